"""train.mixed_precision=bf16: the drafter's forward runs under bf16 autocast while its parameters and the
AdamW moments stay float32 (fp32 master weights: small late updates do not round away). Checked on CPU,
where Accelerate's bf16 autocast works too; the CUDA run is in test_gpu.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from .conftest import REPO, TINY_BUILTIN_OVERRIDES

pytestmark = pytest.mark.slow  # train.py runs in a subprocess

ARGS = [*TINY_BUILTIN_OVERRIDES, "data.num_train=48", "data.regen_max_new_tokens=48", "data.num_eval=3",
        "data.max_length=160", "train.batch_size=4", "train.micro_batch_size=2", "train.max_steps=3",
        "train.warmup_steps=1", "train.save_every=3", "train.eval=false", "eagle3.ttt_steps=2", "logger=none"]


def _train(tmp_path, mp):
    run = tmp_path / mp
    r = subprocess.run([sys.executable, str(REPO / "train.py"), "recipe=eagle3", *ARGS,
                        f"train.mixed_precision={mp}", f"hydra.run.dir={run}"], cwd=REPO, capture_output=True,
                       text=True, timeout=600, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [h["loss"] for h in json.loads((run / "train_metrics.json").read_text())["history"]]
    weights = load_file(run / "final" / "model.safetensors")
    opt = torch.load(run / "checkpoints" / "step_00000003" / "optimizer.pt", weights_only=True)
    moments = [t for s in opt["state"].values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    return losses, weights, moments


def test_bf16_autocast_keeps_fp32_master_weights_and_moments(tmp_path, tiny_builtin_target):
    fp32_losses, _, _ = _train(tmp_path, "no")
    losses, weights, moments = _train(tmp_path, "bf16")
    assert losses != fp32_losses  # the forward really ran in bf16 ...
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, fp32_losses)) < 0.01  # ... and only rounding differs
    floats = {k: v.dtype for k, v in weights.items() if v.is_floating_point()}
    assert floats and set(floats.values()) == {torch.float32}, floats  # fp32 parameters (master weights)
    assert moments and {m.dtype for m in moments} == {torch.float32}  # fp32 AdamW moments
