"""Speculative decoding engine: exactness against plain greedy, losslessness end to end, bad input."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

import jaxdecode
from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters import DraftLM, StaticTreeBuilder, parse_tree_spec
from jaxdecode.models import ModelConfig, causal_mask, forward, init_params
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import SpeculativeError, speculative_decode
from jaxdecode.tree import TreeError
from jaxdecode.verifiers import get_verifier

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
                                        ("static:2,2", 1)])
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


def exact_joint(cfg, params, prompt, vocab):
    """p(x1, x2 | prompt) by enumeration: [V, V]."""
    seqs = np.array([prompt + [a, b] for a, b in itertools.product(range(vocab), repeat=2)], np.int32)
    n, t = seqs.shape
    logits, _, _ = forward(cfg, params, jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(t), (n, t)), None,
                           causal_mask(n, t))
    lp = jax.nn.log_softmax(np.asarray(logits), axis=-1)
    p1 = np.exp(lp[:, len(prompt) - 1])[np.arange(n), seqs[:, -2]]
    p2 = np.exp(lp[:, len(prompt)])[np.arange(n), seqs[:, -1]]
    return (p1 * p2).reshape(vocab, vocab)


def joint_pvalue(cfg, params, drafter, verifier, temperature=1.0):
    prompts = np.tile(np.asarray(PROMPT, np.int32), (DRAWS, 1))
    lengths = np.full((DRAWS,), len(PROMPT), np.int32)
    out = speculative_decode(cfg, params, drafter, prompts, lengths, max_new_tokens=2,
                             verifier=verifier, sampler=SamplerConfig(temperature=temperature),
                             key=jax.random.PRNGKey(11))
    toks = np.asarray(out.tokens)
    v = cfg.vocab_size
    counts = np.bincount(toks[:, 0] * v + toks[:, 1], minlength=v * v)
    expected = exact_joint(cfg, params, PROMPT, v).ravel() * DRAWS
    keep = expected > 5
    chi2 = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    return sps.chi2.sf(chi2, keep.sum() - 1), out


@pytest.mark.parametrize("tree,verifier", [("chain:3:sample", "chain"), ("static:2,2:iid", "specinfer"),
                                           ("static:2,2:gumbel", "rsd"), ("static:3,2", "topk")])
def test_sampling_speculative_matches_target_distribution(small_vocab, tree, verifier):
    (cfg, params), (dcfg, dparams) = small_vocab
    drafter = DraftLM(params=dparams, config=dcfg, builder=parse_tree_spec(tree))
    p, out = joint_pvalue(cfg, params, drafter, get_verifier(verifier))
    assert p > 1e-4, f"{verifier} on {tree}: chi2 p-value {p:.2e}"
    assert float(np.mean(out.stats["tau"])) > 1.0  # drafts were accepted, not only bonus tokens


def test_lossy_typical_acceptance_fails_the_same_test(small_vocab):
    (cfg, params), (dcfg, dparams) = small_vocab
    drafter = DraftLM(params=dparams, config=dcfg, builder=parse_tree_spec("static:3,2"))
    verifier = get_verifier("typical")
    assert not verifier.lossless
    p, _ = joint_pvalue(cfg, params, drafter, verifier)
    assert p < 1e-6


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
    spec = jaxdecode.generate(model, prompts, method="speculative", draft=model, tree="chain:3",
                              max_new_tokens=8, eos_ids=())
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert all(r.stats["tau"] > 1 for r in spec)
    # Whole-batch stats stay whole even when their length equals the batch size (3 depths, 3 prompts).
    assert all(len(r.stats["accept_rate_by_depth"]) == 3 for r in spec)
    assert all(len(r.stats["accept_hist"]) == 4 for r in spec)
    # Drafter options by name and a shrinking verification, as the CLI's --option passes them (JSON lists).
    adaptive = jaxdecode.generate(model, prompts, method="speculative", drafter="prompt_lookup", tree="chain:6",
                                  drafter_options={"lengths": [1, 2, 6]}, verify_widths=[2], max_new_tokens=8,
                                  eos_ids=())
    assert [r.tokens for r in adaptive] == [r.tokens for r in plain]
    with pytest.raises(ValueError, match="lengths"):
        jaxdecode.generate(model, prompts, method="speculative", drafter="prompt_lookup", tree="chain:6",
                           drafter_options={"lengths": [1, 9]}, max_new_tokens=8)
