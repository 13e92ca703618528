"""Building a decoder's parts from a decode config (``drafttrain.config.DecodeConfig``, or any object with its
fields): the one place where a proposer is constructed for eval, bench, tune and the scripts.

- :func:`make_proposer`: the proposer of ``decode.method`` (``decode.tree.enabled``: its tree variant) for a
  loaded drafter (EAGLE-3 drafter, Medusa heads or a draft causal LM);
- :func:`target_taps`: what the target must tap for that proposer;
- :func:`draft_depth`: K of the decoder;
- :func:`static_options`: the runner / proposer options of ``static_shapes``, ``compile`` and ``buckets``;
- :func:`cache_length` (:func:`decode_cache_length` for a decode config): the KV-cache capacity of a job.
"""
from __future__ import annotations

from typing import Sequence

from ..io import DraftTrainError
from .target import DEFAULT_BUCKETS

ROUND_SLACK = 8  # cache slots kept beyond the new tokens and a round's draft positions


def cache_length(prompts: Sequence[Sequence[int]], max_new_tokens: int, draft_positions: int = 0,
                 slack: int = ROUND_SLACK) -> int:
    """KV-cache capacity for decoding ``prompts``: the longest prompt, ``max_new_tokens`` new tokens, the most
    positions a round drafts beyond the committed tokens (a chain's K, a tree's nodes) and ``slack``."""
    return max((len(p) for p in prompts), default=0) + int(max_new_tokens) + int(draft_positions) + int(slack)


def draft_positions(decode) -> int:
    """The most positions a round of ``decode`` drafts beyond the committed tokens."""
    return max(int(decode.num_draft_tokens), int(decode.tree.total_tokens) if decode.tree.enabled else 0)


def decode_cache_length(prompts: Sequence[Sequence[int]], decode) -> int:
    """:func:`cache_length` of a decode config (its ``max_new_tokens``, draft length and tree size)."""
    return cache_length(prompts, decode.max_new_tokens, draft_positions(decode))


def static_options(decode, buckets: bool = False) -> dict:
    """``static_shapes`` / ``compile`` (and with ``buckets`` the padded sizes, default
    :data:`drafttrain.decoding.target.DEFAULT_BUCKETS`) of ``decode``, as ``TargetRunner`` and the proposers
    take them."""
    kw = dict(static_shapes=bool(getattr(decode, "static_shapes", False)),
              compile=bool(getattr(decode, "compile", False)))
    if buckets:
        kw["buckets"] = tuple(getattr(decode, "buckets", None) or DEFAULT_BUCKETS)
    return kw


def medusa_choices_for(drafter, decode):
    """The static Medusa tree to decode with: ``decode.tree.medusa_choices`` if given; else one chosen for
    ``decode.tree.total_tokens`` nodes from the per-head accuracy the drafter was saved with; else the tree it
    was saved with; else :data:`drafttrain.decoding.tree.DEFAULT_MEDUSA_CHOICES`."""
    from .tree import DEFAULT_MEDUSA_CHOICES, medusa_choices_from_accuracy

    tree = decode.tree
    if tree.medusa_choices:
        return [list(c) for c in tree.medusa_choices]
    acc = getattr(drafter, "head_topk_accuracy", None)
    if acc:
        return medusa_choices_from_accuracy(acc, tree.total_tokens, max_depth=min(tree.depth, drafter.num_heads))
    saved = getattr(drafter, "medusa_choices", None)
    if saved:
        return [list(c) for c in saved]
    return [c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= drafter.num_heads]


