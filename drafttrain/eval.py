"""Evaluate a drafter in the speculative decoder: AR baseline vs speculative, side by side.

For each held-out prompt the AR baseline and the speculative decoder run back to back (alternating which
goes first), on the same target and the same sampling settings, so the speed ratio is measured under the
same machine load. Writes ``report.json`` (and ``acceptance.png``) into the run directory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import time
from pathlib import Path

import torch

from .artifacts import drafter_type, load_drafter
from .data.select import eval_conversations, eval_prompt_ids
from .io import DraftTrainError, save_figure, write_json


def _fmt(x, spec=".3f"):
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
        ("alpha (accepted/drafted)", _fmt(report["alpha"])),
        (f"acceptance per {unit}", " ".join(_fmt(a, ".2f") for a in app) or "-"),
        ("tau (tokens per target forward)", _fmt(report["tau"])),
        ("train-estimated tau", _fmt(report.get("train_estimated_tau"))),
        ("tokens/s speculative | AR", f"{_fmt(report['tokens_per_s'], '.1f')} | "
                                      f"{_fmt(report['baseline_tokens_per_s'], '.1f')}"),
        ("speedup (same run, side by side)", _fmt(report["speedup"], ".2f") + "x" + _spread_note(report)),
        ("time split target/draft/other", " / ".join(_fmt(report.get(k), ".0%") for k in
                                                   ("frac_target", "frac_draft", "frac_other"))),
        ("greedy outputs == AR", str(report["outputs_match_baseline"])),
    ]
    if report.get("grammar") or report.get("valid_fraction") is not None:
        rows.append(("grammar | valid outputs spec / AR", f"{report.get('grammar') or 'none'} | "
                     f"{_fmt(report.get('valid_fraction'), '.0%')} / {_fmt(report.get('baseline_valid_fraction'), '.0%')}"))
    for s in report.get("sweep") or []:
        on = f" ({s['prompts']} prompts)" if s.get("prompts") else ""
        rows.append((f"  sweep K={s['draft_tokens']}{on}", f"tau {_fmt(s['tau'], '.2f')}, speedup {_fmt(s['speedup'], '.2f')}x"))
    w = max(len(r[0]) for r in rows)
    print("\n".join(["", "=" * (w + 40)] + [f"{k.ljust(w)}  {v}" for k, v in rows] + ["=" * (w + 40)]), flush=True)


def _spread_note(report: dict) -> str:
    if report.get("speedup_min") is None:
        return ""
    over = report.get("speedup_spread_over", "passes")
    note = (f" ({over}: {_fmt(report['speedup_min'], '.2f')}-{_fmt(report['speedup_max'], '.2f')}, median "
            f"{_fmt(report['speedup_median'], '.2f')}")
    if report.get("baseline_spread") is not None:
        note += f"; AR varied {report['baseline_spread']:.0%}"
    if report.get("speedup_noisy"):
        note += " between " + over + ": a noisy machine, raise decode.repeats" if over == "passes" else \
            f" between {over}: noisy or mixed lengths, decode.repeats>=3 separates them"
    return note + ")"


def plot_acceptance(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    app = [a if a is not None else float("nan") for a in report.get("acceptance_per_position") or []]
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    ax.bar(range(1, len(app) + 1), app, color="#4C72B0")
    ax.set_xlabel("tree depth" if report.get("acceptance_unit") == "depth" else "draft position")
    ax.set_ylabel("P(accepted | reached)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{report['method']}: tau={_fmt(report['tau'], '.2f')}, speedup={_fmt(report['speedup'], '.2f')}x"
                 + (" (LOSSY)" if report.get("lossy") else ""), fontsize=9)
    save_figure(fig, path)


def plot_speedup(report: dict, path: Path) -> None:
    """Measured speedup (and tau) against the draft length (trees: depth) of the sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sw = report.get("sweep") or []
    ks = [s["draft_tokens"] for s in sw]
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    ax.plot(ks, [s["speedup"] if s["speedup"] is not None else float("nan") for s in sw], "o-", color="#C44E52",
            label="speedup vs AR")
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("tree depth" if report.get("acceptance_unit") == "depth" else "draft tokens K")
    ax.set_ylabel("speedup (measured)")
    ax2 = ax.twinx()
    ax2.plot(ks, [s["tau"] if s["tau"] is not None else float("nan") for s in sw], "s--", color="#4C72B0",
             label="tau")
    ax2.set_ylabel("tau")
    ax.set_title(f"{report['method']}: speedup and tau vs draft length", fontsize=9)
    save_figure(fig, path)


