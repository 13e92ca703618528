"""EAGLE-3 training levers: EAGLE-3.1 (fc_norm, norm_output), the Qwen3-style draft layer (qk_norm), the
draft layer initialised from a target layer. Each: TTT == cached inference, greedy == AR in the decoder
(eager and static-shape steps), save/load and the export round trip where an engine layout exists."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from drafttrain.data.vocab import build_draft_vocab
from drafttrain.decoding.engine import SpecDecoder
from drafttrain.decoding.proposers import Eagle3ChainProposer, NoDraft
from drafttrain.decoding.target import TargetRunner
from drafttrain.drafters.eagle3 import Eagle3Drafter
from drafttrain.io import DraftTrainError, load_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

V, L, VD = 80, 6, 40
TAPS = (2, 3, 4)
CFG = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
           num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.3)
LEVERS = {
    "eagle3.1": dict(fc_norm=True, norm_output=True),
    "fc_norm": dict(fc_norm=True),
    "norm_output": dict(norm_output=True),
    "qk_norm": dict(qk_norm=True),
    "init_layer": dict(init_layer=-1),
}


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**CFG)).eval()


def drafter(target, num_layers=1, **opts):
    g = torch.Generator().manual_seed(0)
    d2t, t2d = build_draft_vocab(torch.randint(0, 50, (V,), generator=g), VD, always_include=[2])
    torch.manual_seed(1)
    d = Eagle3Drafter.from_target(target, TAPS, d2t, t2d, num_layers=num_layers, target_name_or_path="tiny", **opts)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # norms start at 1: perturb them so a norm in the wrong place shows
        for n, p in d.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n or ".fc_norm." in n or n.startswith("fc_norm"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return d.eval()


def taps_of(target, ids):
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[j] for j in TAPS], dim=-1)


def test_levers_add_their_parameters(target):
    names = lambda d: set(dict(d.named_parameters()))  # noqa: E731
    base = names(drafter(target))
    assert names(drafter(target, fc_norm=True)) - base == {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
    assert names(drafter(target, qk_norm=True, num_layers=2)) - base >= {
        "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight", "layers.1.self_attn.k_norm.weight"}
    assert names(drafter(target, norm_output=True)) == base


@pytest.mark.parametrize("lever", list(LEVERS))
@pytest.mark.parametrize("num_layers", [1, 2])
def test_ttt_matches_cached_inference_with_lever(target, lever, num_layers):
    d = drafter(target, num_layers=num_layers, **LEVERS[lever])
    B, T, steps = 2, 10, 3
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(5))
    taps = taps_of(target, ids)
    with torch.no_grad():
        logits, hiddens = d.ttt_forward(ids, taps, torch.ones(B, T, dtype=torch.long), steps, return_hidden=True)
        fused = d.fuse(taps)
    cache = d.new_cache(B, 2 * T)
    l0, h0 = d.step(ids[:, 1:], fused[:, :-1], cache)
    torch.testing.assert_close(l0, logits[0][:, :-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h0, hiddens[0][:, :-1], atol=1e-4, rtol=1e-4)
    t = 4
    cache.truncate(t + 1)
    h = h0[:, t: t + 1]
    for i in range(1, steps):
        li, h = d.step(ids[:, t + 1 + i: t + 2 + i], h, cache)
        torch.testing.assert_close(li[:, 0], logits[i][:, t], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(h[:, 0], hiddens[i][:, t], atol=1e-4, rtol=1e-4)


def test_norm_output_hands_on_the_normed_state(target):
    """norm_output changes what step i+1 reads (not step 0's logits); fc_norm changes step 0 already."""
    ids = torch.randint(3, V, (1, 9), generator=torch.Generator().manual_seed(6))
    taps = taps_of(target, ids)
    am = torch.ones(1, 9, dtype=torch.long)
    with torch.no_grad():
        a = drafter(target).ttt_forward(ids, taps, am, 2)
        b = drafter(target, norm_output=True).ttt_forward(ids, taps, am, 2)
        c = drafter(target, fc_norm=True).ttt_forward(ids, taps, am, 1)
    torch.testing.assert_close(a[0], b[0])
    assert (a[1] - b[1]).abs().max() > 1e-3
    assert (a[0] - c[0]).abs().max() > 1e-3


def test_init_layer_copies_the_target_layer(target):
    d = drafter(target, init_layer=-1)
    src = target.model.layers[L - 1]
    lay = d.layers[0]
    torch.testing.assert_close(lay.mlp.down_proj.weight, src.mlp.down_proj.weight)
    torch.testing.assert_close(lay.self_attn.o_proj.weight, src.self_attn.o_proj.weight)
    H = CFG["hidden_size"]
    torch.testing.assert_close(lay.self_attn.q_proj.weight[:, :H], 0.5 * src.self_attn.q_proj.weight)
    torch.testing.assert_close(lay.self_attn.q_proj.weight[:, H:], 0.5 * src.self_attn.q_proj.weight)
    with pytest.raises(DraftTrainError, match="init_layer=9"):
        drafter(target, init_layer=9)


@pytest.mark.parametrize("lever", list(LEVERS))
def test_greedy_equals_ar_with_lever(target, lever):
    d = drafter(target, num_layers=2, **LEVERS[lever])
    runner = TargetRunner(target, taps=TAPS)
    prompt = torch.randint(3, V, (10,), generator=torch.Generator().manual_seed(7)).tolist()
    ar = SpecDecoder(runner, NoDraft(), 0).generate(prompt, 24).tokens
    eager = SpecDecoder(runner, Eagle3ChainProposer(d, max_len=128), 3).generate(prompt, 24)
    static = SpecDecoder(runner, Eagle3ChainProposer(d, max_len=128, static_shapes=True), 3).generate(prompt, 24)
    assert eager.tokens == ar and static.tokens == ar
    assert (eager.num_accepted, eager.num_rounds) == (static.num_accepted, static.num_rounds)


@pytest.mark.parametrize("lever", ["eagle3.1", "qk_norm"])
def test_save_load_and_export(target, tmp_path, lever):
    from drafttrain.artifacts import load_exported_eagle3
    from drafttrain.export.eagle3 import write_eagle3

    d = drafter(target, **LEVERS[lever])
    d.save_pretrained(tmp_path / "d")
    e = Eagle3Drafter.from_pretrained(tmp_path / "d")
    for k, v in d.state_dict().items():
        torch.testing.assert_close(e.state_dict()[k], v)
    out = tmp_path / "vllm"
    out.mkdir()
    write_eagle3(d, "vllm", out, dtype="float32", verifier="tiny", num_speculative_tokens=3)
    import json

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["transformer_layer_config"]["model_type"] == ("qwen3" if lever == "qk_norm" else "llama")
    assert "layers.0.self_attn.q_norm.weight" in load_tensors(out / "model.safetensors") or lever != "qk_norm"
    back = load_exported_eagle3(out, target_model=target)
    assert back.config.qk_norm == (lever == "qk_norm")
    assert (cfg["fc_norm"], cfg["norm_output"]) == (back.config.fc_norm, back.config.norm_output) == \
        ((True, True) if lever == "eagle3.1" else (False, False))
    for k, v in d.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v)
    if lever == "qk_norm":  # SGLang's and TensorRT-LLM's EAGLE-3 layers have no q/k norms
        for fmt in ("sglang", "trtllm"):
            (tmp_path / fmt).mkdir()
            with pytest.raises(DraftTrainError, match=f"qk_norm=true cannot go to format={fmt}.*format=vllm"):
                write_eagle3(d, fmt, tmp_path / fmt, dtype="float32", verifier="tiny", num_speculative_tokens=3)
        return
    sg = tmp_path / "sglang"
    sg.mkdir()
    write_eagle3(d, "sglang", sg, dtype="float32", verifier="tiny", num_speculative_tokens=3)
    back = load_exported_eagle3(sg, target_model=target)
    assert back.config.fc_norm and back.config.norm_output
    for k, v in d.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v)


@pytest.mark.parametrize("lever", list(LEVERS))
def test_static_step_equals_step_with_lever(target, lever):
    """The static-shape step (what compile / CUDA graphs run) hands on the same hidden state as ``step``."""
    d = drafter(target, num_layers=2, **LEVERS[lever])
    n, max_len = 4, 16
    ids = torch.randint(3, V, (1, n), generator=torch.Generator().manual_seed(8))
    hidden = d.fuse(taps_of(target, ids))
    ref_logits, ref_hidden = d.step(ids, hidden, d.new_cache(1, max_len))
    cache = d.new_cache(1, max_len)
    mask = (torch.arange(max_len)[None, :] <= torch.arange(n)[:, None])[None]
    logits, out = d.step_static(ids, hidden, cache.k, cache.v, torch.arange(n)[None], torch.arange(n), mask)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, ref_hidden, atol=1e-4, rtol=1e-4)
