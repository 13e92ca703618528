"""Rewrite every assistant turn of a chat dataset with the target's own output (``drafttrain regenerate``).

A drafter must predict what the *target* generates, not what some other model wrote, so training data is
self-distilled: each assistant turn is replaced by the target's answer given the preceding (already
regenerated) turns.

Batching: conversations are cut into fixed chunks of ``batch_size`` consecutive rows; within a chunk, turn r of
every conversation is generated in one left-padded ``model.generate`` call (r = 0, 1, ...). Chunks depend only
on the input, never on what is already done, so a resumed run does exactly the same computations (and with
``temperature > 0`` draws the same samples: the RNG is reseeded per chunk from ``seed``) as an uninterrupted one.

Output (JSONL, OpenAI shape): ``{"id": <row id, or its line number>, "messages": [...]}`` per row, in input
order, appended and flushed one row at a time. A row the target cannot answer (empty answer to its first
assistant turn, or a prompt that does not fit the model's positions) is written as
``{"id": ..., "messages": [...], "dropped": "<why>"}`` so that resume knows it is done;
:func:`drafttrain.data.chat.read_conversations` skips such rows. An empty answer to a later turn ends the
conversation before that turn. Settings are recorded next to the output in ``<out>.meta.json``; resuming with
different generation settings is refused.

Truncation: a turn is *truncated* when the target produced ``max_new_tokens`` tokens without any of its stop
tokens (:func:`eos_token_ids`); it is counted per turn (``truncated_turns``; ``truncated_rows`` = rows with at
least one) and :func:`describe_stats` reports it as a count and a percentage. With ``drop_truncated=True`` a
conversation ends before its first truncated turn, like an empty answer: the row keeps its earlier, complete
turns, or, when its first answer is the truncated one, is written as a ``"dropped"`` row (so resume still knows
it is done, and readers skip it). Kept rows stay in input order. ``drop_truncated`` is one of the checked
settings (a resumed run must use the same value).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..io import DraftTrainError, read_json, write_json
from .chat import Conversation, prompt_ids, read_conversations

__all__ = ["regenerate_conversations", "regenerate_file", "regenerate_to_jsonl", "eos_token_ids", "describe_stats",
           "resumable_output", "read_input", "new_stats"]

META_SUFFIX = ".meta.json"
# a resumed run must match these (a meta file without "backend" was written by the HF path, before it was recorded)
_CHECKED_SETTINGS = ("backend", "max_new_tokens", "temperature", "top_p", "seed", "model", "drop_truncated")


def eos_token_ids(model, tokenizer) -> list[int]:
    """Stop tokens: the model's generation_config eos (int or list) plus the tokenizer's eos; an error when
    there is none (generation would never stop). The definition is ``data/chat.stop_token_ids``."""
    from .chat import stop_token_ids

    return stop_token_ids(model, tokenizer, required=True)


def _pad_id(tokenizer, eos_ids: list[int]) -> int:
    return int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else eos_ids[0]


def _generation_config(model, max_new_tokens: int, temperature: float, top_p: float, pad_id: int, eos_ids):
    from transformers import GenerationConfig

    base = getattr(model, "generation_config", None)
    gc = copy.deepcopy(base) if base is not None else GenerationConfig()
    sample = temperature > 0
    gc.update(
        max_new_tokens=int(max_new_tokens),
        min_new_tokens=None,
        max_length=None,
        do_sample=sample,
        temperature=float(temperature) if sample else None,
        top_p=float(top_p) if sample else None,
        top_k=None,
        num_beams=1,
        num_return_sequences=1,
        repetition_penalty=None,
        pad_token_id=pad_id,
        eos_token_id=list(eos_ids),
        use_cache=True,
    )
    return gc


def _max_positions(model) -> int | None:
    cfg = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device):
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _validate_settings(batch_size, max_new_tokens, temperature, top_p):
    if int(batch_size) < 1:
        raise DraftTrainError(f"batch_size={batch_size}: must be >= 1")
    if int(max_new_tokens) < 1:
        raise DraftTrainError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    if temperature < 0:
        raise DraftTrainError(f"temperature={temperature}: must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise DraftTrainError(f"top_p={top_p}: must be in (0, 1]")


def _generate_batch(model, tokenizer, prompts: list[list[int]], gc, eos_ids, pad_id) -> list[tuple[str, int, bool]]:
    """Left-padded batched generation; per prompt (text without eos, new tokens incl. eos, stopped at eos)."""
    device = _model_device(model)
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), L), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p) :] = torch.tensor(p, dtype=torch.long)
        attn[b, L - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), generation_config=gc)
    if hasattr(out, "sequences"):
        out = out.sequences
    new = out[:, L:].tolist()
    eos = set(eos_ids)
    results = []
    for row in new:
        stop = next((j for j, t in enumerate(row) if t in eos), None)
        toks = row if stop is None else row[:stop]
        text = tokenizer.decode(toks, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        results.append((text, len(toks) + (stop is not None), stop is not None))
    return results


def _stop(state: dict, why: str) -> bool:
    """End a conversation: after its last regenerated assistant turn, or drop it if it has none (True)."""
    state["pending"] = []
    msgs = state["messages"]
    last = max((j for j, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    if last is None:
        state["dropped"] = why
        return True
    del msgs[last + 1 :]
    return False


def _finish(conv: Conversation, state: dict) -> dict:
    row = {"id": conv.row_id, "messages": state["messages"]}
    if state["dropped"] is not None:
        row["dropped"] = state["dropped"]
    return row


def _as_conversations(convs) -> list[Conversation]:
    return [
        c if isinstance(c, Conversation) else Conversation(messages=list(c), line=i + 1) for i, c in enumerate(convs)
    ]


@dataclasses.dataclass
class _Generation:
    """The target and the generation settings every chunk uses."""

    model: Any
    tokenizer: Any
    gc: Any  # transformers.GenerationConfig
    eos_ids: list[int]
    pad_id: int
    max_pos: int | None  # the model's positions (None: unknown)
    max_new_tokens: int
    drop_truncated: bool

    @classmethod
    def of(cls, model, tokenizer, max_new_tokens: int, temperature: float, top_p: float, drop_truncated: bool):
        eos_ids = eos_token_ids(model, tokenizer)
        pad_id = _pad_id(tokenizer, eos_ids)
        gc = _generation_config(model, max_new_tokens, temperature, top_p, pad_id, eos_ids)
        return cls(model, tokenizer, gc, eos_ids, pad_id, _max_positions(model), int(max_new_tokens),
                   bool(drop_truncated))


def _turn_prompts(gen: _Generation, state: dict, ask: list[int]) -> tuple[list[list[int]], list[int]]:
    """The prompts of the next assistant turn of the conversations ``ask``; a prompt that does not fit the model's
    positions ends its conversation instead. Returns ``(prompts, asked)``."""
    prompts, asked = [], []
    for i in ask:
        # everything so far (earlier regenerated turns included) + the generation prompt; the
        # placeholder answer marks where the prompt ends (prompt_ids cuts at the last assistant turn)
        p = prompt_ids(gen.tokenizer, [*state[i]["messages"], {"role": "assistant", "content": ""}])
        if gen.max_pos is not None and len(p) + gen.max_new_tokens > gen.max_pos:
            _stop(
                state[i],
                f"prompt is {len(p)} tokens; with max_new_tokens={gen.max_new_tokens} that exceeds the "
                f"model's {gen.max_pos} positions",
            )
        else:
            prompts.append(p)
            asked.append(i)
    return prompts, asked


def _take_answers(gen: _Generation, state: dict, asked: list[int], answers, todo: set[int], stats: dict) -> None:
    """Append each generated answer to its conversation (counted when the row is to be written); an empty or
    (``drop_truncated``) truncated answer ends the conversation."""
    for i, (text, n_new, finished) in zip(asked, answers):
        s = state[i]
        s["pending"].pop(0)
        if i in todo:
            stats["turns"] += 1
            stats["new_tokens"] += n_new
            stats["truncated_turns"] += not finished
        s["truncated"] += not finished
        if not finished and gen.drop_truncated:
            dropped = _stop(s, f"the target's answer stopped at max_new_tokens={gen.max_new_tokens} "
                               "(drop_truncated)")
            s["cut"] = "dropped" if dropped else "cut"
        elif text.strip():
            s["messages"].append({"role": "assistant", "content": text})
        else:
            _stop(s, "the target's answer is empty")


def new_state(conv: Conversation) -> dict:
    """A conversation's regeneration state: its messages so far, the input turns still to come (``pending``)."""
    return {"messages": [], "dropped": None, "pending": list(conv.messages), "truncated": 0, "cut": None}


