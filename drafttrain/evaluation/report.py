"""An evaluation's report: :func:`build_report` (τ, α per position, speedup and its spread over passes, the
draft shape, the time split, the validity of structured outputs, a row per category) from the measured passes,
:func:`write_report` (``report.json``, the printed table, the plots ``acceptance.png``, ``speedup.png``,
``categories.png``, ``batch_speedup.png``).
"""
from __future__ import annotations

import time
from pathlib import Path

from ..io import save_figure, write_json
from .batch_sweep import format_table, plot_batch_sweep
from .evalsets import category_rows, decode_settings, plot_categories, print_categories
from .measure import EvalRun, Measured



def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def print_table(report: dict) -> None:
    app = report.get("acceptance_per_position") or []
    unit = report.get("acceptance_unit", "position")
    rows = [
        ("method", report["method"] + (f" ({report['draft_shape']})" if report.get("draft_shape") else "")),
        ("target", report["target"]),
        ("prompts x new tokens", f"{report['prompts']} x {report['new_tokens'] // max(1, report['prompts'])} (avg)"),
        ("draft tokens K / temperature", f"{report['num_draft_tokens']} / {report['temperature']}"),
        ("verification", report.get("verification", "-")),
        *([("drafter | target dtype", f"{report['drafter_dtype']} | {report.get('target_dtype', '-')}")]
          if report.get("drafter_dtype") else []),
        ("alpha (accepted/drafted)", fmt(report["alpha"])),
        (f"acceptance per {unit}", " ".join(fmt(a, ".2f") for a in app) or "-"),
        ("tau (tokens per target forward)", fmt(report["tau"])),
        ("train-estimated tau", fmt(report.get("train_estimated_tau"))),
        ("tokens/s speculative | AR", f"{fmt(report['tokens_per_s'], '.1f')} | "
                                      f"{fmt(report['baseline_tokens_per_s'], '.1f')}"),
        ("speedup (same run, side by side)", fmt(report["speedup"], ".2f") + "x" + _spread_note(report)),
        *([("predicted tau/(1+K*c), c", f"{fmt(report['predicted_speedup'], '.2f')}x, c = "
                                         f"{fmt(report['draft_cost_ratio'], '.3f')}")]
          if report.get("predicted_speedup") is not None else []),
        ("time split target/draft/other", " / ".join(fmt(report.get(k), ".0%") for k in
                                                   ("frac_target", "frac_draft", "frac_other"))),
        ("greedy outputs == AR", str(report["outputs_match_baseline"])),
    ]
    if report.get("grammar") or report.get("valid_fraction") is not None:
        rows.append(("grammar | valid outputs spec / AR", f"{report.get('grammar') or 'none'} | "
                     f"{fmt(report.get('valid_fraction'), '.0%')} / {fmt(report.get('baseline_valid_fraction'), '.0%')}"))
    for s in report.get("sweep") or []:
        on = f" ({s['prompts']} prompts)" if s.get("prompts") else ""
        pred = f" (predicted {fmt(s['predicted_speedup'], '.2f')}x)" if s.get("predicted_speedup") is not None else ""
        rows.append((f"  sweep K={s['draft_tokens']}{on}",
                     f"tau {fmt(s['tau'], '.2f')}, speedup {fmt(s['speedup'], '.2f')}x{pred}"))
    w = max(len(r[0]) for r in rows)
    print("\n".join(["", "=" * (w + 40)] + [f"{k.ljust(w)}  {v}" for k, v in rows] + ["=" * (w + 40)]), flush=True)


def _spread_note(report: dict) -> str:
    if report.get("speedup_min") is None:
        return ""
    over = report.get("speedup_spread_over", "passes")
    note = (f" ({over}: {fmt(report['speedup_min'], '.2f')}-{fmt(report['speedup_max'], '.2f')}, median "
            f"{fmt(report['speedup_median'], '.2f')}")
    if report.get("baseline_spread") is not None:
        note += f"; AR varied {report['baseline_spread']:.0%}"
    if report.get("speedup_noisy"):
        note += " between " + over + ": a noisy machine, raise decode.repeats" if over == "passes" else \
            f" between {over}: noisy or mixed lengths, decode.repeats>=3 separates them"
    return note + ")"


