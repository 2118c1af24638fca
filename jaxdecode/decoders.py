"""Built-in methods of `jaxdecode.generate`: adapters from the registry to the decoder functions.

`generate` hands each adapter the options resolved by `jaxdecode.options.resolve`: every option the
method takes is present, validated, and unset ones hold the table's default. The adapters use the
values as given (0 is a value, never "unset") and turn them into the decoder's own arguments; the
decoders themselves stay plain jit-able functions.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path

import jax

from jaxdecode.autoregressive import decode
from jaxdecode.beam import beam_search
from jaxdecode.options import method_options
from jaxdecode.registry import register_method
from jaxdecode.sampling import SamplerConfig


def sampler_from_options(opts: dict) -> SamplerConfig:
    """The SamplerConfig of resolved options; a rule the method does not take is off (greedy has no
    temperature: it is 0)."""
    return SamplerConfig(temperature=float(opts.get("temperature", 0.0)), top_k=int(opts.get("top_k", 0)),
                         top_p=float(opts.get("top_p", 1.0)), min_p=float(opts.get("min_p", 0.0)),
                         repetition_penalty=float(opts.get("repetition_penalty", 1.0)))


def _key(opts: dict):
    return jax.random.PRNGKey(opts.get("seed", 0))


def place_inputs(model, prompt_tokens, prompt_lengths, opts):
    """With a mesh: parameters as loaded (sharded by `load(mesh=...)`), prompts over `data`."""
    mesh = opts.get("mesh")
    if mesh is None:
        return model.params, prompt_tokens, prompt_lengths
    from jaxdecode.sharding import shard_batch, shard_params
    return (shard_params(model.params, mesh), shard_batch(prompt_tokens, mesh),
            shard_batch(prompt_lengths, mesh))


def structured_constraint(model, opts: dict, batch: int):
    """The Constraint of the structured-output options (regex / json_schema / grammar): opts["constraint"],
    built by generate (jaxdecode.structured), else built here for direct callers; None without them."""
    if opts.get("constraint") is not None:
        return opts["constraint"]
    from jaxdecode.structured import build_constraint, structured_request
    req = structured_request(opts, batch)
    return None if req is None else build_constraint(model, req, opts["eos_ids"])[0]


def _autoregressive(kind: str):
    def run(model, prompt_tokens, prompt_lengths, max_new_tokens, opts):
        params, toks, lens = place_inputs(model, prompt_tokens, prompt_lengths, opts)
        extra = {}
        if kind == "mirostat":
            extra = dict(mirostat_tau=float(opts["tau"]), mirostat_eta=float(opts["eta"]))
        constraint = structured_constraint(model, opts, prompt_tokens.shape[0])
        # decode() treats temperature 0 as greedy for every method.
        out = decode(model.config, params, toks, lens, max_new_tokens=max_new_tokens,
                     sampler=sampler_from_options(opts), eos_ids=opts["eos_ids"], key=_key(opts),
                     cache_len=opts["cache_len"], method=kind, constraint=constraint, **extra,
                     **logprob_flags(opts), stream=stream_sink(opts))
        return out.tokens, out.lengths, out.stats
    return run


def stream_sink(opts: dict):
    """The streaming sink generate put in opts["stream"] (jaxdecode.streaming), told the decode's stop
    strings (the resolved option: the stream holds back text that may begin one) and mesh; None without."""
    sink = opts.get("stream")
    if sink is not None:
        sink.mesh = opts.get("mesh")  # the hook gathers its few ints explicitly onto one device
        if opts.get("stop"):
            sink.stops = (opts["stop"],) if isinstance(opts["stop"], str) else tuple(opts["stop"])
    return sink


def logprob_flags(opts: dict) -> dict:
    """The decoders' logprobs / top_logprobs arguments from the options (top_logprobs > 0 implies logprobs)."""
    top = int(opts.get("top_logprobs") or 0)
    return dict(logprobs=bool(opts.get("logprobs")) or top > 0, top_logprobs=top)


