"""JSON schemas (recursive ones included: `$ref` cycles) as Lark grammars for compile_grammar.

    text = schema_to_lark({"type": "object", "properties": {"children": {"type": "array",
                           "items": {"$ref": "#"}}}, "required": ["children"]})
    g = compile_schema_grammar(schema, tokenizer)        # -> CompiledGrammar (device PDA or llguidance)

Output form: compact JSON as json.dumps writes it (", " and ": " separators, no other whitespace),
properties in the schema's order (required ones always, optional ones may be left out). Each
definition reached through `$ref` ("#", "#/$defs/x", "#/definitions/x") is one rule, so a cycle of
references is a recursive rule (the device PDA's stack holds the nesting). Keywords outside the subset
below are errors that name them (never dropped): a text the grammar allows must validate.

Supported: type (string, integer, number, boolean, null, object, array, or a list of them), properties,
required, additionalProperties: false (the only kind: other keys are never generated), items, enum,
const, anyOf, $ref, $defs / definitions, and the annotations title, description, $schema, $id,
$comment, default, examples.
"""
from __future__ import annotations

import json
from pathlib import Path

from jaxdecode.constraints.grammar import GrammarError, compile_grammar

_ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "default", "examples"}
_KNOWN = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf",
                         "$ref", "$defs", "definitions"}
_TERMINALS = r"""
JSON_STRING: /"([^"\\\x00-\x1f]|\\["\\\/bfnrt]|\\u[0-9a-fA-F]{4})*"/
JSON_INTEGER: /-?(0|[1-9][0-9]*)/
JSON_NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
"""


def _lit(value) -> str:
    """A Lark string literal matching exactly json.dumps(value)."""
    return json.dumps(json.dumps(value))


class _Converter:
    def __init__(self, root):
        self.root, self.rules, self.names = root, {}, {}

    def ref(self, ref: str) -> str:
        if ref in self.names:
            return self.names[ref]
        if ref == "#":
            target = self.root
        elif ref.startswith(("#/$defs/", "#/definitions/")):
            section, key = ref[2:].split("/", 1)
            target = self.root.get(section, {}).get(key)
            if target is None:
                raise GrammarError(f"$ref {ref!r} points to nothing in the schema")
        else:
            raise GrammarError(f"$ref {ref!r} is not supported: only '#', '#/$defs/NAME' and '#/definitions/NAME'")
        name = "start" if ref == "#" else "def_" + "".join(ch if ch.isalnum() else "_" for ch in ref[2:]).lower()
        self.names[ref] = name
        self.rules[name] = None  # reserved: a cycle back here is a call
        self.rules[name] = self.expr(target, ref)
        return name

    def expr(self, s, where: str) -> str:
        if s is True or s == {}:
            raise GrammarError(f"{where}: an unconstrained schema (true / {{}}) is not supported; give it a type")
        if not isinstance(s, dict):
            raise GrammarError(f"{where}: a schema must be an object, got {s!r}")
        unknown = sorted(set(s) - _KNOWN)
        if unknown:
            raise GrammarError(f"{where}: schema keyword(s) {', '.join(unknown)} are not supported by the grammar "
                               f"form (supported: {', '.join(sorted(_KNOWN - _ANNOTATIONS))})")
        if "$ref" in s:
            if set(s) - _ANNOTATIONS - {"$ref", "$defs", "definitions"}:
                raise GrammarError(f"{where}: $ref next to other keywords is not supported")
            return self.ref(s["$ref"])
        if "const" in s:
            return _lit(s["const"])
        if "enum" in s:
            if not s["enum"]:
                raise GrammarError(f"{where}: enum is empty: nothing would validate")
            return "(" + " | ".join(_lit(v) for v in s["enum"]) + ")"
        if "anyOf" in s:
            return "(" + " | ".join(self.expr(x, f"{where}/anyOf/{i}") for i, x in enumerate(s["anyOf"])) + ")"
        t = s.get("type")
        if isinstance(t, list):
            return "(" + " | ".join(self.expr({**s, "type": x}, where) for x in t) + ")"
        if t == "string":
            return "JSON_STRING"
        if t == "integer":
            return "JSON_INTEGER"
        if t == "number":
            return "JSON_NUMBER"
        if t == "boolean":
            return '("true" | "false")'
        if t == "null":
            return '"null"'
        if t == "array":
            if "items" not in s:
                raise GrammarError(f"{where}: an array needs 'items' (the grammar form has no unconstrained value)")
            item = self.expr(s["items"], f"{where}/items")
            return f'"[" ({item} (", " {item})*)? "]"'
        if t == "object":
            return self.object(s, where)
        raise GrammarError(f"{where}: type {t!r} is not supported (string, integer, number, boolean, null, object, "
                           "array)")

    def object(self, s, where):
        if s.get("additionalProperties", False) is not False:
            raise GrammarError(f"{where}: additionalProperties other than false is not supported (the grammar "
                               "generates only the listed properties)")
        props = s.get("properties", {})
        required = set(s.get("required", []))
        missing = required - set(props)
        if missing:
            raise GrammarError(f"{where}: required properties {sorted(missing)} are not in 'properties'")
        fields = [(f'{_lit(k)} ": " {self.expr(v, f"{where}/properties/{k}")}', k in required)
                  for k, v in props.items()]
        # members(i, first): the fields from i on; a comma before each field but the first one written
        body = self._members(fields, 0, True)
        return f'"{{" {body} "}}"' if body else '"{" "}"'

    def _members(self, fields, i, first):
        """Fields i.. as grammar text; `first`: nothing written yet (no comma before the next field)."""
        if i == len(fields):
            return ""
        field, req = fields[i]
        if not first:  # a comma before this field either way: O(n) text
            rest = self._members(fields, i + 1, False)
            return f'(", " {field})' + ("" if req else "?") + (f" {rest}" if rest else "")
        with_it = f"{field} {self._members(fields, i + 1, False)}".strip()
        if req:
            return f"({with_it})"
        without = self._members(fields, i + 1, True)
        return f"(({with_it}) | {without})" if without else f"({with_it})?"


