"""The run's figures are ones a user can show: integer ticks, a legend on every plotted line, the prediction beside
the measurement and the sample size (prompts, new tokens, passes) on each (drafttrain/evaluation/report.py,
evalsets.py, batch_sweep.py)."""
from __future__ import annotations

import math

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from drafttrain.evaluation.batch_sweep import batch_sweep_figure, plot_batch_sweep  # noqa: E402
from drafttrain.evaluation.evalsets import categories_figure, plot_categories  # noqa: E402
from drafttrain.evaluation.report import (acceptance_figure, chain_prediction, draft_cost_ratio,  # noqa: E402
                                          plot_acceptance, plot_speedup, sample_size, speedup_figure)

SWEEP = [(1, 1.6, 1.25), (2, 2.0, 1.45), (4, 2.35, 1.6), (8, 2.5, 1.4)]


def report(**kw) -> dict:
    rep = {"method": "eagle3", "tau": 2.41, "speedup": 1.62, "prompts": 8, "new_tokens": 1024, "repeats": 3,
           "num_draft_tokens": 4, "temperature": 0.0, "verification": "greedy (lossless)", "draft_shape": "chain K=4",
           "acceptance_per_position": [0.72, 0.61, None, 0.5], "acceptance_unit": "position",
           "time_target_s": 10.0, "time_draft_s": 4.0,
           "sweep": [{"draft_tokens": k, "prompts": 4, "new_tokens": 512, "tau": t, "speedup": s} for k, t, s in SWEEP]}
    rep.update(kw)
    return rep


def tick_labels(ax) -> list[str]:
    return [t.get_text() for t in ax.get_xticklabels()]


def lines(ax) -> dict[str, object]:
    """Every plotted line of an axis by its label; a line without a label fails (the legend would not name it)."""
    out = {}
    for ln in ax.get_lines():
        assert not ln.get_label().startswith("_"), f"an unlabelled line in {ax.get_title()!r}"
        out[ln.get_label()] = ln
    return out


def legend_texts(ax) -> list[str]:
    leg = ax.get_legend()
    assert leg is not None, f"no legend on {ax.get_title()!r}"
    return [t.get_text() for t in leg.get_texts()]


def test_draft_cost_and_the_chain_prediction():
    rep = report()
    assert draft_cost_ratio(rep) == pytest.approx(4.0 / (4 * 10.0))  # draft s per token / target s per forward
    assert chain_prediction(2.0, 4, 0.1) == pytest.approx(2.0 / 1.4)
    assert chain_prediction(2.0, 4, 0.0) == 2.0  # free drafts: the speedup is tau
    assert draft_cost_ratio(report(num_draft_tokens=0)) is None  # AR has no drafter
    assert draft_cost_ratio(report(time_target_s=None)) is None and chain_prediction(None, 4, 0.1) is None
    assert sample_size(rep) == "8 prompts x 128 new tokens (avg), 3 timed passes"
    assert sample_size(report(prompts=1, new_tokens=24, repeats=1)) == "1 prompt x 24 new tokens (avg), 1 timed pass"


def test_acceptance_figure_integer_positions_legend_and_sample():
    fig = acceptance_figure(report())
    (ax,) = fig.axes
    assert tick_labels(ax) == ["1", "2", "3", "4"]
    assert [t for t in ax.get_xticks()] == [1, 2, 3, 4]
    got = legend_texts(ax)
    assert "P(accepted | reached), measured" in got and "P(draft positions 1..i all accepted)" in got
    reach = lines(ax)["P(draft positions 1..i all accepted)"].get_ydata()
    assert list(reach) == pytest.approx([0.72, 0.72 * 0.61, 0.0, 0.0])  # never reached: nothing beyond it
    title = ax.get_title()
    assert "8 prompts x 128 new tokens (avg), 3 timed passes" in title and "chain K=4" in title and "τ=2.41" in title
    plt.close(fig)
    fig = acceptance_figure(report(acceptance_unit="depth"))
    assert fig.axes[0].get_xlabel() == "tree depth" and "P(tree depths 1..i all accepted)" in legend_texts(fig.axes[0])
    plt.close(fig)


