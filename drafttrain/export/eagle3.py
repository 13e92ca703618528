"""EAGLE-3 drafters in the on-disk layouts vLLM and SGLang load (shared/reference/speculators-modelopt-
serving-formats.md §2), and back.

Both layouts write ``model.safetensors`` with the drafter's own tensor names (no ``model.`` prefix):
``fc.weight [H, 3·Ht]``, ``layers.{l}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{l}.mlp.{gate,up,down}_proj.weight``,
``layers.{l}.{input_layernorm,post_attention_layernorm}.weight``, ``layers.0.hidden_norm.weight``,
``norm.weight``, ``lm_head.weight [Vd, H]`` (always written) and ``d2t`` (int64 ``[Vd]``, offsets:
``target_id = i + d2t[i]``). ``embed_tokens`` is omitted: both engines then share the target's embedding,
which is what the drafter was trained with (a frozen copy). ``t2d`` (bool ``[V]``) is written in the vLLM
(speculators) layout only; both engines ignore it.

- ``vllm`` — the speculators layout (A): ``speculators_model_type: eagle3``, ``transformer_layer_config``
  (a Llama config of the draft layers), ``speculators_config`` with the verifier named, aux layer ids raw
  (HF ``hidden_states`` indices = vLLM capture ids), and the drafter's four activation-norm flags written
  explicitly: ``norm_before_residual`` (vLLM defaults it to *true* when absent on this path),
  ``norm_before_fc`` (+ ``input_norm.weight [3·Ht]``), ``fc_norm`` (+ ``fc_norm.{0,1,2}.weight``) and
  ``norm_output``; vLLM's ``llama_eagle3.py`` honours all four (``fc_norm``/``norm_output`` from vLLM 0.22).
  Serve: ``vllm serve OUT`` (the verifier is read from the config).
- ``sglang`` — the flat layout (B): ``architectures: [LlamaForCausalLMEagle3]``, ``model_type: llama``,
  Llama fields, ``draft_vocab_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids`` = ids − 1
  (SGLang adds 1), plus the raw ids at the top level (the flat layout's vLLM key). SGLang's
  ``LlamaForCausalLMEagle3`` (and TensorRT-LLM, which reads this layout) takes layer 0's residual before
  ``hidden_norm`` and has no ``input_norm``, skipping unknown weights silently: a drafter with
  ``norm_before_residual`` or ``norm_before_fc`` is refused for this format instead of served wrong.

Reading either layout back (``exported_layout``, ``load_exported_eagle3``, with vLLM's reading of every flag)
is drafttrain/artifacts.py's, the one module that loads saved drafters.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..artifacts import CONFIG_NAME, WEIGHTS_NAME
from ..io import DraftTrainError, read_json, save_tensors, write_json

SPECULATORS_FORMAT = "0.9.0"  # the speculators config layout followed (vllm-project/speculators)

# drafter flags an engine would ignore silently (it would serve another drafter than the one evaluated here):
# format -> {flag: why}. vLLM's speculators layout honours every flag the drafter has.
UNHONOURED = {
    "sglang": {
        "norm_before_residual": "SGLang's LlamaForCausalLMEagle3 (and TensorRT-LLM, which reads this layout) "
                                "takes layer 0's residual before hidden_norm (norm_before_residual=false only)",
        "norm_before_fc": "SGLang's LlamaForCausalLMEagle3 has no input_norm before fc and skips the unknown "
                          "input_norm.weight silently",
    },
}

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise DraftTrainError(f"dtype={name}: expected one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _verifier_architectures(target: str) -> list[str]:
    p = Path(target) / "config.json"
    if p.exists():
        return list(read_json(p).get("architectures") or [])
    try:  # a hub name in the local HF cache
        from transformers import AutoConfig

        return list(getattr(AutoConfig.from_pretrained(target), "architectures", None) or [])
    except Exception:  # not available offline: the engine only needs the name
        return []


def _layer_config(c, dtype: str) -> dict:
    """The Llama config of the draft decoder layers (shared by both layouts)."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_theta,  # the RoPE the drafter was trained with: the target's, scaling included
        "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
        "rope_parameters": {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": c.initializer_range,
        "torch_dtype": dtype,
    }


