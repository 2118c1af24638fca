"""Self-speculation: draft with the target's own layers, no second model (ALGORITHMS.md §4).

Three drafters share one mechanism, `SelfSpecDrafter`: a draft network over the target's weights with
its own KV cache (like DraftLM: each proposal catches up on the tokens committed since the last one,
then a tree builder grows the tree level by level beyond the committed prefix), a static list of
candidate sub-networks (`SubNet`: `stop_at_layer` / `skip_layers` of models.forward, a selection of the
target's stacked weights, never a copy) chosen per step by an index in the drafter state, and an
optional early stop (`threshold`, `depth limit`) that marks the rest of the tree invalid.

No conditional ever takes a KV cache as operand (XLA copies a conditional's large operands into its
branches, every call): the chosen candidate runs as one forward over a run-time layer list
(models.forward's `layer_ids`, a loop over just its layers), and the skips below are
`speculative.run_if` / `switch_in_place` (while loops of 0 or 1 trips, whose carry is updated in place).

- **swift** (SWIFT, Xia et al. 2024; LayerSkip-style layer skipping): candidates are skip sets. The
  drafter tracks an EMA of τ per candidate from the verifications, tries each candidate for
  `explore_steps` steps, then uses the best (τ per draft cost, cost ∝ layers run) and re-tries one other
  candidate for `explore_steps` steps every `reexplore_every` steps. Cache: a skip set's KV depends on
  the whole sub-network below it, so one candidate's cache is wrong for another. The draft cache always
  holds the *current* candidate's own KV: when the choice changes, the next proposal rebuilds it from
  the history in one forward (the catch-up over the whole history instead of the last few tokens,
  chosen by `switch_in_place`), so drafts are exact for the sub-network at the price of one prefill per switch (a few
  per exploration round). No per-candidate caches (memory ×1).
- **del** (DEL, Zarch et al. 2025: dynamic exit layer): candidates are exit layers E (`stop_at_layer`,
  draft = layer E-1's state through the final norm and the LM head). Exits are nested prefixes of the
  target, so ONE cache caught up through the deepest exit is exact for every candidate (no rebuild).
  Acceptance per exit is measured for all candidates at once, without drafting with them ("shadow
  tokens"): the verification forward hands the drafter the target's states at every candidate exit
  (`feature_layers`), and on the committed slots the exit's argmax is compared with the target's. The
  prompt's prefill states warm-start the estimate. Each step takes the (exit, draft length) maximising
  expected tokens per cost: E[tokens] = (1 - α^(γ+1)) / (1 - α) over
  1 + (E_max + (γ - 1) E) / L (one verification + the catch-up + γ-1 draft levels, cost ∝ layers).
- **kangaroo** (Kangaroo, Liu et al. 2024): a trained adapter (one decoder layer of the target's
  shape) on the first l target layers, read out by the target's final norm and LM head; drafting stops
  where the adapter's top-1 probability falls below `threshold`. Its draft network is a model of l+1
  layers (the target's first l + the adapter, stacked once when the drafter is built: a copy of l
  layers' weights), run by the same forward, so it has a KV cache like any draft model. Training:
  jaxdecode.training.selfspec.

Early stop: a node is kept when its parent is kept and the distribution it was drawn from has top-1
probability >= threshold (the root's children always), and its depth is within the limit. Its draft
probabilities are still the distributions the children were drawn from, so every verifier stays
lossless; levels where no node of the batch is kept skip their forward (`run_if`), and the engine's
verification shrinks to the kept nodes (`verify_widths`: one width per tree depth on static trees).
Any tree builder works (chain, static, EAGLE-2, DySpec); greedy speculative equals plain greedy.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.drafters.builders import build_tree
from jaxdecode.drafters.draft_lm import catch_up_blocks, draft_logprobs
from jaxdecode.models import KVCache, ModelConfig, advance, forward, init_cache, padded_causal_mask
from jaxdecode.models.transformer import _norm, output_logits
from jaxdecode.sampling import first_argmax
from jaxdecode.speculative import FINAL, accepted_features, run_if, switch_in_place
from jaxdecode.tree import Tree, ancestor_mask, depths

POLICIES = ("fixed", "swift", "del")


class SelfSpecError(ValueError):
    """A self-speculation drafter that cannot be built as asked (layers the target lacks, ...)."""


@dataclasses.dataclass(frozen=True)
class SubNet:
    """A static sub-network of the target: layers 0..stop_at_layer-1 (None: all) minus skip_layers."""
    stop_at_layer: int | None = None
    skip_layers: tuple = ()

    def layers(self, num_layers: int) -> tuple:
        stop = num_layers if self.stop_at_layer is None else self.stop_at_layer
        return tuple(i for i in range(stop) if i not in self.skip_layers)


def check_subnets(config: ModelConfig, subnets) -> tuple:
    """Validate candidate sub-networks against the target; clear errors."""
    n = config.num_layers
    out = []
    for s in subnets:
        stop = s.stop_at_layer
        if stop is not None and (isinstance(stop, bool) or not isinstance(stop, int) or not 1 <= stop <= n):
            raise SelfSpecError(f"exit layer {stop!r} is not in 1..{n} (the target has {n} layers)")
        bad = [i for i in s.skip_layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise SelfSpecError(f"skip set {list(s.skip_layers)} names layers {bad} that this {n}-layer target "
                                f"does not have (use 0..{n - 1})")
        run = s.layers(n)
        if not run:
            raise SelfSpecError(f"skip set {list(s.skip_layers)} skips every layer: keep at least one")
        if len(run) == n:
            raise SelfSpecError(f"sub-network {s} runs every layer of the target: a draft that costs a "
                                f"target step saves nothing; skip some layers or exit earlier")
        out.append(SubNet(stop, tuple(sorted(set(s.skip_layers)))))
    if not out:
        raise SelfSpecError("no candidate sub-network given")
    if len(set(out)) != len(out):
        raise SelfSpecError(f"candidate sub-networks repeat: {out}")
    return tuple(out)


def default_skip_sets(num_layers: int, ratio: float = 0.5) -> tuple:
    """SWIFT-style candidates: about `ratio` of the interior layers skipped (the first and last layers
    always run), in four patterns: every other one (two phases), the upper block, a middle block."""
    n = num_layers
    if n < 2:
        raise SelfSpecError("self-speculation needs a target of at least 2 layers")
    interior = list(range(1, n - 1))
    if not interior:
        return ((n - 1,),)
    k = max(1, round(ratio * len(interior)))
    mid = (len(interior) - k) // 2
    sets = [tuple(interior[0::2][:k]), tuple(interior[1::2][:k]), tuple(interior[-k:]),
            tuple(interior[mid:mid + k])]
    return tuple(dict.fromkeys(s for s in sets if s))


def default_exit_layers(num_layers: int) -> tuple:
    """DEL candidates: exits at about 1/4, 1/2 and 3/4 of the depth (distinct, in 1..L-1)."""
    if num_layers < 2:
        raise SelfSpecError("self-speculation needs a target of at least 2 layers")
    return tuple(sorted({min(num_layers - 1, max(1, round(num_layers * f))) for f in (0.25, 0.5, 0.75)}))


# ----------------------------------------------------------------------------- drafting pieces
def catch_up(run, cache, history, hist_len, block: int, head=None):
    """Feed the committed tokens the draft cache lacks (history[cache.lengths:hist_len], at most
    `block` of them) and commit them. Returns (head(final state after the last one) [B, V], or None
    without `head`; hidden, index of that token in the block [B], cache). With cache.lengths = 0 and
    block = the history width this rebuilds the cache from scratch. The head runs on the last token
    only: the forward's logits go unused, so XLA drops the LM head over the block (on a rebuild, the
    whole history)."""
    idx = cache.lengths[:, None] + jnp.arange(block)[None, :]  # [B, C] history positions
    valid = idx < hist_len[:, None]
    toks = jnp.take_along_axis(history, jnp.minimum(idx, history.shape[1] - 1), axis=1)
    pos = jnp.minimum(idx, jnp.maximum(hist_len - 1, 0)[:, None])  # padding stays inside position tables
    _, hidden, cache = run(jnp.where(valid, toks, 0), pos, cache, padded_causal_mask(valid))
    n_new = valid.sum(axis=1)
    last = jnp.maximum(n_new - 1, 0)
    root = None if head is None else head(jnp.take_along_axis(hidden["final"], last[:, None, None], axis=1)[:, 0])
    return root, hidden, last, advance(cache, n_new)


def tree_expand(run, root_pos):
    """A builder's `expand` over a draft network `run` writing beyond the committed prefix (raw logits)."""
    def expand(scratch, start, tokens, parents_all):
        f, b = tokens.shape[1], tokens.shape[0]
        # parents_all spans the builder's working tree (W columns); `start` may be traced
        mask = jax.lax.dynamic_slice_in_dim(ancestor_mask(parents_all), start, f, axis=1)  # [B, F, W]
        node_depth = jax.lax.dynamic_slice_in_dim(depths(parents_all), start, f, axis=1)
        lg, _, scratch = run(tokens, root_pos[:, None] + node_depth, scratch, mask,
                             write_offset=jnp.full((b,), start, jnp.int32))
        return lg, scratch
    return expand


