"""Training losses and metrics of every drafter family, as tensor functions (models run in training/*.py).

- EAGLE-3 training-time test (TTT): the compact teacher (:class:`Eagle3Teacher`, :func:`teacher_from_hidden`,
  :func:`teacher_from_logits`), the valid mask and the per-step sums of the step loss ``ce`` / ``tv`` /
  ``lk_hybrid`` (:data:`EAGLE3_LOSSES`, :func:`eagle3_valid_mask`, :func:`eagle3_step_stats`) and the step
  weights ``0.8**i`` (:func:`step_weights`). Drafter step i at index t predicts x_{t+2+i}; its teacher is the
  target distribution at position t+1+i (docs/design.md, "EAGLE-3 alignment").
- Medusa heads: head k at t predicts x_{t+2+k} (:func:`medusa_valid_mask`); per-head CE and top-1/top-k sums
  (:func:`medusa_head_stats`), head weights (:func:`medusa_head_weights`); :func:`medusa_loss` is the
  one-batch form (means over the batch's own tokens).
- DFlash blocks: slot k of the block at anchor p predicts x_{p+k} (:func:`dflash_slot_stats`: per-slot sums,
  the greedy prefix acceptance), slot weights exp(-(k-1)/gamma) (:func:`dflash_slot_weights`) or D-PACE's
  (:func:`dpace_weights`).
- Distillation: per-token divergences between teacher and student logits (``fkl``, ``rkl``, ``jsd``, ``tvd``:
  :data:`KD_KINDS`), their masked mean or weighted mix :func:`kd_loss` (also the Medusa-2 self-distillation
  KL, training/medusa.py), and the plain next-token CE baseline :func:`ce_loss`, both over the positions of
  :func:`next_token_mask`.

Normalisation: the training methods take the *sums* over valid positions these functions return (``loss_sum``,
``ce_sum``, ...) and divide them by the number of valid positions of the whole optimizer step (all
micro-batches and ranks; weighted terms through :func:`combine_step_losses`); the means they also return are
per batch.

Packed rows (drafttrain.data.packing): every mask takes the batch's optional ``doc_ids``; a position is
scored only if the token it predicts lies in its own document (:func:`same_document`).

The EAGLE-3 teacher is compact: the target's logits over the draft vocabulary only, plus the full-vocabulary
log-normaliser and argmax, which :func:`teacher_from_hidden` computes in vocabulary chunks, so the
``[B, T, V]`` float32 logits of a large vocabulary are never built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .data.vocab import d2t_target_ids

__all__ = ["eagle3_valid_mask", "eagle3_step_stats", "eagle3_aligned", "combine_step_losses", "step_weights",
           "same_document", "feature_regression_sum", "Eagle3Teacher", "teacher_from_logits", "teacher_from_hidden",
           "EAGLE3_LOSSES", "soft_cross_entropy", "dflash_slot_weights", "dpace_weights", "dflash_slot_stats"]

# EAGLE-3 step losses: soft cross-entropy to the renormalised teacher on the draft vocabulary (EAGLE-3's
# own, = forward KL up to a constant), total variation to the full teacher (1 - the acceptance
# probability), and the LK-style hybrid (mean of the two)
EAGLE3_LOSSES = ("ce", "tv", "lk_hybrid")


def same_document(doc_ids: torch.Tensor | None, offset: int, shape: tuple[int, int] | None = None,
                  device=None) -> torch.Tensor | None:
    """``[B, T]`` bool: ``doc_ids[:, t] == doc_ids[:, t + offset]`` (False where ``t + offset >= T``);
    ``None`` when ``doc_ids`` is ``None`` (one document per row: nothing to exclude)."""
    if doc_ids is None:
        return None
    B, T = doc_ids.shape
    out = torch.zeros(B, T, dtype=torch.bool, device=doc_ids.device)
    o = int(offset)
    if 0 <= o < T:
        out[:, : T - o] = doc_ids[:, : T - o] == doc_ids[:, o:]
    return out


def _and_doc(valid: torch.Tensor, doc_ids: torch.Tensor | None, offset: int) -> torch.Tensor:
    same = same_document(doc_ids, offset)
    return valid if same is None else valid & same.to(valid.device)


@dataclass
class Eagle3Teacher:
    """The target's next-token distributions as EAGLE-3's loss reads them, without ``[B, T, V]``:

    ``logits`` ``[B, T, Vd]`` float32 (target logits of the draft vocabulary, in draft-id order), ``lse``
    ``[B, T]`` float32 (log-sum-exp over the *full* target vocabulary) and ``top`` ``[B, T]`` long (the
    full-vocabulary argmax, a target id).

    On-demand form (``logits`` is ``None``; ``eagle3.recompute_teacher``): ``hidden`` ``[B, T, H]`` (the
    lm_head input) and the lm_head's draft-vocabulary ``rows`` ``[Vd, H]`` (with ``bias`` ``[Vd]`` and
    ``softcap``) are kept instead, and :meth:`draft_logits` computes the logits of the rows a TTT step scores
    only: memory ``[B, T, H]`` in the target's dtype instead of ``[B, T, Vd]`` float32."""

    logits: torch.Tensor | None
    lse: torch.Tensor
    top: torch.Tensor
    hidden: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    softcap: float | None = None
    # draft_probs' per-temperature tables of the dense form (not part of the teacher's value)
    _probs_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.logits is None) == (self.hidden is None) or (self.hidden is not None and self.rows is None):
            raise ValueError("a teacher holds either its logits or the hidden state and lm_head rows")
        lead = (self.logits if self.logits is not None else self.hidden).shape[:2]
        if lead != self.lse.shape or self.lse.shape != self.top.shape:
            raise ValueError(f"teacher shapes disagree: logits/hidden {tuple(lead)}, lse "
                             f"{tuple(self.lse.shape)}, top {tuple(self.top.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.top.shape

    @property
    def vocab_size(self) -> int:
        """Vd, the draft vocabulary the logits cover."""
        return self.logits.shape[-1] if self.logits is not None else self.rows.shape[0]

    def draft_logits(self, sl: slice, valid: torch.Tensor) -> torch.Tensor:
        """``[N, Vd]`` float32 logits at positions ``[:, sl]`` where ``valid`` (row-major), detached."""
        if self.logits is not None:
            return self.logits.detach()[:, sl][valid].float()
        with torch.no_grad():
            return _head_logits(self.hidden[:, sl][valid], self.rows, self.bias, self.softcap)

    def draft_probs(self, sl: slice, valid: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(p_soft, p_full)`` ``[N, Vd]`` float32 at positions ``[:, sl]`` where ``valid`` (row-major), detached:
        ``softmax(logits / temperature)`` over the draft vocabulary (renormalised) and the full-vocabulary
        probabilities ``exp(logits - lse)`` of the same tokens.

        The dense form computes both once for every position and keeps them (TTT step i reads the teacher at
        t+1+i, so each position is read by up to ``ttt_steps`` steps: one softmax instead of one per step).
        At ``temperature`` 1, ``p_full = p_soft * exp(lse_draft - lse)``, so only ``p_soft`` is kept. The
        on-demand form computes them per call (its memory bound is the point of that form)."""
        if self.logits is None:
            x = self.draft_logits(sl, valid)
            return self._probs(x, self.lse.detach()[:, sl][valid].float(), temperature)
        key = float(temperature)
        if key not in self._probs_cache:
            x = self.logits.detach().float()
            self._probs_cache[key] = self._probs(x, self.lse.detach().float(), key, factored=True)
        p_soft, second = self._probs_cache[key]
        p = p_soft[:, sl][valid]
        if second.dim() == p_soft.dim() - 1:  # the draft vocabulary's share of the full mass, per position
            return p, p * second[:, sl][valid].unsqueeze(-1)
        return p, second[:, sl][valid]

    def release_probs(self) -> None:
        """Drop :meth:`draft_probs`' tables (a micro-batch's loss is done with them; the captures of every
        micro-batch of a step live until the step ends)."""
        self._probs_cache.clear()

    @staticmethod
    def _probs(x: torch.Tensor, lse: torch.Tensor, temperature: float, factored: bool = False):
        if temperature == 1.0:
            lse_draft = torch.logsumexp(x, dim=-1, keepdim=True)
            p_soft = (x - lse_draft).exp_()
            mass = (lse_draft.squeeze(-1) - lse).exp_()  # sum over the draft vocabulary of the full softmax
            return (p_soft, mass) if factored else (p_soft, p_soft * mass.unsqueeze(-1))
        return torch.softmax(x / temperature, dim=-1), (x - lse.unsqueeze(-1)).exp_()

    def dense_logits(self) -> torch.Tensor:
        """``[B, T, Vd]`` float32 logits (built on demand in the on-demand form)."""
        if self.logits is not None:
            return self.logits
        with torch.no_grad():
            return _head_logits(self.hidden, self.rows, self.bias, self.softcap)


def _head_logits(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    """``h @ w.T (+ bias)`` in ``w``'s dtype, then float32 and Gemma-style soft-capping ``c * tanh(x / c)``."""
    x = torch.matmul(h.to(w.dtype), w.t())
    if bias is not None:
        x = x + bias
    x = x.float()
    if softcap:
        x = float(softcap) * torch.tanh(x / float(softcap))
    return x


def teacher_from_logits(target_logits: torch.Tensor, d2t: torch.Tensor) -> Eagle3Teacher:
    """The compact teacher of full-vocabulary logits ``[B, T, V]`` (the reference for
    :func:`teacher_from_hidden`; offline features and tests)."""
    x = target_logits.detach()
    ids = d2t_target_ids(d2t).to(x.device)
    return Eagle3Teacher(logits=x[..., ids].float(), lse=torch.logsumexp(x.float(), dim=-1), top=x.argmax(-1))


@torch.no_grad()
def teacher_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, d2t: torch.Tensor,
                        bias: torch.Tensor | None = None, softcap: float | None = None,
                        chunk: int = 16384, on_demand: bool = False) -> Eagle3Teacher:
    """The compact teacher from the lm_head input ``hidden`` ``[B, T, H]`` and the head's ``weight``
    ``[V, H]`` (and ``bias``): the full log-normaliser and argmax accumulated over vocabulary chunks of
    ``chunk`` rows (peak extra memory ``[B, T, chunk]``), the draft-vocabulary columns (by ``d2t``) taken
    from the same chunks' logits (one pass of the head).
    ``softcap`` applies Gemma-style final-logit soft-capping ``c * tanh(x / c)`` first. ``on_demand``: keep
    ``hidden`` and the selected rows instead of the draft-vocabulary logits (:class:`Eagle3Teacher`)."""
    V = weight.shape[0]
    h = hidden.to(weight.dtype)

    def logits_of(rows: torch.Tensor | slice) -> torch.Tensor:
        return _head_logits(h, weight[rows], None if bias is None else bias[rows], softcap)

    ids = d2t_target_ids(d2t).to(weight.device)  # ascending
    lse = top = best = None
    draft = []  # the draft columns of each chunk's logits (ids ascending: draft-id order)
    for start in range(0, V, int(chunk)):
        end = min(V, start + int(chunk))
        x = logits_of(slice(start, end))
        if not on_demand:
            lo, hi = torch.searchsorted(ids, torch.tensor([start, end], device=ids.device)).tolist()
            draft.append(x[..., ids[lo:hi] - start])
        m, arg = x.max(-1)
        c_lse = torch.logsumexp(x, dim=-1)
        if lse is None:
            lse, best, top = c_lse, m, arg + start
        else:
            lse = torch.logaddexp(lse, c_lse)
            better = m > best  # strict: ties keep the earlier (lower) id, as argmax over the full row does
            best = torch.where(better, m, best)
            top = torch.where(better, arg + start, top)
    if on_demand:
        return Eagle3Teacher(logits=None, lse=lse, top=top, hidden=h, rows=weight[ids],
                             bias=None if bias is None else bias[ids], softcap=softcap)
    return Eagle3Teacher(logits=torch.cat(draft, dim=-1), lse=lse, top=top)


