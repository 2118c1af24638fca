"""models.split_layers: the decoders' per-layer weight layout on the CPU computes what the stacked one does.

XLA:CPU copies each layer's slice of a stacked weight on every forward; the decoders split the target's
layers into one array each (once per parameter set, memoised) and `forward` unrolls them. These tests pin
that the split forward is the stacked forward (every layer selection it supports), that it refuses what
only the stacked form can do, and when the split happens at all.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.autoregressive import decode
from jaxdecode.models import ModelConfig, causal_mask, forward, init_cache, init_params, split_layers
from jaxdecode.models import transformer
from jaxdecode.sampling import SamplerConfig

CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, jax.random.PRNGKey(0))


def test_the_split_is_one_array_per_layer_and_memoised(params):
    split = split_layers(CONFIG, params)
    assert isinstance(split["layers"], tuple) and len(split["layers"]) == CONFIG.num_layers
    for i, layer in enumerate(split["layers"]):
        jax.tree.map(lambda w, stacked: np.testing.assert_array_equal(np.asarray(w), np.asarray(stacked[i])),
                     layer, params["layers"])
    assert split["embed"] is params["embed"]  # only the layers are split
    again = split_layers(CONFIG, params)
    assert again["layers"] is split["layers"]  # the same split: no second copy per call
    assert split_layers(CONFIG, split) is split  # already split: unchanged


@pytest.mark.parametrize("kw", [{}, {"return_layers": (0, 2)}, {"stop_at_layer": 2}, {"skip_layers": (1,)}],
                         ids=["full", "return_layers", "stop_at_layer", "skip_layers"])
def test_the_split_forward_is_the_stacked_forward(params, kw):
    b, t = 2, 5
    tokens = jax.random.randint(jax.random.PRNGKey(1), (b, t), 0, CONFIG.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = init_cache(CONFIG, b, 16)
    outs = [forward(CONFIG, p, tokens, positions, cache, causal_mask(b, t), **kw)
            for p in (params, split_layers(CONFIG, params))]
    (lg0, h0, c0), (lg1, h1, c1) = outs
    np.testing.assert_allclose(np.asarray(lg1), np.asarray(lg0), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(c1.k), np.asarray(c0.k), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(c1.v), np.asarray(c0.v), atol=1e-5, rtol=1e-5)
    if kw.get("return_layers"):
        np.testing.assert_allclose(np.asarray(h1["layers"]), np.asarray(h0["layers"]), atol=1e-5, rtol=1e-5)


def test_a_run_time_layer_list_needs_the_stacked_layers(params):
    b, t = 1, 2
    tokens = jnp.zeros((b, t), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    with pytest.raises(ValueError, match="layer_ids .* stacked"):
        forward(CONFIG, split_layers(CONFIG, params), tokens, positions, init_cache(CONFIG, b, 8),
                causal_mask(b, t), layer_ids=jnp.array([0, 2], jnp.int32))


def test_decoding_is_the_same_on_either_layout(params, monkeypatch):
    prompts = jax.random.randint(jax.random.PRNGKey(2), (2, 6), 1, CONFIG.vocab_size)
    lengths = jnp.array([6, 4], jnp.int32)
    kw = dict(max_new_tokens=8, method="greedy", sampler=SamplerConfig(temperature=0.0))
    split = decode(CONFIG, params, prompts, lengths, **kw).tokens  # decode splits them itself
    with monkeypatch.context() as m:
        m.setattr(transformer, "MAX_SPLIT_BYTES", 0)  # too big to split: the stacked scan
        fresh = jax.tree.map(lambda a: a + 0, params)
        assert split_layers(CONFIG, fresh) is fresh
        stacked = decode(CONFIG, fresh, prompts, lengths, **kw).tokens
    in_jit = jax.jit(lambda p: decode(CONFIG, p, prompts, lengths, **kw).tokens)
    with_jit = in_jit(params)  # traced: stays stacked
    split_in_jit = in_jit(split_layers(CONFIG, params))  # split outside, passed in: the unrolled loop
    for out in (stacked, with_jit, split_in_jit):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(split))


def test_params_closed_over_by_several_jits(params):
    # Concrete params captured by a caller's jit reach split_layers at trace time; the memoised split must
    # be concrete arrays, or the second trace reads the first one's tracers (UnexpectedTracerError).
    prompts = jax.random.randint(jax.random.PRNGKey(4), (1, 5), 1, CONFIG.vocab_size)
    lengths = jnp.array([5], jnp.int32)
    fresh = jax.tree.map(lambda a: a + 0, params)  # not memoised yet: the first split happens under a trace
    outs = [jax.jit(lambda t, n=n: decode(CONFIG, fresh, t, lengths, max_new_tokens=n, method="greedy").tokens)(prompts)
            for n in (3, 4)]
    eager = decode(CONFIG, fresh, prompts, lengths, max_new_tokens=4, method="greedy").tokens
    split = split_layers(CONFIG, fresh)["layers"]
    assert not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(split))
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(eager)[:, :3])
    np.testing.assert_array_equal(np.asarray(outs[1]), np.asarray(eager))


def test_what_stays_stacked(params, monkeypatch):
    # Traced parameters (a caller's jit): a split there would copy the weights on every call.
    seen = []
    jax.jit(lambda p: seen.append(split_layers(CONFIG, p)["layers"]) or 0)(params)
    assert isinstance(seen[0], dict)
    # Too many layers, or too many bytes of them.
    deep = dataclasses.replace(CONFIG, num_layers=transformer.MAX_SPLIT_LAYERS + 1, sliding_windows=())
    assert split_layers(deep, params) is params
    monkeypatch.setattr(transformer, "MAX_SPLIT_BYTES", 1024)
    fresh = jax.tree.map(lambda a: a + 0, params)  # not memoised yet
    assert split_layers(CONFIG, fresh) is fresh
