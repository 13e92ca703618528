"""bench / tune on the tiny built-in target (fast; a wiring test, not a timed benchmark) and the tuning math."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from drafttrain.evaluation.bench import bench, format_table, tune
from drafttrain.config import DecodeConfig, TreeConfig
from drafttrain.decoding.tune import choose_chain_length, choose_tree_size, expected_tau

from .conftest import REPO, TINY_BUILTIN_OVERRIDES


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add overhead


@pytest.fixture(scope="module")
def tiny(tiny_builtin_target):
    import transformers as tf

    from drafttrain.drafters.eagle3 import Eagle3Drafter

    model = tf.AutoModelForCausalLM.from_pretrained(tiny_builtin_target).eval()
    tok = tf.AutoTokenizer.from_pretrained(tiny_builtin_target)
    cfg = model.config
    torch.manual_seed(0)
    draft = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id)).eval()
    V, L = cfg.vocab_size, cfg.num_hidden_layers
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:256] = True
    drafter = Eagle3Drafter.from_target(model, (2, L // 2, L - 3), torch.zeros(256, dtype=torch.long), t2d).eval()
    g = torch.Generator().manual_seed(0)
    # prompts with repeated spans so prompt lookup finds matches
    prompts = [(lambda b: b + b[:6])(torch.randint(10, V, (10,), generator=g).tolist()) for _ in range(2)]
    return model, tok, draft, drafter, prompts


@pytest.mark.slow
def test_bench_rows_and_identical_outputs(tiny):
    model, tok, draft, drafter, prompts = tiny
    res = bench(model, tok, prompts, drafter=drafter, draft_model=draft, max_new_tokens=12, warmup=0, runs=1,
                methods=("ar", "draft_model", "pld", "pld_tree", "eagle3", "eagle3_tree"),
                num_draft_tokens=3, pld_num_tokens=4, tree=dict(depth=3, top_k=2, total_tokens=6), log=lambda *_: None)
    rows = {r["method"]: r for r in res["rows"]}
    assert list(rows) == ["ar", "draft_model", "pld", "pld tree", "eagle3 chain", "eagle3 tree"]
    for r in rows.values():
        assert r["outputs_identical_to_hf"] and r["outputs_identical_to_ar"], r["method"]
        assert r["ours_tokens_per_s"] > 0 and r["hf_tokens_per_s"] > 0
        assert r["ratio_ours_hf"] == pytest.approx(r["ours_tokens_per_s"] / r["hf_tokens_per_s"])
        assert r["ratio_paired_median"] == pytest.approx(r["ours_runs_tokens_per_s"][0] / r["hf_runs_tokens_per_s"][0])
        assert r["ours_tau"] >= 1.0
    assert rows["ar"]["ours_tau"] == 1.0 and rows["ar"]["hf_tau"] == pytest.approx(1.0)  # one forward per token
    assert rows["draft_model"]["hf"].startswith("generate(assistant_model")
    assert rows["pld"]["hf"] == "generate(prompt_lookup_num_tokens=4)"
    table = format_table(res)
    assert table.count("\n") == 1 + len(rows) and "eagle3 tree (depth 3, top-k 2, 6 nodes)" in table


def test_expected_tau_and_chain_choice():
    acc = [0.8, 0.5, 0.5, 0.0]
    assert expected_tau(acc, 0) == 1.0
    assert expected_tau(acc, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert expected_tau(acc, 4) == expected_tau(acc, 3)  # a position never accepted adds nothing
    assert expected_tau([None], 1) == 1.0
    verify = {n: 1.0 + 0.1 * n for n in range(1, 6)}
    # cheap drafts: the longest useful chain wins; expensive drafts: plain decoding wins
    cheap = choose_chain_length(acc, verify, draft_cost_per_token=0.01, other_cost_per_round=0.0, max_k=4)
    assert cheap["best"]["K"] == 3 and [r["K"] for r in cheap["rows"]] == [0, 1, 2, 3, 4]
    assert cheap["best"]["speedup_vs_ar"] == pytest.approx(
        (2.4 / (1.4 + 0.03)) / (1 / 1.1))
    dear = choose_chain_length(acc, verify, draft_cost_per_token=5.0, other_cost_per_round=0.0, max_k=4)
    assert dear["best"]["K"] == 0
    trees = choose_tree_size([{"total_tokens": 8, "tau": 2.0, "draft_time_per_round": 0.1, "nodes_per_round": 8},
                              {"total_tokens": 32, "tau": 2.2, "draft_time_per_round": 0.1, "nodes_per_round": 32}],
                             {9: 1.0, 33: 2.0}, 0.0, ar_round_time=0.9)
    assert trees["best"]["total_tokens"] == 8


@pytest.mark.slow
def test_tune_chain_and_tree(tiny):
    model, tok, draft, drafter, prompts = tiny
    from drafttrain.decoding import Eagle3TreeProposer, PromptLookupProposer

    dec = DecodeConfig(method="pld")
    res = tune(model, tok, prompts, PromptLookupProposer(num_tokens=10), dec, method="pld", max_draft_tokens=3,
               max_new_tokens=10, repeats=1, log=lambda *_: None)
    assert res["kind"] == "chain" and [r["K"] for r in res["rows"]] == [0, 1, 2, 3]
    assert res["best"] in res["rows"] and res["overrides"]
    assert all(r["tau"] >= 1 for r in res["rows"]) and set(res["verify_cost_s"]) == {"1", "2", "3", "4"}
    dec = DecodeConfig(method="eagle3", tree=TreeConfig(enabled=True, depth=3, top_k=2, total_tokens=6))
    L = model.config.num_hidden_layers
    prop = Eagle3TreeProposer(drafter, max_len=128, depth=3, top_k=2, total_tokens=6)
    res = tune(model, tok, prompts, prop, dec, taps=(2, L // 2, L - 3), method="eagle3", max_draft_tokens=1,
               tree_sizes=(2, 4), max_new_tokens=8, repeats=1, log=lambda *_: None)
    assert res["kind"] == "tree" and [r["total_tokens"] for r in res["rows"]] == [2, 4]
    assert res["overrides"][0].startswith("decode.tree.total_tokens=")


@pytest.mark.slow
def test_bench_cli_writes_table(tiny_builtin_target, tmp_path):
    """`drafttrain bench` end to end (ar and pld rows only, to stay fast): bench.json and bench.md."""
    env = dict(os.environ, DRAFTTRAIN_CACHE=str(tiny_builtin_target.parent), OMP_NUM_THREADS="1")
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "drafttrain.cli", "bench", *TINY_BUILTIN_OVERRIDES, "methods=[ar,pld]",
           "decode.draft_model=null", "decode.num_prompts=2", "decode.max_new_tokens=8", "decode.repeats=1",
           "decode.warmup=0", "data.num_eval=2",
           "threads=1", f"hydra.run.dir={out}"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((out / "bench.json").read_text())
    assert [r["method"] for r in res["rows"]] == ["ar", "pld"]
    assert all(r["outputs_identical_to_hf"] for r in res["rows"])
    assert "| ar |" in (out / "bench.md").read_text()
