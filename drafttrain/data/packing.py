"""Sequence packing: several conversations per row, each its own document (docs/design.md, "Packed rows").

A micro-batch's conversations are placed first-fit-decreasing into rows of at most ``capacity`` tokens
(the shortest rows within 1.1 tensor cells per real token, else the fewest cells: :func:`best_groups`). In
the packed batch every token carries its document index (``doc_ids``, per row, from 0) and its position
inside the document (``position_ids``, restarting at 0). The tail of a row that no document fills is
padding: ``attention_mask`` 0, ``loss_mask`` 0, a document of its own (its positions restart too), so a
Hugging Face model given ``position_ids`` and no ``attention_mask`` isolates it as it isolates documents
(transformers' packed-sequence masks). Losses score a pair of positions only when both lie in the same
document (:func:`drafttrain.losses.same_document`), so a packed micro-batch gives the loss of the same
conversations right-padded one per row (tests/test_packing.py).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..io import DraftTrainError
from .chat import collate

__all__ = ["pack_groups", "best_groups", "packing_cost", "ATTENTION_TOKENS", "collate_packed", "padding_ratio", "lm_inputs", "pack_features"]


def pack_groups(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices into ``lengths`` grouped into rows of at most ``capacity`` tokens.

    Deterministic (ties keep input order); a conversation longer than ``capacity`` gets a row of its own.
    Rows come out in the order they were opened, documents inside a row in placement order.
    """
    if capacity <= 0:
        raise DraftTrainError(f"packing capacity must be positive, got {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = int(lengths[i])
        for r, left in enumerate(free):
            if n <= left:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(capacity - n)
    return rows


# What a packed row costs the drafter: its linear layers, lm_head and loss scale with the row's tensor cells
# (T), its TTT attention (scores, masks and softmax over [T, T] per head and per unrolled step) with T^2.
# ATTENTION_TOKENS is the row length at which the two are equal; a packing of R rows of length T costs
# R * (T + T^2 / ATTENTION_TOKENS) (bench/notebook/training_quality.md, section 3 "The cost of a step": merging
# uniform conversations into rows several times longer made a step 1.4x-4x dearer although it saved a few cells).
ATTENTION_TOKENS = 256


def packing_cost(rows: int, T: int) -> float:
    return rows * (T + T * T / ATTENTION_TOKENS)


def best_groups(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """The packing of ``lengths`` into rows of at most ``capacity`` tokens (``max(lengths)`` if larger) of the
    least :func:`packing_cost` (ties: fewer cells, then shorter rows). Tries first-fit decreasing at the row
    lengths that split the total evenly, and at the longest example's length, which alone is never costlier
    than one example per padded row (no more rows, no longer ones): uniform conversations stay one per row
    whatever the capacity, short ones fill the rows of the long ones."""
    longest, total = max(lengths), sum(lengths)
    cap = max(int(capacity), longest)
    candidates = {longest, cap} | {-(-total // r) for r in range(1, len(lengths) + 1)}
    options = []
    for c in sorted(x for x in candidates if longest <= x <= cap):
        groups = pack_groups(lengths, c)
        T = max(sum(lengths[i] for i in g) for g in groups)
        options.append((packing_cost(len(groups), T), len(groups) * T, T, groups))
    return min(options, key=lambda o: o[:3])[3]


def collate_packed(examples: Sequence[dict], pad_id: int, capacity: int) -> dict[str, torch.Tensor]:
    """Pack ``examples`` (dicts with ``input_ids`` and ``loss_mask``) into ``[R, T]`` rows.

    ``T`` is the longest packed row (at most ``max(capacity, longest example)``; :func:`best_groups` picks
    the rows). Returns ``input_ids``,
    ``attention_mask`` (1 = real token), ``loss_mask``, ``position_ids`` (restart per document and at the
    padding tail), ``doc_ids`` (document index within the row; the padding tail has its own index) and
    ``slots`` ``[N, 2]``: (row, first column) of each example, in input order. When no row would hold two
    conversations, the plain right-padded batch of :func:`drafttrain.data.chat.collate` instead (no
    ``position_ids`` / ``doc_ids`` / ``slots``: the same loss without document masks).
    """
    if not examples:
        raise DraftTrainError("collate_packed: empty batch")
    if pad_id is None:
        raise DraftTrainError("collate_packed: pad_id is None (the tokenizer has no pad token; set one)")
    for b, e in enumerate(examples):
        if len(e["loss_mask"]) != len(e["input_ids"]):
            raise DraftTrainError(f"collate_packed: example {b} has {len(e['input_ids'])} input_ids but "
                                  f"{len(e['loss_mask'])} loss_mask")
    lengths = [len(e["input_ids"]) for e in examples]
    groups = best_groups(lengths, capacity)
    if all(len(g) == 1 for g in groups):  # nothing to share a row: the plain right-padded batch (no masks)
        return collate(examples, pad_id)
    T = max(sum(lengths[i] for i in g) for g in groups)
    R = len(groups)
    input_ids = torch.full((R, T), int(pad_id), dtype=torch.long)
    attention = torch.zeros((R, T), dtype=torch.long)
    loss = torch.zeros((R, T), dtype=torch.long)
    positions = torch.zeros((R, T), dtype=torch.long)
    docs = torch.zeros((R, T), dtype=torch.long)
    slots = torch.zeros((len(examples), 2), dtype=torch.long)
    for r, g in enumerate(groups):
        at = 0
        for d, i in enumerate(g):
            n = lengths[i]
            input_ids[r, at: at + n] = torch.as_tensor(examples[i]["input_ids"], dtype=torch.long)
            loss[r, at: at + n] = torch.as_tensor(examples[i]["loss_mask"], dtype=torch.long)
            attention[r, at: at + n] = 1
            positions[r, at: at + n] = torch.arange(n)
            docs[r, at: at + n] = d
            slots[i] = torch.tensor([r, at])
            at += n
        if at < T:  # padding tail: its own document
            positions[r, at:] = torch.arange(T - at)
            docs[r, at:] = len(g)
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss, "position_ids": positions,
            "doc_ids": docs, "slots": slots}


def padding_ratio(batch: dict[str, torch.Tensor]) -> float:
    """Tokens in the batch's tensors per real token (1.0 = no padding)."""
    am = batch["attention_mask"]
    return am.numel() / max(1, int(am.sum()))


def lm_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keyword arguments for a Hugging Face causal LM's forward over ``batch``: the padding mask of a
    right-padded batch, or, for packed rows, the per-document ``position_ids`` and no mask (transformers
    then builds the block-diagonal causal mask from the position restarts; needs ``use_cache=False``)."""
    if "doc_ids" in batch:
        return {"position_ids": batch["position_ids"]}
    return {"attention_mask": batch["attention_mask"]}


def pack_features(features: torch.Tensor, lengths: Sequence[int], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Place per-example features ``[N, L, W]`` (right-padded, in the examples' order) into the packed
    layout ``[R, T, W]`` of ``batch`` (:func:`collate_packed`'s ``slots``); the padding tail stays 0."""
    R, T = batch["input_ids"].shape
    out = features.new_zeros(R, T, features.shape[-1])
    for b, (row, col) in enumerate(batch["slots"].tolist()):
        n = int(lengths[b])
        out[row, col: col + n] = features[b, :n]
    return out
