"""Batched chain speculative decoding: B prompts decoded together (``decode.batch_size > 1``).

:class:`BatchSpecDecoder` wraps the batch-1 parts (a :class:`TargetRunner` and a chain proposer, built as for
:class:`~drafttrain.decoding.engine.SpecDecoder`) and decodes a list of prompts, at most ``batch_size`` rows at
a time. Each row keeps its own accepted length per round (ragged acceptance), its own position and its own end
(eos or its own ``max_new_tokens``); a finished row leaves the batch, and the next waiting prompt takes its
place (continuous batching): the newcomers are prefilled in a forward of their own, into the free physical
rows, and join the next round. Caches have a fixed number of physical rows; the active rows are the leading
ones, a row that leaves is replaced in place by one of the last rows (:func:`fill_holes`: the fewest copies).

Target (and a draft model): :class:`BatchRunner`, per-layer K/V ``[B, Hkv, capacity, D]`` with one **write
pointer per row** (``lengths[b]``). Row b holds its committed tokens at slots ``0 .. lengths[b] - 1`` and slot
= position, so prompts are *right*-padded and need no position offset. A forward of ``n`` tokens writes row b's
tokens at slots ``lengths[b] + i`` (``scatter_`` by index) with ``position_ids = lengths[b] + i`` and a
per-row 4D mask ``slot_k <= slot_q`` (plus the sliding window by position): a row sees its own committed
slots and the new block, never another row's padding or its own stale slots, which all lie past its
pointer. Rollback is per row by index: the pointer moves to ``old + 1 + a_b`` (the pending token and the
accepted drafts); the rejected drafts and the padding of shorter rows stay behind it as dead slots, to be
overwritten by the next forward. Nothing is ever visible that is not the row's prompt + committed tokens
(``visible_slots``; tests/test_batched_decoding.py checks the K/V there against a fresh prefill).

EAGLE-3 drafter (:class:`_BatchEagle3`): its ``step`` writes one slot range for all rows (a shared write
pointer, ``Eagle3Cache.length``), so here rows keep a **validity mask** ``[B, capacity]`` and a position per
slot instead: every step passes a ``[B, n, L + n]`` mask (a query sees the valid slots of its row and the
entries of its own block up to itself) and per-row ``position_ids``. At accept the round's draft entries are
dropped (the shared pointer moves back to where drafting started) and each row's accepted entries are rebuilt
from the target's taps as in the batch-1 proposer; the padding of rows that accepted fewer (and of shorter
prompts) stays behind as invalid holes. When the buffer would overflow, each row's valid entries are gathered
to the front (``Eagle3Cache.keep`` with per-row indices). A draft model's rows are rolled back to their longest
prefix agreeing with the committed tokens right after verification. Medusa and prompt lookup are stateless per round (the target's
last hidden state per row; the batch-1 n-gram lookup per row).

Verification is the batch-1 rule: greedy ``verify_chain_greedy`` vectorised over the rows (one host sync per
round), sampling the batch-1 decoder's ``verify_chain_sampling`` row by row with its one generator; so greedy
rows equal their batch-1 AR output and sampling is lossless per row.
Statistics: a :class:`~drafttrain.decoding.engine.GenerationResult` per row (rounds, committed tokens, tau,
accepted / reached per position); a row's times are the call's times divided by the number of prompts, so
``aggregate`` over the rows gives the batch's throughput.

Static shapes (``TargetRunner(static_shapes=True)``): the target's (and a draft model's) forwards of B rows ×
n tokens are padded to (row bucket, token bucket), dummy rows on free physical rows at pointer 0, attending
over the whole buffer, masked; with ``compile`` one graph per shape (CUDA graphs on CUDA). Prefills run
unpadded; the EAGLE-3 drafter's and Medusa heads' batched steps run eagerly.

Not supported with B > 1 (one clear ``DraftTrainError``): tree proposers, grammar-constrained decoding,
typical acceptance.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from ..io import DraftTrainError
from ..targets.load import gather_taps, text_config
from .engine import GenerationResult, _commit, _record_round, _stop_tokens, aggregate
from .proposers import DraftModelProposer, Eagle3ChainProposer, MedusaChainProposer, NoDraft, PromptLookupProposer
from .sampling import SamplingParams, sample, verify_chain_greedy, verify_chain_sampling
from .target import DEFAULT_BUCKETS, TargetRunner, _layer_kinds, _sync, compile_static, static_cache_support

CHAIN_ONLY = "decode.batch_size>1 supports chain methods only (ar, pld, eagle3, medusa, draft_model, dflash)"


# ------------------------------------------------------------------------------------- per-row cache
def _moves(keep: Sequence[int]) -> tuple[list[int], list[int]]:
    """(destination, source) rows for keeping rows ``keep`` (in that order) in the leading rows in place:
    only the rows that change place move."""
    dst = [j for j, k in enumerate(keep) if int(k) != j]
    return dst, [int(keep[j]) for j in dst]


PACKED_ROW_TOKENS = 256  # a packed prefill's target row length


def pack_rows(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """Split items of ``lengths`` into ``ceil(total / max(row_tokens, longest))`` packed rows of about equal
    length (longest first, each to the shortest row so far): the rows are padded to the longest, so none is
    shorter than the longest item needs. Returns the items' indices per row (no row is empty)."""
    if not lengths:
        return []
    total, cap = sum(int(n) for n in lengths), max(int(row_tokens), max(int(n) for n in lengths), 1)
    R = max(1, min(len(lengths), -(-total // cap)))
    rows: list[list[int]] = [[] for _ in range(R)]
    load = [0] * R
    for i in sorted(range(len(lengths)), key=lambda j: -int(lengths[j])):
        r = min(range(R), key=load.__getitem__)
        rows[r].append(i)
        load[r] += int(lengths[i])
    return rows


@dataclass
class PackedLayout:
    """Where N prompts of ``lens`` tokens sit in ``R`` packed rows of ``S`` columns (:func:`pack_rows`): every real
    token's prompt ``doc`` and position ``pos`` (prompt order), its packed (row, column) ``src``; each prompt's
    row ``row`` and last column ``end``; ``pos_p`` / ``doc_p [R, S]`` (padding: position 0, prompt -1)."""

    R: int
    S: int
    doc: Tensor
    pos: Tensor
    src: tuple[Tensor, Tensor]
    row: Tensor
    end: Tensor
    pos_p: Tensor
    doc_p: Tensor

    @classmethod
    def of(cls, lens: Sequence[int], row_tokens: int, device) -> "PackedLayout":
        lens = [int(n) for n in lens]
        bins = pack_rows(lens, row_tokens)
        R, S = len(bins), max(sum(lens[d] for d in b) for b in bins)
        row_of, col_of = [0] * len(lens), [0] * len(lens)  # each prompt's packed row and first column
        for r, b in enumerate(bins):
            c = 0
            for d in b:
                row_of[d], col_of[d], c = r, c, c + lens[d]
        real = torch.tensor(lens, dtype=torch.long, device=device)
        row, col = torch.tensor(row_of, device=device), torch.tensor(col_of, device=device)
        doc = torch.repeat_interleave(torch.arange(len(lens), device=device), real)
        pos = torch.arange(int(real.sum()), device=device) - (torch.cumsum(real, 0) - real)[doc]
        src = (row[doc], col[doc] + pos)
        pos_p = torch.zeros((R, S), dtype=torch.long, device=device)
        doc_p = torch.full((R, S), -1, dtype=torch.long, device=device)
        pos_p[src], doc_p[src] = pos, doc
        return cls(R, S, doc, pos, src, row, col + real - 1, pos_p, doc_p)

    def causal(self) -> Tensor:
        """``[R, S, S]`` bool: a token sees the tokens of its own prompt up to itself (padding sees padding)."""
        d, p = self.doc_p, self.pos_p
        return (d[:, :, None] == d[:, None, :]) & (p[:, None, :] <= p[:, :, None])


def fill_holes(done: Sequence[bool]) -> list[int]:
    """The surviving rows' order after the ``done`` ones leave: a survivor stays in its row, the holes below
    the new batch size are filled by the last survivors (the fewest rows move in the cache buffers)."""
    alive = [i for i, d in enumerate(done) if not d]
    n = len(alive)
    movers = iter(i for i in alive if i >= n)
    stay = {i for i in alive if i < n}
    return [j if j in stay else next(movers) for j in range(n)]


class _RowLayer(CacheLayerMixin):
    """One layer of :class:`RowKVCache`: writes row b's new K/V at slots ``write_index[b]``."""

    is_sliding = False  # windows are applied by the runner's mask, by position

    def __init__(self, owner: "RowKVCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        _, H, _, D = key_states.shape
        rows, cap = self.owner.rows, self.owner.capacity
        self.device = key_states.device
        self.keys = key_states.new_zeros((rows, H, cap, D))
        self.values = value_states.new_zeros((rows, H, cap, value_states.shape[-1]))
        if self.owner.static and not torch.compiler.is_compiling():
            # fixed addresses: a CUDA graph may then mutate the buffers in place without copying them
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.owner.packed:  # a packed prefill attends within its own row; the runner scatters it after
            self.pending = (key_states, value_states)
            return key_states, value_states
        idx = self.owner.write_index  # [B, n]
        lo, hi = self.owner.row_window  # the physical rows this forward runs on
        keys, values = self.keys[lo:hi], self.values[lo:hi]
        for buf, new in ((keys, key_states), (values, value_states)):
            B, H, n, D = new.shape
            buf.scatter_(2, idx[:, None, :, None].expand(B, H, n, D), new.to(buf.dtype))
        kv = self.owner.kv_len
        return keys[:, :, :kv], values[:, :, :kv]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv_len, 0

    def get_seq_length(self) -> int:
        return self.owner.kv_len

    def get_max_length(self) -> int:
        return self.owner.capacity

    def scatter_packed(self, src: tuple[Tensor, Tensor], rows: Tensor, slots: Tensor) -> None:
        """Write the packed prefill's K/V into the buffers: its token at (packed row ``src[0][i]``, column
        ``src[1][i]``) goes to physical row ``rows[i]``, slot ``slots[i]``."""
        k, v = self.pending
        self.pending = None
        r, c = src
        self.keys[rows, :, slots] = k[r, :, c].to(self.keys.dtype)  # [S, H, D]
        self.values[rows, :, slots] = v[r, :, c].to(self.values.dtype)

    def move_rows(self, dst: list[int], src: list[int], upto: int | None = None) -> None:
        """Copy rows ``src`` onto rows ``dst`` (their first ``upto`` slots; None: all)."""
        if self.is_initialized and dst:
            n = self.keys.shape[2] if upto is None else int(upto)
            self.keys[dst, :, :n], self.values[dst, :, :n] = self.keys[src, :, :n], self.values[src, :, :n]


class RowKVCache(Cache):
    """K/V of ``rows`` physical rows, allocated once: the active rows are the leading ones, a forward runs on
    the rows ``row_window`` with one write pointer per row (the runner sets ``write_index [B, n]`` and
    ``kv_len``). ``static``: the buffers' addresses are marked static (CUDA graphs)."""

    def __init__(self, num_layers: int, capacity: int, rows: int, static: bool = False):
        super().__init__(layers=[_RowLayer(self) for _ in range(num_layers)])
        self.capacity, self.rows, self.static = int(capacity), int(rows), bool(static)
        self.kv_len = 0
        self.write_index: Tensor | None = None
        self.row_window: tuple[int, int] = (0, int(rows))
        self.packed = False  # a packed prefill is running (the layers hold its K/V for the runner to scatter)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len


class BatchRunner:
    """An HF causal LM over B rows, row b holding positions ``[0, lengths[b])`` at slots of the same index
    (see the module docstring). ``forward`` appends a right-padded block; ``set_lengths`` rolls rows back.

    The cache has a fixed number of physical rows (``reset(…, rows=)``: the decoder's batch, under static
    shapes its bucket), allocated once and never moved: rows leave by an in-place copy to the front, newcomers
    are prefilled into the free rows after the active ones (:meth:`admit`).

    ``static_shapes``: the CUDA-graph path. A forward of
    B rows × n tokens (n within the largest bucket) is padded to ``bucket(B)`` rows × ``bucket(n)`` tokens
    (dummy rows at pointer 0, on free physical rows) and attends over the whole buffer, masked, so there is
    one shape per (row bucket, token bucket); ``compile`` runs it through ``torch.compile`` (CUDA graphs on
    CUDA, inductor on CPU: :func:`~drafttrain.decoding.target.compile_static`). Prefills and longer blocks run
    unpadded (eager), as at batch 1."""

    def __init__(self, model, taps: tuple[int, ...] | None = None, max_len: int | None = None, slack: int = 64,
                 timing: bool = True, static_shapes: bool = False, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 compile: bool = False, packed_prefill: bool = True, packed_row_tokens: int = PACKED_ROW_TOKENS):
        why = static_cache_support(model)
        if why:
            raise DraftTrainError(f"decode.batch_size>1: this model cannot be batched ({why})")
        self.model = model.eval()
        self.taps = tuple(taps) if taps else None
        cfg = text_config(model.config)
        self.num_layers, self.vocab_size = int(cfg.num_hidden_layers), int(cfg.vocab_size)
        self.max_len = int(max_len if max_len is not None else getattr(cfg, "max_position_embeddings", 1 << 16))
        self.static_shapes, self.buckets = bool(static_shapes), sorted(int(b) for b in buckets)
        if self.static_shapes:  # padded token blocks write up to a bucket past a row's pointer
            slack = max(int(slack), self.buckets[-1])
        self.capacity = self.max_len + int(slack)  # padded rows write past the longest row
        kinds, self.window = _layer_kinds(cfg)
        self._kinds = set(kinds or [])
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._neg = torch.finfo(self.dtype if self.dtype.is_floating_point else torch.float32).min
        self.timing, self.time_forward, self.num_forwards = bool(timing), 0.0, 0
        self._compiled = compile_static(self._padded_forward, self.device) if compile and self.static_shapes \
            else None
        self.shapes: set[tuple[int, int]] = set()  # the (rows, tokens) shapes of the padded forwards run
        self.packed_prefill, self.packed_row_tokens = bool(packed_prefill), int(packed_row_tokens)
        self.cache: RowKVCache | None = None
        self.reset(1)

    def bucket(self, n: int) -> int | None:
        """The smallest bucket >= n (None: past the largest)."""
        return next((b for b in self.buckets if b >= int(n)), None)

    def reset(self, batch_size: int, rows: int | None = None) -> None:
        """``batch_size`` empty rows in a cache of ``rows`` physical rows (default: ``batch_size``, under static
        shapes its bucket). The buffers are kept while that number stays the same (nothing past a row's
        pointer is ever read)."""
        batch_size = int(batch_size)
        if not rows:
            rows = (self.bucket(batch_size) if self.static_shapes else None) or batch_size
        rows = max(int(rows), 1)
        if batch_size > rows:
            raise ValueError(f"{batch_size} rows, the cache has {rows}")
        if self.cache is None or self.cache.rows != rows:
            self.cache = RowKVCache(self.num_layers, self.capacity, rows=rows, static=self.static_shapes)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self._held = self.lengths.clone()
        self._offset = 0  # the first physical row of the next forward (admit: the newcomers' rows)

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def set_lengths(self, lengths: Tensor | Sequence[int]) -> None:
        """Per-row rollback by index: row b keeps slots ``[0, lengths[b])`` (never more than it holds)."""
        new = torch.as_tensor(lengths, dtype=torch.long, device=self.device).reshape(-1)
        if new.shape != self.lengths.shape or bool((new < 0).any()) or bool((new > self._held).any()):
            raise ValueError(f"cannot set row lengths {new.tolist()} (rows hold {self._held.tolist()})")
        self.lengths = new

    def select_rows(self, rows: Sequence[int] | Tensor) -> None:
        """Keep only the rows ``rows`` (in that order) as the leading rows: finished rows leave the batch. The
        buffers stay; the rows that change place are copied (:func:`fill_holes` makes that the fewest)."""
        keep = [int(r) for r in (rows.tolist() if isinstance(rows, Tensor) else rows)]
        dst, src = _moves(keep)
        upto = int(self._held[src].max()) if src else 0  # slots past a row's held ones are never read
        for layer in self.cache.layers:
            layer.move_rows(dst, src, upto)
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.lengths, self._held = self.lengths[idx], self._held[idx]

    def _check_room(self, n: int) -> None:
        if self.batch_size + int(n) > self.cache.rows:
            raise ValueError(f"{self.batch_size} + {n} rows, the cache has {self.cache.rows}")

    @torch.no_grad()
    def admit(self, ids: Tensor, n_real: Tensor | Sequence[int]) -> tuple[Tensor, Tensor | None]:
        """Continuous batching: prefill the new rows ``ids [N, n]`` (right-padded, ``n_real`` real tokens each)
        in a forward of their own, into the free physical rows after the active ones (which are left as they
        are). Returns the new rows' ``forward(..., last_only=True)``."""
        N, B0 = int(ids.shape[0]), self.batch_size
        self._check_room(N)
        if self.packed_prefill and N > 1:
            return self._admit_packed(ids, n_real)
        L, held = self.lengths, self._held
        self.lengths = self._held = torch.zeros(N, dtype=torch.long, device=self.device)
        self._offset = B0
        try:
            out = self.forward(ids, n_real, last_only=True, pad=False)
        finally:
            self._offset = 0
        self.lengths, self._held = torch.cat([L, self.lengths]), torch.cat([held, self._held])
        return out

    def _admit_packed(self, ids: Tensor, n_real: Tensor | Sequence[int]) -> tuple[Tensor, Tensor | None]:
        """:meth:`admit` in one unpadded forward: the newcomers' prompts back to back in packed rows of about
        ``packed_row_tokens`` tokens each (:func:`pack_rows`), each prompt attending to its own tokens only (a
        block-diagonal causal mask, positions from 0 per prompt), the K/V then scattered into their physical
        rows. Costs their real tokens (plus the short rows' padding), not N x the longest prompt; several rows
        keep the dense mask's attention (the square of a row's length) small."""
        N, B0 = int(ids.shape[0]), self.batch_size
        real = torch.as_tensor(n_real, dtype=torch.long, device=self.device).reshape(N)
        if bool((real < 1).any()) or int(real.max()) > self.max_len:
            raise ValueError(f"cannot prefill prompts of {real.tolist()} tokens (max_len {self.max_len})")
        lay = PackedLayout.of(real.tolist(), self.packed_row_tokens, self.device)
        keep = torch.arange(ids.shape[1], device=self.device)[None, :] < real[:, None]
        flat = ids.new_zeros((lay.R, lay.S)).to(self.device)
        flat[lay.src] = ids.to(self.device)[keep]
        cols, where = torch.unique(lay.end, sorted=True, return_inverse=True)
        if self.timing:
            _sync(self.device)
        t0 = time.perf_counter()
        self.cache.packed, self.cache.kv_len = True, lay.S
        try:
            out = self.model(input_ids=flat, position_ids=lay.pos_p, attention_mask=self._packed_mask(lay),
                             cache=self.cache, use_cache=True, output_hidden_states=self.taps is not None,
                             logits_to_keep=cols)
            for layer in self.cache.layers:
                layer.scatter_packed(lay.src, lay.doc + B0, lay.pos)
        finally:
            self.cache.packed = False
        logits = out.logits.float()
        at = where if logits.shape[1] == cols.numel() else lay.end  # (a model that ignores logits_to_keep)
        logits = logits[lay.row, at][:, None]  # [N, 1, V]
        taps = None
        if self.taps is not None:  # right-padded [N, n, D], as the padded prefill returns them
            t = gather_taps(out.hidden_states, self.taps)
            taps = t.new_zeros((N, ids.shape[1], t.shape[-1]))
            taps[lay.doc, lay.pos] = t[lay.src]
        if self.timing:
            _sync(self.device)
        self.time_forward += time.perf_counter() - t0
        self.num_forwards += 1
        self.lengths, self._held = torch.cat([self.lengths, real]), torch.cat([self._held, real])
        return logits, taps

    def _per_kind(self, one):
        """The attention mask HF takes for this model's layer kinds, from ``one(window or None)``."""
        if "sliding" not in self._kinds:
            return one(None)
        if self._kinds == {"sliding"}:
            return one(self.window)
        return {"full_attention": one(None), "sliding_attention": one(self.window)}

    def _packed_mask(self, lay: PackedLayout):
        """``[R, 1, S, S]`` additive mask of packed rows: causal within each prompt (and its window); the padding
        (prompt -1, position 0) sees only padding, so no query row is empty."""
        same, pos = lay.causal(), lay.pos_p

        def one(window):
            allow = same if not window else same & ((pos[:, :, None] - pos[:, None, :]) < window)
            return torch.where(allow, 0.0, self._neg).to(self.dtype)[:, None]

        return self._per_kind(one)

    def visible_slots(self, row: int) -> range:
        """The slots row ``row`` attends to before the next forward: exactly its committed positions."""
        return range(int(self.lengths[row]))

    def _mask(self, slots: Tensor, kv: int):
        k = torch.arange(kv, device=slots.device)

        def one(window):
            allow = k[None, None, :] <= slots[:, :, None]  # [B, n, kv]: own committed slots + the block
            if window:
                allow = allow & ((slots[:, :, None] - k[None, None, :]) < window)
            return torch.where(allow, 0.0, self._neg).to(self.dtype)[:, None]

        return self._per_kind(one)

    def _padded_forward(self, ids: Tensor, starts: Tensor):
        """Static shapes: ``ids [rows, tokens]`` at slots ``starts[b] + i`` over the whole buffer (masked). The
        slots, write index and mask are derived here from ``starts``: under ``compile`` one graph call per
        (rows, tokens) with two inputs. Returns ``(logits [rows, tokens, V], taps or None)``."""
        slots = starts[:, None] + torch.arange(ids.shape[1], device=ids.device)[None, :]
        self.cache.write_index, self.cache.kv_len = slots, self.cache.capacity
        out = self.model(input_ids=ids, position_ids=slots, attention_mask=self._mask(slots, self.cache.capacity),
                         cache=self.cache, use_cache=True, output_hidden_states=self.taps is not None,
                         logits_to_keep=0)
        return out.logits, (gather_taps(out.hidden_states, self.taps) if self.taps is not None else None)

    @torch.no_grad()
    def forward(self, ids: Tensor, n_real: Tensor | Sequence[int] | None = None,
                last_only: bool = False, pad: bool = True) -> tuple[Tensor, Tensor | None]:
        """Append ``ids [B, n]`` (row b's real tokens first, ``n_real[b]`` of them; default all n) at each row's
        pointer; the pointers advance by ``n_real``. Returns ``(logits [B, n, V] float32, taps [B, n, D] or
        None)``; rows past a row's ``n_real`` are padding (their outputs mean nothing). ``last_only``: logits
        ``[B, 1, V]`` at each row's last real token only (a prefill: the LM head runs on those positions).
        ``pad=False``: never padded to a static shape (a prefill of ragged prompts)."""
        B, n = ids.shape
        if B != self.batch_size:
            raise ValueError(f"batch of {B} rows, the runner holds {self.batch_size}")
        real = torch.full((B,), n, dtype=torch.long, device=self.device) if n_real is None else \
            torch.as_tensor(n_real, dtype=torch.long, device=self.device).reshape(B)
        L = self.lengths
        kv = int(L.max()) + n
        if int((L + real).max()) > self.max_len or kv > self.capacity:
            raise ValueError(f"cache overflow: rows of {L.tolist()} + {n} > max_len {self.max_len}")
        rows_b, n_b = (self.bucket(B), self.bucket(n)) if self.static_shapes and pad else (None, None)
        padded = rows_b is not None and n_b is not None and rows_b <= self.cache.rows and not self._offset
        if self.timing:
            _sync(self.device)
        t0 = time.perf_counter()
        if padded:  # one static shape per (row bucket, token bucket); dummy rows at pointer 0 on free rows
            ids_p = ids.new_zeros((rows_b, n_b))
            ids_p[:B, :n] = ids
            starts = torch.cat([L, L.new_zeros(rows_b - B)])
            self.cache.row_window = (0, rows_b)
            logits, taps = (self._compiled or self._padded_forward)(ids_p.to(self.device), starts)
            self.shapes.add((rows_b, n_b))
            copy = self._compiled is not None and self.device.type == "cuda"  # a graph's outputs are reused
            logits = logits[:B, :n].to(torch.float32, copy=copy)
            taps = None if taps is None else taps[:B, :n].clone() if copy else taps[:B, :n]
            if last_only:
                logits = logits[torch.arange(B, device=logits.device), (real - 1).to(logits.device)][:, None]
        else:
            slots = L[:, None] + torch.arange(n, device=self.device)[None, :]  # [B, n] = positions
            self.cache.write_index, self.cache.kv_len = slots, kv
            self.cache.row_window = (self._offset, self._offset + B)  # the active rows (admit: the newcomers')
            keep = 0
            if last_only:  # the rows' last positions (one set for every row: HF slices the sequence dim)
                keep, where = torch.unique(real - 1, sorted=True, return_inverse=True)
            out = self.model(input_ids=ids.to(self.device), position_ids=slots,
                             attention_mask=self._mask(slots, kv), cache=self.cache, use_cache=True,
                             output_hidden_states=self.taps is not None, logits_to_keep=keep)
            logits = out.logits.float()
            if last_only:  # (a model that ignores logits_to_keep returns every position)
                at = where if logits.shape[1] == keep.numel() else real - 1
                logits = logits[torch.arange(B, device=logits.device), at.to(logits.device)][:, None]
            taps = gather_taps(out.hidden_states, self.taps) if self.taps is not None else None
        if self.timing:
            _sync(self.device)
        self.time_forward += time.perf_counter() - t0
        self.num_forwards += 1
        self._held = L + n  # written (real or padding) up to here: a rollback never goes past it
        self.lengths = L + real
        return logits, taps


def _pad_rows(rows: Sequence[Sequence[int]], device, fill: int = 0) -> tuple[Tensor, Tensor]:
    """Right-padded ``[B, max len]`` LongTensor of ``rows`` and their lengths ``[B]``."""
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), fill, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    return ids.to(device), torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)


# ---------------------------------------------------------------------------------------- proposers
class _BatchNone:
    """AR (``NoDraft``): no drafts, no state."""

    def prefill(self, prompts, taps, firsts) -> None:
        """The state of a new batch of rows ``prompts`` (their taps ``[N, n, D]`` and first tokens)."""

    def admit(self, prompts, taps, firsts) -> None:
        """Continuous batching: append the rows ``prompts`` after the rows held (as ``prefill`` for them)."""

    def propose(self, tokens, ks, sampling):
        return [[] for _ in tokens], [None for _ in tokens]

    def accept(self, tokens, accepted, taps) -> None:
        pass

    def select_rows(self, rows) -> None:
        pass


class _BatchLookup(_BatchNone):
    """Prompt lookup: the batch-1 proposer's n-gram lookup, row by row (stateless)."""

    def __init__(self, proposer: PromptLookupProposer):
        self.proposer = proposer

    def propose(self, tokens, ks, sampling):
        return [list(self.proposer.propose(t, k, sampling)[0]) if k > 0 else [] for t, k in zip(tokens, ks)], \
            [None for _ in tokens]


class _BatchMedusa(_BatchNone):
    """Medusa heads on every row's last verified hidden state ``[B, 1, H]`` (stateless per round)."""

    def __init__(self, proposer: MedusaChainProposer):
        self.heads, self.device, self.dtype = proposer.heads, proposer.device, proposer.dtype
        self._h: Tensor | None = None

    def _set(self, taps: Tensor | None, last: Tensor) -> None:
        if taps is None:
            raise ValueError("Medusa proposers need the target's last hidden state: TargetRunner(taps=(L,))")
        if taps.shape[-1] != self.heads.hidden_size:
            raise ValueError(f"medusa: tap width {taps.shape[-1]} != heads hidden_size {self.heads.hidden_size}")
        rows = torch.arange(taps.shape[0], device=taps.device)
        self._h = taps[rows, last.to(taps.device)].to(self.device, self.dtype)[:, None]  # [B, 1, H]

    def prefill(self, prompts, taps, firsts) -> None:
        self._set(taps, torch.tensor([len(p) - 1 for p in prompts]))

    def admit(self, prompts, taps, firsts) -> None:
        held = self._h
        self.prefill(prompts, taps, firsts)
        self._h = torch.cat([held, self._h]) if held is not None else self._h

    def accept(self, tokens, accepted, taps) -> None:
        self._set(taps, torch.tensor(accepted))

    @torch.no_grad()
    def propose(self, tokens, ks, sampling):
        k = min(max(ks), self.heads.num_heads)
        if k <= 0:
            return super().propose(tokens, ks, sampling)
        top = torch.stack([self.heads.head_logits(self._h, j)[:, 0].argmax(-1) for j in range(k)], 1).tolist()
        return [row[: min(kb, k)] for row, kb in zip(top, ks)], [None for _ in tokens]

    def select_rows(self, rows) -> None:
        self._h = self._h[torch.as_tensor(rows, dtype=torch.long, device=self._h.device)]


def _draft_tokens(z: Tensor, sampling: SamplingParams, qs: list) -> Tensor:
    """One draft per row from logits ``z [B, V]``: the argmax, or a sample of the processed q (kept in ``qs``)."""
    if sampling.greedy:
        return z.argmax(-1)
    q = sampling.process(z)
    qs.append(q)
    return sample(q, sampling.generator)


def _split(drafts: list[Tensor], qs: list[Tensor], ks: Sequence[int]):
    """Per-row drafts (lists, the first ``ks[b]``) and q ``[ks[b], V]`` (None when greedy) from per-step
    ``[B]`` drafts and ``[B, V]`` q: the round's one host read of the drafts."""
    if not drafts:
        return [[] for _ in ks], [None for _ in ks]
    d = torch.stack(drafts, 1).tolist()
    q = torch.stack(qs, 1) if qs else None
    return [row[:k] for row, k in zip(d, ks)], [None if q is None else q[b, :k] for b, k in enumerate(ks)]


class _BatchDraftModel(_BatchNone):
    """A draft causal LM over B rows (a :class:`BatchRunner` of the draft model): each round a row catches up
    on its committed tokens that the draft cache does not hold, then the rows draft one token per forward;
    before the next round each row is rolled back to its longest prefix agreeing with its committed tokens."""

    def __init__(self, proposer: DraftModelProposer, max_len: int, slack: int):
        self.proposer = proposer  # its _to_target_vocab maps the draft logits to the target vocabulary
        self.runner = BatchRunner(proposer.runner.model, None, max_len=max_len, slack=slack,
                                  timing=proposer.runner.timing, **_static_options(proposer.runner))
        self._cached: list[list[int]] = []
        self.rows: int | None = None  # static shapes: the decoder's physical rows

    def prefill(self, prompts, taps, firsts) -> None:
        self.runner.reset(len(prompts), rows=self.rows)
        self._cached = [[] for _ in prompts]  # fed lazily by the first propose, with the pending token

    def admit(self, prompts, taps, firsts) -> None:
        # the newcomers' prompts in a forward of their own (fed with the held rows' one-token catch-ups, a
        # right-padded block would write a prompt's length past every held row's pointer)
        ids, n = _pad_rows(prompts, self.runner.device)
        self.runner.admit(ids, n)
        self._cached.extend(list(p) for p in prompts)

    def _rollback(self, tokens: list[list[int]]) -> list[list[int]]:
        keep = []
        for c, t in zip(self._cached, tokens):
            n, i = min(len(c), len(t) - 1), 0
            while i < n and c[i] == t[i]:
                i += 1
            del c[i:]
            keep.append(i)
        self.runner.set_lengths(keep)
        return [t[i:] for t, i in zip(tokens, keep)]  # every feed holds at least the pending token

    @torch.no_grad()
    def propose(self, tokens, ks, sampling):
        k = max(ks)
        if k <= 0:
            return super().propose(tokens, ks, sampling)
        feed = self._rollback(tokens)
        ids, n = _pad_rows(feed, self.runner.device)
        z = self.runner.forward(ids, n, last_only=True)[0][:, 0]
        drafts, qs = [], []
        for i in range(k):
            drafts.append(_draft_tokens(self.proposer._to_target_vocab(z), sampling, qs))
            if i + 1 < k:
                z = self.runner.forward(drafts[-1][:, None])[0][:, 0]
        for c, f, d in zip(self._cached, feed, torch.stack(drafts, 1)[:, : k - 1].tolist()):
            c.extend(f + d)  # what the draft cache holds now
        return _split(drafts, qs, ks)

    def accept(self, tokens, accepted, taps) -> None:
        self._rollback(tokens)  # the rejected drafts leave every row's view now (not only at the next propose)

    def select_rows(self, rows) -> None:
        self.runner.select_rows(rows)
        self._cached = [self._cached[i] for i in rows]


class _BatchEagle3(_BatchNone):
    """EAGLE-3 chain drafting over B rows with the drafter's own ``step`` (shared write pointer, per-row
    validity mask and positions; see the module docstring). Row b's committed entries are those of the
    batch-1 proposer: entry j = (fused target feature h_j, token x_{j+1}) at position j, for j < n_b."""

    def __init__(self, proposer: Eagle3ChainProposer, capacity: int):
        self.drafter, self.device, self.dtype = proposer.drafter, proposer.device, proposer.dtype
        self.capacity = int(capacity)
        self.compactions = 0
        # several newcomers: their entries built in packed rows (as the target's prefill), not right-padded
        self.packed_prefill, self.packed_row_tokens = True, PACKED_ROW_TOKENS

    def prefill(self, prompts, taps, firsts) -> None:
        """The first rows: a buffer of ``rows`` physical rows (the decoder's; default these), its leading rows
        active (``cache`` is a view of them: :meth:`Eagle3Cache.head`)."""
        self._fresh(prompts, taps, firsts)
        rows = max(int(getattr(self, "rows", None) or 0), len(prompts))
        if rows > len(prompts):
            self._full = self.drafter.new_cache(rows, self.capacity, device=self.device, dtype=self.dtype)
            for full, part in ((self._full.k, self.cache.k), (self._full.v, self.cache.v)):
                for f, x in zip(full, part):
                    f[: len(prompts)] = x
            self._full.length = self.cache.length
            self.cache = self._full.head(len(prompts))
        else:
            self._full = self.cache

    def _fresh(self, prompts, taps, firsts) -> None:
        """Entries of the rows ``prompts`` alone, in a new cache (``self.cache``) and state."""
        if taps is None:
            raise ValueError("Eagle3ChainProposer needs target taps: build the TargetRunner with taps=")
        B, dev = len(prompts), self.device
        self.cache = self.drafter.new_cache(B, self.capacity, device=dev, dtype=self.dtype)
        self.valid = torch.zeros(B, self.capacity, dtype=torch.bool, device=dev)
        self.pos = torch.zeros(B, self.capacity, dtype=torch.long, device=dev)
        seqs = [list(p[1:]) + [int(f)] for p, f in zip(prompts, firsts)]  # entry j: (h_j, x_{j+1})
        if self.packed_prefill and B > 1:
            return self._fresh_packed(seqs, taps)
        ids, lens = _pad_rows(seqs, dev)
        m = ids.shape[1]
        positions = torch.arange(m, device=dev).expand(B, m)
        self._n = torch.zeros(B, dtype=torch.long, device=dev)
        self._rebuild(ids, taps[:, :m], positions, positions < lens[:, None], lens - 1)

    def _fresh_packed(self, seqs: list[list[int]], taps: Tensor) -> None:
        """:meth:`_fresh` in one drafter step over packed rows (:class:`PackedLayout`; a block-diagonal causal
        mask, positions from 0 per prompt), its entries then scattered into the rows' slots ``0 .. n - 1``:
        costs the prompts' tokens, not N x the longest (and the draft LM head runs on as few positions)."""
        dev = self.device
        lay = PackedLayout.of([len(q) for q in seqs], self.packed_row_tokens, dev)
        ids = torch.zeros((lay.R, lay.S), dtype=torch.long, device=dev)
        ids[lay.src] = torch.tensor([t for q in seqs for t in q], dtype=torch.long, device=dev)
        feats = taps.to(dev, self.dtype)[lay.doc, lay.pos]  # [tokens, taps x D]
        hidden = torch.zeros((lay.R, lay.S, feats.shape[-1]), dtype=feats.dtype, device=dev)
        hidden[lay.src] = feats
        hidden = self.drafter.fuse(hidden)
        packed = self.drafter.new_cache(lay.R, lay.S, device=dev, dtype=self.dtype)
        logits, out = self.drafter.step(ids, hidden, packed, position_ids=lay.pos_p, attn_mask=lay.causal())
        for full, part in ((self.cache.k, packed.k), (self.cache.v, packed.v)):
            for f, x in zip(full, part):
                f[lay.doc, :, lay.pos] = x[lay.src[0], :, lay.src[1]]
        self.cache.length = max(len(q) for q in seqs)
        self.valid[lay.doc, lay.pos] = True
        self.pos[lay.doc, lay.pos] = lay.pos
        self._n = torch.tensor([len(q) for q in seqs], dtype=torch.long, device=dev)
        self._next_logits, self._next_hidden = logits[lay.row, lay.end], out[lay.row, lay.end][:, None]

    _STATE = ("valid", "pos", "_n", "_next_logits", "_next_hidden")

    def admit(self, prompts, taps, firsts) -> None:
        """The new rows' entries are built in a cache of their own, then copied into the free rows of the
        fixed buffer after the held rows (the shorter fill's slots past its length are invalid holes)."""
        cache, state, B0 = self.cache, [getattr(self, a) for a in self._STATE], self.cache.batch_size
        self._fresh(prompts, taps, firsts)
        new, N = self.cache, len(prompts)
        if B0 + N > self._full.batch_size:
            raise ValueError(f"{B0} + {N} rows, the draft cache has {self._full.batch_size}")
        for full, part in ((self._full.k, new.k), (self._full.v, new.v)):
            for f, x in zip(full, part):
                f[B0 : B0 + N, :, : new.length] = x[:, :, : new.length]
        for a, held in zip(self._STATE, state):
            setattr(self, a, torch.cat([held, getattr(self, a)]))
        self._full.length = max(cache.length, new.length)
        self.cache = self._full.head(B0 + N)

    def _rebuild(self, ids: Tensor, taps: Tensor, positions: Tensor, real: Tensor, last: Tensor) -> None:
        """Entries from target features (the prompt; a round's accepted tokens); the next round's first draft
        comes from each row's entry ``last``."""
        self._ensure_room(ids.shape[1])
        hidden = self.drafter.fuse(taps.to(self.device, self.dtype))
        logits, out = self._step(ids, hidden, positions, real)
        rows = torch.arange(ids.shape[0], device=self.device)
        self._next_logits, self._next_hidden = logits[rows, last], out[rows, last][:, None]
        self._n = self._n + real.sum(1)

    def _step(self, ids: Tensor, hidden: Tensor, positions: Tensor, real: Tensor):
        """``drafter.step`` on ``m`` new slots per row (real entries first): a query sees its row's valid slots
        and its block's entries up to itself."""
        B, m = ids.shape
        L = self.cache.length
        if L + m > self.capacity:
            raise ValueError(f"draft cache overflow: {L} + {m} > {self.capacity}")
        # a row's real entries come first in its block, so causality alone hides its padding from them
        block = torch.ones(m, m, dtype=torch.bool, device=self.device).tril()[None].expand(B, m, m)
        mask = torch.cat([self.valid[:, None, :L].expand(B, m, L), block], dim=-1)
        out = self.drafter.step(ids, hidden, self.cache, position_ids=positions, attn_mask=mask)
        self.valid[:, L : L + m] = real
        self.pos[:, L : L + m] = torch.where(real, positions, -1)  # bookkeeping (-1: padding)
        return out

    def _ensure_room(self, m: int) -> None:
        """Gather each row's valid entries to the front when ``m`` more slots would not fit."""
        L = self.cache.length
        if L + m <= self.capacity:
            return
        valid = self.valid[:, :L]
        count = valid.sum(1)
        slot = torch.arange(L, device=self.device)
        idx = torch.where(valid, slot, slot + L).sort(1).values[:, : int(count.max())] % L  # valid slots first
        self.cache.keep(idx, start=0)
        C = idx.shape[1]
        self.pos[:, :C] = self.pos.gather(1, idx)
        self.valid[:] = False
        self.valid[:, :C] = torch.arange(C, device=self.device)[None] < count[:, None]
        self.compactions += 1
        if C + m > self.capacity:
            raise ValueError(f"draft cache overflow: {C} entries + {m} > {self.capacity}")

    @torch.no_grad()
    def propose(self, tokens, ks, sampling):
        k = max(ks)
        self._round_start = None
        if k <= 0:
            return super().propose(tokens, ks, sampling)
        self._ensure_room(k + 1)  # the drafts (k - 1 slots), then the rebuild (<= k + 1) from the same start
        self._round_start = self.cache.length
        B = len(tokens)
        logits, hidden = self._next_logits, self._next_hidden
        drafts, qs = [], []
        ones = torch.ones(B, 1, dtype=torch.bool, device=self.device)
        for i in range(k):
            drafts.append(_draft_tokens(self.drafter.logits_to_target(logits.float()), sampling, qs))
            if i + 1 < k:
                out, hidden = self._step(drafts[-1][:, None].to(self.device), hidden, (self._n + i)[:, None], ones)
                logits = out[:, -1]
        return _split(drafts, qs, ks)

    @torch.no_grad()
    def accept(self, tokens, accepted, taps) -> None:
        if taps is None:
            raise ValueError("Eagle3ChainProposer.accept needs the target taps at [pending, d_1..d_a]")
        if self._round_start is not None:  # drop the round's draft entries
            self.cache.truncate(self._round_start)
            self.valid[:, self._round_start :] = False
        a = torch.tensor(accepted, dtype=torch.long, device=self.device)
        m = int(a.max()) + 1
        ids, _ = _pad_rows([t[-(int(x) + 1) :] for t, x in zip(tokens, accepted)], self.device)  # d_1..d_a, b
        step = torch.arange(m, device=self.device)[None]
        self._rebuild(ids, taps[:, :m], self._n[:, None] + step, step <= a[:, None], a)

    def select_rows(self, rows) -> None:
        keep = [int(r) for r in rows]
        dst, src = _moves(keep)
        if dst:
            for t in (*self._full.k, *self._full.v):
                t[dst] = t[src]
        self._full.length = self.cache.length
        self.cache = self._full.head(len(keep))
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.valid, self.pos, self._n = self.valid[idx], self.pos[idx], self._n[idx]
        self._next_logits, self._next_hidden = self._next_logits[idx], self._next_hidden[idx]


def _static_options(runner: TargetRunner) -> dict:
    """A batch-1 runner's static-shape options for its :class:`BatchRunner` (compile: it compiled its own)."""
    return dict(static_shapes=runner.static_shapes, buckets=runner.buckets,
                compile=runner.static_shapes and runner._compiled_chain is not None)


def _batch_proposer(proposer, max_len: int, K: int):
    """The batched state of a batch-1 chain proposer (its drafter / heads / model / n-gram rule are reused)."""
    if getattr(proposer, "tree", False):
        raise DraftTrainError(f"{CHAIN_ONLY}: proposer {proposer.name!r} drafts trees (set decode.tree.enabled=false)")
    if isinstance(proposer, NoDraft):
        return _BatchNone()
    if isinstance(proposer, PromptLookupProposer):
        return _BatchLookup(proposer)
    if isinstance(proposer, MedusaChainProposer):
        return _BatchMedusa(proposer)
    if isinstance(proposer, Eagle3ChainProposer):
        return _BatchEagle3(proposer, capacity=max_len + 2 * K + 8)
    if isinstance(proposer, DraftModelProposer):
        return _BatchDraftModel(proposer, max_len=max_len + K + 1, slack=K + 8)
    if hasattr(proposer, "batched"):  # a family's own batched state, beside its batch-1 proposer (DFlash)
        return proposer.batched(max_len, K)
    raise DraftTrainError(f"{CHAIN_ONLY}: no batched version of proposer {getattr(proposer, 'name', proposer)!r}")


def _verify_greedy(ids: Tensor, n: Tensor, logits: Tensor) -> list[tuple[int, int]]:
    """``verify_chain_greedy`` for every row at once (one host sync): row b verified ``[pending, d_1..d_k]`` =
    ``ids[b, :n[b]]`` with ``logits [B, N, V]``; returns ``(a, target argmax after d_a)`` per row."""
    am = logits.argmax(-1)  # [B, N]
    N = ids.shape[1]
    real = torch.arange(1, N, device=ids.device)[None] < n[:, None]  # the drafts of each row
    a = torch.cumprod(((ids[:, 1:] == am[:, :-1]) & real).long(), dim=1).sum(1)
    return [tuple(v) for v in torch.stack([a, am.gather(1, a[:, None])[:, 0]], 1).tolist()]


# ------------------------------------------------------------------------------------------ decoder
@dataclass
class BatchGenerationResult:
    """The outputs of one :meth:`BatchSpecDecoder.generate` call: one ``GenerationResult`` per prompt (input
    order) and the batch's wall time."""

    results: list[GenerationResult]
    time_total: float = 0.0
    batch_size: int = 0  # the most rows decoded together
    rounds: int = 0  # batched verify rounds (target forwards of the active rows)
    prefills: int = 0  # admissions (target forwards of newcomers' prompts)
    row_rounds: int = 0  # sum over the rounds of the rows in them (row_rounds / rounds: the mean batch)
    time_draft: float = 0.0  # the drafter's seconds, the whole call
    time_prefill: float = 0.0  # the admissions' seconds (prompts' prefill, first tokens, the drafter's priming)

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after each row's first, per second outside the admissions: the decode phase's throughput."""
        n = sum(max(len(r.tokens) - 1, 0) for r in self.results)
        t = self.time_total - self.time_prefill
        return n / t if t > 0 and n else None

    @property
    def tokens(self) -> list[list[int]]:
        return [r.tokens for r in self.results]

    def summary(self) -> dict:
        """The rows' statistics pooled (:func:`~drafttrain.decoding.engine.aggregate`)."""
        return aggregate(self.results)


class BatchSpecDecoder:
    """Chain speculative decoding of B prompts at once around the batch-1 parts (see the module docstring).

    Args: as :class:`~drafttrain.decoding.engine.SpecDecoder` (the same validation; ``typical`` is refused);
    ``target``'s model, taps and ``max_len`` (per row) are reused by a :class:`BatchRunner`, ``proposer``'s
    drafter / heads / draft model / n-gram rule by its batched state. ``packed_prefill``, ``packed_row_tokens``:
    several newcomers' prompts are prefilled in one unpadded forward, balanced over packed rows of about that
    many tokens (:meth:`BatchRunner.admit`; false: right-padded).
    """

    def __init__(self, target: TargetRunner, proposer, num_draft_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, typical: bool = False,
                 draft_temperature: float | None = None, packed_prefill: bool = True,
                 packed_row_tokens: int = PACKED_ROW_TOKENS):
        from .engine import SpecDecoder

        if typical and temperature > 0:
            raise DraftTrainError("decode.batch_size>1 does not support typical acceptance (decode.typical=true)")
        # the batch-1 decoder's checks, sampling parameters, generator and verification rule
        self.one = SpecDecoder(target, proposer, num_draft_tokens, temperature, top_k, top_p, seed,
                               draft_temperature=draft_temperature)
        self.K, self.sampling, self.generator = self.one.K, self.one.sampling, self.one.generator
        self.target = BatchRunner(target.model, target.taps, max_len=target.max_len, slack=self.K + 8,
                                  timing=target.timing, packed_prefill=packed_prefill,
                                  packed_row_tokens=packed_row_tokens, **_static_options(target))
        self.proposer = _batch_proposer(proposer, target.max_len, self.K)
        if isinstance(self.proposer, _BatchDraftModel):
            self.proposer.runner.packed_prefill = bool(packed_prefill)
            self.proposer.runner.packed_row_tokens = int(packed_row_tokens)
        if isinstance(self.proposer, _BatchEagle3):
            self.proposer.packed_prefill, self.proposer.packed_row_tokens = bool(packed_prefill), int(packed_row_tokens)
        self._time_draft = 0.0

    def _timed(self, fn, *args):
        if self.target.timing:
            _sync(self.target.device)
        t0 = time.perf_counter()
        out = fn(*args)
        if self.target.timing:
            _sync(self.target.device)
        self._time_draft += time.perf_counter() - t0
        return out

    def _after_round(self, rows: list[int], tokens: dict[int, list[int]]) -> None:
        """Called after each verify round (and after the prefill) with the active rows (prompt indices, in
        batch order) and every prompt's committed tokens (the pending one last); a hook for checks."""

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 eos_token_id: int | Iterable[int] | None = None, seed: int | None = None,
                 grammar=None, batch_size: int | None = None, admit_min: int = 0) -> BatchGenerationResult:
        """Decode every prompt (up to its ``max_new_tokens``: one int or one per prompt; stops after eos).
        ``seed`` re-seeds the generator first. ``grammar`` is refused (batch 1 only).

        ``batch_size``: at most that many rows decode together, the other prompts wait in input order and a
        row that finishes is refilled by the next one (continuous batching: the newcomers are prefilled in a
        forward of their own and join the next round). None: every prompt in one batch.

        ``admit_min``: newcomers are admitted once at least that many rows are free (or every waiting prompt
        fits, or no row is active), so one prefill forward serves several of them: a forward's fixed cost is
        paid once per admission, against rows left idle until then. 1: refill at once; 0: a quarter of the
        batch (at least 1)."""
        if grammar is not None:
            raise DraftTrainError("decode.batch_size>1 does not support grammar-constrained decoding (decode.grammar)")
        if batch_size is not None and int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if seed is not None:
            self.generator.manual_seed(seed)
        prompts = [[int(t) for t in p] for p in prompts]
        if any(not p for p in prompts):
            raise ValueError("empty prompt")
        limits = [int(max_new_tokens)] * len(prompts) if isinstance(max_new_tokens, int) else \
            [int(m) for m in max_new_tokens]
        if len(limits) != len(prompts):
            raise ValueError(f"{len(limits)} max_new_tokens for {len(prompts)} prompts")
        width = len(prompts) if batch_size is None else int(batch_size)
        K, eos = self.K, _stop_tokens(eos_token_id, None)
        results = [GenerationResult(tokens=[], drafted_per_position=[0] * K, reached_per_position=[0] * K,
                                    accepted_per_position=[0] * K) for _ in prompts]
        t_start, t_target0, self._time_draft = time.perf_counter(), self.target.time_forward, 0.0
        waiting = deque(b for b, m in enumerate(limits) if m > 0)
        tokens = {b: list(p) for b, p in enumerate(prompts)}
        rows: list[int] = []
        stats = {"rounds": 0, "prefills": 0, "row_rounds": 0, "time_prefill": 0.0}
        phys = (self.target.bucket(width) if self.target.static_shapes else None) or width  # physical rows
        self.target.reset(0, rows=phys)
        self.proposer.rows = phys
        need = min(int(admit_min) if admit_min else max(1, width // 4), width)
        while rows or waiting:
            free = width - len(rows)
            if waiting and free > 0 and (free >= min(need, len(waiting)) or not rows):
                new = [waiting.popleft() for _ in range(min(width - len(rows), len(waiting)))]
                t0 = time.perf_counter()
                rows = self._admit(rows, new, prompts, tokens, results, limits, eos)
                stats["time_prefill"] += time.perf_counter() - t0
                stats["prefills"] += 1
                continue  # rows that ended at their first token are refilled before the next round
            stats["rounds"] += 1
            stats["row_rounds"] += len(rows)
            rows = self._round(rows, tokens, results, limits, eos)
        wall = time.perf_counter() - t_start
        share = 1.0 / max(len(prompts), 1)
        for r in results:
            r.time_total, r.time_draft = wall * share, self._time_draft * share
            r.time_target = (self.target.time_forward - t_target0) * share
        return BatchGenerationResult(results, wall, batch_size=width, time_draft=self._time_draft, **stats)

    def _admit(self, rows, new, prompts, tokens, results, limits, eos) -> list[int]:
        """The target reads the prompts ``new`` (right-padded, in a forward of their own) and produces each
        one's first (pending) token; they join the active rows after ``rows``."""
        sp = self.sampling
        ids, lens = _pad_rows([prompts[b] for b in new], self.target.device)
        first_batch = not rows and self.target.batch_size == 0
        logits, taps = self.target.admit(ids, lens)
        last = logits[:, 0]
        first = (last.argmax(-1) if sp.greedy else sample(sp.process(last), self.generator)).tolist()
        done = [False] * len(rows)
        for b, tok in zip(new, first):
            tokens[b].append(tok)
            results[b].tokens.append(tok)
            done.append(tok in eos or limits[b] <= 1)
        self._timed(self.proposer.prefill if first_batch else self.proposer.admit, [prompts[b] for b in new], taps,
                    first)
        rows = rows + list(new)
        self._after_round(rows, tokens)
        return self._drop(rows, done)

    def _drop(self, rows: list[int], done: list[bool]) -> list[int]:
        """Finished rows leave the batch: their rows are dropped from every cache by index."""
        if not any(done):
            return rows
        keep = fill_holes(done)
        self.target.select_rows(keep)
        self.proposer.select_rows(keep)
        return [rows[i] for i in keep]

    def _verify_rows(self, drafts: list[list[int]], qs: list, logits: Tensor) -> list[tuple[int, int]]:
        """``(a, next token)`` per row by the batch-1 decoder's rule (rejection sampling with its generator)."""
        out = []
        for i, row in enumerate(drafts):
            d = torch.tensor(row, dtype=torch.long, device=logits.device)
            q = qs[i] if qs[i] is None or qs[i].shape[0] else None
            out.append(tuple(int(x) for x in self.one._verify_chain(d, q, logits[i, : len(row) + 1])))
        return out

    def _round(self, rows, tokens, results, limits, eos) -> list[int]:
        """One verify round for the active rows: draft, verify every row's chain in one batched target
        forward, roll each row back by index to its own accepted length."""
        target = self.target
        held = target.lengths.tolist()
        room = [target.max_len - n - 1 for n in held]  # positions left after the pending token
        if min(room) < 0:  # a full row ends (as at batch 1)
            rows = self._drop(rows, [r < 0 for r in room])
            return self._round(rows, tokens, results, limits, eos) if rows else rows
        ks = [max(0, min(self.K, limits[b] - len(results[b].tokens) - 1, r)) for b, r in zip(rows, room)]
        drafts, qs = self._timed(self.proposer.propose, [tokens[b] for b in rows], ks, self.one.draft_sampling)
        drafts = [list(d)[:k] for d, k in zip(drafts, ks)]
        ids, n = _pad_rows([[tokens[b][-1]] + d for b, d in zip(rows, drafts)], target.device)
        logits, taps = target.forward(ids, n)
        verdicts = _verify_greedy(ids, n, logits) if self.sampling.greedy else self._verify_rows(drafts, qs, logits)
        accepted, done = [], []
        for i, (b, (a, bonus)) in enumerate(zip(rows, verdicts)):
            accepted.append(a)
            _record_round(results[b], len(drafts[i]), len(drafts[i]), a, drafts[i][:a], eos)
            committed = drafts[i][:a] + [bonus]
            tokens[b].extend(committed)
            done.append(_commit(results[b], committed, eos) or len(results[b].tokens) >= limits[b])
        target.set_lengths([h + 1 + a for h, a in zip(held, accepted)])  # pending + accepted drafts, per row
        self._timed(self.proposer.accept, [tokens[b] for b in rows], accepted, taps)
        self._after_round(rows, tokens)
        return self._drop(rows, done)


__all__ = ["BatchGenerationResult", "BatchRunner", "BatchSpecDecoder", "CHAIN_ONLY", "RowKVCache"]
