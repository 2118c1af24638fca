"""One dtype rule for `jaxdecode.load` (issue 9, item 13): every checkpoint, the embedded ones included,
loads in float32 on CPU and in its own dtype on GPU/TPU unless `dtype=` says otherwise."""
import jax
import jax.numpy as jnp
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
