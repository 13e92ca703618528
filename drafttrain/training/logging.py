"""Experiment logging through Accelerate's trackers: W&B (offline without an API key) or TensorBoard."""
from __future__ import annotations

import netrc
import os
from pathlib import Path


def wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        rc = netrc.netrc(os.path.expanduser("~/.netrc"))
        return any(h and "wandb" in h for h in rc.hosts)
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def tracker_for(logger_cfg, run_dir: Path):
    """Return ``(log_with, init_kwargs)`` for ``Accelerator``/``init_trackers``; ``(None, {})`` for none."""
    kind = logger_cfg.kind
    if kind == "none":
        return None, {}
    if kind == "tensorboard":
        return "tensorboard", {}
    if kind == "wandb":
        mode = logger_cfg.mode
        if mode == "auto":
            mode = os.environ.get("WANDB_MODE") or ("online" if wandb_has_credentials() else "offline")
        os.environ["WANDB_MODE"] = mode
        os.environ.setdefault("WANDB_SILENT", "true")
        kwargs = {"dir": str(run_dir), "mode": mode}
        if logger_cfg.run_name:
            kwargs["name"] = logger_cfg.run_name
        return "wandb", {"wandb": kwargs}
    from ..io import DraftTrainError

    raise DraftTrainError(f"logger.kind={kind}: expected none, wandb or tensorboard")


def log_image(accelerator, key: str, png_path: Path, step: int) -> None:
    """Log a PNG (e.g. the acceptance-per-position plot) to the active tracker."""
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            import wandb

            tracker.log({key: wandb.Image(str(png_path))}, step=step)
        elif tracker.name == "tensorboard":
            import numpy as np
            from PIL import Image

            img = np.asarray(Image.open(png_path).convert("RGB"))
            tracker.writer.add_image(key, img, global_step=step, dataformats="HWC")
