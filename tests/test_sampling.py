"""Logits processors, sampling frequencies and Mirostat v2 rules (pure functions, no model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.sampling import (SamplerConfig, SamplerConfigError, first_argmax, mirostat_init, mirostat_step,
                                mirostat_truncate, mirostat_update, sample, token_presence,
                                validate_mirostat)
from jaxdecode.sampling import process_logits as _process_logits

# Jitted once per (config, shape): much faster than running the ops eagerly.
_process_jit = jax.jit(_process_logits, static_argnames="cfg")


def process_logits(logits, cfg, seen_mask=None):
    return _process_jit(jnp.asarray(logits, jnp.float32), cfg, seen_mask)

N_DRAWS = 200_000
P_THRESHOLD = 1e-4


def support(logprobs):
    return set(np.flatnonzero(np.isfinite(np.asarray(logprobs))).tolist())


def chi2_pvalue(tokens, probs):
    """Pearson chi-square p-value of the token counts against probs (zero-prob tokens must not occur)."""
    probs = np.asarray(probs, np.float64)
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=probs.size).astype(np.float64)
    if counts[probs == 0].sum() > 0:
        return 0.0
    n = counts.sum()
    nz = probs > 0
    stat = np.sum((counts[nz] - n * probs[nz]) ** 2 / (n * probs[nz]))
    return float(jax.scipy.stats.chi2.sf(stat, df=int(nz.sum()) - 1))


# ----------------------------------------------------------------------------- config validation
@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
])
def test_sampler_config_rejects_bad_values(kwargs, match):
    with pytest.raises(SamplerConfigError, match=match):
        SamplerConfig(**kwargs)


def test_sampler_config_is_hashable_and_static():
    assert hash(SamplerConfig(top_k=3)) == hash(SamplerConfig(top_k=3))
    assert SamplerConfig(temperature=0).is_greedy


def test_mirostat_parameters_validated():
    with pytest.raises(SamplerConfigError, match="mirostat_tau"):
        validate_mirostat(0.0, 0.1)
    with pytest.raises(SamplerConfigError, match="mirostat_eta"):
        validate_mirostat(5.0, -1.0)


# ----------------------------------------------------------------------------- supports
TIES = jnp.array([1.0, 3.0, 3.0, 2.0, 3.0, 0.0])


@pytest.mark.parametrize("k, expected", [(1, {1}), (2, {1, 2}), (3, {1, 2, 4}), (4, {1, 2, 3, 4}),
                                         (0, set(range(6))), (6, set(range(6))), (99, set(range(6)))])
def test_top_k_keeps_exactly_k_lower_ids_first_on_ties(k, expected):
    assert support(process_logits(TIES, SamplerConfig(top_k=k))) == expected


def test_top_k_renormalises_over_the_kept_tokens():
    lp = process_logits(TIES, SamplerConfig(top_k=2))
    np.testing.assert_allclose(np.exp(lp[jnp.array([1, 2])]), [0.5, 0.5], rtol=1e-6)


DYADIC = jnp.log(jnp.array([0.5, 0.25, 0.125, 0.0625, 0.0625]))


@pytest.mark.parametrize("top_p, expected", [
    (0.3, {0}), (0.5, {0}),  # 0.5 is reached exactly by the top token
    (0.51, {0, 1}), (0.75, {0, 1}),  # exact cumulative boundary: the smallest set reaching 0.75
    (0.76, {0, 1, 2}), (0.875, {0, 1, 2}), (0.9, {0, 1, 2, 3}), (1.0, set(range(5)))])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, expected):
    assert support(process_logits(DYADIC, SamplerConfig(top_p=top_p))) == expected


def test_top_p_ties_keep_lower_ids_and_always_one_token():
    uniform = jnp.zeros(4)
    assert support(process_logits(uniform, SamplerConfig(top_p=0.5))) == {0, 1}
    assert support(process_logits(uniform, SamplerConfig(top_p=0.01))) == {0}
    # Reordered ids: the mass order, not the id order, decides.
    shuffled = DYADIC[jnp.array([3, 1, 4, 0, 2])]
    assert support(process_logits(shuffled, SamplerConfig(top_p=0.75))) == {1, 3}


def test_top_p_applies_to_the_top_k_distribution():
    # Top-2 of DYADIC renormalises to (2/3, 1/3): top_p 0.6 then keeps only the first.
    assert support(process_logits(DYADIC, SamplerConfig(top_k=2, top_p=0.6))) == {0}
    assert support(process_logits(DYADIC, SamplerConfig(top_k=2, top_p=0.7))) == {0, 1}


def test_min_p_keeps_tokens_with_p_at_least_min_p_times_p_max():
    logits = jnp.array([0.0, np.log(0.25), np.log(0.2), np.log(0.5), -10.0], jnp.float32)
    assert support(process_logits(logits, SamplerConfig(min_p=0.25))) == {0, 1, 3}  # 0.25 exactly kept
    assert support(process_logits(logits, SamplerConfig(min_p=0.3))) == {0, 3}
    assert support(process_logits(logits, SamplerConfig(min_p=1.0))) == {0}
    # After temperature 2 the ratios are square-rooted: 0.2 -> 0.447 survives min_p 0.4.
    assert support(process_logits(logits, SamplerConfig(min_p=0.4, temperature=2.0))) == {0, 1, 2, 3}


def test_temperature_scales_logits_and_zero_is_greedy():
    logits = jnp.array([0.5, 2.0, -1.0, 2.0])
    np.testing.assert_allclose(process_logits(logits, SamplerConfig(temperature=0.5)),
                               jax.nn.log_softmax(logits / 0.5), rtol=1e-6)
    greedy = process_logits(logits, SamplerConfig(temperature=0.0, top_k=3, top_p=0.2))
    assert support(greedy) == {1} and float(greedy[1]) == 0.0  # first of the tied maxima


def test_repetition_penalty_ctrl_rule():
    logits = jnp.array([2.0, -2.0, 2.0, -2.0, 0.0])
    seen = jnp.array([True, True, False, False, True])
    lp = process_logits(logits, SamplerConfig(repetition_penalty=2.0), seen)
    expected = jax.nn.log_softmax(jnp.array([1.0, -4.0, 2.0, -2.0, 0.0]))
    np.testing.assert_allclose(lp, expected, rtol=1e-6)
    # Applied before temperature: the penalised logits are then divided by T.
    lp_t = process_logits(logits, SamplerConfig(repetition_penalty=2.0, temperature=0.5), seen)
    np.testing.assert_allclose(lp_t, jax.nn.log_softmax(jnp.array([2.0, -8.0, 4.0, -4.0, 0.0])),
                               rtol=1e-6)
    with pytest.raises(ValueError, match="seen_mask"):
        _process_logits(logits, SamplerConfig(repetition_penalty=2.0))


def test_token_presence_marks_valid_tokens_only():
    tokens = jnp.array([[1, 2, 7], [3, 3, 0]])
    valid = jnp.array([[True, True, False], [True, True, True]])
    got = np.asarray(token_presence(tokens, valid, 8))
    expected = np.zeros((2, 8), bool)
    expected[0, [1, 2]] = True
    expected[1, [0, 3]] = True
    np.testing.assert_array_equal(got, expected)


def test_process_logits_works_on_any_leading_dims():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 7)).astype(np.float32)
    seen = rng.random((2, 3, 7)) < 0.3
    cfg = SamplerConfig(temperature=0.8, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.3)
    batched = process_logits(logits, cfg, seen)
    for i in range(2):
        for j in range(3):
            np.testing.assert_allclose(batched[i, j], process_logits(logits[i, j], cfg, seen[i, j]),
                                       rtol=1e-6)


# ----------------------------------------------------------------------------- frequencies
FREQ_LOGITS = jnp.array([1.2, 0.9, 0.7, -0.3, 0.1, 1.0, -1.5, 0.4])
FREQ_SEEN = jnp.array([True, False, False, True, False, True, False, False])
FREQ_CFG = SamplerConfig(temperature=0.7, top_k=6, top_p=0.9, min_p=0.08, repetition_penalty=1.5)


@pytest.fixture(scope="module")
def freq_draws():
    processed = process_logits(FREQ_LOGITS, FREQ_CFG, FREQ_SEEN)
    draws = jax.jit(lambda k, lp: sample(k, jnp.broadcast_to(lp, (N_DRAWS, lp.shape[-1]))))
    return processed, draws


def test_sampled_frequencies_match_the_processed_distribution(freq_draws):
    processed, draws = freq_draws
    probs = np.exp(np.asarray(processed, np.float64))
    assert 2 <= np.count_nonzero(probs) < 8  # the truncation is active, yet leaves a choice
    tokens = draws(jax.random.key(123), processed)
    assert chi2_pvalue(tokens, probs) > P_THRESHOLD


def test_a_wrong_sampler_fails_the_frequency_test(freq_draws):
    processed, draws = freq_draws
    probs = np.exp(np.asarray(processed, np.float64))
    # Sampling the unprocessed distribution, or skipping only the repetition penalty, is caught.
    raw = draws(jax.random.key(123), jax.nn.log_softmax(FREQ_LOGITS))
    assert chi2_pvalue(raw, probs) < P_THRESHOLD
    no_penalty = process_logits(FREQ_LOGITS, FREQ_CFG.replace(repetition_penalty=1.0))
    assert chi2_pvalue(draws(jax.random.key(123), no_penalty), probs) < P_THRESHOLD


# ----------------------------------------------------------------------------- Mirostat v2
_truncate = jax.jit(mirostat_truncate)
MIRO = jnp.log(jnp.array([0.5, 0.25, 0.125, 0.0625, 0.0625]))  # surprises 1, 2, 3, 4, 4 bits


@pytest.mark.parametrize("mu, kept, probs", [
    (2.5, {0, 1}, [2 / 3, 1 / 3]), (3.5, {0, 1, 2}, [4 / 7, 2 / 7, 1 / 7]), (0.5, {0}, [1.0]),
    (-3.0, {0}, [1.0]), (10.0, set(range(5)), [0.5, 0.25, 0.125, 0.0625, 0.0625])])
def test_mirostat_truncation_rule(mu, kept, probs):
    lp = _truncate(MIRO, jnp.float32(mu))
    assert support(lp) == kept
    np.testing.assert_allclose(np.exp(lp[np.array(sorted(kept))]), probs, rtol=1e-5)


def test_mirostat_truncation_keeps_the_top_token_anywhere():
    lp = _truncate(MIRO[::-1][None], jnp.array([0.1]))
    assert support(lp[0]) == {4}


def test_mirostat_mu_update_uses_the_observed_surprise():
    assert float(mirostat_init(3, 5.0)[0]) == 10.0
    np.testing.assert_allclose(mirostat_update(jnp.float32(10.0), 7.0, 5.0, 0.1), 9.8, rtol=1e-6)
    mu = jnp.full((4096,), 2.5, jnp.float32)
    lp = jnp.broadcast_to(MIRO, (4096, 5))
    tokens, new_mu = jax.jit(mirostat_step)(jax.random.key(0), lp, mu, 3.0, 0.5)
    tokens = np.asarray(tokens)
    assert set(tokens.tolist()) == {0, 1}
    surprise = np.array([1.0, 2.0])[tokens]  # -log2 p under the untruncated distribution
    np.testing.assert_allclose(new_mu, 2.5 - 0.5 * (surprise - 3.0), rtol=1e-6)


def test_mirostat_sampled_frequencies_follow_the_truncated_distribution():
    mu = jnp.full((N_DRAWS,), 2.5, jnp.float32)
    step = jax.jit(mirostat_step)
    tokens, _ = step(jax.random.key(7), jnp.broadcast_to(MIRO, (N_DRAWS, 5)), mu, 3.0, 0.1)
    assert chi2_pvalue(tokens, [2 / 3, 1 / 3, 0, 0, 0]) > P_THRESHOLD
    # The untruncated distribution is rejected by the same test.
    assert chi2_pvalue(tokens, np.exp(np.asarray(MIRO))) < P_THRESHOLD
    assert chi2_pvalue(tokens, [0.6, 0.4, 0, 0, 0]) < P_THRESHOLD


# ----------------------------------------------------------------------------- truncation without a full sort
from jaxdecode.sampling import _truncation_mask, truncation_mask_sorted  # noqa: E402


def _primitives(jaxpr, skip_cond: bool) -> set:
    """Primitive names in a jaxpr and its sub-jaxprs (not inside lax.cond branches when skip_cond)."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if skip_cond and eqn.primitive.name == "cond":
            continue
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names |= _primitives(inner, skip_cond)
    return names


