"""Unit and statistical tests of drafttrain.decoding.sampling (pure tensor functions, CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from drafttrain.decoding.sampling import (
    SamplingParams,
    process_logits,
    recursive_reject,
    sample,
    verify_chain_greedy,
    verify_chain_sampling,
)

P_MIN = 1e-3  # χ² / binomial acceptance threshold; seeds are fixed, so the outcome is deterministic


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add overhead


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """χ² goodness of fit of ``counts`` to ``probs``; cells with small expectation are pooled.

    Outcomes of probability exactly 0 must never occur (asserted).
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    assert abs(probs.sum() - 1) < 1e-5
    probs = probs / probs.sum()
    assert counts[probs == 0].sum() == 0, "an outcome of probability 0 occurred"
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs, exp = list(counts[big]), list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    exp = np.asarray(exp) * (sum(obs) / sum(exp))  # remove rounding so scipy's sum check passes
    return float(stats.chisquare(obs, exp).pvalue)


# ------------------------------------------------------------------------------------- process_logits
def test_greedy_is_one_hot_first_max():
    logits = torch.tensor([[0.0, 3.0, 3.0, -1.0], [5.0, 1.0, 2.0, 2.0]])
    probs = process_logits(logits, temperature=0.0, top_k=2, top_p=0.5)
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert probs.dtype == torch.float32


def test_temperature_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, generator=g)
    for T in (0.5, 1.0, 2.0):
        torch.testing.assert_close(process_logits(logits, T), torch.softmax(logits / T, -1))


def test_top_k_keeps_k_largest_and_ties():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    probs = process_logits(logits, 1.0, top_k=2)
    expected = torch.tensor([0.0, 0.0, 1.0, np.e]) / (1 + np.e)
    torch.testing.assert_close(probs, expected.float())
    # a tie with the k-th value is kept (as HF's TopKLogitsWarper does)
    tied = process_logits(torch.tensor([1.0, 3.0, 3.0, 4.0]), 1.0, top_k=2)
    assert (tied > 0).tolist() == [False, True, True, True]


