#!/usr/bin/env python
"""CPU cost of a training step, old code against new, side by side (issue: training throughput).

    DRAFTTRAIN_CACHE=/tmp/dtcache python scripts/lab/step_cost_ab.py --old /tmp/old --recipe eagle3 \
        --steps 30 --reps 2 --out bench/results/step_cost_eagle3.json

``--old`` is a checkout of the baseline revision (``git worktree add /tmp/old <rev>``); the new code is this
checkout. Each arm runs ``train.py recipe=<recipe>`` in its own tree, one thread, with the same data, seed
and batch geometry, twice: ``--steps`` optimizer steps and ``--short`` steps. Its CPU-seconds per optimizer
step are ``(cpu(steps) - cpu(short)) / (steps - short)`` with cpu = the child process's user + system time
(setup, target load and data load cancel out). Arms alternate within each repetition (old, new, new, old,
…), so machine load affects both; the table reports every repetition and the median ratio. Both arms see
the same rows per step (the batches are a function of (seed, step)), so the ratio of CPU-s per step is the
ratio of trainable tokens per CPU-second.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def run_arm(tree: Path, recipe: str, steps: int, extra: list[str], run_dir: Path) -> dict:
    """One training run in ``tree``; the child's CPU time (user + sys) and wall time."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DRAFTTRAIN_THREADS": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "train.py"), f"recipe={recipe}", f"train.max_steps={steps}",
           "train.eval=false", "logger=none", "train.log_every=1", f"hydra.run.dir={run_dir}", *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    r = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.time() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {tree}:\n{r.stdout[-3000:]}")
    hist = json.loads((run_dir / "train_metrics.json").read_text())["history"]
    return {"cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), "wall_s": wall,
            "loss_last": hist[-1]["loss"], "steps": steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, type=Path, help="checkout of the baseline revision")
    ap.add_argument("--new", default=REPO, type=Path)
    ap.add_argument("--recipe", default="eagle3")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--short", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--runs", type=Path, default=Path("/tmp/step_cost_runs"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--old-extra", default="", help="overrides for the old arm only (space separated)")
    ap.add_argument("--new-extra", default="", help="overrides for the new arm only (space separated)")
    ap.add_argument("extra", nargs="*", help="overrides for both arms (e.g. train.batch_size=16)")
    a = ap.parse_args(argv)
    arms = {"old": (a.old.resolve(), a.old_extra.split()), "new": (a.new.resolve(), a.new_extra.split())}
    reps = []
    for rep in range(a.reps):
        order = ["old", "new"] if rep % 2 == 0 else ["new", "old"]
        per = {}
        for name in order:
            tree, extra = arms[name]
            runs = {}
            for n in (a.short, a.steps):
                runs[n] = run_arm(tree, a.recipe, n, [*a.extra, *extra], a.runs / f"{name}_{rep}_{n}")
            per[name] = {"cpu_s_per_step": (runs[a.steps]["cpu_s"] - runs[a.short]["cpu_s"]) / (a.steps - a.short),
                         "wall_s_per_step": (runs[a.steps]["wall_s"] - runs[a.short]["wall_s"]) / (a.steps - a.short),
                         "loss_last": runs[a.steps]["loss_last"]}
            print(f"rep {rep} {name}: {per[name]['cpu_s_per_step']:.3f} CPU-s/step "
                  f"(last loss {per[name]['loss_last']:.4f})", flush=True)
        per["ratio_old_over_new"] = per["old"]["cpu_s_per_step"] / per["new"]["cpu_s_per_step"]
        reps.append(per)
    ratios = [r["ratio_old_over_new"] for r in reps]
    summary = {"recipe": a.recipe, "steps": a.steps, "short": a.short, "extra": a.extra,
               "old_extra": a.old_extra, "new_extra": a.new_extra, "reps": reps,
               "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    print(f"old/new CPU-s per step: median {summary['ratio_median']:.2f}x (min {min(ratios):.2f}, max "
          f"{max(ratios):.2f}) over {len(ratios)} repetitions", flush=True)
    if a.out:
        from drafttrain.io import write_json  # atomic; makes the parent directory

        write_json(a.out, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
