"""Constrained decoders: beam search, greedy and sampling over an item index, with a model or with any
logits function (the STATIC benchmark harness and the exactness tests).

    constrained_beam_search(config, params, prompt_tokens, prompt_lengths, constraint, num_beams=K,
                            max_new_tokens=N, ...) -> ConstrainedBeamOutput
    trie_beam_search(constraint, logits_fn, fn_params, batch, num_beams=K, max_new_tokens=N, ...)
    constrained_decode(config, params, prompt_tokens, prompt_lengths, constraint, ...) -> DecodeOutput

The model decoders are jaxdecode.beam.beam_search / jaxdecode.autoregressive.decode with
`constraint=`; this module adds the `valid` flags (a row whose set has fewer items than beams gets
invalid extra beams, never made-up ones) and the model-free loop, which runs the very same beam step
(`jaxdecode.beam._select` over `TrieConstraint.candidates`) with logits from
`logits_fn(fn_params, tokens[R, N], step) -> [R, V]` (tokens: each beam's tokens so far, pad after).
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxdecode.autoregressive import DecodeOutput, decode, pad_id_for
from jaxdecode.beam import (BeamConfigError, _BeamState, _constrained_first, _constrained_select, _real, _select,
                            beam_search)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConstrainedBeamOutput:
    tokens: jax.Array  # int32[B, K, N], best first; pad id after each length
    lengths: jax.Array  # int32[B, K]: tokens incl. the EOS
    scores: jax.Array  # f32[B, K]: sum logprob / length ** length_penalty; -inf for invalid beams
    valid: jax.Array  # bool[B, K]: the beam is an item of its row's set (False: fewer items than beams)
    stats: dict


def constrained_beam_search(config, params, prompt_tokens, prompt_lengths, constraint, *, num_beams: int,
                            max_new_tokens: int, length_penalty: float = 1.0, eos_ids: tuple = (),
                            cache_len: int | None = None) -> ConstrainedBeamOutput:
    """Beam search whose every hypothesis is an item of the row's set (constraint: TrieConstraint)."""
    out = beam_search(config, params, prompt_tokens, prompt_lengths, max_new_tokens=max_new_tokens,
                      num_beams=num_beams, length_penalty=length_penalty, eos_ids=eos_ids,
                      cache_len=cache_len, constraint=constraint)
    return ConstrainedBeamOutput(tokens=out.tokens, lengths=out.lengths, scores=out.scores,
                                 valid=out.scores > -jnp.inf, stats=out.stats)


def constrained_decode(config, params, prompt_tokens, prompt_lengths, constraint, **kw) -> DecodeOutput:
    """Greedy / sampled decoding restricted to the constraint's items (masking; see decode())."""
    return decode(config, params, prompt_tokens, prompt_lengths, constraint=constraint, **kw)


@partial(jax.jit, static_argnames=("logits_fn", "batch", "num_beams", "max_new_tokens", "length_penalty",
                                   "eos_ids", "vocab_size"))
def _trie_beam_search(constraint, fn_params, *, logits_fn, batch, num_beams, max_new_tokens, length_penalty,
                      eos_ids, vocab_size):
    b, k, n = batch, num_beams, max_new_tokens
    pad = pad_id_for(eos_ids)
    run_scores = jnp.where(jnp.arange(k) == 0, 0.0, -jnp.inf) * jnp.ones((b, 1, 1), jnp.float32)
    state = _BeamState(
        step=jnp.int32(0), run_tokens=jnp.full((b, 1, k, n), pad, jnp.int32), run_scores=run_scores,
        fin_tokens=jnp.full((b, 1, k, n), pad, jnp.int32), fin_scores=jnp.full((b, 1, k), -jnp.inf, jnp.float32),
        fin_lengths=jnp.zeros((b, 1, k), jnp.int32), done=jnp.zeros((b, 1), bool),
        parents=jnp.arange(b * k, dtype=jnp.int32), cache=None, calls=jnp.int32(1),
        nonfinite=jnp.zeros((b,), bool))
    select = partial(_select, max_new_tokens=n, length_penalty=length_penalty, diversity_penalty=0.0,
                     eos_ids=eos_ids)
    logits = logits_fn(fn_params, state.run_tokens[:, 0, 0], jnp.int32(0))  # [B, V]
    state = _constrained_first(select, state, constraint, logits, b, 1, k)

    def cond(state):
        return (state.step < n) & ~jnp.all(state.done)

    def body(state):
        logits = logits_fn(fn_params, state.run_tokens.reshape(b * k, n), state.step)
        state = state.replace(calls=state.calls + 1)
        return _constrained_select(select, state, constraint, logits, b, 1, k)

    state = jax.lax.while_loop(cond, body, state)
    scores = state.fin_scores.reshape(b, k)
    order = jnp.argsort(-scores, axis=1, stable=True)
    scores = jnp.take_along_axis(scores, order, axis=1, mode="clip")
    valid = scores > -jnp.inf
    lengths = jnp.where(valid, jnp.take_along_axis(state.fin_lengths.reshape(b, k), order, axis=1, mode="clip"), 0)
    tokens = jnp.take_along_axis(state.fin_tokens.reshape(b, k, n), order[:, :, None], axis=1, mode="clip")
    tokens = jnp.where(jnp.arange(n) < lengths[:, :, None], tokens, pad)
    return ConstrainedBeamOutput(tokens=tokens, lengths=lengths, scores=scores, valid=valid,
                                 stats={"logits_calls": state.calls})


def trie_beam_search(constraint, logits_fn, fn_params, batch: int, *, num_beams: int, max_new_tokens: int,
                     vocab_size: int, length_penalty: float = 1.0, eos_ids: tuple = ()) -> ConstrainedBeamOutput:
    """Constrained beam search driven by `logits_fn(fn_params, tokens[R, N], step) -> logits[R, V]`
    (R = batch * num_beams rows; at step 0, R = batch) instead of a model: the same beam step as
    beam_search(constraint=...). logits_fn must be hashable (a module-level function)."""
    for name, value in (("batch", batch), ("num_beams", num_beams), ("max_new_tokens", max_new_tokens),
                        ("vocab_size", vocab_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BeamConfigError(f"{name} must be an int >= 1, got {value!r}")
    length_penalty = _real("length_penalty", length_penalty)
    eos_ids = tuple(int(e) for e in eos_ids)
    constraint = constraint.prepare(vocab_size, eos_ids, max_new_tokens, batch)
    return _trie_beam_search(constraint, fn_params, logits_fn=logits_fn, batch=batch, num_beams=num_beams,
                             max_new_tokens=max_new_tokens, length_penalty=length_penalty, eos_ids=eos_ids,
                             vocab_size=vocab_size)


__all__ = ["ConstrainedBeamOutput", "constrained_beam_search", "constrained_decode", "trie_beam_search"]
