"""Commit rules of the diffusion decoders (jaxdecode.diffusion), one small frozen dataclass per paper
(ALGORITHMS.md §5), and the decode side of the Learn2PD filter.

A rule sees one forward's predictions for the answer slots (`StepContext`, all [B, A, ...]) and returns
`(commit bool[B, A], tokens int32[B, A], rule_state)`; the loop commits only eligible slots and adds
the most confident one when a rule chose none (`at_least_one`). Rules are static arguments of the decoder's jit, so
they are hashable (frozen dataclasses of numbers; Learn2PD hashes its filter by identity).
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.autoregressive import is_eos
from jaxdecode.sampling import first_argmax


class DiffusionError(ValueError):
    """Inputs a diffusion decoder cannot decode as given (with what to fix)."""


# ----------------------------------------------------------------------------- shared math
def confidence(logits):
    """(probs [..., V] f32, confidence = max prob [...], argmax [...] int32)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    return probs, jnp.max(probs, axis=-1), first_argmax(logits.astype(jnp.float32))


def entropy(probs):
    return -jnp.sum(jnp.where(probs > 0, probs * jnp.log(jnp.maximum(probs, 1e-30)), 0.0), axis=-1)


def rank_desc(score, eligible):
    """int32[B, A]: rank of each eligible slot by score, highest first (ties: lower slot); ineligible
    slots rank after every eligible one."""
    s = jnp.where(eligible, score, -jnp.inf)
    order = jnp.argsort(-s, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True).astype(jnp.int32)


def top_n(score, eligible, n):
    """bool[B, A]: the n (int or int[B]) highest-scoring eligible slots of each row."""
    n = jnp.broadcast_to(jnp.asarray(n, jnp.int32), score.shape[:1])
    return eligible & (rank_desc(score, eligible) < n[:, None])


def with_top1(commit, conf, eligible):
    """commit plus each row's most confident eligible slot (every rule commits >= 1 per forward)."""
    return (commit & eligible) | top_n(conf, eligible, 1)


def at_least_one(commit, conf, eligible):
    """commit's eligible slots; a row that chose none gets its most confident eligible slot instead (the
    loop's guarantee of progress, for rules whose picks need not include the most confident slot)."""
    commit = commit & eligible
    return jnp.where(jnp.any(commit, axis=-1, keepdims=True), commit, top_n(conf, eligible, 1))


# ----------------------------------------------------------------------------- rules
@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a rule sees at one forward (all in the answer frame, [B, A, ...])."""
    logits: jax.Array  # f32[B, A, V]: the prediction for each answer slot
    eligible: jax.Array  # bool[B, A]: masked slots of the current block, before the row's end
    committed: jax.Array  # bool[B, A]: slots already holding their final token (padding included)
    answer: jax.Array  # int32[B, A]
    key: jax.Array
    state: object  # the rule's own state (rule.init)
    eos_ids: tuple
    block_start: jax.Array = None  # int32[B]: first slot of the row's current block (None: 0)
    block_end: jax.Array = None  # int32[B]: one past its last slot, the row's end included (None: A)


def block_bounds(ctx: StepContext):
    """(start, end) int32[B, 1] of each row's current semi-autoregressive block ([0, A) when the loop
    did not say)."""
    b, a = ctx.eligible.shape
    start = jnp.zeros((b,), jnp.int32) if ctx.block_start is None else ctx.block_start
    end = jnp.full((b,), a, jnp.int32) if ctx.block_end is None else ctx.block_end
    return start[:, None], end[:, None]


class Rule:
    """A commit rule. Subclasses are frozen dataclasses (hashable: a static argument of the jit)."""
    name = "rule"
    lookahead = 0  # > 0: the rule drafts and verifies in one batched forward (FreeDave)

    def init(self, batch: int, answer_length: int, vocab: int):
        return None

    def select(self, ctx: StepContext):
        """(commit bool[B, A], tokens int32[B, A], new rule state). Every rule but the lookahead ones
        (FreeDave: the loop runs its draft-and-verify step instead) defines it."""
        raise DiffusionError(f"rule {self.name!r} ({type(self).__name__}) does not define select(): a commit rule "
                             f"returns which eligible slots to commit each forward (see jaxdecode.diffusion_rules)")

    def check(self, config, eos_ids: tuple) -> None:
        """Raise DiffusionError for parameters this rule cannot run with."""

    def visible(self, state, committed):
        """None, or bool[B, A]: the answer slots the next forward attends to (cache='none'); a rule that
        prunes the far field (Window-Diffusion) says which. Decided before the forward, from the rule's
        state and the committed slots."""

    # Lookahead rules (lookahead = K > 0) replace select by two steps around one batched forward:
    def propose(self, ctx: StepContext):
        """(commit bool[K, B, A], tokens int32[B, A]): K candidate commit sets from ctx.logits."""
        raise DiffusionError(f"rule {self.name!r} has lookahead > 0 but does not define propose()")

    def choose(self, ctx: StepContext, commits, masked, eligible, logits):
        """(int32[B] index of the candidate each row keeps, new rule state), given each candidate's
        frame after its commits (masked / eligible bool[K, B, A]) and its forward's logits [K, B, A, V]."""
        raise DiffusionError(f"rule {self.name!r} has lookahead > 0 but does not define choose()")


def check_unit(name, x, *, low_open=False):
    if not isinstance(x, numbers.Real) or isinstance(x, bool) or not (0 < x <= 1 if low_open else 0 <= x <= 1):
        raise DiffusionError(f"{name} must be a number in {'(0' if low_open else '[0'}, 1], got {x!r}")


