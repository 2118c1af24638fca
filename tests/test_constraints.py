"""Constrained decoding (STATIC): the item index, the trie Constraint, the constrained-step kernel, and
constrained beam search / greedy / sampling checked against independent NumPy and exhaustive searches."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.constraints import (ConstraintError, DynamicIndex, ItemSetError, build_index, load_index,
                                   trie_beam_search)
from jaxdecode.kernels.constrained import (block_plan, constrained_topk, constrained_topk_pallas,
                                           constrained_topk_reference, sharded_constrained_topk)
from jaxdecode.sharding import make_mesh

P = 97  # rows of the random log-prob table: a beam's logits = table[step, hash(prefix) % P]


# ----------------------------------------------------------------------------- the "model"
def table_logits(table, tokens, step):
    """Logits [R, V] of tokens[R, N] (the beams so far) at `step`: a fixed random table indexed by a
    rolling hash of the prefix, so every prefix gets its own (pseudo-random) next-token scores."""
    h = jnp.zeros(tokens.shape[0], jnp.int32)
    for i in range(tokens.shape[1]):
        h = jnp.where(i < step, (h * 31 + tokens[:, i] + 1) % P, h)
    return table[jnp.minimum(step, table.shape[0] - 1), h]


def np_logp(table, prefix):
    h = 0
    for t in prefix:
        h = (h * 31 + int(t) + 1) % P
    x = table[min(len(prefix), table.shape[0] - 1), h].astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def np_beam_search(items, table, k, n, eos=(), length_penalty=0.0):
    """Independent beam search over a Python trie, Hugging Face rules: each step every beam expands over
    its allowed children (+ EOS at item ends); the best k candidates that end are finished hypotheses
    (at the last step all best k), the best k that do not end continue. Returns [(score, tokens)]."""
    children, finals = {}, set(items)
    for it in items:
        for t in range(len(it)):
            children.setdefault(it[:t], set()).add(it[t])
    running, finished = [((), 0.0)], []
    for t in range(n):
        cands = []
        for bi, (pre, sc) in enumerate(running):
            logp = np_logp(table, pre)
            for tok in sorted(children.get(pre, ())):
                nxt = pre + (tok,)
                cands.append((sc + logp[tok], bi, not eos and nxt not in children, nxt))
            if eos and pre in finals:
                cands += [(sc + logp[e], bi, True, pre + (e,)) for e in eos]
        cands.sort(key=lambda c: (-c[0], c[1]))
        finished += [(c[0] / (t + 1) ** length_penalty, c[3]) for c in cands[:k] if c[2] or t == n - 1]
        running = [(c[3], c[0]) for c in cands if not c[2]][:k]
        if not running:
            break
    return sorted(finished, key=lambda f: -f[0])[:k]


def got_beams(out, b, k):
    return [(float(out.scores[b, j]), tuple(int(x) for x in out.tokens[b, j, :int(out.lengths[b, j])]))
            for j in range(k) if bool(out.valid[b, j])]


def assert_same_beams(got, want, atol=1e-4):
    assert [g[1] for g in got] == [tuple(int(x) for x in w[1]) for w in want]
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], atol=atol, rtol=1e-5)


def random_items(rng, n, v, length, variable=False, prefix_free=False):
    if not variable:
        return [tuple(int(x) for x in r) for r in rng.integers(0, v, (n, length))]
    lens = rng.integers(1, length + 1, n)
    items = sorted({tuple(int(x) for x in rng.integers(0, v, m)) for m in lens})
    if prefix_free:  # a prefix is followed in sorted order by one of its extensions
        items = [a for a, b in zip(items, items[1:] + [()]) if b[:len(a)] != a]
    return items


def as_tuples(items_out):
    tokens, lens = items_out[:2]
    return sorted(tuple(int(x) for x in t) for t in np.split(tokens, np.cumsum(lens)[:-1]))


def shuffled_with_duplicates(rng, items):
    dup = [items[i] for i in rng.integers(0, len(items), max(1, len(items) // 10))]
    allx = list(items) + dup
    return [list(allx[i]) for i in rng.permutation(len(allx))], len(dup)


# ----------------------------------------------------------------------------- the index
def test_index_sorts_dedups_and_keeps_prefix_items():
    items = [[3, 1], [1, 2, 3], [1, 2], [1, 2], [0], [3, 1, 4], [2]]
    ix = build_index(items, 5)
    assert ix.num_items == 6 and ix.num_duplicates == 1 and ix.has_prefix_items
    assert ix.max_len == 3 and ix.min_len == 1
    assert as_tuples(ix.items()) == sorted({tuple(i) for i in items}) and (ix.items()[2] == 0).all()
    assert ix.contains([1, 2]) and ix.contains([1, 2, 3]) and not ix.contains([1]) and not ix.contains([3])
    # Rows are in token order and every state's children are consecutive states.
    toks, kids = ix.children(ix.walk([1])[-1])
    assert toks.tolist() == [2] and ix.walk([1, 2])[-1] == kids[0]
    assert ix.level_width[1] == 4  # the set root has 4 first tokens: 0, 1, 2, 3


def test_index_input_forms_agree(tmp_path):
    rng = np.random.default_rng(0)
    items = random_items(rng, 300, 50, 5, variable=True)
    mat = np.zeros((len(items), 5), np.int64)
    lens = np.array([len(i) for i in items])
    for i, it in enumerate(items):
        mat[i, :len(it)] = it
    f = tmp_path / "items.txt"
    f.write_text("\n".join(" ".join(map(str, it)) for it in items[::-1]) + "\n")
    a = build_index([list(i) for i in items], 50)
    for other in (build_index(mat, 50, lengths=lens), build_index(str(f), 50),
                  build_index([list(i) for i in items[::-1]] + [list(items[0])], 50)):
        for name in ("edge_token", "indptr", "final_bits"):
            np.testing.assert_array_equal(getattr(a, name), getattr(other, name))
        assert a.level_start == other.level_start
    fixed = rng.integers(0, 50, (100, 4))
    ix = build_index(fixed, 50)
    np.testing.assert_array_equal(np.sort(ix.items()[0].reshape(-1, 4), axis=0),
                                  np.sort(np.unique(fixed, axis=0), axis=0))


BAD_ITEMS = [
    (dict(items=[]), "the item set is empty"),
    (dict(items=np.zeros((0, 4), np.int32)), "the item set is empty"),
    (dict(items=[[1, 2], []]), "item 1 is empty"),
    (dict(items=[[1, 2], [3, 50]]), "token id 50, outside the vocabulary"),
    (dict(items=[[1, -2]]), "token id -2, outside the vocabulary"),
    (dict(items=np.ones((2, 2), np.float32)), "must be integers"),
    (dict(items=[[1], [2]], set_ids=[0, -1]), "negative"),
    (dict(items=[[1], [2]], set_ids=[0, 3], num_sets=2), r"outside \[0, num_sets=2\)"),
    (dict(items=[[1], [2]], set_ids=[0]), "one set per item"),
    (dict(items=np.ones((2, 3), np.int32), lengths=[1, 4]), "lengths"),
    (dict(items=[[1, 2]], dense_levels=[5]), "dense level 5"),
]


@pytest.mark.parametrize("kw,match", BAD_ITEMS)
def test_index_bad_input_is_a_clear_error(kw, match):
    kw = dict(kw)
    with pytest.raises(ItemSetError, match=match):
        build_index(kw.pop("items"), 50, **kw)


@pytest.mark.parametrize("text,match", [("1 2\n\n3 4\n", "line 2 is empty"), ("1 2\n3 x\n", "line 2"),
                                        ("1 2\n3 4-5\n", "line 2"), ("", "holds no items"),
                                        ("1 2\n3 99\n", "outside the vocabulary")])
def test_item_file_errors(tmp_path, text, match):
    f = tmp_path / "items.txt"
    f.write_text(text)
    with pytest.raises(ItemSetError, match=match):
        build_index(str(f), 50)


@pytest.mark.parametrize("word", ["99999999999999999999999", "-99999999999999999999999"])
def test_item_file_id_past_int64_is_reported_as_written(tmp_path, word):
    f = tmp_path / "items.txt"
    f.write_text(f"1 2 3\n4 {word}\n")
    with pytest.raises(ItemSetError, match=f"line 2: item 1 holds token id {word}, outside the vocabulary"):
        build_index(str(f), 100)


def test_save_load_roundtrip(tmp_path):
    rng = np.random.default_rng(1)
    items = random_items(rng, 500, 300, 6, variable=True)
    ix = build_index([list(i) for i in items], 300, set_ids=rng.integers(0, 3, len(items)), dense_levels=[0, 1])
    path = ix.save(tmp_path / "ix")
    back = load_index(path)
    for f in dataclasses.fields(ix):
        a, b = getattr(ix, f.name), getattr(back, f.name)
        if isinstance(a, dict):
            assert a.keys() == b.keys() and all(np.array_equal(a[x], b[x]) for x in a)
        elif isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)
        else:
            assert a == b, f.name
    with pytest.raises(FileNotFoundError):
        load_index(tmp_path / "missing.npz")


def _bench_module():
    """benchmarks/bench_constrained.py (not part of the installed library) as a module."""
    import importlib.util
    import sys
    from pathlib import Path
    if "bench_constrained" in sys.modules:
        return sys.modules["bench_constrained"]
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_constrained.py"
    spec = importlib.util.spec_from_file_location("bench_constrained", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_memory_per_item_at_1e6_items_of_length_8():
    items = np.random.default_rng(2).integers(0, 2048, (1_000_000, 8), dtype=np.int32)
    ix = build_index(items, 2048)
    reference_layout_bytes = _bench_module().reference_layout_bytes
    assert ix.nbytes / 1e6 <= 60, ix.summary()  # bytes per item (the budget: 60 MB per 1e6)
    assert reference_layout_bytes(ix) / 1e6 >= 90  # the reference layout, same trie: ~95 MB
    # Dense: the root row (all 2048 first tokens) and the second level (~490 of 2048 per row), no deeper.
    assert ix.dense.keys() == {1, 2}


# ----------------------------------------------------------------------------- the kernel
def kernel_inputs(seed, r=6, v=300, c=20):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(r, v)) * 3, jnp.float32)
    cand = rng.integers(-1, v, (r, c)).astype(np.int32)
    cand[0, 3:] = -1  # fewer candidates than k: -inf values and -1 slots
    cand[1, :] = -1  # none at all
    mask = rng.random((r, v)) < 0.05
    mask[2] = False
    return logits, jnp.asarray(cand), jnp.asarray(mask)


@pytest.mark.parametrize("variant", ["tpu", "gpu"])
@pytest.mark.parametrize("mode,k", [("candidates", 7), ("candidates", 20), ("mask", 9)])
def test_kernel_interpret_matches_reference(variant, mode, k):
    logits, cand, mask = kernel_inputs(3 + k)
    kw = dict(candidates=cand) if mode == "candidates" else dict(mask=mask)
    want_v, want_s = constrained_topk_reference(logits, k, **kw)
    got_v, got_s = constrained_topk_pallas(logits, k, interpret=True, variant=variant, **kw)
    np.testing.assert_allclose(np.asarray(got_v), np.asarray(want_v), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_s), np.asarray(want_s))
    assert (np.asarray(want_s)[1 if mode == "candidates" else 2] == -1).all()
    # values are log_softmax at the chosen tokens
    tok = np.asarray(want_s) if mode == "mask" else np.take_along_axis(np.asarray(cand), np.maximum(want_s, 0), 1)
    ref = np.asarray(jax.nn.log_softmax(logits, -1))
    ok = np.asarray(want_s) >= 0
    np.testing.assert_allclose(np.take_along_axis(ref, tok, 1)[ok], np.asarray(want_v)[ok], rtol=1e-6)


@pytest.mark.parametrize("variant,platform,target", [("gpu", "cuda", "triton"), ("tpu", "tpu", "tpu_custom_call")])
@pytest.mark.parametrize("mode,shape", [("candidates", (140, 2048, 80, 70)), ("mask", (140, 2048, 2048, 70)),
                                        ("candidates", (3, 1000, 5, 5)), ("mask", (9, 4096, 4096, 71)),
                                        ("mask", (140, 131072, 131072, 140)), ("candidates", (16, 131072, 96, 80))])
def test_kernel_lowers_for_gpu_and_tpu(variant, platform, target, mode, shape):
    """Pallas' Triton / Mosaic lowering (block-shape rules) on this CPU; running it needs the hardware."""
    r, v, c, k = shape

    def f(x, aux):
        return constrained_topk_pallas(x, k, variant=variant, **{mode: aux})

    aux = jax.ShapeDtypeStruct((r, c), jnp.int32 if mode == "candidates" else jnp.bool_)
    text = jax.jit(f).trace(jax.ShapeDtypeStruct((r, v), jnp.bfloat16), aux).lower(
        lowering_platforms=(platform,)).as_text()
    assert target in text
    plan = block_plan(variant, r, v, c, k, mode)
    if variant == "tpu":
        assert plan["block_rows"] % 8 == 0 and plan["v_pad"] % 128 == 0 and plan["k_pad"] % 128 == 0
    else:
        assert all(plan[x] & (plan[x] - 1) == 0 for x in ("block_rows", "v_pad", "w_pad", "k_pad"))


