"""Saved drafters, loaded: the one module every caller reads a saved drafter directory through. It stands above
the drafter modules (it imports them; they never import it); the layout facts it reads (file names, config keys,
``drafter_type`` values) are ``drafttrain.layout``'s, shared with the drafters' ``save_pretrained`` and the exporters.

- :func:`load` -- any saved drafter with the target it verifies with: ``(target, drafter, info)``; the one call
  eval, the engine checks and the scripts make (a Medusa-2 drafter returns the target with its adapter merged);
- :func:`load_drafter` -- a saved drafter that decodes on its own: ``eagle3`` (``Eagle3Drafter``),
  ``draft_model`` (a plain HF causal LM, recipe=draft_model) and the vLLM / SGLang EAGLE-3 exports
  (:func:`load_exported_eagle3`); Medusa drafters are refused there (they come with their target);
- :func:`load_medusa` -- a Medusa-1 / Medusa-2 drafter with the target it verifies with (Medusa-2: adapter
  merged into the target); the heads alone: ``drafters.medusa.load_medusa_heads``;
- :func:`load_eagle3` -- an EAGLE-3 drafter for ``drafttrain bench`` / ``tune`` (None without a path);
- :func:`load_draft_model` -- a draft causal LM and its tokenizer by name (``builtin-small`` or a directory).

A training checkpoint (``<run>/checkpoints/step_N``) is not a saved drafter: ``drafttrain.training.checkpoint.
drafter_dir`` rebuilds its drafter into ``<checkpoint>/drafter`` (the CLI calls it before eval and export).

Exported EAGLE-3 layouts (written by drafttrain.export.eagle3; shared/reference/speculators-modelopt-serving-
formats.md §2): ``vllm``, the speculators layout (``speculators_model_type: eagle3``, a nested
``transformer_layer_config``, the verifier in ``speculators_config``) and ``sglang``, the flat
``LlamaForCausalLMEagle3`` layout (``eagle_config.eagle_aux_hidden_state_layer_ids`` = ids - 1), and
``trtllm``, TensorRT-LLM's reading of that flat layout (``midlayer.*`` tensors, ``drafttrain_layout: trtllm``).
:func:`load_exported_eagle3` reads either back, including checkpoints written by speculators itself (whose
trainer defaults to ``norm_before_residual``, ``norm_before_fc`` and ``norm_output`` all true), with vLLM's
reading of every flag, so such a drafter is scored here as vLLM would serve it.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from .drafters.dflash import DFlashDrafter, DFlashDrafterConfig, target_identity
from .drafters.eagle3 import Eagle3Drafter, Eagle3DrafterConfig, normalise_rope_scaling
from .drafters.medusa import MedusaHeads, heads_dir
from .io import DraftTrainError, check_state_dict, load_tensors, read_json
from .layout import (ADAPTER_DIR, ADAPTER_KEY, CONFIG_NAME, DFLASH_TYPE, DRAFT_MODEL_TYPE, exported_dflash, EAGLE3_TYPE, LAYOUT_KEY, MEDUSA2_TYPE,
                     MEDUSA_TYPE, TARGET_KEY, TRTLLM_LAYER_PREFIX, TRTLLM_LAYOUT, WEIGHTS_NAME, saved_type)

__all__ = [
    "recorded_target", "drafter_type", "load", "load_drafter", "load_medusa", "load_eagle3", "load_draft_lm",
    "load_draft_model", "load_dflash", "read_dflash_export", "exported_layout", "exported_target", "load_exported_eagle3", "NORM_FLAGS",
    "trtllm_to_drafter_names",
]


def drafter_type(path) -> str | None:
    """The ``drafter_type`` of the saved drafter at ``path`` (None for an exported EAGLE-3 layout; ``dflash`` for
    a DFlash export)."""
    cfg = read_json(Path(path) / CONFIG_NAME)
    return saved_type(cfg) or (DFLASH_TYPE if exported_dflash(cfg) else None)


def recorded_target(path) -> str | None:
    """The target the saved drafter at ``path`` was trained for (``target_name_or_path``; an exported vLLM
    layout names its verifier), None when it names none."""
    cfg = read_json(Path(path) / CONFIG_NAME)
    return cfg.get(TARGET_KEY) or exported_target(cfg) or None


# ------------------------------------------------------------------------------------------ any drafter
def load_drafter(path: str, device, target_model=None):
    """The saved drafter at ``path`` on ``device``: an ``Eagle3Drafter`` (``eagle3``, or a vLLM / SGLang
    export, whose embedding comes from ``target_model`` when the export has none) or an HF causal LM
    (``draft_model``). Medusa drafters are loaded with their target (:func:`load_medusa`)."""
    cfg = read_json(Path(path) / CONFIG_NAME)
    kind = saved_type(cfg)
    if kind == DFLASH_TYPE or kind is None and exported_dflash(cfg):  # it borrows the target's embedding and head
        return load_dflash(path, target_model, device)
    if kind is None and exported_layout(cfg):  # `drafttrain export` output (vLLM / SGLang / TRT-LLM EAGLE-3 layouts)
        return load_exported_eagle3(path, target_model=target_model, device=device)
    if kind == EAGLE3_TYPE:
        return Eagle3Drafter.from_pretrained(path, device=device)
    if kind == DRAFT_MODEL_TYPE:  # recipe=draft_model: a plain HF causal LM directory
        return load_draft_lm(path, device)
    if kind in (MEDUSA_TYPE, MEDUSA2_TYPE):
        raise DraftTrainError(f"{path}: a {kind} drafter is loaded with its target (drafttrain.artifacts."
                              "load_medusa)")
    raise DraftTrainError(f"{path}/{CONFIG_NAME}: unknown drafter_type {kind!r}")


# ------------------------------------------------------------------------------------------ DFlash
def load_dflash(path, target_model, device=None):
    """A DFlash drafter (drafttrain's own save, or a z-lab / speculators export read back) bound to
    ``target_model``, whose embedding and lm_head it borrows."""
    if target_model is None:
        raise DraftTrainError(f"{path}: a DFlash drafter borrows its target's embedding and lm_head: load it "
                              "with its target")
    cfg = read_json(Path(path) / CONFIG_NAME)
    if saved_type(cfg) == DFLASH_TYPE:
        return DFlashDrafter.from_pretrained(path, device=device, target_model=target_model)
    config, sd = read_dflash_export(Path(path), cfg, target_model)
    return DFlashDrafter.from_state(config, sd, Path(path) / WEIGHTS_NAME, device).bind_target(target_model)


def _need(d: dict, key: str, where: Path):
    if key not in d:
        raise DraftTrainError(f"{where}: DFlash config has no {key!r}")
    return d[key]


def _dflash_export_fields(raw: dict, where: Path) -> tuple[dict, list[int], int, int | None]:
    """(the draft layers' HF config, 0-based target layer ids, mask token id, block size) of a z-lab or
    speculators DFlash config.json; a causal draft is refused (drafttrain decodes bidirectional blocks)."""
    if raw.get("speculators_model_type") == "dflash":
        layer = _need(raw, "transformer_layer_config", where)
        if raw.get("sliding_window_non_causal") is False:  # vLLM: causal = not sliding_window_non_causal
            raise DraftTrainError(f"{where}: sliding_window_non_causal=false (a causal draft); drafttrain's DFlash "
                                  "decoder is bidirectional inside the block")
        ids = [int(t) - 1 for t in _need(raw, "aux_hidden_state_layer_ids", where)]  # vLLM's ids are + 1
        return layer, ids, int(_need(raw, "mask_token_id", where)), raw.get("block_size")
    dc = _need(raw, "dflash_config", where)
    if raw.get("is_causal", dc.get("causal", False)):
        raise DraftTrainError(f"{where}: is_causal=true (a block-causal draft, JetSpec-style); drafttrain's DFlash "
                              "decoder is bidirectional inside the block")
    ids = [int(t) for t in _need(dc, "target_layer_ids", where)]
    return raw, ids, int(_need(dc, "mask_token_id", where)), raw.get("block_size", dc.get("block_size"))


def read_dflash_export(directory: Path, raw: dict, target_model) -> tuple[DFlashDrafterConfig, dict]:
    """A z-lab or speculators DFlash export (drafttrain.export.dflash, or another trainer's) ->
    ``(DFlashDrafterConfig, state_dict)``, sized against ``target_model``; the export's own embedding / lm_head
    (speculators ships the verifier's) are dropped: the drafter borrows the target's."""
    where = directory / CONFIG_NAME
    layer, ids, mask, block = _dflash_export_fields(raw, where)
    sd = load_tensors(directory / WEIGHTS_NAME)
    if "mask_hidden" in sd:
        raise DraftTrainError(f"{directory / WEIGHTS_NAME}: has a mask_hidden tensor (a P-EAGLE draft, not DFlash)")
    sd = {n: t for n, t in sd.items() if n not in ("embed_tokens.weight", "lm_head.weight")}
    ident = target_identity(target_model)
    rope = layer.get("rope_scaling") or layer.get("rope_parameters")
    heads = int(_need(layer, "num_attention_heads", where))
    config = DFlashDrafterConfig(
        hidden_size=int(_need(layer, "hidden_size", where)),
        intermediate_size=int(_need(layer, "intermediate_size", where)),
        num_attention_heads=heads, num_key_value_heads=int(layer.get("num_key_value_heads", heads)),
        head_dim=int(layer.get("head_dim") or layer["hidden_size"] // heads),
        vocab_size=int(layer.get("vocab_size", ident["vocab_size"])),
        target_hidden_size=int(raw.get("target_hidden_size") or ident["target_hidden_size"]),
        target_num_layers=int(raw.get("num_target_layers") or ident["target_num_layers"]),
        target_layer_ids=ids, mask_token_id=mask, block_size=int(block) if block is not None else 8,
        num_layers=int(_need(layer, "num_hidden_layers", where)), rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(layer.get("rope_theta", (rope or {}).get("rope_theta", 10000.0))),
        rope_scaling=rope if isinstance(rope, dict) else None,
        max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
        target_name_or_path=str(raw.get(TARGET_KEY) or exported_target(raw) or ""),
    )
    return config, sd


def load(path, target_model, device=None):
    """The saved drafter at ``path`` with the target it verifies with: ``(target, drafter, info)`` on ``device``
    (default: the target's). Medusa-1 / Medusa-2 through :func:`load_medusa` (Medusa-2: ``target`` is
    ``target_model`` with the adapter merged; ``info`` its saved tree and ``target_modified``); every other
    drafter through :func:`load_drafter` (``target`` is ``target_model``, ``info`` None)."""
    device = next(target_model.parameters()).device if device is None else device
    if drafter_type(path) in (MEDUSA_TYPE, MEDUSA2_TYPE):
        return load_medusa(path, target_model, device)
    return target_model, load_drafter(str(path), device, target_model=target_model), None


def load_draft_lm(path, device):
    """A saved ``draft_model`` drafter (a plain HF causal LM directory) in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path).eval().to(device)
    except (OSError, ValueError) as e:
        raise DraftTrainError(f"{path}: cannot load the draft model ({e})".splitlines()[0]) from None


def load_eagle3(path, model):
    """``drafttrain bench`` / ``tune``'s EAGLE-3 drafter: None without ``path``; else the saved drafter on
    ``model``'s device, refused unless it is an EAGLE-3 drafter."""
    if not path:
        return None
    if not (Path(path) / CONFIG_NAME).exists():
        raise DraftTrainError(f"drafter={path}: not a saved drafter directory (no config.json)")
    d = load_drafter(path, next(model.parameters()).device)
    if not hasattr(d, "fuse"):
        raise DraftTrainError(f"drafter={path}: bench runs EAGLE-3 drafters (decode.method=eagle3)")
    return d.eval()


def load_draft_model(name: str, target_cfg, device):
    """A draft causal LM and its tokenizer: ``builtin-small`` (the built-in target's 2-layer sibling,
    built on first use) or an HF model directory. Returns ``(model, tokenizer, path)``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "builtin-small":
        from .targets.builtin import builtin_small_draft

        path = builtin_small_draft(target_cfg)
    else:
        path = Path(name)
    if not (Path(path) / CONFIG_NAME).exists():
        raise DraftTrainError(f"draft_model={name}: no config.json in {path}")
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval().to(device)
    tok = AutoTokenizer.from_pretrained(str(path))
    return model, tok, str(path)


# ------------------------------------------------------------------------------------------ Medusa
def load_medusa(path: str | os.PathLike, target_model, device=None):
    """Load a saved Medusa-1 or Medusa-2 drafter for decoding.

    Returns ``(target to verify with, heads, info)``; for Medusa-2 the target is ``target_model`` with the
    saved LoRA adapter merged in (in place), and ``info["target_modified"]`` is True. ``info`` also carries
    the saved ``medusa_choices`` (None if the drafter was saved without a tree)."""
    from .lora import load_lora  # peft, imported when a Medusa-2 drafter is loaded

    path = Path(path)
    cfg = read_json(path / CONFIG_NAME)
    kind = saved_type(cfg)
    hdir = heads_dir(path, cfg)
    heads = MedusaHeads.from_pretrained(hdir, device=device)
    hcfg = read_json(hdir / CONFIG_NAME)
    info = {"medusa_choices": hcfg.get("medusa_choices"), "head_topk_accuracy": hcfg.get("head_topk_accuracy"),
            "target_modified": kind == MEDUSA2_TYPE}
    if kind == MEDUSA2_TYPE:
        peft_model = load_lora(target_model, path / cfg.get(ADAPTER_KEY, ADAPTER_DIR))
        target_model = peft_model.merge_and_unload().eval()
    heads.medusa_choices = info["medusa_choices"]  # read by the decoder's tree choice
    heads.head_topk_accuracy = info["head_topk_accuracy"]
    if device is not None:
        heads.to(device)
    heads.to(next(target_model.parameters()).dtype)
    return target_model, heads.eval(), info


# ------------------------------------------------------------------------------------------ exported EAGLE-3
SGLANG_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def exported_layout(config: dict) -> str | None:
    """``vllm`` (speculators layout), ``sglang`` (flat LlamaForCausalLMEagle3), ``trtllm`` (the flat layout with
    ``midlayer.*`` tensors, marked by ``drafttrain_layout``) or None."""
    if config.get(LAYOUT_KEY) == TRTLLM_LAYOUT:
        return TRTLLM_LAYOUT
    if config.get("speculators_model_type") == "eagle3":
        return "vllm"
    archs = config.get("architectures") or []
    if any(a in SGLANG_ARCHITECTURES for a in archs):
        return "sglang"
    return None


def exported_target(config: dict) -> str | None:
    """The verifier an exported vLLM (speculators) config names, EAGLE-3 or DFlash; None for other layouts."""
    if exported_layout(config) == "vllm" or exported_dflash(config) == "speculators":
        return (config.get("speculators_config", {}).get("verifier") or {}).get("name_or_path")
    return None


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


def _rope_scaling(lc: dict):
    """The layer config's RoPE scaling (transformers 5 ``rope_parameters`` or the older ``rope_scaling``)."""
    rp = lc.get("rope_parameters")
    if not isinstance(rp, dict) or not ({"rope_type", "type"} & rp.keys()):
        rp = lc.get("rope_scaling")
    return normalise_rope_scaling(rp) if isinstance(rp, dict) else None


def _read_vllm_layout(raw: dict, where):
    """(layer config, taps, norm flags, verifier) of the speculators layout."""
    # vLLM's reading (transformers_utils/configs/speculators/algos.py update_eagle3): norm_before_residual
    # is true when absent, the other three false
    norms = {k: _flag(raw, k, k == "norm_before_residual", where) for k in NORM_FLAGS}
    return (raw.get("transformer_layer_config") or {}, raw.get("eagle_aux_hidden_state_layer_ids"), norms,
            exported_target(raw) or "")


def _read_sglang_layout(raw: dict, where):
    """(layer config, taps, norm flags, verifier) of the flat layout."""
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
    return raw, taps, norms, ""


def _read_trtllm_layout(raw: dict, where):
    """(layer config, taps, norm flags, verifier) of the TensorRT-LLM layout: TRT-LLM's reading of the flags
    (norm_before_residual false, the only convention it runs; norm_before_fc in eagle_config; fc_norm and
    norm_output at the top level). The taps are the ones drafttrain wrote (TRT-LLM reads its YAML's instead)."""
    eagle = raw.get("eagle_config") or {}
    norms = {"norm_before_residual": False,
             "norm_before_fc": _flag(eagle, "norm_before_fc", False, where),
             "fc_norm": _flag(raw, "fc_norm", False, where),
             "norm_output": _flag(raw, "norm_output", False, where) or _flag(eagle, "return_hidden_post_norm", False,
                                                                                 where)}
    return raw, raw.get("eagle_aux_hidden_state_layer_ids"), norms, ""


def trtllm_to_drafter_names(sd: dict, num_layers: int) -> dict:
    """TensorRT-LLM layout tensor names -> the drafter's: ``midlayer.`` (one layer) / ``midlayer.{i}.`` ->
    ``layers.{i}.``; a later layer's ``hidden_norm`` (what TRT-LLM's regular layers normalise their input
    with) -> ``input_layernorm``."""
    out = {}
    for k, v in sd.items():
        if k.startswith(TRTLLM_LAYER_PREFIX + "."):
            rest = k[len(TRTLLM_LAYER_PREFIX) + 1:]
            i, sep, tail = rest.partition(".")
            if num_layers > 1 and i.isdigit() and sep:
                k = f"layers.{i}.{tail}"
                if int(i) > 0 and tail == "hidden_norm.weight":
                    k = f"layers.{i}.input_layernorm.weight"
            else:
                k = f"layers.0.{rest}"
        out[k] = v
    return out


def _exported_eagle3_config(raw: dict, where):
    """The ``Eagle3DrafterConfig`` an exported config describes (either layout)."""
    layout = exported_layout(raw)
    if layout is None:
        raise DraftTrainError(f"{where}: not an exported EAGLE-3 config (no speculators_model_type: eagle3 and no "
                              "LlamaForCausalLMEagle3 architecture)")
    read = {"vllm": _read_vllm_layout, "sglang": _read_sglang_layout, TRTLLM_LAYOUT: _read_trtllm_layout}[layout]
    lc, taps, norms, target = read(raw, where)
    if taps is None:
        raise DraftTrainError(f"{where}: no eagle_aux_hidden_state_layer_ids (the taps must be explicit)")
    _warn_sliding_window(lc, where)
    try:
        rope = lc.get("rope_theta") or (lc.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return Eagle3DrafterConfig(
            hidden_size=int(lc["hidden_size"]), target_hidden_size=int(raw.get("target_hidden_size") or lc["hidden_size"]),
            intermediate_size=int(lc["intermediate_size"]), num_attention_heads=int(lc["num_attention_heads"]),
            num_key_value_heads=int(lc.get("num_key_value_heads") or lc["num_attention_heads"]),
            head_dim=int(lc.get("head_dim") or int(lc["hidden_size"]) // int(lc["num_attention_heads"])),
            vocab_size=int(lc["vocab_size"]), draft_vocab_size=int(raw["draft_vocab_size"]),
            rms_norm_eps=float(lc.get("rms_norm_eps", 1e-6)), rope_theta=float(rope),
            rope_scaling=_rope_scaling(lc),
            max_position_embeddings=int(lc.get("max_position_embeddings", 2048)),
            num_layers=int(lc.get("num_hidden_layers", 1)), tap_layers=[int(t) for t in taps],
            target_name_or_path=target, initializer_range=float(lc.get("initializer_range", 0.02)),
            qk_norm=lc.get("model_type") == "qwen3", **norms,  # a Qwen3 layer config: q/k norms (vLLM's reading)
        )
    except KeyError as e:
        raise DraftTrainError(f"{where}: missing key {e.args[0]!r}") from None


def _exported_eagle3_tensors(directory: Path, config, target_model, layout=None) -> dict[str, torch.Tensor]:
    """The export's tensors under the drafter's names: ``model.`` prefixes dropped, ``t2d`` rebuilt from (and
    checked against) ``d2t``, the embedding taken from ``target_model`` when the export has none."""
    from .data.vocab import d2t_target_ids

    weights = directory / WEIGHTS_NAME
    sd = load_tensors(weights)
    sd = {k[len("model."):] if k.startswith("model.") and k != "model.lm_head.weight" else k: v for k, v in sd.items()}
    if layout == TRTLLM_LAYOUT:
        sd = trtllm_to_drafter_names(sd, config.num_layers)
        if "d2t" not in sd and config.draft_vocab_size == config.vocab_size:  # TRT-LLM: no d2t = identity
            sd["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    if "d2t" not in sd or "lm_head.weight" not in sd:
        raise DraftTrainError(f"{weights}: needs d2t and lm_head.weight")
    sd["d2t"] = sd["d2t"].long()
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[d2t_target_ids(sd["d2t"])] = True
    if "t2d" in sd and not torch.equal(sd["t2d"].bool(), t2d):
        raise DraftTrainError(f"{weights}: t2d does not match d2t")
    sd["t2d"] = t2d
    if "embed_tokens.weight" not in sd:
        if target_model is None:
            raise DraftTrainError(f"{directory}: the export has no embed_tokens; load it with its target model")
        emb = target_model.get_input_embeddings().weight.detach()
        if tuple(emb.shape) != (config.vocab_size, config.hidden_size):
            raise DraftTrainError(f"{directory}: target embedding {tuple(emb.shape)} does not fit the drafter "
                                  f"({config.vocab_size}, {config.hidden_size})")
        sd["embed_tokens.weight"] = emb.to("cpu", torch.float32)
    return sd


def load_exported_eagle3(directory: str | Path, target_model=None, device=None):
    """An :class:`~drafttrain.drafters.eagle3.Eagle3Drafter` from an exported vLLM, SGLang or TensorRT-LLM
    directory, or a checkpoint speculators wrote (the same speculators layout, with ``embed_tokens`` and any of
    the norm flags ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output``).

    Without ``embed_tokens.weight`` in the directory (drafttrain's exports) the embedding is taken from
    ``target_model`` (the verifier), as the engines do.
    """
    directory = Path(directory)
    raw = read_json(directory / CONFIG_NAME)
    config = _exported_eagle3_config(raw, directory / CONFIG_NAME)
    sd = _exported_eagle3_tensors(directory, config, target_model, exported_layout(raw))
    model = Eagle3Drafter(config, sd["d2t"], sd["t2d"])
    dtype = sd["fc.weight"].dtype
    if dtype != torch.float32:
        model.to(dtype)
    expected = model.state_dict()
    check_state_dict(directory / WEIGHTS_NAME, expected, sd, against="its config")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in sd.items()}, strict=True)
    if device is not None:
        model.to(device)
    return model.eval()
