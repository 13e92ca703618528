"""The training loop: Accelerate (DDP / DeepSpeed / FSDP via ``accelerate launch``), online capture.

Reads top to bottom: set up -> load target -> data -> drafter -> optimizer/schedule -> resume -> steps
(capture, global valid counts, loss, backward, clip, step) -> checkpoints -> final save -> evaluation.

The loop is method-agnostic. A *method* (training/eagle3.py, …) is an object with:
  build_drafter(target_model, examples, target_name) -> nn.Module  (forward = training forward;
                                                        trainable_parameters(); save_pretrained(dir))
  describe(drafter) -> str                            one line for the log
  param_groups(drafter, lr) -> list[dict]             optimizer groups (e.g. a head lr multiplier)
  capture(target_model, batch) -> object              online capture: target forward under no_grad
  count_valid(drafter, batch, cap) -> Tensor[n]       valid positions per loss term (summed over the
                                                        global batch before the loss is normalised)
  loss(model, drafter, batch, cap, counts, scale) -> (loss, dict of per-term sums)
  summarize(sums) -> dict with "loss"                 means from the globally reduced sums
  estimated_tau(summary, k) -> float | None           τ implied by training metrics
Optional hooks (training/medusa.py, training/distill.py):
  transform_examples(drafter, rows, step, rank) -> rows  rewrite a step's micro-batches before collation
                                                        (on-policy rows sampled by the draft itself)
  finalize(drafter, train_metrics)                    before the final save (Medusa: tree from accuracy)
  eval_setup(target, drafter) -> (target, drafter, extra report keys)
                                                      what the decoder verifies with and drafts with
                                                      (Medusa-2: the adapted target, merged)
  target_layers(cfg) -> int  (static)                 how many of the target's first decoder layers
                                                      build_drafter copies (distill from_target_layers)
capture.mode=offline (offline_features, capture_from_features): the target given to the method is
load_target_parts's: embeddings, final norm, lm_head and the first target_layers(cfg) decoder layers are
loaded, the other layers stay on the meta device; the whole target is loaded after training to evaluate.
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ..data.select import describe_data, load_training_data
from ..io import DraftTrainError, write_json
from . import batching, checkpoint


def _run_dir_from_hydra() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def _mixed_precision(value: str, device: torch.device) -> str:
    if value == "auto":
        return "bf16" if device.type == "cuda" else "no"
    if value not in ("no", "bf16", "fp16"):
        raise DraftTrainError(f"train.mixed_precision={value}: expected auto, no, bf16 or fp16")
    return value


def lr_lambda(warmup: int, total: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        frac = (step - warmup) / max(1, total - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    return f


def _method_class(job):
    """``(class, its config section)`` of ``job.method``."""
    if job.method == "eagle3":
        from .eagle3 import Eagle3Method

        return Eagle3Method, job.eagle3
    if job.method in ("medusa", "medusa2"):
        from .medusa import MedusaMethod

        return MedusaMethod, job.medusa
    if job.method == "distill":
        from .distill import DistillMethod

        return DistillMethod, job.distill
    raise DraftTrainError(f"method={job.method}: not a training method (expected: eagle3, medusa, medusa2, "
                          "distill)")


def make_method(job, tokenizer, target_model):
    cls, cfg = _method_class(job)
    if job.method in ("medusa", "medusa2"):
        return cls(cfg, tokenizer, target_model, joint=job.method == "medusa2")
    if job.method == "distill":
        return cls(cfg, tokenizer, target_model, seed=job.train.seed)
    return cls(cfg, tokenizer, target_model)


def target_layers_needed(job) -> int:
    """How many of the target's first decoder layers the method builds its drafter from (the optional static
    ``target_layers(cfg)`` of its class; 0 without one). capture.mode=offline loads only those of its layers."""
    cls, cfg = _method_class(job)
    return int(cls.target_layers(cfg)) if hasattr(cls, "target_layers") else 0


def run_train(cfg) -> dict | None:
    from accelerate import Accelerator
    from accelerate.utils import broadcast_object_list, set_seed
    from tqdm.auto import tqdm

    from ..data.chat import collate
    from ..data.packing import collate_packed
    from ..targets.load import (
        is_partial,
        load_target,
        load_target_parts,
        resolve_device,
        target_id,
    )
    from .logging import log_image, tracker_for

    job = OmegaConf.to_object(cfg)
    tc = job.train
    hydra_dir = _run_dir_from_hydra()

    device = resolve_device(job.target.device)
    log_with, init_kwargs = tracker_for(job.logger, hydra_dir)
    accelerator = _make_accelerator(Accelerator, tc, device, log_with)
    world, rank = accelerator.num_processes, accelerator.process_index
    plan = batching.make_plan(tc.batch_size, tc.micro_batch_size, world)
    accelerator.gradient_accumulation_steps = plan.accumulation
    _configure_deepspeed(accelerator, plan, tc)
    setup = contextlib.ExitStack()  # ZeRO-3: models built during setup stay whole (the frozen target above all)
    setup.enter_context(_whole_models(accelerator))

    # every process writes into rank 0's run directory (Hydra's timestamped name may differ across ranks)
    shared = [str(hydra_dir)]
    broadcast_object_list(shared)
    run_dir = Path(shared[0])
    if run_dir != hydra_dir and accelerator.is_local_main_process is False:
        shutil.rmtree(hydra_dir, ignore_errors=True)
    set_seed(tc.seed)
    main = accelerator.is_main_process

    def say(msg: str) -> None:
        if main:
            print(f"[drafttrain] {msg}", flush=True)

    say(f"run directory: {run_dir}")
    # ---- target (built on the main process first when it is the built-in one) ----
    # capture.mode=offline: its layers never run, so only what the drafter copies (embeddings, lm_head, the first
    # layers of a from_target_layers draft) is loaded; the whole target is loaded for the final evaluation
    if job.capture.mode == "offline":  # before anything is loaded
        _refuse_offline(job, _method_class(job)[0])
    first_layers = target_layers_needed(job) if job.capture.mode == "offline" else None
    with accelerator.main_process_first():
        if first_layers is None:
            model, tokenizer, target_path = load_target(job.target, device=accelerator.device)
        else:
            model, tokenizer, target_path = load_target_parts(job.target, device=accelerator.device,
                                                              first_layers=first_layers, say=say)
    tname = target_id(target_path)
    say(_describe_target(tname, model, first_layers))

    # ---- data (the main process regenerates/caches first, the others reuse the cache) ----
    store = None  # capture.mode=offline: the feature store written by `drafttrain capture`
    if job.capture.mode == "offline":
        store, examples, eval_convs, dstats = _offline_data(job, tname)
    elif job.capture.mode != "online":
        raise DraftTrainError(f"capture.mode={job.capture.mode}: expected online or offline")
    else:
        with accelerator.main_process_first():
            examples, eval_convs, dstats = load_training_data(job, model, tokenizer, tname, run_dir)
    say(describe_data(dstats, eval_convs))

    # ---- drafter ----
    method = make_method(job, tokenizer, model)
    if store is not None:
        _check_offline(store, method, job)
    drafter = method.build_drafter(model, examples, tname).to(accelerator.device)
    n_train = sum(p.numel() for p in drafter.trainable_parameters())
    say(f"drafter: {job.method}, {n_train / 1e6:.2f}M trainable params, {method.describe(drafter)}")

    optimizer = torch.optim.AdamW(
        method.param_groups(drafter, tc.lr), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(tc.warmup_steps, tc.max_steps, tc.min_lr_ratio)
    )
    meta = {"method": job.method, "target": tname, "world_size": world,
            "config": OmegaConf.to_container(cfg, resolve=True)}

    start_step = 0
    order = checkpoint.param_order(drafter, optimizer)  # names per optimizer group (checkpoints gather by name)
    deepspeed = checkpoint._distributed_kind(accelerator) == "DEEPSPEED"
    resume_from = checkpoint.resolve_resume(tc.resume, run_dir)
    if resume_from is not None:
        checkpoint.check_compatible(checkpoint.read_checkpoint_meta(resume_from), meta, resume_from)
        start_step = checkpoint.load_checkpoint(resume_from, drafter, None if deepspeed else optimizer, scheduler)
        say(f"resumed from {resume_from} at step {start_step}")

    setup.close()
    # the scheduler is stepped by hand once per optimizer step (not prepared: that would tie it to world size)
    wrapped, optimizer = accelerator.prepare(drafter, optimizer)
    if resume_from is not None and deepspeed:  # DeepSpeed builds its optimizer state in prepare: fill it now
        checkpoint.restore_deepspeed_optimizer(optimizer, drafter, checkpoint.load_weights(resume_from),
                                               checkpoint.load_optimizer_state(resume_from), order)
    if main and log_with:
        accelerator.init_trackers(job.logger.project, config=meta["config"], init_kwargs=init_kwargs)
    accelerator.wait_for_everyone()

    pad_id = tokenizer.pad_token_id
    scale = float(world * plan.accumulation)
    history: list[dict] = []
    bar = tqdm(range(start_step, tc.max_steps), desc="train", disable=not main, initial=start_step,
               total=tc.max_steps, mininterval=2.0)
    t_log, tok_log = time.time(), 0
    cells = [0, 0]  # tensor cells and real tokens of this process's micro-batches (padding = their ratio)
    t_start = time.time()
    speed = StepSpeed(world, start_step, tc.max_steps, sync=accelerator.device.type == "cuda")
    for step in bar:
        speed.begin()
        real_before = cells[1]
        mb_idx = batching.micro_batches(len(examples), plan, step, tc.seed, rank)
        rows = [[examples[i] for i in idx] for idx in mb_idx]
        if hasattr(method, "begin_step"):  # e.g. EAGLE-3's TTT curriculum sets this step's unrolled depth
            method.begin_step(step)
        if hasattr(method, "transform_examples"):  # e.g. on-policy rows sampled by the draft itself
            rows = method.transform_examples(drafter, rows, step, rank)
        mbs = [collate_packed(r, pad_id, job.data.max_length) if tc.packing else collate(r, pad_id) for r in rows]
        mbs = [{k: v.to(accelerator.device) for k, v in mb.items()} for mb in mbs]
        caps = [_capture(method, model, mb, store, idx, examples) for mb, idx in zip(mbs, mb_idx)]
        speed.captured()
        counts = sum(method.count_valid(drafter, mb, cap) for mb, cap in zip(mbs, caps))
        counts = accelerator.reduce(counts.to(accelerator.device), reduction="sum")
        step_stats: dict = {}
        for idx, mb, cap in zip(mb_idx, mbs, caps):
            with accelerator.accumulate(wrapped):
                with accelerator.autocast():
                    loss, stats = method.loss(wrapped, drafter, mb, cap, counts, scale)
                _stop_if_not_finite(accelerator, loss, "loss", step, idx, run_dir)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    clip = tc.grad_clip if tc.grad_clip > 0 else float("inf")
                    grad_norm = accelerator.clip_grad_norm_(wrapped.parameters(), clip)
                    if grad_norm is not None:
                        _stop_if_not_finite(accelerator, torch.as_tensor(grad_norm), "gradient norm", step, idx,
                                            run_dir)
                        step_stats["grad_norm"] = float(grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            for k, v in stats.items():
                step_stats[k] = step_stats.get(k, 0.0) + v
            tok_log += int(mb["attention_mask"].sum())
            cells[0] += mb["attention_mask"].numel()
            cells[1] += int(mb["attention_mask"].sum())
        scheduler.step()
        done = step + 1

        keys = sorted(k for k in step_stats if k != "grad_norm")
        reduced = accelerator.reduce(torch.stack([torch.as_tensor(step_stats[k]) for k in keys]).to(
            accelerator.device), reduction="sum").cpu()
        summary = method.summarize(dict(zip(keys, reduced.tolist())))
        summary["lr"] = scheduler.get_last_lr()[0]
        summary["grad_norm"] = step_stats.get("grad_norm", float("nan"))
        summary["step"] = done
        history.append(summary)
        speed.end(cells[1] - real_before)
        if speed.estimate_ready() and main:  # above the progress bar, which is redrawn below it
            bar.write(f"[drafttrain] {speed.estimate_line(_cost_note(job, model, method, plan))}")
        if main:
            post = {"loss": f"{summary['loss']:.3f}", "acc0": f"{summary['acc_0']:.2f}"}
            if speed.tokens_per_s:
                post["tok/s"] = f"{speed.tokens_per_s:.0f}"
            bar.set_postfix(post)
        if done % tc.log_every == 0 or done == tc.max_steps:
            dt = max(time.time() - t_log, 1e-9)
            summary["tokens_per_s"] = tok_log * world / dt
            if speed.seconds_per_step:  # measured after the warm-up step, checkpoints and evaluations excluded
                summary["seconds_per_step"] = speed.seconds_per_step
                summary["eta_seconds"] = speed.seconds_per_step * (tc.max_steps - done)
            t_log, tok_log = time.time(), 0
            if main and log_with:
                accelerator.log({f"train/{k}": v for k, v in summary.items() if k != "step"}, step=done)
        if tc.save_every and done % tc.save_every == 0 and done < tc.max_steps:
            _save(accelerator, run_dir, drafter, optimizer, scheduler, done, meta, tc.keep_checkpoints, wrapped, order)
            if tc.eval_checkpoints and len(eval_convs):
                t_eval = time.time()
                model = _eval_checkpoint(accelerator, method, model, tokenizer, wrapped, job, eval_convs, run_dir,
                                         tname, done, log_with)
                t_log += time.time() - t_eval  # tokens/s counts training time only
    bar.close()
    train_seconds = time.time() - t_start

    # ---- final checkpoint + drafter ----
    if tc.max_steps > start_step or resume_from is None:
        _save(accelerator, run_dir, drafter, optimizer, scheduler, tc.max_steps, meta, tc.keep_checkpoints, wrapped,
              order)
    final_dir = run_dir / "final"
    gathered = contextlib.ExitStack()  # ZeRO-3: the full weights on every process while the drafter is saved
    gathered.enter_context(_full_params(accelerator, wrapped))
    if main:
        tail = history[-min(len(history), 10):]
        # only what every step of the tail has (tokens_per_s and the speed are logged every train.log_every steps)
        train_metrics = {k: sum(h[k] for h in tail) / len(tail) for k in tail[0] if all(k in h for h in tail)}
        if hasattr(method, "finalize"):  # e.g. Medusa picks its tree from the measured per-head accuracy
            method.finalize(_unwrap(accelerator, wrapped), train_metrics)
        _unwrap(accelerator, wrapped).save_pretrained(final_dir)
        padding = cells[0] / max(1, cells[1])
        write_json(run_dir / "train_metrics.json", {"history": history, "train_seconds": train_seconds,
                                                    "padded_per_real_token": padding})
        say(f"saved drafter to {final_dir} ({train_seconds:.0f}s of training; {padding:.2f} tensor cells per real "
            f"token{'' if tc.packing else ', train.packing=false'})")
    accelerator.wait_for_everyone()
    gathered.close()

    report = None
    if tc.eval and main and len(eval_convs):
        from ..eval import evaluate_drafter

        est = method.estimated_tau(train_metrics, job.decode.num_draft_tokens) if train_metrics else None
        if is_partial(model):  # capture.mode=offline: decoding runs the whole target; training is over, load it
            say("loading the whole target for the evaluation")
            with _whole_models(accelerator):  # ZeRO-3: not partitioned (only this process evaluates)
                model, _, _ = load_target(job.target, device=accelerator.device)
        eval_model, eval_drafter, extra = model, _eval_module(accelerator, wrapped, final_dir), None
        if hasattr(method, "eval_setup"):  # e.g. Medusa-2 verifies with its adapted target
            eval_model, eval_drafter, extra = method.eval_setup(model, eval_drafter)
        report = evaluate_drafter(
            eval_model, tokenizer, eval_drafter, job.decode, eval_convs, run_dir,
            target_name=tname, drafter_name=str(final_dir), train_estimated_tau=est, extra=extra,
        )
        if tc.eval_sampled_temperature > 0 and job.decode.temperature == 0:  # the usual chat setting, beside greedy
            from ..eval import add_sampled_row

            add_sampled_row(report, eval_model, tokenizer, eval_drafter, job.decode, eval_convs, run_dir,
                            tc.eval_sampled_temperature, tc.eval_sampled_top_p, target_name=tname,
                            drafter_name=str(final_dir))
        if log_with:
            accelerator.log({f"eval/{k}": v for k, v in report.items() if isinstance(v, (int, float))},
                            step=tc.max_steps)
            png = run_dir / "acceptance.png"
            if png.exists():
                log_image(accelerator, "eval/acceptance_per_position", png, tc.max_steps)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return report


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s" if s >= 60 else f"{seconds:.1f}s"


class StepSpeed:
    """Seconds per optimizer step, real tokens/s and the ETA of ``max_steps``, measured over the steps after
    this run's first one (warm-up: allocations, lazy initialisation, kernel selection); checkpoint saves and
    evaluations between steps are not counted. ``estimate_ready()`` is true once, after ``MEASURE`` measured
    steps (a run with fewer steps left gets no estimate). With ``sync`` (CUDA) the device is synchronised
    around the target's capture forward during the measured steps of the estimate only, to give its share of
    the step time; on CPU the share is always exact. Real tokens: this process's, times the process count."""

    MEASURE = 2

    def __init__(self, world: int, start_step: int, max_steps: int, sync: bool = False, clock=time.perf_counter):
        self.world, self.first, self.max_steps, self.sync, self.clock = world, start_step, max_steps, sync, clock
        self.seconds = self.capture_seconds = 0.0
        self.steps = self.tokens = 0
        self.done = start_step
        self._t0 = self._t_cap = 0.0
        self._reported = False

    def _measuring(self) -> bool:
        return self.done > self.first  # this step is not the run's first

    def _now(self) -> float:
        if self.sync and self._measuring() and self.steps < self.MEASURE:
            torch.cuda.synchronize()
        return self.clock()

    def begin(self) -> None:
        self._t0 = self._now()

    def captured(self) -> None:
        self._t_cap = self._now() - self._t0

    def end(self, real_tokens: int) -> None:
        dt = self._now() - self._t0
        if self._measuring():
            self.steps += 1
            self.seconds += dt
            self.tokens += real_tokens * self.world
            if self.steps <= self.MEASURE:
                self.capture_seconds += self._t_cap
        self.done += 1

    @property
    def seconds_per_step(self) -> float | None:
        return self.seconds / self.steps if self.steps else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.steps and self.seconds > 0 else None

    def estimate_ready(self) -> bool:
        if self._reported or self.steps < self.MEASURE or self.done >= self.max_steps:
            return False
        self._reported = True
        return True

    def estimate_line(self, note: str = "") -> str:
        sps = self.seconds_per_step
        share = self.capture_seconds / max(1e-9, sps * min(self.steps, self.MEASURE))
        left = self.max_steps - self.done
        return (f"speed: {sps:.2f} s/step ({100 * share:.0f}% in the target forward), {self.tokens_per_s:,.0f} real "
                f"tokens/s, {self.tokens / self.steps:,.0f} real tokens/step{f' ({note})' if note else ''}; ETA "
                f"{_duration(sps * left)} for the {left} steps left of {self.max_steps} (measured over steps "
                f"{self.first + 2}-{self.done}, after a warm-up step)")