@pytest.mark.parametrize("cfg, always", [
    (SamplerConfig(top_k=50), True), (SamplerConfig(top_k=50, top_p=0.9), True),
    (SamplerConfig(top_p=0.9), False), (SamplerConfig(top_k=40, top_p=0.8, min_p=0.05), True)])
def test_truncation_does_not_sort_the_vocabulary(cfg, always):
    """top-k uses lax.top_k; top-p alone sorts V only in the fallback branch of a lax.cond (taken when the
    nucleus is wider than TOP_P_CAP tokens)."""
    for shape in ((4, 4096), (2, 9, 4096)):  # a decode step and a speculative [B, N+1, V] verification
        jaxpr = jax.make_jaxpr(lambda x: _process_logits(x, cfg))(jnp.zeros(shape, jnp.float32)).jaxpr
        assert "sort" not in _primitives(jaxpr, skip_cond=True)
        if always:
            assert "sort" not in _primitives(jaxpr, skip_cond=False)


def _truncation_cases():
    """Rows [R, V]: ties at every boundary, normal and peaked logits, exact dyadic masses, uniform rows and a
    constraint's -inf entries (one row with a single allowed token)."""
    rng = np.random.default_rng(11)
    v = 40
    ties = rng.integers(0, 4, (6, v)).astype(np.float32)
    normal = rng.normal(0, 2, (6, v)).astype(np.float32)
    dyadic = np.log(np.array([0.5, 0.25, 0.125, 0.0625] + [0.0625 / (v - 4)] * (v - 4), np.float32))
    dyadic = np.stack([dyadic, dyadic[::-1], np.roll(dyadic, 7), np.zeros(v, np.float32)])
    masked = np.where(rng.random((4, v)) < 0.7, -np.inf, normal[:4]).astype(np.float32)
    masked[0, 1:] = -np.inf
    return np.concatenate([ties, normal, normal * 4, dyadic, masked])


