"""Medusa-1/2 heads (FasterDecoding/Medusa; vLLM's on-disk format).

Head k (0-based) reads the target's final hidden state h_t -- the *post-norm* hidden that feeds the target's
``lm_head`` -- and predicts x_{t+2+k}: ``logits_k = lm_heads[k](blocks[k](h_t))`` where every block layer is
``x + SiLU(W x + b)``. ``W`` and ``b`` start at zero, so a fresh head is the target's LM head (identity
block); ``lm_heads[k]`` starts as a copy of the target's output embedding.

Which hidden state: in transformers 5 (checked on 5.24 for Llama and Qwen2) ``output_hidden_states[-1]``
*is* the final-norm output (``capture_outputs(tie_last_hidden_states=True)`` overwrites the last entry with
``last_hidden_state``), so ``lm_head(hidden_states[-1]) == logits``. Older transformers (4.x) returned the
pre-norm residual there. :func:`final_hidden` does not depend on this: it records the input of the
target's output embedding with a forward hook, which is by definition what the LM head sees.

Parameter names equal vLLM's Medusa names (``vllm/model_executor/models/medusa.py``):
``blocks.{h}.layers.{l}.weight`` [H, H], ``blocks.{h}.layers.{l}.bias`` [H] and ``lm_heads.{h}.weight``
[V, H]. ``config.json`` carries both our fields (``drafter_type``, ``num_heads``, ``num_layers``, ...) and
vLLM's (``model_type: medusa``, ``architectures: [MedusaModel]``, ``medusa_fc_bias``; vLLM renames
``num_layers`` to ``num_hidden_layers``). ``medusa_fc_bias`` must be true when the bias tensors are
present: vLLM's loader silently skips names it has no parameter for.

Medusa-2 (joint training, axolotl ``medusa_utils.py``) uses the same heads on a LoRA-adapted target: the
adapters are in drafttrain/lora.py, the method and its self-distillation loss in drafttrain/training/medusa.py.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from drafttrain.io import (DraftTrainError, atomic_dir, check_state_dict, load_tensors, read_drafter_config, read_json,
                           save_tensors, write_json)
from drafttrain.layout import (CONFIG_NAME, HEADS_DIR, HEADS_KEY, MEDUSA2_TYPE, MEDUSA_TYPE, TARGET_KEY, TYPE_KEY,
                               WEIGHTS_NAME, saved_type)

__all__ = [
    "MedusaHeads",
    "final_hidden",
    "heads_dir",
    "load_medusa_heads",
]

DRAFTER_TYPE = MEDUSA_TYPE  # the saved layout (file names, drafter_type; Medusa-2's): drafttrain/layout.py


class MedusaBlock(nn.Module):
    """``num_layers`` residual layers ``x + SiLU(W x + b)``, zero-initialised (identity at start)."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """K Medusa heads. ``forward(hidden [B, T, H]) -> logits [K, B, T, V]``; head k predicts x_{t+2+k}.

    Upstream Medusa zero-initialises only ``W`` (its bias keeps PyTorch's default init); here the bias is
    zeroed too, so a fresh head reproduces the target's logits exactly.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1,
                 bias: bool = True, target_name_or_path: str = "") -> None:
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("vocab_size", vocab_size), ("num_heads", num_heads)):
            if int(v) <= 0:
                raise DraftTrainError(f"medusa: {name} must be positive (got {v})")
        if int(num_layers) < 0:
            raise DraftTrainError(f"medusa: num_layers must be >= 0 (got {num_layers})")
        self.hidden_size = int(hidden_size)
        self.vocab_size = int(vocab_size)
        self.num_heads = int(num_heads)
        self.num_layers = int(num_layers)
        self.bias = bool(bias)
        self.target_name_or_path = str(target_name_or_path)
        self.blocks = nn.ModuleList(MedusaBlock(self.hidden_size, self.num_layers, self.bias)
                                    for _ in range(self.num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(self.hidden_size, self.vocab_size, bias=False)
                                      for _ in range(self.num_heads))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_target(cls, target_model: nn.Module, num_heads: int = 4, num_layers: int = 1, bias: bool = True,
                    target_name_or_path: str | None = None) -> "MedusaHeads":
        """Size the heads from the target's output embedding ``[V, H]`` and copy it into every ``lm_heads[k]``
        (float32). A bias on the target's LM head, logit soft-capping or logit scaling are not reproduced."""
        out = target_model.get_output_embeddings()
        w = getattr(out, "weight", None)
        if w is None or w.dim() != 2:
            raise DraftTrainError("medusa: the target has no output embedding (lm_head) weight to copy")
        V, H = (int(s) for s in w.shape)
        if target_name_or_path is None:
            target_name_or_path = getattr(getattr(target_model, "config", None), "_name_or_path", "") or ""
        heads = cls(H, V, num_heads=num_heads, num_layers=num_layers, bias=bias,
                    target_name_or_path=target_name_or_path)
        with torch.no_grad():
            for head in heads.lm_heads:
                head.weight.copy_(w.detach().to("cpu", torch.float32))
        return heads

    # ------------------------------------------------------------------ compute
    def head_logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Logits of head ``k`` only: ``[..., V]``."""
        x = hidden.to(self.lm_heads[k].weight.dtype)
        return self.lm_heads[k](self.blocks[k](x))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [B, T, H]`` (the target's final post-norm hidden state) -> ``[K, B, T, V]``."""
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"medusa: hidden width {hidden.shape[-1]} != hidden_size {self.hidden_size}")
        return torch.stack([self.head_logits(hidden, k) for k in range(self.num_heads)])

    # ------------------------------------------------------------------ persistence
    def config_dict(self) -> dict[str, Any]:
        return {
            TYPE_KEY: DRAFTER_TYPE,
            "model_type": "medusa",            # vLLM: MedusaConfig
            "architectures": ["MedusaModel"],
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,     # vLLM renames it to num_hidden_layers
            "medusa_fc_bias": self.bias,
            TARGET_KEY: self.target_name_or_path,
        }

    def save_pretrained(self, directory: str | os.PathLike, overwrite: bool = True) -> None:
        """Write ``config.json`` + ``model.safetensors`` (vLLM tensor names) atomically."""
        with atomic_dir(directory, overwrite=overwrite) as tmp:
            write_json(tmp / CONFIG_NAME, self.config_dict())
            save_tensors(tmp / WEIGHTS_NAME, dict(self.state_dict()),
                         metadata={"format": "pt", TYPE_KEY: DRAFTER_TYPE})

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, device=None) -> "MedusaHeads":
        directory = Path(directory)
        raw = read_drafter_config(directory, CONFIG_NAME, DRAFTER_TYPE)
        try:
            model = cls(int(raw["hidden_size"]), int(raw["vocab_size"]), num_heads=int(raw["num_heads"]),
                        num_layers=int(raw["num_layers"]), bias=bool(raw.get("medusa_fc_bias", True)),
                        target_name_or_path=str(raw.get(TARGET_KEY, "")))
        except KeyError as e:
            raise DraftTrainError(f"{directory / CONFIG_NAME}: missing key {e.args[0]!r}") from None
        weights = directory / WEIGHTS_NAME
        sd = load_tensors(weights)
        check_state_dict(weights, model.state_dict(), sd)
        dtype = sd["lm_heads.0.weight"].dtype
        if dtype.is_floating_point and dtype != torch.float32:
            model.to(dtype)
        model.load_state_dict(sd, strict=True)
        if device is not None:
            model.to(device)
        return model