def test_kernel_bad_input_and_dispatch():
    logits, cand, mask = kernel_inputs(0)
    for kw, match in ((dict(), "exactly one of"), (dict(candidates=cand, mask=mask), "exactly one of"),
                      (dict(candidates=cand[:2]), "candidates must be"), (dict(mask=mask[:, :5]), "mask must be")):
        with pytest.raises(ValueError, match=match):
            constrained_topk(logits, 3, **kw)
    with pytest.raises(ValueError, match="k must be an int"):
        constrained_topk(logits, 21, candidates=cand)
    with pytest.raises(ValueError, match="impl='pallas' compiles"):
        constrained_topk(logits, 3, candidates=cand, impl="pallas")
    a = constrained_topk(logits, 3, candidates=cand)  # auto: the reference on CPU
    b = constrained_topk_reference(logits, 3, candidates=cand)
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


@pytest.mark.parametrize("backend,want", [("cpu", "reference"), ("gpu", "reference"), ("tpu", "pallas")])
def test_auto_dispatch_by_backend(monkeypatch, backend, want):
    """auto: the kernel on TPU only; on a GPU the reference (measured faster there, BENCHMARKS.md)."""
    from jaxdecode.kernels.constrained import resolve_impl
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert resolve_impl("auto") == want


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= 8, "tests/conftest.py should simulate 8 CPU devices"
    return make_mesh(data=2, model=4, devices=jax.devices()[:8])


