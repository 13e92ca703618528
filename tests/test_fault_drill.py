"""The fault drill: a long job killed (SIGKILL) at a chosen write, or whose writer hits a full disk (ENOSPC),
then rerun. The result equals an uninterrupted run bit for bit, or the job refuses in one line and nothing the
user had is changed.

Faults are injected by wrapping the one atomic writer (drafttrain.io.atomic_path) in the job's own process
(``_job``): when the final path of a write contains ``at``, the ``nth`` such write either kills the process
after half of the file is written (``kill``), or raises ENOSPC there (``enospc``). Cases: train (eagle3:
ENOSPC on a checkpoint, then resume; SIGKILL while writing a checkpoint, then resume), capture (ENOSPC on a
shard, then rerun), export (SIGKILL while writing, then rerun; ENOSPC over an earlier export), train of
medusa / medusa2 / draft_model / dflash (SIGKILL while checkpointing, then resume), build-target (SIGKILL before the build
is in place, then rerun). Kills at arbitrary moments: tests/test_reliability.py (train, capture).""" 
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import REPO, TINY_BUILTIN_OVERRIDES

pytestmark = pytest.mark.slow

FAULT = r'''
import contextlib, errno, os, signal, sys
import drafttrain.io as io
at, kind, nth = os.environ["FAULT_AT"], os.environ["FAULT_KIND"], int(os.environ.get("FAULT_NTH", "1"))
seen = [0]
real = io.atomic_path

@contextlib.contextmanager
def faulty(path):
    with real(path) as tmp:
        yield tmp
        if at in str(path):
            seen[0] += 1
            if seen[0] == nth:
                size = os.path.getsize(tmp)
                with open(tmp, "r+b") as f:
                    f.truncate(size // 2)  # half of the file is on disk
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

io.atomic_path = faulty
from drafttrain.cli import main
main(sys.argv[1:])
'''

TRAIN = [*TINY_BUILTIN_OVERRIDES, "recipe=eagle3", "data.num_train=24", "data.regen_max_new_tokens=32",
         "data.num_eval=2", "data.max_length=128", "train.batch_size=4", "train.micro_batch_size=2", "train.lr=3e-3",
         "train.warmup_steps=2", "eagle3.ttt_steps=2", "train.eval=false", "logger=none", "train.max_steps=6",
         "train.save_every=2", "train.keep_checkpoints=2"]