def sweep_lengths(decode, K: int, proposer) -> list[int]:
    """Draft lengths of the speedup sweep (``decode.sweep``; None = 1, 2, 4, 8 and K, capped where the
    proposer cannot draft more)."""
    if decode.sweep is not None:
        ks = [int(k) for k in decode.sweep]
    else:
        ks = [1, 2, 4, 8, K]
    cap = getattr(proposer, "depth", None)
    heads = getattr(getattr(proposer, "heads", None), "num_heads", None)
    if getattr(proposer, "name", "") == "medusa" and heads:
        cap = heads
    return sorted({k for k in ks if k >= 1 and (cap is None or k <= cap)})


def verification_label(decode, typical_used: bool) -> str:
    if decode.temperature <= 0:
        return "greedy (lossless)"
    if typical_used:
        return "typical acceptance (LOSSY: not the target's distribution)"
    return "rejection sampling (lossless)"


def _progress(total: int, desc: str):
    """A progress bar on stderr (redrawn at most every few seconds, so a log file gets a few lines, not
    thousands); its last state stays on screen."""
    import sys

    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="prompt", file=sys.stderr, mininterval=5.0, dynamic_ncols=True)


NOISY_BASELINE = 0.10  # AR speed varying more than this between passes (or prompts) makes speedup unreliable


def speedup_spread(ar_res, sp_res, n_prompts: int) -> dict:
    """How much the speedup moves within this run: per timed pass (each pass interleaves AR and speculative
    per prompt), else per prompt; and how much the AR baseline itself varied (the machine's noise).

    ``speedup_per_pass``: tokens/s ratio of each pass; ``speedup_min/median/max`` over passes (one pass: over
    prompts, ``speedup_spread_over`` says which); ``baseline_spread``: (max - min) / median of AR tokens/s
    over passes (one pass: over prompts, per token, which also holds prompt-length effects);
    ``speedup_noisy``: the baseline spread exceeds NOISY_BASELINE."""
    import statistics

    from .decoding.engine import aggregate

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


@dataclasses.dataclass
class EvalRun:
    """What one evaluation's measure, sweep and report steps share: the prompts, the two decoders (AR and
    speculative) on their runners, and the grammar of each prompt."""

    model: object
    tokenizer: object
    prompts: list
    proposer: object
    decode: object
    method: str
    K: int  # draft length (trees: depth)
    eos: object
    sp_runner: object  # the speculative decoder's TargetRunner (the AR one when no taps are needed)
    ar: object  # SpecDecoder with NoDraft, K = 0
    grammars: object  # GrammarPlan: one grammar per prompt
    compiled: list
    spec: object = None  # SpecDecoder with the proposer, K
    labels: list | None = None  # (category, question id) per prompt: the report adds a row per category
    batched: tuple | None = None  # decode.batch_size > 1: (AR, speculative) BatchSpecDecoder

    @property
    def is_tree(self) -> bool:
        return bool(getattr(self.proposer, "tree", False))

    @property
    def is_oracle(self) -> bool:
        return self.method == "oracle"

    def decoder(self, k: int):
        """A speculative decoder drafting ``k`` tokens (trees: depth) with the run's sampling settings."""
        from .decoding.engine import SpecDecoder

        d = self.decode
        return SpecDecoder(self.sp_runner, self.proposer, k, seed=d.seed, typical=bool(d.typical_acceptance),
                           typical_epsilon=d.typical_epsilon, typical_delta=d.typical_delta,
                           draft_temperature=d.draft_temperature, **_sampling(d))

    def gstate(self, i: int):  # a fresh grammar state per generation (None: unconstrained)
        return None if self.compiled[i] is None else self.compiled[i].state()

    def run_ar(self, i: int, p, n: int | None = None):
        n = self.decode.max_new_tokens if n is None else n
        return self.ar.generate(p, n, self.eos, seed=self.decode.seed + i, grammar=self.gstate(i))

    def run_spec(self, dec, i: int, p, ref):
        if self.is_oracle:
            self.proposer.set_reference(ref)
        return dec.generate(p, self.decode.max_new_tokens, self.eos, seed=self.decode.seed + i,
                            grammar=self.gstate(i))


