"""Tree attention: N draft-tree nodes attend to their row's committed KV prefix and their ancestors.

    tree_attention(q, k_cache, v_cache, lengths, tree_mask, *, q_positions=None, window=0,
                   sm_scale=None, key_positions=None, layer=None, impl="auto", softcap=None) -> out
      q           [B, N, H, hd]   queries of the N tree nodes (rope applied)
      k/v_cache   [B, KV, S, hd]  one layer's cache, the N nodes' own keys already written at slots
                                  lengths[b] .. lengths[b]+N-1 (what the model core does); or, with
                  [L, B, KV, S, hd] `layer`, the whole stacked cache and the layer to read (an int or
                                  a traced int32 scalar): the model passes its cache this way, so no
                                  layer slice is ever copied out of it
      lengths     int32[B]        committed prefix length per row (needs lengths[b] + W <= S)
      tree_mask   bool[B, N, W]   tree_mask[b, i, j]: node i sees the key at slot lengths[b] + j
                                  (ancestor-or-self, valid nodes). Usually W == N; W > N is the
                                  model's window of a tree grown level by level (earlier, uncommitted
                                  levels' keys sit in the first columns)
      q_positions int32[B, N]     positions of the nodes; only needed with a sliding window
      window      int or int32 scalar (may be traced, as in the model's layer scan); 0 = no window:
                  a key at position p' is visible to a query at p iff p - p' < window
      key_positions int32[B, W]   positions of the W window keys, for the sliding window; defaults to
                  q_positions (required when W > N and q_positions is given)
      out         [B, N, H, hd] in q.dtype; softmax in float32; sm_scale defaults to 1/sqrt(hd)
      softcap     None, or c > 0: scores (after sm_scale) become c * tanh(score / c) before masking
                  (Gemma 2's attention logit soft-capping)

Semantics (`tree_attention_reference`, dense over all S slots): node i sees the committed slots
< lengths[b] (key position = slot) and the window columns its tree_mask row marks, minus the keys
outside its sliding window; softmax attention over those, invisible keys scoring the finite -1e30. So
a query that sees no key at all (an invalid padded node over an empty prefix) gets the uniform average
of all S value slots: finite, never NaN. This is the model's attention over its KV cache
(models.transformer.forward runs this op in every layer).

One function, three implementations:
  * "reference": dense, for tests (reads all S slots whatever the rows hold);
  * "blockwise": the kernel's math in jnp (XLA, any backend): the same online-softmax steps
    (`_prefix_step`, `_tree_step`) vmapped over (row, KV head), in a loop over the prefix blocks some
    row needs, [min blk_lo, max blk_hi) (below), then the window block. Its cost follows the longest
    committed prefix, not the cache capacity S; it is the model's default attention;
  * "pallas" / "interpret": the kernel (interpret = Pallas interpret mode, for tests on CPU).
This module does not import `models` (models import kernels); the tests hold the two together.

Kernel design (`impl="pallas"`). Per (row b, KV head h) the G = H/KV query heads of the group and the
N nodes form the M = N*G query rows (row = node*G + g) of one program, so each K/V block is loaded
once per group (GQA); only when M is large (many nodes x heads) is it split into query blocks of
block_m rows (a grid axis) to bound the accumulator. Flash-attention style online softmax in float32
over
  1. the committed prefix, in blocks of `block_k` slots, only blocks [blk_lo[b], blk_hi[b]) are
     visited: blk_hi = ceil(lengths[b] / block_k) (blocks past the prefix are skipped, the last one
     masked by slot < lengths[b]); with a window, blocks wholly before every query's window are
     skipped too. A row in which some query sees nothing sweeps all S slots, which reproduces the
     reference's uniform average exactly;
  2. the tree block: the W window keys (gathered from slots lengths[b]..lengths[b]+W-1 by the
     wrapper, [B, KV, W, hd]) masked by tree_mask (and the window).
The blockwise form runs the same two steps per (row, KV head) with one loop for the whole batch over
the union of the rows' block ranges: in a block outside its own range every slot of a row is masked
(-1e30), which weighs exactly 0 once the row's query has seen a visible key, so the result is the
same. Its default block is `blockwise_block_k()` slots (64 on CPU, 4096 on GPU, BLOCKWISE_BLOCK_K
on TPU); a
cache of at most that many slots is one block (no loop); a last block that would pass S is moved back to
end at S, its overlap dropped.
Masked prefix slots score -1e30 (present but invisible, as in the reference); slots that are not
keys at all (tree padding, cache padding past S) score -inf and weigh exactly 0. The running max
starts at -1e30, so no exp(-inf - -inf) NaN can occur.

Two lowerings of the same kernel math (`_prefix_step`, `_tree_step`, `_online_update`), chosen by
`jax.default_backend()`:
  * "tpu" (Mosaic): grid (B, KV, M/block_m, S/block_k), the last axis "arbitrary" (the reduction); lengths,
    the per-row block range and the layer are scalar-prefetched into SMEM, and the K/V index_map picks
    the layer and clamps the block index into the row's range, so skipped steps re-use the resident
    block (no DMA) and do no work.
    m/l/acc live in VMEM scratch; the tree block and the output write run on the last step. Block
    shapes obey the (8, 128) rule: the second-to-last block dims (block_m, block_k, W_pad) are
    multiples of 8 (or the whole S), the last ones are full dims (hd, 1) or multiples of 128 (W_pad);
    block_k defaults to 512/256/128 dividing S, block_m to M rounded up to 16 (128 when M > 256).
  * "gpu" (Triton): grid (B, KV, M/block_m), an in-kernel `fori_loop` over the row's prefix blocks
    (dynamic bounds read from the lengths/bounds inputs), K/V read block by block at the layer from
    the [L, S, hd] ref of the program's (row, head). Every loaded tensor is a power of two (Triton's
    requirement; dots need >= 16): hd is padded to a power of two >= 16 (by masked loads of the cache,
    as the official Pallas GPU attention does), M and W to whole blocks of block_m and block_w rows (powers
    of two >= 16); block_k in {64, 32, 16}, block_m <= 32 by default.
    The tree window is a second `fori_loop` over blocks of block_w keys (GPU_WINDOW_BYTES of K and V:
    128 keys at hd 64), so a tree of hundreds of nodes fits in shared memory.
A cache whose S has no legal block size (TPU: S > 1024 and not a multiple of 128; GPU: S not a
multiple of 16) is padded along S for the call, which copies its layer: allocate caches accordingly.
A [B, KV, S, hd] cache is layer 0 of a one-layer stack for both (a free reshape).
The GPU variant's parallelism is B*KV*(M/block_m) programs; a split-S (flash-decoding) variant would
raise occupancy for long prefixes with few rows, at the cost of a second reduction pass.
"""
from __future__ import annotations

