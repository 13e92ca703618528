"""An evaluation's decoders and timed passes: :func:`prepare` builds the AR and speculative decoders on their target
runners (and the batched pair with ``decode.batch_size > 1``), :func:`measure` times them back to back on every
prompt (alternating which goes first, so the speed ratio is measured under the same machine load),
:func:`sweep` times other draft lengths on the same prompts. :class:`EvalRun` is what the steps share,
:class:`Measured` the timed passes (evaluation/report.py turns them into the report).
"""
from __future__ import annotations

import dataclasses

from ..io import DraftTrainError



def sweep_lengths(decode, K: int, proposer) -> list[int]:
    """Draft lengths of the speedup sweep (``decode.sweep``; None = 1, 2, 4, 8 and K, capped where the
    proposer cannot draft more)."""
    if decode.sweep is not None:
        ks = [int(k) for k in decode.sweep]
    else:
        ks = [1, 2, 4, 8, K]
    cap = getattr(proposer, "depth", None)
    heads = getattr(getattr(proposer, "heads", None), "num_heads", None)
    if getattr(proposer, "name", "") == "medusa" and heads:
        cap = heads
    return sorted({k for k in ks if k >= 1 and (cap is None or k <= cap)})


def _progress(total: int, desc: str):
    """A progress bar on stderr (redrawn at most every few seconds, so a log file gets a few lines, not
    thousands); its last state stays on screen."""
    import sys

    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="prompt", file=sys.stderr, mininterval=5.0, dynamic_ncols=True)


@dataclasses.dataclass
class EvalRun:
    """What one evaluation's measure, sweep and report steps share: the prompts, the two decoders (AR and
    speculative) on their runners, and the grammar of each prompt."""

    model: object
    tokenizer: object
    prompts: list
    proposer: object
    decode: object
    method: str
    K: int  # draft length (trees: depth)
    eos: object
    sp_runner: object  # the speculative decoder's TargetRunner (the AR one when no taps are needed)
    ar: object  # SpecDecoder with NoDraft, K = 0
    grammars: object  # GrammarPlan: one grammar per prompt
    compiled: list
    spec: object = None  # SpecDecoder with the proposer, K
    labels: list | None = None  # (category, question id) per prompt: the report adds a row per category
    batched: tuple | None = None  # decode.batch_size > 1: (AR, speculative) BatchSpecDecoder

    @property
    def is_tree(self) -> bool:
        return bool(getattr(self.proposer, "tree", False))

    @property
    def is_oracle(self) -> bool:
        return self.method == "oracle"

    def decoder(self, k: int):
        """A speculative decoder drafting ``k`` tokens (trees: depth) with the run's sampling settings."""
        from ..decoding.engine import SpecDecoder

        d = self.decode
        return SpecDecoder(self.sp_runner, self.proposer, k, seed=d.seed, typical=bool(d.typical_acceptance),
                           typical_epsilon=d.typical_epsilon, typical_delta=d.typical_delta,
                           draft_temperature=d.draft_temperature, **_sampling(d))

    def gstate(self, i: int):  # a fresh grammar state per generation (None: unconstrained)
        return None if self.compiled[i] is None else self.compiled[i].state()

    def run_ar(self, i: int, p, n: int | None = None):
        n = self.decode.max_new_tokens if n is None else n
        return self.ar.generate(p, n, self.eos, seed=self.decode.seed + i, grammar=self.gstate(i))

    def run_spec(self, dec, i: int, p, ref):
        if self.is_oracle:
            self.proposer.set_reference(ref)
        return dec.generate(p, self.decode.max_new_tokens, self.eos, seed=self.decode.seed + i,
                            grammar=self.gstate(i))


@dataclasses.dataclass
class Measured:
    """The timed passes: per prompt and pass, AR and speculative results, whether they match; ``refs``: the
    first pass's AR tokens per prompt (the oracle's references in the sweep)."""

    ar: list
    spec: list
    match: list
    refs: list
    calls: list = dataclasses.field(default_factory=list)  # batched: (AR, speculative) BatchGenerationResult per call


def _sampling(decode) -> dict:
    return dict(temperature=decode.temperature, top_k=decode.top_k, top_p=decode.top_p)