@dataclasses.dataclass
class Measured:
    """The timed passes: per prompt and pass, AR and speculative results, whether they match; ``refs``: the
    first pass's AR tokens per prompt (the oracle's references in the sweep)."""

    ar: list
    spec: list
    match: list
    refs: list
    calls: list = dataclasses.field(default_factory=list)  # batched: (AR, speculative) BatchGenerationResult per call


def _sampling(decode) -> dict:
    return dict(temperature=decode.temperature, top_k=decode.top_k, top_p=decode.top_p)


def prepare(model, tokenizer, prompts: list[list[int]], proposer, decode, *, method: str, taps=None,
            grammars=None) -> EvalRun:
    """Check the settings, build the target runners, the AR and speculative decoders and the grammars."""
    from .data.chat import stop_token_ids
    from .decoding.build import decode_cache_length, draft_depth, static_options
    from .decoding.engine import SpecDecoder
    from .decoding.proposers import NoDraft
    from .decoding.target import TargetRunner

    if not prompts:
        raise DraftTrainError("no evaluation prompts (data.num_eval rows of the evaluation set are empty?)")
    if decode.cache not in ("auto", "static", "dynamic"):
        raise DraftTrainError(f"decode.cache={decode.cache}: expected auto, static or dynamic")
    eos = stop_token_ids(model, tokenizer)
    rkw = dict(max_len=decode_cache_length(prompts, decode), cache=decode.cache,
               **static_options(decode, buckets=True))
    try:
        ar_runner = TargetRunner(model, taps=None, **rkw)
        # one runner when no taps are needed: its compiled graphs then serve both decoders
        sp_runner = ar_runner if not taps else TargetRunner(model, taps=taps, **rkw)
    except ValueError as e:
        raise DraftTrainError(f"decode.cache={decode.cache}: {e}") from None
    if grammars is None:
        from .structured import grammar_plan

        grammars = grammar_plan(decode.grammar, [[]] * len(prompts), len(prompts))
    run = EvalRun(model, tokenizer, prompts, proposer, decode, method, draft_depth(proposer, decode), eos,
                  sp_runner, SpecDecoder(ar_runner, NoDraft(), 0, seed=decode.seed, **_sampling(decode)),
                  grammars, [])
    run.spec = run.decoder(run.K)
    if hasattr(proposer, "agree_fn"):  # the oracle tree's wrong siblings must be real token ids
        proposer.vocab_size = sp_runner.vocab_size
    if len(grammars.decode) != len(prompts):
        raise ValueError(f"{len(grammars.decode)} grammars for {len(prompts)} prompts")
    run.compiled = grammars.compile(tokenizer, ar_runner.vocab_size, eos)
    if int(getattr(decode, "batch_size", 1)) > 1:
        run.batched = _batched_decoders(run, ar_runner)
    return run


def _batched_decoders(run: EvalRun, ar_runner) -> tuple:
    """``decode.batch_size > 1``: the AR and speculative ``BatchSpecDecoder`` (chain methods only)."""
    from .decoding.batched import PACKED_ROW_TOKENS, BatchSpecDecoder
    from .decoding.proposers import NoDraft

    d = run.decode
    if run.is_oracle:
        raise DraftTrainError("decode.batch_size>1 does not support decode.method=oracle (per-prompt references)")
    if any(c is not None for c in run.compiled):
        raise DraftTrainError("decode.batch_size>1 does not support grammar-constrained decoding (decode.grammar)")
    packed = dict(packed_prefill=bool(getattr(d, "packed_prefill", True)),
                  packed_row_tokens=int(getattr(d, "packed_row_tokens", PACKED_ROW_TOKENS)))
    ar = BatchSpecDecoder(ar_runner, NoDraft(), 0, seed=d.seed, **packed, **_sampling(d))
    spec = BatchSpecDecoder(run.sp_runner, run.proposer, run.K, seed=d.seed, typical=bool(d.typical_acceptance),
                            draft_temperature=d.draft_temperature, **packed, **_sampling(d))
    return ar, spec


