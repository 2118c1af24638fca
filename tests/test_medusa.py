"""Medusa-1 and Hydra heads (issue 10 item 2): exact greedy decoding with every tree builder, lossless
sampling through the model loop, training that raises acceptance, and the save -> load -> decode trip.

Target: a tiny model without attention output (`markov_target`), so its greedy next token is a fixed
map f of the current token and the heads have something exact to learn (head k: f^(k+1) of the bonus
token); trained heads then get long drafts accepted, which exercises the drafter's state upkeep."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters import make_drafter
from jaxdecode.drafters.medusa import (HeadsDrafter, HydraConfig, MedusaConfig, MedusaError, head_logits, hydra_hidden,
                                       init_params, make_heads_drafter, medusa_hidden, target_head)
from jaxdecode.drafters.trained import DrafterLoadError, load_drafter, save_drafter
from jaxdecode.model import Model
from jaxdecode.models import ModelConfig, causal_mask, forward
from jaxdecode.models import init_params as init_target
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import FINAL, DraftContext, speculative_decode
from jaxdecode.training.medusa import heads_loss, heads_module
from jaxdecode.training.trainer import TrainConfig, train
from jaxdecode.verifiers import get_verifier

V, K = 64, 3
GREEDY = SamplerConfig(temperature=0.0)
CONFIGS = {"medusa": MedusaConfig(num_heads=K), "hydra": HydraConfig(num_heads=K)}


def markov_target(vocab=V, hidden=32, seed=0, std=0.3):
    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=256, sliding_windows=(0, 0))
    params = init_target(cfg, jax.random.PRNGKey(seed), std=std)
    params = {**params, "layers": {**params["layers"], "wo": params["layers"]["wo"] * 0}}
    return Model(cfg, params)


TARGET = markov_target()


@functools.lru_cache(maxsize=None)
def next_token_map() -> np.ndarray:
    """f: the target's greedy next token after each token (position does not matter without attention)."""
    cfg, params = TARGET.config, TARGET.params
    toks = jnp.arange(V, dtype=jnp.int32)[:, None]
    logits, _, _ = forward(cfg, params, toks, jnp.zeros_like(toks), None, causal_mask(V, 1))
    return np.asarray(jnp.argmax(logits[:, 0], axis=-1))


def greedy_sequences(starts, length=24):
    f = next_token_map()
    seq = [np.asarray(starts)]
    for _ in range(length - 1):
        seq.append(f[seq[-1]])
    return np.stack(seq, axis=1).astype(np.int32)


def batch_of(tokens):
    return {"tokens": tokens, "mask": np.ones(tokens.shape, np.float32)}


HELD_OUT = batch_of(greedy_sequences(np.arange(V)))
HELD_PROMPTS = ([[5, 17, 33], [60], [8, 1, 2, 3, 4, 9], [40, 41]])


NEW = 20  # max_new_tokens of every greedy run here (one compiled loop per drafter shape)


def spec_vs_plain(drafter, prompts=HELD_PROMPTS):
    """(speculative tokens, plain greedy tokens, tau per row) at temperature 0."""
    cfg, tp = TARGET.config, TARGET.params
    toks, lens = pad_prompts(prompts)
    out = speculative_decode(cfg, tp, drafter, toks, lens, max_new_tokens=NEW, verifier=get_verifier("greedy"))
    ref = decode(cfg, tp, toks, lens, max_new_tokens=NEW, sampler=GREEDY, method="greedy")
    return np.asarray(out.tokens), np.asarray(ref.tokens), np.asarray(out.stats["tau"])


def tau(kind, params, tree="static:3,2,1"):
    return float(spec_vs_plain(make_heads_drafter(params, CONFIGS[kind], TARGET, tree=tree))[2].mean())