def _job(args, cwd, at=None, kind="enospc", nth=1, timeout=600, extra_env=None):
    env = dict(os.environ, **(extra_env or {}))
    if at is None:
        cmd = [sys.executable, "-m", "drafttrain.cli", *args]
    else:
        env.update(FAULT_AT=at, FAULT_KIND=kind, FAULT_NTH=str(nth))
        cmd = [sys.executable, "-c", FAULT, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def _one_error_line(r):
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return err[0]


def _files(d: Path) -> dict[str, str]:
    """Every file under ``d`` (relative name -> sha256), temporary names included."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def _same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_builtin_target) -> Path:
    run = tmp_path_factory.mktemp("drill") / "reference"
    r = _job(["train", *TRAIN, f"hydra.run.dir={run}"], REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def test_train_checkpoint_on_a_full_disk_then_resume(tmp_path, reference):
    run = tmp_path / "run"
    r = _job(["train", *TRAIN, f"hydra.run.dir={run}"], REPO, at="step_00000004")
    line = _one_error_line(r)
    assert "checkpoints/step_00000004: cannot write it" in line and "No space left on device" in line
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_00000002"], ckpts  # the previous checkpoint intact, nothing half-written beside it
    kept = run / "checkpoints" / "step_00000002"
    assert json.loads((kept / "state.json").read_text())["step"] == 2 and load_file(kept / "drafter.safetensors")
    assert not (run / "final").exists()
    r = _job(["train", *TRAIN, "train.resume=auto", f"hydra.run.dir={run}"], REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step_00000002" in r.stdout
    assert _same_weights(reference / "final" / "model.safetensors", run / "final" / "model.safetensors")


def test_train_killed_while_writing_a_checkpoint_then_resume(tmp_path, reference):
    run = tmp_path / "run"
    r = _job(["train", *TRAIN, f"hydra.run.dir={run}"], REPO, at="step_00000004", kind="kill")
    assert r.returncode == -9, (r.returncode, r.stderr[-2000:])
    names = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert names == ["step_00000002"], names  # the killed checkpoint never appears under its final name
    r = _job(["train", *TRAIN, f"hydra.run.dir={run}"], REPO)  # the same command, no resume: refused
    assert "holds an earlier train run" in _one_error_line(r)
    r = _job(["train", *TRAIN, "train.resume=auto", f"hydra.run.dir={run}"], REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _same_weights(reference / "final" / "model.safetensors", run / "final" / "model.safetensors")


CAPTURE = [*TINY_BUILTIN_OVERRIDES, "data.num_train=24", "data.regen_max_new_tokens=32", "data.num_eval=2",
           "data.max_length=128", "capture.dtype=float32", "capture.shard_mb=0.5"]


def test_capture_shard_on_a_full_disk_then_rerun(tmp_path, tiny_builtin_target):
    from drafttrain.capture.store import FeatureStore

    ref, feats = tmp_path / "ref", tmp_path / "feats"
    r = _job(["capture", *CAPTURE, f"capture.path={ref}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(list(ref.glob("shard-*.safetensors"))) >= 2
    r = _job(["capture", *CAPTURE, f"capture.path={feats}"], tmp_path, at="shard-00001.safetensors")
    line = _one_error_line(r)
    assert "shard-00001.safetensors: cannot write it" in line and "No space left on device" in line
    assert not list(feats.glob("shard-00001*")) and not list(feats.glob(".*tmp"))
    before = _files(feats)
    assert (feats / "shard-00000.safetensors").exists()
    r = _job(["capture", *CAPTURE, f"capture.path={feats}"], tmp_path)  # rerun: resumes after shard 0
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(_files(feats)[k] == v for k, v in before.items() if k.startswith("shard-00000"))
    a, b = FeatureStore(ref, verify="full"), FeatureStore(feats, verify="full")
    assert [x["sha256"] for x in a.records] == [x["sha256"] for x in b.records]


def test_export_killed_then_rerun_and_full_disk_over_an_earlier_export(tmp_path, reference):
    drafter = reference / "final"
    ref, out = tmp_path / "ref", tmp_path / "out"
    r = _job(["export", f"drafter={drafter}", "format=vllm", f"out={ref}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _job(["export", f"drafter={drafter}", "format=vllm", f"out={out}"], tmp_path, at="model.safetensors",
             kind="kill")
    assert r.returncode == -9 and not out.exists()  # never a half export under the final name
    r = _job(["export", f"drafter={drafter}", "format=vllm", f"out={out}"], tmp_path)  # the same command again
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = _files(out), _files(ref)
    assert a.pop("README.md") and b.pop("README.md")  # the model card names its own folder in the serve lines
    assert a == b
    # a second export over it that runs out of room: one line, the earlier export unchanged
    before, stale = _files(out), sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out."))
    r = _job(["export", f"drafter={drafter}", "format=sglang", f"out={out}", "overwrite=true"], tmp_path,
             at="model.safetensors")
    line = _one_error_line(r)
    assert str(out) in line and "No space left on device" in line
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")) == stale  # nothing left behind
    r = _job(["export", f"drafter={drafter}", "format=vllm", f"out={out}"], tmp_path)  # still refused: not empty
    assert "directory is not empty" in _one_error_line(r) and _files(out) == before
    assert json.loads((out / "config.json").read_text())


# the other families' train jobs: killed while writing the step-4 checkpoint, then resumed -> the uninterrupted
# run's final drafter, bit for bit
FAMILIES = {
    "medusa": ["recipe=medusa", "medusa.num_heads=2"],
    "draft_model": ["recipe=draft_model"],
    "dflash": ["recipe=dflash", "dflash.block_size=4", "dflash.num_anchors=4"],
    "medusa2": ["recipe=medusa2", "medusa.num_heads=2", "medusa.lora.r=4", "medusa.lora.target_modules=[q_proj,v_proj]"],
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_resumes_a_killed_checkpoint_bit_for_bit(family, tmp_path, tiny_builtin_target):
    args = [a for a in TRAIN if not a.startswith(("recipe=", "eagle3."))] + FAMILIES[family] + ["train.optimizer=adamw"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    r = _job(["train", *args, f"hydra.run.dir={ref}"], REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _job(["train", *args, f"hydra.run.dir={run}"], REPO, at="step_00000004", kind="kill")
    assert r.returncode == -9, (r.returncode, r.stderr[-2000:])
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_00000002"]
    r = _job(["train", *args, "train.resume=auto", f"hydra.run.dir={run}"], REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    tensors = sorted(p.relative_to(ref) for p in (ref / "final").rglob("*.safetensors"))  # medusa2: heads + adapter
    assert tensors and all(_same_weights(ref / t, run / t) for t in tensors), tensors


def test_build_target_killed_then_rebuilt_identically(tmp_path):
    """build-target killed while writing the build's record (the model and tokenizer already in its temporary
    folder): nothing under the final name; the rerun builds the same files as an uninterrupted build."""
    spec = ["target.builtin.steps=4", "target.builtin.max_files=8", "target.builtin.eval_batches=1"]
    env_a, env_b = tmp_path / "a", tmp_path / "b"

    def build(cache, at=None, kind="kill"):
        return _job(["build-target", *spec], tmp_path, at=at, kind=kind, extra_env={"DRAFTTRAIN_CACHE": str(cache)})

    assert build(env_a).returncode == 0
    r = build(env_b, at="drafttrain_builtin.json")
    assert r.returncode == -9
    assert not [p for p in env_b.glob("builtin-target-*") if not p.name.startswith(".")]  # no half build
    assert build(env_b).returncode == 0
    (a,), (b,) = [[p for p in e.glob("builtin-target-*") if p.is_dir() and not p.name.startswith(".")]
                  for e in (env_a, env_b)]
    fa, fb = _files(a), _files(b)
    fa.pop("drafttrain_builtin.json"), fb.pop("drafttrain_builtin.json")  # it records the build's seconds
    assert fa == fb
