"""Regex / JSON-schema constraints in the diffusion decoders (jaxdecode.diffusion_constraint): every
finished output is a full match, for several commit rules, caches and infilling; the same decodes
without the constraint are not; an impossible infill is refused before decoding."""
import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from jaxdecode.models import init_params
from jd_testutil import PieceTokenizer, dllm_config, tiny_dllm

from jaxdecode import diffusion as D
from jaxdecode import diffusion_constraint as DC
from jaxdecode.constraints.automaton import compile_json_schema, compile_regex

# A character tokenizer with a few merges (so a slot can hold several characters) for a 32-id model.
PIECES = (["<eos>"] + list("0123456789-ab{}\":, ") + ['{"', '":', '"a"', "12", "ab", "a-", "7}", "--", 'b"']
          + ["<mask>"])
EOS, MASK, V = 0, len(PIECES) - 1, 32

TOK = PieceTokenizer(PIECES, EOS, MASK)
ID = {p: i for i, p in enumerate(PIECES)}
PAT = r"[0-9]{2,4}-[ab]+"  # unbounded: rows fill every slot
SHORT = r"[0-9]{1,3}"  # bounded: rows must end with EOS
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 3}},
          "required": ["a", "b"]}


CFG, PARAMS, PROMPTS, LENS = tiny_dllm(V, MASK)
B = PROMPTS.shape[0]


@pytest.fixture(scope="module")
def autos():
    kw = {"vocab_size": V, "eos_ids": (EOS,), "cache": False}
    return {"pat": compile_regex(PAT, TOK, **kw), "short": compile_regex(SHORT, TOK, **kw),
            "json": compile_json_schema(SCHEMA, TOK, **kw)}


def _texts(out, suffix=None):
    """The text of each row: answer up to its EOS, then its suffix; None for unfinished rows."""
    texts = []
    for b in range(out.tokens.shape[0]):
        n = int(out.lengths[b])
        toks = np.asarray(out.tokens[b, :n]).tolist()
        body = toks[:-1] if toks and toks[-1] == EOS else toks
        if MASK in body or bool(out.stats["unfinished"][b]):
            texts.append(None)
            continue
        texts.append("".join(PIECES[t] for t in body + list(suffix[b] if suffix is not None else [])))
    return texts


def _decode(rule, answer_length=10, **kw):
    return D.diffusion_decode(CFG, PARAMS, PROMPTS, LENS, answer_length=answer_length, rule=rule, eos_ids=(EOS,),
                              **kw)


RULES = {"greedy1": D.Greedy1(), "threshold": D.Threshold(0.5), "llada3": D.LLaDA(tokens_per_step=3)}


@pytest.mark.parametrize("rule", list(RULES))
def test_regex_every_row_matches_and_unconstrained_does_not(autos, rule):
    out = _decode(RULES[rule], constraint=autos["pat"].constraint())
    texts = _texts(out)
    assert all(t is not None and re.fullmatch(PAT, t) for t in texts), texts
    assert int(jnp.max(out.stats["nfe"])) <= 10
    if rule == "greedy1":  # the same decode without the constraint misses: the test can fail
        free = _texts(_decode(RULES[rule]))
        assert not all(t is not None and re.fullmatch(PAT, t) for t in free), free


def test_bounded_regex_ends_with_eos(autos):
    """A pattern at most 3 characters long in 8 slots: the rows must commit an EOS early, and nothing
    after it (content after an EOS would be dropped, so it is never committed)."""
    out = _decode(D.Threshold(0.5), answer_length=8, constraint=autos["short"])
    texts = _texts(out)
    assert all(t is not None and re.fullmatch(SHORT, t) for t in texts), texts
    assert (np.asarray(out.lengths) <= 4).all()


def test_json_schema_validates(autos):
    out = _decode(D.Threshold(0.5), answer_length=24, constraint=autos["json"].constraint())
    for t in _texts(out):
        assert t is not None, t
        jsonschema.validate(json.loads(t), SCHEMA)
    free = _texts(_decode(D.Threshold(0.5), answer_length=24))
    assert not all(t is not None and t.startswith("{") and t.endswith("}") for t in free)


