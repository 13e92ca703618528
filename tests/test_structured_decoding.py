"""Grammar-constrained speculative decoding (drafttrain.structured + drafttrain.decoding), CPU.

- the engine keeps the grammar state on the committed tokens (rejected drafts never touch it) and masks
  the target at every verified position; no draft token that reaches the target is ever ungrammatical;
- greedy constrained speculative output == greedy constrained AR output (which equals a plain-HF reference),
  for chain and tree proposers (stub / oracle / prompt lookup / draft model / EAGLE-3 / Medusa);
- sampling preserves the *constrained* distribution (χ² against the exact law on a 5-token toy vocabulary),
  and the check tells the right order (mask, then temperature / top-k) from the wrong one;
- every constrained output validates against its schema; the eval report carries grammar / valid_fraction.
"""
from __future__ import annotations

import functools
import re
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from drafttrain.decoding import (
    DraftModelProposer,
    Eagle3ChainProposer,
    Eagle3TreeProposer,
    MedusaChainProposer,
    MedusaTreeProposer,
    NoDraft,
    OracleProposer,
    PromptLookupProposer,
    SpecDecoder,
    StubProposer,
    StubTreeProposer,
    TargetRunner,
    process_logits,
)
from drafttrain.drafters.eagle3 import Eagle3Drafter
from drafttrain.drafters.medusa import MedusaHeads
from drafttrain.structured import (
    builtin_structured_examples,
    check_output,
    compile_grammar,
    decode_output,
    grammar_plan,
)

from .test_decoding import TOY_PROMPT, toy_eagle3
from .test_structured import DIGITS, _constrained_greedy
from .test_tree import TreeToyLM, _toy_heads

K = 4
MAX_NEW = 120


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def env(tiny_builtin_target):
    """The tiny built-in target, its tokenizer, three constrained prompts (two function-call schemas, one
    regex) with compiled grammars, and each prompt's constrained greedy AR output."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafttrain.data.chat import prompt_ids

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(tiny_builtin_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_builtin_target, dtype=torch.float32).eval().requires_grad_(False)
    V = model.config.vocab_size
    eos = tok.eos_token_id
    examples = [e for e in builtin_structured_examples(limit=60, seed=0, max_string_length=8)
                if len(e.schema["properties"]["arguments"]["properties"]) <= 2][:2]
    cases = [(e.prompt_ids(tok), e.schema) for e in examples]
    cases.append((prompt_ids(tok, [{"role": "user", "content": "def f(x):"}]), f"regex:{DIGITS}"))
    grammars = [compile_grammar(spec, tok, V, stop_token_ids=[eos]) for _, spec in cases]
    L = model.config.num_hidden_layers
    ar = SpecDecoder(TargetRunner(model, max_len=1024), NoDraft(), 0)
    refs = [ar.generate(p, MAX_NEW, eos, grammar=g.state()).tokens for (p, _), g in zip(cases, grammars)]
    return dict(tok=tok, model=model, V=V, eos=eos, cases=cases, grammars=grammars, refs=refs,
                taps=(2, L // 2, L - 3), medusa_taps=(L,))


def _runner(env, medusa=False):
    """A fresh target runner (tests patch its methods)."""
    return TargetRunner(env["model"], taps=env["medusa_taps"] if medusa else env["taps"], max_len=1024)


def _eagle3(env, seed=0, vd=1024):
    g = torch.Generator().manual_seed(seed)
    V = env["V"]
    ids = torch.randperm(V, generator=g)[:vd].sort().values  # a reduced draft vocabulary
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    torch.manual_seed(seed)
    return Eagle3Drafter.from_target(env["model"], env["taps"], ids - torch.arange(vd), t2d).eval()


def _medusa(env, seed=0):
    torch.manual_seed(seed)
    heads = MedusaHeads.from_target(env["model"], num_heads=3)
    with torch.no_grad():  # the copied LM head plus noise: heads that are sometimes right
        for h in heads.lm_heads:
            h.weight.add_(0.02 * torch.randn_like(h.weight))
    return heads.eval()


def _draft_lm(env):
    import transformers as tf

    torch.manual_seed(5)
    cfg = tf.LlamaConfig(vocab_size=env["V"], hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
    return tf.LlamaForCausalLM(cfg).eval()


def _spy(dec: SpecDecoder, log: dict):
    """Check every verify forward: the drafts that reach the target are grammatical from the engine's grammar
    state (which must hold every committed token), and record the engine's chain truncations."""
    runner = dec.target
    fwd, fwd_tree, chain = runner.forward, runner.forward_tree, dec._grammar_chain

    def forward(ids, last_only=False):
        g = log["grammar"]
        if not last_only and g is not None:  # a chain round: [pending, d_1..d_n]
            drafts = torch.as_tensor(ids).reshape(-1)[1:].tolist()
            assert g.fork().advance(drafts), f"ungrammatical draft reached the target: {drafts}"
            log["drafted"] += len(drafts)
        return fwd(ids, last_only=last_only)

    def forward_tree(ids, parents, *a, **kw):
        g = log["grammar"]
        toks = torch.as_tensor(ids).reshape(-1)[1:].tolist()
        par = [int(p) - 1 for p in list(parents)[1:]]
        if g is not None and toks:
            assert g.tree_masks(toks, par).valid.all(), f"ungrammatical tree node reached the target: {toks}"
            log["drafted"] += len(toks)
        return fwd_tree(ids, parents, *a, **kw)

    def grammar_chain(g, d):
        out, masks = chain(g, d)
        log["truncated"] += int(out.shape[0] < d.shape[0])
        return out, masks

    runner.forward, runner.forward_tree, dec._grammar_chain = forward, forward_tree, grammar_chain
    return dec


