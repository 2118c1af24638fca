"""Drafters for speculative decoding, and `make_drafter` to build one by name.

Names: "draft_lm" (any jaxdecode model as a draft LM, with any tree builder), "dllm" (a masked-diffusion
LM drafting a chain in one forward: drafters.diffusion), "prompt_lookup",
"aggressive", "token_recycling", "aded", and the trained kinds ("medusa", "hydra", "eagle3", "block",
"accept_head", "kangaroo", "retrieval" (a datastore of the target's own output), and any kind registered
with `trained.register_kind`), whose weights come from a drafter directory (`drafter_dir=`, or
`<target_dir>/drafters/<kind>` when the target ships one). Without a drafter, draft model or drafter
directory, a target that ships a retrieval datastore drafts from it, any other prompt lookup.
Tree specs: see `builders.parse_tree_spec`.
"""
from __future__ import annotations

import dataclasses
import numbers
import os
import threading
import weakref
from collections import OrderedDict

import jax

from jaxdecode.drafters.builders import (ChainBuilder, DynamicTreeBuilder, StaticTreeBuilder,
                                         parse_tree_spec)
from jaxdecode.drafters.draft_lm import DraftLM
from jaxdecode.drafters.trained import (BUILTIN_KIND_MODULES, CONFIG_FILE, TENSOR_FILE, DrafterKind,
                                        DrafterLoadError, TrainedDrafter, check_options, find_drafter_dir,
                                        get_kind, is_trained_kind, kind_names, kinds_generation, load_drafter,
                                        read_drafter_config, register_kind, save_drafter)
from jaxdecode.sampling import _is_real
from jaxdecode.tree import TreeError

UNTRAINED = ("draft_lm", "dllm", "prompt_lookup", "aggressive", "token_recycling", "aded", "swift", "del")
DRAFTERS = UNTRAINED + tuple(BUILTIN_KIND_MODULES)  # names built in; registered kinds add to drafter_names()


def drafter_names() -> tuple:
    """Every drafter name make_drafter accepts now: the built-in ones and the registered trained kinds."""
    return tuple(dict.fromkeys(UNTRAINED + kind_names()))


def tree_from_option(tree, default, temperature: float):
    """The tree builder of the user's `tree` option: None = `default`, a spec string (parse_tree_spec),
    or a builder object as is; a 'chain:N' spec samples its children when decoding samples
    (temperature > 0). Trained drafters' `make` use it for their `tree` argument."""
    spec = default if tree is None else tree
    if isinstance(spec, numbers.Integral) and not isinstance(spec, bool):
        spec = f"chain:{int(spec)}"  # a node count: the chain of that many nodes
    if isinstance(spec, str) and spec.startswith("chain") and spec.count(":") == 1 and temperature > 0:
        spec = spec + ":sample"
    return parse_tree_spec(spec)


_tree_or_default = tree_from_option


