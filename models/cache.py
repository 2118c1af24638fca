"""Preallocated, tree-capable KV cache.

Layout (DESIGN.md): `k, v: [layers, B, kv_heads, S_max, head_dim]`, `lengths: int32[B]`.
Slot s < lengths[b] holds the committed token of row b at position s. A forward writes its T new
tokens into slots lengths[b] .. lengths[b]+T-1 without advancing `lengths`; `commit(cache, keep)`
then moves the kept tokens (an accepted tree path, or the valid part of a padded block) into
consecutive slots and advances `lengths`. Because the rope of every key is applied with its true
position (prefix length + tree depth), the moved entries are exactly what decoding that path token
by token would have produced.

Writes and moves touch only the entries concerned (B x T slots, a scatter with the row as a batch
dimension), never the whole cache, so inside a jitted loop the cache is updated in place and their
cost does not grow with S_max.
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


def write_layer(k, v, layer, new_k, new_v, starts):
    """Write one layer's T new keys/values per row at slots starts[b] .. starts[b]+T-1, in place.

    k, v: [L, B, KV, S, hd] (the whole cache); layer: int32 scalar (traced inside the layer scan);
    new_*: [B, T, KV, hd]; starts: int32[B]. One scatter of the [B, T, KV, hd] new entries at (layer,
    slot) with the row as a batch dimension, so the cache is neither transposed nor copied (inside a
    jitted loop XLA updates its buffer in place) and a cache sharded by rows stays partitioned. The
    caller sizes the cache (starts + T <= S; the decoders check it up front).
    """
    b, t = new_k.shape[:2]
    slots = starts.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    idx = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (b, t)), slots], axis=-1)  # [B, T, 2]
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(2, 3), inserted_window_dims=(0, 3), scatter_dims_to_operand_dims=(0, 3),
        operand_batching_dims=(1,), scatter_indices_batching_dims=(0,))

    def put(cache, new):
        return jax.lax.scatter(cache, idx, new.astype(cache.dtype), dims, indices_are_sorted=True,
                               unique_indices=True, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
    return put(k, new_k), put(v, new_v)


def commit(cache: KVCache, keep: jax.Array) -> KVCache:
    """Keep the marked new tokens of each row, in order, as the next committed tokens.

    keep: bool[B, T] over the T tokens of the last forward (written at slots lengths..lengths+T-1).
    The kept tokens must be listed in path order (a tree's nodes are topologically ordered, so an
    accepted root-to-node path is). Rejected entries stay beyond `lengths` and are never attended.
    """
    keep = keep.astype(bool)
    t = keep.shape[1]
    # Kept indices first, in their original order (stable sort of the "dropped" flag).
    order = jnp.argsort(~keep, axis=1, stable=True).astype(jnp.int32)  # [B, T]
    n_keep = keep.sum(axis=1).astype(jnp.int32)
    src = (cache.lengths[:, None] + order)[..., None]  # [B, T, 1]: window slot of the j-th kept token
    dst = (cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :])[..., None]  # [B, T, 1]

    def move(x):  # x: [L, B, KV, S, hd]. Gather the T window entries per row (all layers), write them
        # back in path order: the row is a batch dimension, so nothing but those entries is touched.
        n_layers, _, kv, _, hd = x.shape
        block = jax.lax.gather(  # [B, T, L, KV, hd]
            x, src, jax.lax.GatherDimensionNumbers(offset_dims=(2, 3, 4), collapsed_slice_dims=(3,),
                                                   start_index_map=(3,), operand_batching_dims=(1,),
                                                   start_indices_batching_dims=(0,)),
            (n_layers, 1, kv, 1, hd), mode=jax.lax.GatherScatterMode.CLIP)
        return jax.lax.scatter(
            x, dst, block, jax.lax.ScatterDimensionNumbers(update_window_dims=(2, 3, 4), inserted_window_dims=(3,),
                                                           scatter_dims_to_operand_dims=(3,),
                                                           operand_batching_dims=(1,),
                                                           scatter_indices_batching_dims=(0,)),
            indices_are_sorted=True, unique_indices=True, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)

    # No lax.cond around it to skip prefix-only commits: a conditional's pass-through branch makes XLA
    # copy the whole cache, while the move itself costs only B*T entries.
    return KVCache(k=move(cache.k), v=move(cache.v), lengths=cache.lengths + n_keep)


def advance(cache: KVCache, n: jax.Array) -> KVCache:
    """Commit the first n[b] new tokens of each row (causal decoding, padded prefill)."""
    return cache.replace(lengths=cache.lengths + n.astype(jnp.int32))


def reorder_rows(cache: KVCache, index: jax.Array) -> KVCache:
    """Gather cache rows (beam search: the surviving beams' parents)."""
    return KVCache(k=jnp.take(cache.k, index, axis=1), v=jnp.take(cache.v, index, axis=1),
                   lengths=jnp.take(cache.lengths, index, axis=0))
