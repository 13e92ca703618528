"""EAGLE-3 as a training method: how to build the drafter, capture the target online, and score a batch.

The generic loop (loop.py) calls, per optimizer step: ``capture`` on every micro-batch (target forward under
no_grad), ``count_valid`` to learn the global number of valid positions per TTT step, then ``loss`` per
micro-batch. The math lives in drafttrain.drafters.eagle3 and drafttrain.losses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.chat import stop_token_ids
from ..data.packing import lm_inputs
from ..data.vocab import build_draft_vocab, count_assistant_tokens, default_draft_vocab_size
from ..drafters.eagle3 import Eagle3Drafter, noisy_taps
from ..io import DraftTrainError
from ..losses import (EAGLE3_LOSSES, Eagle3Teacher, combine_step_losses, eagle3_aligned, eagle3_step_stats,
                      eagle3_valid_mask, feature_regression_sum, step_weights, teacher_from_hidden,
                      teacher_from_logits)
from ..targets.load import gather_taps, num_layers, resolve_taps, text_config
from .base import MethodDefaults, chain_tau, position_means


@dataclass
class Capture:
    taps: torch.Tensor  # [B, T, 3H]
    teacher: Eagle3Teacher  # the target's distributions, compact (draft-vocabulary logits + full lse/argmax)

    @property
    def logits(self) -> torch.Tensor:
        """The teacher's logits ``[B, T, Vd]`` in draft-id order (the full vocabulary before a drafter exists)."""
        return self.teacher.dense_logits()


def _softcap(model) -> float | None:
    cfg = text_config(model.config)
    return getattr(cfg, "final_logit_softcapping", None) or None


def compact_teacher(target_model, hidden: torch.Tensor, d2t: torch.Tensor, on_demand: bool = False) -> Eagle3Teacher:
    """The teacher from the lm_head input ``hidden`` (the target's last, post-norm hidden state); ``on_demand``:
    its draft-vocabulary logits computed per TTT step from ``hidden`` (``eagle3.recompute_teacher``)."""
    head = target_model.get_output_embeddings()
    return teacher_from_hidden(hidden, head.weight, d2t.to(head.weight.device), bias=getattr(head, "bias", None),
                               softcap=_softcap(target_model), on_demand=on_demand)


