"""A general training loop for Flax NNX modules: jit step, AdamW + schedule, eval, logs, checkpoints.

    result = train(module, loss_fn, batches, config, workdir, eval_step=..., eval_batches=...)

- `loss_fn(module, batch, constants) -> (loss, aux)`: aux is a dict of scalars (an optional
  "tokens" entry drives the tokens/s figure). Gradients are taken w.r.t. the module's `nnx.Param`s.
- `batches(step) -> batch` (a dict of numpy arrays): a pure function of the step, so a resumed run
  sees exactly the batches of an uninterrupted one.
- `eval_step(module, batch, constants) -> (loss_sum, weight_sum)`; the logged held-out loss is
  sum(loss_sum) / sum(weight_sum) over `eval_batches()`.
- `constants`: a pytree passed to every step un-differentiated (e.g. a teacher's params for
  distillation); it is an argument, not a closure, so it is not baked into the compiled program.

The module and its optimizer are split once (`nnx.split`) and the step is a `jax.jit` over the
state pytree (donated), which is also exactly what is checkpointed: params, AdamW moments, the step
count and any RNG state the module holds. The data position is the step itself.

Checkpoints go through an orbax `CheckpointManager` (keeps the last N; each save is written to a
temporary directory and renamed when complete, so a crash during a save leaves the previous one
intact). A kept step that cannot be restored (damaged on disk) is skipped with a warning for the
newest one that can; training moves the bad steps to `corrupt-checkpoints/` and goes on from there.
`metrics.jsonl` is cut back to the restored step on resume, so the log of a resumed run is the log
of an uninterrupted one.

Resuming needs the options that shaped the checkpoint (`TrainConfig.resume_key` and the caller's
`run_info`); a change is refused naming the option. `steps` is not one of them: the learning-rate
schedule's length (`schedule_steps`) is fixed by the run's first call, so a finished run can be
extended by a larger `steps`, the extra steps running at the schedule's final learning rate.

Data parallelism: the batch is sharded over the `data` axis of a (`data`, `model`) mesh; with
`fsdp=True` every parameter and optimizer moment is also sharded over `data` along its largest
divisible axis (XLA inserts the all-gathers). The `model` axis is left for tensor-parallel
decoding; training replicates over it.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import jax
import numpy as np
import optax
from flax import nnx


class TrainConfigError(ValueError):
    """Training options that cannot work together."""


class ResumeMismatchError(TrainConfigError):
    """A work directory holds a checkpoint written with other options. `changes`: (key, old, new)."""

    def __init__(self, workdir, changes: list[tuple[str, Any, Any]], names: dict[str, str] | None = None):
        self.workdir, self.changes = workdir, changes
        names = names or {}

        def key(k):
            return f"{names[k]} ({k})" if k in names else k

        def shown(v):  # a whole section set on one side only: not its contents
            return "set" if isinstance(v, dict) else "unset" if v is None else repr(v)
        (k0, old, new), rest = changes[0], changes[1:]
        more = f" (and {len(rest)} more: {', '.join(key(k) for k, _, _ in rest)})" if rest else ""
        where = "--workdir" if names else "work directory"
        super().__init__(f"{workdir} holds a checkpoint of a different run: {key(k0)} was {shown(old)}, now "
                         f"{shown(new)}{more}; rerun with the same options to resume it, or use a new "
                         f"{where} to start another run")

    def renamed(self, names: dict[str, str]) -> "ResumeMismatchError":
        """The same error with the keys also given by the caller's names for them (CLI flags)."""
        return ResumeMismatchError(self.workdir, self.changes, names)


