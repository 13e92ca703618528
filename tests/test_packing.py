"""Sequence packing (drafttrain.data.packing) and the compact EAGLE-3 teacher (drafttrain.losses).

Packed and right-padded micro-batches of the same conversations must give the same loss, counts and
gradients for every training method (fp32, 1e-5 relative); the compact teacher must give the loss of the
full-vocabulary logits.
"""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from drafttrain.data.chat import collate
from drafttrain.data.packing import collate_packed, pack_features, pack_groups, padding_ratio
from drafttrain.losses import (Eagle3Teacher, eagle3_step_stats, eagle3_valid_mask, same_document,
                               teacher_from_hidden, teacher_from_logits)

from .test_train_methods import _cfg

pytestmark = pytest.mark.usefixtures("one_thread")

V = 61
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


class _Tok:
    eos_token_id = 2
    pad_token_id = 0


def _examples(n=7, seed=0, lo=4, hi=26, lengths=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for j in range(n if lengths is None else len(lengths)):
        T = int(torch.randint(lo, hi, (1,), generator=g)) if lengths is None else lengths[j]
        ids = torch.randint(3, V, (T,), generator=g).tolist()
        p = int(torch.randint(1, max(2, T // 2), (1,), generator=g))
        out.append({"input_ids": ids, "loss_mask": [0] * p + [1] * (T - p)})
    return out


def _target(cls=tf.LlamaForCausalLM, config=tf.LlamaConfig, seed=0, **over):
    torch.manual_seed(seed)
    return cls(config(**{**SMALL, **over})).eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------- layout
def test_pack_groups_first_fit_decreasing():
    lengths = [5, 9, 3, 7, 2, 12]
    groups = pack_groups(lengths, capacity=12)
    assert groups == [[5], [1, 2], [3, 0], [4]]  # 38 tokens: 4 rows of 12, the lower bound
    assert all(sum(lengths[i] for i in g) <= 12 for g in groups)
    assert pack_groups([20, 3], capacity=8) == [[0], [1]]  # too long for the capacity: a row of its own
    assert pack_groups([4, 4, 4], 8) == pack_groups([4, 4, 4], 8)  # deterministic


def test_collate_packed_positions_documents_and_slots():
    ex = _examples(seed=1, lengths=[3, 25, 6, 10, 18])
    b = collate_packed(ex, pad_id=0, capacity=40)
    R, T = b["input_ids"].shape
    assert (R, T) == (2, 31)  # 25 + 6 | 18 + 10 + 3: 62 cells (no padding) against 125 padded
    for i, (r, c) in enumerate(b["slots"].tolist()):
        n = len(ex[i]["input_ids"])
        assert b["input_ids"][r, c: c + n].tolist() == ex[i]["input_ids"]
        assert b["loss_mask"][r, c: c + n].tolist() == ex[i]["loss_mask"]
        assert b["position_ids"][r, c: c + n].tolist() == list(range(n))
        assert (b["doc_ids"][r, c: c + n] == b["doc_ids"][r, c]).all()
        assert b["attention_mask"][r, c: c + n].all()
    assert int(b["attention_mask"].sum()) == sum(len(e["input_ids"]) for e in ex)
    # the padding tail is a document of its own whose positions restart (transformers isolates it)
    for r in range(R):
        real = int(b["attention_mask"][r].sum())
        if real < T:
            assert b["position_ids"][r, real] == 0 and b["doc_ids"][r, real] == b["doc_ids"][r, real - 1] + 1
    assert padding_ratio(b) < padding_ratio(collate(ex, 0))
    feats = torch.randn(len(ex), max(len(e["input_ids"]) for e in ex), 3)
    placed = pack_features(feats, [len(e["input_ids"]) for e in ex], b)
    for i, (r, c) in enumerate(b["slots"].tolist()):
        n = len(ex[i]["input_ids"])
        torch.testing.assert_close(placed[r, c: c + n], feats[i, :n])


def test_packing_keeps_rows_short_within_the_tolerance():
    """Uniform conversations stay one per row at any capacity (merging them saves few cells and costs quadratic
    attention: on the docs target, 8 rows of ~190 tokens merged into one of 1366 made a step 1.4x dearer with
    data.max_length=2048); short conversations fill the rows of the long ones; the chosen packing is the
    cheapest candidate and never costlier than one conversation per padded row."""
    from drafttrain.data.packing import best_groups, pack_groups, packing_cost

    uniform = _examples(seed=4, lengths=[200, 210, 205, 190, 215, 198, 207, 202])
    ref = collate(uniform, 0)
    for capacity in (512, 2048):
        b = collate_packed(uniform, pad_id=0, capacity=capacity)
        assert "doc_ids" not in b and "slots" not in b
        assert all(torch.equal(b[k], ref[k]) for k in ref)
    docs_like = [171, 175, 168, 194, 170, 172, 169, 147]  # real rows of the docs target (plain: 1.14 cells/token)
    assert all(len(g) == 1 for g in best_groups(docs_like, capacity=2048))
    lengths = [3, 25, 6, 10, 18, 24, 7]
    groups = best_groups(lengths, capacity=64)
    T = max(sum(lengths[i] for i in g) for g in groups)
    assert (len(groups), T) == (3, 31)  # 93 cells: cheaper than 4 rows of 25 (100 cells) or 2 of 47
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for c in (25, 47, 64, 93):
        other = pack_groups(lengths, c)
        assert packing_cost(len(groups), T) <= packing_cost(len(other), max(sum(lengths[i] for i in g) for g in other))
    assert packing_cost(len(groups), T) < packing_cost(len(lengths), max(lengths))
    mixed = [500, 40, 60, 30, 80, 45, 52, 70]  # the code target's shape: one long row, short ones fill it
    g = best_groups(mixed, capacity=512)
    assert max(sum(mixed[i] for i in r) for r in g) <= 512 and len(g) < len(mixed)


def test_same_document():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2]])
    assert same_document(doc, 1).tolist() == [[True, True, False, True, False, False]]
    assert same_document(doc, 2).tolist() == [[True, False, False, False, False, False]]
    assert same_document(None, 1) is None


def test_hf_target_isolates_packed_documents():
    """The target's forward on packed rows (position restarts, no mask) equals its forward on each
    conversation alone: the premise of online capture on packed rows."""
    t = _target()
    ex = _examples(4, seed=2)
    b = collate_packed(ex, 0, capacity=48)
    out = t(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
    for i, (r, c) in enumerate(b["slots"].tolist()):
        n = len(ex[i]["input_ids"])
        alone = t(input_ids=torch.tensor([ex[i]["input_ids"]]), use_cache=False).logits[0]
        torch.testing.assert_close(out[r, c: c + n], alone, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- packed == padded loss
def _method(kind, t, **over):
    if kind.startswith("eagle3"):
        from drafttrain.training.eagle3 import Eagle3Method

        m = Eagle3Method(_cfg("Eagle3Config", ttt_steps=3, **over), _Tok(), t)
    elif kind.startswith("medusa"):
        from drafttrain.training.medusa import MedusaMethod

        joint = kind == "medusa2"
        cfg = _cfg("MedusaConfig", num_heads=3, **over)
        cfg.lora.dropout = 0.0
        m = MedusaMethod(cfg, _Tok(), t, joint=joint)
    else:
        from drafttrain.training.draft_model import DraftModelMethod as DistillMethod

        m = DistillMethod(_cfg("DistillConfig", num_layers=2, init="from_config", **over), _Tok(), t)
    return m


def _loss_and_grads(m, d, batches):
    caps = [m.capture(m_target, b) for m_target, b in batches]
    mbs = [b for _, b in batches]
    counts = sum(m.count_valid(d, b, c) for b, c in zip(mbs, caps))
    d.zero_grad(set_to_none=True)
    total, stats = 0.0, {}
    for b, c in zip(mbs, caps):
        loss, st = m.loss(d, d, b, c, counts, 1.0)
        loss.backward()
        total = total + loss.detach()
        for k, v in st.items():
            stats[k] = stats.get(k, 0.0) + float(v)
    grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    return float(total), stats, counts, grads


@pytest.mark.parametrize("kind,over", [
    ("eagle3", {}), ("eagle3_tv", {"loss": "tv"}), ("eagle3_lk", {"loss": "lk_hybrid"}),
    ("eagle3_full_teacher", {"compact_teacher": False}), ("eagle3_ckpt", {"checkpoint_head": True}),
    ("eagle3_recompute", {"recompute_teacher": True, "checkpoint_head": True}),
    ("medusa1", {}), ("medusa2", {}), ("distill_fkl", {"loss": "fkl"}), ("distill_ce", {"loss": "ce"}),
])
def test_packed_equals_padded(kind, over):
    t = _target()
    m = _method(kind, t, **over)
    ex = _examples(seed=3, lengths=[5, 24, 9, 13, 4, 17, 11])
    torch.manual_seed(0)
    d = m.build_drafter(t, ex, "tiny").float()
    mbs_pad = [collate(ex[:4], 0), collate(ex[4:], 0)]
    mbs_pack = [collate_packed(ex[:4], 0, 40), collate_packed(ex[4:], 0, 40)]
    assert sum(b["attention_mask"].numel() for b in mbs_pack) < sum(b["attention_mask"].numel() for b in mbs_pad)
    assert all(int((b["doc_ids"] * b["attention_mask"]).max()) >= 1 for b in mbs_pack)  # rows of 2+ documents
    l_pad, s_pad, n_pad, g_pad = _loss_and_grads(m, d, [(t, b) for b in mbs_pad])
    l_pack, s_pack, n_pack, g_pack = _loss_and_grads(m, d, [(t, b) for b in mbs_pack])
    assert n_pad.tolist() == n_pack.tolist() and float(n_pad.sum()) > 0
    _assert_same_step((l_pad, s_pad, g_pad), (l_pack, s_pack, g_pack))


def _assert_same_step(ref, got):
    """(loss, stats, gradients) of two forms of one training step: equal to 1e-5 relative (gradients 1e-4)."""
    (l0, s0, g0), (l1, s1, g1) = ref, got
    assert l1 == pytest.approx(l0, rel=1e-5)
    for k in s0:
        assert s1[k] == pytest.approx(s0[k], rel=1e-5, abs=1e-6), k
    assert g0.keys() == g1.keys() and g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------ compact teacher
def test_teacher_from_hidden_equals_full_logits():
    torch.manual_seed(0)
    B, T, H, Vt = 2, 5, 8, 37
    hidden = torch.randn(B, T, H)
    w, bias = torch.randn(Vt, H), torch.randn(Vt)
    d2t = torch.tensor([0, 2, 2, 5, 9, 9, 20])  # draft ids 0..6 -> target ids 0,3,4,8,13,14,26
    full = hidden @ w.t() + bias
    ref = teacher_from_logits(full, d2t)
    for chunk in (5, 16, 1000):  # chunks that do and do not divide the vocabulary
        got = teacher_from_hidden(hidden, w, d2t, bias=bias, chunk=chunk)
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.lse, ref.lse, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.top, ref.top)
    capped = teacher_from_hidden(hidden, w, d2t, bias=bias, softcap=3.0, chunk=8)
    torch.testing.assert_close(capped.lse, torch.logsumexp(3.0 * torch.tanh(full / 3.0), -1), rtol=1e-5, atol=1e-5)
    # the loss and metrics from the compact teacher are those of the full logits
    t2d = torch.zeros(Vt, dtype=torch.bool)
    t2d[torch.arange(7) + d2t] = True
    am = torch.ones(B, T, dtype=torch.long)
    draft = torch.randn(B, T, 7, requires_grad=True)
    for kind in ("ce", "tv", "lk_hybrid"):
        valid = eagle3_valid_mask(T, am, am, full, t2d, 0)
        assert torch.equal(valid, eagle3_valid_mask(T, am, am, ref, t2d, 0))
        a = eagle3_step_stats(draft, full, valid, d2t, t2d, 0, loss=kind)
        b = eagle3_step_stats(draft, teacher_from_hidden(hidden, w, d2t, bias=bias, chunk=5), valid, d2t, t2d, 0,
                              loss=kind)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_tv_loss_is_one_minus_acceptance():
    torch.manual_seed(1)
    full = torch.randn(1, 4, 9)
    d2t = torch.zeros(9, dtype=torch.long)
    t2d = torch.ones(9, dtype=torch.bool)
    valid = torch.tensor([[True, True, True, False]])
    draft = torch.randn(1, 4, 9)
    st = eagle3_step_stats(draft, full, valid, d2t, t2d, 0, loss="tv")
    p, q = full[0, 1:4].softmax(-1), draft[0, :3].softmax(-1)
    assert float(st["loss_sum"]) == pytest.approx(float((1 - torch.minimum(p, q).sum(-1)).sum()), rel=1e-5)
    assert float(st["loss_sum"]) == pytest.approx(float(st["count"] - st["accept_sum"]), rel=1e-5)
    with pytest.raises(ValueError, match="unknown EAGLE-3 loss"):
        eagle3_step_stats(draft, full, valid, d2t, t2d, 0, loss="kl")


def test_compact_capture_uses_the_decoder_and_matches_full_logits():
    """Eagle3Method.capture with the compact teacher runs the target's decoder only (its lm_head is applied
    to the draft vocabulary) and gives the teacher of the full logits, Gemma-style soft-capping included."""
    from drafttrain.training.eagle3 import Eagle3Method

    for t in (_target(), _target(tf.Gemma2ForCausalLM, tf.Gemma2Config, head_dim=8, final_logit_softcapping=5.0)):
        ex = _examples(3, seed=5)
        b = collate(ex, 0)
        m = Eagle3Method(_cfg("Eagle3Config", ttt_steps=2, draft_vocab_size=30), _Tok(), t)
        m.build_drafter(t, ex, "tiny")
        seen = []
        h = t.get_output_embeddings().register_forward_hook(lambda *a: seen.append(1))
        cap = m.capture(t, b)
        h.remove()
        assert not seen  # the lm_head module never ran over [B, T, V]
        full = t(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
        ref = teacher_from_logits(full, m.d2t)
        torch.testing.assert_close(cap.teacher.logits, ref.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cap.teacher.lse, ref.lse, rtol=1e-5, atol=1e-5)
        assert torch.equal(cap.teacher.top, ref.top)


def test_checkpoint_head_gives_the_same_loss_and_gradients():
    """eagle3.checkpoint_head recomputes each step's head and loss in the backward: same numbers."""
    t = _target()
    ex = _examples(seed=6, lengths=[12, 20, 7])
    out = []
    for ckpt in (False, True):
        m = _method("eagle3", t, checkpoint_head=ckpt, loss="lk_hybrid")
        torch.manual_seed(0)
        d = m.build_drafter(t, ex, "tiny").float()
        out.append(_loss_and_grads(m, d, [(t, collate_packed(ex, 0, 40))]))
    (l0, s0, _, g0), (l1, s1, _, g1) = out
    assert l1 == pytest.approx(l0, rel=1e-6) and s1 == pytest.approx(s0, rel=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("over", [{}, {"num_layers": 2, "qk_norm": True}, {"loss": "lk_hybrid"}])
@pytest.mark.parametrize("packed", [True, False])
def test_live_positions_give_the_full_unrolls_loss_and_gradients(over, packed):
    """From TTT step 1 on, ttt_forward runs only the positions some later step scores (prompt tokens, the ends
    of documents and padding drop out): loss, per-step stats and gradients equal the full unroll's."""
    from drafttrain.drafters import eagle3 as e3

    t = _target()
    ex = _examples(seed=8, lengths=[14, 22, 6, 18])
    m = _method("eagle3", t, **over)
    torch.manual_seed(0)
    d = m.build_drafter(t, ex, "tiny").float()
    b = collate_packed(ex, 0, 40) if packed else collate(ex, 0)
    cap = m.capture(t, b)
    counts = m.count_valid(d, b, cap)
    live_sizes = []
    real = e3._live_positions

    def spy(live):
        idx, slot = real(live)
        live_sizes.append(idx.shape[1])
        return idx, slot

    out = []
    for compact in (False, True):
        orig = d.ttt_forward
        d.ttt_forward = lambda *a, **k: orig(*a, **{**k, "compact": compact})  # noqa: B023
        e3._live_positions = spy
        try:
            d.zero_grad(set_to_none=True)
            loss, st = m.loss(d, d, b, cap, counts, 1.0)
            loss.backward()
        finally:
            e3._live_positions = real
            del d.ttt_forward
        out.append((float(loss.detach()), {k: float(v) for k, v in st.items()},
                    {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}))
    assert len(live_sizes) == 1 and live_sizes[0] < b["input_ids"].shape[1]  # the compact pass ran, on fewer rows
    assert float(counts[1:].sum()) > 0
    _assert_same_step(*out)


def test_live_positions_layout():
    from drafttrain.drafters.eagle3 import _live_positions

    live = torch.tensor([[0, 1, 0, 1, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 1]], dtype=torch.bool)
    idx, slot = _live_positions(live)
    assert idx.shape == (3, 3)
    assert idx[0].tolist() == [1, 3, 4] and slot[0].tolist() == [True, True, True]
    assert slot[1].tolist() == [False, False, False]
    assert idx[2, :2].tolist() == [0, 4] and slot[2].tolist() == [True, True, False]


def test_on_demand_teacher_equals_the_stored_one():
    """eagle3.recompute_teacher keeps [B, T, H] and the lm_head's draft rows, not [B, T, Vd] logits; the
    logits it computes per step, the loss, the metrics and the gradients are the stored teacher's."""
    torch.manual_seed(3)
    B, T, H, Vt = 2, 6, 8, 29
    hidden, w, bias = torch.randn(B, T, H), torch.randn(Vt, H), torch.randn(Vt)
    d2t = torch.tensor([0, 1, 1, 4, 4, 10])
    stored = teacher_from_hidden(hidden, w, d2t, bias=bias, softcap=4.0, chunk=7)
    lazy = teacher_from_hidden(hidden, w, d2t, bias=bias, softcap=4.0, chunk=7, on_demand=True)
    assert lazy.logits is None and lazy.hidden.shape == (B, T, H) and lazy.vocab_size == 6
    torch.testing.assert_close(lazy.dense_logits(), stored.logits, rtol=1e-5, atol=1e-5)
    v = torch.rand(B, T - 1) > 0.3
    torch.testing.assert_close(lazy.draft_logits(slice(1, T), v), stored.logits[:, 1:][v], rtol=1e-5, atol=1e-5)
    t2d = torch.zeros(Vt, dtype=torch.bool)
    t2d[torch.arange(6) + d2t] = True
    am = torch.ones(B, T, dtype=torch.long)
    valid = eagle3_valid_mask(T, am, am, stored, t2d, 1)
    assert torch.equal(valid, eagle3_valid_mask(T, am, am, lazy, t2d, 1))
    valid[:, : T - 3] = True
    for kind in ("ce", "tv"):
        grads = []
        for teacher in (stored, lazy):
            draft = torch.randn(B, T, 6, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
            st = eagle3_step_stats(draft, teacher, valid, d2t, t2d, 1, loss=kind)
            st["loss_sum"].backward()
            grads.append((st, draft.grad))
        (a, ga), (b, gb) = grads
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="either its logits or"):
        Eagle3Teacher(logits=None, lse=stored.lse, top=stored.top)


def test_step_stats_on_gathered_rows_equal_full_logits():
    """The head may run on the valid rows only: eagle3_step_stats on those rows == on the full logits."""
    torch.manual_seed(2)
    B, T, Vt = 2, 6, 11
    full = torch.randn(B, T, Vt)
    d2t = torch.tensor([0, 0, 1, 1, 3])
    t2d = torch.zeros(Vt, dtype=torch.bool)
    t2d[torch.arange(5) + d2t] = True
    draft = torch.randn(B, T, 5)
    am = torch.ones(B, T, dtype=torch.long)
    for step in (0, 2):
        valid = eagle3_valid_mask(T, am, am, full, t2d, step) | False
        valid[:, : T - 2 - step] = True  # every scorable position (argmax in vocab or not)
        n = T - 1 - step
        a = eagle3_step_stats(draft, full, valid, d2t, t2d, step, loss="lk_hybrid")
        b = eagle3_step_stats(draft[:, :n][valid[:, :n]], full, valid, d2t, t2d, step, loss="lk_hybrid")
        for k in a:
            torch.testing.assert_close(a[k], b[k])
    with pytest.raises(ValueError, match="draft rows"):
        eagle3_step_stats(draft[0], full, valid, d2t, t2d, 2)
