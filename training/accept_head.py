"""Training the acceptance head (jaxdecode.drafters.accept_head) on labels from real verification runs.

    data = collect_labels(cfg, params, inner, prompts, sampler=..., verifier=..., max_new_tokens=64)
    params = train_head(data, head_cfg, target_config, TrainConfig(...), workdir).params
    ece(predict(params, head_cfg, held_out), held_out["label"], held_out["mask"])

Labels: the engine decodes the training prompts with the inner chain drafter (e.g. a draft LM, chain:K)
and a `LabelRecorder` wrapped around it hands every verification's per-position inputs to the host:
x f32[K, 3] (log q(token), log max q, entropy; for a drafter of point masses with confidence classes,
such as retrieval, x f32[K, C] the class one-hot), the target's bonus-slot state f32[D] of the previous
verification, and the verifier's verdict. Convention (SpecDec++): the head predicts
P(accept_i | tokens < i accepted), so position i carries label 1 if accepted, 0 at the first
rejection, and positions after the first rejection are masked out of the BCE (mask 0): their
verdict was never asked. One example = one active row-step.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdecode.drafters.builders import ChainBuilder
from jaxdecode.drafters.accept_head import (NUM_SCALARS, AcceptHeadConfig, bonus_slot_feature, drafter_classes,
                                            final_index, head_feature_layers, head_logits, init_inner,
                                            inner_observation, node_inputs, prefill_bonus_feature,
                                            without_own_cut)
from jaxdecode.speculative import speculative_decode

from .trainer import TrainConfig, train

KEYS = ("x", "tfeat", "label", "mask")  # a label set: numpy arrays with N examples each
DSTATE = "dstate"  # and, for a head with drafter_proj, the inner drafter's state per position [N, K, S]


def _keys(data: dict) -> tuple:
    return KEYS + ((DSTATE,) if DSTATE in data else ())


# ----------------------------------------------------------------------------- module and loss
class AcceptHeadModule(nnx.Module):
    """The head for training; its nnx.Param state as a pure dict is the decode params pytree."""

    def __init__(self, cfg: AcceptHeadConfig, target_config, rngs: nnx.Rngs):
        self.cfg = cfg
        self.inp = nnx.Linear(cfg.input_dim, cfg.hidden, rngs=rngs)
        self.out = nnx.Linear(cfg.hidden, 1, rngs=rngs)
        if cfg.target_proj:
            self.target = nnx.Linear(target_config.hidden_size, cfg.target_proj, rngs=rngs)
        if cfg.drafter_proj:
            self.drafter = nnx.Linear(cfg.drafter_state_dim, cfg.drafter_proj, rngs=rngs)

    def __call__(self, x, tfeat=None, dstate=None):
        """x f32[B, K, node_dim], tfeat f32[B, D], dstate f32[B, K, S] -> logits f32[B, K] (the decode
        function itself)."""
        params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        return head_logits(params, self.cfg, x, jnp.arange(x.shape[1]), tfeat, dstate)


def params_of(module) -> dict:
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def _bce(module, batch):
    if module.cfg.drafter_proj and DSTATE not in batch:
        raise ValueError("this head reads the inner drafter's states (drafter_proj): its labels need them too "
                         "(collect_labels(..., states=True))")
    logits = module(batch["x"], batch["tfeat"] if module.cfg.target_proj else None,
                    batch[DSTATE] if module.cfg.drafter_proj else None)
    mask = batch["mask"].astype(jnp.float32)
    per = optax.sigmoid_binary_cross_entropy(logits, batch["label"].astype(jnp.float32))
    return (per * mask).sum(), mask.sum()


def _check_batch(batch):
    missing = [k for k in KEYS if k not in batch]
    if missing:
        raise ValueError(f"the acceptance head trains on labels from verification runs (a batch with "
                         f"{', '.join(KEYS)}; missing {', '.join(missing)}), not on text windows: use "
                         f"jaxdecode.training.accept_head.train_accept_head (target, draft LM, corpus)")


def accept_loss(module, batch, constants=None):
    """Masked BCE of the head's acceptance logits (trainer form: (loss, aux))."""
    _check_batch(batch)
    total, weight = _bce(module, batch)
    loss = total / jnp.maximum(weight, 1.0)
    return loss, {"bce": loss, "positions": weight}


