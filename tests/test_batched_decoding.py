"""BatchSpecDecoder (decode.batch_size > 1) on tiny random HF models (Llama; Qwen2 with GQA) and on a batched toy
LM with a 5-token vocabulary for exact distribution tests. CPU only, one thread."""
from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers as tf
from torch import nn

from drafttrain.decoding import (DraftModelProposer, Eagle3ChainProposer, MedusaChainProposer, NoDraft,
                                 PromptLookupProposer, PromptLookupTreeProposer, SpecDecoder, TargetRunner,
                                 process_logits, verify_chain_greedy)
from drafttrain.decoding.batched import CHAIN_ONLY, BatchSpecDecoder
from drafttrain.drafters.eagle3 import Eagle3Drafter
from drafttrain.drafters.medusa import MedusaHeads
from drafttrain.io import DraftTrainError

from .test_decoding import _chi2, toy_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")

V, L = 24, 4  # a small vocabulary: random drafters are right now and then (ragged acceptance)
TAPS = (1, 2, 3)
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False)
ARCHS = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}
PROMPT_LENS = (3, 40, 9, 17)  # very different lengths decoded together
LIMITS = [24, 10, 30, 18]  # each row its own max_new_tokens (and one of them ends at eos)
METHODS = {"ar": 0, "pld": 4, "eagle3": 3, "medusa": 3, "draft_model": 3}  # method -> K
MAX_LEN = 96


@functools.lru_cache(maxsize=None)
def build(arch: str) -> SimpleNamespace:
    """Target, drafters, prompts and the batch-1 AR reference of every prompt (with the rows' limits and eos)."""
    C, M = ARCHS[arch]
    torch.manual_seed(0)
    model = M(C(**COMMON)).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in PROMPT_LENS]
    draft = copy.deepcopy(model)  # a noisy copy of the target: right often, not always
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.08 * torch.randn_like(p))
    torch.manual_seed(2)
    drafter = Eagle3Drafter.from_target(model, TAPS, torch.zeros(V, dtype=torch.long),
                                        torch.ones(V, dtype=torch.bool)).eval()
    heads = MedusaHeads(COMMON["hidden_size"], V, num_heads=3).eval()
    free = SpecDecoder(TargetRunner(model, max_len=MAX_LEN), NoDraft(), 0).generate(prompts[2], LIMITS[2]).tokens
    eos = free[6]  # row 2 ends at this eos (other rows may too, wherever it comes first)
    ar = [SpecDecoder(TargetRunner(model, max_len=MAX_LEN), NoDraft(), 0).generate(p, n, eos).tokens
          for p, n in zip(prompts, LIMITS)]
    return SimpleNamespace(arch=arch, model=model, prompts=prompts, eos=eos, ar=ar, draft=draft, drafter=drafter,
                           heads=heads)


def make(s, method: str):
    """(a fresh target runner, a fresh batch-1 proposer) for ``method``."""
    runner = TargetRunner(s.model, taps=(L,) if method == "medusa" else TAPS, max_len=MAX_LEN)
    return runner, {"ar": NoDraft, "pld": lambda: PromptLookupProposer(max_ngram=3, num_tokens=4),
                    "eagle3": lambda: Eagle3ChainProposer(s.drafter, max_len=256),
                    "medusa": lambda: MedusaChainProposer(s.heads),
                    "draft_model": lambda: DraftModelProposer(s.draft, max_len=256)}[method]()


@pytest.fixture(scope="module", params=list(ARCHS))
def setup(request):
    return build(request.param)


class Watched(BatchSpecDecoder):
    """Records the batch size of every round."""

    def _after_round(self, rows, tokens):
        self.sizes = getattr(self, "sizes", []) + [self.target.batch_size]
        assert self.target.batch_size == len(rows)


