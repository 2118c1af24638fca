"""Grammar constraints (jaxdecode.constraints.grammar): device pushdown masks equal llguidance's on random
prefixes, generated texts parse / validate, the llguidance fallback, bad input."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.constraints.automaton import token_bytes
from jaxdecode.constraints.grammar import GrammarError, compile_grammar, llg_mask
from jaxdecode.constraints.grammar_schema import compile_schema_grammar, is_recursive_schema, schema_to_lark

ARITH = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")" | "-" factor
NUMBER: /[0-9]+/
"""
PARENS = r"""
start: group+
group: "(" group* ")" | "[" group* "]"
"""
JSON_LARK = r"""
start: value
?value: object | array | STRING | NUMBER | "true" | "false" | "null"
object: "{" [pair ("," pair)*] "}"
pair: STRING ":" value
array: "[" [value ("," value)*] "]"
STRING: /"[a-z ]*"/
NUMBER: /-?[0-9]+(\.[0-9]+)?/
WS: /[ \n]+/
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
root ::= "[" items? "]"
items ::= item ("," item)*
item ::= [0-9]+ | root
"""
TREE = {"type": "object", "properties": {"value": {"type": "integer"}, "tag": {"type": "string"},
        "children": {"type": "array", "items": {"$ref": "#"}}}, "required": ["value", "children"]}
LEFT_RECURSIVE = r"""
start: sum
sum: sum "+" NUMBER | NUMBER
NUMBER: /[0-9]+/
"""


@pytest.fixture(scope="module")
def tok():
    from pathlib import Path

    from jaxdecode.models import load_tokenizer

    return load_tokenizer(Path(__file__).resolve().parents[1] / "models" / "embedded" / "target")


def _walk_compare(g, tok, rows=4, steps=24, seed=0):
    """Random walks under llguidance's masks (biased towards structure tokens); the device mask must equal
    llguidance's at every step."""
    v = g.vocab_size
    c = g.constraint().prepare(v, g.eos_ids, steps, rows)
    allowed, advance = jax.jit(c.allowed), jax.jit(c.advance)
    st = c.init(rows)
    ms = [g.matcher() for _ in range(rows)]
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
    text = dict(arith=ARITH, parens=PARENS, json=JSON_LARK, spanning=SPANNING, gbnf=GBNF).get(name)
    # deep enough that the walks never meet the depth bound (tested on its own below)
    kw = dict(max_depth=64)
    g = compile_schema_grammar(TREE, tok, **kw) if name == "tree_schema" else compile_grammar(text, tok, **kw)
    assert g.backend == "device", g.reason
    hist = _walk_compare(g, tok)
    assert any(len(set(tok.decode(h)) & set("([{")) for h in hist)
