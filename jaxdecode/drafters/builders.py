"""Tree builders: decide the *shape* of a draft tree from a drafter's next-token distributions.

A builder drives a scorer (e.g. a draft LM) through `expand(scorer_state, start, tokens[B, F],
parents_all[B, W]) -> (logq[B, F, V], scorer_state)`: it asks for the next-token log-distributions
after F new nodes (working indices start..start+F-1, parents in `parents_all`) and picks children.
Builders are static (hashable) configuration; they differ only in which nodes they add:

- `ChainBuilder(depth, rule)`: one path; children by argmax or by sampling from q.
- `StaticTreeBuilder(paths, rule)`: a fixed list of paths (Medusa "choices"); a node with sibling rank r
  takes its parent's r-th top candidate ("topk"), an i.i.d. sample ("iid", SpecInfer/SpecTr), or the
  r-th of a Gumbel-top-k draw without replacement ("gumbel", Recursive Speculative Decoding).
- `DynamicTreeBuilder(depth, topk, total)`: EAGLE-2. Expand `depth` levels keeping the global top-k
  of the k x k children by cumulative draft log-prob, then keep the best `total` nodes of all levels.

Each returns (Tree, q_slots[B, N+1, V] draft probabilities per parent slot, scorer_state).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.tree import (Tree, TreeError, advance_slots, allowed_slots, broadcast_slots, mask_logprobs,
                            slot_gather, static_tree_layout, static_tree_parents, validate_parents)

# The child rules builders draft by (each is one of jaxdecode.verifiers.CHILD_RULES, which says what it
# promises verifiers). On a static tree "argmax" ranks like "topk" and "sample" draws siblings i.i.d.
RULES = ("argmax", "sample", "topk", "iid", "gumbel")


def _ranked(logq, k: int, rule: str, key):
    """k children per distribution: [..., V] -> [..., k] tokens by the rule."""
    if rule in ("argmax", "topk"):
        return jax.lax.top_k(logq, k)[1]
    if rule in ("iid", "sample"):
        return jax.random.categorical(key, logq[..., None, :], axis=-1, shape=logq.shape[:-1] + (k,))
    if rule == "gumbel":  # without replacement: top-k of log q + Gumbel noise
        g = jax.random.gumbel(key, logq.shape)
        return jax.lax.top_k(jnp.where(jnp.isfinite(logq), logq + g, -jnp.inf), k)[1]
    raise ValueError(f"unknown child rule {rule!r}; use one of {RULES}")


def _empty_slots(logq_root, n):
    b, v = logq_root.shape
    return jnp.zeros((b, n + 1, v), jnp.float32).at[:, 0].set(jnp.exp(logq_root))


def chain_widths(k: int) -> tuple:
    """Verification widths for a chain of up to k nodes cut to a varying length (speculative_decode's
    verify_widths): 1, 2, 3, 4, 6, 8, 12, 16, 24 below k, then k. Steps of about 1.5x: a cut chain
    pads to at most ~1.5x its length, with one compiled forward per width."""
    return tuple(sorted({w for w in (1, 2, 3, 4, 6, 8, 12, 16, 24) if w < k} | {k}))


@dataclasses.dataclass(frozen=True)
class ChainBuilder:
    depth: int
    rule: str = "argmax"  # "argmax" (greedy drafting) or "sample" (children ~ q, chain/block verifiers)

    def __post_init__(self):
        if self.depth < 1:
            raise TreeError(f"a chain needs depth >= 1, got {self.depth}")
        if self.rule not in ("argmax", "sample"):
            raise TreeError(f"a chain's rule is 'argmax' or 'sample', got {self.rule!r}")

    num_nodes = property(lambda self: self.depth)
    max_depth = property(lambda self: self.depth)
    working_size = property(lambda self: self.depth)
    static_parents = property(lambda self: np.arange(self.depth, dtype=np.int32) - 1)
    is_chain = True

    def build(self, scorer_state, logq_root, expand, key):
        b = logq_root.shape[0]
        n = self.depth
        parents = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (b, n))
        slots = _empty_slots(logq_root, n)
        keys = jax.random.split(key, n)
        tokens = jnp.zeros((b, n), jnp.int32)
        logq = logq_root
        for d in range(n):  # static unroll over tree depth (trace time), not over decoded tokens
            tok = _ranked(logq, 1, self.rule, keys[d])[:, 0]
            tokens = tokens.at[:, d].set(tok)
            if d + 1 < n:
                logq, scorer_state = expand(scorer_state, d, tok[:, None], parents)
                logq = logq[:, 0]
                slots = slots.at[:, d + 1].set(jnp.exp(logq))
        tree = Tree(tokens=tokens, parents=parents, valid=jnp.ones((b, n), bool))
        return tree, slots, scorer_state


@dataclasses.dataclass(frozen=True, eq=False)
class StoppingChainBuilder:
    """ChainBuilder(depth, rule) whose levels run in a `lax.while_loop` that ends when `stop` says
    every row is done: the drafter's cost follows the draft length it picks (an acceptance head's cut,
    or the adaptive policy's depth: `capped_chain`).

    stop(d, logq [B, V], token [B], carry) -> (keep_next bool[B], carry): called after token d was
    drafted from logq; keep_next False ends the row's chain after node d. Created per propose call
    (it closes over traced values), never hashed as jit static data.
    With `source` (a drafter's `source_state(scorer_state, d) -> f32[B, S]`: the drafter's own state that
    gave logq, e.g. EAGLE-3's layer output), stop takes it as a fifth argument: an acceptance head reads
    the drafter's state while it drafts."""
    base: ChainBuilder
    stop: Callable
    carry0: Any
    source: Callable | None = None

    num_nodes = property(lambda self: self.base.num_nodes)
    max_depth = property(lambda self: self.base.max_depth)
    working_size = property(lambda self: self.base.working_size)
    static_parents = property(lambda self: self.base.static_parents)
    rule = property(lambda self: self.base.rule)
    is_chain = True

    def build(self, scorer_state, logq_root, expand, key):
        b, v = logq_root.shape
        n = self.base.depth
        parents = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (b, n))
        keys = jax.random.split(key, n)

        def draft(d, logq, st):  # token d from logq; the head decides whether the row goes on
            tok = _ranked(logq, 1, self.base.rule, keys[d])[:, 0]
            extra = () if self.source is None else (self.source(st["scorer"], d),)
            going, carry = self.stop(d, logq, tok, st["carry"], *extra)
            going = going & st["going"]
            return tok, going, {**st, "carry": carry,
                                "tokens": st["tokens"].at[:, d].set(tok),
                                "valid": st["valid"].at[:, d].set(st["going"]),
                                "going": going}

        slots = jnp.zeros((b, n + 1, v), jnp.float32).at[:, 0].set(jnp.exp(logq_root))
        st = {"carry": self.carry0, "tokens": jnp.zeros((b, n), jnp.int32), "valid": jnp.zeros((b, n), bool),
              "going": jnp.ones((b,), bool), "slots": slots, "scorer": scorer_state, "d": jnp.int32(0)}
        tok, going, st = draft(0, logq_root, st)

        def cond(st):
            return (st["d"] + 1 < n) & jnp.any(st["going"])

        def body(st):
            d = st["d"]
            tok = st["tokens"][:, d]
            logq, scorer = expand(st["scorer"], d, tok[:, None], parents)
            logq = logq[:, 0]
            st = {**st, "scorer": scorer, "slots": st["slots"].at[:, d + 1].set(jnp.exp(logq)), "d": d + 1}
            _, _, st = draft(d + 1, logq, st)
            return st

        st = jax.lax.while_loop(cond, body, st)
        tree = Tree(tokens=st["tokens"], parents=parents, valid=st["valid"])
        return tree, st["slots"], st["scorer"]


