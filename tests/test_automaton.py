"""Regex / JSON-schema token automata (jaxdecode.constraints.automaton): device masks against
outlines-core's, outputs that validate, stacking, intersection, the packed mask, the cache, bad input."""
from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode.constraints import automaton as am
from jaxdecode.constraints.automaton import AutomatonError, compile_json_schema, compile_regex, stack_automata
from jaxdecode.constraints.protocol import intersect
from jaxdecode.constraints.trie import ConstraintError

jsonschema = pytest.importorskip("jsonschema")
outlines_core = pytest.importorskip("outlines_core")

REGEXES = [
    r"[0-9]{1,3}", r"-?(0|[1-9][0-9]*)(\.[0-9]+)?", r"\d{4}-\d{2}-\d{2}", r"[a-z]+@[a-z]+\.(com|org)",
    r"(cat|dog|bird)s?", r"yes|no|maybe", r"[A-Z][a-z]{2,5} [A-Z][a-z]{2,5}", r"(ab){2,3}c",
    r"é|日本", r"caf[ée] (au lait)?", r"\(\d{3}\) \d{3}-\d{4}", r"\[[0-9, ]{0,6}\]", r"[^\n\"]{3,8}",
    r"0x[0-9a-f]{2,4}", r"(true|false)", r"\{\"a\":[0-9]\}", r"a+b*", r"[\u00e0-\u00ff]{1,3}",
]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "array", "items": {"type": "integer", "maxDigits": 3}, "maxItems": 3},
    {"enum": ["red", "green", 3, None]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "boolean"},
    {"type": "null"},
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {
        "type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}}, "required": ["ok", "tags"]},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"oneOf": [{"type": "string", "format": "date"}, {"type": "null"}]},
    {"type": "array", "items": {"type": "integer", "minimum": -12, "exclusiveMaximum": 130}, "maxItems": 2},
]
# What pydantic emits for a model with an enum, an Optional field, a discriminated union and bounds.
PET = {"$defs": {
    "Cat": {"properties": {"kind": {"const": "cat", "title": "Kind", "type": "string"},
                           "lives": {"maximum": 9, "minimum": 0, "title": "Lives", "type": "integer"}},
            "required": ["kind", "lives"], "title": "Cat", "type": "object"},
    "Color": {"enum": ["red", "green"], "title": "Color", "type": "string"},
    "Dog": {"properties": {"kind": {"const": "dog", "title": "Kind", "type": "string"},
                           "good": {"title": "Good", "type": "boolean"}},
            "required": ["kind", "good"], "title": "Dog", "type": "object"}},
    "properties": {"name": {"maxLength": 5, "title": "Name", "type": "string"},
                   "color": {"$ref": "#/$defs/Color"},
                   "nick": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}], "default": None},
                   "animal": {"discriminator": {"mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"},
                                                "propertyName": "kind"},
                              "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "title": "Animal"}},
    "required": ["name", "color", "animal"], "title": "Pet", "type": "object"}
SCHEMAS.append(PET)
PROMPT = "Answer in JSON: "


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model():
    return jaxdecode.load()


@pytest.fixture(scope="module")
def tok(model):
    return model.tokenizer


def _compile(spec, tokenizer, vocab_size=None, **kw):
    kw.setdefault("eos_ids", (0,))
    kw.setdefault("cache", False)
    if isinstance(spec, dict):
        return compile_json_schema(spec, tokenizer, vocab_size=vocab_size, **kw)
    return compile_regex(spec, tokenizer, vocab_size=vocab_size, **kw)


MARKER = 10**6  # the end-marker token's id in the reference index


def _outlines_index(pattern, tokenizer, eos):
    """outlines-core's own Index over the same id -> bytes map (the reference), for `(?:pattern)` + an end
    marker token: outlines-core 0.2.14 drops the transitions that leave an accepting state for a
    non-accepting one (test_outlines_accepting_state_bug), so a state accepts the pattern where the
    marker token leads on from it."""
    mapping = {am.END_MARKER.encode(): [MARKER]}
    for i, b in enumerate(am.token_bytes(tokenizer)):
        if b and i != eos:
            mapping.setdefault(b, []).append(i)
    return outlines_core.Index(f"(?:{pattern}){am.END_MARKER}", outlines_core.Vocabulary(eos, mapping))


def _accepts(index, state):
    return index.get_transitions().get(state, {}).get(MARKER) in index.get_final_states()


def _can_finish(index, state, memo):
    """Reference liveness: can an accepting state be reached from `state` in outlines' index?"""
    if state in memo:
        return memo[state]
    trans = index.get_transitions()
    seen, stack = {state}, [state]
    while stack:
        s = stack.pop()
        if _accepts(index, s):
            memo[state] = True
            return True
        for n in trans.get(s, {}).values():
            if n not in seen:
                seen.add(n)
                stack.append(n)
    memo[state] = False
    return False


def _device_masks(auto, states, eos, form):
    c = auto.constraint(mask=form).prepare(auto.vocab_size, (eos,))
    return np.asarray(c.allowed(am.AutomatonState(node=(jnp.asarray(states, jnp.int32),)), auto.vocab_size))


def _host_mask(auto, s, eos):
    return set(auto.allowed_tokens(s).tolist()) | ({eos} if auto.final[s] else set())


_WALKS: dict = {}


