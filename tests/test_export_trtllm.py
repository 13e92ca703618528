"""``drafttrain export … format=trtllm`` (EAGLE-3 for TensorRT-LLM's PyTorch backend) against a contract mirror.

``import tensorrt_llm`` needs the NVIDIA driver library, so its loader cannot run here. The mirror below restates
the loader's rules, written from NVIDIA/TensorRT-LLM's source (read, not copied):

- ``tensorrt_llm/_torch/models/modeling_speculative.py`` @ 00679c66c3e38f6d2651ad0a5bef0f94d862e36c:
  ``Eagle3DraftModel`` (which modules exist: ``fc`` [H, H_in·k] with H_in = ``target_hidden_size`` or H and k =
  the number of captured layers; ``input_norm`` iff ``eagle_config.norm_before_fc``; ``fc_norm.{i}`` iff
  ``fc_norm``; ``midlayer`` one layer or ``midlayer.{i}``; ``norm``; ``d2t`` int32 iff ``draft_vocab_size !=
  vocab_size``; ``embed_tokens`` iff H_in != H), ``Eagle3DecoderLayer`` (the first layer: q/k/v over
  [input_layernorm(embeds); hidden_norm(h)] (2H), later layers (``next_layer_regular``, default true): q/k/v
  over hidden_norm(h) (H), no input_layernorm; the residual is h *before* hidden_norm; the next state is the
  pre-norm residual stream, or the post-norm one with ``norm_output``), ``Eagle3ForCausalLM.load_weights``
  (``layers.0.`` -> ``midlayer.`` for one layer, ``layers.{i}.`` -> ``midlayer.{i}.`` for several, ``model.``
  before every non-``lm_head`` key; an ``lm_head`` in the checkpoint replaces the target's) and
  ``apply_eagle3_fc`` (fc_norm per tap, else input_norm, then fc; skipped when the width is already H);
- ``tensorrt_llm/_torch/models/modeling_auto.py`` @ 01bffee125e24ebe5b4a63437840a9422eb70868: with
  ``draft_vocab_size`` in the config, ``architectures[0]`` loses "Eagle3" and gains the prefix "EAGLE3"; the
  registered EAGLE-3 class is ``EAGLE3LlamaForCausalLM``;
- ``tensorrt_llm/_torch/speculative/eagle3.py`` @ f933a608045a46426792263617475b359d568043: the captured
  layers are ``sorted(eagle3_layers_to_capture)``; layer l's capture is its output (hidden + residual), i.e.
  HF ``hidden_states[l + 1]``, concatenated in that order;
- ``tensorrt_llm/llmapi/llm_args.py`` @ fcd3f31682808ae56118ae43c1d7864a3a945e6f: ``Eagle3DecodingConfig``
  (``decoding_type: Eagle3``, ``max_draft_len`` > 0, ``speculative_model`` required, ``eagle3_layers_to_capture``
  a set of ints; Medusa's config is refused on the PyTorch backend).

The draft config is read with ``transformers.AutoConfig``; TensorRT-LLM registers no config class for
``model_type: llama`` (transformers has it), so the test registers nothing. The TensorRT-LLM release these
commits belong to is not recorded in the files read (its ``version.py`` was not stored at them).
"""
from __future__ import annotations

import copy
import json
import math
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
import yaml
from safetensors.torch import load_file, save_file

from drafttrain.artifacts import load_exported_eagle3
from drafttrain.layout import TRTLLM_OPTIONS_NAME
from drafttrain.data.vocab import build_draft_vocab, d2t_target_ids
from drafttrain.drafters.eagle3 import Eagle3Drafter, Eagle3DrafterConfig
from drafttrain.export import export_drafter, serve_hint
from drafttrain.export.eagle3 import trtllm_config, trtllm_tensors
from drafttrain.io import DraftTrainError, write_json

pytestmark = pytest.mark.usefixtures("one_thread")

V, L, VD = 80, 6, 40
CFG = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
           num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.3)
REGISTERED = {"EAGLE3LlamaForCausalLM", "Eagle3DeepSeekV3ForCausalLM"}  # modeling_speculative's register_auto_model


