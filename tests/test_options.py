"""The option table (jaxdecode.options): every bound of every option, the cross-option checks, and that
the registry, the CLI flags and the README all follow the table. Validation only: nothing decodes here."""
import re
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxdecode
from jaxdecode.options import OPTIONS, OptionError, check_option, method_options, options_markdown, resolve
from jaxdecode.registry import get_method

NAN, INF = float("nan"), float("inf")

# (option, value) pairs that must be accepted: the bounds themselves and typical values.
GOOD = [
    ("temperature", 0), ("temperature", 0.0), ("temperature", 1e-6), ("temperature", 2), ("temperature", 100.0),
    ("top_k", 0), ("top_k", 1), ("top_k", 50_000), ("top_k", np.int64(3)),
    ("top_p", 1e-6), ("top_p", 0.5), ("top_p", 1), ("top_p", 1.0), ("top_p", np.float32(0.9)),
    ("min_p", 0), ("min_p", 0.05), ("min_p", 1.0),
    ("repetition_penalty", 1e-3), ("repetition_penalty", 1), ("repetition_penalty", 10.0),
    ("seed", 0), ("seed", 2**32 - 1), ("seed", np.int32(7)),
    ("max_new_tokens", 1), ("max_new_tokens", 4096),
    ("cache_len", 1), ("cache_len", 64),
    ("eos_ids", []), ("eos_ids", ()), ("eos_ids", [0, 5]), ("eos_ids", (np.int64(2),)),
    ("allow_nonfinite", True), ("allow_nonfinite", False),
    ("tau", 1e-3), ("tau", 5), ("eta", 1e-3), ("eta", 1.0),
    ("num_beams", 1), ("num_beams", 64),
    ("num_groups", 2), ("num_groups", 8),
    ("length_penalty", -2.0), ("length_penalty", 0), ("length_penalty", 1.5),
    ("diversity_penalty", 0), ("diversity_penalty", 2.5), ("early_stopping", True), ("early_stopping", "never"),
    ("draft", "path/to/draft"),
    ("drafter", "prompt_lookup"), ("drafter", "draft_lm"), ("drafter", "token_recycling"),
    ("drafter", "medusa"), ("drafter_dir", "path/to/drafter"),
    ("tree", "chain:4"), ("tree", "static:2,2:iid"), ("tree", 8),
    ("verifier", "greedy"), ("verifier", "specinfer"), ("verifier", "typical"),
    ("drafter_options", {}), ("drafter_options", {"lengths": [1, 3, 8]}),
    ("verify_widths", [2]), ("verify_widths", (2, 8)),
    ("adaptive", True), ("adaptive", False), ("costs", "costs.json"),
    ("index", "items.npz"), ("index", "items.txt"),
    ("set_ids", 0), ("set_ids", 3), ("set_ids", [0, 1]), ("set_ids", np.array([2, 0])),
    ("impl", "auto"), ("impl", "reference"), ("impl", "interpret"),
    ("rule", "greedy1"), ("rule", "freedave"), ("answer_length", 1), ("block_length", 32),
    ("threshold", 0), ("threshold", 0.9), ("threshold", 1), ("tokens_per_step", 2), ("filter", "path/to/filter"),
    ("rule_options", {"draft": 4}), ("diffusion_cache", "dual"), ("max_forwards", 1),
    ("regex", "[0-9]+"), ("regex", ["a+", "b+"]), ("grammar", "start: \"a\"+"), ("grammar", Path("g.lark")), ("grammar", [Path("g.gbnf"), "root ::= \"a\""]),
    ("stop", "\n\n"), ("stop", ["def ", " "]), ("logprobs", True), ("top_logprobs", 0), ("top_logprobs", 20),
    ("json_schema", {"type": "integer"}), ("json_schema", '{"type": "string"}'), ("json_schema", "schema.json"),
    ("json_schema", Path("schema.json")), ("json_schema", [{"type": "integer"}, "s.json"]), ("json_schema", True),
    ("num_samples", 1), ("num_samples", 64), ("samples_per_round", 1), ("samples_per_round", 4),
]

