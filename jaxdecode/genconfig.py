"""`GenerationConfig`: a checkpoint's generation defaults (generation_config.json), as transformers reads them.

`jaxdecode.load` reads `generation_config.json` beside config.json into `Model.generation_config`;
`generate` (and the CLI) use its values for whatever the call leaves unset. Precedence, highest first:
an explicit argument of `generate` (or CLI flag), `generate(generation_config=...)`, the checkpoint's
generation_config.json, the method's own default (jaxdecode.options.OPTIONS).

Fields follow transformers' names and meanings:
- `eos_token_id` (an int or a list): every id ends a row. It wins over config.json's eos_token_id, as in
  transformers (Llama-3-Instruct and Qwen2.5-Instruct list their end-of-turn token only here).
- `do_sample` / `num_beams` choose the method when `generate` is given none: sample, beam or greedy.
- `temperature`, `top_k`, `top_p`, `min_p` apply to the methods that draw samples (for method
  "speculative" only when `do_sample` is true: its default is greedy verification, as transformers'
  assisted generation is greedy unless do_sample); `repetition_penalty` to every method that takes it.
- `max_new_tokens`, `num_return_sequences`, `stop_strings`, `length_penalty`, `early_stopping` (beam
  search) as in transformers.
- `pad_token_id` / `bos_token_id` are kept for reference: rows come back unpadded, prompts are encoded
  by the tokenizer's own rule.
Unlike transformers, an unset `top_k` stays off (transformers samples from the top 50 tokens when a
checkpoint does not set top_k): pass `top_k=50` for that. `max_length` (prompt + new tokens) is not used;
jaxdecode counts new tokens (`max_new_tokens`). `top_p=0` keeps the single most likely token
(transformers' rule), i.e. top_k=1.
Other keys of the file are kept in `unused` and ignored; those among them that change transformers'
tokens (min_new_tokens, bad_words_ids, suppress_tokens, ...: `_NOT_APPLIED`), set to anything but their
"off" value, are also listed in `not_applied`, and generate warns about them.
"""
from __future__ import annotations

import dataclasses
import numbers
from pathlib import Path

_FIELDS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
           "num_beams", "length_penalty", "early_stopping", "num_return_sequences", "eos_token_id", "pad_token_id",
           "bos_token_id", "stop_strings")
# Keys transformers applies that change the tokens but that jaxdecode does not implement, with their "off"
# values: set to anything else, generate warns that its output will differ (never a silent difference).
_NOT_APPLIED = {"min_length": (0,), "min_new_tokens": (0,), "bad_words_ids": ((),), "suppress_tokens": ((),),
                "begin_suppress_tokens": ((),), "forced_bos_token_id": (), "forced_eos_token_id": (),
                "no_repeat_ngram_size": (0,), "typical_p": (1.0,), "epsilon_cutoff": (0.0,),
                "eta_cutoff": (0.0,), "num_beam_groups": (1,), "diversity_penalty": (0.0,),
                "exponential_decay_length_penalty": (), "sequence_bias": ((),), "guidance_scale": (1.0,),
                "penalty_alpha": (), "dola_layers": (), "max_time": (), "watermarking_config": (),
                "token_healing": (False,)}
# Keys transformers writes that change nothing here (bookkeeping, or values equal to "off").
_BOOKKEEPING = ("_from_model_config", "transformers_version", "use_cache", "return_dict_in_generate",
                "output_scores", "output_logits", "output_attentions", "output_hidden_states", "max_length")


