"""Speedup against batch size: where speculative decoding stops paying (``drafttrain eval decode.batch_sizes=[…]``).

For each batch size B the same prompts are decoded by the batched AR and speculative decoders
(:mod:`drafttrain.decoding.batched`, through ``measure.measure_batched``: the two back to back per pass), B rows
at a time with finished rows refilled (``decode.continuous_batching``, default; false: groups of B), giving AR
tokens/s, speculative tokens/s, τ, α per position and the speedup, side by side. Batch 1 is also run on
today's batch-1 path (:class:`~drafttrain.decoding.engine.SpecDecoder`), so a regression of the batched code
at B = 1 shows as a ratio measured in the same run.

Beside every measurement, a prediction a user can carry to other hardware: from the batch-1 run's acceptance
per position the expected committed tokens per round ``τ̂ = 1 + Σ_{j≤K} P(position j accepted)`` (for a
chain that always drafts K: ``1 + Σ_{j≤K} Π_{i≤j} α_i`` with ``α_i`` = P(position i accepted | reached); the
counts also cover rounds that draft fewer, as prompt lookup's without a match); from micro-benchmarks of the target, ``c_T(B, n)``, the seconds of one
forward of n new tokens per row for B rows at the prompts' typical context; and the drafter's measured seconds
per round at B, ``c_D(B)`` (its share of the batched run). Then

    predicted speedup(B) = τ̂ · c_T(B, 1) / (E_w[c_T(B, w)] + c_D(B))

AR costs c_T(B, 1) per token per row; a speculative round costs a verify forward plus the drafts and
commits τ̂ tokens per row. The verify is as wide as the round's longest row (right padding): ``w = K + 1``
for a drafter that always drafts K, narrower for one that often drafts nothing (prompt lookup); its law over
``1 .. K + 1`` comes from the batch-1 run's draft lengths (:func:`verify_width_law`). Speculation stops paying when the verify of K + 1 tokens costs about τ̂ forwards of
one (compute-bound decoding), or when τ̂ is small. The *crossover* is the smallest measured B whose speedup is
below 1 (``None``: none up to the largest B). The prediction ignores rows finishing at different rounds
(the batch shrinks) and the decoder's own per-round work; ``prediction_error`` says how far off it is.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Sequence

import torch

from ..io import DraftTrainError
from .measure import batched_decoders, measure, measure_batched


def _with_batch(decode, batch_size: int):
    """``decode`` with ``batch_size`` set (a copy: a dataclass or an OmegaConf node)."""
    if dataclasses.is_dataclass(decode):
        return dataclasses.replace(decode, batch_size=int(batch_size))
    from omegaconf import OmegaConf

    out = OmegaConf.create(OmegaConf.to_container(decode))
    out.batch_size = int(batch_size)
    return out


def expected_tau(alpha_per_position: Sequence[float | None], K: int) -> float:
    """``1 + Σ_{j≤K} Π_{i≤j} α_i`` (a position never reached counts as never accepted)."""
    tau, reach = 1.0, 1.0
    for a in list(alpha_per_position)[:K]:
        reach *= float(a or 0.0)
        tau += reach
    return tau


def expected_tau_from_counts(accepted_per_position: Sequence[int], rounds: int) -> float:
    """``1 + Σ_j P(position j accepted in a round)`` from counts: the chain formula of :func:`expected_tau`
    when every round drafts K tokens, and right too when some rounds draft fewer or none (prompt lookup
    without a match), which the conditional rates alone cannot see."""
    return 1.0 + sum(int(a) for a in accepted_per_position) / max(int(rounds), 1)


def verify_width_law(drafted_per_position: Sequence[int], rounds: int, B: int) -> list[float]:
    """P(a batched verify forward is ``w`` tokens wide), ``w = 1 .. K + 1``, for B rows drafting independently
    with the batch-1 run's draft lengths (``drafted_per_position[j]``: rounds that drafted at least j + 1
    tokens): rows are right-padded to the longest, so ``P(width >= w) = 1 - (1 - P(d >= w - 1))^B``. A chain
    that always drafts K gives width K + 1 at every B; prompt lookup, which often finds no match, narrower."""
    ge = [1.0] + [1.0 - (1.0 - min(1.0, int(d) / max(int(rounds), 1))) ** int(B) for d in drafted_per_position]
    return [ge[w] - (ge[w + 1] if w + 1 < len(ge) else 0.0) for w in range(len(ge))]


def predicted_speedup(tau: float, c_ar: float, c_verify: float, c_draft: float) -> float:
    """``τ · c_ar / (c_verify + c_draft)``: per row, AR pays ``c_ar`` per token, a round pays a verify forward
    plus the drafts and commits ``τ`` tokens."""
    return tau * c_ar / (c_verify + c_draft)


@torch.no_grad()
def target_costs(model, batch_sizes: Sequence[int], tokens: Sequence[int], context: int, reps: int = 5,
                 vocab: int | None = None) -> dict[tuple[int, int], float]:
    """Median seconds of one target forward of ``n`` new tokens per row for ``B`` rows that already hold
    ``context`` tokens (random ids), for every B in ``batch_sizes`` and n in ``tokens``: ``{(B, n): s}``.
    Each forward is rolled back by index before the next one, so every timing sees the same context. The
    ``reps`` timings of a shape are spread over ``reps`` passes through every shape (interleaved), so a burst
    of load on a shared machine does not land on one shape's timings only."""
    from ..decoding.batched import BatchRunner

    V = int(vocab or _vocab(model))
    g = torch.Generator().manual_seed(0)
    runners, ids = {}, {}
    for B in batch_sizes:  # one runner per B, its rows holding the context
        r = runners[int(B)] = BatchRunner(model, max_len=int(context) + max(tokens) + 1, slack=max(tokens) + 8)
        r.reset(int(B))
        r.forward(torch.randint(0, V, (int(B), int(context)), generator=g).to(r.device))
        for n in tokens:
            ids[int(B), int(n)] = torch.randint(0, V, (int(B), int(n)), generator=g).to(r.device)
    times: dict[tuple[int, int], list[float]] = {k: [] for k in ids}
    for rep in range(int(reps) + 1):  # the first pass is a warm-up
        for (B, n), x in ids.items():
            r = runners[B]
            t0 = r.time_forward
            r.forward(x)
            if rep:
                times[B, n].append(r.time_forward - t0)
            r.set_lengths([int(context)] * B)
    return {k: statistics.median(v) for k, v in times.items()}