def _cost_note(job, model, method, plan) -> str:
    """What a training step's cost scales with, for the speed line (README: "What a training step costs")."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    rows = "packed into rows" if job.train.packing else "one per row"
    mbs = f"{plan.accumulation} micro-batch{'es' if plan.accumulation != 1 else ''}"
    parts = [f"{plan.global_batch} conversations {rows} of <= {job.data.max_length} tokens, {mbs} of "
             f"{plan.micro_batch}{f' x {plan.world_size} processes' if plan.world_size > 1 else ''}"]
    if vocab:
        parts.append(f"target vocab {vocab}")
    if getattr(method, "ttt_steps", None):
        parts.append(f"{method.ttt_steps} TTT step{'s' if method.ttt_steps != 1 else ''}")
    return ", ".join(parts)


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


def _save(accelerator, run_dir, drafter, optimizer, scheduler, step, meta, keep, wrapped, order) -> None:
    # full weights and optimizer state in the single-process layout (a collective under ZeRO-3 / FSDP)
    weights, optim_state = checkpoint.gather_state(accelerator, wrapped, drafter, optimizer, order)
    if accelerator.is_main_process:
        path = checkpoint.checkpoint_dir(run_dir, step)
        checkpoint.write_checkpoint(path, weights, optim_state, scheduler, step, meta)
        checkpoint.prune_checkpoints(run_dir, keep)
    accelerator.wait_for_everyone()


def _eval_checkpoint(accelerator, method, model, tokenizer, wrapped, job, eval_convs, run_dir, tname, step,
                     log_with):
    """train.eval_checkpoints: decode with the drafter as of this checkpoint (main process); the report lands
    in the checkpoint's directory and eval/* (α, τ, speedup, the acceptance plot) is logged at its step.

    Returns the target to use from now on: with capture.mode=offline the main process loads the whole target
    at the first checkpoint evaluation (the decoder runs its layers) and keeps it; its lm_head is the one
    training reads, so training is unchanged, but that process now holds the whole target."""
    from ..targets.load import is_partial, load_target
    from .logging import log_image

    skip = "ZeRO-3 (partitioned weights)" if _zero3(accelerator) else \
        "Medusa-2 (its evaluation merges the adapters into the target)" if getattr(method, "joint", False) else None
    if skip:
        if accelerator.is_main_process and step == job.train.save_every:
            print(f"[drafttrain] train.eval_checkpoints: skipped under {skip}; evaluate checkpoints with drafttrain "
                  "eval", flush=True)
        return model
    if accelerator.is_main_process:
        from ..eval import evaluate_drafter

        if is_partial(model):
            print("[drafttrain] train.eval_checkpoints with capture.mode=offline: loading the whole target on the "
                  "main process (once) to decode", flush=True)
            with _whole_models(accelerator):
                model, _, _ = load_target(job.target, device=accelerator.device)

        path = checkpoint.checkpoint_dir(run_dir, step)
        module = _unwrap(accelerator, wrapped)
        eval_model, eval_drafter, extra = model, module, None
        if hasattr(method, "eval_setup"):  # what the decoder drafts with (Medusa heads, the draft LM)
            eval_model, eval_drafter, extra = method.eval_setup(model, module)
        report = evaluate_drafter(eval_model, tokenizer, eval_drafter, job.decode, eval_convs, path,
                                  target_name=tname, drafter_name=str(path), extra=extra)
        module.train()
        if log_with:
            accelerator.log({f"eval/{k}": v for k, v in report.items() if isinstance(v, (int, float))}, step=step)
            if (path / "acceptance.png").exists():
                log_image(accelerator, "eval/acceptance_per_position", path / "acceptance.png", step)
    accelerator.wait_for_everyone()
    return model


def _make_accelerator(Accelerator, tc, device, log_with):
    """The Accelerator of this process. DeepSpeed on a machine without CUDA (DeepSpeed's CPU accelerator,
    ``DS_ACCELERATOR=cpu``) runs over gloo: accelerate must not get ``cpu=True`` then (that selects its plain
    multi-CPU mode and drops DeepSpeed) and needs the backend named."""
    from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs

    mp = _mixed_precision(tc.mixed_precision, device)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return Accelerator(mixed_precision=mp, log_with=log_with, cpu=device.type == "cpu")
    # the launcher exports the config's "auto" accumulation, which Accelerator cannot parse: the loop sets the
    # real value from the batch plan (and writes it into the DeepSpeed config) right after
    kw = dict(mixed_precision=mp, log_with=log_with, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1))
    if device.type == "cpu":
        if torch.cuda.is_available():
            raise DraftTrainError("DeepSpeed with target.device=cpu on a CUDA machine: use target.device=auto")
        kw["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    return Accelerator(**kw)


def _configure_deepspeed(accelerator, plan, tc) -> None:
    """DeepSpeed takes the batch geometry and clipping from its config (there is no data loader to infer them
    from, and its engine clips): set them from the plan so they match the non-DeepSpeed runs exactly."""
    if checkpoint._distributed_kind(accelerator) != "DEEPSPEED":
        return
    accelerator.state.deepspeed_plugin.deepspeed_config.update(
        train_micro_batch_size_per_gpu=plan.micro_batch, gradient_accumulation_steps=plan.accumulation,
        train_batch_size=plan.global_batch, gradient_clipping=float(tc.grad_clip) if tc.grad_clip > 0 else 0.0,
    )


@contextlib.contextmanager
def _whole_models(accelerator):
    """While a ZeRO-3 config is active, transformers partitions every model it loads or builds (zero.Init),
    including the frozen target, which no DeepSpeed engine owns; hide that config during setup. The drafter
    is partitioned by ``prepare`` (zero3_init_flag: false)."""
    if not _zero3(accelerator):
        yield
        return
    from transformers.integrations import deepspeed as hf_ds

    ref = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = ref


def _zero3(accelerator) -> bool:
    if checkpoint._distributed_kind(accelerator) != "DEEPSPEED":
        return False
    return int(accelerator.state.deepspeed_plugin.zero_stage) == 3


def _full_params(accelerator, wrapped):
    """ZeRO-3: gather the drafter's full parameters on every process (enter on all of them); else a no-op."""
    if not _zero3(accelerator):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(_unwrap(accelerator, wrapped).parameters()), modifier_rank=None)