class ContractError(AssertionError):
    pass


def need(cond, what):
    if not cond:
        raise ContractError(what)


# ---------------------------------------------------------------------------------------- the contract mirror
def trtllm_load(out, target_layers: int = L):
    """What TensorRT-LLM's PyTorch backend would load from ``out``: ``(config, spec, weights)`` with the weights
    under its module names; :class:`ContractError` where its loader would fail or load something else."""
    spec = yaml.safe_load((out / TRTLLM_OPTIONS_NAME).read_text())["speculative_config"]
    need(spec.get("decoding_type") == "Eagle3", "decoding_type must be Eagle3")
    need(isinstance(spec.get("max_draft_len"), int) and spec["max_draft_len"] > 0, "max_draft_len must be > 0")
    need(spec.get("speculative_model") == str(out.resolve()), "speculative_model must name the export")
    capture = spec.get("eagle3_layers_to_capture")
    need(isinstance(capture, list) and all(isinstance(x, int) for x in capture), "eagle3_layers_to_capture: ints")
    need(all(0 <= x < target_layers for x in capture), "capture ids are 0-based decoder layers")
    layers = sorted(set(capture))  # Eagle3SpecMetadata: sorted(list(set))
    cfg = tf.AutoConfig.from_pretrained(str(out))  # no registration: model_type llama is transformers' own
    need(hasattr(cfg, "draft_vocab_size"), "no draft_vocab_size: TRT-LLM would not take it for EAGLE-3")
    arch = "EAGLE3" + cfg.architectures[0].replace("Eagle3", "")
    need(arch in REGISTERED, f"architecture {cfg.architectures[0]} maps to {arch}, not a registered class")
    eagle = getattr(cfg, "eagle_config", None) or {}
    H, Hin, k = cfg.hidden_size, getattr(cfg, "target_hidden_size", cfg.hidden_size), len(layers)
    D = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    q, kv, I = cfg.num_attention_heads * D, cfg.num_key_value_heads * D, cfg.intermediate_size
    n = cfg.num_hidden_layers
    want = {"model.fc.weight": (H, Hin * k), "model.norm.weight": (H,), "lm_head.weight": (cfg.draft_vocab_size, H)}
    if eagle.get("norm_before_fc", False):
        want["model.input_norm.weight"] = (Hin * k,)
    if getattr(cfg, "fc_norm", False):
        want |= {f"model.fc_norm.{i}.weight": (Hin,) for i in range(k)}
    for i in range(n):
        p = "model.midlayer." if n == 1 else f"model.midlayer.{i}."
        first = not (eagle.get("next_layer_regular", True) and i > 0)
        w_in = 2 * H if first else H
        want |= {p + "self_attn.q_proj.weight": (q, w_in), p + "self_attn.k_proj.weight": (kv, w_in),
                 p + "self_attn.v_proj.weight": (kv, w_in), p + "self_attn.o_proj.weight": (H, q),
                 p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                 p + "mlp.down_proj.weight": (H, I), p + "hidden_norm.weight": (H,),
                 p + "post_attention_layernorm.weight": (H,)}
        if first:
            want[p + "input_layernorm.weight"] = (H,)
    if cfg.draft_vocab_size != cfg.vocab_size:
        want["model.d2t"] = (cfg.draft_vocab_size,)
    if Hin != H:
        want["model.embed_tokens.weight"] = (cfg.vocab_size, H)
    raw = load_file(str(out / "model.safetensors"))
    got = {}
    for key, v in raw.items():  # Eagle3ForCausalLM.load_weights
        key = re.sub(r"^layers\.0\.", "midlayer.", key) if n == 1 else re.sub(r"^layers\.(\d+)\.", r"midlayer.\1.", key)
        got[key if "lm_head" in key else "model." + key] = v
    need(set(got) == set(want), f"keys after TRT-LLM's renaming: missing {sorted(set(want) - set(got))}, "
                                f"unexpected {sorted(set(got) - set(want))}")
    for key, shape in want.items():
        need(tuple(got[key].shape) == shape, f"{key}: shape {tuple(got[key].shape)}, TRT-LLM builds {shape}")
    if "model.d2t" in got:
        need(got["model.d2t"].dtype == torch.int32, f"d2t is {got['model.d2t'].dtype}, TRT-LLM's is int32")
    need(H != Hin * k, "fc would be skipped (apply_eagle3_fc tests the width)")
    return cfg, spec, layers, got


