"""Exports for vLLM / SGLang / HF checked against the on-disk contract (shared/reference/
speculators-modelopt-serving-formats.md §2), and loaded back into the decoder with the same τ and outputs."""
from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from drafttrain.export import export_drafter
from drafttrain.io import DraftTrainError

from .conftest import REPO
from .test_distributed import reference_run

pytestmark = pytest.mark.slow  # every test here reads the drafter of a 4-step training run (the env fixture)

SD = {torch.bfloat16: "BF16", torch.float32: "F32"}


def tensors(path) -> dict:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_builtin_target):
    torch.set_num_threads(1)
    from drafttrain.config import DecodeConfig, TargetConfig
    from drafttrain.data.builtin import builtin_conversations
    from drafttrain.drafters.eagle3 import Eagle3Drafter
    from drafttrain.targets.load import load_target

    run = reference_run(tmp_path_factory)  # a 4-step EAGLE-3 run on the tiny target (τ > 1 on these prompts)
    model, tok, path = load_target(TargetConfig(name_or_path=str(tiny_builtin_target)))
    decode = DecodeConfig(num_draft_tokens=3, max_new_tokens=24, num_prompts=3, warmup=0, sweep_prompts=0, plot=False)
    convs = builtin_conversations("eval", 3, 0)
    from drafttrain.targets.load import target_id

    return {"run": run, "final": run / "final", "model": model, "tok": tok, "path": target_id(path), "decode": decode,
            "convs": convs, "native": Eagle3Drafter.from_pretrained(run / "final"),
            "tmp": tmp_path_factory.mktemp("exports")}


def _evaluate(env, drafter, method="eagle3", model=None):
    from drafttrain.evaluation import evaluate_drafter

    decode = copy.deepcopy(env["decode"])
    decode.method = method
    return evaluate_drafter(model or env["model"], env["tok"], drafter, decode, env["convs"], None,
                            target_name=env["path"], drafter_name="x")


def _eagle3_names(num_layers: int, fc_norm: bool = False) -> set[str]:
    names = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "layers.0.hidden_norm.weight"}
    names |= {f"fc_norm.{i}.weight" for i in range(3)} if fc_norm else set()
    for layer in range(num_layers):
        names |= {f"layers.{layer}.{n}.weight" for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")}
    return names


def _check_eagle3_tensors(out, native, with_t2d: bool, dtype=torch.bfloat16):
    c = native.config
    H, Ht, I, D = c.hidden_size, c.target_hidden_size, c.intermediate_size, c.head_dim
    got = tensors(out)
    assert set(got) == _eagle3_names(c.num_layers, c.fc_norm) | ({"t2d"} if with_t2d else set())
    assert not any("embed_tokens" in k for k in got)  # shared with the target
    fp = SD[dtype]
    want = {
        "fc.weight": ((H, 3 * Ht), fp), "norm.weight": ((H,), fp), "lm_head.weight": ((c.draft_vocab_size, H), fp),
        "d2t": ((c.draft_vocab_size,), "I64"),
        "layers.0.self_attn.q_proj.weight": ((c.num_attention_heads * D, 2 * H), fp),
        "layers.0.self_attn.k_proj.weight": ((c.num_key_value_heads * D, 2 * H), fp),
        "layers.0.self_attn.v_proj.weight": ((c.num_key_value_heads * D, 2 * H), fp),
        "layers.0.self_attn.o_proj.weight": ((H, c.num_attention_heads * D), fp),
        "layers.0.mlp.gate_proj.weight": ((I, H), fp), "layers.0.mlp.up_proj.weight": ((I, H), fp),
        "layers.0.mlp.down_proj.weight": ((H, I), fp), "layers.0.input_layernorm.weight": ((H,), fp),
        "layers.0.hidden_norm.weight": ((H,), fp), "layers.0.post_attention_layernorm.weight": ((H,), fp),
    }
    if with_t2d:
        want["t2d"] = ((c.vocab_size,), "BOOL")
    for k, v in want.items():
        assert got[k] == v, (k, got[k], v)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        d2t = f.get_tensor("d2t")
        assert torch.equal(torch.arange(d2t.numel()) + d2t, native.draft_target_ids())  # offsets, not ids
        assert torch.equal(f.get_tensor("lm_head.weight"), native.lm_head.weight.detach().to(dtype))
        if with_t2d:
            assert torch.equal(f.get_tensor("t2d"), native.t2d)


def test_eagle3_vllm_speculators_layout(env):
    out = export_drafter(env["final"], "vllm", env["tmp"] / "vllm")
    cfg = json.loads((out / "config.json").read_text())
    c = env["native"].config
    assert cfg["speculators_model_type"] == "eagle3"
    assert "norm_before_residual" in cfg and cfg["norm_before_residual"] is False  # written explicitly
    assert cfg["draft_vocab_size"] == c.draft_vocab_size and cfg["target_hidden_size"] == c.target_hidden_size
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] == c.tap_layers  # raw capture ids (vLLM)
    tl = cfg["transformer_layer_config"]
    assert tl["model_type"] == "llama" and tl["num_hidden_layers"] == 1 and tl["hidden_size"] == c.hidden_size
    assert tl["vocab_size"] == c.vocab_size and tl["head_dim"] == c.head_dim and tl["tie_word_embeddings"] is False
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["speculative_tokens"] == 3
    assert sc["verifier"]["name_or_path"] == c.target_name_or_path == env["path"]  # the verifier is named
    assert sc["verifier"]["architectures"] == ["LlamaForCausalLM"]
    _check_eagle3_tensors(out, env["native"], with_t2d=True)


