"""Speculative-decoding verifiers: exactness, losslessness and input checks.

Losslessness is tested on a toy model over V = 5 tokens whose target p and drafter q are fixed random
tables p(x | last token, depth), q(x | last token, depth), q != p. Each test drafts 1e5 independent
trees (one batch row each) in one jitted call, verifies them, forms the output sequence (accepted
tokens, then the bonus; a sequence cut short is completed by sampling p, as the next decoding step
would) and compares the first two tokens (V^2 cells) and the first token with the target by χ².
Every rule also has a deliberately broken variant, defined here, which must fail the same test.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxdecode import verifiers as vf
from jaxdecode.tree import Tree, TreeError, chain_tree, depths

V = 5
ROOT = 0  # the last committed token
DMAX = 4  # table depth rows (depths 0..3 are used)
NSAMP = 100_000
P_OK = 1e-4  # a lossless rule must pass with p-value above this
P_BROKEN = 1e-8  # a broken rule must fail with p-value below this


def _tables():
    rng = np.random.default_rng(20240611)

    def table():
        t = rng.dirichlet(np.full(V, 0.7), size=(DMAX, V))
        return 0.85 * t + 0.15 / V  # keep every cell's expected count large enough for χ²

    return table(), table()


P_NP, Q_NP = _tables()
P_TAB = jnp.asarray(P_NP, jnp.float32)
Q_TAB = jnp.asarray(Q_NP, jnp.float32)
JOINT = P_NP[0, ROOT][:, None] * P_NP[1]  # target law of the first two output tokens
JOINT = JOINT / JOINT.sum()


def _log1mexp(a):
    return jnp.where(a > -math.log(2.0), jnp.log(-jnp.expm1(a)), jnp.log1p(-jnp.exp(a)))


# --------------------------------------------------------------------------------------------------
# Draft-tree builders (the drafters themselves live elsewhere; these are test fixtures).

def slot_probs(tab, tree):
    """[B, N+1, V] distributions per parent slot: tab[depth, last token]."""
    d = depths(tree.parents)
    b = tree.tokens.shape[0]
    slot_d = jnp.concatenate([jnp.zeros((b, 1), d.dtype), d], axis=1)
    slot_last = jnp.concatenate([jnp.full((b, 1), ROOT, tree.tokens.dtype), tree.tokens], axis=1)
    return tab[jnp.minimum(slot_d, DMAX - 1), slot_last]


# Samplers get fresh Gumbel noise g [B, k, V] for one node's k children. Each builder draws all its
# noise in one call: every random-number call site costs about a second of XLA compile time on CPU.

def iid_children(g, dist, k):
    """k i.i.d. draws from dist [B, V] -> [B, k] (Gumbel-max)."""
    return jnp.argmax(jnp.log(dist)[:, None, :] + g, axis=-1)


def gumbel_topk_children(g, dist, k):
    """k draws without replacement, in draw order: Gumbel-top-k of log q + G."""
    return jax.lax.top_k(jnp.log(dist) + g[:, 0], k)[1]


def topk_children(g, dist, k):
    """Deterministic top-k of q (EAGLE-style)."""
    return jax.lax.top_k(dist, k)[1]


def _opaque(x):
    # Batch-sized constants (parents, valid, the root token) hidden from XLA's constant folding,
    # which otherwise spends many seconds folding 1e5-row sorts and reductions at compile time.
    return jax.lax.optimization_barrier(x)


def _structure(parents, shape):
    par = _opaque(jnp.broadcast_to(jnp.asarray(parents, jnp.int32), shape))
    return par, _opaque(jnp.ones(shape, bool))


def full_tree(key, b, branching, sampler, tab=Q_TAB):
    """Every node at depth d gets branching[d] children drawn by `sampler` from tab[d, last token].
    Nodes are numbered depth by depth, siblings consecutive and in draw order."""
    expansions, width = [], 1
    for k in branching:
        expansions.append(width)
        width *= k
    g = jax.random.gumbel(key, (b, sum(expansions), max(branching), V))
    parents, tokens, used = [], [], 0
    frontier = [(-1, _opaque(jnp.full((b,), ROOT, jnp.int32)))]
    for depth, k in enumerate(branching):
        nxt = []
        for idx, last in frontier:
            kids = sampler(g[:, used, :k], tab[depth, last], k).astype(jnp.int32)
            used += 1
            for j in range(k):
                parents.append(idx)
                tokens.append(kids[:, j])
                nxt.append((len(tokens) - 1, kids[:, j]))
        frontier = nxt
    tok = jnp.stack(tokens, axis=1)
    par, valid = _structure(parents, tok.shape)
    return Tree(tokens=tok, parents=par, valid=valid)


def iid_paths(key, b, k, length):
    """K i.i.d. draft paths of `length` tokens from q, path-major node order (GBV's drafts)."""
    g = jax.random.gumbel(key, (b, k * length, V))
    tokens, parents = [], []
    for _ in range(k):
        last = _opaque(jnp.full((b,), ROOT, jnp.int32))
        for depth in range(length):
            last = jnp.argmax(jnp.log(Q_TAB[depth, last]) + g[:, len(tokens)], axis=-1).astype(jnp.int32)
            parents.append(-1 if depth == 0 else len(tokens) - 1)
            tokens.append(last)
    tok = jnp.stack(tokens, axis=1)
    par, valid = _structure(parents, tok.shape)
    return Tree(tokens=tok, parents=par, valid=valid)


def stochastic_beam_tree(key, b, width, length):
    """RSD-S drafts: stochastic beam search (Kool et al. 2019) with beam `width` for `length` steps;
    the tree is the union of the beams. Nodes are numbered depth by depth in descending perturbed
    score, so each node's children are listed in the without-replacement order RSD verifies."""

    def truncate(parent_g, gt):  # Gumbels gt conditioned to have maximum parent_g (stable form)
        z = jnp.max(gt, axis=-1, keepdims=True)
        v = parent_g[..., None] - gt + _log1mexp(gt - z)
        return parent_g[..., None] - jax.nn.relu(v) - jnp.log1p(jnp.exp(-jnp.abs(v)))

    noise = jax.random.gumbel(key, (b, length, width, V))
    phi = jnp.log(Q_TAB[0, _opaque(jnp.full((b,), ROOT))])  # [B, V]
    g = truncate(jnp.zeros((b,)), phi + noise[:, 0, 0])
    g, tok = jax.lax.top_k(g, width)
    phi = jnp.take_along_axis(phi, tok, axis=1)
    tokens, parents = [tok], [_opaque(jnp.full((b, width), -1, jnp.int32))]
    for depth in range(1, length):
        phic = phi[..., None] + jnp.log(Q_TAB[depth, tok])  # [B, W, V]
        gc = truncate(g, phic + noise[:, depth])
        g, flat = jax.lax.top_k(gc.reshape(b, -1), width)
        beam, tok = flat // V, flat % V
        phi = jnp.take_along_axis(phic.reshape(b, -1), flat, axis=1)
        parents.append(((depth - 1) * width + beam).astype(jnp.int32))
        tokens.append(tok)
    tok = jnp.concatenate(tokens, axis=1).astype(jnp.int32)
    return Tree(tokens=tok, parents=jnp.concatenate(parents, axis=1), valid=_opaque(jnp.ones(tok.shape, bool)))


# Builders are module-level partials so that jit caches one compilation per (verifier, tree shape).
CHAIN3 = functools.partial(full_tree, b=NSAMP, branching=(1, 1, 1), sampler=iid_children)
IID22 = functools.partial(full_tree, b=NSAMP, branching=(2, 2), sampler=iid_children)
IID32 = functools.partial(full_tree, b=NSAMP, branching=(3, 2), sampler=iid_children)
WOR22 = functools.partial(full_tree, b=NSAMP, branching=(2, 2), sampler=gumbel_topk_children)
TOP22 = functools.partial(full_tree, b=NSAMP, branching=(2, 2), sampler=topk_children)
SBS32 = functools.partial(stochastic_beam_tree, b=NSAMP, width=3, length=2)
PATHS33 = functools.partial(iid_paths, b=NSAMP, k=3, length=3)


# --------------------------------------------------------------------------------------------------
# Deliberately broken rules (each must fail the distribution test).

@dataclasses.dataclass(frozen=True)
class ChainNoResidual(vf.ChainVerifier):
    """On rejection emits y ~ p instead of norm((p - q)+)."""
    name: ClassVar[str] = "broken_chain"

    def _reject(self, row, info, state, cur, i):
        return state


@dataclasses.dataclass(frozen=True)
class SpecInferNoResidual(vf.SpecInferVerifier):
    """Never updates P after a rejected child."""
    name: ClassVar[str] = "broken_specinfer"

    def _reject(self, row, info, state, cur, i):
        return state


@dataclasses.dataclass(frozen=True)
class RSDWithQ(vf.RSDVerifier):
    """Tests without-replacement children against the original q (SpecInfer's rule)."""
    name: ClassVar[str] = "broken_rsd"

    def _accept_prob(self, row, info, state, cur, i):
        x = row["tokens"][i]
        return vf._ratio(state["P"][x], row["q"][cur][x])

    def _reject(self, row, info, state, cur, i):
        P = state["P"]
        return {"P": vf._normalize(jax.nn.relu(P - row["q"][cur]), P), "Q": state["Q"]}


@dataclasses.dataclass(frozen=True)
class TopKNoRenorm(vf.TopKVerifier):
    """Zeroes a rejected child's mass but does not renormalise P."""
    name: ClassVar[str] = "broken_topk"

    def _reject(self, row, info, state, cur, i):
        return {"P": state["P"].at[row["tokens"][i]].set(0.0)}


@dataclasses.dataclass(frozen=True)
class PointMassResample(vf.PointMassVerifier):
    """On a mismatch emits a fresh draw from P instead of the draw y that was compared."""
    name: ClassVar[str] = "broken_point_mass"

    def _emit(self, row, info, state, cur, u):
        return vf._sample(row["p"][cur], u, row["p"][cur])


@dataclasses.dataclass(frozen=True)
class SpecTrRhoOne(vf.SpecTrVerifier):
    """ρ = 1 and the chain residual (p - q)+ with k drafts: over-accepts."""
    name: ClassVar[str] = "broken_spectr"

    def _prepare(self, row):
        ones = jnp.ones((row["p"].shape[0],), jnp.float32)
        return {"rho": ones, "coef": ones}


def _block_core_first_failure(p_path, q_path, x, gamma, u, u_bonus):
    """Block verification's h_i, but scanned token-wise: stop at the first i with u_i >= h_i instead
    of taking the largest i with u_i < h_i."""
    length = x.shape[0]
    r = vf._ratio(jnp.take_along_axis(p_path[:length], x[:, None], axis=1)[:, 0],
                  jnp.take_along_axis(q_path, x[:, None], axis=1)[:, 0])
    _, w = jax.lax.scan(lambda w, ri: (jnp.minimum(1.0, w * ri),) * 2, jnp.float32(1.0), r)
    resid = jnp.sum(jax.nn.relu(w[:-1, None] * p_path[1:length] - q_path[1:length]), axis=-1)
    resid = jnp.concatenate([resid, jnp.zeros((1,))])
    pos = jnp.arange(1, length + 1)
    h = jnp.where(pos < gamma, resid / (resid + 1.0 - w + 1e-30), jnp.where(pos == gamma, w, 0.0))
    tau = jnp.sum(jnp.cumprod((u < h).astype(jnp.int32)))
    w_tau = jnp.where(tau > 0, w[jnp.maximum(tau - 1, 0)], 1.0)
    p_next = p_path[tau]
    res = jax.nn.relu(w_tau * p_next - q_path[jnp.minimum(tau, length - 1)])
    return tau, vf._sample(jnp.where(tau == gamma, p_next, res), u_bonus, p_next)


@dataclasses.dataclass(frozen=True)
class BlockFirstFailure(vf.BlockVerifier):
    name: ClassVar[str] = "broken_block"
    _core = staticmethod(_block_core_first_failure)


@dataclasses.dataclass(frozen=True)
class GBVPlainQ(vf.GreedyBlockVerifier):
    """Block-verifies the greedily selected path against q, ignoring the selection's skew."""
    name: ClassVar[str] = "broken_gbv"

    def _path_draft_law(self, q, chain, x, order, rank, num_paths):
        return q[chain[:-1]]


# --------------------------------------------------------------------------------------------------
# Running many verifications at once and testing the output law.

def first_two_tokens(res, tree, key):
    n = res.num_accepted

    def tok(j):
        return jnp.take_along_axis(tree.tokens, jnp.maximum(res.path[:, j:j + 1], 0), axis=1)[:, 0]

    t0 = jnp.where(n >= 1, tok(0), res.bonus)
    g = jax.random.gumbel(key, (n.shape[0], V))
    fresh = jnp.argmax(jnp.log(P_TAB[1, t0]) + g, axis=-1)  # the next decoding step
    t1 = jnp.where(n >= 2, tok(1), jnp.where(n == 1, res.bonus, fresh))
    return t0, t1


@functools.lru_cache(maxsize=None)
def drafts(builder, seed=0):
    """One batch of NSAMP drafted trees with their target/draft distributions (shared by the
    verifiers that use the same tree fixture: one compilation per builder)."""

    @jax.jit
    def make(key):
        tree = builder(key)
        return tree, slot_probs(P_TAB, tree), slot_probs(Q_TAB, tree)

    return make(jax.random.key(seed))


@functools.partial(jax.jit, static_argnames=("verifier",))
def _verify_cells(verifier, tree, p, q, k_ver, k_next):
    res = verifier(p, q if verifier.needs_draft_probs else None, tree, k_ver)
    t0, t1 = first_two_tokens(res, tree, k_next)
    return t0 * V + t1, res.num_accepted


@functools.lru_cache(maxsize=None)
def run(verifier, builder, seed=0):
    """(first-two-token cell per row, accepted count per row) for NSAMP verifications."""
    tree, p, q = drafts(builder, seed)
    k_ver, k_next = jax.random.split(jax.random.key(seed + 1))
    cells, num = _verify_cells(verifier, tree, p, q, k_ver, k_next)
    return np.asarray(cells), np.asarray(num)


def pvalues(cells):
    counts = np.bincount(cells, minlength=V * V).astype(np.float64)
    n = counts.sum()
    p_joint = stats.chisquare(counts, n * JOINT.ravel()).pvalue
    p_first = stats.chisquare(counts.reshape(V, V).sum(1), n * JOINT.sum(1)).pvalue
    return p_joint, p_first


LOSSLESS_CASES = [
    ("chain", vf.ChainVerifier(), CHAIN3),
    ("block", vf.BlockVerifier(), CHAIN3),
    ("point_mass-chain", vf.PointMassVerifier(), CHAIN3),
    ("point_mass-tree", vf.PointMassVerifier(), IID22),
    ("specinfer", vf.SpecInferVerifier(), IID22),
    ("rsd-gumbel_topk", vf.RSDVerifier(), WOR22),
    ("rsd-beam_search", vf.RSDVerifier(), SBS32),
    ("topk", vf.TopKVerifier(), TOP22),
    ("spectr", vf.SpecTrVerifier(), IID32),
    ("gbv", vf.GreedyBlockVerifier(), PATHS33),
]

BROKEN_CASES = [
    ("chain", ChainNoResidual(), CHAIN3),
    ("block", BlockFirstFailure(), CHAIN3),
    ("point_mass", PointMassResample(), IID22),
    ("specinfer", SpecInferNoResidual(), IID22),
    ("rsd-gumbel_topk", RSDWithQ(), WOR22),
    ("rsd-beam_search", RSDWithQ(), SBS32),
    # The correct RSD rule on i.i.d. siblings (a pair the engine refuses): not lossless either.
    ("rsd-iid_siblings", vf.RSDVerifier(), IID22),
    ("topk", TopKNoRenorm(), TOP22),
    ("spectr", SpecTrRhoOne(), IID32),
    ("gbv", GBVPlainQ(), PATHS33),
]


@pytest.mark.parametrize("case", LOSSLESS_CASES, ids=[c[0] for c in LOSSLESS_CASES])
def test_lossless_output_distribution(case):
    label, verifier, builder = case
    cells, num = run(verifier, builder)
    p_joint, p_first = pvalues(cells)
    print(f"\n{label}: chi2 p(first two)={p_joint:.4g} p(first)={p_first:.4g} "
          f"mean accepted={num.mean():.4f}")
    assert p_joint > P_OK and p_first > P_OK, (label, p_joint, p_first)


@pytest.mark.parametrize("case", BROKEN_CASES, ids=[c[0] for c in BROKEN_CASES])
def test_broken_rule_fails(case):
    label, verifier, builder = case
    cells, _ = run(verifier, builder)
    p_joint, p_first = pvalues(cells)
    print(f"\nbroken {label}: chi2 p(first two)={p_joint:.3g} p(first)={p_first:.3g}")
    assert p_joint < P_BROKEN, (label, p_joint)


def test_sbs_tree_really_branches():
    """The beam-search fixture must produce rows where a node has several children."""
    tree, _, _ = drafts(SBS32)
    par = np.asarray(tree.parents[:2000])
    counts = np.stack([np.bincount(r[r >= 0], minlength=6) for r in par])
    assert (counts.max(axis=1) >= 2).mean() > 0.3
    vf.check_tree_kind("tree", par)


def test_block_accepts_at_least_chain():
    """Sun et al.: block verification is never worse than token-wise verification (same drafts)."""
    _, n_chain = run(vf.ChainVerifier(), CHAIN3)
    _, n_block = run(vf.BlockVerifier(), CHAIN3)
    se = math.sqrt((n_chain.var() + n_block.var()) / NSAMP)
    print(f"\nmean accepted: chain {n_chain.mean():.4f}, block {n_block.mean():.4f} (se {se:.4f})")
    assert n_block.mean() >= n_chain.mean() - 3 * se


def test_gbv_accepts_more_than_block_of_one_path():
    """Several paths give GBV more chances than block verification of the first path alone."""
    _, n_gbv = run(vf.GreedyBlockVerifier(), PATHS33)
    _, n_block = run(vf.BlockVerifier(), CHAIN3)
    print(f"\nmean accepted: gbv (K=3) {n_gbv.mean():.4f}, block {n_block.mean():.4f}")
    assert n_gbv.mean() > n_block.mean()


def test_gbv_on_one_path_is_block_verification():
    """With K = 1 the skewed law is q itself: GBV must reproduce block verification draw for draw
    (same drafts, same keys). Allow a handful of rows to differ by float rounding of the skewed law."""
    cells_b, num_b = run(vf.BlockVerifier(), CHAIN3)
    cells_g, num_g = run(vf.GreedyBlockVerifier(), CHAIN3)
    differ = (cells_b != cells_g) | (num_b != num_g)
    assert differ.mean() < 1e-4, differ.sum()


def test_spectr_rho_is_the_smallest_feasible_ratio():
    """ρ* = the smallest ρ in [1, k] with 1 - (1-β(ρ))^k <= ρβ(ρ): feasible at ρ*, infeasible just below."""
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.full(V, 0.5), size=64)
    q = rng.dirichlet(np.full(V, 0.5), size=64)
    k = rng.integers(0, 5, size=64)
    rho, coef = jax.jit(vf._spectr_rho, static_argnums=3)(jnp.asarray(p, jnp.float32),
                                                           jnp.asarray(q, jnp.float32), jnp.asarray(k), 32)
    rho, coef = np.asarray(rho, np.float64), np.asarray(coef, np.float64)

    def slack(r):  # ρβ(ρ) - (1 - (1-β(ρ))^k)
        beta = np.minimum(q, p / r[:, None]).sum(1)
        return r * beta - (1 - (1 - beta) ** k)

    assert np.all((rho >= 1) & (rho <= np.maximum(k, 1) + 1e-6))
    assert np.all(slack(rho) >= -1e-5)
    below = np.maximum(rho - 1e-3, 1.0)
    assert np.all((rho == 1.0) | (slack(below) < 0))
    assert np.all(rho[k <= 1] == 1.0)
    beta = np.minimum(q, p / rho[:, None]).sum(1)
    np.testing.assert_allclose(coef, np.where(k > 0, (1 - (1 - beta) ** k) / beta, 0), rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Greedy exactness.

def _peaked_rows(argmaxes):
    """[B, N+1] argmax tokens -> [B, N+1, V] distributions peaked (not one-hot) at them."""
    a = np.asarray(argmaxes)
    probs = np.full(a.shape + (V,), 0.1 / (V - 1), np.float32)
    np.put_along_axis(probs, a[..., None], 0.9, axis=-1)
    return jnp.asarray(probs)


def test_greedy_hand_made_tree():
    #            root
    #        0:1      1:2
    #     2:3  3:0    4:4
    #     5:2
    tokens = np.array([1, 2, 3, 0, 4, 2])
    parents = np.array([-1, -1, 0, 0, 1, 2])
    b = 5
    tree = Tree(tokens=jnp.asarray(np.tile(tokens, (b, 1)), jnp.int32),
                parents=jnp.asarray(np.tile(parents, (b, 1)), jnp.int32),
                valid=jnp.asarray(np.array([[1] * 6, [1] * 6, [1] * 6, [1, 0, 1, 1, 1, 1],
                                            [1, 1, 1, 1, 1, 1]], bool)))
    # argmax per slot (root, after node 0..5)
    argmax = np.array([[2, 0, 4, 0, 0, 3, 0],   # root->node1 (2), ->node4 (4), leaf: bonus 3
                       [1, 3, 0, 2, 0, 0, 0],   # node0 (1), node2 (3), node5 (2), bonus 0
                       [4, 0, 0, 0, 0, 0, 0],   # no root child carries 4: bonus 4
                       [2, 0, 4, 0, 0, 3, 0],   # node1 invalid: bonus 2 at the root
                       [1, 0, 0, 0, 0, 0, 1]])  # node0 (1), node3 (0), leaf: bonus = slot 4's 0
    res = vf.GreedyVerifier()(_peaked_rows(argmax), None, tree, jax.random.key(0))
    np.testing.assert_array_equal(res.num_accepted, [2, 3, 0, 0, 2])
    np.testing.assert_array_equal(res.bonus, [3, 0, 4, 2, 0])
    np.testing.assert_array_equal(res.path[:, :3], [[1, 4, -1], [0, 2, 5], [-1, -1, -1],
                                                    [-1, -1, -1], [0, 3, -1]])
    assert np.all(np.asarray(res.path[:, 3:]) == -1)


def test_greedy_equals_plain_greedy_decoding():
    b = 512
    tree = jax.jit(functools.partial(full_tree, b=b, branching=(3, 3, 2), sampler=iid_children))(
        jax.random.key(11))
    res = jax.jit(vf.GreedyVerifier())(slot_probs(P_TAB, tree), None, tree, jax.random.key(1))
    greedy, last = [], ROOT
    for depth in range(DMAX):  # plain greedy decoding of the toy target
        last = int(np.argmax(P_NP[depth, last]))
        greedy.append(last)
    toks, path = np.asarray(tree.tokens), np.asarray(res.path)
    num, bonus = np.asarray(res.num_accepted), np.asarray(res.bonus)
    assert num.max() == 3 and num.min() == 0  # the fixture exercises full, partial and empty paths
    for r in range(b):
        out = [int(toks[r, i]) for i in path[r, :num[r]]] + [int(bonus[r])]
        assert out == greedy[:num[r] + 1], r
        # maximal: the next greedy token is not among the last accepted node's children
        cur = path[r, num[r] - 1] if num[r] else -1
        kids = toks[r][np.asarray(tree.parents[r]) == cur]
        assert greedy[num[r]] not in kids.tolist()


# --------------------------------------------------------------------------------------------------
# Flags, registry and input checks.

def test_lossless_flags_and_registry():
    assert set(vf.VERIFIERS) == {"greedy", "chain", "point_mass", "block", "specinfer", "rsd", "topk",
                                 "spectr", "gbv", "typical"}
    for name in vf.VERIFIERS:
        v = vf.get_verifier(name)
        assert v.name == name and v.tree_kind in vf.TREE_KINDS
        assert v.lossless is (name != "typical"), name
        hash(v)  # static under jit
    typical = vf.get_verifier("typical", eps=0.05, delta=0.2)
    assert typical.lossless is False and "LOSSY" in type(typical).__doc__
    assert "Lossy" in type(typical).__name__
    assert vf.get_verifier("chain").tree_kind == "chain" and vf.get_verifier("block").tree_kind == "chain"
    assert vf.get_verifier("gbv").tree_kind == "paths"
    assert not vf.get_verifier("point_mass").needs_draft_probs
    assert vf.get_verifier("spectr").needs_draft_probs


def test_typical_acceptance_is_greedy_first():
    tokens = jnp.asarray([[3, 1, 2]], jnp.int32)  # three root children
    tree = Tree(tokens=tokens, parents=jnp.asarray([[-1, -1, -1]]), valid=jnp.ones((1, 3), bool))
    p = np.full((1, 4, V), 0.05, np.float32)
    p[0, 0] = [0.02, 0.38, 0.4, 0.1, 0.1]  # argmax 2 (node 2) beats the earlier, passing node 1
    res = vf.get_verifier("typical")(jnp.asarray(p), None, tree, jax.random.key(0))
    assert res.path[0, 0] == 2 and res.num_accepted[0] == 1 and res.bonus[0] == 0
    p[0, 0] = [0.6, 0.3, 0.05, 0.03, 0.02]  # argmax 0 absent; node 1 passes, node 0 (token 3) not
    res = vf.get_verifier("typical")(jnp.asarray(p), None, tree, jax.random.key(0))
    assert res.path[0, 0] == 1


def test_bad_inputs_raise_clear_errors():
    tree = chain_tree(jnp.zeros((2, 3), jnp.int32))
    good = jnp.full((2, 4, V), 1.0 / V)
    with pytest.raises(ValueError, match=r"\[B, N\+1, V\] = \[2, 4, V\]"):
        vf.get_verifier("chain")(jnp.full((2, 3, V), 1.0 / V), good, tree, jax.random.key(0))
    with pytest.raises(ValueError, match="target_probs"):
        jax.jit(vf.get_verifier("greedy"))(jnp.full((2, 4), 0.2), None, tree, jax.random.key(0))
    with pytest.raises(ValueError, match="draft_probs"):
        vf.get_verifier("specinfer")(good, None, tree, jax.random.key(0))
    with pytest.raises(ValueError, match="draft_probs has shape"):
        vf.get_verifier("rsd")(good, good[:, :, :3], tree, jax.random.key(0))
    bad_tree = Tree(tokens=tree.tokens, parents=tree.parents[:, :2], valid=tree.valid)
    with pytest.raises(ValueError, match="tree.parents"):
        vf.get_verifier("topk")(good, None, bad_tree, jax.random.key(0))
    with pytest.raises(ValueError, match="valid names: greedy, chain"):
        vf.get_verifier("nope")
    with pytest.raises(ValueError, match="no option"):
        vf.get_verifier("chain", eps=0.1)
    with pytest.raises(ValueError, match="eps"):
        vf.get_verifier("typical", eps=-1.0)


def test_tree_kind_checks():
    branching = np.array([[-1, -1, 0, 0]])
    for name in ("chain", "block"):
        with pytest.raises(vf.TreeKindError, match="verifies a chain"):
            vf.check_tree_kind(vf.get_verifier(name), branching)
    vf.check_tree_kind(vf.get_verifier("block"), np.array([[-1, 0, 1], [-1, 0, 1]]))
    vf.check_tree_kind(vf.get_verifier("specinfer"), branching)
    vf.check_tree_kind(vf.get_verifier("gbv"), np.array([-1, 0, -1, 2]))
    with pytest.raises(vf.TreeKindError, match="share only the root"):
        vf.check_tree_kind(vf.get_verifier("gbv"), np.array([-1, 0, 0]))
    with pytest.raises(vf.TreeKindError, match="equal length"):
        vf.check_tree_kind(vf.get_verifier("gbv"), np.array([-1, 0, -1]))
    with pytest.raises(TreeError):
        vf.check_tree_kind(vf.get_verifier("topk"), np.array([-1, 2, 0]))
    # a concrete tree is checked at call time; under jit it cannot be
    tree = Tree(tokens=jnp.zeros((1, 4), jnp.int32), parents=jnp.asarray(branching),
                valid=jnp.ones((1, 4), bool))
    probs = jnp.full((1, 5, V), 1.0 / V)
    with pytest.raises(vf.TreeKindError, match="'block' verifies a chain"):
        vf.get_verifier("block")(probs, probs, tree, jax.random.key(0))


# --------------------------------------------------------------------------------------------------
# Edge cases: degenerate rows, zero residuals, invalid nodes, vmap.

def _edge_batch(kind, seed):
    """Rows: no valid node; p == q; a one-hot p whose root argmax is the first draft; q with zeros
    (also at drafted tokens); a random valid mask; a plain row. Returns (p, q, tree)."""
    b = 6
    parents = {"chain": [-1, 0, 1, 2], "paths": [-1, 0, 1, -1, 3, 4], "tree": [-1, -1, 0, 0, 1, 1]}[kind]
    n = len(parents)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(b, n))
    p = rng.dirichlet(np.ones(V), size=(b, n + 1)).astype(np.float32)
    q = rng.dirichlet(np.ones(V), size=(b, n + 1)).astype(np.float32)
    q[1] = p[1]
    p[2] = np.eye(V, dtype=np.float32)[rng.integers(0, V, size=n + 1)]
    p[2, 0] = np.eye(V, dtype=np.float32)[tokens[2, 0]]
    q[3, :, ::2] = 0.0
    q[3] /= q[3].sum(-1, keepdims=True)
    valid = np.ones((b, n), bool)
    valid[0] = False
    valid[4] = rng.random(n) < 0.6
    tree = Tree(tokens=jnp.asarray(tokens, jnp.int32), parents=jnp.asarray(np.tile(parents, (b, 1)), jnp.int32),
                valid=jnp.asarray(valid))
    return jnp.asarray(p), jnp.asarray(q), tree


