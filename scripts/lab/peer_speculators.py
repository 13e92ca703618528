#!/usr/bin/env python
"""Peer comparison: drafttrain's EAGLE-3 trainer against speculators' (vLLM project) ``Eagle3DraftModel``.

    scripts/make_speculators_venv.sh /tmp/spec_site          # speculators 0.9.0 importable beside the main env
    DRAFTTRAIN_CACHE=/tmp/dtcache OMP_NUM_THREADS=1 python scripts/lab/peer_speculators.py --target builtin \
        --steps 100 --spec-path /tmp/spec_site --runs /tmp/peer --out bench/notebook/peer_speculators.md

Rows (one process each, one thread, run one after the other):

- ``drafttrain``: ``train.py recipe=eagle3`` (drafttrain's defaults) with the protocol's data and budget.
- ``spec_same``: speculators' ``Eagle3DraftModel`` (its model class: fc / fc_norm / input_norm, its Llama first layer
  with hidden_norm, its TTT unroll with its dense document + diagonal masks, its frozen target lm_head rows, its
  teacher ``verifier_lm_head(verifier_norm(last hidden))``) and its loss (``compute_metrics`` -> ``compound_loss``
  with the eager ``kl_div``, or the loss ``--spec-loss`` names, e.g. ``ce``: hard labels on the target's argmax; such
  a row trains into ``spec_same_<loss>/``), fed by speculators' own ``shift_batch`` + ``CollateFn`` (one packed row
  per step), with drafttrain's hyper-parameters: the same 16 conversations per optimizer step in the same order
  (drafttrain.training.batching), the same target features (the 3 taps, HF ``hidden_states`` indices, and the last
  decoder layer's output before the final norm, as vLLM hands speculators), the same draft vocabulary (d2t / t2d),
  architecture (1 Llama layer sized like drafttrain's), norms (fc_norm, norm_output on; norm_before_residual,
  norm_before_fc off), TTT 7, step decay 0.8, drafttrain's optimizer (``train.optimizer``: AdamW with its lr / betas /
  weight decay; ``muon``: torch's Muon over speculators' own Muon split at drafttrain's muon_lr / momentum, AdamW on
  the rest), its warm-up + cosine schedule, gradient clip, seed.
- ``spec_defaults``: the same model, loss and data, with speculators' own eagle3 defaults
  (speculators.train.config.schema): TTT 3, decay 1.0, norm_before_residual + norm_before_fc + norm_output
  on, fc_norm off, Muon (2-D weights) + AdamW (the rest) via ``speculators.train.optimizers.build_optimizers``,
  lr 1e-3, linear schedule with 1% warm-up, clip 1.0.

What of speculators does not run: its ``Trainer`` (the loop above replaces it: forward, zero_grad, backward,
clip, optimizer and scheduler steps, in its order), its vLLM hidden-state generation (drafttrain's target forward
replaces it) and its Triton-fused losses (the eager ones are the same math; Triton kernels need a GPU). Training
runs in float32 on the CPU (speculators' trainer autocasts to bf16 on a GPU; drafttrain is float32 on CPU);
``draft_attn_impl=eager`` (flex attention needs compilation on a GPU). Both speculators drafters are saved
with ``save_pretrained`` (speculators' layout) and every row is scored by ``drafttrain eval`` (the same
held-out prompts and decoder settings: greedy, chain, K = 4), which reads speculators' checkpoints through
``drafttrain.artifacts.load_drafter``.
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
sys.path.insert(0, str(REPO))

from drafttrain.io import write_json  # noqa: E402

ROWS = ("drafttrain", "spec_same", "spec_defaults")
DESCRIPTION = {
    "drafttrain": "drafttrain default recipe (train.py recipe=eagle3)",
    "spec_same": "speculators Eagle3DraftModel + its loss, drafttrain's settings",
    "spec_defaults": "speculators Eagle3DraftModel + its loss, speculators' eagle3 defaults",
}


def common_overrides(a) -> list[str]:
    """The data and decoder settings every row shares (the training-quality protocol's)."""
    return [f"target={a.target}", "data=builtin", f"data.num_train={a.num_train}", f"data.max_length={a.max_length}",
            f"data.num_eval={a.num_prompts}", f"decode.num_prompts={a.num_prompts}",
            f"decode.max_new_tokens={a.max_new_tokens}", f"decode.num_draft_tokens={a.K}", "decode.temperature=0.0",
            "decode.sweep=[]"]


def budget_overrides(a) -> list[str]:
    return [f"train.max_steps={a.steps}", f"train.batch_size={a.batch_size}", "train.micro_batch_size=8",
            f"train.seed={a.seed}", "train.save_every=0", "logger=none", *a.set]


def env_for(a, speculators: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "DRAFTTRAIN_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"}
    if speculators:
        env["PYTHONPATH"] = os.pathsep.join([a.spec_path, str(REPO)] + ([env["PYTHONPATH"]] if env.get(
            "PYTHONPATH") else []))
    return env


def cpu_seconds_of(cmd: list[str], log: Path, env: dict) -> tuple[float, float]:
    """Run ``cmd`` (its output to ``log``); (wall seconds, child CPU seconds user+system)."""
    before = os.times()
    t0 = time.time()
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    wall = time.time() - t0
    after = os.times()
    if r.returncode:
        tail = "".join(open(log).readlines()[-30:])
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}); log {log}:\n{tail}")
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system)