def accept_eval_step(module, batch, constants=None):
    _check_batch(batch)
    return _bce(module, batch)


def default_config(target_config=None, **overrides) -> AcceptHeadConfig:
    return AcceptHeadConfig(**overrides)


# ----------------------------------------------------------------------------- labels from the engine
_SINK: list = []  # host records of the running collect_labels


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LabelRecorder:
    """The inner chain drafter unchanged, plus a host record of each verification: the head's inputs
    at proposal time and the verifier's verdict (num_accepted). Features: the inner drafter's own, then
    the target's bonus-slot state (FINAL) for the head's optional projection. classes > 0: the inputs
    are the one-hot of the drafter's confidence classes (node_inputs). states: the inner drafter's state
    per position too (its recorded `sources`, float16 on the host: a head with drafter_proj reads them)."""
    inner: Any
    classes: int = dataclasses.field(default=0, metadata=dict(static=True))
    states: bool = dataclasses.field(default=False, metadata=dict(static=True))

    feature_layers = property(lambda self: head_feature_layers(self.inner, 1))
    num_nodes = property(lambda self: self.inner.num_nodes)
    max_depth = property(lambda self: self.inner.max_depth)
    child_rule = property(lambda self: self.inner.child_rule)
    is_chain = property(lambda self: self.inner.is_chain)
    builder = property(lambda self: getattr(self.inner, "builder", None))

    def init(self, prompt_tokens, prompt_lengths, cache_len, key, features=None):
        b, k = prompt_tokens.shape[0], self.num_nodes
        inner = init_inner(self.inner, prompt_tokens, prompt_lengths, cache_len, key, features)
        width = self.inner.source_state_dim if self.states else 0
        return (inner, prefill_bonus_feature(features, prompt_lengths, final_index(self.feature_layers)),
                jnp.zeros((b, k, self.classes or NUM_SCALARS), jnp.float32), jnp.zeros((b, k, width), jnp.float16))

    def propose(self, state, ctx, sampler):
        inner, tfeat, _, ds = state
        tree, slots, inner = self.inner.propose(inner, ctx, sampler)
        if self.states:
            ds = inner.sources.astype(jnp.float16)
        return tree, slots, (inner, tfeat, node_inputs(tree, slots, self.classes), ds)

    def observe(self, state, obs):
        inner, tfeat, x, ds = state
        jax.debug.callback(lambda *a: _SINK.append(tuple(np.asarray(v) for v in a)),
                           x, tfeat, ds, obs.num_accepted, obs.active)
        return (self.inner.observe(inner, inner_observation(obs, self.inner)),
                bonus_slot_feature(obs, tfeat, final_index(self.feature_layers)), x, ds)


def labels_from_records(records, k: int) -> dict:
    """Host records [(x [B,K,node_dim], tfeat [B,D], drafter states [B,K,S] (S may be 0), num_accepted [B],
    active [B])] -> a label set (with DSTATE, float16, when S > 0)."""
    xs, ts, ds, acc = [], [], [], []
    for x, t, d, n, active in records:
        xs.append(x[active])
        ts.append(t[active])
        ds.append(d[active])
        acc.append(n[active])
    acc = np.concatenate(acc)
    i = np.arange(k)[None, :]
    out = {"x": np.concatenate(xs).astype(np.float32), "tfeat": np.concatenate(ts).astype(np.float32),
           "label": (i < acc[:, None]).astype(np.float32),
           "mask": (i <= acc[:, None]).astype(np.float32)}
    if ds and ds[0].shape[-1]:
        out[DSTATE] = np.concatenate(ds).astype(np.float16)
    return out


