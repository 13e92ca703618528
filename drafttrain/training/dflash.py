"""DFlash as a training method: random anchors, every block of a row in one forward, weighted slot losses.

Per micro-batch: ``capture`` runs the target (taps at ``target_layer_ids``; with ``dflash.loss=kd`` also the
last hidden state, the lm_head's input) and samples the blocks (:func:`sample_anchors`); ``count_valid`` gives
the scored slots per slot index; ``loss`` runs the drafter once over all blocks under :func:`block_mask` and
scores slots 1..B-1 through the target's lm_head. The math is in drafttrain.drafters.dflash and
drafttrain.losses.

Anchors: per conversation (document of a packed row), up to ``num_anchors`` positions p where x_p and x_{p+1} are
both answer tokens (``loss_mask``), drawn without replacement by a generator seeded from (train.seed, the step,
the conversation's tokens): the same conversation gets the same blocks whether it is packed or padded, on
whichever process, and a resumed run draws what the uninterrupted one drew.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..data.chat import stop_token_ids
from ..data.packing import lm_inputs
from ..drafters.dflash import DFlashDrafter, context_mask, default_gamma, resolve_layer_ids
from ..io import DraftTrainError
from ..losses import dflash_slot_stats, dflash_slot_weights, dpace_weights
from ..targets.load import gather_taps, num_layers
from .base import MethodDefaults, position_means


@dataclass
class Blocks:
    """The blocks of a micro-batch: ``pos [B, A]`` anchor columns, ``valid [B, A]``; per slot (1..B-1)
    ``labels [B, A, S]`` and ``scored [B, A, S]``."""

    pos: torch.Tensor
    valid: torch.Tensor
    labels: torch.Tensor
    scored: torch.Tensor


@dataclass
class Capture:
    taps: torch.Tensor  # [B, T, K * H_t]
    blocks: Blocks
    last_hidden: torch.Tensor | None = None  # [B, T, H] (loss=kd): the target's lm_head input


def resolve_mask_token(mask_token_id, tokenizer, target_model, where: str = "dflash.mask_token_id") -> int:
    """The block filler: ``mask_token_id``, or the tokenizer's ``mask_token``; refused (one line) when it is
    missing, outside the target's embedding, or the pad / an end token."""
    V = int(target_model.get_input_embeddings().weight.shape[0])
    mid = mask_token_id if mask_token_id is not None else getattr(tokenizer, "mask_token_id", None)
    if mid is None:
        raise DraftTrainError(f"{where}: the target's tokenizer has no mask token; set {where}=<a row of the "
                              f"target's embedding (0..{V - 1}) that is neither pad nor an end token> (Qwen3: 151669 "
                              "<|MASK|>; Llama-3: a reserved special token such as 128002)")
    mid = int(mid)
    if not 0 <= mid < V:
        raise DraftTrainError(f"{where}={mid}: not a row of the target's embedding (0..{V - 1})")
    pad = getattr(tokenizer, "pad_token_id", None)
    ends = stop_token_ids(target_model, tokenizer)
    if mid == pad or mid in ends:
        what = "the pad token" if mid == pad else "an end token"
        raise DraftTrainError(f"{where}={mid}: is {what} of the target; the block filler must be a token the "
                              "target never produces (a reserved special token)")
    return mid


def _doc_seed(seed: int, step: int, tokens: list[int]) -> int:
    h = hashlib.blake2b(repr((seed, step, tokens)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 62) - 1)


