"""Evaluation sets in the speculative decoder: which rows a decoding job reads (``eval_conversations``: data's
evaluation rows or structured rows), a question set's turns as prompts, and τ, α per position and speedup per
category.

``turn_prompts`` turns each question into one prompt per turn. A multi-turn question is answered turn by turn:
turn t's prompt is the chat of the earlier user turns with the target's own greedy answers (our AR decoder,
``decode.max_new_tokens`` tokens) appended, as Spec-Bench's and EAGLE's scripts run MT-Bench. Under sampling the
history is still the greedy answer, so the AR baseline and the speculative decoder see the same prompts. A turn
whose prompt leaves no room for ``decode.max_new_tokens`` (and the draft) in the target's context is skipped with
the question's later turns, and counted per category.

``category_rows`` pools each category's generations (the report's ``categories``; the pooled total over all
prompts is the main report's numbers), each row with the decode settings it was measured under;
``print_categories`` and ``plot_categories`` show them.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

from ..data.select import EvalSet
from ..data.select import eval_conversations as data_eval_conversations
from ..structured import structured_eval_set

__all__ = ["eval_conversations", "TurnPrompt", "turn_prompts", "prompt_labels", "decode_settings", "category_rows", "print_categories",
           "categories_figure", "plot_categories"]


def eval_conversations(data_cfg, target_path: str | None = None) -> EvalSet:
    """The rows a decoding job (eval, bench, tune) reads: ``data.source=structured`` -> prompts with a JSON schema
    each (``structured.structured_eval_set``); any other source -> ``data.select.eval_conversations``."""
    if data_cfg.source == "structured":
        return structured_eval_set(data_cfg)
    return data_eval_conversations(data_cfg, target_path)


@dataclasses.dataclass
class TurnPrompt:
    """One turn of a question, tokenised with its history (``eval_prompt_ids`` reads ``prompt_ids``)."""

    ids: list[int]
    category: str
    qid: str
    turn: int  # 1-based

    def prompt_ids(self, tokenizer) -> list[int]:
        return self.ids


def _context_limit(model) -> int | None:
    from ..targets.load import text_config

    n = getattr(text_config(model.config), "max_position_embeddings", None)
    return int(n) if n else None


def _answerer(model, decode, limit: int | None):
    """Greedy AR in drafttrain's decoder (dynamic cache: prompts grow turn by turn)."""
    from ..decoding.engine import SpecDecoder
    from ..decoding.proposers import NoDraft
    from ..decoding.target import TargetRunner

    return SpecDecoder(TargetRunner(model, taps=None, max_len=limit, cache="dynamic"), NoDraft(), 0, seed=decode.seed)


def turn_prompts(model, tokenizer, qset, decode) -> tuple[EvalSet, dict]:
    """The prompts of every turn of ``qset`` (a ``QuestionSet``) and what was decoded: ``(EvalSet of
    TurnPrompt, info)``; ``info`` (the report's ``eval_set``) names the set, counts questions, turns and
    skipped turns per category."""
    from ..data.chat import prompt_ids, stop_token_ids
    from ..decoding.build import draft_positions

    limit = _context_limit(model)
    room = decode.max_new_tokens + draft_positions(decode) + 1
    eos = stop_token_ids(model, tokenizer)
    stops = set(eos)
    answer = _answerer(model, decode, limit) if any(len(q.turns) > 1 for q in qset.questions) else None
    out, skipped = [], Counter()
    for q in qset.questions:
        msgs = []
        for t, text in enumerate(q.turns):
            msgs.append({"role": "user", "content": text})
            ids = prompt_ids(tokenizer, msgs)
            if limit and len(ids) + room > limit:
                skipped[q.category] += len(q.turns) - t
                break
            out.append(TurnPrompt(ids, q.category, q.qid, t + 1))
            if t + 1 < len(q.turns):
                res = answer.generate(ids, decode.max_new_tokens, eos, seed=decode.seed)
                text = tokenizer.decode([x for x in res.tokens if x not in stops], skip_special_tokens=True)
                msgs.append({"role": "assistant", "content": text})
    info = {"set": qset.name, "path": qset.path, "questions": len(qset.questions), "questions_in_file": qset.total,
            "turn_prompts": len(out), "skipped_turns": dict(skipped), "context_limit": limit,
            "history": "earlier turns answered by the target, greedy (drafttrain's AR decoder)"}
    note = f"{len(out)} turns of {len(qset.questions)} questions of {qset.path}"
    if skipped:
        note += f"; {sum(skipped.values())} turns skipped (longer than the target's {limit}-token context)"
    return EvalSet(out, note), info


def prompt_labels(convs, n: int) -> list[tuple[str, str]] | None:
    """``(category, question id)`` of the first ``n`` evaluation rows, or None when they carry no category."""
    rows = list(convs)[:n]
    if not rows or not all(isinstance(r, TurnPrompt) for r in rows):
        return None
    return [(r.category, r.qid) for r in rows]


def decode_settings(report: dict) -> str:
    """The decode settings a number was measured under, in words (written beside every category row)."""
    t = report.get("temperature") or 0
    samp = "" if not t else f", T={t:g}, top-p {report.get('top_p', 1.0):g}, top-k {report.get('top_k') or 'off'}"
    shape = report.get("draft_shape") or f"K={report.get('num_draft_tokens')}"
    return f"{report['method']}, {shape}, {report.get('verification', '-')}{samp}"