def test_rounds_past_an_accepted_eos_are_counted_as_at_batch_1(setup):
    """The target as its own draft model is right everywhere, past the end of a row too (the target's
    continuation of a finished text): the verifier accepts those drafts and the per-position acceptance the
    report gives still counts only the live positions, in the batched decoder as at batch 1."""
    def self_draft():
        return TargetRunner(setup.model, max_len=MAX_LEN), DraftModelProposer(setup.model, max_len=256)

    out = BatchSpecDecoder(*self_draft(), 3).generate(setup.prompts, LIMITS, eos_token_id=setup.eos)
    assert out.tokens == setup.ar
    one = [SpecDecoder(*self_draft(), 3).generate(p, n, setup.eos) for p, n in zip(setup.prompts, LIMITS)]
    for o, r in zip(out.results, one):
        assert (o.accepted_per_position, o.reached_per_position) == (r.accepted_per_position, r.reached_per_position)
        assert (o.live_accepted_per_position, o.live_reached_per_position) == \
            (r.live_accepted_per_position, r.live_reached_per_position)
    row = out.results[2]  # ends at eos, drafted at the second position of its third round: one draft past it
    assert sum(row.live_reached_per_position) < sum(row.reached_per_position)
    assert out.summary()["acceptance_per_position"] == [1.0] * 3


@pytest.mark.parametrize("method", list(METHODS))
def test_batched_greedy_equals_batch1(setup, method):
    """Every row equals its batch-1 AR output token for token, and its statistics equal the batch-1
    speculative decoder's (rounds, drafts accepted / reached per position): the drafter state is right too.
    The four prompts are prefilled in two packed rows (``packed_row_tokens=8``: the 40-token prompt alone)."""
    K = METHODS[method]
    runner, prop = make(setup, method)
    dec = Watched(runner, prop, K, packed_row_tokens=8)
    out = dec.generate(setup.prompts, LIMITS, eos_token_id=setup.eos)
    assert out.tokens == setup.ar
    assert setup.ar[2][-1] == setup.eos and len(setup.ar[2]) < LIMITS[2]  # one row ended at eos
    runner1, prop1 = make(setup, method)
    one = [SpecDecoder(runner1, prop1, K).generate(p, n, setup.eos) for p, n in zip(setup.prompts, LIMITS)]
    for o, r in zip(out.results, one):
        assert (o.num_rounds, o.num_round_tokens, o.num_drafted, o.num_accepted) == \
            (r.num_rounds, r.num_round_tokens, r.num_drafted, r.num_accepted)
        assert o.accepted_per_position == r.accepted_per_position
        assert o.reached_per_position == r.reached_per_position
        assert o.live_reached_per_position == r.live_reached_per_position  # a row ends at eos: its rounds too
        assert o.live_accepted_per_position == r.live_accepted_per_position
    assert len({r.num_rounds for r in out.results}) > 1  # rows end at different rounds ...
    assert dec.sizes[0] == len(LIMITS) > dec.sizes[-1] and dec.sizes == sorted(dec.sizes, reverse=True)  # ... and leave
    s = out.summary()
    assert s["num_sequences"] == len(LIMITS) and s["num_new_tokens"] == sum(map(len, setup.ar))
    if method in ("pld", "draft_model"):  # ragged acceptance: some rounds accept, some do not
        acc = [r.num_accepted for r in out.results]
        assert sum(acc) > 0 and s["alpha"] < 1
        assert 1 < s["tau"] < K + 1
    if method == "ar":
        assert s["tau"] == 1.0


