"""DFlash drafter: a block-parallel drafter (block diffusion, arXiv 2602.06036) as a plain ``nn.Module``.

One forward drafts a whole block. The block is the last verified token (the *anchor*, slot 0) followed by
``block_size - 1`` copies of a mask token; every slot's output goes through the target's ``lm_head``, so slot k
proposes the token k positions after the anchor. Architecture (z-lab ``dflash/model.py``, vLLM
``qwen3_dflash.py``; shared/reference/dflash-family-2026.md §1.1):

- ``fc`` (``[H, K * H_t]``, no bias) + ``hidden_norm`` fuse the target's hidden states at ``target_layer_ids``
  (0-based: the *output* of layer i, HF ``hidden_states[i + 1]``) into the context features;
- N Qwen3-style layers (q/k RMSNorm, RoPE, SwiGLU) whose keys and values are ``k_proj/v_proj`` of
  ``[context features ; block hidden]`` and whose queries come from the block only; the context does not pass
  through ``input_layernorm``; attention is bidirectional inside the block and sees every context position
  strictly before the anchor;
- ``norm``, then the target's ``lm_head``; the block's token embeddings are the target's: the drafter has no
  embedding and no head of its own (:meth:`DFlashDrafter.bind_target` borrows them, frozen, unregistered).

Training calls :meth:`DFlashDrafter.forward` on all blocks of a packed row at once under a block mask
(:func:`block_mask`); decoding keeps the context's keys/values in a :class:`DFlashCache` (only committed
positions persist: the block is never written) and calls :meth:`DFlashDrafter.draft_block` once per round.
Tests check that both compute the same thing.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from drafttrain.layout import CONFIG_NAME, DFLASH_TYPE, TYPE_KEY, WEIGHTS_NAME
from drafttrain.drafters.eagle3 import (Eagle3MLP, config_from_dict, RMSNorm, RotaryEmbedding, SCALED_ROPE_TYPES, _apply_rope, _cfg_get,
                                        _rope_theta, normalise_rope_scaling, rope_scaling_of)
from drafttrain.io import (DraftTrainError, atomic_dir, check_state_dict, load_tensors, read_drafter_config,
                           save_tensors, write_json)
from drafttrain.targets.load import text_config

__all__ = ["DFlashDrafterConfig", "DFlashDrafter", "DFlashCache", "block_mask", "context_mask", "block_attention", "default_target_layer_ids",
           "resolve_layer_ids",
           "default_gamma", "target_identity"]

DRAFTER_TYPE = DFLASH_TYPE


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """``num_taps`` 0-based layer ids spread evenly from layer 1 to layer ``num_target_layers - 3`` (z-lab's
    ``build_target_layer_ids``: Qwen3-8B's 36 layers and 5 taps give [1, 9, 17, 25, 33]); a target too shallow
    for that range spreads them over every layer."""
    L, k = int(num_target_layers), int(num_taps)
    if k < 1:
        raise DraftTrainError(f"dflash.num_taps={k}: must be >= 1")
    lo, hi = 1, L - 3
    if hi - lo + 1 < k:
        lo, hi = 0, L - 1
    if k == 1:
        return [(lo + hi) // 2]
    return [lo + round(i * (hi - lo) / (k - 1)) for i in range(k)]


def resolve_layer_ids(cfg, n_layers: int) -> list[int]:
    """``dflash.target_layer_ids`` of a job's config (``cfg``: its ``dflash`` section), or the default spread of
    ``dflash.num_taps``; refused in one line when a layer is not one of the target's."""
    ids = list(cfg.target_layer_ids) if cfg.target_layer_ids else default_target_layer_ids(n_layers, cfg.num_taps)
    bad = [i for i in ids if not 0 <= int(i) < n_layers]
    if bad:
        raise DraftTrainError(f"dflash.target_layer_ids={ids}: {bad} out of range (0-based layer outputs of a "
                              f"{n_layers}-layer target: 0..{n_layers - 1})")
    return [int(i) for i in ids]


def default_gamma(block_size: int) -> float:
    """The loss decay γ of slot weights exp(-(k-1)/γ) for a block size: the published points (B 8 -> 4, 10 -> 5,
    16 -> 7; NeMo / ModelOpt), linear between them, B/2 below 8 and the last slope above 16."""
    pts = [(8, 4.0), (10, 5.0), (16, 7.0)]
    b = float(block_size)
    if b <= 8:
        return max(b / 2.0, 0.5)
    for (b0, g0), (b1, g1) in zip(pts, pts[1:]):
        if b <= b1:
            return g0 + (g1 - g0) * (b - b0) / (b1 - b0)
    return 7.0 + (b - 16) / 3.0


def target_identity(target_model) -> dict:
    """What a DFlash drafter needs of its target and records: vocabulary (embedding rows), hidden size, layers."""
    cfg = text_config(target_model.config)
    emb = target_model.get_input_embeddings().weight
    return {"vocab_size": int(emb.shape[0]), "target_hidden_size": int(emb.shape[1]),
            "target_num_layers": int(_cfg_get(cfg, "num_hidden_layers"))}


# ----------------------------------------------------------------------------------------------- config
@dataclass
class DFlashDrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's embedding rows (the drafter drafts over the full target vocabulary)
    target_hidden_size: int
    target_num_layers: int
    target_layer_ids: list  # 0-based: output of target layer i = HF hidden_states[i + 1] (z-lab's convention)
    mask_token_id: int  # a real row of the target's embedding, neither pad nor an end token
    block_size: int = 16
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    target_name_or_path: str = ""

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(t) for t in self.target_layer_ids]
        problems = []
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "target_hidden_size", "target_num_layers", "num_layers"):
            if int(getattr(self, name)) <= 0:
                problems.append(f"{name} must be positive (got {getattr(self, name)})")
        if self.num_key_value_heads > 0 and self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                            f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            problems.append(f"head_dim must be even for rotary embeddings (got {self.head_dim})")
        if int(self.block_size) < 2:
            problems.append(f"block_size must be >= 2 (got {self.block_size}): slot 0 is the anchor")
        if not self.target_layer_ids:
            problems.append("target_layer_ids is empty")
        bad = [t for t in self.target_layer_ids if not 0 <= t < self.target_num_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} out of range: 0-based layer outputs of a "
                            f"{self.target_num_layers}-layer target are 0..{self.target_num_layers - 1}")
        if not 0 <= int(self.mask_token_id) < int(self.vocab_size):
            problems.append(f"mask_token_id {self.mask_token_id} is not a row of the target's embedding "
                            f"(0..{self.vocab_size - 1})")
        self.rope_scaling = normalise_rope_scaling(self.rope_scaling)
        rtype = (self.rope_scaling or {}).get("rope_type", "default")
        if rtype not in SCALED_ROPE_TYPES:
            problems.append(f"rope_type {rtype!r} is not implemented by the drafter")
        if problems:
            raise DraftTrainError("invalid DFlash drafter config: " + "; ".join(problems))

    @property
    def hf_taps(self) -> tuple[int, ...]:
        """The HF ``hidden_states`` indices of ``target_layer_ids`` (each + 1): what the target runner taps."""
        return tuple(t + 1 for t in self.target_layer_ids)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config") -> "DFlashDrafterConfig":
        return config_from_dict(cls, d, f"{where}: DFlash config")