def _methods(env):
    V, refs = env["V"], env["refs"]
    sometimes = lambda j: j % 4 != 2  # noqa: E731
    return {
        "stub_chain": (lambda: StubProposer([], sometimes, V), False),
        "oracle_chain": (lambda: OracleProposer([]), False),
        "pld": (lambda: PromptLookupProposer(max_ngram=3, num_tokens=K), False),
        "draft_model": (lambda: DraftModelProposer(_draft_lm(env)), False),
        "eagle3_chain": (lambda: Eagle3ChainProposer(_eagle3(env), max_len=1024), False),
        "eagle3_tree": (lambda: Eagle3TreeProposer(_eagle3(env), max_len=1024, depth=K, top_k=3, total_tokens=10),
                        False),
        "medusa_chain": (lambda: MedusaChainProposer(_medusa(env)), True),
        "medusa_tree": (lambda: MedusaTreeProposer(_medusa(env), [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
                        True),
        "stub_tree": (lambda: StubTreeProposer([], sometimes, V, branching=3), False),
    }, refs


METHODS = ["stub_chain", "oracle_chain", "pld", "draft_model", "eagle3_chain", "eagle3_tree", "medusa_chain",
           "medusa_tree", "stub_tree"]


# ------------------------------------------------------------------------------------ greedy equality
def test_constrained_ar_matches_plain_hf_reference(env):
    """Constrained AR through the engine == argmax of masked logits over a plain HF cache, and validates."""
    for (prompt, spec), g, ref in zip(env["cases"], env["grammars"], env["refs"]):
        out, _ = _constrained_greedy(env["model"], g.state(), prompt, {env["eos"]}, MAX_NEW)
        assert out == ref
        assert ref[-1] == env["eos"], "the grammar should end every test output within MAX_NEW tokens"
        assert check_output(decode_output(env["tok"], ref, [env["eos"]]), spec) is None


@pytest.mark.parametrize("name", METHODS)
def test_greedy_constrained_speculative_equals_constrained_ar(env, name):
    methods, refs = _methods(env)
    make, medusa = methods[name]
    proposer = make()
    runner = _runner(env, medusa)
    depth = getattr(proposer, "depth", K) if getattr(proposer, "tree", False) else (3 if medusa else K)
    dec = _spy(SpecDecoder(runner, proposer, depth), log := {"grammar": None, "drafted": 0, "truncated": 0})
    accepted = 0
    for (prompt, spec), g, ref in zip(env["cases"], env["grammars"], refs):
        if hasattr(proposer, "set_reference"):
            proposer.set_reference(ref)
        log["grammar"] = state = g.state()
        res = dec.generate(prompt, MAX_NEW, env["eos"], grammar=state)
        assert res.tokens == ref, name
        assert state.num_accepted == len(ref) and state.is_terminated()  # advanced over every output token
        assert check_output(decode_output(env["tok"], res.tokens, [env["eos"]]), spec) is None
        accepted += res.num_accepted
    assert log["drafted"] > 0
    if name != "pld":  # (prompt lookup has little to copy in short prompts)
        assert accepted > 0, "no draft was ever accepted: the equality above is not exercised"
    if getattr(proposer, "grammar_aware", False) and not getattr(proposer, "tree", False):
        assert log["truncated"] == 0  # a grammar-aware proposer's drafts are grammatical by construction
    if name == "stub_chain":
        assert log["truncated"] > 0  # the stub's wrong tokens are often ungrammatical: the engine cut them


def test_unconstrained_proposals_would_be_ungrammatical(env):
    """Negative control for the spy: without the grammar, the random EAGLE-3 drafter's chain drafts include
    tokens the grammar forbids (so the checks above are not vacuous)."""
    prompt, _ = env["cases"][0]
    g = env["grammars"][0].state()
    dec = SpecDecoder(_runner(env), Eagle3ChainProposer(_eagle3(env), max_len=1024), K)
    seen_bad = []
    orig = dec.target.forward

    def forward(ids, last_only=False):
        if not last_only:  # the first round: [first token, d_1..d_n] from the grammar's start state
            seen_bad.append(not g.fork().advance(torch.as_tensor(ids).reshape(-1).tolist()))
        return orig(ids, last_only=last_only)

    dec.target.forward = forward
    dec.generate(prompt, 2 + K, env["eos"])  # unconstrained
    assert seen_bad[0]


# ----------------------------------------------------------------------------- mask / rollback logic
class _GrammarSpyProposer(OracleProposer):
    """A grammar-aware chain proposer that checks the engine's bookkeeping at every round: the state it gets
    has accepted exactly the committed output tokens (pending included) and equals a fresh state walked over
    them; it drafts the reference where ``agree(j)`` and another *grammatical* token elsewhere (so its
    wrong drafts are rejected by the target, not cut by the grammar), exploring under ``scratch()``."""

    name = "grammar_spy"
    grammar_aware = True

    def __init__(self, compiled, agree):
        super().__init__([])
        self.compiled, self.agree = compiled, agree
        self.rounds = self.wrong = 0

    def propose(self, tokens, k, sampling, grammar=None):
        out = tokens[self._prompt_len :]
        assert grammar is not None and grammar.num_accepted == len(out)
        fresh = self.compiled.state()
        assert fresh.advance(out) and torch.equal(fresh.allowed_mask(), grammar.allowed_mask())
        self.rounds += 1
        j0, drafts = len(out), []
        before = grammar.num_accepted
        with grammar.scratch():
            for i in range(k):
                if j0 + i >= len(self.reference):
                    break
                t = self.reference[j0 + i]
                if not self.agree(j0 + i) or not grammar.allowed(t):  # (after a wrong draft: any allowed token)
                    others = [x for x in grammar.allowed_mask().nonzero().flatten().tolist() if x != t]
                    if not others:
                        break
                    t = others[(j0 + i) % len(others)]
                    self.wrong += 1
                assert grammar.advance([t])
                drafts.append(t)
                if grammar.is_terminated():
                    break
        assert grammar.num_accepted == before  # scratch() rolled the exploration back
        return drafts, None


def test_engine_keeps_grammar_on_committed_tokens(env):
    (prompt, _), compiled, ref = env["cases"][0], env["grammars"][0], env["refs"][0]
    prop = _GrammarSpyProposer(compiled, agree=lambda j: j % 3 != 1)
    prop.set_reference(ref)
    dec = SpecDecoder(_runner(env), prop, K)
    state = compiled.state()
    res = dec.generate(prompt, MAX_NEW, env["eos"], grammar=state)
    assert res.tokens == ref and prop.rounds == res.num_rounds
    assert prop.wrong > 0 and 0 < res.num_accepted < res.num_drafted  # rejections happened and were undone
    assert state.num_accepted == len(ref) and state.is_terminated()
    # a terminated state is refused up front
    with pytest.raises(ValueError, match="terminated"):
        dec.generate(prompt, 8, env["eos"], grammar=state)


def test_max_new_tokens_cut_and_stop_tokens(env):
    """A cut output leaves the state mid-grammar (num_accepted = output length); a grammar stop token that
    the caller did not list as eos still ends the output."""
    (prompt, _), compiled, ref = env["cases"][0], env["grammars"][0], env["refs"][0]
    prop = OracleProposer(ref)
    dec = SpecDecoder(_runner(env), prop, K)
    state = compiled.state()
    res = dec.generate(prompt, 10, env["eos"], grammar=state)
    assert res.tokens == ref[:10] and state.num_accepted == 10 and not state.is_terminated()
    state = compiled.state()
    res = dec.generate(prompt, MAX_NEW, None, grammar=state)  # no eos given: the grammar's stop token ends it
    assert res.tokens == ref and state.is_terminated()


# ----------------------------------------------------------------------------------------------- eval
@pytest.mark.slow
def test_evaluate_reports_grammar_and_valid_fraction(env, tmp_path):
    from drafttrain.config import DecodeConfig
    from drafttrain.evaluation import evaluate
    from drafttrain.io import read_json

    examples = [e for e in builtin_structured_examples(limit=60, seed=0, max_string_length=8)
                if len(e.schema["properties"]["arguments"]["properties"]) <= 2][:2]
    prompts = [e.prompt_ids(env["tok"]) for e in examples]
    decode = DecodeConfig(method="eagle3", num_draft_tokens=3, max_new_tokens=MAX_NEW, warmup=0, sweep_prompts=0,
                          plot=False, num_prompts=2)
    common = dict(method="eagle3", target_name="tiny", drafter_name=None, taps=env["taps"])
    prop = Eagle3ChainProposer(_eagle3(env), max_len=1024)
    rep = evaluate(env["model"], env["tok"], prompts, prop, decode, tmp_path, **common,
                   grammars=grammar_plan(None, examples, 2))
    assert rep["grammar"] == "json_schema:per-row" and rep["valid_fraction"] == 1.0
    assert rep["baseline_valid_fraction"] == 1.0 and rep["outputs_match_baseline"] is True
    assert read_json(tmp_path / "report.json")["valid_fraction"] == 1.0
    # decode.grammar=none on the same rows: unconstrained, still validated (the tiny target writes no JSON)
    decode.max_new_tokens = 40
    rep = evaluate(env["model"], env["tok"], prompts[:1], prop, decode, None, **common,
                   grammars=grammar_plan("none", examples, 1))
    assert rep["grammar"] is None and rep["valid_fraction"] == 0.0 and rep["invalid_outputs"]
    # a regex for every prompt via decode.grammar
    decode.grammar = f"regex:{DIGITS}"
    rep = evaluate(env["model"], env["tok"], prompts[:1], prop, decode, None, **common)
    assert rep["grammar"] == f"regex:{DIGITS}" and rep["valid_fraction"] == 1.0 and rep["outputs_match_baseline"]


def test_structured_training_data_from_the_target(env, tmp_path):
    """answer_with_target: the target's own constrained answers (== the constrained AR reference), written as
    rows that read back both as structured eval rows and as chat training data with assistant loss masks."""
    from drafttrain.data.chat import read_conversations, tokenize_conversation
    from drafttrain.structured import answer_with_target, read_structured_jsonl, write_structured_jsonl

    examples = [e for e in builtin_structured_examples(limit=60, seed=0, max_string_length=8)
                if len(e.schema["properties"]["arguments"]["properties"]) <= 2][:2]
    rows = answer_with_target(env["model"], env["tok"], examples, max_new_tokens=MAX_NEW)
    assert len(rows) == 2
    for row, ref in zip(rows, env["refs"]):
        answer = row.messages[-1]
        assert answer["role"] == "assistant" and row.check(answer["content"]) is None
        assert answer["content"] == decode_output(env["tok"], ref, [env["eos"]])
    assert answer_with_target(env["model"], env["tok"], examples[:1], max_new_tokens=5) == []  # cut: left out
    path = tmp_path / "structured_train.jsonl"
    write_structured_jsonl(path, rows)
    back = read_structured_jsonl(path)
    assert [b.schema for b in back] == [r.schema for r in rows] and back[0].prompt_messages == examples[0].messages
    convs = read_conversations(path)
    enc = tokenize_conversation(env["tok"], convs[0], max_length=None)
    assert sum(enc["loss_mask"]) > 0


def test_grammar_plan_and_eval_data(tmp_path):
    import json

    from drafttrain.config import DataConfig
    from drafttrain.evaluation import eval_conversations
    from drafttrain.io import DraftTrainError

    rows = builtin_structured_examples(limit=3, seed=0, max_string_length=8)
    plan = grammar_plan(None, rows, 2)
    assert plan.label == "json_schema:per-row" and [s.schema for s in plan.decode] == [r.schema for r in rows[:2]]
    assert plan.check == plan.decode
    plan = grammar_plan("json", rows, 3)
    assert plan.label == "json" and all(s.kind == "json" for s in plan.decode + plan.check)
    plan = grammar_plan("none", rows, 3)
    assert plan.label is None and plan.decode == [None] * 3 and plan.check[0].schema == rows[0].schema
    plain = grammar_plan(None, [[{"role": "user", "content": "x"}]], 1)
    assert not plain.constrained and not plain.validated
    with pytest.raises(DraftTrainError, match="decode.grammar"):
        grammar_plan("regex:", rows, 1)
    # data.source=structured: the built-in set, or user JSONL with a schema per row
    ex = eval_conversations(DataConfig(source="structured", num_eval=4, structured_max_string_length=8))
    assert len(ex) == 4 and all(e.schema["properties"]["arguments"]["properties"] for e in ex)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "n?"}], "schema": {"type": "integer"}}) + "\n")
    ex = eval_conversations(DataConfig(source="structured", path=str(path)))
    assert len(ex) == 1 and ex[0].schema == {"type": "integer"}
    with pytest.raises(DraftTrainError, match="structured"):
        eval_conversations(DataConfig(source="nope"))


