"""The retrieval drafter: its hashed datastore, its longest-match rule against a reference, and what
it drafts through the engine (greedy == plain greedy; lossless sampling is the point-mass chain pair of
test_verifier_pairs)."""
from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.drafters.retrieval import RetrievalConfig, RetrievalDrafter, build_table, context_hashes


# ----------------------------------------------------------------------------- reference rule
def reference_store(rows, starts, max_order):
    """{context tuple: most frequent next token (ties: the lower id)} over the predicted positions."""
    counts = collections.defaultdict(collections.Counter)
    for row, start in zip(rows, starts):
        row = list(row)
        for t in range(max(start, 1), len(row)):
            for k in range(1, max_order + 1):
                if t - k < 0:
                    break
                counts[tuple(row[t - k:t])][row[t]] += 1
    return {c: min(cnt, key=lambda tok: (-cnt[tok], tok)) for c, cnt in counts.items()}


def reference_draft(history, store, max_order, history_ngram, num_nodes):
    """The module docstring's rule, one token at a time in Python."""
    h, out = list(history), []
    for _ in range(num_nodes):
        n_hist, tok_hist = 0, None
        for e in range(len(h) - 2, -1, -1):  # most recent first: a later equal match does not replace it
            n = 0
            while n < history_ngram and e - n >= 0 and h[e - n] == h[len(h) - 1 - n]:
                n += 1
            if n > n_hist:
                n_hist, tok_hist = n, h[e + 1]
        n_store, tok_store = 0, None
        for k in range(min(max_order, len(h)), 0, -1):
            if tuple(h[-k:]) in store:
                n_store, tok_store = k, store[tuple(h[-k:])]
                break
        if max(n_hist, n_store) == 0:
            break
        tok = tok_hist if n_hist >= n_store else tok_store
        out.append(tok)
        h.append(tok)
    return out


def _run_draft(drafter, histories, width=48):
    hist = np.zeros((len(histories), width), np.int32)
    for i, h in enumerate(histories):
        hist[i, :len(h)] = h
    toks, valid = jax.jit(drafter.draft)(jnp.asarray(hist), jnp.asarray([len(h) for h in histories], jnp.int32))
    return [list(np.asarray(t)[np.asarray(v)]) for t, v in zip(toks, valid)]


# ----------------------------------------------------------------------------- tests
def test_hashes_agree_between_numpy_and_jax():
    x = np.random.default_rng(0).integers(0, 5000, size=(3, 17))
    for a, b in zip(context_hashes(x, 5, np), context_hashes(jnp.asarray(x), 5, jnp)):
        assert a.dtype == np.uint32 and a.shape == (5, 3, 17)
        np.testing.assert_array_equal(a, np.asarray(b))
    fingerprints = context_hashes(x, 5, np)[1]
    assert np.all(fingerprints != 0)  # 0 marks an empty slot


def _look(table, ctx):
    """(token, order) the table answers for the context `ctx` (a list, newest last)."""
    last = np.full((1, table.max_order), -1, np.int32)
    last[0, table.max_order - len(ctx):] = ctx
    tok, order = table.lookup(jnp.asarray(last))
    return int(tok[0]), int(order[0])


@pytest.mark.parametrize("prune", [False, True])
def test_table_holds_the_most_frequent_next_token_and_backs_off(prune):
    rows = np.array([[1, 2, 3, 1, 2, 4, 1, 2, 4, 5, 6, 7],
                     [9, 1, 2, 3, 8, 8, 8, 8, 8, 8, 1, 2]])
    table, stats = build_table(rows, max_order=3, prune=prune)
    ref = reference_store(rows, [1, 1], 3)
    assert ref[(1, 2)] == 3  # 3 and 4 follow (1, 2) twice each: the lower id wins
    assert _look(table, [1, 2]) == (3, 1 if prune else 2)  # pruned: (2,) -> 3 already says it
    assert _look(table, [2, 4, 1]) == (2, 1 if prune else 3)
    assert _look(table, [6, 7])[1] == 0  # 7 is never followed by a predicted token
    assert _look(table, [42])[1] == 0  # unseen
    for ctx, tok in ref.items():  # every context answers as the reference does, pruned or not
        assert _look(table, list(ctx))[0] == tok, ctx
    assert stats["contexts"] == [len([c for c in ref if len(c) == k]) for k in (1, 2, 3)]
    assert stats["entries"] + stats["overflow"] == sum(stats["contexts"]) - sum(stats["redundant"])
    assert (sum(stats["redundant"]) > 0) == prune


