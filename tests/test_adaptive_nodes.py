"""Node-level adaptive speculation (jaxdecode.adaptive): per-node estimates, the kept nodes = each
row's best by reach (not whole depth levels), compacted into the first slots of the forward.

- A wide static tree (8 nodes at depth 1) whose first-rank chain is right: the policy drafts and
  verifies a few nodes (whole-level truncation never drafted: the first level alone cost 8 nodes).
- Greedy output == plain greedy while the kept sets differ between rows (each row right on another
  branch: its kept nodes are not a prefix of the tree) and steps.
- χ² (the harness of tests/test_verifier_pairs.py): sampled static-tree pairs under node truncation
  with per-row, non-prefix kept sets stay lossless; keeping nodes chosen from this step's sampled
  tokens fails the same test.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode import adaptive
from jaxdecode import speculative as spec
from jaxdecode import verifiers as vf
from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters.builders import StaticTreeBuilder
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import speculative_decode
from jaxdecode.tree import Tree, static_tree_layout
from test_speculative import PROMPTS_4, tiny
from test_verifier_pairs import (CFG, LOGQ, PARAMS, PROMPT, V, RowBlocks, RowRanges, StepCosts, chi2_pvalue,
                                 exact_joint, P_BROKEN, P_OK)

GREEDY = SamplerConfig(temperature=0.0)
T1 = SamplerConfig(temperature=1.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BranchOracle:
    """A static tree of point drafts over a known continuation: row b's right branch takes sibling rank
    `right[b]` at depth 1 and rank 0 below (right[b] < 0: nothing is right); every node on that branch
    carries the continuation's token, every other node a wrong one."""
    continuation: jax.Array  # int32[B, T]
    prompt_lengths: jax.Array  # int32[B]
    right: jax.Array  # int32[B]
    builder: StaticTreeBuilder = dataclasses.field(metadata=dict(static=True))
    vocab: int = dataclasses.field(metadata=dict(static=True))
    child_rule = "point"
    is_chain = False
    num_nodes = property(lambda self: self.builder.num_nodes)
    max_depth = property(lambda self: self.builder.max_depth)

    def init(self, prompt_tokens, prompt_lengths, cache_len, key):
        return jnp.zeros((), jnp.int32)

    def propose(self, state, ctx, sampler):
        parents, ranks, depth = static_tree_layout(self.builder.paths)
        # Each node's depth-1 ancestor rank, and whether every deeper rank on its path is 0.
        top, below = np.zeros(len(parents), np.int32), np.zeros(len(parents), bool)
        for i, p in enumerate(parents):
            top[i] = ranks[i] if p < 0 else top[p]
            below[i] = True if p < 0 else below[p] and ranks[i] == 0
        b = ctx.hist_len.shape[0]
        t = self.continuation.shape[1]
        j = (ctx.hist_len - self.prompt_lengths)[:, None] + jnp.asarray(depth - 1)[None, :]  # [B, N]
        good = jnp.take_along_axis(self.continuation, jnp.clip(j, 0, t - 1), axis=1)
        on = (jnp.asarray(top)[None, :] == self.right[:, None]) & jnp.asarray(below)[None, :]
        tokens = jnp.where(on, good, (good + 1) % self.vocab)
        tree = Tree(tokens=tokens.astype(jnp.int32), parents=jnp.broadcast_to(jnp.asarray(parents), (b, len(parents))),
                    valid=j < t)
        return tree, None, state

    def observe(self, state, obs):
        return state


@dataclasses.dataclass(frozen=True)
class Costs:
    """A plain step costs 1, each verified node `per_node`, a draft `draft`."""
    per_node: float = 0.1
    draft: float = 0.1

    def verify_at(self, width):
        return 1.0 + self.per_node * width

    draft_seconds = property(lambda self: self.draft)
    idle_seconds = 0.0


@pytest.fixture(scope="module")
def target():
    return tiny()


def _oracle_run(target, prompts, right, tree, n, **policy):
    cfg, params = target
    prompts, lengths = pad_prompts(prompts)
    ref = decode(cfg, params, prompts, lengths, max_new_tokens=n, sampler=GREEDY, method="greedy")
    drafter = BranchOracle(continuation=ref.tokens, prompt_lengths=lengths, right=jnp.asarray(right, jnp.int32),
                           builder=StaticTreeBuilder.full(tree), vocab=cfg.vocab_size)
    out = speculative_decode(cfg, params, drafter, prompts, lengths, max_new_tokens=n,
                             verifier=vf.get_verifier("greedy"), adaptive=spec.policy_for(drafter, GREEDY, **policy),
                             costs=Costs())
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    return jax.tree.map(np.asarray, out.stats)