# (option, value) pairs that must be refused with an OptionError naming the option.
BAD = [
    ("temperature", -1), ("temperature", -1e-9), ("temperature", NAN), ("temperature", INF), ("temperature", "1"),
    ("temperature", True),
    ("top_k", -1), ("top_k", 2.5), ("top_k", 3.0), ("top_k", True), ("top_k", "3"),
    ("top_p", 0), ("top_p", 0.0), ("top_p", -0.1), ("top_p", 1.5), ("top_p", 1.0000001), ("top_p", NAN),
    ("min_p", -0.01), ("min_p", 1.01), ("min_p", NAN),
    ("repetition_penalty", 0), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", INF), ("repetition_penalty", NAN),
    ("seed", -1), ("seed", 2**32), ("seed", 1.5), ("seed", True), ("seed", "3"),
    ("max_new_tokens", 0), ("max_new_tokens", -3), ("max_new_tokens", 2.0),
    ("cache_len", 0), ("cache_len", 1.5),
    ("eos_ids", 5), ("eos_ids", "0"), ("eos_ids", [-1]), ("eos_ids", [1.5]), ("eos_ids", [True]),
    ("allow_nonfinite", 1), ("allow_nonfinite", "yes"),
    ("mesh", "data=2"), ("mesh", 2),
    ("tau", 0), ("tau", -1.0), ("tau", NAN), ("eta", 0), ("eta", -0.1), ("eta", INF),
    ("num_beams", 0), ("num_beams", -1), ("num_beams", 2.5), ("num_beams", True),
    ("num_groups", 1), ("num_groups", 0), ("num_groups", 2.0),
    ("length_penalty", NAN), ("length_penalty", INF), ("length_penalty", "1"),
    ("diversity_penalty", -0.5), ("diversity_penalty", NAN), ("early_stopping", "always"), ("early_stopping", 1),
    ("draft", 5), ("draft", b"dir"),
    ("drafter", "nope"), ("drafter", 3), ("drafter_dir", 5),
    ("tree", 0), ("tree", -2), ("tree", 2.5), ("tree", True),
    ("verifier", "nope"), ("verifier", 3),
    ("drafter_options", [1]), ("drafter_options", "lengths=[1]"), ("drafter_options", {1: 2}),
    ("verify_widths", []), ("verify_widths", [0]), ("verify_widths", "2,4"), ("verify_widths", [True]),
    ("verify_widths", 4), ("verify_widths", [2.5]),
    ("adaptive", 1), ("adaptive", "no"), ("costs", 5),
    ("index", 5),
    ("set_ids", -1), ("set_ids", [0, -1]), ("set_ids", 1.5), ("set_ids", "0"), ("set_ids", [[0]]),
    ("impl", "fast"), ("impl", 1),
    ("rule", "nope"), ("rule", 3), ("answer_length", 0), ("block_length", 0), ("block_length", 2.0),
    ("threshold", -0.1), ("threshold", 1.5), ("threshold", NAN), ("tokens_per_step", 0), ("filter", 5),
    ("rule_options", [1]), ("diffusion_cache", "exact"), ("max_forwards", 0),
    ("stop", ""), ("stop", ["a", ""]), ("stop", []), ("stop", 3), ("logprobs", 1), ("top_logprobs", 21),
    ("top_logprobs", -1), ("regex", ""), ("regex", 5), ("regex", ["a", 3]), ("regex", []), ("grammar", {"start": "a"}), ("grammar", " "),
    ("json_schema", 5), ("json_schema", []), ("json_schema", [{"type": "integer"}, 2]),
    ("num_samples", 0), ("num_samples", 2.0), ("samples_per_round", 0), ("samples_per_round", True),
]


@pytest.mark.parametrize("name, value", GOOD, ids=[f"{n}={v!r}" for n, v in GOOD])
def test_option_accepts(name, value):
    check_option(name, value)


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_option_refuses(name, value):
    with pytest.raises(OptionError, match=re.escape(name)) as e:
        check_option(name, value)
    assert "must be" in str(e.value)  # says what is accepted


def test_every_option_has_bound_cases():
    assert {n for n, _ in BAD} == set(OPTIONS) and {n for n, _ in GOOD} <= set(OPTIONS)


def test_a_mesh_is_accepted():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    check_option("mesh", mesh)


def test_unknown_option_name():
    with pytest.raises(OptionError, match="unknown option 'topp'"):
        check_option("topp", 0.5)


