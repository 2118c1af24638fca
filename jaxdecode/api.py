"""The public surface: `load(path)` and `generate(model, prompts, method=..., **options)`.

Methods live in a registry (`jaxdecode.registry`), so every decoder — autoregressive, beam, and the
speculative / diffusion / constrained decoders — is reachable by name from Python and from the CLI
with one code path for tokenising, batching, timing and detokenising.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

import jaxdecode.decoders  # noqa: F401  (registers the built-in methods)
import jaxdecode.constraints.asap  # noqa: F401  (registers asap)
import jaxdecode.diffusion  # noqa: F401  (registers diffusion / block_diffusion)
from jaxdecode.bench import CompileClock
from jaxdecode.model import EMBEDDED_DIR, Model, embedded_model_path, load  # noqa: F401  (public names)
from jaxdecode.options import OPTIONS, OptionError  # noqa: F401  (public names)
from jaxdecode.registry import get_method, methods, register_method  # noqa: F401
from jaxdecode.sharding import to_host


@dataclasses.dataclass(frozen=True)
class Generation:
    """One prompt's result. `tokens` are the new tokens (up to and including EOS).

    Under regex= / json_schema= / grammar=: `valid` says whether the text (without its EOS) satisfies
    the constraint, checked apart from the automaton by `validator` (re.fullmatch, jsonschema, lark or
    llguidance; valid None: none could read it), and `backend` names what enforced it while decoding."""
    prompt: str | list[int]
    text: str
    tokens: list[int]
    stats: dict
    valid: bool | None = None
    constraint: str | None = None  # regex | json_schema | grammar, or None (unconstrained)
    backend: str | None = None
    validator: str | None = None

    def to_json(self) -> dict:
        out = {"prompt": self.prompt, "text": self.text, "tokens": self.tokens, "stats": self.stats}
        if self.constraint is not None:
            out.update(valid=self.valid, constraint=self.constraint, backend=self.backend, validator=self.validator)
        return out


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


class NonFiniteLogitsError(ValueError):
    """The model's logits were NaN or infinite while rows were decoding: their output is garbage."""

    def __init__(self, message: str, results: list):
        super().__init__(message)
        self.results = results  # the Generations, each with stats["nonfinite_logits"]


NONFINITE_STAT = "nonfinite_logits"  # per-row stat of every built-in method


