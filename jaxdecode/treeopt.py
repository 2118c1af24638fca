"""Tree size and shape from measured acceptance and measured cost: Sequoia's dynamic program and the
hardware-aware size (`tree="auto"`).

Model (Sequoia, Chen et al. 2024): a node's children are tried in rank order; the child of rank r is
accepted with probability p[r] given that ranks < r were rejected, whatever the node (positional
acceptance). So the r-th child is *the* accepted one with probability a[r] = p[r] * prod_{j<r}(1 - p[j]),
a node with sibling-rank path (r_1..r_d) lies on the accepted path with probability prod_i a[r_i], and
a tree's expected accepted draft tokens is the sum of that over its nodes. Ranks per node must be
contiguous (0..k-1): the measured p[r] assumes ranks < r were there and rejected. A per-depth matrix
p[d][r] (depth d = 1.. of the child) refines it for drafters whose quality falls with depth (Medusa
heads, block drafters); a vector means the same p at every depth.

- `acceptance_profile`: p measured with the real drafter and verifier: speculative decoding (fixed
  configuration) with the drafter built on a "comb" tree (`comb_paths`: `width` ranked children at
  every level of the top-1 path, `depth` levels), counting per depth which rank was accepted.
- `sequoia_tree` / `sequoia_values`: the dynamic program over (nodes, depth, branching) that maximises
  the expected accepted tokens; `expected_accepted(paths, p)` scores any static tree.
- `choose_tree`: for every (node budget, depth limit) the optimal tree, its expected tokens per second
  (1 + E[accepted]) / (draft cost of its depth and size + verification cost of its size, from a measured
  jaxdecode.costmodel.CostTable): the best one (PPD / Sequoia hardware-aware size). The draft cost is
  levels x per-level + nodes x per-node seconds (`split_draft_cost`: from the propose times of the
  profiling comb and of a chain of the same depth).
- `resolve_auto_tree`: what `generate(method="speculative", tree="auto")` runs: profile (cached on
  disk) + cost table (jaxdecode.costmodel.load_or_calibrate) -> the model's ranking of trees -> a walk
  over sizes from its best tree (`size_walk`), each step decoding the prompts with two trees and plain
  decoding side by side (`time_runs`), kept while the measured tokens per second improve -> a
  StaticTreeBuilder (or 'chain:L' for drafters that retrieve chains) and the numbers for the stats.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.costmodel import _emit  # progress lines: stderr, or the caller's callable
from jaxdecode.tree import TreeError, static_tree_layout

__all__ = ["AcceptanceProfile", "TreeChoice", "SizedCosts", "comb_paths", "acceptance_profile", "acceptance_matrix",
           "is_auto", "sequoia_values", "sequoia_tree", "expected_accepted", "choose_tree", "split_draft_cost",
           "TreeRun", "time_runs", "size_walk", "tree_spec", "resolve_auto_tree", "parse_auto", "AUTO_DEFAULTS"]


# ----------------------------------------------------------------------------- the acceptance model
def _check_p(p) -> np.ndarray:
    """p as float64 [D, K] (a vector is one row, used at every depth); a clear error otherwise."""
    arr = np.asarray(p, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[1] == 0 or arr.shape[0] == 0:
        raise ValueError(f"acceptance p must be a non-empty vector p[rank] or a matrix p[depth][rank], "
                         f"got shape {np.shape(p)}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0) or np.any(arr > 1):
        raise ValueError(f"acceptance probabilities must lie in [0, 1], got {arr.tolist()}")
    return arr


def acceptance_matrix(p, max_depth: int) -> np.ndarray:
    """a[d, r] (d = 0..max_depth-1 for depth d+1): probability that the rank-r child of a node at depth
    d is the accepted one. Depths beyond a measured matrix reuse its last row."""
    rows = _check_p(p)
    rows = rows[np.minimum(np.arange(max_depth), len(rows) - 1)]  # [D, K]
    survive = np.cumprod(np.concatenate([np.ones((max_depth, 1)), 1.0 - rows[:, :-1]], axis=1), axis=1)
    return rows * survive


_EPS = 1e-12  # a node must add more than this to the expected count to be kept (ties: fewer nodes)


def _dp(a: np.ndarray, max_nodes: int):
    """The dynamic program for depth limit a.shape[0]: (F [D+1, N+1], S [D, K, N+1]).

    F[l, n]: the best expected accepted count of the subtree below a node at depth l using at most n
    nodes (F[D, .] = 0: no deeper level). S[l, r, m]: how many nodes (the child itself + its subtree) the
    rank-r child of a depth-l node gets when ranks r.. share m nodes (0: no rank-r child, hence none of
    higher rank). The inner allocation H_r(m) = max(0, max_s a[l, r] (1 + F[l+1, s-1]) + H_{r+1}(m-s))."""
    depth, k = a.shape
    n = max_nodes
    f = np.zeros((depth + 1, n + 1))
    s_tab = np.zeros((depth, k, n + 1), np.int32)
    for lvl in range(depth - 1, -1, -1):
        h = np.zeros(n + 1)  # ranks >= k: nothing
        for r in range(k - 1, -1, -1):
            gain = a[lvl, r] * (1.0 + f[lvl + 1, :n])  # gain[s-1]: a rank-r child with s-1 descendants
            new_h = np.zeros(n + 1)
            for m in range(1, n + 1):
                cand = gain[:m] + h[m - 1::-1]  # s = 1..m: gain[s-1] + h[m-s]
                j = int(np.argmax(cand))  # the first maximum: the smallest subtree among ties
                if cand[j] > _EPS:
                    new_h[m], s_tab[lvl, r, m] = cand[j], j + 1
            h = new_h
        f[lvl] = h
    return f, s_tab


def _paths_from(s_tab: np.ndarray, budget: int) -> tuple:
    """The tree of the DP's choices for `budget` nodes below the root, as sibling-rank paths."""
    depth, k, _ = s_tab.shape
    paths: list[tuple] = []

    def grow(lvl, prefix, m):
        for r in range(k):
            s = int(s_tab[lvl, r, m]) if lvl < depth else 0
            if s == 0:
                return
            child = prefix + (r,)
            paths.append(child)
            grow(lvl + 1, child, s - 1)
            m -= s

    grow(0, (), budget)
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


