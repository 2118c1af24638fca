"""One dtype rule for `jaxdecode.load` (issue 9, item 13): every checkpoint, the embedded ones included,
loads in float32 on CPU and in its own dtype on GPU/TPU unless `dtype=` says otherwise."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode.model import embedded_model_path, resolve_dtype
from jaxdecode.models import ModelConfig, init_params, save_params


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=64,
                      sliding_windows=(0,))
    out = tmp_path_factory.mktemp("bf16")
    save_params(cfg, init_params(cfg, jax.random.PRNGKey(0)), out, dtype="bfloat16")
    return out


def _dtypes(model):
    return {a.dtype for a in jax.tree.leaves(model.params)}


def test_bf16_checkpoint_follows_the_rule(bf16_dir):
    assert jax.default_backend() == "cpu"
    assert _dtypes(jaxdecode.load(bf16_dir)) == {jnp.dtype(jnp.float32)}  # CPU: float32
    auto = jaxdecode.load(bf16_dir, dtype="auto")
    assert _dtypes(auto) == {jnp.dtype(jnp.bfloat16)} and auto.config.dtype == "bfloat16"
    assert _dtypes(jaxdecode.load(bf16_dir, dtype="bfloat16")) == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.skipif(embedded_model_path() is None, reason="embedded models not shipped")
def test_embedded_model_follows_the_same_rule():
    m = jaxdecode.load()  # shipped in bfloat16
    assert _dtypes(m) == {jnp.dtype(jnp.float32)} and m.config.dtype == "float32"
    assert _dtypes(jaxdecode.load(dtype="auto")) == {jnp.dtype(jnp.bfloat16)}


def test_resolve_dtype():
    assert resolve_dtype(None, backend="cpu") == "float32"
    assert resolve_dtype(None, backend="gpu") is None and resolve_dtype(None, backend="tpu") is None
    assert resolve_dtype("auto") is None and resolve_dtype("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("fp8")


# ----------------------------------------------------------------------------- weight-only half precision
def _forward_logits(model, tokens):
    from jaxdecode.models import causal_mask, forward
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    return forward(model.config, model.params, tokens, pos, None, causal_mask(b, t))[0]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_param_dtype_narrows_the_matrices_only(family, bf16_dir, tiny_gpt2_dir):
    from jaxdecode.models.transformer import compute_dtype
    path = bf16_dir if family == "llama" else tiny_gpt2_dir
    wide = jaxdecode.load(path, dtype="float32")
    narrow = jaxdecode.load(path, dtype="float32", param_dtype="bfloat16")
    for path_, w in jax.tree_util.tree_leaves_with_path(wide.params):
        n = narrow.params
        for k in path_:
            n = n[k.key]
        per_layer_ndim = w.ndim - (path_[0].key == "layers")  # stacked layers: a leading layer axis
        vector = path_[-1].key in ("bq", "bk", "bv")  # GPT-2's q/k/v biases: [heads, head_dim], vectors in HF
        assert n.dtype == (jnp.bfloat16 if per_layer_ndim >= 2 and not vector else jnp.float32), (path_, n.dtype)
    assert narrow.params["layers"][next(k for k in narrow.params["layers"] if "norm" in k)]["scale"].dtype \
        == jnp.float32  # a stacked norm scale is 2-D but per layer a vector: it keeps the compute dtype
    assert narrow.config.dtype == "float32" and compute_dtype(narrow.params) == jnp.float32
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, wide.config.vocab_size)
    lw, ln = _forward_logits(wide, tokens), _forward_logits(narrow, tokens)
    assert ln.dtype == jnp.float32
    # matmul inputs are rounded to bf16 (8 mantissa bits); everything else stays float32
    scale = float(jnp.max(jnp.abs(lw)))
    assert float(jnp.max(jnp.abs(lw - ln))) <= 0.03 * scale + 1e-3
    if family == "llama":  # a bf16 checkpoint: the float32 load holds the same weight values
        assert jnp.array_equal(narrow.params["embed"].astype(jnp.float32), wide.params["embed"])


def test_param_dtype_is_checked_before_loading(tmp_path):
    with pytest.raises(ValueError, match="param_dtype must be None .* got 'int8'"):
        jaxdecode.load(tmp_path / "nothing here", param_dtype="int8")


@pytest.mark.skipif(embedded_model_path() is None, reason="embedded models not shipped")
def test_param_dtype_speculative_greedy_equals_plain_greedy():
    """Weight-only bf16 keeps the KV cache and activations in float32; on the CPU the verification forward
    over N nodes and the one-token step give the same tokens (README "Numerics and dtypes")."""
    m = jaxdecode.load(param_dtype="bfloat16")
    prompts = ["import os\nimport sys\n\n\ndef main(argv):\n    ", "class Parser:\n    def __init__(self, ",
               "    for name in sorted(", "# Copyright\n\"\"\"Utilities for "]
    plain = jaxdecode.generate(m, prompts, max_new_tokens=40, method="greedy", eos_ids=[])
    for drafter, tree in [("retrieval", "chain:8"), ("prompt_lookup", "chain:4"), ("eagle3", None)]:
        spec = jaxdecode.generate(m, prompts, max_new_tokens=40, method="speculative", drafter=drafter,
                                  tree=tree, adaptive=False, eos_ids=[])
        assert [g.tokens for g in spec] == [g.tokens for g in plain], drafter


@pytest.mark.parametrize("equation,x_shape,w_shape", [
    ("btd,df->btf", (1, 1, 384), (384, 512)),   # a decode step at batch 1: one row, padded to three
    ("btd,df->btf", (2, 1, 384), (384, 512)),   # batch 2: two rows, padded to four
    ("btd,df->btf", (2, 3, 384), (384, 512)),   # several rows: the plain dot
    ("btnh,nhd->btd", (1, 1, 4, 96), (4, 96, 384)),  # the attention output projection, one row
])
def test_half_precision_matmul_keeps_the_weights_narrow(equation, x_shape, w_shape):
    """XLA:CPU has no fast one-row bf16 dot: it widened the whole weight matrix to float32 for one (20 ms
    a call for the embedded target, hoisted out of a decode loop; in a branch, on every step), and rows
    of a one- or two-row product differ in their last bits from the same rows in a wider one. Padded,
    the product reads the bf16 weights as they are, keeps x's low bits (x_hi + x_lo: not rounded to
    bf16), and gives each row the bits of a wider product."""
    from jaxdecode.models.transformer import matmul
    kx, kw = jax.random.split(jax.random.PRNGKey(len(x_shape)))
    x = jax.random.normal(kx, x_shape, jnp.float32)
    w = jax.random.normal(kw, w_shape, jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(lambda x, w: matmul(equation, x, w))
    got = f(x, w)
    want = jnp.einsum(equation, x, w.astype(jnp.float32), precision="highest")
    rounded = jnp.einsum(equation, x.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.float32),
                         precision="highest")  # x rounded to bf16: ~3 significant digits
    assert got.shape == want.shape and got.dtype == jnp.float32
    err, err_rounded = float(jnp.max(jnp.abs(got - want))), float(jnp.max(jnp.abs(rounded - want)))
    assert err <= 1e-5 * float(jnp.max(jnp.abs(want))) and err < err_rounded / 50, (err, err_rounded)
    wide_weights = "f32[" + ",".join(map(str, w_shape))
    assert wide_weights not in f.lower(x, w).compile().as_text()
    # each row has the bits it has inside a wider product (a verification forward's): greedy decoding
    # and speculative verification then see the same logits
    wider = jnp.concatenate([x, jax.random.normal(kx, x.shape[:1] + (12,) + x.shape[2:], jnp.float32)], axis=1)
    assert jnp.array_equal(got, f(wider, w)[:, :x.shape[1]])


def test_half_precision_embedding_rows_are_gathered_narrow():
    from jaxdecode.models.transformer import embed_rows
    table = jax.random.normal(jax.random.PRNGKey(0), (256, 32)).astype(jnp.bfloat16)
    ids = jnp.array([[3, 255, 0]], jnp.int32)
    f = jax.jit(lambda t, i: embed_rows(t, i, jnp.float32))
    assert jnp.array_equal(f(table, ids), table[ids].astype(jnp.float32))
    assert "f32[256,32]" not in f.lower(table, ids).compile().as_text()  # the table is not widened


def test_embedding_words_viewed_once_give_the_same_forward():
    """`with_embed_words` (the speculative engine views a half-precision embedding as uint16 once per call,
    not on every step inside its branches) changes nothing the forward computes; float32 params pass as
    they are."""
    from jaxdecode.models import forward, padded_causal_mask, with_embed_words
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=32, sliding_windows=(0, 0))
    params = init_params(cfg, jax.random.PRNGKey(0))
    assert with_embed_words(params) is params  # float32: nothing to view
    half = {**params, "embed": params["embed"].astype(jnp.bfloat16)}
    viewed = with_embed_words(half)
    assert viewed["embed_words"].dtype == jnp.uint16 and with_embed_words(viewed) is viewed
    tokens = jnp.array([[5, 63, 0, 17]], jnp.int32)
    run = jax.jit(lambda p: forward(cfg, p, tokens, jnp.arange(4)[None], None,
                                    padded_causal_mask(jnp.ones((1, 4), bool)))[0])
    assert jnp.array_equal(run(viewed), run(half))


@pytest.mark.parametrize("tied", [True, False])
def test_drafters_read_a_half_precision_head_narrow(tied):
    """The drafters that apply the target's LM head (Medusa/Hydra, the block drafter, self-speculation)
    or gather its embedding (EAGLE-3) read bf16 weights as they are: an einsum or a bf16 gather widened
    the whole [V, D] matrix to float32 on every call."""
    from jaxdecode.drafters.medusa import head_logits
    from jaxdecode.models.transformer import lm_logits
    v, d = 512, 64
    kx, kw = jax.random.split(jax.random.PRNGKey(1))
    embed = jax.random.normal(kw, (v, d), jnp.float32).astype(jnp.bfloat16)
    lm_head = None if tied else embed.T + 0
    x = jax.random.normal(kx, (2, 1, 3, d), jnp.float32)  # [B, T, K, D]: e.g. Medusa's K heads
    f = jax.jit(lambda x, e, h: head_logits(x, e, h))
    got = f(x, embed, lm_head)
    want = jnp.einsum("btkd,vd->btkv", x, embed.astype(jnp.float32), precision="highest")
    assert got.shape == (2, 1, 3, v) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want))))
    hlo = f.lower(x, embed, lm_head).compile().as_text()
    assert f"f32[{v},{d}]" not in hlo and f"f32[{d},{v}]" not in hlo
    assert jnp.array_equal(got, lm_logits(x, embed, lm_head))  # the target's own head, same bits


def test_param_dtype_heads_and_selfspec_greedy_equal_plain_greedy():
    """The drafters that apply the bf16 target's own head stay exact (their drafts change, not the output).
    The embedded target and its drafters ship with the package: missing, this fails rather than skips."""
    m = jaxdecode.load(param_dtype="bfloat16")
    prompts = ["import os\nimport sys\n\n\ndef main(argv):\n    ", "    for name in sorted("]
    plain = jaxdecode.generate(m, prompts, max_new_tokens=24, method="greedy", eos_ids=[])
    for drafter in ["medusa", "hydra", "swift"]:
        spec = jaxdecode.generate(m, prompts, max_new_tokens=24, method="speculative", drafter=drafter,
                                  adaptive=False, eos_ids=[])
        assert [g.tokens for g in spec] == [g.tokens for g in plain], drafter
        assert max(spec[0].batch_stats["accept_rate_by_depth"]) > 0, drafter  # the drafts were used
