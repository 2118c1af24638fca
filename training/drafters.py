"""Training trained drafters (Medusa / Hydra heads, EAGLE-3, block drafters, ...) on a frozen target.

Each family registers a `TrainKind` (its training module does it at import); `get_train_kind` imports
a built-in kind's module on first use. The NNX module's `nnx.Param` state as a pure dict IS the params
pytree the decode side takes (`params_of`), so training and decoding share weights with no conversion.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from flax import nnx

# Training modules of the built-in kinds, imported on first use (each registers its TrainKind).
TRAIN_KIND_MODULES = {
    "medusa": "jaxdecode.training.medusa",
    "hydra": "jaxdecode.training.medusa",
    "eagle3": "jaxdecode.training.eagle3",
    "block": "jaxdecode.training.block",
    "accept_head": "jaxdecode.training.accept_head",
    "kangaroo": "jaxdecode.training.selfspec",
}


class TrainKindError(ValueError):
    """An unknown training kind, or a built-in kind whose training module is not installed."""


@dataclasses.dataclass(frozen=True)
class TrainKind:
    """One trained-drafter family, training side; `name` is its DrafterKind's name.

    module: (cfg, target_config, rngs: nnx.Rngs) -> nnx.Module whose nnx.Param state is the params.
    loss_fn: (module, batch, constants) -> (loss, aux dict of scalars), the trainer's form;
        batch {"tokens": int32[B, T], "mask": [B, T]}, constants {"target": target params}.
    default_config: (target_config, **overrides) -> the kind's config dataclass.
    eval_step: optional (module, batch, constants) -> (loss_sum, weight_sum) for the held-out loss;
        None: the held-out loss is loss_fn's loss weighted by aux["tokens"] (1 per batch without it).
    """
    name: str
    module: Callable
    loss_fn: Callable
    default_config: Callable
    eval_step: Callable | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"a train kind's name must be an identifier string, got {self.name!r}")
        for field in ("module", "loss_fn", "default_config"):
            if not callable(getattr(self, field)):
                raise ValueError(f"train kind {self.name!r}: {field} must be callable")
        if self.eval_step is not None and not callable(self.eval_step):
            raise ValueError(f"train kind {self.name!r}: eval_step must be callable or None")


_TRAIN_KINDS: dict[str, TrainKind] = {}


def register_train_kind(kind: TrainKind, *, replace: bool = True) -> TrainKind:
    """Make `kind` trainable by name (re-registering a name replaces it unless replace=False)."""
    if not replace and kind.name in _TRAIN_KINDS:
        raise ValueError(f"train kind {kind.name!r} is already registered; pass replace=True to replace it")
    _TRAIN_KINDS[kind.name] = kind
    return kind


def unregister_train_kind(name: str) -> None:
    """Remove a registered kind (tests, plugins)."""
    _TRAIN_KINDS.pop(name, None)


def train_kind_names() -> tuple:
    """Every training kind's name: the built-in ones (installed or not) and the registered ones."""
    return tuple(dict.fromkeys([*TRAIN_KIND_MODULES, *_TRAIN_KINDS]))


def get_train_kind(name: str) -> TrainKind:
    """The registered kind `name`, importing a built-in kind's training module first if needed."""
    name = name.replace("-", "_") if isinstance(name, str) else name
    if name not in _TRAIN_KINDS and name in TRAIN_KIND_MODULES:
        module = TRAIN_KIND_MODULES[name]
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and module.startswith(e.name):  # the module itself, not its imports
                raise TrainKindError(f"training kind {name!r} needs its module {module}, which this "
                                     f"installation does not have yet: upgrade jaxdecode, or register "
                                     f"the kind with jaxdecode.training.drafters.register_train_kind"
                                     ) from None
            raise
        if name not in _TRAIN_KINDS:
            raise TrainKindError(f"{module} was imported but did not register training kind {name!r} "
                                 f"(register_train_kind(TrainKind(name={name!r}, ...)) at import)")
    if name not in _TRAIN_KINDS:
        raise TrainKindError(f"unknown training kind {name!r}; known kinds: {', '.join(train_kind_names())}")
    return _TRAIN_KINDS[name]


def params_of(module: nnx.Module):
    """THE params pytree of a drafter module: its nnx.Param state as a pure dict."""
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))
