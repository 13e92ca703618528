#!/usr/bin/env python
"""Training-quality protocol: τ and α per position against the training budget, per drafter family.

    DRAFTTRAIN_CACHE=/tmp/dtcache python scripts/lab/quality_protocol.py --budgets 50,100,200,400 \
        --methods eagle3,eagle3_v30,medusa1 --targets builtin,builtin-docs --out bench/notebook/training_quality.md

For every (target, seed, budget) a run of ``scripts/compare.py`` over the methods (same data, prompts, decoder
settings; greedy, chain, K draft tokens), then one table per run (τ, α@1..K, train seconds), a summary over
seeds (mean and min–max of τ per target, method and budget, with EAGLE-3 / Medusa-1) and a PNG of τ against
optimizer steps, one panel per target. ``--targets`` are Hydra target groups (``builtin``: the code target,
``builtin-docs``: the Qwen3 docs target); ``data=builtin`` follows each one's corpus. Runs are reused when their
report.json exists, so an interrupted protocol resumes, and ``--only-table`` rebuilds the tables from the runs
already there. ``--sampled 300`` adds an evaluation of the 300-step drafters at temperature 0.7 / top-p 0.9.
Every drafter is scored on ``--eval-prompts`` (64) held-out prompts after its training run (whose own report
uses ``--num-prompts``, 16): on the docs target 16 prompts put one drafter at τ 3.45 and 64 at 3.90.
Each (target, seed, budget) may be run by its own process (``--targets``/``--seeds``/``--budgets`` narrowed,
``--out`` elsewhere); a final call over the whole grid reads them all back into one table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from drafttrain.config import EvalJob  # noqa: E402
from drafttrain.io import write_json  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="eagle3,medusa1")
    ap.add_argument("--budgets", default="50,100,200,400", help="optimizer steps")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--targets", default="builtin", help="Hydra target groups, comma list")
    ap.add_argument("--grid", default="", help="seed:budget pairs to run (comma list; default: every seed x "
                    "budget), e.g. 0:50,0:100,0:300,1:100,2:100")
    ap.add_argument("--only-table", action="store_true", help="read the runs back; train nothing")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--num-train", type=int, default=1024, help="data.num_train (0 = the whole draft split)")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--eval-prompts", type=int, default=64,
                    help="score every trained drafter again on this many held-out prompts (the first --num-prompts "
                    "of them are the training run's own) and report those (16 prompts moved tau by up to 0.45 on "
                    "the docs target); 0 = the training run's own report")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("-K", type=int, default=4)
    ap.add_argument("--sampled", default="", help="budgets (comma list) whose drafters are also decoded at T=0.7, "
                    "top-p 0.9")
    ap.add_argument("--runs", default="/tmp/quality_runs")
    ap.add_argument("--out", default=str(REPO / "bench" / "notebook" / "training_quality.md"))
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run (e.g. target=<dir>)")
    a = ap.parse_args(argv)
    methods = [m for m in a.methods.split(",") if m]
    budgets = [int(b) for b in a.budgets.split(",") if b]
    seeds = [int(s) for s in a.seeds.split(",") if s]
    grid = [tuple(int(x) for x in g.split(":")) for g in a.grid.split(",") if g] or \
        [(seed, steps) for seed in seeds for steps in budgets]
    rows = []
    for target in [t for t in a.targets.split(",") if t]:
        for seed, steps in grid:
            rows.extend(run_cell(a, target, seed, steps, methods))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out.with_suffix(".json"), {"settings": vars(a), "rows": rows})
    write_table(rows, a, out)
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


def run_dir(a, target: str, seed: int, steps: int) -> Path:
    # the code target keeps the layout it had before --targets existed, so its runs are reused
    base = Path(a.runs) if target == "builtin" else Path(a.runs) / target
    return base / f"seed{seed}" / f"steps{steps}"


def run_cell(a, target: str, seed: int, steps: int, methods: list[str]) -> list[dict]:
    """One compare.py run (every method at one budget and seed on one target) and its rows."""
    runs = run_dir(a, target, seed, steps)
    overrides = [f"target={target}", *a.overrides]
    if not a.only_table:
        cmd = [sys.executable, str(REPO / "scripts" / "compare.py"), "--methods", ",".join(methods),
               "--steps", str(steps), "--batch-size", str(a.batch_size), "--num-train", str(a.num_train),
               "--max-length", str(a.max_length), "--num-prompts", str(a.num_prompts),
               "--max-new-tokens", str(a.max_new_tokens), "-K", str(a.K), "--tree", "", "--sampled", "",
               "--runs", str(runs), "--out", str(runs / "compare.md"), f"train.seed={seed}", *overrides]
        subprocess.run(cmd, check=True, cwd=REPO, env=os.environ)
    rows = []
    for m in methods:
        if not (runs / m / "report.json").exists():
            continue  # --only-table over a grid not run yet
        rep = json.loads((runs / m / "report.json").read_text())
        tm = runs / m / "train_metrics.json"
        train = json.loads(tm.read_text()) if tm.exists() else {}
        n = a.eval_prompts or a.num_prompts
        if a.eval_prompts and (runs / m / "final").exists():  # the drafter scored again on more held-out prompts
            rep = evaluate(a, runs, m, f"{m}_p{n}", n, ["decode.temperature=0.0"], overrides) or {}
            if not rep:
                continue
        row = {"target": target, "method": m, "steps": steps, "seed": seed, "tau": rep["tau"], "alpha": rep["alpha"],
               "per_position": rep["acceptance_per_position"], "train_s": train.get("train_seconds"),
               "outputs_match": rep.get("outputs_match_baseline"), "prompts": n}
        if str(steps) in a.sampled.split(",") and (runs / m / "final").exists():
            name = f"{m}_p{n}_t07" if a.eval_prompts else f"{m}_t07"
            s = evaluate(a, runs, m, name, n, ["decode.temperature=0.7", "decode.top_p=0.9"], overrides)
            if s:
                row.update(tau_t07=s["tau"], alpha_t07=s["alpha"])
        sampled = {} if a.eval_prompts else rep.get("sampled") or {}
        if "tau_t07" not in row and sampled.get("temperature") == 0.7 and sampled.get("top_p") == 0.9:
            row.update(tau_t07=sampled["tau"], alpha_t07=sampled["alpha"])  # the run's own sampled row
        rows.append(row)
    return rows


EVAL_KEYS = {f.name for f in dataclasses.fields(EvalJob)}  # the top-level keys `drafttrain eval` takes


def evaluate(a, runs: Path, m: str, name: str, n: int, sampling: list[str], overrides: list[str]) -> dict | None:
    """``drafttrain eval`` of run ``m``'s final drafter on ``n`` held-out prompts into ``runs/name`` (reused when
    its report exists); its report, or None (``--only-table`` and not run yet)."""
    srun = runs / name
    # training-only keys (train.*, eagle3.*, ...) configure the run, not `drafttrain eval`
    overrides = [o for o in overrides if o.lstrip("+~").split("=")[0].split(".")[0] in EVAL_KEYS]
    if not (srun / "report.json").exists() and not a.only_table:
        subprocess.run([sys.executable, "-m", "drafttrain.cli", "eval", f"drafter={runs / m / 'final'}",
                        "data=builtin", f"data.num_eval={n}", f"decode.num_prompts={n}",
                        f"decode.max_new_tokens={a.max_new_tokens}", f"decode.num_draft_tokens={a.K}", *sampling,
                        "decode.sweep=[]", *overrides, f"hydra.run.dir={srun}"], check=True, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    return json.loads((srun / "report.json").read_text()) if (srun / "report.json").exists() else None


def summary(rows) -> list[str]:
    """Mean τ over seeds (min–max, n) per target, method and budget, and EAGLE-3 / Medusa-1 of the means."""
    from statistics import mean

    cells: dict = {}
    for r in rows:
        cells.setdefault((r["target"], r["steps"], r["method"]), []).append(r["tau"])
    methods = sorted({r["method"] for r in rows})
    ratio = "eagle3" in methods and "medusa1" in methods
    head = ["target", "steps", *methods, *(["EAGLE-3 / Medusa-1"] if ratio else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for target, steps in sorted({(t, n) for t, n, _ in cells}):
        out = [target, str(steps)]
        for m in methods:
            v = cells.get((target, steps, m))
            out.append("" if not v else f"{mean(v):.2f}" if len(v) == 1 else
                       f"{mean(v):.2f} ({min(v):.2f}–{max(v):.2f}, n={len(v)})")
        if ratio:
            e, md = cells.get((target, steps, "eagle3")), cells.get((target, steps, "medusa1"))
            out.append(f"{mean(e) / mean(md):.2f}x" if e and md else "")
        lines.append("| " + " | ".join(out) + " |")
    return lines


def sampled_summary(rows) -> list[str]:
    """α at T 0.7 / top-p 0.9 over α greedy (mean over the seeds that have a sampled row)."""
    from statistics import mean

    cells: dict = {}
    for r in rows:
        if "alpha_t07" in r:
            cells.setdefault((r["target"], r["steps"], r["method"]), []).append(r["alpha_t07"] / max(r["alpha"], 1e-9))
    if not cells:
        return []
    methods = sorted({m for _, _, m in cells})
    lines = ["| target | steps | " + " | ".join(methods) + " |", "|---|---|" + "---:|" * len(methods)]
    for target, steps in sorted({(t, n) for t, n, _ in cells}):
        vals = [cells.get((target, steps, m)) for m in methods]
        lines.append(f"| {target} | {steps} | " + " | ".join(
            "" if not v else f"{mean(v):.2f}" + (f" (n={len(v)})" if len(v) > 1 else "") for v in vals) + " |")
    return lines


def write_table(rows, a, out: Path) -> None:
    K = a.K
    head = ["target", "method", "steps", "seed", "τ", *[f"α@{i + 1}" for i in range(K)], "train s"]
    any_sampled = any("tau_t07" in r for r in rows)
    if any_sampled:
        head += ["τ T0.7/p0.9", "α T0.7 / α greedy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (r["target"], r["method"], r["steps"], r["seed"])):
        pp = (list(r["per_position"]) + [float("nan")] * K)[:K]
        cells = [r["target"], r["method"], str(r["steps"]), str(r["seed"]), f"{r['tau']:.2f}", *[f"{x:.2f}" for x in pp],
                 f"{r['train_s']:.0f}" if r["train_s"] else "–"]
        if any_sampled:
            cells += [f"{r['tau_t07']:.2f}", f"{r['alpha_t07'] / max(r['alpha'], 1e-9):.2f}"] if "tau_t07" in r \
                else ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    text = out.read_text() if out.exists() else f"# Training quality: τ against the training budget\n\n"
    begin, end = "<!-- quality_protocol.py: begin generated -->", "<!-- quality_protocol.py: end generated -->"
    prompts = a.eval_prompts or a.num_prompts
    body = (f"{begin}\nGreedy, chain, K = {K}, {prompts} held-out prompts x up to {a.max_new_tokens} new "
            f"tokens; every run: {a.batch_size} sequences per step of the same {a.num_train} target-regenerated chats "
            f"(max length {a.max_length}); α@i = acceptance at position i. All greedy outputs equal AR: "
            f"{all(r['outputs_match'] for r in rows)}.\n\nMean τ over seeds (min–max, number of seeds):\n\n"
            + "\n".join(summary(rows))
            + ("\n\nSampling: α at T 0.7 / top-p 0.9 over greedy α (mean over seeds):\n\n" + "\n".join(sampled_summary(rows))
               if sampled_summary(rows) else "")
            + "\n\nEvery run:\n\n" + "\n".join(lines) + f"\n{end}")
    if begin in text and end in text:
        text = text[: text.index(begin)] + body + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + body + "\n"
    out.write_text(text)


def plot(rows, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from statistics import mean

    targets = sorted({r["target"] for r in rows})
    fig, axes = plt.subplots(1, len(targets), figsize=(6 * len(targets), 4), squeeze=False)
    methods = sorted({r["method"] for r in rows})
    colors = {m: f"C{i}" for i, m in enumerate(methods)}  # one colour per method in every panel
    for ax, target in zip(axes[0], targets):
        for m in methods:
            by_steps: dict = {}
            for r in rows:
                if r["method"] == m and r["target"] == target:
                    by_steps.setdefault(r["steps"], []).append(r["tau"])
            if not by_steps:
                continue
            xs = sorted(by_steps)
            ys = [mean(by_steps[x]) for x in xs]
            err = [[y - min(by_steps[x]) for x, y in zip(xs, ys)], [max(by_steps[x]) - y for x, y in zip(xs, ys)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=m, color=colors[m])
        ax.set_title(f"target={target}")
        ax.set_xlabel("optimizer steps (16 sequences each)")
        ax.set_ylabel("τ (greedy, K = 4; mean, min–max over seeds)")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