def make_drafter(name, target, draft=None, tree=None, temperature: float = 0.0, drafter_dir=None, **kw):
    """Build a drafter for `target` (a jaxdecode.Model). `draft` is a Model for "draft_lm".

    A trained kind (`name` in trained.kind_names(), a TrainedDrafter from load_drafter, or None with
    `drafter_dir` given: the kind its config.json names) is loaded from `drafter_dir`, or from
    `<target_dir>/drafters/<kind>` when drafter_dir is None, and built by its kind's `make`.
    """
    if drafter_dir is not None and not isinstance(drafter_dir, (str, os.PathLike)):
        raise ValueError(f"drafter_dir must be a directory path (str or pathlib.Path), got "
                         f"{type(drafter_dir).__name__}")
    if not _is_real(temperature) or temperature < 0:  # every kind reads it (trees, cuts, the build's key)
        raise ValueError(f"make_drafter: temperature must be a finite number >= 0 (the target's sampling "
                         f"temperature; 0 = greedy), got {temperature!r}")
    if name is None and draft is None and drafter_dir is None and find_drafter_dir(target, "retrieval"):
        name = "retrieval"  # a target that ships a datastore of its own output drafts from it by default
    if isinstance(name, TrainedDrafter) or is_trained_kind(name) or (name is None and drafter_dir is not None):
        return _make_trained(name, target, tree, temperature, drafter_dir, draft, **kw)
    if drafter_dir is not None:
        raise ValueError(f"drafter_dir is for trained drafters ({', '.join(kind_names())}), but the drafter "
                         f"is {name!r}: drop drafter_dir (CLI: --drafter-dir) or name a trained kind")
    diffusion_draft = bool(getattr(getattr(draft, "config", None), "is_diffusion", False))
    name = name or (("dllm" if diffusion_draft else "draft_lm") if draft is not None else "prompt_lookup")
    if name == "dllm":  # a masked-diffusion LM drafting a chain in one forward (drafters.diffusion)
        from jaxdecode.drafters.diffusion import DiffusionDrafterError, make_dllm_drafter
        check_options("dllm", make_dllm_drafter, kw, positional=4, error=DiffusionDrafterError)
        return make_dllm_drafter(target, draft, tree, temperature, **kw)
    if name in ("draft_lm", "draft", "model"):
        if draft is None:
            raise ValueError("drafter 'draft_lm' needs a draft model: pass draft=jaxdecode.load(DIR) "
                             "(CLI: --draft DIR)")
        if diffusion_draft:
            raise ValueError("the draft model is a masked-diffusion LM, which drafter 'draft_lm' would run as a "
                             "causal one: use drafter='dllm' (CLI: --drafter dllm)")
        from jaxdecode.drafters.draft_lm import acceptance_prior_for
        from jaxdecode.models import split_layers
        return _construct(DraftLM, name, dict(params=split_layers(draft.config, draft.params), config=draft.config,
                                              builder=_tree_or_default(tree, "chain:4", temperature),
                                              acceptance_prior=acceptance_prior_for(draft, target)), kw)
    if name == "token_recycling":
        from jaxdecode.drafters.recycling import TokenRecyclingDrafter
        from jaxdecode.drafters.recycling import recycling_template
        if tree is not None:  # 'static:...' is the template M is expanded along; 'nodes:N' its size
            kw.setdefault("template", parse_tree_spec(tree).paths if str(tree).startswith("static")
                          else recycling_template(_node_budget(tree, default=48)))
        return _construct(TokenRecyclingDrafter, name, dict(vocab_size=target.config.vocab_size), kw)
    if name in ("swift", "del"):  # self-speculation: the target's own layers (jaxdecode.drafters.selfspec)
        from jaxdecode.drafters.selfspec import make_selfspec
        return make_selfspec(name, target, tree, temperature, **kw)
    if name == "aded":
        from jaxdecode.drafters.aded import ADEDDrafter
        if tree is not None:
            kw.setdefault("num_nodes", _node_budget(tree, default=16))
        return _construct(ADEDDrafter, name, dict(vocab_size=target.config.vocab_size), kw)
    n = _node_budget(tree, default=8)
    if name == "prompt_lookup":
        from jaxdecode.drafters.ngram import PromptLookupDrafter
        return _construct(PromptLookupDrafter, name, dict(num_nodes=n), kw)
    if name == "aggressive":
        from jaxdecode.drafters.ngram import AggressiveDrafter
        return _construct(AggressiveDrafter, name, dict(num_nodes=n), kw)
    raise ValueError(f"unknown drafter {name!r}; choose one of {drafter_names()}")


def _construct(cls, name: str, given: dict, options: dict):
    """cls(**given, **options), the user's drafter options checked first: a misspelt or a reserved one
    is named with the options this drafter takes (not a TypeError from the constructor)."""
    takes = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in given]
    wrong = sorted(set(options) - set(takes))
    if wrong == ["num_nodes"] and "num_nodes" in given:
        raise ValueError(f"drafter {name!r}: its node count is the tree option's (tree='chain:N' or an int N), "
                         f"not a drafter option; its options: {', '.join(takes)}")
    if wrong:
        raise ValueError(f"drafter {name!r} takes no option {', '.join(map(repr, wrong))}; its options: "
                         f"{', '.join(takes)}")
    return cls(**given, **options)


# The last few trained drafters built (key -> (weak references, drafter)). generate(drafter="eagle3")
# would otherwise read the weights from disk and hash them for the cost table on every call (tens of
# ms a call on CPU, a tenth of a short generation).
_recent_trained: OrderedDict = OrderedDict()
_recent_loaded: OrderedDict = OrderedDict()  # the directories they were read from (_loaded)
RECENT_TRAINED = 4
_recent_lock = threading.Lock()  # generate may be called from several threads