def _vocab(model) -> int:
    from ..targets.load import text_config

    return int(text_config(model.config).vocab_size)


def _call_rounds(calls) -> tuple[float, int, float]:
    """(drafter seconds, batched rounds, mean rows per round) of a batched run's speculative calls (its
    ``Measured.calls``): a call's rounds are its verify rounds plus its prefills (where the drafter primes the
    newcomers' state)."""
    draft = sum(s.time_draft for _, s in calls)
    rounds = sum(s.rounds + s.prefills for _, s in calls)
    mean_rows = sum(s.row_rounds for _, s in calls) / max(sum(s.rounds for _, s in calls), 1)
    return draft, rounds, mean_rows


def _phases(calls) -> dict:
    """AR's and speculative decoding's decode-phase tokens/s (outside the admissions' prefills) and the
    prefills' share of the wall time, over a batched run's calls."""
    out = {}
    for i, key in enumerate(("ar", "spec")):
        res = [c[i] for c in calls]
        n = sum(max(len(r.tokens) - 1, 0) for c in res for r in c.results)
        wall, pre = sum(c.time_total for c in res), sum(c.time_prefill for c in res)
        out[f"{key}_decode_tokens_per_s"] = n / (wall - pre) if wall > pre and n else None
        out[f"{key}_prefill_share"] = pre / wall if wall else None
    return out


def decode_phase(row: dict) -> tuple[float | None, float | None]:
    """(measured decode-phase speedup, its error against ``predicted_speedup``) of a sweep row: the speedup
    outside the admissions' prefills, which AR and speculative decoding pay alike and the prediction leaves
    out (so the end-to-end speedup lies between it and 1)."""
    a, s = row.get("ar_decode_tokens_per_s"), row.get("spec_decode_tokens_per_s")
    if not a or not s:
        return None, None
    sp = s / a
    pred = row.get("predicted_speedup")
    return sp, (sp / pred - 1.0) if pred else None


def _row(B: int, m, path: str) -> dict:
    from ..decoding.engine import aggregate

    A, S = aggregate(m.ar), aggregate(m.spec)
    ar_tps, sp_tps = A["tokens_per_s"], S["tokens_per_s"]
    return {"batch_size": int(B), "path": path, "ar_tokens_per_s": ar_tps, "spec_tokens_per_s": sp_tps,
            "speedup": sp_tps / ar_tps if ar_tps and sp_tps else None, "tau": S["tau"], "alpha": S["alpha"],
            "acceptance_per_position": S["acceptance_per_position"], "outputs_match_ar": all(m.match),
            "accepted_per_position": S["accepted_per_position"], "verify_rounds": S["num_rounds"],
            "drafted_per_position": S["drafted_per_position"],
            "new_tokens": S["num_new_tokens"]}