def test_wide_tree_drafts_its_right_chain(target):
    """8 nodes at depth 1 (24 in all): at the prior a whole first level (8 nodes, cost 1.8 + draft)
    never pays for 1.6 expected tokens, so whole-level truncation never drafted. Per node, one node
    pays; the first-rank chain is confirmed and the policy verifies a few nodes, not the tree."""
    s = _oracle_run(target, PROMPTS_4, [0, 0, 0, 0], (8, 1, 1), 32)
    widths, hist = list(s["policy_widths"]), s["width_hist"]
    assert widths == [0, 1, 2, 4, 8, 16, 24]
    assert hist[1:].sum() >= hist.sum() - 2, hist  # drafts (almost) every step
    assert hist[widths.index(16):].sum() == 0, hist  # never the whole tree, nor two levels
    assert np.all(s["tau"] > 3.0), s["tau"]  # the right chain (3 nodes + the bonus) is committed
    assert np.all(s["drafted_nodes"] <= 6 * s["verify_calls"]), (s["drafted_nodes"], s["verify_calls"])


def test_greedy_exact_with_kept_sets_that_differ_by_row(target):
    """Rows right on different first-level branches (ranks 0, 2, 1) and one never right: each row
    keeps its own nodes (rank 2's chain is nodes 2, 10, 18 of the tree: not a prefix), the width
    changes between steps, and the output is plain greedy's."""
    # Later siblings start optimistic (sibling_share 1: each takes what the earlier ones leave), so a
    # row right on rank 2 finds it within the 32 tokens once ranks 0 and 1 miss.
    s = _oracle_run(target, PROMPTS_4, [0, 2, 1, -1], (8, 1, 1), 32, sibling_share=1.0)
    assert np.all(s["tau"][:3] > 2.0), s["tau"]  # each right branch is found and committed
    assert s["tau"][3] < 1.2, s["tau"]
    assert (s["width_hist"] > 0).sum() >= 2, s["width_hist"]


def test_selection_is_the_best_reach_closed_under_parents_and_earlier_siblings():
    """adaptive.truncate keeps the w nodes of highest reach; a node's previous sibling and parent
    always come with it; `compact` moves them to the front with parents remapped."""
    parents = np.array([-1, -1, 0, 1, 2], np.int32)  # (0), (1), (0,0), (1,0), (0,0,0)
    policy = adaptive.AdaptivePolicy(widths=(0, 1, 2, 3, 5), margin=0.0, min_reach=0.0)
    state = adaptive.init_state(policy, 2, 3, 5, parents)
    # Row 0: rank 1 poor, the rank-0 chain good -> {0, 2, 4}. Row 1: rank 1 better than rank 0, but
    # capped by it -> {0, 1, 3} (node 1 never without node 0).
    acc = jnp.asarray([[0.9, 0.1, 0.9, 0.9, 0.9], [0.5, 0.95, 0.2, 0.95, 0.2]], jnp.float32)
    state = dataclasses.replace(state, accept=acc)
    tree = Tree(tokens=jnp.arange(10, dtype=jnp.int32).reshape(2, 5), parents=jnp.asarray(np.tile(parents, (2, 1))),
                valid=jnp.ones((2, 5), bool))
    # adaptive.cost_vector's layout: step per width, draft per width, idle; width 3 is nearly free
    costs = jnp.asarray([1.0, 9.0, 9.0, 1.0, 9.0] + [0.0] * 5 + [0.0], jnp.float32)
    kept, count, _ = adaptive.truncate(policy, state, costs, tree, jnp.asarray([10, 10]))
    np.testing.assert_array_equal(np.asarray(kept.valid), [[1, 0, 1, 0, 1], [1, 1, 0, 1, 0]])
    np.testing.assert_array_equal(np.asarray(count), [3, 3])
    small, _, perm = adaptive.compact(kept)
    np.testing.assert_array_equal(np.asarray(perm)[:, :3], [[0, 2, 4], [0, 1, 3]])
    np.testing.assert_array_equal(np.asarray(small.parents)[:, :3], [[-1, 0, 1], [-1, -1, 1]])
    np.testing.assert_array_equal(np.asarray(small.tokens)[:, :3], [[0, 2, 4], [5, 6, 8]])
    path, _, _ = adaptive.expand(perm, jnp.asarray([[0, 1, 2, -1, -1], [1, 2, -1, -1, -1]]))
    np.testing.assert_array_equal(np.asarray(path), [[0, 2, 4, -1, -1], [1, 3, -1, -1, -1]])


# ----------------------------------------------------------------------------------------------------
# χ²: sampled static trees (2 i.i.d. / Gumbel children at the root, one child each below: 4 nodes).

