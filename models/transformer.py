"""The model contract: one pure forward for every supported architecture.

    forward(config, params, tokens[B,T], positions[B,T], cache, attn_mask[B,T,T])
        -> (logits[B,T,V] f32, hidden, cache')

`attn_mask[b, i, j]` says whether new token i sees new token j (causal for prefill/decode, an
ancestor mask for token trees, all-ones for a bidirectional diffusion LM). With a cache, every new
token also sees the row's committed prefix (slots < cache.lengths[b]). Without a cache (training)
the new tokens see only each other. Padding tokens are simply tokens nobody attends to.

Layers are stacked along a leading axis and run under `lax.scan`, so compile time does not grow with
depth. On the CPU the decoders pass them split into one array per layer (`split_layers`), which the
forward unrolls: XLA:CPU would copy each layer's weights out of the stack on every step. `stop_at_layer` / `skip_layers` select a sub-network statically (self-speculation) without a
second copy of the weights; `return_layers` exposes chosen layers' hidden states (feature drafters).

A forward costs what the rows occupy, not the cache's capacity S: the whole cache rides in the layer
scan's carry, each layer writes only its T new entries into it (`cache.write_layer`, in place inside
the decoders' jitted loops) and reads it where it lies, and attention over the cache is the
tree-attention op (jaxdecode.kernels.tree_attention: one semantics, its Pallas kernel on GPU/TPU and
its blockwise jnp form, a loop over the occupied prefix blocks, elsewhere). With a `mesh` the op runs
under shard_map on each device's rows and KV heads. Without a cache the T tokens attend densely
(`attention`, the same masking rule).

Parameter pytree (L = layers, D = hidden, H/KV = heads, hd = head dim, F = MLP width):
    embed [V, D]; pos_embed [P, D] (GPT-2); lm_head [D, V] (untied only)
    final_norm {scale [D], bias [D] (GPT-2)}
    layers: attn_norm/mlp_norm {scale [L, D], bias} (none in OLMo 2; no mlp_norm in Cohere's parallel blocks),
            q_norm/k_norm {scale [L, hd]} (Qwen3, Gemma 3; OLMo 2's norms over all heads and Cohere's scales per
            head: [L, H, hd] / [L, KV, hd]),
            attn_out_norm/mlp_out_norm {scale [L, D]} (Gemma 3's and OLMo 2's norms on the attention and MLP
            outputs),
            wq [L, D, H, hd], wk/wv [L, D, KV, hd],
            wo [L, H, hd, D], bq [L, H, hd], bk/bv [L, KV, hd], bo [L, D],
            w_gate/w_up [L, D, F], w_down [L, F, D], b_gate/b_up [L, F], b_down [L, D]
            (mixture of experts, E experts of width Fm, in place of w_gate/w_up/w_down: w_router [L, D, E],
            we_gate/we_up [L, E, D, Fm], we_down [L, E, Fm, D]; Qwen2-MoE's shared expert of width Fs beside
            them: ws_gate/ws_up [L, D, Fs], ws_down [L, Fs, D], its sigmoid gate w_shared_gate [L, D, 1] (none in
            Granite-MoE-shared's))
"""
from __future__ import annotations

import math
import weakref
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .cache import KVCache, write_layer
from .config import (ModelConfig, rope_attention_factor, rope_attention_factors, rope_inv_freq, rope_inv_freqs,
                     rope_long_attention_factor, rope_long_inv_freq, rope_switch_position)

_MASKED = -1e30  # finite, so a fully masked (padding) query gives a uniform softmax, never NaN


# ----------------------------------------------------------------------------- building blocks
def rms_norm(x, p, eps, plus_one: bool = False, scale_f32: bool = False, axes=(-1,), center: bool = False):
    """RMSNorm over the trailing `axes` (p["scale"] spans them). plus_one (Gemma): scaled by 1 + scale in
    float32 before the cast back, as Gemma's reference does; scale_f32 (OLMo 2): scaled in float32, then cast
    back; otherwise cast back, then scaled (Llama's order). center (Cohere): the mean subtracted first, so a
    LayerNorm without bias."""
    x32 = x.astype(jnp.float32)
    if center:
        x32 = x32 - jnp.mean(x32, axis=axes, keepdims=True)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axes, keepdims=True) + eps)
    if plus_one:
        return (y * (1.0 + p["scale"].astype(jnp.float32))).astype(x.dtype)
    if scale_f32:
        return (y * p["scale"].astype(jnp.float32)).astype(x.dtype)
    return y.astype(x.dtype) * p["scale"]


def layer_norm(x, p, eps):
    x32 = x.astype(jnp.float32)
    mu = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mu), axis=-1, keepdims=True)
    y = (x32 - mu) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def _norm(config: ModelConfig, x, p, axes=(-1,)):
    if config.is_gpt2 or config.layer_norm:
        return layer_norm(x, p, config.norm_eps)
    return rms_norm(x, p, config.norm_eps, config.norm_plus_one, config.norm_scale_f32, axes, config.norm_center)


def gelu_new(x):
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * jnp.power(x, 3))))


