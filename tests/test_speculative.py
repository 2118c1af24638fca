"""Speculative decoding engine: exactness against plain greedy, losslessness end to end, statistics,
bad input. Every drafter x tree x verifier pair is tested for losslessness in test_verifier_pairs.py;
the χ² tests here run real draft LMs."""
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters import DraftLM, StaticTreeBuilder, parse_tree_spec
from jaxdecode.models import ModelConfig, init_params
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import SpeculativeError, _acceptance_stats, speculative_decode
from jaxdecode.tree import Tree, TreeError
from jaxdecode.verifiers import get_verifier
from test_verifier_pairs import chi2_pvalue, exact_joint

GREEDY = SamplerConfig(temperature=0.0)


def tiny(vocab=64, layers=2, seed=0, std=0.3, d=32):
    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=d, intermediate_size=2 * d,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=d // 4,
                      max_position_embeddings=256, sliding_windows=(0,) * layers)
    return cfg, init_params(cfg, jax.random.PRNGKey(seed), std=std)


@pytest.fixture(scope="module")
def models():
    target = tiny()
    other = tiny(layers=1, seed=1)
    return target, other


PROMPTS_4 = [[3, 9, 27, 4, 1, 7, 7], [8, 2], [5, 5, 5], [60, 1, 33, 7]]
TREES = ["chain:4", "static:3,2,1", "eagle:depth=3,topk=3,total=7",
         StaticTreeBuilder.from_parents([-1, -1, 0, 0, 1, 2, 2])]


@pytest.mark.parametrize("tree", TREES, ids=lambda t: t if isinstance(t, str) else "parents")
def test_greedy_speculative_equals_greedy_self_draft_batch4(models, tree):
    (cfg, params), _ = models
    prompts, lengths = pad_prompts(PROMPTS_4)
    ref = decode(cfg, params, prompts, lengths, max_new_tokens=14, sampler=GREEDY, method="greedy")
    drafter = DraftLM(params=params, config=cfg, builder=parse_tree_spec(tree))
    out = speculative_decode(cfg, params, drafter, prompts, lengths, max_new_tokens=14,
                             verifier=get_verifier("greedy"))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    # A perfect (self) drafter accepts whole paths: more than one token per target call.
    assert float(np.min(out.stats["tau"])) > 1.5


@pytest.mark.parametrize("tree,batch", [("chain:3", 1), ("eagle:depth=3,topk=2,total=5", 4),
                                        ("static:2,2", 1),
                                        ("eagle:depth=5,topk=2,total=3", 1)])  # fewer nodes than levels
def test_greedy_speculative_equals_greedy_other_draft(models, tree, batch):
    (cfg, params), (dcfg, dparams) = models
    prompts, lengths = pad_prompts(PROMPTS_4[:batch])
    ref = decode(cfg, params, prompts, lengths, max_new_tokens=10, sampler=GREEDY, method="greedy")
    drafter = DraftLM(params=dparams, config=dcfg, builder=parse_tree_spec(tree))
    out = speculative_decode(cfg, params, drafter, prompts, lengths, max_new_tokens=10,
                             verifier=get_verifier("greedy"))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    s = out.stats
    assert int(s["target_calls"]) == int(np.max(s["verify_calls"])) + 1
    assert int(np.sum(s["accept_hist"])) == int(np.sum(s["verify_calls"]))


def test_eos_stops_rows_independently(models):
    (cfg, params), _ = models
    prompts, lengths = pad_prompts(PROMPTS_4)
    ref = decode(cfg, params, prompts, lengths, max_new_tokens=12, sampler=GREEDY, method="greedy")
    eos = int(np.asarray(ref.tokens)[0, 3])  # make row 0 stop at its 4th token
    ref = decode(cfg, params, prompts, lengths, max_new_tokens=12, sampler=GREEDY, method="greedy",
                 eos_ids=(eos,))
    drafter = DraftLM(params=params, config=cfg, builder=parse_tree_spec("chain:4"))
    out = speculative_decode(cfg, params, drafter, prompts, lengths, max_new_tokens=12,
                             verifier=get_verifier("greedy"), eos_ids=(eos,))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert int(out.lengths[0]) <= 4


