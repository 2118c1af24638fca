"""Speculative decoding: one jit-compiled loop draft -> verify -> commit, from three chosen parts.

    speculative_decode(config, params, drafter, prompt_tokens[B,P], prompt_lengths[B], *,
                       max_new_tokens, verifier, sampler, eos_ids, key) -> SpecOutput

- A **drafter** (a pytree dataclass: its arrays are leaves, its configuration static) proposes a token
  tree per row, with draft distributions per parent slot or as point masses, and learns from each
  verification (`observe`). Draft LMs, n-gram/recycling tables and heads are all drafters; a draft LM
  composes with any tree builder (jaxdecode.drafters).
- The **verifier** (jaxdecode.verifiers) decides the accepted path and the bonus token.
- The engine keeps one invariant: the target cache holds every committed token except the newest
  ("pending") one. Each step runs the target once over [pending, tree nodes] with the tree's ancestor
  mask, so slot 0 of the logits is the root's next-token distribution and slot i+1 the one after node
  i (the parent-slot convention of jaxdecode.tree); `commit` then keeps [pending, accepted path].

- With `constraint=` (a regex / JSON-schema / grammar constraint with per-row states), the output is
  the constrained decode's: drafters draft under the mask (drafters.builders.build_tree), every node's
  constraint state follows from its parent's and forbidden nodes are pruned (`constrain_tree`), the
  target is masked per node before the verifier sees it, and the state after the accepted path and
  the bonus is carried to the next step.

Rows accept different lengths; a finished row (EOS or max_new_tokens) stops committing. Stats: tau
(tokens per verification call, counting the bonus), target calls (incl. the prefill), the accepted-
length histogram (per row) and the acceptance rate per tree depth (over the batch), both over committed
nodes (`_acceptance_stats`). Per row: tau, verify_calls, accept_hist, nonfinite_logits (adaptive: also
drafted_nodes, speculative_steps); batch-wide: target_calls, accept_rate_by_depth, width_hist,
policy_widths.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxdecode import adaptive as adaptive_mod
from jaxdecode import streaming
from jaxdecode.autoregressive import (default_cache_len, is_eos, nonfinite_rows, pad_id_for, prefill,
                                      validate_eos_ids, validate_prompts)
from jaxdecode.models import advance, commit, forward, init_cache, split_layers, with_embed_words
from jaxdecode.sampling import SamplerConfig, first_argmax, process_logits, sample
from jaxdecode.scoring import LogprobRecord, check_logprob_flags, token_logprobs
from jaxdecode.sharding import check_auto_axes, under_auto_mesh
from jaxdecode.tree import (Tree, allowed_slots, ancestor_mask, broadcast_slots, complete_slots, constrain_tree,
                            depths, mask_logits, mask_probs, path_to_keep, slot_gather)
from jaxdecode.verifiers import CHILD_RULES, VERIFIERS, VerifyResult, check_tree_kind, get_verifier


class SpeculativeError(ValueError):
    """A drafter / tree / verifier combination or option that cannot decode as asked."""


# ----------------------------------------------------------------------------- protocol
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftContext:
    """What a drafter sees: every committed token so far, the pending one last."""
    history: jax.Array  # int32[B, H]: prompt + committed output
    hist_len: jax.Array  # int32[B]: valid tokens in history; history[hist_len-1] is pending
    key: jax.Array
    # With constraint= decoding: the constraint and the rows' states after the pending token. Drafters
    # draft under it through drafters.builders.build_tree; the engine prunes what they propose anyway.
    constraint: Any = None
    cstate: Any = None
    # int32[B] or None: the nodes the adaptive policy will verify at most in each row this step, chosen
    # before drafting (from past acceptance only, never from this step's tokens). A `level_capped`
    # drafter drafts no more chain levels than that; the others ignore it (the engine trims anyway).
    max_nodes: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Observation:
    """What a drafter learns after a verification (Token Recycling, ADED, draft-model upkeep). N is the
    verified tree's node count: the drafter's own, or 0 for the plain steps of the adaptive engine's lean
    runs (no tree: slot 0, the root, is all there is), so observe must read N from the arrays."""
    tree: Tree
    path: jax.Array  # int32[B, N] accepted node indices, -1 padded
    num_accepted: jax.Array  # int32[B]
    bonus: jax.Array  # int32[B]
    target_logits: jax.Array  # f32[B, N+1, V] raw target logits per parent slot
    history: jax.Array  # after the commit
    hist_len: jax.Array
    active: jax.Array  # bool[B]: rows that were still decoding this step
    # f32[F, B, N+1, D]: the target's hidden states of the drafter's `feature_layers` per slot (slot 0
    # the pending root, slot i+1 node i), from the verification forward itself; None for drafters
    # without feature_layers. `accepted_features` picks the committed ones.
    features: jax.Array | None = None
    # int32[B]: tokens committed this step (path + bonus, fewer when EOS or max_new_tokens cut the
    # row; 0 for inactive rows): history[hist_len - committed:hist_len] are the new ones.
    committed: jax.Array | None = None


class Drafter(Protocol):
    """What a drafter implements (a pytree dataclass; see jaxdecode/drafters for examples).

    Required: num_nodes, max_depth, child_rule, init, propose, observe. Optional attributes:
    is_chain (default False), verify_widths (see speculative_decode), feature_layers (default ()),
    acceptance_prior (default (): the adaptive policy's greedy estimates start at its flat prior; else
    per depth 1, 2, ... the rate at which the target accepted the drafter's node given its parent, as
    measured on held-out text: trained drafters carry what their training measured), idle (run on the
    adaptive policy's plain steps, to keep the drafter's state current), history_only (default False:
    True declares that `observe` is the identity and there is no `idle` — the drafter reads all it
    needs from the history when it proposes — so the engine's plain runs (AdaptivePolicy.plain_run)
    never call the drafter), level_capped (default
    False: True declares a chain drafter whose `propose` drafts at most DraftContext.max_nodes[b]
    levels in row b when it is set, each level costing a draft step; the adaptive policy then sets it
    before drafting and prices a draft of w nodes at what w levels cost, the cost table's
    draft_by_width, instead of the whole chain), source_state / source_state_dim (a chain drafter's own
    state that gave position d's distribution, read from its tree builder's scratch:
    `source_state(scratch, d) -> f32[B, S]`; an acceptance head with drafter_proj reads it while the chain
    is drafted, drafters.builders.StoppingChainBuilder's `source`; EAGLE-3 gives it), catch_up_lag (a
    drafter that catches up lazily on what was committed since its last proposal, as a draft LM does:
    `catch_up_lag(state, hist_len) -> int32[B]`, the tokens its next proposal runs over first; the
    adaptive policy scores a return to drafting with it, the cost table's catch_up_seconds).

    feature_layers: target hidden states the drafter reads, a static tuple of layer ids (0..L-1: the
    output of that decoder layer) and/or FINAL (the last hidden state after the final norm, what the
    LM head reads). When non-empty, `init` gets `features=` f32[F, B, P, D] from the prefill (position
    t holds the state after prompt token t, valid for t < prompt_length - 1: the last prompt token is
    the first pending root, which the first verification runs), and every Observation carries the
    verification forward's states (`Observation.features`): a feature drafter never runs the target.
    """
    num_nodes: int  # N, static tree size
    max_depth: int  # deepest node of any proposed tree
    child_rule: str  # how children were chosen: one of jaxdecode.verifiers.CHILD_RULES
    is_chain: bool  # every proposal is a chain (no node has two children); absent = False

    def init(self, prompt_tokens, prompt_lengths, cache_len: int, key) -> Any: ...  # (+ features=...)

    def propose(self, state, ctx: DraftContext, sampler: SamplerConfig) -> tuple[Tree, Any, Any]: ...

    def observe(self, state, obs: Observation) -> Any: ...


FINAL = "final"  # in Drafter.feature_layers: the target's last hidden state (after the final norm)


def feature_request(feature_layers) -> tuple:
    """The decoder-layer ids a drafter's feature_layers ask the target forward to return."""
    return tuple(sorted({int(i) for i in feature_layers if i != FINAL}))


def check_feature_layers(config, feature_layers) -> tuple:
    """Validate a drafter's feature_layers against the target config; a clear error otherwise."""
    fl = tuple(feature_layers or ())
    bad = [i for i in fl if i != FINAL and (isinstance(i, bool) or not isinstance(i, int)
                                           or not 0 <= i < config.num_layers)]
    if bad:
        raise SpeculativeError(
            f"the drafter reads target layers {bad}, but the target has {config.num_layers} layers "
            f"(0..{config.num_layers - 1}, or {FINAL!r}): was the drafter built for another target?")
    return fl


def select_features(hidden: dict, feature_layers: tuple):
    """The forward's hidden states of `feature_layers`, stacked: f32[F, B, T, D] (None when empty)."""
    if not feature_layers:
        return None
    ids = feature_request(feature_layers)
    return jnp.stack([hidden["final"] if i == FINAL else hidden["layers"][ids.index(i)]
                      for i in feature_layers]).astype(jnp.float32)


def accepted_features(obs: Observation):
    """The committed slots' features in order: f32[F, B, N+1, Dm] for [root, accepted nodes...] (at most
    max_depth + 1 are ever valid: a drafter may slice them off before heavy work on them), and
    int32[B] how many are valid (obs.committed: num_accepted + 1 unless EOS / max_new_tokens cut the
    row; 0 for inactive rows). Slot j holds the state after history token
    hist_len - committed - 1 + j (the pending root is j = 0), the one that predicted the step's
    committed token j; the last valid one is the "bonus slot" (its logits produced the newest token)."""
    slots = jnp.concatenate([jnp.zeros((obs.path.shape[0], 1), obs.path.dtype), obs.path + 1], axis=1)  # [B, N+1]
    slots = jnp.where(slots > 0, slots, 0)
    feats = jnp.take_along_axis(obs.features, slots[None, :, :, None], axis=2)
    count = obs.committed if obs.committed is not None else jnp.where(obs.active, obs.num_accepted + 1, 0)
    return feats, count


# ----------------------------------------------------------------------------- state and output
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecOutput:
    tokens: jax.Array  # int32[B, max_new_tokens], pad after each row's length
    lengths: jax.Array  # int32[B]
    stats: dict


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _SpecState:
    cache: Any
    drafter_state: Any
    history: jax.Array
    hist_len: jax.Array
    num_new: jax.Array  # int32[B]
    done: jax.Array  # bool[B]
    key: jax.Array
    target_calls: jax.Array  # int32 scalar (incl. prefill)
    steps: jax.Array  # int32[B]: verification calls while the row was active
    accept_hist: jax.Array  # int32[B, D+1]: per row, its active steps that committed 0..D draft nodes
    depth_tried: jax.Array  # int32[D]: row-steps whose node at depth d-1 had a child (_acceptance_stats)
    depth_accepted: jax.Array  # int32[D]: row-steps that committed a node at depth d
    nonfinite: jax.Array  # bool[B]: target logits NaN/inf at the root or a valid node while active
    # Adaptive speculation only (None otherwise): the policy's estimates and what it chose.
    policy_state: Any = None  # adaptive.PolicyState
    drafted_nodes: jax.Array | None = None  # int32[B]: draft nodes verified while active
    speculative_steps: jax.Array | None = None  # int32[B]: active steps that verified >= 1 node
    width_hist: jax.Array | None = None  # int32[W]: steps per verification width (policy.widths)
    cstate: Any = None  # the constraint's per-row state after the pending token (constraint= only)
    # logprobs=True only: the target's log-probs of the committed tokens, per output column (+ D + 1
    # scratch columns: a step writes its D + 1 columns from the row's num_new on).
    logprobs: LogprobRecord | None = None

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


def _with_root(tree: Tree, pending, prefix_len):
    """Verification inputs over [pending, nodes]: tokens, positions, mask [B, N+1, N+1]."""
    b, n = tree.tokens.shape
    if n == 0:  # a plain decoding step (adaptive speculation off): the pending token alone
        return pending[:, None], prefix_len[:, None], jnp.ones((b, 1, 1), bool)
    tokens = jnp.concatenate([pending[:, None], tree.tokens], axis=1)
    node_mask = ancestor_mask(tree.parents) & tree.valid[:, None, :] & tree.valid[:, :, None]
    mask = jnp.zeros((b, n + 1, n + 1), bool)
    mask = mask.at[:, :, 0].set(True)  # everyone sees the root
    mask = mask.at[:, 1:, 1:].set(node_mask)
    # Invalid nodes see only the root (their outputs are ignored; this keeps softmax rows non-empty).
    positions = jnp.concatenate(
        [prefix_len[:, None], prefix_len[:, None] + jnp.where(tree.valid, depths(tree.parents), 1)], axis=1)
    return tokens, positions, mask


def _write_rows(history, tokens, start):
    """history int32[B, H] with each row's tokens [B, k] written from its column start[B]
    (dynamic_update_slice per row: faster than a scatter on CPU)."""
    return jax.vmap(lambda h, t, at: jax.lax.dynamic_update_slice(h, t, (at,)))(history, tokens, start)


def run_if(pred, fn, operand):
    """`fn(operand)` when the traced bool `pred` holds, else `operand`; fn returns the operand's structure.
    Unlike lax.cond this updates the operand's buffers in place: XLA copies large operands (a KV cache)
    into a conditional's branches, but aliases a while loop's carry, so this is a loop of 0 or 1 trips."""
    return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.zeros_like(c[0]), fn(c[1])),
                              (jnp.asarray(pred, bool), operand))[1]