def stopping_expand(expand, logq_of, threshold: float, limit, working: int, vocab: int):
    """Wrap `expand` with the early stop: scorer state (scratch, alive [B, W], conf [B, W]). A level
    none of whose new nodes is kept (see `stopped_valid`) skips its forward and returns uniform
    distributions (never drawn from by a kept node). The skip is `run_if`, not lax.cond: the draft
    cache inside `scratch` is written in place, never copied into a conditional."""
    def expand_stop(carry, start, tokens, parents_all):
        scratch, alive, conf = carry
        b, f = tokens.shape
        par = jax.lax.dynamic_slice_in_dim(parents_all, start, f, axis=1)
        d = jax.lax.dynamic_slice_in_dim(depths(parents_all), start, f, axis=1)
        p = jnp.maximum(par, 0)
        live = jnp.where(par < 0, True, jnp.take_along_axis(alive, p, axis=1)
                         & (jnp.take_along_axis(conf, p, axis=1) >= threshold)) & (d <= limit[:, None])
        need = jnp.any(live & (d < limit[:, None]))  # someone may still get a kept child

        def run(carry):
            lg, s = expand(carry[1], start, tokens, parents_all)
            return logq_of(lg), s

        uniform = jnp.full((b, f, vocab), -math.log(vocab), jnp.float32)
        logq, scratch = run_if(need, run, (uniform, scratch))
        alive = jax.lax.dynamic_update_slice_in_dim(alive, live, start, axis=1)
        conf = jax.lax.dynamic_update_slice_in_dim(conf, jnp.exp(logq.max(axis=-1)), start, axis=1)
        return logq, (scratch, alive, conf)

    def init(scratch, b):
        return scratch, jnp.zeros((b, working), bool), jnp.zeros((b, working), jnp.float32)
    return expand_stop, init