def sequoia_values(p, max_nodes: int, max_depth: int) -> np.ndarray:
    """The best expected accepted draft tokens for every node budget 0..max_nodes at depth <= max_depth."""
    _check_sizes(max_nodes, max_depth)
    return _dp(acceptance_matrix(p, max_depth), max_nodes)[0][0]


def sequoia_tree(p, num_nodes: int, max_depth: int) -> tuple:
    """Sequoia's optimal tree for at most `num_nodes` nodes of depth <= max_depth under acceptance `p`
    (vector p[rank] or matrix p[depth][rank]): sibling-rank paths, the format of
    jaxdecode.drafters.StaticTreeBuilder. Nodes that add nothing (p = 0 beyond some rank, or a chain
    deeper than max_depth) are left out, so the tree may be smaller than num_nodes; it is never empty
    (one rank-0 child when nothing is expected to be accepted)."""
    _check_sizes(num_nodes, max_depth)
    _, s_tab = _dp(acceptance_matrix(p, max_depth), num_nodes)
    return _paths_from(s_tab, num_nodes) or ((0,),)


def _check_sizes(max_nodes, max_depth):
    for name, v in (("num_nodes", max_nodes), ("max_depth", max_depth)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")


def expected_accepted(paths, p) -> float:
    """Expected accepted draft tokens per verification of the static tree `paths` under acceptance `p`
    (the bonus token not counted: tokens per step = 1 + this). Siblings' ranks must be 0..k-1."""
    paths = tuple(tuple(int(x) for x in q) for q in paths)
    static_tree_layout(paths)  # validates: prefixes present, no duplicates
    have = set(paths)
    for q in paths:
        if q[-1] > 0 and q[:-1] + (q[-1] - 1,) not in have:
            raise TreeError(f"path {q}: its sibling of rank {q[-1] - 1} is missing; the acceptance model "
                            f"needs every node's children ranked 0..k-1")
    depth = max(len(q) for q in paths)
    a = acceptance_matrix(p, depth)
    k = a.shape[1]
    total = 0.0
    for q in paths:
        total += math.prod(a[d, r] if r < k else 0.0 for d, r in enumerate(q))
    return float(total)


def comb_paths(width: int, depth: int) -> tuple:
    """The profiling tree: `width` ranked children under the root and under every node of the top-1
    path, `depth` levels (width * depth nodes). Depth d's ranks are tried whenever the drafts of
    depths < d were the top-1 ones and were accepted."""
    _check_sizes(width, depth)
    return tuple((0,) * d + (r,) for d in range(depth) for r in range(width))


def tree_spec(paths, rule: str = "topk") -> str:
    """A display string of a static tree: 'static:b1,b2,..:rule' when every node of a depth has the same
    number of children (a full tree), else 'paths:0;1;0.0;...:rule' (ranks joined by '.')."""
    paths = tuple(tuple(q) for q in paths)
    depth = max(len(q) for q in paths)
    branching, level = [], [()]
    for d in range(depth):
        counts = {sum(1 for q in paths if len(q) == d + 1 and q[:d] == par) for par in level}
        if len(counts) != 1:
            break
        branching.append(counts.pop())
        level = [q for q in paths if len(q) == d + 1]
    else:
        return f"static:{','.join(map(str, branching))}:{rule}"
    return f"paths:{';'.join('.'.join(map(str, q)) for q in paths)}:{rule}"


# ----------------------------------------------------------------------------- choosing the size
@dataclasses.dataclass(frozen=True)
class TreeChoice:
    """What `choose_tree` picked and why (times in seconds per verification step, whole batch)."""
    paths: tuple
    num_nodes: int
    depth: int
    expected_accepted: float
    expected_tau: float  # 1 + expected_accepted: tokens per verification, bonus included
    step_seconds: float  # draft (depth levels) + verification of num_nodes
    tokens_per_second: float  # expected_tau / step_seconds (per row)
    plain_tokens_per_second: float  # 1 / the plain step's seconds (costs.step_at(0)), per row
    candidates: tuple  # (num_nodes, depth, expected_tau, tokens_per_second) of every distinct tree scored
    ranked: tuple = ()  # the distinct trees' paths, best expected tokens per second first

    @property
    def speedup(self) -> float:
        """Expected tokens/s against plain decoding (< 1: speculation does not pay on this cost table)."""
        return self.tokens_per_second / self.plain_tokens_per_second

    def stats(self) -> dict:
        return {"tree_nodes": self.num_nodes, "tree_depth": self.depth,
                "tree_expected_tau": round(self.expected_tau, 4),
                "tree_expected_speedup": round(self.speedup, 4)}


def choose_tree(p, costs, max_nodes: int, max_depth: int, draft_seconds_per_level: float | None = None,
                *, draft_levels: int = 1, draft_seconds_per_node: float = 0.0) -> TreeChoice:
    """The hardware-aware tree: over node budgets 1..max_nodes and depth limits 1..max_depth, Sequoia's
    tree and its expected tokens per second (1 + E[accepted]) / (depth * draft_seconds_per_level +
    nodes * draft_seconds_per_node + costs.step_at(nodes)); the fastest (ties: fewer nodes, then
    shallower). draft_seconds_per_node: the part of drafting that grows with the nodes drafted (heads
    run per node: a chain of 4 costs far less than 4 levels of an 8-wide comb); `split_draft_cost`
    measures both parts.

    costs: a jaxdecode.costmodel.CostTable (step_at (or verify_at), draft_seconds, widths): step_at is
    the engine's whole step without the drafter, as the adaptive policy prices it. draft_seconds_per_level:
    the drafter's cost per tree level; default costs.draft_seconds / draft_levels, i.e. the table's
    propose time measured on a tree of `draft_levels` levels. The verification cost of a size beyond the
    widest measured width is not extrapolated: max_nodes must not exceed it."""
    _check_sizes(max_nodes, max_depth)
    widest = max(costs.widths)
    if max_nodes > widest:
        raise ValueError(f"max_nodes={max_nodes} exceeds the widest verification the cost table measured "
                         f"({widest} nodes): measure wider (load_or_calibrate(widths=...)) or choose "
                         f"max_nodes <= {widest}")
    if draft_seconds_per_level is None:
        if isinstance(draft_levels, bool) or not isinstance(draft_levels, int) or draft_levels < 1:
            raise ValueError(f"draft_levels must be an int >= 1, got {draft_levels!r}")
        draft_seconds_per_level = float(costs.draft_seconds) / draft_levels
    for name, v in (("draft_seconds_per_level", draft_seconds_per_level),
                    ("draft_seconds_per_node", draft_seconds_per_node)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating)) or not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    step_at = getattr(costs, "step_at", None) or costs.verify_at
    plain = 1.0 / float(step_at(0))
    seen: dict[tuple, tuple] = {}
    for depth in range(1, max_depth + 1):
        a = acceptance_matrix(p, depth)
        _, s_tab = _dp(a, max_nodes)
        for n in range(1, max_nodes + 1):
            paths = _paths_from(s_tab, n) or ((0,),)
            if paths in seen:
                continue
            nodes, d = len(paths), max(len(q) for q in paths)
            acc = expected_accepted(paths, p)
            seconds = d * draft_seconds_per_level + nodes * draft_seconds_per_node + float(step_at(nodes))
            seen[paths] = (nodes, d, 1.0 + acc, (1.0 + acc) / seconds, seconds, acc)
    ranked = sorted(seen.items(), key=lambda kv: (-kv[1][3], kv[1][0], kv[1][1]))
    paths, (nodes, d, tau, rate, seconds, acc) = ranked[0]
    cands = tuple(sorted((v[0], v[1], round(v[2], 4), v[3]) for v in seen.values()))
    return TreeChoice(paths=paths, num_nodes=nodes, depth=d, expected_accepted=acc, expected_tau=tau,
                      step_seconds=seconds, tokens_per_second=rate, plain_tokens_per_second=plain,
                      candidates=cands, ranked=tuple(kv[0] for kv in ranked))