def switch_in_place(index, branches, operand):
    """lax.switch(index, branches, operand) (index clamped) for branches that return the operand's
    structure, with the operand updated in place (see `run_if`): exactly one branch runs."""
    index = jnp.clip(index, 0, len(branches) - 1)
    for i, branch in enumerate(branches):
        operand = run_if(index == i, branch, operand)
    return operand


def _verify_forward(config, params, tree: Tree, pending, cache, active, widths: tuple, attn_impl: str,
                    mesh=None, feature_layers: tuple = (), judge=None):
    """The target over [pending, tree nodes]: logits [B, N+1, V], the drafter's features
    [F, B, N+1, D] (None without feature_layers) and the cache with them written; with `judge`, also
    its verdict.

    widths: ascending static node counts, the last = N. The forward runs over the smallest width that
    holds every valid node of the active rows (a `lax.switch`, each branch compiled once), so a drafter
    that marks the tail of its proposal invalid (a weak match, a low-confidence draft) pays only for
    what it proposes. Logit rows past the width are zero: they belong to invalid nodes, which no
    verifier accepts and no drafter learns from. Nodes are topologically ordered, so every kept node's
    ancestors lie inside the width. The switch is `switch_in_place`: the cache is written in place,
    never copied into a branch.
    judge(logits [B, w+1, V], nodes): the verdict (a VerifyResult over those w nodes) on the branch's
    own width, so what follows the forward (processing the target's distribution, the verifier) also
    costs only what was verified; its path is padded to N with -1."""
    n = tree.tokens.shape[1]

    def run(width):
        def branch(carry):
            cache = carry[2]
            t = Tree(tokens=tree.tokens[:, :width], parents=tree.parents[:, :width], valid=tree.valid[:, :width])
            tokens, positions, mask = _with_root(t, pending, cache.lengths)
            # The pending token alone is a plain decoding step: its attention is `decode`'s, so it
            # costs and computes what plain decoding does (with the tree kernel, an H200 ran the adaptive
            # default at 0.73x plain sampling, with decode's attention at 0.82x).
            impl = "xla" if width == 0 else attn_impl
            logits, hidden, cache = forward(config, params, tokens, positions, cache, mask, attn_impl=impl,
                                            mesh=mesh, return_layers=feature_request(feature_layers))
            feats = select_features(hidden, feature_layers)
            if feats is not None:
                feats = jnp.pad(feats, ((0, 0), (0, 0), (0, n - width), (0, 0)))
            out = (jnp.pad(logits, ((0, 0), (0, n - width), (0, 0))), feats, cache)
            if judge is None:
                return out
            res = judge(logits, t)
            path = jnp.pad(res.path, ((0, 0), (0, n - width)), constant_values=-1)
            return out + (dataclasses.replace(res, path=path),)
        return branch

    if len(widths) == 1:
        return run(n)((None, None, cache))
    idx = jnp.arange(n)[None, :]
    need = jnp.max(jnp.where(tree.valid & active[:, None], idx + 1, 0))  # nodes the forward must cover
    which = jnp.searchsorted(jnp.asarray(widths), need)  # smallest width >= need
    b = tree.tokens.shape[0]
    logits0 = jnp.zeros((b, n + 1, config.vocab_size), jnp.float32)
    feats0 = (jnp.zeros((len(feature_layers), b, n + 1, config.hidden_size), jnp.float32)
              if feature_layers else None)
    operand = (logits0, feats0, cache)
    if judge is not None:
        operand += (VerifyResult(path=jnp.full((b, n), -1, jnp.int32), num_accepted=jnp.zeros((b,), jnp.int32),
                                 bonus=jnp.zeros((b,), jnp.int32)),)
    return switch_in_place(which, [run(w) for w in widths], operand)


