"""The recipes for real targets (drafttrain/conf/recipe/<method>-<target>.yaml) and their target presets
(drafttrain/conf/target/<name>.yaml). Each recipe composes through the CLI's Hydra config, builds on its method
recipe and states only what differs from it, documents every value it sets in its header (with the 8-GPU launch,
regenerate, capture, export and serve lines and the step arithmetic), validates (also for 8 processes), and builds
its drafter against a tiny random model of the real target's architecture: the real layer count, vocabulary, RoPE
and embedding tying, at width 64 and 40000 tokens (no hub access). One training step per family runs in the slow tier."""
from __future__ import annotations

import json
import math
import re
import shlex

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from drafttrain.cli import CONF_DIR, check_overrides, expand_shorthands
from drafttrain.validate import check_values
from tests.test_config import _flat  # the same flattening of a composed config

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add overhead

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# the real models' architecture facts the recipes depend on (their config.json): family, layers, vocabulary, ...
ARCH = {
    "llama3.1-8b-instruct": dict(hub="meta-llama/Llama-3.1-8B-Instruct", family="llama", layers=32, vocab=128256,
                                 tie=False, rope=LLAMA3_ROPE, max_pos=131072),
    "qwen3-8b": dict(hub="Qwen/Qwen3-8B", family="qwen3", layers=36, vocab=151936, tie=False,
                     rope={"rope_type": "default", "rope_theta": 1000000.0}, max_pos=40960),
    "llama3.3-70b-instruct": dict(hub="meta-llama/Llama-3.3-70B-Instruct", family="llama", layers=80, vocab=128256,
                                  tie=False, rope=LLAMA3_ROPE, max_pos=131072),
    # the pretrained draft of recipe=draft_model-llama3.3-70b
    "llama3.2-1b-instruct": dict(hub="meta-llama/Llama-3.2-1B-Instruct", family="llama", layers=16, vocab=128256,
                                 tie=True, rope={**LLAMA3_ROPE, "factor": 32.0}, max_pos=131072),
}
REAL = {  # recipe -> its target preset
    "eagle3-llama3.1-8b": "llama3.1-8b-instruct",
    "eagle3-qwen3-8b": "qwen3-8b",
    "eagle3-llama3.3-70b": "llama3.3-70b-instruct",
    "medusa-llama3.1-8b": "llama3.1-8b-instruct",
    "medusa2-llama3.1-8b": "llama3.1-8b-instruct",
    "draft_model-llama3.3-70b": "llama3.3-70b-instruct",
    "dflash-qwen3-8b": "qwen3-8b",
}
TRAINED = ["eagle3-qwen3-8b", "medusa-llama3.1-8b", "medusa2-llama3.1-8b", "draft_model-llama3.3-70b", "dflash-qwen3-8b"]


def _family(recipe: str) -> str:
    return recipe.split("-")[0]


def _compose(overrides):
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="train", overrides=expand_shorthands(list(overrides)))
    finally:
        GlobalHydra.instance().clear()


def _source(recipe: str) -> str:
    return (CONF_DIR / "recipe" / f"{recipe}.yaml").read_text()


def _header(recipe: str) -> str:
    """The header comment with continuation lines joined: one command line per entry."""
    lines = [ln[1:].strip() for ln in _source(recipe).splitlines() if ln.startswith("#")]
    return re.sub(r"\s*\\\n\s*", " ", "\n".join(lines))


def _stated(recipe: str) -> dict:
    body = yaml.safe_load(_source(recipe))
    body.pop("defaults")
    return dict(_flat(body))


# ------------------------------------------------------------------------------------------ the files
def test_the_real_recipes_and_presets_are_these():
    """A new <method>-<target> recipe or target preset must join these tables (and so these tests)."""
    recipes = {p.stem for p in (CONF_DIR / "recipe").glob("*-*.yaml")}
    assert recipes == set(REAL)
    presets = {p.stem for p in (CONF_DIR / "target").glob("*.yaml")} - {"auto", "builtin", "builtin-docs", "hf"}
    assert presets == set(REAL.values())


@pytest.mark.parametrize("preset", sorted(set(REAL.values())))
def test_target_preset_names_its_model_and_architecture(preset):
    """The preset loads the hub model (in bf16 on CUDA: dtype auto) and its comment states the architecture facts
    the recipes rely on (the tiny models below are built from the same table)."""
    a, text = ARCH[preset], (CONF_DIR / "target" / f"{preset}.yaml").read_text()
    assert yaml.safe_load(text) == {"name_or_path": a["hub"]}
    L = a["layers"]
    for fact in (f"{L} layers", f"vocabulary {a['vocab']}", f"taps are (2, {L // 2}, {L - 3})"):
        assert fact in text, f"target/{preset}.yaml does not say {fact!r}"
    target = OmegaConf.to_object(_compose([f"target={preset}"])).target
    assert (target.name_or_path, target.dtype) == (a["hub"], "auto")


