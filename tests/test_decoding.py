"""SpecDecoder, TargetRunner and proposers on tiny random HF models (Llama, Qwen2, Mistral with a sliding
window shorter than the sequences) and on a toy LM with a 5-token vocabulary for exact distribution tests.
CPU only."""
from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers as tf
from scipy import stats
from torch import nn

from drafttrain.decoding import (
    DraftModelProposer,
    Eagle3ChainProposer,
    NoDraft,
    OracleProposer,
    PromptLookupProposer,
    SpecDecoder,
    StubProposer,
    TargetRunner,
    aggregate,
    process_logits,
)
from drafttrain.decoding import engine as engine_mod
from drafttrain.decoding.sampling import verify_chain_sampling
from drafttrain.drafters.eagle3 import Eagle3DrafterConfig, Eagle3Drafter

V, L = 96, 8
TAPS = (2, L // 2, L - 3)
N_NEW = 40
PROMPT_LEN = 12
COMMON = dict(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False)
ARCHS = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
    # a window shorter than prompt + output: rollback must work past the window's edge
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 16}),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add overhead


def make_model(arch: str, seed: int):
    torch.manual_seed(seed)
    C, M, extra = ARCHS[arch]
    return M(C(**COMMON, **extra)).eval()


def make_drafter(target, seed: int = 0, vd: int = 48) -> Eagle3Drafter:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(V, generator=g)[:vd].sort().values  # draft vocabulary: a random subset
    d2t = ids - torch.arange(vd)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    torch.manual_seed(seed)
    return Eagle3Drafter.from_target(target, TAPS, d2t, t2d).eval()


@functools.lru_cache(maxsize=None)
def build(arch: str) -> SimpleNamespace:
    """Per architecture: target runner, a second random model, a random EAGLE-3 drafter, a prompt and the
    AR greedy output (checked against uncached greedy decoding in a test)."""
    model = make_model(arch, 0)
    runner = TargetRunner(model, taps=TAPS)
    prompt = torch.randint(0, V, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    ar = SpecDecoder(runner, NoDraft(), 0).generate(prompt, N_NEW)
    return SimpleNamespace(arch=arch, model=model, runner=runner, prompt=prompt, ar=ar.tokens, ar_result=ar,
                           draft_model=make_model(arch, 1), drafter=make_drafter(model))


@pytest.fixture(scope="module", params=list(ARCHS))
def setup(request):
    return build(request.param)


@pytest.fixture(scope="module")
def llama():
    """For tests of the loop's arithmetic, where one architecture is enough."""
    return build("llama")


def greedy_without_cache(model, prompt, n):
    """Ground truth: greedy decoding by full forwards over the whole sequence (no KV cache at all)."""
    seq = list(prompt)
    for _ in range(n):
        logits, _ = full_forward(model, seq)
        seq.append(int(logits[-1].argmax()))
    return seq[len(prompt) :]


def full_forward(model, tokens, taps=None):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), output_hidden_states=taps is not None)
    t = None if taps is None else torch.cat([out.hidden_states[i][0] for i in taps], -1)
    return out.logits[0].float(), t


# ------------------------------------------------------------------------------------------ target runner
def test_ar_matches_uncached_greedy_and_hf_generate(setup):
    assert setup.ar == greedy_without_cache(setup.model, setup.prompt, N_NEW)
    assert setup.ar_result.num_rounds == N_NEW - 1 and setup.ar_result.tau == 1.0
    assert len(set(setup.ar)) > 5  # a non-degenerate reference
    if setup.arch != "mistral":
        # with a sliding window shorter than the sequence, transformers' generate() departs from the uncached
        # forward (transformers 5.24); the runner agrees with the uncached forward, which defines the model
        hf = setup.model.generate(torch.tensor([setup.prompt]), max_new_tokens=N_NEW, do_sample=False,
                                  min_new_tokens=N_NEW)
        assert setup.ar == hf[0, PROMPT_LEN:].tolist()