def collect_labels(config, params, inner, prompts, *, verifier, sampler, max_new_tokens: int,
                   batch_size: int = 8, key=None, eos_ids: tuple = (), states: bool = False) -> dict:
    """Run the engine with `inner` (a chain drafter with draft probabilities, or of point masses with
    confidence classes) over `prompts` (lists of token ids) and return the label set of every active
    row-step; with `states`, the inner drafter's state per position too (DSTATE: a drafter that records
    its sources, e.g. eagle3)."""
    from jaxdecode.autoregressive import pad_prompts
    classes = drafter_classes(inner) if inner.child_rule == "point" else 0
    if not getattr(inner, "is_chain", False) or (inner.child_rule == "point" and not classes):
        raise ValueError("acceptance labels come from a chain drafter with draft probabilities (e.g. a "
                         "draft LM with tree='chain:K') or with confidence classes (retrieval)")
    inner = without_own_cut(inner)  # every position is labelled: the head learns where to cut
    if states:
        if not (hasattr(inner, "record_sources") and hasattr(inner, "source_state_dim")):
            raise ValueError(f"a head over the drafter's states (drafter_proj) needs a drafter that records the "
                             f"state each position was drafted from (eagle3), not {type(inner).__name__}")
        inner = dataclasses.replace(inner, record_sources=True)
    key = jax.random.PRNGKey(0) if key is None else key
    recorder = LabelRecorder(inner, classes, states)
    _SINK.clear()
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        chunk += [chunk[-1]] * (batch_size - len(chunk))  # one compiled shape; repeats are fine data
        toks, lens = pad_prompts(chunk)
        key, k = jax.random.split(key)
        out = speculative_decode(config, params, recorder, toks, lens, max_new_tokens=max_new_tokens,
                                 verifier=verifier, sampler=sampler, key=k, eos_ids=eos_ids)
        jax.block_until_ready(out.tokens)
    jax.effects_barrier()
    records, _SINK[:] = list(_SINK), []
    return labels_from_records(records, inner.num_nodes)


def concat_labels(*sets) -> dict:
    return {k: np.concatenate([s[k] for s in sets]) for k in _keys(sets[0])}


def split_labels(data: dict, held_out_fraction: float, seed: int = 0) -> tuple[dict, dict]:
    n = len(data["x"])
    perm = np.random.default_rng(seed).permutation(n)
    cut = int(round(n * (1 - held_out_fraction)))
    return ({k: v[perm[:cut]] for k, v in data.items()}, {k: v[perm[cut:]] for k, v in data.items()})


# ----------------------------------------------------------------------------- training and calibration
def label_batches(data: dict, batch_size: int, seed: int = 0):
    """batches(step) -> a random batch of examples: a pure function of the step (exact resume)."""
    n = len(data["x"])
    if n == 0:
        raise ValueError("no acceptance labels: the label runs produced no verification steps")

    def batches(step):
        idx = np.random.default_rng((seed, step)).integers(0, n, batch_size)
        return {k: data[k][idx].astype(np.float32) if k == DSTATE else data[k][idx] for k in _keys(data)}
    return batches


def eval_chunks(data: dict, batch_size: int = 1024):
    def chunks():
        for s in range(0, len(data["x"]), batch_size):
            yield {k: data[k][s:s + batch_size].astype(np.float32) if k == DSTATE else data[k][s:s + batch_size]
                   for k in _keys(data)}
    return chunks


@dataclasses.dataclass(frozen=True)
class HeadResult:
    params: dict
    module: Any
    result: Any  # the trainer's TrainResult


def train_head(data: dict, cfg: AcceptHeadConfig, target_config, train_config: TrainConfig, workdir, *,
               eval_data: dict | None = None, batch_size: int = 256, seed: int = 0) -> HeadResult:
    if data["x"].shape[1] > cfg.max_depth:
        raise ValueError(f"the labels have {data['x'].shape[1]} draft positions but the head knows "
                         f"{cfg.max_depth} (AcceptHeadConfig.max_depth)")
    module = AcceptHeadModule(cfg, target_config, nnx.Rngs(seed))
    res = train(module, accept_loss, label_batches(data, batch_size, seed), train_config, workdir,
                eval_step=accept_eval_step if eval_data is not None else None,
                eval_batches=eval_chunks(eval_data) if eval_data is not None else None,
                run_info={"kind": "accept_head", "config": dataclasses.asdict(cfg)})
    return HeadResult(params=params_of(res.module), module=res.module, result=res)


