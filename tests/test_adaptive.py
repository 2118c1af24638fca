"""Adaptive speculation (jaxdecode.adaptive): greedy exactness and sampling losslessness while the draft
depth changes between steps and rows; the policy stops drafting for a drafter that is never right and
drafts to the maximum for one that always is (asserted on the stats, not on time)."""
import dataclasses
import functools
import types
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode import adaptive
from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters import DraftLM, parse_tree_spec
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import SpeculativeError, policy_for, speculative_decode
from jaxdecode.tree import Tree
from jaxdecode.verifiers import get_verifier
from test_speculative import PROMPTS_4, tiny

GREEDY = SamplerConfig(temperature=0.0)


@dataclasses.dataclass(frozen=True)
class Costs:
    """A synthetic cost table: a plain step costs 1, each verified node `per_node`, a draft `draft`."""
    per_node: float = 0.05
    draft: float = 0.3
    idle: float = 0.0

    def verify_at(self, width):
        return 1.0 + self.per_node * width

    draft_seconds = property(lambda self: self.draft)
    idle_seconds = property(lambda self: self.idle)


@dataclasses.dataclass(frozen=True)
class LevelCosts(Costs):
    """Costs of a level_capped drafter: a draft of w levels costs base + per_level * w (draft_at)."""
    base: float = 0.1
    per_level: float = 0.2
    levels: int = 4

    def draft_at(self, width):
        return self.base + self.per_level * width

    draft_seconds = property(lambda self: self.draft_at(self.levels))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    """Proposes a chain of the next K tokens of a known continuation, shifted by `shift` (0: always
    right, 1: always wrong)."""
    continuation: jax.Array  # int32[B, T]
    prompt_lengths: jax.Array  # int32[B]
    depth: int = dataclasses.field(metadata=dict(static=True))
    shift: int = dataclasses.field(metadata=dict(static=True))
    vocab: int = dataclasses.field(metadata=dict(static=True))
    acceptance_prior: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    history_only: bool = dataclasses.field(default=False, metadata=dict(static=True))
    short_for: int = dataclasses.field(default=0, metadata=dict(static=True))  # 1-node chains until then
    child_rule = "point"
    is_chain = True
    num_nodes = property(lambda self: self.depth)
    max_depth = property(lambda self: self.depth)

    def init(self, prompt_tokens, prompt_lengths, cache_len, key):
        return jnp.zeros((), jnp.int32)

    def propose(self, state, ctx, sampler):
        b = ctx.hist_len.shape[0]
        j = (ctx.hist_len - self.prompt_lengths)[:, None] + jnp.arange(self.depth)[None, :]
        t = self.continuation.shape[1]
        toks = jnp.take_along_axis(self.continuation, jnp.clip(j, 0, t - 1), axis=1)
        toks = (toks + self.shift) % self.vocab
        parents = jnp.broadcast_to(jnp.arange(self.depth, dtype=jnp.int32) - 1, (b, self.depth))
        # For the first `short_for` new tokens only the first node is proposed (a weak lookup match).
        short = (j[:, :1] < self.short_for) & (jnp.arange(self.depth)[None, :] > 0)
        return Tree(tokens=toks, parents=parents, valid=(j < t) & ~short), None, state

    def observe(self, state, obs):
        return state


@pytest.fixture(scope="module")
def models():
    return tiny(), tiny(layers=1, seed=1)


def _greedy(cfg, params, prompts, lengths, n):
    return decode(cfg, params, prompts, lengths, max_new_tokens=n, sampler=GREEDY, method="greedy")


def _run(cfg, params, drafter, prompts, lengths, n, costs=Costs(), sampler=GREEDY, verifier="greedy", **kw):
    policy = policy_for(drafter, sampler, **kw)
    return speculative_decode(cfg, params, drafter, prompts, lengths, max_new_tokens=n,
                              verifier=get_verifier(verifier), sampler=sampler, adaptive=policy, costs=costs)


def _oracle_stats(models, prompts, n, shift, costs=Costs(), prior=(), history_only=False, **policy):
    """Stats of an adaptive run with an OracleDrafter (chain of 4) over `prompts` (policy: AdaptivePolicy
    overrides); greedy-exact."""
    (cfg, params), _ = models
    prompts, lengths = pad_prompts(prompts)
    ref = _greedy(cfg, params, prompts, lengths, n)
    drafter = OracleDrafter(continuation=ref.tokens, prompt_lengths=lengths, depth=4, shift=shift, vocab=64,
                            acceptance_prior=prior, history_only=history_only)
    out = _run(cfg, params, drafter, prompts, lengths, n, costs=costs, **policy)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    return jax.tree.map(np.asarray, out.stats)


def test_never_accepted_drafts_stop_within_a_few_steps(models):
    n = 48
    s = _oracle_stats(models, PROMPTS_4[:1], n, shift=1)
    steps, drafting = int(s["verify_calls"][0]), int(s["speculative_steps"][0])
    assert steps == n  # nothing is ever accepted: one token per step
    # A few steps to learn, then only rare probes (untried estimates drift back slowly).
    assert drafting <= 4 + steps // 8, (drafting, steps, s["width_hist"])
    assert s["width_hist"][0] >= steps - drafting  # the other steps verified no draft token at all


def test_returns_to_drafting_that_lose_slow_the_drift():
    """A drafting step after a plain one (a return) is scored in plain steps saved, the drafter's
    catch-up included; while their running mean is below 0 each return halves the rate the estimates
    drift back at (down to explore_floor), once it is not, each doubles it again (up to 1). Steps within
    a drafting streak are not returns."""
    policy = adaptive.AdaptivePolicy(widths=(0, 1, 2, 4), prior=0.5, explore=0.05, explore_floor=0.25)
    chain = Tree(tokens=jnp.zeros((1, 4), jnp.int32), parents=jnp.array([[-1, 0, 1, 2]]), valid=jnp.ones((1, 4), bool))
    # steps at widths 0/1/2/4 (drafting excluded), draft (whole, then per width), idle, catch-up per token
    costs = jnp.asarray([1.0, 1.5, 1.6, 2.0] + [1.0] * 4 + [0.0, 0.1], jnp.float32)
    one = jnp.ones((1,), bool)

    def verified(state, accepted, lag=0):
        path = jnp.asarray([[i if i < accepted else -1 for i in range(4)]], jnp.int32)
        count = jnp.asarray([accepted], jnp.int32)
        return adaptive.update(policy, state, chain, path, count, count, one, costs, jnp.int32(lag))

    def plain(state, k=4):
        return adaptive.drift(policy, state, jnp.asarray([k], jnp.int32))

    fresh = adaptive.init_state(policy, 1, 4, 4, is_chain=True)
    assert float(fresh.explore_scale) == 1.0 and float(fresh.payoff) == 0.0
    # A miss at width 4: 1 token for 2.0 + 1.0 (+ 0.1 per token caught up) plain steps.
    st = verified(fresh, 0, lag=10)
    assert float(st.payoff) == pytest.approx(0.2 * (1 - 4.0)) and float(st.explore_scale) == 0.5
    assert float(verified(fresh, 0).payoff) == pytest.approx(0.2 * (1 - 3.0))  # no catch-up: it lost less
    assert float(verified(st, 0, lag=10).explore_scale) == 0.5  # within the streak: not a return
    st = verified(plain(st), 0, lag=10)
    assert float(st.explore_scale) == 0.25
    st = verified(plain(st), 0, lag=10)
    assert float(st.explore_scale) == 0.25  # the floor
    # The estimates drift back at the scaled rate, over plain steps and in the engine's plain steps alike.
    drifted = plain(st, 3)
    want = st.accept[0, 0] + (1 - (1 - 0.05 * 0.25) ** 3) * (1 - st.accept[0, 0])
    assert float(drifted.accept[0, 0]) == pytest.approx(float(want), rel=1e-5)
    empty = chain.replace(valid=jnp.zeros((1, 4), bool))
    stepped = adaptive.update(policy, st, empty, jnp.full((1, 4), -1, jnp.int32), jnp.zeros((1,), jnp.int32),
                              jnp.zeros((1,), jnp.int32), one, costs)
    want = st.accept[0, 0] + 0.05 * 0.25 * (1 - st.accept[0, 0])
    assert float(stepped.accept[0, 0]) == pytest.approx(float(want), rel=1e-5)
    assert int(stepped.streak) == 0 and float(stepped.payoff) == float(st.payoff)  # a plain step scores nothing
    # Returns that pay (5 tokens for 3 plain steps) bring the mean back above 0, then the rate doubles.
    scales = []
    for _ in range(8):
        st = verified(plain(st), 4)
        scales.append(float(st.explore_scale))
    assert scales[0] == 0.25 and scales[-1] == 1.0 and float(st.payoff) > 0
    assert 0.5 in scales  # doubled one return at a time
    with pytest.raises(ValueError, match="explore_floor"):
        adaptive.AdaptivePolicy(widths=(0, 1), explore_floor=0.0)


