"""The second built-in target (``target=builtin-docs``): a Qwen3 with a Metaspace tokenizer and ChatML, trained on
documentation prose; its corpus and data; and every drafter family trained and decoded against it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from drafttrain.config import BuiltinTargetConfig
from drafttrain.data import docs
from drafttrain.data.builtin import builtin_conversations, corpus_of, regenerated_cache_path

from .conftest import REPO

pytestmark = pytest.mark.usefixtures("one_thread")

# the shipped group (conf/target/builtin-docs.yaml) at a tiny training budget, as the code target's tests use
TINY_DOCS = {"steps": 10, "max_files": 20}
TINY_DOCS_OVERRIDES = ["target=builtin-docs", *[f"target.builtin.{k}={v}" for k, v in TINY_DOCS.items()]]


@pytest.fixture(scope="module")
def docs_target(cache_dir):
    from omegaconf import OmegaConf

    from drafttrain.targets.builtin import BuiltinSpec, ensure_builtin_target

    shipped = OmegaConf.load(REPO / "drafttrain" / "conf" / "target" / "builtin-docs.yaml")
    spec = BuiltinSpec(**{**OmegaConf.to_container(shipped.builtin), **TINY_DOCS})
    return ensure_builtin_target(spec, quiet=True)


def test_docs_target_is_a_qwen3_with_qk_norms_tied_embeddings_and_two_end_tokens(docs_target):
    model = AutoModelForCausalLM.from_pretrained(docs_target)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    attn = model.model.layers[0].self_attn
    assert hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    tok = AutoTokenizer.from_pretrained(docs_target)
    ends = GenerationConfig.from_pretrained(docs_target).eos_token_id
    assert sorted(ends) == sorted(tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    info = json.loads((docs_target / "drafttrain_builtin.json").read_text())
    assert info["spec"]["kind"] == "docs"


def test_docs_tokenizer_is_metaspace_chatml_and_round_trips_through_autotokenizer(docs_target):
    tok = AutoTokenizer.from_pretrained(docs_target)
    assert tok.bos_token is None and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "Return the  value.\n\n  Indented line, é and 中文\tand a tab."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # spaces, newlines and bytes outside the vocabulary come back exactly
    assert any(t.startswith("\u2581") for t in tok.convert_ids_to_tokens(ids))  # SentencePiece-style spaces
    assert "<0xC3>" in tok.convert_ids_to_tokens(ids)  # byte fallback, not <unk>
    spec = json.loads((docs_target / "tokenizer.json").read_text())
    assert "Metaspace" in json.dumps(spec["pre_tokenizer"])
    msgs = [{"role": "user", "content": "What does `x` do?"}, {"role": "assistant", "content": "It returns x."}]
    rendered = tok.apply_chat_template(msgs, tokenize=False)
    assert rendered == ("<|im_start|>user\nWhat does `x` do?<|im_end|>\n"
                        "<|im_start|>assistant\nIt returns x.<|im_end|>\n")
    enc = tok.apply_chat_template(msgs, return_dict=True, return_assistant_tokens_mask=True, tokenize=True)
    ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    marked = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(marked) == "It returns x.<|im_end|>"
    prompt = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ids[: len(prompt["input_ids"])] == list(prompt["input_ids"])  # the generation prompt is a prefix


def test_docs_corpus_is_prose_split_by_file_without_overlap():
    splits = {s: docs.doc_chats(s) for s in ("target", "draft", "eval")}
    assert all(splits.values())
    files = {s: {c.source.split("#")[0] for c in chats} for s, chats in splits.items()}
    assert not (files["target"] & files["draft"]) and not (files["draft"] & files["eval"])
    assert not (files["target"] & files["eval"])
    chat = splits["eval"][0]
    assert chat.prefix.endswith((".", "?")) and "`" in chat.prefix  # a question about a documented name
    assert docs.doc_chats("eval") == splits["eval"]  # deterministic
    words = sum(len(c.completion.split()) for c in splits["draft"])
    assert words > 20_000  # enough prose for data.num_train=1024 chats from the draft split
    assert len(splits["draft"]) >= 1024


def test_data_corpus_follows_the_builtin_target(docs_target, tiny_builtin_target, tmp_path):
    assert corpus_of("auto", docs_target) == "docs"
    assert corpus_of("auto", tiny_builtin_target) == "code"
    assert corpus_of("auto", tmp_path) == "code" and corpus_of("auto", None) == "code"
    assert corpus_of("docs", tiny_builtin_target) == "docs"
    d = builtin_conversations("eval", 3, seed=0, corpus="docs")
    c = builtin_conversations("eval", 3, seed=0)
    assert all(x.source.startswith("docs:") for x in d) and all(x.source.startswith("stdlib:") for x in c)
    # code caches keep the names they had before corpora existed; a docs cache gets another
    args = ("/t", 8, 16, 0.0, 0)
    assert regenerated_cache_path(tmp_path, *args) == regenerated_cache_path(tmp_path, *args, corpus="code")
    assert regenerated_cache_path(tmp_path, *args) != regenerated_cache_path(tmp_path, *args, corpus="docs")


def test_code_target_cache_key_is_unchanged_by_the_kind_field():
    import dataclasses
    import hashlib

    spec = BuiltinTargetConfig()
    fields = {k: v for k, v in dataclasses.asdict(spec).items() if k != "kind"}
    old = hashlib.sha1((json.dumps(fields, sort_keys=True) + sys.version.split()[0]).encode()).hexdigest()[:12]
    assert spec.key() == old
    assert BuiltinTargetConfig(kind="docs").key() != old


@pytest.mark.parametrize("recipe", ["eagle3", "medusa", "draft_model"])
def test_every_family_trains_on_the_docs_target_and_decodes_exactly(recipe, docs_target, tmp_path):
    run = tmp_path / recipe  # data.regenerate=false: the docs answers themselves (a 10-step target writes blanks)
    cmd = [sys.executable, str(REPO / "train.py"), f"recipe={recipe}", *TINY_DOCS_OVERRIDES, "logger=none",
           "data.num_train=12", "data.regenerate=false", "data.num_eval=2", "data.max_length=128",
           "train.max_steps=2", "train.batch_size=4", "train.micro_batch_size=2", "train.warmup_steps=1",
           "eagle3.ttt_steps=2", "decode.max_new_tokens=16", "decode.num_prompts=2", "decode.num_draft_tokens=3",
           "decode.warmup=0", "decode.sweep=[]", f"hydra.run.dir={run}"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"STDOUT:\n{r.stdout[-3000:]}\nSTDERR:\n{r.stderr[-5000:]}"
    report = json.loads((run / "report.json").read_text())
    assert report["target"] == str(docs_target.resolve())
    assert report["outputs_match_baseline"] is True  # greedy speculative output == AR on the docs target
    assert "held-out docs chats" in r.stdout + r.stderr
    if recipe == "eagle3":  # every end token of the target's generation config is in the draft vocabulary
        from safetensors.torch import load_file

        d2t = load_file(str(run / "final" / "model.safetensors"))["d2t"]
        draft_ids = set((torch.arange(len(d2t)) + d2t).tolist())
        tok = AutoTokenizer.from_pretrained(docs_target)
        assert set(tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])) <= draft_ids
