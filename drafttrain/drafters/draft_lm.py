"""Distilled draft models: small HF causal LMs sharing the target's tokenizer, plus on-policy data.

A draft built here is a plain HF model (``save_pretrained`` / ``AutoModelForCausalLM.from_pretrained``), so
:class:`drafttrain.decoding.proposers.DraftModelProposer` can run it; :class:`DraftLM` is the module recipe=draft_model
trains and saves (``drafter_type: draft_model``, read back by drafttrain.artifacts.load_drafter). Three ways to get
one (:func:`build_draft_lm`):

- ``from_config``: the target's config class and settings, shrunk (fewer layers, optionally narrower),
  randomly initialised;
- ``from_target_layers``: a truncated target -- its embedding, first ``num_layers`` decoder layers, final
  norm and LM head, copied bit for bit (weights are matched by parameter name);
- ``from_pretrained``: an existing HF model whose vocabulary size must equal the target's.

DistillSpec's finding is that on-policy data (sequences the draft samples itself, scored by the target)
matters most; :func:`sample_on_policy` produces them and :func:`mix_batches` mixes them with fixed data.
The KD losses live in :mod:`drafttrain.losses` (``kd_loss``, ``ce_loss``).
"""
from __future__ import annotations

import copy
import os
import random
from typing import Any, Sequence, TypeVar

import torch
from torch import nn

from drafttrain.io import DraftTrainError, atomic_dir
from drafttrain.layout import ADAPTER_DIR, DRAFT_MODEL_TYPE, TARGET_KEY, TYPE_KEY
from drafttrain.targets.load import text_config

__all__ = ["DraftLM", "build_draft_lm", "sample_on_policy", "on_policy_records", "mix_batches", "DRAFT_MODES"]

DRAFT_MODES = ("from_config", "from_target_layers", "from_pretrained")
T = TypeVar("T")


class DraftLM(nn.Module):
    """The trained draft: ``forward(input_ids, attention_mask) -> logits [B, T, V]``. ``lm`` is an HF causal
    LM, or (``lora=True``) a peft model wrapping one; peft is not imported here (its model's own methods are
    called)."""

    def __init__(self, lm: nn.Module, tokenizer=None, target_name: str = "", lora: bool = False):
        super().__init__()
        self.lm = lm
        self.tokenizer = tokenizer
        self.target_name = target_name
        self.lora = lora

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).logits

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def base_model(self) -> nn.Module:
        """The plain HF model (adapters merged, on a copy, when LoRA is used)."""
        if not self.lora:
            return self.lm
        return copy.deepcopy(self.lm).merge_and_unload()

    def save_pretrained(self, directory, overwrite: bool = True) -> None:
        """The ``draft_model`` layout (drafttrain/artifacts.py): the HF model directory (adapters merged) with
        ``drafter_type`` and the target in its config, the tokenizer, and with LoRA the adapter in ``adapter/``."""
        model = self.base_model()
        setattr(model.config, TYPE_KEY, DRAFT_MODEL_TYPE)
        setattr(model.config, TARGET_KEY, self.target_name)
        with atomic_dir(directory, overwrite=overwrite) as tmp:
            model.save_pretrained(str(tmp), safe_serialization=True)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(tmp))
            if self.lora:
                self.lm.save_pretrained(str(tmp / ADAPTER_DIR), safe_serialization=True)


def _vocab_size(model: nn.Module) -> int:
    out = model.get_output_embeddings()
    if out is not None and getattr(out, "weight", None) is not None:
        return int(out.weight.shape[0])
    return int(text_config(model.config).vocab_size)