@pytest.mark.parametrize("recipe", sorted(REAL))
def test_recipe_builds_on_its_method_recipe_and_states_only_changes(recipe):
    """defaults = [its method recipe, its target preset, data=jsonl]; every key it sets is a TrainJob key whose
    value differs from the one the method recipe composes with the same groups (and it sets no method)."""
    preset = REAL[recipe]
    assert yaml.safe_load(_source(recipe))["defaults"] == [
        _family(recipe), {"override /target": preset}, {"override /data": "jsonl"}, "_self_"]
    stated = _stated(recipe)
    assert "method" not in stated
    base = dict(_flat(OmegaConf.to_container(_compose([f"recipe={_family(recipe)}", f"target={preset}", "data=jsonl",
                                                       f"data.path={stated['data.path']}"]))))
    for key, value in stated.items():
        assert key in base, f"recipe {recipe}: {key} is not a TrainJob key"
        if key == "data.path":
            continue
        same = value == base[key] or (isinstance(base[key], float) and float(value) == base[key])
        assert not same, f"recipe {recipe}: {key}={value!r} restates what recipe={_family(recipe)} runs with"
    job = OmegaConf.to_object(_compose([f"recipe={recipe}"]))
    assert job.method == _family(recipe) and job.data.source == "jsonl"
    assert job.target.name_or_path == ARCH[preset]["hub"]


@pytest.mark.parametrize("recipe", sorted(REAL))
def test_header_documents_every_value_and_the_step_arithmetic(recipe):
    """Each value set appears in the header as `key value`; train.max_steps = epochs x rows / train.batch_size
    as the header computes it; a warmup stated as a ratio is that ratio of train.max_steps."""
    head, stated = _header(recipe), _stated(recipe)
    for key, value in stated.items():
        if key != "data.path":
            assert f"{key} {value}" in head, f"recipe {recipe}: the header does not say {key} {value}"
    job = OmegaConf.to_object(_compose([f"recipe={recipe}"]))
    m = re.search(r"([\d.]+) (?:epochs? )?(?:\([^)]*\) )?x ([\d,]+) rows / (\d+) rows per step", head)
    assert m, f"recipe {recipe}: no 'E epochs x N rows / B rows per step' in the header"
    epochs, rows, batch = float(m[1]), int(m[2].replace(",", "")), int(m[3])
    assert batch == job.train.batch_size
    assert job.train.max_steps == math.ceil(epochs * rows / batch)
    w = re.search(r"train\.warmup_steps (\d+) .*?([\d.]+) x ([\d,]+)", head)
    if w:
        assert int(w[1]) == job.train.warmup_steps and int(w[3].replace(",", "")) == job.train.max_steps
        assert job.train.warmup_steps == round(float(w[2]) * job.train.max_steps)


def _line(head: str, start: str) -> str:
    found = [ln for ln in head.splitlines() if ln.startswith(start)]
    assert found, f"no line starting {start!r}"
    return found[0]


@pytest.mark.parametrize("recipe", sorted(REAL))
def test_header_has_the_command_lines(recipe):
    """8-GPU launch (an existing accelerate config), regeneration against a vLLM server writing data.path,
    capture of the recipe's data (Medusa-2: none, online only), export, and a serve line for that export."""
    head, job = _header(recipe), OmegaConf.to_object(_compose([f"recipe={recipe}"]))
    hub = ARCH[REAL[recipe]]["hub"]
    launch = _line(head, "accelerate launch --config_file")
    cfg = re.match(r"accelerate launch --config_file conf/(accelerate/\S+\.yaml) --num_processes 8 train\.py "
                   rf"recipe={re.escape(recipe)}( |$)", launch)
    assert cfg and (CONF_DIR / cfg[1]).is_file(), launch
    assert _line(head, "vllm serve").startswith(f"vllm serve {hub} --port 8000")
    regen = shlex.split(_line(head, "drafttrain regenerate"))
    assert regen[2:5] == ["backend=openai", "base_url=http://127.0.0.1:8000/v1", f"model={hub}"]
    assert f"output={job.data.path}" in regen and any(a.startswith("input=") for a in regen)
    if job.method == "medusa2":
        assert "no capture line" in head
    else:
        cap = shlex.split(_line(head, "accelerate launch --num_processes 8 -m drafttrain.cli capture"))
        out = next(a for a in cap if a.startswith("capture.path="))
        assert {f"method={job.method}", f"target={REAL[recipe]}", "data=jsonl", f"data.path={job.data.path}",
                f"data.max_length={job.data.max_length}"} <= set(cap)
        assert any(ln.endswith(f"recipe={recipe} capture.mode=offline {out}") or f"capture.mode=offline {out}" in ln
                   for ln in head.splitlines() if ln.startswith("accelerate launch --config_file"))
    export = shlex.split(_line(head, "drafttrain export"))
    fmt = "hf" if job.method == "draft_model" else "vllm"
    assert export[2:4] == ["drafter=runs/<run>/final", f"format={fmt}"]
    served = [ln for ln in head.splitlines() if ln.startswith("vllm serve") and "--speculative-config" in ln]
    spec = json.loads(shlex.split(served[0])[-1])
    expect = {"eagle3": "eagle3", "medusa": "medusa", "medusa2": "medusa", "dflash": "dflash"}.get(job.method)
    assert spec.get("method") == expect
    assert spec["model"] == export[4].partition("=")[2] + ("/heads" if job.method == "medusa2" else "")


