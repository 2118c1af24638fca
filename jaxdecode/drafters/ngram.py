"""Drafters that copy from the text itself: prompt lookup and input-guided aggressive decoding.

Both propose a chain of `num_nodes` point-mass tokens (child_rule "point": verify with "greedy" or
"point_mass"); nodes past what the source holds are invalid (`tree.valid` False). Everything is
vectorised over the batch and over history positions: an n-gram match is the AND of n shifted
equality maps of the history against its own suffix, and "most recent" / "unique" are a max / a count
over positions. No Python loop runs over positions; the loops over n (<= max_ngram) unroll at trace
time.

PromptLookupDrafter (prompt lookup decoding; the "copy from the context" idea of Aggressive Decoding,
Ge et al. 2022, "Lossless Acceleration for Seq2seq Generation with Aggressive Decoding"):
    for n = max_ngram .. min_ngram: find the most recent earlier occurrence, in prompt + output, of
    the last n committed tokens; the draft is the k tokens that followed it. With `cyclic=True` (the
    default) a match whose continuation runs into the present (a repeat with period p = distance to
    the match) is extended by repeating that period, i.e. the draft keeps copying its own copied
    tokens, which is what the match predicts; with `cyclic=False` such drafts are cut (invalid nodes).
    Under a decode's constraint (`forced=True`, the default) the copy is kept while the constraint
    allows it and the chain then goes on with the tokens the constraint forces (`follow_constraint`).

AggressiveDrafter (Input-guided Aggressive Decoding, IAD, same paper; for editing tasks whose output
is mostly a copy of the input, e.g. grammatical error correction). Here the input is the prompt and
the output is everything generated after it. Alignment rule, from the paper's IAD:
    - before any output, output token t is aligned with input token t: the draft is the prompt from
      its first token (the paper's first aggressive step copies the whole input);
    - afterwards the alignment is re-found from the decoded suffix: for n = min_ngram .. max_ngram,
      look up the last n *output* tokens in the input; if they occur nowhere, stop; if exactly once,
      align the next output token with the input token after that occurrence; if several times, try
      a longer n (ambiguous at max_ngram = no new alignment);
    - difference from the paper: when no unique match exists the paper decodes one token at a time
      until one does; we keep drafting from the previous alignment (output index t -> input index
      t + offset of the last alignment), since a static-shape tree costs the same verified whether
      its nodes are valid or not.
    The draft is the next `num_nodes` input tokens from the aligned position; nodes past the end of
    the prompt are invalid.
"""
from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp

from jaxdecode.sampling import first_argmax
from jaxdecode.tree import chain_tree