def _unwrap(accelerator, wrapped):
    """The drafter under its DDP / FSDP wrapper. ``accelerator.unwrap_model`` imports DeepSpeed whenever it is
    installed (and DeepSpeed's import logs "Setting accelerator to CPU" on a machine without CUDA), so it is
    only used in a DeepSpeed run."""
    if checkpoint._distributed_kind(accelerator) == "DEEPSPEED":
        return accelerator.unwrap_model(wrapped)
    from torch.distributed.fsdp import FullyShardedDataParallel  # FSDP1's wrapper (FSDP2 shards in place)

    module = wrapped
    while isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel,
                              FullyShardedDataParallel)):
        module = module.module
    return module


def _eval_module(accelerator, wrapped, final_dir: Path):
    """The drafter to evaluate. Under ZeRO-3 the trained module's parameters are partitioned and its forward
    hooks gather them collectively, so the main process evaluates a fresh copy loaded from ``final/``."""
    module = _unwrap(accelerator, wrapped)
    if not _zero3(accelerator):
        return module
    if not hasattr(type(module), "from_pretrained"):
        raise DraftTrainError(f"ZeRO-3: cannot reload {type(module).__name__} for evaluation; run `drafttrain eval "
                              f"drafter={final_dir}`")
    return type(module).from_pretrained(final_dir, device=accelerator.device)


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


