"""The target's RoPE scaling (linear / llama3 / yarn) carried into the EAGLE-3 drafter: the drafter rotates
q/k exactly as the target's own transformers rotary module does, keeps it through save/load and the engine
exports, refuses a scaling it cannot compute, and decoding with it stays exact (greedy == AR)."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from drafttrain.data.vocab import build_draft_vocab
from drafttrain.decoding.engine import SpecDecoder
from drafttrain.decoding.proposers import Eagle3ChainProposer, NoDraft
from drafttrain.decoding.target import TargetRunner
from drafttrain.drafters.eagle3 import Eagle3DrafterConfig, Eagle3Drafter
from drafttrain.io import DraftTrainError

pytestmark = pytest.mark.usefixtures("one_thread")

V, L, VD = 80, 6, 40
TAPS = (2, 3, 4)
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.3,
            max_position_embeddings=512)
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}


def _target(scaling):
    torch.manual_seed(0)
    rp = {"rope_type": "default", "rope_theta": 50000.0} if scaling is None else {**scaling, "rope_theta": 50000.0}
    return tf.LlamaForCausalLM(tf.LlamaConfig(**BASE, rope_parameters=rp)).eval()


def _drafter(target):
    d2t, t2d = build_draft_vocab(torch.randint(0, 50, (V,), generator=torch.Generator().manual_seed(0)), VD,
                                 always_include=[2])
    torch.manual_seed(1)
    return Eagle3Drafter.from_target(target, TAPS, d2t, t2d, target_name_or_path="tiny").eval()


def _cos_sin(target, positions):
    rot = target.model.rotary_emb  # the target's own rotary module (transformers)
    x = torch.zeros(1, positions.numel(), 8)
    return rot(x, positions[None])


@pytest.mark.parametrize("kind", [None, *SCALINGS])
def test_drafter_rotates_like_the_target(kind):
    target = _target(SCALINGS.get(kind))
    d = _drafter(target)
    assert d.config.rope_theta == 50000.0
    assert d.config.rope_scaling == (None if kind is None else SCALINGS[kind])
    pos = torch.tensor([0, 1, 7, 63, 64, 200, 511])
    cos, sin = d.rotary(pos, torch.float32)
    ref_cos, ref_sin = _cos_sin(target, pos)
    torch.testing.assert_close(cos, ref_cos[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sin, ref_sin[0], atol=1e-6, rtol=1e-5)
    if kind is not None:  # and the scaling matters: unscaled RoPE would differ
        plain = Eagle3Drafter(Eagle3DrafterConfig(**{**d.config.to_dict(), "rope_scaling": None}))
        assert (plain.rotary(pos, torch.float32)[0] - cos).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["llama3", "yarn"])
def test_rope_scaling_survives_save_load_and_both_exports(kind, tmp_path):
    from drafttrain.artifacts import load_exported_eagle3
    from drafttrain.export.eagle3 import write_eagle3

    target = _target(SCALINGS[kind])
    d = _drafter(target)
    pos = torch.arange(0, 300, 7)
    want = d.rotary(pos, torch.float32)
    d.save_pretrained(tmp_path / "d")
    assert Eagle3Drafter.from_pretrained(tmp_path / "d").config.rope_scaling == SCALINGS[kind]
    for fmt in ("vllm", "sglang"):
        out = tmp_path / fmt
        out.mkdir()
        write_eagle3(d, fmt, out, dtype="float32", verifier="tiny", num_speculative_tokens=3)
        cfg = json.loads((out / "config.json").read_text())
        layer = cfg.get("transformer_layer_config", cfg)
        assert layer["rope_parameters"] == {**SCALINGS[kind], "rope_theta": 50000.0}
        assert layer["rope_scaling"] == SCALINGS[kind]
        back = load_exported_eagle3(out, target_model=target)
        got = back.rotary(pos, torch.float32)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


def test_a_scaling_the_drafter_cannot_compute_is_refused():
    target = _target({"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(DraftTrainError, match=r"rope_type 'dynamic' is not implemented"):
        _drafter(target)


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_greedy_equals_ar_with_scaled_rope_past_the_original_context(kind):
    target = _target(SCALINGS[kind])
    d = _drafter(target)
    runner = TargetRunner(target, taps=TAPS)
    prompt = torch.randint(3, V, (150,), generator=torch.Generator().manual_seed(7)).tolist()  # > original 64/128
    ar = SpecDecoder(runner, NoDraft(), 0).generate(prompt, 24).tokens
    eager = SpecDecoder(runner, Eagle3ChainProposer(d, max_len=256), 3).generate(prompt, 24)
    static = SpecDecoder(runner, Eagle3ChainProposer(d, max_len=256, static_shapes=True), 3).generate(prompt, 24)
    assert eager.tokens == ar and static.tokens == ar
    assert (eager.num_accepted, eager.num_rounds) == (static.num_accepted, static.num_rounds)
