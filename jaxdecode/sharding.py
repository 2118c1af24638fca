"""Device meshes and logical -> physical sharding rules.

Every array axis gets a *logical* name (batch, heads, mlp, vocab, ...); `LOGICAL_RULES` maps logical
names to mesh axes (`data`, `model`). Batch shards over `data` (data parallel), attention heads, MLP
width and vocabulary over `model` (tensor parallel). An axis whose size the mesh axis does not divide
stays replicated (e.g. 2 KV heads on a 4-way `model` axis) instead of failing: correctness never
depends on the layout, only speed does.

Multi-host (several processes, one controller each): call `jax.distributed.initialize()` first;
`make_mesh` then spans every process's devices. Every process runs the same program on the same
inputs (the same prompts, options and checkpoint). `put` builds a global array from host data with
each process filling only its own devices' shards, and `to_host` gathers an output that spans
processes, so that `jaxdecode.generate(..., mesh=mesh)` returns the whole result on every process
(tests/test_multihost.py: two processes equal one).
"""
from __future__ import annotations

import contextlib
import hashlib
import json

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA, MODEL = "data", "model"

LOGICAL_RULES: dict[str, str | None] = {
    "batch": DATA,
    "heads": MODEL,
    "kv_heads": MODEL,
    "mlp": MODEL,
    "vocab": MODEL,
    "experts": None,  # each expert's MLP width splits over `model` instead
    "embed": None,
    "layers": None,
    "head_dim": None,
    "seq": None,
    "positions": None,
}