@pytest.mark.parametrize("method", list(METHODS))
def test_continuous_batching_refills_finished_rows(setup, method):
    """``batch_size=2`` over the four prompts: at most two rows decode together, a finished row is refilled by
    the next waiting prompt (prefilled on its own, joining rows that are mid-answer), and every row still
    equals its batch-1 AR output with the batch-1 decoder's statistics."""
    K = METHODS[method]
    runner, prop = make(setup, method)
    dec = Watched(runner, prop, K)
    out = dec.generate(setup.prompts, LIMITS, eos_token_id=setup.eos, batch_size=2)
    assert out.tokens == setup.ar
    assert max(dec.sizes) == 2 and out.batch_size == 2
    assert out.prefills >= 3  # the first two prompts, then each newcomer on its own
    assert out.rounds < sum(r.num_rounds for r in out.results)  # rounds were shared by rows
    assert out.row_rounds == sum(r.num_rounds for r in out.results)
    runner1, prop1 = make(setup, method)
    one = [SpecDecoder(runner1, prop1, K).generate(p, n, setup.eos) for p, n in zip(setup.prompts, LIMITS)]
    for o, r in zip(out.results, one):
        assert (o.num_rounds, o.accepted_per_position, o.reached_per_position) == \
            (r.num_rounds, r.accepted_per_position, r.reached_per_position)
    # a prompt that ends at its first token, and a batch that empties while prompts still wait
    limits = [1, 1, 5, 1]
    ref = [t[:n] for t, n in zip(setup.ar, limits)]
    assert dec.generate(setup.prompts, limits, eos_token_id=setup.eos, batch_size=2).tokens == ref
    assert dec.generate(setup.prompts, LIMITS, eos_token_id=setup.eos, batch_size=1).tokens == setup.ar


@pytest.mark.parametrize("method", ["ar", "eagle3", "draft_model"])
def test_admit_min_groups_the_newcomers(setup, method):
    """``admit_min=2`` with 3 rows over six prompts: after the first batch, newcomers wait until two rows are
    free and are prefilled together (fewer admissions than refilling at once), and every row still equals its
    batch-1 AR output with the batch-1 decoder's statistics."""
    K = METHODS[method]
    prompts, limits = setup.prompts + setup.prompts[:2], LIMITS + [7, 9]  # (within the first two rows' limits)
    ref = setup.ar + [t[:n] for t, n in zip(setup.ar[:2], limits[4:])]
    runner1, prop1 = make(setup, method)
    one = [SpecDecoder(runner1, prop1, K).generate(p, n, setup.eos) for p, n in zip(prompts, limits)]
    runs = {}
    for m in (1, 2):
        runner, prop = make(setup, method)
        dec = Watched(runner, prop, K)
        out = runs[m] = dec.generate(prompts, limits, eos_token_id=setup.eos, batch_size=3, admit_min=m)
        assert out.tokens == ref
        for o, r in zip(out.results, one):
            assert (o.num_rounds, o.accepted_per_position) == (r.num_rounds, r.accepted_per_position)
        if m == 2:  # a round runs with a free row rather than admitting one newcomer alone
            assert min(dec.sizes[:-1]) < 3 and runs[2].prefills < runs[1].prefills
    assert runs[1].prefills == 1 + 3  # the first batch, then each of the three newcomers on its own


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_a_long_prompt_joins_a_long_row(method):
    """Continuous batching near the cache's end: a 40-token prompt joins while the other row holds ~55
    positions of a 75-position cache (its prefill must not be padded onto the held row's block)."""
    s = build("llama")
    K, max_len = METHODS[method], 75
    prompts, limits = [s.prompts[1], s.prompts[0], s.prompts[1]], [30, 14, 8]
    ref = []
    for p, n in zip(prompts, limits):
        r1 = TargetRunner(s.model, max_len=max_len)
        ref.append(SpecDecoder(r1, NoDraft(), 0).generate(p, n).tokens)
    runner, prop = make(s, method)
    runner.max_len = max_len
    out = BatchSpecDecoder(runner, prop, K).generate(prompts, limits, batch_size=2)
    assert out.tokens == ref and out.prefills == 2


