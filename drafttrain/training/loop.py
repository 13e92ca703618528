"""The training loop: Accelerate (DDP / DeepSpeed / FSDP via ``accelerate launch``), online or offline capture.

``run_train(job, run_dir)`` reads top to bottom: ``setup`` (accelerator, target, data, drafter, optimizer and
schedule, resume) -> ``train`` (``train_step`` per optimizer step: capture, global valid counts, loss,
backward, clip, step; logging; checkpoints) -> ``save_final`` -> ``final_evaluation``. The loop is
method-agnostic: a method implements :class:`drafttrain.training.method.TrainingMethod`. The Accelerate /
DeepSpeed plumbing is training/distributed.py; stored features (capture.mode=offline) are training/offline.py;
the speed line is training/speed.py. The CLI gives the typed job (drafttrain.config.TrainJob) and the run
directory; nothing here knows Hydra.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import resource
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data.select import describe_data, load_training_data
from ..io import DraftTrainError, write_json
from . import batching, checkpoint
from .distributed import (
    configure_deepspeed,
    eval_module,
    full_params,
    is_deepspeed,
    make_accelerator,
    unwrap,
    whole_models,
    zero3,
)
from .method import TrainingMethod, make_method, method_class, refuse_offline, target_layers_needed
from .offline import capture_batch, check_store, offline_data
from .optim import build_ema, build_optimizer
from .speed import StepSpeed, cost_note


def lr_lambda(warmup: int, total: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        frac = (step - warmup) / max(1, total - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    return f


@dataclass
class Run:
    """Everything a training run holds between its phases."""

    job: Any
    run_dir: Path
    accelerator: Any
    plan: batching.BatchPlan
    log_with: Any
    init_kwargs: dict | None = None  # the tracker's
    model: Any = None
    tokenizer: Any = None
    tname: str = ""
    store: Any = None  # capture.mode=offline: the feature store written by `drafttrain capture`
    examples: list = field(default_factory=list)
    eval_convs: list = field(default_factory=list)
    method: TrainingMethod | None = None
    drafter: Any = None
    wrapped: Any = None  # the drafter as prepared (DDP / FSDP / DeepSpeed engine)
    optimizer: Any = None
    scheduler: Any = None
    ema: Any = None  # train.ema_decay's WeightEMA (None: off)
    meta: dict = field(default_factory=dict)
    order: list = field(default_factory=list)  # parameter names per optimizer group (checkpoints gather by name)
    start_step: int = 0
    resume_from: Path | None = None
    history: list = field(default_factory=list)
    cells: list = field(default_factory=lambda: [0, 0])  # tensor cells and real tokens of this process's batches
    train_seconds: float = 0.0
    train_cpu_seconds: float = 0.0  # this process's CPU time (user + system, all its threads) over the loop
    train_metrics: dict = field(default_factory=dict)

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def final_dir(self) -> Path:
        return self.run_dir / "final"

    def say(self, msg: str) -> None:
        if self.main:
            print(f"[drafttrain] {msg}", flush=True)


def run_train(job, run_dir: Path) -> dict | None:
    """Train ``job`` (a drafttrain.config.TrainJob) into ``run_dir``; return the final evaluation's report."""
    run = setup(job, Path(run_dir))
    train(run)
    save_final(run)
    report = final_evaluation(run)
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()
    return report


# ---- setup ----

def setup(job, run_dir: Path) -> Run:
    """Accelerator, target, data, drafter, optimizer and schedule, resumed if asked, prepared for training."""
    run = _start(job, run_dir)
    setup_scope = contextlib.ExitStack()  # ZeRO-3: models built during setup stay whole (the frozen target)
    setup_scope.enter_context(whole_models(run.accelerator))
    _load_target(run)
    _load_data(run)
    _build_drafter(run)
    _resume(run)
    setup_scope.close()
    _prepare(run)
    return run


