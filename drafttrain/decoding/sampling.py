"""Logits processing and the verification rules of speculative decoding (pure tensor functions).

The *processed* distribution (temperature, then top-k, then top-p, renormalised; one-hot argmax at
temperature 0) is the distribution speculative decoding must preserve exactly. Every rule here takes
and returns plain tensors plus an explicit ``torch.Generator``, so a run is reproducible from a seed.

Rules:
- ``verify_chain_greedy``: longest draft prefix equal to the target argmax, then the target argmax.
- ``verify_chain_sampling``: Leviathan et al. (2023) rejection sampling for one chain of drafts with
  known draft distributions q (a deterministic draft is the q = one-hot case).
- ``recursive_reject``: one level of EAGLE's multi-candidate recursive rejection for deterministic
  (q = 1) sibling candidates, one candidate at a time: the one-level reference of the tree rule
  ``verify_tree_sampling`` (decoding/tree.py), which applies the same rejection at every node of a draft
  tree, vectorised with one host sync per round, and is what the decoder calls.

Host syncs: the chain rules compute everything on the device and return Python ints through a single
``.tolist()``, the one sync per verification round (or, with ``device_result=True``, 0-d device tensors
that the decoder reads in its own single sync together with the drafts).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    """How tokens are chosen: temperature 0 means greedy; ``top_k=0`` and ``top_p=1`` disable those filters.

    ``generator`` is the source of all randomness of a decoder (drafts and verification draw from it in
    sequence); it must live on the device of the probabilities it samples.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def process(self, logits: Tensor) -> Tensor:
        return process_logits(logits, self.temperature, self.top_k, self.top_p)


