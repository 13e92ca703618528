"""What every training method is: the :class:`TrainingMethod` protocol the loop (training/loop.py) calls,
:class:`MethodDefaults` (its optional hooks as no-ops, so the loop calls every hook unconditionally) and the
helpers the per-position methods share (``position_means``, ``chain_tau``). The methods (training/eagle3.py,
training/medusa.py, training/draft_model.py) import this module; the table that maps ``job.method`` to them is
training/method.py's ``METHODS`` (above them, never imported by them).
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from ..io import DraftTrainError


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
        """The method built from the job: its config section is named after the method (``job.eagle3``); a
        method whose section has another name (medusa2, draft_model) overrides this."""
        return cls(getattr(job, cls.name), tokenizer, target_model)

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