def _recent_key(name, target, tree, temperature, drafter_dir, draft, kw):
    """(key, objects the build depends on by identity) of a trained drafter build, or (None, ()) when it
    is not cached: a drafter option that is not a plain value, an unhashable tree, or no weights'
    directory found (the build then raises its own clear error). The weights' files count by size and
    modification time, so a retrained drafter is read again. Options of plain values (numbers, strings,
    lists or tuples of them) are part of the key: uncached, generate(drafter="retrieval",
    drafter_options={"min_reach": 0.15}) re-read the datastore and rebuilt its table on every call, 7x
    slower than plain decoding on the CPU."""
    options = _plain_options(kw)
    if options is None:
        return None, ()
    where = drafter_dir
    if where is None and isinstance(name, str):
        where = find_drafter_dir(target, name)
    files = ()
    if where is not None:
        files = _weight_files(where)
        if files is None:
            return None, ()
    elif not isinstance(name, TrainedDrafter):
        return None, ()
    objects = tuple(o for o in (target, draft, name) if o is not None and not isinstance(o, str))
    key = (name if isinstance(name, str) else None, str(where), files, tree, float(temperature),
           tuple(id(o) for o in objects), options, kinds_generation())
    try:
        hash(key)
    except TypeError:
        return None, ()
    return key, objects


