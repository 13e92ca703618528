"""Load any Hugging Face causal LM as a frozen target, and resolve its hidden-state taps."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from ..io import DraftTrainError

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
    return config.get_text_config() if hasattr(config, "get_text_config") else config


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


def load_target(target_cfg, device: torch.device | str | None = None):
    """Return ``(model, tokenizer, path)``: the target in eval mode with gradients off, on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_target_path(target_cfg)
    if not Path(path).exists() and ("/" not in path or path.startswith((".", "/", "~"))):
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
    kwargs = dict(dtype=dtype, trust_remote_code=target_cfg.trust_remote_code, revision=target_cfg.revision)
    if target_cfg.attn_implementation:
        kwargs["attn_implementation"] = target_cfg.attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)
    except OSError as e:
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
    tokenizer = load_tokenizer(path, target_cfg.trust_remote_code, target_cfg.revision)
    return model, tokenizer, path


def target_id(path: str) -> str:
    """A stable identifier for the target recorded in drafters (absolute path for local dirs)."""
    p = Path(os.path.expanduser(path))
    return str(p.resolve()) if p.exists() else path
