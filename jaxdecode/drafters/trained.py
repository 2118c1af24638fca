"""Trained drafters: one on-disk format, one loader, and a registry of drafter kinds.

A trained drafter (Medusa / Hydra heads, an EAGLE-3 head, ...) is a directory:

    DIR/config.json        {"jaxdecode_drafter": KIND, "format_version": 1,
                            "config": {...the kind's config dataclass...},
                            "target": {...the target fields it was trained for...},
                            "extra": {...free JSON: training stats, acceptance...},
                            "tensors": {"a/b/c": {"path": ["a", "b", "c"], "shape": [...], "dtype": "..."}}}
    DIR/model.safetensors  the params pytree, one tensor per leaf, named by its path "a/b/c"

The params pytree is nested dicts (string or int keys, as `nnx.to_pure_dict` gives them) of arrays;
the manifest keeps each leaf's exact key path, so int keys come back as ints. `save_drafter` writes the
directory whole or not at all; `load_drafter` checks everything it reads and raises DrafterLoadError
naming the file, what is wrong and what to do (a drafter trained for another target is a
DrafterTargetError, a subclass).

Each family registers a `DrafterKind` (its decode module does it at import); `get_kind` imports the
module of a built-in kind on first use, so loading a directory needs no import by the caller.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from jaxdecode.files import save_whole

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
TENSOR_FILE = "model.safetensors"
MARKER = "jaxdecode_drafter"  # config.json key naming the kind

# Decode modules of the built-in trained kinds, imported on first use (each registers its kind).
BUILTIN_KIND_MODULES = {
    "medusa": "jaxdecode.drafters.medusa",
    "hydra": "jaxdecode.drafters.medusa",
    "eagle3": "jaxdecode.drafters.eagle3",
    "block": "jaxdecode.drafters.block",
    "accept_head": "jaxdecode.drafters.accept_head",
    "kangaroo": "jaxdecode.drafters.selfspec",
    "retrieval": "jaxdecode.drafters.retrieval",
}


class DrafterLoadError(ValueError):
    """A trained-drafter directory that cannot be loaded (missing / corrupt files, unknown kind)."""


class DrafterTargetError(DrafterLoadError):
    """A trained drafter that was trained for a different target model."""


@dataclasses.dataclass(frozen=True)
class DrafterKind:
    """One trained-drafter family, decode side.

    name: the kind's name ("medusa", ...), also the drafter name of make_drafter / generate / the CLI.
    config_cls: a frozen dataclass whose fields are JSON-able (lists come back as tuples).
    make: (params, cfg, target: jaxdecode.Model, tree, temperature, **drafter_options) -> Drafter.
        `tree` is the user's tree option as given (None = the kind's default; see
        jaxdecode.drafters.tree_from_option).
    target_fields: ModelConfig fields that must equal the target's for the weights to fit it.
    param_shapes: optional (cfg, target_config) -> nested dict of shapes (tuples) like the params:
        save and load then check that every tensor is there with that shape, and no other.
    default_options: optional (extra, path) -> drafter options a loaded drafter uses unless the caller
        gives them (an acceptance head: the directory of the drafter it was trained over, as recorded).
    """
    name: str
    config_cls: type
    make: Callable
    target_fields: tuple = ("vocab_size", "hidden_size", "num_layers")
    param_shapes: Callable | None = None
    default_options: Callable | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"a drafter kind's name must be an identifier string, got {self.name!r}")
        if not (dataclasses.is_dataclass(self.config_cls) and isinstance(self.config_cls, type)):
            raise ValueError(f"drafter kind {self.name!r}: config_cls must be a dataclass type, got "
                             f"{self.config_cls!r}")
        if not callable(self.make):
            raise ValueError(f"drafter kind {self.name!r}: make must be callable")
        object.__setattr__(self, "target_fields", tuple(self.target_fields))

    @property
    def takes_draft_model(self) -> bool:
        """Whether `make` takes a draft LM (`draft_model`): generate's and the CLIs' `draft` goes only there."""
        import inspect
        return "draft_model" in inspect.signature(self.make).parameters


_KINDS: dict[str, DrafterKind] = {}
_GENERATION = [0]  # kinds_generation()


def register_kind(kind: DrafterKind, *, replace: bool = False) -> DrafterKind:
    """Make `kind` loadable and buildable by name. Registering another kind under a taken name is an
    error unless replace=True (re-importing the same module re-registers an equal kind: allowed)."""
    old = _KINDS.get(kind.name)
    if old is not None and not replace and (old.config_cls.__qualname__, old.make.__qualname__) != (
            kind.config_cls.__qualname__, kind.make.__qualname__):
        raise ValueError(f"drafter kind {kind.name!r} is already registered ({old.config_cls.__qualname__}); "
                         f"pass replace=True to replace it")
    if old is not None and old is not kind:
        _GENERATION[0] += 1
    _KINDS[kind.name] = kind
    return kind


def unregister_kind(name: str) -> None:
    """Remove a registered kind (tests, plugins)."""
    if _KINDS.pop(name, None) is not None:
        _GENERATION[0] += 1


def kinds_generation() -> int:
    """Moves whenever a registered kind is replaced or removed: drafters built and remembered under an
    older generation were made by a `make` that may no longer be the registered one."""
    return _GENERATION[0]


def kind_names() -> tuple:
    """Every trained kind's name: the built-in ones (loaded or not) and the registered ones."""
    return tuple(dict.fromkeys([*BUILTIN_KIND_MODULES, *_KINDS]))


