"""Grammar-aligned sampling (ASAp, jaxdecode.constraints.asap) on toys small enough to enumerate.

The toy: 6 tokens (0 = EOS, 1..4 = a b c d, 5 = x, never allowed; also the BOS), a hand-set LM whose
next-token logits depend on the position and the last token (it likes EOS and x, which the grammar
often forbids), and the language [ab][abcd]{0,4}[cd] (1364 strings). Masking then renormalising is
visibly biased there; the exact conditional p(x | x in L) is computed by enumeration.
"""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.constraints.asap import (COMPLETE, CUT_OFF, DEAD_END, AsapError, AsapTrie, PrefixFnLM, _round,
                                        asap_sample, run_asap)
from jaxdecode.constraints.automaton import TokenAutomaton, from_transitions
from jaxdecode.sampling import SamplerConfig

V, N, EOS, BOS = 6, 7, 0, 5
A, B, C, D, X = 1, 2, 3, 4, 5
KL_ALIGNED = 0.03  # KL(exact || proposal) below this: aligned. Masking's is ~0.7 on this toy.


def _language_automaton():
    """[ab][abcd]{0,4}[cd] as a token DFA: state (k letters after the first, last in {c, d})."""
    def st(k, f):
        return 1 + 2 * k + f
    tr = {0: {A: st(0, 0), B: st(0, 0)}, st(5, 1): {}}
    for k in range(5):
        for f in ((0,) if k == 0 else (0, 1)):
            tr[st(k, f)] = {t: st(k + 1, int(t in (C, D))) for t in (A, B, C, D) if k < 4 or t in (C, D)}
    return from_transitions(tr, 0, [st(k, 1) for k in range(1, 6)], V, drop_ids=(EOS,))


_rng = np.random.default_rng(0)
TABLE = _rng.normal(0.0, 1.5, (N + 1, V, V)).astype(np.float32)  # [position, last token, next token]
TABLE[:, :, EOS] += 2.0
TABLE[:, :, X] += 1.0
AUTO = _language_automaton()


# A second LM for the dead-end toy: it likes a (towards the cut-off) and c (a dead end).
TABLE_AC = TABLE.copy()
TABLE_AC[:, :, A] += 3.0
TABLE_AC[:, :, C] += 2.0


def _prefix_lm(table):
    def logits_fn(tokens, lengths):  # the jit-able prefix LM: tokens[B, T], lengths[B] -> logits[B, V]
        last = jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)[:, 0]
        return jnp.asarray(table)[lengths - 1, last]

    def logprobs_at(prefix):  # the same LM on the host, for one prefix of new tokens (after the BOS prompt)
        row = table[len(prefix), prefix[-1] if len(prefix) else BOS].astype(np.float64)
        return row - np.logaddexp.reduce(row)
    return logits_fn, logprobs_at


toy_logits, logprobs_at = _prefix_lm(TABLE)
toy_logits_ac, logprobs_at_ac = _prefix_lm(TABLE_AC)


def allowed_at(prefix, auto=AUTO):
    mask = np.zeros(V, bool)
    s = auto.walk(prefix)
    if s >= 0:
        mask[auto.allowed_tokens(s)] = True
        mask[EOS] = bool(auto.final[s])
    return mask


def enumerate_language(auto=AUTO, max_len=N):
    """Every token string of the language (EOS included) of at most max_len tokens."""
    out = []

    def walk(prefix):
        mask = allowed_at(prefix, auto)
        for t in np.flatnonzero(mask):
            if t == EOS:
                out.append(tuple(prefix) + (EOS,))
            elif len(prefix) + 2 <= max_len:
                walk(prefix + [int(t)])
    walk([])
    return out


def seq_logp(x, logprobs_at=logprobs_at):
    return sum(float(logprobs_at(list(x[:i]))[x[i]]) for i in range(len(x)))


LANG = enumerate_language()
LOGP = np.array([seq_logp(x) for x in LANG])
EXACT = np.exp(LOGP - np.logaddexp.reduce(LOGP))  # p(x | x in L)


def kl_to_exact(trie: AsapTrie, row: int = 0) -> float:
    """KL(p(. | L) || q) for the proposal q the trie defines for `row` (an empty trie: plain masking)."""
    lq = np.array([trie.proposal_log_prob(row, x, logprobs_at, allowed_at, (EOS,)) for x in LANG])
    return float(np.sum(EXACT * (np.log(EXACT) - lq)))


