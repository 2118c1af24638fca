"""Token Recycling (Luo et al., "Turning Trash into Treasure: Accelerating Inference of Large Language
Models with Token Recycling", ACL 2025): the candidate tokens a verification produces anyway become
the next drafts.

State: an adjacency matrix M[B, V, k] per row (int16 when V fits, else int32; 64 KiB per row for
V=4096, k=8): M[b, t] holds the top-k next tokens the target predicted the last time token t was a
tree slot of row b. Rows are independent (each row has its own M), as everywhere in the engine.

- propose: breadth-first expansion from the pending token through M along a fixed static tree
  `template` (paths of candidate ranks, as Medusa "choices"): a node with path (..., r) takes
  M[parent token, r]. A node whose entry is unknown (-1) is invalid, and so are its descendants.
- observe: after each verification, for every valid tree slot (the root and every valid node, accepted
  or not) M[token of that slot] = top-k of the target logits at that slot. A token can occur at several
  slots; the last slot (highest index, i.e. the deepest/latest node) wins, the paper's best-MAT choice
  among its update orders; resolved deterministically by a scatter-max of slot indices.

Initial M (documented choice): the paper starts from zeros and inherits M from the previous query
("hot start"). Zeros would propose token 0 for every unseen token; we start from -1 ("no candidates":
invalid nodes) instead, optionally hot-started from `table` (a [V, k] matrix, e.g. a previous run's),
and with `prime_from_prompt` the rank-0 entry of every still-empty row that occurs in the prompt is set
to the token that followed its last occurrence in the prompt (a free bigram guess until the target's
own candidates arrive).

Default template: `recycling_template(48)`: the 48 paths with the highest prior
prod_i decay / (r_i + 1) (decay 0.7, ranks < 8, depth <= 6), found best-first. Like the paper's
80-node template it is static and imbalanced (earlier siblings get more and deeper children); level
sizes 8, 14, 13, 6, 6, 1. Any list of paths with ranks < topk can be passed instead.
"""
from __future__ import annotations

import dataclasses
import heapq

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.drafters.ngram import check_int
from jaxdecode.tree import Tree, TreeError, static_tree_layout, static_tree_parents


def recycling_template(num_nodes: int = 48, topk: int = 8, max_depth: int = 6,
                       decay: float = 0.7) -> tuple:
    """The `num_nodes` paths of candidate ranks (< topk, depth <= max_depth) with the largest
    prod_i decay / (rank_i + 1). A path always scores below its prefix, so the set is a tree."""
    check_int("recycling_template", "num_nodes", num_nodes, 1)
    check_int("recycling_template", "topk", topk, 1)
    check_int("recycling_template", "max_depth", max_depth, 1)
    if not 0 < decay <= 1:
        raise ValueError(f"recycling_template: decay must be in (0, 1], got {decay!r}")
    heap = [(-decay / (r + 1), (r,)) for r in range(topk)]
    heapq.heapify(heap)
    chosen = []
    while heap and len(chosen) < num_nodes:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < max_depth:
            for r in range(topk):
                heapq.heappush(heap, (neg * decay / (r + 1), path + (r,)))
    if len(chosen) < num_nodes:
        raise ValueError(f"recycling_template: only {len(chosen)} paths exist with topk={topk} and "
                         f"max_depth={max_depth}; ask for fewer nodes")
    return tuple(sorted(chosen, key=lambda p: (len(p), p)))


DEFAULT_TEMPLATE = recycling_template()