def test_a_drafter_whose_returns_lose_returns_more_rarely(models):
    """A drafter that is never right, its estimates drifting back fast: with the drift slowed after
    returns that lose, it drafts on fewer steps than at the full rate, and stays greedy-exact."""
    n = 96
    quick = dict(explore=0.1, costs=Costs(draft=0.6))
    full = _oracle_stats(models, PROMPTS_4[:1], n, shift=1, explore_floor=1.0, **quick)
    slowed = _oracle_stats(models, PROMPTS_4[:1], n, shift=1, **quick)
    assert int(slowed["speculative_steps"][0]) < int(full["speculative_steps"][0]), (slowed["width_hist"],
                                                                                     full["width_hist"])


@pytest.mark.parametrize("shift", [1, 0])
def test_lean_plain_runs_probe_when_step_by_step_would(models, shift):
    """Plain steps run as the engine's lean plain run (up to AdaptivePolicy.plain_run steps in one inner
    loop, no proposal or per-step policy work; a drafter that is not history_only observes each step);
    the run ends where the drifting estimates would make the policy probe, so it drafts on (about) the
    same steps as the step-by-step engine (plain_run=1), with the same output and statistics (4 ragged
    prompts)."""
    n = 48
    run_length = adaptive.plain_run_length
    with mock.patch.object(adaptive, "plain_run_length", wraps=run_length) as runs:
        step = _oracle_stats(models, PROMPTS_4, n, shift=shift, plain_run=1)
        assert not runs.called  # one plain engine step at a time
        leans = [_oracle_stats(models, PROMPTS_4, n, shift=shift, history_only=h) for h in (False, True)]
        assert runs.called  # traced into the loop: plain steps run as lean runs
    jax.clear_caches()  # traced again with the run length's GPU/TPU form (a vmap over every length)
    with mock.patch.object(adaptive, "plain_run_length", wraps=functools.partial(run_length, vectorized=True)) as vec:
        leans.append(_oracle_stats(models, PROMPTS_4, n, shift=shift))
        assert vec.called
    for lean in leans:
        np.testing.assert_array_equal(lean["verify_calls"], step["verify_calls"])
        np.testing.assert_array_equal(lean["target_calls"], step["target_calls"])
        np.testing.assert_array_equal(lean["accept_hist"], step["accept_hist"])
        np.testing.assert_allclose(lean["speculative_steps"], step["speculative_steps"], atol=1)
        assert lean["width_hist"].sum() == step["width_hist"].sum()
        if shift == 1:  # never right: mostly plain steps, counted per step like the engine's own
            assert lean["width_hist"][0] >= n - 4 - n // 8, lean["width_hist"]


def test_drift_compounds_and_the_plain_run_ends_at_the_next_probe():
    """`drift` over k steps equals k single-step drifts for depth-1 keys (toward 1), and
    `plain_run_length` is the first step at which `should_draft` would say yes (first looks off: the
    drift alone; with them the run ends at the first probe instead)."""
    policy = adaptive.AdaptivePolicy(widths=(0, 1), prior=0.2, explore=0.05, margin=0.0, first_look=False)
    state = adaptive.init_state(policy, 2, 1, 1, np.array([-1], np.int32))
    steps = jnp.array([3, 0], jnp.int32)
    once = state
    for _ in range(3):
        once = adaptive.drift(policy, once, jnp.array([1, 0], jnp.int32))
    np.testing.assert_allclose(adaptive.drift(policy, state, steps).accept, once.accept, rtol=1e-6)
    assert float(once.accept[1, 0]) == pytest.approx(0.2)  # a row with no steps keeps its estimate
    # One node: drafting pays once the estimate a clears cost(1) / cost(0) - 1 = 0.5: 0.2 -> 0.5 at
    # 0.05 a step takes 10 steps (1 - 0.8 * 0.95^k >= 0.5), so a run from here takes 10.
    costs = jnp.asarray([1.0, 1.5, 0.0, 0.0], jnp.float32)  # verify at widths 0 / 1, draft, idle
    remaining = jnp.full((2,), 100, jnp.int32)
    assert not bool(adaptive.should_draft(policy, state, costs, remaining))
    never = jnp.asarray([1.0, 100.0, 0.0, 0.0], jnp.float32)
    for vectorized in (False, True):  # the CPU's loop and the GPU/TPU's vmap give the same lengths
        def run(c, cap, **kw):
            return int(adaptive.plain_run_length(policy, state, c, remaining, cap, vectorized=vectorized, **kw))
        assert run(costs, 32) == 10
        assert run(costs, 6) == 6  # the cap
        assert run(never, 32) == 32
        assert run(never, 5) == 5  # the cap
        assert run(costs, jnp.int32(32), max_run=32) == 10  # a traced cap, as in the engine
        assert run(never, jnp.int32(7), max_run=32) == 7
        assert run(costs, jnp.int32(0), max_run=32) == 0  # no run
    with pytest.raises(ValueError, match="exceeds max_run"):
        adaptive.plain_run_length(policy, state, costs, remaining, 40, max_run=32, vectorized=True)
    looks = dataclasses.replace(policy, first_look=True)  # decoding one row, it looks at the first probe
    looking = adaptive.init_state(looks, 1, 1, 1, np.array([-1], np.int32))
    for vectorized in (False, True):  # a first look at the probe (probe_first 8) beats the drift's 10
        assert int(adaptive.plain_run_length(looks, looking, costs, remaining[:1], 32, vectorized=vectorized)) == 8


