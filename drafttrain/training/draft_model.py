"""Distilled draft models as a training method (the protocol of training/loop.py): ``recipe=draft_model``.

A small causal LM sharing the target's tokenizer (drafttrain.drafters.draft_lm.build_draft_lm: shrunk
config, the target's first layers, or any HF model with the same vocabulary) is trained toward the target:

- ``distill.loss`` = ``fkl`` | ``rkl`` | ``jsd`` (``jsd_beta``) | ``tvd`` (= 1 - acceptance) | a weighted mix
  ``"fkl:0.5,tvd:0.5"``: a divergence between the target's next-token distribution (``capture``, no_grad) and
  the draft's, averaged over the assistant tokens of the whole global batch;
- ``distill.loss=ce``: the plain-CE baseline (same draft, same data, next-token CE on the data tokens), so the
  gain of distillation is one switch away.

Data: the fixed dataset (``data.regenerate=false``), teacher-generated (``data.regenerate=true``, the
built-in default), or **on-policy** (``distill.on_policy_ratio`` > 0): that fraction of the rows of every
micro-batch is replaced by a continuation the draft samples itself from the row's prompt (DistillSpec /
GKD), which the target then scores in ``capture``. The rows and the sampling seeds are functions of
(train.seed, step, rank, micro-batch), so resuming reproduces them.

The saved drafter (``final/``) is a plain HF model directory (``save_pretrained`` + the target's tokenizer;
``config.json`` carries ``drafter_type: draft_model``): ``drafttrain eval drafter=final`` or
``decode.method=draft_model decode.draft_model=final``. With ``distill.use_lora`` the adapters are merged
into the saved model and also kept in ``final/adapter/``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..data.chat import stop_token_ids
from ..data.packing import lm_inputs
from ..drafters.draft_lm import DraftLM, build_draft_lm, on_policy_records, sample_on_policy
from ..io import DraftTrainError
from ..losses import KD_KINDS, ce_loss, kd_loss, next_token_mask
from .base import MethodDefaults


def parse_loss(spec: str) -> str | dict[str, float]:
    """``"fkl"`` -> ``"fkl"``; ``"fkl:0.5,tvd:0.5"`` -> ``{"fkl": 0.5, "tvd": 0.5}``; ``"ce"`` -> ``"ce"``."""
    s = str(spec).strip().lower()
    if s == "ce" or s in KD_KINDS:
        return s
    mix: dict[str, float] = {}
    for part in s.split(","):
        name, _, w = part.strip().partition(":")
        name = name.strip()
        if name not in KD_KINDS:
            raise DraftTrainError(f"distill.loss={spec}: {name!r} is not one of ce, {', '.join(KD_KINDS)} "
                                  "(a mix is written fkl:0.5,tvd:0.5)")
        try:
            mix[name] = float(w) if w else 1.0
        except ValueError:
            raise DraftTrainError(f"distill.loss={spec}: weight {w!r} of {name} is not a number") from None
    return mix


def prompt_len(example: dict) -> int:
    """Tokens before the first loss (assistant) token: the prompt an on-policy continuation starts from."""
    lm = example["loss_mask"]
    return next((i for i, m in enumerate(lm) if m), len(lm))


@dataclass
class Capture:
    teacher_logits: torch.Tensor  # [B, T, V] float32, the target's


class DraftModelMethod(MethodDefaults):
    name = "draft_model"

    @classmethod
    def from_job(cls, job, tokenizer, target_model):
        return cls(job.distill, tokenizer, target_model, seed=job.train.seed)

    def __init__(self, cfg, tokenizer, target_model, seed: int = 0):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.kind = parse_loss(cfg.loss)
        if not 0.0 <= float(cfg.on_policy_ratio) <= 1.0:
            raise DraftTrainError(f"distill.on_policy_ratio={cfg.on_policy_ratio}: must be in [0, 1]")
        if not 0.0 <= float(cfg.jsd_beta) <= 1.0:
            raise DraftTrainError(f"distill.jsd_beta={cfg.jsd_beta}: must be in [0, 1]")
        if not float(cfg.temperature) > 0:
            raise DraftTrainError(f"distill.temperature={cfg.temperature}: must be > 0")
        if cfg.on_policy_ratio > 0 and int(cfg.on_policy_max_new_tokens) < 1:
            raise DraftTrainError("distill.on_policy_max_new_tokens must be >= 1 with distill.on_policy_ratio > 0")
        self.seed = int(seed)
        self.eos = stop_token_ids(target_model, tokenizer)
        self.on_policy_rows = 0

    @staticmethod
    def target_layers(cfg) -> int:
        """The target's first decoder layers ``build_drafter`` copies (``init=from_target_layers``); with
        capture.mode=offline the loop loads only those of the target's layers."""
        return int(cfg.num_layers) if cfg.init == "from_target_layers" else 0

    def build_drafter(self, target_model, examples, target_name: str) -> DraftLM:
        c = self.cfg
        lm = build_draft_lm(target_model, mode=c.init, num_layers=int(c.num_layers), hidden_size=c.hidden_size,
                            intermediate_size=c.intermediate_size, pretrained_path=c.pretrained, seed=c.seed,
                            dtype=torch.float32)  # fp32 master weights (autocast handles bf16 compute)
        lm.requires_grad_(True)
        # The input embedding is frozen (EAGLE-3 does the same): a copy of the target's where the widths match
        # (from_target_layers already has it), the pretrained draft's own otherwise; checkpoints rebuild it
        # rather than store it. A narrower from_config draft ties it to its (trained) LM head instead.
        emb, t_emb = lm.get_input_embeddings(), target_model.get_input_embeddings()
        if c.init == "from_config" and emb.weight.shape == t_emb.weight.shape:
            with torch.no_grad():
                emb.weight.copy_(t_emb.weight.to(emb.weight.dtype))
        if c.init == "from_config" and emb.weight.shape != t_emb.weight.shape:
            lm.get_input_embeddings().weight = lm.get_output_embeddings().weight
            lm.config.tie_word_embeddings = True
        else:
            emb.weight.requires_grad_(False)
        lm.train()
        if c.use_lora:
            from ..lora import add_lora, lora_target_modules

            try:
                lm = add_lora(lm, r=c.lora.r, alpha=c.lora.alpha, dropout=c.lora.dropout,
                              target_modules=lora_target_modules(c.lora.target_modules))
            except ValueError as e:
                raise DraftTrainError(f"distill.lora: {e}".splitlines()[0]) from None
        return DraftLM(lm, self.tokenizer, target_name, lora=bool(c.use_lora))

    def describe(self, drafter) -> str:
        cfg = drafter.lm.config
        loss = self.kind if isinstance(self.kind, str) else ",".join(f"{k}:{w}" for k, w in self.kind.items())
        s = (f"{self.cfg.init} draft, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
             f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M params; loss {loss}")
        if self.cfg.on_policy_ratio > 0:
            s += f"; on-policy fraction {self.cfg.on_policy_ratio} (<= {self.cfg.on_policy_max_new_tokens} tokens)"
        if self.cfg.use_lora:
            s += f"; LoRA r={self.cfg.lora.r}"
        return s

    def param_groups(self, drafter, lr: float) -> list[dict]:
        return [{"params": drafter.trainable_parameters(), "lr": lr}]

    # ---- on-policy data
    def transform_examples(self, drafter: DraftLM, micro_batches: list[list[dict]], step: int,
                           rank: int) -> list[list[dict]]:
        """Replace ``round(on_policy_ratio * rows)`` rows of each micro-batch by the draft's own samples."""
        r = float(self.cfg.on_policy_ratio)
        if r <= 0:
            return micro_batches
        out = []
        for j, rows in enumerate(micro_batches):
            rng = random.Random(f"{self.seed}/{step}/{rank}/{j}")
            k = int(round(r * len(rows)))
            picked = sorted(rng.sample(range(len(rows)), k))
            if not picked:
                out.append(rows)
                continue
            prompts = [rows[i]["input_ids"][: max(1, prompt_len(rows[i]))] for i in picked]
            samples = sample_on_policy(drafter.lm, prompts, int(self.cfg.on_policy_max_new_tokens),
                                       temperature=float(self.cfg.on_policy_temperature),
                                       seed=rng.randrange(2**62), eos_token_id=self.eos,
                                       batch_size=len(prompts), pad_token_id=self.tokenizer.pad_token_id or 0)
            new = list(rows)
            for i, rec in zip(picked, on_policy_records(samples)):
                new[i] = rec
            self.on_policy_rows += len(picked)
            out.append(new)
        return out

    # ---- capture / counts / loss
    @torch.no_grad()
    def capture(self, target_model, batch) -> Capture:
        out = target_model(input_ids=batch["input_ids"], **lm_inputs(batch), use_cache=False)
        return Capture(teacher_logits=out.logits.float())

    # capture.mode=offline: teacher logits recomputed with the target's lm_head from the stored last hidden
    # state (the lm_head input), as the online forward computes them. On-policy rows cannot be stored ahead.
    offline_features = ("last_hidden",)

    @staticmethod
    def offline_unsupported(job) -> str | None:
        """Why ``job`` cannot train from stored features (None: it can)."""
        r = float(job.distill.on_policy_ratio)
        if r > 0:
            return (f"distill.on_policy_ratio={r}: on-policy rows are sampled during training, so the target's "
                    "features for them cannot be stored ahead")
        return None

    @torch.no_grad()
    def capture_from_features(self, target_model, batch, feats: dict) -> Capture:
        head = target_model.get_output_embeddings()
        return Capture(teacher_logits=head(feats["last_hidden"].to(head.weight.dtype)).float())

    def count_valid(self, drafter, batch, cap) -> torch.Tensor:
        return next_token_mask(batch["attention_mask"], batch["loss_mask"], batch.get("doc_ids")).sum().float().reshape(1)

    def loss(self, model, drafter, batch, cap: Capture, global_counts: torch.Tensor, scale: float):
        ids, am, lmask, doc = batch["input_ids"], batch["attention_mask"], batch["loss_mask"], batch.get("doc_ids")
        logits = model(ids, **lm_inputs(batch))
        mask = next_token_mask(am, lmask, doc)
        n = global_counts[0].clamp_min(1.0)
        stats: dict[str, torch.Tensor] = {}
        if self.kind == "ce":
            _, st = ce_loss(logits, ids, am, lmask, doc)
            loss_sum = st["loss_sum"]
            with torch.no_grad():  # how well the CE-trained draft matches the target (for the comparison)
                _, kst = kd_loss(logits.detach(), cap.teacher_logits, mask, kind="fkl")
            stats["fkl_sum"] = kst["fkl"] * kst["count"]
            stats["accept_sum"] = kst["accept_sum"]
            stats["agree_sum"] = kst["top1_sum"]
            stats["data_top1_sum"] = st["top1_sum"]
        else:
            _, st = kd_loss(logits, cap.teacher_logits, mask, kind=self.kind, beta=float(self.cfg.jsd_beta),
                            temperature=float(self.cfg.temperature))
            loss_sum = st["loss_sum"]
            for k in KD_KINDS:
                if k in st:
                    stats[f"{k}_sum"] = st[k] * st["count"]
            stats["accept_sum"] = st["accept_sum"]
            stats["agree_sum"] = st["top1_sum"]
        stats["loss_sum"] = loss_sum.detach()
        stats["count"] = st["count"]
        loss = loss_sum / n * scale
        return loss, {k: torch.as_tensor(v).detach().float().cpu() for k, v in stats.items()}

    def summarize(self, stats: dict) -> dict:
        n = max(float(stats["count"]), 1.0)
        out = {"loss": float(stats["loss_sum"]) / n,
               "acc_0": float(stats["agree_sum"]) / n,  # draft argmax == target argmax: greedy acceptance
               "accept": float(stats["accept_sum"]) / n,  # E[sum min(p, q)] at T=1 = 1 - E[TVD]
               "valid_tokens_0": float(stats["count"])}
        for k in (*KD_KINDS, "data_top1"):
            if f"{k}_sum" in stats:
                out[k] = float(stats[f"{k}_sum"]) / n
        return out

    def estimated_tau(self, summary: dict, k: int) -> float:
        """Greedy chain with i.i.d. acceptance a = acc_0: (1 - a^{k+1}) / (1 - a)."""
        a = min(max(summary["acc_0"], 0.0), 1.0)
        return float(sum(a ** j for j in range(k + 1)))

    # ---- loop hooks
    def eval_setup(self, target_model, drafter: DraftLM):
        lm = drafter.base_model().eval()
        return target_model, lm, {"target_modified": False, "draft_loss": self.cfg.loss,
                                  "on_policy_ratio": float(self.cfg.on_policy_ratio),
                                  "on_policy_rows": self.on_policy_rows}