def next_turn(s: dict) -> bool:
    """Move the input turns before the next assistant turn into ``s["messages"]``; True if one is to be asked."""
    while s["pending"] and s["pending"][0]["role"] != "assistant":
        s["messages"].append(dict(s["pending"].pop(0)))
    return bool(s["pending"])


def _regenerate_chunk(gen: _Generation, convs: list[Conversation], chunk: list[int], todo: set[int],
                      stats: dict) -> dict:
    """Regenerate the conversations ``chunk``, turn r of all of them in one batch (r = 0, 1, ...); their states.
    The whole chunk is generated even if part of it is done: same batches as an uninterrupted run."""
    state = {i: new_state(convs[i]) for i in chunk}
    while True:
        ask = [i for i in chunk if next_turn(state[i])]
        if not ask:
            return state
        prompts, asked = _turn_prompts(gen, state, ask)
        if asked:
            answers = _generate_batch(gen.model, gen.tokenizer, prompts, gen.gc, gen.eos_ids, gen.pad_id)
            _take_answers(gen, state, asked, answers, todo, stats)


def _chunk_rows(convs: list[Conversation], chunk: list[int], state: dict, todo: set[int], stats: dict) -> list:
    """The output rows ``(index, row)`` of a regenerated chunk's conversations to be written, counted in ``stats``."""
    out = []
    for i in chunk:
        if i not in todo:
            continue
        row = _finish(convs[i], state[i])
        stats["rows"] += 1
        stats["dropped"] += "dropped" in row
        stats["truncated_rows"] += state[i]["truncated"] > 0
        stats["truncated_dropped"] += state[i]["cut"] == "dropped"
        stats["truncated_cut"] += state[i]["cut"] == "cut"
        out.append((i, row))
    return out


