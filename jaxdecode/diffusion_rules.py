"""Commit rules of the diffusion decoders (jaxdecode.diffusion), one small frozen dataclass per paper
(ALGORITHMS.md §5), and the decode side of the Learn2PD filter.

A rule sees one forward's predictions for the answer slots (`StepContext`, all [B, A, ...]) and returns
`(commit bool[B, A], tokens int32[B, A], rule_state)`; the loop commits only eligible slots and adds
the most confident one when a rule chose none. Rules are static arguments of the decoder's jit, so
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


class DiffusionError(ValueError):
    """Inputs a diffusion decoder cannot decode as given (with what to fix)."""


# ----------------------------------------------------------------------------- shared math
def confidence(logits):
    """(probs [..., V] f32, confidence = max prob [...], argmax [...] int32)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    return probs, jnp.max(probs, axis=-1), jnp.argmax(logits, axis=-1).astype(jnp.int32)


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
    """CreditDecoding: per slot a credit over the vocabulary, C <- decay * C, C[i, x_i] += c_i ** power
    for every masked slot (x_i, c_i from the model's logits); decode from logits + alpha * log(1 + C)
    under the confidence threshold (at least one per forward)."""
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


@dataclasses.dataclass(frozen=True)
class EntropyBounded(Rule):
    """EB-sampler: sort eligible slots by confidence; commit the longest prefix whose summed entropy
    minus the largest entropy in it stays <= gamma (so the most confident slot is always committed)."""
    gamma: float = 0.1
    name = "eb"

    def check(self, config, eos_ids):
        if not isinstance(self.gamma, numbers.Real) or isinstance(self.gamma, bool) or self.gamma < 0:
            raise DiffusionError(f"gamma must be a number >= 0, got {self.gamma!r}")

    def select(self, ctx):
        probs, conf, x = confidence(ctx.logits)
        h = jnp.where(ctx.eligible, entropy(probs), 0.0)
        rank = rank_desc(conf, ctx.eligible)
        order = jnp.argsort(rank, axis=-1)  # slots by rank
        hs = jnp.take_along_axis(h, order, axis=-1)
        cum, run_max = jnp.cumsum(hs, axis=-1), jax.lax.cummax(hs, axis=hs.ndim - 1)
        ok_sorted = (cum - run_max) <= self.gamma
        n = jnp.sum(jnp.cumprod(ok_sorted.astype(jnp.int32), axis=-1), axis=-1)  # leading prefix
        return with_top1(rank < n[:, None], conf, ctx.eligible), x, ctx.state


@dataclasses.dataclass(frozen=True)
class InfoGain(Rule):
    """Information-gain selection: score each eligible slot by confidence minus `beta` times its entropy
    (the information it leaves unresolved); commit the slots scoring >= the threshold, at least the
    best one."""
    threshold: float = 0.7
    beta: float = 0.1
    name = "infogain"

    def check(self, config, eos_ids):
        check_unit("threshold", self.threshold)

    def select(self, ctx):
        probs, conf, x = confidence(ctx.logits)
        score = conf - self.beta * entropy(probs)
        return with_top1(score >= self.threshold, score, ctx.eligible), x, ctx.state


@dataclasses.dataclass(frozen=True)
class CCD(Rule):
    """CCD (history-averaged distributions): per slot an exponential average of the model's
    distributions over the forwards, pbar <- mix * pbar + (1 - mix) * p (pbar = p at the first
    forward); commit eligible slots whose averaged confidence is >= threshold (token: argmax of pbar),
    at least the most confident."""
    threshold: float = 0.9
    mix: float = 0.5
    name = "ccd"

    def check(self, config, eos_ids):
        check_unit("threshold", self.threshold)
        check_unit("mix", self.mix)

    def init(self, batch, answer_length, vocab):
        return jnp.zeros((batch, answer_length, vocab), jnp.float32)

    def select(self, ctx):
        probs, _, _ = confidence(ctx.logits)
        fresh = jnp.sum(ctx.state, axis=-1, keepdims=True) == 0
        pbar = jnp.where(fresh, probs, self.mix * ctx.state + (1 - self.mix) * probs)
        conf, x = jnp.max(pbar, axis=-1), jnp.argmax(pbar, axis=-1).astype(jnp.int32)
        return with_top1(conf >= self.threshold, conf, ctx.eligible), x, pbar


