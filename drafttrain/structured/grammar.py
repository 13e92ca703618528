"""Grammar-constrained decoding: a thin layer over xgrammar (the engine vLLM and SGLang use).

A grammar is given as a *spec*:

- ``json``: any JSON object or array (xgrammar's built-in JSON grammar, "JSON mode" in serving engines);
- ``regex:<pattern>``: the output must match the regular expression (xgrammar regex syntax);
- a path to a ``.json`` file holding a JSON schema (or an inline schema string starting with ``{``, or a
  schema ``dict`` from Python: the per-row schemas of a structured eval set).

``compile_grammar(spec, tokenizer, vocab_size)`` compiles it for one tokenizer and one logits width
(``vocab_size`` = the model's lm_head rows, which may exceed the tokenizer's vocabulary); ``GrammarState`` is
the per-sequence matcher: masks for the current position, advance over accepted tokens, roll back over
rejected ones, masks along a draft chain or a draft tree (what the verifier needs), forks.

Conventions
-----------
- Special tokens (``<|user|>``, ``<|pad|>``, padded ids beyond the tokenizer …) are never allowed by a
  grammar; xgrammar would otherwise treat their text (``"<|user|>"``) as ordinary characters inside JSON
  strings. The only special tokens a grammar admits are its stop tokens.
- Stop tokens (default: the tokenizer's eos; pass the decoder's full eos set) are allowed exactly when the
  grammar is complete. Once the whole grammar is matched and nothing can extend it, the stop tokens are the
  only allowed tokens. After a stop token the state is *terminated*: no token is allowed.
- A state's history is its accepted tokens; ``rollback(n)`` undoes the last ``n`` (stop token included).
- JSON schemas compile with ``any_whitespace=False`` by default: one fixed layout (``", "`` and ``": "``),
  so a weak model cannot loop on whitespace and outputs are comparable across methods.
- Not thread-safe: one ``GrammarState`` per sequence, used by one thread. Compilation is cached per
  (tokenizer, vocab_size, stop tokens, spec).
"""
from __future__ import annotations

import contextlib
import json
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from ..io import DraftTrainError

__all__ = [
    "GrammarSpec",
    "parse_spec",
    "CompiledGrammar",
    "compile_grammar",
    "GrammarState",
    "DraftMasks",
    "unpack_bitmask",
    "apply_mask",
    "check_output",
    "decode_output",
]

_SPEC_HELP = "expected 'json', 'regex:<pattern>' or a JSON-schema file"


def _xgr():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - a dependency
        raise DraftTrainError(f"grammar-constrained decoding needs the xgrammar package ({e})") from None
    return xgrammar


# ------------------------------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class GrammarSpec:
    """A parsed grammar spec. ``kind``: ``json`` | ``regex`` | ``json_schema``."""

    kind: str
    regex: str | None = None
    schema_text: str | None = None  # the schema as JSON text, key order kept (hashable; ``schema`` parses it)
    source: str = ""  # where it came from, for messages and the report (the path, "inline", "row 3", …)

    @property
    def schema(self) -> dict | None:
        return None if self.schema_text is None else json.loads(self.schema_text)

    def describe(self) -> str:
        """One line for reports: ``json``, ``regex:<pattern>`` or ``json_schema:<source>``."""
        if self.kind == "json":
            return "json"
        if self.kind == "regex":
            return f"regex:{self.regex}"
        return f"json_schema:{self.source}"


def _check_schema(schema: Any, where: str) -> str:
    if not isinstance(schema, dict):
        raise DraftTrainError(f"{where}: a JSON schema must be a JSON object, got {type(schema).__name__}")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        path = "/".join(map(str, e.absolute_path)) or "<root>"
        raise DraftTrainError(f"{where}: invalid JSON schema at {path}: {e.message}") from None
    return json.dumps(schema, ensure_ascii=False)  # key order kept: xgrammar emits properties in schema order


