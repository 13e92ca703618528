"""Offline hidden-state capture: run the frozen target once over the training data and store what training
needs (store.py describes the files), so training no longer runs the target's layers.

``drafttrain capture`` (or ``accelerate launch --num_processes N -m drafttrain.cli capture …``: each rank
captures the shards ``k % N == rank``) prints a storage estimate, shows progress, and resumes after an
interruption. ``drafttrain train capture.mode=offline capture.path=DIR`` trains from the result.

Features per method: EAGLE-3 stores the three taps and the last hidden state (the lm_head input, from which
training recomputes the teacher logits); Medusa-1 and distillation store the last hidden state. Medusa-2
trains LoRA adapters inside the target, so its hidden states change during training: no offline mode.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..io import DraftTrainError, read_json, write_json
from ..identity import same_target, target_identity
from ..targets.load import gather_taps
from . import store as S

FEATURES_BY_METHOD = {"eagle3": ("taps", "last_hidden"), "medusa": ("last_hidden",), "draft_model": ("last_hidden",),
                      "dflash": ("taps", "last_hidden")}


def capture_taps(job, model) -> tuple[int, ...] | None:
    """The HF ``hidden_states`` indices a capture job stores as ``taps``: EAGLE-3's three, DFlash's target layers
    (0-based layer outputs + 1); None for the methods that read only the last hidden state."""
    from ..targets.load import num_layers, resolve_taps

    if job.method == "eagle3":
        return resolve_taps(num_layers(model), job.eagle3.tap_layers)
    if job.method == "dflash":
        from ..drafters.dflash import resolve_layer_ids

        return tuple(i + 1 for i in resolve_layer_ids(job.dflash, num_layers(model)))
    return None


def feature_widths(method: str, hidden_size: int, num_taps: int = 3) -> dict[str, int]:
    if method not in FEATURES_BY_METHOD:
        extra = " (Medusa-2 trains adapters inside the target: its hidden states change, use capture.mode=online)" \
            if method == "medusa2" else ""
        raise DraftTrainError(f"method={method}: no offline capture for this method{extra}; expected one of "
                              f"{', '.join(FEATURES_BY_METHOD)}")
    widths = {"taps": num_taps * hidden_size, "last_hidden": hidden_size}
    return {name: widths[name] for name in FEATURES_BY_METHOD[method]}


def _hidden_size(model) -> int:
    from ..targets.load import text_config

    return int(text_config(model.config).hidden_size)


@torch.no_grad()
def target_features(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, taps: Sequence[int] | None
                    ) -> dict[str, torch.Tensor]:
    """One target forward without the LM head: ``{"last_hidden": [B,T,H]}`` (what the lm_head reads) plus
    ``"taps"`` ``[B,T,3H]`` (HF ``hidden_states[i]`` for i in ``taps``, concatenated) when ``taps`` is given."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    want_hs = taps is not None
    if dec is not None and dec is not model:
        out = dec(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=want_hs, use_cache=False)
        last = out.last_hidden_state
        hs = out.hidden_states
    else:  # no separate decoder: record the lm_head input with a hook
        seen: list[torch.Tensor] = []
        handle = model.get_output_embeddings().register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
        try:
            out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=want_hs,
                        use_cache=False)
        finally:
            handle.remove()
        if len(seen) != 1 or seen[0].shape[:2] != input_ids.shape:
            raise DraftTrainError("offline capture: could not record the input of the target's lm_head")
        last, hs = seen[0], out.hidden_states
    feats = {"last_hidden": last}
    if want_hs:
        feats["taps"] = gather_taps(hs, taps)
    return feats


