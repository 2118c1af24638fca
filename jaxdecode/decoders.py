"""Built-in methods of `jaxdecode.generate`: adapters from the registry to the decoder functions.

Each adapter turns the common options (temperature, top-k/p, min-p, repetition penalty, seed, EOS,
mesh) into the decoder's own arguments; the decoders themselves stay plain jit-able functions.
"""
from __future__ import annotations

import jax

from jaxdecode.autoregressive import decode
from jaxdecode.beam import beam_search
from jaxdecode.registry import register_method
from jaxdecode.sampling import SamplerConfig

SAMPLER_OPTIONS = ("top_k", "top_p", "min_p", "repetition_penalty")


def sampler_from_options(opts: dict, default_temperature: float) -> SamplerConfig:
    t = opts.get("temperature")
    return SamplerConfig(
        temperature=default_temperature if t is None else float(t),
        top_k=int(opts.get("top_k") or 0), top_p=float(opts.get("top_p") or 1.0),
        min_p=float(opts.get("min_p") or 0.0),
        repetition_penalty=float(opts.get("repetition_penalty") or 1.0))


def place_inputs(model, prompt_tokens, prompt_lengths, opts):
    """With a mesh: parameters as loaded (sharded by `load(mesh=...)`), prompts over `data`."""
    mesh = opts.get("mesh")
    if mesh is None:
        return model.params, prompt_tokens, prompt_lengths
    from jaxdecode.sharding import shard_batch, shard_params
    return (shard_params(model.params, mesh), shard_batch(prompt_tokens, mesh),
            shard_batch(prompt_lengths, mesh))


def _autoregressive(kind: str, default_temperature: float):
    def run(model, prompt_tokens, prompt_lengths, max_new_tokens, opts):
        params, toks, lens = place_inputs(model, prompt_tokens, prompt_lengths, opts)
        sampler = sampler_from_options(opts, default_temperature)
        method = "greedy" if kind == "sample" and sampler.temperature == 0 else kind
        extra = {}
        if kind == "mirostat":
            extra = {k: float(opts[o]) for k, o in (("mirostat_tau", "tau"), ("mirostat_eta", "eta"))
                     if opts.get(o) is not None}
        out = decode(model.config, params, toks, lens, max_new_tokens=max_new_tokens, sampler=sampler,
                     eos_ids=opts["eos_ids"], key=jax.random.PRNGKey(opts.get("seed") or 0),
                     cache_len=opts.get("cache_len"), method=method, **extra)
        return out.tokens, out.lengths, out.stats
    return run


def _beam(diverse: bool):
    def run(model, prompt_tokens, prompt_lengths, max_new_tokens, opts):
        params, toks, lens = place_inputs(model, prompt_tokens, prompt_lengths, opts)
        num_beams = int(opts.get("num_beams") or 4)
        groups = int(opts.get("num_groups") or (2 if diverse else 1))
        out = beam_search(model.config, params, toks, lens, max_new_tokens=max_new_tokens,
                          num_beams=num_beams, length_penalty=float(opts.get("length_penalty", 1.0)),
                          eos_ids=opts["eos_ids"], num_groups=groups,
                          diversity_penalty=float(opts.get("diversity_penalty",
                                                           0.5 if diverse else 0.0)),
                          cache_len=opts.get("cache_len"))
        stats = dict(out.stats)
        stats["beam_scores"] = out.scores
        stats["beams"] = out.tokens
        stats["beam_lengths"] = out.lengths
        return out.tokens[:, 0], out.lengths[:, 0], stats
    return run


BEAM_ROW_STATS = ("beam_scores", "beams", "beam_lengths")

register_method("greedy", _autoregressive("greedy", 0.0), description="argmax decoding")
register_method("sample", _autoregressive("sample", 1.0), SAMPLER_OPTIONS, aliases=("sampling",),
                description="ancestral sampling with temperature / top-k / top-p / min-p / repetition penalty")
register_method("mirostat", _autoregressive("mirostat", 1.0), SAMPLER_OPTIONS + ("tau", "eta"),
                description="Mirostat v2 sampling at a target surprise tau (bits)")
register_method("beam", _beam(False), ("num_beams", "length_penalty"), aliases=("beam_search",),
                per_row_stats=BEAM_ROW_STATS,
                description="beam search with length penalty")
register_method("diverse_beam", _beam(True), per_row_stats=BEAM_ROW_STATS, options=
                ("num_beams", "length_penalty", "num_groups", "diversity_penalty"),
                description="Diverse Beam Search (Hamming diversity between beam groups)")


# ----------------------------------------------------------------------------- speculative
# The verifier that is lossless for each way a drafter picks children (used when none is named).
DEFAULT_VERIFIER = {"point": "point_mass", "sample": "chain", "argmax": "topk", "topk": "topk",
                    "iid": "specinfer", "gumbel": "rsd"}


