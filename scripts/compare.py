#!/usr/bin/env python
"""Compare drafter families on one target with the same training budget and the same decoder settings.

    python scripts/compare.py                       # the built-in target, defaults below
    python scripts/compare.py --steps 300 --num-train 1024 --out bench/notebook/compare.md

Every trained method runs ``train.py recipe=<recipe>`` (one process; ``accelerate launch`` gives the same
result) with the same data (``data=builtin``: target-regenerated training chats, held-out eval prompts), the
same number of optimizer steps and global batch size, then is evaluated by the training run's own
end-of-training evaluation with the same decoder settings (greedy, chain, K draft tokens, same prompts,
same max_new_tokens). PLD (prompt lookup, no training) is scored with ``drafttrain eval decode.method=pld``.
Each run's report.json is read back into one Markdown table (τ, α, α per position, speedup) and a PNG.

Learning rates are each recipe's own (what the recipe would ship with); everything else that sets the budget
is identical and written in the table header. Runs whose report.json already exists are reused
(``--fresh`` retrains), so an interrupted comparison resumes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# name -> (recipe, extra overrides, description); decode.method comes from the recipe
METHODS = {
    "eagle3": ("eagle3", [], "EAGLE-3 recipe (EAGLE-3.1 norms, 1 layer, 3 taps, TTT 7, lr 3e-3)"),
    "medusa1": ("medusa", [], "Medusa-1 (4 heads, frozen target)"),
    "medusa2": ("medusa2", [], "Medusa-2 (4 heads + LoRA r32, self-distillation; target modified)"),
    "kd": ("draft_model", ["distill.loss=fkl"], "distilled draft, KD (forward KL), 2 target layers"),
    "kd_onpolicy": ("draft_model", ["distill.loss=fkl", "distill.on_policy_ratio=0.5"],
                    "distilled draft, KD (forward KL), 50% on-policy rows"),
    "ce": ("draft_model", ["distill.loss=ce"], "same draft, plain CE on the same data"),
    "pld": (None, ["decode.method=pld"], "prompt lookup (no training)"),
    # EAGLE-3 levers (ablation rows: one change each against "eagle3")
    "eagle3_v30": ("eagle3", ["eagle3.fc_norm=false", "eagle3.norm_output=false", "train.lr=1e-3",
                              "data.regen_temperature=0"],
                   "EAGLE-3 as the recipe was before the lever ablation (no 3.1 norms, lr 1e-3, greedy answers)"),
    "eagle3_v31": ("eagle3", ["eagle3.fc_norm=true", "eagle3.norm_output=true"], "EAGLE-3.1 (fc_norm + norm_output)"),
    "eagle3_lk": ("eagle3", ["eagle3.loss=lk_hybrid"], "EAGLE-3, LK-style hybrid loss (CE + TV) / 2"),
    "eagle3_tv": ("eagle3", ["eagle3.loss=tv"], "EAGLE-3, total-variation loss"),
    "eagle3_init": ("eagle3", ["eagle3.experimental.init_layer=-1"], "EAGLE-3, draft layer from the target's last layer"),
    "eagle3_qk": ("eagle3", ["eagle3.qk_norm=true"], "EAGLE-3, Qwen3-style draft layer (q/k norm)"),
    "eagle3_lr3e3": ("eagle3", ["train.lr=3e-3"], "EAGLE-3, learning rate 3e-3 (recipe: 1e-3)"),
    "eagle3_ttt3": ("eagle3", ["eagle3.ttt_steps=3"], "EAGLE-3, TTT 3 steps (recipe: 7)"),
    "eagle3_greedyregen": ("eagle3", ["data.regen_temperature=0"],
                           "EAGLE-3, every training answer regenerated greedily (the default until 2026-12-04)"),
    "eagle3_regen07": ("eagle3", ["data.regen_temperature=0.7", "data.regen_sampled_fraction=1"],
                       "EAGLE-3, every training answer sampled by the target at T=0.7 (default: half)"),
    "eagle3_regenmix": ("eagle3", ["data.regen_temperature=0.7", "data.regen_sampled_fraction=0.5"],
                        "EAGLE-3, half the training answers sampled from the target at T=0.7, half greedy"),
    "eagle3_regenmix25": ("eagle3", ["data.regen_temperature=0.7", "data.regen_sampled_fraction=0.25"],
                          "EAGLE-3, a quarter of the training answers sampled from the target at T=0.7, the rest greedy"),
    "medusa1_regenmix": ("medusa", ["data.regen_temperature=0.7", "data.regen_sampled_fraction=0.5"],
                         "Medusa-1 on the same half-sampled, half-greedy answers"),
    "medusa1_greedyregen": ("medusa", ["data.regen_temperature=0"],
                            "Medusa-1, every training answer regenerated greedily (the default until 2026-12-04)"),
    "eagle3_answers2": ("eagle3", ["data.regen_answers=2"],
                        "EAGLE-3, two answers per training prompt (the second sampled at T=0.7)"),
    "medusa1_answers2": ("medusa", ["data.regen_answers=2"],
                         "Medusa-1, two answers per training prompt (the second sampled at T=0.7)"),
    "eagle3_curr": ("eagle3", ["eagle3.experimental.ttt_curriculum=50"],
                    "EAGLE-3, TTT curriculum (unrolled depth 1 -> 7 over the first 50 steps)"),
    "eagle3_v31_lr3e3": ("eagle3", ["eagle3.fc_norm=true", "eagle3.norm_output=true", "train.lr=3e-3"],
                         "EAGLE-3.1, learning rate 3e-3"),
    "eagle3_v31_init": ("eagle3", ["eagle3.fc_norm=true", "eagle3.norm_output=true", "eagle3.experimental.init_layer=-1"],
                        "EAGLE-3.1, draft layer from the target's last layer"),
    "eagle3_v31_lr3e3_init": ("eagle3", ["eagle3.fc_norm=true", "eagle3.norm_output=true", "train.lr=3e-3",
                                         "eagle3.experimental.init_layer=-1"], "EAGLE-3.1, lr 3e-3, layer from the target's last"),
    "eagle3_all": ("eagle3", ["eagle3.fc_norm=true", "eagle3.norm_output=true", "train.lr=3e-3",
                              "eagle3.experimental.init_layer=-1", "eagle3.qk_norm=true"],
                   "EAGLE-3.1, lr 3e-3, layer from the target's last, q/k norm"),
    "eagle3_2l": ("eagle3", ["eagle3.num_layers=2"], "EAGLE-3, 2 draft layers"),
    # taps (HF hidden_states indices = the input of that decoder layer, vLLM's aux layer ids) on the 8-layer
    # built-in targets: the default (2, L//2, L-3) = (2, 4, 5) leaves 3 of 8 layers above the top tap
    "eagle3_taps247": ("eagle3", ["eagle3.tap_layers=[2,4,7]"], "EAGLE-3, taps (2, 4, 7): top tap below the last layer"),
    "eagle3_taps147": ("eagle3", ["eagle3.tap_layers=[1,4,7]"], "EAGLE-3, taps (1, 4, 7)"),
    "eagle3_taps246": ("eagle3", ["eagle3.tap_layers=[2,4,6]"], "EAGLE-3, taps (2, 4, 6)"),
    "eagle3_lr6e3": ("eagle3", ["train.lr=6e-3"], "EAGLE-3, learning rate 6e-3 (recipe: 3e-3)"),
    "eagle3_lr1e2": ("eagle3", ["train.lr=1e-2"], "EAGLE-3, learning rate 1e-2 (recipe: 3e-3)"),
    "eagle3_warm20": ("eagle3", ["train.warmup_steps=20"],
                      "EAGLE-3, 20 warm-up steps (the recipe's until 2026-12-06; recipe: 5)"),
    "eagle3_decay05": ("eagle3", ["eagle3.step_decay=0.5"], "EAGLE-3, TTT step weights 0.5^i (recipe: 0.8^i)"),
    "eagle3_tt05": ("eagle3", ["eagle3.teacher_temperature=0.5"], "EAGLE-3, teacher softmax(logits / 0.5) (recipe: 1)"),
    "eagle3_frozenhead": ("eagle3", ["eagle3.experimental.freeze_lm_head=true"],
                          "EAGLE-3, lm_head frozen at the target's rows (speculators' choice; recipe: trained)"),
    "eagle3_decay09": ("eagle3", ["eagle3.step_decay=0.9"], "EAGLE-3, TTT step weights 0.9^i (recipe: 0.8^i)"),
    # against memorising the training chats (docs target: EAGLE-3 tau 4.34 on 16 training prompts, 3.45 held out)
    "eagle3_noise01": ("eagle3", ["eagle3.experimental.feature_noise=0.1"], "EAGLE-3, feature noise U(-0.1, 0.1) x tap RMS"),
    "eagle3_noise03": ("eagle3", ["eagle3.experimental.feature_noise=0.3"], "EAGLE-3, feature noise U(-0.3, 0.3) x tap RMS"),
    "eagle3_wd01": ("eagle3", ["train.weight_decay=0.1"], "EAGLE-3, AdamW weight decay 0.1 (recipe: 0)"),
    # GRIFFIN's token-alignable training: later TTT steps score only the positions earlier steps got right
    "eagle3_align1": ("eagle3", ["eagle3.experimental.align_top_k=1"], "EAGLE-3, token alignment: earlier steps' top-1 right"),
    "eagle3_align3": ("eagle3", ["eagle3.experimental.align_top_k=3"], "EAGLE-3, token alignment: earlier steps' top-3 right"),
    "eagle3_hod10": ("eagle3", ["eagle3.experimental.topk_distill=10"],
                     "EAGLE-3, HASS top-10 distillation added (weight 1)"),
    "eagle3_hod1": ("eagle3", ["eagle3.experimental.topk_distill=1"],
                    "EAGLE-3, HASS top-1 distillation added (weight 1): p(argmax) x CE on the argmax"),
    "eagle3_prompt": ("eagle3", ["eagle3.experimental.score_prompt=true"],
                      "EAGLE-3, every position scored (prompt and template too; recipe: answers only)"),
    "eagle3_feat1": ("eagle3", ["eagle3.experimental.feature_loss_weight=1"],
                     "EAGLE-3, feature regression auxiliary (weight 1): step output vs the next fused features"),
    "eagle3_feat01": ("eagle3", ["eagle3.experimental.feature_loss_weight=0.1"],
                      "EAGLE-3, feature regression auxiliary (weight 0.1)"),
    "eagle3_oov": ("eagle3", ["eagle3.experimental.score_oov=true"],
                   "EAGLE-3, positions whose target argmax is outside the draft vocabulary scored too"),
}
DEFAULT = ["eagle3", "medusa1", "medusa2", "kd", "ce", "pld"]


def _run(cmd: list[str], log: Path, env: dict) -> float:
    t0 = time.time()
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}); log {log}:\n{tail}")
    return time.time() - t0


def _saved_params(final: Path) -> int | None:
    """Parameters in the drafter's saved safetensors files (Medusa-2: heads + LoRA adapter)."""
    import math

    from safetensors import safe_open

    if not final.is_dir():
        return None
    n = 0
    for f in final.rglob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=",".join(DEFAULT), help=f"comma list of {', '.join(METHODS)}")
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps for every trained method")
    ap.add_argument("--batch-size", type=int, default=16, help="global batch (sequences per step)")
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--num-train", type=int, default=512,
                    help="training conversations (data.num_train; 0 = the whole draft split)")
    ap.add_argument("--max-length", type=int, default=384, help="data.max_length")
    ap.add_argument("--num-prompts", type=int, default=16, help="held-out eval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("-K", "--num-draft-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="OMP/torch threads per run (1 is fastest on shared cores)")
    ap.add_argument("--runs", default=str(REPO / "runs" / "compare"), help="run directories go here")
    ap.add_argument("--out", default=str(REPO / "bench" / "notebook" / "compare.md"))
    ap.add_argument("--png", default=None, help="default: <out without .md>.png")
    ap.add_argument("--fresh", action="store_true", help="retrain even if a run's report.json exists")
    ap.add_argument("--tree", default="medusa1",
                    help="also evaluate these Medusa drafters with their static tree (decode.tree.enabled; '' = none)")
    ap.add_argument("--tree-nodes", type=int, default=16, help="decode.tree.total_tokens for --tree")
    ap.add_argument("--sampled", default="kd,ce",
                    help="also evaluate these trained drafters at temperature 1 (a second table; '' = none)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (e.g. target=<dir>)")
    args = ap.parse_args(argv)

    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in names if m not in METHODS]
    if bad:
        ap.error(f"unknown method(s) {bad}; expected some of {list(METHODS)}")
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
    data = ["data=builtin", f"data.num_train={args.num_train or 'null'}", f"data.max_length={args.max_length}",
            f"data.num_eval={args.num_prompts}"]
    decode = [f"decode.num_prompts={args.num_prompts}", f"decode.max_new_tokens={args.max_new_tokens}",
              f"decode.num_draft_tokens={args.num_draft_tokens}", "decode.temperature=0.0", "decode.sweep=[]"]
    budget = [f"train.max_steps={args.steps}", f"train.batch_size={args.batch_size}",
              f"train.micro_batch_size={args.micro_batch_size}", "train.save_every=0", "logger=none"]

    results = {}
    for name in names:
        recipe, extra, desc = METHODS[name]
        run = runs / name
        rep = run / "report.json"
        if rep.exists() and not args.fresh:
            print(f"[compare] {name}: reusing {rep}", flush=True)
        else:
            if recipe is None:
                cmd = [sys.executable, "-m", "drafttrain.cli", "eval", *data, *decode, *extra, *args.overrides,
                       "overwrite=true", f"hydra.run.dir={run}"]  # --fresh: the earlier run moves aside
            else:
                cmd = [sys.executable, str(REPO / "train.py"), f"recipe={recipe}", *data, *budget, *decode, *extra,
                       *args.overrides, "train.overwrite=true", f"hydra.run.dir={run}"]
            run.mkdir(parents=True, exist_ok=True)
            print(f"[compare] {name}: {' '.join(cmd[1:])}", flush=True)
            secs = _run(cmd, run.parent / f"{name}.log", env)
            print(f"[compare] {name}: done in {secs:.0f}s", flush=True)
        r = json.loads(rep.read_text())
        tm = run / "train_metrics.json"
        train = json.loads(tm.read_text()) if tm.exists() else {}
        results[name] = {"desc": desc, "recipe": recipe, "extra": extra, "report": r,
                         "train_seconds": train.get("train_seconds"),
                         "last": _tail_mean(train.get("history") or []), "params": _saved_params(run / "final")}

    def eval_only(name, suffix, extra):
        run = runs / f"{name}_{suffix}"
        rep = run / "report.json"
        if not rep.exists() or args.fresh:
            cmd = [sys.executable, "-m", "drafttrain.cli", "eval", f"drafter={runs / name / 'final'}", *data,
                   *decode, *extra, *args.overrides, "overwrite=true", f"hydra.run.dir={run}"]
            print(f"[compare] {name} ({suffix}): {' '.join(cmd[1:])}", flush=True)
            _run(cmd, runs / f"{name}_{suffix}.log", env)
        return json.loads(rep.read_text())

    trees = {}
    for name in [m.strip() for m in args.tree.split(",") if m.strip()]:
        if name in results and results[name]["recipe"] in ("medusa", "medusa2"):
            trees[name] = eval_only(name, "tree", ["decode.tree.enabled=true",
                                                   f"decode.tree.total_tokens={args.tree_nodes}"])
    sampled = {}
    for name in [m.strip() for m in args.sampled.split(",") if m.strip()]:
        if name in results and results[name]["recipe"]:
            sampled[name] = eval_only(name, "t1", ["decode.temperature=1.0"])

    drift = None
    if "medusa2" in results:
        drift = medusa2_drift(runs / "medusa2" / "final", args.num_prompts, args.max_new_tokens, args.threads)
    write_table(results, args, Path(args.out), sampled, trees, drift)
    png = Path(args.png) if args.png else Path(args.out).with_suffix(".png")
    plot(results, png)
    print(f"[compare] wrote {args.out} and {png}", flush=True)
    return 0