def check_verify_widths(widths, num_nodes: int) -> tuple:
    """Normalise `verify_widths` (node counts a verification may use) to an ascending tuple ending at N."""
    if widths is None:
        return (num_nodes,)
    if isinstance(widths, (str, bytes)) or any(isinstance(w, bool) for w in widths):
        raise SpeculativeError(f"verify_widths must be a list of ints, got {widths!r}")
    try:
        ws = sorted({int(w) for w in widths})
    except (TypeError, ValueError):
        raise SpeculativeError(f"verify_widths must be a list of ints, got {widths!r}") from None
    if not ws or ws[0] < 1 or ws[-1] > num_nodes:
        raise SpeculativeError(f"verify_widths must be node counts in 1..{num_nodes} (the drafter's tree "
                               f"size), got {list(widths)!r}")
    return tuple(ws) if ws[-1] == num_nodes else tuple(ws) + (num_nodes,)


def _acceptance_stats(tree: Tree, path, num_accepted, committed, active, max_depth: int):
    """One step's acceptance over the active rows: (hist int32[B, D+1] (one-hot per active row), tried
    bool[B, D], accepted bool[B, D]; summed over rows they are the per-depth counts).

    path int32[B, N] / num_accepted int32[B]: the verifier's accepted nodes; committed int32[B]: how many
    of them were committed (fewer when an EOS or max_new_tokens ends the row inside the path). Counted is
    what was committed: hist[k] = rows that committed k draft nodes; depth d was *tried* when the node
    committed at depth d-1 (the root for d = 1) has a valid child, and *accepted* when a node at depth d
    was committed. A depth past a cut path is neither (the verifier's verdict there was discarded)."""
    b, n = tree.tokens.shape
    d = jnp.arange(1, max_depth + 1)[None, :]  # [1, D]
    slots = jnp.arange(n + 1)[None, :, None]
    has_child = jnp.any(tree.valid[:, None, :] & (tree.parents[:, None, :] + 1 == slots), axis=2)  # [B, N+1]
    # Parent slot of depth d: the root for d = 1, else the committed node at depth d-1 (slot = node + 1).
    parent_slot = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), path[:, :max_depth - 1] + 1], axis=1)
    parent_slot = jnp.clip(parent_slot, 0, n)  # -1 padding -> the root; masked below
    uncut = (committed == num_accepted)[:, None]
    accepted = (d <= committed[:, None]) & active[:, None]
    tried = accepted | ((d == committed[:, None] + 1) & uncut & active[:, None]
                        & jnp.take_along_axis(has_child, parent_slot, axis=1))
    hist = jax.nn.one_hot(committed, max_depth + 1, dtype=jnp.int32) * active[:, None]
    return hist, tried, accepted


def _empty_proposal(drafter, state, ctx, sampler):
    """An all-invalid tree and zero draft probabilities shaped like the drafter's proposals."""
    shapes = jax.eval_shape(lambda s: drafter.propose(s, ctx, sampler), state)
    tree, probs, _ = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
    return tree.replace(parents=jnp.full_like(tree.parents, -1)), probs


@dataclasses.dataclass(frozen=True)
class _Engine:
    """The speculative engine's three parts: `start` (prefill, drafter init: the loop's first state),
    `step` (one draft -> verify -> commit step, the while loop's body) and `finish` (the output).
    `_speculative` runs them; the cost model (jaxdecode.costmodel) times `step` alone, so the policy's
    costs are those of exactly what a step runs."""
    start: Any
    step: Any
    finish: Any
    # Tokens a plain step commits at most: `plain_run` for a lean plain run, else 1. The cost model
    # divides a plain trip's time by it (a trip that never ends its run early).
    plain_tokens: int = 1


