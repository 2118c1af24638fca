"""Acceptance head (SpecDec++; DSpark's confidence head): draft, and verify, only what is likely kept.

`AcceptHeadDrafter(inner, params, head_config, threshold)` wraps any chain drafter that gives draft
probabilities: a draft LM with tree="chain:K", or a trained drafter that reads the target's features
(EAGLE-3, Hydra, Medusa: `AcceptHeadConfig.inner` names the kind the head was trained over; DSpark puts
its confidence head on such a feature drafter). A tiny MLP predicts, for each draft position i, the
probability p_i that the target accepts token i given that tokens < i were accepted (the SpecDec++
convention). Drafting stops after the first position where the risk of a rejection so far,
1 - prod_{j<=i} p_j, exceeds the threshold h: that position is still verified, the ones after it are
marked invalid (tree.valid False). Consequences:

- h = 0 verifies one node per step, h = 1 all K.
- With `stop_drafting` (the default) the inner drafter's level loop (any drafter that drafts through its
  `builder` field and `build_tree`: draft LM, EAGLE-3, Hydra, Medusa) is a `lax.while_loop` that exits
  once every row has stopped, so the drafter does not pay for levels nobody verifies; without it the
  inner drafter drafts all K levels and only the verification shrinks.
- `verify_widths` (1, 2, 3, 4, 6, 8, ..., K: builders.chain_widths) lets the verification forward
  shrink to what is proposed.
- Invalid nodes are never accepted, so the output law does not change: greedy equals plain greedy and
  sampling verifiers stay lossless (tests/test_accept_head.py).

Inputs per position i, all known when token i is drafted: log q_i(token), log max q_i, the entropy of
q_i (q_i: the inner drafter's distribution the token came from), the depth i (one-hot), and optionally
the target's last hidden state at the "bonus slot" of the previous verification (the state whose
logits produced the pending root; `feature_layers=(FINAL,)`), projected to `target_proj` dims, and
optionally the inner drafter's own state that gave q_i (`drafter_proj`: EAGLE-3's layer output at the
position's parent, its `source_state`), projected to `drafter_proj` dims: known before token i is drawn,
so the cut of position i never depends on token i itself and the output law stays the target's.
A drafter of point masses has no q; one that labels its nodes with a confidence class of its own
(`Tree.classes`, `confidence_classes`: the retrieval drafter's match length) gives the head the class
one-hot instead of the three scalars (`AcceptHeadConfig.classes` = C > 0). Such a drafter's own cut
(`min_reach`) is turned off under the head: the head decides where the chain ends.

The params pytree is the training module's `nnx.Param` state as a pure dict (training/accept_head.py):
{"inp": {"kernel" [Din, H], "bias" [H]}, "out": {"kernel" [H, 1], "bias" [1]},
 "target": {"kernel" [D, P], "bias" [P]} (only with target_proj = P > 0),
 "drafter": {"kernel" [S, Q], "bias" [Q]} (only with drafter_proj = Q > 0; S = drafter_state_dim)},
Din = node_dim + max_depth + P + Q, node_dim = 3 (or C with classes).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxdecode.drafters.builders import ChainBuilder, StoppingChainBuilder, chain_widths
from jaxdecode.speculative import FINAL, SpeculativeError, accepted_features
from jaxdecode.tree import Tree

NUM_SCALARS = 3  # log q(token), log max q, entropy of q
_LOG_FLOOR = -20.0  # log q below this carries no more information (and keeps inputs bounded)
_P_CLIP = 1e-6  # p_i in [eps, 1 - eps]: h = 0 stops after one node, h = 1 never stops


@dataclasses.dataclass(frozen=True)
class AcceptHeadConfig:
    hidden: int = 32  # MLP width
    max_depth: int = 16  # draft positions the head knows (depth one-hot width); K must not exceed it
    target_proj: int = 0  # width of the projected target bonus-slot feature; 0 = not used
    threshold: float = 0.5  # default h: stop once 1 - prod p_i > h
    draft_len: int = 8  # K of the chain it was trained on: the default tree chain:K
    inner: str = "draft_lm"  # the drafter it was trained over: "draft_lm" or a trained kind (e.g. "eagle3")
    classes: int = 0  # > 0: per-node inputs are the one-hot of the drafter's confidence class (Tree.classes)
    # > 0: the inner drafter's own state that drafted each position (its `source_state`, e.g. EAGLE-3's layer
    # output), projected to drafter_proj dims; drafter_state_dim is that state's width (set by training)
    drafter_proj: int = 0
    drafter_state_dim: int = 0

    def __post_init__(self):
        if (self.hidden < 1 or self.max_depth < 1 or self.target_proj < 0 or not 1 <= self.draft_len
                or self.classes < 0 or self.drafter_proj < 0 or self.drafter_state_dim < 0):
            raise ValueError(f"AcceptHeadConfig needs hidden >= 1, max_depth >= 1, target_proj >= 0, "
                             f"draft_len >= 1, classes >= 0 and drafter_proj >= 0, got {self}")
        if self.drafter_proj and not self.drafter_state_dim:
            raise ValueError("AcceptHeadConfig.drafter_proj > 0 reads the inner drafter's states: "
                             "drafter_state_dim must give their width (training sets it from the drafter)")
        if not isinstance(self.inner, str) or not self.inner:
            raise ValueError(f"AcceptHeadConfig.inner names the drafter the head was trained over ('draft_lm' "
                             f"or a trained kind such as 'eagle3'), got {self.inner!r}")
        check_threshold(self.threshold)

    @property
    def node_dim(self) -> int:
        """Per-node inputs: the class one-hot, or the scalars of the drafter's distribution."""
        return self.classes or NUM_SCALARS

    @property
    def input_dim(self) -> int:
        return self.node_dim + self.max_depth + self.target_proj + self.drafter_proj


