"""Sharded on a simulated 2x4 (data x model) mesh equals single device."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.models import ModelConfig, causal_mask, forward, init_cache, init_params
from jaxdecode.sampling import SamplerConfig
from jaxdecode.sharding import make_mesh, shard_batch, shard_cache, shard_params, spec_for

CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     max_position_embeddings=128)


@pytest.fixture(scope="module")
def setup():
    assert jax.device_count() >= 8, "tests/conftest.py should simulate 8 CPU devices"
    params = init_params(CONFIG, jax.random.PRNGKey(0), std=0.3)
    return params, make_mesh(data=2, model=4, devices=jax.devices()[:8])


def test_rules_shard_heads_and_replicate_what_does_not_divide(setup):
    params, mesh = setup
    sp = shard_params(params, mesh)
    assert sp["layers"]["wq"].sharding.spec == jax.sharding.PartitionSpec(None, None, "model", None)
    # 2 KV heads do not divide a 4-way model axis: replicated rather than an error
    assert sp["layers"]["wk"].sharding.spec == jax.sharding.PartitionSpec(None, None, None, None)
    assert sp["layers"]["w_up"].sharding.spec == jax.sharding.PartitionSpec(None, None, "model")
    assert spec_for(("batch", None), (3, 5), mesh) == jax.sharding.PartitionSpec(None, None)


def test_sharded_forward_equals_single_device(setup):
    params, mesh = setup
    toks = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 6)))
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    mask = causal_mask(2, 6)
    ref, _, ref_cache = forward(CONFIG, params, toks, pos, init_cache(CONFIG, 2, 16), mask)
    got, _, got_cache = forward(CONFIG, shard_params(params, mesh), shard_batch(toks, mesh),
                                shard_batch(pos, mesh), shard_cache(init_cache(CONFIG, 2, 16), mesh),
                                shard_batch(mask, mesh))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_cache.k), np.asarray(ref_cache.k), atol=1e-5)


def test_sharded_mixture_of_experts_equals_single_device(setup):
    """Each expert's MLP width splits over `model` (the experts' axis stays whole): decode equals one device."""
    _, mesh = setup
    cfg = CONFIG.replace(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16)
    params = init_params(cfg, jax.random.PRNGKey(1), std=0.3)
    sp = shard_params(params, mesh)
    assert sp["layers"]["we_up"].sharding.spec == jax.sharding.PartitionSpec(None, None, None, "model")
    prompts, lengths = pad_prompts([[3, 9, 27, 4, 1], [8, 2], [5, 5, 5], [60, 1, 33, 7]])
    kw = dict(max_new_tokens=6, sampler=SamplerConfig(temperature=0.0), method="greedy")
    ref = decode(cfg, params, prompts, lengths, **kw)
    got = decode(cfg, sp, shard_batch(prompts, mesh), shard_batch(lengths, mesh), **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))


def _check_sharded_forward(cfg, params, sharded, mesh):
    """The forward over sharded params and batch equals the single-device one (two ragged rows)."""
    from jaxdecode.models import padded_causal_mask
    toks = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 6)))
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    mask = padded_causal_mask(jnp.arange(6)[None, :] < jnp.asarray([6, 3])[:, None])
    ref, _, _ = forward(cfg, params, toks, pos, None, mask)
    got, _, _ = forward(cfg, sharded, shard_batch(toks, mesh), shard_batch(pos, mesh), None, shard_batch(mask, mesh))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)


@pytest.mark.parametrize("layout", ["olmo2", "phi3_longrope"])
def test_sharded_olmo2_and_longrope_forward_equals_single_device(setup, layout):
    """OLMo 2's query / key norms over all heads shard with the heads (the norm then reduces across devices);
    Phi-3's LongRoPE picks its factors per row, rows on different devices (row 0 past the switch, row 1 not)."""
    _, mesh = setup
    if layout == "olmo2":
        cfg = CONFIG.replace(model_type="olmo2", num_kv_heads=4, post_norms=True, qk_norm=True, qk_norm_full=True)
    else:
        cfg = CONFIG.replace(model_type="phi3", partial_rotary_factor=0.75, rope_scaling=(
            ("long_factor", (3.0, 4.0, 5.0)), ("original_max_position_embeddings", 4), ("rope_type", "longrope"),
            ("short_factor", (1.0, 1.5, 2.0))))
    params = init_params(cfg, jax.random.PRNGKey(2), std=0.3)
    params["layers"] = {k: (v if "norm" not in k else {"scale": v["scale"] + 0.3 * jnp.arange(v["scale"].size)
                                                       .reshape(v["scale"].shape) / v["scale"].size})
                        for k, v in params["layers"].items()}
    sp = shard_params(params, mesh)
    if layout == "olmo2":
        assert sp["layers"]["q_norm"]["scale"].sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    _check_sharded_forward(cfg, params, sp, mesh)