def check_int(name, x, low=1):
    if not isinstance(x, numbers.Integral) or isinstance(x, bool) or x < low:
        raise DiffusionError(f"{name} must be an int >= {low}, got {x!r}")


@dataclasses.dataclass(frozen=True)
class Greedy1(Rule):
    """One token per forward: the most confident eligible slot, its argmax (ties: lower slot). The
    reference every lossless decoder (FreeDave) must reproduce."""
    name = "greedy1"

    def select(self, ctx):
        _, conf, x = confidence(ctx.logits)
        return top_n(conf, ctx.eligible, 1), x, ctx.state


@dataclasses.dataclass(frozen=True)
class LLaDA(Rule):
    """LLaDA low-confidence remasking: commit the `tokens_per_step` most confident eligible slots (their
    argmax); the rest stay masked. tokens_per_step=1 is Greedy1."""
    tokens_per_step: int = 1
    name = "llada"

    def check(self, config, eos_ids):
        check_int("tokens_per_step", self.tokens_per_step)

    def select(self, ctx):
        _, conf, x = confidence(ctx.logits)
        return top_n(conf, ctx.eligible, self.tokens_per_step), x, ctx.state


@dataclasses.dataclass(frozen=True)
class RandomRemask(Rule):
    """Random remasking (LLaDA's baseline): `tokens_per_step` eligible slots chosen uniformly at random,
    each committed with its argmax."""
    tokens_per_step: int = 1
    name = "random"

    def check(self, config, eos_ids):
        check_int("tokens_per_step", self.tokens_per_step)

    def select(self, ctx):
        _, _, x = confidence(ctx.logits)
        score = jax.random.uniform(ctx.key, ctx.eligible.shape)
        return top_n(score, ctx.eligible, self.tokens_per_step), x, ctx.state


@dataclasses.dataclass(frozen=True)
class Threshold(Rule):
    """Fast-dLLM confidence threshold: commit every eligible slot with max prob >= threshold, at least
    the most confident one. threshold 1.0 commits one token per forward (Greedy1) unless a prob is
    exactly 1."""
    threshold: float = 0.9
    name = "threshold"

    def check(self, config, eos_ids):
        check_unit("threshold", self.threshold)

    def select(self, ctx):
        _, conf, x = confidence(ctx.logits)
        return with_top1(conf >= self.threshold, conf, ctx.eligible), x, ctx.state


@dataclasses.dataclass(frozen=True)
class Factor(Rule):
    """Fast-dLLM factor rule: with the eligible confidences sorted c_(1) >= c_(2) >= ..., commit the top n
    for the largest n with (n + 1) * (1 - c_(n)) < factor (at least one)."""
    factor: float = 1.0
    name = "factor"

    def check(self, config, eos_ids):
        if not isinstance(self.factor, numbers.Real) or isinstance(self.factor, bool) or self.factor <= 0:
            raise DiffusionError(f"factor must be a number > 0, got {self.factor!r}")

    def select(self, ctx):
        _, conf, x = confidence(ctx.logits)
        rank = rank_desc(conf, ctx.eligible)  # 0-based: slot of rank r is c_(r+1)
        ok = ctx.eligible & ((rank + 2).astype(jnp.float32) * (1.0 - conf) < self.factor)
        # largest n such that the condition holds at c_(n): the sorted c are decreasing, so (n+1)(1-c_(n))
        # increases with n and the satisfied ranks form a prefix.
        n = jnp.max(jnp.where(ok, rank + 1, 0), axis=-1)
        return with_top1(rank < n[:, None], conf, ctx.eligible), x, ctx.state


@dataclasses.dataclass(frozen=True)
class Credit(Rule):
    """CreditDecoding (Wang et al., "CreditDecoding: Accelerating Parallel Decoding in Diffusion Large
    Language Models with Trace Credits", arXiv 2510.06133), as ALGORITHMS.md §5 states it: per slot a
    credit over the vocabulary, C <- decay * C, C[i, x_i] += c_i ** power for every masked slot (x_i, c_i
    from the model's logits); decode from logits + alpha * log(1 + C) under the confidence threshold (at
    least one per forward). Defaults: ALGORITHMS.md's (decay 0.8, power 0.2, alpha 0.7, threshold 0.9)."""
    threshold: float = 0.9
    decay: float = 0.8
    power: float = 0.2
    alpha: float = 0.7
    name = "credit"

    def check(self, config, eos_ids):
        check_unit("threshold", self.threshold)
        check_unit("decay", self.decay)

    def init(self, batch, answer_length, vocab):
        return jnp.zeros((batch, answer_length, vocab), jnp.float32)

    def select(self, ctx):
        _, conf, x = confidence(ctx.logits)
        masked = ~ctx.committed
        add = jax.nn.one_hot(x, ctx.logits.shape[-1], dtype=jnp.float32) * (conf ** self.power)[..., None]
        credit = self.decay * ctx.state + jnp.where(masked[..., None], add, 0.0)
        _, conf2, x2 = confidence(ctx.logits + self.alpha * jnp.log1p(credit))
        return with_top1(conf2 >= self.threshold, conf2, ctx.eligible), x2, credit


