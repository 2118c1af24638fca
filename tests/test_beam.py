"""Beam search and Diverse Beam Search against exhaustive enumeration and a plain-Python reference."""
import itertools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.autoregressive import PromptError, pad_prompts
from jaxdecode.beam import BeamConfigError, _group_step, beam_search
from jaxdecode.models import ModelConfig, forward, padded_causal_mask
from test_autoregressive import random_params

PROMPTS = [[1, 2, 3, 1], [4]]
REF_ROWS, REF_WIDTH = 256, 12  # one compiled shape for every reference forward


def tiny(vocab):
    return ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=16, intermediate_size=32,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                       max_position_embeddings=64)


@partial(jax.jit, static_argnums=0)
def _all_logprobs(config, params, tokens, lengths):
    """Cache-free log-probs [R, W, V] of right-padded rows (padding never changes valid positions)."""
    r, w = tokens.shape
    mask = padded_causal_mask(jnp.arange(w)[None, :] < lengths[:, None])
    logits, _, _ = forward(config, params, tokens, jnp.broadcast_to(jnp.arange(w), (r, w)), None, mask)
    return jax.nn.log_softmax(logits, axis=-1)


def next_logprobs(config, params, prompt, continuations):
    """np [len(continuations), V]: log-probs of the next token after prompt + each continuation."""
    out = []
    for start in range(0, len(continuations), REF_ROWS):
        chunk = continuations[start:start + REF_ROWS]
        tokens = np.zeros((REF_ROWS, REF_WIDTH), np.int32)
        lengths = np.ones((REF_ROWS,), np.int32)
        for i, c in enumerate(chunk):
            seq = list(prompt) + list(c)
            tokens[i, :len(seq)] = seq
            lengths[i] = len(seq)
        lp = np.asarray(_all_logprobs(config, params, jnp.asarray(tokens), jnp.asarray(lengths)))
        out.append(lp[np.arange(len(chunk)), lengths[:len(chunk)] - 1])
    return np.concatenate(out)


def reference_beam_search(score, vocab, n, k, groups=1, length_penalty=1.0, eos=(), diversity=0.0,
                          early_stopping="never"):
    """The documented rule in plain Python for one prompt. score(list of tuples) -> [len, V].

    Returns (hypotheses [(score, tokens)] best first, number of forwards used)."""
    kg = k // groups
    state = [dict(run=[((), 0.0)], fin=[], done=False) for _ in range(groups)]
    calls = 0
    for t in range(n):
        if all(g["done"] for g in state):
            break
        calls += 1
        seqs = sorted({seq for g in state if not g["done"] for seq, _ in g["run"]})
        table = dict(zip(seqs, score(seqs)))
        counts = np.zeros(vocab)
        for g in state:
            if g["done"]:
                continue
            cands = sorted(((s + table[seq][v] - diversity * counts[v], b, v)
                            for b, (seq, s) in enumerate(g["run"]) for v in range(vocab)),
                           key=lambda c: (-c[0], c[1], c[2]))
            for s, b, v in cands[:kg]:
                if v in eos or t == n - 1:
                    g["fin"].append((s / (t + 1) ** length_penalty, g["run"][b][0] + (v,)))
            g["fin"] = sorted(g["fin"], key=lambda f: -f[0])[:kg]
            g["run"] = [(g["run"][b][0] + (v,), s) for s, b, v in cands if v not in eos][:kg]
            for seq, _ in g["run"]:
                counts[seq[-1]] += 1
            best_len = {"never": n if length_penalty > 0 else t + 2, False: t + 1, True: 1}[early_stopping]
            bound = max((s for _, s in g["run"]), default=-np.inf) / float(best_len) ** length_penalty
            bound = -np.inf if early_stopping is True else bound
            full = len(g["fin"]) == kg
            g["done"] = t == n - 1 or (full and min(f[0] for f in g["fin"]) >= bound)
    hyps = sorted((f for g in state for f in g["fin"]), key=lambda f: -f[0])
    return hyps, calls


def assert_matches_reference(out, row, hyps, calls=None, pad=0):
    k = out.tokens.shape[1]
    assert len(hyps) == k
    for j, (s, seq) in enumerate(hyps):
        length = int(out.lengths[row, j])
        assert np.asarray(out.tokens[row, j, :length]).tolist() == list(seq), f"row {row} beam {j}"
        assert (np.asarray(out.tokens[row, j, length:]) == pad).all()
        np.testing.assert_allclose(float(out.scores[row, j]), s, rtol=1e-4, atol=1e-5)
    if calls is not None:
        assert int(out.stats["target_calls"]) == calls


