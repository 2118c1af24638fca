"""Token trees: the draft structure shared by drafters, tree builders, verifiers and the kernel.

A tree of N draft nodes per row is `parents: int32[B, N]` (−1 = child of the root, i.e. of the last
committed token; otherwise the index of an earlier node: parents[i] < i, so nodes are topologically
ordered and any root-to-node path is increasing in index) plus `tokens: int32[B, N]` and
`valid: bool[B, N]` (rows may use fewer than N nodes; invalid nodes are never accepted or attended).

Distributions over the tree are indexed by *parent slot*: slot 0 is the root, slot i+1 is node i. So a
target array `p[B, N+1, V]` holds, at slot s, the next-token distribution after the path ending at s;
node i's own token is scored by p[:, parents[i]+1].
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


class TreeError(ValueError):
    """A parents array that is not a valid token tree."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    tokens: jax.Array  # int32[B, N]
    parents: jax.Array  # int32[B, N]; -1 = root's child; parents[i] < i
    valid: jax.Array  # bool[B, N]
    # int32[B, N] or None: the drafter's confidence class of each node (the retrieval drafter: the
    # length of the match it was retrieved on, minus one), a function of the past. An adaptive policy
    # keyed by class (AdaptivePolicy.classes) estimates acceptance per class rather than per position.
    classes: jax.Array | None = None

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def replace(self, **kw) -> "Tree":
        return dataclasses.replace(self, **kw)


def validate_parents(parents, num_nodes: int | None = None) -> np.ndarray:
    """Host-side check of a parents array ([N] or [B, N]); raises TreeError naming the problem."""
    p = np.asarray(parents)
    if p.ndim not in (1, 2):
        raise TreeError(f"parents must have shape [N] or [B, N], got {p.shape}")
    if not np.issubdtype(p.dtype, np.integer):
        raise TreeError(f"parents must be integers, got dtype {p.dtype}")
    rows = p.reshape(-1, p.shape[-1])
    n = rows.shape[1]
    if num_nodes is not None and n != num_nodes:
        raise TreeError(f"parents has {n} nodes, expected {num_nodes}")
    idx = np.arange(n)
    for r, row in enumerate(rows):
        where = f" (row {r})" if p.ndim == 2 else ""
        if np.any(row < -1) or np.any(row >= n):
            bad = int(idx[(row < -1) | (row >= n)][0])
            raise TreeError(f"parents[{bad}] = {row[bad]}{where} is out of range: use -1 for a child of "
                            f"the root or the index 0..{n - 1} of an earlier node")
        self_loop = row == idx
        if np.any(self_loop):
            bad = int(idx[self_loop][0])
            raise TreeError(f"parents[{bad}] = {bad}{where}: a node cannot be its own parent (cycle)")
        late = row > idx
        if np.any(late):
            bad = int(idx[late][0])
            # Distinguish a true cycle from a mere ordering problem, to say how to fix it.
            seen, j = set(), bad
            while j != -1 and j not in seen:
                seen.add(j)
                j = int(row[j])
            kind = "forms a cycle" if j != -1 else "comes after its child"
            raise TreeError(f"parents[{bad}] = {row[bad]}{where}: the parent {kind}; nodes must be "
                            f"topologically ordered (every parent index smaller than its child's)")
    return p.astype(np.int32)


def depths(parents: jax.Array) -> jax.Array:
    """Depth of each node (root's children have depth 1). parents: [..., N] -> int32[..., N]."""
    return jnp.sum(ancestor_mask(parents), axis=-1, dtype=jnp.int32)


def ancestor_mask(parents: jax.Array) -> jax.Array:
    """A[..., i, j] = node j is node i or an ancestor of i. parents: [..., N] -> bool[..., N, N].

    Pointer jumping: after round k, row i holds i and its 2^k - 1 nearest ancestors, and jump[i] is its
    2^k-th ancestor (-1 past the root); so ceil(log2 N) rounds of a row gather, not a loop over the N
    nodes (one device round trip per node on a GPU: ~15 us each, which made a 256-node verification
    cost 10 ms there). Parents come before their children (`validate_parents`)."""
    n = parents.shape[-1]
    reach = jnp.broadcast_to(jnp.eye(n, dtype=bool), parents.shape + (n,))
    jump = parents.astype(jnp.int32)
    for _ in range(max(n - 1, 0).bit_length()):
        has = jump >= 0
        safe = jnp.maximum(jump, 0)
        above = jnp.take_along_axis(reach, safe[..., :, None], axis=-2)  # row i = reach[jump[i]]
        reach = reach | (above & has[..., None])
        jump = jnp.where(has, jnp.take_along_axis(jump, safe, axis=-1), -1)
    return reach


