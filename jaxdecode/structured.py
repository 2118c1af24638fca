"""Structured output for `generate` and the CLI: options regex= / json_schema= / grammar= as a Constraint,
and the check that each output is valid.

    req = structured_request(opts, batch)            # None without a structured option
    constraint, info = build_constraint(model, req, eos_ids)   # an AutomatonConstraint (or a grammar's)
    ok, validator = validate_text(req, row, text)    # regex fullmatch / jsonschema / grammar parse

Each option takes one value (every prompt) or a list with one per prompt; rows with different values get
one stacked automaton with a start state per row (`stack_automata`). The compilers are
jaxdecode.constraints.automaton (outlines-core) and, for grammars, jaxdecode.constraints.grammar.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from jaxdecode.constraints.trie import ConstraintError
from jaxdecode.options import STRUCTURED_OPTIONS, per_prompt

AUTOMATON_BACKEND = "outlines-core token automaton (device)"


@dataclasses.dataclass(frozen=True)
class StructuredRequest:
    kind: str  # "regex" | "json_schema" | "grammar"
    values: tuple  # one per row: the regex, the schema's JSON text, the grammar's text

    @property
    def distinct(self) -> tuple:
        return tuple(dict.fromkeys(self.values))


def structured_request(opts: dict, batch: int) -> StructuredRequest | None:
    """The structured option among resolved `opts` (at most one: options.resolve checks), values per row."""
    given = [k for k in STRUCTURED_OPTIONS if opts.get(k) is not None]
    if not given:
        return None
    kind = given[0]
    value = opts[kind]
    values = list(value) if per_prompt(value) else [value] * batch
    if len(values) != batch:
        raise ValueError(f"{kind} has {len(values)} entries but there are {batch} prompts: give one per prompt, "
                         f"or one value for all")
    norm = {"json_schema": _schema_text, "grammar": _grammar_text}.get(kind, str)
    return StructuredRequest(kind, tuple(norm(v) for v in values))


_GRAMMAR_SUFFIXES = (".lark", ".gbnf", ".ebnf")


def _grammar_text(grammar) -> str:
    """A grammar (its Lark / GBNF text, or the path of a file holding it) as text. Grammar text always has
    a rule (`start: ...`, `root ::= ...`), so a one-line value naming an existing file is read as that
    file; a one-line value that names no file and has no rule (no ':'), or ends in .lark / .gbnf / .ebnf,
    is an error."""
    text = str(grammar)
    if "\n" in text or not text.strip() or len(text) > 4096:
        return text
    path = Path(text.strip())
    try:
        is_file = path.is_file()
    except OSError:  # a name the OS refuses (too long, ...): grammar text
        is_file = False
    if not is_file:
        if path.suffix.lower() in _GRAMMAR_SUFFIXES or ":" not in text:
            raise FileNotFoundError(f"grammar {text[:80]!r} is neither a readable file nor grammar text: no such "
                                    f"file exists; pass the grammar's text (Lark `start: ...` or GBNF "
                                    f"`root ::= ...`) or the path of an existing .lark / .gbnf file")
        return text
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise FileNotFoundError(f"grammar file {text!r} cannot be read ({e})") from None


def _schema_text(schema) -> str:
    """A schema (dict, JSON text or file path) as JSON text, its properties in the schema's own order (the
    order the output writes them in: a "reasoning" field before an "answer"); a clear error for anything
    else."""
    if isinstance(schema, (dict, bool)):  # boolean schemas: true admits every value, false none
        return json.dumps(schema)
    text = str(schema)
    if isinstance(schema, str):
        try:
            return json.dumps(json.loads(text))
        except json.JSONDecodeError:
            pass
    path = Path(text)
    if not path.is_file():
        raise FileNotFoundError(f"json_schema {text[:80]!r} is neither JSON text nor a readable file; pass the "
                                f"schema as a dict, its JSON text, or the path of a .json file")
    try:
        return json.dumps(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        raise ValueError(f"json_schema file {text!r} is not valid JSON: {e}") from None


# ----------------------------------------------------------------------------- the constraint
def _compile(model, kind: str, value: str, eos_ids: tuple):
    from jaxdecode.constraints import automaton
    if model.tokenizer is None:
        raise ValueError(f"{kind}= needs the model's tokenizer (the token automaton is over its byte strings); "
                         f"this model has no tokenizer files")
    kw = dict(vocab_size=model.config.vocab_size, eos_ids=eos_ids)
    if kind == "regex":
        return automaton.compile_regex(value, model.tokenizer, **kw)
    if kind == "json_schema":
        schema = json.loads(value)
        try:  # recursive schemas ($ref cycles) nest: the grammar path (a pushdown automaton), not a regex
            from jaxdecode.constraints.grammar_schema import compile_schema_grammar, is_recursive_schema
        except ImportError:
            is_recursive_schema = None
        if is_recursive_schema is not None and isinstance(schema, dict) and is_recursive_schema(schema):
            return compile_schema_grammar(schema, model.tokenizer, **kw)
        return automaton.compile_json_schema(schema, model.tokenizer, **kw)
    try:
        from jaxdecode.constraints.grammar import compile_grammar
    except ImportError:
        raise ConstraintError("grammar= needs jaxdecode.constraints.grammar.compile_grammar, which this build "
                              "does not have; constrain with regex= or json_schema= instead") from None
    return compile_grammar(value, model.tokenizer, **kw)


def backend_name(compiled) -> str:
    """Who enforces a compiled constraint, in words (reported with every output)."""
    backend = getattr(compiled, "backend", None)
    if backend is None:
        return AUTOMATON_BACKEND
    if backend == "device":
        return "jaxdecode pushdown automaton (device)"
    if backend == "llguidance":
        reason = getattr(compiled, "reason", "")
        return "llguidance (host fallback" + (f": {reason})" if reason else ")")
    return str(backend)


def build_constraint(model, req: StructuredRequest, eos_ids: tuple):
    """(constraint, info): the device constraint of the request for this model's tokenizer, and
    {"constraint": kind, "constraint_backend": who enforces it}. Errors of the compilers surface unchanged."""
    compiled = {v: _compile(model, req.kind, v, tuple(eos_ids)) for v in req.distinct}
    first = compiled[req.values[0]]
    backend = backend_name(first)
    if len(compiled) == 1:
        return first.constraint(), {"constraint": req.kind, "constraint_backend": backend}
    from jaxdecode.constraints import automaton
    stack = getattr(automaton, "stack_automata", None)
    if all(getattr(a, "backend", None) == "device" for a in compiled.values()):  # device grammars stack too
        from jaxdecode.constraints.grammar import stack_grammars
        stack = stack_grammars
    elif not all(isinstance(a, automaton.TokenAutomaton) for a in compiled.values()):
        stack = None
    if stack is None and getattr(automaton, "stack_automata", None) is not None:
        raise ConstraintError(_unstackable_message(req, compiled, automaton))
    if stack is None:
        raise ConstraintError(f"{req.kind}: {len(compiled)} different values for the prompts of one call need "
                              f"stacked automata, which this build does not have for {req.kind}; give one value "
                              f"for all prompts, or call generate once per value")
    order = {v: i for i, v in enumerate(compiled)}
    stacked = stack(list(compiled.values()))
    return (stacked.constraint(starts=[order[v] for v in req.values]),
            {"constraint": req.kind, "constraint_backend": backend})


def _unstackable_message(req: StructuredRequest, compiled: dict, automaton) -> str:
    """Why the values of `req` cannot share one stacked constraint: which rows need which backend, and
    what to do. Token automata stack with token automata, device grammars with device grammars; a grammar
    on llguidance's host fallback stacks with nothing."""
    def kind_of(a):
        if isinstance(a, automaton.TokenAutomaton):
            return "automaton"
        return "llguidance" if getattr(a, "backend", None) == "llguidance" else "device_grammar"

    groups: dict = {}  # backend in words -> rows
    for row, v in enumerate(req.values):
        groups.setdefault(backend_name(compiled[v]), []).append(row)
    rows = "; ".join(f"rows {', '.join(map(str, r))}: {b}" for b, r in groups.items())
    llg_rows = [r for r, v in enumerate(req.values) if kind_of(compiled[v]) == "llguidance"]
    if llg_rows:
        what = "grammar" if req.kind == "grammar" else "schema"
        why = (f"row(s) {', '.join(map(str, llg_rows))} run on llguidance's host fallback, which holds one "
               f"{what} per call and cannot be stacked with other values")
        fix = (f"call generate once for the rows of each llguidance {what} and once for the others (a list of "
               f"{what}s that all compile to the device pushdown automaton stacks), or rewrite the {what} "
               f"so the device form holds it (the reason is in the backend above)")
    else:
        why = ("flat schemas compile to outlines-core token automata and recursive schemas ($ref cycles) to the "
               "pushdown automaton of the grammar path; the two kinds do not stack in one call"
               if req.kind == "json_schema" else "token automata and pushdown automata do not stack in one call")
        fix = ("call generate once per kind (a list of flat schemas stacks, as does a list of recursive ones), "
               "or give every row the same kind")
    return (f"{req.kind}: the prompts' {len(compiled)} different values need different backends ({rows}): "
            f"{why}; {fix}")