import functools
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from .common import concrete, next_pow2, round_up, shard_map

_MASKED = -1e30  # invisible key: same finite value as models.transformer (all-masked -> uniform)
_ABSENT = float("-inf")  # not a key at all (padding): weight exactly 0
_IMPLS = ("auto", "pallas", "interpret", "blockwise", "reference")
_VARIANTS = ("tpu", "gpu")
GPU_BLOCK_M = 32  # default query rows per program of the GPU (Triton) lowering
# The GPU lowering reads the tree window's keys and values in blocks of at most this many bytes (the
# two together, float32): Triton stages dot operands in shared memory, and a 256-node window read whole
# (512 x 64 x 4 bytes each) asked an H200 for 264 KiB where 227 KiB exist.
GPU_WINDOW_BYTES = 64 * 1024
_LANES = 128  # TPU lane width: m/l scratch is stored lane-replicated, as Mosaic kernels do


# ----------------------------------------------------------------------------- input checks
def _check_inputs(q, k_cache, v_cache, lengths, tree_mask, q_positions, window, sm_scale, key_positions=None,
                  layer=None, softcap=None):
    """Raise a ValueError naming the first problem with the inputs; returns (B, N, W, H, KV, S, hd)."""
    cache_layout = "[B, KV, S, hd]" if layer is None else "[L, B, KV, S, hd] (layer is given)"
    for name, x, nd in (("q", q, 4), ("k_cache", k_cache, 4 if layer is None else 5),
                        ("v_cache", v_cache, 4 if layer is None else 5)):
        if getattr(x, "ndim", None) != nd:
            raise ValueError(f"{name} must be {nd}-D ({'[B, N, H, hd]' if name == 'q' else cache_layout}),"
                             f" got shape {getattr(x, 'shape', None)}")
    if layer is not None:
        if isinstance(layer, (bool, np.bool_)) or not (
                isinstance(layer, (int, np.integer))
                or (getattr(layer, "shape", None) == () and jnp.issubdtype(layer.dtype, jnp.integer))):
            raise ValueError(f"layer must be an int or an integer scalar array, got {layer!r}")
        lv = concrete(layer)
        if lv is not None and not 0 <= int(lv) < k_cache.shape[0]:
            raise ValueError(f"layer {int(lv)} is not a layer of the cache (it has {k_cache.shape[0]})")
    b, n, h, hd = q.shape
    kb, kv, s, khd = k_cache.shape[-4:]
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {v_cache.shape} differs from k_cache shape {k_cache.shape}")
    if kb != b:
        raise ValueError(f"k_cache batch {kb} differs from q batch {b}")
    if khd != hd:
        raise ValueError(f"k_cache head_dim {khd} differs from q head_dim {hd}")
    if kv == 0 or h % kv:
        raise ValueError(f"q has H={h} heads, not a multiple of the cache's KV={kv} heads (GQA needs H % KV == 0)")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point, got {q.dtype}")
    if getattr(lengths, "shape", None) != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be an integer array of shape [B]=({b},), got "
                         f"{getattr(lengths, 'dtype', type(lengths))}{getattr(lengths, 'shape', '')}")
    tshape = getattr(tree_mask, "shape", None)
    if tshape is None or len(tshape) != 3 or tshape[:2] != (b, n) or tshape[2] < n:
        raise ValueError(f"tree_mask must have shape [B, N, N]=({b}, {n}, {n}) (or [B, N, W] with W >= N for "
                         f"a window over earlier uncommitted keys), got {tshape}")
    w_cols = tshape[2]
    if w_cols > s:
        raise ValueError(f"tree_mask covers W={w_cols} slots after the prefix, more than the cache's S={s}")
    if not (tree_mask.dtype == jnp.bool_ or jnp.issubdtype(tree_mask.dtype, jnp.integer)):
        raise ValueError(f"tree_mask must be boolean, got {tree_mask.dtype}")
    if q_positions is not None and (getattr(q_positions, "shape", None) != (b, n)
                                    or not jnp.issubdtype(q_positions.dtype, jnp.integer)):
        raise ValueError(f"q_positions must be an integer array of shape [B, N]=({b}, {n}), got "
                         f"{getattr(q_positions, 'dtype', type(q_positions))}"
                         f"{getattr(q_positions, 'shape', '')}")
    if isinstance(window, (bool, np.bool_)):
        raise ValueError("window must be an integer (0 = no sliding window), got a bool")
    if isinstance(window, (int, np.integer)):
        if window < 0:
            raise ValueError(f"window must be >= 0 (0 = no sliding window), got {window}")
    elif getattr(window, "shape", None) != () or not jnp.issubdtype(window.dtype, jnp.integer):
        raise ValueError(f"window must be an int or an integer scalar array, got {window!r}")
    if q_positions is None and not (isinstance(window, (int, np.integer)) and window == 0):
        raise ValueError("a sliding window needs q_positions (the nodes' positions) to know which keys "
                         "fall inside it")
    if key_positions is not None and (getattr(key_positions, "shape", None) != (b, w_cols)
                                      or not jnp.issubdtype(key_positions.dtype, jnp.integer)):
        raise ValueError(f"key_positions must be an integer array of shape [B, W]=({b}, {w_cols}), got "
                         f"{getattr(key_positions, 'dtype', type(key_positions))}"
                         f"{getattr(key_positions, 'shape', '')}")
    if q_positions is not None and key_positions is None and w_cols != n:
        raise ValueError(f"tree_mask has W={w_cols} > N={n} columns: pass key_positions [B, W] (the window "
                         "keys' positions) along with q_positions")
    if sm_scale is not None and not (isinstance(sm_scale, (int, float, np.floating)) and math.isfinite(sm_scale)
                                     and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive finite number or None, got {sm_scale!r}")
    if softcap is not None and not (isinstance(softcap, (int, float, np.floating)) and not isinstance(softcap, bool)
                                    and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite number or None (no soft-capping), got {softcap!r}")
    lv = concrete(lengths)
    if lv is not None:
        if lv.size and (lv.min() < 0 or lv.max() + w_cols > s):
            raise ValueError(f"every row needs 0 <= lengths[b] and lengths[b] + W <= S (the tree's keys sit "
                             f"at slots lengths[b]..lengths[b]+W-1); got lengths={lv.tolist()}, W={w_cols}, "
                             f"S={s}")
    return b, n, w_cols, h, kv, s, hd


def _scale(sm_scale, hd) -> float:
    return float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(hd)


class _Score(typing.NamedTuple):
    """How q.k becomes a score (a static argument of the kernels): times `scale`, then, with a softcap c,
    c * tanh(score / c) (Gemma 2), before masking."""
    scale: float
    softcap: float | None = None

    def __call__(self, qk):
        s = qk * self.scale
        return s if self.softcap is None else self.softcap * jnp.tanh(s / self.softcap)


def _score(sm_scale, softcap, hd) -> _Score:
    return _Score(_scale(sm_scale, hd), None if softcap is None else float(softcap))


# ----------------------------------------------------------------------------- reference
def tree_attention_reference(q, k_cache, v_cache, lengths, tree_mask, *, q_positions=None, window=0,
                             sm_scale=None, key_positions=None, layer=None, softcap=None):
    """Pure-jnp tree attention: dense visibility over all S slots, then plain softmax attention.

    Same arguments as `tree_attention` (without `impl`); the math of models.transformer.attention.
    """
    b, n, w_cols, h, kv, s, hd = _check_inputs(q, k_cache, v_cache, lengths, tree_mask, q_positions, window,
                                               sm_scale, key_positions, layer, softcap)
    if layer is not None:
        k_cache, v_cache = k_cache[layer], v_cache[layer]
    g = h // kv
    lengths = lengths.astype(jnp.int32)
    slots = jnp.arange(s, dtype=jnp.int32)[None, :]  # [1, S]
    rel = slots - lengths[:, None]  # [B, S]: window column held in the slot
    committed = rel < 0
    in_tree = (rel >= 0) & (rel < w_cols)
    rel_c = jnp.clip(rel, 0, w_cols - 1)
    col_vis = jnp.take_along_axis(tree_mask.astype(bool), jnp.broadcast_to(rel_c[:, None, :], (b, n, s)),
                                  axis=2)  # [B, N, S]
    visible = committed[:, None, :] | (in_tree[:, None, :] & col_vis)  # [B, N, S]
    if q_positions is not None:
        qpos = q_positions.astype(jnp.int32)
        kpos = qpos if key_positions is None else key_positions.astype(jnp.int32)  # [B, W]
        key_pos = jnp.where(committed, slots, jnp.take_along_axis(kpos, rel_c, axis=1))  # [B, S]
        w = jnp.asarray(window, jnp.int32)
        in_window = (qpos[:, :, None] - key_pos[:, None, :]) < w
        visible = jnp.where(w > 0, visible & in_window, visible)

    qg = q.reshape(b, n, kv, g, hd)
    # scores: [B, KV, G, N, S]
    scores = jnp.einsum("bnkgd,bksd->bkgns", qg, k_cache, preferred_element_type=jnp.float32)
    scores = _score(sm_scale, softcap, hd)(scores)
    scores = jnp.where(visible[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    # Output in [B, KV, G, N, hd] order, transposed after: XLA:CPU (jax 0.10) cannot run the bf16 dot
    # with f32 result when the einsum writes [B, N, KV, G, hd] directly.
    out = jnp.einsum("bkgns,bksd->bkgnd", probs, v_cache, preferred_element_type=jnp.float32)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, n, h, hd).astype(q.dtype)


# ----------------------------------------------------------------------------- kernel math
def _precision(dtype):
    # f32 inputs: full-precision MXU / tensor-core passes (IEEE on Triton), to match the reference.
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def _mm(a, b, contract_b, precision):
    """a: [M, C] times b ([C, K] if contract_b == 0, [K, C] if 1) -> f32 [M, K]."""
    return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _online_update(state, s, v, precision):
    """One flash-attention step. s: f32 [M, K] scores; v: [K, D]; state m, l: [M, 1], acc: [M, D]."""
    m_prev, l_prev, acc_prev = state
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1)[:, None])  # >= -1e30: finite
    alpha = jnp.exp(m_prev - m_new)  # [M, 1]
    p = jnp.exp(s - m_new)  # [M, K]; -inf scores give exactly 0
    l_new = alpha * l_prev + jnp.sum(p, axis=1)[:, None]
    pv = _mm(p.astype(v.dtype), v, 0, precision)  # [M, D]
    return m_new, l_new, alpha * acc_prev + pv


def _qk(q, k, score, precision):
    """q: [M, D], k: [K, D] -> f32 scores [M, K]."""
    return score(_mm(q, k, 1, precision))


def _prefix_step(state, q, k, v, start, length, lo_slot, covered=None, *, s_true, s_padded, score, precision):
    """Prefix block of slots start..start+K-1. lo_slot: int32 [M, 1] first slot in each query's window.
    covered: slots below it were visited by an earlier block (a last block clamped to end at S)."""
    s = _qk(q, k, score, precision)  # [M, K]
    slot = start + lax.broadcasted_iota(jnp.int32, s.shape, 1)  # [M, K]
    s = jnp.where((slot < length) & (slot >= lo_slot), s, _MASKED)
    if s_padded:  # slots past the real cache are not keys (matters for the all-masked uniform case)
        s = jnp.where(slot < s_true, s, _ABSENT)
    if covered is not None:  # counted once already
        s = jnp.where(slot >= covered, s, _ABSENT)
    return _online_update(state, s, v, precision)


def _tree_step(state, q, kt, vt, tree_vis, *, score, precision):
    """Tree block. kt, vt: [W_pad, D] the window keys/values; tree_vis: int32 [M, W_pad] (0 = unseen)."""
    s = _qk(q, kt, score, precision)  # [M, W_pad]
    s = jnp.where(tree_vis != 0, s, _ABSENT)
    return _online_update(state, s, vt, precision)


def _finish(state):
    _, l, acc = state
    # l == 0 only for padding rows (a real query always has >= 1 visible key or sweeps all S slots)
    return acc / jnp.where(l == 0.0, 1.0, l)


def _init_state(m_rows, d):
    return (jnp.full((m_rows, 1), _MASKED, jnp.float32), jnp.zeros((m_rows, 1), jnp.float32),
            jnp.zeros((m_rows, d), jnp.float32))


# ----------------------------------------------------------------------------- TPU (Mosaic) kernel
def _tpu_kernel(len_ref, blo_ref, bhi_ref,  # SMEM scalar prefetch: int32 [B] each
                lay_ref,  # SMEM scalar prefetch: int32 [1], the cache layer (used by the index maps)
                q_ref,  # [block_m, D]: query rows (node*G + g) of this q block
                k_ref, v_ref,  # [block_k, D]: prefix block ki of the layer (clamped into the row's range)
                kt_ref, vt_ref,  # [W_pad, D]: the window's (tree nodes') keys/values
                tv_ref,  # int32 [block_m, W_pad]
                lo_ref,  # int32 [block_m, 1]
                o_ref,  # [block_m, D]
                m_ref, l_ref,  # f32 [block_m, 128] lane-replicated running max / denominator
                acc_ref,  # f32 [block_m, D]
                *, block_k, s_true, s_padded, score, precision):
    b, ki = pl.program_id(0), pl.program_id(3)
    rows, d = acc_ref.shape

    def load_state():
        return (jnp.max(m_ref[...], axis=1)[:, None], jnp.max(l_ref[...], axis=1)[:, None], acc_ref[...])

    def store_state(state):
        m, l, acc = state
        m_ref[...] = jnp.broadcast_to(m, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(l, l_ref.shape)
        acc_ref[...] = acc

    @pl.when(ki == 0)
    def _init():
        store_state(_init_state(rows, d))

    @pl.when((ki >= blo_ref[b]) & (ki < bhi_ref[b]))
    def _prefix():
        store_state(_prefix_step(load_state(), q_ref[...], k_ref[...], v_ref[...], ki * block_k, len_ref[b],
                                 lo_ref[...], s_true=s_true, s_padded=s_padded, score=score,
                                 precision=precision))

    @pl.when(ki == pl.num_programs(3) - 1)
    def _tree_and_write():
        state = _tree_step(load_state(), q_ref[...], kt_ref[...], vt_ref[...], tv_ref[...], score=score,
                           precision=precision)
        o_ref[...] = _finish(state).astype(o_ref.dtype)


def _call_tpu(qr, k_cache, v_cache, kt, vt, tv, lo, lengths, blk_lo, blk_hi, layer, *, block_k, block_m,
              s_true, score, interpret):
    from jax.experimental.pallas import tpu as pltpu

    b, kv, m_pad, d = qr.shape
    s_pad = k_cache.shape[3]  # k/v_cache: [L, B, KV, S_pad, hd]
    w_pad = kt.shape[2]
    nk = s_pad // block_k

    def q_rows(bi, hi, qi, ki, *_):
        return bi, hi, qi, 0

    def tree_kv(bi, hi, qi, ki, *_):
        return bi, hi, 0, 0

    def prefix_block(bi, hi, qi, ki, lens, blo, bhi, lay):
        # Outside [blo, bhi) repeat a neighbouring in-range block: Pallas skips the copy of an unchanged
        # block, and the kernel skips the compute.
        last = jnp.maximum(bhi[bi] - 1, blo[bi])
        return lay[0], bi, hi, jnp.minimum(jnp.maximum(ki, blo[bi]), last), 0

    def mask_rows(bi, hi, qi, ki, *_):
        return bi, qi, 0

    kernel = functools.partial(_tpu_kernel, block_k=block_k, s_true=s_true, s_padded=s_pad != s_true,
                               score=score, precision=_precision(qr.dtype))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(b, kv, m_pad // block_m, nk),
        in_specs=[
            pl.BlockSpec((None, None, block_m, d), q_rows),  # q tile
            pl.BlockSpec((None, None, None, block_k, d), prefix_block),  # k_cache (layer, row, head)
            pl.BlockSpec((None, None, None, block_k, d), prefix_block),  # v_cache
            pl.BlockSpec((None, None, w_pad, d), tree_kv),  # tree keys
            pl.BlockSpec((None, None, w_pad, d), tree_kv),  # tree values
            pl.BlockSpec((None, block_m, w_pad), mask_rows),  # tree visibility
            pl.BlockSpec((None, block_m, 1), mask_rows),  # first visible prefix slot
        ],
        out_specs=pl.BlockSpec((None, None, block_m, d), q_rows),
        scratch_shapes=[pltpu.VMEM((block_m, _LANES), jnp.float32), pltpu.VMEM((block_m, _LANES), jnp.float32),
                        pltpu.VMEM((block_m, d), jnp.float32)],
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, kv, m_pad, d), qr.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="tree_attention_tpu",
    )(lengths, blk_lo, blk_hi, layer, qr, k_cache, v_cache, kt, vt, tv, lo)


# ----------------------------------------------------------------------------- GPU (Triton) kernel
def _gpu_kernel(len_ref, blo_ref, bhi_ref,  # int32 scalars of this row
                lay_ref,  # int32 [1]: the cache layer
                q_ref,  # [block_m, D_pad]: query rows (node*G + g) of this q block
                k_ref, v_ref,  # [L, S_pad, D_pad] (D_pad >= hd: columns past hd are masked on load)
                kt_ref, vt_ref,  # [W_pad, D_pad]: the window's (tree nodes') keys/values
                tv_ref,  # int32 [block_m, W_pad]
                lo_ref,  # int32 [block_m, 1]
                o_ref,  # [block_m, D_pad]
                *, block_k, block_w, head_dim, s_true, score, precision):
    from jax.experimental.pallas import triton as plgpu

    rows, d_pad = q_ref.shape
    length = len_ref[()]
    layer = lay_ref[0]
    q = q_ref[...]
    lo_slot = lo_ref[...]
    col_ok = (lax.broadcasted_iota(jnp.int32, (block_k, d_pad), 1) < head_dim) if d_pad != head_dim else None

    def load_block(ref, start):
        view = ref.at[layer, pl.ds(start, block_k), :]
        return view[...] if col_ok is None else plgpu.load(view, mask=col_ok, other=0)

    def body(ki, state):
        start = ki * block_k
        return _prefix_step(state, q, load_block(k_ref, start), load_block(v_ref, start), start, length, lo_slot,
                            s_true=s_true, s_padded=k_ref.shape[0] != s_true, score=score, precision=precision)

    def window_body(wi, state):  # the tree window in blocks of block_w keys (GPU_WINDOW_BYTES)
        cols = pl.ds(pl.multiple_of(wi * block_w, block_w), block_w)
        return _tree_step(state, q, kt_ref[cols, :], vt_ref[cols, :], tv_ref[:, cols], score=score,
                          precision=precision)

    state = lax.fori_loop(blo_ref[()], bhi_ref[()], body, _init_state(rows, d_pad))
    state = lax.fori_loop(0, kt_ref.shape[0] // block_w, window_body, state)
    o_ref[...] = _finish(state).astype(o_ref.dtype)


def _call_gpu(qr, k_cache, v_cache, kt, vt, tv, lo, lengths, blk_lo, blk_hi, layer, *, block_k, block_m, block_w,
              s_true, head_dim, score, interpret):
    from jax.experimental.pallas import triton as plgpu

    b, kv, m_pad, d_pad = qr.shape
    n_layers, s_pad = k_cache.shape[0], k_cache.shape[3]  # k/v_cache: [L, B, KV, S_pad, hd]
    w_pad = kt.shape[2]

    def q_rows(bi, hi, qi):
        return bi, hi, qi, 0

    def whole(bi, hi, qi):
        return bi, hi, 0, 0

    def all_layers(bi, hi, qi):
        return 0, bi, hi, 0, 0

    def mask_rows(bi, hi, qi):
        return bi, qi, 0

    def scalar(bi, hi, qi):
        return (bi,)

    def first(bi, hi, qi):
        return (0,)

    kernel = functools.partial(_gpu_kernel, block_k=block_k, block_w=block_w, head_dim=head_dim, s_true=s_true,
                               score=score, precision=_precision(qr.dtype))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, kv, m_pad, d_pad), qr.dtype),
        grid=(b, kv, m_pad // block_m),
        in_specs=[
            pl.BlockSpec((None,), scalar),  # lengths
            pl.BlockSpec((None,), scalar),  # first prefix block
            pl.BlockSpec((None,), scalar),  # end prefix block
            pl.BlockSpec((1,), first),  # layer
            pl.BlockSpec((None, None, block_m, d_pad), q_rows),  # q tile
            # k/v_cache: every layer of this (row, head), read block by block at `layer`
            pl.BlockSpec((n_layers, None, None, s_pad, d_pad), all_layers),
            pl.BlockSpec((n_layers, None, None, s_pad, d_pad), all_layers),
            pl.BlockSpec((None, None, w_pad, d_pad), whole),  # tree keys
            pl.BlockSpec((None, None, w_pad, d_pad), whole),  # tree values
            pl.BlockSpec((None, block_m, w_pad), mask_rows),  # tree visibility
            pl.BlockSpec((None, block_m, 1), mask_rows),  # first visible prefix slot
        ],
        out_specs=pl.BlockSpec((None, None, block_m, d_pad), q_rows),
        compiler_params=plgpu.CompilerParams(num_warps=4 if d_pad <= 64 else 8, num_stages=2),
        interpret=interpret,
        name="tree_attention_gpu",
    )(lengths, blk_lo, blk_hi, layer, qr, k_cache, v_cache, kt, vt, tv, lo)