def toy_asap(num_samples, seed=1, auto=AUTO, max_new_tokens=N, lm=toy_logits, **kw):
    return asap_sample(lm, auto.constraint(), num_samples, np.full((1, 1), BOS),
                       max_new_tokens=max_new_tokens, eos_ids=(EOS,), vocab_size=V, seed=seed, **kw)


def test_the_toy_is_what_the_docstring_says():
    assert len(LANG) == 1364
    assert all(re.fullmatch("[ab][abcd]{0,4}[cd]", "".join(" abcd"[t] for t in x[:-1])) for x in LANG)


def test_kl_to_the_exact_conditional_falls_with_samples_while_masking_stays_biased():
    masking = kl_to_exact(AsapTrie(1))
    assert masking > 10 * KL_ALIGNED, masking  # the same check flags masking's bias ...
    kls = []
    for budget in (10, 300, 2000):
        out = toy_asap(budget)
        assert (out.status == COMPLETE).all()  # a trimmed automaton: every sample is in L
        kls.append(kl_to_exact(out.trie))
        # the estimate of P(L) is an upper bound that only falls
        assert np.all(np.diff(out.log_mass[0]) <= 1e-9) and out.log_mass[0, -1] >= np.logaddexp.reduce(LOGP) - 1e-6
    assert masking > kls[0] > kls[1] > kls[2], (masking, kls)
    assert kls[2] < KL_ALIGNED, kls  # ... and ASAp passes it
    # the returned estimate: each complete sample's probability under the final proposal is p(x) / mass
    d = out.distribution(0)
    x = next(iter(d))
    assert math.isclose(math.log(d[x]), out.trie.proposal_log_prob(0, x, logprobs_at, allowed_at, (EOS,)),
                        rel_tol=1e-4, abs_tol=1e-4)
    assert 0.9 < sum(d.values()) <= 1.0 + 1e-6


def test_rounds_of_several_samples_per_prompt_converge_too():
    """samples_per_round=8: 2000 samples in 250 rounds of 8 rows per prompt, two prompts (each with its own
    trie); the bound and the proposal still converge."""
    out = asap_sample(toy_logits, AUTO.constraint(), 2000, np.full((2, 1), BOS), max_new_tokens=N, eos_ids=(EOS,),
                      vocab_size=V, seed=3, samples_per_round=8)
    assert out.tokens.shape == (2, 2000, N) and (out.status == COMPLETE).all()
    assert np.all(np.diff(out.log_mass, axis=1) <= 1e-9)
    assert max(kl_to_exact(out.trie, row) for row in (0, 1)) < KL_ALIGNED


def _device_draws(trie, n_draws, seed=0):
    """n_draws samples of the proposal the trie defines, drawn by the device loop (all rows at root 0)."""
    arrays, width = trie.arrays()
    lm = PrefixFnLM(toy_logits, V, width=1 + N)
    toks, lens = jnp.full((n_draws, 1), BOS, jnp.int32), jnp.ones((n_draws,), jnp.int32)
    carry, logits = lm.start(toks, lens)
    c = AUTO.constraint().prepare(V, (EOS,), N, 1)
    tok, n, *_ = _round(lm, carry, logits, c, arrays, jax.random.PRNGKey(seed), max_new_tokens=N,
                        sampler=SamplerConfig(), eos_ids=(EOS,), width=width, per_prompt=n_draws)
    tok, n = np.asarray(tok), np.asarray(n)
    return [tuple(tok[i, :n[i]]) for i in range(n_draws)]


