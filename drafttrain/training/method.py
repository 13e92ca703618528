"""The training-method protocol: what the loop (training/loop.py) calls on EAGLE-3, Medusa and the draft model.

The loop is method-agnostic; a method (training/eagle3.py, training/medusa.py, training/draft_model.py) implements
:class:`TrainingMethod`. It subclasses :class:`MethodDefaults` for the optional hooks it does not need, so the
loop calls every hook unconditionally (no ``hasattr``). ``method_class`` / ``make_method`` map ``job.method``
to its class and build it from the job.
"""
from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch
from torch import nn

from ..io import DraftTrainError

# job.method -> (module under drafttrain.training, class, its config section of the job)
METHODS = {
    "eagle3": ("eagle3", "Eagle3Method", "eagle3"),
    "medusa": ("medusa", "MedusaMethod", "medusa"),
    "medusa2": ("medusa", "MedusaMethod", "medusa"),
    "draft_model": ("draft_model", "DraftModelMethod", "distill"),
    "dflash": ("dflash", "DFlashMethod", "dflash"),
}


class TrainingMethod(Protocol):
    name: str
    offline_features: tuple[str, ...]  # what `drafttrain capture` stores for it (empty: online only)

    def build_drafter(self, target_model, examples: list[dict], target_name: str) -> nn.Module:
        """The drafter: forward = training forward, ``trainable_parameters()``, ``save_pretrained(dir)``."""

    def describe(self, drafter) -> str:
        """One line for the log."""

    def param_groups(self, drafter, lr: float) -> list[dict]:
        """Optimizer groups (e.g. a head learning-rate multiplier)."""

    def capture(self, target_model, batch) -> Any:
        """Online capture: the target's forward on a micro-batch, under no_grad."""

    def capture_from_features(self, target_model, batch, feats: dict) -> Any:
        """capture.mode=offline: the same capture from stored features (``offline_features``)."""

    def count_valid(self, drafter, batch, cap) -> torch.Tensor:
        """Valid positions per loss term ``[n]`` (summed over the global batch before the loss is normalised)."""

    def loss(self, model, drafter, batch, cap, counts: torch.Tensor, scale: float) -> tuple[torch.Tensor, dict]:
        """(loss, per-term sums) of a micro-batch."""

    def summarize(self, sums: dict) -> dict:
        """Means (with "loss") from the globally reduced sums."""

    def estimated_tau(self, summary: dict, k: int) -> float | None:
        """τ implied by the training metrics."""

    def begin_step(self, step: int) -> None:
        """Before a step's batches are built (EAGLE-3: the TTT curriculum's depth)."""

    def transform_examples(self, drafter, rows: list[list[dict]], step: int, rank: int) -> list[list[dict]]:
        """Rewrite a step's micro-batches before collation (the draft model's on-policy rows)."""

    def finalize(self, drafter, train_metrics: dict) -> None:
        """Before the final save (Medusa: its tree from the measured per-head accuracy)."""

    def eval_setup(self, target_model, drafter) -> tuple[Any, Any, dict | None]:
        """(target, drafter, extra report keys) the decoder verifies and drafts with (Medusa-2: adapted target)."""

    @staticmethod
    def target_layers(cfg) -> int:
        """How many of the target's first decoder layers build_drafter copies (capture.mode=offline loads those)."""

    @staticmethod
    def offline_unsupported(job) -> str | None:
        """Why this job's settings cannot train from stored features (None: they can)."""


class MethodDefaults:
    """The optional hooks of :class:`TrainingMethod`, as no-ops; a method overrides those it needs."""

    offline_features: tuple[str, ...] = ()

    @classmethod
    def from_job(cls, job, tokenizer, target_model):
        return cls(getattr(job, METHODS[job.method][2]), tokenizer, target_model)

    def capture_from_features(self, target_model, batch, feats: dict):
        raise DraftTrainError(f"method={self.name} cannot train from stored features; use capture.mode=online")

    def begin_step(self, step: int) -> None:
        pass

    def transform_examples(self, drafter, rows, step: int, rank: int):
        return rows

    def finalize(self, drafter, train_metrics: dict) -> None:
        pass

    def eval_setup(self, target_model, drafter):
        return target_model, drafter, None

    @staticmethod
    def target_layers(cfg) -> int:
        return 0

    @staticmethod
    def offline_unsupported(job) -> str | None:
        return None


def position_means(stats: dict, positions: int, sums: dict[str, str]) -> dict:
    """Per-position means of globally summed stats: ``out[f"{name}_{i}"] = stats[f"{key}_{i}"] / count_i`` for
    each ``name: key`` of ``sums`` (``count_i`` at least 1), plus ``valid_tokens_0``. The summaries of the
    methods that train one prediction per position (EAGLE-3's TTT steps, Medusa's heads) start from it."""
    out: dict = {}
    for i in range(positions):
        n = max(float(stats[f"count_{i}"]), 1.0)
        for name, key in sums.items():
            out[f"{name}_{i}"] = float(stats[f"{key}_{i}"]) / n
    out["valid_tokens_0"] = float(stats["count_0"])
    return out


def chain_tau(accuracies) -> float:
    """1 + Σ_j Π_{i<j} acc_i: the greedy chain τ implied by per-position accuracies (treated as conditional)."""
    tau, prod = 1.0, 1.0
    for a in accuracies:
        prod *= a
        tau += prod
    return tau


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
