"""Beam search with a length penalty, and Diverse Beam Search, as one jit-compiled `lax.while_loop`.

    beam_search(config, params, prompt_tokens[B, P], prompt_lengths[B], max_new_tokens=N,
                num_beams=K, ...) -> BeamOutput(tokens[B, K, N], lengths[B, K], scores[B, K], stats)

Rules (Hugging Face conventions):
- A beam's running score is the sum of its token log-probs. Each step, every running beam is expanded
  over the vocabulary and the best candidates are taken by running score (ties: lower beam, then lower
  token id). The best K non-EOS candidates continue. A candidate ending in an EOS id is a finished
  hypothesis if it ranks among the best K candidates of the step; its score is
  sum logprob / generated_length ** length_penalty (generated length includes the EOS).
- Each row keeps a buffer of its K best finished hypotheses. At max_new_tokens the best K candidates
  of the last step all finish (running beams at the end count as finished).
- A row stops early when its buffer is full and no running beam can beat the worst kept hypothesis,
  by transformers' `early_stopping` rule:
  "never" (this function's default): the bound is exact. Log-probs are <= 0, so a running beam's score
  can only fall; its best final score is S / N ** lp for lp > 0 (finishing as late as possible) and
  S / (t + 1) ** lp otherwise (finishing at the next step, t = tokens generated so far). Stopping early
  therefore never changes the result.
  False (transformers' default, and `generate(method="beam")`'s): the heuristic bound S / t ** lp (the
  best running beam scored at its current length), which may stop before a better hypothesis is found.
  True: as soon as the buffer is full.
- Diverse Beam Search (Vijayakumar et al. 2016): the K beams form G groups of K/G. Each group is a beam
  search of width K/G with its own buffer and stopping test; at each step the groups are expanded in
  order and group g's log-probs are lowered by diversity_penalty x (the number of running beams of
  groups < g that chose that token at this step) — Hamming diversity. As in the paper (and HF) the
  penalties are part of the beam scores. Finished groups no longer count towards the penalty.
  With diversity_penalty = 0 every group runs the same search, so the output is the beam search of
  width K/G with each hypothesis repeated G times.

The first step expands only beam 0 of each group (all beams start from the same prompt), so no
duplicate hypotheses arise. Hypotheses are returned best first over all groups; tokens after a
hypothesis' length are the pad id (eos_ids[0], or 0). If a row has fewer distinct hypotheses than
beams (tiny vocabularies with EOS), the missing ones have score -inf and length 0.

The cache holds B*K rows (row b*K + k); the prompt is prefilled once per row and copied to its beams,
and every step reorders the rows by parent beam (`reorder_rows`) before the forward.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from functools import partial

import jax
import jax.numpy as jnp

from jaxdecode.autoregressive import (PromptError, default_cache_len, is_eos, nonfinite_rows, pad_id_for,
                                      prefill, validate_eos_ids, validate_prompts)
from jaxdecode.models import advance, forward, init_cache, reorder_rows, split_layers
from jaxdecode.sharding import check_auto_axes, under_auto_mesh


class BeamConfigError(ValueError):
    """Beam-search options that do not fit together."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BeamOutput:
    tokens: jax.Array  # int32[B, K, N], best hypothesis first; pad id after each length
    lengths: jax.Array  # int32[B, K]: generated tokens incl. the EOS
    scores: jax.Array  # f32[B, K]: sum logprob / length ** length_penalty
    stats: dict  # {"target_calls": int32 scalar, "nonfinite_logits": bool[B]}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _BeamState:
    step: jax.Array  # int32: tokens generated so far by the running beams
    run_tokens: jax.Array  # int32[B, G, Kg, N]
    run_scores: jax.Array  # f32[B, G, Kg]: sums of (penalised) log-probs; -inf = no beam
    fin_tokens: jax.Array  # int32[B, G, Kg, N]
    fin_scores: jax.Array  # f32[B, G, Kg]: length-normalised; -inf = empty slot
    fin_lengths: jax.Array  # int32[B, G, Kg]
    done: jax.Array  # bool[B, G]
    parents: jax.Array  # int32[B*K]: cache row each beam continues from
    cache: object
    calls: jax.Array  # int32
    nonfinite: jax.Array  # bool[B]: the model's logits held a NaN/inf for a live beam of the row
    cstate: object = None  # constraint state of each beam (row b*K + k), or None

    def replace(self, **kw) -> "_BeamState":
        return dataclasses.replace(self, **kw)