def apply_rope(x, positions, inv_freq, factor: float = 1.0):
    """Rotate-half RoPE (the HF layout), cos and sin times `factor` (YaRN's attention factor), over the first
    2 * len(inv_freq) dims of each head; the others pass unrotated (a partial rotary factor, as transformers).
    x: [B, T, N, hd]; positions: [B, T]; inv_freq: [r/2], or [B, r/2] (a set per row: LongRoPE's)."""
    if inv_freq.ndim == 2:
        inv_freq = inv_freq[:, None, :]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, r/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    if not (isinstance(factor, float) and factor == 1.0):  # a float, or a traced per-layer scalar
        cos, sin = cos * factor, sin * factor
    rot = 2 * angles.shape[-1]
    x32 = x[..., :rot].astype(jnp.float32)
    half = rot // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return out if rot == x.shape[-1] else jnp.concatenate([out, x[..., rot:]], axis=-1)


_GATED_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": partial(jax.nn.gelu, approximate=True),
                      "gelu": partial(jax.nn.gelu, approximate=False)}


def attention(q, k, v, visible, scale: float | None = None, softcap: float | None = None):
    """Grouped-query attention of T queries over S keys, scores scaled by `scale` (default 1/sqrt(hd))
    and, with a softcap c, soft-capped to c * tanh(score / c).

    q: [B, T, H, hd]; k, v: [B, KV, S, hd]; visible: bool[B, T, S]. Returns [B, T, H, hd].
    """
    b, t, h, hd = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, t, kv, h // kv, hd)
    # scores: [B, KV, G, T, S]
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(hd) if scale is None else scale)
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(visible[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    # Output with the batch dims leading ([B, KV, G, T, hd]): XLA:CPU has no bf16 dot for the
    # transposed layout, and the transpose after the dot is free elsewhere.
    out = jnp.einsum("bkgts,bksd->bkgtd", probs, v, preferred_element_type=jnp.float32)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, hd).astype(q.dtype)


def _window_mask(visible, q_pos, key_pos, window):
    """Restrict visibility to keys within the sliding window (window 0 = full attention)."""
    in_window = (q_pos[:, :, None] - key_pos[:, None, :]) < window
    return jnp.where(window > 0, visible & in_window, visible)


def window_key_positions(positions, lengths, width: int, write_offset=None, key_positions=None):
    """Positions of the keys in the W = width window slots lengths[b] .. lengths[b]+W-1: int32[B, W].

    The T new tokens sit at window columns write_offset[b] .. +T-1 (positions from `positions`); the
    other columns hold tokens of an earlier, uncommitted forward (a draft tree grown level by level),
    at `key_positions` [B, W] if given, else at their slot index (only a sliding window reads them)."""
    b, t = positions.shape
    offset = jnp.zeros((b,), jnp.int32) if write_offset is None else write_offset.astype(jnp.int32)
    cols = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, W]
    new_col = cols - offset[:, None]
    new_pos = jnp.take_along_axis(positions.astype(jnp.int32), jnp.clip(new_col, 0, t - 1), axis=1)
    other = lengths[:, None] + cols if key_positions is None else key_positions.astype(jnp.int32)
    return jnp.where((new_col >= 0) & (new_col < t), new_pos, other).astype(jnp.int32)


def compute_dtype(params):
    """The dtype a model's forward computes in: its 1-D parameters' (norm scales), which
    `load(param_dtype=...)` leaves in the compute dtype while it stores the matrices narrower."""
    return jax.tree.leaves(params["final_norm"])[0].dtype


# XLA:CPU multiplies half-precision operands of fewer rows than this on another path than wider
# products: the rows of a one- or two-row product differ in their last bits from the same rows inside
# a product of 3 or more, while every product of 3+ rows gives each row the same bits.
HALF_MIN_ROWS = 3


def _is_half(dtype) -> bool:
    """bfloat16 or float16."""
    return jnp.dtype(dtype).itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)


def matmul(equation: str, x, w, out_dtype=None):
    """einsum(equation, x, w) in `out_dtype` (default x's dtype), w in its own dtype, the products
    accumulated in float32. With matching dtypes this is the plain einsum.

    With weights stored narrower than the activations (`jaxdecode.load(param_dtype="bfloat16")`) the
    product runs as a half-precision dot (fast on CPUs with AVX512-BF16 / AMX; einsum's type promotion
    would widen the whole weight matrix to float32 on every call) and reads half the bytes, and x is
    not rounded: it is split into x_hi = half(x) and x_lo = half(x - x_hi), both multiplied in ONE dot
    (their rows stacked: the weights are read once) and summed, so x keeps ~16 bits of mantissa. Rounded
    to 8 bits instead, a last-bit difference between two ways of computing the same activations (a
    decode step and a verification forward) flipped a bf16 rounding and moved log-probs by ~3e-4
    (median; 7e-7 in float32), enough to change a greedy token near a tie (1 of 16 held-out rows);
    split, they move by 7e-7 as in float32 (BENCHMARKS.md, "weight-only bf16: exact greedy").

    `equation` is "x_spec,w_spec->out_spec". On the CPU a half-precision product of fewer than
    HALF_MIN_ROWS rows is padded to that many: XLA:CPU has no fast one-row bf16 dot, so it widened the
    whole weight matrix to float32 for it (hoisted out of a decode loop: 20 ms a call for the embedded
    target; inside a branch: on every step), and those rows differ in their last bits from the same
    rows in a wider product."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    x_spec, rest = equation.split(",")
    w_spec, out_spec = rest.split("->")
    free = [i for i, c in enumerate(x_spec) if c not in w_spec]  # x's row axes
    rows = math.prod(x.shape[i] for i in free)
    if not (_is_half(w.dtype) and free and rows > 0):
        return jnp.einsum(equation, x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(out_dtype)
    axis = free[-1]  # rows are stacked and padded along x's last row axis
    n = x.shape[axis]
    parts = [x.astype(w.dtype)]
    keep_low_bits = jnp.dtype(x.dtype).itemsize > 2  # wider activations: x_lo as well
    if keep_low_bits:
        parts.append((x - parts[0].astype(x.dtype)).astype(w.dtype))
    stacked = n * len(parts)
    if jax.default_backend() == "cpu":
        stacked = max(stacked, -(-HALF_MIN_ROWS // (rows // n)))
    if stacked > n * len(parts):
        parts.append(jnp.zeros(x.shape[:axis] + (stacked - n * len(parts),) + x.shape[axis + 1:], w.dtype))
    y = jnp.einsum(equation, jnp.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0], w,
                   preferred_element_type=jnp.float32)
    out_axis = out_spec.index(x_spec[axis])
    total = jax.lax.slice_in_dim(y, 0, n, axis=out_axis)
    if keep_low_bits:
        total = total + jax.lax.slice_in_dim(y, n, 2 * n, axis=out_axis)
    return total.astype(out_dtype)


def lm_logits(h, embed, lm_head=None):
    """Float32 logits [..., V] of final-normed states h [..., D]: lm_head [D, V], or None when the head
    is tied to embed [V, D]. Through `matmul`: half-precision head weights are read as they are (an
    einsum would widen the whole matrix to float32 on every call). A tied head is contracted over
    embed's own last axis, not through embed.T: XLA:CPU widens a transposed bf16 operand to float32."""
    lead = "abcefghijk"[:h.ndim - 1]  # h's leading axes, kept as they are (no reshape of sharded axes)
    if lm_head is None:
        return matmul(f"{lead}d,vd->{lead}v", h, embed, out_dtype=jnp.float32)
    return matmul(f"{lead}d,dv->{lead}v", h, lm_head, out_dtype=jnp.float32)