# ----------------------------------------------------------------------------- block plan
def block_plan(variant: str, s: int, m: int, w: int, hd: int, block_k: int | None = None,
               block_m: int | None = None, block_w: int | None = None) -> dict:
    """Static block sizes of a call: block_k (prefix slots per step), block_m (query rows per program),
    block_w (tree window keys per step) and the padded S, M (= N*G query rows), W (tree window keys) and
    D (head dim).

    TPU: the (8, 128) rule (blocks' last two dims multiples of (8, 128) or full array dims); the window
    is one block (it sits in VMEM whole).
    GPU: every loaded tensor a power of two, dot operands >= 16; window blocks, and by default prefix
    blocks, of at most GPU_WINDOW_BYTES of keys and values, so a large tree and a wide head (hd 256)
    fit in shared memory.
    """
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS}, got {variant!r}")
    for name, val in (("block_k", block_k), ("block_m", block_m), ("block_w", block_w)):
        if val is not None and (not isinstance(val, (int, np.integer)) or val <= 0):
            raise ValueError(f"{name} must be a positive int or None, got {val!r}")
    if variant == "tpu":
        if block_k is None:
            block_k = next((c for c in (512, 256, 128) if s % c == 0), None)
            if block_k is None:
                block_k = s if s <= 1024 else 512  # one full-S block, or pad S to a multiple of 512
        elif block_k % 8 and block_k != s:
            raise ValueError(f"TPU block_k must be a multiple of 8 (or S={s}), got {block_k}")
        if block_m is None:
            block_m = round_up(m, 16) if m <= 256 else 128  # 16: a bf16 sublane tile
        elif block_m % 8:
            raise ValueError(f"TPU block_m must be a multiple of 8, got {block_m}")
        w_pad = round_up(w, _LANES)
        if block_w is not None and block_w != w_pad:
            raise ValueError(f"the TPU lowering reads the tree window whole (W padded = {w_pad}); block_w "
                             f"applies to the GPU lowering only, got {block_w}")
        return dict(block_k=block_k, block_m=block_m, block_w=w_pad, s_pad=round_up(s, block_k),
                    m_pad=round_up(m, block_m), w_pad=w_pad, d_pad=hd)
    d_pad = next_pow2(max(hd, 16))
    kv_rows = max(16, GPU_WINDOW_BYTES // (2 * d_pad * 4))  # keys per block within the window's byte budget
    if block_k is None:  # the prefix blocks under the same budget: 64 keys up to hd 128, 32 at Gemma's 256
        block_k = next((c for c in (64, 32, 16) if s % c == 0 and c <= kv_rows), 16)
    elif block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"GPU block_k must be a power of two >= 16, got {block_k}")
    m_pow2 = next_pow2(max(m, 16))
    if block_m is None:
        # bounds what a program keeps in registers: on an H200 (f32, hd 64) 64 rows spilled and ran
        # 7x slower than 32 (BENCHMARKS.md, 'The Pallas kernels on a GPU')
        block_m = min(m_pow2, GPU_BLOCK_M)
    elif block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"GPU block_m must be a power of two >= 16, got {block_m}")
    if block_w is None:  # powers of two: d_pad is one
        block_w = min(next_pow2(max(w, 16)), kv_rows)
    elif block_w < 16 or block_w & (block_w - 1):
        raise ValueError(f"GPU block_w must be a power of two >= 16, got {block_w}")
    w_pad = round_up(max(w, 1), block_w)  # whole blocks: 257 keys are 3 blocks of 128, not 512 keys
    return dict(block_k=block_k, block_m=block_m, block_w=block_w, s_pad=round_up(s, block_k),
                m_pad=round_up(m, block_m), w_pad=w_pad, d_pad=d_pad)  # whole query blocks, as the window