@dataclasses.dataclass(frozen=True)
class LocalLeap(Rule):
    """LocalLeap: anchors are eligible slots with confidence >= anchor; also commit eligible slots within
    `radius` slots of an anchor whose confidence is >= near. At least one per forward."""
    anchor: float = 0.9
    near: float = 0.75
    radius: int = 4
    name = "localleap"

    def check(self, config, eos_ids):
        check_unit("anchor", self.anchor)
        check_unit("near", self.near)
        check_int("radius", self.radius, 0)

    def select(self, ctx):
        _, conf, x = confidence(ctx.logits)
        anchors = ctx.eligible & (conf >= self.anchor)
        a = anchors.shape[1]
        pos = jnp.arange(a)
        close = jnp.abs(pos[:, None] - pos[None, :]) <= self.radius  # [A, A]
        near_anchor = jnp.any(anchors[:, None, :] & close[None], axis=-1)
        return with_top1(anchors | (near_anchor & (conf >= self.near)), conf, ctx.eligible), x, ctx.state


def _check_nonneg(name, x):
    if not isinstance(x, numbers.Real) or isinstance(x, bool) or not math.isfinite(x) or x < 0:
        raise DiffusionError(f"{name} must be a finite number >= 0, got {x!r}")


EB_PROXIES = ("entropy", "confidence", "margin")


@dataclasses.dataclass(frozen=True)
class EntropyBounded(Rule):
    """EB-sampler: Ben-Hamu et al., "Accelerated Sampling from Masked Diffusion Models via Entropy Bounded
    Unmasking" (arXiv 2505.24857). Sort the eligible slots by an error proxy, most reliable first, and
    commit the largest prefix U of that order (each slot with its argmax) such that

        sum_{i in U} H(p_i) - max_{i in U} H(p_i) <= gamma

    (the first slot alone always satisfies it). `proxy`: "entropy" (lowest first: the public EB-sampler
    implementations' choice, the default), "confidence" or "margin" (top-1 minus top-2 probability,
    highest first), the paper's three proxies. gamma: the paper sweeps 1e-3 .. 1; 0.1 is the public
    code's default. Nothing simplified: the rule needs only the current forward."""
    gamma: float = 0.1
    proxy: str = "entropy"
    name = "eb"

    def check(self, config, eos_ids):
        _check_nonneg("gamma", self.gamma)
        if self.proxy not in EB_PROXIES:
            raise DiffusionError(f"proxy must be one of {EB_PROXIES} (the EB-sampler's error proxies), got "
                                 f"{self.proxy!r}")

    def select(self, ctx):
        probs, conf, x = confidence(ctx.logits)
        h = entropy(probs)
        if self.proxy == "entropy":
            score = -h
        elif self.proxy == "confidence":
            score = conf
        else:
            top2 = jax.lax.top_k(probs, 2)[0]  # [B, A, 2]
            score = top2[..., 0] - top2[..., 1]
        rank = rank_desc(score, ctx.eligible)
        hs = jnp.take_along_axis(jnp.where(ctx.eligible, h, 0.0), jnp.argsort(rank, axis=-1), axis=-1)
        bound = jnp.cumsum(hs, axis=-1) - jax.lax.cummax(hs, axis=hs.ndim - 1)  # non-decreasing along the order
        n = jnp.sum(jnp.cumprod((bound <= self.gamma).astype(jnp.int32), axis=-1), axis=-1)
        return at_least_one(ctx.eligible & (rank < n[:, None]), conf, ctx.eligible), x, ctx.state


@dataclasses.dataclass(frozen=True)
class InfoGain(Rule):
    """Info-Gain Sampler: Yang et al., "Improving Sampling for Masked Diffusion Models via Information
    Gain" (arXiv 2602.18176; github.com/yks23/Information-Gain-Sampler). Each step draws `candidates`
    actions a (sets of `tokens_per_step` eligible slots, with their argmax): a_0 = the most confident
    slots, a_c = the top slots of c_i / position_temperature + Gumbel noise; ONE batched lookahead
    forward runs the model on every candidate's next state, and the row keeps

        a* = argmax_a J(a),  J(a) = -sum_{i in a} H(p_i) - mean_{j masked after a} H(p'_j)

    (p': the lookahead's distributions; the information gain over the remaining slots minus the
    uncertainty committed now). The kept candidate's lookahead logits are the next step's current
    logits, so each step costs one (candidates-times-wider) forward, like FreeDave. Defaults are the
    authors' (8 candidates, position temperature 0.1, one token per step). Simplified: greedy tokens
    (the authors' temperature-0 setting); duplicate candidates are scored twice instead of dropped
    (same choice); the beam (beam_size > 1) and KV-cache variants are not implemented (cache='none')."""
    tokens_per_step: int = 1
    candidates: int = 8
    position_temperature: float = 0.1
    name = "infogain"

    @property
    def lookahead(self):
        return self.candidates

    def check(self, config, eos_ids):
        check_int("tokens_per_step", self.tokens_per_step)
        check_int("candidates", self.candidates)
        if (not isinstance(self.position_temperature, numbers.Real) or isinstance(self.position_temperature, bool)
                or not self.position_temperature > 0):
            raise DiffusionError(f"position_temperature must be a number > 0, got {self.position_temperature!r}")

    def propose(self, ctx):
        _, conf, x = confidence(ctx.logits)
        noise = jax.random.gumbel(ctx.key, (self.candidates - 1,) + conf.shape)  # [N-1, B, A]
        scores = jnp.concatenate([conf[None], conf[None] / self.position_temperature + noise])
        return jax.vmap(lambda sc: top_n(sc, ctx.eligible, self.tokens_per_step))(scores), x

    def choose(self, ctx, commits, masked, eligible, logits):
        probs, _, _ = confidence(ctx.logits)
        cost = jnp.sum(jnp.where(commits & ctx.eligible, entropy(probs)[None], 0.0), axis=-1)  # [N, B]
        h_next = entropy(jax.nn.softmax(logits.astype(jnp.float32), axis=-1))  # [N, B, A]
        mean_next = jnp.sum(jnp.where(masked, h_next, 0.0), axis=-1) / jnp.maximum(jnp.sum(masked, axis=-1), 1)
        return jnp.argmax(-cost - mean_next, axis=0).astype(jnp.int32), ctx.state


