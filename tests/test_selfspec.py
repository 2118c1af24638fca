"""Self-speculation (jaxdecode.drafters.selfspec): SWIFT layer skipping, DEL dynamic exit, Kangaroo.

Greedy speculative output equals plain greedy for each (a chain and a tree; batch 4 with ragged prompts
and batch 1); sampling is lossless through the model loop (χ² on the first two tokens, 1e5 rows, with
the lossy `typical` rule failing the same test); SWIFT's online choice finds the skip set that skips
near-identity layers; a few seconds of training lower Kangaroo's loss and raise its τ; save -> load ->
decode. Tiny targets: compiling dominates, so each test decodes with as few shapes as it can."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters import make_drafter, save_drafter
from jaxdecode.drafters import selfspec as ss
from jaxdecode.models import ModelConfig, init_params
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import speculative_decode
from jaxdecode.verifiers import get_verifier

GREEDY = SamplerConfig(temperature=0.0)
PROMPTS4 = [[3, 9, 27, 4, 3, 9, 27, 4, 3], [8, 2], [5, 5, 5, 5, 5, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
PROMPTS1 = [[7, 1, 8, 2, 8]]


def tiny(layers=3, vocab=64, seed=0, identity_layers=()):
    """A random llama-like target; `identity_layers` have (almost) no residual branch output."""
    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=256, sliding_windows=(0,) * layers)
    params = init_params(cfg, jax.random.PRNGKey(seed), std=0.3)
    if identity_layers:
        scale = jnp.ones((layers,)).at[jnp.asarray(identity_layers)].set(1e-3)
        lay = params["layers"]
        params = {**params, "layers": {**lay, "wo": lay["wo"] * scale[:, None, None, None],
                                       "w_down": lay["w_down"] * scale[:, None, None]}}
    return types.SimpleNamespace(config=cfg, params=params, path=None)


def greedy_check(target, drafter, prompts, new=16):
    """Greedy speculative output == plain greedy, and the compiled loop never copies a KV cache."""
    toks, lens = pad_prompts(prompts)
    cfg = target.config
    compiled = jax.jit(lambda params, d: speculative_decode(cfg, params, d, toks, lens, max_new_tokens=new,
                                                            verifier=get_verifier("greedy"))
                       ).lower(target.params, drafter).compile()
    assert cache_copies(cfg, compiled.as_text()) == []
    out = compiled(target.params, drafter)
    ref = decode(target.config, target.params, toks, lens, max_new_tokens=new, sampler=GREEDY, method="greedy")
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    return out


def cache_copies(cfg, hlo: str) -> list:
    """KV-cache-shaped copies in compiled HLO text outside the entry computation (which allocates the
    caches once), i.e. in the decode loop: XLA copies a cache passed into a conditional on every call,
    which would cost each step O(cache size). A cache: [layers, B, KV heads, S >= 64 slots, head dim]
    (the target's, a self-speculation draft's, Kangaroo's l + 1 layers)."""
    import re
    body = "\n".join(c for c in re.split(r"\n(?=\S)", hlo) if not c.startswith("ENTRY"))
    shapes = re.findall(r"= \w+\[(\d+),(\d+),(\d+),(\d+),(\d+)\]\{[\d,]*\} copy\(", body)
    return [s for s in shapes if int(s[2]) == cfg.num_kv_heads and int(s[3]) >= 64 and int(s[4]) == cfg.head_dim]


# ----------------------------------------------------------------------------- greedy == plain greedy
def _kangaroo(target, tree, threshold):
    cfg = ss.KangarooConfig(exit_layer=1, threshold=threshold)
    return ss.make_kangaroo(ss.init_adapter(cfg, target.config, jax.random.PRNGKey(1)), cfg, target, tree)


CASES = {  # (drafter maker, prompts); swift's chain at batch 4 runs in test_swift_finds_the_best_skip_set
    "swift-tree-b1": (lambda t: ss.make_swift(t, "static:2,1", skip_sets=[[1], [2]], explore_steps=1,
                                              reexplore_every=3, threshold=0.05), PROMPTS1),
    "del-chain-b4": (lambda t: ss.make_del(t, "chain:3"), PROMPTS4),
    "del-eagle-b1": (lambda t: ss.make_del(t, "eagle:depth=2,topk=2,total=3"), PROMPTS1),
    "kangaroo-chain-b4": (lambda t: _kangaroo(t, "chain:3", 0.05), PROMPTS4),
    "kangaroo-tree-b1": (lambda t: _kangaroo(t, "static:2,1", 0.0), PROMPTS1),
}


SLOW_CASES = ("del-chain-b4", "kangaroo-tree-b1")  # covered in kind by the others; compile-bound


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c
                                  for c in sorted(CASES)])
