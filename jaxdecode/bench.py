"""`jaxdecode bench`: choose a decoding method for your model and prompts by measuring it.

    jaxdecode bench --model DIR --prompts-file F --method greedy \\
        --method 'speculative:drafter=prompt_lookup,tree=chain:4' --batch-size 1,4 --max-new-tokens 64

`run_bench(model, prompts, methods, batch_sizes, ...)` returns one row (a dict) per method x batch
size; the CLI only parses arguments and prints the rows (a table, or one JSON object per line).

Method strings: `NAME` or `NAME:KEY=VALUE,KEY=VALUE,...` (`parse_method`). NAME is any method of
`jaxdecode.methods()`; each KEY is an option of `jaxdecode.options.OPTIONS` ('-' may stand for '_');
a VALUE is parsed as JSON when it is JSON (`3`, `0.7`, `[2,4]`, `{"lengths":[1,3,8]}`), else kept as a
string. A comma starts a new KEY=VALUE only when `WORD=` follows it; any other comma belongs to the
value, and inside a `tree=` value of named settings (`eagle:depth=5,...`, `auto:depth=8,...`) a `WORD=`
that is not an option name belongs to the tree spec, so tree specs need no quoting:
`speculative:tree=static:3,2,1,verifier=topk`, `speculative:tree=eagle:depth=5,topk=8,total=32,seed=1`.
A value that must contain `,WORD=` itself can be written as a JSON string (`drafter_options={"a":1}`
needs nothing: `"a"` is not a WORD).

Bench-wide options (`temperature`, `seed`, `draft`, `drafter_dir` of run_bench; the CLI's --temperature,
--seed, --draft, --drafter-dir) go to the methods that take them and do not set them, and never change
which drafter a method runs (`_merge_globals`): `draft` to a speculative method that names no drafter
(it then drafts with the draft model, as `jaxdecode generate --draft` does) or a drafter that drafts
with one; `drafter_dir` to a method naming the trained kind the directory holds, or naming no drafter
and given no draft model. A bench-wide `draft` or `drafter_dir` that no method takes is an error.

How it measures, per method x batch size: every prompt runs once, in batches of that size in file
order; a last partial batch (or a batch size above the prompt count) is filled by repeating prompts
from the start, and the row says how many rows were fill (`padded_rows`; they are decoded and counted
like the others, they are the batch's real work, but left out of `same_as_first`). One warm-up pass
over all batches is not timed (it compiles every batch's shapes: batches of different prompt lengths
have different shapes, and a call that compiles also pays JAX dispatch work of tens of milliseconds
that its compile events do not cover); then `repeats` timed passes. Times are `generate`'s
`batch_stats["seconds"]`, which exclude compilation; compilation (tracing, lowering, XLA compile) over all
the row's calls is summed apart in `compile_seconds`.

Row fields (`ROW_FIELDS`; the JSON rows have exactly these keys):
    method               the method string as given
    name                 the canonical method name
    options              the options given to generate (JSON-able: models as their paths)
    batch_size           prompts per generate call
    prompts              distinct prompts (lines of the prompts file)
    batches              generate calls per pass
    padded_rows          fill rows per pass (repeated prompts completing the last batch)
    repeats              timed passes
    new_tokens           new tokens decoded in the timed passes (all rows)
    seconds              decode seconds of the timed passes, compilation excluded
    tokens_per_second    new_tokens / seconds
    compile_seconds      seconds spent compiling over every call of this row (warm-up pass included);
                         null when this JAX cannot report it
    speedup              tokens_per_second / that of the first method at the same batch size
    target_calls_per_token  target forwards (prefill included) per new token of a row:
                         sum over calls of target_calls * rows / new_tokens (1.0 for plain decoding)
    tau                  speculative: new tokens per verification step (bonus included) over all rows;
                         null for other methods
    accept_rate_by_depth speculative: the engine's acceptance rate at each draft depth, averaged over
                         the timed calls weighted by their verification steps; null otherwise
    same_as_first        true/false: every output (fill rows excluded) equals the first method's at
                         this batch size, when both decode greedily (argmax: greedy, or temperature 0
                         without a repetition penalty); null when either samples or is not argmax
    device               the JAX device kind the row ran on
    jax_version          jax.__version__
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from typing import Callable, Sequence

ROW_FIELDS = ("method", "name", "options", "batch_size", "prompts", "batches", "padded_rows", "repeats",
              "new_tokens", "seconds", "tokens_per_second", "compile_seconds", "speedup",
              "target_calls_per_token", "tau", "accept_rate_by_depth", "same_as_first", "device",
              "jax_version")


class BenchError(ValueError):
    """A bad bench request (method string, batch sizes, prompts file): the message says what to fix."""


# ----------------------------------------------------------------------------- compile time
# JAX reports the duration of tracing, jaxpr -> MLIR lowering and XLA compilation of each top-level jit
# as "/jax/core/compile/..." events (jaxpr_trace_duration, jaxpr_to_mlir_module_duration,
# backend_compile_duration in JAX 0.4 - 0.10). Any event under the prefix counts, and overlapping ones
# count once (their union of wall-clock spans), so an event JAX adds or nests later is not counted twice.
COMPILE_EVENT_PREFIX = "/jax/core/compile/"


class CompileClock:
    """A context manager: the wall seconds this thread spends in JAX compilation while inside it.

    `seconds` is set on exit: a float, or None when this JAX has no event-duration listeners (then
    compilation cannot be told apart; callers must say so rather than report 0).
    """

    def __init__(self):
        self.seconds: float | None = None
        self._spans: list[tuple[float, float]] = []
        self._thread = threading.get_ident()
        self._unregister = None

    def _listen(self, event, duration, *args, **kwargs):
        # Called by JAX as each event ends: its span is [now - duration, now]. Other threads' compiles
        # belong to their own calls.
        if isinstance(event, str) and event.startswith(COMPILE_EVENT_PREFIX) and \
                threading.get_ident() == self._thread:
            end = time.perf_counter()
            self._spans.append((end - float(duration), end))

    def __enter__(self) -> "CompileClock":
        try:
            from jax import monitoring
            register = monitoring.register_event_duration_secs_listener
            self._unregister = monitoring.unregister_event_duration_listener
        except (ImportError, AttributeError):  # a JAX line without these: seconds stays None
            return self
        self._thread = threading.get_ident()
        register(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        if self._unregister is None:
            return
        try:
            self._unregister(self._listen)
        except (AssertionError, ValueError):  # someone cleared JAX's listeners meanwhile
            pass
        self.seconds = _union_length(self._spans)


def _union_length(spans) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for s, e in sorted(spans):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


# ----------------------------------------------------------------------------- requests
def parse_method(text: str) -> tuple[str, dict]:
    """`NAME` or `NAME:KEY=VALUE,...` -> (canonical method name, {option: value}), checked against the
    options table (jaxdecode.options.resolve). Raises BenchError naming what to fix."""
    from jaxdecode.options import OPTIONS, resolve
    from jaxdecode.registry import get_method
    if not isinstance(text, str) or not text.strip():
        raise BenchError(f"--method {text!r}: give NAME or NAME:KEY=VALUE,... (see `jaxdecode methods`)")
    name, _, rest = text.strip().partition(":")
    try:
        spec = get_method(name.strip())
    except ValueError as e:
        raise BenchError(f"--method {text!r}: {e}") from None
    options: dict = {}
    for item in _split_options(rest, set(OPTIONS)) if rest.strip() else ():
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not re.fullmatch(r"[A-Za-z_]\w*", key):
            raise BenchError(f"--method {text!r}: {item!r} is not KEY=VALUE; write "
                             f"NAME:KEY=VALUE,KEY=VALUE (e.g. speculative:drafter=prompt_lookup,tree=chain:4)")
        if key not in OPTIONS:
            raise BenchError(f"--method {text!r}: unknown option {key!r}; options: {', '.join(OPTIONS)}")
        if key in options:
            raise BenchError(f"--method {text!r}: option {key} is given twice; give it once")
        options[key] = _value(value)
    try:
        resolve(spec.name, options)
    except ValueError as e:
        raise BenchError(f"--method {text!r}: {e}") from None
    return spec.name, options


def _split_options(rest: str, names: set) -> list[str]:
    """Split `KEY=VALUE,KEY=VALUE` at the commas (outside JSON strings) followed by `WORD=`; other
    commas stay in their value (static:3,2,1, [2,4]). Inside a tree= value of named settings, `WORD=`
    that is not an option name is the tree spec's own (eagle:depth=5,topk=8,total=32) and stays in it."""
    items, start, in_str = [], 0, False
    for i, c in enumerate(rest):
        if c == '"' and (i == 0 or rest[i - 1] != "\\"):
            in_str = not in_str
        elif c == "," and not in_str and re.match(r"\s*[A-Za-z_][\w-]*\s*=", rest[i + 1:]):
            items.append(rest[start:i])
            start = i + 1
    items.append(rest[start:])
    merged: list[str] = []
    for item in items:
        key = item.partition("=")[0].strip().replace("-", "_")
        # Only a tree spec of named settings (eagle:depth=5,..., auto:depth=8) takes more WORD= items: after
        # chain:4 or static:3,2,1 a WORD= is a (misspelt) option, reported as one, not as a bad int.
        if merged and key not in names and _NAMED_TREE.match(merged[-1]):
            merged[-1] += "," + item
        else:
            merged.append(item)
    return merged