def _as_teacher(target, d2t: torch.Tensor | None) -> Eagle3Teacher:
    if isinstance(target, Eagle3Teacher):
        return target
    if d2t is None:
        raise ValueError("full-vocabulary teacher logits need d2t")
    return teacher_from_logits(target, d2t)


def eagle3_valid_mask(
    input_len: int,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    target: torch.Tensor | Eagle3Teacher,
    t2d: torch.Tensor,
    step: int,
    doc_ids: torch.Tensor | None = None,
    score_oov: bool = False,
    answer_chains: bool = False,
) -> torch.Tensor:
    """``[B, T]`` bool: valid iff ``t+2+i < T``, ``attention_mask[t+2+i]`` and ``loss_mask[t+2+i]`` are 1,
    ``argmax`` of the target at ``t+1+i`` is in the draft vocabulary (``t2d``; not required with
    ``score_oov``), and (packed rows) ``t+2+i`` lies in the document of ``t``. With ``answer_chains`` also
    ``loss_mask[t+1]``: the token step 0 embeds at t is an answer token, as at decode time, where the drafter
    starts a chain only from a token the target has produced (never from inside the prompt).
    ``target``: full logits ``[B, T, V]`` or an :class:`Eagle3Teacher`."""
    T = int(input_len)
    B = attention_mask.shape[0]
    i = int(step)
    valid = torch.zeros(B, T, dtype=torch.bool, device=attention_mask.device)
    n = T - 2 - i  # number of indices t with t + 2 + i < T
    if n <= 0:
        return valid
    am = attention_mask[:, 2 + i :].bool()
    lm = loss_mask[:, 2 + i :].bool()
    if answer_chains:
        lm = lm & loss_mask[:, 1 : 1 + n].bool()
    if score_oov:
        valid[:, :n] = am & lm
    else:
        top_all = target.top if isinstance(target, Eagle3Teacher) else target.argmax(-1)
        top = top_all[:, 1 + i : 1 + i + n]  # [B, n]
        in_vocab = t2d.to(top.device)[top]
        valid[:, :n] = am & lm & in_vocab.to(valid.device)
    return _and_doc(valid, doc_ids, 2 + i)