@pytest.mark.parametrize("layout", ["qwen2_moe", "olmoe"])
def test_sharded_shared_expert_and_olmoe_forward_equals_single_device(setup, layout):
    """Qwen2-MoE's shared expert splits its width over `model` as a dense MLP (its one-logit gate whole); OLMoE's
    query / key norms over all heads (without OLMo 2's output norms) shard with the heads, its clamp after them."""
    _, mesh = setup
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    if layout == "qwen2_moe":
        cfg = CONFIG.replace(model_type="qwen2_moe", qkv_bias=True, shared_expert_intermediate_size=24, **moe)
    else:
        cfg = CONFIG.replace(model_type="olmoe", num_kv_heads=4, qk_norm=True, qk_norm_full=True, clip_qkv=0.5, **moe)
    params = init_params(cfg, jax.random.PRNGKey(3), std=0.3)
    sp = shard_params(params, mesh)
    if layout == "qwen2_moe":
        assert sp["layers"]["ws_up"].sharding.spec == jax.sharding.PartitionSpec(None, None, "model")
        assert sp["layers"]["ws_down"].sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
        assert sp["layers"]["w_shared_gate"].sharding.spec == jax.sharding.PartitionSpec(None, None, None)
    else:
        assert sp["layers"]["k_norm"]["scale"].sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    _check_sharded_forward(cfg, params, sp, mesh)


@pytest.mark.parametrize("layout", ["cohere", "cohere2"])
def test_sharded_cohere_forward_equals_single_device(setup, layout):
    """Command-R's per-head query / key norm scales shard with the heads (each head normed where it lies), its
    parallel block reads one LayerNorm, its q / k biases shard as the heads; Command R7B's sliding layer rotates,
    its full one does not. Every norm scale and bias random, so a misplaced shard shows."""
    _, mesh = setup
    cohere = dict(parallel_block=True, norm_center=True, logit_scale=0.5)
    if layout == "cohere":
        cfg = CONFIG.replace(model_type="cohere", num_kv_heads=4, qk_norm=True, qk_norm_head_scales=True,
                             qkv_bias=True, o_bias=True, **cohere)
    else:
        cfg = CONFIG.replace(model_type="cohere2", sliding_windows=(3, 0), rope_layers=(1, 0), **cohere)
    rng = np.random.default_rng(4)
    params = jax.tree.map(lambda a: a + jnp.asarray(rng.normal(0, 0.3, a.shape), a.dtype),
                          init_params(cfg, jax.random.PRNGKey(4), std=0.3))
    sp = shard_params(params, mesh)
    assert "mlp_norm" not in sp["layers"]
    if layout == "cohere":
        assert sp["layers"]["k_norm"]["scale"].sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
        assert sp["layers"]["bq"].sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    _check_sharded_forward(cfg, params, sp, mesh)


def test_sharded_granitemoeshared_forward_equals_single_device(setup):
    """Granite-MoE-shared: its multipliers, experts split over `model` as every MoE's, the ungated shared MLP's
    width over `model` as a dense MLP's."""
    _, mesh = setup
    cfg = CONFIG.replace(model_type="granitemoeshared", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                         shared_expert_intermediate_size=24, embedding_multiplier=3.0, residual_multiplier=0.3,
                         attention_multiplier=0.2, logits_scaling=2.5)
    params = init_params(cfg, jax.random.PRNGKey(4), std=0.3)
    sp = shard_params(params, mesh)
    assert sp["layers"]["ws_gate"].sharding.spec == jax.sharding.PartitionSpec(None, None, "model")
    assert sp["layers"]["ws_down"].sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    assert "w_shared_gate" not in sp["layers"]
    _check_sharded_forward(cfg, params, sp, mesh)


