"""Saved drafters as eval and export read them: a training checkpoint as a drafter directory
(:func:`drafter_dir`) and a saved Medusa-1 / Medusa-2 drafter with the target it verifies with
(:func:`load_medusa`).

``drafttrain eval|export drafter=<run>/checkpoints/step_N``: a checkpoint (drafttrain.training.checkpoint)
holds the trainable weights and the job's config, not a drafter directory: the frozen embedding is rebuilt
from the target and not stored. The drafter is rebuilt exactly as training built it (the recorded config,
the recorded target), the checkpoint's weights are loaded into it, and it is saved once, atomically, as
``<checkpoint>/drafter`` (a normal saved-drafter directory that eval, export and the engines read); later
calls reuse it. Telling a checkpoint apart (its state file) and rebuilding its drafter (the training method's
``build_drafter``) use ``drafttrain.training``, imported only then: a saved drafter directory never imports it.
"""
from __future__ import annotations

import os
from pathlib import Path

from .drafters.medusa import MEDUSA2_TYPE, MedusaHeads
from .io import DraftTrainError, read_json
from .lora import load_lora

__all__ = ["DRAFTER_SUBDIR", "is_checkpoint", "drafter_dir", "load_medusa"]

DRAFTER_SUBDIR = "drafter"


# ------------------------------------------------------------------------------------------ checkpoints
def is_checkpoint(path) -> bool:
    from .training.checkpoint import STATE

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

    from .config import TrainJob
    from .targets.load import load_target, target_id
    from .training.checkpoint import STATE, load_drafter_weights, read_checkpoint_meta
    from .training.loop import make_method

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


# ------------------------------------------------------------------------------------------ Medusa
def load_medusa(path: str | os.PathLike, target_model, device=None):
    """Load a saved Medusa-1 or Medusa-2 drafter for decoding.

    Returns ``(target to verify with, heads, info)``; for Medusa-2 the target is ``target_model`` with the
    saved LoRA adapter merged in (in place), and ``info["target_modified"]`` is True. ``info`` also carries
    the saved ``medusa_choices`` (None if the drafter was saved without a tree)."""
    path = Path(path)
    cfg = read_json(path / "config.json")
    kind = cfg.get("drafter_type")
    heads_dir = path / cfg["heads"] if kind == MEDUSA2_TYPE else path
    heads = MedusaHeads.from_pretrained(heads_dir, device=device)
    hcfg = read_json(heads_dir / "config.json")
    info = {"medusa_choices": hcfg.get("medusa_choices"), "head_topk_accuracy": hcfg.get("head_topk_accuracy"),
            "target_modified": kind == MEDUSA2_TYPE}
    if kind == MEDUSA2_TYPE:
        peft_model = load_lora(target_model, path / cfg.get("adapter", "adapter"))
        target_model = peft_model.merge_and_unload().eval()
    heads.medusa_choices = info["medusa_choices"]  # read by the decoder's tree choice
    heads.head_topk_accuracy = info["head_topk_accuracy"]
    if device is not None:
        heads.to(device)
    heads.to(next(target_model.parameters()).dtype)
    return target_model, heads.eval(), info