def eagle3_step_stats(
    draft_logits: torch.Tensor,
    target: torch.Tensor | Eagle3Teacher,
    valid: torch.Tensor,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    step: int,
    loss: str = "ce",
    teacher_temperature: float = 1.0,
    topk: int = 0,
    topk_weight: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Sums over the valid positions of one TTT step.

    - ``loss_sum`` (differentiable), by ``loss``:
      ``ce``: soft cross-entropy ``-sum_x p(x) log q(x)`` with ``p`` the teacher softmax restricted to the
      draft vocabulary (renormalised) and ``q`` the draft softmax;
      ``tv``: total variation ``1 - sum_x min(p_full(x), q(x))`` against the full-vocabulary teacher (the
      draft puts no mass outside its vocabulary): 1 - the acceptance probability of a sampled draft token;
      ``lk_hybrid``: ``(ce + tv) / 2`` (CE's dense gradient early, TV's acceptance objective);
      ``teacher_temperature`` ``t``: the cross-entropy's teacher is ``softmax(logits / t)`` (``t < 1``
      sharpens it towards the argmax greedy decoding accepts; TV keeps the full-vocabulary teacher);
      ``topk`` K > 0 adds HASS's harmonized objective distillation (arXiv 2408.15766), ``topk_weight`` times
      ``-sum_{x in TopK(p)} p(x) log q(x)``: the soft CE's terms of the teacher's K most likely tokens once more,
      so the ranking at the top, what a greedy or top-k draft proposes, weighs more;
    - ``acc_sum``: draft argmax (mapped through ``d2t``) == full-vocabulary teacher argmax;
    - ``accept_sum``: ``sum_x min(p_full(x), q(x))``: the T=1 acceptance probability;
    - ``count``: number of valid positions.

    ``target``: full logits ``[B, T, V]`` or the compact :class:`Eagle3Teacher`. Only the valid rows are
    gathered before the float32 softmaxes. ``draft_logits`` may also be those rows already, ``[N, Vd]`` for
    the N valid positions of ``valid[:, :T-1-step]`` in row-major order (the head then ran on them only).
    """
    if loss not in EAGLE3_LOSSES:
        raise ValueError(f"unknown EAGLE-3 loss {loss!r}; expected one of {EAGLE3_LOSSES}")
    if not teacher_temperature > 0:
        raise ValueError(f"teacher_temperature must be > 0, got {teacher_temperature}")
    if int(topk) < 0 or not topk_weight >= 0:
        raise ValueError(f"topk must be >= 0 and topk_weight >= 0, got {topk} and {topk_weight}")
    rows = draft_logits.dim() == 2
    B, T = valid.shape if rows else draft_logits.shape[:2]
    i = int(step)
    teacher = _as_teacher(target, d2t)
    if teacher.shape != (B, T) or valid.shape != (B, T):
        raise ValueError(
            f"shape mismatch: draft {tuple(draft_logits.shape)}, target {tuple(teacher.shape)}, "
            f"valid {tuple(valid.shape)}"
        )
    if not isinstance(target, Eagle3Teacher) and target.shape[-1] != t2d.numel():
        raise ValueError("vocabulary sizes of the logits do not match d2t/t2d")
    if draft_logits.shape[-1] != d2t.numel() or teacher.vocab_size != d2t.numel():
        raise ValueError("vocabulary sizes of the logits do not match d2t/t2d")
    valid = valid.bool()
    n = max(T - 1 - i, 0)
    if n < T and bool(valid[:, n:].any()):
        raise ValueError(f"valid mask marks indices t >= T-1-step ({n}) that have no teacher")
    v = valid[:, :n]
    q_logits = (draft_logits if rows else draft_logits[:, :n][v]).float()  # [N, Vd]
    if rows and q_logits.shape[0] != int(v.sum()):
        raise ValueError(f"{q_logits.shape[0]} draft rows for {int(v.sum())} valid positions")
    sl = slice(1 + i, 1 + i + n)
    # [N, Vd] each, constants: the teacher softmax on the draft vocabulary (renormalised) and the
    # full-vocabulary probabilities of the same tokens
    p_soft, p_full_on_draft = teacher.draft_probs(sl, v, teacher_temperature)
    p_top = teacher.top[:, sl][v]                                      # [N]
    ids = d2t_target_ids(d2t).to(p_soft.device)

    loss_sum, q, q_max = _eagle3_loss_sum(loss, q_logits, p_soft, p_full_on_draft, topk, topk_weight)
    with torch.no_grad():
        # the draft's greedy token is the target's argmax: its logit there is the row's largest (valid positions
        # have the target's argmax in the draft vocabulary; an exact tie for the largest counts as a hit)
        top_draft = torch.searchsorted(ids, p_top).clamp_(max=ids.numel() - 1)
        hit = (ids[top_draft] == p_top) & (q_logits.detach().gather(1, top_draft[:, None]).squeeze(1) >= q_max)
        acc_sum = hit.sum().float()
        accept_sum = torch.minimum(p_full_on_draft, q.detach()).sum()
    count = torch.tensor(float(q_logits.shape[0]), device=loss_sum.device)
    return {"loss_sum": loss_sum, "acc_sum": acc_sum, "accept_sum": accept_sum, "count": count}


def _eagle3_loss_sum(loss: str, q_logits: torch.Tensor, p_soft: torch.Tensor, p_full_on_draft: torch.Tensor,
                     topk: int, topk_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`eagle3_step_stats`'s differentiable sum over the rows ``q_logits [N, Vd]`` (see there), with the
    draft softmax ``q`` and each row's largest logit (detached) for its statistics."""
    if loss == "ce":
        ce_sum, q, q_max = soft_cross_entropy(q_logits, p_soft, with_max=True)
    else:
        log_q = torch.log_softmax(q_logits, dim=-1)
        q = log_q.exp()
        q_max = q_logits.detach().amax(-1)
        tv_sum = (1.0 - torch.minimum(p_full_on_draft, q).sum(-1)).sum()
        if loss == "lk_hybrid":
            ce_sum = -(p_soft * log_q).sum()
    loss_sum = ce_sum if loss == "ce" else tv_sum if loss == "tv" else 0.5 * (ce_sum + tv_sum)
    if topk > 0 and topk_weight > 0 and q_logits.shape[0] > 0:  # HASS: the teacher's top-k terms once more
        p_k, idx = p_soft.topk(min(int(topk), p_soft.shape[-1]), dim=-1)  # [N, K] (constants)
        log_q_k = q_logits.gather(1, idx) - torch.logsumexp(q_logits, dim=-1, keepdim=True)
        loss_sum = loss_sum - topk_weight * (p_k * log_q_k).sum()
    return loss_sum, q, q_max


