"""EAGLE-3 drafter (issue 10 item 2): decode == the training unroll, greedy == plain greedy for every
tree (full and trimmed vocabulary), lossless sampling through the model loop, training raises
acceptance on a tiny trained target, save -> load_drafter -> decode."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters import eagle3 as e3
from jaxdecode.drafters.builders import ChainBuilder, parse_tree_spec
from jaxdecode.models import ModelConfig, causal_mask, forward, init_params
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import (FINAL, DraftContext, Observation, select_features, feature_request,
                                   speculative_decode)
from jaxdecode.training import eagle3 as te
from jaxdecode.verifiers import get_verifier

V = 64
GREEDY = SamplerConfig(temperature=0.0)
EVEN = tuple(range(0, V, 2))  # a trimmed draft vocabulary


def tiny(layers=3, bigram=False):
    cfg = ModelConfig(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=64,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=256, sliding_windows=(0,) * layers)
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    if bigram:  # no attention / MLP output: the next token is a function of the current one
        params = {**params, "layers": {**params["layers"], "wo": params["layers"]["wo"] * 0,
                                       "w_down": params["layers"]["w_down"] * 0}}
    return cfg, params


def random_drafter_params(ec, cfg, seed=1, noise=0.3):
    p = e3.init_params(ec, cfg, jax.random.PRNGKey(seed))
    delta = noise * jax.random.normal(jax.random.PRNGKey(seed + 1), p["head_delta"].shape)
    return {**p, "head_delta": delta}


def oracle_params(ec, cfg, tparams, noise=0.0, seed=0):
    """For a bigram target: the drafter's layer passes emb(x_{t+1}) through and its head is the
    target's, so it predicts the target exactly (head noise makes it miss some)."""
    p = e3.init_params(ec, cfg, jax.random.PRNGKey(seed))
    d = cfg.hidden_size
    layers = {**p["layers"], "wo": p["layers"]["wo"] * 0, "w_down": p["layers"]["w_down"] * 0}
    fc2 = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)
    delta = noise * jax.random.normal(jax.random.PRNGKey(seed + 7), p["head_delta"].shape)
    return {**p, "layers": layers, "fc2": fc2, "final_norm": tparams["final_norm"], "head_delta": delta}


def target_features(cfg, params, seq, layers):
    t = jnp.asarray(seq, jnp.int32)[None]
    _, hidden, _ = forward(cfg, params, t, jnp.arange(t.shape[1])[None], None, causal_mask(1, t.shape[1]),
                           return_layers=feature_request(layers))
    return select_features(hidden, layers)  # [F, 1, T, D]


# ----------------------------------------------------------------------------- unit: the unroll
def test_ttt_mask_and_weights():
    s = 5
    np.testing.assert_array_equal(te.ttt_visible(0, s), np.tril(np.ones((s, s), bool)))
    m = te.ttt_visible(2, s)
    assert m.shape == (s, 3 * s)
    t = 4  # the 2nd drafted node of a chain rooted at entry 2: sees entries 0..2, its ancestor at 3, itself
    assert np.flatnonzero(m[t, :s]).tolist() == [0, 1, 2]
    assert np.flatnonzero(m[t, s:2 * s]).tolist() == [3]
    assert np.flatnonzero(m[t, 2 * s:]).tolist() == [4]
    ec = e3.default_config(tiny()[0], ttt_steps=4)
    np.testing.assert_allclose(np.asarray(te.ttt_weights(ec)), 0.8 ** np.arange(4), rtol=1e-6)