def _start(job, run_dir: Path) -> Run:
    """The Accelerator and batch plan; every process writes into rank 0's run directory (a timestamped
    directory name may differ across ranks)."""
    from accelerate.utils import broadcast_object_list, set_seed

    from ..targets.load import resolve_device
    from .logging import tracker_for

    tc = job.train
    log_with, init_kwargs = tracker_for(job.logger, run_dir)
    accelerator = make_accelerator(tc, resolve_device(job.target.device), log_with)
    plan = batching.make_plan(tc.batch_size, tc.micro_batch_size, accelerator.num_processes)
    accelerator.gradient_accumulation_steps = plan.accumulation
    configure_deepspeed(accelerator, plan, tc)
    shared = [str(run_dir)]
    broadcast_object_list(shared)
    if Path(shared[0]) != run_dir and accelerator.is_local_main_process is False:
        shutil.rmtree(run_dir, ignore_errors=True)
    set_seed(tc.seed)
    run = Run(job, Path(shared[0]), accelerator, plan, log_with, init_kwargs)
    run.say(f"run directory: {run.run_dir}")
    return run


def _load_target(run: Run) -> None:
    """The target, built on the main process first when it is the built-in one. capture.mode=offline: its
    layers never run, so only what the drafter copies (embeddings, lm_head, the first layers of a
    from_target_layers draft) is loaded; the whole target is loaded for the final evaluation."""
    from ..targets.load import load_target, load_target_parts, target_id

    job, acc = run.job, run.accelerator
    if job.capture.mode == "offline":  # before anything is loaded
        refuse_offline(job, method_class(job)[0])
    first_layers = target_layers_needed(job) if job.capture.mode == "offline" else None
    with acc.main_process_first():
        if first_layers is None:
            run.model, run.tokenizer, path = load_target(job.target, device=acc.device)
        else:
            run.model, run.tokenizer, path = load_target_parts(job.target, device=acc.device,
                                                               first_layers=first_layers, say=run.say)
    run.tname = target_id(path)
    run.meta = {"method": job.method, "target": run.tname, "world_size": acc.num_processes,
                "config": dataclasses.asdict(job)}  # what a checkpoint records about its run (resume checks it)
    run.say(_describe_target(run.tname, run.model, first_layers))


def _load_data(run: Run) -> None:
    """The training examples and held-out evaluation rows (the main process regenerates/caches first, the
    others reuse the cache); capture.mode=offline: the examples of the feature store."""
    job = run.job
    if job.capture.mode == "offline":
        run.store, run.examples, run.eval_convs, stats = offline_data(job, run.tname)
    elif job.capture.mode != "online":
        raise DraftTrainError(f"capture.mode={job.capture.mode}: expected online or offline")
    else:
        with run.accelerator.main_process_first():
            run.examples, run.eval_convs, stats = load_training_data(job, run.model, run.tokenizer, run.tname,
                                                                     run.run_dir)
    run.say(describe_data(stats, run.eval_convs))


def _build_drafter(run: Run) -> None:
    from accelerate.utils import set_seed

    job, tc = run.job, run.job.train
    # the drafter's initialisation depends on train.seed alone, not on whatever loading the target and the data
    # drew from the random state, so a first run (which may build or regenerate them) and a later one that finds
    # them cached train the same drafter
    set_seed(tc.seed)
    run.method = make_method(job, run.tokenizer, run.model)
    if run.store is not None:
        check_store(run.store, run.method, job)
    run.drafter = run.method.build_drafter(run.model, run.examples, run.tname).to(run.accelerator.device)
    n_train = sum(p.numel() for p in run.drafter.trainable_parameters())
    run.say(f"drafter: {job.method}, {n_train / 1e6:.2f}M trainable params, {run.method.describe(run.drafter)}")
    run.optimizer = build_optimizer(run.drafter, run.method.param_groups(run.drafter, tc.lr), tc,
                                    checkpoint.distributed_kind(run.accelerator))
    # stepped by hand once per optimizer step (not prepared: that would tie it to the world size)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer,
                                                      lr_lambda(tc.warmup_steps, tc.max_steps, tc.min_lr_ratio))
    run.order = checkpoint.param_order(run.drafter, run.optimizer)
    run.ema = build_ema(run.drafter, tc, checkpoint.distributed_kind(run.accelerator))