def feature_regression_sum(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum over rows of the mean squared difference ``[N, H]`` -> scalar (``target`` a constant): EAGLE-1's
    feature regression as an EAGLE-3 auxiliary (``eagle3.experimental.feature_loss_weight``): drafting step i's output hidden
    state at t, the one step i+1 reads, against the fused target features at t+1+i that it stands in for."""
    if pred.shape != target.shape:
        raise ValueError(f"feature regression: prediction {tuple(pred.shape)} vs target {tuple(target.shape)}")
    return (pred.float() - target.detach().float()).pow(2).mean(-1).sum()


@torch.no_grad()
def eagle3_aligned(
    draft_logits: torch.Tensor,
    target: torch.Tensor | Eagle3Teacher,
    valid: torch.Tensor,
    d2t: torch.Tensor,
    step: int,
    top_k: int = 1,
) -> torch.Tensor:
    """GRIFFIN's token alignment (arXiv 2502.11018): ``[N]`` bool, one per valid position of TTT step
    ``step`` in row-major order (the rows of ``draft_logits`` ``[N, Vd]``, as :func:`eagle3_step_stats` takes
    them): whether the target's argmax at ``t+1+step`` (full vocabulary) is among the draft's ``top_k``
    tokens there. With ``top_k=1``: the draft's greedy token would have been accepted at that depth."""
    if draft_logits.dim() != 2:
        raise ValueError(f"draft_logits must be the valid rows [N, Vd], got {tuple(draft_logits.shape)}")
    teacher = _as_teacher(target, d2t)
    i = int(step)
    T = valid.shape[1]
    n = max(T - 1 - i, 0)
    v = valid.bool()[:, :n]
    top = teacher.top[:, 1 + i : 1 + i + n][v].to(draft_logits.device)  # [N] target ids
    if top.shape[0] != draft_logits.shape[0]:
        raise ValueError(f"{draft_logits.shape[0]} draft rows for {top.shape[0]} valid positions")
    k = max(1, min(int(top_k), draft_logits.shape[-1]))
    ids = d2t_target_ids(d2t).to(draft_logits.device)[draft_logits.topk(k, dim=-1).indices]  # [N, k]
    return (ids == top[:, None]).any(-1)


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, p: torch.Tensor):
        # one exp pass: with y = z - max, q = exp(y) / s and -sum p log q = log s * sum p - sum p y per row
        m = z.amax(-1, keepdim=True)
        y = z - m
        p_y = (p * y).sum(-1)  # a product and a sum: faster than linalg.vecdot on the CPU
        q = y.exp_()
        s = q.sum(-1)
        q.div_(s.unsqueeze(-1))
        p_mass = p.sum(-1, keepdim=True)
        loss = (s.log_() * p_mass.squeeze(-1) - p_y).sum()
        ctx.save_for_backward(q, p, p_mass)
        m = m.squeeze(-1)
        ctx.mark_non_differentiable(q, m)
        return loss, q, m

    @staticmethod
    def backward(ctx, g: torch.Tensor, _g_q: torch.Tensor, _g_m: torch.Tensor):
        q, p, p_mass = ctx.saved_tensors
        return (q * (p_mass * g)).addcmul_(p, -g), None


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor, with_max: bool = False):
    """``(-sum_rows sum_x p(x) log softmax(logits)(x), softmax(logits))`` for ``logits`` and constant target
    weights ``p`` ``[N, V]``; the softmax is returned detached (for acceptance metrics), and with ``with_max``
    also each row's largest logit ``[N]`` (detached; whether a token is the draft's greedy choice is
    ``logits[token] == max``, one gather, where an argmax with indices is a slow pass on the CPU). Forward:
    one max, one exp and three row reductions over ``[N, V]`` (no log-softmax table); backward:
    ``(softmax(logits) * sum_x p - p) * g`` in one expression, where autograd's log_softmax, product and sum
    build and read three ``[N, V]`` gradients for the same numbers (tests/test_losses.py)."""
    loss, q, m = _SoftCrossEntropy.apply(logits, p.detach())
    return (loss, q, m) if with_max else (loss, q)


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