def _measure_batched(run: EvalRun) -> Measured:
    """``measure`` with ``decode.batch_size = B``, AR and speculative both batched, run back to back (alternating
    which goes first). ``decode.continuous_batching`` (default): each pass streams every prompt through B rows,
    a finished row refilled by the next prompt; false: the prompts in groups of B, each decoded to its last row.
    A row's times are its share of its call's (so the pooled tokens/s is the batch throughput)."""
    from .decoding.engine import aggregate

    decode, prompts, (ar, spec) = run.decode, run.prompts, run.batched
    B, n_new = int(decode.batch_size), decode.max_new_tokens
    if bool(getattr(decode, "continuous_batching", True)):
        groups, width = [list(range(len(prompts)))], B
    else:
        groups, width = [list(range(i, min(i + B, len(prompts)))) for i in range(0, len(prompts), B)], None
    for _ in range(decode.warmup):  # untimed: one batch
        ar.generate(prompts[:B], min(16, n_new), run.eos)
        spec.generate(prompts[:B], min(16, n_new), run.eos)
    m = Measured([], [], [], [])
    bar = _progress(decode.repeats * len(prompts), f"eval {run.method} vs AR, batch {B}")
    for rep in range(decode.repeats):
        for j, g in enumerate(groups):
            ps, seed = [prompts[i] for i in g], decode.seed + g[0]
            calls = [(ar, "a"), (spec, "s")] if (j + rep) % 2 == 0 else [(spec, "s"), (ar, "a")]
            out = {k: dec.generate(ps, n_new, run.eos, seed=seed, batch_size=width,
                                   admit_min=int(getattr(decode, "admit_min", 0))) for dec, k in calls}
            a, s = out["a"], out["s"]
            m.calls.append((a, s))
            for ra, rs in zip(a.results, s.results):
                m.ar.append(ra)
                m.spec.append(rs)
                m.match.append(ra.tokens == rs.tokens)
                if rep == 0:
                    m.refs.append(ra.tokens)
            bar.update(len(g))
            bar.set_postfix_str(f"tau {aggregate(m.spec)['tau'] or 0:.2f}, pass {rep + 1}/{decode.repeats}",
                                refresh=False)
    bar.close()
    return m


def _warmup(run: EvalRun) -> None:
    """Untimed: first calls pay for allocation and lazy initialisation; compiled, one graph per shape met
    (every prompt, so no compilation is timed)."""
    decode, prompts = run.decode, run.prompts
    for _ in range(decode.warmup):
        if decode.compile:
            for i, p in enumerate(prompts):
                run.run_spec(run.spec, i, p, run.run_ar(i, p).tokens)
            continue
        ref = run.run_ar(0, prompts[0], min(16, decode.max_new_tokens))
        run.run_spec(run.spec, 0, prompts[0], ref.tokens)


def measure(run: EvalRun) -> Measured:
    """``decode.repeats`` timed passes over the prompts after the warm-up; per prompt AR and speculative run
    back to back, alternating which goes first (the oracle needs AR first)."""
    from .decoding.engine import aggregate

    if run.batched:
        return _measure_batched(run)
    decode, prompts = run.decode, run.prompts
    _warmup(run)
    m = Measured([], [], [], [])
    bar = _progress(decode.repeats * len(prompts), f"eval {run.method} vs AR")
    for rep in range(decode.repeats):
        for i, p in enumerate(prompts):
            if run.is_oracle or (i + rep) % 2 == 0:
                a = run.run_ar(i, p)
                s = run.run_spec(run.spec, i, p, a.tokens)
            else:
                s = run.run_spec(run.spec, i, p, None)
                a = run.run_ar(i, p)
            m.ar.append(a)
            m.spec.append(s)
            m.match.append(a.tokens == s.tokens)
            if rep == 0:
                m.refs.append(a.tokens)
            bar.update(1)
            bar.set_postfix_str(f"tau {aggregate(m.spec)['tau'] or 0:.2f}, pass {rep + 1}/{decode.repeats}",
                                refresh=False)
    bar.close()
    return m


