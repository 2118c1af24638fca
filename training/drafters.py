"""Training trained drafters (Medusa / Hydra heads, EAGLE-3, block drafters, ...) on a frozen target.

Each family registers a `TrainKind` (its training module does it at import); `get_train_kind` imports
a built-in kind's module on first use. The NNX module's `nnx.Param` state as a pure dict IS the params
pytree the decode side takes (`params_of`), so training and decoding share weights with no conversion.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
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
    resolve_overrides: optional (overrides dict, target Model, corpus_dir) -> overrides, for config
        fields whose CLI value is computed from the training text (eagle3: `draft_vocab=M`, an int, ->
        the M most frequent ids of the corpus's training split).
    """
    name: str
    module: Callable
    loss_fn: Callable
    default_config: Callable
    eval_step: Callable | None = None
    resolve_overrides: Callable | None = None

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


# ----------------------------------------------------------------------------- held-out acceptance
def measure_acceptance(target, drafter, prompts, *, new_tokens: int, eos_ids: tuple = ()) -> dict:
    """Acceptance of `drafter` on `prompts` int32[B, P] from a real greedy speculative run of the target.

    tau: committed tokens per verification call over all rows (the bonus counted); accept_by_depth[d]:
    the fraction of row-steps that committed a node at depth d+1 among those that drafted one there.
    No EOS by default, so every row runs the same length and the figure does not depend on where the
    target happens to stop.
    """
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.speculative import speculative_decode
    from jaxdecode.verifiers import get_verifier

    prompts = np.asarray(prompts, np.int32)
    lengths = np.full((prompts.shape[0],), prompts.shape[1], np.int32)
    out = speculative_decode(target.config, target.params, drafter, prompts, lengths,
                             max_new_tokens=new_tokens, verifier=get_verifier("greedy"),
                             sampler=SamplerConfig(temperature=0.0), eos_ids=tuple(eos_ids))
    st = jax.device_get(out.stats)
    calls = int(np.sum(st["verify_calls"]))
    return {"tau": float(np.sum(jax.device_get(out.lengths)) / max(calls, 1)),
            "accept_by_depth": [round(float(a), 6) for a in st["accept_rate_by_depth"]],
            "accept_hist": [int(a) for a in np.sum(st["accept_hist"], axis=0)], "verify_calls": calls}


def heldout_prompts(corpus_dir, count: int, length: int, seed: int = 0) -> np.ndarray:
    """int32[count, length] windows of the corpus's held-out split."""
    from .corpus import Corpus
    from .distill_data import prompt_windows
    return prompt_windows(Corpus.open(corpus_dir).tokens("heldout"), count, length, seed)


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """Held-out evaluation during training: loss batches and real speculative runs."""
    prompts: int = 16  # held-out prompts decoded by the target with the current drafter
    prompt_len: int = 32
    new_tokens: int = 48
    loss_batches: int = 4  # held-out windows for the loss, batches of the training batch size
    tree: str | None = None  # the drafter's tree (None: its kind's default)
    seed: int = 0


# ----------------------------------------------------------------------------- training runs
@dataclasses.dataclass
class DrafterTrainResult:
    out_dir: Path | None
    cfg: Any
    params: Any
    train: Any  # training.trainer.TrainResult
    heldout: list  # the eval records of this call (loss, tau, accept_by_depth per evaluation point)
    plot: Path | None = None  # the training plot written (None: not asked, no metrics, or no matplotlib)


def _load_target(target):
    from jaxdecode.model import Model, load
    return target if isinstance(target, Model) else load(target, dtype="float32")


def _loss_eval_step(loss_fn):
    """The trainer's eval form from a loss: (loss x tokens, tokens), or (loss, 1) without aux tokens."""
    def eval_step(module, batch, constants):
        loss, aux = loss_fn(module, batch, constants)
        n = aux.get("tokens", 1.0) if isinstance(aux, dict) else 1.0
        return loss * n, n
    return eval_step