def batch_sweep(run, batch_sizes: Sequence[int], *, cost_reps: int = 9) -> dict:
    """Measure speedup against batch size on ``run``'s prompts (a ``measure.EvalRun``; every B decodes the same
    prompts) and predict it (module docstring). Returns the report's ``batch_sweep`` section."""

    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise DraftTrainError(f"decode.batch_sizes={list(batch_sizes)}: expected sizes >= 1")
    if sizes[-1] > len(run.prompts):
        raise DraftTrainError(f"decode.batch_sizes: the largest batch ({sizes[-1]}) needs at least as many "
                              f"prompts; there are {len(run.prompts)} (raise decode.num_prompts / data.num_eval)")
    if run.method == "ar":
        raise DraftTrainError("decode.batch_sizes needs a speculative method (decode.method=ar has nothing to compare)")
    decode0, batched0 = run.decode, run.batched
    rows = []
    try:
        run.batched = None
        one = _row(1, measure(run), "batch-1 decoder")  # today's path, for the regression ratio at B = 1
        for B in sizes:
            run.decode = _with_batch(decode0, B)
            run.batched = batched_decoders(run, run.ar.target)
            m = measure_batched(run)
            row = _row(B, m, "batched")
            row["spec_target_forwards"] = run.batched[1].target.num_forwards  # prefills + verify rounds, all groups
            draft, row["rounds"], row["mean_rows_per_round"] = _call_rounds(m.calls)
            row.update(_phases(m.calls))
            row["draft_s_per_round"] = draft / max(row["rounds"], 1)
            row["continuous_batching"] = bool(getattr(run.decode, "continuous_batching", True))
            rows.append(row)
    finally:
        run.decode, run.batched = decode0, batched0
    K = run.K
    context = int(statistics.median(len(p) for p in run.prompts) + decode0.max_new_tokens // 2)
    costs = target_costs(run.model, sizes, range(1, K + 2), context, reps=cost_reps)
    tau_hat = expected_tau_from_counts(one["accepted_per_position"], one["verify_rounds"])
    for r in rows:
        B = r["batch_size"]
        law = verify_width_law(one["drafted_per_position"], one["verify_rounds"], B)
        r["verify_width_law"] = law
        r["target_s_ar"], r["target_s_verify"] = costs[B, 1], costs[B, K + 1]
        r["target_s_verify_expected"] = sum(p * costs[B, w + 1] for w, p in enumerate(law))
        r["predicted_speedup"] = predicted_speedup(tau_hat, costs[B, 1], r["target_s_verify_expected"],
                                                   r["draft_s_per_round"])
        r["prediction_error"] = (r["speedup"] / r["predicted_speedup"] - 1.0) if r["speedup"] else None
        r["decode_speedup"], r["decode_prediction_error"] = decode_phase(r)
    below = [r["batch_size"] for r in rows if r["speedup"] is not None and r["speedup"] < 1.0]
    b1 = next(r for r in rows if r["batch_size"] == 1) if sizes[0] == 1 else None
    for r in rows:  # what batching itself gives AR: end to end, and per token of one target forward
        r["ar_vs_batch1"] = r["ar_tokens_per_s"] / b1["ar_tokens_per_s"] if b1 else None
        r["ar_decode_vs_batch1"] = r["ar_decode_tokens_per_s"] / b1["ar_decode_tokens_per_s"] \
            if b1 and r["ar_decode_tokens_per_s"] and b1["ar_decode_tokens_per_s"] else None
        r["forward_vs_batch1"] = costs[1, 1] * r["batch_size"] / costs[r["batch_size"], 1] if b1 else None
    return {
        "batch_sizes": sizes, "rows": rows, "batch1_decoder": one, "num_prompts": len(run.prompts),
        "num_draft_tokens": K, "method": run.method, "temperature": float(decode0.temperature),
        "max_new_tokens": int(decode0.max_new_tokens), "repeats": int(decode0.repeats), "context_tokens": context,
        "expected_tau": tau_hat,
        "crossover": below[0] if below else None,
        "batched_vs_batch1_speedup": (b1["speedup"] / one["speedup"]) if b1 and b1["speedup"] and one["speedup"]
        else None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def format_table(sweep: dict) -> str:
    """The sweep as a markdown table (decode settings in the caption line)."""
    def f(x, spec=".2f"):
        return "" if x is None else format(x, spec)

    head = (f"{sweep['method']}, K = {sweep['num_draft_tokens']}, temperature {sweep['temperature']:g}, "
            f"{sweep['num_prompts']} prompts x up to {sweep['max_new_tokens']} new tokens; crossover: "
            f"{sweep['crossover'] if sweep['crossover'] is not None else 'none up to B = ' + str(sweep['batch_sizes'][-1])}")
    one = sweep["batch1_decoder"]
    lines = [head, "", "| B | AR tok/s | spec tok/s | speedup | predicted | error | decode-phase speedup | its error "
                       "| τ | rows/round | AR tok/s ÷ B=1 | AR decode phase ÷ B=1 | AR prefill share | forward tok/s ÷ B=1 |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| 1 (batch-1 decoder) | {f(one['ar_tokens_per_s'], '.1f')} | {f(one['spec_tokens_per_s'], '.1f')} | "
             f"{f(one['speedup'])}x |  |  |  |  | {f(one['tau'])} |  |  |  |  |  |"]

    def pct(x):
        return "" if x is None else f"{x:+.0%}"

    for r in sweep["rows"]:
        share = r.get("ar_prefill_share")
        dec, dec_err = decode_phase(r)
        lines.append(f"| {r['batch_size']} | {f(r['ar_tokens_per_s'], '.1f')} | {f(r['spec_tokens_per_s'], '.1f')} | "
                     f"{f(r['speedup'])}x | {f(r['predicted_speedup'])}x | {pct(r['prediction_error'])} | "
                     f"{f(dec)}x | {pct(dec_err)} | {f(r['tau'])} | {f(r.get('mean_rows_per_round'), '.1f')} | "
                     f"{f(r.get('ar_vs_batch1'))}x | {f(r.get('ar_decode_vs_batch1'))}x | "
                     f"{'' if share is None else f'{share:.0%}'} | {f(r.get('forward_vs_batch1'))}x |")
    return "\n".join(lines)


def batch_sweep_figure(sweep: dict):
    """Measured (end to end and decode phase) and predicted speedup against batch size, the AR line and the
    crossover; integer batch sizes; the sample (prompts, new tokens, passes) in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    rows = sweep["rows"]
    bs = [r["batch_size"] for r in rows]
    nan = float("nan")
    fig, ax = plt.subplots(figsize=(5.4, 3.8), dpi=120)
    ax.plot(bs, [r["speedup"] if r["speedup"] is not None else nan for r in rows], "o-", color="#C44E52",
            label="measured, end to end")
    if any(r.get("decode_speedup") is not None for r in rows):
        ax.plot(bs, [r.get("decode_speedup") if r.get("decode_speedup") is not None else nan for r in rows], "^:",
                color="#DD8452", label="measured, decode phase (no prefills)")
    ax.plot(bs, [r["predicted_speedup"] for r in rows], "s--", color="#4C72B0",
            label=r"predicted $\hat\tau\,c_T(B,1)\,/\,(E_w[c_T(B,w)]+c_D(B))$, $\hat\tau$="
            f"{sweep['expected_tau']:.2f}")
    ax.axhline(1.0, color="gray", lw=0.8, ls=":", label="AR at the same B (1x)")
    if sweep["crossover"] is not None:
        ax.axvline(sweep["crossover"], color="#C44E52", lw=0.8, ls="--", label=f"crossover B={sweep['crossover']}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("batch size B")
    ax.set_ylabel("speedup vs AR at the same B")
    ax.legend(fontsize=7)
    passes = int(sweep.get("repeats") or 1)
    ax.set_title(f"{sweep['method']}, K={sweep['num_draft_tokens']}, T={sweep['temperature']:g}: speedup vs batch\n"
                 f"{sweep['num_prompts']} prompts x up to {sweep['max_new_tokens']} new tokens, {passes} timed "
                 f"pass{'es' * (passes != 1)} per B", fontsize=8)
    return fig


def plot_batch_sweep(sweep: dict, path: Path) -> None:
    from ..io import save_figure

    save_figure(batch_sweep_figure(sweep), path)


__all__ = ["batch_sweep", "batch_sweep_figure", "decode_phase", "expected_tau", "expected_tau_from_counts", "format_table", "plot_batch_sweep",
           "predicted_speedup", "target_costs", "verify_width_law"]