def test_sharded_kernel_equals_single_device(mesh):
    logits, cand, mask = kernel_inputs(9, r=8)
    for kw in (dict(candidates=cand), dict(mask=mask)):
        got = sharded_constrained_topk(mesh, logits, 5, impl="interpret", **kw)
        want = constrained_topk_reference(logits, 5, **kw)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        assert got[0].sharding.spec[0] == "data"


# ----------------------------------------------------------------------------- exact beam search
EXACT_CASES = {  # name: (items, vocab, max length, kind, beams)
    "1e3-fixed-V2048-L8": (1_000, 2048, 8, "fixed", 8),
    "1e4-variable-V512-L6": (10_000, 512, 6, "variable", 6),
    "1e5-eos-prefixes-V2048-L8": (100_000, 2048, 8, "eos", 5),
    # Small vocabularies: levels past the first are dense (every row spans most of V), so the later
    # steps run the dense form of the beam-group selection.
    "3e3-dense-fixed-V12-L5": (3_000, 12, 5, "fixed", 9),
    "3e3-dense-eos-V16-L5": (3_000, 16, 5, "eos", 7),
}


@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_beam_search_equals_numpy_beam_search(case):
    n, v, length, kind, k = EXACT_CASES[case]
    rng = np.random.default_rng(len(case))
    eos = (v - 1,) if kind == "eos" else ()
    items = random_items(rng, n, v - len(eos), length, variable=kind != "fixed", prefix_free=kind == "variable")
    given, n_dup = shuffled_with_duplicates(rng, items)
    ix = build_index(given, v)
    if "dense" in case:
        assert ix.constraint()._use_dense(2), "the case should exercise a dense level after the first step"
    assert ix.num_items == len(set(items)) and ix.num_duplicates == n_dup + len(items) - len(set(items))
    present = set(items)
    assert ix.has_prefix_items == any(i[:j] in present for i in items for j in range(1, len(i)))
    table = rng.normal(size=(length + 2, P, v)).astype(np.float32) * 2
    n_steps = length + len(eos)
    out = trie_beam_search(ix.constraint(), table_logits, jnp.asarray(table), 1, num_beams=k,
                           max_new_tokens=n_steps, vocab_size=v, length_penalty=0.0, eos_ids=eos)
    got = got_beams(out, 0, k)
    assert len(got) == k
    assert_same_beams(got, np_beam_search(sorted(set(items)), table, k, n_steps, eos))
    assert all(ix.contains(list(t[:-1] if eos else t)) and (not eos or t[-1] in eos) for _, t in got)


