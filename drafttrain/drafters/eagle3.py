"""EAGLE-3 drafter: a plain ``nn.Module`` plus its preallocated KV cache.

Architecture (see docs/design.md and EAGLE-3's ``cnets.py``):

- ``fc``: ``Linear(3 * target_hidden -> H)`` fuses the three target taps; optionally preceded by one RMSNorm
  over the concatenated taps (``input_norm``, ``norm_before_fc``) and/or one per tap (``fc_norm.{0,1,2}``);
- ``embed_tokens``: copied from the target, frozen;
- ``layers.0``: RMS-normalises the token embedding (``input_layernorm``) and the hidden stream
  (``hidden_norm``) separately and concatenates them (2H) into q/k/v; the residual carries only the
  hidden stream (raw, or with ``norm_before_residual`` its ``hidden_norm`` output); then
  ``post_attention_layernorm`` + SwiGLU MLP;
- ``layers.1..``: plain Llama layers (H input);
- ``norm`` + ``lm_head`` (H -> draft vocabulary); buffers ``d2t`` (offsets) and ``t2d`` (membership).

The output hidden state handed to the next drafting step is the residual stream *before* the final norm
(with ``norm_output``, after it).

The optional norms follow the speculators (vllm-project/speculators ``models/eagle3``) and vLLM
(``llama_eagle3.py``) conventions of the same names, so a speculators-format checkpoint trained with any of
them loads here (``drafttrain.artifacts.load_exported_eagle3``) and computes what vLLM computes.

Training uses :meth:`Eagle3Drafter.ttt_forward` (training-time test, O(T^2 + steps*T) attention);
inference uses :meth:`Eagle3Drafter.step` with an :class:`Eagle3Cache`, or :meth:`Eagle3Drafter.step_static`
(the same step with static shapes, what compile / CUDA graphs run). Tests check that all of them agree.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from drafttrain.data.vocab import d2t_target_ids
from drafttrain.io import (DraftTrainError, atomic_dir, check_state_dict, load_tensors, read_drafter_config, save_tensors, write_json)
from drafttrain.layout import CONFIG_NAME, EAGLE3_TYPE, TYPE_KEY, WEIGHTS_NAME
from drafttrain.targets.load import text_config

__all__ = [
    "Eagle3DrafterConfig",
    "Eagle3Cache",
    "Eagle3Drafter",
    "ttt_reference_mask",
    "ttt_attention",
    "masked_attention",
    "sdpa_attention",
    "attention_bias",
]

DRAFTER_TYPE = EAGLE3_TYPE  # the saved layout (file names, drafter_type): drafttrain/artifacts.py


# ----------------------------------------------------------------------------------------------- config
@dataclass
class Eagle3DrafterConfig:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    # the target's RoPE scaling, HF ``rope_parameters`` without rope_theta (e.g. {"rope_type": "llama3",
    # "factor": 8.0, ...}); None: unscaled. linear, llama3 and yarn (static frequencies) are implemented
    rope_scaling: Optional[dict] = None
    num_layers: int = 1
    tap_layers: list[int] = field(default_factory=lambda: [2, 4, 5])
    target_name_or_path: str = ""
    target_num_layers: int = 0
    initializer_range: float = 0.02
    # EAGLE-3.1: an RMSNorm per tapped layer before fc (fc_norm.{0,1,2}); the post-norm hidden state handed to
    # the next drafting step (norm_output)
    fc_norm: bool = False
    norm_output: bool = False
    # Qwen3-style attention: RMSNorm over each head's q and k (self_attn.{q,k}_norm) before the rotary
    qk_norm: bool = False
    # speculators / vLLM conventions (speculators' trainer turns both on by default): layer 0's residual is
    # the hidden_norm-ed hidden stream, not the raw one (norm_before_residual); one RMSNorm over the
    # concatenated 3 * target_hidden taps before fc (norm_before_fc, weight input_norm.weight)
    norm_before_residual: bool = False
    norm_before_fc: bool = False

    def __post_init__(self) -> None:
        self.tap_layers = [int(t) for t in self.tap_layers]
        problems = []
        for name in ("hidden_size", "target_hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size", "num_layers"):
            if int(getattr(self, name)) <= 0:
                problems.append(f"{name} must be positive (got {getattr(self, name)})")
        if self.num_key_value_heads > 0 and self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            problems.append(f"head_dim must be even for rotary embeddings (got {self.head_dim})")
        if self.draft_vocab_size > self.vocab_size:
            problems.append(f"draft_vocab_size ({self.draft_vocab_size}) > vocab_size ({self.vocab_size})")
        if len(self.tap_layers) != 3:
            problems.append(f"tap_layers must have 3 entries (got {self.tap_layers})")
        self.rope_scaling = normalise_rope_scaling(self.rope_scaling)
        rtype = (self.rope_scaling or {}).get("rope_type", "default")
        if rtype not in SCALED_ROPE_TYPES:
            problems.append(f"rope_type {rtype!r} is not implemented by the drafter (implemented: default, "
                            f"{', '.join(SCALED_ROPE_TYPES[1:])}; dynamic / longrope depend on the sequence length)")
        if problems:
            raise DraftTrainError("invalid Eagle3DrafterConfig: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Eagle3DrafterConfig":
        return config_from_dict(cls, d, "Eagle3 config")


# ---------------------------------------------------------------------------------------------- helpers
def config_from_dict(cls, d: dict[str, Any], what: str):
    """A drafter config dataclass from a saved config dict: keys it does not know are ignored (a saved file
    carries drafter_type and the like), a missing required field is one line naming ``what``."""
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = sorted(required - d.keys())
    if missing:
        raise DraftTrainError(f"{what} is missing fields: {', '.join(missing)}")
    return cls(**{k: v for k, v in d.items() if k in names})


def _cfg_get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


SCALED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def normalise_rope_scaling(scaling: Optional[dict]) -> Optional[dict]:
    """HF rope parameters without the theta (None for unscaled RoPE); ``type`` (older configs) -> ``rope_type``."""
    if not scaling:
        return None
    d = {k: v for k, v in dict(scaling).items() if k != "rope_theta"}
    if "type" in d and "rope_type" not in d:
        d["rope_type"] = d.pop("type")
    d.pop("type", None)
    return None if d.get("rope_type", "default") == "default" else d


def rope_scaling_of(cfg: Any) -> Optional[dict]:
    """The RoPE scaling of an HF (text) config: transformers 5 ``rope_parameters`` or the older ``rope_scaling``."""
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):  # per-layer-type parameters
        rp = rp["full_attention"]
    if not isinstance(rp, dict) or "rope_type" not in rp and "type" not in rp:
        rp = getattr(cfg, "rope_scaling", None)
    return normalise_rope_scaling(rp) if isinstance(rp, dict) else None


def _rope_theta(cfg: Any) -> float:
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict):
        if "rope_theta" in rp:
            return float(rp["rope_theta"])
        # per-layer-type rope parameters (e.g. Gemma 3): take the full-attention one if present
        for key in ("full_attention", "default"):
            if isinstance(rp.get(key), dict) and "rope_theta" in rp[key]:
                return float(rp[key]["rope_theta"])
    return float(_cfg_get(cfg, "rope_theta", default=10000.0))


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of an HF causal LM (``model.model.layers`` and the like)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise DraftTrainError(f"{type(model).__name__}: no decoder layers to initialise the drafter from")
    return layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Llama RoPE, unscaled or with the target's static scaling (linear / llama3 / yarn: frequencies and the
    attention factor from transformers' ``ROPE_INIT_FUNCTIONS``, as the target and the engines compute them).
    Frequencies are kept in float32 outside the state dict, so casting the module to bf16/fp16 does not
    degrade them."""

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict] = None,
                 max_position_embeddings: int = 2048) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = float(theta)
        self.scaling = normalise_rope_scaling(scaling)
        self.max_position_embeddings = int(max_position_embeddings)
        self._cache: dict[torch.device, tuple[torch.Tensor, float]] = {}

    def _frequencies(self, device: torch.device) -> tuple[torch.Tensor, float]:
        if device not in self._cache:
            if self.scaling is None:
                exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
                inv, factor = 1.0 / (self.theta ** exponent), 1.0
            else:
                from transformers import LlamaConfig
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                cfg = LlamaConfig(hidden_size=self.head_dim, num_attention_heads=1, head_dim=self.head_dim,
                                  max_position_embeddings=self.max_position_embeddings,
                                  rope_parameters={**self.scaling, "rope_theta": self.theta})
                inv, factor = ROPE_INIT_FUNCTIONS[self.scaling["rope_type"]](cfg, torch.device("cpu"))
            self._cache[device] = (inv.to(device=device, dtype=torch.float32), float(factor))
        return self._cache[device]

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        return self._frequencies(device)[0]

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids ``[..., T]`` -> cos, sin ``[..., T, head_dim]`` (times the attention factor)."""
        inv, factor = self._frequencies(position_ids.device)
        freqs = position_ids.float()[..., None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, heads, T, D]``; cos/sin ``[T, D]`` or ``[B, T, D]``."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


def _mask_value(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Plain GQA attention with a boolean mask (True = attend).

    q ``[B, Hq, Tq, D]``, k/v ``[B, Hkv, S, D]``, mask broadcastable to ``[B, Tq, S]`` -> ``[B, Hq, Tq, D]``.
    Softmax is computed in float32. A fully masked row yields a uniform average instead of NaN.
    """
    B, Hq, Tq, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    qg = q.reshape(B, Hkv, g, Tq, D)
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)).float() / math.sqrt(D)  # [B,Hkv,g,Tq,S]
    m = mask.to(torch.bool)
    while m.dim() < 3:
        m = m.unsqueeze(0)
    scores = scores.masked_fill(~m[:, None, None], _mask_value(scores.dtype))
    p = scores.softmax(-1).to(v.dtype)
    out = torch.matmul(p, v.unsqueeze(2))
    return out.reshape(B, Hq, Tq, D)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`masked_attention` through ``scaled_dot_product_attention`` (a fused kernel; under
    ``torch.compile`` on CPU about 3x faster for one query row over a long cache): the boolean mask
    ``[B, Tq, S]`` becomes an additive one with the dtype's lowest value, so a fully masked row still averages
    uniformly instead of giving NaN."""
    m = torch.where(mask.to(torch.bool), 0.0, _mask_value(q.dtype)).to(q.dtype)
    while m.dim() < 3:
        m = m.unsqueeze(0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m[:, None], enable_gqa=q.shape[1] != k.shape[1])


def attention_bias(mask: torch.Tensor) -> torch.Tensor:
    """Boolean mask ``[B, Tq, S]`` (True = attend) -> additive float32 bias ``[B, 1, 1, Tq, S]`` (0, or the
    lowest float32 where masked) for :func:`ttt_attention`'s grouped scores. Built once per forward: adding it
    costs one pass and nothing in the backward, where ``masked_fill`` with a broadcast mask is a slow kernel
    both ways."""
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return bias.masked_fill_(~mask.to(torch.bool), _mask_value(torch.float32))[:, None, None]


class _TTTKeys:
    """Keys/values of a TTT unroll, per draft layer: step 0's (every query's causal context) and each later
    step's (seen only by the query at the same index)."""

    def __init__(self, num_layers: int):
        self.k0: list[torch.Tensor | None] = [None] * num_layers
        self.v0: list[torch.Tensor | None] = [None] * num_layers
        self.kd: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.vd: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def add(self, layer: int, step: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if step == 0:
            self.k0[layer], self.v0[layer] = k, v
        else:
            self.kd[layer].append(k)
            self.vd[layer].append(v)

    def split(self, layer: int):
        """``(k0, v0, k_diag, v_diag)``, the arguments of :func:`ttt_attention`."""
        return self.k0[layer], self.v0[layer], self.kd[layer], self.vd[layer]

    def joined(self, layer: int):
        """All keys and values concatenated along the sequence (the reference path's layout)."""
        return (torch.cat([self.k0[layer], *self.kd[layer]], dim=2),
                torch.cat([self.v0[layer], *self.vd[layer]], dim=2))


def ttt_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    k_diag: list[torch.Tensor],
    v_diag: list[torch.Tensor],
    mask0: torch.Tensor,
) -> torch.Tensor:
    """Training-time-test attention in O(T^2 + steps*T).

    Query at index t attends to the step-0 keys allowed by ``mask0`` (``[B, T, T]``, causal + key padding)
    and to the key at index t of every later step (``k_diag[j]`` ``[B, Hkv, T, D]``). One softmax over both.
    ``mask0`` may also be the additive bias of :func:`attention_bias` (what the training forward passes).

    The queries may be a subset of the step-0 positions (``q`` ``[B, Hq, Tq, D]``, ``mask0`` ``[B, Tq, S]``
    with the step-0 keys ``[B, Hkv, S, D]``, ``k_diag[j]`` ``[B, Hkv, Tq, D]`` at the queries' own positions):
    the live positions of :meth:`Eagle3Drafter.ttt_forward`.

    One autograd node (:class:`_TTTAttention`) with its own backward: the scores are one batched matmul per
    key-value head (the query heads of a group stacked as rows), the softmax runs in place over the step-0
    scores with the diagonal terms beside them (no concatenated ``[Tq, S + steps]`` table and no slices of
    it in the backward), and only the probabilities are kept for the backward. The softmax runs in float32 (or
    the inputs' dtype when wider).
    """
    bias = mask0 if mask0.is_floating_point() else attention_bias(mask0)
    if bias.dim() == 3:
        bias = bias[:, None, None]
    return _TTTAttention.apply(q, k0, v0, bias, *k_diag, *v_diag)