@pytest.mark.parametrize("name", vf.VERIFIERS)
def test_edge_cases_are_well_formed_under_vmap(name):
    """vmap over an outer axis (16 independent batches of the edge rows, one key each) under jit."""
    verifier = vf.get_verifier(name)
    p, q, tree = _edge_batch(verifier.tree_kind, 2)
    vf.check_tree_kind(verifier, np.asarray(tree.parents))
    reps = 16
    stack = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (reps,) + x.shape), (p, q, tree))
    keys = jax.random.split(jax.random.key(9), reps)
    res = jax.jit(jax.vmap(verifier))(*stack, keys)
    path, num, bonus = (np.asarray(x) for x in (res.path, res.num_accepted, res.bonus))
    parents, valid, toks = (np.asarray(x) for x in (tree.parents, tree.valid, tree.tokens))
    assert np.all((bonus >= 0) & (bonus < V))
    assert np.all(num[:, 0] == 0) and np.all(path[:, 0] == -1)  # the row without valid nodes
    for s in range(reps):
        for r in range(p.shape[0]):
            k = num[s, r]
            assert np.all(path[s, r, k:] == -1) and np.all(path[s, r, :k] >= 0)
            prev = -1
            for node in path[s, r, :k]:
                assert valid[r, node] and parents[r, node] == prev, (name, s, r)
                prev = node
    if verifier.lossless:
        # A one-hot target leaves exactly one possible output: its own argmax walk.
        first = np.where(num[:, 2] >= 1, toks[2][np.maximum(path[:, 2, 0], 0)], bonus[:, 2])
        assert np.all(first == np.argmax(np.asarray(p)[2, 0])), name
    if name not in ("greedy", "typical"):  # sampling verifiers must actually use their keys
        assert len({tuple(b) for b in bonus}) > 1
    if name in ("spectr", "gbv"):  # vmapped slices equal separate calls
        for s in (0, 5):
            one = jax.jit(verifier)(p, q, tree, keys[s])
            for a, c in zip(jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(res)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(c)[s])


