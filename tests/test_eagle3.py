import json

import pytest
import torch
import transformers as tf

from drafttrain.data.vocab import build_draft_vocab
from drafttrain.drafters.eagle3 import (
    Eagle3Cache,
    Eagle3DrafterConfig,
    Eagle3Drafter,
    masked_attention,
    ttt_attention,
    ttt_reference_mask,
)
from drafttrain.io import DraftTrainError

V, VD, L = 96, 40, 8
TAPS = (2, L // 2, L - 3)
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ARCHS = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 16}),  # heads*head_dim != hidden
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {}),
    "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {"head_dim": 8}),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, {}),
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, {"head_dim": 8}),
}


def make_target(arch="llama", seed=0):
    torch.manual_seed(seed)
    C, M, extra = ARCHS[arch]
    return M(C(**COMMON, **extra)).eval()


def make_vocab(seed=0):
    g = torch.Generator().manual_seed(seed)
    return build_draft_vocab(torch.randint(0, 50, (V,), generator=g), VD, always_include=[2])


def target_taps(target, ids, attention_mask=None, taps=TAPS):
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True)
    return torch.cat([out.hidden_states[j] for j in taps], dim=-1), out.logits


@pytest.fixture(scope="module")
def llama():
    return make_target("llama")


def make_drafter(target, num_layers=1, seed=1):
    d2t, t2d = make_vocab()
    torch.manual_seed(seed)
    d = Eagle3Drafter.from_target(target, TAPS, d2t, t2d, num_layers=num_layers, target_name_or_path="tiny")
    return d.eval()