def _resume(run: Run) -> None:
    resume_from = checkpoint.resolve_resume(run.job.train.resume, run.run_dir)
    if resume_from is None:
        return
    checkpoint.check_compatible(checkpoint.read_checkpoint_meta(resume_from), run.meta, resume_from)
    optimizer = None if is_deepspeed(run.accelerator) else run.optimizer  # DeepSpeed's state is filled after prepare
    run.start_step = checkpoint.load_checkpoint(resume_from, run.drafter, optimizer, run.scheduler)
    if run.ema is not None:
        run.ema.load_state_dict(checkpoint.load_ema(resume_from), str(resume_from / checkpoint.EMA_FILE))
    run.resume_from = resume_from
    run.say(f"resumed from {resume_from} at step {run.start_step}")


def _prepare(run: Run) -> None:
    acc = run.accelerator
    run.wrapped, run.optimizer = acc.prepare(run.drafter, run.optimizer)
    if run.resume_from is not None and is_deepspeed(acc):  # DeepSpeed builds its optimizer state in prepare
        checkpoint.restore_deepspeed_optimizer(run.optimizer, run.drafter, checkpoint.load_weights(run.resume_from),
                                               checkpoint.load_optimizer_state(run.resume_from), run.order)
    if run.main and run.log_with:
        acc.init_trackers(run.job.logger.project, config=run.meta["config"], init_kwargs=run.init_kwargs)
    acc.wait_for_everyone()


def _describe_target(tname: str, model, first_layers: int | None) -> str:
    """The log line of the target; with capture.mode=offline, what of it was loaded and what was not."""
    from ..targets.load import is_partial, num_layers

    L = num_layers(model)
    total = sum(p.numel() for p in model.parameters())
    line = f"target: {tname} ({total / 1e6:.1f}M params, {L} layers)"
    if first_layers is None or not is_partial(model):  # online, or the whole target loaded after all
        return line
    loaded = sum(p.numel() for p in model.parameters() if not p.is_meta)
    n = min(first_layers, L)
    return (f"{line}; capture.mode=offline: loaded {loaded / 1e6:.1f}M params (embeddings, final norm, lm_head"
            f"{f', decoder layers 0..{n - 1}' if n else ''}), decoder layers {n}..{L - 1} were not loaded")


# ---- train ----

def train(run: Run) -> None:
    """Optimizer steps from ``run.start_step`` to ``train.max_steps``: log, checkpoint, evaluate checkpoints."""
    from tqdm.auto import tqdm

    tc, acc = run.job.train, run.accelerator
    bar = tqdm(range(run.start_step, tc.max_steps), desc="train", disable=not run.main, initial=run.start_step,
               total=tc.max_steps, mininterval=2.0)
    log = {"t": time.time(), "tokens": 0}  # since the last logged step (tokens/s counts training time only)
    t_start, cpu_start = time.time(), time.process_time()
    speed = StepSpeed(acc.num_processes, run.start_step, tc.max_steps, sync=acc.device.type == "cuda")
    for step in bar:
        speed.begin()
        real_before = run.cells[1]
        summary = train_step(run, step, speed, log)
        run.history.append(summary)
        speed.end(run.cells[1] - real_before)
        _report_step(run, summary, speed, bar, log)
        done = step + 1
        if tc.save_every and done % tc.save_every == 0 and done < tc.max_steps:
            save_checkpoint(run, done)
            if tc.eval_checkpoints and len(run.eval_convs):
                t_eval = time.time()
                evaluate_checkpoint(run, done)
                log["t"] += time.time() - t_eval
    bar.close()
    run.train_seconds = time.time() - t_start
    run.train_cpu_seconds = time.process_time() - cpu_start