def _check_against_outlines(spec, tokenizer, *, walks=4, steps=10, seed=0):
    """Random walks over allowed tokens; at every prefix the automaton's mask equals outlines-core's
    allowed tokens, less those leading only into dead ends (pruned here), with the EOS of outlines-core's
    map at accepting states. Returns (automaton, visited states, reference masks)."""
    key = (json.dumps(spec, sort_keys=True), id(tokenizer), walks, steps, seed)
    if key in _WALKS:
        return _WALKS[key]
    eos = int(tokenizer.eos_token_id)
    auto = _compile(spec, tokenizer, eos_ids=(eos,))
    pattern = am.schema_to_regex(spec) if isinstance(spec, dict) else spec
    index = _outlines_index(pattern, tokenizer, eos)
    trans = index.get_transitions()
    rng = np.random.default_rng(seed)
    memo: dict = {}
    ours, theirs = [], []
    for _ in range(walks):
        s_ref, s = index.get_initial_state(), int(auto.initial[0])
        for _ in range(steps):
            ref = set(int(t) for t in index.get_allowed_tokens(s_ref)
                      if int(t) not in (eos, MARKER) and _can_finish(index, trans[s_ref][t], memo))
            ref |= {eos} if _accepts(index, s_ref) else set()
            assert _host_mask(auto, s, eos) == ref, spec
            ours.append(s)
            theirs.append(ref)
            choices = sorted(ref - {eos})
            if not choices:
                break
            t = int(rng.choice(choices))
            s_ref, s = index.get_next_state(s_ref, t), auto.step(s, t)
            assert s >= 0
    _WALKS[key] = auto, ours, theirs
    return _WALKS[key]


def _check_device(results, eos):
    """The device masks (both forms) of every visited state, all patterns stacked into one automaton (one
    compiled mask program per form), equal the reference masks."""
    st = stack_automata([r[0] for r in results])
    offsets = np.cumsum([0] + [r[0].num_states for r in results])
    states = np.concatenate([np.asarray(r[1]) + o for r, o in zip(results, offsets)])
    refs = [ref for r in results for ref in r[2]]
    for form in ("classes", "bits"):
        masks = _device_masks(st, states, eos, form)
        for m, ref in zip(masks, refs):
            assert set(np.flatnonzero(m).tolist()) == ref, form


# ----------------------------------------------------------------------------- masks = outlines-core
def test_outlines_accepting_state_bug(tok):
    """outlines-core 0.2.14 loses `b` after `a` in `a(bc)?` (a transition out of an accepting state into a
    non-accepting one); compile_regex's end marker keeps it: "1.5" and "abcd" are spelled, and every text
    the automaton accepts on a random walk fullmatches the regex."""
    v = outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})
    assert 98 not in outlines_core.Index("a(bc)?", v).get_transitions().get(
        outlines_core.Index("a(bc)?", v).get_next_state(outlines_core.Index("a(bc)?", v).get_initial_state(), 97), {})
    for pattern, text in [(r"[0-9]+(\.[0-9]+)?", "12.5"), (r"ab(cd)?", "abcd"), (r"a(bc)?", "abc")]:
        auto = _compile(pattern, tok)
        s = auto.walk(tok.encode(text))
        assert s >= 0 and auto.final[s], (pattern, text)
        assert auto.final[auto.walk(tok.encode(text[:-2]))] or pattern.startswith("[")


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_masks_match_outlines(pattern, tok):
    _check_against_outlines(pattern, tok)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_schema_masks_match_outlines(i, tok):
    _check_against_outlines(SCHEMAS[i], tok, seed=i)


def test_device_masks_match_outlines(tok):
    results = [_check_against_outlines(p, tok) for p in REGEXES]
    results += [_check_against_outlines(s, tok, seed=i) for i, s in enumerate(SCHEMAS)]
    _check_device(results, 0)


def _token_id(tokenizer, text: bytes):
    table = am.token_bytes(tokenizer)
    ids = [i for i, b in enumerate(table) if b == text]
    return ids[0] if ids else None


