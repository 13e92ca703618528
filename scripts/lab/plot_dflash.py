#!/usr/bin/env python
"""The results page's DFlash figure, from the raw rows of bench/results/dflash_defaults_<date>.json:
left, greedy acceptance per draft position (code target, seed 0) of EAGLE-3 at its tuned K and DFlash at K = B - 1;
right, speedup over AR against batch size for both (the batch sweep).

    python scripts/lab/plot_dflash.py bench/results/dflash_defaults_20261207.json docs/img/dflash_vs_eagle3.png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(src: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    raw = json.loads(Path(src).read_text())
    rows = {(r["target"], r["seed"], r["run"]): r for r in raw["family_compare_rows"]}
    e3, df = rows[("builtin", 0, "eagle3")], rows[("builtin", 0, "dflash_B8")]
    sweep_e3 = raw["batch_sweep_code"]["results"]["eagle3"]["batch_sweep"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    series = [(f"EAGLE-3, K = {e3['tuned']['K']} (tuned): τ {e3['tuned']['tau']:.2f}",
               e3["tuned"]["acceptance_per_position"], "tab:blue"),
              (f"DFlash, 1 layer, block 8, K = 7: τ {df['tau']:.2f}", df["acceptance_per_position"], "tab:orange")]
    for label, acc, color in series:
        if acc:
            a.plot(range(1, len(acc) + 1), acc, marker="o", label=label, color=color)
    a.set_xlabel("draft position")
    a.set_ylabel("acceptance (reached → accepted)")
    a.set_ylim(0, 1.05)
    a.xaxis.set_major_locator(MaxNLocator(integer=True))
    a.set_title(f"greedy, code target, {df['prompts']} held-out prompts", fontsize=10)
    a.legend(fontsize=8, loc="lower left")
    for name, color in (("eagle3", "tab:blue"), ("dflash", "tab:orange")):
        sweep = raw["batch_sweep_code"]["results"][name]["batch_sweep"]
        pts = [(r["batch_size"], r["speedup"]) for r in sweep["rows"] if r.get("batch_size")]
        b.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color,
               label=f"{'EAGLE-3' if name == 'eagle3' else 'DFlash'}, K = {sweep['num_draft_tokens']}")
    b.axhline(1.0, color="grey", lw=0.8, ls="--", label="AR")
    b.set_xscale("log", base=2)
    b.set_xticks([1, 2, 4, 8, 16], labels=["1", "2", "4", "8", "16"])
    b.set_xlabel("batch size")
    b.set_ylabel("speedup over batched AR")
    b.set_title(f"code target, {sweep_e3['num_prompts']} prompts × {sweep_e3['max_new_tokens']} tokens, CPU",
                fontsize=10)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