# ----------------------------------------------------------------------------- methods and defaults
def test_registry_takes_the_table_options():
    """Each built-in method takes exactly the options the table lists for it."""
    listed = {m for o in OPTIONS.values() for m in o.methods if m != "*"}
    for name in listed:
        assert set(get_method(name).options) == set(method_options(name)), name
    for name in jaxdecode.methods():
        spec = get_method(name)
        assert spec.name in listed or not spec.options, name


def test_defaults_fill_unset_options_and_keep_zeros():
    beam = resolve("beam", {"num_beams": None, "length_penalty": 0})
    assert beam["num_beams"] == 4 and beam["length_penalty"] == 0
    div = resolve("diverse_beam", {"diversity_penalty": 0})
    assert div["diversity_penalty"] == 0 and div["num_groups"] == 2
    assert resolve("sample", {})["temperature"] == 1.0 and resolve("speculative", {})["temperature"] == 0.0
    s = resolve("sample", {"top_k": 0, "min_p": 0, "seed": 0})
    assert (s["top_k"], s["top_p"], s["min_p"], s["repetition_penalty"], s["seed"]) == (0, 1.0, 0, 1.0, 0)
    assert resolve("mirostat", {})["tau"] == 5.0
    assert resolve("greedy", {})["max_new_tokens"] == 32


@pytest.mark.parametrize("method, opts, match", [
    ("greedy", {"temperature": 0.7}, r"method 'greedy' does not take option\(s\) \['temperature'\]"),
    ("beam", {"top_p": 0.9}, "does not take"),
    ("speculative", {"repetition_penalty": 1.2}, "does not take"),
    ("diverse_beam", {"num_beams": 3}, r"num_beams \(3\) must be a multiple of num_groups \(2\)"),
    ("diverse_beam", {"num_beams": 4, "num_groups": 8}, "multiple of num_groups"),
    ("constrained_beam", {}, "needs option index"),
    ("constrained_greedy", {"index": "x.npz", "set_ids": [0, 1, 2]}, r"set_ids has 3 entries but there are 2 prompts"),
    ("speculative", {"draft": "dir", "drafter": "prompt_lookup"}, "draft is used only by drafter 'draft_lm'"),
    ("greedy", {"regex": "a", "json_schema": {}}, r"options \['regex', 'json_schema'\] each constrain the output"),
    ("constrained_greedy", {"index": "x.npz", "regex": "a"}, "give one of regex, json_schema, grammar"),
    ("constrained_beam", {"regex": "a"}, r"does not take option\(s\) \['regex'\]; regex is taken by greedy, sample"),
    ("greedy", {"regex": ["a", "b", "c"]}, "regex has 3 entries but there are 2 prompts"),
])
def test_cross_option_checks(method, opts, match):
    with pytest.raises(OptionError, match=match):
        resolve(method, opts, batch=2)


def test_third_party_options_pass_through():
    from jaxdecode.registry import _METHODS, register_method
    register_method("_test_custom", lambda *a: None, ("my_knob",))
    try:
        assert resolve("_test_custom", {"my_knob": -5})["my_knob"] == -5
    finally:
        _METHODS.pop("_test_custom")


# ----------------------------------------------------------------------------- CLI and README
FIXED_FLAGS = {"help", "model", "prompt", "prompts_file", "method", "dtype", "param_dtype", "option", "json", "prompt_ids",
               "prompts_format", "chat", "system", "chat_template_kwargs", "num_return_sequences", "add_special_tokens",
               "keep_special_tokens", "echo", "stream"}  # load() and generate() arguments that are not method options


def _generate_parser():
    from jaxdecode.cli import build_parser
    p = build_parser(with_train=False)
    sub = next(a for a in p._actions if a.dest == "command")
    return sub.choices["generate"]


def test_cli_flags_follow_the_table():
    g = _generate_parser()
    flags = {a.dest: a for a in g._actions}
    for name, opt in OPTIONS.items():
        if opt.cli is None:
            assert name not in flags
            continue
        action = flags[name]
        assert opt.cli in action.option_strings
        assert opt.doc in action.help and "default" in action.help
        assert action.default is None  # unset flags never override the method's default
    assert set(flags) - FIXED_FLAGS <= set(OPTIONS)
    help_text = g.format_help()
    for name, opt in OPTIONS.items():  # options without a flag are named in --option's help
        if opt.cli is None and name != "mesh":
            assert name in help_text


def test_readme_options_table_is_the_table():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert options_markdown() in readme