def test_unroll_shapes_and_loss_weights():
    cfg, params = tiny()
    ec = e3.default_config(cfg, ttt_steps=3, draft_vocab=EVEN)
    assert ec.feature_layers == (0, 1, 2)
    from flax import nnx
    module = te.eagle3_module(ec, cfg, nnx.Rngs(0))
    toks = np.random.default_rng(0).integers(0, V, (2, 10)).astype(np.int32)
    mask = np.ones((2, 10), np.float32)
    mask[1, 7:] = 0
    logits, labels, w = te.eagle3_outputs(module, {"tokens": toks, "mask": mask}, params)
    assert logits.shape == (3, 2, 9, len(EVEN)) and labels.shape == (2, 9) and w.shape == (3, 2, 9)
    w = np.asarray(w)
    in_vocab = toks[:, 2:] % 2 == 0
    for i in range(3):
        for b in range(2):
            for t in range(9):
                want = t >= i and t + 2 < 10 and mask[b, t + 2] > 0 and in_vocab[b, t]
                assert w[i, b, t] == float(want), (i, b, t)
    np.testing.assert_array_equal(np.asarray(labels)[w[0] > 0], (toks[:, 2:][w[0, :, :8] > 0]) // 2)


@pytest.mark.parametrize("vocab", [(), EVEN])
def test_a_head_bias_targets_drafts_and_training_logits_carry_its_bias(vocab):
    """A target whose LM head adds a bias (Phi-3.5-MoE): an untrained drafter (head_delta 0: the target's head)
    drafts at the root what the target's head gives for the drafter's state, over the draft vocabulary; the
    training unroll's logits carry the same bias (they differ from the bias-free target's by it alone)."""
    from flax import nnx
    from jd_testutil import phimoe_like

    from jaxdecode.models.transformer import output_logits, rms_norm
    cfg, params = phimoe_like(tiny()[0])
    ec = e3.default_config(cfg, draft_vocab=vocab)
    ep = e3.init_params(ec, cfg, jax.random.PRNGKey(1))
    drafter = e3.Eagle3Drafter.build(ep, ec, cfg, params, ChainBuilder(3))
    eps = drafter.layer_config.norm_eps
    h = 3.0 * jax.random.normal(jax.random.PRNGKey(2), (5, cfg.hidden_size))
    cols = np.asarray(vocab) if vocab else np.arange(V)
    want = jax.nn.log_softmax(output_logits(cfg, params, rms_norm(h, ep["final_norm"], eps))[:, cols], axis=-1)
    got = drafter._logq(e3.head_logits(drafter.params, drafter.params["head"], eps, h), SamplerConfig(temperature=1.0))
    np.testing.assert_allclose(np.asarray(got)[:, cols], want, rtol=1e-5, atol=1e-5)
    module = te.eagle3_module(ec, cfg, nnx.Rngs(0))
    batch = {"tokens": np.random.default_rng(0).integers(0, V, (2, 8)).astype(np.int32),
             "mask": np.ones((2, 8), np.float32)}
    logits = te.eagle3_outputs(module, batch, params)[0]
    plain = te.eagle3_outputs(module, batch, {**params, "lm_head_bias": jnp.zeros_like(params["lm_head_bias"])})[0]
    np.testing.assert_allclose(logits - plain, jnp.broadcast_to(params["lm_head_bias"][cols], logits.shape),
                               atol=1e-5)


@pytest.mark.parametrize("vocab,softcap", [((), None), (EVEN, None), ((), 2.0)])
def test_decode_matches_the_training_unroll(vocab, softcap):
    """init + propose (chain) give the distributions the TTT unroll gives at the same positions, and
    init on a prefix + observe equals init on the whole text. A target that soft-caps its logits (Gemma
    2): both draft from the capped head, as the target's own distribution is."""
    from jaxdecode.models.transformer import finish_logits, logits_finish
    cfg, params = tiny()
    cfg = cfg.replace(final_logit_softcapping=softcap)
    ec = e3.default_config(cfg, draft_vocab=vocab)
    ep = random_drafter_params(ec, cfg)
    drafter = e3.Eagle3Drafter.build(ep, ec, cfg, params, ChainBuilder(3))
    seq = [5, 17, 3, 40, 22, 9, 31]
    n = len(seq)
    feats = target_features(cfg, params, seq, ec.feature_layers)
    state = drafter.init(jnp.asarray([seq], jnp.int32), jnp.asarray([n]), 32, jax.random.PRNGKey(0),
                         features=feats)
    hist = jnp.asarray([seq + [0] * 8], jnp.int32)
    tree, slots, _ = drafter.propose(state, DraftContext(history=hist, hist_len=jnp.asarray([n]),
                                                         key=jax.random.PRNGKey(1)), GREEDY)
    full = seq + [int(x) for x in tree.tokens[0]]
    if vocab:
        assert all(x % 2 == 0 for x in full[n:])
    ffeats = target_features(cfg, params, full, ec.feature_layers)
    dcfg = e3.layer_config(ec, cfg)
    head = e3.draft_head(ep, e3.target_head(cfg, params), ec.draft_vocab)
    emb = jnp.take(params["embed"], jnp.asarray(full[1:])[None], axis=0)
    hs = te.ttt_hidden(dcfg, ep, emb, e3.fuse_features(ep, ffeats[:, :, :-1]), 3)
    ref = jax.nn.log_softmax(finish_logits(e3.head_logits(ep, head, dcfg.norm_eps, hs), *logits_finish(cfg)),
                             axis=-1)  # [3, 1, T-1, M]
    cols = np.asarray(vocab) if vocab else np.arange(V)
    for d in range(3):
        got = np.log(np.asarray(slots[0, d])[cols])
        np.testing.assert_allclose(got, np.asarray(ref[d, 0, n - 2 + d]), atol=2e-4, err_msg=f"depth {d}")
        if vocab:
            assert np.all(np.delete(np.asarray(slots[0, d]), cols) == 0)

    # observe: init on a prefix, then commit the rest (3 accepted + bonus) as the engine hands it over
    p, k = 4, 2
    st = drafter.init(jnp.asarray([seq[:p] + [0] * (n - p)], jnp.int32), jnp.asarray([p]), 32,
                      jax.random.PRNGKey(0), features=target_features(cfg, params, seq[:p] + [0] * (n - p),
                                                                       ec.feature_layers))
    slot_pos = (p - 1) + np.arange(4)  # slot 0 = the pending root, slots 1.. the chain nodes
    obs_feats = feats[:, :, slot_pos]  # [F, 1, N+1 = 4, D]
    obs = Observation(tree=None, path=jnp.asarray([[0, 1, -1]]), num_accepted=jnp.asarray([k]),
                      bonus=None, target_logits=None, history=jnp.asarray([seq]), hist_len=jnp.asarray([p + k + 1]),
                      active=jnp.asarray([True]), features=obs_feats, committed=jnp.asarray([k + 1]))
    st = drafter.observe(st, obs)
    assert int(st.cache.lengths[0]) == p - 1, "observe only stores the features: the layer runs lazily"
    # The next proposal's catch-up runs the layer over them (in blocks of max_depth + 1 = 4 entries).
    cache, root = drafter._catch_up(st, DraftContext(history=jnp.asarray([seq + [0] * 8]),
                                                     hist_len=jnp.asarray([p + k + 1]), key=None))
    whole = drafter.init(jnp.asarray([seq]), jnp.asarray([p + k + 1]), 32, jax.random.PRNGKey(0), features=feats)
    assert int(cache.lengths[0]) == int(whole.cache.lengths[0]) == p + k
    np.testing.assert_allclose(np.asarray(root), np.asarray(whole.root), atol=1e-5)
    np.testing.assert_allclose(np.asarray(cache.k[:, :, :, :p + k]), np.asarray(whole.cache.k[:, :, :, :p + k]),
                               atol=1e-5)


def test_plain_steps_only_store_features_and_the_next_proposal_catches_up_in_blocks():
    """Steps that draft nothing (the adaptive policy's plain steps) hand observe one committed slot
    each, which it stores as the target computed it (fc waits too: one token's fc cost a plain sampling
    step 9% on the CPU); fc and the layer run over them only at the next proposal, in several blocks of
    max_depth + 1, and end exactly where an init over the whole sequence does."""
    cfg, params = tiny()
    ec = e3.default_config(cfg)
    drafter = e3.Eagle3Drafter.build(random_drafter_params(ec, cfg), ec, cfg, params, ChainBuilder(3))
    seq = [5, 17, 3, 40, 22, 9, 31, 8, 2]
    p, n = 2, len(seq)
    feats = target_features(cfg, params, seq, ec.feature_layers)  # [F, 1, T, D]
    prefix = seq[:p] + [0] * (n - p)
    st = drafter.init(jnp.asarray([prefix]), jnp.asarray([p]), 32, jax.random.PRNGKey(0),
                      features=target_features(cfg, params, prefix, ec.feature_layers))
    for hist_len in range(p + 1, n + 1):  # each plain step runs the pending token and commits one
        slot_feats = jnp.pad(feats[:, :, hist_len - 2:hist_len - 1], ((0, 0), (0, 0), (0, 3), (0, 0)))
        obs = Observation(tree=None, path=jnp.full((1, 3), -1), num_accepted=jnp.asarray([0]), bonus=None,
                          target_logits=None, history=jnp.asarray([seq]), hist_len=jnp.asarray([hist_len]),
                          active=jnp.asarray([True]), features=slot_feats, committed=jnp.asarray([1]))
        st = drafter.observe(st, obs)
    assert int(st.cache.lengths[0]) == p - 1  # nothing ran yet
    np.testing.assert_array_equal(np.asarray(st.features[:, :n - 1]), np.asarray(e3.side_by_side(feats)[:, :n - 1]))
    cache, root = drafter._catch_up(st, DraftContext(history=jnp.asarray([seq + [0] * 4]),
                                                     hist_len=jnp.asarray([n]), key=None))
    whole = drafter.init(jnp.asarray([seq]), jnp.asarray([n]), 32, jax.random.PRNGKey(0), features=feats)
    assert int(cache.lengths[0]) == int(whole.cache.lengths[0]) == n - 1  # 7 new entries: 2 blocks of 4
    np.testing.assert_allclose(np.asarray(root), np.asarray(whole.root), atol=1e-5)
    np.testing.assert_allclose(np.asarray(cache.k[:, :, :, :n - 1]), np.asarray(whole.cache.k[:, :, :, :n - 1]),
                               atol=1e-5)


def test_drafts_stay_right_across_the_adaptive_policys_plain_steps():
    """End to end: with drafting off for stretches, an oracle drafter's proposals after them are as
    good as when it drafts every step (a stale cache or root would break its bigram predictions), and
    greedy output is exact."""
    from jaxdecode.speculative import policy_for
    from test_adaptive import Costs
    cfg, params = tiny(bigram=True)
    ec = e3.default_config(cfg)
    drafter = e3.Eagle3Drafter.build(oracle_params(ec, cfg, params), ec, cfg, params, ChainBuilder(3))
    toks, lens = pad_prompts(PROMPTS)
    ref = decode(cfg, params, toks, lens, max_new_tokens=32, sampler=GREEDY, method="greedy")
    # Drafting does not pay at the prior; the estimate drifts up (explore) until the policy probes.
    out = speculative_decode(cfg, params, drafter, toks, lens, max_new_tokens=32, verifier=get_verifier("greedy"),
                             adaptive=policy_for(drafter, GREEDY, prior=0.3, explore=0.1), costs=Costs(draft=0.6))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    s = jax.tree.map(np.asarray, out.stats)
    assert s["width_hist"][0] > 0 and np.all(s["speculative_steps"] > 0), s["width_hist"]
    assert s["accept_rate_by_depth"][0] > 0.95, s["accept_rate_by_depth"]  # the oracle is always right


# ----------------------------------------------------------------------------- greedy == plain greedy
PROMPTS = [[3, 9, 27, 4, 1, 7, 7, 2], [8, 2], [5, 5, 5], [60, 1, 33, 7, 11]]


@pytest.mark.parametrize("spec,vocab,rows", [
    ("chain:3", (), 4),
    ("static:2,2", EVEN, 4),
    ("eagle:depth=3,topk=2,total=5", (), 4),
    ("eagle:depth=3,topk=2,total=5", EVEN, 1),
])
def test_greedy_speculative_equals_greedy(spec, vocab, rows):
    cfg, params = tiny(bigram=True)
    ec = e3.default_config(cfg, draft_vocab=vocab)
    drafter = e3.Eagle3Drafter.build(oracle_params(ec, cfg, params, noise=0.1), ec, cfg, params,
                                     parse_tree_spec(spec))
    toks, lens = pad_prompts(PROMPTS[:rows] if rows > 1 else PROMPTS[3:])
    out = speculative_decode(cfg, params, drafter, toks, lens, max_new_tokens=14, verifier=get_verifier("greedy"))
    ref = decode(cfg, params, toks, lens, max_new_tokens=14, sampler=GREEDY, method="greedy")
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    assert np.asarray(out.stats["tau"]).max() > 1.3, "the oracle drafter should get drafts accepted"


# ----------------------------------------------------------------------------- sampling is lossless
ROWS, CHUNKS = 100_000, 5
P_OK, P_BROKEN = 1e-4, 1e-6


def sample_pvalue(spec, vocab, verifier):
    """χ² p-value of the first two tokens of ROWS speculative samples (T = 1) on the V = 6 target of
    test_verifier_pairs, against its exact law."""
    from test_verifier_pairs import CFG, PARAMS, PROMPT, chi2_pvalue, exact_joint
    ec = e3.default_config(CFG, feature_layers=(0, FINAL), draft_vocab=vocab)
    drafter = e3.Eagle3Drafter.build(random_drafter_params(ec, CFG, seed=4, noise=0.5), ec, CFG, PARAMS,
                                     parse_tree_spec(spec))
    per = ROWS // CHUNKS
    prompts = np.tile(np.asarray(PROMPT, np.int32), (per, 1))
    lengths = np.full((per,), len(PROMPT), np.int32)
    outs = []
    for chunk in range(CHUNKS):
        out = speculative_decode(CFG, PARAMS, drafter, prompts, lengths, max_new_tokens=2,
                                 verifier=get_verifier(verifier), sampler=SamplerConfig(temperature=1.0),
                                 key=jax.random.key(200 + chunk, impl="rbg"))
        assert np.all(np.asarray(out.lengths) == 2)
        outs.append(np.asarray(out.tokens))
    return chi2_pvalue(np.concatenate(outs), exact_joint(CFG, PARAMS, PROMPT, CFG.vocab_size))


@pytest.mark.parametrize("spec,vocab,verifier,expect", [
    ("chain:2:sample", (0, 1, 3, 4), "chain", "lossless"),  # q over a trimmed vocabulary (zeros outside)
    ("eagle:depth=2,topk=2,total=4", (), "typical", "broken"),  # lossy control on the default tree kind
    pytest.param("eagle:depth=2,topk=2,total=4", (), "topk", "lossless", marks=pytest.mark.slow),
])
@pytest.mark.exec_bound  # 1e5 rows: running, not compiling (tests/conftest.py)
def test_sampling_matches_the_target(spec, vocab, verifier, expect):
    p = sample_pvalue(spec, vocab, verifier)
    if expect == "lossless":
        assert p > P_OK, f"{spec} {vocab} {verifier}: p = {p:.3g}"
    else:
        assert p < P_BROKEN, f"the lossy control passed: p = {p:.3g}"


# ----------------------------------------------------------------------------- training + round trip
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny trained target, an EAGLE-3 drafter before and after a few seconds of training."""
    from flax import nnx

    import jaxdecode
    from jaxdecode.training.corpus import Corpus
    from jaxdecode.training.fixtures import build_tiny_lm
    from jaxdecode.training.trainer import TrainConfig, train
    tmp = tmp_path_factory.mktemp("eagle3")
    target = jaxdecode.load(build_tiny_lm(tmp / "lm", steps=60))
    corpus = Corpus.open(tmp / "lm" / "corpus")
    toks, held = corpus.tokens("train"), corpus.tokens("heldout")
    cfg = e3.default_config(target.config, ttt_steps=3)

    def batches(step):  # a pure function of the step (exact resume)
        rng = np.random.default_rng([7, step])
        starts = rng.integers(0, len(toks) - 33, size=8)
        return {"tokens": toks[starts[:, None] + np.arange(32)].astype(np.int32),
                "mask": np.ones((8, 32), np.float32)}

    module = te.eagle3_module(cfg, target.config, nnx.Rngs(0))
    before = jax.tree.map(np.array, module.params())  # host copies: train() donates the module's arrays
    held_loss = lambda m: [float(te.eagle3_loss(m, batches(10_000 + i), {"target": target.params})[0])  # noqa: E731
                           for i in range(2)]
    losses = held_loss(module)
    tc = TrainConfig(steps=80, learning_rate=3e-3, warmup_steps=5, log_every=10, eval_every=0,
                     checkpoint_every=0, data_parallel=1, progress=False)
    result = train(module, te.eagle3_loss, batches, tc, tmp / "run", constants={"target": target.params})
    after = nnx.to_pure_dict(nnx.state(result.module, nnx.Param))
    losses += held_loss(result.module)
    starts = np.linspace(0, len(held) - 40, 8).astype(int)
    prompts = [[int(x) for x in held[s:s + 10]] for s in starts]
    return dict(target=target, cfg=cfg, before=before, after=after, losses=losses, prompts=prompts, tmp=tmp)


def _tau(target, cfg, params, prompts, tree="eagle:depth=3,topk=2,total=6"):
    drafter = e3.Eagle3Drafter.build(params, cfg, target.config, target.params, parse_tree_spec(tree))
    toks, lens = pad_prompts(prompts)
    out = speculative_decode(target.config, target.params, drafter, toks, lens, max_new_tokens=16,
                             verifier=get_verifier("greedy"), eos_ids=())
    ref = decode(target.config, target.params, toks, lens, max_new_tokens=16, sampler=GREEDY, method="greedy",
                 eos_ids=())
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    return float(np.mean(np.asarray(out.stats["tau"])))


def test_training_lowers_the_loss_and_raises_acceptance(trained):
    lb = sum(trained["losses"][:2]) / 2
    la = sum(trained["losses"][2:]) / 2
    assert la < 0.8 * lb, f"held-out TTT loss {lb:.3f} -> {la:.3f}"
    t0 = _tau(trained["target"], trained["cfg"], trained["before"], trained["prompts"])
    t1 = _tau(trained["target"], trained["cfg"], trained["after"], trained["prompts"])
    print(f"tau before {t0:.2f} after {t1:.2f}")
    assert t1 > t0 + 0.2 and t1 > 1.5, (t0, t1)


def test_save_load_decode_round_trip(trained):
    import jaxdecode
    from jaxdecode.drafters.trained import load_drafter, save_drafter
    target, cfg = trained["target"], trained["cfg"]
    out_dir = save_drafter(trained["tmp"] / "drafter", "eagle3", cfg, trained["after"], target.config,
                           extra={"note": "test"})
    loaded = load_drafter(out_dir, target)
    assert loaded.cfg == cfg and loaded.name == "eagle3"
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 loaded.params, trained["after"])
    prompts = trained["prompts"][:3]
    spec = jaxdecode.generate(target, prompts, method="speculative", drafter="eagle3", drafter_dir=str(out_dir),
                              tree="eagle:depth=3,topk=2,total=6", max_new_tokens=12, eos_ids=[],
                              adaptive=False)  # tau below is the drafter's own, not the policy's
    plain = jaxdecode.generate(target, prompts, method="greedy", max_new_tokens=12, eos_ids=[])
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert max(r.stats["tau"] for r in spec) > 1.2
