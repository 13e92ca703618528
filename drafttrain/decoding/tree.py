"""Token trees for speculative decoding: structure, tree attention masks, verification rules, Medusa trees.

A round's draft tree has ``n + 1`` nodes: node 0 is the root (the *pending* token: committed but not yet in
the target's cache) and nodes ``1..n`` are draft tokens. ``parents[i]`` is the parent of node i
(``parents[0] = -1``, ``parents[i] < i``: nodes are in topological order), so the target reads
``[pending] + draft tokens`` in one forward where node i sits at position ``L + depth(i)`` and attends to the
committed prefix plus its ancestors (:func:`ancestor_mask`). Siblings carry distinct tokens.

Verification walks from the root:

- greedy (:func:`verify_tree_greedy`): follow the child whose token is the target argmax; the path ends at
  a node none of whose children matches; the next token is the target argmax there.
- sampling (:func:`verify_tree_sampling`): EAGLE's multi-candidate recursive rejection for deterministic
  drafts (q = 1): at each node try the children in order, accepting child x with probability p(x) under the
  target distribution p renormalised after removing the children already rejected; if all are rejected,
  draw from what is left of p. Every emitted token is distributed exactly as p (the drafts being a
  deterministic function of the context), for any temperature / top-k / top-p.
- typical acceptance (:func:`verify_tree_typical`): Medusa's rule, accept x if ``p(x) > min(eps, delta *
  exp(-H(p)))``; **lossy** (does not preserve the target distribution); only used when asked for.

Host syncs: each rule gathers what the walk needs on the device and reads it with one ``.tolist()``.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .sampling import sample


# ------------------------------------------------------------------------------------------ structure
@dataclass
class DraftTree:
    """A proposer's draft tree: ``tokens[i]`` is node ``i + 1``; ``parents[i]`` its parent node (0 = root).

    ``scores`` (optional) are the proposer's own scores (e.g. cumulative draft log-probabilities).
    """

    tokens: list[int]
    parents: list[int]
    scores: list[float] | None = None
    _children: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.tokens = [int(t) for t in self.tokens]
        self.parents = [int(p) for p in self.parents]
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"tree: {len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not 0 <= p <= i:  # node i+1's parent is an earlier node
                raise ValueError(f"tree: node {i + 1} has parent {p} (must be in [0, {i}])")
        seen = set()
        for p, t in zip(self.parents, self.tokens):
            if (p, t) in seen:
                raise ValueError(f"tree: duplicate sibling token {t} under node {p}")
            seen.add((p, t))

    @property
    def num_nodes(self) -> int:
        """Draft nodes (the root excluded)."""
        return len(self.tokens)

    def all_parents(self) -> list[int]:
        """Parents of all ``n + 1`` nodes (root first, ``-1``)."""
        return [-1] + self.parents

    def depths(self) -> list[int]:
        return node_depths(self.all_parents())

    @property
    def depth(self) -> int:
        return max(self.depths(), default=0)

    def children(self) -> list[list[int]]:
        if self._children is None:
            ch: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
            for i, p in enumerate(self.parents):
                ch[p].append(i + 1)
            self._children = ch
        return self._children

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's child down to ``node`` (empty for the root)."""
        par = self.all_parents()
        out = []
        while node > 0:
            out.append(node)
            node = par[node]
        return out[::-1]

    def prune(self, max_depth: int, max_nodes: int) -> "DraftTree":
        """Keep nodes of depth <= ``max_depth``, then the first ``max_nodes`` of them (closed under parents
        because nodes are in topological order)."""
        d = self.depths()
        old_to_new = {0: 0}
        toks, pars, scs = [], [], []
        for i in range(self.num_nodes):
            node = i + 1
            if d[node] > max_depth or len(toks) >= max_nodes or self.parents[i] not in old_to_new:
                continue
            old_to_new[node] = len(toks) + 1
            toks.append(self.tokens[i])
            pars.append(old_to_new[self.parents[i]])
            if self.scores is not None:
                scs.append(self.scores[i])
        return DraftTree(toks, pars, scs if self.scores is not None else None)

    @staticmethod
    def chain(tokens: Sequence[int]) -> "DraftTree":
        return DraftTree(list(tokens), list(range(len(tokens))))


def node_depths(parents: Sequence[int] | Tensor) -> list[int]:
    """Depth of every node (root = 0) from ``parents`` (``parents[0] = -1``)."""
    par = parents.tolist() if isinstance(parents, Tensor) else list(parents)
    d = [0] * len(par)
    for i in range(1, len(par)):
        d[i] = d[par[i]] + 1
    return d


def ancestor_mask(parents: Sequence[int] | Tensor) -> Tensor:
    """Bool ``[n, n]``: ``m[i, j]`` iff node j is node i or one of its ancestors (the tree attention mask)."""
    par = parents.tolist() if isinstance(parents, Tensor) else list(parents)
    n = len(par)
    m = np.zeros((n, n), dtype=bool)
    for i in range(n):
        if par[i] >= 0:
            m[i] = m[par[i]]
        m[i, i] = True
    return torch.from_numpy(m)