def randomize_norms(drafter, seed=3):
    """Norm weights start at 1; perturb them so tests would notice a norm applied in the wrong place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in drafter.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))


# ------------------------------------------------------------------------------------ architectures
@pytest.mark.parametrize("arch", list(ARCHS))
def test_shapes_and_taps_per_architecture(arch):
    target = make_target(arch)
    d = make_drafter(target)
    tc = target.config.get_text_config()
    c = d.config
    assert (c.hidden_size, c.target_hidden_size, c.vocab_size, c.draft_vocab_size) == (32, 32, V, VD)
    assert c.head_dim == (getattr(tc, "head_dim", None) or 32 // 4)
    assert c.num_key_value_heads == 2 and c.target_num_layers == L and c.tap_layers == list(TAPS)
    assert d.layers[0].self_attn.q_proj.in_features == 64  # 2H input
    assert d.layers[0].self_attn.q_proj.out_features == 4 * c.head_dim

    B, T = 2, 11
    ids = torch.randint(3, V, (B, T))
    taps, _ = target_taps(target, ids)
    assert taps.shape == (B, T, 3 * 32)
    fused = d.fuse(taps)
    assert fused.shape == (B, T, 32)
    with torch.no_grad():
        outs = d.ttt_forward(ids, taps, torch.ones(B, T, dtype=torch.long), ttt_steps=3)
    assert len(outs) == 3 and all(o.shape == (B, T, VD) for o in outs)
    assert all(torch.isfinite(o).all() for o in outs)
    cache = d.new_cache(B, 32)
    logits, hid = d.step(ids[:, 1:], fused[:, :-1], cache)
    assert logits.shape == (B, T - 1, VD) and hid.shape == (B, T - 1, 32) and cache.length == T - 1
    # the first step of TTT and a cached prefill agree
    torch.testing.assert_close(logits, outs[0][:, :-1], atol=1e-5, rtol=1e-5)
    # embedding copied from the target and frozen
    assert torch.equal(d.embed_tokens.weight, target.get_input_embeddings().weight)
    assert not d.embed_tokens.weight.requires_grad


def test_rope_theta_from_target_config():
    target = make_target("gemma3")  # per-layer-type rope parameters: full attention uses 1e6
    assert make_drafter(target).config.rope_theta == 1e6


def test_parameter_names_match_export_contract(llama):
    d = make_drafter(llama, num_layers=2)
    names = set(d.state_dict())
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d",
                "layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight",
                "layers.0.post_attention_layernorm.weight",
                "layers.1.input_layernorm.weight", "layers.1.post_attention_layernorm.weight"}
    for i in range(2):
        expected |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        expected |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert names == expected
    assert d.layers[1].self_attn.q_proj.in_features == 32  # extra layers take H
    assert d.d2t.dtype == torch.long and d.t2d.dtype == torch.bool
    assert d.fc.weight.shape == (32, 96) and d.lm_head.weight.shape == (VD, 32)


def test_lm_head_initialised_from_target_rows(llama):
    d = make_drafter(llama)
    ids = torch.arange(VD) + d.d2t
    assert torch.equal(d.lm_head.weight, llama.get_output_embeddings().weight[ids])
    assert {id(p) for p in d.trainable_parameters()} == {
        id(p) for n, p in d.named_parameters() if n != "embed_tokens.weight"}


def test_from_target_rejects_bad_inputs(llama):
    d2t, t2d = make_vocab()
    with pytest.raises(DraftTrainError, match="tap_layers"):
        Eagle3Drafter.from_target(llama, (2, 4, 9), d2t, t2d)
    with pytest.raises(DraftTrainError, match="t2d"):
        Eagle3Drafter.from_target(llama, TAPS, d2t, t2d[:-1])
    bad = d2t.clone()
    bad[0] += 1000
    with pytest.raises(DraftTrainError, match="d2t"):
        Eagle3Drafter.from_target(llama, TAPS, bad, t2d)


# ------------------------------------------------------------------------------------ TTT attention
def test_reference_mask_structure():
    am = torch.tensor([[1, 1, 1, 0]])
    m = ttt_reference_mask(4, 2, am)[0]
    assert m.shape == (4, 12)
    assert m[:, :4].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]]
    assert torch.equal(m[:, 4:8], torch.eye(4, dtype=torch.bool))
    assert torch.equal(m[:, 8:], torch.eye(4, dtype=torch.bool))


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_efficient_ttt_attention_equals_masked_reference(steps):
    g = torch.Generator().manual_seed(steps)
    B, Hq, Hkv, T, D = 2, 4, 2, 7, 8
    q = torch.randn(B, Hq, T, D, generator=g)
    ks = [torch.randn(B, Hkv, T, D, generator=g) for _ in range(steps)]
    vs = [torch.randn(B, Hkv, T, D, generator=g) for _ in range(steps)]
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 5:] = 0
    eff = ttt_attention(q, ks[0], vs[0], ks[1:], vs[1:], ttt_reference_mask(T, 0, am))
    ref = masked_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), ttt_reference_mask(T, steps - 1, am))
    torch.testing.assert_close(eff, ref, atol=1e-6, rtol=1e-5)
    # and it really depends on the diagonal keys (the test would notice them being dropped)
    if steps > 1:
        no_diag = ttt_attention(q, ks[0], vs[0], [], [], ttt_reference_mask(T, 0, am))
        assert (no_diag - eff).abs().max() > 1e-3


def _ttt_attention_by_autograd(q, k0, v0, kd, vd, mask0):
    """The reference: scores of the step-0 keys (masked) and of each diagonal key, one softmax, autograd."""
    B, Hq, Tq, D = q.shape
    g = Hq // k0.shape[1]
    rep = lambda x: x.repeat_interleave(g, dim=1)  # noqa: E731
    s0 = (q @ rep(k0).transpose(-1, -2)) / D ** 0.5
    s0 = s0.masked_fill(~mask0[:, None], float("-inf"))
    diag = [((q * rep(kj)).sum(-1, keepdim=True)) / D ** 0.5 for kj in kd]
    p = torch.cat([s0, *diag], -1).softmax(-1)
    out = p[..., : k0.shape[2]] @ rep(v0)
    for j, vj in enumerate(vd):
        out = out + p[..., k0.shape[2] + j : k0.shape[2] + j + 1] * rep(vj)
    return out


@pytest.mark.parametrize("steps", [1, 3])
def test_ttt_attention_gradients_equal_autograd_reference(steps):
    """ttt_attention's own backward gives autograd's gradients for q, the step-0 keys/values and every
    diagonal key/value (float64), with key padding, two documents in a row and a subset of the positions as
    queries (the live positions); the additive-bias form gives the same."""
    from drafttrain.drafters.eagle3 import attention_bias

    g = torch.Generator().manual_seed(10 + steps)
    B, Hq, Hkv, S, D = 2, 4, 2, 9, 8
    idx = torch.tensor([[1, 3, 4, 6, 8], [0, 2, 5, 7, 7]])  # the queries' positions (Tq = 5)
    Tq = idx.shape[1]
    am = torch.ones(B, S, dtype=torch.long)
    am[1, 7:] = 0
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1], [0] * S])
    full = torch.ones(S, S, dtype=torch.bool).tril()[None] & am.bool()[:, None] & (doc[:, :, None] == doc[:, None])
    mask0 = full.gather(1, idx[..., None].expand(-1, -1, S))
    t = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    q, k0, v0 = t(B, Hq, Tq, D), t(B, Hkv, S, D), t(B, Hkv, S, D)
    kd = [t(B, Hkv, Tq, D) for _ in range(steps - 1)]
    vd = [t(B, Hkv, Tq, D) for _ in range(steps - 1)]
    leaves = [q, k0, v0, *kd, *vd]
    w = torch.randn(B, Hq, Tq, D, generator=g, dtype=torch.float64)
    ref = _ttt_attention_by_autograd(q, k0, v0, kd, vd, mask0)
    ref_grads = torch.autograd.grad((ref * w).sum(), leaves)
    for m in (mask0, attention_bias(mask0)):
        out = ttt_attention(q, k0, v0, kd, vd, m)
        grads = torch.autograd.grad((out * w).sum(), leaves)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_ttt_attention_fully_masked_query_and_low_precision():
    """A query that sees no key at all (packed padding) gets 0 and finite gradients; bfloat16 inputs run the
    softmax in float32 and stay close to the float32 result."""
    g = torch.Generator().manual_seed(3)
    q, k0, v0 = (torch.randn(1, 2, 4, 8, generator=g, requires_grad=True) for _ in range(3))
    mask0 = torch.ones(1, 4, 4, dtype=torch.bool).tril()
    mask0[0, 3] = False
    out = ttt_attention(q, k0, v0, [], [], mask0)
    assert out[0, :, 3].abs().max() == 0
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k0, v0))
    low = ttt_attention(q.bfloat16(), k0.bfloat16(), v0.bfloat16(), [], [], mask0)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), out.detach(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_ttt_forward_efficient_equals_reference(llama, num_layers):
    d = make_drafter(llama, num_layers=num_layers)
    randomize_norms(d)
    ids = torch.randint(3, V, (2, 12))
    am = torch.ones(2, 12, dtype=torch.long)
    am[0, 8:] = 0
    taps, _ = target_taps(llama, ids, am)
    with torch.no_grad():
        eff = d.ttt_forward(ids, taps, am, 4)
        ref = d.ttt_forward(ids, taps, am, 4, attention_impl="reference")
    for a, b in zip(eff, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_ttt_padding_does_not_change_real_positions(llama):
    d = make_drafter(llama, num_layers=2)
    ids = torch.randint(3, V, (1, 9))
    taps, _ = target_taps(llama, ids)
    ids_p = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], 1)
    taps_p = torch.cat([taps, torch.randn(1, 4, taps.shape[-1])], 1)  # garbage in padded slots
    am_p = torch.tensor([[1] * 9 + [0] * 4])
    with torch.no_grad():
        a = d.ttt_forward(ids, taps, torch.ones(1, 9, dtype=torch.long), 3)
        b = d.ttt_forward(ids_p, taps_p, am_p, 3)
    for i, (x, y) in enumerate(zip(a, b)):
        n = 9 - 1 - i  # indices whose input token x_{t+1+i} is real
        torch.testing.assert_close(x[:, :n], y[:, :n], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ TTT == inference
@pytest.mark.parametrize("num_layers", [1, 2])
def test_ttt_matches_cached_inference(llama, num_layers):
    d = make_drafter(llama, num_layers=num_layers)
    randomize_norms(d)
    B, T, steps = 2, 12, 4
    ids = torch.randint(3, V, (B, T))
    taps, _ = target_taps(llama, ids)
    with torch.no_grad():
        logits, hiddens = d.ttt_forward(ids, taps, torch.ones(B, T, dtype=torch.long), steps, return_hidden=True)
        fused = d.fuse(taps)
    # step 0 == one cached pass over the whole sequence (index t embeds x_{t+1})
    cache = d.new_cache(B, 2 * T)
    l0, h0 = d.step(ids[:, 1:], fused[:, :-1], cache)
    torch.testing.assert_close(l0, logits[0][:, :-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h0, hiddens[0][:, :-1], atol=1e-5, rtol=1e-5)
    # step i at index t == drafting i more tokens after caching step-0 entries for positions 0..t
    for t in (0, 3, 6):
        cache.truncate(t + 1)
        h = h0[:, t : t + 1]
        for i in range(1, steps):
            if t + 1 + i >= T:
                break
            li, h = d.step(ids[:, t + 1 + i : t + 2 + i], h, cache)
            torch.testing.assert_close(li[:, 0], logits[i][:, t], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(h[:, 0], hiddens[i][:, t], atol=1e-5, rtol=1e-5)
        assert cache.length == t + steps
        # restore the step-0 entries overwritten by the drafted positions
        cache.truncate(t + 1)
        d.step(ids[:, t + 2 :], fused[:, t + 1 : -1], cache)
    # sanity: later steps differ from step 0 (the check above is not vacuous)
    assert (logits[1][:, 3] - logits[0][:, 4]).abs().max() > 1e-3


def test_step_explicit_tree_mask_matches_separate_chains(llama):
    d = make_drafter(llama, num_layers=2)
    ids = torch.randint(3, V, (1, 8))
    taps, _ = target_taps(llama, ids)
    fused = d.fuse(taps).detach()
    P = 7
    cache = d.new_cache(1, 16)
    _, h = d.step(ids[:, 1:], fused[:, :-1], cache)
    a, b = 5, 9
    # branch a alone
    la, ha = d.step(torch.tensor([[a]]), h[:, -1:], cache)
    cache.truncate(P)
    lb, hb = d.step(torch.tensor([[b]]), h[:, -1:], cache)
    cache.truncate(P)
    # both siblings at once: same position P, each sees the prefix and itself only
    mask = torch.zeros(1, 2, P + 2, dtype=torch.bool)
    mask[:, :, :P] = True
    mask[0, 0, P] = mask[0, 1, P + 1] = True
    lt, ht = d.step(torch.tensor([[a, b]]), h[:, -1:].expand(1, 2, -1), cache,
                    position_ids=torch.tensor([[P, P]]), attn_mask=mask)
    torch.testing.assert_close(lt[:, 0], la[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lt[:, 1], lb[:, 0], atol=1e-5, rtol=1e-5)
    assert (la - lb).abs().max() > 1e-3
    # compact the accepted sibling (b, at cache position P+1) to position P; a child then matches the chain
    cache.keep(torch.tensor([P + 1]), start=P)
    assert cache.length == P + 1
    lc, _ = d.step(torch.tensor([[4]]), ht[:, 1:2], cache)
    cache.truncate(P)
    d.step(torch.tensor([[b]]), h[:, -1:], cache)
    lc_ref, _ = d.step(torch.tensor([[4]]), ht[:, 1:2], cache)
    torch.testing.assert_close(lc, lc_ref, atol=1e-5, rtol=1e-5)


def test_cache_truncate_and_keep():
    c = Eagle3Cache(num_layers=2, batch_size=2, num_kv_heads=1, max_len=10, head_dim=2)
    for buf in (*c.k, *c.v):
        buf.copy_(torch.arange(10.0)[None, None, :, None].expand_as(buf))
        buf[1] += 100
    c.length = 8
    c.keep(torch.tensor([4, 6, 7]))  # start defaults to min index
    assert c.length == 7
    assert c.k[1][0, 0, :7, 0].tolist() == [0, 1, 2, 3, 4, 6, 7]
    c.keep(torch.tensor([[5, 6], [4, 6]]), start=3)  # per-row selection
    assert c.length == 5
    assert c.v[0][0, 0, :5, 0].tolist() == [0, 1, 2, 6, 7]
    assert c.v[0][1, 0, :5, 0].tolist() == [100, 101, 102, 104, 107]
    c.truncate(2)
    assert c.length == 2
    with pytest.raises(ValueError):
        c.truncate(3)
    with pytest.raises(ValueError):
        c.keep(torch.tensor([1]), start=2)


def test_step_rejects_overflow(llama):
    d = make_drafter(llama)
    cache = d.new_cache(1, 4)
    with pytest.raises(DraftTrainError, match="overflow"):
        d.step(torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 5, 32), cache)


def test_logits_to_target(llama):
    d = make_drafter(llama)
    logits = torch.randn(2, 3, VD)
    full = d.logits_to_target(logits)
    ids = torch.arange(VD) + d.d2t
    assert full.shape == (2, 3, V)
    assert torch.equal(full[..., ids], logits)
    assert torch.isneginf(full[..., ~d.t2d]).all()
    assert torch.equal(full.argmax(-1), ids[logits.argmax(-1)])


# -------------------------------------------------------------------------------------- save / load
def test_save_load_round_trip(llama, tmp_path):
    d = make_drafter(llama, num_layers=2)
    randomize_norms(d)
    out = tmp_path / "drafter"
    d.save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["drafter_type"] == "eagle3" and cfg["tap_layers"] == list(TAPS) and cfg["num_layers"] == 2
    e = Eagle3Drafter.from_pretrained(out).eval()
    assert e.config == d.config
    for k, v in d.state_dict().items():
        assert torch.equal(v, e.state_dict()[k]), k
    assert not e.embed_tokens.weight.requires_grad
    ids = torch.randint(3, V, (2, 10))
    taps, _ = target_taps(llama, ids)
    am = torch.ones(2, 10, dtype=torch.long)
    with torch.no_grad():
        for a, b in zip(d.ttt_forward(ids, taps, am, 3), e.ttt_forward(ids, taps, am, 3)):
            assert torch.equal(a, b)
    # saving over an existing directory replaces it
    e.save_pretrained(out)
    assert Eagle3Drafter.from_pretrained(out).config == d.config


def test_config_json_round_trip():
    c = Eagle3DrafterConfig(hidden_size=8, target_hidden_size=16, intermediate_size=12, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=4, vocab_size=20, draft_vocab_size=10, tap_layers=(1, 2, 3))
    assert Eagle3DrafterConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(DraftTrainError, match="draft_vocab_size"):
        Eagle3DrafterConfig(hidden_size=8, target_hidden_size=16, intermediate_size=12, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=4, vocab_size=20, draft_vocab_size=30)


def test_from_pretrained_errors(llama, tmp_path):
    d = make_drafter(llama)
    out = tmp_path / "d"
    with pytest.raises(DraftTrainError, match="not a directory"):
        Eagle3Drafter.from_pretrained(out)
    d.save_pretrained(out)
    # mismatched config
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    with pytest.raises(DraftTrainError, match="shape mismatch"):
        Eagle3Drafter.from_pretrained(out)
    (out / "config.json").write_text(json.dumps({**cfg, "num_layers": 2}))
    with pytest.raises(DraftTrainError, match="missing"):
        Eagle3Drafter.from_pretrained(out)
    (out / "config.json").write_text(json.dumps({**cfg, "drafter_type": "medusa"}))
    with pytest.raises(DraftTrainError, match="drafter_type"):
        Eagle3Drafter.from_pretrained(out)
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DraftTrainError, match="safetensors"):
        Eagle3Drafter.from_pretrained(out)
    (out / "model.safetensors").unlink()
    with pytest.raises(DraftTrainError, match="not found"):
        Eagle3Drafter.from_pretrained(out)


def test_bf16_cast_keeps_working_and_round_trips(llama, tmp_path):
    d = make_drafter(llama).to(torch.bfloat16)
    ids = torch.randint(3, V, (1, 6))
    taps, _ = target_taps(llama, ids)
    cache = d.new_cache(1, 8)
    assert cache.k[0].dtype == torch.bfloat16
    logits, _ = d.step(ids, d.fuse(taps), cache)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    d.save_pretrained(tmp_path / "bf")
    e = Eagle3Drafter.from_pretrained(tmp_path / "bf")
    assert e.fc.weight.dtype == torch.bfloat16 and torch.equal(e.fc.weight, d.fc.weight)


def test_sdpa_attention_equals_masked_attention():
    """The decoder's static draft step attends through SDPA; it must be the training path's masked attention,
    with GQA, a 2-D or 3-D mask, and a fully masked row (a uniform average, not NaN)."""
    from drafttrain.drafters.eagle3 import masked_attention, sdpa_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, t, 8, generator=g) for h, t in ((4, 3), (2, 7), (2, 7)))
    mask = torch.rand(1, 3, 7, generator=g) > 0.4
    mask[0, 1] = False  # a fully masked row
    for m in (mask, mask[0]):
        out = sdpa_attention(q, k, v, m)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, masked_attention(q, k, v, m), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sdpa_attention(q, k, v, mask)[0, :, 1], v[0].mean(1).repeat_interleave(2, 0),
                               atol=1e-5, rtol=1e-5)
