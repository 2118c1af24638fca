"""The parallel block drafter (DFlash / PARD style; jaxdecode.drafters.block, jaxdecode.training.block).

One module fixture trains a block drafter for a few seconds on the target's own greedy continuations
(a tiny trained target from training.fixtures.build_tiny_lm) and measures held-out tau before and after;
the decode tests use that drafter, so drafts are really accepted. The chi-squared test reuses the
model-loop harness of test_verifier_pairs (V = 6 target, 1e5 rows per pair)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdecode
from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters import make_drafter
from jaxdecode.drafters.trained import save_drafter
from jaxdecode.drafters.block import (BlockConfig, BlockDrafterError, BlockState, context_kv,
                                      drafter_model_config, init_params, make_block_drafter)
from jaxdecode.models import causal_mask, forward
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import (DraftContext, feature_request, select_features,
                                   speculative_decode)
from jaxdecode.training.block import (block_loss, block_module, block_outputs, block_weights,
                                      default_config, weighted_block_loss)
from jaxdecode.training.trainer import TrainConfig, train
from jaxdecode.verifiers import get_verifier

T0, T1 = SamplerConfig(temperature=0.0), SamplerConfig(temperature=1.0)
K = 4  # block size of the trained drafter
CFG = BlockConfig(block_size=K, num_layers=1, anchors=8, gamma=2.0)


def _spec(target, drafter, prompts, new, verifier="greedy", sampler=T0, key=None):
    toks, lens = pad_prompts(prompts)
    return speculative_decode(target.config, target.params, drafter, toks, lens, max_new_tokens=new,
                              verifier=get_verifier(verifier), sampler=sampler, key=key)


def _greedy(target, prompts, new):
    toks, lens = pad_prompts(prompts)
    return decode(target.config, target.params, toks, lens, max_new_tokens=new, sampler=T0, method="greedy")


NEW = 20


def _tau(target, params, prompts):
    out = _spec(target, make_block_drafter(params, CFG, target, tree=f"chain:{K}"), prompts, NEW)
    return float(np.sum(out.lengths) / np.sum(out.stats["verify_calls"]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny trained target, a block drafter trained on its greedy continuations, tau before / after."""
    from jaxdecode.training.corpus import Corpus
    from jaxdecode.training.fixtures import build_tiny_lm
    root = tmp_path_factory.mktemp("block")
    target = jaxdecode.load(build_tiny_lm(root / "lm"), dtype="float32")
    corpus = Corpus.open(root / "lm" / "corpus")
    train_toks, held = corpus.tokens("train"), corpus.tokens("heldout")
    # Self-distillation: the target continues training windows greedily (what it will verify).
    starts = np.linspace(0, len(train_toks) - 9, 32).astype(int)
    prompts = [list(map(int, train_toks[s:s + 8])) for s in starts]
    gen = _greedy(target, prompts, 40)
    rows = np.concatenate([np.asarray(prompts, np.int32), np.asarray(gen.tokens, np.int32)], axis=1)  # [32, 48]

    def batches(step):
        pick = np.random.default_rng([1, step]).choice(len(rows), 8, replace=False)
        return {"tokens": rows[pick], "mask": np.ones((8, rows.shape[1]), np.float32)}

    heldout = [list(map(int, held[s:s + 3 + s % 5])) for s in range(0, 400, 100)]  # ragged, 4 prompts
    module = block_module(CFG, target.config, nnx.Rngs(0))
    tau0 = _tau(target, module.params(), heldout)
    tc = TrainConfig(steps=60, learning_rate=3e-3, warmup_steps=10, log_every=10, eval_every=0,
                     checkpoint_every=0, data_parallel=1, progress=False)
    res = train(module, block_loss, batches, tc, root / "run", constants={"target": target.params})
    params = res.module.params()
    return dict(target=target, params=params, module=res.module, history=res.history, tau0=tau0,
                tau1=_tau(target, params, heldout), heldout=heldout, rows=rows, root=root)