def _speculative(model, prompt_tokens, prompt_lengths, max_new_tokens, opts):
    from jaxdecode.model import Model, load
    from jaxdecode.drafters import make_drafter
    from jaxdecode.speculative import speculative_decode
    from jaxdecode.verifiers import get_verifier

    sampler = sampler_from_options(opts, 0.0)
    draft = opts.get("draft")
    if draft is not None and not isinstance(draft, Model):
        draft = load(draft)
    drafter = opts.get("drafter")
    if drafter is None or isinstance(drafter, str):
        drafter = make_drafter(drafter, model, draft=draft, tree=opts.get("tree"),
                               temperature=sampler.temperature, **dict(opts.get("drafter_options") or {}))
    elif opts.get("drafter_options"):
        raise ValueError("drafter_options configure a drafter built by name; a drafter object is already "
                         "configured: drop drafter_options")
    verifier = opts.get("verifier")
    if verifier is None or isinstance(verifier, str):
        name = verifier or ("greedy" if sampler.is_greedy else DEFAULT_VERIFIER[drafter.child_rule])
        verifier = get_verifier(name)
    params, toks, lens = place_inputs(model, prompt_tokens, prompt_lengths, opts)
    out = speculative_decode(model.config, params, drafter, toks, lens, max_new_tokens=max_new_tokens,
                             verifier=verifier, sampler=sampler, eos_ids=opts["eos_ids"],
                             key=jax.random.PRNGKey(opts.get("seed") or 0),
                             cache_len=opts.get("cache_len"), verify_widths=opts.get("verify_widths"))
    return out.tokens, out.lengths, out.stats


register_method("speculative", _speculative,
                SAMPLER_OPTIONS + ("draft", "drafter", "tree", "verifier", "drafter_options", "verify_widths"),
                aliases=("spec",),
                per_row_stats=("tau", "verify_calls"),
                description="speculative decoding: drafter x tree x verifier (lossless verifiers unless "
                            "verifier='typical', which is lossy)")


# ----------------------------------------------------------------------------- constrained
def constraint_from_options(model, opts, batch: int):
    """The TrieConstraint of option `index`: a TrieConstraint, TrieIndex or DynamicIndex, an index file
    (.npz from TrieIndex.save) or an item file (one item per line, token ids separated by spaces; built
    for the model's vocabulary). Option `set_ids`: one item set per prompt, or one int for all."""
    import numpy as np

    from jaxdecode.constraints import DynamicIndex, TrieConstraint, TrieIndex, build_index, load_index
    src = opts.get("index")
    if src is None:
        raise ValueError("constrained methods need option index=: an index .npz (jaxdecode index build), an "
                         "item file (one item per line), a TrieIndex, DynamicIndex or TrieConstraint")
    set_ids = opts.get("set_ids")
    if set_ids is not None:
        set_ids = np.asarray(set_ids)
        if set_ids.ndim == 0:
            set_ids = np.full((batch,), int(set_ids))
    if isinstance(src, TrieConstraint):
        return src if set_ids is None else src.replace(set_ids=jax.numpy.asarray(set_ids, jax.numpy.int32))
    if not isinstance(src, (TrieIndex, DynamicIndex)):
        src = str(src)
        src = load_index(src) if src.endswith(".npz") else build_index(src, model.config.vocab_size)
    return src.constraint(set_ids=set_ids, mesh=opts.get("mesh"), impl=opts.get("impl") or "auto")


def _constrained_beam(model, prompt_tokens, prompt_lengths, max_new_tokens, opts):
    params, toks, lens = place_inputs(model, prompt_tokens, prompt_lengths, opts)
    constraint = constraint_from_options(model, opts, prompt_tokens.shape[0])
    out = beam_search(model.config, params, toks, lens, max_new_tokens=max_new_tokens,
                      num_beams=int(opts.get("num_beams") or 4),
                      length_penalty=float(opts.get("length_penalty", 1.0)), eos_ids=opts["eos_ids"],
                      cache_len=opts.get("cache_len"), constraint=constraint)
    stats = dict(out.stats, beam_scores=out.scores, beams=out.tokens, beam_lengths=out.lengths,
                 beam_valid=out.scores > -float("inf"))
    return out.tokens[:, 0], out.lengths[:, 0], stats


def _constrained_autoregressive(kind: str, default_temperature: float):
    def run(model, prompt_tokens, prompt_lengths, max_new_tokens, opts):
        params, toks, lens = place_inputs(model, prompt_tokens, prompt_lengths, opts)
        constraint = constraint_from_options(model, opts, prompt_tokens.shape[0])
        sampler = sampler_from_options(opts, default_temperature)
        method = "greedy" if kind == "greedy" or sampler.temperature == 0 else "sample"
        out = decode(model.config, params, toks, lens, max_new_tokens=max_new_tokens, sampler=sampler,
                     eos_ids=opts["eos_ids"], key=jax.random.PRNGKey(opts.get("seed") or 0),
                     cache_len=opts.get("cache_len"), method=method, constraint=constraint)
        return out.tokens, out.lengths, out.stats
    return run


CONSTRAINT_OPTIONS = ("index", "set_ids", "impl")
register_method("constrained_beam", _constrained_beam, CONSTRAINT_OPTIONS + ("num_beams", "length_penalty"),
                aliases=("static",), per_row_stats=BEAM_ROW_STATS + ("beam_valid",),
                description="beam search over an item index (STATIC CSR trie): every beam is an item")
register_method("constrained_greedy", _constrained_autoregressive("greedy", 0.0), CONSTRAINT_OPTIONS,
                description="greedy decoding restricted to an item index (masking)")
register_method("constrained_sample", _constrained_autoregressive("sample", 1.0),
                CONSTRAINT_OPTIONS + SAMPLER_OPTIONS,
                description="sampling restricted to an item index (masking)")