def label_logits(params, cfg: AcceptHeadConfig, data: dict, chunk: int = 4096) -> np.ndarray:
    """The head's logits over a label set, f32[N, K] (in chunks: the drafter states are large)."""
    out = []
    for s in range(0, len(data["x"]), chunk):
        part = {k: v[s:s + chunk] for k, v in data.items()}
        x = jnp.asarray(part["x"])
        tf = jnp.asarray(part["tfeat"]) if cfg.target_proj else None
        ds = jnp.asarray(part[DSTATE], jnp.float32) if cfg.drafter_proj else None
        out.append(np.asarray(head_logits(params, cfg, x, jnp.arange(x.shape[1]), tf, ds)))
    return np.concatenate(out) if out else np.zeros((0, data["x"].shape[1]), np.float32)


def predict(params, cfg: AcceptHeadConfig, data: dict) -> np.ndarray:
    """P(accept) per example and position: f32[N, K]."""
    return np.asarray(jax.nn.sigmoid(label_logits(params, cfg, data)))


def bce(p, label, mask) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    w = mask > 0
    return float(-(label * np.log(p) + (1 - label) * np.log(1 - p))[w].mean())


def ece(p, label, mask, bins: int = 10) -> float:
    """Expected calibration error over the masked positions, `bins` equal-width bins of p."""
    w = mask > 0
    p, y = np.asarray(p)[w], np.asarray(label)[w]
    if p.size == 0:
        raise ValueError("no labelled positions to measure calibration on")
    which = np.minimum((p * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            total += sel.sum() * abs(p[sel].mean() - y[sel].mean())
    return float(total / p.size)


# The unit costs the saved threshold is priced with, in target steps (speed_estimate): one draft level,
# one verified node. `jaxdecode train accept-head --draft-cost / --node-cost` sets them per run.
DRAFT_COST = 0.2
NODE_COST = 0.05


def speed_estimate(params, cfg: AcceptHeadConfig, data: dict, thresholds, *, draft_cost: float = DRAFT_COST,
                   node_cost: float = NODE_COST) -> dict:
    """Offline tokens per unit of cost, from label runs of chain:K: for each threshold h, the head's cut
    length L per recorded step, and for each fixed length K' <= K, L = K'. A step commits
    min(accepted, L) + 1 tokens and costs 1 + (draft_cost + node_cost) * L target-step units (L draft
    forwards, including the catch-up that yields the root distribution; node_cost per verified node).
    The trajectory is the one chain:K decoded, so this ranks settings; it does not replace timing them.
    Returns {"head": {h: tokens/cost}, "fixed": {K': tokens/cost}}."""
    accepted = (data["label"] * data["mask"]).sum(1)  # [N]: the verifier's accepted length
    k = data["x"].shape[1]
    logits = jnp.asarray(label_logits(params, cfg, data))

    def rate(length):
        tokens = np.minimum(accepted, length) + 1
        return float(tokens.sum() / (1.0 + (draft_cost + node_cost) * length).sum())

    from jaxdecode.drafters.accept_head import keep_mask
    head = {float(h): rate(np.asarray(keep_mask(logits, h)).sum(1)) for h in thresholds}
    fixed = {kk: rate(np.full(accepted.shape, kk)) for kk in range(1, k + 1)}
    return {"head": head, "fixed": fixed}


def choose_threshold(estimate: dict) -> float:
    """The threshold of the highest estimated tokens per cost."""
    return max(estimate["head"], key=estimate["head"].get)


def stopping_ceilings(accepted, step_seconds: dict, plain_seconds: float, k: int, rules: dict | None = None) -> dict:
    """What ideal draft-length rules could reach, priced with measured step times (tokens per second).

    accepted int[N]: the drafts the verifier accepted in each step of a chain:k label run. step_seconds
    {K: seconds of one speculative step verifying a chain of K} (measured, K = 1 and k among them; other
    lengths interpolated), plain_seconds: one plain decoding step. Each rule drafts L tokens, commits
    min(accepted, L) + 1 and pays step(L) (step(0) = a plain step):
    - "fixed" {K: tokens/s}: L = K every step (the same pricing, so the ratios below compare like with
      like).
    - "head_rule": the acceptance head's own rule with a perfect head. It judges token i only after
      drafting it, so it drafts the first rejected token too: L = min(accepted + 1, k).
    - "foresight": a rule that knows before drafting whether the next token will be accepted, but
      always drafts one: L = max(min(accepted, k), 1).
    - "foresight_and_skip": as foresight, and a plain step where nothing would be accepted (L = 0).
    Ratios of these to max(fixed) bound what any head of that kind can gain over the best fixed length on
    this hardware, optimistically: a fixed chain shorter than k commits more tokens per step when it runs
    than the chain:k run's steps credit it with (4-5% for chains of 1-3 of the embedded EAGLE-3), so divide
    by the best fixed length as timed where there is one (bench_accept_head.py's `over_timed_fixed`).
    `rules` {name: int[N] lengths} prices other rules the same way (e.g. a trained head's cut per step:
    timed rows below its price are overhead, not prediction), returned under "rules"."""
    accepted = np.asarray(accepted)
    if accepted.size == 0:
        raise ValueError("no verification steps to price: the label run recorded none")
    lengths = sorted(int(x) for x in step_seconds)
    if 1 not in lengths or k not in lengths:
        raise ValueError(f"stopping_ceilings needs the step time of chain:1 and chain:{k} (interpolated between "
                         f"measured lengths), got lengths {lengths}")
    times = [float(step_seconds[x]) for x in lengths]

    def step(length):
        length = np.asarray(length)
        return np.where(length == 0, plain_seconds, np.interp(length, lengths, times))

    a = np.minimum(accepted, k)

    def rate(length):  # tokens/s of drafting length[i] at step i: commits min(a, L) + 1, pays step(L)
        length = np.broadcast_to(np.asarray(length), a.shape)
        if (length < 0).any() or (length > k).any():
            raise ValueError(f"a rule's lengths are one per step in 0..{k}, got {length.min()}..{length.max()}")
        return float((np.minimum(a, length) + 1).sum()) / float(step(length).sum())

    for name, length in (rules or {}).items():
        if np.shape(length) != a.shape:
            raise ValueError(f"rule {name!r} needs one length per step ({a.size}), got shape {np.shape(length)}")
    return {"fixed": {kk: rate(kk) for kk in lengths if kk <= k}, "plain": 1.0 / plain_seconds,
            "rules": {name: rate(length) for name, length in (rules or {}).items()},
            "head_rule": rate(np.minimum(a + 1, k)),
            "foresight": rate(np.maximum(a, 1)),
            "foresight_and_skip": rate(a)}


def heldout_report(params, cfg: AcceptHeadConfig, sets: dict, train_data: dict) -> dict:
    """Per label set (e.g. {"T=0": ..., "T=0.7": ...}): examples, acceptance rate, BCE of the head and of
    the constant training rate, ECE (10 bins)."""
    rate = float(train_data["label"][train_data["mask"] > 0].mean())
    out = {}
    for name, d in sets.items():
        p = predict(params, cfg, d)
        out[name] = {"examples": int(len(d["x"])), "accept_rate": float(d["label"][d["mask"] > 0].mean()),
                     "bce": bce(p, d["label"], d["mask"]),
                     "bce_constant": bce(np.full(p.shape, rate), d["label"], d["mask"]),
                     "ece": ece(p, d["label"], d["mask"])}
    return out


def train_accept_head(target, draft=None, corpus_dir=None, out_dir=None, *, train_config: TrainConfig, k: int = 8,
                      temperatures=(0.0, 0.7), train_prompts=None, heldout_prompts=None, prompts: int = 64,
                      heldout: int = 16, prompt_len: int = 32, new_tokens: int = 64, batch_rows: int = 8,
                      batch_size: int = 256, workdir=None, config_overrides: dict | None = None, seed: int = 0,
                      draft_cost: float | None = None, node_cost: float | None = None, inner: str = "draft_lm",
                      inner_dir=None):
    """The whole recipe: label runs of the inner drafter's chain:k on the target (one per temperature:
    greedy verification at 0, the chain verifier on sampled chains above) over training prompts, the
    head trained on them, BCE / ECE on label runs over held-out prompts, and the drafter directory
    written to out_dir (extra: the held-out report). The inner drafter: the draft LM `draft` (inner
    "draft_lm"), or a trained kind (inner="eagle3", "hydra", ...: from inner_dir, default the target's
    shipped one). target / draft: Models or directories. Prompts: lists of token ids, or (when None)
    `prompts` / `heldout` windows of corpus_dir's train / held-out splits.
    The saved config's threshold maximises `speed_estimate` (draft_cost: one draft forward / one target
    step, default DRAFT_COST, 0 for a drafter of point masses; node_cost: per verified node, default
    NODE_COST) on the training runs; the report adds that estimate against the best fixed length on the
    held-out runs.
    Returns an AcceptHeadRun (head, held-out report, the label sets, the config saved)."""
    from jaxdecode.drafters import DraftLM, make_drafter
    from jaxdecode.drafters.trained import save_drafter
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.verifiers import get_verifier

    from .drafters import _load_target

    target = _load_target(target)
    if inner == "draft_lm":
        if draft is None:
            raise ValueError("an acceptance head over a draft LM needs the draft model (draft=, CLI --draft DIR); "
                             "or train it over a trained drafter (inner='eagle3', CLI --set inner=eagle3)")
        draft = _load_target(draft)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft LM's vocabulary ({draft.config.vocab_size}) differs from the target's "
                             f"({target.config.vocab_size})")
    elif draft is not None:
        raise ValueError(f"the acceptance head is trained over the {inner!r} drafter, which drafts without a "
                         f"draft LM: drop draft (CLI --draft)")

    def inner_drafter(rule):
        if inner == "draft_lm":
            return DraftLM(params=draft.params, config=draft.config, builder=ChainBuilder(k, rule))
        return make_drafter(inner, target, tree=ChainBuilder(k, rule), drafter_dir=inner_dir)

    probe = inner_drafter("argmax")
    point = probe.child_rule == "point"  # retrieval: point masses with confidence classes
    classes = drafter_classes(probe) if point else 0
    if draft_cost is None:  # a drafter of point masses looks its drafts up: no forward to pay for
        draft_cost = 0.0 if point else DRAFT_COST
    node_cost = NODE_COST if node_cost is None else node_cost
    overrides = dict(config_overrides or {})
    if overrides.get("drafter_proj"):  # the width of the states the head reads is the inner drafter's
        if not hasattr(probe, "source_state_dim"):
            raise ValueError(f"drafter_proj: the head reads the states the inner drafter drafts from, which the "
                             f"{inner!r} drafter does not give (eagle3 does)")
        overrides["drafter_state_dim"] = int(probe.source_state_dim)
    cfg = AcceptHeadConfig(**{"max_depth": max(k, AcceptHeadConfig.max_depth), **overrides,
                              "draft_len": k, "inner": inner, "classes": classes})
    if train_prompts is None or heldout_prompts is None:
        if corpus_dir is None:
            raise ValueError("train_accept_head needs a corpus_dir or both train_prompts and heldout_prompts")
        from .corpus import Corpus
        from .distill_data import prompt_windows
        from .drafters import heldout_prompts as corpus_heldout
        if train_prompts is None:
            train_prompts = prompt_windows(Corpus.open(corpus_dir).tokens("train"), prompts, prompt_len, seed)
        if heldout_prompts is None:
            heldout_prompts = corpus_heldout(corpus_dir, heldout, prompt_len, seed + 1)
    eos = tuple(getattr(target.config, "eos_token_ids", ()) or ())
    train_sets, held_sets = [], {}
    for i, t in enumerate(temperatures):
        rule, verifier = ("argmax", "greedy") if t == 0 else ("sample", "point_mass" if point else "chain")
        chain = inner_drafter(rule)
        run = dict(verifier=get_verifier(verifier), sampler=SamplerConfig(temperature=float(t)),
                   max_new_tokens=new_tokens, batch_size=batch_rows, eos_ids=eos, states=cfg.drafter_proj > 0)
        train_sets.append(collect_labels(target.config, target.params, chain, list(train_prompts),
                                         key=jax.random.PRNGKey(seed * 100 + 2 * i), **run))
        held_sets[f"T={t:g}"] = collect_labels(target.config, target.params, chain, list(heldout_prompts),
                                               key=jax.random.PRNGKey(seed * 100 + 2 * i + 1), **run)
    data = concat_labels(*train_sets)
    workdir = workdir or (Path(out_dir).with_name(Path(out_dir).name + ".train") if out_dir else None)
    if workdir is None:
        raise ValueError("train_accept_head needs out_dir or workdir (checkpoints and logs)")
    res = train_head(data, cfg, target.config, train_config, workdir, batch_size=batch_size, seed=seed,
                     eval_data=concat_labels(*held_sets.values()))
    report = heldout_report(res.params, cfg, held_sets, data)
    # The saved default threshold: the best estimated tokens per cost on the training label runs.
    grid = [round(x, 2) for x in np.linspace(0.05, 0.95, 19)]
    cost = dict(draft_cost=draft_cost, node_cost=node_cost)
    cfg = dataclasses.replace(cfg, threshold=choose_threshold(speed_estimate(res.params, cfg, data, grid, **cost)))
    for name, d in held_sets.items():
        est = speed_estimate(res.params, cfg, d, grid, **cost)
        best_k = max(est["fixed"], key=est["fixed"].get)
        report[name]["estimate"] = {"threshold": cfg.threshold, "head": est["head"][cfg.threshold],
                                    "best_fixed_k": best_k, "best_fixed": est["fixed"][best_k], **cost}
    if out_dir is not None:
        save_drafter(out_dir, "accept_head", cfg, res.params, target.config,
                     extra={"k": k, "temperatures": list(temperatures), "train_examples": int(len(data["x"])),
                            "steps": int(res.result.step), "heldout": report,
                            **({"draft": str(draft.path)} if inner == "draft_lm" else
                               {"inner": inner, "inner_dir": str(inner_dir) if inner_dir else "shipped",
                                **({"inner_dir_relative": os.path.relpath(Path(inner_dir).resolve(),
                                                                          Path(out_dir).resolve())}
                                   if inner_dir else {})})})
    return AcceptHeadRun(head=res, report=report, train_data=data, heldout_data=held_sets,
                         out_dir=Path(out_dir) if out_dir is not None else None, cfg=cfg)


@dataclasses.dataclass(frozen=True)
class AcceptHeadRun:
    head: HeadResult
    report: dict  # per temperature: examples, accept_rate, bce, bce_constant, ece (held-out label runs)
    train_data: dict  # the training label set
    heldout_data: dict  # {"T=..": held-out label set}
    out_dir: Path | None
    cfg: AcceptHeadConfig  # as saved (threshold chosen by speed_estimate)


def _register():
    try:
        from .drafters import TrainKind, register_train_kind
    except ImportError:  # the shared training registry is not there (older checkout): nothing to register
        return None
    return register_train_kind(TrainKind(name="accept_head", module=AcceptHeadModule, loss_fn=accept_loss,
                                         default_config=default_config, eval_step=accept_eval_step))


TRAIN_KIND = _register()