# ----------------------------------------------------------------------------- loss
def test_loss_weights():
    w = np.asarray(block_weights(8, 4.0))
    np.testing.assert_allclose(w, np.exp(-(np.arange(1, 9) - 1) / 4.0), rtol=1e-6)
    assert w[0] == 1.0 and np.all(np.diff(w) < 0)
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 3, 4, 5)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 5, size=(2, 3, 4)), jnp.int32)
    real = jnp.asarray(rng.integers(0, 2, size=(2, 3, 4)), jnp.float32)
    loss, ce_i, _, prefix = weighted_block_loss(logits, labels, real, 2.0)
    ce = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), np.asarray(labels)[..., None], -1)[..., 0]
    wt = np.asarray(real) * np.exp(-np.arange(4) / 2.0)
    np.testing.assert_allclose(float(loss), (ce * wt).sum() / wt.sum(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ce_i), (ce * np.asarray(real)).reshape(-1, 4).sum(0)
                               / np.maximum(np.asarray(real).reshape(-1, 4).sum(0), 1), rtol=1e-5)
    hit = (np.argmax(np.asarray(logits), -1) == np.asarray(labels)) * np.asarray(real)
    np.testing.assert_array_equal(np.asarray(prefix), np.cumprod(hit, -1).sum(-1))


def test_training_lowers_loss_and_raises_tau(trained):
    hist = [r["loss"] for r in trained["history"] if "loss" in r]
    assert hist[-1] < hist[0] - 0.5, hist
    assert trained["tau1"] > trained["tau0"] + 0.5, (trained["tau0"], trained["tau1"])


# ----------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("tree", [f"chain:{K}", "static:3,2,1"])
def test_greedy_speculative_equals_greedy(trained, tree):
    target, heldout = trained["target"], trained["heldout"]
    drafter = make_block_drafter(trained["params"], CFG, target, tree=tree)
    prompts = heldout  # batch 4 with ragged prompts, then batch 1: the row that accepted most
    for _ in range(2):
        out = _spec(target, drafter, prompts, NEW)
        ref = _greedy(target, prompts, NEW)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
        tau = np.asarray(out.stats["tau"])
        assert tau.max() > 1.5, tau
        prompts = [prompts[int(np.argmax(tau))]]


def test_decode_and_training_see_the_same_context(trained):
    """The drafter's context K/V after a decode equal those of one plain target forward over the final
    text, and its q at a position equals the training forward's at that anchor."""
    target, params, prompts = trained["target"], trained["params"], trained["heldout"]
    drafter = make_block_drafter(params, CFG, target, tree=f"chain:{K}")
    log = []

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class Recorder:  # the drafter, handing its state after every observe to the host
        inner: object
        num_nodes = property(lambda self: self.inner.num_nodes)
        max_depth = property(lambda self: self.inner.max_depth)
        child_rule = property(lambda self: self.inner.child_rule)
        is_chain = property(lambda self: self.inner.is_chain)
        feature_layers = property(lambda self: self.inner.feature_layers)
        init = property(lambda self: self.inner.init)
        propose = property(lambda self: self.inner.propose)

        def observe(self, st, obs):
            st = self.inner.observe(st, obs)
            jax.debug.callback(lambda *a: log.append([np.asarray(x) for x in a]), st.k, st.lengths, ordered=True)
            return st

    out = _spec(target, Recorder(drafter), prompts, NEW)
    k_dec, lengths = log[-1]
    texts = [p + list(np.asarray(out.tokens[b])[:int(out.lengths[b])]) for b, p in enumerate(prompts)]
    toks, lens = pad_prompts(texts)  # right-padded: the states of real positions are those of each row alone
    b, t = toks.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    _, hidden, _ = forward(target.config, target.params, toks, pos, None, causal_mask(b, t),
                           return_layers=feature_request(drafter.feature_layers))
    dcfg = drafter_model_config(CFG, target.config)
    k_ref, v_ref = context_kv(dcfg, drafter.params, select_features(hidden, drafter.feature_layers), pos)
    np.testing.assert_array_equal(lengths, np.asarray(lens) - 1)
    for r, n in enumerate(lengths):
        np.testing.assert_allclose(k_dec[:, r, :, :n], np.asarray(k_ref[:, r, :, :n]), atol=2e-4)
    # q at the pending position of a context of length a (= anchor a in training)
    a = jnp.asarray(lens) - 6
    st = BlockState(k=k_ref, v=v_ref, lengths=a)
    ctx = DraftContext(history=toks, hist_len=a + 1, key=jax.random.PRNGKey(0))
    q_dec = drafter.block_logprobs(st, ctx, T0)
    logits, _, _ = block_outputs(trained["module"], {"tokens": np.asarray(toks), "anchors": np.asarray(a)[:, None]},
                                 target.params)
    np.testing.assert_allclose(np.asarray(q_dec), np.asarray(jax.nn.log_softmax(logits[:, 0])), atol=1e-4)


