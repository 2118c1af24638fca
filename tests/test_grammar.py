"""Grammar constraints (jaxdecode.constraints.grammar): device pushdown masks equal llguidance's on random
prefixes, generated texts parse / validate, the llguidance fallback, bad input."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jd_testutil import ARITH_LARK
from jaxdecode.constraints.automaton import token_bytes
from jaxdecode.constraints.grammar import GrammarError, _llg_matcher, compile_grammar, llg_mask, stack_grammars
from jaxdecode.constraints.grammar_schema import compile_schema_grammar, is_recursive_schema, schema_to_lark
from jaxdecode.constraints.trie import ConstraintError

ARITH = ARITH_LARK
PARENS = r"""
start: group+
group: "(" group* ")" | "[" group* "]"
"""
JSON_LARK = r"""
start: value
?value: object | array | STRING | SIGNED_NUMBER | "true" | "false" | "null"
object: "{" [pair ("," pair)*] "}"
pair: STRING ":" value
array: "[" [value ("," value)*] "]"
STRING: /"[a-z ]*"/
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""
# literals that BPE tokens cross ("def", "return", "():"): tokens spanning the literal's boundary
SPANNING = r"""
start: "def " NAME "():\n" body
body: "    return " expr "\n"
expr: NAME | NAME "(" expr ")"
NAME: /[a-z_]+/
"""
GBNF = r"""
root ::= "[" ws items? "]"
items ::= item ("," ws item)*
item ::= [0-9]{1,3} ws | root ws | "\"" [^"\\]* "\"" ws   # counted repetition, classes, escapes
ws ::= | " "
"""
TREE = {"type": "object", "properties": {"value": {"type": "integer"}, "tag": {"type": "string"},
        "children": {"type": "array", "items": {"$ref": "#"}}}, "required": ["value", "children"]}
LEFT_RECURSIVE = r"""
start: sum
sum: sum "+" NUMBER | NUMBER
NUMBER: /[0-9]+/
"""


