"""The drafter's optimizer (``train.optimizer``): AdamW, or Muon on the hidden weight matrices with AdamW on the rest.

``muon`` follows the usual split (Keller Jordan's Muon; speculators' ``build_optimizers`` does the same): a
trainable 2-D matrix with both sides > 1 goes to ``torch.optim.Muon`` unless it is a vocabulary matrix (an
``lm_head`` or ``embed_tokens``); norms, biases and vocabulary matrices go to ``torch.optim.AdamW``. Muon's
step is scaled with ``adjust_lr_fn="match_rms_adamw"`` (update RMS ~ AdamW's), at ``train.muon_lr``.

Both run under one :class:`torch.optim.Optimizer` (:class:`MuonAdamW`) whose ``param_groups`` and ``state``
are the two inner optimizers' own objects: the learning-rate schedule, gradient clipping, Accelerate's
wrapper and checkpoints see one optimizer with a plain torch ``state_dict`` (Muon groups first, then AdamW's).

``train.ema_decay`` > 0 keeps an exponential moving average of the trainable weights beside the optimizer
(:class:`WeightEMA`): the drafter saved in ``final/`` (and every evaluation) carries the average.
"""
from __future__ import annotations

import contextlib

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


class WeightEMA:
    """An exponential moving average of a module's trainable weights: after every optimizer step
    ``average = decay * average + (1 - decay) * weight`` (``train.ema_decay``; about the last
    ``1 / (1 - decay)`` steps). Only trainable parameters are averaged: the frozen embedding, a copy of the
    target's, is not copied again. ``state_dict`` / ``load_state_dict`` carry the average through checkpoints
    (``ema.safetensors``), so a resumed run continues the same average."""

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise DraftTrainError(f"train.ema_decay={decay}: must be in (0, 1) (0 turns the average off)")
        self.decay = float(decay)
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.average = {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        for n, p in self.params.items():
            self.average[n].lerp_(p.detach().to(self.average[n].dtype), 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().cpu().contiguous() for n, t in self.average.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], where: str) -> None:
        if set(state) != set(self.average):
            raise DraftTrainError(f"{where}: the saved weight average holds {sorted(set(state) - set(self.average))[:3]}"
                                  f" and lacks {sorted(set(self.average) - set(state))[:3]} (another drafter?)")
        for n, t in state.items():
            if t.shape != self.average[n].shape:
                raise DraftTrainError(f"{where}: {n} has shape {tuple(t.shape)}, this drafter's "
                                      f"{tuple(self.average[n].shape)}")
            self.average[n].copy_(t.to(self.average[n].device, self.average[n].dtype))

    @torch.no_grad()
    def copy_to_weights(self) -> None:
        """The average becomes the module's weights (the end of training)."""
        for n, p in self.params.items():
            p.copy_(self.average[n].to(p.dtype))

    @contextlib.contextmanager
    def applied(self):
        """The module holds the average inside the block, its own weights again after it."""
        kept = {n: p.detach().clone() for n, p in self.params.items()}
        self.copy_to_weights()
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(kept[n])


def build_ema(module: torch.nn.Module, tc, distributed: str = "NO") -> WeightEMA | None:
    """``train.ema_decay``'s weight average of ``module`` (None at 0). Every process keeps its own copy of the
    whole average (DDP: the same on each), which sharded training (DeepSpeed, FSDP) does not allow."""
    decay = float(getattr(tc, "ema_decay", 0.0))
    if decay == 0.0:
        return None
    if distributed in ("DEEPSPEED", "FSDP"):
        raise DraftTrainError(f"train.ema_decay={decay} averages whole weights; {distributed} shards them: use "
                              "train.ema_decay=0 with it, or DDP (accelerate launch without a ZeRO/FSDP config)")
    return WeightEMA(module, decay)
