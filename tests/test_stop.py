"""Stop strings (jaxdecode.stop, issue 14): the token automaton against a brute-force byte search, and
every decoder ending each row at the token that completes a stop string (greedy, sample, beam,
speculative, with a regex), the text trimmed, bad input."""
from __future__ import annotations

import dataclasses
import random

import jax
import numpy as np
import pytest

import jaxdecode
from jaxdecode import verifiers as vf
from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.beam import beam_search
from jaxdecode.constraints.automaton import token_bytes
from jaxdecode.drafters import make_drafter
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import SpeculativeError, speculative_decode
from jaxdecode.stop import StopError, check_stops, compile_stops, stop_constraint, text_before_stop, trim_at_stop

N = 24
PROMPTS = ["def fib(n):", "import os\n", "class Foo:"]
# From the embedded model's greedy output (checked by test_greedy_rows_stop_separately): row 0 writes
# "return np.array(np..." ("(n" spans the tokens "(" and "n"), row 1 "from . import os\n..." ("mpo" sits
# inside the token " import"), row 2 ("self.assertEqual(f.get_...") contains neither.
STOPS = ["(n", "mpo"]


def first_stop_len(tb, tokens, stops, eos=(0,)):
    """Brute force: the number of tokens up to and including the one after which the bytes of the
    output first contain a stop string (len(tokens) when none does)."""
    pats = [s.encode() for s in stops]
    text = b""
    for k, t in enumerate(tokens):
        if t in eos:
            return k + 1
        text += tb[t] or b""
        if any(p in text for p in pats):
            return k + 1
    return len(tokens)


@pytest.fixture(scope="module")
def model():
    return jaxdecode.load()


@pytest.fixture(scope="module")
def tb(model):
    return token_bytes(model.tokenizer)


@pytest.fixture(scope="module")
def inputs(model):
    toks, lens = pad_prompts([model.encode(p) for p in PROMPTS])
    return toks, lens


@pytest.fixture(scope="module")
def greedy_ref(model, inputs):
    out = decode(model.config, model.params, *inputs, max_new_tokens=N, eos_ids=(0,), method="greedy")
    return [np.asarray(out.tokens[r])[:int(out.lengths[r])].tolist() for r in range(len(PROMPTS))]


def rows(out):
    return [np.asarray(out.tokens[r])[:int(out.lengths[r])].tolist() for r in range(out.tokens.shape[0])]