def parse_spec(spec: "str | dict | GrammarSpec", where: str = "decode.grammar") -> GrammarSpec:
    """Parse a grammar spec (see the module doc); a bad spec raises DraftTrainError naming ``where``."""
    if isinstance(spec, GrammarSpec):
        return spec
    if isinstance(spec, dict):
        return GrammarSpec("json_schema", schema_text=_check_schema(spec, where), source=where)
    if not isinstance(spec, str) or not spec.strip():
        raise DraftTrainError(f"{where}={spec!r}: {_SPEC_HELP}")
    if spec == "json":
        return GrammarSpec("json", source="json")
    if spec.startswith("regex:"):
        pattern = spec[len("regex:") :]
        if not pattern:
            raise DraftTrainError(f"{where}={spec!r}: empty regular expression")
        return GrammarSpec("regex", regex=pattern, source="regex")
    if spec.lstrip().startswith("{"):
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise DraftTrainError(f"{where}: inline JSON schema is not valid JSON ({e.msg} at char {e.pos})") from None
        return GrammarSpec("json_schema", schema_text=_check_schema(schema, where), source="inline")
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DraftTrainError(f"{where}={spec!r}: no such file ({_SPEC_HELP})")
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DraftTrainError(f"{path}:{e.lineno}: invalid JSON in the schema given as {where} ({e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DraftTrainError(f"{where}={spec!r}: cannot read the schema file ({e})") from None
    return GrammarSpec("json_schema", schema_text=_check_schema(schema, str(path)), source=str(path))


# ------------------------------------------------------------------------------------------ compilation


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(t, "special", False):
            ids.add(int(i))
    return ids


_TI_CACHE: dict = {}
_COMPILERS: dict = {}
_LOCK = threading.Lock()


def _build_tokenizer_info(tokenizer, vocab_size: int, stops: tuple[int, ...]):
    """(xgrammar TokenizerInfo with masks ``vocab_size`` wide, blocked ids), cached per (tokenizer, vocab_size,
    stops); blocked = ids no grammar admits (special tokens other than the stops, lm_head padding: ids the
    tokenizer lacks). Tokenizer ids >= vocab_size (tokens the model cannot emit) are dropped."""
    xgr = _xgr()
    key = (id(tokenizer), int(vocab_size), stops)
    with _LOCK:
        hit = _TI_CACHE.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1], hit[2]
    # Let xgrammar detect the vocabulary encoding (byte-level, byte-fallback, raw) and prefix-space rule,
    # then rebuild the info with special tokens blanked: xgrammar treats empty-string tokens as special
    # (never matched by a grammar), but keeps a special token's text otherwise.
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stops))
    encoded = [""] * vocab_size
    special = _special_ids(tokenizer)
    for tok, idx in tokenizer.get_vocab().items():
        if idx < vocab_size and idx not in special:
            encoded[idx] = tok
    info = xgr.TokenizerInfo(
        encoded,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=list(stops),
        add_prefix_space=detected.add_prefix_space,
    )
    blocked = frozenset(i for i, t in enumerate(encoded) if not t) - set(stops)
    with _LOCK:
        _TI_CACHE[key] = (tokenizer, info, blocked)
    return info, blocked


def _stop_ids(tokenizer, stop_token_ids, vocab_size: int) -> tuple[int, ...]:
    if stop_token_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise DraftTrainError("the tokenizer has no eos token; pass stop_token_ids to the grammar")
        stop_token_ids = [eos]
    elif isinstance(stop_token_ids, int):
        stop_token_ids = [stop_token_ids]
    stops = tuple(sorted({int(t) for t in stop_token_ids}))
    if not stops:
        raise DraftTrainError("a grammar needs at least one stop token id")
    if any(t < 0 or t >= vocab_size for t in stops):
        raise DraftTrainError(f"stop token ids {list(stops)} must lie in [0, {vocab_size}) (the logits width)")
    return stops


