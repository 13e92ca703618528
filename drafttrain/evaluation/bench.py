"""``drafttrain bench`` and ``drafttrain tune``: our speculative decoder against Hugging Face generation, and
choosing the draft length / tree size from measured acceptance and costs.

bench: on one target, drafter and prompt set, greedy, batch 1, after ``decode.warmup`` untimed passes,
``decode.repeats`` timed passes over the prompts (ours and HF interleaved per pass), medians of tokens/s:

    ours ar            vs  HF model.generate()
    ours draft_model   vs  HF generate(assistant_model=...)          (HF's default assistant schedule)
    ours pld           vs  HF generate(prompt_lookup_num_tokens=...)
    ours pld tree      vs  HF generate(prompt_lookup_num_tokens=...)  (several matches verified as one tree)
    ours eagle3 chain  vs  HF model.generate()                       (HF has no EAGLE decoding)
    ours eagle3 tree   vs  HF model.generate()

tau for HF counts the target's forward calls (a forward pre-hook): (new tokens - 1) / (target forwards - 1),
the same definition as ours (the prefill's token and forward excluded). Every greedy output is checked
token for token against HF's and against our AR output. Writes ``bench.json`` and ``bench.md`` into the run
directory and prints the table.

tune: see :mod:`drafttrain.decoding.tune`; writes ``tune.json`` and prints the chosen overrides.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import torch

from ..artifacts import load_draft_model, load_drafter, load_eagle3
from ..config import DEFAULT_BUCKETS
from ..io import DraftTrainError, write_json

# ---------------------------------------------------------------------------------------------- helpers
class ForwardCounter:
    """Counts calls of a module's forward (HF generate's target forwards)."""

    def __init__(self, module):
        self.n = 0
        self._h = module.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.n += 1

    def close(self):
        self._h.remove()


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ------------------------------------------------------------------------------------------------ bench
class _Ours:
    """One of our methods: a SpecDecoder per method, reused across passes."""

    def __init__(self, label, decoder, eos, max_new, oracle=False):
        self.label, self.dec, self.eos, self.max_new = label, decoder, eos, max_new

    def run(self, prompts):
        from ..decoding.engine import aggregate

        t0 = time.perf_counter()
        res = [self.dec.generate(p, self.max_new, self.eos) for p in prompts]
        dt = time.perf_counter() - t0
        agg = aggregate(res)
        return [r.tokens for r in res], agg["num_new_tokens"] / dt, agg["tau"]


class _HF:
    def __init__(self, label, model, eos, pad, max_new, **gen_kw):
        self.label, self.model, self.eos, self.pad, self.max_new, self.kw = label, model, eos, pad, max_new, gen_kw

    @torch.no_grad()
    def run(self, prompts):
        dev = next(self.model.parameters()).device
        counter = ForwardCounter(self.model)
        outs, new, fwd_extra = [], 0, 0
        t0 = time.perf_counter()
        try:
            for p in prompts:
                ids = torch.tensor([p], device=dev)
                before = counter.n
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_new,
                                          do_sample=False, eos_token_id=self.eos, pad_token_id=self.pad,
                                          **self.kw)
                toks = out[0, len(p):].tolist()
                outs.append(toks)
                new += len(toks)
                fwd_extra += (counter.n - before) - 1  # forwards after the prefill
        finally:
            counter.close()
        dt = time.perf_counter() - t0
        rounds_tokens = new - len(prompts)  # the prefill's token of every prompt excluded
        return outs, new / dt, (rounds_tokens / fwd_extra if fwd_extra > 0 else None)


def _identical(a_outs, b_outs) -> bool:
    return all(a == b for a, b in zip(a_outs, b_outs))


@dataclasses.dataclass
class _Plan:
    """The benchmark's settings on one target, and what its rows share: one runner per tap set (each
    generate() resets it) and HF's plain generate() (the baseline of several rows)."""

    model: object
    eos: list
    pad: int
    max_new_tokens: int
    max_len: int
    rkw: dict  # TargetRunner options
    num_draft_tokens: int
    pld_num_tokens: int
    pld_max_ngram: int
    pld_tree_branches: int
    pld_tree_nodes: int
    tree_cfg: dict
    static_shapes: bool
    compile: bool
    buckets: tuple
    hf_num_assistant_tokens: int | None
    eagle3_num_draft_tokens: int | None
    runners: dict = dataclasses.field(default_factory=dict)
    hf_ar: object = None

    def proposer(self, method, drafter=None, k=1, **tree):
        """A row's proposer, as ``drafttrain eval decode.method=<method>`` builds it: ``k`` draft tokens (pld), a
        tree when given its depth, top_k and total_tokens."""
        from ..config import DecodeConfig, TreeConfig
        from ..decoding.build import make_proposer

        decode = DecodeConfig(method=method, num_draft_tokens=k, pld_max_ngram=self.pld_max_ngram,
                              tree=TreeConfig(enabled=bool(tree), **tree), static_shapes=self.static_shapes,
                              compile=self.compile, buckets=list(self.buckets))
        return make_proposer(method, drafter=drafter, decode=decode, max_len=self.max_len)

    def ours(self, label, proposer, K, taps=None):
        from ..decoding import SpecDecoder, TargetRunner

        if taps not in self.runners:
            self.runners[taps] = TargetRunner(self.model, taps=taps, **self.rkw)
        return _Ours(label, SpecDecoder(self.runners[taps], proposer, K), self.eos, self.max_new_tokens)

    def hf(self, label, **gen_kw):
        return _HF(label, self.model, self.eos, self.pad, self.max_new_tokens, **gen_kw)

    def pair(self, m: str, drafter, draft_model, taps, log):
        """The row of method ``m``: ``(name, ours, hf, detail)``, or None when its drafter is missing."""
        if m == "ar":
            return "ar", self.ours("ar", self.proposer("ar"), 0), self.hf_ar, ""
        if m == "draft_model":
            if draft_model is None:
                log("[bench] no draft model: skipping draft_model")
                return None
            if self.hf_num_assistant_tokens:
                draft_model.generation_config.num_assistant_tokens = int(self.hf_num_assistant_tokens)
                draft_model.generation_config.num_assistant_tokens_schedule = "constant"
            K = self.num_draft_tokens
            return ("draft_model", self.ours("draft_model", self.proposer("draft_model", draft_model), K),
                    self.hf("generate(assistant_model=...)", assistant_model=draft_model), f"K={K}")
        n, ngram = self.pld_num_tokens, self.pld_max_ngram
        if m in ("pld", "pld_tree"):
            hf = self.hf(f"generate(prompt_lookup_num_tokens={n})", prompt_lookup_num_tokens=n,
                         max_matching_ngram_size=ngram)
            if m == "pld":
                return "pld", self.ours("pld", self.proposer("pld", k=n), n), hf, f"{n} tokens, n-gram <= {ngram}"
            prop = self.proposer("pld", depth=n, top_k=self.pld_tree_branches, total_tokens=self.pld_tree_nodes)
            return ("pld tree", self.ours("pld_tree", prop, n), hf,
                    f"{n} deep, <= {self.pld_tree_branches} matches, <= {self.pld_tree_nodes} nodes")
        if m in ("eagle3", "eagle3_tree"):
            if drafter is None:
                log(f"[bench] no EAGLE-3 drafter: skipping {m}")
                return None
            if m == "eagle3":
                ke = int(self.eagle3_num_draft_tokens or self.num_draft_tokens)
                return "eagle3 chain", self.ours(m, self.proposer("eagle3", drafter), ke, taps), self.hf_ar, f"K={ke}"
            tc = self.tree_cfg
            return ("eagle3 tree", self.ours(m, self.proposer("eagle3", drafter, **tc), tc["depth"], taps), self.hf_ar,
                    "depth {depth}, top-k {top_k}, {total_tokens} nodes".format(**tc))
        raise DraftTrainError(f"bench: unknown method {m!r} (ar, draft_model, pld, pld_tree, eagle3, eagle3_tree)")