def test_a_soft_capped_target_drafts_from_its_capped_head(trained, monkeypatch):
    """A target that soft-caps its logits (Gemma 2): the drafter's q and the training forward's both come
    from the capped head, the target's own distribution."""
    capped = jaxdecode.Model(trained["target"].config.replace(final_logit_softcapping=2.0), trained["target"].params)
    monkeypatch.setattr(trained["module"], "target_config", capped.config)
    drafter = make_block_drafter(trained["params"], CFG, capped, tree=f"chain:{K}")
    toks, lens = pad_prompts(trained["heldout"][:2])
    b, t = toks.shape
    _, hidden, _ = forward(capped.config, capped.params, toks, jnp.broadcast_to(jnp.arange(t), (b, t)), None,
                           causal_mask(b, t), return_layers=feature_request(drafter.feature_layers))
    dcfg = drafter_model_config(CFG, capped.config)
    k_ref, v_ref = context_kv(dcfg, drafter.params, select_features(hidden, drafter.feature_layers),
                              jnp.broadcast_to(jnp.arange(t), (b, t)))
    a = jnp.asarray(lens) - 3
    q_dec = drafter.block_logprobs(BlockState(k=k_ref, v=v_ref, lengths=a),
                                   DraftContext(history=toks, hist_len=a + 1, key=jax.random.PRNGKey(0)), T1)
    logits, _, _ = block_outputs(trained["module"], {"tokens": np.asarray(toks), "anchors": np.asarray(a)[:, None]},
                                 capped.params)
    assert float(jnp.max(jnp.abs(logits))) <= 2.0  # the training forward's logits are capped
    np.testing.assert_allclose(np.asarray(q_dec), np.asarray(jax.nn.log_softmax(logits[:, 0])), atol=1e-4)


def test_a_head_bias_target_drafts_from_its_biased_head(trained, monkeypatch):
    """A target whose LM head adds a bias (Phi-3.5-MoE, of the trained target's shape): the training forward's
    logits differ from the bias-free target's by that bias alone, and the drafter's q is their distribution."""
    from jd_testutil import phimoe_like
    tcfg, tparams = phimoe_like(trained["target"].config)
    monkeypatch.setattr(trained["module"], "target_config", tcfg)
    drafter = make_block_drafter(trained["params"], CFG, jaxdecode.Model(tcfg, tparams), tree=f"chain:{K}")
    toks, lens = pad_prompts(trained["heldout"][:2])
    b, t = toks.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    _, hidden, _ = forward(tcfg, tparams, toks, pos, None, causal_mask(b, t),
                           return_layers=feature_request(drafter.feature_layers))
    k_ref, v_ref = context_kv(drafter_model_config(CFG, tcfg), drafter.params,
                              select_features(hidden, drafter.feature_layers), pos)
    a = jnp.asarray(lens) - 3
    q_dec = drafter.block_logprobs(BlockState(k=k_ref, v=v_ref, lengths=a),
                                   DraftContext(history=toks, hist_len=a + 1, key=jax.random.PRNGKey(0)), T1)
    batch = {"tokens": np.asarray(toks), "anchors": np.asarray(a)[:, None]}
    logits, _, _ = block_outputs(trained["module"], batch, tparams)
    plain, _, _ = block_outputs(trained["module"], batch, {**tparams, "lm_head_bias": 0 * tparams["lm_head_bias"]})
    np.testing.assert_allclose(np.asarray(logits - plain), np.broadcast_to(tparams["lm_head_bias"], logits.shape),
                               atol=1e-4)
    np.testing.assert_allclose(np.asarray(q_dec), np.asarray(jax.nn.log_softmax(logits[:, 0])), atol=1e-4)