def _rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = pos.double()[:, None] * inv
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos().float(), emb.sin().float()
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin  # rope_gpt_neox


def trtllm_first_pass(cfg, layers, W, hidden_states, input_ids, embedding):
    """Eagle3ForCausalLM's first draft pass over a context as its source computes it (one sequence, causal
    attention): the captures of ``layers`` (HF ``hidden_states[l + 1]``, ascending) at positions 0..T-2 with
    the context's input ids shifted left by one (position t reads token t + 1, _prepare_context_input_ids),
    apply_eagle3_fc, the midlayers, norm, lm_head. Returns draft-vocabulary logits ``[T-1, Vd]`` and the state
    handed to the next pass."""
    eps, H = cfg.rms_norm_eps, cfg.hidden_size
    eagle = getattr(cfg, "eagle_config", None) or {}
    W = {k: v.float() for k, v in W.items()}
    h = torch.cat([hidden_states[l + 1][0, :-1] for l in layers], -1)  # maybe_capture_hidden_states: layer outputs
    input_ids = input_ids[1:]
    if getattr(cfg, "fc_norm", False):
        h = torch.cat([_rms(c, W[f"model.fc_norm.{i}.weight"], eps) for i, c in enumerate(h.chunk(len(layers), -1))], -1)
    elif eagle.get("norm_before_fc", False):
        h = _rms(h, W["model.input_norm.weight"], eps)
    h = h @ W["model.fc.weight"].T
    emb = (W["model.embed_tokens.weight"] if "model.embed_tokens.weight" in W else embedding)[input_ids]
    T = h.shape[0]
    D = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    pos = torch.arange(T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    theta = float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"])
    n, residual = cfg.num_hidden_layers, None
    for i in range(n):
        p = "model.midlayer." if n == 1 else f"model.midlayer.{i}."
        if residual is not None:
            h = h + residual
        residual = h  # taken before hidden_norm
        x = _rms(h, W[p + "hidden_norm.weight"], eps)
        if p + "input_layernorm.weight" in W:
            x = torch.cat([_rms(emb, W[p + "input_layernorm.weight"], eps), x], -1)
        qh = _rope((x @ W[p + "self_attn.q_proj.weight"].T).view(T, nh, D).transpose(0, 1), pos, theta)
        kh = _rope((x @ W[p + "self_attn.k_proj.weight"].T).view(T, nkv, D).transpose(0, 1), pos, theta)
        vh = (x @ W[p + "self_attn.v_proj.weight"].T).view(T, nkv, D).transpose(0, 1)
        kh, vh = kh.repeat_interleave(nh // nkv, 0), vh.repeat_interleave(nh // nkv, 0)
        s = (qh @ kh.transpose(-1, -2)) / math.sqrt(D)
        a = s.masked_fill(~mask, float("-inf")).softmax(-1) @ vh
        a = a.transpose(0, 1).reshape(T, nh * D) @ W[p + "self_attn.o_proj.weight"].T
        residual = a + residual  # post_attention_layernorm(hidden, residual): fused add + norm
        x = _rms(residual, W[p + "post_attention_layernorm.weight"], eps)
        h = (F.silu(x @ W[p + "mlp.gate_proj.weight"].T) * (x @ W[p + "mlp.up_proj.weight"].T)) @ \
            W[p + "mlp.down_proj.weight"].T
    pre = h + residual
    normed = _rms(pre, W["model.norm.weight"], eps)
    nxt = normed if (getattr(cfg, "norm_output", False) or eagle.get("return_hidden_post_norm", False)) else pre
    return normed @ W["lm_head.weight"].T, nxt


def trtllm_target_ids(cfg, W):
    """Target id of each draft id as TRT-LLM maps them (``d2t`` offsets; none: the identity)."""
    d2t = W.get("model.d2t")
    return torch.arange(cfg.draft_vocab_size) + (d2t.long() if d2t is not None else 0)


# ---------------------------------------------------------------------------------------------- drafters
@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**CFG)).eval()


