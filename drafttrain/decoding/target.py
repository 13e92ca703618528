"""TargetRunner: an HF causal LM behind a KV cache that rolls back and compacts by index, plus hidden-state taps.

Batch size 1 only (one sequence per runner), which is what speculative decoding at batch 1 needs.

Two caches sit behind the same interface (``length`` / ``truncate(n)`` / ``keep(indices, start)`` /
``reset()``):

- ``static`` (default where supported): :class:`StaticKVCache`, per-layer K/V buffers
  ``[1, Hkv, capacity, D]`` allocated once (at the first forward) and reused for every sequence. A forward
  writes its new K/V at explicit indices (``index_copy_``), rollback only moves ``length``, and an accepted
  tree path is compacted by ``index_select`` into the slots after the kept prefix: no per-step
  reallocation. The runner always passes its own 4D additive attention mask (causal, tree, and sliding
  windows by *position*, so sliding-window layers keep their full past and roll back anywhere); the model
  never builds one. Needs ``attn_implementation`` eager or sdpa (a custom 4D mask) and attention layers
  that call ``cache.update`` (every standard HF decoder).
- ``dynamic`` (fallback): HF ``DynamicCache`` cropped on rollback. Tree verification with it is supported
  for models without sliding-window layers (compaction by ``index_select`` on each layer's tensors).

``static_shapes=True`` (the CUDA-graph path) pads every verify forward to a fixed bucket of positions and
attends over the whole buffer (masked), so each bucket has one static shape; ``compile=True`` wraps that
forward in ``torch.compile`` (on CUDA ``mode="reduce-overhead"``: CUDA graphs; on CPU inductor with its C++
wrapper; see :func:`compile_static`). A chain forward (a decode step, a chain verify) takes only the padded
tokens and a 0-d start slot: positions, write index and causal / sliding-window masks are computed inside
the graph. :meth:`TargetRunner.greedy_chain` runs a draft model's catch-up forward and its K - 1 greedy draft
steps as one call (one graph). The same padded code runs eagerly on CPU, where it is tested.
"""
from __future__ import annotations

import time
import types
from typing import Sequence

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from ..targets.attention import NAME as GROUPED_SDPA
from ..targets.load import gather_taps, text_config

# static_shapes: the padded forward sizes by default (drafttrain.config.DEFAULT_BUCKETS, the configs' default, is
# the same tuple; tests/test_decoding.py checks it)
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _module_structure_guard(entry) -> bool:
    """Guard filter for :func:`compile_static`: False (skip) for a non-tensor guard on an ``nn.Module``'s
    Python structure (module and config types and flags, submodule dicts); True for every other guard:
    tensor guards (inputs, parameters and buffers: shape, dtype, device, strides), the KV cache's attributes,
    globals, grad mode."""
    return entry.guard_type == "TENSOR_MATCH" or not entry.orig_guard.source.is_unspecialized_nn_module()


def compile_static(fn, device: torch.device):
    """``torch.compile`` for a function whose shapes never change: CUDA graphs on CUDA
    (``mode="reduce-overhead"``); on CPU inductor's default mode with its C++ wrapper (fused C++ kernels
    called from C++: far less Python overhead per forward). One compilation per input shape (per bucket),
    paid at warm-up.

    Per-call overhead matters here (a draft step of a small model is a fraction of a millisecond), so:

    - ``fn`` is compiled from its own copy of its code object. Dynamo keeps its graphs and guards per code
      object, so this owner's cache holds only its own graphs: no lookup walks another runner's entries (the
      target's and the draft's runners share ``TargetRunner._raw_forward``).
    - With that, guards on the model's Python structure are skipped (:func:`_module_structure_guard`): the
      owner never swaps its model, and these are most of the ~1000 guards an HF model gets. Tensor guards,
      parameters included, stay.
    """
    import torch._dynamo

    # one graph per (owner, bucket): allow more than dynamo's default of 8 before it falls back to eager
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    func = getattr(fn, "__func__", fn)
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    own.__kwdefaults__, own.__qualname__ = func.__kwdefaults__, func.__qualname__
    if own.__code__ is func.__code__:  # pragma: no cover - CPython always copies
        raise RuntimeError("code.replace() returned the same code object")
    if hasattr(fn, "__self__"):
        own = types.MethodType(own, fn.__self__)
    options = {"guard_filter_fn": lambda entries: [_module_structure_guard(e) for e in entries]}
    if device.type == "cuda":
        return torch.compile(own, mode="reduce-overhead", dynamic=False, options=options)
    return torch.compile(own, dynamic=False, options={**options, "cpp_wrapper": True})