def _timed_passes(pairs, prompts, hf_ar, warmup: int, runs: int, log):
    """Warm-up passes over all prompts (first calls pay for allocation, lazy initialisation, kernel selection
    and, compile=True, one compilation per shape, which must all happen before timing), then ``runs`` timed
    passes, ours and HF alternating who goes first. Returns per runner (by id) tokens/s and tau of each pass,
    and its outputs."""
    for _ in range(warmup):
        for _, o, h, _ in pairs:
            o.run(prompts)
            h.run(prompts)
    times = {id(x): [] for _, o, h, _ in pairs for x in (o, h)}
    taus = {id(x): [] for _, o, h, _ in pairs for x in (o, h)}
    outs = {}
    hf_done = set()
    for r in range(runs):
        for i, (name, o, h, _) in enumerate(pairs):
            order = (o, h) if (i + r) % 2 == 0 else (h, o)  # alternate who goes first
            for x in order:
                if x is hf_ar and id(x) in hf_done:
                    continue  # HF AR is shared by several rows: time it once per pass
                toks, tps, tau = x.run(prompts)
                times[id(x)].append(tps)
                taus[id(x)].append(tau)
                outs[id(x)] = toks
                if x is hf_ar:
                    hf_done.add(id(x))
        hf_done.clear()
        log(f"[bench] pass {r + 1}/{runs} done")
    return times, taus, outs


