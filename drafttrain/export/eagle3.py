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

:func:`load_exported_eagle3` reads either layout back, including checkpoints written by speculators itself
(whose trainer defaults to ``norm_before_residual``, ``norm_before_fc`` and ``norm_output`` all true), with
vLLM's reading of every flag, so such a drafter is scored here as vLLM would serve it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..io import DraftTrainError, check_state_dict, load_tensors, read_json, save_tensors, write_json

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


def _rope_scaling(lc: dict):
    """The layer config's RoPE scaling (transformers 5 ``rope_parameters`` or the older ``rope_scaling``)."""
    from ..drafters.eagle3 import normalise_rope_scaling

    rp = lc.get("rope_parameters")
    if not isinstance(rp, dict) or not ({"rope_type", "type"} & rp.keys()):
        rp = lc.get("rope_scaling")
    return normalise_rope_scaling(rp) if isinstance(rp, dict) else None


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
    write_json(tmp / "config.json", config)
    save_tensors(tmp / "model.safetensors", tensors_for_export(drafter, export_dtype(dtype), fmt == "vllm"),
                 metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------ loading back
def exported_layout(config: dict) -> str | None:
    """``vllm`` (speculators layout), ``sglang`` (flat LlamaForCausalLMEagle3) or None."""
    if config.get("speculators_model_type") == "eagle3":
        return "vllm"
    archs = config.get("architectures") or []
    if any(a in ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM") for a in archs):
        return "sglang"
    return None


def exported_target(config: dict) -> str | None:
    if exported_layout(config) == "vllm":
        return (config.get("speculators_config", {}).get("verifier") or {}).get("name_or_path")
    return None


NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def _flag(cfg: dict, key: str, default, where):
    """``cfg[key]`` as a bool (``default`` when absent or null); anything but true/false is refused."""
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise DraftTrainError(f"{where}: {key}={v!r}, expected true or false")
    return v


def _warn_sliding_window(lc: dict, where) -> None:
    """speculators' trainer gives its draft layers sliding-window attention (window 2048) by default; this
    decoder attends over the whole context, which is the same computation while a sequence fits the window."""
    if "sliding_attention" in (lc.get("layer_types") or []) and lc.get("sliding_window"):
        print(f"[drafttrain] warning: {where}: the draft layers use sliding-window attention (window "
              f"{lc['sliding_window']}); this decoder attends over the full context, exact for sequences of up to "
              f"{lc['sliding_window']} tokens", flush=True)


def load_exported_eagle3(directory: str | Path, target_model=None, device=None):
    """An :class:`~drafttrain.drafters.eagle3.Eagle3Drafter` from an exported vLLM or SGLang directory, or a
    checkpoint speculators wrote (the same speculators layout, with ``embed_tokens`` and any of the norm
    flags ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output``).

    Without ``embed_tokens.weight`` in the directory (drafttrain's exports) the embedding is taken from
    ``target_model`` (the verifier), as the engines do.
    """
    from ..drafters.eagle3 import Eagle3Config, Eagle3Drafter

    directory = Path(directory)
    raw = read_json(directory / "config.json")
    layout = exported_layout(raw)
    where = directory / "config.json"
    if layout is None:
        raise DraftTrainError(f"{where}: not an exported EAGLE-3 config (no speculators_model_type: eagle3 and no "
                              "LlamaForCausalLMEagle3 architecture)")
    if layout == "vllm":
        lc = raw.get("transformer_layer_config") or {}
        taps = raw.get("eagle_aux_hidden_state_layer_ids")
        # vLLM's reading (transformers_utils/configs/speculators/algos.py update_eagle3): norm_before_residual
        # is true when absent, the other three false
        norms = {k: _flag(raw, k, k == "norm_before_residual", where) for k in NORM_FLAGS}
        target = exported_target(raw) or ""
    else:
        lc = raw
        nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        taps = [int(t) + 1 for t in nested] if nested is not None else raw.get("eagle_aux_hidden_state_layer_ids")
        top = raw.get("eagle_aux_hidden_state_layer_ids")
        if nested is not None and top is not None and [int(t) for t in top] != taps:
            raise DraftTrainError(f"{where}: eagle_config ids {nested} (+1) disagree with top-level ids {top}")
        # vLLM's reading of the flat layout: every flag false when absent; eagle_config.norm_before_fc (ModelOpt's
        # place for it) wins over the top-level key
        norms = {k: _flag(raw, k, False, where) for k in NORM_FLAGS}
        nested_fc = _flag(raw.get("eagle_config") or {}, "norm_before_fc", None, where)
        if nested_fc is not None:
            norms["norm_before_fc"] = nested_fc
        target = ""
    if taps is None:
        raise DraftTrainError(f"{where}: no eagle_aux_hidden_state_layer_ids (the taps must be explicit)")
    _warn_sliding_window(lc, where)
    try:
        rope = lc.get("rope_theta") or (lc.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        config = Eagle3Config(
            hidden_size=int(lc["hidden_size"]), target_hidden_size=int(raw.get("target_hidden_size") or lc["hidden_size"]),
            intermediate_size=int(lc["intermediate_size"]), num_attention_heads=int(lc["num_attention_heads"]),
            num_key_value_heads=int(lc.get("num_key_value_heads") or lc["num_attention_heads"]),
            head_dim=int(lc.get("head_dim") or int(lc["hidden_size"]) // int(lc["num_attention_heads"])),
            vocab_size=int(lc["vocab_size"]), draft_vocab_size=int(raw["draft_vocab_size"]),
            rms_norm_eps=float(lc.get("rms_norm_eps", 1e-6)), rope_theta=float(rope),
            rope_scaling=_rope_scaling(lc),
            max_position_embeddings=int(lc.get("max_position_embeddings", 2048)),
            num_layers=int(lc.get("num_hidden_layers", 1)), tap_layers=[int(t) for t in taps],
            target_name_or_path=target, initializer_range=float(lc.get("initializer_range", 0.02)), **norms,
        )
    except KeyError as e:
        raise DraftTrainError(f"{where}: missing key {e.args[0]!r}") from None
    sd = load_tensors(directory / "model.safetensors")
    sd = {k[len("model."):] if k.startswith("model.") and k != "model.lm_head.weight" else k: v for k, v in sd.items()}
    if "d2t" not in sd or "lm_head.weight" not in sd:
        raise DraftTrainError(f"{directory / 'model.safetensors'}: needs d2t and lm_head.weight")
    d2t = sd["d2t"].long()
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t] = True
    if "t2d" in sd and not torch.equal(sd["t2d"].bool(), t2d):
        raise DraftTrainError(f"{directory / 'model.safetensors'}: t2d does not match d2t")
    sd["t2d"] = t2d
    if "embed_tokens.weight" not in sd:
        if target_model is None:
            raise DraftTrainError(f"{directory}: the export has no embed_tokens; load it with its target model")
        emb = target_model.get_input_embeddings().weight.detach()
        if tuple(emb.shape) != (config.vocab_size, config.hidden_size):
            raise DraftTrainError(f"{directory}: target embedding {tuple(emb.shape)} does not fit the drafter "
                                  f"({config.vocab_size}, {config.hidden_size})")
        sd["embed_tokens.weight"] = emb.to("cpu", torch.float32)
    model = Eagle3Drafter(config, d2t, t2d)
    dtype = sd["fc.weight"].dtype
    if dtype != torch.float32:
        model.to(dtype)
    expected = model.state_dict()
    check_state_dict(directory / "model.safetensors", expected, sd, against="its config")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in sd.items()}, strict=True)
    if device is not None:
        model.to(device)
    return model.eval()
