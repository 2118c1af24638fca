"""The public surface: `load(path)` and `generate(model, prompts, method=..., **options)`.

Methods live in a registry (`jaxdecode.registry`), so every decoder — autoregressive, beam, and the
speculative / diffusion / constrained decoders — is reachable by name from Python and from the CLI
with one code path for tokenising, batching, timing and detokenising.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import numpy as np

import jaxdecode.decoders  # noqa: F401  (registers the built-in methods)
from jaxdecode.model import EMBEDDED_DIR, Model, embedded_model_path, load  # noqa: F401  (public names)
from jaxdecode.registry import COMMON_OPTIONS, get_method, methods, register_method  # noqa: F401


@dataclasses.dataclass(frozen=True)
class Generation:
    """One prompt's result. `tokens` are the new tokens (up to and including EOS)."""
    prompt: str | list[int]
    text: str
    tokens: list[int]
    stats: dict

    def to_json(self) -> dict:
        return {"prompt": self.prompt, "text": self.text, "tokens": self.tokens, "stats": self.stats}


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