def check_int(owner: str, name: str, value, minimum: int) -> int:
    """A static int option >= minimum, or a ValueError naming the drafter and the option."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _check_ngrams(owner: str, max_ngram, min_ngram) -> None:
    check_int(owner, "min_ngram", min_ngram, 1)
    check_int(owner, "max_ngram", max_ngram, 1)
    if min_ngram > max_ngram:
        raise ValueError(f"{owner}: min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")


def _shifted(history, t: int, fill: int = -1):
    """history[b, j - t] at column j (fill where j < t)."""
    return jnp.pad(history, ((0, 0), (t, 0)), constant_values=fill)[:, :history.shape[1]]


def suffix_match_maps(history, hist_len, max_ngram: int):
    """For n = 1..max_ngram, bool[B, H]: the n tokens ending at column j equal the last n committed
    tokens (history[hist_len-n : hist_len]). Columns j < n-1 are False; later columns are not masked
    (callers restrict j to the region they search)."""
    h = history.shape[1]
    pos = jnp.arange(h)[None, :]
    maps, eq = [], jnp.ones(history.shape, bool)
    for t in range(max_ngram):  # static: n <= max_ngram
        suffix_t = jnp.take_along_axis(history, jnp.clip(hist_len - 1 - t, 0, h - 1)[:, None], axis=1)
        eq = eq & (_shifted(history, t) == suffix_t) & (pos >= t) & ((hist_len - 1 - t) >= 0)[:, None]
        maps.append(eq)
    return maps


def _chain(tokens, valid):
    # Invalid nodes still go through the target's forward: give them an in-vocabulary token.
    return chain_tree(jnp.where(valid, tokens, 0).astype(jnp.int32), valid)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter:
    """Prompt lookup: continue the most recent earlier occurrence of the longest matching suffix n-gram
    (n = max_ngram .. min_ngram) in prompt + output; a chain of `num_nodes` tokens (see module doc)."""

    num_nodes: int = dataclasses.field(default=8, metadata=dict(static=True))
    max_ngram: int = dataclasses.field(default=3, metadata=dict(static=True))
    min_ngram: int = dataclasses.field(default=1, metadata=dict(static=True))
    cyclic: bool = dataclasses.field(default=True, metadata=dict(static=True))
    # Draft length by the size n of the matched n-gram: lengths[n - 1] tokens (a longer match is a
    # surer continuation), the rest of the chain invalid; None = num_nodes for every match. With it,
    # the engine verifies only the lengths in use (verify_widths).
    lengths: tuple | None = dataclasses.field(default=None, metadata=dict(static=True))
    # Under a decode's constraint: where the copy stops (no match, or its next token is forbidden), go
    # on with the tokens the constraint forces (states with exactly one allowed token: a schema's `":`,
    # a closing `}`, EOS), which every decode under it must emit (see `follow_constraint`).
    forced: bool = dataclasses.field(default=True, metadata=dict(static=True))

    child_rule = "point"
    is_chain = True
    max_depth = property(lambda self: self.num_nodes)
    history_only = True  # observe is the identity: see speculative.Drafter

    def __post_init__(self):
        check_int("PromptLookupDrafter", "num_nodes", self.num_nodes, 1)
        if not isinstance(self.forced, bool):
            raise ValueError(f"PromptLookupDrafter: forced must be True or False, got {self.forced!r}")
        _check_ngrams("PromptLookupDrafter", self.max_ngram, self.min_ngram)
        if self.lengths is not None:
            ls = tuple(self.lengths) if isinstance(self.lengths, (tuple, list)) else None
            if ls is None or len(ls) != self.max_ngram:
                raise ValueError(f"PromptLookupDrafter: lengths must list a draft length for each match "
                                 f"size 1..max_ngram={self.max_ngram}, got {self.lengths!r}")
            for n, k in enumerate(ls, 1):
                check_int("PromptLookupDrafter", f"lengths[{n - 1}]", k, 1)
                if k > self.num_nodes:
                    raise ValueError(f"PromptLookupDrafter: lengths[{n - 1}]={k} exceeds num_nodes="
                                     f"{self.num_nodes}")
            object.__setattr__(self, "lengths", tuple(int(k) for k in ls))

    @property
    def verify_widths(self):
        if self.lengths is None:
            return None
        return tuple(sorted(set(self.lengths[self.min_ngram - 1:]) | {self.num_nodes}))

    def init(self, prompt_tokens, prompt_lengths, cache_len, key):
        return ()  # stateless: everything it needs is in the history

    def lookup(self, history, hist_len):
        """(tokens int32[B, k], valid bool[B, k]) — the proposal, for tests and reuse."""
        b, h = history.shape
        pos = jnp.arange(h)[None, :]
        maps = suffix_match_maps(history, hist_len, self.max_ngram)
        # An earlier occurrence ends at j <= hist_len - 2 (the suffix itself ends at hist_len - 1).
        earlier = pos <= (hist_len - 2)[:, None]
        end = jnp.full((b,), -1, jnp.int32)
        limit = jnp.full((b,), self.num_nodes, jnp.int32)  # draft length for the match found
        for n in range(self.max_ngram, self.min_ngram - 1, -1):  # longest n-gram first
            last = jnp.max(jnp.where(maps[n - 1] & earlier, pos, -1), axis=1).astype(jnp.int32)
            if self.lengths is not None:
                limit = jnp.where((end < 0) & (last >= 0), self.lengths[n - 1], limit)
            end = jnp.where(end >= 0, end, last)
        found = end >= 0
        i = jnp.arange(self.num_nodes)[None, :]
        if self.cyclic:
            period = jnp.maximum(hist_len - 1 - end, 1)[:, None]
            idx = end[:, None] + 1 + i % period
            valid = jnp.broadcast_to(found[:, None], idx.shape)
        else:
            idx = end[:, None] + 1 + i
            valid = found[:, None] & (idx < hist_len[:, None])
        valid = valid & (i < limit[:, None])
        tokens = jnp.take_along_axis(history, jnp.clip(idx, 0, h - 1), axis=1)
        return tokens, valid

    def propose(self, state, ctx, sampler):
        tokens, valid = self.lookup(ctx.history, ctx.hist_len)
        constraint = getattr(ctx, "constraint", None)
        if self.forced and constraint is not None:
            tokens, valid = follow_constraint(constraint, ctx.cstate, tokens, valid)
        return _chain(tokens, valid), None, state

    def observe(self, state, obs):
        return state


def follow_constraint(constraint, cstate, tokens, valid):
    """A copied chain (tokens int32[B, K], valid bool[B, K]) walked under a constraint from the rows'
    states `cstate` (after the pending token): nodes keep the copy while it is allowed; from the first
    node where it is not (or has run out) the chain goes on with forced tokens, those of states that
    allow exactly one (EOS included at an accepting state with no way on), and ends at the first state
    that allows several. A copy is often cut by a constraint the target spells differently (the
    embedded target writes a schema's `{"name"` as `{` `"` `n` `a` `m` `e` where the prompt has
    `name`), yet the structural tokens between are forced: a verifier that decodes under the
    constraint accepts them whenever it accepts the path to them. Drafts stay point masses, so
    losslessness rests on the verifier as before."""
    def step(carry, x):
        s, copying, alive = carry
        tok, ok = x
        allowed = constraint.allowed(s)  # [B, V]
        n_allowed = jnp.sum(allowed, axis=1)
        copy_ok = copying & ok & jnp.take_along_axis(allowed, jnp.clip(tok, 0, allowed.shape[1] - 1)[:, None],
                                                     axis=1)[:, 0]
        only = first_argmax(allowed)  # the allowed token where exactly one is
        out = jnp.where(copy_ok, tok, only)
        keep = alive & (copy_ok | (n_allowed == 1))
        s = constraint.advance(s, jnp.where(keep, out, 0))
        return (s, copy_ok & keep, keep), (out, keep)

    b = tokens.shape[0]
    init = (cstate, jnp.ones((b,), bool), jnp.ones((b,), bool))
    _, (out, keep) = jax.lax.scan(step, init, (tokens.T.astype(jnp.int32), valid.T))
    return out.T, keep.T


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AggressiveState:
    prompt_len: jax.Array  # int32[B]
    offset: jax.Array  # int32[B]: input index of output token t is t + offset (last alignment)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AggressiveDrafter:
    """Input-guided aggressive decoding: copy the prompt aligned with the output position, re-aligned
    by the shortest unique suffix n-gram (see the module docstring for the exact rule)."""

    num_nodes: int = dataclasses.field(default=8, metadata=dict(static=True))
    max_ngram: int = dataclasses.field(default=3, metadata=dict(static=True))
    min_ngram: int = dataclasses.field(default=1, metadata=dict(static=True))

    child_rule = "point"
    is_chain = True
    max_depth = property(lambda self: self.num_nodes)
    history_only = True  # observe is the identity: see speculative.Drafter

    def __post_init__(self):
        check_int("AggressiveDrafter", "num_nodes", self.num_nodes, 1)
        _check_ngrams("AggressiveDrafter", self.max_ngram, self.min_ngram)

    def init(self, prompt_tokens, prompt_lengths, cache_len, key):
        b = prompt_tokens.shape[0]
        return AggressiveState(prompt_len=jnp.asarray(prompt_lengths, jnp.int32),
                               offset=jnp.zeros((b,), jnp.int32))

    def align(self, state: AggressiveState, history, hist_len):
        """Input index aligned with the next output token: int32[B] (new offset applied)."""
        h = history.shape[1]
        pos = jnp.arange(h)[None, :]
        plen = state.prompt_len
        out_len = hist_len - plen  # committed output tokens (the pending one included)
        maps = suffix_match_maps(history, hist_len, self.max_ngram)
        in_input = pos <= (plen - 1)[:, None]  # the occurrence lies inside the prompt
        decided = jnp.zeros(hist_len.shape, bool)
        start = jnp.full(hist_len.shape, -1, jnp.int32)
        for n in range(self.min_ngram, self.max_ngram + 1):  # shortest unique n-gram wins
            hits = maps[n - 1] & in_input
            count = hits.sum(axis=1)
            at = (jnp.max(jnp.where(hits, pos, -1), axis=1) + 1).astype(jnp.int32)  # after the match
            usable = n <= out_len  # the n-gram must consist of output tokens
            stop_none = ~usable | (count == 0)
            unique = usable & (count == 1)
            start = jnp.where(~decided & unique, at, start)
            decided = decided | stop_none | unique
        offset = jnp.where(start >= 0, start - out_len, state.offset)
        return out_len + offset, offset

    def propose(self, state: AggressiveState, ctx, sampler):
        src, offset = self.align(state, ctx.history, ctx.hist_len)
        idx = src[:, None] + jnp.arange(self.num_nodes)[None, :]
        valid = (idx >= 0) & (idx < state.prompt_len[:, None])
        tokens = jnp.take_along_axis(ctx.history, jnp.clip(idx, 0, ctx.history.shape[1] - 1), axis=1)
        return _chain(tokens, valid), None, dataclasses.replace(state, offset=offset)

    def observe(self, state, obs):
        return state