@dataclasses.dataclass(frozen=True)
class CCD(Rule):
    """CCD, Coherent Contextual Decoding, adaptive-budget form (CCD-DS): Chen et al., "Beyond Confidence:
    Adaptive and Coherent Decoding for Diffusion Language Models" (arXiv 2512.02044), as the authors'
    released sampler (github.com/tonyckc/CCD-DLM-code, `seek_mode`) implements it. Slots are ranked by
    negative entropy. Each forward keeps a verification buffer V: the n_v best-ranked slots left masked,
    with their argmax. At the next forward, with T = the k best-ranked slots and C = the n_v best,

        M = {i in C ∩ V : argmax_t(i) = argmax_{t-1}(i)}   (predictions consistent across forwards)
        commit M  if t >= warmup, T ∩ V != {} and |M| >= k;   else commit T

    so the budget grows to |M| when the history agrees. n_v = 1 for the first warmup-1 forwards, then
    grows by one per forward up to k + floor(k * expand_ratio). Defaults are the authors' (k =
    tokens_per_step 1, i.e. steps = answer length; expand_ratio 4; warmup 5). Simplified: the released
    code's late-stage reset of n_v (when < 10% of the slots are masked) is left out; the forward count
    is per row."""
    tokens_per_step: int = 1
    expand_ratio: float = 4.0
    warmup: int = 5
    name = "ccd"

    def check(self, config, eos_ids):
        check_int("tokens_per_step", self.tokens_per_step)
        _check_nonneg("expand_ratio", self.expand_ratio)
        check_int("warmup", self.warmup)

    def init(self, batch, answer_length, vocab):
        return (jnp.zeros((batch, answer_length), bool), jnp.full((batch, answer_length), -1, jnp.int32),
                jnp.zeros((batch,), jnp.int32))

    def select(self, ctx):
        probs, _, x = confidence(ctx.logits)
        verify, prev_x, t = ctx.state
        k = self.tokens_per_step
        n_max = k + int(k * self.expand_ratio)
        n_v = jnp.where(t < self.warmup - 1, 1, jnp.minimum(t - self.warmup + 3, n_max))[:, None]
        score = -entropy(probs)
        rank = rank_desc(score, ctx.eligible)
        top = ctx.eligible & (rank < k)
        matched = ctx.eligible & (rank < n_v) & verify & (x == prev_x)
        use = ((t >= self.warmup)[:, None] & jnp.any(top & verify, axis=-1, keepdims=True)
               & (jnp.sum(matched, axis=-1, keepdims=True) >= k))
        commit = jnp.where(use, matched, top)
        left = ctx.eligible & ~commit
        verify = left & (rank_desc(score, left) < n_v)
        return commit, x, (verify, x, t + 1)


@dataclasses.dataclass(frozen=True)
class ETE(Rule):
    """ETE, Explore-Then-Exploit: Fu et al., "From Bits to Rounds: Parallel Decoding with Exploration for
    Diffusion Language Models" (arXiv 2511.21103). Only the abstract could be found (no method text, no
    code): ETE "combines cross-block decoding with targeted exploration of high-uncertainty tokens to
    reshape the conditional distribution and trigger cascades of confident predictions". This rule does
    only what that sentence states:

        exploit: commit {i : c_i >= threshold};  if that is empty, explore: commit the `explore`
        eligible slots of highest entropy H(p_i) (their argmax)

    Defaults are not from the paper (threshold 0.9 as Fast-dLLM, explore 1). Simplified / unknown: the
    paper's exploration budget and how it picks explored tokens beyond "high uncertainty"; cross-block
    decoding is whatever the loop's blocks allow (block_length = answer_length lets confident slots
    anywhere commit)."""
    threshold: float = 0.9
    explore: int = 1
    name = "ete"

    def check(self, config, eos_ids):
        check_unit("threshold", self.threshold)
        check_int("explore", self.explore)

    def select(self, ctx):
        probs, conf, x = confidence(ctx.logits)
        sure = ctx.eligible & (conf >= self.threshold)
        uncertain = top_n(entropy(probs), ctx.eligible, self.explore)
        pick = jnp.where(jnp.any(sure, axis=-1, keepdims=True), sure, uncertain)
        return at_least_one(pick, conf, ctx.eligible), x, ctx.state