def _engine(config, params, drafter, costs=None, constraint=None, *, verifier, sampler, max_new_tokens, eos_ids,
            cache_len, hist_cap, attn_impl, verify_widths, mesh=None, policy=None, logprobs=False,
            top_logprobs=0, stream_handle=None) -> _Engine:
    n, max_d = drafter.num_nodes, drafter.max_depth
    pad = pad_id_for(eos_ids)
    feature_layers = tuple(getattr(drafter, "feature_layers", ()) or ())
    plain_run = 1 if policy is None else policy.plain_run
    # Plain steps as a lean run (`plain_steps`) where nothing but the token and the drafter's upkeep
    # needs a step's care (a constraint's state and log-probs are kept by the engine step).
    lean_plain = policy is not None and constraint is None and not logprobs and plain_run > 1
    idle = getattr(drafter, "idle", None)
    # The drafter keeps state from what the target computed (observe) or on steps it does not draft (idle).
    upkeep = idle is not None or not bool(getattr(drafter, "history_only", False))
    # Greedy decoding with a verifier that reads only the target's argmax: no [B, N+1, V] distribution.
    argmax_only = sampler.is_greedy and callable(getattr(verifier, "verify_argmax", None))
    # A chain drafter that drafts only the levels the policy's plan will verify (Drafter.level_capped).
    level_capped = policy is not None and bool(getattr(drafter, "level_capped", False))
    lag_of = getattr(drafter, "catch_up_lag", None)

    def catch_up_beyond(st, active):
        """int32[] (None for a drafter that keeps up): the committed tokens beyond a steady step's
        (max_depth + 1) that the drafter runs over before its next proposal, the most of any live row
        (adaptive: "Returns to drafting")."""
        if lag_of is None:
            return None
        return jnp.max(jnp.where(active, lag_of(st.drafter_state, st.hist_len), 0)) - (max_d + 1)

    def start(prompt_tokens, prompt_lengths, key) -> _SpecState:
        st = _start(config, params, drafter, prompt_tokens, prompt_lengths, key, cache_len=cache_len,
                    hist_cap=hist_cap, pad=pad, feature_layers=feature_layers, policy=policy)
        b = prompt_tokens.shape[0]
        if logprobs:
            st = st.replace(logprobs=LogprobRecord.empty(b, max_new_tokens + max_d + 1, top_logprobs))
        return st if constraint is None else st.replace(cstate=constraint.init(b))

    def committed_logprobs(st, logits, res, seq, count, slot_states):
        """Write the target's log-probs of this step's tokens seq [B, D+1] (the first `count` are
        committed) at the rows' output columns. Token j was predicted at its parent's slot: the root
        for j = 0, else the accepted node at depth j (slot path[j-1] + 1); the distribution is the one
        the verifier judges against (processed, constrained), greedy: the softmax of the logits."""
        slots = jnp.concatenate([jnp.zeros_like(res.path[:, :1]), jnp.clip(res.path[:, :max_d] + 1, 0, n)], axis=1)
        step_logits = jnp.take_along_axis(logits, slots[:, :, None], axis=1)  # [B, D+1, V]
        if constraint is not None:
            step_logits = mask_logits(step_logits, allowed_slots(constraint, slot_gather(slot_states, slots),
                                                                 config.vocab_size))
        dist = (jax.nn.log_softmax(step_logits, axis=-1) if sampler.is_greedy
                else process_logits(step_logits, sampler))
        keep = jnp.arange(max_d + 1)[None, :] < count[:, None]
        return st.logprobs.write(st.num_new, keep, *token_logprobs(dist, seq, top_logprobs))

    def constrain(st, tree, draft_probs, active):
        """The proposal under the constraint (ALGORITHMS.md §6): every node's state from its parent's, a
        node whose token is not allowed there is dropped with its subtree (it could never be accepted:
        the target is masked), and the draft distributions are restricted to what each slot allows, so
        the surviving children are draws from the distributions the verifier is given. Returns (tree,
        draft_probs, slot states (leaves [B, N+1, ...]), allowed bool[B, N+1, V]; all-False on
        finished rows)."""
        tree, slots, allowed = constrain_tree(constraint, st.cstate, tree, config.vocab_size, max_d, eos_ids)
        allowed = allowed & active[:, None, None]
        if draft_probs is not None:
            draft_probs = mask_probs(draft_probs, allowed[:, :, :draft_probs.shape[-1]])
        return tree, draft_probs, slots, allowed

    def next_token(logits, key):
        """The token after the pending one with no draft: [B, V] logits -> int32[B]."""
        if sampler.is_greedy:  # the processed distribution's argmax is the raw logits' argmax
            return first_argmax(logits)
        return sample(key, process_logits(logits, sampler))

    def verify(st, tree, draft_probs, active, k_verify, allowed=None):
        """The target over [pending, tree] and the verifier's verdict: (logits [B, N+1, V], features,
        cache, VerifyResult, nonfinite). allowed: bool[B, N+1, V] per parent slot under a constraint:
        the verifier judges against the constrained target (the raw logits are returned)."""
        b = st.history.shape[0]
        pending = st.history[jnp.arange(b), st.hist_len - 1]

        def judge(logits, nodes):  # logits [B, w+1, V] over the w nodes the forward ran
            if allowed is not None:
                logits = mask_logits(logits, allowed[:, :logits.shape[1]])
            if nodes.tokens.shape[1] == 0:  # the width-0 branch (traced, never taken: a node is valid)
                return VerifyResult(path=jnp.zeros((b, 0), jnp.int32), num_accepted=jnp.zeros((b,), jnp.int32),
                                    bonus=next_token(logits[:, 0], k_verify))
            if argmax_only:  # greedy: the argmax is all the verdict reads
                return verifier.verify_argmax(first_argmax(logits), nodes)
            w = nodes.tokens.shape[1]
            probs = None if draft_probs is None else draft_probs[:, :w + 1]  # [B, w+1, V]: per parent slot
            return verifier(jnp.exp(process_logits(logits, sampler)), probs, nodes, k_verify)

        logits, feats, cache, res = _verify_forward(config, params, tree, pending, st.cache, active, verify_widths,
                                                    attn_impl, mesh, feature_layers, judge)  # [B, N+1, V]
        nodes = jnp.concatenate([jnp.ones((b, 1), bool), tree.valid], axis=1)  # [B, N+1]: root + valid
        nonfinite = st.nonfinite | nonfinite_rows(logits, active, nodes)
        return logits, feats, cache, res, nonfinite

    def verify_nothing(st, tree, active, k_verify, allowed=None, pending=None, padded: bool = True):
        """`verify` for a step that drafted nothing, done as a plain decoding step: the target over the
        pending token alone (no tree forward, no verifier), the next token drawn from its processed
        distribution — exactly what every verifier does for an empty tree (greedy: the argmax).
        allowed: bool[B, >=1, V], slot 0 the root's allowed tokens under a constraint. pending:
        int32[B], the pending tokens when the caller has them (else read from the history). padded:
        logits, features and path shaped for `tree`'s N nodes as `verify` returns them; False: for no
        nodes (N = 0, the lean plain run's observation)."""
        b = st.history.shape[0]
        if pending is None:
            pending = st.history[jnp.arange(b), st.hist_len - 1]
        no_nodes = Tree(tokens=tree.tokens[:, :0], parents=tree.parents[:, :0], valid=tree.valid[:, :0])
        logits, feats, cache = _verify_forward(config, params, no_nodes, pending, st.cache, active, (0,),
                                               attn_impl, mesh, feature_layers)  # [B, 1, V]
        nonfinite = st.nonfinite | nonfinite_rows(logits, active, jnp.ones((b, 1), bool))
        root = logits[:, 0] if allowed is None else mask_logits(logits[:, 0], allowed[:, 0])
        res = VerifyResult(path=jnp.full((b, n if padded else 0), -1, jnp.int32),
                           num_accepted=jnp.zeros((b,), jnp.int32), bonus=next_token(root, k_verify))
        if not padded:
            return logits, feats, cache, res, nonfinite
        logits = jnp.pad(logits, ((0, 0), (0, n), (0, 0)))  # slots of the (absent) nodes: zeros
        if feats is not None:
            feats = jnp.pad(feats, ((0, 0), (0, 0), (0, n), (0, 0)))
        return logits, feats, cache, res, nonfinite

    def constraint_after(slot_states, res, j):
        """Under a constraint: (ended bool[B, D+1]: the item is complete after the step's token j, the
        rows' states after the accepted path and the bonus). slot_states: leaves [B, N+1, ...] in the
        drafter's node order (the order of res.path)."""
        b = res.path.shape[0]
        path_slots = jnp.clip(res.path[:, :max_d] + 1, 0, n)  # [B, D]
        last = jnp.take_along_axis(path_slots, jnp.maximum(res.num_accepted - 1, 0)[:, None], axis=1)
        last = jnp.where(res.num_accepted[:, None] > 0, last, 0)  # [B, 1]: the root when nothing was accepted
        moved = constraint.advance(jax.tree.map(lambda x: x[:, 0], slot_gather(slot_states, last)), res.bonus)
        on_path = jnp.pad(complete_slots(constraint, slot_gather(slot_states, path_slots)), ((0, 0), (0, 1)))
        at_bonus = constraint.complete(moved).reshape(b, 1)
        ended = jnp.where(j < res.num_accepted[:, None], on_path, at_bonus & (j == res.num_accepted[:, None]))
        return ended, moved

    def observe(dstate, tree, res, logits, feats, history, hist_len, active, count):
        """The drafter's state after a verification of `tree` (history already committed)."""
        return drafter.observe(dstate, Observation(
            tree=tree, path=res.path, num_accepted=res.num_accepted, bonus=res.bonus, target_logits=logits,
            history=history, hist_len=hist_len, active=active, features=feats, committed=count))

    def finish(st, tree, dstate, pstate, key, active, verified, plain: bool = False, slot_path=None,
               slot_states=None, lag=None):
        """Commit a verification's accepted path and bonus; observe; statistics. plain: nothing was
        drafted (the pending token alone was run: it stays where it was written). slot_path: the
        accepted path as forward slots when the forward ran a compacted tree (adaptive.compact);
        `verified` then holds the verdict in the drafter's node indices. slot_states: the constraint's
        state per parent slot of `tree` (constraint= only). lag: what the drafter caught up on before
        this proposal (`catch_up_beyond`; scores a return to drafting)."""
        logits, feats, cache, res, nonfinite = verified
        if plain:
            cache = advance(cache, active.astype(jnp.int32))
        else:
            slot_path = res.path if slot_path is None else slot_path
            keep = jnp.concatenate([active[:, None], path_to_keep(slot_path, n) & active[:, None]], axis=1)
            cache = commit(cache, keep)

        # New tokens: the accepted path, then the bonus; cut at the first EOS and at max_new_tokens.
        path_tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(res.path, 0), axis=1)  # [B, N]
        j = jnp.arange(max_d + 1)[None, :]
        path_tokens = jnp.pad(path_tokens[:, :max_d], ((0, 0), (0, 1)))  # [B, D+1]
        seq = jnp.where(j < res.num_accepted[:, None], path_tokens, res.bonus[:, None])
        count = res.num_accepted + 1
        ends, cstate = is_eos(seq, eos_ids), st.cstate
        if constraint is not None:  # a completed item ends the row like an EOS
            from jaxdecode.constraints.protocol import select_rows  # constraints imports this package
            ended, moved = constraint_after(slot_states, res, j)
            ends, cstate = ends | ended, select_rows(active, moved, st.cstate)
        eos_at = jnp.where(ends & (j < count[:, None]), j, max_d + 1).min(axis=1)
        hit_eos = eos_at <= max_d
        count = jnp.where(hit_eos, eos_at + 1, count)
        count = jnp.minimum(count, max_new_tokens - st.num_new)
        count = jnp.where(active, count, 0)
        seq = jnp.where(j < count[:, None], seq, pad)
        history = _write_rows(st.history, seq, st.hist_len)
        record = committed_logprobs(st, logits, res, seq, count, slot_states) if logprobs else None
        hist_len = st.hist_len + count
        num_new = st.num_new + count
        done = st.done | (active & (hit_eos | (num_new >= max_new_tokens)))
        if stream_handle is not None:  # streaming: the output so far to the host (whole blocks); rows end if abandoned
            done = done | streaming.emit(stream_handle, history, hist_len - num_new, st.num_new, num_new, done)

        dstate = observe(dstate, tree, res, logits, feats, history, hist_len, active, count)
        # Committed draft nodes: the path up to an EOS or the token budget (count includes the bonus).
        committed = jnp.minimum(res.num_accepted, count)
        hist, tried, accepted = _acceptance_stats(tree, res.path, res.num_accepted, committed, active, max_d)
        acc_hist = st.accept_hist + hist
        policy_stats = {}
        if policy is not None:
            pstate = adaptive_mod.update(policy, pstate, tree, res.path, committed, res.num_accepted, active,
                                         costs, lag)
            kept = jnp.sum(tree.valid, axis=1).astype(jnp.int32)
            chosen = jnp.max(jnp.where(active, kept, 0))
            width_at = jnp.searchsorted(jnp.asarray(policy.widths), chosen)  # the forward's width index
            policy_stats = dict(
                policy_state=pstate, drafted_nodes=st.drafted_nodes + kept,
                speculative_steps=st.speculative_steps + ((kept > 0) & active).astype(jnp.int32),
                width_hist=st.width_hist.at[width_at].add(1))
        return st.replace(cache=cache, drafter_state=dstate, history=history, hist_len=hist_len, cstate=cstate,
                          num_new=num_new, done=done, key=key, target_calls=st.target_calls + 1,
                          steps=st.steps + active.astype(jnp.int32), accept_hist=acc_hist,
                          depth_tried=st.depth_tried + tried.sum(0).astype(jnp.int32),
                          depth_accepted=st.depth_accepted + accepted.sum(0).astype(jnp.int32),
                          nonfinite=nonfinite, logprobs=record, **policy_stats)

    def body(st: _SpecState) -> _SpecState:
        key, k_draft, k_verify = jax.random.split(st.key, 3)
        active = ~st.done
        ctx = DraftContext(history=st.history, hist_len=st.hist_len, key=k_draft, constraint=constraint,
                           cstate=st.cstate)

        def propose(st, ctx=ctx):
            """The drafter's proposal, pruned under the constraint: (tree, draft_probs, drafter state,
            slot states, allowed [B, N+1, V]; the last two None without a constraint)."""
            tree, draft_probs, dstate = drafter.propose(st.drafter_state, ctx, sampler)
            if constraint is None:
                return tree, draft_probs, dstate, None, None
            tree, draft_probs, slots, allowed = constrain(st, tree, draft_probs, active)
            return tree, draft_probs, dstate, slots, allowed

        if policy is None:
            tree, draft_probs, dstate, slots, allowed = propose(st)
            verified = verify(st, tree, draft_probs, active, k_verify, allowed)
            return finish(st, tree, dstate, None, key, active, verified, slot_states=slots)
        remaining = jnp.where(active, max_new_tokens - st.num_new, 0)  # tokens each row still has to go
        drafting, plan_nodes = adaptive_mod.draft_plan(policy, st.policy_state, costs, remaining)
        empty_tree, empty_probs = _empty_proposal(drafter, st.drafter_state, ctx, sampler)

        def draft_and_verify(st):
            shape_valid = None
            lag = catch_up_beyond(st, active)  # before the proposal catches up
            if level_capped:  # draft only the levels the plan verifies; the uncapped shape is the whole chain
                tree, draft_probs, dstate, slots, allowed = propose(st, dataclasses.replace(ctx, max_nodes=plan_nodes))
                shape_valid = tree.valid | (jnp.arange(n)[None, :] >= plan_nodes[:, None])
            else:
                tree, draft_probs, dstate, slots, allowed = propose(st)
            tree, _, pstate = adaptive_mod.truncate(policy, st.policy_state, costs, tree, remaining, shape_valid)
            # The kept nodes into the first slots, so the forward's width is what is kept (a chain's
            # kept nodes are a prefix already).
            chain = bool(getattr(drafter, "is_chain", False))
            vtree, vprobs, perm = (tree, draft_probs, None) if chain else adaptive_mod.compact(tree, draft_probs)
            vallowed = allowed
            if allowed is not None and perm is not None:  # the allowed sets follow their slots
                order = jnp.concatenate([jnp.zeros_like(perm[:, :1]), perm + 1], axis=1)  # [B, N+1]
                vallowed = jnp.take_along_axis(allowed, order[:, :, None], axis=1)
            kept_any = jnp.any(vtree.valid & active[:, None]).astype(jnp.int32)

            def finish_verified(st, verified):
                slot_path = None
                if perm is not None:  # the verdict back in the drafter's node indices (observe, estimates)
                    logits, feats, cache, res, nonfinite = verified
                    slot_path = res.path
                    path, logits, feats = adaptive_mod.expand(perm, res.path, logits, feats)
                    verified = (logits, feats, cache, dataclasses.replace(res, path=path), nonfinite)
                return finish(st, tree, dstate, pstate, key, active, verified, slot_path=slot_path,
                              slot_states=slots, lag=lag)

            if lean_plain:
                # Nothing kept (the proposal was empty or not worth its forward): the lean plain run
                # follows this branch (flagged), not an engine step over an empty tree (which costs more
                # than a plain step). Its key is this step's fresh one: the discarded proposal drew on
                # k_draft, which the plain tokens must not share.
                skipped = st.replace(drafter_state=dstate, policy_state=pstate, key=key)
                verified = run_if(kept_any > 0, lambda s: finish_verified(
                    s, verify(s, vtree, vprobs, active, k_verify, vallowed)), skipped)
                return verified, kept_any == 0
            # Nothing kept: a plain step after all. The branches read the target cache from the
            # switch's operand, so it is updated in place.
            verified = switch_in_place(
                kept_any,
                [lambda c: verify_nothing(st.replace(cache=c[2]), vtree, active, k_verify, vallowed),
                 lambda c: verify(st.replace(cache=c[2]), vtree, vprobs, active, k_verify, vallowed)],
                _verified_shapes(st, vtree, active, k_verify))
            return finish_verified(st, verified)

        def plain(st):  # drafting does not pay this step: the drafter only keeps its state current
            dstate = st.drafter_state if idle is None else idle(st.drafter_state, ctx)
            slots = allowed = None
            if constraint is not None:
                slots = broadcast_slots(st.cstate, n + 1)
                allowed = (constraint.allowed(st.cstate, config.vocab_size) & active[:, None])[:, None]
            return finish(st, empty_tree, dstate, st.policy_state, key, active,
                          verify_nothing(st, empty_tree, active, k_verify, allowed), plain=True, slot_states=slots)

        if not lean_plain:
            return switch_in_place(drafting.astype(jnp.int32), [plain, draft_and_verify], st)
        # Where the lean plain run sits decides its speed on the 2-core CPU, though its compiled loop is
        # the same (BENCHMARKS.md, "The lean run after the drafting branch"). Sampling: last in the step,
        # after the drafting branch (which flags whether it kept nothing); inside the branches its steps
        # ran 11-14% slower than `decode`'s at batch 1, last 5-7%. Greedy: inside the branches, at
        # `decode`'s speed; last, 5% slower at batch 4.
        if sampler.is_greedy:
            def drafted(s):
                s, kept_nothing = draft_and_verify(s)
                return plain_steps(s, remaining, empty_tree, run_plain=kept_nothing)
            return switch_in_place(drafting.astype(jnp.int32),
                                   [lambda s: plain_steps(s, remaining, empty_tree, run_plain=jnp.bool_(True)),
                                    drafted], st)
        st, plain_next = switch_in_place(drafting.astype(jnp.int32),
                                         [lambda c: (c[0], jnp.bool_(True)), lambda c: draft_and_verify(c[0])],
                                         (st, jnp.bool_(False)))
        return plain_steps(st, remaining, empty_tree, run_plain=plain_next)

    def plain_steps(st, remaining, empty_tree, run_plain):
        """Plain decoding steps in one inner loop: as many as the policy would take before its next probe
        (adaptive.plain_run_length), at most `plain_run`; none unless `run_plain` (bool[]: the step
        verified nothing). Each runs the pending token alone through the target and commits the next
        token (greedy: the argmax, as every verifier does for an empty tree); a drafter that keeps
        state (not history_only) gets an engine plain step's idle and observe calls, the observation
        over no nodes (N = 0: observing the N + 1 slots of its tree cost EAGLE-3 14% of a plain step
        at batch 4 on the CPU, where one slot is all a plain step commits). The
        statistics are those of that many engine plain steps, and the policy's estimates drift once for
        the steps taken."""
        b = st.history.shape[0]
        rows = jnp.arange(b)
        no_nodes = jax.tree.map(lambda x: x[:, :0], empty_tree)

        # The loop carries the pending token (a gather from the history per step cost ~0.25 ms of a 3 ms
        # step on CPU) and only what a plain step changes.
        def one(carry):
            i, cache, history, hist_len, num_new, done, key, nonfinite, taken, pending, dstate = carry
            # Greedy reads no randomness: no key split (a threefry loop per step on CPU).
            if idle is not None:
                key, k_draft, k_verify = jax.random.split(key, 3)
                dstate = idle(dstate, DraftContext(history=history, hist_len=hist_len, key=k_draft))
            else:
                key, k_verify = (key, key) if sampler.is_greedy else jax.random.split(key)
            active = ~done
            s = st.replace(cache=cache, history=history, hist_len=hist_len, nonfinite=nonfinite)
            logits, feats, cache, res, nonfinite = verify_nothing(s, empty_tree, active, k_verify, pending=pending,
                                                                  padded=False)  # [B, 1, V], [F, B, 1, D]
            count = active.astype(jnp.int32)
            # A finished row writes padding past its end (hist_len < hist_cap always: room for a tree).
            history = _write_rows(history, jnp.where(active, res.bonus, pad)[:, None], hist_len)
            hist_len, new_num = hist_len + count, num_new + count
            done = done | (active & (is_eos(res.bonus, eos_ids) | (new_num >= max_new_tokens)))
            if stream_handle is not None:
                done = done | streaming.emit(stream_handle, history, hist_len - new_num, num_new, new_num, done)
            if upkeep:  # observed as what it is, a verification of no nodes (N = 0: one slot, the root)
                dstate = observe(dstate, no_nodes, res, logits, feats, history, hist_len, active, count)
            return (i + 1, advance(cache, count), history, hist_len, new_num, done, key, nonfinite, taken + count,
                    jnp.where(active, res.bonus, pending), dstate)

        run = adaptive_mod.plain_run_length(policy, st.policy_state, costs, remaining,
                                            jnp.where(run_plain, plain_run, 0), max_run=plain_run)
        carry = (jnp.int32(0), st.cache, st.history, st.hist_len, st.num_new, st.done, st.key, st.nonfinite,
                 jnp.zeros_like(st.steps), st.history[rows, st.hist_len - 1], st.drafter_state if upkeep else None)
        trips, cache, history, hist_len, num_new, done, key, nonfinite, taken, _, dstate = jax.lax.while_loop(
            lambda c: (c[0] < run) & ~jnp.all(c[5]), one, carry)
        return st.replace(cache=cache, history=history, hist_len=hist_len, num_new=num_new, done=done, key=key,
                          nonfinite=nonfinite, target_calls=st.target_calls + trips, steps=st.steps + taken,
                          accept_hist=st.accept_hist.at[:, 0].add(taken), width_hist=st.width_hist.at[0].add(trips),
                          policy_state=adaptive_mod.drift(policy, st.policy_state, taken),
                          drafter_state=dstate if upkeep else st.drafter_state)

    def _verified_shapes(st, tree, active, k_verify):
        """Zeros shaped like `verify`'s result (the operand of the switch between the two)."""
        shapes = jax.eval_shape(lambda: verify_nothing(st, tree, active, k_verify))
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
        return zeros[:2] + (st.cache,) + zeros[3:]

    def output(st: _SpecState, prompt_lengths) -> SpecOutput:
        cols = prompt_lengths[:, None] + jnp.arange(max_new_tokens)[None, :]
        out = jnp.take_along_axis(st.history, jnp.minimum(cols, hist_cap - 1), axis=1)
        out = jnp.where(jnp.arange(max_new_tokens)[None, :] < st.num_new[:, None], out, pad)
        stats = {"target_calls": st.target_calls, "verify_calls": st.steps,
                 "tau": st.num_new / jnp.maximum(st.steps, 1),
                 "accept_hist": st.accept_hist,
                 "accept_rate_by_depth": st.depth_accepted / jnp.maximum(st.depth_tried, 1),
                 "nonfinite_logits": st.nonfinite}
        if policy is not None:
            stats.update(drafted_nodes=st.drafted_nodes, speculative_steps=st.speculative_steps,
                         width_hist=st.width_hist, policy_widths=jnp.asarray(policy.widths, jnp.int32))
        if logprobs:
            stats.update(st.logprobs.stats(max_new_tokens, st.num_new))
        return SpecOutput(tokens=out, lengths=st.num_new, stats=stats)

    return _Engine(start=start, step=body, finish=output, plain_tokens=plain_run if lean_plain else 1)