def _chi2_pvalue(draws, probs: dict):
    """Pearson chi-square of string counts against probs, strings expected < 5 times pooled into one bin."""
    n = len(draws)
    keys = list(probs)
    expected = np.array([probs[k] * n for k in keys])
    counts = {}
    for d in draws:
        counts[d] = counts.get(d, 0) + 1
    if any(d not in probs for d in counts):
        return 0.0
    obs = np.array([counts.get(k, 0) for k in keys], np.float64)
    big = expected >= 5
    obs = np.append(obs[big], obs[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    stat = float(np.sum((obs - expected) ** 2 / np.maximum(expected, 1e-300)))
    return float(jax.scipy.stats.chi2.sf(stat, df=obs.size - 1))


def test_device_rounds_draw_the_proposal_the_trie_defines():
    """The jit-compiled round samples exactly q(x) = prod p(x_i|w) EFG(w x_i) / EFG(w) (chi-square over
    1e5 draws of whole strings); plain masking's q, a deliberately wrong rule here, fails the same test."""
    trie = toy_asap(300).trie
    draws = _device_draws(trie, 100_000)
    q = {x: math.exp(trie.proposal_log_prob(0, x, logprobs_at, allowed_at, (EOS,))) for x in LANG}
    masking = {x: math.exp(AsapTrie(1).proposal_log_prob(0, x, logprobs_at, allowed_at, (EOS,))) for x in LANG}
    assert math.isclose(sum(q.values()), 1.0, abs_tol=1e-5)
    assert _chi2_pvalue(draws, q) > 1e-4
    assert _chi2_pvalue(draws, masking) < 1e-6


# ----------------------------------------------------------------------------- dead ends and cut-offs
def _over_approximating_automaton():
    """a* b, plus c: allowed but a dead end (a mask that over-approximates the language, as a grammar's
    lookahead or top-k truncation can). Built by hand: from_transitions trims dead states."""
    token_class = np.array([0, 1, 2, 3, 0, 0], np.int32)  # a, b, c: classes 1, 2, 3
    nxt = np.array([[-1, 0, 1, 2], [-1, -1, -1, -1], [-1, -1, -1, -1]], np.int32)  # [S, C]
    return TokenAutomaton(token_class=token_class, next=nxt, final=np.array([False, True, False]),
                          initial=np.array([0], np.int32))


def test_dead_ends_and_cut_offs_are_learned_and_the_mass_estimate_becomes_exact():
    auto = _over_approximating_automaton()
    n = 4  # a^k b EOS with k <= 2 fits; longer is cut off
    lang = enumerate_language(auto, max_len=n)
    assert len(lang) == 3
    exact_log_mass = np.logaddexp.reduce([seq_logp(x, logprobs_at_ac) for x in lang])
    out = toy_asap(60, auto=auto, max_new_tokens=n, lm=toy_logits_ac)
    st = out.status[0]
    assert (st[:20] != COMPLETE).any() and {DEAD_END, CUT_OFF} <= set(st.tolist())
    # every way out of the language is found once and then never sampled again
    assert (st[-20:] == COMPLETE).all()
    assert np.all(np.diff(out.log_mass[0]) <= 1e-9)
    assert abs(out.log_mass[0, -1] - exact_log_mass) < 1e-4
    for x, p in out.distribution(0).items():
        assert math.isclose(p, math.exp(seq_logp(x, logprobs_at_ac) - exact_log_mass), rel_tol=1e-3)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, match", [
    (dict(num_samples=0), "num_samples"),
    (dict(sampler=SamplerConfig(temperature=0.0)), "temperature 0"),
    (dict(sampler=SamplerConfig(repetition_penalty=1.2)), "repetition_penalty"),
    (dict(constraint=None), "needs a constraint"),
    (dict(vocab_size=None), "vocab_size"),
    (dict(samples_per_round=3), "dividing num_samples"),
])
def test_bad_input_is_refused_with_what_to_change(kwargs, match):
    args = dict(constraint=AUTO.constraint(), num_samples=4, vocab_size=V)
    args.update(kwargs)
    c, num, vs = args.pop("constraint"), args.pop("num_samples"), args.pop("vocab_size")
    with pytest.raises(AsapError, match=match):
        asap_sample(toy_logits, c, num, np.full((1, 1), BOS), max_new_tokens=N, eos_ids=(EOS,), vocab_size=vs,
                    **args)


# ----------------------------------------------------------------------------- a real model
def test_one_asap_run_on_the_embedded_model_matches_the_regex():
    import jaxdecode
    from jaxdecode.options import method_options
    model = jaxdecode.load()
    pattern = "[0-9]{1,3}"
    opts = {"regex": pattern, "eos_ids": (0,), "num_samples": 3, "seed": 0, "mesh": None, "cache_len": None}
    toks = np.asarray([model.encode("x = ")], np.int32)
    tokens, lengths, stats = run_asap(model, toks, np.asarray([toks.shape[1]], np.int32), 6, opts)
    text = model.decode(tokens[0, :lengths[0]], skip_special_tokens=False)
    assert stats["asap_valid"][0] and text.endswith("<|endoftext|>"), text
    assert re.fullmatch(pattern, text[: -len("<|endoftext|>")]), text
    assert stats["asap_samples"].shape == (1, 3, 6) and stats["asap_log_mass"][0] <= 0.0
    with pytest.raises(AsapError, match="regex="):
        run_asap(model, toks, np.asarray([toks.shape[1]], np.int32), 6, dict(opts, regex=None))
    assert {"num_samples", "regex"} <= set(method_options("asap"))
    out = jaxdecode.generate(model, ["x = "], method="asap", regex=pattern, num_samples=3, max_new_tokens=6, seed=0)
    assert out[0].text + "<|endoftext|>" == text and out[0].stats["asap_valid"]  # the text skips special tokens