# ----------------------------------------------------------------------------- losslessness
DRAWS = 100_000
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def small_vocab():
    target = tiny(vocab=6, layers=1, seed=3, std=0.6, d=16)
    draft = tiny(vocab=6, layers=1, seed=4, std=0.6, d=16)
    return target, draft


def joint_pvalue(cfg, params, drafter, verifier, temperature=1.0):
    prompts = np.tile(np.asarray(PROMPT, np.int32), (DRAWS, 1))
    lengths = np.full((DRAWS,), len(PROMPT), np.int32)
    out = speculative_decode(cfg, params, drafter, prompts, lengths, max_new_tokens=2,
                             verifier=verifier, sampler=SamplerConfig(temperature=temperature),
                             key=jax.random.PRNGKey(11))
    toks = np.asarray(out.tokens)
    return chi2_pvalue(toks, exact_joint(cfg, params, PROMPT, cfg.vocab_size)), out


# A draft LM's own distributions reach the verifier (the pair matrix uses table drafters); the lossy
# `typical` verifier failing the same χ² test is one of the matrix's negative controls.
@pytest.mark.parametrize("tree,verifier", [("chain:3:sample", "chain"), ("static:2,2:gumbel", "rsd")])
@pytest.mark.exec_bound  # 1e5 rows: running, not compiling (tests/conftest.py)
def test_sampling_speculative_matches_target_distribution(small_vocab, tree, verifier):
    (cfg, params), (dcfg, dparams) = small_vocab
    drafter = DraftLM(params=dparams, config=dcfg, builder=parse_tree_spec(tree))
    p, out = joint_pvalue(cfg, params, drafter, get_verifier(verifier))
    assert p > 1e-4, f"{verifier} on {tree}: chi2 p-value {p:.2e}"
    assert float(np.mean(out.stats["tau"])) > 1.0  # drafts were accepted, not only bonus tokens


# ----------------------------------------------------------------------------- statistics
def _tree(parents, valid=None, n_rows=1):
    parents = np.tile(np.asarray(parents, np.int32), (n_rows, 1))
    valid = np.ones(parents.shape, bool) if valid is None else np.tile(np.asarray(valid, bool), (n_rows, 1))
    return Tree(tokens=jnp.zeros(parents.shape, jnp.int32), parents=jnp.asarray(parents), valid=jnp.asarray(valid))