# ----------------------------------------------------------------------------------------------- layers
class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashDrafterConfig) -> None:
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim).transpose(1, 2)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return _apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, S, H]`` -> k, v ``[B, kv_heads, S, D]`` (k normed and rotated; context and block alike)."""
        k = _apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


DFlashMLP = Eagle3MLP  # the same SwiGLU (gate_proj, up_proj, down_proj), Qwen3's


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashDrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DFlashMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, block: int | None = None) -> torch.Tensor:
        """Block hidden ``x [B, Q, H]`` attends to the context keys/values ``[B, kv, C, D]`` and the block's own.
        ``block`` None: ``mask [B, Q, C + Q]`` bool (True = attend) or None (everything visible). ``block`` = the
        block size of Q = A x block queries (training): ``mask [B, A, C]`` is each block's visible context, and a
        query sees its own block only (:func:`block_attention`: no A x A score table)."""
        h = self.input_layernorm(x)
        att = self.self_attn
        q = att.query(h, cos, sin)
        k, v = att.key_value(h, cos, sin)
        if block is not None:
            o = block_attention(q, ctx_k.to(k.dtype), ctx_v.to(v.dtype), k, v, mask, block)
        else:
            k, v = torch.cat([ctx_k.to(k.dtype), k], dim=2), torch.cat([ctx_v.to(v.dtype), v], dim=2)
            bias = None if mask is None else torch.where(mask, 0.0, torch.finfo(q.dtype).min).to(q.dtype)[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=q.shape[1] != k.shape[1])
        x = x + att.out(o)
        return x + self.mlp(self.post_attention_layernorm(x))


def block_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                    v_blk: torch.Tensor, ctx_mask: torch.Tensor, block: int) -> torch.Tensor:
    """Attention of A blocks of ``block`` queries each (``q [B, h, A*block, D]``) over the context
    (``k_ctx / v_ctx [B, kv, C, D]``, block a sees the columns where ``ctx_mask[b, a]`` is True) and over their
    own block only (``k_blk / v_blk [B, kv, A*block, D]``, bidirectional): one softmax over [context ; own
    block] per query, the same numbers as a dense [A*block, C + A*block] mask at C + block columns per query."""
    B, Hq, Q, D = q.shape
    kv, A = k_ctx.shape[1], Q // block
    g = Hq // kv
    scale = D ** -0.5
    qg = q.reshape(B, kv, g, A, block, D)
    s_ctx = torch.einsum("bkgatd,bkcd->bkgatc", qg, k_ctx).float() * scale
    s_ctx = s_ctx.masked_fill(~ctx_mask[:, None, None, :, None, :], torch.finfo(torch.float32).min)
    s_blk = torch.einsum("bkgatd,bkasd->bkgats", qg, k_blk.reshape(B, kv, A, block, D)).float() * scale
    p = torch.softmax(torch.cat([s_ctx, s_blk], -1), -1).to(q.dtype)
    C = k_ctx.shape[2]
    o = torch.einsum("bkgatc,bkcd->bkgatd", p[..., :C], v_ctx) + \
        torch.einsum("bkgats,bkasd->bkgatd", p[..., C:], v_blk.reshape(B, kv, A, block, D))
    return o.reshape(B, Hq, Q, D)


# ----------------------------------------------------------------------------------------------- masks
def context_mask(anchor_pos: torch.Tensor, anchor_valid: torch.Tensor, attention_mask: torch.Tensor,
                 doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Each block's visible context, bool ``[B, A, T]``: the real columns j < anchor_pos[a] in the anchor's
    document; nothing for a padding block (``anchor_valid`` False)."""
    T = attention_mask.shape[1]
    j = torch.arange(T, device=anchor_pos.device)
    ctx = (j[None, None, :] < anchor_pos[:, :, None]) & attention_mask.bool()[:, None, :]
    if doc_ids is not None:
        ctx &= doc_ids[:, None, :] == torch.gather(doc_ids, 1, anchor_pos)[:, :, None]
    return ctx & anchor_valid[:, :, None]