def test_beam_search_with_model_is_exhaustive_when_beams_cover_the_set(tmp_path):
    """Model beam search through jaxdecode.generate, from an item file; beams > items: every item, in the
    order of its teacher-forced log-probability (+ EOS), then invalid beams."""
    import jaxdecode
    from jaxdecode.models import causal_mask, forward
    model = tiny_model()
    rng = np.random.default_rng(4)
    items = sorted({tuple(int(x) for x in rng.integers(0, 60, rng.integers(1, 4))) for _ in range(24)})
    f = tmp_path / "items.txt"
    f.write_text("\n".join(" ".join(map(str, i)) for i in items[::-1]) + "\n")
    eos, k = (63,), 32
    prompts = [[1, 2, 3], [4, 5]]
    out = jaxdecode.generate(model, prompts, method="constrained_beam", max_new_tokens=4, index=str(f),
                             num_beams=k, length_penalty=0.0)

    def score(prompt, item):
        seq = list(prompt) + list(item)
        logits, _, _ = forward(model.config, model.params, jnp.asarray([seq]), jnp.arange(len(seq))[None], None,
                               causal_mask(1, len(seq)))
        lp = np.asarray(jax.nn.log_softmax(logits[0], -1))
        return float(sum(lp[len(prompt) - 1 + i, seq[len(prompt) + i]] for i in range(len(item))))

    for p, g in zip(prompts, out):
        st = g.stats
        assert st["beam_valid"] == [True] * len(items) + [False] * (k - len(items))
        assert all(s == -np.inf for s in st["beam_scores"][len(items):]) and not any(st["beam_lengths"][len(items):])
        got = [(st["beam_scores"][j], tuple(st["beams"][j][:st["beam_lengths"][j]])) for j in range(len(items))]
        want = sorted(((score(p, it + eos), it + eos) for it in items), key=lambda x: -x[0])
        assert_same_beams(got, want, atol=2e-4)


