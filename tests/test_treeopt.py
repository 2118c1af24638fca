"""Tree size and shape from acceptance and cost (jaxdecode.treeopt): Sequoia's dynamic program against
brute force, the hardware-aware choice on synthetic cost tables, the acceptance profile measured through
the real engine, and generate(tree="auto")."""
import functools

import numpy as np
import pytest

from jaxdecode.treeopt import (AcceptanceProfile, acceptance_matrix, choose_tree, comb_paths,
                               expected_accepted, sequoia_tree, sequoia_values, tree_spec)
from jaxdecode.tree import TreeError

P_VECTORS = [(0.7, 0.2, 0.1), (0.3, 0.3, 0.3, 0.3), (0.9, 0.05), (0.5, 0.5, 0.5),
             ((0.8, 0.3, 0.1), (0.5, 0.2, 0.2), (0.2, 0.1, 0.1))]  # the last one per depth


@functools.lru_cache(maxsize=None)
def _forests(n: int, depth: int) -> tuple:
    """Every ordered forest of exactly n nodes and depth <= depth: a forest is a tuple of trees, a tree
    the forest of its children (the first tree takes s nodes, the rest n - s)."""
    if n == 0:
        return ((),)
    if depth == 0:
        return ()
    out = []
    for s in range(1, n + 1):
        for first in _forests(s - 1, depth - 1):
            for rest in _forests(n - s, depth):
                out.append((first,) + rest)
    return tuple(out)


def _value(forest, a, level=0):
    return sum(a[level, r] * (1 + _value(child, a, level + 1)) if r < a.shape[1] else 0.0
               for r, child in enumerate(forest))


def _paths(forest, prefix=()):
    out = []
    for r, child in enumerate(forest):
        out.append(prefix + (r,))
        out += _paths(child, prefix + (r,))
    return out


@pytest.mark.parametrize("p", P_VECTORS, ids=lambda p: str(np.asarray(p).round(2).tolist()))
@pytest.mark.parametrize("max_depth", [2, 3, 6])
def test_dp_equals_brute_force(p, max_depth):
    a = acceptance_matrix(p, max_depth)
    values = sequoia_values(p, 6, max_depth)
    for n in range(1, 7):
        best = max(_value(f, a) for m in range(1, n + 1) for f in _forests(m, max_depth))
        assert values[n] == pytest.approx(best, abs=1e-12)
        paths = sequoia_tree(p, n, max_depth)
        assert len(paths) <= n and max(len(q) for q in paths) <= max_depth
        assert expected_accepted(paths, p) == pytest.approx(best, abs=1e-12)
    # expected_accepted agrees with the brute-force value of every tree
    for f in _forests(4, max_depth):
        assert expected_accepted(_paths(f), p) == pytest.approx(_value(f, a), abs=1e-12)


def test_acceptance_matrix():
    # the rank-r child is the accepted one: p[r] times the chance that ranks < r were all rejected
    np.testing.assert_allclose(acceptance_matrix((0.5, 0.5, 0.5), 2), [[0.5, 0.25, 0.125]] * 2)
    np.testing.assert_allclose(acceptance_matrix(((0.5, 1.0), (0.2, 0.5)), 3),
                               [[0.5, 0.5], [0.2, 0.4], [0.2, 0.4]])  # deeper: the last row


def test_chain_and_star():
    assert sequoia_tree((1.0, 0.0, 0.0), 5, 8) == tuple((0,) * d for d in range(1, 6))
    assert sequoia_tree((1.0, 0.0, 0.0), 5, 3) == ((0,), (0, 0), (0, 0, 0))  # zero-value nodes dropped
    assert sequoia_tree((0.1,) * 6, 5, 8) == tuple((r,) for r in range(5))
    assert tree_spec(sequoia_tree((0.1,) * 6, 5, 8)) == "static:5:topk"
    assert tree_spec(((0,), (1,), (0, 0)), "iid") == "paths:0;1;0.0:iid"
    assert sequoia_tree((0.0, 0.0), 4, 3) == ((0,),)  # nothing pays: still a tree


def test_expected_accepted_checks_its_input():
    with pytest.raises(TreeError, match="rank 0 is missing"):
        expected_accepted(((1,),), (0.5, 0.5))
    with pytest.raises(TreeError, match="parent"):
        expected_accepted(((0, 0),), (0.5,))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        expected_accepted(((0,),), (1.5,))
    with pytest.raises(ValueError, match="num_nodes"):
        sequoia_tree((0.5,), 0, 3)


class _Costs:
    """A synthetic cost table: verify_at interpolates between measured widths (CostTable's rule)."""

    def __init__(self, widths, seconds, draft_seconds=0.0):
        self.widths, self.verify_seconds, self.draft_seconds = tuple(widths), tuple(seconds), draft_seconds

    def verify_at(self, w):
        return float(np.interp(w, self.widths, self.verify_seconds))


P_REAL = (0.6, 0.3, 0.2, 0.1, 0.1, 0.05, 0.05, 0.05)


def test_choose_tree_follows_the_cost_curve():
    widths = (0, 1, 2, 4, 8, 16, 32)
    flat = choose_tree(P_REAL, _Costs(widths, [1.0] * 7), max_nodes=32, max_depth=6)
    steep = choose_tree(P_REAL, _Costs(widths, [1.0 + 0.25 * w for w in widths]), max_nodes=32, max_depth=6)
    assert flat.num_nodes == 32 and steep.num_nodes < 8
    assert flat.expected_tau > steep.expected_tau > 1
    assert flat.tokens_per_second == pytest.approx(flat.expected_tau / flat.step_seconds)
    assert flat.plain_tokens_per_second == 1.0 and flat.speedup > steep.speedup
    # a costly drafter per level makes the tree shallower
    deep = choose_tree((0.9, 0.1), _Costs(widths, [1.0] * 7), 16, 8, draft_seconds_per_level=0.0)
    shallow = choose_tree((0.9, 0.1), _Costs(widths, [1.0] * 7), 16, 8, draft_seconds_per_level=0.5)
    assert shallow.depth < deep.depth
    with pytest.raises(ValueError, match="widest"):
        choose_tree(P_REAL, _Costs(widths, [1.0] * 7), max_nodes=64, max_depth=4)


def test_profile_json_and_estimates():
    prof = AcceptanceProfile(2, 2, tried=((10, 4), (6, 3)), accepted=((6, 1), (3, 0)))
    np.testing.assert_allclose(prof.p, [9 / 16, 1 / 7])
    by_depth = prof.p_by_depth(prior_weight=0.0)
    np.testing.assert_allclose(by_depth, [[0.6, 0.25], [0.5, 0.0]])
    assert AcceptanceProfile.from_json(prof.to_json()) == prof
    with pytest.raises(ValueError, match="do not fit"):
        AcceptanceProfile.from_json(dict(prof.to_json(), width=3))
    assert len(comb_paths(3, 2)) == 6