class GenerationConfigError(ValueError):
    """A generation_config.json (or GenerationConfig field) with a value of the wrong type or range."""


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Generation defaults, transformers' field names; None = unset (the next rule down decides)."""
    max_new_tokens: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    num_beams: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None  # beam search: True, False or "never" (module beam)
    num_return_sequences: int | None = None
    eos_token_id: tuple | None = None  # ints (an int given is kept as a 1-tuple)
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    stop_strings: tuple | None = None
    unused: tuple = ()  # names of the file's keys that jaxdecode does not use
    # "key=value" of the unused keys that change transformers' tokens (min_new_tokens, bad_words_ids, ...):
    # generate warns about each
    not_applied: tuple = ()

    def __post_init__(self):
        eos = self.eos_token_id
        if eos is not None and not isinstance(eos, tuple):
            object.__setattr__(self, "eos_token_id", (eos,) if _is_int(eos) else tuple(eos))
        stops = self.stop_strings
        if isinstance(stops, str):
            object.__setattr__(self, "stop_strings", (stops,))
        elif stops is not None:
            object.__setattr__(self, "stop_strings", tuple(stops))
        _check(self)

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_dict(cls, values: dict, *, source: str = "generation config") -> "GenerationConfig":
        """From a dict of transformers' keys (generation_config.json's content); keys jaxdecode does not
        use are listed in `unused`, never an error (checkpoints carry many)."""
        if not isinstance(values, dict):
            raise GenerationConfigError(f"{source}: expected a JSON object, got {type(values).__name__}")
        known = {k: values[k] for k in _FIELDS if k in values}
        unused = tuple(sorted(k for k in values if k not in _FIELDS and k not in _BOOKKEEPING))
        not_applied = tuple(f"{k}={values[k]!r}" for k in sorted(_NOT_APPLIED) if k in values and
                            values[k] is not None and _plain(values[k]) not in _NOT_APPLIED[k])
        try:
            return cls(**known, unused=unused, not_applied=not_applied)
        except GenerationConfigError as e:
            raise GenerationConfigError(f"{source}: {e}") from None

    @classmethod
    def from_pretrained(cls, path) -> "GenerationConfig | None":
        """The generation_config.json of a checkpoint directory, or None when it has none."""
        file = Path(path) / "generation_config.json"
        if not file.exists():
            return None
        from jaxdecode.models.hf import read_json_object  # names the file when it is not valid JSON
        return cls.from_dict(read_json_object(file), source=str(file))

    @classmethod
    def from_transformers(cls, config) -> "GenerationConfig":
        """From a `transformers.GenerationConfig` (only the values it was given: its to_diff_dict)."""
        return cls.from_dict(config.to_diff_dict(), source="transformers.GenerationConfig")

    def replace(self, **changes) -> "GenerationConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k in _FIELDS
                if (v := getattr(self, k)) is not None}

    def over(self, base: "GenerationConfig | None") -> "GenerationConfig":
        """This config's set fields over `base`'s (e.g. a user's config over the checkpoint's)."""
        if base is None:
            return self
        return dataclasses.replace(base, **{k: getattr(self, k) for k in _FIELDS if getattr(self, k) is not None},
                                   unused=tuple(sorted(set(base.unused) | set(self.unused))),
                                   not_applied=_over_keys(self.not_applied, base.not_applied))

    # ------------------------------------------------------------------ use
    def method(self) -> str:
        """The method transformers would run with these flags: beam, sample or greedy."""
        if (self.num_beams or 1) > 1:
            if self.do_sample:
                raise GenerationConfigError(
                    f"the generation config asks for beam sampling (do_sample=True with num_beams="
                    f"{self.num_beams}), which jaxdecode does not implement; pass method='beam' or method='sample'")
            return "beam"
        return "sample" if self.do_sample else "greedy"

    def options_for(self, method: str, takes) -> dict:
        """The options these defaults give `method` (a canonical name) that takes the options `takes`."""
        from jaxdecode.options import SAMPLING
        out = {}
        if self.max_new_tokens is not None:
            out["max_new_tokens"] = self.max_new_tokens
        if self.eos_token_id is not None:
            out["eos_ids"] = list(self.eos_token_id)
        sampling = method in SAMPLING and (method != "speculative" or bool(self.do_sample))
        if sampling:
            for name in ("temperature", "top_k", "top_p", "min_p"):
                if getattr(self, name) is not None:
                    out[name] = getattr(self, name)
            if self.top_p == 0:  # transformers keeps the one most likely token: top_k=1 is that rule
                del out["top_p"]
                out["top_k"] = 1
        if self.repetition_penalty is not None:
            out["repetition_penalty"] = self.repetition_penalty
        if self.num_beams is not None and self.num_beams > 1:
            out["num_beams"] = self.num_beams
        if self.length_penalty is not None:
            out["length_penalty"] = self.length_penalty
        if self.early_stopping is not None:
            out["early_stopping"] = self.early_stopping
        if self.stop_strings:
            out["stop"] = list(self.stop_strings)
        return {k: v for k, v in out.items() if k in takes}

    def ignored_by(self, method: str, takes) -> list[str]:
        """Set fields that change transformers' output but that `method` (taking options `takes`) does not
        apply: generate warns about them rather than differ silently."""
        out = []
        if self.repetition_penalty not in (None, 1.0) and "repetition_penalty" not in takes:
            out.append(f"repetition_penalty={self.repetition_penalty}")
        if self.stop_strings and "stop" not in takes:
            out.append(f"stop_strings={list(self.stop_strings)}")
        return out + list(self.not_applied)


def _plain(value):
    """A JSON value made hashable for the "off" test (lists become tuples)."""
    return tuple(_plain(v) for v in value) if isinstance(value, (list, tuple)) else value


def _over_keys(top: tuple, base: tuple) -> tuple:
    """"key=value" entries of `top` over `base`'s (a key set in both keeps top's value)."""
    keys = {e.split("=", 1)[0] for e in top}
    return tuple(sorted(top + tuple(e for e in base if e.split("=", 1)[0] not in keys)))


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check(c: GenerationConfig) -> None:
    def bad(name, want):
        raise GenerationConfigError(f"{name}={getattr(c, name)!r} is not accepted: {name} must be {want}")

    # pad/bos ids are only kept for reference: any int, as transformers takes them (old Llama conversions
    # write pad_token_id -1 for "none").
    for name, low in (("max_new_tokens", 1), ("top_k", 0), ("num_beams", 1), ("num_return_sequences", 1),
                      ("pad_token_id", None), ("bos_token_id", None)):
        v = getattr(c, name)
        if v is not None and not (_is_int(v) and (low is None or v >= low)):
            bad(name, "an int" if low is None else f"an int >= {low}")
    for name, low, high in (("temperature", 0, None), ("top_p", 0, 1), ("min_p", 0, 1),
                            ("repetition_penalty", 0, None), ("length_penalty", None, None)):
        v = getattr(c, name)
        if v is None:
            continue
        ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and v == v and abs(v) != float("inf")
        ok = ok and (low is None or v >= low) and (high is None or v <= high)
        if not ok:
            bad(name, "a finite number" + (f" >= {low}" if low is not None else "") + (
                f" and <= {high}" if high is not None else ""))
    if c.do_sample is not None and not isinstance(c.do_sample, bool):
        bad("do_sample", "true or false")
    if c.early_stopping is not None and not (isinstance(c.early_stopping, bool) or c.early_stopping == "never"):
        bad("early_stopping", 'true, false or "never"')
    if c.eos_token_id is not None and not all(_is_int(e) and e >= 0 for e in c.eos_token_id):
        bad("eos_token_id", "a token id or a list of them")
    if c.stop_strings is not None and not all(isinstance(s, str) and s for s in c.stop_strings):
        bad("stop_strings", "a non-empty string or a list of them")