def output_logits(config: ModelConfig, params, h):
    """A model's float32 logits [..., V] of its final-normed states h [..., D] (its LM head, or its
    embedding when the head is tied), plus the head's bias (Phi-3.5-MoE), times logit_scale (Cohere), divided
    by logits_scaling (Granite) and soft-capped where the model does (Gemma 2)."""
    logits = lm_logits(h, params["embed"], None if config.tie_word_embeddings else params["lm_head"])
    return finish_logits(logits, *logits_finish(config), bias=head_bias(config, params))


def logits_finish(config: ModelConfig) -> tuple:
    """(logits_scaling, final_logit_softcapping, logit_scale): what a model does to its head's logits
    (finish_logits). Drafters that read the target's head keep it, so their drafts follow the target's
    distribution."""
    return float(config.logits_scaling), config.final_logit_softcapping, float(config.logit_scale)


def head_bias(config: ModelConfig, params):
    """The LM head's bias [V] (Phi-3.5-MoE's lm_head_bias), None where the head has none: finish_logits' `bias`.
    Drafters that read the target's head keep it beside logits_finish (an array, so not in that static tuple)."""
    return params["lm_head_bias"] if config.lm_head_bias else None


def finish_logits(logits, scaling: float = 1.0, softcap: float | None = None, multiplier: float = 1.0, bias=None):
    """Head logits as the model emits them: plus the head's `bias` [V] (Phi-3.5-MoE, before any scaling, as
    its lm_head adds it), times `multiplier` (Cohere's logit_scale), divided by `scaling` (Granite), then
    soft-capped (Gemma 2)."""
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if multiplier != 1.0:
        logits = logits * multiplier
    if scaling != 1.0:
        logits = logits / scaling
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def times_float(x, factor: float):
    """x * factor as transformers multiplies a tensor by a Python float (Granite's multipliers): in float32,
    one rounding back to x's dtype (not factor rounded to x's dtype first, as jnp would for bf16)."""
    return (x.astype(jnp.float32) * factor).astype(x.dtype)


def embed_rows(table, ids, dtype, words=None):
    """table[ids] in `dtype`. A half-precision table is gathered as raw 16-bit words and widened after
    the gather: gathered as bf16, XLA:CPU widens the whole table to float32 first (a 4096 x 384 copy
    on every call, or on every step inside a branch). words: the table's words already viewed as
    uint16 (`with_embed_words`), else they are viewed here."""
    if _is_half(table.dtype) and jnp.dtype(dtype) != table.dtype:
        words = jax.lax.bitcast_convert_type(table, jnp.uint16) if words is None else words
        return jax.lax.bitcast_convert_type(jnp.take(words, ids, axis=0), table.dtype).astype(dtype)
    return jnp.take(table, ids, axis=0).astype(dtype)


def with_embed_words(params):
    """params with "embed_words", the uint16 view of a half-precision embedding table that `forward`
    widens after gathering (embed_rows), made once; params unchanged otherwise. For loops that nest a
    forward inside branches (the speculative engine): XLA hoisted the view out of the innermost loop
    into the engine's step, where it copied the whole table (3 MB for the embedded target) on every
    step; made before the loops, it is copied once per call."""
    embed = params["embed"]
    if not _is_half(embed.dtype) or compute_dtype(params) == embed.dtype or "embed_words" in params:
        return params
    return {**params, "embed_words": jax.lax.bitcast_convert_type(embed, jnp.uint16)}