def test_acceptance_stats_hand_built_trees():
    """Depth d is tried only when the committed node at depth d-1 has a valid child; only committed
    nodes count. Tree:  root -> 0 -> 2 -> 4  and  root -> 1 -> 3  (depths 1, 1, 2, 2, 3)."""
    parents = [-1, -1, 0, 1, 2]
    full = [1, 1, 1, 1, 1]
    # (valid, path, num_accepted, committed, active) -> (hist over 0..3, tried [3], accepted [3])
    cases = [
        (full, [1], 1, 1, True, [0, 1, 0, 0], [1, 1, 0], [1, 0, 0]),  # node 1's child 3 rejected
        (full, [0, 2, 4], 3, 3, True, [0, 0, 0, 1], [1, 1, 1], [1, 1, 1]),
        (full, [0, 2, 4], 3, 1, True, [0, 1, 0, 0], [1, 0, 0], [1, 0, 0]),  # EOS at node 0: rest dropped
        (full, [], 0, 0, True, [1, 0, 0, 0], [1, 0, 0], [0, 0, 0]),
        (full, [0, 2], 2, 2, False, [0, 0, 0, 0], [0, 0, 0], [0, 0, 0]),  # inactive row
        # accepted node 1 has no valid child; a node at depth 2 exists elsewhere (node 2)
        ([1, 1, 1, 0, 1], [1], 1, 1, True, [0, 1, 0, 0], [1, 0, 0], [1, 0, 0]),
        ([0, 0, 0, 0, 0], [], 0, 0, True, [1, 0, 0, 0], [0, 0, 0], [0, 0, 0]),  # nothing drafted
        ([1, 1, 1, 1, 0], [0, 2], 2, 2, True, [0, 0, 1, 0], [1, 1, 0], [1, 1, 0]),  # leaf node 2
    ]
    for valid, path, num, committed, active, hist, tried, accepted in cases:
        p = jnp.asarray([path + [-1] * (5 - len(path))], jnp.int32)
        got = _acceptance_stats(_tree(parents, valid), p, jnp.asarray([num]), jnp.asarray([committed]),
                                jnp.asarray([active]), 3)
        got = (got[0].sum(0), got[1].sum(0), got[2].sum(0))  # per row -> counts
        assert [np.asarray(g).tolist() for g in got] == [hist, tried, accepted], (valid, path, committed)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FixedTreeDrafter:
    """Proposes the same hand-made tree for each row at every step (point masses)."""
    tokens: jax.Array  # int32[B, N]
    parents: jax.Array  # int32[B, N]
    max_depth: int = dataclasses.field(metadata=dict(static=True))
    child_rule = "point"
    is_chain = False
    num_nodes = property(lambda self: self.tokens.shape[1])

    def init(self, prompt_tokens, prompt_lengths, cache_len, key):
        return jnp.zeros((), jnp.int32)

    def propose(self, state, ctx, sampler):
        return Tree(tokens=self.tokens, parents=self.parents, valid=jnp.ones(self.tokens.shape, bool)), None, state

    def observe(self, state, obs):
        return state


def test_engine_stats_count_committed_nodes_of_the_accepted_branch(models):
    """Greedy verification of hand-made trees built from each row's greedy continuation g1 g2 g3:
    row 0: chain g1 g2 g3, all accepted, but g1 is an EOS: one node committed;
    row 1: root -> {g1, x -> y}: g1 accepted, it has no child (its sibling has): depth 2 not tried;
    row 2: chain g1 g2 g3, all accepted, max_new_tokens = 2 commits two;
    row 3: root -> g1 -> {z, g2}: two accepted, g2 is a leaf;
    row 4: root -> g1 -> {z, w}, both wrong: depth 2 tried, not accepted."""
    (cfg, params), _ = models
    prompts, lengths = pad_prompts(PROMPTS_4 + PROMPTS_4[3:])
    g = np.asarray(decode(cfg, params, prompts, lengths, max_new_tokens=3, sampler=GREEDY,
                          method="greedy").tokens)
    eos = int(g[0, 0])
    assert eos not in g[1:, :2]  # only row 0 stops at an EOS
    z, w = (g[3:, 1] + 1) % 64, (g[3:, 1] + 2) % 64
    tokens = np.array([g[0], [g[1, 0], (g[1, 0] + 1) % 64, 0], g[2], [g[3, 0], z[0], g[3, 1]],
                       [g[4, 0], z[1], w[1]]], np.int32)
    parents = np.array([[-1, 0, 1], [-1, -1, 1], [-1, 0, 1], [-1, 0, 0], [-1, 0, 0]], np.int32)
    drafter = FixedTreeDrafter(tokens=jnp.asarray(tokens), parents=jnp.asarray(parents), max_depth=3)
    out = speculative_decode(cfg, params, drafter, prompts, lengths, max_new_tokens=2,
                             verifier=get_verifier("greedy"), eos_ids=(eos,))
    np.testing.assert_array_equal(np.asarray(out.lengths), [1, 2, 2, 2, 2])
    np.testing.assert_array_equal(np.asarray(out.tokens)[1:], g[1:, :2])
    s = out.stats
    np.testing.assert_array_equal(np.asarray(s["verify_calls"]), [1, 1, 1, 1, 1])
    # committed nodes per row: one step each
    np.testing.assert_array_equal(np.asarray(s["accept_hist"]), np.eye(4, dtype=int)[[1, 1, 2, 2, 1]])
    # tried [5, 3, 0] (depth 2: rows 2, 3, 4), accepted [5, 2, 0] (depth 2: rows 2, 3)
    np.testing.assert_allclose(np.asarray(s["accept_rate_by_depth"]), [1.0, 2 / 3, 0.0], rtol=1e-6)