def make_drafter(target, taps=(2, 3, 4), vd=VD, num_layers=1, **opts):
    g = torch.Generator().manual_seed(0)
    d2t, t2d = build_draft_vocab(torch.randint(0, 50, (V,), generator=g), vd, always_include=[2])
    torch.manual_seed(1)
    d = Eagle3Drafter.from_target(target, list(taps), d2t, t2d, num_layers=num_layers, target_name_or_path="tiny",
                                  **opts)
    _perturb(d)
    return d.eval()


def _perturb(d):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # norms start at 1: perturb them so a norm in the wrong place shows
        for n, p in d.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))


def wide_drafter():
    """A draft wider than the target (H 48 over taps of width 32): TRT-LLM needs its own embed_tokens."""
    c = Eagle3DrafterConfig(hidden_size=48, target_hidden_size=32, intermediate_size=96, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=12, vocab_size=V, draft_vocab_size=VD, tap_layers=[2, 3, 4],
                            target_num_layers=L, target_name_or_path="tiny")
    g = torch.Generator().manual_seed(0)
    d2t, t2d = build_draft_vocab(torch.randint(0, 50, (V,), generator=g), VD, always_include=[2])
    torch.manual_seed(1)
    d = Eagle3Drafter(c, d2t, t2d)
    _perturb(d)
    return d.eval()


CASES = {
    "base": dict(),
    "eagle3.1": dict(fc_norm=True, norm_output=True),
    "norm_before_fc": dict(norm_before_fc=True),
    "2-layers": dict(num_layers=2),
    "3-layers+norm_output": dict(num_layers=3, norm_output=True),
    "unsorted-taps": dict(taps=(4, 1, 3), fc_norm=True),
    "full-vocab": dict(vd=V),
}


def build(target, case):
    return wide_drafter() if case == "wide" else make_drafter(target, **CASES[case])


