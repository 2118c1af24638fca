"""The constrained decoding step: log-softmax, gather of the allowed tokens, masked top-k, in one pass.

    constrained_topk(logits[R, V], k, *, candidates=None, mask=None, impl="auto") -> (values, slots)
      logits      [R, V] float    raw next-token logits of R rows (beams)
      candidates  int32[R, C]     the row's allowed token ids (a gathered CSR row of the trie plus EOS
                                  slots); -1 (or any id outside [0, V)) = no candidate in this slot
      mask        bool[R, V]      alternatively: the allowed tokens as a mask (a dense trie level)
      k           static int      k <= C (candidates) or k <= V (mask)
      values      f32[R, k]       log_softmax(logits)[r, token] of the row's k best allowed tokens, best
                                  first; -inf where the row has fewer than k
      slots       int32[R, k]     their candidate slot (candidates) or token id (mask); -1 where the value
                                  is -inf. Ties go to the lower slot, as in lax.top_k.

The STATIC beam step (ALGORITHMS.md §6) is this op on every beam's CSR row, then a top-k over the
beams x k survivors. The reference materialises the [R, V] log-probs (`logits - logsumexp`) and gathers
from them; the kernel reads each row block of logits once into VMEM / registers, computes its
normaliser there, gathers the candidates and runs the top-k on them, and writes only the [R, k]
result, so the [R, V] log-probs never reach memory.

Kernel design (`impl="pallas"`), the same math for both lowerings: blocks of `block_rows` rows; the
vocabulary is read in tiles of `v_tile` columns (one tile when V fits), and per row block
  1. the log-sum-exp accumulates online over the tiles: running max m and sum s of exp(x - m), s
     rescaled when m grows (padding columns are -inf);
  2. candidates: each tile, a loop over the C candidate slots, each a compare-select-max over the tile
     (slot j's token is extracted by a masked max, so no vector gather is needed: neither Mosaic nor
     Triton has a general in-register gather), accumulating each slot's raw logit; mask: each tile's
     allowed logits merge into a running top-k (k rounds of max over the running k and the tile,
     lowest token id on ties);
  3. after the last tile: values minus the log-sum-exp, and (candidates) the top-k: k rounds of (max,
     lowest index attaining it, knock it out).
Step 2 costs C x V per row, so it suits the narrow CSR levels; wide levels are dense in the index
(`jaxdecode.constraints.index`) and use the mask form, whose cost is k x V. Token ids and slot indices
are carried as float32 inside the kernel (exact below 2**24), because float lane reductions are the
ones both backends lower everywhere. `block_plan` gives the padded sizes and tiles:
  * "tpu" (Mosaic): grid (row blocks, V tiles), the tile axis "arbitrary" with the running statistics
    in VMEM scratch; blocks obey the (8, 128) rule: block_rows a multiple of 8 (32 for the int8 mask),
    tiles, C and k multiples of 128. The tile is the widest (up to 8192) whose estimated working set
    (double-buffered inputs, outputs, scratch, temporaries) stays within 24 MiB, and the call sets
    `vmem_limit_bytes` to cover it (the default scoped limit is 16 or 32 MiB by generation; v7x has
    64 MiB of VMEM per core), so V = 128 K runs in 16 tiles of 8192.
  * "gpu" (Triton): one program per row block loops over the tiles (`pl.ds` slices of the row);
    every block dimension a power of two, block_rows x v_tile <= 16 K floats so a tile stays in
    registers (v_tile <= 4096, block_rows <= 16). Only tiles that hold real columns are visited.
The CSR rows themselves (contiguous int16 slices of the trie) are gathered by XLA before the call:
a per-row DMA of a few dozen ids costs more than one batched gather.

Where it runs: `impl="auto"` is this kernel on TPU and the jnp reference on GPU (measured faster
there, see `resolve_impl`) and CPU. The trie constraint (jaxdecode.constraints) calls the op for
every constrained step (the kernel on TPU): greedy and
sampling do not (they mask the logits), beam search does at every step, per row for the first step
and per beam then per group (the group's top-k over the beams' kernel winners) for the others.

`sharded_constrained_topk` runs the op under `shard_map` with rows over the mesh axis "data": the trie
stays replicated (it is not an input here), each device works on its own beams.
"""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from .common import next_pow2, round_up, shard_map