# ----------------------------------------------------------------------------- shared by kernel and blockwise
def _visibility(tree_mask, lengths, q_positions, key_positions, window):
    """Per-node inputs of both implementations, on [B, N, W]-sized arrays: the window columns each node
    sees (tree mask and sliding window) bool[B, N, W], the first prefix slot inside each node's window
    int32[B, N], and which rows hold a query that sees no key at all bool[B] (they sweep all S slots,
    which reproduces the reference's uniform average exactly)."""
    b, n = tree_mask.shape[:2]
    tv = tree_mask.astype(bool)  # [B, N, W]
    lo_slot = jnp.zeros((b, n), jnp.int32)
    if q_positions is not None:
        qpos = q_positions.astype(jnp.int32)
        kpos = qpos if key_positions is None else key_positions.astype(jnp.int32)  # [B, W]
        win = jnp.asarray(window, jnp.int32)
        tv = tv & ((win <= 0) | ((qpos[:, :, None] - kpos[:, None, :]) < win))
        lo_slot = jnp.where(win > 0, qpos - win + 1, 0)
    sees_prefix = jnp.maximum(lo_slot, 0) < lengths[:, None]  # [B, N]
    blind = ~(sees_prefix | jnp.any(tv, axis=-1))  # [B, N]
    return tv, lo_slot, jnp.any(blind, axis=-1)