def test_starts_and_lengths_limit_what_is_predicted():
    rows = np.array([[5, 6, 7, 5, 6, 9, 9, 9]])
    table, stats = build_table(rows, lengths=[6], starts=[4], max_order=2, prune=False)  # predicts 4 and 5
    assert stats["predicted_positions"] == 2
    assert _look(table, [5, 6]) == (9, 2)
    assert _look(table, [7, 5]) == (6, 2)
    assert _look(table, [6, 7])[1] == 0  # 7 -> 5 is at position 3: context only
    assert _look(table, [9, 9])[1] == 0  # past the row's length


def test_drafts_follow_the_reference_rule():
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 6, size=(40, 30))
    max_order, ng = 4, 3
    table, stats = build_table(rows, starts=np.full(40, 5), max_order=max_order, load=0.1)
    assert stats["overflow"] == 0  # a full bucket would drop contexts the reference keeps
    store = reference_store(rows, [5] * 40, max_order)
    histories = [list(rng.integers(0, 6, size=n)) for n in (1, 2, 5, 11, 20, 33)]
    drafter = RetrievalDrafter(table=table, num_nodes=7, history_ngram=ng)
    got = _run_draft(drafter, histories)
    for h, g in zip(histories, got):
        assert g == reference_draft(h, store, max_order, ng, 7), h


def test_history_only_drafter_is_prompt_lookup_that_rematches():
    histories = [[1, 2, 3, 4, 1, 2, 3], [7, 7], [5], [1, 2, 9, 1, 2, 8, 1, 2]]
    got = _run_draft(RetrievalDrafter(table=None, num_nodes=5, history_ngram=4), histories)
    assert got[0] == [4, 1, 2, 3, 4]
    assert got[1] == [7, 7, 7, 7, 7]
    assert got[2] == []  # nothing to match: no draft
    assert got[3][:1] == [8]  # the most recent occurrence of the longest match
    for h, g in zip(histories, got):
        assert g == reference_draft(h, {}, 1, 4, 5)


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="rows must be an int array"):
        build_table(np.zeros((3,), int))
    with pytest.raises(ValueError, match="negative token ids"):
        build_table(np.array([[1, -1, 2]]))
    with pytest.raises(ValueError, match="one entry per row"):
        build_table(np.array([[1, 2, 3]]), lengths=[3, 3])
    with pytest.raises(ValueError, match="max_order"):
        build_table(np.array([[1, 2, 3]]), max_order=0)
    with pytest.raises(ValueError, match="num_nodes"):
        RetrievalDrafter(num_nodes=0)
    with pytest.raises(ValueError, match="table must be an NgramTable"):
        RetrievalDrafter(table=np.zeros(3))


@pytest.mark.parametrize("pairs,match", [
    ([[0.7, [0.2, 0.3]]], "needs the greedy confidence"),  # checked against confidence=() below
    ([[0.7, [0.2]]], "must hold 2 probabilities"),
    ([[0.7, [0.2, 1.5]]], "must hold 2 probabilities"),
    ([[0.0, [0.2, 0.3]]], "finite, > 0"),
    ([[0.7, [0.2, 0.3]], [0.7, [0.1, 0.2]]], "given once each"),
    ([0.7, 0.2], "not a list of \\(temperature, rates\\) pairs"),
])
def test_bad_sampled_confidence_is_refused_clearly(pairs, match):
    confidence = () if "greedy" in match else (0.3, 0.6)
    with pytest.raises(ValueError, match=match):
        RetrievalConfig(confidence=confidence, sampled_confidence=pairs)
    with pytest.raises(ValueError, match=match):
        RetrievalDrafter(num_nodes=2, confidence=confidence, sampled_confidence=pairs)