def _start(config, params, drafter, prompt_tokens, prompt_lengths, key, *, cache_len, hist_cap, pad,
           feature_layers, policy) -> _SpecState:
    """The engine's first state: the prompt prefilled but for its last token (the pending root of the
    first tree), the drafter initialised, statistics at zero."""
    b, p = prompt_tokens.shape
    n, max_d = drafter.num_nodes, drafter.max_depth
    # Lengths derived from an argument, not a constant: XLA would otherwise constant-fold the prefill's
    # masks over the empty cache at the batch size (minutes of compile for 1e4+ rows).
    cache = init_cache(config, b, cache_len).replace(lengths=jnp.minimum(prompt_lengths, 0))
    _, cache, hidden = prefill(config, params, prompt_tokens, prompt_lengths - 1, cache,
                               return_layers=feature_request(feature_layers), with_hidden=True)
    history = jnp.full((b, hist_cap), pad, jnp.int32).at[:, :p].set(prompt_tokens)
    key, dkey = jax.random.split(key)
    if feature_layers:
        dstate0 = drafter.init(prompt_tokens, prompt_lengths, cache_len, dkey,
                               features=select_features(hidden, feature_layers))
    else:
        dstate0 = drafter.init(prompt_tokens, prompt_lengths, cache_len, dkey)
    state = _SpecState(
        cache=cache, drafter_state=dstate0,
        history=history, hist_len=prompt_lengths, num_new=jnp.zeros((b,), jnp.int32),
        done=jnp.zeros((b,), bool), key=key, target_calls=jnp.int32(1), steps=jnp.zeros((b,), jnp.int32),
        accept_hist=jnp.zeros((b, max_d + 1), jnp.int32), depth_tried=jnp.zeros((max_d,), jnp.int32),
        depth_accepted=jnp.zeros((max_d,), jnp.int32), nonfinite=jnp.zeros((b,), bool))
    if policy is not None:
        builder = getattr(drafter, "builder", None)
        state = state.replace(
            policy_state=adaptive_mod.init_state(policy, b, max_d, n, getattr(builder, "static_parents", None),
                                                 bool(getattr(drafter, "is_chain", False))),
            drafted_nodes=jnp.zeros((b,), jnp.int32), speculative_steps=jnp.zeros((b,), jnp.int32),
            width_hist=jnp.zeros((len(policy.widths),), jnp.int32))
    return state