def capped_chain(base: ChainBuilder, max_nodes) -> StoppingChainBuilder:
    """`base` drafting at most max_nodes[b] levels in row b (int32[B]; at least one level is drafted,
    the engine drops what it does not verify): the adaptive policy's depth, chosen before drafting,
    so a draft LM pays for the levels it verifies, not for its whole chain."""
    return StoppingChainBuilder(base, lambda d, logq, tok, cap: (d + 1 < cap, cap), max_nodes)


@dataclasses.dataclass(frozen=True)
class StaticTreeBuilder:
    paths: tuple  # tuple of tuples of sibling ranks, e.g. ((0,), (1,), (0, 0))
    rule: str = "topk"

    def __post_init__(self):
        if self.rule not in ("topk", "iid", "gumbel", "argmax", "sample"):
            raise TreeError(f"static tree rule must be topk, iid or gumbel (or argmax = topk, sample = iid), "
                            f"got {self.rule!r}")
        object.__setattr__(self, "paths", tuple(tuple(int(x) for x in p) for p in self.paths))
        static_tree_parents(self.paths)  # validates

    @classmethod
    def full(cls, branching, rule: str = "topk") -> "StaticTreeBuilder":
        """Every node at depth d has branching[d] children (e.g. (3, 2, 1))."""
        paths, level = [], [()]
        for k in branching:
            level = [p + (r,) for p in level for r in range(int(k))]
            paths += level
        return cls(tuple(paths), rule)

    @classmethod
    def from_parents(cls, parents, rule: str = "topk") -> "StaticTreeBuilder":
        """A static tree from a parents array (−1 = root's child); siblings ranked in index order."""
        parents = validate_parents(parents)
        if parents.ndim != 1:
            raise TreeError(f"a static tree's parents must be one row [N], got shape {parents.shape}")
        paths: list[tuple] = []
        child_count: dict[int, int] = {}
        for p in parents:
            rank = child_count.get(int(p), 0)
            child_count[int(p)] = rank + 1
            paths.append((paths[p] if p >= 0 else ()) + (rank,))
        return cls(tuple(paths), rule)

    @property
    def _layout(self):
        return static_tree_layout(self.paths)

    num_nodes = property(lambda self: len(self.paths))
    max_depth = property(lambda self: max(len(p) for p in self.paths))
    static_parents = property(lambda self: self._layout[0])
    working_size = property(lambda self: len(self.paths))

    @property
    def is_chain(self) -> bool:
        return all(p == (0,) * len(p) for p in self.paths)

    def build(self, scorer_state, logq_root, expand, key):
        parents_np, ranks_np, depth_np = self._layout
        b = logq_root.shape[0]
        n = len(parents_np)
        parents = jnp.broadcast_to(jnp.asarray(parents_np), (b, n))
        slots = _empty_slots(logq_root, n)
        tokens = jnp.zeros((b, n), jnp.int32)
        width = int(ranks_np.max()) + 1
        keys = jax.random.split(key, int(depth_np.max()) + 1)
        for d in range(1, int(depth_np.max()) + 1):
            idx = np.flatnonzero(depth_np == d)  # this level's nodes (contiguous)
            par_slot = parents_np[idx] + 1  # their parents' distribution slots
            logq_par = jnp.log(slots[:, par_slot])  # [B, F, V]
            # Per parent, `width` ranked candidates; a node takes its rank's candidate. Siblings share
            # the parent's draw, so "gumbel" gives distinct children (without replacement).
            cand = _ranked(logq_par, width, self.rule, keys[d])  # [B, F, width]
            if self.rule == "gumbel":  # one Gumbel draw per parent, shared by its children
                uniq, first = np.unique(par_slot, return_index=True)
                cand = cand[:, first[np.searchsorted(uniq, par_slot)]]
            tok = jnp.take_along_axis(cand, jnp.asarray(ranks_np[idx])[None, :, None], axis=2)[..., 0]
            tokens = tokens.at[:, idx].set(tok)
            if d < depth_np.max():
                has_children = np.isin(idx, parents_np)
                logq, scorer_state = expand(scorer_state, int(idx[0]), tok, parents)
                slots = slots.at[:, idx[has_children] + 1].set(jnp.exp(logq[:, has_children]))
        tree = Tree(tokens=tokens, parents=parents, valid=jnp.ones((b, n), bool))
        return tree, slots, scorer_state