@dataclass(eq=False)
class CompiledGrammar:
    """A grammar compiled for one tokenizer and logits width; make per-sequence states with ``state()``."""

    spec: GrammarSpec
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    xgr_compiled: Any = field(repr=False)
    any_whitespace: bool = False
    blocked: frozenset = field(default=frozenset(), repr=False)  # ids never allowed (specials, lm_head padding)

    def state(self) -> "GrammarState":
        return GrammarState(self)

    def describe(self) -> str:
        return self.spec.describe()

    def check(self, text: str) -> str | None:
        """None if ``text`` (the decoded output, stop token excluded) satisfies the spec, else why not."""
        return check_output(text, self.spec)


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error as one line: it reports grammar errors as ``RuntimeError("[time] file:line: message")``."""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", msg)


def compile_grammar(
    spec: "str | dict | GrammarSpec",
    tokenizer,
    vocab_size: int,
    stop_token_ids: Iterable[int] | int | None = None,
    *,
    any_whitespace: bool = False,
    where: str = "decode.grammar",
) -> CompiledGrammar:
    """Compile ``spec`` for ``tokenizer`` and logits of width ``vocab_size`` (the model's, not the tokenizer's).

    ``stop_token_ids``: the tokens that end the output (pass the decoder's eos set; default: tokenizer eos).
    ``any_whitespace`` (JSON schemas): allow any whitespace between JSON tokens instead of one fixed layout.
    Compiled grammars are cached; an unsupported or malformed grammar raises DraftTrainError naming ``where``.
    """
    gspec = parse_spec(spec, where)
    stops = _stop_ids(tokenizer, stop_token_ids, vocab_size)
    info, blocked = _build_tokenizer_info(tokenizer, vocab_size, stops)
    xgr = _xgr()
    ckey = (id(info),)
    with _LOCK:
        hit = _COMPILERS.get(ckey)
        if hit is None or hit[0] is not info:
            hit = (info, xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True))
            _COMPILERS[ckey] = hit
    compiler = hit[1]
    try:
        if gspec.kind == "json":
            compiled = compiler.compile_builtin_json_grammar()
        elif gspec.kind == "regex":
            compiled = compiler.compile_regex(gspec.regex)
        else:
            compiled = compiler.compile_json_schema(gspec.schema_text, any_whitespace=any_whitespace)
    except RuntimeError as e:
        raise DraftTrainError(f"{where} ({gspec.describe()}): xgrammar cannot compile it: {xgrammar_message(e)}") \
            from None
    return CompiledGrammar(gspec, int(vocab_size), stops, compiled, any_whitespace, blocked)


# ---------------------------------------------------------------------------------------------- masks

_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's packed int32 bitmask ``[..., ceil(V/32)]`` (bit ``j % 32`` of word ``j // 32`` = token ``j``)
    -> bool ``[..., V]`` (True = allowed), on the bitmask's device."""
    if bitmask.device.type == "cpu" and sys.byteorder == "little":
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")
        return torch.from_numpy(bits[..., :vocab_size].astype(np.bool_))
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` with ``-inf`` where ``allowed`` is False (new tensor; ``allowed`` broadcasts, any device)."""
    if logits.shape[-1] != allowed.shape[-1]:
        raise ValueError(f"logits width {logits.shape[-1]} != grammar mask width {allowed.shape[-1]}")
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


@dataclass
class DraftMasks:
    """Masks along a draft (chain or tree) walked from a state, the state itself left unchanged.

    ``masks[0]`` is the mask at the starting state; ``masks[i + 1]`` the mask after node ``i`` (after the
    tokens on the path root -> node ``i``). ``valid[i]``: node ``i``'s token is allowed after its parent's
    path (and the parent is valid). Rows after an invalid node, and after a stop token, allow nothing.
    """

    masks: torch.Tensor  # bool [N + 1, V]
    valid: torch.Tensor  # bool [N]
    bitmasks: torch.Tensor  # the same masks packed as xgrammar does: int32 [N + 1, ceil(V / 32)] (8x smaller
    # to copy to a GPU; xgrammar.apply_token_bitmask_inplace applies them there)

    @property
    def num_valid_prefix(self) -> int:
        """For a chain: the number of leading draft tokens that are grammatical."""
        bad = (~self.valid).nonzero()
        return int(bad[0]) if len(bad) else int(self.valid.numel())


class GrammarState:
    """The grammar state of one sequence (an xgrammar GrammarMatcher plus its accepted-token count)."""

    def __init__(self, compiled: CompiledGrammar, _matcher=None, _num_accepted: int = 0):
        xgr = _xgr()
        self.compiled = compiled
        self.vocab_size = compiled.vocab_size
        self._m = _matcher if _matcher is not None else xgr.GrammarMatcher(
            compiled.xgr_compiled, override_stop_tokens=list(compiled.stop_token_ids)
        )
        self._buf = xgr.allocate_token_bitmask(1, self.vocab_size)
        self._num_accepted = _num_accepted
        self._cached: torch.Tensor | None = None  # allowed mask of the current state
        self._cached_packed: torch.Tensor | None = None  # its packed bitmask

    # -- state ------------------------------------------------------------------------------------------
    @property
    def num_accepted(self) -> int:
        """Tokens accepted since the start (stop token included); ``rollback`` can undo up to this many."""
        return self._num_accepted

    def is_terminated(self) -> bool:
        """A stop token was accepted: nothing more is allowed."""
        return self._m.is_terminated()

    def is_completed(self) -> bool:
        """The accepted text is a complete match (a stop token is allowed now)."""
        return self._m.is_completed()

    def advance(self, tokens: int | Sequence[int] | torch.Tensor) -> bool:
        """Accept ``tokens`` in order. All or nothing: if one is not allowed, the state is left as it was and
        False is returned."""
        toks = _as_list(tokens)
        blocked, V = self.compiled.blocked, self.vocab_size
        n = 0
        for t in toks:
            # tokens no grammar admits are refused here (xgrammar would log a warning for each)
            if t in blocked or not 0 <= t < V or not self._m.accept_token(t):
                break
            n += 1
        if n < len(toks):
            if n:
                self._m.rollback(n)
            return False
        if n:
            self._num_accepted += n
            self._invalidate()
        return True

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (rejected draft tokens, or anything accepted to explore)."""
        if n < 0 or n > self._num_accepted:
            raise ValueError(f"rollback({n}): only {self._num_accepted} tokens were accepted")
        if n:
            self._m.rollback(n)
            self._num_accepted -= n
            self._invalidate()

    def reset(self) -> None:
        self._m.reset()
        self._num_accepted = 0
        self._invalidate()

    def fork(self) -> "GrammarState":
        """An independent copy (same compiled grammar, deep-copied matcher state and history)."""
        return GrammarState(self.compiled, self._m.fork(), self._num_accepted)

    @contextlib.contextmanager
    def scratch(self) -> Iterator["GrammarState"]:
        """Explore, then restore: everything accepted inside the block is rolled back on exit.

        A chain proposer: ``with g.scratch(): for k: d = argmax(g.mask(q)); g.advance(d)``.
        """
        start = self._num_accepted
        try:
            yield self
        finally:
            if self._num_accepted < start:
                raise RuntimeError("rolled back past the scratch() start inside the block")
            self.rollback(self._num_accepted - start)

    # -- masks ------------------------------------------------------------------------------------------
    def _invalidate(self) -> None:
        self._cached = self._cached_packed = None

    def bitmask(self) -> torch.Tensor:
        """The current state's mask packed: int32 ``[ceil(V/32)]`` (all zero once terminated). Cached until the
        state changes; do not modify it."""
        if self._cached_packed is None:
            if self._m.is_terminated():
                self._buf.zero_()
            else:
                self._m.fill_next_token_bitmask(self._buf)
            self._cached_packed = self._buf[0].clone()
        return self._cached_packed

    def allowed_mask(self) -> torch.Tensor:
        """bool ``[V]`` on CPU: the tokens allowed next (all False once terminated). Cached until the state
        changes; do not modify it."""
        if self._cached is None:
            self._cached = unpack_bitmask(self.bitmask(), self.vocab_size)
        return self._cached

    def allowed(self, token: int) -> bool:
        t = int(token)
        return 0 <= t < self.vocab_size and bool(self.allowed_mask()[t])

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (``[V]`` or ``[..., V]``) with ``-inf`` on tokens the CURRENT state disallows (every row
        gets the same mask). Returns a new tensor on ``logits``' device."""
        return apply_mask(logits, self.allowed_mask())

    def masks_along(self, tokens: Sequence[int] | torch.Tensor) -> DraftMasks:
        """Masks at the K+1 positions of a chain draft ``tokens`` (K tokens) walked from the current state.

        ``masks[j]`` is the mask for the target's j-th verified position (after ``tokens[:j]``); the state is
        unchanged afterwards. The walk stops at the first disallowed token (``valid`` False from there).
        """
        toks = _as_list(tokens)
        return self.tree_masks(toks, list(range(-1, len(toks) - 1)))

    def tree_masks(self, tokens: Sequence[int] | torch.Tensor, parents: Sequence[int] | torch.Tensor) -> DraftMasks:
        """Masks for a draft tree: node ``i`` holds ``tokens[i]`` and hangs under node ``parents[i]`` (-1: the
        current state, i.e. the pending position). ``masks[i + 1]`` is the mask after the path to node ``i``
        (for the target position verified *at* node ``i``); ``masks[0]`` the root's. Depth-first with
        accept/rollback, each node accepted once; the state is unchanged afterwards."""
        toks, pars = _as_list(tokens), _as_list(parents)
        n = len(toks)
        if len(pars) != n:
            raise ValueError(f"tree_masks: {n} tokens but {len(pars)} parents")
        children: list[list[int]] = [[] for _ in range(n + 1)]  # index 0 = root, i + 1 = node i
        for i, p in enumerate(pars):
            if not -1 <= p < i:
                raise ValueError(f"tree_masks: parents[{i}]={p} must be in [-1, {i}) (topological order)")
            children[p + 1].append(i)
        packed = torch.zeros(n + 1, self._buf.shape[-1], dtype=self._buf.dtype)
        valid = torch.zeros(n, dtype=torch.bool)
        packed[0] = self.bitmask()
        start = self._num_accepted
        stack = [(c, 0) for c in reversed(children[0])]  # (node, depth of its parent)
        depth = 0  # tokens accepted on the current path
        try:
            while stack:
                i, pdepth = stack.pop()
                if depth > pdepth:
                    self.rollback(depth - pdepth)
                    depth = pdepth
                t = toks[i]
                if not 0 <= t < self.vocab_size or not (int(packed[pars[i] + 1, t >> 5]) >> (t & 31)) & 1:
                    continue  # invalid node: its row and its subtree stay all-False
                if not self.advance([toks[i]]):  # pragma: no cover - the mask said it was allowed
                    raise RuntimeError(f"xgrammar rejected token {toks[i]} its own mask allowed")
                depth += 1
                valid[i] = True
                packed[i + 1] = self.bitmask()
                stack.extend((c, depth) for c in reversed(children[i + 1]))
        finally:
            self.rollback(self._num_accepted - start)
        return DraftMasks(unpack_bitmask(packed, self.vocab_size), valid, packed)


def _as_list(tokens) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        return [int(t) for t in tokens.reshape(-1).tolist()]
    if isinstance(tokens, int):
        return [tokens]
    return [int(t) for t in tokens]


# ------------------------------------------------------------------------------------------- validation


def check_output(text: str, spec: "str | dict | GrammarSpec") -> str | None:
    """Validate a finished output (decoded text, stop token excluded) against a grammar spec independently of
    xgrammar: ``json`` -> ``json.loads`` gives an object or array; ``regex:`` -> Python ``re.fullmatch``;
    JSON schema -> ``json.loads`` + ``jsonschema``. Returns None when it validates, else the reason."""
    gspec = parse_spec(spec)
    if gspec.kind == "regex":
        try:
            ok = re.fullmatch(gspec.regex, text) is not None
        except re.error as e:
            return f"the pattern is not a Python regex ({e}); cannot check"
        return None if ok else "does not match the regular expression"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg} at char {e.pos})"
    if gspec.kind == "json":
        return None if isinstance(value, (dict, list)) else f"JSON {type(value).__name__}, not an object or array"
    import jsonschema

    schema = gspec.schema
    validator = jsonschema.validators.validator_for(schema)(schema)
    err = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if err is None:
        return None
    path = "/".join(map(str, err.absolute_path)) or "<root>"
    return f"schema violation at {path}: {err.message}"


def decode_output(tokenizer, ids: Sequence[int] | torch.Tensor, stop_token_ids: Iterable[int] = ()) -> str:
    """The text to validate: ``ids`` cut before the first stop token, decoded verbatim (no clean-up of
    tokenization spaces, which would rewrite JSON such as ``"a" , 1``)."""
    stops = set(int(t) for t in stop_token_ids)
    toks = _as_list(ids)
    for k, t in enumerate(toks):
        if t in stops:
            toks = toks[:k]
            break
    return tokenizer.decode(toks, skip_special_tokens=False, clean_up_tokenization_spaces=False)
