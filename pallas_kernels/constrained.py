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

Kernel design (`impl="pallas"`), the same math for both lowerings: grid over blocks of `block_rows`
rows; per block
  1. lse = max + log(sum(exp(x - max))) over the padded row (padding columns are -inf);
  2. candidates: a loop over the C candidate slots, each a compare-select-max over the row (slot j's
     token is extracted by a masked max, so no vector gather is needed: neither Mosaic nor Triton has a
     general in-register gather); mask: `where(mask, x - lse, -inf)` over the row;
  3. top-k: k rounds of (max, lowest index attaining it, knock it out).
Step 2 costs C x V per row, so it suits the narrow CSR levels; wide levels are dense in the index
(`jaxdecode.constraints.index`) and use the mask form, whose cost is k x V. Token ids and slot indices
are carried as float32 inside the kernel (exact below 2**24), because float lane reductions are the
ones both backends lower everywhere.
  * "tpu" (Mosaic): blocks obey the (8, 128) rule: block_rows a multiple of 8 (32 for the int8 mask),
    V, C and k padded to multiples of 128; grid axis "parallel".
  * "gpu" (Triton): every block dimension a power of two; block_rows chosen so a block of logits stays
    within ~16 K float registers per program.
The CSR rows themselves (contiguous int16 slices of the trie) are gathered by XLA before the call:
a per-row DMA of a few dozen ids costs more than one batched gather.

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
def _row_lse(x):
    """x: f32 [bm, Vp] (padding -inf) -> [bm, 1] log-sum-exp; rows of all -inf give -inf."""
    m = jnp.max(x, axis=1)[:, None]
    m_safe = jnp.where(m > _NEG, m, 0.0)
    return m_safe + jnp.log(jnp.sum(jnp.exp(x - m_safe), axis=1)[:, None])


def _gather_candidates(x, lse, cand, n_slots):
    """vals[r, j] = x[r, cand[r, j]] - lse[r] (-inf for no candidate). cand: f32 [bm, Cp] ids (-1 none)."""
    bm, vp = x.shape
    cp = cand.shape[1]
    col_v = lax.broadcasted_iota(jnp.int32, (bm, vp), 1).astype(jnp.float32)
    col_c = lax.broadcasted_iota(jnp.int32, (bm, cp), 1).astype(jnp.float32)

    def body(j, vals):
        jf = j.astype(jnp.float32)
        tok = jnp.max(jnp.where(col_c == jf, cand, -1.0), axis=1)[:, None]  # [bm, 1]
        got = jnp.max(jnp.where(col_v == tok, x, _NEG), axis=1)[:, None]  # -inf when tok == -1
        return jnp.where(col_c == jf, got, vals)

    vals = lax.fori_loop(0, n_slots, body, jnp.full((bm, cp), _NEG, jnp.float32))
    return jnp.where(cand >= 0, vals - lse, _NEG)


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


def _kernel(x_ref, c_ref, v_out, s_out, *, mode, k, n_slots, vocab):
    x = x_ref[...].astype(jnp.float32)  # [bm, Vp]
    bm, vp = x.shape
    if vp != vocab:  # padding columns are not tokens
        x = jnp.where(lax.broadcasted_iota(jnp.int32, (bm, vp), 1) < vocab, x, _NEG)
    lse = _row_lse(x)
    if mode == "candidates":
        cand = c_ref[...].astype(jnp.float32)
        vals = _gather_candidates(x, lse, cand, n_slots)
    else:
        vals = jnp.where(c_ref[...].astype(jnp.int32) != 0, x - lse, _NEG)  # int8 mask: widen before comparing
    out_v, out_s = _topk_rounds(vals, k, v_out.shape[1])
    v_out[...] = out_v
    s_out[...] = out_s.astype(jnp.int32)