def _data_batches(data, corpus_dir, target, workdir, *, batch_size, seq_len, seed, distill, progress):
    """(batches(step), data record for the run identity and the export) of --data corpus|self|mix."""
    from .corpus import Corpus
    from .distill_data import DATA_MODES, make_batches, self_distill_data
    if target.tokenizer is not None:  # the corpus must speak the target's vocabulary
        Corpus.open(corpus_dir).check_tokenizer(target.tokenizer)
    if data not in DATA_MODES:
        raise ValueError(f"unknown data {data!r}; choose one of {', '.join(DATA_MODES)}")
    shard, info = None, {"data": data}
    if data != "corpus":
        if distill.seq_len != seq_len:
            distill = dataclasses.replace(distill, new_tokens=seq_len - distill.prompt_len)
        shard = self_distill_data(target, corpus_dir, Path(workdir) / "data", distill, progress=progress)
        info["self"] = json.loads((shard.parent / "manifest.json").read_text())["key"]
    return make_batches(data, corpus_dir, batch_size=batch_size, seq_len=seq_len, seed=seed, shard=shard), info


def check_config_overrides(kind: str, overrides: dict | None, flag: str = "config_overrides") -> None:
    """A clear error for a field the kind's config does not have (a typo in `--set`), before anything
    loads or trains."""
    from jaxdecode.drafters.trained import get_kind
    fields = sorted(f.name for f in dataclasses.fields(get_kind(kind).config_cls))
    unknown = sorted(set(overrides or {}) - set(fields))
    if unknown:
        raise ValueError(f"{flag}: the {kind} drafter's config has no field(s) {unknown}; its fields: "
                         f"{', '.join(fields)}")


def check_drafter_options(kind: str, options: dict | None, flag: str = "drafter_options") -> None:
    """A clear error for drafter options the kind's `make` does not take (e.g. a draft model given to a
    kind that drafts without one), before anything loads or trains."""
    import inspect

    from jaxdecode.drafters.trained import get_kind
    params = inspect.signature(get_kind(kind).make).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(options or {}) - set(list(params)[5:]))  # after (params, cfg, target, tree, temperature)
    if unknown:
        raise ValueError(f"{flag}: the {kind} drafter does not take {unknown} (it takes "
                         f"{list(params)[5:] or 'no options'})")