def new_stats(max_new_tokens: int, drop_truncated: bool) -> dict[str, Any]:
    """The counters of a regenerate run (see :func:`regenerate_conversations`), all zero."""
    return {"rows": 0, "dropped": 0, "turns": 0, "truncated_turns": 0, "truncated_rows": 0, "truncated_dropped": 0,
            "truncated_cut": 0, "new_tokens": 0, "max_new_tokens": int(max_new_tokens),
            "drop_truncated": bool(drop_truncated)}


def regenerate_conversations(
    model, tokenizer, convs: Sequence[Conversation | Sequence[dict]], batch_size: int = 16, max_new_tokens: int = 256,
    temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, progress: bool = True,
    skip: Callable[[int], bool] | None = None, on_row: Callable[[int, dict], None] | None = None,
    drop_truncated: bool = False,
) -> tuple[list[dict], dict[str, Any]]:
    """Regenerate the assistant turns of ``convs`` in memory.

    Returns ``(rows, stats)``: one output row per conversation not skipped (``skip(index)`` true = already done),
    in input order, each ``{"id", "messages"}`` (plus ``"dropped": why`` when the target could not answer);
    ``on_row(index, row)`` is called as soon as a row is final, in input order. Stats: rows, dropped (rows
    written as dropped, any reason), turns (generated), truncated_turns (stopped at max_new_tokens without a stop
    token), truncated_rows (rows with at least one), and with ``drop_truncated``: truncated_dropped (rows dropped
    because their first answer was truncated) and truncated_cut (rows ended before a later truncated turn);
    new_tokens, seconds, max_new_tokens, drop_truncated.
    """
    _validate_settings(batch_size, max_new_tokens, temperature, top_p)
    convs = _as_conversations(convs)
    todo = {i for i in range(len(convs)) if not (skip is not None and skip(i))}
    stats = new_stats(max_new_tokens, drop_truncated)
    if not todo:
        stats["seconds"] = 0.0
        return [], stats
    if model is None:
        raise DraftTrainError(f"{len(todo)} conversations need regenerating but no target model was given")
    gen = _Generation.of(model, tokenizer, max_new_tokens, temperature, top_p, drop_truncated)
    device = _model_device(model)
    rows: list[dict] = []
    t0 = time.time()
    was_training = bool(getattr(model, "training", False))
    model.eval()
    bar = None
    if progress and todo:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="regenerate", unit="conv", mininterval=2.0)
    try:
        for start in range(0, len(convs), batch_size):
            chunk = list(range(start, min(start + batch_size, len(convs))))
            if not todo.intersection(chunk):
                continue
            with _seeded(seed * 1_000_003 + start, device):
                state = _regenerate_chunk(gen, convs, chunk, todo, stats)
            for i, row in _chunk_rows(convs, chunk, state, todo, stats):
                rows.append(row)
                if on_row is not None:
                    on_row(i, row)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        if was_training:
            model.train()
    stats["seconds"] = round(time.time() - t0, 2)
    return rows, stats


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{seconds:.1f}s"
    h, rem = divmod(s, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def describe_stats(stats: dict[str, Any], max_new_tokens_key: str = "max_new_tokens",
                   drop_key: str | None = "drop_truncated") -> str:
    """One readable line for the stats of a regenerate run (regenerate_conversations / regenerate_to_jsonl):
    rows and turns generated, how many turns stopped at max_new_tokens (count and percentage) with what to do
    about it, and what was dropped. ``max_new_tokens_key`` / ``drop_key`` name the settings in the hint (the
    built-in data path has its own names; ``drop_key=None``: no drop option to suggest)."""
    rows, turns = int(stats.get("rows", 0)), int(stats.get("turns", 0))
    done, total = stats.get("already_done"), stats.get("total")
    head = f"regenerated {rows} rows ({turns} turns, {int(stats.get('new_tokens', 0))} new tokens) in " \
           f"{_duration(float(stats.get('seconds', 0.0)))}"
    if done:
        head += f"; {done} of {total} rows were already done"
    parts = [head]
    n_trunc, limit = int(stats.get("truncated_turns", 0)), stats.get("max_new_tokens")
    if n_trunc:
        pct = 100.0 * n_trunc / max(1, turns)
        line = (f"{n_trunc} turns ({pct:.1f}%) in {int(stats.get('truncated_rows', 0))} rows stopped at "
                f"{max_new_tokens_key}={limit} without an end token")
        if stats.get("drop_truncated"):
            line += (f"; kept out ({drop_key or 'drop_truncated'}): {int(stats.get('truncated_dropped', 0))} rows "
                     f"dropped, {int(stats.get('truncated_cut', 0))} rows ended before their truncated turn")
        elif drop_key:
            line += f": raise {max_new_tokens_key} or set {drop_key}=true to keep them out of training"
        else:
            line += f": raise {max_new_tokens_key} to keep them complete"
        parts.append(line)
    elif turns:
        parts.append(f"no turn stopped at {max_new_tokens_key}={limit}")
    other = int(stats.get("dropped", 0)) - int(stats.get("truncated_dropped", 0))
    if other:
        parts.append(f"{other} rows dropped (the target could not answer: empty answer or prompt too long)")
    if stats.get("invalid_skipped"):
        parts.append(f"{stats['invalid_skipped']} invalid input rows skipped")
    return "; ".join(parts)


# ------------------------------------------------------------------------------------------ resumable output


def _row_key(rid: Any) -> str:
    return json.dumps(rid)


def _recover_output(out_path: Path) -> list[str]:
    """Keys of the rows already in ``out_path``; a torn last line (crash mid-write) is truncated away first."""
    if not out_path.exists():
        return []
    data = out_path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1  # 0 when the only line is torn
        with open(out_path, "r+b") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
        data = data[:cut]
    keys = []
    for lineno, line in enumerate(data.split(b"\n")[:-1] if data else [], start=1):
        where = f"{out_path}:{lineno}"
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DraftTrainError(
                f"{where}: not a regenerate output row ({e}); refusing to append — delete the file or pick another "
                "output path"
            ) from None
        if not isinstance(row, dict) or "id" not in row or "messages" not in row:
            raise DraftTrainError(
                f'{where}: not a regenerate output row (needs "id" and "messages"); refusing to append — delete the '
                "file or pick another output path"
            )
        keys.append((_row_key(row["id"]), where))
    return keys


def _settings(model, max_new_tokens, temperature, top_p, seed, batch_size, drop_truncated=False) -> dict:
    from ..identity import target_identity

    cfg = getattr(model, "config", None)
    path = None if model is None else str(getattr(cfg, "_name_or_path", "") or getattr(model, "name_or_path", ""))
    return {
        "backend": "hf",
        "model": None if path is None else target_identity(path),  # what it is (checked), not where it was
        "model_path": path,  # where it was read from (not checked)
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "seed": int(seed),
        "batch_size": int(batch_size),
        "drop_truncated": bool(drop_truncated),
    }


def _check_meta(meta_path: Path, settings: dict, has_rows: bool) -> None:
    if not meta_path.exists():
        return
    old = read_json(meta_path)
    if isinstance(old, dict):
        old = {"backend": "hf", **old}
    from ..identity import same_target

    diffs = [
        f"{k}: {old.get(k)!r} -> {settings[k]!r}"
        for k in _CHECKED_SETTINGS
        if isinstance(old, dict) and k in old and settings[k] is not None and old.get(k) != settings[k]
        and not (k == "model" and same_target(old.get(k), settings[k]))  # an older record holds a path
    ]
    if diffs and has_rows:
        raise DraftTrainError(
            f"{meta_path}: the existing output was generated with other settings ({'; '.join(diffs)}); "
            "resuming would mix them — use the same settings, or delete the output to start over"
        )


@contextlib.contextmanager
def _exclusive(out_path: Path, wait: bool):
    """An exclusive lock on the output (one writer at a time)."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "ab") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise DraftTrainError(f"{out_path}: another process is writing it (locked)") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _index_by_id(convs: list[Conversation]) -> dict[str, int]:
    """Row key -> index; every row needs an id (or line number), unique in the input."""
    index: dict[str, int] = {}
    for i, c in enumerate(convs):
        k = _row_key(c.row_id)
        if c.row_id is None:
            raise DraftTrainError(f"{c.where}: conversation has no id and no line number; cannot resume by id")
        if k in index:
            raise DraftTrainError(f"{c.where}: duplicate id {c.row_id!r} (also {convs[index[k]].where})")
        index[k] = i
    return index


def _done_rows(out_path: Path, index: dict[str, int]) -> set[int]:
    """Indices of the input rows already in ``out_path`` (a row of another dataset there is an error)."""
    done_keys = _recover_output(out_path)
    for k, where in done_keys:
        if k not in index:
            raise DraftTrainError(
                f"{where}: row id {json.loads(k)!r} is not in the input; the output belongs to another dataset — "
                "delete it or pick another output path"
            )
    return {index[k] for k, _ in done_keys}


@contextlib.contextmanager
def resumable_output(out_path: str | os.PathLike, convs: Sequence[Conversation], settings: dict,
                     wait_for_lock: bool = False, can_generate: bool = True):
    """The append-only output of a regenerate run, shared by every backend: locks ``out_path``, drops a torn last
    line, finds the rows already there (by id; a row of another dataset is an error), refuses a resume whose
    ``settings`` differ from the recorded ones (``<out>.meta.json``) and records them when rows remain. Yields
    ``(done, write)``: the indices of ``convs`` already written and ``write(row)``, which appends one row and
    flushes it (rows are written in the order ``write`` is called)."""
    out_path = Path(out_path)
    convs = _as_conversations(convs)
    index = _index_by_id(convs)
    meta_path = out_path.with_name(out_path.name + META_SUFFIX)
    with _exclusive(out_path, wait_for_lock):
        done = _done_rows(out_path, index)
        _check_meta(meta_path, settings, bool(done))
        if len(done) < len(convs):
            if not can_generate:
                raise DraftTrainError(
                    f"{out_path}: {len(convs) - len(done)} of {len(convs)} rows still need regenerating, but no "
                    "target model was given"
                )
            write_json(meta_path, settings)
        with open(out_path, "a", encoding="utf-8") as f:

            def write(row: dict) -> None:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                f.flush()

            try:
                yield done, write
            finally:
                f.flush()
                os.fsync(f.fileno())


def regenerate_to_jsonl(
    model,
    tokenizer,
    convs: Sequence[Conversation],
    out_path: str | os.PathLike,
    batch_size: int = 16,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    progress: bool = True,
    wait_for_lock: bool = False,
    drop_truncated: bool = False,
) -> dict[str, Any]:
    """Regenerate ``convs`` into ``out_path`` (append-only, resumable). Stats as regenerate_conversations plus
    ``already_done`` (rows found in the output) and ``total``."""
    _validate_settings(batch_size, max_new_tokens, temperature, top_p)
    convs = _as_conversations(convs)
    settings = _settings(model, max_new_tokens, temperature, top_p, seed, batch_size, drop_truncated)
    with resumable_output(out_path, convs, settings, wait_for_lock, can_generate=model is not None) as (done, write):
        _, stats = regenerate_conversations(
            model, tokenizer, convs, batch_size=batch_size, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, seed=seed, progress=progress, skip=done.__contains__,
            on_row=lambda i, row: write(row), drop_truncated=drop_truncated,
        )
    stats["already_done"] = len(done)
    stats["total"] = len(convs)
    return stats


def read_input(in_path: str | os.PathLike, out_path: str | os.PathLike, skip_invalid: bool = False):
    """The conversations of ``in_path`` (``read_conversations``); an output path that is the input is an error."""
    in_path, out_path = Path(in_path), Path(out_path)
    if out_path.resolve() == in_path.resolve() or (
        out_path.exists() and in_path.exists() and os.path.samefile(in_path, out_path)
    ):
        raise DraftTrainError(f"{out_path}: output is the input file; refusing to overwrite the input")
    return read_conversations(in_path, skip_invalid=skip_invalid)


def regenerate_file(
    model,
    tokenizer,
    in_path: str | os.PathLike,
    out_path: str | os.PathLike,
    batch_size: int = 16,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    progress: bool = True,
    skip_invalid: bool = False,
    drop_truncated: bool = False,
) -> dict[str, Any]:
    """Regenerate the assistant turns of the JSONL file ``in_path`` into ``out_path`` (resumable).

    Rows keep their ``id`` (their line number if they have none). On rerun, rows already in ``out_path`` are
    skipped; a torn last line is removed first. ``in_path`` is only read. ``drop_truncated``: end each
    conversation before its first turn that stopped at ``max_new_tokens`` (see the module docstring).
    """
    convs = read_input(in_path, out_path, skip_invalid)
    stats = regenerate_to_jsonl(
        model,
        tokenizer,
        convs,
        out_path,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        progress=progress,
        drop_truncated=drop_truncated,
    )
    stats["invalid_skipped"] = len(convs.skipped)
    return stats