def stopped_valid(tree: Tree, slots, threshold: float, limit, max_depth: int):
    """Which nodes the early stop keeps: a root child always, another node when its parent is kept and
    the parent's distribution (slots[parent + 1], what the node was drawn from) has top-1 >= threshold;
    only depths <= limit[b]. bool[B, N]."""
    conf = slots.max(axis=-1)  # [B, N+1]
    d = depths(tree.parents)
    p = jnp.maximum(tree.parents, 0)
    pconf = jnp.take_along_axis(conf, tree.parents + 1, axis=1)
    keep = jnp.zeros(tree.valid.shape, bool)
    for level in range(1, max_depth + 1):  # static: tree depth, not decoded tokens
        ok = jnp.where(tree.parents < 0, True, jnp.take_along_axis(keep, p, axis=1) & (pconf >= threshold))
        keep = jnp.where(d == level, ok, keep)
    return tree.valid & keep & (d <= limit[:, None])


def depth_widths(builder):
    """verify_widths for a builder whose tree is fixed: the node counts of depths <= 1, 2, 4, ... and all
    (nodes are level-ordered), so a stopped draft verifies little more than its kept levels; None for
    trees that change from step to step."""
    parents = getattr(builder, "static_parents", None)
    if parents is None:
        return None
    parents = np.asarray(parents)
    d = np.zeros(len(parents), np.int32)
    for i, p in enumerate(parents):
        d[i] = 1 if p < 0 else d[p] + 1
    if np.any(np.diff(d) < 0):
        return None
    # depths 1, 2, 4, ... and the deepest: each width is one compiled verification forward
    levels = sorted({k for k in (2 ** np.arange(8)) if k < d.max()} | {int(d.max())})
    return tuple(int(np.sum(d <= k)) for k in levels)