def train_drafter(kind: str, target, corpus_dir, out_dir=None, *, train_config, data: str = "corpus",
                  batch_size: int = 16, seq_len: int = 96, workdir=None, config_overrides: dict | None = None,
                  distill=None, eval_options: EvalOptions = EvalOptions(), drafter_options: dict | None = None,
                  plot: bool = True, export_dtype: str | None = None) -> DrafterTrainResult:
    """Train a drafter of a registered kind on a frozen target; export it with save_drafter to out_dir.

    target: a jaxdecode.Model or its directory. corpus_dir: a corpus tokenized with the target's
    tokenizer (training windows, self-distillation prompts, held-out loss and prompts). data: corpus |
    self | mix (training.distill_data). Every evaluation point logs the held-out loss and the drafter's
    acceptance (tau, by depth) from real greedy speculative runs to workdir/metrics.jsonl; rerunning
    resumes exactly from workdir's last checkpoint. drafter_options go to the decode kind's make (e.g.
    draft_model=Model for kinds that draft with a draft LM).
    """
    from flax import nnx as _nnx

    from jaxdecode.drafters.trained import get_kind, save_drafter

    from .distill_data import CorpusBatches, DistillOptions
    from .trainer import train

    tk = get_train_kind(kind)
    dk = get_kind(tk.name)
    check_config_overrides(tk.name, config_overrides)
    check_drafter_options(tk.name, drafter_options)
    target = _load_target(target)
    if seq_len > target.config.max_position_embeddings:
        raise ValueError(f"seq_len={seq_len} exceeds the target's max_position_embeddings "
                         f"{target.config.max_position_embeddings}")
    workdir = Path(workdir) if workdir is not None else Path(out_dir).with_name(Path(out_dir).name + ".train")
    overrides = dict(config_overrides or {})
    if tk.resolve_overrides is not None:
        overrides = tk.resolve_overrides(overrides, target, corpus_dir)
    if "context_window" in {f.name for f in dataclasses.fields(dk.config_cls)} and "context_window" not in overrides:
        overrides["context_window"] = seq_len  # decode within the distances training sees (BlockConfig)
    cfg = tk.default_config(target.config, **overrides)
    module = tk.module(cfg, target.config, _nnx.Rngs(train_config.seed))
    options = dict(drafter_options or {})
    # The held-out runs' drafter, built once before training: a tree it cannot draw fails now, not at
    # the first evaluation after minutes of training.
    dk.make(jax.device_get(params_of(module)), cfg, target, eval_options.tree, 0.0, **options)
    batches, data_info = _data_batches(data, corpus_dir, target, workdir, batch_size=batch_size,
                                       seq_len=seq_len, seed=train_config.seed,
                                       distill=distill or DistillOptions(seed=train_config.seed),
                                       progress=train_config.progress)
    from .corpus import Corpus
    held = CorpusBatches(Corpus.open(corpus_dir).tokens("heldout"), batch_size, seq_len, eval_options.seed + 1)
    eval_set = [held(i) for i in range(eval_options.loss_batches)]
    prompts = heldout_prompts(corpus_dir, eval_options.prompts, eval_options.prompt_len, eval_options.seed)

    def on_eval(mod, step):
        # on the host: the trainer's copy is laid out on its data mesh, the target's params are not
        drafter = dk.make(jax.device_get(params_of(mod)), cfg, target, eval_options.tree, 0.0, **options)
        return measure_acceptance(target, drafter, prompts, new_tokens=eval_options.new_tokens)

    run_info = {"kind": tk.name, "cfg": _jsonable(dataclasses.asdict(cfg)),
                "target": _target_id(target), **data_info, "batch_size": batch_size, "seq_len": seq_len}
    result = train(module, tk.loss_fn, batches, train_config, workdir,
                   eval_step=tk.eval_step or _loss_eval_step(tk.loss_fn), eval_batches=lambda: eval_set,
                   constants={"target": target.params}, run_info=run_info, on_eval=on_eval)
    params = params_of(result.module)
    # The whole run's log (a resumed run's history holds only its own steps).
    metrics = read_metrics_file(workdir / "metrics.jsonl")
    heldout = [r for r in metrics if "tau" in r] or [r for r in result.history if "tau" in r]
    # The drafter is exported first: an optional plot that fails (no matplotlib) must not lose it.
    if out_dir is not None:
        last = heldout[-1] if heldout else {}
        save_drafter(out_dir, tk.name, cfg, params, target.config,
                     extra={"trained_steps": result.step, "data": data_info, "batch_size": batch_size,
                            "seq_len": seq_len, "heldout": {k: last[k] for k in ("eval_loss", "tau",
                                                                               "accept_by_depth") if k in last},
                            "heldout_step": last.get("step")},
                     dtype=export_dtype)
    plot_path = plot_training(metrics, workdir / "training.png", title=f"{tk.name} drafter") if plot else None
    return DrafterTrainResult(out_dir=Path(out_dir) if out_dir is not None else None, cfg=cfg, params=params,
                              train=result, heldout=heldout, plot=plot_path)


def train_draft_lm(target, corpus_dir, out_dir=None, *, train_config, data: str = "self", size: str = "draft",
                   batch_size: int = 8, seq_len: int = 96, workdir=None, distill=None,
                   logit_distill: bool = False, distill_temperature: float = 1.0, distill_alpha: float = 1.0,
                   eval_options: EvalOptions = EvalOptions(), plot: bool = True):
    """A draft LM (the train_lm path, model size `size`) on corpus windows, the target's own
    continuations (data="self": on-policy) or both; logit_distill adds DistillLoss with the target as
    teacher. Every evaluation point logs the held-out loss and tau of DraftLM(the current params) with
    the target; the model is exported as an HF directory (tokenizer: the target's) to out_dir."""
    from jaxdecode.drafters import DraftLM, tree_from_option

    from .distill_data import DistillOptions, lm_batches
    from .lm import LMTrainSpec, model_config, train_lm
    from .tokenizer import eos_id

    target = _load_target(target)
    if target.path is None or target.tokenizer is None:
        raise ValueError("train_draft_lm needs a target loaded from a directory with its tokenizer "
                         "(the draft LM shares it): pass the directory")
    workdir = Path(workdir) if workdir is not None else Path(out_dir).with_name(Path(out_dir).name + ".train")
    batches, data_info = _data_batches(data, corpus_dir, target, workdir, batch_size=batch_size,
                                       seq_len=seq_len, seed=train_config.seed,
                                       distill=distill or DistillOptions(seed=train_config.seed),
                                       progress=train_config.progress)
    config = model_config(size, target.config.vocab_size, target.config.max_position_embeddings,
                          eos_id(target.tokenizer))
    spec = LMTrainSpec(batch_size=batch_size, seq_len=seq_len - 1, eval_batch_size=batch_size,
                       eval_max_batches=eval_options.loss_batches, distill_temperature=distill_temperature,
                       distill_alpha=distill_alpha)
    prompts = heldout_prompts(corpus_dir, eval_options.prompts, eval_options.prompt_len, eval_options.seed)
    builder = tree_from_option(eval_options.tree, "chain:4", 0.0)

    def on_eval(mod, step):
        drafter = DraftLM(params=jax.device_get(mod.raw_params()), config=mod.config, builder=builder)
        return measure_acceptance(target, drafter, prompts, new_tokens=eval_options.new_tokens)

    result = train_lm(corpus_dir, target.path, config, train_config, Path(workdir) / "run", spec=spec,
                      teacher_dir=target.path if logit_distill else None, export_dir=out_dir,
                      batches=lm_batches(batches), data_info=json.dumps({**data_info, "target": _target_id(target)},
                                                                        sort_keys=True),
                      on_eval=on_eval)
    # train_lm has exported the model (export_dir) before this optional plot
    plot_path = (plot_training(read_metrics_file(Path(workdir) / "run" / "metrics.jsonl"),
                               Path(workdir) / "training.png", title=f"draft LM ({size}, data={data})")
                 if plot else None)
    return DrafterTrainResult(out_dir=Path(out_dir) if out_dir is not None else None, cfg=config,
                              params=result.module.raw_params(), train=result,
                              heldout=[r for r in result.history if "tau" in r], plot=plot_path)