_NAMED_TREE = re.compile(r"\s*tree\s*=\s*\w+\s*:\s*[A-Za-z_][\w-]*\s*=")


def _value(text: str):
    text = text.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_batch_sizes(text) -> tuple[int, ...]:
    """'1,4' (or ints) -> (1, 4); each an int >= 1, no repeats (costmodel's rule, as a BenchError)."""
    from jaxdecode.costmodel import parse_batch_sizes as parse
    try:
        return parse(text if isinstance(text, str) else ",".join(str(p) for p in text))
    except ValueError as e:
        raise BenchError(str(e)) from None


def read_prompts(path) -> list:
    """One prompt per line (blank lines skipped), or a .jsonl file of {"prompt"} / {"messages"} / {"ids"}
    objects: read by `jaxdecode generate --prompts-file`'s own reader, so both split a file into the same
    prompts (str.splitlines: form feeds and the other Unicode line breaks too)."""
    import os

    from jaxdecode.cli import read_prompts_file
    if not os.path.exists(path):
        raise BenchError(f"prompts file {str(path)!r} does not exist: give --prompts-file FILE, a text "
                         f"file with one prompt per line")
    if os.path.isdir(path):
        raise BenchError(f"prompts file {str(path)!r} is a directory: give a text file with one prompt "
                         f"per line")
    try:
        return read_prompts_file(path)
    except OSError as e:  # its message names --prompts-file
        raise BenchError(str(e)) from None
    except UnicodeDecodeError as e:
        raise BenchError(f"prompts file {str(path)!r} is not text ({e.reason}): give a text file with one "
                         f"prompt per line") from None
    except ValueError as e:  # no prompts, a bad JSONL line: the message starts with the path
        hint = "" if str(path).endswith((".jsonl", ".ndjson")) else ": write one prompt per line"
        raise BenchError(f"prompts file {e}{hint}") from None