def process_logits(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Logits ``[..., V]`` -> processed probabilities ``[..., V]`` (float32).

    temperature <= 0: one-hot of the argmax (the first maximal index on ties). Otherwise
    softmax(logits / T); top-k keeps the k largest logits (ties with the k-th value are kept, as in HF);
    top-p then keeps the smallest set of most probable tokens whose mass reaches ``top_p`` (always at
    least one token), computed on the top-k-renormalised distribution; the result is renormalised.
    Entries of ``-inf`` (e.g. outside a draft vocabulary) get probability 0.
    """
    logits = logits.float()
    V = logits.shape[-1]
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), V).to(torch.float32)
    logits = logits / temperature
    if 0 < top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False  # always keep the most probable token
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one token per row of ``probs [..., V]`` -> LongTensor ``[...]`` (no host sync).

    Exponential race: argmax_x p(x) / E_x with E_x ~ Exp(1) i.i.d. is an exact draw from p (the minimum
    of E_x / p(x) is attained at x with probability p(x)); zero-probability tokens are never chosen.
    """
    e = torch.empty_like(probs, dtype=torch.float32).exponential_(1.0, generator=generator)
    # an exact 0 draw (possible on CPU, ~2^-24 per entry) would make 0/0 = NaN win the argmax on a
    # zero-probability token; the clamp keeps p = 0 entries at 0
    e = e.clamp_min_(torch.finfo(torch.float32).tiny)
    return torch.argmax(probs.float() / e, dim=-1)


def _as_tokens(tokens, device) -> Tensor:
    if isinstance(tokens, Tensor):
        return tokens.to(device=device, dtype=torch.long).reshape(-1)
    return torch.tensor(list(tokens), dtype=torch.long, device=device)


def _accepted_prefix(accept: Tensor) -> Tensor:
    """Bool ``[K]`` -> number of leading True values (0-d LongTensor)."""
    return torch.cumprod(accept.long(), dim=0).sum() if accept.numel() else accept.new_zeros((), dtype=torch.long)


def verify_chain_greedy(draft_tokens, target_logits: Tensor, device_result: bool = False) -> tuple[int, int]:
    """Greedy chain verification.

    Args:
        draft_tokens: ``[K]`` drafts d_1..d_K (tensor or list of ints).
        target_logits: ``[K+1, V]`` target logits; row i predicts the token after d_i (row 0: after the
            pending token).
    Returns:
        ``(a, next_token)``: a = length of the longest prefix of drafts equal to the target argmax, and
        next_token = the target argmax after d_a (correction on a mismatch, bonus if a = K). With
        ``device_result`` both stay 0-d device tensors (no host sync; the caller reads them together with
        whatever else it needs).
    """
    argmax = target_logits.argmax(-1)  # [K+1]
    K = argmax.shape[0] - 1
    d = _as_tokens(draft_tokens, argmax.device)
    a = _accepted_prefix(d == argmax[:K])
    if not device_result:
        a_val, tok = torch.stack([a, argmax[a]]).tolist()  # the round's one host sync
        return a_val, tok
    return a, argmax[a]


def verify_chain_sampling(
    draft_tokens, draft_probs: Tensor, target_probs: Tensor, generator: torch.Generator | None = None,
    device_result: bool = False,
) -> tuple[int, int]:
    """Speculative (rejection) sampling for one chain; the emitted tokens are distributed exactly as p.

    Args:
        draft_tokens: ``[K]`` drafts; d_i was drawn from ``draft_probs[i-1]``.
        draft_probs: q ``[K, V]``, the processed distributions the drafts were sampled from (one-hot
            rows for deterministic drafts).
        target_probs: p ``[K+1, V]``, the target's processed distributions at the pending token and at
            each draft.
        generator: randomness source (on the device of the probabilities).
    Returns:
        ``(a, next_token)``: d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)) until the first
        rejection; the next token is drawn from normalise(max(p_a - q_a, 0)) after a rejection at a+1, or
        from p_{K+1} (bonus) when all K drafts were accepted.
    """
    p = target_probs.float()
    q = draft_probs.float().to(p.device)
    K = p.shape[0] - 1
    d = _as_tokens(draft_tokens, p.device)
    if K > 0:
        rows = torch.arange(K, device=p.device)
        p_d, q_d = p[rows, d], q[rows, d]
        u = torch.rand(K, generator=generator, device=p.device)
        accept = u * q_d < p_d  # P(accept) = min(1, p/q) for u ~ U[0, 1)
        a = _accepted_prefix(accept)
        # candidate distributions for the next token: the residual after a rejection at position i
        # (rows 0..K-1), or the bonus distribution (row K)
        dists = torch.cat([(p[:K] - q).clamp_min(0.0), p[K:]], dim=0)
    else:
        a = torch.zeros((), dtype=torch.long, device=p.device)
        dists = p
    dist = dists[a]
    mass = dist.sum()
    # a rejection has probability 0 when p_a == q_a, so the residual is never empty in exact arithmetic;
    # fall back to p_a against rounding
    dist = torch.where(mass > 0, dist / mass.clamp_min(1e-30), p[a])
    tok = sample(dist, generator)
    if not device_result:
        a_val, tok_val = torch.stack([a, tok]).tolist()  # the round's one host sync
        return a_val, tok_val
    return a, tok


def recursive_reject(candidates, p: Tensor, generator: torch.Generator | None = None) -> tuple[int, int]:
    """One tree level of EAGLE's multi-candidate recursive rejection (deterministic candidates, q = 1).

    Tries the candidates in order: candidate x is accepted with probability p(x) under the current
    (renormalised) p; on rejection p(x) is set to 0 and p renormalised. If every candidate is rejected,
    the token is drawn from what is left of p. The returned token is distributed exactly as the input p.

    Args:
        candidates: ``[m]`` sibling tokens (duplicates are harmless: a rejected token has p = 0).
        p: ``[V]`` target processed distribution at the parent.
    Returns:
        ``(index, token)``: the index of the accepted candidate and its token, or ``(-1, token)`` with
        the token drawn from the residual.
    """
    p = p.float().clone()
    cands = _as_tokens(candidates, p.device).tolist()
    u = torch.rand(max(len(cands), 1), generator=generator, device=p.device).tolist()
    for i, x in enumerate(cands):
        mass = float(p.sum())
        if mass <= 0:
            break
        px = float(p[x]) / mass
        if u[i] < px:
            return i, x
        p[x] = 0.0
    # unreachable with an empty residual: once a candidate holds all the remaining mass, p(x)/mass == 1.0
    # exactly and u < 1 accepts it
    return -1, int(sample(p / p.sum(), generator))
