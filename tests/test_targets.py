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


@pytest.mark.slow
def test_builtin_build_is_deterministic(tmp_path, tiny_builtin_target):
    spec = BuiltinSpec(**{**TINY_BUILTIN, "steps": 3})
    torch.manual_seed(spec.seed + 1)  # a state of the caller's own (the build seeds from spec.seed)
    before = torch.get_rng_state()
    build_builtin_target(tmp_path / "a", spec, quiet=True)
    assert torch.equal(torch.get_rng_state(), before)  # seeded by the spec; the caller's random state is left alone
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


def _bad_target_dirs(tmp_path):
    """Directories a target loader must refuse: missing, not a causal LM, a config without weights."""
    (tmp_path / "notlm").mkdir()
    (tmp_path / "notlm" / "config.json").write_text(json.dumps({"model_type": "resnet"}))
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 16,
                                                                    "hidden_size": 8, "num_hidden_layers": 1,
                                                                    "num_attention_heads": 2,
                                                                    "intermediate_size": 8}))
    return [str(tmp_path / d) for d in ("missing", "notlm", "noweights")]


def test_bad_targets_and_taps(tmp_path):
    missing, notlm, noweights = _bad_target_dirs(tmp_path)
    with pytest.raises(DraftTrainError, match="no such directory"):
        load_target(TargetConfig(name_or_path=missing))
    with pytest.raises(DraftTrainError, match="not a causal language model|cannot load"):
        load_target(TargetConfig(name_or_path=notlm))
    with pytest.raises(DraftTrainError, match="cannot load the model weights"):
        load_target(TargetConfig(name_or_path=noweights))
    with pytest.raises(DraftTrainError, match="out of range"):
        resolve_taps(8, [2, 4, 9])
    with pytest.raises(DraftTrainError, match="exactly 3"):
        resolve_taps(8, [2, 4])


# ------------------------------------------------------------------ load_target_parts (capture.mode=offline)
def _save_tiny(tmp_path, tiny_builtin_target, arch, tie, shard=None, name="m"):
    tok = AutoTokenizer.from_pretrained(tiny_builtin_target)
    cfg = _tiny_configs(len(tok))[arch]
    cfg.tie_word_embeddings = tie
    cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # make every tensor distinct from an init (norms start at one)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path / name, **kw)
    tok.save_pretrained(tmp_path / name)
    return tmp_path / name


@pytest.mark.parametrize("arch,tie,shard,dtype", [
    ("llama", False, None, "float32"),       # untied, one model.safetensors
    ("qwen3", True, "150KB", "float32"),     # tied embeddings, sharded checkpoint
    ("gemma", True, None, "bfloat16"),       # ties by default; cast from the stored float32 as from_pretrained does
])
def test_target_parts_match_the_full_load(arch, tie, shard, dtype, tmp_path, tiny_builtin_target):
    from drafttrain.targets.load import is_partial, load_target_parts

    path = _save_tiny(tmp_path, tiny_builtin_target, arch, tie, shard)
    assert (path / "model.safetensors.index.json").exists() == bool(shard)
    tc = TargetConfig(name_or_path=str(path), dtype=dtype)
    full, _, _ = load_target(tc)
    notes = []
    for first in (0, 2):
        part, tok, p = load_target_parts(tc, first_layers=first, say=notes.append)
        assert p == str(path) and tok.eos_token_id == full.config.eos_token_id and not notes
        assert is_partial(part) and not is_partial(full) and not part.training
        assert part.generation_config.eos_token_id == full.generation_config.eos_token_id
        emb, head = part.get_input_embeddings().weight, part.get_output_embeddings().weight
        assert (emb is head) == tie == (full.get_input_embeddings().weight is full.get_output_embeddings().weight)
        ref = full.state_dict()
        kept = {k for k, v in part.state_dict().items() if not v.is_meta}
        prefix = "model.layers."
        assert kept == {k for k in ref if not k.startswith(prefix) or int(k[len(prefix):].split(".")[0]) < first}
        for k in kept:  # bit-identical to from_pretrained, dtype included
            assert torch.equal(part.state_dict()[k], ref[k]) and part.state_dict()[k].dtype == ref[k].dtype, k
        assert all(p.is_meta for p in part.model.layers[first:].parameters())  # no memory for the rest
        assert not any(p.requires_grad for p in part.parameters())
        loaded = sum(p.numel() for p in part.parameters() if not p.is_meta)
        assert loaded < sum(p.numel() for p in full.parameters())