def _beam(diverse: bool):
    def run(model, prompt_tokens, prompt_lengths, max_new_tokens, opts):
        params, toks, lens = place_inputs(model, prompt_tokens, prompt_lengths, opts)
        constraint = structured_constraint(model, opts, prompt_tokens.shape[0])
        out = beam_search(model.config, params, toks, lens, max_new_tokens=max_new_tokens,
                          num_beams=opts["num_beams"], length_penalty=float(opts["length_penalty"]),
                          eos_ids=opts["eos_ids"], num_groups=opts["num_groups"] if diverse else 1,
                          diversity_penalty=float(opts["diversity_penalty"]) if diverse else 0.0,
                          cache_len=opts["cache_len"], constraint=constraint, early_stopping=opts["early_stopping"])
        stats = dict(out.stats)
        stats["beam_scores"] = out.scores
        stats["beams"] = out.tokens
        stats["beam_lengths"] = out.lengths
        return out.tokens[:, 0], out.lengths[:, 0], stats
    return run


BEAM_ROW_STATS = ("beam_scores", "beams", "beam_lengths")

register_method("greedy", _autoregressive("greedy"), method_options("greedy"), description="argmax decoding")
register_method("sample", _autoregressive("sample"), method_options("sample"), aliases=("sampling",),
                description="ancestral sampling with temperature / top-k / top-p / min-p / repetition penalty")
register_method("mirostat", _autoregressive("mirostat"), method_options("mirostat"),
                description="Mirostat v2 sampling at a target surprise tau (bits)")
register_method("beam", _beam(False), method_options("beam"), aliases=("beam_search",),
                per_row_stats=BEAM_ROW_STATS,
                description="beam search with length penalty")
register_method("diverse_beam", _beam(True), method_options("diverse_beam"), per_row_stats=BEAM_ROW_STATS,
                description="Diverse Beam Search (Hamming diversity between beam groups)")


# ----------------------------------------------------------------------------- speculative
from jaxdecode.verifiers import DEFAULT_VERIFIER  # noqa: F401  (re-exported: it used to live here)

SETUP_KEY = "_setup_seconds"  # opts entry: [wall, compile] seconds a method spent preparing, not decoding


@contextlib.contextmanager
def setup_clock(opts: dict):
    """Times work a method does before decoding (measuring step costs, choosing tree="auto"): generate
    takes its wall time out of `seconds` and its compiles out of `compile_seconds`, since the stats that
    report it (calibrate_seconds, tree_auto_seconds) already hold both. Yields a one-item list that
    holds this block's wall seconds on exit."""
    from jaxdecode.bench import CompileClock
    spent, clock = [0.0], CompileClock()
    start = time.perf_counter()
    try:
        with clock:
            yield spent
    finally:
        spent[0] = time.perf_counter() - start
        total = opts.setdefault(SETUP_KEY, [0.0, 0.0])
        total[0] += spent[0]
        total[1] += clock.seconds or 0.0  # None: this JAX cannot tell; the wall alone is taken out