_IMPLS = ("auto", "pallas", "interpret", "reference")
_VARIANTS = ("tpu", "gpu")
_NEG = float("-inf")
_BIG = float(1 << 30)  # > any slot index, exact in float32


# ----------------------------------------------------------------------------- checks
def _check(logits, k, candidates, mask):
    if getattr(logits, "ndim", None) != 2 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits must be a float array [rows, vocab], got "
                         f"{getattr(logits, 'dtype', type(logits))}{getattr(logits, 'shape', '')}")
    r, v = logits.shape
    if (candidates is None) == (mask is None):
        raise ValueError("pass exactly one of candidates= (int32[rows, C] token ids, -1 = none) or "
                         "mask= (bool[rows, vocab])")
    if candidates is not None:
        if (getattr(candidates, "ndim", None) != 2 or candidates.shape[0] != r
                or not jnp.issubdtype(candidates.dtype, jnp.integer)):
            raise ValueError(f"candidates must be an int array [rows={r}, C], got "
                             f"{getattr(candidates, 'dtype', type(candidates))}{getattr(candidates, 'shape', '')}")
        width = candidates.shape[1]
    else:
        if getattr(mask, "shape", None) != (r, v) or not (mask.dtype == jnp.bool_
                                                           or jnp.issubdtype(mask.dtype, jnp.integer)):
            raise ValueError(f"mask must be bool[rows, vocab]=({r}, {v}), got "
                             f"{getattr(mask, 'dtype', type(mask))}{getattr(mask, 'shape', '')}")
        width = v
    if not isinstance(k, numbers.Integral) or isinstance(k, bool) or not 1 <= k <= width:
        raise ValueError(f"k must be an int in [1, {width}] (the number of candidate slots), got {k!r}")
    return r, v, width


# ----------------------------------------------------------------------------- reference
def constrained_topk_reference(logits, k: int, *, candidates=None, mask=None):
    """Pure-jnp reference of `constrained_topk` (see the module docstring)."""
    _check(logits, k, candidates, mask)
    x = logits.astype(jnp.float32)
    logp = x - jax.nn.logsumexp(x, axis=-1, keepdims=True)  # [R, V]
    v = x.shape[-1]
    if candidates is not None:
        ok = (candidates >= 0) & (candidates < v)
        vals = jnp.take_along_axis(logp, jnp.where(ok, candidates, 0).astype(jnp.int32), axis=-1)
        vals = jnp.where(ok, vals, _NEG)
    else:
        vals = jnp.where(mask.astype(bool), logp, _NEG)
    top, slots = lax.top_k(vals, k)
    return top, jnp.where(top > _NEG, slots, -1).astype(jnp.int32)


# ----------------------------------------------------------------------------- kernel math
def _online_lse(m, s, x):
    """Fold a tile x f32 [bm, T] (padding -inf) into the running max m and sum s of exp(x - m) [bm, 1]."""
    m_new = jnp.maximum(m, jnp.max(x, axis=1, keepdims=True))
    m_safe = jnp.where(m_new > _NEG, m_new, 0.0)
    s_new = s * jnp.exp(m - m_safe) + jnp.sum(jnp.exp(x - m_safe), axis=1, keepdims=True)
    return m_new, s_new


def _lse(m, s):
    """log-sum-exp from the running statistics; -inf for rows with no finite logit."""
    return jnp.where(m > _NEG, m, 0.0) + jnp.log(s)