def split_draft_cost(comb_seconds: float, width: int, depth: int, chain_seconds: float) -> tuple[float, float]:
    """(seconds per level, seconds per node) of drafting, from one propose on the profiling comb (`width`
    x `depth` nodes, `depth` levels) and one on a chain of the same depth (`depth` nodes and levels):
    comb = depth * (level + width * node), chain = depth * (level + node). Timing noise never makes a
    part negative."""
    _check_sizes(width, depth)
    if width == 1:
        return max(comb_seconds, 0.0) / depth, 0.0
    per_node = max(0.0, (comb_seconds - chain_seconds) / (depth * (width - 1)))
    per_level = max(0.0, chain_seconds / depth - per_node)
    return per_level, per_node


@dataclasses.dataclass(frozen=True)
class SizedCosts:
    """A cost table measured with a drafter of `measured_nodes` nodes, re-priced for a tree of its own
    size: a drafting step's bookkeeping (compaction, observe, statistics over the drafter's node slots)
    grows with the drafter's node count, not only with the verified width, so the profiling comb's
    table overprices small trees. step_at(w > 0) = table.step_at(w) - per_node * (measured_nodes - w);
    the plain step (w = 0) is kept. per_node comes from the width-1 steps of the comb and of a chain."""
    table: Any
    measured_nodes: int
    per_node: float

    @property
    def widths(self):
        return self.table.widths

    @property
    def draft_seconds(self):
        return self.table.draft_seconds

    @property
    def idle_seconds(self):
        return getattr(self.table, "idle_seconds", 0.0)

    @property
    def catch_up_seconds(self):
        return getattr(self.table, "catch_up_seconds", 0.0)

    def verify_at(self, width) -> float:
        return self.table.verify_at(width)

    def step_at(self, width) -> float:
        base = (getattr(self.table, "step_at", None) or self.table.verify_at)(width)
        if width <= 0:
            return base
        return max(self.table.verify_at(width), base - self.per_node * max(self.measured_nodes - width, 0))


# ----------------------------------------------------------------------------- measuring p
@dataclasses.dataclass(frozen=True)
class AcceptanceProfile:
    """Counts of a profiling run. tried[d][r]: verifications in which the rank-r child at depth d+1 was
    tried (its parent on the accepted path, ranks < r rejected); accepted[d][r]: in which it was the
    accepted one. Invalid (not proposed) nodes count as tried and rejected: the verification paid for
    them."""
    width: int
    depth: int
    tried: tuple  # int [depth][width]
    accepted: tuple  # int [depth][width]
    meta: dict = dataclasses.field(default_factory=dict, compare=False)

    @property
    def p(self) -> np.ndarray:
        """Positional acceptance over all depths: p[r] = accepted / tried (0 where never tried)."""
        t, a = np.asarray(self.tried, float).sum(0), np.asarray(self.accepted, float).sum(0)
        return np.where(t > 0, a / np.maximum(t, 1), 0.0)

    def p_by_depth(self, prior_weight: float = 8.0) -> np.ndarray:
        """p[d][r] per depth, each shrunk toward the pooled `p` by `prior_weight` pseudo-observations (deep
        levels are tried rarely: their raw ratios are noisy)."""
        t, a = np.asarray(self.tried, float), np.asarray(self.accepted, float)
        return (a + prior_weight * self.p[None]) / (t + prior_weight)

    @property
    def verifications(self) -> int:
        return int(np.asarray(self.tried)[0, 0])

    def to_json(self) -> dict:
        return {"width": self.width, "depth": self.depth, "tried": [list(map(int, r)) for r in self.tried],
                "accepted": [list(map(int, r)) for r in self.accepted], "meta": self.meta}

    @classmethod
    def from_json(cls, d: dict) -> "AcceptanceProfile":
        width, depth = int(d["width"]), int(d["depth"])
        tried, accepted = np.asarray(d["tried"], np.int64), np.asarray(d["accepted"], np.int64)
        if tried.shape != (depth, width) or accepted.shape != (depth, width) or np.any(accepted > tried) \
                or np.any(accepted < 0):
            raise ValueError(f"acceptance profile counts do not fit width={width}, depth={depth}")
        return cls(width, depth, tuple(map(tuple, tried.tolist())), tuple(map(tuple, accepted.tolist())),
                   dict(d.get("meta", {})))


# The recorder reports each step's counts to the host; runs hold this lock so that counts of two
# profiles never mix (one static callback: repeated profiles reuse the compiled loop).
_SINK_LOCK = threading.Lock()
_SINK: dict = {}