def _jsonable(x):
    return json.loads(json.dumps(x, default=lambda o: list(o) if isinstance(o, tuple) else str(o)))


def _target_id(target) -> str:
    from .distill_data import target_fingerprint
    return target_fingerprint(target)


def read_metrics_file(path) -> list[dict]:
    from .trainer import read_metrics
    return read_metrics(path) if Path(path).exists() else []


# ----------------------------------------------------------------------------- plot
def pyplot(path=None):
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed (it is optional:
    a plot is then skipped with one line on stderr naming `path`, and training goes on)."""
    try:
        import matplotlib
    except ImportError:
        what = f"the plot {path}" if path is not None else "the plot"
        print(f"warning: matplotlib is not installed: skipped {what} (`pip install matplotlib` makes it)",
              file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_loss(ax, metrics: list[dict], title: str) -> None:
    """Train loss (thin) and held-out loss (dots) over steps on one matplotlib axis."""
    tr = [(m["step"], m["loss"]) for m in metrics if "loss" in m]
    ev = [(m["step"], m["eval_loss"]) for m in metrics if "eval_loss" in m]
    if tr:
        ax.plot(*zip(*tr), color="tab:blue", alpha=0.35, lw=1, label="train")
    if ev:
        ax.plot(*zip(*ev), "o-", color="tab:blue", lw=2, ms=3, label="held-out")
    ax.set(xlabel="step", ylabel="loss", title=f"{title}: loss")
    ax.legend()


def plot_training(metrics: list[dict], path, title: str = "drafter") -> Path | None:
    """Loss (train, held-out), tau and acceptance by depth over training steps, one figure. Returns its
    path, or None when there is nothing to plot or matplotlib is not installed (skipped with a warning)."""
    if not metrics:
        return None
    plt = pyplot(path)
    if plt is None:
        return None
    fig, (ax_l, ax_t, ax_d) = plt.subplots(1, 3, figsize=(14, 4))
    plot_loss(ax_l, metrics, title)
    acc = [m for m in metrics if "tau" in m]
    if acc:
        ax_t.plot([m["step"] for m in acc], [m["tau"] for m in acc], "o-", color="tab:green", lw=2, ms=3)
        depth = max(len(m["accept_by_depth"]) for m in acc)
        cmap = plt.get_cmap("viridis")
        for d in range(depth):
            pts = [(m["step"], m["accept_by_depth"][d]) for m in acc if d < len(m["accept_by_depth"])]
            ax_d.plot(*zip(*pts), "o-", ms=3, color=cmap(d / max(depth - 1, 1)), label=f"depth {d + 1}")
        ax_d.legend(fontsize=8)
    ax_t.set(xlabel="step", ylabel="tokens per target call", title="tau (held-out, greedy)")
    ax_d.set(xlabel="step", ylabel="acceptance rate", title="acceptance by depth", ylim=(0, 1.02))
    for ax in (ax_l, ax_t, ax_d):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