def test_eagle3_sglang_flat_layout(env):
    out = export_drafter(env["final"], "sglang", env["tmp"] / "sglang")
    cfg = json.loads((out / "config.json").read_text())
    c = env["native"].config
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang adds 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["norm_before_residual"] is False and cfg["tie_word_embeddings"] is False
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "vocab_size", "draft_vocab_size", "rms_norm_eps", "max_position_embeddings"):
        assert cfg[k] == getattr(c, k), k
    assert cfg["num_hidden_layers"] == c.num_layers and cfg["rope_theta"] == c.rope_theta
    _check_eagle3_tensors(out, env["native"], with_t2d=False)


def test_exported_eagle3_reproduces_tau_and_outputs(env):
    from drafttrain.artifacts import load_drafter

    base = _evaluate(env, env["native"])
    assert base["outputs_match_baseline"] is True
    assert base["tau"] > 1.2, "the reference drafter should accept drafts here, or this test proves little"
    outs = {}
    for fmt in ("vllm", "sglang"):
        out = export_drafter(env["final"], fmt, env["tmp"] / f"{fmt}-fp32", dtype="float32")
        d = load_drafter(str(out), "cpu", target_model=env["model"])
        for (k, v), w in zip(d.state_dict().items(), env["native"].state_dict().values()):
            assert torch.equal(v, w), (fmt, k)  # embed_tokens from the target: bit-identical to the drafter's
        rep = _evaluate(env, d)
        assert rep["tau"] == base["tau"] and rep["acceptance_per_position"] == base["acceptance_per_position"]
        assert rep["outputs_match_baseline"] is True
        outs[fmt] = rep
    bf = load_drafter(str(env["tmp"] / "vllm"), "cpu", target_model=env["model"])  # the default bf16 export
    rep = _evaluate(env, bf.float())
    assert rep["outputs_match_baseline"] is True and rep["tau"] == pytest.approx(base["tau"], abs=0.3)


def test_eval_command_reads_the_exported_directory(env, tmp_path):
    """`drafttrain eval drafter=<vllm export>`: the target comes from the verifier named in the export."""
    out = env["tmp"] / "vllm-fp32"
    if not out.exists():
        export_drafter(env["final"], "vllm", out, dtype="float32")
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from drafttrain.cli import CONF_DIR
    from drafttrain.evaluation import run_eval

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("eval", [f"drafter={out}", "data.num_eval=3", "decode.num_prompts=3", "decode.max_new_tokens=24",
                               "decode.num_draft_tokens=3", "decode.warmup=0", "decode.sweep_prompts=0",
                               "decode.plot=false"])
    rep = run_eval(OmegaConf.to_object(cfg), tmp_path)  # what `drafttrain eval` passes: the typed job, the run dir
    base = json.loads((env["run"] / "report.json").read_text())
    assert rep["target"] == env["path"] and rep["outputs_match_baseline"] is True
    assert rep["tau"] == base["tau"] and rep["alpha"] == base["alpha"]


# --------------------------------------------------------------------------------------------- Medusa
@pytest.fixture(scope="module")
def medusa_dir(env):
    from drafttrain.drafters.medusa import MedusaHeads

    heads = MedusaHeads.from_target(env["model"], num_heads=2, num_layers=1, target_name_or_path=env["path"])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    d = env["tmp"] / "medusa-native"
    heads.save_pretrained(d)
    return d, heads


def test_medusa_vllm_layout(env, medusa_dir):
    src, heads = medusa_dir
    out = export_drafter(src, "vllm", env["tmp"] / "medusa-vllm")
    cfg = json.loads((out / "config.json").read_text())
    H, V = heads.hidden_size, heads.vocab_size
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert cfg["num_heads"] == 2 and cfg["num_hidden_layers"] == 1 and cfg["medusa_fc_bias"] is True
    assert cfg["hidden_size"] == H and cfg["vocab_size"] == V
    want = {}
    for h in range(2):
        want[f"blocks.{h}.layers.0.weight"] = ((H, H), "BF16")
        want[f"blocks.{h}.layers.0.bias"] = ((H,), "BF16")
        want[f"lm_heads.{h}.weight"] = ((V, H), "BF16")
    assert tensors(out) == want
    with pytest.raises(DraftTrainError, match="SGLang has no Medusa"):
        export_drafter(src, "sglang", env["tmp"] / "medusa-sglang")


