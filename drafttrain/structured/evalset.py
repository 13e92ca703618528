"""Structured eval sets: prompts that each carry the JSON schema their answer must satisfy.

Built-in (``builtin_structured_examples``): function-call-style JSON from the stdlib function signatures the
built-in data already uses (``drafttrain.data.stdlib.code_chats``). For ``def name(a, b=2, *, c=None)`` the
user asks for a call as JSON and the row's schema is::

    {"type": "object",
     "properties": {"name": {"const": "name"},
                    "arguments": {"type": "object",
                                  "properties": {"a": {...}, "b": {"type": "integer", ...}, "c": {...}},
                                  "required": ["a"], "additionalProperties": false}},
     "required": ["name", "arguments"], "additionalProperties": false}

A parameter's type comes from its annotation (``int``, ``str``, ``float``, ``bool``, ``bytes``, ``list``/
``tuple``/``set``, ``Optional[...]``/``X | None``), else from its default value's type, else it is a string;
a ``None`` default adds ``null``. ``self``/``cls`` of methods, ``*args`` and ``**kwargs`` are left out.
Every value is bounded (strings ``maxLength``, numbers ``minimum``/``maximum``, arrays ``maxItems``), so the
grammar itself ends every output: with enough ``max_new_tokens`` every constrained output validates.

User JSONL (``read_structured_jsonl``): one ``{"messages": [...], "schema": {...}}`` object per line (optional
``"id"``); messages are OpenAI-style; a trailing assistant turn (a reference answer) is allowed and is not
part of the prompt.
"""
from __future__ import annotations

import ast
import functools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..data import stdlib
from ..data.chat import ROLES, prompt_ids
from ..data.select import EvalSet
from ..io import DraftTrainError
from .grammar import check_output, parse_spec

__all__ = [
    "StructuredExample",
    "function_call_schema",
    "builtin_structured_examples",
    "read_structured_jsonl",
    "validate_outputs",
    "answer_with_target",
    "write_structured_jsonl",
    "structured_eval_set",
]

INT_BOUND = 1_000_000  # |integer| and |number| arguments are at most this
MAX_ITEMS = 4  # array arguments hold at most this many items


@dataclass
class StructuredExample:
    """One structured prompt: ``messages`` (ending with the user turn, or with a reference assistant turn)
    and the JSON ``schema`` the generated answer must satisfy."""

    messages: list[dict[str, str]]
    schema: dict
    id: Any = None
    where: str = ""  # origin for messages: "file:line" or "stdlib:<relpath>:<lineno>"
    meta: dict = field(default_factory=dict)  # e.g. {"function": name, "required": [...]} for built-in rows

    @property
    def prompt_messages(self) -> list[dict[str, str]]:
        """The messages to answer: all of them, less a final (reference) assistant turn."""
        return self.messages[:-1] if self.messages and self.messages[-1]["role"] == "assistant" else self.messages

    def prompt_ids(self, tokenizer) -> list[int]:
        """The chat-templated prompt ids, ending with the generation prompt."""
        # chat.prompt_ids renders the messages before the LAST assistant turn: an empty one marks the end
        return prompt_ids(tokenizer, [*self.prompt_messages, {"role": "assistant", "content": ""}])

    def check(self, text: str) -> str | None:
        """None if ``text`` validates against this row's schema, else the reason."""
        return check_output(text, self.schema)


# ------------------------------------------------------------------------------------------- built-in

_SCALAR_ANNOTATIONS = {
    "int": "integer",
    "str": "string",
    "float": "number",
    "bool": "boolean",
    "bytes": "string",
    "bytearray": "string",
    "Path": "string",
    "PathLike": "string",
}
_ARRAY_ANNOTATIONS = {"list", "tuple", "set", "frozenset", "List", "Tuple", "Set", "Sequence", "Iterable"}


def _type_schema(json_type: str, max_string_length: int) -> dict:
    if json_type == "string":
        return {"type": "string", "maxLength": max_string_length}
    if json_type in ("integer", "number"):
        return {"type": json_type, "minimum": -INT_BOUND, "maximum": INT_BOUND}
    if json_type == "array":
        return {"type": "array", "items": {"type": "string", "maxLength": max_string_length}, "maxItems": MAX_ITEMS}
    return {"type": json_type}  # boolean, null


