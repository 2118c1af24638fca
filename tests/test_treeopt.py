"""Tree size and shape from acceptance and cost (jaxdecode.treeopt): Sequoia's dynamic program against
brute force, the hardware-aware choice on synthetic cost tables, the acceptance profile measured through
the real engine, and generate(tree="auto")."""
import functools
import json

import numpy as np
import pytest

from jaxdecode.treeopt import (AcceptanceProfile, acceptance_matrix, choose_tree, comb_paths, split_draft_cost,
                               SizedCosts, size_walk,
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


def test_draft_cost_per_level_and_per_node():
    # comb 8 x 4 and chain of 4 from level = 2, node = 0.5: comb = 4 * (2 + 8 * 0.5), chain = 4 * 2.5
    assert split_draft_cost(24.0, 8, 4, 10.0) == pytest.approx((2.0, 0.5))
    assert split_draft_cost(9.0, 8, 4, 10.0) == (2.5, 0.0)  # noise: the comb timed faster, nothing negative
    assert split_draft_cost(8.0, 1, 4, 99.0) == (2.0, 0.0)  # a chain comb: all per level
    widths = (0, 1, 2, 4, 8, 16)
    flat = _Costs(widths, [1.0] * 6)
    # Medusa-like: depth-1 heads are good at every rank, deeper ones only at rank 0.
    p = ((0.5, 0.4, 0.3, 0.3), (0.8, 0.05, 0.05, 0.05), (0.8, 0.05, 0.05, 0.05))
    per_node = choose_tree(p, flat, 12, 3, draft_seconds_per_level=0.0, draft_seconds_per_node=0.2)
    per_level = choose_tree(p, flat, 12, 3, draft_seconds_per_level=0.8, draft_seconds_per_node=0.0)
    # priced per node, every node must pay for itself: a small tree; per level, extra nodes are free
    assert per_node.num_nodes < per_level.num_nodes
    assert per_node.step_seconds == pytest.approx(1.0 + 0.2 * per_node.num_nodes)
    assert per_level.step_seconds == pytest.approx(1.0 + 0.8 * per_level.depth)
    with pytest.raises(ValueError, match="draft_seconds_per_node"):
        choose_tree(p, flat, 12, 3, draft_seconds_per_node=-1.0)
    # a table measured with a 12-node drafter, re-priced for smaller trees; never below the forward alone
    table = _Costs(widths, [1.0, 1.2, 1.2, 1.2, 1.2, 1.2])
    table.step_at = lambda w: 1.0 if w == 0 else 2.0  # whole steps: the forward + bookkeeping of 12 slots
    sized = SizedCosts(table, measured_nodes=12, per_node=0.05)
    assert sized.step_at(0) == 1.0 and sized.step_at(12) == pytest.approx(2.0)
    assert sized.step_at(2) == pytest.approx(2.0 - 0.05 * 10)
    assert SizedCosts(table, 12, per_node=1.0).step_at(1) == pytest.approx(1.2)  # the forward's floor


def _trees(*sizes):
    """Stand-ins for the model's ranking: a chain per size, best first."""
    return [tuple((0,) * d for d in range(1, n + 1)) for n in sizes]


@pytest.mark.parametrize("peak, budget, measured, chosen", [
    (2, 4, [(5, 2), (2, 1)], 2),  # down while faster: 5 -> 2 (faster) -> 1 (slower): stop at 2
    (1, 4, [(5, 2), (2, 1)], 1),  # down to one node
    (5, 4, [(5, 2), (5, 6)], 5),  # down is slower, up is slower: the model's choice
    (20, 4, [(5, 2), (5, 6), (6, 9)], 9),  # down is slower: up (the best of (n, 2n] nodes) while faster
    (20, 9, [(5, 2), (5, 6), (6, 9), (9, 18)], 18),
    (20, 2, [(5, 2)], 5),  # the budget: two trees run
    (1, 1, [], 5),  # budget 1: the model's choice, nothing run
])
def test_size_walk(peak, budget, measured, chosen):
    ranked = _trees(5, 4, 6, 2, 9, 3, 1, 18, 12)
    calls = []

    def measure(cands):  # tokens/s peaked at `peak` nodes
        calls.append(tuple(len(q) for q in cands))
        return [100.0 * 0.8 ** abs(len(q) - peak) for q in cands]
    assert len(size_walk(ranked, measure, budget)) == chosen
    assert calls == measured


def _walk(sizes, rates, budget=4, margin=None):
    """size_walk over chains of `sizes` (best first) whose tokens/s are rates[nodes]: (chosen size,
    the sizes of each measured pair)."""
    calls = []

    def measure(cands):
        calls.append(tuple(len(q) for q in cands))
        return [rates[len(q)] for q in cands]
    return len(size_walk(_trees(*sizes), measure, budget, margin)), calls


def test_size_walk_settles_a_tie_by_its_measurement():
    rates = {4: 100.0, 2: 104.0, 1: 103.0, 8: 90.0}  # 2 and 1 nodes: faster, but within the 5% margin
    # a tie does not move the walk: it looks one step further (1 node, against 4), then up; the tie
    # left standing goes to the tree that ran fastest against the best (2 nodes)
    assert _walk((4, 2, 1, 8), rates) == (2, [(4, 2), (4, 1), (4, 8)])
    assert _walk((4, 2, 1, 8), rates, margin=0.01)[0] == 2
    # ties that ran slower than the best keep the best
    assert _walk((4, 2, 1, 8), {4: 100.0, 2: 97.0, 1: 96.0, 8: 90.0}) == (4, [(4, 2), (4, 1), (4, 8)])
    # a tie with an earlier best does not count once the walk has moved: 8 -> 4 a tie (+2%), 2 beats 8;
    # 1 ties with 2 but ran slower, so 2 stays although 4 ran faster than 8
    assert _walk((8, 4, 2, 1), {8: 100.0, 4: 102.0, 2: 110.0, 1: 108.0}) == (2, [(8, 4), (8, 2), (2, 1)])
    # the Zen 5 case (retrieval greedy, bf16): chain:12 vs chain:6 a tie, chain:3 a tie but slower -> 6
    assert _walk((12, 6, 3), {12: 1.98, 6: 2.04, 3: 1.95}) == (6, [(12, 6), (12, 3)])


def test_size_walk_looks_past_a_tie():
    sizes = (8, 4, 2, 1, 16)
    # Hydra's shape: 8 -> 4 a tie, 2 faster than 8 by more than the margin, 1 slower than 2
    hydra = {8: 83.0, 4: 85.0, 2: 95.0, 1: 80.0, 16: 60.0}
    assert _walk(sizes, hydra) == (2, [(8, 4), (8, 2), (2, 1)])
    # one look past a tie, not two: 8 -> 4 a tie -> 2 a tie: stop, then up; the fastest tie (4) is kept
    assert _walk(sizes, {8: 83.0, 4: 85.0, 2: 84.0, 1: 120.0, 16: 60.0}) == (4, [(8, 4), (8, 2), (8, 16)])
    # a tie that ends at a loss beyond the margin stops the direction
    assert _walk(sizes, {8: 83.0, 4: 82.0, 2: 70.0, 1: 120.0, 16: 90.0}) == (16, [(8, 4), (8, 2), (8, 16)])
    # the look-ahead counts against the budget (the tie it left is settled: 4 ran faster than 8)
    assert _walk(sizes, hydra, budget=2) == (4, [(8, 4)])


def test_profile_json_and_estimates():
    prof = AcceptanceProfile(2, 2, tried=((10, 4), (6, 3)), accepted=((6, 1), (3, 0)))
    np.testing.assert_allclose(prof.p, [9 / 16, 1 / 7])
    by_depth = prof.p_by_depth(prior_weight=0.0)
    np.testing.assert_allclose(by_depth, [[0.6, 0.25], [0.5, 0.0]])
    assert AcceptanceProfile.from_json(prof.to_json()) == prof
    with pytest.raises(ValueError, match="do not fit"):
        AcceptanceProfile.from_json(dict(prof.to_json(), width=3))
    assert len(comb_paths(3, 2)) == 6


# ----------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def pair():
    """A 1-layer target and a draft near it (its weights plus noise: top-1 agreement about one half, so
    lower ranks are accepted too)."""
    import jax
    from jaxdecode.model import Model
    from test_speculative import tiny
    cfg, params = tiny(layers=1)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(5), len(leaves))
    near = [x + 0.03 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return Model(cfg, params), Model(cfg, jax.tree.unflatten(treedef, near))


PROMPTS = [[3, 9, 27, 4, 1, 7, 7], [8, 2], [5, 5, 5], [60, 1, 33, 7]]


def test_profile_counts_ranks_through_the_engine(pair):
    from jaxdecode.autoregressive import pad_prompts
    from jaxdecode.drafters import DraftLM
    from jaxdecode.treeopt import acceptance_profile
    target, _ = pair
    toks, lens = pad_prompts(PROMPTS)
    # the settings of the auto test below (one compiled loop for both)
    prof = acceptance_profile(target, lambda t: DraftLM(params=target.params, config=target.config, builder=t),
                              toks, lens, width=3, depth=3, max_new_tokens=12)
    # a perfect drafter: every top-1 child is accepted, ranks 1, 2 are never tried; 4 rows x 3 steps
    # (4 tokens each)
    assert prof.tried == ((12, 0, 0),) * 3 and prof.accepted == ((12, 0, 0),) * 3
    assert prof.p.tolist() == [1.0, 0.0, 0.0] and prof.meta["verifier"] == "greedy"
    assert sequoia_tree(prof.p_by_depth(), 9, 3) == ((0,), (0, 0), (0, 0, 0))


@pytest.fixture
def flat_costs(monkeypatch, tmp_path):
    """Profiles cached under tmp_path; every verification width costs the same and drafting nothing, so
    every node that may be accepted pays (the real calibration is tests/test_costmodel.py's)."""
    import jaxdecode.costmodel as cm
    import jaxdecode.treeopt as to
    monkeypatch.setenv("JAXDECODE_CACHE_DIR", str(tmp_path))
    calls = []

    def fake(model, drafter, batch_size, **kw):
        calls.append(batch_size)
        widths = cm.default_widths(drafter.num_nodes)
        return cm.CostTable(widths=widths, verify_seconds=(1e-3,) * len(widths), draft_seconds=0.0,
                            idle_seconds=0.0, batch_size=batch_size)
    monkeypatch.setattr(cm, "load_or_calibrate", fake)
    # the walk's runs: flat steps, each node accepted (each test may set its own)
    monkeypatch.setattr(to, "time_runs", lambda model, drafters, *a, **kw: [
        to.TreeRun(1.0 + (d.num_nodes if d else 0), 1e-3, 1e3 * (1.0 + (d.num_nodes if d else 0))) for d in drafters])
    return calls


def test_generate_auto_tree_greedy_exact(pair, flat_costs, monkeypatch):
    import jaxdecode
    import jaxdecode.treeopt as to
    target, other = pair
    plain = jaxdecode.generate(target, PROMPTS, method="greedy", max_new_tokens=10, eos_ids=())
    kw = dict(method="speculative", draft=other, tree="auto:width=3,depth=3,tokens=12", max_new_tokens=10,
              eos_ids=())
    out = jaxdecode.generate(target, PROMPTS, **kw)
    assert [r.tokens for r in out] == [r.tokens for r in plain]
    s = out[0].batch_stats
    # flat costs: the whole budget (3 x 3 comb = 9 nodes) is worth verifying, as a tree of depth <= 3
    assert s["tree_nodes"] == 9 and s["tree_depth"] <= 3 and len(s["tree_parents"]) == 9
    assert s["tree"].endswith(":topk") and s["tree_expected_tau"] >= 1.0
    assert set(flat_costs) == {4}  # the batch size (the adaptive policy may ask for its own table)
    # a second call reads the cached profile: nothing is measured again
    monkeypatch.setattr(to, "acceptance_profile", lambda *a, **k: pytest.fail("profile not cached"))
    again = jaxdecode.generate(target, PROMPTS, **kw)
    assert again[0].batch_stats["tree"] == s["tree"] and [r.tokens for r in again] == [r.tokens for r in plain]


def test_generate_auto_tree_measures_on_the_mesh(pair, monkeypatch, tmp_path):
    """tree="auto" under a mesh prices trees with step costs and runs measured on that mesh (they were
    measured on one device), and its output equals plain greedy's."""
    import jax
    import jaxdecode
    import jaxdecode.costmodel as cm
    import jaxdecode.treeopt as to
    monkeypatch.setenv("JAXDECODE_CACHE_DIR", str(tmp_path))
    meshes = []

    def fake(model, drafter, batch_size, **kw):
        meshes.append(kw.get("mesh"))
        widths = cm.default_widths(drafter.num_nodes)
        return cm.CostTable(widths=widths, verify_seconds=(1e-3,) * len(widths), draft_seconds=0.0,
                            idle_seconds=0.0, batch_size=batch_size)

    def runs(model, drafters, *a, **kw):
        meshes.append(kw.get("mesh"))
        return [to.TreeRun(1.0 + (d.num_nodes if d else 0), 1e-3, 1e3 * (1.0 + (d.num_nodes if d else 0)))
                for d in drafters]
    monkeypatch.setattr(cm, "load_or_calibrate", fake)
    monkeypatch.setattr(to, "time_runs", runs)
    target, other = pair
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    plain = jaxdecode.generate(target, PROMPTS, method="greedy", max_new_tokens=6, eos_ids=())
    out = jaxdecode.generate(target, PROMPTS, method="speculative", draft=other, max_new_tokens=6, eos_ids=(),
                             tree="auto:width=2,depth=2,tokens=8,finalists=2", mesh=mesh, adaptive=False)
    assert [r.tokens for r in out] == [r.tokens for r in plain]
    assert meshes and all(m is not None and dict(m.shape) == {"data": 2, "model": 4} for m in meshes)


def test_auto_tree_walks_down_by_measured_runs(pair, flat_costs, monkeypatch, tmp_path):
    import jaxdecode
    import jaxdecode.treeopt as to
    target, other = pair
    ran = []

    def steep(model, drafters, *a, **kw):  # every node costs as much as a plain step: small trees win
        ran.append([d.num_nodes if d else 0 for d in drafters])
        return [to.TreeRun(2.0 if d else 1.0, 1e-3 * (1 + (d.num_nodes if d else 0)),
                           (2.0 if d else 1.0) / (1e-3 * (1 + (d.num_nodes if d else 0)))) for d in drafters]
    monkeypatch.setattr(to, "time_runs", steep)
    plain = jaxdecode.generate(target, PROMPTS, method="greedy", max_new_tokens=10, eos_ids=())
    kw = dict(method="speculative", draft=other, max_new_tokens=10, eos_ids=())
    out = jaxdecode.generate(target, PROMPTS, tree="auto:width=3,depth=3,tokens=12", **kw)
    assert [r.tokens for r in out] == [r.tokens for r in plain]
    s = out[0].batch_stats
    # plain decoding beside each pair; the model's 9 nodes, then halving while faster, 4 trees run
    assert ran == [[0, 9, 4], [0, 4, 2], [0, 2, 1]] and s["tree_nodes"] == 1
    assert [f["step_ms"] for f in s["tree_finalists"]] == pytest.approx([10, 5, 3, 2])
    assert s["tree_expected_tau"] == 2.0 and s["tree_expected_speedup"] == pytest.approx(1.0)
    assert all(f["model_tau"] >= 1.0 and f["tau"] == 2.0 for f in s["tree_finalists"])
    # the walk is cached: the same call runs nothing
    again = jaxdecode.generate(target, PROMPTS, tree="auto:width=3,depth=3,tokens=12", **kw)
    assert len(ran) == 3 and again[0].batch_stats["tree"] == s["tree"]
    # corrupt caches are measured again with a warning, never an error
    (trials,) = (tmp_path / "trials").glob("*.json")
    (profile,) = (tmp_path / "profiles").glob("*.json")
    trials.write_text("{not json")
    profile.write_text('{"key": "another"}')
    with pytest.warns(UserWarning, match="measured again"):
        third = jaxdecode.generate(target, PROMPTS, tree="auto:width=3,depth=3,tokens=12", **kw)
    assert len(ran) == 6 and third[0].batch_stats["tree"] == s["tree"]
    assert json.loads(trials.read_text())["best"] == [[0]]  # rewritten
    # finalists=1: the model's choice, nothing run
    one = jaxdecode.generate(target, PROMPTS, tree="auto:width=3,depth=3,tokens=12,finalists=1", **kw)
    assert one[0].batch_stats["tree_nodes"] == 9 and one[0].batch_stats["tree_finalists"] == [] and len(ran) == 6


@pytest.mark.real_costs
def test_time_runs_measures_each_configuration(pair):
    """The primitive itself (the autouse fixture replaces it elsewhere): a perfect drafter's tau is its
    depth + 1, plain decoding's is 1; rows are filled cyclically to whole batches."""
    from jaxdecode.autoregressive import pad_prompts
    from jaxdecode.drafters import DraftLM, parse_tree_spec
    from jaxdecode.treeopt import time_runs
    target, _ = pair
    toks, lens = pad_prompts(PROMPTS[:3])
    chain = DraftLM(params=target.params, config=target.config, builder=parse_tree_spec("chain:3"))
    plain, spec = time_runs(target, [None, chain], toks, lens, batch_size=2, max_new_tokens=8, repeats=1)
    assert plain.tau == 1.0 and spec.tau == 4.0
    assert all(r.step_seconds > 0 and r.tokens_per_second > 0 for r in (plain, spec))


def test_generate_auto_chain_for_retrieval_drafters(pair, flat_costs):
    import jaxdecode
    target, _ = pair
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 1, 2, 1]]
    plain = jaxdecode.generate(target, prompts, method="greedy", max_new_tokens=8, eos_ids=())
    out = jaxdecode.generate(target, prompts, method="speculative", drafter="prompt_lookup",
                             tree="auto:depth=3,tokens=8", max_new_tokens=8, eos_ids=())
    assert [r.tokens for r in out] == [r.tokens for r in plain]
    assert out[0].batch_stats["tree"].startswith("chain:")