def schema_to_lark(schema) -> str:
    """Lark grammar text of the compact JSON texts valid under `schema` (dict, JSON text or file path)."""
    if isinstance(schema, (str, Path)) and not str(schema).lstrip().startswith("{") and Path(schema).exists():
        schema = Path(schema).read_text()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the schema is not valid JSON: {e}") from None
    conv = _Converter(schema)
    conv.ref("#")
    lines = [f"{name}: {body}" for name, body in conv.rules.items()]
    return "\n".join(lines) + "\n" + _TERMINALS


def compile_schema_grammar(schema, tokenizer, **kw):
    """compile_grammar of schema_to_lark(schema): for recursive schemas (regex automata cannot nest)."""
    return compile_grammar(schema_to_lark(schema), tokenizer, syntax="lark", **kw)


def is_recursive_schema(schema) -> bool:
    """Whether the schema's $refs form a cycle (then it needs compile_schema_grammar, not a regex)."""
    conv = _Converter(schema if isinstance(schema, dict) else json.loads(Path(schema).read_text()
                                                                        if Path(str(schema)).exists() else schema))
    graph = {}

    def refs(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "$ref" and isinstance(v, str):
                    yield v
                else:
                    yield from refs(v)
        elif isinstance(node, list):
            for x in node:
                yield from refs(x)

    root = conv.root

    def target(ref):
        if ref == "#":
            return root
        if "/" in ref[2:]:
            section, key = ref[2:].split("/", 1)
            return root.get(section, {}).get(key, {})
        return {}

    todo, seen = ["#"], set()
    while todo:
        r = todo.pop()
        if r in seen:
            continue
        seen.add(r)
        node = target(r)
        if r == "#":  # the root's own refs, not its definitions' (those are reached by reference)
            node = {k: v for k, v in root.items() if k not in ("$defs", "definitions")}
        graph[r] = set(refs(node))
        todo += list(graph[r])

    def reach(a, b, seen=()):
        return any(n == b or (n not in seen and reach(n, b, seen + (n,))) for n in graph.get(a, ()))

    return any(reach(r, r) for r in graph)
