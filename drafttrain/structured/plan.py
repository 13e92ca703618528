"""Which grammar each evaluation prompt is decoded under, and what its output is validated against.

``grammar_plan(decode_grammar, examples, n)`` combines ``decode.grammar`` with the evaluation data:

=====================================  ======================================  =================================
``decode.grammar``                      plain prompts (``data=builtin|jsonl``)  structured rows (``data=structured``)
=====================================  ======================================  =================================
unset (None)                            unconstrained, nothing validated        each row's own schema
``json`` / ``regex:…`` / schema file    that grammar, validated against it      that grammar, validated against it
``none``                                unconstrained, nothing validated        unconstrained, validated against
                                                                                each row's schema (the baseline of
                                                                                a with/without-grammar comparison)
=====================================  ======================================  =================================

"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .grammar import CompiledGrammar, GrammarSpec, check_output, compile_grammar, decode_output, parse_spec

__all__ = ["GrammarPlan", "grammar_plan", "UNCONSTRAINED"]

UNCONSTRAINED = "none"  # decode.grammar=none: decode without a grammar even on structured rows


@dataclass
class GrammarPlan:
    """Per prompt: the grammar decoding uses (``decode[i]``, None = unconstrained) and the spec its output is
    validated against (``check[i]``, None = not validated). ``label`` goes into the report's ``grammar`` key:
    ``json``, ``regex:<pattern>``, ``json_schema:<file>``, ``json_schema:per-row`` or None (unconstrained)."""

    label: str | None
    decode: list[GrammarSpec | None]
    check: list[GrammarSpec | None]

    @property
    def constrained(self) -> bool:
        return any(s is not None for s in self.decode)

    @property
    def validated(self) -> bool:
        return any(s is not None for s in self.check)

    def compile(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> list[CompiledGrammar | None]:
        """Compile each prompt's grammar (xgrammar caches identical specs) with the decoder's eos set as stops."""
        return [None if s is None else compile_grammar(s, tokenizer, vocab_size, stop_token_ids,
                                                       where=s.source if s.kind == "json_schema" else "decode.grammar")
                for s in self.decode]

    def validate(self, tokenizer, outputs: Sequence[Sequence[int]], stop_token_ids: Sequence[int]) -> dict:
        """Check each output (token ids) against ``check``: ``{"valid_fraction", "num_valid", "num", "failures"}``
        (``valid_fraction`` None when nothing is validated; ``failures``: up to 10 ``{"prompt", "error"}``;
        an output that ran out of tokens before its stop token is reported as cut)."""
        stops = set(int(t) for t in stop_token_ids)
        failures, num = [], 0
        for i, (spec, out) in enumerate(zip(self.check, outputs)):
            if spec is None:
                continue
            num += 1
            err = check_output(decode_output(tokenizer, out, stops), spec)
            if err is not None:
                if not any(int(t) in stops for t in out):
                    err = f"cut at max_new_tokens ({len(out)} tokens) before the stop token: {err}"
                failures.append({"prompt": i, "error": err})
        return {"valid_fraction": (num - len(failures)) / num if num else None, "num_valid": num - len(failures),
                "num": num, "failures": failures[:10]}


def grammar_plan(decode_grammar: str | None, examples: Sequence, n: int) -> GrammarPlan:
    """The plan for the first ``n`` evaluation ``examples`` (conversations, or ``StructuredExample`` rows that
    carry a ``schema``) under ``decode.grammar`` (see the module doc). Bad specs raise DraftTrainError naming
    ``decode.grammar`` or the row."""
    rows = list(examples)[:n]
    schemas = [getattr(e, "schema", None) for e in rows]
    structured = any(s is not None for s in schemas)
    row_specs = [None if s is None else parse_spec(s, where=f"{getattr(e, 'where', '') or 'row'}: schema")
                 for s, e in zip(schemas, rows)]
    if decode_grammar is not None and decode_grammar.strip().lower() == UNCONSTRAINED:
        return GrammarPlan(None, [None] * len(rows), row_specs)
    if decode_grammar is not None:
        spec = parse_spec(decode_grammar, where="decode.grammar")
        return GrammarPlan(spec.describe(), [spec] * len(rows), [spec] * len(rows))
    if structured:
        return GrammarPlan("json_schema:per-row", row_specs, row_specs)
    return GrammarPlan(None, [None] * len(rows), [None] * len(rows))
