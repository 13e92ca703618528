"""Evaluate a drafter in the speculative decoder: AR baseline vs speculative, side by side.

:func:`evaluate` = ``prepare`` -> ``measure`` -> ``sweep`` -> ``build_report`` -> ``write_report`` (evaluation/
measure.py, evaluation/report.py; ``decode.batch_sizes``: the batch sweep, evaluation/batch_sweep.py);
:func:`evaluate_drafter` builds the proposer of a loaded drafter (the training loop's evaluations call it);
:func:`run_eval` is ``drafttrain eval`` (the job's target, drafter and prompts). Writes ``report.json`` (and the
plots) into the run directory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
from pathlib import Path

import torch

from ..artifacts import drafter_type, load, recorded_target
from ..data.select import eval_prompt_ids
from ..io import DraftTrainError, write_json
from .batch_sweep import batch_sweep
from .evalsets import eval_conversations, prompt_labels, turn_prompts
from .measure import measure, prepare, sweep
from .report import build_report, fmt, write_report



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

    ``labels``: ``(category, question id)`` per prompt (a standard evaluation set, ``drafttrain.evaluation.evalsets``): the
    report adds ``categories``, one row per category, printed and plotted as ``categories.png``.
    """
    run = prepare(model, tokenizer, prompts, proposer, decode, method=method, taps=taps, grammars=grammars)
    run.labels = labels
    measured = measure(run)
    report = build_report(run, measured, sweep(run, measured), target_name=target_name, drafter_name=drafter_name,
                          train_estimated_tau=train_estimated_tau, extra=extra)
    if list(getattr(decode, "batch_sizes", None) or []):
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
    print(f"sampled (T={temperature:g}, top-p {top_p:g}): tau {fmt(r['tau'], '.3f')}, alpha "
          f"{fmt(r['alpha'], '.3f')}, speedup {fmt(r['speedup'], '.2f')}x ({r['verification']}); "
          f"greedy: tau {fmt(report['tau'], '.3f')}", flush=True)
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
    from ..decoding.build import decode_cache_length, make_proposer, target_taps

    method = decode.method
    proposer = make_proposer(method, drafter=drafter, decode=decode, max_len=decode_cache_length(prompts, decode),
                             device=next(model.parameters()).device)
    taps = target_taps(method, drafter, model)  # Medusa: the last hidden state (post-norm in transformers 5)
    from ..structured import grammar_plan

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
    """The target ``job.drafter`` (a saved drafter directory) names, if any."""
    if not job.drafter:
        return None
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
    model, drafter, extra = load(job.drafter, model)  # Medusa-2 also changes the target: its LoRA adapter merged
    dvocab = drafter.vocab_size if kind in ("medusa", "medusa2") else drafter.config.vocab_size
    tvocab = model.get_output_embeddings().weight.shape[0]
    if dvocab != tvocab:
        raise DraftTrainError(f"drafter vocabulary ({dvocab}) differs from the target's ({tvocab})")
    return model, drafter, extra


def _job_prompts(job, model, tokenizer, tname: str, extra: dict | None):
    """The evaluation rows: ``eval.set``'s questions turn by turn (the report's ``eval_set`` goes into
    ``extra``), else ``data``'s evaluation rows."""
    if not job.eval.set:
        return eval_conversations(job.data, tname), extra
    from ..data.questions import load_question_set
    convs, info = turn_prompts(model, tokenizer, load_question_set(job.eval), job.decode)
    if not convs:
        raise DraftTrainError(f"eval.set={job.eval.set}: no turn fits the target's context "
                              f"({info['context_limit']} tokens) with decode.max_new_tokens={job.decode.max_new_tokens}")
    return convs, {**(extra or {}), "eval_set": info}


def run_eval(job, run_dir: Path) -> dict:
    """``drafttrain eval``: ``job`` is an ``EvalJob`` (drafttrain/config.py); the report goes into ``run_dir``."""
    from ..decoding.build import decode_cache_length, make_proposer
    from ..structured import grammar_plan
    from ..targets.load import load_target, target_id

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
    return evaluate(model, tokenizer, prompts, proposer, job.decode, run_dir, method=job.decode.method,
                    target_name=tname, drafter_name=None, extra=extra,
                    grammars=grammar_plan(job.decode.grammar, convs, len(prompts)),
                    labels=prompt_labels(convs, len(prompts)))