@partial(jax.jit, static_argnames=("config", "verifier", "sampler", "max_new_tokens", "eos_ids",
                                   "cache_len", "hist_cap", "attn_impl", "verify_widths", "mesh", "policy",
                                   "logprobs", "top_logprobs"))
def _speculative(config, params, drafter, prompt_tokens, prompt_lengths, key, costs=None, constraint=None,
                 stream_handle=None, *,
                 verifier, sampler, max_new_tokens, eos_ids, cache_len, hist_cap, attn_impl, verify_widths,
                 mesh=None, policy=None, logprobs=False, top_logprobs=0):
    params = with_embed_words(params)  # viewed once here, not on every step inside the branches
    engine = _engine(config, params, drafter, costs, constraint, verifier=verifier, sampler=sampler,
                     max_new_tokens=max_new_tokens, eos_ids=eos_ids, cache_len=cache_len, hist_cap=hist_cap,
                     attn_impl=attn_impl, verify_widths=verify_widths, mesh=mesh, policy=policy,
                     logprobs=logprobs, top_logprobs=top_logprobs, stream_handle=stream_handle)
    st = jax.lax.while_loop(lambda s: ~jnp.all(s.done), engine.step,
                            engine.start(prompt_tokens, prompt_lengths, key))
    return engine.finish(st, prompt_lengths)


