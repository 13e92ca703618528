"""Training checkpoints: weights, optimizer, scheduler, step and RNG, written atomically.

Layout ``<run>/checkpoints/step_00000100/``:
  drafter.safetensors   trainable weights and buffers of the drafter
  optimizer.pt          optimizer state (tensors and numbers only; loaded with ``weights_only=True``)
  rng.safetensors       torch CPU (and CUDA) RNG states
  ema.safetensors       the weight average (train.ema_decay > 0 only)
  state.json            step, method, target, scheduler state, world size, config fingerprint

The data position is the step (see batching.py), so no data-loader state is needed. A checkpoint directory
appears under its final name only when complete (built under a temporary name, then renamed).

The layout does not depend on how the run was distributed: under DeepSpeed ZeRO-2/3 (and FSDP) the full
weights (fp32 masters) and the full AdamW state are gathered on save (:func:`gather_state`, a collective)
and written in the plain single-process layout, so a checkpoint saved by N processes under ZeRO-3 resumes
in 1 process (or under DDP, or under ZeRO with another process count) and loads into the decoder.
DeepSpeed's own sharded checkpoint files are not used; :func:`restore_deepspeed_optimizer` scatters a
saved AdamW state into a DeepSpeed optimizer after ``accelerator.prepare``.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import torch

from ..io import DraftTrainError, atomic_dir, load_tensors, read_json, save_tensors, torch_load_safe, write_json
from ..layout import CONFIG_NAME, DRAFTER_SUBDIR

STATE = "state.json"
EMA_FILE = "ema.safetensors"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / STATE).exists())


def _skip(name: str) -> bool:
    # the frozen embedding is a copy of the target's: rebuilt from the target, not checkpointed
    return name.endswith("embed_tokens.weight")


def save_checkpoint(path: Path, drafter, optimizer, scheduler, step: int, meta: dict) -> None:
    """Single-process save (the weights and optimizer are not sharded)."""
    weights = {k: v for k, v in drafter.state_dict().items() if not _skip(k)}
    write_checkpoint(path, weights, optimizer.state_dict(), scheduler, step, meta)


def write_checkpoint(path: Path, weights: dict, optimizer_state: dict, scheduler, step: int, meta: dict,
                     ema: dict | None = None) -> None:
    """Write a checkpoint from already gathered full weights and a plain (torch AdamW layout) optimizer state;
    ``ema``: the weight average's tensors (:class:`drafttrain.training.optim.WeightEMA`), if the run keeps one."""
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"torch_cuda_{i}"] = s
    state = dict(meta)
    state.update(step=step, scheduler=scheduler.state_dict(), python_random=list(random.getstate()[1]))
    with atomic_dir(path) as tmp:
        save_tensors(tmp / "drafter.safetensors", {k: v for k, v in weights.items() if not _skip(k)})
        torch.save(optimizer_state, tmp / "optimizer.pt")
        save_tensors(tmp / "rng.safetensors", rng)
        if ema is not None:
            save_tensors(tmp / EMA_FILE, ema)
        write_json(tmp / STATE, state)


# ------------------------------------------------------------------------------ distributed (ZeRO, FSDP)
def param_order(drafter, optimizer) -> list[list[str]]:
    """Parameter names of each optimizer group, in state-dict order. Call before ``accelerator.prepare``
    (DeepSpeed replaces the groups' parameters by flat partitions)."""
    names = {id(p): n for n, p in drafter.named_parameters()}
    groups = []
    for g in optimizer.param_groups:
        missing = [tuple(p.shape) for p in g["params"] if id(p) not in names]
        if missing:
            raise DraftTrainError(f"optimizer parameters {missing[:3]} are not parameters of the drafter")
        groups.append([names[id(p)] for p in g["params"]])
    return groups


def distributed_kind(accelerator) -> str:
    return str(getattr(accelerator, "distributed_type", "NO")).split(".")[-1]


def _ds_inner_optimizer(optimizer):
    """The torch optimizer under accelerate's wrapper and DeepSpeed's ZeRO optimizer."""
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate wrapper -> DeepSpeed ZeRO optimizer
    return getattr(opt, "optimizer", opt)  # ZeRO optimizer -> torch AdamW over flat partitions


