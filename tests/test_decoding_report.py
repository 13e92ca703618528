"""evaluate(): report.json keys for chains and trees (per-depth acceptance, draft shape, verification rule, lossy
label), acceptance.png and the measured speedup-vs-draft-length sweep (speedup.png); make_proposer's methods."""
from __future__ import annotations

import json

import pytest
import torch

from drafttrain.config import DecodeConfig, TreeConfig
from drafttrain.decoding.build import draft_depth, make_proposer, medusa_choices_for
from drafttrain.evaluation import evaluate
from drafttrain.io import DraftTrainError


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add overhead


@pytest.fixture(scope="module")
def tiny(tiny_builtin_target):
    import transformers as tf

    from drafttrain.drafters.eagle3 import Eagle3Drafter
    from drafttrain.drafters.medusa import MedusaHeads

    model = tf.AutoModelForCausalLM.from_pretrained(tiny_builtin_target).eval()
    tok = tf.AutoTokenizer.from_pretrained(tiny_builtin_target)
    V, L = model.config.vocab_size, model.config.num_hidden_layers
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:256] = True
    torch.manual_seed(0)
    drafter = Eagle3Drafter.from_target(model, (2, L // 2, L - 3), torch.zeros(256, dtype=torch.long), t2d).eval()
    heads = MedusaHeads.from_target(model, num_heads=3).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [(lambda b: b + b[:5])(torch.randint(10, V, (8,), generator=g).tolist()) for _ in range(2)]
    return model, tok, drafter, heads, prompts


def _decode(**kw):
    tree = kw.pop("tree", {})
    return DecodeConfig(max_new_tokens=10, num_prompts=2, warmup=0, sweep_prompts=2, tree=TreeConfig(**tree), **kw)


def _run(tiny, tmp_path, method, decode, drafter=None, taps=None):
    model, tok, *_ = tiny
    prop = make_proposer(method, drafter=drafter, decode=decode, max_len=128)
    return evaluate(model, tok, tiny[4], prop, decode, tmp_path, method=method, target_name="tiny",
                    drafter_name=None, taps=taps), prop


@pytest.mark.slow
def test_report_chain_with_sweep_and_plots(tiny, tmp_path):
    decode = _decode(method="pld", num_draft_tokens=3, sweep=[1, 3])
    rep, _ = _run(tiny, tmp_path, "pld", decode)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["method"] == "pld" and on_disk["acceptance_unit"] == "position"
    assert rep["outputs_match_baseline"] is True and rep["verification"].startswith("greedy")
    assert rep["draft_chain"] == {"kind": "chain", "num_draft_tokens": 3} and rep["lossy"] is False
    for i, a in enumerate(on_disk["acceptance_per_position"]):  # the live counts, beside the verifier's own
        assert a == on_disk["live_accepted_per_position"][i] / on_disk["live_reached_per_position"][i]
        assert on_disk["live_reached_per_position"][i] <= on_disk["reached_per_position"][i]
    assert [s["draft_tokens"] for s in rep["sweep"]] == [1, 3]
    assert all(s["speedup"] > 0 and s["tau"] >= 1 for s in rep["sweep"])
    c = on_disk["draft_cost_ratio"]  # the drafter's seconds per draft token over the target's per verify forward
    assert c == pytest.approx(rep["time_draft_s"] / (3 * rep["time_target_s"]))
    assert on_disk["predicted_speedup"] == pytest.approx(rep["tau"] / (1 + 3 * c))
    for s in on_disk["sweep"]:  # the prediction beside every measured draft length, and the sweep's sample
        assert s["predicted_speedup"] == pytest.approx(s["tau"] / (1 + s["draft_tokens"] * c))
        assert s["prompts"] == 2 and 0 < s["new_tokens"] <= 2 * 10
    assert rep["frac_target"] + rep["frac_draft"] + rep["frac_other"] == pytest.approx(1.0)
    for png in ("acceptance.png", "speedup.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_report_trees_per_depth(tiny, tmp_path):
    model, tok, drafter, heads, prompts = tiny
    L = model.config.num_hidden_layers
    decode = _decode(method="eagle3", sweep=[], tree=dict(enabled=True, depth=3, top_k=2, total_tokens=5))
    rep, prop = _run(tiny, tmp_path, "eagle3", decode, drafter=drafter, taps=(2, L // 2, L - 3))
    assert prop.tree and draft_depth(prop, decode) == 3
    assert rep["acceptance_unit"] == "depth" and rep["acceptance_per_depth"] == rep["acceptance_per_position"]
    assert len(rep["acceptance_per_depth"]) == 3 and rep["outputs_match_baseline"] is True
    assert rep["draft_tree"]["top_k"] == 2 and rep["draft_tree"]["total_tokens"] == 5
    assert 1 <= rep["nodes_per_round"] <= 5 and rep["sweep"] == [] and not (tmp_path / "speedup.png").exists()
    # medusa: chain and static tree (the tree from the drafter's measured accuracy when it has one)
    decode = _decode(method="medusa", num_draft_tokens=2, sweep=[])
    rep, prop = _run(tiny, tmp_path, "medusa", decode, drafter=heads, taps=(L,))
    assert prop.name == "medusa" and rep["outputs_match_baseline"] is True
    decode = _decode(method="medusa", sweep=[], tree=dict(enabled=True, total_tokens=4))
    heads.head_topk_accuracy = [[0.5, 0.2], [0.3, 0.1], [0.2, 0.1]]
    assert medusa_choices_for(heads, decode) == [[0], [1], [0, 0], [1, 0]]
    rep, prop = _run(tiny, tmp_path, "medusa", decode, drafter=heads, taps=(L,))
    del heads.head_topk_accuracy
    assert prop.structure.choices == [[0], [1], [0, 0], [1, 0]] and rep["draft_tree"]["medusa_choices"]
    assert rep["outputs_match_baseline"] is True
    # the oracle tree: tau = depth + 1 on full rounds
    decode = _decode(method="oracle", sweep=[], tree=dict(enabled=True, depth=4, top_k=3))
    rep, _ = _run(tiny, tmp_path, "oracle", decode)
    assert rep["outputs_match_baseline"] is True and rep["acceptance_per_depth"][0] in (1.0, None)


@pytest.mark.slow
def test_report_typical_acceptance_is_labelled_lossy(tiny, tmp_path):
    model, tok, drafter, heads, prompts = tiny
    L = model.config.num_hidden_layers
    decode = _decode(method="medusa", temperature=0.8, typical_acceptance=True, sweep=[],
                     tree=dict(enabled=True, total_tokens=6))
    rep, _ = _run(tiny, tmp_path, "medusa", decode, drafter=heads, taps=(L,))
    assert rep["lossy"] is True and "LOSSY" in rep["verification"] and rep["outputs_match_baseline"] is None
    decode = _decode(method="medusa", temperature=0.8, sweep=[], tree=dict(enabled=True, total_tokens=6))
    rep, _ = _run(tiny, tmp_path, "medusa", decode, drafter=heads, taps=(L,))
    assert rep["lossy"] is False and rep["verification"] == "rejection sampling (lossless)"


def test_make_proposer_errors():
    with pytest.raises(DraftTrainError):
        make_proposer("medusa", decode=_decode(method="medusa"))
    with pytest.raises(DraftTrainError):
        make_proposer("nonsense", decode=_decode())


@pytest.mark.slow
def test_compiled_eval_compiles_nothing_while_timing(tiny, tmp_path, monkeypatch):
    """With decode.compile the warm-up decodes every prompt (AR and speculative) once, so every graph the
    timed pass needs already exists: no generate() after the warm-up triggers a compilation."""
    from torch._dynamo.utils import counters

    from drafttrain.decoding import SpecDecoder

    frames, orig = [], SpecDecoder.generate

    def counted(self, *a, **kw):
        before = counters["stats"]["unique_graphs"]
        out = orig(self, *a, **kw)
        frames.append(counters["stats"]["unique_graphs"] - before)
        return out

    monkeypatch.setattr(SpecDecoder, "generate", counted)
    model, tok, *_ = tiny
    prompts = [tiny[4][0], tiny[4][1][:6]]  # 13 and 6 tokens: prefill buckets 16 and 8
    decode = _decode(method="pld", num_draft_tokens=3, static_shapes=True, compile=True, buckets=[1, 4, 8, 16])
    decode.warmup, decode.sweep_prompts = 1, 0
    rep = evaluate(model, tok, prompts, make_proposer("pld", decode=decode, max_len=128), decode, tmp_path,
                   method="pld", target_name="tiny", drafter_name=None)
    assert rep["outputs_match_baseline"] is True
    warm = 2 * len(prompts)
    assert sum(frames[:warm]) > 0 and frames[warm:] == [0] * (len(frames) - warm), frames


def _res(n_tokens, seconds):
    from drafttrain.decoding.engine import GenerationResult

    return GenerationResult(tokens=[0] * n_tokens, num_rounds=n_tokens, num_round_tokens=n_tokens,
                            time_total=seconds)


def test_speedup_spread_per_pass_and_the_noisy_baseline_flag():
    from drafttrain.evaluation.report import NOISY_BASELINE, speedup_spread

    # two passes over two prompts: AR 10 tokens/s in pass 1, 8 in pass 2; speculative 20 and 12
    ar = [_res(10, 1.0), _res(10, 1.0), _res(8, 1.0), _res(8, 1.0)]
    sp = [_res(10, 0.5), _res(10, 0.5), _res(12, 1.0), _res(12, 1.0)]
    s = speedup_spread(ar, sp, n_prompts=2)
    assert s["speedup_spread_over"] == "passes"
    assert s["speedup_per_pass"] == pytest.approx([2.0, 1.5])
    assert (s["speedup_min"], s["speedup_median"], s["speedup_max"]) == pytest.approx((1.5, 1.75, 2.0))
    assert s["baseline_spread"] == pytest.approx(2 / 9) and s["baseline_spread"] > NOISY_BASELINE
    assert s["speedup_noisy"] is True
    # one pass: the spread is over prompts; a steady baseline is not flagged
    s = speedup_spread(ar[:2], [_res(10, 0.5), _res(10, 0.4)], n_prompts=2)
    assert s["speedup_spread_over"] == "prompts" and s["speedup_per_pass"] == []
    assert (s["speedup_min"], s["speedup_max"]) == pytest.approx((2.0, 2.5))
    assert s["baseline_spread"] == 0 and s["speedup_noisy"] is False


def test_the_table_prints_the_spread_beside_the_speedup(capsys):
    from drafttrain.evaluation.report import _spread_note

    note = _spread_note({"speedup_min": 1.5, "speedup_max": 2.0, "speedup_median": 1.75, "baseline_spread": 0.22,
                         "speedup_noisy": True, "speedup_spread_over": "passes"})
    assert note == " (passes: 1.50-2.00, median 1.75; AR varied 22% between passes: a noisy machine, raise " \
                   "decode.repeats)"
    assert _spread_note({"speedup_min": None}) == ""
