import math

import pytest
import torch
import transformers as tf

from drafttrain.drafters.draft_lm import build_draft_lm, mix_batches, on_policy_records, sample_on_policy
from drafttrain.io import DraftTrainError
from drafttrain.losses import ce_loss, kd_fkl, kd_jsd, kd_loss, kd_rkl, kd_tvd, next_token_mask

V, L = 96, 8
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=L, num_attention_heads=8,
              num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ARCHS = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}


def make_target(arch="llama", seed=0, **over):
    torch.manual_seed(seed)
    C, M = ARCHS[arch]
    return M(C(**{**COMMON, **over})).eval()


# --------------------------------------------------------------------------------------- divergences
S = [0.5, -1.0, 2.0, 0.0]   # student logits
P = [1.5, 0.3, -0.7, 0.9]   # teacher logits


def _sm(xs, t=1.0):
    m = max(xs)
    e = [math.exp((x - m) / t) for x in xs]
    return [x / sum(e) for x in e]


def _kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)


def _t(xs):
    return torch.tensor([xs])


@pytest.mark.parametrize("temp", [1.0, 2.0])
def test_divergences_by_hand(temp):
    p, q = _sm(P, temp), _sm(S, temp)
    assert kd_fkl(_t(S), _t(P), temp).item() == pytest.approx(_kl(p, q), rel=1e-5)
    assert kd_rkl(_t(S), _t(P), temp).item() == pytest.approx(_kl(q, p), rel=1e-5)
    assert kd_tvd(_t(S), _t(P), temp).item() == pytest.approx(0.5 * sum(abs(x - y) for x, y in zip(p, q)), rel=1e-5)
    b = 0.3
    m = [b * x + (1 - b) * y for x, y in zip(p, q)]
    assert kd_jsd(_t(S), _t(P), b, temp).item() == pytest.approx(b * _kl(p, m) + (1 - b) * _kl(q, m), rel=1e-5)
    # the values differ from each other, so a swapped direction would be caught
    assert abs(_kl(p, q) - _kl(q, p)) > 0.05


def test_jsd_conventions():
    s, p = torch.randn(5, 11), torch.randn(5, 11)
    torch.testing.assert_close(kd_jsd(s, p, 0.0), kd_fkl(s, p))   # TRL/GKD end points
    torch.testing.assert_close(kd_jsd(s, p, 1.0), kd_rkl(s, p))
    j = kd_jsd(s, p, 0.5)
    torch.testing.assert_close(j, kd_jsd(p, s, 0.5))              # symmetric at beta = 0.5
    assert bool((j >= 0).all()) and bool((j <= math.log(2) + 1e-6).all())
    # small beta behaves like beta * forward KL
    torch.testing.assert_close(kd_jsd(s, p, 1e-4) / 1e-4, kd_fkl(s, p), rtol=1e-2, atol=1e-3)
    with pytest.raises(ValueError):
        kd_jsd(s, p, 1.5)


def test_divergences_zero_iff_equal():
    x = torch.randn(3, 7)
    for f in (kd_fkl, kd_rkl, kd_tvd):
        assert f(x, x).abs().max().item() < 1e-6
        assert f(x, x + torch.randn(3, 7)).min().item() > 0
    assert kd_jsd(x, x, 0.3).abs().max().item() < 1e-6


def test_acceptance_identity():
    g = torch.Generator().manual_seed(0)
    s, p = torch.randn(6, 4, 50, generator=g) * 2, torch.randn(6, 4, 50, generator=g) * 2
    accept = torch.minimum(torch.softmax(s, -1), torch.softmax(p, -1)).sum(-1)
    torch.testing.assert_close(accept, 1 - kd_tvd(s, p), rtol=1e-5, atol=1e-6)
    mask = torch.rand(6, 4, generator=g) > 0.3
    _, st = kd_loss(s, p, mask, "tvd")
    assert st["accept_sum"].item() / st["count"].item() == pytest.approx(1 - st["tvd"].item(), rel=1e-5)


def test_tvd_gradient_sign():
    g = torch.Generator().manual_seed(1)
    p_logits = torch.randn(4, 20, generator=g)
    s = torch.randn(4, 20, generator=g).requires_grad_(True)
    tvd = kd_tvd(s, p_logits).sum()
    tvd.backward()
    with torch.no_grad():
        after = kd_tvd(s - 0.05 * s.grad, p_logits).sum()
        assert after.item() < tvd.item()
        # moving q toward p in probability space shrinks TVD by exactly the mixing factor
        q, p = torch.softmax(s, -1), torch.softmax(p_logits, -1)
        eps = 0.25
        moved = torch.log((1 - eps) * q + eps * p)
        torch.testing.assert_close(kd_tvd(moved, p_logits), (1 - eps) * kd_tvd(s, p_logits), rtol=1e-5, atol=1e-6)
    assert s.grad.abs().sum() > 0
    assert p_logits.grad is None