EARLY_STOPPING = (True, False, "never")  # transformers' values (module docstring)


def _best_final_score(run_scores, t, max_new_tokens: int, length_penalty: float, early_stopping="never"):
    """The score a running beam (t + 1 tokens generated) must be able to beat for its row to go on: an
    exact upper bound of its final score ("never"), transformers' heuristic (False), or +inf's opposite
    (True: a full buffer stops the row). See the module docstring."""
    if early_stopping is True:
        return jnp.full(run_scores.shape[:-1], -jnp.inf, jnp.float32)
    if early_stopping is False:
        best_len = t + 1
    else:
        best_len = max_new_tokens if length_penalty > 0 else t + 2
    return jnp.max(run_scores, axis=-1) / jnp.asarray(best_len, jnp.float32) ** length_penalty


def _group_step(t, counts, group, *, max_new_tokens, length_penalty, diversity_penalty, eos_ids,
                early_stopping="never"):
    """Expand one group's beams by one token.

    counts: f32[B, V] tokens chosen by earlier groups this step. group: dict of this group's arrays
    (logprobs [B, Kg, C], run_*, fin_*, done [B]). Unconstrained, the candidates are the vocabulary
    (C = V, token = index). With a constraint the group also holds each beam's candidate list
    (cand_tokens / cand_ends [B, Kg, C], cand_next and node: constraint states), or the group's own
    ranked candidates (logprobs etc. [B, 1, C] and cand_parent [B, 1, C], the beam each extends; see
    TrieConstraint.candidates with scores), and the beams' constraint states advance to the chosen
    candidates' next states. Returns (counts', new group arrays, parent beam [B, Kg] within the group).
    """
    logprobs, run_tokens, run_scores = group["logprobs"], group["run_tokens"], group["run_scores"]
    fin_tokens, fin_scores, fin_lengths, done = (group["fin_tokens"], group["fin_scores"],
                                                 group["fin_lengths"], group["done"])
    constrained = "cand_tokens" in group
    b, kg = run_scores.shape
    c = logprobs.shape[-1]
    v = counts.shape[-1]
    last = t == max_new_tokens - 1
    if not constrained:
        lp = logprobs - diversity_penalty * counts[:, None, :]
        cand = (run_scores[:, :, None] + lp).reshape(b, kg * v)  # [B, Kg*V]
        n_cand = min(kg * (1 + len(eos_ids)), kg * v)  # enough for Kg non-EOS candidates
        top_scores, top_idx = jax.lax.top_k(cand, n_cand)  # [B, C], ties: lower index first
        parent, token = top_idx // v, (top_idx % v).astype(jnp.int32)
        ends = is_eos(token, eos_ids)
        seqs = jnp.take_along_axis(run_tokens, parent[:, :, None], axis=1, mode="clip")  # [B, C, N]
        seqs = seqs.at[:, :, t].set(token)
        # Finished hypotheses: EOS candidates among the best Kg, or every best-Kg candidate at the end.
        finishing = (jnp.arange(n_cand) < kg)[None, :] & (ends | last) & ~done[:, None]
        # Running beams: the best Kg candidates that did not end in EOS.
        run_scores_new, keep = jax.lax.top_k(jnp.where(ends, -jnp.inf, top_scores), kg)
        run_tokens_new = jnp.take_along_axis(seqs, keep[:, :, None], axis=1, mode="clip")
        parent_new = jnp.take_along_axis(parent, keep, axis=1, mode="clip").astype(jnp.int32)
        token_new = jnp.take_along_axis(token, keep, axis=1, mode="clip")
        node_new = None
    else:
        cand_tokens = group["cand_tokens"].reshape(b, -1)
        cand_ends = group["cand_ends"].reshape(b, -1)
        ranked = "cand_parent" in group  # the group's candidates, already ranked: [B, 1, C]
        if ranked:
            src = group["cand_parent"].reshape(b, -1)  # [B, C] beam of each candidate
            cand = jnp.take_along_axis(run_scores, src, axis=1, mode="clip") + logprobs.reshape(b, -1)

            def beam_of(idx):
                return jnp.take_along_axis(src, idx, axis=1, mode="clip")
        else:
            lp = logprobs
            if diversity_penalty:
                lp = lp - diversity_penalty * jnp.take_along_axis(
                    jnp.broadcast_to(counts[:, None, :], (b, kg, v)), jnp.maximum(group["cand_tokens"], 0), axis=-1)
            cand = (run_scores[:, :, None] + lp).reshape(b, kg * c)  # [B, Kg*C]

            def beam_of(idx):
                return idx // c
        # Finished hypotheses: ending candidates among the best Kg (every one of them at the end).
        top_scores, top_idx = jax.lax.top_k(cand, min(kg, cand.shape[1]))
        parent = beam_of(top_idx)
        token = jnp.take_along_axis(cand_tokens, top_idx, axis=1, mode="clip")
        ends = jnp.take_along_axis(cand_ends, top_idx, axis=1, mode="clip")
        seqs = jnp.take_along_axis(run_tokens, parent[:, :, None], axis=1, mode="clip").at[:, :, t].set(token)
        finishing = (ends | last) & ~done[:, None]
        # Running beams: the best Kg candidates that do not end (any number of candidates may end).
        run_scores_new, keep = jax.lax.top_k(jnp.where(cand_ends, -jnp.inf, cand), kg)
        parent_new = beam_of(keep).astype(jnp.int32)
        token_new = jnp.take_along_axis(cand_tokens, keep, axis=1, mode="clip")
        run_tokens_new = jnp.take_along_axis(run_tokens, parent_new[:, :, None], axis=1,
                                             mode="clip").at[:, :, t].set(token_new)
        node_new = tuple(jnp.take_along_axis(x.reshape(b, -1), keep, axis=1, mode="clip") for x in group["cand_next"])

    gen_len = (t + 1).astype(jnp.float32)
    new_fin = jnp.where(finishing, top_scores / gen_len ** length_penalty, -jnp.inf)
    all_scores = jnp.concatenate([fin_scores, new_fin], axis=1)  # kept ones first: they win ties
    fin_scores_new, pick = jax.lax.top_k(all_scores, kg)
    all_tokens = jnp.concatenate([fin_tokens, seqs], axis=1)
    all_lengths = jnp.concatenate([fin_lengths, jnp.broadcast_to(t + 1, new_fin.shape)], axis=1)
    fin_tokens_new = jnp.take_along_axis(all_tokens, pick[:, :, None], axis=1, mode="clip")
    fin_lengths_new = jnp.take_along_axis(all_lengths, pick, axis=1, mode="clip").astype(jnp.int32)

    full = jnp.all(fin_scores_new > -jnp.inf, axis=-1)
    hopeless = jnp.min(fin_scores_new, axis=-1) >= _best_final_score(
        run_scores_new, t, max_new_tokens, length_penalty, early_stopping)
    done_new = done | last | (full & hopeless)

    if diversity_penalty:  # only the penalty of later groups reads the counts
        live_beam = ~done[:, None] & (run_scores_new > -jnp.inf)  # [B, Kg]
        counts = counts + jnp.sum(jax.nn.one_hot(token_new, v, dtype=counts.dtype) * live_beam[..., None],
                                  axis=1)

    def frozen(new, old):  # finished groups keep their state
        return jnp.where(done.reshape(done.shape + (1,) * (new.ndim - 1)), old, new)

    out = dict(run_tokens=frozen(run_tokens_new, run_tokens), run_scores=frozen(run_scores_new, run_scores),
               fin_tokens=frozen(fin_tokens_new, fin_tokens), fin_scores=frozen(fin_scores_new, fin_scores),
               fin_lengths=frozen(fin_lengths_new, fin_lengths), done=done_new)
    if constrained:
        out["node"] = tuple(frozen(n, o) for n, o in zip(node_new, group["node"]))
    parent_new = frozen(parent_new, jnp.broadcast_to(jnp.arange(kg, dtype=jnp.int32), parent_new.shape))
    return counts, out, parent_new