def _rows(pairs, times, taus, outs, hf_ar) -> list[dict]:
    ar_outs = next((outs[id(o)] for name, o, h, _ in pairs if name == "ar"), outs[id(hf_ar)] if id(hf_ar) in outs
                   else None)
    rows = []
    for name, o, h, detail in pairs:
        ours_tps, hf_tps = _median(times[id(o)]), _median(times[id(h)])
        rows.append({
            "method": name,
            "detail": detail,
            "ours_tokens_per_s": ours_tps,
            "ours_tau": _median(taus[id(o)]),
            "hf": h.label,
            "hf_tokens_per_s": hf_tps,
            "hf_tau": _median(taus[id(h)]),
            "ratio_ours_hf": ours_tps / hf_tps if ours_tps and hf_tps else None,
            # ours and HF ran back to back in every pass: the median of the per-pass ratios is less sensitive
            # to load that changes between passes than the ratio of the medians
            "ratio_paired_median": _median([a / b for a, b in zip(times[id(o)], times[id(h)]) if a and b]),
            "outputs_identical_to_hf": _identical(outs[id(o)], outs[id(h)]),
            "outputs_identical_to_ar": _identical(outs[id(o)], ar_outs) if ar_outs is not None else None,
            "ours_runs_tokens_per_s": times[id(o)],
            "hf_runs_tokens_per_s": times[id(h)],
        })
    return rows


