#!/usr/bin/env python
"""Where one training step's CPU time goes: target forward + teacher (capture), the drafter's forward (TTT
attention, head, loss) and the backward, on real micro-batches of a target's training data.

    DRAFTTRAIN_CACHE=/tmp/dtcache python scripts/lab/profile_train_step.py --steps 6 --out bench/results/profile_eagle3.json
    python scripts/lab/profile_train_step.py target=<dir> data=<chats.jsonl>         # any target / data

Runs the method exactly as the training loop does (same batches for step s, packed or not by
train.packing), one thread; reports the mean seconds per micro-batch of each phase over --steps steps
(after one warm-up step) and the ten costliest operators of the whole step (torch.profiler, self CPU time).
Hydra overrides after the options select the target, data and method settings (as for train.py).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)

    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from drafttrain.cli import CONF_DIR, expand_shorthands
    from drafttrain.data.chat import collate
    from drafttrain.data.packing import collate_packed
    from drafttrain.data.select import load_training_data
    from drafttrain.targets.load import load_target, target_id
    from drafttrain.training import batching
    from drafttrain.training.method import make_method

    torch.set_num_threads(1)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("train", overrides=["recipe=eagle3", *expand_shorthands(a.overrides)])
    job = OmegaConf.to_object(cfg)
    model, tok, path = load_target(job.target, device=torch.device("cpu"))
    name = target_id(path)
    examples, _, _ = load_training_data(job, model, tok, name, Path("/tmp"))
    method = make_method(job, tok, model)
    drafter = method.build_drafter(model, examples, name)
    tc = job.train
    plan = batching.make_plan(tc.batch_size, tc.micro_batch_size, 1)
    phases = {"capture": 0.0, "count": 0.0, "forward+loss": 0.0, "backward": 0.0}
    cells = real = n_mb = 0

    def step(s: int, timed: bool) -> None:
        nonlocal cells, real, n_mb
        for idx in batching.micro_batches(len(examples), plan, s, tc.seed, 0):
            rows = [examples[i] for i in idx]
            mb = collate_packed(rows, tok.pad_token_id, job.data.max_length) if tc.packing else \
                collate(rows, tok.pad_token_id)
            t0 = time.process_time()
            cap = method.capture(model, mb)
            t1 = time.process_time()
            counts = method.count_valid(drafter, mb, cap)
            t2 = time.process_time()
            loss, _ = method.loss(drafter, drafter, mb, cap, counts, 1.0)
            t3 = time.process_time()
            loss.backward()
            t4 = time.process_time()
            drafter.zero_grad(set_to_none=True)
            if timed:
                for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    phases[k] += dt
                cells += mb["attention_mask"].numel()
                real += int(mb["attention_mask"].sum())
                n_mb += 1

    step(0, False)
    for s in range(1, a.steps + 1):
        step(s, True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(a.steps + 1, False)
    ops = [{"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "calls": e.count}
           for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]]
    per_step = {k: v / a.steps for k, v in phases.items()}
    res = {"target": name, "packing": tc.packing, "micro_batches_per_step": n_mb / a.steps,
           "cells_per_real_token": cells / max(1, real), "cpu_s_per_step": per_step,
           "cpu_s_per_step_total": sum(per_step.values()), "top_ops_one_step": ops,
           "overrides": a.overrides}
    total = res["cpu_s_per_step_total"]
    print(f"{name}: {total:.3f} CPU-s per optimizer step ({res['cells_per_real_token']:.2f} cells per real token)")
    for k, v in per_step.items():
        print(f"  {k:14s} {v:.3f} s  ({v / total:.0%})")
    for o in ops:
        print(f"  {o['op']:40s} {o['self_cpu_s']:.3f} s  x{o['calls']}")
    if a.out:
        from drafttrain.io import write_json  # atomic; makes the parent directory

        write_json(a.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
