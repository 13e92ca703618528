#!/usr/bin/env python
"""Drafter families side by side on the built-in targets: each trained by its recipe (same data, seed, budget),
then scored by drafttrain's decoder on the same held-out prompts (greedy; the sampled row at T 0.7 / top-p 0.9),
each at its own draft length (the recipe's, or one per run given with @K).

    python scripts/lab/family_compare.py --targets builtin,builtin-docs --seeds 0 \
        --runs eagle3:recipe=eagle3@4 dflash:recipe=dflash@15 --out bench/results/family_compare.json

A run spec is ``name:override,override,...@K``. Per (target, seed, run): ``train.py <overrides>`` into
``<workdir>/<target>-s<seed>-<name>`` (reused when its report.json exists), then the row: τ, α, acceptance per
position, speedup over AR measured side by side in the run's evaluation (its per-prompt spread), the sampled
row, training seconds (wall and CPU, one process), real tokens per CPU-second and peak memory. Every row keeps its
command.

With ``--tune``, each drafter is also scored at its tuned draft length: ``drafttrain tune`` (``--tune-prompts``
calibration prompts, acceptance and costs measured) picks K, then ``drafttrain eval`` at that K on the same
held-out prompts (the row's ``tuned`` entry; the recipe's K when tune picks it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _parse(spec: str):
    name, _, rest = spec.partition(":")
    over, _, k = rest.partition("@")
    return name, [o for o in over.split(",") if o], (int(k) if k else None)


def _row(run: Path) -> dict:
    rep = json.loads((run / "report.json").read_text())
    tm = json.loads((run / "train_metrics.json").read_text())
    samp = rep.get("sampled") or {}
    return {
        "tau": rep["tau"], "alpha": rep["alpha"], "acceptance_per_position": rep["acceptance_per_position"],
        "speedup": rep["speedup"], "speedup_min": rep.get("speedup_min"), "speedup_max": rep.get("speedup_max"),
        "outputs_match_baseline": rep["outputs_match_baseline"], "num_draft_tokens": rep.get("num_draft_tokens"),
        "prompts": rep["prompts"], "train_estimated_tau": rep.get("train_estimated_tau"),
        "frac_draft": rep.get("frac_draft"),
        "sampled_tau": samp.get("tau"), "sampled_speedup": samp.get("speedup"),
        "train_seconds": tm.get("train_seconds"), "train_cpu_seconds": tm.get("train_cpu_seconds"),
        "train_tokens_per_cpu_s": (tm["real_tokens"] / tm["train_cpu_seconds"]) if tm.get("train_cpu_seconds")
        and tm.get("real_tokens") else None,
        "peak_rss_mb": (tm.get("peak_memory_mb") or {}).get("rss"), "steps": (tm.get("history") or [{}])[-1].get("step"),
        "seconds_per_step": (tm.get("history") or [{}])[-1].get("seconds_per_step"),
        "train_tokens_per_s": (tm.get("history") or [{}])[-1].get("tokens_per_s"),
    }


def _cli(args: list[str], log: Path) -> None:
    with log.open("w") as f:
        r = subprocess.run([sys.executable, "-m", "drafttrain.cli", *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        raise RuntimeError(f"drafttrain {' '.join(args)} failed ({r.returncode}); see {log}")


def tuned(run: Path, target: str, a, row: dict) -> dict:
    """``drafttrain tune`` on the run's drafter, then its evaluation at the picked K (the run's own when equal)."""
    tdir = run / "tune"
    if not (tdir / "tune.json").exists():
        _cli(["tune", f"drafter={run / 'final'}", f"target={target}", f"decode.num_prompts={a.tune_prompts}",
              "max_draft_tokens=8", f"hydra.run.dir={tdir}"], run / "tune.log")
    tj = json.loads((tdir / "tune.json").read_text())
    k = next((int(o.split("=")[1]) for o in tj["overrides"] if o.startswith("decode.num_draft_tokens=")), 0)
    out = {"K": k, "tune_rows": [{key: r.get(key) for key in ("K", "tau", "speedup_vs_ar")} for r in tj["rows"]]}
    if k == row["num_draft_tokens"]:
        return {**out, **{key: row[key] for key in ("tau", "alpha", "speedup", "speedup_min", "speedup_max",
                                                      "outputs_match_baseline")}}
    edir = run / f"eval-K{k}"
    if not (edir / "report.json").exists():
        _cli(["eval", f"drafter={run / 'final'}", f"target={target}", f"data.num_eval={a.num_prompts}",
              f"decode.num_prompts={a.num_prompts}",
              f"decode.num_draft_tokens={k}", "decode.temperature=0.0", "decode.sweep=[]", "decode.repeats=1",
              f"hydra.run.dir={edir}"], run / f"eval-K{k}.log")
    rep = json.loads((edir / "report.json").read_text())
    return {**out, **{key: rep.get(key) for key in ("tau", "alpha", "speedup", "speedup_min", "speedup_max",
                                                      "outputs_match_baseline")}}


def _tuned_cell(t: dict | None) -> str:
    if not t:
        return "–"
    same = "" if t.get("outputs_match_baseline", True) else " (NOT == AR)"
    return f"K={t['K']}: {t['tau']:.2f} / {t['speedup']:.2f}x{same}"


def table(rows: list[dict]) -> str:
    """The results page's table: per target and run, τ, speedup over AR (per-prompt range), the sampled row,
    training seconds and seconds per step."""
    f = lambda x, n=2: "–" if x is None else f"{x:.{n}f}"  # noqa: E731
    out = ["| target | drafter | K | τ | α | speedup over AR (per-prompt min–max) | sampled τ / speedup | "
           "greedy == AR | tuned K: τ / speedup | train s (s/step) | tokens / CPU-s | peak RSS MiB |",
           "|---|---|---:|---:|---:|---:|---:|:-:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['target']} | {r['run']} | {r['num_draft_tokens']} | {f(r['tau'])} | {f(r['alpha'])} | "
                   f"{f(r['speedup'])}x ({f(r['speedup_min'])}–{f(r['speedup_max'])}) | "
                   f"{f(r['sampled_tau'])} / {f(r['sampled_speedup'])}x | {'yes' if r['outputs_match_baseline'] else 'NO'} | "
                   f"{_tuned_cell(r.get('tuned'))} | {f(r['train_seconds'], 0)} ({f(r['seconds_per_step'])}) | "
                   f"{f(r.get('train_tokens_per_cpu_s'), 0)} | {f(r.get('peak_rss_mb'), 0)} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="builtin")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--runs", nargs="+", default=[])
    ap.add_argument("--num-prompts", type=int, default=16, help="held-out prompts (data.num_eval and decode.num_prompts)")
    ap.add_argument("--workdir", default="/tmp/family_compare")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "family_compare.json"))
    ap.add_argument("--common", default="logger=none,decode.sweep=[],decode.repeats=1",
                    help="overrides for every run (comma list)")
    ap.add_argument("--tune", action="store_true", help="also score each drafter at its tuned draft length")
    ap.add_argument("--tune-prompts", type=int, default=8)
    ap.add_argument("--table", action="store_true", help="print the markdown table of --out; run nothing")
    a = ap.parse_args(argv)
    out = Path(a.out)
    results = json.loads(out.read_text()) if out.exists() else {"rows": []}
    if a.table:
        print(table(results["rows"]))
        return 0
    done = {(r["target"], r["seed"], r["run"]) for r in results["rows"]}
    for target in a.targets.split(","):
        for seed in [int(s) for s in a.seeds.split(",")]:
            for spec in a.runs:
                name, over, k = _parse(spec)
                if (target, seed, name) in done:
                    continue
                run = Path(a.workdir) / f"{target}-s{seed}-{name}"
                cmd = [sys.executable, str(REPO / "train.py"), *over, f"target={target}", f"train.seed={seed}",
                       f"data.num_eval={a.num_prompts}", f"decode.num_prompts={a.num_prompts}",
                       *[c for c in a.common.split(",") if c],
                       *([f"decode.num_draft_tokens={k}"] if k else []), f"hydra.run.dir={run}"]
                if not (run / "report.json").exists():
                    t0 = time.time()
                    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
                    if r.returncode != 0:
                        print(f"FAILED {name} on {target}: {r.stderr[-2000:]}", file=sys.stderr)
                        continue
                    print(f"{target} seed {seed} {name}: {time.time() - t0:.0f} s", flush=True)
                row = {"target": target, "seed": seed, "run": name, "command": " ".join(cmd[1:]), **_row(run)}
                if a.tune:
                    row["tuned"] = tuned(run, target, a, row)
                row = {**row,
                       "date": time.strftime("%Y-%m-%d"),
                       "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                                capture_output=True, text=True).stdout.strip()}
                results["rows"].append(row)
                out.parent.mkdir(parents=True, exist_ok=True)
                tmp = out.with_suffix(".tmp")
                tmp.write_text(json.dumps(results, indent=1))
                os.replace(tmp, out)
                print(json.dumps({k: row.get(k) for k in ("target", "run", "tau", "speedup", "sampled_tau",
                                                           "train_seconds", "tuned")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
