"""Tree speculative decoding: structure, verification rules (greedy / lossless sampling / lossy typical), tree
verification in the target with the static and dynamic caches, Medusa chain and tree proposers, the EAGLE-3
dynamic tree, cache compaction, the static-shape path, and χ² tests on a toy vocabulary. CPU only (the CUDA
graph path has its own marked test)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch import nn

from drafttrain.decoding import (
    DEFAULT_MEDUSA_CHOICES,
    DraftTree,
    Eagle3ChainProposer,
    Eagle3TreeProposer,
    MedusaChainProposer,
    MedusaTreeProposer,
    NoDraft,
    PromptLookupProposer,
    PromptLookupTreeProposer,
    SpecDecoder,
    StubTreeProposer,
    TargetRunner,
    aggregate,
    ancestor_mask,
    medusa_choices_from_accuracy,
    medusa_topk_accuracy,
    medusa_tree,
    verify_tree_greedy,
    verify_tree_sampling,
    verify_tree_typical,
)
from drafttrain.decoding import engine as engine_mod
from drafttrain.decoding.tree import DEFAULT_MEDUSA_ACCURACY, expected_accepted_length, typical_threshold
from drafttrain.drafters.medusa import MedusaHeads

from .test_decoding import (
    COMMON,
    L,
    N_NEW,
    PROMPT_LEN,
    TAPS,
    TOY_NEW,
    TOY_PROMPT,
    TOY_V,
    V,
    ToyLM,
    _check_law,
    build,
    full_forward,
    simulate,
    toy_eagle3,
    toy_law,
)

ARCH_NAMES = ["llama", "qwen2", "mistral"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add overhead


@pytest.fixture(scope="module", params=ARCH_NAMES)
def setup(request):
    return build(request.param)


@pytest.fixture(scope="module")
def llama():
    return build("llama")


def medusa_heads(model, seed=0, num_heads=4) -> MedusaHeads:
    """Heads initialised from the target's LM head with random blocks: non-trivial, sometimes right."""
    torch.manual_seed(seed)
    heads = MedusaHeads.from_target(model, num_heads=num_heads)
    with torch.no_grad():
        for b in heads.blocks:
            for layer in b.layers:
                layer.weight.normal_(0, 0.3)
    return heads.eval()


# -------------------------------------------------------------------------------------------- structure
def test_tree_structure_and_mask():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    t = DraftTree([10, 11, 12, 13, 14], [0, 0, 1, 1, 2])
    assert t.depths() == [0, 1, 1, 2, 2, 2] and t.depth == 2
    assert t.children() == [[1, 2], [3, 4], [5], [], [], []]
    assert t.path_to(4) == [1, 4] and t.path_to(0) == []
    m = ancestor_mask(t.all_parents())
    expect = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}}
    for i in range(6):
        assert set(torch.nonzero(m[i]).flatten().tolist()) == expect[i]
    p = t.prune(max_depth=1, max_nodes=10)
    assert p.tokens == [10, 11] and p.parents == [0, 0]
    p = t.prune(max_depth=5, max_nodes=3)
    assert p.tokens == [10, 11, 12] and p.parents == [0, 0, 1]
    assert DraftTree.chain([5, 6, 7]).parents == [0, 1, 2]
    with pytest.raises(ValueError):
        DraftTree([1, 1], [0, 0])  # duplicate siblings would break the recursive rejection
    with pytest.raises(ValueError):
        DraftTree([1, 2], [0, 2])  # a parent after its child


