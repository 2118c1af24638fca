"""Verifiers of speculative decoding: which drafted tokens to keep, and the token emitted after them.

Every verifier is a hashable frozen dataclass (a static argument under jit) called as

    verifier(target_probs, draft_probs, tree, key) -> VerifyResult

with `target_probs`/`draft_probs` f32[B, N+1, V] indexed by *parent slot* (slot 0 = root, slot i+1 =
after node i; see `jaxdecode.tree`), `draft_probs` None for point-mass drafters, and a PRNG key. Rows
are independent: one `uniform(key, (B, M))` draw gives each row its own M numbers (a single
random-number call site: each one costs seconds of XLA compile time on CPU), and the row function
is vmapped, so everything jits and vmaps. Invalid nodes (tree.valid False) are never accepted; a row
without valid nodes just samples the bonus at the root.

Class attributes say how a verifier may be used: `name` (registry key), `lossless` (output distributed
exactly as sampling from the target), `greedy_decoding` (reproduces argmax decoding: temperature 0
only; every other verifier samples: temperature > 0), `needs_draft_probs`, `tree_kind`: "chain" (node
i's parent is node i-1), "paths" (several root-to-leaf chains sharing only the root) or "tree" (any
tree), and `child_rules`: the ways of choosing children (CHILD_RULES) it is lossless for, each on any
tree or on chains only; `accepts_children(rule, chain)` answers from it, and the speculative engine
refuses every other pair. `check_tree_kind` checks a concrete parents array on the host; `__call__`
runs it when the tree is concrete (not under jit).

Rules (ALGORITHMS.md §1 and the papers; formulas re-derived and checked by the χ² tests):
- greedy: descend into the child carrying argmax P; bonus = argmax at the last accepted node.
- chain: Leviathan/Chen rejection sampling on a chain.
- point_mass: sample y ~ P at the node; descend into the first child carrying y, else emit y.
- block: Sun et al. block verification (chain only).
- specinfer / rsd / topk: multi-round rejection over the children, in index order (see classes).
- spectr: SpecTr k-sequential selection at every node (k = number of valid children).
- gbv: greedy multi-path block verification for K i.i.d. paths: greedy path selection, then block
  verification of the selected path against the selected path's own ("skewed") draft law.
- typical: Medusa typical acceptance, LOSSY.

Where this module differs from ALGORITHMS.md (the papers win):
- acceptance tests use `u < a` with u ~ U[0, 1) instead of `u <= a`: identical in real arithmetic, but
  a ratio of exactly 0 is then never accepted and 1 always is, so impossible tokens cannot slip in;
- GBV is not spelled out in ALGORITHMS.md; see `GreedyBlockVerifier` for the rule and its provenance;
- SpecTr: ρ* is found by bisection and the upper end of the final bracket is used, so the residual
  stays non-negative (any ρ with 1 - (1-β)^k <= ρβ is lossless, the smallest is merely optimal);
- float guards: a ratio p/q with q = 0 counts as certain acceptance when p > 0 (the drafter called
  its own token impossible); a 0/0 block-verification weight h_i is 0 (it can only occur where the
  next position accepts surely); a residual that rounds to all-zero falls back to the target at that
  node (reachable only through float rounding, never in exact arithmetic).
"""
from __future__ import annotations

import abc
import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.kernels.common import concrete
from jaxdecode.sampling import first_argmax
from jaxdecode.tree import Tree, TreeError, ancestor_mask, depths, validate_parents

__all__ = [
    "VerifyResult", "Verifier", "VerifierInputError", "TreeKindError",
    "GreedyVerifier", "ChainVerifier", "PointMassVerifier", "BlockVerifier", "SpecInferVerifier",
    "RSDVerifier", "TopKVerifier", "SpecTrVerifier", "GreedyBlockVerifier", "LossyTypicalVerifier",
    "VERIFIERS", "TREE_KINDS", "CHILD_RULES", "ANY_CHILDREN", "get_verifier", "check_tree_kind",
]

TREE_KINDS = ("chain", "paths", "tree")

