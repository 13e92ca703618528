"""The built-in targets: small causal LMs and their tokenizers, trained offline by the toolkit itself.

Two kinds (``target.builtin.kind``), trained deterministically (seeded) on corpora of the running interpreter,
in chat form (loss on the assistant span only) mixed with plain text:

- ``code`` (``target=builtin``, the default): a Llama with a byte-level BPE tokenizer and its own chat
  template, on the Python standard library sources (the ``target`` split of :mod:`drafttrain.data.stdlib`;
  user: a function's signature and docstring, assistant: its body).
- ``docs`` (``target=builtin-docs``): a Qwen3 (q/k RMSNorm, tied embeddings, grouped-query attention,
  rope_theta 1e6) with a SentencePiece-style tokenizer (Metaspace pre-tokenizer, BPE with byte fallback) and
  ChatML with two end tokens (``<|im_end|>``, ``<|endoftext|>``), on documentation prose (the ``target``
  split of :mod:`drafttrain.data.docs`; user: a question about a documented name, assistant: its docs).

Saved with ``save_pretrained`` (safetensors) and loadable with ``AutoModelForCausalLM``/``AutoTokenizer``.
Cached under ``$DRAFTTRAIN_CACHE`` (default ``~/.cache/drafttrain``); ``$DRAFTTRAIN_BUILTIN_TARGET`` points
at an existing build instead.
"""
from __future__ import annotations

import dataclasses
import fcntl
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..config import BuiltinTargetConfig
from ..io import DraftTrainError, atomic_dir, cache_root, write_json

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# A reserved token that no text contains: block-parallel drafters (recipe=dflash) fill a block's slots 1..B-1
# with its embedding row, as Qwen3's <|MASK|>. Added after the BPE is trained (the merges are the ones a build
# without it learns), as the last id; the tokenizer names it ``mask_token``.
MASK_TOKEN = "<|mask|>"

# Each message is "<|role|>{content}<|end|>": special tokens on both sides of the content, so the content
# tokenises the same in training and after a generation prompt (no BPE merge across the boundary). The
# assistant's "{content}<|end|>" is marked with {% generation %}, so
# `apply_chat_template(..., return_assistant_tokens_mask=True)` gives the loss mask.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>' }}{% generation %}{{ message['content'] }}{{ '<|end|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


# ChatML, as Qwen and many others write it; no BOS. The assistant's "{content}<|im_end|>" is the generation span.
CHATML_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] }}{{ '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# The spec lives with the other structured configs (``target.builtin.*``); its hash names the cache entry.
BuiltinSpec = BuiltinTargetConfig


def builtin_path(spec: BuiltinSpec | None = None) -> Path:
    override = os.environ.get("DRAFTTRAIN_BUILTIN_TARGET")
    if override:
        return Path(override)
    spec = spec or BuiltinSpec()
    return cache_root() / f"builtin-target-{spec.key()}"


def ensure_builtin_target(spec: BuiltinSpec | None = None, quiet: bool = False) -> Path:
    """Return the built-in target's directory, building it first if it is not cached.

    Safe to call from several processes at once (``accelerate launch``): one builds, the others wait.
    """
    spec = spec or BuiltinSpec()
    path = builtin_path(spec)
    if (path / "config.json").exists():
        return path
    if os.environ.get("DRAFTTRAIN_BUILTIN_TARGET"):
        raise DraftTrainError(f"DRAFTTRAIN_BUILTIN_TARGET={path}: no config.json there")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").exists():
            if not quiet:
                print(f"[drafttrain] building the built-in target into {path} (first use only)", flush=True)
            build_builtin_target(path, spec, quiet=quiet)
    return path


# the built-in target's small sibling (decode.method=draft_model decode.draft_model=builtin-small)
SMALL_DRAFT = dict(hidden_size=96, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1)


def builtin_small_draft(target_cfg) -> Path:
    """A 2-layer sibling of the built-in target: same tokenizer (same files, vocabulary size and seed), trained
    the same way; the natural ``draft_model`` for the built-in target (built on first use, cached)."""
    spec = dataclasses.replace(target_cfg.builtin, **SMALL_DRAFT)
    return ensure_builtin_target(spec)


def _reserve_mask(tok, mask_token: bool) -> dict:
    """Add :data:`MASK_TOKEN` to the trained ``tokenizers.Tokenizer`` as its last id (``mask_token`` kwarg for
    the transformers wrapper), or nothing."""
    if not mask_token:
        return {}
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(MASK_TOKEN, special=True, normalized=False)])
    return {"mask_token": MASK_TOKEN}


def train_tokenizer(texts: list[str], vocab_size: int, mask_token: bool = False):
    """Byte-level BPE trained on ``texts``, wrapped as a transformers fast tokenizer with the chat template;
    ``mask_token``: plus the reserved :data:`MASK_TOKEN` as the last id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    extra = _reserve_mask(tok, mask_token)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        **extra,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1_000_000,  # positions are bounded by the model config, not here
        clean_up_tokenization_spaces=False,
    )


def train_metaspace_tokenizer(texts: list[str], vocab_size: int, mask_token: bool = False):
    """SentencePiece-style BPE (``▁`` for spaces, byte fallback for what the vocabulary lacks, newlines kept
    apart) trained on ``texts``, with ChatML; eos ``<|im_end|>``, pad ``<|endoftext|>``, no BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", "isolated"),  # a newline never merges with the word after it
        pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never"),
    ])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHATML_SPECIAL_TOKENS + byte_tokens,
                                  initial_alphabet=[], show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    extra = _reserve_mask(tok, mask_token)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        **extra,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=1_000_000,
        clean_up_tokenization_spaces=False,
    )