@pytest.mark.parametrize("method", list(METHODS))
def test_static_shapes_pad_to_row_and_token_buckets(setup, method):
    """``static_shapes``: every verify (and draft-model) forward is padded to (row bucket, token bucket), the
    dummy rows on free physical rows; outputs equal batch-1 AR, in one batch and under continuous batching."""
    K = METHODS[method]
    buckets = (1, 2, 4, 8)
    runner = TargetRunner(setup.model, taps=(L,) if method == "medusa" else TAPS, max_len=MAX_LEN,
                          static_shapes=True, buckets=buckets)
    _, prop = make(setup, method)
    if method == "draft_model":
        prop = DraftModelProposer(setup.draft, max_len=256, static_shapes=True, buckets=buckets)
    dec = BatchSpecDecoder(runner, prop, K)
    for width in (None, 3):
        assert dec.generate(setup.prompts, LIMITS, eos_token_id=setup.eos, batch_size=width).tokens == setup.ar
    assert dec.target.cache.rows == 4  # the bucket of 3 rows
    rows = {r for r, _ in dec.target.shapes}
    tokens = {t for _, t in dec.target.shapes}
    assert rows <= set(buckets) and tokens <= set(buckets) and len(rows) > 1  # the batch shrank through buckets
    # a verify of the pending token + K drafts (fewer near a row's limit, or prompt lookup without a match)
    assert max(tokens) == (1 if method == "ar" else next(b for b in buckets if b >= K + 1))
    if method == "draft_model":
        assert dec.proposer.runner.shapes and dec.proposer.runner.cache.rows == 4


def test_static_shapes_compiled_on_cpu():
    """``static_shapes=true compile=true`` with B > 1 on CPU (inductor; CUDA graphs on a GPU: tests/test_gpu.py):
    one graph per (row bucket, token bucket) shape, the same tokens as batch-1 AR, with continuous batching."""
    s = build("llama")
    runner = TargetRunner(s.model, taps=TAPS, max_len=MAX_LEN, static_shapes=True, compile=True, buckets=(4,),
                          timing=False)
    dec = BatchSpecDecoder(runner, Eagle3ChainProposer(s.drafter, max_len=256), METHODS["eagle3"])
    assert dec.target._compiled is not None
    for width in (None, 2):
        assert dec.generate(s.prompts, LIMITS, eos_token_id=s.eos, batch_size=width).tokens == s.ar
    assert dec.target.shapes == {(4, 4)}  # 4 rows (one to four active) x the 4-token verify: one shape


@pytest.mark.parametrize("method", ["pld", "eagle3"])
def test_a_full_row_ends_as_at_batch_1(method):
    """A target ``max_len`` that the 40-token prompt's row fills first: that row stops where batch 1 stops (the
    cache holds all but the pending token) while the others go on."""
    s = build("llama")
    K, limit = METHODS[method], 30
    runner, prop = make(s, method)
    runner.max_len = 50
    out = BatchSpecDecoder(runner, prop, K).generate(s.prompts, limit)
    runner1, prop1 = make(s, method)
    runner1.max_len = 50
    one = [SpecDecoder(runner1, prop1, K).generate(p, limit).tokens for p in s.prompts]
    assert out.tokens == one
    assert len(out.tokens[1]) == 50 - 40 + 1 and all(len(t) == limit for i, t in enumerate(out.tokens) if i != 1)


def test_sliding_window_target():
    """A Mistral target whose window (8) is shorter than the prompts: the batched mask applies it by position."""
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=8)).eval()
    prompts = build("llama").prompts
    ref = [SpecDecoder(TargetRunner(model, max_len=MAX_LEN), NoDraft(), 0).generate(p, 12).tokens for p in prompts]
    runner = TargetRunner(model, max_len=MAX_LEN)
    assert BatchSpecDecoder(runner, NoDraft(), 0).generate(prompts, 12).tokens == ref
    assert BatchSpecDecoder(runner, PromptLookupProposer(num_tokens=3), 3).generate(prompts, 12).tokens == ref