def check_threshold(h) -> float:
    h = float(h)
    if not 0.0 <= h <= 1.0:
        raise ValueError(f"the acceptance-head threshold h is a probability of rejection in [0, 1] "
                         f"(0: verify one node, 1: all), got {h}")
    return h


# ----------------------------------------------------------------------------- the head (pure)
def scalar_features(logq, tokens):
    """Cheap per-position inputs from the drafter's own distribution: logq [..., V] (log-probs the
    token was drafted from), tokens [...] -> f32[..., 3] = (log q(token), log max q, entropy)."""
    logq = jnp.maximum(logq.astype(jnp.float32), _LOG_FLOOR)
    tok = jnp.take_along_axis(logq, tokens[..., None], axis=-1)[..., 0]
    q = jnp.exp(logq)
    entropy = -jnp.sum(jnp.where(q > jnp.exp(_LOG_FLOOR), q * logq, 0.0), axis=-1)
    return jnp.stack([tok, logq.max(-1), entropy], axis=-1)


def chain_features(tree: Tree, slots):
    """scalar_features of every node of a chain: node i was drafted from its parent's slot (= i).
    tree tokens [B, K], slots f32[B, K+1, V] draft probabilities -> f32[B, K, 3]."""
    q = jnp.take_along_axis(slots, (tree.parents + 1)[..., None], axis=1)  # [B, K, V]
    return scalar_features(jnp.log(jnp.maximum(q, 1e-30)), tree.tokens)


def node_inputs(tree: Tree, slots, classes: int):
    """The head's per-node inputs f32[B, K, node_dim]: the one-hot of the node's confidence class when
    `classes` > 0 (a point-mass drafter that labels its nodes), else chain_features."""
    if not classes:
        return chain_features(tree, slots)
    if tree.classes is None:
        raise SpeculativeError("this acceptance head reads the drafter's confidence classes, but the drafter "
                               "proposed a tree without them (Tree.classes)")
    return jax.nn.one_hot(tree.classes, classes, dtype=jnp.float32)


