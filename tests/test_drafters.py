"""Training-free drafters (prompt lookup, aggressive decoding, Token Recycling, ADED, retrieval) and the DySpec tree
builder: proposal logic in isolation, then exactness against plain greedy decoding through the engine
(batch 1 and 4, a random model and a repetitive one where drafts are accepted), and point-mass
sampling that runs and is reproducible."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters.aded import ADEDDrafter, mcts_tree, table_add, table_lookup
from jaxdecode.drafters.builders import parse_tree_spec
from jaxdecode.drafters.draft_lm import DraftLM, catch_up_blocks, catch_up_widths, check_catch_up_sizes
from jaxdecode.drafters.dyspec import DySpecBuilder
from jaxdecode.drafters.ngram import AggressiveDrafter, PromptLookupDrafter
from jaxdecode.drafters.recycling import DEFAULT_TEMPLATE, TokenRecyclingDrafter, recycling_template
from jaxdecode.drafters.retrieval import RetrievalDrafter, build_table
from jaxdecode.models import ModelConfig, init_params
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import DraftContext, Observation, speculative_decode
from jaxdecode.tree import Tree, TreeError, depths, validate_parents
from jaxdecode.verifiers import get_verifier

V = 64
GREEDY = SamplerConfig(temperature=0.0)


def hist(rows, width=16, pad=0):
    h = np.full((len(rows), width), pad, np.int32)
    for i, r in enumerate(rows):
        h[i, :len(r)] = r
    return jnp.asarray(h), jnp.asarray([len(r) for r in rows], jnp.int32)


def ctx(rows, width=16):
    h, n = hist(rows, width)
    return DraftContext(history=h, hist_len=n, key=jax.random.PRNGKey(0))


def np_tree(tree):
    return np.asarray(tree.tokens), np.asarray(tree.parents), np.asarray(tree.valid)


def assert_tree_ok(tree, max_depth):
    """Parents topological, valid set closed under ancestors, depth bound respected."""
    toks, par, val = np_tree(tree)
    validate_parents(par)
    for b in range(par.shape[0]):
        for i in np.flatnonzero(val[b]):
            assert par[b, i] < 0 or val[b, par[b, i]], f"row {b}: valid node {i} has an invalid parent"
    d = np.asarray(depths(tree.parents))
    assert np.all(d[val] <= max_depth)


# ================================================================= prompt lookup
def test_prompt_lookup_most_recent_longest_match():
    d = PromptLookupDrafter(num_nodes=4)
    rows = [[1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 2, 3],  # 2-gram [2,3]: earlier at 1..2 and 6..7 -> most recent
            [4, 5, 6, 8, 5, 6, 1, 4, 5, 6],  # 3-gram [4,5,6] beats the more recent 2-gram [5,6]
            [1, 2, 3],  # nothing to match
            [5, 6, 5, 6, 5]]  # overlapping repeat: period 2
    tokens, valid = map(np.asarray, d.lookup(*hist(rows)))
    np.testing.assert_array_equal(tokens[0], [7, 7, 2, 3])
    np.testing.assert_array_equal(tokens[1], [8, 5, 6, 1])
    assert not valid[2].any()
    np.testing.assert_array_equal(tokens[3], [6, 5, 6, 5])  # cyclic: keeps copying its own copy
    assert valid[[0, 1, 3]].all()

    flat, fvalid = map(np.asarray, PromptLookupDrafter(num_nodes=4, cyclic=False).lookup(*hist(rows)))
    np.testing.assert_array_equal(fvalid[3], [True, True, False, False])  # cut at the present
    np.testing.assert_array_equal(flat[3, :2], [6, 5])

    # min_ngram=2: a lone 1-gram match is not used.
    _, v2 = PromptLookupDrafter(num_nodes=2, min_ngram=2).lookup(*hist([[7, 1, 8, 1]]))
    assert not np.asarray(v2).any()
    _, v1 = PromptLookupDrafter(num_nodes=2).lookup(*hist([[7, 1, 8, 1]]))
    assert np.asarray(v1).all()

    tree, probs, _ = d.propose((), ctx(rows), GREEDY)
    assert probs is None and d.child_rule == "point" and d.is_chain
    toks, par, val = np_tree(tree)
    np.testing.assert_array_equal(par[0], [-1, 0, 1, 2])
    assert (toks[~val] == 0).all()  # invalid nodes carry an in-vocabulary token


def test_prompt_lookup_follows_forced_tokens_under_a_constraint():
    """Under a constraint the copy is kept while allowed; where it stops (forbidden, or no match) the
    chain goes on with forced tokens (states with one allowed token, EOS at a dead-end accepting state)
    and ends where several are allowed. Without a constraint, or forced=False, it is the plain lookup."""
    from jaxdecode.constraints import automaton as am
    from jaxdecode.constraints.automaton import AutomatonState
    # a -10|11-> b -12-> c -13-> d -14|15-> e (accepting, no way on: only EOS = 0)
    auto = am.from_transitions({"a": {10: "b", 11: "b"}, "b": {12: "c"}, "c": {13: "d"}, "d": {14: "e", 15: "e"}},
                               "a", ["e"], V, drop_ids=(0,))
    con = auto.constraint().prepare(V, (0,), 16, 4)
    rows = [[7, 10, 12, 13, 14, 9, 7],  # the copy is allowed up to 9, then EOS is forced
            [7, 20, 21, 7],  # forbidden at once where two tokens are allowed: nothing
            [7, 11, 30, 7],  # 11 copied, 30 forbidden: 12, 13 forced, then two choices
            [5, 6]]  # no match, from state b: 12, 13 forced
    starts = [auto.walk([]), auto.walk([]), auto.walk([]), auto.walk([10])]
    c = dataclasses.replace(ctx(rows), constraint=con, cstate=AutomatonState(node=(jnp.asarray(starts, jnp.int32),)))
    tree, _, _ = PromptLookupDrafter(num_nodes=8).propose((), c, GREEDY)
    toks, par, val = np_tree(tree)
    np.testing.assert_array_equal(val.sum(axis=1), [5, 0, 3, 2])
    assert (val[:, :-1] >= val[:, 1:]).all()  # valid nodes are a prefix of the chain
    np.testing.assert_array_equal(toks[0, :5], [10, 12, 13, 14, 0])
    np.testing.assert_array_equal(toks[2, :3], [11, 12, 13])
    np.testing.assert_array_equal(toks[3, :2], [12, 13])
    plain_toks, plain_val = map(np.asarray, PromptLookupDrafter(num_nodes=8).lookup(*hist(rows)))
    for d, cc in ((PromptLookupDrafter(num_nodes=8, forced=False), c), (PromptLookupDrafter(num_nodes=8), ctx(rows))):
        toks, _, val = np_tree(d.propose((), cc, GREEDY)[0])
        np.testing.assert_array_equal(val, plain_val)
        np.testing.assert_array_equal(toks[val], plain_toks[plain_val])
    with pytest.raises(ValueError, match="forced"):
        PromptLookupDrafter(forced=1)


def test_prompt_lookup_draft_length_by_match_size():
    d = PromptLookupDrafter(num_nodes=4, lengths=(1, 2, 4))
    assert d.verify_widths == (1, 2, 4)
    rows = [[1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 2, 3],  # longest match: a 2-gram -> 2 tokens
            [4, 5, 6, 8, 5, 6, 1, 4, 5, 6],  # a 3-gram -> 4 tokens
            [7, 1, 8, 1],  # a 1-gram -> 1 token
            [1, 2, 3]]  # none
    tokens, valid = map(np.asarray, d.lookup(*hist(rows)))
    np.testing.assert_array_equal(valid.sum(axis=1), [2, 4, 1, 0])
    full, _ = map(np.asarray, PromptLookupDrafter(num_nodes=4).lookup(*hist(rows)))
    np.testing.assert_array_equal(tokens[valid], full[valid])  # the same tokens, fewer of them
    assert PromptLookupDrafter(num_nodes=4, min_ngram=2, lengths=(1, 2, 2)).verify_widths == (2, 4)
    for bad in [(1, 2), (1, 2, 5), (0, 1, 2), "124"]:
        with pytest.raises(ValueError, match="lengths"):
            PromptLookupDrafter(num_nodes=4, lengths=bad)


def test_aggressive_alignment_rule():
    d = AggressiveDrafter(num_nodes=4)
    prompt = [10, 11, 12, 13, 14, 10, 15]
    plen = jnp.full((4,), len(prompt), jnp.int32)
    state = d.init(jnp.asarray([prompt] * 4), plen, 64, None)
    rows = [prompt,  # no output yet: copy the prompt from its first token
            prompt + [11, 12],  # [12] occurs once in the input -> continue after it
            prompt + [20, 10],  # [10] twice, [20, 10] nowhere -> no new alignment: previous offset
            prompt + [13]]  # [13] once -> input index 4
    tree, _, new_state = d.propose(state, ctx(rows), GREEDY)
    toks, _, val = np_tree(tree)
    np.testing.assert_array_equal(toks[0], [10, 11, 12, 13])
    np.testing.assert_array_equal(toks[1], [13, 14, 10, 15])
    np.testing.assert_array_equal(toks[2], [12, 13, 14, 10])  # output index 2 -> input index 2
    np.testing.assert_array_equal(toks[3], [14, 10, 15, 0])
    np.testing.assert_array_equal(val[3], [True, True, True, False])  # past the end of the input
    np.testing.assert_array_equal(np.asarray(new_state.offset), [0, 1, 0, 3])
    # The alignment persists: one more output token later, row 3 drafts from input index 5.
    tree, _, _ = d.propose(new_state, ctx([prompt, prompt, prompt, prompt + [13, 99]]), GREEDY)
    np.testing.assert_array_equal(np.asarray(tree.tokens)[3, :2], [10, 15])


def test_ngram_config_errors():
    with pytest.raises(ValueError, match="num_nodes"):
        PromptLookupDrafter(num_nodes=0)
    with pytest.raises(ValueError, match="min_ngram .* <= max_ngram"):
        PromptLookupDrafter(num_nodes=4, max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="max_ngram"):
        AggressiveDrafter(num_nodes=4, max_ngram=0)


# ================================================================= token recycling
def test_recycling_template_and_config():
    assert len(DEFAULT_TEMPLATE) == 48 and max(map(len, DEFAULT_TEMPLATE)) == 6
    assert set(DEFAULT_TEMPLATE) >= {p[:i] for p in DEFAULT_TEMPLATE for i in range(1, len(p) + 1)}
    assert recycling_template(3, topk=2, max_depth=2) == ((0,), (1,), (0, 0))
    d = TokenRecyclingDrafter(vocab_size=V)
    assert d.num_nodes == 48 and d.max_depth == 6 and not d.is_chain and d.topk == 8
    with pytest.raises(ValueError, match="rank 3 .* topk=2"):
        TokenRecyclingDrafter(vocab_size=V, topk=2, template=((0,), (3,)))
    with pytest.raises(ValueError, match="bad template"):
        TokenRecyclingDrafter(vocab_size=V, template=((0,), (0, 0, 0)))
    with pytest.raises(ValueError, match="table must have shape"):
        TokenRecyclingDrafter(vocab_size=V, table=jnp.zeros((V, 3), jnp.int32))


def test_recycling_propose_and_observe_update():
    template = ((0,), (1,), (0, 0), (0, 1), (1, 0))  # nodes: 0=(0) 1=(1) 2=(0,0) 3=(0,1) 4=(1,0)
    table = np.full((V, 2), -1, np.int32)
    table[5] = [6, 7]
    table[6] = [8, -1]  # only one known candidate after 6
    d = TokenRecyclingDrafter(vocab_size=V, topk=2, template=template, prime_from_prompt=False,
                              table=jnp.asarray(table))
    state = jax.jit(d.init, static_argnums=2)(jnp.asarray([[1, 5], [1, 9]]), jnp.asarray([2, 2]), 64, None)
    assert state.table.dtype == jnp.int16 and state.table.shape == (2, V, 2)  # V fits int16
    tree, probs, state = jax.jit(d.propose, static_argnums=2)(state, ctx([[1, 5], [1, 9]]), GREEDY)
    toks, par, val = np_tree(tree)
    np.testing.assert_array_equal(par[0], [-1, -1, 0, 0, 1])
    np.testing.assert_array_equal(toks[0][val[0]], [6, 7, 8])  # 5 -> 6, 7; 6 -> 8; 6's rank 1 unknown
    np.testing.assert_array_equal(val[0], [True, True, True, False, False])
    assert not val[1].any()  # 9 has no candidates: the whole tree is invalid
    assert probs is None

    # Observe: every valid slot's token gets the top-2 of its logits; duplicates: the last slot wins.
    n = tree.tokens.shape[1]
    logits = np.zeros((2, n + 1, V), np.float32)
    def put(b, s, first, second):
        logits[b, s, first], logits[b, s, second] = 2.0, 1.0
    put(0, 0, 30, 31)  # root 5
    put(0, 1, 32, 33)  # node 0 = 6
    put(0, 2, 34, 35)  # node 1 = 7
    put(0, 3, 36, 37)  # node 2 = 8
    put(1, 0, 40, 41)  # row 1: root 9 only
    dup = Tree(tokens=tree.tokens.at[0, 2].set(6), parents=tree.parents, valid=tree.valid)  # 6 twice
    obs = Observation(tree=dup, path=jnp.full((2, n), -1), num_accepted=jnp.zeros(2, jnp.int32),
                      bonus=jnp.zeros(2, jnp.int32), target_logits=jnp.asarray(logits),
                      history=hist([[1, 5, 30], [1, 9, 40]])[0], hist_len=jnp.asarray([3, 3]),
                      active=jnp.asarray([True, True]))
    observe = jax.jit(d.observe)
    m = np.asarray(observe(state, obs).table)
    np.testing.assert_array_equal(m[0, 5], [30, 31])
    np.testing.assert_array_equal(m[0, 6], [36, 37])  # node 2 (later slot) overrides node 0
    np.testing.assert_array_equal(m[0, 7], [34, 35])
    np.testing.assert_array_equal(m[1, 9], [40, 41])
    np.testing.assert_array_equal(m[1, 5], [6, 7])  # rows are independent
    # Inactive rows and invalid nodes write nothing.
    m2 = np.asarray(observe(state, dataclasses.replace(obs, active=jnp.asarray([True, False]))).table)
    np.testing.assert_array_equal(m2[1, 9], [-1, -1])


def test_recycling_primes_from_prompt():
    d = TokenRecyclingDrafter(vocab_size=V, topk=2, template=((0,), (0, 0), (0, 0, 0)))
    state = d.init(jnp.asarray([[3, 4, 3, 5, 0]]), jnp.asarray([4]), 64, None)
    m = np.asarray(state.table)[0]
    np.testing.assert_array_equal(m[3], [5, -1])  # last occurrence of 3 in the prompt is followed by 5
    np.testing.assert_array_equal(m[4], [3, -1])
    assert (m[5] == -1).all() and (m[0] == -1).all()  # the padding is not read
    tree, _, _ = d.propose(state, ctx([[3, 4, 3, 5, 0][:4] + [3]]), GREEDY)
    toks, _, val = np_tree(tree)
    np.testing.assert_array_equal(val[0], [True, False, False])
    np.testing.assert_array_equal(toks[0, :1], [5])


# ================================================================= ADED
def test_aded_table_counts_and_backoff():
    d = ADEDDrafter(vocab_size=V, table_size=512, topk=3)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 3]
    state = jax.jit(d.init, static_argnums=2)(jnp.asarray([prompt, prompt[:3] + [0] * 6]),
                                              jnp.asarray([9, 3]), 64, None)
    lookup = jax.jit(table_lookup, static_argnums=3)
    look = lambda a, b, st=state: [np.asarray(x) for x in lookup(st.table, jnp.asarray(a),  # noqa: E731
                                                                 jnp.asarray(b), V)]
    toks, probs = look([1, 1], [2, 2])
    np.testing.assert_array_equal(toks[0], [3, 4, -1])  # (1, 2) -> 3 twice, 4 once
    np.testing.assert_allclose(probs[0], [2 / 3, 1 / 3, 0])
    np.testing.assert_array_equal(toks[1], [3, -1, -1])  # row 1 only saw its own prompt [1, 2, 3]
    toks, probs = look([7, 7], [2, 2])  # unknown tri-gram context: back off to the bi-gram "2 ->"
    np.testing.assert_array_equal(toks[0], [3, 4, -1])
    toks, _ = look([V, V], [3, 9])  # bi-gram 3 -> 1; 9 unseen
    np.testing.assert_array_equal(toks[0, :1], [1])
    assert (toks[1] == -1).all()
    np.testing.assert_array_equal(np.asarray(state.seen), [9, 3])

    # observe counts exactly the newly committed tokens of active rows.
    h, n = hist([prompt + [1, 2, 4], prompt[:3] + [5]], width=16)
    n_nodes = d.num_nodes
    obs = Observation(tree=Tree(jnp.zeros((2, n_nodes), jnp.int32), jnp.full((2, n_nodes), -1),
                                jnp.zeros((2, n_nodes), bool)),
                      path=jnp.full((2, n_nodes), -1), num_accepted=jnp.zeros(2, jnp.int32),
                      bonus=jnp.zeros(2, jnp.int32), target_logits=jnp.zeros((2, n_nodes + 1, V)),
                      history=h, hist_len=n, active=jnp.asarray([True, False]))
    new = jax.jit(d.observe)(state, obs)
    toks, probs = look([1, 2], [2, 3], new)
    np.testing.assert_allclose(probs[0], [0.5, 0.5, 0])  # (1, 2): 3 twice, 4 twice now
    assert (toks[1] == -1).all()  # row 1 was inactive: (2, 3) -> 5 not counted
    np.testing.assert_array_equal(np.asarray(new.seen), [12, 3])


def test_aded_space_saving_and_bucket_takeover():
    d = ADEDDrafter(vocab_size=V, table_size=1, topk=2)  # one bucket: every context collides
    tab = d.empty_table(1)
    one = lambda x: jnp.asarray([x])  # noqa: E731
    for nxt in (5, 5, 6, 7):  # 7 replaces the smallest count (6: 1) and gets 1 + 1
        tab = table_add(tab, one(1), one(2), one(nxt), one(True), 1.0)
    np.testing.assert_array_equal(np.asarray(tab.tokens)[0, 0], [5, 7])
    np.testing.assert_array_equal(np.asarray(tab.counts)[0, 0], [2, 2])
    tab = table_add(tab, one(3), one(4), one(9), one(True), 1.0)  # another context takes the bucket
    toks, _ = table_lookup(tab, one(1), one(2), V)
    assert (np.asarray(toks) == -1).all()  # never mixes contexts
    toks, _ = table_lookup(tab, one(3), one(4), V)
    np.testing.assert_array_equal(np.asarray(toks)[0], [9, -1])
    decayed = table_add(d.empty_table(1), one(1), one(2), one(5), one(True), 0.5)
    decayed = table_add(decayed, one(1), one(2), one(5), one(True), 0.5)
    np.testing.assert_allclose(np.asarray(decayed.counts)[0, 0], [1.5, 0])


def test_aded_mcts_search():
    # A fixed model: after token t the candidates are t+1 (p=0.7) and t+2 (p=0.3); after 50 nothing.
    def lookup(a, b):
        toks = jnp.stack([b + 1, b + 2], axis=1)
        toks = jnp.where(b[:, None] >= 50, -1, toks)
        probs = jnp.where(toks >= 0, jnp.asarray([[0.7, 0.3]]), 0.0)
        return toks.astype(jnp.int32), probs

    search = jax.jit(lambda root, c: mcts_tree(lookup, root, jnp.full_like(root, V), num_nodes=6,
                                                max_depth=3, c_puct=c), static_argnums=1)
    tree, reward = search(jnp.asarray([10, 49, 50]), 1.0)
    assert_tree_ok(tree, 3)
    toks, par, val = np_tree(tree)
    np.testing.assert_array_equal(val[0], [True] * 6)
    assert toks[0, 0] == 11  # the first simulation takes the most likely child
    d0 = np.asarray(depths(tree.parents))[0]
    chain = [toks[0, i] for i in range(6) if d0[i] == 3]
    assert 13 in chain  # the greedy path 11 -> 12 -> 13 is explored to the depth limit
    # Rewards are path probabilities: each child's is its parent's times its own probability.
    r = np.asarray(reward)[0]
    for i in range(6):
        parent_r = 1.0 if par[0, i] < 0 else r[par[0, i]]
        step = 0.7 if toks[0, i] == (toks[0, par[0, i]] if par[0, i] >= 0 else 10) + 1 else 0.3
        np.testing.assert_allclose(r[i], parent_r * step, rtol=1e-6)
    # Row 1: 49 -> 50, 51 and nothing after them: only 2 nodes exist. Row 2: no candidates at all.
    np.testing.assert_array_equal(val[1], [True, True, False, False, False, False])
    assert sorted(toks[1, :2]) == [50, 51]
    assert not val[2].any()


def test_aded_mcts_balances_exploration():
    probs = jnp.asarray([[0.55, 0.25, 0.15, 0.05]])

    def lookup(a, b):  # after t: t+1 .. t+4 with fixed probabilities
        toks = (b[:, None] + jnp.arange(1, 5)[None, :]).astype(jnp.int32)
        return toks, jnp.broadcast_to(probs, toks.shape)

    search = jax.jit(lambda r, c: mcts_tree(lookup, r, jnp.full_like(r, V), num_nodes=10, max_depth=4,
                                            c_puct=c))

    def run(c):  # c_puct traced: one compilation for the three settings
        tree, reward = search(jnp.asarray([10]), jnp.float32(c))
        assert_tree_ok(tree, 4)
        return np.asarray(tree.parents)[0], float(np.asarray(reward).sum())

    greedy_par, greedy_r = run(0.0)  # no exploration bonus: depth first down the likeliest child
    balanced_par, balanced_r = run(1.0)
    wide_par, _ = run(50.0)
    assert (greedy_par < 0).sum() == 1
    # A larger c_puct tries more siblings (here: root children).
    assert (wide_par < 0).sum() >= (balanced_par < 0).sum() > (greedy_par < 0).sum()
    # The reward (sum of path probabilities = expected accepted tokens under the tri-gram model) of
    # the balanced search is close to the best possible 10-node tree (best-first: 1.95).
    assert balanced_r > 0.97 * 1.95 > greedy_r


def test_aded_config_errors():
    with pytest.raises(ValueError, match="table_size"):
        ADEDDrafter(vocab_size=V, table_size=0)
    with pytest.raises(ValueError, match="decay"):
        ADEDDrafter(vocab_size=V, decay=0.0)
    with pytest.raises(ValueError, match="c_puct"):
        ADEDDrafter(vocab_size=V, c_puct=-1.0)
    with pytest.raises(ValueError, match="token ids"):
        ADEDDrafter(vocab_size=V, table_size=16).fit_corpus([[1, V]])
    prior = ADEDDrafter(vocab_size=V, table_size=64, topk=2).fit_corpus([[1, 2, 3], [1, 2, 3]])
    state = prior.init(jnp.asarray([[7, 8]]), jnp.asarray([2]), 64, None)
    toks, probs = table_lookup(state.table, jnp.asarray([1]), jnp.asarray([2]), V)
    np.testing.assert_array_equal(np.asarray(toks)[0], [3, -1])  # corpus counts start the table
    toks, _ = table_lookup(state.table, jnp.asarray([V]), jnp.asarray([3]), V)
    assert (np.asarray(toks) == -1).all()  # no context reaches across the two sequences


# ================================================================= DySpec
def fake_expand(scorer_state, start, tokens, parents_all):
    """Draft distribution after token t: mass on t+1 (0.6), t+2 (0.3), t+3 (0.1)."""
    v = 40
    base = jnp.full(tokens.shape + (v,), 1e-9)
    for off, p in ((1, 0.6), (2, 0.3), (3, 0.1)):
        base = base + p * jax.nn.one_hot((tokens + off) % v, v)
    return jnp.log(base / base.sum(-1, keepdims=True)), scorer_state + 1


def best_n_paths(n, k, root_q):
    """Brute force: the n highest path probabilities of the fake model (top-k children)."""
    import heapq
    items, heap = [], [(-p, (t,)) for t, p in root_q[:k]]
    heapq.heapify(heap)
    while len(items) < n:
        negp, path = heapq.heappop(heap)
        items.append(-negp)
        for off, p in ((1, 0.6), (2, 0.3), (3, 0.1))[:k]:
            heapq.heappush(heap, (negp * p, path + (path[-1] + off,)))
    return sorted(items, reverse=True)


def test_dyspec_greedy_expansion():
    root = jnp.log(jnp.asarray([[0.5, 0.3, 0.2] + [1e-9] * 37]))
    for per_round, max_depth in ((1, 0), (3, 2)):
        b = DySpecBuilder(num_nodes=7, topk=2, per_round=per_round, max_depth=max_depth)
        assert b.max_depth == (7 if per_round == 1 else 2)  # default: one level per round at most
        tree, slots, calls = jax.jit(lambda r: b.build(0, r, fake_expand, None))(root)
        assert calls == len(b.schedule) - 1  # one draft forward per round but the last
        assert_tree_ok(tree, b.max_depth)
        toks, par, val = np_tree(tree)
        # With depth <= 2 and topk = 2 only 2 + 4 nodes exist: the 7th is invalid.
        assert val.sum() == (7 if per_round == 1 else 6)
        if per_round == 1:  # exactly the paper's one-at-a-time greedy = the best 7 paths
            pp = []  # path probability of each node under the fake model
            for i in range(7):
                step = ([0.5, 0.3, 0.2][toks[0, i]] if par[0, i] < 0 else
                        pp[par[0, i]] * {1: 0.6, 2: 0.3, 3: 0.1}[(toks[0, i] - toks[0, par[0, i]]) % 40])
                pp.append(step)
            np.testing.assert_allclose(sorted(pp, reverse=True),
                                       best_n_paths(7, 2, [(0, 0.5), (1, 0.3), (2, 0.2)]), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(slots)[0, 0].sum(), 1.0, rtol=1e-5)
    # Zero-probability candidates become invalid nodes.
    point = jnp.log(jnp.asarray([[1.0] + [0.0] * 39]))
    b = DySpecBuilder(num_nodes=4, topk=2)
    tree, _, _ = jax.jit(lambda r: b.build(0, r, fake_expand, None))(point)
    np.testing.assert_array_equal(np.asarray(tree.valid)[0], [True, False, True, True])
    # The first round cannot take more than the root's topk candidates.
    assert DySpecBuilder(num_nodes=7, topk=2, per_round=3).schedule == (2, 3, 2)
    assert DySpecBuilder(num_nodes=3, topk=1).schedule == (1, 1, 1)
    with pytest.raises(TreeError, match="per_round"):
        DySpecBuilder(num_nodes=2, topk=2, per_round=3)
    with pytest.raises(TreeError, match="topk"):
        DySpecBuilder(num_nodes=4, topk=0)


# ================================================================= through the engine
def tiny(seed=0, layers=2):
    cfg = ModelConfig(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=64,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=256, sliding_windows=(0,) * layers)
    return cfg, init_params(cfg, jax.random.PRNGKey(seed), std=0.3)


PROMPTS = [[3, 9, 27, 4, 1, 7, 7, 2], [8, 2], [5, 5, 5], [60, 1, 33, 7, 11]]
NEW = 20


def cycle_of(row):
    """The repeating tail of a greedy output row (shortest period that repeats twice)."""
    for p in range(1, len(row) // 2):
        if list(row[-p:]) == list(row[-2 * p:-p]):
            return list(row[-p:])
    raise AssertionError(f"no cycle in {row}")


@pytest.fixture(scope="module")
def setup():
    cfg, params = tiny()
    # Without attention output the model maps the current token to the next one: greedy decoding
    # falls into short cycles, so copied / recycled / counted drafts are really accepted.
    rep = {**params, "layers": {**params["layers"], "wo": params["layers"]["wo"] * 0}}
    # Draft model for DySpec: the target's first layer only (a different, weaker model).
    dcfg = cfg.replace(num_layers=1, sliding_windows=(0,))
    dparams = {**params, "layers": jax.tree_util.tree_map(lambda x: x[:1], params["layers"])}
    random_prompts = pad_prompts(PROMPTS)
    ref_rep = decode(cfg, rep, *random_prompts, max_new_tokens=NEW, sampler=GREEDY, method="greedy")
    # Repetitive prompts: each row repeats a cycle of the model a whole number of times, so the text
    # after it continues the prompt from its start (what aggressive decoding copies). Width 8 as the
    # random prompts, so the same compiled program serves both.
    cycles = [cycle_of(r) for r in np.asarray(ref_rep.tokens)]
    rep_rows = [c * (8 // len(c)) for c in cycles]
    assert max(map(len, rep_rows)) == 8, cycles
    return dict(cfg=cfg, params=params, rep=rep, dcfg=dcfg, dparams=dparams,
                random=random_prompts, repetitive=pad_prompts(rep_rows))


def make(name, s, params):
    if name == "prompt_lookup":
        return PromptLookupDrafter(num_nodes=6)
    if name == "prompt_lookup_adaptive":  # draft length by match size; verification shrinks to fit
        return PromptLookupDrafter(num_nodes=6, lengths=(2, 4, 6))
    if name == "aggressive":
        return AggressiveDrafter(num_nodes=8)
    if name == "recycling":
        return TokenRecyclingDrafter(vocab_size=V, topk=4, template=recycling_template(12, topk=4,
                                                                                       max_depth=4))
    if name == "aded":
        return ADEDDrafter(vocab_size=V, num_nodes=8, max_depth=4, table_size=256, topk=4)
    if name == "aded_small":  # fewer nodes than the default depth (6): the depth is capped at num_nodes
        d = ADEDDrafter(vocab_size=V, num_nodes=3, table_size=256, topk=4)
        assert d.max_depth == 3
        return d
    if name == "retrieval":  # a datastore of the model's own greedy output on other prompts
        return RetrievalDrafter(table=datastore(s["cfg"], params), num_nodes=6, history_ngram=4)
    if name == "dyspec":  # the target as its own draft model
        return DraftLM(params=params, config=s["cfg"], builder=DySpecBuilder(num_nodes=8, topk=3))
    if name == "dyspec_other":  # a separate, weaker draft model: drafts get rejected too
        return DraftLM(params=s["dparams"], config=s["dcfg"], builder=DySpecBuilder(num_nodes=8, topk=3))
    raise KeyError(name)


DRAFTERS = ["prompt_lookup", "prompt_lookup_adaptive", "aggressive", "recycling", "aded", "retrieval", "dyspec"]


def datastore(cfg, params):
    """A retrieval table of the model's greedy continuations of 16 random prompts (not the tests')."""
    prompts = np.random.default_rng(7).integers(1, V, size=(16, 4))
    out = decode(cfg, params, jnp.asarray(prompts, jnp.int32), jnp.full((16,), 4, jnp.int32), max_new_tokens=12,
                 sampler=GREEDY, method="greedy")
    rows = np.concatenate([prompts, np.asarray(out.tokens)], axis=1)
    return build_table(rows, starts=np.full(16, 4), max_order=4)[0]


@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_exact_batch4_random_and_repetitive(setup, name):
    s = setup
    for kind, params, (prompts, lengths) in (("random", s["params"], s["random"]),
                                            ("repetitive", s["rep"], s["repetitive"])):
        ref = decode(s["cfg"], params, prompts, lengths, max_new_tokens=NEW, sampler=GREEDY,
                     method="greedy")
        out = speculative_decode(s["cfg"], params, make(name, s, params), prompts, lengths,
                                 max_new_tokens=NEW, verifier=get_verifier("greedy"))
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens), err_msg=kind)
        np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
        tau = np.asarray(out.stats["tau"])
        assert np.all(tau >= 1.0)
        if kind == "repetitive":  # drafts are accepted: clearly more than one token per target call
            assert float(tau.min()) > 1.5, (name, tau)


@pytest.mark.parametrize("name", DRAFTERS[:-1] + ["dyspec_other", "aded_small"])
def test_greedy_exact_batch1(setup, name):
    s = setup
    prompts, lengths = pad_prompts(PROMPTS[:1])
    ref = decode(s["cfg"], s["params"], prompts, lengths, max_new_tokens=NEW, sampler=GREEDY,
                 method="greedy")
    out = speculative_decode(s["cfg"], s["params"], make(name, s, s["params"]), prompts, lengths,
                             max_new_tokens=NEW, verifier=get_verifier("greedy"))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))


# Aggressive decoding verifies exactly like prompt lookup (a copied chain): one of them suffices here.
@pytest.mark.parametrize("name", ["prompt_lookup", "prompt_lookup_adaptive", "recycling", "aded", "retrieval",
                                  "dyspec_other"])
def test_point_mass_sampling_runs_and_is_reproducible(setup, name):
    s = setup
    prompts, lengths = s["random"]
    drafter = make(name, s, s["params"])
    run = lambda seed: speculative_decode(  # noqa: E731
        s["cfg"], s["params"], drafter, prompts, lengths, max_new_tokens=NEW,
        verifier=get_verifier("point_mass"), sampler=SamplerConfig(temperature=0.8),
        key=jax.random.PRNGKey(seed))
    a, b, c = run(1), run(1), run(2)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    toks = np.asarray(a.tokens)
    assert toks.min() >= 0 and toks.max() < V
    np.testing.assert_array_equal(np.asarray(a.lengths), [NEW] * 4)
    assert np.all(np.asarray(a.stats["tau"]) >= 1.0)


@pytest.mark.parametrize("sizes", [(), (3,), (1,), (2, 3)])
def test_draft_lm_catches_up_over_several_blocks(setup, sizes):
    """A draft LM left behind by steps that drafted nothing (the adaptive policy's plain steps) catches
    up on all the committed tokens it missed, a padded block of up to max_depth + 1 per forward (any
    block lengths: `catch_up_sizes`), and then proposes exactly what it proposes from a cache prefilled
    with the same history; rows lagging by different amounts (here 2, 6 and 12 tokens against blocks of
    at most 3) end up alike."""
    s = setup
    drafter = DraftLM(params=s["dparams"], config=s["dcfg"], builder=parse_tree_spec("chain:2"),
                      catch_up_sizes=sizes)
    rows = [[3, 9, 27, 4, 1, 7, 7, 2, 5, 8, 13, 21, 34, 55], [8, 2, 6, 1, 9, 4, 4, 3, 2, 1, 0, 5, 6, 7],
            [5, 5, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
    history = jnp.asarray(rows, jnp.int32)
    start = jnp.asarray([13, 9, 3], jnp.int32)  # init saw start - 1 tokens; the pending root is at start - 1
    full = jnp.full((3,), 14, jnp.int32)
    key = jax.random.PRNGKey(0)
    lagging = drafter.init(history, start, 32, key)
    fresh = drafter.init(history, full, 32, key)  # prefilled with all but the last token
    ctx = DraftContext(history=history, hist_len=full, key=key)
    tree_a, probs_a, cache_a = drafter.propose(lagging, ctx, GREEDY)
    tree_b, probs_b, cache_b = drafter.propose(fresh, ctx, GREEDY)
    np.testing.assert_array_equal(np.asarray(cache_a.lengths), np.asarray(full))
    np.testing.assert_array_equal(np.asarray(tree_a.tokens), np.asarray(tree_b.tokens))
    if probs_b is not None:
        np.testing.assert_allclose(np.asarray(probs_a), np.asarray(probs_b), atol=1e-5)


def test_catch_up_runs_the_smallest_block_that_holds_what_the_furthest_row_lacks():
    """catch_up_blocks sizes each forward to the row furthest behind (the largest width while it lacks
    more), so catching up on one accepted token costs a block of 2 rows, not max_depth + 1. The fake
    block counts the rows each forward runs."""
    def block(st, n):
        lengths, rows = st
        return jnp.ones((2, 1)), (jnp.minimum(lengths + n, target), rows + n)

    target = jnp.asarray([5, 7], jnp.int32)
    for start, widths, rows in (([4, 6], (1, 2, 4, 9), 1), ([4, 5], (1, 2, 4, 9), 2), ([4, 4], (1, 2, 4, 9), 4),
                                ([0, 7], (1, 2, 4, 9), 9), ([0, 0], (1, 2, 4, 9), 9), ([0, 0], (1, 2, 4, 5), 7),
                                ([4, 6], (9,), 9), ([0, 0], (3,), 9)):
        _, (lengths, ran) = jax.jit(lambda s: catch_up_blocks(block, s, lambda st: st[0], target, 1, widths,
                                                              root=jnp.zeros((2, 1))))(
            (jnp.asarray(start, jnp.int32), jnp.int32(0)))
        np.testing.assert_array_equal(np.asarray(lengths), np.asarray(target))
        assert int(ran) == rows, (start, widths, int(ran))
    assert catch_up_widths(9) == (2, 4, 9) and catch_up_widths(4) == (2, 4) and catch_up_widths(3) == (3,)
    assert catch_up_widths(17) == (2, 4, 8, 17) and catch_up_widths(1) == (1,)
    for bad in ((4, 2), (0, 3), (2, 2), (1, 5)):
        with pytest.raises(ValueError, match="catch_up_sizes must be ascending block lengths in 1..4"):
            check_catch_up_sizes(bad, max_depth=3)


def test_a_draft_lm_starts_from_acceptance_recorded_for_its_target(tmp_path):
    """A draft model's directory may record the target's held-out acceptance of its chain
    (acceptance.json): make_drafter hands it to the adaptive policy as its start, but only for the target
    whose weights it was measured on; a broken record is skipped with a warning, never an error."""
    import json

    import jaxdecode
    from jaxdecode.costmodel import params_digest
    from jaxdecode.drafters import make_drafter
    from jaxdecode.drafters.draft_lm import ACCEPTANCE_FILE

    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=64)
    target = jaxdecode.Model(config=cfg, params=init_params(cfg, jax.random.PRNGKey(0)))
    other = jaxdecode.Model(config=cfg, params=init_params(cfg, jax.random.PRNGKey(1)))
    draft = jaxdecode.Model(config=cfg, params=init_params(cfg, jax.random.PRNGKey(2)), path=str(tmp_path))
    assert make_drafter("draft_lm", target, draft=draft).acceptance_prior == ()  # nothing recorded

    record = tmp_path / ACCEPTANCE_FILE
    record.write_text(json.dumps({"target_params_sha256": params_digest(target.params),
                                  "accept_by_depth": [0.8, 0.9]}))
    assert make_drafter("draft_lm", target, draft=draft).acceptance_prior == (0.8, 0.9)
    assert make_drafter("draft_lm", other, draft=draft).acceptance_prior == ()  # measured on another target

    # Inside a caller's jit: traced weights cannot be fingerprinted (no prior, no error); concrete ones
    # closed over are, with the digest's sample taken eagerly (the sampled digest of large models).
    from jaxdecode import costmodel
    seen = []
    jax.jit(lambda p: seen.append(make_drafter("draft_lm", dataclasses.replace(target, params=p),
                                               draft=draft).acceptance_prior) or 0)(target.params)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(costmodel, "FULL_HASH_BYTES", 0)
        mp.setattr(costmodel, "SAMPLE_ELEMENTS", 64)
        copy = lambda: jax.tree.map(lambda a: a + 0, target.params)  # noqa: E731 - equal, not yet fingerprinted
        record.write_text(json.dumps({"target_params_sha256": params_digest(copy()), "accept_by_depth": [0.7]}))
        fresh = dataclasses.replace(target, params=copy())
        jax.jit(lambda: seen.append(make_drafter("draft_lm", fresh, draft=draft).acceptance_prior) or 0)()
    assert seen == [(), (0.7,)]

    for broken in ("{not json", json.dumps({"accept_by_depth": [0.8]}),
                   json.dumps({"target_params_sha256": params_digest(target.params), "accept_by_depth": [1.5]})):
        record.write_text(broken)
        with pytest.warns(UserWarning, match="not a draft acceptance record"):
            assert make_drafter("draft_lm", target, draft=draft).acceptance_prior == ()


def test_the_embedded_draft_records_its_acceptance_for_the_embedded_target():
    import jaxdecode
    from jaxdecode.drafters import make_drafter

    target, draft = jaxdecode.load(), jaxdecode.load("draft")
    prior = make_drafter("draft_lm", target, draft=draft).acceptance_prior
    assert len(prior) == 4 and all(0.5 < a <= 1.0 for a in prior)


def test_documented_tree_specs_and_the_default_dynamic_tree_are_valid():
    """Every tree spec the `tree` option's text shows parses, and so do the EAGLE-2 builder's defaults and
    partial specs over them (the shown eagle:depth=5,topk=8,total=48 and the defaults were refused: 48 nodes
    out of 5 x 8 candidates)."""
    import re

    from jaxdecode.drafters.builders import DynamicTreeBuilder
    from jaxdecode.options import OPTIONS
    shown = re.findall(r"(?:chain|static|eagle|dyspec):[\w=,:]*\w", OPTIONS["tree"].doc)
    assert any(s.startswith("eagle:") for s in shown), shown
    for spec in [s for s in shown if not s.endswith(":N")] + ["eagle", "eagle:depth=3", "eagle:topk=4"]:
        parse_tree_spec(spec)
    assert DynamicTreeBuilder().total <= DynamicTreeBuilder().depth * DynamicTreeBuilder().topk