def test_greedy_verdict_from_the_argmax_alone_is_the_full_verdict():
    """verify_argmax (what the engine calls when decoding greedily) gives the verdict the verifier gives
    from the whole [B, N+1, V] distribution, on random trees whose tokens often match the argmax."""
    from jaxdecode.tree import Tree
    from jaxdecode.verifiers import get_verifier
    b, n, v = 6, 7, 5
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(3), 3)
    probs = jax.nn.softmax(3 * jax.random.normal(k1, (b, n + 1, v)), axis=-1)
    parents = jnp.asarray([[-1, 0, 1, 0, 3, -1, 5]] * b, jnp.int32)
    tokens = jax.random.randint(k2, (b, n), 0, v, jnp.int32)
    valid = jax.random.uniform(k3, (b, n)) < 0.9
    valid = valid & jnp.where(parents >= 0, jnp.take_along_axis(valid, jnp.maximum(parents, 0), axis=1), True)
    tree = Tree(tokens=tokens, parents=parents, valid=valid)
    ver = get_verifier("greedy")
    full = ver(probs, None, tree, jax.random.PRNGKey(0))
    fast = ver.verify_argmax(jnp.argmax(probs, axis=-1), tree)
    for a, c in zip(jax.tree.leaves(full), jax.tree.leaves(fast)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    assert int(jnp.sum(full.num_accepted)) > 0  # the test sees acceptances, not only empty paths


@pytest.mark.parametrize("n", [1, 5, 24])
def test_greedy_walk_without_a_node_loop_matches_the_sequential_walk(n):
    """GreedyVerifier decides with [N, N] masks instead of a loop over the nodes; on random trees (ids in
    parent-first order, siblings sharing tokens, invalid nodes anywhere, 3 tokens so matches are
    frequent) its path, count and bonus equal the sequential walk's."""
    ver = vf.get_verifier("greedy")
    sequential = jax.jit(jax.vmap(functools.partial(vf._SequentialVerifier._verify_row, ver)))
    vectorised = jax.jit(jax.vmap(ver._verify_row))
    rng = np.random.default_rng(n)
    b, v = 64, 3
    parents = np.stack([[rng.integers(-1, i) if i else -1 for i in range(n)] for _ in range(b)]).reshape(b, n)
    args = (jnp.asarray(rng.integers(0, v, (b, n + 1)), jnp.int32), jnp.zeros((b, 1)),
            jnp.asarray(rng.integers(0, v, (b, n)), jnp.int32), jnp.asarray(parents, jnp.int32),
            jnp.asarray(rng.random((b, n)) < 0.85), jnp.zeros((b, 2 * n + 2)))
    for a, c in zip(sequential(*args), vectorised(*args)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    if n > 1:
        assert int(jnp.max(vectorised(*args)[1])) >= 2  # deep paths are exercised, not only empty ones


def test_greedy_walk_of_an_empty_tree_emits_the_root_argmax():
    empty = jnp.zeros((0,), jnp.int32)
    path, num, bonus = vf.get_verifier("greedy")._verify_row(jnp.asarray([2], jnp.int32), None, empty, empty,
                                                              empty.astype(bool), None)
    assert path.shape == (0,) and int(num) == 0 and int(bonus) == 2