def _gather_tile(acc, x, cand, col0, n_slots):
    """acc[r, j] = max(acc[r, j], x[r, cand[r, j] - col0]) where slot j's token lies in this tile.
    acc f32 [bm, Cp] raw logits so far (-inf: not found yet), x f32 [bm, T], cand f32 [bm, Cp] ids."""
    bm, tv = x.shape
    cp = cand.shape[1]
    col_v = lax.broadcasted_iota(jnp.int32, (bm, tv), 1).astype(jnp.float32) + col0
    col_c = lax.broadcasted_iota(jnp.int32, (bm, cp), 1).astype(jnp.float32)

    def body(j, acc):
        here = col_c == j.astype(jnp.float32)
        tok = jnp.max(jnp.where(here, cand, -1.0), axis=1, keepdims=True)  # [bm, 1]
        got = jnp.max(jnp.where(col_v == tok, x, _NEG), axis=1, keepdims=True)  # -inf: not in this tile
        return jnp.where(here, jnp.maximum(acc, got), acc)

    return lax.fori_loop(0, n_slots, body, acc)


def _merge_topk(run_v, run_i, x, col0, k):
    """The best k of the running top-k (run_v values, run_i token ids: f32 [bm, kp], best first) and the
    tile x f32 [bm, T] whose column c is token col0 + c: k rounds of max, lowest id on ties."""
    bm, tv = x.shape
    kp = run_v.shape[1]
    col = lax.broadcasted_iota(jnp.int32, (bm, tv), 1).astype(jnp.float32) + col0
    col_k = lax.broadcasted_iota(jnp.int32, (bm, kp), 1).astype(jnp.float32)

    def body(i, carry):
        rv, tx, out_v, out_i = carry
        best = jnp.maximum(jnp.max(rv, axis=1, keepdims=True), jnp.max(tx, axis=1, keepdims=True))
        idx = jnp.minimum(jnp.min(jnp.where(rv == best, run_i, _BIG), axis=1, keepdims=True),
                          jnp.min(jnp.where(tx == best, col, _BIG), axis=1, keepdims=True))
        rv = jnp.where(run_i == idx, _NEG, rv)
        tx = jnp.where(col == idx, _NEG, tx)
        here = col_k == i.astype(jnp.float32)
        return rv, tx, jnp.where(here, best, out_v), jnp.where(here, idx, out_i)

    init = (run_v, x, jnp.full((bm, kp), _NEG, jnp.float32), jnp.full((bm, kp), _BIG, jnp.float32))
    _, _, out_v, out_i = lax.fori_loop(0, k, body, init)
    return out_v, out_i


def _topk_rounds(vals, k, kp):
    """k rounds of select-the-max over vals f32 [bm, W]: (values f32 [bm, kp], slots f32 [bm, kp])."""
    bm, w = vals.shape
    col = lax.broadcasted_iota(jnp.int32, (bm, w), 1).astype(jnp.float32)
    col_k = lax.broadcasted_iota(jnp.int32, (bm, kp), 1).astype(jnp.float32)

    def body(i, carry):
        vals, out_v, out_s = carry
        best = jnp.max(vals, axis=1)[:, None]
        idx = jnp.min(jnp.where(vals == best, col, _BIG), axis=1)[:, None]  # lowest slot on ties
        vals = jnp.where(col == idx, _NEG, vals)
        here = col_k == i.astype(jnp.float32)
        out_v = jnp.where(here, best, out_v)
        out_s = jnp.where(here, jnp.where(best > _NEG, idx, -1.0), out_s)
        return vals, out_v, out_s

    init = (vals, jnp.full((bm, kp), _NEG, jnp.float32), jnp.full((bm, kp), -1.0, jnp.float32))
    _, out_v, out_s = lax.fori_loop(0, k, body, init)
    return out_v, out_s


def _tile_logits(x, col0, vocab, v_pad):
    """A tile as f32 with the padding columns (ids >= vocab) at -inf."""
    x = x.astype(jnp.float32)
    if v_pad == vocab:
        return x
    col = lax.broadcasted_iota(jnp.int32, x.shape, 1).astype(jnp.float32) + col0
    return jnp.where(col < vocab, x, _NEG)