class _TTTAttention(torch.autograd.Function):
    """:func:`ttt_attention`'s math. Inputs ``q, k0, v0, bias, *k_diag, *v_diag``. Scores and probabilities
    are ``[B, Hkv, g*Tq, S]`` (g = Hq / Hkv query heads per key-value head) plus ``[B, Hkv, g*Tq, n]`` for the
    n diagonal keys."""

    # exp() of arguments below about -87 (float32 underflow) takes a slow path on the CPU: the shifted scores
    # are clamped here first, and masked keys are then zeroed exactly (a kept key this far below the row's
    # maximum has probability < 2e-35 either way)
    _EXP_FLOOR = -80.0

    @staticmethod
    def forward(ctx, q, k0, v0, bias, *kv):
        n = len(kv) // 2
        k_diag, v_diag = kv[:n], kv[n:]
        B, Hq, Tq, D = q.shape
        Hkv, S = k0.shape[1], k0.shape[2]
        g = Hq // Hkv
        acc = torch.promote_types(q.dtype, torch.float32)             # the softmax's dtype: float32 or wider
        qs = (q * (1.0 / math.sqrt(D))).reshape(B, Hkv, g * Tq, D)  # the scale on q: [Tq, D], not [Tq, S]
        s = torch.matmul(qs, k0.transpose(-1, -2)).to(acc)            # [B, Hkv, g*Tq, S]
        s.view(B, Hkv, g, Tq, S).add_(bias)
        m = s.amax(-1, keepdim=True)
        if n:
            qg = qs.view(B, Hkv, g, Tq, D)
            d = torch.stack([torch.linalg.vecdot(qg, kj.unsqueeze(2)) for kj in k_diag], -1)
            d = d.reshape(B, Hkv, g * Tq, n).to(acc)
            m = torch.maximum(m, d.amax(-1, keepdim=True))
            pd = d.sub_(m).clamp_(min=_TTTAttention._EXP_FLOOR).exp_()
        p = s.sub_(m).clamp_(min=_TTTAttention._EXP_FLOOR).exp_()
        p.view(B, Hkv, g, Tq, S).mul_((bias > _mask_value(torch.float32) / 2).to(p.dtype))
        z = p.sum(-1, keepdim=True)
        if n:
            z = z + pd.sum(-1, keepdim=True)
        z.clamp_(min=torch.finfo(acc).tiny)  # a query with every key masked (packed padding): p = 0
        if n:
            pd.div_(z)
        p.div_(z)
        out = torch.matmul(p.to(v0.dtype), v0)                         # [B, Hkv, g*Tq, D]
        if n:
            og, pdg = out.view(B, Hkv, g, Tq, D), pd.view(B, Hkv, g, Tq, n).to(v0.dtype)
            for j, vj in enumerate(v_diag):
                og.addcmul_(pdg[..., j : j + 1], vj.unsqueeze(2))
            ctx.save_for_backward(qs, k0, v0, p, pd, *k_diag, *v_diag)
        else:
            ctx.save_for_backward(qs, k0, v0, p)
        ctx.shape = (B, Hq, Tq, D, Hkv, S, g, n)
        return out.view(B, Hq, Tq, D)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        B, Hq, Tq, D, Hkv, S, g, n = ctx.shape
        qs, k0, v0, p, *rest = ctx.saved_tensors
        do = dout.reshape(B, Hkv, g * Tq, D)
        dp = torch.matmul(do, v0.transpose(-1, -2)).to(p.dtype)        # d loss / d p, [B, Hkv, g*Tq, S]
        c = torch.linalg.vecdot(p, dp).unsqueeze(-1)                   # sum_k p_k dp_k over all keys
        if n:
            pd, k_diag, v_diag = rest[0], rest[1 : 1 + n], rest[1 + n :]
            dog = do.view(B, Hkv, g, Tq, D)
            dpd = torch.stack([torch.linalg.vecdot(dog, vj.unsqueeze(2)) for vj in v_diag], -1)
            dpd = dpd.reshape(B, Hkv, g * Tq, n).to(p.dtype)
            c = c + torch.linalg.vecdot(pd, dpd).unsqueeze(-1)
            dd = dpd.sub_(c).mul_(pd)                                  # d loss / d diagonal scores
        ds = dp.sub_(c).mul_(p).to(qs.dtype)                           # d loss / d step-0 scores
        dqs = torch.matmul(ds, k0)
        dk0 = torch.matmul(ds.transpose(-1, -2), qs)
        dv0 = torch.matmul(p.to(do.dtype).transpose(-1, -2), do)
        grads = []
        if n:
            qg, dqg = qs.view(B, Hkv, g, Tq, D), dqs.view(B, Hkv, g, Tq, D)
            ddg = dd.view(B, Hkv, g, Tq, n).to(qs.dtype)
            pdg = pd.view(B, Hkv, g, Tq, n).to(do.dtype)
            dk = []
            for j, kj in enumerate(k_diag):
                dqg.addcmul_(ddg[..., j : j + 1], kj.unsqueeze(2))
                dk.append((ddg[..., j : j + 1] * qg).sum(2))
            grads = dk + [(pdg[..., j : j + 1] * dog).sum(2) for j in range(n)]
        dq = dqs.mul_(1.0 / math.sqrt(D)).view(B, Hq, Tq, D)
        return (dq, dk0, dv0, None, *grads)


