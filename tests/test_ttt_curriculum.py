"""EAGLE-3's TTT curriculum (``eagle3.experimental.ttt_curriculum``): the unrolled depth grows from 1 to
``ttt_steps``, the loss at depth d is the full loss's first d terms, and at full depth it is the loss without a curriculum."""
from __future__ import annotations

import pytest
import torch

from drafttrain.data.chat import collate
from drafttrain.losses import combine_step_losses
from drafttrain.training.eagle3 import Eagle3Method, ttt_depth

from .test_packing import _examples, _target, _Tok
from .test_train_methods import _cfg

pytestmark = pytest.mark.usefixtures("one_thread")


def test_ttt_depth_schedule():
    assert [ttt_depth(s, 4, 0) for s in (0, 5, 99)] == [4, 4, 4]  # no curriculum: full depth
    assert [ttt_depth(s, 4, 8) for s in range(10)] == [1, 1, 2, 2, 3, 3, 4, 4, 4, 4]
    assert ttt_depth(0, 1, 10) == 1 and ttt_depth(1000, 7, 10) == 7


def _loss(m, d, t, b):
    cap = m.capture(t, b)
    counts = m.count_valid(d, b, cap)
    loss, stats = m.loss(d, d, b, cap, counts, 1.0)
    return loss, stats, counts


def test_curriculum_loss_is_the_first_terms_of_the_full_loss():
    t = _target()
    b = collate(_examples(4, seed=3), 0)
    full = Eagle3Method(_cfg("Eagle3Config", ttt_steps=4, draft_vocab_size=30), _Tok(), t)
    cur = Eagle3Method(_cfg("Eagle3Config", ttt_steps=4, draft_vocab_size=30, experimental=dict(ttt_curriculum=8)),
                       _Tok(), t)
    torch.manual_seed(0)
    d = full.build_drafter(t, _examples(4, seed=3), "tiny")
    cur.d2t = full.d2t  # the same draft vocabulary for the teacher (build_drafter records it)
    ref, ref_stats, counts = _loss(full, d, t, b)
    for step, depth in ((0, 1), (2, 2), (5, 3)):
        cur.begin_step(step)
        assert cur.depth == depth
        loss, stats, _ = _loss(cur, d, t, b)
        sums = [torch.as_tensor(ref_stats[f"loss_sum_{i}"]) for i in range(depth)]
        expect = combine_step_losses(sums, list(counts)[:depth], full.weights[:depth])
        torch.testing.assert_close(loss.detach(), expect, rtol=1e-5, atol=1e-6)
        assert all(float(stats[f"count_{i}"]) == 0 for i in range(depth, 4))  # same keys, zeros beyond
        assert sorted(stats) == sorted(ref_stats)
    cur.begin_step(8)
    loss, _, _ = _loss(cur, d, t, b)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)  # full depth: the loss without a curriculum
