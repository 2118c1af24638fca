"""The cost model of speculative decoding: what one step costs on this device, measured, not guessed.

    table = load_or_calibrate(model, drafter, batch_size)   # cached on disk, measured on a miss
    table.verify_at(6)      # seconds of one target verification over [pending + 6 nodes], whole batch
    table.draft_seconds     # one drafter.propose;  table.idle_seconds: one drafter.idle (0 without one)
    table.draft_at(2)       # a level_capped drafter's propose capped at 2 nodes (else draft_seconds)
    table.catch_up_seconds  # a lagging drafter's catch-up per token beyond a steady step's (0 without)
    table.step_at(6)        # seconds of a whole engine step verifying 6 nodes, drafting excluded

`measure` times, compile excluded, exactly what the engine runs each step: the target's verification
forward (`speculative._verify_forward`) over [pending + w chain nodes] on a KV cache filled to
`context_len` tokens, for each width w (w = 0 is the pending token alone: a plain decoding step), and
the drafter's `propose` / `idle` from its `init` state on the same prompt, and the engine's whole step
(`speculative._engine(...).step`: draft, verification forward, the verifier over the processed
target distribution, commit, the drafter's observe, the policy's bookkeeping) with each width forced.
The adaptive policy prices a step with the whole-step figure (`step_at`): on a small model the parts
around the forward are a large share of a step, and a policy that counted only the forward overrated
drafting. Each item runs inside a jitted loop, as in the engine's `lax.while_loop` (state updated in
place, no dispatch per step); the figure is the least of `repeats` timed loops' seconds per trip
(the loops run round robin; a busy machine only adds time, and the least varies about half as much
between calibrations as the median did).

Tables are cached as `<cache_dir>/costs/<sha256 of the key>.json` (cache_dir: $JAXDECODE_CACHE_DIR,
else $XDG_CACHE_HOME/jaxdecode, else ~/.cache/jaxdecode). The key holds everything the cost depends on:
the model (config + a content hash of its parameters), the drafter (type, static fields, content hash
of its arrays), the device (platform, kind, count), the batch size, the widths, the context length
rounded up to a power of two, the verifier, greedy or sampled, and the JAX version; anything changed is
a miss, except that generate (and tree="auto") then reads the nearest other context bucket's table when
one is cached (`any_context`). A cache file that cannot
be read or does not hold a valid table for its key is re-measured with a warning, never an error.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import files
from jaxdecode.kernels.common import next_pow2, round_up

SCHEMA = 22  # version of the cache file layout and of the key; bump when either changes meaning
# (4: DraftLM and self-speculation lost their idle step: older tables hold an idle cost no longer paid;
# 5: plain steps of history_only drafters run as lean runs, priced per token;
# 6: level_capped drafters draft only the levels a step verifies: draft_by_width, and forced steps
# that draft w levels; 7: a lean plain run's length is found by a loop that stops at the first
# flip, not a vmap that cost ~4 ms per run inside the engine at batch 1 on the CPU: older tables
# overprice plain decoding; 8: when sampling, the lean plain run follows the drafting branch instead
# of running inside it, 5% faster per sampled token at batch 1 on the CPU; 9: on the CPU the
# decoders run the target's layers from one array each (models.split_layers), a third faster per
# plain step at batch 1: older tables overprice every forward; 10: engine steps are timed over 16
# trips at least: EAGLE-3's plain step at batch 4 measured 5.8-6.6 ms over 3 trips, 3.6 ms decoding;
# 11: every drafter's plain steps run as lean runs (the drafter's observe inside them), not only
# history_only drafters; 12: the engine's step timed under the drafter's own policy, class-keyed
# where the engine keys it so; 13: on the CPU a one-row half-precision matmul is padded to two rows
# (models.transformer.matmul): XLA:CPU widened every weight matrix to float32 for it, 20 ms a call
# for the embedded target in weight-only bf16, so older tables overprice its plain and verify steps;
# 14: the device names the host CPU and its cores on the CPU backend (XLA calls every CPU "cpu"), and
# a draft LM's or EAGLE-3's catch-up is sized to what was accepted: older tables overprice drafting;
# 15: a drafter that reads only the history is timed on a history that moves with the trip (it was
# hoisted out of the timed loop: the retrieval drafter's draft priced at 0.9 us, not ~50 us), greedy
# verification's argmax runs as two plain reductions, 6-10x faster on the CPU (sampling.first_argmax);
# 16: the engine views a half-precision embedding as uint16 once per call (models.with_embed_words)
# and the output projection no longer copies its weight: older tables price copies XLA ran every step;
# 17: on GPU and TPU a lean plain run's length is one vmap again, not a loop trip (kernel launches and a
# host read) per plain token: older GPU tables overprice plain decoding; 18: a forward over the
# pending token alone (a plain step) runs decode's attention, not the tree kernel: older GPU and TPU
# tables overprice plain steps; 19: each item is the least of its timed loops, not their median: four
# calibrations of the embedded target's steps (bf16, batch 1) spread +-9% by median, +-4% by least);
# 20: a drafter's sampling temperature is keyed as greedy or sampled, not by value (the retrieval
# default's cut reads it, its step costs do not): each new temperature measured again, ~45 s a time;
# 21: a drafter that catches up lazily (Drafter.catch_up_lag) has its catch-up measured per token,
# which scores the adaptive policy's returns to drafting: older tables lack it; 22: EAGLE-3's observe
# stores the target's features unfused, its fc runs in the catch-up: older tables overprice its plain
# steps and underprice its catch-up)
DEFAULT_CONTEXT_LEN = 256
# Trips of a timed engine step, at least: the first steps from the prefilled state cost more than
# later ones (EAGLE-3's plain step at batch 4: 6.0 ms per trip over 3 trips, 4.2 over 32, 3.6 in a
# 96-token decode), and a dear step's 20 ms target allowed only 3.
STEP_MIN_TRIPS = 16
# Parameters up to this many bytes are hashed whole; above it every leaf is hashed by shape, dtype and
# a strided sample of SAMPLE_ELEMENTS elements (hashing gigabytes would cost more than it saves).
FULL_HASH_BYTES = 64 << 20
SAMPLE_ELEMENTS = 1 << 16


class CostTableError(ValueError):
    """A cost table (or its JSON form) that is not well formed."""


# ----------------------------------------------------------------------------- the table
@dataclasses.dataclass(frozen=True)
class CostTable:
    """Measured seconds per engine step part, for the whole batch. Hashable (meta is left out of
    equality and hash), so it can be a static argument of a jitted function."""
    widths: tuple  # ascending verification widths (node counts); widths[0] == 0, the plain step
    verify_seconds: tuple  # one target verification over [pending + w nodes], per width
    draft_seconds: float  # one drafter.propose
    idle_seconds: float  # one drafter.idle (0.0 when the drafter has none)
    batch_size: int
    # The engine's whole step with each width forced, drafting (w > 0) or idling (w = 0) included; ()
    # when not measured (a table written by hand): the policy then prices a step by its forward alone.
    step_seconds: tuple = ()
    # A level_capped drafter's propose capped at each width's node count (entry 0, the plain step's, is
    # 0.0); () for drafters that draft their whole proposal whatever is verified.
    draft_by_width: tuple = ()
    # Seconds per committed token that a proposal catches up on beyond a steady step's max_depth + 1
    # (after a lean plain run; adaptive: "Returns to drafting"); 0.0 for drafters that keep up (no catch_up_lag).
    catch_up_seconds: float = 0.0
    meta: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)  # for display

    def __post_init__(self):
        w, v = self.widths, self.verify_seconds
        if not isinstance(w, tuple) or not w or any(type(x) is not int for x in w):
            raise CostTableError(f"widths must be a non-empty tuple of ints, got {w!r}")
        if w[0] != 0 or any(a >= b for a, b in zip(w, w[1:])):
            raise CostTableError(f"widths must be strictly ascending and start at 0 (the plain step), got {w}")
        if not isinstance(v, tuple) or len(v) != len(w):
            raise CostTableError(f"verify_seconds must be a tuple with one entry per width ({len(w)}), got {v!r}")
        if not isinstance(self.step_seconds, tuple) or len(self.step_seconds) not in (0, len(w)):
            raise CostTableError(f"step_seconds must be () or a tuple with one entry per width ({len(w)}), "
                                 f"got {self.step_seconds!r}")
        if not isinstance(self.draft_by_width, tuple) or len(self.draft_by_width) not in (0, len(w)):
            raise CostTableError(f"draft_by_width must be () or a tuple with one entry per width ({len(w)}), "
                                 f"got {self.draft_by_width!r}")
        for name, x in ([("verify_seconds", s) for s in v] + [("step_seconds", s) for s in self.step_seconds]
                        + [("draft_by_width", s) for s in self.draft_by_width]
                        + [("draft_seconds", self.draft_seconds), ("idle_seconds", self.idle_seconds),
                           ("catch_up_seconds", self.catch_up_seconds)]):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                raise CostTableError(f"{name} must hold finite numbers >= 0, got {x!r}")
        if type(self.batch_size) is not int or self.batch_size < 1:
            raise CostTableError(f"batch_size must be an int >= 1, got {self.batch_size!r}")
        if not isinstance(self.meta, dict):
            raise CostTableError(f"meta must be a dict, got {type(self.meta).__name__}")

    def verify_at(self, width) -> float:
        """Seconds of a verification forward over `width` nodes: linear interpolation between the
        measured widths; past the last one, the last segment's slope continues (verification cost grows
        about linearly in the node count once the device is busy)."""
        return _interpolate(self.widths, self.verify_seconds, width)

    def draft_at(self, width) -> float:
        """Seconds of the drafter's propose when the step verifies `width` > 0 nodes: a level_capped
        drafter drafts only those levels (`draft_by_width`, interpolated), any other its whole proposal."""
        if not self.draft_by_width:
            return float(self.draft_seconds)
        return _interpolate(self.widths[1:], self.draft_by_width[1:], max(width, self.widths[1])) \
            if len(self.widths) > 1 else float(self.draft_seconds)

    def step_at(self, width) -> float:
        """Seconds of a whole engine step that verifies `width` nodes (0: a plain decoding step),
        drafting excluded (the policy adds draft_at(width) or idle_seconds): the measured step less the
        drafter's part; a drafting width's never below the forward alone, while width 0 is a lean run's
        token as the engine ran it (a floor at the forward timed alone, the larger of two noisy
        timings, priced plain decoding up to 16% high and made near break-even drafting look worth
        it). Tables without step_seconds: `verify_at`."""
        forward = self.verify_at(width)
        if not self.step_seconds:
            return forward
        if width == 0:  # a lean run's token, measured as the engine runs it (the forward inside it)
            return max(self.step_seconds[0] - self.idle_seconds, 1e-9)
        return max(forward, _interpolate(self.widths, self.step_seconds, width) - self.draft_at(width))

    @property
    def plain_seconds(self) -> float:
        """One plain decoding step (width 0): the pending token alone."""
        return self.step_at(0)

    def to_json(self) -> dict:
        return {"widths": list(self.widths), "verify_seconds": list(self.verify_seconds),
                "step_seconds": list(self.step_seconds), "draft_by_width": list(self.draft_by_width),
                "draft_seconds": self.draft_seconds, "idle_seconds": self.idle_seconds,
                "catch_up_seconds": self.catch_up_seconds, "batch_size": self.batch_size, "meta": self.meta}

    @classmethod
    def from_json(cls, data) -> "CostTable":
        """From `to_json()`'s dict (or its JSON text); CostTableError when it is not a valid table."""
        if isinstance(data, (str, bytes)):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as e:
                raise CostTableError(f"not JSON: {e}") from None
        fields = {"widths", "verify_seconds", "draft_seconds", "idle_seconds", "batch_size", "meta"}
        # absent in tables written before they were measured
        optional = {"step_seconds", "draft_by_width", "catch_up_seconds"}
        report = {"cache_file", "measured", "temperature"}  # what `jaxdecode calibrate --json` adds: ignored
        if not isinstance(data, dict) or not fields <= set(data) <= fields | optional | report:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise CostTableError(f"a cost table is an object with fields {sorted(fields)} (and optionally "
                                 f"{sorted(optional)}), got {got}")
        try:
            return cls(widths=tuple(data["widths"]), verify_seconds=tuple(data["verify_seconds"]),
                       step_seconds=tuple(data.get("step_seconds", ())),
                       draft_by_width=tuple(data.get("draft_by_width", ())),
                       draft_seconds=data["draft_seconds"], idle_seconds=data["idle_seconds"],
                       catch_up_seconds=data.get("catch_up_seconds", 0.0),
                       batch_size=data["batch_size"], meta=data["meta"])
        except TypeError as e:  # e.g. widths not a list
            raise CostTableError(f"malformed cost table: {e}") from None


