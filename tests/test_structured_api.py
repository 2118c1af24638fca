"""Structured output through the public surface: generate(..., regex= / json_schema= / grammar=) with
every method that takes a constraint, per-row values, the CLI's --regex / --json-schema and its "valid"
field, and the errors of bad requests. The embedded target, a few new tokens each."""
import json
import re

import jsonschema
import pytest

import jaxdecode
from jaxdecode.cli import main
from jaxdecode.constraints import automaton
from jaxdecode.constraints.trie import ConstraintError
from jaxdecode.options import STRUCTURED, OptionError
from jaxdecode.structured import StructuredRequest, validate_text

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
OTHER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
PATTERN = r"[a-c]{2}-[0-9]{1,3}"
PROMPTS = ["x = ", "def f("]
METHOD_OPTIONS = {"greedy": {}, "sample": {"seed": 3}, "beam": {"num_beams": 2},
                  "diverse_beam": {"num_beams": 2, "num_groups": 2}, "speculative": {"drafter": "prompt_lookup"}}


@pytest.fixture(scope="module")
def model():
    return jaxdecode.load()


def _check_schema(results, schemas):
    for r, schema in zip(results, schemas):
        assert r.tokens[-1] == 0, r.text  # ended by EOS, allowed only where the JSON is complete
        jsonschema.validate(json.loads(r.text.removesuffix("<|endoftext|>")), schema)
        assert (r.valid, r.constraint, r.validator) == (True, "json_schema", "jsonschema")
        assert r.backend == r.batch_stats["constraint_backend"] and "device" in r.backend


@pytest.mark.parametrize("method", [m for m in STRUCTURED if m in METHOD_OPTIONS])
def test_json_schema_with_every_method(model, method):
    # A boolean field: an integer has no length limit, and beam search on the embedded target can prefer
    # writing digits past max_new_tokens to closing the object (the test checks completion, not taste).
    out = jaxdecode.generate(model, PROMPTS, method=method, max_new_tokens=16, json_schema=OTHER,
                             **METHOD_OPTIONS[method])
    _check_schema(out, [OTHER] * 2)


def test_regex_fullmatches_and_says_valid(model):
    out = jaxdecode.generate(model, PROMPTS, method="sample", max_new_tokens=12, regex=PATTERN, seed=0)
    for r in out:
        assert re.fullmatch(PATTERN, r.text.removesuffix("<|endoftext|>")), r.text
        assert r.valid is True and r.validator == "re.fullmatch" and r.to_json()["valid"] is True
    plain = jaxdecode.generate(model, PROMPTS[0], max_new_tokens=2)[0]
    assert plain.constraint is None and "valid" not in plain.to_json()


def test_stop_string_under_a_constraint(model):
    """A stop string that fires inside a constrained row: the text is cut before it, and `valid` judges
    the text returned."""
    r = jaxdecode.generate(model, ["def f(x):\n    return x"], regex=r"[a-z \n]+", stop=[" "], max_new_tokens=20)[0]
    assert (r.finish_reason, r.stop) == ("stop", " ") and " " not in r.text and r.valid is True