def _block_range(lengths, lo_slot, sweep_all, block_k: int, num_blocks: int):
    """Prefix blocks [blk_lo[b], blk_hi[b]) row b must visit: up to its committed length, from the first
    block inside some node's window (all blocks for a sweeping row). int32[B] each."""
    blk_lo = jnp.where(sweep_all, 0, jnp.clip(jnp.min(jnp.maximum(lo_slot, 0), axis=-1) // block_k, 0,
                                              num_blocks - 1))
    blk_hi = jnp.where(sweep_all, num_blocks, jnp.clip(-(-lengths // block_k), 0, num_blocks))
    return blk_lo.astype(jnp.int32), blk_hi.astype(jnp.int32)


def _window_kv(k_cache, v_cache, layer, lengths, w_cols: int):
    """The W window keys/values of layer `layer`, slots lengths[b]..lengths[b]+W-1: [B, KV, W, hd] each.
    k/v_cache: [L, B, KV, S, hd]. A gather of just those entries with the row as a batch dimension (no
    transposed view of the cache; a cache sharded by rows stays partitioned)."""
    b = lengths.shape[0]
    slots = lengths[:, None] + jnp.arange(w_cols, dtype=jnp.int32)[None, :]  # [B, W]
    idx = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (b, w_cols)), slots], axis=-1)  # [B, W, 2]
    kv, hd = k_cache.shape[2], k_cache.shape[4]
    dims = lax.GatherDimensionNumbers(offset_dims=(2, 3), collapsed_slice_dims=(0, 3), start_index_map=(0, 3),
                                      operand_batching_dims=(1,), start_indices_batching_dims=(0,))

    def take(c):  # [B, W, KV, hd] -> [B, KV, W, hd]
        return lax.gather(c, idx, dims, (1, 1, kv, 1, hd), indices_are_sorted=True,
                          mode=lax.GatherScatterMode.CLIP).transpose(0, 2, 1, 3)
    return take(k_cache), take(v_cache)