# ----------------------------------------------------------------------------- exhaustive
def test_beam_search_without_pruning_equals_exhaustive_search():
    config = tiny(5)
    params = random_params(config, seed=1)
    n, k, lp = 3, 25, 1.5  # 25 = V^(N-1): every prefix survives, the last step picks the top 25
    tokens, lengths = pad_prompts(PROMPTS)
    out = beam_search(config, params, tokens, lengths, max_new_tokens=n, num_beams=k,
                      length_penalty=lp)
    conts = list(itertools.product(range(5), repeat=n))
    for row, prompt in enumerate(PROMPTS):
        prefixes = sorted({c[:i] for c in conts for i in range(n)})
        table = dict(zip(prefixes, next_logprobs(config, params, prompt, prefixes)))
        total = np.array([sum(table[c[:i]][c[i]] for i in range(n)) for c in conts])
        best = np.argsort(-total, kind="stable")[:k]
        hyps = [(total[i] / n ** lp, conts[i]) for i in best]
        assert_matches_reference(out, row, hyps, calls=n)
    np.testing.assert_array_equal(out.lengths, n)


# ----------------------------------------------------------------------------- reference, EOS
VOCAB, N_NEW = 6, 5


@pytest.fixture(scope="module")
def model6():
    config = tiny(VOCAB)
    return config, random_params(config, seed=2)