def test_per_request_sets_and_sharded_search(mesh):
    rng = np.random.default_rng(6)
    v, length, k = 40, 3, 5
    items = sorted(set(random_items(rng, 300, v, length)))
    sets = rng.integers(0, 3, len(items))
    ix = build_index([list(i) for i in items], v, set_ids=sets, num_sets=4)
    table = jnp.asarray(rng.normal(size=(length + 2, P, v)).astype(np.float32) * 2)
    rows = [2, 0, 1, 2]
    kw = dict(num_beams=k, max_new_tokens=length, vocab_size=v, length_penalty=0.0)
    out = trie_beam_search(ix.constraint(set_ids=rows), table_logits, table, 4, **kw)
    for b, s in enumerate(rows):
        want = np_beam_search([it for it, st in zip(items, sets) if st == s], np.asarray(table), k, length)
        assert_same_beams(got_beams(out, b, k), want)
    sharded = trie_beam_search(ix.constraint(set_ids=rows, mesh=mesh, impl="interpret"), table_logits, table, 4, **kw)
    np.testing.assert_array_equal(np.asarray(sharded.tokens), np.asarray(out.tokens))
    np.testing.assert_allclose(np.asarray(sharded.scores), np.asarray(out.scores), rtol=1e-6)
    with pytest.raises(ConstraintError, match="item set 3 .* has no items"):
        trie_beam_search(ix.constraint(set_ids=[0, 3]), table_logits, table, 2, **kw)


def test_dynamic_add_remove_equals_rebuilt_set_without_recompiling():
    rng = np.random.default_rng(7)
    v, length, k = 40, 3, 6
    items = sorted(set(random_items(rng, 400, v - 1, length)))
    dyn = DynamicIndex(build_index([list(i) for i in items], v, dense_levels=[0, 1]))
    table = rng.normal(size=(length + 2, P, v)).astype(np.float32) * 2
    first = items[0][0]  # remove every item under one first token: that prefix must vanish
    gone = set(items[::3]) | {i for i in items if i[0] == first}
    assert dyn.remove([list(i) for i in sorted(gone)]) == dict(removed=len(gone), missing=0)
    new = sorted(set(random_items(rng, 40, v - 1, length)) - set(items))
    assert dyn.add([list(i) for i in new])["added"] == len(new)
    assert dyn.add([list(items[1])]) == dict(added=0, revived=1 if items[1] in gone else 0,
                                             already_present=0 if items[1] in gone else 1)
    live = sorted((set(items) - gone) | set(new) | {items[1]})
    assert dyn.num_items == len(live) and all(dyn.contains(list(i)) for i in live)
    eos = (v - 1,)
    kw = dict(num_beams=k, vocab_size=v, length_penalty=0.0)
    for e in ((), eos):
        out = trie_beam_search(dyn.constraint(), table_logits, jnp.asarray(table), 1, max_new_tokens=length + len(e),
                               eos_ids=e, **kw)
        assert_same_beams(got_beams(out, 0, k), np_beam_search(live, table, k, length + len(e), e))
    # A later update of similar size reuses the compiled search: same pytree structure, static metadata,
    # shapes and dtypes (bucketed delta capacities), so jit finds its cached executable.
    def signature(c):
        return jax.tree.structure(c), [(x.shape, x.dtype) for x in jax.tree.leaves(c)]

    before = signature(dyn.constraint())
    dyn.add([list(i) for i in sorted(set(random_items(rng, 5, v - 1, length)) - set(live))])
    dyn.remove([list(live[2])])
    assert signature(dyn.constraint()) == before
    with pytest.raises(ItemSetError, match="is not in the index"):
        dyn.remove([[0, 0, 0, 0]])
    before = as_tuples(dyn.items())
    base = dyn.compact()
    assert dyn.num_added == 0 and base.num_items == len(before) and as_tuples(base.items()) == before


# ----------------------------------------------------------------------------- decoders and API
def tiny_model(vocab=64):
    from jaxdecode.api import Model
    from jaxdecode.models import ModelConfig, init_params
    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, eos_token_ids=(63,))
    return Model(config=cfg, params=init_params(cfg, jax.random.PRNGKey(1), std=0.5))


