"""Chat data: JSONL conversations -> messages -> token ids + assistant loss mask.

Input rows (one JSON object per line) come in two shapes, both normalised to OpenAI-style messages
``[{"role": "system"|"user"|"assistant", "content": str}, ...]``:

- ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system"|..., "value": "..."}]}``
- OpenAI:   ``{"messages": [{"role": "...", "content": "..."}]}``
- Magpie:   ``{"instruction": "...", "response": "..."}`` (one user turn and its answer; Magpie rows that carry
  ``conversations`` are ShareGPT-shaped)

``data.format`` names the shape (``FORMATS``; :func:`preset_row` maps each to the first two, which
:func:`parse_row` validates, the one parser): ``auto`` reads each row by its keys (a dataset: by its columns,
:func:`detect_format`), ``ultrachat`` is OpenAI ``messages`` with the id in ``prompt_id``.

An optional ``id`` (string or integer) is kept. Rows carrying a ``"dropped"`` key (written by
``drafttrain regenerate`` when the target could not answer a row) are skipped and counted, never an error.

Every row is validated before anything else happens, so a bad row is reported as ``file:line: what``.

Tokenisation uses the tokenizer's chat template. ``loss_mask`` is 1 exactly on assistant tokens: the content of
each assistant turn and the end-of-turn token the template appends (the model has to generate it). With a
template that has ``{% generation %}`` markers, transformers computes the mask
(``return_assistant_tokens_mask=True``); otherwise a prefix-diff over the rendered turns is used.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence, Union

import torch

from ..config import DATA_FORMATS
from ..io import DraftTrainError

__all__ = [
    "Conversation",
    "Conversations",
    "read_conversations",
    "parse_row",
    "FORMATS",
    "detect_format",
    "preset_row",
    "tokenize_conversation",
    "tokenize_conversations",
    "prompt_ids",
    "collate",
    "has_generation_markers",
    "stop_token_ids",
]

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}
# Tokens that end a turn in common chat templates; the tokenizer's eos is always included too.
END_OF_TURN_TOKENS = ("<|end|>", "<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eot|>")
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")

Message = dict  # {"role": str, "content": str}


@dataclass
class Conversation:
    """One validated conversation; ``where`` names its origin (``file:line``) for error messages."""

    messages: list[dict[str, str]]
    id: Any = None  # the row's "id" (str or int) if it had one
    line: int | None = None  # 1-based line in the source file
    path: str | None = None
    source: str | None = None  # free-form origin when not read from a file (e.g. "json/decoder.py:12")

    @property
    def where(self) -> str:
        if self.path is not None and self.line is not None:
            return f"{self.path}:{self.line}"
        return self.source or (f"conversation {self.id}" if self.id is not None else "conversation")

    @property
    def row_id(self) -> Any:
        """The id written by ``regenerate``: the row's own id, else its line number."""
        return self.id if self.id is not None else self.line

    def to_row(self) -> dict:
        return {"id": self.row_id, "messages": [dict(m) for m in self.messages]}


class Conversations(list):
    """A ``list[Conversation]`` that also reports the rows it skipped (``skip_invalid=True`` / dropped rows)."""

    def __init__(self, items: Iterable[Conversation] = (), skipped: list[str] | None = None):
        super().__init__(items)
        self.skipped: list[str] = list(skipped or [])


ConvLike = Union[Conversation, Sequence[Message]]


def _messages_of(conv: ConvLike) -> list[dict[str, str]]:
    return conv.messages if isinstance(conv, Conversation) else list(conv)


def _where_of(conv: ConvLike, index: int | None = None) -> str:
    if isinstance(conv, Conversation):
        return conv.where
    return f"conversation {index}" if index is not None else "conversation"


# --------------------------------------------------------------------------------------------------- reading


def _content_text(content: Any, where: str, what: str) -> str:
    """A message's content as text. Accepts a string or OpenAI text parts ``[{"type": "text", "text": ...}]``."""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise DraftTrainError(
                    f"{where}: {what}: content part {j} is not a text part "
                    f'({{"type": "text", "text": "..."}}); only text is supported'
                )
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise DraftTrainError(f"{where}: {what}: content must be a string, got {type(content).__name__}")
    if not content.strip():
        raise DraftTrainError(f"{where}: {what}: content is empty")
    return content


