"""Masked-diffusion decoding: one jit-compiled `lax.while_loop` over answer slots, one commit rule per paper.

    diffusion_decode(config, params, prompt_tokens[B,P], prompt_lengths[B], *, answer_length=A,
                     rule=Greedy1(), block_length=..., eos_ids=(), ...) -> DiffusionOutput

Layout. Row b's prompt (right-padded input, as everywhere in jaxdecode) is followed directly by its A_b
answer slots (A_b = answer_lengths[b] <= A), so slot j sits at position P_b + j; columns past
P_b + A_b are padding nobody attends to. The slots start as the MASK id and are filled ("committed")
in place; a committed token is never changed again.

One iteration: a model forward gives, per answer slot, the logits of its token (with `logits_shift`
1, Dream / Fast-dLLM v2, the logit at position i predicts token i + 1, so slot j reads column
P_b + j - 1); the rule decides which *eligible* slots to commit and with which token. Eligible slots
are the masked slots of the row's current semi-autoregressive block (the first block of
`block_length` slots that still has a masked slot), before the row's first committed EOS. Every
rule commits at least one eligible slot per forward (the loop adds the most confident one if a rule
chose none), so the loop ends after at most A forwards per row.

EOS: a row's answer ends at its first committed EOS; the slots after it are padding — set to the pad
id (eos_ids[0]) at once, never decoded, and the model sees them as that id (the padding of LLaDA-style
training). A row is finished when no masked slot is left before its end.

Stats: "nfe" int32[B] (forwards the row took part in while live), "tokens_per_forward" f32[B]
(committed answer tokens / nfe), "steps" int32 (loop iterations of the batch), "unfinished" bool[B]
(max_forwards ran out while the row still had masked slots: those slots hold the MASK id).

KV caches (`cache=`):
- "none": every forward runs over prompt + whole answer (exact).
- "prefix" / "dual" (Fast-dLLM's approximate caches, bidirectional models): when a row enters a new
  block, one forward over everything refreshes the KV cache; inside the block, forwards run over the
  block's slots only and attend to the cached prefix ("prefix") or prefix and suffix ("dual") as
  computed at the refresh. A refresh runs for the whole batch when any live row needs one. With
  logits_shift 1 the block's first slot is predicted from the column just before the block (the
  prompt's or the previous block's last token): the block forwards rerun that column as one more new
  token, so its prediction sees the block's current tokens as it does without a cache.
- "exact" (`block_diffusion_decode`, attention="block" models): causal across blocks, so the cache of
  finished blocks is exact; forwards run over the current block only (plus, once, the block just
  finished, to write its clean keys and values into the cache).

Constraints (`constraint=`, jaxdecode.diffusion_constraint: a "binding" masks each forward's logits and
keeps the rule's commits left to right). A regex / JSON-schema automaton: the rule sees logits masked to
the tokens that keep the answer completable, and its commits are kept while some filling of the remaining
MASK slots (+ the suffix) is still in the language (exact DFA emptiness over the slots); a finished row is
a full match. A grammar (pushdown automaton): a walk from the first masked slot, filling the gaps with
the model's own most likely allowed tokens, masks each slot it reaches to the tokens the grammar allows
there, and the rule's commits anywhere in the answer are kept while such a walk passes through them (a
witness that the answer stays extendable); a row that ends with EOS is accepted by the
grammar, one that runs out of slots first is not (stats "constraint_unmatched"); infilling under a
grammar starts from a witness that the suffix closes, searched on the host before the decode.

Rules are small frozen dataclasses (ALGORITHMS.md §5): `select(ctx) -> (commit bool[B,A], tokens
int32[B,A], rule_state)`; lookahead rules (FreeDave, InfoGain), which run several candidate answers
through one batched forward, propose / choose around the loop's lookahead step (`lookahead`).
"""
from __future__ import annotations

import dataclasses
import numbers
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import diffusion_constraint as DC
from jaxdecode.autoregressive import (_concrete, is_eos, nonfinite_rows, pad_id_for, validate_eos_ids,
                                      validate_prompts)
from jaxdecode.diffusion_rules import (  # noqa: F401  (the rules and the filter are public here too)
    CCD, ETE, FILTER_FEATURES, FILTER_KIND, FILTER_WINDOW, R2, RULES, AdaBlock, Credit, DiffusionError,
    Dystruct, EntropyBounded, Factor, FreeDave, Greedy1, InfoGain, LLaDA, Learn2PD, LocalLeap, RandomRemask,
    Rule, StepContext, Threshold, Window, at_least_one, check_int, confidence, entropy, filter_apply, filter_features,
    init_filter, load_filter, make_rule, rank_desc, save_filter, top_n, with_top1)
from jaxdecode.models import advance, bidirectional_mask, block_causal_mask, forward, init_cache, split_layers
from jaxdecode.sharding import check_auto_axes, under_auto_mesh

CACHE_MODES = ("none", "prefix", "dual", "exact")
_NEG = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DiffusionOutput:
    tokens: jax.Array  # int32[B, A]; after a row's length: the pad id
    lengths: jax.Array  # int32[B]: answer tokens per row, EOS included
    stats: dict


# ----------------------------------------------------------------------------- the loop
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _State:
    answer: jax.Array  # int32[B, A]
    nfe: jax.Array  # int32[B]
    steps: jax.Array  # int32
    key: jax.Array
    rule_state: object
    cache: object  # KVCache or None
    carry: object  # mode-specific: a lookahead rule's current logits [B, A, V]; exact: [B, V] logits of the slot
    #                before the current block (logits_shift); prefix/dual: int32[B] block of the last refresh
    nonfinite: jax.Array  # bool[B]
    ccarry: object = ()  # the constraint binding's per-row loop state (grammars: the state after the prefix)

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one decode (hashable)."""
    config: object
    rule: Rule
    answer_length: int
    block_length: int
    eos_ids: tuple
    mask_id: int
    shift: int
    mode: str
    max_forwards: int
    cache_len: int


def _frame(s: _Static, answer, answer_lengths):
    """Per slot: (masked, eligible, row_done, first_eos): the eligible slots are the masked ones of the
    row's current block before its end (answer_lengths, first committed EOS)."""
    a = s.answer_length
    pos = jnp.arange(a, dtype=jnp.int32)[None, :]
    committed = answer != s.mask_id
    eos_here = committed & is_eos(answer, s.eos_ids) & (pos < answer_lengths[:, None])
    first_eos = jnp.min(jnp.where(eos_here, pos, a), axis=-1)
    end = jnp.minimum(answer_lengths, first_eos + 1)  # slots < end belong to the answer
    masked = ~committed & (pos < end[:, None])
    blk = pos // s.block_length
    cur = jnp.min(jnp.where(masked, blk, a), axis=-1)
    eligible = masked & (blk == cur[:, None])
    return masked, eligible, ~jnp.any(masked, axis=-1), end, cur