def test_constrained_greedy_and_sampling_through_generate(tmp_path):
    import jaxdecode
    from jaxdecode.cli import main
    model = tiny_model()
    rng = np.random.default_rng(8)
    items = sorted({tuple(int(x) for x in rng.integers(0, 60, rng.integers(1, 5))) for _ in range(50)})
    f = tmp_path / "items.txt"
    f.write_text("\n".join(" ".join(map(str, i)) for i in items))
    assert main(["index", "build", str(f), "--vocab-size", "60", "--out", str(tmp_path / "ix.npz")]) == 0
    assert main(["index", "info", str(tmp_path / "ix.npz")]) == 0
    prompts = [[1, 2, 3], [7, 8]]
    greedy = jaxdecode.generate(model, prompts, method="constrained_greedy", max_new_tokens=5,
                                index=str(tmp_path / "ix.npz"))
    children, finals = {}, set(items)
    for it in items:
        for t in range(len(it)):
            children.setdefault(it[:t], set()).add(it[t])
    from jaxdecode.models import causal_mask, forward
    for p, g in zip(prompts, greedy):
        assert g.tokens[-1] == 63 and tuple(g.tokens[:-1]) in finals
        seq = p + g.tokens  # each token is the best allowed one under teacher forcing
        logits, _, _ = forward(model.config, model.params, jnp.asarray([seq]), jnp.arange(len(seq))[None], None,
                               causal_mask(1, len(seq)))
        for i, tok in enumerate(g.tokens):
            pre = tuple(g.tokens[:i])
            allowed = sorted(children.get(pre, set()) | ({63} if pre in finals else set()))
            row = np.asarray(logits[0, len(p) - 1 + i])
            assert tok == allowed[int(np.argmax(row[allowed]))]
    sampled = jaxdecode.generate(model, prompts * 4, method="constrained_sample", max_new_tokens=5, seed=3,
                                 index=build_index([list(i) for i in items], 60), top_k=5)
    assert all(s.tokens[-1] == 63 and tuple(s.tokens[:-1]) in finals for s in sampled)


def test_fixed_length_items_without_eos_end_at_leaves():
    from jaxdecode.autoregressive import decode
    model = tiny_model()
    items = np.random.default_rng(9).integers(0, 60, (30, 3))
    c = build_index(items, 60).constraint()
    out = decode(model.config, model.params, jnp.asarray([[1, 2], [3, 4]]), jnp.asarray([2, 2]),
                 max_new_tokens=6, method="greedy", constraint=c)
    assert out.lengths.tolist() == [3, 3]
    assert all(tuple(out.tokens[b, :3].tolist()) in {tuple(r) for r in items.tolist()} for b in range(2))


CONSTRAINT_ERRORS = [
    (dict(items=[[1, 2], [1]]), dict(), "prefixes of other items.*pass eos_ids"),
    (dict(items=[[1, 63]], vocab=64), dict(eos_ids=(63,)), "EOS id 63 also occurs inside items"),
    (dict(items=[[1, 2, 3]]), dict(eos_ids=(63,), max_new_tokens=3), r"max_new_tokens >= 4"),
    (dict(items=[[1, 2, 3]], vocab=100), dict(), "build the index with vocab_size <= 64"),
    (dict(items=[[1]], set_ids=[0, 5]), dict(), r"set_ids\[1\] = 5 is outside"),
    (dict(items=[[1]], set_ids=[0]), dict(), "set_ids has shape"),
]


@pytest.mark.parametrize("build,call,match", CONSTRAINT_ERRORS)
def test_decoder_rejects_unusable_constraints(build, call, match):
    from jaxdecode.beam import beam_search
    build = dict(build)
    model = tiny_model()
    ix = build_index(build.pop("items"), build.pop("vocab", 60))
    c = ix.constraint(**build)
    call = dict(dict(max_new_tokens=4, num_beams=2), **call)
    with pytest.raises(ConstraintError, match=match):
        beam_search(model.config, model.params, jnp.asarray([[1], [2]]), jnp.asarray([1, 1]), constraint=c, **call)


# ----------------------------------------------------------------------------- issue 9 (5, 6, 10, 12)
def _jit_index():
    rng = np.random.default_rng(11)
    items = sorted(set(random_items(rng, 200, 60, 3)))
    return items, build_index([list(i) for i in items], 60, set_ids=rng.integers(0, 2, len(items)), num_sets=2)


