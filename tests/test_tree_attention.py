"""Tree attention: the Pallas kernel (interpret mode, both lowerings) and the blockwise jnp form equal the
dense reference (also over a stacked [L, B, KV, S, hd] cache read at a layer), the sharded op equals the
unsharded one, and the GPU/TPU lowerings of the kernel build (block-shape rules) without the hardware."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxdecode.kernels.tree_attention import (block_plan, sharded_tree_attention, tree_attention,
                                              tree_attention_blockwise, tree_attention_pallas,
                                              tree_attention_reference)
from jaxdecode.sharding import make_mesh

TREES = {  # parents (-1 = child of the last committed token), valid nodes
    "chain": ([-1, 0, 1, 2, 3, 4, 5], None),
    "branching": ([-1, -1, 0, 0, 1, 2, 2], None),
    "padded": ([-1, -1, 0, 0, 1, 2, 2], [1, 1, 1, 1, 1, 0, 0]),  # two invalid padding nodes
    "padded8": ([-1, -1, 0, 0, 1, 2, 2, 3], [1, 1, 1, 1, 1, 1, 1, 0]),
    "chain40": (list(range(-1, 39)), None),  # wider than one 16-key window block
    "padded24": ([i // 2 - 1 for i in range(24)], [1] * 20 + [0] * 4),
}


def ancestor_mask(parents, valid):
    """bool[N, N]: A[i, j] = j is i or an ancestor of i, both valid (as jaxdecode.tree builds it)."""
    n = len(parents)
    a = np.eye(n, dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            a[i] |= a[p]
    v = np.ones(n, bool) if valid is None else np.asarray(valid, bool)
    return a & v[:, None] & v[None, :]


def make_inputs(seed, *, h=4, kv=2, s=64, hd=16, tree="branching", lengths=(0, 37), dtype=jnp.float32):
    """Fresh random q and caches; a tree; ragged lengths; node positions = length + depth - 1."""
    rng = np.random.default_rng(seed)
    parents, valid = TREES[tree]
    b, n = len(lengths), len(parents)
    mask = ancestor_mask(parents, valid)
    depth = mask.sum(axis=1) if valid is None else ancestor_mask(parents, None).sum(axis=1)
    lens = np.asarray(lengths, np.int32)
    q = jnp.asarray(rng.normal(size=(b, n, h, hd)), dtype)
    k = jnp.asarray(rng.normal(size=(b, kv, s, hd)), dtype)
    v = jnp.asarray(rng.normal(size=(b, kv, s, hd)), dtype)
    return dict(q=q, k_cache=k, v_cache=v, lengths=jnp.asarray(lens),
                tree_mask=jnp.asarray(np.broadcast_to(mask, (b, n, n))),
                q_positions=jnp.asarray(lens[:, None] + depth[None, :] - 1, jnp.int32))


def call(fn, inp, window=0, **kw):
    return fn(inp["q"], inp["k_cache"], inp["v_cache"], inp["lengths"], inp["tree_mask"],
              q_positions=inp["q_positions"], window=window, **kw)


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else dict(atol=2e-2, rtol=2e-2)


def assert_close(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol(dtype))


# name: (make_inputs kwargs, window, pallas kwargs)
KERNEL_CASES = {
    "gqa-branching-f32": (dict(seed=1), 0, dict(block_k=16)),
    "mha-chain-f32-window-scale": (dict(seed=2, h=2, kv=2, tree="chain", lengths=(5, 50)), 8,
                                   dict(block_k=16, sm_scale=0.3)),
    "gqa-padded-bf16-empty-prefix": (dict(seed=3, tree="padded", lengths=(0, 20), dtype=jnp.bfloat16), 0,
                                     dict(block_k=16)),
    "gqa-branching-bf16-window": (dict(seed=4, lengths=(3, 40), dtype=jnp.bfloat16), 4, {}),
    "odd-shapes-hd24-s40-g4": (dict(seed=5, h=4, kv=1, hd=24, s=40, tree="chain", lengths=(33, 0)), 0, {}),
    "query-blocks-padded-window": (dict(seed=6, h=4, kv=1, hd=32, tree="padded8", lengths=(12, 0)), 6,
                                   dict(block_k=16, block_m=16)),
    # Gemma 2's soft-capped scores (a cap small enough that it changes them: see the test below)
    "gqa-softcap-window": (dict(seed=9, lengths=(7, 30)), 5, dict(block_k=16, sm_scale=2.0, softcap=1.5)),
}
# the GPU lowering's tree window in several blocks (a 256-node tree on an H200 needs 4 of 128 keys)
GPU_KERNEL_CASES = {
    "window-blocks-f32": (dict(seed=7, s=128, tree="chain40", lengths=(9, 60)), 0, dict(block_k=16, block_w=16)),
    "window-blocks-bf16-window": (dict(seed=8, h=4, kv=1, tree="padded24", lengths=(0, 17), dtype=jnp.bfloat16), 5,
                                  dict(block_w=16)),
}


@pytest.mark.parametrize("variant,case", [(v, c) for v in ("tpu", "gpu") for c in KERNEL_CASES]
                         + [("gpu", c) for c in GPU_KERNEL_CASES])
def test_kernel_interpret_matches_reference(case, variant):
    inp_kw, window, kw = {**KERNEL_CASES, **GPU_KERNEL_CASES}[case]
    inp = make_inputs(**inp_kw)
    dtype = inp["q"].dtype
    want = call(tree_attention_reference, inp, window, sm_scale=kw.get("sm_scale"), softcap=kw.get("softcap"))
    got = call(tree_attention_pallas, inp, window, interpret=True, variant=variant, **kw)
    assert_close(got, want, dtype)
    assert np.all(np.isfinite(np.asarray(got, np.float32)))


@pytest.mark.parametrize("variant", ["tpu", "gpu"])
def test_kernel_skips_blocks_outside_prefix_and_window(variant):
    """NaN in cache blocks no query may see (past the prefix and tree; before every window) must not
    reach the output: the kernel never reads them (the reference, reading all S slots, would be NaN)."""
    inp = make_inputs(18, lengths=(5, 20))  # S=64, block_k=16, tree slots 5..11 and 20..26
    want = call(tree_attention_reference, inp, 4)
    poison = np.zeros(inp["v_cache"].shape, np.float32)
    poison[:, :, 32:] = np.nan  # blocks 2, 3: past every row's prefix and tree
    poison[1, :, :16] = np.nan  # row 1, block 0: before all its nodes' windows (positions >= 20)
    bad = dict(inp, k_cache=inp["k_cache"] + poison, v_cache=inp["v_cache"] + poison)
    assert_close(call(tree_attention_pallas, bad, 4, interpret=True, variant=variant, block_k=16), want,
                 jnp.float32)


def test_public_op_dispatch_on_cpu():
    inp = make_inputs(7, tree="padded", lengths=(9, 0))
    ref = call(tree_attention_reference, inp, 5)
    np.testing.assert_array_equal(call(tree_attention, inp, 5), call(tree_attention_blockwise, inp, 5))  # auto
    assert_close(call(tree_attention, inp, 5), ref, jnp.float32)
    assert_close(call(tree_attention, inp, 5, impl="interpret"), ref, jnp.float32)
    # no positions needed without a window
    no_pos = tree_attention(inp["q"], inp["k_cache"], inp["v_cache"], inp["lengths"], inp["tree_mask"])
    assert_close(no_pos, call(tree_attention_reference, inp, 0), jnp.float32)


@pytest.mark.parametrize("block_k", [16, 24, 256])  # 24: S=64 ends in a block moved back to end at S
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_blockwise_matches_reference(case, block_k):
    inp_kw, window, kw = KERNEL_CASES[case]
    inp = make_inputs(**inp_kw)
    want = call(tree_attention_reference, inp, window, sm_scale=kw.get("sm_scale"), softcap=kw.get("softcap"))
    got = call(tree_attention_blockwise, inp, window, sm_scale=kw.get("sm_scale"), block_k=block_k,
               softcap=kw.get("softcap"))
    assert_close(got, want, inp["q"].dtype)


def test_softcap_is_tanh_of_the_scaled_scores():
    """The soft-capped reference equals plain attention over c * tanh(scores / c), and differs from the
    uncapped op, so the kernel cases with a softcap test it."""
    inp_kw, window, kw = KERNEL_CASES["gqa-softcap-window"]
    inp = make_inputs(**inp_kw)
    capped = call(tree_attention_reference, inp, window, sm_scale=2.0, softcap=1.5)
    plain = call(tree_attention_reference, inp, window, sm_scale=2.0)
    assert float(jnp.max(jnp.abs(capped - plain))) > 1e-2
    from jaxdecode.kernels.tree_attention import _score
    x = jnp.linspace(-5.0, 5.0, 11)
    np.testing.assert_allclose(_score(2.0, 1.5, 64)(x), 1.5 * np.tanh(2.0 * np.asarray(x) / 1.5), rtol=1e-6)
    np.testing.assert_allclose(_score(None, None, 64)(x), np.asarray(x) / 8.0, rtol=1e-6)


@pytest.mark.parametrize("backend,want", [("cpu", 64), ("gpu", 4096), ("tpu", 256)])
def test_blockwise_default_block_by_backend(monkeypatch, backend, want):
    """CPU follows the prefix in small blocks; a GPU sweeps caches up to 4096 slots at once (a loop trip
    costs a device round trip there)."""
    from jaxdecode.kernels.tree_attention import blockwise_block_k
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert blockwise_block_k() == want


def test_blockwise_reads_only_blocks_some_row_needs():
    """NaN in cache blocks past every row's prefix and tree must not reach the output: the loop stops at
    the longest prefix, whatever the capacity."""
    inp = make_inputs(18, lengths=(5, 20))  # S=64, tree slots 5..11 and 20..26
    want = call(tree_attention_reference, inp, 4)
    poison = np.zeros(inp["v_cache"].shape, np.float32)
    poison[:, :, 32:] = np.nan
    bad = dict(inp, k_cache=inp["k_cache"] + poison, v_cache=inp["v_cache"] + poison)
    assert_close(call(tree_attention_blockwise, bad, 4, block_k=16), want, jnp.float32)


@pytest.mark.parametrize("impl", ["reference", "blockwise", "interpret"])
def test_stacked_cache_read_at_a_layer(impl):
    """A [L, B, KV, S, hd] cache with `layer` (a traced scalar, as in the model's layer scan) is layer
    `layer` of the stack: the model reads its cache in place this way."""
    inp = make_inputs(19, lengths=(6, 30))
    other = make_inputs(20, lengths=(6, 30))
    k_all = jnp.stack([other["k_cache"], inp["k_cache"], other["k_cache"]])
    v_all = jnp.stack([other["v_cache"], inp["v_cache"], other["v_cache"]])
    want = call(tree_attention_reference, inp, 3)
    f = jax.jit(lambda layer: tree_attention(inp["q"], k_all, v_all, inp["lengths"], inp["tree_mask"],
                                             q_positions=inp["q_positions"], window=3, layer=layer, impl=impl))
    assert_close(f(jnp.int32(1)), want, jnp.float32)
    if impl == "interpret":
        got = tree_attention_pallas(inp["q"], k_all, v_all, inp["lengths"], inp["tree_mask"],
                                    q_positions=inp["q_positions"], window=3, layer=1, interpret=True,
                                    variant="gpu")
        assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("impl", ["reference", "blockwise", "interpret"])
def test_window_over_earlier_uncommitted_levels(impl):
    """tree_mask [B, N, W > N]: the last 3 nodes of a 7-node tree attend to all 7 window keys (the first 4
    written by an earlier, uncommitted forward), which equals those nodes' rows of one 7-node call."""
    full = make_inputs(17, tree="branching", lengths=(6, 0))
    new = slice(4, 7)
    want = call(tree_attention_reference, full, 2)[:, new]
    got = tree_attention(full["q"][:, new], full["k_cache"], full["v_cache"], full["lengths"],
                         full["tree_mask"][:, new, :], q_positions=full["q_positions"][:, new], window=2,
                         key_positions=full["q_positions"], impl=impl)
    assert_close(got, want, jnp.float32)


def test_query_that_sees_nothing_averages_all_slots():
    """The documented corner case, kept by every implementation: an invalid node over an empty prefix."""
    inp = make_inputs(12, h=2, kv=2, tree="padded", lengths=(0, 3))
    uniform = jnp.mean(inp["v_cache"][0], axis=1)  # [KV, hd]: row 0, all S slots
    for got in (call(tree_attention_reference, inp), call(tree_attention_pallas, inp, interpret=True),
                call(tree_attention_blockwise, inp, block_k=24)):
        np.testing.assert_allclose(got[0, 5], uniform, atol=1e-5)  # node 5 is invalid: sees no key
        np.testing.assert_allclose(got[0, 6], uniform, atol=1e-5)


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= 8, "tests/conftest.py should simulate 8 CPU devices"
    return make_mesh(data=2, model=4, devices=jax.devices()[:8])


def test_sharded_kernel_equals_unsharded(mesh):
    inp = make_inputs(13, h=8, kv=4, s=32, lengths=(0, 21))  # KV=4 splits over model=4, B=2 over data=2
    want = call(tree_attention_reference, inp, 6)
    got = call(lambda *a, **k: sharded_tree_attention(mesh, *a, **k), inp, 6, impl="interpret")
    assert got.sharding.spec == P("data", None, "model", None)
    assert_close(got, want, jnp.float32)
    # a stacked [L, B, KV, S, hd] cache: the layer axis stays whole on every device
    stacked = dict(inp, k_cache=jnp.stack([inp["v_cache"], inp["k_cache"]]),
                   v_cache=jnp.stack([inp["k_cache"], inp["v_cache"]]))
    got = call(lambda *a, **k: sharded_tree_attention(mesh, *a, **k), stacked, 6, layer=jnp.int32(1),
               impl="blockwise")
    assert_close(got, want, jnp.float32)


def test_sharded_replicates_axes_the_mesh_does_not_divide(mesh):
    inp = make_inputs(14, h=4, kv=2, s=32, tree="padded", lengths=(4,))  # B=1 of 2, KV=2 of 4
    got = sharded_tree_attention(mesh, inp["q"], inp["k_cache"], inp["v_cache"], inp["lengths"],
                                 inp["tree_mask"], impl="reference")
    want = tree_attention_reference(inp["q"], inp["k_cache"], inp["v_cache"], inp["lengths"], inp["tree_mask"])
    assert_close(got, want, jnp.float32)


def _bad(**changes):
    inp = make_inputs(15)
    inp.update(changes)
    return inp


BAD_INPUTS = [
    (dict(q=jnp.zeros((2, 7, 3, 16))), {}, "not a multiple of the cache's KV=2"),
    (dict(tree_mask=jnp.ones((2, 7, 6), bool)), {}, r"tree_mask must have shape \[B, N, N\]"),
    (dict(v_cache=jnp.zeros((2, 2, 32, 16))), {}, "v_cache shape"),
    (dict(k_cache=jnp.zeros((2, 2, 64, 8)), v_cache=jnp.zeros((2, 2, 64, 8))), {}, "head_dim 8 differs"),
    (dict(lengths=jnp.zeros((3,), jnp.int32)), {}, r"lengths must be an integer array of shape \[B\]"),
    (dict(lengths=jnp.asarray([0, 60], jnp.int32)), {}, r"lengths\[b\] \+ W <= S"),
    (dict(q=jnp.zeros((2, 7, 4, 16), jnp.bfloat16)), {}, "must share a dtype"),
    (dict(q_positions=jnp.zeros((2, 6), jnp.int32)), {}, "q_positions must be an integer array"),
    (dict(q_positions=None), dict(window=4), "sliding window needs q_positions"),
    (dict(tree_mask=jnp.ones((2, 7, 9), bool)), {}, "pass key_positions"),
    ({}, dict(key_positions=jnp.zeros((2, 6), jnp.int32)), "key_positions must be an integer array"),
    ({}, dict(window=-1), "window must be >= 0"),
    ({}, dict(sm_scale=0.0), "sm_scale must be a positive"),
    ({}, dict(softcap=0.0), r"softcap must be a positive finite number or None \(no soft-capping\), got 0.0"),
    ({}, dict(softcap=True), r"softcap must be a positive finite number"),
    ({}, dict(impl="cuda"), "impl must be one of"),
    ({}, dict(impl="pallas"), "impl='pallas' compiles the kernel for a GPU or TPU"),
    ({}, dict(layer=0), r"k_cache must be 5-D \(\[L, B, KV, S, hd\]"),
    (dict(k_cache=jnp.zeros((2, 2, 2, 64, 16)), v_cache=jnp.zeros((2, 2, 2, 64, 16))), {},
     r"k_cache must be 4-D \(\[B, KV, S, hd\]\)"),
    (dict(k_cache=jnp.zeros((2, 2, 2, 64, 16)), v_cache=jnp.zeros((2, 2, 2, 64, 16))), dict(layer=2),
     "layer 2 is not a layer of the cache"),
    (dict(k_cache=jnp.zeros((2, 2, 2, 64, 16)), v_cache=jnp.zeros((2, 2, 2, 64, 16))), dict(layer=1.0),
     "layer must be an int"),
    ({}, dict(impl="blockwise", block_k=0), "block_k must be a positive int"),
]


@pytest.mark.parametrize("changes,kw,match", BAD_INPUTS)
def test_bad_input_raises_clear_errors(changes, kw, match):
    inp = _bad(**changes)
    with pytest.raises(ValueError, match=match):
        tree_attention(inp["q"], inp["k_cache"], inp["v_cache"], inp["lengths"], inp["tree_mask"],
                       q_positions=inp["q_positions"], **kw)


def test_bad_kernel_options_and_mesh(mesh):
    inp = make_inputs(16)
    for kw, match in ((dict(variant="cpu"), "variant must be one of"),
                      (dict(variant="gpu", block_k=24), "power of two"),
                      (dict(variant="tpu", block_k=12), "multiple of 8"),
                      (dict(variant="gpu", block_m=8), "power of two"),
                      (dict(variant="gpu", block_w=24), "power of two"),
                      (dict(variant="tpu", block_w=16), "reads the tree window whole")):
        with pytest.raises(ValueError, match=match):
            call(tree_attention_pallas, inp, interpret=True, **kw)
    flat = jax.sharding.Mesh(np.asarray(jax.devices()[:8]), ("x",))
    with pytest.raises(ValueError, match=r"the mesh's axes are \('x',\), but this op shards rows over an axis "
                                         r"named 'data'.*rename \['x'\]"):
        call(lambda *a, **k: sharded_tree_attention(flat, *a, **k), inp)


@pytest.mark.parametrize("variant", ["tpu", "gpu"])
@pytest.mark.parametrize("s,m,n,hd", [(64, 14, 7, 16), (40, 7, 7, 24), (4096, 512, 64, 128), (1100, 300, 60, 80),
                                      (2048, 8, 8, 256), (512, 771, 257, 64)])
def test_block_plan_obeys_backend_rules(variant, s, m, n, hd):
    p = block_plan(variant, s, m, n, hd)
    assert p["s_pad"] % p["block_k"] == 0 and p["s_pad"] >= s and p["m_pad"] % p["block_m"] == 0
    assert p["m_pad"] >= m and p["w_pad"] >= n and p["d_pad"] >= hd
    if variant == "tpu":  # (8, 128) rule: sublane dims multiples of 8 (or full), lane dims full or x128
        assert p["block_k"] % 128 == 0 or p["block_k"] == p["s_pad"] == s
        assert p["block_m"] % 8 == 0 and p["w_pad"] % 128 == 0 and p["d_pad"] == hd
    else:  # Triton: power-of-two tensors, dot operands >= 16
        for key in ("block_k", "block_m", "block_w", "d_pad"):
            assert p[key] >= 16 and p[key] & (p[key] - 1) == 0, (key, p)
        assert p["block_m"] <= 32  # 64 spilled on an H200 (GPU_BLOCK_M)
        assert p["w_pad"] % p["block_w"] == 0 and 2 * p["block_w"] * p["d_pad"] * 4 <= 64 * 1024  # shared memory
        assert 2 * p["block_k"] * p["d_pad"] * 4 <= 64 * 1024 and (p["block_k"] == 64 or hd > 128 or s % 64)


@pytest.mark.parametrize("variant,platform,target", [("gpu", "cuda", "__gpu$xla.gpu.triton"),
                                                     ("tpu", "tpu", "tpu_custom_call")])
@pytest.mark.parametrize("shape", [(2, 7, 4, 2, 256, 64, jnp.float32, 0), (1, 5, 8, 1, 1100, 80, jnp.bfloat16, 0),
                                   (2, 3, 2, 2, 40, 24, jnp.bfloat16, 3), (1, 64, 8, 1, 512, 128, jnp.bfloat16, 0),
                                   (1, 1, 8, 2, 256, 64, jnp.bfloat16, 5),
                                   # the embedded target's 256-node verification (257 window keys: 3 blocks
                                   # of 128 on the GPU; the whole window, padded to 512 keys, asked an H200
                                   # for 264 KiB of shared memory)
                                   (1, 257, 6, 2, 512, 64, jnp.float32, 4),
                                   # Gemma 2 / 3: head_dim 256, scores scaled by query_pre_attn_scalar and
                                   # soft-capped (the options below, for hd 256)
                                   (1, 7, 8, 4, 2048, 256, jnp.bfloat16, 3)])
def test_kernel_lowers_for_gpu_and_tpu(variant, platform, target, shape):
    """Runs Pallas' Triton / Mosaic lowering (its block-shape and power-of-two checks) on this CPU
    machine; compiling and running the result needs the hardware. L > 0: a stacked cache read at a
    traced layer (as inside the model's layer scan)."""
    b, n, h, kv, s, hd, dt, n_layers = shape
    cache = (b, kv, s, hd) if not n_layers else (n_layers, b, kv, s, hd)
    gemma = dict(sm_scale=256 ** -0.5, softcap=50.0) if hd == 256 else {}

    def f(q, k, v, lens, tm, qp, w, layer):
        return tree_attention_pallas(q, k, v, lens, tm, q_positions=qp, window=w, variant=variant,
                                     layer=layer if n_layers else None, **gemma)

    args = [jax.ShapeDtypeStruct(x, d) for x, d in (((b, n, h, hd), dt), (cache, dt), (cache, dt),
                                                    ((b,), jnp.int32), ((b, n, n), jnp.bool_), ((b, n), jnp.int32),
                                                    ((), jnp.int32), ((), jnp.int32))]
    text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert target in text


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3_text"])
def test_whole_model_verification_with_kernel_equals_reference(family):
    """A target forward over [root, tree] with the interpret-mode kernel equals the XLA attention (Gemma 3:
    the kernel's own score scale, from query_pre_attn_scalar, and a RoPE base per layer; Gemma 2: scores
    soft-capped in the kernel)."""
    from jaxdecode.models import ModelConfig, advance, causal_mask, forward, init_cache, init_params
    from jaxdecode.tree import ancestor_mask, depths

    gemma = dict(query_pre_attn_scalar=24, activation="gelu_tanh", norm_plus_one=True, scale_embed=True,
                 sandwich_norms=True)
    family_options = {"llama": {}, "gemma2": dict(gemma, attn_logit_softcapping=0.5, final_logit_softcapping=3.0),
                      "gemma3_text": dict(gemma, local_rope_theta=100.0, rope_theta=1e6, qk_norm=True)}
    cfg = ModelConfig(model_type=family, vocab_size=40, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64, sliding_windows=(0, 4), **family_options[family])
    params = init_params(cfg, jax.random.PRNGKey(2), std=0.3)
    rng = np.random.RandomState(5)
    cache = init_cache(cfg, 2, 32)
    _, _, cache = forward(cfg, params, jnp.asarray(rng.randint(0, 40, (2, 6))),
                          jnp.broadcast_to(jnp.arange(6), (2, 6)), cache, causal_mask(2, 6))
    cache = advance(cache, jnp.array([6, 2]))
    parents = jnp.array([[-1, -1, 0, 0, 1, 2, 2], [-1, 0, 1, 2, 3, 4, 5]])
    toks = jnp.asarray(rng.randint(0, 40, (2, 7)))
    pos = cache.lengths[:, None] + depths(parents) - 1
    mask = ancestor_mask(parents)
    ref, _, ref_cache = forward(cfg, params, toks, pos, cache, mask)
    got, _, got_cache = forward(cfg, params, toks, pos, cache, mask, attn_impl="interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5)
    np.testing.assert_allclose(np.asarray(got_cache.k), np.asarray(ref_cache.k), atol=2e-5)
    cpu_dispatch, _, _ = forward(cfg, params, toks, pos, cache, mask, attn_impl="tree")
    np.testing.assert_allclose(np.asarray(cpu_dispatch), np.asarray(ref), atol=2e-5)
