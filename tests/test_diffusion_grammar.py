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


import dataclasses  # noqa: E402


@dataclasses.dataclass(frozen=True)
class SampledSlots(D.Rule):
    """A test rule that strays from the grammar's guide: `n` random eligible slots, each with a token
    SAMPLED from its (masked) logits, so a later slot's proposal often does not follow the earlier ones."""
    n: int = 3
    name = "sampled_slots"

    def select(self, ctx):
        k1, k2 = jax.random.split(ctx.key)
        tokens = jax.random.categorical(k1, ctx.logits.astype(jnp.float32), axis=-1).astype(jnp.int32)
        return D.top_n(jax.random.uniform(k2, ctx.eligible.shape), ctx.eligible, self.n), tokens, ctx.state


def _decode(rule, constraint, answer_length=10, **kw):
    return D.diffusion_decode(CFG, PARAMS, PROMPTS, LENS, answer_length=answer_length, rule=rule, eos_ids=(EOS,),
                              constraint=constraint, **kw)


@pytest.mark.parametrize("rule", ["threshold0", "llada3", "sampled"])
def test_bounded_grammar_rows_end_with_eos_and_parse(grammars, rule):
    r = {"threshold0": D.Threshold(0.0), "llada3": D.LLaDA(tokens_per_step=3), "sampled": SampledSlots(3)}[rule]
    out = _decode(r, grammars["nest"].constraint(), key=jax.random.PRNGKey(3))
    rows = _rows(out)
    assert all(eos and _parses("nest", t) for t, eos in rows), rows
    assert not np.asarray(out.stats["constraint_unmatched"]).any()
    if rule == "threshold0":  # every slot proposed each forward: several kept per forward on some row
        assert float(jnp.max(out.stats["tokens_per_forward"])) > 1.0


def test_a_filter_that_keeps_every_proposal_fails(grammars, monkeypatch):
    """The same decode as above (the rule that strays) with the witness check broken (every proposed
    commit kept): the texts do not parse, so the test above can fail."""
    keep = DC.GrammarBinding.keep

    def keep_all(self, carry, step, commit, tokens):
        kept, tokens, carry = keep(self, carry, step, commit, tokens)
        return kept | commit, tokens, carry

    monkeypatch.setattr(DC.GrammarBinding, "keep", keep_all)
    D._decode.clear_cache()  # a cached trace of the real filter must not serve this decode
    try:
        rows = _rows(_decode(SampledSlots(3), grammars["nest"].constraint(), key=jax.random.PRNGKey(3)))
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


# ----------------------------------------------------------------------------- the witness, step by step
def _binding(grammar, batch, answer_length):
    bound = DC.bind_constraint(grammar.constraint(), vocab_size=V, eos_ids=(EOS,), mask_id=MASK, batch=batch,
                               answer_length=answer_length)
    answer = jnp.full((batch, answer_length), MASK, jnp.int32)
    lengths = jnp.full((batch,), answer_length, jnp.int32)
    binding, carry, _ = DC.start(bound, answer, lengths, None, None, mask_id=MASK, eos_ids=(EOS,), vocab_size=V)
    return binding, carry, answer, lengths


def _favour(pieces_by_slot, answer_length):
    """Logits [1, A, V] whose best token at slot j is pieces_by_slot[j] (None: uniform)."""
    lg = np.zeros((1, answer_length, V), np.float32)
    for j, piece in enumerate(pieces_by_slot):
        if piece is not None:
            lg[0, j, ID[piece]] = 5.0
    return jnp.asarray(lg)


@jax.jit
def _mask_keep(binding, carry, answer, lengths, logits, commit, tokens):
    _, st = binding.mask(carry, answer, lengths, logits)
    return binding.keep(carry, st, commit, tokens)


