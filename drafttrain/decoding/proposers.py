"""Draft proposers: who guesses the next K tokens in a speculative round.

Protocol (see ``Proposer``). The engine calls, per sequence:
``reset()``; ``prefill(prompt, prompt_taps, first_token)`` after the target prefilled the prompt; then per
round ``propose(tokens, k, sampling)`` and, after verification, ``accept(tokens, a, taps)``.

``tokens`` is always the full committed sequence (prompt + generated) whose last token is *pending* (not
yet in the target's cache). A deterministic proposer returns ``q = None`` and the engine treats its drafts
as one-hot q; a stochastic one samples its drafts from its processed distribution q (same temperature /
top-k / top-p as the target) and returns q ``[len, V_target]``.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from .sampling import SamplingParams, sample
from .target import TargetRunner


@runtime_checkable
class Proposer(Protocol):
    name: str
    stochastic: bool  # True when drafts are sampled from q (propose returns probs)

    def reset(self) -> None: ...

    def prefill(self, prompt_ids: list[int], target_taps: Tensor | None, first_token: int) -> None:
        """After the target prefilled the prompt: ``target_taps [len(prompt), D]`` at the prompt positions,
        ``first_token`` = the token the target produced after the prompt (the pending token)."""

    def propose(self, tokens: list[int], k: int, sampling: SamplingParams) -> tuple[list[int], Tensor | None]:
        """Up to ``k`` draft tokens (possibly fewer, even none) and, if stochastic, q ``[len, V]``."""

    def accept(self, tokens: list[int], num_accepted: int, target_taps: Tensor | None) -> None:
        """After verification: ``tokens`` = committed tokens (the new pending token last); ``target_taps``
        = target features at the verified positions that were kept: ``[pending_old, d_1..d_a]``."""


class _DeterministicBase:
    stochastic = False

    def reset(self) -> None:
        pass

    def prefill(self, prompt_ids, target_taps, first_token) -> None:
        pass

    def accept(self, tokens, num_accepted, target_taps) -> None:
        pass


class NoDraft(_DeterministicBase):
    """Autoregressive decoding: never drafts (use with K = 0)."""

    name = "none"

    def propose(self, tokens, k, sampling):
        return [], None


class OracleProposer(_DeterministicBase):
    """Drafts read from a precomputed output (e.g. the AR greedy output): always right under greedy.

    ``reference_tokens`` are the *new* tokens of that output for the prompt being decoded; the draft for
    output index j (0 = the first generated token) is ``reference_tokens[j]``. Drafts stop at the end of
    the reference. Call ``set_reference`` before decoding another prompt.
    """

    name = "oracle"

    def __init__(self, reference_tokens: Sequence[int]):
        self.set_reference(reference_tokens)
        self._prompt_len = 0

    def set_reference(self, reference_tokens: Sequence[int]) -> None:
        self.reference = [int(t) for t in reference_tokens]

    def prefill(self, prompt_ids, target_taps, first_token) -> None:
        self._prompt_len = len(prompt_ids)

    def propose(self, tokens, k, sampling):
        j = len(tokens) - self._prompt_len  # output index of the first draft
        return self.reference[j : j + k], None


class StubProposer(OracleProposer):
    """Test proposer: at output index j it proposes ``reference_tokens[j]`` when ``agree_fn(j)`` is True,
    otherwise ``(reference_tokens[j] + 1) % vocab_size``, a token guaranteed to differ from the reference.

    Under greedy decoding with the AR output as reference, the acceptance pattern is thus exactly
    ``agree_fn`` over output indices.
    """

    name = "stub"

    def __init__(self, reference_tokens: Sequence[int], agree_fn: Callable[[int], bool], vocab_size: int):
        super().__init__(reference_tokens)
        self.agree_fn = agree_fn
        self.vocab_size = int(vocab_size)

    def propose(self, tokens, k, sampling):
        j0 = len(tokens) - self._prompt_len
        ref = self.reference[j0 : j0 + k]
        return [t if self.agree_fn(j0 + i) else (t + 1) % self.vocab_size for i, t in enumerate(ref)], None


class PromptLookupProposer(_DeterministicBase):
    """Prompt lookup decoding (n-gram copy from the context).

    Finds the last ``n`` committed tokens (n from ``max_ngram`` down to ``min_ngram``, longest first)
    earlier in the committed tokens and proposes the up to ``min(k, num_tokens)`` tokens that followed.
    Among several matches the *most recent* one wins (HF's ``PromptLookupCandidateGenerator`` takes the
    first from the left); recent context tends to predict the continuation better. No match -> no draft.
    """

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_tokens: int = 10):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.num_tokens = max_ngram, min_ngram, num_tokens

    def propose(self, tokens, k, sampling):
        k = min(k, self.num_tokens)
        L = len(tokens)
        if k <= 0 or L < 2:
            return [], None
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            # windows starting at 0..L-n-1: every earlier occurrence, excluding the suffix itself
            windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)
            hits = np.nonzero((windows == arr[L - n :]).all(axis=1))[0]
            if hits.size:
                start = int(hits[-1]) + n  # most recent match; it is followed by >= 1 token
                return arr[start : start + k].tolist(), None
        return [], None


class DraftModelProposer:
    """Vanilla speculative decoding with a separate small causal LM sharing the target's tokenizer.

    The draft keeps its own KV cache (a ``TargetRunner`` without taps) holding a prefix of the committed
    tokens plus its own drafts; each round it catches up on the committed tokens it has not seen, then
    drafts one token per forward. After verification the cache is rolled back to the longest prefix that
    agrees with the committed tokens.

    Args:
        draft_model: HF causal LM.
        vocab_size: the target's logits width if it differs from the draft's (draft logits are padded
            with -inf or truncated to it before processing, so q lives in the target vocabulary).
        max_len: draft cache capacity (default: the draft's ``max_position_embeddings``).
    """

    name = "draft_model"
    stochastic = True

    def __init__(self, draft_model, vocab_size: int | None = None, max_len: int | None = None):
        self.runner = TargetRunner(draft_model, taps=None, max_len=max_len)
        self.vocab_size = int(vocab_size) if vocab_size is not None else self.runner.vocab_size
        self.reset()

    def reset(self) -> None:
        self.runner.reset()
        self._cached: list[int] = []  # tokens whose entries are in the draft cache, in order
        self._committed = 0  # leading entries of _cached known to be committed tokens (never change)

    def prefill(self, prompt_ids, target_taps, first_token) -> None:
        pass  # the prompt is fed lazily by the first propose (together with the pending token)

    def _to_target_vocab(self, logits: Tensor) -> Tensor:
        Vd = logits.shape[-1]
        if Vd > self.vocab_size:
            return logits[..., : self.vocab_size]
        if Vd < self.vocab_size:
            pad = logits.new_full((*logits.shape[:-1], self.vocab_size - Vd), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    def _rollback(self, tokens: list[int]) -> None:
        """Truncate the draft cache to its longest prefix agreeing with ``tokens`` (minus the last)."""
        n = min(len(self._cached), len(tokens) - 1)
        i = min(self._committed, n)
        while i < n and self._cached[i] == tokens[i]:
            i += 1
        self._committed = i
        if i < len(self._cached):
            self.runner.truncate(i)
            del self._cached[i:]

    def propose(self, tokens, k, sampling):
        if k <= 0:
            return [], None
        k = min(k, self.runner.max_len - len(tokens) + 1)  # the last draft is never fed
        if k <= 0:
            return [], None
        self._rollback(tokens)
        feed = tokens[len(self._cached) :]  # includes the pending token
        logits, _ = self.runner.forward(feed, last_only=True)
        self._cached.extend(feed)
        logits = logits[-1]
        drafts, qs = [], []
        for i in range(k):
            z = self._to_target_vocab(logits)
            if sampling.greedy:
                d = z.argmax(-1)
            else:
                q = sampling.process(z)
                d = sample(q, sampling.generator)
                qs.append(q)
            drafts.append(d)
            if i + 1 < k:
                logits, _ = self.runner.forward(d.reshape(1, 1))
                logits = logits[-1]
        draft_list = torch.stack(drafts).tolist()  # one host sync per proposal
        self._cached.extend(draft_list[:-1])
        return draft_list, (torch.stack(qs) if qs else None)

    def accept(self, tokens, num_accepted, target_taps) -> None:
        self._rollback(tokens)


class Eagle3ChainProposer:
    """Chain drafting with an EAGLE-3 drafter (``drafttrain.drafters.eagle3``).

    Drafter cache entry j is built from (fused target feature h_j, token x_{j+1}) at rotary position j.
    Entries built from target features cover the target's cache (positions < n, n = target cache length);
    the drafts of a round append entries n, n+1, ... built from (d_i, the drafter's own previous output
    hidden). After verification (a accepted, bonus b), the cache is truncated back to n and positions
    n..n+a are rebuilt from the target taps just verified with tokens [d_1..d_a, b]; the output at the last
    of them gives the next round's first draft.

    Args:
        drafter: object with ``new_cache``, ``fuse``, ``step`` and ``logits_to_target`` (see the module
            ``drafttrain.drafters.eagle3``).
        max_len: capacity of the drafter's cache (target max length + K is enough).
    """

    name = "eagle3"
    stochastic = True

    def __init__(self, drafter, max_len: int = 4096):
        self.drafter = drafter
        self.max_len = int(max_len)
        p = next(drafter.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.reset()

    def reset(self) -> None:
        self.cache = None
        self._n = 0  # drafter cache entries built from target features (= target cache length)
        self._next_logits: Tensor | None = None  # [Vd] logits for the next round's first draft
        self._next_hidden: Tensor | None = None  # [1, 1, H] drafter output hidden at position n-1

    @torch.no_grad()
    def _extend(self, ids: list[int], taps: Tensor, start: int) -> None:
        """Write entries ``start..start+len(ids)-1`` from target taps ``[len, D]`` and tokens ``ids``."""
        hidden = self.drafter.fuse(taps.to(self.device, self.dtype).unsqueeze(0))  # [1, n, H]
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, n]
        pos = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)
        logits, out_hidden = self.drafter.step(input_ids, hidden, self.cache, position_ids=pos)
        self._next_logits = logits[0, -1]
        self._next_hidden = out_hidden[:, -1:]
        self._n = start + len(ids)

    def prefill(self, prompt_ids, target_taps, first_token) -> None:
        if target_taps is None:
            raise ValueError("Eagle3ChainProposer needs target taps: build the TargetRunner with taps=")
        self.cache = self.drafter.new_cache(1, self.max_len, device=self.device, dtype=self.dtype)
        # entry j = (h_j, x_{j+1}) for j = 0..n-1, the last token being the pending first_token
        self._extend(list(prompt_ids[1:]) + [int(first_token)], target_taps, start=0)

    @torch.no_grad()
    def propose(self, tokens, k, sampling):
        k = min(k, self.max_len - self._n)  # the round may leave up to n + k entries after accept
        if k <= 0:
            return [], None
        logits, hidden = self._next_logits, self._next_hidden
        drafts, qs = [], []
        for i in range(k):
            z = self.drafter.logits_to_target(logits.float())  # [V], -inf outside the draft vocab
            if sampling.greedy:
                d = z.argmax(-1)
            else:
                q = sampling.process(z)
                d = sample(q, sampling.generator)
                qs.append(q)
            drafts.append(d)
            if i + 1 < k:
                pos = torch.tensor([[self._n + i]], device=self.device)
                out, hidden = self.drafter.step(d.reshape(1, 1), hidden, self.cache, position_ids=pos)
                logits = out[0, -1]
        return torch.stack(drafts).tolist(), (torch.stack(qs) if qs else None)  # one host sync

    @torch.no_grad()
    def accept(self, tokens, num_accepted, target_taps) -> None:
        a = int(num_accepted)
        if target_taps is None or target_taps.shape[0] != a + 1:
            raise ValueError("Eagle3ChainProposer.accept needs the target taps at [pending, d_1..d_a]")
        if self._n + a + 2 != len(tokens):
            raise RuntimeError(f"drafter out of step: {self._n} target entries, {len(tokens)} committed tokens")
        self.cache.truncate(self._n)  # drop the draft-only entries
        self._extend(list(tokens[-(a + 1) :]), target_taps, start=self._n)
