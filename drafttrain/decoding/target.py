"""TargetRunner: an HF causal LM behind a KV cache that rolls back by index, plus hidden-state taps.

Batch size 1 only (one sequence per runner), which is what chain speculative decoding needs; batching
would need per-row lengths and ragged rollback.

The cache interface is ``length`` / ``truncate(n)`` / ``reset()``; today it is an HF ``DynamicCache``
cropped on rollback, and a preallocated static cache written by index can replace it behind the same
interface. Sliding-window layers (Mistral, some Qwen configs) keep their past while recording, so they
can be rolled back too.
"""
from __future__ import annotations

import time

import torch
from torch import Tensor
from transformers import DynamicCache


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TargetRunner:
    """Runs the target model incrementally: position ``length`` is the next one to be written.

    Args:
        model: any HF causal LM (put in eval mode; no gradients are taken).
        taps: indices into HF's ``hidden_states`` tuple (0 = embeddings, j = output of layer j-1) whose
            rows are concatenated, in this order, into the tap features; None = no taps (and no
            ``output_hidden_states``).
        max_len: the most positions the cache may hold (default: the model's
            ``max_position_embeddings``).
    """

    def __init__(self, model, taps: tuple[int, ...] | None = None, max_len: int | None = None):
        self.model = model.eval()
        self.taps = tuple(int(t) for t in taps) if taps else None
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        self.config = cfg
        self.vocab_size = int(cfg.vocab_size)
        self.max_len = int(max_len if max_len is not None else getattr(cfg, "max_position_embeddings", 1 << 30))
        if self.taps is not None:
            n_states = int(cfg.num_hidden_layers) + 1
            bad = [t for t in self.taps if not 0 <= t < n_states]
            if bad:
                raise ValueError(f"taps {bad} out of range: hidden_states has {n_states} entries")
        self.device = next(model.parameters()).device
        self.time_forward = 0.0  # seconds spent in forward(), accumulated over the runner's life
        self.num_forwards = 0
        self.reset()

    @property
    def length(self) -> int:
        """Number of positions held by the cache."""
        return self._length

    def reset(self) -> None:
        """Empty the cache (start a new sequence)."""
        self.cache = DynamicCache(config=self.model.config)
        self._sliding = any(getattr(layer, "is_sliding", False) for layer in self.cache.layers)
        if self._sliding:
            # keep past states until crop() so a rollback past the window's edge stays possible
            self.cache.activate_past_recording()
        self._length = 0

    @torch.no_grad()
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
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(1, -1)
        n = ids.shape[1]
        if self._length + n > self.max_len:
            raise ValueError(f"target cache overflow: {self._length} + {n} > max_len {self.max_len}")
        pos = torch.arange(self._length, self._length + n, device=self.device).unsqueeze(0)
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=self.taps is not None,
            **({"logits_to_keep": 1} if last_only else {}),
        )
        logits = out.logits[0, -1:] if last_only else out.logits[0]
        logits = logits.float()  # [n, V] ([1, V] if last_only)
        taps = None
        if self.taps is not None:
            taps = torch.cat([out.hidden_states[i][0] for i in self.taps], dim=-1)  # [n, len(taps)*H]
        _sync(self.device)
        self.time_forward += time.perf_counter() - t0
        self.num_forwards += 1
        self._length += n
        return logits, taps

    def truncate(self, n: int) -> None:
        """Roll the cache back so it holds positions ``[0, n)`` only."""
        remove = self._length - n
        if remove < 0 or n < 0:
            raise ValueError(f"cannot truncate a cache of length {self._length} to {n}")
        # crop(0) is still needed for sliding layers: it trims the recorded past back to the window
        if remove > 0 or self._sliding:
            self.cache.crop(-remove)  # transformers' crop takes minus the number of tokens to remove
        self._length = n
