"""``eagle3.experimental.align_top_k``: GRIFFIN's token-alignable training (arXiv 2502.11018).

From TTT step 1 on, a position is scored only if at every earlier step that scored it the target's argmax was
among the draft's top-k; each step's sum still divides by all of its valid positions. Checked against a
hand-built version of the same rule on the full unroll's logits, with and without ``checkpoint_head``."""
from __future__ import annotations

import pytest
import torch

from drafttrain.data.chat import collate
from drafttrain.losses import combine_step_losses, eagle3_aligned, eagle3_step_stats, teacher_from_logits
from drafttrain.training.eagle3 import Eagle3Method

from .test_packing import _examples, _target, _Tok
from .test_train_methods import _cfg

pytestmark = pytest.mark.usefixtures("one_thread")


def test_aligned_is_the_teachers_argmax_among_the_drafts_top_k():
    # full vocabulary 6, draft vocabulary = target ids 0, 2, 3, 5 (d2t holds offsets: target id = index + d2t)
    d2t = torch.tensor([0, 1, 1, 2])
    target = torch.full((1, 4, 6), -5.0)
    target[0, 1, 2] = 5.0  # step 0 at t: teacher at t + 1; argmax 2 at t = 0,
    target[0, 2, 5] = 5.0  # 5 at t = 1,
    target[0, 3, 1] = 5.0  # 1 at t = 2 (outside the draft vocabulary)
    teacher = teacher_from_logits(target, d2t)
    valid = torch.tensor([[True, True, True, False]])
    rows = torch.tensor([[0.0, 3.0, 2.0, 1.0],   # t=0: top-1 draft id 1 = target 2: hit
                         [3.0, 2.0, 1.0, 0.0],   # t=1: target 5 = draft id 3, ranked last
                         [3.0, 2.0, 1.0, 0.0]])  # t=2: target 1 is not in the draft vocabulary
    assert eagle3_aligned(rows, teacher, valid, d2t, 0, 1).tolist() == [True, False, False]
    assert eagle3_aligned(rows, teacher, valid, d2t, 0, 3).tolist() == [True, False, False]
    assert eagle3_aligned(rows, teacher, valid, d2t, 0, 4).tolist() == [True, True, False]
    with pytest.raises(ValueError, match="2 draft rows for 3 valid"):
        eagle3_aligned(rows[:2], teacher, valid, d2t, 0, 1)


def _method(k, checkpoint_head=False):
    return Eagle3Method(_cfg("Eagle3Config", ttt_steps=4, draft_vocab_size=30, experimental=dict(align_top_k=k),
                             checkpoint_head=checkpoint_head), _Tok(), _target())


def _by_hand(m, d, b, cap, k):
    """The rule on the full unroll: keep[t] falls at the first step that scores t and misses."""
    masks = m.valid_masks(d, b, cap)
    logits = d.ttt_forward(b["input_ids"], cap.taps, b["attention_mask"], m.ttt_steps)
    keep = torch.ones_like(masks[0])
    sums, counts, static = [], [], []
    for i, mask in enumerate(masks):
        chosen = mask & keep
        rows = logits[i][chosen]
        s = eagle3_step_stats(rows.float(), cap.teacher, chosen, d.d2t, d.t2d, i)
        hit = eagle3_aligned(rows.float(), cap.teacher, chosen, d.d2t, i, k)
        keep = keep.clone()
        keep[chosen] = hit
        sums.append(s["loss_sum"])
        counts.append(float(s["count"]))
        static.append(float(mask.sum()))
    return combine_step_losses(sums, static, m.weights), counts, static


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("checkpoint_head", [False, True])
def test_alignment_scores_the_positions_every_earlier_step_got_right(k, checkpoint_head):
    t = _target()
    ex = _examples(6, seed=4)
    b = collate(ex, 0)
    m, plain = _method(k, checkpoint_head), _method(0)
    torch.manual_seed(0)
    d = m.build_drafter(t, ex, "tiny")
    plain.d2t = m.d2t
    with torch.no_grad():  # a drafter that gets some positions right: its lm_head reads the target's head
        d.fc.weight.mul_(3.0)
    cap = m.capture(t, b)
    counts = m.count_valid(d, b, cap)
    d.zero_grad(set_to_none=True)
    loss, stats = m.loss(d, d, b, cap, counts, 1.0)
    loss.backward()
    grad = d.fc.weight.grad.clone()
    d.zero_grad(set_to_none=True)
    ref, ref_counts, static = _by_hand(m, d, b, cap, k)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, d.fc.weight.grad)
    assert [float(stats[f"count_{i}"]) for i in range(4)] == ref_counts
    assert counts.tolist() == static  # the denominators: every valid position
    # the rule bites: step 0 scores everything, later steps fewer positions, never more than without it
    assert ref_counts[0] == static[0] and ref_counts[-1] < static[-1]
    assert all(a <= s for a, s in zip(ref_counts, static))
    _, plain_stats = plain.loss(d, d, b, cap, counts, 1.0)
    assert [float(plain_stats[f"count_{i}"]) for i in range(4)] == static


def test_wider_top_k_keeps_at_least_as_many_positions():
    t = _target()
    ex = _examples(6, seed=4)
    b = collate(ex, 0)
    m1, m3 = _method(1), _method(3)
    torch.manual_seed(0)
    d = m1.build_drafter(t, ex, "tiny")
    m3.d2t = m1.d2t
    cap = m1.capture(t, b)
    with torch.no_grad():
        c1 = [float(m1.loss(d, d, b, cap, m1.count_valid(d, b, cap), 1.0)[1][f"count_{i}"]) for i in range(4)]
        c3 = [float(m3.loss(d, d, b, cap, m3.count_valid(d, b, cap), 1.0)[1][f"count_{i}"]) for i in range(4)]
    assert all(a <= c for a, c in zip(c1, c3)) and c1 != c3