def _example_stream(tokenizer, chats, texts, spec: BuiltinSpec, rng: random.Random):
    """Endless (input_ids, labels) sequences of exactly seq_len tokens: chats (assistant-only labels) and text."""
    T = spec.seq_len
    while True:
        if rng.random() < spec.chat_fraction:
            enc = tokenizer.apply_chat_template(
                rng.choice(chats).messages(), return_dict=True, return_assistant_tokens_mask=True, tokenize=True
            )
            ids, mask = list(enc["input_ids"])[:T], list(enc["assistant_masks"])[:T]
            labels = [i if m else -100 for i, m in zip(ids, mask)]
            pad = T - len(ids)
            yield ids + [tokenizer.pad_token_id] * pad, labels + [-100] * pad
        else:
            text = rng.choice(texts)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            start = rng.randrange(max(1, len(ids) - T + 1))
            bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
            ids = (bos + ids[start : start + T - len(bos)]) if start == 0 else ids[start : start + T]
            pad = T - len(ids)
            yield ids + [tokenizer.pad_token_id] * pad, ids + [-100] * pad


def _batches(stream, batch_size):
    while True:
        rows = [next(stream) for _ in range(batch_size)]
        yield torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])


def _corpus(spec: BuiltinSpec):
    """(train texts, train chats, eval texts, eval chats) of the spec's kind."""
    from ..data import docs, stdlib

    corpus = docs if spec.kind == "docs" else stdlib
    chats_of = docs.doc_chats if spec.kind == "docs" else stdlib.code_chats
    texts, chats = corpus.plain_texts("target"), chats_of("target")
    eval_texts, eval_chats = corpus.plain_texts("eval"), chats_of("eval")
    if spec.max_files:
        texts, eval_texts = texts[: spec.max_files], eval_texts[: max(1, spec.max_files // 4)]
        chats, eval_chats = chats[: 20 * spec.max_files], eval_chats[: 5 * spec.max_files]
    if not texts or not chats:
        raise DraftTrainError(f"no {spec.kind} corpus found under {stdlib.stdlib_root()}")
    return texts, chats, eval_texts, eval_chats


def _model_config(spec: BuiltinSpec, tokenizer):
    """The architecture of the spec's kind: Llama (code) or Qwen3 (docs), sized by the spec."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if spec.kind == "docs":
        return Qwen3Config(**common, head_dim=spec.hidden_size // spec.num_heads, rope_theta=1e6,
                           tie_word_embeddings=True)
    return LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)


def build_builtin_target(out_dir: Path, spec: BuiltinSpec, quiet: bool = False) -> dict:
    """Build the target of ``spec`` into ``out_dir``, seeded by the spec; the caller's torch random state is
    restored afterwards (a job that builds the target draws nothing from its own RNG)."""
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))):  # manual_seed seeds every device
        return _build_builtin_target(out_dir, spec, quiet)


def _build_builtin_target(out_dir: Path, spec: BuiltinSpec, quiet: bool) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    t0 = time.time()
    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    texts, chats, eval_texts, eval_chats = _corpus(spec)
    tokenizer = (train_metaspace_tokenizer if spec.kind == "docs" else train_tokenizer)(
        texts, spec.vocab_size, mask_token=spec.mask_token)
    config = _model_config(spec, tokenizer)
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step):
        if step < spec.warmup_steps:
            return spec.lr * (step + 1) / spec.warmup_steps
        frac = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    batches = _batches(_example_stream(tokenizer, chats, texts, spec, rng), spec.batch_size)
    bar = tqdm(range(spec.steps), desc="built-in target", disable=quiet, mininterval=2.0)
    loss_ema = None
    for step in bar:
        ids, labels = next(batches)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{loss_ema:.3f}")

    model.eval()
    eval_rng = random.Random(spec.seed + 1)
    eval_batches = _batches(_example_stream(tokenizer, eval_chats, eval_texts, spec, eval_rng), spec.batch_size)
    with torch.no_grad():
        losses = []
        for _ in range(spec.eval_batches):
            ids, labels = next(eval_batches)
            losses.append(model(input_ids=ids, labels=labels).loss.item())
    heldout_loss = sum(losses) / len(losses)
    info = {
        "spec": dataclasses.asdict(spec),
        "python": sys.version.split()[0],
        "train_files": len(texts),
        "heldout_loss": heldout_loss,
        "build_seconds": round(time.time() - t0, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if spec.kind == "docs":  # two end tokens, as Qwen3's generation config has
            ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
            GenerationConfig(eos_token_id=ends, pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
        elif model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        write_json(tmp / "drafttrain_builtin.json", info)
    if not quiet:
        print(
            f"[drafttrain] built-in target: {info['parameters'] / 1e6:.1f}M params, held-out loss "
            f"{heldout_loss:.3f} nats/token ({info['build_seconds']}s) -> {out_dir}",
            flush=True,
        )
    return info