def _speculative(model, prompt_tokens, prompt_lengths, max_new_tokens, opts):
    from jaxdecode.model import Model, load
    from jaxdecode.drafters import TrainedDrafter, make_drafter
    from jaxdecode.speculative import check_combination, check_feature_layers, speculative_decode
    from jaxdecode.treeopt import is_auto, resolve_auto_tree
    from jaxdecode.verifiers import default_verifier, get_verifier

    sampler = sampler_from_options(opts)
    draft = opts["draft"]
    # Loading a draft model or a trained drafter's weights, building a datastore's table (seconds on a
    # first call, then cached): reported as drafter_load_seconds, not in seconds, like the calibration.
    with setup_clock(opts) as loading:
        if draft is not None and not isinstance(draft, Model):
            draft = load(draft)
        if draft is not None and opts.get("mesh") is not None:  # the draft model on the target's mesh
            from jaxdecode.sharding import shard_params
            draft = dataclasses.replace(draft, params=shard_params(draft.params, opts["mesh"]))
    drafter, tree, tree_stats = opts["drafter"], opts["tree"], {}
    drafter_load = loading[0]
    if drafter is None or isinstance(drafter, (str, TrainedDrafter)):  # built here, trained ones loaded
        def build(tree, name=drafter):
            return make_drafter(name, model, draft=draft, tree=tree, temperature=sampler.temperature,
                                drafter_dir=opts["drafter_dir"], **(opts["drafter_options"] or {}))
        if is_auto(tree):  # tree="auto": shape and size from measured acceptance and costs (treeopt)
            with setup_clock(opts):  # reported as tree_auto_seconds, not in seconds
                tree, tree_stats = resolve_auto_tree(model, build, prompt_tokens, prompt_lengths, spec=tree,
                                                     sampler=sampler, verifier=opts["verifier"],
                                                     eos_ids=opts["eos_ids"], max_new_tokens=max_new_tokens,
                                                     mesh=opts.get("mesh"))
        with setup_clock(opts) as loading:
            drafter = build(tree)
        drafter_load += loading[0]
    elif is_auto(tree):
        raise ValueError("tree='auto' builds the drafter on the tree it chooses: name the drafter "
                         "(drafter='draft_lm', 'medusa', ...) instead of passing a Drafter object")
    elif opts["drafter_options"] is not None:
        raise ValueError("drafter_options configure a drafter built by name; a drafter object is already "
                         "configured: drop drafter_options")
    verifier = opts["verifier"]
    if verifier is None:
        verifier = default_verifier(drafter, sampler)
    if isinstance(verifier, str):
        verifier = get_verifier(verifier)
    # The engine's own host checks, before the policy measures step costs (minutes on a first call): a
    # pair it refuses is refused at once, with its own message, whatever `adaptive` is.
    check_combination(model.config, drafter, verifier, sampler)
    check_feature_layers(model.config, getattr(drafter, "feature_layers", ()))
    constraint = structured_constraint(model, opts, prompt_tokens.shape[0])
    policy, costs = _adaptive_policy(model, drafter, sampler, verifier, prompt_tokens, max_new_tokens, opts)
    params, toks, lens = place_inputs(model, prompt_tokens, prompt_lengths, opts)
    extra = {} if constraint is None else {"constraint": constraint}  # options.STRUCTURED lists speculative
    out = speculative_decode(model.config, params, drafter, toks, lens, max_new_tokens=max_new_tokens,
                             verifier=verifier, sampler=sampler, eos_ids=opts["eos_ids"],
                             key=_key(opts), cache_len=opts["cache_len"],
                             verify_widths=None if policy else opts["verify_widths"], mesh=opts.get("mesh"),
                             adaptive=policy, costs=costs, **extra, **logprob_flags(opts),
                             stream=stream_sink(opts))
    if policy is not None:
        tree_stats["calibrate_seconds"] = float(opts.get("calibrate_seconds", 0.0))  # compiles included
    tree_stats["drafter_load_seconds"] = float(drafter_load)
    # What actually ran (defaults and tree="auto" resolved), reported with the batch's stats.
    tree_stats.update(drafter=drafter_name(drafter), verifier=str(verifier.name))
    tree_stats.setdefault("tree", tree if isinstance(tree, str) else tree_text(drafter))  # auto: its chosen spec
    return out.tokens, out.lengths, {**out.stats, **tree_stats}


def drafter_name(drafter) -> str:
    """A drafter's kind (trained kinds and named drafters), else its class name."""
    for attr in ("kind", "name"):
        value = getattr(drafter, attr, None)
        if isinstance(value, str):
            return value
    return type(drafter).__name__


def tree_text(drafter) -> str:
    """The draft tree a drafter proposes, as a spec where it has one (chain:4, eagle:depth=5,...)."""
    from jaxdecode.drafters.builders import ChainBuilder, DynamicTreeBuilder, StaticTreeBuilder
    b = getattr(drafter, "builder", None)
    if isinstance(b, ChainBuilder):
        return f"chain:{b.depth}" + ("" if b.rule == "argmax" else f":{b.rule}")
    if isinstance(b, DynamicTreeBuilder):
        return f"eagle:depth={b.depth},topk={b.topk},total={b.total}"
    nodes, depth = getattr(drafter, "num_nodes", None), getattr(drafter, "max_depth", None)
    if b is None and getattr(drafter, "is_chain", False) and nodes == depth:  # lookup drafters' chains
        return f"chain:{nodes}"  # as the tree option takes it back
    shape = "static" if isinstance(b, StaticTreeBuilder) else type(b or drafter).__name__
    return f"{shape}: {nodes} nodes, depth {depth}" + (f", {b.rule}" if isinstance(b, StaticTreeBuilder) else "")