def head_logits(params, cfg: AcceptHeadConfig, feats, depth, target_feat=None, drafter_state=None):
    """Logit of P(accept) per position. feats f32[B, K, node_dim], depth int32[K] (0 = first draft token),
    target_feat f32[B, D] (required iff cfg.target_proj), drafter_state f32[B, K, S] (the inner drafter's
    state per position; required iff cfg.drafter_proj) -> f32[B, K]."""
    b, k, _ = feats.shape
    parts = [feats, jnp.broadcast_to(jax.nn.one_hot(depth, cfg.max_depth), (b, k, cfg.max_depth))]
    if cfg.target_proj:
        t = target_feat.astype(jnp.float32) @ params["target"]["kernel"] + params["target"]["bias"]  # [B, P]
        parts.append(jnp.broadcast_to(jax.nn.silu(t)[:, None, :], (b, k, cfg.target_proj)))
    if cfg.drafter_proj:
        s = drafter_state.astype(jnp.float32) @ params["drafter"]["kernel"] + params["drafter"]["bias"]  # [B, K, Q]
        parts.append(jax.nn.silu(s))
    x = jnp.concatenate(parts, axis=-1)  # [B, K, Din]
    h = jax.nn.silu(x @ params["inp"]["kernel"] + params["inp"]["bias"])  # [B, K, H]
    return (h @ params["out"]["kernel"] + params["out"]["bias"])[..., 0]


def log_accept(logits):
    """log p_i, with p_i clipped to [eps, 1 - eps] (see _P_CLIP)."""
    return jnp.log(jnp.clip(jax.nn.sigmoid(logits), _P_CLIP, 1.0 - _P_CLIP))


def keep_mask(logits, threshold):
    """Which positions to verify: bool[B, K]. Position i is kept while the risk before it,
    1 - prod_{j<i} p_j, is <= h (position 0 always): the position that crosses h is the last one."""
    risk = 1.0 - jnp.exp(jnp.cumsum(log_accept(logits), axis=1))  # [B, K], non-decreasing in i
    before = jnp.concatenate([jnp.zeros_like(risk[:, :1]), risk[:, :-1]], axis=1)
    return before <= threshold


# ----------------------------------------------------------------------------- features of head + inner
def drafter_classes(drafter) -> int:
    """How many confidence classes `drafter` labels its nodes with (Tree.classes); 0 for none."""
    return int(getattr(drafter, "confidence_classes", 0) or 0)


def without_own_cut(drafter):
    """`drafter` with its own confidence cut (min_reach) off: under a head, the head ends the chain."""
    return dataclasses.replace(drafter, min_reach=0.0) if getattr(drafter, "min_reach", 0) > 0 else drafter


def head_feature_layers(inner, target_proj: int) -> tuple:
    """The target features a head over `inner` asks for: the inner drafter's own, then FINAL (the
    bonus-slot state) when the head projects it and the inner drafter does not read it already."""
    own = tuple(getattr(inner, "feature_layers", ()) or ())
    return own + ((FINAL,) if target_proj and FINAL not in own else ())


def inner_features(features, inner):
    """The inner drafter's slice of features f32[F, ...] asked for by head_feature_layers (its own come
    first); None when it reads none."""
    n = len(tuple(getattr(inner, "feature_layers", ()) or ()))
    return features[:n] if n and features is not None else None


def init_inner(inner, prompt_tokens, prompt_lengths, cache_len, key, features):
    """The inner drafter's init, handed its own slice of the head's features (none if it reads none)."""
    own = inner_features(features, inner)
    return inner.init(prompt_tokens, prompt_lengths, cache_len, key, **({} if own is None else {"features": own}))


def final_index(layers: tuple) -> int:
    """Where FINAL sits in a feature request."""
    return layers.index(FINAL)


def inner_observation(obs, inner):
    """obs with only the inner drafter's features (the head's FINAL may follow them)."""
    return dataclasses.replace(obs, features=inner_features(obs.features, inner))