# How a drafter chose each node's children (its `child_rule`): the contract between drafters and verifiers.
CHILD_RULES = {
    "argmax": "deterministic: the draft's most likely token (on a tree the r-th child is the r-th most likely)",
    "topk": "deterministic: a node's r-th child is the r-th most likely draft token",
    "sample": "drawn from q: a chain node's one child; on a tree the siblings are i.i.d. (as 'iid')",
    "iid": "siblings drawn i.i.d. from q (with replacement)",
    "gumbel": "siblings drawn from q without replacement, listed in draw order (Gumbel-top-k)",
    "point": "point masses without a draft distribution (prompt lookup, n-grams, token recycling)",
}
ANY_CHILDREN = "any"  # a `child_rules` value: lossless whatever the rule (drafts independent of the verifier)
_SCOPES = ("tree", "chain")  # a rule holds on any tree the verifier's tree_kind admits / on chains only
# Children that are draws from q, independent across siblings. Without replacement ("gumbel") they are
# independent only when each node has one child, i.e. on a chain.
_IID_CHILDREN = {"sample": "tree", "iid": "tree", "gumbel": "chain"}
_LN2 = math.log(2.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyResult:
    path: jax.Array  # int32[B, N]: accepted node indices in root-to-leaf order, -1 padded
    num_accepted: jax.Array  # int32[B]: accepted draft nodes (0..max depth)
    bonus: jax.Array  # int32[B]: the token emitted after the accepted path (correction or bonus)


class VerifierInputError(ValueError):
    """Arrays handed to a verifier do not have the shapes it needs."""


class TreeKindError(ValueError):
    """A draft structure the verifier is not valid for (e.g. a branching tree for a chain verifier)."""


# ----------------------------------------------------------------------------------------------------
# Float-safe primitives (all on one row; vmapped by the verifiers).

def _ratio(num, den):
    """num / den for probabilities; den == 0 gives +inf when num > 0 (certain acceptance), else 0."""
    pos = den > 0
    return jnp.where(pos, num / jnp.where(pos, den, 1.0), jnp.where(num > 0, jnp.inf, 0.0))


def _normalize(w, fallback):
    """w / sum(w) over the last axis; `fallback` where the sum is not positive (a zero residual)."""
    s = jnp.sum(w, axis=-1, keepdims=True)
    return jnp.where(s > 0, w / jnp.where(s > 0, s, 1.0), fallback)


def _sample(weights, u, fallback):
    """Inverse-CDF draw from unnormalised non-negative `weights` [V] with u in (0, 1].

    u > 0 and the strict `<` make a zero-weight token unreachable; an all-zero vector samples
    `fallback` instead (the target at that node), so a rounded-away residual never yields NaN/garbage.
    """
    w = jnp.where(jnp.sum(weights) > 0, weights, fallback)
    c = jnp.cumsum(w)
    idx = jnp.sum(c < u * c[-1])
    return jnp.minimum(idx, w.shape[-1] - 1).astype(jnp.int32)


def _log1mexp(a):
    """log(1 - exp(a)) for a <= 0, accurate on both sides of -ln 2 (Mächler 2012)."""
    a = jnp.minimum(a, 0.0)
    return jnp.where(a > -_LN2, jnp.log(-jnp.expm1(a)), jnp.log1p(-jnp.exp(a)))


def _children_matrix(parents, valid):
    """child[s, i] = node i is a valid child of parent slot s. [N+1, N]."""
    n = parents.shape[0]
    return valid[None, :] & (parents[None, :] + 1 == jnp.arange(n + 1)[:, None])


def _split_uniforms(u, n):
    """A row's 2N+2 uniforms: U[0,1) per node test, U(0,1] per slot draw, U(0,1] for the bonus."""
    return u[:n], 1.0 - u[n:2 * n + 1], 1.0 - u[2 * n + 1]


# ----------------------------------------------------------------------------------------------------
# Base class.

@dataclasses.dataclass(frozen=True)
class Verifier(abc.ABC):
    """Base of all verifiers. Subclasses set the class attributes and implement `_verify_row`."""

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = True
    greedy_decoding: ClassVar[bool] = False
    needs_draft_probs: ClassVar[bool] = True
    tree_kind: ClassVar[str] = "tree"
    # child rule -> "tree" | "chain" (see _SCOPES), or ANY_CHILDREN. Empty by default: a verifier that
    # does not declare its contract is refused by the engine for every drafter.
    child_rules: ClassVar = {}
    # Lossless on drafts pruned by a constraint (speculative_decode(constraint=)): the verdict at a node
    # reads only that node's children, so dropping forbidden children (and renormalising q over the
    # allowed ones) leaves i.i.d. draws from the renormalised q. False for rules that weigh the whole
    # draft jointly (block verification), where a cut that depends on the drafted tokens biases them.
    prunable: ClassVar[bool] = True

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        rules = cls.child_rules
        if rules != ANY_CHILDREN and (not isinstance(rules, dict) or not set(rules) <= set(CHILD_RULES)
                                      or not set(rules.values()) <= set(_SCOPES)):
            raise TypeError(f"{cls.__name__}.child_rules must be ANY_CHILDREN or a dict from child rules "
                            f"({', '.join(CHILD_RULES)}) to a scope ({', '.join(_SCOPES)}), got {rules!r}")

    @classmethod
    def accepts_children(cls, rule: str, chain: bool) -> bool:
        """Whether drafts whose children follow `rule` verify losslessly (the lossy verifier: are
        verified at all); `chain`: the drafts are chains (no node has two children)."""
        if cls.child_rules == ANY_CHILDREN:
            return True
        scope = cls.child_rules.get(rule)
        return scope == "tree" or (scope == "chain" and chain)

    @classmethod
    def describe_children(cls) -> str:
        """The declared child rules in words, for error messages."""
        if cls.child_rules == ANY_CHILDREN:
            return "any child rule"
        parts = [" / ".join(r for r, sc in cls.child_rules.items() if sc == scope) for scope in _SCOPES]
        words = (f"{parts[0]} (any {cls.tree_kind})" if parts[0] else "",
                 f"{parts[1]} (chains only: no node with two children)" if parts[1] else "")
        return " or ".join(w for w in words if w) or "no child rule"

    def __call__(self, target_probs, draft_probs, tree: Tree, key) -> VerifyResult:
        p, q = _check_inputs(self, target_probs, draft_probs, tree)
        parents = concrete(tree.parents)
        if parents is not None:
            check_tree_kind(self, parents)
        b, n = tree.tokens.shape
        # One draw for the whole batch: every random-number call site costs seconds of XLA compile
        # time on CPU, and rows stay independent (disjoint slices of one uniform array).
        u = jax.random.uniform(key, (b, self._num_uniforms(n)), jnp.float32)
        path, num, bonus = jax.vmap(self._verify_row)(
            p, q, tree.tokens.astype(jnp.int32), tree.parents.astype(jnp.int32),
            tree.valid.astype(bool), u)
        return VerifyResult(path=path.astype(jnp.int32), num_accepted=num.astype(jnp.int32),
                            bonus=bonus.astype(jnp.int32))

    def _num_uniforms(self, n: int) -> int:
        """U[0,1) numbers one row consumes (N nodes)."""
        return n + 1

    @abc.abstractmethod
    def _verify_row(self, p, q, tokens, parents, valid, u):
        """(path [N], num_accepted, bonus) for one row."""


def _check_inputs(verifier, target_probs, draft_probs, tree):
    name = verifier.name
    if not isinstance(tree, Tree):
        raise VerifierInputError(f"{name}: tree must be a jaxdecode.tree.Tree, got {type(tree).__name__}")
    tshape = tuple(tree.tokens.shape)
    if len(tshape) != 2:
        raise VerifierInputError(f"{name}: tree.tokens must be [B, N], got shape {tshape}")
    for field in ("parents", "valid"):
        shape = tuple(getattr(tree, field).shape)
        if shape != tshape:
            raise VerifierInputError(f"{name}: tree.{field} has shape {shape}, tree.tokens has {tshape}")
    b, n = tshape
    target_shape = tuple(jnp.shape(target_probs))
    if len(target_shape) != 3 or target_shape[:2] != (b, n + 1) or target_shape[2] < 1:
        raise VerifierInputError(
            f"{name}: target_probs must be [B, N+1, V] = [{b}, {n + 1}, V] (one distribution per parent "
            f"slot: the root and each of the N nodes), got shape {target_shape}")
    p = jnp.asarray(target_probs, jnp.float32)
    if draft_probs is None:
        if verifier.needs_draft_probs:
            raise VerifierInputError(
                f"{name}: needs draft_probs [B, N+1, V] (the drafter's distribution per parent slot); "
                f"for drafters without a distribution use 'point_mass', 'topk' or 'greedy'")
        return p, p  # unused stand-in keeps one vmapped signature
    draft_shape = tuple(jnp.shape(draft_probs))
    if draft_shape != target_shape:
        raise VerifierInputError(
            f"{name}: draft_probs has shape {draft_shape}, expected the target's {target_shape}")
    return p, jnp.asarray(draft_probs, jnp.float32)


# ----------------------------------------------------------------------------------------------------
# Sequential verifiers: walk the nodes in index order once. A node is tested iff it is a valid child of
# the current node; acceptance moves the current node to it (later siblings are then skipped since
# their parent is no longer current), rejection updates the residual state. Because parents[i] < i,
# one pass over i = 0..N-1 visits every node's children in index order, for trees and chains alike.

@dataclasses.dataclass(frozen=True)
class _SequentialVerifier(Verifier):

    # Hooks. `row` holds p, q [N+1, V], tokens, parents, valid [N], u_slot [N+1].
    def _prepare(self, row):
        """Per-slot quantities computed once, vectorised over all N+1 slots."""
        return {}

    def _enter(self, row, info, slot):
        """State when `slot` becomes the current node."""
        return {}

    @abc.abstractmethod
    def _accept_prob(self, row, info, state, cur, i):
        """Probability of accepting node i as the next child of the current node `cur`."""

    def _reject(self, row, info, state, cur, i):
        return state

    @abc.abstractmethod
    def _emit(self, row, info, state, cur, u):
        """The token emitted after the accepted path (correction or bonus)."""

    def _num_uniforms(self, n):
        return 2 * n + 2

    def _verify_row(self, p, q, tokens, parents, valid, u):
        n = tokens.shape[0]
        u_node, u_slot, u_bonus = _split_uniforms(u, n)
        row = dict(p=p, q=q, tokens=tokens, parents=parents, valid=valid, u_slot=u_slot)
        info = self._prepare(row)
        idx = jnp.arange(n)

        def body(i, carry):
            cur, num, path, state = carry
            child = valid[i] & (parents[i] + 1 == cur)
            prob = self._accept_prob(row, info, state, cur, i)
            acc = child & (u_node[i] < prob)
            rej = child & ~acc
            st_acc = self._enter(row, info, i + 1)
            st_rej = self._reject(row, info, state, cur, i)
            state = jax.tree_util.tree_map(
                lambda a, r, s: jnp.where(acc, a, jnp.where(rej, r, s)), st_acc, st_rej, state)
            path = jnp.where(acc & (idx == num), i, path)
            return (jnp.where(acc, i + 1, cur), num + acc.astype(jnp.int32), path, state)

        carry = (jnp.int32(0), jnp.int32(0), jnp.full((n,), -1, jnp.int32), self._enter(row, info, 0))
        cur, num, path, state = jax.lax.fori_loop(0, n, body, carry)
        return path, num, self._emit(row, info, state, cur, u_bonus)


@dataclasses.dataclass(frozen=True)
class GreedyVerifier(_SequentialVerifier):
    """Greedy: accept the child whose token is argmax P at the current node (the first such child);
    bonus = argmax at the last accepted node. Equals plain greedy decoding. Chains and trees."""

    name: ClassVar[str] = "greedy"
    needs_draft_probs: ClassVar[bool] = False
    greedy_decoding: ClassVar[bool] = True
    child_rules: ClassVar = ANY_CHILDREN

    def _prepare(self, row):
        p = row["p"]  # [N+1, V] probabilities, or [N+1] argmax tokens (verify_argmax)
        return {"argmax": (p if p.ndim == 1 else first_argmax(p)).astype(jnp.int32)}

    def _accept_prob(self, row, info, state, cur, i):
        return (row["tokens"][i] == info["argmax"][cur]).astype(jnp.float32)

    def verify_argmax(self, target_argmax, tree: Tree) -> VerifyResult:
        """The same verdict from the target's argmax per slot, int32[B, N+1], alone: greedy decoding
        needs no [B, N+1, V] distribution (the speculative engine calls this when decoding greedily)."""
        b, n = tree.tokens.shape
        if target_argmax.shape != (b, n + 1):
            raise VerifierInputError(f"greedy: target_argmax has shape {target_argmax.shape}, expected "
                                     f"{(b, n + 1)} (the root + {n} nodes per row)")
        parents = concrete(tree.parents)
        if parents is not None:
            check_tree_kind(self, parents)
        u = jnp.zeros((b, self._num_uniforms(n)), jnp.float32)  # greedy draws nothing
        path, num, bonus = jax.vmap(self._verify_row)(
            target_argmax.astype(jnp.int32), jnp.zeros((b, 1), jnp.float32), tree.tokens.astype(jnp.int32),
            tree.parents.astype(jnp.int32), tree.valid.astype(bool), u)
        return VerifyResult(path=path.astype(jnp.int32), num_accepted=num.astype(jnp.int32),
                            bonus=bonus.astype(jnp.int32))

    def _emit(self, row, info, state, cur, u):
        return info["argmax"][cur]

    def _verify_row(self, p, q, tokens, parents, valid, u):
        """The sequential walk's verdict without its loop over the N nodes (one device round trip per
        node on a GPU): node i is on the accepted path iff every node from the root down to i carries the
        argmax at its parent's slot and is the first such child of that parent in index order (the walk
        descends into the first match, so a later sibling is never tested)."""
        argmax = (p if p.ndim == 1 else first_argmax(p)).astype(jnp.int32)  # [N+1]
        n = tokens.shape[0]
        if n == 0:
            return jnp.zeros((0,), jnp.int32), jnp.int32(0), argmax[0]
        idx = jnp.arange(n)
        match = valid & (tokens == argmax[parents + 1])                                   # [N]
        earlier_sibling = (parents[:, None] == parents[None, :]) & (idx[None, :] < idx[:, None])  # [i, j]
        first = match & ~jnp.any(earlier_sibling & match[None, :], axis=1)
        lineage = ancestor_mask(parents)                                                 # [i, j]: j is i or above
        on_path = jnp.all(~lineage | first[None, :], axis=1)
        depth = jnp.sum(lineage, axis=1)                                                 # root's children: 1
        path = jnp.full((n,), -1, jnp.int32).at[jnp.where(on_path, depth - 1, n)].set(idx, mode="drop")
        cur = jnp.max(jnp.where(on_path, idx + 1, 0))  # the deepest accepted node's slot (ids grow downwards)
        return path, jnp.sum(on_path).astype(jnp.int32), argmax[cur]


@dataclasses.dataclass(frozen=True)
class PointMassVerifier(_SequentialVerifier):
    """Drafts without a distribution (prompt lookup, n-gram, token recycling): at the current node draw
    y ~ P; descend into the first child carrying y, else emit y. Lossless for any draft tree that does
    not depend on the verifier's randomness."""

    name: ClassVar[str] = "point_mass"
    needs_draft_probs: ClassVar[bool] = False
    child_rules: ClassVar = ANY_CHILDREN

    def _prepare(self, row):
        # One draw per slot; each slot is current at most once, so the draws are independent.
        y = jax.vmap(_sample)(row["p"], row["u_slot"], row["p"])
        return {"y": y}

    def _accept_prob(self, row, info, state, cur, i):
        return (row["tokens"][i] == info["y"][cur]).astype(jnp.float32)

    def _emit(self, row, info, state, cur, u):
        return info["y"][cur]


@dataclasses.dataclass(frozen=True)
class SpecInferVerifier(_SequentialVerifier):
    """SpecInfer multi-round rejection for children drawn i.i.d. from q at each node.

    Child c (in index order): accept if u < P(c)/q(c); on reject P = norm((P - q)+). No child
    accepted, or a leaf: emit y ~ P. Lossless when the children are i.i.d. draws from q."""

    name: ClassVar[str] = "specinfer"
    child_rules: ClassVar = _IID_CHILDREN

    def _enter(self, row, info, slot):
        return {"P": row["p"][slot]}

    def _accept_prob(self, row, info, state, cur, i):
        x = row["tokens"][i]
        return _ratio(state["P"][x], row["q"][cur][x])

    def _reject(self, row, info, state, cur, i):
        P = state["P"]
        return {"P": _normalize(jax.nn.relu(P - row["q"][cur]), P)}

    def _emit(self, row, info, state, cur, u):
        return _sample(state["P"], u, row["p"][cur])


@dataclasses.dataclass(frozen=True)
class ChainVerifier(SpecInferVerifier):
    """Chain rejection sampling (Leviathan et al. 2023; Chen et al. 2023): for i = 1..γ accept x_i if
    u_i < p_i(x_i)/q_i(x_i); at the first rejection emit y ~ norm((p_i - q_i)+); all accepted: bonus
    y ~ p_{γ+1}. (SpecInfer's rule restricted to one child per node.)"""

    name: ClassVar[str] = "chain"
    tree_kind: ClassVar[str] = "chain"


@dataclasses.dataclass(frozen=True)
class RSDVerifier(_SequentialVerifier):
    """Recursive Speculative Decoding (Jeon et al. 2024): recursive rejection sampling for children
    drawn WITHOUT replacement from q, listed in draw order (Gumbel-top-k of log q + G, or the
    descending perturbed scores of a stochastic beam search).

    Residual draft Q starts at q: accept child c if u < P(c)/Q(c); on reject P = norm((P - Q)+), then
    Q(c) = 0, Q = norm(Q). Lossless because, given the earlier siblings, the next sibling's token is
    a draw from Q and whether it exists at all does not depend on which token it is."""

    name: ClassVar[str] = "rsd"
    # Without replacement on any tree. Not i.i.d. siblings: they repeat tokens that the residual Q has
    # already zeroed, which biases the output (a χ² negative control); on a chain a sampled child is one
    # draw from q, which is fine.
    child_rules: ClassVar = {"gumbel": "tree", "sample": "chain", "iid": "chain"}

    def _enter(self, row, info, slot):
        return {"P": row["p"][slot], "Q": row["q"][slot]}

    def _accept_prob(self, row, info, state, cur, i):
        x = row["tokens"][i]
        return _ratio(state["P"][x], state["Q"][x])

    def _reject(self, row, info, state, cur, i):
        P, Q = state["P"], state["Q"]
        Qz = Q.at[row["tokens"][i]].set(0.0)
        return {"P": _normalize(jax.nn.relu(P - Q), P), "Q": _normalize(Qz, Qz)}

    def _emit(self, row, info, state, cur, u):
        return _sample(state["P"], u, row["p"][cur])


@dataclasses.dataclass(frozen=True)
class TopKVerifier(_SequentialVerifier):
    """Deterministic children (EAGLE-2/3 top-k, static trees): the children are point masses.

    Child c: accept if u < P(c); on reject P(c) = 0, P = norm(P); emit y ~ P. Lossless for any tree
    built without the verifier's randomness (sequential sampling of P restricted to the children)."""

    name: ClassVar[str] = "topk"
    needs_draft_probs: ClassVar[bool] = False
    child_rules: ClassVar = ANY_CHILDREN

    def _enter(self, row, info, slot):
        return {"P": row["p"][slot]}

    def _accept_prob(self, row, info, state, cur, i):
        return state["P"][row["tokens"][i]]

    def _reject(self, row, info, state, cur, i):
        Pz = state["P"].at[row["tokens"][i]].set(0.0)
        return {"P": _normalize(Pz, Pz)}

    def _emit(self, row, info, state, cur, u):
        return _sample(state["P"], u, row["p"][cur])


def _spectr_rho(p, q, k, steps: int):
    """SpecTr k-sequential ρ* per row of p, q [S, V] with k [S] drafts: the smallest ρ in [1, k] with
    1 - (1-β(ρ))^k <= ρβ(ρ), β(ρ) = Σ min(q, p/ρ). ρβ(ρ) increases and β(ρ) decreases in ρ, so the
    condition is monotone and bisection (static step count) applies; we return the bracket's upper
    end, which always satisfies it. Returns (rho, coef) with coef = (1 - (1-β)^k) / β."""
    kf = k.astype(jnp.float32)

    def parts(rho):
        beta = jnp.clip(jnp.sum(jnp.minimum(q, p / rho[:, None]), axis=-1), 0.0, 1.0)
        # 1 - (1-β)^k without cancellation; k == 0 (a leaf) accepts nothing.
        acc = jnp.where(kf > 0, -jnp.expm1(kf * jnp.log1p(-beta)), 0.0)
        return beta, acc

    def ok(rho):
        beta, acc = parts(rho)
        return rho * beta - acc >= 0

    one = jnp.ones_like(kf)
    hi0 = jnp.maximum(kf, 1.0)

    def bisect(_, lohi):
        lo, hi = lohi
        mid = 0.5 * (lo + hi)
        good = ok(mid)
        return jnp.where(good, lo, mid), jnp.where(good, mid, hi)

    _, hi = jax.lax.fori_loop(0, steps, bisect, (one, hi0))
    rho = jnp.where(ok(one), one, hi)
    beta, acc = parts(rho)
    coef = jnp.where(beta > 0, acc / jnp.where(beta > 0, beta, 1.0), kf)
    return rho, coef


@dataclasses.dataclass(frozen=True)
class SpecTrVerifier(_SequentialVerifier):
    """SpecTr k-sequential selection (Sun et al. 2023, "SpecTr: Fast Speculative Decoding via Optimal
    Transport") at every node whose k children are i.i.d. draws from q (k = valid children there).

    ρ* as in `_spectr_rho`; try the children in index order, accepting x_j with probability
    min(1, p(x_j) / (ρ* q(x_j))); none accepted (or a leaf): y ~ norm(p - min(q, p/ρ*)(1-(1-β)^k)/β).
    Lossless: each draft is accepted-and-equal-to-x with probability min(q, p/ρ)(x), so the accepted
    mass is min(q, p/ρ)(1-(1-β)^k)/β <= p exactly when 1-(1-β)^k <= ρβ. k = 1 is chain rejection."""

    name: ClassVar[str] = "spectr"
    child_rules: ClassVar = _IID_CHILDREN
    bisection_steps: int = 32

    def __post_init__(self):
        if not isinstance(self.bisection_steps, int) or self.bisection_steps < 1:
            raise ValueError(f"spectr: bisection_steps must be an int >= 1, got {self.bisection_steps!r}")

    def _prepare(self, row):
        kids = jnp.sum(_children_matrix(row["parents"], row["valid"]), axis=1)
        rho, coef = _spectr_rho(row["p"], row["q"], kids, self.bisection_steps)
        return {"rho": rho, "coef": coef}

    def _accept_prob(self, row, info, state, cur, i):
        x = row["tokens"][i]
        return _ratio(row["p"][cur][x], info["rho"][cur] * row["q"][cur][x])

    def _emit(self, row, info, state, cur, u):
        p, q, rho = row["p"][cur], row["q"][cur], info["rho"][cur]
        resid = jax.nn.relu(p - jnp.minimum(q, p / rho) * info["coef"][cur])
        return _sample(resid, u, p)


@dataclasses.dataclass(frozen=True)
class LossyTypicalVerifier(_SequentialVerifier):
    """LOSSY: Medusa typical acceptance (Cai et al. 2024). NOT distributed as the target.

    At each node accept child x if p(x) > min(eps, delta * exp(-H(p))) (H in nats), greedy-first: the
    child carrying argmax p is tried first (it always passes, as p_max >= exp(-H) > delta exp(-H)),
    then the other children in index order; descend into the first that passes. Bonus = argmax p."""

    name: ClassVar[str] = "typical"
    lossless: ClassVar[bool] = False
    needs_draft_probs: ClassVar[bool] = False
    child_rules: ClassVar = ANY_CHILDREN
    eps: float = 0.09
    delta: float = 0.3

    def __post_init__(self):
        for field, val in (("eps", self.eps), ("delta", self.delta)):
            if not isinstance(val, (int, float)) or isinstance(val, bool) or not math.isfinite(val) or val <= 0:
                raise ValueError(f"typical (lossy): {field} must be a finite number > 0, got {val!r}")

    def _prepare(self, row):
        p, tokens = row["p"], row["tokens"]
        ent = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
        thr = jnp.minimum(self.eps, self.delta * jnp.exp(-ent))
        amax = first_argmax(p)
        passing = _children_matrix(row["parents"], row["valid"]) & (p[:, tokens] > thr[:, None])
        pref = passing & (tokens[None, :] == amax[:, None])

        def first(m):
            return jnp.where(jnp.any(m, axis=1), jnp.argmax(m, axis=1), -1).astype(jnp.int32)

        chosen = jnp.where(jnp.any(pref, axis=1), first(pref), first(passing))
        return {"argmax": amax, "chosen": chosen}

    def _accept_prob(self, row, info, state, cur, i):
        return (info["chosen"][cur] == i).astype(jnp.float32)

    def _emit(self, row, info, state, cur, u):
        return info["argmax"][cur]


# ----------------------------------------------------------------------------------------------------
# Block verification and its multi-path extension.

def _block_core(p_path, q_path, x, gamma, u, u_bonus):
    """Block verification (Sun et al., ICLR 2025, Alg. 2) on one drafted path.

    p_path [L+1, V]: target at depth 0..L; q_path [L, V]: law of draft token d+1 given the first d;
    x [L]: draft tokens; gamma <= L: usable length. u [L] ~ U[0,1), u_bonus ~ U(0,1].
        w_0 = 1, w_i = min(1, w_{i-1} p_i(x_i)/q_i(x_i))
        h_i = R_i / (R_i + 1 - w_i), R_i = Σ_x (w_i p_{i+1}(x) - q_{i+1}(x))+   (i < γ);  h_γ = w_γ
        τ = the largest i with u_i < h_i (0 if none); τ == γ: y ~ p_{γ+1}, else y ~ norm((w_τ p_{τ+1} - q_{τ+1})+)
    Returns (τ, y)."""
    length = x.shape[0]
    if length == 0:
        return jnp.int32(0), _sample(p_path[0], u_bonus, p_path[0])
    px = jnp.take_along_axis(p_path[:length], x[:, None], axis=1)[:, 0]
    qx = jnp.take_along_axis(q_path, x[:, None], axis=1)[:, 0]
    r = _ratio(px, qx)

    def step(w, r_i):
        # w == 0 stays 0 (avoids 0 * inf); min(1, w * inf) = 1 otherwise.
        w = jnp.minimum(1.0, jnp.where(w > 0, w * r_i, 0.0))
        return w, w

    _, w = jax.lax.scan(step, jnp.float32(1.0), r)  # w[j] = w_{j+1}
    resid = jnp.sum(jax.nn.relu(w[:-1, None] * p_path[1:length] - q_path[1:length]), axis=-1)
    resid = jnp.concatenate([resid, jnp.zeros((1,), resid.dtype)])  # R_L is never needed
    pos = jnp.arange(1, length + 1)
    denom = resid + 1.0 - w
    h_mid = jnp.where(denom > 0, resid / jnp.where(denom > 0, denom, 1.0), 0.0)
    h = jnp.where(pos < gamma, h_mid, jnp.where(pos == gamma, w, 0.0))
    tau = jnp.max(jnp.where(u < h, pos, 0)).astype(jnp.int32)
    w_tau = jnp.where(tau > 0, w[jnp.maximum(tau - 1, 0)], 1.0)
    p_next = p_path[tau]
    res = jax.nn.relu(w_tau * p_next - q_path[jnp.minimum(tau, length - 1)])
    weights = jnp.where(tau == gamma, p_next, res)
    return tau, _sample(weights, u_bonus, p_next)


def _block_uniforms(u, n):
    """A row's N+1 uniforms: U[0,1) per position, U(0,1] for the correction/bonus draw."""
    return u[:n], 1.0 - u[n]


@dataclasses.dataclass(frozen=True)
class BlockVerifier(Verifier):
    """Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025):
    decides the accepted length jointly from all on-path ratios (see `_block_core`); lossless and never
    worse than chain rejection in expected accepted tokens. Chain only; the usable length γ is the
    number of leading valid nodes."""

    name: ClassVar[str] = "block"
    tree_kind: ClassVar[str] = "chain"
    prunable: ClassVar[bool] = False
    child_rules: ClassVar = _IID_CHILDREN
    _core = staticmethod(_block_core)

    def _verify_row(self, p, q, tokens, parents, valid, u):
        n = tokens.shape[0]
        u, u_bonus = _block_uniforms(u, n)
        gamma = jnp.sum(jnp.cumprod(valid.astype(jnp.int32)))
        tau, bonus = self._core(p, q[:n], tokens, gamma, u, u_bonus)
        idx = jnp.arange(n)
        return jnp.where(idx < tau, idx, -1), tau, bonus


@dataclasses.dataclass(frozen=True)
class GreedyBlockVerifier(Verifier):
    """Greedy multi-path block verification, GBV (Thomas & Pal 2026, "Greedy Multi-Path Block
    Verification for Faster Decoding in Speculative Sampling") for K i.i.d. draft paths from q.

    Provenance: only the paper's abstract and public reviews could be read (not its algorithm
    section). They state that GBV decomposes into a path selection that induces a "skewed" draft,
    followed by single-path block verification, with a greedy tree-based path ranking that uses only
    on-path probabilities; a public re-implementation describes the greedy ranking as "highest
    min(1, p/q) child first" and block verification run against the selected path's skewed law. This
    class implements that rule; the skewed law below is our own derivation, verified by the χ² tests.

    Rule. At each prefix rank the tokens by min(1, p/q) (ties: higher token id ranks higher). Walk
    from the root, at each depth taking the highest-ranked next token among the paths that still
    share the selected prefix (identical prefixes on different paths are merged): the selected path S
    is the lexicographic maximum of the K paths. With F(x^d) = P(a path's d-prefix <=_lex x^d),
    P(S^d = x^d) = F(x^d)^K - F⁻(x^d)^K (F⁻: strictly less), hence S's next-token law at x^d is
        Q(y | x^d) = (u_y^K - v_y^K) / (1 - α^K),  u_y = α + β C(y),  v_y = α + β C⁻(y),
    with α = F⁻/F, β = q(x^d)/F = 1 - α at x^d, C/C⁻ the inclusive/exclusive q-mass below y in the
    ranking. Block verification of S against Q (instead of q) is lossless because S ~ Π Q; with K = 1,
    Q = q and GBV is block verification. u^K - v^K is evaluated in log space as
    K log u + log1mexp(K log1p(-β q(y)/u)), so tiny prefix probabilities neither cancel nor underflow.

    tree_kind "paths": K root-to-leaf chains sharing only the root (as drafted: K rows of length L),
    K = valid children of the root, all paths truncated to the shortest valid one."""

    name: ClassVar[str] = "gbv"
    tree_kind: ClassVar[str] = "paths"
    prunable: ClassVar[bool] = False
    child_rules: ClassVar = _IID_CHILDREN  # K i.i.d. paths; without replacement only for K = 1
    _core = staticmethod(_block_core)

    def _path_draft_law(self, q, chain, x, order, rank, num_paths):
        """Law of the selected path's token j+1 given its first j tokens, for j = 0..N-1: [N, V]."""
        n = x.shape[0]
        k = jnp.maximum(num_paths, 1.0)

        def skew(ab, j):
            alpha, beta = ab  # F-(x^j)/F(x^j) and q(x^j)/F(x^j), tracked separately (no 1 - α cancellation)
            s = chain[j]
            qs = q[s]
            cs = jnp.cumsum(qs[order[s]])
            incl = cs[rank[s]]
            excl = jnp.concatenate([jnp.zeros((1,), cs.dtype), cs[:-1]])[rank[s]]
            uu = jnp.clip(alpha + beta * incl, 0.0, 1.0)
            vv = jnp.clip(alpha + beta * excl, 0.0, 1.0)
            pos = uu > 0
            uu_safe = jnp.where(pos, uu, 1.0)
            log_f = jnp.where(pos, k * jnp.log(uu_safe) + _log1mexp(k * jnp.log1p(-beta * qs / uu_safe)),
                              -jnp.inf)
            top = jnp.max(log_f)
            f = jnp.exp(log_f - jnp.where(jnp.isfinite(top), top, 0.0))
            xj = x[j]
            ux = uu_safe[xj]
            nxt = (jnp.where(uu[xj] > 0, vv[xj] / ux, 0.0), beta * qs[xj] / ux)
            return nxt, _normalize(f, qs)

        _, q_path = jax.lax.scan(skew, (jnp.float32(0.0), jnp.float32(1.0)), jnp.arange(n))
        return q_path

    def _verify_row(self, p, q, tokens, parents, valid, u):
        n = tokens.shape[0]
        u, u_bonus = _block_uniforms(u, n)
        d = depths(parents)
        slot_depth = jnp.concatenate([jnp.zeros((1,), d.dtype), d])
        child = _children_matrix(parents, valid)
        num_paths = jnp.sum(child[0]).astype(jnp.float32)
        leaf = valid & ~jnp.any(child[1:], axis=1)
        length = jnp.where(jnp.any(leaf), jnp.min(jnp.where(leaf, d, n)), 0).astype(jnp.int32)

        # Total order per slot: ascending min(1, p/q), ties by token id (stable sort).
        score = jnp.minimum(1.0, _ratio(p, q))
        order = jnp.argsort(score, axis=-1, stable=True).astype(jnp.int32)  # [N+1, V]
        rank = jnp.argsort(order, axis=-1).astype(jnp.int32)

        def select(depth, carry):
            alive, sel = carry  # alive: slots whose prefix equals S^{depth-1}
            s = jnp.argmax(alive)
            cand = valid & alive[parents + 1] & (d == depth) & (depth <= length)
            sc = jnp.where(cand, rank[s][tokens], -1)
            best = jnp.max(sc)
            has = best >= 0
            tok = order[s][jnp.maximum(best, 0)]
            new = jnp.concatenate([jnp.zeros((1,), bool), cand & (tokens == tok)])
            alive = jnp.where(has, new, alive)
            sel = sel.at[depth].set(jnp.where(has, jnp.argmax(new), 0).astype(jnp.int32))
            return alive, sel

        alive0 = jnp.zeros((n + 1,), bool).at[0].set(True)
        _, sel = jax.lax.fori_loop(1, n + 1, select, (alive0, jnp.zeros((n + 1,), jnp.int32)))

        # One concrete root-to-leaf chain of nodes for S (the ancestors of a leaf of S), so the
        # committed path and the distributions used below come from the same nodes.
        def up(_, carry):
            s, chain = carry
            chain = chain.at[slot_depth[s]].set(s)
            return jnp.where(s > 0, parents[jnp.maximum(s - 1, 0)] + 1, 0), chain

        _, chain = jax.lax.fori_loop(0, n + 1, up, (sel[length], jnp.zeros((n + 1,), jnp.int32)))
        x = tokens[jnp.maximum(chain[1:] - 1, 0)]  # [N]: token at depth j+1 (garbage beyond length)
        q_path = self._path_draft_law(q, chain, x, order, rank, num_paths)
        tau, bonus = self._core(p[chain], q_path, x, length, u, u_bonus)
        idx = jnp.arange(n)
        return jnp.where(idx < tau, chain[1:] - 1, -1), tau, bonus


# ----------------------------------------------------------------------------------------------------
# Registry and host-side structure checks.

_REGISTRY: dict[str, type[Verifier]] = {
    cls.name: cls for cls in (
        GreedyVerifier, ChainVerifier, PointMassVerifier, BlockVerifier, SpecInferVerifier,
        RSDVerifier, TopKVerifier, SpecTrVerifier, GreedyBlockVerifier, LossyTypicalVerifier)
}
VERIFIERS: tuple[str, ...] = tuple(_REGISTRY)


# The verifier used when none is named, per child rule (CHILD_RULES): each is lossless for its rule on
# chains and trees alike (tests/test_verifier_pairs.py checks it against the declarations).
DEFAULT_VERIFIER = {"point": "point_mass", "sample": "specinfer", "argmax": "topk", "topk": "topk",
                    "iid": "specinfer", "gumbel": "rsd"}


def default_verifier(drafter, sampler) -> str:
    """The verifier's name when the user names none: greedy when decoding greedily, else the lossless
    verifier of the drafter's child rule."""
    return "greedy" if sampler.is_greedy else DEFAULT_VERIFIER[drafter.child_rule]


def get_verifier(name: str, **kw) -> Verifier:
    """The verifier registered as `name`, configured by keyword fields (e.g. typical's eps/delta)."""
    if name not in _REGISTRY:
        lossy = [n for n, c in _REGISTRY.items() if not c.lossless]
        raise ValueError(f"unknown verifier {name!r}; valid names: {', '.join(VERIFIERS)} "
                         f"(lossy: {', '.join(lossy)})")
    cls = _REGISTRY[name]
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(kw) - set(fields))
    if unknown:
        raise ValueError(f"verifier {name!r} has no option(s) {unknown}; its options: {fields or 'none'}")
    return cls(**kw)