@dataclasses.dataclass(frozen=True)
class Window(Rule):
    """Window-Diffusion: Zuo et al., "Window-Diffusion: Accelerating Diffusion Language Model Inference
    with Windowed Token Pruning and Caching" (arXiv 2601.20332; github.com/vhicrgit/Window-Diffusion).
    Every `refresh` forwards one full forward, whose candidates are all masked slots; it fixes the
    window: the decoded slots and the `window_tokens` leftmost slots still masked. In between, the
    forwards leave the far field (masked slots outside the window) out of attention, and only the
    `active` leftmost masked slots are candidates. Each forward commits the `tokens_per_step` most
    confident candidates (the authors' sampler keeps LLaDA's fixed count):

        C_t = E_t  if t mod refresh = 0,  else {i in E_t : #(masked slots left of i) < active};
        commit top_k(c, C_t)

    Defaults: the authors' example (active 16, window 64, refresh 32, one token per step). Simplified:
    between refreshes the paper reuses the buffer slots' keys and values from the refresh (computing
    only the active slots); here every kept slot is recomputed each forward (exact within the window),
    so the commit schedule and the pruning are the paper's and the cache reuse is not. The pruning
    applies with cache='none'; the forward count t is per row."""
    tokens_per_step: int = 1
    active: int = 16
    window_tokens: int = 64
    refresh: int = 32
    name = "window"

    def check(self, config, eos_ids):
        check_int("tokens_per_step", self.tokens_per_step)
        check_int("active", self.active)
        check_int("window_tokens", self.window_tokens)
        check_int("refresh", self.refresh)

    def init(self, batch, answer_length, vocab):
        return jnp.zeros((batch,), jnp.int32), jnp.ones((batch, answer_length), bool)  # (forwards, window)

    def visible(self, state, committed):
        t, window = state
        return (t % self.refresh == 0)[:, None] | window | committed

    def select(self, ctx):
        _, conf, x = confidence(ctx.logits)
        t, window = ctx.state
        left = jnp.cumsum((~ctx.committed).astype(jnp.int32), axis=-1) - 1  # masked slots before each slot
        full = (t % self.refresh == 0)[:, None]
        commit = top_n(conf, ctx.eligible & (full | (left < self.active)), self.tokens_per_step)
        masked = ~ctx.committed & ~commit
        fresh = masked & (jnp.cumsum(masked.astype(jnp.int32), axis=-1) <= self.window_tokens)
        return commit, x, (t + 1, jnp.where(full, fresh, window))


@dataclasses.dataclass(frozen=True)
class R2(Rule):
    """R²-dLLM's training-free decoding rules: Du et al., "R²-dLLM: Accelerating Diffusion Large Language
    Models via Spatio-Temporal Redundancy Reduction" (arXiv 2604.18995), as the authors' sampler
    (github.com/GATECH-EIC/R2-dLLM, llada/generate.py) applies them, in order, to one forward of the
    current block (c_i, x_i: confidence and argmax):

    1. threshold: i commits if c_i >= threshold (at least the most confident slot);
    2. confidence clusters: every window of `cluster_size` consecutive block slots holding at most
       `cluster_unmasked` unmasked slots (after 1) whose masked slots have mean c >= spatial_threshold
       commits all of them;
    3. token clusters: each maximal run (>= 2) of consecutive still-masked slots with the same x_i whose
       max c > spatial_threshold commits its most confident slot (mode "confidence");
    4. temporal: a still-masked slot whose argmax has been the same for `temporal_steps` consecutive
       forwards (counted while it is in the current block) commits if c_i >= temporal_threshold
       (evaluation "last").

    Defaults are the authors' GSM8K script (threshold 0.9, cluster 3, spatial 0.8, at most 1 unmasked,
    token clusters on, temporal 3 steps at 0.8). No committed token is remasked (the authors' sampler
    never does). Nothing simplified beyond: the authors pair the rules with Fast-dLLM's dual cache (here
    any cache mode), and the paper's redundancy-aware fine-tuning is not part of a decoder."""
    threshold: float = 0.9
    cluster_size: int = 3
    spatial_threshold: float = 0.8
    cluster_unmasked: int = 1
    token_clusters: bool = True
    temporal_steps: int = 3
    temporal_threshold: float = 0.8
    name = "r2"

    def check(self, config, eos_ids):
        check_unit("threshold", self.threshold)
        check_int("cluster_size", self.cluster_size)
        check_unit("spatial_threshold", self.spatial_threshold)
        check_int("cluster_unmasked", self.cluster_unmasked, 0)
        if not isinstance(self.token_clusters, bool):
            raise DiffusionError(f"token_clusters must be True or False, got {self.token_clusters!r}")
        check_int("temporal_steps", self.temporal_steps)
        check_unit("temporal_threshold", self.temporal_threshold)

    def init(self, batch, answer_length, vocab):
        return jnp.full((batch, answer_length), -1, jnp.int32), jnp.zeros((batch, answer_length), jnp.int32)

    def _clusters(self, masked, conf, start, end):
        """bool[B, A]: masked slots inside a window of cluster_size block slots with <= cluster_unmasked
        unmasked ones and mean masked confidence >= spatial_threshold."""
        w, a = self.cluster_size, masked.shape[1]
        if w > a:
            return jnp.zeros_like(masked)
        m = jnp.pad(masked, ((0, 0), (0, w - 1)))
        c = jnp.pad(jnp.where(masked, conf, 0.0), ((0, 0), (0, w - 1)))
        n = sum(m[:, o:o + a].astype(jnp.int32) for o in range(w))  # [B, A]: masked slots of window j..j+w-1
        tot = sum(c[:, o:o + a] for o in range(w))
        j = jnp.arange(a)[None, :]
        ok = ((j >= start) & (j + w <= end) & (n > 0) & (w - n <= self.cluster_unmasked)
              & (tot >= self.spatial_threshold * jnp.maximum(n, 1)))
        ok = jnp.pad(ok, ((0, 0), (w - 1, 0)))
        return masked & jnp.any(jnp.stack([ok[:, w - 1 - o:w - 1 - o + a] for o in range(w)]), axis=0)

    def _token_clusters(self, masked, conf, x):
        """bool[B, A]: the most confident slot (first on ties) of each run >= 2 of consecutive masked slots
        sharing the argmax, when that confidence > spatial_threshold."""
        a = masked.shape[1]
        prev_same = jnp.pad(masked[:, :-1] & (x[:, :-1] == x[:, 1:]), ((0, 0), (1, 0)))
        run = jnp.cumsum((masked & ~prev_same).astype(jnp.int32), axis=-1)  # run id of each masked slot
        same = masked[:, :, None] & masked[:, None, :] & (run[:, :, None] == run[:, None, :])  # [B, A, A]
        length = jnp.sum(same, axis=-1)
        best = jnp.max(jnp.where(same, conf[:, None, :], -jnp.inf), axis=-1)
        first = jnp.min(jnp.where(same & (conf[:, None, :] == best[..., None]), jnp.arange(a), a), axis=-1)
        return masked & (length >= 2) & (best > self.spatial_threshold) & (first == jnp.arange(a))

    def select(self, ctx):
        _, conf, x = confidence(ctx.logits)
        start, end = block_bounds(ctx)
        commit = at_least_one(conf >= self.threshold, conf, ctx.eligible)
        commit = commit | self._clusters(ctx.eligible & ~commit, conf, start, end)
        if self.token_clusters:
            commit = commit | self._token_clusters(ctx.eligible & ~commit, conf, x)
        last, run = ctx.state
        active = ctx.eligible & ~commit
        run = jnp.where(active, jnp.where(x == last, run + 1, 1), jnp.where(ctx.eligible, 0, run))
        last = jnp.where(active, x, jnp.where(ctx.eligible, -1, last))
        commit = commit | (active & (run >= self.temporal_steps) & (conf >= self.temporal_threshold))
        return commit, x, (jnp.where(commit, -1, last), jnp.where(commit, 0, run))