def test_a_short_proposal_does_not_stop_a_row_for_good():
    """The plan judges the last proposal's shape; a one-node proposal never pays where a drafting step
    costs 2.9 plain steps, so without shape probes the row would never draft again. Once the row has
    waited (probe_first steps, doubled after each further shape that does not pay, up to
    probe_period) the plan judges the full chain, and drafts."""
    policy = adaptive.AdaptivePolicy(widths=(0, 1, 2, 4), prior=0.95, margin=0.15, probe_first=8, probe_every=8)
    state = adaptive.init_state(policy, 1, 4, 4, is_chain=True)
    costs = jnp.asarray([1.0, 1.05, 1.1, 1.2, 1.5, 1.5, 1.5, 1.5, 0.0], jnp.float32)  # verify, draft, idle
    remaining = jnp.full((1,), 1000, jnp.int32)
    assert bool(adaptive.should_draft(policy, state, costs, remaining))  # the full chain pays
    # a probe that keeps nothing (a draft of 1.5 plain steps, and an engine step priced as the one-node
    # step's extra, 0.05) costs at most 2% of the plain steps between probes: 1.55 / 0.02
    assert int(adaptive.probe_period(policy, costs)) == 78
    one = Tree(tokens=jnp.zeros((1, 4), jnp.int32), parents=jnp.array([[-1, 0, 1, 2]], jnp.int32),
               valid=jnp.array([[True, False, False, False]]))
    full = one.replace(valid=jnp.ones((1, 4), bool))

    def due_after(state):  # the plain steps until the plan drafts again
        return next(k for k in range(200) if bool(adaptive.should_draft(
            policy, adaptive.drift(policy, state, jnp.array([k])), costs, remaining)))

    waits = []
    for _ in range(5):  # shapes of one node, one after another: 16, 32, 64, then the cap
        _, _, state = adaptive.truncate(policy, state, costs, one, remaining)
        assert not bool(adaptive.should_draft(policy, state, costs, remaining))  # not worth a drafting step
        waits.append(due_after(state))
    assert waits == [16, 32, 64, 78, 78]
    for vectorized in (False, True):  # up to the probe
        assert int(adaptive.plain_run_length(policy, state, costs, remaining, 128, vectorized=vectorized)) == 78
    _, _, state = adaptive.truncate(policy, state, costs, full, remaining)  # a shape that pays: wait reset
    assert bool(adaptive.should_draft(policy, state, costs, remaining))
    _, _, state = adaptive.truncate(policy, state, costs, one, remaining)
    assert due_after(state) == 16
    cheap = dataclasses.replace(policy, probe_cost=0.5)  # cheap probes: every probe_every steps at most
    assert int(adaptive.probe_period(cheap, costs)) == cheap.probe_every == 8
    for bad, match in [(dict(probe_every=0), "probe_every"), (dict(probe_first=0), "probe_first"),
                       (dict(probe_first=9, probe_every=8), "must not exceed"), (dict(probe_cost=0.0), "probe_cost")]:
        with pytest.raises(ValueError, match=match):
            adaptive.AdaptivePolicy(widths=(0, 1), **bad)


def test_noisy_costs_are_fit_monotone_not_raised_to_their_worst():
    """The policy's step costs per drafting width are the least-squares non-decreasing fit of the
    measured ones (one slow spell at a narrow width no longer prices every wider tree at it), never
    below the plain step; a decreasing run is pooled at its mean."""
    assert adaptive.isotonic([4.9, 8.5, 9.8, 16.1, 14.7, 15.0, 12.7]).tolist() == pytest.approx(
        [4.9, 8.5, 9.8, 14.625, 14.625, 14.625, 14.625])
    assert adaptive.isotonic([1, 2, 3]).tolist() == [1, 2, 3] and adaptive.isotonic([]).size == 0

    class Costs:
        def __init__(self, steps):
            self.steps, self.draft_seconds, self.idle_seconds = steps, 1e-4, 0.0

        def step_at(self, w):
            return self.steps[w]
    vec = adaptive.cost_vector(adaptive.AdaptivePolicy(widths=(0, 1, 2, 3)), Costs([5.0, 4.0, 9.0, 7.0]))
    assert vec[:4].tolist() == pytest.approx([5.0, 5.0, 8.0, 8.0])  # width 1 below plain: raised to it


def test_an_empty_proposal_backs_off_until_a_match():
    """An empty proposal (no match) at a probe restarts the row's wait, doubled like a shape that does
    not pay; one from a row drafting on a shape that pays stops the row, which probes after 1 step,
    then 2, 4, ... while probes come back empty. Before, both rows stayed drafting-worthy and ran an
    engine step per token until a match came."""
    policy = adaptive.AdaptivePolicy(widths=(0, 1, 2, 4), prior=0.95, margin=0.15, probe_first=4, probe_every=16)
    state = adaptive.init_state(policy, 2, 4, 4, is_chain=True)
    costs = jnp.asarray([1.0, 1.05, 1.1, 1.2, 1.5, 1.5, 1.5, 1.5, 0.0], jnp.float32)  # verify, draft, idle
    remaining = jnp.full((2,), 1000, jnp.int32)
    state = dataclasses.replace(state, stale=jnp.array([4, 1], jnp.int32))  # row 0 due a probe, row 1 not
    assert bool(adaptive.should_draft(policy, state, costs, remaining))  # the full chain pays
    empty = Tree(tokens=jnp.zeros((2, 4), jnp.int32), parents=jnp.broadcast_to(jnp.array([-1, 0, 1, 2]), (2, 4)),
                 valid=jnp.zeros((2, 4), bool))
    _, kept, state = adaptive.truncate(policy, state, costs, empty, remaining)
    assert kept.tolist() == [0, 0]
    assert state.stale.tolist() == [0, 0] and state.wait.tolist() == [8, 1]
    assert not bool(adaptive.should_draft(policy, state, costs, remaining))  # neither drafts now
    # a weak match (one node: does not pay) at row 1's probe waits probe_first, as any such shape
    one = empty.replace(valid=jnp.array([[False] * 4, [True, False, False, False]]))
    _, _, weak = adaptive.truncate(policy, adaptive.drift(policy, state, jnp.ones((2,), jnp.int32)), costs, one,
                                   remaining)
    assert int(weak.wait[1]) == policy.probe_first and int(weak.stale[1]) == 0
    waits = []
    for _ in range(4):  # row 1's probes come back empty: it waits 1, 2, 4, 8 steps
        run = int(adaptive.plain_run_length(policy, state, costs, remaining, 32))
        waits.append(run)
        state = adaptive.drift(policy, state, jnp.full((2,), run, jnp.int32))
        assert bool(adaptive.should_draft(policy, state, costs, remaining))  # a probe is due
        _, _, state = adaptive.truncate(policy, state, costs, empty, remaining)
    assert waits == [1, 2, 4, 8]
    full = empty.replace(valid=jnp.ones((2, 4), bool))  # a match: the row drafts again, its wait reset
    state = adaptive.drift(policy, state, jnp.full((2,), 16, jnp.int32))
    _, kept, state = adaptive.truncate(policy, state, costs, full, remaining)
    assert kept.tolist() == [4, 4] and state.wait.tolist() == [4, 4]
    assert bool(adaptive.should_draft(policy, state, costs, remaining))


def test_a_batch_whose_drafts_keep_nothing_backs_off():
    """Rows that miss in turn (row 1's proposal empty, then row 0's, ...) each probe again one step later,
    so a batch whose plan needs every row to pay drafted on every other step and kept nothing (the
    retrieval default at batch 16 sampling: 23 such steps in 64 tokens). The batch now holds off after a
    drafting step that keeps nothing: 1 step, then 2, 4, 8; a step that keeps a node ends the hold."""
    policy = adaptive.AdaptivePolicy(widths=(0, 1, 2, 4), prior=0.95, margin=0.15, probe_first=4, probe_every=16)
    state = adaptive.init_state(policy, 2, 4, 4, is_chain=True)
    costs = jnp.asarray([1.0, 1.05, 1.1, 1.2, 1.5, 1.5, 1.5, 1.5, 0.0], jnp.float32)  # verify, draft, idle
    remaining = jnp.full((2,), 1000, jnp.int32)
    chain = jnp.broadcast_to(jnp.array([-1, 0, 1, 2]), (2, 4))
    assert bool(adaptive.should_draft(policy, state, costs, remaining))
    runs = []
    for step in range(4):
        valid = jnp.ones((2, 4), bool).at[(step + 1) % 2].set(False)  # one row proposes nothing
        tree = Tree(tokens=jnp.zeros((2, 4), jnp.int32), parents=chain, valid=valid)
        _, kept, state = adaptive.truncate(policy, state, costs, tree, remaining)
        assert kept.tolist() == [0, 0]  # the empty row needs a step per token: the batch verifies nothing
        assert not bool(adaptive.should_draft(policy, state, costs, remaining))
        run = int(adaptive.plain_run_length(policy, state, costs, remaining, 32))
        runs.append(run)
        state = adaptive.drift(policy, state, jnp.full((2,), run, jnp.int32))
        assert bool(adaptive.should_draft(policy, state, costs, remaining))  # the hold is over: a probe
    assert runs == [1, 2, 4, 8]
    full = Tree(tokens=jnp.zeros((2, 4), jnp.int32), parents=chain, valid=jnp.ones((2, 4), bool))
    _, kept, state = adaptive.truncate(policy, state, costs, full, remaining)
    assert kept.tolist() == [4, 4] and int(state.hold) == 0 and int(state.backoff) == 1
    assert bool(adaptive.should_draft(policy, state, costs, remaining))


