"""Speedup against batch size for several drafters on the built-in target (issue 17's benchmark).

    DRAFTTRAIN_CACHE=/tmp/dtcache python scripts/lab/batch_bench.py --out /tmp/batch \
        --drafters eagle3=<eagle3 run>/final draft_model=<draft_model run>/final pld \
        --batch-sizes 1 2 4 8 16 32 --prompts 128 --max-new-tokens 64

Each drafter (``pld`` needs none; ``name=dir@K`` gives its draft length, else K = 4) is one ``drafttrain eval …
decode.batch_sizes=[…]`` run: every batch size decodes the same ``--prompts`` held-out prompts, greedy, chain, batched AR against batched speculative,
the batch-1 decoder beside (drafttrain/evaluation/batch_sweep.py). Writes ``<out>/batch.json`` (every run's
``batch_sweep``) and prints one markdown table per drafter; each run directory keeps its report.json and
batch_speedup.png. An existing report.json is reused (delete it to measure again).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def run_one(out: Path, name: str, drafter: str | None, a, k: int = 4) -> dict:
    run = out / f"eval-{name}"
    if not (run / "report.json").exists():
        sizes = "[" + ",".join(str(b) for b in a.batch_sizes) + "]"
        args = ["eval", f"data.num_eval={a.prompts}", f"decode.num_prompts={a.prompts}",
                f"decode.max_new_tokens={a.max_new_tokens}", f"decode.num_draft_tokens={k}", "decode.sweep_prompts=0",
                f"decode.batch_sizes={sizes}", f"hydra.run.dir={run}", *a.extra]
        args += [f"drafter={drafter}"] if drafter else [f"decode.method={name}"]
        t = time.time()
        with (out / f"eval-{name}.log").open("w") as f:
            r = subprocess.run([sys.executable, "-m", "drafttrain.cli", *args], stdout=f, stderr=subprocess.STDOUT)
        if r.returncode:
            sys.exit(f"failed ({r.returncode}): drafttrain {' '.join(args)}; see {out / f'eval-{name}.log'}")
        print(f"  {time.time() - t:6.0f} s  {name}", flush=True)
    return json.loads((run / "report.json").read_text())


def main() -> None:
    from drafttrain.evaluation.batch_sweep import format_table
    from drafttrain.io import write_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--drafters", nargs="+", required=True, help="name=dir[@K], or pld")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every eval")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for spec in a.drafters:
        name, _, drafter = spec.partition("=")
        drafter, _, k = drafter.partition("@")
        rep = run_one(a.out, name, drafter or None, a, int(k) if k else 4)
        results[name] = {"drafter": drafter or None, "num_draft_tokens": int(k) if k else 4, "batch_sweep": rep["batch_sweep"],
                         "target": rep.get("target"), "repeats": rep.get("repeats")}
        print(f"\n### {name}\n\n{format_table(rep['batch_sweep'])}\n", flush=True)
    write_json(a.out / "batch.json", {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                                      "results": results})


if __name__ == "__main__":
    main()
