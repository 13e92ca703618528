"""EAGLE-3 training options that change only the training signal.

- ``eagle3.experimental.feature_noise`` (EAGLE-1's feature augmentation): uniform noise, bounded by the scale
  times each tap's RMS at each position, off at 0, applied in training only.
- ``eagle3.teacher_temperature``: the soft CE's teacher is ``softmax(logits / t)`` (by hand in
  tests/test_losses.py); here: the method passes it through.
- ``eagle3.experimental.freeze_lm_head``: the draft lm_head stays the target's rows (no gradient, not optimised).
- ``eagle3.experimental.score_oov``: positions whose target argmax is outside the draft vocabulary are scored too.
- ``eagle3.experimental.topk_distill``: HASS's top-k term reaches the loss (by hand in tests/test_losses.py).
- ``eagle3.experimental.score_prompt``: every real position is scored, not only the answers'.
- ``eagle3.experimental.answer_chains``: only the chains that start from an answer token are scored.
- ``eagle3.experimental.feature_loss_weight``: each step's output hidden state against the fused features it
  stands in for.

A drafter trained with all of them still decodes exactly (greedy == AR)."""
from __future__ import annotations

import pytest
import torch

from drafttrain.data.chat import collate
from drafttrain.decoding.engine import SpecDecoder
from drafttrain.decoding.proposers import Eagle3ChainProposer, NoDraft
from drafttrain.decoding.target import TargetRunner
from drafttrain.drafters.eagle3 import noisy_taps
from drafttrain.training.eagle3 import Eagle3Method

from .test_packing import V, _examples, _target, _Tok
from .test_train_methods import _cfg

pytestmark = pytest.mark.usefixtures("one_thread")


def test_noise_is_bounded_by_each_taps_rms_and_off_at_zero():
    g = torch.Generator().manual_seed(0)
    H = 16
    taps = torch.randn(2, 5, 3 * H, generator=g)
    taps[..., H:2 * H] *= 100.0  # one tap 100x the others' scale: its noise scales with it
    assert noisy_taps(taps, 0.0) is taps
    out = noisy_taps(taps, 0.2, torch.Generator().manual_seed(1))
    assert out.shape == taps.shape and out.dtype == taps.dtype
    x, y = taps.reshape(2, 5, 3, H), out.reshape(2, 5, 3, H)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    rel = (y - x) / rms
    assert rel.abs().max() <= 0.2 + 1e-6  # U(-a, a) x RMS
    assert rel.abs().max() > 0.15 and rel.abs().mean() > 0.05  # and spread over that range, every tap
    assert rel.abs().mean(dim=(0, 1, 3)).min() > 0.05
    assert abs(float(rel.mean())) < 0.03  # zero-mean
    again = noisy_taps(taps, 0.2, torch.Generator().manual_seed(1))
    torch.testing.assert_close(again, out)  # reproducible from the generator


def _method(noise, teacher_temperature=1.0, freeze_lm_head=False, score_oov=False, topk_distill=0,
            score_prompt=False, feature_loss_weight=0.0, answer_chains=False):
    experimental = dict(feature_noise=noise, freeze_lm_head=freeze_lm_head, score_oov=score_oov,
                        topk_distill=topk_distill, score_prompt=score_prompt,
                        feature_loss_weight=feature_loss_weight, answer_chains=answer_chains)
    return Eagle3Method(_cfg("Eagle3Config", ttt_steps=3, draft_vocab_size=30,
                             teacher_temperature=teacher_temperature, experimental=experimental),
                        _Tok(), _target())


def _loss(m, d, t, b):
    cap = m.capture(t, b)
    return m.loss(d, d, b, cap, m.count_valid(d, b, cap), 1.0)[0]


def _fc_grad(m, d, t, b):
    d.zero_grad(set_to_none=True)
    loss = _loss(m, d, t, b)
    loss.backward()
    return loss.detach(), d.fc.weight.grad.clone()


def test_noise_changes_the_training_step_only_under_grad():
    t = _target()
    ex = _examples(4, seed=3)
    b = collate(ex, 0)
    plain, noisy = _method(0.0), _method(0.3)
    torch.manual_seed(0)
    d = plain.build_drafter(t, ex, "tiny")
    noisy.d2t = plain.d2t
    ref, ref_g = _fc_grad(plain, d, t, b)
    torch.manual_seed(5)
    a, g = _fc_grad(noisy, d, t, b)
    torch.manual_seed(5)
    a2, g2 = _fc_grad(noisy, d, t, b)
    # fc reads the taps: its gradient moves with the noise (the random drafter's loss barely does)
    assert (g - ref_g).norm() > 0.05 * ref_g.norm()
    assert a != ref
    torch.testing.assert_close(g, g2)  # seeded: reproducible
    torch.testing.assert_close(a, a2)
    with torch.no_grad():  # no noise outside training
        torch.testing.assert_close(_loss(noisy, d, t, b), ref)


