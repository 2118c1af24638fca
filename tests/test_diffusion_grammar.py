"""Grammar constraints in the diffusion decoders (jaxdecode.diffusion_constraint.GrammarBinding): the answer
stays a valid prefix of the grammar; every row that ends with EOS parses (lark, independent of the device
automaton), for rules that commit one or many slots per forward, both decoders, per-row grammars, under
jit and through generate; a filter that keeps every proposed commit does not; bad input is refused."""
import jax
import jax.numpy as jnp
import lark
import numpy as np
import pytest
from jaxdecode.models import init_params
from jd_testutil import ARITH_LARK, PieceTokenizer, dllm_config, tiny_dllm

import jaxdecode
from jaxdecode import diffusion as D
from jaxdecode import diffusion_constraint as DC
from jaxdecode.constraints.grammar import LLGuidanceConstraint, compile_grammar, stack_grammars
from jaxdecode.model import Model

# A character tokenizer with a few merges (a slot can hold several characters) for a 32-id model.
PIECES = (["<eos>"] + list("0123456789+-*/()") + ["12", "(1", "+(", ")*", "3)", "--", "7+", "))", "((", "0-",
                                                   "x", "y", "z", "9)"] + ["<mask>"])
EOS, MASK, V = 0, len(PIECES) - 1, 32
assert len(PIECES) == V
ID = {p: i for i, p in enumerate(PIECES)}

TOK = PieceTokenizer(PIECES, EOS, MASK)
ARITH = ARITH_LARK
# nesting bounded by max_depth: every text fits in 10 slots, so a row must end with EOS
NEST = r"""
start: item
item: "(" item ")" | NUMBER
NUMBER: /[0-9]{1,2}/
"""
PARSERS = {name: lark.Lark(text, parser="earley") for name, text in (("arith", ARITH), ("nest", NEST))}


CFG, PARAMS, PROMPTS, LENS = tiny_dllm(V, MASK)
B = PROMPTS.shape[0]


@pytest.fixture(scope="module")
def grammars():
    kw = {"vocab_size": V, "eos_ids": (EOS,), "cache": False}
    return {"arith": compile_grammar(ARITH, TOK, **kw), "nest": compile_grammar(NEST, TOK, max_depth=2, **kw)}


def _parses(name, text):
    try:
        PARSERS[name].parse(text)
        return True
    except lark.exceptions.LarkError:
        return False


def _prefix_ok(name, text):
    """A valid prefix: some completion parses (an operand if one is due, then the open parentheses closed)."""
    close = ")" * (text.count("(") - text.count(")"))
    return any(_parses(name, text + tail + close) for tail in ("", "1"))


def _rows(out):
    """(text without EOS, ended with EOS) per row."""
    rows = []
    for b in range(out.tokens.shape[0]):
        toks = np.asarray(out.tokens[b, :int(out.lengths[b])]).tolist()
        eos = bool(toks) and toks[-1] == EOS
        rows.append(("".join(PIECES[t] for t in (toks[:-1] if eos else toks)), eos))
    return rows


def _check(out, names):
    """Every EOS row parses; every other row is a valid prefix, reported unmatched unless it parses."""
    unmatched = np.asarray(out.stats["constraint_unmatched"]).tolist()
    for (text, eos), name, um in zip(_rows(out), names, unmatched):
        if eos:
            assert _parses(name, text) and not um, (name, text)
        else:
            assert _prefix_ok(name, text) and um is not _parses(name, text), (name, text)


def _decode(rule, constraint, answer_length=10, **kw):
    return D.diffusion_decode(CFG, PARAMS, PROMPTS, LENS, answer_length=answer_length, rule=rule, eos_ids=(EOS,),
                              constraint=constraint, **kw)


@pytest.mark.parametrize("rule", ["threshold0", "llada3"])
def test_bounded_grammar_rows_end_with_eos_and_parse(grammars, rule):
    r = {"threshold0": D.Threshold(0.0), "llada3": D.LLaDA(tokens_per_step=3)}[rule]
    out = _decode(r, grammars["nest"].constraint())
    rows = _rows(out)
    assert all(eos and _parses("nest", t) for t, eos in rows), rows
    assert not np.asarray(out.stats["constraint_unmatched"]).any()
    if rule == "threshold0":  # every slot proposed each forward: several kept per forward on some row
        assert float(jnp.max(out.stats["tokens_per_forward"])) > 1.0


def test_a_filter_that_keeps_every_proposal_fails(grammars, monkeypatch):
    """The same decode as above with the left-to-right filter broken (every proposed commit kept): the
    texts do not parse, so the test above can fail."""
    keep = DC.GrammarBinding.keep

    def keep_all(self, carry, step, commit, tokens):
        kept, tokens, carry = keep(self, carry, step, commit, tokens)
        return kept | commit, tokens, carry

    monkeypatch.setattr(DC.GrammarBinding, "keep", keep_all)
    D._decode.clear_cache()  # a cached trace of the real filter must not serve this decode
    try:
        rows = _rows(_decode(D.Threshold(0.0), grammars["nest"].constraint()))
    finally:
        D._decode.clear_cache()  # the broken trace must not serve later decodes
    assert not all(eos and _parses("nest", t) for t, eos in rows), rows