# ----------------------------------------------------------------------------- the drafter
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AcceptHeadDrafter:
    """A chain drafter whose drafts are cut where the acceptance head's risk exceeds `threshold`."""
    inner: Any  # a chain drafter with draft probabilities (DraftLM with a ChainBuilder, ...)
    params: Any  # the head's params pytree
    threshold: jax.Array  # f32 scalar h (an array leaf: another h does not recompile)
    head_config: AcceptHeadConfig = dataclasses.field(metadata=dict(static=True))
    stop_drafting: bool = dataclasses.field(default=True, metadata=dict(static=True))

    num_nodes = property(lambda self: self.inner.num_nodes)
    max_depth = property(lambda self: self.inner.max_depth)
    child_rule = property(lambda self: self.inner.child_rule)
    is_chain = True
    builder = property(lambda self: getattr(self.inner, "builder", None))
    verify_widths = property(lambda self: chain_widths(self.num_nodes))

    @property
    def feature_layers(self) -> tuple:
        return head_feature_layers(self.inner, self.head_config.target_proj)

    @classmethod
    def wrap(cls, inner, params, head_config: AcceptHeadConfig, threshold=None, stop_drafting: bool = True):
        """Checked construction: `inner` must propose chains with draft probabilities."""
        if not getattr(inner, "is_chain", False):
            raise SpeculativeError("the acceptance head cuts chains: wrap a chain drafter (e.g. draft_lm "
                                   "or eagle3 with tree='chain:8'), not a branching tree")
        classes = drafter_classes(inner)
        if head_config.classes and classes != head_config.classes:
            raise SpeculativeError(f"this acceptance head reads {head_config.classes} confidence classes of the "
                                   f"drafter it was trained over ({head_config.inner!r}), but this drafter has "
                                   f"{classes}: wrap the drafter the head was trained with")
        if inner.child_rule == "point" and not head_config.classes:
            raise SpeculativeError("the acceptance head reads the drafter's probabilities, but this drafter "
                                   "proposes point masses: wrap a drafter with a distribution (draft_lm, "
                                   "eagle3, hydra, medusa), or train the head over its confidence classes "
                                   "(retrieval)")
        inner = without_own_cut(inner)  # the head decides where the chain ends (module docstring)
        if head_config.drafter_proj:
            inner = _with_sources(inner, head_config, stop_drafting)
        if inner.num_nodes > head_config.max_depth:
            raise SpeculativeError(f"this acceptance head knows draft positions 1..{head_config.max_depth}, "
                                   f"but the chain has {inner.num_nodes}: use tree='chain:"
                                   f"{head_config.max_depth}' or fewer, or train a head with a larger "
                                   f"max_depth")
        h = check_threshold(head_config.threshold if threshold is None else threshold)
        return cls(inner=inner, params=params, threshold=jnp.float32(h), head_config=head_config,
                   stop_drafting=stop_drafting)

    def _can_stop_early(self) -> bool:
        return self.stop_drafting and isinstance(self.builder, ChainBuilder) and hasattr(self.inner, "builder")

    def init(self, prompt_tokens, prompt_lengths, cache_len, key, features=None):
        inner = init_inner(self.inner, prompt_tokens, prompt_lengths, cache_len, key, features)
        if not self.head_config.target_proj:
            return inner, jnp.zeros((prompt_tokens.shape[0], 0), jnp.float32)
        return inner, prefill_bonus_feature(features, prompt_lengths, final_index(self.feature_layers))

    def propose(self, state, ctx, sampler):
        inner_state, tfeat = state
        cfg = self.head_config
        tf = tfeat if cfg.target_proj else None
        if self._can_stop_early():
            def stop(d, logq, tok, log_cum, source=None):  # source f32[B, S]: the drafter's state (drafter_proj)
                feats = scalar_features(logq, tok)[:, None, :]  # [B, 1, 3]
                ds = None if source is None else source[:, None, :]
                lg = head_logits(self.params, cfg, feats, jnp.full((1,), d, jnp.int32), tf, ds)[:, 0]
                log_cum = log_cum + log_accept(lg)
                return 1.0 - jnp.exp(log_cum) <= self.threshold, log_cum

            b = ctx.hist_len.shape[0]
            builder = StoppingChainBuilder(self.inner.builder, stop, jnp.zeros((b,), jnp.float32),
                                           self.inner.source_state if cfg.drafter_proj else None)
            inner = dataclasses.replace(self.inner, builder=builder)
            tree, slots, inner_state = inner.propose(inner_state, ctx, sampler)
        else:
            tree, slots, inner_state = self.inner.propose(inner_state, ctx, sampler)
            k = tree.tokens.shape[1]
            ds = inner_state.sources if cfg.drafter_proj else None  # recorded (_with_sources)
            lg = head_logits(self.params, cfg, node_inputs(tree, slots, cfg.classes), jnp.arange(k), tf, ds)
            tree = tree.replace(valid=tree.valid & keep_mask(lg, self.threshold))
        return tree, slots, (inner_state, tfeat)

    @property
    def catch_up_lag(self):
        """The inner drafter's catch_up_lag(state, hist_len) -> int32[B] over this drafter's state
        (speculative.Drafter), or None when the inner drafter keeps up: then calibration times no
        catch-up and the policy charges none, as for the inner drafter alone."""
        lag = getattr(self.inner, "catch_up_lag", None)
        if lag is None:
            return None
        return lambda state, hist_len: lag(state[0], hist_len)

    def idle(self, state, ctx):
        """A step without a proposal: the inner drafter's idle (a draft LM keeps its cache current)."""
        inner_state, tfeat = state
        inner_idle = getattr(self.inner, "idle", None)
        return (inner_state if inner_idle is None else inner_idle(inner_state, ctx)), tfeat

    def observe(self, state, obs):
        inner_state, tfeat = state
        inner_state = self.inner.observe(inner_state, inner_observation(obs, self.inner))
        if self.head_config.target_proj:
            tfeat = bonus_slot_feature(obs, tfeat, final_index(self.feature_layers))
        return inner_state, tfeat


