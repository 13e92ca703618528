"""Draft proposers: who guesses the next K tokens in a speculative round.

Protocol (see ``Proposer``). The engine calls, per sequence:
``reset()``; ``prefill(prompt, prompt_taps, first_token)`` after the target prefilled the prompt; then per
round ``propose(tokens, k, sampling)`` and, after verification, ``accept(tokens, a, taps)``.

``tokens`` is always the full committed sequence (prompt + generated) whose last token is *pending* (not
yet in the target's cache). A deterministic proposer returns ``q = None`` and the engine treats its drafts
as one-hot q; a stochastic one samples its drafts from its processed distribution q (same temperature /
top-k / top-p as the target) and returns q ``[len, V_target]``.

Tree proposers (``tree = True``) implement ``propose_tree(tokens, max_depth, max_nodes, sampling) ->
DraftTree`` instead of ``propose``; their drafts are deterministic (top-k), which the tree verifier's
recursive rejection needs to be lossless. ``accept`` is the same for both: after a tree round the taps are
those of the root and the accepted path, in order, exactly as for a chain.

Grammar-aware proposers (``grammar_aware = True``) take ``grammar=`` (a ``drafttrain.structured.GrammarState``
that has accepted every committed output token, the pending one included) in ``propose`` /
``propose_tree``: each draft distribution is masked by the grammar state after the draft's own path (before
temperature / top-k / top-p, so q is the constrained draft distribution), drafting stops where nothing is
allowed or after a stop token, and the state is explored under ``grammar.scratch()``, so it is left as it was.
The decoder truncates (chains) or prunes (trees) the drafts of any other proposer at ungrammatical tokens.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from .sampling import SamplingParams, sample
from .target import DEFAULT_BUCKETS, TargetRunner
from .tree import DEFAULT_MEDUSA_CHOICES, DraftTree, medusa_tree


@runtime_checkable
class Proposer(Protocol):
    name: str
    stochastic: bool  # True when drafts are sampled from q (propose returns probs)

    def reset(self) -> None: ...

    def prefill(self, prompt_ids: list[int], target_taps: Tensor | None, first_token: int) -> None:
        """After the target prefilled the prompt: ``target_taps [len(prompt), D]`` at the prompt positions,
        ``first_token`` = the token the target produced after the prompt (the pending token)."""

    def propose(self, tokens: list[int], k: int, sampling: SamplingParams) -> tuple[list[int] | Tensor, Tensor | None]:
        """Up to ``k`` draft tokens (possibly fewer, even none; a list or a 1-D LongTensor that may stay on the
        device) and, if stochastic, q ``[len, V]``."""

    def accept(self, tokens: list[int], num_accepted: int, target_taps: Tensor | None) -> None:
        """After verification: ``tokens`` = committed tokens (the new pending token last); ``target_taps``
        = target features at the verified positions that were kept: ``[pending_old, d_1..d_a]``."""


def _grammar_scope(grammar):
    """Explore the grammar (rolled back on exit), or nothing without one."""
    return grammar.scratch() if grammar is not None else contextlib.nullcontext()


def _allowed_after(grammar, path: list[int] | None) -> Tensor:
    """bool ``[V]`` (CPU): the tokens the grammar allows after ``path`` from its current state (state unchanged);
    all False for ``path=None`` (an ungrammatical node) or a path the grammar refuses."""
    with grammar.scratch():
        if path is None or not grammar.advance(path):
            return torch.zeros(grammar.vocab_size, dtype=torch.bool)
        return grammar.allowed_mask()


def _grammar_logits(z: Tensor, grammar) -> Tensor | None:
    """Draft logits ``z [V]`` masked by the grammar's current state; None when no token is left (drafting
    stops). One host sync."""
    z = z.masked_fill(~grammar.allowed_mask().to(z.device), float("-inf"))
    return z if bool(torch.isfinite(z).any()) else None


def _grammar_step(grammar, d) -> bool:
    """Advance the grammar over draft ``d``; False when drafting must stop (``d`` was a stop token)."""
    if not grammar.advance([int(d)]):  # pragma: no cover - d came from the masked distribution
        raise RuntimeError(f"the grammar refused draft token {int(d)} picked from its own mask")
    return not grammar.is_terminated()


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
    Among several matches the *most recent one followed by at least that many tokens* wins (recent context
    tends to predict the continuation better); if none is, the leftmost one (the longest continuation, what
    HF's ``PromptLookupCandidateGenerator`` always takes). In a repetition loop the most recent match alone
    would be followed by only one period of the loop. No match -> no draft.
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
                full = hits[hits + n + k <= L]  # matches followed by >= k tokens
                start = int(full[-1] if full.size else hits[0]) + n  # (every match is followed by >= 1 token)
                return arr[start : start + k].tolist(), None
        return [], None


class PromptLookupTreeProposer(PromptLookupProposer):
    """Prompt lookup with a tree: the continuations of up to ``max_branches`` earlier matches, merged into a
    trie (shared prefixes once), verified in one target forward. The first branch is exactly the chain
    proposer's draft; the others are the remaining matches of the longest matching n-gram, most recent first,
    then those of shorter n-grams. Drafts are a deterministic function of the context (lossless under
    sampling through the tree verifier)."""

    name = "prompt_lookup_tree"
    tree = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_tokens: int = 10, max_branches: int = 4,
                 max_nodes: int = 48):
        super().__init__(max_ngram, min_ngram, num_tokens)
        self.max_branches, self.max_nodes = int(max_branches), int(max_nodes)
        self.depth = int(num_tokens)

    def propose_tree(self, tokens, max_depth, max_nodes, sampling) -> DraftTree:
        depth = min(int(max_depth), self.num_tokens)
        budget = min(int(max_nodes), self.max_nodes)
        L = len(tokens)
        if depth <= 0 or budget <= 0 or L < 2:
            return DraftTree([], [])
        arr = np.asarray(tokens, dtype=np.int64)
        starts: list[int] = []
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)
            hits = np.nonzero((windows == arr[L - n :]).all(axis=1))[0]
            if not hits.size:
                continue
            full = hits[hits + n + depth <= L]
            first = int(full[-1] if full.size else hits[0])  # the chain proposer's choice
            for h in [first] + [int(h) for h in hits[::-1] if h != first]:
                if h + n not in starts:
                    starts.append(h + n)
                if len(starts) >= self.max_branches:
                    break
            if len(starts) >= self.max_branches:
                break
        toks: list[int] = []
        pars: list[int] = []
        children: list[dict[int, int]] = [{}]
        for st in starts:
            node = 0
            for t in arr[st : st + depth].tolist():
                nxt = children[node].get(t)
                if nxt is None:
                    if len(toks) >= budget:
                        break
                    toks.append(t)
                    pars.append(node)
                    children.append({})
                    nxt = children[node][t] = len(toks)
                node = nxt
        return DraftTree(toks, pars)


def _draft_token(z: Tensor, sampling: SamplingParams, grammar, drafts: list, qs: list) -> bool:
    """One chain draft from logits ``z`` [V]: masked by the grammar, then the argmax (greedy) or a sample
    of the processed distribution q (appended to ``qs``); the token is appended to ``drafts``. False when
    drafting stops here: no grammatical token (nothing appended), or the grammar ends after this one."""
    if grammar is not None and (z := _grammar_logits(z, grammar)) is None:
        return False
    if sampling.greedy:
        d = z.argmax(-1)
    else:
        q = sampling.process(z)
        d = sample(q, sampling.generator)
        qs.append(q)
    drafts.append(d)
    return grammar is None or _grammar_step(grammar, d)


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
        static_shapes, compile, buckets: the draft model's runner options (see ``TargetRunner``).
    """

    name = "draft_model"
    stochastic = True
    grammar_aware = True

    def __init__(self, draft_model, vocab_size: int | None = None, max_len: int | None = None,
                 static_shapes: bool = False, compile: bool = False, buckets: Sequence[int] = DEFAULT_BUCKETS):
        self.runner = TargetRunner(draft_model, taps=None, max_len=max_len, static_shapes=static_shapes,
                                   compile=compile, buckets=buckets)
        self.vocab_size = int(vocab_size) if vocab_size is not None else self.runner.vocab_size
        self.reset()

    def reset(self) -> None:
        self.runner.reset()
        self._cached: list[int] = []  # tokens whose entries are in the draft cache, in order
        self._committed = 0  # leading entries of _cached known to be committed tokens (never change)
        self._unsynced: Tensor | None = None  # last drafts fed to the cache, not yet read to the host

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
        if self._unsynced is not None:
            self._cached.extend(self._unsynced.tolist())
            self._unsynced = None
        n = min(len(self._cached), len(tokens) - 1)
        i = min(self._committed, n)
        while i < n and self._cached[i] == tokens[i]:
            i += 1
        self._committed = i
        if i < len(self._cached):
            self.runner.truncate(i)
            del self._cached[i:]

    def propose(self, tokens, k, sampling, grammar=None):
        if k <= 0:
            return [], None
        k = min(k, self.runner.max_len - len(tokens) + 1)  # the last draft is never fed
        if k <= 0:
            return [], None
        self._rollback(tokens)
        feed = tokens[len(self._cached) :]  # includes the pending token
        if sampling.greedy and grammar is None:
            # the catch-up and k - 1 draft steps in one call (one graph with static shapes + compile)
            drafts_t = self.runner.greedy_chain(feed, k, self.vocab_size)
            self._cached.extend(feed)
            self._unsynced = drafts_t[: k - 1]
            return drafts_t, None
        logits, _ = self.runner.forward(feed, last_only=True)
        self._cached.extend(feed)
        logits = logits[-1]
        drafts, qs = [], []
        fed = 0  # drafts fed to the draft cache
        with _grammar_scope(grammar):
            for i in range(k):
                if not _draft_token(self._to_target_vocab(logits), sampling, grammar, drafts, qs):
                    break
                if i + 1 < k:
                    logits, _ = self.runner.forward(drafts[-1].reshape(1, 1))
                    logits = logits[-1]
                    fed += 1
        if not drafts:
            return [], None
        drafts_t = torch.stack(drafts)
        self._unsynced = drafts_t[:fed]  # fed to the draft cache; read at the next rollback (after the round)
        return drafts_t, (torch.stack(qs) if qs else None)

    def accept(self, tokens, num_accepted, target_taps) -> None:
        self._rollback(tokens)


