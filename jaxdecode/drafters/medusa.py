"""Medusa-1 and Hydra heads: K trained heads on the target's last hidden state draft a whole tree from
the verification's own features (zero extra target forwards, no draft KV cache).

Notation: h_t is the target's final hidden state after history token t (what the LM head reads; it
predicts x_{t+1}). Head k (k = 0..K-1 here, "head k+1" in the papers) predicts x_{t+k+2}:

- Medusa-1 (Cai et al. 2024): `z_k = h + SiLU(h W_k + b_k)`, W_k zero-initialised, so an untrained head
  is the LM head's next-token guess (shifted by k+1).
- Hydra (Ankner et al. 2024): head k also reads the embeddings of the tokens between t and its target,
  e_j = emb(x_{t+1+j}) for j = 0..k (x_{t+1} is the token the LM head itself produced):
  `z_k = h + SiLU(h A_k + sum_{j<=k} e_j E_{k,j} + c_k) O_k`, O_k zero-initialised. Sequentially
  dependent: a tree node's children come from the head of its depth fed that node's own path.

Both read out through the target's frozen LM head (tied, not copied: the drafter then holds only the
residual blocks, which keeps a shipped drafter a few MB where K vocabulary copies would not, and an
untrained drafter is exactly the LM head's guess). Embeddings are the target's frozen input embeddings.

Decoding. The drafter's state is the feature of the last verification's bonus slot: h_{t} with x_{t+1}
the pending root (from `init(features=...)` at position prompt_length - 2 for the first step; a zero
feature for one-token prompts, which only makes the first draft poor, never the output wrong). Head k
gives the distribution of the depth-(k+1) children, so the tree builders' `expand` returns, for each new
node at depth d, head d's distribution (Medusa: independent of the node; Hydra: conditioned on the
node's path, tracked per working node in the builder's scorer state). Any builder works (chain,
static top-k, EAGLE-2 dynamic, DySpec) up to depth K; the child rule is the builder's and the draft
probabilities per parent slot are exactly the distributions the children were drawn from.

The pure functions here (`medusa_hidden`, `hydra_hidden`, `head_logits`) are also what training runs
(jaxdecode.training.medusa): the NNX modules' `nnx.Param` state is this params pytree.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdecode.drafters.builders import build_tree
from jaxdecode.drafters.draft_lm import draft_logprobs
from jaxdecode.drafters.trained import DrafterKind, register_kind
from jaxdecode.models.transformer import embed_rows, finish_logits, head_bias, lm_logits, logits_finish
from jaxdecode.speculative import FINAL, accepted_features
from jaxdecode.tree import depths


class MedusaError(ValueError):
    """Heads that do not fit their target, their config or the requested tree."""


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    num_heads: int = 4  # K: drafts up to depth K
    loss_decay: float = 0.8  # training: head k (1-based) weighs loss_decay ** k

    def __post_init__(self):
        _check_common(self)


@dataclasses.dataclass(frozen=True)
class HydraConfig:
    num_heads: int = 4
    hidden_size: int = 0  # width of each head's MLP; 0 = the target's hidden size
    loss_decay: float = 0.8

    def __post_init__(self):
        _check_common(self)
        if isinstance(self.hidden_size, bool) or not isinstance(self.hidden_size, int) or self.hidden_size < 0:
            raise MedusaError(f"HydraConfig.hidden_size must be an int >= 0 (0 = the target's), "
                              f"got {self.hidden_size!r}")


def _check_common(cfg):
    name = type(cfg).__name__
    if isinstance(cfg.num_heads, bool) or not isinstance(cfg.num_heads, int) or cfg.num_heads < 1:
        raise MedusaError(f"{name}.num_heads must be an int >= 1, got {cfg.num_heads!r}")
    if not 0 < float(cfg.loss_decay) <= 1:
        raise MedusaError(f"{name}.loss_decay must be in (0, 1], got {cfg.loss_decay!r}")


def param_shapes(cfg, d: int) -> dict:
    """The params pytree's shapes for target hidden size d."""
    k = cfg.num_heads
    if isinstance(cfg, MedusaConfig):
        return {"w": (k, d, d), "b": (k, d)}
    m = cfg.hidden_size or d
    return {"w_h": (k, d, m), "w_e": (k, k, d, m), "b": (k, m), "w_out": (k, m, d)}


def init_params(cfg, d: int, key) -> dict:
    """Fresh heads: the residual branch's output weights zero, so every head starts as the LM head."""
    shapes = param_shapes(cfg, d)
    if isinstance(cfg, MedusaConfig):
        return {name: jnp.zeros(s, jnp.float32) for name, s in shapes.items()}
    k1, k2 = jax.random.split(key)
    return {"w_h": jax.random.normal(k1, shapes["w_h"], jnp.float32) / jnp.sqrt(d),
            "w_e": jax.random.normal(k2, shapes["w_e"], jnp.float32) / jnp.sqrt(d),
            "b": jnp.zeros(shapes["b"], jnp.float32), "w_out": jnp.zeros(shapes["w_out"], jnp.float32)}