def test_medusa_tree_from_choices():
    st = medusa_tree([[1], [0, 0], [0], [0, 1], [0, 0, 0]])
    assert st.choices == [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    assert st.parents == [0, 0, 1, 1, 3] and st.heads == [0, 0, 1, 1, 2] and st.ranks == [0, 1, 0, 1, 0]
    assert st.topk == [2, 2, 1]
    for bad in ([[0, 0]], [[0], [0]], [[]], [[-1]]):
        with pytest.raises(ValueError):
            medusa_tree(bad)
    with pytest.raises(ValueError):
        medusa_tree([[0], [0, 0], [0, 0, 0]], num_heads=2)


def test_medusa_choices_from_accuracy_is_optimal():
    acc = [[0.6, 0.2], [0.4, 0.35], [0.3, 0.1]]
    all_paths = [p for d in (1, 2, 3) for p in itertools.product(range(2), repeat=d)]
    for n in (1, 3, 5, 7):
        best = max(
            expected_accepted_length([list(p) for p in sub], acc)
            for sub in itertools.combinations(all_paths, n)
            if all(len(p) == 1 or p[:-1] in sub for p in sub)  # prefix-closed trees only
        )
        chosen = medusa_choices_from_accuracy(acc, n)
        assert len(chosen) == n
        medusa_tree(chosen)  # valid (prefix-closed)
        assert expected_accepted_length(chosen, acc) == pytest.approx(best)
    assert medusa_choices_from_accuracy(DEFAULT_MEDUSA_ACCURACY, 24) == DEFAULT_MEDUSA_CHOICES
    assert max(len(c) for c in medusa_choices_from_accuracy(acc, 20, max_depth=2)) == 2


def test_prompt_lookup_tree_merges_matches():
    ctx = [1, 2, 5, 6, 9, 1, 2, 5, 7, 8, 1, 2, 3, 4, 0, 1, 2]  # bigram (1, 2) at 0, 5, 10 and at the end
    t = PromptLookupTreeProposer(max_ngram=2, num_tokens=3, max_branches=3).propose_tree(ctx, 3, 20, None)
    # first branch = the chain proposer's draft; shared prefixes (5) are merged
    chain, _ = PromptLookupProposer(max_ngram=2, num_tokens=3).propose(ctx, 3, None)
    assert [t.tokens[i - 1] for i in t.path_to(3)] == chain == [3, 4, 0]
    assert t.tokens == [3, 4, 0, 5, 7, 8, 6, 9] and t.parents == [0, 1, 2, 0, 4, 5, 4, 7]
    small = PromptLookupTreeProposer(max_ngram=2, num_tokens=3, max_branches=3).propose_tree(ctx, 2, 4, None)
    assert small.tokens == [3, 4, 5, 7] and small.depth == 2  # limits on depth and nodes
    assert PromptLookupTreeProposer().propose_tree([4, 5, 6], 3, 10, None).num_nodes == 0  # no match


def test_medusa_topk_accuracy():
    K, B, T, Vv = 2, 1, 6, 7
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    logits = torch.zeros(K, B, T, Vv)
    for t in range(T - 2):  # head 0 ranks the true token x_{t+2} first
        logits[0, 0, t, ids[0, t + 2]] = 5.0
    for t in range(T - 3):  # head 1 ranks it second
        logits[1, 0, t, (ids[0, t + 3] + 1) % Vv] = 5.0
        logits[1, 0, t, ids[0, t + 3]] = 4.0
    acc = medusa_topk_accuracy(logits, ids, topk=3)
    assert acc[0] == [1.0, 0.0, 0.0] and acc[1] == [0.0, 1.0, 0.0]


# ------------------------------------------------------------------------------------- verification rules
def test_verify_tree_greedy():
    t = DraftTree([10, 11, 12, 13, 14], [0, 0, 1, 1, 2])
    logits = torch.zeros(6, 20)

    def argmax_at(node, tok):
        logits[node] = 0
        logits[node, tok] = 1

    argmax_at(0, 11)  # node 2 matches
    argmax_at(2, 14)  # node 5 matches (leaf)
    argmax_at(5, 7)  # bonus
    argmax_at(1, 13)  # irrelevant: node 1 is not on the path
    assert verify_tree_greedy(t, logits) == ([2, 5], 7)
    argmax_at(0, 10)
    argmax_at(1, 3)  # no child of node 1 holds 3: correction
    assert verify_tree_greedy(t, logits) == ([1], 3)
    argmax_at(0, 9)
    assert verify_tree_greedy(t, logits) == ([], 9)
    assert verify_tree_greedy(DraftTree([], []), logits[:1]) == ([], 9)


def _round_law(tree: DraftTree, p: torch.Tensor) -> dict:
    """Exact law of one round's committed tokens when each token is drawn from the target at the node it
    continues, stopping at the first token that leaves the tree (or after the bonus at a leaf)."""
    law = {}
    ch, toks = tree.children(), tree.tokens

    def walk(node, prefix, prob):
        for x in range(p.shape[1]):
            px = float(p[node, x])
            if px == 0:
                continue
            child = next((c for c in ch[node] if toks[c - 1] == x), None)
            if child is None:
                law[prefix + (x,)] = law.get(prefix + (x,), 0.0) + prob * px
            else:
                walk(child, prefix + (x,), prob * px)

    walk(0, (), 1.0)
    return law


def _chi2_dict(counts: dict, law: dict) -> float:
    from scipy import stats

    assert all(k in law for k in counts), "an outcome of probability 0 occurred"
    keys = list(law)
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    exp = np.array([law[k] for k in keys]) * obs.sum()
    big = exp >= 5
    o, e = list(obs[big]), list(exp[big])
    if (~big).any():
        o.append(obs[~big].sum())
        e.append(exp[~big].sum())
    e = np.array(e) * (sum(o) / sum(e))
    return float(stats.chisquare(o, e).pvalue)


@pytest.mark.slow
def test_verify_tree_sampling_is_exact_per_round():
    g = torch.Generator().manual_seed(5)
    Vs = 5
    t = DraftTree([2, 0, 4, 1, 3, 2], [0, 0, 0, 1, 1, 4])  # three root children, a depth-3 path
    p = torch.rand(7, Vs, generator=g) ** 2
    p[1, 4] = 0.0  # a child token with zero probability
    p = p / p.sum(-1, keepdim=True)
    law = _round_law(t, p)
    assert sum(law.values()) == pytest.approx(1.0)
    counts: dict = {}
    for _ in range(12000):
        path, b = verify_tree_sampling(t, p, g)
        seq = tuple(t.tokens[i - 1] for i in path) + (b,)
        counts[seq] = counts.get(seq, 0) + 1
    assert _chi2_dict(counts, law) > 1e-3
    # every child covering the whole mass: the walk still ends with a valid token
    p1 = torch.zeros(7, Vs)
    p1[:, 2] = 1.0
    assert verify_tree_sampling(DraftTree([2], [0]), p1[:2], g) == ([1], 2)


def test_verify_tree_sampling_broken_rule_is_detected():
    """Negative control: accepting a child with its plain probability p(x) (no renormalisation after the
    rejected siblings) changes the law, and the same χ² check catches it."""
    g = torch.Generator().manual_seed(6)
    t = DraftTree([2, 0, 4], [0, 0, 0])
    p = torch.tensor([[0.1, 0.1, 0.4, 0.1, 0.3]] * 4)
    law = _round_law(t, p)
    counts: dict = {}
    for _ in range(6000):
        b = None
        for c in (1, 2, 3):
            if float(torch.rand(1, generator=g)) < float(p[0, t.tokens[c - 1]]):  # no renormalisation
                b = t.tokens[c - 1]
                seq = (b, int(torch.multinomial(p[c], 1, generator=g)))
                break
        if b is None:
            rest = p[0].clone()
            rest[[2, 0, 4]] = 0
            seq = (int(torch.multinomial(rest / rest.sum(), 1, generator=g)),)
        counts[seq] = counts.get(seq, 0) + 1
    assert _chi2_dict(counts, law) < 1e-4


def test_typical_acceptance_rule():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25], [0.9, 0.05, 0.03, 0.02]])
    thr = typical_threshold(p, 0.09, 0.3)
    ent = -(p * p.log()).sum(-1)
    torch.testing.assert_close(thr, torch.minimum(torch.full_like(ent, 0.09), 0.3 * torch.exp(-ent)))
    t = DraftTree([1, 3, 0], [0, 0, 1])  # node 1 (token 1, p=.3 ok), node 2 (token 3, p=.05 < thr), node 3
    g = torch.Generator().manual_seed(0)
    path, b = verify_tree_typical(t, p[[0, 1, 1, 2]], 0.09, 0.3, g)
    assert path == [1, 3] and 0 <= b < 4


