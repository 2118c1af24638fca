"""EAGLE-3 (Li et al. 2025): a one-layer drafter that reads fused low / mid / high target features.

Input at position t: fc2([norm(emb(x_{t+1})); norm(g_t)]) with g_t = fc([f_low_t; f_mid_t; f_high_t])
(the target's hidden states of `feature_layers` after token t), then ONE llama decoder layer with its
own KV cache (the models' `forward` on a 1-layer ModelConfig), then its own head (the target's LM
head, or its columns for a trimmed draft vocabulary, plus a trained delta) predicting x_{t+2}.
Where the drafter runs ahead of the target (the tree), the feature of a node is the drafter's own
layer output at its parent ("training-time test": the model is trained on exactly that unroll).

Decode (the Drafter protocol): the drafter's cache holds one entry per committed position t whose
target feature is known, paired with token x_{t+1}; `init` fills it from the prefill's features.
`observe` only stores the committed slots' target features (`accepted_features`, side by side as fc
reads them) by position: fc and the layer run over them lazily, at the next `propose`, in blocks
(`catch_up_blocks`), so the adaptive policy's plain steps do not pay for a drafter they do not use (fc
on one token per plain step cost 9% of a plain sampling step at batch 1 on the CPU; over a block it is
one matmul). The last entry's output predicts the tree's first level; `propose` grows any tree through
the builders' `expand`, each level one forward that writes beyond the committed entries
(`write_offset`, an ancestor window mask), like DraftLM.

Params pytree (D = target hidden, F = len(feature_layers), M = draft vocabulary):
    fc [F*D, D]; fc2 [2D, D]; emb_norm/feat_norm/final_norm {scale [D]};
    layers: the 1-layer model's (attn_norm, mlp_norm, wq, wk, wv, wo, w_gate, w_up, w_down);
    head_delta [D, M]: head = target_head[:, draft_vocab] + head_delta (zero-init: starts at the target's)
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxdecode.drafters.builders import build_tree
from jaxdecode.drafters.draft_lm import catch_up_blocks, check_catch_up_sizes, draft_logprobs
from jaxdecode.models import ModelConfig, advance, forward, init_cache, padded_causal_mask
from jaxdecode.models import init_params as model_init_params
from jaxdecode.models import param_shapes as model_param_shapes
from jaxdecode.models.transformer import embed_rows, finish_logits, head_bias, logits_finish, rms_norm
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import FINAL, accepted_features
from jaxdecode.tree import ancestor_mask, depths

DEFAULT_TREE = "eagle:depth=6,topk=4,total=24"


class Eagle3Error(ValueError):
    """An EAGLE-3 config or input that cannot work."""


def default_feature_layers(num_layers: int) -> tuple:
    """Low / mid / high target layers (distinct, ascending): (1, L//2, L-1), layer 0 for L < 4."""
    if num_layers < 1:
        raise Eagle3Error(f"the target needs at least one layer, got {num_layers}")
    low = 1 if num_layers >= 4 else 0
    return tuple(dict.fromkeys((low, num_layers // 2, num_layers - 1)))


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """The drafter's shape (JSON-able; `default_config` fills it from the target)."""
    feature_layers: tuple  # target layer ids (0..L-1) and/or "final", fused by fc
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab: tuple = ()  # target token ids the drafter can propose, ascending; () = all of them
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    ttt_steps: int = 3  # training-time-test unroll length (training)
    ttt_decay: float = 0.8  # loss weight of unroll step i: ttt_decay ** i (training)
    tree: str = DEFAULT_TREE  # default tree spec at decode

    def __post_init__(self):
        fl = tuple(self.feature_layers)
        if not fl or any(i != FINAL and (isinstance(i, bool) or not isinstance(i, int) or i < 0) for i in fl):
            raise Eagle3Error(f"feature_layers must be a non-empty tuple of target layer ids (ints >= 0) "
                              f"and/or {FINAL!r}, got {self.feature_layers!r}")
        voc = tuple(int(t) for t in self.draft_vocab)
        if list(voc) != sorted(set(voc)) or (voc and voc[0] < 0):
            raise Eagle3Error("draft_vocab must hold distinct token ids >= 0 in ascending order "
                              "(use draft_vocab_from to build it)")
        for name in ("num_heads", "num_kv_heads", "head_dim", "intermediate_size", "ttt_steps"):
            if getattr(self, name) < 1:
                raise Eagle3Error(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise Eagle3Error(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                              f"({self.num_kv_heads})")
        if not 0 < self.ttt_decay <= 1:
            raise Eagle3Error(f"ttt_decay must be in (0, 1], got {self.ttt_decay}")
        object.__setattr__(self, "feature_layers", fl)
        object.__setattr__(self, "draft_vocab", voc)


def default_config(target_config: ModelConfig, **overrides) -> Eagle3Config:
    """An Eagle3Config for `target_config`: its attention shape, feature layers (1, L//2, L-1)."""
    kw = dict(feature_layers=default_feature_layers(target_config.num_layers),
              num_heads=target_config.num_heads, num_kv_heads=target_config.num_kv_heads,
              head_dim=target_config.head_dim, intermediate_size=target_config.intermediate_size,
              rope_theta=target_config.rope_theta if target_config.uses_rope else 10000.0,
              norm_eps=target_config.norm_eps)
    unknown = set(overrides) - {f.name for f in dataclasses.fields(Eagle3Config)}
    if unknown:
        raise Eagle3Error(f"unknown eagle3 option(s) {sorted(unknown)}; options: "
                          f"{[f.name for f in dataclasses.fields(Eagle3Config)]}")
    kw.update(overrides)
    return Eagle3Config(**kw)


def check_config(cfg: Eagle3Config, target_config: ModelConfig) -> None:
    """Eagle3Error unless cfg fits the target (feature layers it has, draft ids in its vocabulary)."""
    n = target_config.num_layers
    bad = [i for i in cfg.feature_layers if i != FINAL and i >= n]
    if bad:
        raise Eagle3Error(f"feature_layers {bad} are not layers of the {n}-layer target (0..{n - 1} or "
                          f"{FINAL!r})")
    if cfg.draft_vocab and cfg.draft_vocab[-1] >= target_config.vocab_size:
        raise Eagle3Error(f"draft_vocab holds id {cfg.draft_vocab[-1]}, outside the target's vocabulary "
                          f"of {target_config.vocab_size}")


def draft_vocab_size(cfg: Eagle3Config, target_config: ModelConfig) -> int:
    return len(cfg.draft_vocab) or target_config.vocab_size


def layer_config(cfg: Eagle3Config, target_config: ModelConfig) -> ModelConfig:
    """The drafter's decoder layer as a 1-layer llama ModelConfig (vocabulary = the draft vocabulary)."""
    return ModelConfig(model_type="llama", vocab_size=draft_vocab_size(cfg, target_config),
                       hidden_size=target_config.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_layers=1, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, max_position_embeddings=target_config.max_position_embeddings,
                       norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, sliding_windows=(0,),
                       tie_word_embeddings=False, dtype="float32")


def init_params(cfg: Eagle3Config, target_config: ModelConfig, key) -> dict:
    """Fresh drafter params: the layer as models.init_params makes it, fc / fc2 ~ N(0, 1/fan_in),
    unit norms, head_delta zero (the head starts as the target's)."""
    check_config(cfg, target_config)
    dcfg = layer_config(cfg, target_config)
    d, f = target_config.hidden_size, len(cfg.feature_layers)
    k_layer, k_fc, k_fc2 = jax.random.split(key, 3)
    base = model_init_params(dcfg, k_layer)
    ones = lambda: {"scale": jnp.ones((d,), jnp.float32)}  # noqa: E731
    return {"fc": jax.random.normal(k_fc, (f * d, d), jnp.float32) / math.sqrt(f * d),
            "fc2": jax.random.normal(k_fc2, (2 * d, d), jnp.float32) / math.sqrt(2 * d),
            "emb_norm": ones(), "feat_norm": ones(), "layers": base["layers"],
            "final_norm": base["final_norm"],
            "head_delta": jnp.zeros((d, dcfg.vocab_size), jnp.float32)}


def param_shapes(cfg: Eagle3Config, target_config: ModelConfig) -> dict:
    """Shape of every param (the loader checks saved drafters against it)."""
    dcfg = layer_config(cfg, target_config)
    d, f = target_config.hidden_size, len(cfg.feature_layers)
    model = model_param_shapes(dcfg)
    return {"fc": (f * d, d), "fc2": (2 * d, d), "emb_norm": {"scale": (d,)}, "feat_norm": {"scale": (d,)},
            "layers": model["layers"], "final_norm": model["final_norm"], "head_delta": (d, dcfg.vocab_size)}


# ----------------------------------------------------------------------------- pure pieces (shared with training)
def target_head(target_config: ModelConfig, target_params):
    """The target's LM head [D, V]."""
    return target_params["embed"].T if target_config.tie_word_embeddings else target_params["lm_head"]


def draft_head(params, base_head, draft_vocab: tuple):
    """The drafter's head [D, M]: the target head's draft-vocabulary columns + the trained delta."""
    if draft_vocab:
        base_head = jnp.take(base_head, jnp.asarray(draft_vocab, jnp.int32), axis=1)
    return base_head.astype(jnp.float32) + params["head_delta"]


def draft_head_bias(target_config: ModelConfig, target_params, draft_vocab: tuple):
    """The target head's bias over the draft vocabulary [M] (Phi-3.5-MoE), None where its head has none: the
    drafter's logits then get what the target's get for the same state."""
    bias = head_bias(target_config, target_params)
    if bias is None or not draft_vocab:
        return bias
    return jnp.take(bias, jnp.asarray(draft_vocab, jnp.int32))


def side_by_side(feats):
    """[f_1; ...; f_F]: feats [F, B, T, D] -> [B, T, F*D], column f*D + d feature f's dimension d (fc's
    rows). The activations are rearranged, not the weight (a reshaped weight is copied on every call)."""
    f, b, t, d = feats.shape
    return jnp.moveaxis(feats, 0, 2).reshape(b, t, f * d)


def fuse(params, x):
    """g = fc(x): x [B, T, F*D] (side_by_side) -> [B, T, D]."""
    w = params["fc"]  # [F*D, D]
    return x.astype(w.dtype) @ w


def fuse_features(params, feats):
    """g = fc([f_1; ...; f_F]): feats [F, B, T, D] -> [B, T, D]."""
    return fuse(params, side_by_side(feats))


def layer_inputs(params, eps: float, emb, feat):
    """fc2([norm(emb); norm(feat)]): emb, feat [B, T, D] -> [B, T, D]."""
    x = jnp.concatenate([rms_norm(emb.astype(jnp.float32), params["emb_norm"], eps),
                         rms_norm(feat.astype(jnp.float32), params["feat_norm"], eps)], axis=-1)
    return x @ params["fc2"]


def run_layer(dcfg: ModelConfig, params, head, x, positions, cache, mask, write_offset=None):
    """The decoder layer over input vectors x [B, T, D] with the drafter's cache: (h [B, T, D] the
    layer output before the final norm (what a child reads as its feature), logits [B, T, M], cache).
    `head` None skips the head (a [D, 1] stand-in: only the states are needed).

    models.forward embeds token ids; its table is swapped for the inputs themselves (row b*T + t is
    x[b, t], token id b*T + t), so the drafter runs the models' exact layer and cache code."""
    b, t, d = x.shape
    lm_head = jnp.zeros((d, 1), jnp.float32) if head is None else head
    fparams = {"embed": x.reshape(b * t, d), "layers": params["layers"], "final_norm": params["final_norm"],
               "lm_head": lm_head}
    ids = jnp.arange(b * t, dtype=jnp.int32).reshape(b, t)
    logits, hidden, cache = forward(dcfg, fparams, ids, positions, cache, mask, write_offset=write_offset,
                                    return_layers=(0,))
    return hidden["layers"][0], logits, cache


def head_logits(params, head, eps: float, h):
    """Logits [..., M] of layer outputs h [..., D] (the final norm, then the head)."""
    return rms_norm(h.astype(jnp.float32), params["final_norm"], eps) @ head


# ----------------------------------------------------------------------------- the drafter
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3State:
    cache: object  # the decoder layer's KV cache: entries t = 0 .. cache.lengths - 1
    root: jax.Array  # [B, D] the layer output of entry cache.lengths - 1 (zeros before any entry)
    # [B, cache_len + max_depth + 1, F*D] the target features after token t, side by side (unfused), by
    # position t: the entries the next propose fuses and runs (t >= cache.lengths) and older ones
    # (already in the cache, kept so positions stay fixed); the last max_depth + 1 are room for
    # observe's slice writes.
    features: jax.Array
    # f32[B, N, D] with record_sources: the layer state each node of the last proposal was drafted from
    # (its parent's output; the root's for depth-1 nodes): label runs of an acceptance head read them.
    sources: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3Drafter:
    params: dict  # the params pytree, with "head" [D, M] (target columns + delta) precomputed
    embed: jax.Array  # the target's token embedding [V, D]
    d2t: jax.Array | None  # int32[M]: draft id -> target id (None: the full vocabulary)
    layer_config: ModelConfig = dataclasses.field(metadata=dict(static=True))  # the 1-layer drafter
    builder: object = dataclasses.field(metadata=dict(static=True))
    feature_layers: tuple = dataclasses.field(metadata=dict(static=True))
    vocab_size: int = dataclasses.field(metadata=dict(static=True))  # the target's V
    # Held-out acceptance by depth from training (TrainedDrafter.make): the adaptive policy's start.
    acceptance_prior: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    # Catch-up block lengths (as DraftLM's): () = draft_lm.catch_up_widths(max_depth + 1).
    catch_up_sizes: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    # the target's logits_finish (Granite's scaling, Cohere's logit_scale, Gemma 2's soft-cap): drafts from its
    # distribution
    finish: tuple = dataclasses.field(default=(1.0, None), metadata=dict(static=True))
    # keep each proposal's node sources in the state (Eagle3State.sources; chains only)
    record_sources: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # the target's LM-head bias over the draft vocabulary [M] (Phi-3.5-MoE; None: none), added before the finish
    head_bias: jax.Array | None = None

    num_nodes = property(lambda self: self.builder.num_nodes)
    max_depth = property(lambda self: self.builder.max_depth)
    child_rule = property(lambda self: self.builder.rule)
    is_chain = property(lambda self: self.builder.is_chain)

    @classmethod
    def build(cls, params, cfg: Eagle3Config, target_config: ModelConfig, target_params, builder):
        """A drafter from trained params for a target (config + params: embedding and LM head)."""
        check_config(cfg, target_config)
        head = draft_head(params, target_head(target_config, target_params), cfg.draft_vocab)
        p = {k: v for k, v in params.items() if k != "head_delta"}
        d2t = jnp.asarray(cfg.draft_vocab, jnp.int32) if cfg.draft_vocab else None
        return cls(params={**p, "head": head}, embed=target_params["embed"], d2t=d2t,
                   layer_config=layer_config(cfg, target_config), builder=builder,
                   feature_layers=cfg.feature_layers, vocab_size=target_config.vocab_size,
                   finish=logits_finish(target_config),
                   head_bias=draft_head_bias(target_config, target_params, cfg.draft_vocab))

    @property
    def source_state_dim(self) -> int:
        """Width of `source_state`: the layer's hidden size."""
        return self.layer_config.hidden_size

    def source_state(self, scratch, d):
        """The layer state whose head gave chain position d's draft distribution, f32[B, D], from the
        tree builder's scratch (StoppingChainBuilder.source: an acceptance head reads it while the chain
        is drafted): node d's parent is node d - 1."""
        _, hbuf, root = scratch
        return _node_sources(hbuf, root, jnp.full((root.shape[0], 1), d - 1, jnp.int32))[:, 0]

    # pieces
    def _inputs(self, tokens, feat):
        emb = embed_rows(self.embed, tokens, jnp.float32)
        return layer_inputs(self.params, self.layer_config.norm_eps, emb, feat)

    def _logq(self, logits, sampler: SamplerConfig):
        """Draft log-probs over the target vocabulary (-inf outside the draft vocabulary)."""
        lp = draft_logprobs(finish_logits(logits, *self.finish, bias=self.head_bias), sampler)
        if self.d2t is None:
            return lp
        full = jnp.full(lp.shape[:-1] + (self.vocab_size,), -jnp.inf, lp.dtype)
        return full.at[..., self.d2t].set(lp)

    def _append(self, cache, tokens, fused, valid):
        """Commit entries (fused feature fused[:, j], token tokens[:, j]) for valid j (a prefix per
        row) after the cache's entries; returns (cache, layer outputs [B, T, D])."""
        x = self._inputs(jnp.where(valid, tokens, 0), fused)
        t = tokens.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        h, _, cache = run_layer(self.layer_config, self.params, None, x, positions, cache, padded_causal_mask(valid))
        return advance(cache, valid.sum(axis=1)), h

    def _catch_up(self, state: Eagle3State, ctx):
        """Run fc and the layer over the stored entries its cache lacks (t < hist_len - 1: the pending token
        is the last one paired), in padded blocks of up to max_depth + 1 (`catch_up_sizes`): (cache,
        root [B, D])."""
        hist_cap, buf_cap = ctx.history.shape[1], state.features.shape[1]

        def block(cache, catch):  # the feature buffer is only read: closed over, not carried
            t = cache.lengths[:, None] + jnp.arange(catch, dtype=jnp.int32)[None, :]  # [B, C] positions
            valid = t < (ctx.hist_len - 1)[:, None]
            tokens = jnp.take_along_axis(ctx.history, jnp.minimum(t + 1, hist_cap - 1), axis=1)  # x_{t+1}
            x = jnp.take_along_axis(state.features, jnp.minimum(t, buf_cap - 1)[..., None], axis=1)  # [B, C, F*D]
            cache, h = self._append(cache, tokens, fuse(self.params, x), valid)
            n_new = valid.sum(axis=1)
            return jnp.take_along_axis(h, jnp.maximum(n_new - 1, 0)[:, None, None], axis=1)[:, 0], cache

        root, cache = catch_up_blocks(block, state.cache, lambda c: c.lengths, ctx.hist_len - 1,
                                      state.root.shape[1], root=state.root,
                                      widths=check_catch_up_sizes(self.catch_up_sizes, self.max_depth))
        return cache, root.astype(state.root.dtype)

    def init(self, prompt_tokens, prompt_lengths, cache_len, key, features=None):
        if features is None:
            raise Eagle3Error("the eagle3 drafter reads the target's features: run it through "
                              "speculative_decode (it passes features= to init)")
        b, p = prompt_tokens.shape
        # Room: the committed entries, one catch-up block and the working tree beyond them.
        cache = init_cache(self.layer_config, b, cache_len + self.builder.working_size + self.max_depth + 1)
        # Lengths 0, computed from an input: with constant lengths XLA constant-folds the empty prefix's
        # attention at the batch size (minutes of compile time at 1e4 rows on CPU).
        cache = cache.replace(lengths=jnp.minimum(prompt_lengths, 0).astype(jnp.int32))
        # Entry t pairs the feature after token t with token t+1: t = 0 .. len-2.
        nxt = jnp.concatenate([prompt_tokens[:, 1:], jnp.zeros((b, 1), prompt_tokens.dtype)], axis=1)
        valid = jnp.arange(p)[None, :] < (prompt_lengths - 1)[:, None]
        x = side_by_side(features)  # [B, P, F*D]
        cache, h = self._append(cache, nxt, fuse(self.params, x), valid)
        root = jnp.take_along_axis(h, jnp.maximum(prompt_lengths - 2, 0)[:, None, None], axis=1)[:, 0]
        buf = jnp.zeros((b, max(cache_len, p) + self.max_depth + 1, x.shape[-1]), x.dtype).at[:, :p].set(x)
        sources = jnp.zeros((b, self.num_nodes, root.shape[-1]), jnp.float32) if self.record_sources else None
        return Eagle3State(cache=cache, root=jnp.where((prompt_lengths >= 2)[:, None], root, 0.0), features=buf,
                           sources=sources)

    def observe(self, state: Eagle3State, obs):
        """Store the committed slots' target features; fc and the layer run over them at the next propose."""
        feats, count = accepted_features(obs)  # [F, B, N+1, Dm]: slot j = state after token p0 + j
        feats = feats[:, :, :self.max_depth + 1]  # at most max_depth + 1 are ever committed
        m = feats.shape[2]
        x = side_by_side(feats).astype(state.features.dtype)  # [B, m, F*D]

        # Slot j is entry t = hist_len - count - 1 + j (paired with the committed token after it). Each
        # row's m entries from there are rewritten in place, those past `count` with what they held
        # (a slice update per row: a scatter cost a plain step 3% at batch 4 on the CPU). The buffer
        # has max_depth + 1 entries of room past the cache, so a slice is never shifted back.
        def write(buf, new, c, start):  # [T, F*D], [m, F*D], int32[], int32[]
            old = jax.lax.dynamic_slice_in_dim(buf, start, m, axis=0)
            return jax.lax.dynamic_update_slice_in_dim(buf, jnp.where((jnp.arange(m) < c)[:, None], new, old),
                                                       start, axis=0)

        start = jnp.maximum(obs.hist_len - count - 1, 0)
        return dataclasses.replace(state, features=jax.vmap(write)(state.features, x, count, start))

    def catch_up_lag(self, state: Eagle3State, hist_len):
        """int32[B]: stored entries the next proposal runs its layer over first (speculative.Drafter)."""
        return hist_len - 1 - state.cache.lengths

    def propose(self, state: Eagle3State, ctx, sampler: SamplerConfig):
        cache, root = self._catch_up(state, ctx)  # every committed entry: root predicts the first level
        eps, head = self.layer_config.norm_eps, self.params["head"]
        b, d = root.shape
        root_pos = cache.lengths - 1  # the newest entry's position; a depth-k node sits k after it
        logq_root = self._logq(head_logits(self.params, head, eps, root), sampler)

        def expand(scratch, start, tokens, parents_all):
            cache, hbuf, _ = scratch  # hbuf [B, W, D]: layer outputs of the working nodes
            f = tokens.shape[1]
            # dynamic slices: `start` may be traced (a builder whose levels run in a lax.while_loop)
            par = jax.lax.dynamic_slice_in_dim(parents_all, start, f, axis=1)  # [B, F]
            feat = _node_sources(hbuf, root, par).astype(hbuf.dtype)  # the parent's own output
            mask = jax.lax.dynamic_slice_in_dim(ancestor_mask(parents_all), start, f, axis=1)  # [B, F, W]
            node_depth = jax.lax.dynamic_slice_in_dim(depths(parents_all), start, f, axis=1)
            h, lg, cache = run_layer(self.layer_config, self.params, head, self._inputs(tokens, feat),
                                     root_pos[:, None] + node_depth, cache, mask,
                                     write_offset=jnp.full((b,), start, jnp.int32))
            hbuf = jax.lax.dynamic_update_slice_in_dim(hbuf, h.astype(hbuf.dtype), start, axis=1)
            return self._logq(lg, sampler), (cache, hbuf, root)

        hbuf = jnp.zeros((b, self.builder.working_size, d), root.dtype)
        tree, slots, (cache, hbuf, _) = build_tree(self.builder, ctx, (cache, hbuf, root), logq_root, expand, ctx.key)
        # The scratch cache: the tree's entries lie beyond its lengths (never attended), and keeping
        # the caught-up one would make XLA copy it before the tree writes.
        if self.record_sources and not self.is_chain:  # hbuf is by working index, a chain's alone is by node
            raise Eagle3Error("record_sources keeps the states of a chain's nodes: use tree='chain:K'")
        sources = _node_sources(hbuf, root, tree.parents) if self.record_sources else None
        return tree, slots, Eagle3State(cache=cache, root=root, features=state.features, sources=sources)


def _node_sources(hbuf, root, parents):
    """The layer state each node was drafted from, f32[B, N, D]: its parent's output (hbuf [B, W, D], by
    working index) or the root [B, D] for parents < 0."""
    par = jnp.take_along_axis(hbuf, jnp.maximum(parents, 0)[..., None], axis=1)
    return jnp.where((parents < 0)[..., None], root[:, None, :], par).astype(jnp.float32)


def make(params, cfg: Eagle3Config, target, tree=None, temperature: float = 0.0, **options):
    """DrafterKind.make: the EAGLE-3 drafter for `target` (a jaxdecode Model), any tree builder
    (default cfg.tree, EAGLE-2 dynamic)."""
    from jaxdecode.drafters import tree_from_option
    if options:
        raise Eagle3Error(f"the eagle3 drafter takes no drafter options, got {sorted(options)}")
    builder = tree_from_option(tree, cfg.tree, temperature)
    return Eagle3Drafter.build(params, cfg, target.config, target.params, builder)


def _register():
    from jaxdecode.drafters.trained import DrafterKind, register_kind
    register_kind(DrafterKind(name="eagle3", config_cls=Eagle3Config, make=make, param_shapes=param_shapes))


_register()

__all__ = ["Eagle3Config", "Eagle3Drafter", "Eagle3Error", "Eagle3State", "default_config", "default_feature_layers",
           "init_params", "param_shapes", "layer_config", "make", "side_by_side", "fuse", "fuse_features",
           "layer_inputs", "run_layer", "head_logits", "draft_head", "draft_head_bias", "target_head", "DEFAULT_TREE"]
