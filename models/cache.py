"""Preallocated, tree-capable KV cache.

Layout (DESIGN.md): `k, v: [layers, B, kv_heads, S_max, head_dim]`, `lengths: int32[B]`.
Slot s < lengths[b] holds the committed token of row b at position s. A forward writes its T new
tokens into slots lengths[b] .. lengths[b]+T-1 without advancing `lengths`; `commit(cache, keep)`
then moves the kept tokens (an accepted tree path, or the valid part of a padded block) into
consecutive slots and advances `lengths`. Because the rope of every key is applied with its true
position (prefix length + tree depth), the moved entries are exactly what decoding that path token
by token would have produced.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [L, B, KV, S, hd]
    v: jax.Array  # [L, B, KV, S, hd]
    lengths: jax.Array  # int32[B]: committed tokens per row

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    def replace(self, **kw) -> "KVCache":
        return dataclasses.replace(self, **kw)


def init_cache(config, batch_size: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache for `batch_size` rows of up to `max_len` tokens each."""
    if max_len <= 0 or batch_size <= 0:
        raise ValueError(f"cache needs batch_size > 0 and max_len > 0, got {batch_size}, {max_len}")
    dtype = dtype or config.jnp_dtype
    shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch_size,), jnp.int32))


def write_new(cache_layer_k, cache_layer_v, new_k, new_v, lengths):
    """Write T new keys/values of one layer after each row's committed prefix.

    cache_layer_*: [B, KV, S, hd]; new_*: [B, KV, T, hd]; lengths: [B].
    """
    def one(ck, cv, nk, nv, start):
        ck = jax.lax.dynamic_update_slice(ck, nk.astype(ck.dtype), (0, start, 0))
        cv = jax.lax.dynamic_update_slice(cv, nv.astype(cv.dtype), (0, start, 0))
        return ck, cv
    return jax.vmap(one)(cache_layer_k, cache_layer_v, new_k, new_v, lengths)


def commit(cache: KVCache, keep: jax.Array) -> KVCache:
    """Keep the marked new tokens of each row, in order, as the next committed tokens.

    keep: bool[B, T] over the T tokens of the last forward (written at slots lengths..lengths+T-1).
    The kept tokens must be listed in path order (a tree's nodes are topologically ordered, so an
    accepted root-to-node path is). Rejected entries stay beyond `lengths` and are never attended.
    """
    keep = keep.astype(bool)
    t = keep.shape[1]
    # Kept indices first, in their original order (stable sort of the "dropped" flag).
    order = jnp.argsort(~keep, axis=1, stable=True)  # [B, T]
    n_keep = keep.sum(axis=1).astype(jnp.int32)
    all_prefix = jnp.all(order == jnp.arange(t)[None, :])

    def move(x):  # x: [L, B, KV, S, hd]
        def row(xb, start, idx):  # xb: [L, KV, S, hd]
            block = jax.lax.dynamic_slice_in_dim(xb, start, t, axis=2)
            block = jnp.take(block, idx, axis=2)
            return jax.lax.dynamic_update_slice_in_dim(xb, block, start, axis=2)
        return jax.vmap(row, in_axes=(1, 0, 0), out_axes=1)(x, cache.lengths, order)

    # When every row keeps a prefix (plain decoding), no data moves: skip the gather.
    k, v = jax.lax.cond(all_prefix, lambda: (cache.k, cache.v),
                        lambda: (move(cache.k), move(cache.v)))
    return KVCache(k=k, v=v, lengths=cache.lengths + n_keep)


def advance(cache: KVCache, n: jax.Array) -> KVCache:
    """Commit the first n[b] new tokens of each row (causal decoding, padded prefill)."""
    return cache.replace(lengths=cache.lengths + n.astype(jnp.int32))


def reorder_rows(cache: KVCache, index: jax.Array) -> KVCache:
    """Gather cache rows (beam search: the surviving beams' parents)."""
    return KVCache(k=jnp.take(cache.k, index, axis=1), v=jnp.take(cache.v, index, axis=1),
                   lengths=jnp.take(cache.lengths, index, axis=0))
