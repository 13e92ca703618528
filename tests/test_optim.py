"""train.optimizer=muon: torch's Muon on the hidden matrices, AdamW on the rest, as one optimizer."""
from __future__ import annotations

import copy
import types

import pytest
import torch

from drafttrain.io import DraftTrainError
from drafttrain.training import checkpoint
from drafttrain.training.loop import lr_lambda
from drafttrain.training.optim import MuonAdamW, WeightEMA, build_ema, build_optimizer, is_muon_param


class _Toy(torch.nn.Module):
    """The shapes an EAGLE-3 drafter's optimizer sees: fc, a layer's matrices, norms, a bias, lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(12, 6, bias=False)
        self.q_proj = torch.nn.Linear(6, 6, bias=True)
        self.norm = torch.nn.LayerNorm(6)
        self.lm_head = torch.nn.Linear(6, 5, bias=False)
        self.embed_tokens = torch.nn.Embedding(5, 6)
        self.embed_tokens.weight.requires_grad_(False)

    def forward(self, x):
        return self.lm_head(self.norm(self.q_proj(self.fc(x)))).logsumexp(-1).sum()


def _tc(**kw):
    base = dict(optimizer="muon", lr=3e-3, muon_lr=1e-2, betas=[0.9, 0.95], weight_decay=0.0, muon_momentum=0.95)
    base.update(kw)
    return types.SimpleNamespace(**base)


def _groups(m, lr=3e-3):
    return [{"params": [p for p in m.parameters() if p.requires_grad], "lr": lr}]


def _train(model, opt, sched, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 12, generator=g)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()


def test_muon_takes_the_hidden_matrices_only():
    m = _Toy()
    names = {n for n, p in m.named_parameters() if is_muon_param(n, p)}
    assert names == {"fc.weight", "q_proj.weight"}  # not biases, norms, lm_head or the frozen embedding
    opt = build_optimizer(m, _groups(m), _tc())
    assert [len(g["params"]) for g in opt.param_groups] == [2, 4]
    assert opt.param_groups[0]["params"][0] is m.fc.weight
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-3]


def test_steps_equal_torch_muon_and_adamw_side_by_side():
    """One optimizer under a schedule == torch.optim.Muon + torch.optim.AdamW stepped by hand."""
    torch.manual_seed(0)
    a = _Toy()
    b = copy.deepcopy(a)
    opt = build_optimizer(a, _groups(a), _tc())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(2, 6, 0.1))
    mu = [b.fc.weight, b.q_proj.weight]
    ref = [torch.optim.Muon(mu, lr=1e-2, weight_decay=0.0, momentum=0.95, adjust_lr_fn="match_rms_adamw"),
           torch.optim.AdamW([b.q_proj.bias, b.norm.weight, b.norm.bias, b.lm_head.weight], lr=3e-3,
                             betas=(0.9, 0.95), weight_decay=0.0)]
    ref_sched = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(2, 6, 0.1)) for o in ref]
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randn(4, 12, generator=g)
        a(x).backward()
        b(x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        for o, s in zip(ref, ref_sched):
            o.step()
            o.zero_grad(set_to_none=True)
            s.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert not torch.equal(a.fc.weight, _Toy().fc.weight)


def test_a_group_learning_rate_multiplier_reaches_its_muon_part():
    m = _Toy()
    groups = [{"params": [m.fc.weight], "lr": 3e-3}, {"params": [m.q_proj.weight, m.q_proj.bias], "lr": 1.2e-2}]
    opt = build_optimizer(m, groups, _tc())
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-2, 4e-2, 1.2e-2])


def test_the_state_dict_round_trip_continues_the_run_exactly(tmp_path):
    """Save after 3 steps (torch.save / weights_only load, as checkpoints do), resume in a fresh optimizer:
    the same weights as 6 steps in one go."""
    torch.manual_seed(0)
    a = _Toy()
    b = copy.deepcopy(a)
    opt_a = build_optimizer(a, _groups(a), _tc())
    sched_a = torch.optim.lr_scheduler.LambdaLR(opt_a, lr_lambda(2, 6, 0.1))
    _train(a, opt_a, sched_a, 3, seed=0)
    torch.save(opt_a.state_dict(), tmp_path / "optimizer.pt")
    saved_weights = copy.deepcopy(a.state_dict())
    sched_state = sched_a.state_dict()
    _train(a, opt_a, sched_a, 3, seed=1)

    b.load_state_dict(saved_weights)
    opt_b = build_optimizer(b, _groups(b), _tc())
    sched_b = torch.optim.lr_scheduler.LambdaLR(opt_b, lr_lambda(2, 6, 0.1))
    opt_b.load_state_dict(checkpoint.load_optimizer_state(tmp_path))
    sched_b.load_state_dict(sched_state)
    assert isinstance(opt_b, MuonAdamW) and opt_b._muon.state is opt_b.state
    assert "momentum_buffer" in opt_b.state[b.fc.weight] and "exp_avg" in opt_b.state[b.lm_head.weight]
    _train(b, opt_b, sched_b, 3, seed=1)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n


def test_an_adamw_checkpoint_does_not_resume_a_muon_run(tmp_path):
    m = _Toy()
    adamw = build_optimizer(m, _groups(m), _tc(optimizer="adamw"))
    sched = torch.optim.lr_scheduler.LambdaLR(adamw, lr_lambda(2, 6, 0.1))
    _train(m, adamw, sched, 1)
    checkpoint.save_checkpoint(tmp_path / "step_1", m, adamw, sched, 1, {})
    muon = build_optimizer(m, _groups(m), _tc())
    with pytest.raises(DraftTrainError, match=r"optimizer\.pt: the saved optimizer state does not fit"):
        checkpoint.load_checkpoint(tmp_path / "step_1", m, muon, torch.optim.lr_scheduler.LambdaLR(
            muon, lr_lambda(2, 6, 0.1)))


@pytest.mark.parametrize("kind", ["DEEPSPEED", "FSDP"])
def test_muon_is_refused_where_the_matrices_are_sharded(kind):
    m = _Toy()
    with pytest.raises(DraftTrainError, match=f"train.optimizer=muon needs whole weight matrices; {kind}"):
        build_optimizer(m, _groups(m), _tc(), kind)
    assert isinstance(build_optimizer(m, _groups(m), _tc(optimizer="adamw"), kind), torch.optim.AdamW)


def test_muon_without_a_hidden_matrix_is_refused():
    m = torch.nn.Module()
    m.lm_head = torch.nn.Linear(4, 3)
    with pytest.raises(DraftTrainError, match="no hidden weight matrix for Muon"):
        build_optimizer(m, _groups(m), _tc())


# ---------------------------------------------------------------------------------- train.ema_decay
def test_the_weight_average_follows_its_recursion_and_swaps_in_and_out():
    torch.manual_seed(0)
    m = _Toy()
    start = {n: p.detach().clone() for n, p in m.named_parameters()}
    ema = WeightEMA(m, 0.75)
    assert "embed_tokens.weight" not in ema.average  # frozen: not averaged (a copy of the target's)
    expect = {n: t.clone() for n, t in ema.average.items()}
    for k in range(3):
        with torch.no_grad():
            for p in m.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p))
        ema.update()
        for n, p in m.named_parameters():
            if p.requires_grad:
                expect[n] = 0.75 * expect[n] + 0.25 * p.detach()
    for n, t in expect.items():
        torch.testing.assert_close(ema.average[n], t)
    live = {n: p.detach().clone() for n, p in m.named_parameters()}
    with ema.applied():
        for n, p in m.named_parameters():
            assert torch.equal(p, ema.average[n] if n in ema.average else live[n]), n
    for n, p in m.named_parameters():
        assert torch.equal(p, live[n]), n  # restored exactly
    assert not torch.equal(live["fc.weight"], start["fc.weight"])
    ema.copy_to_weights()
    assert torch.equal(m.fc.weight, ema.average["fc.weight"])


def test_the_weight_average_round_trips_and_refuses_another_drafter():
    torch.manual_seed(0)
    a, b = _Toy(), _Toy()
    ea, eb = WeightEMA(a, 0.9), WeightEMA(b, 0.9)
    eb.load_state_dict(ea.state_dict(), "x/ema.safetensors")
    for n in ea.average:
        assert torch.equal(ea.average[n], eb.average[n])
    bad = dict(ea.state_dict())
    bad.pop("fc.weight")
    with pytest.raises(DraftTrainError, match="x/ema.safetensors.*lacks.*fc.weight"):
        eb.load_state_dict(bad, "x/ema.safetensors")


@pytest.mark.parametrize("kind", ["DEEPSPEED", "FSDP"])
def test_the_weight_average_is_off_at_zero_and_refused_where_weights_are_sharded(kind):
    m = _Toy()
    assert build_ema(m, _tc(ema_decay=0.0)) is None
    assert isinstance(build_ema(m, _tc(ema_decay=0.9), "MULTI_CPU"), WeightEMA)
    with pytest.raises(DraftTrainError, match=f"train.ema_decay=0.9 .*{kind} shards"):
        build_ema(m, _tc(ema_decay=0.9), kind)


def test_a_checkpoint_without_the_average_does_not_resume_an_averaging_run(tmp_path):
    m = _Toy()
    opt = build_optimizer(m, _groups(m), _tc(optimizer="adamw"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(0, 10, 0.1))
    checkpoint.save_checkpoint(tmp_path / "step_1", m, opt, sched, 1, {})
    with pytest.raises(DraftTrainError, match="ema.safetensors: missing.*train.ema_decay=0"):
        checkpoint.load_ema(tmp_path / "step_1")
    ema = WeightEMA(m, 0.9)
    checkpoint.write_checkpoint(tmp_path / "step_2", m.state_dict(), opt.state_dict(), sched, 2, {},
                                ema=ema.state_dict())
    assert checkpoint.load_ema(tmp_path / "step_2").keys() == ema.average.keys()
