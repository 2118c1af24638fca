"""Training the EAGLE-3 drafter on a frozen target (decode side: jaxdecode.drafters.eagle3).

    module = eagle3_module(cfg, target_config, nnx.Rngs(0))        # cfg = default_config(target_config)
    loss, aux = eagle3_loss(module, {"tokens": int32[B, T], "mask": [B, T]}, {"target": target_params})

The module holds the decode params pytree as `nnx.Param`s (fc, fc2, norms, the 1-layer decoder
`layers`, head_delta) and runs the drafter's own pure pieces, so the trained state is the drafter's
params with no conversion. The target runs under stop_gradient; its embedding and LM head are frozen
(the drafter's head is the target head's draft-vocabulary columns plus the trained head_delta).

Training-time test (TTT). Entry t (t = 0..T-2) reads token x_{t+1} and a feature, and predicts x_{t+2}.
Step 0 reads the target's fused feature g_t. Step i > 0 reads, at t, the drafter's own step-(i-1)
output at t-1: position t is then the i-th drafted node of a chain rooted at the committed entry t-i.
Its attention sees what it would see at decode time: step-0 entries up to t-i (committed, real
features) and the step-j entry at t-(i-j) for j = 1..i (its drafted ancestors and itself).
Loss: sum_i ttt_decay^i * CE_i, CE_i the mean over positions with t >= i (a chain needs a real root),
x_{t+2} a scored token (mask) inside the draft vocabulary.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdecode.drafters.eagle3 import (Eagle3Config, default_config, draft_head, draft_head_bias, fuse_features,
                                       head_logits, init_params, layer_config, layer_inputs, target_head)
from jaxdecode.models import causal_mask, forward, rope_inv_freq
from jaxdecode.models.transformer import _layer, attention, finish_logits, logits_finish
from jaxdecode.speculative import feature_request, select_features


class Eagle3Module(nnx.Module):
    """The EAGLE-3 drafter's params as NNX params; `cfg` and the target's config ride along (static)."""

    def __init__(self, cfg: Eagle3Config, target_config, rngs: nnx.Rngs):
        if not isinstance(cfg, Eagle3Config):
            raise TypeError(f"Eagle3Module takes an Eagle3Config, got {type(cfg).__name__}")
        self.cfg = cfg
        self.target_config = target_config
        p = init_params(cfg, target_config, rngs.params())
        self.names = tuple(p)
        for name, value in p.items():
            setattr(self, name, nnx.data(jax.tree.map(nnx.Param, value)))

    def params(self) -> dict:
        """The decode params pytree (the same as nnx.to_pure_dict(nnx.state(self, nnx.Param)))."""
        return {name: jax.tree.map(lambda v: v[...], getattr(self, name),
                                   is_leaf=lambda x: isinstance(x, nnx.Variable)) for name in self.names}


def eagle3_module(cfg, target_config, rngs: nnx.Rngs) -> Eagle3Module:
    return Eagle3Module(cfg, target_config, rngs)


# ----------------------------------------------------------------------------- the unroll
def ttt_visible(step: int, s: int) -> np.ndarray:
    """Which keys a step-`step` query at position t sees: bool[S, (step+1)*S], key blocks by step.
    Block 0 (real features): positions u <= t - step; block j >= 1: only u = t - (step - j)."""
    t = np.arange(s)[:, None]
    u = np.arange(s)[None, :]
    blocks = [u <= t - step] + [u == t - (step - j) for j in range(1, step + 1)]
    return np.concatenate(blocks, axis=1)


def ttt_weights(cfg: Eagle3Config) -> jax.Array:
    """Loss weight of each unroll step: ttt_decay ** i, i = 0..ttt_steps-1."""
    return jnp.asarray(cfg.ttt_decay ** np.arange(cfg.ttt_steps), jnp.float32)


def ttt_hidden(dcfg, params, emb, g, steps: int):
    """The drafter's layer outputs over the TTT unroll: [steps, B, S, D].

    emb [B, S, D]: embeddings of x_{t+1}; g [B, S, D]: fused target features g_t. One layer call per
    step over S entries; a step's keys/values are kept for the later steps (no recomputation)."""
    b, s, _ = emb.shape
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    inv_freq = jnp.asarray(rope_inv_freq(dcfg))
    lp = jax.tree.map(lambda a: a[0], params["layers"])  # the single layer
    ks, vs, hs = [], [], []
    feat = g
    for i in range(steps):  # static unroll over the (few) TTT steps
        vis = jnp.broadcast_to(jnp.asarray(ttt_visible(i, s)), (b, s, (i + 1) * s))

        def attend(q, k, v, vis=vis):
            kk = jnp.concatenate(ks + [k], axis=1).transpose(0, 2, 1, 3)  # [B, KV, (i+1)S, hd]
            vv = jnp.concatenate(vs + [v], axis=1).transpose(0, 2, 1, 3)
            return attention(q, kk, vv, vis), (k, v)

        h, (k, v) = _layer(dcfg, layer_inputs(params, dcfg.norm_eps, emb, feat), lp, pos, inv_freq, attend)
        ks.append(k)
        vs.append(v)
        hs.append(h)
        feat = jnp.pad(h[:, :-1], ((0, 0), (1, 0), (0, 0)))  # position t reads the output at t-1
    return jnp.stack(hs)