# data.format: the row shapes a dataset may have. Each maps to a parse_row shape ("conversations": ShareGPT's
# from/value turns, "messages": OpenAI's role/content); the id is read from the preset's id columns.
FORMATS = DATA_FORMATS  # ("auto", "sharegpt", "ultrachat", "magpie", "openai"): data.format's choices
_PRESET_IDS = {"sharegpt": ("id",), "openai": ("id",), "ultrachat": ("prompt_id", "id"), "magpie": ("uuid", "id")}
_NEEDS = {"sharegpt": '"conversations"', "magpie": '"conversations" or "instruction" + "response"',
          "openai": '"messages"'}
SHAPES = ('conversations (ShareGPT / Magpie: from, value), messages (OpenAI / UltraChat: role, content), '
          'instruction + response (Magpie)')


def _columns_of(fmt: str, cols) -> str | None:
    """The conversation column(s) ``fmt`` reads from ``cols`` (None: it reads none of them)."""
    if fmt == "sharegpt":
        return "conversations" if "conversations" in cols else None
    if fmt in ("openai", "ultrachat"):
        return "messages" if "messages" in cols else None
    if "conversations" in cols:  # magpie: its conversations (every turn), else the single-turn columns
        return "conversations"
    return "instruction" if {"instruction", "response"} <= set(cols) else None


def detect_format(columns: Sequence[str], fmt: str, where: str) -> str:
    """The preset (not ``auto``) that reads a dataset with these columns; one line naming the columns found and
    the shapes accepted when none does."""
    cols = list(columns)
    found = ", ".join(map(str, cols)) or "none"
    if fmt == "auto":
        if "conversations" in cols and "messages" in cols:
            raise DraftTrainError(f'{where}: both "conversations" and "messages" columns; choose one with '
                                  f"data.format=sharegpt|openai (columns: {found})")
        fmt = ("magpie" if "uuid" in cols and "messages" not in cols else "sharegpt" if "conversations" in cols
               else "ultrachat" if {"messages", "prompt_id"} <= set(cols) else "openai" if "messages" in cols
               else "magpie")
        if _columns_of(fmt, cols) is None:
            raise DraftTrainError(f"{where}: no conversation columns (columns: {found}); expected one of: {SHAPES} "
                                  f"(data.format={'|'.join(FORMATS)})")
    elif _columns_of(fmt, cols) is None:
        raise DraftTrainError(f"{where}: data.format={fmt} reads {_NEEDS.get(fmt, _NEEDS['openai'])}, not found "
                              f"(columns: {found}); expected one of: {SHAPES}")
    return fmt


def preset_row(row: dict, fmt: str, where: str = "row") -> dict:
    """``row`` of preset ``fmt`` as a :func:`parse_row` shape: ``{"conversations" | "messages": [...], "id"}``.
    ``auto`` keeps rows that have ``conversations`` or ``messages`` as they are (their ``id``) and reads
    ``instruction`` + ``response`` rows as Magpie; other rows are left for parse_row to refuse. A named preset
    needs its columns (one line naming ``where`` and the row's keys)."""
    if fmt == "auto":
        if "conversations" in row or "messages" in row or not {"instruction", "response"} <= set(row):
            return row
        fmt = "magpie"
    key = _columns_of(fmt, row)
    if key is None:
        keys = ", ".join(sorted(map(str, row))) or "none"
        raise DraftTrainError(f"{where}: data.format={fmt} reads {_NEEDS.get(fmt, _NEEDS['openai'])}, not in the "
                              f"row (keys: {keys})")
    rid = next((row[k] for k in _PRESET_IDS[fmt] if row.get(k) is not None), None)
    if key == "instruction":
        turns = [{"role": "user", "content": row["instruction"]}, {"role": "assistant", "content": row["response"]}]
        return {"messages": turns, "id": rid}
    return {key: row[key], "id": rid}