def test_target_parts_fall_back_to_the_whole_target(tmp_path, tiny_builtin_target):
    """A checkpoint the parts loader cannot read as the model expects (here: tie_word_embeddings=true but the
    file holds a different lm_head, which from_pretrained keeps untied) is loaded whole, with a note."""
    from drafttrain.targets.load import is_partial, load_target_parts

    path = _save_tiny(tmp_path, tiny_builtin_target, "llama", tie=False)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    notes = []
    model, _, _ = load_target_parts(TargetConfig(name_or_path=str(path), dtype="float32"), say=notes.append)
    assert len(notes) == 1 and "different" in notes[0] and "loading the whole target" in notes[0]
    assert not is_partial(model)
    full, _, _ = load_target(TargetConfig(name_or_path=str(path), dtype="float32"))
    assert torch.equal(model.lm_head.weight, full.lm_head.weight)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_target_parts_refuse_bad_targets_like_load_target(tmp_path):
    from drafttrain.targets.load import load_target_parts

    missing, notlm, noweights = _bad_target_dirs(tmp_path)
    with pytest.raises(DraftTrainError, match="no such directory"):
        load_target_parts(TargetConfig(name_or_path=missing))
    with pytest.raises(DraftTrainError, match="not a causal language model|cannot load"):
        load_target_parts(TargetConfig(name_or_path=notlm))
    notes = []
    with pytest.raises(DraftTrainError, match="cannot load the model weights"):
        load_target_parts(TargetConfig(name_or_path=noweights), say=notes.append)
    assert notes and "no safetensors checkpoint" in notes[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma"])
def test_grouped_sdpa_equals_transformers_sdpa_with_masks(arch, tmp_path, tiny_builtin_target):
    """A grouped-query target loaded on CPU runs ``drafttrain_sdpa`` (no repeated K/V heads under a mask), and
    every masked forward the toolkit runs gives transformers' ``sdpa`` numbers: a right-padded batch (2D mask), a
    verify block of ragged rows over the row cache (4D mask), and the single-token decode step."""
    from drafttrain.decoding.batched import BatchRunner
    from drafttrain.targets.attention import NAME

    path = _save_tiny(tmp_path, tiny_builtin_target, arch, tie=False)
    model, _, _ = load_target(TargetConfig(name_or_path=str(path), dtype="float32"))
    cfg = model.config
    assert cfg._attn_implementation == NAME
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 4:] = 0

    def run():
        out = [model(input_ids=ids, attention_mask=mask).logits * mask[..., None]]
        runner = BatchRunner(model, max_len=64)
        runner.reset(3)
        runner.forward(ids[:, :6], n_real=[6, 3, 5], pad=False)
        for block, real in ((ids[:, 6:11], [5, 2, 1]), (ids[:, :1], [1, 1, 1])):  # a verify block, a decode step
            logits, _ = runner.forward(block, n_real=real)
            out.append(torch.cat([logits[b, :r] for b, r in enumerate(real)]))
        return out

    grouped = run()
    model.set_attn_implementation("sdpa")
    plain = run()
    for a, b in zip(grouped, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_grouped_sdpa_leaves_other_models_alone(tmp_path, tiny_builtin_target):
    """No grouping (as many K/V heads as query heads), or eager attention: the model keeps what it was given."""
    from transformers import LlamaConfig

    tok = AutoTokenizer.from_pretrained(tiny_builtin_target)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "mha")
    tok.save_pretrained(tmp_path / "mha")
    model, _, _ = load_target(TargetConfig(name_or_path=str(tmp_path / "mha"), dtype="float32"))
    assert model.config._attn_implementation == "sdpa"
    model, _, _ = load_target(TargetConfig(name_or_path=str(tiny_builtin_target), dtype="float32",
                                           attn_implementation="eager"))
    assert model.config._attn_implementation == "eager"