def check_params(cfg, params, d: int) -> None:
    """Clear error unless `params` has exactly the shapes of `cfg` over a hidden size d."""
    want = param_shapes(cfg, d)
    try:
        got = {name: tuple(params[name].shape) for name in params}
    except (TypeError, AttributeError):
        raise MedusaError(f"{type(cfg).__name__} params must be a dict of arrays {want}, got "
                          f"{type(params).__name__}") from None
    if got != want:
        raise MedusaError(f"{type(cfg).__name__} params have shapes {got}, but num_heads="
                          f"{cfg.num_heads} over a target of hidden size {d} needs {want}")


# ----------------------------------------------------------------------------- the heads (pure)
def medusa_hidden(params, h):
    """Every head's input to the LM head: h [..., D] -> [..., K, D]."""
    pre = jnp.einsum("...d,kde->...ke", h, params["w"]) + params["b"]
    return h[..., None, :] + jax.nn.silu(pre)


def hydra_hidden(params, h, emb):
    """h [..., D], emb [..., K, D] (e_j = embedding of x_{t+1+j}) -> [..., K, D]; head k reads e_0..e_k."""
    k = params["w_e"].shape[0]
    causal = jnp.tril(jnp.ones((k, k), params["w_e"].dtype))  # [head, j]: j <= head
    pre = (jnp.einsum("...d,kdm->...km", h, params["w_h"])
           + jnp.einsum("...jd,kjdm,kj->...km", emb, params["w_e"], causal) + params["b"])
    return h[..., None, :] + jnp.einsum("...km,kmd->...kd", jax.nn.silu(pre), params["w_out"])


def hydra_head(params, h, emb, k):
    """Head k alone (a traced int32 scalar): hydra_hidden(params, h, emb)[..., k, :] at a K-th of its
    cost, for the usual case where every node a tree level expands sits at the same depth.
    h [..., D] (broadcast against emb's leading dims), emb [..., K, D] -> [..., D]."""
    pick = lambda w: jax.lax.dynamic_index_in_dim(w, k, keepdims=False)  # noqa: E731
    num = params["w_e"].shape[0]
    upto = (jnp.arange(num) <= k).astype(emb.dtype)[:, None]  # [K, 1]: e_j for j <= k
    pre = (jnp.einsum("...d,dm->...m", h, pick(params["w_h"]))
           + jnp.einsum("...jd,jdm->...m", emb * upto, pick(params["w_e"])) + pick(params["b"]))
    return h + jnp.einsum("...m,md->...d", jax.nn.silu(pre), pick(params["w_out"]))


def head_logits(x, embed, lm_head):
    """The target's LM head on x [..., D] -> f32[..., V]; lm_head [D, V], or None when tied to embed [V, D]."""
    return lm_logits(x, embed, lm_head)


def target_head(config, params):
    """(embed [V, D], lm_head [D, V] or None when the target ties them)."""
    return params["embed"], None if config.tie_word_embeddings else params["lm_head"]