@dataclasses.dataclass(frozen=True)
class Dystruct(Rule):
    """Commit the eligible slots whose confidence is >= threshold, and extend each committed run to its
    right neighbour while that neighbour's confidence is >= the relaxed `follow` threshold. At least one
    per forward.

    NOT verified against the paper. Only the title and id were found: "Dystruct: Dynamically Structured
    Diffusion Language Model Decoding via Bayesian Inference" (arXiv 2605.09820); neither its text nor
    code could be read, so its (Bayesian) rule is unknown. This is the previous wave's reading of the
    name, kept so that rule="dystruct" still runs; do not cite it as the paper's method."""
    threshold: float = 0.9
    follow: float = 0.7
    name = "dystruct"

    def check(self, config, eos_ids):
        check_unit("threshold", self.threshold)
        check_unit("follow", self.follow)

    def select(self, ctx):
        _, conf, x = confidence(ctx.logits)
        sure = ctx.eligible & (conf >= self.threshold)
        follow = ctx.eligible & (conf >= self.follow)

        def grow(c, _):
            left = jnp.pad(c, ((0, 0), (1, 0)))[:, :-1]
            return c | (left & follow), None
        pick, _ = jax.lax.scan(grow, sure, None, length=min(conf.shape[1], 64))
        return with_top1(pick, conf, ctx.eligible), x, ctx.state


@dataclasses.dataclass(frozen=True)
class AdaBlock(Rule):
    """AdaBlock-dLLM: Lu et al., "AdaBlock-dLLM: Semantic-Aware Diffusion LLM Inference via Adaptive Block
    Size" (arXiv 2509.26432; github.com/lgxi24/AdaBlock-dLLM). Semi-autoregressive blocks whose size is
    chosen when a block starts, from that forward: with s the first masked slot and W = floor(window
    * answer_length) slots from s, let d = the slot in [s, s + W) whose argmax is a delimiter with the
    highest confidence c_d;

        block = [s, d]  if c_d >= delimiter_threshold,  else [s, s + block_length)

    and inside the block the Fast-dLLM threshold (c_i >= threshold, at least the most confident slot).
    Defaults are the authors' scripts (threshold 0.9, delimiter_threshold 0.3, block_length 32 =
    init_block_length, window 0.25). `delimiters`: the authors use the newline token of their tokenizer
    (LLaDA's 198); jaxdecode does not know the tokenizer, so the default is the EOS ids: pass the newline
    id(s) for the paper's setting; with neither, every block has block_length slots (the paper's
    fixed-size baseline). Use the loop's block_length = answer_length (the default for bidirectional
    models) so the adaptive blocks replace the fixed ones; a smaller loop block cuts them."""
    threshold: float = 0.9
    delimiter_threshold: float = 0.3
    block_length: int = 32
    window: float = 0.25
    delimiters: tuple = ()
    name = "adablock"

    def check(self, config, eos_ids):
        check_unit("threshold", self.threshold)
        check_unit("delimiter_threshold", self.delimiter_threshold)
        check_int("block_length", self.block_length)
        check_unit("window", self.window)
        for d in self.delimiters:
            if isinstance(d, bool) or not isinstance(d, numbers.Integral) or not 0 <= d < config.vocab_size:
                raise DiffusionError(f"delimiters must be token ids in [0, {config.vocab_size}), got "
                                     f"{self.delimiters!r}")

    def init(self, batch, answer_length, vocab):
        return jnp.zeros((batch,), jnp.int32)  # one past the current adaptive block's last slot

    def select(self, ctx):
        _, conf, x = confidence(ctx.logits)
        a = x.shape[1]
        pos = jnp.arange(a, dtype=jnp.int32)[None, :]
        masked = ~ctx.committed
        start = jnp.min(jnp.where(masked, pos, a), axis=-1)  # [B]
        span = int(self.window * a)
        delim = masked & is_eos(x, tuple(self.delimiters or ctx.eos_ids)) & (pos < (start + span)[:, None])
        dconf = jnp.where(delim, conf, -1.0)
        d = jnp.argmax(dconf, axis=-1).astype(jnp.int32)
        found = jnp.max(dconf, axis=-1) >= self.delimiter_threshold
        new_end = jnp.where(found, d + 1, jnp.minimum(start + self.block_length, a))
        end = jnp.where(start >= ctx.state, new_end, ctx.state)  # a new block starts when the last one is done
        cand = ctx.eligible & (pos < end[:, None])
        return at_least_one(conf >= self.threshold, conf, cand), x, end