def medusa2_drift(final: Path, num_prompts: int, max_new_tokens: int, threads: int) -> dict:
    """Medusa-2 changes the target: greedy outputs of the original target vs the adapted (merged) one on the
    held-out prompts (HF ``generate``): how many are identical, and the mean length of the common prefix."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafttrain.data.builtin import builtin_conversations, corpus_of
    from drafttrain.data.chat import stop_token_ids
    from drafttrain.data.select import eval_prompt_ids
    from drafttrain.io import read_json
    from drafttrain.artifacts import load_medusa

    torch.set_num_threads(threads)
    target = read_json(final / "config.json")["target_name_or_path"]
    tok = AutoTokenizer.from_pretrained(target)
    prompts = eval_prompt_ids(tok, builtin_conversations("eval", num_prompts, 0, corpus_of("auto", target)),
                              num_prompts)

    def outputs(model):
        res = []
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=stop_token_ids(model, tok), pad_token_id=tok.pad_token_id)
            res.append(out[0, len(p):].tolist())
        return res

    base = outputs(AutoModelForCausalLM.from_pretrained(target).eval())
    adapted_model, _, _ = load_medusa(final, AutoModelForCausalLM.from_pretrained(target).eval())
    adapted = outputs(adapted_model)
    prefix = []
    for a, b in zip(base, adapted):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix.append(n)
    return {"identical": sum(a == b for a, b in zip(base, adapted)), "prompts": len(prompts),
            "mean_common_prefix": sum(prefix) / len(prefix), "mean_len": sum(map(len, base)) / len(base)}


def _tail_mean(history: list[dict], n: int = 10) -> dict:
    tail = history[-n:]
    keys = set().union(*tail) if tail else set()
    return {k: sum(h[k] for h in tail if k in h) / sum(1 for h in tail if k in h) for k in keys
            if all(isinstance(h.get(k, 0.0), (int, float)) for h in tail)}


def _f(x, spec=".2f"):
    return "–" if x is None else format(x, spec)


def write_table(results: dict, args, out: Path, sampled: dict | None = None, trees: dict | None = None,
                drift: dict | None = None) -> None:
    from drafttrain.io import write_text

    K = args.num_draft_tokens
    any_r = next(iter(results.values()))["report"]
    lines = [
        f"Target: `{any_r['target']}`; {any_r['prompts']} held-out prompts x up to {args.max_new_tokens} new "
        f"tokens; greedy; chain drafts, K = {K}; speedup = speculative / AR tokens/s measured side by side in "
        f"the same run on CPU ({args.threads} thread).",
        f"Training budget (every trained method): {args.steps} optimizer steps x {args.batch_size} sequences "
        f"(micro-batch {args.micro_batch_size}) of the same {args.num_train} target-regenerated chats "
        f"(max length {args.max_length}); learning rate = each recipe's.",
        "",
        "| method | drafter | saved params | train s | τ | α | " + " | ".join(f"α@{i + 1}" for i in range(K))
        + " | tok/s spec / AR | speedup | draft time | greedy = AR | target modified |",
        "|---|---|---:|---:|---:|---:|" + "---:|" * K + "---:|---:|---:|:-:|:-:|",
    ]
    for name, res in results.items():
        r = res["report"]
        app = list(r.get("acceptance_per_position") or []) + [None] * K
        params = res["params"]
        lines.append(
            f"| {name} | {res['desc']} | {_f(params / 1e6, '.2f') + 'M' if params else '–'} | "
            f"{_f(res['train_seconds'], '.0f')} | {_f(r['tau'])} | {_f(r['alpha'])} | "
            + " | ".join(_f(a) for a in app[:K])
            + f" | {_f(r['tokens_per_s'], '.0f')} / {_f(r['baseline_tokens_per_s'], '.0f')} | {_f(r['speedup'])}x | "
            f"{_f(r.get('frac_draft'), '.0%')} | "
            f"{'yes' if r.get('outputs_match_baseline') else 'NO'} | {'yes' if r.get('target_modified') else 'no'} |"
        )
    for name, r in (trees or {}).items():
        lines.append(f"| {name} tree | same heads, static tree of {args.tree_nodes} nodes (depth "
                     f"<= {len(r.get('acceptance_per_position') or [])}) chosen from the measured per-head top-k "
                     f"accuracy; α@i = acceptance at depth i | | | {_f(r['tau'])} | {_f(r['alpha'])} | "
                     + " | ".join(_f(a) for a in (list(r.get("acceptance_per_position") or []) + [None] * K)[:K])
                     + f" | {_f(r['tokens_per_s'], '.0f')} / {_f(r['baseline_tokens_per_s'], '.0f')} | "
                     f"{_f(r['speedup'])}x | {_f(r.get('frac_draft'), '.0%')} | "
                     f"{'yes' if r.get('outputs_match_baseline') else 'NO'} | "
                     f"{'yes' if r.get('target_modified') else 'no'} |")
    if drift:
        lines += ["", f"Medusa-2 changed the target: the adapted target's greedy output equals the original target's "
                  f"on {drift['identical']}/{drift['prompts']} prompts (mean common prefix {drift['mean_common_prefix']:.1f}"
                  f" of {drift['mean_len']:.1f} tokens); its row is measured against the adapted target's AR."]
    if sampled:
        lines += ["", "Sampling (temperature 1, lossless rejection sampling; same drafters, prompts and K):", "",
                  "| method | τ | α | " + " | ".join(f"α@{i + 1}" for i in range(K)) + " | speedup |",
                  "|---|---:|---:|" + "---:|" * K + "---:|"]
        for name, r in sampled.items():
            app = list(r.get("acceptance_per_position") or []) + [None] * K
            lines.append(f"| {name} | {_f(r['tau'])} | {_f(r['alpha'])} | " + " | ".join(_f(a) for a in app[:K])
                         + f" | {_f(r['speedup'])}x |")
    train_cols = [(n, res["last"]) for n, res in results.items() if res["last"]]
    if train_cols:
        lines += ["", "Last 10 training steps (training data, mean): loss, and for the heads/drafts top-1 agreement with the "
                  "label or target (`acc_0`), for the distilled drafts E[Σ min(p, q)] against the target (`accept`), for "
                  "Medusa-2 the KL of the adapted target to the original (`lm_loss`) and how often their argmax "
                  "agree (`lm_agree`):", "",
                  "| method | loss | acc_0 | accept | lm_loss | lm_agree |", "|---|---:|---:|---:|---:|---:|"]
        for n, h in train_cols:
            lines.append(f"| {n} | {_f(h.get('loss'), '.3f')} | {_f(h.get('acc_0'))} | {_f(h.get('accept'))} | "
                         f"{_f(h.get('lm_loss'), '.4f')} | {_f(h.get('lm_agree'), '.3f')} |")
    lines.append("")
    lines.append("Commands (each run's full config is in its `.hydra/config.yaml`):")
    lines.append("")
    lines.append("```")
    lines.append(" ".join(["python scripts/compare.py", f"--steps {args.steps}", f"--batch-size {args.batch_size}",
                           f"--num-train {args.num_train}", f"--num-prompts {args.num_prompts}",
                           f"--max-new-tokens {args.max_new_tokens}", f"-K {K}", f"--methods {args.methods}",
                           f"--sampled '{args.sampled}'"]
                          + list(args.overrides)))
    for name, res in results.items():
        if res["recipe"]:
            lines.append(f"# {name}: accelerate launch train.py recipe={res['recipe']} "
                         + " ".join(res["extra"] + [f"train.max_steps={args.steps}", f"train.batch_size={args.batch_size}",
                                                    f"data.num_train={args.num_train or 'null'}"]))
        else:
            lines.append(f"# {name}: drafttrain eval " + " ".join(res["extra"]))
    for name in trees or {}:
        lines.append(f"# {name} tree: drafttrain eval drafter=runs/compare/{name}/final decode.tree.enabled=true "
                     f"decode.tree.total_tokens={args.tree_nodes}")
    for name in sampled or {}:
        lines.append(f"# {name} at T=1: drafttrain eval drafter=runs/compare/{name}/final decode.temperature=1.0")
    lines.append("```")
    text = "\n".join(lines) + "\n"
    # keep hand-written analysis around the generated block (between the markers) when rerun
    begin, end = "<!-- compare.py: begin generated -->\n", "<!-- compare.py: end generated -->\n"
    old = out.read_text() if out.exists() else ""
    if begin in old and end in old:
        text = old[: old.index(begin) + len(begin)] + text + old[old.index(end):]
    else:
        text = begin + text + end
    write_text(out, text)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from drafttrain.io import atomic_path

    names = list(results)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=120, gridspec_kw={"width_ratios": [3, 2]})
    K = max(len(results[n]["report"].get("acceptance_per_position") or []) for n in names)
    w = 0.8 / max(1, len(names))
    for j, n in enumerate(names):
        app = [a if a is not None else 0.0 for a in (results[n]["report"].get("acceptance_per_position") or [])]
        a1.bar([i + 1 + (j - (len(names) - 1) / 2) * w for i in range(len(app))], app, width=w, label=n)
    a1.set_xticks(range(1, K + 1))
    a1.set_xlabel("draft position")
    a1.set_ylabel("P(accepted | reached)")
    a1.set_ylim(0, 1)
    a1.legend(fontsize=7, ncol=2)
    taus = [results[n]["report"]["tau"] or 0 for n in names]
    sps = [results[n]["report"]["speedup"] or 0 for n in names]
    x = range(len(names))
    a2.bar([i - 0.2 for i in x], taus, width=0.4, label="τ (tokens / target forward)")
    a2.bar([i + 0.2 for i in x], sps, width=0.4, label="speedup (CPU)")
    a2.axhline(1.0, color="grey", lw=0.8)
    a2.set_xticks(list(x))
    a2.set_xticklabels(names, rotation=30, fontsize=8)
    a2.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