# ----------------------------------------------------------------------------- the layer
def _layer(config: ModelConfig, x, lp, q_pos, inv_freq, attend, rope_factor=None):
    """One transformer block. x: [B, T, D]. attend(q [B,T,H,hd], k, v [B,T,KV,hd]) -> (a [B,T,H,hd], aux):
    the attention of this layer (with or without a cache); aux is returned as it is. rope_factor: this
    layer's factor on RoPE's cos and sin (default: the config's, rope_attention_factor)."""
    h = x if config.post_norms else _norm(config, x, lp["attn_norm"])
    q = matmul("btd,dnh->btnh", h, lp["wq"])  # [B, T, H, hd]
    k = matmul("btd,dnh->btnh", h, lp["wk"])  # [B, T, KV, hd]
    v = matmul("btd,dnh->btnh", h, lp["wv"])
    if config.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    if config.qk_norm:  # Qwen3, Gemma 3: each head's query and key RMS-normed over head_dim, before RoPE (Cohere:
        # a scale per head, [H, hd], broadcast); OLMo 2: all heads' queries (keys) as one vector, normed over
        # [heads, head_dim] where they lie
        axes = (-2, -1) if config.qk_norm_full else (-1,)
        q = _norm(config, q, lp["q_norm"], axes)
        k = _norm(config, k, lp["k_norm"], axes)
    if config.clip_qkv is not None:  # OLMoE: after the norms, before RoPE
        c = config.clip_qkv
        q, k, v = jnp.clip(q, -c, c), jnp.clip(k, -c, c), jnp.clip(v, -c, c)
    if config.uses_rope:
        factor = rope_attention_factor(config) if rope_factor is None else rope_factor
        q = apply_rope(q, q_pos, inv_freq, factor)
        k = apply_rope(k, q_pos, inv_freq, factor)
    a, aux = attend(q, k, v)
    # contracted over one flattened (heads x head_dim) axis: with two contracting axes XLA:CPU copied wo
    # into another layout before each product, and a copy hoisted out of a 0/1-trip branch loop (each
    # verification width's) runs on every step whichever branch is taken
    wo = lp["wo"]
    o = matmul("btk,kd->btd", a.reshape(a.shape[:2] + (-1,)), wo.reshape((-1, wo.shape[-1])))  # [B, T, D]
    if config.o_bias:
        o = o + lp["bo"]
    if config.sandwich_norms or config.post_norms:
        o = _norm(config, o, lp["attn_out_norm"])
    if config.residual_multiplier != 1.0:  # Granite
        o = times_float(o, config.residual_multiplier)
    x = x + o
    if config.post_norms:
        h = x
    elif not config.parallel_block:  # parallel (Cohere): the MLP reads the attention's normed input, h as it is
        h = _norm(config, x, lp["mlp_norm"])
    if config.is_gpt2:
        u = matmul("btd,df->btf", h, lp["w_up"]) + lp["b_up"]
        m = matmul("btf,fd->btd", gelu_new(u), lp["w_down"]) + lp["b_down"]
    elif config.num_experts:
        m = moe_mlp(config, h, lp)
        if config.shared_expert_intermediate_size:
            m = m + shared_expert(config, h, lp)
    else:
        biases = (lp["b_gate"], lp["b_up"], lp["b_down"]) if config.mlp_bias else None
        m = gated_mlp(config, h, lp["w_gate"], lp["w_up"], lp["w_down"], biases)
    if config.sandwich_norms or config.post_norms:
        m = _norm(config, m, lp["mlp_out_norm"])
    if config.residual_multiplier != 1.0:
        m = times_float(m, config.residual_multiplier)
    return x + m, aux


def gated_mlp(config: ModelConfig, h, w_gate, w_up, w_down, biases=None):
    """act(h W_gate + b_gate) * (h W_up + b_up), then W_down (+ b_down): h [B, T, D] -> [B, T, D].
    biases: (b_gate, b_up, b_down) or None."""
    g = matmul("btd,df->btf", h, w_gate)
    u = matmul("btd,df->btf", h, w_up)
    if biases is not None:
        g, u = g + biases[0], u + biases[1]
    m = matmul("btf,fd->btd", _GATED_ACTIVATIONS[config.activation](g) * u, w_down)
    return m if biases is None else m + biases[2]


def shared_expert(config: ModelConfig, h, lp):
    """The shared expert: a gated MLP every token runs, times sigmoid(h . w_shared_gate) (Qwen2-MoE) or as it is
    (Granite-MoE-shared: config.shared_expert_gated False)."""
    m = gated_mlp(config, h, lp["ws_gate"], lp["ws_up"], lp["ws_down"])
    if not config.shared_expert_gated:
        return m
    return jax.nn.sigmoid(matmul("btd,dk->btk", h, lp["w_shared_gate"])) * m  # [B, T, 1] * [B, T, D]


