"""The public surface: `load(path)` and `generate(model, prompts, method=..., **options)`.

Methods live in a registry (`register_method`), so every decoder — autoregressive, beam, and the
speculative / diffusion / constrained decoders of later modules — is reachable by name from Python and
from the CLI with one code path for tokenising, batching, timing and detokenising.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

import jaxdecode.models as _models_pkg
from jaxdecode.models import ModelConfig, load_params, load_tokenizer

# Shipped with the jaxdecode.models package (models/embedded in the repository).
EMBEDDED_DIR = Path(_models_pkg.__file__).resolve().parent / "embedded"


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: static config, parameter pytree, tokenizer (or None) and where it came from."""
    config: ModelConfig
    params: Any
    tokenizer: Any = None
    path: str | None = None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.path} has no tokenizer files; pass prompts as token-id lists")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(int(t)) for t in tokens)
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)


@dataclasses.dataclass(frozen=True)
class Generation:
    """One prompt's result. `tokens` are the new tokens (up to and including EOS)."""
    prompt: str | list[int]
    text: str
    tokens: list[int]
    stats: dict

    def to_json(self) -> dict:
        return {"prompt": self.prompt, "text": self.text, "tokens": self.tokens, "stats": self.stats}


def embedded_model_path(name: str = "target") -> Path | None:
    """Directory of an embedded default model ("target" or "draft"), or None if not shipped."""
    p = EMBEDDED_DIR / name
    return p if (p / "config.json").exists() else None


def load(path: str | Path | None = None, *, dtype: str | None = None, mesh=None) -> Model:
    """Load a Hugging Face checkpoint directory (config.json + safetensors + tokenizer).

    `path=None` (or "default"/"target"/"draft") loads an embedded default model. `dtype` overrides the
    checkpoint's ("float32", "bfloat16"). With a `mesh`, parameters are sharded over it.
    """
    if path is None or str(path) in ("default", "target", "draft"):
        name = "draft" if str(path) == "draft" else "target"
        found = embedded_model_path(name)
        if found is None:
            raise FileNotFoundError(
                f"the embedded {name} model is not shipped in this checkout ({EMBEDDED_DIR / name}); "
                f"build it with `make models` or pass a checkpoint directory")
        path = found
        dtype = dtype or "float32"  # shipped in bf16 to save space; f32 is faster on CPU
    config, params = load_params(path, dtype=dtype)
    if mesh is not None:
        from jaxdecode.sharding import shard_params
        params = shard_params(params, mesh)
    return Model(config=config, params=params, tokenizer=load_tokenizer(path), path=str(path))


# ----------------------------------------------------------------------------- method registry
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
    _ensure_builtin_methods()
    return {n: s.description for n, s in sorted(_METHODS.items())}


def _ensure_builtin_methods():
    # Importing the decoder modules registers their methods.
    from jaxdecode import decoders  # noqa: F401


def get_method(name: str) -> MethodSpec:
    _ensure_builtin_methods()
    if name not in _METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(_METHODS))}")
    return _METHODS[name]


# ----------------------------------------------------------------------------- generate
def _tokenize(model: Model, prompts) -> tuple[list, list[list[int]]]:
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and
                                    isinstance(prompts[0], (int, np.integer))):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
    token_lists = []
    for i, p in enumerate(prompts):
        ids = model.encode(p) if isinstance(p, str) else [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty (it encodes to no tokens); every prompt needs at "
                             f"least one token")
        token_lists.append(ids)
    return list(prompts), token_lists


def generate(model: Model, prompts, method: str = "greedy", max_new_tokens: int = 32, *,
             temperature: float | None = None, seed: int = 0, eos_ids: Sequence[int] | None = None,
             **options) -> list[Generation]:
    """Generate continuations of `prompts` (a string, a list of strings, or token-id lists).

    `method` is any registered name (`jaxdecode.methods()`): greedy, sample, mirostat, beam,
    diverse_beam, and the speculative/diffusion/constrained decoders. Options are the method's own
    (e.g. top_k, top_p, min_p, repetition_penalty, num_beams, length_penalty). EOS defaults to the
    model's eos ids. Returns one `Generation` per prompt, with stats new_tokens, target_calls, seconds.
    """
    from jaxdecode.autoregressive import pad_prompts
    spec = get_method(method)
    allowed = set(COMMON_OPTIONS) | set(spec.options)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"method {method!r} does not take option(s) {unknown}; it takes "
                         f"{sorted(allowed - {'mesh'})}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    raw_prompts, token_lists = _tokenize(model, prompts)
    prompt_tokens, prompt_lengths = pad_prompts(token_lists)
    if eos_ids is None:
        eos_ids = model.config.eos_token_ids
    opts = dict(options, temperature=temperature, seed=seed, eos_ids=tuple(int(e) for e in eos_ids))
    start = time.perf_counter()
    tokens, lengths, stats = spec.run(model, prompt_tokens, prompt_lengths, max_new_tokens, opts)
    tokens, lengths = jax.device_get((tokens, lengths))
    stats = jax.device_get(stats)
    seconds = time.perf_counter() - start
    out = []
    for b, prompt in enumerate(raw_prompts):
        new = [int(t) for t in np.asarray(tokens[b])[: int(lengths[b])]]
        row_stats = {"new_tokens": len(new), "seconds": round(seconds, 4)}
        for k, v in stats.items():
            row_stats[k] = _jsonable(np.asarray(v)[b] if k in spec.per_row_stats else v)
        out.append(Generation(prompt=prompt if isinstance(prompt, str) else list(map(int, prompt)),
                              text=model.decode(new), tokens=new, stats=row_stats))
    return out


def _jsonable(v):
    v = np.asarray(v)
    if v.ndim == 0:
        return v.item()
    return v.tolist()