def test_sharded_phimoe_forward_equals_single_device(setup):
    """Phi-3.5-MoE: LayerNorm biases whole, the LM-head bias split over `model` with the vocabulary, sparsemixer
    routing, LongRoPE's factors and mscales per row (row 0 past the switch, row 1 not)."""
    _, mesh = setup
    cfg = CONFIG.replace(model_type="phimoe", layer_norm=True, lm_head_bias=True, qkv_bias=True, o_bias=True,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, moe_norm_topk=False,
                         sparsemixer_eps=0.3, sliding_windows=(4, 4), rope_scaling=(
                             ("long_factor", (2.0, 4.0, 6.0, 8.0)), ("long_mscale", 1.5),
                             ("original_max_position_embeddings", 4), ("rope_type", "longrope"),
                             ("short_factor", (1.0, 1.5, 2.0, 3.0)), ("short_mscale", 1.2)))
    params = init_params(cfg, jax.random.PRNGKey(5), std=0.2)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(  # biases and norm scales away from 0 and 1
        lambda path, a: a + jnp.asarray(rng.normal(0, 0.3, a.shape), a.dtype)
        if "bias" in jax.tree_util.keystr(path) or "scale" in jax.tree_util.keystr(path) else a, params)
    sp = shard_params(params, mesh)
    assert sp["lm_head_bias"].sharding.spec == jax.sharding.PartitionSpec("model")
    assert sp["layers"]["attn_norm"]["bias"].sharding.spec == jax.sharding.PartitionSpec(None, None)
    _check_sharded_forward(cfg, params, sp, mesh)


@pytest.mark.parametrize("method,sampler", [("greedy", SamplerConfig(temperature=0.0)),
                                            ("sample", SamplerConfig(temperature=0.8, top_k=20))])
def test_sharded_decode_equals_single_device(setup, method, sampler):
    params, mesh = setup
    prompts, lengths = pad_prompts([[3, 9, 27, 4, 1], [8, 2], [5, 5, 5], [60, 1, 33, 7]])
    kw = dict(max_new_tokens=8, sampler=sampler, method=method, key=jax.random.PRNGKey(3))
    ref = decode(CONFIG, params, prompts, lengths, **kw)
    got = decode(CONFIG, shard_params(params, mesh), shard_batch(prompts, mesh),
                 shard_batch(lengths, mesh), **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths))


def test_mesh_errors():
    with pytest.raises(ValueError, match="must divide the number of devices"):
        make_mesh(model=3, devices=jax.devices()[:8])
    with pytest.raises(ValueError, match="needs 6 devices"):
        make_mesh(data=3, model=2, devices=jax.devices()[:8])
    with pytest.raises(ValueError, match="data >= 1"):
        make_mesh(data=0, model=8, devices=jax.devices()[:8])


def test_meshes_named_otherwise_are_refused_and_a_data_only_mesh_works(tiny_llama_dir):
    """Axes not named data/model: a clear error, not a KeyError; a mesh with only a 'data' axis shards the
    batch and replicates the parameters."""
    import jaxdecode
    from jaxdecode.options import OptionError
    from jaxdecode.sharding import check_mesh
    devices = np.asarray(jax.devices()[:8])
    odd = jax.sharding.Mesh(devices.reshape(4, 2), ("x", "y"))
    with pytest.raises(ValueError, match="axes are \\('x', 'y'\\).*named 'data'"):
        check_mesh(odd)
    model = jaxdecode.load(tiny_llama_dir)
    with pytest.raises(OptionError, match="option mesh: the mesh's axes are"):
        jaxdecode.generate(model, ["def f(", "x"], max_new_tokens=3, mesh=odd)
    with pytest.raises(ValueError, match="named 'data'"):
        jaxdecode.load(tiny_llama_dir, mesh=odd)
    data_only = jax.sharding.Mesh(devices, ("data",))
    want = [r.tokens for r in jaxdecode.generate(model, ["def f(", "x"], max_new_tokens=3, eos_ids=[])]
    got = jaxdecode.generate(model, ["def f(", "x"], max_new_tokens=3, eos_ids=[], mesh=data_only)
    assert [r.tokens for r in got] == want