# =============================================================================================== Medusa
# Head k (0-based) reads the target's final (post-norm) hidden state at position t and predicts x_{t+2+k}
# (head 0 = two tokens ahead; the target's own lm_head covers t+1). Valid iff t+2+k < T, attention_mask[t]
# and attention_mask / loss_mask at t+2+k are 1.

__all__ += [
    "medusa_valid_mask",
    "medusa_head_stats",
    "medusa_loss",
    "medusa_head_weights",
    "next_token_mask",
    "kd_fkl",
    "kd_rkl",
    "kd_jsd",
    "kd_tvd",
    "kd_loss",
    "ce_loss",
    "KD_KINDS",
]


def medusa_valid_mask(attention_mask: torch.Tensor, loss_mask: torch.Tensor, head: int,
                      doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T]`` bool: position t of head ``head`` is scored on token ``t+2+head`` (in t's document)."""
    B, T = attention_mask.shape
    off = 2 + int(head)
    valid = torch.zeros(B, T, dtype=torch.bool, device=attention_mask.device)
    n = T - off
    if n > 0:
        valid[:, :n] = attention_mask[:, :n].bool() & attention_mask[:, off:].bool() & loss_mask[:, off:].bool()
    return _and_doc(valid, doc_ids, off)


def medusa_head_stats(
    head_logits: torch.Tensor | Sequence[torch.Tensor],
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    topk: int = 5,
    doc_ids: torch.Tensor | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Per-head sums over valid positions (for normalising by a global count, like the EAGLE-3 loss).

    Returns one dict per head: ``ce_sum`` (differentiable), ``top1_sum``, ``top5_sum`` (label within the
    head's top-``topk``), ``count``. Only valid rows are gathered before the float32 log-softmax.
    """
    K = len(head_logits)
    if K == 0:
        raise ValueError("need at least one head")
    B, T = input_ids.shape
    if attention_mask.shape != (B, T) or loss_mask.shape != (B, T):
        raise ValueError(f"mask shapes {tuple(attention_mask.shape)}, {tuple(loss_mask.shape)} != ids {(B, T)}")
    out = []
    for k in range(K):
        logits = head_logits[k]
        if logits.shape[:2] != (B, T):
            raise ValueError(f"head {k} logits {tuple(logits.shape)} do not match input_ids {(B, T)}")
        valid = medusa_valid_mask(attention_mask, loss_mask, k, doc_ids).to(logits.device)
        off = 2 + k
        labels = torch.zeros_like(input_ids)
        if T > off:
            labels[:, : T - off] = input_ids[:, off:]
        x = logits[valid].float()                       # [N, V]
        y = labels.to(logits.device)[valid]              # [N]
        logp = torch.log_softmax(x, dim=-1)
        ce_sum = -logp.gather(-1, y[:, None]).sum()
        with torch.no_grad():
            top = x.topk(min(int(topk), x.shape[-1]), dim=-1).indices  # [N, k]
            top1 = (top[:, 0] == y).sum().float()
            topn = (top == y[:, None]).any(-1).sum().float()
        out.append({"ce_sum": ce_sum, "top1_sum": top1, "top5_sum": topn,
                    "count": torch.tensor(float(x.shape[0]), device=x.device)})
    return out


def medusa_head_weights(num_heads: int, decay: float = 0.8, coefficient: float = 1.0) -> list[float]:
    """``coefficient * decay**k`` for heads k = 0..K-1.

    Medusa-1 (``train_legacy.py``) sums the heads unweighted: ``decay=1``. Medusa-2 (axolotl) weighs its
    *i*-th logits ``0.8**i * heads_coefficient`` where i = 0 is the base LM head, so our head k is its
    i = k+1: reproduce it exactly with ``coefficient = heads_coefficient * decay``.
    """
    return [float(coefficient) * float(decay) ** k for k in range(int(num_heads))]


def medusa_loss(
    head_logits: torch.Tensor | Sequence[torch.Tensor],
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    weights: Sequence[float],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``sum_k weights[k] * CE_k`` with ``CE_k`` the head's cross-entropy averaged over its valid tokens.

    ``head_logits``: ``[K, B, T, V]`` (or a list of K ``[B, T, V]``). Stats (detached, shape ``[K]``):
    ``ce`` (per-head mean CE), ``top1_sum``, ``top5_sum``, ``count``; accuracy = sum / count.
    """
    if len(weights) != len(head_logits):
        raise ValueError(f"{len(head_logits)} heads but {len(weights)} weights")
    per = medusa_head_stats(head_logits, input_ids, loss_mask, attention_mask)
    loss = combine_step_losses([s["ce_sum"] for s in per], [s["count"] for s in per], weights)
    stats = {
        "ce": torch.stack([s["ce_sum"].detach() / s["count"].clamp_min(1.0) for s in per]),
        "top1_sum": torch.stack([s["top1_sum"] for s in per]),
        "top5_sum": torch.stack([s["top5_sum"] for s in per]),
        "count": torch.stack([s["count"] for s in per]),
    }
    return loss, stats


# ====================================================================================== distillation (KD)
# Per-token divergences between the teacher p = softmax(teacher_logits / T) and the student
# q = softmax(student_logits / T) over the vocabulary; inputs [..., V] -> output [...] (float32).
# The teacher is always detached. No T^2 factor is applied (GKD / TRL convention).
# Log-probabilities are floored at -1e4 so -inf logits (masked vocabulary entries) stay finite:
# exp(-1e4) == 0 in float32, so such entries contribute exactly 0 where the other side has mass 0 too.

_LOGP_FLOOR = -1.0e4
KD_KINDS = ("fkl", "rkl", "jsd", "tvd")


def _log_probs(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float):
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ"
            " (the draft must share the target's vocabulary)"
        )
    t = float(temperature)
    if not t > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_q = torch.log_softmax(student_logits.float() / t, dim=-1).clamp_min(_LOGP_FLOOR)
    log_p = torch.log_softmax(teacher_logits.detach().float() / t, dim=-1).clamp_min(_LOGP_FLOOR)
    return log_p, log_q


def kd_fkl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Forward KL ``KL(p || q) = sum p (log p - log q)`` (mass-covering)."""
    log_p, log_q = _log_probs(student_logits, teacher_logits, temperature)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def kd_rkl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Reverse KL ``KL(q || p) = sum q (log q - log p)`` (mode-seeking)."""
    log_p, log_q = _log_probs(student_logits, teacher_logits, temperature)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def kd_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 0.5,
           temperature: float = 1.0) -> torch.Tensor:
    """Generalised JSD of GKD (Agarwal et al. 2024, eq. 1), as in TRL's ``generalized_jsd_loss``.

    ``JSD(beta) = beta * KL(p || m) + (1 - beta) * KL(q || m)``, ``m = beta * p + (1 - beta) * q``, p the
    teacher. For small beta it behaves like ``beta * KL(p||q)`` and near 1 like ``(1 - beta) * KL(q||p)``,
    so, following TRL, the end points are defined as those limits' directions: ``beta = 0`` returns the
    forward KL and ``beta = 1`` the reverse KL (the bare formula would be identically 0 there).
    ``beta = 0.5`` is the symmetric Jensen-Shannon divergence (bounded by log 2).
    """
    b = float(beta)
    if not 0.0 <= b <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if b == 0.0:
        return kd_fkl(student_logits, teacher_logits, temperature)
    if b == 1.0:
        return kd_rkl(student_logits, teacher_logits, temperature)
    log_p, log_q = _log_probs(student_logits, teacher_logits, temperature)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(b), log_q + math.log(1.0 - b)]), dim=0)
    kl_pm = (log_p.exp() * (log_p - log_m)).sum(-1)
    kl_qm = (log_q.exp() * (log_q - log_m)).sum(-1)
    return b * kl_pm + (1.0 - b) * kl_qm