# ----------------------------------------------------------------------------- validity
def output_text(model, tokens, eos_ids) -> str | None:
    """The exact text of an output without its EOS, from the tokens' bytes (None: not valid UTF-8)."""
    from jaxdecode.constraints.automaton import token_bytes
    eos = set(int(e) for e in eos_ids)
    tokens = [int(t) for t in tokens]
    if tokens and tokens[-1] in eos:
        tokens = tokens[:-1]
    table = _token_bytes(model.tokenizer, token_bytes)
    try:
        return b"".join(table[t] or b"" for t in tokens).decode("utf-8")
    except (UnicodeDecodeError, IndexError):
        return None


_BYTES_CACHE: dict = {}


def _token_bytes(tokenizer, token_bytes):
    key = id(tokenizer)
    if key not in _BYTES_CACHE or _BYTES_CACHE[key][0] is not tokenizer:
        _BYTES_CACHE[key] = (tokenizer, token_bytes(tokenizer))
    return _BYTES_CACHE[key][1]


def validate_text(req: StructuredRequest, row: int, text: str | None, tokens=None, model=None):
    """(valid, validator): whether row's text satisfies its constraint, checked independently of the
    automaton: regex by Python's re.fullmatch, JSON by jsonschema (the schema's regex when jsonschema is
    not installed), a grammar by lark's Earley parser (llguidance for grammars lark cannot read).
    valid is None when no validator can read the constraint (the validator says why)."""
    value = req.values[row]
    if text is None:
        return False, "utf-8"
    if req.kind == "regex":
        return _validate_regex(value, text)
    if req.kind == "json_schema":
        schema = json.loads(value)
        try:
            import jsonschema
        except ImportError:
            from jaxdecode.constraints.automaton import schema_to_regex
            return re.fullmatch(schema_to_regex(schema), text) is not None, "the schema's regex (no jsonschema)"
        try:
            instance = json.loads(text)
        except json.JSONDecodeError:
            return False, "jsonschema"
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        # formats: the automaton enforces a format's shape only (2021-02-30 has the shape of a date); the
        # format checker judges the rest where jsonschema has a checker for the format
        checker = getattr(cls, "FORMAT_CHECKER", None)
        return cls(schema, format_checker=checker).is_valid(instance), "jsonschema"
    return _validate_grammar(value, text, tokens, model)