def test_a_mesh_from_jax_make_mesh_works(tiny_llama_dir):
    """jax.make_mesh makes Explicit axes by default; load / generate / score take such a mesh as they take
    jaxdecode.sharding.make_mesh's (Auto axes) and give the unsharded tokens (it failed inside the embedding
    gather with a ShardingTypeError)."""
    import jaxdecode
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    model = jaxdecode.load(tiny_llama_dir)
    sharded = jaxdecode.load(tiny_llama_dir, mesh=mesh)
    prompts = ["def f(", "x = 1"]
    for kw in (dict(method="greedy"), dict(method="speculative", drafter="prompt_lookup", tree="chain:3",
                                            adaptive=False)):
        want = [r.tokens for r in jaxdecode.generate(model, prompts, max_new_tokens=4, eos_ids=[], **kw)]
        got = jaxdecode.generate(sharded, prompts, max_new_tokens=4, eos_ids=[], mesh=mesh, **kw)
        assert [r.tokens for r in got] == want, kw
    assert np.allclose(jaxdecode.score(sharded, prompts, mesh=mesh)[0].total, jaxdecode.score(model, prompts)[0].total,
                       atol=1e-4)


@pytest.mark.parametrize("axes", [("data",), ("model",)])
def test_one_axis_meshes_run_every_decoder_family(tiny_llama_dir, axes):
    """A mesh with only a 'data' or only a 'model' axis (the other counts as size 1): speculative decoding
    (its verification's attention under shard_map) and constrained beam search equal one device."""
    import jaxdecode
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]), axes)
    model = jaxdecode.load(tiny_llama_dir)
    prompts = ["def f(", "x = 1"]
    for kw in (dict(method="speculative", drafter="prompt_lookup", tree="chain:3", adaptive=False, eos_ids=[]),
               dict(method="beam", num_beams=2, regex="[a-z ]+")):
        want = [r.tokens for r in jaxdecode.generate(model, prompts, max_new_tokens=4, **kw)]
        got = jaxdecode.generate(model, prompts, max_new_tokens=4, mesh=mesh, **kw)
        assert [r.tokens for r in got] == want, (axes, kw)


def test_explicit_meshes_inside_set_mesh_and_a_callers_jit(tiny_llama_dir):
    """jax.make_mesh's Explicit axes: generate / score / decode run inside `with jax.set_mesh(mesh)`;
    param_shardings places parameters as shard_params does (Auto axes); arrays placed on the Explicit axes
    and passed into the caller's own jit are refused up front with the way to place them."""
    import jaxdecode
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxdecode.sharding import param_shardings
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    model = jaxdecode.load(tiny_llama_dir)
    prompts = ["def f(", "x = 1"]
    want = [r.tokens for r in jaxdecode.generate(model, prompts, max_new_tokens=4, eos_ids=[])]
    tokens, lengths = pad_prompts([model.encode(p) for p in prompts])
    placed = jax.device_put(model.params, param_shardings(model.params, mesh))
    assert jax.tree.leaves(placed)[0].sharding.mesh.axis_types == shard_params(model.params, mesh)[
        "embed"].sharding.mesh.axis_types
    with jax.set_mesh(mesh):
        assert [r.tokens for r in jaxdecode.generate(model, prompts, max_new_tokens=4, eos_ids=[],
                                                     mesh=mesh)] == want
        assert np.isfinite(jaxdecode.score(model, prompts, mesh=mesh)[0].total)
        out = decode(model.config, placed, tokens, lengths, max_new_tokens=4, method="greedy", eos_ids=())
        assert np.asarray(out.tokens).tolist() == want
    rows = NamedSharding(mesh, P("data"))
    own = jax.jit(lambda p, t, n: decode(model.config, p, t, n, max_new_tokens=4, method="greedy").tokens)
    with pytest.raises(ValueError, match=r"prompt_tokens is sharded over the Explicit mesh axes \('data',\) .* "
                                         r"place the arrays with jaxdecode.sharding.shard_params / shard_batch"):
        own(placed, jax.device_put(tokens, rows), jax.device_put(lengths, rows))


