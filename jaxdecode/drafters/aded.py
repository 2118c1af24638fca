"""ADED (Liu et al., "Adaptive Draft-Verification for Efficient Large Language Model Decoding", AAAI
2025): a tri-gram model of the target's output, updated from the decoded text, drives an MCTS-style
draft search that balances exploitation (likely continuations) and exploration (less-visited ones).

Provenance: the paper's abstract and public summaries could be read (tri-gram matrix "LLM
representative" with the top entries per context, adaptively updated during decoding; an MCTS draft
maker whose PUCT score mixes the tri-gram probabilities with visit counts). The table layout and the
fixed-budget search below are our own static-shape design from that description.

Tri-gram table (per row, static shapes). Contexts (a, b) = the two tokens before a position are
hashed into `table_size` buckets; a bucket stores its exact context (a, b) and `topk` (token, count)
candidates. A bucket holding another context is taken over (its counts restart: recency wins, like a
direct-mapped cache), so a lookup never mixes contexts. Bigram contexts use a = vocab_size (no first
token) in the same table and serve as the back-off when a tri-gram context is unknown. Within a
bucket, counts follow Space-Saving: a seen token gets +1; an unseen one replaces the smallest count c
and gets c + 1 (an empty slot has c = 0). `decay` < 1 multiplies a bucket's counts before each update,
so recent text weighs more. `init` counts the prompt's tri-grams and bi-grams (one lax.scan over prompt
positions); `observe` counts every newly committed token (<= max_depth + 1 per step), so the table
adapts as decoding goes. An optional corpus prior (`fit_corpus`) plays the part of the paper's
datastore.

Draft search (fixed budget, vectorised over the batch). The tree grows by `num_nodes` simulations, each
adding exactly one node while the tree can still grow:
  - select: from the root (the pending token), repeatedly pick among the current node's candidates
    (its context's top-k, probabilities P = counts / total) the one maximising the PUCT score
        Q(s, a) + c_puct * P(s, a) * sqrt(N(s) + 1) / (1 + N(s, a))
    with N the visit counts of this search and Q(s, a) the mean reward of the simulations through
    (s, a) (0 when unvisited); candidates whose subtree cannot grow (depth limit, no candidates) are
    skipped;
  - expand: the first chosen candidate that is not yet in the tree becomes a node;
  - evaluate: the reward is the node's estimated acceptance probability, the product of P along its
    path (what the tri-gram model predicts the target will accept);
  - back up: N += 1 and the reward is added along the path.
Exploitation: high-P, high-reward subtrees get deeper; exploration: the sqrt(N)/(1+N(s,a)) bonus
gives untried siblings a turn as their parent is visited more. Nodes are indexed in creation order,
which is topological. Drafts are point masses (child_rule "point"): verify with "greedy" or
"point_mass". Rows with fewer reachable candidates leave trailing nodes invalid.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.drafters.ngram import check_int
from jaxdecode.tree import Tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrigramTable:
    """Hashed tri-gram counts; leading axis B (per row) or none (a shared corpus prior)."""
    key_a: jax.Array  # int32[..., T]: context first token (vocab_size = none); -1 = empty bucket
    key_b: jax.Array  # int32[..., T]: context second token
    tokens: jax.Array  # int32[..., T, K]: candidate next tokens, -1 = empty slot
    counts: jax.Array  # f32[..., T, K]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ADEDState:
    table: TrigramTable
    seen: jax.Array  # int32[B]: history tokens already counted


def _hash(a, b, size: int):
    """Bucket of context (a, b): a 32-bit multiplicative mix, mod the table size."""
    x = a.astype(jnp.uint32) * jnp.uint32(0x9E3779B1) ^ (b.astype(jnp.uint32) + jnp.uint32(0x7F4A7C15))
    x = x * jnp.uint32(0x85EBCA77)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0xC2B2AE3D)
    x = x ^ (x >> 13)
    return (x % jnp.uint32(size)).astype(jnp.int32)


def table_add(table: TrigramTable, a, b, nxt, ok, decay: float) -> TrigramTable:
    """Count `nxt` after context (a, b) for the rows where `ok` (all [B]); see the module doc."""
    size, k = table.tokens.shape[-2:]
    rows = jnp.arange(a.shape[0])
    bucket = _hash(a, b, size)
    same = (table.key_a[rows, bucket] == a) & (table.key_b[rows, bucket] == b)
    toks = jnp.where(same[:, None], table.tokens[rows, bucket], -1)
    cnts = jnp.where(same[:, None], table.counts[rows, bucket] * decay, 0.0)
    hit = toks == nxt[:, None]
    slot = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1), jnp.argmin(cnts, axis=1))
    one = jax.nn.one_hot(slot, k, dtype=bool)
    toks = jnp.where(one, nxt[:, None], toks)
    cnts = jnp.where(one, cnts + 1.0, cnts)
    tgt = jnp.where(ok, bucket, size)  # out of range: dropped
    return TrigramTable(key_a=table.key_a.at[rows, tgt].set(a, mode="drop"),
                        key_b=table.key_b.at[rows, tgt].set(b, mode="drop"),
                        tokens=table.tokens.at[rows, tgt].set(toks, mode="drop"),
                        counts=table.counts.at[rows, tgt].set(cnts, mode="drop"))


def table_lookup(table: TrigramTable, a, b, none: int):
    """Candidates after (a, b), backing off to (none, b): (tokens int32[..., K] with -1 = none,
    probabilities f32[..., K]), sorted by count. a, b: int[B, ...]."""
    size = table.tokens.shape[-2]
    rows = jnp.arange(a.shape[0]).reshape((-1,) + (1,) * (a.ndim - 1))

    def exact(x, y):
        bucket = _hash(x, y, size)
        same = (table.key_a[rows, bucket] == x) & (table.key_b[rows, bucket] == y)
        return (jnp.where(same[..., None], table.tokens[rows, bucket], -1),
                jnp.where(same[..., None], table.counts[rows, bucket], 0.0))

    tri_tok, tri_cnt = exact(a, b)
    bi_tok, bi_cnt = exact(jnp.full_like(a, none), b)
    use_tri = jnp.sum(tri_cnt, axis=-1, keepdims=True) > 0
    toks = jnp.where(use_tri, tri_tok, bi_tok)
    cnts = jnp.where(toks >= 0, jnp.where(use_tri, tri_cnt, bi_cnt), 0.0)
    cnts, order = jax.lax.top_k(cnts, cnts.shape[-1])
    toks = jnp.take_along_axis(toks, order, axis=-1)
    total = jnp.sum(cnts, axis=-1, keepdims=True)
    probs = jnp.where(total > 0, cnts / jnp.where(total > 0, total, 1.0), 0.0)
    return jnp.where(cnts > 0, toks, -1), probs


def mcts_tree(lookup, root_tok, root_prev, *, num_nodes: int, max_depth: int, c_puct: float):
    """The fixed-budget PUCT draft search of the module doc.

    lookup(a[B], b[B]) -> (tokens int32[B, K] (-1 = none), probs f32[B, K]) gives the candidates after
    context (a, b). Returns (Tree, reward f32[B, N]) where reward is each node's path probability."""
    b = root_tok.shape[0]
    n, d_max, s = num_nodes, max_depth, num_nodes + 1
    rows = jnp.arange(b)
    c0_tok, c0_p = lookup(root_prev, root_tok)
    k = c0_tok.shape[1]

    def put(arr, idx, val, mask):  # arr[b, idx[b]] = val[b] where mask (else untouched)
        return arr.at[rows, jnp.where(mask, idx, arr.shape[1])].set(val, mode="drop")

    st = dict(
        s_tok=jnp.zeros((b, s), jnp.int32).at[:, 0].set(root_tok),
        s_depth=jnp.zeros((b, s), jnp.int32),
        s_pathp=jnp.zeros((b, s), jnp.float32).at[:, 0].set(1.0),
        cand_tok=jnp.full((b, s, k), -1, jnp.int32).at[:, 0].set(c0_tok),
        cand_p=jnp.zeros((b, s, k), jnp.float32).at[:, 0].set(c0_p),
        child=jnp.full((b, s, k), -1, jnp.int32),
        visits=jnp.zeros((b, s), jnp.float32),
        wsum=jnp.zeros((b, s), jnp.float32),
        full=jnp.zeros((b, s), bool).at[:, 0].set(jnp.all(c0_tok < 0, axis=1)),
        used=jnp.zeros((b,), jnp.int32),
        parents=jnp.full((b, n), -1, jnp.int32),
    )

    def slot_full(st, slot):
        """Can nothing more grow below `slot` [B]? (depth limit, or every candidate is absent or an
        exhausted child)."""
        ch = st["child"][rows, slot]
        ch_full = jnp.take_along_axis(st["full"], jnp.maximum(ch, 0), axis=1) & (ch >= 0)
        dead = (st["cand_tok"][rows, slot] < 0) | ch_full
        return (st["s_depth"][rows, slot] >= d_max) | jnp.all(dead, axis=1)

    def descend_one(depth, carry):
        """One level of the selection walk: `cur` (at depth `depth`) picks a candidate by PUCT; a
        known child is entered, a new one is created (and the walk ends)."""
        st, cur, path, going, made, new, new_ctx = carry
        ch = st["child"][rows, cur]  # [B, K]
        ctok, cp = st["cand_tok"][rows, cur], st["cand_p"][rows, cur]
        have = ch >= 0
        chs = jnp.maximum(ch, 0)
        ch_full = jnp.take_along_axis(st["full"], chs, axis=1) & have
        avail = (ctok >= 0) & ~ch_full
        n_ch = jnp.where(have, jnp.take_along_axis(st["visits"], chs, axis=1), 0.0)
        q = jnp.where(have, jnp.take_along_axis(st["wsum"], chs, axis=1) / jnp.maximum(n_ch, 1.0), 0.0)
        u = c_puct * cp * jnp.sqrt(st["visits"][rows, cur] + 1.0)[:, None] / (1.0 + n_ch)
        a = jnp.argmax(jnp.where(avail, q + u, -jnp.inf), axis=1)
        going = going & jnp.any(avail, axis=1)
        pick = jnp.take_along_axis(ch, a[:, None], axis=1)[:, 0]
        descend = going & (pick >= 0)
        create = going & (pick < 0)
        # Expand: a new node at slot used + 1, child of `cur`.
        slot = st["used"] + 1
        tok = jnp.take_along_axis(ctok, a[:, None], axis=1)[:, 0]
        prob = jnp.take_along_axis(cp, a[:, None], axis=1)[:, 0]
        st = dict(st)
        st["s_tok"] = put(st["s_tok"], slot, tok, create)
        st["s_depth"] = put(st["s_depth"], slot, jnp.broadcast_to(depth + 1, (b,)), create)
        st["s_pathp"] = put(st["s_pathp"], slot, st["s_pathp"][rows, cur] * prob, create)
        st["child"] = st["child"].at[rows, jnp.where(create, cur, s), a].set(slot, mode="drop")
        st["parents"] = put(st["parents"], slot - 1, cur - 1, create)
        st["used"] = st["used"] + create.astype(jnp.int32)
        made = made | create
        new = jnp.where(create, slot, new)
        new_ctx = jnp.where(create, st["s_tok"][rows, cur], new_ctx)
        nxt = jnp.where(descend, pick, jnp.where(create, slot, cur))
        path = path.at[:, depth + 1].set(jnp.where(descend | create, nxt, -1))
        return st, nxt, path, descend, made, new, new_ctx

    def simulate(_, st):
        zeros = jnp.zeros((b,), jnp.int32)
        path = jnp.full((b, d_max + 1), -1, jnp.int32).at[:, 0].set(0)
        carry = (st, zeros, path, ~st["full"][:, 0], jnp.zeros((b,), bool), zeros, zeros)
        # The walk never enters an exhausted node, so it creates a node within d_max levels.
        st, _, path, _, made, new, new_ctx = jax.lax.fori_loop(0, d_max, descend_one, carry)
        # The new node's candidates (one table lookup per simulation).
        ntok, nprob = lookup(new_ctx, st["s_tok"][rows, new])
        st = dict(st)
        st["cand_tok"] = put(st["cand_tok"], new, ntok, made)
        st["cand_p"] = put(st["cand_p"], new, nprob, made)
        # Back up the new node's reward along its path, then refresh which path nodes are exhausted
        # (bottom-up, so a parent sees its children's new state; this also settles the new node).
        reward = jnp.where(made, st["s_pathp"][rows, new], 0.0)
        idx = jnp.where((path >= 0) & made[:, None], path, s)
        st["visits"] = st["visits"].at[rows[:, None], idx].add(1.0, mode="drop")
        st["wsum"] = st["wsum"].at[rows[:, None], idx].add(reward[:, None], mode="drop")

        def refresh(i, full):
            p = path[:, d_max - i]
            return put(full, p, slot_full({**st, "full": full}, jnp.maximum(p, 0)), p >= 0)

        st["full"] = jax.lax.fori_loop(0, d_max + 1, refresh, st["full"])
        return st

    st = jax.lax.fori_loop(0, n, simulate, st)
    node = jnp.arange(n)[None, :]
    valid = node < st["used"][:, None]
    tokens = jnp.where(valid, st["s_tok"][:, 1:], 0)
    parents = jnp.where(valid, st["parents"], jnp.maximum(node - 1, -1))  # invalid: any earlier index
    reward = jnp.where(valid, st["s_pathp"][:, 1:], 0.0)
    return Tree(tokens=tokens, parents=parents.astype(jnp.int32), valid=valid), reward


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ADEDDrafter:
    """ADED: adaptive tri-gram table + fixed-budget PUCT tree search (see the module docstring)."""

    vocab_size: int = dataclasses.field(metadata=dict(static=True))
    num_nodes: int = dataclasses.field(default=16, metadata=dict(static=True))
    max_depth: int = dataclasses.field(default=6, metadata=dict(static=True))  # capped at num_nodes
    table_size: int = dataclasses.field(default=4096, metadata=dict(static=True))
    topk: int = dataclasses.field(default=8, metadata=dict(static=True))
    c_puct: float = dataclasses.field(default=1.0, metadata=dict(static=True))
    decay: float = dataclasses.field(default=1.0, metadata=dict(static=True))
    prior: TrigramTable | None = None  # optional corpus counts (no batch axis), see fit_corpus

    own_tree_shape = True  # builds its own shapes: tree="auto" is refused (treeopt), sized by its node budget
    child_rule = "point"
    is_chain = False

    def __post_init__(self):
        owner = "ADEDDrafter"
        check_int(owner, "vocab_size", self.vocab_size, 1)
        check_int(owner, "num_nodes", self.num_nodes, 1)
        check_int(owner, "max_depth", self.max_depth, 1)
        # A tree of num_nodes nodes is at most that deep (tree="chain:3" under the default depth 6).
        object.__setattr__(self, "max_depth", min(self.max_depth, self.num_nodes))
        check_int(owner, "table_size", self.table_size, 1)
        check_int(owner, "topk", self.topk, 1)
        for name, val, lo_open in (("c_puct", self.c_puct, False), ("decay", self.decay, True)):
            if not isinstance(val, numbers.Real) or isinstance(val, bool) or not math.isfinite(val) \
                    or val < 0 or (lo_open and not 0 < val <= 1):
                rng = "in (0, 1]" if lo_open else ">= 0"
                raise ValueError(f"{owner}: {name} must be a finite number {rng}, got {val!r}")
        shape = getattr(getattr(self.prior, "tokens", None), "shape", None)
        if isinstance(shape, tuple) and shape != (self.table_size, self.topk):
            raise ValueError(f"{owner}: prior table has shape {shape}, expected [table_size, topk] = "
                             f"[{self.table_size}, {self.topk}]: build it with fit_corpus")

    # ------------------------------------------------------------------ table
    def empty_table(self, batch: int | None) -> TrigramTable:
        lead = () if batch is None else (batch,)
        t, k = self.table_size, self.topk
        return TrigramTable(key_a=jnp.full(lead + (t,), -1, jnp.int32),
                            key_b=jnp.full(lead + (t,), -1, jnp.int32),
                            tokens=jnp.full(lead + (t, k), -1, jnp.int32),
                            counts=jnp.zeros(lead + (t, k), jnp.float32))

    def count_sequences(self, table: TrigramTable, tokens, lengths) -> TrigramTable:
        """Count every position 1..length-1 of tokens[B, P] (tri-gram and bi-gram contexts)."""
        p = tokens.shape[1]
        offsets = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), tokens.shape)
        return self._count(table, tokens, offsets, offsets < lengths[:, None])

    def _count(self, table: TrigramTable, tokens, offsets, valid) -> TrigramTable:
        """One lax.scan over positions of tokens[B, P]; offsets[B, P] = index within its own sequence
        (contexts never reach across a sequence start); valid[B, P] = count this position."""
        none = self.vocab_size
        tokens = tokens.astype(jnp.int32)

        def step(tab, q):
            a = jnp.where(offsets[:, q] >= 2, tokens[:, jnp.maximum(q - 2, 0)], none)
            bb = tokens[:, q - 1]
            nxt = tokens[:, q]
            ok = valid[:, q] & (offsets[:, q] >= 1)
            tab = table_add(tab, a, bb, nxt, ok & (a != none), self.decay)
            return table_add(tab, jnp.full_like(bb, none), bb, nxt, ok, self.decay), None

        if tokens.shape[1] < 2:
            return table
        table, _ = jax.lax.scan(step, table, jnp.arange(1, tokens.shape[1]))
        return table

    def fit_corpus(self, sequences) -> "ADEDDrafter":
        """A copy whose table starts from the counts of `sequences` (lists of token ids), the role of
        the paper's corpus datastore. The sequences are counted in order, in one scan."""
        seqs = [np.asarray(q, np.int64).reshape(-1) for q in sequences]
        flat = np.concatenate(seqs) if seqs else np.zeros((0,), np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= self.vocab_size):
            raise ValueError(f"ADEDDrafter.fit_corpus: token ids must be in [0, {self.vocab_size})")
        offsets = np.concatenate([np.arange(q.size) for q in seqs]) if seqs else flat
        table = jax.jit(self._count)(self.empty_table(1), jnp.asarray(flat[None], jnp.int32),
                                     jnp.asarray(offsets[None], jnp.int32),
                                     jnp.ones((1, flat.size), bool))
        return dataclasses.replace(self, prior=jax.tree_util.tree_map(lambda x: x[0], table))

    # ------------------------------------------------------------------ protocol
    def init(self, prompt_tokens, prompt_lengths, cache_len, key):
        b = prompt_tokens.shape[0]
        if self.prior is None:
            table = self.empty_table(b)
        else:
            table = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (b,) + x.shape), self.prior)
        lengths = jnp.asarray(prompt_lengths, jnp.int32)
        table = self.count_sequences(table, prompt_tokens, lengths)
        return ADEDState(table=table, seen=lengths)

    def propose(self, state: ADEDState, ctx, sampler):
        hist, hl = ctx.history, ctx.hist_len
        rows = jnp.arange(hist.shape[0])
        root = hist[rows, hl - 1].astype(jnp.int32)
        prev = jnp.where(hl >= 2, hist[rows, jnp.maximum(hl - 2, 0)], self.vocab_size).astype(jnp.int32)
        lookup = lambda a, bb: table_lookup(state.table, a, bb, self.vocab_size)  # noqa: E731
        tree, _ = mcts_tree(lookup, root, prev, num_nodes=self.num_nodes, max_depth=self.max_depth,
                            c_puct=self.c_puct)
        return tree, None, state

    def observe(self, state: ADEDState, obs):
        hist, hl = obs.history, obs.hist_len
        none, width = self.vocab_size, hist.shape[1]
        rows = jnp.arange(hist.shape[0])

        def count(i, tab):
            p = state.seen + i  # a newly committed position
            ok = (p < hl) & obs.active
            pc = jnp.clip(p, 0, width - 1)
            a = jnp.where(p >= 2, hist[rows, jnp.clip(p - 2, 0, width - 1)], none)
            bb = hist[rows, jnp.clip(p - 1, 0, width - 1)]
            nxt = hist[rows, pc]
            tab = table_add(tab, a, bb, nxt, ok & (a != none) & (p >= 1), self.decay)
            return table_add(tab, jnp.full_like(bb, none), bb, nxt, ok & (p >= 1), self.decay)

        # One step commits at most max_depth + 1 tokens (accepted path + bonus).
        table = jax.lax.fori_loop(0, self.max_depth + 1, count, state.table)
        return ADEDState(table=table, seen=jnp.where(obs.active, hl, state.seen))