def sweep(run: EvalRun, m: Measured) -> list[dict]:
    """Speedup per draft length (``sweep_lengths``) on the first ``decode.sweep_prompts`` prompts, against the
    AR times of the same prompts (first repeat); [] for AR or when nothing is to be swept."""
    from .decoding.engine import aggregate

    decode, proposer, prompts = run.decode, run.proposer, run.prompts
    lengths = sweep_lengths(decode, run.K, proposer)
    if run.method == "ar" or decode.sweep_prompts <= 0 or not lengths or run.batched:  # (the sweep is batch 1)
        return []
    n = min(decode.sweep_prompts, len(prompts))
    base = aggregate(m.ar[:n])["tokens_per_s"]
    saved_num_tokens = getattr(proposer, "num_tokens", None)
    out = []
    sbar = _progress(len(lengths) * n, f"sweep {run.method} K={','.join(map(str, lengths))}")
    for k in lengths:
        if saved_num_tokens is not None:  # prompt lookup caps its drafts at num_tokens
            proposer.num_tokens = k
        dec = run.decoder(k)
        res = []
        for i, p in enumerate(prompts[:n]):
            res.append(run.run_spec(dec, i, p, m.refs[i]))
            sbar.update(1)
        agg = aggregate(res)
        out.append({"draft_tokens": k, "prompts": n, "tau": agg["tau"], "alpha": agg["alpha"],
                    "tokens_per_s": agg["tokens_per_s"],
                    "speedup": agg["tokens_per_s"] / base if base and agg["tokens_per_s"] else None})
    sbar.close()
    if saved_num_tokens is not None:
        proposer.num_tokens = saved_num_tokens
    return out


def _draft_shape(run: EvalRun, S: dict) -> dict:
    K, proposer = run.K, run.proposer
    if run.is_tree:
        shape = {"kind": "tree", "depth": K, "nodes_per_round": S["nodes_per_round"]}
        if hasattr(proposer, "top_k"):
            shape.update(top_k=proposer.top_k, total_tokens=proposer.total_tokens)
        if hasattr(proposer, "structure"):
            shape.update(medusa_choices=proposer.structure.choices)
        shape_str = f"tree depth {K}, {_fmt(S['nodes_per_round'], '.1f')} nodes/round"
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
    from .decoding.engine import aggregate

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
    if run.is_tree:
        report["acceptance_per_depth"] = S["acceptance_per_position"]
    if run.labels:
        from .evalsets import category_rows, decode_settings

        report["categories"] = category_rows(m.ar, m.spec, m.match, run.labels, decode_settings(report), greedy)
    if extra:
        report.update(extra)
    return report


def write_report(report: dict, run_dir: Path | None, decode) -> None:
    """Print the table; with a run directory, write ``report.json`` and (``decode.plot``) the plots."""
    from .evalsets import plot_categories, print_categories

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
        from .batch_sweep import format_table, plot_batch_sweep

        print(format_table(report["batch_sweep"]), flush=True)
        if decode.plot:
            plot_batch_sweep(report["batch_sweep"], run_dir / "batch_speedup.png")
    print(f"[drafttrain] report: {run_dir / 'report.json'}", flush=True)


@torch.no_grad()
def evaluate(model, tokenizer, prompts: list[list[int]], proposer, decode, run_dir: Path | None, *,
             method: str, target_name: str, drafter_name: str | None, taps=None,
             train_estimated_tau: float | None = None, extra: dict | None = None, grammars=None,
             labels: list | None = None) -> dict:
    """Run AR and speculative decoding on ``prompts`` side by side; return (and write) the report.

    Besides ``report.json`` and ``acceptance.png`` (per position; per depth for trees), a sweep over draft
    lengths (``decode.sweep``) is timed on the same prompts and plotted as ``speedup.png`` (speedup against
    the AR baseline of the main run).

    ``grammars``: a ``drafttrain.structured.GrammarPlan`` (one grammar per prompt; default: from
    ``decode.grammar``). AR and speculative decoding run under the same grammar, so ``outputs_match_baseline``
    compares with *constrained* AR; the report adds ``grammar`` and ``valid_fraction`` (speculative outputs
    that validate; ``baseline_valid_fraction`` for AR).

    The steps, each usable alone: ``prepare`` (decoders), ``measure`` (timed passes), ``sweep`` (draft
    lengths), ``build_report`` and ``write_report``.

    ``labels``: ``(category, question id)`` per prompt (a standard evaluation set, ``drafttrain.evalsets``): the
    report adds ``categories``, one row per category, printed and plotted as ``categories.png``.
    """
    run = prepare(model, tokenizer, prompts, proposer, decode, method=method, taps=taps, grammars=grammars)
    run.labels = labels
    measured = measure(run)
    report = build_report(run, measured, sweep(run, measured), target_name=target_name, drafter_name=drafter_name,
                          train_estimated_tau=train_estimated_tau, extra=extra)
    if list(getattr(decode, "batch_sizes", None) or []):
        from .batch_sweep import batch_sweep

        report["batch_sweep"] = batch_sweep(run, decode.batch_sizes)
    write_report(report, run_dir, decode)
    return report