def test_exported_medusa_reproduces_tau_and_outputs(env, medusa_dir):
    from drafttrain.artifacts import load_medusa

    src, _ = medusa_dir
    out = export_drafter(src, "vllm", env["tmp"] / "medusa-fp32", dtype="float32")
    reps = []
    for d in (src, out):
        target, heads, _ = load_medusa(d, env["model"])
        reps.append(_evaluate(env, heads, method="medusa", model=target))
    assert reps[0]["outputs_match_baseline"] is True and reps[1]["outputs_match_baseline"] is True
    assert reps[1]["tau"] == reps[0]["tau"] and reps[1]["acceptance_per_position"] == reps[0]["acceptance_per_position"]


def test_medusa2_exports_heads_and_adapter(env, medusa_dir, tmp_path):
    from drafttrain.lora import add_lora, save_lora
    from drafttrain.targets.load import load_target
    from drafttrain.config import TargetConfig

    src, _ = medusa_dir
    m2 = tmp_path / "m2"
    (m2).mkdir()
    import shutil

    shutil.copytree(src, m2 / "heads")
    target, _, _ = load_target(TargetConfig(name_or_path=env["path"]))
    save_lora(add_lora(target, r=4, alpha=8, dropout=0.0), m2 / "adapter")
    (m2 / "config.json").write_text(json.dumps({"drafter_type": "medusa2", "heads": "heads", "adapter": "adapter",
                                                "target_modified": True}))
    out = export_drafter(m2, "vllm", tmp_path / "m2-vllm")
    assert json.loads((out / "config.json").read_text())["drafter_type"] == "medusa2"
    assert json.loads((out / "heads" / "config.json").read_text())["model_type"] == "medusa"
    assert set(tensors(out / "heads")) == set(tensors(src))
    assert (out / "adapter" / "adapter_config.json").exists()
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (m2 / "adapter" / "adapter_model.safetensors").read_bytes()


# --------------------------------------------------------------------------------- distilled draft model
def test_distilled_draft_exports_as_a_plain_hf_directory(env, tmp_path):
    from transformers import AutoModelForCausalLM

    from drafttrain.drafters.draft_lm import build_draft_lm

    draft = build_draft_lm(env["model"], "from_target_layers", num_layers=2)
    draft.config.drafter_type = "draft_lm"
    draft.save_pretrained(tmp_path / "d")
    env["tok"].save_pretrained(tmp_path / "d")
    out = export_drafter(tmp_path / "d", "hf", tmp_path / "hf", dtype="float32")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.num_hidden_layers == 2 and (out / "tokenizer.json").exists()
    got = tensors(out)
    for k, v in draft.state_dict().items():
        if k in got:
            assert got[k] == (tuple(v.shape), "F32"), k
    ref_sd = draft.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, ref_sd[k]), k
    with pytest.raises(DraftTrainError, match="EAGLE-3 drafter exports as vllm or sglang"):
        export_drafter(env["final"], "hf", tmp_path / "no")


# ------------------------------------------------------------------------------------------ the out dir
def test_export_refuses_a_non_empty_directory(env, tmp_path):
    out = tmp_path / "o"
    export_drafter(env["final"], "vllm", out)
    before = (out / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(DraftTrainError, match="not empty"):
        export_drafter(env["final"], "sglang", out)
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    r = subprocess.run([sys.executable, "-m", "drafttrain.cli", "export", f"drafter={env['final']}", "format=sglang",
                        f"out={out}"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().startswith("error:") and len(r.stderr.strip().splitlines()) == 1
    assert "overwrite=true" in r.stderr
    export_drafter(env["final"], "sglang", out, overwrite=True)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    empty = tmp_path / "empty"
    empty.mkdir()
    export_drafter(env["final"], "vllm", empty)  # an existing empty directory is fine


# ------------------------------------------------------------------------------------------ the model card
def test_export_of_a_run_carries_its_model_card(env, tmp_path):
    """The 4-step run's export: README.md with the target, the run's data and budget, its measured τ and
    acceptance with the decode settings, and the launch command; the layout still loads back."""
    import yaml

    report = json.loads((env["run"] / "report.json").read_text())
    out = export_drafter(env["final"], "vllm", tmp_path / "o")
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["base_model"] == env["native"].config.target_name_or_path
    assert front["tags"] == ["speculative-decoding", "eagle3", "drafttrain"]
    assert "`data.source=builtin`" in card and "48 training conversations of up to 160 tokens" in card
    assert "4 optimizer steps x batch 4 (16 conversations)" in card and "4 steps recorded in" in card
    app = " ".join(format(a, ".2f") if a is not None else "-" for a in report["acceptance_per_position"])
    assert f"| {report['tau']:.3f} | {report['alpha']:.3f} | {app} | {report['speedup']:.2f}x |" in card
    assert "eagle3, chain K=3, greedy (lossless); 3 prompts x" in card
    assert "this export's weights are bfloat16" in card  # the run measured the float32 drafter
    assert f"vllm serve {out}" in card
    from drafttrain.artifacts import load_drafter

    back = load_drafter(str(out), "cpu", target_model=env["model"])  # the card does not disturb the read-back
    assert back.config.tap_layers == env["native"].config.tap_layers