def test_top_p_smallest_set_reaching_mass():
    base = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = base.log()
    # sorted: 0.5, 0.3, 0.15, 0.05 -> 0.5 < 0.75 <= 0.8: keep {0.5, 0.3}
    torch.testing.assert_close(process_logits(logits, 1.0, top_p=0.75), torch.tensor([0.0, 0.625, 0.0, 0.375]))
    # 0.8 < 0.9 <= 0.95: keep three
    torch.testing.assert_close(process_logits(logits, 1.0, top_p=0.9), torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95)
    # tiny top_p still keeps the most probable token
    torch.testing.assert_close(process_logits(logits, 1.0, top_p=1e-4), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    # top-p runs on the top-k-renormalised distribution: top-2 -> (0.625, 0.375); top_p 0.6 keeps one
    torch.testing.assert_close(process_logits(logits, 1.0, top_k=2, top_p=0.6), torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_matches_hf_logits_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 50, generator=g) * 2
    for T, k, p in [(0.7, 0, 1.0), (1.0, 10, 1.0), (1.0, 0, 0.8), (0.8, 20, 0.9), (1.3, 5, 0.5)]:
        x = TemperatureLogitsWarper(T)(None, logits.clone())
        if k:
            x = TopKLogitsWarper(k)(None, x)
        if p < 1:
            x = TopPLogitsWarper(p)(None, x)
        torch.testing.assert_close(process_logits(logits, T, k, p), torch.softmax(x, -1), atol=1e-6, rtol=1e-5)


def test_neg_inf_logits_get_zero_probability():
    logits = torch.tensor([float("-inf"), 0.5, float("-inf"), 1.0, 0.0])
    for k, p in [(0, 1.0), (2, 1.0), (0, 0.7), (4, 0.95)]:
        probs = process_logits(logits, 0.9, k, p)
        assert probs[0] == 0 and probs[2] == 0
        assert abs(float(probs.sum()) - 1) < 1e-6


def test_sampling_params_process():
    logits = torch.tensor([0.1, 2.0, -1.0])
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    torch.testing.assert_close(SamplingParams(0.5, 2, 0.9).process(logits), process_logits(logits, 0.5, 2, 0.9))


# ----------------------------------------------------------------------------------------------- sample
def test_sample_distribution_and_reproducibility():
    p = torch.tensor([0.1, 0.0, 0.45, 0.05, 0.4])
    g = torch.Generator().manual_seed(3)
    draws = sample(p.expand(20000, 5), g)  # one draw per row
    assert draws.shape == (20000,)
    assert chi2_pvalue(np.bincount(draws.numpy(), minlength=5), p.numpy()) > P_MIN
    a = sample(p.expand(50, 5), torch.Generator().manual_seed(7))
    b = sample(p.expand(50, 5), torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_sample_detects_wrong_distribution():
    # power check of the χ² helper: draws from p do not fit a slightly different q
    p = torch.tensor([0.3, 0.3, 0.4])
    draws = sample(p.expand(20000, 3), torch.Generator().manual_seed(0))
    assert chi2_pvalue(np.bincount(draws.numpy(), minlength=3), [0.33, 0.3, 0.37]) < 1e-6


# ----------------------------------------------------------------------------------- greedy verification
def test_verify_chain_greedy():
    V = 6
    target_argmax = [3, 1, 4, 1]  # row i: argmax after the i-th input

    logits = torch.full((4, V), -1.0)
    logits[torch.arange(4), torch.tensor(target_argmax)] = 2.0
    assert verify_chain_greedy([3, 1, 4], logits) == (3, 1)  # all accepted + bonus
    assert verify_chain_greedy([3, 2, 4], logits) == (1, 1)  # mismatch at position 2: correction 1
    assert verify_chain_greedy(torch.tensor([0, 1, 4]), logits) == (0, 3)
    assert verify_chain_greedy([], logits[:1]) == (0, 3)  # K = 0 is plain greedy decoding


# ---------------------------------------------------------------------------------- sampling verification
def _random_dist(g, shape, zero_frac=0.3):
    x = torch.rand(shape, generator=g) ** 2
    x = x * (torch.rand(shape, generator=g) > zero_frac)
    x[..., 0] += 0.05  # keep every row non-empty
    return x / x.sum(-1, keepdim=True)


def _exact_chain_law(p: torch.Tensor, q: torch.Tensor) -> dict:
    """The law of Leviathan's rule computed in closed form (double precision)."""
    p, q = p.double(), q.double()
    beta = torch.minimum(p[:-1], q).sum(-1)  # P(accept d_i | reached), d_i ~ q_i
    resid = (p[:-1] - q).clamp_min(0)
    resid = resid / resid.sum(-1, keepdim=True)
    # first emitted token: accepted d_1 (prob min(p, q)(x)) or the residual after rejecting d_1
    first = torch.minimum(p[0], q[0]) + (1 - beta[0]) * resid[0]
    return {"beta": beta, "resid": resid, "first": first}


def test_chain_law_in_closed_form_is_p():
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        p, q = _random_dist(g, (3, 7)), _random_dist(g, (2, 7))
        law = _exact_chain_law(p, q)
        torch.testing.assert_close(law["first"], p[0].double())
        torch.testing.assert_close(law["beta"], 1 - 0.5 * (p[:2].double() - q.double()).abs().sum(-1))  # 1 - TVD


def _run_chain(p, q, n, seed, verify=verify_chain_sampling):
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T  # [n, K], row j: d_i ~ q_i
    out = []
    for d in drafts:
        a, b = verify(d, q, p, g)
        out.append((a, d[:a].tolist() + [b], int(d[0])))
    return out


@pytest.fixture(scope="module")
def chain_case():
    V = 5
    p = torch.tensor([[0.10, 0.40, 0.00, 0.30, 0.20], [0.25, 0.05, 0.50, 0.20, 0.00], [0.6, 0.1, 0.1, 0.1, 0.1]])
    q = torch.tensor([[0.40, 0.10, 0.30, 0.10, 0.10], [0.10, 0.30, 0.10, 0.10, 0.40]])
    runs = _run_chain(p, q, 12000, seed=11)
    return V, p, q, runs


def test_verify_chain_sampling_first_token_is_p(chain_case):
    V, p, q, runs = chain_case
    first = np.bincount([emitted[0] for _, emitted, _ in runs], minlength=V)
    assert chi2_pvalue(first, p[0].numpy()) > P_MIN
    # and not the draft's distribution: the check has power
    assert chi2_pvalue(first, (0.999 * q[0] + 0.001 / V).numpy()) < 1e-6


def test_verify_chain_sampling_acceptance_rates_and_residual(chain_case):
    V, p, q, runs = chain_case
    law = _exact_chain_law(p, q)
    a = np.array([r[0] for r in runs])
    n1 = int((a >= 1).sum())
    assert stats.binomtest(n1, len(a), float(law["beta"][0])).pvalue > P_MIN
    assert stats.binomtest(int((a == 2).sum()), n1, float(law["beta"][1])).pvalue > P_MIN
    # after rejecting d_1, the token comes from normalise(max(p_1 - q_1, 0))
    resid_tok = np.bincount([em[0] for ai, em, _ in runs if ai == 0], minlength=V)
    assert chi2_pvalue(resid_tok, law["resid"][0].numpy()) > P_MIN
    # a rejected draft is never re-emitted when p < q at it (the residual is 0 there)
    assert all(em[0] != d1 for ai, em, d1 in runs if ai == 0)


def test_verify_chain_sampling_later_tokens_are_p(chain_case):
    V, p, q, runs = chain_case
    second = np.bincount([em[1] for ai, em, _ in runs if ai >= 1], minlength=V)
    assert chi2_pvalue(second, p[1].numpy()) > P_MIN
    bonus = np.bincount([em[2] for ai, em, _ in runs if ai == 2], minlength=V)
    assert chi2_pvalue(bonus, p[2].numpy()) > P_MIN


def test_broken_rule_is_detected(chain_case):
    """Negative control: resampling from p (instead of the residual) after a rejection is biased."""
    V, p, q, _ = chain_case

    def broken(d, q_, p_, g):
        a, _ = verify_chain_sampling(d, q_, p_, g)
        return a, int(torch.multinomial(p_[a], 1, generator=g))

    runs = _run_chain(p, q, 2000, seed=12, verify=broken)
    first = np.bincount([em[0] for _, em, _ in runs], minlength=V)
    assert chi2_pvalue(first, p[0].numpy()) < 1e-6


def test_verify_chain_sampling_edge_cases():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.2, 0.3, 0.5, 0.0], [0.1, 0.1, 0.1, 0.7], [0.25, 0.25, 0.25, 0.25]])
    # q == p: every draft is accepted
    for _ in range(200):
        d = [int(torch.multinomial(p[i], 1, generator=g)) for i in range(2)]
        assert verify_chain_sampling(d, p[:2], p, g)[0] == 2
    # a one-hot draft where p = 0 is always rejected, and the correction is drawn from p
    q = torch.nn.functional.one_hot(torch.tensor([3, 3]), 4).float()
    toks = [verify_chain_sampling([3, 3], q, p, g) for _ in range(300)]
    assert all(a == 0 and t != 3 for a, t in toks)
    # a one-hot target (greedy) emits its argmax, whatever the draft
    p1 = torch.nn.functional.one_hot(torch.tensor([2, 0, 1]), 4).float()
    for _ in range(100):
        d = [int(torch.multinomial(p[0], 1, generator=g)), int(torch.multinomial(p[0], 1, generator=g))]
        a, t = verify_chain_sampling(d, p[:2], p1, g)
        assert d[:a] + [t] == [2, 0, 1][: a + 1]
    # K = 0: a plain draw from p
    assert verify_chain_sampling([], torch.zeros(0, 4), p[1:2], g)[0] == 0


# -------------------------------------------------------------------------------------- recursive_reject
def test_recursive_reject_preserves_p():
    V = 6
    p = torch.tensor([0.05, 0.30, 0.25, 0.0, 0.15, 0.25])
    cands = [2, 1, 2, 3]  # a duplicate and a zero-probability candidate
    g = torch.Generator().manual_seed(21)
    res = [recursive_reject(cands, p, g) for _ in range(8000)]
    toks = np.bincount([t for _, t in res], minlength=V)
    assert chi2_pvalue(toks, p.numpy()) > P_MIN
    # exact index law: candidate i (first occurrence) is accepted w.p. p(c_i); duplicates and p = 0 never
    idx = np.bincount([i + 1 for i, _ in res], minlength=len(cands) + 1)  # slot 0 = residual (-1)
    law = [1 - 0.25 - 0.30, 0.25, 0.30, 0.0, 0.0]
    assert chi2_pvalue(idx, law) > P_MIN
    assert all(cands[i] == t for i, t in res if i >= 0)
    # the residual never returns a rejected candidate
    assert all(t not in (1, 2, 3) for i, t in res if i < 0)