@functools.lru_cache(maxsize=None)
def trained(kind, tmp_root=None):
    """Heads trained for a few seconds on the target's greedy continuations: (params, before, after) with
    before/after = (held-out loss, head-1 top-1 accuracy)."""
    import tempfile

    def batches(step):
        return batch_of(greedy_sequences(np.random.default_rng(step).integers(0, V, 16)))

    module = heads_module(CONFIGS[kind], TARGET.config, nnx.Rngs(0))
    constants = {"target": TARGET.params}
    loss0, aux0 = heads_loss(module, HELD_OUT, constants)
    before = (float(loss0), float(aux0["acc_1"]), jax.tree.map(np.asarray, module.params()))  # train donates
    config = TrainConfig(steps=120, learning_rate=1e-2, warmup_steps=5, weight_decay=0.0, log_every=40,
                         eval_every=0, checkpoint_every=0, data_parallel=1, progress=False)
    with tempfile.TemporaryDirectory(dir=tmp_root) as work:
        result = train(module, heads_loss, batches, config, work, constants=constants)
    loss1, aux1 = heads_loss(result.module, HELD_OUT, constants)
    params = jax.tree.map(np.asarray, result.module.params())
    return params, before, (float(loss1), float(aux1["acc_1"]))


# ----------------------------------------------------------------------------------------------------
def test_untrained_heads_are_the_lm_head():
    """Zero-init residual branches: every head's distribution is the LM head's next-token guess."""
    embed, lm_head = target_head(TARGET.config, TARGET.params)
    h = jax.random.normal(jax.random.PRNGKey(1), (5, 32))
    want = head_logits(h, embed, lm_head)
    for cfg in CONFIGS.values():
        p = init_params(cfg, 32, jax.random.PRNGKey(2))
        z = medusa_hidden(p, h) if isinstance(cfg, MedusaConfig) else hydra_hidden(
            p, h, jax.random.normal(jax.random.PRNGKey(3), (5, K, 32)))
        np.testing.assert_allclose(head_logits(z, embed, lm_head), jnp.broadcast_to(want[:, None], (5, K, V)),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("finish", [dict(logits_scaling=4.0), dict(final_logit_softcapping=2.0), dict(logit_scale=0.3)])
def test_untrained_heads_draft_the_targets_own_distribution(finish):
    """A target that scales (Granite, Cohere) or soft-caps (Gemma 2) its logits: zero-init heads draft from the
    target's own next-token distribution (output_logits), not from its raw LM head's, at T = 1."""
    from jaxdecode.models.transformer import output_logits
    target = Model(TARGET.config.replace(**finish), TARGET.params)
    h = 3.0 * jax.random.normal(jax.random.PRNGKey(1), (5, 32))
    want = jax.nn.log_softmax(output_logits(target.config, target.params, h), axis=-1)
    for cfg in CONFIGS.values():
        _check_zero_heads_draft(cfg, target, h, want)


def _check_zero_heads_draft(cfg, target, h, want):
    """Zero-init heads of `cfg` over `target` draft `want` (log-probs [5, V]) at every depth from states h."""
    drafter = make_heads_drafter(init_params(cfg, 32, jax.random.PRNGKey(2)), cfg, target)
    z = medusa_hidden(drafter.params, h) if isinstance(cfg, MedusaConfig) else hydra_hidden(
        drafter.params, h, jax.random.normal(jax.random.PRNGKey(3), (5, K, 32)))
    got = drafter._logq(z, SamplerConfig(temperature=1.0))
    np.testing.assert_allclose(got, jnp.broadcast_to(want[:, None], (5, K, V)), rtol=1e-5, atol=1e-5)


def test_untrained_heads_draft_a_head_bias_targets_own_distribution():
    """A target whose LM head adds a bias (Phi-3.5-MoE): zero-init heads draft output_logits' distribution, the
    bias added, and training's head logits are the target's own logits at every position."""
    from jd_testutil import phimoe_like

    from jaxdecode.models.transformer import output_logits
    from jaxdecode.training.medusa import head_outputs
    target = Model(*phimoe_like(TARGET.config))
    h = 3.0 * jax.random.normal(jax.random.PRNGKey(1), (5, 32))
    want = jax.nn.log_softmax(output_logits(target.config, target.params, h), axis=-1)
    toks = jax.random.randint(jax.random.PRNGKey(5), (2, 9), 0, V)
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    own = forward(target.config, target.params, toks, pos, None, causal_mask(2, 9))[0]  # [B, T, V]
    for cfg in CONFIGS.values():
        _check_zero_heads_draft(cfg, target, h, want)
        module = heads_module(cfg, target.config, nnx.Rngs(0))
        logits, _, _ = head_outputs(module, {"tokens": toks, "mask": jnp.ones((2, 9))}, target.params)
        np.testing.assert_allclose(logits, jnp.broadcast_to(own[:, :, None], (2, 9, K, V)), rtol=1e-5, atol=1e-5)


def test_hydra_head_reads_only_earlier_tokens():
    """Head k depends on e_0..e_k only (sequential dependence, no peeking at later drafts)."""
    cfg = CONFIGS["hydra"]
    p = jax.tree.map(lambda a: jax.random.normal(jax.random.PRNGKey(4), a.shape),
                     init_params(cfg, 32, jax.random.PRNGKey(2)))
    h = jax.random.normal(jax.random.PRNGKey(1), (32,))
    e = jax.random.normal(jax.random.PRNGKey(5), (K, 32))
    base = hydra_hidden(p, h, e)
    for j in range(K):
        moved = hydra_hidden(p, h, e.at[j].add(1.0))
        changed = np.abs(np.asarray(moved - base)).max(axis=-1) > 1e-6
        np.testing.assert_array_equal(changed, np.arange(K) >= j)


def test_one_hydra_head_equals_that_head_of_all():
    """Decoding runs only the head of a level's depth (hydra_head): the same output as head k of
    hydra_hidden, for a batch of nodes and every k (traced)."""
    from jaxdecode.drafters.medusa import hydra_head
    cfg = CONFIGS["hydra"]
    p = jax.tree.map(lambda a: jax.random.normal(jax.random.PRNGKey(4), a.shape) / 4,
                     init_params(cfg, 32, jax.random.PRNGKey(2)))
    h = jax.random.normal(jax.random.PRNGKey(1), (3, 1, 32))
    e = jax.random.normal(jax.random.PRNGKey(5), (3, 2, K, 32))
    every = hydra_hidden(p, h, e)  # [3, 2, K, 32]
    one = jax.jit(lambda k: hydra_head(p, h, e, k))
    for k in range(K):
        np.testing.assert_allclose(np.asarray(one(jnp.int32(k))), np.asarray(every[..., k, :]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_training_raises_acceptance(kind):
    """A few seconds of training: held-out loss falls, head-1 top-1 accuracy and greedy tau rise."""
    params, (loss0, acc0, init), (loss1, acc1) = trained(kind)
    tau0, tau1 = tau(kind, init), tau(kind, params)
    print(f"{kind}: loss {loss0:.3f} -> {loss1:.3f}, acc_1 {acc0:.3f} -> {acc1:.3f}, tau {tau0:.2f} -> {tau1:.2f}")
    assert loss1 < 0.5 * loss0
    assert acc1 > max(acc0 + 0.3, 0.8)
    assert tau1 > tau0 + 1.0 and tau1 > 2.5


TREES = ["static:3,2,1", "chain:3", "eagle:depth=3,topk=3,total=8", f"dyspec:num_nodes=6,topk=2,max_depth={K}"]


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("tree", TREES)
def test_greedy_equals_plain_greedy(kind, tree):
    """Batch 4 with ragged prompts (one of a single token: no feature yet); batch 1 on the static tree."""
    drafter = make_heads_drafter(trained(kind)[0], CONFIGS[kind], TARGET, tree=tree)
    for prompts in (HELD_PROMPTS, HELD_PROMPTS[2:3])[:2 if tree == TREES[0] else 1]:
        out, ref, taus = spec_vs_plain(drafter, prompts)
        np.testing.assert_array_equal(out, ref)
        assert taus.min() > 1.5, "trained heads should get drafts accepted"


def test_bad_trees_and_params_are_refused():
    params = trained("hydra")[0]
    with pytest.raises(MedusaError, match=f"depth 4 but the drafter has {K} heads"):
        make_heads_drafter(params, CONFIGS["hydra"], TARGET, tree="chain:4")
    with pytest.raises(MedusaError, match="num_heads=3 over a target of hidden size 32"):
        make_heads_drafter(params, CONFIGS["medusa"], TARGET)
    with pytest.raises(MedusaError, match="num_heads must be an int >= 1"):
        MedusaConfig(num_heads=0)


def test_save_load_decode_round_trip(tmp_path):
    for kind in ("medusa", "hydra"):
        params = trained(kind)[0]
        out_dir = save_drafter(tmp_path / kind, kind, CONFIGS[kind], params, TARGET.config, extra={"steps": 120})
        loaded = load_drafter(out_dir, TARGET)
        assert loaded.cfg == CONFIGS[kind] and loaded.extra == {"steps": 120}
        jax.tree.map(np.testing.assert_array_equal, loaded.params, params)
        out, ref, _ = spec_vs_plain(make_drafter(kind, TARGET, tree=TREES[0], drafter_dir=out_dir))
        np.testing.assert_array_equal(out, ref)
    with pytest.raises(DrafterLoadError, match="hidden_size 32.*has 16"):
        load_drafter(tmp_path / "medusa", markov_target(hidden=16))


def test_a_trained_drafter_by_name_is_built_once_until_its_files_or_target_change(tmp_path):
    """generate(drafter="hydra") calls make_drafter on every call: the weights are read (and hashed
    for the cost table) once, while the target lives and the directory's files are unchanged."""
    import gc

    from jaxdecode import drafters
    params = trained("hydra")[0]
    d = save_drafter(tmp_path / "hydra", "hydra", CONFIGS["hydra"], params, TARGET.config)
    first = make_drafter("hydra", TARGET, tree=TREES[0], drafter_dir=d)
    assert make_drafter("hydra", TARGET, tree=TREES[0], drafter_dir=d) is first
    assert make_drafter("hydra", TARGET, tree=TREES[1], drafter_dir=d) is not first  # another tree
    assert make_drafter("hydra", TARGET, tree=TREES[0], temperature=0.7, drafter_dir=d) is not first
    # Retrained in place: read again.
    bumped = jax.tree.map(lambda x: x + 1.0, params)
    save_drafter(d, "hydra", CONFIGS["hydra"], bumped, TARGET.config)
    again = make_drafter("hydra", TARGET, tree=TREES[0], drafter_dir=d)
    assert again is not first
    jax.tree.map(np.testing.assert_array_equal, again.params, load_drafter(d, TARGET).params)
    # Another target object (even an equal one) builds anew, and a dropped target takes its entry along.
    other = Model(config=TARGET.config, params=TARGET.params, tokenizer=None, path=None)
    assert make_drafter("hydra", other, tree=TREES[0], drafter_dir=d) is not again
    n = len(drafters._recent_trained)
    del other
    gc.collect()
    assert len(drafters._recent_trained) == n - 1


def test_held_out_acceptance_from_training_becomes_the_drafters_prior(tmp_path):
    """What training measured (extra.heldout.accept_by_depth) is the drafter's `acceptance_prior`, the
    adaptive policy's starting estimates; a directory without it (or with rates outside [0, 1]) gives
    none."""
    params = trained("hydra")[0]
    rates = [0.9, 0.8, 0.5]
    told = save_drafter(tmp_path / "told", "hydra", CONFIGS["hydra"], params, TARGET.config,
                        extra={"heldout": {"tau": 3.1, "accept_by_depth": rates}})
    assert make_drafter("hydra", TARGET, tree=TREES[0], drafter_dir=told).acceptance_prior == tuple(rates)
    for name, extra in (("silent", {"steps": 1}), ("bad", {"heldout": {"accept_by_depth": [1.5]}})):
        d = save_drafter(tmp_path / name, "hydra", CONFIGS["hydra"], params, TARGET.config, extra=extra)
        assert make_drafter("hydra", TARGET, tree=TREES[0], drafter_dir=d).acceptance_prior == ()


# ----------------------------------------------------------------------------------------------------
# Sampling stays lossless: chi-square of the first two tokens through the model loop (the harness of
# tests/test_verifier_pairs.py: a V = 6 target, 1e5 rows in chunks), the lossy control failing.

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSplit:
    """Rows [0, cut) drafted by `first`, the rest by `second` (one compiled loop for both drafters)."""
    first: HeadsDrafter
    second: HeadsDrafter
    cut: int = dataclasses.field(metadata=dict(static=True))
    feature_layers = (FINAL,)
    num_nodes = property(lambda self: self.first.num_nodes)
    max_depth = property(lambda self: self.first.max_depth)
    child_rule = property(lambda self: self.first.child_rule)
    is_chain = property(lambda self: self.first.is_chain)

    def _halves(self, x, axis=0):
        a, b = jnp.split(x, [self.cut], axis=axis)
        return a, b

    def init(self, prompt_tokens, prompt_lengths, cache_len, key, features=None):
        (t1, t2), (l1, l2), (f1, f2) = self._halves(prompt_tokens), self._halves(prompt_lengths), \
            self._halves(features, axis=1)
        return jnp.concatenate([self.first.init(t1, l1, cache_len, key, features=f1),
                                self.second.init(t2, l2, cache_len, key, features=f2)])

    def propose(self, state, ctx, sampler):
        parts = [d.propose(s, DraftContext(history=h, hist_len=n, key=jax.random.fold_in(ctx.key, i)), sampler)
                 for i, (d, s, h, n) in enumerate(zip((self.first, self.second), self._halves(state),
                                                      self._halves(ctx.history), self._halves(ctx.hist_len)))]
        return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)

    def observe(self, state, obs):
        rows = dataclasses.replace(obs, features=None)
        f1, f2 = self._halves(obs.features, axis=1)
        s1, s2 = self._halves(state)
        o1 = dataclasses.replace(jax.tree.map(lambda x: x[:self.cut], rows), features=f1)
        o2 = dataclasses.replace(jax.tree.map(lambda x: x[self.cut:], rows), features=f2)
        return jnp.concatenate([self.first.observe(s1, o1), self.second.observe(s2, o2)])


@pytest.mark.exec_bound  # 1e5 rows: running, not compiling (tests/conftest.py)
def test_sampling_is_lossless():
    """Medusa and Hydra on a static top-k tree, verified by `topk` (the default for their child rule):
    1e5 rows each match the target's law; Hydra rows verified by the lossy `typical` rule must fail."""
    from test_verifier_pairs import CFG, PARAMS, P_BROKEN, P_OK, PROMPT, ROWS, RowBlocks, chi2_pvalue, exact_joint
    import jaxdecode.speculative as spec
    target = Model(CFG, PARAMS)

    def heads(kind, seed):
        p = init_params(CONFIGS[kind], CFG.hidden_size, jax.random.PRNGKey(seed))
        p = jax.tree.map(lambda a: 0.5 * jax.random.normal(jax.random.PRNGKey(seed + 1), a.shape), p)
        return make_heads_drafter(p, CONFIGS[kind], target, tree="static:2,1", temperature=1.0)

    chunks, per = 10, ROWS // 10  # small chunks: compile time grows with the batch
    drafter = RowSplit(heads("medusa", 7), heads("hydra", 9), cut=per)
    blocks = (("medusa topk", "topk", (0, per)), ("hydra topk", "topk", (per, 2 * per)),
              ("hydra typical", "typical", (2 * per, 3 * per)))
    verifier = RowBlocks(tuple((get_verifier(v), (span,)) for _, v, span in blocks))
    for d in (drafter.first, drafter.second):  # the engine's own check, per real drafter
        spec.check_combination(CFG, d, get_verifier("topk"), SamplerConfig(temperature=1.0))
    prompts = np.tile(np.asarray(PROMPT, np.int32), (3 * per, 1))
    lens = np.full((3 * per,), len(PROMPT), np.int32)
    toks = []
    with pytest.MonkeyPatch.context() as mp:  # the row-block verifier is no registered verifier
        mp.setattr(spec, "check_combination", lambda *a: None)
        for chunk in range(chunks):
            out = speculative_decode(CFG, PARAMS, drafter, prompts, lens, max_new_tokens=2, verifier=verifier,
                                     sampler=SamplerConfig(temperature=1.0),
                                     key=jax.random.key(300 + chunk, impl="rbg"))
            toks.append((np.asarray(out.tokens), np.asarray(out.stats["verify_calls"])))
    joint = exact_joint(CFG, PARAMS, PROMPT, CFG.vocab_size)
    for name, _, (a, z) in blocks:
        p = chi2_pvalue(np.concatenate([t[a:z] for t, _ in toks]), joint)
        t = 2.0 / np.concatenate([c[a:z] for _, c in toks]).mean()
        print(f"{name}: p={p:.3g} tau={t:.2f}")
        if "typical" in name:
            assert p < P_BROKEN, name
        else:
            assert p > P_OK and t > 1.05, name