def test_auto_tree_errors(pair, flat_costs):
    import jaxdecode
    from jaxdecode.drafters import DraftLM, parse_tree_spec
    from jaxdecode.treeopt import parse_auto
    target, other = pair
    with pytest.raises(ValueError, match="tree='auto' builds the drafter"):
        jaxdecode.generate(target, PROMPTS, method="speculative", tree="auto", max_new_tokens=4,
                           drafter=DraftLM(params=other.params, config=other.config,
                                           builder=parse_tree_spec("chain:2")))
    with pytest.raises(ValueError, match="width=, depth="):
        parse_auto("auto:widht=3")
    with pytest.raises(ValueError, match="ints >= 1"):
        parse_auto("auto:depth=0")
    assert parse_auto("auto:depth=4")["depth"] == 4
    # the drafter's own error, passed on first (not after a claim that the drafter takes no trees)
    with pytest.raises(ValueError, match="could not build the drafter on a profiling tree: drafter 'draft_lm' "
                                         "needs a draft model"):
        jaxdecode.generate(target, PROMPTS, method="speculative", drafter="draft_lm", tree="auto",
                           max_new_tokens=4)
    for name in ("token_recycling", "aded"):  # they build their own shapes: sized by nodes:N, not chosen
        with pytest.raises(ValueError, match="builds its own tree shapes: give its size instead.*nodes:N"):
            jaxdecode.generate(target, PROMPTS, method="speculative", drafter=name, tree="auto", max_new_tokens=4)


@pytest.mark.slow
def test_generate_auto_tree_sampling(pair, flat_costs):
    """At T > 0 the auto tree draws children without replacement (verified by RSD) and decodes."""
    import jaxdecode
    target, near = pair
    out = jaxdecode.generate(target, PROMPTS, method="speculative", draft=near, temperature=0.7, seed=3,
                             tree="auto:width=3,depth=3,tokens=12", max_new_tokens=10, eos_ids=())
    assert all(len(r.tokens) == 10 for r in out)
    assert out[0].batch_stats["tree"].endswith(":gumbel") and out[0].batch_stats["tree_nodes"] >= 2
    # a verifier of chains: the chain length is chosen
    out = jaxdecode.generate(target, PROMPTS, method="speculative", draft=near, temperature=0.7, seed=3,
                             verifier="chain", tree="auto:depth=3,tokens=12", max_new_tokens=10, eos_ids=())
    assert out[0].batch_stats["tree"].startswith("chain:")