# ----------------------------------------------------------------------------- the drafter
def _slice(x, start, f):
    """x[:, start:start+f] for a static or traced `start` (builders may run their levels in a loop)."""
    return jax.lax.dynamic_slice_in_dim(x, start, f, axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadsDrafter:
    """Medusa (cfg: MedusaConfig) or Hydra (cfg: HydraConfig) heads over any tree builder of depth <= K.

    State: f32[B, D], the bonus-slot feature of the last verification."""
    params: dict
    embed: jax.Array  # [V, D] the target's input embeddings (Hydra's token inputs; the tied LM head)
    lm_head: jax.Array | None  # [D, V], or None when the target ties it to embed
    cfg: object = dataclasses.field(metadata=dict(static=True))
    builder: object = dataclasses.field(metadata=dict(static=True))
    feature_layers: tuple = dataclasses.field(default=(FINAL,), metadata=dict(static=True))
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
    hydra = property(lambda self: isinstance(self.cfg, HydraConfig))

    def init(self, prompt_tokens, prompt_lengths, cache_len, key, features=None):
        if features is None:
            raise MedusaError("HeadsDrafter needs the target's features: run it through "
                              "speculative_decode, which passes them because feature_layers is set")
        b = prompt_tokens.shape[0]
        pos = prompt_lengths - 2  # h after the token before the pending root
        h = features[0, jnp.arange(b), jnp.maximum(pos, 0)]
        return jnp.where((pos >= 0)[:, None], h, 0.0)

    def _logq(self, x, sampler):
        logits = finish_logits(head_logits(x, self.embed, self.lm_head), *self.finish, bias=self.lm_head_bias)
        return draft_logprobs(logits, sampler)

    def propose(self, h, ctx, sampler):
        b, k = h.shape[0], self.cfg.num_heads
        rows = jnp.arange(b)
        if not self.hydra:
            logq = self._logq(medusa_hidden(self.params, h), sampler)  # [B, K, V]: every depth at once

            def expand(state, start, tokens, parents_all):
                d = _slice(depths(parents_all), start, tokens.shape[1])  # [B, F]
                return logq[rows[:, None], jnp.minimum(d, k - 1)], state  # children of depth d+1: head d

            tree, slots, _ = build_tree(self.builder, ctx, None, logq[:, 0], expand, ctx.key)
            return tree, slots, h

        pending = ctx.history[rows, ctx.hist_len - 1]
        e0 = embed_rows(self.embed, pending, jnp.float32)  # [B, D]

        def path_heads(path_tokens, head):
            """Head `head` [...] on each node's path: [x_{t+1}, path tokens...] -> logq [..., V]."""
            emb = embed_rows(self.embed, path_tokens[..., :k - 1], jnp.float32)
            lead = jnp.broadcast_to(e0.reshape((b,) + (1,) * (emb.ndim - 3) + e0.shape[-1:]),
                                    emb.shape[:-2] + e0.shape[-1:])
            emb = jnp.concatenate([lead[..., None, :], emb], axis=-2)  # [..., K, D]
            hb = h.reshape((b,) + (1,) * (emb.ndim - 3) + h.shape[-1:])
            first = head.reshape(-1)[0]

            def every_head(_):  # nodes of different depths in one call: all heads, each node picks its own
                z = hydra_hidden(self.params, hb, emb)  # [..., K, D]
                return jnp.take_along_axis(z, head[..., None, None], axis=-2)[..., 0, :]

            def one_head(_):  # a tree level: every node at one depth, so only that depth's head runs
                return jnp.broadcast_to(hydra_head(self.params, hb, emb, first), emb.shape[:-2] + h.shape[-1:])

            z = jax.lax.cond(jnp.all(head == first), one_head, every_head, None)
            return self._logq(z, sampler)

        work = getattr(self.builder, "working_size", self.builder.num_nodes)
        paths = jnp.zeros((b, work, k), jnp.int32)  # tokens at depths 1..K of each working node

        def expand(paths, start, tokens, parents_all):
            f = tokens.shape[1]
            par = _slice(parents_all, start, f)
            d = _slice(depths(parents_all), start, f)  # [B, F]
            own = jnp.take_along_axis(paths, jnp.maximum(par, 0)[..., None], axis=1)
            own = jnp.where((par >= 0)[..., None], own, 0)
            own = jnp.where(jnp.arange(k) == d[..., None] - 1, tokens[..., None], own)  # [B, F, K]
            paths = jax.lax.dynamic_update_slice_in_dim(paths, own, start, axis=1)
            return path_heads(own, jnp.minimum(d, k - 1)), paths

        root = path_heads(jnp.zeros((b, k), jnp.int32), jnp.zeros((b,), jnp.int32))
        tree, slots, _ = build_tree(self.builder, ctx, paths, root, expand, ctx.key)
        return tree, slots, h

    def observe(self, h, obs):
        feats, count = accepted_features(obs)  # [1, B, N+1, D]
        last = feats[0, jnp.arange(h.shape[0]), jnp.maximum(count - 1, 0)]
        return jnp.where((count > 0)[:, None], last, h)


def check_tree_depth(cfg, builder) -> None:
    """Clear error when the tree is deeper than the heads reach."""
    depth, k = builder.max_depth, cfg.num_heads
    if depth > k:
        raise MedusaError(
            f"the tree reaches depth {depth} but the drafter has {k} heads (head k drafts depth k): "
            f"use a tree of depth <= {k}, e.g. 'chain:{k}', 'eagle:depth={k},topk=4,total=16' or "
            f"'dyspec:num_nodes=16,topk=4,max_depth={k}'")


def default_tree(num_heads: int) -> str:
    """A static top-k tree of depth K (4 children at depth 1, then 2, 2, 1, ...)."""
    branching = ((4, 2, 2) + (1,) * num_heads)[:num_heads]
    return "static:" + ",".join(map(str, branching))


def make_heads_drafter(params, cfg, target, tree=None, temperature: float = 0.0, **kw) -> HeadsDrafter:
    """The drafter for `target` (a jaxdecode.Model) from trained head params; `tree`: a spec or a
    builder (default `default_tree(K)`)."""
    if kw:
        raise MedusaError(f"unknown {'hydra' if isinstance(cfg, HydraConfig) else 'medusa'} drafter options "
                          f"{sorted(kw)} (it takes none)")
    from jaxdecode.drafters import tree_from_option
    embed, lm_head = target_head(target.config, target.params)
    builder = tree_from_option(tree, default_tree(cfg.num_heads), temperature)
    check_tree_depth(cfg, builder)
    check_params(cfg, params, embed.shape[1])
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    return HeadsDrafter(params=params, embed=embed, lm_head=lm_head, cfg=cfg, builder=builder,
                        finish=logits_finish(target.config), lm_head_bias=head_bias(target.config, target.params))


def _param_shapes(cfg, target_config) -> dict:
    return param_shapes(cfg, target_config.hidden_size)


register_kind(DrafterKind(name="medusa", config_cls=MedusaConfig, make=make_heads_drafter,
                          param_shapes=_param_shapes))
register_kind(DrafterKind(name="hydra", config_cls=HydraConfig, make=make_heads_drafter,
                          param_shapes=_param_shapes))
