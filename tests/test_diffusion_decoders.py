"""Diffusion decoders (jaxdecode.diffusion) on tiny random models with an explicit MASK id."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxdecode.models import ModelConfig, init_params

import jaxdecode
from jaxdecode import diffusion as D
from jaxdecode.model import Model

MASK, EOS = 31, 5
ANSWER, BLOCK = 10, 4


def _config(**kw):
    base = {"model_type": "llama", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
            "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "max_position_embeddings": 64}
    try:
        return ModelConfig(**base, attention=kw.pop("attention", "bidirectional"), mask_token_id=MASK, **kw)
    except TypeError:  # a ModelConfig without the diffusion fields: the decoders take mask_id= explicitly
        return ModelConfig(**base)


CFG = _config()
# std 0.3 spreads the logits: greedy picks are not near-ties, confidences vary
PARAMS = init_params(CFG, jax.random.PRNGKey(0), std=0.3)
PROMPTS = jnp.array([[1, 2, 3, 4, 6], [7, 8, 0, 0, 0], [9, 10, 11, 12, 0]], jnp.int32)
LENGTHS = jnp.array([5, 2, 4], jnp.int32)
ANSWER_LENGTHS = jnp.array([10, 7, 9], jnp.int32)


def _run(rule=None, config=CFG, **kw):
    kw = {"answer_length": ANSWER, "block_length": BLOCK, "eos_ids": (EOS,), "mask_id": MASK,
          "answer_lengths": ANSWER_LENGTHS, **kw}
    return D.diffusion_decode(config, PARAMS, PROMPTS, LENGTHS, rule=rule, **kw)


@pytest.fixture(scope="module")
def greedy():
    return _run(D.Greedy1())


@pytest.fixture(scope="module")
def greedy_eos(greedy):
    """(eos, Greedy1 output) with an EOS id the model does produce (row 0's fourth token)."""
    eos = int(np.asarray(greedy.tokens)[0, 3])
    return eos, _run(D.Greedy1(), eos_ids=(eos,))


def _check_layout(out, eos=EOS):
    """Tokens after each row's length are padding; an EOS ends the row; no MASK is left."""
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    pad = eos
    for b in range(tokens.shape[0]):
        n = int(lengths[b])
        assert 1 <= n <= int(ANSWER_LENGTHS[b])
        assert (tokens[b, n:] == pad).all()
        assert MASK not in tokens[b, :n]
        eos_at = np.flatnonzero(tokens[b, :n] == eos)
        assert eos_at.size == 0 or eos_at[0] == n - 1
    assert not np.asarray(out.stats["unfinished"]).any()


def test_greedy1_one_token_per_forward_and_eos(greedy, greedy_eos):
    _check_layout(greedy)
    nfe, lengths = np.asarray(greedy.stats["nfe"]), np.asarray(greedy.lengths)
    assert (nfe >= lengths).all()  # one slot per forward (a slot after a later EOS is dropped)
    # an EOS the model commits ends the row: with EOS = a token greedy produces, rows end early
    tok, out = greedy_eos
    _check_layout(out, tok)
    t, n = np.asarray(out.tokens), np.asarray(out.lengths)
    assert int(n[0]) <= 4 and t[0, int(n[0]) - 1] == tok and (t[0, int(n[0]):] == tok).all()
    assert int(np.asarray(out.stats["nfe"])[0]) < int(np.asarray(greedy.stats["nfe"])[0])


def test_freedave_equals_greedy1(greedy, greedy_eos):
    eos, greedy_with_eos = greedy_eos
    for ref, eos_ids in ((greedy, (EOS,)), (greedy_with_eos, (eos,))):  # the second: rows end at EOS
        out = _run(D.FreeDave(draft=4), eos_ids=eos_ids)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
        np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
        nfe = np.asarray(out.stats["nfe"])
        assert (nfe <= np.asarray(ref.stats["nfe"]) + 1).all() and nfe.sum() < np.asarray(ref.stats["nfe"]).sum()


def test_threshold_one_and_llada_n1_reduce_to_greedy1(greedy):
    for rule in (D.Threshold(1.0), D.LLaDA(tokens_per_step=1)):
        out = _run(rule)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(greedy.tokens))
        np.testing.assert_array_equal(np.asarray(out.stats["nfe"]), np.asarray(greedy.stats["nfe"]))


