"""DFlash (block-parallel drafter): block mask, anchors, slot weights, the training forward against the decoder's
cached block, greedy == AR, lossless sampling (χ² on a toy vocabulary), save / export / read back, refusals."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers as tf
from torch import nn

from drafttrain.decoding import NoDraft, SpecDecoder, TargetRunner
from drafttrain.decoding.dflash_proposer import DFlashProposer
from drafttrain.drafters.dflash import (DFlashDrafter, DFlashDrafterConfig, block_mask, default_gamma,
                                        default_target_layer_ids)
from drafttrain.io import DraftTrainError
from drafttrain.losses import dflash_slot_stats, dflash_slot_weights, dpace_weights
from drafttrain.training.dflash import resolve_mask_token, sample_anchors

pytestmark = pytest.mark.usefixtures("one_thread")

V, L = 96, 8
MASK = V - 1
COMMON = dict(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
              num_key_value_heads=2, head_dim=12, max_position_embeddings=256, initializer_range=0.3)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON)).eval()


def make_drafter(target, block=8, layers=2, seed=0):
    torch.manual_seed(seed)
    return DFlashDrafter.from_target(target, [1, 3, 5], MASK, block_size=block, num_layers=layers).eval()


def taps_of(target, drafter, ids):
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in drafter.config.hf_taps], -1)


# --------------------------------------------------------------------------------------------- pieces
def test_default_layer_ids_and_gamma():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B's published taps
    assert default_target_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    assert default_target_layer_ids(4, 3) == [0, 2, 3]  # too shallow for 1..L-3: every layer
    assert [default_gamma(b) for b in (8, 10, 16)] == [4.0, 5.0, 7.0]
    assert dflash_slot_weights(4, 7.0) == pytest.approx([1.0, math.exp(-1 / 7), math.exp(-2 / 7)])


def test_block_mask_context_strictly_before_anchor_bidirectional_block_and_documents():
    T, bs = 10, 3
    am = torch.ones(1, T, dtype=torch.long)
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    pos = torch.tensor([[2, 7]])
    m = block_mask(pos, torch.tensor([[True, True]]), bs, am, docs)[0]  # [6, 10 + 6]
    # block 0 (anchor column 2, document 0): context columns 0, 1
    assert m[:3, :T].nonzero()[:, 1].unique().tolist() == [0, 1]
    # block 1 (anchor column 7, document 1): columns 4..6 (column 3 is the other document)
    assert m[3:, :T].nonzero()[:, 1].unique().tolist() == [4, 5, 6]
    # bidirectional inside a block, nothing of the other block
    assert m[:3, T:T + 3].all() and not m[:3, T + 3:].any()
    assert m[3:, T + 3:].all() and not m[3:, T:T + 3].any()
    # a padding block sees only itself
    m2 = block_mask(pos, torch.tensor([[True, False]]), bs, am, docs)[0]
    assert not m2[3:, :T].any() and m2[3:, T + 3:].all()


def test_anchors_are_supervised_per_document_bounded_and_layout_independent():
    ids = torch.arange(1, 13)[None]
    loss = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1]])
    batch = {"input_ids": ids, "loss_mask": loss, "attention_mask": torch.ones_like(ids),
             "doc_ids": torch.tensor([[0] * 6 + [1] * 6]), "position_ids": torch.tensor([list(range(6)) * 2])}
    bl = sample_anchors(batch, num_anchors=10, block_size=4, seed=0, step=0)
    # x_p and x_{p+1} both answer tokens, inside one document: 2, 3, 4 and 8, 9, 10
    assert bl.pos[0][bl.valid[0]].tolist() == [2, 3, 4, 8, 9, 10]
    # slot k of the anchor at 4 predicts x_{4+k}: x_5 is scored, x_6 is the next document's
    i = bl.pos[0].tolist().index(4)
    assert bl.labels[0, i].tolist()[0] == 6 and bl.scored[0, i].tolist() == [True, False, False]
    # an answer's last token (its next token is the user's) anchors nothing: the block would start off the answer
    turns = {"input_ids": torch.arange(1, 9)[None], "loss_mask": torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1]]),
             "attention_mask": torch.ones(1, 8, dtype=torch.long)}
    assert sample_anchors(turns, 10, 4, seed=0, step=0).pos[0].tolist() == [1, 5, 6]
    few = sample_anchors(batch, num_anchors=2, block_size=4, seed=0, step=3)
    assert few.valid.sum() == 4  # two per document
    again = sample_anchors(batch, num_anchors=2, block_size=4, seed=0, step=3)
    assert torch.equal(few.pos, again.pos)  # deterministic (resume draws what the run drew)
    # the same second document alone in a padded row gets the same anchors
    solo = {"input_ids": ids[:, 6:], "loss_mask": loss[:, 6:], "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    one = sample_anchors(solo, num_anchors=2, block_size=4, seed=0, step=3)
    assert (one.pos[0][one.valid[0]] + 6).tolist() == few.pos[0][few.valid[0]].tolist()[2:]
    other = [sample_anchors(batch, 1, 4, seed=0, step=s).pos[0].tolist() for s in range(8)]
    assert len({tuple(o) for o in other}) > 1  # a new draw every step


def test_dpace_weights_and_slot_stats():
    q = torch.tensor([[0.5, 1.0, 0.0]])
    valid = torch.tensor([[True, True, True]])
    r = 0.5 * q + 0.5  # alpha 0.5: 0.75, 1.0, 0.5
    p = torch.cumprod(r, -1)
    assert torch.allclose(dpace_weights(q, valid, 0.5), torch.flip(torch.cumsum(torch.flip(p, [-1]), -1), [-1]))
    w = dpace_weights(q, torch.tensor([[True, False, True]]), 0.5)
    assert w[0, 1] == 0 and w[0, 2] == 0  # an invalid slot ends the block
    logits = torch.tensor([[5.0, 0, 0], [0, 5.0, 0], [0, 0, 5.0]])
    labels = torch.tensor([0, 0, 2])  # right, wrong, right
    st = dflash_slot_stats(logits, labels, torch.tensor([0, 1, 2]), valid, 3)
    assert [float(st[f"acc_sum_{k}"]) for k in range(3)] == [1, 0, 1]
    assert [float(st[f"prefix_sum_{k}"]) for k in range(3)] == [1, 0, 0]  # slot 3 right but slot 2 wrong


# ------------------------------------------------------------------------------- training == decoding
def test_training_forward_equals_the_decoders_cached_block(target):
    d = make_drafter(target)
    torch.manual_seed(1)
    ids = torch.randint(0, V - 1, (1, 30))
    taps = taps_of(target, d, ids)
    bs, pos = d.config.block_size, torch.tensor([[9, 17, 25]])
    m = block_mask(pos, torch.ones_like(pos, dtype=torch.bool), bs, torch.ones_like(ids))
    blk = torch.full((1, 3, bs), MASK)
    blk[0, :, 0] = ids[0, pos[0]]
    bpos = (pos[:, :, None] + torch.arange(bs)).view(1, -1)
    with torch.no_grad():
        h = d(d.embed(blk.view(1, -1)), taps, bpos, torch.arange(30)[None], m).view(1, 3, bs, -1)
    # the training path (each block's context mask, its own block only: no A x A table) computes the same
    from drafttrain.drafters.dflash import context_mask

    cm = context_mask(pos, torch.ones_like(pos, dtype=torch.bool), torch.ones_like(ids))
    with torch.no_grad():
        hb = d(d.embed(blk.view(1, -1)), taps, bpos, torch.arange(30)[None], cm, bs).view(1, 3, bs, -1)
    assert torch.allclose(hb, h, atol=1e-5)
    for a, p in enumerate(pos[0].tolist()):
        cache = d.new_cache(64)
        d.append_context(cache, taps[0, :p], 0)
        assert torch.allclose(d.logits(h[0, a, 1:]), d.draft_block(cache, int(ids[0, p])), atol=1e-4), p
    # K < B-1 drafted slots: a block of 1 + K tokens (as vLLM runs it), the same as a training block of that size
    m4 = block_mask(pos[:, :1], torch.ones(1, 1, dtype=torch.bool), 4, torch.ones_like(ids))
    with torch.no_grad():
        h4 = d(d.embed(blk[:, :1, :4].reshape(1, -1)), taps, bpos.view(1, 3, bs)[:, :1, :4].reshape(1, -1),
               torch.arange(30)[None], m4)
    cache = d.new_cache(64)
    d.append_context(cache, taps[0, :9], 0)
    short = d.draft_block(cache, int(ids[0, 9]), num_slots=3)
    assert torch.allclose(d.logits(h4[0, 1:]), short, atol=1e-4)
    assert not torch.allclose(short, d.logits(h[0, 0, 1:4]), atol=1e-4)  # the other slots are attended to
    # the context grows in pieces as the decoder adds verified positions: same keys as one write
    cache = d.new_cache(64)
    d.append_context(cache, taps[0, :5], 0)
    d.append_context(cache, taps[0, 5:9], 5)
    assert torch.allclose(d.logits(h[0, 0, 1:]), d.draft_block(cache, int(ids[0, 9])), atol=1e-4)


def _trained_copy(target, ids):
    """A drafter fitted in a few hundred steps to one sequence: its blocks are mostly right, so decoding
    exercises long accepted runs as well as rejections."""
    d = make_drafter(target, block=6, layers=1, seed=2).train()
    taps = taps_of(target, d, ids)
    T, bs = ids.shape[1], 6
    pos = torch.arange(0, T - 1)[None]
    m = block_mask(pos, torch.ones_like(pos, dtype=torch.bool), bs, torch.ones_like(ids))
    blk = torch.full((1, pos.shape[1], bs), MASK)
    blk[0, :, 0] = ids[0, pos[0]]
    cols = pos[0][:, None] + torch.arange(1, bs)
    ok = cols < T
    labels = ids[0, cols.clamp(max=T - 1)]
    bpos = (pos[:, :, None] + torch.arange(bs)).view(1, -1)
    emb = d.embed(blk.view(1, -1))
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    for _ in range(150):
        h = d(emb, taps, bpos, torch.arange(T)[None], m).view(pos.shape[1], bs, -1)[:, 1:]
        loss = nn.functional.cross_entropy(d.logits(h[ok]), labels[ok])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


def test_greedy_equals_ar_and_a_fitted_drafter_is_accepted(target):
    torch.manual_seed(3)
    prompt = torch.randint(0, V - 1, (10,)).tolist()
    for drafter_seed in (0, 1):  # random drafters: almost nothing accepted
        d = make_drafter(target, seed=drafter_seed)
        runner = TargetRunner(target, taps=d.config.hf_taps)
        ar = SpecDecoder(runner, NoDraft(), 0).generate(prompt, 40)
        res = SpecDecoder(runner, DFlashProposer(d, max_len=128), 7).generate(prompt, 40)
        assert res.tokens == ar.tokens
    d = _trained_copy(target, torch.tensor([prompt + ar.tokens]))
    runner = TargetRunner(target, taps=d.config.hf_taps)
    for k in (1, 3, 5):
        res = SpecDecoder(runner, DFlashProposer(d, max_len=128), k).generate(prompt, 40)
        assert res.tokens == ar.tokens, k
        assert res.num_drafted <= k * res.num_rounds
    assert res.num_accepted / res.num_rounds > 1.5  # the fitted blocks are accepted: several tokens per round
    # static shapes: the block over the whole cache (masked), context writes padded to powers of two
    st = SpecDecoder(runner, DFlashProposer(d, max_len=128, static_shapes=True), 5).generate(prompt, 40)
    assert st.tokens == ar.tokens and st.num_accepted == res.num_accepted


@pytest.mark.slow
def test_compiled_static_proposer_decodes_as_eager(target):
    """decode.compile: the static block forward and context write compiled (inductor on CPU) draft as eager."""
    torch.manual_seed(3)
    prompt = torch.randint(0, V - 1, (10,)).tolist()
    d = make_drafter(target, block=6, layers=1)
    runner = TargetRunner(target, taps=d.config.hf_taps)
    ar = SpecDecoder(runner, NoDraft(), 0).generate(prompt, 24)
    d = _trained_copy(target, torch.tensor([prompt + ar.tokens]))
    eager = SpecDecoder(runner, DFlashProposer(d, max_len=64), 5).generate(prompt, 24)
    comp = SpecDecoder(runner, DFlashProposer(d, max_len=64, static_shapes=True, compile=True), 5).generate(prompt, 24)
    assert comp.tokens == ar.tokens and comp.num_accepted == eager.num_accepted


def test_batched_decoding_equals_batch_one(target):
    """decode.batch_size > 1: every row's output equals batch-1 AR, in one batch, under continuous batching (a
    finished row refilled by a newcomer of another length) and with static shapes; the fitted drafter's
    blocks are accepted there too."""
    from drafttrain.decoding.batched import BatchSpecDecoder

    torch.manual_seed(4)
    prompts = [torch.randint(0, V - 1, (n,)).tolist() for n in (10, 6, 13, 8, 11)]
    limits = [30, 12, 25, 18, 9]
    ar = [SpecDecoder(TargetRunner(target), NoDraft(), 0).generate(p, n).tokens for p, n in zip(prompts, limits)]
    fitted = _trained_copy(target, torch.tensor([prompts[0] + ar[0]]))
    for d in (make_drafter(target, block=6), fitted):
        for width, static in ((None, False), (2, False), (3, True)):
            runner = TargetRunner(target, taps=d.config.hf_taps, max_len=96, static_shapes=static, buckets=(1, 2, 4, 8))
            out = BatchSpecDecoder(runner, DFlashProposer(d, max_len=96), 4).generate(prompts, limits, batch_size=width)
            assert out.tokens == ar, (width, static)
    assert out.results[0].num_accepted > out.results[0].num_rounds  # the fitted drafter's first prompt: drafts accepted in the batch as at batch 1


# --------------------------------------------------------------------------------- lossless sampling
class ToyTarget(nn.Module):
    """The toy LM of test_decoding (logits = table[x_{t-1}, x_t]) with an embedding and head a DFlash drafter
    can borrow."""

    def __init__(self):
        super().__init__()
        from tests.test_decoding import TOY_V, ToyLM

        self.lm = ToyLM(TOY_V, seed=1)
        self.config = self.lm.config
        self.embed = nn.Embedding(TOY_V, 8)
        self.head = nn.Linear(8, TOY_V, bias=False)

    def forward(self, *a, **kw):
        return self.lm(*a, **kw)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


@pytest.mark.slow
@pytest.mark.parametrize("T,k,p", [(1.0, 0, 1.0), (0.7, 3, 0.9)])
def test_dflash_sampling_preserves_target_distribution(T, k, p):
    from tests.test_decoding import TOY_N, TOY_NEW, TOY_PROMPT, TOY_V, _check_law, toy_law

    torch.manual_seed(5)
    toy = ToyTarget()
    nn.init.normal_(toy.head.weight, std=1.5)
    cfg = DFlashDrafterConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=4, vocab_size=TOY_V, target_hidden_size=4, target_num_layers=1,
                              target_layer_ids=[0], mask_token_id=TOY_V - 1, block_size=4, initializer_range=0.5)
    d = DFlashDrafter(cfg).eval()
    d._target = (toy.embed, toy.head, None)
    runner = TargetRunner(toy.lm, taps=d.config.hf_taps)
    dec = SpecDecoder(runner, DFlashProposer(d, max_len=32), 2, temperature=T, top_k=k, top_p=p, seed=7)
    counts = np.zeros((TOY_V,) * TOY_NEW)
    drafted = accepted = 0
    for _ in range(TOY_N):
        res = dec.generate(TOY_PROMPT, TOY_NEW)
        counts[tuple(res.tokens)] += 1
        drafted, accepted = drafted + res.num_drafted, accepted + res.num_accepted
    assert 0.05 < accepted / drafted < 0.95  # both paths of the rejection rule are exercised
    assert min(_check_law(counts, toy_law(toy.lm, T, k, p))) > 1e-3


# -------------------------------------------------------------------------------------- refusals
def test_bad_settings_are_refused_in_one_line(target):
    tok = SimpleNamespace(mask_token_id=None, pad_token_id=0, eos_token_id=2)
    with pytest.raises(DraftTrainError, match="no mask token"):
        resolve_mask_token(None, tok, target)
    with pytest.raises(DraftTrainError, match="not a row of the target's embedding"):
        resolve_mask_token(V, tok, target)
    with pytest.raises(DraftTrainError, match="pad token"):
        resolve_mask_token(0, tok, target)
    with pytest.raises(DraftTrainError, match="end token"):
        resolve_mask_token(2, tok, target)
    assert resolve_mask_token(None, SimpleNamespace(mask_token_id=MASK, pad_token_id=0, eos_token_id=2), target) == MASK
    with pytest.raises(DraftTrainError, match="block_size must be >= 2"):
        DFlashDrafter.from_target(target, [1], MASK, block_size=1)
    with pytest.raises(DraftTrainError, match=r"target_layer_ids \[8\] out of range"):
        DFlashDrafter.from_target(target, [1, 8], MASK)
    from drafttrain.decoding.build import make_proposer
    from drafttrain.config import DecodeConfig

    with pytest.raises(DraftTrainError, match="drafts at most 7 tokens"):
        make_proposer("dflash", make_drafter(target), DecodeConfig(method="dflash", num_draft_tokens=8))
    other = tf.Qwen3ForCausalLM(tf.Qwen3Config(**{**COMMON, "vocab_size": V + 8})).eval()
    with pytest.raises(DraftTrainError, match="trained for another target.*vocab_size 96 != the target's 104"):
        make_drafter(target).bind_target(other)


# --------------------------------------------------------------------------------- save / export
def test_save_export_and_read_back(target, tmp_path):
    from drafttrain.artifacts import drafter_type, load_drafter
    from drafttrain.export import export_drafter
    from drafttrain.io import load_tensors

    d = make_drafter(target)
    d.save_pretrained(tmp_path / "d")
    assert drafter_type(tmp_path / "d") == "dflash"
    with pytest.raises(DraftTrainError, match="load it with its target"):
        load_drafter(str(tmp_path / "d"), "cpu")
    back = load_drafter(str(tmp_path / "d"), "cpu", target_model=target)
    for n, t in d.state_dict().items():
        assert torch.equal(t, back.state_dict()[n]), n
    cache = d.new_cache(32)
    ids = torch.randint(0, V - 1, (1, 12))
    taps = taps_of(target, d, ids)
    d.append_context(cache, taps[0], 0)
    ref = d.draft_block(cache, 5)

    z = export_drafter(tmp_path / "d", "zlab", tmp_path / "z", dtype="float32")
    cfg = json.loads((z / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["is_causal"] is False and cfg["block_size"] == cfg["dflash_config"]["block_size"] == 8
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3, 5]  # 0-based layer outputs
    assert 0 <= cfg["dflash_config"]["mask_token_id"] < V
    names = set(load_tensors(z / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= names
    assert not any(n.startswith(("model.", "embed_tokens", "lm_head", "mask_hidden")) for n in names)
    s = export_drafter(tmp_path / "d", "vllm", tmp_path / "s", dtype="float32")
    scfg = json.loads((s / "config.json").read_text())
    assert scfg["speculators_model_type"] == "dflash"
    assert scfg["aux_hidden_state_layer_ids"] == [2, 4, 6]  # vLLM's convention: + 1
    assert scfg["sliding_window_non_causal"] is True  # vLLM: causal = not sliding_window_non_causal
    from drafttrain.artifacts import exported_target, recorded_target
    from drafttrain.layout import TARGET_KEY

    # a checkpoint speculators' own trainer saved (no drafttrain key) still names its verifier for target=auto
    scfg["speculators_config"]["verifier"]["name_or_path"] = "Qwen/Qwen3-8B"
    bare = {k: v for k, v in scfg.items() if k != TARGET_KEY}
    assert exported_target(bare) == "Qwen/Qwen3-8B"
    (tmp_path / "spec").mkdir()
    (tmp_path / "spec" / "config.json").write_text(json.dumps(bare))
    assert recorded_target(tmp_path / "spec") == "Qwen/Qwen3-8B"
    t = export_drafter(tmp_path / "d", "trtllm", tmp_path / "t", dtype="float32")
    assert "decoding_type: DFlash" in (t / "extra_llm_api_options.yaml").read_text()
    assert "target_layer_ids: [1, 3, 5]" in (t / "extra_llm_api_options.yaml").read_text()
    for out in (z, s):  # every layout reads back into the same drafter
        assert drafter_type(out) == "dflash"
        e = load_drafter(str(out), "cpu", target_model=target)
        c2 = e.new_cache(32)
        e.append_context(c2, taps[0], 0)
        assert torch.allclose(e.draft_block(c2, 5), ref, atol=1e-5), out
    with pytest.raises(DraftTrainError, match="1..7"):
        export_drafter(tmp_path / "d", "zlab", tmp_path / "z2", num_speculative_tokens=8)


def test_tune_measures_a_block_drafter_at_every_length():
    """DFlash's block is 1 + K tokens, so its tau is measured per K, not predicted from the longest K's acceptance:
    time(K) = verify(K + 1) + that K's draft forward + other; K = 0 costs AR's round."""
    from drafttrain.decoding.tune import choose_chain_length, choose_measured_length

    verify = {n: 1.0 + 0.01 * n for n in range(1, 9)}
    # measured: the full block (K = 7) accepts more per slot than a short one
    measured = [{"K": k, "tau": 1 + 0.7 * k if k < 7 else 6.5, "draft_time_per_round": 0.5,
                 "other_time_per_round": 0.1} for k in range(1, 8)]
    res = choose_measured_length(measured, verify, ar_round_time=1.11)
    t = {r["K"]: r["round_time_s"] for r in res["rows"]}
    assert t[0] == pytest.approx(1.11) and t[1] == pytest.approx(1.02 + 0.5 + 0.1)
    assert t[7] == pytest.approx(1.08 + 0.5 + 0.1)
    assert res["best"]["K"] == 7 and res["rows"][0]["speedup_vs_ar"] == 1.0
    assert res["best"]["speedup_vs_ar"] == pytest.approx((6.5 / 1.68) / (1 / 1.11))
    # a short block that measures better wins, whatever the longest K's acceptance would predict
    measured[2]["tau"] = 8.0
    assert choose_measured_length(measured, verify, ar_round_time=1.11)["best"]["K"] == 3
    # a chain drafter (EAGLE-3) still pays per draft token and is predicted from one calibration
    per_token = choose_chain_length([0.9] * 7, verify, 0.5, 0.1, 7)
    assert per_token["best"]["K"] < 7