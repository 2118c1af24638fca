"""Autoregressive decoding: one token per forward, as one jit-compiled `lax.while_loop`.

    decode(config, params, prompt_tokens[B, P], prompt_lengths[B], max_new_tokens=N, ...)
        -> DecodeOutput(tokens[B, N], lengths[B], stats={"target_calls": int32, "nonfinite_logits": bool[B]})

All rows are prefilled together in one forward (right-padded prompts, padded causal mask), then every
step feeds each live row's last token at its own position (= its own committed length). A row that
emits an id in `eos_ids` is finished: it stops advancing its cache and its later outputs are the pad
id (eos_ids[0], or 0 without EOS ids). The loop ends after N tokens or when every row is finished.

The first token comes from the prefill logits, so a decode of N tokens makes at most N forwards
(1 prefill + up to N - 1 steps); `target_calls` counts them.

Host-side checks (`validate_prompts`) run before jit and raise `PromptError` with what to fix; with
traced inputs (decode called inside a user's jit) only the shape checks can run.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import streaming
from jaxdecode.kernels.common import concrete
from jaxdecode.models import advance, forward, init_cache, padded_causal_mask, split_layers
from jaxdecode.models.transformer import output_logits
from jaxdecode.sampling import (SamplerConfig, greedy, mirostat_init, mirostat_step, mirostat_truncate,
                                process_logits, sample, token_presence, validate_mirostat)
from jaxdecode.scoring import LogprobRecord, check_logprob_flags, token_logprobs
from jaxdecode.sharding import check_auto_axes, under_auto_mesh

METHODS = ("greedy", "sample", "mirostat")
CACHE_LEN_MULTIPLE = 64


class PromptError(ValueError):
    """Prompts or decoding lengths that cannot be decoded as given."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeOutput:
    tokens: jax.Array  # int32[B, N]; after a row's EOS: the pad id
    lengths: jax.Array  # int32[B]: new tokens per row, including the EOS
    stats: dict  # {"target_calls": int32 scalar: forwards incl. the prefill,
    #              "nonfinite_logits": bool[B]: the row's logits held a NaN/inf while it was live}