def _step(binding, carry, answer, lengths, logits, proposals):
    """One forward: the binding's mask and keep with the given proposals {slot: piece}; the new answer."""
    commit = np.zeros(answer.shape, bool)
    tokens = np.zeros(answer.shape, np.int32)
    for j, piece in proposals.items():
        commit[0, j], tokens[0, j] = True, ID[piece]
    kept, toks, carry = _mask_keep(binding, carry, answer, lengths, logits, jnp.asarray(commit), jnp.asarray(tokens))
    return np.asarray(kept)[0], jnp.where(kept, toks, answer), carry


def test_witness_keeps_a_proposal_right_of_the_frontier(grammars):
    """A proposal three slots right of the frontier is kept when the model's own guesses fill the gap
    ("(" "1" then ")"); the frontier then commits the witness's tokens, one per forward without proposals."""
    binding, carry, answer, lengths = _binding(grammars["nest"], 1, 6)
    logits = _favour(["(", "1", None, None], 6)
    kept, answer, carry = _step(binding, carry, answer, lengths, logits, {2: ")"})
    assert kept.tolist() == [False, False, True, False, False, False]
    uniform = jnp.zeros((1, 6, V))  # the witness, not this forward's logits, fills the frontier now
    for want in ("(", "1"):
        kept, answer, carry = _step(binding, carry, answer, lengths, uniform, {})
        assert PIECES[int(answer[0, int(np.argmax(kept))])] == want
    assert "".join(PIECES[int(t)] for t in answer[0, :3]) == "(1)"


def test_witness_rejects_what_no_filling_of_the_guess_allows(grammars):
    """")" right after a number (the guess for slot 0) has no walk: rejected; the frontier slot commits
    its best allowed token instead (nothing is committed further right)."""
    binding, carry, answer, lengths = _binding(grammars["nest"], 1, 6)
    kept, answer, _ = _step(binding, carry, answer, lengths, _favour(["7", None], 6), {1: ")"})
    assert kept.tolist() == [True, False, False, False, False, False] and PIECES[int(answer[0, 0])] == "7"


def test_witness_tries_proposals_one_at_a_time(grammars):
    """Together two ")" proposals have no walk (the second closes nothing: after "(1)" only EOS); the
    first alone has one, so it is kept and the second dropped."""
    binding, carry, answer, lengths = _binding(grammars["nest"], 1, 6)
    kept, _, _ = _step(binding, carry, answer, lengths, _favour(["(", "1", None, "5"], 6), {2: ")", 4: ")"})
    assert kept.tolist() == [False, False, True, False, False, False]


def test_witness_random_proposals_keep_the_answer_extendable(grammars):
    """Random logits and random proposals, forward after forward: the committed slots, with the witness
    in the gaps, always read as a valid prefix (lark, independently); the rows end as texts or prefixes."""
    rng = np.random.default_rng(0)
    a, b = 8, 4
    binding, carry, answer, lengths = _binding(grammars["arith"], b, a)
    keep = jax.jit(lambda c, st, cm, tk: binding.keep(c, st, cm, tk))
    mask = jax.jit(lambda c, ans, lg: binding.mask(c, ans, lengths, lg))
    for _ in range(3 * a):
        ans = np.asarray(answer)
        open_ = (ans == MASK)
        if not open_.any():
            break
        logits = jnp.asarray(rng.normal(0, 2, (b, a, V)).astype(np.float32))
        _, st = mask(carry, answer, logits)
        commit = open_ & (rng.random((b, a)) < 0.4)
        tokens = rng.integers(1, MASK, (b, a)).astype(np.int32)  # any text token, EOS never proposed
        kept, toks, carry = keep(carry, st, jnp.asarray(commit), jnp.asarray(tokens))
        kept = np.asarray(kept)
        assert not (kept & ~open_).any() and (kept.any(-1) | ~open_.any(-1)).all()  # >= 1 per live row
        ans = np.where(kept, np.asarray(toks), ans)
        after_eos = np.cumsum(ans == EOS, axis=-1) > 0  # padding after a committed EOS, as the decoder does
        ans = np.where(after_eos, EOS, ans)
        answer, wit = jnp.asarray(ans), np.asarray(carry.witness)
        for r in range(b):
            fixed = np.nonzero(ans[r] != MASK)[0]
            last = int(fixed.max()) if fixed.size else -1
            text = ""
            for j in range(last + 1):
                t = int(ans[r, j]) if ans[r, j] != MASK else int(wit[r, j])
                if t == EOS:
                    break
                text += PIECES[t]
            assert _prefix_ok("arith", text) or _parses("arith", text), (r, text)
    assert not (np.asarray(answer) == MASK).any()