def test_speedup_figure_one_scale_per_axis_prediction_beside_measurement():
    rep = report()
    fig = speedup_figure(rep)
    assert len(fig.axes) == 2  # speedup above, tau below: no twin axis sharing one panel
    top, bottom = fig.axes
    assert top.get_shared_x_axes().joined(top, bottom)
    assert tick_labels(bottom) == ["1", "2", "4", "8"]
    got = lines(top)
    c = draft_cost_ratio(rep)
    pred = got[f"predicted τ/(1+K·c), c={c:.3f}"].get_ydata()
    assert list(pred) == pytest.approx([t / (1 + k * c) for k, t, _ in SWEEP])
    assert list(got["measured speedup vs AR"].get_ydata()) == [s for *_, s in SWEEP]
    assert list(got["AR (1x)"].get_ydata()) == [1.0, 1.0]
    assert list(lines(bottom)["τ measured (tokens per target forward)"].get_ydata()) == [t for _, t, _ in SWEEP]
    for ax in fig.axes:
        assert set(legend_texts(ax)) == set(lines(ax))  # every line named in its panel's legend
    assert "sweep: 4 prompts x 128 new tokens (avg), 1 pass per length" in top.get_title()
    assert "at K=4" in top.get_title()
    plt.close(fig)
    # the report's own prediction (build_report writes it) is what is drawn
    rep["sweep"][0]["predicted_speedup"] = 9.0
    fig = speedup_figure(rep)
    assert lines(fig.axes[0])[f"predicted τ/(1+K·c), c={c:.3f}"].get_ydata()[0] == 9.0
    plt.close(fig)
    # no timings (an old report): the measurement alone, still labelled
    fig = speedup_figure(report(time_draft_s=None, sweep=[{"draft_tokens": 2, "prompts": 1, "tau": 1.5, "speedup": 1.1}]))
    assert set(lines(fig.axes[0])) == {"measured speedup vs AR", "AR (1x)"}
    assert "sweep: 1 prompt, 1 pass per length" in fig.axes[0].get_title()
    plt.close(fig)


def test_categories_figure_counts_legend_and_sample():
    rows = [{"category": c, "questions": 10, "prompts": 20, "tau": t, "speedup": s, "decode": "eagle3, chain K=4"}
            for c, t, s in [("writing", 2.1, 1.4), ("coding", 2.9, 1.9)]]
    fig = categories_figure(report(prompts=40, new_tokens=40 * 64, repeats=1, categories=rows,
                                   eval_set={"set": "spec_bench"}))
    (ax,) = fig.axes
    assert tick_labels(ax) == ["writing (20)", "coding (20)", "total (40)"]
    assert legend_texts(ax) == ["τ per category (its prompts)", "all categories pooled", "on each bar: speedup vs AR"]
    assert [t.get_text() for t in ax.texts] == ["1.40x", "1.90x", "1.62x"]
    assert "40 prompts (20 questions) x 64 new tokens (avg), 1 timed pass" in ax.get_title()
    assert "eagle3, chain K=4" in ax.get_title()
    plt.close(fig)


def test_batch_sweep_figure_integer_batches_legend_and_sample():
    sweep = {"method": "eagle3", "num_draft_tokens": 3, "temperature": 0.0, "num_prompts": 16, "max_new_tokens": 128,
             "repeats": 2, "expected_tau": 2.3, "crossover": 8, "batch_sizes": [1, 2, 4, 8],
             "rows": [{"batch_size": b, "speedup": s, "decode_speedup": None, "predicted_speedup": p}
                      for b, s, p in [(1, 1.6, 1.8), (2, 1.5, 1.7), (4, 1.1, 1.2), (8, 0.8, 0.85)]]}
    fig = batch_sweep_figure(sweep)
    (ax,) = fig.axes
    assert tick_labels(ax) == ["1", "2", "4", "8"] and len(ax.get_xticks(minor=True)) == 0
    got = lines(ax)
    pred = next(k for k in got if k.startswith("predicted"))
    assert list(got[pred].get_ydata()) == [1.8, 1.7, 1.2, 0.85] and "2.30" in pred
    assert {"measured, end to end", "AR at the same B (1x)", "crossover B=8"} <= set(got)
    assert set(legend_texts(ax)) == set(got)
    assert "16 prompts x up to 128 new tokens, 2 timed passes per B" in ax.get_title()
    plt.close(fig)


def test_plots_write_pngs(tmp_path):
    rep = report(categories=[{"category": "x", "questions": 1, "prompts": 8, "tau": 2.0, "speedup": 1.2,
                              "decode": "d"}])
    plot_acceptance(rep, tmp_path / "a.png")
    plot_speedup(rep, tmp_path / "s.png")
    plot_categories(rep, tmp_path / "c.png")
    plot_batch_sweep({"method": "pld", "num_draft_tokens": 2, "temperature": 0.0, "num_prompts": 2,
                      "max_new_tokens": 8, "expected_tau": 1.5, "crossover": None, "batch_sizes": [1, 2],
                      "rows": [{"batch_size": 1, "speedup": 1.2, "predicted_speedup": 1.3},
                               {"batch_size": 2, "speedup": math.nan, "predicted_speedup": 1.1}]}, tmp_path / "b.png")
    for name in ("a", "s", "c", "b"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.get_fignums()  # every figure closed