def tree_attention_mask(tree: Tree) -> jax.Array:
    """Mask among the N new tokens of a verification forward: ancestors, valid nodes only."""
    return ancestor_mask(tree.parents) & tree.valid[:, None, :] & tree.valid[:, :, None]


def tree_positions(tree: Tree, prefix_lengths: jax.Array) -> jax.Array:
    """Position of each node: committed prefix length + depth − 1 (the root's children come next)."""
    return prefix_lengths[:, None] + depths(tree.parents) - 1


def path_to_keep(path_nodes: jax.Array, num_nodes: int) -> jax.Array:
    """Accepted path (node indices, −1 padded) -> keep mask bool[B, N] for `commit`."""
    hit = path_nodes[:, :, None] == jnp.arange(num_nodes)[None, None, :]
    return jnp.any(hit & (path_nodes[:, :, None] >= 0), axis=1)


def chain_tree(tokens: jax.Array, valid: jax.Array | None = None) -> Tree:
    """A chain (γ draft tokens, each the child of the previous) as a Tree."""
    b, n = tokens.shape
    parents = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (b, n))
    valid = jnp.ones((b, n), bool) if valid is None else valid
    return Tree(tokens=tokens.astype(jnp.int32), parents=parents, valid=valid)


def static_tree_parents(paths) -> np.ndarray:
    """Medusa-style "choices": a list of paths of child ranks, e.g. [(0,), (1,), (0, 0), (0, 1)].

    Returns (parents int32[N], ranks int32[N]) with nodes ordered by depth then path, where ranks[i]
    is node i's rank among its siblings (the drafter fills node i with its parent's ranks[i]-th
    candidate). Every prefix of a path must itself be a path.
    """
    paths = [tuple(int(x) for x in p) for p in paths]
    if not paths:
        raise TreeError("a static tree needs at least one path")
    if len(set(paths)) != len(paths):
        raise TreeError("static tree paths contain duplicates")
    ordered = sorted(paths, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(ordered)}
    parents, ranks = [], []
    for p in ordered:
        if len(p) == 0 or min(p) < 0:
            raise TreeError(f"static tree path {p} must be a non-empty tuple of ranks >= 0")
        if len(p) > 1 and p[:-1] not in index:
            raise TreeError(f"static tree path {p} has no parent path {p[:-1]}: include every prefix")
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
        ranks.append(p[-1])
    return np.asarray(parents, np.int32), np.asarray(ranks, np.int32)


def static_tree_layout(paths) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(parents, sibling ranks, depths) of a static tree given as paths (see static_tree_parents)."""
    parents, ranks = static_tree_parents(paths)
    depth = np.zeros(len(parents), np.int32)
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    return parents, ranks, depth


# ----------------------------------------------------------------------------- constraints on trees
# A constraint (jaxdecode.constraints.protocol) keeps one state per row: a pytree whose leaves have a
# leading row axis. On a tree every node has its own state, the one after its root-to-node path, so
# the leaves gain a slot axis: [B, S, ...] with the parent-slot convention (slot 0 the root).

def _flat(state):
    """Leaves [B, S, ...] -> [B*S, ...]: one constraint row per slot."""
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), state)


def _unflat(state, b: int):
    return jax.tree.map(lambda x: x.reshape((b, -1) + x.shape[1:]), state)


def slot_gather(state, idx):
    """state leaves [B, S, ...], idx int32[B, K] (in 0..S-1) -> leaves [B, K, ...]."""
    rows = jnp.arange(idx.shape[0])[:, None]
    return jax.tree.map(lambda x: x[rows, idx], state)


def broadcast_slots(row_state, num_slots: int):
    """A per-row state (leaves [B, ...]) repeated into num_slots slots: leaves [B, S, ...]."""
    return jax.tree.map(lambda x: jnp.repeat(x[:, None], num_slots, axis=1), row_state)


def advance_slots(constraint, parent_states, tokens):
    """The states after `tokens` int32[B, F] from parent_states (leaves [B, F, ...]): leaves [B, F, ...]."""
    b = tokens.shape[0]
    return _unflat(constraint.advance(_flat(parent_states), tokens.reshape(-1)), b)


def complete_slots(constraint, states):
    """bool[B, S]: the constraint's `complete` (an item ended without an EOS) at each slot."""
    b = jax.tree.leaves(states)[0].shape[0]
    return constraint.complete(_flat(states)).reshape(b, -1)


