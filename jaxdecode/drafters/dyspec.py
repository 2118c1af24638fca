"""DySpec tree builder (Xiong et al., "DySpec: Faster Speculative Decoding with Dynamic Token Tree
Structure"): grow the draft tree greedily, always adding the frontier candidate with the highest
estimated acceptance probability, the product of the draft probabilities along its path, until the
node budget is spent.

Same interface as the builders of `jaxdecode.drafters.builders` (works with `DraftLM`):
`build(scorer_state, logq_root, expand, key) -> (Tree, q_slots[B, N+1, V], scorer_state)`.

Rule, in static shapes. The frontier holds, for every node already in the tree (and the root), its
`topk` most likely children under the draft (rule "topk": deterministic top-k children, so verify with
"topk", "greedy" or "point_mass"). A round moves the `per_round` frontier candidates with the largest
cumulative draft log-probability into the tree (their order = their index, so parents always precede
children) and asks the scorer for their next-token distributions (one draft forward per round), whose
top-k children join the frontier. The paper pops one candidate per draft forward; taking the best
`per_round` at once (default: topk; fewer while the frontier is smaller, see `schedule`) keeps the
number of draft forwards near num_nodes / per_round, and with per_round = 1 it is exactly the
one-at-a-time greedy. A child never scores above its
parent, so the chosen set is closed under ancestors. Candidates deeper than `max_depth` (default: the
number of rounds, i.e. no limit) are never taken; candidates of zero draft probability (e.g. cut by the
sampler's top-k/top-p) become invalid nodes.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdecode.drafters.ngram import check_int
from jaxdecode.tree import Tree, TreeError


@dataclasses.dataclass(frozen=True)
class DySpecBuilder:
    num_nodes: int = 32
    topk: int = 4
    per_round: int = 0  # candidates added per draft forward; 0 = topk
    max_depth: int = 0  # deepest node; 0 = number of rounds (no extra limit)
    rule = "topk"
    is_chain = False

    def __post_init__(self):
        try:
            check_int("DySpecBuilder", "num_nodes", self.num_nodes, 1)
            check_int("DySpecBuilder", "topk", self.topk, 1)
            check_int("DySpecBuilder", "per_round", self.per_round, 0)
            check_int("DySpecBuilder", "max_depth", self.max_depth, 0)
        except ValueError as e:
            raise TreeError(str(e)) from None
        if self.per_round == 0:
            object.__setattr__(self, "per_round", min(self.topk, self.num_nodes))
        if self.per_round > self.num_nodes:
            raise TreeError(f"DySpecBuilder: per_round ({self.per_round}) exceeds num_nodes "
                            f"({self.num_nodes})")
        rounds = len(self.schedule)
        if self.max_depth == 0 or self.max_depth > rounds:
            object.__setattr__(self, "max_depth", rounds)  # a path gains at most one node per round

    working_size = property(lambda self: self.num_nodes)

    @property
    def schedule(self) -> tuple:
        """Nodes added per round: per_round, but never more than the frontier holds (topk children
        of the root and of every node so far, minus the nodes taken) nor than the budget left."""
        sizes, added = [], 0
        while added < self.num_nodes:
            size = min(self.per_round, self.num_nodes - added, self.topk + added * (self.topk - 1))
            sizes.append(size)
            added += size
        return tuple(sizes)

    def build(self, scorer_state, logq_root, expand, key):
        b, v = logq_root.shape
        n, k, d_max = self.num_nodes, self.topk, self.max_depth
        if k > v:
            raise TreeError(f"DySpecBuilder: topk ({k}) exceeds the vocabulary ({v})")
        sizes = self.schedule
        c = (n + 1) * k  # frontier: topk children of each parent slot (root = slot 0)
        rows = jnp.arange(b)[:, None]
        score, tok = jax.lax.top_k(logq_root, k)
        f_score = jnp.full((b, c), -jnp.inf, jnp.float32).at[:, :k].set(score)
        f_tok = jnp.zeros((b, c), jnp.int32).at[:, :k].set(tok)
        f_open = jnp.zeros((b, c), bool).at[:, :k].set(True)  # still a candidate
        slot_depth = jnp.zeros((b, n + 1), jnp.int32)  # depth of each parent slot (root 0)
        tokens = jnp.zeros((b, n), jnp.int32)
        parents = jnp.full((b, n), -1, jnp.int32)
        valid = jnp.zeros((b, n), bool)
        slots = jnp.zeros((b, n + 1, v), jnp.float32).at[:, 0].set(jnp.exp(logq_root))
        start = 0
        for r, size in enumerate(sizes):  # static: one draft forward per round
            par_depth = jnp.repeat(slot_depth, k, axis=1)  # depth of each candidate's parent slot
            allowed = f_open & (par_depth < d_max)
            best, pick = jax.lax.top_k(jnp.where(allowed, f_score, -jnp.inf), size)  # [B, size]
            par_slot = pick // k
            ok = jnp.isfinite(best) & jnp.take_along_axis(allowed, pick, axis=1)
            new = slice(start, start + size)
            tokens = tokens.at[:, new].set(jnp.where(ok, jnp.take_along_axis(f_tok, pick, axis=1), 0))
            parents = parents.at[:, new].set(par_slot - 1)
            valid = valid.at[:, new].set(ok)
            f_open = f_open.at[rows, pick].set(False)
            slot_depth = slot_depth.at[:, start + 1:start + size + 1].set(
                jnp.take_along_axis(slot_depth, par_slot, axis=1) + 1)
            if r + 1 < len(sizes):
                logq, scorer_state = expand(scorer_state, start, tokens[:, new], parents)
                slots = slots.at[:, start + 1:start + size + 1].set(jnp.exp(logq))
                child_score, child_tok = jax.lax.top_k(logq, k)  # [B, size, k]
                cum = jnp.where(ok[..., None], best[..., None] + child_score, -jnp.inf)
                fr = slice((start + 1) * k, (start + size + 1) * k)
                f_score = f_score.at[:, fr].set(cum.reshape(b, size * k))
                f_tok = f_tok.at[:, fr].set(child_tok.reshape(b, size * k))
                f_open = f_open.at[:, fr].set(ok.repeat(k, axis=1))
            start += size
        # Invalid nodes: an earlier index keeps the parents array a valid tree.
        idx = jnp.arange(n)[None, :]
        parents = jnp.where(valid, parents, jnp.maximum(idx - 1, -1)).astype(jnp.int32)
        return Tree(tokens=tokens, parents=parents, valid=valid), slots, scorer_state