def test_masked_vocab_entries_stay_finite():
    s = torch.tensor([[0.0, 1.0, float("-inf"), 2.0]], requires_grad=True)
    p = torch.tensor([[1.0, 0.0, float("-inf"), 0.5]])
    for kind in ("fkl", "rkl", "jsd", "tvd"):
        loss, _ = kd_loss(s[None], p[None], torch.ones(1, 1, dtype=torch.bool), kind)
        loss.backward()
        assert math.isfinite(loss.item()) and torch.isfinite(s.grad).all(), kind
        s.grad = None
    want = _kl(_sm([1.0, 0.0, 0.5]), _sm([0.0, 1.0, 2.0]))
    assert kd_fkl(s, p).item() == pytest.approx(want, rel=1e-5)


def test_kd_loss_mask_mix_and_errors():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(2, 5, 9, generator=g, requires_grad=True)
    p = torch.randn(2, 5, 9, generator=g)
    mask = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 1, 0, 0]], dtype=torch.bool)
    loss, st = kd_loss(s, p, mask, "rkl")
    assert st["count"].item() == 5
    assert loss.item() == pytest.approx(kd_rkl(s, p)[mask].mean().item(), rel=1e-6)
    mix, st2 = kd_loss(s, p, mask, {"fkl": 0.25, "tvd": 2.0}, temperature=1.5)
    want = 0.25 * kd_fkl(s, p, 1.5)[mask].mean() + 2.0 * kd_tvd(s, p, 1.5)[mask].mean()
    assert mix.item() == pytest.approx(want.item(), rel=1e-6)
    assert set(st2) >= {"fkl", "tvd", "loss_sum", "count", "accept_sum", "top1_sum"}
    assert st2["top1_sum"].item() == (s.argmax(-1) == p.argmax(-1))[mask].sum().item()
    jsd, _ = kd_loss(s, p, mask, "jsd", beta=0.2)
    assert jsd.item() == pytest.approx(kd_jsd(s, p, 0.2)[mask].mean().item(), rel=1e-6)
    mix.backward()
    assert (s.grad[~mask] == 0).all() and s.grad[mask].abs().sum() > 0
    with pytest.raises(ValueError, match="unknown"):
        kd_loss(s, p, mask, "kl")
    with pytest.raises(ValueError):
        kd_loss(s, p[..., :8], mask, "fkl")
    empty, st3 = kd_loss(s, p, torch.zeros_like(mask), "fkl")
    assert empty.item() == 0.0 and st3["count"].item() == 0


def test_ce_loss_by_hand():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [2.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 3.0]]])
    ids = torch.tensor([[0, 2, 1, 2]])
    am = torch.tensor([[1, 1, 1, 0]])
    lm = torch.tensor([[0, 1, 1, 1]])
    # scored: t=0 -> x1=2, t=1 -> x2=1; t=2 -> x3 is padding
    assert next_token_mask(am, lm).tolist() == [[True, True, False, False]]
    loss, st = ce_loss(logits, ids, am, lm)

    def ce(row, y):
        return math.log(sum(math.exp(x) for x in row)) - row[y]

    assert loss.item() == pytest.approx((ce([0.0, 1.0, 2.0], 2) + ce([2.0, 0.0, 0.0], 1)) / 2, rel=1e-6)
    assert st["count"].item() == 2 and st["top1_sum"].item() == 1


