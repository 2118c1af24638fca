"""Training Medusa-1 and Hydra heads on a frozen target (decode side: jaxdecode.drafters.medusa).

    module = heads_module(cfg, target_config, nnx.Rngs(0))         # MedusaConfig or HydraConfig
    loss, aux = heads_loss(module, {"tokens": int32[B, T], "mask": [B, T]}, {"target": target_params})

The module holds the decode params pytree as `nnx.Param`s ({"w", "b"} for Medusa, {"w_h", "w_e", "b",
"w_out"} for Hydra) and runs the same pure functions the drafter runs, so the trained state is the
drafter's params with no conversion. The target runs under stop_gradient; its LM head and input
embeddings (Hydra's token inputs) are frozen and tied, not trained.

Loss: sum_k loss_decay^k * CE_k (k = 1..K), CE_k the cross-entropy of head k predicting x_{t+k+1} from
h_t, the target's final hidden state after token t. Hydra is trained with teacher forcing: head k reads
the embeddings of the real tokens x_{t+1..t+k}. Every head is scored on the same positions: t and its
K+1 following tokens all real (mask), so the loss is a weighted sum of per-head means over one set.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdecode.drafters.medusa import (HydraConfig, MedusaConfig, head_logits, hydra_hidden, init_params,
                                       medusa_hidden, target_head)
from jaxdecode.models import causal_mask, forward
from jaxdecode.models.transformer import finish_logits, head_bias, logits_finish

from .drafters import TrainKind, register_train_kind


class HeadsModule(nnx.Module):
    """Medusa or Hydra heads as NNX params; `cfg` and the target's config ride along (static)."""

    def __init__(self, cfg, target_config, rngs: nnx.Rngs):
        if not isinstance(cfg, (MedusaConfig, HydraConfig)):
            raise TypeError(f"HeadsModule takes a MedusaConfig or HydraConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.target_config = target_config
        p = init_params(cfg, target_config.hidden_size, rngs.params())
        self.names = tuple(p)
        for name, value in p.items():
            setattr(self, name, nnx.Param(value))

    def params(self) -> dict:
        """The decode params pytree (the same as nnx.to_pure_dict(nnx.state(self, nnx.Param)))."""
        return {name: getattr(self, name)[...] for name in self.names}

    def __call__(self, h, emb=None):
        """h [..., D] (+ Hydra: emb [..., K, D] of x_{t+1..t+K}) -> every head's LM-head input [..., K, D]."""
        if isinstance(self.cfg, HydraConfig):
            return hydra_hidden(self.params(), h, emb)
        return medusa_hidden(self.params(), h)


def heads_module(cfg, target_config, rngs: nnx.Rngs) -> HeadsModule:
    return HeadsModule(cfg, target_config, rngs)


def _shifted(x, shift: int, fill):
    """x[:, t + shift] at every t (fill past the end): [B, T, ...] -> [B, T, ...]."""
    pad = [(0, 0), (0, shift)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, pad, constant_values=fill)[:, shift:]


def head_outputs(module: HeadsModule, batch, target_params):
    """(logits f32[B, T, K, V], labels int32[B, T, K], weight f32[B, T]): head k at position t predicts
    tokens[t + k + 2] (k from 0); weight 1 where t..t+K+1 are all real tokens."""
    tcfg, k = module.target_config, module.cfg.num_heads
    toks = jnp.asarray(batch["tokens"], jnp.int32)
    mask = jnp.asarray(batch["mask"], jnp.float32)
    b, t = toks.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    _, hidden, _ = forward(tcfg, target_params, toks, pos, None, causal_mask(b, t))
    h = jax.lax.stop_gradient(hidden["final"].astype(jnp.float32))  # [B, T, D]
    embed, lm_head = jax.lax.stop_gradient(target_head(tcfg, target_params))
    labels = jnp.stack([_shifted(toks, j + 2, 0) for j in range(k)], axis=2)  # [B, T, K]
    weight = mask
    for j in range(1, k + 2):
        weight = weight * _shifted(mask, j, 0.0)
    emb = None
    if isinstance(module.cfg, HydraConfig):  # teacher forcing: e_j = emb(x_{t+1+j}), j = 0..K-1
        nxt = jnp.stack([_shifted(toks, j + 1, 0) for j in range(k)], axis=2)  # [B, T, K]
        emb = jnp.take(embed, nxt, axis=0).astype(jnp.float32)
    bias = jax.lax.stop_gradient(head_bias(tcfg, target_params))  # as decoding adds it (Phi-3.5-MoE)
    logits = finish_logits(head_logits(module(h, emb), embed, lm_head), *logits_finish(tcfg), bias=bias)  # [B,T,K,V]
    return logits, labels, weight


def head_weights(cfg) -> jax.Array:
    """lambda_k = loss_decay ** k, k = 1..K."""
    return jnp.asarray([cfg.loss_decay ** (k + 1) for k in range(cfg.num_heads)], jnp.float32)


def heads_loss(module: HeadsModule, batch, constants):
    """Trainer form: (sum_k lambda_k CE_k, aux {"tokens", "ce_k", "acc_k" per head k = 1..K})."""
    logits, labels, weight = head_outputs(module, batch, constants["target"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # [B, T, K]
    hit = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    n = jnp.maximum(weight.sum(), 1.0)
    ce_k = jnp.einsum("btk,bt->k", ce, weight) / n
    acc_k = jnp.einsum("btk,bt->k", hit, weight) / n
    aux = {"tokens": weight.sum()}
    for j in range(module.cfg.num_heads):
        aux[f"ce_{j + 1}"] = ce_k[j]
        aux[f"acc_{j + 1}"] = acc_k[j]
    return jnp.sum(head_weights(module.cfg) * ce_k), aux


def heads_eval_step(module: HeadsModule, batch, constants):
    """Trainer eval form: (sum over scored positions of sum_k lambda_k CE, number of positions)."""
    logits, labels, weight = head_outputs(module, batch, constants["target"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels) @ head_weights(module.cfg)
    return jnp.sum(ce * weight), jnp.sum(weight)


def medusa_config(target_config, **overrides) -> MedusaConfig:
    """Medusa's config with CLI overrides (num_heads, loss_decay)."""
    return MedusaConfig(**overrides)


def hydra_config(target_config, **overrides) -> HydraConfig:
    """Hydra's config with CLI overrides (num_heads, hidden_size, loss_decay)."""
    return HydraConfig(**overrides)


register_train_kind(TrainKind(name="medusa", module=heads_module, loss_fn=heads_loss, default_config=medusa_config,
                              eval_step=heads_eval_step))
register_train_kind(TrainKind(name="hydra", module=heads_module, loss_fn=heads_loss, default_config=hydra_config,
                              eval_step=heads_eval_step))