# ----------------------------------------------------------------------------------------- static cache
class _IndexedLayer(CacheLayerMixin):
    """One layer of :class:`StaticKVCache`: writes at ``cache.write_index``, returns ``[:, :, :cache.kv_len]``."""

    is_compileable = True
    is_croppable = True
    is_sliding = False  # windows are applied by the runner's mask, by position

    def __init__(self, owner: "StaticKVCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        B, H, _, Dk = key_states.shape
        cap = self.owner.capacity
        self.device = key_states.device
        self.keys = torch.zeros((B, H, cap, Dk), dtype=key_states.dtype, device=self.device)
        self.values = torch.zeros((B, H, cap, value_states.shape[-1]), dtype=value_states.dtype, device=self.device)
        if not torch.compiler.is_compiling():
            # fixed addresses: a CUDA graph may then mutate the buffers in place without copying them
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        idx = self.owner.write_index
        self.keys.index_copy_(2, idx, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, idx, value_states.to(self.values.dtype))
        kv = self.owner.kv_len
        return self.keys[:, :, :kv], self.values[:, :, :kv]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv_len, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.capacity

    def reset(self) -> None:  # buffers are reused; nothing past ``length`` is ever read
        pass


class StaticKVCache(Cache):
    """Preallocated K/V for every layer of an HF decoder (see the module docstring).

    The runner sets ``write_index`` (LongTensor ``[n]``: the slots the next forward writes) and ``kv_len``
    (how many leading slots attention reads) before each forward.
    """

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[_IndexedLayer(self) for _ in range(num_layers)])
        self.capacity = int(capacity)
        self.length = 0
        self.kv_len = 0
        self.write_index: Tensor | None = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def keep(self, src: Tensor, start: int, kept: int) -> None:
        """Move the slots ``src [kept]`` (absolute, all >= start) to ``start .. start+kept-1``."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[:, :, start : start + kept] = layer.keys.index_select(2, src)
                layer.values[:, :, start : start + kept] = layer.values.index_select(2, src)


def _layer_kinds(cfg) -> tuple[list[str] | None, int | None]:
    """(per-layer kinds "full"/"sliding", or None when unsupported; the sliding window or None)."""
    n = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        kinds = []
        for t in types:
            if t == "full_attention":
                kinds.append("full")
            elif t == "sliding_attention" and window:
                kinds.append("sliding")
            else:
                return None, None
        return kinds, (int(window) if window else None)
    if window:  # Mistral-style configs: every layer uses the window
        return ["sliding"] * n, int(window)
    return ["full"] * n, None


def static_cache_support(model) -> str | None:
    """None if the static cache can run ``model``; otherwise the reason it cannot."""
    cfg = text_config(model.config)
    impl = getattr(model.config, "_attn_implementation", None) or getattr(cfg, "_attn_implementation", None)
    if impl not in ("eager", "sdpa", GROUPED_SDPA):
        return f"attn_implementation={impl!r} takes no custom 4D mask (need eager or sdpa)"
    kinds, _ = _layer_kinds(cfg)
    if kinds is None:
        return f"layer types {sorted(set(getattr(cfg, 'layer_types', []) or []))} are not plain full/sliding attention"
    if not hasattr(model, "get_output_embeddings"):
        return "not a causal LM"
    return None


class TargetRunner:
    """Runs the target model incrementally: position ``length`` is the next one to be written.

    Args:
        model: any HF causal LM (put in eval mode; no gradients are taken).
        taps: indices into HF's ``hidden_states`` tuple (0 = embeddings, j = output of layer j-1) whose
            rows are concatenated, in this order, into the tap features; None = no taps (and no
            ``output_hidden_states``).
        max_len: the most positions the cache may hold (default: the model's
            ``max_position_embeddings``; the static cache allocates this many slots, so pass what a run
            needs).
        cache: "auto" (static where :func:`static_cache_support` allows, else dynamic), "static" or
            "dynamic".
        static_shapes: pad verify forwards to fixed buckets and attend over the whole buffer (static
            cache only): one shape per bucket, as CUDA graphs need.
        buckets: the padded sizes for ``static_shapes`` (a forward of n positions uses the smallest
            bucket >= n; longer ones, e.g. the prefill, run unpadded).
        compile: with ``static_shapes``, run the padded forward through ``torch.compile`` (CUDA graphs via
            ``mode="reduce-overhead"`` on CUDA, inductor's default mode on CPU); see :func:`compile_static`.
        timing: synchronise around each forward to measure ``time_forward`` (one extra device sync per
            forward on CUDA; turn off for pure throughput runs).
    """

    def __init__(self, model, taps: tuple[int, ...] | None = None, max_len: int | None = None,
                 cache: str = "auto", static_shapes: bool = False, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 compile: bool = False, timing: bool = True):
        self.model = model.eval()
        self.taps = tuple(int(t) for t in taps) if taps else None
        cfg = text_config(model.config)
        self.config = cfg
        self.vocab_size = int(cfg.vocab_size)
        self.max_len = int(max_len if max_len is not None else getattr(cfg, "max_position_embeddings", 1 << 16))
        if self.taps is not None:
            n_states = int(cfg.num_hidden_layers) + 1
            bad = [t for t in self.taps if not 0 <= t < n_states]
            if bad:
                raise ValueError(f"taps {bad} out of range: hidden_states has {n_states} entries")
        if cache not in ("auto", "static", "dynamic"):
            raise ValueError(f"cache must be auto, static or dynamic (got {cache!r})")
        why = static_cache_support(model)
        if cache == "static" and why:
            raise ValueError(f"static cache unsupported for this model: {why}")
        self.cache_kind = "static" if (cache != "dynamic" and why is None) else "dynamic"
        self.static_shapes = bool(static_shapes) and self.cache_kind == "static"
        self.buckets = sorted(int(b) for b in buckets)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.timing = bool(timing)
        self.time_forward = 0.0  # seconds spent in forward(), accumulated over the runner's life
        self.num_forwards = 0
        kinds, self.window = _layer_kinds(cfg)
        self._kinds = kinds or []
        self._mixed = len(set(self._kinds)) > 1
        self._sliding = "sliding" in self._kinds
        if self.cache_kind == "static":
            slack = self.buckets[-1] if self.static_shapes else 0  # padded rows write past the end
            self._kv = StaticKVCache(int(cfg.num_hidden_layers), self.max_len + slack)
            self._neg = torch.finfo(self.dtype if self.dtype.is_floating_point else torch.float32).min
        self._compiled = self._compiled_chain = self._compiled_greedy = None
        if compile and self.static_shapes:
            self._compiled = compile_static(self._raw_forward, self.device)  # tree verifies
            self._compiled_chain = compile_static(self._chain_forward, self.device)  # steps, chain verifies
            self._compiled_greedy = compile_static(self._greedy_chain, self.device)  # greedy draft chains
        self.reset()

    # ------------------------------------------------------------------------------------------ state
    @property
    def length(self) -> int:
        """Number of positions held by the cache."""
        return self._length

    def reset(self) -> None:
        """Empty the cache (start a new sequence). The static cache keeps its buffers."""
        if self.cache_kind == "static":
            self.cache = self._kv
            self._kv.length = 0
        else:
            self.cache = DynamicCache(config=self.model.config)
            self._dyn_sliding = any(getattr(layer, "is_sliding", False) for layer in self.cache.layers)
            if self._dyn_sliding:
                # keep past states until crop() so a rollback past the window's edge stays possible
                self.cache.activate_past_recording()
        self._length = 0

    def _set_length(self, n: int) -> None:
        self._length = n
        if self.cache_kind == "static":
            self._kv.length = n

    # ------------------------------------------------------------------------------------------ masks
    def _mask(self, q_pos: Tensor, tree: Tensor | None, n: int, kv: int, window: int | None) -> Tensor:
        """Additive mask ``[1, 1, n_rows, kv]`` for ``n`` new positions at slots ``[L, L+n)``.

        q_pos ``[n_rows]`` = positions of the query rows (rows >= n are padding); ``tree`` = bool ``[n, n]``
        (row i may attend to new slot j), or None for causal. Old slots j < L have position j.
        """
        L = self._length
        rows = q_pos.shape[0]
        dev = q_pos.device
        if tree is None and not window:
            # plain causal chain, padded or not: row r (slot L + r) sees slots <= L + r. Padding rows see
            # their own padding slots too, which only affects their own (discarded) outputs.
            if rows == 1 and kv == L + 1:
                return torch.zeros(1, 1, 1, kv, dtype=self.dtype, device=dev)
            allow = self._slots(kv, dev)[None, :] <= (L + self._slots(rows, dev))[:, None]
            return torch.where(allow, 0.0, self._neg).to(self.dtype)[None, None]
        k_slot = torch.arange(kv, device=dev)
        allow = (k_slot[None, :] < L).expand(rows, kv).clone()  # the committed prefix
        if window:
            allow &= (q_pos[:, None] - k_slot[None, :]) < window
        new = torch.zeros(rows, kv - L, dtype=torch.bool, device=dev)
        if tree is None:
            new[:n, :n] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        else:
            new[:n, :n] = tree
        if window:
            k_pos_new = q_pos[: kv - L] if rows >= kv - L else torch.cat(
                [q_pos, q_pos.new_zeros(kv - L - rows)])
            new &= (q_pos[:, None] - k_pos_new[None, :]) < window
        allow[:, L:] = new
        if rows > n:  # padding rows attend to their own slot only (no NaN, no effect on real rows)
            pad = torch.arange(n, rows, device=dev)
            allow[pad] = False
            allow[pad, L + pad] = True
        m = torch.zeros(rows, kv, dtype=self.dtype, device=dev).masked_fill_(~allow, self._neg)
        return m[None, None]

    def _slots(self, n: int, dev) -> Tensor:
        """``arange(n)`` on the device, cached (the capacity-sized one is used by every padded forward)."""
        cache = self.__dict__.setdefault("_slots_cache", {})
        if n not in cache:
            cache[n] = torch.arange(n, device=dev)
        return cache[n]

    def _mask_arg(self, q_pos, tree, n, kv):
        if not self._sliding:
            return self._mask(q_pos, tree, n, kv, None)
        if not self._mixed:
            return self._mask(q_pos, tree, n, kv, self.window)
        return {"full_attention": self._mask(q_pos, tree, n, kv, None),
                "sliding_attention": self._mask(q_pos, tree, n, kv, self.window)}

    # ------------------------------------------------------------------------------------------ forward
    def _raw_forward(self, ids: Tensor, pos: Tensor, mask, logits_to_keep: int):
        out = self.model(
            input_ids=ids, position_ids=pos, attention_mask=mask, cache=self.cache, use_cache=True,
            output_hidden_states=self.taps is not None, logits_to_keep=logits_to_keep,
        )
        taps = None
        if self.taps is not None:
            taps = gather_taps(out.hidden_states, self.taps)[0]
        return out.logits[0], taps

    def _chain_forward(self, ids: Tensor, start: Tensor):
        """Padded chain forward of ``ids [1, bucket]`` at slots and positions ``start + r`` (a committed slot
        holds the position of its index): the write index, positions and causal (and sliding-window) mask
        are computed here from the 0-d ``start``, so under ``compile`` a decode step or chain verify is one
        graph call with two inputs. Padding rows attend causally to their own slots (no effect on real rows)."""
        rows = ids.shape[1]
        q = start + torch.arange(rows, device=ids.device)
        self._kv.write_index = q
        k = torch.arange(self._kv.capacity, device=ids.device)

        def mask(window):
            allow = k[None, :] <= q[:, None]
            if window:
                allow = allow & ((q[:, None] - k[None, :]) < window)
            return torch.where(allow, 0.0, self._neg).to(self.dtype)[None, None]

        if not self._sliding:
            m = mask(None)
        elif not self._mixed:
            m = mask(self.window)
        else:
            m = {"full_attention": mask(None), "sliding_attention": mask(self.window)}
        return self._raw_forward(ids, q[None], m, 0)

    def _greedy_chain(self, ids: Tensor, start: Tensor, last: Tensor, k: int, vocab: int) -> Tensor:
        """Padded forward of ``ids [1, bucket]`` at ``start`` (real rows up to index ``last``, 0-d), then
        ``k - 1`` greedy steps, each feeding the previous argmax: ``k`` tokens ``[k]`` (argmax over the first
        ``vocab`` logits). One graph per (bucket, k) under ``compile``."""
        logits, _ = self._chain_forward(ids, start)
        d = logits.index_select(0, last.reshape(1))[:, :vocab].argmax(-1)  # [1]
        out = [d]
        pos = start + last + 1
        for _ in range(k - 1):
            logits, _ = self._chain_forward(d[None], pos)
            d = logits[:, :vocab].argmax(-1)
            out.append(d)
            pos = pos + 1
        return torch.cat(out)

    @torch.no_grad()
    def greedy_chain(self, input_ids: Tensor | list[int], k: int, vocab: int | None = None) -> Tensor:
        """Append ``input_ids`` (n tokens), then draft ``k`` tokens greedily, feeding all but the last one:
        afterwards ``length`` grew by ``n + k - 1``. Returns the ``k`` drafts (a device tensor: no host sync).

        ``vocab``: take each argmax over the first ``vocab`` logits only (a draft whose vocabulary is larger
        than the target's). With ``static_shapes`` (the static cache, n within a bucket) the whole chain is
        one function call, under ``compile`` one graph (one CUDA graph on CUDA); otherwise ``k`` forwards."""
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(-1)
        n, L = ids.shape[0], self._length
        vocab = self.vocab_size if vocab is None else min(int(vocab), self.vocab_size)
        if k < 1 or n < 1:
            raise ValueError(f"greedy_chain needs n >= 1 tokens and k >= 1 drafts (got n={n}, k={k})")
        if L + n + k - 1 > self.max_len:
            raise ValueError(f"cache overflow: {L} + {n} + {k - 1} > max_len {self.max_len}")
        bucket = next((b for b in self.buckets if b >= n), None) if self.static_shapes else None
        if bucket is None:
            logits, _ = self.forward(ids, last_only=True)
            out = [logits[-1, :vocab].argmax(-1, keepdim=True)]
            for _ in range(k - 1):
                logits, _ = self.forward(out[-1])
                out.append(logits[-1, :vocab].argmax(-1, keepdim=True))
            return torch.cat(out)
        dev = self.device
        ids_p = ids if bucket == n else torch.cat([ids, ids.new_zeros(bucket - n)])
        self._kv.kv_len = self._kv.capacity
        slots = self._slots(self._kv.capacity, dev)
        if self.timing:
            _sync(dev)
        t0 = time.perf_counter()
        fn = self._compiled_greedy or self._greedy_chain
        drafts = fn(ids_p[None], slots[L], slots[n - 1], int(k), vocab)
        if self._compiled_greedy is not None and dev.type == "cuda":
            drafts = drafts.clone()  # a CUDA graph's output is overwritten by its next replay
        if self.timing:
            _sync(dev)
        self.time_forward += time.perf_counter() - t0
        self.num_forwards += k
        self._set_length(L + n + k - 1)
        return drafts

    @torch.no_grad()
    def _run(self, ids: Tensor, depth: Tensor | None, tree: Tensor | None, last_only: bool):
        n = ids.shape[0]
        L = self._length
        if L + n > self.max_len:
            raise ValueError(f"target cache overflow: {L} + {n} > max_len {self.max_len}")
        dev = self.device
        bucket = next((b for b in self.buckets if b >= n), None) if self.static_shapes else None
        # a padded chain forward derives its positions inside the graph
        pos = None if bucket is not None and tree is None else (
            (torch.arange(n, device=dev) if depth is None else depth.to(dev)) + L)
        if self.timing:
            _sync(dev)
        t0 = time.perf_counter()
        if self.cache_kind == "dynamic":
            if tree is not None and self._dyn_sliding:
                raise ValueError("tree verification with sliding-window layers needs the static cache")
            mask = None
            if tree is not None:  # 4D additive mask over [cache, new]
                allow = torch.ones(n, L + n, dtype=torch.bool, device=dev)
                allow[:, L:] = tree
                mask = torch.zeros(n, L + n, dtype=self.dtype, device=dev).masked_fill_(
                    ~allow, torch.finfo(self.dtype).min)[None, None]
            out = self.model(input_ids=ids[None], position_ids=pos[None], attention_mask=mask, cache=self.cache,
                             use_cache=True, output_hidden_states=self.taps is not None,
                             **({"logits_to_keep": 1} if last_only else {}))
            logits = out.logits[0, -1:] if last_only else out.logits[0]
            taps = None
            if self.taps is not None:
                taps = gather_taps(out.hidden_states, self.taps)[0]
        else:
            if bucket is not None:
                pad = bucket - n
                ids_p = ids if pad == 0 else torch.cat([ids, ids.new_zeros(pad)])
                self._kv.kv_len = self._kv.capacity
                if tree is None:
                    # everything but the tokens is derived from L inside the (compiled) function: a 0-d
                    # view of the device's slot numbers, no host-to-device copy
                    fn = self._compiled_chain or self._chain_forward
                    logits, taps = fn(ids_p[None], self._slots(self._kv.capacity, dev)[L])
                else:
                    pos_p = torch.cat([pos, pos.new_full((pad,), L)])
                    self._kv.write_index = torch.arange(L, L + bucket, device=dev)
                    mask = self._mask_arg(pos_p, tree, n, self._kv.capacity)
                    fn = self._compiled or self._raw_forward
                    logits, taps = fn(ids_p[None], pos_p[None], mask, 0)
                logits, taps = logits[:n], (None if taps is None else taps[:n])
                if last_only:
                    logits = logits[-1:]
            else:
                self._kv.write_index = torch.arange(L, L + n, device=dev)
                self._kv.kv_len = L + n
                mask = self._mask_arg(pos, tree, n, L + n)
                logits, taps = self._raw_forward(ids[None], pos[None], mask, 1 if last_only else 0)
                if last_only:
                    logits = logits[-1:]
        logits = logits.float()
        if self.timing:
            _sync(dev)
        self.time_forward += time.perf_counter() - t0
        self.num_forwards += 1
        self._set_length(L + n)
        return logits, taps

    def forward(self, input_ids: Tensor | list[int], last_only: bool = False) -> tuple[Tensor, Tensor | None]:
        """Append ``n`` tokens at positions ``[length, length + n)``.

        Args:
            input_ids: ``[1, n]`` or ``[n]`` token ids (or a list of ints).
            last_only: return the logits of the last position only (``[1, V]``; for the prefill of a long
                prompt, where ``[n, V]`` float32 logits would be large). Taps are always returned in full.
        Returns:
            ``(logits [n, V] float32, taps [n, len(taps) * H] or None)``; logits row i predicts the token
            after input i.
        """
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(-1)
        return self._run(ids, None, None, last_only)

    def forward_tree(self, input_ids, parents: Sequence[int] | Tensor, depths: Sequence[int] | Tensor | None = None,
                     ancestors: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Run a token tree in one forward: node i sits in slot ``length + i`` at position ``length + depth_i``
        and attends to the committed prefix and to its ancestors (and itself).

        Args:
            input_ids: ``[n]`` node tokens; node 0 is the root (the pending token).
            parents: ``[n]`` parent node of each node (``parents[0] = -1``; ``parents[i] < i``).
            depths, ancestors: optional precomputed depths ``[n]`` and ancestor-or-self mask ``[n, n]``.
        Returns:
            ``(logits [n, V], taps [n, D] or None)``. Afterwards ``length`` includes all n slots: keep the
            accepted path with :meth:`keep`.
        """
        from .tree import ancestor_mask, node_depths

        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(-1)
        if ancestors is None:
            ancestors = ancestor_mask(parents)
        if depths is None:
            depths = node_depths(parents)
        depth = torch.as_tensor(depths, dtype=torch.long, device=self.device)
        return self._run(ids, depth, ancestors.to(self.device), last_only=False)

    # ---------------------------------------------------------------------------------------- rollback
    def truncate(self, n: int) -> None:
        """Roll the cache back so it holds positions ``[0, n)`` only."""
        remove = self._length - n
        if remove < 0 or n < 0:
            raise ValueError(f"cannot truncate a cache of length {self._length} to {n}")
        if self.cache_kind == "dynamic":
            # crop(0) is still needed for sliding layers: it trims the recorded past back to the window
            if remove > 0 or self._dyn_sliding:
                self.cache.crop(-remove)  # transformers' crop takes minus the number of tokens to remove
        self._set_length(n)

    def keep(self, indices: Sequence[int] | Tensor, start: int) -> None:
        """Compact: slots ``< start`` stay; the slots ``indices`` (ascending, all >= start) move to
        ``start, start+1, ...``; afterwards ``length == start + len(indices)``. Moving slot ``start + i``
        onto itself is free, so a chain-shaped accepted prefix costs nothing beyond the truncation."""
        idx = [int(i) for i in (indices.tolist() if isinstance(indices, Tensor) else indices)]
        if any(i < start or i >= self._length for i in idx) or any(b <= a for a, b in zip(idx, idx[1:])):
            raise ValueError(f"keep indices must be ascending in [{start}, {self._length}), got {idx}")
        k = len(idx)
        moved = [j for j, i in enumerate(idx) if i != start + j]
        if moved:
            first = moved[0]
            src = torch.tensor(idx[first:], dtype=torch.long, device=self.device)
            if self.cache_kind == "static":
                self._kv.keep(src, start + first, k - first)
            else:
                if self._dyn_sliding:
                    raise ValueError("tree compaction with sliding-window layers needs the static cache")
                for layer in self.cache.layers:
                    if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
                        layer.keys[:, :, start + first : start + k] = layer.keys.index_select(2, src)
                        layer.values[:, :, start + first : start + k] = layer.values.index_select(2, src)
        self.truncate(start + k)