def test_token_healing_boundary_tokens(tok):
    """Byte-level BPE: a token spanning the end of the literal `"a"` and the `:` after it is allowed
    exactly where its bytes fit."""
    auto = _compile({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, tok)
    quote_colon = _token_id(tok, b'":')
    assert quote_colon is not None
    s = auto.walk([_token_id(tok, b"{"), _token_id(tok, b'"'), _token_id(tok, b"a")])
    allowed = set(auto.allowed_tokens(s).tolist())
    assert quote_colon in allowed and _token_id(tok, b'"') in allowed
    quote_comma = _token_id(tok, b'",')
    if quote_comma is not None:
        assert quote_comma not in allowed
    # the same token is forbidden where its bytes do not fit (right after '{')
    assert quote_colon not in set(auto.allowed_tokens(auto.walk([_token_id(tok, b"{")])).tolist())
    t = auto.walk([_token_id(tok, b"{"), _token_id(tok, b'"'), _token_id(tok, b"a"), quote_colon,
                   _token_id(tok, b"7"), _token_id(tok, b"}")])
    assert t >= 0 and auto.final[t]


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory):
    """A SentencePiece-style BPE ('▁' for spaces, <0xNN> byte fallback) trained offline."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.normalizer = normalizers.Replace(" ", "\u2581")
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["</s>", "<unk>"], show_progress=False)
    t.train_from_iterator(["the cat sat on the mat, 123 dogs ran; caf\u00e9 au lait"] * 20, trainer)
    spec = json.loads(t.to_str())  # byte tokens <0xNN> as ordinary vocabulary entries (as in Llama-2)
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    t = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_byte_fallback_tokenizer(sp_tokenizer):
    table = am.token_bytes(sp_tokenizer)
    assert table[sp_tokenizer.convert_tokens_to_ids("<0xE6>")] == b"\xe6"
    assert any(b is not None and b.startswith(b" ") for b in table)  # '▁' is a space
    results = [_check_against_outlines(p, sp_tokenizer, walks=3)
               for p in (r"é|日本", r"the (cat|dog)s? [0-9]{1,2}", r"caf[ée] au lait", r"[a-z ]{2,6}")]
    _check_device(results, sp_tokenizer.eos_token_id)
    auto = _compile(r"日本", sp_tokenizer, eos_ids=(sp_tokenizer.eos_token_id,))
    ids = [sp_tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "日本".encode()]
    s = auto.walk(ids)
    assert s >= 0 and auto.final[s]


# ----------------------------------------------------------------------------- EOS, packed mask
def test_eos_exactly_at_accepting_states(tok):
    auto = _compile(r"a+b*", tok)
    a, b = _token_id(tok, b"a"), _token_id(tok, b"b")
    c = auto.constraint().prepare(4096, (0,))
    states = [int(auto.initial[0]), auto.walk([a]), auto.walk([a, b])]
    m = np.asarray(c.allowed(am.AutomatonState(node=(jnp.asarray(states),)), 4096))
    assert not m[0, 0] and m[1, 0] and m[2, 0]  # EOS only once something matched
    assert m[1, a] and m[1, b] and m[2, b] and not m[2, a]  # accepting states that go on keep going
    with pytest.raises(ConstraintError, match="eos_ids"):
        auto.constraint().prepare(4096, ())
    fixed = _compile(r"ab", tok)
    fixed.constraint().prepare(4096, ())  # no continuation past acceptance: fine without EOS


def test_packed_mask_rule_and_equality(tok, monkeypatch):
    autos = [_compile(x, tok) for x in [r"[0-9]{1,3}"] + SCHEMAS]
    big = max(autos, key=lambda a: a.num_states)
    assert all(a.mask_form() == "bits" and a.constraint().bits is not None for a in autos)  # small tables
    monkeypatch.setattr(am, "MASK_BITS_BUDGET", 4 * big.num_states * big.mask_words - 1)  # the rule's edge
    assert big.mask_form() == "classes" and big.constraint().bits is None
    assert autos[0].mask_form() == "bits"
    states = np.arange(big.num_states)
    np.testing.assert_array_equal(_device_masks(big, states, 0, "bits"), _device_masks(big, states, 0, "classes"))
    with pytest.raises(ConstraintError, match="mask must be"):
        autos[0].constraint(mask="dense")


# ----------------------------------------------------------------------------- stacking
def test_stack_automata_joint_classes(tok):
    autos = [_compile(s, tok) for s in (SCHEMAS[0], r"[0-9]{1,3}", SCHEMAS[2])]
    st = stack_automata(autos)
    assert st.num_patterns == 3 and st.patterns[1] == r"[0-9]{1,3}"
    rng = np.random.default_rng(0)
    for i, a in enumerate(autos):
        s, t = int(a.initial[0]), int(st.initial[i])
        for _ in range(8):
            ok = a.allowed_tokens(s)
            np.testing.assert_array_equal(ok, st.allowed_tokens(t))
            assert bool(a.final[s]) == bool(st.final[t])
            if not ok.size:
                break
            tk = int(rng.choice(ok))
            s, t = a.step(s, tk), st.step(t, tk)
    with pytest.raises(ConstraintError, match="outside"):
        st.constraint(starts=[0, 3])


# ----------------------------------------------------------------------------- generation validates
def _prompts(tok, n):
    ids = tok.encode(PROMPT)
    return jnp.asarray([ids] * n, jnp.int32), jnp.full((n,), len(ids), jnp.int32)


def _texts(tok, out):
    """Each row's text without its EOS; every row must have ended with EOS."""
    toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
    toks, lens = toks.reshape(-1, toks.shape[-1]), lens.reshape(-1)
    texts = []
    for row, n in zip(toks, lens):
        assert n >= 1 and row[n - 1] == 0, "the row did not finish with EOS"
        texts.append(b"".join(am.token_bytes(tok)[t] for t in row[:n - 1]).decode("utf-8"))
    return texts


# Bounded lengths (digits, strings, items), so every row can finish within max_new_tokens.
GEN = [{"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                         "age": {"type": "integer", "minimum": 18, "maximum": 99}},
        "required": ["name", "age"]},
       {"anyOf": [{"type": "integer", "maxDigits": 3}, {"type": "string", "maxLength": 3}]},
       r"\d{4}-\d{2}-\d{2}", SCHEMAS[8], PET]
MAX_NEW = 128  # the pydantic-style row needs ~110 tokens of this small vocabulary


def _valid(spec, text):
    if isinstance(spec, dict):
        jsonschema.validate(json.loads(text), spec)
    else:
        assert re.fullmatch(spec, text), (spec, text)


@pytest.fixture(scope="module")
def stacked(model, tok):
    return stack_automata([_compile(s, tok, vocab_size=model.config.vocab_size) for s in GEN])