def _with_sources(inner, cfg: AcceptHeadConfig, stop_drafting: bool):
    """`inner` checked for the states a drafter_proj head reads: `source_state` of cfg.drafter_state_dim
    (read while the chain is drafted), and with stop_drafting off, each proposal's states kept in its
    state (`record_sources`)."""
    width = getattr(inner, "source_state_dim", None)
    if width is None or not hasattr(inner, "source_state"):
        raise SpeculativeError(f"this acceptance head reads the states the {cfg.inner!r} drafter drafts from "
                               f"(drafter_proj), which this drafter does not give: wrap the drafter the head was "
                               f"trained with")
    if width != cfg.drafter_state_dim:
        raise SpeculativeError(f"this acceptance head reads drafter states {cfg.drafter_state_dim} wide, but this "
                               f"{cfg.inner!r} drafter's are {width}: wrap the drafter the head was trained with")
    if stop_drafting and isinstance(getattr(inner, "builder", None), ChainBuilder):
        return inner  # the head reads them as the chain is drafted (AcceptHeadDrafter._can_stop_early)
    if not hasattr(inner, "record_sources"):
        raise SpeculativeError(f"this acceptance head reads the {cfg.inner!r} drafter's states after the whole "
                               f"chain is drafted (stop_drafting=False), which this drafter cannot keep: leave "
                               f"stop_drafting on")
    return dataclasses.replace(inner, record_sources=True)


def prefill_bonus_feature(features, prompt_lengths, index: int = 0):
    """The state that produced the first pending root (the last prompt token), at position P-2 of the
    prefill's features f32[F, B, P, D] (feature `index` of F) -> f32[B, D] (zeros for a one-token
    prompt: there is none)."""
    pos = jnp.maximum(prompt_lengths - 2, 0)
    f = jnp.take_along_axis(features[index], pos[:, None, None], axis=1)[:, 0]
    return jnp.where((prompt_lengths >= 2)[:, None], f, 0.0)