def tensors_for_export(drafter, dtype: torch.dtype, with_t2d: bool) -> dict[str, torch.Tensor]:
    sd = drafter.state_dict()
    out = {}
    for k, v in sd.items():
        if k.startswith("embed_tokens."):
            continue  # shared with the target (the drafter's is a frozen, bit-identical copy)
        if k == "t2d":
            if with_t2d:
                out[k] = v.to(torch.bool)
            continue
        if k == "d2t":
            out[k] = v.to(torch.int64)
            continue
        out[k] = v.detach().to(dtype)
    if "lm_head.weight" not in out:
        raise DraftTrainError("EAGLE-3 export: the drafter has no lm_head.weight")
    return out


def vllm_config(drafter, verifier: str, num_speculative_tokens: int, dtype: str) -> dict:
    c = drafter.config
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_FORMAT,
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": bool(c.norm_before_residual),  # explicit: vLLM assumes true when absent
        "norm_before_fc": bool(c.norm_before_fc),  # input_norm.weight [3·Ht]
        "fc_norm": bool(c.fc_norm),  # EAGLE-3.1 (vLLM >= 0.22 reads fc_norm.{0,1,2}.weight)
        "norm_output": bool(c.norm_output),
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": [int(t) for t in c.tap_layers],
        "transformer_layer_config": _layer_config(c, dtype),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": _verifier_architectures(verifier)},
        },
        "torch_dtype": dtype,
    }


def sglang_config(drafter, dtype: str) -> dict:
    c = drafter.config
    cfg = _layer_config(c, dtype)
    cfg.update({
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": False,  # the only value SGLang implements (write_eagle3 refuses true)
        "fc_norm": bool(c.fc_norm),  # EAGLE-3.1, as SpecForge writes it (fc_norm.{0,1,2}.weight)
        "norm_output": bool(c.norm_output),
        "eagle_aux_hidden_state_layer_ids": [int(t) for t in c.tap_layers],  # vLLM convention (raw)
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [int(t) - 1 for t in c.tap_layers],  # SGLang adds 1
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_last_layernorm": True,
            "use_mtp_layernorm": False,
            "next_layer_regular": True,
        },
    })
    return cfg


def write_eagle3(drafter, fmt: str, tmp: Path, *, dtype: str, verifier: str, num_speculative_tokens: int) -> None:
    c = drafter.config
    if c.qk_norm:
        raise DraftTrainError("EAGLE-3 export: a drafter with qk_norm (Qwen3-style draft layer) has no verified "
                              "engine layout yet; evaluate it with drafttrain eval")
    for flag, why in UNHONOURED.get(fmt, {}).items():
        if getattr(c, flag):
            raise DraftTrainError(f"EAGLE-3 export: {flag}=true cannot go to format={fmt}: {why}; export "
                                  "format=vllm (the speculators layout, which vLLM reads with this flag)")
    if fmt == "vllm":
        config = vllm_config(drafter, verifier, num_speculative_tokens, dtype)
    elif fmt == "sglang":
        if drafter.config.num_layers != 1:
            print(f"[drafttrain] warning: SGLang's EAGLE-3 model runs 1 draft layer; this drafter has "
                  f"{drafter.config.num_layers}", flush=True)
        config = sglang_config(drafter, dtype)
    else:
        raise DraftTrainError(f"format={fmt}: an EAGLE-3 drafter exports as vllm or sglang")
    write_json(tmp / CONFIG_NAME, config)
    save_tensors(tmp / WEIGHTS_NAME, tensors_for_export(drafter, export_dtype(dtype), fmt == "vllm"),
                 metadata={"format": "pt"})
