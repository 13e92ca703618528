"""SpecDecoder: chain speculative decoding (prefill / propose / verify / accept) plus its statistics.

Per sequence: the target prefills the prompt and produces the first new token (the *pending* token: it
is committed but not yet in the target's cache). Each round the proposer drafts d_1..d_k, the target runs
once on [pending, d_1..d_k], verification accepts d_1..d_a and yields one more target token b; the target
cache is rolled back by index to hold everything committed but b, which becomes the new pending token.
Autoregressive decoding is the same loop with ``NoDraft`` and K = 0 (one target forward per token).

Tree proposers (``proposer.tree``) draft a token tree instead; the target runs the whole tree in one
forward with a tree attention mask (``TargetRunner.forward_tree``), the tree verifier picks the accepted
path (greedy: longest matching path; sampling: EAGLE's recursive rejection, lossless for deterministic
drafts), and the target cache is compacted by index to hold the committed tokens only. For trees, K is the
maximum depth and "position i" is depth i + 1.

Statistics: a *round* is one target verify forward after the prefill; tau = mean over rounds of the
tokens the round committed (a + 1, less only when the round was cut by eos). The prefill's token is not
counted, so AR has tau = 1 exactly and a proposer that is always right has tau = K + 1.

Typical acceptance (``typical=True``, Medusa's rule) is LOSSY and only applies when sampling; results
carry ``lossy = True`` so reports can say so.

Grammar-constrained decoding (``generate(..., grammar=GrammarState)``, see ``drafttrain.structured``): the
target's logits are masked by the grammar at every verified position (before temperature / top-k / top-p),
so greedy speculative output equals greedy constrained AR output and sampling preserves the *constrained*
distribution. Drafts are made grammatical before verification: grammar-aware proposers
(``grammar_aware = True``: EAGLE-3, Medusa, draft model; chain and tree) mask their own draft distributions
with the same state (explored under ``GrammarState.scratch()``); any other proposer's chain is truncated at its
first ungrammatical token and its tree pruned of ungrammatical nodes. The masks for the verified positions
come from walking the drafts from the committed state (``masks_along`` / ``tree_masks``, which restore it),
and after verification the state is advanced over the committed tokens ``d_1..d_a, b`` only, so rejected
drafts never touch it. The state must have accepted every committed output token (the pending one
included); the output ends at a stop token of the grammar as at eos.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from ..io import DraftTrainError
from .proposers import Proposer
from .sampling import SamplingParams, sample, verify_chain_greedy, verify_chain_sampling
from .target import TargetRunner, _sync
from .tree import DraftTree, verify_tree_greedy, verify_tree_sampling, verify_tree_typical


@dataclass
class GenerationResult:
    """Output and statistics of one ``SpecDecoder.generate`` call.

    ``*_per_position`` lists have length K; position i is the i-th draft token of a round. A draft
    position is *reached* in a round when all earlier drafts of that round were accepted (what vLLM counts,
    ``accepted_per_position`` being the verifier's acceptances, as in vLLM's per-position metric). It is *live*
    when, in addition, none of those earlier drafts is a stop token: after an accepted stop token the output has
    ended, and the drafts past it can neither be used nor, judged against the target's continuation of a
    finished text, say anything about the drafter. ``live_accepted_per_position[i] /
    live_reached_per_position[i]`` estimates P(position i accepted | reached, output not ended), the
    conditional acceptance the report gives per position (counting the position after an accepted stop token
    as reached and rejected biases it down wherever answers end inside a round: on the built-in code target's
    short answers the third position read 0.69 instead of 0.75).
    """

    tokens: list[int]  # new tokens only; ends at eos (inclusive) or after max_new_tokens
    num_rounds: int = 0  # target verify forwards after the prefill
    num_round_tokens: int = 0  # tokens committed by rounds (all new tokens but the prefill's)
    num_drafted: int = 0
    num_accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    reached_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    live_reached_per_position: list[int] = field(default_factory=list)
    live_accepted_per_position: list[int] = field(default_factory=list)
    num_tree_nodes: int = 0  # draft nodes verified (= num_drafted for chains)
    lossy: bool = False  # typical acceptance was used: the output is not distributed as the target's
    time_total: float = 0.0
    time_target: float = 0.0
    time_draft: float = 0.0
    time_grammar: float = 0.0  # the decoder's own grammar work (masks along drafts, advancing); part of "other"

    @property
    def tau(self) -> float:
        """Mean tokens committed per round (1 for AR)."""
        return self.num_round_tokens / self.num_rounds if self.num_rounds else float("nan")

    def __post_init__(self) -> None:
        K = len(self.drafted_per_position)
        for name in ("live_reached_per_position", "live_accepted_per_position"):
            if not getattr(self, name):
                setattr(self, name, [0] * K)


class SpecDecoder:
    """Chain speculative decoder around a ``TargetRunner`` and a ``Proposer`` (batch size 1).

    Args:
        target: the target runner (its ``taps`` must be set when the proposer needs features).
        proposer: the draft proposer (``NoDraft`` with ``num_draft_tokens=0`` for AR).
        num_draft_tokens: K, the most drafts per round.
        temperature, top_k, top_p: the target's sampling; temperature 0 is greedy. Speculative output
            is distributed exactly as the target's processed distribution (identical to AR when greedy).
        seed: seeds the decoder's ``torch.Generator`` (drafts and verification share it).
        typical, typical_epsilon, typical_delta: Medusa's typical acceptance instead of rejection sampling
            (LOSSY; sampling only; greedy decoding ignores it).
        draft_temperature: when the target samples, the temperature a stochastic proposer drafts at (its
            top-k / top-p are the target's); ``None``: the target's. 0 drafts the argmax (one-hot q). Lossless at
            any value: verification uses the q the drafts were sampled from. Greedy decoding ignores it.
    """

    def __init__(
        self,
        target: TargetRunner,
        proposer: Proposer,
        num_draft_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        typical: bool = False,
        typical_epsilon: float = 0.09,
        typical_delta: float = 0.3,
        draft_temperature: float | None = None,
    ):
        if num_draft_tokens < 0:
            raise DraftTrainError(f"decode.num_draft_tokens={num_draft_tokens}: must be >= 0")
        if temperature < 0:
            raise DraftTrainError(f"decode.temperature={temperature}: must be >= 0")
        if top_k < 0:
            raise DraftTrainError(f"decode.top_k={top_k}: must be >= 0")
        if not 0.0 < top_p <= 1.0:
            raise DraftTrainError(f"decode.top_p={top_p}: must be in (0, 1]")
        self.target = target
        self.proposer = proposer
        self.K = int(num_draft_tokens)
        self.generator = torch.Generator(device=target.device)
        self.generator.manual_seed(seed)
        self.sampling = SamplingParams(float(temperature), int(top_k), float(top_p), self.generator)
        if draft_temperature is not None and draft_temperature < 0:
            raise DraftTrainError(f"decode.draft_temperature={draft_temperature}: must be >= 0")
        self.draft_sampling = self.sampling if draft_temperature is None or self.sampling.greedy else \
            SamplingParams(float(draft_temperature), int(top_k), float(top_p), self.generator)
        self.tree = bool(getattr(proposer, "tree", False))
        self.typical = bool(typical) and not self.sampling.greedy
        self.typical_epsilon, self.typical_delta = float(typical_epsilon), float(typical_delta)

    def _timed(self, fn, *args, **kwargs):
        timing = self.target.timing
        if timing:
            _sync(self.target.device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if timing:
            _sync(self.target.device)
        self._time_draft += time.perf_counter() - t0
        return out

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_token_id: int | Iterable[int] | None = None,
        seed: int | None = None,
        grammar=None,
    ) -> GenerationResult:
        """Decode up to ``max_new_tokens`` new tokens after ``prompt_ids`` (stops after an eos token).

        ``seed`` re-seeds the generator first; without it the generator's stream continues from the
        previous call. ``grammar``: a ``drafttrain.structured.GrammarState`` (usually fresh:
        ``compiled.state()``) that constrains the output; it is advanced over every new token, and its stop
        tokens end the output like eos (compile it with the decoder's eos set as stop tokens).
        """
        if seed is not None:
            self.generator.manual_seed(seed)
        eos = _stop_tokens(eos_token_id, grammar)
        K, target, proposer = self.K, self.target, self.proposer
        gkw = {"grammar": grammar} if grammar is not None and getattr(proposer, "grammar_aware", False) else {}
        res = GenerationResult(
            tokens=[], drafted_per_position=[0] * K, reached_per_position=[0] * K, accepted_per_position=[0] * K
        )
        prompt = [int(t) for t in prompt_ids]
        if max_new_tokens <= 0:
            return res
        if not prompt:
            raise ValueError("empty prompt")
        t_start = time.perf_counter()
        t_target0 = target.time_forward
        self._time_draft = self._time_grammar = 0.0

        first, taps = self._prefill(prompt, grammar, eos)
        tokens = prompt + [first]
        res.tokens.append(first)
        done = first in eos
        if not done and max_new_tokens > 1:
            self._timed(proposer.prefill, prompt, taps, first)
        round_fn = self._tree_round if self.tree else self._chain_round
        while not done and len(res.tokens) < max_new_tokens:
            room = target.max_len - target.length - 1  # positions left after the pending token
            if room < 0:
                break
            k = min(K, max_new_tokens - len(res.tokens) - 1, room)  # a round commits at most k + 1 tokens
            a, committed, taps = round_fn(tokens, k, room, res, grammar, gkw, eos)
            tokens.extend(committed)
            done = _commit(res, committed, eos)
            if not done and len(res.tokens) < max_new_tokens:
                self._timed(proposer.accept, tokens, a, taps)

        res.time_total = time.perf_counter() - t_start
        res.time_target = target.time_forward - t_target0
        res.time_draft = self._time_draft
        res.time_grammar = self._time_grammar
        res.lossy = self.typical
        return res

    def _prefill(self, prompt: list[int], grammar, stops: set[int]):
        """The target reads the prompt and produces the first (pending) token; returns it and the prompt's taps."""
        sp, target = self.sampling, self.target
        target.reset()
        self._timed(self.proposer.reset)
        logits, taps = target.forward(prompt, last_only=True)
        last = logits[-1]
        if grammar is not None:
            t0 = time.perf_counter()
            allowed = grammar.allowed_mask()
            if not bool(allowed.any()):
                raise ValueError("the grammar allows no token: its state is terminated (pass a fresh state)")
            last = last.masked_fill(~allowed.to(last.device), float("-inf"))
            self._time_grammar += time.perf_counter() - t0
        first = int(last.argmax()) if sp.greedy else int(sample(sp.process(last), self.generator))
        if grammar is not None:
            self._grammar_commit(grammar, [first], stops)
        return first, taps

    def _chain_round(self, tokens: list[int], k: int, room: int, res: GenerationResult, grammar=None,
                     gkw: dict | None = None, stops: set[int] = frozenset()):
        """One chain round: draft up to ``k`` tokens, verify them in one target forward, truncate the cache.

        Returns ``(a, committed tokens, target taps at [pending, d_1..d_a])``.
        """
        target = self.target
        drafts, q = self._timed(self.proposer.propose, tokens, k, self.draft_sampling, **(gkw or {})) if k > 0 \
            else ([], None)
        # drafts may be a device tensor: they stay on the device until the round's one host sync
        if isinstance(drafts, torch.Tensor):
            d = drafts.reshape(-1)[:k].to(device=target.device, dtype=torch.long)
        else:
            d = torch.tensor([int(t) for t in drafts[:k]], dtype=torch.long, device=target.device)
        masks = None
        if grammar is not None:  # (a host sync: the grammar lives on the host)
            d, masks = self._grammar_chain(grammar, d)
        n = d.shape[0]
        pending = torch.tensor([tokens[-1]], dtype=torch.long, device=target.device)
        logits, taps = target.forward(torch.cat([pending, d]))  # [n+1, V]
        if masks is not None:
            logits = _constrain(logits, masks)
        a, b = self._verify_chain(d, q, logits)
        host = torch.cat([a, b, d]).tolist()  # the round's one host sync
        a, b, drafts = host[0], host[1], host[2:]
        target.truncate(len(tokens) + a)  # keep x_0..x_{n-1} (incl. the old pending) and d_1..d_a
        _record_round(res, n, n, a, drafts[:a], stops)
        committed = drafts[:a] + [b]
        if grammar is not None:
            self._grammar_commit(grammar, committed, stops)
        return a, committed, None if taps is None else taps[: a + 1]

    def _verify_chain(self, d: torch.Tensor, q, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Accepted count ``a`` and the target's token ``b`` for the chain ``d`` (device tensors of shape [1])."""
        sp = self.sampling
        n = d.shape[0]
        if sp.greedy:
            a, b = verify_chain_greedy(d, logits, device_result=True)
        elif self.typical:
            path, b = verify_tree_typical(DraftTree.chain(d.tolist()), sp.process(logits), self.typical_epsilon,
                                          self.typical_delta, self.generator)
            a, b = torch.tensor(len(path)), torch.tensor(b)
        else:
            p = sp.process(logits)
            V = p.shape[-1]
            if q is None:  # deterministic drafts: q is one-hot
                q = torch.nn.functional.one_hot(d.to(p.device), V).float()
            elif q.dim() != 2 or q.shape[0] < n or q.shape[1] != V:
                raise ValueError(f"proposer {self.proposer.name!r} returned q {tuple(q.shape)}, expected ({n}, {V})")
            a, b = verify_chain_sampling(d, q[:n], p, self.generator, device_result=True)
        a, b = (torch.as_tensor(x).reshape(1).to(device=d.device, dtype=torch.long) for x in (a, b))
        return a, b

    # ------------------------------------------------------------------------------------------ grammar
    def _grammar_chain(self, grammar, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cut the chain ``d`` before its first ungrammatical token; the masks of its ``n + 1`` verified
        positions (the state itself is left as it was)."""
        t0 = time.perf_counter()
        dm = grammar.masks_along(d.tolist())
        nv = dm.num_valid_prefix
        self._time_grammar += time.perf_counter() - t0
        return d[:nv], dm.masks[: nv + 1]

    def _grammar_tree(self, grammar, tree: DraftTree) -> tuple[DraftTree, torch.Tensor]:
        """Prune the tree's ungrammatical nodes (and their subtrees); the masks at its ``n + 1`` nodes."""
        t0 = time.perf_counter()
        tm = grammar.tree_masks(tree.tokens, [p - 1 for p in tree.parents])
        masks = tm.masks
        if not bool(tm.valid.all()):  # an invalid node's descendants are invalid too: what is kept is a tree
            keep = tm.valid.nonzero().flatten().tolist()
            new_of = {0: 0}
            for j, i in enumerate(keep):
                new_of[i + 1] = j + 1
            tree = DraftTree([tree.tokens[i] for i in keep], [new_of[tree.parents[i]] for i in keep],
                             None if tree.scores is None else [tree.scores[i] for i in keep])
            masks = masks[[0] + [i + 1 for i in keep]]
        self._time_grammar += time.perf_counter() - t0
        return tree, masks

    def _grammar_commit(self, grammar, committed: list[int], stops: set[int]) -> None:
        """Advance the grammar over the committed tokens (up to and including a stop token)."""
        t0 = time.perf_counter()
        upto = next((j + 1 for j, t in enumerate(committed) if t in stops), len(committed))
        if not grammar.advance(committed[:upto]):  # pragma: no cover - the target's masked choice is allowed
            raise RuntimeError(f"the grammar refused committed tokens {committed[:upto]} (a mask was not applied)")
        self._time_grammar += time.perf_counter() - t0

    def _tree_round(self, tokens: list[int], k: int, room: int, res: GenerationResult, grammar=None,
                    gkw: dict | None = None, stops: set[int] = frozenset()):
        """One tree round: draft, verify the whole tree in one target forward, compact the cache.

        Returns ``(a, committed tokens, target taps at [root, path])``.
        """
        sp, target = self.sampling, self.target
        tree = self._timed(self.proposer.propose_tree, tokens, k, room, sp, **(gkw or {})) if k > 0 \
            else DraftTree([], [])
        if tree.num_nodes > room or tree.depth > k:
            raise ValueError(f"proposer {self.proposer.name!r} drafted a tree of {tree.num_nodes} nodes / depth "
                             f"{tree.depth}, over the limits {room} / {k}")
        masks = None
        if grammar is not None:
            tree, masks = self._grammar_tree(grammar, tree)
        L0 = target.length
        parents = tree.all_parents()
        logits, taps = target.forward_tree([tokens[-1]] + tree.tokens, parents)
        if masks is not None:
            logits = _constrain(logits, masks)
        if sp.greedy:
            path, b = verify_tree_greedy(tree, logits)
        elif self.typical:
            path, b = verify_tree_typical(tree, sp.process(logits), self.typical_epsilon, self.typical_delta,
                                          self.generator)
        else:
            path, b = verify_tree_sampling(tree, sp.process(logits), self.generator)
        a = len(path)
        keep = [0] + path
        target.keep([L0 + i for i in keep], start=L0)
        # draft positions offered: one per depth, so alpha is comparable to chains
        committed = [tree.tokens[i - 1] for i in path] + [b]
        _record_round(res, tree.depth, tree.num_nodes, a, committed[:a], stops)
        if grammar is not None:
            self._grammar_commit(grammar, committed, stops)
        kept_taps = None if taps is None else taps[torch.tensor(keep, device=taps.device)]
        return a, committed, kept_taps


def _stop_tokens(eos_token_id, grammar) -> set[int]:
    """The tokens that end the output: ``eos_token_id`` (one id, several or None) and the grammar's stop tokens."""
    if eos_token_id is None:
        eos = set()
    elif isinstance(eos_token_id, int):
        eos = {eos_token_id}
    else:
        eos = {int(t) for t in eos_token_id}
    if grammar is not None:
        eos = eos | set(grammar.compiled.stop_token_ids)
    return eos


def _commit(res: GenerationResult, committed: list[int], stops: set[int]) -> bool:
    """Append a round's committed tokens to the output, up to and including a stop token; True when one ended it."""
    for tok in committed:
        res.tokens.append(tok)
        res.num_round_tokens += 1
        if tok in stops:
            return True
    return False


def _record_round(res: GenerationResult, positions: int, nodes: int, a: int, accepted_tokens=(),
                  stops: set[int] = frozenset()) -> None:
    """Count one verify round: ``positions`` draft positions offered (chain length; tree depth), ``nodes``
    draft nodes verified, ``a`` accepted; ``accepted_tokens`` (the accepted drafts, in order) and ``stops``
    say where the output ended inside the round: the positions after an accepted stop token are not live."""
    res.num_rounds += 1
    res.num_drafted += positions
    res.num_tree_nodes += nodes
    res.num_accepted += a
    live = min(a + 1, positions)
    for j, t in enumerate(list(accepted_tokens)[:a]):
        if t in stops:
            live = min(live, j + 1)
            break
    for i in range(positions):
        res.drafted_per_position[i] += 1
    for i in range(min(a + 1, positions)):
        res.reached_per_position[i] += 1
    for i in range(a):
        res.accepted_per_position[i] += 1
    for i in range(live):
        res.live_reached_per_position[i] += 1
        res.live_accepted_per_position[i] += i < a


def _constrain(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Logits ``[n, V]`` with ``-inf`` where the grammar masks ``[n, V]`` disallow a token. A row that allows
    nothing (the position after a drafted stop token) is left as it is: no committed token ever comes from
    it, since the output ends at the stop token."""
    masks = masks.to(logits.device)
    none = ~masks.any(-1, keepdim=True)
    return logits.masked_fill(~(masks | none), float("-inf"))


def aggregate(results: Sequence[GenerationResult]) -> dict:
    """Pool the statistics of several generations.

    Returns a dict with ``alpha`` (accepted / drafted), ``acceptance_per_position`` (list: P(position i
    accepted | reached with the output not ended yet), None where never reached; see
    :class:`GenerationResult`), ``tau`` (round tokens / rounds), ``tokens_per_s`` (new tokens / total time),
    the time split (``time_total``, ``time_target``, ``time_draft``, ``time_other`` and the ``frac_*`` of the
    total) and the raw counts.
    """

    def ratio(x, y):
        return x / y if y else None

    K = max((len(r.drafted_per_position) for r in results), default=0)

    def pos_sum(attr):
        out = [0] * K
        for r in results:
            for i, v in enumerate(getattr(r, attr)):
                out[i] += v
        return out

    drafted_pp = pos_sum("drafted_per_position")
    reached_pp = pos_sum("reached_per_position")
    accepted_pp = pos_sum("accepted_per_position")
    live_reached_pp = pos_sum("live_reached_per_position")
    live_accepted_pp = pos_sum("live_accepted_per_position")
    num_new = sum(len(r.tokens) for r in results)
    rounds = sum(r.num_rounds for r in results)
    drafted = sum(r.num_drafted for r in results)
    accepted = sum(r.num_accepted for r in results)
    nodes = sum(r.num_tree_nodes for r in results)
    t_total = sum(r.time_total for r in results)
    t_target = sum(r.time_target for r in results)
    t_draft = sum(r.time_draft for r in results)
    t_other = max(t_total - t_target - t_draft, 0.0)
    t_grammar = sum(r.time_grammar for r in results)
    return {
        "num_sequences": len(results),
        "num_new_tokens": num_new,
        "num_rounds": rounds,
        "num_drafted": drafted,
        "num_accepted": accepted,
        "num_tree_nodes": nodes,
        "nodes_per_round": ratio(nodes, rounds),
        "lossy": any(r.lossy for r in results),
        "alpha": ratio(accepted, drafted),
        "acceptance_per_position": [ratio(a, r) for a, r in zip(live_accepted_pp, live_reached_pp)],
        "accepted_per_position": accepted_pp,
        "reached_per_position": reached_pp,
        "live_accepted_per_position": live_accepted_pp,
        "live_reached_per_position": live_reached_pp,
        "drafted_per_position": drafted_pp,
        "tau": ratio(sum(r.num_round_tokens for r in results), rounds),
        "tokens_per_s": ratio(num_new, t_total),
        "time_total": t_total,
        "time_target": t_target,
        "time_draft": t_draft,
        "time_other": t_other,
        "frac_target": ratio(t_target, t_total),
        "frac_draft": ratio(t_draft, t_total),
        "frac_other": ratio(t_other, t_total),
        "time_grammar": t_grammar,  # the decoder's grammar work (inside time_other)
        "frac_grammar": ratio(t_grammar, t_total),
    }


__all__ = ["GenerationResult", "SpecDecoder", "aggregate"]
