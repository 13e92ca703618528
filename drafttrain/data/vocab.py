"""Draft vocabulary: the top-N most frequent assistant tokens of the training data.

The drafter's ``lm_head`` only scores ``draft_vocab_size`` tokens. The mapping to the target vocabulary is
stored the way EAGLE-3 / SpecForge / vLLM expect it:

- ``d2t`` (long ``[Vd]``): an *offset* table, ``target_id = draft_id + d2t[draft_id]``;
- ``t2d`` (bool ``[V]``): ``t2d[target_id]`` is True iff the target token is in the draft vocabulary.

Selected target ids are sorted ascending, so draft id order follows target id order.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from drafttrain.io import DraftTrainError

__all__ = [
    "build_draft_vocab",
    "count_assistant_tokens",
    "d2t_target_ids",
    "draft_to_target",
    "target_to_draft",
    "default_draft_vocab_size",
]


def default_draft_vocab_size(vocab_size: int) -> int:
    """EAGLE-3's 32000, but never more than half the target vocabulary (and at least 1)."""
    return min(32000, max(1, int(vocab_size) // 2))


def build_draft_vocab(
    token_counts: torch.Tensor,
    draft_vocab_size: int,
    always_include: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the draft vocabulary and return ``(d2t, t2d)``.

    ``token_counts[v]`` is how often target token ``v`` occurs in assistant spans. The selection is:
    every id of ``always_include`` (e.g. eos), then the most frequent ids (ties broken by lower id) until
    ``draft_vocab_size`` ids are chosen. If fewer tokens were seen than needed, the rest is filled with the
    lowest unused ids (count 0 sorts by id, so this is the same rule).
    """
    counts = torch.as_tensor(token_counts)
    if counts.dim() != 1:
        raise DraftTrainError(f"token_counts must be 1-D [vocab_size], got shape {tuple(counts.shape)}")
    if counts.is_floating_point() and not torch.isfinite(counts).all():
        raise DraftTrainError("token_counts contains non-finite values")
    V = counts.numel()
    n = int(draft_vocab_size)
    if n <= 0:
        raise DraftTrainError(f"draft_vocab_size must be positive, got {draft_vocab_size}")
    if n > V:
        raise DraftTrainError(
            f"draft_vocab_size={n} is larger than the target vocabulary ({V} tokens); "
            f"use at most {V} (default would be {default_draft_vocab_size(V)})"
        )
    if (counts < 0).any():
        raise DraftTrainError("token_counts must be non-negative")

    forced = sorted({int(t) for t in always_include})
    for t in forced:
        if not 0 <= t < V:
            raise DraftTrainError(f"always_include id {t} is outside the target vocabulary [0, {V})")
    if len(forced) > n:
        raise DraftTrainError(
            f"always_include has {len(forced)} distinct ids but draft_vocab_size is only {n}"
        )

    counts = counts.detach().to("cpu", torch.float64)
    # Stable descending sort: equal counts keep ascending id order (ties -> lower id first).
    order = torch.sort(counts, descending=True, stable=True).indices
    chosen = torch.zeros(V, dtype=torch.bool)
    if forced:
        chosen[torch.tensor(forced, dtype=torch.long)] = True
    need = n - len(forced)
    if need > 0:
        rest = order[~chosen[order]][:need]
        chosen[rest] = True
    selected = chosen.nonzero().flatten()  # ascending
    assert selected.numel() == n
    d2t = (selected - torch.arange(n, dtype=torch.long)).to(torch.long)
    return d2t, chosen


def count_assistant_tokens(examples: Iterable[Mapping[str, Sequence[int]]], vocab_size: int) -> torch.Tensor:
    """Count target tokens inside assistant spans (``loss_mask == 1``) -> LongTensor ``[vocab_size]``."""
    V = int(vocab_size)
    if V <= 0:
        raise DraftTrainError(f"vocab_size must be positive, got {vocab_size}")
    total = torch.zeros(V, dtype=torch.long)
    for k, ex in enumerate(examples):
        try:
            ids = torch.as_tensor(ex["input_ids"], dtype=torch.long).flatten()
            mask = torch.as_tensor(ex["loss_mask"]).flatten()
        except KeyError as e:
            raise DraftTrainError(f"example {k}: missing field {e.args[0]!r} (need input_ids and loss_mask)") from None
        if ids.numel() != mask.numel():
            raise DraftTrainError(
                f"example {k}: input_ids ({ids.numel()}) and loss_mask ({mask.numel()}) differ in length"
            )
        sel = ids[mask.bool()]
        if sel.numel() == 0:
            continue
        lo, hi = int(sel.min()), int(sel.max())
        if lo < 0 or hi >= V:
            bad = lo if lo < 0 else hi
            raise DraftTrainError(f"example {k}: token id {bad} is outside the vocabulary [0, {V})")
        total += torch.bincount(sel, minlength=V)
    return total


def d2t_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of every draft id, ``[Vd]`` long, ascending (``draft_id + d2t[draft_id]``): the one
    definition of the ``d2t`` offset table (losses, the drafter, the export loader and the maps below use it)."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t.long()


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Map draft-vocabulary ids to target ids (``id + d2t[id]``)."""
    draft_ids = torch.as_tensor(draft_ids, dtype=torch.long, device=d2t.device)
    return d2t_target_ids(d2t)[draft_ids]


def target_to_draft(target_ids: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Map target ids to draft ids; ids outside the draft vocabulary map to -1."""
    target_ids = torch.as_tensor(target_ids, dtype=torch.long, device=d2t.device)
    targets_sorted = d2t_target_ids(d2t)  # ascending by construction
    idx = torch.searchsorted(targets_sorted, target_ids).clamp_max(d2t.numel() - 1)
    inside = t2d.to(d2t.device)[target_ids.clamp(0, t2d.numel() - 1)]
    inside &= (target_ids >= 0) & (target_ids < t2d.numel()) & (targets_sorted[idx] == target_ids)
    return torch.where(inside, idx, torch.full_like(idx, -1))
