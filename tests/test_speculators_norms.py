"""EAGLE-3 drafters trained elsewhere with speculators' norm conventions (``norm_before_residual``,
``norm_before_fc``, ``fc_norm``, ``norm_output``; speculators' trainer turns the first, second and fourth on by
default): a checkpoint in speculators' own layout loads, computes what an independent reference written here
computes (training forward, cached inference step, static step), drafts exactly the reference's tokens in the
decoder with greedy output equal to AR, and is exported only to layouts whose engine honours each flag."""
from __future__ import annotations

import json
import math

import pytest
import torch
import transformers as tf

from drafttrain.data.vocab import build_draft_vocab
from drafttrain.io import DraftTrainError, save_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

V, L, VD = 80, 6, 40
TAPS = [2, 3, 4]
CFG = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
           num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.3)
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# what speculators 0.9.0's trainer writes by default (its `--fc-norm` variant in newer files), then each alone
COMBOS = {
    "speculators-0.9.0": dict(norm_before_residual=True, norm_before_fc=True, norm_output=True),
    "speculators-fc_norm": dict(norm_before_residual=True, fc_norm=True, norm_output=True),
    "norm_before_residual": dict(norm_before_residual=True),
    "norm_before_fc": dict(norm_before_fc=True),
    "none": {},
}


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**CFG)).eval()


# ----------------------------------------------------------------- a checkpoint as speculators writes it
def speculators_checkpoint(directory, target, taps, flags: dict, seed: int = 0, draft_vocab: int | None = None,
                           include=()):
    """``directory`` in speculators' save layout (Eagle3DraftModel.save_pretrained, speculators 0.9.0):
    config.json with the top-level norm flags and a transformer_layer_config (sliding-window draft layer, as
    its trainer writes by default), model.safetensors with speculators' tensor names (``input_norm.weight``
    over the concatenated taps, the verifier's embedding saved, t2d/d2t). Random weights, norms away from 1;
    the draft vocabulary holds the ids ``include``. Returns the tensors and the config."""
    tc = target.config
    H, heads, kv = tc.hidden_size, tc.num_attention_heads, tc.num_key_value_heads
    D = getattr(tc, "head_dim", None) or H // heads
    I, Vt = tc.intermediate_size, tc.vocab_size
    vd = draft_vocab or Vt // 2
    g = torch.Generator().manual_seed(seed)
    d2t, t2d = build_draft_vocab(torch.randint(0, 50, (Vt,), generator=g), vd, always_include=[2, *include])

    def w(*shape, std=0.2):
        return torch.randn(shape, generator=g) * std

    def norm(n):
        return 1 + 0.3 * torch.randn(n, generator=g)

    sd = {"d2t": d2t, "t2d": t2d, "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
          "lm_head.weight": w(vd, H), "fc.weight": w(H, 3 * H, std=0.1), "norm.weight": norm(H),
          "layers.0.self_attn.q_proj.weight": w(heads * D, 2 * H), "layers.0.self_attn.k_proj.weight": w(kv * D, 2 * H),
          "layers.0.self_attn.v_proj.weight": w(kv * D, 2 * H), "layers.0.self_attn.o_proj.weight": w(H, heads * D),
          "layers.0.mlp.gate_proj.weight": w(I, H), "layers.0.mlp.up_proj.weight": w(I, H),
          "layers.0.mlp.down_proj.weight": w(H, I), "layers.0.input_layernorm.weight": norm(H),
          "layers.0.hidden_norm.weight": norm(H), "layers.0.post_attention_layernorm.weight": norm(H)}
    if flags.get("norm_before_fc"):
        sd["input_norm.weight"] = norm(3 * H)
    if flags.get("fc_norm"):
        sd.update({f"fc_norm.{i}.weight": norm(H) for i in range(3)})
    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "transformers_version": tf.__version__,
        "dtype": "float32",
        "draft_vocab_size": vd,
        **{k: bool(flags.get(k, False)) for k in FLAGS},
        "embed_requires_grad": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(taps),
        "transformer_layer_config": {
            "model_type": "llama", "vocab_size": Vt, "hidden_size": H, "intermediate_size": I,
            "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": D,
            "hidden_act": "silu", "max_position_embeddings": 2048, "initializer_range": 0.02,
            "rms_norm_eps": tc.rms_norm_eps, "tie_word_embeddings": False, "attention_bias": False,
            "mlp_bias": False, "sliding_window": 2048, "use_sliding_window": True,
            "layer_types": ["sliding_attention"], "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": "tiny-verifier", "architectures": ["LlamaForCausalLM"]},
        },
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_tensors(directory / "model.safetensors", sd, metadata={"format": "pt"})
    return sd, config


