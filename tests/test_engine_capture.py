"""The engine tier, capture: ``drafttrain capture capture.backend=vllm`` (vLLM's ``extract_hidden_states`` in the
engine venv) against ``capture.backend=hf`` on the same rows, for real.

The rows: conversations of very different lengths (a few tokens to ~240), captured in batches of 8 by both
backends (vLLM prefills up to 8 rows together: the batch > 1 case where speculators #279 found silently wrong
states). Per token, the three stored taps and the last hidden state agree within ``REL`` of that token's
largest HF value: both sides are fp32, but vLLM runs its own kernels (fused residual-add + RMSNorm, its CPU
attention and GEMMs, other reduction orders), so they differ by rounding only (measured ~1e-6 relative;
bench/notebook/capture_vllm.md). A tap one layer off differs by ~10% or more, which the test checks too (the tolerance
bites). Then: a rerun after losing one shard recomputes only that shard, and an EAGLE-3 trained from either
store follows the same loss curve. Target: the engine tier's built-in variant (tests/test_engine_vllm.py SPEC:
vLLM's CPU attention needs a head size of 32, not the default 48).
"""
from __future__ import annotations

import json

import pytest
import torch

from drafttrain.engines.vllm_check import engine_python, engine_venv

from .conftest import REPO
from .test_engine_vllm import SPEC, TARGET

pytestmark = [pytest.mark.engine, pytest.mark.slow,
              pytest.mark.skipif(engine_python() is None,
                                 reason=f"no engine venv at {engine_venv()} (scripts/make_engine_venv.sh builds it)")]

REL = 1e-4  # per token: max |vllm - hf| <= REL * max(1, max |hf|) over the hidden dimension
# assistant answers cut to these many characters: rows from a few tokens to data.max_length, short and long
# interleaved so that every shard (one vLLM batch) mixes lengths
CUTS = [1, 2000, 4, 1000, 12, 800, 30, 600, 60, 450, 100, 330, 160, 240]
DATA = ["data.max_length=240", "data.num_eval=2"]
CAPTURE = ["capture.dtype=float32", "capture.batch_size=8", "capture.shard_mb=1.6"]
TRAIN = ["recipe=eagle3", "eagle3.ttt_steps=2", "eagle3.fc_norm=false", "eagle3.norm_output=false", "logger=none",
         "train.eval=false", "train.max_steps=6", "train.batch_size=4", "train.micro_batch_size=2", "train.lr=3e-3",
         "train.warmup_steps=1", "train.log_every=1", "train.save_every=100", "capture.mode=offline",
         "capture.verify=full"]


