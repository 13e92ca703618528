#!/usr/bin/env python
"""The "What a training step costs" numbers (docs/distributed.md): the printed ``speed:`` line of a short EAGLE-3 run
per setting.

    DRAFTTRAIN_CACHE=/tmp/dtcache python scripts/lab/step_cost_table.py --runs /tmp/sc --out /tmp/sc/result.json

Each setting runs ``train.py recipe=eagle3 train.max_steps=8`` (one torch thread, ``--parallel`` runs at a time)
and reports the s/step, the share in the target forward and the real tokens per step the run printed after its
warm-up step. Wall-clock on a shared machine: compare rows of one invocation only.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SETTINGS = {
    "default": [],
    "eagle3.ttt_steps=3": ["eagle3.ttt_steps=3"],
    "eagle3.ttt_steps=1": ["eagle3.ttt_steps=1"],
    "eagle3.draft_vocab_size=256": ["eagle3.draft_vocab_size=256"],
    "data.max_length=256": ["data.max_length=256"],
    "data.max_length=1024": ["data.max_length=1024"],
    "train.micro_batch_size=4": ["train.micro_batch_size=4"],
    "train.micro_batch_size=16": ["train.micro_batch_size=16"],
    "train.batch_size=32": ["train.batch_size=32"],
    "train.packing=false": ["train.packing=false"],
}
SPEED = re.compile(r"speed: ([\d.]+) s/step \((\d+)% in the target forward\), [\d,]+ real tokens/s, "
                   r"([\d,]+) real tokens/step")


def run_one(name: str, extra: list[str], runs: Path, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DRAFTTRAIN_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "train.py"), "recipe=eagle3", f"train.max_steps={steps}", "train.eval=false",
           "logger=none", "train.save_every=0", *extra, f"hydra.run.dir={runs / re.sub(r'[^A-Za-z0-9_]', '_', name)}"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    found = SPEED.findall(r.stdout + r.stderr)
    if not found:
        raise RuntimeError(f"{name}: no speed line in the run's output")
    s_per_step, share, tokens = found[-1]
    return {"setting": name, "s_per_step": float(s_per_step), "target_share": int(share) / 100,
            "real_tokens_per_step": int(tokens.replace(",", "")), "command": ["python", "train.py", *cmd[2:]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, required=True, help="directory for the runs")
    ap.add_argument("--out", type=Path, required=True, help="JSON file for the rows")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=2)
    args = ap.parse_args()
    with ThreadPoolExecutor(args.parallel) as ex:
        rows = list(ex.map(lambda kv: run_one(kv[0], kv[1], args.runs, args.steps), SETTINGS.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print("| setting | s/step | share in the target forward | real tokens/step |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['s_per_step']:.2f} | {r['target_share']:.0%} | {r['real_tokens_per_step']:,} |")


if __name__ == "__main__":
    main()