def prepare(model, tokenizer, prompts: list[list[int]], proposer, decode, *, method: str, taps=None,
            grammars=None) -> EvalRun:
    """Check the settings, build the target runners, the AR and speculative decoders and the grammars."""
    from ..data.chat import stop_token_ids
    from ..decoding.build import decode_cache_length, draft_depth, static_options
    from ..decoding.engine import SpecDecoder
    from ..decoding.proposers import NoDraft
    from ..decoding.target import TargetRunner

    if not prompts:
        raise DraftTrainError("no evaluation prompts (data.num_eval rows of the evaluation set are empty?)")
    if decode.cache not in ("auto", "static", "dynamic"):
        raise DraftTrainError(f"decode.cache={decode.cache}: expected auto, static or dynamic")
    eos = stop_token_ids(model, tokenizer)
    rkw = dict(max_len=decode_cache_length(prompts, decode), cache=decode.cache,
               **static_options(decode, buckets=True))
    try:
        ar_runner = TargetRunner(model, taps=None, **rkw)
        # one runner when no taps are needed: its compiled graphs then serve both decoders
        sp_runner = ar_runner if not taps else TargetRunner(model, taps=taps, **rkw)
    except ValueError as e:
        raise DraftTrainError(f"decode.cache={decode.cache}: {e}") from None
    if grammars is None:
        from ..structured import grammar_plan

        grammars = grammar_plan(decode.grammar, [[]] * len(prompts), len(prompts))
    run = EvalRun(model, tokenizer, prompts, proposer, decode, method, draft_depth(proposer, decode), eos,
                  sp_runner, SpecDecoder(ar_runner, NoDraft(), 0, seed=decode.seed, **_sampling(decode)),
                  grammars, [])
    run.spec = run.decoder(run.K)
    if hasattr(proposer, "agree_fn"):  # the oracle tree's wrong siblings must be real token ids
        proposer.vocab_size = sp_runner.vocab_size
    if len(grammars.decode) != len(prompts):
        raise ValueError(f"{len(grammars.decode)} grammars for {len(prompts)} prompts")
    run.compiled = grammars.compile(tokenizer, ar_runner.vocab_size, eos)
    if int(getattr(decode, "batch_size", 1)) > 1:
        run.batched = batched_decoders(run, ar_runner)
    return run


def batched_decoders(run: EvalRun, ar_runner) -> tuple:
    """``decode.batch_size > 1``: the AR and speculative ``BatchSpecDecoder`` (chain methods only)."""
    from ..decoding.batched import PACKED_ROW_TOKENS, BatchSpecDecoder
    from ..decoding.proposers import NoDraft

    d = run.decode
    if run.is_oracle:
        raise DraftTrainError("decode.batch_size>1 does not support decode.method=oracle (per-prompt references)")
    if any(c is not None for c in run.compiled):
        raise DraftTrainError("decode.batch_size>1 does not support grammar-constrained decoding (decode.grammar)")
    packed = dict(packed_prefill=bool(getattr(d, "packed_prefill", True)),
                  packed_row_tokens=int(getattr(d, "packed_row_tokens", PACKED_ROW_TOKENS)))
    ar = BatchSpecDecoder(ar_runner, NoDraft(), 0, seed=d.seed, **packed, **_sampling(d))
    spec = BatchSpecDecoder(run.sp_runner, run.proposer, run.K, seed=d.seed, typical=bool(d.typical_acceptance),
                            draft_temperature=d.draft_temperature, **packed, **_sampling(d))
    return ar, spec


def measure_batched(run: EvalRun) -> Measured:
    """``measure`` with ``decode.batch_size = B``, AR and speculative both batched, run back to back (alternating
    which goes first). ``decode.continuous_batching`` (default): each pass streams every prompt through B rows,
    a finished row refilled by the next prompt; false: the prompts in groups of B, each decoded to its last row.
    A row's times are its share of its call's (so the pooled tokens/s is the batch throughput)."""
    from ..decoding.engine import aggregate

    decode, prompts, (ar, spec) = run.decode, run.prompts, run.batched
    B, n_new = int(decode.batch_size), decode.max_new_tokens
    if bool(getattr(decode, "continuous_batching", True)):
        groups, width = [list(range(len(prompts)))], B
    else:
        groups, width = [list(range(i, min(i + B, len(prompts)))) for i in range(0, len(prompts), B)], None
    for _ in range(decode.warmup):  # untimed: one batch
        ar.generate(prompts[:B], min(16, n_new), run.eos)
        spec.generate(prompts[:B], min(16, n_new), run.eos)
    m = Measured([], [], [], [])
    bar = _progress(decode.repeats * len(prompts), f"eval {run.method} vs AR, batch {B}")
    for rep in range(decode.repeats):
        for j, g in enumerate(groups):
            ps, seed = [prompts[i] for i in g], decode.seed + g[0]
            calls = [(ar, "a"), (spec, "s")] if (j + rep) % 2 == 0 else [(spec, "s"), (ar, "a")]
            out = {k: dec.generate(ps, n_new, run.eos, seed=seed, batch_size=width,
                                   admit_min=int(getattr(decode, "admit_min", 0))) for dec, k in calls}
            a, s = out["a"], out["s"]
            m.calls.append((a, s))
            for ra, rs in zip(a.results, s.results):
                m.ar.append(ra)
                m.spec.append(rs)
                m.match.append(ra.tokens == rs.tokens)
                if rep == 0:
                    m.refs.append(ra.tokens)
            bar.update(len(g))
            bar.set_postfix_str(f"tau {aggregate(m.spec)['tau'] or 0:.2f}, pass {rep + 1}/{decode.repeats}",
                                refresh=False)
    bar.close()
    return m


