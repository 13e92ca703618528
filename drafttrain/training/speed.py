"""How fast a training run goes and what its step costs: seconds per step, real tokens/s and the ETA
(:class:`StepSpeed`), and the one-line note on what a step's cost scales with (``cost_note``)."""
from __future__ import annotations

import time

import torch


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s" if s >= 60 else f"{seconds:.1f}s"


class StepSpeed:
    """Seconds per optimizer step, real tokens/s and the ETA of ``max_steps``, measured over the steps after
    this run's first one (warm-up: allocations, lazy initialisation, kernel selection); checkpoint saves and
    evaluations between steps are not counted. ``estimate_ready()`` is true once, after ``MEASURE`` measured
    steps (a run with fewer steps left gets no estimate). With ``sync`` (CUDA) the device is synchronised
    around the target's capture forward during the measured steps of the estimate only, to give its share of
    the step time; on CPU the share is always exact. Real tokens: this process's, times the process count."""

    MEASURE = 2

    def __init__(self, world: int, start_step: int, max_steps: int, sync: bool = False, clock=time.perf_counter):
        self.world, self.first, self.max_steps, self.sync, self.clock = world, start_step, max_steps, sync, clock
        self.seconds = self.capture_seconds = 0.0
        self.steps = self.tokens = 0
        self.done = start_step
        self._t0 = self._t_cap = 0.0
        self._reported = False

    def _measuring(self) -> bool:
        return self.done > self.first  # this step is not the run's first

    def _now(self) -> float:
        if self.sync and self._measuring() and self.steps < self.MEASURE:
            torch.cuda.synchronize()
        return self.clock()

    def begin(self) -> None:
        self._t0 = self._now()

    def captured(self) -> None:
        self._t_cap = self._now() - self._t0

    def end(self, real_tokens: int) -> None:
        dt = self._now() - self._t0
        if self._measuring():
            self.steps += 1
            self.seconds += dt
            self.tokens += real_tokens * self.world
            if self.steps <= self.MEASURE:
                self.capture_seconds += self._t_cap
        self.done += 1

    @property
    def seconds_per_step(self) -> float | None:
        return self.seconds / self.steps if self.steps else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.steps and self.seconds > 0 else None

    def estimate_ready(self) -> bool:
        if self._reported or self.steps < self.MEASURE or self.done >= self.max_steps:
            return False
        self._reported = True
        return True

    def estimate_line(self, note: str = "") -> str:
        sps = self.seconds_per_step
        share = self.capture_seconds / max(1e-9, sps * min(self.steps, self.MEASURE))
        left = self.max_steps - self.done
        return (f"speed: {sps:.2f} s/step ({100 * share:.0f}% in the target forward), {self.tokens_per_s:,.0f} real "
                f"tokens/s, {self.tokens / self.steps:,.0f} real tokens/step{f' ({note})' if note else ''}; ETA "
                f"{_duration(sps * left)} for the {left} steps left of {self.max_steps} (measured over steps "
                f"{self.first + 2}-{self.done}, after a warm-up step)")


def cost_note(job, model, method, plan) -> str:
    """What a training step's cost scales with, for the speed line (docs/distributed.md, "What a training step
    costs")."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    rows = "packed into rows" if job.train.packing else "one per row"
    mbs = f"{plan.accumulation} micro-batch{'es' if plan.accumulation != 1 else ''}"
    parts = [f"{plan.global_batch} conversations {rows} of <= {job.data.max_length} tokens, {mbs} of "
             f"{plan.micro_batch}{f' x {plan.world_size} processes' if plan.world_size > 1 else ''}"]
    if vocab:
        parts.append(f"target vocab {vocab}")
    if getattr(method, "ttt_steps", None):
        parts.append(f"{method.ttt_steps} TTT step{'s' if method.ttt_steps != 1 else ''}")
    return ", ".join(parts)