def parse_row(row: Any, where: str, prompts_only: bool = False, fmt: str = "auto"
              ) -> tuple[list[dict[str, str]], Any]:
    """Validate one decoded JSON row (or a dataset's row) of shape ``fmt`` (:data:`FORMATS`); return
    ``(messages, id)``. Raises DraftTrainError naming ``where``.

    ``prompts_only`` (evaluation prompts): the final assistant turn may be empty or missing (the prompt is
    everything before it); an empty final assistant turn is dropped. Training rows need an answer."""
    if not isinstance(row, dict):
        raise DraftTrainError(f"{where}: row must be a JSON object, got {type(row).__name__}")
    row = preset_row(row, fmt, where)
    has_sg, has_oa = "conversations" in row, "messages" in row
    if has_sg and has_oa:
        raise DraftTrainError(f'{where}: row has both "conversations" and "messages"; keep one')
    if not (has_sg or has_oa):
        keys = ", ".join(sorted(map(str, row))) or "none"
        raise DraftTrainError(
            f'{where}: row has neither "conversations" (ShareGPT) nor "messages" (OpenAI) nor "instruction" + '
            f'"response" (Magpie) (keys: {keys})'
        )
    key = "conversations" if has_sg else "messages"
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        raise DraftTrainError(f'{where}: "{key}" must be a non-empty list')
    rid = row.get("id")
    if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
        raise DraftTrainError(f'{where}: "id" must be a string or an integer, got {type(rid).__name__}')
    rkey, ckey = ("from", "value") if has_sg else ("role", "content")
    messages = []
    for k, turn in enumerate(turns):
        what = f"{key}[{k}]"
        if not isinstance(turn, dict):
            raise DraftTrainError(f"{where}: {what} must be an object, got {type(turn).__name__}")
        for need in (rkey, ckey):
            if need not in turn:
                raise DraftTrainError(f'{where}: {what} has no "{need}" key')
        raw_role = turn[rkey]
        role = SHAREGPT_ROLES.get(raw_role) if has_sg else (raw_role if raw_role in ROLES else None)
        if role is None:
            allowed = ", ".join(SHAREGPT_ROLES if has_sg else ROLES)
            raise DraftTrainError(f"{where}: {what}: unknown role {raw_role!r} (expected one of: {allowed})")
        if prompts_only and role == "assistant" and k == len(turns) - 1 and _is_blank(turn[ckey]):
            continue  # the answer to be generated
        messages.append({"role": role, "content": _content_text(turn[ckey], where, f"{what} ({role})")})
    if prompts_only:
        if not any(m["role"] == "user" for m in messages):
            raise DraftTrainError(f"{where}: conversation has no user turn (nothing to prompt with)")
    elif not any(m["role"] == "assistant" for m in messages):
        raise DraftTrainError(f"{where}: conversation has no assistant turn")
    return messages, rid


def _is_blank(content: Any) -> bool:
    return content is None or (isinstance(content, str) and not content.strip()) or content == []


def _iter_rows(path: Path, skip_invalid: bool, skipped: list[str], prompts_only: bool = False,
               fmt: str = "auto") -> Iterator[Conversation]:
    """Validated conversations of a JSONL file, line by line."""
    name = str(path)
    seen_ids: dict[str, int] = {}
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{name}:{lineno}"
            try:
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DraftTrainError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
                if not text.strip():
                    continue
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as e:
                    raise DraftTrainError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
                if isinstance(row, dict) and row.get("dropped"):
                    skipped.append(f"{where}: dropped by regenerate ({row['dropped']})")
                    continue
                messages, rid = parse_row(row, where, prompts_only, fmt)
                if rid is not None:
                    k = json.dumps(rid)
                    if k in seen_ids:
                        raise DraftTrainError(f"{where}: duplicate id {rid!r} (first at line {seen_ids[k]})")
                    seen_ids[k] = lineno
            except DraftTrainError as e:
                if not skip_invalid:
                    raise
                skipped.append(str(e))
                continue
            yield Conversation(messages=messages, id=rid, line=lineno, path=name)