# (top_k, top_p, cap): the lax.top_k path, top-k >= V (top-p alone), and top-p alone with caps that make
# the capped branch, the full-sort fallback, or (cap >= V) no lax.cond at all serve the rows.
TRUNCATIONS = [(1, 1.0, 256), (3, 1.0, 256), (39, 1.0, 256), (3, 0.5, 256), (7, 0.75, 256), (12, 0.9, 256),
               (40, 0.6, 256), (99, 0.95, 4)]
TRUNCATIONS += [(0, p, cap) for p in (0.5, 0.75, 0.875, 0.999, 1e-3) for cap in (1, 4, 16, 256)]


@pytest.fixture(scope="module")
def truncations():
    """Every TRUNCATIONS mask of the cases, in one compiled function: whole batch (one lax.cond for all
    rows), row by row (vmap: each row takes its own branch), on a [B, N+1, V] block, and the reference."""
    x = _truncation_cases()

    def masks(x):
        out = {}
        for k, p, cap in TRUNCATIONS:
            out[k, p, cap] = (_truncation_mask(x, k, p, cap),
                              jax.vmap(lambda r: _truncation_mask(r, k, p, cap))(x),
                              _truncation_mask(x[:24].reshape(4, 6, -1), k, p, cap).reshape(24, -1),
                              truncation_mask_sorted(x, k, p))
        return out
    return jax.device_get(jax.jit(masks)(x))