def block_mask(anchor_pos: torch.Tensor, anchor_valid: torch.Tensor, block_size: int, attention_mask: torch.Tensor,
               doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The training mask of every block of a row in one forward: bool ``[B, A * block_size, T + A * block_size]``.

    ``anchor_pos [B, A]`` (column of each block's anchor), ``anchor_valid [B, A]``. A query of block a sees the
    context columns j < anchor_pos[a] that are real (``attention_mask``) and in the anchor's document
    (``doc_ids``, packed rows), and every slot of its own block (bidirectional); nothing of another block. A
    padding block (not valid) sees only itself."""
    B, A = anchor_pos.shape
    T = attention_mask.shape[1]
    dev = anchor_pos.device
    ctx = context_mask(anchor_pos, anchor_valid, attention_mask, doc_ids)  # [B, A, T]
    same = torch.eye(A, dtype=torch.bool, device=dev)[None].expand(B, A, A)  # block a sees block a only
    blocks = same[:, :, :, None].expand(B, A, A, block_size).reshape(B, A, A * block_size)
    m = torch.cat([ctx, blocks], dim=2)  # [B, A, T + A*bs]
    return m[:, :, None, :].expand(B, A, block_size, T + A * block_size).reshape(B, A * block_size, -1)


# ----------------------------------------------------------------------------------------------- cache
class DFlashCache:
    """The drafter's keys/values of the committed context, per layer ``[1, kv_heads, max_len, D]``; ``length``
    entries are valid (entry j = context position j). A round's block is never written here."""

    def __init__(self, num_layers: int, num_kv_heads: int, max_len: int, head_dim: int, device=None, dtype=None):
        shape = (1, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def truncate(self, n: int) -> None:
        self.length = min(self.length, int(n))


# ----------------------------------------------------------------------------------------------- drafter
class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashDrafterConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(c) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        self._target: tuple = ()  # (embedding, lm_head, softcap) of the target: borrowed, never registered
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    @classmethod
    def from_target(cls, target_model: nn.Module, target_layer_ids, mask_token_id: int, block_size: int = 16,
                    num_layers: int = 1, target_name_or_path: str = "", intermediate_size: int | None = None,
                    init_layer: int | None = None) -> "DFlashDrafter":
        """Sized from the target (hidden size, heads, head_dim, norms, RoPE), bound to its embedding and head.
        ``init_layer``: every draft layer starts as a copy of that target decoder layer where shapes allow."""
        cfg = text_config(target_model.config)
        ident = target_identity(target_model)
        H = int(_cfg_get(cfg, "hidden_size"))
        heads = int(_cfg_get(cfg, "num_attention_heads"))
        config = DFlashDrafterConfig(
            hidden_size=H,
            intermediate_size=int(intermediate_size or _cfg_get(cfg, "intermediate_size", default=4 * H)),
            num_attention_heads=heads,
            num_key_value_heads=int(_cfg_get(cfg, "num_key_value_heads", default=heads)),
            head_dim=int(_cfg_get(cfg, "head_dim", default=H // heads)),
            target_layer_ids=[int(t) for t in target_layer_ids], mask_token_id=int(mask_token_id),
            block_size=int(block_size), num_layers=int(num_layers),
            rms_norm_eps=float(_cfg_get(cfg, "rms_norm_eps", "layer_norm_eps", default=1e-6)),
            rope_theta=_rope_theta(cfg), rope_scaling=rope_scaling_of(cfg),
            max_position_embeddings=int(_cfg_get(cfg, "max_position_embeddings", default=2048)),
            initializer_range=float(_cfg_get(cfg, "initializer_range", default=0.02)),
            target_name_or_path=str(target_name_or_path), **ident,
        )
        model = cls(config)
        if init_layer is not None:
            model.init_layers_from(target_model, int(init_layer))
        return model.bind_target(target_model)

    @torch.no_grad()
    def init_layers_from(self, target_model: nn.Module, index: int) -> list[str]:
        """Copy target decoder layer ``index`` (negative: from the end) into every draft layer where names and
        shapes match (projections, MLP, norms; a Llama target has no q/k norms: those stay ones)."""
        from drafttrain.drafters.eagle3 import _decoder_layers

        layers = _decoder_layers(target_model)
        if not -len(layers) <= index < len(layers):
            raise DraftTrainError(f"dflash.init_layer={index}: the target has {len(layers)} decoder layers")
        src = dict(layers[index].named_parameters())
        done = []
        for li, layer in enumerate(self.layers):
            for name, p in layer.named_parameters():
                s = src.get(name)
                if s is not None and s.shape == p.shape:
                    p.copy_(s.detach().to(p.device, p.dtype))
                    done.append(f"layers.{li}.{name}")
        return done

    # ------------------------------------------------------------------ the borrowed target parts
    def bind_target(self, target_model: nn.Module) -> "DFlashDrafter":
        """Borrow the target's input embedding and lm_head (frozen; not parameters of the drafter, not saved),
        after checking that this is a target the drafter fits: same vocabulary, hidden size and depth."""
        ident = target_identity(target_model)
        c = self.config
        diff = [f"{k} {getattr(c, k)} != the target's {v}" for k, v in ident.items() if int(getattr(c, k)) != v]
        if diff:
            raise DraftTrainError(f"this DFlash drafter was trained for another target "
                                  f"({c.target_name_or_path or 'unrecorded'}): {'; '.join(diff)}")
        cfg = text_config(target_model.config)
        softcap = getattr(cfg, "final_logit_softcapping", None) or None
        head = target_model.get_output_embeddings()
        if head is None:
            raise DraftTrainError(f"{type(target_model).__name__}: no lm_head for the DFlash drafter to borrow")
        self._target = (target_model.get_input_embeddings(), head, softcap)
        return self

    def _borrowed(self):
        if not self._target:
            raise DraftTrainError("the DFlash drafter has no target bound: it borrows the target's embedding and "
                                  "lm_head (load it with its target, DFlashDrafter.bind_target)")
        return self._target

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        emb = self._borrowed()[0]
        with torch.no_grad():
            return emb(ids.to(emb.weight.device)).to(self.fc.weight.device, self.fc.weight.dtype)

    def head_weight(self) -> torch.Tensor:
        return self._borrowed()[1].weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's lm_head on the drafter's (final-normed) output ``[..., H]`` -> ``[..., V]`` float32."""
        _, head, softcap = self._borrowed()
        w = head.weight
        z = F.linear(hidden.to(w.device, w.dtype), w, getattr(head, "bias", None)).float()
        if softcap:
            z = torch.tanh(z / softcap) * softcap
        return z

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ forward
    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """``[..., K * H_t]`` target hidden states -> context features ``[..., H]`` (fc, then hidden_norm)."""
        if taps.shape[-1] != self.fc.in_features:
            raise DraftTrainError(f"taps have width {taps.shape[-1]}, expected {len(self.config.target_layer_ids)}"
                                  f" x target_hidden = {self.fc.in_features}")
        return self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))

    def forward(self, block_embeds: torch.Tensor, taps: torch.Tensor, block_pos: torch.Tensor,
                ctx_pos: torch.Tensor, mask: torch.Tensor | None, block: int | None = None) -> torch.Tensor:
        """Training forward: every block of a batch in one pass. ``block_embeds [B, Q, H]`` (the target's
        embeddings of anchor / mask tokens), ``taps [B, C, K*H_t]`` (the context), ``block_pos [B, Q]`` and
        ``ctx_pos [B, C]`` rotary positions; ``mask``: the dense ``[B, Q, C + Q]`` (:func:`block_mask`), or with
        ``block`` (Q = A x block) each block's visible context ``[B, A, C]`` (:func:`context_mask`, what training
        passes: no A x A table). Returns the final-normed block hidden states ``[B, Q, H]`` (the lm_head's input)."""
        ctx = self.fuse(taps)
        dt = self.fc.weight.dtype
        cos_c, sin_c = self.rotary(ctx_pos, dt)
        cos_b, sin_b = self.rotary(block_pos, dt)
        x = block_embeds.to(dt)
        for layer in self.layers:
            ck, cv = layer.self_attn.key_value(ctx, cos_c, sin_c)
            x = layer(x, ck, cv, cos_b, sin_b, mask, block)
        return self.norm(x)

    # ------------------------------------------------------------------ inference
    def new_cache(self, max_len: int, device=None, dtype=None) -> DFlashCache:
        c = self.config
        return DFlashCache(c.num_layers, c.num_key_value_heads, max_len, c.head_dim, device=device,
                           dtype=dtype or self.fc.weight.dtype)

    @torch.no_grad()
    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the context keys / values ``[B, kv, n, D]`` of target hidden states ``taps [B, n, K*H_t]`` at
        rotary ``positions [B, n]`` (or ``[n]``). A context entry depends on its own position only, so any split of
        the context into pieces gives the same entries."""
        ctx = self.fuse(taps)
        cos, sin = self.rotary(positions, ctx.dtype)
        return [layer.self_attn.key_value(ctx, cos, sin) for layer in self.layers]

    @torch.no_grad()
    def append_context(self, cache: DFlashCache, taps: torch.Tensor, start: int) -> None:
        """Write the context entries of positions ``start .. start + n - 1`` from target hidden states
        ``taps [n, K*H_t]`` (``start`` must equal the cache's length: the context grows by committed tokens)."""
        n = taps.shape[0]
        if start != cache.length:
            raise RuntimeError(f"DFlash context out of step: cache holds {cache.length} positions, writing at {start}")
        if start + n > cache.max_len:
            raise ValueError(f"DFlash cache overflow: {start} + {n} > {cache.max_len}")
        dev = cache.k[0].device
        kv = self.context_kv(taps.to(dev).unsqueeze(0), torch.arange(start, start + n, device=dev))
        for li, (k, v) in enumerate(kv):
            cache.k[li][:, :, start:start + n] = k.to(cache.k[li].dtype)
            cache.v[li][:, :, start:start + n] = v.to(cache.v[li].dtype)
        cache.length = start + n

    @torch.no_grad()
    def draft_blocks(self, ks: list[torch.Tensor], vs: list[torch.Tensor], lengths: torch.Tensor,
                     anchors: torch.Tensor, num_slots: int | None = None) -> torch.Tensor:
        """One forward over B rows' blocks [anchor, mask × num_slots] at positions ``lengths[b] ..``; row b sees its
        first ``lengths[b]`` context entries of ``ks[layer] / vs[layer]`` ``[B, kv, C, D]`` (C ≥ every length) and
        its whole block. ``num_slots`` (default block_size - 1, the trained block): the block holds 1 + num_slots
        tokens, as the engines run it (vLLM's query is 1 + num_speculative_tokens per request). Returns the logits
        of slots 1..num_slots ``[B, num_slots, V]``."""
        c = self.config
        n = c.block_size - 1 if num_slots is None else int(num_slots)
        Bs = n + 1
        dev = ks[0].device
        B, C = anchors.shape[0], ks[0].shape[2]
        ids = torch.full((B, Bs), c.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchors.to(dev)
        x = self.embed(ids)
        lengths = lengths.to(dev)
        cos, sin = self.rotary(lengths[:, None] + torch.arange(Bs, device=dev), x.dtype)
        mask = None
        if B > 1 or C != int(lengths.max()):  # rows of other lengths (or a longer buffer): hide the slots past each
            seen = torch.arange(C, device=dev)[None] < lengths[:, None]
            mask = torch.cat([seen, torch.ones(B, Bs, dtype=torch.bool, device=dev)], 1)[:, None].expand(B, Bs, C + Bs)
        for li, layer in enumerate(self.layers):
            x = layer(x, ks[li], vs[li], cos, sin, mask)
        return self.logits(self.norm(x[:, 1:]))

    @torch.no_grad()
    def draft_block(self, cache: DFlashCache, anchor: int | torch.Tensor, num_slots: int | None = None) -> torch.Tensor:
        """One forward over the block [anchor, mask × num_slots] (default B-1) at positions ``cache.length ..`` (the
        anchor is the pending token, just after the committed context). Returns the logits of slots 1..num_slots
        ``[num_slots, V]``: slot k proposes the token k positions after the anchor."""
        L = cache.length
        dev = cache.k[0].device
        anchor = torch.as_tensor(anchor, dtype=torch.long, device=dev).reshape(1)
        ks, vs = [k[:, :, :L] for k in cache.k], [v[:, :, :L] for v in cache.v]
        return self.draft_blocks(ks, vs, torch.tensor([L], device=dev), anchor, num_slots)[0]

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, directory: str | os.PathLike, overwrite: bool = True) -> None:
        cfg = {TYPE_KEY: DRAFTER_TYPE, **self.config.to_dict()}
        with atomic_dir(directory, overwrite=overwrite) as tmp:
            write_json(tmp / CONFIG_NAME, cfg)
            save_tensors(tmp / WEIGHTS_NAME, dict(self.state_dict()), metadata={"format": "pt", TYPE_KEY: DRAFTER_TYPE})

    @classmethod
    def from_state(cls, config: DFlashDrafterConfig, sd: dict, where, device=None) -> "DFlashDrafter":
        model = cls(config)
        dtype = sd["fc.weight"].dtype if "fc.weight" in sd else torch.float32
        if dtype.is_floating_point and dtype != torch.float32:
            model.to(dtype)
        check_state_dict(where, model.state_dict(), sd)
        model.load_state_dict(sd, strict=True)
        return model.to(device) if device is not None else model

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, device=None, target_model=None) -> "DFlashDrafter":
        directory = Path(directory)
        raw = read_drafter_config(directory, CONFIG_NAME, DRAFTER_TYPE)
        config = DFlashDrafterConfig.from_dict(raw, where=str(directory / CONFIG_NAME))
        weights = directory / WEIGHTS_NAME
        model = cls.from_state(config, load_tensors(weights), weights, device)
        return model.bind_target(target_model) if target_model is not None else model