def test_infilling_with_suffix_and_emptiness(autos):
    suffix = [[ID["-"], ID["a"], ID["b"]]] * B
    out = _decode(D.Threshold(0.5), answer_length=6, constraint=autos["pat"], suffix_tokens=jnp.asarray(suffix))
    texts = _texts(out, suffix)
    assert all(t is not None and re.fullmatch(PAT, t) for t in texts), texts
    # one slot cannot hold two digits and a '-' before the suffix "b": refused before decoding
    with pytest.raises(D.DiffusionError, match="row 0 \\(1 slots\\).*followed by the row suffix"):
        _decode(D.Threshold(0.5), answer_length=1, constraint=autos["pat"],
                suffix_tokens=jnp.full((B, 1), ID["b"], jnp.int32))
    with pytest.raises(D.DiffusionError, match="EOS id"):
        _decode(D.Threshold(0.5), answer_length=6, constraint=autos["pat"],
                suffix_tokens=jnp.asarray([[ID["a"], EOS]] * B))


def test_empty_language_without_eos_and_under_jit(autos):
    """Without EOS ids the answer fills all its slots: 6 slots never hold <= 3 digits."""
    with pytest.raises(D.DiffusionError, match="must fill every slot"):
        D.diffusion_decode(CFG, PARAMS, PROMPTS, LENS, answer_length=6, rule="threshold", eos_ids=(),
                           constraint=autos["short"])
    # under jit the check cannot raise: the row with room for the pattern decodes, the other ends
    c = autos["short"].constraint()
    lengths = jnp.asarray([3, 6, 3, 3, 3, 3], jnp.int32)
    out = jax.jit(lambda al: D.diffusion_decode(CFG, PARAMS, PROMPTS, LENS, answer_length=6, rule="threshold",
                                                eos_ids=(), answer_lengths=al, constraint=c))(lengths)
    assert np.asarray(out.stats["constraint_empty"]).tolist() == [False, True, False, False, False, False]
    texts = _texts(out)
    assert all(re.fullmatch(SHORT, t) for i, t in enumerate(texts) if i != 1), texts


def test_token_automaton_closed_over_under_jit(autos):
    """A TokenAutomaton closed over by the caller's jit works as its .constraint() does (the tables are built
    eagerly, not as tracers of the caller's trace)."""
    auto = autos["pat"]
    run = lambda c: jax.jit(lambda p: D.diffusion_decode(CFG, p, PROMPTS, LENS, answer_length=10, rule="threshold",
                                                         eos_ids=(EOS,), constraint=c))(PARAMS)
    out, ref = run(auto), run(auto.constraint())
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert all(re.fullmatch(PAT, t) for t in _texts(out) if t is not None)


@pytest.mark.parametrize("mode", ["prefix_shift1", "block", "freedave"])
def test_caches_and_lookahead(autos, mode):
    if mode == "block":
        cfg = dllm_config(V, MASK, attention="block", block_size=4)
        out = D.block_diffusion_decode(cfg, init_params(cfg, jax.random.PRNGKey(1), std=0.3), PROMPTS, LENS,
                                       answer_length=12, rule=D.Threshold(0.5), eos_ids=(EOS,),
                                       constraint=autos["pat"])
    elif mode == "prefix_shift1":
        cfg = dllm_config(V, MASK, logits_shift=1)
        out = D.diffusion_decode(cfg, PARAMS, PROMPTS, LENS, answer_length=12, block_length=4, cache="prefix",
                                 rule=D.Threshold(0.5), eos_ids=(EOS,), constraint=autos["pat"])
    else:
        out = _decode(D.FreeDave(), answer_length=8, constraint=autos["short"])
    pat = SHORT if mode == "freedave" else PAT
    texts = _texts(out)
    assert all(t is not None and re.fullmatch(pat, t) for t in texts), texts


def test_filter_keeps_leftmost_and_rejects_conflicts(autos):
    """Unit check of the left-to-right filter: in 3 slots of [0-9]{1,3} + EOS, proposals "1" at slot 0 and
    EOS at slot 1 are compatible, but content at slot 2 after that EOS is not."""
    a = DC.bind(autos["short"].constraint(), vocab_size=V, eos_ids=(EOS,), mask_id=MASK, batch=1)
    answer = jnp.full((1, 3), MASK, jnp.int32)
    lengths = jnp.asarray([3], jnp.int32)
    tacc = DC.tail_accept(a, None, 1)
    st = DC.sets(a, answer, lengths, tacc, MASK, True)
    tokens = jnp.asarray([[ID["1"], EOS, ID["2"]]], jnp.int32)
    kept = DC.filter_commits(a, st, jnp.ones((1, 3), bool), tokens, tacc, True)
    assert np.asarray(kept).tolist() == [[True, True, False]]
    ok = np.asarray(DC.token_mask(a, st, tacc, True))[0]  # [3, V]
    assert not ok[0, EOS] and ok[1, EOS] and ok[0, ID["12"]] and not ok[0, ID["a"]]