def train_step(run: Run, step: int, speed: StepSpeed | None = None, log: dict | None = None) -> dict:
    """One optimizer step over the global batch of ``step`` (this process's micro-batches); the summary of
    its globally reduced metrics."""
    from ..data.chat import collate
    from ..data.packing import collate_packed

    job, tc, acc, method = run.job, run.job.train, run.accelerator, run.method
    mb_idx = batching.micro_batches(len(run.examples), run.plan, step, tc.seed, acc.process_index)
    method.begin_step(step)  # e.g. EAGLE-3's TTT curriculum sets this step's unrolled depth
    rows = method.transform_examples(run.drafter, [[run.examples[i] for i in idx] for idx in mb_idx], step,
                                     acc.process_index)  # e.g. on-policy rows sampled by the draft itself
    pad_id = run.tokenizer.pad_token_id
    mbs = [collate_packed(r, pad_id, job.data.max_length) if tc.packing else collate(r, pad_id) for r in rows]
    mbs = [{k: v.to(acc.device) for k, v in mb.items()} for mb in mbs]
    caps = [capture_batch(method, run.model, mb, run.store, idx, run.examples) for mb, idx in zip(mbs, mb_idx)]
    if speed is not None:
        speed.captured()
    counts = sum(method.count_valid(run.drafter, mb, cap) for mb, cap in zip(mbs, caps))
    counts = acc.reduce(counts.to(acc.device), reduction="sum")
    sums: dict = {}
    for idx, mb, cap in zip(mb_idx, mbs, caps):
        stats = _micro_step(run, mb, cap, counts, step, idx, sums)
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v
        real = int(mb["attention_mask"].sum())
        run.cells[0] += mb["attention_mask"].numel()
        run.cells[1] += real
        if log is not None:
            log["tokens"] += real
    run.scheduler.step()
    return _summarize(run, sums, step + 1)


def _micro_step(run: Run, mb: dict, cap, counts: torch.Tensor, step: int, idx: list[int], sums: dict) -> dict:
    """Loss and backward of one micro-batch; on the last of the step, clip and update. Stops before a
    non-finite loss or gradient norm reaches the weights."""
    acc, tc, wrapped = run.accelerator, run.job.train, run.wrapped
    scale = float(acc.num_processes * run.plan.accumulation)
    with acc.accumulate(wrapped):
        with acc.autocast():
            loss, stats = run.method.loss(wrapped, run.drafter, mb, cap, counts, scale)
        _stop_if_not_finite(acc, loss, "loss", step, idx, run.run_dir)
        acc.backward(loss)
        if acc.sync_gradients:
            grad_norm = acc.clip_grad_norm_(wrapped.parameters(), tc.grad_clip if tc.grad_clip > 0 else float("inf"))
            if grad_norm is not None:
                _stop_if_not_finite(acc, torch.as_tensor(grad_norm), "gradient norm", step, idx, run.run_dir)
                sums["grad_norm"] = float(grad_norm)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        if run.ema is not None and acc.sync_gradients:
            run.ema.update()
    return stats


def _summarize(run: Run, sums: dict, done: int) -> dict:
    keys = sorted(k for k in sums if k != "grad_norm")
    reduced = run.accelerator.reduce(torch.stack([torch.as_tensor(sums[k]) for k in keys]).to(
        run.accelerator.device), reduction="sum").cpu()
    summary = run.method.summarize(dict(zip(keys, reduced.tolist())))
    summary["lr"] = run.scheduler.get_last_lr()[0]
    summary["grad_norm"] = sums.get("grad_norm", float("nan"))
    summary["step"] = done
    return summary


def _report_step(run: Run, summary: dict, speed: StepSpeed, bar, log: dict) -> None:
    """The speed estimate (once), the progress bar, and every train.log_every steps the tracker's train/*."""
    tc, acc, done = run.job.train, run.accelerator, summary["step"]
    if speed.estimate_ready() and run.main:  # above the progress bar, which is redrawn below it
        bar.write(f"[drafttrain] {speed.estimate_line(cost_note(run.job, run.model, run.method, run.plan))}")
    if run.main:
        post = {"loss": f"{summary['loss']:.3f}", "acc0": f"{summary['acc_0']:.2f}"}
        if speed.tokens_per_s:
            post["tok/s"] = f"{speed.tokens_per_s:.0f}"
        bar.set_postfix(post)
    if done % tc.log_every == 0 or done == tc.max_steps:
        summary["tokens_per_s"] = log["tokens"] * acc.num_processes / max(time.time() - log["t"], 1e-9)
        if speed.seconds_per_step:  # measured after the warm-up step, checkpoints and evaluations excluded
            summary["seconds_per_step"] = speed.seconds_per_step
            summary["eta_seconds"] = speed.seconds_per_step * (tc.max_steps - done)
        log["t"], log["tokens"] = time.time(), 0
        if run.main and run.log_with:
            acc.log({f"train/{k}": v for k, v in summary.items() if k != "step"}, step=done)