def _sink(tried, accepted):
    _SINK["tried"] += np.asarray(tried, np.int64)
    _SINK["accepted"] += np.asarray(accepted, np.int64)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _RankRecorder:
    """A drafter that delegates to `inner` (built on a static tree of known layout) and reports, after
    every verification, which sibling rank was accepted at each depth (jax.debug.callback)."""
    inner: Any
    parents: tuple = dataclasses.field(metadata=dict(static=True))  # per node, -1 = root's child
    ranks: tuple = dataclasses.field(metadata=dict(static=True))
    width: int = dataclasses.field(metadata=dict(static=True))
    depth: int = dataclasses.field(metadata=dict(static=True))

    num_nodes = property(lambda self: self.inner.num_nodes)
    max_depth = property(lambda self: self.inner.max_depth)
    child_rule = property(lambda self: self.inner.child_rule)
    is_chain = property(lambda self: bool(getattr(self.inner, "is_chain", False)))
    feature_layers = property(lambda self: tuple(getattr(self.inner, "feature_layers", ()) or ()))
    verify_widths = property(lambda self: getattr(self.inner, "verify_widths", None))
    builder = property(lambda self: getattr(self.inner, "builder", None))
    config = property(lambda self: getattr(self.inner, "config", None))

    def init(self, prompt_tokens, prompt_lengths, cache_len, key, **kw):
        return self.inner.init(prompt_tokens, prompt_lengths, cache_len, key, **kw)

    def propose(self, state, ctx, sampler):
        return self.inner.propose(state, ctx, sampler)

    def observe(self, state, obs):
        n, k, big_d = len(self.parents), self.width, self.depth
        # has[s, r]: parent slot s (0 = root, i+1 = node i) has a rank-r child.
        has = np.zeros((n + 1, k), bool)
        has[np.asarray(self.parents) + 1, np.asarray(self.ranks)] = True
        rank_of = jnp.asarray(np.append(np.asarray(self.ranks), k), jnp.int32)  # index -1 -> k ("none")
        path = obs.path[:, :big_d]  # [B, D] accepted node per depth, -1 padded
        prev = jnp.concatenate([jnp.zeros_like(path[:, :1]), path[:, :-1] + 1], axis=1)  # parent slot
        reached = jnp.concatenate([jnp.ones_like(path[:, :1], bool), path[:, :-1] >= 0], axis=1)
        reached = reached & obs.active[:, None]
        got = rank_of[jnp.where(path >= 0, path, n)]  # [B, D]: accepted rank, k = none
        r = jnp.arange(k)[None, None, :]
        child = jnp.asarray(has)[jnp.maximum(prev, 0)]  # [B, D, K]
        tried = reached[..., None] & child & (r <= got[..., None])
        acc = reached[..., None] & (r == got[..., None])
        jax.debug.callback(_sink, tried.sum(0).astype(jnp.int32), acc.sum(0).astype(jnp.int32))
        return self.inner.observe(state, obs)


def acceptance_profile(model, build_drafter: Callable[[Any], Any], prompt_tokens, prompt_lengths, *,
                       width: int = 8, depth: int = 6, rule: str = "topk", chain: bool = False,
                       verifier=None, sampler=None, max_new_tokens: int = 128, eos_ids: tuple = (),
                       key=None) -> AcceptanceProfile:
    """Measure the positional acceptance of a drafter with the real verifier.

    build_drafter(tree) -> a Drafter for `model` (a jaxdecode Model) drafting along `tree`: here a
    StaticTreeBuilder of the comb (`comb_paths(width, depth)`, children by `rule`), or with chain=True
    the spec string 'chain:{depth}' (drafters that retrieve chains; width is then 1). Speculative
    decoding of the prompts (fixed configuration, verifier default: greedy at temperature 0, else the
    lossless one for the rule) records which rank each verification accepted at each depth."""
    from jaxdecode.drafters.builders import StaticTreeBuilder
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.speculative import speculative_decode
    from jaxdecode.verifiers import default_verifier, get_verifier

    sampler = sampler or SamplerConfig(temperature=0.0)
    if chain:
        width, tree = 1, f"chain:{depth}"
        parents, ranks = tuple(range(-1, depth - 1)), (0,) * depth
    else:
        paths = comb_paths(width, depth)
        tree = StaticTreeBuilder(paths, rule)
        parents_np, ranks_np, _ = static_tree_layout(tree.paths)
        parents, ranks = tuple(map(int, parents_np)), tuple(map(int, ranks_np))
    inner = build_drafter(tree)
    if inner.num_nodes != len(parents) or inner.max_depth != depth:
        raise ValueError(f"the drafter did not take the profiling tree {tree!r} (it drafts {inner.num_nodes} "
                         f"nodes, depth {inner.max_depth})")
    recorder = _RankRecorder(inner, parents, ranks, width, depth)
    if verifier is None:
        verifier = default_verifier(inner, sampler)
    if isinstance(verifier, str):
        verifier = get_verifier(verifier)
    with _SINK_LOCK:
        _SINK.update(tried=np.zeros((depth, width), np.int64), accepted=np.zeros((depth, width), np.int64))
        out = speculative_decode(model.config, model.params, recorder, prompt_tokens, prompt_lengths,
                                 max_new_tokens=max_new_tokens, verifier=verifier, sampler=sampler,
                                 eos_ids=tuple(eos_ids), key=key if key is not None else jax.random.PRNGKey(0))
        jax.block_until_ready(out.tokens)
        jax.effects_barrier()
        tried, accepted = _SINK.pop("tried"), _SINK.pop("accepted")
    meta = {"verifier": verifier.name, "rule": "chain" if chain else rule, "temperature": sampler.temperature,
            "new_tokens": int(np.asarray(out.lengths).sum()), "rows": int(np.asarray(prompt_lengths).shape[0])}
    return AcceptanceProfile(width, depth, tuple(map(tuple, tried.tolist())),
                             tuple(map(tuple, accepted.tolist())), meta)


# ----------------------------------------------------------------------------- the model's trees, run
@dataclasses.dataclass(frozen=True)
class TreeRun:
    """What one configuration delivered decoding the calibration prompts: tau (new tokens per
    verification of a row, as the engine's stats count it; 1 for plain decoding), seconds per target
    forward of the batch (the prefill included), new tokens per second (every row)."""
    tau: float
    step_seconds: float
    tokens_per_second: float


def _batches(prompt_tokens, prompt_lengths, batch_size: int) -> list:
    """The prompts as batches of exactly batch_size rows, the last filled by cycling from the first
    prompt (jaxdecode.bench.batches_of, as `jaxdecode bench` batches)."""
    from jaxdecode.bench import batches_of
    toks, lens = np.asarray(prompt_tokens), np.asarray(prompt_lengths)
    rows, _ = batches_of(toks.shape[0], batch_size)
    return [(jnp.asarray(toks[r]), jnp.asarray(lens[r])) for r in rows]