DEFAULT_DYNAMIC_TOTAL = 32


@dataclasses.dataclass(frozen=True)
class DynamicTreeBuilder:
    """EAGLE-2 dynamic tree: `depth` levels of global top-`topk` expansion, best `total` nodes kept
    (default: 32, or all depth x topk candidates when there are fewer, so `eagle:depth=3` is a tree)."""
    depth: int = 5
    topk: int = 8
    total: int | None = None
    rule = "topk"
    is_chain = False

    def __post_init__(self):
        if self.total is None:
            object.__setattr__(self, "total", min(DEFAULT_DYNAMIC_TOTAL, self.depth * self.topk))
        if self.depth < 1 or self.topk < 1 or self.total < 1:
            raise TreeError("dynamic tree needs depth, topk and total >= 1")
        if self.total > self.depth * self.topk:
            raise TreeError(f"total={self.total} exceeds the {self.depth * self.topk} nodes that "
                            f"depth={self.depth} x topk={self.topk} expansion produces")

    num_nodes = property(lambda self: self.total)
    max_depth = property(lambda self: min(self.depth, self.total))  # total nodes reach at most that deep
    static_parents = None  # the shape changes every step
    working_size = property(lambda self: self.depth * self.topk)

    def build(self, scorer_state, logq_root, expand, key):
        b, v = logq_root.shape
        k, big_d = self.topk, self.depth
        w = k * big_d  # working nodes: level l occupies [l*k, (l+1)*k)
        work_tok = jnp.zeros((b, w), jnp.int32)
        work_par = jnp.full((b, w), -1, jnp.int32)
        work_score = jnp.full((b, w), -jnp.inf, jnp.float32)
        work_q = jnp.zeros((b, w + 1, v), jnp.float32).at[:, 0].set(jnp.exp(logq_root))
        score, tok = jax.lax.top_k(logq_root, k)
        work_tok = work_tok.at[:, :k].set(tok)
        work_score = work_score.at[:, :k].set(score)
        for lvl in range(1, big_d):
            start = (lvl - 1) * k
            logq, scorer_state = expand(scorer_state, start, work_tok[:, start:start + k], work_par)
            work_q = work_q.at[:, start + 1:start + k + 1].set(jnp.exp(logq))
            child_score, child_tok = jax.lax.top_k(logq, k)  # [B, k, k]
            cum = work_score[:, start:start + k, None] + child_score
            best, flat = jax.lax.top_k(cum.reshape(b, k * k), k)
            par_local = flat // k
            new = slice(lvl * k, (lvl + 1) * k)
            work_tok = work_tok.at[:, new].set(jnp.take_along_axis(child_tok.reshape(b, k * k), flat, axis=1))
            work_par = work_par.at[:, new].set(start + par_local)
            work_score = work_score.at[:, new].set(best)
        # Keep the best `total` nodes; a small depth penalty makes every child rank strictly below its
        # parent, so the kept set is closed under ancestors (a tree).
        level = jnp.arange(w) // k
        keep_score = work_score - 1e-6 * level
        _, chosen = jax.lax.top_k(keep_score, self.total)
        chosen = jnp.sort(chosen, axis=1)  # working order is topological (levels contiguous)
        new_index = jnp.full((b, w), -1, jnp.int32)
        new_index = jax.vmap(lambda ni, c: ni.at[c].set(jnp.arange(self.total, dtype=jnp.int32)))(
            new_index, chosen)
        old_par = jnp.take_along_axis(work_par, chosen, axis=1)
        parents = jnp.where(old_par < 0, -1, jnp.take_along_axis(new_index, jnp.maximum(old_par, 0), axis=1))
        tokens = jnp.take_along_axis(work_tok, chosen, axis=1)
        slots = jnp.concatenate([work_q[:, :1], jnp.take_along_axis(work_q, chosen[..., None] + 1, axis=1)],
                                axis=1)
        tree = Tree(tokens=tokens, parents=parents.astype(jnp.int32), valid=jnp.ones((b, self.total), bool))
        return tree, slots, scorer_state