def _stop_if_not_finite(accelerator, value: torch.Tensor, what: str, step: int, rows: list[int], run_dir) -> None:
    """Stop (on every process) before a NaN/inf reaches the weights; name the step, the batch and the last
    good checkpoint, which stays on disk untouched."""
    bad = torch.tensor([0.0 if bool(torch.isfinite(value.detach()).all()) else 1.0], device=accelerator.device)
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad, reduction="sum")
    if bad.item() > 0:
        last = checkpoint.list_checkpoints(run_dir)
        raise DraftTrainError(
            f"non-finite {what} at step {step + 1} (this process's micro-batch: dataset rows {rows}); "
            f"stopped before the update; last good checkpoint: {last[-1] if last else 'none'}"
        )


# ---- save ----

def save_checkpoint(run: Run, step: int) -> None:
    """``step_<N>/``: full weights and optimizer state in the single-process layout (a collective under
    ZeRO-3 / FSDP: every process calls it), then older checkpoints pruned to train.keep_checkpoints."""
    acc = run.accelerator
    weights, optim_state = checkpoint.gather_state(acc, run.wrapped, run.drafter, run.optimizer, run.order)
    if acc.is_main_process:
        path = checkpoint.checkpoint_dir(run.run_dir, step)
        checkpoint.write_checkpoint(path, weights, optim_state, run.scheduler, step, run.meta,
                                    ema=None if run.ema is None else run.ema.state_dict())
        checkpoint.prune_checkpoints(run.run_dir, run.job.train.keep_checkpoints)
    acc.wait_for_everyone()


def save_final(run: Run) -> None:
    """The last checkpoint, then ``final/`` (the drafter as eval and export read it) and train_metrics.json."""
    tc, acc = run.job.train, run.accelerator
    if tc.max_steps > run.start_step or run.resume_from is None:
        save_checkpoint(run, tc.max_steps)
    if run.ema is not None:  # the checkpoint keeps the last weights and the average; final/ the average
        run.ema.copy_to_weights()
    gathered = contextlib.ExitStack()  # ZeRO-3: the full weights on every process while the drafter is saved
    gathered.enter_context(full_params(acc, run.wrapped))
    if run.main:
        tail = run.history[-min(len(run.history), 10):]
        # only what every step of the tail has (tokens_per_s and the speed are logged every train.log_every steps)
        run.train_metrics = {k: sum(h[k] for h in tail) / len(tail) for k in (tail[0] if tail else {})
                             if all(k in h for h in tail)}
        run.method.finalize(unwrap(acc, run.wrapped), run.train_metrics)  # e.g. Medusa's tree from its accuracy
        unwrap(acc, run.wrapped).save_pretrained(run.final_dir)
        padding = run.cells[0] / max(1, run.cells[1])
        write_json(run.run_dir / "train_metrics.json", {"history": run.history, "train_seconds": run.train_seconds,
                                                        "train_cpu_seconds": run.train_cpu_seconds,
                                                        "real_tokens": run.cells[1],  # this process's batches
                                                        "peak_memory_mb": peak_memory_mb(acc.device),
                                                        "padded_per_real_token": padding})
        run.say(f"saved drafter to {run.final_dir} ({run.train_seconds:.0f}s of training; {padding:.2f} tensor "
                f"cells per real token{'' if tc.packing else ', train.packing=false'})")
    acc.wait_for_everyone()
    gathered.close()


# ---- evaluation ----