# ------------------------------------------------------------------------------------------- target side
def heads_dir(path: Path, cfg: dict) -> Path:
    """The heads directory of a saved Medusa drafter: itself (medusa) or its ``heads`` subdirectory (medusa2)."""
    return path / cfg.get(HEADS_KEY, HEADS_DIR) if saved_type(cfg) == MEDUSA2_TYPE else path


def load_medusa_heads(path: str | os.PathLike, device=None) -> MedusaHeads:
    """The ``MedusaHeads`` of a saved Medusa-1 or Medusa-2 drafter (without touching any target)."""
    path = Path(path)
    return MedusaHeads.from_pretrained(heads_dir(path, read_json(path / CONFIG_NAME)), device=device)


def final_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run an HF causal LM (or a peft wrapper of one) and return ``(hidden [B, T, H], logits [B, T, V])``,
    ``hidden`` being the input of its output embedding (recorded by a forward hook), i.e. the post-norm
    state Medusa heads read. Gradients flow as the caller's grad mode allows."""
    head = model.get_output_embeddings()
    if head is None:
        raise DraftTrainError("medusa: model has no output embedding to hook")
    seen: list[torch.Tensor] = []

    def hook(_mod, args):
        seen.append(args[0])

    handle = head.register_forward_pre_hook(hook)
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    finally:
        handle.remove()
    if len(seen) != 1:
        raise DraftTrainError(f"medusa: expected one call of the LM head, saw {len(seen)}")
    hidden = seen[0]
    if hidden.shape[:2] != out.logits.shape[:2]:
        raise DraftTrainError("medusa: the LM head saw a sliced hidden state (logits_to_keep?)")
    return hidden, out.logits
