"""Deterministic global batches, indexed by optimizer step.

The sequence of examples is a function of (seed, step) only: epoch e is a seeded permutation of the
dataset, and optimizer step s takes the next ``global_batch`` indices of the concatenated epochs. Process r
takes its contiguous slice and splits it into micro-batches. Hence

* resuming at step s needs no saved data-loader state (the data position *is* the step), and
* 1 process with gradient accumulation and N processes see the same global batches, so their loss curves
  agree up to floating-point summation order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..io import DraftTrainError


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int
    micro_batch: int
    world_size: int

    @property
    def per_process(self) -> int:
        return self.global_batch // self.world_size

    @property
    def accumulation(self) -> int:
        return self.per_process // self.micro_batch


def make_plan(global_batch: int, micro_batch: int, world_size: int) -> BatchPlan:
    if global_batch <= 0 or micro_batch <= 0:
        raise DraftTrainError(f"train.batch_size={global_batch} and train.micro_batch_size={micro_batch} must be > 0")
    if global_batch % (micro_batch * world_size):
        raise DraftTrainError(
            f"train.batch_size={global_batch} must be a multiple of train.micro_batch_size ({micro_batch}) x "
            f"processes ({world_size})"
        )
    return BatchPlan(global_batch, micro_batch, world_size)


def _epoch_perm(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


def global_batch_indices(n: int, plan: BatchPlan, step: int, seed: int) -> list[int]:
    """Dataset indices of optimizer step ``step`` (0-based), over all processes."""
    if n <= 0:
        raise DraftTrainError("the training set is empty")
    start = step * plan.global_batch
    out: list[int] = []
    while len(out) < plan.global_batch:
        epoch, offset = divmod(start + len(out), n)
        perm = _epoch_perm(n, seed, epoch)
        take = min(plan.global_batch - len(out), n - offset)
        out.extend(perm[offset : offset + take].tolist())
    return out


def micro_batches(n: int, plan: BatchPlan, step: int, seed: int, rank: int) -> list[list[int]]:
    idx = global_batch_indices(n, plan, step, seed)
    mine = idx[rank * plan.per_process : (rank + 1) * plan.per_process]
    return [mine[i : i + plan.micro_batch] for i in range(0, len(mine), plan.micro_batch)]