@pytest.mark.parametrize("window,row_tokens", [(None, 256), (8, 256), (None, 40), (8, 40)])
def test_packed_prefill_equals_the_padded_one(window, row_tokens):
    """``BatchRunner.admit`` of prompts of very different lengths, packed (a block-diagonal mask; in one row, or
    with ``row_tokens`` 40 in two: the 40-token prompt alone, the 17 and 9 together, padded) and right-padded,
    into rows after one that is held: the same last-token logits, taps and lengths, and the same K/V at every
    visible slot (Qwen2 with GQA; Mistral with a sliding window shorter than the prompts); the held row is left
    as it was. Without a window, a full prefill of its own is also the reference for the keys."""
    from drafttrain.decoding.batched import BatchRunner, _pad_rows

    torch.manual_seed(0)
    model = (tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON)) if window is None else
             tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=window))).eval()
    prompts = build("llama").prompts
    held, new = prompts[0], prompts[1:]  # 40, 9 and 17 tokens join a row of 3
    outs = {}
    for packed in (True, False):
        r = BatchRunner(model, TAPS, max_len=MAX_LEN, packed_prefill=packed, packed_row_tokens=row_tokens)
        r.reset(0, rows=4)
        r.admit(*_pad_rows([held], "cpu"))
        before = [layer.keys[0, :, :len(held)].clone() for layer in r.cache.layers]
        n0 = r.num_forwards
        logits, taps = r.admit(*_pad_rows(new, "cpu"))
        assert r.num_forwards == n0 + 1 and r.lengths.tolist() == [len(held)] + [len(p) for p in new]
        for layer, b in zip(r.cache.layers, before):
            assert torch.equal(layer.keys[0, :, :len(held)], b)
        outs[packed] = (logits, taps, r)
    (lp, tp, rp), (lq, tq, rq) = outs[True], outs[False]
    assert lp.shape == lq.shape == (3, 1, V) and torch.allclose(lp, lq, atol=1e-5)
    assert tp.shape == tq.shape
    for i, p in enumerate(new):
        assert (tp[i, : len(p)] - tq[i, : len(p)]).abs().max() < 1e-4, (tp[i, : len(p)] - tq[i, : len(p)]).abs().max()
        assert not tp[i, len(p):].any()  # padding positions are zeros
        if window is None:  # (HF's own cache keeps only the window's last slots)
            for layer, fresh in zip(rp.cache.layers, _fresh_keys(model, p)):
                assert torch.allclose(layer.keys[1 + i, :, : len(p)], fresh, atol=1e-5)
        for a, b in zip(rp.cache.layers, rq.cache.layers):
            for buf in ("keys", "values"):
                x, y = getattr(a, buf)[1 + i, :, : len(p)], getattr(b, buf)[1 + i, :, : len(p)]
                assert torch.allclose(x, y, atol=1e-5)


def test_pack_rows_balances_the_rows():
    """``pack_rows``: ceil(total / row_tokens) rows (never more than the items), every item once, longest first
    to the shortest row, so the rows' lengths differ by at most the shortest item placed last."""
    from drafttrain.decoding.batched import pack_rows

    lens = [40, 9, 17, 3, 25, 25, 60, 1]
    rows = pack_rows(lens, 64)
    assert len(rows) == 3 and sorted(i for r in rows for i in r) == list(range(len(lens)))
    loads = sorted(sum(lens[i] for i in r) for r in rows)
    assert loads == [60, 60, 60]
    assert pack_rows(lens, 1000) == [sorted(range(len(lens)), key=lambda i: -lens[i])]
    assert [len(r) for r in pack_rows([5, 6], 1)] == [1, 1]