# --------------------------------------------------------------------------------------- draft models
@pytest.mark.parametrize("arch", list(ARCHS))
def test_build_from_config(arch):
    t = make_target(arch)
    d = build_draft_lm(t, "from_config", num_layers=2, hidden_size=32, seed=0)
    assert type(d) is type(t) and type(d.config) is type(t.config)
    c = d.config
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size) == (2, 32, V)
    assert c.intermediate_size == 64                      # scaled with the width
    assert c.num_attention_heads == 4 and c.num_attention_heads % c.num_key_value_heads == 0
    assert len(getattr(c, "layer_types", None) or [0, 0]) == 2
    assert len(d.model.layers) == 2 and d.get_output_embeddings().weight.shape == (V, 32)
    ids = torch.randint(3, V, (2, 7))
    with torch.no_grad():
        assert d(input_ids=ids).logits.shape == (2, 7, V)
    same = build_draft_lm(t, "from_config", num_layers=2, hidden_size=32, seed=0)
    other = build_draft_lm(t, "from_config", num_layers=2, hidden_size=32, seed=1)
    w = d.model.embed_tokens.weight
    assert torch.equal(same.model.embed_tokens.weight, w) and not torch.equal(other.model.embed_tokens.weight, w)
    wide = build_draft_lm(t, "from_config", num_layers=3)
    assert (wide.config.hidden_size, wide.config.num_hidden_layers) == (64, 3)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_build_from_target_layers_copies_bit_identically(arch):
    t = make_target(arch)
    d = build_draft_lm(t, "from_target_layers", num_layers=3)
    assert d.config.num_hidden_layers == 3 and len(d.model.layers) == 3
    tsd = t.state_dict()
    for k, v in d.state_dict().items():
        assert torch.equal(v, tsd[k]), k
    assert torch.equal(d.model.embed_tokens.weight, t.model.embed_tokens.weight)
    assert torch.equal(d.lm_head.weight, t.lm_head.weight)
    assert torch.equal(d.model.norm.weight, t.model.norm.weight)
    assert d.model.layers[2].self_attn.q_proj.weight.data_ptr() != t.model.layers[2].self_attn.q_proj.weight.data_ptr()
    # the draft computes the target's first 3 layers: its hidden_states[3] (pre-norm) match the target's
    ids = torch.randint(3, V, (1, 6))
    with torch.no_grad():
        hd = d.model(input_ids=ids, output_hidden_states=True).hidden_states
        ht = t.model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(hd[2], ht[2], rtol=0, atol=0)
    with pytest.raises(DraftTrainError):
        build_draft_lm(t, "from_target_layers", num_layers=L + 1)


def test_build_from_pretrained_and_vocab_check(tmp_path):
    t = make_target()
    d = build_draft_lm(t, "from_config", num_layers=1, hidden_size=32, seed=0)
    d.save_pretrained(tmp_path / "ok")
    back = build_draft_lm(t, "from_pretrained", pretrained_path=tmp_path / "ok")
    ids = torch.randint(3, V, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, d(input_ids=ids).logits, rtol=0, atol=0)
    auto = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "ok")
    assert type(auto) is tf.LlamaForCausalLM
    make_target(vocab_size=V + 32).save_pretrained(tmp_path / "wide")
    with pytest.raises(DraftTrainError, match="vocabulary size 128.*target has 96"):
        build_draft_lm(t, "from_pretrained", pretrained_path=tmp_path / "wide")
    with pytest.raises(DraftTrainError, match="pretrained_path"):
        build_draft_lm(t, "from_pretrained")
    with pytest.raises(DraftTrainError, match="unknown mode"):
        build_draft_lm(t, "distilled")


# --------------------------------------------------------------------------------------- on-policy data
def _one_hot_draft(token, seed=0):
    """A draft whose logits put (almost) all mass on ``token`` whatever the context."""
    d = build_draft_lm(make_target(), "from_config", num_layers=1, hidden_size=32, seed=seed)
    head = torch.nn.Linear(32, V, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-50.0)
        head.bias[token] = 50.0
    d.lm_head = head
    return d


def _peaked_draft(seed):
    d = build_draft_lm(make_target(), "from_config", num_layers=1, hidden_size=32, seed=seed)
    with torch.no_grad():
        d.lm_head.weight.mul_(30.0)  # random init is near-uniform (logit std ~0.1); sharpen to std ~3
    return d


PROMPTS = [[1, 5, 7], [1, 9], [1, 3, 4, 5, 6], [1, 11, 12]]


def test_sampler_uses_the_drafts_distribution():
    for tok in (17, 42):
        out = sample_on_policy(_one_hot_draft(tok), PROMPTS, max_new_tokens=5, temperature=1.0, seed=0)
        assert [p for p, _ in out] == PROMPTS
        assert all(c == [tok] * 5 for _, c in out)
    a = sample_on_policy(_peaked_draft(1), PROMPTS, 8, temperature=1.0, seed=0)
    b = sample_on_policy(_peaked_draft(2), PROMPTS, 8, temperature=1.0, seed=0)
    assert a != b                                                           # another draft, other samples
    assert a == sample_on_policy(_peaked_draft(1), PROMPTS, 8, temperature=1.0, seed=0)
    assert a != sample_on_policy(_peaked_draft(1), PROMPTS, 8, temperature=1.0, seed=5)
    assert a == sample_on_policy(_peaked_draft(1), PROMPTS, 8, temperature=1.0, seed=0, batch_size=1)


