"""Which conversations a training job reads: ``load_training_data`` (the training rows, tokenised, and the
held-out evaluation rows that go with them), ``describe_data`` (the log line saying so), and ``EvalSet`` (rows
plus a note on where they came from). Used by the training loop, ``drafttrain capture`` and the scripts;
evaluation-only jobs pick their rows with ``drafttrain.eval.eval_conversations``.
"""
from __future__ import annotations

from pathlib import Path

from ..io import DraftTrainError

__all__ = ["EvalSet", "held_out_note", "load_training_data", "describe_data"]


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