def _fresh_keys(model, tokens: list[int]):
    """Per layer K ``[H, n, D]`` of a fresh batch-1 prefill of ``tokens`` (no cache reuse at all)."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), use_cache=True)
    return [layer.keys[0] for layer in out.past_key_values.layers]


class Checked(BatchSpecDecoder):
    """After every round, checks that each row can attend to exactly its prompt + committed tokens."""

    checks = 0

    def _after_round(self, rows, tokens):
        runner = self.target
        L_ = runner.lengths
        kv = int(L_.max()) + 1
        allow = runner._mask(L_[:, None], kv)[:, 0, 0] == 0  # what a next forward's first query sees
        for i, b in enumerate(rows):
            committed = tokens[b][:-1]  # the pending token is not in the cache
            n = len(committed)
            assert list(runner.visible_slots(i)) == list(range(n))
            assert allow[i].nonzero().flatten().tolist() == list(range(n + 1))  # its slots and itself
            fresh = _fresh_keys(runner.model, committed)
            for layer, ref in zip(runner.cache.layers, fresh):
                torch.testing.assert_close(layer.keys[i, :, :n], ref, atol=1e-4, rtol=1e-4)
            self._check_proposer(i, tokens[b])
        self.checks += 1

    def _check_proposer(self, i, tokens):
        p = self.proposer
        if hasattr(p, "valid"):  # EAGLE-3: valid slots hold positions 0..n-1 once each, as a fresh rebuild
            n = len(tokens) - 1
            slots = p.valid[i].nonzero().flatten()
            assert sorted(p.pos[i, slots].tolist()) == list(range(n)) and int(p._n[i]) == n
            out = self.target_model(input_ids=torch.tensor([tokens[:-1]]), output_hidden_states=True)
            taps = torch.cat([out.hidden_states[t] for t in TAPS], -1)
            fresh = p.drafter.new_cache(1, 256)
            logits, _ = p.drafter.step(torch.tensor([tokens[1:]]), p.drafter.fuse(taps), fresh)
            torch.testing.assert_close(fresh.k[0][0][:, p.pos[i, slots]], p.cache.k[0][i][:, slots],
                                       atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(p._next_logits[i], logits[0, -1], atol=1e-4, rtol=1e-4)
        if hasattr(p, "runner"):  # draft model: its visible slots hold the cached tokens' K/V
            n = int(p.runner.lengths[i])
            assert p._cached[i][:n] == tokens[:n]
            if n:
                fresh = _fresh_keys(p.runner.model, tokens[:n])
                torch.testing.assert_close(p.runner.cache.layers[0].keys[i, :, :n], fresh[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
@pytest.mark.parametrize("row_tokens", [256, 8, None])
def test_rollback_leaves_no_stale_visible_entries(setup, method, row_tokens):
    """After every round each row's visible K/V (target, draft model) and EAGLE-3 entries equal a fresh
    prefill of its committed tokens: admissions packed in one row (256), in several (8: the 40-token prompt
    alone), or right-padded (None: ``packed_prefill=False``)."""
    runner, prop = make(setup, method)
    packing = dict(packed_row_tokens=row_tokens) if row_tokens else dict(packed_prefill=False)
    dec = Checked(runner, prop, METHODS[method], **packing)
    dec.target_model = setup.model
    if method == "eagle3":
        dec.proposer.capacity = 56  # small: the drafter cache is compacted (holes gathered out) on the way
    with torch.no_grad():
        out = dec.generate(setup.prompts, LIMITS, eos_token_id=setup.eos)
    assert out.tokens == setup.ar and dec.checks > 5
    if method == "eagle3":
        assert dec.proposer.compactions > 0
    dec.checks = 0  # continuous batching: the newcomers' rows (target and drafter) are as fresh
    assert dec.generate(setup.prompts, LIMITS, eos_token_id=setup.eos, batch_size=2).tokens == setup.ar
    assert dec.checks > 5


# ------------------------------------------------------------------- exact distribution (toy target, V=5)
class BatchToyLM(nn.Module):
    """The toy LM of tests/test_decoding.py over B rows: logits at position t are ``table[x_{t-1}, x_t]``; the
    token history is kept in the model's cache (tokens stored as one-dimensional keys), read by position (by slot
    in a packed prefill, whose keys are the packed row itself)."""

    def __init__(self, vocab: int, seed: int):
        super().__init__()
        self.config = tf.LlamaConfig(vocab_size=vocab, hidden_size=4, num_hidden_layers=1, num_attention_heads=1,
                                     num_key_value_heads=1, intermediate_size=4, max_position_embeddings=64)
        self.config._attn_implementation = "eager"
        g = torch.Generator().manual_seed(seed)
        self.V = vocab
        self.table = nn.Parameter(torch.randn(vocab + 1, vocab, vocab, generator=g), requires_grad=False)
        self.emb = nn.Parameter(torch.randn(vocab + 1, vocab, 4, generator=g), requires_grad=False)

    def get_output_embeddings(self):
        return None

    def forward(self, input_ids, position_ids=None, cache=None, output_hidden_states=False, **kw):
        x = input_ids.float()[:, None, :, None]
        hist = cache.update(x, x, 0)[0][:, 0, :, 0].long()  # [B, kv]: slot = position
        before = position_ids - 1
        if cache.packed:  # a packed prefill (prompts back to back in one row): the previous token is the previous slot
            before = torch.where(position_ids > 0, torch.arange(input_ids.shape[1])[None] - 1, -1)
        prev = torch.where(before >= 0, hist.gather(1, before.clamp_min(0)), self.V)
        h = self.emb[prev, input_ids]
        return SimpleNamespace(logits=self.table[prev, input_ids], hidden_states=(h, torch.tanh(h)))


TOY_V, TOY_NEW = 5, 4
TOY_PROMPTS = [[0, 1, 2, 3, 4, 0, 2, 4, 1, 3], [4, 4, 1], [2, 0, 3, 1, 0, 2, 2]]  # different last tokens


def toy_law(target, prompt, T, k, p) -> np.ndarray:
    """Exact P(y1..y4 | prompt) under the toy's processed distribution, ``[V, V, V, V]``."""
    law, ctx = np.ones((1,)), [(prompt[-2], prompt[-1])]
    for _ in range(TOY_NEW):
        step = np.stack([process_logits(target.table[a, b].double(), T, k, p).double().numpy() for a, b in ctx])
        law = (law[:, None] * step).ravel()
        ctx = [(b, y) for a, b in ctx for y in range(TOY_V)]
    return law.reshape((TOY_V,) * TOY_NEW)