def _init_acc(mode, bm, w_pad, k_pad):
    """The running selection: slot logits f32 [bm, w_pad] (candidates) or the top-k (values, ids)."""
    if mode == "candidates":
        return (jnp.full((bm, w_pad), _NEG, jnp.float32),)
    return jnp.full((bm, k_pad), _NEG, jnp.float32), jnp.full((bm, k_pad), _BIG, jnp.float32)


def _update(acc, x, aux, col0, *, mode, k, n_slots):
    """Fold one tile into the running selection (aux: the candidate ids, or the tile of the mask)."""
    if mode == "candidates":
        return (_gather_tile(acc[0], x, aux, col0, n_slots),)
    allowed = jnp.where(aux.astype(jnp.int32) != 0, x, _NEG)  # int8 mask: widen before comparing
    return _merge_topk(acc[0], acc[1], allowed, col0, k)


def _finish(acc, lse, cand, *, mode, k, k_pad):
    """(values - lse, slots) f32 [bm, k_pad] from the running selection."""
    if mode == "candidates":
        vals = jnp.where((cand >= 0) & (acc[0] > _NEG), acc[0] - lse, _NEG)
        return _topk_rounds(vals, k, k_pad)
    out_v, out_i = acc
    ok = out_v > _NEG
    return jnp.where(ok, out_v - lse, _NEG), jnp.where(ok, out_i, -1.0)


def _tpu_kernel(x_ref, a_ref, v_out, s_out, m_ref, l_ref, *acc_refs, mode, k, n_slots, vocab, v_pad, v_tile):
    """Grid (row block i, V tile j): running statistics in VMEM scratch, outputs at the last tile."""
    j = pl.program_id(1)
    bm = x_ref.shape[0]

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        w_pad = acc_refs[0].shape[1] if mode == "candidates" else 0
        for r, a in zip(acc_refs, _init_acc(mode, bm, w_pad, v_out.shape[1])):
            r[...] = a

    col0 = (j * v_tile).astype(jnp.float32)
    x = _tile_logits(x_ref[...], col0, vocab, v_pad)
    m, s = _online_lse(m_ref[...][:, :1], l_ref[...][:, :1], x)
    m_ref[...] = jnp.broadcast_to(m, m_ref.shape)
    l_ref[...] = jnp.broadcast_to(s, l_ref.shape)
    aux = a_ref[...].astype(jnp.float32) if mode == "candidates" else a_ref[...]
    acc = _update(tuple(r[...] for r in acc_refs), x, aux, col0, mode=mode, k=k, n_slots=n_slots)
    for r, a in zip(acc_refs, acc):
        r[...] = a

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        cand = a_ref[...].astype(jnp.float32) if mode == "candidates" else None
        out_v, out_s = _finish(acc, _lse(m, s), cand, mode=mode, k=k, k_pad=v_out.shape[1])
        v_out[...] = out_v
        s_out[...] = out_s.astype(jnp.int32)


def _gpu_kernel(x_ref, a_ref, v_out, s_out, *, mode, k, n_slots, vocab, v_pad, v_tile, n_tiles):
    """One program per row block, a loop over the V tiles that hold real columns."""
    bm = x_ref.shape[0]
    k_pad = v_out.shape[1]
    cand = a_ref[...].astype(jnp.float32) if mode == "candidates" else None

    def tile(j, carry):
        m, s, acc = carry
        start = pl.multiple_of(j * v_tile, v_tile)
        col0 = (j * v_tile).astype(jnp.float32)
        x = _tile_logits(x_ref[:, pl.ds(start, v_tile)], col0, vocab, v_pad)
        m, s = _online_lse(m, s, x)
        aux = cand if mode == "candidates" else a_ref[:, pl.ds(start, v_tile)]
        return m, s, _update(acc, x, aux, col0, mode=mode, k=k, n_slots=n_slots)

    init = (jnp.full((bm, 1), _NEG, jnp.float32), jnp.zeros((bm, 1), jnp.float32),
            _init_acc(mode, bm, cand.shape[1] if cand is not None else 0, k_pad))
    m, s, acc = lax.fori_loop(0, n_tiles, tile, init)
    out_v, out_s = _finish(acc, _lse(m, s), cand, mode=mode, k=k, k_pad=k_pad)
    v_out[...] = out_v
    s_out[...] = out_s.astype(jnp.int32)