class CheckpointCorruptError(ValueError):
    """A checkpoint directory exists but cannot be restored. `reason`: why, in a few words."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


class CheckpointFallbackWarning(UserWarning):
    """The newest kept checkpoint could not be restored; an older kept one was used."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000  # train until this step
    learning_rate: float = 1e-3
    end_lr_ratio: float = 0.1  # cosine decays to learning_rate * end_lr_ratio at the schedule's end
    # Length of the warmup + cosine schedule; None: `steps` (when resuming: the checkpoint's). Steps
    # beyond it run at learning_rate * end_lr_ratio.
    schedule_steps: int | None = None
    warmup_steps: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200  # 0: only at the end
    checkpoint_every: int = 200  # 0: only at the end
    keep_checkpoints: int = 3
    data_parallel: int | None = None  # devices on the `data` axis; None: all devices
    fsdp: bool = False
    progress: bool = True

    def __post_init__(self):
        if self.steps < 1:
            raise TrainConfigError(f"steps must be >= 1, got {self.steps}")
        if self.schedule_steps is not None and self.schedule_steps < 1:
            raise TrainConfigError(f"schedule_steps must be >= 1 (or None: steps), got {self.schedule_steps}")
        if self.warmup_steps < 0 or self.warmup_steps >= max(self.horizon, 2):
            raise TrainConfigError(f"warmup_steps must be in [0, steps), got {self.warmup_steps} "
                                   f"with {'schedule_steps' if self.schedule_steps else 'steps'}="
                                   f"{self.horizon}")
        if self.learning_rate <= 0:
            raise TrainConfigError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.keep_checkpoints < 1:
            raise TrainConfigError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")

    @property
    def horizon(self) -> int:
        """The schedule's length in steps."""
        return self.schedule_steps or self.steps

    def resume_key(self) -> dict:
        """The options a resumed run must share with the run that wrote the checkpoint.

        Not `steps` (a run may be extended) and not the device layout (`data_parallel`, `fsdp`: a
        checkpoint restores onto any mesh); the schedule's length is in it as `schedule_steps`.
        """
        d = dataclasses.asdict(self)
        for k in ("progress", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "steps",
                  "data_parallel", "fsdp"):
            d.pop(k)
        d["schedule_steps"] = self.horizon
        return d


def _current_identity_form(identity):
    """A checkpoint identity written before `schedule_steps` existed, in today's form."""
    if not isinstance(identity, dict) or not isinstance(identity.get("train"), dict):
        return identity
    t = dict(identity["train"])
    if "schedule_steps" not in t and "steps" in t:
        t["schedule_steps"] = t.pop("steps")
    for k in ("data_parallel", "fsdp"):
        t.pop(k, None)
    return {**identity, "train": t}