def is_trained_kind(name) -> bool:
    return isinstance(name, str) and name in kind_names()


def get_kind(name: str) -> DrafterKind:
    """The registered kind `name`, importing a built-in kind's decode module first if needed."""
    if name not in _KINDS and name in BUILTIN_KIND_MODULES:
        module = BUILTIN_KIND_MODULES[name]
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and module.startswith(e.name):  # the module itself, not its imports
                raise DrafterLoadError(f"trained drafter kind {name!r} needs its decode module {module}, "
                                       f"which this jaxdecode installation does not have: upgrade "
                                       f"jaxdecode, or register the kind with "
                                       f"jaxdecode.drafters.trained.register_kind") from None
            raise
        if name not in _KINDS:
            raise DrafterLoadError(f"{module} was imported but did not register drafter kind {name!r} "
                                   f"(register_kind(DrafterKind(name={name!r}, ...)) at import)")
    if name not in _KINDS:
        raise DrafterLoadError(f"unknown trained drafter kind {name!r}; known kinds: "
                               f"{', '.join(kind_names())} (a kind of your own: import the module that "
                               f"calls register_kind first)")
    return _KINDS[name]


def check_options(name: str, make: Callable, options: dict, positional: int = 0, error=ValueError) -> None:
    """The drafter options of `make` (a drafter's constructor function), checked before the call: an
    unknown one is refused with the options it takes, not with Python's TypeError. positional: how
    many leading parameters the caller passes by position (not options; any names). A `make` with
    **kwargs checks its options itself."""
    import inspect
    params = list(inspect.signature(make).parameters.values())
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return
    params = params[positional:]
    takes = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    wrong = sorted(set(options) - set(takes))
    if wrong:
        raise error(f"drafter {name!r} takes no option {', '.join(map(repr, wrong))}; its options: "
                    f"{', '.join(takes) or 'none'}")


