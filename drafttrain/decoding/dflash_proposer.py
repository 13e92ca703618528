"""Chain drafting with a DFlash drafter (drafttrain/drafters/dflash.py): one drafter forward per round.

The drafter's cache holds the context features of every committed position whose target hidden states are
known (the target's cache: positions 0..n-1); the pending token (position n) is the block's anchor. A round runs
the block [anchor, mask × (B-1)] once and proposes slots 1..k (k ≤ B-1, ``decode.num_draft_tokens``); after
verification the context grows by the verified positions [pending, d_1..d_a] and nothing of the block is kept.

Sampling: slot i's own distribution (processed with the target's temperature / top-k / top-p) is the proposal
of draft i; it does not depend on the earlier drafts, which verification allows (the chain rule only needs q to
be the distribution the draft was drawn from), so decoding stays lossless. Greedy: each slot's argmax, on the
device, in one call. Grammar-aware: slot i is masked by the grammar after d_1..d_{i-1}.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .proposers import _draft_token, _grammar_scope


class DFlashProposer:
    name = "dflash"
    stochastic = True
    grammar_aware = True

    def __init__(self, drafter, max_len: int = 4096):
        self.drafter = drafter
        self.max_len = int(max_len)
        p = next(drafter.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.block_size = int(drafter.config.block_size)
        self.cache = None
        self._buffer = None

    def reset(self) -> None:
        self.cache = None

    def prefill(self, prompt_ids, target_taps: Tensor | None, first_token: int) -> None:
        if target_taps is None:
            raise ValueError("DFlashProposer needs target taps: build the TargetRunner with taps=")
        if self._buffer is None or self._buffer.max_len < self.max_len:
            self._buffer = self.drafter.new_cache(self.max_len, device=self.device, dtype=self.dtype)
        self.cache = self._buffer
        self.cache.truncate(0)
        self.drafter.append_context(self.cache, target_taps.to(self.device, self.dtype), start=0)

    @torch.no_grad()
    def propose(self, tokens, k, sampling, grammar=None):
        k = min(int(k), self.block_size - 1, self.max_len - self.cache.length - 1)
        if k <= 0:
            return [], None
        if len(tokens) != self.cache.length + 1:
            raise RuntimeError(f"DFlash drafter out of step: {self.cache.length} context positions, "
                               f"{len(tokens)} committed tokens")
        logits = self.drafter.draft_block(self.cache, int(tokens[-1]), num_slots=k)  # [k, V]
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
        self.drafter.append_context(self.cache, target_taps.to(self.device, self.dtype), start=self.cache.length)
        if self.cache.length + 1 != len(tokens):
            raise RuntimeError(f"DFlash drafter out of step: {self.cache.length} context positions, "
                               f"{len(tokens)} committed tokens")