def test_constrained_decoders_run_inside_user_jit():
    """beam_search, decode and trie_beam_search with the constraint as a traced argument of the user's
    jax.jit give the eager result, with set ids traced, absent, or given inside the trace (issue 9.5:
    prepare() raised TracerArrayConversionError)."""
    from jaxdecode.autoregressive import decode
    from jaxdecode.beam import beam_search
    model = tiny_model()
    cfg, params = model.config, model.params
    _, ix = _jit_index()
    prompts, lens = jnp.asarray([[1, 2, 3], [4, 5, 0]]), jnp.asarray([3, 2])
    table = jnp.asarray(np.random.default_rng(12).normal(size=(5, P, 60)).astype(np.float32))
    calls = {
        "beam": lambda c, p, n: beam_search(cfg, params, p, n, max_new_tokens=4, num_beams=3, eos_ids=(63,),
                                            constraint=c),
        "greedy": lambda c, p, n: decode(cfg, params, p, n, max_new_tokens=4, method="greedy", constraint=c),
        "trie": lambda c, p, n: trie_beam_search(c, table_logits, table, 2, num_beams=3, max_new_tokens=3,
                                                 vocab_size=60),
    }
    for name, sets in (("beam", "traced"), ("greedy", "none"), ("trie", "none"), ("trie", "given_inside_jit")):
        f = calls[name]
        c = ix.constraint(set_ids=[1, 0] if sets == "traced" else None)
        if sets == "given_inside_jit":  # the constraint traced, its set ids a constant of the trace
            f = (lambda f: lambda c, p, n: f(c.replace(set_ids=np.array([1, 0], np.int32)), p, n))(f)
        want = f(c, prompts, lens)
        got = jax.jit(f)(c, prompts, lens)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, err_msg=f"{name} {sets}")


def test_constraint_checks_cost_no_device_transfer():
    """prepare() checks against host copies taken when the constraint was built: a repeated call moves no
    data between host and device (issue 9.5: two device->host copies per call), and the checks still
    run inside jit when the constraint itself is concrete."""
    _, ix = _jit_index()
    table = jnp.asarray(np.random.default_rng(13).normal(size=(5, P, 60)).astype(np.float32))
    kw = dict(num_beams=3, max_new_tokens=3, vocab_size=60)
    for set_ids in (None, [1, 0]):
        c = ix.constraint(set_ids=set_ids)
        want = trie_beam_search(c, table_logits, table, 2, **kw)
        with jax.transfer_guard("disallow"):
            c.prepare(60, (), 3, 2)
            got = trie_beam_search(c, table_logits, table, 2, **kw)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    bad = build_index([[1, 2], [3, 4]], 60, set_ids=[0, 0], num_sets=2)
    with pytest.raises(ConstraintError, match="item set 1 .* has no items"):
        jax.jit(lambda t: trie_beam_search(bad.constraint(set_ids=[0, 1]), table_logits, t, 2, num_beams=2,
                                           max_new_tokens=2, vocab_size=60).tokens)(table)
    with pytest.raises(ConstraintError, match="item set 1 .* has no items"):  # set ids swapped in later
        bad.constraint().replace(set_ids=jnp.asarray([0, 1], jnp.int32)).prepare(60, (), 2, 2)
    with pytest.raises(ConstraintError, match="EOS id 3 also occurs inside items"):
        jax.jit(lambda t: trie_beam_search(bad.constraint(), table_logits, t, 2, num_beams=2, max_new_tokens=3,
                                           vocab_size=60, eos_ids=(3,)).tokens)(table)


@pytest.mark.parametrize("content", ["garbage", "truncated", "npy", "foreign_npz"])
def test_load_index_says_a_bad_file_is_not_an_index(tmp_path, content):
    """A corrupt file is named as not a jaxdecode index; never a hint to enable allow_pickle (issue 9.6)."""
    path = tmp_path / "bad.npz"
    if content == "garbage":
        path.write_bytes(b"this is not an index\n" * 20)
    elif content == "truncated":
        data = build_index([[1, 2], [3, 4, 5]], 10).save(tmp_path / "good.npz").read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif content == "npy":
        with open(path, "wb") as f:
            np.save(f, np.arange(5))
    else:
        with open(path, "wb") as f:
            np.savez(f, meta=np.frombuffer(b'{"format": 1}', np.uint8))
    with pytest.raises(ItemSetError, match=r"bad\.npz is not a valid jaxdecode item index") as e:
        load_index(path)
    assert "pickle" not in str(e.value)