def _interpolate(widths, seconds, width) -> float:
    if isinstance(width, bool) or not isinstance(width, (int, float, np.integer, np.floating)) or not width >= 0:
        raise CostTableError(f"width must be a number >= 0, got {width!r}")
    w, v = widths, seconds
    if width <= w[-1] or len(w) == 1:
        return float(np.interp(width, w, v))
    slope = (v[-1] - v[-2]) / (w[-1] - w[-2])
    return float(v[-1] + max(slope, 0.0) * (width - w[-1]))


# ----------------------------------------------------------------------------- fingerprints
_digests: dict = {}  # id(array) -> (weakref, hex digest): parameters are hashed once per object


def array_digest(x, *, sample: bool = False) -> str:
    """sha256 of an array's shape, dtype and bytes (or of a strided sample of SAMPLE_ELEMENTS
    elements when `sample`), memoised per array object."""
    if isinstance(x, jax.core.Tracer):
        raise TypeError("a traced array (weights passed into jax.jit) has no bytes to fingerprint: pass "
                        "the concrete arrays, or close over them")
    memo = _digests.get(id(x))
    if memo is not None and memo[0]() is x and memo[1] == sample:
        return memo[2]
    h = hashlib.sha256(f"{tuple(x.shape)}|{x.dtype}|{'sample' if sample else 'full'}|".encode())
    size = int(np.prod(x.shape))
    if not getattr(x, "is_fully_addressable", True):  # spans other hosts: its layout stands for it
        h.update(f"sharded|{x.sharding}".encode())
    elif sample and size > SAMPLE_ELEMENTS:
        step = size // SAMPLE_ELEMENTS
        with jax.ensure_compile_time_eval():  # concrete weights inside a caller's jit: sample them eagerly
            flat = jnp.ravel(x)[::step] if isinstance(x, jax.Array) else np.ravel(x)[::step]
        h.update(np.ascontiguousarray(np.asarray(flat)).tobytes())
    else:
        h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
    digest = h.hexdigest()
    try:
        _digests[id(x)] = (weakref.ref(x, lambda _, k=id(x): _digests.pop(k, None)), sample, digest)
    except TypeError:  # not weak-referenceable: hash again next time
        pass
    return digest


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def params_digest(params) -> str:
    """Content hash of a parameter pytree: every leaf's bytes when the pytree holds at most
    FULL_HASH_BYTES, else each leaf's shape, dtype and a strided sample (a changed checkpoint of the
    same architecture still changes the sample, unless it differs only between sampled elements)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    arrays = [(jax.tree_util.keystr(p), x) for p, x in flat if _is_array(x)]
    sample = sum(x.size * x.dtype.itemsize for _, x in arrays) > FULL_HASH_BYTES
    h = hashlib.sha256(b"sample" if sample else b"full")
    for path, x in arrays:
        h.update(f"{path}={array_digest(x, sample=sample)};".encode())
    for path, x in flat:
        if not _is_array(x):
            h.update(f"{jax.tree_util.keystr(path)}={x!r};".encode())
    return h.hexdigest()


def _stable(obj, depth: int = 0):
    """A JSON-able description of a configuration object that is the same in every process: dataclass
    fields, containers, scalars; arrays by content hash; functions by qualified name."""
    if depth > 12:
        return type(obj).__qualname__
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return repr(obj)  # nan / inf stay JSON-able
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return _stable(obj.item(), depth)
    if _is_array(obj):
        return {"array": array_digest(obj)}
    if isinstance(obj, (list, tuple)):
        return [_stable(x, depth + 1) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _stable(v, depth + 1) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {"type": name, **{f.name: _stable(getattr(obj, f.name), depth + 1)
                                 for f in dataclasses.fields(obj)}}
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"{getattr(obj, '__module__', '')}.{obj.__qualname__}"
    if hasattr(obj, "__dict__"):
        return {"type": name, **{k: _stable(v, depth + 1) for k, v in sorted(vars(obj).items())}}
    text = repr(obj)
    return name if " at 0x" in text else text


def _config_and_params(model):
    """(config, params) of a jaxdecode Model (anything with .config and .params) or a pair."""
    if isinstance(model, tuple) and len(model) == 2:
        return model
    if hasattr(model, "config") and hasattr(model, "params"):
        return model.config, model.params
    raise TypeError(f"model must be a jaxdecode Model (jaxdecode.load) or a (config, params) pair, got "
                    f"{type(model).__name__}")


def model_fingerprint(model) -> dict:
    config, params = _config_and_params(model)
    return {"config": _stable(config), "params": params_digest(params)}


def _temperature_class(desc):
    """`desc` (a `_stable` description) with every `temperature` field reduced to greedy or sampled."""
    if isinstance(desc, list):
        return [_temperature_class(x) for x in desc]
    if not isinstance(desc, dict):
        return desc
    out = {k: _temperature_class(v) for k, v in desc.items()}
    if isinstance(desc.get("temperature"), str):  # _stable writes floats as their repr
        try:
            out["temperature"] = "greedy" if float(desc["temperature"]) == 0.0 else "sampled"
        except ValueError:
            pass
    return out


def mesh_text(mesh) -> str:
    """How a table's meta names the mesh it was measured on: "one device" or "data=2,model=4"."""
    return "one device" if mesh is None else ",".join(f"{k}={int(v)}" for k, v in mesh.shape.items())