def test_target_runner_rollback_matches_full_forward(setup):
    model, runner = setup.model, TargetRunner(setup.model, taps=TAPS)
    seq = setup.prompt + setup.ar[:14]  # 26 positions: beyond mistral's window of 16
    runner.forward(seq[:20])
    runner.forward([5, 6, 7, 8, 9])  # a rejected guess at positions 20..24
    runner.truncate(20)
    assert runner.length == 20 and runner.cache.get_seq_length() == 20
    logits, taps = runner.forward(seq[20:])
    ref_logits, ref_taps = full_forward(model, seq, TAPS)
    torch.testing.assert_close(logits, ref_logits[20:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(taps, ref_taps[20:], atol=1e-4, rtol=1e-4)
    assert taps.shape == (6, 3 * COMMON["hidden_size"])
    runner.truncate(runner.length)  # a no-op rollback keeps everything
    assert runner.length == len(seq)
    with pytest.raises(ValueError):
        runner.truncate(runner.length + 1)
    runner.reset()
    last, taps = runner.forward(seq, last_only=True)  # the prefill's form: one row of logits, all taps
    torch.testing.assert_close(last, ref_logits[-1:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(taps, ref_taps, atol=1e-4, rtol=1e-4)


def test_target_max_len_stops_generation(llama):
    runner = TargetRunner(llama.model, max_len=PROMPT_LEN + 10)
    for prop, K in [(NoDraft(), 0), (OracleProposer(llama.ar), 4), (StubProposer(llama.ar, lambda j: j % 2, V), 3)]:
        res = SpecDecoder(runner, prop, K).generate(llama.prompt, N_NEW)
        assert res.tokens == llama.ar[:11]  # the cache holds all but the pending token: 10 + 1 new tokens
        assert runner.length == runner.max_len
    with pytest.raises(ValueError):
        runner.forward([1])


# ---------------------------------------------------------------------------------------- greedy equality
def proposers_for(s):
    always = lambda j: True  # noqa: E731
    never = lambda j: False  # noqa: E731
    sometimes = lambda j: j % 5 not in (2, 4)  # noqa: E731
    return {
        "oracle": OracleProposer(s.ar),
        "stub_always": StubProposer(s.ar, always, V),
        "stub_never": StubProposer(s.ar, never, V),
        "stub_sometimes": StubProposer(s.ar, sometimes, V),
        "prompt_lookup": PromptLookupProposer(max_ngram=3, min_ngram=1, num_tokens=8),
        "draft_model": DraftModelProposer(s.draft_model),
        # static shapes: the catch-up and the draft steps are one greedy_chain call
        "draft_model_static": DraftModelProposer(s.draft_model, max_len=256, static_shapes=True, buckets=(1, 4)),
        "eagle3": Eagle3ChainProposer(s.drafter, max_len=256),
    }


PROPOSERS = {"oracle": 5, "stub_always": 4, "stub_never": 2, "stub_sometimes": 1, "prompt_lookup": 4,
             "draft_model": 3, "draft_model_static": 3, "eagle3": 4}  # name -> K


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_greedy_equals_ar(setup, name):
    K = PROPOSERS[name]
    res = SpecDecoder(setup.runner, proposers_for(setup)[name], K).generate(setup.prompt, N_NEW)
    assert res.tokens == setup.ar, (name, K)
    # the target cache holds every committed token but the pending one: no stale entries
    assert setup.runner.length == setup.runner.cache.get_seq_length() == PROMPT_LEN + N_NEW - 1
    assert res.num_accepted <= res.num_drafted <= K * res.num_rounds


def test_greedy_chain_matches_step_by_step(setup):
    """TargetRunner.greedy_chain (feed n tokens, then k - 1 greedy steps in one call; padded with static
    shapes) drafts what step-by-step forwards draft, leaves the cache as they do, also with the argmax taken
    over a smaller vocabulary."""
    seq = setup.prompt + setup.ar[:3]
    ref = TargetRunner(setup.draft_model, max_len=128)
    for static in (False, True):
        runner = TargetRunner(setup.draft_model, max_len=128, static_shapes=static, buckets=(1, 4))
        for vocab in (V, V // 2):
            for r in (runner, ref):
                r.reset()
                r.forward(seq[:PROMPT_LEN])
            drafts = runner.greedy_chain(seq[PROMPT_LEN:], 4, vocab)  # 3 tokens: padded to bucket 4
            logits, _ = ref.forward(seq[PROMPT_LEN:])
            expect = [int(logits[-1, :vocab].argmax())]
            for _ in range(3):
                logits, _ = ref.forward([expect[-1]])
                expect.append(int(logits[-1, :vocab].argmax()))
            assert drafts.tolist() == expect, (static, vocab)
            assert runner.length == ref.length == PROMPT_LEN + 3 + 3
            for r in (runner, ref):  # reject the last two fed drafts; the cache must hold no stale rows
                r.truncate(PROMPT_LEN + 4)
            torch.testing.assert_close(runner.forward([5, 6])[0], ref.forward([5, 6])[0], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="overflow"):
        runner.greedy_chain([1], 200)


def test_no_draft_with_k_is_ar(setup):
    res = SpecDecoder(setup.runner, NoDraft(), 3).generate(setup.prompt, N_NEW)
    assert res.tokens == setup.ar and res.num_rounds == N_NEW - 1 and res.num_drafted == 0


def test_self_draft_model_accepts_everything(setup):
    """The target as its own draft model: greedy drafts are always right (checks the draft cache rollback)."""
    K = 3
    res = SpecDecoder(setup.runner, DraftModelProposer(setup.model), K).generate(setup.prompt, N_NEW)
    assert res.tokens == setup.ar
    assert res.num_rounds == math.ceil((N_NEW - 1) / (K + 1))
    assert res.num_accepted == res.num_drafted == N_NEW - 1 - res.num_rounds


# ------------------------------------------------------------------------------------------ tau and stats
def simulate(agree, n_new, K):
    """Expected round statistics of a proposer right exactly where ``agree(j)`` (output index j)."""
    g, rounds = 1, 0
    acc, reached, drafted = [0] * K, [0] * K, [0] * K
    while g < n_new:
        k = min(K, n_new - g - 1)
        a = 0
        while a < k and agree(g + a):
            a += 1
        for i in range(k):
            drafted[i] += 1
        for i in range(min(a + 1, k)):
            reached[i] += 1
        for i in range(a):
            acc[i] += 1
        g += a + 1
        rounds += 1
    return rounds, acc, reached, drafted


@pytest.mark.parametrize("pattern", ["always", "never", "sometimes", "oracle"])
def test_tau_and_per_position_counts(llama, pattern):
    setup = llama
    K = 4
    agree = {"always": lambda j: True, "never": lambda j: False, "oracle": lambda j: True,
             "sometimes": lambda j: j % 5 not in (2, 4)}[pattern]
    prop = OracleProposer(setup.ar) if pattern == "oracle" else StubProposer(setup.ar, agree, V)
    res = SpecDecoder(setup.runner, prop, K).generate(setup.prompt, N_NEW)
    rounds, acc, reached, drafted = simulate(agree, N_NEW, K)
    assert res.tokens == setup.ar
    assert res.num_rounds == rounds
    assert res.accepted_per_position == acc
    assert res.reached_per_position == reached
    assert res.drafted_per_position == drafted
    assert res.num_round_tokens == N_NEW - 1
    assert res.tau == pytest.approx((N_NEW - 1) / rounds)
    if pattern in ("always", "oracle"):
        # 39 = 7 full rounds of K + 1 = 5 tokens, then one round cut to 4 by max_new_tokens
        assert rounds == math.ceil((N_NEW - 1) / (K + 1)) == 8
        assert res.num_accepted == res.num_drafted
        agg = aggregate([res])
        assert agg["alpha"] == 1.0 and agg["acceptance_per_position"] == [1.0] * K
        # all full rounds commit K + 1 tokens
        assert (res.num_round_tokens - (N_NEW - 1 - (rounds - 1) * (K + 1))) / (rounds - 1) == K + 1
    if pattern == "never":
        assert res.tau == 1.0 and res.num_accepted == 0 and rounds == N_NEW - 1
        assert aggregate([res])["acceptance_per_position"][0] == 0.0


def test_aggregate(llama):
    setup = llama
    K = 3
    r1 = SpecDecoder(setup.runner, StubProposer(setup.ar, lambda j: j % 3 != 0, V), K).generate(setup.prompt, N_NEW)
    r2 = SpecDecoder(setup.runner, StubProposer(setup.ar, lambda j: j % 4 != 0, V), K).generate(setup.prompt, 25)
    agg = aggregate([r1, r2])
    assert agg["num_rounds"] == r1.num_rounds + r2.num_rounds
    assert agg["alpha"] == pytest.approx((r1.num_accepted + r2.num_accepted) / (r1.num_drafted + r2.num_drafted))
    assert agg["tau"] == pytest.approx((N_NEW - 1 + 24) / (r1.num_rounds + r2.num_rounds))
    for i in range(K):
        expect = (r1.accepted_per_position[i] + r2.accepted_per_position[i]) / (
            r1.reached_per_position[i] + r2.reached_per_position[i])
        assert agg["acceptance_per_position"][i] == pytest.approx(expect)
    assert 0 <= agg["time_target"] <= agg["time_total"] and agg["time_draft"] >= 0
    assert agg["tokens_per_s"] == pytest.approx((N_NEW + 25) / (r1.time_total + r2.time_total))
    assert agg["frac_target"] + agg["frac_draft"] + agg["frac_other"] == pytest.approx(1.0)


# ----------------------------------------------------------------------------------- stopping conditions
def test_eos_and_max_new_tokens(setup):
    j = next(i for i in range(5, N_NEW) if setup.ar[i] not in setup.ar[:i])  # first occurrence at j >= 5
    eos = setup.ar[j]
    for prop, K in [(NoDraft(), 0), (OracleProposer(setup.ar), 4),
                    (StubProposer(setup.ar, lambda i: i % 3 != 1, V), 3)]:
        res = SpecDecoder(setup.runner, prop, K).generate(setup.prompt, N_NEW, eos_token_id=eos)
        assert res.tokens == setup.ar[: j + 1]
        res = SpecDecoder(setup.runner, prop, K).generate(setup.prompt, N_NEW, eos_token_id=[1000, eos])
        assert res.tokens == setup.ar[: j + 1]
        for n in (1, 2, 7):
            res = SpecDecoder(setup.runner, prop, K).generate(setup.prompt, n)
            assert res.tokens == setup.ar[:n]
        assert SpecDecoder(setup.runner, prop, K).generate(setup.prompt, 0).tokens == []
    dec = SpecDecoder(setup.runner, OracleProposer(setup.ar), 4)
    first = dec.generate(setup.prompt, N_NEW, eos_token_id=setup.ar[0])
    assert first.tokens == setup.ar[:1] and first.num_rounds == 0


# ------------------------------------------------------------------------------- proposer state checks
class CheckedDraftModel(DraftModelProposer):
    """Before each proposal, checks that greedy drafts equal a fresh greedy continuation by the draft model."""

    def propose(self, tokens, k, sampling):
        drafts_out, q = super().propose(tokens, k, sampling)
        drafts = drafts_out.tolist() if torch.is_tensor(drafts_out) else list(drafts_out)
        logits, _ = full_forward(self.runner.model, list(tokens) + drafts[:-1])
        logits = logits[len(tokens) - 1 :]  # [len(drafts), V]: the draft model's logits before each draft
        if sampling.greedy:
            assert logits.argmax(-1).tolist() == drafts
        else:
            # q is exactly the processed distribution each draft was sampled from
            torch.testing.assert_close(q, sampling.process(logits), atol=1e-4, rtol=1e-4)
            assert bool((q[torch.arange(len(drafts)), torch.tensor(drafts)] > 0).all())
        assert self.runner.length == len(self._cached) + len(self._unsynced) == len(tokens) + len(drafts) - 1
        self.checks = getattr(self, "checks", 0) + 1
        return drafts_out, q


class CheckedEagle3(Eagle3ChainProposer):
    """Before each proposal, checks the drafter state against a fresh rebuild from the committed tokens."""

    target_model = None

    def propose(self, tokens, k, sampling):
        n = len(tokens) - 1  # positions held by the target cache
        assert self._n == n and self.cache.length == n
        _, taps = full_forward(self.target_model, list(tokens[:-1]), TAPS)
        fresh = self.drafter.new_cache(1, 256)
        hidden = self.drafter.fuse(taps.unsqueeze(0))
        logits, h = self.drafter.step(torch.tensor([tokens[1:]]), hidden, fresh)
        torch.testing.assert_close(self._next_logits, logits[0, -1], atol=2e-4, rtol=2e-4)
        drafts_out, q = super().propose(tokens, k, sampling)
        drafts = drafts_out.tolist() if torch.is_tensor(drafts_out) else list(drafts_out)
        # d_2 comes from (d_1, the drafter's own output hidden) at position n
        rows = [logits[0, -1]]
        if len(drafts) >= 2:
            rows.append(self.drafter.step(torch.tensor([[drafts[0]]]), h[:, -1:], fresh)[0][0, -1])
        z = self.drafter.logits_to_target(torch.stack(rows))  # [<=2, V]
        if sampling.greedy:
            assert z.argmax(-1).tolist() == drafts[:2]
        else:  # q is the processed distribution (in the target vocabulary) the drafts were sampled from
            torch.testing.assert_close(q[:2], sampling.process(z), atol=1e-4, rtol=1e-4)
        self.checks = getattr(self, "checks", 0) + 1
        return drafts_out, q


class OracleEagle3(nn.Module):
    """A stand-in with the EAGLE-3 drafter API that predicts perfectly (its logits come from the target run on
    the tokens it was fed) and checks how it is fed: positions in order, the fused target feature of position j
    in rebuilt entries, its own previous output hidden in draft steps."""

    class Cache:
        def __init__(self):
            self.tokens: list[int] = []

        @property
        def length(self) -> int:
            return len(self.tokens)

        def truncate(self, n: int) -> None:
            del self.tokens[n:]

    def __init__(self, target, first_prompt_token: int):
        super().__init__()
        self.target, self.x0, self.H = target, first_prompt_token, target.config.hidden_size
        self.dummy = nn.Parameter(torch.zeros(1))

    def new_cache(self, batch_size, max_len, device=None, dtype=None):
        return OracleEagle3.Cache()

    def fuse(self, taps):
        return taps[..., : self.H]  # hidden_states[TAPS[0]]

    def logits_to_target(self, logits):
        return logits

    def marker(self, pos: int):
        return torch.full((self.H,), 1000.0 + pos)

    def step(self, input_ids, hidden, cache, position_ids=None, attn_mask=None):
        n, L = input_ids.shape[1], cache.length
        assert position_ids[0].tolist() == list(range(L, L + n))
        cache.tokens.extend(input_ids[0].tolist())
        logits, taps = full_forward(self.target, [self.x0] + cache.tokens, TAPS)  # entry j holds x_{j+1}
        for i in range(n):
            if not torch.equal(hidden[0, i], self.marker(L + i - 1)):  # not a draft step: a target feature
                torch.testing.assert_close(hidden[0, i], taps[L + i, : self.H], atol=1e-4, rtol=1e-4)
        out_hidden = torch.stack([self.marker(L + i) for i in range(n)]).unsqueeze(0)
        return logits[L + 1 : L + n + 1].unsqueeze(0), out_hidden  # entry j predicts x_{j+2}


def test_eagle3_chain_with_perfect_drafter(setup):
    """A drafter that is always right: every draft is accepted iff the chain is fed and rolled back correctly."""
    K = 4
    prop = Eagle3ChainProposer(OracleEagle3(setup.model, setup.prompt[0]), max_len=256)
    res = SpecDecoder(setup.runner, prop, K).generate(setup.prompt, N_NEW)
    assert res.tokens == setup.ar
    assert res.num_rounds == math.ceil((N_NEW - 1) / (K + 1))
    assert res.num_accepted == res.num_drafted


def test_eagle3_chain_with_perfect_drafter_sampling(llama):
    """Under sampling the perfect drafter's q equals p (up to float noise): (almost) everything is accepted."""
    K = 4
    prop = Eagle3ChainProposer(OracleEagle3(llama.model, llama.prompt[0]), max_len=256)
    res = SpecDecoder(llama.runner, prop, K, temperature=1.0, seed=3).generate(llama.prompt, N_NEW)
    assert len(res.tokens) == N_NEW
    assert res.num_accepted >= res.num_drafted - 1 and res.num_rounds <= math.ceil((N_NEW - 1) / (K + 1)) + 1


def test_proposer_state_after_rollback(setup):
    _check_proposer_states(setup, temperature=0.0)


def test_proposer_state_after_rollback_sampling(llama):
    _check_proposer_states(llama, temperature=1.0)


def _check_proposer_states(setup, temperature):
    dm = CheckedDraftModel(setup.draft_model)
    eg = CheckedEagle3(setup.drafter, max_len=256)
    eg.target_model = setup.model
    for prop in (dm, eg):
        res = SpecDecoder(setup.runner, prop, 3, temperature=temperature, seed=4).generate(setup.prompt, 24)
        if temperature == 0:
            assert res.tokens == setup.ar[:24]
        assert res.num_rounds - 1 <= prop.checks <= res.num_rounds  # a last round cut to k = 0 drafts nothing
        # target cache: committed minus the pending token, and the incremental state equals a fresh one
        committed = setup.prompt + res.tokens
        assert setup.runner.length == setup.runner.cache.get_seq_length() == len(committed) - 1
        logits, _ = setup.runner.forward(committed[-1:])
        ref, _ = full_forward(setup.model, committed)
        torch.testing.assert_close(logits[0], ref[-1], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------- sampling (HF model)
def test_sampling_is_reproducible_and_self_draft_accepts(llama):
    setup = llama
    kw = dict(temperature=0.8, top_k=20, top_p=0.95)
    a = SpecDecoder(setup.runner, DraftModelProposer(setup.draft_model), 3, seed=7, **kw).generate(setup.prompt, 20)
    b = SpecDecoder(setup.runner, DraftModelProposer(setup.draft_model), 3, seed=7, **kw).generate(setup.prompt, 20)
    c = SpecDecoder(setup.runner, DraftModelProposer(setup.draft_model), 3, seed=8, **kw).generate(setup.prompt, 20)
    assert a.tokens == b.tokens and a.tokens != c.tokens and len(a.tokens) == 20
    # q == p (up to float noise) when the draft is the target: (almost) everything is accepted
    res = SpecDecoder(setup.runner, DraftModelProposer(setup.model), 3, seed=0, **kw).generate(setup.prompt, 20)
    assert res.num_accepted >= res.num_drafted - 1


# ----------------------------------------------------------------------------- prompt lookup (unit test)
def test_prompt_lookup_matching():
    pl = PromptLookupProposer(max_ngram=3, min_ngram=1, num_tokens=3)
    sp = None
    # last 3-gram (1, 2, 3) occurs at 0 and 4: the most recent one (followed by 7, 5, 1) wins
    assert pl.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 5, sp) == ([7, 5, 1], None)
    assert pl.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2, sp) == ([7, 5], None)
    # no 3-gram / 2-gram match: fall back to the 1-gram (4 ... 8)
    assert pl.propose([4, 8, 6, 0, 2, 4], 5, sp) == ([8, 6, 0], None)
    # the continuation may run up to the end of the context
    assert pl.propose([5, 6, 5], 3, sp) == ([6, 5], None)
    assert pl.propose([1, 2, 3], 3, sp) == ([], None)
    # a repetition loop: the most recent match is followed by one period only; the most recent one followed
    # by k tokens is taken instead
    assert pl.propose([9, 4, 5, 4, 5, 4, 5, 4, 5], 3, sp) == ([4, 5, 4], None)
    assert PromptLookupProposer(max_ngram=1, num_tokens=5).propose([7, 1, 2, 7, 3, 7], 5, sp) == ([1, 2, 7, 3, 7], None)
    assert PromptLookupProposer(max_ngram=2, min_ngram=2).propose([4, 8, 6, 0, 2, 4], 5, sp) == ([], None)


# ------------------------------------------------------------------- exact distribution (toy target, V=5)
class ToyLM(nn.Module):
    """A toy causal LM for exact distribution tests: the logits at position t are ``table[x_{t-1}, x_t]``.

    The token history is kept in an HF ``DynamicCache`` (tokens stored as one-dimensional "keys"), so it rolls
    back exactly like a real model's cache; its two "hidden states" are fixed random features of
    (x_{t-1}, x_t).
    """

    def __init__(self, vocab: int, seed: int, scale: float = 1.0, hidden: int = 4):
        super().__init__()
        self.config = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=1,
                                     num_key_value_heads=1, intermediate_size=4, max_position_embeddings=64)
        g = torch.Generator().manual_seed(seed)
        self.V = vocab
        self.table = nn.Parameter(torch.randn(vocab + 1, vocab, vocab, generator=g) * scale, requires_grad=False)
        self.emb = nn.Parameter(torch.randn(vocab + 1, vocab, hidden, generator=g), requires_grad=False)

    def forward(self, input_ids, position_ids=None, cache=None, use_cache=True, output_hidden_states=False, **kw):
        ids = input_ids[0]
        n = ids.shape[0]
        hist = cache.update(ids.float().view(1, 1, n, 1), ids.float().view(1, 1, n, 1), 0)[0][0, 0, :, 0].long() \
            if cache is not None else ids
        prev = torch.cat([hist.new_tensor([self.V]), hist])[hist.shape[0] - n : hist.shape[0]]
        hs = None
        if output_hidden_states:
            h = self.emb[prev, ids].unsqueeze(0)
            hs = (h, torch.tanh(h))
        return SimpleNamespace(logits=self.table[prev, ids].unsqueeze(0), hidden_states=hs)

    def dist(self, prev: int, cur: int, T, k, p):
        return process_logits(self.table[prev, cur].double(), T, k, p).double()


TOY_V = 5
TOY_PROMPT = [0, 1, 2, 3, 4, 0, 2, 4, 1, 3]  # every token occurs: prompt lookup always finds a 1-gram
TOY_NEW = 4  # prefill token y1, then a round with K = 2 (y2, y3, bonus y4) or more rounds


def toy_law(target: ToyLM, T, k, p) -> np.ndarray:
    """Exact P(y1..y4 | prompt) under the target's processed distribution, ``[V, V, V, V]``."""
    law = np.ones((1,))
    ctx = [(TOY_PROMPT[-2], TOY_PROMPT[-1])]  # (previous, current) token of each prefix, flattened
    for _ in range(TOY_NEW):
        step = np.stack([target.dist(a, b, T, k, p).numpy() for a, b in ctx])  # [prefixes, V]
        law = (law[:, None] * step).ravel()
        ctx = [(b, y) for a, b in ctx for y in range(TOY_V)]
    return law.reshape((TOY_V,) * TOY_NEW)


def toy_eagle3() -> Eagle3Drafter:
    cfg = Eagle3DrafterConfig(hidden_size=8, target_hidden_size=4, intermediate_size=16, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=4, vocab_size=TOY_V, draft_vocab_size=4,
                       tap_layers=[0, 1, 1], initializer_range=0.6)
    torch.manual_seed(3)
    # draft vocabulary {0, 1, 2, 4}: token 3 can never be drafted (q = 0 where p > 0)
    return Eagle3Drafter(cfg, d2t=torch.tensor([0, 0, 0, 1]), t2d=torch.tensor([1, 1, 1, 0, 1], dtype=torch.bool))


def _chi2(counts, law):
    counts, law = counts.ravel().astype(float), law.ravel() / law.sum()
    assert counts[law == 0].sum() == 0, "a sequence of probability 0 was generated"
    exp = law * counts.sum()
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if exp[~big].sum() > 0:  # pool the rare sequences
        obs_b.append(counts[~big].sum())
        exp_b.append(exp[~big].sum())
    exp_b = np.asarray(exp_b) * (sum(obs_b) / sum(exp_b))
    return float(stats.chisquare(obs_b, exp_b).pvalue)


def _toy_counts(proposer, T, k, p, n, seed, draft_temperature=None):
    """Generate ``n`` times TOY_NEW tokens; return the counts ``[V]*4``, the exact law and the acceptance rate."""
    target = ToyLM(TOY_V, seed=1)
    runner = TargetRunner(target, taps=(0, 1, 1))
    dec = SpecDecoder(runner, proposer, 2, temperature=T, top_k=k, top_p=p, seed=seed,
                      draft_temperature=draft_temperature)
    counts = np.zeros((TOY_V,) * TOY_NEW)
    drafted = accepted = 0
    for _ in range(n):
        res = dec.generate(TOY_PROMPT, TOY_NEW)
        counts[tuple(res.tokens)] += 1
        drafted, accepted = drafted + res.num_drafted, accepted + res.num_accepted
    return counts, toy_law(target, T, k, p), accepted / max(drafted, 1)


def _check_law(counts, law) -> list[float]:
    """χ² p-values of two exact marginals: the first three tokens (y1, y2, y3) and the last two (y3, y4)."""
    return [_chi2(counts.sum(3), law.sum(3)), _chi2(counts.sum((0, 1)), law.sum((0, 1)))]


TOY_N = 1000  # sequences per case
TOY_CASES = [
    ("draft_model", 1.0, 0, 1.0),
    ("draft_model", 0.7, 3, 1.0),
    ("draft_model", 1.0, 0, 0.8),
    ("prompt_lookup", 0.7, 0, 0.9),
    ("eagle3", 1.0, 4, 1.0),
]


def _toy_proposer(name):
    if name == "draft_model":
        return DraftModelProposer(ToyLM(TOY_V, seed=2))  # a deliberately different q
    if name == "prompt_lookup":
        return PromptLookupProposer(max_ngram=2, num_tokens=2)  # deterministic drafts: q one-hot
    return Eagle3ChainProposer(toy_eagle3(), max_len=32)


@pytest.mark.slow
@pytest.mark.parametrize("name,T,k,p", TOY_CASES)
def test_speculative_sampling_preserves_target_distribution(name, T, k, p):
    """The first 4 tokens (the prefill's token, then a K=2 round and whatever follows) are distributed exactly
    as the target's processed distribution: χ² against the exact law computed from the toy's table."""
    # the EAGLE-3 drafter is slower; its q is also checked exactly in test_proposer_state_after_rollback
    counts, law, alpha = _toy_counts(_toy_proposer(name), T, k, p, n=TOY_N if name != "eagle3" else 600, seed=100)
    assert 0.05 < alpha < 0.95  # drafts are neither always right nor always wrong: both paths are exercised
    assert min(_check_law(counts, law)) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name,T,k,p,dt", [
    ("draft_model", 1.0, 0, 1.0, 0.5),
    ("draft_model", 0.7, 0, 0.9, 0.0),  # argmax drafts (one-hot q) under a sampling target
    ("eagle3", 1.0, 4, 1.0, 0.6),
])
def test_draft_temperature_keeps_the_target_distribution(name, T, k, p, dt):
    """``decode.draft_temperature``: drafts sampled at another temperature than the target's are still
    verified against the q they came from, so the output law is the target's; the acceptance rate moves."""
    n = TOY_N if name != "eagle3" else 600
    counts, law, alpha = _toy_counts(_toy_proposer(name), T, k, p, n=n, seed=101, draft_temperature=dt)
    assert 0.05 < alpha < 0.95
    assert min(_check_law(counts, law)) > 1e-3
    _, _, alpha_same = _toy_counts(_toy_proposer(name), T, k, p, n=200, seed=101)
    assert abs(alpha - alpha_same) > 0.02  # the drafts really came from another distribution


@pytest.mark.slow
def test_distribution_check_has_power(monkeypatch):
    """Negative control: with a biased verifier (resample from p instead of the residual), the χ² fails."""

    def biased(d, q, p, g, **kw):
        a, _ = verify_chain_sampling(d, q, p, g)
        return a, int(torch.multinomial(p[a], 1, generator=g))

    monkeypatch.setattr(engine_mod, "verify_chain_sampling", biased)
    counts, law, _ = _toy_counts(_toy_proposer("draft_model"), 1.0, 0, 1.0, n=600, seed=100)
    assert min(_check_law(counts, law)) < 1e-4


# ------------------------------------------------------------------------------ static shapes, compiled
def test_static_shapes_mixed_sliding_and_full_layers():
    """A model mixing sliding-window and full-attention layers (Gemma-3 style): the padded static-shape path,
    whose chain mask is built inside the (compilable) forward per layer type, gives the uncached forward's
    logits past the window's edge (after a rollback) and decodes as uncached greedy."""
    torch.manual_seed(0)
    cfg = tf.Gemma3TextConfig(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=12, sliding_window=8,
                              layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                                           "full_attention"], max_position_embeddings=256, initializer_range=0.3)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    seq = torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref_logits, _ = full_forward(model, seq)
    runner = TargetRunner(model, max_len=128, static_shapes=True, buckets=(1, 4))
    assert runner.static_shapes and runner._mixed
    runner.forward(seq[:20])
    runner.forward([1, 2, 3])  # rejected drafts at 20..22, rolled back
    runner.truncate(20)
    steps = [runner.forward([t])[0] for t in seq[20:36]]  # bucket-1 steps, past the window of 8
    torch.testing.assert_close(torch.cat(steps), ref_logits[20:36], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(runner.forward(seq[36:39])[0], ref_logits[36:39], atol=1e-4, rtol=1e-4)  # padded
    prompt = seq[:PROMPT_LEN]
    ref = greedy_without_cache(model, prompt, 30)
    assert SpecDecoder(runner, NoDraft(), 0).generate(prompt, 30).tokens == ref
    res = SpecDecoder(runner, StubProposer(ref, lambda j: j % 3 != 1, V), 3).generate(prompt, 30)
    assert res.tokens == ref and res.num_rounds < 29


@pytest.mark.slow
def test_cpu_compiled_chain_path_matches_eager(llama):
    """static_shapes + compile on CPU: AR and a draft model of the *same shapes* as the target (each runner
    compiles its own copy of the forward, with guards on module structure skipped) decode exactly as eager,
    and every forward of the draft's runner returns its own model's logits."""
    target = TargetRunner(llama.model, max_len=128, static_shapes=True, compile=True, buckets=(1, 4), timing=False)
    assert target._compiled_chain is not None
    assert SpecDecoder(target, NoDraft(), 0).generate(llama.prompt, 24).tokens == llama.ar[:24]
    prop = DraftModelProposer(llama.draft_model, max_len=128, static_shapes=True, compile=True, buckets=(1, 4))
    res = SpecDecoder(target, prop, 3).generate(llama.prompt, 24)
    assert res.tokens == llama.ar[:24] and res.num_rounds < 23
    eager = TargetRunner(llama.draft_model, max_len=128)
    seq = llama.prompt + llama.ar[:9]
    for r in (prop.runner, eager):
        r.reset()
        r.forward(seq[:PROMPT_LEN])
    for i in range(PROMPT_LEN, len(seq)):  # bucket-1 steps
        torch.testing.assert_close(prop.runner.forward([seq[i]])[0], eager.forward([seq[i]])[0], atol=1e-4,
                                   rtol=1e-4)
    torch.testing.assert_close(prop.runner.forward(seq[-3:])[0], eager.forward(seq[-3:])[0], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_cpu_compiled_eagle3_chain_no_recompile_per_prompt_length(llama):
    """Compiled EAGLE-3 chain on CPU: greedy == AR, and once every shape has been met, a prompt of a new
    length compiles nothing (the rebuilt hidden state handed to the compiled step has the same strides
    whatever the prompt's length)."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (12, 20, 19)]
    ar = SpecDecoder(TargetRunner(llama.model, max_len=128), NoDraft(), 0)
    refs = [ar.generate(p, 16).tokens for p in prompts]
    runner = TargetRunner(llama.model, taps=TAPS, max_len=128, static_shapes=True, compile=True, buckets=(1, 4),
                          timing=False)
    dec = SpecDecoder(runner, Eagle3ChainProposer(llama.drafter, max_len=128, static_shapes=True, compile=True), 3)
    for p, ref in zip(prompts[:2], refs):
        assert dec.generate(p, 16).tokens == ref
    before = counters["stats"]["unique_graphs"]
    assert dec.generate(prompts[2], 16).tokens == refs[2]
    assert counters["stats"]["unique_graphs"] == before


def test_bucket_default_and_cache_length():
    """One bucket default (the configs' equals the runner's) and one KV-cache length rule."""
    from drafttrain import config
    from drafttrain.decoding.build import cache_length, decode_cache_length, static_options
    from drafttrain.decoding.target import DEFAULT_BUCKETS

    assert config.DEFAULT_BUCKETS == DEFAULT_BUCKETS
    assert config.DecodeConfig().buckets == config.BenchJob().decode.buckets == list(DEFAULT_BUCKETS)
    assert static_options(SimpleNamespace(static_shapes=True, buckets=[]), buckets=True)["buckets"] == DEFAULT_BUCKETS
    prompts = [[1] * 5, [2] * 9]
    assert cache_length(prompts, 20, 4) == 9 + 20 + 4 + 8 and cache_length([], 20, slack=1) == 21
    tree = config.TreeConfig(enabled=True, total_tokens=30)
    assert decode_cache_length(prompts, config.DecodeConfig(max_new_tokens=20, num_draft_tokens=4, tree=tree)) == 67
    assert decode_cache_length(prompts, config.DecodeConfig(max_new_tokens=20, num_draft_tokens=4)) == 41


def test_positions_after_an_accepted_stop_token_are_not_live(llama):
    """A round whose accepted drafts include a stop token ends the output there: the drafts past it are counted
    as vLLM counts them (reached, and accepted when the verifier accepts them) but not in the per-position
    acceptance the report gives, which would otherwise read them as rejections of a drafter that was right."""
    setup, K = llama, 4
    ar = setup.ar
    # rounds of an always-right chain start at output index 1, 6, 11, ...: a stop token at the second draft
    # position of a round leaves two positions of that round past it
    e = next(j for j in (7, 12, 17, 22, 27) if ar[j] not in ar[:j])
    stop = ar[e]
    prop = StubProposer(ar, lambda j: j <= e, V)  # right up to the stop token, wrong after it
    res = SpecDecoder(setup.runner, prop, K).generate(setup.prompt, N_NEW, eos_token_id=stop)
    assert res.tokens == ar[: e + 1]
    r = (e - 1) // (K + 1)  # the round holding the stop token, at position (e - 1) % (K + 1) == 1
    assert res.num_rounds == r + 1
    assert res.reached_per_position == [r + 1] * 3 + [r]  # the third position, past the stop, was reached ...
    assert res.accepted_per_position == [r + 1, r + 1, r, r]  # ... and rejected
    assert res.live_reached_per_position == [r + 1, r + 1, r, r]  # not live: the output had ended
    assert res.live_accepted_per_position == res.live_reached_per_position
    agg = aggregate([res])
    assert agg["acceptance_per_position"] == [1.0] * K
    assert agg["live_reached_per_position"] == res.live_reached_per_position
    # a drafter right past the stop token too (the target's continuation of the ended text): the verifier
    # accepts those drafts, as vLLM counts them, and the live counts are the same as above
    res2 = SpecDecoder(setup.runner, OracleProposer(ar), K).generate(setup.prompt, N_NEW, eos_token_id=stop)
    assert res2.tokens == res.tokens and res2.accepted_per_position == [r + 1] * K
    assert res2.live_reached_per_position == res.live_reached_per_position
    assert aggregate([res2])["acceptance_per_position"] == [1.0] * K