# ------------------------------------------------------------------------------------------ driver
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--target", default="builtin", help="Hydra target group or directory (builtin, builtin-docs)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-train", type=int, default=1024)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("-K", type=int, default=4)
    ap.add_argument("--spec-path", default="/tmp/spec_site", help="directory with speculators 0.9.0 importable "
                    "(scripts/make_speculators_venv.sh)")
    ap.add_argument("--runs", default="/tmp/peer")
    ap.add_argument("--out", default=str(REPO / "bench" / "notebook" / "peer_speculators.md"))
    ap.add_argument("--fresh", action="store_true", help="retrain rows whose drafter exists")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a Hydra override for every row's settings (repeatable), e.g. train.warmup_steps=20")
    ap.add_argument("--spec-loss", default="kl_div",
                    help="spec_same's loss: a speculators loss name (kl_div, ce = hard labels on the target's "
                         "argmax, reverse_kl, js, tv, ...) or its JSON mix, e.g. '{\"ce\": 0.5, \"kl_div\": 0.5}'")
    ap.add_argument("--worker", choices=["spec_same", "spec_defaults"], help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return train_speculators(a, a.worker, Path(a.run_dir))

    rows = [r for r in a.rows.split(",") if r]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        ap.error(f"unknown rows {bad}; expected some of {ROWS}")
    tag = Path(a.target).name if "/" in a.target else a.target
    base = Path(a.runs) / f"{tag}_steps{a.steps}_seed{a.seed}"
    base.mkdir(parents=True, exist_ok=True)
    results = []
    for row in rows:
        run = base / run_name(row, a.spec_loss)
        drafter = run / ("final" if row == "drafttrain" else "drafter")
        meta_path = run / "peer_train.json"
        if row == "drafttrain":
            cmd = [sys.executable, str(REPO / "train.py"), "recipe=eagle3", *common_overrides(a), *budget_overrides(a),
                   f"hydra.run.dir={run}"]
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", row, "--run-dir", str(run),
                   *[x for k, v in vars(a).items() if k in ("target", "steps", "batch_size", "seed", "num_train",
                                                               "max_length", "num_prompts", "max_new_tokens",
                                                               "spec_loss")
                     for x in (f"--{k.replace('_', '-')}", str(v))], "-K", str(a.K),
                   *[x for o in a.set for x in ("--set", o)]]
        if not (drafter.exists() and meta_path.exists()) or a.fresh:
            run.mkdir(parents=True, exist_ok=True)
            print(f"[peer] {row}: training: {' '.join(cmd[1:])}", flush=True)
            wall, cpu = cpu_seconds_of(cmd, base / f"{run.name}.train.log", env_for(a, row != "drafttrain"))
            extra = json.loads(meta_path.read_text()) if meta_path.exists() else {}
            meta_path.write_text(json.dumps({**extra, "wall_s": wall, "cpu_s": cpu, "cmd": cmd[1:]}, indent=1))
        meta = json.loads(meta_path.read_text())
        ev = run / "eval"
        ecmd = [sys.executable, "-m", "drafttrain.cli", "eval", f"drafter={drafter}", *common_overrides(a),
                f"hydra.run.dir={ev}"]
        if not (ev / "report.json").exists() or a.fresh:
            print(f"[peer] {row}: eval: {' '.join(ecmd[1:])}", flush=True)
            cpu_seconds_of(ecmd, base / f"{run.name}.eval.log", env_for(a, False))
        rep = json.loads((ev / "report.json").read_text())
        results.append({"row": row, "description": DESCRIPTION[row], "target": rep["target"], "steps": a.steps,
                        "batch_size": a.batch_size, "seed": a.seed, "tau": rep["tau"], "alpha": rep["alpha"],
                        "acceptance_per_position": rep["acceptance_per_position"],
                        "outputs_match_baseline": rep["outputs_match_baseline"], "train_wall_s": meta["wall_s"],
                        "train_cpu_s": meta["cpu_s"], "settings": meta.get("settings"),
                        "speculators_ran": meta.get("speculators_ran"), "final_loss": meta.get("final_loss"),
                        "overrides": list(a.set), "spec_loss": a.spec_loss if row == "spec_same" else None,
                        "train_cmd": " ".join(meta["cmd"]),
                        "eval_cmd": " ".join(ecmd[1:])})
    write_outputs(a, results)
    return 0