def add_sampled_row(report: dict, model, tokenizer, drafter, decode, eval_convs, run_dir, temperature: float,
                    top_p: float, *, target_name, drafter_name) -> dict:
    """Decode the same prompts again at ``temperature`` / ``top_p`` (lossless rejection sampling; one pass, no
    sweep), print it as one row beside the greedy table and store it as ``report["sampled"]`` (the full
    report in ``run_dir/sampled/``)."""
    sdec = dataclasses.replace(decode, temperature=float(temperature), top_p=float(top_p), sweep_prompts=0,
                               plot=False, repeats=1)
    sub = Path(run_dir) / "sampled" if run_dir is not None else None
    with contextlib.redirect_stdout(io.StringIO()):  # one row, not a second table
        r = evaluate_drafter(model, tokenizer, drafter, sdec, eval_convs, sub, target_name=target_name,
                             drafter_name=drafter_name)
    keys = ("temperature", "top_p", "alpha", "acceptance_per_position", "tau", "speedup", "verification")
    report["sampled"] = {k: r.get(k) for k in keys}
    print(f"sampled (T={temperature:g}, top-p {top_p:g}): tau {_fmt(r['tau'], '.3f')}, alpha "
          f"{_fmt(r['alpha'], '.3f')}, speedup {_fmt(r['speedup'], '.2f')}x ({r['verification']}); "
          f"greedy: tau {_fmt(report['tau'], '.3f')}", flush=True)
    if run_dir is not None:
        write_json(Path(run_dir) / "report.json", report)
    return report


def _dtype_name(module) -> str:
    p = next(module.parameters(), None)
    return str(p.dtype).replace("torch.", "") if p is not None else "-"


def evaluate_drafter(model, tokenizer, drafter, decode, eval_convs, run_dir, *, target_name, drafter_name,
                     train_estimated_tau=None, extra: dict | None = None) -> dict:
    """The end-of-training evaluation (also used by ``drafttrain eval``).

    ``drafter``: an ``Eagle3Drafter`` (decode.method=eagle3), ``MedusaHeads`` (medusa) or an HF causal LM
    (draft_model). ``model`` is the target that verifies (for Medusa-2: the adapted target). ``extra``:
    keys added to the report (e.g. ``target_modified``)."""
    drafter.eval()
    # the dtype the drafter decodes in: as saved (an export in bfloat16 runs in bfloat16, as in an engine)
    dtypes = {"drafter_dtype": _dtype_name(drafter), "target_dtype": _dtype_name(model)}
    extra = {**dtypes, **(extra or {})}
    prompts = eval_prompt_ids(tokenizer, eval_convs, decode.num_prompts)
    announce_prompts(prompts, eval_convs, decode.num_prompts)
    from .decoding.build import decode_cache_length, make_proposer, target_taps

    method = decode.method
    proposer = make_proposer(method, drafter=drafter, decode=decode, max_len=decode_cache_length(prompts, decode),
                             device=next(model.parameters()).device)
    taps = target_taps(method, drafter, model)  # Medusa: the last hidden state (post-norm in transformers 5)
    from .evalsets import prompt_labels
    from .structured import grammar_plan

    return evaluate(model, tokenizer, prompts, proposer, decode, run_dir, method=method, target_name=target_name,
                    drafter_name=drafter_name, taps=taps, train_estimated_tau=train_estimated_tau, extra=extra,
                    grammars=grammar_plan(decode.grammar, eval_convs, len(prompts)),
                    labels=prompt_labels(eval_convs, len(prompts)))




def announce_prompts(prompts: list, convs, limit: int) -> None:
    """One line: how many prompts are decoded, out of which rows, and how to get all of them."""
    note = getattr(convs, "note", "") or f"{len(convs)} conversations"
    cap = f"; decode.num_prompts={limit} of {len(convs)}, 0 for all" if limit and limit < len(convs) else ""
    print(f"[drafttrain] eval: {len(prompts)} prompts: {note}{cap}", flush=True)


def _recorded_target(job) -> str | None:
    """Resolve ``job.drafter`` (a training checkpoint -> its drafter) and return the target it names, if any."""
    if not job.drafter:
        return None
    from .artifacts import drafter_dir, recorded_target  # a training checkpoint (step_*) -> its drafter

    job.drafter = str(drafter_dir(job.drafter))
    if not (Path(job.drafter) / "config.json").exists():
        raise DraftTrainError(f"drafter={job.drafter}: not a saved drafter directory (no config.json)")
    return recorded_target(job.drafter)