def test_greedy_speculative_equals_plain_greedy(case):
    target = tiny()
    make, prompts = CASES[case]
    out = greedy_check(target, make(target), prompts)
    assert np.all(np.asarray(out.stats["verify_calls"]) >= 1)


@pytest.mark.parametrize("family", ["smollm3", "qwen2_moe", "granitemoeshared", "phimoe"])
def test_kangaroo_over_per_layer_and_expert_targets(family):
    """Kangaroo over a target with layers without RoPE (SmolLM3: the draft network keeps layer l's) and over
    mixtures of experts with a shared expert (Qwen2-MoE; Granite-MoE-shared's ungated one under its multipliers)
    or LayerNorms and sparsemixer (Phi-3.5-MoE): the fresh adapter zeroes every down projection (and the
    attention's output bias), so it starts as the early exit at layer l; greedy speculative equals plain greedy."""
    base = tiny().config
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_norm_topk=False)
    extra = {"smollm3": dict(rope_layers=(1, 0, 1)),
             "qwen2_moe": dict(shared_expert_intermediate_size=24, qkv_bias=True, **moe),
             "granitemoeshared": dict(shared_expert_intermediate_size=24, embedding_multiplier=3.0,
                                      residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=2.5,
                                      **dict(moe, moe_norm_topk=True)),
             "phimoe": dict(layer_norm=True, lm_head_bias=True, qkv_bias=True, o_bias=True, sparsemixer_eps=0.3,
                            **moe)}[family]
    cfg = base.replace(model_type=family, **extra)
    target = types.SimpleNamespace(config=cfg, params=init_params(cfg, jax.random.PRNGKey(0), std=0.3), path=None)
    kcfg = ss.KangarooConfig(exit_layer=1, threshold=0.0)
    adapter = ss.init_adapter(kcfg, cfg, jax.random.PRNGKey(1))
    net_cfg, net_params = ss.kangaroo_network(cfg, target.params, kcfg, adapter)
    h0 = {"layers": jax.tree.map(lambda a: a[:1], target.params["layers"])}
    exit_cfg = cfg.replace(num_layers=1, sliding_windows=cfg.sliding_windows[:1], rope_layers=cfg.rope_layers[:1])
    toks, lens = pad_prompts(PROMPTS1)
    from jaxdecode.models import causal_mask, forward
    pos = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
    exit_logits = forward(exit_cfg, {**target.params, **h0}, toks, pos, None, causal_mask(*toks.shape))[0]
    net_logits = forward(net_cfg, net_params, toks, pos, None, causal_mask(*toks.shape))[0]
    np.testing.assert_allclose(np.asarray(net_logits), np.asarray(exit_logits), atol=1e-5)  # a zero adapter
    greedy_check(target, ss.make_kangaroo(adapter, kcfg, target, "chain:3"), PROMPTS1, new=8)