def _query_rows(q, kv: int):
    """[B, N, H, hd] -> [B, KV, M, hd], query row r = node * G + g (the kernel's tile per KV head)."""
    b, n, h, hd = q.shape
    return q.reshape(b, n, kv, h // kv, hd).transpose(0, 2, 1, 3, 4).reshape(b, kv, n * (h // kv), hd)


def _from_query_rows(out, n: int, h: int, hd: int):
    """[B, KV, M(_pad), D(_pad)] -> [B, N, H, hd]."""
    b, kv = out.shape[:2]
    out = out[:, :, :n * (h // kv), :hd]
    return out.reshape(b, kv, n, h // kv, hd).transpose(0, 2, 1, 3, 4).reshape(b, n, h, hd)


def _as_stacked(k_cache, v_cache, layer):
    """Both layouts as the stacked one: a [B, KV, S, hd] cache is layer 0 of a 1-layer stack (a free
    reshape). Returns (k, v, layer as int32[1])."""
    if layer is None:
        return k_cache[None], v_cache[None], jnp.zeros((1,), jnp.int32)
    return k_cache, v_cache, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))


# ----------------------------------------------------------------------------- kernel wrapper
@functools.partial(jax.jit, static_argnames=("score", "variant", "block_k", "block_m", "block_w", "interpret"))
def _pallas_forward(q, k_cache, v_cache, lengths, tree_mask, q_positions, key_positions, window, layer, *,
                    score, variant, block_k, block_m, block_w, interpret):
    """k/v_cache: [L, B, KV, S, hd]; layer: int32[1]."""
    b, n, h, hd = q.shape
    kv, s = k_cache.shape[2], k_cache.shape[3]
    w_cols = tree_mask.shape[2]
    g = h // kv
    m = n * g
    plan = block_plan(variant, s, m, w_cols, hd, block_k, block_m, block_w)
    bk, bm, s_pad, m_pad, w_pad, d_pad = (plan[k] for k in ("block_k", "block_m", "s_pad", "m_pad", "w_pad",
                                                             "d_pad"))
    lengths = lengths.astype(jnp.int32)
    tv, lo_slot, sweep_all = _visibility(tree_mask, lengths, q_positions, key_positions, window)
    blk_lo, blk_hi = _block_range(lengths, lo_slot, sweep_all, bk, s_pad // bk)

    qr = _query_rows(q, kv)  # [B, KV, M, hd]
    kt, vt = _window_kv(k_cache, v_cache, layer[0], lengths, w_cols)  # [B, KV, W, hd]
    tv_rows = jnp.repeat(tv, g, axis=1).astype(jnp.int32)  # [B, M, W]
    lo_rows = jnp.repeat(lo_slot, g, axis=1)[:, :, None]  # [B, M, 1]

    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, m_pad - m), (0, d_pad - hd)))
    kt = jnp.pad(kt, ((0, 0), (0, 0), (0, w_pad - w_cols), (0, d_pad - hd)))
    vt = jnp.pad(vt, ((0, 0), (0, 0), (0, w_pad - w_cols), (0, d_pad - hd)))
    tv_rows = jnp.pad(tv_rows, ((0, 0), (0, m_pad - m), (0, w_pad - w_cols)))
    lo_rows = jnp.pad(lo_rows, ((0, 0), (0, m_pad - m), (0, 0)))
    if s_pad != s:  # slow path (copies the layer): S has no legal block size
        pad = ((0, 0), (0, 0), (0, 0), (0, s_pad - s), (0, 0))
        k_cache = jnp.pad(lax.dynamic_index_in_dim(k_cache, layer[0], 0), pad)
        v_cache = jnp.pad(lax.dynamic_index_in_dim(v_cache, layer[0], 0), pad)
        layer = jnp.zeros((1,), jnp.int32)

    args = (qr, k_cache, v_cache, kt, vt, tv_rows, lo_rows, lengths, blk_lo, blk_hi, layer)
    if variant == "tpu":
        out = _call_tpu(*args, block_k=bk, block_m=bm, s_true=s, score=score, interpret=interpret)
    else:  # the cache keeps its hd columns; the kernel's block is D_pad wide and loads are masked
        out = _call_gpu(*args, block_k=bk, block_m=bm, block_w=plan["block_w"], s_true=s, head_dim=hd, score=score,
                        interpret=interpret)
    return _from_query_rows(out, n, h, hd)


