"""Load any Hugging Face causal LM as a frozen target, and resolve its hidden-state taps."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from ..io import DraftTrainError, looks_local
from .attention import use_grouped_sdpa

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DraftTrainError(f"target.device={device}: CUDA is not available on this machine")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise DraftTrainError(f"target.dtype={dtype}: expected one of auto, {', '.join(sorted(set(_DTYPES)))}")
    return _DTYPES[dtype]


def resolve_target_path(target_cfg) -> str:
    """``builtin`` -> the cached built-in target (built on first use); anything else is returned as given."""
    name = target_cfg.name_or_path
    if name == "builtin":
        from .builtin import BuiltinSpec, ensure_builtin_target

        spec = BuiltinSpec(**dataclasses.asdict(target_cfg.builtin)) if dataclasses.is_dataclass(target_cfg.builtin) \
            else BuiltinSpec(**dict(target_cfg.builtin))
        return str(ensure_builtin_target(spec))
    return name


def text_config(config):
    """The decoder's text config: a multimodal model's language-model section, the config itself for a plain
    causal LM. The one definition (targets, drafters, decoding, training read sizes through it); ``decoder=True``
    looks only at decoder-side sections (a causal LM target generates text)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def gather_taps(hidden_states, taps) -> torch.Tensor:
    """EAGLE-3's tap features: the HF ``hidden_states`` entries ``taps`` (indices, docs/design.md "Hidden-state
    taps") concatenated in that order on the last dim -> ``[..., len(taps) * H]``. The one definition (training
    capture, offline capture, the decoder's target runner)."""
    return torch.cat([hidden_states[i] for i in taps], dim=-1)


def num_layers(model) -> int:
    return int(text_config(model.config).num_hidden_layers)