def ids_and_states(target, T=12, seed=5):
    ids = torch.randint(3, V, (1, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
    return ids, hs


def drafter_first_pass(d, ids, hs):
    """The drafter's own step 0 (ttt_forward) on the same inputs: draft logits [T-1, Vd] and the next state
    (index t reads the taps at t and the token t + 1; the last index has no next token)."""
    taps = torch.cat([hs[t] for t in d.config.tap_layers], -1)
    with torch.no_grad():
        logits, hiddens = d.ttt_forward(ids, taps, torch.ones_like(ids), 1, return_hidden=True)
    return logits[0][0, :-1], hiddens[0][0, :-1]


def export(d, tmp_path, name="trt", dtype="float32"):
    d.save_pretrained(tmp_path / f"{name}-src")
    return export_drafter(tmp_path / f"{name}-src", "trtllm", tmp_path / name, dtype=dtype, num_speculative_tokens=4)


def check_contract(out, d, target):
    """Every check of the mirror against the drafter ``d`` the export was written from."""
    cfg, spec, layers, W = trtllm_load(out)
    c = d.config
    need(cfg.draft_vocab_size == c.draft_vocab_size and cfg.target_hidden_size == c.target_hidden_size,
         "draft_vocab_size / target_hidden_size")
    need(tuple(W["model.fc.weight"].shape) == (c.hidden_size, 3 * c.target_hidden_size), "fc width = 3 x target H")
    need(sorted(spec["eagle3_layers_to_capture"]) == sorted(t - 1 for t in c.tap_layers),
         f"eagle3_layers_to_capture {spec['eagle3_layers_to_capture']} != taps - 1 ({c.tap_layers})")
    need(not getattr(cfg, "norm_before_residual", False) and not c.norm_before_residual,
         "TRT-LLM takes the residual before hidden_norm")
    need(torch.equal(trtllm_target_ids(cfg, W), d2t_target_ids(d.d2t)), "d2t[i] + i != the drafter's target ids")
    need("lm_head.weight" in W, "lm_head")
    need(("model.embed_tokens.weight" in W) == (c.hidden_size != c.target_hidden_size), "embed_tokens")
    ids, hs = ids_and_states(target)
    emb = target.get_input_embeddings().weight.detach()
    got, nxt = trtllm_first_pass(cfg, layers, W, hs, ids[0], emb)
    want, want_next = drafter_first_pass(d, ids, hs)
    need(torch.allclose(got, want, atol=1e-4, rtol=1e-4), f"first-pass logits differ by {(got - want).abs().max():.3g}")
    need(torch.allclose(nxt, want_next, atol=1e-4, rtol=1e-4), "the state handed to the next pass differs")
    return cfg, spec, W


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("case", [*CASES, "wide"])
def test_export_passes_the_trtllm_contract(target, tmp_path, case):
    d = build(target, case)
    out = export(d, tmp_path)
    cfg, spec, W = check_contract(out, d, target)
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "llama" and raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert spec["max_draft_len"] == 4 and sorted(p.name for p in out.iterdir()) == [
        "README.md", "config.json", TRTLLM_OPTIONS_NAME, "model.safetensors"]
    n = d.config.num_layers
    assert any(k.startswith("model.midlayer.1.") for k in W) == (n > 1)
    assert ("model.d2t" in W) == (case != "full-vocab")
    # the export loads back into drafttrain (eval) as the same drafter: same logits on the same inputs
    back = load_exported_eagle3(out, target_model=target)
    ids, hs = ids_and_states(target, seed=9)
    l0, h0 = drafter_first_pass(d, ids, hs)
    l1, h1 = drafter_first_pass(back, ids, hs)
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1, h0, atol=1e-5, rtol=1e-5)
    assert torch.equal(back.draft_target_ids(), d.draft_target_ids())
    if case == "2-layers":  # later steps too: the cached step of the reloaded drafter equals the original's
        taps = lambda m: torch.cat([hs[t] for t in m.config.tap_layers], -1)  # noqa: E731
        with torch.no_grad():
            a = d.ttt_forward(ids, taps(d), torch.ones_like(ids), 3)
            b = back.ttt_forward(ids, taps(back), torch.ones_like(ids), 3)
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)


def test_bf16_export_and_serve_line(target, tmp_path):
    d = make_drafter(target)
    out = export(d, tmp_path, dtype="bfloat16")
    cfg, _, _, W = trtllm_load(out)
    assert W["model.fc.weight"].dtype == torch.bfloat16 and W["model.d2t"].dtype == torch.int32
    assert serve_hint(out, "trtllm") == f"trtllm-serve <target> --extra_llm_api_options {out / TRTLLM_OPTIONS_NAME}"
    text = (out / TRTLLM_OPTIONS_NAME).read_text()
    assert yaml.safe_load(text)["speculative_config"]["eagle3_layers_to_capture"] == [1, 2, 3]  # taps (2, 3, 4)


# each mutation of a good export, and the check that catches it
def _drop(key):
    def f(out, d):
        sd = load_file(str(out / "model.safetensors"))
        sd.pop(key)
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return f


def _tensor(key, fn):
    def f(out, d):
        sd = load_file(str(out / "model.safetensors"))
        sd[key] = fn(sd[key])
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return f


def _rename(old, new):
    def f(out, d):
        sd = load_file(str(out / "model.safetensors"))
        sd = {k.replace(old, new): v for k, v in sd.items()}
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return f


def _config(**kv):
    def f(out, d):
        cfg = json.loads((out / "config.json").read_text())
        for k, v in kv.items():
            if v is None:
                cfg.pop(k)
            else:
                cfg[k] = v
        write_json(out / "config.json", cfg)
    return f


def _yaml(fn):
    def f(out, d):
        doc = yaml.safe_load((out / TRTLLM_OPTIONS_NAME).read_text())
        fn(doc["speculative_config"])
        (out / TRTLLM_OPTIONS_NAME).write_text(yaml.safe_dump(doc))
    return f