# ----------------------------------------------------------------------------- cost: no cache copies
def test_kangaroo_drafts_a_head_bias_targets_own_distribution():
    """A target whose LM head adds a bias (Phi-3.5-MoE): the draft network ends in the target's head through
    output_logits, bias included, so a fresh (zero) adapter's root logits in decoding and its logits in training
    are the target's head on the exit state."""
    from flax import nnx
    from jd_testutil import phimoe_like

    from jaxdecode.models import causal_mask, forward
    from jaxdecode.models.transformer import _norm, output_logits
    from jaxdecode.training.selfspec import KangarooModule, kangaroo_outputs
    cfg, params = phimoe_like(tiny().config)
    kcfg = ss.KangarooConfig(exit_layer=1, threshold=0.0)
    drafter = ss.make_kangaroo(ss.init_adapter(kcfg, cfg, jax.random.PRNGKey(1)), kcfg,
                               types.SimpleNamespace(config=cfg, params=params, path=None), "chain:3")
    toks, lens = pad_prompts(PROMPTS4)
    b, t = toks.shape
    _, hidden, _ = forward(cfg, params, toks, jnp.broadcast_to(jnp.arange(t), (b, t)), None, causal_mask(b, t),
                           return_layers=(0,))  # the state after layer 0: the exit at layer 1
    want = output_logits(cfg, params, _norm(cfg, hidden["layers"][0], params["final_norm"]))  # [B, T, V]
    root, _ = drafter._catch_up(drafter.init(toks, lens, 64, jax.random.PRNGKey(0)), toks, lens, 4)
    np.testing.assert_allclose(np.asarray(root), np.asarray(want[jnp.arange(b), lens - 1]), atol=1e-5)
    module = KangarooModule(kcfg, cfg, nnx.Rngs(0))
    logits_d = kangaroo_outputs(module, {"tokens": toks, "mask": jnp.ones((b, t))}, params)[0]
    np.testing.assert_allclose(np.asarray(logits_d), np.asarray(want), atol=1e-5)


def test_run_time_layer_list_and_in_place_switch_compute_what_they_replace():
    """forward(layer_ids=, num_layers_run=) equals the static sub-network; switch_in_place / run_if equal
    lax.switch / lax.cond."""
    from jaxdecode.models import forward, init_cache, padded_causal_mask
    from jaxdecode.speculative import run_if, switch_in_place
    target = tiny(layers=4)
    cfg, params = target.config, target.params
    toks = jnp.asarray([[3, 9, 27, 4, 5]])
    pos = jnp.arange(5)[None]
    mask = padded_causal_mask(jnp.ones((1, 5), bool))
    cache = init_cache(cfg, 1, 16)
    run = jax.jit(lambda ids, n: forward(cfg, params, toks, pos, cache, mask, layer_ids=ids, num_layers_run=n))
    for skip, ids in (((1, 2), [0, 3, 1]), ((), [0, 1, 2, 3])):  # ids past num_layers_run are ignored
        ref, _, ref_cache = forward(cfg, params, toks, pos, cache, mask, skip_layers=skip)
        got, _, got_cache = run(jnp.asarray(ids), jnp.int32(4 - len(skip)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got_cache.k), np.asarray(ref_cache.k), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="cannot be combined"):
        forward(cfg, params, toks, pos, cache, mask, layer_ids=jnp.asarray([0]), skip_layers=(1,))
    branches = [lambda x: x + 1.0, lambda x: x * 3.0, lambda x: -x]
    for i in (-1, 0, 1, 2, 5):  # clamped like lax.switch
        assert float(switch_in_place(jnp.int32(i), branches, jnp.float32(2.0))) == float(
            jax.lax.switch(i, branches, jnp.float32(2.0)))
    assert float(run_if(jnp.bool_(False), branches[1], jnp.float32(2.0))) == 2.0
    assert float(run_if(jnp.bool_(True), branches[1], jnp.float32(2.0))) == 6.0