@dataclasses.dataclass(frozen=True)
class TrainedDrafter:
    """A loaded trained drafter: its kind, config, params pytree (jax arrays), extra info, directory."""
    kind: DrafterKind
    cfg: Any
    params: Any
    extra: dict
    path: str | None = None
    target: dict | None = None  # the target fields it was trained for (config.json "target")

    @property
    def name(self) -> str:
        return self.kind.name

    def make(self, target, tree=None, temperature: float = 0.0, **drafter_options):
        """The Drafter for `target` (checked against the target this drafter was trained for)."""
        check_target(self, target)
        if self.kind.default_options is not None:
            defaults = self.kind.default_options(self.extra or {}, self.path)
            drafter_options = {**{k: v for k, v in defaults.items() if drafter_options.get(k) is None},
                               **drafter_options}
        # make(params, cfg, target, tree, temperature, **drafter_options)
        check_options(self.name, self.kind.make, drafter_options, positional=5)
        drafter = self.kind.make(self.params, self.cfg, target, tree, temperature, **drafter_options)
        prior = self.acceptance_prior
        declares = dataclasses.is_dataclass(drafter) and "acceptance_prior" in {
            f.name for f in dataclasses.fields(drafter)}
        if prior and declares and not drafter.acceptance_prior:
            drafter = dataclasses.replace(drafter, acceptance_prior=prior)
        return drafter

    @property
    def acceptance_prior(self) -> tuple:
        """The target's acceptance by depth of this drafter's nodes on held-out prompts, as its training
        measured it (greedy verification; `extra["heldout"]["accept_by_depth"]`), or () if not recorded."""
        heldout = (self.extra or {}).get("heldout")
        rates = (heldout.get("accept_by_depth") if isinstance(heldout, dict) else None) or ()
        try:
            rates = tuple(float(a) for a in rates)
        except (TypeError, ValueError):
            return ()
        return rates if all(0.0 <= a <= 1.0 for a in rates) else ()


# ----------------------------------------------------------------------------- pytree <-> flat tensors
def _is_leaf(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def flatten_params(params, where: str = "params", is_leaf=_is_leaf) -> dict:
    """Nested dicts of arrays -> {"a/b/c": (path list, array)}; anything else is a ValueError."""
    out = {}

    def walk(node, path):
        if is_leaf(node):
            if not path:
                raise ValueError(f"{where} must be a dict of arrays (nested dicts allowed), got one array")
            out["/".join(map(str, path))] = (list(path), node)
            return
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)) or (isinstance(k, str) and
                                                                            ("/" in k or not k)):
                    raise ValueError(f"{where}: key {k!r} at {'/'.join(map(str, path)) or 'the top'} must be "
                                     f"a non-empty string without '/' or an int")
                walk(v, path + [k])
            return
        kind = type(node).__name__
        hint = (" (store a sequence as a dict with int keys, as nnx.to_pure_dict does)"
                if isinstance(node, (list, tuple)) else "")
        raise ValueError(f"{where}: the leaf at {'/'.join(map(str, path)) or 'the top'} is a {kind}, not an "
                         f"array: params must be nested dicts of arrays{hint}")

    walk(params, [])
    keys = {}
    for name in out:  # "1" (str) and 1 (int) would both be named "1"
        if name in keys:
            raise ValueError(f"{where}: two leaves are both named {name!r}")
        keys[name] = True
    return out


def unflatten_params(items) -> dict:
    """[(path list, array)] -> nested dicts."""
    root: dict = {}
    for path, value in items:
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return root


def _check_shapes(expected, flat: dict, what: str, fix: str) -> None:
    """Every tensor of `expected` (nested dict of shapes) present in `flat` with that shape, no other."""
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x)  # noqa: E731
    want = {name: shape for name, (_, shape) in flatten_params(expected, "param_shapes", is_shape).items()}
    missing = sorted(set(want) - set(flat))
    unexpected = sorted(set(flat) - set(want))
    if missing or unexpected:
        raise DrafterLoadError(f"{what}: tensors missing {missing or 'none'}, unexpected "
                               f"{unexpected or 'none'} for the kind's config; {fix}")
    for name, shape in want.items():
        got = tuple(flat[name])
        if got != shape:
            raise DrafterLoadError(f"{what}: tensor {name!r} has shape {list(got)} but the config expects "
                                   f"{list(shape)}; {fix}")


# ----------------------------------------------------------------------------- config <-> JSON
def _tuples(x):
    """JSON lists back to tuples (config dataclasses are static, hashable configuration)."""
    if isinstance(x, list):
        return tuple(_tuples(v) for v in x)
    if isinstance(x, dict):
        return {k: _tuples(v) for k, v in x.items()}
    return x


def _target_config(target):
    """A jaxdecode Model or a ModelConfig -> the ModelConfig."""
    return getattr(target, "config", target)