def _plain_options(kw: dict):
    """The drafter options as a sorted tuple of typed values when every value is a plain one (None,
    bool, int, float, str, or a tuple / list of them: equal options build equal drafters), else None
    (not cached: an array or object may change under the same name)."""
    def plain(v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return type(v).__name__, v  # typed: True and 1 are equal keys, not equal options
        if isinstance(v, (tuple, list)):
            items = tuple(plain(x) for x in v)
            return _NOT_PLAIN if any(x is _NOT_PLAIN for x in items) else (type(v).__name__, items)
        return _NOT_PLAIN
    items = tuple((k, plain(v)) for k, v in sorted(kw.items()))
    return None if any(v is _NOT_PLAIN for _, v in items) else items


_NOT_PLAIN = object()


def _make_trained(name, target, tree, temperature, drafter_dir, draft, **kw):
    """A trained drafter, the same object again for the same arguments while they live (drafters are
    immutable pytrees; see _recent_trained)."""
    key, objects = _recent_key(name, target, tree, temperature, drafter_dir, draft, kw)
    return _remember(_recent_trained, RECENT_TRAINED, key, objects,
                     lambda: _build_trained(name, target, tree, temperature, drafter_dir, draft, **kw))


def _remember(cache: OrderedDict, size: int, key, objects: tuple, build):
    """cache[key] while every object in `objects` is alive (held by weak reference: an entry goes when
    one of them does), else build() stored there, the least recently used of more than `size` dropped;
    key None: build() alone."""
    if key is None:
        return build()
    with _recent_lock:
        hit = cache.get(key)
        if hit is not None and all(ref() is obj for ref, obj in zip(hit[0], objects)):
            cache.move_to_end(key)
            return hit[1]
    # Called inside a caller's jit with concrete weights, build eagerly: a value made of that trace's
    # tracers would leak into the next trace that hits the cache. Traced inputs give traced values,
    # which are not kept.
    with jax.ensure_compile_time_eval():
        value = build()
    if _holds_tracers(value):
        return value
    try:
        refs = tuple(weakref.ref(o, lambda _, k=key: cache.pop(k, None)) for o in objects)
    except TypeError:  # not weak-referenceable: not cached
        return value
    with _recent_lock:
        cache[key] = (refs, value)
        while len(cache) > size:
            cache.popitem(last=False)
    return value


def _holds_tracers(value) -> bool:
    """value (a drafter pytree, or a TrainedDrafter and its params) holds arrays of a running trace."""
    leaves = jax.tree.leaves(value) + jax.tree.leaves(getattr(value, "params", None))
    return any(isinstance(x, jax.core.Tracer) for x in leaves)


def _loaded(drafter_dir, target) -> TrainedDrafter:
    """load_drafter(drafter_dir, target), the same object again while the target lives and the
    directory's files are unchanged: builds of one directory with other trees or options then share its
    weights (and a retrieval datastore its table, built once per rows object). Read anew per build, a
    benchmark cycling over five retrieval configurations re-read the datastore and rebuilt its table on
    every call."""
    files = _weight_files(drafter_dir)
    key = None if files is None else (str(drafter_dir), files, id(target))
    load = lambda: load_drafter(drafter_dir, target)  # noqa: E731
    td = _remember(_recent_loaded, RECENT_TRAINED, key, (target,), load)
    if td.kind is not get_kind(td.kind.name):  # its kind was registered anew since: load with that one
        with _recent_lock:
            _recent_loaded.pop(key, None)
        td = _remember(_recent_loaded, RECENT_TRAINED, key, (target,), load)
    return td


def _weight_files(where):
    """((file, size, mtime_ns), ...) of a drafter directory's config and weights, None when unreadable."""
    try:
        return tuple((f, st.st_size, st.st_mtime_ns)
                     for f in (CONFIG_FILE, TENSOR_FILE) for st in [os.stat(os.path.join(where, f))])
    except OSError:
        return None


def _build_trained(name, target, tree, temperature, drafter_dir, draft, **kw):
    """A trained drafter: from a TrainedDrafter, a kind name (+ drafter_dir or the target's own), or a
    drafter_dir alone (its config.json names the kind). `draft` (a draft Model) goes to kinds whose
    `make` takes `draft_model`."""
    if isinstance(name, TrainedDrafter):
        if drafter_dir is not None:
            raise ValueError(f"the drafter is a TrainedDrafter already loaded from {name.path}: drop "
                             f"drafter_dir={str(drafter_dir)!r}")
        return name.make(target, tree=tree, temperature=temperature, **_with_draft(name.kind, draft, kw))
    if drafter_dir is None:
        drafter_dir = find_drafter_dir(target, name)
        if drafter_dir is None:
            where = getattr(target, "path", None)
            looked = (f"; none is shipped with the target ({where}/drafters/{name} has no config.json)"
                      if where else "")
            raise ValueError(f"drafter {name!r} is a trained drafter and needs its weights: pass "
                             f"drafter_dir=DIR (CLI: --drafter-dir DIR), a directory written by `jaxdecode "
                             f"train {name}` or save_drafter{looked}")
    elif name is not None:
        found = read_drafter_config(drafter_dir)["jaxdecode_drafter"]
        if found != name:
            raise ValueError(f"drafter_dir {drafter_dir} holds a {found!r} drafter, but drafter={name!r} was "
                             f"asked: pass drafter={found!r}, or leave drafter unset to use the directory's "
                             f"kind")
    td = _loaded(drafter_dir, target)
    return td.make(target, tree=tree, temperature=temperature, **_with_draft(td.kind, draft, kw))


def _with_draft(kind, draft, kw: dict) -> dict:
    """drafter options plus draft_model=draft, for a kind whose make takes a draft LM."""
    if draft is None:
        return kw
    if not kind.takes_draft_model:
        raise ValueError(f"the {kind.name} drafter does not draft with a draft model: drop draft (CLI: --draft)")
    if kw.get("draft_model") is not None:
        raise ValueError("a draft model is given twice, as draft and as drafter_options['draft_model']: "
                         "keep one")
    return dict(kw, draft_model=draft)


def _node_budget(tree, default: int) -> int:
    """Node budget for retrieval drafters: 'chain:N', 'nodes:N', an int or a ChainBuilder (a wrapper's
    chain, e.g. the acceptance head's; the rule does not apply to a drafter of point masses)."""
    if tree is None:
        return default
    if isinstance(tree, str) and tree.startswith("nodes:"):
        try:
            return int(tree.partition(":")[2])
        except ValueError:
            raise TreeError(f"bad tree spec {tree!r}: write nodes:N with N a node count") from None
    builder = parse_tree_spec(tree)  # a misspelt spec is named as such
    if isinstance(builder, ChainBuilder):
        return builder.depth
    raise ValueError(f"drafters that retrieve a continuation propose chains: use tree='chain:N', got "
                     f"{tree!r}")


__all__ = ["ChainBuilder", "DynamicTreeBuilder", "StaticTreeBuilder", "DraftLM", "make_drafter",
           "parse_tree_spec", "tree_from_option", "DRAFTERS", "drafter_names", "DrafterKind",
           "DrafterLoadError", "TrainedDrafter", "load_drafter", "save_drafter", "register_kind"]
