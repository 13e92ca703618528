"""EAGLE-3 training-time-test loss and metrics (alignment: docs/design.md, "EAGLE-3 alignment").

Drafter step i at index t predicts x_{t+2+i}; its teacher is the target distribution at position t+1+i.
Per step, this module returns *sums* over valid positions; the caller divides by the number of valid
positions of the whole optimizer step (all micro-batches and ranks) via :func:`combine_step_losses`.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["eagle3_valid_mask", "eagle3_step_stats", "combine_step_losses", "step_weights"]


def _draft_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    return torch.arange(d2t.numel(), device=d2t.device) + d2t.long()


def eagle3_valid_mask(
    input_len: int,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    target_logits: torch.Tensor,
    t2d: torch.Tensor,
    step: int,
) -> torch.Tensor:
    """``[B, T]`` bool: valid iff ``t+2+i < T``, ``attention_mask[t+2+i]`` and ``loss_mask[t+2+i]`` are 1,
    and ``argmax(target_logits[t+1+i])`` is in the draft vocabulary (``t2d``)."""
    T = int(input_len)
    B = attention_mask.shape[0]
    i = int(step)
    valid = torch.zeros(B, T, dtype=torch.bool, device=attention_mask.device)
    n = T - 2 - i  # number of indices t with t + 2 + i < T
    if n <= 0:
        return valid
    am = attention_mask[:, 2 + i :].bool()
    lm = loss_mask[:, 2 + i :].bool()
    top = target_logits[:, 1 + i : 1 + i + n].argmax(-1)  # [B, n]
    in_vocab = t2d.to(top.device)[top]
    valid[:, :n] = am & lm & in_vocab.to(valid.device)
    return valid


def eagle3_step_stats(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    valid: torch.Tensor,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    step: int,
) -> dict[str, torch.Tensor]:
    """Sums over the valid positions of one TTT step.

    - ``loss_sum``: soft cross-entropy ``-sum_x p(x) log q(x)`` with ``p`` the teacher softmax restricted to
      the draft vocabulary (renormalised) and ``q`` the draft softmax (differentiable);
    - ``acc_sum``: draft argmax (mapped through ``d2t``) == full-vocabulary teacher argmax;
    - ``accept_sum``: ``sum_x min(p_full(x), q(x))`` with ``p_full`` the teacher softmax over the full target
      vocabulary: the T=1 acceptance probability (1 - total variation distance);
    - ``count``: number of valid positions.

    Only the valid rows are gathered, so nothing larger than ``[B, T, V]`` is materialised (in float32 when
    the inputs are lower precision).
    """
    B, T, _ = draft_logits.shape
    i = int(step)
    if target_logits.shape[:2] != (B, T) or valid.shape != (B, T):
        raise ValueError(
            f"shape mismatch: draft {tuple(draft_logits.shape)}, target {tuple(target_logits.shape)}, "
            f"valid {tuple(valid.shape)}"
        )
    if target_logits.shape[-1] != t2d.numel() or draft_logits.shape[-1] != d2t.numel():
        raise ValueError("vocabulary sizes of the logits do not match d2t/t2d")
    valid = valid.bool()
    n = max(T - 1 - i, 0)
    if n < T and bool(valid[:, n:].any()):
        raise ValueError(f"valid mask marks indices t >= T-1-step ({n}) that have no teacher")
    v = valid[:, :n]
    q_logits = draft_logits[:, :n][v].float()                 # [N, Vd]
    p_logits = target_logits.detach()[:, 1 + i : 1 + i + n][v].float()  # [N, V]; the teacher is a constant
    ids = _draft_target_ids(d2t).to(p_logits.device)

    log_q = torch.log_softmax(q_logits, dim=-1)
    p_draft = torch.softmax(p_logits[:, ids], dim=-1)
    loss_sum = -(p_draft * log_q).sum()

    with torch.no_grad():
        acc_sum = (ids[q_logits.argmax(-1)] == p_logits.argmax(-1)).sum().float()
        p_full_on_draft = torch.softmax(p_logits, dim=-1)[:, ids]
        accept_sum = torch.minimum(p_full_on_draft, log_q.exp()).sum()
    count = torch.tensor(float(q_logits.shape[0]), device=loss_sum.device)
    return {"loss_sum": loss_sum, "acc_sum": acc_sum, "accept_sum": accept_sum, "count": count}


def step_weights(n: int, decay: float = 0.8) -> list[float]:
    """EAGLE-3 per-step weights ``decay**i`` for i < n."""
    return [float(decay) ** i for i in range(int(n))]


def combine_step_losses(
    loss_sums: Sequence[torch.Tensor],
    counts: Sequence[float | torch.Tensor],
    weights: Sequence[float],
) -> torch.Tensor:
    """``sum_i w_i * loss_sum_i / max(count_i, 1)``; ``counts`` are the *global* valid counts per step."""
    if not (len(loss_sums) == len(counts) == len(weights)) or not loss_sums:
        raise ValueError(
            f"need equally many (>0) loss sums, counts and weights, got {len(loss_sums)}, {len(counts)}, {len(weights)}"
        )
    total = None
    for s, c, w in zip(loss_sums, counts, weights):
        c = torch.as_tensor(c, dtype=torch.float32, device=s.device).clamp_min(1.0)
        term = s * (float(w) / c)
        total = term if total is None else total + term
    return total