def _apply(s: _Static, answer, commit, tokens, answer_lengths):
    """Commit tokens at the chosen slots; slots after a committed EOS (or past the row's answer length)
    become padding."""
    answer = jnp.where(commit, tokens, answer)
    _, _, _, end, _ = _frame(s, answer, answer_lengths)
    pos = jnp.arange(s.answer_length, dtype=jnp.int32)[None, :]
    return jnp.where(pos >= end[:, None], pad_id_for(s.eos_ids), answer)


def _layout(prompt_tokens, prompt_lengths, answer, answer_lengths, suffix=None):
    """Full sequences [B, P + A (+ S)]: tokens, positions, valid, answer-slot index of each column.
    suffix: None, or (suffix_tokens int32[B, S], suffix_lengths int32[B]): row b's suffix sits right
    after its A_b answer slots (columns P_b + A_b ..), so the slots are a gap to infill."""
    b, p = prompt_tokens.shape
    a = answer.shape[1]
    sw = 0 if suffix is None else suffix[0].shape[1]
    cols = jnp.arange(p + a + sw, dtype=jnp.int32)[None, :]
    ans_idx = cols - prompt_lengths[:, None]
    is_prompt = cols < prompt_lengths[:, None]
    is_ans = (ans_idx >= 0) & (ans_idx < answer_lengths[:, None])
    ptok = jnp.take_along_axis(prompt_tokens, jnp.clip(cols, 0, p - 1).repeat(b, 0), axis=1)
    atok = jnp.take_along_axis(answer, jnp.clip(ans_idx, 0, a - 1), axis=1)
    tokens = jnp.where(is_prompt, ptok, jnp.where(is_ans, atok, 0))
    valid = is_prompt | is_ans
    last = prompt_lengths + answer_lengths - 1
    if suffix is not None:
        suffix_tokens, suffix_lengths = suffix
        suf_idx = ans_idx - answer_lengths[:, None]  # [B, T]: index into the row's suffix
        is_suf = (suf_idx >= 0) & (suf_idx < suffix_lengths[:, None])
        stok = jnp.take_along_axis(suffix_tokens, jnp.clip(suf_idx, 0, max(sw - 1, 0)), axis=1)
        tokens = jnp.where(is_suf, stok, tokens)
        valid = valid | is_suf
        last = last + suffix_lengths
    positions = jnp.minimum(cols, last[:, None])
    return tokens, positions, valid, ans_idx


def _mask(s: _Static, valid, ans_idx):
    """[B, T, T] attention among the columns: bidirectional, or block-causal for attention='block' with
    blocks of block_size aligned to the answer start (as the dLLM trainer aligns them), so the prompt's
    last block ends where the answer begins."""
    if getattr(s.config, "attention", "bidirectional") == "block":
        return block_causal_mask(valid, s.config.block_size, offset=ans_idx[:, 0])
    return bidirectional_mask(valid)


def _answer_logits(s: _Static, logits, prompt_lengths):
    """[B, A, V]: the logits predicting each answer slot (column P_b + j - shift)."""
    a = s.answer_length
    cols = prompt_lengths[:, None] + jnp.arange(a, dtype=jnp.int32)[None, :] - s.shift
    cols = jnp.clip(cols, 0, logits.shape[1] - 1)
    return _never_mask(s, jnp.take_along_axis(logits, cols[..., None], axis=1))


def _never_mask(s: _Static, logits):
    """The MASK id is never a prediction (committing it would leave the slot masked)."""
    return logits.at[..., s.mask_id].set(_NEG)


def _full_forward(s: _Static, params, prompt_tokens, prompt_lengths, answer, answer_lengths, suffix=None,
                  visible=None):
    """visible: None, or bool[B, A]: the answer slots the forward keeps as keys (a rule's pruning, e.g.
    Window-Diffusion's far field); the others keep their positions but nobody attends to them."""
    tokens, positions, valid, ans_idx = _layout(prompt_tokens, prompt_lengths, answer, answer_lengths, suffix)
    if visible is not None:
        is_ans = (ans_idx >= 0) & (ans_idx < answer_lengths[:, None])
        vis = jnp.take_along_axis(visible, jnp.clip(ans_idx, 0, answer.shape[1] - 1), axis=1)
        valid = valid & (~is_ans | vis)
    logits, _, _ = forward(s.config, params, tokens, positions, None, _mask(s, valid, ans_idx))
    return _answer_logits(s, logits, prompt_lengths)


def _context(s: _Static, state: _State, logits, answer_lengths):
    """(StepContext of one forward's answer-frame logits, eligible bool[B, A], the loop's next key)."""
    _, eligible, _, end, cur = _frame(s, state.answer, answer_lengths)
    key, sub = jax.random.split(state.key)
    start = jnp.minimum(cur * s.block_length, s.answer_length)  # finished rows: past the end
    ctx = StepContext(logits=logits, eligible=eligible, committed=state.answer != s.mask_id,
                      answer=state.answer, key=sub, state=state.rule_state, eos_ids=s.eos_ids,
                      block_start=start, block_end=jnp.minimum(start + s.block_length, end))
    return ctx, eligible, key


def _constrain(cons, ccarry, answer, answer_lengths, logits):
    """(logits masked by the constraint binding, the step's data for `_keep_completable`); no constraint:
    (logits, None). See jaxdecode.diffusion_constraint."""
    if cons is None:
        return logits, None
    return cons.mask(ccarry, answer, answer_lengths, logits)


def _keep_completable(cons, ccarry, st, commit, tokens):
    """(commits kept, left to right, tokens int32[B, A] to write, next constraint carry): regex / JSON schema
    keep the commits that leave the answer completable, grammars those that extend the valid prefix; all
    of them without a constraint."""
    tokens = tokens.astype(jnp.int32)
    if cons is None:
        return commit, tokens, ccarry
    return cons.keep(ccarry, st, commit, tokens)


def _commit_step(s: _Static, state: _State, logits, answer_lengths, live, cons=None):
    """The rule's commits from one forward's answer-frame logits (under a constraint: from the masked
    logits, then filtered by the constraint)."""
    raw = logits
    logits, st = _constrain(cons, state.ccarry, state.answer, answer_lengths, logits)
    ctx, eligible, key = _context(s, state, logits, answer_lengths)
    commit, tokens, rstate = s.rule.select(ctx)
    _, conf, _ = confidence(logits)
    commit = at_least_one(commit, conf, eligible) & live[:, None]
    commit, tokens, ccarry = _keep_completable(cons, state.ccarry, st, commit, tokens)
    answer = _apply(s, state.answer, commit, tokens, answer_lengths)
    bad = nonfinite_rows(raw, live, eligible)
    return state.replace(answer=answer, key=key, rule_state=rstate, nfe=state.nfe + live.astype(jnp.int32),
                         nonfinite=state.nonfinite | bad, ccarry=ccarry)