@pytest.mark.parametrize("option", [{"teacher_temperature": 0.5}, {"topk_distill": 3}])
def test_a_loss_option_reaches_the_loss_and_leaves_the_statistics(option):
    t = _target()
    ex = _examples(4, seed=3)
    b = collate(ex, 0)
    plain, other = _method(0.0), _method(0.0, **option)
    torch.manual_seed(0)
    d = plain.build_drafter(t, ex, "tiny")
    other.d2t = plain.d2t
    a, ga = _fc_grad(plain, d, t, b)
    c, gc = _fc_grad(other, d, t, b)
    assert (ga - gc).norm() > 0.05 * ga.norm()  # (the random drafter's loss itself is near log Vd either way)
    assert a != c
    if "topk_distill" in option:
        assert c > a  # the extra term is a positive sum of -p log q
    with torch.no_grad():
        cap = plain.capture(t, b)
        _, sa = plain.loss(d, d, b, cap, plain.count_valid(d, b, cap), 1.0)
        _, sc = other.loss(d, d, b, cap, other.count_valid(d, b, cap), 1.0)
    assert all(torch.equal(sa[k], sc[k]) for k in sa if not k.startswith("loss_sum"))  # acc / accept: the target's


def test_frozen_lm_head_is_the_targets_rows_and_gets_no_gradient():
    t = _target()
    ex = _examples(4, seed=3)
    b = collate(ex, 0)
    m = _method(0.0, freeze_lm_head=True)
    d = m.build_drafter(t, ex, "tiny")
    names = {id(p): n for n, p in d.named_parameters()}
    trainable = {names[id(p)] for p in m.param_groups(d, 1e-3)[0]["params"]}
    assert "lm_head.weight" not in trainable and "fc.weight" in trainable and "norm.weight" in trainable
    rows = t.get_output_embeddings().weight[d.draft_target_ids()]
    torch.testing.assert_close(d.lm_head.weight, rows)
    _loss(m, d, t, b).backward()
    assert d.lm_head.weight.grad is None and d.fc.weight.grad is not None
    plain = _method(0.0)
    assert "lm_head.weight" in {n for n, p in plain.build_drafter(t, ex, "tiny").named_parameters() if p.requires_grad}


def _masks_pair(**option):
    """(batch, the recipe's method, the method with ``option``, a drafter, the target's capture)."""
    t = _target()
    ex = _examples(4, seed=3)
    b = collate(ex, 0)
    plain, other = _method(0.0), _method(0.0, **option)
    torch.manual_seed(0)
    d = plain.build_drafter(t, ex, "tiny")
    return b, plain, other, d, plain.capture(t, b)


def test_score_oov_adds_exactly_the_out_of_vocabulary_positions():
    b, plain, oov, d, cap = _masks_pair(score_oov=True)
    for i, (mp, mo) in enumerate(zip(plain.valid_masks(d, b, cap), oov.valid_masks(d, b, cap))):
        T = mp.shape[1]
        top = cap.teacher.top[:, 1 + i:]
        in_vocab = torch.zeros_like(mp)
        in_vocab[:, :T - 1 - i] = d.t2d[top]
        assert torch.equal(mp, mo & in_vocab) and bool((mo & ~in_vocab).any())  # the draft vocabulary is 30 of V
    sp = plain.loss(d, d, b, cap, plain.count_valid(d, b, cap), 1.0)[1]
    so = oov.loss(d, d, b, cap, oov.count_valid(d, b, cap), 1.0)[1]
    assert so["count_0"] > sp["count_0"] and torch.equal(so["acc_sum_0"], sp["acc_sum_0"])  # no hit is possible there


def test_score_prompt_scores_every_real_position_the_teacher_allows():
    b, plain, every, d, cap = _masks_pair(score_prompt=True)
    am = b["attention_mask"]
    assert bool((b["loss_mask"] < am).any())  # the rows have prompt tokens
    for i, (mp, me) in enumerate(zip(plain.valid_masks(d, b, cap), every.valid_masks(d, b, cap))):
        T = mp.shape[1]
        top = cap.teacher.top[:, 1 + i:]
        want = torch.zeros_like(mp)
        want[:, :T - 2 - i] = am[:, 2 + i:].bool() & d.t2d[top[:, :T - 2 - i]]
        assert torch.equal(me, want)
        assert not bool((mp & ~me).any()) and int(me.sum()) > int(mp.sum())  # the answers' positions and more
    sp = plain.loss(d, d, b, cap, plain.count_valid(d, b, cap), 1.0)[1]
    se = every.loss(d, d, b, cap, every.count_valid(d, b, cap), 1.0)[1]
    assert se["count_0"] > sp["count_0"]