def test_greedy_and_sampled_outputs_validate_per_row(model, tok, stacked):
    from jaxdecode.autoregressive import decode

    n = len(GEN)
    prompts, lens = _prompts(tok, n)
    c = stacked.constraint(starts=list(range(n)))
    out = decode(model.config, model.params, prompts, lens, max_new_tokens=MAX_NEW, eos_ids=(0,), constraint=c,
                 method="greedy")
    for spec, text in zip(GEN, _texts(tok, out)):
        _valid(spec, text)
    for seed in range(2):  # same shapes: no recompilation
        c = stacked.constraint(starts=[(seed + i) % n for i in range(n)])
        out = decode(model.config, model.params, prompts, lens, max_new_tokens=MAX_NEW, eos_ids=(0,), constraint=c,
                     method="sample", key=jax.random.key(seed))
        for i, text in enumerate(_texts(tok, out)):
            _valid(GEN[(seed + i) % n], text)


def test_beam_search_outputs_validate(model, tok, stacked):
    from jaxdecode.beam import beam_search

    prompts, lens = _prompts(tok, 2)
    c = stacked.constraint(starts=[0, 2])
    out = beam_search(model.config, model.params, prompts, lens, max_new_tokens=MAX_NEW, num_beams=2, eos_ids=(0,),
                      constraint=c)
    texts = _texts(tok, out)  # [B * K]
    for i, text in enumerate(texts):
        _valid([GEN[0], GEN[2]][i // 2], text)


def test_per_row_constraint_dedupes(tok):
    c = am.per_row_constraint([SCHEMAS[2], r"[0-9]{1,3}", SCHEMAS[2]], tok, eos_ids=(0,), cache=False)
    assert c.host.num_patterns == 2 and c.per_row
    np.testing.assert_array_equal(np.asarray(c.initial)[[0, 2]], [c.host.initial[0]] * 2)
    with pytest.raises(AutomatonError, match="specs\\[0\\]"):
        am.per_row_constraint([3], tok)


# ----------------------------------------------------------------------------- intersection
def test_intersect_two_automata_and_a_trie(model, tok):
    from jaxdecode.constraints import build_index

    v = model.config.vocab_size
    a = _compile(r"[0-9]{2,6}", tok, vocab_size=v).constraint()
    b = _compile(r"1[0-9]*5", tok, vocab_size=v).constraint()
    both = intersect(a, b)  # two automata: the product on the host, dead ends pruned
    assert isinstance(both, am.AutomatonConstraint)
    prod, table = both.host, am.token_bytes(tok)
    rng = np.random.default_rng(0)
    for _ in range(30):  # random walks never get stuck, and every accepted text is in both languages
        s, text = int(prod.initial[0]), b""
        while True:
            ok = prod.allowed_tokens(s)
            if prod.final[s] and (not ok.size or rng.random() < 0.3):
                break
            assert ok.size, text
            t = int(rng.choice(ok))
            s, text = prod.step(s, t), text + table[t]
        assert re.fullmatch(rb"[0-9]{2,6}", text) and re.fullmatch(rb"1[0-9]*5", text), text
    with pytest.raises(AutomatonError, match="intersection .* is empty"):
        intersect(a, _compile(r"[a-z]+", tok, vocab_size=v).constraint())
    # the generic form of the same pair allows a superset: the product also drops the pair's dead ends
    from jaxdecode.constraints.protocol import IntersectConstraint

    gen = IntersectConstraint(parts=(a, b)).prepare(v, (0,))
    prod = both.prepare(v, (0,))
    one = jnp.asarray([_token_id(tok, b"1")])
    after_one = jax.jit(lambda c: c.allowed(c.advance(c.init(1), one), v))  # one program, not op by op
    g, p = np.asarray(after_one(gen))[0], np.asarray(after_one(prod))[0]
    assert (p <= g).all() and p.any() and (g & ~p).any()
    # a trie of three items, one of which the regex forbids: per-candidate advance with a shared depth
    items = [tok.encode(x) for x in ("Abc", "12", "xyz9")]
    trie = build_index(items, v).constraint()
    both = intersect(trie, _compile(r"[a-z0-9]*[0-9]", tok, vocab_size=v).constraint()).prepare(v, (0,))
    st = both.init(1)
    logits = jnp.zeros((1, v)).at[0, items[0][0]].set(5.0)
    cands = jax.jit(lambda c, s, lg: c.candidates(s, lg, 2))(both, st, logits)  # one program, not op by op
    firsts = {it[0] for it in items[1:]}
    assert items[0][0] not in firsts
    got = [int(t) for t in np.asarray(cands.tokens)[0] if t >= 0]
    assert set(got) == firsts  # 'Abc' is cut by the regex
    nxt = both.step_to(st, tuple(n[:, 0] for n in cands.next))
    assert int(nxt.parts[0].depth) == 1
    masks = jax.jit(lambda c, a, b, t: (c.allowed(a, v), c.allowed(c.advance(b, t), v)))(both, nxt, st,
                                                                                         cands.tokens[:, 0])
    np.testing.assert_array_equal(np.asarray(masks[0]), np.asarray(masks[1]))


# ----------------------------------------------------------------------------- kernel
def test_constrained_kernel_takes_the_automaton_mask(tok):
    from jaxdecode.kernels.constrained import constrained_topk

    auto = _compile(SCHEMAS[0], tok)
    c = auto.constraint().prepare(auto.vocab_size, (0,))
    st = am.AutomatonState(node=(jnp.asarray([int(auto.initial[0]), auto.walk(tok.encode('{"name'))]),))
    mask = c.allowed(st, auto.vocab_size)
    logits = jax.random.normal(jax.random.key(0), mask.shape)
    ref = constrained_topk(logits, 4, mask=mask, impl="reference")
    ker = constrained_topk(logits, 4, mask=mask, impl="interpret")
    np.testing.assert_array_equal(np.asarray(ref[1]), np.asarray(ker[1]))
    np.testing.assert_allclose(np.asarray(ref[0]), np.asarray(ker[0]), rtol=1e-5)
    ck = c.replace(impl="interpret").candidates(st, logits, 2)
    cr = c.candidates(st, logits, 2)
    np.testing.assert_array_equal(np.asarray(ck.tokens), np.asarray(cr.tokens))
    assert np.asarray(mask)[np.arange(2)[:, None], np.maximum(np.asarray(cr.tokens), 0)][np.asarray(cr.tokens) >= 0].all()


# ----------------------------------------------------------------------------- cache
def test_compile_cache(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDECODE_CACHE_DIR", str(tmp_path))
    a = compile_regex(r"[0-9]{1,3}x", tok, eos_ids=(0,))
    files = list((tmp_path / "automata").glob("*.npz"))
    assert len(files) == 1

    def boom(*args, **kw):
        raise AssertionError("compiled again instead of loading the cache")

    with monkeypatch.context() as m:
        m.setattr(outlines_core, "Index", boom)
        b = compile_regex(r"[0-9]{1,3}x", tok, eos_ids=(0,))
    np.testing.assert_array_equal(a.next, b.next)
    np.testing.assert_array_equal(a.token_class, b.token_class)
    assert b.tokenizer == a.tokenizer and b.patterns == a.patterns
    files[0].write_bytes(b"not an npz file")
    c = compile_regex(r"[0-9]{1,3}x", tok, eos_ids=(0,))  # rebuilt and rewritten
    np.testing.assert_array_equal(a.next, c.next)
    am.TokenAutomaton.load(files[0])
    # a file with tables out of range is rejected on load, then rebuilt
    bad = am.TokenAutomaton(token_class=a.token_class + 100, next=a.next, final=a.final, initial=a.initial)
    bad.save(files[0])
    with pytest.raises(AutomatonError, match="valid token automaton"):
        am.TokenAutomaton.load(files[0])
    np.testing.assert_array_equal(compile_regex(r"[0-9]{1,3}x", tok, eos_ids=(0,)).next, a.next)


# ----------------------------------------------------------------------------- bad input
class _Vocab:
    """A minimal tokenizer: ids 0..n-1 for the given strings, id 0 = EOS (special)."""

    def __init__(self, words):
        self.words = ["</s>"] + list(words)
        self.all_special_ids = [0]
        self.eos_token_id = 0

    def get_vocab(self):
        return {w: i for i, w in enumerate(self.words)}


def test_invalid_regex(tok):
    with pytest.raises(AutomatonError, match="invalid regex.*missing \\)"):
        compile_regex("(ab", tok, cache=False)
    with pytest.raises(AutomatonError, match="non-empty"):
        compile_regex("", tok, cache=False)


@pytest.mark.parametrize("pattern,match", [
    (r"^[0-9]+$", r"anchor \^ at position 0: .*matched whole.*drop it"),
    (r"\A[0-9]+", r"anchor \\A at position 0: .*implicit"),
    (r"[0-9]+\z", r"anchor \\z at position 6"),
    (r"[0-9]+\Z", r"anchor \\Z at position 6"),
    (r"[0-9]+$", r"anchor \$ at position 6"),
    (r"a(^b)?", r"anchor \^ at position 2"),
    (r"a{,3}b", r"repetition \{,3\} at position 1, which is not Rust regex syntax.*write \{0,3\}"),
    (r"a\bb", r"Unicode word boundaries .*write ASCII ones, \(\?-u:\\b\)"),
    (r"a\Bb", r"Unicode word boundaries"),
])
def test_regex_spellings_that_need_a_fix(pattern, match):
    """Anchors (patterns are matched whole) and Python's `{,n}`: an error up front naming the pattern and
    the fix, not outlines-core's "anchored universal start state" / "error building NFA"."""
    with pytest.raises(AutomatonError, match=match) as err:
        compile_regex(pattern, _Vocab(["a", "b", "0", "1", "$", "^"]), cache=False)
    assert repr(pattern) in str(err.value)


@pytest.mark.parametrize("pattern", [r"[$^]a", r"\$a\^", r"a\{,3\}", r"[^a]b", r"a{2,}", r"[]a]b", r"[a[^b]]",
                                     r"a(?-u:\b)\$"])
def test_anchor_characters_that_are_not_anchors(pattern):
    compile_regex(pattern, _Vocab(["a", "b", "c", "$", "^", "{", ",", "3", "}", "]"]), cache=False)


def test_eos_id_the_pattern_needs():
    """An EOS id whose text the pattern needs is an error naming the id, its text and the fix (it was
    reported as a vocabulary problem, or the branch that needs it silently dropped)."""
    vocab = _Vocab(["1", "2", "%", "ab"])  # ids: </s> 0, "1" 1, "2" 2, "%" 3, "ab" 4
    for pattern in ["[12]{2}%", "[12]{2}%?"]:
        with pytest.raises(AutomatonError, match=r"EOS id 3 \(token text '%'\).*eos_ids.*drop '%' from the pattern"):
            compile_regex(pattern, vocab, eos_ids=(3,), cache=False)
    auto = compile_regex("[12]{2}", vocab, eos_ids=(3,), cache=False)  # the pattern never uses it: fine
    auto.constraint().prepare(auto.vocab_size, (3,))
    # another token spells the EOS id's bytes (" %" and "▁%"): no text is lost, the EOS id is left out
    twin = _Vocab(["1", " %", "\u2581%"])
    auto = compile_regex("1 %", twin, eos_ids=(3,), cache=False)
    after = auto.step(int(auto.initial[0]), 1)
    assert auto.allowed_tokens(after).tolist() == [2] and int(auto.token_class[3]) == 0
    auto.constraint().prepare(auto.vocab_size, (3,))


def test_empty_language_and_dead_states():
    vocab = _Vocab(["a", "b", "ab", "c"])
    with pytest.raises(AutomatonError, match="no accepting path"):
        compile_regex("a*d", vocab, cache=False)  # outlines-core builds it (a loop on 'a'), nothing accepts
    with pytest.raises(AutomatonError, match="no accepting path"):
        compile_regex("abd", vocab, cache=False)  # no token spells 'd'
    auto = compile_regex("a*d|b", vocab, cache=False)  # after 'a' only a dead loop: 'a' is pruned
    assert auto.allowed_tokens(int(auto.initial[0])).tolist() == [2]


def test_vocab_mismatch(tok):
    with pytest.raises(AutomatonError, match="does not belong"):
        compile_regex("[0-9]", tok, vocab_size=100, cache=False)
    auto = _compile("[0-9]", tok)
    with pytest.raises(ConstraintError, match="vocabulary"):
        auto.constraint().prepare(1000, (0,))
    other = compile_regex("[ab]", _Vocab(["a", "b"]), cache=False)
    with pytest.raises(AutomatonError, match="different vocabularies"):
        stack_automata([auto, other])


UNSUPPORTED = [
    ({"type": "integer", "multipleOf": 3}, "multipleOf", "$"),
    ({"type": "object", "properties": {"n": {"type": "number", "minimum": 0}}}, "minimum", "$.properties.n"),
    ({"type": "integer", "minimum": 5, "maximum": 3}, "bounds", "$"),
    ({"type": "integer", "minimum": 0, "multipleOf": 2}, "multipleOf", "$"),
    ({"type": "number", "exclusiveMaximum": 3}, "exclusiveMaximum", "$"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "$"),
    ({"not": {"type": "integer"}}, "not", "$"),
    ({"if": {"type": "integer"}, "then": {"type": "integer"}}, "if", "$"),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}}, "patternProperties", "$"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired", "$"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains", "$"),
    ({"type": "object", "propertyNames": {"maxLength": 2}}, "propertyNames", "$"),
    ({"type": "object", "maxProperties": 1}, "maxProperties", "$"),
    ({"type": "array", "items": {"type": "string", "format": "ipv4"}}, "ipv4", "$.items"),
    ({"allOf": [{"type": "integer", "maxDigits": 2}, {"type": "integer", "maxDigits": 3}]}, "maxDigits",
     "$.allOf[1]"),
    ({"allOf": [{"$ref": "#/$defs/a"}, {"type": "integer"}], "$defs": {"a": {"type": "integer"}}}, "allOf", "$"),
    ({"type": "string", "anyOf": [{"type": "integer"}, {"type": "null"}]}, "anyOf", "$"),
    ({"type": "integer", "maxLength": 2.5}, "maxLength", "$"),
    ({"type": "object", "properties": {"e": {"enum": []}}}, "enum", "$.properties.e"),
    ({"type": "string", "pattern": "a+", "maxLength": 2}, "pattern", "$"),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {'q"': {"type": "null"}}}}},
     "property name", "$.properties.a"),
    ({"type": "string", "format": "date", "maxLength": 2}, "format", "$"),
    ({"type": "string", "pattern": "(a)\\1"}, "back-reference", "$"),
    ({"type": "string", "pattern": "(?=a)a"}, "look-around", "$"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "$"),
    ({"type": "integer", "enum": [1, "a"]}, "enum", "$"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, "required", "$"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}, "minProperties", "$"),
    ({"type": "string", "nullable": True}, "nullable", "$"),
    ({"oneOf": [{"enum": ["a", "b"]}, {"const": "b"}]}, "oneOf", "$"),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}]}, "oneOf", "$"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems", "$"),
]