def resolve_taps(n_layers: int, taps=None) -> tuple[int, int, int]:
    """EAGLE-3 taps as indices into HF ``hidden_states`` (0 = embeddings, L = last layer's output).

    Default ``(2, L//2, L-3)`` — the residual stream entering layers 2, L//2 and L-3 (vLLM convention).
    """
    if taps is None:
        if n_layers < 4:
            raise DraftTrainError(f"target has {n_layers} layers; EAGLE-3's default taps need at least 4")
        taps = (2, n_layers // 2, n_layers - 3)
    taps = tuple(int(t) for t in taps)
    if len(taps) != 3:
        raise DraftTrainError(f"eagle3.tap_layers={list(taps)}: expected exactly 3 layer indices")
    for t in taps:
        if not 0 <= t <= n_layers:
            raise DraftTrainError(
                f"eagle3.tap_layers={list(taps)}: index {t} is out of range for a target with {n_layers} layers "
                f"(valid: 0..{n_layers}, indices into hidden_states)"
            )
    return taps


def load_tokenizer(path: str, trust_remote_code: bool = False, revision: str | None = None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _target_config(target_cfg, device):
    """``(path, device, dtype, config)`` of the target; the errors of a bad path or a non-causal-LM config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_target_path(target_cfg)
    if looks_local(path) and not Path(path).expanduser().is_dir():
        raise DraftTrainError(f"target.name_or_path={path}: no such directory (and not a hub name)")
    dev = resolve_device(target_cfg.device) if device is None else torch.device(device)
    dtype = resolve_dtype(target_cfg.dtype, dev)
    try:
        config = AutoConfig.from_pretrained(
            path, trust_remote_code=target_cfg.trust_remote_code, revision=target_cfg.revision
        )
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DraftTrainError(f"target.name_or_path={path}: cannot load a model config ({first})") from None
    if type(config) not in AutoModelForCausalLM._model_mapping and not target_cfg.trust_remote_code:
        raise DraftTrainError(f"target.name_or_path={path}: {type(config).__name__} is not a causal language model")
    return path, dev, dtype, config


def load_target(target_cfg, device: torch.device | str | None = None):
    """Return ``(model, tokenizer, path)``: the target in eval mode with gradients off, on ``device``."""
    from transformers import AutoModelForCausalLM

    path, dev, dtype, config = _target_config(target_cfg, device)
    kwargs = dict(dtype=dtype, trust_remote_code=target_cfg.trust_remote_code, revision=target_cfg.revision)
    if target_cfg.attn_implementation:
        kwargs["attn_implementation"] = target_cfg.attn_implementation
    from safetensors import SafetensorError

    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)
    except (OSError, SafetensorError) as e:
        first = str(e).strip().splitlines()[0]
        raise DraftTrainError(f"target.name_or_path={path}: cannot load the model weights ({first})") from None
    except ValueError as e:
        if "Unrecognized configuration class" in str(e) or "does not support" in str(e):
            raise DraftTrainError(
                f"target.name_or_path={path}: {type(config).__name__} is not a causal language model"
            ) from None
        raise
    model.to(dev)
    model.eval()
    model.requires_grad_(False)
    use_grouped_sdpa(model)  # CPU + GQA + masks: no repeated K/V heads (targets/attention.py)
    tokenizer = load_tokenizer(path, target_cfg.trust_remote_code, target_cfg.revision)
    return model, tokenizer, path


# ------------------------------------------------------------------------------ part of the target only
class _NotFromFile(Exception):
    """A reason to load the whole target instead of its parts (one line)."""


def load_target_parts(target_cfg, device: torch.device | str | None = None, *, first_layers: int = 0,
                      say: Callable[[str], None] | None = None):
    """Return ``(model, tokenizer, path)`` like :func:`load_target`, with only what training from stored features
    reads in memory: every tensor of the target except those of its decoder layers ``first_layers``.. (so the input
    and output embeddings, the final norm, and the first ``first_layers`` decoder layers, which
    ``distill.init=from_target_layers`` copies). The other decoder layers stay on the ``meta`` device (no memory),
    as do buffers that are not in checkpoints (rotary tables): the result is not meant to run a forward, and
    running one fails loudly. :func:`is_partial` tells such a model apart.

    The model is built from its config on ``meta`` and the kept tensors are read one by one from the checkpoint's
    safetensors files (``model.safetensors``, or the shards of ``model.safetensors.index.json``), in the dtype
    ``from_pretrained`` gives them; tied tensors (``tie_word_embeddings``) stay tied. Config, tokenizer and
    ``generation_config`` are the ones :func:`load_target` gives. Where a kept tensor cannot be read under the
    model's own name (no safetensors checkpoint, renamed keys, a quantized checkpoint, ...) the whole target is
    loaded instead, with a one-line note through ``say``; a tensor is never left randomly initialised."""
    say = say or (lambda m: print(f"[drafttrain] {m}", flush=True))
    path, dev, dtype, config = _target_config(target_cfg, device)
    try:
        model = _load_parts(target_cfg, path, dev, dtype, config, int(first_layers))
    except _NotFromFile as e:
        say(f"target: {e}; loading the whole target")
        return load_target(target_cfg, device=dev)
    tokenizer = load_tokenizer(path, target_cfg.trust_remote_code, target_cfg.revision)
    return model, tokenizer, path


def is_partial(model) -> bool:
    """Whether ``model`` came from :func:`load_target_parts` with some decoder layers left unloaded (on meta)."""
    return any(p.is_meta for p in model.parameters())


def _checkpoint_files(path: str, revision: str | None) -> dict[str, str]:
    """Tensor name -> local safetensors file of the checkpoint (single file or sharded index)."""
    from transformers.utils import cached_file

    def find(name: str) -> str | None:
        return cached_file(path, name, revision=revision, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)

    index = find("model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(Path(index).read_text()).get("weight_map") or {}
        files = {}
        for shard in sorted(set(weight_map.values())):
            local = find(shard)
            if local is None:
                raise _NotFromFile(f"shard {shard} of model.safetensors.index.json is missing")
            files[shard] = local
        return {name: files[shard] for name, shard in weight_map.items()}
    single = find("model.safetensors")
    if single is None:
        raise _NotFromFile("no safetensors checkpoint (model.safetensors or model.safetensors.index.json)")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _decoder_layers(model) -> tuple[str, torch.nn.ModuleList]:
    """``(qualified name, module list)`` of the target's decoder layers."""
    n = int(text_config(model.config).num_hidden_layers)
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(dec, "layers", None)
    if not (isinstance(layers, torch.nn.ModuleList) and len(layers) == n):
        raise _NotFromFile(f"cannot find the {n} decoder layers of {type(model).__name__}")
    return next(name for name, m in model.named_modules() if m is layers), layers


def _fp32_patterns(model, dtype: torch.dtype) -> re.Pattern | None:
    """``_keep_in_fp32_modules(_strict)``: the tensors from_pretrained keeps in float32 at this dtype."""
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    pats = [p.replace("*", ".*") for p, d in plan.items() if d == torch.float32]
    return re.compile("|".join(f"(?:{p})" for p in pats)) if pats else None


def _load_parts(target_cfg, path: str, dev: torch.device, dtype: torch.dtype, config, first_layers: int):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, GenerationConfig

    if getattr(config, "quantization_config", None):
        raise _NotFromFile("a quantized checkpoint")
    files = _checkpoint_files(path, target_cfg.revision)
    kwargs = {"dtype": dtype, "trust_remote_code": target_cfg.trust_remote_code}
    if target_cfg.attn_implementation:
        kwargs["attn_implementation"] = target_cfg.attn_implementation
    try:
        from transformers import initialization as hf_init
    except ImportError:  # older transformers
        hf_init = None
    safe_ops = getattr(hf_init, "meta_device_safe_creation_ops", None)
    try:  # as from_pretrained builds it before loading: on meta, no memory, no random init
        with torch.device("meta"), (safe_ops() if safe_ops else contextlib.nullcontext()):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _NotFromFile(f"cannot build {type(config).__name__} on the meta device ({first})") from None
    prefix, layers = _decoder_layers(model)
    skipped = tuple(f"{prefix}.{i}." for i in range(first_layers, len(layers)))

    # every tensor with a checkpoint name (parameters and persistent buffers), grouped by identity: a tied
    # tensor (lm_head.weight -> model.embed_tokens.weight) has several names and is read once, set at all
    groups: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
    fp32 = _fp32_patterns(model, dtype)
    handles: dict[str, object] = {}
    loaded: set[int] = set()
    try:
        for names in groups.values():
            if all(n.startswith(skipped) for n in names):
                continue
            found = [n for n in names if n in files]
            if not found:
                raise _NotFromFile(f"tensor {names[0]} is not in the checkpoint under that name")
            values = []
            for n in found:
                if files[n] not in handles:
                    handles[files[n]] = safe_open(files[n], framework="pt", device="cpu")
                values.append(handles[files[n]].get_tensor(n))
            if any(not torch.equal(v, values[0]) for v in values[1:]):
                raise _NotFromFile(f"the checkpoint holds different {' and '.join(found)}, which the model ties")
            old = model.get_parameter_or_buffer(names[0])
            if tuple(values[0].shape) != tuple(old.shape):
                raise _NotFromFile(f"tensor {found[0]} has shape {tuple(values[0].shape)} in the checkpoint, the "
                                   f"model expects {tuple(old.shape)}")
            want = torch.float32 if fp32 is not None and any(fp32.search(n) for n in names) else old.dtype
            value = values[0].to(device=dev, dtype=want)
            new = torch.nn.Parameter(value, requires_grad=False) if isinstance(old, torch.nn.Parameter) else value
            for n in names:
                owner, _, attr = n.rpartition(".")
                mod = model.get_submodule(owner)
                (mod._parameters if attr in mod._parameters else mod._buffers)[attr] = new
            loaded.add(id(new))
    finally:
        handles.clear()
    # every kept tensor was read from the checkpoint; every other one is still on meta
    for name, t in model.state_dict(keep_vars=True).items():
        if name.startswith(skipped) and id(t) not in loaded:
            if not t.is_meta:
                raise DraftTrainError(f"load_target_parts: {name} was materialised without being loaded")
        elif id(t) not in loaded:
            raise DraftTrainError(f"load_target_parts: {name} was not loaded from the checkpoint")
    if model.can_generate():  # what from_pretrained does: generation_config.json, else the one in config.json
        try:
            model.generation_config = GenerationConfig.from_pretrained(path, revision=target_cfg.revision)
        except OSError:
            model.generation_config = GenerationConfig.from_pretrained(
                path, config_file_name="config.json", _from_model_config=True, revision=target_cfg.revision)
    model.eval()
    model.requires_grad_(False)
    return model


def target_id(path: str) -> str:
    """A stable identifier for the target recorded in drafters (absolute path for local dirs)."""
    p = Path(os.path.expanduser(path))
    return str(p.resolve()) if p.exists() else path
