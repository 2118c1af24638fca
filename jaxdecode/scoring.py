"""Log-probs: of the tokens a decoder emits (inside its loop), and of given texts (scoring, `echo`).

Decoders (jaxdecode.autoregressive, jaxdecode.speculative) record, when asked by a static flag, each
emitted token's log-prob under the distribution it was drawn from and the top-n alternatives of that
distribution into a `LogprobRecord`; `LogprobRecord.stats` turns it into the stats keys

    "logprobs"        f32[B, N]     the token's log-prob; 0 after the row's end (so a row sums to its
                                    sequence log-prob)
    "top_logprobs"    f32[B, N, n]  the n largest log-probs, best first (ties: lower id); -inf padding
    "top_logprob_ids" int32[B, N, n] their token ids; -1 where the log-prob is -inf (outside the
                                    distribution's support: no alternative) and after the row's end

`prompt_logprobs` / `score` run the model once over given token lists (one jit-compiled forward over
the right-padded batch) and return log p(x_i | x_<i) for every position i >= 1 (nothing predicts x_0).
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# What a column after a row's end holds.
PAD_LOGPROB, PAD_TOP_LOGPROB, PAD_TOP_ID = 0.0, -jnp.inf, -1
MAX_TOP_LOGPROBS = 20  # the top_logprobs option's range (jaxdecode.options)


def check_logprob_flags(logprobs, top_logprobs) -> tuple[bool, int]:
    """(logprobs, top_logprobs) as the decoders' static flags; top_logprobs > 0 implies logprobs."""
    if not isinstance(logprobs, (bool, np.bool_)):
        raise ValueError(f"logprobs must be True or False, got {logprobs!r}")
    if (not isinstance(top_logprobs, (int, np.integer)) or isinstance(top_logprobs, bool)
            or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
        raise ValueError(f"top_logprobs must be an int in 0..{MAX_TOP_LOGPROBS} (alternatives per token), "
                         f"got {top_logprobs!r}")
    return bool(logprobs) or top_logprobs > 0, int(top_logprobs)


def token_logprobs(dist, tokens, top_n: int):
    """Log-probs of `tokens` [...] under dist [..., V] (normalised log-probs), and the top_n of dist.

    Returns (lp f32[...], top f32[..., n] best first, top_ids int32[..., n]); the last two are None
    when top_n == 0. Alternatives at -inf (outside the support) get id -1."""
    lp = jnp.take_along_axis(dist, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if top_n == 0:
        return lp, None, None
    top, ids = jax.lax.top_k(dist, top_n)  # ties: lower id first
    return lp, top, jnp.where(top > -jnp.inf, ids.astype(jnp.int32), PAD_TOP_ID)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogprobRecord:
    """Per-row output columns of log-probs, written as a decoder writes its tokens."""
    logprobs: jax.Array  # f32[B, C]
    top_logprobs: jax.Array | None  # f32[B, C, n] (None: top_n == 0)
    top_ids: jax.Array | None  # int32[B, C, n]

    @staticmethod
    def empty(batch: int, columns: int, top_n: int) -> "LogprobRecord":
        if top_n == 0:
            return LogprobRecord(jnp.full((batch, columns), PAD_LOGPROB, jnp.float32), None, None)
        return LogprobRecord(jnp.full((batch, columns), PAD_LOGPROB, jnp.float32),
                             jnp.full((batch, columns, top_n), PAD_TOP_LOGPROB, jnp.float32),
                             jnp.full((batch, columns, top_n), PAD_TOP_ID, jnp.int32))

    def write(self, start, keep, lp, top=None, top_ids=None) -> "LogprobRecord":
        """Columns start[b] .. start[b] + K - 1 of each row := lp [B, K] (top [B, K, n]) where keep
        [B, K], padding elsewhere. start: int32[B] or a scalar (every row at the same column)."""
        b, k = lp.shape
        start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (b,))
        put = jax.vmap(lambda buf, new, s: jax.lax.dynamic_update_slice_in_dim(buf, new, s, axis=0))
        out = dict(logprobs=put(self.logprobs, jnp.where(keep, lp, PAD_LOGPROB), start))
        if self.top_logprobs is not None:
            out.update(top_logprobs=put(self.top_logprobs, jnp.where(keep[..., None], top, PAD_TOP_LOGPROB), start),
                       top_ids=put(self.top_ids, jnp.where(keep[..., None], top_ids, PAD_TOP_ID), start))
        return dataclasses.replace(self, **out)

    def stats(self, columns: int, lengths) -> dict:
        """The stats keys (module docstring) of the first `columns` columns, padded past lengths [B]."""
        live = jnp.arange(columns)[None, :] < lengths[:, None]  # [B, C]
        out = {"logprobs": jnp.where(live, self.logprobs[:, :columns], PAD_LOGPROB)}
        if self.top_logprobs is not None:
            out["top_logprobs"] = jnp.where(live[..., None], self.top_logprobs[:, :columns], PAD_TOP_LOGPROB)
            out["top_logprob_ids"] = jnp.where(live[..., None], self.top_ids[:, :columns], PAD_TOP_ID)
        return out


LOGPROB_STATS = ("logprobs", "top_logprobs", "top_logprob_ids")  # per-row stats keys of the decoders


# ----------------------------------------------------------------------------- scoring given tokens
@partial(jax.jit, static_argnames=("config",))
def _score_padded(config, params, tokens, lengths):
    """f32[B, P]: entry i (1 <= i < lengths[b]) = log p(tokens[b, i] | tokens[b, :i]); 0 elsewhere."""
    from jaxdecode.models import forward, padded_causal_mask
    b, p = tokens.shape
    valid = jnp.arange(p)[None, :] < lengths[:, None]  # [B, P]
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, _, _ = forward(config, params, jnp.where(valid, tokens, 0), positions, None,
                           padded_causal_mask(valid))  # [B, P, V]
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)  # [B, P-1, V]: predicts i + 1
    got = jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]  # [B, P-1]
    return jnp.pad(jnp.where(valid[:, 1:], got, 0.0), ((0, 0), (1, 0)))