# --------------------------------------------------------------------------------- greedy equality with AR
def _tree_proposers(s):
    heads = medusa_heads(s.model)
    return {
        "eagle3_tree": (Eagle3TreeProposer(s.drafter, max_len=256, depth=4, top_k=3, total_tokens=10), 4, TAPS),
        "medusa_chain": (MedusaChainProposer(heads), 3, (L,)),
        "medusa_tree": (MedusaTreeProposer(heads), 4, (L,)),
        "stub_tree_always": (StubTreeProposer(s.ar, lambda j: True, V, branching=3), 4, None),
        "stub_tree_sometimes": (StubTreeProposer(s.ar, lambda j: j % 5 not in (2, 4), V), 3, None),
        "stub_tree_never": (StubTreeProposer(s.ar, lambda j: False, V), 2, None),
        "pld_tree": (PromptLookupTreeProposer(max_ngram=2, num_tokens=4, max_branches=3, max_nodes=10), 4, None),
    }


@pytest.mark.parametrize("name", ["eagle3_tree", "medusa_chain", "medusa_tree", "stub_tree_always",
                                  "stub_tree_sometimes", "stub_tree_never", "pld_tree"])
def test_greedy_equals_ar(setup, name):
    prop, K, taps = _tree_proposers(setup)[name]
    runner = TargetRunner(setup.model, taps=taps, max_len=256)
    assert runner.cache_kind == "static"
    res = SpecDecoder(runner, prop, K).generate(setup.prompt, N_NEW)
    assert res.tokens == setup.ar, (name, setup.arch)
    assert runner.length == PROMPT_LEN + N_NEW - 1  # committed minus the pending token: nothing stale
    assert res.num_accepted <= res.num_drafted <= K * res.num_rounds
    if name.startswith("stub_tree"):
        agree = {"always": lambda j: True, "never": lambda j: False,
                 "sometimes": lambda j: j % 5 not in (2, 4)}[name.rsplit("_", 1)[1]]
        rounds, acc, reached, drafted = simulate(agree, N_NEW, K)
        assert res.num_rounds == rounds and res.accepted_per_position == acc
        assert res.reached_per_position == reached and res.drafted_per_position == drafted
        if name == "stub_tree_always":  # tau = K + 1 on every full round
            assert rounds == math.ceil((N_NEW - 1) / (K + 1))
            assert aggregate([res])["acceptance_per_position"] == [1.0] * K
        if name == "stub_tree_never":
            assert res.tau == 1.0
        assert res.num_tree_nodes > res.num_drafted  # wrong siblings were verified too