def allowed_slots(constraint, states, width: int):
    """bool[B, S, width]: the tokens the constraint allows after each slot's path."""
    b = jax.tree.leaves(states)[0].shape[0]
    return constraint.allowed(_flat(states), width).reshape(b, -1, width)


def constrain_tree(constraint, root_state, tree: Tree, width: int, depth: int, eos_ids: tuple = ()):
    """The tree pruned by a constraint: (tree, slot states (leaves [B, N+1, ...]), allowed bool[B, N+1, width]).

    root_state: the rows' constraint states after every committed token (leaves [B, ...]). A node stays
    valid when it was, its parent stays and its token is allowed after its parent's path (an EOS id
    exactly at accepting states; nothing after an EOS or a completed item). depth: a bound on the
    tree's depth: each of the `depth` passes moves every node's state one level further from the root,
    so the work is depth gathers over the whole tree, not one per node."""
    b, n = tree.tokens.shape
    par_slot = jnp.maximum(tree.parents, -1) + 1  # [B, N]
    root = jax.tree.map(lambda x: x[:, None], root_state)
    cat = lambda r, s: jax.tree.map(lambda a, c: jnp.concatenate([a, c], axis=1), r, s)

    def grow(_, slots):
        return cat(root, advance_slots(constraint, slot_gather(slots, par_slot), tree.tokens))

    slots = jax.lax.fori_loop(0, depth, grow, broadcast_slots(root_state, n + 1)) if n else broadcast_slots(
        root_state, 1)
    allowed = allowed_slots(constraint, slots, width)  # [B, N+1, width]
    if n == 0:
        return tree, slots, allowed
    rows = jnp.arange(b)[:, None]
    in_vocab = (tree.tokens >= 0) & (tree.tokens < width)
    ok = allowed[rows, par_slot, jnp.clip(tree.tokens, 0, width - 1)] & in_vocab  # [B, N]
    # Nothing follows an EOS or a completed item, whatever the constraint's state there says.
    ended = complete_slots(constraint, slots)
    for e in eos_ids:
        ended = ended.at[:, 1:].set(ended[:, 1:] | (tree.tokens == e))
    keep = tree.valid & ok & ~ended[rows, par_slot]

    def prune(_, valid):  # an invalid parent invalidates its subtree
        return keep & ((tree.parents < 0) | valid[rows, jnp.maximum(tree.parents, 0)])

    return tree.replace(valid=jax.lax.fori_loop(0, depth, prune, keep)), slots, allowed


def mask_logits(logits, allowed):
    """logits [..., V] with forbidden tokens at -inf; a slot that allows nothing (past an EOS, a
    finished row) is left as it is: nothing verified there is ever committed."""
    usable = jnp.any(allowed, axis=-1, keepdims=True)
    return jnp.where(allowed | ~usable, logits, -jnp.inf)


def mask_logprobs(logq, allowed):
    """Log-probabilities [..., V] restricted to the allowed tokens and renormalised (a slot that
    allows nothing is left as it is)."""
    masked = mask_logits(logq, allowed)
    lse = jax.nn.logsumexp(masked, axis=-1, keepdims=True)
    return jnp.where(jnp.isfinite(lse), masked - lse, masked)  # no mass on any allowed token: as is


def mask_probs(q, allowed):
    """Probabilities [..., V] restricted to the allowed tokens and renormalised (a slot that allows
    nothing is left as it is; allowed tokens of zero total mass stay zero)."""
    usable = jnp.any(allowed, axis=-1, keepdims=True)
    qm = jnp.where(allowed, q, 0.0)
    s = jnp.sum(qm, axis=-1, keepdims=True)
    return jnp.where(usable, qm / jnp.where(s > 0, s, 1.0), q)