# ----------------------------------------------------------------------------- the automaton
def test_automaton_matches_brute_force():
    """Random token sequences over a small byte alphabet (hits are frequent; overlapping stops, a
    multi-byte character, special tokens that add no text): the table's state is STOP exactly when the
    bytes so far contain a stop string."""
    rng = random.Random(0)
    alphabet = [b"a", b"b", b"\n", b" ", "é".encode()]
    vocab = [None, None] + [b"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(60)]
    vocab += [b"\xc3", b"\xa9"]  # the two halves of "é" as separate tokens
    stops = ["ab", "b\nb", "\n\n", "é", "aaa", "ba b", " abab", "\né\n"]  # infixes of others
    tables = compile_stops(vocab, stops, len(vocab) + 3)  # ids past the list: no text
    pats = [s.encode() for s in stops]
    for _ in range(300):
        seq = [rng.randrange(len(vocab) + 3) for _ in range(10)]
        text, state = b"", 0
        for t in seq:
            text += (vocab[t] if t < len(vocab) else None) or b""
            state = tables.walk([t], state)
            assert (state == tables.stop_state) == any(p in text for p in pats), (seq, text)
    assert tables.next.shape[1] < len(vocab)  # tokens share classes


def test_automaton_embedded_vocab_and_device(model, tb):
    """The embedded tokenizer's vocabulary: host walk vs brute force, and the device advance vs the host."""
    c = stop_constraint(model, ["\n\n", "self.", "def ", ")\n"])
    tables = compile_stops(tb, c.stops, model.config.vocab_size)
    rng = np.random.default_rng(0)
    seqs = rng.integers(0, model.config.vocab_size, (64, 12))
    seqs[:, 3] = model.encode(" self")[-1]  # make hits common
    seqs[:, 4] = model.encode(".")[-1]
    state = c.init(64)
    adv = jax.jit(c.advance)
    for j in range(12):
        state = adv(state, seqs[:, j])
        for r in range(64):
            text = b"".join(tb[t] or b"" for t in seqs[r, :j + 1])
            assert bool(c.hit(state)[r]) == any(s.encode() in text for s in c.stops)
            assert int(state.stop[r]) == tables.walk(seqs[r, :j + 1])


# ----------------------------------------------------------------------------- decoders
def test_greedy_rows_stop_separately(model, tb, inputs, greedy_ref):
    """A stop string spanning two tokens (row 0), one inside a single token (row 1), none (row 2): each
    row is the unconstrained greedy output cut after the token completing its stop string."""
    want = [first_stop_len(tb, r, STOPS) for r in greedy_ref]
    assert want[0] != want[1] and want[2] == N  # rows end at different steps; row 2 never does
    last0 = tb[greedy_ref[0][want[0] - 1]]
    assert b"(n" not in last0 and b"(n" in b"".join(tb[t] for t in greedy_ref[0][want[0] - 2:want[0]])
    assert b"mpo" in tb[greedy_ref[1][want[1] - 1]]  # inside one token
    out = decode(model.config, model.params, *inputs, max_new_tokens=N, eos_ids=(0,), method="greedy",
                 constraint=stop_constraint(model, STOPS))
    got = rows(out)
    assert got == [r[:k] for r, k in zip(greedy_ref, want)]
    text, hit = trim_at_stop(model.decode(got[0]), STOPS)
    full = model.decode(greedy_ref[0])
    assert hit == "(n" and text == full[:full.index("(n")]
    assert trim_at_stop(model.decode(got[1]), STOPS) == ("from . i", "mpo")
    assert trim_at_stop(model.decode(got[2]), STOPS)[1] is None


def test_sample_is_a_prefix(model, tb, inputs):
    """Sampling with the same key: the stopped row is the unstopped row cut at its first stop string."""
    kw = dict(max_new_tokens=N, eos_ids=(0,), method="sample", sampler=SamplerConfig(temperature=1.0),
              key=jax.random.key(3))
    ref = rows(decode(model.config, model.params, *inputs, **kw))
    stops = ["e", "\n"]
    got = rows(decode(model.config, model.params, *inputs, constraint=stop_constraint(model, stops), **kw))
    want = [first_stop_len(tb, r, stops) for r in ref]
    assert got == [r[:k] for r, k in zip(ref, want)]
    assert min(want) < N


def test_beam_hypotheses_end_at_stop(model, tb, inputs):
    """Beam search: every hypothesis ends at the token completing its first stop string (or at the length
    limit / an EOS); some end by a stop string."""
    stops = ["."]
    out = beam_search(model.config, model.params, *inputs, max_new_tokens=12, num_beams=4, eos_ids=(0,),
                      constraint=stop_constraint(model, stops))
    ended = 0
    for r in range(len(PROMPTS)):
        for k in range(4):
            n = int(out.lengths[r, k])
            hyp = np.asarray(out.tokens[r, k])[:n].tolist()
            assert first_stop_len(tb, hyp, stops) == n
            ended += any(s.encode() in b"".join(tb[t] or b"" for t in hyp) for s in stops)
    assert ended > 0


def test_speculative_greedy_equals_greedy(model, inputs, greedy_ref, tb):
    """Greedy speculative decoding with stop strings = greedy decoding with them, token for token (the
    row ends inside an accepted block at the stopping token, like an EOS)."""
    c = stop_constraint(model, STOPS)
    ref = rows(decode(model.config, model.params, *inputs, max_new_tokens=N, eos_ids=(0,), method="greedy",
                      constraint=c))
    drafter = make_drafter("draft_lm", model, draft=model, tree="chain:4")  # accepts whole blocks
    out = speculative_decode(model.config, model.params, drafter, *inputs, max_new_tokens=N,
                             verifier=vf.get_verifier("greedy"), eos_ids=(0,), constraint=c)
    assert rows(out) == ref
    assert float(np.max(np.asarray(out.stats["tau"]))) > 1.5  # blocks were accepted, the stop cut one


def test_speculative_refuses_joint_verifiers(model, inputs):
    drafter = make_drafter("draft_lm", model, draft=model, tree="chain:2", temperature=1.0)
    with pytest.raises(SpeculativeError, match="stop strings"):
        speculative_decode(model.config, model.params, drafter, *inputs, max_new_tokens=4,
                           verifier=vf.get_verifier("block"), sampler=SamplerConfig(temperature=1.0),
                           eos_ids=(0,), constraint=stop_constraint(model, STOPS))


# ----------------------------------------------------------------------------- lossless sampling
# The V = 6 target of test_verifier_pairs with a byte vocabulary; token 3 ("ab") completes the stop string
# by itself, so the first two tokens' law is the target's with x2 = pad (the EOS id) after x1 = 3 or EOS.
TOY_VOCAB = [None, b"a", b"b", b"ab", b"c", b"ba"]


def toy_law():
    import test_verifier_pairs as vp
    joint = vp.exact_joint(vp.CFG, vp.PARAMS, vp.PROMPT, vp.V)
    law = joint.copy()
    for x1 in (0, 3):  # EOS, and the token that completes "ab": the row ends, x2 is the pad (id 0)
        law[x1] = 0.0
        law[x1, 0] = joint[x1].sum()
    return law


def toy_first_two(rows: int = 100_000):
    """Sampled speculative decoding of the toy target (a 2-deep iid chain the engine cuts after a stop
    string, the chain verifier): the first two tokens of `rows` rows."""
    import test_verifier_pairs as vp
    from test_constrained_speculative import Rows

    import jaxdecode.speculative as spec
    from jaxdecode.drafters.builders import StaticTreeBuilder
    c = compile_stops(TOY_VOCAB, ["ab"], vp.V).constraint(eos_ids=(0,))
    drafter = Rows(vp.LOGQ, ((StaticTreeBuilder.full((1, 1), "iid"), False, 0, rows),))
    prompts = np.tile(np.asarray(vp.PROMPT, np.int32), (rows, 1))
    with pytest.MonkeyPatch.context() as mp:  # the test drafter's iid chain with the chain verifier
        mp.setattr(spec, "check_combination", lambda *a: None)
        out = speculative_decode(vp.CFG, vp.PARAMS, drafter, prompts, np.full((rows,), len(vp.PROMPT), np.int32),
                                 max_new_tokens=2, verifier=vf.get_verifier("chain"), sampler=vp.T1, eos_ids=(0,),
                                 constraint=c, key=jax.random.key(11, impl="rbg"))
    return np.asarray(out.tokens)


@pytest.mark.exec_bound  # 1e5 rows: running, not compiling (tests/conftest.py)
def test_sampled_speculative_with_stop_is_lossless():
    """χ² (1e5 rows) of the first two tokens against the target's law cut at the stop string."""
    import test_verifier_pairs as vp
    law = toy_law()
    assert law[3, 0] > 0.3  # the stop is frequent: the cut inside accepted drafts is exercised
    assert vp.chi2_pvalue(toy_first_two(), law) > vp.P_OK


@pytest.mark.exec_bound  # 1e5 rows: running, not compiling (tests/conftest.py)
def test_ignoring_stops_inside_drafts_fails_the_same_test():
    """A deliberately wrong engine that checks stop strings only at the bonus token (not on the
    accepted draft path): rows go on past a stop inside a draft, and the same χ² test fails."""
    import test_verifier_pairs as vp

    import jaxdecode.speculative as spec
    spec._speculative.clear_cache()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(spec, "complete_slots", lambda constraint, states: jax.numpy.zeros(
            jax.tree.leaves(states)[0].shape[:2], bool))
        toks = toy_first_two()
    spec._speculative.clear_cache()
    assert vp.chi2_pvalue(toks, toy_law()) < vp.P_BROKEN


def test_stop_with_regex(model, tb, inputs):
    """With a regex inside: masked by the regex, ended by the regex (EOS) or by a stop string, whichever
    first: the regex-only output cut at its first stop string."""
    from jaxdecode.constraints.automaton import compile_regex
    inner = compile_regex(r"[a-z_. ]{1,20}", model.tokenizer, vocab_size=model.config.vocab_size,
                          eos_ids=(0,)).constraint()
    kw = dict(max_new_tokens=N, eos_ids=(0,), method="greedy")
    ref = rows(decode(model.config, model.params, *inputs, constraint=inner, **kw))
    stops = ["."]
    got = rows(decode(model.config, model.params, *inputs, constraint=stop_constraint(model, stops, inner=inner),
                      **kw))
    want = [first_stop_len(tb, r, stops) for r in ref]
    assert got == [r[:k] for r, k in zip(ref, want)]
    assert any(k < len(r) for r, k in zip(ref, want))


def test_generate_stop(model, greedy_ref):
    """generate(..., stop=...): the text trimmed before the stop string, finish_reason 'stop'."""
    res = jaxdecode.generate(model, PROMPTS, method="greedy", max_new_tokens=N, stop=STOPS)
    assert [r.stop for r in res] == ["(n", "mpo", None]
    assert [r.finish_reason for r in res][:2] == ["stop", "stop"]
    assert res[1].text == "from . i"
    full = model.decode(greedy_ref[0])
    assert res[0].text == full[:full.index("(n")]


# ----------------------------------------------------------------------------- text and bad input
def test_text_before_stop_looks_where_the_loop_looked():
    """Special tokens have no text for the stop automaton: the result's text is cut where the loop stopped,
    also when the caller keeps special tokens (skip_special_tokens=False)."""
    pieces = {0: "ab", 1: "<|im_end|>", 2: "c", 3: "de"}  # 1 is special

    def decode(ids, skip_special_tokens=True):
        return "".join(pieces[i] for i in ids if not (skip_special_tokens and i == 1))

    # "im_end" occurs only inside the special token's text: no stop, whatever is kept
    assert text_before_stop(decode, [0, 1, 2], ["im_end"], False) == ("ab<|im_end|>c", None)
    assert text_before_stop(decode, [0, 1, 2], ["im_end"], True) == ("abc", None)
    # "bc" spans the special token: found in the text without it; the special token inside goes with it
    assert text_before_stop(decode, [0, 1, 2, 3], ["bc"], True) == ("a", "bc")
    assert text_before_stop(decode, [0, 1, 2, 3], ["bc"], False) == ("a", "bc")
    # a special token before the stop is kept when asked for
    assert text_before_stop(decode, [1, 0, 2, 3], ["cd"], False) == ("<|im_end|>ab", "cd")
    assert text_before_stop(decode, [1, 0, 2, 3], ["cd"], True) == ("ab", "cd")


def test_trim_at_stop_rules():
    assert trim_at_stop("abc\n\ndef x", ["\n\n", "def "]) == ("abc", "\n\n")
    assert trim_at_stop("abcd", ["abcd", "c"]) == ("ab", "c")  # the earliest end: where the loop stopped
    assert trim_at_stop("xab", ["b", "ab"]) == ("x", "ab")  # same end: the longest
    assert trim_at_stop("nothing here", "zz") == ("nothing here", None)
    assert trim_at_stop("café!", ["é"]) == ("caf", "é")


def test_bad_input(model):
    with pytest.raises(StopError, match="empty string"):
        check_stops(["ok", ""])
    with pytest.raises(StopError, match="must be a string"):
        check_stops(["ok", 3])
    with pytest.raises(StopError, match="empty list"):
        check_stops([])
    with pytest.raises(StopError, match="string or a list"):
        check_stops({"a": 1})
    assert check_stops(["a", "b", "a"]) == ("a", "b")
    with pytest.raises(StopError, match="tokenizer"):
        stop_constraint(dataclasses.replace(model, tokenizer=None), ["x"])
    with pytest.raises(StopError, match="inner must be a constraint"):
        stop_constraint(model, ["x"], inner="[a-z]+")
    with pytest.raises(StopError, match="vocabulary has 100"):
        stop_constraint(model, ["x"]).prepare(100, (0,))
