"""A KV connector for vLLM's ``extract_hidden_states`` that works on the CPU build (engine venv only).

vLLM's ``ExampleHiddenStatesConnector`` copies each finished request's hidden states out of the cache-only
layer's KV cache on a CUDA stream and records a CUDA event; neither exists in a CPU torch. This subclass keeps
everything else (the scheduler side that names one ``{req_id}.safetensors`` per request and delays the
request's block freeing, the slot mapping from its block ids) and replaces that one step by a synchronous copy
and an atomic write (``.tmp`` then rename) of ``{"hidden_states": [T, n_layers, H], "token_ids": [T]}``.

Loaded by vLLM through ``kv_transfer_config.kv_connector_module_path`` (``vllm_capture_driver.py`` puts this
folder on ``sys.path``); imports vLLM, never drafttrain.
"""
from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, extract_from_kv_cache)


class _Done:
    """Stands in for the CUDA event ``get_finished`` polls: the copy below is complete when it returns."""

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        n = int(pending.token_ids.shape[0])
        hs = extract_from_kv_cache(self._kv_cache, slots, n).to("cpu").clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        tmp = pending.filename + ".tmp"
        save_file({"hidden_states": hs.contiguous(), "token_ids": pending.token_ids.clone().contiguous()}, tmp)
        os.replace(tmp, pending.filename)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Done()