def sample_anchors(batch: dict, num_anchors: int, block_size: int, seed: int, step: int) -> Blocks:
    """Blocks of a micro-batch (see the module docstring). A row holds the blocks of all its documents."""
    ids, lm = batch["input_ids"], batch["loss_mask"].bool() & batch["attention_mask"].bool()
    B, T = ids.shape
    docs = batch.get("doc_ids")
    rows: list[list[int]] = []
    for b in range(B):
        eligible = (lm[b, :-1] & lm[b, 1:]).clone()
        if docs is not None:
            eligible &= docs[b, :-1] == docs[b, 1:]
        cand = torch.nonzero(eligible).flatten().tolist()
        if docs is None:
            groups = {0: cand}
        else:
            groups = {}
            for p in cand:
                groups.setdefault(int(docs[b, p]), []).append(p)
        chosen = []
        for d, ps in groups.items():
            if len(ps) > num_anchors:
                cols = (docs[b] == d) if docs is not None else batch["attention_mask"][b].bool()
                g = torch.Generator().manual_seed(_doc_seed(seed, step, ids[b][cols].tolist()))
                pick = torch.randperm(len(ps), generator=g)[:num_anchors].sort().values.tolist()
                ps = [ps[i] for i in pick]
            chosen.extend(ps)
        rows.append(sorted(chosen))
    A = max(1, max(len(r) for r in rows))
    pos = torch.zeros(B, A, dtype=torch.long)
    valid = torch.zeros(B, A, dtype=torch.bool)
    for b, r in enumerate(rows):
        pos[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        valid[b, :len(r)] = True
    k = torch.arange(1, block_size)
    cols = pos[:, :, None] + k  # [B, A, S]
    inside = cols < T
    cols_c = cols.clamp(max=T - 1)
    flat = cols_c.view(B, -1)
    labels = torch.gather(ids.cpu(), 1, flat).view_as(cols)
    scored = inside & valid[:, :, None] & torch.gather(lm.cpu(), 1, flat).view_as(cols)
    if docs is not None:
        d_anchor = torch.gather(docs.cpu(), 1, pos)
        scored &= torch.gather(docs.cpu(), 1, flat).view_as(cols) == d_anchor[:, :, None]
    dev = ids.device
    return Blocks(pos=pos.to(dev), valid=valid.to(dev), labels=labels.to(dev), scored=scored.to(dev))


class DFlashMethod(MethodDefaults):
    name = "dflash"
    offline_features = ("taps", "last_hidden")

    def __init__(self, cfg, tokenizer, target_model, seed: int = 0):
        self.cfg = cfg
        self.layer_ids = resolve_layer_ids(cfg, num_layers(target_model))
        self.hf_taps = tuple(i + 1 for i in self.layer_ids)
        self.taps = list(self.hf_taps)  # what an offline store must hold (training/offline.py checks it)
        self.offline_features = ("taps", "last_hidden") if cfg.loss == "kd" else ("taps",)
        self.mask_id = resolve_mask_token(cfg.mask_token_id, tokenizer, target_model)
        self.block = int(cfg.block_size)
        self.slots = self.block - 1
        self.gamma = float(cfg.loss_gamma) if cfg.loss_gamma else default_gamma(self.block)
        self.weights = dflash_slot_weights(self.block, self.gamma)
        self.seed, self.step = int(seed), 0

    @classmethod
    def from_job(cls, job, tokenizer, target_model):
        return cls(job.dflash, tokenizer, target_model, seed=job.train.seed)

    def build_drafter(self, target_model, examples, target_name: str) -> DFlashDrafter:
        return DFlashDrafter.from_target(target_model, self.layer_ids, self.mask_id, block_size=self.block,
                                         num_layers=self.cfg.num_layers, target_name_or_path=target_name,
                                         intermediate_size=self.cfg.intermediate_size, init_layer=self.cfg.init_layer)

    def describe(self, drafter) -> str:
        return (f"{drafter.config.num_layers} layer(s), block {self.block}, target layers {self.layer_ids} "
                f"(HF hidden_states {list(self.hf_taps)}), mask token {self.mask_id}, "
                f"{self.cfg.num_anchors} anchors per conversation, {self.cfg.loss} loss, "
                + (f"slot weights exp(-(k-1)/{self.gamma:g})" if self.cfg.slot_weights == "decay" else "D-PACE weights"))

    def param_groups(self, drafter, lr: float) -> list[dict]:
        return [{"params": list(drafter.trainable_parameters()), "lr": lr}]

    def begin_step(self, step: int) -> None:
        self.step = int(step)

    def _blocks(self, batch) -> Blocks:
        return sample_anchors(batch, self.cfg.num_anchors, self.block, self.seed, self.step)

    @torch.no_grad()
    def capture(self, target_model, batch) -> Capture:
        decoder = target_model.get_decoder()
        out = decoder(input_ids=batch["input_ids"], **lm_inputs(batch), output_hidden_states=True, use_cache=False)
        last = out.last_hidden_state if self.cfg.loss == "kd" else None
        return Capture(taps=gather_taps(out.hidden_states, self.hf_taps), blocks=self._blocks(batch), last_hidden=last)

    @torch.no_grad()
    def capture_from_features(self, target_model, batch, feats: dict) -> Capture:
        return Capture(taps=feats["taps"], blocks=self._blocks(batch), last_hidden=feats.get("last_hidden"))

    def count_valid(self, drafter, batch, cap: Capture) -> torch.Tensor:
        return cap.blocks.scored.sum(dim=(0, 1)).float()

    def _inputs(self, drafter, batch, blocks: Blocks):
        B, T = batch["input_ids"].shape
        A, Bs = blocks.pos.shape[1], self.block
        dev = batch["input_ids"].device
        pos_ids = batch.get("position_ids")
        if pos_ids is None:
            pos_ids = torch.arange(T, device=dev).expand(B, T)
        ids = torch.full((B, A, Bs), self.mask_id, dtype=torch.long, device=dev)
        ids[:, :, 0] = torch.gather(batch["input_ids"], 1, blocks.pos)
        block_pos = (torch.gather(pos_ids, 1, blocks.pos)[:, :, None] + torch.arange(Bs, device=dev)).view(B, -1)
        mask = context_mask(blocks.pos, blocks.valid, batch["attention_mask"], batch.get("doc_ids"))  # [B, A, T]
        return drafter.embed(ids.view(B, -1)), block_pos, pos_ids, mask

    def loss(self, model, drafter, batch, cap: Capture, global_counts: torch.Tensor, scale: float):
        bl = cap.blocks
        embeds, block_pos, ctx_pos, mask = self._inputs(drafter, batch, bl)
        hidden = model(embeds, cap.taps, block_pos, ctx_pos, mask, self.block)  # [B, A*Bs, H]
        B, A = bl.pos.shape
        rows = hidden.view(B, A, self.block, -1)[:, :, 1:][bl.scored]  # [N, H], row-major over [B, A, S]
        slot = torch.nonzero(bl.scored)[:, 2]
        logits = drafter.logits(rows)
        labels = bl.labels[bl.scored]
        teacher = None
        if self.cfg.loss == "kd":  # the target's distribution at p+k-1 predicts x_{p+k}
            cols = (bl.pos[:, :, None] + torch.arange(self.slots, device=bl.pos.device))  # [B, A, S]: p+k-1
            b_idx = torch.arange(B, device=cols.device)[:, None, None].expand_as(cols)
            teacher = drafter.logits(cap.last_hidden[b_idx[bl.scored], cols[bl.scored]])
        if self.cfg.slot_weights == "dpace":
            with torch.no_grad():
                q = torch.zeros(bl.scored.shape, device=rows.device)
                q[bl.scored] = torch.softmax(logits.detach(), -1).gather(1, labels[:, None]).squeeze(1)
                w = dpace_weights(q, bl.scored, self.cfg.dpace_alpha)[bl.scored]
            denom = global_counts.sum()
        else:
            w = torch.tensor(self.weights, device=rows.device)[slot]
            denom = (global_counts.to(rows.device) * torch.tensor(self.weights, device=rows.device)).sum()
        st = dflash_slot_stats(logits, labels, slot, bl.scored, self.slots, slot_weights=w, teacher_logits=teacher)
        loss = st.pop("loss_sum") / denom.clamp(min=1.0) * scale
        return loss, {k: v.detach().float() for k, v in st.items()}

    def summarize(self, stats: dict) -> dict:
        out = position_means(stats, self.slots, {"loss": "loss_sum", "acc": "acc_sum"})
        blocks = max(float(stats["count_0"]), 1.0)  # blocks with a scored first slot
        for i in range(self.slots):  # the share of blocks whose slots 1..i+1 are all right: a greedy chain's
            out[f"accept_{i}"] = float(stats[f"prefix_sum_{i}"]) / blocks  # chance to accept i+1 drafts
        total = sum(self.weights)
        out["loss"] = sum(w * out[f"loss_{i}"] for i, w in enumerate(self.weights)) / total
        return out

    def estimated_tau(self, summary: dict, k: int) -> float:
        """1 + Σ_{j<k} P(slots 1..j+1 all right): the greedy chain τ of k drafted slots implied by training."""
        return 1.0 + sum(summary[f"accept_{j}"] for j in range(min(k, self.slots)))

    @staticmethod
    def offline_unsupported(job) -> str | None:
        return None
