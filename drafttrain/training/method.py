"""The training methods by name: ``METHODS`` maps ``job.method`` to its module, class and config section;
``method_class`` / ``make_method`` build it from the job (the module imported by name, so a job loads only its own
method). The protocol every method implements, and its defaults, are training/base.py's (re-exported here).
"""
from __future__ import annotations

import importlib

from ..io import DraftTrainError
from .base import MethodDefaults, TrainingMethod, chain_tau, position_means

__all__ = ["METHODS", "TrainingMethod", "MethodDefaults", "chain_tau", "position_means", "method_class",
           "make_method", "target_layers_needed", "refuse_offline"]

# job.method -> (module under drafttrain.training, class, its config section of the job)
METHODS = {
    "eagle3": ("eagle3", "Eagle3Method", "eagle3"),
    "medusa": ("medusa", "MedusaMethod", "medusa"),
    "medusa2": ("medusa", "MedusaMethod", "medusa"),
    "draft_model": ("draft_model", "DraftModelMethod", "distill"),
    "dflash": ("dflash", "DFlashMethod", "dflash"),
}


def method_class(job):
    """``(class, its config section)`` of ``job.method``."""
    if job.method not in METHODS:
        raise DraftTrainError(f"method={job.method}: not a training method (expected: {', '.join(METHODS)})")
    module, cls, section = METHODS[job.method]
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls), getattr(job, section)


def make_method(job, tokenizer, target_model) -> TrainingMethod:
    return method_class(job)[0].from_job(job, tokenizer, target_model)


def target_layers_needed(job) -> int:
    """How many of the target's first decoder layers the method builds its drafter from (0 for most methods);
    capture.mode=offline loads only those of its layers."""
    cls, cfg = method_class(job)
    return int(cls.target_layers(cfg))


def refuse_offline(job, cls=None) -> None:
    """capture.mode=offline with a method (or a setting of it) that cannot train from stored features."""
    cls = cls or method_class(job)[0]
    why = cls.offline_unsupported(job)
    if why or not cls.offline_features:
        raise DraftTrainError(f"capture.mode=offline: method={job.method} cannot train from stored features"
                              f"{f' ({why})' if why else ''}; use capture.mode=online")