def kd_tvd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Total variation ``0.5 * sum |p - q| = 1 - sum min(p, q)`` = 1 - the speculative acceptance
    probability of a draft token sampled from q against target p (Leviathan et al. 2023)."""
    log_p, log_q = _log_probs(student_logits, teacher_logits, temperature)
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


def _kd_one(kind: str, student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float) -> torch.Tensor:
    if kind == "fkl":
        return kd_fkl(student, teacher, temperature)
    if kind == "rkl":
        return kd_rkl(student, teacher, temperature)
    if kind == "jsd":
        return kd_jsd(student, teacher, beta, temperature)
    if kind == "tvd":
        return kd_tvd(student, teacher, temperature)
    raise ValueError(f"unknown KD divergence {kind!r}; expected one of {KD_KINDS}")


def next_token_mask(attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                    doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T]`` bool: the logits at position t (which predict x_{t+1}) are scored iff t+1 < T,
    ``attention_mask[t]`` and ``attention_mask`` / ``loss_mask`` at t+1 are 1 (and, packed, t+1 is in t's
    document)."""
    B, T = attention_mask.shape
    valid = torch.zeros(B, T, dtype=torch.bool, device=attention_mask.device)
    if T > 1:
        valid[:, :-1] = attention_mask[:, :-1].bool() & attention_mask[:, 1:].bool() & loss_mask[:, 1:].bool()
    return _and_doc(valid, doc_ids, 1)


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    kind: str | dict[str, float] = "fkl",
    beta: float = 0.5,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean over the positions where ``mask`` is true of a divergence (or a weighted mix of them).

    Args:
        student_logits, teacher_logits: ``[B, T, V]`` (same positions; use :func:`next_token_mask` for the
            usual "logits at t are scored if x_{t+1} is an assistant token" mask).
        mask: ``[B, T]`` bool.
        kind: one of ``fkl``, ``rkl``, ``jsd``, ``tvd``, or ``{kind: weight}`` (loss = sum weight * mean).
    Returns:
        ``(loss, stats)``; stats (detached): ``loss_sum`` (differentiable; the weighted per-token sum, for
        normalising by a global token count), ``count``, the mean of each divergence used (``fkl``, ...),
        ``accept_sum`` (sum over tokens of ``sum_x min(p, q)`` at temperature 1) and ``top1_sum``
        (student argmax == teacher argmax: the greedy acceptance).
    """
    mix = {kind: 1.0} if isinstance(kind, str) else {str(k): float(w) for k, w in dict(kind).items()}
    if not mix:
        raise ValueError("kind must name at least one divergence")
    for k in mix:
        if k not in KD_KINDS:
            raise ValueError(f"unknown KD divergence {k!r}; expected one of {KD_KINDS}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ"
        )
    if mask.shape != student_logits.shape[:-1]:
        raise ValueError(f"mask {tuple(mask.shape)} does not match logits {tuple(student_logits.shape)}")
    mask = mask.bool().to(student_logits.device)
    s = student_logits[mask]
    t = teacher_logits.detach().to(student_logits.device)[mask]
    count = torch.tensor(float(s.shape[0]), device=s.device)
    stats: dict[str, torch.Tensor] = {}
    loss_sum = None
    for k, w in mix.items():
        d = _kd_one(k, s, t, beta, temperature).sum()
        stats[k] = d.detach() / count.clamp_min(1.0)
        loss_sum = d * w if loss_sum is None else loss_sum + d * w
    loss = loss_sum / count.clamp_min(1.0)
    with torch.no_grad():
        p, q = torch.softmax(t.float(), -1), torch.softmax(s.detach().float(), -1)
        stats["accept_sum"] = torch.minimum(p, q).sum()
        stats["top1_sum"] = (s.detach().argmax(-1) == t.argmax(-1)).sum().float()
    stats["loss_sum"] = loss_sum
    stats["count"] = count
    return loss, stats


def ce_loss(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain next-token cross-entropy on the data (the KD baseline), averaged over the positions of
    :func:`next_token_mask`. Stats: ``loss_sum`` (differentiable), ``count``, ``top1_sum``."""
    B, T = input_ids.shape
    if logits.shape[:2] != (B, T):
        raise ValueError(f"logits {tuple(logits.shape)} do not match input_ids {(B, T)}")
    valid = next_token_mask(attention_mask, loss_mask, doc_ids).to(logits.device)
    labels = torch.zeros_like(input_ids)
    labels[:, :-1] = input_ids[:, 1:]
    x = logits[valid].float()
    y = labels.to(logits.device)[valid]
    loss_sum = -torch.log_softmax(x, -1).gather(-1, y[:, None]).sum()
    count = torch.tensor(float(x.shape[0]), device=x.device)
    with torch.no_grad():
        top1 = (x.argmax(-1) == y).sum().float()
    return loss_sum / count.clamp_min(1.0), {"loss_sum": loss_sum, "count": count, "top1_sum": top1}