# ----------------------------------------------------------------------------- block plan
def block_plan(variant: str, rows: int, vocab: int, width: int, k: int, mode: str,
               block_rows: int | None = None) -> dict:
    """Static padded sizes of a call: block_rows, rows_pad, v_pad, w_pad (candidate slots), k_pad."""
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS}, got {variant!r}")
    if block_rows is not None and (not isinstance(block_rows, (int, np.integer)) or block_rows <= 0):
        raise ValueError(f"block_rows must be a positive int or None, got {block_rows!r}")
    if variant == "tpu":
        sub = 32 if mode == "mask" else 8  # int8 mask tiles are (32, 128)
        if block_rows is None:
            block_rows = sub
        elif block_rows % sub:
            raise ValueError(f"TPU block_rows must be a multiple of {sub} here, got {block_rows}")
        v_pad = round_up(vocab, 128)
        w_pad = v_pad if mode == "mask" else round_up(width, 128)
        return dict(block_rows=block_rows, rows_pad=round_up(rows, block_rows), v_pad=v_pad, w_pad=w_pad,
                    k_pad=round_up(k, 128))
    v_pad = next_pow2(vocab)
    if block_rows is None:  # ~16 K floats of logits per program
        block_rows = max(1, min(16, (1 << 14) // v_pad))
    elif block_rows & (block_rows - 1):
        raise ValueError(f"GPU block_rows must be a power of two, got {block_rows}")
    w_pad = v_pad if mode == "mask" else next_pow2(width)
    return dict(block_rows=block_rows, rows_pad=round_up(rows, block_rows), v_pad=v_pad, w_pad=w_pad,
                k_pad=next_pow2(k))


# ----------------------------------------------------------------------------- kernel wrapper
@functools.partial(jax.jit, static_argnames=("k", "mode", "variant", "block_rows", "interpret"))
def _pallas_call(logits, aux, *, k, mode, variant, block_rows, interpret):
    r, v = logits.shape
    width = aux.shape[1]
    plan = block_plan(variant, r, v, width, k, mode, block_rows)
    bm, r_pad, v_pad, w_pad, k_pad = (plan[n] for n in ("block_rows", "rows_pad", "v_pad", "w_pad", "k_pad"))
    x = jnp.pad(logits, ((0, r_pad - r), (0, v_pad - v)))  # padded columns are masked in the kernel
    if mode == "candidates":
        aux = jnp.pad(aux.astype(jnp.int32), ((0, r_pad - r), (0, w_pad - width)), constant_values=-1)
        aux = jnp.where(aux < v, aux, -1)  # ids past the vocabulary are no candidates
    else:
        aux = jnp.pad(aux.astype(jnp.int8), ((0, r_pad - r), (0, w_pad - width)))
    kernel = functools.partial(_kernel, mode=mode, k=k, n_slots=width, vocab=v)
    rows = lambda i: (i, 0)  # noqa: E731
    in_specs = [pl.BlockSpec((bm, v_pad), rows), pl.BlockSpec((bm, w_pad), rows)]
    out_specs = [pl.BlockSpec((bm, k_pad), rows), pl.BlockSpec((bm, k_pad), rows)]
    if variant == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        params = pltpu.CompilerParams(dimension_semantics=("parallel",))
    else:
        from jax.experimental.pallas import triton as plgpu
        params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    vals, slots = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((r_pad, k_pad), jnp.float32),
                   jax.ShapeDtypeStruct((r_pad, k_pad), jnp.int32)],
        grid=(r_pad // bm,),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=params,
        interpret=interpret,
        name=f"constrained_topk_{variant}",
    )(x, aux)
    return vals[:r, :k], slots[:r, :k]


def _default_variant() -> str:
    return "gpu" if jax.default_backend() == "gpu" else "tpu"


def constrained_topk_pallas(logits, k: int, *, candidates=None, mask=None, interpret=False, variant=None,
                            block_rows=None):
    """The Pallas kernel. `variant` "tpu" | "gpu" (default: by backend; "tpu" on CPU) picks the lowering;
    `interpret=True` runs it in Pallas interpret mode (any backend)."""
    _check(logits, k, candidates, mask)
    variant = variant or _default_variant()
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS} or None, got {variant!r}")
    mode = "candidates" if candidates is not None else "mask"
    return _pallas_call(logits, candidates if candidates is not None else mask, k=int(k), mode=mode,
                        variant=variant, block_rows=block_rows, interpret=bool(interpret))


# ----------------------------------------------------------------------------- public ops
def resolve_impl(impl: str) -> str:
    """'auto' -> 'pallas' on GPU/TPU, 'reference' on CPU; checks the name and the backend."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "tpu") else "reference"
    if impl == "pallas" and jax.default_backend() not in ("gpu", "tpu"):
        raise ValueError(f"impl='pallas' compiles the kernel for a GPU or TPU, but the default backend is "
                         f"{jax.default_backend()!r}: use impl='interpret' (or 'reference', or 'auto')")
    return impl


def constrained_topk(logits, k: int, *, candidates=None, mask=None, impl: str = "auto"):
    """Top-k allowed tokens per row by log-probability. See the module docstring.

    impl: "auto" (the kernel on gpu/tpu, the reference on cpu), "pallas", "interpret" (the kernel in
    Pallas interpret mode, for tests), "reference".
    """
    impl = resolve_impl(impl)
    if impl == "reference":
        return constrained_topk_reference(logits, k, candidates=candidates, mask=mask)
    return constrained_topk_pallas(logits, k, candidates=candidates, mask=mask, interpret=impl == "interpret")


def row_axis(mesh, rows: int):
    """The mesh axis rows shard over: "data" when it divides them, else None (replicated)."""
    if "data" not in mesh.shape:
        raise ValueError(f"the mesh needs an axis 'data' for the rows (axes: {tuple(mesh.shape)})")
    return "data" if rows % mesh.shape["data"] == 0 else None


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
