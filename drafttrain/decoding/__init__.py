"""Speculative decoding: target runner, verification rules, proposers and the chain decoder."""
from .engine import GenerationResult, SpecDecoder, aggregate
from .proposers import (
    DraftModelProposer,
    Eagle3ChainProposer,
    NoDraft,
    OracleProposer,
    PromptLookupProposer,
    Proposer,
    StubProposer,
)
from .sampling import (
    SamplingParams,
    process_logits,
    recursive_reject,
    sample,
    verify_chain_greedy,
    verify_chain_sampling,
)
from .target import TargetRunner

__all__ = [
    "DraftModelProposer",
    "Eagle3ChainProposer",
    "GenerationResult",
    "NoDraft",
    "OracleProposer",
    "PromptLookupProposer",
    "Proposer",
    "SamplingParams",
    "SpecDecoder",
    "StubProposer",
    "TargetRunner",
    "aggregate",
    "process_logits",
    "recursive_reject",
    "sample",
    "verify_chain_greedy",
    "verify_chain_sampling",
]