def _select(state: _BeamState, logprobs, *, max_new_tokens, length_penalty, diversity_penalty,
            eos_ids, early_stopping="never", constraint=None, cands=None, vocab_size=None) -> _BeamState:
    """One beam step for every row and group. logprobs: f32[B, G, Kg, V], or with a constraint the
    candidates' log-probs f32[B, G, Kg, C] and `cands` (their tokens, ends and next states), or the
    groups' ranked candidates f32[B, G, 1, C] with cands.parent."""
    b, g, kg = state.run_scores.shape
    v = logprobs.shape[-1] if cands is None else vocab_size
    t = state.step
    groups = dict(logprobs=logprobs, run_tokens=state.run_tokens, run_scores=state.run_scores,
                  fin_tokens=state.fin_tokens, fin_scores=state.fin_scores,
                  fin_lengths=state.fin_lengths, done=state.done)
    if cands is not None:
        groups.update(cand_tokens=cands.tokens, cand_ends=cands.ends, cand_next=cands.next,
                      node=tuple(n.reshape(b, g, kg) for n in state.cstate.node))
        if cands.parent is not None:
            groups["cand_parent"] = cands.parent

    def step(counts, group):
        counts, out, parent = _group_step(t, counts, group, max_new_tokens=max_new_tokens,
                                          length_penalty=length_penalty,
                                          diversity_penalty=diversity_penalty, eos_ids=eos_ids,
                                          early_stopping=early_stopping)
        return counts, (out, parent)

    counts = jnp.zeros((b, v), jnp.float32)
    if g == 1:  # one group: no scan (a loop of one iteration still costs its copies)
        _, (new, parent) = step(counts, jax.tree.map(lambda a: a[:, 0], groups))
        new = jax.tree.map(lambda a: a[:, None], new)
        parent = parent[:, None]
    else:
        groups = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), groups)  # group axis first for the scan
        _, (new, parent) = jax.lax.scan(step, counts, groups)
        new = jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), new)
        parent = jnp.moveaxis(parent, 0, 1)  # [B, G, Kg] beam within its group
    row0 = (jnp.arange(b)[:, None, None] * (g * kg) + jnp.arange(g)[None, :, None] * kg)
    if cands is not None:
        node = new.pop("node")
        new["cstate"] = constraint.step_to(state.cstate, tuple(n.reshape(-1) for n in node))
    return state.replace(step=t + 1, parents=(row0 + parent).reshape(-1).astype(jnp.int32), **new)