@pytest.mark.parametrize("schema,keyword,path", UNSUPPORTED, ids=[u[1] for u in UNSUPPORTED])
def test_unsupported_schema_keyword_is_named(schema, keyword, path):
    with pytest.raises(AutomatonError) as e:
        am.schema_to_regex(schema)
    msg = str(e.value)
    assert keyword in msg and f"at {path}:" in msg, msg


def test_recursive_schema_is_sent_to_the_grammar_path():
    schema = {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}},
        "$ref": "#/$defs/node"}
    with pytest.raises(AutomatonError, match="recursive.*grammar"):
        am.schema_to_regex(schema)
    ok = {"$defs": {"x": {"type": "integer"}}, "type": "object",
          "properties": {"a": {"$ref": "#/$defs/x"}, "b": {"$ref": "#/$defs/x"}}, "required": ["a", "b"]}
    assert am.schema_to_regex(ok)  # a reused (not recursive) $ref is fine
    for annotated in ({"type": "integer", "title": "n", "description": "d", "x-ui": 1},
                      {"enum": [1, 2], "type": "integer"}, {"oneOf": [{"type": "string"}, {"type": "null"}]},
                      {"oneOf": [{"const": "a"}, {"enum": ["b", 3]}]}, PET):
        assert am.schema_to_regex(annotated)