def _to_dataset(convs: Sequence[Conversation]):
    """Validated conversations as an in-memory ``datasets.Dataset`` (columns ``messages``, ``id_json``, ``line``).

    ``id_json`` is the row id JSON-encoded (ids may mix strings and integers, which one Arrow column cannot
    hold). Built in memory from rows that were already validated, with a content fingerprint: no stale cache
    for an edited file, nothing written outside a temporary directory.
    """
    from datasets import Dataset, Features, Value
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    features = Features(
        {
            "messages": [{"role": Value("string"), "content": Value("string")}],
            "id_json": Value("string"),
            "line": Value("int64"),
        }
    )
    records = [
        {"messages": c.messages, "id_json": None if c.id is None else json.dumps(c.id), "line": c.line}
        for c in convs
    ]

    def gen(rows):
        yield from rows

    fingerprint = hashlib.sha1(json.dumps(records, sort_keys=True).encode()).hexdigest()
    bars_were_off = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="drafttrain-ds-") as tmp:
            return Dataset.from_generator(
                gen,
                features=features,
                gen_kwargs={"rows": records},
                keep_in_memory=True,
                cache_dir=tmp,
                fingerprint=fingerprint,
            )
    finally:
        if not bars_were_off:
            enable_progress_bars()


def read_conversations(path: str | Path, skip_invalid: bool = False, prompts_only: bool = False,
                       fmt: str = "auto") -> Conversations:
    """Read and validate a JSONL file of ShareGPT- or OpenAI-shaped conversations (``fmt``: the rows' shape,
    :data:`FORMATS`; ``auto`` reads Magpie ``instruction`` + ``response`` rows too).

    Every non-blank line is validated first; the first bad one raises ``DraftTrainError`` as
    ``file:line: what is wrong``. With ``skip_invalid=True`` bad rows are skipped instead and listed (one message
    each) in the result's ``.skipped``, and one ``warning:`` line says how many. ``prompts_only``: evaluation
    prompts, whose final assistant turn may be empty or missing (:func:`parse_row`). The rows then go through
    ``datasets`` (Arrow) so every consumer sees the same normalised schema. The file is only read.
    """
    path = Path(path)
    if not path.exists():
        raise DraftTrainError(f"{path}: file not found")
    if path.is_dir():
        raise DraftTrainError(f"{path}: is a directory, expected a .jsonl file")
    skipped: list[str] = []
    convs = list(_iter_rows(path, skip_invalid, skipped, prompts_only, fmt))
    check_nonempty(convs, skipped, path)
    out = Conversations(skipped=skipped)
    for rec in _to_dataset(convs):
        out.append(
            Conversation(
                messages=[{"role": m["role"], "content": m["content"]} for m in rec["messages"]],
                id=None if rec["id_json"] is None else json.loads(rec["id_json"]),
                line=rec["line"],
                path=str(path),
            )
        )
    warn_skipped(skipped, path)
    return out


def check_nonempty(convs, skipped: list[str], name) -> None:
    """One line when a source gave no conversation (and why, when rows were skipped)."""
    if not convs:
        why = f" ({len(skipped)} rows skipped; first: {skipped[0]})" if skipped else ""
        raise DraftTrainError(f"{name}: no conversations{why}")