@dataclasses.dataclass(frozen=True)
class ETE(Rule):
    """ETE (explore then exploit): exploit — commit every eligible slot with confidence >= threshold;
    when none is that sure, explore — commit the `explore` most confident slots among those whose
    entropy is <= max_entropy (nats). At least one per forward."""
    threshold: float = 0.9
    explore: int = 2
    max_entropy: float = 1.0
    name = "ete"

    def check(self, config, eos_ids):
        check_unit("threshold", self.threshold)
        check_int("explore", self.explore)

    def select(self, ctx):
        probs, conf, x = confidence(ctx.logits)
        sure = ctx.eligible & (conf >= self.threshold)
        calm = top_n(conf, ctx.eligible & (entropy(probs) <= self.max_entropy), self.explore)
        pick = jnp.where(jnp.any(sure, axis=-1, keepdims=True), sure, calm)
        return with_top1(pick, conf, ctx.eligible), x, ctx.state


@dataclasses.dataclass(frozen=True)
class Window(Rule):
    """Window-Diffusion: only the `window` leftmost masked slots of the block are candidates (a sliding
    window over the masked frontier); inside it, the confidence threshold (at least one)."""
    window: int = 8
    threshold: float = 0.9
    name = "window"

    def check(self, config, eos_ids):
        check_int("window", self.window)
        check_unit("threshold", self.threshold)

    def select(self, ctx):
        _, conf, x = confidence(ctx.logits)
        left = jnp.cumsum(ctx.eligible.astype(jnp.int32), axis=-1) <= self.window
        cand = ctx.eligible & left
        return with_top1(conf >= self.threshold, conf, cand), x, ctx.state


@dataclasses.dataclass(frozen=True)
class R2(Rule):
    """R^2-dLLM (training-free rules): spatial — a slot also commits when the mean confidence of its
    +-1 neighbourhood (eligible or committed neighbours count as 1) is >= threshold; temporal — a slot
    whose argmax has been the same for `stable` consecutive forwards commits. Plus the threshold rule
    and at least one per forward."""
    threshold: float = 0.9
    stable: int = 3
    name = "r2"

    def check(self, config, eos_ids):
        check_unit("threshold", self.threshold)
        check_int("stable", self.stable)

    def init(self, batch, answer_length, vocab):
        return (jnp.full((batch, answer_length), -1, jnp.int32), jnp.zeros((batch, answer_length), jnp.int32))

    def select(self, ctx):
        _, conf, x = confidence(ctx.logits)
        last, run = ctx.state
        run = jnp.where(x == last, run + 1, 1)
        c = jnp.where(ctx.committed, 1.0, conf)
        padded = jnp.pad(c, ((0, 0), (1, 1)), constant_values=1.0)
        local = (padded[:, :-2] + padded[:, 1:-1] + padded[:, 2:]) / 3.0
        pick = (conf >= self.threshold) | (local >= self.threshold) | (run >= self.stable)
        return with_top1(pick, conf, ctx.eligible), x, (x, run)


@dataclasses.dataclass(frozen=True)
class Dystruct(Rule):
    """Dystruct (dynamic structure): commit the eligible slots whose confidence is >= threshold, and
    extend each committed run to its right neighbour while that neighbour's confidence is >= the
    relaxed `follow` threshold (structure grows from sure tokens). At least one per forward."""
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
    """AdaBlock: the block ends early at the first eligible slot predicting a delimiter (ids
    `delimiters`, default the EOS ids) with confidence >= delimiter_threshold; inside the shortened
    block, the confidence threshold (at least one)."""
    threshold: float = 0.9
    delimiter_threshold: float = 0.5
    delimiters: tuple = ()
    name = "adablock"

    def check(self, config, eos_ids):
        check_unit("threshold", self.threshold)
        check_unit("delimiter_threshold", self.delimiter_threshold)

    def select(self, ctx):
        _, conf, x = confidence(ctx.logits)
        delims = self.delimiters or ctx.eos_ids
        is_delim = is_eos(x, tuple(delims)) & ctx.eligible & (conf >= self.delimiter_threshold)
        a = x.shape[1]
        pos = jnp.arange(a)[None, :]
        end = jnp.min(jnp.where(is_delim, pos, a), axis=-1, keepdims=True)
        cand = ctx.eligible & (pos <= end)
        return with_top1(conf >= self.threshold, conf, cand), x, ctx.state


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