# ------------------------------------------------------------- sampling: the constrained distribution
# A 5-token toy vocabulary ("a", "b", "c", "ab", eos) with a regex, so the exact law of the constrained
# output can be computed from the toy target's table, with the grammar's masks written out independently.
TOY_TEXT = ["a", "b", "c", "ab"]
TOY_EOS = 4
TOY_REGEX = r"[ab]{0,2}c[ab]*"
TOY_PREFIX = re.compile(r"[ab]{0,2}(c[ab]*)?")  # every prefix of the language
TOY_NEW = 4


@pytest.fixture(scope="module")
def toy_grammar():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(TOY_TEXT + ["<e>"])}, merges=[("a", "b")]))
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<e>")
    return compile_grammar(f"regex:{TOY_REGEX}", tok, 5, stop_token_ids=[TOY_EOS])


def toy_allowed(text: str) -> torch.Tensor:
    """The grammar's mask after ``text``, from Python's re (not xgrammar)."""
    ok = [TOY_PREFIX.fullmatch(text + t) is not None for t in TOY_TEXT]
    return torch.tensor(ok + [re.fullmatch(TOY_REGEX, text) is not None])


def toy_constrained_law(target: TreeToyLM, T, k, p, wrong_order=False) -> dict[tuple, float]:
    """Exact P(output) for outputs of up to TOY_NEW tokens (ending early at eos) under the constrained target:
    logits masked by the grammar, then temperature / top-k / top-p (``wrong_order``: processed first, then
    masked and renormalised -- a different distribution, for the power check)."""
    law: dict[tuple, float] = {}

    def walk(prev, cur, text, seq, prob):
        if len(seq) == TOY_NEW or (seq and seq[-1] == TOY_EOS):
            law[tuple(seq)] = law.get(tuple(seq), 0.0) + prob
            return
        logits, allowed = target.table[prev, cur].double(), toy_allowed(text)
        if wrong_order:
            d = process_logits(logits, T, k, p).double() * allowed
            d = d / d.sum()
        else:
            d = process_logits(logits.masked_fill(~allowed, float("-inf")), T, k, p).double()
        for y in range(5):
            if d[y] > 0:
                walk(cur, y, text + (TOY_TEXT[y] if y < 4 else ""), seq + [y], prob * float(d[y]))

    walk(TOY_PROMPT[-2], TOY_PROMPT[-1], "", [], 1.0)
    return law