def _check_token_lists(config, token_lists) -> list[list[int]]:
    from jaxdecode.autoregressive import PromptError
    if getattr(config, "is_diffusion", False):
        raise ValueError(f"this checkpoint is a masked-diffusion LM (attention={config.attention!r}): it has no "
                         f"left-to-right log-probs p(x_i | x_<i) to score or echo; use a causal LM")
    if isinstance(token_lists, (str, bytes)) or not isinstance(token_lists, Sequence) or not token_lists:
        raise PromptError("token_lists must be a non-empty list of token-id lists")
    out = []
    for i, ids in enumerate(token_lists):
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise PromptError(f"sequence {i} must be a non-empty flat list of int token ids, got {ids!r:.80}")
        bad = np.flatnonzero((arr < 0) | (arr >= config.vocab_size))
        if bad.size:
            raise PromptError(f"token id {int(arr[bad[0]])} at sequence {i}, position {int(bad[0])} is outside "
                              f"the vocabulary [0, {config.vocab_size})")
        if arr.size > config.max_position_embeddings:
            raise PromptError(f"sequence {i} has {arr.size} tokens, more than the model's "
                              f"max_position_embeddings ({config.max_position_embeddings}); shorten it")
        out.append([int(t) for t in arr])
    return out


def prompt_logprobs(model, token_lists, mesh=None) -> list[list[float | None]]:
    """log p(x_i | x_<i) of every token of every list (entry 0 is None: nothing predicts it).

    One forward over the right-padded batch (width rounded up to a multiple of 64, so nearby lengths
    share one compiled program). mesh: a (data, model) Mesh: rows over data, parameters over model."""
    from jaxdecode.autoregressive import pad_prompts
    from jaxdecode.kernels.common import round_up
    lists = _check_token_lists(model.config, token_lists)
    tokens, lengths = pad_prompts(lists)
    width = min(round_up(tokens.shape[1], 64), model.config.max_position_embeddings)
    tokens = np.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))
    params = model.params
    if mesh is not None:
        from jaxdecode.sharding import check_mesh, shard_batch, shard_params
        check_mesh(mesh)
        params, tokens, lengths = shard_params(params, mesh), shard_batch(tokens, mesh), shard_batch(lengths, mesh)
    from jaxdecode.sharding import mesh_context, to_host
    with mesh_context(mesh):
        lp = np.asarray(to_host(_score_padded(model.config, params, jnp.asarray(tokens), jnp.asarray(lengths))))
    return [[None] + [float(x) for x in lp[b, 1:len(ids)]] for b, ids in enumerate(lists)]


@dataclasses.dataclass(frozen=True)
class Score:
    """One sequence's score: its tokens, log p(token_i | tokens before it) (None for the first) and
    their sum (the sequence's log-prob given its first token)."""
    tokens: list[int]
    logprobs: list[float | None]
    total: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def score(model, texts_or_ids, mesh=None, add_special_tokens: bool = True) -> list[Score]:
    """Score texts (encoded with the model's tokenizer, its special tokens included unless
    add_special_tokens=False) or token-id lists (as given) under the model: one `Score` per sequence.
    The first token is only conditioned on (no log-prob): a tokenizer that adds BOS makes every text
    token scored."""
    items = texts_or_ids
    if isinstance(items, str) or (isinstance(items, Sequence) and items
                                  and isinstance(items[0], (int, np.integer))):
        items = [items]
    if isinstance(items, (bytes, dict)) or not isinstance(items, Sequence) or len(items) == 0:
        raise ValueError("score() takes a text, a token-id list, or a non-empty list of either")
    lists = [model.encode(x, add_special_tokens=add_special_tokens) if isinstance(x, str) else x for x in items]
    for i, ids in enumerate(lists):
        if isinstance(items[i], str) and not ids:
            raise ValueError(f"text {i} encodes to no tokens; there is nothing to score")
    out = []
    for ids, lps in zip(lists, prompt_logprobs(model, lists, mesh=mesh)):
        out.append(Score(tokens=[int(t) for t in ids], logprobs=lps, total=float(sum(lps[1:]))))
    return out