@pytest.mark.parametrize("name,T,k,p,n,dt,width", [
    ("draft_model", 1.0, 0, 1.0, 500, None, None), ("pld", 0.7, 0, 0.9, 500, None, None),
    ("eagle3", 1.0, 4, 1.0, 300, None, None), ("draft_model", 1.0, 0, 1.0, 400, 0.25, None),
    ("eagle3", 1.0, 0, 1.0, 300, None, 2)])
def test_batched_sampling_preserves_each_rows_distribution(name, T, k, p, n, dt, width):
    """B = 3 different prompts per batch: each row's first 4 tokens follow the target's exact law (χ²), also
    when the draft samples at its own temperature (``dt``), and under continuous batching (``width`` rows at a
    time: the third prompt joins when a row leaves)."""
    target = BatchToyLM(TOY_V, seed=1)
    prop = {"draft_model": lambda: DraftModelProposer(BatchToyLM(TOY_V, seed=2)),
            "pld": lambda: PromptLookupProposer(max_ngram=2, num_tokens=2),
            "eagle3": lambda: Eagle3ChainProposer(toy_eagle3(), max_len=32)}[name]()
    dec = BatchSpecDecoder(TargetRunner(target, taps=(0, 1, 1), max_len=32), prop, 2, temperature=T, top_k=k,
                           top_p=p, seed=100, draft_temperature=dt)
    counts = np.zeros((len(TOY_PROMPTS),) + (TOY_V,) * TOY_NEW)
    drafted = accepted = 0
    for _ in range(n):
        out = dec.generate(TOY_PROMPTS, TOY_NEW, batch_size=width)
        for b, r in enumerate(out.results):
            counts[(b, *r.tokens)] += 1
            drafted, accepted = drafted + r.num_drafted, accepted + r.num_accepted
    assert 0.05 < accepted / drafted < 0.95  # both the accept and the reject paths are exercised
    for b, prompt in enumerate(TOY_PROMPTS):
        law = toy_law(target, prompt, T, k, p)
        pv = [_chi2(counts[b].sum(3), law.sum(3)), _chi2(counts[b].sum((0, 1)), law.sum((0, 1)))]
        assert min(pv) > 1e-3, (b, pv)


