#!/usr/bin/env python
"""Check a drafter's export against a real vLLM on a laptop (CPU): exports it, serves it with vLLM's offline
``LLM`` in the engine venv (scripts/make_engine_venv.sh) and decodes the same prompt ids with drafttrain.

    python scripts/check_engine.py drafter=runs/<run>/final engine=vllm [target=<dir>] [num_draft_tokens=3]
        [max_new_tokens=32] [num_prompts=4] [prompts=<chats.jsonl>] [dtype=float32|bfloat16] [out=<report.json>]

``drafter``: a saved drafter (EAGLE-3, Medusa-1/-2, draft model) or an EAGLE-3 export; ``target``: default the
target the drafter records. Prompts: the built-in held-out chats, or a JSONL file of chats (their last
assistant turn dropped). Prints one row: loads, outputs equal (vLLM greedy == drafttrain AR, token for token),
acceptance equal (per prompt: vLLM's drafts == our rounds, its accepted == ours; on a prompt that ends by
length vLLM may count more, shown as +n), τ ours vs vLLM. Exit status 1 when a check fails.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KEYS = {"drafter": None, "engine": "vllm", "target": None, "num_draft_tokens": "3", "max_new_tokens": "32",
        "num_prompts": "4", "prompts": None, "dtype": "float32", "out": None}


def parse(argv: list[str]) -> dict:
    from drafttrain.io import DraftTrainError

    args = dict(KEYS)
    for a in argv:
        k, eq, v = a.partition("=")
        if not eq or k not in KEYS:
            raise DraftTrainError(f"{a}: expected key=value with key one of {', '.join(KEYS)}")
        args[k] = v
    if not args["drafter"]:
        raise DraftTrainError("drafter=<dir> is required (a saved drafter or an EAGLE-3 export)")
    if args["engine"] != "vllm":
        raise DraftTrainError(f"engine={args['engine']}: only vllm runs on CPU (TensorRT-LLM needs an NVIDIA driver)")
    for k in ("num_draft_tokens", "max_new_tokens", "num_prompts"):
        if not args[k].isdigit() or int(args[k]) < 1:
            raise DraftTrainError(f"{k}={args[k]}: expected an integer >= 1")
    if args["dtype"] not in ("float32", "bfloat16"):
        raise DraftTrainError(f"dtype={args['dtype']}: expected float32 or bfloat16")
    return args


def prompts_of(args: dict, tok) -> list[list[int]]:
    from drafttrain.data.select import eval_prompt_ids

    n = int(args["num_prompts"])
    if args["prompts"]:
        from drafttrain.data.chat import read_conversations

        convs = [c.messages[:-1] if c.messages and c.messages[-1]["role"] == "assistant" else c.messages
                 for c in read_conversations(args["prompts"], prompts_only=True)]
        return eval_prompt_ids(tok, convs, n)
    from drafttrain.data.builtin import builtin_conversations

    return eval_prompt_ids(tok, builtin_conversations("eval", n, 0), 0)


def check(args: dict) -> dict:
    from drafttrain.artifacts import recorded_target
    from drafttrain.data.chat import stop_token_ids
    from drafttrain.engines.vllm_check import compare, load_pair, ours, run_driver, serving_spec, summary
    from drafttrain.io import DraftTrainError

    target = args["target"] or recorded_target(args["drafter"])
    if not target:
        raise DraftTrainError(f"drafter={args['drafter']} records no target: pass target=<dir>")
    K, N = int(args["num_draft_tokens"]), int(args["max_new_tokens"])
    model, tok, drafter, method, kind = load_pair(args["drafter"], target)
    prompts = prompts_of(args, tok)
    with tempfile.TemporaryDirectory(prefix="drafttrain-check-") as work:
        spec = serving_spec(args["drafter"], target, work, K, model=model, tokenizer=tok, dtype=args["dtype"])
        if args["dtype"] != "float32" and kind in ("eagle3",):  # we decode the rounded weights vLLM serves
            model, tok, drafter, method, _ = load_pair(spec["speculative_config"]["model"], target)
        mine = ours(model, tok, drafter, method, prompts, K, N)
        try:
            got = run_driver({**spec, "prompts": prompts, "max_tokens": N, "stop_token_ids": stop_token_ids(model, tok)})
        except DraftTrainError as e:
            return {"drafter": args["drafter"], "kind": kind, "loads": False, "error": str(e).splitlines()[0]}
    rows = compare(mine, got["results"], N)
    return {"drafter": args["drafter"], "kind": kind, "loads": True, "vllm": got["vllm"], **summary(rows), "rows": rows}


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_table(r: dict) -> None:
    print(f"{'drafter':<40} {'kind':<12} {'loads':<6} {'outputs equal':<14} {'acceptance equal':<17} "
          f"{'tau ours':>9} {'tau vLLM':>9}")
    if not r["loads"]:
        print(f"{r['drafter'][-40:]:<40} {r['kind']:<12} {'no':<6}  {r['error']}")
        return
    acc = ("yes" if r["acceptance_equal"] else "NO") + (f" (+{r['length_extra']} at length)" if r["length_extra"] else "")
    print(f"{r['drafter'][-40:]:<40} {r['kind']:<12} {'yes':<6} {'yes' if r['outputs_equal'] else 'NO':<14} "
          f"{acc:<17} {_f(r['tau']):>9} {_f(r['vllm_tau']):>9}")


def main(argv: list[str]) -> int:
    from drafttrain.io import DraftTrainError

    try:
        args = parse(argv)
        r = check(args)
    except DraftTrainError as e:
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    print_table(r)
    if args["out"]:
        from drafttrain.io import write_json

        write_json(Path(args["out"]), r)
    return 0 if r["loads"] and r["outputs_equal"] and r["acceptance_equal"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