def _chi2_pvalue(counts: Counter, law: dict) -> float:
    assert not set(counts) - set(law), f"an output of probability 0 was generated: {set(counts) - set(law)}"
    keys = sorted(law)
    obs = np.array([counts.get(key, 0) for key in keys], float)
    exp = np.array([law[key] for key in keys]) * obs.sum()
    big = exp >= 5
    o, e = list(obs[big]), list(exp[big])
    if (~big).any():
        o.append(obs[~big].sum())
        e.append(exp[~big].sum())
    e = np.asarray(e) * (sum(o) / sum(e))
    return float(stats.chisquare(o, e).pvalue)


def _toy_proposer(name):
    """(proposer, target taps, K). Grammar-aware: draft model (masked q), EAGLE-3 and Medusa (chain and
    tree); not: prompt lookup (chain cut by the engine) and the stub tree (pruned by the engine)."""
    if name == "draft_model":
        return DraftModelProposer(TreeToyLM(5, seed=2)), None, 2  # a deliberately different q
    if name == "prompt_lookup":
        return PromptLookupProposer(max_ngram=2, num_tokens=2), None, 2
    if name == "eagle3":
        return Eagle3ChainProposer(toy_eagle3(), max_len=32), (0, 1, 1), 2
    if name == "eagle3_tree":
        return Eagle3TreeProposer(toy_eagle3(), max_len=32, depth=3, top_k=2, total_tokens=5), (0, 1, 1), 3
    if name == "medusa_tree":
        return MedusaTreeProposer(_toy_heads(), [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]), (1,), 3
    ref = [0, 1, 2, 3, 4, 0, 1]  # a fixed guess per position (deterministic: still lossless)
    return StubTreeProposer(ref, lambda j: True, 5, branching=2), None, 3