def test_answer_chains_drop_exactly_the_chains_that_start_in_the_prompt():
    b, plain, chains, d, cap = _masks_pair(answer_chains=True)
    lm = b["loss_mask"].bool()
    for i, (mp, mc) in enumerate(zip(plain.valid_masks(d, b, cap), chains.valid_masks(d, b, cap))):
        T = mp.shape[1]
        start = torch.zeros_like(mp)
        start[:, :T - 1] = lm[:, 1:]  # x_{t+1}, the token step 0 embeds at t, is an answer token
        assert torch.equal(mc, mp & start)
        assert bool((mp & ~start).any())  # step i scores i + 1 chains per answer that start in its prompt
    sp = plain.loss(d, d, b, cap, plain.count_valid(d, b, cap), 1.0)[1]
    sc = chains.loss(d, d, b, cap, chains.count_valid(d, b, cap), 1.0)[1]
    assert sc["count_0"] < sp["count_0"]


def test_feature_loss_is_each_steps_output_against_the_next_fused_features():
    t = _target()
    ex = _examples(4, seed=3)
    b = collate(ex, 0)
    w = 0.5
    plain, feat = _method(0.0), _method(0.0, feature_loss_weight=w)
    torch.manual_seed(0)
    d = plain.build_drafter(t, ex, "tiny")
    feat.d2t = plain.d2t
    cap = plain.capture(t, b)
    counts = plain.count_valid(d, b, cap)
    a = plain.loss(d, d, b, cap, counts, 1.0)[0]
    f = feat.loss(d, d, b, cap, counts, 1.0)[0]
    with torch.no_grad():  # the reference: the plain unroll's per-step output hidden states, over [B, T]
        _, hidden = d.ttt_forward(b["input_ids"], cap.taps, b["attention_mask"], 3, return_hidden=True)
        fused = d.fuse(cap.taps)
    extra = 0.0
    for i, m in enumerate(plain.valid_masks(d, b, cap)):
        n = m.shape[1] - 1 - i
        diff = hidden[i][:, :n][m[:, :n]] - fused[:, 1 + i:][m[:, :n]]  # index t against the features at t+1+i
        extra += plain.weights[i] * w * float(diff.pow(2).mean(-1).sum()) / float(counts[i])
    assert extra > 1e-3
    assert float((f - a).detach()) == pytest.approx(extra, rel=1e-4)
    f.backward()
    assert d.fc.weight.grad is not None and float(d.fc.weight.grad.abs().sum()) > 0


def test_loss_releases_the_teacher_probability_table():
    """The dense teacher's probability table (read by every TTT step) is dropped when the micro-batch's loss is
    done: every micro-batch's capture lives until the optimizer step ends, the table need not. With
    checkpoint_head under grad the backward reads the teacher again, so it stays until then."""
    t = _target()
    ex = _examples(4, seed=3)
    b = collate(ex, 0)
    m = _method(0.0)
    d = m.build_drafter(t, ex, "tiny")
    cap = m.capture(t, b)
    m.loss(d, d, b, cap, m.count_valid(d, b, cap), 1.0)
    assert cap.teacher._probs_cache == {}
    m.checkpoint_head = True
    loss, _ = m.loss(d, d, b, cap, m.count_valid(d, b, cap), 1.0)
    assert len(cap.teacher._probs_cache) == 1
    loss.backward()


def test_greedy_equals_ar_after_training_with_the_options():
    t = _target()
    ex = _examples(6, seed=4)
    b = collate(ex, 0)
    m = _method(0.3, teacher_temperature=0.5, freeze_lm_head=True, score_oov=True, topk_distill=3,
                score_prompt=True, feature_loss_weight=0.1, answer_chains=True)
    torch.manual_seed(0)
    d = m.build_drafter(t, ex, "tiny")
    head = d.lm_head.weight.clone()
    opt = torch.optim.AdamW(d.trainable_parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        _loss(m, d, t, b).backward()
        opt.step()
    torch.testing.assert_close(d.lm_head.weight, head)  # frozen through training
    d.eval()
    runner = TargetRunner(t, taps=m.taps)
    prompt = torch.randint(3, V, (9,), generator=torch.Generator().manual_seed(7)).tolist()
    ar = SpecDecoder(runner, NoDraft(), 0).generate(prompt, 20).tokens
    spec = SpecDecoder(runner, Eagle3ChainProposer(d, max_len=96), 3).generate(prompt, 20)
    assert spec.tokens == ar