def test_classes_by_source_tell_the_rows_own_text_from_the_datastore():
    """With by_source a token's class is (source, match length): the datastore's lengths 1..L, then the
    row's own text's. The chain's cut reads that class's rate, and match_acceptance counts the sources
    apart (the two halves add up to the counts by length alone)."""
    from jaxdecode.drafters.retrieval import match_acceptance
    from jaxdecode.speculative import DraftContext
    table, _ = build_table(np.array([[1, 2, 3, 4, 5, 6]]), max_order=2)
    conf = (0.5, 0.6, 0.7, 0.9)  # datastore lengths 1, 2; own text lengths 1, 2
    drafter = RetrievalDrafter(table=table, num_nodes=3, history_ngram=2, confidence=conf, by_source=True)
    hist = jnp.asarray([[1, 2, 0, 0, 0, 0, 0, 0, 0], [7, 8, 9, 7, 8, 0, 0, 0, 0]], jnp.int32)
    lens = jnp.asarray([2, 5], jnp.int32)
    toks, valid, strength, own = (np.asarray(x) for x in drafter.draft(hist, lens, with_match=True))
    assert toks.tolist() == [[3, 4, 5], [9, 7, 8]] and valid.all()
    assert strength.tolist() == [[2, 2, 2], [2, 2, 2]] and own.tolist() == [[False] * 3, [True] * 3]
    tree, _, _ = drafter.propose((), DraftContext(history=hist, hist_len=lens, key=jax.random.key(0)), None)
    assert np.asarray(tree.classes).tolist() == [[1, 1, 1], [3, 3, 3]]
    assert drafter.confidence_classes == 4
    # the cut: reach 0.6, 0.36 on the datastore's chain (cut after one), 0.9, 0.81, 0.73 on the own text's
    cut = RetrievalDrafter(table=table, num_nodes=3, history_ngram=2, confidence=conf, by_source=True, min_reach=0.4)
    assert np.asarray(cut.draft(hist, lens)[1]).tolist() == [[True, False, False], [True] * 3]

    # sampling at T = 0.7 the cut reads the rates measured there: the own text's chain ends after one too
    # (0.5, 0.25); at a temperature between measurements, interpolated rates (0.7 at T = 0.35: two kept)
    sampled = ((0.7, (0.3, 0.4, 0.4, 0.5)),)
    for t, kept in ((0.0, 3), (0.35, 2), (0.7, 1)):
        hot = dataclasses.replace(cut, sampled_confidence=sampled, temperature=t)
        assert np.asarray(hot.draft(hist, lens)[1]).tolist()[1] == [True] * kept + [False] * (3 - kept)
    assert dataclasses.replace(cut, temperature=np.float32(0.7)).temperature == pytest.approx(0.7)
    for bad in (-1.0, float("nan"), True, "0.7"):
        with pytest.raises(ValueError, match="finite number >= 0"):
            dataclasses.replace(cut, temperature=bad)

    prompts = np.array([[0, 0, 0, 1, 2], [7, 8, 9, 7, 8]], np.int32)
    continuations = np.array([[3, 4, 9], [9, 7, 1]], np.int32)
    split = match_acceptance(dataclasses.replace(drafter, confidence=()), prompts, continuations)
    whole = match_acceptance(dataclasses.replace(drafter, confidence=(), by_source=False), prompts, continuations)
    assert len(split[0]) == 4 and len(whole[0]) == 2
    halves = np.asarray(split[1]).reshape(2, 2, 2)
    assert (halves.sum(0) == np.asarray(whole[1])).all()
    assert halves[0].tolist() == [[0, 0], [3, 2]] and halves[1].tolist() == [[0, 0], [3, 2]]


@pytest.mark.parametrize("make,match", [
    (lambda t: RetrievalDrafter(table=t, by_source=True, confidence=(0.1, 0.2, 0.3)), "2L in all"),
    (lambda t: RetrievalDrafter(by_source=True), "no datastore"),
    (lambda t: RetrievalDrafter(table=t, by_source="yes"), "true or false"),
    (lambda t: RetrievalConfig(by_source=True, confidence=(0.1, 0.2, 0.3)), "2L in all"),
])
def test_bad_by_source_is_refused_clearly(make, match):
    table, _ = build_table(np.array([[1, 2, 3]]), max_order=2)
    with pytest.raises(ValueError, match=match):
        make(table)


