"""Learn2PD: training the unmasking filter of a diffusion LM (decode side: jaxdecode.diffusion).

    data = filter_data(config, params, prompts, prompt_lengths, answer_length=A)   # greedy1 trajectories
    result = train_filter(data, train_config, workdir)                            # the shared trainer
    save_filter(out_dir, result.params, meta)                                     # what Learn2PD loads

Labels come from the model's own one-token-per-step decoding (Greedy1): at every step of it, every
still-masked slot of the current block is labelled 1 when its current argmax already equals the token
Greedy1 finally commits there ("final"), else 0. The features are exactly what the Learn2PD rule
computes at decode time (`filter_features(confidence, committed)` from that step's logits), so the
filter learns P(final | features) under the decoder's own state distribution.

The trajectories are recorded by running the real decoder (`diffusion_decode` with `TracingGreedy1`, a
Greedy1 that also hands each step's confidence, committed/eligible flags and argmax to the host through
`jax.debug.callback`): no second decoding loop.

The network is the decode-side 2-layer MLP (`filter_apply`): `FilterModule` holds the same dict pytree
as `nnx.Param`s, so `module.params()` is what `save_filter` writes and `Learn2PD(params=...)` runs.
Loss: binary cross-entropy over the labelled slots, the positives weighted `pos_weight`.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdecode.diffusion import (FILTER_FEATURES, Greedy1, Learn2PD, confidence, diffusion_decode, filter_apply,
                                 filter_features, init_filter, save_filter)

from .trainer import TrainConfig, TrainConfigError, train


# ----------------------------------------------------------------------------- trajectories
@dataclasses.dataclass(frozen=True)
class TracingGreedy1(Greedy1):
    """Greedy1 that records, per forward, (step, confidence, committed, eligible, argmax) [B, A] each
    into `sink` (a list, on the host). Its rule state counts the forwards. Hashed by the sink's identity
    (a static argument of the decoder's jit): one rule per recording."""
    sink: list = dataclasses.field(default=None, hash=False, compare=False)

    def __hash__(self):
        return hash(("tracing_greedy1", id(self.sink)))

    def __eq__(self, other):
        return type(other) is type(self) and other.sink is self.sink

    def init(self, batch, answer_length, vocab):
        return jnp.int32(0)

    def _record(self, step, conf, committed, eligible, argmax):
        self.sink.append(tuple(np.asarray(a) for a in (step, conf, committed, eligible, argmax)))

    def select(self, ctx):
        commit, tokens, _ = super().select(ctx)
        _, conf, x = confidence(ctx.logits)
        jax.debug.callback(self._record, ctx.state, conf, ctx.committed, ctx.eligible, x)
        return commit, tokens, ctx.state + 1


@dataclasses.dataclass
class FilterData:
    """Labelled slots of greedy1 trajectories, one row per (prompt, step): features f32[N, A, F],
    labels f32[N, A] (1: the slot's current argmax is final), weight f32[N, A] (1: a labelled slot,
    i.e. eligible at that step)."""
    features: np.ndarray
    labels: np.ndarray
    weight: np.ndarray

    def __len__(self):
        return self.features.shape[0]

    @property
    def positive_fraction(self) -> float:
        return float((self.labels * self.weight).sum() / max(self.weight.sum(), 1.0))


def greedy1_trajectories(config, params, prompt_tokens, prompt_lengths, *, answer_length: int, **decode_kw):
    """(final DiffusionOutput, [(step, confidence, committed, eligible, argmax)] per forward) of
    Greedy1 decoding; decode_kw go to diffusion_decode (block_length, eos_ids, mask_id, logits_shift)."""
    sink: list = []
    out = diffusion_decode(config, params, prompt_tokens, prompt_lengths, answer_length=answer_length,
                           rule=TracingGreedy1(sink=sink), **decode_kw)
    jax.block_until_ready(out.tokens)
    jax.effects_barrier()
    return out, sorted(sink, key=lambda r: int(r[0]))


def filter_data(config, params, prompt_tokens, prompt_lengths, *, answer_length: int, batch_size: int = 64,
                **decode_kw) -> FilterData:
    """Features and labels from Greedy1 trajectories of every prompt (decoded `batch_size` at a time)."""
    prompt_tokens = np.asarray(prompt_tokens)
    prompt_lengths = np.asarray(prompt_lengths)
    feats, labels, weights = [], [], []
    featurize = jax.jit(filter_features)
    for lo in range(0, len(prompt_tokens), batch_size):
        toks, lens = prompt_tokens[lo:lo + batch_size], prompt_lengths[lo:lo + batch_size]
        if len(toks) < batch_size and lo > 0:  # keep one shape (one compile): pad with the first rows
            pad = batch_size - len(toks)
            toks = np.concatenate([toks, prompt_tokens[:pad]])
            lens = np.concatenate([lens, prompt_lengths[:pad]])
            keep = batch_size - pad
        else:
            keep = len(toks)
        out, steps = greedy1_trajectories(config, params, toks, lens, answer_length=answer_length, **decode_kw)
        final = np.asarray(out.tokens)
        for _, conf, committed, eligible, argmax in steps:
            feats.append(np.asarray(featurize(conf, committed))[:keep])
            labels.append((argmax == final).astype(np.float32)[:keep])
            weights.append(eligible.astype(np.float32)[:keep])
    if not feats:
        raise TrainConfigError("no greedy1 steps were recorded: give at least one prompt")
    data = FilterData(np.concatenate(feats), np.concatenate(labels), np.concatenate(weights))
    live = data.weight.sum(axis=1) > 0  # rows of finished prompts carry no labels
    return FilterData(data.features[live], data.labels[live], data.weight[live])


# ----------------------------------------------------------------------------- the module + loss
class FilterModule(nnx.Module):
    """The decode-side filter MLP's dict pytree {w1, b1, w2, b2} as nnx.Params."""

    def __init__(self, params: dict):
        self.w1, self.b1 = nnx.Param(jnp.asarray(params["w1"])), nnx.Param(jnp.asarray(params["b1"]))
        self.w2, self.b2 = nnx.Param(jnp.asarray(params["w2"])), nnx.Param(jnp.asarray(params["b2"]))

    def params(self) -> dict:
        return {k: getattr(self, k)[...] for k in ("w1", "b1", "w2", "b2")}

    def __call__(self, features):
        return filter_apply(self.params(), features)


@dataclasses.dataclass(frozen=True)
class FilterLoss:
    """Weighted BCE over labelled slots; positives weighted pos_weight. batch: features, labels, weight."""
    pos_weight: float = 1.0

    def __call__(self, module, batch, constants=None):
        logits = module(batch["features"])
        y, w = batch["labels"], batch["weight"]
        bce = optax.sigmoid_binary_cross_entropy(logits, y) * jnp.where(y > 0, self.pos_weight, 1.0)
        n = jnp.maximum(jnp.sum(w), 1.0)
        pred = logits > 0
        tp = jnp.sum(w * pred * y)
        return jnp.sum(bce * w) / n, {"tokens": jnp.sum(w), "accuracy": jnp.sum(w * (pred == (y > 0))) / n,
                                      "precision": tp / jnp.maximum(jnp.sum(w * pred), 1.0),
                                      "recall": tp / jnp.maximum(jnp.sum(w * y), 1.0)}


@dataclasses.dataclass(frozen=True)
class FilterBatches:
    """Random minibatches of FilterData rows; batch `step` depends only on (seed, step)."""
    data: FilterData = dataclasses.field(hash=False, compare=False)
    batch_size: int = 256
    seed: int = 0

    def __call__(self, step: int) -> dict:
        idx = np.random.default_rng([self.seed, step]).integers(0, len(self.data), self.batch_size)
        return {"features": self.data.features[idx], "labels": self.data.labels[idx],
                "weight": self.data.weight[idx]}


@dataclasses.dataclass
class FilterResult:
    params: dict
    train: object  # the trainer's TrainResult
    data: FilterData


def train_filter(data: FilterData, train_config: TrainConfig, workdir, *, hidden: int = 32,
                 batch_size: int = 256, pos_weight: float = 1.0, run_info: dict | None = None) -> FilterResult:
    """Train the filter MLP on `data` with the shared trainer; result.params is save_filter's pytree."""
    if data.features.shape[-1] != FILTER_FEATURES:
        raise TrainConfigError(f"filter data has {data.features.shape[-1]} features, filter_features makes "
                               f"{FILTER_FEATURES}: rebuild the data with this jaxdecode")
    module = FilterModule(init_filter(jax.random.PRNGKey(train_config.seed), hidden))
    info = {"hidden": hidden, "batch_size": batch_size, "pos_weight": pos_weight, "rows": len(data),
            **(run_info or {})}
    result = train(module, FilterLoss(pos_weight), FilterBatches(data, batch_size, train_config.seed),
                   train_config, workdir, run_info=json.loads(json.dumps(info)))
    params = jax.tree.map(np.asarray, result.module.params())
    return FilterResult(params=params, train=result, data=data)


# ----------------------------------------------------------------------------- evaluation + export
def compare_nfe(config, params, filter_params, prompt_tokens, prompt_lengths, *, answer_length: int,
                threshold: float = 0.9, validate=None, **decode_kw) -> dict:
    """Greedy1 vs Learn2PD(filter) on the same prompts: mean NFE of each, their ratio, the fraction of
    Learn2PD outputs equal to Greedy1's, and (with `validate(prompt, answer) -> bool`) each one's
    validity."""
    runs = {}
    for name, rule in (("greedy1", Greedy1()), ("learn2pd", Learn2PD(params=filter_params, threshold=threshold))):
        out = diffusion_decode(config, params, prompt_tokens, prompt_lengths, answer_length=answer_length,
                               rule=rule, **decode_kw)
        runs[name] = (np.asarray(out.tokens), np.asarray(out.lengths), np.asarray(out.stats["nfe"]))
    report = {f"nfe_{k}": float(v[2].mean()) for k, v in runs.items()}
    report["nfe_ratio"] = report["nfe_greedy1"] / max(report["nfe_learn2pd"], 1e-9)
    report["match_greedy1"] = float(np.mean(np.all(runs["greedy1"][0] == runs["learn2pd"][0], axis=1)))
    if validate is not None:
        prompts = np.asarray(prompt_tokens)
        for k, (toks, lens, _) in runs.items():
            report[f"valid_{k}"] = float(np.mean([validate(prompts[i], toks[i, : lens[i]])
                                                  for i in range(len(toks))]))
    return report


def export_filter(out_dir, result: FilterResult, meta: dict | None = None) -> Path:
    """save_filter with what it was trained on (meta) and the label statistics."""
    info = {**(meta or {}), "rows": len(result.data), "positive_fraction": result.data.positive_fraction,
            "steps": result.train.step}
    return save_filter(out_dir, result.params, json.loads(json.dumps(info)))
