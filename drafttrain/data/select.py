"""Which conversations a training job reads: ``load_training_data`` (the training rows, tokenised, and the
held-out evaluation rows that go with them), ``describe_data`` (the log line saying so), and ``EvalSet`` (rows
plus a note on where they came from), and for jobs that only decode, ``eval_conversations`` (the evaluation rows
of ``data``) and ``eval_prompt_ids`` (their prompts, tokenised). Sources: data=builtin, data=jsonl (chat.py),
data=hub / data=file (data/sources.py: datasets by name and split; parquet / arrow / JSON(L) files). Used by the
training loop, eval, bench, tune, ``drafttrain capture`` and the scripts.
"""
from __future__ import annotations

from pathlib import Path

from ..io import DraftTrainError

__all__ = ["EvalSet", "held_out_note", "load_training_data", "describe_data", "eval_conversations", "eval_prompt_ids"]


class EvalSet(list):
    """Evaluation conversations, and a note saying which rows of what they are (printed with the count)."""

    def __init__(self, items=(), note: str = ""):
        super().__init__(items)
        self.note = note


def held_out_note(n: int, total: int, path) -> str:
    return (f"the last {n} of {total} rows of {path}, held out from training (data.num_eval={n}; "
            "data.eval_path=<file> evaluates on another file)")


def load_training_data(job, model, tokenizer, target_name: str, run_dir: Path):
    """Return (train examples, eval prompt conversations (an EvalSet: rows and where they came from), data
    stats)."""
    from .chat import tokenize_conversations

    d = job.data
    if d.source == "builtin":
        from ..io import cache_root
        from ..identity import target_identity
        from .builtin import builtin_dataset, corpus_of

        corpus = corpus_of(d.corpus, target_name)
        train_convs, eval_convs = builtin_dataset(  # keyed by what the target is, not where it was found
            model, tokenizer, target_id=target_identity(target_name), num_train=d.num_train, num_eval=d.num_eval,
            max_new_tokens=d.regen_max_new_tokens, regenerate=d.regenerate, temperature=d.regen_temperature,
            batch_size=d.regen_batch_size, cache_dir=cache_root() / "data", seed=d.seed, corpus=corpus,
            sampled_fraction=d.regen_sampled_fraction, answers=d.regen_answers,
        )
        eval_convs = EvalSet(eval_convs, f"{len(eval_convs)} built-in held-out {corpus} chats")
    elif d.source in FILE_SOURCES:
        train_convs, eval_convs = _file_training_rows(d)
    else:
        raise DraftTrainError(f"data.source={d.source}: expected builtin, {', '.join(FILE_SOURCES)}")
    held = getattr(eval_convs, "held_out", 0)
    note = f"the other {held} of its {held + len(train_convs)} rows are held out for evaluation (data.num_eval=" \
           f"{d.num_eval})" if held else ""
    examples, stats = tokenize_conversations(tokenizer, train_convs, d.max_length, d.overlong, note)
    return examples, eval_convs, stats


# Sources read from files or datasets: jsonl (chat.read_conversations), hub and file (data/sources.py).
FILE_SOURCES = ("jsonl", "hub", "file")


def _read(d, path, split: str, prompts_only: bool = False):
    """The conversations of ``path`` (and ``split``, for a dataset) as ``data`` (``d``) reads them."""
    fmt = getattr(d, "format", "auto")
    if d.source == "jsonl":
        from .chat import read_conversations

        return read_conversations(path, skip_invalid=d.skip_invalid, prompts_only=prompts_only, fmt=fmt)
    from .sources import read_source

    return read_source(path, split, getattr(d, "subset", None), fmt, d.skip_invalid, prompts_only,
                       hub=d.source == "hub")


def _label(d, path, split: str) -> str:
    from .sources import source_label

    return str(path) if d.source == "jsonl" else source_label(path, split)


def _eval_source(d):
    """``(path, split)`` of separate evaluation rows: ``data.eval_path`` (its ``data.eval_split``, default
    train), or for a dataset ``data.eval_split`` of ``data.path``; None: the last rows of ``data.path``."""
    eval_split = getattr(d, "eval_split", None)
    if d.eval_path:
        return d.eval_path, eval_split or "train"
    if d.source != "jsonl" and eval_split:
        return d.path, eval_split
    return None


