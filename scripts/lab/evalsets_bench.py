"""τ per category on the standard evaluation sets for the built-in target: EAGLE-3, Medusa-1, the draft model, DFlash
and prompt lookup, each through `drafttrain eval eval.set=…` (the per-category table of drafttrain.evaluation.evalsets).

    python scripts/lab/evalsets_bench.py --out /tmp/evalsets --sets humaneval \
        /work/shared/evalsets/spec_bench/question.jsonl --per-category 0 5 --max-new-tokens 64

Trains each family with its recipe's defaults (`drafttrain train recipe=<r>`, same built-in data and seed; skip
with --drafters name=dir[@K]; --families picks which to train), then evaluates every drafter on every set with the
same decode settings (greedy, chain, one timed pass: τ and α are exact counts; the speedups are single CPU passes on
a shared machine and only indicative) at its own draft length: K=4 for the chain families, the block's B-1 for DFlash,
or the @K given. Writes <out>/evalsets.json and prints a markdown table per set (bench/notebook/evalsets.md holds one run).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

FAMILIES = {"eagle3": "eagle3", "medusa": "medusa", "draft_model": "draft_model", "dflash": "dflash"}
DEFAULT_K = {"dflash": 15}  # recipe=dflash drafts the block's B - 1 = 15 slots; every other family K = 4


def _run(args: list[str], log: Path) -> None:
    t = time.time()
    with log.open("w") as f:
        r = subprocess.run([sys.executable, "-m", "drafttrain.cli", *args], stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        sys.exit(f"failed ({r.returncode}): drafttrain {' '.join(args)}; see {log}")
    print(f"  {time.time() - t:6.0f} s  drafttrain {' '.join(args[:3])} ...", flush=True)


def train(out: Path, family: str, extra: list[str]) -> Path:
    run = out / f"train-{family}"
    final = run / "final"
    if not (final / "config.json").exists():
        _run(["train", f"recipe={FAMILIES[family]}", "train.eval=false", f"hydra.run.dir={run}", *extra],
             out / f"train-{family}.log")
    return final


def evaluate(out: Path, name: str, drafter: Path | None, set_: str, per_category: int, max_new: int, k: int) -> dict:
    tag = Path(set_).parent.name if set_.endswith(".jsonl") else Path(set_).name
    run = out / f"eval-{name}-{tag}"
    args = ["eval", f"eval.set={set_}", f"eval.per_category={per_category}", f"decode.max_new_tokens={max_new}",
            f"decode.num_draft_tokens={k}", "decode.repeats=1", "decode.sweep_prompts=0", f"hydra.run.dir={run}"]
    args += [f"drafter={drafter}"] if drafter else ["decode.method=pld"]
    if not (run / "report.json").exists():
        _run(args, out / f"eval-{name}-{tag}.log")
    return json.loads((run / "report.json").read_text())


def table(reports: dict[str, dict]) -> str:
    names = list(reports)
    cats = [r["category"] for r in next(iter(reports.values()))["categories"]]
    head = "| category | questions | turns | " + " | ".join(f"{n} τ (speedup)" for n in names) + " |"
    lines = [head, "|" + "---|" * (3 + len(names))]
    for i, c in enumerate(cats):
        first = next(iter(reports.values()))["categories"][i]
        cells = [f"{r['categories'][i]['tau']:.2f} ({r['categories'][i]['speedup']:.2f}x)" for r in reports.values()]
        lines.append(f"| {c} | {first['questions']} | {first['prompts']} | " + " | ".join(cells) + " |")
    tot = next(iter(reports.values()))
    cells = [f"**{r['tau']:.2f}** ({r['speedup']:.2f}x)" for r in reports.values()]
    lines.append(f"| **total (pooled)** | {sum(x['questions'] for x in tot['categories'])} | {tot['prompts']} | "
                 + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sets", nargs="+", required=True, help="humaneval and/or question.jsonl paths")
    ap.add_argument("--per-category", type=int, nargs="+", default=[0], help="eval.per_category per set (0: all)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--drafters", nargs="*", default=[],
                    help="name=dir[@K]: use a saved drafter instead of training (K: its draft length)")
    ap.add_argument("--families", nargs="*", default=list(FAMILIES), help="the families to evaluate (and train)")
    ap.add_argument("--train-args", nargs="*", default=[], help="extra overrides for every training run")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    given = dict(x.split("=", 1) for x in a.drafters)
    ks = {name: int(d.rpartition("@")[2]) for name, d in given.items() if "@" in d}
    given = {name: d.rpartition("@")[0] if "@" in d else d for name, d in given.items()}
    drafters = {f: Path(given[f]) if f in given else train(a.out, f, a.train_args) for f in a.families}
    drafters["pld"] = None
    ks = {name: ks.get(name, DEFAULT_K.get(name, 4)) for name in drafters}
    per = a.per_category + [a.per_category[-1]] * (len(a.sets) - len(a.per_category))
    results = {}
    for set_, n in zip(a.sets, per):
        reps = {name: evaluate(a.out, name, d, set_, n, a.max_new_tokens, ks[name]) for name, d in drafters.items()}
        results[set_] = {name: {k: r.get(k) for k in ("tau", "alpha", "speedup", "prompts", "new_tokens",
                                                       "acceptance_per_position", "categories", "eval_set",
                                                       "num_draft_tokens")}
                         for name, r in reps.items()}
        print(f"\n### {set_} (eval.per_category={n}; {reps['pld']['categories'][0]['decode'].split(', ', 1)[1]})\n")
        print(table(reps))
    meta = {"sets": a.sets, "per_category": per, "max_new_tokens": a.max_new_tokens, "drafters": {
        k: str(v) for k, v in drafters.items()}, "num_draft_tokens": ks, "train_args": a.train_args, "threads": os.environ.get("OMP_NUM_THREADS")}
    (a.out / "evalsets.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"\nwrote {a.out / 'evalsets.json'}")


if __name__ == "__main__":
    main()