def run_name(row: str, spec_loss: str) -> str:
    """A row's run directory: spec_same with another loss than kl_div trains into its own directory (a cached
    kl_div drafter is never reused for it)."""
    if row != "spec_same" or spec_loss == "kl_div":
        return row
    return f"{row}_" + "".join(ch if ch.isalnum() else "_" for ch in spec_loss).strip("_")


def _loss_of(r: dict):
    """spec_same's loss of a result row (rows written before --spec-loss existed trained with kl_div)."""
    return r.get("spec_loss") or ("kl_div" if r["row"] == "spec_same" else None)


def write_outputs(a, results: list[dict]) -> None:
    out = Path(a.out)
    js = out.parent / "results" / "peer_speculators.json"
    js.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(js.read_text()) if js.exists() else {"rows": []}
    keep = [r for r in old.get("rows", []) if not any(
        r["row"] == n["row"] and r["target"] == n["target"] and r["steps"] == n["steps"] and r["seed"] == n["seed"]
        and r.get("overrides", []) == n["overrides"] and _loss_of(r) == _loss_of(n) for n in results)]
    allrows = keep + results
    spec_version = "0.9.0"
    write_json(js, {"speculators_version": spec_version, "rows": allrows})
    print(f"wrote {js}")
    lines = ["| target | row | τ | α | α@1 | α@2 | α@3 | α@4 | steps x batch | train wall s | train CPU s | "
             "greedy == AR |", "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in allrows:
        acc = list(r["acceptance_per_position"]) + [None] * 4
        row = " ".join([r["row"] + ("" if _loss_of(r) in (None, "kl_div") else f" (loss {_loss_of(r)})"),
                        *r.get("overrides", [])])
        lines.append(f"| {Path(r['target']).name} | {row} | {r['tau']:.2f} | {r['alpha']:.2f} | "
                     + " | ".join("" if x is None else f"{x:.2f}" for x in acc[:4])
                     + f" | {r['steps']} x {r['batch_size']} | {r['train_wall_s']:.0f} | {r['train_cpu_s']:.0f} | "
                     f"{r['outputs_match_baseline']} |")
    table = "\n".join(lines)
    begin, end = "<!-- peer_speculators.py: begin generated -->", "<!-- peer_speculators.py: end generated -->"
    body = f"{begin}\n{table}\n{end}"
    if out.exists() and begin in out.read_text():
        text = out.read_text()
        text = text[:text.index(begin)] + body + text[text.index(end) + len(end):]
    else:
        text = f"# Peer comparison: drafttrain vs speculators {spec_version}\n\n{body}\n"
    out.write_text(text)
    print(table)
    print(f"wrote {out}")


# ------------------------------------------------------------------------------------------ worker
def train_speculators(a, row: str, run_dir: Path) -> int:
    """Train speculators' Eagle3DraftModel on drafttrain's rows / order / features; save it in speculators'
    layout under ``run_dir/drafter``."""
    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from drafttrain.cli import CONF_DIR, expand_shorthands
    from drafttrain.data.select import load_training_data
    from drafttrain.targets.load import gather_taps, load_target, target_id
    from drafttrain.training import batching
    from drafttrain.training.loop import lr_lambda
    from drafttrain.training.method import make_method

    import importlib.metadata as md

    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.config.schema import LossArgs, OptimizerArgs
    from speculators.train.data import CollateFn
    from speculators.train.optimizers import build_optimizers
    from transformers import LlamaConfig, get_linear_schedule_with_warmup

    torch.set_num_threads(1)
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = ["recipe=eagle3", *common_overrides(a), *budget_overrides(a)]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("train", overrides=expand_shorthands(overrides))
    job = OmegaConf.to_object(cfg)
    tc, ec = job.train, job.eagle3
    model, tok, path = load_target(job.target, device=torch.device("cpu"))
    tname = target_id(path)
    examples, _, _ = load_training_data(job, model, tok, tname, run_dir)
    method = make_method(job, tok, model)
    ref = method.build_drafter(model, examples, tname)  # drafttrain's drafter: its d2t / t2d and its sizes
    c = ref.config
    taps = [int(t) for t in method.taps]

    same = row == "spec_same"
    if same:
        st = dict(ttt_steps=int(ec.ttt_steps), decay=float(ec.step_decay), norm_before_residual=bool(
            ec.norm_before_residual), norm_before_fc=bool(ec.norm_before_fc), fc_norm=bool(ec.fc_norm),
            norm_output=bool(ec.norm_output), optimizer=str(tc.optimizer), lr=float(tc.lr), betas=list(tc.betas),
            weight_decay=float(tc.weight_decay), schedule=f"drafttrain warm-up {tc.warmup_steps} + cosine to "
            f"{tc.min_lr_ratio} x lr", grad_clip=float(tc.grad_clip), loss=str(a.spec_loss))
        if tc.optimizer == "muon":  # drafttrain's Muon settings (drafttrain/training/optim.py)
            from drafttrain.training.optim import MUON_ADJUST_LR_FN

            st.update(muon_lr=float(tc.muon_lr), muon_momentum=float(tc.muon_momentum),
                      muon_adjust_lr_fn=MUON_ADJUST_LR_FN)
    else:
        oa, la = OptimizerArgs(), LossArgs()
        st = dict(ttt_steps=int(la.ttt_steps), decay=float(la.ttt_step_loss_decay), norm_before_residual=True,
                  norm_before_fc=True, fc_norm=False, norm_output=True, optimizer=oa.optimizer, lr=float(oa.lr),
                  muon_lr=float(oa.muon_lr if oa.muon_lr is not None else oa.lr), weight_decay=float(oa.weight_decay),
                  muon_weight_decay=float(oa.muon_weight_decay), muon_momentum=float(oa.muon_momentum),
                  muon_ns_steps=int(oa.muon_ns_steps), muon_adjust_lr_fn=oa.muon_adjust_lr_fn,
                  schedule="linear, warm-up 1% of the steps", grad_clip=1.0, loss="kl_div")
    print(f"[peer] {row}: settings {st}", flush=True)

    layer_cfg = LlamaConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps, vocab_size=c.vocab_size, max_position_embeddings=c.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(c.rope_theta)}, attention_bias=False,
        mlp_bias=False, tie_word_embeddings=False, initializer_range=c.initializer_range)
    torch.manual_seed(tc.seed)
    spec = Eagle3DraftModel.from_training_args(
        layer_cfg, t2d=ref.t2d.clone(), d2t=ref.d2t.clone(), draft_vocab_size=int(c.draft_vocab_size),
        norm_before_residual=st["norm_before_residual"], norm_before_fc=st["norm_before_fc"], fc_norm=st["fc_norm"],
        norm_output=st["norm_output"], ttt_steps=st["ttt_steps"], verifier_name_or_path=str(path),
        target_layer_ids=taps, draft_attn_impl="eager")
    spec.train()
    n_train = sum(p.numel() for p in spec.parameters() if p.requires_grad)
    print(f"[peer] {row}: speculators Eagle3DraftModel, {n_train / 1e6:.3f}M trainable params, taps {taps}, "
          f"draft vocab {c.draft_vocab_size}", flush=True)
    loss_config = resolve_loss_config(st["loss"], "eager")

    if same:
        if st["optimizer"] == "muon":  # speculators' own Muon / AdamW split, at drafttrain's settings and betas
            from speculators.train.optimizers import split_named_params_for_muon

            muon_named, adamw_named = split_named_params_for_muon(spec)
            opts = [torch.optim.Muon([p for _, p in muon_named], lr=st["muon_lr"], momentum=st["muon_momentum"],
                                     weight_decay=st["weight_decay"], adjust_lr_fn=st["muon_adjust_lr_fn"]),
                    torch.optim.AdamW([p for _, p in adamw_named], lr=st["lr"], betas=tuple(st["betas"]),
                                      weight_decay=st["weight_decay"])]
        else:
            opts = [torch.optim.AdamW([p for p in spec.parameters() if p.requires_grad], lr=st["lr"],
                                      betas=tuple(st["betas"]), weight_decay=st["weight_decay"])]
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(tc.warmup_steps, tc.max_steps, tc.min_lr_ratio))
                  for o in opts]
    else:
        from types import SimpleNamespace

        opts = build_optimizers(spec, SimpleNamespace(**{k: st[k] for k in (
            "optimizer", "lr", "weight_decay", "muon_lr", "muon_momentum", "muon_weight_decay", "muon_ns_steps",
            "muon_adjust_lr_fn")}))
        scheds = [get_linear_schedule_with_warmup(o, num_warmup_steps=tc.max_steps // 100,
                                                  num_training_steps=tc.max_steps) for o in opts]

    # the target's features, per conversation (no padding): taps and the input of the final norm
    norm = model.get_decoder().norm
    seen: list = []
    hook = norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))

    @torch.no_grad()
    def features(ex: dict) -> dict:
        ids = torch.tensor(ex["input_ids"], dtype=torch.long)[None]
        seen.clear()
        out = model.get_decoder()(input_ids=ids, output_hidden_states=True, use_cache=False)
        T = ids.shape[1]
        return {"input_ids": ids[0], "hidden_states": gather_taps(out.hidden_states, taps)[0].float(),
                "verifier_last_hidden_states": seen[-1][0].float(),
                "loss_mask": torch.tensor(ex["loss_mask"], dtype=torch.long), "lengths": torch.tensor([T]),
                "position_ids": torch.arange(T)}

    plan = batching.make_plan(tc.batch_size, tc.micro_batch_size, 1)
    H = c.target_hidden_size
    t0 = time.time()
    cpu0 = time.process_time()
    history = []
    for step in range(tc.max_steps):
        idx = [i for mb in batching.micro_batches(len(examples), plan, step, tc.seed, 0) for i in mb]
        items = [features(examples[i]) for i in idx]
        total = sum(int(x["lengths"][0]) - 1 for x in items)  # shift_batch drops one token per conversation
        batch = CollateFn(max_len=total, hidden_size=H, num_target_layers=3, dtype=torch.float32,
                          preprocess=shift_batch)(items)
        batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        _draft, loss, metrics = spec(**batch, ttt_steps=st["ttt_steps"], ttt_step_loss_decay=st["decay"],
                                     loss_config=loss_config)
        for o in opts:
            o.zero_grad()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(spec.parameters(), st["grad_clip"])
        for o in opts:
            o.step()
        for s in scheds:
            s.step()
        acc = [float(metrics[f"full_acc_{i}_sum"] / max(float(metrics[f"full_acc_{i}_total"]), 1.0))
               for i in range(st["ttt_steps"])]
        history.append({"step": step + 1, "loss": float(loss), "grad_norm": float(gn), "full_acc": acc})
        if step % 10 == 0 or step + 1 == tc.max_steps:
            print(f"[peer] {row}: step {step + 1}/{tc.max_steps} loss {float(loss):.4f} tokens {total} "
                  f"acc {[round(x, 3) for x in acc]} lr {scheds[0].get_last_lr()[0]:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
    hook.remove()
    train_s, train_cpu = time.time() - t0, time.process_time() - cpu0
    spec.eval()
    out = run_dir / "drafter"
    spec.save_pretrained(str(out))
    ran = ("speculators.models.eagle3.Eagle3DraftModel (from_training_args, load_vocab_mappings, "
           "load_verifier_weights, forward: TTT unroll, masks, teacher, compute_metrics), "
           "speculators.losses (resolve_loss_config kl_div eager, compound_loss), speculators.models.eagle3.data."
           "shift_batch, speculators.train.data.CollateFn, save_pretrained"
           + ("" if same else ", speculators.train.optimizers.build_optimizers (Muon + AdamW), "
              "transformers.get_linear_schedule_with_warmup as speculators' trainer builds it"))
    (run_dir / "peer_train.json").write_text(json.dumps({
        "row": row, "speculators_version": md.version("speculators"), "settings": st, "speculators_ran": ran,
        "loop_s": train_s, "loop_cpu_s": train_cpu, "final_loss": history[-1]["loss"], "history": history},
        indent=1))
    print(f"[peer] {row}: saved {out} ({train_s:.0f}s, {train_cpu:.0f} CPU-s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