def draft_cost_ratio(report: dict) -> float | None:
    """``c``: the drafter's seconds per draft token over the target's seconds per verify forward, from the run's
    time split (a round runs the target once and drafts ``num_draft_tokens``; a tree: its depth); None without
    a drafter or timings."""
    K, t_target, t_draft = report.get("num_draft_tokens"), report.get("time_target_s"), report.get("time_draft_s")
    if not K or not t_target or t_draft is None:
        return None
    return t_draft / (K * t_target)


def chain_prediction(tau: float | None, K: int, c: float | None) -> float | None:
    """The speedup ``τ / (1 + K·c)`` that τ tokens per round and a draft cost ``c`` per token give when a verify
    forward costs what an AR step does and nothing else takes time (``draft_cost_ratio``)."""
    if tau is None or c is None:
        return None
    return tau / (1.0 + K * c)


def sample_size(report: dict) -> str:
    """The sample a figure's numbers come from, in words: prompts, new tokens, timed passes."""
    n, passes = report.get("prompts") or 0, int(report.get("repeats") or 1)
    per = (report.get("new_tokens") or 0) / max(1, n)
    return (f"{n} prompt{'s' * (n != 1)} x {per:.0f} new tokens (avg), "
            f"{passes} timed pass{'es' * (passes != 1)}")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _wrap(text: str, width: int = 70) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def acceptance_figure(report: dict):
    """Bars: P(position i accepted | reached) per draft position (trees: depth), integer positions; a line: the
    chance that the round's drafts up to i are all accepted (τ = 1 + its sum for a chain); sample and decode
    settings in the title."""
    plt = _pyplot()
    app = [a if a is not None else float("nan") for a in report.get("acceptance_per_position") or []]
    pos = list(range(1, len(app) + 1))
    unit = "tree depth" if report.get("acceptance_unit") == "depth" else "draft position"
    fig, ax = plt.subplots(figsize=(5.4, 3.8), dpi=120)
    ax.bar(pos, app, color="#4C72B0", label="P(accepted | reached), measured")
    reach, run = [], 1.0
    for a in app:
        run *= 0.0 if a != a else a  # nan (never reached): nothing beyond it is accepted
        reach.append(run)
    ax.plot(pos, reach, "o--", color="#DD8452", label=f"P({unit}s 1..i all accepted)")
    ax.set_xticks(pos, [str(p) for p in pos])
    ax.set_xlabel(unit)
    ax.set_ylabel("probability")
    ax.set_ylim(0, 1.12)
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title(f"{report['method']}: τ={fmt(report['tau'], '.2f')}, speedup={fmt(report['speedup'], '.2f')}x"
                 + (" (LOSSY)" if report.get("lossy") else "") + "\n"
                 + _wrap(f"{sample_size(report)}; {decode_settings(report)}"), fontsize=8)
    return fig


def plot_acceptance(report: dict, path: Path) -> None:
    save_figure(acceptance_figure(report), path)


def speedup_figure(report: dict):
    """The draft-length sweep: measured speedup beside the prediction τ/(1+K·c) (c from the main run's time split)
    and the AR line above; τ per draft length below; integer K; the sweep's sample (its prompts, new tokens, one
    pass) in the title."""
    plt = _pyplot()
    nan = float("nan")
    sw = report.get("sweep") or []
    ks = [int(s["draft_tokens"]) for s in sw]
    c = report.get("draft_cost_ratio", draft_cost_ratio(report))
    pred = [s.get("predicted_speedup", chain_prediction(s["tau"], s["draft_tokens"], c)) for s in sw]
    unit = "tree depth" if report.get("acceptance_unit") == "depth" else "draft tokens K"
    fig, (ax, ax2) = plt.subplots(2, 1, sharex=True, figsize=(5.4, 4.8), dpi=120, height_ratios=[3, 2])
    ax.plot(ks, [s["speedup"] if s["speedup"] is not None else nan for s in sw], "o-", color="#C44E52",
            label="measured speedup vs AR")
    if any(p is not None for p in pred):
        ax.plot(ks, [p if p is not None else nan for p in pred], "s--", color="#4C72B0",
                label=f"predicted τ/(1+K·c), c={c:.3f}")
    ax.axhline(1.0, color="gray", lw=0.8, ls=":", label="AR (1x)")
    ax.set_ylabel("speedup")
    ax.legend(fontsize=7)
    ax2.plot(ks, [s["tau"] if s["tau"] is not None else nan for s in sw], "o-", color="#55A868",
             label="τ measured (tokens per target forward)")
    ax2.set_ylabel("τ")
    ax2.legend(fontsize=7)
    ax2.set_xticks(ks, [str(k) for k in ks])
    ax2.set_xlabel(unit)
    n = max((int(s.get("prompts") or 0) for s in sw), default=0)
    tok = [s["new_tokens"] for s in sw if s.get("new_tokens") is not None]
    tokens = f" x {sum(tok) / len(tok) / max(1, n):.0f} new tokens (avg)" if tok else ""
    cost = (f"; c = draft s per token / target s per forward, at K={report.get('num_draft_tokens')}"
            if c is not None else "")
    ax.set_title(f"{report['method']}: speedup and τ vs draft length\n"
                 + _wrap(f"sweep: {n} prompt{'s' * (n != 1)}{tokens}, 1 pass per length (decode.sweep_prompts)"
                         f"{cost}"), fontsize=8)
    return fig