def test_a_weak_class_proposal_backs_off_like_an_empty_one():
    """Keyed by confidence class, the plan judges a row's next proposal as of the best class. A proposal
    that does not pay at its own classes (a weak match) kept as the row's shape would be drafted again
    every step and keep nothing (the retrieval default sampling at T = 0.7 drafted on 58 of 60 steps and
    kept nothing on 37): it stops the row like an empty proposal, which probes after 1, 2, 4, ... steps
    until a strong match pays."""
    policy = adaptive.AdaptivePolicy(widths=(0, 1, 2, 4), classes=2, prior_by_class=(0.05, 0.95), margin=0.15,
                                     probe_first=4, probe_every=16)
    state = adaptive.init_state(policy, 1, 4, 4, is_chain=True)
    costs = jnp.asarray([1.0, 1.05, 1.1, 1.2, 1e-3, 1e-3, 1e-3, 1e-3, 0.0], jnp.float32)  # verify, draft, idle
    remaining = jnp.full((1,), 1000, jnp.int32)
    assert bool(adaptive.should_draft(policy, state, costs, remaining))  # judged at the best class: pays
    chain = jnp.array([[-1, 0, 1, 2]])

    def proposal(cls):
        return Tree(tokens=jnp.zeros((1, 4), jnp.int32), parents=chain, valid=jnp.ones((1, 4), bool),
                    classes=jnp.full((1, 4), cls, jnp.int32))
    _, kept, state = adaptive.truncate(policy, state, costs, proposal(0), remaining)
    assert kept.tolist() == [0]  # the weak match is not verified ...
    assert state.wait.tolist() == [1] and state.stale.tolist() == [0] and not bool(jnp.any(state.shaped))
    assert not bool(adaptive.should_draft(policy, state, costs, remaining))  # ... nor drafted again at once
    waits = []
    for _ in range(4):  # weak probes: waits of 1, 2, 4, 8 steps
        run = int(adaptive.plain_run_length(policy, state, costs, remaining, 32))
        waits.append(run)
        state = adaptive.drift(policy, state, jnp.full((1,), run, jnp.int32))
        assert bool(adaptive.should_draft(policy, state, costs, remaining))
        _, kept, state = adaptive.truncate(policy, state, costs, proposal(0), remaining)
        assert kept.tolist() == [0]
    assert waits == [1, 2, 4, 8]
    state = adaptive.drift(policy, state, jnp.full((1,), 16, jnp.int32))
    _, kept, state = adaptive.truncate(policy, state, costs, proposal(1), remaining)  # a strong match
    assert kept.tolist() == [4] and state.wait.tolist() == [policy.probe_first]
    assert bool(adaptive.should_draft(policy, state, costs, remaining))  # drafting goes on


def test_rows_that_pay_is_each_row_planned_alone():
    """`_rows_that_pay` (each row judged as a batch of its own, in O(B)) equals the whole-batch plan
    run once per row with every other row done, on random estimates, shapes, classes and budgets."""
    rng = np.random.default_rng(0)
    b, n = 24, 6
    policy = adaptive.AdaptivePolicy(widths=(0, 1, 2, 4, 6), classes=3, margin=0.15)
    state = adaptive.init_state(policy, b, n, n, is_chain=True)
    parents = np.where(rng.random((b, n)) < 0.3, -1, np.maximum(np.arange(n) - 1, -1))
    parents[:, 0] = -1
    state = dataclasses.replace(state, accept=jnp.asarray(rng.random(state.accept.shape), jnp.float32),
                                parents=jnp.asarray(parents, jnp.int32),
                                shaped=jnp.asarray(rng.random((b, n)) < 0.8),
                                node_classes=jnp.asarray(rng.integers(0, 3, (b, n)), jnp.int32))
    costs = jnp.asarray([1.0, 1.1, 1.2, 1.4, 1.6] + [0.05] * 5 + [0.0], jnp.float32)
    remaining = jnp.asarray(rng.integers(0, 6, b), jnp.int32)  # some rows done, some near the end
    for as_drafted in (False, True):
        got = np.asarray(adaptive._rows_that_pay(policy, state, costs, remaining, as_drafted=as_drafted))
        judged = state if as_drafted else adaptive._as_next(state)
        values = adaptive._node_values(policy, judged, state.parents, state.shaped)
        want = [int(adaptive._best_width(policy, *values, costs, jnp.where(jnp.arange(b) == r, remaining, 0),
                                         drafted=False)[0]) > 0 for r in range(b)]
        assert got.tolist() == want
        assert 0 < sum(want) < int(np.sum(np.asarray(remaining) > 0))  # the rows differ


@pytest.mark.parametrize("probe_every", [8, 10_000])
def test_a_row_drafts_again_after_a_stretch_of_short_proposals(models, probe_every):
    """An always-right drafter that proposes a single node for its first 8 tokens (a weak match), where
    a drafting step costs 2.5 plain steps: one node never pays, the full chain does. With shape probes
    the row drafts whole chains once they come back; without them (probe_every beyond the run) it
    would decode plainly to the end (the control: no probe within the run).
    Greedy output is exact either way."""
    (cfg, params), _ = models
    prompts, lengths = pad_prompts(PROMPTS_4[:2])
    n = 64
    ref = _greedy(cfg, params, prompts, lengths, n)
    drafter = OracleDrafter(continuation=ref.tokens, prompt_lengths=lengths, depth=4, shift=0, vocab=64,
                            acceptance_prior=(0.95,), short_for=8)
    out = _run(cfg, params, drafter, prompts, lengths, n, costs=Costs(per_node=0.05, draft=1.5),
               probe_first=2 if probe_every == 8 else probe_every, probe_every=probe_every, probe_cost=0.5)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    tau = np.asarray(out.stats["tau"])
    if probe_every == 8:
        assert np.all(tau > 2.5), (tau, out.stats["width_hist"])
    else:  # the control: stuck on the one-node shape
        assert np.all(tau < 1.2), (tau, out.stats["width_hist"])


def test_always_right_drafts_grow_to_the_maximum(models):
    s = _oracle_stats(models, PROMPTS_4, 40, shift=0)
    widths = list(s["policy_widths"])
    assert widths == [0, 1, 2, 4]
    # Every step after the first verifies the whole chain (4 nodes): tau = 5 but for the row ends.
    assert s["width_hist"][widths.index(4)] >= s["width_hist"].sum() - 1, s["width_hist"]
    assert np.all(s["tau"] > 4.0), s["tau"]