# ----------------------------------------------------------------------------- bad input
def test_bad_input(models):
    (cfg, params), (dcfg, dparams) = models
    prompts, lengths = pad_prompts([[1, 2, 3]])
    greedy = get_verifier("greedy")
    wrong_vocab_cfg, wrong_vocab_params = tiny(vocab=32, layers=1)
    with pytest.raises(SpeculativeError, match="vocabulary"):
        speculative_decode(cfg, params, DraftLM(params=wrong_vocab_params, config=wrong_vocab_cfg,
                                                builder=parse_tree_spec("chain:2")),
                           prompts, lengths, max_new_tokens=4, verifier=greedy)
    drafter = DraftLM(params=dparams, config=dcfg, builder=parse_tree_spec("static:4,4"))
    with pytest.raises(SpeculativeError, match="no room"):
        speculative_decode(cfg, params, drafter, prompts, lengths, max_new_tokens=8, verifier=greedy,
                           cache_len=16)
    deeper = types.SimpleNamespace(num_nodes=8, max_depth=9, child_rule="argmax")  # a third-party drafter
    with pytest.raises(SpeculativeError, match=r"max_depth \(9\) must be in 1..num_nodes \(8\)"):
        speculative_decode(cfg, params, deeper, prompts, lengths, max_new_tokens=4, verifier=greedy)
    with pytest.raises(TreeError, match="cycle"):
        StaticTreeBuilder.from_parents([-1, 2, 1])
    with pytest.raises(TreeError, match="comes after its child"):
        StaticTreeBuilder.from_parents([-1, 2, -1])
    for name in ("chain", "specinfer", "point_mass"):
        with pytest.raises(SpeculativeError, match="temperature"):
            speculative_decode(cfg, params, DraftLM(params=dparams, config=dcfg,
                                                    builder=parse_tree_spec("chain:2:sample")),
                               prompts, lengths, max_new_tokens=4, verifier=get_verifier(name),
                               sampler=SamplerConfig(temperature=0.0))
    with pytest.raises(SpeculativeError, match="chains only"):
        speculative_decode(cfg, params, DraftLM(params=dparams, config=dcfg,
                                                builder=parse_tree_spec("static:2,2:sample")),
                           prompts, lengths, max_new_tokens=4, verifier=get_verifier("block"),
                           sampler=SamplerConfig(temperature=1.0))
    # RSD is lossless for children drawn without replacement, not for i.i.d. siblings (issue 9).
    with pytest.raises(SpeculativeError, match="'rsd' is lossless only for children chosen by gumbel"):
        speculative_decode(cfg, params, DraftLM(params=dparams, config=dcfg,
                                                builder=parse_tree_spec("static:2,2:sample")),
                           prompts, lengths, max_new_tokens=4, verifier=get_verifier("rsd"),
                           sampler=SamplerConfig(temperature=1.0))


def test_greedy_verifier_refuses_sampling(models):
    """verifier='greedy' at temperature > 0 would silently decode greedily: a clear error instead."""
    (cfg, params), (dcfg, dparams) = models
    prompts, lengths = pad_prompts([[1, 2, 3]])
    drafter = DraftLM(params=dparams, config=dcfg, builder=parse_tree_spec("chain:2:sample"))
    with pytest.raises(SpeculativeError, match=r"'greedy' decodes greedily.*temperature is 0.7.*specinfer"):
        speculative_decode(cfg, params, drafter, prompts, lengths, max_new_tokens=4,
                           verifier=get_verifier("greedy"), sampler=SamplerConfig(temperature=0.7))