def test_parallel_rules_commit_more_per_forward(greedy):
    out = _run(D.LLaDA(tokens_per_step=2))
    _check_layout(out)
    assert (np.asarray(out.stats["nfe"]) <= (np.asarray(greedy.stats["nfe"]) + 1) // 2 + 1).all()
    low = _run(D.Threshold(0.0))  # every eligible slot at once: one forward per block
    assert (np.asarray(low.stats["nfe"]) <= -(-ANSWER_LENGTHS // BLOCK)).all()


@pytest.mark.parametrize("names", [("llada", "random", "threshold", "factor", "credit", "localleap"),
                                   ("adablock", "ccd", "ete", "window", "r2", "dystruct", "eb", "infogain")])
def test_every_rule_runs_inside_a_user_jit(names):
    rules = [D.make_rule(n) for n in names]

    @jax.jit
    def run_all(prompts, lengths, key):
        outs = [D.diffusion_decode(CFG, PARAMS, prompts, lengths, answer_length=ANSWER, block_length=BLOCK,
                                   eos_ids=(EOS,), mask_id=MASK, rule=r, key=key, answer_lengths=ANSWER_LENGTHS)
                for r in rules]
        return [(o.tokens, o.lengths, o.stats) for o in outs]

    for tokens, lengths, stats in run_all(PROMPTS, LENGTHS, jax.random.PRNGKey(1)):
        _check_layout(D.DiffusionOutput(tokens, lengths, stats))


def test_learn2pd_filter_roundtrip_and_decode(tmp_path, greedy):
    params = D.init_filter(jax.random.PRNGKey(0), hidden=8)
    conf = jax.random.uniform(jax.random.PRNGKey(1), (2, 6))
    feats = D.filter_features(conf, jnp.array([[1, 0, 0, 1, 0, 0]] * 2, bool))
    assert feats.shape == (2, 6, D.FILTER_FEATURES) and feats.dtype == jnp.float32
    assert D.filter_apply(params, feats).shape == (2, 6)
    D.save_filter(tmp_path / "f", params, {"task": "copy"})
    loaded, meta = D.load_filter(tmp_path / "f")
    assert meta["task"] == "copy" and meta["hidden"] == 8
    for k in params:
        np.testing.assert_array_equal(np.asarray(loaded[k]), np.asarray(params[k]))
    with pytest.raises(D.DiffusionError, match="not a Learn2PD filter directory"):
        D.load_filter(tmp_path)
    # a filter that never fires is Greedy1 (top-1 per forward); EoTP off
    never = dict(loaded, b2=jnp.float32(-1e4))
    out = _run(D.Learn2PD(params=never, eot_threshold=1.0))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(greedy.tokens))
    # End-of-Text Prediction: a slot predicting EOS (any confidence at eot_threshold 0) commits with the
    # top-1 and ends the answer, so rows whose greedy output has that token stop earlier
    eos = int(np.asarray(greedy.tokens)[0, 3])  # as in greedy_eos
    plain = _run(D.Learn2PD(params=never, eot_threshold=1.0), eos_ids=(eos,))
    eot = _run(D.Learn2PD(params=never, eot_threshold=0.0), eos_ids=(eos,))
    _check_layout(eot, eos)
    assert (np.asarray(eot.stats["nfe"]) <= np.asarray(plain.stats["nfe"])).all()
    assert np.asarray(eot.stats["nfe"]).sum() < np.asarray(plain.stats["nfe"]).sum()


def test_fast_dllm_caches_run(greedy):
    for cache in ("prefix", "dual"):
        out = _run(D.Threshold(0.9), cache=cache)
        _check_layout(out)
        # the first forward of each block is a full refresh: the first committed slot matches greedy1's
        assert np.asarray(out.stats["nfe"]).min() >= 1


@pytest.mark.parametrize("shift", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_block_diffusion_cache_equals_recomputation(shift):
    cfg = _config(attention="block", block_size=BLOCK)
    params = init_params(cfg, jax.random.PRNGKey(2), std=0.3)
    kw = {"answer_length": ANSWER, "eos_ids": (EOS,), "mask_id": MASK, "logits_shift": shift,
          "answer_lengths": ANSWER_LENGTHS, "rule": D.Threshold(0.3)}
    cached = D.block_diffusion_decode(cfg, params, PROMPTS, LENGTHS, **kw)
    plain = D.block_diffusion_decode(cfg, params, PROMPTS, LENGTHS, use_cache=False, **kw)
    np.testing.assert_array_equal(np.asarray(cached.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(cached.lengths), np.asarray(plain.lengths))
    _check_layout(cached)


def test_bad_input_is_a_clear_error():
    with pytest.raises(D.DiffusionError, match="answer_length must be an int >= 1"):
        _run(answer_length=0)
    bad = PROMPTS.at[1, 1].set(MASK)
    with pytest.raises(D.DiffusionError, match="contains the MASK id"):
        D.diffusion_decode(CFG, PARAMS, bad, LENGTHS, answer_length=4, mask_id=MASK)
    with pytest.raises(D.DiffusionError, match="unknown diffusion rule"):
        D.make_rule("nope")
    with pytest.raises(D.DiffusionError, match="takes no parameter"):
        D.make_rule("llada", threshold=0.5)
    with pytest.raises(D.DiffusionError, match="block-diffusion model"):
        D.block_diffusion_decode(CFG, PARAMS, PROMPTS, LENGTHS, answer_length=4, mask_id=MASK)


def test_generate_checks_the_model_kind():
    dllm = Model(config=CFG, params=PARAMS)
    causal = Model(config=dataclasses.replace(CFG, attention="causal", mask_token_id=None), params=PARAMS)
    with pytest.raises(ValueError, match="causal LM"):
        jaxdecode.generate(causal, [[1, 2]], method="diffusion", max_new_tokens=4)
    with pytest.raises(ValueError, match="masked-diffusion LM"):
        jaxdecode.generate(dllm, [[1, 2]], method="greedy", max_new_tokens=4)
    out = jaxdecode.generate(dllm, [[1, 2, 3, 4, 6], [7, 8]], method="diffusion", max_new_tokens=ANSWER,
                             rule="freedave", rule_options={"draft": 3}, block_length=BLOCK, eos_ids=[EOS])
    ref = _run(D.Greedy1(), answer_lengths=None)
    for b in range(2):
        n = int(ref.lengths[b])
        assert out[b].tokens == [int(t) for t in np.asarray(ref.tokens)[b, :n]]
        assert out[b].stats["nfe"] >= 1 and out[b].stats["tokens_per_forward"] > 0


def test_generate_reports_unfinished_rows():
    """Rows that max_forwards leaves with MASK slots end with finish_reason 'unfinished' (not 'length')."""
    dllm = Model(config=CFG, params=PARAMS)
    prompts = [[1, 2, 3, 4, 6], [7, 8]]
    res = jaxdecode.generate(dllm, prompts, method="diffusion", max_new_tokens=ANSWER, max_forwards=2, eos_ids=[])
    for r in res:
        assert r.stats["unfinished"] and MASK in r.tokens
        assert r.finish_reason == "unfinished" and r.valid is None  # unconstrained: no validity to report
    done = jaxdecode.generate(dllm, prompts, method="diffusion", max_new_tokens=ANSWER, eos_ids=[])
    assert all(not r.stats["unfinished"] and r.finish_reason == "length" for r in done)


def test_answer_length_never_exceeds_max_new_tokens():
    dllm = Model(config=CFG, params=PARAMS)
    with pytest.raises(D.DiffusionError, match="answer_length=10 is more than max_new_tokens=4"):
        jaxdecode.generate(dllm, [[1, 2, 3]], method="diffusion", max_new_tokens=4, answer_length=10, eos_ids=[])
    # a shorter answer block that runs out (no EOS, no constraint) ended for length, not 'complete'
    r = jaxdecode.generate(dllm, [[1, 2, 3]], method="diffusion", max_new_tokens=10, answer_length=4, eos_ids=[])[0]
    assert len(r.tokens) == 4 and r.finish_reason == "length"
    r = jaxdecode.generate(dllm, [[1, 2, 3]], method="diffusion", max_new_tokens=4, answer_length=4, eos_ids=[])[0]
    assert len(r.tokens) == 4 and r.finish_reason == "length"


def test_block_diffusion_refuses_every_block_length_but_the_models():
    cfg = _config(attention="block", block_size=BLOCK)
    params = init_params(cfg, jax.random.PRNGKey(2), std=0.3)
    kw = {"answer_length": 8, "eos_ids": (EOS,), "mask_id": MASK}
    ref = D.block_diffusion_decode(cfg, params, PROMPTS, LENGTHS, **kw)
    for use_cache in (True, False):
        for bl in (2, 3, 5, 8, 12):
            with pytest.raises(D.DiffusionError, match=f"block_size \\({BLOCK}\\), got {bl}"):
                D.block_diffusion_decode(cfg, params, PROMPTS, LENGTHS, block_length=bl, use_cache=use_cache, **kw)
        out = D.block_diffusion_decode(cfg, params, PROMPTS, LENGTHS, block_length=BLOCK, use_cache=use_cache, **kw)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    with pytest.raises(D.DiffusionError, match="got 8"):
        D.diffusion_decode(cfg, params, PROMPTS, LENGTHS, block_length=8, cache="exact", **kw)
    # an answer shorter than one block: any block_length covering it is that one block
    short = dict(kw, answer_length=3)
    a = D.block_diffusion_decode(cfg, params, PROMPTS, LENGTHS, **short)
    b = D.block_diffusion_decode(cfg, params, PROMPTS, LENGTHS, block_length=3, **short)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    with pytest.raises(D.DiffusionError, match="got 2"):
        D.block_diffusion_decode(cfg, params, PROMPTS, LENGTHS, block_length=2, **short)
    bd = Model(config=cfg, params=params)
    with pytest.raises(D.DiffusionError, match="got 8"):
        jaxdecode.generate(bd, [[1, 2, 3]], method="block_diffusion", max_new_tokens=8, block_length=8)