def _target_record(kind: DrafterKind, target_config) -> dict:
    rec = {}
    for f in kind.target_fields:
        if not hasattr(target_config, f):
            raise ValueError(f"drafter kind {kind.name!r} checks target field {f!r}, which "
                             f"{type(target_config).__name__} does not have")
        v = getattr(target_config, f)
        rec[f] = list(v) if isinstance(v, tuple) else v
    # the family too, for kinds that read the target's hidden states: weights trained on one family's
    # states do not fit another's of the same vocab / width / depth (check_target compares it when recorded)
    if "hidden_size" in kind.target_fields:
        rec.setdefault("model_type", getattr(target_config, "model_type", None))
    return rec


# ----------------------------------------------------------------------------- save
def check_out_dir(out_dir) -> None:
    """A clear error, before anything is trained or written, when `out_dir` cannot take a drafter: it is a
    file, or a non-empty directory that is not a drafter directory (a target checkpoint, a home
    directory): saving replaces the directory whole, which would delete what it holds. A drafter
    directory (retraining in place) is fine; files in it besides the drafter's own are kept."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"the output {out} is a file, not a directory: pass a new or a drafter directory")
    if out.is_dir() and any(out.iterdir()) and not _is_drafter_dir(out):
        raise ValueError(f"the output {out} is a non-empty directory that holds no drafter ({CONFIG_FILE} with "
                         f"{MARKER!r}); saving a drafter replaces its directory whole, which would delete what "
                         f"it holds: pass a new directory (or an existing drafter's, to replace it)")


def _is_drafter_dir(path: Path) -> bool:
    try:
        return MARKER in json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def save_drafter(out_dir, kind_name: str, cfg, params, target_config, extra: dict | None = None,
                 dtype: str | None = None) -> Path:
    """Write a trained drafter to `out_dir` (config.json + model.safetensors), whole or not at all.

    `cfg` is an instance of the kind's config_cls, `params` the params pytree (nested dicts of arrays),
    `target_config` the target's ModelConfig (or Model), `extra` free JSON-able info. `dtype` (e.g.
    "bfloat16") stores floating tensors in that type (load_drafter casts them to the target's compute
    dtype); None keeps them as they are. Returns out_dir.
    """
    import jax
    kind = get_kind(kind_name)
    if not isinstance(cfg, kind.config_cls):
        raise ValueError(f"save_drafter({kind_name!r}): cfg must be a {kind.config_cls.__name__}, got "
                         f"{type(cfg).__name__}")
    cfg_dict = dataclasses.asdict(cfg)
    try:
        cfg_json = json.loads(json.dumps(cfg_dict, allow_nan=False))
        extra_json = json.loads(json.dumps(extra or {}, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"save_drafter({kind_name!r}): the config and extra must be JSON-able ({e})") from None
    if kind.config_cls(**_tuples(cfg_json)) != cfg:
        raise ValueError(f"save_drafter({kind_name!r}): {type(cfg).__name__} does not survive a JSON round "
                         f"trip ({cfg_dict} came back as {_tuples(cfg_json)}): use JSON-able field values "
                         f"(numbers, strings, bools, None, tuples, dicts)")
    tcfg = _target_config(target_config)
    flat = flatten_params(params)
    host = {name: np.asarray(jax.device_get(x)) for name, (_, x) in flat.items()}
    if dtype is not None:
        import jax.numpy as jnp
        host = {n: np.asarray(jnp.asarray(a, dtype)) if np.issubdtype(a.dtype, np.floating)
                or a.dtype == jnp.bfloat16 else a for n, a in host.items()}
    if kind.param_shapes is not None:
        _check_shapes(kind.param_shapes(cfg, tcfg), {n: a.shape for n, a in host.items()},
                      f"save_drafter({kind_name!r})", "the params do not fit the config")
    meta = {MARKER: kind.name, "format_version": FORMAT_VERSION, "config": cfg_json,
            "target": _target_record(kind, tcfg), "extra": extra_json,
            "tensors": {name: {"path": path, "shape": list(host[name].shape), "dtype": str(host[name].dtype)}
                        for name, (path, _) in flat.items()}}

    def write(tmp: Path):
        import jax.numpy as jnp
        from safetensors.flax import save_file  # the flax writer handles bfloat16
        save_file({n: jnp.asarray(a) for n, a in host.items()}, str(tmp / TENSOR_FILE),
                  metadata={"format": "jaxdecode_drafter"})
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        old = Path(out_dir)
        if old.is_dir():  # a drafter retrained in place: notes, plots and a card beside it are kept
            for p in old.iterdir():
                if p.name in (CONFIG_FILE, TENSOR_FILE):
                    continue
                (shutil.copytree(p, tmp / p.name, symlinks=True) if p.is_dir() and not p.is_symlink()
                 else shutil.copy2(p, tmp / p.name, follow_symlinks=False))

    check_out_dir(out_dir)
    return save_whole(Path(out_dir), write)


# ----------------------------------------------------------------------------- load
_REDO = "re-save it (save_drafter) or retrain it (jaxdecode train KIND --target DIR --out DIR)"


def read_drafter_config(path) -> dict:
    """config.json of a drafter directory, checked for the format's keys (DrafterLoadError)."""
    from jaxdecode.models.hf import CheckpointError, read_json_object
    path = Path(path)
    if not path.is_dir():
        raise DrafterLoadError(f"drafter directory {path} does not exist or is not a directory: pass the "
                               f"directory save_drafter / `jaxdecode train` wrote")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise DrafterLoadError(f"{file} is missing: {path} is not a trained-drafter directory; {_REDO}")
    try:
        meta = read_json_object(file)
    except CheckpointError as e:
        raise DrafterLoadError(f"{e} (trained-drafter config); {_REDO}") from None
    if not isinstance(meta.get(MARKER), str):
        raise DrafterLoadError(f"{file} has no {MARKER!r} kind name: it is not a trained-drafter config "
                               f"(a model checkpoint? pass it as draft= / --draft instead); {_REDO}")
    version = meta.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise DrafterLoadError(f"{file} has format_version {version!r}; this jaxdecode reads version "
                               f"{FORMAT_VERSION}: upgrade jaxdecode or {_REDO}")
    for key in ("config", "target", "tensors"):
        if not isinstance(meta.get(key), dict):
            raise DrafterLoadError(f"{file} has no {key!r} object; {_REDO}")
    if not isinstance(meta.get("extra", {}), dict):
        raise DrafterLoadError(f"{file}: 'extra' must be an object; {_REDO}")
    for name, info in meta["tensors"].items():
        ok = (isinstance(info, dict) and isinstance(info.get("path"), list) and info["path"]
              and "/".join(map(str, info["path"])) == name and isinstance(info.get("shape"), list))
        if not ok:
            raise DrafterLoadError(f"{file}: the manifest entry of tensor {name!r} is malformed "
                                   f"({info!r}); {_REDO}")
    return meta


