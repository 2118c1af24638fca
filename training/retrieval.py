"""`jaxdecode train retrieval`: a datastore of the target's own continuations for the retrieval drafter.

Nothing is optimised: the target continues corpus prompts (training.distill_data, the same cached,
resumable self-distillation data the trained drafters use; greedy by default, since a point-mass draft
is accepted most often when it is the target's most likely token), the rows are kept from
`max_order` tokens before each continuation (its context) to its EOS, and the drafter's table is built
from them when it is loaded (jaxdecode.drafters.retrieval). On held-out prompts the target's greedy
continuations then measure how often a drafted token is accepted by its match length (the drafter's
confidence cut, `RetrievalConfig.confidence`), and a real greedy speculative run on other held-out
prompts measures tau and the acceptance by depth (which the adaptive policy starts from). The export
holds the rows (uint16), the config with the confidence, and those figures.
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


def build_retrieval(target, corpus_dir, out_dir=None, *, distill, workdir, config_overrides: dict | None = None,
                    eval_options: EvalOptions = EvalOptions(), calibration_prompts: int = 64,
                    progress: bool = True) -> RetrievalBuildResult:
    """Generate (or reuse) the target's continuations of corpus prompts, build the datastore, measure the
    acceptance by match length on `calibration_prompts` held-out prompts (the drafter's confidence cut)
    and its held-out acceptance on the evaluation's prompts, and export it with save_drafter to out_dir
    (kind "retrieval")."""
    from jaxdecode.autoregressive import decode
    from jaxdecode.drafters.retrieval import (RetrievalConfig, datastore_params, make_retrieval_drafter,
                                              match_acceptance, table_for)
    from jaxdecode.drafters.trained import save_drafter
    from jaxdecode.sampling import SamplerConfig

    from .corpus import Corpus
    from .distill_data import self_distill_data
    from .drafters import _load_target, _target_id

    target = _load_target(target)
    if target.tokenizer is not None:
        Corpus.open(corpus_dir).check_tokenizer(target.tokenizer)
    cfg = RetrievalConfig(**(config_overrides or {}))
    shard = self_distill_data(target, corpus_dir, Path(workdir) / "data", distill, progress=progress)
    data = np.load(shard)
    rows, lengths, starts = datastore_rows(data["tokens"], data["mask"], distill.prompt_len, cfg.max_order)
    params = datastore_params(rows, lengths, starts)
    _, stats = table_for(params, cfg, target.config.vocab_size)
    # The confidence by match length, on held-out prompts other than the evaluation's
    uncut = make_retrieval_drafter(params, dataclasses.replace(cfg, confidence=()), target, eval_options.tree)
    cal = heldout_prompts(corpus_dir, calibration_prompts, eval_options.prompt_len, eval_options.seed + 1)
    cont = decode(target.config, target.params, cal, np.full(len(cal), cal.shape[1], np.int32),
                  max_new_tokens=eval_options.new_tokens, sampler=SamplerConfig(temperature=0.0), method="greedy")
    confidence, counts = match_acceptance(uncut, cal, np.asarray(cont.tokens))
    cfg = dataclasses.replace(cfg, confidence=confidence)
    drafter = make_retrieval_drafter(params, cfg, target, eval_options.tree)
    prompts = heldout_prompts(corpus_dir, eval_options.prompts, eval_options.prompt_len, eval_options.seed)
    heldout = measure_acceptance(target, drafter, prompts, new_tokens=eval_options.new_tokens)
    manifest = json.loads((shard.parent / "manifest.json").read_text())
    if out_dir is not None:
        save_drafter(out_dir, "retrieval", cfg, params, target.config,
                     extra={"data": {"self": manifest.get("key"), "rows": int(rows.shape[0]),
                                     "tokens": int(lengths.sum()), "target": _target_id(target)},
                            "table": stats, "heldout": {k: heldout[k] for k in ("tau", "accept_by_depth")},
                            "confidence_counts": {"prompts": calibration_prompts, "tried_accepted": counts},
                            "heldout_prompts": {"count": eval_options.prompts, "length": eval_options.prompt_len,
                                                "new_tokens": eval_options.new_tokens}})
    return RetrievalBuildResult(out_dir=Path(out_dir) if out_dir is not None else None, cfg=cfg, params=params,
                                stats=stats, heldout=heldout)