# ----------------------------------------------------------------------------- a shipped datastore
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(target Model, corpus dir, datastore dir) from `jaxdecode train retrieval` on a tiny trained LM."""
    from jaxdecode.cli import main
    from jaxdecode.training.fixtures import build_tiny_lm
    import jaxdecode
    root = tmp_path_factory.mktemp("retrieval")
    target = jaxdecode.load(build_tiny_lm(root / "lm", steps=40))
    out = root / "store"
    rc = main(["train", "retrieval", "--target", target.path, "--corpus", str(root / "lm" / "corpus"),
               "--out", str(out), "--prompts", "32", "--prompt-len", "8", "--seq-len", "40", "--gen-batch-size",
               "16", "--eval-prompts", "4", "--eval-new-tokens", "16", "--set", "max_order=4", "--no-progress"])
    assert rc == 0
    return target, root / "lm" / "corpus", out


def test_cli_builds_a_datastore_that_decodes_exactly(built, capsys):
    import jaxdecode
    from jaxdecode.drafters import load_drafter, make_drafter
    target, _, out = built
    loaded = load_drafter(out, target)
    assert loaded.name == "retrieval" and loaded.cfg.max_order == 4
    rows = np.asarray(loaded.params["rows"])
    assert rows.dtype == np.uint16 and rows.shape == (32, 40 - 8 + 4)  # 4 context tokens + the continuation
    extra = loaded.extra
    assert extra["data"]["rows"] == 32 and extra["table"]["entries"] > 0
    # the build's defaults (training.retrieval.BUILD_DEFAULTS): chains of 16, cut at reach 0.15
    assert loaded.cfg.num_nodes == 16 and loaded.cfg.min_reach == 0.15
    assert extra["heldout"]["tau"] >= 1.0 and len(extra["heldout"]["accept_by_depth"]) == 16
    # the acceptance by match length greedily and at the default sampling temperatures, one rate a class
    assert [t for t, _ in loaded.cfg.sampled_confidence] == [0.7, 1.0]
    assert all(len(r) == len(loaded.cfg.confidence) for _, r in loaded.cfg.sampled_confidence)
    counts = extra["confidence_counts"]
    assert len(counts["tried_accepted_at_0.7"]) == len(counts["tried_accepted"]) == len(loaded.cfg.confidence)
    # by (source, match length): the datastore's lengths 1..8 (max(8, max_order)), then the row's own text's
    assert loaded.cfg.by_source and len(loaded.cfg.confidence) == 16
    drafter = make_drafter("retrieval", target, drafter_dir=str(out), tree="chain:5")
    assert drafter.num_nodes == 5 and drafter.acceptance_prior == tuple(extra["heldout"]["accept_by_depth"])
    prompts = ["def f(x):", "import os\n", "class A"]
    greedy = jaxdecode.generate(target, prompts, "greedy", 24, eos_ids=[])
    for adaptive in (False, True):
        spec = jaxdecode.generate(target, prompts, "speculative", 24, eos_ids=[], drafter="retrieval",
                                  drafter_dir=str(out), adaptive=adaptive)
        assert [g.tokens for g in spec] == [g.tokens for g in greedy]


def test_a_datastore_with_options_is_built_once(built):
    """generate(drafter="retrieval", drafter_options={...}) builds the drafter on every call: with plain
    option values it is the same object again (uncached, each call re-read the datastore and rebuilt its
    table: 7x slower than plain decoding); other values, or an array option, build anew, on the same
    loaded datastore and table, however many configurations take turns."""
    from jaxdecode.drafters import make_drafter
    target, _, out = built
    first = make_drafter("retrieval", target, drafter_dir=str(out), min_reach=0.15)
    assert make_drafter("retrieval", target, drafter_dir=str(out), min_reach=0.15) is first
    assert first.min_reach == 0.15
    other = make_drafter("retrieval", target, drafter_dir=str(out), min_reach=0.35)
    assert other is not first and other.min_reach == 0.35
    assert make_drafter("retrieval", target, drafter_dir=str(out), min_reach=0.15, history_ngram=4) is not first
    assert make_drafter("retrieval", target, drafter_dir=str(out), min_reach=0.15) is first
    unplain = make_drafter("retrieval", target, drafter_dir=str(out), min_reach=np.float32(0.15))
    assert unplain is not first and unplain is not make_drafter("retrieval", target, drafter_dir=str(out),
                                                                min_reach=np.float32(0.15))
    for n in range(1, 9):  # more configurations than the builds kept: each still reads the same table
        assert make_drafter("retrieval", target, drafter_dir=str(out), tree=f"chain:{n}").table is first.table


def test_a_target_that_ships_a_datastore_drafts_from_it_by_default(built, tmp_path):
    import shutil

    import jaxdecode
    from jaxdecode.drafters import make_drafter
    from jaxdecode.drafters.ngram import PromptLookupDrafter
    target, _, out = built
    assert isinstance(make_drafter(None, target), PromptLookupDrafter)
    shipped = tmp_path / "target"
    shutil.copytree(target.path, shipped)
    shutil.copytree(out, shipped / "drafters" / "retrieval")
    with_store = jaxdecode.load(shipped)
    assert isinstance(make_drafter(None, with_store), RetrievalDrafter)
    draft_given = make_drafter(None, with_store, draft=with_store)  # a draft model still means draft_lm
    assert type(draft_given).__name__ == "DraftLM"


def test_a_datastore_for_another_target_is_refused(built, tmp_path):
    import json

    from jaxdecode.drafters import make_drafter
    from jaxdecode.drafters.retrieval import RetrievalConfig, RetrievalError, datastore_params
    from jaxdecode.drafters.trained import DrafterLoadError, DrafterTargetError, save_drafter
    target, _, out = built
    other = target.config.replace(vocab_size=target.config.vocab_size + 1)
    foreign = tmp_path / "foreign"
    save_drafter(foreign, "retrieval", RetrievalConfig(), datastore_params(np.ones((2, 5), int), [5, 5], [1, 1]),
                 other)
    with pytest.raises(DrafterTargetError, match="vocab_size"):
        make_drafter("retrieval", target, drafter_dir=str(foreign))
    for bad in ("0.7", -0.5, float("inf"), None):  # the temperature is checked before anything loads
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            make_drafter("retrieval", target, drafter_dir=str(out), temperature=bad)
    # ids outside the vocabulary (a datastore tokenized otherwise, its config.json edited)
    wide = tmp_path / "wide"
    save_drafter(wide, "retrieval", RetrievalConfig(),
                 datastore_params(np.full((2, 5), target.config.vocab_size + 3), [5, 5], [1, 1]), target.config)
    with pytest.raises(RetrievalError, match="outside the target's vocabulary"):
        make_drafter("retrieval", target, drafter_dir=str(wide))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"jaxdecode_drafter": "retrieval"}))
    with pytest.raises(DrafterLoadError, match="no 'config' object"):
        make_drafter("retrieval", target, drafter_dir=str(broken))
    with pytest.raises(RetrievalError, match="unknown retrieval drafter options"):
        make_drafter("retrieval", target, drafter_dir=str(out), max_depth=3)


def test_sharded_retrieval_equals_single_device():
    """On a (data x model) mesh the datastore's table is replicated and the rows' histories split over
    data: the same tokens and verification counts as on one device."""
    from jaxdecode.autoregressive import decode, pad_prompts
    from jaxdecode.models import ModelConfig, init_params
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.sharding import make_mesh, shard_batch, shard_params
    from jaxdecode.speculative import speculative_decode
    from jaxdecode.verifiers import get_verifier

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    greedy = SamplerConfig(temperature=0.0)
    seed_prompts = np.random.default_rng(3).integers(1, 64, size=(8, 3))
    own = decode(cfg, params, jnp.asarray(seed_prompts, jnp.int32), jnp.full((8,), 3, jnp.int32), max_new_tokens=16,
                 sampler=greedy, method="greedy")
    table, _ = build_table(np.concatenate([seed_prompts, np.asarray(own.tokens)], axis=1), starts=np.full(8, 3),
                           max_order=4)
    drafter = RetrievalDrafter(table=table, num_nodes=4)
    prompts, lengths = pad_prompts([[3, 9, 27, 4, 1], [8, 2], [5, 5, 5], [60, 1, 33, 7]])
    kw = dict(max_new_tokens=12, verifier=get_verifier("greedy"), sampler=greedy)
    ref = speculative_decode(cfg, params, drafter, prompts, lengths, **kw)
    mesh = make_mesh(data=2, model=4, devices=jax.devices()[:8])
    got = speculative_decode(cfg, shard_params(params, mesh), drafter, shard_batch(prompts, mesh),
                             shard_batch(lengths, mesh), mesh=mesh, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(got.stats["verify_calls"]), np.asarray(ref.stats["verify_calls"]))
    plain = decode(cfg, params, prompts, lengths, max_new_tokens=12, sampler=greedy, method="greedy")
    np.testing.assert_array_equal(np.asarray(ref.tokens), np.asarray(plain.tokens))
    assert float(np.max(np.asarray(ref.stats["tau"]))) > 1.0  # it drafted something the target accepted


# ----------------------------------------------------------------------------- class-keyed adaptive policy
def test_a_class_keyed_policy_learns_per_class_and_plans_for_the_best():
    from jaxdecode import adaptive
    from jaxdecode.tree import chain_tree

    policy = adaptive.AdaptivePolicy(widths=(0, 1, 2), shape="proposal", classes=3, prior_by_class=(0.01, 0.9))
    st = adaptive.init_state(policy, 1, 2, 2, is_chain=True)
    np.testing.assert_allclose(np.asarray(st.accept), [[0.01, 0.9, 0.9]])  # later classes take the last
    costs = jnp.asarray([1.0, 1.2, 1.3, 0.0, 0.0, 0.0, 0.0], jnp.float32)  # [step x W, draft x W, idle]
    remaining = jnp.asarray([5])

    def keep(classes, state=st):
        tree = chain_tree(jnp.asarray([[1, 2]], jnp.int32)).replace(classes=jnp.asarray([classes], jnp.int32))
        kept_tree, kept, new = adaptive.truncate(policy, state, costs, tree, remaining)
        return int(kept[0]), kept_tree, new

    n, _, after_weak = keep([0, 0])
    assert n == 0  # class 0 is not worth a node
    # ... and the row stops (it drafted on a shape that paid: a weak match counts as no match), then
    # probes after one plain step, its next proposal judged as if of the best class
    assert not bool(adaptive.should_draft(policy, after_weak, costs, remaining))
    assert int(after_weak.wait[0]) == 1
    assert bool(adaptive.should_draft(policy, adaptive.drift(policy, after_weak, jnp.asarray([1])), costs, remaining))
    assert keep([2, 0])[0] == 1 and keep([1, 1])[0] == 2  # what each proposal's own classes are worth
    # a kept class-2 node accepted, and (another step) a class-1 node rejected: only those classes move
    _, tree, st2 = keep([2, 0])
    st3 = adaptive.update(policy, st2, tree, jnp.asarray([[0, -1]]), jnp.asarray([1]), jnp.asarray([1]),
                          jnp.asarray([True]))
    _, tree, st4 = keep([1, 1], st3)
    st5 = adaptive.update(policy, st4, tree, jnp.asarray([[-1, -1]]), jnp.asarray([0]), jnp.asarray([0]),
                          jnp.asarray([True]))
    got = np.asarray(st5.accept)[0]
    assert got[2] > 0.9 and got[1] < 0.9 and abs(got[0] - 0.01) < 0.02
    with pytest.raises(ValueError, match="shape='proposal'"):
        adaptive.AdaptivePolicy(widths=(0, 1), shape="structure", classes=2)
    with pytest.raises(ValueError, match="Tree.classes"):
        adaptive.truncate(policy, st, costs, chain_tree(jnp.ones((1, 2), jnp.int32)), remaining)


def test_policy_for_keys_by_class_when_the_drafter_has_a_confidence_table():
    from jaxdecode import adaptive
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.speculative import policy_for
    with_conf = RetrievalDrafter(num_nodes=4, confidence=(0.3, 0.6, 0.9))
    greedy = policy_for(with_conf, SamplerConfig(temperature=0.0))
    assert greedy.classes == 3 and greedy.prior_by_class == (0.3, 0.6, 0.9)
    sampled = policy_for(with_conf, SamplerConfig(temperature=0.7))
    # measured greedily: sampling starts there too, weighed as a guess (not as a measurement)
    assert sampled.classes == 3 and sampled.prior_by_class == (0.3, 0.6, 0.9) and sampled.prior_weight == 0.0
    assert greedy.prior_weight == adaptive.MEASURED_PRIOR_WEIGHT
    assert policy_for(RetrievalDrafter(num_nodes=4), SamplerConfig()).classes == 0
    table, _ = build_table(np.array([[1, 2, 3]]), max_order=2)
    by_source = RetrievalDrafter(table=table, num_nodes=4, confidence=(0.3, 0.5, 0.4, 0.9), by_source=True)
    assert policy_for(by_source, SamplerConfig()).prior_by_class == (0.3, 0.5, 0.4, 0.9)  # one key per class


@pytest.mark.parametrize("temps,match", [("0,0.7", "finite, > 0 and given once"),
                                         ("0.7,0.7", "given once each"), ("abc", "not a comma-separated list")])
def test_bad_confidence_temperatures_are_refused_clearly(temps, match, capsys):
    from jaxdecode.cli import main
    with pytest.raises(SystemExit):
        main(["train", "retrieval", "--target", "T", "--out", "O", "--corpus", "C", "--confidence-temperatures", temps])
    assert match in capsys.readouterr().err


def test_sampling_starts_from_the_rates_measured_at_its_temperature():
    """A datastore measured at T = 0.7 and 1.0 (sampled continuations) starts a policy sampling there
    from those rates, counted as a measurement; between measured temperatures (the greedy rates at 0)
    the start is interpolated and weighed as a guess, and so is a filtered sampler's (greedy rates)."""
    from jaxdecode import adaptive
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.speculative import policy_for
    drafter = RetrievalDrafter(num_nodes=4, confidence=(0.3, 0.6, 0.9),
                               sampled_confidence=((1.0, (0.1, 0.2, 0.3)), (0.7, (0.2, 0.4, 0.6))))

    def start(**sampler):
        policy = policy_for(drafter, SamplerConfig(**sampler))
        return tuple(round(p, 4) for p in policy.prior_by_class), policy.prior_weight

    measured = adaptive.MEASURED_PRIOR_WEIGHT
    assert start(temperature=0.0) == ((0.3, 0.6, 0.9), measured)
    assert start(temperature=0.7) == ((0.2, 0.4, 0.6), measured)
    assert start(temperature=0.73) == ((0.2, 0.4, 0.6), measured)  # within SAMPLED_CONFIDENCE_TOLERANCE
    assert start(temperature=1.0) == ((0.1, 0.2, 0.3), measured)
    assert start(temperature=0.35) == ((0.25, 0.5, 0.75), 0.0)  # halfway from greedy to 0.7
    assert start(temperature=0.85) == ((0.15, 0.3, 0.45), 0.0)
    assert start(temperature=1.5) == ((0.1, 0.2, 0.3), 0.0)  # past the hottest: its rates, as a guess
    assert start(temperature=0.7, top_p=0.9) == ((0.3, 0.6, 0.9), 0.0)  # filtered: the greedy guess
    assert drafter.class_prior_at(0.7) == ((0.2, 0.4, 0.6), True)
    assert RetrievalDrafter(num_nodes=4).class_prior_at(0.7) == ((), False)