def test_a_declared_acceptance_prior_gets_a_good_drafter_tried(models):
    """A draft so costly that, at the flat prior (0.6 per level), a chain of 4 is not worth trying.
    Without first looks the policy never drafts and never learns the drafter is always right (the
    control). Declaring the drafter's measured acceptance (`acceptance_prior`, as trained drafters do)
    makes it draft from the first step; greedy output stays exact either way (_oracle_stats)."""
    n, costly = 40, Costs(per_node=0.05, draft=1.0)
    blind = _oracle_stats(models, PROMPTS_4[:1], n, shift=0, costs=costly, first_look=False)
    assert int(blind["speculative_steps"][0]) <= int(blind["verify_calls"][0]) // 4, blind["width_hist"]
    told = _oracle_stats(models, PROMPTS_4[:1], n, shift=0, costs=costly, prior=(0.95, 0.95, 0.95, 0.95))
    assert int(told["speculative_steps"][0]) == int(told["verify_calls"][0]), told["width_hist"]
    assert told["tau"][0] > 4.0, told["tau"]


def test_a_first_look_tries_a_drafter_the_flat_guess_prices_out(models):
    """The same costly draft with no declared prior: a row's first shape probe (after probe_first plain
    steps) judges its never-tried keys as if always accepted, verifies the chain, and a hit outweighs
    the guess, so an always-right drafter drafts every step after it; an always-wrong one costs that
    look and stops (adaptive, "First looks"). A batch's rows look together. Greedy output stays exact.
    A look costs its draft and a step at its width in place of a plain one (1.0 + 0.2 plain steps for
    the whole chain here): a 5% probe budget of the 32 tokens left at the probe holds it, the default 2%
    does not."""
    n, costly = 40, Costs(per_node=0.05, draft=1.0)
    for prompts in (PROMPTS_4[:1], PROMPTS_4[:2]):  # a batch's rows look together
        right = _oracle_stats(models, prompts, n, shift=0, costs=costly, probe_cost=0.05)
        plain, full = int(right["width_hist"][0]), int(right["width_hist"][-1])
        # Every drafting step verifies the whole chain and commits 5 tokens.
        assert np.all(full == right["speculative_steps"]) and plain + 5 * full >= n, right["width_hist"]
        assert plain <= adaptive.AdaptivePolicy(widths=(0, 4)).probe_first + 2, right["width_hist"]
        wrong = _oracle_stats(models, prompts, n, shift=1, costs=costly, probe_cost=0.05)
        assert np.all(wrong["speculative_steps"] <= 2), wrong["width_hist"]
        dear = _oracle_stats(models, prompts, n, shift=0, costs=costly)
        assert np.all(dear["speculative_steps"] == 0), dear["width_hist"]
    # Where only a shallow look is affordable (a node costs 0.35 plain steps, the draft 0.2: 2% of 32
    # tokens buys one node), the row looks one level deep, and a hit there makes drafting pay.
    shallow = Costs(per_node=0.35, draft=0.2)
    looked = _oracle_stats(models, PROMPTS_4[:1], n, shift=0, costs=shallow)
    blind = _oracle_stats(models, PROMPTS_4[:1], n, shift=0, costs=shallow, first_look=False)
    widths = list(looked["policy_widths"])
    assert int(looked["width_hist"][widths.index(1)]) >= 1 and looked["tau"][0] > 1.8, looked["width_hist"]
    assert int(blind["speculative_steps"][0]) == 0, blind["width_hist"]
    # What a look verifies and what its verdict does (a chain of 4 keys; a plain step costs 1, a node
    # 0.2, the draft 0.1). 2% of 32 tokens to go buys a look of 2 levels (0.5 plain steps), not 4 (0.9);
    # the keys below are judged never accepted on the look.
    chain = adaptive.AdaptivePolicy(widths=(0, 1, 2, 4))
    costs = jnp.asarray([1.0, 1.2, 1.4, 1.8, 0.1, 0.1, 0.1, 0.1, 0.0], jnp.float32)
    st = adaptive.init_state(chain, 2, 4, 4, is_chain=True)
    due = jnp.ones((2,), bool)
    judged, look = adaptive._looking(chain, st, costs, jnp.asarray([32, 32]), due)
    assert np.all(np.asarray(look))
    np.testing.assert_allclose(np.asarray(judged.accept), [[1, 1, 0, 0]] * 2)
    judged, look = adaptive._looking(chain, st, costs, jnp.asarray([64, 32]), due)
    np.testing.assert_allclose(np.asarray(judged.accept)[0], [1, 1, 1, 1])
    # Rows look together: one that cannot afford a look holds the others' back; a finished one does not.
    assert not np.any(np.asarray(adaptive._looking(chain, st, costs, jnp.asarray([64, 8]), due)[1]))
    assert np.asarray(adaptive._looking(chain, st, costs, jnp.asarray([64, 0]), due)[1]).tolist() == [True, False]
    # A miss at depth 1: decoding one row, it weighs against the guess (0.6 -> 0.6 d / (1 + d)) and the
    # deeper keys stay to be looked at; in a batch it leaves the guess, and the row has had its look.
    tree = Tree(tokens=jnp.zeros((1, 4), jnp.int32), parents=jnp.array([[-1, 0, 1, 2]]), valid=jnp.ones((1, 4), bool))
    for b in (1, 2):
        one = dataclasses.replace(adaptive.init_state(chain, b, 4, 4, is_chain=True), looking=jnp.ones((b,), bool))
        trees = jax.tree.map(lambda x: jnp.repeat(x, b, axis=0), tree)
        zero = jnp.zeros((b,), jnp.int32)
        after = adaptive.update(chain, one, trees, jnp.full((b, 4), -1, jnp.int32), zero, zero, jnp.ones((b,), bool))
        miss = 0.6 * chain.decay / (1 + chain.decay) if b == 1 else 0.6
        assert float(after.accept[0, 0]) == pytest.approx(miss, rel=1e-5)
        assert np.asarray(after.never_tried)[0].tolist() == ([False, True, True, True] if b == 1 else [False] * 4)
    # A look whose step kept nothing is over once the plain steps after it drift the estimates.
    one = adaptive.AdaptivePolicy(widths=(0, 1))
    looked = dataclasses.replace(adaptive.init_state(one, 1, 1, 1, is_chain=True), looking=jnp.ones((1,), bool))
    assert not bool(adaptive.drift(one, looked, jnp.zeros((1,), jnp.int32)).looking[0])
    # Only keys started at the flat guess get a first look: a measured start has none to look at.
    policy = adaptive.AdaptivePolicy(widths=(0, 1, 2), prior_by_depth=(0.9,))
    assert not np.any(np.asarray(adaptive.init_state(policy, 2, 2, 2, is_chain=True).never_tried))
    guessed = adaptive.init_state(dataclasses.replace(policy, prior_by_depth=()), 2, 2, 2, is_chain=True)
    assert np.all(np.asarray(guessed.never_tried))