def target_to_draft(cfg: Eagle3Config, vocab_size: int) -> np.ndarray:
    """int32[V]: the draft id of each target id, -1 outside the draft vocabulary."""
    if not cfg.draft_vocab:
        return np.arange(vocab_size, dtype=np.int32)
    t2d = np.full((vocab_size,), -1, np.int32)
    t2d[np.asarray(cfg.draft_vocab)] = np.arange(len(cfg.draft_vocab), dtype=np.int32)
    return t2d


def eagle3_outputs(module: Eagle3Module, batch, target_params):
    """(logits [K, B, T-1, M], labels [B, T-1] draft ids, weights [K, B, T-1]) of the TTT unroll."""
    cfg, tcfg = module.cfg, module.target_config
    tokens = jnp.asarray(batch["tokens"], jnp.int32)
    mask = jnp.asarray(batch["mask"], jnp.float32)
    b, t = tokens.shape
    if t < 3:
        raise ValueError(f"eagle3 training needs sequences of >= 3 tokens (entry t predicts x_(t+2)), got {t}")
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    _, hidden, _ = forward(tcfg, target_params, tokens, pos, None, causal_mask(b, t),
                           return_layers=feature_request(cfg.feature_layers))
    feats = jax.lax.stop_gradient(select_features(hidden, cfg.feature_layers))  # [F, B, T, D]
    embed = jax.lax.stop_gradient(target_params["embed"]).astype(jnp.float32)
    params = module.params()
    head = draft_head(params, jax.lax.stop_gradient(target_head(tcfg, target_params)), cfg.draft_vocab)
    dcfg = layer_config(cfg, tcfg)
    g = fuse_features(params, feats[:, :, :-1])  # entries t = 0..T-2
    hs = ttt_hidden(dcfg, params, jnp.take(embed, tokens[:, 1:], axis=0), g, cfg.ttt_steps)
    bias = jax.lax.stop_gradient(draft_head_bias(tcfg, target_params, cfg.draft_vocab))  # as decoding adds it
    logits = finish_logits(head_logits(params, head, dcfg.norm_eps, hs), *logits_finish(tcfg), bias=bias)  # [K,B,T-1,M]
    nxt2 = jnp.pad(tokens[:, 2:], ((0, 0), (0, 1)))  # x_{t+2} (entry T-2 has none)
    scored = jnp.pad(mask[:, 2:], ((0, 0), (0, 1)))
    labels = jnp.asarray(target_to_draft(cfg, tcfg.vocab_size))[nxt2]
    base = scored * (labels >= 0)
    rooted = (jnp.arange(t - 1)[None, :] >= jnp.arange(cfg.ttt_steps)[:, None])  # [K, T-1]: t >= i
    weights = base[None] * rooted[:, None, :]
    return logits, jnp.maximum(labels, 0), weights


