import math

import pytest
import torch
import transformers as tf

from drafttrain.data.vocab import build_draft_vocab
from drafttrain.drafters.eagle3 import Eagle3Drafter
from drafttrain.losses import combine_step_losses, eagle3_step_stats, eagle3_valid_mask, step_weights

# target vocab 4, draft vocab = target ids {0, 2, 3}
D2T = torch.tensor([0, 1, 1])
T2D = torch.tensor([True, False, True, True])


def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [x / sum(e) for x in e]


def test_soft_ce_by_hand():
    # T = 4, step 0: indices t = 0, 1 are predictable (t + 2 < 4); teacher for t is target_logits[t + 1]
    target = torch.tensor([[[9.0, 9.0, 9.0, 9.0],
                            [2.0, 1.0, 0.5, -1.0],   # teacher of t=0, argmax 0 (in draft vocab)
                            [0.0, 3.0, 1.0, 2.0],    # teacher of t=1, argmax 1 (NOT in draft vocab)
                            [5.0, 5.0, 5.0, 5.0]]])
    draft = torch.tensor([[[0.3, -0.2, 1.0], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    am = torch.ones(1, 4, dtype=torch.long)
    lm = torch.ones(1, 4, dtype=torch.long)
    valid = eagle3_valid_mask(4, am, lm, target, T2D, 0)
    assert valid.tolist() == [[True, False, False, False]]
    st = eagle3_step_stats(draft, target, valid, D2T, T2D, 0)

    p = _softmax([2.0, 0.5, -1.0])           # teacher restricted to ids 0, 2, 3, renormalised
    logq = [x - math.log(sum(math.exp(y) for y in [0.3, -0.2, 1.0])) for x in [0.3, -0.2, 1.0]]
    expected = -sum(pi * li for pi, li in zip(p, logq))
    assert st["loss_sum"].item() == pytest.approx(expected, rel=1e-6)
    assert st["count"].item() == 1
    # draft argmax = draft id 2 -> target id 3; teacher argmax = 0 -> wrong
    assert st["acc_sum"].item() == 0
    # acceptance = sum_x min(p_full, q_full)
    p_full = _softmax([2.0, 1.0, 0.5, -1.0])
    q = [math.exp(x) for x in logq]
    q_full = [q[0], 0.0, q[1], q[2]]
    assert st["accept_sum"].item() == pytest.approx(sum(min(a, b) for a, b in zip(p_full, q_full)), rel=1e-6)


@pytest.mark.parametrize("t", [1.0, 0.5, 2.0])
def test_teacher_temperature_by_hand(t):
    # the soft CE's teacher is softmax(logits / t) over the draft vocabulary; acc / accept keep the target's
    target = torch.tensor([[[9.0, 9.0, 9.0, 9.0], [2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 2.0], [5.0] * 4]])
    draft = torch.tensor([[[0.3, -0.2, 1.0], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    valid = torch.tensor([[True, False, False, False]])
    st = eagle3_step_stats(draft, target, valid, D2T, T2D, 0, teacher_temperature=t)
    base = eagle3_step_stats(draft, target, valid, D2T, T2D, 0)
    p = _softmax([2.0 / t, 0.5 / t, -1.0 / t])
    logq = [x - math.log(sum(math.exp(y) for y in [0.3, -0.2, 1.0])) for x in [0.3, -0.2, 1.0]]
    assert st["loss_sum"].item() == pytest.approx(-sum(pi * li for pi, li in zip(p, logq)), rel=1e-6)
    assert (st["loss_sum"].item() == pytest.approx(base["loss_sum"].item(), rel=1e-7)) == (t == 1.0)
    for k in ("acc_sum", "accept_sum", "count"):
        assert st[k].item() == pytest.approx(base[k].item(), rel=1e-7)
    # a very cold teacher is the hard CE on the argmax (draft id 0)
    cold = eagle3_step_stats(draft, target, valid, D2T, T2D, 0, teacher_temperature=1e-3)
    assert cold["loss_sum"].item() == pytest.approx(-logq[0], rel=1e-5)
    with pytest.raises(ValueError, match="teacher_temperature"):
        eagle3_step_stats(draft, target, valid, D2T, T2D, 0, teacher_temperature=0.0)


@pytest.mark.parametrize("k,w", [(1, 1.0), (2, 0.5), (3, 2.0)])
def test_topk_distillation_by_hand(k, w):
    # HASS's term: w x -sum over the teacher's top-k draft tokens of p(x) log q(x), added to the soft CE
    target = torch.tensor([[[9.0, 9.0, 9.0, 9.0], [2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 2.0], [5.0] * 4]])
    draft = torch.tensor([[[0.3, -0.2, 1.0], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]],
                         requires_grad=True)
    valid = torch.tensor([[True, False, False, False]])
    st = eagle3_step_stats(draft, target, valid, D2T, T2D, 0, topk=k, topk_weight=w)
    base = eagle3_step_stats(draft, target, valid, D2T, T2D, 0)
    p = _softmax([2.0, 0.5, -1.0])  # draft ids 0, 1, 2 = target ids 0, 2, 3; ranked 0 > 1 > 2
    logq = [x - math.log(sum(math.exp(y) for y in [0.3, -0.2, 1.0])) for x in [0.3, -0.2, 1.0]]
    soft = -sum(pi * li for pi, li in zip(p, logq))
    extra = -sum(p[j] * logq[j] for j in range(k))
    assert st["loss_sum"].item() == pytest.approx(soft + w * extra, rel=1e-6)
    assert base["loss_sum"].item() == pytest.approx(soft, rel=1e-6)
    for key in ("acc_sum", "accept_sum", "count"):
        assert st[key].item() == pytest.approx(base[key].item(), rel=1e-7)
    # the gradient is the soft CE's plus w x the top-k term's: d/dz [-sum_j p_j log q_j] = (sum_j p_j) q - p_topk
    (g,) = torch.autograd.grad(st["loss_sum"], draft)
    q = torch.softmax(draft[0, 0].detach().double(), -1)
    pt = torch.tensor(p, dtype=torch.double)
    top = torch.zeros(3, dtype=torch.double)
    top[:k] = pt[:k]
    want = (q - pt) + w * (top.sum() * q - top)
    torch.testing.assert_close(g[0, 0].double(), want, rtol=1e-5, atol=1e-6)
    assert float(g[0, 1:].abs().sum()) == 0.0
    with pytest.raises(ValueError, match="topk"):
        eagle3_step_stats(draft, target, valid, D2T, T2D, 0, topk=-1)


def test_accept_sum_is_one_minus_tvd_and_acc():
    g = torch.Generator().manual_seed(0)
    B, T, V, Vd = 2, 6, 12, 5
    d2t, t2d = build_draft_vocab(torch.randint(0, 9, (V,), generator=g), Vd)
    target = torch.randn(B, T, V, generator=g) * 2
    draft = torch.randn(B, T, Vd, generator=g) * 2
    valid = torch.zeros(B, T, dtype=torch.bool)
    valid[:, :4] = True
    for step in (0, 1):
        st = eagle3_step_stats(draft, target, valid, d2t, t2d, step)
        tvd_sum, acc = 0.0, 0
        ids = torch.arange(Vd) + d2t
        for b in range(B):
            for t in range(4):
                p = torch.softmax(target[b, t + 1 + step].double(), -1)
                q = torch.zeros(V, dtype=torch.double)
                q[ids] = torch.softmax(draft[b, t].double(), -1)
                tvd_sum += 1 - 0.5 * (p - q).abs().sum().item()
                acc += int(ids[draft[b, t].argmax()] == target[b, t + 1 + step].argmax())
        assert st["accept_sum"].item() == pytest.approx(tvd_sum, rel=1e-5)
        assert st["acc_sum"].item() == acc
        assert st["count"].item() == 8


def test_valid_mask_alignment_matches_definition():
    g = torch.Generator().manual_seed(1)
    B, T, V = 3, 10, 16
    t2d = torch.rand(V, generator=g) < 0.6
    target = torch.randn(B, T, V, generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 7:] = 0
    am[2, 4:] = 0
    lm = (torch.rand(B, T, generator=g) < 0.7).long() * am
    for step in range(4):
        got = eagle3_valid_mask(T, am, lm, target, t2d, step)
        for b in range(B):
            for t in range(T):
                j = t + 2 + step
                want = j < T and bool(am[b, j]) and bool(lm[b, j]) and bool(t2d[target[b, t + 1 + step].argmax()])
                assert bool(got[b, t]) == want, (step, b, t)
        assert got.any()  # non-vacuous
    assert not eagle3_valid_mask(3, am[:, :3], lm[:, :3], target[:, :3], t2d, 1).any()


def _stats_over_steps(draft_steps, target, am, lm, d2t, t2d):
    T = target.shape[1]
    out = []
    for i, dl in enumerate(draft_steps):
        valid = eagle3_valid_mask(T, am, lm, target, t2d, i)
        out.append(eagle3_step_stats(dl, target, valid, d2t, t2d, i))
    return out


def test_padding_and_global_normalisation():
    g = torch.Generator().manual_seed(2)
    V, Vd, steps = 10, 6, 3
    d2t, t2d = build_draft_vocab(torch.randint(0, 9, (V,), generator=g), Vd)
    lens = [9, 6]
    seqs = []
    for n in lens:
        target = torch.randn(1, n, V, generator=g)
        target[..., ~t2d] -= 5  # keep most teacher argmaxes inside the draft vocab
        draft = [torch.randn(1, n, Vd, generator=g) for _ in range(steps)]
        lm = torch.ones(1, n, dtype=torch.long)
        lm[0, :2] = 0
        seqs.append((target, draft, lm))
    w = step_weights(steps)

    # separately (two micro-batches), combined with global counts
    per = [_stats_over_steps(d, t, torch.ones_like(lm), lm, d2t, t2d) for t, d, lm in seqs]
    sums = [per[0][i]["loss_sum"] + per[1][i]["loss_sum"] for i in range(steps)]
    counts = [per[0][i]["count"] + per[1][i]["count"] for i in range(steps)]
    loss_sep = combine_step_losses(sums, counts, w)

    # one right-padded batch, with 3 extra padded positions of garbage
    T = max(lens) + 3
    target = torch.randn(2, T, V, generator=g) * 10
    draft = [torch.randn(2, T, Vd, generator=g) * 10 for _ in range(steps)]
    am = torch.zeros(2, T, dtype=torch.long)
    lm = torch.zeros(2, T, dtype=torch.long)
    for b, (n, (tg, dr, m)) in enumerate(zip(lens, seqs)):
        target[b, :n] = tg[0]
        for i in range(steps):
            draft[i][b, :n] = dr[i][0]
        am[b, :n] = 1
        lm[b, :n] = m[0]
    batch = _stats_over_steps(draft, target, am, lm, d2t, t2d)
    loss_batch = combine_step_losses([s["loss_sum"] for s in batch], [s["count"] for s in batch], w)
    torch.testing.assert_close(loss_batch, loss_sep)
    assert [s["count"].item() for s in batch] == [c.item() for c in counts]

    # global normalisation is a mean over all valid positions, not a mean of per-batch means
    mean_of_means = sum(w[i] * (per[0][i]["loss_sum"] / per[0][i]["count"] + per[1][i]["loss_sum"]
                                / per[1][i]["count"]) / 2 for i in range(steps))
    assert abs(mean_of_means.item() - loss_sep.item()) > 1e-4


def test_combine_and_weights():
    assert step_weights(3) == pytest.approx([1.0, 0.8, 0.64])
    assert step_weights(2, decay=0.5) == [1.0, 0.5]
    out = combine_step_losses([torch.tensor(6.0), torch.tensor(4.0), torch.tensor(3.0)],
                              [3, torch.tensor(2.0), 0], [1.0, 0.5, 2.0])
    assert out.item() == pytest.approx(6 / 3 + 0.5 * 4 / 2 + 2.0 * 3 / 1)
    with pytest.raises(ValueError):
        combine_step_losses([torch.tensor(1.0)], [1, 2], [1.0])


def test_empty_valid_mask_gives_zero_but_keeps_graph():
    draft = torch.randn(1, 5, 3, requires_grad=True)
    st = eagle3_step_stats(draft, torch.randn(1, 5, 4), torch.zeros(1, 5, dtype=torch.bool), D2T, T2D, 0)
    assert st["loss_sum"].item() == 0 and st["count"].item() == 0
    st["loss_sum"].backward()
    assert draft.grad is not None and (draft.grad == 0).all()


def test_gradient_flows_only_to_trainable_params():
    torch.manual_seed(0)
    V, Vd = 80, 30
    target = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2))
    d2t, t2d = build_draft_vocab(torch.randint(0, 20, (V,)), Vd)
    drafter = Eagle3Drafter.from_target(target, (2, 4, 5), d2t, t2d, num_layers=2)
    B, T, steps = 2, 10, 3
    ids = torch.randint(0, V, (B, T))
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 7:] = 0
    out = target(input_ids=ids, attention_mask=am, output_hidden_states=True)  # grad enabled on purpose
    taps = torch.cat([out.hidden_states[j] for j in (2, 4, 5)], -1).detach()
    logits = drafter.ttt_forward(ids, taps, am, steps)
    stats = _stats_over_steps(logits, out.logits, am, am, d2t, t2d)
    loss = combine_step_losses([s["loss_sum"] for s in stats], [s["count"] for s in stats], step_weights(steps))
    assert all(s["count"] > 0 for s in stats)
    loss.backward()
    assert drafter.embed_tokens.weight.grad is None
    for n, p in drafter.named_parameters():
        if n != "embed_tokens.weight":
            assert p.grad is not None and p.grad.abs().sum() > 0, n
    assert all(p.grad is None for p in target.parameters())  # the teacher is a constant
    assert not stats[0]["acc_sum"].requires_grad and not stats[0]["accept_sum"].requires_grad


@pytest.mark.parametrize("mass", [1.0, 0.7])
def test_soft_cross_entropy_equals_autograd(mass):
    """The fused soft CE (one-expression backward) gives autograd's loss and gradient, and the softmax."""
    from drafttrain.losses import soft_cross_entropy

    g = torch.Generator().manual_seed(4)
    z = (3 * torch.randn(37, 19, generator=g, dtype=torch.float64)).requires_grad_(True)
    p = torch.softmax(torch.randn(37, 19, generator=g, dtype=torch.float64), -1) * mass
    ref = -(p * torch.log_softmax(z, -1)).sum()
    (gz_ref,) = torch.autograd.grad(2.5 * ref, z)
    loss, q = soft_cross_entropy(z, p)
    (gz,) = torch.autograd.grad(2.5 * loss, z)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gz, gz_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(q, torch.softmax(z, -1).detach(), rtol=1e-12, atol=1e-12)
    assert not q.requires_grad


def test_soft_cross_entropy_row_max_and_float32_precision():
    """with_max gives each row's largest logit (detached), and the one-exp form keeps float32 precision with
    large logits (a float64 reference, 1e-5 relative)."""
    from drafttrain.losses import soft_cross_entropy

    g = torch.Generator().manual_seed(5)
    z = 40 * torch.randn(300, 257, generator=g) + 25
    p = torch.softmax(torch.randn(300, 257, generator=g), -1) * 0.9
    zr = z.double().requires_grad_(True)
    ref = -(p.double() * torch.log_softmax(zr, -1)).sum()
    (gz_ref,) = torch.autograd.grad(ref, zr)
    zz = z.clone().requires_grad_(True)
    loss, q, m = soft_cross_entropy(zz, p, with_max=True)
    (gz,) = torch.autograd.grad(loss, zz)
    assert torch.equal(m, z.amax(-1))
    assert not m.requires_grad and not q.requires_grad
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(gz.double(), gz_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_teacher_probs_table_matches_per_position_formulas(temperature):
    """The dense teacher's probability table (computed once, read by every TTT step) gives, at each step's
    positions, the renormalised draft-vocabulary softmax and the full-vocabulary probabilities; the on-demand
    teacher computes the same per call; and a second read reuses the table."""
    from drafttrain.losses import teacher_from_hidden, teacher_from_logits

    g = torch.Generator().manual_seed(6)
    B, T, H, V, Vd = 2, 7, 5, 13, 6
    d2t, t2d = build_draft_vocab(torch.randint(0, 9, (V,), generator=g), Vd)
    hidden, w = torch.randn(B, T, H, generator=g), 2 * torch.randn(V, H, generator=g)
    full = hidden @ w.T
    ids = torch.arange(Vd) + d2t
    dense = teacher_from_logits(full, d2t)
    lazy = teacher_from_hidden(hidden, w, d2t, chunk=4, on_demand=True)
    valid = torch.rand(B, T - 2, generator=g) > 0.3
    for step in (0, 1):
        sl = slice(1 + step, 1 + step + valid.shape[1])
        v = valid.clone()
        v[:, valid.shape[1] - step:] = False
        x = full[:, sl][v]
        want_soft = torch.softmax(x[:, ids] / temperature, -1)
        want_full = torch.softmax(x, -1)[:, ids]
        for teacher in (dense, lazy):
            p_soft, p_full = teacher.draft_probs(sl, v, temperature)
            torch.testing.assert_close(p_soft, want_soft, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(p_full, want_full, rtol=1e-5, atol=1e-7)
    table = dense._probs_cache[float(temperature)][0]
    dense.draft_probs(slice(1, 6), valid, temperature)
    assert dense._probs_cache[float(temperature)][0] is table and len(dense._probs_cache) == 1
    assert lazy._probs_cache == {}
    dense.release_probs()
    assert dense._probs_cache == {}