def _default_variant() -> str:
    return "gpu" if jax.default_backend() == "gpu" else "tpu"


def tree_attention_pallas(q, k_cache, v_cache, lengths, tree_mask, *, q_positions=None, window=0,
                          sm_scale=None, key_positions=None, layer=None, interpret=False, variant=None,
                          block_k=None, block_m=None, block_w=None, softcap=None):
    """The Pallas kernel. `variant` "tpu" | "gpu" (default: by backend; "tpu" on CPU) picks the
    lowering; `interpret=True` runs it in Pallas interpret mode (any backend); `block_k` / `block_m` /
    `block_w` override the prefix block size / query rows per program / tree window keys per step
    (checked against the variant's rules)."""
    hd = _check_inputs(q, k_cache, v_cache, lengths, tree_mask, q_positions, window, sm_scale, key_positions,
                       layer, softcap)[-1]
    variant = variant or _default_variant()
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS} or None, got {variant!r}")
    k_cache, v_cache, layer = _as_stacked(k_cache, v_cache, layer)
    return _pallas_forward(q, k_cache, v_cache, lengths, tree_mask, q_positions, key_positions,
                           jnp.asarray(window, jnp.int32), layer, score=_score(sm_scale, softcap, hd), variant=variant,
                           block_k=block_k, block_m=block_m, block_w=block_w, interpret=bool(interpret))


# ----------------------------------------------------------------------------- blockwise (jnp)
BLOCKWISE_BLOCK_K = 256  # prefix slots per step of the blockwise form (accelerators)
# On CPU a loop step costs little and every slot swept costs its share: with 64-slot blocks the sweep
# follows the committed prefix instead of the whole cache (BENCHMARKS.md, issue 11: plain decoding
# 1.0-1.5x faster at 128-384-token prompts, and the speculative engine's extra tree room nearly free).
BLOCKWISE_BLOCK_K_CPU = 64
# On a GPU each trip of the block loop is a device round trip, while sweeping a whole cache costs next to
# nothing: on an H200 the 256-slot loop took 128 us (cache 512) and 462 us (cache 4096, 7B-like heads)
# against 58 and 47 us for one dense sweep (BENCHMARKS.md, "On a GPU"). Caches up to 4096 slots are one block.
BLOCKWISE_BLOCK_K_GPU = 4096


def blockwise_block_k() -> int:
    """The blockwise form's default block for the default backend."""
    backend = jax.default_backend()
    return {"cpu": BLOCKWISE_BLOCK_K_CPU, "gpu": BLOCKWISE_BLOCK_K_GPU}.get(backend, BLOCKWISE_BLOCK_K)