def _causal_padding_mask(attention_mask: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T]`` (1 = real) -> ``[B, T, T]``: key s visible to query t iff s <= t and s is real (and, for
    packed rows, s lies in t's document)."""
    B, T = attention_mask.shape
    causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()
    mask = causal[None] & attention_mask.to(torch.bool)[:, None, :]
    if doc_ids is not None:
        mask = mask & (doc_ids[:, :, None] == doc_ids[:, None, :])
    return mask


def ttt_reference_mask(T: int, step: int, attention_mask: torch.Tensor) -> torch.Tensor:
    """Explicit TTT mask over the concatenated keys of steps ``0..step``: ``[B, T, (step+1)*T]`` bool.

    Key ``j*T + s`` (step j, index s) is visible to query t iff (j == 0 and s <= t and s is real) or
    (j >= 1 and s == t). Slow (O(steps*T^2)); for tests and debugging.
    """
    attention_mask = attention_mask.to(torch.bool)
    if attention_mask.shape[-1] != T:
        raise ValueError(f"attention_mask has length {attention_mask.shape[-1]}, expected {T}")
    blocks = [_causal_padding_mask(attention_mask)]
    eye = torch.eye(T, dtype=torch.bool, device=attention_mask.device)
    B = attention_mask.shape[0]
    blocks += [eye.expand(B, T, T)] * step
    return torch.cat(blocks, dim=-1)


def noisy_taps(taps: torch.Tensor, scale: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """EAGLE-1's feature augmentation for training: ``[B, T, 3*H]`` taps + ``U(-scale, scale)`` noise times each
    tap's RMS at that position (per tap and position, so the noise is relative to the raw residual stream's
    scale, which differs per layer; after ``fc_norm`` it is about ``scale`` per coordinate). The drafter then
    learns from slightly perturbed features, as it reads features of its own uncertain context at decode time."""
    if scale <= 0:
        return taps
    B, T, W = taps.shape
    x = taps.float().reshape(B, T, 3, W // 3)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype) * 2 - 1
    return (x + scale * rms * u).reshape(B, T, W).to(taps.dtype)


def _live_positions(live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` bool -> (``idx`` ``[B, T1]``, ``slot`` ``[B, T1]`` bool): each row's live positions in
    ascending order, padded to the longest row's count ``T1`` (>= 1) with other positions (``slot`` False)."""
    counts = live.sum(1)
    T1 = max(int(counts.max()), 1) if live.numel() else 1
    idx = torch.argsort((~live).to(torch.uint8), dim=1, stable=True)[:, :T1]
    slot = torch.arange(T1, device=live.device)[None] < counts[:, None]
    return idx, slot


def _shift_left(input_ids: torch.Tensor, n: int, pad_id: int = 0) -> torch.Tensor:
    if n == 0:
        return input_ids
    B, T = input_ids.shape
    pad = torch.full((B, min(n, T)), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    return torch.cat([input_ids[:, n:], pad], dim=1)


# ---------------------------------------------------------------------------------------------- modules
class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3DrafterConfig, in_dim: int) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x ``[B, T, in]`` -> rotated q ``[B, Hq, T, D]``, rotated k and v ``[B, Hkv, T, D]``."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        B, H, T, D = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(B, T, H * D))


class Eagle3MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """Layer 0 (``first=True``): [norm(embed); hidden_norm(hidden)] -> attention. Others: plain Llama.

    Layer 0's residual is its input hidden stream, or with ``norm_before_residual`` that stream's
    ``hidden_norm`` output (the one the attention reads)."""

    def __init__(self, cfg: Eagle3DrafterConfig, first: bool) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.first = first
        self.norm_before_residual = bool(first and cfg.norm_before_residual)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, 2 * H if first else H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(H, cfg.intermediate_size)

    def attn_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if self.first:
            return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        return self.input_layernorm(hidden)

    def finish(self, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output from its attention output and its input hidden stream ``hidden`` (the one
        passed to :meth:`attn_input`): residual add, then post-attention norm + MLP."""
        residual = self.hidden_norm(hidden) if self.norm_before_residual else hidden
        h = residual + self.self_attn.out(attn)
        return h + self.mlp(self.post_attention_layernorm(h))


# ------------------------------------------------------------------------------------------------ cache
class Eagle3Cache:
    """Preallocated per-layer K/V ``[B, Hkv, max_len, D]`` plus a fill ``length``.

    Entries at positions >= ``length`` are dead. Rollback is by index (:meth:`truncate`); accepted tree
    paths are compacted with :meth:`keep`.
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        if max_len <= 0 or batch_size <= 0:
            raise ValueError(f"batch_size and max_len must be positive (got {batch_size}, {max_len})")
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    def head(self, rows: int) -> "Eagle3Cache":
        """A cache over the first ``rows`` rows of this one's buffers (views: its writes land here), with this
        cache's length (batched decoding keeps a fixed buffer and decodes its leading, active rows)."""
        out = Eagle3Cache.__new__(Eagle3Cache)
        out.k, out.v = [t[:rows] for t in self.k], [t[:rows] for t in self.v]
        out.length = self.length
        return out

    def truncate(self, n: int) -> None:
        """Keep positions ``[0, n)``."""
        n = int(n)
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate cache of length {self.length} to {n}")
        self.length = n

    def keep(self, indices: torch.Tensor, start: int | None = None) -> None:
        """Compact: positions ``< start`` stay; the positions in ``indices`` move to ``start, start+1, ...``.

        ``indices``: LongTensor ``[k]`` (same for every row) or ``[B, k]`` (per row) of absolute positions,
        all in ``[start, length)``. ``start`` defaults to the smallest index. Afterwards
        ``length == start + k``.
        """
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.k[0].device)
        if idx.dim() not in (1, 2) or (idx.dim() == 2 and idx.shape[0] != self.batch_size):
            raise ValueError(f"indices must be [k] or [batch={self.batch_size}, k], got {tuple(idx.shape)}")
        kept = idx.shape[-1]
        if kept == 0:
            if start is None:
                raise ValueError("keep() with no indices needs an explicit start")
            self.truncate(start)
            return
        start = int(idx.min()) if start is None else int(start)
        if int(idx.min()) < start or int(idx.max()) >= self.length:
            raise ValueError(f"keep indices must lie in [{start}, {self.length})")
        for buf in (*self.k, *self.v):
            if idx.dim() == 1:
                sel = buf.index_select(2, idx)
            else:
                B, Hkv, _, D = buf.shape
                sel = buf.gather(2, idx[:, None, :, None].expand(B, Hkv, kept, D))
            buf[:, :, start : start + kept] = sel
        self.length = start + kept


# ---------------------------------------------------------------------------------------------- drafter
class Eagle3Drafter(nn.Module):
    def __init__(self, config: Eagle3DrafterConfig, d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        c = config
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        if c.norm_before_fc:
            self.input_norm = RMSNorm(3 * c.target_hidden_size, c.rms_norm_eps)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(3)])
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList([Eagle3Layer(c, first=(i == 0)) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        if d2t is None:
            d2t = torch.zeros(c.draft_vocab_size, dtype=torch.long)
        if t2d is None:
            t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
            t2d[: c.draft_vocab_size] = True
        self._check_vocab(d2t, t2d)
        self.register_buffer("d2t", d2t.to(torch.long).clone())
        self.register_buffer("t2d", t2d.to(torch.bool).clone())
        self.reset_parameters()

    def _check_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        c = self.config
        if d2t.dim() != 1 or d2t.numel() != c.draft_vocab_size:
            raise DraftTrainError(f"d2t must have {c.draft_vocab_size} entries (draft vocab), got {tuple(d2t.shape)}")
        if t2d.dim() != 1 or t2d.numel() != c.vocab_size:
            raise DraftTrainError(
                f"t2d must have {c.vocab_size} entries (the target's embedding rows), got {tuple(t2d.shape)}"
            )
        targets = d2t_target_ids(d2t)
        if (targets < 0).any() or (targets >= c.vocab_size).any() or (targets[1:] <= targets[:-1]).any():
            raise DraftTrainError("d2t offsets do not give strictly increasing target ids inside the vocabulary")
        if int(t2d.sum()) != d2t.numel() or not bool(t2d.to(targets.device)[targets].all()):
            raise DraftTrainError("d2t and t2d disagree (t2d must mark exactly the ids d2t maps to)")

    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        with torch.no_grad():
            nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=std)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_target(
        cls,
        target_model: nn.Module,
        tap_layers,
        d2t: torch.Tensor,
        t2d: torch.Tensor,
        num_layers: int = 1,
        target_name_or_path: str = "",
        fc_norm: bool = False,
        norm_output: bool = False,
        qk_norm: bool = False,
        init_layer: int | None = None,
        norm_before_residual: bool = False,
        norm_before_fc: bool = False,
    ) -> "Eagle3Drafter":
        """Size the drafter from ``target_model.config``; copy (and freeze) its input embedding; initialise
        ``lm_head`` from the target's output-embedding rows of the draft vocabulary. ``init_layer`` (a target
        decoder layer index, negative from the end) also initialises the draft layers from that target layer
        where shapes allow (:meth:`init_layers_from`)."""
        cfg = text_config(target_model.config)
        emb = target_model.get_input_embeddings().weight
        H = int(_cfg_get(cfg, "hidden_size"))
        heads = int(_cfg_get(cfg, "num_attention_heads"))
        L = int(_cfg_get(cfg, "num_hidden_layers"))
        taps = [int(t) for t in tap_layers]
        if len(taps) != 3 or any(not 0 <= t <= L for t in taps):
            raise DraftTrainError(f"tap_layers must be 3 hidden_states indices in [0, {L}], got {list(tap_layers)}")
        if emb.shape[1] != H:
            raise DraftTrainError(f"target embedding width {emb.shape[1]} != hidden_size {H}")
        config = Eagle3DrafterConfig(
            hidden_size=H,
            target_hidden_size=H,
            intermediate_size=int(_cfg_get(cfg, "intermediate_size", default=4 * H)),
            num_attention_heads=heads,
            num_key_value_heads=int(_cfg_get(cfg, "num_key_value_heads", default=heads)),
            head_dim=int(_cfg_get(cfg, "head_dim", default=H // heads)),
            vocab_size=int(emb.shape[0]),
            draft_vocab_size=int(d2t.numel()),
            rms_norm_eps=float(_cfg_get(cfg, "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", default=1e-6)),
            rope_theta=_rope_theta(cfg),
            rope_scaling=rope_scaling_of(cfg),
            max_position_embeddings=int(_cfg_get(cfg, "max_position_embeddings", default=2048)),
            num_layers=int(num_layers),
            tap_layers=taps,
            target_name_or_path=str(target_name_or_path),
            target_num_layers=L,
            initializer_range=float(_cfg_get(cfg, "initializer_range", default=0.02)),
            fc_norm=bool(fc_norm), norm_output=bool(norm_output), qk_norm=bool(qk_norm),
            norm_before_residual=bool(norm_before_residual), norm_before_fc=bool(norm_before_fc),
        )
        model = cls(config, d2t.detach().cpu(), t2d.detach().cpu())
        if init_layer is not None:
            model.init_layers_from(target_model, int(init_layer))
        with torch.no_grad():
            model.embed_tokens.weight.copy_(emb.detach().to("cpu", torch.float32))
            out = target_model.get_output_embeddings() if hasattr(target_model, "get_output_embeddings") else None
            if out is not None and getattr(out, "weight", None) is not None and out.weight.shape == emb.shape:
                ids = model.draft_target_ids().to(out.weight.device)
                model.lm_head.weight.copy_(out.weight.detach()[ids].to("cpu", torch.float32))
        return model

    @torch.no_grad()
    def init_layers_from(self, target_model: nn.Module, index: int) -> list[str]:
        """Copy target decoder layer ``index`` (negative: from the end) into every draft layer, tensor by
        tensor where the shapes match: o_proj, the MLP, the norms (and q/k norms). Layer 0's q/k/v read
        ``[norm(embedding); hidden_norm(hidden)]`` (2H inputs): both halves get the target's projection, halved,
        so at the start they apply the target layer to the mean of the two streams. Returns the names set."""
        layers = _decoder_layers(target_model)
        if not -len(layers) <= index < len(layers):
            raise DraftTrainError(f"eagle3.experimental.init_layer={index}: the target has {len(layers)} "
                                  "decoder layers")
        src = dict(layers[index].named_parameters())
        done = []
        for li, layer in enumerate(self.layers):
            for name, p in layer.named_parameters():
                s = src.get(name if name != "hidden_norm.weight" else "input_layernorm.weight")
                if s is None:
                    continue
                if s.shape == p.shape:
                    p.copy_(s.detach().to(p.device, p.dtype))
                elif name.split(".")[-2] in ("q_proj", "k_proj", "v_proj") and p.shape == (s.shape[0], 2 * s.shape[1]):
                    half = (0.5 * s.detach()).to(p.device, p.dtype)
                    p.copy_(torch.cat([half, half], dim=1))
                else:
                    continue
                done.append(f"layers.{li}.{name}")
        return done

    # ------------------------------------------------------------------ small API
    def draft_target_ids(self) -> torch.Tensor:
        """Target id of every draft id, ``[Vd]`` ascending."""
        return d2t_target_ids(self.d2t)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Every parameter but the (frozen) token embedding and anything else frozen (``freeze_lm_head``)."""
        return [p for n, p in self.named_parameters() if not n.startswith("embed_tokens.") and p.requires_grad]

    def freeze_lm_head(self) -> None:
        """Keep ``lm_head`` (the target's output-embedding rows of the draft vocabulary, from
        :meth:`from_target`) fixed in training, as speculators' trainer does: no weight gradient, no optimizer
        state; the draft layer learns to produce hidden states the target's own head reads."""
        self.lm_head.weight.requires_grad_(False)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """``[B, T, 3*Ht]`` -> ``[B, T, H]``: ``input_norm`` over all three taps (``norm_before_fc``), then one
        norm per tap (``fc_norm``), then ``fc`` (the order vLLM's ``combine_hidden_states`` applies them)."""
        if taps.shape[-1] != self.fc.in_features:
            raise DraftTrainError(
                f"taps have width {taps.shape[-1]}, expected 3 x target_hidden = {self.fc.in_features}"
            )
        taps = taps.to(self.fc.weight.dtype)
        if hasattr(self, "input_norm"):
            taps = self.input_norm(taps)
        if hasattr(self, "fc_norm"):
            taps = torch.cat([n(x) for n, x in zip(self.fc_norm, taps.chunk(3, dim=-1))], dim=-1)
        return self.fc(taps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def output_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden state handed to the next drafting step: the last layer's residual stream, or with
        ``norm_output`` (EAGLE-3.1) its final-norm output, what the lm_head reads."""
        return self.norm(hidden) if self.config.norm_output else hidden

    def logits_to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Scatter draft logits ``[..., Vd]`` to target ids ``[..., V]``; -inf elsewhere."""
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.draft_target_ids().to(logits.device)] = logits
        return out

    # ------------------------------------------------------------------ training (TTT)
    def forward(self, input_ids, taps, attention_mask, ttt_steps: int, position_ids=None, doc_ids=None,
                step_loss=None, checkpoint_head: bool = False, valid=None):
        """Training forward (the TTT unroll), so DDP/DeepSpeed/FSDP wrappers see a normal ``forward``."""
        return self.ttt_forward(input_ids, taps, attention_mask, ttt_steps, position_ids=position_ids,
                                doc_ids=doc_ids, step_loss=step_loss, checkpoint_head=checkpoint_head, valid=valid)

    def ttt_forward(
        self,
        input_ids: torch.Tensor,
        taps: torch.Tensor,
        attention_mask: torch.Tensor,
        ttt_steps: int,
        attention_impl: str = "efficient",
        return_hidden: bool = False,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        step_loss=None,
        checkpoint_head: bool = False,
        valid: list[torch.Tensor] | None = None,
        compact: bool = True,
    ):
        """Unroll ``ttt_steps`` drafting steps (docs/design.md, "EAGLE-3 alignment").

        ``step_loss(i, rows, head) -> dict of tensors``: return that per step instead of the logits. ``valid``
        (one ``[B, T]`` bool per step) says which positions step i scores; ``rows`` ``[N_i, H]`` are step i's
        output hidden states at those positions (row-major order), and ``head`` (norm + lm_head) is applied
        by the callback (the loss is computed inside the forward, so a DDP wrapper sees every parameter
        used). With ``checkpoint_head`` each step's norm + lm_head + loss run under activation checkpointing:
        only the ``[N_i, H]`` rows are kept for the backward, not the ``[N_i, Vd]`` logits and the loss's
        softmaxes (recomputed one step at a time).

        Live positions (with ``step_loss`` and ``compact``): step 0 runs on every position (its keys are what
        later steps attend to), but from step 1 on a position matters only if some step >= 1 scores it: a
        later step at index t reads the step-0 keys and its own earlier steps at t, nothing else of the other
        positions. Steps 1.. therefore run on those positions only, gathered per row into ``[B, T1, ...]``
        (prompt tokens, the ends of documents and padding drop out); loss and gradients are those of the
        full unroll (tests/test_packing.py).

        Packed rows (drafttrain.data.packing) pass ``position_ids`` (restarting per document) and ``doc_ids``:
        step-0 keys are then visible only inside a query's document; the later steps' keys sit at the
        query's own index, so they are always its document's.

        Returns a list of per-step draft logits ``[B, T, Vd]`` (and, with ``return_hidden``, the list of
        per-step output hidden states ``[B, T, H]``). ``attention_impl="reference"`` uses the explicit
        mask of :func:`ttt_reference_mask` (slow; for tests).
        """
        self._check_ttt_args(input_ids, taps, attention_mask, ttt_steps, attention_impl, return_hidden,
                             doc_ids, step_loss, valid)
        B, T = input_ids.shape
        device = input_ids.device
        hidden = self.fuse(taps)
        dtype = hidden.dtype
        mask_q = mask0 = _causal_padding_mask(attention_mask, doc_ids)
        pos = torch.arange(T, device=device) if position_ids is None else position_ids.to(device)
        ids_of = lambda n: _shift_left(input_ids, n)  # noqa: E731  (the token ids step n - 1 embeds)
        masks = None if valid is None else [m.to(device=device, dtype=torch.bool) for m in valid]
        kv = _TTTKeys(len(self.layers))
        logits_out, hidden_out = [], []
        bias = None  # attention_bias(mask_q), built on first use (and again for the live positions)
        for i in range(ttt_steps):
            if i == 1 and step_loss is not None and compact and attention_impl == "efficient":
                idx, slot = _live_positions(torch.stack(masks[1:ttt_steps]).any(0))
                hidden = hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))
                mask_q = mask0.gather(1, idx[..., None].expand(-1, -1, T)) & slot[..., None]
                pos = pos.expand(B, T).gather(1, idx)
                ids_of = lambda n, f=ids_of: f(n).gather(1, idx)  # noqa: E731
                masks = [m.gather(1, idx) & slot for m in masks]
                bias = None
            if attention_impl == "efficient" and bias is None:
                bias = attention_bias(mask_q)
            emb = self.embed_tokens(ids_of(1 + i)).to(dtype)
            if attention_impl == "efficient":
                attend = lambda q, li, b=bias: ttt_attention(q, *kv.split(li), b)  # noqa: E731
            else:
                attend = lambda q, li, m=ttt_reference_mask(T, i, attention_mask): masked_attention(  # noqa: E731
                    q, *kv.joined(li), m)
            h = self._ttt_layers(i, emb, hidden, self.rotary(pos + i, dtype), kv, attend)
            hidden = self.output_hidden(h)
            if step_loss is None:
                logits_out.append(self.compute_logits(h))
                hidden_out.append(hidden)
            else:
                logits_out.append(self._head(i, h[masks[i]], step_loss, checkpoint_head))
        return (logits_out, hidden_out) if return_hidden else logits_out

    def _check_ttt_args(self, input_ids, taps, attention_mask, ttt_steps, attention_impl, return_hidden,
                        doc_ids, step_loss, valid) -> None:
        if attention_impl not in ("efficient", "reference"):
            raise ValueError(f"attention_impl must be 'efficient' or 'reference', got {attention_impl!r}")
        if attention_impl == "reference" and doc_ids is not None:
            raise ValueError("attention_impl='reference' does not take packed rows (doc_ids)")
        if ttt_steps < 1:
            raise DraftTrainError(f"ttt_steps must be >= 1, got {ttt_steps}")
        if step_loss is not None and (valid is None or len(valid) < ttt_steps or return_hidden):
            raise ValueError("step_loss needs one valid mask per step (valid=) and no return_hidden")
        B, T = input_ids.shape
        if taps.shape[:2] != (B, T) or attention_mask.shape != (B, T):
            raise DraftTrainError(
                f"shape mismatch: input_ids {tuple(input_ids.shape)}, taps {tuple(taps.shape)}, "
                f"attention_mask {tuple(attention_mask.shape)}"
            )

    def _ttt_layers(self, i: int, emb, hidden, rotary, kv: "_TTTKeys", attend):
        """One TTT step through every draft layer: step 0's keys/values become ``kv``'s shared keys, later
        steps' are appended per layer; ``attend(q, layer)`` is the step's attention over ``kv``."""
        cos, sin = rotary
        h = hidden
        for li, layer in enumerate(self.layers):
            q, k, v = layer.self_attn.qkv(layer.attn_input(emb, h), cos, sin)
            kv.add(li, i, k, v)
            h = layer.finish(attend(q, li), h)
        return h

    def _head(self, i: int, rows: torch.Tensor, step_loss, checkpoint_head: bool):
        def fn(x):
            return step_loss(i, x, self.compute_logits)

        if checkpoint_head and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(fn, rows, use_reentrant=False)
        return fn(rows)

    # ------------------------------------------------------------------ inference
    def new_cache(self, batch_size: int, max_len: int, device=None, dtype=None) -> Eagle3Cache:
        p = self.fc.weight
        c = self.config
        return Eagle3Cache(c.num_layers, batch_size, c.num_key_value_heads, max_len, c.head_dim,
                           device=device or p.device, dtype=dtype or p.dtype)

    @torch.no_grad()
    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        cache: Eagle3Cache,
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run n new positions; append their K/V at cache positions ``[length, length+n)``.

        input_ids ``[B, n]``; hidden ``[B, n, H]`` (``fuse(taps)`` or a previous ``out_hidden``);
        position_ids default ``arange(length, length+n)``; attn_mask ``[B, n, length+n]`` bool (True =
        attend), default causal. Returns ``(logits [B, n, Vd], out_hidden [B, n, H])``.
        """
        B, n = input_ids.shape
        L = cache.length
        if hidden.shape[:2] != (B, n):
            raise DraftTrainError(f"hidden {tuple(hidden.shape)} does not match input_ids {tuple(input_ids.shape)}")
        if B != cache.batch_size:
            raise DraftTrainError(f"batch size {B} != cache batch size {cache.batch_size}")
        if L + n > cache.max_len:
            raise DraftTrainError(f"draft cache overflow: {L} + {n} > max_len {cache.max_len}")
        device = input_ids.device
        dtype = self.fc.weight.dtype
        if position_ids is None:
            position_ids = torch.arange(L, L + n, device=device).expand(B, n)
        if attn_mask is None:
            kpos = torch.arange(L + n, device=device)
            attn_mask = (kpos[None, :] <= (L + torch.arange(n, device=device))[:, None])[None]
        else:
            attn_mask = attn_mask.to(device=device, dtype=torch.bool)
            if attn_mask.shape[-2:] != (n, L + n):
                raise DraftTrainError(f"attn_mask must be [B, {n}, {L + n}], got {tuple(attn_mask.shape)}")
        emb = self.embed_tokens(input_ids).to(dtype)
        cos, sin = self.rotary(position_ids, dtype)
        h = hidden.to(dtype)
        for li, layer in enumerate(self.layers):
            q, k, v = layer.self_attn.qkv(layer.attn_input(emb, h), cos, sin)
            cache.k[li][:, :, L : L + n] = k.to(cache.k[li].dtype)
            cache.v[li][:, :, L : L + n] = v.to(cache.v[li].dtype)
            kc = cache.k[li][:, :, : L + n].to(q.dtype)
            vc = cache.v[li][:, :, : L + n].to(q.dtype)
            h = layer.finish(masked_attention(q, kc, vc, attn_mask), h)
        cache.length = L + n
        return self.compute_logits(h), self.output_hidden(h)

    @torch.no_grad()
    def step_static(self, input_ids: torch.Tensor, hidden: torch.Tensor, cache_k: list[torch.Tensor],
                    cache_v: list[torch.Tensor], position_ids: torch.Tensor, write_index: torch.Tensor,
                    mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`step` with static shapes: the new K/V go to slots ``write_index [n]`` of the preallocated
        ``cache_k/cache_v`` (per layer ``[1, Hkv, max_len, D]``, e.g. an :class:`Eagle3Cache`'s ``k`` / ``v``)
        and attention reads the whole buffer under ``mask [1, n, max_len]`` (True = attend). Same math as
        ``step``; no checks and no cache length kept (the caller owns both); every shape is fixed by (n,
        max_len), so the call can be captured in a CUDA graph. Returns ``(logits [1, n, Vd], out_hidden
        [1, n, H])``."""
        dtype = self.fc.weight.dtype
        emb = self.embed_tokens(input_ids).to(dtype)
        cos, sin = self.rotary(position_ids, dtype)
        h = hidden.to(dtype)
        for li, layer in enumerate(self.layers):
            q, k, v = layer.self_attn.qkv(layer.attn_input(emb, h), cos, sin)
            cache_k[li].index_copy_(2, write_index, k.to(cache_k[li].dtype))
            cache_v[li].index_copy_(2, write_index, v.to(cache_v[li].dtype))
            h = layer.finish(sdpa_attention(q, cache_k[li].to(q.dtype), cache_v[li].to(q.dtype), mask), h)
        return self.compute_logits(h), self.output_hidden(h)

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, directory: str | os.PathLike, overwrite: bool = True) -> None:
        cfg = {TYPE_KEY: DRAFTER_TYPE, **self.config.to_dict()}
        tensors = {k: v for k, v in self.state_dict().items()}
        with atomic_dir(directory, overwrite=overwrite) as tmp:
            write_json(tmp / CONFIG_NAME, cfg)
            save_tensors(tmp / WEIGHTS_NAME, tensors, metadata={"format": "pt", TYPE_KEY: DRAFTER_TYPE})

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, device=None) -> "Eagle3Drafter":
        directory = Path(directory)
        config = Eagle3DrafterConfig.from_dict(read_drafter_config(directory, CONFIG_NAME, DRAFTER_TYPE))
        weights = directory / WEIGHTS_NAME
        sd = load_tensors(weights)
        if "d2t" not in sd or "t2d" not in sd:
            raise DraftTrainError(f"{weights}: missing d2t/t2d buffers")
        model = cls(config, sd["d2t"], sd["t2d"])
        saved_dtype = sd["fc.weight"].dtype if "fc.weight" in sd else torch.float32
        if saved_dtype.is_floating_point and saved_dtype != torch.float32:
            model.to(saved_dtype)
        check_state_dict(weights, model.state_dict(), sd)
        model.load_state_dict(sd, strict=True)
        if device is not None:
            model.to(device)
        return model
