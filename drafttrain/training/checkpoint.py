"""Training checkpoints: weights, optimizer, scheduler, step and RNG, written atomically.

Layout ``<run>/checkpoints/step_00000100/``:
  drafter.safetensors   trainable weights and buffers of the drafter
  optimizer.pt          optimizer state (tensors and numbers only; loaded with ``weights_only=True``)
  rng.safetensors       torch CPU (and CUDA) RNG states
  state.json            step, method, target, scheduler state, world size, config fingerprint

The data position is the step (see batching.py), so no data-loader state is needed. A checkpoint directory
appears under its final name only when complete (built under a temporary name, then renamed).
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch

from ..io import DraftTrainError, atomic_dir, load_tensors, read_json, save_tensors, torch_load_safe, write_json

STATE = "state.json"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / STATE).exists())


def save_checkpoint(path: Path, drafter, optimizer, scheduler, step: int, meta: dict) -> None:
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"torch_cuda_{i}"] = s
    state = dict(meta)
    state.update(step=step, scheduler=scheduler.state_dict(), python_random=list(random.getstate()[1]))
    with atomic_dir(path) as tmp:
        # the frozen embedding is a copy of the target's: rebuilt from the target, not checkpointed
        weights = {k: v for k, v in drafter.state_dict().items() if not k.endswith("embed_tokens.weight")}
        save_tensors(tmp / "drafter.safetensors", weights)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        save_tensors(tmp / "rng.safetensors", rng)
        write_json(tmp / STATE, state)


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    if keep <= 0:
        return
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    if not resume:
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if path.is_dir() and not (path / STATE).exists():  # a run directory: take its latest checkpoint
        found = list_checkpoints(path)
        if found:
            return found[-1]
    if not (path / STATE).exists():
        raise DraftTrainError(f"train.resume={resume}: not a checkpoint directory (no {STATE})")
    return path


def read_checkpoint_meta(path: Path) -> dict:
    return read_json(Path(path) / STATE)


def check_compatible(meta: dict, expected: dict, path: Path) -> None:
    """Refuse to resume from a checkpoint of another method or another target."""
    for key in ("method", "target"):
        if meta.get(key) != expected.get(key):
            raise DraftTrainError(
                f"train.resume={path}: checkpoint was made for {key}={meta.get(key)!r}, this run has "
                f"{key}={expected.get(key)!r}"
            )


def load_checkpoint(path: Path, drafter, optimizer, scheduler) -> int:
    """Restore weights, optimizer, scheduler and RNG in place; return the step to continue from."""
    path = Path(path)
    meta = read_checkpoint_meta(path)
    state = load_tensors(path / "drafter.safetensors")
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.endswith("embed_tokens.weight")]:
        raise DraftTrainError(f"{path}: weights do not match this drafter (missing {missing}, unexpected {unexpected})")
    optimizer.load_state_dict(torch_load_safe(path / "optimizer.pt"))
    scheduler.load_state_dict(meta["scheduler"])
    rng = load_tensors(path / "rng.safetensors")
    torch.set_rng_state(rng["torch_cpu"])
    if torch.cuda.is_available():
        states = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    random.setstate((3, tuple(meta["python_random"]), None))
    return int(meta["step"])