def test_vectorised_greedy_verification_is_verify_chain_greedy_per_row():
    """The batched greedy rule equals ``verify_chain_greedy`` row by row, padding never counts as a draft (here
    the padding token 0 is the target's argmax everywhere, so a padded slot would be "accepted")."""
    from drafttrain.decoding.batched import _verify_greedy, _pad_rows

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 7, generator=g)
    logits[:, :, 0] += 100.0 * (torch.rand(4, 5, generator=g) < 0.7)  # argmax 0 at most positions
    rows = [[3, 0, 0, 0, 0], [3, 0], [3], [3, 0, 0, 5]]  # pending, then the drafts (0: often right)
    ids, n = _pad_rows(rows, "cpu")
    got = _verify_greedy(ids, n, logits)
    assert got == [verify_chain_greedy(r[1:], logits[b, : len(r)]) for b, r in enumerate(rows)]
    assert any(a < len(r) - 1 for (a, _), r in zip(got, rows)) and got[1][0] <= 1 and got[2][0] == 0


# --------------------------------------------------------------------------------------------- refusals
def test_refusals_are_one_clear_line(setup):
    runner, prop = make(setup, "pld")
    with pytest.raises(DraftTrainError, match="supports chain methods only") as e:
        BatchSpecDecoder(runner, PromptLookupTreeProposer(), 4)
    assert CHAIN_ONLY in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DraftTrainError, match="typical acceptance") as e:
        BatchSpecDecoder(runner, prop, 4, temperature=1.0, typical=True)
    assert "\n" not in str(e.value)
    with pytest.raises(DraftTrainError, match="grammar") as e:
        BatchSpecDecoder(runner, prop, 4).generate(setup.prompts, 4, grammar=object())
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ eval wiring
@pytest.mark.parametrize("method,continuous", [("pld", True), ("draft_model", True), ("draft_model", False)])
def test_eval_decode_batch_size_groups_the_prompts(method, continuous):
    """``decode.batch_size=3`` on 5 prompts (continuous: 3 rows refilled as they finish; groups: 3, then 2): same
    outputs and per-position statistics as ``batch_size=1`` under greedy, AR and speculative both batched, the
    batch size in the report."""
    from drafttrain.config import DecodeConfig
    from drafttrain.decoding.build import make_proposer
    from drafttrain.evaluation import evaluate

    s = build("llama")
    prompts = s.prompts + [s.prompts[0] * 3]
    reps = {}
    for B in (1, 3):
        decode = DecodeConfig(method=method, num_draft_tokens=3, max_new_tokens=12, warmup=0, sweep_prompts=2,
                              plot=False, batch_size=B, continuous_batching=continuous)
        prop = make_proposer(method, drafter=s.draft if method == "draft_model" else None, decode=decode,
                             max_len=128)
        reps[B] = evaluate(s.model, None, prompts, prop, decode, None, method=method, target_name="tiny",
                           drafter_name=None)
    one, three = reps[1], reps[3]
    assert three["batch_size"] == 3 and one["batch_size"] == 1 and three["outputs_match_baseline"] is True
    for key in ("tau", "alpha", "acceptance_per_position", "new_tokens"):
        assert three[key] == one[key], key
    assert three["sweep"] == [] and one["sweep"]  # the draft-length sweep stays batch 1
    assert 1 < three["tau"] < 4


def test_eval_batch_size_refuses_trees_in_one_line():
    from drafttrain.config import DecodeConfig, TreeConfig
    from drafttrain.decoding.build import make_proposer
    from drafttrain.evaluation import evaluate

    s = build("llama")
    decode = DecodeConfig(method="pld", num_draft_tokens=3, max_new_tokens=8, warmup=0, sweep_prompts=0, plot=False,
                          batch_size=2, tree=TreeConfig(enabled=True, depth=3, top_k=2, total_tokens=6))
    prop = make_proposer("pld", decode=decode, max_len=128)
    with pytest.raises(DraftTrainError, match="decode.batch_size>1 supports chain methods only") as e:
        evaluate(s.model, None, s.prompts, prop, decode, None, method="pld", target_name="tiny", drafter_name=None)
    assert "\n" not in str(e.value)