# Logical axes of every parameter (by its key in the params pytree; see models/transformer.py).
PARAM_AXES: dict[str, tuple] = {
    "embed": ("vocab", "embed"),
    "pos_embed": ("positions", "embed"),
    "lm_head": ("embed", "vocab"),
    "lm_head_bias": ("vocab",),  # Phi-3.5-MoE's, split over `model` with the head's vocabulary
    "scale": ("embed",),  # final_norm (the per-layer norms get a leading "layers" axis)
    "bias": ("embed",),
    "wq": ("layers", "embed", "heads", "head_dim"),
    "wk": ("layers", "embed", "kv_heads", "head_dim"),
    "wv": ("layers", "embed", "kv_heads", "head_dim"),
    "wo": ("layers", "heads", "head_dim", "embed"),
    "bq": ("layers", "heads", "head_dim"),
    "bk": ("layers", "kv_heads", "head_dim"),
    "bv": ("layers", "kv_heads", "head_dim"),
    "bo": ("layers", "embed"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
    "b_gate": ("layers", "mlp"),
    "b_up": ("layers", "mlp"),
    "b_down": ("layers", "embed"),
    "w_router": ("layers", "embed", "experts"),
    "we_gate": ("layers", "experts", "embed", "mlp"),
    "we_up": ("layers", "experts", "embed", "mlp"),
    "we_down": ("layers", "experts", "mlp", "embed"),
    # Qwen2-MoE's shared expert: its width over `model` as a dense MLP's; its one-logit gate [L, D, 1] whole
    "ws_gate": ("layers", "embed", "mlp"),
    "ws_up": ("layers", "embed", "mlp"),
    "ws_down": ("layers", "mlp", "embed"),
    "w_shared_gate": ("layers", "embed", None),
}

CACHE_AXES = {"k": ("layers", "batch", "kv_heads", "seq", "head_dim"),
              "v": ("layers", "batch", "kv_heads", "seq", "head_dim"),
              "lengths": ("batch",)}


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
    """A (`data`, `model`) mesh over `devices` (default: all). `data` defaults to the rest."""
    devices = list(jax.devices() if devices is None else devices)
    if data is not None and data < 1:
        raise ValueError(f"data={data}: a mesh needs data >= 1 (the batch is split over `data` devices)")
    if model < 1 or len(devices) % model:
        raise ValueError(f"model={model} must divide the number of devices ({len(devices)})")
    data = len(devices) // model if data is None else data
    if data * model != len(devices):
        raise ValueError(f"mesh {data}x{model} needs {data * model} devices, have {len(devices)}; "
                         f"pass devices=jax.devices()[:{data * model}] to use a subset")
    grid = np.asarray(devices, dtype=object).reshape(data, model)
    auto = getattr(jax.sharding, "AxisType", None)
    if auto is not None:  # Auto axes: GSPMD propagates shardings through the decoders
        return Mesh(grid, (DATA, MODEL), axis_types=(auto.Auto, auto.Auto))
    return Mesh(grid, (DATA, MODEL))


def auto_axes(mesh: Mesh) -> Mesh:
    """The mesh with Auto axes. `jax.make_mesh` makes Explicit axes by default, under which every gather
    and matmul must name its output sharding; the decoders leave that to GSPMD's propagation, so they run
    on the same devices and axis names with Auto types (the shardings are the same)."""
    axis_type = getattr(jax.sharding, "AxisType", None)
    types = getattr(mesh, "axis_types", None)
    if axis_type is None or types is None or all(t == axis_type.Auto for t in types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(axis_type.Auto,) * len(mesh.axis_names))


def check_mesh(mesh) -> None:
    """A mesh the decoders can use: axes named 'data' (the batch) and/or 'model' (the parameters); an axis
    it lacks counts as size 1."""
    names = tuple(getattr(mesh, "axis_names", ()))
    if not isinstance(mesh, Mesh) or not names or not set(names) <= {DATA, MODEL}:
        raise ValueError(f"the mesh's axes are {names or mesh!r}, but jaxdecode shards the batch over an axis "
                         f"named {DATA!r} and the parameters over one named {MODEL!r}: name them so "
                         f"(jaxdecode.sharding.make_mesh(data=..., model=...) builds one)")


def spec_for(logical_axes: tuple, shape: tuple, mesh: Mesh, rules=LOGICAL_RULES) -> P:
    """PartitionSpec for an array, replicating axes the mesh axis size does not divide (or the mesh
    lacks: a data-only mesh replicates the parameters)."""
    out = []
    used = set()
    for name, size in zip(logical_axes, shape):
        axis = rules.get(name)
        if axis is None or axis in used or axis not in mesh.shape or size % mesh.shape[axis]:
            out.append(None)
        else:
            out.append(axis)
            used.add(axis)
    return P(*out)


def _param_axes(path, leaf) -> tuple:
    key = path[-1].key
    axes = PARAM_AXES.get(key)
    if axes is None:
        raise ValueError(f"no sharding rule for parameter {jax.tree_util.keystr(path)}; "
                         f"add it to jaxdecode.sharding.PARAM_AXES")
    if key in ("scale", "bias") and leaf.ndim == 2:  # per-layer norms: [L, D]
        axes = ("layers",) + axes
    # OLMo 2's query / key norms over all heads, Cohere's scales per head: [L, heads, hd], sharded as the heads
    if key == "scale" and leaf.ndim == 3:
        axes = ("layers", "kv_heads" if path[-2].key == "k_norm" else "heads", "head_dim")
    if len(axes) != leaf.ndim:
        raise ValueError(f"parameter {jax.tree_util.keystr(path)} has {leaf.ndim} axes, its rule "
                         f"names {len(axes)}: {axes}")
    return axes


def param_shardings(params, mesh: Mesh, rules=LOGICAL_RULES):
    """The NamedSharding of every parameter on `mesh` (with Auto axes, as the decoders need: the same
    shardings `shard_params` places them with)."""
    mesh = auto_axes(mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, a: NamedSharding(mesh, spec_for(_param_axes(path, a), a.shape, mesh, rules)),
        params)


def _spans_processes(x) -> bool:
    """A jax.Array with shards on other processes' devices (a global array, not host-local data)."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def put(x, sharding: NamedSharding):
    """`jax.device_put(x, sharding)`, also when `sharding` spans several processes: then host data (or
    a process-local array), which must be the same on every process, becomes one global array whose
    shards each process fills for its own devices (jax.device_put refuses a committed local array and
    all-gathers anything else to compare it); an array that already spans processes is resharded."""
    if sharding.is_fully_addressable or _spans_processes(x):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(tree):
    """`jax.device_get(tree)` that also fetches arrays spanning several processes: every process gets
    the whole value (a collective: all processes must call it on the same tree)."""
    def get(x):
        if not _spans_processes(x):
            return jax.device_get(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.tree_util.tree_map(get, tree)


def shard_params(params, mesh: Mesh, rules=LOGICAL_RULES):
    """Place parameters on the mesh: heads and MLP tensor-parallel over `model`."""
    return jax.tree_util.tree_map(put, params, param_shardings(params, auto_axes(mesh), rules))


def shard_cache(cache, mesh: Mesh, rules=LOGICAL_RULES):
    """Place a KVCache on the mesh: batch over `data`, KV heads over `model`."""
    mesh = auto_axes(mesh)
    shardings = {name: NamedSharding(mesh, spec_for(axes, getattr(cache, name).shape, mesh, rules))
                 for name, axes in CACHE_AXES.items()}
    return cache.replace(**{n: put(getattr(cache, n), s) for n, s in shardings.items()})


def shard_batch(x, mesh: Mesh, rules=LOGICAL_RULES):
    """Place a [B, ...] array with its batch axis over `data` (replicated if B does not divide).

    On a mesh that spans processes every process must pass the same batch (checked: different prompts
    per process would otherwise decode garbage silently)."""
    axes = ("batch",) + (None,) * (np.ndim(x) - 1)
    mesh = auto_axes(mesh)
    sharding = NamedSharding(mesh, spec_for(axes, np.shape(x), mesh, rules))
    if not sharding.is_fully_addressable and not _spans_processes(x):
        # the shape first, as a fixed-size array: comparing arrays of different shapes aborts the collective
        shape = np.zeros(9, np.int64)
        shape[0], shape[1:1 + np.ndim(x)] = np.ndim(x), np.shape(x)[:8]
        for what, value in (("shape", shape), ("contents", np.asarray(x))):
            same_across_processes(value, f"the batch {what} (shape {np.shape(x)})",
                                  "every process must pass the same prompts and options")
    return put(x, sharding)


def same_across_processes(value, what: str, rule: str) -> None:
    """Raise a ValueError naming `what` unless `value` (an array of one shape on every process) is the
    same on every process. A collective: every process must call it."""
    from jax.experimental import multihost_utils
    try:
        multihost_utils.assert_equal(value)
    except AssertionError:
        raise ValueError(f"{what} is not the same on every process: on a mesh that spans processes {rule} (this is "
                         f"process {jax.process_index()})") from None


def check_same_options(options: dict, mesh) -> None:
    """On a mesh that spans processes, the options that are plain values (seed, temperature, lengths, ...)
    must be the same on every process: a different seed would silently mix rows of two decodes."""
    if mesh is None or jax.process_count() == 1 or all(d.process_index == jax.process_index()
                                                         for d in np.asarray(mesh.devices).flat):
        return

    def plain(v):
        return v is None or isinstance(v, (bool, int, float, str)) or (
            isinstance(v, (list, tuple)) and all(plain(x) for x in v))
    shown = {k: v for k, v in sorted(options.items()) if plain(v)}
    digest = hashlib.sha256(json.dumps(shown, default=str).encode()).digest()
    same_across_processes(np.frombuffer(digest, np.uint8), f"the options ({', '.join(shown)})",
                          "every process must pass the same prompts and options")


@contextlib.contextmanager
def mesh_context(mesh=None):
    """Inside a caller's `with jax.set_mesh(m)` with m from jax.make_mesh (Explicit axes), the decoders'
    ops would be checked against m while their arrays live on Auto axes: run them with `mesh` (default:
    m itself), as Auto axes, as the context instead. Outside such a context, or inside a jit (where the
    context cannot change), nothing changes."""
    get, setter = getattr(jax.sharding, "get_abstract_mesh", None), getattr(jax, "set_mesh", None)
    axis_type = getattr(jax.sharding, "AxisType", None)
    try:
        context = None if get is None or setter is None or get().empty else jax.sharding.get_mesh()
        if context is not None and (mesh is not None or any(t == axis_type.Explicit for t in context.axis_types)):
            switch = setter(auto_axes(mesh if mesh is not None else context))
            switch.__enter__()
        else:
            context = None
    except ValueError:  # inside a jit the context cannot change: check_auto_axes explains what it cannot take
        context = None
    if context is None:
        yield
        return
    try:
        yield
    finally:
        switch.__exit__(None, None, None)


def under_auto_mesh(fn):
    """`fn` (a decoder) run under `mesh_context()`: callable inside a caller's jax.set_mesh context."""
    import functools

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with mesh_context():
            return fn(*args, **kwargs)
    return wrapped


def _explicit_axes(x) -> tuple:
    """The Explicit mesh axes a traced array's type is sharded over (jax.make_mesh's default)."""
    axis_type = getattr(jax.sharding, "AxisType", None)
    sharding = getattr(getattr(x, "aval", None), "sharding", None)
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if axis_type is None or spec is None or mesh is None or not getattr(mesh, "axis_types", None):
        return ()
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == axis_type.Explicit}
    used = {a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))}
    return tuple(sorted(used & explicit))


def check_auto_axes(**arrays) -> None:
    """Inside a caller's jit, arrays sharded over a mesh's Explicit axes (jax.make_mesh's default) carry
    their sharding in their type, and the decoders' gathers would fail on it deep inside with a
    ShardingTypeError: refuse them up front, saying how to place them instead."""
    for name, tree in arrays.items():
        for leaf in jax.tree.leaves(tree):
            if isinstance(leaf, jax.core.Tracer) and _explicit_axes(leaf):
                raise ValueError(
                    f"{name} is sharded over the Explicit mesh axes {_explicit_axes(leaf)} (jax.make_mesh's "
                    f"default) inside your jit; the decoders shard with Auto axes: place the arrays with "
                    f"jaxdecode.sharding.shard_params / shard_batch (or param_shardings), or build the mesh "
                    f"with jaxdecode.sharding.make_mesh or axis_types=(AxisType.Auto,) * 2")