CASES = {
    "plain": dict(num_beams=3, length_penalty=1.0, eos_ids=(2,)),
    "negative_lp_two_eos": dict(num_beams=3, length_penalty=-0.5, eos_ids=(2, 5)),
    "diverse": dict(num_beams=4, num_groups=2, diversity_penalty=1.5, length_penalty=2.0,
                    eos_ids=(2,)),
    "heuristic_stop": dict(num_beams=3, length_penalty=1.0, eos_ids=(2, 5), early_stopping=False),
    "diverse_stop_when_full": dict(num_beams=4, num_groups=2, diversity_penalty=1.5, length_penalty=2.0,
                                   eos_ids=(2,), early_stopping=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_beam_search_matches_the_python_reference(model6, case):
    config, params = model6
    kw = CASES[case]
    tokens, lengths = pad_prompts(PROMPTS)
    out = beam_search(config, params, tokens, lengths, max_new_tokens=N_NEW, **kw)
    calls = []
    for row, prompt in enumerate(PROMPTS):
        hyps, c = reference_beam_search(
            partial(next_logprobs, config, params, prompt), VOCAB, N_NEW, kw["num_beams"],
            groups=kw.get("num_groups", 1), length_penalty=kw["length_penalty"], eos=kw["eos_ids"],
            diversity=kw.get("diversity_penalty", 0.0), early_stopping=kw.get("early_stopping", "never"))
        assert_matches_reference(out, row, hyps, pad=kw["eos_ids"][0])
        calls.append(c)
    # One batched forward per step until the last row is done.
    assert int(out.stats["target_calls"]) == max(calls)
    # The EOS path is exercised: some hypotheses end early.
    assert (np.asarray(out.lengths) < N_NEW).any()
    if case == "negative_lp_two_eos":
        assert max(calls) < N_NEW  # every row stopped early on the exact bound
    if case == "diverse":
        for row in range(len(PROMPTS)):
            seqs = {tuple(np.asarray(out.tokens[row, j, :int(out.lengths[row, j])]).tolist())
                    for j in range(4)}
            assert len(seqs) == 4  # the groups found different hypotheses


def test_diverse_beam_without_penalty_repeats_the_narrow_beam_search(model6):
    """diversity_penalty=0: each of the G groups is the same width-K/G beam search, so the output is
    that search's hypotheses, each repeated G times (best first)."""
    config, params = model6
    tokens, lengths = pad_prompts(PROMPTS)
    kw = dict(max_new_tokens=N_NEW, eos_ids=(2,), length_penalty=1.0)
    groups = beam_search(config, params, tokens, lengths, num_beams=6, num_groups=3,
                         diversity_penalty=0.0, **kw)
    narrow = beam_search(config, params, tokens, lengths, num_beams=2, **kw)
    np.testing.assert_array_equal(groups.tokens, np.repeat(narrow.tokens, 3, axis=1))
    np.testing.assert_array_equal(groups.lengths, np.repeat(narrow.lengths, 3, axis=1))
    np.testing.assert_array_equal(groups.scores, np.repeat(narrow.scores, 3, axis=1))
    assert int(groups.stats["target_calls"]) == int(narrow.stats["target_calls"])


# ----------------------------------------------------------------------------- one step, by hand
def one_step(logprobs, t=0, n=4, done=False, fin_scores=(-np.inf, -np.inf)):
    """Run the group step on hand-made log-probs of one row, two beams (beam 1 not yet live)."""
    kg = 2
    group = dict(logprobs=jnp.asarray([logprobs, logprobs], jnp.float32)[None],
                 run_tokens=jnp.zeros((1, kg, n), jnp.int32),
                 run_scores=jnp.asarray([[0.0, -jnp.inf]]),
                 fin_tokens=jnp.zeros((1, kg, n), jnp.int32),
                 fin_scores=jnp.asarray([fin_scores], jnp.float32),
                 fin_lengths=jnp.ones((1, kg), jnp.int32), done=jnp.asarray([done]))
    _, out, parent = _group_step(jnp.int32(t), jnp.zeros((1, len(logprobs))), group, max_new_tokens=n,
                                 length_penalty=1.0, diversity_penalty=0.0, eos_ids=(2,))
    return out, parent


def test_eos_candidates_finish_only_within_the_best_k():
    # EOS (id 2) ranks third of the step's candidates: it is neither finished nor kept running.
    out, parent = one_step(np.log([0.5, 0.3, 0.2]))
    assert np.isneginf(np.asarray(out["fin_scores"])).all()
    np.testing.assert_array_equal(out["run_tokens"][0, :, 0], [0, 1])
    np.testing.assert_array_equal(parent[0], [0, 0])
    # EOS ranks first: it finishes with score logprob / 1, and the next two candidates run on.
    out, _ = one_step(np.log([0.3, 0.2, 0.5]), t=1)
    np.testing.assert_allclose(out["fin_scores"][0], [np.log(0.5) / 2, -np.inf], rtol=1e-6)
    np.testing.assert_array_equal(out["fin_lengths"][0, 0], 2)
    np.testing.assert_array_equal(out["run_tokens"][0, :, 1], [0, 1])
    assert not bool(out["done"][0])  # buffer not full yet
    # At the last step the best K candidates all finish, and the row is done.
    out, _ = one_step(np.log([0.5, 0.3, 0.2]), t=3)
    np.testing.assert_allclose(out["fin_scores"][0], np.log([0.5, 0.3]) / 4, rtol=1e-6)
    assert bool(out["done"][0])
    # A full buffer that no running beam can beat (bound: log 0.5 / 4 steps) stops the row.
    out, _ = one_step(np.log([0.5, 0.3, 0.2]), fin_scores=(-0.1, -0.15))
    assert bool(out["done"][0])
    out, _ = one_step(np.log([0.5, 0.3, 0.2]), fin_scores=(-0.1, -0.2))
    assert not bool(out["done"][0])


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, err, match", [
    (dict(num_beams=4, num_groups=3), BeamConfigError, "multiple of num_groups"),
    (dict(num_beams=0), BeamConfigError, "num_beams must be an int >= 1"),
    (dict(num_beams=2, num_groups=2, diversity_penalty=-1.0), BeamConfigError, "diversity_penalty"),
    (dict(num_beams=2, length_penalty=float("inf")), BeamConfigError, "length_penalty"),
    (dict(num_beams=40, max_new_tokens=2), BeamConfigError, "possible continuations"),
    (dict(num_beams=2, eos_ids=(6,)), PromptError, "eos_ids"),
])
def test_bad_beam_options_raise_clear_errors(kwargs, err, match):
    tokens, lengths = pad_prompts(PROMPTS)
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(err, match=match):
        beam_search(tiny(VOCAB), None, tokens, lengths, **kwargs)


def test_beam_search_validates_prompts():
    with pytest.raises(PromptError, match="empty prompt"):
        beam_search(tiny(VOCAB), None, *pad_prompts([[1], []]), max_new_tokens=3, num_beams=2)
