"""The method registry: every decoder reachable by name from `jaxdecode.generate` and the CLI.

A leaf module (it imports no decoder): decoder modules register themselves here, and `jaxdecode.api`
imports them once so the built-in methods are always present.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """run(model, prompt_tokens[B,P], prompt_lengths[B], max_new_tokens, options) -> (tokens, lengths, stats).

    tokens: int [B, N] new tokens; lengths: int [B]; stats: dict of per-batch numbers (scalars or [B]).
    """
    name: str
    run: Callable
    options: tuple = ()  # option names the method accepts (beyond the common ones)
    description: str = ""
    per_row_stats: tuple = ()  # stats with one entry per prompt (the others are whole-batch figures)


_METHODS: dict[str, MethodSpec] = {}
COMMON_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "eos_ids",
                  "cache_len", "mesh")


def register_method(name: str, run: Callable, options: Sequence[str] = (), description: str = "",
                    aliases: Sequence[str] = (), per_row_stats: Sequence[str] = ()) -> None:
    spec = MethodSpec(name=name, run=run, options=tuple(options), description=description,
                      per_row_stats=tuple(per_row_stats))
    for n in (name, *aliases):
        _METHODS[n] = spec


def methods() -> dict[str, str]:
    """Registered method names and one-line descriptions."""
    return {n: s.description for n, s in sorted(_METHODS.items())}


def get_method(name: str) -> MethodSpec:
    if name not in _METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(_METHODS))}")
    return _METHODS[name]