def test_verify_widths_are_checked_and_change_nothing(models):
    from jaxdecode.drafters.ngram import PromptLookupDrafter
    cfg, params = models[0]
    prompts, lengths = pad_prompts([[5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 9, 3, 9]])
    drafter = PromptLookupDrafter(num_nodes=5)
    kw = dict(max_new_tokens=12, verifier=get_verifier("greedy"))
    full = speculative_decode(cfg, params, drafter, prompts, lengths, **kw)
    shrunk = speculative_decode(cfg, params, drafter, prompts, lengths, verify_widths=(1, 3), **kw)
    np.testing.assert_array_equal(np.asarray(full.tokens), np.asarray(shrunk.tokens))
    for bad in [(0, 5), (6,), (), "ab", "12", (True, 3)]:
        with pytest.raises(SpeculativeError, match="verify_widths"):
            speculative_decode(cfg, params, drafter, prompts, lengths, verify_widths=bad, **kw)


def test_gbv_needs_independent_chains(models):
    (cfg, params), (dcfg, dparams) = models
    prompts, lengths = pad_prompts([[1, 2, 3]])
    kw = dict(max_new_tokens=4, verifier=get_verifier("gbv"), sampler=SamplerConfig(temperature=1.0))
    with pytest.raises(SpeculativeError, match="gbv"):
        speculative_decode(cfg, params, DraftLM(params=dparams, config=dcfg,
                                                builder=parse_tree_spec("static:2,2:iid")),
                           prompts, lengths, **kw)
    out = speculative_decode(cfg, params, DraftLM(params=dparams, config=dcfg,
                                                  builder=parse_tree_spec("static:3,1,1:iid")),
                             prompts, lengths, **kw)
    assert int(out.lengths[0]) == 4


def test_generate_api_speculative(tiny_llama_dir):
    model = jaxdecode.load(tiny_llama_dir)
    prompts = ["def add(a, b):", "import", "class A:"]
    plain = jaxdecode.generate(model, prompts, method="greedy", max_new_tokens=8, eos_ids=())
    # The default (adaptive) may judge drafting not worth it on a model this small: same output.
    spec = jaxdecode.generate(model, prompts, method="speculative", draft=model, tree="chain:3",
                              max_new_tokens=8, eos_ids=())
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    spec = jaxdecode.generate(model, prompts, method="speculative", draft=model, tree="chain:3",
                              max_new_tokens=8, eos_ids=(), adaptive=False)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert all(r.stats["tau"] > 1 for r in spec)
    # Whole-batch stats stay whole even when their length equals the batch size (3 depths, 3 prompts);
    # accept_hist is per row (each row's own histogram over draft lengths 0..3).
    assert all(len(r.batch_stats["accept_rate_by_depth"]) == 3 for r in spec)
    assert all(len(r.stats["accept_hist"]) == 4 and sum(r.stats["accept_hist"]) == r.stats["verify_calls"]
               for r in spec)
    # Drafter options by name and a shrinking verification, as the CLI's --option passes them (JSON lists).
    adaptive = jaxdecode.generate(model, prompts, method="speculative", drafter="prompt_lookup", tree="chain:6",
                                  drafter_options={"lengths": [1, 2, 6]}, verify_widths=[2], max_new_tokens=8,
                                  eos_ids=())
    assert [r.tokens for r in adaptive] == [r.tokens for r in plain]
    with pytest.raises(ValueError, match="lengths"):
        jaxdecode.generate(model, prompts, method="speculative", drafter="prompt_lookup", tree="chain:6",
                           drafter_options={"lengths": [1, 9]}, max_new_tokens=8)