def test_later_siblings_are_judged_given_the_earlier_ones_missed():
    """Estimates are P(accepted | parent accepted, earlier siblings missed): siblings' chances sum to
    <= 1 and a first child that keeps missing leaves its mass to the next. Every prior (flat, or a
    drafter's measured acceptance by depth) is a first child's; a later sibling starts at a guess
    (sibling_share) weighing as one. When every rank of a depth started at the depth's prior,
    Medusa's four depth-1 siblings were worth 0.68 each (capped to sum to 1), a full tree looked
    worth 1 + depth tokens, and the policy drafted at 0.72x plain greedy (BENCHMARKS.md, "Later
    siblings")."""
    static = np.array([-1, -1, -1, -1, 0, 0], np.int32)  # four children of the root; two of node 0
    policy = adaptive.AdaptivePolicy(widths=(0, 2, 6), prior_by_depth=(0.7,), prior_weight=16.0, min_reach=0.0)
    st = adaptive.init_state(policy, 1, 2, 6, static)
    np.testing.assert_allclose(np.asarray(st.accept)[0], [0.7, 1 / 3, 1 / 3, 1 / 3, 0.7, 1 / 3], rtol=1e-6)
    # measured rates count as measured (16 observations); the later siblings' guess as 1 / (1 - decay)
    np.testing.assert_allclose(np.asarray(st.weight)[0], [16, 5, 5, 5, 16, 5], rtol=1e-6)
    reach, _, _, _ = adaptive._node_values(policy, st, st.parents, st.shaped)
    a1 = 0.3 / 3  # node 1: node 0 missed (0.3), then it is right (1/3)
    np.testing.assert_allclose(np.asarray(reach)[0],
                               [0.7, a1, a1 * 2 / 3, a1 * 4 / 9, 0.49, 0.7 * a1], rtol=1e-5)
    assert float(np.sum(np.asarray(reach)[0, :4])) < 1.0
    # A first child that keeps missing leaves its mass to the next: rank 1 is worth its own rate.
    missing = dataclasses.replace(st, accept=st.accept.at[:, 0].set(0.0))
    reach, order, _, _ = adaptive._node_values(policy, missing, st.parents, st.shaped)
    np.testing.assert_allclose(np.asarray(reach)[0, :4], [0.0, 1 / 3, 2 / 9, 4 / 27], rtol=1e-5)
    # A later sibling is tried only where the earlier ones missed: node 0 accepted leaves node 1 as it was.
    tree = Tree(tokens=jnp.zeros((1, 6), jnp.int32), parents=jnp.asarray(static)[None], valid=jnp.ones((1, 6), bool))
    after = adaptive.update(policy, st, tree, jnp.asarray([[0, 4, -1, -1, -1, -1]]), jnp.asarray([2]),
                            jnp.asarray([2]), jnp.asarray([True]))
    acc = np.asarray(after.accept)[0]
    assert acc[0] > 0.7 and acc[4] > 0.7 and acc[1] >= 1 / 3 - 1e-6 and acc[5] >= 1 / 3 - 1e-6, acc
    after = adaptive.update(policy, st, tree, jnp.asarray([[1, -1, -1, -1, -1, -1]]), jnp.asarray([1]),
                            jnp.asarray([1]), jnp.asarray([True]))
    acc = np.asarray(after.accept)[0]
    assert acc[0] < 0.7 and acc[1] > 1 / 3 and acc[2] >= 1 / 3 - 1e-6, acc  # node 2 untried: node 1 was right
    # the flat prior likewise; a chain has no later siblings
    flat = adaptive.init_state(adaptive.AdaptivePolicy(widths=(0, 2, 6)), 1, 2, 6, static)
    np.testing.assert_allclose(np.asarray(flat.accept)[0, :2], [0.6, 1 / 3], rtol=1e-6)
    chain = adaptive.init_state(adaptive.AdaptivePolicy(widths=(0, 4)), 1, 4, 4, is_chain=True)
    np.testing.assert_allclose(np.asarray(chain.accept)[0], [0.6] * 4)
    with pytest.raises(ValueError, match="sibling_share"):
        adaptive.AdaptivePolicy(widths=(0, 1), sibling_share=1.5)


def test_acceptance_prior_seeds_the_estimates_by_depth_for_greedy_decoding_only():
    static = np.array([-1, -1, 0, 1, 2], np.int32)  # depths 1, 1, 2, 2, 3
    policy = adaptive.AdaptivePolicy(widths=(0, 1, 2, 5), prior_by_depth=(0.9, 0.8))
    # The rates are a first child's: node 1, node 0's later sibling, starts at the guess
    # (AdaptivePolicy.sibling_share); deeper than the table: its last rate.
    np.testing.assert_allclose(np.asarray(adaptive.init_state(policy, 2, 3, 5, static).accept),
                               [[0.9, 1 / 3, 0.8, 0.8, 0.8]] * 2, rtol=1e-6)
    keyed = adaptive.init_state(policy, 1, 3, 8)  # (depth, rank) keys: rank 0 at the depth's rate
    np.testing.assert_allclose(np.asarray(keyed.accept)[0].reshape(3, 8),
                               [[0.9] + [1 / 3] * 7] + [[0.8] + [1 / 3] * 7] * 2, rtol=1e-6)
    with pytest.raises(ValueError, match="prior_by_depth"):
        adaptive.AdaptivePolicy(widths=(0, 1), prior_by_depth=(1.5,))
    drafter = OracleDrafter(continuation=jnp.zeros((1, 4), jnp.int32), prompt_lengths=jnp.ones((1,), jnp.int32),
                            depth=4, shift=0, vocab=64, acceptance_prior=(0.7, 0.6))
    assert policy_for(drafter, GREEDY).prior_by_depth == (0.7, 0.6)
    # The rates were measured under greedy verification: sampling starts at the flat prior.
    assert policy_for(drafter, SamplerConfig(temperature=0.7)).prior_by_depth == ()
    assert policy_for(drafter, GREEDY).prior_weight == adaptive.MEASURED_PRIOR_WEIGHT
    assert policy_for(drafter, SamplerConfig(temperature=0.7)).prior_weight == 0.0
    # a lookup drafter's measured rates by confidence class weigh as much; its sampling start (flat) does not
    lookup = types.SimpleNamespace(num_nodes=4, max_depth=4, is_chain=True, child_rule="point", confidence_classes=2,
                                   class_prior=(0.3, 0.9))
    assert policy_for(lookup, GREEDY).prior_weight == adaptive.MEASURED_PRIOR_WEIGHT
    assert policy_for(lookup, SamplerConfig(temperature=0.7)).prior_weight == 0.0


def test_sampling_asks_a_wider_margin_of_a_drafting_width():
    """Greedy keeps AdaptivePolicy's margin (0.15) at every batch size; sampling asks SAMPLING_MARGIN
    (0.3: adaptive, "Sampling margin") of one row and SAMPLING_BATCH_MARGIN (0.5) of a batch, for a
    drafter keyed by depth and one keyed by confidence class; a margin the caller gives holds at every
    batch size, and a batch_margin the caller gives wins."""
    oracle = OracleDrafter(continuation=jnp.zeros((1, 4), jnp.int32), prompt_lengths=jnp.ones((1,), jnp.int32),
                           depth=4, shift=0, vocab=64, acceptance_prior=(0.7, 0.6))
    lookup = types.SimpleNamespace(num_nodes=4, max_depth=4, is_chain=True, child_rule="point", confidence_classes=2,
                                   class_prior=(0.3, 0.9))
    for drafter in (oracle, lookup):
        assert policy_for(drafter, GREEDY).margin == adaptive.AdaptivePolicy(widths=(0, 1)).margin == 0.15
        assert policy_for(drafter, GREEDY).batch_margin is None
        sampled = policy_for(drafter, SamplerConfig(temperature=0.7))
        assert (sampled.margin, sampled.batch_margin) == (adaptive.SAMPLING_MARGIN, adaptive.SAMPLING_BATCH_MARGIN)
        assert (adaptive.margin_at(sampled, 1), adaptive.margin_at(sampled, 4)) == (0.3, 0.5)
        given = policy_for(drafter, SamplerConfig(temperature=0.7), margin=0.05)
        assert (adaptive.margin_at(given, 1), adaptive.margin_at(given, 16)) == (0.05, 0.05)
        assert policy_for(drafter, SamplerConfig(temperature=0.7), batch_margin=0.2).batch_margin == 0.2
        assert policy_for(drafter, GREEDY, margin=0.05).margin == 0.05