def _flip_residual(out, d):
    """The same tensors written for a drafter trained with norm_before_residual (which write_eagle3 refuses)."""
    d.config.norm_before_residual = True
    d.layers[0].norm_before_residual = True


def _set(spec, **kv):
    spec.update(kv)


MUTATIONS = {
    "d2t dropped": (_drop("d2t"), "missing ['model.d2t']"),
    "d2t int64": (_tensor("d2t", lambda v: v.long()), "int32"),
    "d2t off by one": (_tensor("d2t", lambda v: v + 1), "d2t[i] + i"),
    "lm_head dropped": (_drop("lm_head.weight"), "missing ['lm_head.weight']"),
    "embed_tokens added": (lambda out, d: _add_embed(out), "unexpected ['model.embed_tokens.weight']"),
    "one layer written as midlayer.0": (_rename("midlayer.", "midlayer.0."), "missing"),
    "fc narrowed": (_tensor("fc.weight", lambda v: v[:, :64].contiguous()), "shape"),
    "taps shifted by one": (_yaml(lambda s: _set(s, eagle3_layers_to_capture=[2, 3, 4])), "taps - 1"),
    "taps 1-based": (_yaml(lambda s: _set(s, eagle3_layers_to_capture=[2, 3, 4])), "logits differ"),
    "no decoding_type": (_yaml(lambda s: _set(s, decoding_type="Eagle")), "decoding_type"),
    "speculative_model elsewhere": (_yaml(lambda s: _set(s, speculative_model="/elsewhere")), "speculative_model"),
    "speculators architecture": (_config(architectures=["Eagle3DraftModel"]), "not a registered class"),
    "no draft_vocab_size": (_config(draft_vocab_size=None), "draft_vocab_size"),
    "fc columns in the drafter's order": (None, "logits differ"),
    "residual convention flipped": (_flip_residual, "residual"),
    "residual convention flipped, flag hidden": (None, "logits differ"),
    "norm_output dropped": (_config(norm_output=False), "next pass"),
}


