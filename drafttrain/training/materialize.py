"""A training checkpoint as a saved drafter: ``drafttrain eval|export drafter=<run>/checkpoints/step_N``.

A checkpoint (drafttrain.training.checkpoint) holds the trainable weights and the job's config, not a
drafter directory: the frozen embedding is rebuilt from the target and not stored. The drafter is rebuilt
exactly as training built it (the recorded config, the recorded target), the checkpoint's weights are
loaded into it, and it is saved once, atomically, as ``<checkpoint>/drafter`` (a normal saved-drafter
directory that eval, export and the engines read); later calls reuse it.
"""
from __future__ import annotations

from pathlib import Path

from ..io import DraftTrainError
from .checkpoint import STATE, load_drafter_weights, read_checkpoint_meta

DRAFTER_SUBDIR = "drafter"


def is_checkpoint(path) -> bool:
    p = Path(path)
    return (p / STATE).is_file() and (p / "drafter.safetensors").is_file()


def drafter_dir(path) -> Path:
    """``path`` itself for a saved drafter; for a training checkpoint, its drafter (built on first use)."""
    p = Path(path)
    if (p / "config.json").exists() or not is_checkpoint(p):
        return p
    out = p / DRAFTER_SUBDIR
    if (out / "config.json").exists():
        return out
    _materialize(p, out)
    return out


def _materialize(ckpt: Path, out: Path) -> None:
    from omegaconf import OmegaConf

    from ..config import TrainJob
    from ..targets.load import load_target, target_id
    from .loop import make_method

    meta = read_checkpoint_meta(ckpt)
    if not isinstance(meta.get("config"), dict):
        raise DraftTrainError(f"{ckpt / STATE}: no recorded job config (a checkpoint from an older drafttrain?)")
    job = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainJob), meta["config"]))
    print(f"[drafttrain] {ckpt} is a training checkpoint (step {meta.get('step')}): rebuilding its "
          f"{job.method} drafter into {out}", flush=True)
    model, tokenizer, path = load_target(job.target, device="cpu")
    if meta.get("target") and str(meta["target"]) != str(path):
        raise DraftTrainError(f"{ckpt}: trained for target {meta['target']}, which now resolves to {path}")
    method = make_method(job, tokenizer, model)
    drafter = method.build_drafter(model, [], target_id(path))  # d2t/t2d come from the checkpoint
    load_drafter_weights(ckpt, drafter)
    drafter.save_pretrained(out)
