"""The drafter's optimizer (``train.optimizer``): AdamW, or Muon on the hidden weight matrices with AdamW on the rest.

``muon`` follows the usual split (Keller Jordan's Muon; speculators' ``build_optimizers`` does the same): a
trainable 2-D matrix with both sides > 1 goes to ``torch.optim.Muon`` unless it is a vocabulary matrix (an
``lm_head`` or ``embed_tokens``); norms, biases and vocabulary matrices go to ``torch.optim.AdamW``. Muon's
step is scaled with ``adjust_lr_fn="match_rms_adamw"`` (update RMS ~ AdamW's), at ``train.muon_lr``.

Both run under one :class:`torch.optim.Optimizer` (:class:`MuonAdamW`) whose ``param_groups`` and ``state``
are the two inner optimizers' own objects: the learning-rate schedule, gradient clipping, Accelerate's
wrapper and checkpoints see one optimizer with a plain torch ``state_dict`` (Muon groups first, then AdamW's).
"""
from __future__ import annotations

import torch

from ..io import DraftTrainError

OPTIMIZERS = ("adamw", "muon")
# 2-D parameters that stay on AdamW under train.optimizer=muon (vocabulary matrices)
VOCAB_HINTS = ("lm_head", "embed_tokens")
# Muon's step size rule: its update RMS matched to AdamW's, so train.muon_lr reads like an AdamW rate
MUON_ADJUST_LR_FN = "match_rms_adamw"


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """Muon takes a trainable hidden weight matrix: 2-D, both sides > 1, not a vocabulary matrix."""
    return p.requires_grad and p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in VOCAB_HINTS)


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over the groups' hidden matrices, ``torch.optim.AdamW`` over the rest.

    ``groups``: the method's parameter groups (``{"params": [...], "lr": lr, ...}``); each is split in two,
    its Muon part at ``lr * muon_lr / base_lr`` (a group's learning-rate multiplier carries over), its AdamW
    part at ``lr``. ``names`` maps ``id(param)`` to the parameter's name."""

    def __init__(self, groups: list[dict], names: dict[int, str], base_lr: float, muon_lr: float,
                 betas: tuple[float, float], weight_decay: float, muon_momentum: float) -> None:
        muon_groups, adamw_groups = [], []
        for g in groups:
            params = [p for p in g["params"] if p.requires_grad]
            lr = float(g.get("lr", base_lr))
            to_muon = [is_muon_param(names.get(id(p), ""), p) for p in params]
            mu = [p for p, m in zip(params, to_muon) if m]
            ad = [p for p, m in zip(params, to_muon) if not m]
            if mu:
                muon_groups.append({"params": mu, "lr": lr * muon_lr / base_lr})
            if ad:
                adamw_groups.append({"params": ad, "lr": lr})
        if not muon_groups:
            raise DraftTrainError("train.optimizer=muon: the drafter has no hidden weight matrix for Muon "
                                  "(only vocabulary matrices, norms and biases); use train.optimizer=adamw")
        self._muon = torch.optim.Muon(muon_groups, lr=muon_lr, weight_decay=weight_decay, momentum=muon_momentum,
                                      adjust_lr_fn=MUON_ADJUST_LR_FN)
        self._adamw = (torch.optim.AdamW(adamw_groups, lr=base_lr, betas=tuple(betas), weight_decay=weight_decay)
                       if adamw_groups else None)
        super().__init__([p for g in muon_groups + adamw_groups for p in g["params"]], {"lr": base_lr})
        self._link()

    def _link(self) -> None:
        """One set of groups and one state: this optimizer's are the inner optimizers' objects."""
        inner = [self._muon] + ([self._adamw] if self._adamw is not None else [])
        self.param_groups = [g for o in inner for g in o.param_groups]
        for o in inner:
            o.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon.step()
        if self._adamw is not None:
            self._adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        n = len(self._muon.param_groups)
        super().load_state_dict(state_dict)  # new group dicts and a new state: hand them back to the inner ones
        self._muon.param_groups = self.param_groups[:n]
        if self._adamw is not None:
            self._adamw.param_groups = self.param_groups[n:]
        self._link()


def build_optimizer(drafter, groups: list[dict], tc, distributed: str = "NO") -> torch.optim.Optimizer:
    """The optimizer ``tc.optimizer`` names over the method's parameter groups (``tc``: drafttrain.config's
    TrainConfig). ``distributed``: Accelerate's distributed type (Muon needs whole matrices: not under
    DeepSpeed or FSDP, which shard them)."""
    if tc.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)
    if tc.optimizer != "muon":
        raise DraftTrainError(f"train.optimizer must be one of {OPTIMIZERS}, got {tc.optimizer!r}")
    if distributed in ("DEEPSPEED", "FSDP"):
        raise DraftTrainError(f"train.optimizer=muon needs whole weight matrices; {distributed} shards them: "
                              "use train.optimizer=adamw with it, or DDP (accelerate launch without a ZeRO/FSDP config)")
    names = {id(p): n for n, p in drafter.named_parameters()}
    return MuonAdamW(groups, names, tc.lr, tc.muon_lr, tuple(tc.betas), tc.weight_decay, tc.muon_momentum)