def make_proposer(method: str, drafter=None, decode=None, max_len: int = 4096, device="cpu"):
    """The proposer of ``decode.method``; ``decode.tree.enabled`` selects the tree variant (eagle3, medusa,
    pld, oracle). Tree proposers draft up to ``decode.tree.depth`` tokens along a path (see
    :func:`draft_depth`)."""
    from .proposers import (DraftModelProposer, Eagle3ChainProposer, Eagle3TreeProposer, MedusaChainProposer,
                            MedusaTreeProposer, NoDraft, OracleProposer, PromptLookupProposer, StubTreeProposer)

    tree = decode.tree if decode is not None else None
    use_tree = bool(tree is not None and tree.enabled)
    if method == "eagle3":
        if drafter is None:
            raise DraftTrainError("decode.method=eagle3 needs a drafter (drafter=runs/<run>/final)")
        static = static_options(decode)
        if use_tree:
            return Eagle3TreeProposer(drafter, max_len=max_len, depth=tree.depth, top_k=tree.top_k,
                                      total_tokens=tree.total_tokens, **static)
        return Eagle3ChainProposer(drafter, max_len=max_len, **static)
    if method == "dflash":
        return _dflash_proposer(drafter, decode, max_len, use_tree)
    if method == "medusa":
        if drafter is None:
            raise DraftTrainError("decode.method=medusa needs Medusa heads (drafter=runs/<run>/final)")
        if use_tree:
            return MedusaTreeProposer(drafter, medusa_choices_for(drafter, decode))
        return MedusaChainProposer(drafter)
    if method == "ar":
        return NoDraft()
    if method == "pld":
        if use_tree:  # several matches' continuations as one trie: depth tokens, top_k branches
            from .proposers import PromptLookupTreeProposer

            return PromptLookupTreeProposer(max_ngram=decode.pld_max_ngram, num_tokens=tree.depth,
                                            max_branches=tree.top_k, max_nodes=tree.total_tokens)
        return PromptLookupProposer(max_ngram=decode.pld_max_ngram, num_tokens=decode.num_draft_tokens)
    if method == "oracle":
        if use_tree:  # the right path among top_k - 1 wrong siblings per depth: a benchmark of tree verify
            return StubTreeProposer([], lambda j: True, vocab_size=1 << 62, branching=tree.top_k)
        return OracleProposer([])
    if method == "draft_model":
        if drafter is not None:  # a distilled draft (recipe=draft_model) or a loaded draft model
            return DraftModelProposer(drafter, max_len=max_len, **static_options(decode, buckets=True))
        if not decode.draft_model:
            raise DraftTrainError("decode.method=draft_model needs decode.draft_model=<dir of a causal LM>")
        from transformers import AutoModelForCausalLM

        dm = AutoModelForCausalLM.from_pretrained(decode.draft_model).eval().to(device)
        return DraftModelProposer(dm, max_len=max_len, **static_options(decode, buckets=True))
    raise DraftTrainError(f"decode.method={method}: expected one of ar, eagle3, medusa, pld, oracle, draft_model, "
                          "dflash")


def _dflash_proposer(drafter, decode, max_len: int, use_tree: bool):
    """decode.method=dflash: one drafter forward per round; ``decode.num_draft_tokens`` of the block's B-1 slots."""
    from .dflash_proposer import DFlashProposer

    if drafter is None or not hasattr(drafter, "draft_block"):
        raise DraftTrainError("decode.method=dflash needs a DFlash drafter (drafter=runs/<run>/final, recipe=dflash)")
    if use_tree:
        raise DraftTrainError("decode.method=dflash drafts a chain: decode.tree.enabled=true is not supported")
    slots = int(drafter.config.block_size) - 1
    if decode is not None and int(decode.num_draft_tokens) > slots:
        raise DraftTrainError(f"decode.num_draft_tokens={decode.num_draft_tokens}: this DFlash drafter's block "
                              f"(block_size {slots + 1}) drafts at most {slots} tokens")
    if decode is None:
        return DFlashProposer(drafter, max_len=max_len)
    return DFlashProposer(drafter, max_len=max_len, num_draft_tokens=int(decode.num_draft_tokens) or None,
                          **static_options(decode))


def target_taps(method: str, drafter=None, model=None) -> tuple[int, ...] | None:
    """The target's taps the proposer of ``method`` reads: an EAGLE-3 drafter's ``tap_layers``; for Medusa
    heads the last hidden state ``hidden_states[L]`` of ``model`` (post-norm in transformers 5); else None."""
    if method == "eagle3":
        return tuple(drafter.config.tap_layers)
    if method == "dflash":  # 0-based layer outputs -> HF hidden_states indices
        return tuple(drafter.config.hf_taps)
    if method == "medusa":
        from ..targets.load import num_layers

        return (num_layers(model),)
    return None


def draft_depth(proposer, decode) -> int:
    """K of the decoder: draft tokens per round for chains, the maximum tree depth for tree proposers."""
    if getattr(proposer, "tree", False):
        return int(getattr(proposer, "depth", None) or decode.tree.depth)
    return int(decode.num_draft_tokens)