_EXTEND_PAD = 16  # static shapes: rebuilds of up to this many entries are padded (slack kept in the cache)


@torch.no_grad()
def _eagle3_step_static(drafter, input_ids: Tensor, hidden: Tensor, cache_k: list[Tensor], cache_v: list[Tensor],
                       position_ids: Tensor, write_index: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The drafter's static-shape step (:meth:`drafttrain.drafters.eagle3.Eagle3Drafter.step_static`, the one
    owner of its forward), called as a function of the drafter so that each proposer compiles its own copy."""
    return drafter.step_static(input_ids, hidden, cache_k, cache_v, position_ids, write_index, mask)


@torch.no_grad()
def eagle3_step_chain(drafter, input_ids: Tensor, hidden: Tensor | None, cache_k: list[Tensor],
                      cache_v: list[Tensor], start: Tensor, taps: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The drafter's ``step_static`` for ``n`` causal entries at slots (= positions) ``start .. start + n - 1``,
    ``start`` 0-d: positions, write index and mask are computed here, so under ``compile`` they are part of
    the graph. With ``taps [1, n, 3*Ht]`` instead of ``hidden``, the target features are fused first (the
    rebuild of a round's accepted entries)."""
    if taps is not None:
        hidden = drafter.fuse(taps)
    n, cap = input_ids.shape[1], cache_k[0].shape[2]
    q = start + torch.arange(n, device=input_ids.device)
    mask = (torch.arange(cap, device=input_ids.device)[None, :] <= q[:, None])[None]
    return drafter.step_static(input_ids, hidden, cache_k, cache_v, q[None], q, mask)