def identity_changes(old, new) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) of every leaf that differs, in the new identity's order. A
    section only one side has (run.self when --data changed from self to corpus) is one change, its
    absent side None, not one per leaf: the user changed one option, not eleven."""
    a, b = json.loads(json.dumps(old)), json.loads(json.dumps(new))
    out = []

    def walk(x, y, prefix):
        if isinstance(x, dict) and isinstance(y, dict):
            for k in list(y) + [k for k in x if k not in y]:
                walk(x.get(k), y.get(k), f"{prefix}{k}.")
        elif x != y:
            out.append((prefix[:-1], x, y))
    walk(a, b, "")
    return out


@dataclasses.dataclass
class TrainResult:
    module: Any
    step: int
    resumed_from: int | None
    history: list[dict]  # every record written to metrics.jsonl by this call
    eval_loss: float | None


# ----------------------------------------------------------------------------- optimizer
def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0, then cosine decay to learning_rate * end_lr_ratio at `config.horizon`,
    constant after it (optax's cosine holds its end value)."""
    return optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, config.warmup_steps, max(config.horizon, config.warmup_steps + 1),
        end_value=config.learning_rate * config.end_lr_ratio)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW; weight decay on matrices only (not norms or biases).

    Memoised on the optimizer's options: the transformation is part of the jitted step's static
    graph definition, so equal options must give the same object to reuse the compiled step.
    """
    return _optimizer(dataclasses.replace(config, steps=config.horizon, schedule_steps=None,
                                          progress=False, log_every=1, eval_every=0,
                                          checkpoint_every=0, keep_checkpoints=1,
                                          data_parallel=None, fsdp=False, seed=0))


@functools.lru_cache(maxsize=64)
def _optimizer(config: TrainConfig) -> optax.GradientTransformation:
    def decay_mask(params):
        return jax.tree.map(lambda p: len(getattr(p, "shape", ())) >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2,
                    weight_decay=config.weight_decay, mask=decay_mask))


# ----------------------------------------------------------------------------- mesh
def make_mesh(data: int | None = None, model: int = 1) -> jax.sharding.Mesh:
    n = jax.device_count()
    data = n // model if data is None else data
    if data < 1 or model < 1 or data * model > n:
        raise TrainConfigError(f"a ({data} data x {model} model) mesh needs {data * model} devices; "
                               f"{n} are available")
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((data, model), ("data", "model"), axis_types=auto,
                         devices=jax.devices()[: data * model])


def state_shardings(state, mesh, fsdp: bool):
    """Replicated leaves, or (FSDP) each leaf sharded over `data` on its largest divisible axis."""
    P, NS = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    n = mesh.shape["data"]

    def spec(x):
        shape = getattr(x, "shape", ())
        if not fsdp or n == 1 or not shape:
            return NS(mesh, P())
        axes = [i for i in np.argsort(shape)[::-1] if shape[i] % n == 0 and shape[i] >= n]
        if not axes:
            return NS(mesh, P())
        parts = [None] * len(shape)
        parts[axes[0]] = "data"
        return NS(mesh, P(*parts))
    return jax.tree.map(spec, state)


def batch_sharding(mesh):
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))


# ----------------------------------------------------------------------------- checkpoints
def checkpoint_manager(directory, keep: int, read_only: bool = False):
    import orbax.checkpoint as ocp
    directory = Path(directory).absolute()
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only, read_only=read_only,
                                        enable_async_checkpointing=False)
    return ocp.CheckpointManager(directory, options=opts)


def save_checkpoint(manager, step: int, state, meta: dict) -> None:
    import orbax.checkpoint as ocp
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               meta=ocp.args.JsonSave(meta)), force=True)
    manager.wait_until_finished()


def restore_checkpoint(manager, step: int, abstract_state):
    """(state, meta) of a saved step; a damaged checkpoint is a CheckpointCorruptError."""
    import orbax.checkpoint as ocp
    step_dir = Path(manager.directory) / str(step)
    advice = ("delete that step directory to resume from the previous checkpoint, or start over in a "
              "new work directory")
    try:
        out = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        state, meta = out["state"], out["meta"]
    except Exception as e:  # orbax raises many types (FileNotFoundError, ValueError, tensorstore)
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        raise CheckpointCorruptError(f"checkpoint {step_dir} is corrupt or incomplete and cannot be "
                                     f"restored ({why}); {advice}", reason=why) from None
    if meta is None or not isinstance(meta, dict) or "step" not in meta:
        raise CheckpointCorruptError(f"checkpoint {step_dir} has no readable metadata; {advice}",
                                     reason="no readable metadata")
    return state, meta


def newest_meta(manager) -> dict | None:
    """The metadata of the newest kept step, or None (no step, or its metadata does not read: the
    state restore then reports it)."""
    import orbax.checkpoint as ocp
    steps = sorted(manager.all_steps(), reverse=True)
    if not steps:
        return None
    try:
        meta = manager.restore(steps[0], args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception:  # orbax raises many types; a damaged step is restore_newest's to report
        return None
    return meta if isinstance(meta, dict) else None


def restore_newest(manager, abstract_state):
    """(state, meta, step, bad) of the newest kept step that restores, or None when none is kept.

    `bad`: [(step, why)] of the newer kept steps that could not be restored (newest first). When no
    kept step restores, a CheckpointCorruptError names each one and why.
    """
    steps = sorted(manager.all_steps(), reverse=True)
    bad = []
    for step in steps:
        try:
            state, meta = restore_checkpoint(manager, step, abstract_state)
        except CheckpointCorruptError as e:
            bad.append((step, e.reason))
            continue
        return state, meta, step, bad
    if not bad:
        return None
    listed = ", ".join(f"step {st} ({why})" for st, why in bad)
    raise CheckpointCorruptError(
        f"no kept checkpoint in {manager.directory} can be restored: {listed}; delete the damaged step "
        f"directories to start over, or use a new work directory", reason="no kept step restores")


def _warn_fallback(ckpt_dir, bad, step, moved: dict | None = None):
    for st, why in bad:
        where = f"; moved to {moved[st]}" if moved else ""
        warnings.warn(f"checkpoint step {st} in {ckpt_dir} cannot be restored ({why}); using step {step}"
                      f"{where}", CheckpointFallbackWarning, stacklevel=3)


def _set_aside(ckpt_dir: Path, aside: Path, bad, step: int, keep: int):
    """Move the unrestorable steps `bad` from `ckpt_dir` to `aside` (kept for inspection, out of the
    manager's sight), warn, and return a manager that sees the remaining steps."""
    aside.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    moved = {st: aside / f"{st}-{stamp}" for st, _ in bad}
    _warn_fallback(ckpt_dir, bad, step, moved)
    for st, dest in moved.items():
        shutil.move(str(ckpt_dir / str(st)), str(dest))
    return checkpoint_manager(ckpt_dir, keep)


def restore_latest(module: nnx.Module, config: TrainConfig, workdir, step: int | None = None):
    """(module with the params of a checkpoint in `workdir`, its step); default: the newest kept
    step that restores (older ones are tried, with a CheckpointFallbackWarning, when newer ones are
    damaged).

    Safe while the run that writes the checkpoints is still going (read-only manager). `config`
    only shapes the optimizer state to read; its schedule values do not matter.
    """
    optimizer = nnx.Optimizer(module, make_optimizer(config), wrt=nnx.Param)
    graphdef, state = nnx.split((module, optimizer))
    ckpt_dir = Path(workdir) / "checkpoints"
    if not ckpt_dir.is_dir():
        raise CheckpointCorruptError(f"{workdir} has no checkpoints/ directory: nothing to restore")
    manager = checkpoint_manager(ckpt_dir, config.keep_checkpoints, read_only=True)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    try:
        if step is not None:
            state, _ = restore_checkpoint(manager, step, abstract)
        else:
            found = restore_newest(manager, abstract)
            if found is None:
                raise CheckpointCorruptError(f"{ckpt_dir} holds no complete checkpoint")
            state, _, step, bad = found
            _warn_fallback(ckpt_dir, bad, step)
    finally:
        manager.close()
    module, _ = nnx.merge(graphdef, state)
    return module, step


# ----------------------------------------------------------------------------- metrics log
class MetricsLog:
    """Append-only JSONL, cut back to a step on resume."""

    def __init__(self, path, resume_step: int | None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        keep = []
        if resume_step is not None and self.path.exists():
            with open(self.path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line torn by a kill mid-write
                    if rec.get("step", 0) <= resume_step:
                        keep.append(rec)
        with open(self.path, "w") as f:
            for rec in keep:
                f.write(json.dumps(rec) + "\n")

    def write(self, record: dict):
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------- the loop
# One compiled step per (module structure, loss, mesh, FSDP): runs of the same model and loss reuse
# it (tests, resumes). The output shardings are pinned to the input ones so that every step, before
# and after a resume, runs the very same executable (bit-identical resumes).
_STEP_CACHE: dict = {}


def _train_step_fn(graphdef, loss_fn, mesh, fsdp: bool, shardings, replicated):
    key = (graphdef, loss_fn, mesh, fsdp)
    if key not in _STEP_CACHE:
        def step(state, batch, constants):
            module, optimizer = nnx.merge(graphdef, state)
            (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(module, batch, constants)
            metrics = {**aux, "loss": loss, "grad_norm": optax.global_norm(grads)}
            optimizer.update(module, grads)
            return nnx.state((module, optimizer)), metrics
        _STEP_CACHE[key] = jax.jit(step, donate_argnums=(0,), out_shardings=(shardings, replicated))
    return _STEP_CACHE[key]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _eval_step(module_graphdef, eval_step, module_state, batch, constants):
    return eval_step(nnx.merge(module_graphdef, module_state), batch, constants)


def train(module: nnx.Module, loss_fn: Callable, batches: Callable[[int], dict], config: TrainConfig,
          workdir, *, eval_step: Callable | None = None,
          eval_batches: Callable[[], Iterable[dict]] | None = None, constants=None,
          run_info: dict | None = None,
          on_eval: Callable[[nnx.Module, int], dict] | None = None) -> TrainResult:
    """Train `module` for `config.steps` optimizer steps, resuming from `workdir` if it holds a
    checkpoint; `result.module` is the trained module (the one passed in is left as it was).

    on_eval(module, step) -> dict of JSON-able figures: run at every evaluation point (with or without
    an eval_step) and merged into that step's eval record in metrics.jsonl (e.g. a drafter's
    acceptance from real decoding runs)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    def split(cfg):  # the optimizer's schedule lives in the graphdef; the state's layout is the same
        return nnx.split((module, nnx.Optimizer(module, make_optimizer(cfg), wrt=nnx.Param)))
    graphdef, state = split(config)

    mesh = make_mesh(config.data_parallel)
    shardings = state_shardings(state, mesh, config.fsdp)
    state = jax.device_put(state, shardings)
    bsharding = batch_sharding(mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    constants = None if constants is None else jax.device_put(constants, replicated)

    ckpt_dir = workdir / "checkpoints"
    manager = checkpoint_manager(ckpt_dir, config.keep_checkpoints)
    start, resumed_from = 0, None
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)

    def resumed_config(meta):
        """The config a resume from `meta`'s step runs with; a ResumeMismatchError if the run changed."""
        old = _current_identity_form(meta.get("identity"))
        cfg = config
        if cfg.schedule_steps is None and isinstance(old, dict):
            # another `steps` (a longer run) keeps the schedule the run started with
            horizon = old.get("train", {}).get("schedule_steps")
            if isinstance(horizon, int) and horizon > cfg.warmup_steps:
                cfg = dataclasses.replace(cfg, schedule_steps=horizon)
        changes = identity_changes(old, {"train": cfg.resume_key(), "run": run_info or {}})
        if changes:
            raise ResumeMismatchError(workdir, changes)
        return cfg

    try:
        # The run's identity first, from the newest step's metadata alone: an option that changes the
        # parameters' shapes is a changed option (named), not a checkpoint that fails to restore.
        newest = newest_meta(manager)
        if newest is not None:
            resumed_config(newest)
        found = restore_newest(manager, abstract)
        if found is not None:
            state, meta, step, bad = found
            if bad:  # out of the way, so that this run can write those steps again
                manager.close()
                manager = _set_aside(ckpt_dir, workdir / "corrupt-checkpoints", bad, step,
                                     config.keep_checkpoints)
            config = resumed_config(meta)
            graphdef, _ = split(config)
            start = resumed_from = int(meta["step"])
            todo = "" if start < config.steps else ": nothing to train"
            print(f"resuming from step {start} (of {config.steps}){todo} in {workdir}", file=sys.stderr)
    except BaseException:
        manager.close()
        raise
    identity = {"train": config.resume_key(), "run": run_info or {}}
    schedule = learning_rate_schedule(config)
    log = MetricsLog(workdir / "metrics.jsonl", resumed_from if resumed_from is not None else -1)

    step_fn = _train_step_fn(graphdef, loss_fn, mesh, config.fsdp, shardings, replicated)
    eval_fn = None
    if eval_step is not None and eval_batches is not None:
        # the module alone (not the optimizer), so runs with other schedules share the compile
        eval_fn = functools.partial(_eval_step, nnx.graphdef(module), eval_step)

    def evaluate(state):
        tot, wt = 0.0, 0.0
        for b in eval_batches():
            ls, ws = eval_fn(state[0], jax.device_put(b, bsharding), constants)
            tot += float(ls)
            wt += float(ws)
        return tot / max(wt, 1e-9)

    history: list[dict] = []

    def record(rec):
        log.write(rec)
        history.append(rec)

    def checkpoint(step, state):
        save_checkpoint(manager, step, state, {"step": step, "identity": identity,
                                               "time": time.time()})

    bar = None
    if config.progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=config.steps, initial=start, desc="train", dynamic_ncols=True)
    eval_loss = None
    t_last = time.perf_counter()
    pending: list = []

    def flush_logs(done):
        nonlocal pending, t_last
        if not pending:
            return
        fetched = jax.device_get(pending)  # one host sync per log interval
        pending = []
        now = time.perf_counter()
        dt = max(now - t_last, 1e-9)
        t_last = now
        toks = float(sum(m.get("tokens", 0.0) for m in fetched))
        last = fetched[-1]
        rec = {"step": done, "loss": float(np.mean([m["loss"] for m in fetched])),
               "grad_norm": float(last["grad_norm"]), "lr": float(schedule(done - 1)),
               "steps_per_s": len(fetched) / dt}
        if toks:
            rec["tokens_per_s"] = toks / dt
        rec.update({k: float(v) for k, v in last.items() if k not in ("loss", "grad_norm", "tokens")})
        record(rec)
        if bar is not None:
            post = {"loss": f"{rec['loss']:.3f}"}
            if toks:
                post["tok/s"] = f"{rec['tokens_per_s']:.0f}"
            bar.set_postfix(post)
            bar.update(len(fetched))

    try:
        for step in range(start, config.steps):
            batch = jax.device_put(batches(step), bsharding)
            state, metrics = step_fn(state, batch, constants)
            pending.append(metrics)
            done = step + 1
            last_step = done == config.steps
            evaluate_now = (eval_fn is not None or on_eval is not None) and (
                last_step or (config.eval_every and done % config.eval_every == 0))
            save_now = last_step or (config.checkpoint_every and done % config.checkpoint_every == 0)
            if done % config.log_every == 0 or evaluate_now or save_now:
                flush_logs(done)
            if evaluate_now:
                rec = {"step": done}
                if eval_fn is not None:
                    eval_loss = rec["eval_loss"] = evaluate(state)
                if on_eval is not None:
                    rec.update(on_eval(nnx.merge(nnx.graphdef(module), state[0]), done))
                record(rec)
            if save_now:
                checkpoint(done, state)
            if evaluate_now or save_now:
                t_last = time.perf_counter()  # evaluation and saving are not training throughput
    finally:
        if bar is not None:
            bar.close()
        manager.close()
    if start >= config.steps and eval_fn is not None:
        eval_loss = evaluate(state)
    module, _ = nnx.merge(graphdef, state)
    return TrainResult(module=module, step=max(start, config.steps), resumed_from=resumed_from,
                       history=history, eval_loss=eval_loss)