def _constrained_select(select, state, constraint, logits, b, g, kg):
    """Constraint candidates of every beam (logits [B*K, V]), then the beam step over them. Without a
    diversity penalty the constraint ranks each group's candidates from the running scores (one
    top-k over a group's beams x allowed tokens); the penalty re-ranks tokens inside the step, so with
    it the candidates are each beam's own best. The loop body never sees depth 0 (min_depth=1)."""
    scores = None if select.keywords.get("diversity_penalty") else state.run_scores.reshape(-1)
    c = constraint.candidates(state.cstate, logits, kg, scores=scores, min_depth=1)

    def split(a):  # [B*K, C] -> [B, G, Kg, C]; ranked per group: [B*G, C] -> [B, G, 1, C]
        return a.reshape(b, g, kg if c.parent is None else 1, -1)

    cands = jax.tree.map(split, c)
    return select(state, cands.logprobs, constraint=constraint, cands=cands, vocab_size=logits.shape[-1])


def _constrained_first(select, state, constraint, logits, b, g, kg):
    """The first step: each prompt's candidates once (logits [B, V]; only beam 0 of a group is live), as
    each group's ranked list (all from beam 0), or, with a diversity penalty (it re-ranks inside the
    step), as every beam's own list."""
    roots = constraint.init(b)
    c = constraint.candidates(roots, logits, kg, max_depth=0)  # [B, C]
    ranked = not select.keywords.get("diversity_penalty")
    if ranked:  # the ranked step takes the best kg: at least kg slots
        c = c.pad_to(kg)
        c = dataclasses.replace(c, parent=jnp.zeros(c.tokens.shape, jnp.int32))
    c = jax.tree.map(lambda a: jnp.broadcast_to(a[:, None, None, :], (b, g, 1 if ranked else kg, a.shape[-1])), c)
    state = state.replace(cstate=roots.replace(node=tuple(jnp.repeat(x, g * kg) for x in roots.node)))
    return select(state, c.logprobs, constraint=constraint, cands=c, vocab_size=logits.shape[-1])