# ------------------------------------------------------------------------ the independent reference
class Reference:
    """EAGLE-3 one-layer draft math written out from speculators' ``Eagle3DraftModel`` / vLLM's
    ``llama_eagle3.py``, on the checkpoint's tensors: an entry is (fused feature or handed-on hidden, token) at
    a rotary position; its query attends to a given list of earlier entries' keys and its own."""

    def __init__(self, sd, config):
        self.sd, self.c = sd, config
        lc = config["transformer_layer_config"]
        self.eps, self.heads, self.kv, self.D = lc["rms_norm_eps"], lc["num_attention_heads"], \
            lc["num_key_value_heads"], lc["head_dim"]
        self.theta = lc["rope_parameters"]["rope_theta"]
        self.target_ids = torch.arange(sd["d2t"].numel()) + sd["d2t"]

    def rms(self, x, name):
        return self.sd[name] * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def fuse(self, taps):  # [n, 3H] -> [n, H]
        if self.c["norm_before_fc"]:
            taps = self.rms(taps, "input_norm.weight")
        if self.c["fc_norm"]:
            taps = torch.cat([self.rms(x, f"fc_norm.{i}.weight") for i, x in enumerate(taps.chunk(3, -1))], -1)
        return taps @ self.sd["fc.weight"].T

    def rope(self, x, pos):  # x [heads, D] at integer position pos
        half = self.D // 2
        freq = 1.0 / self.theta ** (torch.arange(half, dtype=torch.float64) * 2 / self.D)
        ang = (pos * freq).float()
        cos, sin = torch.cos(ang), torch.sin(ang)
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    def entry(self, token, hidden, pos):
        """q, k, v of one entry, plus what finishes it."""
        p = "layers.0."
        e = self.rms(self.sd["embed_tokens.weight"][token], p + "input_layernorm.weight")
        hn = self.rms(hidden, p + "hidden_norm.weight")
        x = torch.cat([e, hn])
        q = (self.sd[p + "self_attn.q_proj.weight"] @ x).view(self.heads, self.D)
        k = (self.sd[p + "self_attn.k_proj.weight"] @ x).view(self.kv, self.D)
        v = (self.sd[p + "self_attn.v_proj.weight"] @ x).view(self.kv, self.D)
        residual = hn if self.c["norm_before_residual"] else hidden
        return self.rope(q, pos), self.rope(k, pos), v, residual

    def finish(self, q, keys, values, residual):
        """Attention of q over ``keys``/``values`` ([S, kv, D] each), then the rest of the layer and the head."""
        p = "layers.0."
        group = self.heads // self.kv
        out = []
        for h in range(self.heads):
            s = keys[:, h // group] @ q[h] / math.sqrt(self.D)
            out.append(torch.softmax(s, 0) @ values[:, h // group])
        h = residual + self.sd[p + "self_attn.o_proj.weight"] @ torch.cat(out)
        m = self.rms(h, p + "post_attention_layernorm.weight")
        gate, up = self.sd[p + "mlp.gate_proj.weight"] @ m, self.sd[p + "mlp.up_proj.weight"] @ m
        h = h + self.sd[p + "mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up)
        normed = self.rms(h, "norm.weight")
        logits = self.sd["lm_head.weight"] @ normed
        return logits, (normed if self.c["norm_output"] else h)

    def prefix(self, tokens, fused):
        """Entries j = (fused[j], tokens[j]) at positions j, causal: logits, handed-on hiddens, keys, values."""
        ks, vs, logits, hid = [], [], [], []
        for j, t in enumerate(tokens):
            q, k, v, res = self.entry(t, fused[j], j)
            ks.append(k)
            vs.append(v)
            lo, hd = self.finish(q, torch.stack(ks), torch.stack(vs), res)
            logits.append(lo)
            hid.append(hd)
        return torch.stack(logits), torch.stack(hid), ks, vs

    def chain(self, context, taps, k):
        """The k greedy drafts after ``context`` (x_0..x_n) from scratch: entries (h_j, x_{j+1}) for j < n
        from the target taps ``[n, 3H]``, then each draft fed back with the previous handed-on hidden."""
        logits, hid, ks, vs = self.prefix(context[1:], self.fuse(taps))
        lo, h = logits[-1], hid[-1]
        drafts = []
        for i in range(k):
            d = int(self.target_ids[int(lo.argmax())])
            drafts.append(d)
            if i + 1 < k:
                q, kk, vv, res = self.entry(d, h, len(context) - 1 + i)
                ks.append(kk)
                vs.append(vv)
                lo, h = self.finish(q, torch.stack(ks), torch.stack(vs), res)
        return drafts


def taps_of(target, ids, taps):
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[j] for j in taps], dim=-1)


def load(directory, target):
    from drafttrain.artifacts import load_drafter  # what `drafttrain eval drafter=DIR` calls

    return load_drafter(str(directory), "cpu", target_model=target)


# ------------------------------------------------------------------------------------------- (a)
@pytest.mark.parametrize("combo", list(COMBOS))
def test_speculators_checkpoint_matches_the_reference(target, tmp_path, combo, capsys):
    sd, config = speculators_checkpoint(tmp_path / "ckpt", target, TAPS, COMBOS[combo])
    d = load(tmp_path / "ckpt", target)
    for k in FLAGS:
        assert getattr(d.config, k) is bool(COMBOS[combo].get(k, False)), k
    assert ("input_norm.weight" in d.state_dict()) is bool(COMBOS[combo].get("norm_before_fc"))
    assert "sliding-window attention (window 2048)" in capsys.readouterr().out  # said once, at load
    ref = Reference(sd, config)
    T = 9
    ids = torch.randint(3, V, (1, T), generator=torch.Generator().manual_seed(5))
    taps = taps_of(target, ids, TAPS)
    # step 0 over the prompt: entry j = (h_j, x_{j+1}) at position j
    ref_logits, ref_hidden, _, _ = ref.prefix(ids[0, 1:].tolist(), ref.fuse(taps[0, :-1]))
    with torch.no_grad():
        cache = d.new_cache(1, 2 * T)
        logits, hidden = d.step(ids[:, 1:], d.fuse(taps[:, :-1]), cache)
        torch.testing.assert_close(logits[0], ref_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hidden[0], ref_hidden, atol=1e-4, rtol=1e-4)
        # a draft step reads the handed-on hidden (norm_output) through the KV cache
        y = 7
        _, _, ks, vs = ref.prefix(ids[0, 1:].tolist(), ref.fuse(taps[0, :-1]))
        q, k, v, res = ref.entry(y, ref_hidden[-1], T - 1)
        ref_l1, ref_h1 = ref.finish(q, torch.stack(ks + [k]), torch.stack(vs + [v]), res)
        l1, h1 = d.step(torch.tensor([[y]]), hidden[:, -1:], cache)
        torch.testing.assert_close(l1[0, 0], ref_l1, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(h1[0, 0], ref_h1, atol=1e-4, rtol=1e-4)
        # the static-shape step (what compile / CUDA graphs run)
        n, cap = T - 1, 16
        c2 = d.new_cache(1, cap)
        mask = (torch.arange(cap)[None, :] <= torch.arange(n)[:, None])[None]
        sl, sh = d.step_static(ids[:, 1:], d.fuse(taps[:, :-1]), c2.k, c2.v, torch.arange(n)[None],
                               torch.arange(n), mask)
        torch.testing.assert_close(sl[0], ref_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(sh[0], ref_hidden, atol=1e-4, rtol=1e-4)
        # the training forward (TTT): step 1 at index t reads step 0's hidden at t, token x_{t+2}, position t+1,
        # and attends to step 0's keys 0..t and its own
        ttt = d.ttt_forward(ids, taps, torch.ones(1, T, dtype=torch.long), 2)
        torch.testing.assert_close(ttt[0][0, :-1], ref_logits, atol=1e-4, rtol=1e-4)
        t = 4
        _, _, ks, vs = ref.prefix(ids[0, 1 : t + 2].tolist(), ref.fuse(taps[0, : t + 1]))
        q, k, v, res = ref.entry(int(ids[0, t + 2]), ref_hidden[t], t + 1)
        ref_ttt1, _ = ref.finish(q, torch.stack(ks + [k]), torch.stack(vs + [v]), res)
        torch.testing.assert_close(ttt[1][0, t], ref_ttt1, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------- (b)
@pytest.fixture(scope="module")
def builtin(tiny_builtin_target):
    model = tf.AutoModelForCausalLM.from_pretrained(tiny_builtin_target).eval()
    return model


@pytest.mark.parametrize("combo", ["speculators-0.9.0", "speculators-fc_norm"])
def test_speculators_drafter_drafts_the_reference_tokens_and_greedy_equals_ar(builtin, tmp_path, combo):
    from drafttrain.decoding.engine import SpecDecoder
    from drafttrain.decoding.proposers import Eagle3ChainProposer, Eagle3TreeProposer, NoDraft
    from drafttrain.decoding.target import TargetRunner

    taps = [2, 4, 5]
    runner = TargetRunner(builtin, taps=tuple(taps))
    prompt = torch.randint(3, builtin.config.vocab_size, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    ar = SpecDecoder(runner, NoDraft(), 0).generate(prompt, 20).tokens
    sd, config = speculators_checkpoint(tmp_path / "ckpt", builtin, taps, COMBOS[combo], seed=1, draft_vocab=512,
                                        include=ar)
    ref = Reference(sd, config)
    # the tiny target repeats one token: tilt the head row of that token toward the drafter's mean output (as
    # training would), so that some drafts are accepted and some rejected
    ctx = torch.tensor([prompt + ar])
    _, hid, _, _ = ref.prefix(ctx[0, 1:].tolist(), ref.fuse(taps_of(builtin, ctx, taps)[0, :-1]))
    out = hid if config["norm_output"] else torch.stack([ref.rms(x, "norm.weight") for x in hid])
    row = int((ref.target_ids == max(set(ar), key=ar.count)).nonzero())
    head = sd["lm_head.weight"]
    head[row] += 0.5 * head.norm(dim=1).mean() * out.mean(0) / out.mean(0).norm()
    save_tensors(tmp_path / "ckpt" / "model.safetensors", sd, metadata={"format": "pt"})
    d = load(tmp_path / "ckpt", builtin)
    for static in (False, True):
        prop = Eagle3ChainProposer(d, max_len=128, static_shapes=static)
        rounds = []
        propose = prop.propose

        def recording(tokens, k, sampling, grammar=None, _propose=propose):
            drafts, q = _propose(tokens, k, sampling, grammar)
            rounds.append((list(tokens), k, [int(x) for x in drafts]))
            return drafts, q

        prop.propose = recording
        out = SpecDecoder(runner, prop, 3).generate(prompt, 20)
        assert out.tokens == ar
        assert len(rounds) >= 5 and 0 < out.num_accepted < 3 * out.num_rounds  # accepted and rejected drafts
        for tokens, k, drafts in rounds:  # every round's drafts are the reference's, computed from scratch
            ctx = torch.tensor([tokens[:-1]])
            assert drafts == ref.chain(tokens, taps_of(builtin, ctx, taps)[0], k)[: len(drafts)], tokens
    tree = SpecDecoder(runner, Eagle3TreeProposer(d, max_len=128, depth=3, top_k=2, total_tokens=6), 3)
    assert tree.generate(prompt, 20).tokens == ar


# ------------------------------------------------------------------------------------------- (c)
def drafter(target, **flags):
    from drafttrain.drafters.eagle3 import Eagle3Drafter

    g = torch.Generator().manual_seed(0)
    d2t, t2d = build_draft_vocab(torch.randint(0, 50, (V,), generator=g), VD, always_include=[2])
    torch.manual_seed(1)
    d = Eagle3Drafter.from_target(target, TAPS, d2t, t2d, target_name_or_path="tiny", **flags)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return d.eval()


@pytest.mark.parametrize("flag", ["norm_before_residual", "norm_before_fc"])
def test_export_writes_each_flag_only_where_the_engine_honours_it(target, tmp_path, flag):
    from safetensors import safe_open

    from drafttrain.export import export_drafter

    d = drafter(target, **{flag: True})
    d.save_pretrained(tmp_path / "d")
    with pytest.raises(DraftTrainError) as e:
        export_drafter(tmp_path / "d", "sglang", tmp_path / "sglang")
    msg = str(e.value)
    assert f"{flag}=true cannot go to format=sglang" in msg and "SGLang" in msg and len(msg.splitlines()) == 1
    assert not (tmp_path / "sglang").exists()  # nothing half-written
    out = export_drafter(tmp_path / "d", "vllm", tmp_path / "vllm", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert {k: cfg[k] for k in FLAGS} == {k: k == flag for k in FLAGS}  # every flag explicit
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert ("input_norm.weight" in f.keys()) is (flag == "norm_before_fc")
    back = load(out, target)
    assert getattr(back.config, flag) is True
    for k, v in d.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v)


def test_training_config_builds_the_drafter_with_the_flags(target):
    from drafttrain.config import Eagle3Config as TrainEagle3
    from drafttrain.training.eagle3 import Eagle3Method

    class Tok:
        eos_token_id = 2

    cfg = TrainEagle3(tap_layers=TAPS, draft_vocab_size=VD, norm_before_residual=True, norm_before_fc=True)
    examples = [{"input_ids": list(range(3, V)), "loss_mask": [1] * (V - 3)}]
    d = Eagle3Method(cfg, Tok(), target).build_drafter(target, examples, "tiny")
    assert d.config.norm_before_residual and d.config.norm_before_fc and d.config.fc_norm  # fc_norm: its default
    assert d.input_norm.weight.shape == (3 * CFG["hidden_size"],) and d.layers[0].norm_before_residual
    assert TrainEagle3().norm_before_residual is False and TrainEagle3().norm_before_fc is False


# ------------------------------------------------------------------------------------------- (d)
def test_configs_without_the_keys_load_as_before(target, tmp_path):
    from drafttrain.drafters.eagle3 import Eagle3Drafter

    d = drafter(target, fc_norm=True, norm_output=True)
    d.save_pretrained(tmp_path / "d")
    p = tmp_path / "d" / "config.json"
    cfg = json.loads(p.read_text())
    assert cfg.pop("norm_before_residual") is False and cfg.pop("norm_before_fc") is False
    p.write_text(json.dumps(cfg))  # a config.json saved before the keys existed
    old = Eagle3Drafter.from_pretrained(tmp_path / "d")
    assert not old.config.norm_before_residual and not old.config.norm_before_fc
    assert not hasattr(old, "input_norm") and not old.layers[0].norm_before_residual
    ids = torch.randint(3, V, (1, 8), generator=torch.Generator().manual_seed(2))
    taps = taps_of(target, ids, TAPS)
    am = torch.ones(1, 8, dtype=torch.long)
    with torch.no_grad():
        for a, b in zip(old.ttt_forward(ids, taps, am, 2), d.ttt_forward(ids, taps, am, 2)):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    # an export written before norm_before_fc was written (norm_before_residual: false explicit) loads as false;
    # a speculators config without norm_before_residual reads it as vLLM does: true
    sd, config = speculators_checkpoint(tmp_path / "s", target, TAPS, {})
    del config["norm_before_fc"], config["fc_norm"], config["norm_output"]
    (tmp_path / "s" / "config.json").write_text(json.dumps(config))
    back = load(tmp_path / "s", target)
    assert not any(getattr(back.config, k) for k in FLAGS)
    del config["norm_before_residual"]
    (tmp_path / "s" / "config.json").write_text(json.dumps(config))
    assert load(tmp_path / "s", target).config.norm_before_residual is True
    config["norm_before_fc"] = "yes"
    (tmp_path / "s" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftTrainError, match="norm_before_fc='yes', expected true or false"):
        load(tmp_path / "s", target)


def test_flat_layout_reads_the_flags_as_vllm_does(target, tmp_path):
    """The flat (ModelOpt / SpecForge) layout: norm_before_residual top-level (false when absent);
    norm_before_fc from eagle_config (ModelOpt's place, winning over the top level) or the top level."""
    sd, config = speculators_checkpoint(tmp_path / "s", target, TAPS, COMBOS["speculators-0.9.0"])
    lc = config["transformer_layer_config"]
    flat = {**{k: v for k, v in lc.items() if k not in ("layer_types", "sliding_window", "use_sliding_window")},
            "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": config["draft_vocab_size"],
            "norm_before_residual": True, "norm_output": True, "norm_before_fc": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in TAPS], "norm_before_fc": True}}
    (tmp_path / "s" / "config.json").write_text(json.dumps(flat))
    d = load(tmp_path / "s", target)
    assert d.config.norm_before_residual and d.config.norm_before_fc and d.config.norm_output
    ref = Reference(sd, config)
    ids = torch.randint(3, V, (1, 7), generator=torch.Generator().manual_seed(4))
    taps = taps_of(target, ids, TAPS)
    ref_logits, _, _, _ = ref.prefix(ids[0, 1:].tolist(), ref.fuse(taps[0, :-1]))
    with torch.no_grad():
        logits, _ = d.step(ids[:, 1:], d.fuse(taps[:, :-1]), d.new_cache(1, 8))
    torch.testing.assert_close(logits[0], ref_logits, atol=1e-4, rtol=1e-4)
    del flat["norm_before_residual"], flat["eagle_config"]["norm_before_fc"]
    (tmp_path / "s" / "config.json").write_text(json.dumps(flat))
    with pytest.raises(DraftTrainError, match="unexpected: \\['input_norm.weight'\\]"):
        load(tmp_path / "s", target)  # norm_before_fc false now: the weight has no place