def _structure_error(drafter, verifier) -> str | None:
    """Why `verifier` cannot verify this drafter's proposals as declared (child rule, tree kind, draft
    probabilities), or None when it can."""
    name, rule = verifier.name, drafter.child_rule
    chain = bool(getattr(drafter, "is_chain", False))
    if not verifier.accepts_children(rule, chain):
        shape = "chains" if chain else "a branching tree"
        return (f"verifier {name!r} is lossless only for children chosen by {verifier.describe_children()}, "
                f"but this drafter's children are {rule!r} on {shape}")
    if verifier.needs_draft_probs and rule == "point":
        return f"verifier {name!r} needs draft probabilities but this drafter proposes point masses"
    kind = verifier.tree_kind
    if kind == "chain" and not chain:
        return f"verifier {name!r} verifies chains only (e.g. tree='chain:4'), but this drafter branches"
    parents = getattr(getattr(drafter, "builder", None), "static_parents", None)
    if kind != "tree":
        if parents is None and not chain:
            return (f"verifier {name!r} needs a fixed tree structure ({kind}), e.g. tree='static:3,1,1:iid' "
                    f"for 3 i.i.d. chains; this drafter's trees change from step to step")
        if parents is not None:
            try:
                check_tree_kind(verifier, parents)
            except ValueError as e:
                return str(e)
    return None


def _sampling_verifiers_for(drafter) -> str:
    """The lossless sampling verifiers that accept this drafter's proposals, for error messages."""
    names = [n for n in VERIFIERS if (v := get_verifier(n)).lossless and not v.greedy_decoding
             and _structure_error(drafter, v) is None]
    return ", ".join(names) or "none"


def check_verifier_temperature(verifier, sampler: SamplerConfig, sampling_choice: str = "a sampling verifier"):
    """A greedy verifier needs temperature 0 and a sampling one a temperature > 0 (SpeculativeError);
    `sampling_choice` names what to use instead of a greedy verifier."""
    if verifier.greedy_decoding and not sampler.is_greedy:
        raise SpeculativeError(
            f"verifier {verifier.name!r} decodes greedily (argmax), but the temperature is {sampler.temperature}: "
            f"use temperature 0, or {sampling_choice}")
    if not verifier.greedy_decoding and sampler.is_greedy:
        raise SpeculativeError(
            f"verifier {verifier.name!r} samples but the temperature is {sampler.temperature} (<= 0): use "
            f"verifier='greedy' for greedy decoding or a temperature > 0")


def check_combination(config, drafter, verifier, sampler: SamplerConfig) -> None:
    """Host-side checks of a drafter / verifier / sampler combination; clear errors. Which drafts a
    verifier is lossless for is declared by the verifier itself (`child_rules`, `tree_kind`, ...)."""
    dcfg = getattr(drafter, "config", None)
    if dcfg is not None and dcfg.vocab_size != config.vocab_size:
        raise SpeculativeError(
            f"the drafter's vocabulary ({dcfg.vocab_size} tokens) differs from the target's "
            f"({config.vocab_size}): drafter and target must share one tokenizer")
    if sampler.repetition_penalty != 1.0:
        raise SpeculativeError("repetition_penalty depends on each tree node's own history, which "
                               "speculative decoding does not track; use method='sample' for it")
    n, depth = drafter.num_nodes, drafter.max_depth
    if not 1 <= depth <= n:  # the engine sizes each step's accepted path by it
        raise SpeculativeError(f"the drafter's max_depth ({depth}) must be in 1..num_nodes ({n}): a tree of "
                               f"{n} nodes is at most {n} deep; declare max_depth <= num_nodes")
    name, rule = verifier.name, drafter.child_rule
    if rule not in CHILD_RULES:
        raise SpeculativeError(f"the drafter's child_rule {rule!r} is unknown; declare one of "
                               f"{', '.join(CHILD_RULES)} (jaxdecode.verifiers.CHILD_RULES)")
    check_verifier_temperature(verifier, sampler,
                               f"a sampling verifier for this drafter ({_sampling_verifiers_for(drafter)})")
    problem = _structure_error(drafter, verifier)
    if problem is not None:
        raise SpeculativeError(f"{problem}; lossless sampling verifiers for this drafter: "
                               f"{_sampling_verifiers_for(drafter)}")


def check_constraint(config, constraint, verifier, eos_ids: tuple, max_new_tokens: int, batch: int):
    """The constraint prepared for this decode (its own checks: vocabulary, EOS ids, batch), or a clear
    error when speculative decoding cannot take it."""
    if not all(callable(getattr(constraint, m, None)) for m in ("prepare", "init", "allowed", "advance", "complete")):
        raise SpeculativeError(f"constraint must implement the Constraint protocol (jaxdecode.constraints: "
                               f"prepare, init, allowed, advance, complete), got {type(constraint).__name__}")
    if not getattr(verifier, "prunable", True):
        # Stop strings forbid nothing, but the draft is still cut after the token that completes one.
        what = getattr(constraint, "what", None)
        cut = (f"{what} cut drafts after the token that completes one" if what else
               "a constraint cuts drafts at tokens it forbids")
        raise SpeculativeError(
            f"verifier {verifier.name!r} judges the whole draft jointly, and {cut}: the cut would bias its "
            f"verdict. Use a token-by-token verifier with {what or 'constraint='} (verifier='chain' for "
            f"sampled chains, or 'specinfer' / 'spectr' for trees)")
    constraint = constraint.prepare(config.vocab_size, eos_ids, max_new_tokens, batch)
    shapes = jax.eval_shape(lambda c: c.init(batch), constraint)
    shared = [x.shape for x in jax.tree.leaves(shapes) if not x.shape or x.shape[0] != batch]
    if shared:
        raise SpeculativeError(
            f"{type(constraint).__name__} keeps state shared by all rows (leaves of shape {shared}, e.g. a "
            f"trie's common depth), but every node of a draft tree sits at its own depth and needs its own "
            f"state: speculative decoding takes constraints with per-row states (regex / JSON schema: "
            f"jaxdecode.constraints.automaton); decode item sets with method='constrained_greedy', "
            f"'constrained_sample' or 'constrained_beam'")
    return constraint