def check_tree_kind(verifier, parents) -> None:
    """Host check that a concrete parents array ([N] or [B, N]) suits `verifier.tree_kind` (or a kind
    string). Raises TreeError for an invalid tree, TreeKindError for a structure the verifier cannot
    verify losslessly."""
    kind = verifier if isinstance(verifier, str) else verifier.tree_kind
    label = kind if isinstance(verifier, str) else f"verifier {verifier.name!r}"
    if kind not in TREE_KINDS:
        raise ValueError(f"unknown tree kind {kind!r}; valid kinds: {', '.join(TREE_KINDS)}")
    p = np.asarray(parents)
    if p.ndim not in (1, 2):
        raise TreeError(f"parents must have shape [N] or [B, N], got {p.shape}")
    rows = np.unique(p.reshape(-1, p.shape[-1]), axis=0) if p.size else p.reshape(-1, p.shape[-1])
    validate_parents(rows)
    n = rows.shape[1]
    if kind == "tree" or n == 0:
        return
    tree_names = ", ".join(nm for nm, c in _REGISTRY.items() if c.tree_kind == "tree")
    if kind == "chain":
        expect = np.arange(n) - 1
        bad = rows != expect
        if np.any(bad):
            r, i = map(int, np.argwhere(bad)[0])
            raise TreeKindError(
                f"{label} verifies a chain (node i's parent is node i-1), but parents[{i}] = "
                f"{rows[r, i]}: the draft branches. Use a tree verifier ({tree_names}).")
        return
    # kind == "paths": chains that share only the root, all of the same depth.
    for row in rows:
        counts = np.bincount(row[row >= 0], minlength=n)
        if np.any(counts > 1):
            i = int(np.argmax(counts > 1))
            raise TreeKindError(
                f"{label} needs independent paths that share only the root, but node {i} has "
                f"{int(counts[i])} children. Use a tree verifier ({tree_names}).")
        d = np.zeros(n, np.int64)
        for i, par in enumerate(row):
            d[i] = 1 if par < 0 else d[par] + 1
        leaf_depths = set(d[counts == 0].tolist())
        if len(leaf_depths) > 1:
            raise TreeKindError(
                f"{label} needs paths of equal length (i.i.d. drafts of L tokens), got leaf depths "
                f"{sorted(leaf_depths)}")
