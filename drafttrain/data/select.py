"""Which conversations a training job reads: ``load_training_data`` (the training rows, tokenised, and the
held-out evaluation rows that go with them), ``describe_data`` (the log line saying so), and ``EvalSet`` (rows
plus a note on where they came from), and for jobs that only decode, ``eval_conversations`` (the evaluation rows
of ``data``) and ``eval_prompt_ids`` (their prompts, tokenised). Used by the training loop, eval, bench, tune,
``drafttrain capture`` and the scripts.
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
    from .chat import read_conversations, tokenize_conversations

    d = job.data
    if d.source == "builtin":
        from ..targets.builtin import cache_root
        from .builtin import builtin_dataset, corpus_of

        corpus = corpus_of(d.corpus, target_name)
        train_convs, eval_convs = builtin_dataset(
            model, tokenizer, target_id=target_name, num_train=d.num_train, num_eval=d.num_eval,
            max_new_tokens=d.regen_max_new_tokens, regenerate=d.regenerate, temperature=d.regen_temperature,
            batch_size=d.regen_batch_size, cache_dir=cache_root() / "data", seed=d.seed, corpus=corpus,
        )
        eval_convs = EvalSet(eval_convs, f"{len(eval_convs)} built-in held-out {corpus} chats")
    elif d.source == "jsonl":
        if not d.path:
            raise DraftTrainError("data.path is required with data=jsonl")
        convs = read_conversations(d.path, skip_invalid=d.skip_invalid)
        if d.eval_path:  # train on every row; evaluate on the first num_eval rows of the other file (0: all)
            rows = read_conversations(d.eval_path, skip_invalid=d.skip_invalid, prompts_only=True)
            sel = rows[: d.num_eval] if d.num_eval else rows
            train_convs, eval_convs = convs, EvalSet(sel, f"{len(sel)} of {len(rows)} rows of {d.eval_path}")
        else:  # hold out the last num_eval rows (0: none, and no final evaluation)
            n_eval = min(d.num_eval, max(0, len(convs) - 1))
            train_convs = convs[: len(convs) - n_eval]
            eval_convs = EvalSet(convs[len(convs) - n_eval:], held_out_note(n_eval, len(convs), d.path))
    else:
        raise DraftTrainError(f"data.source={d.source}: expected builtin or jsonl")
    examples, stats = tokenize_conversations(tokenizer, train_convs, d.max_length, d.overlong)
    return examples, eval_convs, stats


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
    the one the built-in target at ``target_path`` was trained on); a JSONL file's rows (``data.eval_path``: its
    first ``data.num_eval``; else the last ``data.num_eval`` rows of ``data.path``, the rows training holds
    out; ``data.num_eval=0``: every row); or structured rows. Prompt files may leave the final assistant turn
    empty or out."""
    from .chat import read_conversations

    n = int(data_cfg.num_eval)
    if data_cfg.source == "builtin":
        from .builtin import builtin_conversations, corpus_of

        if n == 0:
            raise DraftTrainError("data.num_eval=0 (every row) needs a prompt file (data=<file>.jsonl); the "
                                  "built-in set needs a count")
        corpus = corpus_of(getattr(data_cfg, "corpus", "auto"), target_path)
        return EvalSet(builtin_conversations("eval", n, data_cfg.seed, corpus),
                       f"{n} built-in held-out {corpus} chats")
    if data_cfg.source == "jsonl":
        if data_cfg.eval_path:
            rows = read_conversations(data_cfg.eval_path, skip_invalid=data_cfg.skip_invalid, prompts_only=True)
            sel = rows[:n] if n else rows
            return EvalSet(sel, f"{'every one' if len(sel) == len(rows) else f'the first {len(sel)}'} of "
                                f"{len(rows)} rows of {data_cfg.eval_path}")
        if not data_cfg.path:
            raise DraftTrainError("data.path (or data.eval_path) is required with data=jsonl")
        rows = read_conversations(data_cfg.path, skip_invalid=data_cfg.skip_invalid, prompts_only=True)
        if not n or n >= len(rows):
            return EvalSet(rows, f"every one of {len(rows)} rows of {data_cfg.path}")
        return EvalSet(rows[-n:], held_out_note(n, len(rows), data_cfg.path))
    if data_cfg.source == "structured":  # prompts with a JSON schema each (drafttrain.structured.evalset)
        from ..structured import builtin_structured_examples, read_structured_jsonl

        path = data_cfg.eval_path or data_cfg.path
        if path:
            rows = read_structured_jsonl(path, limit=n or None)
            return EvalSet(rows, f"{len(rows)} structured rows of {path}")
        if n == 0:
            raise DraftTrainError("data.num_eval=0 (every row) needs a structured prompt file (data.path)")
        return EvalSet(builtin_structured_examples("eval", n, data_cfg.seed,
                                                   max_string_length=data_cfg.structured_max_string_length),
                       f"{n} built-in structured prompts")
    raise DraftTrainError(f"data.source={data_cfg.source}: expected builtin, jsonl or structured")