# ----------------------------------------------------------------------------- infilling under a grammar
def _ids(text):
    out, i = [], 0
    while i < len(text):  # longest piece first, as a tokenizer with merges would
        piece = max((p for p in PIECES[1:-1] if text.startswith(p, i)), key=len)
        out.append(ID[piece])
        i += len(piece)
    return out


def test_infilling_under_a_grammar(grammars):
    """Answer + suffix parse: a suffix that closes parentheses, one that continues an expression; a fixed
    answer length per row; the first witness comes from the host search and the decode keeps one."""
    suffixes = [")", "+2)", "*(3-4)", ")", "1", "))"]
    width = max(len(_ids(x)) for x in suffixes)
    st = np.zeros((B, width), np.int32)
    sl = np.asarray([len(_ids(x)) for x in suffixes], np.int32)
    for r, x in enumerate(suffixes):
        st[r, :sl[r]] = _ids(x)
    for rule in (D.Threshold(0.0), SampledSlots(3)):
        out = _decode(rule, grammars["arith"], answer_length=6, suffix_tokens=jnp.asarray(st),
                      suffix_lengths=jnp.asarray(sl), key=jax.random.PRNGKey(5))
        for (text, _), x in zip(_rows(out), suffixes):
            assert _parses("arith", text + x), (rule, text, x)
        assert not np.asarray(out.stats["constraint_unmatched"]).any()


def test_grammar_infill_witness_search(grammars):
    """The host search: the fewest tokens the suffix closes; exhaustive 'empty' for a bounded grammar."""
    c = DC.bind_constraint(grammars["nest"].constraint(), vocab_size=V, eos_ids=(EOS,), mask_id=MASK, batch=2,
                           answer_length=4)
    binding = DC.GrammarBinding(constraint=c, mask_id=MASK, eos_ids=(EOS,), vocab_size=V)
    start = binding.init(2, 4).state
    suffix = (jnp.asarray([[ID[")"], 0], [ID["))"], ID[")"]]], jnp.int32), jnp.asarray([1, 2], jnp.int32))
    wit, status = DC.grammar_infill_witness(c, start, suffix, jnp.asarray([4, 4]), answer_length=4, eos_ids=(EOS,),
                                            mask_id=MASK)
    assert status == ["found", "empty"]  # max_depth 2: three closing parentheses never fit
    text = "".join(PIECES[t] for t in wit[0] if t != EOS)
    assert _parses("nest", text + ")") and len([t for t in wit[0] if t != EOS]) == 1, text  # "(1" is one token
    with pytest.raises(D.DiffusionError, match=r"row 1 \(4 slots\): no answer of that many slots"):
        D.diffusion_decode(CFG, PARAMS, PROMPTS[:2], LENS[:2], answer_length=4, eos_ids=(EOS,),
                           constraint=grammars["nest"], suffix_tokens=suffix[0], suffix_lengths=suffix[1])
    with pytest.raises(D.DiffusionError, match="outside jax.jit"):
        jax.jit(lambda st: D.diffusion_decode(CFG, PARAMS, PROMPTS[:2], LENS[:2], answer_length=4, eos_ids=(EOS,),
                                              constraint=grammars["nest"], suffix_tokens=st,
                                              suffix_lengths=suffix[1]))(suffix[0])
