"""Choosing the draft length / tree size from measured acceptance and measured costs.

Model of one round with K drafts (chain):
    time(K)   = t_verify(K + 1) + K * t_draft + t_other        (DFlash: t_draft once per round, whatever K)
    tau(K)    = 1 + sum_{k=1..K} prod_{i<=k} acc_i          (acc_i = P(position i accepted | reached))
    speed(K)  = tau(K) / time(K)                             (tokens per second)
``t_verify(n)`` is the measured time of one target forward over n new positions, ``t_draft`` the measured
drafting time per draft token, ``t_other`` the measured per-round overhead (verification, bookkeeping).
Under greedy decoding the acceptance of position i does not depend on K, so one calibration run at the
largest K gives every acc_i. K = 0 is plain AR.

For trees, tau depends on the whole shape, so each candidate size is run and its measured tau and draft
time per round enter the same formula with ``t_verify(total_tokens + 1)``.
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from .target import TargetRunner, _sync


def expected_tau(acceptance_per_position: Sequence[float | None], K: int) -> float:
    """1 + sum over k <= K of the probability that the first k drafts are all accepted."""
    tau, run = 1.0, 1.0
    for i in range(K):
        a = acceptance_per_position[i] if i < len(acceptance_per_position) else None
        run *= 0.0 if a is None else float(a)
        tau += run
    return tau


@torch.no_grad()
def measure_verify_cost(runner: TargetRunner, context: Sequence[int], sizes: Sequence[int], repeats: int = 5,
                        tree: bool = False) -> dict[int, float]:
    """Median seconds of one target forward over n new positions after ``context`` (a prefilled cache),
    for every n in ``sizes``; with ``tree`` the n positions form a star tree (root + n-1 children)."""
    runner.reset()
    runner.forward(list(context))
    L = runner.length
    out = {}
    dev = runner.device
    for n in sizes:
        ids = [int(context[-1])] * n
        times = []
        for r in range(repeats + 1):
            _sync(dev)
            t0 = time.perf_counter()
            if tree and n > 1:
                runner.forward_tree(ids, [-1] + [0] * (n - 1))
            else:
                runner.forward(ids)
            _sync(dev)
            if r:  # the first call warms this shape up
                times.append(time.perf_counter() - t0)
            runner.truncate(L)
        out[int(n)] = statistics.median(times)
    return out


def choose_chain_length(acceptance_per_position: Sequence[float | None], verify_cost: dict[int, float],
                        draft_cost_per_token: float, other_cost_per_round: float, max_k: int,
                        draft_cost_per_round: float = 0.0) -> dict:
    """Predicted tau / time / speed for K = 0..max_k (K + 1 must be in ``verify_cost``); the best K.
    ``draft_cost_per_round``: a drafter whose one forward drafts every K (DFlash) costs that per round with K > 0."""
    rows = []
    for K in range(0, max_k + 1):
        if K + 1 not in verify_cost:
            continue
        tau = expected_tau(acceptance_per_position, K)
        t = verify_cost[K + 1] + K * draft_cost_per_token + (draft_cost_per_round if K else 0.0) + other_cost_per_round
        rows.append({"K": K, "tau": tau, "round_time_s": t, "tokens_per_s": tau / t})
    base = next((r["tokens_per_s"] for r in rows if r["K"] == 0), None)
    for r in rows:
        r["speedup_vs_ar"] = r["tokens_per_s"] / base if base else None
    best = max(rows, key=lambda r: r["tokens_per_s"]) if rows else None
    return {"rows": rows, "best": best}


def choose_tree_size(measured: Sequence[dict], verify_cost: dict[int, float], other_cost_per_round: float,
                     ar_round_time: float) -> dict:
    """``measured``: per candidate ``{"total_tokens", "tau", "draft_time_per_round", "nodes_per_round"}``.
    Predicted speed = tau / (t_verify(nodes + 1) + draft time + other); the best candidate."""
    rows = []
    sizes = sorted(verify_cost)
    for m in measured:
        nodes = int(round(m.get("nodes_per_round") or m["total_tokens"]))
        n = next((s for s in sizes if s >= nodes + 1), sizes[-1])
        t = verify_cost[n] + m["draft_time_per_round"] + other_cost_per_round
        rows.append({**m, "round_time_s": t, "tokens_per_s": m["tau"] / t,
                     "speedup_vs_ar": (m["tau"] / t) * ar_round_time})
    best = max(rows, key=lambda r: r["tokens_per_s"]) if rows else None
    return {"rows": rows, "best": best}