def ttt_depth(step: int, ttt_steps: int, curriculum: int) -> int:
    """TTT steps unrolled at optimizer step ``step``: 1 at step 0, growing linearly to ``ttt_steps`` at step
    ``curriculum`` (and after); ``ttt_steps`` throughout with ``curriculum=0``."""
    if curriculum <= 0:
        return ttt_steps
    return max(1, min(ttt_steps, 1 + (step * ttt_steps) // curriculum))


class _Alignment:
    """``eagle3.experimental.align_top_k``'s state over one micro-batch's TTT unroll: ``keep`` ``[B, T]`` is
    False at the positions some earlier step scored where the target's argmax was not among the draft's top-k
    (:func:`drafttrain.losses.eagle3_aligned`); step i scores its valid positions that are still kept. The
    selection of each step is recorded the first time, so a recomputation of the step (``checkpoint_head``'s
    backward) scores the same rows and does not update ``keep`` again."""

    def __init__(self, top_k: int, teacher: Eagle3Teacher, d2t: torch.Tensor) -> None:
        self.top_k, self.teacher, self.d2t = top_k, teacher, d2t
        self.keep: torch.Tensor | None = None
        self.chosen: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.updated: set[int] = set()

    def select(self, i: int, rows: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if i not in self.chosen:
            if self.keep is None:
                self.chosen[i] = (None, mask)
            else:
                keep = self.keep.to(mask.device)
                self.chosen[i] = (keep[mask].to(rows.device), mask & keep)
        sel, chosen = self.chosen[i]
        return (rows if sel is None else rows[sel]), chosen

    def update(self, i: int, logits: torch.Tensor, mask: torch.Tensor) -> None:
        if i in self.updated:
            return
        self.updated.add(i)
        hit = eagle3_aligned(logits.detach(), self.teacher, mask, self.d2t, i, self.top_k)
        keep = torch.ones_like(mask, dtype=torch.bool) if self.keep is None else self.keep.clone()
        keep[mask] = hit.to(keep.device)
        self.keep = keep


class Eagle3Method(MethodDefaults):
    name = "eagle3"

    def __init__(self, cfg, tokenizer, target_model):
        self.cfg = cfg
        self.taps = resolve_taps(num_layers(target_model), cfg.tap_layers)
        self.ttt_steps = int(cfg.ttt_steps)
        if self.ttt_steps < 1:
            raise DraftTrainError(f"eagle3.ttt_steps={self.ttt_steps}: must be >= 1")
        self.weights = step_weights(self.ttt_steps, cfg.step_decay)
        exp = cfg.experimental  # eagle3.experimental: the levers that did not earn a place
        self.curriculum = int(exp.ttt_curriculum)
        self.depth = ttt_depth(0, self.ttt_steps, self.curriculum)  # steps unrolled now (begin_step updates it)
        # every stop token stays in the draft vocabulary (Llama-3 / Qwen3 list several; a rare one would
        # otherwise fall out and the drafter could never propose the end of an answer)
        self.eos_ids = stop_token_ids(target_model, tokenizer)
        if cfg.loss not in EAGLE3_LOSSES:
            raise DraftTrainError(f"eagle3.loss={cfg.loss}: expected one of {', '.join(EAGLE3_LOSSES)}")
        self.loss_kind = cfg.loss
        self.compact = bool(cfg.compact_teacher)
        self.checkpoint_head = bool(cfg.checkpoint_head)
        self.recompute_teacher = bool(cfg.recompute_teacher)
        self.feature_noise = float(exp.feature_noise)
        self.teacher_temperature = float(cfg.teacher_temperature)
        self.topk_distill = int(exp.topk_distill)
        self.topk_distill_weight = float(exp.topk_distill_weight)
        self.align_top_k = int(exp.align_top_k)
        self.score_oov = bool(exp.score_oov)
        self.answer_chains = bool(exp.answer_chains)
        self.score_prompt = bool(exp.score_prompt)
        self.feature_weight = float(exp.feature_loss_weight)

    def build_drafter(self, target_model, examples, target_name: str) -> Eagle3Drafter:
        V = target_model.get_output_embeddings().weight.shape[0]
        size = self.cfg.draft_vocab_size or default_draft_vocab_size(V)
        if size > V:
            raise DraftTrainError(f"eagle3.draft_vocab_size={size} is larger than the target vocabulary ({V})")
        counts = count_assistant_tokens(examples, V)
        d2t, t2d = build_draft_vocab(counts, size, always_include=self.eos_ids)
        self.d2t = d2t  # the teacher's draft-vocabulary rows (capture)
        coverage = counts[t2d].sum().item() / max(1, counts.sum().item())
        self.vocab_coverage = coverage
        drafter = Eagle3Drafter.from_target(
            target_model, self.taps, d2t, t2d, num_layers=self.cfg.num_layers, target_name_or_path=target_name,
            fc_norm=self.cfg.fc_norm, norm_output=self.cfg.norm_output, qk_norm=self.cfg.qk_norm,
            init_layer=self.cfg.experimental.init_layer, norm_before_residual=self.cfg.norm_before_residual,
            norm_before_fc=self.cfg.norm_before_fc,
        )
        if self.cfg.experimental.freeze_lm_head:
            drafter.freeze_lm_head()
        return drafter

    def describe(self, drafter) -> str:
        return (f"taps {list(self.taps)}, draft vocab {drafter.d2t.numel()} "
                f"(covers {self.vocab_coverage:.1%} of assistant tokens)")

    def param_groups(self, drafter, lr: float) -> list[dict]:
        return [{"params": list(drafter.trainable_parameters()), "lr": lr}]

    @torch.no_grad()
    def capture(self, target_model, batch) -> Capture:
        """The target's forward (its decoder only with the compact teacher: the lm_head is applied to the
        draft vocabulary and, for the log-normaliser and argmax, in vocabulary chunks)."""
        d2t = self._teacher_rows(target_model)
        decoder = target_model.get_decoder() if self.compact else target_model
        if decoder is target_model:  # no separable decoder (or eagle3.compact_teacher=false): full logits
            out = target_model(input_ids=batch["input_ids"], **lm_inputs(batch), output_hidden_states=True,
                               use_cache=False)
            teacher = teacher_from_logits(out.logits, d2t.to(out.logits.device))
        else:
            out = decoder(input_ids=batch["input_ids"], **lm_inputs(batch), output_hidden_states=True,
                          use_cache=False)
            teacher = compact_teacher(target_model, out.last_hidden_state, d2t, self.recompute_teacher)
        taps = gather_taps(out.hidden_states, self.taps)
        return Capture(taps=taps, teacher=teacher)

    # capture.mode=offline: the loop reads these features of the batch's rows from the store
    offline_features = ("taps", "last_hidden")

    @torch.no_grad()
    def capture_from_features(self, target_model, batch, feats: dict) -> Capture:
        """Offline capture: stored taps; the teacher recomputed with the target's lm_head from the stored
        last hidden state (the lm_head input), as in the online forward."""
        d2t = self._teacher_rows(target_model)
        if self.compact:
            return Capture(taps=feats["taps"], teacher=compact_teacher(target_model, feats["last_hidden"], d2t,
                                                                       self.recompute_teacher))
        head = target_model.get_output_embeddings()
        logits = head(feats["last_hidden"].to(head.weight.dtype)).float()
        return Capture(taps=feats["taps"], teacher=teacher_from_logits(logits, d2t.to(logits.device)))

    def _teacher_rows(self, target_model) -> torch.Tensor:
        """``d2t`` of the drafter built by :meth:`build_drafter`; before that, every target id (offsets 0)."""
        d2t = getattr(self, "d2t", None)
        if d2t is None:
            d2t = torch.zeros(target_model.get_output_embeddings().weight.shape[0], dtype=torch.long)
        return d2t

    def begin_step(self, step: int) -> None:
        """Called by the loop before each optimizer step: the TTT curriculum's depth for it."""
        self.depth = ttt_depth(step, self.ttt_steps, self.curriculum)

    def valid_masks(self, drafter, batch, cap: Capture) -> list[torch.Tensor]:
        T = batch["input_ids"].shape[1]
        scored = batch["attention_mask"] if self.score_prompt else batch["loss_mask"]
        return [
            eagle3_valid_mask(T, batch["attention_mask"], scored, cap.teacher, drafter.t2d, i,
                              doc_ids=batch.get("doc_ids"), score_oov=self.score_oov,
                              answer_chains=self.answer_chains)
            for i in range(self.ttt_steps)
        ]

    def count_valid(self, drafter, batch, cap: Capture) -> torch.Tensor:
        return torch.stack([m.sum() for m in self.valid_masks(drafter, batch, cap)]).float()

    def loss(self, model, drafter, batch, cap: Capture, global_counts: torch.Tensor, scale: float):
        """Loss of one micro-batch, scaled so the sum over micro-batches and processes is the global mean.

        ``model`` is the (possibly DDP-wrapped) drafter to call, ``drafter`` the unwrapped module.
        Returns (scaled loss, stats dict of per-step sums).
        """
        masks = self.valid_masks(drafter, batch, cap)
        align = _Alignment(self.align_top_k, cap.teacher, drafter.d2t) if self.align_top_k else None
        taps = cap.taps.to(next(drafter.parameters()).dtype)
        clean_taps, fused = taps, []

        def features():  # feature_loss_weight's targets, fc(taps) as a constant; first computed inside the
            if not fused:  # forward (step_loss runs there), where a sharding wrapper has gathered fc's weights
                with torch.no_grad():
                    fused.append(drafter.fuse(clean_taps))
            return fused[0]

        def step_loss(i, rows, head):  # rows: step i's hidden states at its valid positions (row-major)
            mask = masks[i]
            if align is not None:
                rows, mask = align.select(i, rows, mask)
            logits = head(rows).float()
            if align is not None:
                align.update(i, logits, mask)
            st = eagle3_step_stats(logits, cap.teacher, mask, drafter.d2t, drafter.t2d, i,
                                   loss=self.loss_kind, teacher_temperature=self.teacher_temperature,
                                   topk=self.topk_distill, topk_weight=self.topk_distill_weight)
            if self.feature_weight > 0:  # index t of step i stands in for the features at t+1+i (same document)
                n = mask.shape[1] - 1 - i
                target = features()[:, 1 + i:][mask[:, :n].to(clean_taps.device)]
                st["loss_sum"] = st["loss_sum"] + self.feature_weight * feature_regression_sum(
                    drafter.output_hidden(rows), target)
            return st

        d = self.depth
        if self.feature_noise > 0 and torch.is_grad_enabled():  # training only (not the loop's eval passes)
            taps = noisy_taps(taps, self.feature_noise)
        per_step = model(batch["input_ids"], taps,
                         batch["attention_mask"], d, position_ids=batch.get("position_ids"),
                         doc_ids=batch.get("doc_ids"), step_loss=step_loss, checkpoint_head=self.checkpoint_head,
                         valid=masks)
        if not (self.checkpoint_head and torch.is_grad_enabled()):  # (its backward reads the teacher again)
            cap.teacher.release_probs()  # the backward keeps its own rows; the table would live to the step's end
        sums, stats = [], {}
        for i in range(self.ttt_steps):  # steps the curriculum has not reached yet: zeros (same keys every step)
            s = per_step[i] if i < d else None
            if s is not None:
                sums.append(s["loss_sum"])
            for k in ("loss_sum", "acc_sum", "accept_sum", "count"):
                stats[f"{k}_{i}"] = torch.as_tensor(s[k]).detach().float() if s is not None else torch.zeros(())
        loss = combine_step_losses(sums, list(global_counts)[:d], self.weights[:d]) * scale
        return loss, stats

    def summarize(self, stats: dict) -> dict:
        """Per-step means from summed stats (already reduced over processes and micro-batches)."""
        out = position_means(stats, self.ttt_steps, {"loss": "loss_sum", "acc": "acc_sum", "accept": "accept_sum"})
        total = 0.0
        for i in range(self.ttt_steps):
            total += self.weights[i] * out[f"loss_{i}"]
        out["loss"] = total
        return out

    def estimated_tau(self, summary: dict, k: int) -> float:
        """1 + Σ_{j=1..k} Π_{i<j} acc_i: the chain τ implied by per-step training accuracy (greedy)."""
        return chain_tau(summary[f"acc_{i}"] for i in range(min(k, self.ttt_steps)))
