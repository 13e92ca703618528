"""decode.batch_sizes: speedup against batch size, measured beside its prediction (drafttrain/evaluation/batch_sweep.py)."""
from __future__ import annotations

import math

import pytest

from drafttrain.evaluation.batch_sweep import (expected_tau, expected_tau_from_counts, format_table, predicted_speedup,
                                    target_costs, verify_width_law)
from drafttrain.io import DraftTrainError

from .test_batched_decoding import build

pytestmark = pytest.mark.usefixtures("one_thread")


def test_expected_tau_and_predicted_speedup():
    assert expected_tau([1.0, 1.0, 1.0], 3) == 4.0  # always right: K + 1
    assert expected_tau([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tau([0.8, None, 0.9], 3) == pytest.approx(1.8)  # never reached: never accepted
    assert expected_tau([0.8, 0.5, 0.9], 2) == pytest.approx(1 + 0.8 + 0.4)  # only K positions count
    # counts: 10 rounds, position 1 accepted in 8, position 2 in 4 = the chain formula with 0.8, 0.5
    assert expected_tau_from_counts([8, 4], 10) == pytest.approx(expected_tau([0.8, 0.5], 2))
    # 5 of the 10 rounds drafted nothing (prompt lookup, no match): the conditional rate 0.8 alone overstates
    assert expected_tau_from_counts([4], 10) == pytest.approx(1.4) and expected_tau([0.8], 1) == pytest.approx(1.8)
    # a verify of K + 1 tokens as cheap as one token and free drafts: the speedup is tau
    assert predicted_speedup(2.5, 0.01, 0.01, 0.0) == pytest.approx(2.5)
    # compute-bound: the verify costs as much as tau single-token forwards: no gain
    assert predicted_speedup(2.5, 0.01, 0.025, 0.0) == pytest.approx(1.0)
    assert predicted_speedup(2.5, 0.01, 0.02, 0.005) == pytest.approx(1.0)


def test_verify_width_law():
    """A round's verify is as wide as its longest row: from the batch-1 draft lengths, for B rows."""
    assert verify_width_law([10, 10, 10], 10, 1) == [0.0, 0.0, 0.0, 1.0]  # always drafts K = 3: width 4
    assert verify_width_law([10, 10, 10], 10, 8) == [0.0, 0.0, 0.0, 1.0]
    # drafts K in half the rounds, nothing otherwise (prompt lookup without a match)
    assert verify_width_law([5, 5, 5], 10, 1) == pytest.approx([0.5, 0.0, 0.0, 0.5])
    assert verify_width_law([5, 5, 5], 10, 2) == pytest.approx([0.25, 0.0, 0.0, 0.75])  # one of two rows drafts
    law = verify_width_law([8, 6, 2], 10, 4)
    assert sum(law) == pytest.approx(1.0) and all(p >= 0 for p in law)
    assert law[0] == pytest.approx(0.2 ** 4) and law[3] == pytest.approx(1 - 0.8 ** 4)


def test_target_costs_cover_every_shape_and_grow_with_the_tokens():
    s = build("llama")
    costs = target_costs(s.model, (1, 8), (1, 256), context=20, reps=3)
    assert set(costs) == {(1, 1), (1, 256), (8, 1), (8, 256)}
    assert all(c > 0 for c in costs.values())
    # 2048 new tokens cost more than one. On this tiny model a forward of 128 tokens costs about what one
    # does (per-call overhead), so a burst of load flipped that comparison in CI; 2048 tokens measure ~15x
    # one token here, so a 3x margin holds under load and still fails if the shapes' timings are mixed up.
    assert costs[8, 256] > 3 * costs[1, 1]
    assert costs[8, 256] > costs[1, 256] and costs[8, 256] > costs[8, 1]


def _decode(**kw):
    from drafttrain.config import DecodeConfig

    return DecodeConfig(method="pld", num_draft_tokens=3, max_new_tokens=10, warmup=0, sweep_prompts=0, plot=True,
                        **kw)


def test_eval_batch_sizes_measures_every_size_beside_its_prediction(tmp_path):
    """``decode.batch_sizes=[1,2,4]`` on 4 prompts: one row per size with AR and speculative tokens/s, the
    speedup, the prediction and its error; greedy outputs equal AR at every size, so tau is the batch-1 tau;
    the batch-1 decoder's row beside; the crossover follows the rows; the table and the plot are written."""
    import json

    from drafttrain.decoding.build import make_proposer
    from drafttrain.evaluation import evaluate

    s = build("llama")
    prompts = [p * 2 for p in s.prompts]  # repeats: prompt lookup finds matches
    decode = _decode(batch_sizes=[4, 1, 2])
    prop = make_proposer("pld", decode=decode, max_len=160)
    rep = evaluate(s.model, None, prompts, prop, decode, tmp_path, method="pld", target_name="tiny",
                   drafter_name=None)
    sw = rep["batch_sweep"]
    assert sw["batch_sizes"] == [1, 2, 4] and [r["batch_size"] for r in sw["rows"]] == [1, 2, 4]
    one = sw["batch1_decoder"]
    assert one["path"] == "batch-1 decoder" and one["outputs_match_ar"]
    for r in sw["rows"]:
        assert r["outputs_match_ar"] and r["tau"] == one["tau"] and r["new_tokens"] == one["new_tokens"]
        assert r["ar_tokens_per_s"] > 0 and r["spec_tokens_per_s"] > 0
        assert r["speedup"] == pytest.approx(r["spec_tokens_per_s"] / r["ar_tokens_per_s"])
        assert r["predicted_speedup"] > 0 and math.isfinite(r["prediction_error"])
        assert r["target_s_verify"] > 0 and r["draft_s_per_round"] >= 0
        assert r["continuous_batching"] and 1 <= r["mean_rows_per_round"] <= r["batch_size"]
        assert sum(r["verify_width_law"]) == pytest.approx(1.0)
        assert r["ar_decode_tokens_per_s"] > r["ar_tokens_per_s"] and 0 < r["ar_prefill_share"] < 1
        assert r["decode_speedup"] == pytest.approx(r["spec_decode_tokens_per_s"] / r["ar_decode_tokens_per_s"])
        assert r["decode_prediction_error"] == pytest.approx(r["decode_speedup"] / r["predicted_speedup"] - 1)
        assert min(r["target_s_ar"], r["target_s_verify"]) <= r["target_s_verify_expected"] <= \
            max(r["target_s_ar"], r["target_s_verify"]) * 1.5  # between a one-token and a K+1 forward (noise)
    fw = {r["batch_size"]: r["spec_target_forwards"] for r in sw["rows"]}
    assert fw[4] < fw[2] < fw[1]  # each size really decoded B rows per forward
    assert sw["expected_tau"] == pytest.approx(one["tau"])  # greedy: the counts give the measured batch-1 tau
    below = [r["batch_size"] for r in sw["rows"] if r["speedup"] < 1]
    assert sw["crossover"] == (below[0] if below else None)
    assert sw["rows"][0]["ar_vs_batch1"] == 1.0 and sw["rows"][0]["forward_vs_batch1"] == 1.0
    assert sw["rows"][0]["ar_decode_vs_batch1"] == 1.0
    assert sw["rows"][2]["forward_vs_batch1"] == pytest.approx(
        4 * sw["rows"][0]["target_s_ar"] / sw["rows"][2]["target_s_ar"])
    assert 1 < one["tau"] <= 4  # prompt lookup accepts drafts here, or the rows prove little
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["batch_sweep"]["rows"][2]["batch_size"] == 4
    assert format_table(saved["batch_sweep"]) == format_table(sw)  # the table reads a saved report too
    assert (tmp_path / "batch_speedup.png").stat().st_size > 0
    table = format_table(sw)
    assert "crossover" in table and table.count("\n| ") == 4 + 1  # the header row, batch-1 decoder, 3 sizes


def test_eval_batch_sizes_refuses_more_rows_than_prompts():
    from drafttrain.decoding.build import make_proposer
    from drafttrain.evaluation import evaluate

    s = build("llama")
    decode = _decode(batch_sizes=[1, 8])
    with pytest.raises(DraftTrainError, match=r"largest batch \(8\) needs at least as many prompts; there are 4"):
        evaluate(s.model, None, s.prompts, make_proposer("pld", decode=decode, max_len=160), decode, None,
                 method="pld", target_name="tiny", drafter_name=None)
