"""Targets: the built-in target (tokenizer, chat template, model) and loading any HF causal LM with taps."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from drafttrain.config import TargetConfig
from drafttrain.io import DraftTrainError
from drafttrain.targets.builtin import BuiltinSpec, build_builtin_target
from drafttrain.targets.load import load_target, num_layers, resolve_taps

from .conftest import TINY_BUILTIN

CODE = 'def f(x, *a, **kw):\n\t"""Doc: é ü 中文 — ok."""\n    return {"k": [x, 1.5e-3]}  # comment\n\n\n'


def test_builtin_tokenizer_round_trips_through_autotokenizer(tiny_builtin_target):
    tok = AutoTokenizer.from_pretrained(tiny_builtin_target)
    ids = tok(CODE, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == CODE
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|end|>"
    assert tok.pad_token_id is not None and tok.bos_token_id is not None
    cfg = json.loads((tiny_builtin_target / "tokenizer_config.json").read_text())
    assert cfg.get("chat_template") or (tiny_builtin_target / "chat_template.jinja").exists()


def test_builtin_chat_template_masks_assistant_and_matches_generation_prompt(tiny_builtin_target):
    tok = AutoTokenizer.from_pretrained(tiny_builtin_target)
    msgs = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "    return a + b"}]
    enc = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    masked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert masked == "    return a + b<|end|>"
    prompt = tok.apply_chat_template(msgs[:1], tokenize=True, add_generation_prompt=True, return_dict=True)
    prompt = list(prompt["input_ids"])
    assert ids[: len(prompt)] == prompt  # the prompt tokenises as a prefix: no BPE merge across the boundary
    assert ids[0] == tok.bos_token_id


def test_builtin_target_is_a_real_causal_lm(tiny_builtin_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_builtin_target)
    info = json.loads((tiny_builtin_target / "drafttrain_builtin.json").read_text())
    assert model.config.num_hidden_layers >= 6
    taps = resolve_taps(model.config.num_hidden_layers)
    assert len(set(taps)) == 3  # distinct low/mid/high taps
    assert info["heldout_loss"] < torch.log(torch.tensor(float(model.config.vocab_size))).item()  # learned something
    assert list(tiny_builtin_target.glob("*.safetensors")) and not list(tiny_builtin_target.glob("*.bin"))


def test_builtin_build_is_deterministic(tmp_path, tiny_builtin_target):
    spec = BuiltinSpec(**{**TINY_BUILTIN, "steps": 3})
    build_builtin_target(tmp_path / "a", spec, quiet=True)
    build_builtin_target(tmp_path / "b", spec, quiet=True)
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "a").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "b").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _tiny_configs(vocab):
    from transformers import (GemmaConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                              Qwen3Config)

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return {
        "llama": LlamaConfig(**common),
        "qwen2": Qwen2Config(**common),
        "qwen3": Qwen3Config(**common, head_dim=8),
        "mistral": MistralConfig(**common),
        "gemma": GemmaConfig(**common, head_dim=8),
        "phi3": Phi3Config(**common, pad_token_id=0),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma", "phi3"])
def test_any_causal_lm_loads_and_taps(arch, tmp_path, tiny_builtin_target):
    tok = AutoTokenizer.from_pretrained(tiny_builtin_target)
    cfg = _tiny_configs(len(tok))[arch]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / arch)
    tok.save_pretrained(tmp_path / arch)
    model, tokenizer, path = load_target(TargetConfig(name_or_path=str(tmp_path / arch), dtype="float32"))
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    L = num_layers(model)
    taps = resolve_taps(L)
    assert taps == (2, L // 2, L - 3)
    ids = torch.tensor([tokenizer("x = 1\n", add_special_tokens=False)["input_ids"]])
    out = model(input_ids=ids, output_hidden_states=True)
    assert len(out.hidden_states) == L + 1
    feats = torch.cat([out.hidden_states[i] for i in taps], -1)
    assert feats.shape == (1, ids.shape[1], 3 * cfg.hidden_size)


def test_bad_targets_and_taps(tmp_path):
    with pytest.raises(DraftTrainError, match="no such directory"):
        load_target(TargetConfig(name_or_path=str(tmp_path / "missing")))
    (tmp_path / "notlm").mkdir()
    (tmp_path / "notlm" / "config.json").write_text(json.dumps({"model_type": "resnet"}))
    with pytest.raises(DraftTrainError, match="not a causal language model|cannot load"):
        load_target(TargetConfig(name_or_path=str(tmp_path / "notlm")))
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 16,
                                                                    "hidden_size": 8, "num_hidden_layers": 1,
                                                                    "num_attention_heads": 2,
                                                                    "intermediate_size": 8}))
    with pytest.raises(DraftTrainError, match="cannot load the model weights"):
        load_target(TargetConfig(name_or_path=str(tmp_path / "noweights")))
    with pytest.raises(DraftTrainError, match="out of range"):
        resolve_taps(8, [2, 4, 9])
    with pytest.raises(DraftTrainError, match="exactly 3"):
        resolve_taps(8, [2, 4])