def build_tree(builder, ctx, scorer_state, logq_root, expand, key):
    """`builder.build(scorer_state, logq_root, expand, key)`, drafting under the decode's constraint
    when the speculative engine runs with one (ctx.constraint, ctx.cstate: the rows' states after the
    pending token): every distribution the builder reads, the root's and each `expand`'s, is masked
    to the tokens allowed after that node's path and renormalised, so children are drawn (or ranked)
    among allowed tokens and the draft probabilities are the ones they were drawn from. The node
    states ride along in the scorer state ([B, W] per leaf, W the builder's working size).
    Drafters call this instead of `builder.build`; without a constraint it is exactly that."""
    constraint = getattr(ctx, "constraint", None)
    if constraint is None:
        return builder.build(scorer_state, logq_root, expand, key)
    v = logq_root.shape[-1]
    root = ctx.cstate
    work0 = broadcast_slots(root, getattr(builder, "working_size", builder.num_nodes))

    def constrained_expand(carry, start, tokens, parents_all):
        inner, work = carry
        f = tokens.shape[1]
        par = jax.lax.dynamic_slice_in_dim(parents_all, start, f, axis=1)  # [B, F] working indices
        from_root = broadcast_slots(root, f)
        par_states = jax.tree.map(lambda g, r: jnp.where((par >= 0).reshape(par.shape + (1,) * (g.ndim - 2)), g, r),
                                  slot_gather(work, jnp.maximum(par, 0)), from_root)
        new = advance_slots(constraint, par_states, tokens)  # the frontier's states
        work = jax.tree.map(lambda w, x: jax.lax.dynamic_update_slice_in_dim(w, x, start, axis=1), work, new)
        logq, inner = expand(inner, start, tokens, parents_all)  # [B, F, V]
        return mask_logprobs(logq, allowed_slots(constraint, new, v)), (inner, work)

    logq_root = mask_logprobs(logq_root, constraint.allowed(root, v))
    if getattr(builder, "source", None) is not None:  # the drafter's state lies in the wrapped scorer's first part
        builder = dataclasses.replace(builder, source=lambda sc, d, source=builder.source: source(sc[0], d))
    tree, slots, (scorer_state, _) = builder.build((scorer_state, work0), logq_root, constrained_expand, key)
    return tree, slots, scorer_state


