"""DFlash exports (shared/reference/dflash-family-2026.md §1.5) and their reading back.

- ``zlab`` (also what ``sglang`` and ``trtllm`` write): the z-lab HF layout every engine loads —
  ``architectures: ["DFlashDraftModel"]``, ``model_type: qwen3``, ``is_causal: false``, ``block_size`` at top level
  and in ``dflash_config``, ``dflash_config: {mask_token_id, target_layer_ids (0-based layer outputs), block_size,
  causal: false}``, bare tensor names (``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.…``, ``norm.weight``),
  no embedding, no lm_head and no ``mask_hidden``. vLLM taps ``target_layer_ids + 1``; SGLang adds the +1 itself;
  TensorRT-LLM reads the same 0-based list (``format=trtllm`` adds ``extra_llm_api_options.yaml`` with
  ``decoding_type: DFlash``).
- ``vllm``: the speculators layout — ``speculators_model_type: dflash``, ``aux_hidden_state_layer_ids`` = the
  0-based ids + 1 (vLLM's convention), ``mask_token_id``, ``block_size``, ``sliding_window_non_causal: true``
  (vLLM reads ``causal = not sliding_window_non_causal``), ``transformer_layer_config`` (the draft layers' Qwen3
  config), ``speculators_config`` naming the verifier; the same tensors.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..io import DraftTrainError, save_tensors, write_json
from ..layout import CONFIG_NAME, DFLASH_ARCHITECTURE, TRTLLM_OPTIONS_NAME, WEIGHTS_NAME

__all__ = ["write_dflash", "DFLASH_FORMATS", "zlab_config", "speculators_config"]

DFLASH_FORMATS = ("zlab", "vllm", "sglang", "trtllm")


def _layer_config(c, dtype: torch.dtype) -> dict:
    """The draft layers as an HF Qwen3 config (what every engine builds the layers from)."""
    cfg = {
        "model_type": "qwen3", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
        "attention_bias": False, "tie_word_embeddings": False, "initializer_range": c.initializer_range,
        "layer_types": ["full_attention"] * c.num_layers, "sliding_window": None, "use_sliding_window": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }
    if c.rope_scaling:
        cfg["rope_scaling"] = dict(c.rope_scaling)
        cfg["rope_parameters"] = {**c.rope_scaling, "rope_theta": c.rope_theta}
    return cfg


def zlab_config(c, dtype: torch.dtype) -> dict:
    return {
        "architectures": [DFLASH_ARCHITECTURE], **_layer_config(c, dtype), "is_causal": False,
        "block_size": c.block_size, "num_target_layers": c.target_num_layers, "target_hidden_size": c.target_hidden_size,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
                          "block_size": c.block_size, "causal": False},
        "target_name_or_path": c.target_name_or_path,
    }


def speculators_config(c, dtype: torch.dtype, verifier: str, num_speculative_tokens: int) -> dict:
    return {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "speculators_version": "0.4.0",
        "aux_hidden_state_layer_ids": [t + 1 for t in c.target_layer_ids], "mask_token_id": c.mask_token_id,
        "block_size": c.block_size, "draft_vocab_size": c.vocab_size, "target_hidden_size": c.target_hidden_size,
        "sliding_window_non_causal": True, "sample_from_anchor": False,
        "transformer_layer_config": {"architectures": ["Qwen3ForCausalLM"], **_layer_config(c, dtype)},
        "speculators_config": {
            "algorithm": "dflash", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens)}],
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
        "torch_dtype": str(dtype).replace("torch.", ""),
    }


def write_dflash(drafter, fmt: str, tmp: Path, dtype: torch.dtype, verifier: str, num_speculative_tokens: int) -> None:
    """Write ``drafter`` (a DFlashDrafter) into ``tmp`` in ``fmt``."""
    c = drafter.config
    if fmt not in DFLASH_FORMATS:
        raise DraftTrainError(f"format={fmt}: a DFlash drafter exports as {', '.join(DFLASH_FORMATS)}")
    k = int(num_speculative_tokens)
    if not 1 <= k <= c.block_size - 1:
        raise DraftTrainError(f"num_speculative_tokens={k}: a block of {c.block_size} drafts 1..{c.block_size - 1}")
    tensors = {n: t.detach().to("cpu", dtype).contiguous() for n, t in drafter.state_dict().items()}
    if fmt == "vllm":
        write_json(tmp / CONFIG_NAME, speculators_config(c, dtype, verifier, k))
    else:
        write_json(tmp / CONFIG_NAME, zlab_config(c, dtype))
    save_tensors(tmp / WEIGHTS_NAME, tensors, metadata={"format": "pt"})
    if fmt == "trtllm":
        (tmp / TRTLLM_OPTIONS_NAME).write_text(
            "speculative_config:\n  decoding_type: DFlash\n"
            f"  max_draft_len: {k}\n  speculative_model_dir: {tmp.name}\n"
            f"  target_layer_ids: {list(c.target_layer_ids)}\n  mask_token_id: {c.mask_token_id}\n")