# ----------------------------------------------------------------------------- JSON-Schema-Test-Suite
def test_json_schema_suite_is_sound():
    """Vendored JSON-Schema-Test-Suite cases (tests/data/json_schema_suite): no invalid instance (compact
    or spaced JSON) matches the regex of a schema the compiler accepts; each case it rejects is one where
    outlines-core's converter alone (check=False) would admit an invalid instance. (cases.json holds every
    accepted case of the suite's top-level draft2020-12 files, and the rejected ones with such a leak.)"""
    from pathlib import Path

    cases = json.loads((Path(__file__).parent / "data" / "json_schema_suite" / "cases.json").read_text())
    assert sum(c["accepted"] for c in cases) >= 114

    def leaks(rx, tests):
        try:
            r = re.compile(rx)
        except re.error:  # a Rust-regex form Python's re lacks (one case): no check here
            return None
        return [t["data"] for t in tests if not t["valid"] and any(
            r.fullmatch(json.dumps(t["data"], ensure_ascii=False, separators=sep))
            for sep in ((",", ":"), (", ", ": ")))]

    for c in cases:
        name = f"{c['file']}: {c['description']}"
        if c["accepted"]:
            assert leaks(am.schema_to_regex(c["schema"]), c["tests"]) in ([], None), name
        else:
            with pytest.raises(AutomatonError):
                am.schema_to_regex(c["schema"])
            assert leaks(am.schema_to_regex(c["schema"], check=False), c["tests"]), name