def warn_skipped(skipped: list[str], name) -> None:
    """The one warning line of a source whose invalid rows were skipped (data.skip_invalid)."""
    if skipped:
        print(f"warning: {name}: skipped {len(skipped)} rows; first: {skipped[0]}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- tokenising


def has_generation_markers(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(_GENERATION_RE.search(template))


def _check_template(tokenizer) -> None:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise DraftTrainError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
            "set tokenizer.chat_template (a base model needs one to train on chats)"
        )


def _render(tokenizer, messages, add_generation_prompt: bool, where: str, mask: bool = False):
    """Token ids of the chat template applied to ``messages`` (no special tokens added beyond the template's)."""
    try:
        enc = tokenizer.apply_chat_template(
            list(messages),
            tokenize=True,
            return_dict=True,
            add_generation_prompt=add_generation_prompt,
            return_assistant_tokens_mask=mask,
        )
    except DraftTrainError:
        raise
    except Exception as e:  # jinja errors ("roles must alternate", raise_exception(...)), tokenizer errors
        raise DraftTrainError(f"{where}: chat template failed: {type(e).__name__}: {e}") from None
    ids = [int(i) for i in enc["input_ids"]]
    if mask:
        return ids, [int(m) for m in enc["assistant_masks"]]
    return ids


def stop_token_ids(model, tokenizer, required: bool = False) -> list[int]:
    """The tokens that end a generation: the model's ``generation_config.eos_token_id`` (an int or a list:
    Llama-3 and Qwen3 list several) and the tokenizer's eos, without repeats, generation config first. The one
    definition every consumer uses (decoding, regeneration, on-policy sampling, the draft vocabulary)."""
    ids: list[int] = []
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    for e in [eos] if isinstance(eos, int) else list(eos or []):
        if e is not None and int(e) not in ids:
            ids.append(int(e))
    tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if tok_eos is not None and int(tok_eos) not in ids:
        ids.append(int(tok_eos))
    if required and not ids:
        raise DraftTrainError("the target has no eos token (neither tokenizer.eos_token nor "
                              "generation_config.eos_token_id); generation would never stop")
    return ids


def _end_token_ids(tokenizer) -> set[int]:
    ids = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    vocab = tokenizer.get_vocab()
    for t in END_OF_TURN_TOKENS:
        if t in vocab:
            ids.add(int(vocab[t]))
    return ids


def _prefix_diff_mask(tokenizer, messages, where: str) -> tuple[list[int], list[int]]:
    """Assistant mask from the prefix property of the template, for templates without generation markers.

    For each assistant turn i: ``render(messages[:i], add_generation_prompt=True)`` must be a token prefix of
    ``render(messages[:i+1])``, which must be a token prefix of the whole conversation; the tokens in between are
    the turn. Template text after the turn's end-of-turn token (e.g. ChatML's newline) is not masked.
    """
    full = _render(tokenizer, messages, False, where)
    mask = [0] * len(full)
    ends = _end_token_ids(tokenizer)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], True, where)
        upto = _render(tokenizer, messages[: i + 1], False, where)
        for name, a, b in (("the prompt", prompt, upto), ("the turn", upto, full)):
            if b[: len(a)] != a:
                k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                ta = tokenizer.decode(a[max(0, k - 3) : k + 3])
                tb = tokenizer.decode(b[max(0, k - 3) : k + 3])
                text_a = tokenizer.decode(a)
                text_b = tokenizer.decode(b)
                if text_b.startswith(text_a):
                    why = (
                        "the template text is a prefix, but the tokenizer merges characters across the boundary "
                        f"(token {k}: {ta!r} vs {tb!r})"
                    )
                else:
                    why = (
                        "the template renders earlier turns differently once a later turn is added "
                        f"(token {k}: {ta!r} vs {tb!r})"
                    )
                raise DraftTrainError(
                    f"{where}: cannot find assistant turn {i}: chat template is not prefix-stable: {name} "
                    f"(messages[:{i}]{' + generation prompt' if name == 'the prompt' else ''}) is not a token "
                    f"prefix of the longer rendering; {why}. Add {{% generation %}}...{{% endgeneration %}} "
                    "markers around the assistant content in the template"
                )
        span = list(range(len(prompt), len(upto)))
        ends_at = [j for j in span if full[j] in ends]
        if ends_at:  # stop after the turn's end-of-turn token; what the template adds after it is not generated
            span = [j for j in span if j <= ends_at[-1]]
        if not span:
            raise DraftTrainError(f"{where}: assistant turn {i} rendered to no tokens with this chat template")
        for j in span:
            mask[j] = 1
    return full, mask


def _tokenize(tokenizer, messages, where: str) -> tuple[list[int], list[int]]:
    _check_template(tokenizer)
    if has_generation_markers(tokenizer):
        ids, mask = _render(tokenizer, messages, False, where, mask=True)
        if len(mask) == len(ids) and any(mask):
            return ids, mask
        # markers present but no mask (e.g. a slow tokenizer without offsets): use the template-agnostic path
    return _prefix_diff_mask(tokenizer, messages, where)


def _check_overlong(overlong: str) -> None:
    if overlong not in ("truncate", "skip"):
        raise DraftTrainError(f"overlong={overlong!r}: expected 'truncate' or 'skip'")


def tokenize_conversation(
    tokenizer, messages: ConvLike, max_length: int | None, overlong: str = "truncate"
) -> dict[str, list[int]] | None:
    """``{"input_ids", "loss_mask"}`` of one conversation, or None when it is skipped.

    Skipped: longer than ``max_length`` with ``overlong="skip"``, or no assistant token left after truncation.
    """
    out, _ = _tokenize_one(tokenizer, messages, max_length, overlong, _where_of(messages))
    return out