@torch.no_grad()
def check_head_reproduces_logits(model, batch: dict, last_hidden: torch.Tensor) -> float:
    """Training recomputes the teacher logits as ``lm_head(last_hidden)``; refuse a target where that is not
    the model's output (e.g. logit soft-capping or scaling after the head). Returns the max abs difference."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    head = model.get_output_embeddings()
    mine = head(last_hidden.to(head.weight.dtype))
    m = batch["attention_mask"].bool()
    diff = (mine.float() - logits.float())[m].abs().max().item()
    scale = logits.float()[m].abs().max().item()
    tol = (1e-4 if logits.dtype == torch.float32 else 2e-2) * max(1.0, scale)
    if not diff <= tol:
        raise DraftTrainError(
            f"offline capture: this target's logits are not lm_head(last hidden state) (max difference {diff:.3g}, "
            f"e.g. soft-capping or scaling after the head); train it with capture.mode=online"
        )
    return diff


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _length_batches(indices: Sequence[int], lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first), to waste little compute on padding."""
    order = sorted(indices, key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def make_plan(examples: list[dict], method: str, taps, hidden_size: int, dtype: str, shard_mb: float,
              target_name: str) -> dict:
    widths = feature_widths(method, hidden_size, len(taps) if taps else 3)
    bpt = S.bytes_per_token(widths, S.store_dtype(dtype))
    lengths = [len(ex["input_ids"]) for ex in examples]
    if not examples:
        raise DraftTrainError("capture: the training set is empty")
    if shard_mb <= 0:
        raise DraftTrainError(f"capture.shard_mb={shard_mb}: must be > 0")
    per_shard = max(1, int(shard_mb * 2**20 // bpt))
    return {
        "format_version": S.FORMAT_VERSION,
        "method": method,
        "features": widths,
        "dtype": dtype,
        "taps": [int(t) for t in taps] if "taps" in widths else None,
        "target": target_name,  # where it was read from; compared by identity (identity.py)
        "target_id": target_identity(target_name),
        "hidden_size": hidden_size,
        "num_examples": len(examples),
        "tokens": int(sum(lengths)),
        "bytes_per_token": bpt,
        "tokens_per_shard": per_shard,
        "data_fingerprint": S.data_fingerprint(examples),
        "shards": [list(r) for r in S.plan_shards(lengths, per_shard)],
    }


def _check_same_plan(found: dict, plan: dict, directory: Path) -> None:
    same = {"target": lambda: same_target(found.get("target"), plan["target"]),
            "target_id": lambda: "target_id" not in found or found["target_id"] == plan["target_id"]}
    diff = [k for k in plan if found.get(k) != plan[k] and not (k in same and same[k]())]
    if diff:
        raise DraftTrainError(
            f"capture.path={directory} holds a capture made with different {', '.join(diff)}; use a new "
            f"capture.path (or delete it) to capture with these settings"
        )


def _open_store(out: Path, plan: dict, rank: int, barrier: Callable[[], None]) -> None:
    """Rank 0 writes the plan into a new (empty) directory; every rank then checks the plan found there."""
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if not (out / S.PLAN).exists():
            if any(p for p in out.iterdir() if not p.name.startswith(".")):
                raise DraftTrainError(f"capture.path={out}: directory is not empty and holds no capture plan")
            write_json(out / S.PLAN, plan)
    barrier()
    _check_same_plan(read_json(out / S.PLAN), plan, out)


def _announce(out: Path, plan: dict, dtype: str, todo_tokens: int, say: Callable[[str], None]) -> None:
    """The storage estimate (total, still to write, free); an error when the rest does not fit."""
    total = plan["tokens"] * plan["bytes_per_token"]
    free = shutil.disk_usage(out).free
    say(f"capture: {plan['num_examples']} examples, {plan['tokens']} tokens, {plan['bytes_per_token']} bytes/token "
        f"({' + '.join(f'{n} {w}' for n, w in plan['features'].items())} x {dtype}, ids, mask) -> "
        f"{total / 2**30:.3f} GiB in {len(plan['shards'])} shards; still to write "
        f"{todo_tokens * plan['bytes_per_token'] / 2**30:.3f} GiB, {free / 2**30:.1f} GiB free on {out}")
    if todo_tokens * plan["bytes_per_token"] > free:
        raise DraftTrainError(f"capture.path={out}: needs {todo_tokens * plan['bytes_per_token'] / 2**30:.2f} GiB "
                              f"more, only {free / 2**30:.2f} GiB free")


def _capture_shard(model, examples: list[dict], lengths: list[int], plan: dict, rows: range, *, batch_size: int,
                   pad_id: int, sdtype, stats: dict, bar, check_head: bool) -> dict[int, dict[str, torch.Tensor]]:
    """The features of the examples ``rows`` (length-sorted batches), on the host in the store's dtype;
    ``check_head``: first check that the lm_head applied to the captured last hidden state gives the logits."""
    from ..data.chat import collate

    device = next(model.parameters()).device
    per_example: dict[int, dict[str, torch.Tensor]] = {}
    for idx in _length_batches(rows, lengths, batch_size):
        mb = collate([examples[i] for i in idx], pad_id)
        mb = {key: v.to(device) for key, v in mb.items()}
        _sync(device)
        tf = time.time()
        feats = target_features(model, mb["input_ids"], mb["attention_mask"],
                                plan["taps"] if "taps" in plan["features"] else None)
        _sync(device)
        stats["forward_seconds"] += time.time() - tf
        if check_head:
            check_head_reproduces_logits(model, mb, feats["last_hidden"])
            check_head = False
        for b, i in enumerate(idx):
            n = lengths[i]
            per_example[i] = {name: feats[name][b, :n].to("cpu", sdtype) for name in plan["features"]}
            if not all(torch.isfinite(t).all() for t in per_example[i].values()):
                raise DraftTrainError(f"capture: non-finite hidden states for example {i} (target dtype overflow?)")
        bar.update(sum(lengths[i] for i in idx))
    return per_example


def _write_index(out: Path, plan: dict, stats: dict, say: Callable[[str], None]) -> None:
    """After every rank finished: the index of all shards (an error when one is missing)."""
    n_shards = len(plan["shards"])
    records = [S.read_record(out, k) for k in range(n_shards)]
    missing = [S.shard_name(k) for k, r in enumerate(records) if r is None]
    if missing:
        raise DraftTrainError(f"capture.path={out}: shards {missing[:3]} are still missing after every rank finished")
    total_bytes = sum(r["bytes"] for r in records)
    write_json(out / S.INDEX, {
        "format_version": S.FORMAT_VERSION,
        "plan": plan,
        "shards": records,
        "tokens": plan["tokens"],
        "bytes": total_bytes,
        "bytes_per_token_on_disk": total_bytes / max(1, plan["tokens"]),
    })
    say(f"capture: done -> {out} ({total_bytes / 2**20:.1f} MiB, {total_bytes / max(1, plan['tokens']):.1f} bytes/token "
        f"on disk; this rank wrote {stats['shards_written']} shards, reused {stats['shards_skipped']})")


def run_capture(model, examples: list[dict], out_dir: str | Path, *, method: str, taps=None, dtype: str = "bfloat16",
                batch_size: int = 8, shard_mb: float = 1024.0, target_name: str = "", pad_id: int = 0,
                rank: int = 0, world: int = 1, barrier: Callable[[], None] | None = None,
                progress: bool = True, say: Callable[[str], None] | None = None, source=None) -> dict:
    """Capture ``examples`` into ``out_dir`` (resumable, multi-process). Returns stats of this rank.

    ``source``: where the features come from instead of HF forwards of ``model`` (capture.backend=vllm:
    capture/vllm.py): an object with ``hidden_size``, ``prepare(plan, shards)`` (called once with the shards this
    rank still has to write) and ``shard(plan, k, rows, sdtype, stats, bar) -> {example: {feature: [n, width]}}``, ``written(k)`` (shard k is
    recorded) and ``finish()``."""
    from tqdm.auto import tqdm

    out = Path(out_dir)
    barrier = barrier or (lambda: None)
    say = say or (lambda msg: print(f"[drafttrain] {msg}", flush=True))
    if batch_size <= 0:
        raise DraftTrainError(f"capture.batch_size={batch_size}: must be > 0")
    hidden = source.hidden_size if source is not None else _hidden_size(model)
    plan = make_plan(examples, method, taps, hidden, dtype, shard_mb, target_name)
    sdtype = S.store_dtype(dtype)
    _open_store(out, plan, rank, barrier)

    n_shards = len(plan["shards"])
    mine = [k for k in range(n_shards) if k % world == rank]
    done = {k: S.read_record(out, k) for k in range(n_shards)}
    if rank == 0:
        _announce(out, plan, dtype, sum(sum(len(examples[i]["input_ids"]) for i in range(*plan["shards"][k]))
                                        for k in range(n_shards) if done[k] is None), say)
    lengths = [len(ex["input_ids"]) for ex in examples]
    stats = {"rank": rank, "shards_written": 0, "shards_skipped": 0, "tokens": 0, "bytes_written": 0,
             "forward_seconds": 0.0, "seconds": 0.0}
    my_tokens = sum(lengths[i] for k in mine for i in range(*plan["shards"][k]))
    bar = tqdm(total=my_tokens, desc=f"capture rank {rank}/{world}", unit="tok", disable=not (progress and rank == 0),
               mininterval=2.0)
    t0 = time.time()
    check_head = True
    meta = {"format_version": S.FORMAT_VERSION, "dtype": dtype}
    for k in mine:  # resumed: make sure the recorded shards are intact before trusting them
        if done[k] is not None:
            S.check_shard(out, plan, done[k], checksum=True)
    if source is not None:
        source.prepare(plan, [k for k in mine if done[k] is None])
    for k in mine:
        start, end = plan["shards"][k]
        if done[k] is not None:
            stats["shards_skipped"] += 1
            bar.update(sum(lengths[start:end]))
            continue
        if source is not None:
            per_example = source.shard(plan, k, range(start, end), sdtype, stats, bar)
        else:
            per_example = _capture_shard(model, examples, lengths, plan, range(start, end), batch_size=batch_size,
                                         pad_id=pad_id, sdtype=sdtype, stats=stats, bar=bar, check_head=check_head)
        check_head = False
        ids = list(range(start, end))
        tensors = S.pack_shard(ids, [examples[i] for i in ids],
                               {name: [per_example[i][name] for i in ids] for name in plan["features"]}, sdtype)
        rec = S.write_shard(out, k, tensors, meta, rank=rank)
        if source is not None:
            source.written(k)
        stats["shards_written"] += 1
        stats["tokens"] += rec["tokens"]
        stats["bytes_written"] += rec["bytes"]
    bar.close()
    if source is not None:
        source.finish()
    stats["seconds"] = time.time() - t0
    stats["tokens_per_s"] = stats["tokens"] / stats["seconds"] if stats["tokens"] and stats["seconds"] else None
    barrier()
    if rank == 0:
        _write_index(out, plan, stats, say)
    barrier()
    return stats


def run_capture_job(job) -> dict:
    """``drafttrain capture``: the target and data of a training job (``job``: a ``CaptureJob``,
    drafttrain/config.py), written to ``capture.path``."""
    from accelerate import PartialState

    from ..targets.load import load_target, resolve_device, target_id
    from ..data.select import load_training_data

    c = job.capture
    if not c.path:
        raise DraftTrainError("capture.path is required (the directory to write the features to)")
    if c.backend == "vllm":
        return _run_vllm_capture_job(job)
    device = resolve_device(job.target.device)
    state = PartialState(cpu=device.type == "cpu")
    if job.target.device == "auto" and device.type == "cuda":
        device = state.device
    rank, world = state.process_index, state.num_processes
    with state.main_process_first():
        model, tokenizer, path = load_target(job.target, device=device)
    tname = target_id(path)
    with state.main_process_first():
        examples, _, dstats = load_training_data(job, model, tokenizer, tname, Path(c.path))
    taps = capture_taps(job, model)
    if state.is_main_process:
        print(f"[drafttrain] capture: target {tname}, method {job.method}, data {dstats}, {world} process(es)",
              flush=True)
    stats = run_capture(model, examples, c.path, method=job.method, taps=taps, dtype=c.dtype,
                        batch_size=c.batch_size, shard_mb=c.shard_mb, target_name=tname,
                        pad_id=tokenizer.pad_token_id, rank=rank, world=world, barrier=state.wait_for_everyone,
                        say=(lambda m: print(f"[drafttrain] {m}", flush=True)) if state.is_main_process else (lambda m: None))
    if state.is_main_process:
        print(f"[drafttrain] capture rank 0 stats: {stats}", flush=True)
    return stats


def _run_vllm_capture_job(job) -> dict:
    """capture.backend=vllm: one process; vLLM (engine venv) computes the states, this process writes the store.
    Only the target's embeddings, final norm and lm_head are loaded here (all of it when the built-in data is
    regenerated by the target)."""
    import os

    from ..data.select import load_training_data
    from ..engines.vllm_check import require_engine_python
    from ..targets.load import load_target, load_target_parts, target_id
    from .vllm import VllmSource

    c = job.capture
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise DraftTrainError("capture.backend=vllm runs in one process (vLLM parallelises itself); run it without "
                              "accelerate launch")
    require_engine_python("capture.backend=vllm: ")  # before loading anything
    say = lambda m: print(f"[drafttrain] {m}", flush=True)  # noqa: E731
    regen = job.data.source == "builtin" and job.data.regenerate
    load = load_target if regen else (lambda t, device: load_target_parts(t, device=device, say=say))
    model, tokenizer, path = load(job.target, device="cpu")
    tname = target_id(path)
    examples, _, dstats = load_training_data(job, model, tokenizer, tname, Path(c.path))
    taps = capture_taps(job, model)
    say(f"capture: target {tname}, method {job.method}, data {dstats}, backend vllm")
    source = VllmSource(model, path, examples, Path(c.path), batch_size=c.batch_size, say=say)
    stats = run_capture(None, examples, c.path, method=job.method, taps=taps, dtype=c.dtype, batch_size=c.batch_size,
                        shard_mb=c.shard_mb, target_name=tname, say=say, source=source)
    stats["max_next_token_logit_gap"] = source.max_gap
    say(f"capture stats: {stats}")
    return stats