def gather_state(accelerator, wrapped, drafter, optimizer, order: list[list[str]]) -> tuple[dict, dict]:
    """Full weights and AdamW state in the single-process layout. A collective under ZeRO-3 and FSDP: every
    process must call it; the result is complete on the main process (others may get partial copies)."""
    kind = distributed_kind(accelerator)
    flat = [n for g in order for n in g]
    if kind == "DEEPSPEED":
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        params = dict(drafter.named_parameters())
        weights = {}
        for name, value in drafter.state_dict().items():
            if _skip(name):
                continue
            p = params.get(name)
            if p is None:  # a buffer (d2t, t2d): never partitioned
                weights[name] = value.detach().cpu()
            elif p.requires_grad:  # the fp32 master of a trained parameter
                weights[name] = safe_get_full_fp32_param(p).detach().cpu().reshape(getattr(p, "ds_shape", p.shape))
            else:
                with deepspeed.zero.GatheredParameters([p]):
                    weights[name] = p.detach().cpu().clone()
        inner = _ds_inner_optimizer(optimizer)
        steps = [float(s["step"]) for s in inner.state.values() if "step" in s]
        state = {}
        for i, name in enumerate(flat):
            m1 = safe_get_full_optimizer_state(params[name], "exp_avg")
            m2 = safe_get_full_optimizer_state(params[name], "exp_avg_sq")
            if m1 is not None and m2 is not None and steps:
                shape = params[name].ds_shape if hasattr(params[name], "ds_shape") else params[name].shape
                state[i] = {"step": torch.tensor(steps[0]), "exp_avg": m1.detach().cpu().reshape(shape),
                            "exp_avg_sq": m2.detach().cpu().reshape(shape)}
        groups, start = [], 0
        for gi, names in enumerate(order):
            hyper = {k: v for k, v in inner.param_groups[gi].items() if k != "params"}
            groups.append({**hyper, "params": list(range(start, start + len(names)))})
            start += len(names)
        return weights, {"state": state, "param_groups": groups}
    if kind == "FSDP":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = accelerator.get_state_dict(wrapped)
        weights = {k: v.detach().cpu() for k, v in full.items() if not _skip(k)}
        osd = get_optimizer_state_dict(wrapped, getattr(optimizer, "optimizer", optimizer),
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # keyed by parameter name: convert to the index layout of a plain optimizer
        pos = {n: i for i, n in enumerate(flat)}
        state = {pos[_strip_prefix(k, pos)]: v for k, v in osd["state"].items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [pos[_strip_prefix(n, pos)] for n in g["params"]]} for g in osd["param_groups"]]
        return weights, {"state": state, "param_groups": groups}
    weights = {k: v for k, v in drafter.state_dict().items() if not _skip(k)}
    return weights, optimizer.state_dict()


def _strip_prefix(name: str, known: dict) -> str:
    """FSDP/compile wrappers may prefix parameter names; find the drafter's own name."""
    if name in known:
        return name
    for cand in known:
        if name.endswith("." + cand):
            return cand
    raise DraftTrainError(f"optimizer state has an unknown parameter {name!r}")