def _adaptive_policy(model, drafter, sampler, verifier, prompt_tokens, max_new_tokens, opts):
    """(AdaptivePolicy, CostTable) of the `adaptive` / `costs` options, or (None, None) when off.
    Costs: given, or measured for this model, drafter, device and batch size on first use and cached
    (jaxdecode.costmodel; progress on stderr), on the mesh when one is given."""
    costs = opts["costs"]
    overrides = _policy_overrides(opts["adaptive"])
    if overrides is None:
        return None, None
    from jaxdecode import costmodel
    from jaxdecode.speculative import check_verify_widths, policy_for
    if opts["verify_widths"] is not None:  # checked as without the policy: nothing dropped silently
        check_verify_widths(opts["verify_widths"], drafter.num_nodes)
    # costmodel's rule, which `jaxdecode calibrate` follows too: its tables have the key read here
    widths = costmodel.policy_widths(drafter, opts["verify_widths"])
    policy = policy_for(drafter, sampler, widths=widths, **overrides)
    batch_size, sampled = int(prompt_tokens.shape[0]), not sampler.is_greedy
    if isinstance(costs, (str, os.PathLike)):
        path, costs = costs, _costs_from_file(costs, batch_size, sampled=sampled)
        _check_costs_fit(costs, f"costs={str(path)!r} holds a cost table", model, drafter, batch_size, sampled,
                         opts.get("mesh"))
    elif costs is None:
        with setup_clock(opts) as spent:  # reported apart as calibrate_seconds, not in seconds
            costs = costmodel.load_or_calibrate(model, drafter, batch_size, widths=widths,
                                                context_len=int(prompt_tokens.shape[1]) + max_new_tokens // 2,
                                                mesh=opts.get("mesh"), sampler=sampler, verifier=verifier,
                                                any_context=True)
        opts["calibrate_seconds"] = spent[0]
    else:
        _check_costs_fit(costs, "costs= is a cost table", model, drafter, batch_size, sampled, opts.get("mesh"))
    if jax.process_count() > 1:  # every process must decide alike: all use process 0's measurements
        costs = _same_costs_everywhere(costs)
    return policy, costs


def _calibrate_hint(batch_size: int, sampled: bool) -> str:
    """How to measure the table a call needs (Python and CLI), for the costs= errors."""
    temp = " --temperature 0.7" if sampled else ""
    return (f"calibrate for it (costmodel.load_or_calibrate(model, drafter, {batch_size}"
            f"{', sampler=SamplerConfig(0.7)' if sampled else ''}); CLI `jaxdecode calibrate --batch-size "
            f"{batch_size}{temp} --json` with the call's --drafter, --tree and dtype options), or leave costs "
            f"unset to measure it")


def _check_costs_fit(costs, what: str, model, drafter, batch_size: int, sampled: bool, mesh=None) -> None:
    """A costs= table prices this call's steps only if it was measured for them: the same batch size, drafter
    (type and node count), compute and weight dtypes, greedy or sampled decoding, and mesh. What a table's
    meta does not record (tables made by hand, older files) is not checked."""
    from jaxdecode.costmodel import mesh_text, weights_dtype
    if isinstance(getattr(costs, "batch_size", None), int) and costs.batch_size != batch_size:
        # a step's cost grows with the batch: another size's table misprices every step
        raise ValueError(f"{what} measured at batch size {costs.batch_size}, not at this call's {batch_size}: "
                         + _calibrate_hint(batch_size, sampled))
    meta = getattr(costs, "meta", None)
    if not isinstance(meta, dict):
        return
    floats = lambda text: "/".join(d for d in str(text).split("/") if "float" in d)  # noqa: E731
    checks = [("drafter", meta.get("drafter"), type(drafter).__name__),
              ("tree size (nodes)", meta.get("num_nodes"), int(drafter.num_nodes)),
              ("compute dtype", meta.get("dtype"), model.config.dtype),
              ("weight dtype", floats(meta.get("weights_dtype") or "") or None, weights_dtype(model.params)),
              ("decoding", {True: "sampled", False: "greedy"}.get(meta.get("sampling")),
               "sampled" if sampled else "greedy"),
              ("mesh", meta.get("mesh"), mesh_text(mesh))]
    for name, measured, call in checks:
        if measured is not None and measured != call:
            raise ValueError(f"{what} measured for {name} {measured}, but this call has {call}: it would "
                             f"misprice every step; " + _calibrate_hint(batch_size, sampled))