def plot_speedup(report: dict, path: Path) -> None:
    """Measured and predicted speedup, and tau, against the draft length (trees: depth) of the sweep."""
    save_figure(speedup_figure(report), path)


def verification_label(decode, typical_used: bool) -> str:
    if decode.temperature <= 0:
        return "greedy (lossless)"
    if typical_used:
        return "typical acceptance (LOSSY: not the target's distribution)"
    return "rejection sampling (lossless)"


NOISY_BASELINE = 0.10  # AR speed varying more than this between passes (or prompts) makes speedup unreliable


def speedup_spread(ar_res, sp_res, n_prompts: int) -> dict:
    """How much the speedup moves within this run: per timed pass (each pass interleaves AR and speculative
    per prompt), else per prompt; and how much the AR baseline itself varied (the machine's noise).

    ``speedup_per_pass``: tokens/s ratio of each pass; ``speedup_min/median/max`` over passes (one pass: over
    prompts, ``speedup_spread_over`` says which); ``baseline_spread``: (max - min) / median of AR tokens/s
    over passes (one pass: over prompts, per token, which also holds prompt-length effects);
    ``speedup_noisy``: the baseline spread exceeds NOISY_BASELINE."""
    import statistics

    from ..decoding.engine import aggregate

    def tps(rs):
        return aggregate(rs)["tokens_per_s"]

    passes = len(ar_res) // max(1, n_prompts)
    if passes > 1:
        groups = [slice(k * n_prompts, (k + 1) * n_prompts) for k in range(passes)]
        over = "passes"
    else:
        groups = [slice(i, i + 1) for i in range(len(ar_res))]
        over = "prompts"
    ratios, base = [], []
    for g in groups:
        a, s = tps(ar_res[g]), tps(sp_res[g])
        if a and s:
            ratios.append(s / a)
            base.append(a)
    if not ratios:
        return {"speedup_per_pass": [], "speedup_spread_over": over, "speedup_min": None, "speedup_median": None,
                "speedup_max": None, "baseline_spread": None, "speedup_noisy": None}
    med = statistics.median(base)
    bspread = (max(base) - min(base)) / med if med else None
    return {
        "speedup_per_pass": ratios if over == "passes" else [],
        "speedup_spread_over": over,
        "speedup_min": min(ratios), "speedup_median": statistics.median(ratios), "speedup_max": max(ratios),
        "baseline_spread": bspread,
        "speedup_noisy": bool(bspread is not None and bspread > NOISY_BASELINE),
    }


def _draft_shape(run: EvalRun, S: dict) -> dict:
    K, proposer = run.K, run.proposer
    if run.is_tree:
        shape = {"kind": "tree", "depth": K, "nodes_per_round": S["nodes_per_round"]}
        if hasattr(proposer, "top_k"):
            shape.update(top_k=proposer.top_k, total_tokens=proposer.total_tokens)
        if hasattr(proposer, "structure"):
            shape.update(medusa_choices=proposer.structure.choices)
        shape_str = f"tree depth {K}, {fmt(S['nodes_per_round'], '.1f')} nodes/round"
    else:
        shape = {"kind": "chain", "num_draft_tokens": K}
        shape_str = f"chain K={K}"
    return {"draft_shape": shape_str, "draft_tree" if run.is_tree else "draft_chain": shape,
            "nodes_per_round": S["nodes_per_round"]}


def _time_split(S: dict, A: dict) -> dict:
    return {"frac_target": S["frac_target"], "frac_draft": S["frac_draft"], "frac_other": S["frac_other"],
            "time_target_s": S["time_target"], "time_draft_s": S["time_draft"], "time_other_s": S["time_other"],
            "baseline_time_s": A["time_total"]}