@functools.partial(jax.jit, static_argnames=("score", "block_k"))
def _blockwise_forward(q, k_cache, v_cache, lengths, tree_mask, q_positions, key_positions, window, layer, *,
                       score, block_k):
    """The kernel's steps in jnp, vmapped over (row, KV head). k/v_cache: [L, B, KV, S, hd]; layer int32[1]."""
    b, n, h, hd = q.shape
    kv, s = k_cache.shape[2], k_cache.shape[3]
    w_cols = tree_mask.shape[2]
    g = h // kv
    bk = min(block_k, s)
    lengths = lengths.astype(jnp.int32)
    layer = layer[0]
    tv, lo_slot, sweep_all = _visibility(tree_mask, lengths, q_positions, key_positions, window)
    blk_lo, blk_hi = _block_range(lengths, lo_slot, sweep_all, bk, -(-s // bk))
    qr = _query_rows(q, kv)  # [B, KV, M, hd]
    lo_rows = jnp.repeat(lo_slot, g, axis=1)[:, :, None]  # [B, M, 1]
    precision = _precision(q.dtype)

    # One step per (row, KV head): vmapped over KV heads (shared length / window bounds), then rows.
    prefix = functools.partial(_prefix_step, s_true=s, s_padded=False, score=score, precision=precision)
    prefix = jax.vmap(jax.vmap(prefix, in_axes=(0, 0, 0, 0, None, None, None, None)),
                      in_axes=(0, 0, 0, 0, None, 0, 0, None))
    tree = functools.partial(_tree_step, score=score, precision=precision)
    tree = jax.vmap(jax.vmap(tree, in_axes=(0, 0, 0, 0, None)))

    def block(i, state):
        # Every row visits the union of the rows' ranges: in a block outside its own range all of a row's
        # slots score -1e30 (masked) and weigh exactly 0 once a visible key is seen, so the result is the
        # kernel's. A last block that would pass S is moved back to end at S; `covered` drops the overlap.
        want = i * bk
        start = jnp.minimum(want, s - bk)
        kb = lax.dynamic_slice(k_cache, (layer, 0, 0, start, 0), (1, b, kv, bk, hd))[0]  # [B, KV, bk, hd]
        vb = lax.dynamic_slice(v_cache, (layer, 0, 0, start, 0), (1, b, kv, bk, hd))[0]
        return prefix(state, qr, kb, vb, start, lengths, lo_rows, want if s % bk else None)

    init = jax.tree.map(lambda x: jnp.broadcast_to(x, (b, kv) + x.shape), _init_state(qr.shape[2], hd))
    if bk == s:  # one block: visit it (an all-masked block is exact, see above) without a loop
        state = block(0, init)
    else:
        state = lax.fori_loop(jnp.min(blk_lo), jnp.max(blk_hi), block, init)
    kt, vt = _window_kv(k_cache, v_cache, layer, lengths, w_cols)  # [B, KV, W, hd]
    state = tree(state, qr, kt, vt, jnp.repeat(tv, g, axis=1).astype(jnp.int32))
    return _from_query_rows(_finish(state).astype(q.dtype), n, h, hd)


def tree_attention_blockwise(q, k_cache, v_cache, lengths, tree_mask, *, q_positions=None, window=0,
                             sm_scale=None, key_positions=None, layer=None, block_k=None, softcap=None):
    """The kernel's math in jnp (XLA on any backend): cost follows the longest committed prefix in the
    batch, not the cache capacity. block_k: prefix slots per step (any positive int; None:
    `blockwise_block_k()`)."""
    hd = _check_inputs(q, k_cache, v_cache, lengths, tree_mask, q_positions, window, sm_scale, key_positions,
                       layer, softcap)[-1]
    block_k = blockwise_block_k() if block_k is None else block_k
    if isinstance(block_k, (bool, np.bool_)) or not isinstance(block_k, (int, np.integer)) or block_k <= 0:
        raise ValueError(f"block_k must be a positive int, got {block_k!r}")
    k_cache, v_cache, layer = _as_stacked(k_cache, v_cache, layer)
    return _blockwise_forward(q, k_cache, v_cache, lengths, tree_mask, q_positions, key_positions,
                              jnp.asarray(window, jnp.int32), layer, score=_score(sm_scale, softcap, hd),
                              block_k=int(block_k))


# ----------------------------------------------------------------------------- public ops
def tree_attention(q, k_cache, v_cache, lengths, tree_mask, *, q_positions=None, window=0, sm_scale=None,
                   key_positions=None, layer=None, impl="auto", block_k=None, softcap=None):
    """Attention of N tree nodes over their row's committed prefix plus their tree ancestors.

    impl: "auto" (the Pallas kernel on gpu/tpu, the blockwise jnp form elsewhere), "pallas", "interpret"
    (the kernel in Pallas interpret mode, for tests), "blockwise", "reference" (dense). block_k: prefix
    slots per step (None: the implementation's default). See the module docstring for shapes and
    semantics.
    """
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "pallas" if jax.default_backend() in ("gpu", "tpu") else "blockwise"
    if impl == "pallas" and jax.default_backend() not in ("gpu", "tpu"):
        raise ValueError(f"impl='pallas' compiles the kernel for a GPU or TPU, but the default backend is "
                         f"{jax.default_backend()!r}: use impl='interpret' (or 'blockwise', or 'auto')")
    kw = dict(q_positions=q_positions, window=window, sm_scale=sm_scale, key_positions=key_positions, layer=layer,
              softcap=softcap)
    if impl == "reference":
        return tree_attention_reference(q, k_cache, v_cache, lengths, tree_mask, **kw)
    if impl == "blockwise":
        return tree_attention_blockwise(q, k_cache, v_cache, lengths, tree_mask, block_k=block_k, **kw)
    return tree_attention_pallas(q, k_cache, v_cache, lengths, tree_mask, interpret=impl == "interpret",
                                 block_k=block_k, **kw)


def sharded_tree_attention(mesh, q, k_cache, v_cache, lengths, tree_mask, *, q_positions=None, window=0,
                           sm_scale=None, key_positions=None, layer=None, impl="auto", softcap=None):
    """`tree_attention` under shard_map: batch over mesh axis "data", KV heads (with their query groups)
    over "model"; every device runs the op on its local shard (a stacked cache keeps its layer axis
    whole). An axis the mesh does not divide, or lacks, is replicated over that mesh axis instead (as in
    jaxdecode.sharding), which stays correct."""
    from jax.sharding import PartitionSpec as P

    b, n, w_cols, h, kv, s, hd = _check_inputs(q, k_cache, v_cache, lengths, tree_mask, q_positions, window,
                                               sm_scale, key_positions, layer, softcap)
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    other = [a for a in mesh.axis_names if a not in ("data", "model")]
    if other:
        raise ValueError(f"the mesh's axes are {tuple(mesh.axis_names)}, but this op shards rows over an axis named "
                         f"'data' and KV heads over one named 'model' (a mesh may lack either); rename {other}")
    # an axis the mesh lacks counts as size 1 (a data-only or model-only mesh)
    bax = "data" if "data" in mesh.shape and b % mesh.shape["data"] == 0 else None
    hax = "model" if "model" in mesh.shape and kv % mesh.shape["model"] == 0 else None  # splits at group bounds
    sm_scale = _scale(sm_scale, hd)

    cache_spec = P(bax, hax, None, None) if layer is None else P(None, bax, hax, None, None)
    specs = [P(bax, None, hax, None), cache_spec, cache_spec, P(bax), P(bax, None, None)]
    args = [q, k_cache, v_cache, lengths, tree_mask]
    if q_positions is not None:  # window (int or traced scalar) rides along replicated
        specs += [P(bax, None), P(), P(bax, None)]
        args += [q_positions, jnp.asarray(window, jnp.int32),
                 q_positions if key_positions is None else key_positions]
    if layer is not None:
        specs.append(P())
        args.append(jnp.asarray(layer, jnp.int32))

    def local(q, k, v, lens, tm, *rest):
        qp, win, kp = rest[:3] if q_positions is not None else (None, 0, None)
        return tree_attention(q, k, v, lens, tm, q_positions=qp, window=win, sm_scale=sm_scale,
                              key_positions=kp, layer=rest[-1] if layer is not None else None, impl=impl,
                              softcap=softcap)

    return shard_map(local, mesh, tuple(specs), P(bax, None, hax, None))(*args)