def moe_mlp(config: ModelConfig, h, lp):
    """Mixture of experts: each token [B, T, D] through its top-k experts' gated MLPs, summed with the
    router's weights (softmax over the experts in float32, top k, renormalised when config.moe_norm_topk).

    The N = B*T*k (token, expert) pairs are sorted by expert and multiplied as one grouped matmul
    (`lax.ragged_dot`: each expert over its own rows), not every expert over every token."""
    b, t, d = h.shape
    k = config.num_experts_per_tok
    logits = matmul("btd,de->bte", h, lp["w_router"], out_dtype=jnp.float32)  # [B, T, E]
    if config.sparsemixer_eps is not None:
        top_w, top_e = sparsemixer_top2(logits, config.sparsemixer_eps)
    else:
        top_w, top_e = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)  # [B, T, k]
    if config.moe_norm_topk:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    pair_expert = top_e.reshape(-1)  # [N]
    order = jnp.argsort(pair_expert, stable=True)
    pair_token = order // k  # the token (row of [B*T, D]) of each sorted pair
    sizes = jnp.bincount(pair_expert, length=config.num_experts).astype(jnp.int32)  # [E] rows per expert
    wdt = lp["we_up"].dtype

    def grouped(x, w):  # x [N, C] sorted by expert, w [E, C, F] -> [N, F] float32
        hi = x.astype(wdt)
        if jnp.dtype(x.dtype).itemsize <= jnp.dtype(wdt).itemsize:
            return jax.lax.ragged_dot(hi, w, sizes, preferred_element_type=jnp.float32)
        # Weights stored narrower: `matmul`'s hi / lo split, each pair's two rows kept together so the rows
        # stay grouped by expert and every expert's weights are read once.
        lo = (x - hi.astype(x.dtype)).astype(wdt)
        both = jnp.stack([hi, lo], axis=1).reshape(-1, x.shape[-1])  # [2N, C]
        out = jax.lax.ragged_dot(both, w, 2 * sizes, preferred_element_type=jnp.float32)  # [2N, F]
        return out.reshape(x.shape[0], 2, -1).sum(axis=1)

    xs = jnp.take(h.reshape(b * t, d), pair_token, axis=0)  # [N, D]
    act = _GATED_ACTIVATIONS[config.activation]
    y = grouped(act(grouped(xs, lp["we_gate"])) * grouped(xs, lp["we_up"]), lp["we_down"])  # [N, D]
    y = y * jnp.take(top_w.reshape(-1), order)[:, None]
    out = jnp.zeros((b * t, d), jnp.float32).at[pair_token].add(y)
    return out.reshape(b, t, d).astype(h.dtype)


def sparsemixer_top2(scores, eps: float):
    """Phi-3.5-MoE's routing of router logits scores [..., E] as transformers' sparsemixer computes it in eval mode:
    the top expert, weighted by a softmax over the experts whose (top - score) / max(|score|, top) is at most
    2 * eps (the others masked to -inf); then the top of the rest (the first masked out), weighted the same way
    relative to its own score. Returns (weights [..., 2], experts [..., 2]); the weights are not renormalised."""
    def pick(masked):  # masked: scores with the experts already taken at -inf; the threshold reads scores
        top = jnp.max(masked, axis=-1, keepdims=True)
        expert = jnp.argmax(masked, axis=-1)  # the first on a tie, as torch's max
        far = (top - scores) / jnp.maximum(jnp.abs(scores), top) > 2 * eps  # 0/0 is NaN: kept, as in torch
        gates = jax.nn.softmax(jnp.where(far, -jnp.inf, masked), axis=-1)
        return jnp.take_along_axis(gates, expert[..., None], axis=-1)[..., 0], expert

    w1, e1 = pick(scores)
    w2, e2 = pick(jnp.where(jax.nn.one_hot(e1, scores.shape[-1], dtype=bool), -jnp.inf, scores))
    return jnp.stack([w1, w2], axis=-1), jnp.stack([e1, e2], axis=-1)


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
# split_layers keeps the stacked form above these: the unrolled forward compiles in time linear in
# its layers, and the split holds a second copy of the layer weights.
MAX_SPLIT_LAYERS = 32
MAX_SPLIT_BYTES = 1 << 30
_splits: dict = {}  # id of the first layer leaf -> (weak refs to the stacked leaves, the split)


def split_layers(config: ModelConfig, params):
    """params for the decoders' loops on the CPU: the stacked layer weights as one array per layer
    ('layers' a tuple of per-layer dicts), which `forward` runs unrolled; params unchanged elsewhere.

    XLA:CPU copies each layer's slice of a stacked weight before its matmul, on every forward (under
    a scan or a dynamic index alike): at batch 1 those copies took a third of a decode step of the
    embedded model. Split once, the forward reads each layer's weights where they lie. The split is
    memoised per stacked array (it lives as long as they do), so it is a second copy of the layer
    weights: only for concrete CPU arrays of at most MAX_SPLIT_BYTES and MAX_SPLIT_LAYERS layers.
    Traced params (passed into a caller's jit), GPU and TPU arrays keep the stacked form: there a split
    would copy the weights on every call, and the device's memory is the scarce resource.
    """
    layers = params["layers"]
    leaves = jax.tree.leaves(layers)
    if (isinstance(layers, tuple) or not leaves or config.num_layers > MAX_SPLIT_LAYERS
            or sum(x.size * x.dtype.itemsize for x in leaves) > MAX_SPLIT_BYTES
            or not all(_on_cpu(x) for x in leaves)):
        return params
    memo = _splits.get(id(leaves[0]))
    if memo is not None and len(memo[0]) == len(leaves) and all(r() is x for r, x in zip(memo[0], leaves)):
        return {**params, "layers": memo[1]}
    # Concrete arrays may arrive inside a caller's jit (params closed over, not passed): slice them
    # eagerly, or the memo would keep that trace's tracers and the next trace would read them.
    with jax.ensure_compile_time_eval():
        split = _split(layers, config.num_layers)
    try:
        refs = tuple(weakref.ref(x) for x in leaves)
        weakref.finalize(leaves[0], _splits.pop, id(leaves[0]), None)
        _splits[id(leaves[0])] = (refs, split)
    except TypeError:  # not weak-referenceable: split again next time
        pass
    return {**params, "layers": split}


