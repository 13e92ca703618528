"""SDPA for grouped-query attention on CPU, with masks: the K/V heads are never repeated.

transformers' ``sdpa`` attention passes ``enable_gqa=True`` to :func:`torch.nn.functional.scaled_dot_product_attention`
only when there is no attention mask (CUDA's fused kernels need that); with a mask it folds the query heads for a
single query token and otherwise copies every K/V head ``num_key_value_groups`` times (``repeat_kv``). On CPU the
grouped kernel takes a mask and gives the same numbers without that copy. In the built-in target (4 query / 2
K/V heads), a verify block of 16 rows x 5 tokens over ~105 cached positions spent 2.3 ms per forward copying K/V;
the forward went from 22.1 to 21.0 ms and from 30.1 to 26.0 ms in two interleaved profiles (the copy grows with
the cached length). Every forward the decoder and the capture run has a mask (padding, packed documents, the row
cache's 4D mask).

:func:`use_grouped_sdpa` switches a model loaded with ``attn_implementation="sdpa"`` to :data:`NAME`, which is
``sdpa`` with that one difference on CPU, and exactly transformers' ``sdpa`` elsewhere (CUDA tensors, no grouping,
position biases, soft-capping)."""
from __future__ import annotations

import torch.nn.functional as F

NAME = "drafttrain_sdpa"


def grouped_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                         is_causal=None, **kwargs):
    """transformers' attention-function signature: ``query [B, H, n, D]``, ``key``/``value`` ``[B, H_kv, kv, D]``
    -> ``(out [B, n, H, D], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    if (attention_mask is None or groups <= 1 or query.device.type != "cpu" or key.shape[-1] != value.shape[-1]
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # with a mask transformers' sdpa never sets is_causal: the mask is the whole pattern
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make :data:`NAME` an attention implementation transformers knows (its masks are ``sdpa``'s)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(NAME, grouped_sdpa_forward)
        AttentionMaskInterface.register(NAME, sdpa_mask)


def _groups(config) -> int:
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    return int(heads) // int(kv) if heads and kv else 1


def use_grouped_sdpa(model) -> bool:
    """Switch ``model`` (on CPU, ``sdpa``, grouped-query attention) to :data:`NAME`; True if it was switched. A
    model whose attention cannot be switched (remote code outside transformers' attention interface) is left
    as it is."""
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or _groups(text) <= 1:
        return False
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return False
    can = getattr(model, "_can_set_attn_implementation", None)
    if device.type != "cpu" or text is not cfg or can is None or not can():
        return False
    register()
    model.set_attn_implementation(NAME)
    return getattr(model.config, "_attn_implementation", None) == NAME