@functools.lru_cache(maxsize=None)  # the power check reuses a case's samples
def _toy_counts(toy_grammar, name, T, k, p, n, seed):
    target = TreeToyLM(5, seed=1)  # follows tree attention masks (a node's context is its parent)
    proposer, taps, depth = _toy_proposer(name)
    runner = TargetRunner(target, taps=taps, max_len=32)
    dec = SpecDecoder(runner, proposer, depth, temperature=T, top_k=k, top_p=p, seed=seed)
    counts: Counter = Counter()
    drafted = accepted = 0
    for _ in range(n):
        res = dec.generate(TOY_PROMPT, TOY_NEW, grammar=toy_grammar.state())
        counts[tuple(res.tokens)] += 1
        drafted, accepted = drafted + res.num_drafted, accepted + res.num_accepted
    return counts, target, accepted / max(drafted, 1)


TOY_CASES = [
    ("draft_model", 1.0, 0, 1.0),
    ("draft_model", 0.8, 3, 1.0),
    ("prompt_lookup", 0.7, 0, 0.9),
    ("eagle3", 1.0, 0, 1.0),
    ("eagle3_tree", 1.0, 0, 0.8),
    ("medusa_tree", 0.7, 3, 1.0),
    ("stub_tree", 0.8, 0, 0.9),
]