def eagle3_loss(module: Eagle3Module, batch, constants):
    """Trainer form: (sum_i ttt_decay^i * CE_i, aux with ce_i / acc_i per step and scored tokens)."""
    logits, labels, weights = eagle3_outputs(module, batch, constants["target"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels[None])  # [K, B, T-1]
    hit = (jnp.argmax(logits, axis=-1) == labels[None]).astype(jnp.float32)
    n = jnp.maximum(weights.sum(axis=(1, 2)), 1.0)  # [K]
    ce_k = (ce * weights).sum(axis=(1, 2)) / n
    acc_k = (hit * weights).sum(axis=(1, 2)) / n
    aux = {"tokens": weights[0].sum()}
    for i in range(module.cfg.ttt_steps):
        aux[f"ce_{i}"] = ce_k[i]
        aux[f"acc_{i}"] = acc_k[i]
    return jnp.sum(ttt_weights(module.cfg) * ce_k), aux


def eagle3_eval_step(module: Eagle3Module, batch, constants):
    """Trainer eval form: (sum over scored positions of sum_i decay^i CE_i, step-0 scored positions)."""
    logits, labels, weights = eagle3_outputs(module, batch, constants["target"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels[None])
    return jnp.sum(ttt_weights(module.cfg) @ (ce * weights).sum(axis=(1, 2))), weights[0].sum()


def draft_vocab_from(tokens, size: int, keep=()) -> tuple:
    """The `size` most frequent ids of `tokens` (any int array of training text), plus `keep` (e.g.
    EOS ids), ascending: a trimmed draft vocabulary for Eagle3Config.draft_vocab. Ties: lower id."""
    tokens = np.asarray(tokens).ravel()
    keep = sorted({int(k) for k in keep})
    if size < len(keep) or size < 1:
        raise ValueError(f"draft vocabulary size {size} must be >= 1 and hold the {len(keep)} kept ids")
    counts = np.bincount(tokens, minlength=max(keep, default=0) + 1).astype(np.int64)
    counts[keep] = -1  # placed first below, whatever their counts
    order = np.lexsort((np.arange(len(counts)), -counts))
    rest = [int(i) for i in order if counts[i] > 0][: size - len(keep)]
    return tuple(sorted(set(keep) | set(rest)))


def eagle3_default_config(target_config, **overrides) -> Eagle3Config:
    """The kind's config for a target, with CLI overrides (any Eagle3Config field)."""
    return default_config(target_config, **overrides)


def resolve_draft_vocab(overrides: dict, target, corpus_dir) -> dict:
    """`draft_vocab=M` (an int, e.g. `jaxdecode train eagle3 --set draft_vocab=1024`) -> the M most frequent
    ids of the corpus's training split plus the target's EOS ids; a list of ids passes unchanged."""
    m = overrides.get("draft_vocab")
    if isinstance(m, bool) or not isinstance(m, int):
        return overrides
    vocab = target.config.vocab_size
    if not 1 <= m <= vocab:
        raise ValueError(f"draft_vocab={m}: a trimmed draft vocabulary holds 1..{vocab} ids (the target's "
                         f"vocabulary); give a size in that range, or a list of ids")
    from .corpus import Corpus
    keep = list(target.config.eos_token_ids)
    return {**overrides, "draft_vocab": draft_vocab_from(Corpus.open(corpus_dir).tokens("train"), m, keep=keep)}


def _register():
    from .drafters import TrainKind, register_train_kind
    register_train_kind(TrainKind(name="eagle3", module=eagle3_module, loss_fn=eagle3_loss,
                                  default_config=eagle3_default_config, eval_step=eagle3_eval_step,
                                  resolve_overrides=resolve_draft_vocab))


_register()

__all__ = ["Eagle3Module", "eagle3_module", "eagle3_loss", "eagle3_eval_step", "eagle3_outputs", "ttt_hidden",
           "ttt_visible", "ttt_weights", "target_to_draft", "draft_vocab_from", "eagle3_default_config",
           "resolve_draft_vocab"]