def test_sampler_frequencies_match_softmax():
    d = _one_hot_draft(0)
    probs = torch.tensor([0.6, 0.3, 0.1])
    with torch.no_grad():
        d.lm_head.bias.fill_(-1e4)
        d.lm_head.bias[[10, 20, 30]] = probs.log() * 2.0   # at temperature 2 the softmax is exactly `probs`
    out = sample_on_policy(d, [[1, 2 + i] for i in range(16)], max_new_tokens=40, temperature=2.0, seed=3)
    toks = torch.tensor([x for _, c in out for x in c])
    assert toks.numel() == 640 and set(toks.tolist()) <= {10, 20, 30}
    freq = torch.stack([(toks == x).float().mean() for x in (10, 20, 30)])
    assert (freq - probs).abs().max().item() < 0.06


def test_sampler_feeds_back_its_own_tokens_greedy_and_eos():
    d = _peaked_draft(3)
    out = sample_on_policy(d, PROMPTS, max_new_tokens=6, temperature=0.0)
    for prompt, cont in out:  # reference: recompute the argmax chain without a cache
        seq = list(prompt)
        for _ in range(6):
            with torch.no_grad():
                seq.append(int(d(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        assert cont == seq[len(prompt):]
    first = out[0][1]
    eos = first[2]
    stopped = sample_on_policy(d, PROMPTS, max_new_tokens=6, temperature=0.0, eos_token_id=eos)
    assert stopped[0][1] == first[: first.index(eos) + 1]
    assert all(len(c) <= 6 for _, c in stopped)
    recs = on_policy_records(stopped[:1])
    assert recs[0]["input_ids"] == PROMPTS[0] + stopped[0][1]
    assert recs[0]["loss_mask"] == [0] * len(PROMPTS[0]) + [1] * len(stopped[0][1])


def test_mix_batches():
    fixed = [("f", i) for i in range(10)]
    onp = [("o", i) for i in range(10)]
    out = mix_batches(fixed, onp, 0.3, seed=0)
    assert len(out) == 10 and sum(s == "o" for s, _ in out) == 3
    assert len(set(out)) == 10
    assert out == mix_batches(fixed, onp, 0.3, seed=0)
    assert out != mix_batches(fixed, onp, 0.3, seed=1)
    assert all(s == "f" for s, _ in mix_batches(fixed, onp, 0.0))
    assert all(s == "o" for s, _ in mix_batches(fixed, onp, 1.0))
    assert sum(s == "o" for s, _ in mix_batches(fixed, onp, 0.5, n=6)) == 3
    with pytest.raises(ValueError):
        mix_batches(fixed, onp[:2], 0.5)
    with pytest.raises(ValueError):
        mix_batches(fixed, onp, 1.5)


def test_a_draft_model_saved_under_the_old_drafter_type_still_loads(tmp_path):
    """Older releases saved draft models as ``drafter_type: draft_lm``; today's name is draft_model (one name per
    family). Such a directory is read as today's family and decodes with the same weights."""
    from drafttrain.artifacts import drafter_type, load_drafter
    from drafttrain.layout import DRAFT_MODEL_TYPE
    from drafttrain.drafters.draft_lm import DraftLM
    from drafttrain.io import read_json, write_json

    t = make_target()
    DraftLM(build_draft_lm(t, "from_config", num_layers=1, hidden_size=32, seed=0), target_name="tiny") \
        .save_pretrained(tmp_path / "new")
    assert read_json(tmp_path / "new" / "config.json")["drafter_type"] == DRAFT_MODEL_TYPE == "draft_model"
    cfg = read_json(tmp_path / "new" / "config.json")
    write_json(tmp_path / "new" / "config.json", {**cfg, "drafter_type": "draft_lm"})
    assert drafter_type(tmp_path / "new") == "draft_model"
    old = load_drafter(str(tmp_path / "new"), "cpu")
    ids = torch.randint(3, V, (1, 6))
    with torch.no_grad():
        ref = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "new")(input_ids=ids).logits
        torch.testing.assert_close(old(input_ids=ids).logits, ref, rtol=0, atol=0)


def test_a_checkpoint_of_the_old_method_name_resumes_as_draft_model(tmp_path):
    """Checkpoints written when the family was called ``distill`` read as ``draft_model`` (method and recorded
    config), so train.resume and `drafttrain eval drafter=<step_N>` accept them; another method is refused."""
    from drafttrain.training import checkpoint

    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    checkpoint.save_checkpoint(tmp_path / "c", m, opt, sched, 1,
                               {"method": "distill", "target": "t", "config": {"method": "distill"}})
    meta = checkpoint.read_checkpoint_meta(tmp_path / "c")
    assert meta["method"] == "draft_model" and meta["config"]["method"] == "draft_model"
    checkpoint.check_compatible(meta, {"method": "draft_model", "target": "t"}, tmp_path / "c")
    with pytest.raises(DraftTrainError, match="method="):
        checkpoint.check_compatible(meta, {"method": "eagle3", "target": "t"}, tmp_path / "c")