def _on_cpu(x) -> bool:
    """x is a concrete array whose every shard is on a CPU device (not a tracer, not a NumPy array)."""
    if not isinstance(x, jax.Array):
        return False
    try:
        return {d.platform for d in x.devices()} == {"cpu"}
    except jax.errors.ConcretizationTypeError:  # a tracer: inside a caller's jit
        return False


@partial(jax.jit, static_argnums=1)
def _split(layers, num_layers: int):
    return tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(num_layers))


ATTN_IMPLS = ("xla", "tree", "interpret")
# attn_impl -> the tree-attention op's impl (jaxdecode.kernels.tree_attention)
_OP_IMPL = {"xla": "blockwise", "tree": "auto", "interpret": "interpret"}


def _cached_attention(q, k_all, v_all, layer, window, lengths, mask, q_pos, win_pos, attn_impl, mesh, sm_scale=None,
                      softcap=None):
    """The tree-attention op over layer `layer` of the stacked cache (read in place, never sliced out);
    under shard_map on the mesh's local shards when a mesh is given (a Pallas call cannot be
    partitioned by GSPMD)."""
    from jaxdecode.kernels.tree_attention import sharded_tree_attention, tree_attention

    kw = dict(q_positions=q_pos, window=window, key_positions=win_pos, layer=layer, impl=_OP_IMPL[attn_impl],
              sm_scale=sm_scale, softcap=softcap)
    if mesh is None:
        return tree_attention(q, k_all, v_all, lengths, mask, **kw)
    return sharded_tree_attention(mesh, q, k_all, v_all, lengths, mask, **kw)


