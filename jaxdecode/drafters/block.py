"""The parallel block drafter (DFlash / PARD style): a few-layer drafter that predicts a whole block of
k tokens in ONE forward, conditioned on the target's own hidden states.

Input: the pending token x_t followed by k MASK slots at positions t, t+1, .., t+k; the slots see each
other both ways (bidirectional inside the block), and slot i's output predicts x_{t+i} (masked-diffusion
convention: a MASK slot predicts its own token), read out by the target's frozen LM head. MASK is a
learned embedding of its own, not a vocabulary token; the token embedding is the target's (shared,
frozen), so a drafter directory holds only the drafter's layers.

Context: the target's hidden states of several layers (`feature_layers`, f_j after history token j)
fused as c_j = RMSNorm(sum_f F_j^f W_fc^f) are injected into EVERY drafter layer as extra keys/values of
the context positions j < t: layer l's K = rope(c_j Wk_l), V = c_j Wv_l, next to the block's own keys.
The drafter keeps these projected K/V of the committed text as its state (a small KV cache, Ld layers),
filled from `init(features=...)` and appended from `accepted_features(obs)` after every verification,
so drafting never runs the target and costs one small forward over k+1 tokens whatever k is.

The drafter layers are the model core's layer (`jaxdecode.models.transformer._layer`: pre-norm, RoPE,
GQA, gated SiLU MLP) with its stacked-parameter layout, so `models.init_params` initialises them; only
the attention differs (context K/V + the block, `block_attention`).

Decoding: one forward gives q_1..q_k for depths 1..k. Any tree builder of depth <= k drafts over them
(`expand` returns q_{d+1} for any node at depth d, the same for every node of a depth: like Medusa, q
does not depend on the parent), so chains (argmax / sampled) and static top-k trees both work; the child
rule is the builder's and the draft probabilities per parent slot are the q the children came from.

The pure functions here are also what training runs (jaxdecode.training.block): the NNX module's
`nnx.Param` state is this params pytree.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.drafters.builders import build_tree
from jaxdecode.drafters.draft_lm import draft_logprobs
from jaxdecode.drafters.medusa import head_logits, target_head
from jaxdecode.drafters.trained import DrafterKind, register_kind
from jaxdecode.models import ModelConfig, rope_inv_freq
from jaxdecode.models import init_params as model_init_params
from jaxdecode.models import param_shapes as model_param_shapes
from jaxdecode.models.transformer import (_MASKED, _layer, apply_rope, embed_rows, finish_logits, head_bias,
                                         logits_finish, rms_norm)
from jaxdecode.speculative import FINAL, accepted_features
from jaxdecode.tree import depths


class BlockDrafterError(ValueError):
    """A block drafter config, params or tree that cannot work with its target."""


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    block_size: int = 8  # k: MASK slots, the deepest draft
    num_layers: int = 2  # drafter layers
    # Drafter attention / MLP shape; 0 = the target's (the width is always the target's hidden size:
    # the drafter shares its embedding and LM head).
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    # Target layers fused into the context (ids 0..L-1 and/or "final"); () = low/mid/high of the target.
    feature_layers: tuple = ()
    gamma: float = 4.0  # training: loss weight of block position i is exp(-(i-1)/gamma)
    # training: random anchor positions per sequence (16 blocks of 8 cover a 96-token window ~1.3x at
    # ~1/2 the cost of one target forward); 0 = every position (k+1 drafter tokens per text token)
    anchors: int = 16
    rope_theta: float = 10000.0
    # decoding: attend to the newest context_window committed positions only (0 = all). Training sees
    # contexts of at most --seq-len tokens, and a drafter trained on short windows does not extrapolate
    # its RoPE attention to longer distances (acceptance collapses past them), so `train block` sets it
    # to the training sequence length.
    context_window: int = 0

    def __post_init__(self):
        for name in ("block_size", "num_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise BlockDrafterError(f"BlockConfig.{name} must be an int >= 1, got {v!r}")
        for name in ("num_heads", "num_kv_heads", "head_dim", "intermediate_size", "anchors", "context_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise BlockDrafterError(f"BlockConfig.{name} must be an int >= 0 (0 = default), got {v!r}")
        if not (isinstance(self.gamma, (int, float)) and math.isfinite(self.gamma) and self.gamma > 0):
            raise BlockDrafterError(f"BlockConfig.gamma must be a finite number > 0, got {self.gamma!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise BlockDrafterError(f"BlockConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        layers = tuple(self.feature_layers)
        bad = [x for x in layers if x != FINAL and (isinstance(x, bool) or not isinstance(x, int) or x < 0)]
        if bad or len(set(layers)) != len(layers):
            raise BlockDrafterError(f"BlockConfig.feature_layers must be distinct target layer ids (ints >= 0) "
                                    f"or {FINAL!r}, got {self.feature_layers!r}")
        object.__setattr__(self, "feature_layers", layers)


# ----------------------------------------------------------------------------- config against a target
def default_feature_layers(num_layers: int) -> tuple:
    """Low, middle and high target layers (every layer of a target with <= 3)."""
    if num_layers <= 3:
        return tuple(range(num_layers))
    return tuple(sorted({round(float(x)) for x in np.linspace(1, num_layers - 1, 3)}))


def feature_layers_for(cfg: BlockConfig, target_config) -> tuple:
    """The target layers the drafter fuses (checked against the target's layer count)."""
    layers = cfg.feature_layers or default_feature_layers(target_config.num_layers)
    bad = [x for x in layers if x != FINAL and x >= target_config.num_layers]
    if bad:
        raise BlockDrafterError(f"BlockConfig.feature_layers {list(bad)} are not layers of the target, which "
                                f"has {target_config.num_layers} (0..{target_config.num_layers - 1} or {FINAL!r})")
    return layers


def drafter_model_config(cfg: BlockConfig, target_config) -> ModelConfig:
    """The drafter layers' shape as a ModelConfig (llama-style layers of the target's width)."""
    d = target_config.hidden_size
    heads = cfg.num_heads or target_config.num_heads
    kv = cfg.num_kv_heads or (target_config.num_kv_heads if not cfg.num_heads else heads)
    head_dim = cfg.head_dim or (target_config.head_dim if not cfg.num_heads else d // heads)
    if heads % kv:
        raise BlockDrafterError(f"the block drafter's num_heads ({heads}) must be a multiple of its "
                                f"num_kv_heads ({kv})")
    if head_dim % 2:
        raise BlockDrafterError(f"the block drafter's head_dim must be even (RoPE), got {head_dim}")
    return ModelConfig(model_type="llama", vocab_size=target_config.vocab_size, hidden_size=d,
                       intermediate_size=cfg.intermediate_size or target_config.intermediate_size,
                       num_layers=cfg.num_layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                       max_position_embeddings=target_config.max_position_embeddings,
                       norm_eps=target_config.norm_eps, rope_theta=float(cfg.rope_theta),
                       tie_word_embeddings=True, dtype="float32")


def param_shapes(cfg: BlockConfig, target_config) -> dict:
    """The params pytree's shapes: the drafter layers (models layout), its final norm, the context
    fusion fc [F, D, D] + ctx_norm, and the MASK embedding [D]."""
    d = target_config.hidden_size
    model = model_param_shapes(drafter_model_config(cfg, target_config))
    return {"layers": model["layers"], "final_norm": model["final_norm"],
            "fc": (len(feature_layers_for(cfg, target_config)), d, d), "ctx_norm": {"scale": (d,)},
            "mask_embed": (d,)}


def init_params(cfg: BlockConfig, target_config, key) -> dict:
    """Fresh drafter params: random layers (models.init_params), fc = the mean of the fused layers."""
    k1, k2 = jax.random.split(key)
    d = target_config.hidden_size
    f = len(feature_layers_for(cfg, target_config))
    model = model_init_params(drafter_model_config(cfg, target_config), k1)
    return {"layers": model["layers"], "final_norm": model["final_norm"],
            "fc": jnp.broadcast_to(jnp.eye(d, dtype=jnp.float32) / f, (f, d, d)),
            "ctx_norm": {"scale": jnp.ones((d,), jnp.float32)},
            "mask_embed": 0.02 * jax.random.normal(k2, (d,), jnp.float32)}


def check_params(cfg: BlockConfig, params, target_config) -> None:
    want = param_shapes(cfg, target_config)
    try:
        got = jax.tree.map(lambda a: tuple(a.shape), params)
    except (TypeError, AttributeError):
        got = None
    if got != want:
        raise BlockDrafterError(f"block drafter params have shapes {got}, but {cfg} over this target "
                                f"(hidden size {target_config.hidden_size}) needs {want}")


# ----------------------------------------------------------------------------- the network (pure)
def context_kv(dcfg: ModelConfig, params, feats, positions):
    """Every drafter layer's keys/values of context features.

    feats f32[F, B, S, Dt] (target states of the fused layers), positions int32[B, S]
    -> (k, v) f32[Ld, B, KV, S, hd], k rotary-encoded at `positions`."""
    c = jnp.einsum("fbsd,fde->bse", feats.astype(jnp.float32), params["fc"])
    c = rms_norm(c, params["ctx_norm"], dcfg.norm_eps)
    lay = params["layers"]
    k = jnp.einsum("bse,lenh->lbsnh", c, lay["wk"])  # [Ld, B, S, KV, hd]
    v = jnp.einsum("bse,lenh->lbsnh", c, lay["wv"])
    inv_freq = jnp.asarray(rope_inv_freq(dcfg))
    k = jax.vmap(lambda x: apply_rope(x, positions, inv_freq))(k)
    return k.transpose(0, 1, 3, 2, 4), v.transpose(0, 1, 3, 2, 4)


def block_attention(q, k, v, k_ctx, v_ctx, ctx_visible):
    """Attention of A blocks per row over the row's context plus their own block (bidirectional).

    q [B, A, T, H, hd]; k, v [B, A, T, KV, hd] (the block's own keys, all visible); k_ctx, v_ctx
    [B, KV, S, hd] (shared by a row's blocks); ctx_visible bool[B, A, S] -> [B, A, T, H, hd]."""
    b, a, t, h, hd = q.shape
    kv = k.shape[3]
    qg = q.reshape(b, a, t, kv, h // kv, hd).astype(jnp.float32)
    s_ctx = jnp.einsum("batkgd,bksd->bakgts", qg, k_ctx.astype(jnp.float32))  # [B, A, KV, G, T, S]
    s_ctx = jnp.where(ctx_visible[:, :, None, None, None, :], s_ctx, _MASKED)
    s_blk = jnp.einsum("batkgd,baukd->bakgtu", qg, k.astype(jnp.float32))  # [B, A, KV, G, T, T]
    p = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1) / math.sqrt(hd), axis=-1)
    s = k_ctx.shape[2]
    out = (jnp.einsum("bakgts,bksd->batkgd", p[..., :s], v_ctx.astype(jnp.float32))
           + jnp.einsum("bakgtu,baukd->batkgd", p[..., s:], v.astype(jnp.float32)))
    return out.reshape(b, a, t, h, hd).astype(q.dtype)


def block_hidden(dcfg: ModelConfig, params, x, positions, ctx_k, ctx_v, ctx_visible):
    """The drafter over A blocks per row: x f32[B, A, T, D] block inputs at `positions` int32[B, A, T],
    context keys/values [Ld, B, KV, S, hd] (`context_kv`), ctx_visible bool[B, A, S] -> the final-norm
    states f32[B, A, T, D] (what the LM head reads)."""
    b, a, t, d = x.shape
    inv_freq = jnp.asarray(rope_inv_freq(dcfg))

    def body(hs, xs):
        lp, ck, cv = xs

        def attend(q, k, v):  # [B, A*T, H|KV, hd]: back to blocks for the attention
            split = lambda z: z.reshape(b, a, t, *z.shape[2:])
            out = block_attention(split(q), split(k), split(v), ck, cv, ctx_visible)
            return out.reshape(b, a * t, *out.shape[3:]), None

        hs, _ = _layer(dcfg, hs, lp, positions.reshape(b, a * t), inv_freq, attend)
        return hs, None

    hs, _ = jax.lax.scan(body, x.reshape(b, a * t, d).astype(jnp.float32), (params["layers"], ctx_k, ctx_v))
    return rms_norm(hs, params["final_norm"], dcfg.norm_eps).reshape(b, a, t, d)


def block_inputs(params, embed, first_tokens, block_size: int):
    """[x_anchor, MASK x k] embeddings: first_tokens int32[...] -> f32[..., k+1, D]."""
    e0 = embed_rows(embed, first_tokens, jnp.float32)[..., None, :]
    masks = jnp.broadcast_to(params["mask_embed"].astype(jnp.float32), e0.shape[:-2] + (block_size,) + e0.shape[-1:])
    return jnp.concatenate([e0, masks], axis=-2)


# ----------------------------------------------------------------------------- the drafter
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockState:
    """Projected context of the committed text: keys/values of positions 0..lengths-1 per row."""
    k: jax.Array  # f32[Ld, B, KV, S, hd]
    v: jax.Array
    lengths: jax.Array  # int32[B]: context positions held (= the pending token's position)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockDrafter:
    """The block drafter (cfg: BlockConfig) over any tree builder of depth <= block_size."""
    params: dict
    embed: jax.Array  # [V, D] the target's input embeddings (the block's pending token; tied LM head)
    lm_head: jax.Array | None  # [D, V], or None when the target ties it to embed
    cfg: BlockConfig = dataclasses.field(metadata=dict(static=True))
    dcfg: ModelConfig = dataclasses.field(metadata=dict(static=True))
    builder: object = dataclasses.field(metadata=dict(static=True))
    feature_layers: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    # Held-out acceptance by depth from training (TrainedDrafter.make): the adaptive policy's start.
    acceptance_prior: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    # the target's logits_finish (Granite's scaling, Cohere's logit_scale, Gemma 2's soft-cap): drafts from its
    # distribution
    finish: tuple = dataclasses.field(default=(1.0, None), metadata=dict(static=True))
    # the target's LM-head bias [V] (Phi-3.5-MoE; None: none), added before the finish as the target adds it
    lm_head_bias: jax.Array | None = None

    num_nodes = property(lambda self: self.builder.num_nodes)
    max_depth = property(lambda self: self.builder.max_depth)
    child_rule = property(lambda self: self.builder.rule)
    is_chain = property(lambda self: getattr(self.builder, "is_chain", False))

    def init(self, prompt_tokens, prompt_lengths, cache_len, key, features=None):
        if features is None:
            raise BlockDrafterError("BlockDrafter needs the target's features: run it through "
                                    "speculative_decode, which passes them because feature_layers is set")
        b, p = prompt_tokens.shape
        dc = self.dcfg
        # Room for every committed position plus one step's write of max_depth + 1 states past it.
        cap = max(cache_len, p) + self.max_depth + 2
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        k, v = context_kv(dc, self.params, features, pos)  # prefill states: valid for t < length - 1
        shape = (dc.num_layers, b, dc.num_kv_heads, cap, dc.head_dim)
        return BlockState(k=jnp.zeros(shape, jnp.float32).at[:, :, :, :p].set(k),
                          v=jnp.zeros(shape, jnp.float32).at[:, :, :, :p].set(v),
                          lengths=jnp.maximum(prompt_lengths - 1, 0).astype(jnp.int32))

    def block_logprobs(self, st: BlockState, ctx, sampler):
        """q_1..q_k after the pending token: f32[B, k, V] (log, the sampler's processing)."""
        b, k = ctx.hist_len.shape[0], self.cfg.block_size
        t = ctx.hist_len - 1  # the pending token's position (= st.lengths for active rows)
        root = ctx.history[jnp.arange(b), t]
        x = block_inputs(self.params, self.embed, root, k)[:, None]  # [B, 1, k+1, D]
        positions = (t[:, None] + jnp.arange(k + 1))[:, None]
        slot = jnp.arange(st.k.shape[3])[None, :]
        visible = slot < st.lengths[:, None]  # [B, S]
        if self.cfg.context_window:  # only distances training saw
            visible &= slot >= st.lengths[:, None] - self.cfg.context_window
        visible = visible[:, None]  # [B, 1, S]
        h = block_hidden(self.dcfg, self.params, x, positions, st.k, st.v, visible)[:, 0, 1:]
        logits = finish_logits(head_logits(h, self.embed, self.lm_head), *self.finish, bias=self.lm_head_bias)
        return draft_logprobs(logits, sampler)

    def propose(self, st: BlockState, ctx, sampler):
        b = ctx.hist_len.shape[0]
        rows = jnp.arange(b)[:, None]
        logq = self.block_logprobs(st, ctx, sampler)  # [B, k, V]: every depth from one forward

        def expand(state, start, tokens, parents_all):
            d = jax.lax.dynamic_slice_in_dim(depths(parents_all), start, tokens.shape[1], axis=1)  # [B, F]
            return logq[rows, jnp.minimum(d, self.cfg.block_size - 1)], state  # children at depth d+1: q_{d+1}

        tree, slots, _ = build_tree(self.builder, ctx, None, logq[:, 0], expand, ctx.key)
        return tree, slots, st

    def observe(self, st: BlockState, obs):
        feats, count = accepted_features(obs)  # [F, B, N+1, D]: root, accepted nodes...
        m = min(self.max_depth + 1, feats.shape[2])  # a path holds at most max_depth nodes (N may be 0)
        feats = feats[:, :, :m]
        pos = st.lengths[:, None] + jnp.arange(m, dtype=jnp.int32)[None, :]
        k, v = context_kv(self.dcfg, self.params, feats, pos)  # [Ld, B, KV, m, hd]

        def write(cache, new):  # per row, at its context length; slots past `count` stay invisible
            return jax.vmap(lambda c, n, at: jax.lax.dynamic_update_slice_in_dim(c, n, at, axis=2),
                            in_axes=(1, 1, 0), out_axes=1)(cache, new, st.lengths)

        return BlockState(k=write(st.k, k), v=write(st.v, v), lengths=st.lengths + count)


def check_tree_depth(cfg: BlockConfig, builder) -> None:
    depth, k = builder.max_depth, cfg.block_size
    if depth > k:
        raise BlockDrafterError(
            f"the tree reaches depth {depth} but the block drafter predicts {k} tokens per forward "
            f"(block_size): use a tree of depth <= {k}, e.g. 'chain:{k}' or 'static:4,2' ")


def make_block_drafter(params, cfg: BlockConfig, target, tree=None, temperature: float = 0.0,
                       **kw) -> BlockDrafter:
    """The drafter for `target` (a jaxdecode.Model) from trained params; `tree`: a spec or a builder
    (default 'chain:k', sampled children at a temperature > 0)."""
    if kw:
        raise BlockDrafterError(f"unknown block drafter options {sorted(kw)} (it takes none)")
    from jaxdecode.drafters import tree_from_option
    tcfg = target.config
    builder = tree_from_option(tree, f"chain:{cfg.block_size}", temperature)
    check_tree_depth(cfg, builder)
    check_params(cfg, params, tcfg)
    embed, lm_head = target_head(tcfg, target.params)
    return BlockDrafter(params=jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params), embed=embed,
                        lm_head=lm_head, cfg=cfg, dcfg=drafter_model_config(cfg, tcfg), builder=builder,
                        feature_layers=feature_layers_for(cfg, tcfg), finish=logits_finish(tcfg),
                        lm_head_bias=head_bias(tcfg, target.params))


register_kind(DrafterKind(name="block", config_cls=BlockConfig, make=make_block_drafter,
                          param_shapes=param_shapes))