def time_runs(model, drafters, prompt_tokens, prompt_lengths, *, batch_size: int, max_new_tokens: int,
              sampler=None, verifier=None, eos_ids: tuple = (), key=None, repeats: int = 3, mesh=None) -> list:
    """A TreeRun per drafter (None: plain decoding): each decodes the prompts, batch_size rows at a time,
    with the fixed engine (no adaptive policy: trees compared as trees); compiled by a first run, then
    all timed round robin (`repeats` rounds, the median of each), so they share the load of the moment.
    verifier: the given one, else each drafter's default for the sampler. mesh: decode on it, placed as
    generate places a sharded decode (parameters over 'model', rows over 'data')."""
    from jaxdecode.autoregressive import decode
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.speculative import speculative_decode
    from jaxdecode.verifiers import default_verifier, get_verifier

    sampler = sampler or SamplerConfig(temperature=0.0)
    key = key if key is not None else jax.random.PRNGKey(0)
    batches = _batches(prompt_tokens, prompt_lengths, batch_size)
    params = model.params
    if mesh is not None:
        from jaxdecode.sharding import shard_batch, shard_params
        params = shard_params(params, mesh)
        batches = [(shard_batch(t, mesh), shard_batch(l, mesh)) for t, l in batches]

    def runner(drafter):
        if drafter is None:
            def run():
                outs = [decode(model.config, params, t, l, max_new_tokens=max_new_tokens, sampler=sampler,
                               eos_ids=tuple(eos_ids), key=key, method="greedy" if sampler.is_greedy else "sample")
                        for t, l in batches]
                jax.block_until_ready([o.tokens for o in outs])
                new = sum(int(np.asarray(o.lengths).sum()) for o in outs)
                return new, new, sum(1 + int(np.asarray(o.lengths).max()) for o in outs)  # prefill + steps
            return run
        v = verifier if verifier is not None else default_verifier(drafter, sampler)
        v = get_verifier(v) if isinstance(v, str) else v

        def run():
            outs = [speculative_decode(model.config, params, drafter, t, l, max_new_tokens=max_new_tokens,
                                       verifier=v, sampler=sampler, eos_ids=tuple(eos_ids), key=key, mesh=mesh)
                    for t, l in batches]
            jax.block_until_ready([o.tokens for o in outs])
            new = sum(int(np.asarray(o.lengths).sum()) for o in outs)
            return (new, sum(int(np.asarray(o.stats["verify_calls"]).sum()) for o in outs),
                    sum(int(np.asarray(o.stats["target_calls"]).max()) for o in outs))  # prefill included
        return run

    runs = [runner(d) for d in drafters]
    counts = [run() for run in runs]  # compiles; (new tokens, row steps, forwards) are the same every time
    secs = [[] for _ in runs]
    for _ in range(max(1, int(repeats))):
        for i, run in enumerate(runs):
            t0 = time.perf_counter()
            run()
            secs[i].append(time.perf_counter() - t0)
    out = []
    for (new, row_steps, forwards), ss in zip(counts, secs):
        sec = float(np.median(ss))
        out.append(TreeRun(tau=new / max(row_steps, 1), step_seconds=sec / max(forwards, 1),
                           tokens_per_second=new / sec))
    return out