def test_integer_bounds_compile_exactly():
    """minimum / maximum / exclusive* on integers: compiled here (outlines-core ignores them), exact on
    every integer of a window, no leading zeros or '-0'."""
    rng = np.random.default_rng(0)
    cases = [(None, 0), (0, None), (-5, 5), (1, 1), (-1, -1), (95, 105), (None, -3), (-17, None), (7, 1234)]
    cases += [tuple(sorted(rng.integers(-1500, 1500, 2).tolist())) for _ in range(20)]
    window = np.arange(-1600, 1601)
    for lo, hi in cases:
        r = re.compile(am.int_range_regex(lo, hi))
        got = np.array([bool(r.fullmatch(str(n))) for n in window])
        want = ((lo is None) | (window >= (lo or 0))) & ((hi is None) | (window <= (hi or 0)))
        np.testing.assert_array_equal(got, want, err_msg=str((lo, hi)))
        assert not any(r.fullmatch(x) for x in ("-0", "01", "-01", "+1"))
    rx = am.schema_to_regex({"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 0.5,
                                                                    "maximum": 20.5}}, "required": ["n"]})
    assert re.fullmatch(rx, '{"n": 1}') and re.fullmatch(rx, '{"n":20}')
    assert not re.fullmatch(rx, '{"n": 0}') and not re.fullmatch(rx, '{"n": 21}')


