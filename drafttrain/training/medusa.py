"""Medusa-1 and Medusa-2 as training methods (the protocol of training/loop.py).

Medusa-1 (``recipe=medusa``): the target is frozen; ``capture`` runs it under no_grad and records its final
(post-norm) hidden state ``h_t``; K heads learn ``x_{t+2+k}`` from ``h_t`` with loss
``sum_k w_k CE_k``, ``w_k = heads_coefficient * step_decay**k`` (each CE averaged over the head's valid
tokens of the whole global batch).

Medusa-2 (``recipe=medusa2``): joint training. LoRA adapters (peft) are injected into the target, and the
trained module holds the adapted target *and* the heads; the head losses back-propagate into the adapters.
The LM loss keeps the target's output the target's: with self-distillation it is
``KL(p_base || p_adapted)`` where ``p_base`` is the same model with its adapters disabled (computed in
``capture``, no_grad), zero at step 0 because LoRA's B starts at zero. Heads get
``train.lr * head_lr_multiplier``. **Medusa-2 changes the target**: the saved drafter holds the heads and
the LoRA adapter, and evaluation verifies with the adapted (merged) target, whose greedy output is the
AR reference (report key ``target_modified: true``).

The default decoding tree is chosen from the per-head, per-rank accuracy measured over the last training
steps (``decoding.tree.medusa_choices_from_accuracy``); both are saved in the heads' config
(``medusa_choices``, ``head_topk_accuracy``), and the decoder re-picks a tree of ``decode.tree.total_tokens``
nodes from that accuracy (``decoding.build.medusa_choices_for``).

Saved layouts (``final/``): Medusa-1: a MedusaHeads directory (vLLM Medusa format; config.json also carries
``medusa_choices`` and ``head_topk_accuracy``). Medusa-2: ``config.json`` (``drafter_type: medusa2``,
``heads``, ``adapter``, ``target_modified: true``), ``heads/`` (a MedusaHeads directory) and ``adapter/``
(a peft LoRA adapter for the target).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..data.packing import lm_inputs
from ..decoding.tree import medusa_choices_from_accuracy
from ..drafters.medusa import MedusaHeads, final_hidden, load_medusa_heads
from ..io import DraftTrainError, atomic_dir, save_tensors, write_json
from ..layout import (ADAPTER_DIR, ADAPTER_KEY, CONFIG_NAME, HEADS_DIR, HEADS_KEY, MEDUSA2_TYPE, MEDUSA_TYPE,
                      TARGET_KEY, TYPE_KEY, WEIGHTS_NAME)
from ..lora import add_lora, lora_target_modules
from ..losses import (combine_step_losses, kd_loss, medusa_head_stats, medusa_head_weights, medusa_valid_mask,
                      next_token_mask)
from .base import MethodDefaults, chain_tau, position_means

__all__ = ["MedusaTrainable", "MedusaMethod", "self_distillation_kl"]


# ------------------------------------------------------------------------------------------ modules
class MedusaTrainable(nn.Module):
    """What the loop trains. Medusa-1: the heads (``forward(hidden) -> [K, B, T, V]``). Medusa-2: the heads
    plus the LoRA-adapted target (``forward(input_ids, attention_mask) -> (head logits [K, B, T, V], LM
    logits [B, T, V])``; heads read the adapted target's final hidden state, with gradients).

    For Medusa-2 ``state_dict`` holds only the trained tensors (heads and LoRA weights): checkpoints do not
    copy the frozen target."""

    def __init__(self, heads: MedusaHeads, peft_model: nn.Module | None = None):
        super().__init__()
        self.heads = heads
        self.peft = peft_model
        self.joint = peft_model is not None
        self.medusa_choices: list[list[int]] | None = None
        self.head_topk_accuracy: list[list[float]] | None = None

    def forward(self, x, attention_mask=None, position_ids=None):
        if not self.joint:
            return self.heads(x)
        hidden, logits = final_hidden(self.peft, x, attention_mask, position_ids=position_ids)
        return self.heads(hidden), logits

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def _trained_keys(self) -> set[str]:
        names = {n for n, p in self.named_parameters() if p.requires_grad}
        return names | {n for n in super().state_dict() if n.startswith("heads.")}

    def state_dict(self, *args, **kwargs):
        sd = super().state_dict(*args, **kwargs)
        if not self.joint:
            return sd
        keep = self._trained_keys()
        prefix = kwargs.get("prefix", "")
        return type(sd)((k, v) for k, v in sd.items() if k[len(prefix):] in keep)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if not self.joint:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        res = super().load_state_dict(state_dict, strict=False, assign=assign)
        keep = self._trained_keys()
        missing = [k for k in res.missing_keys if k in keep]
        if strict and (missing or res.unexpected_keys):
            raise RuntimeError(f"medusa2: missing {missing[:5]}, unexpected {res.unexpected_keys[:5]}")
        return type(res)(missing, res.unexpected_keys)

    def _heads_config(self) -> dict:
        cfg = self.heads.config_dict()
        if self.medusa_choices is not None:
            cfg["medusa_choices"] = self.medusa_choices
        if self.head_topk_accuracy is not None:
            cfg["head_topk_accuracy"] = self.head_topk_accuracy
        return cfg

    def _write_heads(self, directory: Path) -> None:
        write_json(directory / CONFIG_NAME, self._heads_config())
        save_tensors(directory / WEIGHTS_NAME, dict(self.heads.state_dict()),
                     metadata={"format": "pt", TYPE_KEY: MEDUSA_TYPE})

    def save_pretrained(self, directory, overwrite: bool = True) -> None:
        """The medusa / medusa2 layouts of drafttrain/artifacts.py (read back by ``artifacts.load_medusa``)."""
        with atomic_dir(directory, overwrite=overwrite) as tmp:
            if not self.joint:
                self._write_heads(tmp)
                return
            (tmp / HEADS_DIR).mkdir()
            self._write_heads(tmp / HEADS_DIR)
            self.peft.save_pretrained(str(tmp / ADAPTER_DIR), safe_serialization=True)
            write_json(tmp / CONFIG_NAME, {
                TYPE_KEY: MEDUSA2_TYPE,
                HEADS_KEY: HEADS_DIR,
                ADAPTER_KEY: ADAPTER_DIR,
                "target_modified": True,
                "num_heads": self.heads.num_heads,
                "vocab_size": self.heads.vocab_size,
                "hidden_size": self.heads.hidden_size,
                TARGET_KEY: self.heads.target_name_or_path,
                "note": "Medusa-2 adapts the target: decode with the target + adapter/ (merged), heads/ as drafter",
            })


def self_distillation_kl(
    peft_model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    adapted_logits: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Medusa-2 self-distillation LM loss ``KL(p_base || p_adapted)``, averaged over the positions of
    :func:`drafttrain.losses.next_token_mask`.

    ``p_base`` is the same model with its adapters disabled (``peft_model.disable_adapter()`` under
    ``no_grad``); ``p_adapted`` is the normal forward (pass ``adapted_logits`` when the caller already ran
    it, e.g. via :func:`drafttrain.drafters.medusa.final_hidden` to feed the heads too). Zero while the
    adapters are at their init (LoRA B = 0). Returns ``(loss, stats)`` with the stats of
    :func:`drafttrain.losses.kd_loss`. (The training loop computes the same loss in two halves:
    ``MedusaMethod.capture`` runs ``p_base``, ``MedusaMethod.loss`` the KL.)
    """
    with torch.no_grad(), peft_model.disable_adapter():
        base = peft_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    if adapted_logits is None:
        adapted_logits = peft_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    mask = next_token_mask(attention_mask, loss_mask)
    return kd_loss(adapted_logits, base, mask, kind="fkl", temperature=temperature)


@dataclass
class Capture:
    hidden: torch.Tensor | None  # Medusa-1: the frozen target's final hidden state [B, T, H]
    base_logits: torch.Tensor | None  # Medusa-2 self-distillation: the target without adapters [B, T, V]


class MedusaMethod(MethodDefaults):
    """``joint=False``: Medusa-1; ``joint=True``: Medusa-2 (see the module docstring)."""

    @classmethod
    def from_job(cls, job, tokenizer, target_model):
        return cls(job.medusa, tokenizer, target_model, joint=job.method == "medusa2")

    def __init__(self, cfg, tokenizer, target_model, joint: bool = False):
        self.cfg = cfg
        self.joint = bool(joint)
        self.name = "medusa2" if joint else "medusa"
        K = int(cfg.num_heads)
        if K < 1:
            raise DraftTrainError(f"medusa.num_heads={K}: must be >= 1")
        if int(cfg.num_layers) < 0:
            raise DraftTrainError(f"medusa.num_layers={cfg.num_layers}: must be >= 0")
        if cfg.head_lr_multiplier <= 0:
            raise DraftTrainError(f"medusa.head_lr_multiplier={cfg.head_lr_multiplier}: must be > 0")
        if int(cfg.tree_top_k) < 1:
            raise DraftTrainError(f"medusa.tree_top_k={cfg.tree_top_k}: must be >= 1")
        self.K = K
        self.weights = medusa_head_weights(K, cfg.step_decay, cfg.heads_coefficient)
        self.R = int(cfg.tree_top_k)
        self.peft = None

    # ---- build
    def build_drafter(self, target_model, examples, target_name: str) -> MedusaTrainable:
        c = self.cfg
        if c.init_heads:
            heads = load_medusa_heads(c.init_heads)
            if heads.num_heads != self.K:
                raise DraftTrainError(f"medusa.init_heads={c.init_heads}: has {heads.num_heads} heads, "
                                      f"medusa.num_heads={self.K}")
            V, H = target_model.get_output_embeddings().weight.shape
            if (heads.vocab_size, heads.hidden_size) != (V, H):
                raise DraftTrainError(f"medusa.init_heads={c.init_heads}: heads are {heads.vocab_size}x"
                                      f"{heads.hidden_size}, the target is {V}x{H}")
        else:
            heads = MedusaHeads.from_target(target_model, num_heads=self.K, num_layers=int(c.num_layers),
                                            target_name_or_path=target_name)
        heads.target_name_or_path = target_name  # heads stay float32 (master weights; they cast their input)
        if not self.joint:
            return MedusaTrainable(heads)
        try:
            self.peft = add_lora(target_model, r=c.lora.r, alpha=c.lora.alpha, dropout=c.lora.dropout,
                                 target_modules=lora_target_modules(c.lora.target_modules))
        except ValueError as e:
            raise DraftTrainError(f"medusa.lora: {e}".splitlines()[0]) from None
        self.peft.train()  # LoRA dropout; the base model has no other dropout at its defaults
        return MedusaTrainable(heads, self.peft)

    def describe(self, drafter) -> str:
        s = f"{self.K} heads x {self.cfg.num_layers} block(s), weights {[round(w, 3) for w in self.weights]}"
        if self.joint:
            n_lora = sum(p.numel() for n, p in drafter.named_parameters() if p.requires_grad and "lora_" in n)
            s += (f"; LoRA r={self.cfg.lora.r} alpha={self.cfg.lora.alpha} ({n_lora / 1e6:.2f}M params) on the "
                  f"target, head lr x{self.cfg.head_lr_multiplier}, LM loss "
                  f"{'KL to the target without adapters' if self.cfg.self_distillation else 'CE on the data'}")
        return s

    def param_groups(self, drafter, lr: float) -> list[dict]:
        heads = [p for p in drafter.heads.parameters() if p.requires_grad]
        if not self.joint:
            return [{"params": heads, "lr": lr}]
        ids = {id(p) for p in heads}
        rest = [p for p in drafter.trainable_parameters() if id(p) not in ids]
        return [{"params": rest, "lr": lr}, {"params": heads, "lr": lr * float(self.cfg.head_lr_multiplier)}]

    # ---- capture / counts / loss
    @torch.no_grad()
    def capture(self, target_model, batch) -> Capture:
        if not self.joint:
            hidden, _ = final_hidden(target_model, batch["input_ids"], **lm_inputs(batch))
            return Capture(hidden=hidden.detach(), base_logits=None)
        if not self.cfg.self_distillation:
            return Capture(hidden=None, base_logits=None)
        with self.peft.disable_adapter():
            base = self.peft(input_ids=batch["input_ids"], **lm_inputs(batch), use_cache=False).logits
        return Capture(hidden=None, base_logits=base.float())

    # capture.mode=offline (Medusa-1): the stored last hidden state, the lm_head input that ``final_hidden``
    # records online
    offline_features = ("last_hidden",)

    @staticmethod
    def offline_unsupported(job) -> str | None:
        """Why ``job`` cannot train from stored features (None: it can)."""
        return "Medusa-2 trains adapters inside the target, so its hidden states change" \
            if job.method == "medusa2" else None

    @torch.no_grad()
    def capture_from_features(self, target_model, batch, feats: dict) -> Capture:
        return Capture(hidden=feats["last_hidden"], base_logits=None)

    def count_valid(self, drafter, batch, cap) -> torch.Tensor:
        am, lm, doc = batch["attention_mask"], batch["loss_mask"], batch.get("doc_ids")
        counts = [medusa_valid_mask(am, lm, k, doc).sum() for k in range(self.K)]
        if self.joint:
            counts.append(next_token_mask(am, lm, doc).sum())
        return torch.stack(counts).float()

    def loss(self, model, drafter, batch, cap: Capture, global_counts: torch.Tensor, scale: float):
        ids, am, lmask, doc = batch["input_ids"], batch["attention_mask"], batch["loss_mask"], batch.get("doc_ids")
        if self.joint:
            head_logits, lm_logits = model(ids, **lm_inputs(batch))
        else:
            head_logits = model(cap.hidden)
        per = medusa_head_stats(head_logits, ids, lmask, am, doc_ids=doc)
        loss = combine_step_losses([s["ce_sum"] for s in per], list(global_counts[: self.K]), self.weights)
        stats: dict[str, torch.Tensor] = {}
        for k, s in enumerate(per):
            stats[f"ce_sum_{k}"] = s["ce_sum"].detach().float()
            stats[f"top1_sum_{k}"] = s["top1_sum"].float()
            stats[f"top5_sum_{k}"] = s["top5_sum"].float()
            stats[f"count_{k}"] = s["count"].float()
            for i, v in enumerate(self._rank_hits(head_logits[k], ids, am, lmask, k, doc)):
                stats[f"rank_sum_{k}_{i}"] = v
        if self.joint:
            mask = next_token_mask(am, lmask, doc)
            if self.cfg.self_distillation:
                _, st = kd_loss(lm_logits, cap.base_logits, mask, kind="fkl")
                lm_sum = st["loss_sum"]
                stats["lm_accept_sum"] = st["accept_sum"].float()
                stats["lm_agree_sum"] = st["top1_sum"].float()
            else:
                from ..losses import ce_loss

                _, st = ce_loss(lm_logits, ids, am, lmask, doc)
                lm_sum = st["loss_sum"]
                stats["lm_agree_sum"] = st["top1_sum"].float()
                stats["lm_accept_sum"] = torch.zeros(())
            stats["lm_sum"] = lm_sum.detach().float()
            stats["lm_count"] = st["count"].float()
            loss = loss + combine_step_losses([lm_sum], [global_counts[self.K]], [self.cfg.lm_loss_weight])
        return loss * scale, {k: torch.as_tensor(v).detach().float().cpu() for k, v in stats.items()}

    @torch.no_grad()
    def _rank_hits(self, logits, ids, am, lmask, k, doc=None) -> list[torch.Tensor]:
        """Per rank i < tree_top_k: number of valid positions whose label is head k's i-th ranked token."""
        valid = medusa_valid_mask(am, lmask, k, doc).to(logits.device)
        off = 2 + k
        T = ids.shape[1]
        labels = torch.zeros_like(ids)
        if T > off:
            labels[:, : T - off] = ids[:, off:]
        x = logits[valid].float()
        y = labels.to(logits.device)[valid]
        R = min(self.R, x.shape[-1])
        top = x.topk(R, dim=-1).indices if x.shape[0] else torch.zeros(0, R, dtype=torch.long)
        hits = (top == y[:, None]).sum(0).float() if x.shape[0] else torch.zeros(R)
        return [hits[i] for i in range(R)] + [torch.zeros(()) for _ in range(self.R - R)]

    def summarize(self, stats: dict) -> dict:
        out = position_means(stats, self.K, {"ce": "ce_sum", "acc": "top1_sum", "top5": "top5_sum"})
        total = 0.0
        for k in range(self.K):
            n = max(float(stats[f"count_{k}"]), 1.0)
            for i in range(self.R):
                out[f"racc_{k}_{i}"] = float(stats[f"rank_sum_{k}_{i}"]) / n
            total += self.weights[k] * out[f"ce_{k}"]
        if self.joint:
            n = max(float(stats["lm_count"]), 1.0)
            out["lm_loss"] = float(stats["lm_sum"]) / n
            out["lm_agree"] = float(stats["lm_agree_sum"]) / n  # adapted argmax == base argmax (or == data)
            out["lm_accept"] = float(stats["lm_accept_sum"]) / n
            total += self.cfg.lm_loss_weight * out["lm_loss"]
        out["loss"] = total
        return out

    def rank_accuracy(self, summary: dict) -> list[list[float]]:
        return [[summary[f"racc_{k}_{i}"] for i in range(self.R)] for k in range(self.K)]

    def estimated_tau(self, summary: dict, k: int) -> float:
        """Chain (greedy): 1 + Σ_j Π_{i<j} acc_i over the first k heads (head accuracies treated as
        conditional ones; an approximation, heads do not see earlier drafts)."""
        return chain_tau(summary[f"acc_{i}"] for i in range(min(k, self.K)))

    # ---- loop hooks
    def finalize(self, drafter: MedusaTrainable, train_metrics: dict) -> None:
        """Before the final save: choose the default tree from the measured per-head top-k accuracy."""
        if not train_metrics:
            return
        acc = self.rank_accuracy(train_metrics)
        drafter.head_topk_accuracy = [[round(a, 5) for a in row] for row in acc]
        drafter.medusa_choices = medusa_choices_from_accuracy(acc, int(self.cfg.tree_num_nodes))

    def eval_setup(self, target_model, drafter: MedusaTrainable):
        """(target to verify with, drafter for the proposer, extra report keys). Medusa-2 merges its LoRA
        adapter into the target (in place; training is over) and verifies with that adapted target."""
        extra = {"medusa_choices": drafter.medusa_choices, "head_topk_accuracy": drafter.head_topk_accuracy}
        # the decoder (decoding.build.medusa_choices_for) reads the measured accuracy / saved tree from the heads
        drafter.heads.medusa_choices = drafter.medusa_choices
        drafter.heads.head_topk_accuracy = drafter.head_topk_accuracy
        if not self.joint:
            return target_model, drafter.heads, {**extra, "target_modified": False}
        merged = drafter.peft.merge_and_unload()
        merged.eval()
        return merged, drafter.heads, {**extra, "target_modified": True,
                                       "target_note": "Medusa-2: verified with the LoRA-adapted target (merged); "
                                                      "AR baseline = the adapted target's AR"}
