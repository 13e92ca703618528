"""recipe=dflash end to end on the tiny built-in target: report (greedy == AR), bit-exact resume, 2 processes (DDP,
ZeRO-2, ZeRO-3) against 1, offline capture against online, a z-lab export evaluated as the drafter it holds."""
from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

from .conftest import REPO, TINY_BUILTIN_OVERRIDES
from .test_distributed import ACC, DATA, LAUNCH, assert_same_curve, history, run_cmd

pytestmark = pytest.mark.slow  # subprocess runs of train.py and the CLI

SMALL = [
    *TINY_BUILTIN_OVERRIDES, *DATA,
    "train.batch_size=4", "train.micro_batch_size=2", "train.lr=3e-3", "train.warmup_steps=2",
    "dflash.block_size=6", "dflash.num_anchors=8", "dflash.num_layers=1",
    "decode.max_new_tokens=24", "decode.num_prompts=3", "decode.num_draft_tokens=4", "decode.sweep_prompts=0",
    "decode.warmup=0", "logger=none", "train.optimizer=adamw",
]


def _train(d, *extra, launcher=None):
    return run_cmd([REPO / "train.py", "recipe=dflash", *SMALL, *extra, f"hydra.run.dir={d}"], launcher=launcher)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_builtin_target):
    d = tmp_path_factory.mktemp("dflash") / "run"
    _train(d, "train.max_steps=6", "train.save_every=3", "train.keep_checkpoints=5")
    return d


def _same_weights(a_path, b_path):
    a, b = load_file(a_path), load_file(b_path)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_report_and_training_metrics(run):
    report = json.loads((run / "report.json").read_text())
    assert report["method"] == "dflash" and report["outputs_match_baseline"] is True
    assert len(report["acceptance_per_position"]) == 4 and report["tau"] >= 1.0
    assert report["train_estimated_tau"] is not None
    hist = history(run)
    assert [h["step"] for h in hist] == list(range(1, 7))
    assert all(f"acc_{k}" in h and f"accept_{k}" in h for h in hist for k in range(5))  # slots 1..5
    assert all(h["accept_1"] <= h["accept_0"] for h in hist)  # a longer right prefix is rarer
    assert hist[-1]["loss"] < hist[0]["loss"]
    cfg = json.loads((run / "final" / "config.json").read_text())
    assert cfg["drafter_type"] == "dflash" and cfg["block_size"] == 6 and cfg["target_layer_ids"] == [1, 2, 3, 4, 5]


def test_resume_is_bit_exact(run, tmp_path):
    run2 = tmp_path / "resumed"
    (run2 / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / "step_00000003", run2 / "checkpoints" / "step_00000003")
    _train(run2, "train.max_steps=6", "train.save_every=3", "train.resume=auto", "train.eval=false")
    _same_weights(run / "final" / "model.safetensors", run2 / "final" / "model.safetensors")
    assert [h["loss"] for h in history(run)[3:]] == [h["loss"] for h in history(run2)]


@pytest.mark.parametrize("config", ["ddp_cpu.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"])
def test_two_processes_match_one(run, tmp_path, config):
    d = tmp_path / config
    _train(d, "train.max_steps=6", "train.eval=false",
           launcher=LAUNCH + ["--config_file", ACC / config, "--num_processes", "2", "--mixed_precision", "no"])
    assert_same_curve(history(run), history(d), rel=2e-3)


def test_offline_capture_trains_as_online(run, tmp_path):
    feats = tmp_path / "feats"
    run_cmd(["-m", "drafttrain.cli", "capture", "method=dflash", *TINY_BUILTIN_OVERRIDES, *DATA,
             "capture.dtype=float32", f"capture.path={feats}", f"hydra.run.dir={tmp_path / 'cap'}"])
    index = json.loads((feats / "index.json").read_text())
    plan = index.get("plan", index)
    assert plan["taps"] == [2, 3, 4, 5, 6] and plan["features"]["taps"] == 5 * 192  # the 5 layers' outputs
    off = tmp_path / "offline"
    _train(off, "train.max_steps=6", "train.eval=false", "capture.mode=offline", f"capture.path={feats}")
    assert_same_curve(history(run), history(off), rel=1e-3)


def test_zlab_export_evaluates_as_the_final_drafter(run, tmp_path):
    out = tmp_path / "zlab"
    run_cmd(["-m", "drafttrain.cli", "export", f"drafter={run / 'final'}", "format=zlab", f"out={out}",
             "dtype=float32", "num_speculative_tokens=4"])
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    ev = tmp_path / "ev"
    run_cmd(["-m", "drafttrain.cli", "eval", f"drafter={out}", *TINY_BUILTIN_OVERRIDES, "data.num_eval=3",
             "decode.num_prompts=3", "decode.max_new_tokens=24", "decode.num_draft_tokens=4", "decode.warmup=0",
             "decode.sweep_prompts=0", f"hydra.run.dir={ev}"], cwd=tmp_path)
    r1, r2 = (json.loads((p / "report.json").read_text()) for p in (run, ev))
    assert r2["method"] == "dflash" and r2["outputs_match_baseline"] is True
    assert r2["tau"] == pytest.approx(r1["tau"]) and r2["acceptance_per_position"] == r1["acceptance_per_position"]


def test_tune_picks_a_draft_length_within_the_block(run, tmp_path):
    """drafttrain tune on a DFlash drafter (decode.method inferred from it): every length up to B - 1 = 5 is
    decoded (its block is 1 + K tokens, so its tau is measured, not predicted) and costed with one draft forward
    per round, and the pick is one of them."""
    run_cmd(["-m", "drafttrain.cli", "tune", f"drafter={run / 'final'}", *TINY_BUILTIN_OVERRIDES, "data.num_eval=3",
             "decode.num_prompts=2", "decode.max_new_tokens=16", "repeats=2", f"hydra.run.dir={tmp_path / 'tune'}"])
    res = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert res["method"] == "dflash" and [r["K"] for r in res["rows"]] == list(range(6))
    assert res["draft_cost_per_token_s"] == 0 and res["draft_cost_per_round_s"] > 0
    assert [m["K"] for m in res["measured_per_k"]] == [1, 2, 3, 4, 5]
    assert [r["tau"] for r in res["rows"][1:]] == [m["tau"] for m in res["measured_per_k"]]
    assert all(m["draft_time_per_round"] > 0 and 1 <= m["tau"] <= m["K"] + 1 for m in res["measured_per_k"])
    assert res["best"]["K"] in range(6)