def check_target(drafter: TrainedDrafter | dict, target) -> None:
    """DrafterTargetError unless the target's fields equal those the drafter was trained for."""
    if isinstance(drafter, TrainedDrafter):
        kind, record, where = drafter.kind, drafter.target, drafter.path
    else:
        kind, record, where = drafter["kind"], drafter["target"], drafter["path"]
    if record is None:
        return
    tcfg = _target_config(target)
    target_name = getattr(target, "path", None) or "this target"
    fields = tuple(kind.target_fields) + (("model_type",) if "model_type" in record
                                          and "model_type" not in kind.target_fields else ())
    for f in fields:
        want = record.get(f)
        have = getattr(tcfg, f, None)
        have = list(have) if isinstance(have, tuple) else have
        if want != have:
            raise DrafterTargetError(
                f"drafter {where} was trained for a target with {f} {want}, but this target "
                f"({target_name}) has {have} (the {kind.name} drafter's weights only fit a target with "
                f"the same {', '.join(kind.target_fields)}: {record}); load the target it was trained "
                f"for, or train a {kind.name} drafter for this one (jaxdecode train {kind.name} --target "
                f"DIR --out DIR)")


def load_drafter(path, target) -> TrainedDrafter:
    """Load a trained drafter directory for `target` (a jaxdecode Model or its ModelConfig).

    Checks the config, that the target fits (vocab size, hidden size, layer count, ... as the kind
    says), and every tensor against the manifest (and the kind's expected shapes). Raises
    DrafterLoadError (DrafterTargetError for another target) naming the file and the fix.
    """
    from jaxdecode.models.hf import CheckpointError, check_safetensors_file
    path = Path(path)
    meta = read_drafter_config(path)
    cfg_file = path / CONFIG_FILE
    try:
        kind = get_kind(meta[MARKER])
    except DrafterLoadError as e:  # name the file
        raise DrafterLoadError(f"{cfg_file} names drafter kind {meta[MARKER]!r}: {e}") from None
    try:
        cfg = kind.config_cls(**_tuples(meta["config"]))
    except (TypeError, ValueError) as e:
        raise DrafterLoadError(f"{cfg_file}: its 'config' does not fit {kind.name}'s "
                               f"{kind.config_cls.__name__} ({e}); {_REDO}") from None
    missing = [f for f in kind.target_fields if f not in meta["target"]]
    if missing:
        raise DrafterLoadError(f"{cfg_file}: its 'target' lacks {missing}, which kind {kind.name} checks; "
                               f"{_REDO}")
    check_target({"kind": kind, "target": meta["target"], "path": str(path)}, target)

    file = path / TENSOR_FILE
    if not file.is_file():
        raise DrafterLoadError(f"{file} is missing (the drafter's weights); {_REDO}")
    try:
        check_safetensors_file(file)
    except CheckpointError as e:
        raise DrafterLoadError(f"{e} (trained-drafter weights; or {_REDO})") from None
    from safetensors import safe_open
    manifest = meta["tensors"]
    with safe_open(str(file), framework="flax") as sf:
        names = set(sf.keys())
        absent = sorted(set(manifest) - names)
        unknown = sorted(names - set(manifest))
        if absent or unknown:
            raise DrafterLoadError(f"{file} does not match {cfg_file}'s tensor list: missing "
                                   f"{absent or 'none'}, not listed {unknown or 'none'}; {_REDO}")
        items = []
        for name, info in manifest.items():
            x = sf.get_tensor(name)
            if list(x.shape) != list(info["shape"]):
                raise DrafterLoadError(f"{file}: tensor {name!r} has shape {list(x.shape)} but {cfg_file} "
                                       f"lists {info['shape']}; {_REDO}")
            items.append((info["path"], x))
    if kind.param_shapes is not None:
        _check_shapes(kind.param_shapes(cfg, _target_config(target)),
                      {n: tuple(info["shape"]) for n, info in manifest.items()}, str(file), _REDO)
    compute = _compute_dtype(target)
    if compute is not None:  # weights stored narrower (e.g. bf16 on disk) compute as the target does
        items = [(p, x.astype(compute) if jnp.issubdtype(x.dtype, jnp.floating) else x) for p, x in items]
    return TrainedDrafter(kind=kind, cfg=cfg, params=unflatten_params(items), extra=meta.get("extra", {}),
                          path=str(path), target=meta["target"])


def _compute_dtype(target):
    """The dtype a Model's forward computes in (None for a bare ModelConfig): its activations', which a
    target loaded with param_dtype keeps wider than its weight matrices."""
    from jaxdecode.models.transformer import compute_dtype
    params = getattr(target, "params", None)
    return None if params is None else compute_dtype(params)


def find_drafter_dir(target, kind_name: str) -> Path | None:
    """The drafter shipped beside a target: `<target_dir>/drafters/<kind>` when it holds a config.json."""
    tpath = getattr(target, "path", None)
    if not tpath:
        return None
    d = Path(tpath) / "drafters" / kind_name
    return d if (d / CONFIG_FILE).is_file() else None


__all__ = ["DrafterKind", "DrafterLoadError", "DrafterTargetError", "TrainedDrafter", "register_kind",
           "unregister_kind", "get_kind", "kind_names", "is_trained_kind", "save_drafter", "load_drafter",
           "read_drafter_config", "kinds_generation", "check_target", "find_drafter_dir", "flatten_params",
           "unflatten_params", "BUILTIN_KIND_MODULES"]