# ----------------------------------------------------------------------------- block plan
TPU_VMEM_BUDGET = 24 << 20  # working set the TPU plan aims for (bytes)
TPU_VMEM_MAX = 48 << 20  # the most vmem_limit_bytes it sets (v7x: 64 MiB of VMEM per core)
TPU_MAX_TILE = 8192
GPU_REGISTER_FLOATS = 1 << 14  # logits per program and tile (block_rows x v_tile)
GPU_MAX_TILE = 4096


def _tpu_vmem_bytes(bm, tv, w_pad, k_pad, mode, logit_bytes) -> int:
    """Estimated VMEM working set of one grid step: double-buffered input and output blocks, scratch,
    and the f32 temporaries of a tile (iotas, the f32 tile, compare / select results)."""
    aux = 2 * bm * (tv * 1 if mode == "mask" else w_pad * 4)
    inputs = 2 * bm * tv * logit_bytes + aux
    outputs = 2 * 2 * bm * k_pad * 4
    scratch = 2 * bm * 128 * 4 + (bm * w_pad * 4 if mode == "candidates" else 2 * bm * k_pad * 4)
    temps = 8 * bm * (tv + max(w_pad, k_pad)) * 4
    return inputs + outputs + scratch + temps


def block_plan(variant: str, rows: int, vocab: int, width: int, k: int, mode: str,
               block_rows: int | None = None, v_tile: int | None = None, logit_bytes: int = 4) -> dict:
    """Static sizes of a call: block_rows, rows_pad, v_pad, v_tile, n_tiles, w_pad (candidate slots),
    k_pad; for "tpu" also vmem_bytes (the estimated working set) and vmem_limit_bytes (what the call
    sets). See the module docstring for the rules."""
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS}, got {variant!r}")
    for name, value in (("block_rows", block_rows), ("v_tile", v_tile)):
        if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
                                  or value <= 0):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    if variant == "tpu":
        sub = 32 if mode == "mask" else 8  # int8 mask tiles are (32, 128)
        if block_rows is None:
            block_rows = sub
        elif block_rows % sub:
            raise ValueError(f"TPU block_rows must be a multiple of {sub} here, got {block_rows}")
        k_pad = round_up(k, 128)
        w_pad = round_up(width, 128) if mode == "candidates" else 0
        if v_tile is None:
            v_tile = min(round_up(vocab, 128), TPU_MAX_TILE)
            while v_tile > 128 and _tpu_vmem_bytes(block_rows, v_tile, w_pad, k_pad, mode,
                                                   logit_bytes) > TPU_VMEM_BUDGET:
                v_tile = round_up(v_tile // 2, 128)
        elif v_tile % 128:
            raise ValueError(f"TPU v_tile must be a multiple of 128, got {v_tile}")
        v_pad = round_up(vocab, v_tile)
        need = _tpu_vmem_bytes(block_rows, v_tile, w_pad, k_pad, mode, logit_bytes)
        limit = max(16 << 20, round_up(need * 5 // 4, 1 << 20))
        if limit > TPU_VMEM_MAX:
            raise ValueError(f"the constrained top-k needs ~{need >> 20} MiB of VMEM per step (block_rows="
                             f"{block_rows}, v_tile={v_tile}, {width} candidate slots, k={k}), more than "
                             f"{TPU_VMEM_MAX >> 20} MiB; lower k, the candidate width or v_tile")
        return dict(block_rows=block_rows, rows_pad=round_up(rows, block_rows), v_pad=v_pad, v_tile=v_tile,
                    n_tiles=v_pad // v_tile, w_pad=w_pad if mode == "candidates" else v_pad, k_pad=k_pad,
                    vmem_bytes=need, vmem_limit_bytes=limit)
    v_pow = next_pow2(vocab)
    if v_tile is None:
        v_tile = min(v_pow, GPU_MAX_TILE)
    elif v_tile & (v_tile - 1):
        raise ValueError(f"GPU v_tile must be a power of two, got {v_tile}")
    if block_rows is None:
        block_rows = max(1, min(16, GPU_REGISTER_FLOATS // v_tile))
    elif block_rows & (block_rows - 1):
        raise ValueError(f"GPU block_rows must be a power of two, got {block_rows}")
    v_pad = max(v_pow, v_tile)
    return dict(block_rows=block_rows, rows_pad=round_up(rows, block_rows), v_pad=v_pad, v_tile=v_tile,
                n_tiles=-(-vocab // v_tile), w_pad=next_pow2(width) if mode == "candidates" else v_pad,
                k_pad=next_pow2(k))


def _compiler_params(variant: str, plan: dict):
    """Compiler parameters across JAX versions (CompilerParams; TPUCompilerParams / TritonCompilerParams
    in older releases)."""
    if variant == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
        return cls(dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=plan["vmem_limit_bytes"])
    from jax.experimental.pallas import triton as plgpu
    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return cls(num_warps=4, num_stages=1)


# ----------------------------------------------------------------------------- kernel wrapper
@functools.partial(jax.jit, static_argnames=("k", "mode", "variant", "block_rows", "v_tile", "interpret"))
def _pallas_call(logits, aux, *, k, mode, variant, block_rows, v_tile, interpret):
    r, v = logits.shape
    width = aux.shape[1]
    plan = block_plan(variant, r, v, width, k, mode, block_rows, v_tile, jnp.dtype(logits.dtype).itemsize)
    bm, r_pad, v_pad, tv, w_pad, k_pad = (plan[n] for n in ("block_rows", "rows_pad", "v_pad", "v_tile", "w_pad",
                                                             "k_pad"))
    x = jnp.pad(logits, ((0, r_pad - r), (0, v_pad - v)))  # padded columns are masked in the kernel
    if mode == "candidates":
        aux = jnp.pad(aux.astype(jnp.int32), ((0, r_pad - r), (0, w_pad - width)), constant_values=-1)
        aux = jnp.where(aux < v, aux, -1)  # ids past the vocabulary are no candidates
    else:
        aux = jnp.pad(aux.astype(jnp.int8), ((0, r_pad - r), (0, w_pad - width)))
    out_shape = [jax.ShapeDtypeStruct((r_pad, k_pad), jnp.float32), jax.ShapeDtypeStruct((r_pad, k_pad), jnp.int32)]
    common = dict(mode=mode, k=k, n_slots=width, vocab=v, v_pad=v_pad, v_tile=tv)
    if variant == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        aux_block = (bm, w_pad) if mode == "candidates" else (bm, tv)
        aux_map = (lambda i, j: (i, 0)) if mode == "candidates" else (lambda i, j: (i, j))
        acc = ([pltpu.VMEM((bm, w_pad), jnp.float32)] if mode == "candidates"
               else [pltpu.VMEM((bm, k_pad), jnp.float32), pltpu.VMEM((bm, k_pad), jnp.float32)])
        vals, slots = pl.pallas_call(
            functools.partial(_tpu_kernel, **common),
            out_shape=out_shape,
            grid=(r_pad // bm, plan["n_tiles"]),
            in_specs=[pl.BlockSpec((bm, tv), lambda i, j: (i, j)), pl.BlockSpec(aux_block, aux_map)],
            out_specs=[pl.BlockSpec((bm, k_pad), lambda i, j: (i, 0))] * 2,
            scratch_shapes=[pltpu.VMEM((bm, 128), jnp.float32), pltpu.VMEM((bm, 128), jnp.float32)] + acc,
            compiler_params=_compiler_params(variant, plan),
            interpret=interpret,
            name="constrained_topk_tpu",
        )(x, aux)
    else:
        rows = lambda i: (i, 0)  # noqa: E731
        vals, slots = pl.pallas_call(
            functools.partial(_gpu_kernel, n_tiles=plan["n_tiles"], **common),
            out_shape=out_shape,
            grid=(r_pad // bm,),
            in_specs=[pl.BlockSpec((bm, v_pad), rows), pl.BlockSpec((bm, w_pad), rows)],
            out_specs=[pl.BlockSpec((bm, k_pad), rows)] * 2,
            compiler_params=_compiler_params(variant, plan),
            interpret=interpret,
            name="constrained_topk_gpu",
        )(x, aux)
    return vals[:r, :k], slots[:r, :k]


def _default_variant() -> str:
    return "gpu" if jax.default_backend() == "gpu" else "tpu"


def constrained_topk_pallas(logits, k: int, *, candidates=None, mask=None, interpret=False, variant=None,
                            block_rows=None, v_tile=None):
    """The Pallas kernel. `variant` "tpu" | "gpu" (default: by backend; "tpu" on CPU) picks the lowering;
    `interpret=True` runs it in Pallas interpret mode (any backend); block_rows / v_tile override the
    block plan (tests force small tiles)."""
    _check(logits, k, candidates, mask)
    variant = variant or _default_variant()
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS} or None, got {variant!r}")
    mode = "candidates" if candidates is not None else "mask"
    return _pallas_call(logits, candidates if candidates is not None else mask, k=int(k), mode=mode,
                        variant=variant, block_rows=block_rows, v_tile=v_tile, interpret=bool(interpret))


# ----------------------------------------------------------------------------- public ops
def resolve_impl(impl: str) -> str:
    """'auto' -> 'pallas' on TPU, 'reference' on GPU and CPU; checks the name and the backend.

    GPU: the Triton lowering runs one program per row block, sweeping the whole vocabulary alone, so at
    V = 32k it took 250-380 us on an H200 against XLA's reference in under 80 us (BENCHMARKS.md, 'The
    Pallas kernels on a GPU'); a vocabulary split across programs would be needed to win there.
    impl='pallas' still runs it."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "tpu" else "reference"
    if impl == "pallas" and jax.default_backend() not in ("gpu", "tpu"):
        raise ValueError(f"impl='pallas' compiles the kernel for a GPU or TPU, but the default backend is "
                         f"{jax.default_backend()!r}: use impl='interpret' (or 'reference', or 'auto')")
    return impl


def constrained_topk(logits, k: int, *, candidates=None, mask=None, impl: str = "auto"):
    """Top-k allowed tokens per row by log-probability. See the module docstring.

    impl: "auto" (the kernel on tpu, the reference on gpu and cpu: see `resolve_impl`), "pallas", "interpret" (the kernel in
    Pallas interpret mode, for tests), "reference".
    """
    impl = resolve_impl(impl)
    if impl == "reference":
        return constrained_topk_reference(logits, k, candidates=candidates, mask=mask)
    return constrained_topk_pallas(logits, k, candidates=candidates, mask=mask, interpret=impl == "interpret")


def row_axis(mesh, rows: int):
    """The mesh axis rows shard over: "data" when the mesh has it and it divides them, else None
    (replicated: a model-only mesh)."""
    return "data" if "data" in mesh.shape and rows % mesh.shape["data"] == 0 else None


def sharded_constrained_topk(mesh, logits, k: int, *, candidates=None, mask=None, impl: str = "auto"):
    """`constrained_topk` under shard_map: rows over mesh axis "data" (replicated when it does not divide
    them), replicated over any other axis; each device runs the op on its local rows."""
    from jax.sharding import PartitionSpec as P

    r = _check(logits, k, candidates, mask)[0]
    impl = resolve_impl(impl)
    ax = row_axis(mesh, r)
    aux = candidates if candidates is not None else mask
    key = "candidates" if candidates is not None else "mask"

    def local(x, a):
        return constrained_topk(x, k, impl=impl, **{key: a})

    spec = P(ax, None)
    return shard_map(local, mesh, (spec, spec), (spec, spec))(logits, aux)


__all__ = ["block_plan", "constrained_topk", "constrained_topk_pallas", "constrained_topk_reference",
           "resolve_impl", "row_axis", "sharded_constrained_topk"]