def test_early_stop_marks_the_rest_invalid_and_keeps_drafts_distributions():
    """Threshold 0.99 on a random target: only the root's children survive; the slots are untouched."""
    target = tiny()
    d = _kangaroo(target, "chain:3", 0.99)
    toks, lens = pad_prompts(PROMPTS4)
    state = d.init(toks, lens, 64, jax.random.PRNGKey(0))
    from jaxdecode.speculative import DraftContext
    hist = jnp.pad(toks, ((0, 0), (0, 8)))
    tree, slots, _ = d.propose(state, DraftContext(hist, lens, jax.random.PRNGKey(0)), GREEDY)
    conf = np.asarray(slots).max(-1)
    valid = np.asarray(tree.valid)
    assert valid[:, 0].all()
    for b in range(valid.shape[0]):  # kept node i+1 iff node i kept and its distribution was confident
        for i in range(1, 3):
            assert valid[b, i] == (valid[b, i - 1] and conf[b, i] >= 0.99)
    np.testing.assert_allclose(np.asarray(slots).sum(-1)[:, :3], 1.0, atol=1e-5)
    assert ss.depth_widths(d.builder) == (1, 2, 3)


# ----------------------------------------------------------------------------- SWIFT's online choice
def test_swift_finds_the_best_skip_set(monkeypatch):
    """Layers 2 and 3 of the target are near-identity: skipping them drafts almost exactly what the target
    says, skipping 0 and 1 does not. The best set is listed second; SWIFT must settle on it (and greedy
    output stays exact, batch 4 ragged)."""
    target = tiny(layers=4, identity_layers=(2, 3))
    drafter = ss.make_swift(target, "chain:3", skip_sets=[[0, 1], [2, 3]], explore_steps=2, reexplore_every=6)
    seen = []
    original = ss.SelfSpecDrafter._swift_observe

    def logged(self, state, obs):
        new = original(self, state, obs)
        jax.debug.callback(lambda c, s: seen.append((int(c), np.asarray(s))), new.choice, new.score,
                           ordered=True)
        return new

    monkeypatch.setattr(ss.SelfSpecDrafter, "_swift_observe", logged)
    out = greedy_check(target, drafter, PROMPTS4, new=40)
    choices = [c for c, _ in seen]
    assert set(choices[:4]) == {0, 1}, f"both candidates explored first: {choices}"
    late = choices[len(choices) // 2:]
    assert np.mean(np.asarray(late) == 1) >= 0.7, f"SWIFT should mostly use skip set [2, 3]: {choices}"
    score = seen[-1][1]
    assert score[1] > score[0] + 1.0, score
    assert float(np.mean(out.stats["tau"])) > 2.5


# ----------------------------------------------------------------------------- DEL's choice
def test_del_prefers_the_exit_past_which_layers_do_nothing():
    """Layers 2 and 3 are near-identity: exit 2 drafts like the full model at half the cost of exit 4
    would; DEL's warm start from the prompt's states already picks it, with the deepest length."""
    target = tiny(layers=4, identity_layers=(2, 3))
    d = ss.make_del(target, "chain:3", exit_layers=[1, 2, 3])
    toks, lens = pad_prompts(PROMPTS4)
    feats = _prefill_features(target, d, toks, lens)
    state = d.init(toks, lens, 64, jax.random.PRNGKey(0), features=feats)
    alpha = (np.asarray(state.score) + 1) / (np.asarray(state.count) + 2)
    assert alpha[1] > 0.9 and alpha[1] > alpha[0], alpha
    assert int(state.choice) == 1 and int(state.limit) == 3


def _prefill_features(target, drafter, toks, lens):
    from jaxdecode.autoregressive import prefill
    from jaxdecode.models import init_cache
    from jaxdecode.speculative import feature_request, select_features
    cache = init_cache(target.config, toks.shape[0], 64)
    _, _, hidden = prefill(target.config, target.params, toks, lens - 1, cache,
                           return_layers=feature_request(drafter.feature_layers), with_hidden=True)
    return select_features(hidden, drafter.feature_layers)


# ----------------------------------------------------------------------------- building and errors
def test_make_drafter_by_name_and_clear_errors():
    target = tiny(layers=4)
    d = make_drafter("swift", target, tree="chain:3", skip_sets=[[1, 2]])
    assert d.policy == "fixed" and d.candidates == (ss.SubNet(None, (1, 2)),)
    d = make_drafter("swift", target, tree="chain:3", temperature=0.7)
    assert d.policy == "swift" and d.child_rule == "sample" and len(d.candidates) >= 2
    d = make_drafter("del", target, tree="static:2,1")
    assert d.candidates == (ss.SubNet(1), ss.SubNet(2), ss.SubNet(3)) and d.feature_layers == (0, 1, 2, "final")
    with pytest.raises(ss.SelfSpecError, match=r"layers \[7\].*4-layer"):
        make_drafter("swift", target, skip_sets=[[7]])
    with pytest.raises(ss.SelfSpecError, match="runs every layer"):
        make_drafter("del", target, exit_layers=[4])
    with pytest.raises(ss.SelfSpecError, match="drafter 'swift' takes no option 'exit_layers'; its options: skip_"):
        make_drafter("swift", target, exit_layers=[1])
    with pytest.raises(ss.SelfSpecError, match="exit_layer 4 must be below"):
        ss.init_adapter(ss.KangarooConfig(exit_layer=4), target.config, jax.random.PRNGKey(0))
    with pytest.raises(ss.SelfSpecError, match="threshold"):
        ss.KangarooConfig(threshold=1.5)
    assert ss.default_skip_sets(12)[0] == (1, 3, 5, 7, 9)
    assert ss.default_exit_layers(12) == (3, 6, 9)


# ----------------------------------------------------------------------------- sampling is lossless
@pytest.mark.slow  # ~1 min of CPU: 2 x 1e5 rows through the loop, two verifiers
def test_sampling_is_lossless_through_the_model_loop():
    """Kangaroo with the early stop (i.i.d. chain, the `chain` verifier) matches the target's law of the
    first two tokens; the lossy `typical` rule on the same drafter's top-k tree fails the same test."""
    from test_verifier_pairs import P_BROKEN, P_OK, chi2_pvalue, exact_joint
    v, prompt, rows = 6, [2, 5], 100_000
    cfg = tiny(layers=2, vocab=v).config
    params = init_params(cfg, jax.random.PRNGKey(3), std=0.6)  # spread logits: a non-trivial law
    target = types.SimpleNamespace(config=cfg, params=params, path=None)
    joint = exact_joint(target.config, params, prompt, v)
    t1 = SamplerConfig(temperature=1.0)
    results = {}
    for name, tree in (("chain", "chain:2"), ("typical", "static:2,1")):
        d = _kangaroo(target, ss._tree(tree, 1.0) if name == "chain" else tree, 0.4)
        toks = np.tile(np.asarray(prompt, np.int32), (rows // 2, 1))
        lens = np.full((rows // 2,), len(prompt), np.int32)
        outs = [np.asarray(speculative_decode(target.config, params, d, toks, lens, max_new_tokens=2,
                                              verifier=get_verifier(name), sampler=t1,
                                              key=jax.random.key(10 + k, impl="rbg")).tokens)
                for k in range(2)]
        results[name] = chi2_pvalue(np.concatenate(outs), joint)
    assert results["chain"] > P_OK, results
    assert results["typical"] < P_BROKEN, results


# ----------------------------------------------------------------------------- Kangaroo training
def test_kangaroo_training_lowers_loss_raises_tau_and_round_trips(tmp_path):
    from jaxdecode.training.drafters import params_of
    from jaxdecode.training.selfspec import KangarooModule, kangaroo_loss
    from jaxdecode.training.trainer import TrainConfig, train
    from flax import nnx

    target = tiny(layers=4, seed=5)
    cfg = ss.KangarooConfig(exit_layer=1, threshold=0.0, hidden_weight=0.1)
    module = KangarooModule(cfg, target.config, nnx.Rngs(0))
    # Training text: the target's own greedy continuations of random prompts (what it will verify).
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 64, size=(64, 4)).astype(np.int32)
    text = decode(target.config, target.params, starts, np.full((64,), 4, np.int32), max_new_tokens=28,
                  sampler=SamplerConfig(temperature=1.0), method="sample", key=jax.random.PRNGKey(0))
    text = np.concatenate([starts, np.asarray(text.tokens)], axis=1)  # [64, 32]
    batches = lambda step: {"tokens": text[(step % 4) * 16:(step % 4 + 1) * 16],  # noqa: E731
                            "mask": np.ones((16, 32), np.float32)}
    constants = {"target": target.params}
    before, aux0 = kangaroo_loss(module, batches(0), constants)
    tau_before = _tau(target, ss.make_kangaroo(params_of(module), cfg, target, "chain:3"))
    res = train(module, kangaroo_loss, batches, TrainConfig(steps=60, learning_rate=1e-2, warmup_steps=5,
                                                             weight_decay=0.0, log_every=20, eval_every=0,
                                                             checkpoint_every=0, data_parallel=1,
                                                             progress=False), tmp_path / "work",
                constants=constants)
    after, aux = kangaroo_loss(res.module, batches(0), constants)
    # the soft cross-entropy includes the target's own entropy, which no adapter removes
    assert float(after) < float(before) - 0.3 and float(aux["acc"]) > float(aux0["acc"]) + 0.1, (
        float(before), float(after), float(aux0["acc"]), float(aux["acc"]))
    params = params_of(res.module)
    tau_after = _tau(target, ss.make_kangaroo(params, cfg, target, "chain:3"))
    print(f"kangaroo tau {tau_before:.2f} -> {tau_after:.2f}")
    assert tau_after > tau_before + 0.1, (tau_before, tau_after)

    save_drafter(tmp_path / "kangaroo", "kangaroo", cfg, params, target.config, extra={"tau": tau_after})
    loaded = make_drafter("kangaroo", target, tree="chain:3", drafter_dir=tmp_path / "kangaroo", threshold=0.0)
    assert _tau(target, loaded) == pytest.approx(tau_after)
    with pytest.raises(Exception, match="num_layers"):
        make_drafter("kangaroo", tiny(layers=3), tree="chain:3", drafter_dir=tmp_path / "kangaroo")


def _tau(target, drafter):
    out = greedy_check(target, drafter, PROMPTS4, new=24)
    return float(np.sum(out.lengths) / np.sum(out.stats["verify_calls"]))


@pytest.mark.parametrize("skip_sets", [[[1]], [[1], [2]]])
def test_catches_up_over_several_blocks(skip_sets):
    """Left behind by steps that drafted nothing (no idle step), the self-draft catches up on every
    committed token it missed, max_depth + 1 per forward, and proposes exactly what it proposes from
    a cache prefilled with the same history; rows 2, 6 and 12 tokens behind end up alike."""
    from jaxdecode.speculative import DraftContext
    target = tiny()
    drafter = ss.make_swift(target, "chain:2", skip_sets=skip_sets)
    history = jnp.asarray(np.random.RandomState(0).randint(1, 64, size=(3, 14)), jnp.int32)
    start = jnp.asarray([13, 9, 3], jnp.int32)  # init saw start - 1 tokens
    full = jnp.full((3,), 14, jnp.int32)
    key = jax.random.PRNGKey(0)
    lagging, fresh = drafter.init(history, start, 32, key), drafter.init(history, full, 32, key)
    ctx = DraftContext(history=history, hist_len=full, key=key)
    tree_a, _, state_a = drafter.propose(lagging, ctx, GREEDY)
    tree_b, _, _ = drafter.propose(fresh, ctx, GREEDY)
    np.testing.assert_array_equal(np.asarray(state_a.cache.lengths), np.asarray(full))
    np.testing.assert_array_equal(np.asarray(tree_a.tokens), np.asarray(tree_b.tokens))
