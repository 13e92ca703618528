"""Structured output: grammar-constrained decoding (xgrammar) and structured eval sets."""
from .evalset import (
    StructuredExample,
    answer_with_target,
    builtin_structured_examples,
    function_call_schema,
    read_structured_jsonl,
    structured_eval_set,
    validate_outputs,
    write_structured_jsonl,
)
from .grammar import (
    CompiledGrammar,
    DraftMasks,
    GrammarSpec,
    GrammarState,
    apply_mask,
    check_output,
    compile_grammar,
    decode_output,
    parse_spec,
    unpack_bitmask,
)
from .plan import UNCONSTRAINED, GrammarPlan, grammar_plan

__all__ = [
    "CompiledGrammar",
    "DraftMasks",
    "GrammarSpec",
    "GrammarPlan",
    "GrammarState",
    "StructuredExample",
    "answer_with_target",
    "apply_mask",
    "builtin_structured_examples",
    "check_output",
    "compile_grammar",
    "decode_output",
    "function_call_schema",
    "grammar_plan",
    "parse_spec",
    "read_structured_jsonl",
    "structured_eval_set",
    "unpack_bitmask",
    "validate_outputs",
    "write_structured_jsonl",
    "UNCONSTRAINED",
]