def bonus_slot_feature(obs, previous, index: int = 0):
    """The target's FINAL state (feature `index` of obs.features) at the step's bonus slot, f32[B, D];
    `previous` for rows that committed nothing (inactive)."""
    feats, count = accepted_features(obs)  # [F, B, N+1, Dm]
    last = jnp.take_along_axis(feats[index], jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
    return jnp.where((count > 0)[:, None], last, previous)


# ----------------------------------------------------------------------------- trained kind
def param_shapes(cfg: AcceptHeadConfig, target_config) -> dict:
    shapes = {"inp": {"kernel": (cfg.input_dim, cfg.hidden), "bias": (cfg.hidden,)},
              "out": {"kernel": (cfg.hidden, 1), "bias": (1,)}}
    if cfg.target_proj:
        shapes["target"] = {"kernel": (target_config.hidden_size, cfg.target_proj), "bias": (cfg.target_proj,)}
    if cfg.drafter_proj:
        shapes["drafter"] = {"kernel": (cfg.drafter_state_dim, cfg.drafter_proj), "bias": (cfg.drafter_proj,)}
    return shapes


def make(params, cfg: AcceptHeadConfig, target, tree, temperature: float, draft_model=None, threshold=None,
         stop_drafting: bool = True, inner_dir=None):
    """DrafterKind.make: the head over the chain drafter it was trained with (cfg.inner), tree 'chain:K'
    (default K = cfg.draft_len).
    cfg.inner == "draft_lm": draft_model is the draft LM (a Model or its directory; by name:
    drafter_options={"draft_model": DIR}; default the embedded draft model).
    A trained kind (e.g. "eagle3"): inner_dir is its directory (drafter_options={"inner_dir": DIR};
    default <target_dir>/drafters/<kind>, the shipped one).
    threshold: h (default the config's). stop_drafting: end the inner drafter's level loop at the cut
    (default) or only shrink the verification."""
    from jaxdecode.drafters import make_drafter, tree_from_option
    from jaxdecode.drafters.draft_lm import DraftLM
    builder = tree_from_option(tree, f"chain:{min(cfg.draft_len, cfg.max_depth)}", temperature)
    if not isinstance(builder, ChainBuilder):
        raise SpeculativeError(f"the acceptance head cuts chains: use tree='chain:K' (K <= {cfg.max_depth}), "
                               f"got {tree!r}")
    if cfg.inner != "draft_lm":
        if draft_model is not None:
            raise SpeculativeError(f"this acceptance head was trained over the {cfg.inner!r} drafter, which "
                                   f"drafts without a draft LM: drop draft / draft_model (its directory, if "
                                   f"not the shipped one: drafter_options={{'inner_dir': DIR}})")
        try:
            inner = make_drafter(cfg.inner, target, tree=builder, temperature=temperature, drafter_dir=inner_dir)
        except ValueError as e:
            if inner_dir is not None or "needs its weights" not in str(e):
                raise
            raise ValueError(f"this acceptance head was trained over the {cfg.inner!r} drafter, whose directory "
                             f"is not found (not recorded beside the head, and none is shipped with the target): "
                             f"pass it as drafter_options={{'inner_dir': DIR}} (CLI: --option "
                             f"'drafter_options={{\"inner_dir\": \"DIR\"}}')") from None
        return AcceptHeadDrafter.wrap(inner, params, cfg, threshold, stop_drafting)
    if inner_dir is not None:
        raise SpeculativeError("this acceptance head was trained over a draft LM (inner 'draft_lm'): give the "
                               "draft model as draft= (drafter_options={'draft_model': DIR}), not inner_dir")
    draft = draft_model
    if draft is None:
        from jaxdecode.model import embedded_model_path
        draft = embedded_model_path("draft")
        if draft is None:
            raise ValueError("the acceptance head drafts with a draft LM: pass the one it was trained with "
                             "as drafter_options={'draft_model': DIR} (or a jaxdecode Model)")
    if isinstance(draft, (str, bytes)) or hasattr(draft, "__fspath__"):
        import jaxdecode
        draft = jaxdecode.load(draft)
    if draft.config.vocab_size != target.config.vocab_size:
        raise SpeculativeError(f"the draft model's vocabulary ({draft.config.vocab_size}) differs from the "
                               f"target's ({target.config.vocab_size})")
    inner = DraftLM(params=draft.params, config=draft.config, builder=builder)
    return AcceptHeadDrafter.wrap(inner, params, cfg, threshold, stop_drafting)


def default_options(extra: dict, path) -> dict:
    """The inner drafter's directory as training recorded it (`inner_dir_relative`: from the head's own
    directory, so the two can move together; else `inner_dir` as given), when it exists."""
    import os
    candidates = []
    if path is not None and isinstance(extra.get("inner_dir_relative"), str):
        candidates.append(os.path.join(path, extra["inner_dir_relative"]))
    if isinstance(extra.get("inner_dir"), str) and extra["inner_dir"] != "shipped":
        candidates.append(extra["inner_dir"])
    found = next((c for c in candidates if os.path.isfile(os.path.join(c, "config.json"))), None)
    return {} if found is None else {"inner_dir": os.path.normpath(found)}


def _register():
    from jaxdecode.drafters.trained import DrafterKind, register_kind
    # The head reads the target's hidden states only with target_proj; the vocabulary must match the
    # draft LM's (checked in make), so the target fields are the ones the projection needs.
    return register_kind(DrafterKind(name="accept_head", config_cls=AcceptHeadConfig, make=make,
                                     target_fields=("vocab_size", "hidden_size"), param_shapes=param_shapes,
                                     default_options=default_options))


KIND = _register()