def test_toy_grammar_masks_match_python_re(toy_grammar):
    g = toy_grammar.state()
    text = ""
    for t in [0, 2, 3, 1, TOY_EOS]:
        assert torch.equal(g.allowed_mask(), toy_allowed(text)), text
        assert g.advance([t])
        text += TOY_TEXT[t] if t < 4 else ""
    assert g.is_terminated()


@pytest.mark.slow
@pytest.mark.parametrize("name,T,k,p", TOY_CASES)
def test_sampling_preserves_constrained_distribution(toy_grammar, name, T, k, p):
    torch.set_num_threads(1)
    counts, target, alpha = _toy_counts(toy_grammar, name, T, k, p, n=600, seed=100)
    assert 0.05 < alpha < 0.95  # both accepted and rejected drafts are exercised
    law = toy_constrained_law(target, T, k, p)
    assert sum(law.values()) == pytest.approx(1.0)
    assert any(len(s) < TOY_NEW for s in counts)  # some outputs ended early at the grammar's stop token
    assert _chi2_pvalue(counts, law) > 1e-3


@pytest.mark.slow
def test_constrained_distribution_check_has_power(toy_grammar):
    """The same samples against the law of the wrong order (top-k before the mask) are rejected."""
    torch.set_num_threads(1)
    counts, target, _ = _toy_counts(toy_grammar, "draft_model", 0.8, 3, 1.0, n=600, seed=100)
    wrong = toy_constrained_law(target, 0.8, 3, 1.0, wrong_order=True)
    right = toy_constrained_law(target, 0.8, 3, 1.0)
    assert max(abs(wrong.get(s, 0) - right.get(s, 0)) for s in set(wrong) | set(right)) > 0.02
    bad = set(counts) - set(wrong)
    assert bad or _chi2_pvalue(counts, wrong) < 1e-4
