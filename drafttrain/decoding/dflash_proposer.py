"""Chain drafting with a DFlash drafter (drafttrain/drafters/dflash.py): one drafter forward per round.

The drafter's cache holds the context features of every committed position whose target hidden states are
known (the target's cache: positions 0..n-1); the pending token (position n) is the block's anchor. A round runs
the block [anchor, mask × K] once (K = ``decode.num_draft_tokens`` ≤ B-1: the block holds 1 + K tokens, as vLLM
and SGLang run it; the drafter was trained on blocks of B, so K = B-1 is the trained shape) and proposes its
slots (fewer near the end of an answer: the block keeps its K + 1 tokens); after verification the context grows
by the verified positions [pending, d_1..d_a] and nothing of the block is kept.

Sampling: slot i's own distribution (processed with the target's temperature / top-k / top-p) is the proposal
of draft i; it does not depend on the earlier drafts, which verification allows (the chain rule only needs q to
be the distribution the draft was drawn from), so decoding stays lossless. Greedy: each slot's argmax, on the
device, in one call. Grammar-aware: slot i is masked by the grammar after d_1..d_{i-1}.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .proposers import _draft_token, _grammar_scope


@torch.no_grad()
def _draft_static(drafter, ks, vs, length, anchor, num_slots: int):
    """The block's forward over the whole preallocated cache (slots past ``length`` masked): one shape for
    every round, what ``compile`` / CUDA graphs run. Logits of every slot ``[1, num_slots, V]``."""
    return drafter.draft_blocks(ks, vs, length, anchor, num_slots)


@torch.no_grad()
def _context_static(drafter, ks, vs, taps, start):
    """Context entries of ``taps [1, m, D]`` at positions ``start ..`` written into the caches: ``m`` is a power
    of two (padded rows land past the committed length, masked until the next write replaces them)."""
    m = taps.shape[1]
    pos = start + torch.arange(m, device=taps.device)
    for li, (k, v) in enumerate(drafter.context_kv(taps, pos[None])):
        ks[li].index_copy_(2, pos, k.to(ks[li].dtype))
        vs[li].index_copy_(2, pos, v.to(vs[li].dtype))


class DFlashProposer:
    name = "dflash"
    stochastic = True
    grammar_aware = True
    one_forward_per_round = True  # drafttrain tune: the draft cost is per round, not per draft token

    def __init__(self, drafter, max_len: int = 4096, num_draft_tokens: int | None = None, static_shapes: bool = False,
                 compile: bool = False):
        self.drafter = drafter
        self.max_len = int(max_len)
        p = next(drafter.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.block_size = int(drafter.config.block_size)
        # the block's drafted slots (1 + slots tokens per forward), whatever a round asks for (at most that)
        self.slots = min(int(num_draft_tokens or self.block_size - 1), self.block_size - 1)
        self.static_shapes = bool(static_shapes)
        self._draft, self._context = _draft_static, _context_static
        if compile and self.static_shapes:
            from .target import compile_static

            self._draft = compile_static(_draft_static, self.device)
            self._context = compile_static(_context_static, self.device)
        self.cache = None
        self._buffer = None

    def reset(self) -> None:
        self.cache = None

    def prefill(self, prompt_ids, target_taps: Tensor | None, first_token: int) -> None:
        if target_taps is None:
            raise ValueError("DFlashProposer needs target taps: build the TargetRunner with taps=")
        slack = self.block_size if self.static_shapes else 0  # a padded context write may run past max_len
        if self._buffer is None or self._buffer.max_len < self.max_len + slack:
            self._buffer = self.drafter.new_cache(self.max_len + slack, device=self.device, dtype=self.dtype)
            if self.static_shapes:
                for t in (*self._buffer.k, *self._buffer.v):  # updated in place inside CUDA graphs
                    torch._dynamo.mark_static_address(t)
        self.cache = self._buffer
        self.cache.truncate(0)
        self.drafter.append_context(self.cache, target_taps.to(self.device, self.dtype), start=0)  # eager: any length

    @torch.no_grad()
    def propose(self, tokens, k, sampling, grammar=None):
        k = min(int(k), self.slots, self.max_len - self.cache.length - 1)
        if k <= 0:
            return [], None
        if len(tokens) != self.cache.length + 1:
            raise RuntimeError(f"DFlash drafter out of step: {self.cache.length} context positions, "
                               f"{len(tokens)} committed tokens")
        if self.static_shapes:
            c = self.cache
            L = torch.tensor([c.length], device=self.device)
            anchor = torch.tensor([int(tokens[-1])], device=self.device)
            logits = self._draft(self.drafter, c.k, c.v, L, anchor, self.slots)[0, :k]
        else:
            logits = self.drafter.draft_block(self.cache, int(tokens[-1]), num_slots=self.slots)[:k]  # [k, V]
        if sampling.greedy and grammar is None:
            return logits.argmax(-1), None
        drafts, qs = [], []
        with _grammar_scope(grammar):
            for i in range(k):
                if not _draft_token(logits[i], sampling, grammar, drafts, qs):
                    break
        if not drafts:
            return [], None
        return torch.stack(drafts), (torch.stack(qs) if qs else None)

    @torch.no_grad()
    def accept(self, tokens, num_accepted, target_taps) -> None:
        a = int(num_accepted)
        if target_taps is None or target_taps.shape[0] != a + 1:
            raise ValueError("DFlashProposer.accept needs the target taps at [pending, d_1..d_a]")
        taps = target_taps.to(self.device, self.dtype)
        if self.static_shapes:  # padded to a power of two: one compiled shape per size
            n, c = taps.shape[0], self.cache
            pad = (1 << (n - 1).bit_length()) - n
            if c.length + n + pad > c.max_len:
                raise ValueError(f"DFlash cache overflow: {c.length} + {n + pad} > {c.max_len}")
            t = torch.cat([taps, taps.new_zeros(pad, taps.shape[-1])]) if pad else taps
            self._context(self.drafter, c.k, c.v, t[None], torch.tensor(c.length, device=self.device))
            c.length += n
        else:
            self.drafter.append_context(self.cache, taps, start=self.cache.length)
        if self.cache.length + 1 != len(tokens):
            raise RuntimeError(f"DFlash drafter out of step: {self.cache.length} context positions, "
                               f"{len(tokens)} committed tokens")

    def batched(self, max_len: int, K: int):
        """The batched decoder's state for this proposer (decoding/batched.py, ``decode.batch_size > 1``)."""
        return BatchDFlash(self, capacity=max_len + K + 8)