def test_schema_normal_forms_keep_the_instances():
    """Forms outlines-core mistranslates are rewritten to equivalent ones: keywords next to anyOf go into
    each branch (a branch whose type cannot meet them is dropped), allOf of plain schemas is merged,
    type-less keywords apply to their type only, counts given as 2.0 are 2, `true` is any value."""
    def ok(schema, good, bad):
        rx = am.schema_to_regex(schema)
        for x in good:
            jsonschema.validate(json.loads(x), schema)
            assert re.fullmatch(rx, x), (schema, x)
        for x in bad:
            assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(x))
            assert not re.fullmatch(rx, x), (schema, x)

    ok({"type": "string", "anyOf": [{"maxLength": 1}, {"minLength": 3}]}, ['"a"', '"abc"'], ['"ab"', '5'])
    ok({"type": "string", "anyOf": [{"type": "string", "maxLength": 2}, {"type": "integer"}]}, ['"ab"'],
       ['5', '"abc"'])
    ok({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                  {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
       ['{"a": 1, "b": true}'], ['{"a": 1}', '{"b": true}'])
    ok({"maxLength": 2}, ['"ab"', '123', 'null', '[1]'], ['"abc"'])
    ok({"type": "array", "maxItems": 2.0}, ['[1, 2]'], ['[1, 2, 3]'])
    ok({"type": "object", "properties": {"a": True}, "required": ["a"]}, ['{"a": [1]}', '{"a": null}'], ['{}'])
    # object values of enum / const: outlines-core leaves their keys unescaped ('k.' matched 'kX')
    ok({"enum": [{"k.": "a|b", "x": [1, {}]}, "p"]}, ['{"k.": "a|b", "x": [1, {}]}', '{"k.":"a|b","x":[1,{}]}', '"p"'],
       ['{"kX": "a|b", "x": [1, {}]}', '{"k.": "a", "x": [1, {}]}'])
    with pytest.raises(AutomatonError, match="empty language"):
        am.schema_to_regex({"type": "string", "anyOf": [{"type": "integer"}]})


def test_string_pattern_stays_inside_the_json_string():
    """`pattern` is pasted raw by outlines-core (then `[^@]+` can emit a raw quote or newline, and `x|y`
    binds to the quotes); json_string_pattern rewrites it over the JSON text: every JSON string the
    regex admits is valid JSON whose value matches the pattern (checked on all short strings over an
    alphabet with the characters JSON escapes)."""
    import itertools

    alphabet = ["a", "1", " ", "@", '"', "\\", "\n", "\u00e9"]
    for p in ["^[^@]+@[^@]+$", "x|a", r"\d{1,2}\s[\w-]+", r"[\x00-\x7f]{2}", ".", "[^a]", r"\D\W?", r"\S+",
              r'[a"\\]+', '^(a|1)*$', r"[^\d\s]", 'a"']:
        rx = re.compile('"' + am.json_string_pattern(p) + '"')
        matched = 0
        for n in range(4):
            for chars in itertools.product(alphabet, repeat=n):
                s = "".join(chars)
                if rx.fullmatch(json.dumps(s, ensure_ascii=False)):
                    assert re.search(p, s), (p, s)
                    matched += 1
        for text in ['"""', '"\n"', '"\\"', '"a\nb"', '"a"a"']:  # raw quote / newline / backslash
            assert not rx.fullmatch(text), (p, text)
        assert matched or p == 'a"', p
    assert re.fullmatch(am.schema_to_regex({"type": "string", "pattern": 'a"'}), '"a\\""')
    rx = am.schema_to_regex({"type": "object", "properties": {"e": {"type": "string", "pattern": "x|y"}},
                             "required": ["e"]})
    assert re.fullmatch(rx, '{"e": "x"}') and not re.fullmatch(rx, '{"e": "x')


def test_token_classes_from_edges_equal_the_dense_way():
    """The hashed class grouping (no [S, V] table) gives the dense np.unique grouping's partition."""
    rng = np.random.default_rng(0)
    for s, v, e in ((5, 40, 60), (30, 300, 2000), (1, 10, 0)):
        src, tok, dst = rng.integers(0, s, e), rng.integers(0, v, e), rng.integers(0, s, e)
        _, first = np.unique(src * v + tok, return_index=True)  # one transition per (state, token)
        src, tok, dst = src[first], tok[first], dst[first]
        tok = np.where(tok % 7 == 0, tok - tok % 14, tok)  # repeated columns
        _, first = np.unique(src * v + tok, return_index=True)
        src, tok, dst = src[first], tok[first], dst[first]
        cls, nxt = am._classes_from_edges(src, tok, dst, s, v)
        full = np.full((s, v), -1, np.int32)
        full[src, tok] = dst
        np.testing.assert_array_equal(nxt[:, cls], full)  # the class table spells every column
        assert (nxt[:, 0] == -1).all() and np.unique(nxt, axis=1).shape[1] == nxt.shape[1]  # distinct columns


def test_random_accepted_texts_validate(tok):
    """Random walks over each schema's token automaton (uniform over allowed tokens) end only in texts
    that parse as JSON and validate; none gets stuck (no dead ends)."""
    table = am.token_bytes(tok)
    rng = np.random.default_rng(1)
    for i, schema in enumerate(SCHEMAS):
        auto = _check_against_outlines(schema, tok, seed=i)[0]
        for _ in range(12):
            s, text = int(auto.initial[0]), b""
            for _ in range(300):
                ok = auto.allowed_tokens(s)
                if auto.final[s] and (not ok.size or rng.random() < 0.2):
                    break
                assert ok.size, (schema, text)
                t = int(rng.choice(ok))
                s, text = auto.step(s, t), text + table[t]
            if auto.final[s]:
                jsonschema.validate(json.loads(text.decode("utf-8")), schema)


def test_filter_index_keeps_the_matching_items(tok):
    from jaxdecode.constraints import build_index

    words = ["cat", "dog", "cow1", "emu22", "Yak", "ant3"]
    items = [tok.encode(w) for w in words]
    idx = build_index(items, 4096, set_ids=[0, 1, 0, 1, 1, 0], num_sets=2)
    f = am.filter_index(idx, _compile(r"[a-z]+[0-9]+", tok))
    toks, lens, sets = f.items()
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    got = {(tok.decode(toks[a:a + n].tolist()), int(s)) for a, n, s in zip(starts, lens, sets)}
    assert got == {("cow1", 0), ("emu22", 1), ("ant3", 0)}
    with pytest.raises(AutomatonError, match="no item"):
        am.filter_index(idx, _compile(r"[0-9]+", tok))


def test_patterns_of_similar_size_share_one_compiled_decode(model, tok):
    """Device tables are padded to power-of-two states / classes: a second pattern of similar size reuses
    the compiled decode (a new schema costs its host compile, not an XLA compile)."""
    from jaxdecode.autoregressive import _decode, decode
    a, b = (compile_regex(p, tok, vocab_size=model.config.vocab_size, eos_ids=(0,))
            for p in (r"[0-9]{2,4}", r"(yes|no)"))
    ca, cb = a.constraint(), b.constraint()
    assert ca.next.shape == cb.next.shape and a.next.shape != b.next.shape
    assert ca.next.shape[0] >= a.num_states and not bool(np.asarray(ca.final)[a.num_states:].any())
    toks = jnp.asarray([model.encode("x = ")], jnp.int32)
    lens = jnp.asarray([toks.shape[1]], jnp.int32)
    run = lambda c: decode(model.config, model.params, toks, lens, max_new_tokens=6, eos_ids=(0,),  # noqa: E731
                           method="greedy", constraint=c)
    out_a = run(ca)
    size = _decode._cache_size()
    out_b = run(cb)
    assert _decode._cache_size() == size  # no new compilation
    text_b = model.decode(np.asarray(out_b.tokens[0, :int(out_b.lengths[0])]))
    assert re.fullmatch(r"(yes|no)", text_b), text_b
    assert re.fullmatch(r"[0-9]{2,4}", model.decode(np.asarray(out_a.tokens[0, :int(out_a.lengths[0])])))