@dataclasses.dataclass(frozen=True)
class Learn2PD(Rule):
    """Learn2PD: a small filter network (filter_apply over filter_features) scores every slot; commit the
    eligible slots with sigmoid(score) > threshold plus the most confident one. End-of-Text
    Prediction (eot_threshold < 1): the first eligible slot predicting an EOS id with confidence >=
    eot_threshold commits too, which ends the answer there (the rest is padding, never decoded).
    `params` is the filter's dict pytree (load_filter); it is hashed by identity as a static argument,
    so keep one object per filter."""
    params: dict = dataclasses.field(default=None, hash=False, compare=False)
    threshold: float = 0.5
    eot_threshold: float = 0.9
    name = "learn2pd"

    def check(self, config, eos_ids):
        if self.params is None:
            raise DiffusionError("rule learn2pd needs a trained filter: Learn2PD(params=load_filter(dir)[0]) "
                                 "(generate: filter=DIR, written by `jaxdecode train filter`)")
        check_unit("threshold", self.threshold)
        check_unit("eot_threshold", self.eot_threshold)

    def __hash__(self):
        return hash((self.name, id(self.params), self.threshold, self.eot_threshold))

    def __eq__(self, other):
        return (type(other) is type(self) and other.params is self.params and other.threshold == self.threshold
                and other.eot_threshold == self.eot_threshold)

    def select(self, ctx):
        _, conf, x = confidence(ctx.logits)
        score = jax.nn.sigmoid(filter_apply(self.params, filter_features(conf, ctx.committed)))
        pick = score > self.threshold
        eot = ctx.eligible & is_eos(x, ctx.eos_ids) & (conf >= self.eot_threshold)
        pos = jnp.arange(x.shape[1])[None, :]
        first_eot = eot & (pos == jnp.min(jnp.where(eot, pos, x.shape[1]), axis=-1, keepdims=True))
        return with_top1(pick | first_eot, conf, ctx.eligible), x, ctx.state


@dataclasses.dataclass(frozen=True)
class FreeDave(Rule):
    """FreeDave (lossless w.r.t. Greedy1): from the current forward, draft D_j = the j most confident
    eligible slots with their argmax, j = 1..draft; run the model on all drafts in ONE batched forward;
    D_{j+1} is consistent when Greedy1's pick after D_j is exactly its (j+1)-th element; commit the
    longest consistent draft, whose forward is the next step's current forward. Output equals
    Greedy1's token for token; each loop step costs one (draft-times-wider) forward."""
    draft: int = 4
    name = "freedave"

    @property
    def lookahead(self):
        return self.draft

    def check(self, config, eos_ids):
        check_int("draft", self.draft)

    def propose(self, ctx):
        _, conf, x = confidence(ctx.logits)
        rank = rank_desc(conf, ctx.eligible)
        js = jnp.arange(1, self.draft + 1, dtype=jnp.int32)  # draft sizes
        return ctx.eligible[None] & (rank[None] < js[:, None, None]), x

    def choose(self, ctx, commits, masked, eligible, logits):
        _, conf, x = confidence(ctx.logits)
        rank = rank_desc(conf, ctx.eligible)
        js = jnp.arange(1, self.draft + 1, dtype=jnp.int32)
        # Greedy1's pick after each draft D_j
        _, conf_j, x_j = confidence(logits)
        pick_slot = jnp.argmax(jnp.where(eligible, conf_j, -jnp.inf), axis=-1)  # [K, B] (ties: lower slot)
        pick_tok = jnp.take_along_axis(x_j, pick_slot[..., None], axis=-1)[..., 0]
        # the (j+1)-th draft element: the slot of rank j, with its argmax from the current logits
        want_slot = jnp.argmax(rank[None] == js[:, None, None], axis=-1)  # [K, B]
        want_tok = jnp.take_along_axis(x, want_slot.T, axis=-1).T
        n_elig = jnp.sum(ctx.eligible, axis=-1)
        ok = (jnp.any(eligible, axis=-1) & (js[:, None] < n_elig[None]) & (pick_slot == want_slot)
              & (pick_tok == want_tok))  # D_{j+1} is consistent
        return jnp.sum(jnp.cumprod(ok[:-1].astype(jnp.int32), axis=0), axis=0), ctx.state


RULES = {"greedy1": Greedy1, "llada": LLaDA, "random": RandomRemask, "threshold": Threshold,
         "factor": Factor, "learn2pd": Learn2PD, "credit": Credit, "localleap": LocalLeap,
         "freedave": FreeDave, "adablock": AdaBlock, "ccd": CCD, "ete": ETE, "window": Window,
         "r2": R2, "dystruct": Dystruct, "eb": EntropyBounded, "infogain": InfoGain}