def _chats(path) -> None:
    from drafttrain.data.builtin import builtin_conversations

    convs = builtin_conversations("draft", 2 * len(CUTS), 0)
    long = [c for c in convs if len(c.messages[1]["content"]) >= 400][: len(CUTS)]
    rows = []
    for c, n in zip(long + convs, CUTS + CUTS[:2]):
        user, answer = c.messages[0]["content"], c.messages[1]["content"]
        rows.append({"messages": [{"role": "user", "content": user if n >= 60 else user[: n + 3]},
                                  {"role": "assistant", "content": ((answer.strip() + "\n") * 8)[:n]}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _cli(args):
    from .test_distributed import run_cmd

    return run_cmd(["-m", "drafttrain.cli", "capture", *TARGET, *args])


@pytest.fixture(scope="module")
def stores(tmp_path_factory, cache_dir):
    from drafttrain.targets.builtin import BuiltinSpec, ensure_builtin_target

    torch.set_num_threads(1)
    target = ensure_builtin_target(BuiltinSpec(**SPEC), quiet=True)
    root = tmp_path_factory.mktemp("engine-capture")
    _chats(root / "chats.jsonl")
    data = ["data.source=jsonl", f"data.path={root / 'chats.jsonl'}", *DATA]
    _cli([*data, *CAPTURE, f"capture.path={root / 'hf'}"])
    r = _cli([*data, *CAPTURE, "capture.backend=vllm", f"capture.path={root / 'vllm'}"])
    return {"target": target, "root": root, "data": data, "hf": root / "hf", "vllm": root / "vllm", "log": r.stdout}


def _rel_errors(a, b, name: str) -> torch.Tensor:
    """Per token of every example: max |b - a| / max(1, max |a|) over the feature's width."""
    out = []
    for i in range(len(a)):
        x, y = a.feature(i, name).float(), b.feature(i, name).float()
        out.append((y - x).abs().amax(-1) / x.abs().amax(-1).clamp_min(1.0))
    return torch.cat(out)


def test_vllm_capture_equals_hf_capture_per_token(stores):
    from drafttrain.capture.store import FeatureStore

    hf, vl = FeatureStore(stores["hf"], verify="full"), FeatureStore(stores["vllm"], verify="full")
    assert vl.plan == hf.plan  # same data fingerprint, taps, features, shard plan
    assert vl.examples() == hf.examples()
    lengths = [len(ex["input_ids"]) for ex in hf.examples()]
    assert min(lengths) <= 12 and max(lengths) >= 200, lengths  # very different lengths ...
    print(f"row lengths {sorted(lengths)}, shards {hf.plan['shards']}")
    shards = hf.plan["shards"]  # ... several rows of different lengths in each vLLM batch
    assert len(shards) >= 2 and all(e - s >= 3 and len(set(lengths[s:e])) >= 2 for s, e in shards), (shards, lengths)
    assert all(max(lengths[s:e]) > 4 * min(lengths[s:e]) for s, e in shards[:2]), (shards, lengths)
    assert sorted(hf.features) == ["last_hidden", "taps"]
    worst = {}
    for name in hf.features:
        err = _rel_errors(hf, vl, name)
        worst[name] = float(err.max())
        assert err.numel() == hf.num_tokens and worst[name] <= REL, (name, worst[name], int(err.argmax()))
    print(f"vLLM vs HF capture, max per-token relative error over {hf.num_tokens} tokens: {worst}")
    (stores["root"] / "errors.json").write_text(json.dumps(worst))


def test_the_tolerance_bites_on_a_tap_one_layer_off(stores):
    """vLLM's taps against HF ``hidden_states`` one index later: far outside the tolerance."""
    from drafttrain.capture.store import FeatureStore
    from drafttrain.config import TargetConfig
    from drafttrain.targets.load import load_target

    vl = FeatureStore(stores["vllm"])
    model, _, _ = load_target(TargetConfig(name_or_path=str(stores["target"]), dtype="float32"))
    H, taps = model.config.hidden_size, vl.plan["taps"]
    errs = []
    for i, ex in enumerate(vl.examples()):
        with torch.no_grad():
            hs = model(input_ids=torch.tensor([ex["input_ids"]]), output_hidden_states=True).hidden_states
        got, right = vl.feature(i, "taps").float(), torch.cat([hs[t][0] for t in taps], -1)
        shifted = torch.cat([hs[t + 1][0] for t in taps], -1)
        assert got.shape == shifted.shape == (len(ex["input_ids"]), 3 * H)
        errs.append((got - shifted).abs().amax(-1) / shifted.abs().amax(-1).clamp_min(1))
        assert float(((got - right).abs().amax(-1) / right.abs().amax(-1).clamp_min(1)).max()) <= REL  # unpadded too
    smallest = float(torch.cat(errs).min())
    print(f"taps one layer off: smallest per-token relative error {smallest:.3g} (tolerance {REL})")
    assert smallest > 100 * REL, smallest


def test_a_rerun_recaptures_only_the_lost_shard(stores):
    from safetensors.torch import load_file

    from drafttrain.capture import store as S
    from drafttrain.capture.store import FeatureStore

    out = stores["vllm"]
    n = len(FeatureStore(out).records)
    before = {k: (out / S.shard_name(k)).stat().st_mtime_ns for k in range(n)}
    old = load_file(out / S.shard_name(1))
    (out / S.record_name(1)).unlink()
    (out / S.shard_name(1)).unlink()
    (out / S.INDEX).unlink()
    r = _cli([*stores["data"], *CAPTURE, "capture.backend=vllm", f"capture.path={out}"])
    assert f"this rank wrote 1 shards, reused {n - 1}" in r.stdout, r.stdout[-2000:]
    assert "on 1 of 1 shards still to write" in r.stdout, r.stdout[-2000:]
    after = {k: (out / S.shard_name(k)).stat().st_mtime_ns for k in range(n)}
    assert {k: v for k, v in after.items() if k != 1} == {k: v for k, v in before.items() if k != 1}
    new = FeatureStore(out, verify="full")
    assert len(new.records) == n and not (out / ".vllm-work").exists()
    got = load_file(out / S.shard_name(1))
    assert got.keys() == old.keys() and all(torch.equal(got[k], old[k]) for k in got)  # vLLM is deterministic


def test_eagle3_trains_the_same_from_either_store(stores):
    from .test_distributed import assert_same_curve, history, run_cmd

    runs = {}
    for name in ("hf", "vllm"):
        runs[name] = stores["root"] / f"train-{name}"
        run_cmd([REPO / "train.py", *TARGET, *stores["data"], *TRAIN, f"capture.path={stores[name]}",
                 f"hydra.run.dir={runs[name]}"])
    a, b = history(runs["hf"]), history(runs["vllm"])
    assert len(a) == 6 and a[-1]["loss"] < a[0]["loss"], a  # it trains
    gap = assert_same_curve(a, b, rel=1e-3)
    print(f"EAGLE-3 from the HF store vs the vLLM store: losses {[round(h['loss'], 5) for h in a]} vs "
          f"{[round(h['loss'], 5) for h in b]}, max relative gap {gap:.2e}")
    (stores["root"] / "curves.json").write_text(json.dumps({"hf": a, "vllm": b, "gap": gap}))
