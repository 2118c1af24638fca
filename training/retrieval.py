"""`jaxdecode train retrieval`: a datastore of the target's own continuations for the retrieval drafter.

Nothing is optimised: the target continues corpus prompts (training.distill_data, the same cached,
resumable self-distillation data the trained drafters use; greedy by default, since a point-mass draft
is accepted most often when it is the target's most likely token), the rows are kept from
`max_order` tokens before each continuation (its context) to its EOS, and the drafter's table is built
from them when it is loaded (jaxdecode.drafters.retrieval). On held-out prompts the target's greedy
continuations then measure how often a drafted token is accepted by its match length (with `by_source`
datastore and own-text matches apart; the drafter's confidence cut, `RetrievalConfig.confidence`),
their continuations sampled at each of `confidence_temperatures` the same rates when sampling there
(`RetrievalConfig.sampled_confidence`, the adaptive policy's start at that temperature), and a real
greedy speculative run on other held-out prompts measures tau and the acceptance by depth (which the
adaptive policy starts from). The export holds the rows (uint16), the config with the confidence, and
those figures.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from .drafters import EvalOptions, heldout_prompts, measure_acceptance


@dataclasses.dataclass
class RetrievalBuildResult:
    out_dir: Path | None
    cfg: object
    params: dict
    stats: dict  # the table build's statistics
    heldout: dict  # tau, accept_by_depth of the held-out run


def datastore_rows(tokens, mask, prompt_len: int, context: int):
    """(rows, lengths, starts) of a self-distillation shard: each row from `context` tokens before its
    continuation (the prompt's tail) to its EOS; predicted positions start at the continuation."""
    keep_from = max(prompt_len - context, 0)
    rows = np.asarray(tokens)[:, keep_from:]
    lengths = np.asarray(mask).sum(axis=1).astype(np.int32) - keep_from
    starts = np.full((rows.shape[0],), prompt_len - keep_from, np.int32)
    return rows, lengths, starts


def confidence_at(target, drafter, prompts, new_tokens: int, temperature: float, seed: int = 0):
    """(rates, [tried, accepted] counts) by match length (match_acceptance) over the target's
    continuations of `prompts` int[R, P]: greedy at temperature 0, else sampled at `temperature` (the walk
    over sampled text measures the acceptance when sampling there)."""
    import jax

    from jaxdecode.autoregressive import decode
    from jaxdecode.drafters.retrieval import match_acceptance
    from jaxdecode.sampling import SamplerConfig

    greedy = temperature == 0.0
    cont = decode(target.config, target.params, prompts, np.full(len(prompts), prompts.shape[1], np.int32),
                  max_new_tokens=new_tokens, sampler=SamplerConfig(temperature=float(temperature)),
                  method="greedy" if greedy else "sample", key=None if greedy else jax.random.key(seed))
    return match_acceptance(drafter, prompts, np.asarray(cont.tokens))


# What a build stores unless `config_overrides` (`--set`) says otherwise: rates by (source, match length),
# and chains of up to 16 tokens cut at reach 0.15, which the adaptive policy then sizes per step. On the
# shipped datastore this decoded 2.01x plain greedy at batch 1 where rates by length with chains of 8 cut
# at 0.25 decoded 1.84x, and no slower at batch 4 or 16 or when sampling (BENCHMARKS.md, "Rates by
# source, chains of 16"). RetrievalConfig's own defaults differ: they read a datastore saved without
# these fields as it was built (rates by length).
BUILD_DEFAULTS = dict(by_source=True, num_nodes=16, min_reach=0.15)


def build_retrieval(target, corpus_dir, out_dir=None, *, distill, workdir, config_overrides: dict | None = None,
                    eval_options: EvalOptions = EvalOptions(), calibration_prompts: int = 64,
                    confidence_temperatures: tuple = (0.7, 1.0), progress: bool = True) -> RetrievalBuildResult:
    """Generate (or reuse) the target's continuations of corpus prompts, build the datastore, measure the
    acceptance by match length on `calibration_prompts` held-out prompts (the drafter's confidence cut;
    and at each of `confidence_temperatures` over sampled continuations) and its held-out acceptance on
    the evaluation's prompts, and export it with save_drafter to out_dir (kind "retrieval")."""
    from jaxdecode.drafters.retrieval import (RetrievalConfig, datastore_params, make_retrieval_drafter,
                                              table_for)
    from jaxdecode.drafters.trained import save_drafter

    from .corpus import Corpus
    from .distill_data import self_distill_data
    from .drafters import _load_target, _target_id

    target = _load_target(target)
    if target.tokenizer is not None:
        Corpus.open(corpus_dir).check_tokenizer(target.tokenizer)
    cfg = RetrievalConfig(**(BUILD_DEFAULTS | (config_overrides or {})))
    shard = self_distill_data(target, corpus_dir, Path(workdir) / "data", distill, progress=progress)
    data = np.load(shard)
    rows, lengths, starts = datastore_rows(data["tokens"], data["mask"], distill.prompt_len, cfg.max_order)
    params = datastore_params(rows, lengths, starts)
    _, stats = table_for(params, cfg, target.config.vocab_size)
    # The confidence by match length, on held-out prompts other than the evaluation's
    uncut = make_retrieval_drafter(params, dataclasses.replace(cfg, confidence=(), sampled_confidence=()), target,
                                   eval_options.tree)
    cal = heldout_prompts(corpus_dir, calibration_prompts, eval_options.prompt_len, eval_options.seed + 1)
    confidence, counts = confidence_at(target, uncut, cal, eval_options.new_tokens, 0.0)
    sampled = {t: confidence_at(target, uncut, cal, eval_options.new_tokens, t, seed=eval_options.seed)
               for t in confidence_temperatures}
    cfg = dataclasses.replace(cfg, confidence=confidence,
                              sampled_confidence=tuple((t, rates) for t, (rates, _) in sampled.items()))
    drafter = make_retrieval_drafter(params, cfg, target, eval_options.tree)
    prompts = heldout_prompts(corpus_dir, eval_options.prompts, eval_options.prompt_len, eval_options.seed)
    heldout = measure_acceptance(target, drafter, prompts, new_tokens=eval_options.new_tokens)
    manifest = json.loads((shard.parent / "manifest.json").read_text())
    if out_dir is not None:
        save_drafter(out_dir, "retrieval", cfg, params, target.config,
                     extra={"data": {"self": manifest.get("key"), "rows": int(rows.shape[0]),
                                     "tokens": int(lengths.sum()), "target": _target_id(target)},
                            "table": stats, "heldout": {k: heldout[k] for k in ("tau", "accept_by_depth")},
                            "confidence_counts": {"prompts": calibration_prompts, "tried_accepted": counts,
                                                  **{f"tried_accepted_at_{t:g}": c for t, (_, c) in sampled.items()}},
                            "heldout_prompts": {"count": eval_options.prompts, "length": eval_options.prompt_len,
                                                "new_tokens": eval_options.new_tokens}})
    return RetrievalBuildResult(out_dir=Path(out_dir) if out_dir is not None else None, cfg=cfg, params=params,
                                stats=stats, heldout=heldout)