def test_a_batch_margin_holds_a_batch_to_more_than_one_row():
    """A one-node width whose expected tokens beat the plain step by 40% (reach 0.61 at 1.15x the cost)
    is bought by one row at the 0.3 margin and refused by a batch at the 0.5 batch margin: a sampled
    draft is a coin flip per row, and a level batch gains only when the rows that hold it back all
    accept (adaptive, "Sampling margin"). The plain-run search, which asks the same plan, agrees."""
    costs = jnp.asarray([1.0, 1.15, 0.0, 0.0, 0.0], jnp.float32)  # steps at widths 0 / 1, drafts, idle
    policy = adaptive.AdaptivePolicy(widths=(0, 1), prior=0.61, margin=0.3, batch_margin=0.5)
    for rows, buys in [(1, True), (4, False)]:
        state = adaptive.init_state(policy, rows, 1, 1, np.array([-1], np.int32))
        remaining = jnp.full((rows,), 64, jnp.int32)
        assert bool(adaptive.should_draft(policy, state, costs, remaining)) == buys
        alike = dataclasses.replace(policy, batch_margin=None)  # the margin at every batch size
        assert bool(adaptive.should_draft(alike, state, costs, remaining))
        assert int(adaptive.plain_run_length(policy, state, costs, remaining, 8)) == (1 if buys else 8)
    for bad in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="batch_margin must be None"):
            adaptive.AdaptivePolicy(widths=(0, 1), batch_margin=bad)


def test_a_measured_prior_outweighs_a_few_early_misses():
    """A running estimate (decay 0.8) took the draft LM's measured 0.79 at depth 1 to 0.40 after three
    misses, and a batch whose openings rejected the first drafts never drafted again. Counted as 16
    observations, the prior takes them at 1 / (0.8 n + 1), n falling toward the steady 5: 0.61 after
    three misses, and the running estimate's own rate once the prior's weight is spent."""
    chain = Tree(tokens=jnp.zeros((1, 4), jnp.int32), parents=jnp.array([[-1, 0, 1, 2]]), valid=jnp.ones((1, 4), bool))
    miss = jnp.full((1, 4), -1, jnp.int32)

    def after_misses(policy, k):
        state = adaptive.init_state(policy, 1, 4, 4, is_chain=True)
        for _ in range(k):
            state = adaptive.update(policy, state, chain, miss, jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32),
                                    jnp.ones((1,), bool))
        return state
    measured = (0.79, 0.87, 0.89, 0.95)
    running = after_misses(adaptive.AdaptivePolicy(widths=(0, 1, 2, 4), prior_by_depth=measured), 3)
    weighed = after_misses(adaptive.AdaptivePolicy(widths=(0, 1, 2, 4), prior_by_depth=measured, prior_weight=16), 3)
    assert float(running.accept[0, 0]) == pytest.approx(0.79 * 0.8 ** 3)
    three_misses = 0.79 * (12.8 / 13.8) * (11.04 / 12.04) * (9.632 / 10.632)  # n: 16 -> 13.8 -> 12.04 -> 10.632
    assert float(weighed.accept[0, 0]) == pytest.approx(three_misses, rel=1e-4)
    assert float(weighed.accept[0, 0]) > 0.6
    np.testing.assert_allclose(np.asarray(weighed.accept[0, 1:]), measured[1:], atol=0.01)  # untried: drifted
    np.testing.assert_allclose(np.asarray(weighed.weight[0, 1:]), 16.0)  # ... their weight kept
    spent = after_misses(adaptive.AdaptivePolicy(widths=(0, 1, 2, 4), prior_by_depth=measured, prior_weight=16), 40)
    assert float(spent.weight[0, 0]) == pytest.approx(5.0, abs=1e-2)  # the steady weight: a running estimate again
    for bad in (-1.0, float("nan"), "16"):
        with pytest.raises(ValueError, match="prior_weight"):
            adaptive.AdaptivePolicy(widths=(0, 1), prior_weight=bad)


def test_greedy_exact_while_depth_changes_between_steps_and_rows(models):
    """A real (weak) draft LM: rows accept differently, the policy's depths differ by row and step."""
    (cfg, params), (dcfg, dparams) = models
    prompts, lengths = pad_prompts(PROMPTS_4)
    n = 24
    ref = _greedy(cfg, params, prompts, lengths, n)
    for tree in ("chain:4", "static:2,2,1", "eagle:depth=3,topk=2,total=5"):
        drafter = DraftLM(params=dparams, config=dcfg, builder=parse_tree_spec(tree))
        # Verification nearly free, drafting cheap: the policy keeps drafting but trims by row.
        out = _run(cfg, params, drafter, prompts, lengths, n, costs=Costs(per_node=0.01, draft=0.05))
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens), err_msg=tree)
        np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths), err_msg=tree)
        s = jax.tree.map(np.asarray, out.stats)
        assert (s["width_hist"] > 0).sum() >= 2, (tree, s["width_hist"])  # the width changed between steps


def test_a_draft_lm_catches_up_after_plain_steps(models):
    """With drafting off for stretches (expensive drafts), a self-draft LM must still draft the right
    tokens whenever the policy probes: its cache, left behind by the plain steps, catches up on every
    token committed meanwhile (several blocks of max_depth + 1) before it drafts."""
    (cfg, params), _ = models
    prompts, lengths = pad_prompts(PROMPTS_4)
    n = 32
    ref = _greedy(cfg, params, prompts, lengths, n)
    drafter = DraftLM(params=params, config=cfg, builder=parse_tree_spec("chain:3"))
    # Drafting does not pay at the prior; the estimate drifts up (explore) until the policy probes.
    out = _run(cfg, params, drafter, prompts, lengths, n, costs=Costs(draft=0.6), prior=0.3, explore=0.1)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    s = jax.tree.map(np.asarray, out.stats)
    assert s["width_hist"][0] > 0  # some steps did not draft
    assert np.all(s["speculative_steps"] > 0)
    # Every drafted step of a self-draft is fully accepted when the cache is current.
    assert np.all(s["accept_rate_by_depth"][:1] > 0.95), s["accept_rate_by_depth"]


def test_bad_adaptive_arguments(models):
    (cfg, params), (dcfg, dparams) = models
    prompts, lengths = pad_prompts(PROMPTS_4[:1])
    drafter = DraftLM(params=dparams, config=dcfg, builder=parse_tree_spec("chain:4"))
    with pytest.raises(SpeculativeError, match="needs the measured costs"):
        speculative_decode(cfg, params, drafter, prompts, lengths, max_new_tokens=4,
                           verifier=get_verifier("greedy"), adaptive=policy_for(drafter, GREEDY))
    with pytest.raises(SpeculativeError, match="must end at the drafter's tree size"):
        speculative_decode(cfg, params, drafter, prompts, lengths, max_new_tokens=4,
                           verifier=get_verifier("greedy"), costs=Costs(),
                           adaptive=adaptive.AdaptivePolicy(widths=(0, 1, 2)))
    with pytest.raises(ValueError, match="starting at 0"):
        adaptive.AdaptivePolicy(widths=(1, 4))
    with pytest.raises(ValueError, match="first_look must be a bool"):
        adaptive.AdaptivePolicy(widths=(0, 4), first_look=1)
    with pytest.raises(ValueError, match="unusable seconds"):
        adaptive.cost_vector(adaptive.AdaptivePolicy(widths=(0, 4)), Costs(draft=float("nan")))