def test_context_window_hides_older_context(trained):
    """context_window = W: q depends only on the newest W committed positions (garbage in older slots
    changes nothing; without the window it does), and greedy speculative output stays plain greedy."""
    target, params, prompts = trained["target"], trained["params"], trained["heldout"]
    w = 3
    windowed = make_block_drafter(params, dataclasses.replace(CFG, context_window=w), target, tree=f"chain:{K}")
    full = make_block_drafter(params, CFG, target, tree=f"chain:{K}")
    toks = jnp.asarray(np.tile(np.arange(1, 13, dtype=np.int32), (2, 1)))
    lengths = jnp.asarray([9, 11], jnp.int32)
    dcfg = drafter_model_config(CFG, target.config)
    k = jax.random.normal(jax.random.PRNGKey(0), (dcfg.num_layers, 2, dcfg.num_kv_heads, 16, dcfg.head_dim))
    v = jax.random.normal(jax.random.PRNGKey(1), k.shape)
    old = (jnp.arange(16)[None, :] < (lengths - w)[:, None])[None, :, None, :, None]  # slots before the window
    k2, v2 = jnp.where(old, 5.0, k), jnp.where(old, -5.0, v)
    ctx = DraftContext(history=toks, hist_len=lengths + 1, key=jax.random.PRNGKey(0))
    q = lambda d, kk, vv: np.asarray(d.block_logprobs(BlockState(k=kk, v=vv, lengths=lengths), ctx, T0))  # noqa: E731
    np.testing.assert_allclose(q(windowed, k, v), q(windowed, k2, v2), atol=1e-5)
    assert np.abs(q(full, k, v) - q(full, k2, v2)).max() > 1e-3
    out = _spec(target, windowed, prompts, NEW)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(_greedy(target, prompts, NEW).tokens))
    with pytest.raises(BlockDrafterError, match="context_window"):
        BlockConfig(context_window=-1)


def test_save_load_decode_round_trip(trained, tmp_path):
    target = trained["target"]
    cfg = default_config(target.config, block_size=K, num_layers=1, anchors=8, gamma=2.0)
    assert cfg.feature_layers == (0, 1)  # written out for the 2-layer target
    # so is the layers' shape taken from the target: the saved config says it without the target
    tc = target.config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (
        tc.num_heads, tc.num_kv_heads, tc.head_dim, tc.intermediate_size)
    path = save_drafter(tmp_path / "block", "block", CFG, trained["params"], target.config,
                                  extra={"tau": trained["tau1"]})
    td = jaxdecode.load_drafter(path, target)
    assert td.name == "block" and td.cfg == CFG and td.extra == {"tau": trained["tau1"]}
    jax.tree.map(np.testing.assert_array_equal, td.params, jax.tree.map(np.asarray, trained["params"]))
    drafter = make_drafter("block", target, drafter_dir=str(path), tree=f"chain:{K}")
    out = _spec(target, drafter, trained["heldout"], NEW)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(_greedy(target, trained["heldout"], NEW).tokens))
    assert float(np.sum(out.lengths) / np.sum(out.stats["verify_calls"])) == pytest.approx(trained["tau1"])


def test_bad_trees_and_configs(trained):
    target, params = trained["target"], trained["params"]
    with pytest.raises(BlockDrafterError, match=r"depth 5 but the block drafter predicts 4"):
        make_block_drafter(params, CFG, target, tree="chain:5")
    with pytest.raises(BlockDrafterError, match="gamma"):
        BlockConfig(gamma=0.0)
    with pytest.raises(BlockDrafterError, match="feature_layers"):
        BlockConfig(feature_layers=(1, 1))
    with pytest.raises(BlockDrafterError, match=r"feature_layers \[5\] are not layers of the target"):
        make_block_drafter(params, dataclasses.replace(CFG, feature_layers=(0, 5)), target)
    with pytest.raises(BlockDrafterError, match="params have shapes"):
        make_block_drafter(params, dataclasses.replace(CFG, num_layers=2), target)
    with pytest.raises(BlockDrafterError, match="options"):
        make_block_drafter(params, CFG, target, nodes=3)


