"""Small helpers shared by the kernels, the model core and the decoders (one copy each).

This module sits at the bottom of the import graph (DESIGN.md: kernels <- models <- jaxdecode), so
every layer may use it.
"""
from __future__ import annotations

import jax
import numpy as np


def concrete(x):
    """x as a numpy array, or None when its value is not available on this host: a tracer (inside jit
    or vmap) or an array that spans other hosts. Host-side value checks are skipped then."""
    if x is None:
        return None
    try:
        if not getattr(x, "is_fully_addressable", True):
            return None
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def shard_map(f, mesh, in_specs, out_specs):
    """jax.shard_map across JAX versions (replication checks off: outputs are per-shard by design)."""
    if hasattr(jax, "shard_map"):  # JAX >= 0.7
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as _sm  # older JAX
    return _sm(f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (int(x) - 1).bit_length())


def round_up(x: int, m: int) -> int:
    """x rounded up to a multiple of m."""
    return -(-int(x) // m) * m


__all__ = ["concrete", "next_pow2", "round_up", "shard_map"]