@pytest.mark.parametrize("mode,width", [("candidates", 96), ("mask", 131072)])
def test_kernel_block_plan_fits_a_128k_vocabulary(mode, width):
    """V = 131072: the TPU plan tiles V and sets a scoped-VMEM limit that covers its working set and
    fits every TPU generation (v7x: 64 MiB per core); the GPU plan keeps a block within ~16 K f32
    registers per program (issue 9.10)."""
    v, r, k = 131072, 140, 140
    tpu = block_plan("tpu", r, v, width, k, mode)
    assert tpu["v_tile"] < v and tpu["v_tile"] % 128 == 0 and tpu["v_pad"] % tpu["v_tile"] == 0
    assert tpu["vmem_bytes"] <= tpu["vmem_limit_bytes"] <= 48 << 20
    gpu = block_plan("gpu", r, v, width, k, mode)
    assert gpu["v_tile"] < v and gpu["block_rows"] * gpu["v_tile"] <= 1 << 14
    assert all(gpu[x] & (gpu[x] - 1) == 0 for x in ("block_rows", "v_tile", "w_pad", "k_pad"))


@pytest.mark.parametrize("variant", ["tpu", "gpu"])
@pytest.mark.parametrize("mode,k", [("candidates", 7), ("mask", 9)])
def test_kernel_tiled_vocabulary_matches_reference(variant, mode, k):
    """The vocabulary split into tiles (online max / sum, running top-k) gives the one-tile result."""
    logits, cand, mask = kernel_inputs(21 + k, r=5, v=300)
    kw = dict(candidates=cand) if mode == "candidates" else dict(mask=mask)
    want_v, want_s = constrained_topk_reference(logits, k, **kw)
    got_v, got_s = constrained_topk_pallas(logits, k, interpret=True, variant=variant, v_tile=128, **kw)
    np.testing.assert_allclose(np.asarray(got_v), np.asarray(want_v), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_s), np.asarray(want_s))


def _exp_over_vocab(jaxpr, v) -> bool:
    """Does the jaxpr (sub-jaxprs included, Pallas kernels excluded) exponentiate a [.., V] array?"""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            continue
        if eqn.primitive.name == "exp" and eqn.outvars[0].aval.shape[-1:] == (v,):
            return True
        for p in eqn.params.values():
            for j in (p if isinstance(p, (tuple, list)) else (p,)):
                j = getattr(j, "jaxpr", j)
                if hasattr(j, "eqns") and _exp_over_vocab(j, v):
                    return True
    return False


GROUPED_CASES = {  # name: (items, vocab, max length, kind, beams)
    "fixed": (200, 40, 3, "fixed", 5),  # CSR rows, items end at leaves
    "variable-mixed": (200, 30, 4, "variable", 4),  # levels mixing leaves and inner states: two kinds
    "dense-eos": (300, 12, 3, "eos", 6),  # dense levels (the mask form) and EOS slots
}


@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_grouped_beam_step_runs_the_kernel(case):
    """The default beam path (per-group selection) runs the Pallas kernel when the kernel is the
    implementation (GPU/TPU; here interpret mode): the kernel's per-row best allowed tokens feed the
    group's top-k, so the [R, V] log-softmax is never built, and the beams equal the NumPy search
    (issue 9.10)."""
    n, v, length, kind, k = GROUPED_CASES[case]
    rng = np.random.default_rng(30 + len(case))
    eos = (v - 1,) if kind == "eos" else ()
    items = sorted(set(random_items(rng, n, v - len(eos), length, variable=kind != "fixed",
                                    prefix_free=kind == "variable")))
    ix = build_index([list(i) for i in items], v)
    c = ix.constraint(impl="interpret")
    r = 2 * k
    logits = jnp.asarray(rng.normal(size=(r, v)).astype(np.float32))
    state = c.prepare(v, eos).init(r).replace(depth=jnp.int32(1))
    jaxpr = jax.make_jaxpr(lambda c, s, x, sc: c.candidates(s, x, k, scores=sc))(
        c.prepare(v, eos), state, logits, jnp.zeros((r,), jnp.float32))
    assert "pallas_call" in str(jaxpr)
    assert not _exp_over_vocab(jaxpr.jaxpr, v), "an [R, V] softmax is built outside the kernel"
    table = rng.normal(size=(length + 2, P, v)).astype(np.float32) * 2
    n_steps = length + len(eos)
    out = trie_beam_search(c, table_logits, jnp.asarray(table), 1, num_beams=k, max_new_tokens=n_steps,
                           vocab_size=v, length_penalty=0.0, eos_ids=eos)
    assert_same_beams(got_beams(out, 0, k), np_beam_search(items, table, k, n_steps, eos))


def test_library_holds_no_benchmark_code(capsys):
    """The benchmark lives in benchmarks/ (issue 9.12); `jaxdecode index bench` says where it went."""
    import importlib.util

    from jaxdecode.cli import main
    assert importlib.util.find_spec("jaxdecode.constraints.bench") is None
    assert main(["index", "bench"]) == 2
    assert "benchmarks/bench_constrained.py" in capsys.readouterr().err
