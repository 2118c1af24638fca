"""Training the parallel block drafter on a frozen target (decode side: jaxdecode.drafters.block).

    module = block_module(cfg, target_config, nnx.Rngs(0))
    loss, aux = block_loss(module, {"tokens": int32[B, T], "mask": [B, T]}, {"target": target_params})

The module holds the decode params pytree as `nnx.Param`s (nested like the pytree: `layers`,
`final_norm`, `fc`, `ctx_norm`, `mask_embed`) and runs the same pure functions the drafter runs, so
the trained state is the drafter's params with no conversion. The target runs under stop_gradient;
its embeddings and LM head are frozen and shared, not trained.

Loss (DFlash): anchors a in the text (every position, or `cfg.anchors` random ones per sequence); the
block [x_a, MASK x k] at positions a..a+k sees the fused target states of the context j < a and itself,
and slot i predicts x_{a+i}. CE at block position i weighs exp(-(i-1)/gamma); the loss is the weighted
mean over the real (mask) labels. One target forward per sequence serves all its anchors: every block
of a row shares the row's context keys/values (`block_attention`).

Anchors when the batch has no "anchors" int32[B, A]: drawn from a key derived from the batch's tokens,
so a batch always gets the same anchors (a resumed run sees exactly the anchors of an uninterrupted one).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdecode.drafters.block import (BlockConfig, block_hidden, block_inputs, context_kv, drafter_model_config,
                                      feature_layers_for, init_params)
from jaxdecode.drafters.medusa import head_logits, target_head
from jaxdecode.models import causal_mask, forward
from jaxdecode.models.transformer import finish_logits, head_bias, logits_finish
from jaxdecode.speculative import feature_request, select_features


class _Params(nnx.Module):
    """A nested dict of arrays as nnx.Params, keeping the dict's nesting in the module's state."""

    def __init__(self, tree: dict):
        for name, value in tree.items():
            setattr(self, name, _Params(value) if isinstance(value, dict) else nnx.Param(value))


class BlockModule(nnx.Module):
    """The block drafter as NNX params; `cfg` and the target's config ride along (static)."""

    def __init__(self, cfg: BlockConfig, target_config, rngs: nnx.Rngs):
        if not isinstance(cfg, BlockConfig):
            raise TypeError(f"BlockModule takes a BlockConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.target_config = target_config
        for name, value in init_params(cfg, target_config, rngs.params()).items():
            setattr(self, name, _Params(value) if isinstance(value, dict) else nnx.Param(value))

    def params(self) -> dict:
        """The decode params pytree (nnx.to_pure_dict of the nnx.Param state)."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))


def block_module(cfg: BlockConfig, target_config, rngs: nnx.Rngs) -> BlockModule:
    return BlockModule(cfg, target_config, rngs)


def block_weights(block_size: int, gamma: float) -> jax.Array:
    """w_i = exp(-(i-1)/gamma) for block positions i = 1..k."""
    return jnp.exp(-jnp.arange(block_size, dtype=jnp.float32) / gamma)


def sample_anchors(tokens, num: int):
    """`num` anchor positions per row in [0, T-2], from a key derived from the tokens: int32[B, num];
    num = 0: every position 0..T-2."""
    b, t = tokens.shape
    if num == 0:
        return jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32), (b, t - 1))
    mix = jnp.sum(tokens.astype(jnp.uint32) * (jnp.arange(t, dtype=jnp.uint32) * np.uint32(2654435761) + np.uint32(1)))
    key = jax.random.fold_in(jax.random.PRNGKey(0), mix)
    return jax.random.randint(key, (b, num), 0, t - 1, dtype=jnp.int32)


def block_outputs(module: BlockModule, batch, target_params):
    """(logits f32[B, A, k, V], labels int32[B, A, k], real f32[B, A, k]): block position i of anchor a
    predicts tokens[a + i]; real = 1 where x_a and x_{a+i} are real text."""
    cfg, tcfg = module.cfg, module.target_config
    k = cfg.block_size
    toks = jnp.asarray(batch["tokens"], jnp.int32)
    b, t = toks.shape
    mask = jnp.asarray(batch["mask"], jnp.float32) if "mask" in batch else jnp.ones((b, t), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    layers = feature_layers_for(cfg, tcfg)
    _, hidden, _ = forward(tcfg, target_params, toks, pos, None, causal_mask(b, t),
                           return_layers=feature_request(layers))
    feats = jax.lax.stop_gradient(select_features(hidden, layers))  # [F, B, T, D]
    embed, lm_head = jax.lax.stop_gradient(target_head(tcfg, target_params))
    params = module.params()
    dcfg = drafter_model_config(cfg, tcfg)
    ctx_k, ctx_v = context_kv(dcfg, params, feats, pos)  # [Ld, B, KV, T, hd]: shared by the row's blocks

    anchors = jnp.asarray(batch["anchors"], jnp.int32) if "anchors" in batch else sample_anchors(toks, cfg.anchors)
    idx = anchors[..., None] + jnp.arange(k + 1, dtype=jnp.int32)  # [B, A, k+1] block positions
    inside = idx < t
    idx_c = jnp.minimum(idx, t - 1)
    rows = jnp.arange(b)[:, None, None]
    blk = toks[rows, idx_c]  # [B, A, k+1]
    real = mask[rows, idx_c] * inside
    x = block_inputs(params, embed, blk[..., 0], k)  # [B, A, k+1, D]
    visible = (jnp.arange(t)[None, None, :] < anchors[..., None]) & (mask[:, None, :] > 0)  # [B, A, T]
    h = block_hidden(dcfg, params, x, idx, ctx_k, ctx_v, visible)[:, :, 1:]
    bias = jax.lax.stop_gradient(head_bias(tcfg, target_params))  # as decoding adds it (Phi-3.5-MoE)
    logits = finish_logits(head_logits(h, embed, lm_head), *logits_finish(tcfg), bias=bias)
    return logits, blk[..., 1:], real[..., 1:] * real[..., :1]


def weighted_block_loss(logits, labels, real, gamma: float):
    """(loss, ce_i f32[k], acc_i f32[k], accepted-prefix length f32[B, A]) from block outputs: loss =
    sum w_i real CE / sum w_i real, w_i = exp(-(i-1)/gamma); ce_i / acc_i per block position over its
    real labels; the prefix length counts the leading argmax hits (a greedy chain's accepted length
    on this text)."""
    k = labels.shape[-1]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # [B, A, k]
    w = real * block_weights(k, gamma)
    loss = jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1e-9)
    n_i = jnp.maximum(real.reshape(-1, k).sum(0), 1.0)
    hit = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    prefix = jnp.cumprod(hit * real, axis=-1).sum(-1)
    return loss, (ce * real).reshape(-1, k).sum(0) / n_i, (hit * real).reshape(-1, k).sum(0) / n_i, prefix


def block_loss(module: BlockModule, batch, constants):
    """Trainer form: (weighted CE, aux {"tokens", "accept_len", "ce_i", "acc_i" per position i})."""
    logits, labels, real = block_outputs(module, batch, constants["target"])
    loss, ce_i, acc_i, prefix = weighted_block_loss(logits, labels, real, module.cfg.gamma)
    full = real[..., 0] > 0  # blocks whose anchor has at least one real label
    aux = {"tokens": real.sum(), "accept_len": jnp.sum(prefix * full) / jnp.maximum(full.sum(), 1.0)}
    for i in range(module.cfg.block_size):
        aux[f"ce_{i + 1}"] = ce_i[i]
        aux[f"acc_{i + 1}"] = acc_i[i]
    return loss, aux


def block_eval_step(module: BlockModule, batch, constants):
    """Trainer eval form: (sum of w_i CE over real labels, sum of their weights)."""
    logits, labels, real = block_outputs(module, batch, constants["target"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    w = real * block_weights(labels.shape[-1], module.cfg.gamma)
    return jnp.sum(ce * w), jnp.sum(w)


def default_config(target_config, **overrides) -> BlockConfig:
    """BlockConfig with CLI overrides; the fused layers are written out for the target (low/mid/high)."""
    cfg = BlockConfig(**overrides)
    if not cfg.feature_layers:
        cfg = BlockConfig(**{**overrides, "feature_layers": feature_layers_for(cfg, target_config)})
    # write out the shape taken from the target (0 = the target's), as eagle3 does: the saved drafter then
    # fits any target of its vocab / width / depth instead of failing its shape check on another head layout
    d = drafter_model_config(cfg, target_config)
    return dataclasses.replace(cfg, num_heads=d.num_heads, num_kv_heads=d.num_kv_heads, head_dim=d.head_dim,
                               intermediate_size=d.intermediate_size)


def params_of(module: BlockModule) -> dict:
    return module.params()


def _register():
    try:
        from .drafters import TrainKind, register_train_kind
    except ImportError:  # the shared training registry is not there yet: nothing to register
        return None
    return register_train_kind(TrainKind(name="block", module=block_module, loss_fn=block_loss,
                                         default_config=default_config, eval_step=block_eval_step))


TRAIN_KIND = _register()
