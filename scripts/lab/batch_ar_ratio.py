"""Issue 17's bar, AR only: batched B=16 against the batch-1 decoder (the path decode.batch_size=1 runs), 128
held-out prompts of the built-in target, up to 64 new tokens, greedy, 2 threads, passes interleaved.

    DRAFTTRAIN_CACHE=/tmp/dtcache REPS=4 OUT=bench/results/batch_ar_ratio_grouped_sdpa.json \
        python scripts/lab/batch_ar_ratio.py
"""
import os, time, statistics, json, torch
from drafttrain.config import EvalJob
from drafttrain.targets.load import load_target, target_id
from drafttrain.data.select import eval_conversations, eval_prompt_ids
from drafttrain.decoding.target import TargetRunner
from drafttrain.decoding.engine import SpecDecoder
from drafttrain.decoding.batched import BatchSpecDecoder
from drafttrain.decoding.proposers import NoDraft
from drafttrain.data.chat import stop_token_ids
torch.set_num_threads(2)
job = EvalJob(); job.data.num_eval = 128
model, tok, path = load_target(job.target)
print("attention", model.config._attn_implementation)
prompts = eval_prompt_ids(tok, eval_conversations(job.data, target_id(path)), 128)
eos = stop_token_ids(model, tok)
ml = max(map(len, prompts)) + 80
b1 = SpecDecoder(TargetRunner(model, max_len=ml), NoDraft(), 0)
bb = BatchSpecDecoder(TargetRunner(model, max_len=ml), NoDraft(), 0)
bb.generate(prompts[:16], 16, eos, batch_size=16)
res = {"b1": [], "b16": [], "b16_rows_per_round": []}
for rep in range(int(os.environ.get("REPS", "3"))):
    t0 = time.perf_counter(); n = sum(len(b1.generate(p, 64, eos, seed=0).tokens) for p in prompts)
    res["b1"].append(n / (time.perf_counter() - t0))
    r = bb.generate(prompts, 64, eos, seed=0, batch_size=16)
    res["b16"].append(sum(len(x.tokens) for x in r.results) / r.time_total)
    res["b16_rows_per_round"].append(r.row_rounds / r.rounds)
    a, b = res["b1"][-1], res["b16"][-1]
    print(rep, "batch-1 decoder %.1f tok/s  B=16 %.1f tok/s  ratio %.2f" % (a, b, b / a), flush=True)
res["ratio_per_pass"] = [b / a for a, b in zip(res["b1"], res["b16"])]
print("ratio per pass", [round(x, 2) for x in res["ratio_per_pass"]],
      "median", round(statistics.median(res["ratio_per_pass"]), 2))
json.dump(res, open(os.environ.get("OUT", "batch_ar_ratio.json"), "w"), indent=1)