@under_auto_mesh
def speculative_decode(config, params, drafter, prompt_tokens, prompt_lengths, *, max_new_tokens: int,
                       verifier, sampler: SamplerConfig = SamplerConfig(temperature=0.0),
                       eos_ids: tuple = (), key=None, cache_len: int | None = None,
                       attn_impl: str | None = None, verify_widths=None, mesh=None,
                       adaptive: "adaptive_mod.AdaptivePolicy | None" = None, costs=None,
                       constraint=None, logprobs: bool = False, top_logprobs: int = 0,
                       stream=None) -> SpecOutput:
    """Speculative decoding of up to max_new_tokens per row (see the module docstring).

    attn_impl: attention of the verification forward; default "tree" (the Pallas tree-attention
    kernel) on GPU/TPU and "xla" on CPU, where the kernel would only run interpreted.
    verify_widths: node counts the verification forward may shrink to (e.g. (2, 8) for an 8-node
    drafter): each step verifies the smallest that covers every valid node. Pays off with drafters
    that leave low-confidence tails invalid (PromptLookupDrafter(lengths=...)); the output is the same.
    Default: the drafter's `verify_widths` attribute if it has one, else always all N nodes.
    mesh: the (data, model) Mesh params and prompts are sharded on: the verification forward then runs
    its attention kernel under shard_map on each device's shard (models.forward's `mesh`).
    adaptive: an AdaptivePolicy (`policy_for(drafter, sampler)`): each step decides per row how deep to
    draft, down to zero, from `costs` (a jaxdecode.costmodel.CostTable measured for this model,
    drafter and batch size) and the rows' running acceptance (jaxdecode.adaptive); None: every step
    verifies the drafter's whole proposal. Stats then add drafted_nodes, speculative_steps (per row),
    width_hist and policy_widths.
    constraint: a Constraint with per-row states (a regex / JSON-schema AutomatonConstraint from
    jaxdecode.constraints.automaton): the output is the constrained decode's (greedy: token for token
    constrained greedy; sampling: distributed as constrained sampling). Drafters that read distributions
    draft under it, every proposal is pruned to allowed nodes, and the verifier judges against the
    target masked per node (EOS exactly at accepting states). ALGORITHMS.md §6.
    logprobs / top_logprobs (static): stats add the TARGET's log-prob of every committed token (never
    the drafter's) under the distribution the verifier judges against (greedy: the softmax of the
    logits), and the top_logprobs best alternatives (jaxdecode.scoring).
    stream: a jaxdecode.streaming.TokenSink: the rows' output goes to it from inside the loop once a row
    crosses a multiple of `sink.every` tokens (whole accepted blocks; a host callback, the compiled program
    does not depend on which sink). None: no callback is traced.
    """
    logprobs, top_logprobs = check_logprob_flags(logprobs, top_logprobs)
    if attn_impl is None:
        attn_impl = "xla" if jax.default_backend() == "cpu" else "tree"
    if mesh is not None:  # jax.make_mesh's Explicit axes: the decode needs Auto ones
        from jaxdecode.sharding import auto_axes
        mesh = auto_axes(mesh)
    eos_ids = validate_eos_ids(config, eos_ids)
    check_combination(config, drafter, verifier, sampler)
    check_feature_layers(config, getattr(drafter, "feature_layers", ()))
    n = drafter.num_nodes
    # Room: prompt + new tokens + one verification tree (N nodes + the pending root) beyond them.
    extra = n + 1 + drafter.max_depth + 1
    check_auto_axes(params=params, prompt_tokens=prompt_tokens, prompt_lengths=prompt_lengths)
    prompt_tokens, prompt_lengths = validate_prompts(config, prompt_tokens, prompt_lengths,
                                                     max_new_tokens, lookahead=drafter.max_depth + 1)
    if constraint is not None:
        constraint = check_constraint(config, constraint, verifier, eos_ids, max_new_tokens, prompt_tokens.shape[0])
    width = prompt_tokens.shape[1]
    need = width + max_new_tokens + extra
    if cache_len is None:
        cache_len = default_cache_len(width, max_new_tokens, extra)
    elif cache_len < need:
        raise SpeculativeError(
            f"the cache ({cache_len} slots) has no room for the prompt ({width}) + max_new_tokens "
            f"({max_new_tokens}) + a tree of {n} nodes (+{extra - n} scratch); raise cache_len to "
            f">= {need} or use a smaller tree")
    if width + max_new_tokens + drafter.max_depth + 1 > config.max_position_embeddings:
        raise SpeculativeError(
            f"prompt ({width}) + max_new_tokens ({max_new_tokens}) + tree depth "
            f"({drafter.max_depth}) exceeds max_position_embeddings ({config.max_position_embeddings})")
    if key is None:
        key = jax.random.PRNGKey(0)
    hist_cap = width + max_new_tokens + drafter.max_depth + 2
    if verify_widths is None:
        verify_widths = getattr(drafter, "verify_widths", None)
    widths = check_verify_widths(verify_widths, n)
    cost_vec = None
    if adaptive is not None:
        if not isinstance(adaptive, adaptive_mod.AdaptivePolicy):
            raise SpeculativeError(f"adaptive must be an AdaptivePolicy (policy_for(drafter, sampler)) or None, "
                                   f"got {type(adaptive).__name__}")
        if adaptive.widths[-1] != n:
            raise SpeculativeError(f"the adaptive policy's widths {adaptive.widths} must end at the drafter's "
                                   f"tree size {n}: build it with policy_for(drafter, sampler)")
        if costs is None:
            raise SpeculativeError("adaptive speculation needs the measured costs: pass costs="
                                   "jaxdecode.costmodel.load_or_calibrate(model, drafter, batch_size)")
        cost_vec = adaptive_mod.cost_vector(adaptive, costs)
        widths = adaptive.widths
    stream_handle = streaming.operand(stream, prompt_tokens.shape[0], max_new_tokens, mesh)
    return _speculative(config, split_layers(config, params), drafter, prompt_tokens, prompt_lengths, key,
                        cost_vec, constraint, stream_handle, verifier=verifier,
                        sampler=sampler, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                        cache_len=cache_len, hist_cap=hist_cap, attn_impl=attn_impl, verify_widths=widths,
                        mesh=mesh, policy=adaptive, logprobs=logprobs, top_logprobs=top_logprobs)


def _class_prior_at(drafter, sampler: SamplerConfig) -> tuple[tuple, bool] | None:
    """(the drafter's acceptance by confidence class at the sampler's temperature, measured there) from
    its `class_prior_at`, or None: for plain temperature sampling only, since top-k / top-p / min-p and a
    repetition penalty change how likely the drafted tokens are."""
    at = getattr(drafter, "class_prior_at", None)
    plain = (sampler.top_k == 0 and sampler.top_p >= 1.0 and sampler.min_p == 0.0
             and not sampler.uses_seen_tokens)
    if at is None or not plain:
        return None
    rates, measured = at(sampler.temperature)
    return (tuple(rates), bool(measured)) if rates else None


def policy_for(drafter, sampler: SamplerConfig, **overrides) -> "adaptive_mod.AdaptivePolicy":
    """The adaptive policy for this drafter: widths 0, powers of two, N (and the drafter's own
    verify_widths); `need` from the proposal when decoding greedily, from the tree's fixed structure
    when sampling with a static shape, all-or-nothing when sampling with a shape that follows the
    sampled tokens (jaxdecode.adaptive, "Lossless"). Greedy decoding starts the estimates at the
    drafter's `acceptance_prior` (held-out acceptance by depth, measured greedily) when it declares one.
    A drafter declaring `confidence_classes` gets estimates keyed by class (adaptive, "Confidence
    classes"), started at its `class_prior` (measured greedily: when sampling, at the weight of a
    guess), or when sampling at its rates for that temperature (`class_prior_at`: a measurement there,
    or a guess between measured temperatures). Measured starts count as MEASURED_PRIOR_WEIGHT
    observations (adaptive, "Measured priors"). Sampling: a drafting width must beat the plain step
    by SAMPLING_MARGIN, in a batch of several rows by SAMPLING_BATCH_MARGIN (adaptive, "Sampling
    margin")."""
    if sampler.is_greedy:
        overrides.setdefault("prior_by_depth", tuple(getattr(drafter, "acceptance_prior", None) or ()))
    elif "margin" not in overrides:  # a margin the caller gives holds at every batch size
        overrides["margin"] = adaptive_mod.SAMPLING_MARGIN
        overrides.setdefault("batch_margin", adaptive_mod.SAMPLING_BATCH_MARGIN)
    static = getattr(getattr(drafter, "builder", None), "static_parents", None) is not None
    classes = int(getattr(drafter, "confidence_classes", 0) or 0)
    if classes and (sampler.is_greedy or drafter.child_rule in ("point", "topk", "argmax")):
        # estimates per confidence class (adaptive, "Confidence classes"), started at the drafter's
        # measured rates. They are greedy ones; sampling starts there too, at a guess's weight: a point
        # mass is accepted with the target's probability of its token, and a class whose tokens are
        # rarely the target's likeliest is rarely drawn either (a flat 0.6 for every class had batch 16
        # at T = 0.7 verify one node on 6-9 steps for nothing; BENCHMARKS.md, "Sampling starts")
        overrides.setdefault("classes", classes)
        sampled = None if sampler.is_greedy else _class_prior_at(drafter, sampler)
        if sampled:  # the rates at this temperature: a measurement, or a guess between measured ones
            overrides.setdefault("prior_by_class", sampled[0])
            if sampled[1]:
                overrides.setdefault("prior_weight", adaptive_mod.MEASURED_PRIOR_WEIGHT)
        overrides.setdefault("prior_by_class", tuple(getattr(drafter, "class_prior", None) or ()))
    # Children that are a function of q (top-k, argmax, point masses) make the whole proposal a
    # function of the past: any truncation of it is too. Sampled children: only the fixed shape.
    deterministic = sampler.is_greedy or drafter.child_rule in ("point", "topk", "argmax")
    if sampler.is_greedy and (overrides.get("prior_by_depth") or overrides.get("prior_by_class")):
        # measured over many held-out tokens: a few early misses must not undo it (adaptive, "Measured priors")
        overrides.setdefault("prior_weight", adaptive_mod.MEASURED_PRIOR_WEIGHT)
    shape = ("proposal" if deterministic
             else "structure" if static or getattr(drafter, "is_chain", False) else "none")
    overrides.setdefault("widths", adaptive_mod.default_widths(drafter.num_nodes,
                                                               getattr(drafter, "verify_widths", None)))
    return adaptive_mod.AdaptivePolicy(**dict(dict(shape=shape), **overrides))