def test_greedy_tree_with_dynamic_cache(llama):
    """The DynamicCache fallback also verifies trees (4D mask, compaction by index_select)."""
    for prop, K, taps in list(_tree_proposers(llama).values())[:3]:
        runner = TargetRunner(llama.model, taps=taps, max_len=256, cache="dynamic")
        res = SpecDecoder(runner, prop, K).generate(llama.prompt, N_NEW)
        assert res.tokens == llama.ar and runner.cache.get_seq_length() == PROMPT_LEN + N_NEW - 1


@pytest.mark.slow
def test_static_shapes_path_matches(setup):
    """The padded, static-shape forward (the CUDA-graph path) runs eagerly on CPU with the same outputs."""
    for name in ("eagle3_tree", "stub_tree_sometimes", "medusa_chain"):
        prop, K, taps = _tree_proposers(setup)[name]
        runner = TargetRunner(setup.model, taps=taps, max_len=256, static_shapes=True, buckets=(1, 4, 16))
        assert runner.static_shapes
        res = SpecDecoder(runner, prop, K).generate(setup.prompt, N_NEW)
        assert res.tokens == setup.ar, name
    runner = TargetRunner(setup.model, max_len=256, static_shapes=True, buckets=(4,))
    assert SpecDecoder(runner, NoDraft(), 0).generate(setup.prompt, N_NEW).tokens == setup.ar
    # the EAGLE-3 draft steps with static shapes (whole-buffer attention under a mask) draft the same tokens
    runner = TargetRunner(setup.model, taps=TAPS, max_len=256, static_shapes=True, buckets=(1, 4, 16))
    for eager, static in [
        (Eagle3ChainProposer(setup.drafter, max_len=256), Eagle3ChainProposer(setup.drafter, max_len=256,
                                                                                static_shapes=True)),
        (Eagle3TreeProposer(setup.drafter, max_len=256, depth=4, top_k=3, total_tokens=10),
         Eagle3TreeProposer(setup.drafter, max_len=256, depth=4, top_k=3, total_tokens=10, static_shapes=True)),
    ]:
        a = SpecDecoder(setup.runner if not getattr(eager, "tree", False) else TargetRunner(
            setup.model, taps=TAPS, max_len=256), eager, 4).generate(setup.prompt, N_NEW)
        b = SpecDecoder(runner, static, 4).generate(setup.prompt, N_NEW)
        assert a.tokens == b.tokens == setup.ar
        assert a.accepted_per_position == b.accepted_per_position and a.num_tree_nodes == b.num_tree_nodes