# ----------------------------------------------------------------------------- host helpers
def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists into (prompt_tokens int32[B, P], prompt_lengths int32[B])."""
    rows = [np.asarray(p) for p in prompts]
    for i, r in enumerate(rows):
        if r.ndim != 1 or (r.size and not np.issubdtype(r.dtype, np.integer)):
            raise PromptError(f"prompt {i} must be a flat list of int token ids, got {prompts[i]!r:.80}")
    lengths = np.array([r.size for r in rows], np.int32)
    tokens = np.full((len(rows), int(lengths.max(initial=0))), pad_id, np.int32)
    for i, r in enumerate(rows):
        tokens[i, :r.size] = r
    return tokens, lengths


def default_cache_len(prompt_width: int, max_new_tokens: int, extra: int = 0) -> int:
    """Room for the longest prompt, the new tokens and `extra` scratch slots, rounded up to 64."""
    need = prompt_width + max_new_tokens + extra
    return int(math.ceil(need / CACHE_LEN_MULTIPLE) * CACHE_LEN_MULTIPLE)


def _concrete(name: str, x):
    """x as a numpy array, or None when it is a tracer (decode called inside jit)."""
    try:
        return concrete(x)
    except ValueError as e:  # ragged nested lists
        raise PromptError(f"{name} must be a rectangular int array; right-pad ragged token lists "
                          f"with pad_prompts ({e})") from None


def _check_count(name: str, value, minimum: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise PromptError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def validate_prompts(config, prompt_tokens, prompt_lengths, max_new_tokens: int,
                     cache_len: int | None = None, lookahead: int = 0):
    """Check prompts before jit; return (prompt_tokens, prompt_lengths) as int32 arrays.

    prompt_tokens: int[B, P] right-padded (ids past a row's length are ignored); prompt_lengths:
    int[B]. The width P is kept as given, so callers control the compiled shapes. `cache_len` None
    means the caller sizes the cache to fit (see default_cache_len). Raises PromptError naming the
    offending row and the fix. With traced inputs the value checks are skipped and the width P
    stands in for the longest prompt. lookahead: positions past a row's next token that a forward may
    hold (a speculative tree's depth), for the LongRoPE check (check_rope_switch).
    """
    max_new_tokens = _check_count("max_new_tokens", max_new_tokens, 1)
    if cache_len is not None:
        cache_len = _check_count("cache_len", cache_len, 1)
    tokens = _concrete("prompt_tokens", prompt_tokens)
    lengths = _concrete("prompt_lengths", prompt_lengths)
    shape_t = np.shape(prompt_tokens if tokens is None else tokens)
    shape_l = np.shape(prompt_lengths if lengths is None else lengths)
    if len(shape_t) != 2:
        raise PromptError(f"prompt_tokens must be 2-D [batch, prompt_len] (right-padded), got shape "
                          f"{shape_t}; use pad_prompts(list_of_token_lists)")
    if shape_l != shape_t[:1]:
        raise PromptError(f"prompt_lengths must have shape [batch] = {shape_t[:1]}, got {shape_l}")
    if shape_t[0] == 0:
        raise PromptError("the batch has zero rows; pass at least one prompt")
    for name, x, arr in (("prompt_tokens", prompt_tokens, tokens),
                         ("prompt_lengths", prompt_lengths, lengths)):
        dtype = (x if arr is None else arr).dtype
        if not np.issubdtype(dtype, np.integer):
            raise PromptError(f"{name} must hold integer token ids / lengths, got dtype {dtype}")
    if tokens is None or lengths is None:  # traced: only the static bound can be checked
        longest = shape_t[1]
    else:
        empty = np.flatnonzero(lengths <= 0)
        if empty.size:
            raise PromptError(f"empty prompt: row {int(empty[0])} has length {int(lengths[empty[0]])}; "
                              "every row needs at least one token (e.g. a BOS token)")
        over = np.flatnonzero(lengths > shape_t[1])
        if over.size:
            i = int(over[0])
            raise PromptError(f"row {i} has prompt_length {int(lengths[i])} but prompt_tokens is only "
                              f"{shape_t[1]} wide")
        longest = int(lengths.max())
        valid = np.arange(shape_t[1])[None, :] < lengths[:, None]
        bad = valid & ((tokens < 0) | (tokens >= config.vocab_size))
        if bad.any():
            i, j = (int(a) for a in np.argwhere(bad)[0])
            raise PromptError(f"token id {int(tokens[i, j])} at row {i}, position {j} is outside the "
                              f"vocabulary [0, {config.vocab_size}); ids must be in "
                              f"0..{config.vocab_size - 1}")
        prompt_tokens, prompt_lengths = tokens, lengths
    total = longest + max_new_tokens
    if cache_len is not None and shape_t[1] > cache_len:
        raise PromptError(f"prompt_tokens is {shape_t[1]} wide but the cache has only {cache_len} "
                          "slots; raise cache_len or drop padding columns")
    if cache_len is not None and total > cache_len:
        raise PromptError(f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = "
                          f"{total} does not fit the cache of {cache_len} slots; raise cache_len or "
                          f"shorten the prompt / max_new_tokens")
    if total > config.max_position_embeddings:
        raise PromptError(f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = "
                          f"{total} exceeds the model's max_position_embeddings "
                          f"({config.max_position_embeddings}); shorten the prompt or max_new_tokens")
    check_rope_switch(config, lengths if tokens is not None and lengths is not None else None, shape_t[1],
                      max_new_tokens, lookahead)
    return jnp.asarray(prompt_tokens, jnp.int32), jnp.asarray(prompt_lengths, jnp.int32)


def check_rope_switch(config, lengths, width: int, max_new_tokens: int, lookahead: int = 0) -> None:
    """A LongRoPE model (Phi-3) takes its long factors in a forward whose sequence reaches
    original_max_position_embeddings (models.config.rope_switch_position); transformers' generate then
    recomputes the whole cache with them. jaxdecode keeps the cache, so a row's forwards must stay on one
    side: they hold positions from prompt_length - 2 (a speculative decode prefills all but the last prompt
    token) to prompt_length + max_new_tokens - 2 + lookahead. lengths None (traced): any prompt up to `width`
    tokens must stay on one side."""
    from jaxdecode.models.config import rope_switch_position
    switch = rope_switch_position(config)
    if switch is None:
        return
    reach = max_new_tokens - 2 + lookahead  # the furthest position a row's forwards hold, past its prompt
    if lengths is None:
        if min(width, switch + 1) + reach >= switch:
            raise PromptError(f"this model's LongRoPE switches to its long factors at position {switch} "
                              f"(original_max_position_embeddings), and the prompts are traced: keep the prompt "
                              f"width ({width}) + max_new_tokens ({max_new_tokens}) within {switch + 1 - lookahead}")
        return
    lengths = np.asarray(lengths)
    cross = np.flatnonzero((lengths - 2 < switch) & (lengths + reach >= switch))
    if cross.size:
        i = int(cross[0])
        raise PromptError(
            f"row {i}'s prompt ({int(lengths[i])} tokens) + max_new_tokens ({max_new_tokens}) crosses position "
            f"{switch} (original_max_position_embeddings), where this model's LongRoPE switches from its short to "
            f"its long factors for the whole sequence: transformers' generate recomputes the cache there, "
            f"jaxdecode does not. Keep prompt + max_new_tokens <= {switch + 1 - lookahead}, or decode a prompt "
            f"of more than {switch + 1} tokens (the long factors throughout)")


def validate_eos_ids(config, eos_ids) -> tuple:
    eos_ids = tuple(eos_ids)
    for e in eos_ids:
        if not isinstance(e, numbers.Integral) or isinstance(e, bool) or not 0 <= e < config.vocab_size:
            raise PromptError(f"eos_ids must be token ids in [0, {config.vocab_size}), got {eos_ids!r}")
    return tuple(int(e) for e in eos_ids)


def pad_id_for(eos_ids: tuple) -> int:
    return eos_ids[0] if eos_ids else 0


def nonfinite_rows(logits, live, valid=None):
    """bool[B]: live rows whose logits [B, ..., V] hold a NaN or inf (only where valid [B, ...] is True).

    Every decoder loop ORs this into a per-row flag (stats["nonfinite_logits"]): the sampler would
    otherwise turn NaN logits into token 0 without a trace (NaN weights, low-precision overflow)."""
    bad = ~jnp.all(jnp.isfinite(logits), axis=-1)
    if valid is not None:
        bad = bad & valid
    return jnp.any(bad.reshape(bad.shape[0], -1), axis=1) & live


def is_eos(tokens, eos_ids: tuple):
    """bool[...]: tokens[...] is one of the (static) eos_ids."""
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.any(tokens[..., None] == jnp.asarray(eos_ids, tokens.dtype), axis=-1)


# ----------------------------------------------------------------------------- jit-able parts
def prefill(config, params, prompt_tokens, prompt_lengths, cache, return_layers: tuple = (),
            with_hidden: bool = False):
    """Run every row's prompt in one padded forward and commit it. Returns (last_logits[B, V], cache),
    and the forward's `hidden` dict third when `with_hidden` (feature drafters read the prompt's
    hidden states; `return_layers` as in models.forward).

    The prompt goes after whatever the cache already holds (normally nothing). Padding tokens are
    replaced by id 0 at the row's last position, masked out for everyone, and left uncommitted.
    """
    b, p = prompt_tokens.shape
    offsets = jnp.arange(p, dtype=jnp.int32)[None, :]
    valid = offsets < prompt_lengths[:, None]  # [B, P]
    tokens = jnp.where(valid, prompt_tokens, 0)
    # Clamped positions keep padding inside the position table (GPT-2 learned positions).
    positions = cache.lengths[:, None] + jnp.clip(offsets, 0, jnp.maximum(prompt_lengths[:, None] - 1, 0))
    _, hidden, cache = forward(config, params, tokens, positions, cache, padded_causal_mask(valid),
                               return_layers=tuple(return_layers))
    # The LM head at each row's last prompt token only (XLA drops the forward's unused [B, P, V] logits):
    # all of them were P times its work and, with a large vocabulary, the prefill's largest array.
    h_last = jnp.take_along_axis(hidden["final"], (jnp.maximum(prompt_lengths, 1) - 1)[:, None, None], axis=1)
    last = output_logits(config, params, h_last)[:, 0]  # [B, V]
    if with_hidden:
        return last, advance(cache, prompt_lengths), hidden
    return last, advance(cache, prompt_lengths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _DecodeState:
    step: jax.Array  # int32: tokens emitted so far (= next output column)
    tokens: jax.Array  # int32[B, N]
    done: jax.Array  # bool[B]
    n_new: jax.Array  # int32[B]
    cache: object
    key: jax.Array
    seen: jax.Array | None  # bool[B, V] (repetition penalty only)
    mu: jax.Array  # f32[B] Mirostat maximal surprise
    calls: jax.Array  # int32
    nonfinite: jax.Array  # bool[B]: the model's logits held a NaN/inf at a step where the row was live
    cstate: object = None  # constraint state per row, or None
    logprobs: LogprobRecord | None = None  # per output column (logprobs=True only)

    def replace(self, **kw) -> "_DecodeState":
        return dataclasses.replace(self, **kw)


def _choose(method, sampler, key, logits, seen, mu, tau, eta):
    """The next token per row, Mirostat's updated mu, and the log-probs [B, V] of the distribution the
    token was drawn from (what logprobs=True reports; XLA drops them when unused). Greedy: the
    softmax of the logits after the repetition penalty (transformers' normalised scores), not the
    point mass; Mirostat: its truncated, renormalised distribution."""
    logprobs = process_logits(logits, sampler, seen)
    if method == "greedy":
        scores = process_logits(logits, SamplerConfig(repetition_penalty=sampler.repetition_penalty), seen)
        return greedy(logprobs), mu, scores
    if method == "sample":
        return sample(key, logprobs), mu, logprobs
    token, new_mu = mirostat_step(key, logprobs, mu, tau, eta)
    return token, new_mu, mirostat_truncate(logprobs, mu)


def _emit(state: _DecodeState, token, new_mu, eos_ids: tuple) -> _DecodeState:
    """Record this step's token for live rows (pad for finished ones) and update per-row status."""
    live = ~state.done
    token = jnp.where(live, token, pad_id_for(eos_ids))
    seen = state.seen
    if seen is not None:
        seen = seen | (jax.nn.one_hot(token, seen.shape[-1], dtype=bool) & live[:, None])
    return state.replace(
        step=state.step + 1, tokens=state.tokens.at[:, state.step].set(token),
        done=state.done | (live & is_eos(token, eos_ids)), n_new=state.n_new + live.astype(jnp.int32),
        seen=seen, mu=jnp.where(live, new_mu, state.mu))


def _constrain(state: _DecodeState, logits, constraint):
    """Logits with the tokens the constraint forbids set to -inf (finished rows are left alone)."""
    allowed = constraint.allowed(state.cstate, logits.shape[-1])
    return jnp.where(allowed | state.done[:, None], logits, -jnp.inf)


def _advance_constraint(old: _DecodeState, new: _DecodeState, token, constraint) -> _DecodeState:
    """Move live rows' constraint states along their token; a row whose item is complete is done."""
    live = ~old.done
    moved = constraint.advance(old.cstate, token)
    from jaxdecode.constraints.protocol import select_rows  # constraints.search imports this module
    cstate = select_rows(live, moved, old.cstate)
    return new.replace(cstate=cstate, done=new.done | (live & constraint.complete(cstate)))


@partial(jax.jit, static_argnames=("config", "max_new_tokens", "sampler", "eos_ids", "cache_len",
                                   "method", "logprobs", "top_logprobs"))
def _decode(config, params, prompt_tokens, prompt_lengths, key, tau, eta, constraint=None, stream_handle=None, *,
            max_new_tokens, sampler, eos_ids, cache_len, method, logprobs=False, top_logprobs=0):
    b = prompt_tokens.shape[0]
    cache = init_cache(config, b, cache_len)
    logits, cache = prefill(config, params, prompt_tokens, prompt_lengths, cache)
    seen = None
    if sampler.uses_seen_tokens:
        valid = jnp.arange(prompt_tokens.shape[1])[None, :] < prompt_lengths[:, None]
        seen = token_presence(prompt_tokens, valid, config.vocab_size)
    state = _DecodeState(
        step=jnp.int32(0), tokens=jnp.full((b, max_new_tokens), pad_id_for(eos_ids), jnp.int32),
        done=jnp.zeros((b,), bool), n_new=jnp.zeros((b,), jnp.int32), cache=cache, key=key,
        seen=seen, mu=mirostat_init(b, tau), calls=jnp.int32(1), nonfinite=jnp.zeros((b,), bool),
        cstate=None if constraint is None else constraint.init(b),
        logprobs=LogprobRecord.empty(b, max_new_tokens, top_logprobs) if logprobs else None)

    def choose_and_emit(state, logits):
        key, sub = jax.random.split(state.key)
        # The model's own logits, before the constraint's -inf masking.
        state = state.replace(nonfinite=state.nonfinite | nonfinite_rows(logits, ~state.done))
        if constraint is not None:
            logits = _constrain(state, logits, constraint)
        token, mu, dist = _choose(method, sampler, sub, logits, state.seen, state.mu, tau, eta)
        if logprobs:  # column `step` of the live rows (finished rows keep the padding)
            cols = [None if x is None else x[:, None] for x in token_logprobs(dist, token, top_logprobs)]
            state = state.replace(logprobs=state.logprobs.write(state.step, ~state.done[:, None], *cols))
        new = _emit(state.replace(key=key), token, mu, eos_ids)
        new = new if constraint is None else _advance_constraint(state, new, token, constraint)
        if stream_handle is not None:  # streaming: the output so far to the host every few tokens; rows end if abandoned
            new = new.replace(done=new.done | streaming.emit(stream_handle, new.tokens, 0, state.n_new, new.n_new,
                                                             new.done))
        return new

    def cond(state):
        return (state.step < max_new_tokens) & ~jnp.all(state.done)

    def body(state):
        last = state.tokens[:, state.step - 1]
        cache = state.cache
        logits, _, cache = forward(config, params, last[:, None], cache.lengths[:, None], cache,
                                   jnp.ones((b, 1, 1), bool))
        # Finished rows ran along (static shapes) but do not commit their token.
        cache = advance(cache, (~state.done).astype(jnp.int32))
        state = state.replace(cache=cache, calls=state.calls + 1)
        return choose_and_emit(state, logits[:, 0])

    state = jax.lax.while_loop(cond, body, choose_and_emit(state, logits))
    stats = {"target_calls": state.calls, "nonfinite_logits": state.nonfinite}
    if logprobs:
        stats.update(state.logprobs.stats(max_new_tokens, state.n_new))
    return DecodeOutput(tokens=state.tokens, lengths=state.n_new, stats=stats)


def resolve_method(method: str, sampler: SamplerConfig) -> tuple[str, SamplerConfig]:
    """Canonical (method, sampler): temperature 0 means greedy, and greedy ignores truncation."""
    if method not in METHODS:
        raise ValueError(f"unknown decoding method {method!r}; choose one of {METHODS}")
    if not isinstance(sampler, SamplerConfig):
        raise TypeError(f"sampler must be a SamplerConfig, got {type(sampler).__name__}")
    if method == "greedy" or sampler.is_greedy:
        return "greedy", SamplerConfig(temperature=0.0, repetition_penalty=sampler.repetition_penalty)
    return method, sampler


@under_auto_mesh
def decode(config, params, prompt_tokens, prompt_lengths, *, max_new_tokens: int,
           sampler: SamplerConfig = SamplerConfig(), eos_ids: tuple = (), key=None,
           cache_len: int | None = None, method: str = "sample", mirostat_tau: float = 5.0,
           mirostat_eta: float = 0.1, constraint=None, logprobs: bool = False,
           top_logprobs: int = 0, stream=None) -> DecodeOutput:
    """Decode up to max_new_tokens per row. See the module docstring.

    method: "greedy" (argmax after the repetition penalty), "sample" (the SamplerConfig distribution)
    or "mirostat" (Mirostat v2 over the SamplerConfig distribution; tau in bits). temperature 0 means
    greedy for every method. `key` (a JAX PRNG key) is required unless decoding is greedy.
    constraint: a Constraint (jaxdecode.constraints): each step the logits of the tokens it does not
    allow are set to -inf before the sampler, and a row whose item is complete (an EOS id, or a final
    leaf without EOS ids) is finished. Masked sampling draws prod_i p(x_i | x_<i, allowed), not
    p(x | x in the set) (ALGORITHMS.md §6, ASAp).
    logprobs / top_logprobs (static): stats add each new token's log-prob under the distribution it was
    drawn from, and the top_logprobs best alternatives (jaxdecode.scoring; top_logprobs > 0 implies
    logprobs). Greedy reports the softmax of the logits after the repetition penalty and constraint.
    stream: a jaxdecode.streaming.TokenSink: the rows' output goes to it from inside the loop every
    `sink.every` tokens (a host callback; the compiled program does not depend on which sink). None: no
    callback is traced.
    """
    logprobs, top_logprobs = check_logprob_flags(logprobs, top_logprobs)
    method, sampler = resolve_method(method, sampler)
    eos_ids = validate_eos_ids(config, eos_ids)
    check_auto_axes(params=params, prompt_tokens=prompt_tokens, prompt_lengths=prompt_lengths)
    prompt_tokens, prompt_lengths = validate_prompts(config, prompt_tokens, prompt_lengths,
                                                     max_new_tokens, cache_len)
    if cache_len is None:
        cache_len = default_cache_len(prompt_tokens.shape[1], max_new_tokens)
    if method == "mirostat":
        validate_mirostat(mirostat_tau, mirostat_eta)
    if key is None:
        if method != "greedy":
            raise ValueError(f"method={method!r} samples: pass key=jax.random.key(seed)")
        key = jax.random.key(0)  # unused by greedy decoding
    if constraint is not None:
        constraint = constraint.prepare(config.vocab_size, eos_ids, max_new_tokens, prompt_tokens.shape[0])
    stream_handle = streaming.operand(stream, prompt_tokens.shape[0], max_new_tokens)
    return _decode(config, split_layers(config, params), prompt_tokens, prompt_lengths, key,
                   jnp.float32(mirostat_tau), jnp.float32(mirostat_eta), constraint, stream_handle,
                   max_new_tokens=max_new_tokens, sampler=sampler, eos_ids=eos_ids,
                   cache_len=cache_len, method=method, logprobs=logprobs, top_logprobs=top_logprobs)