def _spec_settings(rest: str, builder) -> dict:
    """'depth=5,topk=8' -> {"depth": 5, "topk": 8}, checked against the builder's settings."""
    known = [f.name for f in dataclasses.fields(builder) if f.init]
    kw = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{item!r} is not key=value: write settings as {','.join(k + '=N' for k in known)}")
        if key not in known:
            raise ValueError(f"unknown setting {key!r}; this tree takes {', '.join(known)}")
        kw[key] = int(value)
    return kw


def parse_tree_spec(spec) -> object:
    """'chain:4' | 'chain:4:sample' | 'static:3,2,1[:rule]' | 'eagle:depth=5,topk=8,total=32' | an int N
    (= 'chain:N') | builder."""
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        spec = f"chain:{int(spec)}"  # a node count: the chain of that many nodes
    if not isinstance(spec, str):
        return spec
    kind, _, rest = spec.partition(":")
    try:
        if kind == "chain":
            depth, _, rule = rest.partition(":")
            return ChainBuilder(int(depth or 4), rule or "argmax")
        if kind == "static":
            branching, _, rule = rest.partition(":")
            return StaticTreeBuilder.full([int(x) for x in branching.split(",")], rule or "topk")
        if kind in ("eagle", "eagle2", "dynamic", "dyspec"):
            if kind == "dyspec":
                from jaxdecode.drafters.dyspec import DySpecBuilder as builder
            else:
                builder = DynamicTreeBuilder
            return builder(**_spec_settings(rest, builder))
    except (ValueError, TypeError) as e:
        raise TreeError(f"bad tree spec {spec!r}: {e}") from None
    raise TreeError(f"unknown tree spec {spec!r}; use 'chain:4', 'chain:4:sample', 'static:3,2,1', "
                    f"'static:2,2:iid', 'eagle:depth=5,topk=8,total=32' or 'dyspec:num_nodes=32,topk=4'")