def _file_training_rows(d):
    """(training conversations, EvalSet) of a file or dataset source."""
    if not d.path:
        raise DraftTrainError(f"data.path is required with data={d.source}")
    split = getattr(d, "split", "train")
    convs = _read(d, d.path, split)
    src = _eval_source(d)
    if src:  # train on every row; evaluate on the first num_eval rows of the other source (0: all)
        rows = _read(d, *src, prompts_only=True)
        sel = rows[: d.num_eval] if d.num_eval else rows
        return convs, EvalSet(sel, f"{len(sel)} of {len(rows)} rows of {_label(d, *src)}")
    n_eval = min(d.num_eval, max(0, len(convs) - 1))  # hold out the last num_eval rows (0: none, no final eval)
    held = EvalSet(convs[len(convs) - n_eval:], held_out_note(n_eval, len(convs), _label(d, d.path, split)))
    held.held_out = n_eval  # taken from the training rows of the same file (named when none is trainable)
    return convs[: len(convs) - n_eval], held


def describe_data(stats: dict, eval_convs) -> str:
    """One readable line: training rows and tokens, what was truncated or skipped, and the eval prompts."""
    parts = [f"data: {stats.get('rows', 0)} training rows, {stats.get('trainable_tokens', 0)} trainable tokens"]
    if stats.get("truncated"):
        parts.append(f"{stats['truncated']} truncated to data.max_length (data.overlong=skip drops them)")
    if stats.get("skipped"):
        parts.append(f"{stats['skipped']} skipped")
    note = getattr(eval_convs, "note", "") or f"{len(eval_convs)} conversations"
    return "; ".join(parts) + f". Eval prompts: {note}" if len(eval_convs) else \
        "; ".join(parts) + ". No eval prompts (data.num_eval=0): the final evaluation is skipped"


def eval_prompt_ids(tokenizer, convs, limit: int) -> list[list[int]]:
    """Prompt ids of the first ``limit`` conversations (0: all of them)."""
    from .chat import prompt_ids

    out = []
    for c in (convs[:limit] if limit else convs):
        if hasattr(c, "prompt_ids"):  # a structured row (drafttrain.structured.StructuredExample)
            out.append(c.prompt_ids(tokenizer))
            continue
        out.append(prompt_ids(tokenizer, c.messages if hasattr(c, "messages") else c))
    return out


def eval_conversations(data_cfg, target_path: str | None = None) -> EvalSet:
    """The evaluation set of ``data``: built-in held-out chats (of the corpus ``data.corpus`` names; ``auto``:
    the one the built-in target at ``target_path`` was trained on); a JSONL file's or a dataset's rows
    (``data.eval_path`` / ``data.eval_split``: its first ``data.num_eval``; else the last ``data.num_eval`` rows
    of ``data.path``, the rows training holds out; ``data.num_eval=0``: every row). Prompt files may leave the
    final assistant turn empty or out. ``data.source=structured`` (prompts with a JSON schema each) is read by
    ``structured.structured_eval_set``; the decoding jobs' ``evaluation.eval_conversations`` takes either."""
    n = int(data_cfg.num_eval)
    if data_cfg.source == "builtin":
        from .builtin import builtin_conversations, corpus_of

        if n == 0:
            raise DraftTrainError("data.num_eval=0 (every row) needs a prompt file (data=<file>.jsonl); the "
                                  "built-in set needs a count")
        corpus = corpus_of(getattr(data_cfg, "corpus", "auto"), target_path)
        return EvalSet(builtin_conversations("eval", n, data_cfg.seed, corpus),
                       f"{n} built-in held-out {corpus} chats")
    if data_cfg.source in FILE_SOURCES:
        src = _eval_source(data_cfg)
        if src:
            rows = _read(data_cfg, *src, prompts_only=True)
            sel = rows[:n] if n else rows
            return EvalSet(sel, f"{'every one' if len(sel) == len(rows) else f'the first {len(sel)}'} of "
                                f"{len(rows)} rows of {_label(data_cfg, *src)}")
        if not data_cfg.path:
            raise DraftTrainError(f"data.path (or data.eval_path) is required with data={data_cfg.source}")
        split = getattr(data_cfg, "split", "train")
        rows = _read(data_cfg, data_cfg.path, split, prompts_only=True)
        label = _label(data_cfg, data_cfg.path, split)
        if not n or n >= len(rows):
            return EvalSet(rows, f"every one of {len(rows)} rows of {label}")
        return EvalSet(rows[-n:], held_out_note(n, len(rows), label))
    if data_cfg.source == "structured":
        raise DraftTrainError("data.source=structured: rows with a JSON schema each are read by the decoding jobs "
                              "(drafttrain eval / bench: drafttrain.evaluation.eval_conversations)")
    raise DraftTrainError(f"data.source={data_cfg.source}: expected builtin, {', '.join(FILE_SOURCES)} or "
                          "structured")
