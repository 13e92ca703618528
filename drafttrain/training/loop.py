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
"""
from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

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


def make_method(job, tokenizer, target_model):
    if job.method == "eagle3":
        from .eagle3 import Eagle3Method

        return Eagle3Method(job.eagle3, tokenizer, target_model)
    raise DraftTrainError(f"method={job.method}: not a training method (expected: eagle3)")


def load_training_data(job, model, tokenizer, target_name: str, run_dir: Path):
    """Return (train examples, eval prompt conversations, data stats)."""
    from ..data.chat import read_conversations, tokenize_conversations

    d = job.data
    if d.source == "builtin":
        from ..data.builtin import builtin_dataset
        from ..targets.builtin import cache_root

        train_convs, eval_convs = builtin_dataset(
            model, tokenizer, target_id=target_name, num_train=d.num_train, num_eval=d.num_eval,
            max_new_tokens=d.regen_max_new_tokens, regenerate=d.regenerate, temperature=d.regen_temperature,
            batch_size=d.regen_batch_size, cache_dir=cache_root() / "data", seed=d.seed,
        )
    elif d.source == "jsonl":
        if not d.path:
            raise DraftTrainError("data.path is required with data=jsonl")
        convs = read_conversations(d.path, skip_invalid=d.skip_invalid)
        if d.eval_path:
            train_convs, eval_convs = convs, read_conversations(d.eval_path, skip_invalid=d.skip_invalid)
        else:
            n_eval = min(d.num_eval, max(0, len(convs) - 1))
            train_convs, eval_convs = convs[: len(convs) - n_eval], convs[len(convs) - n_eval :]
    else:
        raise DraftTrainError(f"data.source={d.source}: expected builtin or jsonl")
    examples, stats = tokenize_conversations(tokenizer, train_convs, d.max_length, d.overlong)
    return examples, eval_convs, stats


def run_train(cfg) -> dict | None:
    from accelerate import Accelerator
    from accelerate.utils import broadcast_object_list, set_seed
    from tqdm.auto import tqdm

    from ..data.chat import collate
    from ..targets.load import load_target, resolve_device, target_id
    from .logging import log_image, tracker_for

    job = OmegaConf.to_object(cfg)
    tc = job.train
    hydra_dir = _run_dir_from_hydra()

    device = resolve_device(job.target.device)
    log_with, init_kwargs = tracker_for(job.logger, hydra_dir)
    accelerator = Accelerator(mixed_precision=_mixed_precision(tc.mixed_precision, device), log_with=log_with,
                              cpu=device.type == "cpu")
    world, rank = accelerator.num_processes, accelerator.process_index
    plan = batching.make_plan(tc.batch_size, tc.micro_batch_size, world)
    accelerator.gradient_accumulation_steps = plan.accumulation

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
    with accelerator.main_process_first():
        model, tokenizer, target_path = load_target(job.target, device=accelerator.device)
    tname = target_id(target_path)
    say(f"target: {tname} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
        f"{model.config.num_hidden_layers} layers)")

    # ---- data (the main process regenerates/caches first, the others reuse the cache) ----
    with accelerator.main_process_first():
        examples, eval_convs, dstats = load_training_data(job, model, tokenizer, tname, run_dir)
    say(f"data: {dstats}")

    # ---- drafter ----
    method = make_method(job, tokenizer, model)
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
    resume_from = checkpoint.resolve_resume(tc.resume, run_dir)
    if resume_from is not None:
        checkpoint.check_compatible(checkpoint.read_checkpoint_meta(resume_from), meta, resume_from)
        start_step = checkpoint.load_checkpoint(resume_from, drafter, optimizer, scheduler)
        say(f"resumed from {resume_from} at step {start_step}")

    # the scheduler is stepped by hand once per optimizer step (not prepared: that would tie it to world size)
    wrapped, optimizer = accelerator.prepare(drafter, optimizer)
    if main and log_with:
        accelerator.init_trackers(job.logger.project, config=meta["config"], init_kwargs=init_kwargs)
    accelerator.wait_for_everyone()

    pad_id = tokenizer.pad_token_id
    scale = float(world * plan.accumulation)
    history: list[dict] = []
    bar = tqdm(range(start_step, tc.max_steps), desc="train", disable=not main, initial=start_step,
               total=tc.max_steps, mininterval=2.0)
    t_log, tok_log = time.time(), 0
    t_start = time.time()
    for step in bar:
        mbs = [collate([examples[i] for i in idx], pad_id) for idx in
               batching.micro_batches(len(examples), plan, step, tc.seed, rank)]
        mbs = [{k: v.to(accelerator.device) for k, v in mb.items()} for mb in mbs]
        caps = [method.capture(model, mb) for mb in mbs]
        counts = sum(method.count_valid(drafter, mb, cap) for mb, cap in zip(mbs, caps))
        counts = accelerator.reduce(counts.to(accelerator.device), reduction="sum")
        step_stats: dict = {}
        for mb, cap in zip(mbs, caps):
            with accelerator.accumulate(wrapped):
                with accelerator.autocast():
                    loss, stats = method.loss(wrapped, drafter, mb, cap, counts, scale)
                if not torch.isfinite(loss):
                    raise DraftTrainError(
                        f"non-finite loss at step {step + 1} (micro-batch rows {mb['input_ids'].shape[0]}); "
                        f"last good checkpoint: {checkpoint.list_checkpoints(run_dir)[-1:] or 'none'}"
                    )
                accelerator.backward(loss)
                if accelerator.sync_gradients and tc.grad_clip > 0:
                    grad_norm = accelerator.clip_grad_norm_(wrapped.parameters(), tc.grad_clip)
                    step_stats["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            for k, v in stats.items():
                step_stats[k] = step_stats.get(k, 0.0) + v
            tok_log += int(mb["attention_mask"].sum())
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
        if main:
            bar.set_postfix(loss=f"{summary['loss']:.3f}", acc0=f"{summary['acc_0']:.2f}")
        if done % tc.log_every == 0 or done == tc.max_steps:
            dt = max(time.time() - t_log, 1e-9)
            summary["tokens_per_s"] = tok_log * world / dt
            t_log, tok_log = time.time(), 0
            if main and log_with:
                accelerator.log({f"train/{k}": v for k, v in summary.items() if k != "step"}, step=done)
        if tc.save_every and done % tc.save_every == 0 and done < tc.max_steps:
            _save(accelerator, run_dir, drafter, optimizer, scheduler, done, meta, tc.keep_checkpoints)
    bar.close()
    train_seconds = time.time() - t_start

    # ---- final checkpoint + drafter ----
    if tc.max_steps > start_step or resume_from is None:
        _save(accelerator, run_dir, drafter, optimizer, scheduler, tc.max_steps, meta, tc.keep_checkpoints)
    final_dir = run_dir / "final"
    if main:
        accelerator.unwrap_model(wrapped).save_pretrained(final_dir)
        tail = history[-min(len(history), 10):]
        train_metrics = {k: sum(h[k] for h in tail) / len(tail) for k in tail[0]} if tail else {}
        write_json(run_dir / "train_metrics.json", {"history": history, "train_seconds": train_seconds})
        say(f"saved drafter to {final_dir} ({train_seconds:.0f}s of training)")
    accelerator.wait_for_everyone()

    report = None
    if tc.eval and main:
        from ..eval import evaluate_drafter

        est = method.estimated_tau(train_metrics, job.decode.num_draft_tokens) if train_metrics else None
        report = evaluate_drafter(
            model, tokenizer, accelerator.unwrap_model(wrapped), job.decode, eval_convs, run_dir,
            target_name=tname, drafter_name=str(final_dir), train_estimated_tau=est,
        )
        if log_with:
            accelerator.log({f"eval/{k}": v for k, v in report.items() if isinstance(v, (int, float))},
                            step=tc.max_steps)
            png = run_dir / "acceptance.png"
            if png.exists():
                log_image(accelerator, "eval/acceptance_per_position", png, tc.max_steps)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return report


def _save(accelerator, run_dir, drafter, optimizer, scheduler, step, meta, keep) -> None:
    if accelerator.is_main_process:
        path = checkpoint.checkpoint_dir(run_dir, step)
        checkpoint.save_checkpoint(path, drafter, optimizer.optimizer if hasattr(optimizer, "optimizer")
                                   else optimizer, scheduler, step, meta)
        checkpoint.prune_checkpoints(run_dir, keep)
    accelerator.wait_for_everyone()
