"""Every option of `jaxdecode.generate` and `jaxdecode generate`, in one table, with one validator.

Each `Option` states its type, the values it accepts, its default (`None`: the method decides, as
`default_doc` says), which methods take it and a one-line doc. From this table:
- `generate` validates every option it is given (`resolve`) before anything decodes: a clear
  `OptionError` names the option, the bad value and what is accepted; `None` means "unset" and
  becomes the default, any other value (0 included) is used as given;
- the built-in methods register exactly the options the table lists for them (`method_options`);
- the CLI builds its `generate` flags and their help from it;
- the README's options table is `options_markdown()` (a test keeps them equal).

Values that need the model or the drafter to check (token ids < vocab size, a tree spec, verify
widths <= the tree size) are checked again by the decoders, also before decoding.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable

ALL = "*"  # Option.methods: every method (including methods registered by users)

SAMPLING = ("sample", "mirostat", "speculative", "constrained_sample", "asap")
BEAMS = ("beam", "diverse_beam", "constrained_beam")
CONSTRAINED = ("constrained_beam", "constrained_greedy", "constrained_sample")
DIFFUSION = ("diffusion", "block_diffusion")
# Methods that take a regex / JSON-schema / grammar constraint (the decoders' `constraint=`).
STRUCTURED = ("greedy", "sample", "mirostat", "beam", "diverse_beam", "speculative", "diffusion", "block_diffusion",
              "asap")
# Methods that stop rows at stop strings (a token automaton run inside the loop: jaxdecode.stop).
STOPPING = ("greedy", "sample", "mirostat", "beam", "diverse_beam", "speculative")
# Methods that report per-token log-probs (the target's, under the distribution tokens are drawn from).
LOGPROBS = ("greedy", "sample", "mirostat", "speculative")
STRUCTURED_OPTIONS = ("regex", "json_schema", "grammar")  # each builds a constraint: one at most, not with index
SEED_MAX = 2**32 - 1  # jax.random.PRNGKey wraps larger seeds onto smaller ones


class OptionError(ValueError):
    """An option of generate() / the CLI that is unknown, of the wrong type or out of range."""


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    # int | float | bool | str | ids (list of ints) | int_or_ids | dict | mesh | texts | schemas | stops |
    # stopping (True, False or "never")
    kind: str
    doc: str
    methods: tuple  # canonical method names, or (ALL,)
    default: Any = None  # a value, {method: value}, or None (the method decides: default_doc)
    default_doc: str = ""
    low: float | None = None  # bounds of numbers (and of list entries)
    high: float | None = None
    low_open: bool = False  # low itself excluded
    high_open: bool = False
    choices: tuple | Callable[[], tuple] | None = None  # allowed strings
    # Also accepted, not listed in the docs: names registered at run time (trained-drafter kinds).
    more_choices: Callable[[], tuple] | None = None
    objects: str = ""  # also accepted: a Python object of this description (not checked further)
    required: bool = False
    cli: str | None = ""  # the CLI flag; "" = derived from the name; None = Python / --option only
    cli_repeat: bool = False  # a repeatable flag (lists)
    min_len: int = 0  # lists: at least this many entries

    def __post_init__(self):
        if self.cli == "":  # a switch that is on by default is turned off by its flag: --no-NAME
            off = self.kind == "bool" and self.default is True
            object.__setattr__(self, "cli", ("--no-" if off else "--") + self.name.replace("_", "-"))

    def takes(self, method: str) -> bool:
        return ALL in self.methods or method in self.methods

    def default_for(self, method: str):
        return self.default.get(method) if isinstance(self.default, dict) else self.default

    def allowed_choices(self) -> tuple:
        c = self.choices
        return tuple(c() if callable(c) else c or ())

    def accepts(self) -> str:
        """What the option accepts, in words (error messages, CLI help, README)."""
        if self.kind in ("int", "float", "ids", "int_or_ids"):
            lo = "" if self.low is None else ("(" if self.low_open else "[") + _num(self.low)
            hi = "" if self.high is None else _num(self.high) + (")" if self.high_open else "]")
            if lo and hi:
                rng = f"in {lo}, {hi}"
            elif lo:
                rng = f"{'>' if self.low_open else '>='} {_num(self.low)}"
            else:
                rng = ""
            text = {"int": f"an int {rng}", "float": f"a finite number {rng}",
                    "ids": f"a{' non-empty' if self.min_len else ''} list of ints, each {rng}",
                    "int_or_ids": f"an int {rng}, or a list of them (one per prompt)"}[self.kind]
            text = text.strip().removesuffix(", each")
        elif self.kind == "bool":
            text = "True or False"
        elif self.kind == "stopping":
            text = "True, False or 'never'"
        elif self.kind == "str":
            ch = self.choices
            text = ("one of " + ", ".join(self.allowed_choices())) if ch is not None else "a string"
        elif self.kind == "dict":
            text = "a dict with string keys"
        elif self.kind == "texts":
            text = "a non-empty string, or a list of them (one per prompt)"
        elif self.kind == "stops":
            text = "a non-empty string, or a list of them (the same for every prompt)"
        elif self.kind == "schemas":
            text = "a dict (or True / False), a JSON text or a .json file path, or a list of them (one per prompt)"
        elif self.kind == "grammars":
            text = "grammar text or a grammar file's path (str or os.PathLike), or a list of them (one per prompt)"
        else:
            text = "a jax.sharding.Mesh with axes named 'data' and/or 'model'"
        if self.objects:
            text += f", or {self.objects}"
        return text

    def default_text(self) -> str:
        if isinstance(self.default, dict):
            return ", ".join(f"{m}: {_num(v)}" for m, v in self.default.items())
        if self.default is not None:
            return _num(self.default)
        return self.default_doc or "unset"

    def methods_text(self) -> str:
        return "all" if ALL in self.methods else ", ".join(self.methods)


def _num(x) -> str:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return str(x)
    if x == SEED_MAX:
        return "2^32 - 1"
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _drafters() -> tuple:
    from jaxdecode.drafters import DRAFTERS
    return tuple(DRAFTERS)


def _registered_drafters() -> tuple:
    from jaxdecode.drafters import drafter_names
    return drafter_names()


def _verifiers() -> tuple:
    from jaxdecode.verifiers import VERIFIERS
    return tuple(VERIFIERS)


def _diffusion_rules() -> tuple:
    from jaxdecode.diffusion import RULES
    return tuple(RULES)


def _impls() -> tuple:
    from jaxdecode.kernels.constrained import _IMPLS
    return tuple(_IMPLS)


_TABLE = (
    # ------------------------------------------------------------------ every method
    Option("max_new_tokens", "int", "new tokens per prompt at most (EOS included)", (ALL,), 32, low=1),
    Option("eos_ids", "ids", "token ids that end a row (the EOS is kept in the output); [] = none", (ALL,),
           default_doc="the model's eos_token_id(s)", low=0, cli="--eos-id", cli_repeat=True),
    Option("cache_len", "int", "KV-cache slots per row", (ALL,), low=1,
           default_doc="prompt + new tokens (+ one draft tree) rounded up to 64"),
    Option("allow_nonfinite", "bool", "return outputs even when the model's logits were NaN/inf "
           "(stats['nonfinite_logits'] marks the rows) instead of raising", (ALL,), False),
    Option("mesh", "mesh", "device mesh: batch over 'data', parameters over 'model'", (ALL,),
           default_doc="one device", cli=None),
    Option("stop", "stops", "stop strings: a row stops once its generated text contains one (checked inside "
           "the loop by a token automaton); the returned text ends before it", STOPPING, default_doc="none",
           cli_repeat=True),
    Option("logprobs", "bool", "report each new token's log-prob under the distribution it was drawn from "
           "(the target's: after penalties, temperature, truncation and constraints)", LOGPROBS, False),
    Option("top_logprobs", "int", "also report the n most likely tokens of that distribution at each "
           "step (implies logprobs)", LOGPROBS, 0, low=0, high=20),
    # ------------------------------------------------------------------ sampling
    Option("temperature", "float", "logits / T before truncation; 0 = greedy", SAMPLING,
           {"sample": 1.0, "mirostat": 1.0, "constrained_sample": 1.0, "speculative": 0.0, "asap": 1.0}, low=0),
    Option("top_k", "int", "keep the k most likely tokens (ties: lower id); 0 = off", SAMPLING, 0, low=0),
    Option("top_p", "float", "nucleus: the smallest most-likely set with mass >= p; 1 = off", SAMPLING, 1.0,
           low=0, low_open=True, high=1),
    Option("min_p", "float", "keep tokens with p >= min_p * p_max; 0 = off", SAMPLING, 0.0, low=0, high=1),
    Option("repetition_penalty", "float", "CTRL penalty on tokens already in the prompt or output; 1 = off",
           ("greedy", "sample", "mirostat", "constrained_greedy", "constrained_sample"), 1.0,
           low=0, low_open=True),
    Option("seed", "int", "PRNG seed of the draws", SAMPLING + DIFFUSION, 0, low=0, high=SEED_MAX),
    Option("tau", "float", "Mirostat target surprise (bits)", ("mirostat",), 5.0, low=0, low_open=True),
    Option("eta", "float", "Mirostat learning rate", ("mirostat",), 0.1, low=0, low_open=True),
    # ------------------------------------------------------------------ beams
    Option("num_beams", "int", "beams per prompt (all groups together)", BEAMS, 4, low=1),
    Option("length_penalty", "float", "hypothesis score = sum logprob / length ** length_penalty", BEAMS, 1.0),
    Option("early_stopping", "stopping", "when a row whose buffer of finished beams is full stops, as in "
           "transformers: False its heuristic (the best running beam scored at its current length cannot "
           "beat them), True at once, 'never' when no running beam can (the exact best beams)",
           ("beam", "diverse_beam"), False),
    Option("num_groups", "int", "beam groups (num_beams must be a multiple)", ("diverse_beam",), 2, low=2),
    Option("diversity_penalty", "float", "Hamming diversity penalty between groups", ("diverse_beam",), 0.5,
           low=0),
    # ------------------------------------------------------------------ speculative
    Option("draft", "str", "draft model directory (drafter draft_lm; dllm: a masked-diffusion LM; trained "
           "drafters over a draft LM, e.g. accept_head)", ("speculative",),
           default_doc="none", objects="a jaxdecode Model"),
    Option("drafter", "str", "who proposes the draft tree (trained kinds: medusa .. retrieval, and kinds "
           "registered with jaxdecode.drafters.trained.register_kind, load their weights from drafter_dir)",
           ("speculative",), choices=_drafters, more_choices=_registered_drafters,
           default_doc="draft_lm with a draft model (dllm with a diffusion one), else retrieval when the target "
           "ships a datastore (<target_dir>/drafters/retrieval), else prompt_lookup; the kind in "
           "drafter_dir's config.json with drafter_dir", objects="a Drafter object or a TrainedDrafter (load_drafter)"),
    Option("drafter_dir", "str", "trained drafter directory (config.json + model.safetensors, written by "
           "`jaxdecode train KIND` / save_drafter)", ("speculative",), objects="a pathlib.Path",
           default_doc="<target_dir>/drafters/<kind> when the target ships one"),
    Option("tree", "str", "tree spec (an int N is chain:N): chain:4, static:3,2,1[:rule], "
           "eagle:depth=5,topk=8,total=32, dyspec:num_nodes=32 (retrieval drafters: chain:N / node count); "
           "auto = size and shape from measured acceptance and costs (jaxdecode.treeopt)", ("speculative",), low=1,
           default_doc="the drafter's own", objects="an int node count or a tree builder"),
    Option("verifier", "str", "acceptance rule (typical is lossy)", ("speculative",), choices=_verifiers,
           default_doc="greedy at temperature 0, else the lossless one for the drafter's child rule",
           objects="a Verifier object"),
    Option("drafter_options", "dict", "keyword options of the drafter built by name", ("speculative",),
           default_doc="none", cli=None),
    Option("verify_widths", "ids", "node counts a verification may shrink to (<= the tree size)",
           ("speculative",), default_doc="the drafter's own, else all nodes", low=1, min_len=1, cli=None),
    Option("adaptive", "bool", "adaptive speculation: each step, per row, draft only as deep as pays, down "
           "to plain decoding, from measured costs and running acceptance (false: verify every proposal "
           "whole)", ("speculative",), True,
           default_doc="true", objects="a dict of jaxdecode.adaptive.AdaptivePolicy fields (on, tuned: "
           "{'margin': 0.1, 'batch_spread': 1})"),
    Option("costs", "str", "the cost table of adaptive speculation: a JSON file written by `jaxdecode "
           "calibrate --json` (one table per batch size, one per line: the call's batch size picks its own)",
           ("speculative",), cli=None, objects="a jaxdecode.costmodel.CostTable",
           default_doc="measured once per model, drafter, device and batch size, then cached"),
    # ------------------------------------------------------------------ constrained
    Option("index", "str", "item index: .npz (jaxdecode index build) or an item file", CONSTRAINED,
           required=True, default_doc="required", objects="a TrieIndex, DynamicIndex or TrieConstraint"),
    Option("set_ids", "int_or_ids", "item set of each prompt (one int: every prompt)", CONSTRAINED,
           default_doc="set 0", low=0, cli="--set-id", cli_repeat=True),
    Option("impl", "str", "constrained top-k implementation", CONSTRAINED, "auto", choices=_impls),
    # ------------------------------------------------------------------ structured output
    Option("regex", "texts", "the output (up to EOS) must match this regex in full (outlines-core syntax); "
           "EOS is allowed exactly where the text matches", STRUCTURED, default_doc="none", cli_repeat=True),
    Option("json_schema", "schemas", "the output must be a JSON value valid under this JSON schema "
           "(a token automaton via outlines-core; recursive schemas: the grammar path)", STRUCTURED, default_doc="none", cli_repeat=True),
    Option("grammar", "grammars", "the output must parse under this context-free grammar (Lark or GBNF text; "
           "jaxdecode.constraints.grammar)", STRUCTURED,
           default_doc="none", cli_repeat=True),
    # ------------------------------------------------------------------ grammar-aligned sampling
    Option("num_samples", "int", "ASAp's budget: samples drawn one after another, each correcting the next "
           "(the last one is returned)", ("asap",), 16, low=1),
    Option("samples_per_round", "int", "ASAp rows per prompt per round, drawn from one proposal; must divide "
           "num_samples; 1 = the paper's sequential rule", ("asap",), 1, low=1),
    # ------------------------------------------------------------------ diffusion LMs
    Option("rule", "str", "which masked slots a forward commits (ALGORITHMS.md §5; greedy1 = one token per "
           "forward, the reference)", DIFFUSION, "greedy1", choices=_diffusion_rules,
           objects="a jaxdecode.diffusion.Rule"),
    Option("answer_length", "int", "answer slots per prompt (all start as MASK; at most max_new_tokens)",
           DIFFUSION, low=1,
           default_doc="max_new_tokens"),
    Option("block_length", "int", "slots per semi-autoregressive block (decoded left to right, block by "
           "block)", DIFFUSION, low=1, default_doc="the model's block_size (block attention), else answer_length"),
    Option("threshold", "float", "confidence threshold of the rules that have one (threshold, credit, ete, "
           "r2, adablock, dystruct; learn2pd: the filter's score)", DIFFUSION, low=0, high=1,
           default_doc="the rule's own (0.9; learn2pd 0.5)"),
    Option("tokens_per_step", "int", "slots committed per forward by rules llada and random (ccd, window, "
           "infogain: their base number)", DIFFUSION, low=1,
           default_doc="1"),
    Option("filter", "str", "Learn2PD filter directory (config.json + model.safetensors, `jaxdecode train "
           "filter`); rule learn2pd", DIFFUSION, default_doc="required by rule learn2pd",
           objects="a pathlib.Path"),
    Option("rule_options", "dict", "the rule's other parameters (e.g. freedave {\"draft\": 4}, factor "
           "{\"factor\": 1.0}; see jaxdecode.diffusion)", DIFFUSION, default_doc="none", cli=None),
    Option("diffusion_cache", "str", "KV cache of method diffusion: none (exact), prefix / dual (Fast-dLLM's "
           "approximate caches, refreshed at block boundaries)", ("diffusion",), "none",
           choices=("none", "prefix", "dual")),
    Option("max_forwards", "int", "loop steps at most (rows still masked then: stats['unfinished'])", DIFFUSION,
           low=1, default_doc="answer_length + 1"),
)
OPTIONS: dict[str, Option] = {o.name: o for o in _TABLE}


def method_options(method: str) -> tuple:
    """Names of the options the table lists for `method` beyond those every method takes."""
    return tuple(o.name for o in _TABLE if method in o.methods)


def common_options() -> tuple:
    return tuple(o.name for o in _TABLE if ALL in o.methods)


# ----------------------------------------------------------------------------- value checks
def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _in_range(opt: Option, x) -> bool:
    if opt.low is not None and (x < opt.low or (opt.low_open and x == opt.low)):
        return False
    if opt.high is not None and (x > opt.high or (opt.high_open and x == opt.high)):
        return False
    return True


def _ids(value):
    """value as a list if it is a flat sequence / 1-D array, else None."""
    import numpy as np
    if isinstance(value, (str, bytes, dict)) or isinstance(value, numbers.Number):
        return None
    if isinstance(value, np.ndarray):
        return list(value) if value.ndim == 1 else None
    try:
        return list(value)
    except TypeError:
        return None


def check_option(name: str, value):
    """Raise OptionError unless `value` is acceptable for option `name` (None = unset is acceptable)."""
    if name not in OPTIONS:
        raise OptionError(f"unknown option {name!r}; options: {', '.join(OPTIONS)}")
    opt = OPTIONS[name]
    if value is None:
        return
    ok = True
    if opt.objects and not isinstance(value, (str, bytes, numbers.Number)):
        return  # an object (Model, Drafter, builder, index): the method checks it
    if opt.kind == "int":
        ok = _is_int(value) and _in_range(opt, value)
    elif opt.kind == "float":
        ok = _is_real(value) and _in_range(opt, value)
    elif opt.kind == "bool":
        ok = isinstance(value, bool)
    elif opt.kind == "stopping":
        ok = isinstance(value, bool) or value == "never"
    elif opt.kind == "str":
        if opt.objects and _is_int(value) and opt.low is not None:  # tree: a node count
            ok = _in_range(opt, value)
        else:
            choices = opt.allowed_choices() + (opt.more_choices() if opt.more_choices else ())
            ok = isinstance(value, str) and (opt.choices is None or value in choices)
    elif opt.kind in ("ids", "int_or_ids"):
        if opt.kind == "int_or_ids" and _is_int(value):
            ok = _in_range(opt, value)
        else:
            items = _ids(value)
            ok = items is not None and all(_is_int(v) and _in_range(opt, v) for v in items)
            ok = ok and len(items) >= opt.min_len
    elif opt.kind == "dict":
        ok = isinstance(value, dict) and all(isinstance(k, str) for k in value)
    elif opt.kind in ("texts", "schemas", "grammars"):
        import os

        def one(v):
            if opt.kind == "schemas" and isinstance(v, (dict, bool, os.PathLike)):  # true / false: schemas too
                return True
            if opt.kind == "grammars" and isinstance(v, os.PathLike):
                return True
            return isinstance(v, str) and bool(v.strip())
        items = [value] if one(value) else _ids(value)
        ok = bool(items) and all(one(v) for v in items)
    elif opt.kind == "stops":  # whitespace is a fine stop string ("\n\n"); the empty string would stop at once
        items = [value] if isinstance(value, str) else _ids(value)
        ok = bool(items) and all(isinstance(v, str) and v for v in items)
    elif opt.kind == "mesh":
        import jax

        from jaxdecode.sharding import check_mesh
        ok = isinstance(value, jax.sharding.Mesh)
        if ok:
            try:
                check_mesh(value)
            except ValueError as e:
                raise OptionError(f"option {name}: {e}") from None
    if not ok:
        raise OptionError(f"option {name}={value!r} is not accepted: {name} must be {opt.accepts()} "
                          f"({opt.doc})")


def resolve(method: str, given: dict, *, batch: int | None = None) -> dict:
    """Check the options `given` to `method` (a registered name) and return every option the method
    takes, unset ones (absent or None) filled with the table's defaults. `batch` (the number of
    prompts), when known, enables the per-prompt checks. Raises OptionError."""
    from jaxdecode.registry import get_method
    spec = get_method(method)
    constraints = [k for k in STRUCTURED_OPTIONS + ("index",) if given.get(k) is not None]
    if len(constraints) > 1:
        raise OptionError(f"options {constraints} each constrain the output; give one of regex, json_schema, "
                          f"grammar (or index, an item set): to combine constraints, intersect them "
                          f"(jaxdecode.constraints)")
    taken = set(common_options()) | set(spec.options)
    unknown = sorted(k for k, v in given.items() if k not in taken and v is not None)
    if unknown:
        elsewhere = "".join(f"; {k} is taken by {OPTIONS[k].methods_text()}" for k in unknown if k in OPTIONS)
        raise OptionError(f"method {spec.name!r} does not take option(s) {unknown}{elsewhere}; {spec.name} takes "
                          f"{sorted(taken - {'mesh'})} (see jaxdecode.options.OPTIONS)")
    out = {}
    for name in sorted(taken):
        value = given.get(name)
        opt = OPTIONS.get(name)
        if opt is None:  # an option of a method registered by a user: passed as given
            out[name] = value
            continue
        check_option(name, value)
        if value is None:
            if opt.required:
                raise OptionError(f"method {spec.name!r} needs option {name}= ({opt.doc}): "
                                  f"{opt.accepts()}")
            value = opt.default_for(spec.name)
        elif opt.kind == "mesh":  # jax.make_mesh's Explicit axes: the decoders need Auto ones
            from jaxdecode.sharding import auto_axes
            value = auto_axes(value)
        out[name] = value
    _cross_checks(spec.name, out, batch)
    return out


def _cross_checks(method: str, opts: dict, batch: int | None) -> None:
    if method == "diverse_beam" and opts["num_beams"] % opts["num_groups"]:
        raise OptionError(f"num_beams ({opts['num_beams']}) must be a multiple of num_groups "
                          f"({opts['num_groups']}): each group holds num_beams / num_groups beams")
    drafter = opts.get("drafter")
    if (opts.get("draft") is not None and drafter is not None and drafter not in ("draft_lm", "dllm")
            and not _takes_drafter_dir(drafter)):  # trained kinds that draft with an LM take it too
        raise OptionError(f"draft is used only by drafter 'draft_lm' or 'dllm' (and trained drafters over a draft "
                          f"LM, e.g. accept_head), but the drafter is "
                          f"{drafter if isinstance(drafter, str) else type(drafter).__name__!r}: drop draft "
                          f"or use drafter='draft_lm'")
    drafter_dir = opts.get("drafter_dir")
    if drafter_dir is not None and drafter is not None and not _takes_drafter_dir(drafter):
        raise OptionError(f"drafter_dir is for trained drafters, but the drafter is "
                          f"{drafter if isinstance(drafter, str) else type(drafter).__name__!r}: drop "
                          f"drafter_dir, or name a trained kind (e.g. drafter='medusa')")
    set_ids = opts.get("set_ids")
    if batch is not None and set_ids is not None and not _is_int(set_ids) and len(_ids(set_ids)) != batch:
        raise OptionError(f"set_ids has {len(_ids(set_ids))} entries but there are {batch} prompts: give "
                          f"one item set per prompt, or one int for all")
    for name in STRUCTURED_OPTIONS:
        value = opts.get(name)
        if batch is not None and per_prompt(value) and len(value) != batch:
            raise OptionError(f"{name} has {len(value)} entries but there are {batch} prompts: give one per "
                              f"prompt, or one value for all")


def per_prompt(value) -> bool:
    """A structured-output option given as a list (one value per prompt), not one value for all."""
    return value is not None and not isinstance(value, (str, dict, bool)) and not hasattr(value, "__fspath__")


def _takes_drafter_dir(drafter) -> bool:
    """A trained kind's name (its weights come from drafter_dir)."""
    from jaxdecode.drafters.trained import is_trained_kind
    return is_trained_kind(drafter)


# ----------------------------------------------------------------------------- docs
def options_markdown() -> str:
    """The README's options table."""
    rows = ["| option | accepts | default | methods | what |", "|---|---|---|---|---|"]
    for o in _TABLE:
        cells = (f"`{o.name}`", o.accepts(), o.default_text(), o.methods_text(), o.doc)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def cli_help(opt: Option) -> str:
    """The help of an option's CLI flag."""
    if opt.kind == "bool":
        accepts = "no value"
    else:
        repeat = (" (repeat the flag, or comma-separate them: 7,9; [] adds none)" if opt.kind == "ids" else
                  " (repeat the flag, one value each)")
        accepts = opt.accepts() + (repeat if opt.cli_repeat else "")
    return f"{opt.doc}. Accepts {accepts}; default: {opt.default_text()}; methods: {opt.methods_text()}"