def _whole_target(run: Run, why: str):
    """The target the decoder runs: with capture.mode=offline the whole one is loaded (once, on the main
    process; its lm_head is the one training read, so training is unchanged)."""
    from ..targets.load import is_partial, load_target

    if is_partial(run.model):
        run.say(why)
        with whole_models(run.accelerator):  # ZeRO-3: not partitioned (only this process evaluates)
            run.model, _, _ = load_target(run.job.target, device=run.accelerator.device)
    return run.model


def _log_eval(run: Run, report: dict, directory: Path, step: int) -> None:
    from .logging import log_image

    if not run.log_with:
        return
    run.accelerator.log({f"eval/{k}": v for k, v in report.items() if isinstance(v, (int, float))}, step=step)
    if (directory / "acceptance.png").exists():
        log_image(run.accelerator, "eval/acceptance_per_position", directory / "acceptance.png", step)


def evaluate_checkpoint(run: Run, step: int) -> None:
    """train.eval_checkpoints: decode with the drafter as of this checkpoint (main process); the report lands
    in the checkpoint's directory and eval/* (α, τ, speedup, the acceptance plot) is logged at its step."""
    acc = run.accelerator
    skip = "ZeRO-3 (partitioned weights)" if zero3(acc) else \
        "Medusa-2 (its evaluation merges the adapters into the target)" if getattr(run.method, "joint", False) else None
    if skip:
        if step == run.job.train.save_every:
            run.say(f"train.eval_checkpoints: skipped under {skip}; evaluate checkpoints with drafttrain eval")
        return
    if acc.is_main_process:
        from ..evaluation import evaluate_drafter

        model = _whole_target(run, "train.eval_checkpoints with capture.mode=offline: loading the whole target on "
                                   "the main process (once) to decode")
        path = checkpoint.checkpoint_dir(run.run_dir, step)
        module = unwrap(acc, run.wrapped)
        with run.ema.applied() if run.ema is not None else contextlib.nullcontext():  # what final/ would hold
            eval_model, eval_drafter, extra = run.method.eval_setup(model, module)  # what the decoder drafts with
            report = evaluate_drafter(eval_model, run.tokenizer, eval_drafter, run.job.decode, run.eval_convs,
                                      path, target_name=run.tname, drafter_name=str(path), extra=extra)
        module.train()
        _log_eval(run, report, path, step)
    acc.wait_for_everyone()


def final_evaluation(run: Run) -> dict | None:
    """train.eval: AR vs speculative decoding with the final drafter on the held-out rows (main process), and
    the sampled row beside greedy (train.eval_sampled_temperature)."""
    job, tc = run.job, run.job.train
    if not (tc.eval and run.main and len(run.eval_convs)):
        return None
    from ..evaluation import add_sampled_row, evaluate_drafter

    est = run.method.estimated_tau(run.train_metrics, job.decode.num_draft_tokens) if run.train_metrics else None
    model = _whole_target(run, "loading the whole target for the evaluation")
    drafter = eval_module(run.accelerator, run.wrapped, run.final_dir)
    eval_model, eval_drafter, extra = run.method.eval_setup(model, drafter)  # e.g. Medusa-2's adapted target
    names = dict(target_name=run.tname, drafter_name=str(run.final_dir))
    report = evaluate_drafter(eval_model, run.tokenizer, eval_drafter, job.decode, run.eval_convs, run.run_dir,
                              train_estimated_tau=est, extra=extra, **names)
    if tc.eval_sampled_temperature > 0 and job.decode.temperature == 0:  # the usual chat setting, beside greedy
        add_sampled_row(report, eval_model, run.tokenizer, eval_drafter, job.decode, run.eval_convs, run.run_dir,
                        tc.eval_sampled_temperature, tc.eval_sampled_top_p, **names)
    _log_eval(run, report, run.run_dir, tc.max_steps)
    return report


def peak_memory_mb(device) -> dict:
    """The main process's peak memory so far, in MiB: resident set (the target, the drafter, the data and the
    optimizer state together) and, on a GPU, the most torch allocated on it."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out = {"rss": round(rss / (2**20 if sys.platform == "darwin" else 2**10), 1)}
    if device.type == "cuda":
        out["cuda_allocated"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return out