def _table_dtype(vocab_size: int):
    return jnp.int16 if vocab_size <= np.iinfo(np.int16).max else jnp.int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecyclingState:
    table: jax.Array  # int[B, V, k]: top-k next tokens per token, -1 = unknown
    root: jax.Array  # int32[B]: the pending token of the last proposal (slot 0 of its tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenRecyclingDrafter:
    """Token Recycling: draft trees read from an adjacency matrix of recycled top-k candidates."""

    vocab_size: int = dataclasses.field(metadata=dict(static=True))
    topk: int = dataclasses.field(default=8, metadata=dict(static=True))
    template: tuple = dataclasses.field(default=DEFAULT_TEMPLATE, metadata=dict(static=True))
    prime_from_prompt: bool = dataclasses.field(default=True, metadata=dict(static=True))
    table: jax.Array | None = None  # optional hot start M[V, k] (a leaf: not baked into the program)

    own_tree_shape = True  # builds its own shapes: tree="auto" is refused (treeopt), sized by its template
    child_rule = "point"

    def __post_init__(self):
        check_int("TokenRecyclingDrafter", "vocab_size", self.vocab_size, 1)
        check_int("TokenRecyclingDrafter", "topk", self.topk, 1)
        if self.topk > self.vocab_size:
            raise ValueError(f"TokenRecyclingDrafter: topk ({self.topk}) exceeds vocab_size "
                             f"({self.vocab_size})")
        try:
            paths = tuple(tuple(int(r) for r in p) for p in self.template)
            static_tree_parents(paths)
        except TreeError as e:
            raise ValueError(f"TokenRecyclingDrafter: bad template: {e}") from None
        except TypeError:
            raise ValueError(f"TokenRecyclingDrafter: template must be a list of paths (tuples of "
                             f"candidate ranks), got {self.template!r:.80}") from None
        worst = max(max(p) for p in paths)
        if worst >= self.topk:
            raise ValueError(f"TokenRecyclingDrafter: the template uses candidate rank {worst} but M "
                             f"keeps only topk={self.topk} candidates per token; raise topk or trim "
                             f"the template")
        object.__setattr__(self, "template", paths)
        # JAX rebuilds the drafter from its leaves (tracers, or placeholders in tree utilities):
        # check the table only when it looks like an array.
        shape = getattr(self.table, "shape", None)
        if isinstance(shape, tuple):
            if shape != (self.vocab_size, self.topk):
                raise ValueError(f"TokenRecyclingDrafter: table must have shape [vocab_size, topk] = "
                                 f"[{self.vocab_size}, {self.topk}], got {shape}")

    @property
    def _layout(self):
        return static_tree_layout(self.template)

    num_nodes = property(lambda self: len(self.template))
    max_depth = property(lambda self: max(len(p) for p in self.template))
    is_chain = property(lambda self: all(p == (0,) * len(p) for p in self.template))

    # ------------------------------------------------------------------ state
    def init(self, prompt_tokens, prompt_lengths, cache_len, key):
        b, p = prompt_tokens.shape
        v, k, dt = self.vocab_size, self.topk, _table_dtype(self.vocab_size)
        if self.table is None:
            table = jnp.full((b, v, k), -1, dt)
        else:
            table = jnp.broadcast_to(jnp.asarray(self.table).astype(dt), (b, v, k))
        if self.prime_from_prompt and p > 1:
            prev, nxt = prompt_tokens[:, :-1], prompt_tokens[:, 1:]
            ok = jnp.arange(1, p)[None, :] < prompt_lengths[:, None]
            table = self._write_last(table, prev, ok, nxt[..., None], rank0_if_empty=True)
        rows = jnp.arange(b)
        root = prompt_tokens[rows, jnp.maximum(prompt_lengths - 1, 0)]
        return RecyclingState(table=table, root=root.astype(jnp.int32))

    def _write_last(self, table, keys, ok, values, rank0_if_empty=False):
        """table[b, keys[b, s]] = values[b, s] for ok slots; among equal keys the last slot wins.
        rank0_if_empty: write only column 0 and only into rows that are still unknown."""
        b, s = keys.shape
        v = self.vocab_size
        rows = jnp.arange(b)[:, None]
        slot = jnp.broadcast_to(jnp.arange(s)[None, :], (b, s))
        keys = jnp.clip(keys, 0, v - 1)
        last = jnp.full((b, v), -1, jnp.int32).at[rows, keys].max(jnp.where(ok, slot, -1))
        win = ok & (jnp.take_along_axis(last, keys, axis=1) == slot)
        if rank0_if_empty:
            win = win & (table[rows, keys, 0] < 0)
            target = jnp.where(win, keys, v)  # out of range: dropped
            return table.at[rows, target, 0].set(values[..., 0].astype(table.dtype), mode="drop")
        target = jnp.where(win, keys, v)
        return table.at[rows, target].set(values.astype(table.dtype), mode="drop")

    # ------------------------------------------------------------------ protocol
    def expand(self, table, root):
        """The template tree read from `table` [B, V, k] starting at `root` [B]: (tokens, valid)."""
        parents, ranks, depth = self._layout
        b, n = root.shape[0], len(parents)
        rows = jnp.arange(b)[:, None]
        tokens = jnp.zeros((b, n), jnp.int32)
        valid = jnp.zeros((b, n), bool)
        for d in range(1, int(depth.max()) + 1):  # static unroll over tree depth
            idx = np.flatnonzero(depth == d)
            par = parents[idx]
            if d == 1:
                par_tok = jnp.broadcast_to(root[:, None], (b, idx.size))
                par_ok = jnp.ones((b, idx.size), bool)
            else:
                par_tok, par_ok = tokens[:, par], valid[:, par]
            cand = table[rows, par_tok, jnp.asarray(ranks[idx])[None, :]].astype(jnp.int32)
            ok = par_ok & (cand >= 0)
            tokens = tokens.at[:, idx].set(jnp.where(ok, cand, 0))
            valid = valid.at[:, idx].set(ok)
        return tokens, valid

    def propose(self, state: RecyclingState, ctx, sampler):
        b = ctx.history.shape[0]
        root = ctx.history[jnp.arange(b), ctx.hist_len - 1].astype(jnp.int32)
        tokens, valid = self.expand(state.table, root)
        parents = jnp.broadcast_to(jnp.asarray(self._layout[0]), tokens.shape)
        tree = Tree(tokens=tokens, parents=parents, valid=valid)
        return tree, None, dataclasses.replace(state, root=root)

    def observe(self, state: RecyclingState, obs):
        logits = obs.target_logits
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"TokenRecyclingDrafter: built for vocab_size={self.vocab_size} but the "
                             f"target's logits have {logits.shape[-1]} entries")
        keys = jnp.concatenate([state.root[:, None], obs.tree.tokens], axis=1)  # [B, N+1] slot tokens
        ok = jnp.concatenate([jnp.ones((keys.shape[0], 1), bool), obs.tree.valid], axis=1)
        ok = ok & obs.active[:, None]
        cand = jax.lax.top_k(logits, self.topk)[1]  # [B, N+1, k]
        return dataclasses.replace(state, table=self._write_last(state.table, keys, ok, cand))