# ------------------------------------------------------------------------------------------------ DFlash
# A block of size B at anchor column p: slot k (1..B-1) predicts x_{p+k}; its teacher (loss=kd) is the target's
# distribution at p+k-1. Slot 0 (the anchor) is never scored.


def dflash_slot_weights(block_size: int, gamma: float) -> list[float]:
    """DFlash's slot weights exp(-(k-1)/gamma) for k = 1..B-1 (index 0 = slot 1)."""
    return [math.exp(-(k - 1) / float(gamma)) for k in range(1, int(block_size))]


def dpace_weights(q_right: torch.Tensor, valid: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE's per-position weights (arXiv 2605.18810), detached: for the slots of each block ``[..., S]``,
    w_j = sum_{m >= j} prod_{i <= m} r_i with r_i = (1 - alpha) q_i + alpha, ``q_right`` the drafter's
    probability of the right token at slot i; an invalid slot ends the block (r = 0 from there on)."""
    r = ((1 - alpha) * q_right.detach().float() + alpha) * valid.float()
    prod = torch.cumprod(r, dim=-1)
    return torch.flip(torch.cumsum(torch.flip(prod, [-1]), -1), [-1]) * valid.float()


def dflash_slot_stats(logits: torch.Tensor, labels: torch.Tensor, slot: torch.Tensor, valid: torch.Tensor,
                      num_slots: int, slot_weights: torch.Tensor | None = None,
                      teacher_logits: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Sums per slot over the scored rows of a micro-batch.

    ``logits [N, V]`` (the drafter's, through the target's head) at the ``N`` valid slots, row-major over
    ``[B, A, S]`` blocks (``valid [B, A, S]`` bool, S = B - 1 slots: index 0 = slot 1), ``labels [N]``,
    ``slot [N]`` (0-based slot index). ``slot_weights [N]`` multiplies each row's loss (None: 1).
    ``teacher_logits [N, V]``: soft cross-entropy to softmax(teacher) instead of the hard label.
    Returns ``loss_sum`` (weighted, a 0-d tensor with grad) and per slot ``loss_sum_k``, ``acc_sum_k``,
    ``prefix_sum_k`` (the blocks whose slots 1..k are all right: the acceptance a greedy chain gets),
    ``count_k``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    if teacher_logits is None:
        per_row = -logp.gather(1, labels[:, None]).squeeze(1)
    else:
        per_row = -(torch.softmax(teacher_logits.float(), -1) * logp).sum(-1)
    w = per_row.new_ones(()) if slot_weights is None else slot_weights
    out = {"loss_sum": (per_row * w).sum()}
    with torch.no_grad():
        right_rows = logits.argmax(-1) == labels
        right = torch.zeros(valid.shape, dtype=torch.bool, device=valid.device)
        right[valid] = right_rows.to(valid.device)
        prefix = torch.cumprod(right.long(), dim=-1).bool()  # slots 1..k all right (an invalid slot breaks it)
        for k in range(num_slots):
            sel = slot == k
            out[f"loss_sum_{k}"] = per_row.detach()[sel].sum()
            out[f"acc_sum_{k}"] = right[..., k].sum().float()
            out[f"prefix_sum_{k}"] = prefix[..., k].sum().float()
            out[f"count_{k}"] = valid[..., k].sum().float()
    return out
