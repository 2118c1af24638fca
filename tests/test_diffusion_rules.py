"""Commit rules of jaxdecode.diffusion_rules against their papers: per rule a handcrafted forward (one
StepContext, tiny B, A, V) where the paper's rule commits a set that a plain threshold / top-k rule
would not, and every changed rule decoding a tiny random model end to end."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxdecode.models import ModelConfig, init_params

from jaxdecode import diffusion as D
from jaxdecode import diffusion_rules as R

V = 8  # vocabulary of the handcrafted forwards


def dist(top, c, spread="flat", other=None):
    """A distribution over V tokens: probability c on `top`; the rest spread evenly ("flat", high
    entropy) or put on one other token ("one", low entropy)."""
    p = np.full(V, (1 - c) / (V - 1))
    if spread == "one":
        p[:] = 0.0
        p[(top + 1) % V if other is None else other] = 1 - c
    p[top] = c
    return p


def ctx(rows, committed=None, state=None, block=None, eos_ids=(7,)):
    """StepContext from per-slot distributions rows[b][i] (logits = log p); eligible = not committed."""
    p = np.asarray(rows, np.float64)
    logits = jnp.asarray(np.log(np.maximum(p, 1e-12)), jnp.float32)
    committed = np.zeros(p.shape[:2], bool) if committed is None else np.asarray(committed, bool)
    start, end = (None, None) if block is None else (jnp.asarray(block[0], jnp.int32), jnp.asarray(block[1], jnp.int32))
    return R.StepContext(logits=logits, eligible=jnp.asarray(~committed), committed=jnp.asarray(committed),
                         answer=jnp.zeros(p.shape[:2], jnp.int32), key=jax.random.PRNGKey(0), state=state,
                         eos_ids=eos_ids, block_start=start, block_end=end)


def picks(rule, c, state=None):
    commit, tokens, new_state = rule.select(c if state is None else dataclasses.replace(c, state=state))
    return [np.flatnonzero(r).tolist() for r in np.asarray(commit)], np.asarray(tokens), new_state


def threshold_picks(c, t=0.9):
    return picks(R.Threshold(t), c)[0]


def test_at_least_one_keeps_a_rules_choice():
    conf = jnp.array([[0.5, 0.9, 0.1]])
    elig = jnp.array([[True, True, True]])
    np.testing.assert_array_equal(R.at_least_one(jnp.array([[True, False, False]]), conf, elig), [[1, 0, 0]])
    np.testing.assert_array_equal(R.at_least_one(jnp.zeros((1, 3), bool), conf, elig), [[0, 1, 0]])


def test_eb_sorts_by_entropy_and_bounds_the_summed_entropy():
    # slot 0: p=0.60 on one token, the rest on one other (low entropy); slot 1: p=0.62, rest flat (high entropy)
    c = ctx([[dist(1, 0.60, "one"), dist(2, 0.62), dist(3, 0.3)]])
    assert picks(R.EntropyBounded(gamma=0.0), c)[0] == [[0]]  # lowest entropy first
    assert picks(R.EntropyBounded(gamma=0.0, proxy="confidence"), c)[0] == [[1]] == threshold_picks(c)
    # entropies 0.056, 0.423, 0.673: a + b - max = 0.056 <= 0.1 < a + b + c - max = 0.479
    c = ctx([[dist(1, 0.6, "one"), dist(2, 0.99, "one"), dist(3, 0.85, "one"), dist(4, 0.3)]])
    assert picks(R.EntropyBounded(gamma=0.1), c)[0] == [[1, 2]]
    assert threshold_picks(c) == [[1]]
    assert picks(R.EntropyBounded(gamma=0.5), c)[0] == [[0, 1, 2]]


def test_ete_explores_the_most_uncertain_slot_when_nothing_is_sure():
    c = ctx([[dist(1, 0.7, "one"), dist(2, 0.5), dist(3, 0.8, "one"), dist(4, 0.6, "one")]])
    assert picks(R.ETE(threshold=0.9), c)[0] == [[1]]  # highest entropy, not the most confident (slot 2)
    assert threshold_picks(c) == [[2]]
    c = ctx([[dist(1, 0.95), dist(2, 0.5), dist(3, 0.92, "one"), dist(4, 0.6)]])
    assert picks(R.ETE(threshold=0.9), c)[0] == [[0, 2]]  # exploit when something is sure


def test_window_commits_inside_the_active_window_between_refreshes():
    rows = [[dist(1, 0.5), dist(2, 0.6), dist(3, 0.4), dist(4, 0.7), dist(5, 0.99), dist(6, 0.3)]]
    c = ctx(rows, committed=[[True, False, False, False, False, False]])
    rule = R.Window(active=2, window_tokens=3, refresh=3)
    window = jnp.array([[False, True, True, True, False, False]])
    commit, _, (t, win) = picks(rule, c, state=(jnp.array([1]), window))
    assert commit == [[1]] and int(t[0]) == 2  # active = the 2 leftmost masked slots (1, 2)
    assert np.asarray(win).tolist() == np.asarray(window).tolist()  # kept until the next refresh
    # a refresh: every slot is a candidate, and the window becomes the 3 leftmost slots still masked
    commit, _, (t, win) = picks(rule, c, state=(jnp.array([3]), window))
    assert commit == [[4]] == threshold_picks(c) and np.asarray(win)[0].tolist() == [0, 1, 1, 1, 0, 0]
    # the forward before a pruned step sees the window and the decoded slots only; before a refresh, all
    committed = jnp.array([[True, False, False, False, True, False]])
    assert np.asarray(rule.visible((jnp.array([4]), win), committed))[0].tolist() == [1, 1, 1, 1, 1, 0]
    assert np.asarray(rule.visible((jnp.array([6]), win), committed)).all()


def test_adablock_ends_the_block_at_a_confident_delimiter():
    delim = 6
    rows = [[dist(1, 0.6), dist(2, 0.92), dist(delim, 0.5), dist(3, 0.4), dist(4, 0.95), dist(5, 0.97),
             dist(1, 0.3), dist(2, 0.3)]]
    c = ctx(rows)
    rule = R.AdaBlock(delimiters=(delim,), block_length=4, window=0.5)  # window: 4 slots from the start
    commit, _, end = picks(rule, c, state=jnp.array([0]))
    assert commit == [[1]] and int(end[0]) == 3  # block [0, 2]: slot 5 (0.97) waits for a later block
    assert threshold_picks(c) == [[1, 4, 5]]
    # no delimiter >= 0.3 in the window: the default block of 4 slots
    rows[0][2] = dist(delim, 0.2)
    commit, _, end = picks(rule, ctx(rows), state=jnp.array([0]))
    assert commit == [[1]] and int(end[0]) == 4
    # no delimiter ids at all: fixed blocks of block_length
    assert picks(R.AdaBlock(block_length=2), ctx(rows, eos_ids=()), state=jnp.array([0]))[2].tolist() == [2]
    # inside an unfinished block the boundary is kept
    commit, _, end = picks(rule, ctx(rows, committed=[[False, True] + [False] * 6]), state=jnp.array([3]))
    assert int(end[0]) == 3 and commit == [[0]]


def test_r2_confidence_clusters():
    rows = [[dist(0, 0.9), dist(1, 0.85), dist(2, 0.78), dist(3, 0.3), dist(4, 0.3), dist(5, 0.88)]]
    c = ctx(rows, committed=[[True] + [False] * 5], block=([0], [6]))
    rule = R.R2()
    commit, _, _ = picks(rule, c, state=rule.init(1, 6, V))
    # slot 5: the most confident; window {0, 1, 2}: one unmasked slot, mean(0.85, 0.78) >= 0.8
    assert commit == [[1, 2, 5]] and threshold_picks(c) == [[5]]
    # the same window past the block's end is not a window
    assert picks(rule, ctx(rows, committed=[[True] + [False] * 5], block=([0], [2])), state=rule.init(1, 6, V))[0] \
        == [[5]]


def test_r2_token_clusters_and_temporal_stability():
    rule = R.R2()
    rows = [[dist(0, 0.3), dist(1, 0.3), dist(2, 0.85), dist(2, 0.7), dist(4, 0.3), dist(5, 0.88)]]
    c = ctx(rows, block=([0], [6]))
    # slots 2, 3 both predict token 2: a run whose max (0.85) > 0.8 commits its most confident slot
    assert picks(rule, c, state=rule.init(1, 6, V))[0] == [[2, 5]]
    assert picks(R.R2(token_clusters=False), c, state=rule.init(1, 6, V))[0] == [[5]] == threshold_picks(c)
    rows = [[dist(0, 0.3), dist(1, 0.3), dist(2, 0.3), dist(3, 0.82), dist(4, 0.5), dist(5, 0.88)]]
    state = (jnp.array([[-1, -1, -1, 3, 6, -1]]), jnp.array([[0, 0, 0, 2, 2, 0]]))
    commit, _, (last, run) = picks(rule, ctx(rows, block=([0], [6])), state=state)
    assert commit == [[3, 5]]  # slot 3: same argmax a third forward, 0.82 >= 0.8; slot 4's argmax changed
    assert np.asarray(run)[0].tolist() == [1, 1, 1, 0, 1, 0] and np.asarray(last)[0].tolist() == [0, 1, 2, -1, 4, -1]


def test_ccd_commits_the_history_consistent_slots():
    rule = R.CCD()
    # ranks by entropy: slot 2 (0.6 on one token), slot 3, slot 1 (flat); slot 0 committed
    rows = [[dist(0, 0.9), dist(1, 0.65), dist(2, 0.6, "one"), dist(3, 0.55, "one"), dist(4, 0.2)]]
    c = ctx(rows, committed=[[True, False, False, False, False]])
    verify = jnp.array([[False, False, True, True, False]])
    prev = jnp.array([[0, 1, 2, 3, 4]])
    commit, _, (v2, x2, t2) = picks(rule, c, state=(verify, prev, jnp.array([5])))
    assert commit == [[2, 3]] and int(t2[0]) == 6  # both verified slots kept their argmax
    assert np.asarray(x2)[0].tolist() == [0, 1, 2, 3, 4]  # this forward's argmax, for the next check
    assert picks(R.LLaDA(1), c)[0] == [[1]] and threshold_picks(c) == [[1]]  # most confident: slot 1
    assert np.asarray(v2)[0].tolist() == [False, True, False, False, True]  # n_v = 3 best of the rest
    # warm-up, or an argmax that changed: one slot, the best ranked
    assert picks(rule, c, state=(verify, prev, jnp.array([2])))[0] == [[2]]
    assert picks(rule, c, state=(verify, jnp.array([[0, 1, 2, 5, 4]]), jnp.array([5])))[0] == [[2]]


def test_localleap_and_credit_follow_algorithms_md():
    # LocalLeap: anchors c >= 0.9; neighbours within 4 slots with c >= 0.75
    rows = [[dist(1, 0.7), dist(1, 0.3), dist(2, 0.95), dist(1, 0.3), dist(1, 0.3), dist(3, 0.8), dist(1, 0.3),
             dist(4, 0.8)]]
    assert picks(R.LocalLeap(), ctx(rows))[0] == [[2, 5]]
    # Credit: C <- 0.8 C; C[i, x_i] += c_i ** 0.2; decide on logits + 0.7 log(1 + C)
    rows = [[dist(1, 0.6), dist(2, 0.85, "one")]]
    c = ctx(rows)
    rule = R.Credit()
    credit0 = jnp.zeros((1, 2, V)).at[0, 1, 5].set(2.0)
    commit, tokens, credit = picks(rule, c, state=credit0)
    want = 0.8 * np.asarray(credit0)
    want[0, 0, 1] += 0.6 ** 0.2
    want[0, 1, 2] += 0.85 ** 0.2
    np.testing.assert_allclose(np.asarray(credit), want, rtol=1e-5)
    boosted = jax.nn.softmax(c.logits + 0.7 * jnp.log1p(jnp.asarray(want)), axis=-1)
    want_commit = np.asarray(boosted.max(-1) >= 0.9)[0] | (np.arange(2) == int(jnp.argmax(boosted.max(-1)[0])))
    assert commit == [np.flatnonzero(want_commit).tolist()]
    np.testing.assert_array_equal(tokens, np.asarray(boosted.argmax(-1)))


def test_infogain_keeps_the_candidate_with_the_best_information_gain():
    # current forward: slot 0 most confident but uncertain (flat rest), slot 1 a little less confident, certain
    c = ctx([[dist(1, 0.6), dist(2, 0.55, "one"), dist(3, 0.3)]])
    rule = R.InfoGain(candidates=3)
    commits, tokens = rule.propose(c)
    assert commits.shape == (3, 1, 3) and np.asarray(commits[0])[0].tolist() == [True, False, False]
    assert np.asarray(commits).sum(-1).tolist() == [[1], [1], [1]] and np.asarray(tokens)[0].tolist() == [1, 2, 3]
    # lookahead forwards: committing slot 1 leaves the rest certain; committing slot 0 leaves it uncertain
    commits = jnp.array([[[True, False, False]], [[False, True, False]], [[False, False, True]]])
    masked = jnp.asarray(~np.asarray(commits))
    logp = lambda rows: np.log(np.maximum(np.asarray(rows), 1e-12))
    after = np.stack([logp([[dist(1, 0.6), dist(2, 0.5), dist(3, 0.4)]]),  # a = {0}: remaining stay flat
                      logp([[dist(1, 0.99, "one"), dist(2, 0.5), dist(3, 0.99, "one")]]),  # a = {1}: the rest resolve
                      logp([[dist(1, 0.6), dist(2, 0.5), dist(3, 0.3)]])])
    idx, _ = rule.choose(c, commits, masked, masked, jnp.asarray(after, jnp.float32))
    assert np.asarray(idx).tolist() == [1]  # not the most confident slot (what greedy1 / top-k would commit)


def test_rule_parameters_are_checked():
    cfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=64)
    for rule, msg in ((R.EntropyBounded(proxy="margins"), "proxy"), (R.EntropyBounded(gamma=-1), "gamma"),
                      (R.Window(active=0), "active"), (R.CCD(expand_ratio=-1.0), "expand_ratio"),
                      (R.AdaBlock(delimiters=(99,)), "delimiters"), (R.R2(cluster_unmasked=-1), "cluster_unmasked"),
                      (R.InfoGain(position_temperature=0.0), "position_temperature")):
        with pytest.raises(R.DiffusionError, match=msg):
            rule.check(cfg, (5,))


# ----------------------------------------------------------------------------- end to end
MASK = 15
CFG = ModelConfig(model_type="llama", vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=8, max_position_embeddings=64, attention="bidirectional", mask_token_id=MASK)
PARAMS = init_params(CFG, jax.random.PRNGKey(0), std=0.3)
PROMPTS = jnp.array([[1, 2, 3, 4], [5, 6, 0, 0]], jnp.int32)
LENGTHS = jnp.array([4, 2], jnp.int32)
ANSWER_LENGTHS = jnp.array([8, 6], jnp.int32)


def test_each_rule_decodes_a_random_model():
    rules = [R.EntropyBounded(gamma=0.5), R.ETE(threshold=0.5), R.Window(active=3, refresh=2), R.R2(),
             R.CCD(warmup=1), R.AdaBlock(delimiters=(3,), block_length=3), R.InfoGain(candidates=3),
             R.RandomRemask(1)]

    @jax.jit
    def run_all(prompts, lengths, key):
        outs = [D.diffusion_decode(CFG, PARAMS, prompts, lengths, answer_length=8, eos_ids=(7,), rule=r, key=key,
                                   answer_lengths=ANSWER_LENGTHS) for r in rules]
        return [(o.tokens, o.lengths, o.stats) for o in outs]

    for rule, (tokens, lengths, stats) in zip(rules, run_all(PROMPTS, LENGTHS, jax.random.PRNGKey(1))):
        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        assert not np.asarray(stats["unfinished"]).any(), rule
        for b in range(2):
            n = int(lengths[b])
            assert 1 <= n <= int(ANSWER_LENGTHS[b]) and MASK not in tokens[b, :n], rule
        tpf = np.asarray(stats["tokens_per_forward"])
        if rule.name == "random":  # the loop adds the most confident slot only when a rule chose none
            assert (tpf <= 1.0).all(), tpf


def test_a_pruned_forward_ignores_the_far_field():
    """The loop's visibility hook (Window-Diffusion's far field): slots outside `visible` change nothing."""
    s = D._Static(config=CFG, rule=R.Window(), answer_length=8, block_length=8, eos_ids=(7,), mask_id=MASK, shift=0,
                  mode="none", max_forwards=9, cache_len=64)
    answer = jnp.array([[3, 4, MASK, MASK, MASK, MASK, MASK, MASK]] * 2, jnp.int32)
    other = answer.at[:, 6].set(9)  # a far-field slot holds another token
    visible = jnp.array([[1, 1, 1, 1, 0, 0, 0, 0]] * 2, bool)
    run = lambda ans, vis: D._full_forward(s, PARAMS, PROMPTS, LENGTHS, ans, ANSWER_LENGTHS, None, vis)[:, :4]
    np.testing.assert_allclose(run(answer, visible), run(other, visible), rtol=1e-5, atol=1e-5)
    assert not np.allclose(run(answer, None), run(other, None), atol=1e-4)