@torch.no_grad()
def bench(model, tokenizer, prompts, *, drafter=None, draft_model=None, methods=("ar", "draft_model", "pld",
          "eagle3", "eagle3_tree"), max_new_tokens=128, warmup=1, runs=3, num_draft_tokens=4, pld_num_tokens=10,
          pld_max_ngram=3, pld_tree_branches=4, pld_tree_nodes=32, tree=None, cache="auto", static_shapes=False,
          compile=False, buckets=DEFAULT_BUCKETS,
          hf_num_assistant_tokens=None, eagle3_num_draft_tokens=None, log=print) -> dict:
    """Run the benchmark; returns ``{"rows": [...], ...}`` (see the module docstring)."""
    from transformers.utils import logging as hf_logging

    from ..decoding.build import cache_length, target_taps
    from ..data.chat import stop_token_ids

    if not prompts:
        raise DraftTrainError("bench: no prompts")
    hf_logging.set_verbosity_error()
    eos = sorted(stop_token_ids(model, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    tree_cfg = dict(depth=6, top_k=8, total_tokens=48) if tree is None else dict(tree)
    max_len = cache_length(prompts, max_new_tokens, max(num_draft_tokens, pld_num_tokens, tree_cfg["total_tokens"]))
    plan = _Plan(model, eos, pad, max_new_tokens, max_len,
                 dict(max_len=max_len, cache=cache, static_shapes=static_shapes, compile=compile,
                      buckets=tuple(buckets), timing=False),
                 num_draft_tokens, pld_num_tokens, pld_max_ngram, pld_tree_branches, pld_tree_nodes, tree_cfg,
                 static_shapes, compile, tuple(buckets), hf_num_assistant_tokens, eagle3_num_draft_tokens)
    taps = target_taps("eagle3", drafter) if drafter is not None else None
    plan.hf_ar = hf_ar = plan.hf("generate()")
    pairs = [p for p in (plan.pair(m, drafter, draft_model, taps, log) for m in methods) if p is not None]
    times, taus, outs = _timed_passes(pairs, prompts, hf_ar, warmup, runs, log)
    return {"rows": _rows(pairs, times, taus, outs, hf_ar), "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "runs": runs, "warmup": warmup,
            "new_tokens_per_pass": sum(len(t) for t in outs[id(hf_ar)]) if id(hf_ar) in outs else None,
            "device": str(next(model.parameters()).device), "threads": torch.get_num_threads(),
            "cache": cache, "static_shapes": static_shapes, "compile": compile,
            "buckets": list(buckets) if static_shapes else None}


def format_table(result: dict) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    lines = ["| method | ours tok/s | ours τ | HF baseline | HF tok/s | HF τ | ours / HF | ours / HF per pass "
             "(median) | greedy output = HF = AR |",
             "|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        same = "yes" if r["outputs_identical_to_hf"] and r["outputs_identical_to_ar"] in (True, None) else "NO"
        name = r["method"] + (f" ({r['detail']})" if r["detail"] else "")
        lines.append(f"| {name} | {f(r['ours_tokens_per_s'], '.1f')} | {f(r['ours_tau'], '.2f')} | {r['hf']} | "
                     f"{f(r['hf_tokens_per_s'], '.1f')} | {f(r['hf_tau'], '.2f')} | "
                     f"{f(r['ratio_ours_hf'], '.2f')}x | {f(r.get('ratio_paired_median'), '.2f')}x | {same} |")
    return "\n".join(lines)


def _setup(job):
    from ..artifacts import recorded_target
    from ..data.select import eval_prompt_ids
    from .evalsets import eval_conversations
    from ..targets.load import load_target, target_id

    if job.threads > 0:
        torch.set_num_threads(job.threads)
    if job.target.name_or_path == "auto":  # the target the drafter was trained for, else the built-in one
        rec = recorded_target(job.drafter) if job.drafter and (Path(job.drafter) / "config.json").exists() else None
        job.target.name_or_path = rec or "builtin"
    model, tokenizer, path = load_target(job.target)
    prompts = eval_prompt_ids(tokenizer, eval_conversations(job.data, path), job.decode.num_prompts)
    return model, tokenizer, path, target_id(path), prompts


def run_bench(job, run_dir: Path) -> dict:
    """``drafttrain bench``: ``job`` is a ``BenchJob`` (drafttrain/config.py); bench.json and bench.md go into
    ``run_dir``."""
    from ..io import atomic_path

    model, tokenizer, path, tname, prompts = _setup(job)
    dev = next(model.parameters()).device
    drafter = load_eagle3(job.drafter, model)
    d = job.decode
    dm = None
    dm_path = None
    if d.draft_model and "draft_model" in job.methods:
        dm, dtok, dm_path = load_draft_model(d.draft_model, job.target, dev)
        if dtok.get_vocab() != tokenizer.get_vocab():
            raise DraftTrainError(f"decode.draft_model={d.draft_model}: its tokenizer differs from the target's")
    res = bench(model, tokenizer, prompts, drafter=drafter, draft_model=dm, methods=job.methods,
                max_new_tokens=d.max_new_tokens, warmup=d.warmup, runs=d.repeats,
                num_draft_tokens=d.num_draft_tokens, pld_num_tokens=job.pld_num_tokens,
                pld_max_ngram=d.pld_max_ngram, pld_tree_branches=job.pld_tree_branches,
                pld_tree_nodes=job.pld_tree_nodes,
                tree=dict(depth=d.tree.depth, top_k=d.tree.top_k, total_tokens=d.tree.total_tokens),
                cache=d.cache, static_shapes=d.static_shapes, compile=d.compile, buckets=d.buckets,
                hf_num_assistant_tokens=job.hf_num_assistant_tokens, eagle3_num_draft_tokens=job.eagle3_num_draft_tokens)
    res.update(target=tname, drafter=job.drafter, draft_model=dm_path, created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    table = format_table(res)
    print("\n" + table + "\n", flush=True)
    run_dir = Path(run_dir)
    write_json(run_dir / "bench.json", res)
    with atomic_path(run_dir / "bench.md") as tmp:
        Path(tmp).write_text(table + "\n")
    print(f"[drafttrain] bench: {run_dir / 'bench.json'}", flush=True)
    return res


# ------------------------------------------------------------------------------------------------- tune
def _tune_chain(runner, proposer, decode_all, verify: dict, max_draft_tokens: int) -> dict:
    """Chains: acceptance per position and draft costs at the longest draft length; the best K."""
    from ..decoding import SpecDecoder
    from ..decoding.tune import choose_chain_length

    K = max_draft_tokens
    if getattr(proposer, "name", "") == "medusa":
        K = min(K, proposer.heads.num_heads)
    saved = getattr(proposer, "num_tokens", None)
    if saved is not None:
        proposer.num_tokens = K
    cal = decode_all(SpecDecoder(runner, proposer, K))
    if saved is not None:
        proposer.num_tokens = saved
    draft_per_token = cal["time_draft"] / max(cal["num_drafted"], 1)
    other = cal["time_other"] / max(cal["num_rounds"], 1)
    choice = choose_chain_length(cal["acceptance_per_position"], verify, draft_per_token, other, K)
    out = dict(kind="chain", acceptance_per_position=cal["acceptance_per_position"],
               draft_cost_per_token_s=draft_per_token, draft_cost_per_round_s=0.0, other_cost_per_round_s=other,
               **choice)
    best = choice["best"]
    out["overrides"] = [f"decode.num_draft_tokens={best['K']}"] if best and best["K"] > 0 else \
        ["decode.method=ar  (no draft length beats plain decoding here)"]
    return out


def _tune_block(runner, proposer, decode_all, verify: dict, K: int, ar_round: float) -> dict:
    """A block drafter: tau, draft and other time measured at each K = 1..K (one decode of the calibration
    prompts per K); the best K by measured tau over modelled round time."""
    from ..decoding import SpecDecoder
    from ..decoding.tune import choose_measured_length

    saved, measured, longest = proposer.slots, [], None  # the block holds 1 + slots tokens
    try:
        for k in range(1, K + 1):
            proposer.slots = k
            agg = decode_all(SpecDecoder(runner, proposer, k))
            rounds = max(agg["num_rounds"], 1)
            measured.append({"K": k, "tau": agg["tau"], "draft_time_per_round": agg["time_draft"] / rounds,
                             "other_time_per_round": agg["time_other"] / rounds})
            longest = agg
    finally:
        proposer.slots = saved
    choice = choose_measured_length(measured, verify, ar_round)
    out = dict(kind="chain", acceptance_per_position=longest["acceptance_per_position"], draft_cost_per_token_s=0.0,
               draft_cost_per_round_s=measured[-1]["draft_time_per_round"],
               other_cost_per_round_s=measured[-1]["other_time_per_round"], measured_per_k=measured, **choice)
    best = choice["best"]
    out["overrides"] = [f"decode.num_draft_tokens={best['K']}"] if best["K"] > 0 else \
        ["decode.method=ar  (no draft length beats plain decoding here)"]
    return out


def _tune_tree(runner, proposer, decode, decode_all, verify: dict, tree_sizes, other_ar: float, ar_round: float,
               log) -> dict:
    """Trees: tau and draft time measured at each size of ``tree_sizes``; the best total_tokens."""
    from ..decoding import SpecDecoder
    from ..decoding.tune import choose_tree_size

    measured = []
    for size in tree_sizes:
        if hasattr(proposer, "total_tokens"):
            proposer.total_tokens = int(size)
        dec = SpecDecoder(runner, proposer, int(getattr(proposer, "depth", decode.tree.depth)))
        agg = decode_all(dec)
        measured.append({"total_tokens": int(size), "tau": agg["tau"], "nodes_per_round": agg["nodes_per_round"],
                         "draft_time_per_round": agg["time_draft"] / max(agg["num_rounds"], 1),
                         "measured_tokens_per_s": agg["tokens_per_s"]})
        log(f"[tune] tree {size} nodes: tau {agg['tau']:.2f}")
    choice = choose_tree_size(measured, verify, other_ar, ar_round)
    out = dict(kind="tree", **choice)
    best = choice["best"]
    out["overrides"] = [f"decode.tree.total_tokens={best['total_tokens']}"] if best else []
    return out


@torch.no_grad()
def tune(model, tokenizer, prompts, proposer, decode, *, taps=None, method: str, max_draft_tokens: int = 8,
         tree_sizes=(8, 16, 32, 48, 64), max_new_tokens: int = 64, repeats: int = 5, log=print) -> dict:
    """Measure acceptance and costs on ``prompts`` and pick the draft length (chains) or tree size (trees)."""
    from ..decoding import SpecDecoder, TargetRunner, aggregate
    from ..decoding.build import cache_length, static_options
    from ..decoding.tune import measure_verify_cost
    from ..data.chat import stop_token_ids

    eos = stop_token_ids(model, tokenizer)
    is_tree = bool(getattr(proposer, "tree", False))
    if getattr(proposer, "one_forward_per_round", False):  # DFlash: every length its block drafts, in one forward
        max_draft_tokens = int(proposer.block_size) - 1
    biggest = max(max_draft_tokens, max(tree_sizes) if is_tree else 0)
    # the runner the decoder will use (same cache, static shapes and compilation), so costs are the real ones
    runner = TargetRunner(model, taps=taps, max_len=cache_length(prompts, max_new_tokens, biggest),
                          cache=decode.cache, timing=False, **static_options(decode, buckets=True))
    context = prompts[0]
    sizes = sorted({n for n in range(1, max_draft_tokens + 2)} | ({s + 1 for s in tree_sizes} if is_tree else set()))
    verify = measure_verify_cost(runner, context, sizes, repeats=repeats, tree=is_tree)
    log("[tune] target forward cost (ms) by new positions: " +
        ", ".join(f"{n}: {1e3 * t:.2f}" for n, t in verify.items()))

    def decode_all(dec):
        if hasattr(proposer, "set_reference"):
            raise DraftTrainError("tune: the oracle needs references; tune a real drafter or pld")
        # warm-up (allocation; with compile, one graph per shape and draft length met, e.g. each catch-up
        # bucket of a fused draft chain): not timed. Compiled, every prompt once, so no compilation is timed.
        for p in (prompts if decode.compile else prompts[:1]):
            dec.generate(p, max_new_tokens, eos)
        return aggregate([dec.generate(p, max_new_tokens, eos) for p in prompts])

    ar = decode_all(SpecDecoder(runner, _no_draft(), 0))
    other_ar = max(ar["time_other"] / max(ar["num_rounds"], 1), 0.0)
    ar_round = verify[1] + other_ar
    out = {"method": method, "verify_cost_s": {str(k): v for k, v in verify.items()}, "ar_tokens_per_s": ar["tokens_per_s"]}
    if getattr(proposer, "one_forward_per_round", False):  # DFlash: its block is 1 + K tokens, so measure each K
        out.update(_tune_block(runner, proposer, decode_all, verify, max_draft_tokens, ar_round))
    elif not is_tree:
        out.update(_tune_chain(runner, proposer, decode_all, verify, max_draft_tokens))
    else:
        out.update(_tune_tree(runner, proposer, decode, decode_all, verify, tree_sizes, other_ar, ar_round, log))
    return out


def _no_draft():
    from ..decoding import NoDraft

    return NoDraft()


def _tune_proposer(job, model, prompts):
    """The proposer ``drafttrain tune`` measures, and the drafter (EAGLE-3) it runs on."""
    from ..decoding.build import cache_length, make_proposer

    dev = next(model.parameters()).device
    if job.drafter and job.decode.method == "eagle3":  # the default: a saved DFlash drafter names its own method
        from ..artifacts import drafter_type

        if drafter_type(job.drafter) == "dflash":
            job.decode.method = "dflash"
    method = job.decode.method
    drafter = None
    if method == "eagle3":
        drafter = load_eagle3(job.drafter, model)
        if drafter is None:
            raise DraftTrainError("tune: decode.method=eagle3 needs drafter=<saved drafter directory>")
    if method == "dflash":
        if not job.drafter:
            raise DraftTrainError("tune: decode.method=dflash needs drafter=<saved DFlash drafter directory>")
        drafter = load_drafter(job.drafter, dev, target_model=model).eval()
    if method not in ("eagle3", "draft_model", "pld", "dflash"):
        raise DraftTrainError(f"tune: decode.method={method}: tune eagle3 (chain or tree), dflash, draft_model or pld")
    block = int(drafter.config.block_size) if method == "dflash" else 0
    max_len = cache_length(prompts, job.decode.max_new_tokens, max(job.max_draft_tokens, block, *job.tree_sizes))
    if method == "draft_model" and job.decode.draft_model:
        dm, _, _ = load_draft_model(job.decode.draft_model, job.target, dev)
        return make_proposer(method, drafter=dm, decode=job.decode, max_len=max_len, device=dev), drafter
    return make_proposer(method, drafter=drafter, decode=job.decode, max_len=max_len, device=dev), drafter


def run_tune(job, run_dir: Path) -> dict:
    """``drafttrain tune``: ``job`` is a ``TuneJob`` (drafttrain/config.py); tune.json goes into ``run_dir``."""
    from ..decoding.build import target_taps

    model, tokenizer, path, tname, prompts = _setup(job)
    proposer, drafter = _tune_proposer(job, model, prompts)
    method = job.decode.method  # (a saved DFlash drafter sets it)
    taps = target_taps(method, drafter) if drafter is not None else None
    res = tune(model, tokenizer, prompts, proposer, job.decode, taps=taps, method=method,
               max_draft_tokens=job.max_draft_tokens, tree_sizes=job.tree_sizes,
               max_new_tokens=job.decode.max_new_tokens,
               repeats=job.repeats)
    res.update(target=tname, drafter=job.drafter, created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    rows = res["rows"]
    key = "K" if res["kind"] == "chain" else "total_tokens"
    print("\n" + "\n".join(
        [f"{key:>12} {'tau':>6} {'round ms':>9} {'tok/s':>8} {'vs AR':>6}"] +
        [f"{r[key]:>12} {r['tau']:>6.2f} {1e3 * r['round_time_s']:>9.2f} {r['tokens_per_s']:>8.1f} "
         f"{(r['speedup_vs_ar'] or 0):>5.2f}x" for r in rows]), flush=True)
    print("[drafttrain] tune picks: " + " ".join(res["overrides"]), flush=True)
    write_json(Path(run_dir) / "tune.json", res)
    return res