# POSIX classes ([[:digit:]], [a[:^space:]]): Rust's regex crate (the compiler's syntax) reads them, Python's
# re reads `[:` as two literals in a set
_POSIX_CLASS = re.compile(r"\[:\^?(?:alnum|alpha|ascii|blank|cntrl|digit|graph|lower|print|punct|space|upper|"
                          r"word|xdigit):\]")


def _rust_only_syntax(pattern: str) -> str | None:
    """What in `pattern` Python's re reads differently from Rust's regex crate (outlines-core, which
    compiles the constraint), or None: a POSIX class, a nested character class, a set operation
    (&&, --, ~~, ||) inside a class."""
    i, n, in_set, first = 0, len(pattern), False, False
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            first = False
            continue
        if not in_set:
            if c == "[":
                in_set, first = True, True
                if pattern.startswith("^", i + 1):
                    i += 1
        else:
            if c == "[" and _POSIX_CLASS.match(pattern, i):
                return f"a POSIX class {_POSIX_CLASS.match(pattern, i).group(0)}"
            if c == "[":
                return f"a nested character class at position {i}"
            if pattern[i:i + 2] in ("&&", "--", "~~", "||"):
                return f"the set operation {pattern[i:i + 2]!r} at position {i}"
            if c == "]" and not first:
                in_set = False
            first = False
        i += 1
    return None