def drafter_fingerprint(drafter) -> dict:
    """Type name, static fields and a content hash of the drafter's arrays (its weights, tables). A
    drafter built for a sampling temperature (the retrieval drafter's cut reads its rates there) is
    keyed by greedy or sampled alone: a step costs the same at 0.7 as at 0.9, and every new temperature
    would otherwise be measured again."""
    name = f"{type(drafter).__module__}.{type(drafter).__qualname__}"
    desc = _temperature_class(_stable(drafter))
    return {"type": name, "num_nodes": int(drafter.num_nodes),
            "digest": hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()}


def device_fingerprint() -> dict:
    """What the timings depend on besides the model: backend, device kind and count; on the CPU backend
    also the host CPU and its core count (XLA's device kind is just "cpu": a table measured on one CPU
    model would price another's steps, e.g. from a shared home directory)."""
    devices = jax.devices()
    fp = {"platform": jax.default_backend(), "device_kind": devices[0].device_kind, "device_count": len(devices)}
    if fp["platform"] == "cpu":
        fp.update(host_cpu=host_cpu(), host_cores=os.cpu_count())
    return fp


@functools.cache  # read once per process: every generate call builds a cache key
def host_cpu() -> str:
    """The host CPU as /proc/cpuinfo names it (vendor, family / model numbers and model name: a
    hypervisor may report a name alone as generic as "AMD EPYC"); elsewhere platform.processor()."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    parts = [fields.get(k, "") for k in ("vendor_id", "cpu family", "model", "model name")]
    if any(parts):
        return " / ".join(parts)
    import platform
    return platform.processor() or platform.machine()


# ----------------------------------------------------------------------------- measuring
def default_widths(num_nodes: int) -> tuple:
    """0, 1, 2, 4, ... (powers of two below N), N: the widths the adaptive policy verifies over."""
    from jaxdecode.adaptive import default_widths as policy_widths
    return policy_widths(num_nodes)


def policy_widths(drafter, verify_widths=()) -> tuple:
    """The widths method="speculative"'s adaptive policy verifies over, and so the widths its cost table
    is measured and keyed at: 0, the powers of two below N, N, the drafter's own `verify_widths` and the
    call's `verify_widths` option. The one rule for generate, `jaxdecode calibrate` and the default of
    `load_or_calibrate`: a table measured at other widths has another key, and generate would measure
    again rather than read it."""
    from jaxdecode.adaptive import default_widths as widths_with
    return widths_with(drafter.num_nodes, tuple(verify_widths or ())
                       + tuple(getattr(drafter, "verify_widths", None) or ()))


def check_widths(widths, num_nodes: int, stepped: bool = True) -> tuple:
    """Normalise measured widths to an ascending tuple of distinct ints that starts at 0 (the plain
    step is always measured: the adaptive engine needs it). stepped: the engine's whole step is timed at
    each width too, so none may exceed the drafter's tree (`num_nodes`)."""
    if widths is None:
        return default_widths(num_nodes)
    if isinstance(widths, (str, bytes)) or not hasattr(widths, "__iter__"):
        raise ValueError(f"widths must be a list of node counts, got {widths!r}")
    widths = list(widths)
    bad = [w for w in widths if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0]
    if bad:
        raise ValueError(f"widths must be node counts (ints >= 0), got {bad}")
    if len(set(widths)) != len(widths):
        raise ValueError(f"widths {widths} repeat a width: give each once")
    wide = [int(w) for w in widths if w > num_nodes]
    if stepped and wide:
        raise ValueError(f"widths {wide} exceed the drafter's tree ({num_nodes} nodes): a step never verifies "
                         f"more nodes than its tree holds. Give widths <= {num_nodes}, or a larger tree "
                         f"(e.g. --tree chain:{max(wide)}); benchmarks/bench_verify_cost.py times the target's "
                         f"forward alone at any node count")
    return tuple(sorted({0, *(int(w) for w in widths)}))