# ----------------------------------------------------------------------------- running
def batches_of(n: int, size: int) -> tuple[list[list[int]], int]:
    """Indices of n prompts in batches of `size` (file order); the last batch is filled by cycling from
    the first prompt. Returns (batches, fill rows)."""
    order = list(range(n))
    fill = -n % size
    order += [i % n for i in range(fill)]
    return [order[i:i + size] for i in range(0, len(order), size)], fill


def _argmax_decoding(name: str, options: dict) -> bool:
    """Whether (name, options) decodes by argmax, so its output is comparable token for token."""
    from jaxdecode.options import OPTIONS
    if name not in ("greedy", "sample", "speculative"):
        return False
    temp = options.get("temperature")
    temp = OPTIONS["temperature"].default_for(name) if temp is None else temp
    rep = options.get("repetition_penalty")
    return (name == "greedy" or temp == 0) and rep in (None, 1, 1.0) and options.get("verifier") != "typical"


def _preload(model, name: str, options: dict, given: dict, cache: dict) -> tuple[dict, dict]:
    """(options to run with, options to report): the draft model and a trained drafter loaded once,
    so the timed calls do not reload them from disk (generate would, inside its timing). `given`: the
    options of the method string (the rest are bench-wide, merged by _merge_globals only where they fit)."""
    import jaxdecode
    from jaxdecode.drafters.trained import find_drafter_dir, is_trained_kind, load_drafter
    run, shown = dict(options), dict(options)
    if isinstance(run.get("draft"), str):
        key = ("draft", run["draft"])
        if key not in cache:
            cache[key] = jaxdecode.load(run["draft"])
        run["draft"] = cache[key]
    drafter, ddir = run.get("drafter"), run.get("drafter_dir")
    if name == "speculative" and (is_trained_kind(drafter) or (drafter is None and ddir is not None)):
        if ddir is None:
            ddir = find_drafter_dir(model, drafter)
        if ddir is None:
            raise BenchError(f"drafter {drafter!r} is a trained drafter and the target ships none: give its "
                             f"weights as drafter_dir=DIR in the method string, or --drafter-dir DIR (which "
                             f"goes to the methods whose drafter is the kind it holds)")
        key = ("drafter", str(ddir))
        if key not in cache:
            cache[key] = load_drafter(ddir, model)
        td = cache[key]
        if drafter is not None and td.name != drafter:
            raise BenchError(f"drafter {drafter!r} was asked for but {ddir} holds a {td.name!r} "
                             f"drafter: name drafter={td.name} or give the {drafter} directory")
        run["drafter"], run["drafter_dir"] = td, None
        shown["drafter"], shown["drafter_dir"] = td.name, str(ddir)
        draft = run.pop("draft", None)
        if draft is not None and _kind_takes_draft(td.name):  # how a loaded drafter takes it
            run["drafter_options"] = dict(run.get("drafter_options") or {}, draft_model=draft)
        elif draft is not None:  # never dropped silently (_merge_globals gives none to such a drafter)
            raise BenchError(f"the {td.name} drafter does not draft with a draft model: drop draft")
    return run, shown


