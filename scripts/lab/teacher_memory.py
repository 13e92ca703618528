#!/usr/bin/env python
"""Peak memory of one EAGLE-3 training step with a large vocabulary: compact teacher against full logits.

    python scripts/lab/teacher_memory.py --vocab 128256 --batch 2 --seq 512 --out bench/results/teacher_memory.json

A tiny random Llama target with a V-token vocabulary (the memory of interest is the [B, T, V] teacher);
each arm runs in its own process (one thread; arms: full logits, compact teacher, + eagle3.checkpoint_head,
+ eagle3.recompute_teacher): capture (target forward + teacher), the TTT loss and the
backward of one micro-batch. Reported: the step's peak resident memory above the process's level before
it (sampled every millisecond), for the capture alone and for the whole step, and the loss (the arms must
agree to 1e-5 relative). Each arm runs with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then maps every large
block and unmaps it on free, so resident memory follows live tensors instead of the heap's high-water mark.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARMS = ("full", "compact", "compact+checkpoint_head", "compact+checkpoint_head+recompute_teacher")


def _current_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakSampler:
    """The highest resident memory seen while active (sampled every millisecond by a thread): unlike
    ``ru_maxrss``, not masked by a peak the process reached before (e.g. while building the model)."""

    def __enter__(self):
        import threading

        self.peak, self._stop = _current_mb(), False

        def loop():
            while not self._stop:
                self.peak = max(self.peak, _current_mb())
                time.sleep(0.001)

        self._t = threading.Thread(target=loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop = True
        self._t.join()
        self.peak = max(self.peak, _current_mb())


def arm(compact: bool, vocab: int, batch: int, seq: int, ttt: int, draft_vocab: int, ckpt: bool,
        recompute: bool = False) -> dict:
    import torch
    import transformers as tf

    sys.path.insert(0, str(REPO))
    from drafttrain.config import Eagle3Config
    from drafttrain.data.chat import collate
    from drafttrain.training.eagle3 import Eagle3Method

    torch.set_num_threads(1)
    torch.manual_seed(0)
    target = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, eos_token_id=2)).eval().requires_grad_(False)

    class Tok:
        eos_token_id, pad_token_id = 2, 0

    g = torch.Generator().manual_seed(1)
    examples = [{"input_ids": torch.randint(3, vocab, (seq,), generator=g).tolist(), "loss_mask": [0] * 8 + [1] * (seq - 8)}
                for _ in range(batch)]
    cfg = Eagle3Config(ttt_steps=ttt, compact_teacher=compact, draft_vocab_size=draft_vocab, checkpoint_head=ckpt,
                       recompute_teacher=recompute)
    m = Eagle3Method(cfg, Tok(), target)
    d = m.build_drafter(target, examples, "random-128k")
    b = collate(examples, 0)
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed set-up memory back, so the base is what is live
    base = _current_mb()
    with PeakSampler() as cap_peak:
        cap = m.capture(target, b)
    with PeakSampler() as step_peak:
        counts = m.count_valid(d, b, cap)
        loss, _ = m.loss(d, d, b, cap, counts, 1.0)
        loss.backward()
    return {"compact_teacher": compact, "checkpoint_head": ckpt, "recompute_teacher": recompute,
            "loss": float(loss.detach()), "base_mb": base,
            "capture_peak_above_base_mb": cap_peak.peak - base,
            "step_peak_above_base_mb": max(cap_peak.peak, step_peak.peak) - base}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.arm:
        print(json.dumps(arm(a.arm != "full", a.vocab, a.batch, a.seq, a.ttt, a.draft_vocab,
                             "checkpoint_head" in a.arm, "recompute_teacher" in a.arm)))
        return 0
    res = {}
    for name in ARMS:
        out = subprocess.run([sys.executable, __file__, "--arm", name, "--vocab", str(a.vocab), "--batch",
                              str(a.batch), "--seq", str(a.seq), "--ttt", str(a.ttt), "--draft-vocab",
                              str(a.draft_vocab)], check=True, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}).stdout
        res[name] = json.loads(out.strip().splitlines()[-1])
        print(name, res[name], flush=True)
    f, c, k, r = (res[n] for n in ARMS)
    summary = {"settings": vars(a) | {"out": str(a.out)}, **res,
               "capture_ratio": f["capture_peak_above_base_mb"] / max(c["capture_peak_above_base_mb"], 1e-9),
               "step_ratio": f["step_peak_above_base_mb"] / max(c["step_peak_above_base_mb"], 1e-9),
               "step_ratio_with_checkpoint_head": f["step_peak_above_base_mb"] / max(k["step_peak_above_base_mb"], 1e-9),
               "step_ratio_with_recompute_teacher": f["step_peak_above_base_mb"] / max(r["step_peak_above_base_mb"], 1e-9),
               "loss_rel_diff": max(abs(f["loss"] - x["loss"]) / abs(f["loss"]) for x in (c, k, r))}
    summary["settings"].pop("arm", None)
    print(f"peak memory full/compact: capture {summary['capture_ratio']:.2f}x, whole step {summary['step_ratio']:.2f}x, "
          f"whole step with checkpoint_head {summary['step_ratio_with_checkpoint_head']:.2f}x, with checkpoint_head "
          f"and recompute_teacher {summary['step_ratio_with_recompute_teacher']:.2f}x; loss relative "
          f"difference {summary['loss_rel_diff']:.1e}", flush=True)
    if a.out:
        from drafttrain.io import write_json  # atomic; makes the parent directory

        write_json(a.out, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