def check_batch_size(batch_size) -> int:
    """batch_size as an int >= 1; a ValueError saying what is wrong otherwise."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    return int(batch_size)


def _emit(progress, line: str) -> None:
    if progress is True:
        print(line, file=sys.stderr, flush=True)
    elif callable(progress):
        progress(line)


@dataclasses.dataclass
class _Loop:
    """One timed item: `step(args, state, trip) -> (state, outputs)` run `trips` times inside a jitted
    loop, as in the engine's while loop: the state (a KV cache, a drafter state) is donated and updated
    in place, no dispatch per step, and the last trip's outputs are returned so XLA cannot drop the work
    that makes them. The trip count is traced: one compile per item."""
    step: Callable
    args: Any
    trips: int = 1
    times: list = dataclasses.field(default_factory=list)
    same_as: "_Loop | None" = None  # a loop with the same step and args of the same shapes: one compile

    def __post_init__(self):
        if self.same_as is not None:
            self._run = self.same_as._run
            return
        step = self.step

        def run(a, state, n):
            shapes = jax.eval_shape(lambda s: step(a, s, jnp.int32(0))[1], state)
            out0 = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
            return jax.lax.fori_loop(0, n, lambda i, c: step(a, c[0], i), (state, out0))
        self._run = jax.jit(run, donate_argnums=1)

    def __call__(self, state, trips: int):
        """Run `trips` trips; (state, seconds per trip)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Dd]onat")  # backends without donation
            t0 = time.perf_counter()
            state, out = self._run(self.args, state, trips)
            jax.block_until_ready((state, out))
        return state, (time.perf_counter() - t0) / trips