def _kind_takes_draft(kind: str) -> bool:
    """Whether trained kind `kind` drafts with a draft LM (its make takes draft_model)."""
    from jaxdecode.drafters.trained import get_kind
    try:
        return get_kind(kind).takes_draft_model
    except ValueError as e:  # a kind this installation lacks (a directory's config.json may name one)
        raise BenchError(str(e)) from None


def prepare_methods(methods: Sequence[str], *, max_new_tokens: int, temperature=None, seed=None, draft=None,
                    drafter_dir=None) -> list[tuple]:
    """[(text, method name, its options with the bench-wide ones, its own options)] of the --method
    strings, every check that needs no model done: the options table, a tree spec that does not parse,
    and a verifier that cannot decode at the temperature. So a bad last method fails before the first
    one runs. Raises BenchError."""
    from jaxdecode.options import resolve
    defaults = dict(temperature=temperature, seed=seed, draft=draft, drafter_dir=drafter_dir)
    # a bad directory fails here, before any method runs
    dir_kind = None if drafter_dir is None else _dir_kind(drafter_dir, "--drafter-dir")
    parsed = []
    for text in methods:
        name, given = parse_method(text)
        options = _merge_globals(name, given, defaults, text)
        try:
            resolve(name, dict(options, max_new_tokens=max_new_tokens))
            _check_tree_and_verifier(options)
        except ValueError as e:
            raise BenchError(f"--method {text!r} with the bench-wide options: {e}") from None
        parsed.append((text, name, options, given))
    # A bench-wide model or directory that no method runs with is a mistake to report, not to skip.
    for key, flag, goes, example in (
            ("draft", "--draft", "speculative methods that name no drafter or one that drafts with a draft model "
             "(draft_lm, dllm, accept_head)", "draft_lm"),
            ("drafter_dir", "--drafter-dir", "speculative methods that name the kind it holds, or name no drafter "
             "and get no draft model", dir_kind)):
        if defaults[key] is not None and not any(opts.get(key) is defaults[key] and key not in given
                                                 for _, _, opts, given in parsed):
            raise BenchError(f"{flag} is used by no --method: it goes to the {goes}; add a method such as "
                             f"'speculative:drafter={example}', or drop {flag}")
    return parsed