def _block_slots(s: _Static, cur):
    """int32[B, Lb]: the answer slots of each row's current block."""
    return cur[:, None] * s.block_length + jnp.arange(s.block_length, dtype=jnp.int32)[None, :]


def _scatter_block(s: _Static, block_logits, slots):
    """Logits of T slots [B, T, V] into the answer frame [B, A, V] (other slots: 0, never eligible)."""
    b, lb, v = block_logits.shape
    out = jnp.zeros((b, s.answer_length + lb, v), block_logits.dtype)  # room for a block past the end
    out = jax.vmap(lambda o, x, i: o.at[i].set(x))(out, block_logits, slots)
    return _never_mask(s, out[:, :s.answer_length])


def _token_before_block(prompt_tokens, prompt_lengths, answer, start):
    """int32[B]: the token of the column just before answer slot `start` [B] (the prompt's last at 0)."""
    last_prompt = jnp.take_along_axis(prompt_tokens, (prompt_lengths - 1)[:, None], axis=1)[:, 0]
    prev = jnp.take_along_axis(answer, jnp.clip(start - 1, 0, answer.shape[1] - 1)[:, None], axis=1)[:, 0]
    return jnp.where(start > 0, prev, last_prompt)


def _block_forward(s: _Static, params, cache, prompt_lengths, answer, answer_lengths, cur, first_logits, kind,
                   prev_token=None):
    """Forward over each row's current block, attending to the cache's committed prefix. kind "exact" /
    "dual": the block's slots are the new tokens ("dual": they also see the slots after the block as
    cached at the last refresh); "prefix": the block and every slot after it are new tokens (Fast-dLLM's
    prefix cache recomputes the suffix). Returns answer-frame logits and the cache.

    logits_shift 1: the block's first slot reads `first_logits` [B, V] (exact: the finished prefix's
    last logits), or, given `prev_token` int32[B] (the approximate caches), the column before the block
    is rerun as new token 0 over the prefix's last cache slot, so its logits are fresh."""
    lb, a = s.block_length, s.answer_length
    t = a if kind == "prefix" else lb
    slots = cur[:, None] * lb + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    valid = slots < answer_lengths[:, None]
    tokens = jnp.where(valid, jnp.take_along_axis(answer, jnp.clip(slots, 0, a - 1), axis=1), 0)
    positions = prompt_lengths[:, None] + jnp.minimum(slots, answer_lengths[:, None] - 1)
    if kind == "dual":  # columns: the block, then the slots after it (their keys from the last refresh)
        col_slot = cur[:, None] * lb + jnp.arange(lb + a, dtype=jnp.int32)[None, :]
        col_valid = col_slot < answer_lengths[:, None]
    else:
        col_valid = valid
    rerun = s.shift and prev_token is not None
    if rerun:  # the prefix's last column (cache slot lengths - 1) becomes new token 0
        start = jnp.minimum(cur * lb, answer_lengths)
        tokens = jnp.concatenate([prev_token[:, None], tokens], axis=1)
        positions = jnp.concatenate([(prompt_lengths + start - 1)[:, None], positions], axis=1)
        col_valid = jnp.concatenate([jnp.ones_like(col_valid[:, :1]), col_valid], axis=1)
        cache = cache.replace(lengths=cache.lengths - 1)
    mask = jnp.broadcast_to(col_valid[:, None, :], (valid.shape[0], tokens.shape[1], col_valid.shape[1]))
    logits, _, cache = forward(s.config, params, tokens, positions, cache, mask)
    if rerun:  # output j predicts slot j of the block
        logits, cache = logits[:, :-1], cache.replace(lengths=cache.lengths + 1)
    elif s.shift:  # slot j of the block reads column j - 1; the first slot reads the carried logits
        logits = jnp.concatenate([first_logits[:, None], logits[:, :-1]], axis=1)
    return _scatter_block(s, logits, slots), cache


def _refresh(s: _Static, params, prompt_tokens, prompt_lengths, answer, answer_lengths, cache, cur):
    """Fast-dLLM refresh: one forward over everything writes every column's keys and values; the cache
    then holds prompt + the slots before the current block as its committed prefix."""
    tokens, positions, valid, ans_idx = _layout(prompt_tokens, prompt_lengths, answer, answer_lengths)
    cache = cache.replace(lengths=jnp.zeros_like(cache.lengths))
    logits, _, cache = forward(s.config, params, tokens, positions, cache, _mask(s, valid, ans_idx))
    cache = advance(cache, prompt_lengths + jnp.minimum(cur * s.block_length, answer_lengths))
    return _answer_logits(s, logits, prompt_lengths), cache


def _exact_step(s: _Static, params, state: _State, prompt_lengths, answer_lengths, cur, done):
    """Block diffusion with the exact cache: forward over the current block; when a row's previous block
    is finished but not yet cached, the forward also runs over it first (written and committed)."""
    lb = s.block_length
    cache = state.cache
    cached_blk = (cache.lengths - prompt_lengths) // lb
    pending = ~done & (cached_blk < cur)

    def plain(_):
        return _block_forward(s, params, cache, prompt_lengths, state.answer, answer_lengths, cur, state.carry,
                              "exact") + (state.carry,)

    def with_pending(_):
        prev = jnp.where(pending, cur - 1, cur)
        prev_slots = _block_slots(s, prev)
        cur_slots = _block_slots(s, cur)
        pv = (prev_slots < answer_lengths[:, None]) & pending[:, None]
        cv = cur_slots < answer_lengths[:, None]
        a = s.answer_length
        take = lambda sl: jnp.take_along_axis(state.answer, jnp.clip(sl, 0, a - 1), axis=1)
        tokens = jnp.concatenate([jnp.where(pv, take(prev_slots), 0), jnp.where(cv, take(cur_slots), 0)], axis=1)
        last = answer_lengths[:, None] - 1
        positions = prompt_lengths[:, None] + jnp.concatenate(
            [jnp.minimum(prev_slots, last), jnp.minimum(cur_slots, last)], axis=1)
        kv = jnp.concatenate([pv, cv], axis=1)  # [B, 2Lb]
        q_second = jnp.arange(2 * lb)[None, :, None] >= lb
        k_second = jnp.arange(2 * lb)[None, None, :] >= lb
        mask = kv[:, None, :] & ~(k_second & ~q_second)  # the finished block does not see the current one
        logits, _, c2 = forward(s.config, params, tokens, positions, cache, mask)
        n_prev = jnp.sum(pv, axis=-1).astype(jnp.int32)
        # carried logits for the current block's first slot: the finished block's last valid column
        first = jnp.take_along_axis(logits, jnp.clip(n_prev - 1, 0)[:, None, None], axis=1)[:, 0]
        first = jnp.where(pending[:, None], first, state.carry)
        cur_logits = logits[:, lb:]
        if s.shift:
            cur_logits = jnp.concatenate([first[:, None], cur_logits[:, :-1]], axis=1)
        # The current block was written after a full block of slots; rows whose finished block was
        # shorter (answer end) are done, so its uncommitted slots never matter.
        return _scatter_block(s, cur_logits, cur_slots), advance(c2, n_prev), first

    logits, cache, carry = jax.lax.cond(jnp.any(pending), with_pending, plain, None)
    return logits, cache, carry