def _offline_data(job, tname: str):
    """capture.mode=offline: the examples (and later their features) from a `drafttrain capture` directory;
    evaluation prompts from ``data`` as usual."""
    from ..capture.store import FeatureStore
    from ..eval import eval_conversations

    c = job.capture
    if not c.path:
        raise DraftTrainError("capture.mode=offline needs capture.path=<directory written by drafttrain capture>")
    store = FeatureStore(c.path, verify=c.verify)
    if store.meta.get("target") != tname:
        raise DraftTrainError(f"capture.path={c.path}: captured from target {store.meta.get('target')}, but this run's "
                              f"target is {tname}")
    examples = store.examples()
    stats = {"rows": len(examples), "tokens": store.num_tokens, "offline_features": str(c.path),
             "trainable_tokens": sum(sum(ex["loss_mask"]) for ex in examples)}
    return store, examples, eval_conversations(job.data, tname), stats


def check_offline(job) -> None:
    """capture.mode=offline: refuse a method that cannot train from stored features (drafttrain.validate)."""
    _refuse_offline(job, _method_class(job)[0])


def _refuse_offline(job, cls) -> None:
    """capture.mode=offline with a method (or a setting of it) that cannot train from stored features."""
    why = cls.offline_unsupported(job) if hasattr(cls, "offline_unsupported") else None
    if why or not hasattr(cls, "capture_from_features"):
        raise DraftTrainError(f"capture.mode=offline: method={job.method} cannot train from stored features"
                              f"{f' ({why})' if why else ''}; use capture.mode=online")