def _add_embed(out):
    sd = load_file(str(out / "model.safetensors"))
    sd["embed_tokens.weight"] = torch.zeros(V, CFG["hidden_size"])
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_the_mirror_rejects_a_mutated_export(target, tmp_path, mutation):
    opts = {"fc columns in the drafter's order": dict(taps=(4, 1, 3)),
            "norm_output dropped": dict(norm_output=True)}.get(mutation, {})
    d = make_drafter(target, **opts)
    good = export(d, tmp_path)
    check_contract(good, d, target)  # the unmutated export passes
    out = tmp_path / "mutated"
    shutil.copytree(good, out)
    (out / TRTLLM_OPTIONS_NAME).write_text((good / TRTLLM_OPTIONS_NAME).read_text().replace(str(good.resolve()), str(out.resolve())))
    fn, match = MUTATIONS[mutation]
    d = copy.deepcopy(d)
    if mutation == "taps 1-based":  # the translation check skipped: the forward catches it too
        fn(out, d)
        cfg, spec, layers, W = trtllm_load(out)
        ids, hs = ids_and_states(target)
        got, _ = trtllm_first_pass(cfg, layers, W, hs, ids[0], target.get_input_embeddings().weight.detach())
        want, _ = drafter_first_pass(d, ids, hs)
        assert not torch.allclose(got, want, atol=1e-3)
        return
    if mutation == "fc columns in the drafter's order":  # fc as the drafter holds it (taps 4, 1, 3), unsorted
        sd = load_file(str(out / "model.safetensors"))
        sd["fc.weight"] = d.fc.weight.detach().clone()
        sd.update({f"fc_norm.{i}.weight": w.detach().clone() for i, w in enumerate(
            m.weight for m in getattr(d, "fc_norm", []))})
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    elif mutation == "residual convention flipped, flag hidden":
        d.layers[0].norm_before_residual = True  # the drafter computes the other convention; its config says false
    else:
        fn(out, d)
    with pytest.raises(ContractError, match=match.replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        check_contract(out, d, target)


# ------------------------------------------------------------------------------------------------ refusals
def _refused(src, fmt, out, match):
    with pytest.raises(DraftTrainError) as e:
        export_drafter(src, fmt, out)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and match in msg, msg
    assert not out.exists()  # nothing half-written
    return msg


@pytest.mark.parametrize("opts,match", [
    (dict(norm_before_residual=True), "norm_before_residual=true cannot go to format=trtllm"),
    (dict(qk_norm=True), "qk_norm=true cannot go to format=trtllm"),
    (dict(fc_norm=True, norm_before_fc=True), "fc_norm=true with norm_before_fc=true cannot go to format=trtllm"),
    (dict(taps=(0, 2, 4)), "include [0]"),
    (dict(taps=(2, 4, 6)), "include [6]"),
    (dict(taps=(2, 4, 4)), "repeat a layer"),
])
def test_trtllm_refuses_what_it_cannot_serve(target, tmp_path, opts, match):
    d = make_drafter(target, **opts)
    d.save_pretrained(tmp_path / "d")
    _refused(tmp_path / "d", "trtllm", tmp_path / "out", match)


def test_sglang_refuses_several_draft_layers(target, tmp_path):
    d = make_drafter(target, num_layers=2)
    d.save_pretrained(tmp_path / "d")
    _refused(tmp_path / "d", "sglang", tmp_path / "out", "num_layers=2 cannot go to format=sglang")


@pytest.mark.parametrize("kind,fmt,match", [
    ("medusa", "trtllm", "Medusa on TensorRT-LLM is engine-build only"),
    ("medusa2", "trtllm", "Medusa on TensorRT-LLM is engine-build only"),
    ("medusa", "sglang", "SGLang has no Medusa"),
    ("draft_model", "trtllm", "use format=hf"),
])
def test_other_families_refuse_engines_that_cannot_serve_them(tmp_path, kind, fmt, match):
    src = tmp_path / "d"
    src.mkdir()
    write_json(src / "config.json", {"drafter_type": kind})
    _refused(src, fmt, tmp_path / "out", match)


def test_write_eagle3_helpers_are_what_the_export_writes(target, tmp_path):
    """trtllm_config / trtllm_tensors (used above to build mutations) are the export's own writers."""
    d = make_drafter(target, taps=(4, 1, 3))
    out = export(d, tmp_path)
    assert json.loads((out / "config.json").read_text()) == json.loads(json.dumps(trtllm_config(d, "float32")))
    sd = load_file(str(out / "model.safetensors"))
    ref = trtllm_tensors(d, torch.float32)
    assert set(sd) == set(ref) and all(torch.equal(sd[k], ref[k]) for k in sd)


def test_fc_of_the_draft_width_is_refused(tmp_path):
    """hidden_size = 3 x target_hidden_size: TRT-LLM's apply_eagle3_fc would take the taps for fc's output."""
    c = Eagle3DrafterConfig(hidden_size=96, target_hidden_size=32, intermediate_size=96, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=24, vocab_size=V, draft_vocab_size=VD, tap_layers=[2, 3, 4],
                            target_num_layers=L)
    d2t, t2d = build_draft_vocab(torch.randint(0, 50, (V,), generator=torch.Generator().manual_seed(0)), VD)
    Eagle3Drafter(c, d2t, t2d).save_pretrained(tmp_path / "d")
    _refused(tmp_path / "d", "trtllm", tmp_path / "out", "TensorRT-LLM skips fc")


def test_the_export_command_prints_the_trtllm_serve_line(target, tmp_path):
    import subprocess
    import sys

    from .conftest import REPO

    make_drafter(target).save_pretrained(tmp_path / "d")
    r = subprocess.run([sys.executable, "-m", "drafttrain.cli", "export", f"drafter={tmp_path / 'd'}", "format=trtllm",
                        f"out={tmp_path / 'out'}", "num_speculative_tokens=5"], capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"trtllm-serve <target> --extra_llm_api_options {tmp_path / 'out' / TRTLLM_OPTIONS_NAME}" in r.stdout
    _, spec, _, _ = trtllm_load(tmp_path / "out")
    assert spec["max_draft_len"] == 5