# ----------------------------------------------------------------------------- the drafter
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SelfSpecState:
    cache: KVCache  # the draft network's cache: every committed token (pending included after propose)
    choice: jax.Array  # int32: the candidate the next proposal drafts with
    built: jax.Array  # int32: the candidate the cache's entries were computed with (swift)
    limit: jax.Array  # int32: deepest kept draft node (del: the chosen draft length)
    score: jax.Array  # f32[C]: swift: EMA of τ per candidate; del: decayed exit-argmax matches
    count: jax.Array  # f32[C]: swift: steps tried since the last (re)exploration; del: decayed trials
    step: jax.Array  # int32: verifications observed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SelfSpecDrafter:
    """Draft with sub-networks of `params`/`config` (the target's, or Kangaroo's stacked draft network)."""
    params: object
    config: ModelConfig = dataclasses.field(metadata=dict(static=True))
    builder: object = dataclasses.field(metadata=dict(static=True))
    candidates: tuple = dataclasses.field(default=(SubNet(),), metadata=dict(static=True))
    policy: str = dataclasses.field(default="fixed", metadata=dict(static=True))
    threshold: float = dataclasses.field(default=0.0, metadata=dict(static=True))
    explore_steps: int = dataclasses.field(default=4, metadata=dict(static=True))
    reexplore_every: int = dataclasses.field(default=64, metadata=dict(static=True))
    ema: float = dataclasses.field(default=0.3, metadata=dict(static=True))  # swift: weight of a new τ
    decay: float = dataclasses.field(default=0.9, metadata=dict(static=True))  # del: per-step decay
    warmup_positions: int = dataclasses.field(default=64, metadata=dict(static=True))  # del: prompt tail
    # Held-out acceptance by depth from training (TrainedDrafter.make): the adaptive policy's start.
    acceptance_prior: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise SelfSpecError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0.0 <= float(self.threshold) < 1.0:
            raise SelfSpecError(f"threshold (top-1 probability to keep drafting) must be in [0, 1), got "
                                f"{self.threshold!r}")
        if self.policy == "del" and any(s.skip_layers or s.stop_at_layer is None for s in self.candidates):
            raise SelfSpecError("del candidates are exit layers (SubNet(stop_at_layer=E)) only")
        if self.explore_steps < 1 or self.reexplore_every < 1:
            raise SelfSpecError("explore_steps and reexplore_every must be >= 1")

    num_nodes = property(lambda self: self.builder.num_nodes)
    max_depth = property(lambda self: self.builder.max_depth)
    child_rule = property(lambda self: self.builder.rule)
    is_chain = property(lambda self: getattr(self.builder, "is_chain", False))
    num_candidates = property(lambda self: len(self.candidates))

    @property
    def verify_widths(self):  # only a drafter that stops early leaves nodes out
        return depth_widths(self.builder) if self.threshold > 0 or self.policy == "del" else None

    @property
    def feature_layers(self) -> tuple:
        if self.policy != "del":
            return ()
        return tuple(s.stop_at_layer - 1 for s in self.candidates) + (FINAL,)

    @property
    def _exits(self):
        return np.asarray([s.stop_at_layer for s in self.candidates], np.int32)

    def cost(self) -> np.ndarray:
        """Layers one draft level of each candidate runs, over the target's layer count."""
        return np.asarray([len(s.layers(self.config.num_layers)) for s in self.candidates],
                          np.float32) / self.config.num_layers

    # -- networks
    def _run(self, sub: SubNet, return_layers=()):
        def run(tokens, positions, cache, mask, write_offset=None):
            return forward(self.config, self.params, tokens, positions, cache, mask, write_offset=write_offset,
                           stop_at_layer=sub.stop_at_layer, skip_layers=sub.skip_layers,
                           return_layers=return_layers)
        return run

    def _switch(self, choice):
        """The draft network of candidate `choice` (traced): one forward over a run-time layer list
        (models.forward's layer_ids), costing the chosen candidate's layers. Not a lax.switch over
        per-candidate forwards: XLA would copy the draft cache into the chosen branch on every call."""
        if self.num_candidates == 1:
            return self._run(self.candidates[0])
        lists = [s.layers(self.config.num_layers) for s in self.candidates]
        table = np.zeros((len(lists), max(map(len, lists))), np.int32)  # [C, K] layer ids, padded
        for c, ids in enumerate(lists):
            table[c, :len(ids)] = ids
        ids = jnp.asarray(table)[choice]
        count = jnp.asarray([len(x) for x in lists], jnp.int32)[choice]

        def run(tokens, positions, cache, mask, write_offset=None):
            return forward(self.config, self.params, tokens, positions, cache, mask, write_offset=write_offset,
                           layer_ids=ids, num_layers_run=count)
        return run

    def _catch_up(self, state: SelfSpecState, history, hist_len, block_len: int):
        """(root logits [B, V], cache) of the chosen candidate after all the committed tokens: blocks of
        `block_len` tokens until every row has caught up (at least one block). No `idle`: steps that draft
        nothing leave the cache behind, and the next proposal catches up on them here."""
        def block(st, n):
            root, cache = self._catch_up_block(st, history, hist_len, n)
            return root, dataclasses.replace(st, cache=cache, built=st.choice)  # a rebuild happens once

        root, state = catch_up_blocks(block, state, lambda st: st.cache.lengths, hist_len, self.config.vocab_size,
                                      widths=(block_len,))
        return root, state.cache

    def _catch_up_block(self, state: SelfSpecState, history, hist_len, block: int):
        """One block of `_catch_up`: (root logits [B, V], cache) after at most `block` more tokens."""
        if self.policy == "del":  # the deepest exit writes every candidate's layers; read the chosen exit
            deepest = max(s.stop_at_layer for s in self.candidates)
            ids = tuple(s.stop_at_layer - 1 for s in self.candidates)
            _, hidden, last, cache = catch_up(self._run(SubNet(deepest), ids), state.cache, history,
                                              hist_len, block)
            h = jax.lax.dynamic_index_in_dim(hidden["layers"], state.choice, keepdims=False)  # [B, T, D]
            h = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
            return output_logits(self.config, self.params, _norm(self.config, h, self.params["final_norm"])), cache
        run = self._switch(state.choice)
        head = lambda h: output_logits(self.config, self.params, h)  # noqa: E731
        if self.policy != "swift" or self.num_candidates == 1:
            root, _, _, cache = catch_up(run, state.cache, history, hist_len, block, head)
            return root, cache

        def rebuild(carry):  # the choice changed: recompute every committed token's KV with it
            cache = carry[1].replace(lengths=jnp.zeros_like(carry[1].lengths))
            root, _, _, cache = catch_up(run, cache, history, hist_len, history.shape[1], head)
            return root, cache

        def update(carry):
            root, _, _, cache = catch_up(run, carry[1], history, hist_len, block, head)
            return root, cache
        root0 = jnp.zeros((history.shape[0], self.config.vocab_size), jnp.float32)
        return switch_in_place((state.choice != state.built).astype(jnp.int32), [update, rebuild],
                               (root0, state.cache))

    # -- protocol
    def init(self, prompt_tokens, prompt_lengths, cache_len, key, features=None):
        b = prompt_tokens.shape[0]
        cache = init_cache(self.config, b, cache_len + getattr(self.builder, "working_size", self.num_nodes)
                           + self.max_depth + 1)
        c = self.num_candidates
        state = SelfSpecState(cache=cache, choice=jnp.int32(0), built=jnp.int32(0),
                              limit=jnp.int32(self.max_depth), score=jnp.zeros((c,), jnp.float32),
                              count=jnp.zeros((c,), jnp.float32), step=jnp.int32(0))
        if self.policy == "del":
            if features is None:
                raise SelfSpecError("the del drafter reads the target's states at its exit layers: run it "
                                    "through speculative_decode, which passes them (feature_layers)")
            state = self._del_warm_start(state, features, prompt_lengths)
        # Everything but the pending root (the last prompt token), with the first candidate.
        _, cache = self._catch_up(state, prompt_tokens, prompt_lengths - 1, prompt_tokens.shape[1])
        return dataclasses.replace(state, cache=cache)

    def catch_up_lag(self, state: SelfSpecState, hist_len):
        """int32[B]: committed tokens the next proposal catches up on first (speculative.Drafter)."""
        return hist_len - state.cache.lengths

    def propose(self, state: SelfSpecState, ctx, sampler):
        root_logits, cache = self._catch_up(state, ctx.history, ctx.hist_len, self.max_depth + 1)
        b = root_logits.shape[0]
        root_pos = ctx.hist_len - 1
        limit = jnp.broadcast_to(state.limit, (b,))
        logq_of = lambda lg: draft_logprobs(lg, sampler)  # noqa: E731
        expand = tree_expand(self._switch(state.choice), root_pos)
        stops = self.threshold > 0 or self.policy == "del"
        if stops:
            expand, carry = stopping_expand(expand, logq_of, self.threshold, limit,
                                            getattr(self.builder, "working_size", self.num_nodes),
                                            self.config.vocab_size)
            tree, slots, (scratch, _, _) = build_tree(self.builder, ctx, carry(cache, b), logq_of(root_logits),
                                                      expand, ctx.key)
            tree = dataclasses.replace(tree, valid=stopped_valid(tree, slots, self.threshold, limit,
                                                                 self.max_depth))
        else:
            def expand_logq(scratch, start, tokens, parents_all):
                lg, scratch = expand(scratch, start, tokens, parents_all)
                return logq_of(lg), scratch
            tree, slots, scratch = build_tree(self.builder, ctx, cache, logq_of(root_logits), expand_logq, ctx.key)
        # Keep the scratch cache: the tree's entries lie beyond `lengths` (never attended, overwritten by
        # the next catch-up), and keeping `cache` instead would make XLA copy it before the tree writes.
        return tree, slots, dataclasses.replace(state, cache=scratch.replace(lengths=cache.lengths),
                                                built=state.choice)

    def observe(self, state: SelfSpecState, obs):
        state = dataclasses.replace(state, step=state.step + 1)
        if self.policy == "swift" and self.num_candidates > 1:
            return self._swift_observe(state, obs)
        if self.policy == "del":
            return self._del_observe(state, obs)
        return state

    # -- SWIFT: explore each candidate, exploit the best, re-explore one now and then
    def _swift_observe(self, state, obs):
        act = obs.active.astype(jnp.float32)
        tau = jnp.sum((obs.num_accepted + 1) * act) / jnp.maximum(act.sum(), 1.0)
        c = state.choice
        first = state.count[c] == 0
        new = jnp.where(first, tau, (1 - self.ema) * state.score[c] + self.ema * tau)
        score = state.score.at[c].set(new)
        count = state.count.at[c].add(1.0)
        # Re-explore: every reexplore_every steps, one other candidate (round robin) is tried again.
        k = self.num_candidates
        due = (state.step % self.reexplore_every == 0) & (state.step > k * self.explore_steps)
        other = (state.step // self.reexplore_every) % k
        count = jnp.where(due, count.at[other].set(0.0), count)
        need = count < self.explore_steps
        value = score / (1.0 + self.max_depth * jnp.asarray(self.cost()))  # τ per step cost
        best = jnp.argmax(jnp.where(count > 0, value, -jnp.inf)).astype(jnp.int32)
        nxt = jnp.where(need[c], c, jnp.where(jnp.any(need), jnp.argmax(need), best)).astype(jnp.int32)
        return dataclasses.replace(state, score=score, count=count, choice=nxt)

    # -- DEL: per-exit acceptance from the target's own states, then the best (exit, length)
    def _exit_matches(self, feats, target_top):
        """feats [F, B, T, D] (the candidates' exit states first), target_top int32[B, T] -> bool[C, B, T]:
        whether each exit's argmax equals the target's."""
        h = _norm(self.config, feats[:self.num_candidates], self.params["final_norm"])
        return first_argmax(output_logits(self.config, self.params, h)) == target_top[None]

    def _del_choose(self, state, score, count):
        alpha = (score + 1.0) / (count + 2.0)  # [C], Laplace-smoothed acceptance per exit
        gamma = jnp.arange(1, self.max_depth + 1, dtype=jnp.float32)[None, :]  # [1, G]
        a = jnp.clip(alpha[:, None], 0.0, 0.999)
        tokens = (1.0 - a ** (gamma + 1.0)) / (1.0 - a)
        exits = jnp.asarray(self._exits, jnp.float32)[:, None]
        cost = 1.0 + (float(self._exits.max()) + (gamma - 1.0) * exits) / self.config.num_layers
        flat = jnp.argmax((tokens / cost).reshape(-1))
        g = self.max_depth
        return dataclasses.replace(state, score=score, count=count, choice=(flat // g).astype(jnp.int32),
                                   limit=(flat % g + 1).astype(jnp.int32))

    def _del_warm_start(self, state, features, prompt_lengths):
        w = min(self.warmup_positions, features.shape[2])
        p = features.shape[2]
        feats = features[:, :, p - w:]  # [F, B, w, D]: the prompt's tail
        pos = p - w + jnp.arange(w)[None, :]
        ok = (pos < prompt_lengths[:, None] - 1).astype(jnp.float32)  # valid prefill states
        top = first_argmax(output_logits(self.config, self.params, feats[-1]))  # FINAL is already normed
        hits = (self._exit_matches(feats, top) * ok[None]).sum(axis=(1, 2))
        return self._del_choose(state, hits, jnp.broadcast_to(ok.sum(), hits.shape))

    def _del_observe(self, state, obs):
        feats, count = accepted_features(obs)  # [F, B, N+1, D], int32[B]
        slots = jnp.concatenate([jnp.zeros((obs.path.shape[0], 1), obs.path.dtype), jnp.maximum(obs.path, 0) + 1],
                                axis=1)
        top = first_argmax(jnp.take_along_axis(obs.target_logits, slots[..., None], axis=1))
        ok = (jnp.arange(slots.shape[1])[None, :] < count[:, None]).astype(jnp.float32)
        hits = (self._exit_matches(feats, top) * ok[None]).sum(axis=(1, 2))
        return self._del_choose(state, self.decay * state.score + hits,
                                self.decay * state.count + ok.sum())


# ----------------------------------------------------------------------------- building by name
def _tree(tree, temperature):
    from jaxdecode.drafters import tree_from_option
    return tree_from_option(tree, "chain:4", temperature)


def _int_sets(value, what: str) -> tuple:
    try:
        return tuple(tuple(int(i) for i in s) for s in value)
    except (TypeError, ValueError):
        raise SelfSpecError(f"{what} must be a list of lists of layer ids, got {value!r}") from None


def make_swift(target, tree=None, temperature: float = 0.0, *, skip_sets=None, threshold: float = 0.0,
               explore_steps: int = 4, reexplore_every: int = 64) -> SelfSpecDrafter:
    """SWIFT / LayerSkip for `target` (a jaxdecode Model): skip_sets = candidate lists of skipped
    layers (default `default_skip_sets`; one set = a fixed LayerSkip draft), threshold = stop drafting
    below this top-1 probability (0 = off)."""
    sets = default_skip_sets(target.config.num_layers) if skip_sets is None else _int_sets(skip_sets, "skip_sets")
    subs = check_subnets(target.config, [SubNet(None, s) for s in sets])
    return SelfSpecDrafter(params=target.params, config=target.config, builder=_tree(tree, temperature),
                           candidates=subs, policy="swift" if len(subs) > 1 else "fixed",
                           threshold=float(threshold), explore_steps=int(explore_steps),
                           reexplore_every=int(reexplore_every))


def make_del(target, tree=None, temperature: float = 0.0, *, exit_layers=None,
             threshold: float = 0.0) -> SelfSpecDrafter:
    """DEL for `target`: exit_layers = candidate exits E (draft = the first E layers + the LM head;
    default `default_exit_layers`); the draft length is chosen per step up to the tree's depth."""
    exits = default_exit_layers(target.config.num_layers) if exit_layers is None else exit_layers
    try:
        exits = tuple(sorted({int(e) for e in exits}))
    except (TypeError, ValueError):
        raise SelfSpecError(f"exit_layers must be a list of ints, got {exit_layers!r}") from None
    subs = check_subnets(target.config, [SubNet(e) for e in exits])
    return SelfSpecDrafter(params=target.params, config=target.config, builder=_tree(tree, temperature),
                           candidates=subs, policy="del", threshold=float(threshold))


def make_selfspec(name: str, target, tree=None, temperature: float = 0.0, **options) -> SelfSpecDrafter:
    """make_drafter's entry for the training-free kinds: "swift" or "del"."""
    makers = {"swift": make_swift, "del": make_del}
    if name not in makers:
        raise SelfSpecError(f"unknown self-speculation drafter {name!r}; use one of {sorted(makers)}")
    from jaxdecode.drafters.trained import check_options
    check_options(name, makers[name], options, positional=3, error=SelfSpecError)
    return makers[name](target, tree, temperature, **options)


# ----------------------------------------------------------------------------- Kangaroo
@dataclasses.dataclass(frozen=True)
class KangarooConfig:
    exit_layer: int = 2  # l: the adapter reads the output of target layer l-1 (the first l layers)
    threshold: float = 0.6  # stop drafting where the adapter's top-1 probability is below this
    hidden_weight: float = 0.0  # training: weight of 1 - cos(adapter's final state, the target's)

    def __post_init__(self):
        if isinstance(self.exit_layer, bool) or not isinstance(self.exit_layer, int) or self.exit_layer < 1:
            raise SelfSpecError(f"KangarooConfig.exit_layer must be an int >= 1, got {self.exit_layer!r}")
        if not 0.0 <= float(self.threshold) < 1.0:
            raise SelfSpecError(f"KangarooConfig.threshold must be in [0, 1), got {self.threshold!r}")
        if float(self.hidden_weight) < 0:
            raise SelfSpecError(f"KangarooConfig.hidden_weight must be >= 0, got {self.hidden_weight!r}")


def _check_exit(cfg: KangarooConfig, target_config: ModelConfig):
    if not cfg.exit_layer < target_config.num_layers:
        raise SelfSpecError(f"Kangaroo's exit_layer {cfg.exit_layer} must be below the target's "
                            f"{target_config.num_layers} layers (the adapter replaces the rest)")


def adapter_config(target_config: ModelConfig) -> ModelConfig:
    """A one-layer model of the target's shape: the adapter's layer parameters."""
    return dataclasses.replace(target_config, num_layers=1, sliding_windows=(0,), rope_layers=())


def kangaroo_param_shapes(cfg: KangarooConfig, target_config: ModelConfig) -> dict:
    from jaxdecode.models import param_shapes
    return {"layer": param_shapes(adapter_config(target_config))["layers"]}


def init_adapter(cfg: KangarooConfig, target_config: ModelConfig, key) -> dict:
    """A fresh adapter: a target-shaped decoder layer whose residual branches output zero, so the
    untrained drafter is the early exit at layer l (DEL's draft) and training starts from there."""
    from jaxdecode.models import init_params
    _check_exit(cfg, target_config)
    layer = init_params(dataclasses.replace(adapter_config(target_config), dtype="float32"), key)["layers"]
    for name in ("wo", "w_down", "we_down", "ws_down", "bo", "b_down"):  # experts: we_down (and ws_down), no w_down
        if name in layer:
            layer[name] = jnp.zeros_like(layer[name])
    return {"layer": layer}


def kangaroo_network(target_config: ModelConfig, target_params, cfg: KangarooConfig, adapter):
    """(config, params) of the draft network: the target's first l layers, then the adapter layer, then
    the target's final norm and LM head: a model of l + 1 layers that models.forward runs. Pure (training
    differentiates through it into `adapter`)."""
    _check_exit(cfg, target_config)
    l = cfg.exit_layer
    layers = jax.tree.map(lambda t, a: jnp.concatenate([t[:l], a.astype(t.dtype)], axis=0),
                          target_params["layers"], adapter["layer"])
    windows = tuple(target_config.sliding_windows[:l]) + (target_config.sliding_windows[l],)
    rope = target_config.rope_layers  # per layer (SmolLM3's NoPE layers): the adapter takes layer l's, as its window
    rope = tuple(rope[:l]) + (rope[l],) if rope else ()
    config = dataclasses.replace(target_config, num_layers=l + 1, sliding_windows=windows, rope_layers=rope)
    return config, {**target_params, "layers": layers}


def make_kangaroo(params, cfg: KangarooConfig, target, tree=None, temperature: float = 0.0, *,
                  threshold=None) -> SelfSpecDrafter:
    """The Kangaroo drafter for `target` from trained adapter params (DrafterKind.make)."""
    config, net = kangaroo_network(target.config, target.params, cfg, params)
    thr = cfg.threshold if threshold is None else float(threshold)
    return SelfSpecDrafter(params=net, config=config, builder=_tree(tree, temperature),
                           candidates=(SubNet(),), policy="fixed", threshold=thr)


KANGAROO_TARGET_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                          "num_heads", "num_kv_heads", "head_dim")


def _register():
    from jaxdecode.drafters.trained import DrafterKind, register_kind
    register_kind(DrafterKind(name="kangaroo", config_cls=KangarooConfig, make=make_kangaroo,
                              target_fields=KANGAROO_TARGET_FIELDS, param_shapes=kangaroo_param_shapes))


_register()