@partial(jax.jit, static_argnames=("config", "max_new_tokens", "num_beams", "num_groups",
                                   "length_penalty", "diversity_penalty", "eos_ids", "cache_len", "early_stopping"))
def _beam_search(config, params, prompt_tokens, prompt_lengths, constraint=None, *, max_new_tokens,
                 num_beams, num_groups, length_penalty, diversity_penalty, eos_ids, cache_len, early_stopping):
    b = prompt_tokens.shape[0]
    k, g = num_beams, num_groups
    kg = k // g
    n = max_new_tokens
    cache = init_cache(config, b, cache_len)
    logits, cache = prefill(config, params, prompt_tokens, prompt_lengths, cache)
    cache = reorder_rows(cache, jnp.repeat(jnp.arange(b), k))  # every beam starts from its prompt
    pad = pad_id_for(eos_ids)
    # Only beam 0 of each group is live at first, so the first expansion has no duplicates.
    run_scores = jnp.where(jnp.arange(kg) == 0, 0.0, -jnp.inf) * jnp.ones((b, g, 1), jnp.float32)
    state = _BeamState(
        step=jnp.int32(0), run_tokens=jnp.full((b, g, kg, n), pad, jnp.int32), run_scores=run_scores,
        fin_tokens=jnp.full((b, g, kg, n), pad, jnp.int32),
        fin_scores=jnp.full((b, g, kg), -jnp.inf, jnp.float32),
        fin_lengths=jnp.zeros((b, g, kg), jnp.int32), done=jnp.zeros((b, g), bool),
        parents=jnp.arange(b * k, dtype=jnp.int32), cache=cache, calls=jnp.int32(1),
        nonfinite=nonfinite_rows(logits, jnp.ones((b,), bool)))
    select = partial(_select, max_new_tokens=n, length_penalty=length_penalty,
                     diversity_penalty=diversity_penalty, eos_ids=eos_ids, early_stopping=early_stopping)
    if constraint is None:
        first = jax.nn.log_softmax(logits, axis=-1)  # [B, V]
        state = select(state, jnp.broadcast_to(first[:, None, None, :], (b, g, kg, first.shape[-1])))
    else:
        state = _constrained_first(select, state, constraint, logits, b, g, kg)

    def cond(state):
        return (state.step < n) & ~jnp.all(state.done)

    def body(state):
        cache = reorder_rows(state.cache, state.parents)
        last = state.run_tokens[..., state.step - 1].reshape(b * k)
        logits, _, cache = forward(config, params, last[:, None], cache.lengths[:, None], cache,
                                   jnp.ones((b * k, 1, 1), bool))
        live = (~state.done[:, :, None] & (state.run_scores > -jnp.inf)).reshape(b * k)
        bad = nonfinite_rows(logits[:, 0], live).reshape(b, k).any(axis=1)
        state = state.replace(cache=advance(cache, jnp.ones((b * k,), jnp.int32)), calls=state.calls + 1,
                              nonfinite=state.nonfinite | bad)
        if constraint is not None:
            return _constrained_select(select, state, constraint, logits[:, 0], b, g, kg)
        logprobs = jax.nn.log_softmax(logits[:, 0], axis=-1).reshape(b, g, kg, -1)
        return select(state, logprobs)

    state = jax.lax.while_loop(cond, body, state)

    scores = state.fin_scores.reshape(b, k)
    order = jnp.argsort(-scores, axis=1, stable=True)
    scores = jnp.take_along_axis(scores, order, axis=1)
    empty = scores == -jnp.inf
    lengths = jnp.where(empty, 0, jnp.take_along_axis(state.fin_lengths.reshape(b, k), order, axis=1))
    tokens = jnp.take_along_axis(state.fin_tokens.reshape(b, k, n), order[:, :, None], axis=1)
    tokens = jnp.where(jnp.arange(n) < lengths[:, :, None], tokens, pad)
    return BeamOutput(tokens=tokens, lengths=lengths, scores=scores,
                      stats={"target_calls": state.calls, "nonfinite_logits": state.nonfinite})


