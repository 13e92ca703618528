#!/usr/bin/env python
"""τ per drafter family with and without a grammar, on the built-in structured (function-call JSON) eval set.

For each method the same prompts are decoded twice, greedy: *without* a grammar (the target answers freely)
and *with* each row's JSON schema (xgrammar masks the target and the drafts). Within each mode the
speculative output must equal the AR output of the same mode token for token, and every constrained output
must validate against its schema. Writes the markdown table into ``--out`` (between the ``<!-- table -->``
markers of an existing file, else a new file) and the raw numbers to ``--json``.

    DRAFTTRAIN_CACHE=/tmp/dtcache python scripts/lab/structured_compare.py \\
        --eagle3 runs/s7-eagle3/final --medusa runs/s7-medusa/final --out bench/notebook/structured.md

Structured training data for a drafter (the target's own constrained answers on the ``draft`` split, which
the eval split never overlaps) is written with ``--write-train-data rows.jsonl --train-rows N`` (and nothing
else is run); mix it with chat data and train with ``data=jsonl data.path=…``.

Methods without a drafter (pld, oracle) always run; eagle3 / medusa (chain and tree) and draft_model run when
given. Speedups are measured against the AR run of the same mode, timed before and after the methods (the
faster of the two counts: on a shared machine the load changes), one after the other on the same machine.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from drafttrain.config import DecodeConfig, TargetConfig, TreeConfig  # noqa: E402
from drafttrain.data.chat import stop_token_ids  # noqa: E402
from drafttrain.decoding import NoDraft, SpecDecoder, TargetRunner, aggregate  # noqa: E402
from drafttrain.decoding.build import cache_length  # noqa: E402
from drafttrain.io import write_json, write_text  # noqa: E402
from drafttrain.structured import builtin_structured_examples, grammar_plan  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eagle3", help="a saved EAGLE-3 drafter directory (runs/<run>/final)")
    ap.add_argument("--eagle3-extra", action="append", default=[], metavar="LABEL=DIR",
                    help="another EAGLE-3 drafter, shown as 'eagle3 (LABEL)' (repeatable)")
    ap.add_argument("--medusa", help="a saved Medusa drafter directory")
    ap.add_argument("--draft-model", help="a causal-LM directory sharing the target's tokenizer "
                                          "(e.g. a distilled draft, recipe=draft_model)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256, help="enough for every constrained output to end")
    ap.add_argument("--max-string-length", type=int, default=16, help="maxLength of string arguments")
    ap.add_argument("-K", "--num-draft-tokens", type=int, default=4)
    ap.add_argument("--tree-depth", type=int, default=5)
    ap.add_argument("--tree-top-k", type=int, default=4)
    ap.add_argument("--tree-nodes", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "bench" / "notebook" / "structured.md"))
    ap.add_argument("--json", default=str(REPO / "runs" / "structured_compare.json"))
    ap.add_argument("--write-train-data", help="write structured training rows (draft split) here and exit")
    ap.add_argument("--train-rows", type=int, default=128)
    ap.add_argument("--render-only", action="store_true", help="rewrite the table in --out from --json, run nothing")
    return ap.parse_args(argv)


def load(args):
    from drafttrain.targets.load import load_target, num_layers, target_id

    model, tok, path = load_target(TargetConfig())
    L = num_layers(model)
    methods = [("pld", None, "pld"), ("oracle", None, "oracle")]  # (method, kind, drafter key / label)
    drafters = {}
    eagle3 = ([("eagle3", args.eagle3)] if args.eagle3 else []) + [
        (f"eagle3 ({x.partition('=')[0]})", x.partition("=")[2]) for x in args.eagle3_extra]
    for key, ddir in eagle3:
        from drafttrain.artifacts import load_drafter

        drafters[key] = load_drafter(ddir, "cpu").eval()
        methods += [("eagle3", "chain", key), ("eagle3", "tree", key)]
    if args.medusa:
        from drafttrain.artifacts import load_medusa

        model_m, heads, info = load_medusa(args.medusa, model, "cpu")
        if info["target_modified"]:
            raise SystemExit("--medusa: a Medusa-2 drafter changes the target; compare Medusa-1 heads here")
        drafters["medusa"] = heads
        methods += [("medusa", "chain", "medusa"), ("medusa", "tree", "medusa")]
    if args.draft_model:
        from transformers import AutoModelForCausalLM

        drafters["draft_model"] = AutoModelForCausalLM.from_pretrained(args.draft_model).eval()
        methods += [("draft_model", "chain", "draft_model")]
    return model, tok, target_id(path), L, drafters, methods


def make(name, kind, key, drafters, args, max_len, L, V):
    """(proposer, K, target taps) of a method (``key``: its drafter in ``drafters``)."""
    from drafttrain.decoding.build import draft_depth, make_proposer, target_taps

    tree = TreeConfig(enabled=kind == "tree", depth=args.tree_depth, top_k=args.tree_top_k,
                      total_tokens=args.tree_nodes)
    decode = DecodeConfig(method=name, num_draft_tokens=args.num_draft_tokens, tree=tree)
    prop = make_proposer(name, drafter=drafters.get(key), decode=decode, max_len=max_len)
    if name == "pld":
        prop.num_tokens = args.num_draft_tokens
    if hasattr(prop, "agree_fn"):
        prop.vocab_size = V
    K = draft_depth(prop, decode)
    if name == "medusa":
        K = min(K, drafters["medusa"].num_heads)
    taps = target_taps(name, drafters.get(key)) if name != "medusa" else (L,)
    return prop, K, taps


def run_mode(model, tok, prompts, compiled, methods, drafters, args, L, eos, plan):
    """Decode every prompt with AR and with each method under ``compiled`` (per-prompt grammars or Nones)."""
    max_len = cache_length(prompts, args.max_new_tokens, max(args.num_draft_tokens, args.tree_nodes))
    V = model.config.vocab_size

    def state(i):
        return None if compiled[i] is None else compiled[i].state()

    ar = SpecDecoder(TargetRunner(model, max_len=max_len), NoDraft(), 0)
    ar.generate(prompts[0], 16, eos, grammar=state(0))  # warm-up
    ar_res = [ar.generate(p, args.max_new_tokens, eos, grammar=state(i)) for i, p in enumerate(prompts)]
    A = aggregate(ar_res)
    rows = [{"method": "ar", "shape": "-", "tau": A["tau"], "alpha": None, "tokens_per_s": A["tokens_per_s"],
             "speedup": None, "match_ar": True, "new_tokens": A["num_new_tokens"],
             "valid_fraction": plan.validate(tok, [r.tokens for r in ar_res], eos)["valid_fraction"],
             "frac_grammar": A["frac_grammar"]}]
    print(f"  ar: {A['num_new_tokens']} tokens, {A['tokens_per_s']:.1f} tok/s", flush=True)
    for name, kind, key in methods:
        prop, K, taps = make(name, kind, key, drafters, args, max_len, L, V)
        dec = SpecDecoder(TargetRunner(model, taps=taps, max_len=max_len), prop, K)
        res = []
        for i, p in enumerate(prompts):
            if name == "oracle":
                prop.set_reference(ar_res[i].tokens)
            res.append(dec.generate(p, args.max_new_tokens, eos, grammar=state(i)))
        S = aggregate(res)
        shape = (f"tree d{K}, {S['nodes_per_round']:.1f} nodes" if getattr(prop, "tree", False) else f"chain K={K}")
        row = {"method": key if name in ("pld", "oracle") else f"{key} {kind}", "shape": shape, "tau": S["tau"],
               "alpha": S["alpha"], "tokens_per_s": S["tokens_per_s"],
               "speedup": None, "new_tokens": S["num_new_tokens"],
               "match_ar": all(r.tokens == a.tokens for r, a in zip(res, ar_res)),
               "valid_fraction": plan.validate(tok, [r.tokens for r in res], eos)["valid_fraction"],
               "frac_grammar": S["frac_grammar"]}
        rows.append(row)
        print(f"  {row['method']}: tau {row['tau']:.2f}, {row['tokens_per_s']:.1f} tok/s, match {row['match_ar']}, "
              f"valid {row['valid_fraction']}", flush=True)
    again = aggregate([ar.generate(p, args.max_new_tokens, eos, grammar=state(i)) for i, p in enumerate(prompts)])
    base = max(A["tokens_per_s"], again["tokens_per_s"])
    print(f"  ar again: {again['tokens_per_s']:.1f} tok/s; baseline {base:.1f} tok/s", flush=True)
    rows[0]["tokens_per_s_runs"] = [A["tokens_per_s"], again["tokens_per_s"]]
    rows[0]["tokens_per_s"] = base
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / base
    return rows


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def table(result) -> str:
    free, gram = ({r["method"]: r for r in result["modes"][m]} for m in ("none", "schema"))
    lines = ["| method | draft shape | τ no grammar | τ schema | Δτ | α no grammar | α schema | speedup no grammar "
             "| speedup schema | valid outputs no grammar / schema | greedy = AR (both modes) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for name, g in gram.items():
        f = free[name]
        d = g["tau"] - f["tau"] if g["tau"] is not None and f["tau"] is not None else None
        shape = g["shape"] if g["shape"] == f["shape"] else f"{f['shape']} / {g['shape'].split(', ')[-1]}"
        lines.append(f"| {name} | {shape} | {fmt(f['tau'])} | {fmt(g['tau'])} | {fmt(d, '+.2f')} | "
                     f"{fmt(f['alpha'])} | {fmt(g['alpha'])} | {fmt(f['speedup'])}x | {fmt(g['speedup'])}x | "
                     f"{fmt(f['valid_fraction'], '.0%')} / {fmt(g['valid_fraction'], '.0%')} | "
                     f"{'yes' if f['match_ar'] and g['match_ar'] else 'NO'} |")
    return "\n".join(lines)


BEGIN, END = "<!-- table:begin (scripts/lab/structured_compare.py) -->", "<!-- table:end -->"


def with_table(path: Path, md: str, result: dict) -> str:
    """The file's text with the table (and the command and run facts under it) between the markers."""
    block = (f"{BEGIN}\n{md}\n\n`{result['command']}` -- {result['prompts']} prompts, target {result['target']}, "
             f"{result['threads']} thread(s), {result['seconds']:.0f} s; AR baseline "
             f"{result['modes']['none'][0]['tokens_per_s']:.1f} tok/s without a grammar, "
             f"{result['modes']['schema'][0]['tokens_per_s']:.1f} tok/s with; every constrained output valid: "
             f"{result['all_constrained_outputs_valid']}; every output == AR of its mode: "
             f"{result['all_outputs_match_ar']}\n{END}")
    old = path.read_text(encoding="utf-8") if path.exists() else f"# Structured output\n\n{BEGIN}\n{END}\n"
    if BEGIN not in old or END not in old:
        return old.rstrip("\n") + "\n\n" + block + "\n"
    return old[: old.index(BEGIN)] + block + old[old.index(END) + len(END):]


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    if args.render_only:
        result = json.loads(Path(args.json).read_text(encoding="utf-8"))
        write_text(args.out, with_table(Path(args.out), table(result), result))
        return 0
    if args.write_train_data:
        from drafttrain.structured import answer_with_target, write_structured_jsonl
        from drafttrain.targets.load import load_target

        model, tok, _ = load_target(TargetConfig())
        ex = builtin_structured_examples("draft", args.train_rows, args.seed, max_string_length=args.max_string_length)
        rows = answer_with_target(model, tok, ex, max_new_tokens=args.max_new_tokens)
        write_structured_jsonl(args.write_train_data, rows)
        print(f"[structured_compare] {len(rows)}/{len(ex)} rows -> {args.write_train_data} ({time.time() - t0:.0f} s)")
        return 0
    model, tok, tname, L, drafters, methods = load(args)
    eos = sorted(stop_token_ids(model, tok))
    examples = builtin_structured_examples("eval", args.num_prompts, args.seed,
                                           max_string_length=args.max_string_length)
    prompts = [e.prompt_ids(tok) for e in examples]
    V = model.config.vocab_size
    result = {"target": tname, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "max_string_length": args.max_string_length, "num_draft_tokens": args.num_draft_tokens,
              "tree": {"depth": args.tree_depth, "top_k": args.tree_top_k, "total_tokens": args.tree_nodes},
              "drafters": {"eagle3": args.eagle3, "eagle3_extra": args.eagle3_extra, "medusa": args.medusa,
                           "draft_model": args.draft_model},
              "threads": args.threads, "command": "python scripts/lab/structured_compare.py " + shlex.join(
                  sys.argv[1:] if argv is None else argv), "modes": {}}
    for mode, grammar in (("none", "none"), ("schema", None)):
        plan = grammar_plan(grammar, examples, len(prompts))  # none: unconstrained, still validated per row
        compiled = plan.compile(tok, V, eos)
        print(f"[structured_compare] mode {mode} ({plan.label or 'unconstrained'})", flush=True)
        result["modes"][mode] = run_mode(model, tok, prompts, compiled, methods, drafters, args, L, eos, plan)
    result["seconds"] = time.time() - t0
    gram = result["modes"]["schema"]
    result["all_constrained_outputs_valid"] = all(r["valid_fraction"] == 1.0 for r in gram)
    result["all_outputs_match_ar"] = all(r["match_ar"] for m in result["modes"].values() for r in m)
    md = table(result)
    print(md)
    write_json(args.json, result)
    write_text(args.out, with_table(Path(args.out), md, result))
    print(f"[structured_compare] {result['seconds']:.0f} s; every constrained output valid: "
          f"{result['all_constrained_outputs_valid']}; every output == AR: {result['all_outputs_match_ar']}")
    return 0 if result["all_constrained_outputs_valid"] and result["all_outputs_match_ar"] else 1


if __name__ == "__main__":
    sys.exit(main())