def test_unbounded_grammar_both_decoders(grammars):
    """Arithmetic (unbounded): rows end with EOS and parse, or run out of slots on a valid prefix."""
    out = _decode(D.Threshold(0.5), grammars["arith"], answer_length=8)
    _check(out, ["arith"] * B)
    cfg = dllm_config(V, MASK, attention="block", block_size=4)
    out = D.block_diffusion_decode(cfg, init_params(cfg, jax.random.PRNGKey(1), std=0.3), PROMPTS, LENS,
                                   answer_length=8, rule=D.Threshold(0.3), eos_ids=(EOS,),
                                   constraint=grammars["arith"].constraint())
    _check(out, ["arith"] * B)


def test_per_row_grammars_lengths_and_jit(grammars):
    both = stack_grammars([grammars["nest"], grammars["arith"]])
    starts = [0, 1, 0, 1, 0, 1]
    c = both.constraint(starts=starts)
    lengths = jnp.asarray([10, 6, 10, 3, 7, 8], jnp.int32)
    run = jax.jit(lambda al: _decode(D.LLaDA(tokens_per_step=2), c, answer_lengths=al))
    out = run(lengths)
    _check(out, [("nest", "arith")[s] for s in starts])
    assert (np.asarray(out.lengths) <= np.asarray(lengths)).all()
    assert np.asarray(_rows(out)[0][1]) and np.asarray(_rows(out)[2][1])  # 10 slots: nest always fits


@pytest.mark.slow
def test_lookahead_rule(grammars):
    """FreeDave runs its candidates through one forward: each candidate's commits are filtered, the kept
    candidate's grammar state carries on."""
    out = _decode(D.FreeDave(), grammars["nest"], answer_length=8)
    assert all(eos and _parses("nest", t) for t, eos in _rows(out))


def test_constraint_prefix(grammars):
    # the prompts' last token starts the text: "(" / "(1" -> the answer continues it
    prompts = jnp.asarray([[3, ID["("]], [ID["(1"], 0]], jnp.int32)
    out = D.diffusion_decode(CFG, PARAMS, prompts, jnp.asarray([2, 1]), answer_length=8, rule="threshold",
                             eos_ids=(EOS,), constraint=grammars["nest"], constraint_prefix=1)
    for head, (text, eos) in zip(["(", "(1"], _rows(out)):
        assert eos and _parses("nest", head + text), (head, text)
    with pytest.raises(D.DiffusionError, match="no prefix of a text of the grammar"):
        D.diffusion_decode(CFG, PARAMS, jnp.asarray([[3, ID[")"]]]), jnp.asarray([2]), answer_length=8,
                           eos_ids=(EOS,), constraint=grammars["nest"], constraint_prefix=1)


def test_bad_input(grammars):
    with pytest.raises(D.DiffusionError, match="infilling .* grammar constraint is not supported.*regex"):
        _decode(D.Greedy1(), grammars["arith"], suffix_tokens=jnp.full((B, 2), ID["1"], jnp.int32))
    host = LLGuidanceConstraint(grammar=ARITH, tokenizer=TOK, vocab=V, grammar_eos=(EOS,))
    with pytest.raises(D.DiffusionError, match="llguidance's host matcher"):
        _decode(D.Greedy1(), host)
    with pytest.raises(D.DiffusionError, match="needs eos_ids"):
        D.diffusion_decode(CFG, PARAMS, PROMPTS, LENS, answer_length=4, eos_ids=(), constraint=grammars["arith"])
    with pytest.raises(D.DiffusionError, match="start states for 2 rows"):
        _decode(D.Greedy1(), stack_grammars([grammars["nest"], grammars["arith"]]).constraint(starts=[0, 1]))


def test_generate_with_grammar():
    """generate(method="diffusion", grammar=...): one grammar per prompt (stacked), outputs validated by lark."""
    model = Model(config=CFG, params=PARAMS, tokenizer=TOK)
    res = jaxdecode.generate(model, [[3, 4], [5], [6, 7, 8]], method="diffusion", max_new_tokens=8,
                             grammar=[NEST, ARITH, NEST], rule="threshold", threshold=0.0, eos_ids=[EOS])
    for r, name in zip(res, ["nest", "arith", "nest"]):
        assert r.constraint == "grammar" and r.validator == "lark" and "pushdown" in r.backend
        assert r.valid is _parses(name, r.text) and r.valid is not r.stats["constraint_unmatched"], r
    assert res[0].valid and res[2].valid  # nest fits in 8 slots: these rows must end with EOS