def _param_dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _shrunk_config(target_model: nn.Module, num_layers: int, hidden_size: int | None,
                   intermediate_size: int | None):
    cfg = copy.deepcopy(target_model.config)
    if text_config(cfg) is not cfg:
        raise DraftTrainError(
            f"draft_lm: target config {type(cfg).__name__} nests a text config; pass a text-only causal LM"
        )
    L = int(cfg.num_hidden_layers)
    if not 1 <= num_layers:
        raise DraftTrainError(f"draft_lm: num_layers must be >= 1 (got {num_layers})")
    cfg.num_hidden_layers = int(num_layers)
    # per-layer lists (sliding/full attention pattern, ...) keep the pattern of the first layers
    for key in ("layer_types",):
        v = getattr(cfg, key, None)
        if isinstance(v, (list, tuple)) and len(v) == L and num_layers <= L:
            setattr(cfg, key, list(v)[:num_layers])
    H = int(cfg.hidden_size)
    if hidden_size is not None and int(hidden_size) != H:
        hs = int(hidden_size)
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or H // heads)
        new_heads = max(1, hs // head_dim)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        new_kv = max(1, new_heads * kv // heads)
        while new_heads % new_kv:
            new_kv -= 1
        cfg.hidden_size = hs
        cfg.num_attention_heads = new_heads
        if hasattr(cfg, "num_key_value_heads"):
            cfg.num_key_value_heads = new_kv
        if getattr(cfg, "head_dim", None) is not None:
            cfg.head_dim = head_dim
        if intermediate_size is None and getattr(cfg, "intermediate_size", None):
            intermediate_size = max(1, round(int(cfg.intermediate_size) * hs / H))
    if intermediate_size is not None:
        if not hasattr(cfg, "intermediate_size"):
            raise DraftTrainError(f"draft_lm: {type(cfg).__name__} has no intermediate_size to set")
        cfg.intermediate_size = int(intermediate_size)
    cfg._name_or_path = ""
    return cfg


def build_draft_lm(
    target_model: nn.Module,
    mode: str = "from_config",
    num_layers: int = 2,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    pretrained_path: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    seed: int | None = None,
) -> nn.Module:
    """Build a draft causal LM for ``target_model`` (see the module docstring for the modes).

    Args:
        num_layers, hidden_size, intermediate_size: the draft's size (``from_config``); ``hidden_size=None``
            keeps the target's width; a narrower width keeps the target's head_dim and KV-group ratio and
            scales ``intermediate_size`` with it unless given. ``from_target_layers`` uses ``num_layers`` only.
        pretrained_path: the HF model to load (``from_pretrained``).
        dtype: parameter dtype of the result (default: the target's).
        seed: seeds the random init of ``from_config`` (the global RNG is left untouched).
    Returns:
        an HF ``*ForCausalLM`` in eval mode, on CPU, with the target's generation config (eos/pad ids).
    Raises:
        DraftTrainError: unknown mode, bad sizes, or a vocabulary size different from the target's.
    """
    if mode not in DRAFT_MODES:
        raise DraftTrainError(f"draft_lm: unknown mode {mode!r}; expected one of {DRAFT_MODES}")
    dtype = dtype or _param_dtype(target_model)
    target_vocab = _vocab_size(target_model)

    if mode == "from_pretrained":
        if pretrained_path is None:
            raise DraftTrainError("draft_lm: mode=from_pretrained needs pretrained_path")
        from transformers import AutoModelForCausalLM

        try:
            draft = AutoModelForCausalLM.from_pretrained(str(pretrained_path), dtype=dtype)
        except (OSError, ValueError) as e:
            raise DraftTrainError(f"draft_lm: cannot load {pretrained_path}: {e}") from None
        v = _vocab_size(draft)
        if v != target_vocab:
            raise DraftTrainError(
                f"draft_lm: {pretrained_path} has vocabulary size {v}, the target has {target_vocab}; a draft "
                "must share the target's tokenizer and vocabulary"
            )
        return draft.eval()

    if mode == "from_target_layers":
        L = int(target_model.config.num_hidden_layers)
        if not 1 <= num_layers <= L:
            raise DraftTrainError(f"draft_lm: num_layers must be in [1, {L}] for from_target_layers (got {num_layers})")
        if hidden_size is not None and int(hidden_size) != int(target_model.config.hidden_size):
            raise DraftTrainError("draft_lm: from_target_layers keeps the target's hidden_size")
        cfg = _shrunk_config(target_model, num_layers, None, None)
    else:
        cfg = _shrunk_config(target_model, num_layers, hidden_size, intermediate_size)

    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(int(seed))
        draft = type(target_model)(cfg)
    draft.to(dtype)

    if mode == "from_target_layers":
        src = target_model.state_dict()
        dst = draft.state_dict()
        missing = [k for k in dst if k not in src]
        bad = [k for k in dst if k in src and src[k].shape != dst[k].shape]
        if missing or bad:
            raise DraftTrainError(f"draft_lm: cannot copy target weights (missing {missing[:5]}, shape {bad[:5]})")
        draft.load_state_dict({k: src[k].detach().to("cpu") for k in dst}, strict=True)

    gen = getattr(target_model, "generation_config", None)
    if gen is not None:
        draft.generation_config = copy.deepcopy(gen)
    if _vocab_size(draft) != target_vocab:  # cannot happen for the two modes above; keep the invariant explicit
        raise DraftTrainError(f"draft_lm: draft vocabulary {_vocab_size(draft)} != target {target_vocab}")
    return draft.eval()


# ----------------------------------------------------------------------------------------- on-policy data
@torch.no_grad()
def sample_on_policy(
    draft_model: nn.Module,
    prompts_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    batch_size: int = 8,
    pad_token_id: int = 0,
) -> list[tuple[list[int], list[int]]]:
    """Continuations sampled by the draft itself (DistillSpec / GKD on-policy data), to be scored by the
    target.

    Prompts are left-padded into batches and decoded with the draft's KV cache; each step samples from
    ``softmax(logits / temperature)`` (``temperature == 0``: argmax). Randomness comes from a CPU
    ``generator`` (or one seeded from ``seed``), never the global RNG; it seeds one generator per prompt,
    so the samples do not depend on ``batch_size``. A row stops after emitting an
    ``eos_token_id`` (kept in its continuation) or ``max_new_tokens`` tokens.

    Returns ``[(prompt_ids, continuation_ids), ...]`` in the order of ``prompts_ids``.
    """
    from transformers import DynamicCache

    if generator is None:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(int(seed) if seed is not None else 0)
    t = float(temperature)
    if t < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    eos = set() if eos_token_id is None else ({int(eos_token_id)} if isinstance(eos_token_id, int)
                                              else {int(e) for e in eos_token_id})
    prompts = [list(map(int, p)) for p in prompts_ids]
    if any(not p for p in prompts):
        raise ValueError("sample_on_policy: every prompt needs at least one token")
    # one generator per prompt, seeded from ``generator``: the samples do not depend on ``batch_size``
    row_seeds = torch.randint(0, 2**62, (len(prompts),), generator=generator).tolist()
    device = next(draft_model.parameters()).device
    was_training = draft_model.training
    draft_model.eval()
    results: list[tuple[list[int], list[int]]] = []
    try:
        for start in range(0, len(prompts), max(1, int(batch_size))):
            chunk = prompts[start : start + max(1, int(batch_size))]
            B, P = len(chunk), max(len(p) for p in chunk)
            ids = torch.full((B, P), int(pad_token_id), dtype=torch.long)
            am = torch.zeros(B, P, dtype=torch.long)
            for i, p in enumerate(chunk):
                ids[i, P - len(p) :] = torch.tensor(p)
                am[i, P - len(p) :] = 1
            ids, am = ids.to(device), am.to(device)
            cache = DynamicCache(config=draft_model.config)
            conts: list[list[int]] = [[] for _ in range(B)]
            gens = [torch.Generator(device="cpu").manual_seed(int(sd)) for sd in row_seeds[start : start + B]]
            done = torch.zeros(B, dtype=torch.bool)
            feed, pos = ids, (am.cumsum(-1) - 1).clamp_min(0)
            for _ in range(int(max_new_tokens)):
                out = draft_model(input_ids=feed, attention_mask=am, position_ids=pos, cache=cache, use_cache=True)
                logits = out.logits[:, -1].float().cpu()
                if t == 0.0:
                    nxt = logits.argmax(-1)
                else:
                    probs = torch.softmax(logits / t, dim=-1)
                    nxt = torch.stack([torch.multinomial(probs[i], 1, generator=gens[i])[0] for i in range(B)])
                for i in range(B):
                    if not done[i]:
                        conts[i].append(int(nxt[i]))
                        if int(nxt[i]) in eos:
                            done[i] = True
                if bool(done.all()):
                    break
                nxt = torch.where(done, torch.full_like(nxt, int(pad_token_id)), nxt)
                feed = nxt[:, None].to(device)
                pos = pos[:, -1:] + 1
                am = torch.cat([am, (~done).long()[:, None].to(device)], dim=-1)
            results.extend((p, c) for p, c in zip(chunk, conts))
    finally:
        draft_model.train(was_training)
    return results


def on_policy_records(samples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[dict[str, Any]]:
    """``(prompt, continuation)`` pairs -> data records ``{"input_ids", "loss_mask"}`` (docs/design.md) with
    ``loss_mask`` 1 on the continuation: the tokens the draft generated, which the target then scores."""
    return [{"input_ids": list(p) + list(c), "loss_mask": [0] * len(p) + [1] * len(c)} for p, c in samples]


def mix_batches(fixed: Sequence[T], on_policy: Sequence[T], ratio: float, seed: int = 0,
                n: int | None = None) -> list[T]:
    """A shuffled list of ``n`` items (default ``len(fixed)``) of which exactly ``round(ratio * n)`` come from
    ``on_policy`` and the rest from ``fixed`` (each drawn without replacement, at random positions).

    GKD's ``lmbda`` draws the source of every batch from a Bernoulli; a fixed count gives the same
    expected fraction with no variance. Items can be examples or whole batches.
    """
    r = float(ratio)
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    n = len(fixed) if n is None else int(n)
    k = int(round(r * n))
    if k > len(on_policy) or n - k > len(fixed):
        raise ValueError(
            f"mix_batches: need {k} on-policy and {n - k} fixed items, have {len(on_policy)} and {len(fixed)}"
        )
    rng = random.Random(int(seed))
    picked = [on_policy[i] for i in rng.sample(range(len(on_policy)), k)]
    picked += [fixed[i] for i in rng.sample(range(len(fixed)), n - k)]
    rng.shuffle(picked)
    return picked