@pytest.mark.parametrize("top_k, top_p, cap", TRUNCATIONS)
def test_truncation_equals_the_full_sort(truncations, top_k, top_p, cap):
    """The lax.top_k / capped-nucleus path keeps exactly the tokens the stable full sort keeps: ties by lower
    id, exact boundary masses, -inf entries; for top-p alone both the capped branch and its fallback."""
    batch, rows, spec, want = truncations[top_k, top_p, cap]
    np.testing.assert_array_equal(batch, want)
    np.testing.assert_array_equal(rows, want)
    np.testing.assert_array_equal(spec, want[:24])


def test_first_argmax_is_argmax():
    """The two-reduction argmax returns what jnp.argmax does: the first maximum (ties are common in
    low-precision logits), the first NaN when there is one, index 0 of an all -inf row, on 1-3-D input,
    float32 and bfloat16 (and int32 and bool), inside jit; a deliberately last-tie rule (argmax of the
    reversed row) differs."""
    rng = np.random.default_rng(0)
    cases = [rng.standard_normal((3, 4097)).astype(np.float32),
             rng.integers(-3, 3, (2, 9, 64)).astype(np.float32),  # many ties
             rng.integers(-2, 2, (5, 7)).astype(np.float32),
             np.full((2, 5), -np.inf, np.float32),
             np.array([[0.0, -0.0, 0.0], [-0.0, 0.0, -1.0]], np.float32),
             np.array([[1.0, np.nan, 3.0, np.nan], [np.inf, 2.0, np.inf, 0.0]], np.float32),
             rng.standard_normal(11).astype(np.float32)]
    for x in cases:
        for dt in (jnp.float32, jnp.bfloat16):
            xj = jnp.asarray(x, dt)
            got = jax.jit(first_argmax)(xj)
            assert got.dtype == jnp.int32 and got.shape == x.shape[:-1]
            np.testing.assert_array_equal(got, jnp.argmax(xj, axis=-1))
    for x in (rng.integers(-3, 3, (4, 33)).astype(np.int32), rng.random((3, 17)) < 0.2,
              np.zeros((2, 6), bool)):  # ints and bools (a drafter's allowed-token masks), all-False rows
        np.testing.assert_array_equal(jax.jit(first_argmax)(jnp.asarray(x)), jnp.argmax(x, axis=-1))
    ties = jnp.asarray(cases[1])
    last_tie = ties.shape[-1] - 1 - jnp.argmax(ties[..., ::-1], axis=-1)
    assert not np.array_equal(first_argmax(ties), last_tie)


def test_sample_is_the_gumbel_max_draw():
    """`sample` draws what jax.random.categorical draws for the same key (the Gumbel-max draw, its argmax
    by `first_argmax`) and never a -inf token; its frequencies are tested against the distribution (and a
    wrong sampler) by test_sampled_frequencies_match_the_processed_distribution and
    test_a_wrong_sampler_fails_the_frequency_test."""
    rng = np.random.default_rng(1)
    for shape in [(4097,), (3, 4097), (2, 5, 64)]:
        lp = jax.nn.log_softmax(jnp.asarray(rng.standard_normal(shape) * 3, jnp.float32))
        lp = lp.at[..., ::7].set(-jnp.inf)
        for seed in range(4):
            key = jax.random.PRNGKey(seed)
            got = jax.jit(sample)(key, lp)
            assert got.dtype == jnp.int32 and got.shape == shape[:-1]
            np.testing.assert_array_equal(got, jax.random.categorical(key, lp, axis=-1))
            np.testing.assert_array_equal(got, jnp.argmax(jax.random.gumbel(key, shape) + lp, axis=-1))
            assert not np.any(np.asarray(got) % 7 == 0)
