"""The model contract: one pure forward for every supported architecture.

    forward(config, params, tokens[B,T], positions[B,T], cache, attn_mask[B,T,T])
        -> (logits[B,T,V] f32, hidden, cache')

`attn_mask[b, i, j]` says whether new token i sees new token j (causal for prefill/decode, an
ancestor mask for token trees, all-ones for a bidirectional diffusion LM). With a cache, every new
token also sees the row's committed prefix (slots < cache.lengths[b]). Without a cache (training)
the new tokens see only each other. Padding tokens are simply tokens nobody attends to.

Layers are stacked along a leading axis and run under `lax.scan`, so compile time does not grow with
depth. `stop_at_layer` / `skip_layers` select a sub-network statically (self-speculation) without a
second copy of the weights; `return_layers` exposes chosen layers' hidden states (feature drafters).

Parameter pytree (L = layers, D = hidden, H/KV = heads, hd = head dim, F = MLP width):
    embed [V, D]; pos_embed [P, D] (GPT-2); lm_head [D, V] (untied only)
    final_norm {scale [D], bias [D] (GPT-2)}
    layers: attn_norm/mlp_norm {scale [L, D], bias}, wq [L, D, H, hd], wk/wv [L, D, KV, hd],
            wo [L, H, hd, D], bq [L, H, hd], bk/bv [L, KV, hd], bo [L, D],
            w_gate/w_up [L, D, F], w_down [L, F, D], b_gate/b_up [L, F], b_down [L, D]
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .cache import KVCache, write_new
from .config import ModelConfig, rope_inv_freq

_MASKED = -1e30  # finite, so a fully masked (padding) query gives a uniform softmax, never NaN


# ----------------------------------------------------------------------------- building blocks
def rms_norm(x, p, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype) * p["scale"]


def layer_norm(x, p, eps):
    x32 = x.astype(jnp.float32)
    mu = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mu), axis=-1, keepdims=True)
    y = (x32 - mu) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def _norm(config: ModelConfig, x, p):
    return layer_norm(x, p, config.norm_eps) if config.is_gpt2 else rms_norm(x, p, config.norm_eps)


def gelu_new(x):
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * jnp.power(x, 3))))


def apply_rope(x, positions, inv_freq):
    """Rotate-half RoPE (the HF layout). x: [B, T, N, hd]; positions: [B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attention(q, k, v, visible):
    """Grouped-query attention of T queries over S keys.

    q: [B, T, H, hd]; k, v: [B, KV, S, hd]; visible: bool[B, T, S]. Returns [B, T, H, hd].
    """
    b, t, h, hd = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, t, kv, h // kv, hd)
    # scores: [B, KV, G, T, S]
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(hd)
    scores = jnp.where(visible[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    # Output with the batch dims leading ([B, KV, G, T, hd]): XLA:CPU has no bf16 dot for the
    # transposed layout, and the transpose after the dot is free elsewhere.
    out = jnp.einsum("bkgts,bksd->bkgtd", probs, v, preferred_element_type=jnp.float32)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, hd).astype(q.dtype)


def key_visibility(positions, attn_mask, lengths, max_len, write_offset=None, key_positions=None):
    """Which cache slots each new token sees, and the positions of the keys in those slots.

    Slots < lengths[b] are the committed prefix (slot index == position). attn_mask [B, T, W] covers the
    W slots lengths[b] .. lengths[b]+W-1 after it; the T new tokens are written at window columns
    write_offset[b] .. write_offset[b]+T-1 (default 0, and W == T: the window is just the new tokens).
    W > T lets a forward see tokens written by an earlier, not yet committed forward (a draft tree grown
    level by level). key_positions [B, W] gives those earlier tokens' positions (only a sliding window
    needs them; default: the slot index). Returns visible bool[B, T, S] and key_pos int32[B, S].
    """
    b, t = positions.shape
    w = attn_mask.shape[2]
    offset = jnp.zeros((b,), jnp.int32) if write_offset is None else write_offset.astype(jnp.int32)
    slots = jnp.arange(max_len, dtype=jnp.int32)[None, :]  # [1, S]
    rel = slots - lengths[:, None]  # [B, S]: column of the attention window
    committed = rel < 0
    in_window = (rel >= 0) & (rel < w)
    rel_c = jnp.clip(rel, 0, w - 1)
    win_vis = jnp.take_along_axis(attn_mask.astype(bool), jnp.broadcast_to(rel_c[:, None, :], (b, t, max_len)),
                                  axis=2)
    visible = committed[:, None, :] | (in_window[:, None, :] & win_vis)
    # Key positions: committed slots by index; the new tokens from `positions`; other window columns
    # from key_positions (or their slot index).
    new_col = rel - offset[:, None]
    is_new = (new_col >= 0) & (new_col < t)
    new_pos = jnp.take_along_axis(positions, jnp.clip(new_col, 0, t - 1), axis=1)
    other_pos = slots if key_positions is None else jnp.take_along_axis(key_positions, rel_c, axis=1)
    key_pos = jnp.where(committed, slots, jnp.where(is_new, new_pos, other_pos))
    return visible, key_pos.astype(jnp.int32)


def _window_mask(visible, q_pos, key_pos, window):
    """Restrict visibility to keys within the sliding window (window 0 = full attention)."""
    in_window = (q_pos[:, :, None] - key_pos[:, None, :]) < window
    return jnp.where(window > 0, visible & in_window, visible)


# ----------------------------------------------------------------------------- the layer
def _layer(config: ModelConfig, x, lp, q_pos, inv_freq, visible, key_pos, window, ck, cv, write_start,
           tree_args=None, attn_impl: str = "xla"):
    """One transformer block. x: [B, T, D]. ck/cv: this layer's cache [B, KV, S, hd] or None."""
    h = _norm(config, x, lp["attn_norm"])
    q = jnp.einsum("btd,dnh->btnh", h, lp["wq"])  # [B, T, H, hd]
    k = jnp.einsum("btd,dnh->btnh", h, lp["wk"])  # [B, T, KV, hd]
    v = jnp.einsum("btd,dnh->btnh", h, lp["wv"])
    if config.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    if config.uses_rope:
        q = apply_rope(q, q_pos, inv_freq)
        k = apply_rope(k, q_pos, inv_freq)
    k = k.transpose(0, 2, 1, 3)  # [B, KV, T, hd]
    v = v.transpose(0, 2, 1, 3)
    if ck is not None:
        ck, cv = write_new(ck, cv, k, v, write_start)
        keys, vals = ck, cv
    else:
        keys, vals = k, v
    if attn_impl == "xla" or ck is None:
        vis = _window_mask(visible, q_pos, key_pos, window)
        a = attention(q, keys, vals, vis)  # [B, T, H, hd]
    else:  # the tree-attention op: Pallas kernel on GPU/TPU (or interpret mode), reference on CPU
        from jaxdecode.kernels.tree_attention import tree_attention
        lengths, mask, win_pos = tree_args
        a = tree_attention(q, keys, vals, lengths, mask, q_positions=q_pos, window=window,
                           key_positions=win_pos, impl="interpret" if attn_impl == "interpret" else "auto")
    o = jnp.einsum("btnh,nhd->btd", a, lp["wo"])
    if config.o_bias:
        o = o + lp["bo"]
    x = x + o
    h = _norm(config, x, lp["mlp_norm"])
    if config.is_gpt2:
        u = jnp.einsum("btd,df->btf", h, lp["w_up"]) + lp["b_up"]
        m = jnp.einsum("btf,fd->btd", gelu_new(u), lp["w_down"]) + lp["b_down"]
    else:
        g = jnp.einsum("btd,df->btf", h, lp["w_gate"])
        u = jnp.einsum("btd,df->btf", h, lp["w_up"])
        if config.mlp_bias:
            g, u = g + lp["b_gate"], u + lp["b_up"]
        m = jnp.einsum("btf,fd->btd", jax.nn.silu(g) * u, lp["w_down"])
        if config.mlp_bias:
            m = m + lp["b_down"]
    return x + m, ck, cv


def _layer_ids(config: ModelConfig, stop_at_layer, skip_layers, return_layers) -> tuple:
    """The layers to run, in order; rejects selections that name layers the model does not have."""
    n = config.num_layers
    stop = n if stop_at_layer is None else stop_at_layer
    if not 0 < stop <= n:
        raise ValueError(f"stop_at_layer must be in 1..{n}, got {stop_at_layer}")
    bad_skip = [i for i in (skip_layers or ()) if not 0 <= i < n]
    if bad_skip:
        raise ValueError(f"skip_layers {bad_skip} are not layers of this {n}-layer model (use 0..{n - 1})")
    ids = tuple(i for i in range(stop) if i not in set(skip_layers or ()))
    if not ids:
        raise ValueError(f"skip_layers={tuple(skip_layers)} with stop_at_layer={stop_at_layer} "
                         "removes every layer")
    not_run = [i for i in return_layers if i not in ids]
    if not_run:
        raise ValueError(f"return_layers {not_run} are not run by this forward (it runs layers {ids}: "
                         "stop_at_layer and skip_layers exclude the others); ask only for layers it runs")
    return ids


# ----------------------------------------------------------------------------- forward
ATTN_IMPLS = ("xla", "tree", "interpret")


@partial(jax.jit, static_argnames=("config", "return_layers", "stop_at_layer", "skip_layers", "attn_impl"))
def forward(config: ModelConfig, params, tokens, positions, cache: KVCache | None, attn_mask,
            *, write_offset=None, key_positions=None, return_layers: tuple = (),
            stop_at_layer: int | None = None, skip_layers: tuple = (), attn_impl: str = "xla"):
    """Run the model over T new tokens per row. See the module docstring for the contract.

    attn_mask is [B, T, T], or with a cache [B, T, W >= T]: then its columns are the W slots after the
    committed prefix and the new tokens are written at columns write_offset[b]..+T-1 (see
    `key_visibility`), so a draft tree can grow level by level without committing.
    Returns logits [B, T, V] (float32), hidden {"final": [B, T, D] after the final norm,
    "layers": [len(return_layers), B, T, D] outputs of the chosen layers (or None)}, and the cache
    with the new keys/values written after each row's committed prefix (lengths unchanged).
    attn_impl: "xla" (plain einsum attention), "tree" (the tree-attention op of jaxdecode.kernels:
    the Pallas kernel on GPU/TPU, its jnp reference on CPU) or "interpret" (the kernel in Pallas
    interpret mode, for tests). All three compute the same function.
    """
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")
    b, t = tokens.shape
    if attn_mask.shape[:2] != (b, t) or attn_mask.shape[2] < t or (cache is None and attn_mask.shape[2] != t):
        raise ValueError(f"attn_mask must be [B, T, T] (or [B, T, W>=T] with a cache) for tokens "
                         f"{tokens.shape}, got {attn_mask.shape}")
    ids = _layer_ids(config, stop_at_layer, skip_layers, return_layers)
    x = jnp.take(params["embed"], tokens, axis=0)
    if config.is_gpt2:
        x = x + jnp.take(params["pos_embed"], positions, axis=0)
    inv_freq = jnp.asarray(rope_inv_freq(config)) if config.uses_rope else None
    if cache is not None:
        visible, key_pos = key_visibility(positions, attn_mask, cache.lengths, cache.max_len,
                                          write_offset, key_positions)
        write_start = cache.lengths if write_offset is None else cache.lengths + write_offset
        # The kernel takes the window columns' key positions directly ([B, W] after the prefix).
        win_cols = cache.lengths[:, None] + jnp.arange(attn_mask.shape[2])[None, :]
        win_pos = jnp.take_along_axis(key_pos, jnp.minimum(win_cols, cache.max_len - 1), axis=1)
        tree_args = (cache.lengths, attn_mask.astype(bool), win_pos)
    else:
        visible, key_pos = attn_mask.astype(bool), positions.astype(jnp.int32)

    layers = params["layers"]
    windows = jnp.asarray(config.sliding_windows, jnp.int32)
    full = ids == tuple(range(config.num_layers))
    if not full:  # a static sub-network: gather its layers (and their cache slices)
        sel = np.asarray(ids)
        layers = jax.tree.map(lambda a: a[sel], layers)
        windows = windows[sel]
    ck_all = cv_all = None
    if cache is not None:
        ck_all, cv_all = (cache.k, cache.v) if full else (cache.k[sel], cache.v[sel])

    def body(x, xs):
        lp, w, ck, cv = xs
        x, ck, cv = _layer(config, x, lp, positions, inv_freq, visible, key_pos, w, ck, cv,
                           None if cache is None else write_start,
                           None if cache is None else tree_args, attn_impl)
        return x, (x if return_layers else None, ck, cv)

    x, (per_layer, new_k, new_v) = jax.lax.scan(body, x, (layers, windows, ck_all, cv_all))
    h_final = _norm(config, x, params["final_norm"])
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    logits = jnp.einsum("btd,dv->btv", h_final, head, preferred_element_type=jnp.float32)

    layers_out = None
    if return_layers:
        pos = [ids.index(i) for i in return_layers]
        layers_out = per_layer[np.asarray(pos)]
    hidden = {"final": h_final, "layers": layers_out}

    new_cache = None
    if cache is not None:
        if full:
            new_cache = cache.replace(k=new_k, v=new_v)
        else:
            new_cache = cache.replace(k=cache.k.at[sel].set(new_k), v=cache.v.at[sel].set(new_v))
    return logits, hidden, new_cache


def causal_mask(batch: int, t: int) -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


def padded_causal_mask(valid: jax.Array) -> jax.Array:
    """Causal mask among new tokens where only valid (non-padding) keys are visible. valid: [B, T]."""
    b, t = valid.shape
    return causal_mask(b, t) & valid[:, None, :]


# ----------------------------------------------------------------------------- init
@partial(jax.jit, static_argnames=("config", "std"))
def init_params(config: ModelConfig, key, std: float = 0.02):
    """Random parameters (normal(0, std) matrices, unit norms, zero biases) in config.dtype."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    h, kv, hd, n = config.num_heads, config.num_kv_heads, config.head_dim, config.num_layers
    dt = config.jnp_dtype
    keys = iter(jax.random.split(key, 16))

    def normal(shape, scale=std):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)

    def norm_params(shape):
        p = {"scale": jnp.ones(shape, dt)}
        if config.is_gpt2:
            p["bias"] = jnp.zeros(shape, dt)
        return p

    # Residual projections scaled down by depth (GPT-2 style) for stable training from scratch.
    resid = std / math.sqrt(2 * n)
    layers = {
        "attn_norm": norm_params((n, d)), "mlp_norm": norm_params((n, d)),
        "wq": normal((n, d, h, hd)), "wk": normal((n, d, kv, hd)), "wv": normal((n, d, kv, hd)),
        "wo": normal((n, h, hd, d), resid),
        "w_up": normal((n, d, f)), "w_down": normal((n, f, d), resid),
    }
    if not config.is_gpt2:
        layers["w_gate"] = normal((n, d, f))
    if config.qkv_bias:
        layers.update(bq=jnp.zeros((n, h, hd), dt), bk=jnp.zeros((n, kv, hd), dt),
                      bv=jnp.zeros((n, kv, hd), dt))
    if config.o_bias:
        layers["bo"] = jnp.zeros((n, d), dt)
    if config.is_gpt2 or config.mlp_bias:
        layers.update(b_up=jnp.zeros((n, f), dt), b_down=jnp.zeros((n, d), dt))
        if not config.is_gpt2:
            layers["b_gate"] = jnp.zeros((n, f), dt)
    params = {"embed": normal((v, d)), "layers": layers, "final_norm": norm_params((d,))}
    if config.is_gpt2:
        params["pos_embed"] = normal((config.max_position_embeddings, d), 0.01)
    if not config.tie_word_embeddings:
        params["lm_head"] = normal((d, v))
    return params


def param_shapes(config: ModelConfig) -> dict:
    """The expected shape of every parameter (used to validate loaded checkpoints)."""
    abstract = jax.eval_shape(lambda k: init_params(config, k), jax.random.PRNGKey(0))
    return jax.tree.map(lambda a: tuple(a.shape), abstract)
