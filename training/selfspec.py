"""Training Kangaroo's adapter on a frozen target (decode side: jaxdecode.drafters.selfspec).

    module = kangaroo_module(KangarooConfig(exit_layer=2), target_config, nnx.Rngs(0))
    loss, aux = kangaroo_loss(module, {"tokens": int32[B, T], "mask": [B, T]}, {"target": target_params})

The module's nnx.Param state is the decode params pytree {"layer": one target-shaped decoder layer}; the
draft network (the target's first l layers, the adapter, the target's final norm and LM head) is built
by the same pure `kangaroo_network` the drafter runs, with the target's weights under stop_gradient, so
only the adapter learns. Loss, over the real positions (mask): cross-entropy of the draft network's
next-token distribution against the target's (distillation: soft labels), plus hidden_weight * (1 -
cos) between the draft's final state and the target's (KangarooConfig.hidden_weight, 0 by default).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdecode.drafters.selfspec import KangarooConfig, init_adapter, kangaroo_network
from jaxdecode.models import causal_mask, forward

_is_param = lambda x: isinstance(x, nnx.Variable)  # noqa: E731


class KangarooModule(nnx.Module):
    """The adapter layer as NNX params; `cfg` and the target's config ride along (static)."""

    def __init__(self, cfg: KangarooConfig, target_config, rngs: nnx.Rngs):
        if not isinstance(cfg, KangarooConfig):
            raise TypeError(f"KangarooModule takes a KangarooConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.target_config = target_config
        self.layer = nnx.data(jax.tree.map(nnx.Param, init_adapter(cfg, target_config, rngs.params())["layer"]))

    def params(self) -> dict:
        """The decode params pytree (= nnx.to_pure_dict(nnx.state(self, nnx.Param)))."""
        return {"layer": jax.tree.map(lambda v: v[...], self.layer, is_leaf=_is_param)}


def kangaroo_module(cfg, target_config, rngs: nnx.Rngs) -> KangarooModule:
    return KangarooModule(cfg, target_config, rngs)


def kangaroo_outputs(module: KangarooModule, batch, target_params):
    """(draft logits, target logits f32[B, T, V], draft final state, target final state [B, T, D],
    weight f32[B, T]) over a batch of windows."""
    tcfg = module.target_config
    toks = jnp.asarray(batch["tokens"], jnp.int32)
    weight = jnp.asarray(batch["mask"], jnp.float32)
    b, t = toks.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    target_params = jax.lax.stop_gradient(target_params)
    logits_t, hid_t, _ = forward(tcfg, target_params, toks, pos, None, causal_mask(b, t))
    cfg_d, net = kangaroo_network(tcfg, target_params, module.cfg, module.params())
    logits_d, hid_d, _ = forward(cfg_d, net, toks, pos, None, causal_mask(b, t))
    return (logits_d, jax.lax.stop_gradient(logits_t), hid_d["final"].astype(jnp.float32),
            jax.lax.stop_gradient(hid_t["final"].astype(jnp.float32)), weight)


def _per_position(module, batch, constants):
    logits_d, logits_t, h_d, h_t, weight = kangaroo_outputs(module, batch, constants["target"])
    p_t = jax.nn.softmax(logits_t, axis=-1)
    ce = -jnp.sum(p_t * jax.nn.log_softmax(logits_d, axis=-1), axis=-1)  # [B, T]
    cos = jnp.sum(h_d * h_t, -1) / (jnp.linalg.norm(h_d, axis=-1) * jnp.linalg.norm(h_t, axis=-1) + 1e-6)
    loss = ce + module.cfg.hidden_weight * (1.0 - cos)
    hit = (jnp.argmax(logits_d, -1) == jnp.argmax(logits_t, -1)).astype(jnp.float32)
    return loss, ce, cos, hit, weight


def kangaroo_loss(module: KangarooModule, batch, constants):
    """Trainer form: (mean loss over real positions, aux {"tokens", "ce", "cos", "acc"}); acc = how
    often the draft's argmax is the target's (greedy acceptance of a one-token draft)."""
    loss, ce, cos, hit, w = _per_position(module, batch, constants)
    n = jnp.maximum(w.sum(), 1.0)
    mean = lambda x: jnp.sum(x * w) / n  # noqa: E731
    return mean(loss), {"tokens": w.sum(), "ce": mean(ce), "cos": mean(cos), "acc": mean(hit)}


def kangaroo_eval_step(module: KangarooModule, batch, constants):
    """Trainer eval form: (sum of the loss over real positions, their number)."""
    loss, _, _, _, w = _per_position(module, batch, constants)
    return jnp.sum(loss * w), jnp.sum(w)


def default_config(target_config, **overrides) -> KangarooConfig:
    """KangarooConfig with CLI overrides; exit_layer defaults to about a quarter of the depth (>= 1)."""
    overrides.setdefault("exit_layer", max(1, min(target_config.num_layers - 1, round(target_config.num_layers / 4))))
    return KangarooConfig(**overrides)


def _register():
    from .drafters import TrainKind, register_train_kind
    register_train_kind(TrainKind(name="kangaroo", module=kangaroo_module, loss_fn=kangaroo_loss,
                                  default_config=default_config, eval_step=kangaroo_eval_step))


_register()