def _check_tree_and_verifier(options: dict) -> None:
    """The checks of a speculative method's tree and verifier that need no model (ValueError)."""
    from jaxdecode.drafters.builders import parse_tree_spec
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.speculative import check_verifier_temperature
    from jaxdecode.treeopt import is_auto, parse_auto
    from jaxdecode.verifiers import get_verifier
    tree = options.get("tree")
    if isinstance(tree, str) and not tree.startswith("nodes:"):  # nodes:N: lookup drafters
        try:
            parse_auto(tree) if is_auto(tree) else parse_tree_spec(tree)
        except ValueError as e:
            raise ValueError(f"{e}{_misspelt_option_hint(tree, str(e))}") from None
    if options.get("verifier") is not None:  # the engine's own check (the temperature: --temperature T)
        check_verifier_temperature(get_verifier(options["verifier"]),
                                   SamplerConfig(temperature=float(options.get("temperature") or 0.0)))


def _misspelt_option_hint(tree: str, error: str) -> str:
    """' (is 'vrifier' a misspelt option 'verifier'?)' for a WORD= of a tree spec that its error names and
    that is close to an option name: inside a tree spec of named settings a WORD= that is no option
    belongs to the spec (_split_options), so a misspelt option shows up as a bad tree setting."""
    import difflib

    from jaxdecode.options import OPTIONS
    for word in re.findall(r"[,:]\s*([A-Za-z_][\w-]*)\s*=", tree):
        key = word.replace("-", "_")
        close = difflib.get_close_matches(key, OPTIONS, n=1)
        if key not in OPTIONS and close and (f"'{word}'" in error or f"'{word}=" in error):
            return f" (is {word!r} a misspelt option {close[0]!r}?)"
    return ""


# Untrained drafters that draft with the draft model (make_drafter's names for draft_lm, and dllm).
_DRAFT_MODEL_DRAFTERS = ("draft_lm", "draft", "model", "dllm")


def _merge_globals(name: str, options: dict, defaults: dict, text: str = "") -> dict:
    """The bench-wide options (temperature, seed, draft, drafter_dir) added where the method takes
    them and does not set them itself; draft / drafter_dir only where they fit the method's drafter, so
    a bench-wide option never changes which drafter a method runs (BenchError when that is ambiguous):
    - draft: a method naming no drafter (it drafts with the draft model, as `generate --draft` does) or
      a drafter that takes one (draft_lm, dllm, a trained kind whose make takes draft_model);
    - drafter_dir: a method naming the trained kind the directory holds, or naming no drafter and having
      no draft model (it runs the directory's kind, as `generate --drafter-dir` does)."""
    from jaxdecode.drafters.trained import is_trained_kind
    from jaxdecode.registry import get_method
    taken = set(get_method(name).options)
    out = dict(options)
    for key in ("temperature", "seed"):
        if defaults[key] is not None and key in taken and out.get(key) is None:
            out[key] = defaults[key]
    drafter, own_dir = options.get("drafter"), options.get("drafter_dir")
    draft, ddir = defaults["draft"], defaults["drafter_dir"]
    if draft is not None and "draft" in taken and out.get("draft") is None:
        if drafter is None and own_dir is not None:  # the method's own trained drafter: if it takes one
            fits = _kind_takes_draft(_dir_kind(own_dir, f"--method {text!r}: drafter_dir"))
        elif drafter is None:
            fits = True
        else:
            fits = drafter in _DRAFT_MODEL_DRAFTERS or (is_trained_kind(drafter) and _kind_takes_draft(drafter))
        if fits:
            out["draft"] = draft
    if ddir is not None and "drafter_dir" in taken and own_dir is None:
        kind = _dir_kind(ddir, "--drafter-dir")
        if drafter is None and out.get("draft") is not None and _kind_takes_draft(kind):
            raise BenchError(f"--method {text!r} names no drafter and gets both a draft model and --drafter-dir, "
                             f"whose {kind!r} drafter drafts with a draft model: it could run either; name the "
                             f"drafter: drafter={kind} or drafter=draft_lm")
        if drafter == kind or (drafter is None and out.get("draft") is None):
            out["drafter_dir"] = ddir
    return out