def make_rule(name: str, **kw) -> Rule:
    """The rule called `name` (RULES) with its parameters; unknown names / parameters are errors."""
    if isinstance(name, Rule):
        return name
    if name not in RULES:
        raise DiffusionError(f"unknown diffusion rule {name!r}; choose one of {', '.join(RULES)}")
    cls = RULES[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(kw) - fields)
    if bad:
        raise DiffusionError(f"rule {name!r} takes no parameter(s) {bad}; it takes {sorted(fields)}")
    return cls(**kw)


# ----------------------------------------------------------------------------- Learn2PD filter
FILTER_WINDOW = 2  # neighbours on each side the filter sees
FILTER_FEATURES = 2 * (2 * FILTER_WINDOW + 1) + 3


def filter_features(confidence, committed):
    """Per-slot features of the Learn2PD filter: float32[B, L, F], F = FILTER_FEATURES.

    confidence: f32[B, L], the model's max prob at every slot (committed slots included); committed:
    bool[B, L]. Per slot: the confidences and committed flags of the slots at offsets -2..+2 (0 past
    the ends), the mean confidence of the row's masked slots, the row's committed fraction, and the
    slot's relative position j / L."""
    c = confidence.astype(jnp.float32)
    m = committed.astype(jnp.float32)
    b, n = c.shape
    w = FILTER_WINDOW
    cp, mp = jnp.pad(c, ((0, 0), (w, w))), jnp.pad(m, ((0, 0), (w, w)))
    neigh_c = [cp[:, i:i + n] for i in range(2 * w + 1)]
    neigh_m = [mp[:, i:i + n] for i in range(2 * w + 1)]
    masked = 1.0 - m
    mean_c = jnp.sum(c * masked, axis=-1, keepdims=True) / jnp.maximum(jnp.sum(masked, axis=-1, keepdims=True), 1.0)
    frac = jnp.mean(m, axis=-1, keepdims=True)
    rel = jnp.broadcast_to(jnp.arange(n, dtype=jnp.float32)[None, :] / max(n, 1), (b, n))
    extra = [jnp.broadcast_to(mean_c, (b, n)), jnp.broadcast_to(frac, (b, n)), rel]
    return jnp.stack(neigh_c + neigh_m + extra, axis=-1)


def init_filter(key, hidden: int = 32, num_features: int = FILTER_FEATURES) -> dict:
    """Random filter parameters: {"w1": [F, H], "b1": [H], "w2": [H], "b2": []}."""
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (num_features, hidden), jnp.float32) / math.sqrt(num_features),
            "b1": jnp.zeros((hidden,), jnp.float32),
            "w2": jax.random.normal(k2, (hidden,), jnp.float32) / math.sqrt(hidden),
            "b2": jnp.zeros((), jnp.float32)}


def filter_apply(params: dict, features):
    """The filter's logits [B, L] (sigmoid = P(the slot's current argmax is its final token)): a 2-layer
    MLP, gelu(features @ w1 + b1) @ w2 + b2."""
    h = jax.nn.gelu(jnp.einsum("blf,fh->blh", features, params["w1"]) + params["b1"])  # [B, L, H]
    return jnp.einsum("blh,h->bl", h, params["w2"]) + params["b2"]


FILTER_KIND = "learn2pd_filter"


def save_filter(out_dir, params: dict, meta: dict | None = None) -> Path:
    """Write the filter to out_dir: config.json ({"kind", "num_features", "hidden", **meta}) and
    model.safetensors (one tensor per key)."""
    from safetensors.numpy import save_file
    missing = {"w1", "b1", "w2", "b2"} - set(params)
    if missing:
        raise DiffusionError(f"filter params lack {sorted(missing)}; expected keys w1, b1, w2, b2 "
                             "(init_filter's layout)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.asarray(v, np.float32) for k, v in params.items()}
    f, h = arrays["w1"].shape
    cfg = {**(meta or {}), "kind": FILTER_KIND, "num_features": int(f), "hidden": int(h)}
    save_file(arrays, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return out


def load_filter(path) -> tuple[dict, dict]:
    """(params, meta) of a filter written by save_filter; clear errors for anything else."""
    from safetensors.numpy import load_file
    path = Path(path)
    cfg_file, tensor_file = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file() or not tensor_file.is_file():
        raise DiffusionError(f"{path} is not a Learn2PD filter directory: it needs config.json and "
                             "model.safetensors (written by save_filter / `jaxdecode train filter`)")
    meta = json.loads(cfg_file.read_text())
    if meta.get("kind") != FILTER_KIND:
        raise DiffusionError(f"{cfg_file} has kind {meta.get('kind')!r}, not {FILTER_KIND!r}")
    arrays = load_file(str(tensor_file))
    params = {k: jnp.asarray(v) for k, v in arrays.items()}
    shapes = {"w1": (meta["num_features"], meta["hidden"]), "b1": (meta["hidden"],), "w2": (meta["hidden"],),
              "b2": ()}
    for k, s in shapes.items():
        if k not in params or tuple(params[k].shape) != s:
            raise DiffusionError(f"filter tensor {k!r} in {tensor_file} should have shape {s}, got "
                                 f"{None if k not in params else tuple(params[k].shape)}")
    if meta["num_features"] != FILTER_FEATURES:
        raise DiffusionError(f"the filter in {path} takes {meta['num_features']} features but "
                             f"filter_features makes {FILTER_FEATURES}; retrain it with this jaxdecode")
    return params, meta