def _costs_from_file(path, batch_size: int, sampled: bool = False):
    """The cost table in a file written by `jaxdecode calibrate --json`: one JSON table per line, one per
    batch size (and temperature) measured; the one for this batch size and greedy or sampled decoding
    (an error when the file has none for it; a table that does not say which decoding serves both)."""
    import json

    from jaxdecode import costmodel
    try:
        text = Path(path).read_text()
        try:
            objects = [json.loads(text)]  # one table, however it is laid out
        except json.JSONDecodeError:
            objects = [json.loads(line) for line in text.splitlines() if line.strip()]  # one per line
        if not objects:
            raise ValueError("the file is empty")
        tables = [costmodel.CostTable.from_json(obj) for obj in objects]
    except (OSError, ValueError) as e:
        raise ValueError(f"costs={str(path)!r} is not a readable cost table ({e}); write one with "
                         f"`jaxdecode calibrate --json`, or leave costs unset to measure them") from None
    decoding = "sampled" if sampled else "greedy"
    sized = [t for t in tables if t.batch_size == batch_size]
    for table in sized:
        if table.meta.get("sampling", sampled) == sampled:
            return table
    if sized:  # a sampled step costs more than a greedy one (the verifier's draws)
        other = "greedy" if sampled else "sampled"
        raise ValueError(f"costs={str(path)!r} holds a {other} cost table for batch size {batch_size}, not a "
                         f"{decoding} one as this call decodes: " + _calibrate_hint(batch_size, sampled))
    # One table or several, never another batch size's: a step's cost grows with the batch.
    sizes = sorted({t.batch_size for t in tables})
    held = (f"a cost table for batch size {sizes[0]}" if len(tables) == 1
            else f"cost tables for batch sizes {sizes}")
    raise ValueError(f"costs={str(path)!r} holds {held}, not for this call's {batch_size}: "
                     + _calibrate_hint(batch_size, sampled))


def _policy_overrides(setting) -> dict | None:
    """AdaptivePolicy fields of the `adaptive` option: None when off (false), {} for true, the dict's
    (checked) for a dict."""
    import numpy as np

    from jaxdecode.adaptive import AdaptivePolicy
    if isinstance(setting, (bool, np.bool_)):
        return {} if setting else None
    if not isinstance(setting, dict):
        raise ValueError(f"adaptive= takes true, false or a dict of AdaptivePolicy fields (e.g. "
                         f"{{'margin': 0.1}}), got {setting!r}")
    fields = sorted(f.name for f in dataclasses.fields(AdaptivePolicy) if f.name != "widths")
    if "widths" in setting:
        raise ValueError("adaptive={'widths': ...}: the policy's widths come from the drafter; set the "
                         "verify_widths option to add widths")
    unknown = sorted(set(setting) - set(fields))
    if unknown:
        raise ValueError(f"adaptive= has unknown AdaptivePolicy fields {unknown}; the fields are {fields}")
    # lists (JSON, the CLI) as tuples: the policy is part of the jit key, so it must hash
    out = {k: tuple(v) if isinstance(v, list) else v for k, v in setting.items()}
    try:
        AdaptivePolicy(widths=(0, 1), **out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"adaptive={setting!r}: {e}") from None
    return out


def _same_costs_everywhere(costs):
    """Process 0's cost table on every process (each measured its own; timings differ between hosts,
    and processes that decided differently whether to draft would run different programs)."""
    import numpy as np
    from jax.experimental import multihost_utils
    n = len(costs.widths)
    vec = np.asarray(list(costs.verify_seconds) + list(costs.step_seconds)
                     + [costs.draft_seconds, costs.idle_seconds, costs.catch_up_seconds], np.float64)
    vec = np.asarray(multihost_utils.broadcast_one_to_all(vec), np.float64).tolist()
    return dataclasses.replace(costs, verify_seconds=tuple(vec[:n]), step_seconds=tuple(vec[n:-3]),
                               draft_seconds=vec[-3], idle_seconds=vec[-2], catch_up_seconds=vec[-1])