_IMPLIED_METHOD = {"eagle3": "eagle3", "medusa": "medusa", "medusa2": "medusa", "draft_model": "draft_model",
                   "dflash": "dflash"}


def _load_job_drafter(job, model, tname: str, recorded: str | None):
    """The job's saved drafter, checked against the target; ``decode.method`` inferred from it when left at
    the default. Returns ``(model, drafter, extra)`` (Medusa-2 returns the adapted target)."""
    if recorded and recorded != tname:
        raise DraftTrainError(f"drafter={job.drafter} was trained for target {recorded}, but target={tname} was given")
    kind = drafter_type(job.drafter)
    if kind in _IMPLIED_METHOD and job.decode.method != _IMPLIED_METHOD[kind]:
        if job.decode.method != "eagle3":  # eagle3 is the default: infer the method from the drafter
            raise DraftTrainError(f"drafter={job.drafter} is a {kind} drafter; decode.method="
                                  f"{job.decode.method} cannot use it (use decode.method={_IMPLIED_METHOD[kind]})")
        job.decode.method = _IMPLIED_METHOD[kind]
    extra = None
    if kind in ("medusa", "medusa2"):  # Medusa-2 also changes the target: merge its LoRA adapter
        from .artifacts import load_medusa

        model, drafter, extra = load_medusa(job.drafter, model, next(model.parameters()).device)
        dvocab = drafter.vocab_size
    else:
        drafter = load_drafter(job.drafter, next(model.parameters()).device, target_model=model)
        dvocab = drafter.config.vocab_size
    tvocab = model.get_output_embeddings().weight.shape[0]
    if dvocab != tvocab:
        raise DraftTrainError(f"drafter vocabulary ({dvocab}) differs from the target's ({tvocab})")
    return model, drafter, extra


def _job_prompts(job, model, tokenizer, tname: str, extra: dict | None):
    """The evaluation rows: ``eval.set``'s questions turn by turn (the report's ``eval_set`` goes into
    ``extra``), else ``data``'s evaluation rows."""
    if not job.eval.set:
        return eval_conversations(job.data, tname), extra
    from .data.questions import load_question_set
    from .evalsets import turn_prompts

    convs, info = turn_prompts(model, tokenizer, load_question_set(job.eval), job.decode)
    if not convs:
        raise DraftTrainError(f"eval.set={job.eval.set}: no turn fits the target's context "
                              f"({info['context_limit']} tokens) with decode.max_new_tokens={job.decode.max_new_tokens}")
    return convs, {**(extra or {}), "eval_set": info}


def run_eval(job, run_dir: Path) -> dict:
    """``drafttrain eval``: ``job`` is an ``EvalJob`` (drafttrain/config.py); the report goes into ``run_dir``."""
    from .decoding.build import decode_cache_length, make_proposer
    from .structured import grammar_plan
    from .targets.load import load_target, target_id

    recorded = _recorded_target(job)
    if job.target.name_or_path == "auto":
        job.target.name_or_path = recorded if recorded and Path(recorded).exists() else (recorded or "builtin")
    model, tokenizer, path = load_target(job.target)
    tname = target_id(path)
    drafter = extra = None
    if job.drafter:
        model, drafter, extra = _load_job_drafter(job, model, tname, recorded)
    if drafter is None and job.decode.method in ("eagle3", "medusa", "dflash"):
        raise DraftTrainError(f"decode.method={job.decode.method} needs drafter=<saved drafter directory>")
    convs, extra = _job_prompts(job, model, tokenizer, tname, extra)
    if drafter is not None:
        return evaluate_drafter(model, tokenizer, drafter, job.decode, convs, run_dir, target_name=tname,
                                drafter_name=job.drafter, extra=extra)
    prompts = eval_prompt_ids(tokenizer, convs, job.decode.num_prompts)
    announce_prompts(prompts, convs, job.decode.num_prompts)
    proposer = make_proposer(job.decode.method, decode=job.decode, max_len=decode_cache_length(prompts, job.decode),
                             device=next(model.parameters()).device)
    from .evalsets import prompt_labels

    return evaluate(model, tokenizer, prompts, proposer, job.decode, run_dir, method=job.decode.method,
                    target_name=tname, drafter_name=None, extra=extra,
                    grammars=grammar_plan(job.decode.grammar, convs, len(prompts)),
                    labels=prompt_labels(convs, len(prompts)))