def size_walk(ranked, measure: Callable[[list], list], budget: int, margin: float | None = None) -> tuple:
    """The tree the measurements prefer, walking over sizes from the model's best (ranked[0]): down by
    halves (the model's best tree of (n/4, n/2] nodes, then of half that, ... to one node) while each
    step measures faster than the best so far by more than `margin` (default _WALK_MARGIN: the walk
    moves only where the measurement overturns the model); if the first step down does not, up by
    doublings (its best of (n, 2n] nodes) the same way. A tie (within the margin either way) is a flat
    stretch, not a slope up: the walk looks one step past it (the next size from the tied tree, run
    against the best) before it stops; a loss beyond the margin stops it at once. A tie left standing
    is settled by its measurement: of the trees that tied with the final best, the one that ran fastest
    against it, if faster than it at all (both are within the noise; the measured one is the better
    guess).
    measure([best, candidate]) -> their tokens per second, measured side by side. At most `budget`
    trees are measured (1: the model's choice, unmeasured). Why a walk:
    the model's ranking is right about shape but its error grows with size (deep acceptance measured
    on a comb's trajectory, branches off the top-1 path that heads do not condition on, step costs timed
    on a random context), and the error is one-sided along a size axis, which a line search follows.
    Why a look past a tie: calibration prompts that suit the drafter better than the served ones flatten
    the curve near the model's size (Hydra greedy: 8 nodes 0.83x of plain and 4 nodes 0.85x on them; 2
    and 1 nodes faster on the served prompts). Why settle a tie by it: retrieval greedy on a Zen 5 CPU
    (weight-only bf16) tied chain:12 with chain:6 on the calibration prompts (1.98x / 2.04x of plain)
    while chains of 4-6 ran ~10% faster than chain:12 on the served ones in two timed rounds."""
    margin = _WALK_MARGIN if margin is None else margin
    best = ranked[0]
    if budget <= 1:
        return best
    measured = 1

    def pick(lo, hi):  # the model's best tree of lo < nodes <= hi
        return next((q for q in ranked if lo < len(q) <= hi), None)

    ties = []  # (rate / best's rate in the same round, tree) of the trees that tied with the current best
    for direction in ("down", "up"):
        moved, stand, past_tie = False, best, False  # stand: the size the next step starts from
        while measured < budget:
            n = len(stand)
            cand = pick((n // 2) // 2, n // 2) if direction == "down" else pick(n, 2 * n)
            if cand is None:
                break
            measured += 1
            rate_best, rate_cand = measure([best, cand])
            if rate_cand > rate_best * (1.0 + margin):
                best = stand = cand
                moved, past_tie, ties = True, False, []
                continue
            if rate_cand >= rate_best * (1.0 - margin):
                ties.append((rate_cand / rate_best, cand))
                if not past_tie:
                    stand, past_tie = cand, True  # one step further from it, still measured against best
                    continue
            break
        if moved:
            break
    ratio, fastest = max(ties, key=lambda t: t[0], default=(0.0, best))
    return fastest if ratio > 1.0 else best


# ----------------------------------------------------------------------------- tree="auto"
# Settings of tree="auto" ("auto:width=4,depth=4" overrides them): the profiling comb's ranks per node
# and depth (unset: 6 for a comb, 12 for a chain: a chain adds one node a level, not `width`, and the
# drafters that retrieve chains are often right deep), the largest tree considered (default: the comb's
# size, the widest verification the cost table measures), new tokens per prompt of the profiling run
# (and at most of the walk's runs, which decode the call's max_new_tokens), and how many trees the walk
# over sizes may run (`finalists`; 1: the model's choice, nothing run).
AUTO_DEFAULTS = {"width": 8, "depth": None, "max_nodes": None, "tokens": 128, "finalists": 4}
_DEFAULT_DEPTH = {"comb": 6, "chain": 12}
PROFILE_SCHEMA = 1
TRIAL_SCHEMA = 3  # 2: the walk looks one step past a tie; 3: a tie is settled by its measurement
_PROFILE_ROWS = 16  # prompts the profiling run decodes at most (the first ones)
# Prompts the walk's runs decode (the first ones; at least one batch): the profile's own. With the first 8
# of 16, retrieval's greedy curve over chains of 3-12 ran 1.37-1.68x there and 1.48-1.89x on all 16, and
# at T = 0.7 one node led on the 8 (1.03x, every chain 0.82-0.91x) but trailed on the 16.
_TRIAL_ROWS = _PROFILE_ROWS
# How much faster a run must be to move the walk: above the spread of one round robin on the 2-core CPU
# (a tree re-run in the next step of one walk moved by 3.5-4% in step time, by up to 13% against the
# plain run beside it), and the goal's own tolerance: a tie within it does not move the walk (it looks one
# size further, and a tie left standing is settled by its measurement: `size_walk`).
_WALK_MARGIN = 0.05


def is_auto(tree) -> bool:
    return isinstance(tree, str) and tree.partition(":")[0] == "auto"


def parse_auto(spec: str) -> dict:
    """'auto' or 'auto:width=8,depth=6,max_nodes=32,tokens=128' -> settings (AUTO_DEFAULTS filled in)."""
    kind, _, rest = spec.partition(":")
    if kind != "auto":
        raise ValueError(f"not an auto tree spec: {spec!r}")
    out = dict(AUTO_DEFAULTS)
    for item in filter(None, rest.split(",")):
        name, eq, value = item.partition("=")
        if name not in AUTO_DEFAULTS or not eq or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"bad tree spec {spec!r}: 'auto' takes width=, depth=, max_nodes=, tokens=, "
                             f"finalists= (ints >= 1), e.g. 'auto:width=4,depth=5', got {item!r}")
        out[name] = int(value)
    return out


def _sampling_rule(sampler, verifier) -> str:
    """How the profiled (and the chosen) tree picks children: top-k at temperature 0; when sampling,
    without replacement (Gumbel-top-k, verified by RSD: Sequoia's robust choice), or the first rule the
    user's verifier is lossless for on a tree."""
    from jaxdecode.verifiers import get_verifier
    if sampler.is_greedy:
        return "topk"
    if verifier is None:
        return "gumbel"
    v = get_verifier(verifier) if isinstance(verifier, str) else verifier
    if v.tree_kind == "chain":
        return "sample"  # chains only: the chain's own rule (resolve_auto_tree profiles chains)
    for rule in ("gumbel", "iid", "topk"):
        if v.accepts_children(rule, False):
            return rule
    raise ValueError(f"tree='auto' drafts a branching tree, but verifier {v.name!r} is lossless for no "
                     f"branching child rule: use another verifier, or a chain (tree='chain:N')")


def _profile_drafter(build_drafter, settings: dict, rule: str, chains_only: bool = False):
    """(drafter, chain?, depth): the drafter on the deepest profiling comb it takes; drafters that
    take no tree builder (retrieval of chains), or all with chains_only, on 'chain:depth'. A ValueError
    naming why otherwise."""
    from jaxdecode.drafters.builders import StaticTreeBuilder
    width, errors = settings["width"], []
    for chain in (True,) if chains_only else (False, True):
        depth = settings["depth"] or _DEFAULT_DEPTH["chain" if chain else "comb"]
        for d in range(depth, 0, -1):  # trained heads draft to a fixed depth: the deepest they take
            tree = f"chain:{d}" if chain else StaticTreeBuilder(comb_paths(width, d), rule)
            try:
                drafter = build_drafter(tree)
            except (ValueError, TypeError) as e:
                errors.append(str(e))
                continue
            if getattr(drafter, "own_tree_shape", False):  # token_recycling, aded: no shape to choose
                raise ValueError(f"tree='auto' chooses a tree's size and shape, but the {type(drafter).__name__} "
                                 f"builds its own tree shapes: give its size instead (tree='nodes:N'; "
                                 f"token_recycling also takes a template, tree='static:4,2,1')")
            want = d if chain else width * d
            if drafter.num_nodes == want and drafter.max_depth == d:
                return drafter, chain, d
            errors.append(f"the drafter drafts {drafter.num_nodes} nodes of depth {drafter.max_depth} on "
                          f"the profiling tree {tree!r}")
    # the first error is the real cause (no draft model, no weights, a depth it cannot draft, ...)
    raise ValueError(f"tree='auto' could not build the drafter on a profiling tree: {errors[0]} (tree='auto' "
                     f"profiles drafters that draft along a tree builder: draft_lm, medusa, hydra, eagle3, "
                     f"block, ...; or retrieve chains: prompt_lookup, aggressive, retrieval). Fix that, or give "
                     f"the tree explicitly (e.g. tree='chain:4' or 'nodes:16')")


def _profile_key(model, drafter, verifier_name: str, sampler, settings: dict, chain: bool, rule: str) -> dict:
    from jaxdecode.costmodel import drafter_fingerprint, model_fingerprint
    return {"schema": PROFILE_SCHEMA, "model": model_fingerprint(model), "drafter": drafter_fingerprint(drafter),
            "verifier": verifier_name, "rule": "chain" if chain else rule,
            "sampler": [float(sampler.temperature), int(sampler.top_k), float(sampler.top_p), float(sampler.min_p)],
            "width": 1 if chain else settings["width"], "depth": drafter.max_depth, "tokens": settings["tokens"]}


def _cache_file(kind: str, key: dict, cache_dir=None) -> Path:
    """<cache_dir>/<kind>/<sha256 of the key>.json (kind: profiles, or trials: the walk's runs)."""
    from jaxdecode.costmodel import default_cache_dir
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return Path(cache_dir or default_cache_dir()) / kind / f"{digest}.json"


def _read_cached(path: Path, key: dict, parse: Callable[[dict], Any], what: str):
    """parse(the file's dict) when `path` holds one written for `key`, None when absent; a file that is
    unreadable, written for another key or not parsed is measured again with a warning, never an
    error."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("key") != json.loads(json.dumps(key)):
            raise ValueError("it was written for another model / drafter / verifier / sampler")
        return parse(data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:  # JSONDecodeError is a ValueError
        warnings.warn(f"tree='auto' cache file {path} does not hold a valid {what} ({e}); it is measured "
                      f"again and the file replaced", stacklevel=3)
        return None


def _write_cached(path: Path, key: dict, **content) -> None:
    from jaxdecode.costmodel import write_json_atomic
    try:
        write_json_atomic(path, {"key": key, **content})
    except OSError as e:  # a read-only cache must not stop decoding
        warnings.warn(f"cannot write the tree='auto' cache {path} ({e}); set JAXDECODE_CACHE_DIR to a "
                      f"writable directory", stacklevel=3)


def _walk_measured(model, build_drafter, as_tree, ranked, prompt_tokens, prompt_lengths, *, budget: int, tokens: int,
                   profile_key: dict, batch: int, sampler, verifier, eos_ids, key, cache_dir, progress, mesh=None):
    """`size_walk` over the model's ranking, each step `time_runs` of the two trees and plain decoding
    on the first prompts (at least one batch; _TRIAL_ROWS at batch 1); cached under trials/ (keyed by
    the profile's key, the ranking, the batch size, the device and the settings). ({paths: (TreeRun,
    plain decoding's tokens/s in the same round robin)}, the chosen paths)."""
    from jaxdecode.costmodel import device_fingerprint
    rows = max(batch, _TRIAL_ROWS)
    ranking = hashlib.sha256(json.dumps([list(map(list, q)) for q in ranked]).encode()).hexdigest()
    tkey = {"schema": TRIAL_SCHEMA, "profile": profile_key, "ranking": ranking, "batch_size": batch,
            "device": device_fingerprint(), "jax": jax.__version__, "rows": rows, "tokens": tokens, "budget": budget,
            "margin": _WALK_MARGIN, "mesh": None if mesh is None else {str(k): int(v) for k, v in mesh.shape.items()}}
    path = _cache_file("trials", tkey, cache_dir)

    def parse(d):
        runs = {tuple(map(tuple, r["paths"])): (TreeRun(float(r["tau"]), float(r["step_seconds"]),
                                                        float(r["tokens_per_second"])),
                                                float(r["plain_tokens_per_second"])) for r in d["runs"]}
        best = tuple(map(tuple, d["best"]))
        if best not in runs or not all(v > 0 for r, pt in runs.values() for v in (*dataclasses.astuple(r), pt)):
            raise ValueError("its runs do not hold the chosen tree")
        return runs, best

    cached = _read_cached(path, tkey, parse, "set of tree runs")
    if cached is not None:
        return cached
    toks = np.asarray(prompt_tokens)[:rows]
    lens = np.asarray(prompt_lengths)[:rows]
    _emit(progress, f"tree=auto: decoding {len(toks)} prompts x {tokens} tokens with the model's best trees and "
                    f"plain decoding side by side, walking over sizes (at most {budget} trees; once, cached in "
                    f"{path})")
    runs, built = {}, {}

    def measure(cands):  # the tree the walk stands on is re-run beside each candidate: built once
        for q in cands:
            if q not in built:
                built[q] = build_drafter(as_tree(q)[0])
        drafters = [None] + [built[q] for q in cands]
        plain, *got = time_runs(model, drafters, toks, lens, batch_size=batch, max_new_tokens=tokens,
                                sampler=sampler, verifier=verifier, eos_ids=eos_ids, key=key, mesh=mesh)
        for q, r in zip(cands, got):
            runs[q] = (r, plain.tokens_per_second)
            _emit(progress, f"tree=auto: {as_tree(q)[1]:40s} {len(q):3d} nodes: tau {r.tau:5.2f}, step "
                            f"{r.step_seconds * 1e3:8.3f} ms, {r.tokens_per_second / plain.tokens_per_second:5.2f}x "
                            f"plain decoding")
        return [r.tokens_per_second for r in got]

    best = size_walk(ranked, measure, budget, _WALK_MARGIN)
    if best not in runs:  # no other size to walk to: the model's choice, run for the stats
        measure([best])
    _write_cached(path, tkey, best=[list(q) for q in best],
                  runs=[{"paths": [list(x) for x in q], "tau": r.tau, "step_seconds": r.step_seconds,
                         "tokens_per_second": r.tokens_per_second, "plain_tokens_per_second": pt}
                        for q, (r, pt) in runs.items()])
    return runs, best


def resolve_auto_tree(model, build_drafter: Callable[[Any], Any], prompt_tokens, prompt_lengths, *,
                      spec: str = "auto", sampler=None, verifier=None, eos_ids: tuple = (),
                      max_new_tokens: int | None = None, cache_dir=None, progress=True, key=None,
                      batch_size: int | None = None, mesh=None):
    """What tree='auto' becomes for this drafter, model, batch and sampler: (tree, stats).

    build_drafter(tree) builds the drafter on a tree option (a builder or a spec string). The acceptance
    profile (`acceptance_profile` over the first prompts; cached as <cache_dir>/profiles/<sha256>.json,
    keyed by model, drafter, verifier, sampler and the settings) and the cost table of this batch size
    (jaxdecode.costmodel.load_or_calibrate, same cache dir) feed `choose_tree`, whose ranking is then
    walked over sizes by runs on the first prompts (`size_walk`, `time_runs`; cached under trials/).
    tree is a StaticTreeBuilder(paths, rule) for drafters that take builders, 'chain:L' for drafters
    that retrieve chains; stats: tree (spec string), tree_parents, tree_nodes, tree_depth,
    tree_expected_tau and tree_expected_speedup (measured by the walk's runs against plain decoding;
    from the model and the cost table with finalists=1), tree_finalists (each tree run: tree,
    model_tau, tau, step_ms, speedup) and tree_auto_seconds (the time this took: profiling,
    calibrating and running on a cache miss, reading the caches on a hit). batch_size: the
    batch decoding will run at, whose cost table prices the trees (default: the prompts' rows, as in
    generate; give it when the prompts are a calibration set of another size). mesh: the decode's; step
    costs and the walk's runs are measured on it (the acceptance profile does not depend on it)."""
    from jaxdecode.costmodel import check_batch_size, load_or_calibrate
    from jaxdecode.drafters.builders import StaticTreeBuilder
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.verifiers import default_verifier, get_verifier

    start = time.perf_counter()
    settings = parse_auto(spec)
    sampler = sampler or SamplerConfig(temperature=0.0)
    rule = _sampling_rule(sampler, verifier)
    given = get_verifier(verifier) if isinstance(verifier, str) else verifier
    chains_only = given is not None and given.tree_kind == "chain"  # e.g. verifier='chain' or 'block'
    drafter, chain, depth = _profile_drafter(build_drafter, settings, rule, chains_only)
    width = 1 if chain else settings["width"]
    if verifier is None:
        verifier = default_verifier(drafter, sampler)
    verifier = get_verifier(verifier) if isinstance(verifier, str) else verifier

    pkey = _profile_key(model, drafter, verifier.name, sampler, settings, chain, rule)
    path = _cache_file("profiles", pkey, cache_dir)
    profile = _read_cached(path, pkey, lambda d: AcceptanceProfile.from_json(d["profile"]), "acceptance profile")
    toks = np.asarray(prompt_tokens)[:_PROFILE_ROWS]
    lens = np.asarray(prompt_lengths)[:_PROFILE_ROWS]
    room = model.config.max_position_embeddings - toks.shape[1] - depth - 1  # new tokens the prompts allow
    if room < 1:
        raise ValueError(f"tree='auto' measures acceptance by decoding the prompts, but the prompts "
                         f"({toks.shape[1]} tokens) leave no room below max_position_embeddings "
                         f"({model.config.max_position_embeddings}): give the tree explicitly")
    if profile is None:
        tokens = min(settings["tokens"], room)
        _emit(progress, f"tree=auto: measuring acceptance by rank and depth ({len(toks)} prompts x "
                        f"{tokens} tokens; once, cached in {path})")
        profile = acceptance_profile(model, build_drafter, jnp.asarray(toks), jnp.asarray(lens), width=width,
                                     depth=depth, rule=rule, chain=chain, verifier=verifier, sampler=sampler,
                                     max_new_tokens=tokens, eos_ids=eos_ids, key=key)
        _write_cached(path, pkey, profile=profile.to_json())

    batch = int(np.asarray(prompt_tokens).shape[0]) if batch_size is None else check_batch_size(batch_size)
    context = int(np.max(np.asarray(prompt_lengths))) + (max_new_tokens or settings["tokens"]) // 2
    limit = model.config.max_position_embeddings - drafter.max_depth - 1
    costs = load_or_calibrate(model, drafter, batch, context_len=max(2, min(context, limit)), sampler=sampler,
                              verifier=verifier, cache_dir=cache_dir, progress=progress, any_context=True, mesh=mesh)
    max_nodes = min(settings["max_nodes"] or drafter.num_nodes, max(costs.widths))
    per_level, per_node = costs.draft_seconds / depth, 0.0
    if not chain:  # drafting cost = levels + nodes: a chain of the comb's depth tells the two apart
        try:
            chain_drafter = build_drafter(f"chain:{depth}")
        except (ValueError, TypeError):
            chain_drafter = None  # a drafter that takes no chain: its cost is priced per level
        if chain_drafter is not None and chain_drafter.num_nodes == depth:
            chain_costs = load_or_calibrate(model, chain_drafter, batch, widths=(1,),
                                            context_len=max(2, min(context, limit)), sampler=sampler,
                                            cache_dir=cache_dir, progress=progress, any_context=True, mesh=mesh)
            per_level, per_node = split_draft_cost(costs.draft_seconds, width, depth, chain_costs.draft_seconds)
            bookkeeping = (costs.step_at(1) - chain_costs.step_at(1)) / max(drafter.num_nodes - depth, 1)
            costs = SizedCosts(costs, drafter.num_nodes, max(0.0, bookkeeping))
    p = profile.p_by_depth()
    choice = choose_tree(p, costs, max_nodes, depth, draft_seconds_per_level=per_level,
                         draft_seconds_per_node=per_node)

    def as_tree(paths):  # (the drafter's tree option, its display spec)
        if chain or (rule == "topk" and all(q == (0,) * len(q) for q in paths)):  # greedy chains: 'chain:L'
            return (f"chain:{len(paths)}",) * 2
        return StaticTreeBuilder(paths, rule), tree_spec(paths, rule)

    runs = {}
    if settings["finalists"] > 1:  # the model's ranking, walked over sizes by measured runs
        tokens = max(1, min(settings["tokens"], max_new_tokens or settings["tokens"], room))  # what will run
        runs, best = _walk_measured(model, build_drafter, as_tree, choice.ranked, prompt_tokens, prompt_lengths,
                                    budget=settings["finalists"], tokens=tokens, profile_key=pkey, batch=batch,
                                    sampler=sampler, verifier=given, eos_ids=eos_ids, key=key, cache_dir=cache_dir,
                                    progress=progress, mesh=mesh)
        run, plain_tps = runs[best]
        choice = dataclasses.replace(choice, paths=best, num_nodes=len(best), depth=max(map(len, best)),
                                     expected_accepted=run.tau - 1.0, expected_tau=run.tau,
                                     step_seconds=run.step_seconds, tokens_per_second=run.tokens_per_second,
                                     plain_tokens_per_second=plain_tps)
    parents, _, _ = static_tree_layout(choice.paths)
    tree, spec_str = as_tree(choice.paths)
    stats = {"tree": spec_str, "tree_parents": [int(x) for x in parents], **choice.stats(),
             "tree_finalists": [{"tree": as_tree(q)[1], "model_tau": round(1.0 + expected_accepted(q, p), 4),
                                 "tau": round(r.tau, 4), "step_ms": round(r.step_seconds * 1e3, 4),
                                 "speedup": round(r.tokens_per_second / pt, 4)} for q, (r, pt) in runs.items()],
             "tree_draft_ms_per_level": round(per_level * 1e3, 4), "tree_draft_ms_per_node": round(per_node * 1e3, 4),
             "tree_step_ms_per_node": round(getattr(costs, "per_node", 0.0) * 1e3, 4),
             "tree_auto_seconds": round(time.perf_counter() - start, 4)}  # profiling + calibration
    return tree, stats