def _lookahead_step(s: _Static, params, state: _State, prompt_tokens, prompt_lengths, answer_lengths, live,
                    suffix=None, cons=None):
    """One step of a lookahead rule (FreeDave, InfoGain): the rule proposes K commit sets from the current
    logits, ONE batched forward runs the model on the K resulting answers, the rule keeps one per row;
    the kept answer's forward gives the next step's current logits."""
    b, a = state.answer.shape
    cur_logits = state.carry
    masked_logits, st = _constrain(cons, state.ccarry, state.answer, answer_lengths, cur_logits)
    ctx, eligible, key = _context(s, state, masked_logits, answer_lengths)
    commits, tokens = s.rule.propose(ctx)  # [K, B, A], [B, A]
    k = commits.shape[0]
    commits, tokens_k, carries = jax.vmap(
        lambda c: _keep_completable(cons, state.ccarry, st, c & eligible & live[:, None], tokens))(commits)
    drafts = jax.vmap(lambda c, t: _apply(s, state.answer, c & live[:, None], t, answer_lengths))(
        commits, tokens_k)  # [K, B, A]
    rep = lambda t: jnp.broadcast_to(t, (k,) + t.shape).reshape((k * b,) + t.shape[1:])
    logits = _full_forward(s, params, rep(prompt_tokens), rep(prompt_lengths), drafts.reshape(k * b, a),
                           rep(answer_lengths), None if suffix is None else tuple(map(rep, suffix)))
    logits = logits.reshape(k, b, a, -1)
    masked_j, elig_j = jax.vmap(lambda d: _frame(s, d, answer_lengths)[:2])(drafts)  # [K, B, A] each
    idx, rstate = s.rule.choose(ctx, commits, masked_j, elig_j, logits)  # idx int32[B] in 0..K-1
    idx = idx[None, :, None]
    answer = jnp.take_along_axis(drafts, jnp.broadcast_to(idx, (1, b, a)), axis=0)[0]
    new_logits = jnp.take_along_axis(logits, idx[..., None], axis=0)[0]
    answer = jnp.where(live[:, None], answer, state.answer)
    ccarry = jax.tree.map(lambda x: jnp.take_along_axis(x, idx.reshape((1, b) + (1,) * (x.ndim - 2)), axis=0)[0],
                          carries)  # the kept candidate's constraint carry
    bad = nonfinite_rows(cur_logits, live, eligible)
    return state.replace(answer=answer, carry=jnp.where(live[:, None, None], new_logits, cur_logits), key=key,
                         rule_state=rstate, nfe=state.nfe + live.astype(jnp.int32), nonfinite=state.nonfinite | bad,
                         ccarry=ccarry)


def _bind_constraint(s: _Static, auto, answer, answer_lengths, suffix, prompt=None):
    """(the constraint's binding for the loop, its initial carry, bool[B] rows no answer can satisfy), or
    (None, (), None) without a constraint. auto: what DC.bind_constraint returned. prompt: None, or
    (prompt_tokens, prompt_lengths, prefix_lengths) when the constrained text starts inside the prompt."""
    if auto is None:
        return None, (), None
    return DC.start(auto, answer, answer_lengths, suffix, prompt, mask_id=s.mask_id, eos_ids=s.eos_ids,
                    vocab_size=s.config.vocab_size)


@partial(jax.jit, static_argnames=("s",))
def _empty_rows(s: _Static, auto, answer_lengths, suffix, prompt):
    """bool[B]: rows no answer of their length (+ suffix) can satisfy the constraint (the host check)."""
    pos = jnp.arange(s.answer_length, dtype=jnp.int32)[None, :]
    answer = jnp.where(pos < answer_lengths[:, None], s.mask_id, pad_id_for(s.eos_ids)).astype(jnp.int32)
    return _bind_constraint(s, auto, answer, answer_lengths, suffix, prompt)[2]