def test_properties_come_in_the_schema_order(model):
    """Properties are written in the order the schema declares them (a "reasoning" field before an
    "answer"), not sorted, on the automaton path and on the grammar (recursive schema) path."""
    flat = {"type": "object", "properties": {"zname": {"type": "boolean"}, "age": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 9}},
            "required": ["zname", "age"], "additionalProperties": False}
    r = jaxdecode.generate(model, "user = ", json_schema=flat, max_new_tokens=24)[0]
    assert r.valid and list(json.loads(r.text.removesuffix("<|endoftext|>"))) == ["zname", "age"], r.text
    tree = {"type": "object", "properties": {"value": {"type": "integer"},
                                             "children": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["value", "children"]}
    r = jaxdecode.generate(model, "tree = ", json_schema=tree, max_new_tokens=10)[0]
    assert r.text.startswith('{"value"'), r.text


def test_one_schema_per_row(model):
    schemas = [SCHEMA, OTHER, SCHEMA]
    out = jaxdecode.generate(model, PROMPTS + ["import"], max_new_tokens=16, json_schema=schemas)
    _check_schema(out, schemas)


GRAMMAR = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
TREE = {"type": "object", "properties": {"v": {"type": "integer"},
                                         "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v", "kids"]}


@pytest.fixture
def cli_model(model, monkeypatch):
    """The CLI decodes with the module's model (loading it again per call costs seconds)."""
    monkeypatch.setattr(jaxdecode, "load", lambda *a, **k: model)
    return model


def test_grammar_and_recursive_schema(model, cli_model, tmp_path, capsys):
    pytest.importorskip("jaxdecode.constraints.grammar_schema")
    import lark
    out = jaxdecode.generate(model, "x = ", max_new_tokens=12, grammar=GRAMMAR)[0]
    assert out.backend == "jaxdecode pushdown automaton (device)" and out.validator == "lark"
    prefix = out.text.removesuffix("<|endoftext|>")
    try:
        lark.Lark(GRAMMAR).parse(prefix)
        parses = True
    except lark.exceptions.LarkError:
        parses = False
    assert out.valid is parses and (parses or out.tokens[-1] != 0)  # ended by EOS: a sentence
    tree = jaxdecode.generate(model, "x = ", max_new_tokens=24, json_schema=TREE)[0]  # $ref cycle: grammar path
    assert "pushdown" in tree.backend
    if tree.tokens[-1] == 0:
        assert tree.valid is True
        jsonschema.validate(json.loads(tree.text.removesuffix("<|endoftext|>")), TREE)
    path = tmp_path / "expr.lark"
    path.write_text(GRAMMAR)
    assert main(["generate", "--prompt", "x = ", "--grammar", str(path), "--max-new-tokens", "12", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["constraint"] == "grammar" and row["validator"] == "lark" and row["valid"] is out.valid


def test_cli_regex_and_json_schema(cli_model, tmp_path, capsys):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    assert main(["generate", "--prompt", "a", "--prompt", "b", "--json-schema", str(path), "--max-new-tokens",
                 "16", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()][:-1]  # then batch_stats
    assert len(rows) == 2 and all(r["valid"] is True and r["validator"] == "jsonschema" for r in rows)
    assert all(r["constraint"] == "json_schema" and "device" in r["backend"] for r in rows)
    assert main(["generate", "--prompt", "a", "--regex", PATTERN, "--max-new-tokens", "10"]) == 0
    assert "valid: True (regex checked by re.fullmatch" in capsys.readouterr().out


def test_cli_bad_requests(cli_model, tmp_path, capsys):
    assert main(["generate", "--prompt", "a", "--json-schema", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err
    assert "--json-schema" in err and "neither a readable file nor JSON text" in err
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["generate", "--prompt", "a", "--json-schema", str(tmp_path / "bad.json")]) == 2
    assert "not a JSON file" in capsys.readouterr().err


def test_bad_requests(model):
    with pytest.raises(OptionError, match=r"options \['regex', 'json_schema'\] each constrain the output"):
        jaxdecode.generate(model, "a", regex="a+", json_schema=SCHEMA)
    with pytest.raises(OptionError, match="give one of regex, json_schema, grammar"):
        jaxdecode.generate(model, "a", method="constrained_greedy", index="items.txt", regex="a+")
    # a method without constraints: the error names the methods that take one
    with pytest.raises(OptionError, match=r"does not take option\(s\) \['regex'\]; regex is taken by greedy, "):
        jaxdecode.generate(model, "a", method="constrained_sample", regex="a+")
    with pytest.raises(FileNotFoundError, match="neither JSON text nor a readable file"):
        jaxdecode.generate(model, "a", json_schema="/nonexistent/schema.json")
    with pytest.raises(OptionError, match="regex has 3 entries but there are 2 prompts"):
        jaxdecode.generate(model, PROMPTS, regex=["a", "b", "c"])
    with pytest.raises(automaton.AutomatonError):  # the schema `false`: no accepting path
        jaxdecode.generate(model, "a", json_schema=False)
    # the automaton's own error surfaces unchanged
    with pytest.raises(automaton.AutomatonError) as direct:
        automaton.compile_regex("(a", model.tokenizer, vocab_size=model.config.vocab_size, cache=False)
    with pytest.raises(automaton.AutomatonError) as through:
        jaxdecode.generate(model, "a", regex="(a")
    assert str(through.value) == str(direct.value)


def test_json_schema_formats_are_checked(model):
    """`valid` uses jsonschema's format checker: the automaton enforces a format's shape only, so an
    impossible date it admits is reported invalid; a format jsonschema has no checker for adds nothing."""
    date = {"type": "string", "format": "date"}
    assert re.fullmatch(automaton.schema_to_regex(date), '"2021-02-30"')  # the shape of a date
    req = StructuredRequest("json_schema", (json.dumps(date),))
    assert validate_text(req, 0, '"2021-02-30"') == (False, "jsonschema")
    assert validate_text(req, 0, '"2021-02-28"') == (True, "jsonschema")
    unchecked = next((f for f in ("uri", "date-time", "time") if f not in
                      jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers), None)
    if unchecked is not None:
        req = StructuredRequest("json_schema", (json.dumps({"type": "string", "format": unchecked}),))
        assert validate_text(req, 0, '"not checked"') == (True, "jsonschema")
    r = jaxdecode.generate(model, "d = ", json_schema=date, max_new_tokens=16)[0]
    text = r.text.removesuffix("<|endoftext|>")
    fc = jsonschema.Draft202012Validator(date, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    assert r.valid is (r.tokens[-1] == 0 and fc.is_valid(json.loads(text))), text


@pytest.mark.parametrize("pattern,text", [("[[:digit:]]{2}", "64"), ("[a-z&&[^q]]{2}", "mp"), ("[a[:digit:]]", "5"),
                                          ("[a-c--b]", "a"), ("[a-c[x]]", "x"), ("(?P<n", "x")])
def test_regex_validator_says_none_where_python_reads_it_otherwise(pattern, text):
    """The compiler reads Rust regex syntax: where Python's re reads the pattern differently (POSIX
    classes, nested classes, set operations) or not at all, valid is None, with no warning."""
    import warnings

    with warnings.catch_warnings():  # in re's cache already: its FutureWarning does not come again
        warnings.simplefilter("ignore")
        re.compile(pattern) if pattern != "(?P<n" else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ok, validator = validate_text(StructuredRequest("regex", (pattern,)), 0, text)
    assert ok is None and validator.startswith("none (Python's re"), validator
    for pattern, text, ok in [("[a-c]{2}", "ab", True), ("[^]a]x", "bx", True), ("[^]a]x", "]x", False),
                              (r"a\[[:]", "a[:", True)]:
        assert validate_text(StructuredRequest("regex", (pattern,)), 0, text) == (ok, "re.fullmatch")


def test_rust_regex_syntax_through_generate(model):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        r = jaxdecode.generate(model, "x = ", regex="[[:digit:]]{2}", max_new_tokens=4)[0]
    assert re.fullmatch("[0-9]{2}", r.text.removesuffix("<|endoftext|>")), r.text
    assert r.valid is None and "Rust" in r.validator and r.to_json()["valid"] is None


LEFT_RECURSIVE = 'start: sum\nsum: sum "+" NUM | NUM\nNUM: /[0-9]/\n'


def test_per_row_values_that_do_not_stack_say_why(model):
    """A list of grammars / schemas whose rows need backends that do not stack: the error names the rows,
    the backend of each and what to do (not "this build does not have stacked automata")."""
    plain = 'start: NUM ("+" NUM)*\nNUM: /[0-9]/\n'
    with pytest.raises(ConstraintError, match=r"rows 0: llguidance \(host fallback.*rows 1: jaxdecode pushdown "
                                              r"automaton \(device\).*row\(s\) 0 run on llguidance.*call "
                                              r"generate once") as err:
        jaxdecode.generate(model, ["a", "b"], grammar=[LEFT_RECURSIVE, plain], max_new_tokens=4)
    assert "does not have" not in str(err.value)
    with pytest.raises(ConstraintError, match=r"rows 0: jaxdecode pushdown automaton \(device\); rows 1: "
                                              r"outlines-core token automaton.*recursive schemas.*call generate "
                                              r"once per kind") as err:
        jaxdecode.generate(model, ["a", "b"], json_schema=[TREE, {"type": "integer"}], max_new_tokens=4)
    assert "does not have" not in str(err.value)


def test_grammar_from_a_file_path(model, tmp_path):
    """grammar= takes the path of a grammar file (a str or a pathlib.Path), as json_schema= takes a schema
    file; a one-line .lark / .gbnf value naming no file is a clear error."""
    path = tmp_path / "expr.lark"
    path.write_text(GRAMMAR)
    by_path = jaxdecode.generate(model, "x = ", max_new_tokens=6, grammar=str(path))[0]
    by_pathlib = jaxdecode.generate(model, "x = ", max_new_tokens=6, grammar=path)[0]
    by_text = jaxdecode.generate(model, "x = ", max_new_tokens=6, grammar=GRAMMAR)[0]
    assert by_path.tokens == by_pathlib.tokens == by_text.tokens and by_path.validator == "lark"
    with pytest.raises(FileNotFoundError, match="no such file exists; pass the grammar's text"):
        jaxdecode.generate(model, "x = ", max_new_tokens=6, grammar=str(tmp_path / "missing.lark"))