def _validity(run: EvalRun, m: Measured, S: dict) -> dict:
    """Structured output: the grammar decoding ran under (None: unconstrained) and the fraction of outputs of
    the first repeat that validate against it (or, decode.grammar=none on structured rows, each row's schema)."""
    n_p = len(run.prompts)
    valid = run.grammars.validate(run.tokenizer, [r.tokens for r in m.spec[:n_p]], run.eos)
    base_valid = run.grammars.validate(run.tokenizer, [r.tokens for r in m.ar[:n_p]], run.eos)
    return {"grammar": run.grammars.label, "valid_fraction": valid["valid_fraction"],
            "baseline_valid_fraction": base_valid["valid_fraction"], "invalid_outputs": valid["failures"],
            "time_grammar_s": S["time_grammar"], "frac_grammar": S["frac_grammar"]}


def build_report(run: EvalRun, m: Measured, swept: list[dict], *, target_name: str, drafter_name: str | None,
                 train_estimated_tau: float | None = None, extra: dict | None = None) -> dict:
    """The report (``report.json``) of a measured run and its sweep."""
    from ..decoding.engine import aggregate

    decode = run.decode
    A, S = aggregate(m.ar), aggregate(m.spec)
    greedy = decode.temperature == 0
    report = {
        "method": run.method, "target": target_name, "drafter": drafter_name, "prompts": len(run.prompts),
        "new_tokens": S["num_new_tokens"] // max(1, decode.repeats), "num_draft_tokens": run.K,
        "temperature": decode.temperature, "top_k": decode.top_k, "top_p": decode.top_p,
        "verification": verification_label(decode, S["lossy"]), "lossy": S["lossy"], "alpha": S["alpha"],
        "acceptance_unit": "depth" if run.is_tree else "position",
        "acceptance_per_position": S["acceptance_per_position"], "tau": S["tau"],
        **{k: S[k] for k in ("accepted_per_position", "reached_per_position", "live_accepted_per_position",
                             "live_reached_per_position")},
        "tokens_per_s": S["tokens_per_s"], "baseline_tokens_per_s": A["tokens_per_s"],
        "speedup": (S["tokens_per_s"] / A["tokens_per_s"]) if S["tokens_per_s"] and A["tokens_per_s"] else None,
        **speedup_spread(m.ar, m.spec, len(run.prompts)),
        "outputs_match_baseline": all(m.match) if greedy else None,
        "train_estimated_tau": train_estimated_tau,
        **_time_split(S, A),
        **_draft_shape(run, S),
        "sweep": swept,
        "cache": run.sp_runner.cache_kind, "static_shapes": run.sp_runner.static_shapes,
        "repeats": decode.repeats, "batch_size": int(getattr(decode, "batch_size", 1)), "device": str(next(run.model.parameters()).device),
        "mismatched_prompts": [i for i, ok in enumerate(m.match) if not ok] if greedy else [],
        **_validity(run, m, S),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    c = report["draft_cost_ratio"] = draft_cost_ratio(report)
    report["predicted_speedup"] = chain_prediction(report["tau"], run.K, c)
    report["sweep"] = [{**s, "predicted_speedup": chain_prediction(s["tau"], s["draft_tokens"], c)} for s in swept]
    if run.is_tree:
        report["acceptance_per_depth"] = S["acceptance_per_position"]
    if run.labels:
        report["categories"] = category_rows(m.ar, m.spec, m.match, run.labels, decode_settings(report), greedy)
    if extra:
        report.update(extra)
    return report


def write_report(report: dict, run_dir: Path | None, decode) -> None:
    """Print the table; with a run directory, write ``report.json`` and (``decode.plot``) the plots."""
    print_table(report)
    print_categories(report)
    if run_dir is None:
        return
    run_dir = Path(run_dir)
    write_json(run_dir / "report.json", report)
    if decode.plot and report.get("categories"):
        plot_categories(report, run_dir / "categories.png")
    if decode.plot and report["acceptance_per_position"]:
        plot_acceptance(report, run_dir / "acceptance.png")
    if decode.plot and report["sweep"]:
        plot_speedup(report, run_dir / "speedup.png")
    if report.get("batch_sweep"):
        print(format_table(report["batch_sweep"]), flush=True)
        if decode.plot:
            plot_batch_sweep(report["batch_sweep"], run_dir / "batch_speedup.png")
    print(f"[drafttrain] report: {run_dir / 'report.json'}", flush=True)
