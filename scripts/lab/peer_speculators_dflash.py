#!/usr/bin/env python
"""Peer comparison: drafttrain's DFlash trainer against speculators' (vLLM project) ``DFlashDraftModel``.

    bash scripts/make_speculators_venv.sh /tmp/spec_site     # speculators 0.9.0 importable beside the main env
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 DRAFTTRAIN_THREADS=1 python scripts/lab/peer_speculators_dflash.py \
        --target builtin --steps 300 --seed 0 --spec-path /tmp/spec_site --runs /tmp/peer_dflash

Rows (one process each, one thread, run one after the other; every row scored by ``drafttrain eval``):

- ``drafttrain``: ``train.py recipe=dflash`` (drafttrain's DFlash defaults, plus any ``--set dflash.*=...``) with
  the protocol's data and budget (peer_speculators.py's), decode.num_draft_tokens = K (default block_size - 1).
- ``spec_same``: speculators' ``DFlashDraftModel`` and its loss at drafttrain's settings, on drafttrain's data and
  features: the same conversations per optimizer step in the same order (drafttrain.training.batching), the
  target's features computed by drafttrain's target forward (the taps at HF ``hidden_states`` indices = drafttrain's
  0-based ``dflash.target_layer_ids`` + 1, which is speculators' ``target_layer_ids`` / ``aux_hidden_state_layer_ids``
  convention, and the last decoder layer's output before the final norm, what vLLM hands speculators), the same
  draft layer count and shape (its own ``create_transformer_layer_config`` with every layer full attention), block
  size, mask token id, taps, full target vocabulary (no d2t / t2d: drafttrain's DFlash drafts over the target's
  vocabulary), ``max_anchors`` = drafttrain's ``dflash.num_anchors`` per conversation (see "rows" below), loss
  ``ce`` for drafttrain's ``dflash.loss=ce`` (``kl_div`` for ``kd``; ``--spec-loss`` overrides), position weights
  ``fixed-exp-decay`` with drafttrain's gamma (``dpace`` with its alpha for ``dflash.slot_weights=dpace``),
  drafttrain's optimizer (AdamW lr / betas / weight decay, or torch Muon over speculators' own Muon split),
  warm-up + cosine schedule, gradient clip and seed.
- ``spec_defaults``: the same model class and data with speculators' own DFlash defaults, read from its
  ``speculators.train.config.schema.TrainConfig(speculator_type="dflash")``: 5 layers, block 16, its default
  taps (``resolve_target_layer_ids``: HF indices [2, L//2, L-3]), its mask token (``resolve_mask_token_id``), loss
  ``ce`` with D-PACE position weights (alpha 0.5), ``max_anchors`` 512 per packed row, sliding-window 2048
  layers (``create_transformer_layer_config``), Muon + AdamW (``build_optimizers``: lr 1e-3, muon_lr 1e-3, its
  weight decays, momentum, Newton-Schulz steps, ``match_rms_adamw``), a linear schedule with 1% warm-up
  (``_resolve_scheduler_steps``), clip 1.0 (its Trainer's constant). One setting is changed and cannot be
  kept: speculators' default ``sliding_window_non_causal`` is false, i.e. its sliding-window layers are causal
  inside the block (and vLLM serves the checkpoint causal: ``causal = not sliding_window_non_causal``), while
  drafttrain's DFlash decoder (and its reader, drafttrain.artifacts) is bidirectional only; so spec_defaults trains
  with ``sliding_window_non_causal=true`` (speculators' own flag, DFlash2's default). The 2048 window is longer
  than any sequence here (training rows <= data.max_length per conversation, eval prompt + max_new_tokens), so its
  sliding-window layers then compute exactly what full-attention layers would.

Rows of a step (how the step's conversations reach speculators' forward): speculators' ``select_anchors`` draws
``max_anchors`` anchors per packed row, uniformly among the row's supervised positions (``loss_mask``) outside the
row's last ``block_size`` positions. spec_defaults packs the step's conversations into one row, as its data loader
would (``CollateFn``; padded by ``block_size`` positions, which for a row shorter than its total_seq_len, 8192,
selects exactly what its padding to 8192 selects, at less cost), with its default 512 anchors for the row. spec_same
runs one row per conversation (each padded by ``block_size``) with ``max_anchors`` = drafttrain's
``dflash.num_anchors``, so every conversation gets min(num_anchors, supervised positions) anchors drawn by
speculators' own ``select_anchors``, as drafttrain draws num_anchors per conversation (one packed row would instead
spread num_anchors x batch anchors at random over the step and, on the CPU, build a dense [A*B, T + A*B] eager
attention of ~5 GB per layer). The rows' losses are combined as sum_r loss_r * n_r / sum_r n_r (n_r = the row's
scored slots, speculators' ``loss_function`` denominator), which is speculators' loss of one row holding all the
step's blocks; one backward per step.

Cost on the CPU: speculators' forward always builds ``max_anchors`` blocks (invalid ones padded and masked), so
a row's eager attention is dense over [max_anchors * block_size, T + max_anchors * block_size] per layer. spec_same
(64 x 16 queries per conversation, 1 layer) costs about 3 s per step of 16 conversations here; spec_defaults (one row of
512 x 16 = 8192 queries, 5 layers) about 60-70 s and 10 GB per step with ``eager`` on this 2-core machine, about
20 s and 3.4 GB with ``--spec-attn sdpa`` (speculators' other CPU attention; the same mask and math, and the same
step-1 loss to 4 digits in a check), i.e. hours at 300 steps.

What of speculators runs: ``speculators.models.dflash.DFlashDraftModel`` (``from_training_args``: its config, its
Qwen3 DFlash layers, its initialisation, ``load_verifier_weights``: the frozen embedding, lm_head and verifier norm
from the target's checkpoint; ``forward``: ``select_anchors``, its anchor block mask
``create_anchor_block_mask_mod`` as a dense float mask (``draft_attn_impl=eager``), mask-token blocks, the teacher
``verifier_lm_head(verifier_norm(last hidden))`` shifted by one, its ``compute_metrics``), ``speculators.losses``
(``resolve_loss_config(.., "eager")``, ``compound_loss`` / ``loss_function``, ``dflash_loss_decay`` or
``dpace_loss_decay``, through ``DFlashDraftModel.get_trainer_kwargs``), ``speculators.train.data.CollateFn`` (rows,
document ids, padding), ``speculators.train.cli.create_transformer_layer_config``,
``speculators.models.utils.resolve_target_layer_ids`` and ``save_pretrained`` (its checkpoint layout); for
spec_defaults also ``TrainConfig``'s dflash defaults, ``speculators.train.utils.resolve_mask_token_id``,
``speculators.train.optimizers.build_optimizers`` and its trainer's ``_resolve_scheduler_steps`` with
``transformers.get_linear_schedule_with_warmup``.

What does not run: its ``Trainer`` (the loop below does what ``Trainer.train_epoch`` does, in its order: forward,
zero_grad, backward, clip, optimizer steps, scheduler steps), its vLLM hidden-state generation (drafttrain's target
forward gives the tensors vLLM would: the taps and the last decoder layer's pre-norm output), its Triton-fused
losses (the eager ones are the same math; Triton needs a GPU), flex attention (it needs compilation on a GPU;
``eager`` is speculators' own CPU option) and its bf16 autocast (a GPU setting; everything here is float32 on the
CPU, as drafttrain trains on the CPU).

Scoring: speculators' ``save_pretrained`` checkpoint (speculators layout: ``speculators_model_type: dflash``,
``aux_hidden_state_layer_ids`` = HF indices, ``transformer_layer_config``, bare tensor names, no embedding, no
lm_head for a full-vocabulary draft) is read by drafttrain's own reader (drafttrain.artifacts.load_dflash /
read_dflash_export) unchanged, and ``drafttrain eval drafter=<dir>`` scores it with the same held-out prompts and
decoder settings as the drafttrain row (greedy chain, K drafts per round). The worker checks the read-back:
speculators' forward and drafttrain's DFlashDrafter loaded from the checkpoint give the same block logits
(``readback_max_abs_diff`` in peer_train.json; ~5e-6 in the smoke run). Should a future speculators write a
config our reader refuses, the worker writes a converted copy (``drafter_converted/``, drafttrain.export.dflash's
``vllm`` layout, the same tensors) and records the reader's refusal, which names the field (``conversion`` in
peer_train.json), and that copy is scored; with 0.9.0 none is needed: its config carries every field our reader
needs (the extra ones, ``architectures: [DFlashDraftModel]``, ``auto_map``, ``draft_vocab_size``,
``sample_from_anchor``, ``speculators_config``, ``target_hidden_size: null``, ``layer_types``,
``sliding_window``, are ignored or fall back to the target's), and its tensors have our names.

Outputs: bench/results/peer_speculators_dflash_<date>.json (``--json``) and a section of
bench/notebook/peer_speculators.md (``--out``) between this script's own markers.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from drafttrain.io import write_json, write_text  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_speculators import cpu_seconds_of, env_for  # noqa: E402  (the EAGLE-3 peer's runner and environment)

ROWS = ("drafttrain", "spec_same", "spec_defaults")
DESCRIPTION = {
    "drafttrain": "drafttrain DFlash recipe (train.py recipe=dflash)",
    "spec_same": "speculators DFlashDraftModel + its loss, drafttrain's settings",
    "spec_defaults": "speculators DFlashDraftModel + its loss, speculators' dflash defaults (non-causal blocks)",
}
SPEC_VERSION = "0.9.0"
BEGIN = "<!-- peer_speculators_dflash.py: begin generated -->"
END = "<!-- peer_speculators_dflash.py: end generated -->"


def common_overrides(a) -> list[str]:
    """The data and decoder settings every row shares (peer_speculators.py's, with K = a.K drafts per round)."""
    return [f"target={a.target}", "data=builtin", f"data.num_train={a.num_train}", f"data.max_length={a.max_length}",
            f"data.num_eval={a.num_prompts}", f"decode.num_prompts={a.num_prompts}",
            f"decode.max_new_tokens={a.max_new_tokens}", f"decode.num_draft_tokens={a.K}", "decode.temperature=0.0",
            "decode.sweep=[]"]


def budget_overrides(a) -> list[str]:
    return [f"train.max_steps={a.steps}", f"train.batch_size={a.batch_size}",
            f"train.micro_batch_size={min(8, a.batch_size)}", f"train.seed={a.seed}", "train.save_every=0",
            "logger=none", *a.set]


def compose_job(a, with_k: bool = True):
    """drafttrain's resolved train config of the protocol (recipe=dflash + the overrides every row shares)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from drafttrain.cli import CONF_DIR, expand_shorthands

    common = common_overrides(a) if with_k else [o for o in common_overrides(a) if not o.startswith(
        "decode.num_draft_tokens=")]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("train", overrides=expand_shorthands(["recipe=dflash", *common, *budget_overrides(a)]))
    return OmegaConf.to_object(cfg)


# ------------------------------------------------------------------------------------------ driver
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--target", default="builtin", help="Hydra target group or directory (builtin, builtin-docs)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-train", type=int, default=1024)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("-K", type=int, default=None, help="drafts per round in every row's eval (default: drafttrain's "
                    "dflash.block_size - 1, after --set)")
    ap.add_argument("--spec-path", default="/tmp/spec_site", help="directory with speculators 0.9.0 importable "
                    "(scripts/make_speculators_venv.sh)")
    ap.add_argument("--runs", default="/tmp/peer_dflash")
    ap.add_argument("--out", default=str(REPO / "bench" / "notebook" / "peer_speculators.md"))
    ap.add_argument("--json", default=str(REPO / "bench" / "results" /
                                          f"peer_speculators_dflash_{time.strftime('%Y%m%d')}.json"))
    ap.add_argument("--fresh", action="store_true", help="retrain rows whose drafter exists")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a Hydra override for every row's settings (repeatable), e.g. dflash.num_anchors=32")
    ap.add_argument("--spec-loss", default=None,
                    help="spec_same's loss: a speculators loss name (ce = hard labels on the target's argmax, "
                         "kl_div, rkl, jsd, tv, ...) or its JSON mix; default: ce for dflash.loss=ce, kl_div for kd")
    ap.add_argument("--spec-attn", choices=["eager", "sdpa"], default="eager",
                    help="speculators' draft_attn_impl for both of its rows (its CPU options; flex attention needs a "
                         "GPU): eager (default) or sdpa, the same math from the same dense mask without the "
                         "[Q, T + Q] score tables (spec_defaults: about 3x faster and 3x less memory)")
    ap.add_argument("--worker", choices=["spec_same", "spec_defaults"], help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.K is None:
        a.K = int(compose_job(a, with_k=False).dflash.block_size) - 1
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
        run = base / run_name(row, a.spec_loss, a.set)
        meta_path = run / "peer_train.json"
        if row == "drafttrain":
            cmd = [sys.executable, str(REPO / "train.py"), "recipe=dflash", *common_overrides(a),
                   *budget_overrides(a), f"hydra.run.dir={run}"]
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", row, "--run-dir", str(run),
                   *[x for k, v in vars(a).items() if k in ("target", "steps", "batch_size", "seed", "num_train",
                                                               "max_length", "num_prompts", "max_new_tokens")
                     for x in (f"--{k.replace('_', '-')}", str(v))], "-K", str(a.K), "--spec-path", a.spec_path,
                   "--spec-attn", a.spec_attn,
                   *(["--spec-loss", a.spec_loss] if a.spec_loss else []), *[x for o in a.set for x in ("--set", o)]]
        trained = (run / "final").exists() if row == "drafttrain" else (run / "drafter").exists()
        retrain = not (trained and meta_path.exists()) or a.fresh
        if retrain:
            if row == "drafttrain" and run.exists() and any(run.iterdir()):
                cmd.append("train.overwrite=true")  # train.py moves the earlier run aside (<run>.old-<time>)
            run.mkdir(parents=True, exist_ok=True)
            print(f"[peer-dflash] {row}: training: {' '.join(cmd[1:])}", flush=True)
            wall, cpu = cpu_seconds_of(cmd, base / f"{run.name}.train.log", env_for(a, row != "drafttrain"))
            extra = json.loads(meta_path.read_text()) if meta_path.exists() and row != "drafttrain" else {}
            if row == "drafttrain":
                extra = drafttrain_meta(run)
            write_json(meta_path, {**extra, "wall_s": wall, "cpu_s": cpu, "cmd": cmd[1:]})
        meta = json.loads(meta_path.read_text())
        drafter = run / "final" if row == "drafttrain" else Path(meta.get("eval_drafter") or run / "drafter")
        ev = run / "eval"
        ecmd = [sys.executable, "-m", "drafttrain.cli", "eval", f"drafter={drafter}", *common_overrides(a),
                f"hydra.run.dir={ev}"]
        if not (ev / "report.json").exists() or retrain:
            if ev.exists() and any(ev.iterdir()):
                ecmd.append("overwrite=true")  # drafttrain eval moves the earlier report aside (eval.old-<time>)
            print(f"[peer-dflash] {row}: eval: {' '.join(ecmd[1:])}", flush=True)
            cpu_seconds_of(ecmd, base / f"{run.name}.eval.log", env_for(a, False))
        rep = json.loads((ev / "report.json").read_text())
        results.append({"row": row, "description": DESCRIPTION[row], "target": rep["target"], "steps": a.steps,
                        "batch_size": a.batch_size, "seed": a.seed, "K": a.K, "tau": rep["tau"],
                        "alpha": rep["alpha"], "acceptance_per_position": rep["acceptance_per_position"],
                        "outputs_match_baseline": rep["outputs_match_baseline"], "speedup": rep.get("speedup"),
                        "num_prompts": a.num_prompts, "max_new_tokens": a.max_new_tokens,
                        "train_wall_s": meta["wall_s"], "train_cpu_s": meta["cpu_s"],
                        "loop_s": meta.get("loop_s"), "loop_cpu_s": meta.get("loop_cpu_s"),
                        "settings": meta.get("settings"), "unmatched": meta.get("unmatched"),
                        "speculators_ran": meta.get("speculators_ran"), "final_loss": meta.get("final_loss"),
                        "readback_max_abs_diff": meta.get("readback_max_abs_diff"),
                        "conversion": meta.get("conversion"), "drafter": str(drafter),
                        "overrides": list(a.set), "spec_loss": meta.get("settings", {}).get("loss")
                        if row != "drafttrain" else None,
                        "train_cmd": " ".join(meta["cmd"]), "eval_cmd": " ".join(ecmd[1:])})
    write_outputs(a, results)
    return 0


def run_name(row: str, spec_loss: str | None, overrides: list[str]) -> str:
    """A row's run directory; spec_same with an explicit --spec-loss trains into its own directory, and so does
    every row with --set overrides (a cached drafter of other settings is never reused)."""
    name = row
    if row == "spec_same" and spec_loss:
        name += "_" + "".join(ch if ch.isalnum() else "_" for ch in spec_loss).strip("_")
    if overrides:
        import hashlib

        name += "_" + hashlib.sha1("\n".join(overrides).encode()).hexdigest()[:8]
    return name


def drafttrain_meta(run: Path) -> dict:
    """The drafttrain row's settings as its run recorded them (the resolved config Hydra saved)."""
    cfg = run / ".hydra" / "config.yaml"
    if not cfg.exists():
        return {}
    from omegaconf import OmegaConf

    c = OmegaConf.load(cfg)
    train_keys = ("max_steps", "batch_size", "micro_batch_size", "optimizer", "lr", "betas", "weight_decay",
                  "warmup_steps", "min_lr_ratio", "muon_lr", "muon_momentum", "grad_clip", "seed")
    st = {"dflash": OmegaConf.to_container(c.dflash, resolve=True)} if "dflash" in c else {}
    if "train" in c:
        st["train"] = {k: OmegaConf.to_container(c.train, resolve=True)[k] for k in train_keys if k in c.train}
    return {"settings": st}


def _short(x) -> str:
    return "" if x is None else f"{x:.2f}"


def write_outputs(a, results: list[dict]) -> None:
    js = Path(a.json)
    js.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(js.read_text()) if js.exists() else {"rows": []}
    keep = [r for r in old.get("rows", []) if not any(
        r["row"] == n["row"] and r["target"] == n["target"] and r["steps"] == n["steps"] and r["seed"] == n["seed"]
        and r.get("overrides", []) == n["overrides"] and r.get("spec_loss") == n["spec_loss"] for n in results)]
    allrows = sorted(keep + results, key=lambda r: (str(r["target"]), r["steps"], r["seed"], r.get("overrides", []),
                                                     ROWS.index(r["row"])))
    write_json(js, {"speculators_version": SPEC_VERSION, "script": "scripts/lab/peer_speculators_dflash.py",
                    "rows": allrows})
    print(f"wrote {js}")
    lines = ["| target | row | K | τ | α | α@1 | α@2 | α@3 | α@4 | steps x batch | train wall s | train CPU s | "
             "greedy == AR |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in allrows:
        acc = list(r["acceptance_per_position"]) + [None] * 4
        name = " ".join([r["row"] + (f" (loss {r['spec_loss']})" if r["row"] == "spec_same" and r.get("spec_loss")
                                     not in (None, "ce") else ""), *r.get("overrides", [])])
        lines.append(f"| {Path(r['target']).name} | {name} | {r['K']} | {r['tau']:.2f} | {r['alpha']:.2f} | "
                     + " | ".join(_short(x) for x in acc[:4])
                     + f" | {r['steps']} x {r['batch_size']} | {r['train_wall_s']:.0f} | {r['train_cpu_s']:.0f} | "
                     f"{r['outputs_match_baseline']} |")
    details = []
    for r in allrows:
        details.append(f"- **{r['row']}** ({Path(r['target']).name}, seed {r['seed']}, {r['steps']} x "
                       f"{r['batch_size']}): acceptance per position "
                       f"{' / '.join('-' if x is None else f'{x:.2f}' for x in r['acceptance_per_position'])}")
        if r.get("settings"):
            details.append(f"  - settings: `{json.dumps(r['settings'], sort_keys=True)}`")
        for u in r.get("unmatched") or []:
            details.append(f"  - not matched: {u}")
        if r.get("readback_max_abs_diff") is not None:
            details.append(f"  - read back by drafttrain.artifacts.load_dflash: block logits max abs diff "
                           f"{r['readback_max_abs_diff']:.2e} against speculators' forward"
                           + (f"; converted: {r['conversion']}" if r.get("conversion") else ", no conversion"))
        if r.get("loop_s") is not None:
            details.append(f"  - training loop alone: {r['loop_s']:.0f} s wall, {r['loop_cpu_s']:.0f} CPU-s")
        details.append(f"  - train: `python {r['train_cmd']}`")
        details.append(f"  - eval: `python {r['eval_cmd']}`")
    body = "\n".join([BEGIN, "", f"Raw rows: `{_rel(js)}`.", "", *lines, "", *details, "", END])
    out = Path(a.out)
    text = out.read_text() if out.exists() else ""
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + body + text[text.index(END) + len(END):]
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + SECTION_HEAD + "\n" + body + "\n"
    write_text(out, text)
    print("\n".join(lines))
    print(f"wrote {out}")


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return str(p)


SECTION_HEAD = """## DFlash: drafttrain vs speculators 0.9.0 (`DFlashDraftModel`)

`scripts/lab/peer_speculators_dflash.py` (its docstring gives the rows, what of speculators runs and what the
script replaces). drafttrain's `recipe=dflash` against speculators' DFlash draft model and loss, trained on
drafttrain's data and target features with the same conversations per step in the same order, at drafttrain's
settings (`spec_same`) and at speculators' own dflash defaults (`spec_defaults`: 5 layers, D-PACE + CE, 512
anchors per packed row, Muon + AdamW lr 1e-3, with non-causal blocks because drafttrain decodes bidirectional
blocks only). Both speculators drafters are saved with its `save_pretrained` and read by drafttrain's own DFlash
reader unchanged; every row is scored by `drafttrain eval` on the same held-out prompts (greedy chain, K drafts per
round). Settings that could not be matched are listed per row below. `train wall s` / `train CPU s`: the whole
training process (target load, data, training; drafttrain's also its own end-of-training evaluation), one thread
each on the shared 2-core machine; speculators' CPU path (eager attention over dense block masks) is not its GPU
path (flex attention), so these are not a fair speed comparison, only τ is.
"""


# ------------------------------------------------------------------------------------------ worker
LOSS_OF = {"ce": "ce", "kd": "kl_div"}  # drafttrain's dflash.loss -> the speculators loss closest to it
WEIGHTS_OF = {"decay": "fixed-exp-decay", "dpace": "dpace"}


def train_speculators(a, row: str, run_dir: Path) -> int:
    """Train speculators' DFlashDraftModel on drafttrain's conversations / order / features; save it in
    speculators' layout under ``run_dir/drafter``."""
    import importlib.metadata as md
    from types import SimpleNamespace

    import torch

    from drafttrain.data.select import load_training_data
    from drafttrain.targets.load import gather_taps, load_target, target_id
    from drafttrain.training import batching
    from drafttrain.training.loop import lr_lambda
    from drafttrain.training.method import make_method

    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.utils import resolve_target_layer_ids
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.config.schema import TrainConfig
    from speculators.train.data import CollateFn

    torch.set_num_threads(1)
    run_dir.mkdir(parents=True, exist_ok=True)
    job = compose_job(a)
    tc, dc = job.train, job.dflash
    model, tok, path = load_target(job.target, device=torch.device("cpu"))
    tname = target_id(path)
    examples, _, _ = load_training_data(job, model, tok, tname, run_dir)
    method = make_method(job, tok, model)  # drafttrain's DFlash: its taps, mask token, block size, gamma
    ref = method.build_drafter(model, examples, tname).config  # drafttrain's drafter sizes
    V, H = int(ref.vocab_size), int(ref.target_hidden_size)
    same = row == "spec_same"
    unmatched: list[str] = []

    if same:
        n_layers = int(dc.num_layers)
        st = dict(
            num_layers=n_layers, block_size=int(method.block), target_layer_ids=[int(t) for t in method.hf_taps],
            mask_token_id=int(method.mask_id), max_anchors=int(dc.num_anchors), rows="one per conversation",
            intermediate_size=int(ref.intermediate_size), layer_types="full_attention",
            sliding_window_non_causal=True, loss=a.spec_loss or LOSS_OF[dc.loss],
            per_position_loss_weight=WEIGHTS_OF[dc.slot_weights], dflash_decay_gamma=float(method.gamma),
            dpace_alpha=float(dc.dpace_alpha), optimizer=str(tc.optimizer), lr=float(tc.lr), betas=list(tc.betas),
            weight_decay=float(tc.weight_decay), schedule=f"drafttrain warm-up {tc.warmup_steps} + cosine to "
            f"{tc.min_lr_ratio} x lr", grad_clip=float(tc.grad_clip), seed=int(tc.seed))
        if tc.optimizer == "muon":  # drafttrain's Muon settings (drafttrain/training/optim.py)
            from drafttrain.training.optim import MUON_ADJUST_LR_FN

            st.update(muon_lr=float(tc.muon_lr), muon_momentum=float(tc.muon_momentum),
                      muon_adjust_lr_fn=MUON_ADJUST_LR_FN)
        layer_cfg = create_transformer_layer_config(
            verifier_name_or_path=str(path), num_layers=n_layers, draft_arch="qwen3", hidden_act="silu",
            sliding_window=2048, full_attention_indices=list(range(n_layers)))
        layer_cfg.intermediate_size = st["intermediate_size"]  # dflash.intermediate_size (default: the target's)
        if dc.init_layer is not None:
            unmatched.append(f"dflash.init_layer={dc.init_layer}: speculators has no option to start the draft "
                             "layers from a target layer (its own initialisation is used)")
        unmatched += [
            "rows: one speculators row per conversation (its trainer packs conversations into rows of "
            "total_seq_len tokens and draws max_anchors per row), so that max_anchors is per conversation, as "
            "drafttrain's num_anchors; the rows' losses are combined into the one-row loss of the step's blocks",
            "anchors: speculators' select_anchors takes an anchor wherever loss_mask[p] = 1 (drafttrain: "
            "loss_mask[p] and loss_mask[p + 1]), by the global torch RNG (drafttrain: a generator seeded per "
            "conversation and step), so the counts per conversation agree (min(num_anchors, eligible)) but not "
            "the positions",
            ("loss labels: speculators' ce is hard labels on the target's argmax at each slot; drafttrain's ce is "
             "the data's next tokens (the built-in data's answers are half sampled at T 0.7, so the two labels "
             "differ there)") if st["loss"] == "ce" and dc.loss == "ce" else
            f"loss: speculators {st['loss']} against drafttrain dflash.loss={dc.loss}",
            "loss normalisation: speculators divides the weighted slot losses by the number of scored slots "
            "(loss_function), drafttrain by the sum of the slot weights over the scored slots (decay weights; "
            "D-PACE: by the count, as speculators); a per-step scale, which AdamW ignores but the gradient clip "
            "does not",
        ]
    else:
        d = TrainConfig(speculator_type="dflash")  # its resolved dflash defaults
        from speculators.train.utils import resolve_mask_token_id

        n_layers = int(d.draft.num_layers)
        taps = resolve_target_layer_ids(d.draft.target_layer_ids, str(path))
        full = list(d.draft.full_attention_indices)
        oa = d.optimizer
        st = dict(
            num_layers=n_layers, block_size=int(d.dflash.block_size), target_layer_ids=[int(t) for t in taps],
            mask_token_id=int(resolve_mask_token_id(str(path), V, d.draft.mask_token_id)),
            max_anchors=int(d.data.max_anchors), rows="one packed row per step", hidden_act=d.draft.draft_hidden_act,
            sliding_window=int(d.draft.sliding_window), full_attention_indices=full,
            sliding_window_non_causal=True, speculators_default_sliding_window_non_causal=bool(
                d.draft.sliding_window_non_causal),
            loss=str(d.loss.loss_fn), per_position_loss_weight=str(d.dflash.per_position_loss_weight),
            dflash_decay_gamma=float(d.dflash.dflash_decay_gamma), dpace_alpha=float(d.dflash.dpace_alpha),
            optimizer=oa.optimizer, lr=float(oa.lr), muon_lr=float(oa.muon_lr if oa.muon_lr is not None else oa.lr),
            weight_decay=float(oa.weight_decay), muon_weight_decay=float(oa.muon_weight_decay),
            muon_momentum=float(oa.muon_momentum), muon_ns_steps=int(oa.muon_ns_steps),
            muon_adjust_lr_fn=oa.muon_adjust_lr_fn, schedule=str(d.scheduler.scheduler_type), grad_clip=1.0,
            seed=int(tc.seed), speculators_default_seed=int(d.seed))
        layer_cfg = create_transformer_layer_config(
            verifier_name_or_path=str(path), num_layers=n_layers, draft_arch=d.draft.draft_arch,
            hidden_act=d.draft.draft_hidden_act, sliding_window=st["sliding_window"], full_attention_indices=full,
            mrope_full_head_hack=d.draft.draft_mrope_full_head_hack)
        unmatched += [
            f"sliding_window_non_causal: speculators' default {st['speculators_default_sliding_window_non_causal']} "
            "(causal blocks in its sliding-window layers) -> true: drafttrain decodes (and reads) bidirectional "
            "blocks only; the window (2048) exceeds every sequence here, so the layers are full attention",
            f"seed: the protocol's {tc.seed} (speculators' default {st['speculators_default_seed']})",
            "hidden-state dtype: float32 on the CPU (speculators' default bfloat16 autocast on a GPU)",
            f"data: drafttrain's conversations and batch ({tc.batch_size} per step, the protocol's) in one row per "
            f"step, not speculators' packing of {d.data.total_seq_len}-token rows; its {st['max_anchors']} anchors "
            "are drawn over that row",
        ]
    st.update(draft_attn_impl=a.spec_attn, dtype="float32")
    print(f"[peer-dflash] {row}: settings {st}", flush=True)
    for u in unmatched:
        print(f"[peer-dflash] {row}: not matched: {u}", flush=True)

    torch.manual_seed(tc.seed)
    spec = DFlashDraftModel.from_training_args(
        layer_cfg, t2d=None, d2t=None, draft_vocab_size=V, block_size=st["block_size"],
        verifier_name_or_path=str(path), target_layer_ids=st["target_layer_ids"], draft_attn_impl=a.spec_attn,
        mask_token_id=st["mask_token_id"], sliding_window_non_causal=st["sliding_window_non_causal"],
        sample_from_anchor=False)
    spec.train()
    n_train = sum(p.numel() for p in spec.parameters() if p.requires_grad)
    print(f"[peer-dflash] {row}: speculators DFlashDraftModel, {n_layers} layer(s), {n_train / 1e6:.3f}M trainable "
          f"params, taps (HF) {st['target_layer_ids']}, block {st['block_size']}, mask {st['mask_token_id']}",
          flush=True)
    call_kwargs, _ = DFlashDraftModel.get_trainer_kwargs(
        loss_fn=st["loss"], loss_implementation="eager", dflash_decay_gamma=st["dflash_decay_gamma"],
        max_anchors=st["max_anchors"], per_position_loss_weight=st["per_position_loss_weight"],
        dpace_alpha=st["dpace_alpha"])
    assert set(call_kwargs) == {"loss_config", "gamma", "max_anchors", "per_position_loss_weight", "dpace_alpha"}

    params = [p for p in spec.parameters() if p.requires_grad]
    if same:
        if st["optimizer"] == "muon":  # speculators' own Muon / AdamW split, at drafttrain's settings and betas
            from speculators.train.optimizers import split_named_params_for_muon

            muon_named, adamw_named = split_named_params_for_muon(spec)
            opts = [torch.optim.Muon([p for _, p in muon_named], lr=st["muon_lr"], momentum=st["muon_momentum"],
                                     weight_decay=st["weight_decay"], adjust_lr_fn=st["muon_adjust_lr_fn"]),
                    torch.optim.AdamW([p for _, p in adamw_named], lr=st["lr"], betas=tuple(st["betas"]),
                                      weight_decay=st["weight_decay"])]
        else:
            opts = [torch.optim.AdamW(params, lr=st["lr"], betas=tuple(st["betas"]), weight_decay=st["weight_decay"])]
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(tc.warmup_steps, tc.max_steps, tc.min_lr_ratio))
                  for o in opts]
    else:
        from speculators.train.optimizers import build_optimizers
        from speculators.train.trainer import TrainerConfig, _resolve_scheduler_steps
        from transformers import get_linear_schedule_with_warmup

        opts = build_optimizers(spec, SimpleNamespace(**{k: st[k] for k in (
            "optimizer", "lr", "weight_decay", "muon_lr", "muon_momentum", "muon_weight_decay", "muon_ns_steps",
            "muon_adjust_lr_fn")}))
        warm, total = _resolve_scheduler_steps(TrainerConfig(lr=st["lr"], num_epochs=1, save_path=str(run_dir),
                                                             max_steps=tc.max_steps), tc.max_steps)
        st["schedule"] = f"linear, warm-up {warm} of {total} steps"
        scheds = [get_linear_schedule_with_warmup(o, num_warmup_steps=warm, num_training_steps=total) for o in opts]

    # the target's features, per conversation (no padding): the taps and the input of the final norm
    decoder = model.get_decoder()
    seen: list = []
    hook = decoder.norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    taps = st["target_layer_ids"]

    @torch.no_grad()
    def features(ex: dict) -> dict:
        ids = torch.tensor(ex["input_ids"], dtype=torch.long)[None]
        seen.clear()
        out = decoder(input_ids=ids, output_hidden_states=True, use_cache=False)
        T = ids.shape[1]
        return {"input_ids": ids[0], "hidden_states": gather_taps(out.hidden_states, taps)[0].float(),
                "verifier_last_hidden_states": seen[-1][0].float(),
                "loss_mask": torch.tensor(ex["loss_mask"], dtype=torch.long), "lengths": torch.tensor([T]),
                "position_ids": torch.arange(T)}

    block = st["block_size"]

    def collate(items: list[dict]) -> dict:
        total = sum(int(x["lengths"][0]) for x in items)  # + block: padding, as speculators' loader pads rows
        batch = CollateFn(max_len=total + block, hidden_size=H, num_target_layers=len(taps), dtype=torch.float32,
                          preprocess=None)(items)
        return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}

    def eligible(ex: dict) -> int:  # drafttrain's rule (both tokens supervised), for the anchor-count record
        lm = ex["loss_mask"]
        return sum(1 for p in range(len(lm) - 1) if lm[p] and lm[p + 1])

    plan = batching.make_plan(tc.batch_size, tc.micro_batch_size, 1)
    t0 = time.time()
    cpu0 = time.process_time()
    history = []
    for step in range(tc.max_steps):
        idx = [i for mb in batching.micro_batches(len(examples), plan, step, tc.seed, 0) for i in mb]
        feats = [features(examples[i]) for i in idx]
        groups = [[f] for f in feats] if same else [feats]
        parts = []
        for g in groups:
            _draft, loss_r, m = spec(**collate(g), **call_kwargs)
            parts.append((loss_r, float(m["full_acc_total"]), m))
        n_all = sum(n for _, n, _ in parts)
        loss = sum(l_r * (n / n_all) for l_r, n, _ in parts) if n_all > 0 else sum(l_r * 0.0 for l_r, _, _ in parts)
        for o in opts:
            o.zero_grad()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(spec.parameters(), st["grad_clip"])
        for o in opts:
            o.step()
        for s in scheds:
            s.step()
        acc = []
        for k in range(1, block):
            c = sum(float(m[f"position_{k}_acc_sum"]) for _, _, m in parts)
            t = sum(float(m[f"position_{k}_acc_total"]) for _, _, m in parts)
            acc.append(c / t if t else 0.0)
        eal = sum(float(m["eal_sum"]) for _, _, m in parts) / max(sum(float(m["eal_total"]) for _, _, m in parts), 1)
        history.append({"step": step + 1, "loss": float(loss.detach()), "grad_norm": float(gn), "scored_slots": n_all,
                        "blocks": sum(float(m["eal_total"]) for _, _, m in parts),
                        "drafttrain_rule_blocks": sum(min(int(dc.num_anchors), eligible(examples[i])) for i in idx),
                        "acc_per_slot": acc, "eal": eal})
        if step % 10 == 0 or step + 1 == tc.max_steps:
            h = history[-1]
            print(f"[peer-dflash] {row}: step {step + 1}/{tc.max_steps} loss {h['loss']:.4f} blocks "
                  f"{h['blocks']:.0f} (drafttrain's rule: {h['drafttrain_rule_blocks']}) slots {n_all:.0f} acc@1..4 "
                  f"{[round(x, 3) for x in acc[:4]]} eal {eal:.2f} lr {scheds[0].get_last_lr()[0]:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
    train_s, train_cpu = time.time() - t0, time.process_time() - cpu0
    spec.eval()
    out = run_dir / "drafter"
    spec.save_pretrained(str(out))
    eval_dir, conversion, diff = readback(spec, out, model, examples[0], features, collate, run_dir)
    hook.remove()
    print(f"[peer-dflash] {row}: drafttrain reads {eval_dir}: block logits max abs diff {diff:.2e} against "
          f"speculators' forward" + (f" (converted: {conversion})" if conversion else ""), flush=True)
    ran = ("speculators.models.dflash.DFlashDraftModel (from_training_args, load_verifier_weights, get_trainer_kwargs, "
           "forward: select_anchors, create_anchor_block_mask_mod as an eager float mask, mask-token blocks, the "
           "teacher, compute_metrics), speculators.losses (resolve_loss_config eager, compound_loss, "
           f"{'dpace_loss_decay' if st['per_position_loss_weight'] == 'dpace' else 'dflash_loss_decay'}), "
           "speculators.train.data.CollateFn, speculators.train.cli.create_transformer_layer_config, "
           "speculators.models.utils.resolve_target_layer_ids, save_pretrained"
           + ("" if same else ", speculators.train.config.schema.TrainConfig (dflash defaults), "
              "speculators.train.utils.resolve_mask_token_id, speculators.train.optimizers.build_optimizers "
              "(Muon + AdamW), speculators.train.trainer._resolve_scheduler_steps + "
              "transformers.get_linear_schedule_with_warmup"))
    write_json(run_dir / "peer_train.json", {
        "row": row, "speculators_version": md.version("speculators"), "settings": st, "unmatched": unmatched,
        "speculators_ran": ran, "eval_drafter": str(eval_dir), "conversion": conversion,
        "readback_max_abs_diff": diff, "loop_s": train_s, "loop_cpu_s": train_cpu,
        "final_loss": history[-1]["loss"], "history": history})
    print(f"[peer-dflash] {row}: saved {out} ({train_s:.0f}s, {train_cpu:.0f} CPU-s)", flush=True)
    return 0


def readback(spec, out: Path, model, ex: dict, features, collate, run_dir: Path):
    """drafttrain's reader on speculators' checkpoint: ``(directory to evaluate, conversion or None, max abs
    difference of the block logits)``. The logits of speculators' forward on one conversation (8 anchors) against
    drafttrain's DFlashDrafter loaded from ``out`` (or from a converted copy, should the reader refuse ``out``) on
    the same anchors."""
    import torch

    from drafttrain.artifacts import load_dflash
    from drafttrain.drafters.dflash import context_mask
    from drafttrain.io import DraftTrainError, read_json

    eval_dir, conversion = out, None
    try:
        drafter = load_dflash(out, model)
    except DraftTrainError as e:  # not with speculators 0.9.0; kept for a future layout change
        eval_dir, conversion = convert(out, model, run_dir / "drafter_converted", str(e))
        drafter = load_dflash(eval_dir, model)
    drafter.eval()
    batch = collate([features(ex)])
    B = spec.block_size
    torch.manual_seed(1234)
    with torch.no_grad():
        _h, logits, _t, _m, abi = spec._backbone_forward(**batch, max_anchors=8)
        anchors = abi.view(-1, B)[:, 0]
        ids = torch.full((1, anchors.numel(), B), spec.mask_token_id, dtype=torch.long)
        ids[0, :, 0] = batch["input_ids"][0, anchors]
        pos = batch["position_ids"]
        block_pos = (pos[0, anchors][:, None] + torch.arange(B)).view(1, -1)
        valid = torch.ones(1, anchors.numel(), dtype=torch.bool)
        mask = context_mask(anchors[None], valid, (batch["document_ids"] != -1).long(), batch["document_ids"])
        hid = drafter(drafter.embed(ids.view(1, -1)), batch["hidden_states"], block_pos, pos, mask, B)
        ours = drafter.logits(hid)
    diff = float((ours - logits.float()).abs().max())
    cfg = read_json(out / "config.json")
    if not diff < 1e-3:
        raise RuntimeError(f"drafttrain's reading of {out} does not reproduce speculators' logits (max abs diff "
                           f"{diff:.3e}); config: {json.dumps(cfg)[:400]}")
    return eval_dir, conversion, diff


def convert(src: Path, model, dst: Path, why: str) -> tuple[Path, str]:
    """A copy of speculators' checkpoint in drafttrain's own ``vllm`` export layout (drafttrain.export.dflash),
    built from the fields speculators' config does carry; returns (dst, what differed)."""
    import torch

    from drafttrain.drafters.dflash import DFlashDrafter, DFlashDrafterConfig, target_identity
    from drafttrain.export.dflash import write_dflash
    from drafttrain.io import atomic_dir, load_tensors, read_json

    raw = read_json(src / "config.json")
    layer = raw.get("transformer_layer_config") or {}
    ident = target_identity(model)
    heads = int(layer["num_attention_heads"])
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    config = DFlashDrafterConfig(
        hidden_size=int(layer["hidden_size"]), intermediate_size=int(layer["intermediate_size"]),
        num_attention_heads=heads, num_key_value_heads=int(layer.get("num_key_value_heads", heads)),
        head_dim=int(layer.get("head_dim") or layer["hidden_size"] // heads), **ident,
        target_layer_ids=[int(t) - 1 for t in raw["aux_hidden_state_layer_ids"]],
        mask_token_id=int(raw["mask_token_id"]), block_size=int(raw["block_size"]),
        num_layers=int(layer["num_hidden_layers"]), rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(layer.get("rope_theta", rope.get("rope_theta", 10000.0))), rope_scaling=rope or None,
        max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
        target_name_or_path=str((raw.get("speculators_config") or {}).get("verifier", {}).get("name_or_path", "")))
    sd = {n: t for n, t in load_tensors(src / "model.safetensors").items()
          if n not in ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight",
                       "t2d", "d2t")}
    drafter = DFlashDrafter.from_state(config, sd, src / "model.safetensors")
    with atomic_dir(dst) as tmp:
        write_dflash(drafter, "vllm", tmp, torch.float32, config.target_name_or_path, config.block_size - 1)
    return dst, f"drafttrain's reader refused speculators' config ({why}); rewritten with drafttrain.export.dflash"


if __name__ == "__main__":
    sys.exit(main())
