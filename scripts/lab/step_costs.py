#!/usr/bin/env python
"""Per-forward costs that decide whether speculation can pay on this machine.

    python scripts/lab/step_costs.py                       # built-in target + builtin-small draft, CPU, 1 thread
    python scripts/lab/step_costs.py --compile --threads 1 --context 100

For the target and the draft model, each behind our TargetRunner (static KV cache; with ``--compile`` static
shapes + torch.compile, as ``drafttrain bench decode.static_shapes=true decode.compile=true``), it times a 1-token decode
step and a 4-position verify forward after a ``--context``-token prefill (warm-up first, best of 3 repeats),
and for the draft model a whole greedy draft chain (``TargetRunner.greedy_chain``: catch up on 2 committed
tokens, then K - 1 steps; one graph when compiled). A K-draft round costs about verify(K+1) + chain(K) and
returns tau tokens: speculation beats plain decoding only when tau / (verify + chain) > 1 / step.
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--compile", action="store_true", help="static shapes + torch.compile (buckets 1, 4, 16)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--k", type=int, default=3, help="draft tokens per round for the draft chain timing")
    ap.add_argument("--draft", default="builtin-small", help="draft model: builtin-small or a causal-LM directory")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from drafttrain.artifacts import load_draft_model
    from drafttrain.config import TargetConfig
    from drafttrain.decoding import TargetRunner
    from drafttrain.targets.load import load_target

    cfg = TargetConfig()
    target, _, _ = load_target(cfg)
    draft, _, _ = load_draft_model(args.draft, cfg, target.device)
    ctx = list(range(5, 5 + args.context))
    for name, model in (("target", target), ("draft", draft)):
        runner = TargetRunner(model, taps=None, max_len=args.context + args.steps + 32, timing=False,
                              static_shapes=args.compile, compile=args.compile, buckets=(1, 4, 16))

        def timed(n_new: int, reps: int) -> float:
            runner.reset()
            runner.forward(ctx, last_only=True)
            for _ in range(3):  # warm-up (compiles this bucket)
                runner.forward([7] * n_new)
                runner.truncate(runner.length - n_new)
            t = time.perf_counter()
            for _ in range(reps):
                runner.forward([7] * n_new)
                if n_new > 1:
                    runner.truncate(runner.length - n_new + 1)
            return (time.perf_counter() - t) / reps * 1e3

        def chain(k: int, reps: int) -> float:
            """A draft model's round: catch up on 2 committed tokens, then k - 1 greedy steps (greedy_chain)."""
            runner.reset()
            runner.forward(ctx, last_only=True)
            for _ in range(3):
                runner.greedy_chain([7, 8], k)
                runner.truncate(len(ctx))
            t = time.perf_counter()
            for _ in range(reps):
                runner.greedy_chain([7, 8], k)
                runner.truncate(len(ctx))
            return (time.perf_counter() - t) / reps * 1e3

        step = min(timed(1, args.steps) for _ in range(3))
        verify = min(timed(4, args.steps // 3) for _ in range(3))
        msg = f"1-token step {step:.2f} ms, 4-position verify {verify:.2f} ms"
        if name == "draft":
            msg += f", K={args.k} draft chain {min(chain(args.k, args.steps // 3) for _ in range(3)):.2f} ms"
        print(f"{name:6s} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
              f"{'compiled' if args.compile else 'eager'}): {msg}", flush=True)


if __name__ == "__main__":
    main()