@pytest.fixture(scope="module", autouse=True)
def _fresh_cache(tmp_path_factory):
    """Grammars compile from scratch here (a disk cache from an older grammar.py must not hide a change)."""
    import os

    old = os.environ.get("JAXDECODE_CACHE_DIR")
    os.environ["JAXDECODE_CACHE_DIR"] = str(tmp_path_factory.mktemp("grammar-cache"))
    yield
    if old is None:
        os.environ.pop("JAXDECODE_CACHE_DIR")
    else:
        os.environ["JAXDECODE_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def model():
    import jaxdecode

    return jaxdecode.load()


@pytest.fixture(scope="module")
def tok(model):
    return model.tokenizer


_COMPILED = {}


def _grammar(tok, name, max_depth=64):
    """Compiled once per module: the test grammars by name (deep enough that walks never meet the bound)."""
    key = (id(tok), name, max_depth)
    if key not in _COMPILED:
        text = {"arith": ARITH, "parens": PARENS, "json": JSON_LARK, "spanning": SPANNING, "gbnf": GBNF}.get(name)
        _COMPILED[key] = (compile_schema_grammar(TREE, tok, max_depth=max_depth) if name == "tree_schema"
                          else compile_grammar(text, tok, max_depth=max_depth))
    return _COMPILED[key]


def _walk_compare(g, tok, rows=3, steps=20, seed=0, starts=None):
    """Random walks under llguidance's masks (biased towards structure tokens); the device mask must equal
    llguidance's at every step. starts: stacked grammar of each row."""
    v = g.vocab_size
    c = g.constraint(starts).prepare(v, g.eos_ids, steps, rows)
    allowed, advance = jax.jit(c.allowed), jax.jit(c.advance)
    st = c.init(rows)
    ms = [g.matcher(0 if starts is None else starts[i]) for i in range(rows)]
    rng = np.random.default_rng(seed)
    struct = np.array([any(ch in tok.decode([i]) for ch in "()[]{},:\"\n") for i in range(v)])
    hist = [[] for _ in range(rows)]
    tb = token_bytes(tok) + [None] * (v - len(token_bytes(tok)))
    for step in range(steps):
        dev = np.asarray(allowed(st))
        toks = []
        for i, m in enumerate(ms):
            if hist[i] and hist[i][-1] in g.eos_ids:  # finished: the device row is done too
                assert not dev[i].any()
                toks.append(g.eos_ids[0])
                continue
            ref = llg_mask(m, v)
            # llguidance allows only the canonical token where bytes are forced ("def" for "def ", not "d"):
            # the device allows every token whose bytes fit, so those extra tokens are prefixes of the
            # forced bytes; everything else must be equal
            ff = m.compute_ff_bytes()
            bad = [t for t in np.flatnonzero(ref != dev[i])
                   if ref[t] or not (tb[t] and len(tb[t]) < len(ff) and ff.startswith(tb[t]))]
            assert not bad, (step, tok.decode(hist[i]), [(int(t), tok.decode([int(t)]), bool(ref[t]))
                                                         for t in bad[:8]])
            ok = np.flatnonzero(ref & ~np.isin(np.arange(v), g.eos_ids))
            pref = ok[struct[ok]] if rng.random() < 0.6 and struct[ok].any() else ok
            t = int(rng.choice(pref)) if ok.size else g.eos_ids[0]
            toks.append(t)
            hist[i].append(t)
            if ok.size:
                m.consume_token(t)
        st = advance(st, jnp.asarray(toks, jnp.int32))
    return hist


@pytest.mark.parametrize("name", ["arith", "parens", "json", "spanning", "gbnf", "tree_schema"])
def test_device_masks_equal_llguidance(name, tok):
    g = _grammar(tok, name)
    assert g.backend == "device", g.reason
    hist = _walk_compare(g, tok)
    assert any(len(set(tok.decode(h)) & set("([{")) for h in hist)


def _texts(model, out, eos):
    rows = []
    for toks, n in zip(np.asarray(out.tokens), np.asarray(out.lengths)):
        toks = [int(t) for t in toks[:n]]
        ended = bool(toks) and toks[-1] in eos
        rows.append((model.tokenizer.decode(toks[:-1] if ended else toks), ended, toks))
    return rows


def test_stacked_grammars_per_row(tok):
    """Different grammars per row of one batch: stacked automata, each row's mask equals its grammar's."""
    parts = [_grammar(tok, "arith"), _grammar(tok, "tree_schema")]
    g = stack_grammars(parts)
    assert g.starts[1] == parts[0].tables.kind.shape[0]
    _walk_compare(g, tok, rows=3, steps=16, starts=[1, 0, 1])
    with pytest.raises(ConstraintError, match="outside"):
        g.constraint([0, 2])


def test_generated_tree_json_validates(model):
    """Sampled generation under a recursive schema (greedy: the expression test below): every finished
    text validates with jsonschema, every unfinished one is a prefix llguidance accepts."""
    import jsonschema

    from jaxdecode.autoregressive import decode
    from jaxdecode.sampling import SamplerConfig

    g = _grammar(model.tokenizer, "tree_schema")
    assert g.backend == "device" and is_recursive_schema(TREE)
    prompts = ["data = ", "tree = {"]
    enc = [model.encode(p) for p in prompts]
    toks = np.zeros((2, max(map(len, enc))), np.int32)
    for i, e in enumerate(enc):
        toks[i, :len(e)] = e
    lens = jnp.asarray([len(e) for e in enc], jnp.int32)
    finished = 0
    out = decode(model.config, model.params, jnp.asarray(toks), lens, max_new_tokens=48, eos_ids=(0,),
                 constraint=g.constraint(), method="sample", key=jax.random.key(3),
                 sampler=SamplerConfig(temperature=1.0))
    for text, ended, ids in _texts(model, out, (0,)):
        if ended:
            jsonschema.validate(json.loads(text), TREE)
            finished += 1
        else:
            m = g.matcher()
            assert m.consume_tokens(ids), text
    assert finished >= 1


def test_generated_expression_parses_with_lark(model):
    import lark

    from jaxdecode.autoregressive import decode
    from jaxdecode.sampling import SamplerConfig

    # one bracketed expression: after its closing bracket EOS is the only token left, so rows finish
    grammar = ARITH.replace("start: expr", 'start: "(" expr ")"').replace("/[0-9]+/", "/[0-9]/")
    g = compile_grammar(grammar, model.tokenizer, vocab_size=model.config.vocab_size, eos_ids=(0,))
    toks = jnp.asarray([model.encode("x = (1 + 2) * ")] * 4, jnp.int32)
    lens = jnp.full((4,), toks.shape[1], jnp.int32)
    out = decode(model.config, model.params, toks, lens, max_new_tokens=32, eos_ids=(0,), constraint=g.constraint(),
                 method="sample", key=jax.random.key(0), sampler=SamplerConfig(temperature=1.0))
    greedy = decode(model.config, model.params, toks[:1], lens[:1], max_new_tokens=32, eos_ids=(0,),
                    constraint=g.constraint(), method="greedy")
    parser = lark.Lark(grammar, parser="earley")
    rows = _texts(model, out, (0,)) + _texts(model, greedy, (0,))
    for text, ended, ids in rows:
        if ended:
            parser.parse(text)
        else:
            assert g.matcher().consume_tokens(ids), text
    assert any(ended for _, ended, _ in rows)


def test_beam_search_under_grammar(model):
    from jaxdecode.beam import beam_search

    g = _grammar(model.tokenizer, "gbnf", max_depth=8)  # beam nodes carry the stack: keep it short
    toks = jnp.asarray([model.encode("a = ")], jnp.int32)
    out = beam_search(model.config, model.params, toks, jnp.asarray([toks.shape[1]], jnp.int32), max_new_tokens=8,
                      num_beams=2, eos_ids=(0,), constraint=g.constraint())
    seqs = np.asarray(out.tokens)[0]
    lengths = np.asarray(out.lengths)[0]
    for s, n in zip(seqs, lengths):
        ids = [int(t) for t in s[:n]]
        m = g.matcher()
        assert m.consume_tokens(ids), model.tokenizer.decode(ids)


def test_not_ll1_falls_back_to_llguidance(tok, model):
    """A left-recursive grammar has no device form: llguidance on the host (backend says so), or an error
    with fallback="error"; generation under the fallback parses."""
    import lark

    from jaxdecode.autoregressive import decode

    with pytest.raises(GrammarError, match="left-recursive"):
        compile_grammar(LEFT_RECURSIVE, tok, fallback="error")
    g = compile_grammar(LEFT_RECURSIVE, tok, vocab_size=model.config.vocab_size, eos_ids=(0,))
    assert g.backend == "llguidance" and "left-recursive" in g.reason
    c = g.constraint()
    assert c.backend == "llguidance"
    toks = jnp.asarray([model.encode("n = 1 + ")] * 2, jnp.int32)
    out = decode(model.config, model.params, toks, jnp.full((2,), toks.shape[1], jnp.int32), max_new_tokens=10,
                 eos_ids=(0,), constraint=c, method="greedy")
    for text, ended, ids in _texts(model, out, (0,)):
        assert g.matcher().consume_tokens(ids), text
        if ended:
            lark.Lark(LEFT_RECURSIVE, parser="earley").parse(text)


def test_depth_bound(tok):
    """Nesting beyond max_depth is masked on the device (never a dead end: closing stays allowed); a grammar
    whose every text nests deeper than max_depth falls back, or errors with fallback="error"."""
    g = compile_grammar(PARENS, tok, max_depth=3)
    c = g.constraint().prepare(g.vocab_size, g.eos_ids, 8, 1)
    allowed, advance = jax.jit(c.allowed), jax.jit(c.advance)
    st = c.init(1)
    open_, close = tok.convert_tokens_to_ids("("), tok.convert_tokens_to_ids(")")
    for _ in range(3):
        assert bool(allowed(st)[0, open_])
        st = advance(st, jnp.asarray([open_]))
    mask = np.asarray(allowed(st)[0])
    assert not mask[open_] and mask[close]
    # every text calls a inside start, b inside a, c inside b: 3 return states on the stack at least
    deep = 'start: "(" a ")"\na: "<" a ">" | "[" b "]"\nb: "<" b ">" | "{" c "}"\nc: "<" c ">" | "x"\n'
    with pytest.raises(GrammarError, match="max_depth=2"):
        compile_grammar(deep, tok, max_depth=2, fallback="error")
    g = compile_grammar(deep, tok, max_depth=2)
    assert g.backend == "llguidance" and "max_depth" in g.reason
    assert compile_grammar(deep, tok, max_depth=8).backend == "device"


def test_bad_input(tok):
    with pytest.raises(GrammarError, match="line 3"):
        compile_grammar('start: a\na: "x"\nb: : "y"\n', tok)
    with pytest.raises(GrammarError, match="no 'start' rule"):
        compile_grammar('a: "x"\n', tok)
    with pytest.raises(GrammarError, match="not defined"):
        compile_grammar('start: a "x"\n', tok)
    with pytest.raises(GrammarError, match="accepts no text"):
        compile_grammar('start: "x" start\n', tok)
    with pytest.raises(GrammarError, match="uniqueItems"):
        schema_to_lark({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    with pytest.raises(GrammarError, match="points to nothing"):
        schema_to_lark({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})


def _acceptor(g, tok):
    """text -> whether the device grammar `g` accepts it whole (one row, stepped token by token)."""
    c = g.constraint().prepare(g.vocab_size, g.eos_ids, 8, 1)
    advance = jax.jit(c.advance)

    def accepts(text):
        st = c.init(1)
        for t in tok.encode(text):
            st = advance(st, jnp.asarray([t]))
        return bool(c.accepting(st)[0])
    return accepts


def test_lark_common_escaped_string(tok):
    """lark's common.ESCAPED_STRING (a lazy match with a lookbehind) runs on the device as the same regular
    language: escapes allowed, a raw newline not (lark's '.' does not match it)."""
    g = compile_grammar('start: ESCAPED_STRING\n%import common.ESCAPED_STRING\n', tok)
    assert g.backend == "device", g.reason
    accepts = _acceptor(g, tok)
    assert accepts('"a\\"b"') and accepts('"x\\\\"') and not accepts('"a\nb"') and not accepts('"a\\"')


@pytest.mark.parametrize("text", [
    'start: a | b\na: "x" NUM -> ax\nb: "y" NUM -> by\nNUM: /[0-9]+/\n',  # an alias on a single rule
    'start: "x" NUM -> ax\n    | "y" NUM -> by\nNUM: /[0-9]+/\n',  # aliases on alternatives
])
def test_lark_alias_is_dropped(tok, text):
    """`-> name` only names lark's tree node: the grammar compiles (the alias is not a rule reference) and
    its language is that of the grammar without the aliases."""
    g = compile_grammar(text, tok, cache=False)
    assert g.backend == "device", g.reason
    accepts = _acceptor(g, tok)
    assert accepts("x12") and accepts("y3") and not accepts("x") and not accepts("ax1") and not accepts("z1")


def test_disk_cache(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDECODE_CACHE_DIR", str(tmp_path))
    a = compile_grammar(PARENS, tok, max_depth=4)
    assert len(list((tmp_path / "grammars").glob("*.npz"))) == 1
    b = compile_grammar(PARENS, tok, max_depth=9)  # max_depth is not part of the key
    assert b.max_depth == 9 and b.tables.starts == a.tables.starts and b.tables.returns == a.tables.returns
    for k in ("kind", "next", "push", "req", "final"):
        np.testing.assert_array_equal(getattr(a.tables, k), getattr(b.tables, k))
    np.testing.assert_array_equal(a.code, b.code)
    np.testing.assert_array_equal(a.pops, b.pops)


SCHEMAS = [
    TREE,
    {"$defs": {"node": {"type": "object", "properties": {"v": {"enum": [1, "a", None]},
                                                         "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                        "required": ["next"]}}, "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"a": {"type": ["integer", "string"]}, "b": {"type": "number"},
                                      "c": {"const": [1, 2]}, "d": {"type": "boolean"}},
     "required": ["c"], "additionalProperties": False},
]


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_schema_grammar_texts_validate(tok, i):
    """Random texts of each schema's grammar (llguidance walks on schema_to_lark's grammar, EOS taken
    often) validate with jsonschema; json.dumps of valid instances are texts of the grammar."""
    import jsonschema
    import lark

    schema = SCHEMAS[i]
    text = schema_to_lark(schema)
    v = len(tok)
    rng = np.random.default_rng(i)
    done = 0
    for _ in range(12):
        m, ids = _llg_matcher(text, tok, v, (0,)), []
        for _ in range(80):
            mask = llg_mask(m, v)
            if mask[0] and rng.random() < 0.7:
                break
            ok = np.flatnonzero(mask & (np.arange(v) != 0))
            if not ok.size:
                break
            t = int(rng.choice(ok))
            m.consume_token(t)
            ids.append(t)
        if llg_mask(m, v)[0]:
            jsonschema.validate(json.loads(tok.decode(ids)), schema)
            done += 1
    assert done >= 3
    parser = lark.Lark(text, parser="earley")
    for inst in ({"value": 3, "children": [{"value": -1, "tag": "t", "children": []}]},
                 {"v": "a", "next": {"next": None}}, {"a": "x", "c": [1, 2], "d": False}):
        try:
            jsonschema.validate(inst, schema)
        except jsonschema.ValidationError:
            continue
        parser.parse(json.dumps(inst))


def test_mask_comparison_catches_a_wrong_table(tok):
    """The llguidance comparison has teeth: one forbidden (state, token class) entry fails it."""
    import dataclasses

    g = _grammar(tok, "arith")
    paren = tok.convert_tokens_to_ids("(")
    code = g.code.copy()
    code[g.tables.start, g.token_class[paren]] = -1  # "(" forbidden at the start
    with pytest.raises(AssertionError):
        _walk_compare(dataclasses.replace(g, code=code), tok, rows=1, steps=2)


def test_wrong_pop_outcome_fails_the_comparison(tok):
    """The precomputed outcome of tokens that pop once (PopPairs) is checked too: rejecting the tokens it
    allows (")" after a number in brackets) fails the llguidance comparison."""
    import dataclasses

    g = _grammar(tok, "arith")
    code = g.pairs.code.copy()
    assert (code >= 0).any() and (code == -2).any()  # some decided per stack top, some simulated
    code[code >= 0] = -1
    with pytest.raises(AssertionError):
        _walk_compare(dataclasses.replace(g, pairs=dataclasses.replace(g.pairs, code=code)), tok, rows=3, steps=20)


# ARITH with names: a different grammar of the same bucketed size
ARITH_NAMES = ARITH.replace("factor: NUMBER", "factor: NUMBER | NAME").replace("NUMBER: /[0-9]+/",
                                                                              "NUMBER: /[0-9]+/\nNAME: /[a-z]+/")


def test_similar_grammars_share_one_compiled_step(tok):
    """Device tables are padded to power-of-two sizes: two different grammars of similar size give the same
    leaf shapes, dtypes and static fields, so a jitted function of the constraint traces once for both
    (decode compiles once); the padding changes no mask along random prefixes."""
    gs = [_grammar(tok, "arith"), compile_grammar(ARITH_NAMES, tok, max_depth=64)]
    assert gs[1].backend == "device" and gs[0].tables.kind.shape != gs[1].tables.kind.shape
    cs = [g.constraint().prepare(g.vocab_size, g.eos_ids, 8, 2) for g in gs]
    (la, ta), (lb, tb) = (jax.tree.flatten(c) for c in cs)
    assert ta == tb and [(x.shape, x.dtype) for x in la] == [(x.shape, x.dtype) for x in lb]
    traces = []

    @jax.jit
    def step(c, st):
        traces.append(1)
        return c.allowed(st), c.advance(st, jnp.zeros(st.q.shape, jnp.int32))

    rng = np.random.default_rng(0)
    for g, c in zip(gs, cs):
        exact = g.constraint(bucket=False).prepare(g.vocab_size, g.eos_ids, 8, 2)
        assert exact.kind.shape[0] == g.tables.kind.shape[0] < c.kind.shape[0]
        allowed, advance = jax.jit(exact.allowed), jax.jit(exact.advance)
        st = exact.init(2)
        for _ in range(12):
            want = np.array(allowed(st))
            np.testing.assert_array_equal(np.asarray(step(c, st)[0]), want)
            want[:, list(g.eos_ids)] = False
            st = advance(st, jnp.asarray([rng.choice(np.flatnonzero(w)) if w.any() else 0 for w in want], jnp.int32))
    assert len(traces) == 1


@pytest.mark.slow
def test_speculative_greedy_equals_grammar_greedy(model):
    """Under a recursive-schema grammar, speculative greedy (self-draft and prompt lookup) equals constrained
    greedy token for token (slow: the speculative engine compiles twice)."""
    import jaxdecode.verifiers as vf
    from jaxdecode.autoregressive import decode
    from jaxdecode.drafters import make_drafter
    from jaxdecode.speculative import speculative_decode

    g = _grammar(model.tokenizer, "tree_schema", max_depth=16)
    c = g.constraint()
    enc = [model.encode("tree = {"), model.encode("data = ")]
    toks = np.zeros((2, max(map(len, enc))), np.int32)
    for i, e in enumerate(enc):
        toks[i, :len(e)] = e
    toks, lens = jnp.asarray(toks), jnp.asarray([len(e) for e in enc], jnp.int32)
    ref = decode(model.config, model.params, toks, lens, max_new_tokens=32, eos_ids=(0,), constraint=c,
                 method="greedy")
    for drafter in (make_drafter("draft_lm", model, draft=model, tree="chain:4"), make_drafter("prompt_lookup", model)):
        out = speculative_decode(model.config, model.params, drafter, toks, lens, max_new_tokens=32,
                                 verifier=vf.get_verifier("greedy"), eos_ids=(0,), constraint=c)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