@pytest.mark.parametrize("recipe", sorted(REAL))
def test_recipe_validates_through_the_cli(recipe, tmp_path, monkeypatch, capsys):
    """The CLI's check (compose + check_job): a missing data file is one line naming data.path; with the file
    there the recipe passes for the 8 processes of its launch line (batch geometry). The header's
    regenerate, capture and offline-training lines pass the same check (their files made), its export line
    composes (the drafter it names does not exist here)."""
    monkeypatch.chdir(tmp_path)
    path = _stated(recipe)["data.path"]
    with pytest.raises(SystemExit) as e:
        check_overrides("train", [f"recipe={recipe}"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: data.path={path}: no such file"
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text('{"messages": []}\n')
    monkeypatch.setenv("WORLD_SIZE", "8")  # as under the launch line (one process passes whenever 8 do)
    check_overrides("train", [f"recipe={recipe}"])
    monkeypatch.delenv("WORLD_SIZE")
    head = _header(recipe)
    regen = shlex.split(_line(head, "drafttrain regenerate"))[2:]
    (tmp_path / next(a for a in regen if a.startswith("input=")).partition("=")[2]).write_text("")
    check_overrides("regenerate", expand_shorthands(regen))
    if _family(recipe) != "medusa2":
        cap = shlex.split(_line(head, "accelerate launch --num_processes 8 -m drafttrain.cli capture"))[7:]
        check_overrides("capture", expand_shorthands(cap))
        (tmp_path / next(a for a in cap if a.startswith("capture.path=")).partition("=")[2]).mkdir(parents=True)
        offline = [ln for ln in head.splitlines() if ln.startswith("accelerate launch --config_file") and
                   "capture.mode=offline" in ln]
        check_overrides("train", shlex.split(offline[0])[7:])
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="export", overrides=shlex.split(_line(head, "drafttrain export").replace("<run>", "r"))[2:])
    check_values("export", cfg)


# ------------------------------------------------------------------------------ tiny models of the real ones
WORDS = [f"w{i}" for i in range(64)]
SPECIALS = ["<pad>", "<bos>", "<eot>", "<unk>", "<system>", "<user>", "<assistant>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<' + m['role'] + '>' }} {% if m['role'] == 'assistant' %}"
            "{% generation %}{{ m['content'] }} <eot>{% endgeneration %}{% else %}{{ m['content'] }} <eot>{% endif %} "
            "{% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}")


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(WordLevel({t: i for i, t in enumerate(SPECIALS + WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eot>", pad_token="<pad>",
                                  unk_token="<unk>", additional_special_tokens=SPECIALS[4:])
    tok.chat_template = TEMPLATE
    return tok


# the tiny models' vocabulary: above the recipes' 32000-token draft vocabulary (which is then not the default
# min(32000, V // 2) = 20000, so the recipes' eagle3.draft_vocab_size is what the drafter gets), and a third of
# Llama-3's 128256, which keeps Medusa's 5 full-vocabulary heads cheap
TINY_VOCAB = 40000


def _save_tiny(name: str, directory):
    """A random model of ``ARCH[name]``'s family, layer count, RoPE, length and tying, 64 wide, with
    ``TINY_VOCAB`` tokens and a small word-level tokenizer (its ids are the first of the vocabulary)."""
    import transformers as tf

    a, tok = ARCH[name], _tokenizer()
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=a["layers"],
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=a["tie"],
                  max_position_embeddings=a["max_pos"], rope_parameters=dict(a["rope"]),
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = tf.Qwen3Config(**common, head_dim=16) if a["family"] == "qwen3" else tf.LlamaConfig(**common)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> the directory of its tiny model, built on first use."""
    root, made = tmp_path_factory.mktemp("tiny"), {}

    def get(name):
        if name not in made:
            made[name] = _save_tiny(name, root / name)
        return made[name]

    return get


def _tiny_overrides(recipe, tiny):
    out = [f"recipe={recipe}", f"target={tiny(REAL[recipe])}"]  # the CLI's shorthand for a local target
    if _family(recipe) == "draft_model":
        out.append(f"distill.pretrained={tiny('llama3.2-1b-instruct')}")
    if _family(recipe) == "dflash":  # the tiny vocabulary has no row 151669 (Qwen3's <|MASK|>): its last row
        out.append(f"dflash.mask_token_id={TINY_VOCAB - 1}")
    return out


@pytest.mark.parametrize("recipe", sorted(REAL))
def test_recipe_builds_its_drafter_on_a_tiny_model_of_its_target(recipe, tiny):
    """The recipe's model keys resolve against its target's architecture: EAGLE-3 taps (2, L//2, L-3) of the
    real depth, the recipe's 32000-token draft vocabulary, the target's RoPE and length; 5 Medusa heads (Medusa-2: LoRA
    r 32 on the target); the pretrained draft (Llama-3.2-1B's architecture) sharing the vocabulary."""
    from drafttrain.targets.load import load_target
    from drafttrain.training.method import method_class

    job = OmegaConf.to_object(_compose(_tiny_overrides(recipe, tiny)))
    assert job.target.name_or_path == str(tiny(REAL[recipe]))
    model, tok, path = load_target(job.target)
    cls, _ = method_class(job)
    method = cls.from_job(job, tok, model)
    a = ARCH[REAL[recipe]]
    examples = [{"input_ids": list(range(7, 40)), "loss_mask": [0] * 8 + [1] * 25}]
    drafter = method.build_drafter(model, examples, path)
    if job.method == "eagle3":
        L = a["layers"]
        assert method.taps == (2, L // 2, L - 3) and drafter.d2t.numel() == 32000
        assert drafter.fc.in_features == 3 * 64 and drafter.config.vocab_size == TINY_VOCAB
        assert drafter.config.max_position_embeddings == a["max_pos"]
        assert (drafter.config.rope_scaling or {}).get("rope_type", "default") == a["rope"]["rope_type"]
    elif job.method in ("medusa", "medusa2"):
        assert drafter.heads.num_heads == 5 and drafter.heads.num_layers == 1
        assert drafter.heads.vocab_size == TINY_VOCAB
        ranks = {m.r["default"] for m in model.modules() if hasattr(m, "lora_A") and isinstance(m.r, dict)}
        assert ranks == ({32} if job.method == "medusa2" else set())
    elif job.method == "dflash":  # Qwen3-8B's published draft: 5 layers over taps [1, 9, 17, 25, 33], block 16
        assert method.layer_ids == [1, 9, 17, 25, 33] and drafter.config.hf_taps == (2, 10, 18, 26, 34)
        assert drafter.config.num_layers == 5 and drafter.config.block_size == 16
        assert drafter.fc.in_features == 5 * 64 and drafter.config.vocab_size == TINY_VOCAB
        assert job.dflash.mask_token_id == TINY_VOCAB - 1
        assert OmegaConf.to_object(_compose([f"recipe={recipe}"])).dflash.mask_token_id == 151669
    else:
        lm = drafter.lm
        assert lm.config.num_hidden_layers == ARCH["llama3.2-1b-instruct"]["layers"] and lm.config.tie_word_embeddings
        assert lm.get_output_embeddings().weight.shape[0] == TINY_VOCAB


@pytest.mark.slow
@pytest.mark.parametrize("recipe", TRAINED)
def test_recipe_trains_one_step_on_a_tiny_model_of_its_target(recipe, tiny, tmp_path):
    """One optimizer step of the recipe's settings (its micro-batch, max_length, lr schedule, heads, on-policy
    ratio) on the tiny model, then its final evaluation: greedy speculative output equals AR."""
    from accelerate.state import AcceleratorState, GradientState

    from drafttrain.training import loop

    chats = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": " ".join(WORDS[i:i + 6])},
                          {"role": "assistant", "content": " ".join(WORDS[i + 6:i + 20])}]} for i in range(0, 40, 4)]
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    micro = OmegaConf.to_object(_compose([f"recipe={recipe}"])).train.micro_batch_size
    job = OmegaConf.to_object(_compose([
        *_tiny_overrides(recipe, tiny), f"data.path={chats}", "logger=none", "data.num_eval=1", "train.max_steps=1",
        f"train.batch_size={micro}", "distill.on_policy_max_new_tokens=8",
        "decode.max_new_tokens=6", "decode.warmup=0", "decode.sweep=[]", "decode.plot=false",
        "train.eval_sampled_temperature=0"]))
    (tmp_path / "run").mkdir()
    try:
        report = loop.run_train(job, tmp_path / "run")
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    history = json.loads((tmp_path / "run" / "train_metrics.json").read_text())["history"]
    assert [h["step"] for h in history] == [1] and math.isfinite(history[0]["loss"])
    assert report["outputs_match_baseline"] is True and report["method"] == job.decode.method
    assert report.get("target_modified", False) is (job.method == "medusa2")