def _warmup(run: EvalRun) -> None:
    """Untimed: first calls pay for allocation and lazy initialisation; compiled, one graph per shape met
    (every prompt, so no compilation is timed)."""
    decode, prompts = run.decode, run.prompts
    for _ in range(decode.warmup):
        if decode.compile:
            for i, p in enumerate(prompts):
                run.run_spec(run.spec, i, p, run.run_ar(i, p).tokens)
            continue
        ref = run.run_ar(0, prompts[0], min(16, decode.max_new_tokens))
        run.run_spec(run.spec, 0, prompts[0], ref.tokens)


def measure(run: EvalRun) -> Measured:
    """``decode.repeats`` timed passes over the prompts after the warm-up; per prompt AR and speculative run
    back to back, alternating which goes first (the oracle needs AR first)."""
    from ..decoding.engine import aggregate

    if run.batched:
        return measure_batched(run)
    decode, prompts = run.decode, run.prompts
    _warmup(run)
    m = Measured([], [], [], [])
    bar = _progress(decode.repeats * len(prompts), f"eval {run.method} vs AR")
    for rep in range(decode.repeats):
        for i, p in enumerate(prompts):
            if run.is_oracle or (i + rep) % 2 == 0:
                a = run.run_ar(i, p)
                s = run.run_spec(run.spec, i, p, a.tokens)
            else:
                s = run.run_spec(run.spec, i, p, None)
                a = run.run_ar(i, p)
            m.ar.append(a)
            m.spec.append(s)
            m.match.append(a.tokens == s.tokens)
            if rep == 0:
                m.refs.append(a.tokens)
            bar.update(1)
            bar.set_postfix_str(f"tau {aggregate(m.spec)['tau'] or 0:.2f}, pass {rep + 1}/{decode.repeats}",
                                refresh=False)
    bar.close()
    return m


def sweep(run: EvalRun, m: Measured) -> list[dict]:
    """Speedup per draft length (``sweep_lengths``) on the first ``decode.sweep_prompts`` prompts, against the
    AR times of the same prompts (first repeat); [] for AR or when nothing is to be swept."""
    from ..decoding.engine import aggregate

    decode, proposer, prompts = run.decode, run.proposer, run.prompts
    lengths = sweep_lengths(decode, run.K, proposer)
    if run.method == "ar" or decode.sweep_prompts <= 0 or not lengths or run.batched:  # (the sweep is batch 1)
        return []
    n = min(decode.sweep_prompts, len(prompts))
    base = aggregate(m.ar[:n])["tokens_per_s"]
    saved_num_tokens = getattr(proposer, "num_tokens", None)
    out = []
    sbar = _progress(len(lengths) * n, f"sweep {run.method} K={','.join(map(str, lengths))}")
    for k in lengths:
        if saved_num_tokens is not None:  # prompt lookup caps its drafts at num_tokens
            proposer.num_tokens = k
        dec = run.decoder(k)
        res = []
        for i, p in enumerate(prompts[:n]):
            res.append(run.run_spec(dec, i, p, m.refs[i]))
            sbar.update(1)
        agg = aggregate(res)
        out.append({"draft_tokens": k, "prompts": n, "new_tokens": agg["num_new_tokens"], "tau": agg["tau"],
                    "alpha": agg["alpha"],
                    "tokens_per_s": agg["tokens_per_s"],
                    "speedup": agg["tokens_per_s"] / base if base and agg["tokens_per_s"] else None})
    sbar.close()
    if saved_num_tokens is not None:
        proposer.num_tokens = saved_num_tokens
    return out