# --------------------------------------------------------------------------------------- verification
def verify_tree_greedy(tree: DraftTree, target_logits: Tensor) -> tuple[list[int], int]:
    """Longest path of drafts equal to the target argmax.

    Args:
        target_logits: ``[n+1, V]``; row i predicts the token after node i (row 0: after the pending token).
    Returns:
        ``(path, next_token)``: accepted nodes (root's child first) and the target argmax after the last.
    """
    argmax = target_logits.argmax(-1).tolist()  # the round's one host sync
    ch, toks = tree.children(), tree.tokens
    node, path = 0, []
    while True:
        want = argmax[node]
        nxt = next((c for c in ch[node] if toks[c - 1] == want), None)
        if nxt is None:
            return path, int(want)
        path.append(nxt)
        node = nxt


def verify_tree_sampling(tree: DraftTree, target_probs: Tensor,
                         generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """EAGLE's multi-candidate recursive rejection over a tree of deterministic drafts (lossless).

    Args:
        target_probs: p ``[n+1, V]``, the target's processed distributions at every node.
    Returns:
        ``(path, next_token)``; the committed tokens ``[tokens on path] + [next_token]`` are distributed
        exactly as p applied token by token.
    """
    p = target_probs.float()
    dev = p.device
    n = tree.num_nodes
    if n:
        tok = torch.tensor(tree.tokens, dtype=torch.long, device=dev)
        par = torch.tensor(tree.parents, dtype=torch.long, device=dev)
        p_child = p[par, tok]  # [n] p(node token | parent)
        u = torch.rand(n, generator=generator, device=dev)
        resid = p.clone()
        resid[par, tok] = 0.0  # the residual at each node: p without its children
    else:
        p_child = u = p.new_zeros(0)
        resid = p
    mass = resid.sum(-1, keepdim=True)
    resid = torch.where(mass > 0, resid / mass.clamp_min(1e-30), p)  # every child holds all mass: rounding
    draws = sample(resid, generator)  # [n+1] a residual draw at every node
    host = torch.cat([p_child.double(), u.double(), draws.double()]).tolist()  # the round's one host sync
    pc, uu, dr = host[:n], host[n : 2 * n], [int(x) for x in host[2 * n :]]
    ch = tree.children()
    node, path = 0, []
    while True:
        left = 1.0
        for c in ch[node]:
            q = pc[c - 1]
            if uu[c - 1] * left < q:  # accept w.p. p(c) / (mass left after the rejected siblings)
                path.append(c)
                node = c
                break
            left -= q
        else:
            return path, dr[node]


def typical_threshold(probs: Tensor, epsilon: float, delta: float) -> Tensor:
    """Medusa's typical-acceptance threshold ``min(eps, delta * exp(-H(p)))`` per row of ``probs [..., V]``."""
    p = probs.float()
    ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    return torch.minimum(torch.full_like(ent, epsilon), delta * torch.exp(-ent))


def verify_tree_typical(tree: DraftTree, target_probs: Tensor, epsilon: float = 0.09, delta: float = 0.3,
                        generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Medusa's typical acceptance (LOSSY: the output is not distributed as the target's).

    A node is acceptable when its token has ``p(x) > min(eps, delta * exp(-H(p)))`` under its parent's
    distribution; the longest all-acceptable path wins (ties: highest product of p along the path); the
    next token is drawn from p at its last node.
    """
    p = target_probs.float()
    n = tree.num_nodes
    if n == 0:
        return [], int(sample(p[0], generator))
    tok = torch.tensor(tree.tokens, dtype=torch.long, device=p.device)
    par = torch.tensor(tree.parents, dtype=torch.long, device=p.device)
    thr = typical_threshold(p, epsilon, delta)
    pc = p[par, tok]
    ok = (pc > thr[par]).tolist()
    lp = torch.log(pc.clamp_min(1e-30)).tolist()
    par_l = tree.parents
    good = [True] + [False] * n
    score = [0.0] * (n + 1)
    depth = [0] * (n + 1)
    for i in range(n):
        node = i + 1
        good[node] = ok[i] and good[par_l[i]]
        score[node] = score[par_l[i]] + lp[i]
        depth[node] = depth[par_l[i]] + 1
    best = max((nd for nd in range(n + 1) if good[nd]), key=lambda nd: (depth[nd], score[nd]))
    return tree.path_to(best), int(sample(p[best], generator))


# --------------------------------------------------------------------------------------- Medusa trees
# Default static tree (paths of top-k ranks, Medusa's ``medusa_choices`` format): 24 nodes, depth <= 3, made
# by ``medusa_choices_from_accuracy(DEFAULT_MEDUSA_ACCURACY, 24)`` and frozen here.
DEFAULT_MEDUSA_ACCURACY = [  # P(rank-r candidate of head k is right), Medusa-1-like decay over heads
    [0.56, 0.12, 0.05, 0.03, 0.02],
    [0.32, 0.11, 0.05, 0.03, 0.02],
    [0.20, 0.09, 0.05, 0.03, 0.02],
    [0.15, 0.07, 0.04, 0.03, 0.02],
]


def medusa_choices_from_accuracy(accuracy, num_nodes: int, max_depth: int | None = None) -> list[list[int]]:
    """Pick a static Medusa tree from measured per-head top-k accuracy.

    ``accuracy[k][r]`` = P(the rank-r candidate of head k is the right token) (not cumulative; measure it
    with :func:`medusa_topk_accuracy`). Under Medusa's independence assumption a node (path of ranks
    ``[r_0, .., r_d]``) is accepted with probability ``prod_k accuracy[k][r_k]`` and the expected number of
    accepted tokens is the sum of that over the tree's nodes; since the value only decreases along a path,
    best-first selection of the ``num_nodes`` most probable paths is optimal (and closed under prefixes).
    Returns the paths sorted by (length, ranks).
    """
    acc = [list(map(float, row)) for row in accuracy]
    depth = len(acc) if max_depth is None else min(len(acc), int(max_depth))
    if depth <= 0 or num_nodes <= 0:
        return []
    heap = [(-acc[0][r], (r,)) for r in range(len(acc[0]))]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < num_nodes:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        d = len(path)
        if d < depth:
            for r in range(len(acc[d])):
                heapq.heappush(heap, (neg * acc[d][r], path + (r,)))
    return sorted((list(c) for c in chosen), key=lambda c: (len(c), c))


DEFAULT_MEDUSA_CHOICES = [
    [0], [1], [2], [3], [4], [0, 0], [0, 1], [0, 2], [0, 3], [0, 4], [1, 0], [1, 1], [1, 2], [2, 0], [2, 1],
    [3, 0], [4, 0], [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [1, 0, 0],
]


def expected_accepted_length(choices, accuracy) -> float:
    """Expected accepted drafts per round of a Medusa tree under the independence model (1 + this = tau)."""
    total = 0.0
    for c in choices:
        v = 1.0
        for k, r in enumerate(c):
            v *= float(accuracy[k][r]) if r < len(accuracy[k]) else 0.0
        total += v
    return total


@dataclass
class MedusaTree:
    """A static tree from Medusa choices: node i (1-based) takes rank ``ranks[i-1]`` of head ``heads[i-1]``."""

    choices: list[list[int]]
    parents: list[int]
    heads: list[int]
    ranks: list[int]

    @property
    def topk(self) -> list[int]:
        """How many candidates each head must provide (max rank + 1 per head)."""
        out = [0] * (max(self.heads) + 1 if self.heads else 0)
        for h, r in zip(self.heads, self.ranks):
            out[h] = max(out[h], r + 1)
        return out


def medusa_tree(choices: Sequence[Sequence[int]], num_heads: int | None = None) -> MedusaTree:
    """Validate and order Medusa choices; every proper prefix of a path must be a path too."""
    paths = [tuple(int(r) for r in c) for c in choices]
    if not paths:
        raise ValueError("medusa tree: no choices")
    if any(len(c) == 0 or min(c) < 0 for c in paths):
        raise ValueError("medusa tree: every choice is a non-empty list of ranks >= 0")
    if len(set(paths)) != len(paths):
        raise ValueError("medusa tree: duplicate choices")
    if num_heads is not None and max(len(c) for c in paths) > num_heads:
        raise ValueError(f"medusa tree: depth {max(len(c) for c in paths)} > {num_heads} heads")
    order = sorted(paths, key=lambda c: (len(c), c))
    index = {c: i + 1 for i, c in enumerate(order)}
    parents = []
    for c in order:
        if len(c) > 1 and c[:-1] not in index:
            raise ValueError(f"medusa tree: choice {list(c)} has no parent {list(c[:-1])}")
        parents.append(index[c[:-1]] if len(c) > 1 else 0)
    return MedusaTree([list(c) for c in order], parents, [len(c) - 1 for c in order], [c[-1] for c in order])


@torch.no_grad()
def medusa_topk_accuracy(head_logits: Tensor, input_ids: Tensor, mask: Tensor | None = None,
                         topk: int = 10) -> list[list[float]]:
    """Per-head rank accuracy ``acc[k][r]`` = P(rank-r candidate of head k is the token k+2 ahead).

    head_logits ``[K, B, T, V]`` (heads on the target's final hidden), input_ids ``[B, T]``, mask ``[B, T]``
    (1 = the token at that index counts as a label).
    """
    K, B, T, _ = head_logits.shape
    acc = []
    for k in range(K):
        s = k + 2
        if T <= s:
            acc.append([0.0] * topk)
            continue
        top = head_logits[k, :, : T - s].topk(topk, dim=-1).indices  # [B, T-s, topk]
        lab = input_ids[:, s:]
        valid = torch.ones_like(lab, dtype=torch.bool) if mask is None else mask[:, s:].bool()
        hit = (top == lab[..., None]) & valid[..., None]
        acc.append((hit.sum((0, 1)).float() / valid.sum().clamp_min(1)).tolist())
    return acc
