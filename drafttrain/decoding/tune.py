"""Choosing the draft length / tree size from measured acceptance and measured costs.

Model of one round with K drafts (chain):
    time(K)   = t_verify(K + 1) + K * t_draft + t_other        (DFlash: t_draft once per round, whatever K)
    tau(K)    = 1 + sum_{k=1..K} prod_{i<=k} acc_i          (acc_i = P(position i accepted | reached))
    speed(K)  = tau(K) / time(K)                             (tokens per second)
``t_verify(n)`` is the measured time of one target forward over n new positions, ``t_draft`` the measured
drafting time per draft token, ``t_other`` the measured per-round overhead (verification, bookkeeping).
Under greedy decoding the acceptance of position i does not depend on K for a chain drafter (draft i sees only
drafts 1..i-1), so one calibration run at the largest K gives every acc_i. K = 0 is plain AR.

A DFlash drafter runs a block of 1 + K tokens with attention in both directions inside it, so every slot's
proposal depends on K (measured: slot 3 accepted 0.82 at K = 3 against 0.92 at K = 7, bench/notebook/dflash.md);
its tau and draft time are measured at every K instead (``choose_measured_length``).

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
                        draft_cost_per_token: float, other_cost_per_round: float, max_k: int) -> dict:
    """Predicted tau / time / speed for K = 0..max_k (K + 1 must be in ``verify_cost``); the best K."""
    rows = []
    for K in range(0, max_k + 1):
        if K + 1 not in verify_cost:
            continue
        tau = expected_tau(acceptance_per_position, K)
        t = verify_cost[K + 1] + K * draft_cost_per_token + other_cost_per_round
        rows.append({"K": K, "tau": tau, "round_time_s": t, "tokens_per_s": tau / t})
    base = next((r["tokens_per_s"] for r in rows if r["K"] == 0), None)
    for r in rows:
        r["speedup_vs_ar"] = r["tokens_per_s"] / base if base else None
    best = max(rows, key=lambda r: r["tokens_per_s"]) if rows else None
    return {"rows": rows, "best": best}


def choose_measured_length(measured: Sequence[dict], verify_cost: dict[int, float],
                           ar_round_time: float) -> dict:
    """Draft lengths whose tau was measured at each K (a block drafter): ``measured`` rows ``{K, tau,
    draft_time_per_round, other_time_per_round}``; time(K) = t_verify(K + 1) + draft + other, K = 0 is AR's
    ``ar_round_time``. Rows as ``choose_chain_length``'s; the best K."""
    rows = [{"K": 0, "tau": 1.0, "round_time_s": ar_round_time, "tokens_per_s": 1.0 / ar_round_time}]
    for m in sorted(measured, key=lambda m: m["K"]):
        if m["K"] + 1 not in verify_cost:
            continue
        t = verify_cost[m["K"] + 1] + m["draft_time_per_round"] + m["other_time_per_round"]
        rows.append({"K": int(m["K"]), "tau": float(m["tau"]), "round_time_s": t, "tokens_per_s": m["tau"] / t,
                     "measured": True})
    for r in rows:
        r["speedup_vs_ar"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return {"rows": rows, "best": max(rows, key=lambda r: r["tokens_per_s"])}


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