register_method("speculative", _speculative, method_options("speculative"), aliases=("spec",),
                per_row_stats=("tau", "verify_calls", "accept_hist", "drafted_nodes", "speculative_steps"),
                description="speculative decoding: drafter x tree x verifier (lossless verifiers unless "
                            "verifier='typical', which is lossy)")


# ----------------------------------------------------------------------------- constrained
def constraint_from_options(model, opts, batch: int):
    """The TrieConstraint of option `index`: a TrieConstraint, TrieIndex or DynamicIndex, an index file
    (.npz from TrieIndex.save) or an item file (one item per line, token ids separated by spaces; built
    for the model's vocabulary). Option `set_ids`: one item set per prompt, or one int for all."""
    import numpy as np

    from jaxdecode.constraints import DynamicIndex, TrieConstraint, TrieIndex, build_index, load_index
    src = opts["index"]
    if src is None:  # generate() refuses this earlier (a required option); kept for direct callers
        raise ValueError("constrained methods need option index=: an index .npz (jaxdecode index build), an "
                         "item file (one item per line), a TrieIndex, DynamicIndex or TrieConstraint")
    set_ids = opts["set_ids"]
    if set_ids is not None:
        set_ids = np.asarray(set_ids)
        if set_ids.ndim == 0:
            set_ids = np.full((batch,), int(set_ids))
    if isinstance(src, TrieConstraint):
        return src if set_ids is None else src.replace(set_ids=jax.numpy.asarray(set_ids, jax.numpy.int32))
    if not isinstance(src, (TrieIndex, DynamicIndex)):
        src = str(src)
        src = load_index(src) if src.endswith(".npz") else build_index(src, model.config.vocab_size)
    return src.constraint(set_ids=set_ids, mesh=opts["mesh"], impl=opts["impl"])


def _constrained_beam(model, prompt_tokens, prompt_lengths, max_new_tokens, opts):
    params, toks, lens = place_inputs(model, prompt_tokens, prompt_lengths, opts)
    constraint = constraint_from_options(model, opts, prompt_tokens.shape[0])
    out = beam_search(model.config, params, toks, lens, max_new_tokens=max_new_tokens,
                      num_beams=opts["num_beams"], length_penalty=float(opts["length_penalty"]),
                      eos_ids=opts["eos_ids"], cache_len=opts["cache_len"], constraint=constraint)
    stats = dict(out.stats, beam_scores=out.scores, beams=out.tokens, beam_lengths=out.lengths,
                 beam_valid=out.scores > -float("inf"))
    return out.tokens[:, 0], out.lengths[:, 0], stats


def _constrained_autoregressive(kind: str):
    def run(model, prompt_tokens, prompt_lengths, max_new_tokens, opts):
        params, toks, lens = place_inputs(model, prompt_tokens, prompt_lengths, opts)
        constraint = constraint_from_options(model, opts, prompt_tokens.shape[0])
        out = decode(model.config, params, toks, lens, max_new_tokens=max_new_tokens,
                     sampler=sampler_from_options(opts), eos_ids=opts["eos_ids"], key=_key(opts),
                     cache_len=opts["cache_len"], method=kind, constraint=constraint, stream=stream_sink(opts))
        return out.tokens, out.lengths, out.stats
    return run


register_method("constrained_beam", _constrained_beam, method_options("constrained_beam"),
                aliases=("static",), per_row_stats=BEAM_ROW_STATS + ("beam_valid",),
                description="beam search over an item index (STATIC CSR trie): every beam is an item")
register_method("constrained_greedy", _constrained_autoregressive("greedy"), method_options("constrained_greedy"),
                description="greedy decoding restricted to an item index (masking)")
register_method("constrained_sample", _constrained_autoregressive("sample"), method_options("constrained_sample"),
                description="sampling restricted to an item index (masking)")