def category_rows(ar: list, spec: list, match: list, labels: list, settings: str, greedy: bool) -> list[dict]:
    """Per category (in first-appearance order): τ, α, acceptance per position, tokens/s, speedup, pooled over
    its prompts' generations (all timed passes); ``ar``/``spec``/``match`` are ``Measured``'s lists (pass-major)."""
    from ..decoding.engine import aggregate

    n = len(labels)
    rows = []
    for cat in dict.fromkeys(c for c, _ in labels):
        idx = [j for j in range(len(spec)) if labels[j % n][0] == cat]
        S, A = aggregate([spec[j] for j in idx]), aggregate([ar[j] for j in idx])
        passes = max(1, len(spec) // n)
        rows.append({
            "category": cat, "questions": len({q for c, q in labels if c == cat}),
            "prompts": sum(1 for c, _ in labels if c == cat), "new_tokens": S["num_new_tokens"] // passes,
            "tau": S["tau"], "alpha": S["alpha"], "acceptance_per_position": S["acceptance_per_position"],
            "tokens_per_s": S["tokens_per_s"], "baseline_tokens_per_s": A["tokens_per_s"],
            "speedup": S["tokens_per_s"] / A["tokens_per_s"] if S["tokens_per_s"] and A["tokens_per_s"] else None,
            "outputs_match_baseline": all(match[j] for j in idx) if greedy else None, "decode": settings,
        })
    return rows


def _f(x, spec):
    return "-" if x is None else format(x, spec)


def print_categories(report: dict) -> None:
    """The per-category table, then the pooled total, with the decode settings above it."""
    rows = report.get("categories") or []
    if not rows:
        return
    info = report.get("eval_set") or {}
    head = f"{'category':<16} {'questions':>9} {'turns':>6} {'tokens':>7} {'tau':>6} {'alpha':>6}  {'speedup':>7}  " \
           "acceptance per position"
    lines = ["", f"per category: {info.get('set', '-')} ({report['categories'][0]['decode']})", head]
    total = {"category": "total (pooled)", "questions": sum(r["questions"] for r in rows),
             "prompts": sum(r["prompts"] for r in rows), "new_tokens": report["new_tokens"], "tau": report["tau"],
             "alpha": report["alpha"], "speedup": report["speedup"],
             "acceptance_per_position": report["acceptance_per_position"]}
    for r in [*rows, total]:
        app = " ".join(_f(a, ".2f") for a in r["acceptance_per_position"] or [])
        lines.append(f"{r['category'][:16]:<16} {r['questions']:>9} {r['prompts']:>6} {r['new_tokens']:>7} "
                     f"{_f(r['tau'], '.3f'):>6} {_f(r['alpha'], '.3f'):>6}  {_f(r['speedup'], '.2f') + 'x':>7}  {app}")
    if info.get("skipped_turns"):
        lines.append("skipped (longer than the target's context): " +
                     ", ".join(f"{c} {k}" for c, k in info["skipped_turns"].items()))
    print("\n".join(lines), flush=True)


def categories_figure(report: dict):
    """τ per category as bars (the speedup written on each), the pooled total last, each category's prompt count
    under its name; legend; the sample and the decode settings in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = report.get("categories") or []
    names = [f"{r['category']} ({r['prompts']})" for r in rows] + [f"total ({report.get('prompts', '-')})"]
    taus = [r["tau"] or 0.0 for r in rows] + [report["tau"] or 0.0]
    spd = [r["speedup"] for r in rows] + [report["speedup"]]
    fig, ax = plt.subplots(figsize=(max(5.4, 0.55 * len(names) + 1.5), 4.0), dpi=120)
    bars = ax.bar(range(len(names)), taus, color=["#4C72B0"] * len(rows) + ["#55A868"])
    for b, s in zip(bars, spd):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{_f(s, '.2f')}x", ha="center", va="bottom",
                fontsize=7)
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("τ (tokens per target forward)")
    ax.set_ylim(0, max(taus + [1.0]) * 1.45)  # room for the legend above the bars
    ax.legend(handles=[Patch(color="#4C72B0", label="τ per category (its prompts)"),
                       Patch(color="#55A868", label="all categories pooled"),
                       Patch(color="none", label="on each bar: speedup vs AR")], fontsize=7, loc="upper left")
    passes = int(report.get("repeats") or 1)
    n = max(1, int(report.get("prompts") or 0))
    sample = (f"{report.get('prompts', '-')} prompts ({sum(r['questions'] for r in rows)} questions) x "
              f"{(report.get('new_tokens') or 0) / n:.0f} new tokens (avg), {passes} timed pass{'es' * (passes != 1)}")
    import textwrap

    ax.set_title(f"{(report.get('eval_set') or {}).get('set', '')}\n"
                 + "\n".join(textwrap.wrap(f"{sample}; {rows[0]['decode'] if rows else ''}", 80)), fontsize=8)
    return fig


def plot_categories(report: dict, path: Path) -> None:
    from ..io import save_figure

    save_figure(categories_figure(report), path)