def generate(model: Model, prompts, method: str = "greedy", max_new_tokens: int = 32, *,
             temperature: float | None = None, seed: int | None = None,
             eos_ids: Sequence[int] | None = None, **options) -> list[Generation]:
    """Generate continuations of `prompts` (a string, a list of strings, or token-id lists).

    `method` is any registered name (`jaxdecode.methods()`): greedy, sample, mirostat, beam,
    diverse_beam, and the speculative/constrained decoders. Structured output: regex=, json_schema= or
    grammar= (one value, or a list with one per prompt) constrains the methods in
    jaxdecode.options.STRUCTURED; each Generation then says whether its text is `valid`. Options are the method's own; every
    option, what it accepts and its default are in `jaxdecode.options.OPTIONS` (README, "Options").
    All are checked before anything decodes; None means "the method's default". EOS defaults to the
    model's eos ids. Returns one `Generation` per prompt, with stats new_tokens, target_calls,
    seconds (the call's wall time without compilation), compile_seconds (JAX tracing + compiling
    during the call: ~0 on a repeated call at the same shapes; None when this JAX cannot report it,
    then seconds includes it), nonfinite_logits, and the method's own (under a structured option also
    constraint, constraint_backend and constraint_compile_seconds: host compile time, not in seconds).

    If the model's logits were NaN/inf at a step where a row was decoding, raises
    NonFiniteLogitsError naming the rows (its `.results` holds the outputs) unless
    allow_nonfinite=True.
    """
    from jaxdecode.autoregressive import pad_prompts
    from jaxdecode.options import resolve
    from jaxdecode.structured import build_constraint, output_text, structured_request, validate_text
    spec = get_method(method)
    _check_model_kind(model, spec.name)
    given = dict(options, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                 eos_ids=eos_ids)
    raw_prompts, token_lists = _tokenize(model, prompts)
    opts = resolve(spec.name, given, batch=len(token_lists))
    prompt_tokens, prompt_lengths = pad_prompts(token_lists)
    if opts["eos_ids"] is None:
        opts["eos_ids"] = model.config.eos_token_ids
    opts["eos_ids"] = tuple(int(e) for e in opts["eos_ids"])  # validated ints: exact
    structured = structured_request(opts, len(token_lists))
    constraint_stats = {}
    if structured is not None:  # compiled here, before decoding and outside its timing (the disk cache helps)
        start = time.perf_counter()
        opts["constraint"], constraint_stats = build_constraint(model, structured, opts["eos_ids"])
        constraint_stats["constraint_compile_seconds"] = round(time.perf_counter() - start, 4)
    max_new_tokens = opts.pop("max_new_tokens")
    allow_nonfinite = opts.pop("allow_nonfinite")
    # seconds = the call's wall time minus JAX's tracing / lowering / compiling, reported apart as
    # compile_seconds (None when this JAX cannot report it: then seconds includes it).
    with CompileClock() as compiling:
        start = time.perf_counter()
        tokens, lengths, stats = spec.run(model, prompt_tokens, prompt_lengths, max_new_tokens, opts)
        tokens, lengths, stats = to_host((tokens, lengths, stats))  # also gathers what spans processes
        wall = time.perf_counter() - start
    compile_seconds = compiling.seconds
    seconds = wall if compile_seconds is None else max(wall - compile_seconds, 0.0)
    compile_seconds = None if compile_seconds is None else round(compile_seconds, 4)
    per_row = set(spec.per_row_stats) | {NONFINITE_STAT}
    out = []
    for b, prompt in enumerate(raw_prompts):
        new = [int(t) for t in np.asarray(tokens[b])[: int(lengths[b])]]
        row_stats = {"new_tokens": len(new), "seconds": round(seconds, 4), "compile_seconds": compile_seconds,
                     **constraint_stats}
        for k, v in stats.items():
            row_stats[k] = _jsonable(np.asarray(v)[b] if k in per_row else v)
        checked = {}
        if structured is not None:
            valid, validator = validate_text(structured, b, output_text(model, new, opts["eos_ids"]),
                                             tokens=new, model=model)
            checked = dict(valid=valid, constraint=structured.kind, validator=validator,
                           backend=row_stats.get("constraint_backend"))
        out.append(Generation(prompt=prompt if isinstance(prompt, str) else list(map(int, prompt)),
                              text=model.decode(new), tokens=new, stats=row_stats, **checked))
    bad = [b for b, r in enumerate(out) if r.stats.get(NONFINITE_STAT)]
    if bad and not allow_nonfinite:
        dtype = model.config.dtype
        cause = ("NaN/inf weights in the checkpoint, or activations overflowing float32" if dtype == "float32"
                 else f"NaN/inf weights in the checkpoint, or overflow in {dtype} (try "
                      f"jaxdecode.load(..., dtype='float32'), CLI --dtype float32)")
        raise NonFiniteLogitsError(
            f"the model's logits were NaN or infinite while decoding prompt(s) {bad} (of {len(out)}), so "
            f"their output is garbage. Likely cause: {cause}. Pass allow_nonfinite=True (CLI: "
            f"--allow-nonfinite) to get the outputs anyway.", out)
    return out


def _check_model_kind(model: Model, method: str) -> None:
    """A masked-diffusion checkpoint decodes only with the diffusion methods, and they only decode it."""
    from jaxdecode.diffusion import DIFFUSION_METHODS
    diffusion = bool(getattr(model.config, "is_diffusion", False))
    if diffusion and method not in DIFFUSION_METHODS:
        raise ValueError(f"this checkpoint is a masked-diffusion LM (attention={model.config.attention!r}): "
                         f"method {method!r} decodes causal LMs token by token; use method='diffusion'"
                         + (" or 'block_diffusion'" if model.config.attention == "block" else ""))
    if not diffusion and method in DIFFUSION_METHODS:
        raise ValueError(f"method {method!r} decodes masked-diffusion LMs, but this checkpoint is a causal LM; "
                         f"use method='greedy', 'sample' or 'speculative'")


def _jsonable(v):
    v = np.asarray(v)
    if v.ndim == 0:
        return v.item()
    return v.tolist()