# ----------------------------------------------------------------------------- lossless sampling
@pytest.mark.parametrize("tree,names", [
    ("chain:2:sample", ("chain", "typical")),
    pytest.param("chain:2:sample", ("block",), marks=pytest.mark.slow),
    pytest.param("static:2,1:iid", ("specinfer", "topk"), marks=pytest.mark.slow)])
@pytest.mark.exec_bound  # 1e5 rows: running, not compiling (tests/conftest.py)
def test_sampling_is_lossless_through_the_model_loop(monkeypatch, tree, names):
    """chi-squared of the first two tokens (1e5 rows per pair) for the block drafter's sampled chains and
    i.i.d. trees with the lossless verifiers the engine accepts for them; the lossy `typical` rule fails
    the same test. As in test_verifier_pairs, one compiled loop per tree serves several verifiers
    (RowBlocks over row ranges), each pair judged by the engine's own check first."""
    import jaxdecode.speculative as spec
    from test_verifier_pairs import CFG as TCFG
    from test_verifier_pairs import P_BROKEN, P_OK, PARAMS, PROMPT, ROWS, RowBlocks, chi2_pvalue, exact_joint
    target = jaxdecode.Model(config=TCFG, params=PARAMS)
    cfg = BlockConfig(block_size=2, num_layers=1)
    params = init_params(cfg, TCFG, jax.random.PRNGKey(0))
    # Large weights: a confident draft far from the target, and q_1 far from q_2 (total variation 0.5),
    # so draft probabilities handed to the verifier for the wrong depth would fail the test.
    params["mask_embed"] = params["mask_embed"] * 50.0
    params["layers"] = {name: w * 30.0 if name.startswith("w") else w for name, w in params["layers"].items()}
    joint = exact_joint(TCFG, PARAMS, PROMPT, TCFG.vocab_size)
    chunks, per, report = 5, ROWS // 5, []
    drafter = make_block_drafter(params, cfg, target, tree=tree, temperature=1.0)
    for name in names:
        if get_verifier(name).lossless:
            spec.check_combination(TCFG, drafter, get_verifier(name), T1)  # the engine accepts the pair
    verifier = RowBlocks(tuple((get_verifier(n), ((i * per, (i + 1) * per),)) for i, n in enumerate(names)))
    rows = per * len(names)
    toks, lens = np.tile(np.asarray(PROMPT, np.int32), (rows, 1)), np.full((rows,), len(PROMPT), np.int32)
    outs = []
    with monkeypatch.context() as mp:  # RowBlocks is no single verifier: the pairs were judged above
        mp.setattr(spec, "check_combination", lambda *a: None)
        for c in range(chunks):
            out = speculative_decode(TCFG, PARAMS, drafter, toks, lens, max_new_tokens=2, verifier=verifier,
                                     sampler=T1, key=jax.random.key(50 + c, impl="rbg"),
                                     cache_len=len(PROMPT) + 2 + drafter.num_nodes + drafter.max_depth + 2)
            assert np.all(np.asarray(out.lengths) == 2)
            outs.append((np.asarray(out.tokens), np.asarray(out.stats["verify_calls"])))
    for i, name in enumerate(names):
        sl = slice(i * per, (i + 1) * per)
        p = chi2_pvalue(np.concatenate([t[sl] for t, _ in outs]), joint)
        tau = 2.0 / np.concatenate([c[sl] for _, c in outs]).mean()
        report.append((tree, name, p, tau))
        ok = p > P_OK if get_verifier(name).lossless else p < P_BROKEN
        assert ok, report
    assert min(tau for *_, tau in report) > 1.05, report  # drafts are accepted: the test has teeth