def _dir_kind(path, what: str) -> str:
    """The trained kind a drafter directory's config.json names (BenchError when it cannot be read)."""
    from jaxdecode.drafters.trained import MARKER, read_drafter_config
    try:
        return read_drafter_config(path)[MARKER]
    except ValueError as e:
        raise BenchError(f"{what} {path}: {e}") from None


def _jsonable_options(options: dict) -> dict:
    out = {}
    for k, v in options.items():
        if v is None:
            continue
        if isinstance(v, (str, int, float, bool, list, dict)):
            out[k] = v
        else:  # a Model, a TrainedDrafter, a builder: its path when it has one
            path = getattr(v, "path", None)
            out[k] = str(path) if path is not None else type(v).__name__
    return out


def run_bench(model, prompts: Sequence[str], methods: Sequence[str], batch_sizes=(1,), *,
              max_new_tokens: int = 32, temperature: float | None = None, seed: int | None = None,
              draft=None, drafter_dir=None, repeats: int = 1,
              progress: Callable[[str], None] | None = None) -> list[dict]:
    """Measure each method string at each batch size on `prompts` (module docstring: how, and the row
    fields). `draft` / `drafter_dir` / `temperature` / `seed` go to every method that takes them and
    does not set them in its string. Returns the rows, batch size by batch size, methods in order.
    Each row's compiled programs are released when it is done (`jax.clear_caches()`): on a CPU a process
    that keeps a few dozen decoders compiled runs out of memory maps (README, "Many configurations in
    one process"), and a row's timing never includes its compile time anyway."""
    import jax

    import jaxdecode
    if not prompts:
        raise BenchError("no prompts: give at least one")
    if not methods:
        raise BenchError("no methods: give at least one --method (the first is the baseline of speedup)")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise BenchError(f"repeats={repeats!r}: give an int >= 1 (timed passes over the prompts)")
    sizes = parse_batch_sizes(batch_sizes)
    parsed = prepare_methods(methods, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                             draft=draft, drafter_dir=drafter_dir)
    say = progress or (lambda msg: None)
    loaded: dict = {}
    # Draft models and trained drafters loaded (and a missing or mismatched one reported) before any
    # method is measured, once for every batch size.
    parsed = [(text, name, options, *_preload(model, name, options, given, loaded))
              for text, name, options, given in parsed]
    device = jax.devices()[0].device_kind
    rows = []
    for size in sizes:
        groups, fill = batches_of(len(prompts), size)
        first = None
        for text, name, options, run_opts, shown in parsed:

            def call(idx, opts=run_opts, name=name):
                return jaxdecode.generate(model, [prompts[i] for i in idx], method=name,
                                          max_new_tokens=max_new_tokens, **opts)
            say(f"{text} at batch {size}: warm-up pass, then {repeats} timed pass(es) of {len(groups)} call(s)")
            compile_s = 0.0
            for idx in groups:  # every batch's shapes compiled before timing (prompt lengths differ)
                compile_s = _add(compile_s, _compile_of(call(idx)))
            outputs, acc = None, _Totals()
            for rep in range(repeats):
                pass_out = []
                for idx in groups:
                    res = call(idx)
                    compile_s = _add(compile_s, _compile_of(res))
                    acc.add(res)
                    pass_out.append([r.tokens for r in res])
                if rep == 0:
                    outputs = [toks for batch in pass_out for toks in batch][: len(prompts)]
            row = dict(method=text, name=name, options=_jsonable_options(shown), batch_size=size,
                       prompts=len(prompts), batches=len(groups), padded_rows=fill, repeats=repeats,
                       **acc.summary(), compile_seconds=None if compile_s is None else round(compile_s, 4),
                       device=device, jax_version=jax.__version__)
            argmax = _argmax_decoding(name, options)
            if first is None:
                first = (row, outputs, argmax)
                row["speedup"] = 1.0
                row["same_as_first"] = True if argmax else None
            else:
                base, base_out, base_argmax = first
                row["speedup"] = _ratio(row["tokens_per_second"], base["tokens_per_second"])
                row["same_as_first"] = (outputs == base_out) if (argmax and base_argmax) else None
            rows.append({k: row[k] for k in ROW_FIELDS})
            say(f"{text} at batch {size}: {row['tokens_per_second']} tokens/s, speedup {row['speedup']}")
            jax.clear_caches()
    return rows