@pytest.mark.parametrize("tree,temperature,verifier", [("eagle:depth=3,topk=2,total=5", 0.0, "greedy"),
                                                       ("static:2,2:iid", 0.8, "specinfer")])
def test_sharded_speculative_equals_single_device(setup, tree, temperature, verifier):
    from jaxdecode.drafters import DraftLM, parse_tree_spec
    from jaxdecode.speculative import speculative_decode
    from jaxdecode.verifiers import get_verifier

    params, mesh = setup
    dcfg = CONFIG.replace(num_layers=1, sliding_windows=(0,))
    dparams = init_params(dcfg, jax.random.PRNGKey(7), std=0.3)
    prompts, lengths = pad_prompts([[3, 9, 27, 4, 1], [8, 2], [5, 5, 5], [60, 1, 33, 7]])
    kw = dict(max_new_tokens=8, verifier=get_verifier(verifier),
              sampler=SamplerConfig(temperature=temperature), key=jax.random.PRNGKey(5))
    ref = speculative_decode(CONFIG, params, DraftLM(params=dparams, config=dcfg,
                                                     builder=parse_tree_spec(tree)), prompts, lengths, **kw)
    sharded_drafter = DraftLM(params=shard_params(dparams, mesh), config=dcfg, builder=parse_tree_spec(tree))
    # mesh: the verification forward runs its attention op under shard_map on the local shards
    got = speculative_decode(CONFIG, shard_params(params, mesh), sharded_drafter,
                             shard_batch(prompts, mesh), shard_batch(lengths, mesh), mesh=mesh, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(got.stats["verify_calls"]), np.asarray(ref.stats["verify_calls"]))


KERNEL_CONFIG = CONFIG.replace(num_heads=8, num_kv_heads=4, sliding_windows=(0, 5))  # KV=4 splits over model=4


def test_sharded_forward_runs_the_kernel_under_shard_map(setup):
    """With a mesh, the tree-attention kernel (interpret mode) runs on each device's shard (batch over
    data, KV heads over model) inside the sharded forward, and equals the single-device forward."""
    from jaxdecode.models import KVCache
    from jaxdecode.tree import ancestor_mask, depths

    _, mesh = setup
    params = init_params(KERNEL_CONFIG, jax.random.PRNGKey(1), std=0.3)
    rng = np.random.RandomState(2)
    shape = (2, 2, 4, 16, 8)  # [L, B, KV, S, hd]; rows hold 6 and 3 committed tokens
    cache = KVCache(k=jnp.asarray(rng.normal(size=shape), jnp.float32),
                    v=jnp.asarray(rng.normal(size=shape), jnp.float32), lengths=jnp.array([6, 3], jnp.int32))
    parents = jnp.array([[-1, 0, 0, 1], [-1, -1, 0, 2]])
    toks = jnp.asarray(rng.randint(0, 64, (2, 4)))
    pos = cache.lengths[:, None] + depths(parents) - 1
    mask = ancestor_mask(parents)
    ref, _, ref_cache = forward(KERNEL_CONFIG, params, toks, pos, cache, mask)

    sharded = (shard_params(params, mesh), shard_batch(toks, mesh), shard_batch(pos, mesh),
               shard_cache(cache, mesh), shard_batch(mask, mesh))
    fwd = jax.jit(lambda p, t, q, c, m: forward(KERNEL_CONFIG, p, t, q, c, m, attn_impl="interpret", mesh=mesh))
    text = fwd.lower(*sharded).as_text()
    assert "SPMDFullToShardShape" in text or "manual_computation" in text  # shard_map regions
    got, _, got_cache = fwd(*sharded)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5)
    np.testing.assert_allclose(np.asarray(got_cache.k), np.asarray(ref_cache.k), atol=2e-5)
