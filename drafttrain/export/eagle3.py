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
  A drafter with q/k norms (``qk_norm``, a Qwen3-style layer) gets a Qwen3 ``transformer_layer_config``
  (``model_type: qwen3``), which vLLM serves as ``Eagle3Qwen3ForCausalLM`` (``qwen3_eagle3.py``, the same flags
  and tensor names plus ``self_attn.{q,k}_norm.weight``). Serve: ``vllm serve OUT`` (the verifier is read from
  the config).
- ``sglang`` — the flat layout (B): ``architectures: [LlamaForCausalLMEagle3]``, ``model_type: llama``,
  Llama fields, ``draft_vocab_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids`` = ids − 1
  (SGLang adds 1), plus the raw ids at the top level (the flat layout's vLLM key). SGLang's
  ``LlamaForCausalLMEagle3`` (and TensorRT-LLM, which reads this layout) takes layer 0's residual before
  ``hidden_norm`` and has no ``input_norm`` and no q/k norms, skipping unknown weights silently: a drafter with
  ``norm_before_residual``, ``norm_before_fc`` or ``qk_norm`` is refused for this format instead of served wrong.

- ``trtllm`` — TensorRT-LLM's PyTorch backend (rules read from NVIDIA/TensorRT-LLM
  ``tensorrt_llm/_torch/models/modeling_speculative.py`` @ ``00679c66`` (Eagle3DraftModel, Eagle3DecoderLayer,
  Eagle3ForCausalLM.load_weights), ``models/modeling_auto.py`` @ ``01bffee1`` (the architecture rename),
  ``speculative/eagle3.py`` @ ``f933a608`` (the capture) and ``llmapi/llm_args.py`` @ ``fcd3f316``
  (Eagle3DecodingConfig)): the flat config (``model_type: llama``, ``architectures: [LlamaForCausalLMEagle3]``,
  which TRT-LLM turns into ``EAGLE3LlamaForCausalLM`` because ``draft_vocab_size`` is present), tensors
  ``midlayer.*`` (one layer) or ``midlayer.{i}.*`` (several; a later layer's input norm is its ``hidden_norm``),
  ``d2t`` int32 (only when ``draft_vocab_size < vocab_size``: TRT-LLM has no d2t otherwise), ``embed_tokens``
  only when ``target_hidden_size != hidden_size``; ``norm_before_fc`` goes in ``eagle_config``. TRT-LLM reads
  the taps only from its YAML (``eagle3_layers_to_capture``, 0-based layer outputs = our ids − 1, a set it
  sorts), so ``fc``'s column blocks are written in ascending tap order, and the YAML is written beside the
  config (``extra_llm_api_options.yaml``). Refused (one line each): ``norm_before_residual`` (TRT-LLM takes the
  residual before hidden_norm), ``qk_norm`` (its Eagle3Attention has no q/k norms), ``fc_norm`` together with
  ``norm_before_fc`` (it applies only fc_norm), taps 0 or L (TRT-LLM captures decoder-layer outputs before the
  final norm), repeated taps and ``hidden_size == 3 · target_hidden_size`` (its fc is skipped by a shape test).

Reading any layout back (``exported_layout``, ``load_exported_eagle3``, with vLLM's reading of every flag,
TRT-LLM's for ``trtllm``) is drafttrain/artifacts.py's, the one module that loads saved drafters.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..io import DraftTrainError, read_json, save_tensors, write_json
from ..layout import (CONFIG_NAME, LAYOUT_KEY, TRTLLM_ARCHITECTURE, TRTLLM_LAYER_PREFIX, TRTLLM_LAYOUT,
                      TRTLLM_OPTIONS_NAME, WEIGHTS_NAME)

SPECULATORS_FORMAT = "0.9.0"  # the speculators config layout followed (vllm-project/speculators)

# drafter flags an engine would ignore silently (it would serve another drafter than the one evaluated here):
# format -> {flag: why}. vLLM's speculators layout honours every flag the drafter has.
UNHONOURED = {
    "sglang": {
        "qk_norm": "SGLang's LlamaForCausalLMEagle3 has no q/k norms (a Qwen3-style draft layer)",
        "norm_before_residual": "SGLang's LlamaForCausalLMEagle3 (and TensorRT-LLM, which reads this layout) "
                                "takes layer 0's residual before hidden_norm (norm_before_residual=false only)",
        "norm_before_fc": "SGLang's LlamaForCausalLMEagle3 has no input_norm before fc and skips the unknown "
                          "input_norm.weight silently",
    },
    "trtllm": {
        "norm_before_residual": "TensorRT-LLM's Eagle3DecoderLayer takes the residual before hidden_norm "
                                "(norm_before_residual=false only)",
        "qk_norm": "TensorRT-LLM's Eagle3Attention has no q/k norms (a Qwen3-style draft layer)",
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
    """The config of the draft decoder layers (shared by the layouts): Llama's, or Qwen3's for a drafter with
    q/k norms (``qk_norm``: vLLM then serves it as ``Eagle3Qwen3ForCausalLM``, whose layers read
    ``self_attn.{q,k}_norm.weight``)."""
    qwen3 = bool(getattr(c, "qk_norm", False))
    return {
        "model_type": "qwen3" if qwen3 else "llama",
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
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


# ------------------------------------------------------------------------------------------ TensorRT-LLM
def trtllm_taps(c) -> list[int]:
    """The drafter's taps (HF ``hidden_states`` ids) in the order TensorRT-LLM concatenates them (ascending: it
    sorts ``eagle3_layers_to_capture``); refuses taps it cannot capture as the drafter was trained."""
    taps = [int(t) for t in c.tap_layers]
    if len(set(taps)) != len(taps):
        raise DraftTrainError(f"EAGLE-3 export: tap_layers={taps} repeat a layer; format=trtllm takes them as a set "
                              "(eagle3_layers_to_capture), so the fc input would shrink")
    L = int(c.target_num_layers or 0)
    bad = [t for t in taps if t < 1 or (L and t >= L)]
    if bad:
        raise DraftTrainError(f"EAGLE-3 export: tap_layers={taps} include {bad}: format=trtllm captures decoder-layer "
                              f"outputs 0..L-2 (our ids 1..{L - 1 if L else 'L-1'}); id 0 (the embeddings) and id L "
                              "(after the final norm) have no TensorRT-LLM equivalent")
    return sorted(taps)


def trtllm_capture_layers(c) -> list[int]:
    """``eagle3_layers_to_capture``: TensorRT-LLM's 0-based decoder-layer outputs = our ids − 1."""
    return [t - 1 for t in trtllm_taps(c)]


def _check_trtllm(c) -> None:
    if c.fc_norm and c.norm_before_fc:
        raise DraftTrainError("EAGLE-3 export: fc_norm=true with norm_before_fc=true cannot go to format=trtllm: "
                              "TensorRT-LLM applies fc_norm and skips input_norm; export format=vllm")
    if c.hidden_size == 3 * c.target_hidden_size:
        raise DraftTrainError(f"EAGLE-3 export: hidden_size={c.hidden_size} = 3 x target_hidden_size cannot go to "
                              "format=trtllm: TensorRT-LLM skips fc when the taps already have the draft width")
    trtllm_taps(c)


def trtllm_config(drafter, dtype: str) -> dict:
    c = drafter.config
    taps = trtllm_taps(c)
    cfg = _layer_config(c, dtype)
    cfg.update({
        "architectures": [TRTLLM_ARCHITECTURE],
        LAYOUT_KEY: TRTLLM_LAYOUT,
        "draft_vocab_size": c.draft_vocab_size,  # also what makes TRT-LLM pick its EAGLE-3 class
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": False,  # the only convention TRT-LLM runs (write_eagle3 refuses true)
        "fc_norm": bool(c.fc_norm),  # fc_norm.{0,1,2}.weight, in ascending tap order
        "norm_output": bool(c.norm_output),
        "eagle_aux_hidden_state_layer_ids": taps,  # informational (TRT-LLM reads the YAML); ascending = fc's order
        "eagle_config": {
            "next_layer_regular": True,  # layers 1.. take H inputs and no input_layernorm
            "norm_before_fc": bool(c.norm_before_fc),  # input_norm.weight [3·Ht]
            "eagle_aux_hidden_state_layer_ids": [t - 1 for t in taps],
        },
    })
    return cfg


def trtllm_tensors(drafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's tensors under TensorRT-LLM's module names (before its own ``model.`` prefix), the tap
    blocks of ``fc`` / ``fc_norm`` / ``input_norm`` permuted into ascending tap order."""
    c = drafter.config
    Ht = c.target_hidden_size
    order = sorted(range(len(c.tap_layers)), key=lambda j: int(c.tap_layers[j]))
    out = {}
    for k, v in drafter.state_dict().items():
        if k == "t2d" or (k.startswith("embed_tokens.") and c.target_hidden_size == c.hidden_size):
            continue  # TRT-LLM shares the target's embedding when the widths match (it has no t2d)
        if k == "d2t":
            if c.draft_vocab_size == c.vocab_size:  # TRT-LLM has no d2t then: draft id = target id, which is what
                continue  # a full-size d2t is (the drafter's target ids are strictly increasing: all offsets 0)
            if int(v.abs().max()) >= 2 ** 31:
                raise DraftTrainError("EAGLE-3 export: d2t offsets do not fit TensorRT-LLM's int32 d2t")
            out[k] = v.to(torch.int32)
            continue
        v = v.detach()
        if k == "fc.weight":
            v = torch.cat([v[:, j * Ht:(j + 1) * Ht] for j in order], dim=1)
        elif k == "input_norm.weight":
            v = torch.cat([v[j * Ht:(j + 1) * Ht] for j in order])
        elif k.startswith("fc_norm."):
            k = f"fc_norm.{order.index(int(k.split('.')[1]))}.weight"
        elif k.startswith("layers."):
            _, i, tail = k.split(".", 2)
            if int(i) > 0 and tail == "input_layernorm.weight":
                tail = "hidden_norm.weight"  # TRT-LLM's regular layers normalise their input with hidden_norm
            k = f"{TRTLLM_LAYER_PREFIX}.{tail}" if c.num_layers == 1 else f"{TRTLLM_LAYER_PREFIX}.{i}.{tail}"
        out[k] = v.to(dtype)
    if "lm_head.weight" not in out:
        raise DraftTrainError("EAGLE-3 export: the drafter has no lm_head.weight")
    return dict(sorted(out.items()))


def trtllm_options(drafter, speculative_model: Path, num_speculative_tokens: int) -> str:
    """The YAML for ``trtllm-serve --extra_llm_api_options`` / ``trtllm-bench --config`` (TRT-LLM reads the
    taps only from here)."""
    import yaml

    spec = {"decoding_type": "Eagle3", "max_draft_len": int(num_speculative_tokens),
            "speculative_model": str(Path(speculative_model).resolve()),
            "eagle3_layers_to_capture": trtllm_capture_layers(drafter.config)}
    return ("# written by drafttrain export format=trtllm: trtllm-serve <target> --extra_llm_api_options <this file>\n"
            "# eagle3_layers_to_capture = the drafter's HF hidden_states tap ids - 1 (0-based decoder-layer outputs)\n"
            + yaml.safe_dump({"speculative_config": spec}, sort_keys=False))


def write_eagle3(drafter, fmt: str, tmp: Path, *, dtype: str, verifier: str, num_speculative_tokens: int,
                 final_dir: Path | None = None) -> None:
    """Write ``drafter`` in layout ``fmt`` into ``tmp``; ``final_dir`` is the directory ``tmp`` becomes (the
    ``speculative_model`` path of the trtllm YAML; default ``tmp``)."""
    c = drafter.config
    for flag, why in UNHONOURED.get(fmt, {}).items():
        if getattr(c, flag):
            hint = "; export format=vllm (the speculators layout, which vLLM reads with this flag)"
            raise DraftTrainError(f"EAGLE-3 export: {flag}=true cannot go to format={fmt}: {why}{hint}")
    if fmt == "vllm":
        config = vllm_config(drafter, verifier, num_speculative_tokens, dtype)
    elif fmt == "sglang":
        if c.num_layers != 1:
            raise DraftTrainError(f"EAGLE-3 export: num_layers={c.num_layers} cannot go to format=sglang: SGLang's "
                                  "EAGLE-3 model runs 1 draft layer; export format=vllm or format=trtllm")
        config = sglang_config(drafter, dtype)
    elif fmt == TRTLLM_LAYOUT:
        _check_trtllm(c)
        write_json(tmp / CONFIG_NAME, trtllm_config(drafter, dtype))
        save_tensors(tmp / WEIGHTS_NAME, trtllm_tensors(drafter, export_dtype(dtype)), metadata={"format": "pt"})
        (tmp / TRTLLM_OPTIONS_NAME).write_text(trtllm_options(drafter, final_dir or tmp, num_speculative_tokens))
        return
    else:
        raise DraftTrainError(f"format={fmt}: an EAGLE-3 drafter exports as vllm or sglang, or trtllm")
    write_json(tmp / CONFIG_NAME, config)
    save_tensors(tmp / WEIGHTS_NAME, tensors_for_export(drafter, export_dtype(dtype), fmt == "vllm"),
                 metadata={"format": "pt"})