@pytest.mark.slow
def test_builtin_target_tree_methods(tiny_builtin_target):
    from transformers import AutoModelForCausalLM

    from drafttrain.drafters.eagle3 import Eagle3Drafter

    model = AutoModelForCausalLM.from_pretrained(tiny_builtin_target).eval()
    Vt, nl = model.config.vocab_size, model.config.num_hidden_layers
    taps = (2, nl // 2, nl - 3)
    torch.manual_seed(0)
    vd = 512
    d2t = torch.zeros(vd, dtype=torch.long)  # draft vocabulary = the first 512 ids
    t2d = torch.zeros(Vt, dtype=torch.bool)
    t2d[:vd] = True
    drafter = Eagle3Drafter.from_target(model, taps, d2t, t2d).eval()
    prompt = torch.randint(10, Vt, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    n_new = 32
    ar = SpecDecoder(TargetRunner(model, max_len=128), NoDraft(), 0).generate(prompt, n_new).tokens
    heads = medusa_heads(model, num_heads=3)
    cases = [
        (Eagle3TreeProposer(drafter, max_len=128, depth=4, top_k=4, total_tokens=12), 4, taps),
        (Eagle3ChainProposer(drafter, max_len=128), 4, taps),
        (MedusaChainProposer(heads), 3, (nl,)),
        (MedusaTreeProposer(heads, [[0], [1], [0, 0], [1, 0], [0, 0, 0]]), 3, (nl,)),
        (StubTreeProposer(ar, lambda j: True, Vt, branching=2), 5, None),
    ]
    for prop, K, tp in cases:
        runner = TargetRunner(model, taps=tp, max_len=128)
        res = SpecDecoder(runner, prop, K).generate(prompt, n_new)
        assert res.tokens == ar, prop.name
        assert runner.length == len(prompt) + n_new - 1
    assert res.tau == pytest.approx((n_new - 1) / math.ceil((n_new - 1) / 6))  # the oracle tree: K + 1


# ----------------------------------------------------------------------------------- EAGLE-3 dynamic tree
class RecordingEagle3Tree(Eagle3TreeProposer):
    """Records its second proposal (after one verify/accept cycle)."""

    def propose_tree(self, tokens, max_depth, max_nodes, sampling):
        self.calls = getattr(self, "calls", 0) + 1
        snapshot = (self.cache.length, self._next_logits.clone(), self._next_hidden.clone())
        tree = super().propose_tree(tokens, max_depth, max_nodes, sampling)
        if self.calls == 2:
            self.snapshot, self.last_tree, self.last_tokens = snapshot, tree, list(tokens)
        return tree


def test_eagle3_tree_scores_equal_chain_recomputation(llama):
    """Every node's score is the sum of draft log-probabilities along its path, recomputed by plain chain
    steps in a fresh cache (checks the tree mask, positions and hidden routing of the batched steps); the
    children of every node are among its parent's top-k."""
    prop = RecordingEagle3Tree(llama.drafter, max_len=256, depth=4, top_k=3, total_tokens=14)
    runner = TargetRunner(llama.model, taps=TAPS, max_len=256)
    dec = SpecDecoder(runner, prop, 4)
    dec.generate(llama.prompt, 12)  # the second proposal is recorded
    tree, tokens = prop.last_tree, prop.last_tokens
    n, next_logits, next_hidden = prop.snapshot
    assert tree.num_nodes == 14 and tree.depth >= 3
    ids = prop._draft_ids
    d = llama.drafter
    _, taps = full_forward(llama.model, tokens[:-1], TAPS)
    for node in range(1, tree.num_nodes + 1):
        path = tree.path_to(node)
        cache = d.new_cache(1, 256)
        logits, h = d.step(torch.tensor([tokens[1:]]), d.fuse(taps.unsqueeze(0)), cache)
        torch.testing.assert_close(logits[0, -1], next_logits, atol=2e-4, rtol=2e-4)
        lg, hid, score = logits[0, -1], h[:, -1:], 0.0
        for depth, nd in enumerate(path):
            lp = torch.log_softmax(lg.float(), -1)
            tok = tree.tokens[nd - 1]
            draft_id = int((ids == tok).nonzero())
            assert draft_id in lp.topk(3).indices.tolist()
            score += float(lp[draft_id])
            if depth + 1 < len(path):
                out, hid = d.step(torch.tensor([[tok]]), hid, cache, position_ids=torch.tensor([[n + depth]]))
                lg = out[0, -1]
        assert tree.scores[node - 1] == pytest.approx(score, abs=1e-3)
    # reranking: the selected nodes are the best-scoring candidates, so no selected score is below a
    # never-selected child of a selected, expanded node... at least, scores never increase along a path
    par = tree.all_parents()
    assert all(tree.scores[i - 1] <= (tree.scores[par[i] - 1] if par[i] else 0.0) + 1e-6
               for i in range(1, tree.num_nodes + 1))


def test_eagle3_tree_with_top1_is_the_chain(setup):
    K = 4
    chain = SpecDecoder(setup.runner, Eagle3ChainProposer(setup.drafter, max_len=256), K).generate(setup.prompt, N_NEW)
    runner = TargetRunner(setup.model, taps=TAPS, max_len=256)
    tree = SpecDecoder(runner, Eagle3TreeProposer(setup.drafter, max_len=256, depth=K, top_k=1, total_tokens=K),
                       K).generate(setup.prompt, N_NEW)
    assert tree.tokens == chain.tokens == setup.ar
    assert tree.num_rounds == chain.num_rounds and tree.accepted_per_position == chain.accepted_per_position


# ---------------------------------------------------------------------------------------- cache compaction
def test_compaction_leaves_no_stale_entries(setup):
    """After tree rounds (wrong siblings written and discarded every round) the static cache's K/V at
    [0, length) equal a fresh prefill of the committed tokens, and the next logits equal a full forward."""
    runner = TargetRunner(setup.model, taps=None, max_len=256)
    prop = StubTreeProposer(setup.ar, lambda j: j % 4 != 3, V, branching=3)
    res = SpecDecoder(runner, prop, 3).generate(setup.prompt, 30)
    committed = setup.prompt + res.tokens
    n = len(committed) - 1
    assert runner.length == n and res.num_tree_nodes > 2 * res.num_drafted
    fresh = TargetRunner(setup.model, taps=None, max_len=256)
    fresh.forward(committed[:-1])
    for la, lb in zip(runner.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(la.keys[:, :, :n], lb.keys[:, :, :n], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(la.values[:, :, :n], lb.values[:, :, :n], atol=1e-5, rtol=1e-4)
    logits, _ = runner.forward(committed[-1:])
    ref, _ = full_forward(setup.model, committed)
    torch.testing.assert_close(logits[0], ref[-1], atol=1e-4, rtol=1e-4)


def test_runner_keep_and_truncate_by_index(llama):
    model = llama.model
    seq = llama.prompt + llama.ar[:10]
    r = TargetRunner(model, taps=TAPS, max_len=64)
    r.forward(seq[:15])
    # a 4-node tree after position 15: root=seq[15], children [junk, seq[16]], grandchild seq[17] under seq[16]
    logits, taps = r.forward_tree([seq[15], 7, seq[16], seq[17]], [-1, 0, 0, 2])
    ref_logits, ref_taps = full_forward(model, seq[:18], TAPS)
    for node, pos in ((0, 15), (2, 16), (3, 17)):
        torch.testing.assert_close(logits[node], ref_logits[pos], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(taps[node], ref_taps[pos], atol=1e-4, rtol=1e-4)
    r.keep([15, 17, 18], start=15)
    assert r.length == 18
    logits, _ = r.forward(seq[18:])
    ref, _ = full_forward(model, seq)
    torch.testing.assert_close(logits, ref[18:], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError):
        r.keep([3, 2], start=0)  # not ascending
    with pytest.raises(ValueError):
        r.keep([r.length], start=0)  # beyond the cache


# ---------------------------------------------------------------------- exact distribution (toy, V = 5)
class TreeToyLM(ToyLM):
    """ToyLM whose "previous token" of a query is read from the attention mask (the last visible slot before
    its own), so it follows tree masks: a tree node's context is its parent, not the slot before it."""

    def __init__(self, vocab, seed, **kw):
        super().__init__(vocab, seed, **kw)
        self.config._attn_implementation = "eager"
        self.lm_head = nn.Linear(1, vocab, bias=False)  # only so the runner recognises a causal LM

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, position_ids=None, attention_mask=None, cache=None, use_cache=True,
                output_hidden_states=False, logits_to_keep=0, **kw):
        ids = input_ids[0]
        n = ids.shape[0]
        keys = cache.update(ids.float().view(1, 1, n, 1), ids.float().view(1, 1, n, 1), 0)[0][0, 0, :, 0].long()
        kv = keys.shape[0]
        start = kv - n
        if isinstance(attention_mask, dict):
            attention_mask = attention_mask["full_attention"]
        slot = torch.arange(kv)
        own = start + torch.arange(n)
        allowed = slot[None] <= own[:, None] if attention_mask is None else attention_mask[0, 0] == 0
        before = allowed & (slot[None] < own[:, None])
        last = torch.where(before, slot[None], torch.full_like(slot[None], -1)).max(-1).values
        prev = torch.where(last >= 0, keys[last.clamp_min(0)], torch.full_like(last, self.V))
        logits = self.table[prev, ids].unsqueeze(0)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        hs = None
        if output_hidden_states:
            h = self.emb[prev, ids].unsqueeze(0)
            hs = (h, torch.tanh(h))
        from types import SimpleNamespace

        return SimpleNamespace(logits=logits, hidden_states=hs)


def _toy_heads(seed=4):
    torch.manual_seed(seed)
    heads = MedusaHeads(hidden_size=4, vocab_size=TOY_V, num_heads=3)
    with torch.no_grad():
        for h in heads.lm_heads:
            h.weight.normal_(0, 2.0)
    return heads.eval()


TOY_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def _toy_tree_proposer(name):
    if name == "medusa_tree":
        return MedusaTreeProposer(_toy_heads(), TOY_TREE), (1,), 3
    if name == "medusa_chain":
        return MedusaChainProposer(_toy_heads()), (1,), 2
    if name == "eagle3_tree":
        return Eagle3TreeProposer(toy_eagle3(), max_len=32, depth=3, top_k=2, total_tokens=5), (0, 1, 1), 3
    if name == "pld_tree":
        return PromptLookupTreeProposer(max_ngram=1, num_tokens=3, max_branches=2), None, 3
    ref = [0, 1, 2, 3, 4, 0, 1]  # a fixed guess, deterministic given the position: still lossless
    return StubTreeProposer(ref, lambda j: True, TOY_V, branching=2), None, 3


def _toy_tree_counts(name, T, k, p, n, seed):
    target = TreeToyLM(TOY_V, seed=1)
    prop, taps, K = _toy_tree_proposer(name)
    runner = TargetRunner(target, taps=taps, max_len=32)
    assert runner.cache_kind == "static"
    dec = SpecDecoder(runner, prop, K, temperature=T, top_k=k, top_p=p, seed=seed)
    counts = np.zeros((TOY_V,) * TOY_NEW)
    drafted = accepted = 0
    for _ in range(n):
        res = dec.generate(TOY_PROMPT, TOY_NEW)
        counts[tuple(res.tokens)] += 1
        drafted, accepted = drafted + res.num_drafted, accepted + res.num_accepted
    return counts, toy_law(target, T, k, p), accepted / max(drafted, 1)


TREE_TOY_CASES = [
    ("medusa_tree", 1.0, 0, 1.0),
    ("medusa_tree", 0.7, 3, 1.0),
    ("eagle3_tree", 1.0, 0, 0.8),
    ("stub_tree", 0.8, 3, 0.9),
    ("medusa_chain", 1.0, 0, 0.9),
    ("pld_tree", 0.9, 0, 1.0),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,T,k,p", TREE_TOY_CASES)
def test_tree_speculative_sampling_preserves_target_distribution(name, T, k, p):
    """The first 4 tokens are distributed exactly as the target's processed distribution (temperature,
    top-k, top-p): χ² against the exact law, through the static cache and tree masks of the runner."""
    counts, law, alpha = _toy_tree_counts(name, T, k, p, n=800 if name == "eagle3_tree" else 1000, seed=100)
    assert 0.05 < alpha < 0.95  # both accept and reject paths are exercised
    assert min(_check_law(counts, law)) > 1e-3


@pytest.mark.slow
def test_tree_distribution_check_has_power(monkeypatch):
    """Negative control: a verifier that draws the final token from p instead of the residual is caught."""

    def biased(tree, p, g):
        path, _ = verify_tree_sampling(tree, p, g)
        node = path[-1] if path else 0
        return path, int(torch.multinomial(p[node], 1, generator=g))

    monkeypatch.setattr(engine_mod, "verify_tree_sampling", biased)
    counts, law, _ = _toy_tree_counts("medusa_tree", 1.0, 0, 1.0, n=800, seed=100)
    assert min(_check_law(counts, law)) < 1e-4


def test_typical_acceptance_is_labelled_lossy(llama):
    heads = medusa_heads(llama.model)
    runner = TargetRunner(llama.model, taps=(L,), max_len=256)
    dec = SpecDecoder(runner, MedusaTreeProposer(heads), 4, temperature=0.8, typical=True, seed=0)
    res = dec.generate(llama.prompt, 20)
    assert res.lossy and aggregate([res])["lossy"] and len(res.tokens) == 20
    lossless = SpecDecoder(runner, MedusaTreeProposer(heads), 4, temperature=0.8, seed=0).generate(llama.prompt, 20)
    assert not lossless.lossy
    greedy = SpecDecoder(runner, MedusaTreeProposer(heads), 4, typical=True).generate(llama.prompt, N_NEW)
    assert not greedy.lossy and greedy.tokens == llama.ar  # greedy ignores the typical option


@pytest.mark.slow
def test_cpu_compiled_verify_matches_eager(llama):
    """compile=True on CPU (inductor, one shape per bucket) decodes exactly as the eager path."""
    runner = TargetRunner(llama.model, max_len=128, static_shapes=True, compile=True, buckets=(8,))
    assert runner._compiled is not None
    prop = StubTreeProposer(llama.ar, lambda j: j % 3 != 2, V, branching=2)
    res = SpecDecoder(runner, prop, 3).generate(llama.prompt, 20)
    assert res.tokens == llama.ar[:20] and res.num_rounds < 19


# ------------------------------------------------------------------------------------------- CUDA path
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_path_matches_eager():
    import transformers as tf

    from .test_decoding import make_drafter

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON)).eval()
    drafter = make_drafter(model).cuda()
    model.cuda()
    prompt = torch.randint(0, V, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    ar = SpecDecoder(TargetRunner(model, max_len=256), NoDraft(), 0).generate(prompt, N_NEW).tokens
    runner = TargetRunner(model, max_len=256, static_shapes=True, compile=True, buckets=(1, 8, 16), timing=False)
    assert runner._compiled is not None
    assert SpecDecoder(runner, NoDraft(), 0).generate(prompt, N_NEW).tokens == ar
    prop = StubTreeProposer(ar, lambda j: j % 3 != 2, V, branching=2)
    res = SpecDecoder(runner, prop, 4).generate(prompt, N_NEW)
    assert res.tokens == ar
    # EAGLE-3 draft steps captured too (static shapes + reduce-overhead), chain and tree
    runner = TargetRunner(model, taps=TAPS, max_len=256, static_shapes=True, compile=True, buckets=(1, 8, 16),
                          timing=False)
    for prop in (Eagle3ChainProposer(drafter, max_len=256, static_shapes=True, compile=True),
                 Eagle3TreeProposer(drafter, max_len=256, depth=4, top_k=3, total_tokens=12, static_shapes=True,
                                    compile=True)):
        assert SpecDecoder(runner, prop, 4).generate(prompt, N_NEW).tokens == ar


def test_tree_positions_after_an_accepted_stop_token_are_not_live(llama):
    """As for chains (tests/test_decoding.py): the depths of a round past an accepted stop token are counted as
    the verifier counts them, not in the report's per-depth acceptance."""
    s, K = llama, 4
    e = next(j for j in (7, 12, 17, 22, 27) if s.ar[j] not in s.ar[:j])  # the second depth of a round
    prop = StubTreeProposer(s.ar, lambda j: j <= e, V, branching=3)
    res = SpecDecoder(TargetRunner(s.model, max_len=256), prop, K).generate(s.prompt, N_NEW, eos_token_id=s.ar[e])
    assert res.tokens == s.ar[: e + 1]
    r = (e - 1) // (K + 1)
    assert res.reached_per_position == [r + 1] * 3 + [r] and res.accepted_per_position == [r + 1, r + 1, r, r]
    assert res.live_reached_per_position == res.live_accepted_per_position == [r + 1, r + 1, r, r]
    assert aggregate([res])["acceptance_per_position"] == [1.0] * K