def restore_deepspeed_optimizer(optimizer, drafter, weights: dict, optimizer_state: dict,
                                order: list[list[str]]) -> None:
    """Scatter saved fp32 master weights and AdamW moments into a DeepSpeed ZeRO optimizer (after prepare).

    DeepSpeed creates Adam's state lazily at the first step, so it is created here (zeros, saved step) and
    then filled through DeepSpeed's fragment API, which maps full tensors onto this rank's partitions."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    zero = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO optimizer
    inner = _ds_inner_optimizer(optimizer)
    saved = optimizer_state.get("state", {})
    steps = {float(s["step"]) for s in saved.values() if "step" in s}
    if len(steps) > 1:
        raise DraftTrainError(f"optimizer state has parameters at different steps {sorted(steps)}")
    step = steps.pop() if steps else 0.0
    # the flat fp32 partitions DeepSpeed steps its torch optimizer on (stage 3 / stages 1-2)
    flats = getattr(zero, "fp32_partitioned_groups_flat", None) or getattr(zero, "single_partition_of_fp32_groups", None)
    if flats is None:
        raise DraftTrainError(f"cannot restore optimizer state into {type(zero).__name__} (not a ZeRO optimizer)")
    if saved:
        for fp in flats:
            st = inner.state[fp]
            if "exp_avg" not in st:
                st["exp_avg"] = torch.zeros_like(fp)
                st["exp_avg_sq"] = torch.zeros_like(fp)
            st["step"] = torch.tensor(step, dtype=torch.float32)
        if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # stages 1-2 link the state after step 1
            zero._lazy_init_hp_params_optimizer_state()
    for gi, g in enumerate(optimizer_state.get("param_groups", [])[: len(inner.param_groups)]):
        for key in ("lr", "initial_lr"):  # the scheduler's current value; prepare does not keep it
            if key in g:
                inner.param_groups[gi][key] = g[key]
    params = dict(drafter.named_parameters())
    for i, name in enumerate(n for g in order for n in g):
        p = params[name]
        if name in weights:
            safe_set_full_fp32_param(p, weights[name].to(torch.float32))
        if i in saved:
            safe_set_full_optimizer_state(p, saved[i]["exp_avg"].float(), "exp_avg")
            safe_set_full_optimizer_state(p, saved[i]["exp_avg_sq"].float(), "exp_avg_sq")


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    if keep <= 0:
        return
    for old in list_checkpoints(run_dir)[:-keep]:
        # rename first (atomic), so a crash mid-delete never leaves a partial checkpoint under a final name
        doomed = old.with_name(f".{old.name}.deleting")
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    if not resume:
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if path.is_dir() and not (path / STATE).exists():  # a run directory: take its latest checkpoint
        found = list_checkpoints(path)
        if found:
            return found[-1]
    if not (path / STATE).exists():
        raise DraftTrainError(f"train.resume={resume}: not a checkpoint directory (no {STATE})")
    return path


def read_checkpoint_meta(path: Path) -> dict:
    """A checkpoint's recorded state; a method under an older release's name (config.RENAMED_METHODS) is read
    as today's, in ``method`` and in the recorded job config, and so are keys an older release kept elsewhere
    (config.upgrade_recorded_config), so such checkpoints resume and evaluate."""
    from ..config import RENAMED_METHODS, upgrade_recorded_config

    meta = read_json(Path(path) / STATE)
    if meta.get("method") in RENAMED_METHODS:
        meta["method"] = RENAMED_METHODS[meta["method"]]
    if isinstance(meta.get("config"), dict) and meta["config"].get("method") in RENAMED_METHODS:
        meta["config"] = {**meta["config"], "method": RENAMED_METHODS[meta["config"]["method"]]}
    if isinstance(meta.get("config"), dict):
        meta["config"] = upgrade_recorded_config(meta["config"])
    return meta


def check_compatible(meta: dict, expected: dict, path: Path) -> None:
    """Refuse to resume from a checkpoint of another method or another target."""
    from ..identity import same_target

    for key in ("method", "target"):
        if meta.get(key) != expected.get(key) and not (key == "target" and same_target(meta.get(key),
                                                                                      expected.get(key))):
            raise DraftTrainError(
                f"train.resume={path}: checkpoint was made for {key}={meta.get(key)!r}, this run has "
                f"{key}={expected.get(key)!r}"
            )


def load_checkpoint(path: Path, drafter, optimizer, scheduler) -> int:
    """Restore weights, optimizer, scheduler and RNG in place; return the step to continue from.

    ``optimizer=None`` leaves the optimizer alone (DeepSpeed: :func:`restore_deepspeed_optimizer` after
    prepare, with :func:`load_weights` and :func:`load_optimizer_state`)."""
    path = Path(path)
    meta = read_checkpoint_meta(path)
    load_drafter_weights(path, drafter)
    if optimizer is not None:
        try:
            optimizer.load_state_dict(load_optimizer_state(path))
        except (ValueError, KeyError) as e:  # other groups: another train.optimizer or drafter
            raise DraftTrainError(f"{path / 'optimizer.pt'}: the saved optimizer state does not fit this run's "
                                  f"optimizer (train.optimizer changed since it was saved?): {e}") from None
    scheduler.load_state_dict(meta["scheduler"])
    rng = load_tensors(path / "rng.safetensors")
    torch.set_rng_state(rng["torch_cpu"])
    if torch.cuda.is_available():
        states = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    random.setstate((3, tuple(meta["python_random"]), None))
    return int(meta["step"])


def load_drafter_weights(path: Path, drafter) -> None:
    """The checkpoint's weights into ``drafter``; only the frozen embedding (rebuilt from the target) may be
    missing."""
    missing, unexpected = drafter.load_state_dict(load_weights(path), strict=False)
    if unexpected or [k for k in missing if not k.endswith("embed_tokens.weight")]:
        raise DraftTrainError(f"{path}: weights do not match this drafter (missing {missing}, unexpected {unexpected})")


def load_weights(path: Path) -> dict:
    return load_tensors(Path(path) / "drafter.safetensors")


def load_ema(path: Path) -> dict:
    """The saved weight average (``train.ema_decay`` > 0)."""
    f = Path(path) / EMA_FILE
    if not f.exists():
        raise DraftTrainError(f"{f}: missing: this checkpoint was written without a weight average "
                              "(train.ema_decay=0); resume it with train.ema_decay=0")
    return load_tensors(f)


def load_optimizer_state(path: Path) -> dict:
    """The saved optimizer state (tensors and numbers only: ``weights_only=True``)."""
    return torch_load_safe(Path(path) / "optimizer.pt")


# ------------------------------------------------------------------------------- a checkpoint as a drafter
def is_checkpoint(path) -> bool:
    p = Path(path)
    return (p / STATE).is_file() and (p / "drafter.safetensors").is_file()


def drafter_dir(path) -> Path:
    """``path`` itself for a saved drafter; for a training checkpoint, its drafter (built on first use).

    ``drafttrain eval|export drafter=<run>/checkpoints/step_N``: a checkpoint holds the trainable weights and the
    job's config, not a drafter directory (the frozen embedding is rebuilt from the target and not stored). The
    drafter is rebuilt exactly as training built it (the recorded config, the recorded target), the checkpoint's
    weights are loaded into it, and it is saved once, atomically, as ``<checkpoint>/drafter`` (a normal
    saved-drafter directory that eval, export and the engines read); later calls reuse it."""
    p = Path(path)
    if (p / CONFIG_NAME).exists() or not is_checkpoint(p):
        return p
    out = p / DRAFTER_SUBDIR
    if (out / CONFIG_NAME).exists():
        return out
    _materialize(p, out)
    return out


def _materialize(ckpt: Path, out: Path) -> None:
    from omegaconf import OmegaConf

    from ..config import TrainJob
    from ..targets.load import load_target, target_id
    from .method import make_method

    meta = read_checkpoint_meta(ckpt)
    if not isinstance(meta.get("config"), dict):
        raise DraftTrainError(f"{ckpt / STATE}: no recorded job config (a checkpoint from an older drafttrain?)")
    job = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainJob), meta["config"]))
    print(f"[drafttrain] {ckpt} is a training checkpoint (step {meta.get('step')}): rebuilding its "
          f"{job.method} drafter into {out}", flush=True)
    model, tokenizer, path = load_target(job.target, device="cpu")
    if meta.get("target") and str(meta["target"]) != str(path):
        raise DraftTrainError(f"{ckpt}: trained for target {meta['target']}, which now resolves to {path}")
    method = make_method(job, tokenizer, model)
    drafter = method.build_drafter(model, [], target_id(path))  # d2t/t2d come from the checkpoint
    load_drafter_weights(ckpt, drafter)
    if (ckpt / EMA_FILE).exists():  # train.ema_decay: the run's drafter is the weight average (what final/ holds)
        _, unexpected = drafter.load_state_dict(load_ema(ckpt), strict=False)
        if unexpected:
            raise DraftTrainError(f"{ckpt / EMA_FILE}: tensors this drafter does not have: {unexpected[:3]}")
        print(f"[drafttrain] {ckpt}: the drafter holds the checkpoint's weight average ({EMA_FILE})", flush=True)
    drafter.save_pretrained(out)