def test_a_capped_chain_drafts_only_its_rows_levels():
    """capped_chain: row b drafts max_nodes[b] levels (at least one), and the level loop stops once
    every row is done: expand runs max(max_nodes) - 1 times, not depth - 1."""
    from jaxdecode.drafters.builders import ChainBuilder, capped_chain
    v, b = 16, 3
    logq = jnp.log(jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(0), (v, v)), axis=-1))

    def expand(calls, start, toks, parents):
        return logq[toks], calls + 1

    root = logq[jnp.arange(b)]
    full, full_slots, full_calls = ChainBuilder(4, "argmax").build(jnp.int32(0), root, expand, jax.random.PRNGKey(1))
    tree, slots, calls = capped_chain(ChainBuilder(4, "argmax"), jnp.array([1, 3, 0], jnp.int32)).build(
        jnp.int32(0), root, expand, jax.random.PRNGKey(1))
    assert int(full_calls) == 3 and int(calls) == 2
    np.testing.assert_array_equal(np.asarray(tree.valid), [[1, 0, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
    # the levels drafted are the uncapped chain's: same tokens, same draft distributions
    keep = np.asarray(tree.valid)
    np.testing.assert_array_equal(np.asarray(tree.tokens)[keep], np.asarray(full.tokens)[keep])
    np.testing.assert_allclose(np.asarray(slots)[:, :2], np.asarray(full_slots)[:, :2])


def test_a_level_capped_draft_lm_drafts_what_pays_and_grows_when_right(models):
    """A chain draft LM is level_capped: the policy picks the depth before drafting, from costs that
    price each level (LevelCosts), and the draft LM drafts only that deep. At the prior, 2 levels pay
    and 4 do not; a self-draft (always right) then grows to the whole chain, because the shape the
    policy keeps is the uncapped chain's, not the capped draft's (levels never drafted while capped
    reach their parents' estimates by the explore drift, here fast). Greedy output is exact throughout."""
    (cfg, params), (dcfg, dparams) = models
    prompts, lengths = pad_prompts(PROMPTS_4)
    n = 32
    ref = _greedy(cfg, params, prompts, lengths, n)
    costs = LevelCosts(per_node=0.05, base=0.1, per_level=0.2)
    seen, drafted = [], []
    real = DraftLM.propose

    def spy(self, cache, ctx, sampler):  # the cap the engine hands the drafter; the levels it drafted
        seen.append(ctx.max_nodes is not None)
        tree, slots, cache = real(self, cache, ctx, sampler)
        jax.debug.callback(lambda v: drafted.append(int(v)), jnp.max(jnp.sum(tree.valid, axis=1)))
        return tree, slots, cache

    with mock.patch.object(DraftLM, "propose", spy):
        for name, (c, p) in {"weak": (dcfg, dparams), "self": (cfg, params)}.items():
            drafter = DraftLM(params=p, config=c, builder=parse_tree_spec("chain:4"))
            assert drafter.level_capped
            out = _run(cfg, params, drafter, prompts, lengths, n, costs=costs, explore=0.2 if name == "self" else 0.005)
            np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens), err_msg=name)
            s = jax.tree.map(np.asarray, out.stats)
            widths = list(s["policy_widths"])
            if name == "weak":  # the first step drafts 2 levels (the plan at the prior), not the chain's 4
                assert drafted and drafted[0] == 2 and s["width_hist"][widths.index(2)] > 0, (drafted, s["width_hist"])
                drafted.clear()
            else:
                # from 2 levels at the prior to the whole chain (a one- or two-node shape would never grow)
                assert s["width_hist"][widths.index(4)] >= 2, s["width_hist"]
                assert np.all(s["tau"] > 3.0), s["tau"]
    assert any(seen)
    assert not DraftLM(params=dparams, config=dcfg, builder=parse_tree_spec("static:2,1")).level_capped


def _simulated_batch_steps(p: float, rows: int, remaining: int, trials: int = 4000) -> float:
    """E[steps until every row has `remaining` tokens], one node a step accepted with p, by simulation."""
    rng = np.random.default_rng(0)
    tokens, steps = np.zeros((trials, rows)), np.zeros((trials, rows))
    while (tokens < remaining).any():
        going = tokens < remaining
        tokens += going * (1 + (rng.random((trials, rows)) < p))
        steps += going
    return float(steps.max(axis=1).mean())


def test_batch_spread_prices_the_slowest_row_as_the_batch_waits_for_it():
    """A batch waits for its unluckiest row ("Batch spread"): with 4 level rows a one-node width whose
    mean steps pay (42.7 steps for 64 tokens at p = 0.5, cost 1.45 -> 61.9 plain steps' time) but
    whose simulated batch steps do not (45.1 -> 65.4) is refused with the spread; priced at the max of
    the means (batch_spread 0, the default), for one row alone, or for a batch whose last row lags far
    behind the others (it alone contests the maximum), it is bought."""
    np.testing.assert_allclose(adaptive.expected_max_normal(16)[[0, 1, 2, 4, 16]],
                               [0.0, 0.0, 0.5641896, 1.0293754, 1.7659914], atol=2e-5)
    cost = 1.45
    level = _simulated_batch_steps(0.5, 4, 64)
    assert cost * 64 / 1.5 < 64 < cost * level  # the premise: the means pay, the batch does not
    costs = jnp.asarray([1.0, cost, 0.0, 0.0, 0.0], jnp.float32)  # steps at widths 0 / 1, drafts, idle

    def drafts(rows, remaining, spread=1.0):
        policy = adaptive.AdaptivePolicy(widths=(0, 1), prior=0.5, margin=0.0, batch_spread=spread)
        state = adaptive.init_state(policy, rows, 1, 1, np.array([-1], np.int32))
        return bool(adaptive.should_draft(policy, state, costs, jnp.asarray(remaining, jnp.int32)))

    assert drafts(1, [64])  # a row alone: no spread
    assert not drafts(4, [64] * 4)
    assert drafts(4, [64] * 4, spread=0.0)
    assert drafts(4, [64, 40, 40, 40])  # the last row far behind: the max is its own steps
    assert drafts(4, [64, 0, 0, 0])  # three rows done
    assert not drafts(16, [64] * 16)


def test_generate_takes_policy_fields_as_the_adaptive_option(tiny_llama_dir):
    """adaptive={...}: on, with those AdaptivePolicy fields (lists as tuples: the policy is a jit key);
    bad fields and values get errors that name them."""
    import jaxdecode
    from jaxdecode import speculative

    model = jaxdecode.load(tiny_llama_dir)
    kw = dict(method="speculative", drafter="prompt_lookup", tree="chain:3", max_new_tokens=6)
    built = []
    real = speculative.policy_for

    def spy(*a, **k):
        built.append(real(*a, **k))
        return built[-1]

    with mock.patch.object(speculative, "policy_for", spy):
        plain = jaxdecode.generate(model, ["def add(a, b):"], **kw)
        tuned = jaxdecode.generate(model, ["def add(a, b):"], adaptive={"batch_spread": 1.0, "margin": 0.3,
                                                                       "prior_by_depth": [0.5, 0.4]}, **kw)
    assert built[0].batch_spread == 0.0 and built[1].batch_spread == 1.0 and built[1].margin == 0.3
    assert built[1].prior_by_depth == (0.5, 0.4)
    assert tuned[0].tokens == plain[0].tokens  # greedy: the policy changes the speed, never the output
    for bad, match in [({"nope": 1}, r"unknown AdaptivePolicy fields \['nope'\]"),
                       ({"widths": (0, 1)}, "verify_widths"), ({"batch_spread": -1.0}, "batch_spread must be"),
                       ({"plain_run": 0}, "plain_run must be"), ([1], "takes true, false or a dict")]:
        with pytest.raises(ValueError, match=match):
            jaxdecode.generate(model, ["x = 1"], adaptive=bad, **kw)