@pytest.mark.parametrize("verifier,lossless,by_source", [("point_mass", True, False), ("typical", False, False),
                                                       ("point_mass", True, True)])
@pytest.mark.exec_bound  # 1e5 rows: running, not compiling (tests/conftest.py)
def test_class_keyed_adaptive_sampling_is_lossless(verifier, lossless, by_source):
    """1e5 rows of the chi-squared harness's target (tests/test_verifier_pairs.py) sampled at T = 1 with
    the retrieval drafter under a class-keyed policy whose costs keep strong matches and drop weak
    ones, so rows verify different depths by the classes of their own proposals: the first two tokens
    follow the target's law; the lossy `typical` verifier fails the same test. by_source: the classes
    also tell the row's own text from the datastore (a 1-token match is dropped from the datastore
    only)."""
    import test_verifier_pairs as vp

    from jaxdecode import adaptive
    from jaxdecode.speculative import speculative_decode
    from jaxdecode.verifiers import get_verifier

    rows = np.random.default_rng(2).integers(0, vp.V, size=(64, 12))
    table, _ = build_table(rows, max_order=2)
    conf = (0.25, 0.9, 0.9, 0.9) if by_source else (0.25, 0.9)
    drafter = RetrievalDrafter(table=table, num_nodes=2, history_ngram=2, confidence=conf, by_source=by_source)
    policy = adaptive.AdaptivePolicy(widths=(0, 1, 2), shape="proposal", classes=len(conf), prior_by_class=conf,
                                     margin=0.0)
    costs = vp.StepCosts(per_node=0.35, draft=0.0)  # a node pays from a ~0.35 estimate: class 1, not class 0
    n, chunks = 100_000, 5
    prompts = np.tile(np.asarray(vp.PROMPT, np.int32), (n // chunks, 1))
    lengths = np.full((n // chunks,), len(vp.PROMPT), np.int32)
    toks, plain_steps, drafting_steps = [], 0, 0
    for c in range(chunks):
        out = speculative_decode(vp.CFG, vp.PARAMS, drafter, prompts, lengths, max_new_tokens=3,
                                 verifier=get_verifier(verifier), sampler=vp.T1,
                                 key=jax.random.key(200 + c, impl="rbg"), adaptive=policy, costs=costs)
        toks.append(np.asarray(out.tokens)[:, :2])
        spec = np.asarray(out.stats["speculative_steps"])
        plain_steps += int(np.sum(np.asarray(out.stats["verify_calls"]) - spec))
        drafting_steps += int(np.sum(spec))
    if lossless:  # the policy mixed: rows drafted on some steps and not on others
        assert plain_steps > 0 and drafting_steps > 0, (plain_steps, drafting_steps)
    p = vp.chi2_pvalue(np.concatenate(toks), vp.exact_joint(vp.CFG, vp.PARAMS, vp.PROMPT, vp.V))
    assert (p > vp.P_OK) if lossless else (p < vp.P_BROKEN), p


# ----------------------------------------------------------------------------- under an acceptance head
def class_head(classes: int, max_depth: int = 8, slope: float = 8.0, bias: float = 3.0):
    """(AcceptHeadConfig, params) of a head over confidence classes that trusts every class but the
    first (the weakest match): logit bias for strong classes, bias - slope * silu(1) for class 0."""
    from jaxdecode.drafters.accept_head import AcceptHeadConfig
    cfg = AcceptHeadConfig(hidden=4, max_depth=max_depth, classes=classes, inner="retrieval")
    w = np.zeros((cfg.input_dim, cfg.hidden), np.float32)
    w[0, 0] = 1.0  # hidden unit 0 fires on class 0
    out = np.zeros((cfg.hidden, 1), np.float32)
    out[0, 0] = -slope
    return cfg, {"inp": {"kernel": jnp.asarray(w), "bias": jnp.zeros((cfg.hidden,))},
                 "out": {"kernel": jnp.asarray(out), "bias": jnp.full((1,), bias)}}


@pytest.mark.parametrize("verifier,lossless", [("point_mass", True), ("typical", False)])
@pytest.mark.exec_bound  # 1e5 rows: running, not compiling (tests/conftest.py)
def test_an_acceptance_head_over_retrieval_stays_lossless(verifier, lossless):
    """The head cuts each chain after its first weak-class node (a function of the text before it), so
    rows verify different lengths by their own matches: 1e5 rows at T = 1 follow the target's law with
    the point-mass verifier; the lossy `typical` fails the same test."""
    import test_verifier_pairs as vp

    from jaxdecode.drafters.accept_head import AcceptHeadDrafter
    from jaxdecode.speculative import speculative_decode
    from jaxdecode.verifiers import get_verifier

    rows = np.random.default_rng(2).integers(0, vp.V, size=(64, 12))
    table, _ = build_table(rows, max_order=2)
    inner = RetrievalDrafter(table=table, num_nodes=2, history_ngram=2, confidence=(0.25, 0.9), min_reach=0.5)
    cfg, params = class_head(2)
    drafter = AcceptHeadDrafter.wrap(inner, params, cfg, threshold=0.5)
    assert drafter.inner.min_reach == 0.0, "the head decides where the chain ends"
    n, chunks = 100_000, 5
    prompts = np.tile(np.asarray(vp.PROMPT, np.int32), (n // chunks, 1))
    lengths = np.full((n // chunks,), len(vp.PROMPT), np.int32)
    toks, hist = [], 0
    for c in range(chunks):
        out = speculative_decode(vp.CFG, vp.PARAMS, drafter, prompts, lengths, max_new_tokens=3,
                                 verifier=get_verifier(verifier), sampler=vp.T1,
                                 key=jax.random.key(300 + c, impl="rbg"))
        toks.append(np.asarray(out.tokens)[:, :2])
        hist = hist + np.asarray(out.stats["accept_hist"]).sum(0)
    p = vp.chi2_pvalue(np.concatenate(toks), vp.exact_joint(vp.CFG, vp.PARAMS, vp.PROMPT, vp.V))
    assert (p > vp.P_OK) if lossless else (p < vp.P_BROKEN), p


def test_bad_heads_over_retrieval_are_refused():
    from jaxdecode.drafters.accept_head import AcceptHeadConfig, AcceptHeadDrafter
    from jaxdecode.speculative import SpeculativeError
    inner = RetrievalDrafter(num_nodes=4, confidence=(0.3, 0.6, 0.9))
    cfg, params = class_head(2)
    with pytest.raises(SpeculativeError, match="reads 2 confidence classes.*has 3"):
        AcceptHeadDrafter.wrap(inner, params, cfg)
    with pytest.raises(SpeculativeError, match="point masses.*retrieval"):
        AcceptHeadDrafter.wrap(inner, params, AcceptHeadConfig(hidden=4, max_depth=8))
    with pytest.raises(ValueError, match="classes >= 0"):
        AcceptHeadConfig(classes=-1)


def test_train_a_head_over_the_datastore_then_decode(built, tmp_path):
    """train_accept_head(inner='retrieval') labels real runs of the shipped datastore's chains (its own
    cut off), greedy and point-mass sampled; the inputs are the match-length class one-hot; the saved
    head rebuilds over the datastore by name and greedy == plain greedy (batch 3, ragged)."""
    from jaxdecode.autoregressive import decode, pad_prompts
    from jaxdecode.drafters import load_drafter, make_drafter
    from jaxdecode.drafters.accept_head import AcceptHeadDrafter
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.speculative import speculative_decode
    from jaxdecode.training.accept_head import train_accept_head
    from jaxdecode.training.trainer import TrainConfig
    from jaxdecode.verifiers import get_verifier
    target, corpus, store = built
    classes = make_drafter("retrieval", target, drafter_dir=str(store)).confidence_classes
    assert classes > 0
    tc = TrainConfig(steps=40, learning_rate=1e-2, warmup_steps=5, log_every=20, eval_every=0,
                     checkpoint_every=0, progress=False, data_parallel=1)
    run = train_accept_head(target, None, corpus, tmp_path / "head", train_config=tc, k=4, prompts=16,
                            heldout=8, prompt_len=8, new_tokens=16, batch_rows=8, batch_size=64,
                            inner="retrieval", inner_dir=store, config_overrides={"hidden": 8, "max_depth": 8})
    assert run.cfg.classes == classes and run.train_data["x"].shape[1:] == (4, classes)
    assert np.allclose(run.train_data["x"].sum(-1), 1.0)  # one class per position
    assert set(run.report) == {"T=0", "T=0.7"}
    loaded = load_drafter(run.out_dir, target)
    assert loaded.cfg.inner == "retrieval" and loaded.cfg.classes == classes
    drafter = make_drafter("accept_head", target, drafter_dir=run.out_dir, inner_dir=str(store), threshold=0.5)
    assert isinstance(drafter, AcceptHeadDrafter) and drafter.num_nodes == 4 and drafter.inner.min_reach == 0
    ids = [target.tokenizer.encode(p) for p in ("def f(x):", "import os\n", "class A")]
    toks, lens = pad_prompts(ids)
    out = speculative_decode(target.config, target.params, drafter, toks, lens, max_new_tokens=24,
                             verifier=get_verifier("greedy"))
    ref = decode(target.config, target.params, toks, lens, max_new_tokens=24,
                 sampler=SamplerConfig(temperature=0.0), method="greedy").tokens
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref))