def _real(name: str, value, minimum: float | None = None) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or (
            minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise BeamConfigError(f"{name} must be a finite number{bound}, got {value!r}")
    return float(value)


@under_auto_mesh
def beam_search(config, params, prompt_tokens, prompt_lengths, *, max_new_tokens: int,
                num_beams: int, length_penalty: float = 1.0, eos_ids: tuple = (), num_groups: int = 1,
                diversity_penalty: float = 0.0, cache_len: int | None = None,
                constraint=None, early_stopping: bool | str = "never") -> BeamOutput:
    """Beam search (num_groups=1) or Diverse Beam Search. See the module docstring for the rules.

    early_stopping: when a row with a full buffer stops, transformers' values: "never" (the exact best
    hypotheses), False (transformers' default heuristic) or True (as soon as the buffer is full).

    constraint: a Constraint with the candidate form (jaxdecode.constraints.TrieConstraint): every
    hypothesis is then an item of the row's set. Each beam expands over its candidate list (the
    STATIC step) instead of the vocabulary; a candidate may end its hypothesis (EOS, or a final leaf
    without EOS ids). When a row's set has fewer items than beams, the missing hypotheses keep
    score -inf and length 0.
    """
    for name, value in (("num_beams", num_beams), ("num_groups", num_groups)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise BeamConfigError(f"{name} must be an int >= 1, got {value!r}")
    if num_beams % num_groups:
        raise BeamConfigError(f"num_beams ({num_beams}) must be a multiple of num_groups ({num_groups})")
    if not any(early_stopping is v or (isinstance(v, str) and early_stopping == v) for v in EARLY_STOPPING):
        raise BeamConfigError(f"early_stopping must be True, False or 'never' (transformers' values), got "
                              f"{early_stopping!r}")
    length_penalty = _real("length_penalty", length_penalty)
    diversity_penalty = _real("diversity_penalty", diversity_penalty, 0.0)
    eos_ids = validate_eos_ids(config, eos_ids)
    check_auto_axes(params=params, prompt_tokens=prompt_tokens, prompt_lengths=prompt_lengths)
    prompt_tokens, prompt_lengths = validate_prompts(config, prompt_tokens, prompt_lengths,
                                                     max_new_tokens, cache_len)
    group_size = num_beams // num_groups
    if group_size > config.vocab_size ** min(max_new_tokens, 64):
        raise BeamConfigError(
            f"{group_size} beams per group but only {config.vocab_size}^{max_new_tokens} possible "
            f"continuations; lower num_beams or raise max_new_tokens")
    if cache_len is None:
        cache_len = default_cache_len(prompt_tokens.shape[1], max_new_tokens)
    if constraint is not None:
        constraint = constraint.prepare(config.vocab_size, eos_ids, max_new_tokens, prompt_tokens.shape[0])
    return _beam_search(config, split_layers(config, params), prompt_tokens, prompt_lengths, constraint,
                        max_new_tokens=max_new_tokens,
                        num_beams=num_beams, num_groups=num_groups, length_penalty=length_penalty,
                        diversity_penalty=diversity_penalty, eos_ids=eos_ids, cache_len=cache_len,
                        early_stopping=early_stopping)


__all__ = ["BeamOutput", "BeamConfigError", "PromptError", "beam_search"]