def _time_loops(loops: list, state, repeats: int, target_seconds: float, max_trips: int = 256,
                fresh: bool = False, min_trips: int = 1):
    """Least seconds per trip of each loop over `repeats` timings, compile excluded (a busy machine only
    adds time: the least is the steadiest figure between calibrations); `state` is handed from loop to
    loop (one KV cache for every width), or with `fresh` every call starts from a copy of it (made untimed: loops
    whose state grows, like the engine's, then stay within the room they were given). The loops are
    timed round-robin, so a slow spell of a busy machine spreads over all of them instead of bending
    the curve."""
    def copy(s):  # private: it is donated
        return jax.block_until_ready(jax.tree.map(lambda x: jnp.array(x, copy=True), s))

    bases = [copy(state) if fresh else None] * len(loops)
    state = copy(state)

    def run(i, state, trips):
        return loops[i](copy(bases[i]) if fresh else state, trips)

    for i, loop in enumerate(loops):
        state, _ = run(i, state, 1)  # compile + warm up
        state, first = run(i, state, 1)
        loop.trips = int(min(max_trips, max(min_trips, target_seconds // max(first, 1e-9))))
    for _ in range(repeats):
        for i, loop in enumerate(loops):
            state, secs = run(i, state, loop.trips)
            loop.times.append(secs)
    return [float(min(loop.times)) for loop in loops]


def resolve_context(config, drafter, context_len) -> int:
    """The context length to measure at: `context_len`, or min(256, the limit) when None. The limit is
    what the engine allows: the deepest tree node's position must fit max_position_embeddings."""
    limit = config.max_position_embeddings - drafter.max_depth - 1
    if context_len is None:
        context_len = min(DEFAULT_CONTEXT_LEN, limit)
    if isinstance(context_len, bool) or not isinstance(context_len, (int, np.integer)) \
            or not 2 <= context_len <= limit:
        raise ValueError(f"context_len must be an int in 2..{limit} (the model's max_position_embeddings "
                         f"{config.max_position_embeddings} minus the drafter's tree depth "
                         f"{drafter.max_depth} and the pending token), got {context_len!r}")
    return int(context_len)


def measurement_tree(tokens, max_depth: int):
    """w valid nodes as chains of at most `max_depth` nodes (w <= max_depth: one chain), so every node's
    position stays where the engine's trees put theirs. Attention cost does not depend on the shape."""
    from jaxdecode.tree import Tree
    b, w = tokens.shape
    i = jnp.arange(w, dtype=jnp.int32)
    parents = jnp.broadcast_to(jnp.where(i % max_depth == 0, -1, i - 1), (b, w))
    return Tree(tokens=tokens, parents=parents, valid=jnp.ones((b, w), bool))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _FirstNodes:
    """`inner`'s drafting with only the first `width` nodes of each proposal valid (nodes are
    topologically ordered, so they form a tree): the cost model runs the engine's step at a forced
    width with it. The width is traced: one compile serves every width."""
    inner: Any
    width: jax.Array  # int32 scalar

    def __getattr__(self, name):  # everything but propose is the inner drafter's
        if name in ("inner", "width"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def propose(self, state, ctx, sampler):
        tree, probs, state = self.inner.propose(state, ctx, sampler)
        first = jnp.arange(tree.tokens.shape[1])[None, :] < self.width
        return tree.replace(valid=jnp.broadcast_to(first, tree.valid.shape)), probs, state


def _forcing_costs(widths: tuple, index: int) -> jnp.ndarray:
    """A policy cost vector under which width `index` is always the best choice (engine timing only)."""
    vec = np.ones(2 * len(widths) + 1, np.float32)  # adaptive.cost_vector's layout
    vec[index] = 1e-9
    vec[len(widths):] = 0.0  # drafting and idling free: the width alone decides
    return jnp.asarray(vec)


def measure(model, drafter, batch_size: int, *, widths=None, context_len: int | None = None,
            repeats: int = 5, target_seconds: float = 0.02, sampler=None, verifier=None,
            attn_impl: str | None = None, mesh=None, seed: int = 0, progress=True,
            whole_step: bool = True) -> CostTable:
    """Measure a CostTable for `drafter` on `model` (a jaxdecode Model or (config, params)) at
    `batch_size` rows over a cache holding `context_len` tokens (default min(256, the model's limit)).

    widths: the verification widths (node counts) to time; default `policy_widths(drafter)` (what
    generate's policy verifies over); 0 is always included. repeats: timed loops per item (the least
    counts); target_seconds: length of each loop.
    sampler: the SamplerConfig `propose` gets (default greedy). verifier: the engine step's verifier
    (a Verifier or a name; default: what generate uses, `verifiers.default_verifier`). attn_impl /
    mesh: as speculative_decode. progress: True = one line per measured item on stderr, False =
    silent, a callable gets the lines. whole_step=False skips the whole-step timing (step_seconds ())."""
    from jaxdecode.models import init_cache, split_layers, with_embed_words
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.speculative import _verify_forward, check_feature_layers, feature_request, select_features

    config, params = _config_and_params(model)
    check_batch_size(batch_size)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    b = int(batch_size)
    widths = check_widths(policy_widths(drafter) if widths is None else widths, drafter.num_nodes,
                          stepped=whole_step)
    context_len = resolve_context(config, drafter, context_len)
    sampler = sampler or SamplerConfig(temperature=0.0)
    if attn_impl is None:
        attn_impl = "xla" if jax.default_backend() == "cpu" else "tree"
    feature_layers = check_feature_layers(config, getattr(drafter, "feature_layers", ()))
    n = drafter.num_nodes
    # Room as the engine leaves it: the context, the widest tree (+ the pending root), a catch-up block.
    cache_len = round_up(context_len + max(max(widths), n) + drafter.max_depth + 2, 64)
    hist_cap = context_len + drafter.max_depth + 2

    key = jax.random.PRNGKey(seed)
    k_prompt, k_tree, k_init, k_draft = jax.random.split(key, 4)
    prompt = jax.random.randint(k_prompt, (b, context_len), 0, config.vocab_size, jnp.int32)
    lengths = jnp.full((b,), context_len, jnp.int32)
    if mesh is not None:  # placed as generate places them: parameters over 'model', rows over 'data'
        from jaxdecode.sharding import shard_batch, shard_params
        params, prompt, lengths = shard_params(params, mesh), shard_batch(prompt, mesh), shard_batch(lengths, mesh)
    model_digest = model_fingerprint((config, params))["params"][:12]
    # the layout the decoders run (on the CPU, one array per layer), the embedding viewed as the engine does
    params = with_embed_words(split_layers(config, params))
    # The engine's state before a step: the cache holds all but the last prompt token (the pending one).
    _, cache, hidden = jax.jit(_prefill, static_argnums=(0, 5))(
        config, params, prompt, lengths - 1, init_cache(config, b, cache_len), feature_request(feature_layers))
    pending = prompt[:, -1]
    active = jnp.ones((b,), bool)
    meta = {"model": model_digest,
            "model_type": config.model_type, "num_parameters": config.num_parameters(),
            "dtype": config.dtype, "weights_dtype": weights_dtype(params), "drafter": type(drafter).__name__,
            "num_nodes": n,
            "device": device_fingerprint(), "jax": jax.__version__, "context_len": context_len,
            "attn_impl": attn_impl, "repeats": repeats, "sampling": not sampler.is_greedy, "mesh": mesh_text(mesh),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    where = f"batch {b}, context {context_len}"

    # (a) the target verification forward per width: the engine's _verify_forward at that one width.
    def verify_step(w):
        def step(a, cache_, i):
            p, toks, pend, act = a
            # Tokens change with the trip, so XLA cannot hoist the forward out of the loop.
            tree = measurement_tree((toks + i) % config.vocab_size, max(1, drafter.max_depth))
            logits, feats, cache_ = _verify_forward(config, p, tree, pend, cache_, act, (w,), attn_impl, mesh,
                                                    feature_layers)  # [B, w+1, V]
            return cache_, (logits, feats)
        return step

    loops = []
    for w in widths:
        tokens = jax.random.randint(jax.random.fold_in(k_tree, w), (b, w), 0, config.vocab_size, jnp.int32)
        loops.append(_Loop(verify_step(w), (params, tokens, pending, active)))
    verify = _time_loops(loops, cache, repeats, target_seconds)
    for w, secs in zip(widths, verify):
        _emit(progress, f"calibrate: verify {w:4d} nodes ({where}): {secs * 1e3:9.3f} ms")

    # (b) drafter.propose (and idle) from its init state on the same prompt, as the engine calls them.
    feats = select_features(hidden, feature_layers)  # None without feature layers
    state0 = _init_drafter(drafter, prompt, lengths, cache_len, k_init, feats)

    history = jnp.zeros((b, hist_cap), jnp.int32).at[:, :context_len].set(prompt)
    ctx_args = (drafter, history, lengths, k_draft)

    def ctx_at(a, i, max_nodes=None):
        return trip_context(a[1], a[2], a[3], i, config.vocab_size, max_nodes)

    def draft_step(a, state, i):
        tree, probs, state = a[0].propose(state, ctx_at(a, i, a[4] if len(a) > 4 else None), sampler)
        return state, (tree, probs)

    loops = [_Loop(draft_step, ctx_args)]
    if callable(getattr(drafter, "idle", None)):  # what the drafter does on a step that drafts nothing
        loops.append(_Loop(lambda a, state, i: (a[0].idle(state, ctx_at(a, i)), ()), ctx_args))
    capped = []
    if getattr(drafter, "level_capped", False) and getattr(drafter, "is_chain", False):
        # Drafted only as deep as each width (DraftContext.max_nodes): one compile, the cap traced.
        for w in widths[1:]:
            capped.append(_Loop(draft_step, ctx_args + (jnp.full((b,), w, jnp.int32),),
                                same_as=capped[0] if capped else None))
    secs = _time_loops(loops + capped, state0, repeats, target_seconds)
    draft, idle = (secs[:len(loops)] + [0.0])[:2]
    draft_by_width = (0.0,) + tuple(secs[len(loops):]) if capped else ()
    name = type(drafter).__name__
    _emit(progress, f"calibrate: draft  ({name}, {where}): {draft * 1e3:9.3f} ms")
    if len(loops) > 1:
        _emit(progress, f"calibrate: idle   ({name}, {where}): {idle * 1e3:9.3f} ms")
    for w, secs_w in zip(widths[1:], draft_by_width[1:]):
        _emit(progress, f"calibrate: draft  {w:4d} levels ({name}, {where}): {secs_w * 1e3:9.3f} ms")
    catch_up = 0.0
    if callable(getattr(drafter, "catch_up_lag", None)):
        catch_up = _measure_catch_up(drafter, prompt, lengths, feats, cache_len, sampler, k_init, k_draft,
                                     config.vocab_size, repeats, target_seconds)
        _emit(progress, f"calibrate: catch-up per token ({name}, {where}): {catch_up * 1e3:9.3f} ms")
    steps = ()
    if whole_step:
        steps = _measure_steps(config, params, drafter, prompt, lengths, widths, sampler, verifier, attn_impl,
                               mesh, repeats, target_seconds, jax.random.fold_in(key, 1))
        for w, secs in zip(widths, steps):
            _emit(progress, f"calibrate: step   {w:4d} nodes ({where}): {secs * 1e3:9.3f} ms")
    meta["verifier"] = getattr(_verifier(drafter, sampler, verifier), "name", "?")
    return CostTable(widths=widths, verify_seconds=tuple(verify), step_seconds=tuple(steps), draft_seconds=draft,
                     idle_seconds=idle, batch_size=b, draft_by_width=draft_by_width, catch_up_seconds=catch_up,
                     meta=meta)


def _init_drafter(drafter, prompt, lengths, cache_len: int, key, feats):
    """drafter.init as the engine calls it, jitted, with room for `cache_len` tokens; `feats` the
    prompt's features (None for a drafter that reads none). Every array goes in as an argument, none
    closed over: over several processes they span devices that are not this process's, and a jitted
    function may not capture such an array."""
    init = jax.jit(lambda d, p, l, k, f: d.init(p, l, cache_len, k, **({} if f is None else {"features": f})))
    return init(drafter, prompt, lengths, key, feats)


# Tokens a timed catch-up runs beyond a steady step's: the adaptive policy's lean plain run at most.
CATCH_UP_SPAN = 32
CATCH_UP_TRIPS = 8  # proposals per timed loop (each starts from the init state: room for this many)


def _measure_catch_up(drafter, prompt, lengths, feats, cache_len, sampler, k_init, k_draft, vocab_size: int,
                      repeats: int, target_seconds: float) -> float:
    """Seconds per token of a lagging drafter's catch-up beyond a steady step's (Drafter.catch_up_lag):
    its propose timed with the history moved max_depth + 1 tokens per trip (a steady step at most) and
    CATCH_UP_SPAN more (a proposal after a lean plain run), the difference per extra token."""
    b, context_len = prompt.shape
    steady = drafter.max_depth + 1
    spans = (steady, steady + CATCH_UP_SPAN)
    room = CATCH_UP_TRIPS * spans[-1]
    state0 = _init_drafter(drafter, prompt, lengths, cache_len + room, k_init, feats)
    # The committed tokens ahead of the prompt: random ones (what the drafter reads, not what it makes).
    width = context_len + room + drafter.max_depth + 2
    ahead = jax.random.randint(jax.random.fold_in(k_draft, 1), (b, width), 0, vocab_size, jnp.int32)
    history = ahead.at[:, :context_len].set(prompt)

    def step(a, state, i):
        from jaxdecode.speculative import DraftContext
        d, hist, start, key, span = a
        ctx = DraftContext(history=hist, hist_len=start + (i + 1) * span, key=jax.random.fold_in(key, i))
        tree, probs, state = d.propose(state, ctx, sampler)
        return state, (tree, probs)

    loops = [_Loop(step, (drafter, history, lengths, k_draft, jnp.int32(s))) for s in spans]
    loops[1] = _Loop(step, loops[1].args, same_as=loops[0])
    near, far = _time_loops(loops, state0, repeats, target_seconds, max_trips=CATCH_UP_TRIPS, fresh=True)
    return max(far - near, 0.0) / CATCH_UP_SPAN


def weights_dtype(params) -> str:
    """The dtype(s) the weight matrices (the 2-D and wider floating parameters) are stored in, e.g.
    "bfloat16" under weight-only half precision while the model computes in float32 (the embedding's
    uint16 view, `with_embed_words`, is not a weight of its own)."""
    return "/".join(sorted({str(x.dtype) for x in jax.tree.leaves(params)
                            if getattr(x, "ndim", 0) >= 2 and jnp.issubdtype(x.dtype, jnp.floating)}))


def trip_context(history, hist_len, key, trip, vocab_size: int, max_nodes=None):
    """The DraftContext of trip `trip` of a timed draft loop: the history with its pending token (the
    last committed one) moved by the trip, and a key folded with it. A drafter that reads only the
    history (a lookup: no state, no key) is then no longer loop-invariant; with a fixed history XLA
    hoisted its whole proposal out of the loop, and the retrieval drafter's draft was timed at 0.9 us
    instead of ~50 us (BENCHMARKS.md, "Argmax over a vocabulary")."""
    from jaxdecode.speculative import DraftContext
    col = jnp.arange(history.shape[1])[None, :]
    moved = jnp.where(col == (hist_len - 1)[:, None], (history + trip) % vocab_size, history)
    return DraftContext(history=moved, hist_len=hist_len, key=jax.random.fold_in(key, trip), max_nodes=max_nodes)


def _verifier(drafter, sampler, verifier):
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.verifiers import default_verifier, get_verifier
    if verifier is None:
        verifier = default_verifier(drafter, sampler or SamplerConfig(temperature=0.0))
    return get_verifier(verifier) if isinstance(verifier, str) else verifier


def _measure_steps(config, params, drafter, prompt, lengths, widths, sampler, verifier, attn_impl, mesh,
                   repeats, target_seconds, key, max_trips: int = 32) -> list:
    """Seconds of the engine's whole step at each width (speculative._engine's step, the very function
    the decoding loop runs), each width forced (`_forced_steps`). Every timed loop starts from the same
    prefilled state, and the room for `max_trips` steps is reserved in the cache and history."""
    loops, state0, plain_tokens = _forced_steps(config, params, drafter, prompt, lengths, widths, sampler,
                                                verifier, attn_impl, mesh, key, max_trips)
    secs = _time_loops(loops, state0, repeats, target_seconds, max_trips=max_trips, fresh=True,
                       min_trips=STEP_MIN_TRIPS)
    return [secs[0] / plain_tokens] + list(secs[1:])  # width 0: seconds per plain token


def _forced_steps(config, params, drafter, prompt, lengths, widths, sampler, verifier, attn_impl, mesh, key,
                  max_trips: int):
    """(one _Loop per width running the engine's step with that width forced, the prefilled state they
    start from, the tokens a forced plain trip commits: the engine's `plain_tokens`). A width is forced
    by the policy's costs and by a drafter whose proposals keep exactly that many nodes; each trip
    returns the policy's width histogram (which width the step verified)."""
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.speculative import _engine, policy_for

    b, context_len = prompt.shape
    grow = drafter.max_depth + 1  # most tokens a step commits
    max_new = max_trips * grow + 1  # rows never finish inside a timed loop
    cache_len = round_up(context_len + max_new + drafter.num_nodes + grow + 1, 64)
    # The drafter's own policy (keyed by confidence class where the engine keys it so: that bookkeeping
    # is part of the step; timed without it, the retrieval default's 1-node step at batch 4, T = 0.7
    # was priced at 1.23 plain tokens, with it 1.33, and the policy drafted at 0.91x plain decoding,
    # now 0.98x: BENCHMARKS.md, "the policy's own bookkeeping priced"), with estimates fixed at 1
    # (decay 1, no drift, no reach limit, no first look): every kept node stays verifiable. A lean
    # plain run of `grow` steps per trip, the room each trip has: the policy prices a plain token at what
    # a run of them costs, not one run's overhead (the probe-time check of adaptive.plain_run_length)
    # per token.
    policy = policy_for(drafter, sampler or SamplerConfig(temperature=0.0), widths=widths, decay=1.0, prior=1.0,
                        explore=0.0, min_reach=0.0, margin=0.0, shape="proposal", plain_run=grow,
                        prior_by_depth=(), prior_by_class=(), prior_weight=0.0, first_look=False)
    static = dict(verifier=_verifier(drafter, sampler, verifier), sampler=sampler, max_new_tokens=max_new,
                  eos_ids=(), cache_len=cache_len, hist_cap=context_len + max_new + grow + 1,
                  attn_impl=attn_impl, verify_widths=widths, mesh=mesh, policy=policy)

    def engine(p, d, costs):
        return _engine(config, p, d, costs, **static)

    start = jax.jit(lambda p, d, toks, lens, k: engine(p, d, None).start(toks, lens, k))
    state0 = start(params, drafter, prompt, lengths, key)

    def step(a, st, i):
        p, d, costs = a
        st = engine(p, d, costs).step(st)
        return st, st.width_hist

    loops = []
    for i, w in enumerate(widths):
        args = (params, _FirstNodes(drafter, jnp.int32(w)), _forcing_costs(widths, i))
        loops.append(_Loop(step, args, same_as=loops[0] if loops else None))
    return loops, state0, engine(params, drafter, None).plain_tokens


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON atomically: a temporary sibling, then os.replace (readers never see half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _prefill(config, params, prompt, lengths, cache, return_layers):
    from jaxdecode.autoregressive import prefill
    return prefill(config, params, prompt, lengths, cache, return_layers=return_layers, with_hidden=True)


# ----------------------------------------------------------------------------- the cache on disk
default_cache_dir = files.default_cache_dir  # one root for every jaxdecode cache


def context_bucket(context_len: int, limit: int) -> int:
    """The context a table is measured (and keyed) at: context_len rounded up to a power of two, within
    the model's limit (attention cost grows with the context; a bucket shares one table)."""
    return min(next_pow2(int(context_len)), limit)


def cache_key(model, drafter, batch_size: int, *, widths=None, context_len: int | None = None,
              attn_impl: str | None = None, mesh=None, sampler=None, verifier=None) -> dict:
    """Everything a table depends on (the file name is the sha256 of its JSON). widths / context_len as
    in `load_or_calibrate`; the context is already bucketed here."""
    config, params = _config_and_params(model)
    check_batch_size(batch_size)
    widths = check_widths(policy_widths(drafter) if widths is None else widths, drafter.num_nodes)
    context_len = resolve_context(config, drafter, context_len)
    if attn_impl is None:
        attn_impl = "xla" if jax.default_backend() == "cpu" else "tree"
    return {"schema": SCHEMA, "model": model_fingerprint((config, params)),
            "drafter": drafter_fingerprint(drafter), "device": device_fingerprint(),
            "batch_size": int(batch_size), "widths": list(widths),
            "context_len": context_bucket(context_len, config.max_position_embeddings - drafter.max_depth - 1),
            "attn_impl": attn_impl,
            "mesh": None if mesh is None else {str(k): int(v) for k, v in mesh.shape.items()},
            # drafting greedily (argmax children) or sampling them costs a little differently
            "sampling": sampler is not None and not sampler.is_greedy,
            "verifier": _stable(_verifier(drafter, sampler, verifier)), "jax": jax.__version__}


def cache_file(key: dict, cache_dir=None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return Path(cache_dir or default_cache_dir()) / "costs" / f"{digest}.json"


def read_cached(path: Path, key: dict) -> CostTable | None:
    """The table cached at `path` for `key`; None when there is none. A file that cannot be read or
    does not hold a valid table for this key gives a warning (it is then re-measured), never an error."""
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):  # no such file (a file stands where a directory would)
        return None
    except (OSError, UnicodeDecodeError) as e:
        warnings.warn(f"cost cache file {path} cannot be read ({e}); the costs are measured again and "
                      f"the file replaced", stacklevel=3)
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or set(data) != {"schema", "key", "table"}:
            raise CostTableError(f"not a jaxdecode cost cache file of schema {SCHEMA}")
        if data["key"] != json.loads(json.dumps(key)):
            raise CostTableError("it was written for another model / drafter / device / batch size")
        table = CostTable.from_json(data["table"])
        if table.batch_size != key["batch_size"] or list(table.widths) != key["widths"]:
            raise CostTableError("its table does not match its key")
        return table
    except (json.JSONDecodeError, CostTableError) as e:
        warnings.warn(f"cost cache file {path} is not a valid cost table ({e}); the costs are measured "
                      f"again and the file replaced", stacklevel=3)
        return None


def write_cached(path: Path, key: dict, table: CostTable) -> None:
    """Write atomically (readers never see half a file)."""
    write_json_atomic(path, {"schema": SCHEMA, "key": key, "table": table.to_json()})


def _nearest_context(model, drafter, key: dict, cache_dir) -> tuple[CostTable, Path] | None:
    """A table cached for `key` but another context bucket, the nearest one (by ratio; of two as near,
    the longer), with its file; None when no other bucket is cached. Files that do not read are
    passed over silently here: their own context reports them when it is asked for."""
    config, _ = _config_and_params(model)
    limit = config.max_position_embeddings - drafter.max_depth - 1
    want = key["context_len"]
    buckets = {context_bucket(2 ** i, limit) for i in range(1, max(limit, 2).bit_length() + 1)} - {want}
    found = []
    for bucket in buckets:
        other = dict(key, context_len=bucket)
        path = cache_file(other, cache_dir)
        if not path.is_file():
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            table = read_cached(path, other)
        if table is not None:
            found.append((abs(math.log2(bucket / want)), -bucket, table, path))
    if not found:
        return None
    _, _, table, path = min(found, key=lambda f: f[:2])
    return table, path


def calibrate(model, drafter, batch_size: int, *, widths=None, context_len: int | None = None,
              cache_dir=None, progress=True, refresh: bool = False, attn_impl: str | None = None,
              mesh=None, sampler=None, verifier=None, any_context: bool = False,
              **measure_kw) -> tuple[CostTable, Path | None, bool]:
    """`load_or_calibrate`, also returning the cache file (None: it could not be written) and whether the
    table was measured now."""
    key = cache_key(model, drafter, batch_size, widths=widths, context_len=context_len,
                    attn_impl=attn_impl, mesh=mesh, sampler=sampler, verifier=verifier)
    path = cache_file(key, cache_dir)
    table = None if refresh else read_cached(path, key)
    if table is not None:
        return table, path, False
    if any_context and not refresh:  # a table of another context serves before minutes of measuring
        near = _nearest_context(model, drafter, key, cache_dir)
        if near is not None:
            return near[0], near[1], False
    _emit(progress, f"calibrate: measuring step costs of {type(drafter).__name__} at batch {batch_size} "
                    f"(once; cached in {path})")
    table = measure(model, drafter, batch_size, widths=tuple(key["widths"]), context_len=key["context_len"],
                    attn_impl=key["attn_impl"], mesh=mesh, sampler=sampler, verifier=verifier, progress=progress,
                    **measure_kw)
    try:
        write_cached(path, key, table)
    except OSError as e:  # a read-only home must not stop decoding: the table is still good
        warnings.warn(f"cannot write the cost cache {path} ({e}); the costs will be measured again next "
                      f"time (pass a writable cache_dir, CLI --cache-dir, or set JAXDECODE_CACHE_DIR)",
                      stacklevel=2)
        return table, None, True
    return table, path, True


def load_or_calibrate(model, drafter, batch_size: int, *, widths=None, context_len: int | None = None,
                      cache_dir=None, progress=True, refresh: bool = False, any_context: bool = False,
                      **kw) -> CostTable:
    """The CostTable of `drafter` on `model` at `batch_size` on this device: from the cache when one was
    measured for the same key (module docstring), else measured now (`measure`) and cached.
    any_context=True (what generate and tree="auto" pass): on a miss, a table cached for everything but
    the context bucket serves, the nearest bucket's, instead of measuring (a step's costs grow with the
    context nearly alike at every width, and the policy weighs them against each other); `table.meta
    ["context_len"]` says which was read. Measured only when no bucket is cached.

    model: a jaxdecode Model or (config, params). widths: default `policy_widths(drafter)` (0, powers of
    two, N and the drafter's own verify_widths: the table generate reads). context_len:
    the context decoding runs at (default 256), rounded up to a power of two within the model's
    positions. cache_dir: default `default_cache_dir()`. progress: as `measure` (one line per measured
    item; nothing on a hit). refresh: measure again even when cached. sampler (greedy or
    not is part of the key), verifier (part of the key; default as generate chooses), attn_impl, mesh
    and the other keywords (repeats, target_seconds, whole_step) go to `measure`."""
    return calibrate(model, drafter, batch_size, widths=widths, context_len=context_len, cache_dir=cache_dir,
                     progress=progress, refresh=refresh, any_context=any_context, **kw)[0]


# ----------------------------------------------------------------------------- command line helpers
def parse_batch_sizes(text: str) -> tuple:
    """'1,4,16' -> (1, 4, 16): distinct ints >= 1; ValueError saying what is wrong otherwise."""
    parts = [p.strip() for p in str(text).split(",")]
    if not all(p.lstrip("+").isdigit() for p in parts):
        raise ValueError(f"--batch-size {text!r}: give ints >= 1 separated by commas, e.g. 1,4,16")
    sizes = tuple(int(p) for p in parts)
    if any(s < 1 for s in sizes):
        raise ValueError(f"--batch-size {text!r}: every batch size must be >= 1")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"--batch-size {text!r} repeats a batch size: give each once")
    return sizes


def parse_temperatures(text: str) -> tuple:
    """'0,0.7' -> (0.0, 0.7): distinct finite numbers >= 0; ValueError saying what is wrong otherwise."""
    try:
        temps = tuple(float(p) for p in str(text).split(","))
    except ValueError:
        raise ValueError(f"--temperature {text!r}: give numbers >= 0 separated by commas, e.g. 0,0.7") from None
    if not all(math.isfinite(t) and t >= 0 for t in temps):
        raise ValueError(f"--temperature {text!r}: every temperature must be a finite number >= 0 (0: greedy)")
    if len(set(temps)) != len(temps):
        raise ValueError(f"--temperature {text!r} repeats a temperature: give each once")
    if sum(t > 0 for t in temps) > 1:
        raise ValueError(f"--temperature {text!r}: every temperature above 0 shares one table (a sampled step "
                         f"costs the same at any temperature): give one, e.g. 0,0.7")
    return temps


def format_tables(rows) -> str:
    """A text table of (CostTable, cache file, measured now) rows: milliseconds per step, whole batch."""
    widths = sorted({w for t, _, _ in rows for w in t.widths})
    head = ["batch", "ms at width"] + [f"{w}" for w in widths] + ["draft", "idle", "catch-up/token", "source"]
    body = []
    for table, path, measured in rows:
        verify = [f"{table.verify_at(w) * 1e3:.3f}" for w in widths]
        body.append([str(table.batch_size), "verify"] + verify + [f"{table.draft_seconds * 1e3:.3f}",
                                                                   f"{table.idle_seconds * 1e3:.3f}",
                                                                   f"{table.catch_up_seconds * 1e3:.3f}",
                                                                   "measured" if measured else "cached"])
        if table.step_seconds:  # the whole engine step as measured (drafting included; 0: a plain token)
            step = [f"{_interpolate(table.widths, table.step_seconds, w) * 1e3:.3f}" for w in widths]
            body.append([str(table.batch_size), "whole step"] + step + ["", "", "", ""])
    cols = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    lines = ["  ".join(c.rjust(n) for c, n in zip(r, cols)) for r in [head] + body]
    meta = rows[0][0].meta if rows else {}
    stored = meta.get("weights_dtype")
    weights = f" (weights {stored})" if stored and stored != meta.get("dtype") else ""
    decoding = {True: ", sampled", False: ", greedy"}.get(meta.get("sampling"), "")  # older tables: not said
    lines.insert(0, f"step costs in ms (whole batch): drafter {meta.get('drafter')} ({meta.get('num_nodes')} "
                    f"nodes{decoding}), {meta.get('model_type')} {meta.get('dtype')}{weights}, "
                    f"context {meta.get('context_len')}, "
                    f"{meta.get('device', {}).get('device_kind')} x{meta.get('device', {}).get('device_count')}")
    lines += [f"batch {t.batch_size}: {p if p is not None else 'not cached (the cache could not be written)'}"
              for t, p, _ in rows]
    return "\n".join(lines)