@partial(jax.jit, static_argnames=("config", "return_layers", "stop_at_layer", "skip_layers", "attn_impl", "mesh"))
def forward(config: ModelConfig, params, tokens, positions, cache: KVCache | None, attn_mask,
            *, write_offset=None, key_positions=None, return_layers: tuple = (),
            stop_at_layer: int | None = None, skip_layers: tuple = (), attn_impl: str = "xla", mesh=None,
            layer_ids=None, num_layers_run=None):
    """Run the model over T new tokens per row. See the module docstring for the contract.

    attn_mask is [B, T, T], or with a cache [B, T, W >= T]: then its columns are the W slots after the
    committed prefix and the new tokens are written at columns write_offset[b]..+T-1 (key positions of
    the other columns: `key_positions` [B, W], see `window_key_positions`), so a draft tree can grow
    level by level without committing.
    Returns logits [B, T, V] (float32), hidden {"final": [B, T, D] after the final norm,
    "layers": [len(return_layers), B, T, D] outputs of the chosen layers (or None)}, and the cache
    with the new keys/values written after each row's committed prefix (lengths unchanged).
    attn_impl (attention over the cache; all compute the same function): "xla" (the tree-attention op's
    blockwise jnp form), "tree" (the op: its Pallas kernel on GPU/TPU, the blockwise form on CPU) or
    "interpret" (the kernel in Pallas interpret mode, for tests).
    mesh: a (data, model) Mesh when params and cache are sharded on it: the attention op then runs
    under shard_map (rows over data, KV heads over model), as a Pallas kernel must.
    layer_ids / num_layers_run: a sub-network chosen at run time: int32[K] layer ids (traced), of which
    the first num_layers_run (traced int32, default K) run in order. One compiled forward then serves
    every candidate sub-network (self-speculation picks one per step) at the cost of the layers it runs,
    with no conditional around the cache (XLA copies a conditional's large operands). Exclusive with
    stop_at_layer / skip_layers / return_layers; a while loop, so not reverse-differentiable.
    """
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")
    b, t = tokens.shape
    if attn_mask.shape[:2] != (b, t) or attn_mask.shape[2] < t or (cache is None and attn_mask.shape[2] != t):
        raise ValueError(f"attn_mask must be [B, T, T] (or [B, T, W>=T] with a cache) for tokens "
                         f"{tokens.shape}, got {attn_mask.shape}")
    if layer_ids is not None:
        if stop_at_layer is not None or skip_layers or return_layers:
            raise ValueError("layer_ids (a sub-network chosen at run time) cannot be combined with "
                             "stop_at_layer, skip_layers or return_layers: give the layers in layer_ids alone")
        if jnp.ndim(layer_ids) != 1:
            raise ValueError(f"layer_ids must be a 1-D int array of layer ids, got shape {jnp.shape(layer_ids)}")
        ids = None
    else:
        ids = _layer_ids(config, stop_at_layer, skip_layers, return_layers)
    # with weights stored narrower, the residual stream, attention and KV cache keep the compute dtype
    act_dtype = compute_dtype(params)
    x = embed_rows(params["embed"], tokens, act_dtype, params.get("embed_words"))
    if config.scale_embed:  # Gemma: sqrt(hidden_size) in the activations' dtype, as its reference rounds it
        x = x * jnp.asarray(math.sqrt(config.hidden_size), act_dtype)
    if config.embedding_multiplier != 1.0:  # Granite
        x = times_float(x, config.embedding_multiplier)
    if config.is_gpt2:
        x = x + embed_rows(params["pos_embed"], positions, act_dtype)
    # [L, hd/2]: one row per layer where layers differ (Gemma 3's sliding-window layers, SmolLM3's layers
    # without RoPE: zeros, so cos 1 and sin 0), else [hd/2]
    inv_freqs = rope_factors = None
    if config.rope_per_layer:
        inv_freqs = jnp.asarray(rope_inv_freqs(config))
        factors = rope_attention_factors(config)
        rope_factors = jnp.asarray(factors) if np.any(factors != 1) else None  # YaRN's factor on some layers
    inv_freq = jnp.asarray(rope_inv_freq(config)) if config.uses_rope else None
    positions = positions.astype(jnp.int32)
    mask = attn_mask.astype(bool)
    switch = rope_switch_position(config)
    row_factor = None  # LongRoPE with a factor on cos and sin per set (Phi-3.5-MoE's mscales): [B, 1, 1, 1]
    if switch is not None:  # LongRoPE: its long factors for a row whose furthest token reaches the switch
        long_rows = _longrope_rows(switch, positions, mask, write_offset)
        inv_freq = jnp.where(long_rows[:, None], jnp.asarray(rope_long_inv_freq(config))[None, :], inv_freq[None, :])
        short_factor, long_factor = rope_attention_factor(config), rope_long_attention_factor(config)
        if short_factor != long_factor:
            row_factor = jnp.where(long_rows, long_factor, short_factor).astype(jnp.float32)[:, None, None, None]
    if cache is not None:
        write_start = cache.lengths if write_offset is None else cache.lengths + write_offset.astype(jnp.int32)
        win_pos = window_key_positions(positions, cache.lengths, mask.shape[2], write_offset, key_positions)

    layers = params["layers"]
    windows = jnp.asarray(config.sliding_windows, jnp.int32)

    # The cache rides in the scan's carry and each layer writes only its T new slots into it, so XLA
    # updates it in place (no per-forward copy). The layers run are scanned by id; a sub-network
    # (stop_at_layer / skip_layers) indexes its weights inside the body, so it gathers no copy of its
    # weights or cache either (the full model scans the stacked weights, the usual form for training).
    full = ids == tuple(range(config.num_layers))

    def body(carry, xs):
        x, k_all, v_all = carry
        layer, lp = xs
        if lp is None:
            lp = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), layers)
        window = jax.lax.dynamic_index_in_dim(windows, layer, keepdims=False)
        layer_inv_freq, layer_factor = inv_freq, row_factor
        if inv_freqs is not None:
            layer_inv_freq = jax.lax.dynamic_index_in_dim(inv_freqs, layer, keepdims=False)
            layer_factor = 1.0 if rope_factors is None else jax.lax.dynamic_index_in_dim(rope_factors, layer,
                                                                                         keepdims=False)

        def attend(q, k, v):
            if cache is None:  # the T tokens see each other as attn_mask says
                vis = _window_mask(mask, positions, positions, window)
                a = attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), vis, config.attn_scale,
                              config.attn_logit_softcapping)
                return a, (None, None)
            k2, v2 = write_layer(k_all, v_all, layer, k, v, write_start)
            a = _cached_attention(q, k2, v2, layer, window, cache.lengths, mask, positions, win_pos, attn_impl,
                                  mesh, config.attn_scale, config.attn_logit_softcapping)
            return a, (k2, v2)

        x, (k_all, v_all) = _layer(config, x, lp, positions, layer_inv_freq, attend, layer_factor)
        return (x, k_all, v_all), (x if return_layers else None)

    init = (x, None, None) if cache is None else (x, cache.k, cache.v)
    if isinstance(layers, tuple):  # one weight buffer per layer (split_layers): the layers unrolled
        if ids is None:
            raise ValueError("layer_ids (a sub-network chosen at run time) indexes the stacked layer weights; "
                             "pass params whose 'layers' are stacked arrays, not split_layers' tuple")
        carry, outs = init, []
        for i in ids:
            carry, out = body(carry, (jnp.int32(i), layers[i]))
            outs.append(out)
        x, new_k, new_v = carry
        per_layer = jnp.stack(outs) if return_layers else None
    elif ids is None:  # run-time layer list: a loop of num_layers_run trips, the cache in its carry
        run_ids = jnp.asarray(layer_ids, jnp.int32)
        n_run = run_ids.shape[0] if num_layers_run is None else num_layers_run
        x, new_k, new_v = jax.lax.fori_loop(0, n_run, lambda i, c: body(c, (run_ids[i], None))[0], init)
    else:
        xs = (jnp.asarray(ids, jnp.int32), layers if full else None)
        (x, new_k, new_v), per_layer = jax.lax.scan(body, init, xs)
    h_final = _norm(config, x, params["final_norm"])
    logits = output_logits(config, params, h_final)

    layers_out = None
    if return_layers:
        pos = [ids.index(i) for i in return_layers]
        layers_out = per_layer[np.asarray(pos)]
    hidden = {"final": h_final, "layers": layers_out}
    new_cache = None if cache is None else cache.replace(k=new_k, v=new_v)
    return logits, hidden, new_cache


def _longrope_rows(switch: int, positions, mask, write_offset):
    """LongRoPE's choice per row, bool[B]: the long factors (and Phi-3.5-MoE's long_mscale) where the row's
    furthest token is at a position >= switch (original_max_position_embeddings). transformers decides so per
    forward (max(position_ids) + 1 > original_max_position_embeddings); here per row, over the row's own tokens
    (those that see themselves: not padding), so a row's logits do not depend on its batch-mates nor on padding.
    A cache written with the other set would mix them, which transformers' generate avoids by recomputing the
    cache at the switch: the decoders refuse a decode that would cross it (autoregressive.validate_prompts)."""
    b, t = positions.shape
    col = jnp.arange(t, dtype=jnp.int32)[None, :]
    if write_offset is not None:  # with a cache: new token i sits at window column write_offset[b] + i
        col = col + write_offset.astype(jnp.int32)[:, None]
    own = jnp.take_along_axis(mask, jnp.broadcast_to(jnp.minimum(col, mask.shape[2] - 1), (b, t))[..., None],
                              axis=2)[..., 0]
    furthest = jnp.max(jnp.where(own, positions, -1), axis=1)  # [B]
    return furthest >= switch


