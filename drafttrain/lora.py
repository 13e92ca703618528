"""LoRA adapters on a causal LM (peft): add, save and load them.

Used by Medusa-2 (adapters on the target, trained jointly with the heads: training/medusa.py; loading a saved
Medusa-2 drafter merges its adapter into the target: artifacts.load_medusa) and by distillation with
``distill.use_lora`` (adapters on the draft: training/draft_model.py). peft is imported only when called.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from torch import nn

from .io import DraftTrainError, atomic_dir

__all__ = ["add_lora", "lora_target_modules", "save_lora", "load_lora"]


def add_lora(target_model: nn.Module, r: int = 32, alpha: int = 16, dropout: float = 0.05,
             target_modules: str | Sequence[str] | None = "all-linear"):
    """Wrap the target in LoRA adapters (``peft.get_peft_model``, task ``CAUSAL_LM``); the base weights are
    frozen. Defaults = the Medusa-2 Vicuna-7B recipe (r 32, alpha 16, dropout 0.05, all linear layers except
    the LM head). Note that peft injects the adapters into ``target_model`` in place."""
    from peft import LoraConfig, TaskType, get_peft_model

    if isinstance(target_modules, (list, tuple)):
        target_modules = list(target_modules)
    cfg = LoraConfig(r=int(r), lora_alpha=int(alpha), lora_dropout=float(dropout), target_modules=target_modules,
                     task_type=TaskType.CAUSAL_LM, bias="none")
    return get_peft_model(target_model, cfg)


def lora_target_modules(modules) -> str | list[str]:
    """A config's ``lora.target_modules`` list as peft takes it: ``["all-linear"]`` -> ``"all-linear"``."""
    mods = list(modules)
    return "all-linear" if mods == ["all-linear"] else mods


def save_lora(peft_model: nn.Module, directory: str | os.PathLike, overwrite: bool = True) -> None:
    """peft's ``save_pretrained`` (``adapter_config.json`` + ``adapter_model.safetensors``), atomically."""
    with atomic_dir(directory, overwrite=overwrite) as tmp:
        peft_model.save_pretrained(str(tmp), safe_serialization=True)


def load_lora(target_model: nn.Module, directory: str | os.PathLike, is_trainable: bool = False):
    """``PeftModel.from_pretrained(target_model, directory)`` (adapters injected into ``target_model``)."""
    from peft import PeftModel

    directory = Path(directory)
    if not (directory / "adapter_config.json").exists():
        raise DraftTrainError(f"{directory}: no adapter_config.json (not a peft adapter directory)")
    return PeftModel.from_pretrained(target_model, str(directory), is_trainable=is_trainable)
