#!/usr/bin/env python
"""Sampling acceptance of an EAGLE-3 export, drafttrain against vLLM (the engine venv), issue 15's open comparison.

    DRAFTTRAIN_CACHE=/tmp/dtcache python scripts/vllm_sampling_probe.py <target dir> <saved eagle3 drafter> \
        [--out bench/results/vllm_sampling_probe.json]

8 built-in held-out prompts x 3 samples, 48 new tokens, K = 4, argmax drafts (vLLM's default), T = 0.7 and
greedy: the first draft position's acceptance rate both ways, how many distinct samples vLLM gave per prompt
and how many samples equal the greedy output (so a "sampling" run that is really greedy shows).
"""
import json
import sys

import torch
torch.set_num_threads(1)

from drafttrain.engines.vllm_check import load_pair, serving_spec, run_driver, ours, first_position_rates
from drafttrain.data.builtin import builtin_conversations
from drafttrain.data.select import eval_prompt_ids
from drafttrain.data.chat import stop_token_ids
T, D = sys.argv[1], sys.argv[2]
OUT = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
model, tok, drafter, method, _ = load_pair(D, T)
prompts = eval_prompt_ids(tok, builtin_conversations("eval", 8, 0), 0)
S = 3
ps = prompts * S
import tempfile

spec = serving_spec(D, T, tempfile.mkdtemp(prefix="vllm-probe-"), 4, model=model, tokenizer=tok)
base = {**spec, "prompts": ps, "max_tokens": 48, "stop_token_ids": stop_token_ids(model, tok)}
greedy = run_driver({**base, "temperature": 0.0, "prompts": prompts})
got = run_driver({**base, "temperature": 0.7})
mine = ours(model, tok, drafter, method, ps, 4, 48, temperature=0.7, draft_temperature=0.0)
mine_g = ours(model, tok, drafter, method, prompts, 4, 48)
r = first_position_rates(mine, got["results"])
rg = first_position_rates(mine_g, greedy["results"])
vs = [x["samples"][0] for x in got["results"]]
gs = [x["samples"][0] for x in greedy["results"]]
distinct = sum(len({tuple(vs[i + k * len(prompts)]) for k in range(S)}) for i in range(len(prompts)))
eq_greedy = sum(vs[i] == gs[i % len(prompts)] for i in range(len(vs)))
ours_eq_greedy = sum(m["spec"] == mine_g[i % len(prompts)]["ar"] for i, m in enumerate(mine))
res = {"target": T, "drafter": D, "temperature": 0.7, "K": 4, "prompts": len(prompts), "samples": S,
       "vllm": got.get("vllm"), "sampled_first_position": r, "greedy_first_position": rg,
       "vllm_distinct_samples_per_prompt": distinct / len(prompts),
       "vllm_samples_equal_greedy": f"{eq_greedy}/{len(vs)}", "ours_samples_equal_greedy": f"{ours_eq_greedy}/{len(mine)}"}
print(json.dumps(res, indent=1))
if OUT:
    from drafttrain.io import write_json

    write_json(OUT, res)