def _compile_of(results) -> float | None:
    return results[0].batch_stats.get("compile_seconds")


def _add(a, b):
    return None if a is None or b is None else a + b


def _ratio(a, b):
    return None if a is None or not b else round(a / b, 3)


class _Totals:
    """Sums over the timed calls of one row."""

    def __init__(self):
        self.tokens = self.seconds = self.calls = self.verify = 0
        self.depth_sum, self.depth_weight, self.spec = None, 0, False

    def add(self, results) -> None:
        import numpy as np
        self.seconds += results[0].batch_stats["seconds"]  # one call: the whole batch's
        self.tokens += sum(r.stats["new_tokens"] for r in results)
        # target_calls are the batch's (one batched forward serves every row): counted per row as before
        self.calls += results[0].batch_stats.get("target_calls", 0) * len(results)
        if "verify_calls" in results[0].stats:
            self.spec = True
            steps = sum(r.stats["verify_calls"] for r in results)
            self.verify += steps
            rate = np.asarray(results[0].batch_stats.get("accept_rate_by_depth", []), float)  # the batch's
            self.depth_sum = rate * steps if self.depth_sum is None else self.depth_sum + rate * steps
            self.depth_weight += steps

    def summary(self) -> dict:
        tps = round(self.tokens / self.seconds, 2) if self.seconds > 0 else None
        depth = None
        if self.spec and self.depth_weight:
            depth = [round(float(x), 4) for x in self.depth_sum / self.depth_weight]
        return dict(new_tokens=self.tokens, seconds=round(self.seconds, 4), tokens_per_second=tps,
                    target_calls_per_token=round(self.calls / self.tokens, 4) if self.tokens else None,
                    tau=round(self.tokens / self.verify, 4) if self.spec and self.verify else None,
                    accept_rate_by_depth=depth)


# ----------------------------------------------------------------------------- output
def format_table(rows: Sequence[dict]) -> str:
    """The rows as an aligned text table (one line per method x batch size)."""
    head = ("method", "batch", "tok/s", "speedup", "compile s", "tau", "calls/tok", "accept by depth",
            "same")

    def fmt(v, nd=2):
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "NO"
        if isinstance(v, float):
            return f"{v:.{nd}f}"
        return str(v)
    lines = [head]
    for r in rows:
        depth = r["accept_rate_by_depth"]
        depth = "-" if depth is None else " ".join(f"{x:.2f}" for x in depth[:8]) + (" .." if len(depth) > 8 else "")
        lines.append((r["method"], fmt(r["batch_size"]) + (f" (+{r['padded_rows']} fill)" if r["padded_rows"] else ""),
                      fmt(r["tokens_per_second"], 1), fmt(r["speedup"]), fmt(r["compile_seconds"], 1),
                      fmt(r["tau"]), fmt(r["target_calls_per_token"], 3), depth, fmt(r["same_as_first"])))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    if rows:
        out.append(f"({rows[0]['device']}, jax {rows[0]['jax_version']}; tok/s excludes compilation, "
                   f"reported apart; speedup against the first method at the same batch size)")
    return "\n".join(out)


def main_progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)