def test_bad_constraints(autos):
    with pytest.raises(D.DiffusionError, match="regex / JSON-schema constraint"):
        _decode(D.Greedy1(), constraint=object())
    small = compile_regex(PAT, TOK, vocab_size=V, eos_ids=(), cache=False)  # EOS id 0 would be a pattern token?
    assert small.token_class[EOS] == 0  # <eos> is special: never a pattern token
    with pytest.raises(D.DiffusionError, match="vocabulary has"):
        DC.bind(autos["pat"].constraint(), vocab_size=V - 4, eos_ids=(EOS,), mask_id=V - 5, batch=B)


def test_constraint_prefix_starts_in_the_prompt(autos):
    """The prompts end in "12" / "7" / "1"; with constraint_prefix the pattern covers them: the answer
    continues the number (pattern [0-9]{2,4}-[ab]+ over prompt tail + answer + suffix "b")."""
    prompts = jnp.asarray([[3, 4, ID["1"], ID["2"]], [5, ID["7"], 0, 0], [6, 8, 9, ID["1"]]], jnp.int32)
    lens = jnp.asarray([4, 2, 4], jnp.int32)
    prefix = jnp.asarray([2, 1, 1], jnp.int32)
    suffix = jnp.full((3, 1), ID["b"], jnp.int32)
    out = D.diffusion_decode(CFG, PARAMS, prompts, lens, answer_length=5, rule=D.Threshold(0.5), eos_ids=(EOS,),
                             constraint=autos["pat"], constraint_prefix=prefix, suffix_tokens=suffix)
    heads = ["12", "7", "1"]
    for head, t in zip(heads, _texts(out, np.asarray(suffix))):
        assert t is not None and re.fullmatch(PAT, head + t), (head, t)
    with pytest.raises(D.DiffusionError, match="after the constraint_prefix"):  # "a" cannot start a number
        D.diffusion_decode(CFG, PARAMS, prompts.at[0, 3].set(ID["a"]), lens, answer_length=5, rule="threshold",
                           eos_ids=(EOS,), constraint=autos["pat"], constraint_prefix=prefix, suffix_tokens=suffix)
    with pytest.raises(D.DiffusionError, match="constraint_prefix must be in"):
        D.diffusion_decode(CFG, PARAMS, prompts, lens, answer_length=5, eos_ids=(EOS,), constraint=autos["pat"],
                           constraint_prefix=3)


def _brute_completable(auto, slots):
    """Host reference: some filling of the MASK slots (one token each: a class representative or EOS) is
    text + EOS padding with the text accepted (content after an EOS is never part of a filling)."""
    import itertools
    reps = [int(np.flatnonzero(auto.token_class == c)[0]) for c in range(1, auto.num_classes)] + [EOS]
    holes = [j for j, t in enumerate(slots) if t == MASK]
    for fill in itertools.product(reps, repeat=len(holes)):
        seq = list(slots)
        for j, t in zip(holes, fill):
            seq[j] = t
        end = seq.index(EOS) if EOS in seq else len(seq)
        if any(t != EOS for t in seq[end:]):
            continue
        s = auto.walk(seq[:end])
        if s >= 0 and auto.final[s]:
            return True
    return False


def test_reachability_equals_brute_force(autos):
    """completable() and token_mask() against enumerating every filling, on random partial answers."""
    rng = np.random.RandomState(0)
    a4 = 4
    for name in ("short", "pat"):
        host = autos[name]
        a = DC.bind(host, vocab_size=V, eos_ids=(EOS,), mask_id=MASK, batch=24)
        pool = [MASK] * 4 + [EOS, ID["1"], ID["12"], ID["-"], ID["a"], ID["ab"], ID["a-"]]
        answers = rng.choice(pool, size=(24, a4)).astype(np.int32)
        lengths = jnp.full((24,), a4, jnp.int32)
        tacc = DC.tail_accept(a, None, 24)
        st = DC.sets(a, jnp.asarray(answers), lengths, tacc, MASK, True)
        got = np.asarray(DC.completable(a, st))
        ok = np.asarray(DC.token_mask(a, st, tacc, True))  # [B, A, V]
        for b in range(24):
            assert got[b] == _brute_completable(host, answers[b].tolist()), (name, answers[b])
            for j in np.flatnonzero(answers[b] == MASK)[:1]:  # the first hole: each candidate token
                for t in (EOS, ID["1"], ID["12"], ID["-"], ID["a"], ID["b\""]):
                    seq = answers[b].tolist()
                    seq[j] = t
                    assert ok[b, j, t] == _brute_completable(host, seq), (name, answers[b], j, t)