class Eagle3ChainProposer:
    """Chain drafting with an EAGLE-3 drafter (``drafttrain.drafters.eagle3``).

    Drafter cache entry j is built from (fused target feature h_j, token x_{j+1}) at rotary position j.
    Entries built from target features cover the target's cache (positions < n, n = target cache length);
    the drafts of a round append entries n, n+1, ... built from (d_i, the drafter's own previous output
    hidden). After verification (a accepted, bonus b), the cache is truncated back to n and positions
    n..n+a are rebuilt from the target taps just verified with tokens [d_1..d_a, b]; the output at the last
    of them gives the next round's first draft.

    Args:
        drafter: object with ``new_cache``, ``fuse``, ``step`` and ``logits_to_target``, and with
            ``static_shapes`` ``step_static`` (see the module ``drafttrain.drafters.eagle3``).
        max_len: capacity of the drafter's cache (target max length + K is enough).
        static_shapes: run the per-token draft steps with static shapes (the drafter's ``step_static``:
            write by index, attend over the whole preallocated cache with a mask), as CUDA graphs need.
        compile: with ``static_shapes``, compile that step (CUDA graphs on CUDA, inductor on CPU; see
            :func:`drafttrain.decoding.target.compile_static`).
    """

    name = "eagle3"
    stochastic = True
    grammar_aware = True

    def __init__(self, drafter, max_len: int = 4096, static_shapes: bool = False, compile: bool = False):
        self.drafter = drafter
        self.max_len = int(max_len)
        p = next(drafter.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.static_shapes = bool(static_shapes)
        self._step_static, self._step_chain = _eagle3_step_static, eagle3_step_chain
        if compile and self.static_shapes:
            from .target import compile_static

            self._step_static = compile_static(_eagle3_step_static, self.device)  # tree steps (a given mask)
            self._step_chain = compile_static(eagle3_step_chain, self.device)  # chain steps and rebuilds
        self.reset()

    def _draft_step(self, ids: Tensor, hidden: Tensor | None, pos: Tensor, attn_mask: Tensor | None = None,
                    n_real: int | None = None, taps: Tensor | None = None):
        """One drafting step of ``n`` new entries (``attn_mask [1, n, L + n]``; None = causal). With static
        shapes, rows past ``n_real`` are padding: written past the kept entries and never seen by real rows.
        ``taps [1, n, 3*Ht]`` (static shapes, causal) replaces ``hidden``: fused inside the step."""
        if not self.static_shapes:
            return self.drafter.step(ids, hidden, self.cache, position_ids=pos, attn_mask=attn_mask)
        L, n, cap = self.cache.length, ids.shape[1], self.cache.max_len
        if L + n > cap:
            raise ValueError(f"draft cache overflow: {L} + {n} > {cap}")
        if attn_mask is None:  # causal, slot = position: everything but the inputs is built in the step
            slots = self.__dict__.get("_slots")
            if slots is None or slots.shape[0] != cap:
                slots = self._slots = torch.arange(cap, device=self.device)
            out = self._step_chain(self.drafter, ids, hidden, self.cache.k, self.cache.v, slots[L], taps)
        else:
            full = torch.zeros(1, n, cap, dtype=torch.bool, device=self.device)
            full[:, :, : L + n] = attn_mask.to(self.device)
            write = torch.arange(L, L + n, device=self.device)
            out = self._step_static(self.drafter, ids, hidden, self.cache.k, self.cache.v, pos, write, full)
        self.cache.length = L + (n if n_real is None else int(n_real))
        return out

    def reset(self) -> None:
        self.cache = None
        self._n = 0  # drafter cache entries built from target features (= target cache length)
        self._next_logits: Tensor | None = None  # [Vd] logits for the next round's first draft
        self._next_hidden: Tensor | None = None  # [1, 1, H] drafter output hidden at position n-1

    @torch.no_grad()
    def _extend(self, ids: list[int], taps: Tensor, start: int) -> None:
        """Write entries ``start..start+len(ids)-1`` from target taps ``[len, D]`` and tokens ``ids``."""
        taps = taps.to(self.device, self.dtype).unsqueeze(0)  # [1, n, 3*Ht]
        n = len(ids)
        if self.static_shapes and n <= _EXTEND_PAD:
            # a round's rebuild (a + 1 entries): padded to a power of two, one static shape per size; the
            # features are fused inside the (compiled) step
            if self.cache.length != start:  # the step writes at the cache's end: slot = position
                raise RuntimeError(f"drafter cache holds {self.cache.length} entries, rebuild starts at {start}")
            pad = (1 << (n - 1).bit_length()) - n
            input_ids = torch.tensor([ids + [0] * pad], dtype=torch.long, device=self.device)
            if pad:
                taps = torch.cat([taps, taps.new_zeros(1, pad, taps.shape[-1])], dim=1)
            logits, out_hidden = self._draft_step(input_ids, None, None, n_real=n, taps=taps)
        else:  # the prompt: eager, any length
            input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, n]
            pos = torch.arange(start, start + n, device=self.device).unsqueeze(0)
            logits, out_hidden = self.drafter.step(input_ids, self.drafter.fuse(taps), self.cache, position_ids=pos)
        self._next_logits = logits[0, n - 1]
        # a fresh [1, 1, H] tensor: a slice of out_hidden would carry its strides, and a compiled step
        # (guarded on strides) would recompile for every length of this rebuild (every prompt length)
        self._next_hidden = out_hidden[:, n - 1 : n].clone(memory_format=torch.contiguous_format)
        self._n = start + n

    def prefill(self, prompt_ids, target_taps, first_token) -> None:
        if target_taps is None:
            raise ValueError("Eagle3ChainProposer needs target taps: build the TargetRunner with taps=")
        if getattr(self, "_buffer", None) is None:  # allocated once, reused for every sequence
            self._buffer = self.drafter.new_cache(1, self.max_len + (_EXTEND_PAD if self.static_shapes else 0),
                                                  device=self.device, dtype=self.dtype)
            if self.static_shapes and hasattr(self._buffer, "k"):
                for t in (*self._buffer.k, *self._buffer.v):  # updated in place inside CUDA graphs
                    torch._dynamo.mark_static_address(t)
        self.cache = self._buffer
        if hasattr(self.cache, "k"):
            self.cache.truncate(0)
        elif self.cache.length:  # a stand-in cache without buffers: start afresh
            self.cache = self._buffer = self.drafter.new_cache(1, self.max_len, device=self.device, dtype=self.dtype)
        # entry j = (h_j, x_{j+1}) for j = 0..n-1, the last token being the pending first_token
        self._extend(list(prompt_ids[1:]) + [int(first_token)], target_taps, start=0)

    @torch.no_grad()
    def propose(self, tokens, k, sampling, grammar=None):
        k = min(k, self.max_len - self._n)  # the round may leave up to n + k entries after accept
        if k <= 0:
            return [], None
        logits, hidden = self._next_logits, self._next_hidden
        drafts, qs = [], []
        with _grammar_scope(grammar):
            for i in range(k):
                z = self.drafter.logits_to_target(logits.float())  # [V], -inf outside the draft vocab
                # (masking the target-width z is masking the draft vocabulary at allowed[draft_to_target_ids])
                if not _draft_token(z, sampling, grammar, drafts, qs):
                    break
                if i + 1 < k:
                    pos = None if self.static_shapes else torch.tensor([[self._n + i]], device=self.device)
                    out, hidden = self._draft_step(drafts[-1].reshape(1, 1), hidden, pos)
                    logits = out[0, -1]
        if not drafts:
            return [], None
        return torch.stack(drafts), (torch.stack(qs) if qs else None)  # a device tensor: no host sync

    @torch.no_grad()
    def accept(self, tokens, num_accepted, target_taps) -> None:
        a = int(num_accepted)
        if target_taps is None or target_taps.shape[0] != a + 1:
            raise ValueError("Eagle3ChainProposer.accept needs the target taps at [pending, d_1..d_a]")
        if self._n + a + 2 != len(tokens):
            raise RuntimeError(f"drafter out of step: {self._n} target entries, {len(tokens)} committed tokens")
        self.cache.truncate(self._n)  # drop the draft-only entries
        self._extend(list(tokens[-(a + 1) :]), target_taps, start=self._n)