def _tokenize_one(tokenizer, conv, max_length, overlong, where) -> tuple[dict | None, str]:
    """(example or None, status): status "ok" or "truncated" (an example); "skipped" (no assistant token),
    "too_long" (over max_length, overlong=skip) or "truncated_away" (no assistant token left after truncation)."""
    _check_overlong(overlong)
    if max_length is not None and max_length <= 0:
        raise DraftTrainError(f"max_length={max_length}: must be positive")
    ids, mask = _tokenize(tokenizer, _messages_of(conv), where)
    status = "ok"
    if max_length is not None and len(ids) > max_length:
        if overlong == "skip":
            return None, "too_long"
        ids, mask = ids[:max_length], mask[:max_length]
        status = "truncated"
    if not any(mask):
        return None, "skipped" if status == "ok" else "truncated_away"
    return {"input_ids": ids, "loss_mask": mask}, status


def tokenize_conversations(
    tokenizer, convs: Iterable[ConvLike], max_length: int | None, overlong: str = "truncate", note: str = ""
) -> tuple[list[dict[str, list[int]]], dict[str, int]]:
    """Tokenise many conversations; stats = {rows (kept), truncated, skipped, trainable_tokens}. With no trainable
    token at all: one error naming the file(s), the counts that explain it and ``note`` (e.g. the held-out rows)."""
    _check_overlong(overlong)
    examples: list[dict] = []
    stats = {"rows": 0, "truncated": 0, "skipped": 0, "trainable_tokens": 0}
    n, too_long, files = 0, 0, []
    for n, conv in enumerate(convs, start=1):
        ex, status = _tokenize_one(tokenizer, conv, max_length, overlong, _where_of(conv, n - 1))
        path = getattr(conv, "path", None)
        if path is not None and path not in files:
            files.append(path)
        if ex is None:
            stats["skipped"] += 1
            too_long += status != "skipped"  # too_long (overlong=skip) or truncated_away (nothing left)
            continue
        stats["truncated"] += status == "truncated"
        stats["rows"] += 1
        stats["trainable_tokens"] += sum(ex["loss_mask"])
        examples.append(ex)
    if stats["trainable_tokens"] == 0:
        where = f"{', '.join(str(f) for f in files[:3])}{', ...' if len(files) > 3 else ''}: " if files else ""
        why = []
        if too_long:
            cut = "skipped (data.overlong=skip)" if overlong == "skip" else "cut before their first answer token"
            why.append(f"{too_long} longer than data.max_length={max_length}, {cut}")
        if stats["skipped"] - too_long:
            why.append(f"{stats['skipped'] - too_long} with no assistant token")
        raise DraftTrainError(
            f"{where}zero trainable (assistant) tokens in the {n} training conversation{'s' if n != 1 else ''}"
            f"{f' ({chr(59).join(why)})' if why else ''}{f'; {note}' if note else ''}; nothing to train on — check "
            "the data and data.max_length"
        )
    return examples, stats


def prompt_ids(tokenizer, messages: ConvLike) -> list[int]:
    """The eval/generation prompt: messages before the last assistant turn, plus the generation prompt."""
    msgs = _messages_of(messages)
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=len(msgs))
    _check_template(tokenizer)
    return _render(tokenizer, msgs[:last], True, _where_of(messages))


def collate(examples: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: ``input_ids`` (pad_id), ``attention_mask`` (1 = real), ``loss_mask``; all ``[B, T]``."""
    if not examples:
        raise DraftTrainError("collate: empty batch")
    if pad_id is None:
        raise DraftTrainError("collate: pad_id is None (the tokenizer has no pad token; set one)")
    T = max(len(e["input_ids"]) for e in examples)
    B = len(examples)
    input_ids = torch.full((B, T), int(pad_id), dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    loss = torch.zeros((B, T), dtype=torch.long)
    for b, e in enumerate(examples):
        n = len(e["input_ids"])
        if len(e["loss_mask"]) != n:
            raise DraftTrainError(f"collate: example {b} has {n} input_ids but {len(e['loss_mask'])} loss_mask")
        input_ids[b, :n] = torch.as_tensor(e["input_ids"], dtype=torch.long)
        attention[b, :n] = 1
        loss[b, :n] = torch.as_tensor(e["loss_mask"], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss}