def _validate_regex(pattern: str, text: str):
    """re.fullmatch where Python's re reads the pattern as the compiler (Rust's regex crate) does; (None, why)
    where it cannot (a compile error, POSIX classes, nested classes, set operations), with no warning."""
    import warnings

    other = _rust_only_syntax(pattern)
    if other is not None:
        return None, f"none (Python's re does not read the pattern as the compiler's Rust regex syntax does: {other})"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # re's "possible nested set / set operation"
            compiled = re.compile(pattern)
    except FutureWarning as e:
        return None, f"none (Python's re does not read the pattern as the compiler's Rust regex syntax does: {e})"
    except re.error as e:
        return None, f"none (Python's re cannot read the pattern: {e})"
    return compiled.fullmatch(text) is not None, "re.fullmatch"


def _validate_grammar(grammar: str, text: str, tokens, model):
    try:  # GBNF -> Lark as the compiler reads it
        from jaxdecode.constraints.grammar import to_lark
        grammar = to_lark(grammar, "auto")
    except Exception:  # noqa: BLE001 - the compiler refused it already; lark / llguidance say why below
        pass
    try:
        import lark
        parser = lark.Lark(grammar, parser="earley")
    except Exception:  # noqa: BLE001 - llguidance's Lark dialect (lazy / regex extensions): on the tokens
        return _llguidance_accepts(grammar, tokens, model)
    try:
        parser.parse(text)
        return True, "lark"
    except lark.exceptions.LarkError:
        return False, "lark"


def _llguidance_accepts(grammar: str, tokens, model):
    if tokens is None or model is None:
        return None, "none (lark cannot read the grammar)"
    try:
        import llguidance
        matcher = llguidance.LLMatcher(_llguidance_tokenizer(model), llguidance.LLMatcher.grammar_from_lark(grammar),
                                       log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
    except Exception as e:  # noqa: BLE001 - any reason it cannot read the grammar is reported
        return None, f"none (neither lark nor llguidance reads the grammar: {e})"
    eos = set(model.config.eos_token_ids)
    body = [int(t) for t in tokens if int(t) not in eos]
    ok = matcher.consume_tokens(body) and not matcher.is_error() and matcher.is_accepting()
    return bool(ok), "llguidance"


def _llguidance_tokenizer(model):
    import llguidance.hf
    key = ("llguidance", id(model.tokenizer))
    if key not in _BYTES_CACHE or _BYTES_CACHE[key][0] is not model.tokenizer:
        _BYTES_CACHE[key] = (model.tokenizer, llguidance.hf.from_tokenizer(model.tokenizer,
                                                                           n_vocab=model.config.vocab_size))
    return _BYTES_CACHE[key][1]