ROWS = 100_000
PAIRS = (("iid", "specinfer"), ("gumbel", "rsd"))
# Start estimates per row type (row % 3), keyed by node (0), (1), (0,0), (1,0): with these costs the
# first step verifies 2 nodes: {0, 2} (rank 1 poor: the kept set is not a prefix), {0, 1}, {0, 1}.
START = np.array([[0.9, 0.1, 0.9, 0.9], [0.9, 0.9, 0.1, 0.1], [0.6, 0.6, 0.6, 0.6]], np.float32)
COSTS = StepCosts(per_node=0.3, draft=0.1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StaticRows(RowRanges):
    """test_verifier_pairs' RowRanges with the (shared) static shape visible to the policy."""
    builder = property(lambda self: self.ranges[0][0])


_INIT = adaptive.init_state


def _start_at(policy, batch, max_depth, num_nodes, static_parents=None, is_chain=False):
    state = _INIT(policy, batch, max_depth, num_nodes, static_parents, is_chain)
    return dataclasses.replace(state, accept=jnp.asarray(START)[jnp.arange(batch) % 3])


def _keep_by_token(real, rows):
    """The deliberate bug, on rows >= `rows` only: after the policy's choice, drop a depth-1 node (and
    its child) when its sampled token is in the upper half of the vocabulary."""
    def truncate(policy, state, costs, tree, remaining, shape_valid=None):
        tree, count, state = real(policy, state, costs, tree, remaining, shape_valid)
        low = tree.tokens < V // 2
        keep = jnp.where(tree.parents < 0, low, jnp.take_along_axis(low, jnp.maximum(tree.parents, 0), axis=1))
        keep = keep | (jnp.arange(keep.shape[0]) < rows)[:, None]
        return tree.replace(valid=tree.valid & keep), count, state
    return truncate


@pytest.mark.exec_bound  # 1e5 rows: running, not compiling (tests/conftest.py)
def test_node_truncation_is_lossless_and_a_token_dependent_choice_is_not():
    """One decode, ROWS rows per block (3 new tokens, the first two tested): the two lossless pairs,
    then the first pair again with the kept nodes chosen by their sampled tokens (must fail)."""
    for rule, name in PAIRS:  # the engine accepts these pairs, and samples them with a fixed shape
        builder = StaticTreeBuilder.full((2, 1), rule)
        d = type("D", (), dict(child_rule=rule, is_chain=False, num_nodes=4, builder=builder))()
        assert spec._structure_error(d, vf.get_verifier(name)) is None, (rule, name)
        assert spec.policy_for(d, T1).shape == "structure"
    blocks = PAIRS + PAIRS[:1]
    builders = [StaticTreeBuilder.full((2, 1), rule) for rule, _ in blocks]
    drafter = StaticRows(LOGQ, tuple((b, k * ROWS, (k + 1) * ROWS) for k, b in enumerate(builders)))
    verifier = RowBlocks(tuple((vf.get_verifier(name), ((k * ROWS, (k + 1) * ROWS),))
                               for k, (_, name) in enumerate(blocks)))
    rows = ROWS * len(blocks)
    prompts = np.tile(np.asarray(PROMPT, np.int32), (rows, 1))
    lengths = np.full((rows,), len(PROMPT), np.int32)
    policy = adaptive.AdaptivePolicy(widths=(0, 1, 2, 4), decay=0.5, margin=0.0, shape="structure", explore=0.0031)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(spec, "check_combination", lambda *a: None)  # a composite drafter (pairs judged above)
        mp.setattr(adaptive, "init_state", _start_at)
        mp.setattr(adaptive, "truncate", _keep_by_token(adaptive.truncate, ROWS * len(PAIRS)))
        out = speculative_decode(CFG, PARAMS, drafter, prompts, lengths, max_new_tokens=3, verifier=verifier,
                                 sampler=T1, key=jax.random.key(7, impl="rbg"), adaptive=policy, costs=COSTS,
                                 cache_len=len(PROMPT) + 3 + 4 + 1 + 2 + 1)
    hist = np.asarray(out.stats["width_hist"])
    assert hist[2] > 0 and hist[0] > 0, hist  # 2 nodes on the first step, other widths later
    toks = np.asarray(out.tokens)[:, :2]
    joint = exact_joint(CFG, PARAMS, PROMPT, V)
    p = [chi2_pvalue(toks[k * ROWS:(k + 1) * ROWS], joint) for k in range(len(blocks))]
    print("\np-values:", list(zip(blocks, p)))
    assert all(x > P_OK for x in p[:len(PAIRS)]), p
    assert p[-1] < P_BROKEN, p