def _check_offline(store, method, job) -> None:
    _refuse_offline(job, type(method))
    needs = method.offline_features
    missing = [n for n in needs if n not in store.features]
    if missing:
        raise DraftTrainError(f"capture.path={job.capture.path}: lacks {', '.join(missing)} needed by method="
                              f"{job.method} (captured for method={store.meta.get('method')})")
    if "taps" in needs and list(store.meta.get("taps") or []) != list(getattr(method, "taps", [])):
        raise DraftTrainError(f"capture.path={job.capture.path}: captured taps {store.meta.get('taps')}, this run's "
                              f"eagle3 taps are {list(method.taps)}")


def _capture(method, model, mb, store, idx, examples):
    """Online: the target runs on the micro-batch. Offline: the stored features of its examples."""
    if store is None:
        return method.capture(model, mb)
    from ..data.packing import pack_features

    packed = "slots" in mb
    if packed:
        spans = [(r, c) for r, c in mb["slots"].tolist()]  # (row, first column) of each example
        lengths = [int(((mb["doc_ids"][r] == mb["doc_ids"][r, c]) & (mb["attention_mask"][r] > 0)).sum())
                   for r, c in spans]
    else:
        lengths = mb["attention_mask"].sum(1).tolist()
        spans = [(b, 0) for b in range(len(lengths))]
    for b, i in enumerate(idx):  # stored features belong to the stored rows: refuse rewritten (on-policy) rows
        r, c = spans[b] if b < len(spans) else (0, 0)
        if b >= len(lengths) or lengths[b] != len(examples[i]["input_ids"]) or \
                mb["input_ids"][r, c: c + lengths[b]].tolist() != examples[i]["input_ids"]:
            raise DraftTrainError("capture.mode=offline: the method rewrote the training rows (on-policy data?); "
                                  "stored features cannot match them: use capture.mode=online")
    device = mb["input_ids"].device
    if not packed:
        return method.capture_from_features(model, mb, store.batch(idx, mb["input_ids"].shape[1],
                                                                   method.offline_features, device=device))
    feats = store.batch(idx, max(lengths), method.offline_features, device=device)
    return method.capture_from_features(model, mb, {k: pack_features(v, lengths, mb) for k, v in feats.items()})