def _annotation_type(node: ast.expr | None) -> tuple[str | None, bool]:
    """(json type or None if unknown, whether None is allowed) of an annotation."""
    if node is None:
        return None, False
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # string annotation
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return None, False
    if isinstance(node, ast.Constant) and node.value is None:
        return "null", True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # X | None
        left, ln = _annotation_type(node.left)
        right, rn = _annotation_type(node.right)
        types = {t for t in (left, right) if t not in (None, "null")}
        nullable = ln or rn or "null" in (left, right)
        return (types.pop() if len(types) == 1 else None), nullable
    if isinstance(node, ast.Subscript):
        base = _name_of(node.value)
        if base == "Optional":
            t, _ = _annotation_type(node.slice)
            return t, True
        if base in _ARRAY_ANNOTATIONS:
            return "array", False
        return None, False
    name = _name_of(node)
    if name in _SCALAR_ANNOTATIONS:
        return _SCALAR_ANNOTATIONS[name], False
    if name in _ARRAY_ANNOTATIONS:
        return "array", False
    return None, False


def _name_of(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _default_type(node: ast.expr | None) -> tuple[str | None, bool]:
    if node is None:
        return None, False
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None:
            return None, True
        if isinstance(v, bool):
            return "boolean", False
        if isinstance(v, int):
            return "integer", False
        if isinstance(v, float):
            return "number", False
        if isinstance(v, (str, bytes)):
            return "string", False
        return None, False
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return "array", False
    return None, False


def _param_schema(annotation, default, max_string_length: int) -> dict:
    t, nullable = _annotation_type(annotation)
    if t is None or t == "null":
        dt, dnull = _default_type(default)
        t, nullable = (t if t == "null" else dt), nullable or dnull
    t = t or "string"
    schema = _type_schema(t, max_string_length)
    if nullable and t != "null":
        return {"anyOf": [schema, {"type": "null"}]}
    return schema


def _parse_function(prefix: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    for src in (prefix, prefix + "\n    pass"):
        try:
            tree = ast.parse(src)
        except (SyntaxError, ValueError):
            continue
        if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
            return tree.body[0]
    return None


def function_call_schema(fn: ast.FunctionDef | ast.AsyncFunctionDef, max_string_length: int = 32) -> dict:
    """The JSON schema of a call to ``fn``: ``{"name": <const>, "arguments": {<param>: <value>, ...}}``."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = list(zip(positional, defaults)) + list(zip(a.kwonlyargs, a.kw_defaults))
    if params and positional and params[0][0].arg in ("self", "cls"):
        params = params[1:]
    props, required = {}, []
    for arg, default in params:
        props[arg.arg] = _param_schema(arg.annotation, default, max_string_length)
        if default is None:
            required.append(arg.arg)
    arguments = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    return {
        "type": "object",
        "properties": {"name": {"const": fn.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _signature_text(prefix: str, fn) -> str:
    """The ``def`` line(s) of the prefix, plus the docstring's first line as a comment-free summary."""
    lines = prefix.split("\n")
    body0 = fn.body[0]
    has_doc = isinstance(body0, ast.Expr) and isinstance(body0.value, ast.Constant) and isinstance(body0.value.value, str)
    sig = "\n".join(lines[: body0.lineno - 1] if has_doc else lines).rstrip()
    if has_doc:
        summary = body0.value.value.strip().split("\n")[0].strip()
        if summary:
            sig += f'\n    """{summary}"""'
    return sig


def structured_prompt(name: str, signature: str, schema: dict) -> str:
    return (
        f"Call `{name}` with example arguments. Answer with one JSON object matching this schema:\n"
        f"{json.dumps(schema, separators=(',', ':'))}\n\n{signature}"
    )


@functools.lru_cache(maxsize=8)
def _builtin_rows(split: str, max_string_length: int, min_params: int) -> tuple:
    rows, seen = [], set()
    for chat in stdlib.code_chats(split):
        fn = _parse_function(chat.prefix)
        if fn is None:
            continue
        schema = function_call_schema(fn, max_string_length)
        arg_props = schema["properties"]["arguments"]["properties"]
        if len(arg_props) < min_params:
            continue
        sig = _signature_text(chat.prefix, fn)
        key = (fn.name, json.dumps(schema, sort_keys=True))
        if key in seen:
            continue
        seen.add(key)
        rows.append((chat.source, fn.name, sig, schema))
    return tuple(rows)


def builtin_structured_examples(
    split: str = "eval",
    limit: int | None = None,
    seed: int = 0,
    max_string_length: int = 32,
    min_params: int = 1,
) -> list[StructuredExample]:
    """Function-call JSON tasks from a stdlib split (``eval``: held out from the target and the drafter data;
    ``draft``: for drafter training data), shuffled with ``seed``, then limited. Deterministic."""
    if split not in stdlib.SPLITS:
        raise DraftTrainError(f"structured builtin split={split!r}: expected one of {', '.join(stdlib.SPLITS)}")
    if limit is not None and limit < 0:
        raise DraftTrainError(f"limit={limit}: must be >= 0 (or None for all)")
    if max_string_length < 1:
        raise DraftTrainError(f"max_string_length={max_string_length}: must be >= 1")
    rows = list(_builtin_rows(split, max_string_length, min_params))
    if not rows:
        raise DraftTrainError(f"no function signatures with >= {min_params} parameters in the stdlib {split!r} split")
    random.Random(seed).shuffle(rows)
    if limit is not None:
        if limit > len(rows):
            raise DraftTrainError(f"asked for {limit} structured {split!r} examples but the split has only {len(rows)}")
        rows = rows[:limit]
    out = []
    for source, name, sig, schema in rows:
        schema = json.loads(json.dumps(schema))  # callers may mutate their copy
        msg = {"role": "user", "content": structured_prompt(name, sig, schema)}
        required = schema["properties"]["arguments"]["required"]
        out.append(
            StructuredExample([msg], schema, id=source, where=f"stdlib:{source}",
                              meta={"function": name, "required": list(required)})
        )
    return out


# ------------------------------------------------------------------------------------------ user JSONL


def _parse_structured_row(row: Any, where: str) -> StructuredExample:
    if not isinstance(row, dict):
        raise DraftTrainError(f"{where}: row must be a JSON object, got {type(row).__name__}")
    for key in ("messages", "schema"):
        if key not in row:
            raise DraftTrainError(f'{where}: structured row has no "{key}" key (expected {{"messages": [...], "schema": {{...}}}})')
    msgs = row["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise DraftTrainError(f'{where}: "messages" must be a non-empty list')
    messages = []
    for k, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DraftTrainError(f'{where}: messages[{k}] must be an object with "role" and "content"')
        if m["role"] not in ROLES:
            raise DraftTrainError(f"{where}: messages[{k}]: unknown role {m['role']!r} (expected one of: {', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise DraftTrainError(f"{where}: messages[{k}] content must be a string, got {type(m['content']).__name__}")
        messages.append({"role": m["role"], "content": m["content"]})
    prompt = messages[:-1] if messages[-1]["role"] == "assistant" else messages
    if not prompt or prompt[-1]["role"] != "user":
        raise DraftTrainError(f"{where}: the prompt (messages before a final assistant turn) must end with a user turn")
    rid = row.get("id")
    if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
        raise DraftTrainError(f'{where}: "id" must be a string or an integer, got {type(rid).__name__}')
    schema = row["schema"]
    parse_spec(schema, where=f'{where}: "schema"')  # validates the schema (DraftTrainError naming the row)
    return StructuredExample(messages, schema, id=rid, where=where)


def read_structured_jsonl(path: str | Path, limit: int | None = None) -> list[StructuredExample]:
    """Rows ``{"messages": [...], "schema": {...}, "id"?}``; blank lines skipped; errors name ``file:line``."""
    path = Path(path)
    if not path.is_file():
        raise DraftTrainError(f"{path}: structured data file not found")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DraftTrainError(f"{where}: invalid JSON ({e.msg})") from None
            out.append(_parse_structured_row(row, where))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise DraftTrainError(f"{path}: no structured rows")
    return out


def structured_eval_set(data_cfg) -> EvalSet:
    """``data.source=structured``: the rows of ``data.eval_path`` / ``data.path`` (at most ``data.num_eval``), or
    ``data.num_eval`` built-in structured prompts."""
    n = int(data_cfg.num_eval)
    path = data_cfg.eval_path or data_cfg.path
    if path:
        rows = read_structured_jsonl(path, limit=n or None)
        return EvalSet(rows, f"{len(rows)} structured rows of {path}")
    if n == 0:
        raise DraftTrainError("data.num_eval=0 (every row) needs a structured prompt file (data.path)")
    return EvalSet(builtin_structured_examples("eval", n, data_cfg.seed,
                                               max_string_length=data_cfg.structured_max_string_length),
                   f"{n} built-in structured prompts")


@torch.no_grad()
def answer_with_target(model, tokenizer, examples: Sequence[StructuredExample], max_new_tokens: int = 256,
                       stop_token_ids: Sequence[int] | None = None) -> list[StructuredExample]:
    """Drafter training data for structured traffic: each row with a final assistant turn holding the target's
    own greedy answer under the row's schema (grammar-constrained AR decoding), so a drafter can learn what
    the target writes when it is constrained. Rows whose answer does not end within ``max_new_tokens`` are
    left out. Write them with :func:`write_structured_jsonl`; ``data=jsonl data.path=<file>`` trains on them
    (the rows are OpenAI-shaped; the extra ``schema`` key is ignored there) and ``data=structured
    data.path=<file>`` evaluates on them."""
    from ..data.chat import stop_token_ids as target_stop_tokens
    from ..decoding import NoDraft, SpecDecoder, TargetRunner
    from ..decoding.build import cache_length
    from .grammar import compile_grammar, decode_output

    stops = sorted({*target_stop_tokens(model, tokenizer, required=True), *(int(t) for t in (stop_token_ids or []))})
    vocab = int(model.config.vocab_size)
    prompts = [e.prompt_ids(tokenizer) for e in examples]
    runner = TargetRunner(model, max_len=cache_length(prompts, max_new_tokens, slack=1))  # AR: no drafts
    dec = SpecDecoder(runner, NoDraft(), 0)
    out = []
    for e, p in zip(examples, prompts):
        state = compile_grammar(e.schema, tokenizer, vocab, stops, where=e.where or "structured row").state()
        res = dec.generate(p, max_new_tokens, stops, grammar=state)
        if not state.is_terminated():
            continue
        text = decode_output(tokenizer, res.tokens, stops)
        rid = None if e.id is None else f"structured:{e.id}"  # distinct from chat rows of the same source
        out.append(StructuredExample([*e.prompt_messages, {"role": "assistant", "content": text}], e.schema,
                                     id=rid, where=e.where, meta=dict(e.meta)))
    return out


def write_structured_jsonl(path: str | Path, examples: Sequence[StructuredExample]) -> None:
    """Rows ``{"messages", "schema", "id"}``, one per line, written atomically (read back with
    :func:`read_structured_jsonl`, or as chats with ``data=jsonl``)."""
    from ..io import write_text

    lines = [json.dumps({"messages": e.messages, "schema": e.schema, "id": e.id}, ensure_ascii=False)
             for e in examples]
    write_text(path, "".join(line + "\n" for line in lines))


def validate_outputs(texts: Sequence[str], examples: Sequence[StructuredExample]) -> dict:
    """Check each output against its row's schema: ``{"valid_fraction", "num_valid", "num", "failures"}``
    (``failures``: up to 10 ``{"id", "error"}``)."""
    if len(texts) != len(examples):
        raise ValueError(f"{len(texts)} outputs for {len(examples)} examples")
    failures = []
    for text, ex in zip(texts, examples):
        err = ex.check(text)
        if err is not None:
            failures.append({"id": ex.id, "error": err})
    n = len(texts)
    return {
        "valid_fraction": (n - len(failures)) / n if n else 0.0,
        "num_valid": n - len(failures),
        "num": n,
        "failures": failures[:10],
    }