@partial(jax.jit, static_argnames=("s",))
def _decode(s: _Static, params, prompt_tokens, prompt_lengths, answer_lengths, key, suffix=None, auto=None,
            prefix_lengths=None):
    b = prompt_tokens.shape[0]
    a, v = s.answer_length, s.config.vocab_size
    pos = jnp.arange(a, dtype=jnp.int32)[None, :]
    answer = jnp.where(pos < answer_lengths[:, None], s.mask_id, pad_id_for(s.eos_ids)).astype(jnp.int32)
    cons, ccarry, empty = _bind_constraint(
        s, auto, answer, answer_lengths, suffix,
        None if prefix_lengths is None else (prompt_tokens, prompt_lengths, prefix_lengths))
    if cons is not None:  # rows with an empty language (only when called under jit): ended at once, reported
        answer = jnp.where(empty[:, None], pad_id_for(s.eos_ids), answer)
    state = _State(answer=answer, nfe=jnp.zeros((b,), jnp.int32), steps=jnp.int32(0), key=key,
                   rule_state=s.rule.init(b, a, v), cache=None, carry=None, nonfinite=jnp.zeros((b,), bool),
                   ccarry=ccarry)
    if s.rule.lookahead:  # FreeDave, InfoGain: the current forward comes before the loop
        live0 = ~_frame(s, answer, answer_lengths)[2]
        state = state.replace(carry=_full_forward(s, params, prompt_tokens, prompt_lengths, answer, answer_lengths,
                                                  suffix),
                              nfe=state.nfe + live0.astype(jnp.int32))
    elif s.mode in ("prefix", "dual"):
        state = state.replace(cache=init_cache(s.config, b, s.cache_len), carry=jnp.full((b,), -1, jnp.int32))
    elif s.mode == "exact":  # prefill the prompt (its blocks aligned to end at the answer start)
        cache = init_cache(s.config, b, s.cache_len)
        p = prompt_tokens.shape[1]
        cols = jnp.arange(p, dtype=jnp.int32)[None, :]
        valid = cols < prompt_lengths[:, None]
        ans_idx = cols - prompt_lengths[:, None]
        logits, _, cache = forward(s.config, params, jnp.where(valid, prompt_tokens, 0),
                                   jnp.minimum(cols, prompt_lengths[:, None] - 1), cache, _mask(s, valid, ans_idx))
        first = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
        state = state.replace(cache=advance(cache, prompt_lengths), carry=first, nfe=state.nfe + 1)

    def cond(st):
        done = _frame(s, st.answer, answer_lengths)[2]
        return ~jnp.all(done) & (st.steps < s.max_forwards)

    def body(st):
        _, _, done, _, cur = _frame(s, st.answer, answer_lengths)
        cur = jnp.minimum(cur, -(-a // s.block_length))  # finished rows: one past the last block
        live = ~done
        st = st.replace(steps=st.steps + 1)
        if s.rule.lookahead:
            return _lookahead_step(s, params, st, prompt_tokens, prompt_lengths, answer_lengths, live, suffix, cons)
        if s.mode == "none":
            logits = _full_forward(s, params, prompt_tokens, prompt_lengths, st.answer, answer_lengths, suffix,
                                   s.rule.visible(st.rule_state, st.answer != s.mask_id))
        elif s.mode == "exact":
            logits, cache, carry = _exact_step(s, params, st, prompt_lengths, answer_lengths, cur, done)
            st = st.replace(cache=cache, carry=carry)
        else:
            need = jnp.any(live & (cur != st.carry))

            def refresh(_):
                return _refresh(s, params, prompt_tokens, prompt_lengths, st.answer, answer_lengths, st.cache, cur)

            def inside(_):
                prev = _token_before_block(prompt_tokens, prompt_lengths, st.answer, cur * s.block_length)
                return _block_forward(s, params, st.cache, prompt_lengths, st.answer, answer_lengths, cur, None,
                                      s.mode, prev_token=prev)
            logits, cache = jax.lax.cond(need, refresh, inside, None)
            st = st.replace(cache=cache, carry=jnp.where(need, cur, st.carry))
        return _commit_step(s, st, logits, answer_lengths, live, cons)

    state = jax.lax.while_loop(cond, body, state)
    _, _, done, end, _ = _frame(s, state.answer, answer_lengths)
    tokens = jnp.where(pos < end[:, None], state.answer, pad_id_for(s.eos_ids))
    decoded = jnp.sum((pos < end[:, None]) & (state.answer != s.mask_id), axis=-1)
    stats = {"nfe": state.nfe, "steps": state.steps, "unfinished": ~done,
             "tokens_per_forward": decoded.astype(jnp.float32) / jnp.maximum(state.nfe, 1).astype(jnp.float32),
             "nonfinite_logits": state.nonfinite}
    if cons is not None:
        last = jnp.take_along_axis(state.answer, jnp.clip(end - 1, 0, a - 1)[:, None], axis=1)[:, 0]
        stats["constraint_empty"] = empty
        stats["constraint_unmatched"] = ~cons.matched(state.ccarry, done & ~empty, (end > 0) & is_eos(last, s.eos_ids))
    return DiffusionOutput(tokens=tokens, lengths=end.astype(jnp.int32), stats=stats)


# ----------------------------------------------------------------------------- public entry points
def _check_model(config, mask_id, logits_shift, method: str):
    attention = getattr(config, "attention", "causal")
    if attention == "causal" and mask_id is None:
        raise DiffusionError(f"{method} decodes masked-diffusion LMs, but this checkpoint is a causal LM "
                             "(config attention='causal', no mask_token_id); use method='greedy' / "
                             "'speculative' for it, or load a diffusion checkpoint (LLaDA, Dream, "
                             "Fast-dLLM v2)")
    if mask_id is None:
        mask_id = getattr(config, "mask_token_id", None)
    if mask_id is None:
        raise DiffusionError("the model's config has no mask_token_id: pass mask_id=<the MASK token id>")
    if isinstance(mask_id, bool) or not isinstance(mask_id, numbers.Integral) or not 0 <= mask_id < config.vocab_size:
        raise DiffusionError(f"mask_id must be a token id in [0, {config.vocab_size}), got {mask_id!r}")
    shift = getattr(config, "logits_shift", 0) if logits_shift is None else logits_shift
    if shift not in (0, 1):
        raise DiffusionError(f"logits_shift must be 0 or 1, got {logits_shift!r}")
    return int(mask_id), int(shift)


def _check_inputs(config, prompt_tokens, prompt_lengths, answer_length, answer_lengths, mask_id, eos_ids):
    if isinstance(answer_length, bool) or not isinstance(answer_length, numbers.Integral) or answer_length < 1:
        raise DiffusionError(f"answer_length must be an int >= 1 (answer slots per prompt), got {answer_length!r}")
    prompt_tokens, prompt_lengths = validate_prompts(config, prompt_tokens, prompt_lengths, int(answer_length))
    toks, lens = _concrete("prompt_tokens", prompt_tokens), _concrete("prompt_lengths", prompt_lengths)
    if toks is not None and lens is not None:
        valid = np.arange(toks.shape[1])[None, :] < lens[:, None]
        hit = np.argwhere(valid & (toks == mask_id))
        if hit.size:
            i, j = (int(t) for t in hit[0])
            raise DiffusionError(f"prompt {i} contains the MASK id {mask_id} at position {j}: the decoder "
                                 "could not tell it from an answer slot; remove it from the prompt")
    if mask_id in eos_ids:
        raise DiffusionError(f"the MASK id {mask_id} is also an EOS id {eos_ids}; they must differ")
    b = prompt_tokens.shape[0]
    if answer_lengths is None:
        answer_lengths = jnp.full((b,), answer_length, jnp.int32)
    else:
        al = _concrete("answer_lengths", answer_lengths)
        if np.shape(answer_lengths) != (b,):
            raise DiffusionError(f"answer_lengths must have shape [batch] = ({b},), got {np.shape(answer_lengths)}")
        if al is not None and (np.any(al < 1) or np.any(al > answer_length)):
            raise DiffusionError(f"answer_lengths must be in 1..answer_length ({answer_length}), got {al.tolist()}")
        answer_lengths = jnp.asarray(answer_lengths, jnp.int32)
    return prompt_tokens, prompt_lengths, answer_lengths


def _check_suffix(config, suffix_tokens, suffix_lengths, prompt_tokens, prompt_lengths, answer_length, mask_id,
                  attention, cache):
    """(suffix_tokens int32[B, S], suffix_lengths int32[B]) checked, or None when there is no suffix."""
    if suffix_tokens is None:
        if suffix_lengths is not None:
            raise DiffusionError("suffix_lengths was given without suffix_tokens: pass both (infilling) or neither")
        return None
    if attention == "block":
        raise DiffusionError("infilling (suffix_tokens) needs a model that attends both ways: this block-diffusion "
                             "model (attention='block') is causal across blocks, so the answer slots would never "
                             "see a suffix after them; use a bidirectional model (LLaDA, Dream) or drop the suffix")
    if cache != "none":
        raise DiffusionError(f"infilling (suffix_tokens) runs with cache='none'; cache={cache!r} caches a layout "
                             "without a suffix")
    b = prompt_lengths.shape[0]
    if np.ndim(suffix_tokens) != 2 or np.shape(suffix_tokens)[0] != b:
        raise DiffusionError(f"suffix_tokens must be 2-D [batch, suffix_len] = ({b}, S) (right-padded), got shape "
                             f"{np.shape(suffix_tokens)}")
    sw = np.shape(suffix_tokens)[1]
    if suffix_lengths is None:
        suffix_lengths = np.full((b,), sw, np.int32)
    if np.shape(suffix_lengths) != (b,):
        raise DiffusionError(f"suffix_lengths must have shape [batch] = ({b},), got {np.shape(suffix_lengths)}")
    toks, lens = _concrete("suffix_tokens", suffix_tokens), _concrete("suffix_lengths", suffix_lengths)
    for name, x, arr in (("suffix_tokens", suffix_tokens, toks), ("suffix_lengths", suffix_lengths, lens)):
        dtype = (x if arr is None else arr).dtype
        if not np.issubdtype(dtype, np.integer):
            raise DiffusionError(f"{name} must hold integer token ids / lengths, got dtype {dtype}")
    longest = sw
    if lens is not None:
        if np.any(lens < 0) or np.any(lens > sw):
            raise DiffusionError(f"suffix_lengths must be in 0..{sw} (the width of suffix_tokens), got {lens.tolist()}")
        longest = int(lens.max(initial=0))
        if toks is not None:
            valid = np.arange(sw)[None, :] < lens[:, None]
            for what, bad in (("is the MASK id", toks == mask_id),
                              (f"is outside the vocabulary [0, {config.vocab_size})",
                               (toks < 0) | (toks >= config.vocab_size))):
                hit = np.argwhere(valid & bad)
                if hit.size:
                    i, j = (int(t) for t in hit[0])
                    raise DiffusionError(f"suffix {i} token {j} (id {int(toks[i, j])}) {what}: a suffix holds "
                                         "known tokens only (to leave a gap, make answer_length longer)")
    plen = _concrete("prompt_lengths", prompt_lengths)
    total = (int(plen.max()) if plen is not None else prompt_tokens.shape[1]) + int(answer_length) + longest
    if total > config.max_position_embeddings:
        raise DiffusionError(f"prompt + answer_length ({answer_length}) + suffix = {total} positions exceed the "
                             f"model's max_position_embeddings ({config.max_position_embeddings}); shorten one")
    if sw == 0:  # an empty suffix is no suffix
        return None
    return jnp.asarray(suffix_tokens, jnp.int32), jnp.asarray(suffix_lengths, jnp.int32)


@under_auto_mesh
def diffusion_decode(config, params, prompt_tokens, prompt_lengths, *, answer_length: int, rule=None,
                     block_length: int | None = None, eos_ids=(), key=None, mask_id=None, logits_shift=None,
                     max_forwards: int | None = None, answer_lengths=None, cache: str = "none",
                     cache_len: int | None = None, suffix_tokens=None, suffix_lengths=None,
                     constraint=None, constraint_prefix=None) -> DiffusionOutput:
    """Decode `answer_length` masked slots per prompt with a commit rule. See the module docstring.

    rule: a Rule (or a name in RULES; default Greedy1). block_length: slots per semi-autoregressive
    block (default: the model's block_size for block attention, else answer_length); it must divide
    nothing — the last block may be short. answer_lengths: int[B] per-row answer lengths (<=
    answer_length; default all answer_length). mask_id / logits_shift: override the config's.
    max_forwards: stop after this many loop steps (rows left with masked slots are reported in
    stats["unfinished"]). cache: "none" | "prefix" | "dual" (Fast-dLLM's approximate caches,
    bidirectional models) | "exact" (block-attention models: see block_diffusion_decode).

    Infilling: suffix_tokens int[B, S] (right-padded) and suffix_lengths int[B] (0..S; default all S) put
    a known suffix right after each row's answer slots (after its answer_lengths[b] slots), so the
    slots fill the gap between prompt and suffix. The model sees the suffix through its bidirectional
    attention; rules, blocks and EOS work as without one (an EOS ends the gap early: the slots after it
    become padding, the suffix keeps its positions). Only cache='none' and bidirectional models
    (attention='block' never lets a slot see what comes after its block).

    constraint: a regex / JSON-schema AutomatonConstraint (compile_regex(...).constraint(), one pattern
    per row with starts=) or a TokenAutomaton: each row's answer up to its first EOS, followed by its
    suffix, is a full match of the pattern when the row finishes (jaxdecode.diffusion_constraint: the
    rule sees logits masked to the tokens that keep the answer completable, and its commits are kept
    left to right while a completion exists). Without EOS ids the answer fills all its slots. A row
    whose pattern no answer of its length (+ suffix) can match is an error before decoding (under jit:
    stats["constraint_empty"], the row ends at once). stats["unfinished"] rows (max_forwards ran out)
    hold MASK slots: what they committed is completable but not yet a match. constraint_prefix: int or
    int[B], how many of each prompt's last tokens already belong to the constrained text (e.g. the
    `{"name": "` before an infilled JSON value); default 0: the text starts at the answer.

    Or a grammar: a GrammarConstraint (compile_grammar(...).constraint(), per-row grammars through
    stack_grammars + starts=; eos_ids required; the llguidance fallback is refused). Commits anywhere in the
    answer are kept while the committed slots have a witness (a filling of the gaps between them, found
    from the model's own most likely allowed tokens, that the grammar walks; jaxdecode.diffusion_constraint):
    every row that ends with EOS is a text the grammar accepts; a row can run out of answer slots before
    the grammar accepts (no EOS: not a match, stats["constraint_unmatched"]), as autoregressive grammar
    decoding can run out of max_new_tokens. Infilling (a suffix) with a grammar: the
    first witness is a whole answer that the suffix closes, searched on the host before the decode (rows
    with none are an error; not under jax.jit); every row then finishes as a full match. stats["constraint_unmatched"]
    (both kinds): rows whose answer is not a full match.
    """
    mask_id, shift = _check_model(config, mask_id, logits_shift, "diffusion decoding")
    rule = make_rule(rule) if isinstance(rule, str) else (rule or Greedy1())
    if not isinstance(rule, Rule):
        raise DiffusionError(f"rule must be a Rule or one of {', '.join(RULES)}, got {rule!r}")
    eos_ids = validate_eos_ids(config, eos_ids)
    rule.check(config, eos_ids)
    check_auto_axes(params=params, prompt_tokens=prompt_tokens, prompt_lengths=prompt_lengths)
    prompt_tokens, prompt_lengths, answer_lengths = _check_inputs(
        config, prompt_tokens, prompt_lengths, answer_length, answer_lengths, mask_id, eos_ids)
    attention = getattr(config, "attention", "bidirectional")
    suffix = _check_suffix(config, suffix_tokens, suffix_lengths, prompt_tokens, prompt_lengths, answer_length,
                           mask_id, attention, cache)
    if block_length is None:
        block_length = config.block_size if attention == "block" else answer_length
    if isinstance(block_length, bool) or not isinstance(block_length, numbers.Integral) or block_length < 1:
        raise DiffusionError(f"block_length must be an int >= 1, got {block_length!r}")
    given_block = int(block_length)
    block_length = min(int(block_length), int(answer_length))
    if cache not in CACHE_MODES:
        raise DiffusionError(f"cache must be one of {CACHE_MODES}, got {cache!r}")
    if cache != "none" and rule.lookahead:
        raise DiffusionError(f"rule {rule.name!r} runs its candidates through full forwards (lookahead): use "
                             f"cache='none' with it")
    if cache in ("prefix", "dual") and attention == "block":
        raise DiffusionError(f"cache={cache!r} is Fast-dLLM's approximate cache for bidirectional models; this "
                             "block-diffusion model (attention='block') has an exact cache: use cache='exact' "
                             "(method block_diffusion)")
    if cache == "exact":
        if attention != "block":
            raise DiffusionError(f"cache='exact' needs a block-diffusion model (attention='block'); this one has "
                                 f"attention={attention!r}: use cache='none', 'prefix' or 'dual'")
        _check_block_length(config, given_block, answer_length)
        block_length = config.block_size
    if max_forwards is None:
        max_forwards = int(answer_length) + 1
    check_int("max_forwards", max_forwards)
    p = prompt_tokens.shape[1]
    need = p + 2 * int(answer_length) + block_length
    cache_len = int(cache_len or (-(-need // 64) * 64))
    if key is None:
        if isinstance(rule, RandomRemask):
            raise DiffusionError("rule random draws slots at random: pass key=jax.random.key(seed)")
        key = jax.random.PRNGKey(0)
    s = _Static(config=config, rule=rule, answer_length=int(answer_length), block_length=block_length,
                eos_ids=eos_ids, mask_id=mask_id, shift=shift, mode=cache, max_forwards=int(max_forwards),
                cache_len=cache_len)
    auto = prefix = None
    if constraint is not None:
        auto = DC.bind_constraint(constraint, vocab_size=config.vocab_size, eos_ids=eos_ids, mask_id=mask_id,
                                  batch=prompt_tokens.shape[0], answer_length=int(answer_length),
                                  prompt_width=p if constraint_prefix is not None else 0)
        prefix = _check_constraint_prefix(constraint_prefix, prompt_lengths)
        if suffix is not None and not isinstance(auto, DC.SlotAutomaton):
            auto = _grammar_infill(s, auto, answer_lengths, suffix,
                                   None if prefix is None else (prompt_tokens, prompt_lengths, prefix))
        _check_constraint_rows(s, auto, answer_lengths, suffix, constraint,
                               None if prefix is None else (prompt_tokens, prompt_lengths, prefix))
    elif constraint_prefix is not None:
        raise DiffusionError("constraint_prefix was given without a constraint: pass constraint= too, or drop it")
    return _decode(s, split_layers(s.config, params), prompt_tokens, prompt_lengths, answer_lengths, key, suffix, auto,
                   prefix)


def _check_block_length(config, block_length: int, answer_length: int) -> None:
    """Block diffusion decodes one attention block of the model at a time: block_length must be its block_size
    (or, when the whole answer fits in one block, any length that still covers the whole answer)."""
    size = int(config.block_size)
    if min(int(block_length), int(answer_length)) != min(size, int(answer_length)):
        raise DiffusionError(f"block_diffusion decodes one attention block at a time: block_length must be the "
                             f"model's block_size ({size}), got {block_length}; drop block_length (it defaults "
                             f"to block_size)")


def _grammar_infill(s: _Static, grammar, answer_lengths, suffix, prompt, max_configs: int = 4096):
    """The grammar bound for infilling (DC.GrammarInfill): each row's first witness, a whole answer that
    its suffix closes, found by the host search DC.grammar_infill_witness; rows without one are an error
    naming them (no answer of that many slots fits, or the search gave up)."""
    concrete = _constraint_inputs(answer_lengths, suffix, prompt)
    if concrete is None:
        raise DiffusionError("infilling under a grammar searches each row's first filling on the host before the "
                             "decode: pass concrete answer_lengths / suffix_tokens / suffix_lengths (and prompt, "
                             "constraint_prefix), i.e. call diffusion_decode outside jax.jit, or constrain the infill "
                             "with a regex / JSON-schema constraint (its emptiness check runs under jit)")
    DC.check_suffix_tokens(suffix, s.eos_ids)
    b = suffix[0].shape[0]
    binding = DC.GrammarBinding(constraint=grammar, mask_id=s.mask_id, eos_ids=s.eos_ids,
                                vocab_size=s.config.vocab_size)
    start = binding.init(b, s.answer_length, prompt).state
    witness, status = DC.grammar_infill_witness(grammar, start, suffix, answer_lengths, answer_length=s.answer_length,
                                                eos_ids=s.eos_ids, mask_id=s.mask_id, max_configs=max_configs)
    bad = [(r, st) for r, st in enumerate(status) if st != "found"]
    if bad:
        al = concrete[0]
        what = {"empty": "no answer of that many slots followed by the row's suffix is a text of the grammar (the "
                         "search over the pushdown automaton's configurations is exhaustive)",
                "unknown": f"the search for an answer that the row's suffix closes gave up (over {max_configs} "
                           "configurations of the pushdown automaton at one length)"}
        raise DiffusionError("; ".join(f"row {r} ({int(al[r])} slots): {what[st]}" for r, st in bad[:4])
                             + (f"; and {len(bad) - 4} more rows" if len(bad) > 4 else "")
                             + ": change answer_length / answer_lengths, the suffix or the grammar")
    return DC.GrammarInfill(constraint=grammar, witness=jnp.asarray(witness))


def _check_constraint_prefix(constraint_prefix, prompt_lengths):
    """int32[B] (or None for none): prompt tokens that start the constrained text, each in 0..prompt length."""
    if constraint_prefix is None:
        return None
    b = prompt_lengths.shape[0]
    arr = _concrete("constraint_prefix", constraint_prefix)
    if arr is not None:
        if arr.dtype.kind not in "iu" or arr.ndim > 1 or (arr.ndim == 1 and arr.shape != (b,)):
            raise DiffusionError(f"constraint_prefix must be an int or int[batch] = ({b},) (prompt tokens that "
                                 f"start the constrained text), got {constraint_prefix!r}")
        lens = _concrete("prompt_lengths", prompt_lengths)
        if (arr < 0).any() or (lens is not None and (np.broadcast_to(arr, (b,)) > lens).any()):
            raise DiffusionError(f"constraint_prefix must be in 0..each prompt's length, got {arr.tolist()}")
    return jnp.broadcast_to(jnp.asarray(constraint_prefix, jnp.int32), (b,))


def _constraint_inputs(answer_lengths, suffix, prompt):
    """[answer_lengths, suffix_tokens, suffix_lengths, prompt_tokens, prompt_lengths, constraint_prefix] as
    numpy arrays (suffix / prompt parts only when given), or None when any is traced (under jit)."""
    named = [("answer_lengths", answer_lengths)]
    if suffix is not None:
        named += [("suffix_tokens", suffix[0]), ("suffix_lengths", suffix[1])]
    if prompt is not None:
        named += list(zip(("prompt_tokens", "prompt_lengths", "constraint_prefix"), prompt))
    arrays = [_concrete(n, x) for n, x in named]
    return None if any(x is None for x in arrays) else arrays


def _check_constraint_rows(s: _Static, auto, answer_lengths, suffix, constraint, prompt=None):
    """Raise DiffusionError naming the rows whose pattern no answer of their length (+ suffix) matches
    (the emptiness check before decoding; skipped under jit, where stats['constraint_empty'] reports)."""
    concrete_in = _constraint_inputs(answer_lengths, suffix, prompt)
    if concrete_in is None:
        return
    DC.check_suffix_tokens(suffix, s.eos_ids)
    empty = np.asarray(_empty_rows(s, auto, answer_lengths, suffix, prompt))
    if empty.any() and not isinstance(auto, DC.SlotAutomaton):  # a grammar: no token can start / continue it
        rows = np.flatnonzero(empty).tolist()
        if prompt is not None:
            raise DiffusionError(f"rows {rows[:8]}: the last constraint_prefix tokens of the prompt are no prefix "
                                 "of a text of the grammar, so no answer can continue them; change "
                                 "constraint_prefix or the prompt")
        raise DiffusionError("no token of the model's vocabulary starts a text of the grammar; compile it with "
                             "this model's tokenizer")
    if empty.any():
        rows = np.flatnonzero(empty).tolist()
        al = concrete_in[0]
        pats = getattr(getattr(constraint, "host", None), "patterns", None) or getattr(constraint, "patterns", ())
        what = f" {pats[0]!r}" if len(pats) == 1 else ""
        raise DiffusionError(
            f"{', '.join(f'row {r} ({int(al[r])} slots)' for r in rows[:4])}"
            f"{f' and {len(rows) - 4} more rows' if len(rows) > 4 else ''}: no answer of that many slots"
            f"{' after the constraint_prefix' if prompt is not None else ''}"
            f"{' followed by the row suffix' if suffix is not None else ''} matches the pattern{what}"
            f"{'' if s.eos_ids else ' (without EOS ids the answer must fill every slot)'}: the constrained "
            "language is empty there; change answer_length / answer_lengths, the suffix or the pattern")


def block_diffusion_decode(config, params, prompt_tokens, prompt_lengths, *, answer_length: int, rule=None,
                           use_cache: bool = True, **kw) -> DiffusionOutput:
    """Exact block-diffusion decoding (BD3-LM / Fast-dLLM v2, attention='block'): block after block, each
    block's slots decoded by `rule` while attending to the exact KV cache of the prompt and the finished
    blocks (forwards over the current block only). use_cache=False recomputes everything each forward
    (same output)."""
    if getattr(config, "attention", "causal") != "block":
        raise DiffusionError(f"block_diffusion needs a block-diffusion model (attention='block', block_size > 0); "
                             f"this one has attention={getattr(config, 'attention', 'causal')!r}"
                             + (": use method='diffusion'" if getattr(config, "attention", "causal") != "causal"
                                else ": it is a causal LM, use method='greedy'"))
    if kw.get("block_length") is None:
        kw["block_length"] = config.block_size
    elif not use_cache and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 1
                               for x in (kw["block_length"], answer_length)):
        _check_block_length(config, kw["block_length"], answer_length)  # the recomputing loop: the same blocks
    return diffusion_decode(config, params, prompt_tokens, prompt_lengths, answer_length=answer_length, rule=rule,
                            cache="exact" if use_cache else "none", **kw)


# ----------------------------------------------------------------------------- generate / CLI
DIFFUSION_METHODS = ("diffusion", "block_diffusion")


def rule_from_options(opts: dict) -> Rule:
    """The Rule of generate's options: rule (a name or a Rule), threshold, tokens_per_step, filter (a
    Learn2PD filter directory) and rule_options (the rule's other parameters)."""
    rule = opts.get("rule") or "greedy1"
    given = {k: opts.get(k) for k in ("threshold", "tokens_per_step") if opts.get(k) is not None}
    given.update(opts.get("rule_options") or {})
    if opts.get("filter") is not None:
        if rule != "learn2pd":
            raise DiffusionError(f"option filter is the Learn2PD filter: it needs rule='learn2pd', not {rule!r}")
        given["params"] = load_filter(opts["filter"])[0]
    if isinstance(rule, Rule):
        if given:
            raise DiffusionError(f"options {sorted(given)} configure a rule built by name; the Rule object "
                                 f"{rule!r} is already configured: drop them")
        return rule
    if rule == "learn2pd" and "params" not in given:
        raise DiffusionError("rule learn2pd needs option filter=DIR (a filter written by `jaxdecode train filter`)")
    return make_rule(rule, **given)


def _run(method: str):
    def run(model, prompt_tokens, prompt_lengths, max_new_tokens, opts):
        from jaxdecode.decoders import place_inputs
        config = model.config
        if not getattr(config, "is_diffusion", False):
            raise DiffusionError(f"method {method!r} decodes masked-diffusion LMs, but this checkpoint is a "
                                 f"causal LM (attention='causal'); use method='greedy' or 'speculative'")
        answer_length = opts["answer_length"] or max_new_tokens
        if answer_length > max_new_tokens:
            raise DiffusionError(f"answer_length={answer_length} is more than max_new_tokens={max_new_tokens}: a "
                                 f"row returns at most max_new_tokens new tokens; raise max_new_tokens to "
                                 f">= {answer_length}, or drop answer_length (it defaults to max_new_tokens)")
        params, toks, lens = place_inputs(model, prompt_tokens, prompt_lengths, opts)
        kw = {"answer_length": answer_length, "rule": rule_from_options(opts), "block_length": opts["block_length"],
              "eos_ids": opts["eos_ids"], "key": jax.random.PRNGKey(opts.get("seed") or 0),
              "max_forwards": opts["max_forwards"], "cache_len": opts["cache_len"],
              "constraint": opts.get("constraint")}
        if method == "block_diffusion":
            out = block_diffusion_decode(config, params, toks, lens, **kw)
        else:
            out = diffusion_decode(config, params, toks, lens, cache=opts["diffusion_cache"], **kw)
        return out.tokens, out.lengths, dict(out.stats, target_calls=jnp.max(out.stats["nfe"]))
    return run


def _register():
    from jaxdecode.options import method_options
    from jaxdecode.registry import register_method
    rows = ("nfe", "tokens_per_forward", "unfinished", "constraint_empty", "constraint_unmatched")
    register_method("diffusion", _run("diffusion"), method_options("diffusion"), per_row_stats=rows,
                    aliases=("dllm",),
                    description="masked-diffusion LM decoding: answer slots start as MASK, a commit rule "
                                "(rule=) fills several per forward, semi-autoregressive blocks")
    register_method("block_diffusion", _run("block_diffusion"), method_options("block_diffusion"),
                    per_row_stats=rows,
                    description="block-diffusion LM decoding (attention='block'): block after block with the "
                                "exact KV cache of finished blocks")


_register()