class BatchDFlash:
    """DFlash over B rows (decode.batch_size > 1, continuous batching): one drafter forward per round drafts every
    row's block. Row b's context entries (positions 0..n_b - 1) sit in slots 0..n_b - 1 of a ``[rows, kv,
    capacity, D]`` buffer per layer; a row sees its own first n_b slots only (``draft_blocks``' per-row lengths).
    A context entry depends on its own position alone, so rows are written independently, padding included."""

    def __init__(self, proposer: DFlashProposer, capacity: int):
        self.drafter, self.device, self.dtype = proposer.drafter, proposer.device, proposer.dtype
        self.slots = proposer.slots
        self.capacity = int(capacity)
        self.rows: int | None = None  # the decoder's physical rows (static shapes); default: the first batch
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.n = torch.zeros(0, dtype=torch.long)

    def _buffers(self, rows: int) -> None:
        c = self.drafter.config
        shape = (rows, c.num_key_value_heads, self.capacity, c.head_dim)
        self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(c.num_layers)]
        self.v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(c.num_layers)]

    def _write(self, rows: Tensor, taps: Tensor, start: Tensor, real: Tensor) -> None:
        """Entries of ``rows`` at positions ``start[b] + j`` from ``taps [N, m, D]`` (``real [N, m]``: the rest is
        padding, never written)."""
        m = taps.shape[1]
        pos = start[:, None] + torch.arange(m, device=self.device)
        if int((pos * real).max()) >= self.capacity:
            raise ValueError(f"DFlash draft cache overflow: {int(pos.max()) + 1} > {self.capacity}")
        kv = self.drafter.context_kv(taps.to(self.device, self.dtype), pos)
        r, j = torch.nonzero(real, as_tuple=True)
        for li, (k, v) in enumerate(kv):
            self.k[li][rows[r], :, pos[r, j]] = k[r, :, j].to(self.dtype)
            self.v[li][rows[r], :, pos[r, j]] = v[r, :, j].to(self.dtype)

    def _context(self, prompts, taps) -> tuple[Tensor, Tensor]:
        if taps is None:
            raise ValueError("DFlashProposer needs target taps: build the TargetRunner with taps=")
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device)
        m = int(lens.max())
        return taps[:, :m], torch.arange(m, device=self.device)[None] < lens[:, None]

    def prefill(self, prompts, taps, firsts) -> None:
        self._buffers(max(int(self.rows or 0), len(prompts)))
        t, real = self._context(prompts, taps)
        rows = torch.arange(len(prompts), device=self.device)
        self._write(rows, t, torch.zeros(len(prompts), dtype=torch.long, device=self.device), real)
        self.n = real.sum(1)

    def admit(self, prompts, taps, firsts) -> None:
        B0, N = self.n.shape[0], len(prompts)
        if B0 + N > self.k[0].shape[0]:
            raise ValueError(f"{B0} + {N} rows, the draft cache has {self.k[0].shape[0]}")
        t, real = self._context(prompts, taps)
        self._write(torch.arange(B0, B0 + N, device=self.device), t,
                    torch.zeros(N, dtype=torch.long, device=self.device), real)
        self.n = torch.cat([self.n, real.sum(1)])

    @torch.no_grad()
    def propose(self, tokens, ks, sampling):
        from .batched import _draft_tokens, _split

        k = min(max(ks), self.slots)
        if k <= 0:
            return [[] for _ in tokens], [None for _ in tokens]
        B = len(tokens)
        C = int(self.n.max())
        anchors = torch.tensor([t[-1] for t in tokens], dtype=torch.long, device=self.device)
        logits = self.drafter.draft_blocks([x[:B, :, :C] for x in self.k], [x[:B, :, :C] for x in self.v],
                                           self.n, anchors, num_slots=self.slots)[:, :k]  # [B, k, V]
        drafts, qs = [], []
        for i in range(k):
            drafts.append(_draft_tokens(logits[:, i], sampling, qs))
        return _split(drafts, qs, [min(kb, k) for kb in ks])

    @torch.no_grad()
    def accept(self, tokens, accepted, taps) -> None:
        if taps is None:
            raise ValueError("DFlashProposer.accept needs the target taps at [pending, d_1..d_a]")
        a = torch.tensor(accepted, dtype=torch.long, device=self.device)
        m = int(a.max()) + 1
        real = torch.arange(m, device=self.device)[None] <= a[:, None]
        self._write(torch.arange(len(tokens), device=self.device), taps[:, :m], self.n, real)
        self.n = self.n + a + 1

    def select_rows(self, rows) -> None:
        from .batched import _moves

        keep = [int(r) for r in rows]
        dst, src = _moves(keep)
        if dst:
            for t in (*self.k, *self.v):
                t[dst] = t[src]
        self.n = self.n[torch.tensor(keep, dtype=torch.long, device=self.n.device)]