class Eagle3TreeProposer(Eagle3ChainProposer):
    """EAGLE-2-style dynamic tree drafting with an EAGLE-3 drafter.

    The root's ``top_k`` draft tokens form depth 1. Each further level runs the drafter once on the current
    frontier (``top_k`` nodes, one batched ``step`` with a tree attention mask: each node sees the
    committed entries, its ancestors' draft entries and itself; a depth-d node sits at rotary position
    n + d - 1 and reads its parent's output hidden), scores every node's ``top_k`` children by cumulative
    draft log-probability, and keeps the global ``top_k`` of the ``top_k**2`` children as the next frontier.
    All expanded nodes are reranked and the ``total_tokens`` best (ties go to the shallower node, so the
    selection is closed under ancestors) form the tree. Drafts are deterministic: sampling stays lossless
    through the tree verifier. After verification the drafter cache drops every draft entry and rebuilds the
    accepted path from target features (as the chain proposer does).

    Args:
        depth: the most draft tokens along a path (depth - 1 batched drafter steps per round).
        top_k: children per expanded node and frontier width.
        total_tokens: draft nodes in the verified tree (root excluded).
    """

    name = "eagle3_tree"
    stochastic = False
    tree = True

    def __init__(self, drafter, max_len: int = 4096, depth: int = 6, top_k: int = 8, total_tokens: int = 48,
                 static_shapes: bool = False, compile: bool = False):
        if depth < 1 or top_k < 1 or total_tokens < 1:
            raise ValueError(f"tree depth, top_k and total_tokens must be >= 1 (got {depth}, {top_k}, {total_tokens})")
        self.depth, self.top_k, self.total_tokens = int(depth), int(top_k), int(total_tokens)
        # the draft entries of a round live past the target entries until accept() drops them
        super().__init__(drafter, max_len=int(max_len) + (self.depth - 1) * self.top_k, static_shapes=static_shapes,
                         compile=compile)
        self._draft_ids = drafter.draft_target_ids().to(self.device)

    def propose(self, tokens, k, sampling, grammar=None):  # pragma: no cover - the engine calls propose_tree
        raise TypeError("Eagle3TreeProposer drafts trees: use propose_tree")

    def _logprobs(self, logits: Tensor, grammar, paths: list) -> Tensor:
        """Draft log-probabilities ``[m, Vd]`` of ``logits [m, Vd]``; with a grammar, renormalised over the
        tokens it allows after each row's path (``paths[i]``: tokens from the committed state; None = an
        ungrammatical node), -inf everywhere on rows that allow nothing."""
        if grammar is None:
            return torch.log_softmax(logits.float(), -1)
        allowed = torch.stack([_allowed_after(grammar, p) for p in paths]).to(self.device)[:, self._draft_ids]
        lp = torch.log_softmax(logits.float().masked_fill(~allowed, float("-inf")), -1)
        return lp.masked_fill(~allowed, float("-inf"))  # (rows with nothing allowed would be NaN)

    @torch.no_grad()
    def propose_tree(self, tokens, max_depth: int, max_nodes: int, sampling, grammar=None) -> DraftTree:
        D = min(self.depth, int(max_depth))
        total = min(self.total_tokens, int(max_nodes))
        if D <= 0 or total <= 0 or self._next_logits is None:
            return DraftTree([], [])
        dev, n = self.device, self._n
        D = min(D, (self.cache.max_len - n) // self.top_k + 1)  # never overflow the drafter cache
        lp0 = self._logprobs(self._next_logits[None], grammar, [[]])[0]  # [Vd]
        k = min(self.top_k, lp0.shape[-1])
        s1, i1 = lp0.topk(k)
        cand_score, cand_tok, cand_par = [s1], [self._draft_ids[i1]], [torch.full((k,), -1, device=dev)]
        f_idx = torch.arange(k, device=dev)  # candidate index of each frontier node
        f_tok, f_score = self._draft_ids[i1], s1
        f_hid = self._next_hidden.expand(1, k, -1)  # [1, k, H] the parents' output hidden
        vis = torch.zeros(k, 0, dtype=torch.bool, device=dev)  # draft entries each frontier node may see
        n_cand = k
        paths = None  # with a grammar: each frontier node's token path (None: -inf score, ungrammatical)
        if grammar is not None:
            paths = [[t] if ok else None for t, ok in zip(f_tok.tolist(), torch.isfinite(s1).tolist())]
        for d in range(2, D + 1):
            mask = torch.cat([torch.ones(k, n, dtype=torch.bool, device=dev), vis,
                              torch.eye(k, dtype=torch.bool, device=dev)], dim=1)[None]  # [1, k, L + k]
            pos = torch.full((1, k), n + d - 2, dtype=torch.long, device=dev)
            logits, out_h = self._draft_step(f_tok[None], f_hid, pos, mask)
            lp = self._logprobs(logits[0], grammar, paths)  # [k, Vd]
            cs, ci = lp.topk(k, dim=-1)  # [k, k] children of each frontier node
            cs = (f_score[:, None] + cs).reshape(-1)
            ctok = self._draft_ids[ci].reshape(-1)
            rows = torch.arange(k, device=dev).repeat_interleave(k)  # frontier row of each child
            cand_score.append(cs)
            cand_tok.append(ctok)
            cand_par.append(f_idx[rows])
            best = cs.topk(k).indices  # next frontier: global top-k children
            r = rows[best]
            f_idx = n_cand + best
            f_tok, f_score, f_hid = ctok[best], cs[best], out_h[:, r]
            vis = torch.cat([vis[r], torch.eye(k, dtype=torch.bool, device=dev)[r]], dim=1)
            n_cand += k * k
            if grammar is not None:  # a finite score means a grammatical path (its parent's is finite too)
                paths = [paths[rr] + [t] if ok else None for rr, t, ok in
                         zip(r.tolist(), f_tok.tolist(), torch.isfinite(f_score).tolist())]
        scores = torch.cat(cand_score)
        # stable sort: ties keep the earlier candidate, and parents are always earlier than their children
        order = torch.sort(scores, descending=True, stable=True).indices[:total]
        if grammar is not None:
            order = order[torch.isfinite(scores[order])]  # ungrammatical candidates score -inf
            if order.numel() == 0:
                return DraftTree([], [])
        sel = order.sort().values  # candidate order is topological
        host = torch.stack([sel.double(), torch.cat(cand_tok)[sel].double(), torch.cat(cand_par)[sel].double(),
                            scores[sel].double()]).tolist()  # one host sync
        sel_l, tok_l, par_l, sc_l = host
        node_of = {int(c): i + 1 for i, c in enumerate(sel_l)}
        parents = [0 if p < 0 else node_of[int(p)] for p in par_l]
        return DraftTree([int(t) for t in tok_l], parents, sc_l)


class MedusaChainProposer(_DeterministicBase):
    """Medusa heads as a chain: the top-1 token of heads 0..K-1 (q one-hot, so sampling stays lossless).

    Head k reads the target's final (post-norm) hidden state h_m at the last verified position m -- the
    state whose LM-head output produced the pending token x_{m+1} -- and predicts x_{m+2+k}: head 0 drafts
    the token after the pending one. The target must tap ``hidden_states[L]`` (``taps=(L,)``, L = number of
    layers). K is at most the number of heads.
    """

    name = "medusa"
    grammar_aware = True

    def __init__(self, heads):
        self.heads = heads
        p = next(heads.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.reset()

    def reset(self) -> None:
        self._h: Tensor | None = None

    def _set_hidden(self, taps) -> None:
        if taps is None:
            raise ValueError("Medusa proposers need the target's last hidden state: TargetRunner(taps=(L,))")
        if taps.shape[-1] != self.heads.hidden_size:
            raise ValueError(f"medusa: tap width {taps.shape[-1]} != heads hidden_size {self.heads.hidden_size} "
                             "(tap hidden_states[L] only)")
        self._h = taps[-1].to(self.device, self.dtype).reshape(1, 1, -1)

    def prefill(self, prompt_ids, target_taps, first_token) -> None:
        self._set_hidden(target_taps)

    def accept(self, tokens, num_accepted, target_taps) -> None:
        self._set_hidden(target_taps)

    @torch.no_grad()
    def _head_topk(self, num_heads: int, k: int | list[int]) -> Tensor:
        ks = [k] * num_heads if isinstance(k, int) else list(k)
        kmax = max(ks)
        out = torch.zeros(num_heads, kmax, dtype=torch.long, device=self.device)
        for j in range(num_heads):
            out[j, : ks[j]] = self.heads.head_logits(self._h, j)[0, 0].topk(ks[j]).indices
        return out

    def propose(self, tokens, k, sampling, grammar=None):
        k = min(int(k), self.heads.num_heads)
        if k <= 0 or self._h is None:
            return [], None
        if grammar is None:
            return self._head_topk(k, 1)[:, 0], None  # a device tensor: no host sync
        drafts = []  # head j: the top-1 among the tokens allowed after the drafts of heads < j
        with grammar.scratch():
            for j in range(k):
                z = _grammar_logits(self.heads.head_logits(self._h, j)[0, 0], grammar)
                if z is None:
                    break
                drafts.append(int(z.argmax()))
                if not _grammar_step(grammar, drafts[-1]):
                    break
        return drafts, None


class MedusaTreeProposer(MedusaChainProposer):
    """Medusa heads on a static tree given as Medusa ``choices`` (paths of top-k ranks: ``[0, 1]`` = top-1 of
    head 0, then top-2 of head 1); default :data:`drafttrain.decoding.tree.DEFAULT_MEDUSA_CHOICES`.
    Siblings are distinct ranks of one head, hence distinct tokens; drafts are deterministic."""

    name = "medusa_tree"
    tree = True

    def __init__(self, heads, choices=None):
        super().__init__(heads)
        self.structure = medusa_tree(choices if choices else DEFAULT_MEDUSA_CHOICES, heads.num_heads)
        self.depth = max(self.structure.heads) + 1

    def propose_tree(self, tokens, max_depth: int, max_nodes: int, sampling, grammar=None) -> DraftTree:
        st = self.structure
        D = min(self.depth, int(max_depth))
        if D <= 0 or max_nodes <= 0 or self._h is None:
            return DraftTree([], [])
        if grammar is not None:
            return self._grammar_tree(D, int(max_nodes), grammar)
        cand = self._head_topk(D, st.topk[:D]).tolist()  # one host sync
        nodes = [i for i, h in enumerate(st.heads) if h < D][: int(max_nodes)]  # topological: parents first
        keep = {i + 1: j + 1 for j, i in enumerate(nodes)}
        return DraftTree([cand[st.heads[i]][st.ranks[i]] for i in nodes],
                         [0 if st.parents[i] == 0 else keep[st.parents[i]] for i in nodes])

    @torch.no_grad()
    def _grammar_tree(self, D: int, max_nodes: int, grammar) -> DraftTree:
        """The static tree under a grammar: a rank-r node takes the rank-r token of its head among the tokens
        allowed after its parent's path; a node without one (fewer allowed tokens) is dropped with its
        subtree. Siblings are distinct ranks of one masked distribution, hence distinct tokens."""
        st = self.structure
        head = [self.heads.head_logits(self._h, j)[0, 0].float() for j in range(D)]
        new_of = {0: 0}  # structure node -> tree node (0 = root)
        paths: dict[int, list[int]] = {0: []}  # tree node -> its token path
        allowed: dict[int, Tensor] = {}  # tree node -> tokens allowed after its path
        toks, pars = [], []
        for i, h in enumerate(st.heads):
            if h >= D or st.parents[i] not in new_of or len(toks) >= max_nodes:
                continue
            par = new_of[st.parents[i]]
            if par not in allowed:
                allowed[par] = _allowed_after(grammar, paths[par]).to(self.device)
            top = head[h].masked_fill(~allowed[par], float("-inf")).topk(st.ranks[i] + 1)
            if not bool(torch.isfinite(top.values[-1])):
                continue
            t = int(top.indices[-1])
            toks.append(t)
            pars.append(par)
            new_of[i + 1] = len(toks)
            paths[len(toks)] = paths[par] + [t]
        return DraftTree(toks, pars)


class StubTreeProposer(OracleProposer):
    """Test proposer for trees: a main path along ``reference_tokens`` with ``branching - 1`` wrong siblings
    at every depth (wrong tokens are ``(ref + 1 + s) % vocab_size``), the right token's slot among its
    siblings rotating with the depth. Where ``agree_fn(j)`` is False the main-path node at output index j
    holds a wrong token instead. Under greedy decoding with the AR output as reference the accepted length
    is exactly the chain stub's, so tau can be computed in closed form.
    """

    name = "stub_tree"
    tree = True

    def __init__(self, reference_tokens: Sequence[int], agree_fn: Callable[[int], bool], vocab_size: int,
                 branching: int = 2):
        super().__init__(reference_tokens)
        self.agree_fn = agree_fn
        self.vocab_size = int(vocab_size)
        self.branching = int(branching)

    def propose_tree(self, tokens, max_depth, max_nodes, sampling) -> DraftTree:
        j0 = len(tokens) - self._prompt_len
        ref = self.reference[j0 : j0 + int(max_depth)]
        toks, pars = [], []
        main = 0
        for d, t in enumerate(ref):
            right = t if self.agree_fn(j0 + d) else (t + self.branching) % self.vocab_size
            wrong = [(t + 1 + s) % self.vocab_size for s in range(self.branching - 1)]
            slot = d % self.branching
            sib = wrong[:slot] + [right] + wrong[slot:]
            if len(toks) + len(sib) > max_nodes:
                break
            for i, tok in enumerate(sib):
                toks.append(tok)
                pars.append(main)
                if i == slot:
                    new_main = len(toks)
            main = new_main
        return DraftTree(toks, pars)
