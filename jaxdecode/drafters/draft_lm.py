"""Any jaxdecode model as a draft LM, with its own KV cache, composed with any tree builder.

The draft cache holds committed tokens only. Each proposal first catches up on the tokens the target
committed since the last proposal, in padded forwards of up to max_depth + 1 tokens (after a drafting
step: the accepted path and the bonus, one forward sized to the longest row's; after steps the adaptive
policy did not draft, one forward per block of the tokens committed meanwhile, instead of one draft
forward every plain step), which yields the root distribution; the builder then grows the tree level
by level, each level one forward that writes beyond the committed prefix (`write_offset`) and sees its
ancestors through a window mask. Nothing written while drafting is ever committed, so `observe` has nothing to
undo.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxdecode.drafters.builders import ChainBuilder, build_tree, capped_chain
from jaxdecode.autoregressive import prefill
from jaxdecode.models import ModelConfig, advance, forward, init_cache, padded_causal_mask
from jaxdecode.sampling import SamplerConfig, process_logits
from jaxdecode.speculative import switch_in_place
from jaxdecode.tree import ancestor_mask, depths


def draft_logprobs(logits, sampler: SamplerConfig):
    """The draft distribution: the target's sampler on draft logits (temperature 1 for greedy runs,
    where only the ranking matters and a point mass would leave top-k children undefined)."""
    if sampler.is_greedy:
        return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return process_logits(logits, sampler.replace(repetition_penalty=1.0))


def catch_up_widths(max_block: int) -> tuple:
    """Block lengths a catch-up may run (`catch_up_blocks`' widths) when at most `max_block` tokens are
    committed per step: 2, 4, 8, 16 where at most half of it, then max_block. After a step that kept a
    tokens the drafter lacks a + 1; one block of max_depth + 1 rows made a wrapped chain of 8 run a 9-row
    forward even when one token was kept (issue 10: the acceptance head over EAGLE-3 at h = 0). Each
    width is one more branch to compile and a loop test per catch-up, so short chains keep one block."""
    return tuple(sorted({w for w in (2, 4, 8, 16) if 2 * w <= max_block} | {max_block}))


def check_catch_up_sizes(sizes: tuple, max_depth: int) -> tuple:
    """A drafter's `catch_up_sizes` as catch-up widths: () = the default; else ascending lengths in
    1..max_depth + 1 (its cache has room for one block of max_depth + 1 past the committed entries)."""
    if not sizes:
        return catch_up_widths(max_depth + 1)
    if list(sizes) != sorted(set(sizes)) or sizes[0] < 1 or sizes[-1] > max_depth + 1:
        raise ValueError(f"catch_up_sizes must be ascending block lengths in 1..{max_depth + 1} (max_depth + 1), "
                         f"got {sizes!r}")
    return tuple(sizes)


def catch_up_blocks(block, state, lengths_of, target_len, width: int, widths: tuple, root=None):
    """A drafter's cache brought up to `target_len` int32[B] entries, one block per forward:
    `block(state, n)` -> (root [B, width] after the block's last entry: logits or a layer output, state)
    feeds each row's next <= n entries (n static, one of `widths`, ascending); a row that took nothing in
    a later block keeps its root from an earlier one. Each forward runs the smallest width that holds
    what the furthest-behind row lacks, the largest while it lacks more (`switch_in_place`: one compiled
    branch per width, the state updated in place). `root` [B, width]: the root before catching up (the
    loop runs only while a row is behind); None: zeros, and at least one block runs (a drafter that
    keeps no root: when the engine drafts, the pending token is always new). Returns (root f32[B, width],
    state)."""
    def run(n):
        def branch(operand):
            new_root, new_st = block(operand[1], n)
            return new_root.astype(jnp.float32), new_st
        return branch

    def step(carry):
        root, st, _ = carry
        if len(widths) == 1:
            new_root, new_st = run(widths[0])((root, st))
        else:
            need = jnp.max(target_len - lengths_of(st))  # entries the furthest-behind row lacks
            which = jnp.searchsorted(jnp.asarray(widths, jnp.int32), need)  # past the largest: clamped
            new_root, new_st = switch_in_place(which, [run(n) for n in widths], (jnp.zeros_like(root), st))
        took = (lengths_of(new_st) > lengths_of(st))[:, None]
        return jnp.where(took, new_root, root), new_st, jnp.bool_(False)

    def behind(carry):
        return carry[2] | jnp.any(lengths_of(carry[1]) < target_len)

    once = root is None
    root0 = jnp.zeros((target_len.shape[0], width), jnp.float32) if once else root.astype(jnp.float32)
    root, state, _ = jax.lax.while_loop(behind, step, (root0, state, jnp.bool_(once)))
    return root, state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftLM:
    params: object
    config: ModelConfig = dataclasses.field(metadata=dict(static=True))
    builder: object = dataclasses.field(metadata=dict(static=True))
    # The target's acceptance by depth of this draft's chain on held-out prompts (greedy), where it was
    # measured for this target (`acceptance_prior_for`): the adaptive policy's greedy start. Without it
    # the policy starts at its flat prior, at which a draft LM step rarely looks worth its cost, and a
    # probe of so costly a drafter comes rarely, so a good draft can go untried.
    acceptance_prior: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    # Block lengths the catch-up may run (ascending; the loop runs until caught up, so any lengths are
    # exact); () = `catch_up_widths(max_depth + 1)`; (max_depth + 1,) = one fixed block, as before.
    catch_up_sizes: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    def __post_init__(self):
        # a list from a JSON drafter option is kept as a tuple (a static field must hash), checked here
        sizes = self.catch_up_sizes
        if not isinstance(sizes, (tuple, list)) or not all(
                isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in sizes):
            raise ValueError(f"DraftLM: catch_up_sizes must be a list of block lengths (ints), got {sizes!r}")
        object.__setattr__(self, "catch_up_sizes", tuple(int(n) for n in sizes))
        check_catch_up_sizes(self.catch_up_sizes, self.max_depth)

    num_nodes = property(lambda self: self.builder.num_nodes)
    max_depth = property(lambda self: self.builder.max_depth)
    child_rule = property(lambda self: self.builder.rule)
    is_chain = property(lambda self: self.builder.is_chain)
    history_only = True  # observe is the identity: see speculative.Drafter
    # A chain drafts level by level: under the adaptive policy it drafts only the levels it will verify
    # (DraftContext.max_nodes), so a short draft costs a short draft (speculative.Drafter).
    level_capped = property(lambda self: isinstance(self.builder, ChainBuilder))

    def init(self, prompt_tokens, prompt_lengths, cache_len, key):
        # Room for the committed tokens, one catch-up block and the working tree.
        cache = init_cache(self.config, prompt_tokens.shape[0],
                           cache_len + self.builder.working_size + self.max_depth + 1)
        _, cache = prefill(self.config, self.params, prompt_tokens, prompt_lengths - 1, cache)
        return cache

    def _catch_up(self, cache, ctx):
        """Run the draft LM over the committed tokens its cache lacks, in padded blocks of up to
        max_depth + 1 (`catch_up_sizes`): (the root's logits [B, V], the cache holding every committed
        token). No `idle`: steps that draft nothing leave the cache behind, and the next proposal
        catches up on them here."""
        hist_cap = ctx.history.shape[1]

        def block(cache, catch):
            idx = cache.lengths[:, None] + jnp.arange(catch)[None, :]  # [B, C] history positions
            valid = idx < ctx.hist_len[:, None]
            toks = jnp.take_along_axis(ctx.history, jnp.minimum(idx, hist_cap - 1), axis=1)
            logits, _, cache = forward(self.config, self.params, jnp.where(valid, toks, 0), idx, cache,
                                       padded_causal_mask(valid))
            n_new = valid.sum(axis=1)
            root = jnp.take_along_axis(logits, jnp.maximum(n_new - 1, 0)[:, None, None], axis=1)[:, 0]
            return root, advance(cache, n_new)

        return catch_up_blocks(block, cache, lambda c: c.lengths, ctx.hist_len, self.config.vocab_size,
                               widths=check_catch_up_sizes(self.catch_up_sizes, self.max_depth))

    def catch_up_lag(self, cache, hist_len):
        """int32[B]: committed tokens the next proposal catches up on first (speculative.Drafter)."""
        return hist_len - cache.lengths

    def propose(self, cache, ctx, sampler: SamplerConfig):
        cfg, params = self.config, self.params
        root_logits, cache = self._catch_up(cache, ctx)  # now holds every committed token, pending included
        root_pos = ctx.hist_len - 1
        b = root_pos.shape[0]

        def expand(scratch, start, tokens, parents_all):
            f = tokens.shape[1]
            # parents_all spans the builder's whole working tree: W = working_size window columns
            # dynamic slices: `start` may be traced (a builder whose levels run in a lax.while_loop)
            mask = jax.lax.dynamic_slice_in_dim(ancestor_mask(parents_all), start, f, axis=1)  # [B, F, W]
            node_depth = jax.lax.dynamic_slice_in_dim(depths(parents_all), start, f, axis=1)
            lg, _, scratch = forward(cfg, params, tokens, root_pos[:, None] + node_depth, scratch, mask,
                                     write_offset=jnp.full((b,), start, jnp.int32))
            return draft_logprobs(lg, sampler), scratch

        builder = self.builder
        if getattr(ctx, "max_nodes", None) is not None and self.level_capped:
            builder = capped_chain(builder, ctx.max_nodes)
        tree, slots, scratch = build_tree(builder, ctx, cache, draft_logprobs(root_logits, sampler), expand, ctx.key)
        # The scratch cache, not `cache`: the tree's entries lie beyond `lengths` (never attended), and
        # keeping `cache` would make XLA copy it before the tree writes, every step.
        return tree, slots, scratch.replace(lengths=cache.lengths)

    def observe(self, cache, obs):
        return cache


ACCEPTANCE_FILE = "acceptance.json"


def acceptance_prior_for(draft, target) -> tuple:
    """The held-out acceptance by depth recorded beside a draft model (its directory's acceptance.json:
    {"target_params_sha256": ..., "accept_by_depth": [...]}) when it was measured against this very
    target (the digest of its weights), else (). A file that does not parse is skipped with a warning:
    the prior only sets where the adaptive policy's estimates start, never what is decoded."""
    path = Path(draft.path) / ACCEPTANCE_FILE if getattr(draft, "path", None) else None
    if path is None or not path.is_file():
        return ()
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(target.params)):
        return ()  # weights passed into a caller's jit: no bytes to fingerprint, so no prior
    from jaxdecode.costmodel import params_digest
    try:
        record = json.loads(path.read_text())
        rates = tuple(float(a) for a in record["accept_by_depth"])
        if not rates or not all(0.0 <= a <= 1.0 for a in rates):
            raise ValueError("accept_by_depth must be a non-empty list of rates in [0, 1]")
        measured_for = str(record["target_params_sha256"])
    except (OSError, ValueError, TypeError, KeyError) as err:
        warnings.warn(f"{path}: not a draft acceptance record ({err}); the adaptive policy starts at its "
                      f"flat prior (delete or fix the file)", stacklevel=2)
        return ()
    return rates if measured_for == params_digest(target.params) else ()