def causal_mask(batch: int, t: int) -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


def padded_causal_mask(valid: jax.Array) -> jax.Array:
    """Causal mask among new tokens where only valid (non-padding) keys are visible. valid: [B, T]."""
    b, t = valid.shape
    return causal_mask(b, t) & valid[:, None, :]


def bidirectional_mask(valid: jax.Array) -> jax.Array:
    """Masked-diffusion LM mask among new tokens: every token sees every valid (non-padding) token.
    valid: bool[B, T] -> bool[B, T, T]."""
    b, t = valid.shape
    return jnp.broadcast_to(valid.astype(bool)[:, None, :], (b, t, t))


def block_causal_mask(valid: jax.Array, block_size: int, offset=0) -> jax.Array:
    """Block-diffusion mask among new tokens (BD3-LM, Fast-dLLM v2): causal across blocks of
    `block_size` positions, bidirectional inside one; only valid keys are visible.

    valid: bool[B, T]; offset: int or int[B], the position of new token 0, so blocks are aligned to
    absolute positions (k * block_size) whatever the window's start (with a cache: its lengths).
    Returns bool[B, T, T]: token i sees token j iff block(offset + j) <= block(offset + i).
    """
    if not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int (tokens per block), got {block_size!r}")
    b, t = valid.shape
    pos = jnp.asarray(offset, jnp.int32).reshape(-1, 1) + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B|1, T]
    blk = pos // block_size
    sees = blk[:, None, :] <= blk[:, :, None]  # [B|1, T(query), T(key)]
    return jnp.broadcast_to(sees, (b, t, t)) & valid.astype(bool)[:, None, :]


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

    def norm_params(shape):  # the identity: scale 1, or 0 where the norm scales by 1 + scale (Gemma)
        p = {"scale": (jnp.zeros if config.norm_plus_one else jnp.ones)(shape, dt)}
        if config.is_gpt2 or config.layer_norm:
            p["bias"] = jnp.zeros(shape, dt)
        return p

    # Residual projections scaled down by depth (GPT-2 style) for stable training from scratch.
    resid = std / math.sqrt(2 * n)
    layers = {
        "wq": normal((n, d, h, hd)), "wk": normal((n, d, kv, hd)), "wv": normal((n, d, kv, hd)),
        "wo": normal((n, h, hd, d), resid),
    }
    if not config.post_norms:
        layers["attn_norm"] = norm_params((n, d))
    if not (config.post_norms or config.parallel_block):
        layers["mlp_norm"] = norm_params((n, d))
    if config.num_experts:
        e, fm = config.num_experts, config.moe_intermediate_size
        layers.update(w_router=normal((n, d, e)), we_gate=normal((n, e, d, fm)), we_up=normal((n, e, d, fm)),
                      we_down=normal((n, e, fm, d), resid))
        fs = config.shared_expert_intermediate_size
        if fs:
            layers.update(ws_gate=normal((n, d, fs)), ws_up=normal((n, d, fs)), ws_down=normal((n, fs, d), resid))
            if config.shared_expert_gated:
                layers["w_shared_gate"] = normal((n, d, 1))
    else:
        layers.update(w_up=normal((n, d, f)), w_down=normal((n, f, d), resid))
    if not config.is_gpt2 and not config.num_experts:
        layers["w_gate"] = normal((n, d, f))
    if config.qkv_bias:
        layers.update(bq=jnp.zeros((n, h, hd), dt), bk=jnp.zeros((n, kv, hd), dt),
                      bv=jnp.zeros((n, kv, hd), dt))
    if config.o_bias:
        layers["bo"] = jnp.zeros((n, d), dt)
    if config.qk_norm_full or config.qk_norm_head_scales:
        layers.update(q_norm=norm_params((n, h, hd)), k_norm=norm_params((n, kv, hd)))
    elif config.qk_norm:
        layers.update(q_norm=norm_params((n, hd)), k_norm=norm_params((n, hd)))
    if config.sandwich_norms or config.post_norms:
        layers.update(attn_out_norm=norm_params((n, d)), mlp_out_norm=norm_params((n, d)))
    if config.is_gpt2 or config.mlp_bias:
        layers.update(b_up=jnp.zeros((n, f), dt), b_down=jnp.zeros((n, d), dt))
        if not config.is_gpt2:
            layers["b_gate"] = jnp.zeros((n, f), dt)
    params = {"embed": normal((v, d)), "layers": layers, "final_norm": norm_params((d,))}
    if config.is_gpt2:
        params["pos_embed"] = normal((config.max_position_embeddings, d), 0.01)
    if not config.tie_word_embeddings:
        params["lm_head"] = normal((d, v))
    if config.lm_head_bias:
        params["lm_head_bias"] = jnp.zeros((v,), dt)
    return params


def param_shapes(config: ModelConfig) -> dict:
    """The expected shape of every parameter (used to validate loaded checkpoints)."""
    abstract = jax.eval_shape(lambda k: init_params(config, k), jax.random.PRNGKey(0))
    return jax.tree.map(lambda a: tuple(a.shape), abstract)
