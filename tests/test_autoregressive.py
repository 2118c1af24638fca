"""Autoregressive decode: greedy parity with transformers, EOS per row, sampling plumbing, Mirostat,
and host-side input validation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jd_testutil import make_hf_model
from jaxdecode.autoregressive import (PromptError, decode, default_cache_len, pad_prompts, prefill,
                                      validate_prompts)
from jaxdecode.models import (ModelConfig, forward, init_cache, load_params, padded_causal_mask,
                              param_shapes)
from jaxdecode.sampling import SamplerConfig, mirostat_truncate, process_logits, token_presence
from test_sampling import P_THRESHOLD, chi2_pvalue

N_NEW = 8


def random_params(config, seed: int = 0, std: float = 0.5):
    """Random weights (unit norm scales) drawn with numpy: much cheaper than compiling init_params."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        if "scale" in jax.tree_util.keystr(path):
            return jnp.ones(shape, jnp.float32)
        return jnp.asarray(rng.normal(0.0, std, shape), jnp.float32)
    return jax.tree_util.tree_map_with_path(leaf, param_shapes(config),
                                            is_leaf=lambda x: isinstance(x, tuple))
PROMPT_LENS = (5, 2, 7)
# Norm scales that are not all ones (Qwen3's per-head query/key norms, Gemma's), a head_dim of Qwen3's
# own, Gemma 3's sliding-window layer (its own RoPE base) beside a full one and its query scale, a SmolLM3
# layer without RoPE beside one with YaRN
FAMILY_OVERRIDES = {"qwen3": dict(head_dim=16, random_norms=True), "gemma": dict(random_norms=True),
                    "smollm3": dict(no_rope_layers=[1, 0], rope_parameters={
                        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 6,
                        "rope_theta": 100.0}),
                    "gemma2": dict(random_norms=True, sliding_window=4, attn_logit_softcapping=1.5,
                                   final_logit_softcapping=2.0),
                    "gemma3_text": dict(random_norms=True, sliding_window=4, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "full_attention"]),
                    "qwen3_moe": dict(norm_topk_prob=True),
                    # a partial rotary factor, LongRoPE short of its switch (64), a window over every layer, tied
                    "phi3": dict(random_norms=True, partial_rotary_factor=0.75, sliding_window=4,
                                 tie_word_embeddings=True, original_max_position_embeddings=64, rope_parameters={
                                     "rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0],
                                     "long_factor": [3.0, 4.0, 5.0], "rope_theta": 10000.0}),
                    "olmo2": dict(random_norms=True),
                    "olmo3": dict(random_norms=True, sliding_window=4,
                                  layer_types=["sliding_attention", "full_attention"]),
                    "granite": dict(random_norms=True, embedding_multiplier=3.0, residual_multiplier=0.3,
                                    attention_multiplier=0.2, logits_scaling=2.5),
                    # the shared expert, q/k/v biases, a window on layer 0 (transformers 5's default layer_types)
                    "qwen2_moe": dict(random_biases=True, use_sliding_window=True, sliding_window=4,
                                      max_window_layers=1),
                    "olmoe": dict(random_norms=True, norm_topk_prob=True, clip_qkv=0.5),
                    # per-head query / key LayerNorms and biases (interleaved RoPE, permuted on load), a logit_scale
                    "cohere": dict(random_norms=True, random_biases=True, use_qk_norm=True, attention_bias=True,
                                   logit_scale=0.5),
                    # a sliding layer with RoPE beside a full one without, a window shorter than the decode
                    "cohere2": dict(random_norms=True, sliding_window=4, logit_scale=0.5,
                                    layer_types=["sliding_attention", "full_attention"]),
                    "granitemoe": dict(random_norms=True, random_biases=True, attention_bias=True,
                                       embedding_multiplier=3.0, residual_multiplier=0.3, attention_multiplier=0.2,
                                       logits_scaling=2.5),
                    "granitemoeshared": dict(random_norms=True, embedding_multiplier=3.0, residual_multiplier=0.3,
                                             attention_multiplier=0.2, logits_scaling=2.5),
                    # LayerNorms, every bias, sparsemixer keeping several experts, a window over every layer,
                    # LongRoPE short of its switch (64) with its short_mscale
                    "phimoe": dict(random_norms=True, random_biases=True, attention_bias=True, lm_head_bias=True,
                                   router_jitter_noise=0.3, sliding_window=4, rope_parameters={
                                       "rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                                       "long_factor": [2.0, 4.0, 6.0, 8.0], "short_mscale": 1.2, "long_mscale": 1.5,
                                       "original_max_position_embeddings": 64, "rope_theta": 10000.0})}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """kind -> (transformers model, jaxdecode config, params) of a tiny random checkpoint, built once."""
    built = {}

    def get(kind):
        if kind not in built:
            hf = make_hf_model(kind, **FAMILY_OVERRIDES.get(kind, {}))
            hf.generation_config.eos_token_id = None  # never stop early: compare N_NEW tokens
            path = tmp_path_factory.mktemp(f"ar_{kind}")
            hf.save_pretrained(str(path))
            built[kind] = (hf, *load_params(path))
        return built[kind]
    return get


@pytest.fixture(scope="module")
def llama(hf_models):
    return hf_models("llama")[1:]


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(1, 320, n).tolist() for n in PROMPT_LENS]


def hf_greedy(hf, prompt, n, **kw):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                          pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen3", "smollm3", "gemma", "gemma2", "gemma3_text", "mixtral",
                                  "qwen3_moe", "phi3", "olmo2", "olmo3", "granite", "qwen2_moe", "olmoe", "cohere",
                                  "cohere2", "granitemoe", "granitemoeshared", "phimoe"])
def test_greedy_matches_transformers_for_a_ragged_batch(hf_models, kind, prompts):
    hf, config, params = hf_models(kind)
    tokens, lengths = pad_prompts(prompts)
    out = decode(config, params, tokens, lengths, max_new_tokens=N_NEW, method="greedy")
    for i, p in enumerate(prompts):
        assert np.asarray(out.tokens[i]).tolist() == hf_greedy(hf, p, N_NEW), f"row {i}"
    np.testing.assert_array_equal(out.lengths, [N_NEW] * 3)
    assert int(out.stats["target_calls"]) == N_NEW  # prefill + N - 1 steps


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "gemma3_text", "qwen3_moe", "phi3", "olmo2", "granite",
                                  "qwen2_moe", "olmoe", "cohere", "cohere2", "granitemoe", "granitemoeshared",
                                  "phimoe"])
def test_speculative_decoding_equals_greedy_on_newer_families(tmp_path, prompts, kind):
    """A Qwen3 / Gemma 2 / Gemma 3 / Qwen3-MoE checkpoint through the public API: speculative decoding with a
    draft model of its family (a 1-layer one of other weights, whose drafts are mostly rejected, and the target itself,
    whose drafts are all accepted) gives plain greedy's tokens: a tree verified through the tree-attention
    op with the family's query/key norms, query scale, soft-capped scores and per-layer RoPE, and (MoE) the
    tree's tokens routed to their experts together."""
    import jaxdecode
    from jd_testutil import make_checkpoint
    target = jaxdecode.load(make_checkpoint(kind, tmp_path / "target", **FAMILY_OVERRIDES[kind]))
    draft = jaxdecode.load(make_checkpoint(kind, tmp_path / "draft", seed=1, num_hidden_layers=1,
                                           **{**FAMILY_OVERRIDES[kind], "layer_types": ["full_attention"]}))
    want = [g.tokens for g in jaxdecode.generate(target, prompts, method="greedy", max_new_tokens=N_NEW,
                                                 eos_ids=[])]
    for d in (draft, target):
        out = jaxdecode.generate(target, prompts, method="speculative", draft=d, tree="eagle:depth=3,topk=2",
                                 max_new_tokens=N_NEW, eos_ids=[], adaptive=False)
        assert [g.tokens for g in out] == want
    assert out[0].batch_stats["target_calls"] < N_NEW  # the target's own drafts were accepted


def test_longrope_past_its_switch_matches_transformers(tmp_path):
    """Prompts longer than original_max_position_embeddings (4) + 1: transformers' Phi-3 takes the long factors in
    every forward, and so does jaxdecode: greedy equals generate, speculative decoding equals greedy. A decode that
    would cross the switch (transformers recomputes the cache there) is refused by name."""
    import jaxdecode
    from jd_testutil import make_checkpoint
    over = dict(FAMILY_OVERRIDES["phi3"], original_max_position_embeddings=4)
    path = make_checkpoint("phi3", tmp_path / "phi3", **over)
    hf = make_hf_model("phi3", **over)
    model = jaxdecode.load(path)
    rng = np.random.default_rng(1)
    long_prompts = [rng.integers(1, 320, n).tolist() for n in (6, 7, 8)]
    want = [hf_greedy(hf, p, N_NEW) for p in long_prompts]
    assert [g.tokens for g in jaxdecode.generate(model, long_prompts, method="greedy", max_new_tokens=N_NEW,
                                                 eos_ids=[])] == want
    out = jaxdecode.generate(model, long_prompts, method="speculative", draft=model, tree="eagle:depth=3,topk=2",
                             max_new_tokens=N_NEW, eos_ids=[], adaptive=False)
    assert [g.tokens for g in out] == want
    with pytest.raises(PromptError, match=r"row 1's prompt \(2 tokens\) \+ max_new_tokens \(8\) crosses position 4 "
                                          r"\(original_max_position_embeddings\), where this model's LongRoPE"):
        jaxdecode.generate(model, [long_prompts[0], [1, 2]], method="greedy", max_new_tokens=N_NEW, eos_ids=[])
    # a short decode stays on the short factors, as transformers' does
    assert jaxdecode.generate(model, [[3, 4]], method="greedy", max_new_tokens=3, eos_ids=[])[0].tokens == \
        hf_greedy(hf, [3, 4], 3)


def test_phimoe_longrope_past_its_switch_matches_the_reference(tmp_path):
    """Prompts past original_max_position_embeddings (4) + 1: Phi-3.5-MoE's long factors and long_mscale in every
    forward (transformers' model with the factors chosen by length, jd_testutil.phimoe_rope_by_length): greedy
    equals its generate, speculative decoding equals greedy, a decode crossing the switch is refused."""
    import jaxdecode
    from jd_testutil import make_checkpoint, phimoe_rope_by_length
    over = dict(FAMILY_OVERRIDES["phimoe"])
    over["rope_parameters"] = dict(over["rope_parameters"], original_max_position_embeddings=4)
    model = jaxdecode.load(make_checkpoint("phimoe", tmp_path / "phimoe", **over))
    hf = phimoe_rope_by_length(make_hf_model("phimoe", **over))
    rng = np.random.default_rng(1)
    long_prompts = [rng.integers(1, 320, n).tolist() for n in (6, 7, 8)]
    want = [hf_greedy(hf, p, N_NEW) for p in long_prompts]
    for method, kw in (("greedy", {}), ("speculative", dict(draft=model, tree="eagle:depth=3,topk=2", adaptive=False))):
        out = jaxdecode.generate(model, long_prompts, method=method, max_new_tokens=N_NEW, eos_ids=[], **kw)
        assert [g.tokens for g in out] == want, method
    with pytest.raises(PromptError, match=r"row 1's prompt \(2 tokens\) \+ max_new_tokens \(8\) crosses position 4"):
        jaxdecode.generate(model, [long_prompts[0], [1, 2]], method="greedy", max_new_tokens=N_NEW, eos_ids=[])


def test_greedy_with_repetition_penalty_matches_transformers(hf_models, prompts):
    hf, config, params = hf_models("llama")
    tokens, lengths = pad_prompts(prompts)
    out = decode(config, params, tokens, lengths, max_new_tokens=N_NEW, method="greedy",
                 sampler=SamplerConfig(repetition_penalty=1.5))
    for i, p in enumerate(prompts):
        assert np.asarray(out.tokens[i]).tolist() == hf_greedy(hf, p, N_NEW, repetition_penalty=1.5)


# ----------------------------------------------------------------------------- EOS, ragged rows
def test_rows_stop_independently_at_eos_and_match_decoding_alone(llama, prompts):
    config, params = llama
    tokens, lengths = pad_prompts(prompts)
    free = np.asarray(decode(config, params, tokens, lengths, max_new_tokens=N_NEW,
                             method="greedy").tokens)
    # EOS ids that each row meets at a different step: every row must stop at its first one.
    eos_ids = (int(free[0, 2]), int(free[1, 4]), int(free[2, 1]))
    expected = [int(np.flatnonzero(np.isin(row, eos_ids))[0]) + 1 for row in free]
    assert len(set(expected)) > 1 and max(expected) < N_NEW
    out = decode(config, params, tokens, lengths, max_new_tokens=N_NEW, method="greedy",
                 eos_ids=eos_ids)
    got = np.asarray(out.tokens)
    np.testing.assert_array_equal(out.lengths, expected)
    for i, n in enumerate(expected):
        np.testing.assert_array_equal(got[i, :n], free[i, :n])
        assert (got[i, n:] == eos_ids[0]).all()  # pad id = eos_ids[0]
        # The same row decoded alone (same padded width, so one compilation serves all rows).
        alone = decode(config, params, tokens[i:i + 1], lengths[i:i + 1], max_new_tokens=N_NEW,
                       method="greedy", eos_ids=eos_ids)
        np.testing.assert_array_equal(alone.tokens[0], got[i])
        assert int(alone.lengths[0]) == n
        assert int(alone.stats["target_calls"]) == n
    # The loop ends once every row has stopped: one forward per emitted column.
    assert int(out.stats["target_calls"]) == max(expected)


def test_sampling_with_top_k_1_is_greedy_and_decode_is_jittable(llama, prompts):
    config, params = llama
    tokens, lengths = pad_prompts(prompts)
    greedy = decode(config, params, tokens, lengths, max_new_tokens=N_NEW, method="greedy")
    top1 = decode(config, params, tokens, lengths, max_new_tokens=N_NEW, method="sample",
                  sampler=SamplerConfig(top_k=1, temperature=1.3), key=jax.random.key(3))
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)
    # Called inside a user's jit: validation keeps to the shape checks, the result is the same.
    jitted = jax.jit(lambda p, t, l: decode(config, p, t, l, max_new_tokens=N_NEW, method="greedy"))
    np.testing.assert_array_equal(jitted(params, jnp.asarray(tokens), jnp.asarray(lengths)).tokens,
                                  greedy.tokens)


def test_prefill_commits_each_row_and_returns_its_last_logits(llama, prompts):
    config, params = llama
    tokens, lengths = pad_prompts(prompts)
    t, l = jnp.asarray(tokens), jnp.asarray(lengths)
    last, cache = jax.jit(prefill, static_argnums=0)(config, params, t, l, init_cache(config, 3, 16))
    np.testing.assert_array_equal(cache.lengths, lengths)
    # Reference: the cache-free forward; right padding never changes a row's valid logits.
    ref, _, _ = forward(config, params, t, jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape), None,
                        padded_causal_mask(jnp.arange(t.shape[1])[None, :] < l[:, None]))
    np.testing.assert_allclose(last, ref[jnp.arange(3), l - 1], atol=1e-5)
    # The LM head runs at each row's last token only: no [B, P, V] logits in the compiled prefill.
    hlo = jax.jit(prefill, static_argnums=0).lower(config, params, t, l, init_cache(config, 3, 16)).compile().as_text()
    assert f"f32[3,{t.shape[1]},{config.vocab_size}]" not in hlo
    assert f"f32[3,{config.vocab_size}]" in hlo or f"f32[3,1,{config.vocab_size}]" in hlo


# ----------------------------------------------------------------------------- sampling plumbing
SMALL = ModelConfig(model_type="llama", vocab_size=8, hidden_size=16, intermediate_size=32,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=64)
MANY = 100_000
PROMPT = [3, 1, 3]


@pytest.fixture(scope="module")
def small():
    params = random_params(SMALL, std=0.3)
    t = jnp.asarray([PROMPT])
    logits, _, _ = forward(SMALL, params, t, jnp.arange(3)[None], None,
                           padded_causal_mask(jnp.ones_like(t, bool)))
    seen = token_presence(t, jnp.ones_like(t, bool), SMALL.vocab_size)
    return params, logits[0, -1], seen[0]


def first_tokens(params, **kw):
    tokens = np.tile(np.asarray(PROMPT, np.int32), (MANY, 1))
    lengths = np.full((MANY,), len(PROMPT), np.int32)
    out = decode(SMALL, params, tokens, lengths, max_new_tokens=1, cache_len=4, **kw)
    return np.asarray(out.tokens[:, 0])


def test_decode_samples_the_processed_distribution(small):
    params, logits, seen = small
    cfg = SamplerConfig(temperature=0.8, top_k=6, top_p=0.95, repetition_penalty=1.8)
    expected = np.exp(np.asarray(process_logits(logits, cfg, seen), np.float64))
    assert 2 <= np.count_nonzero(expected) < 8
    drawn = first_tokens(params, sampler=cfg, key=jax.random.key(11))
    assert chi2_pvalue(drawn, expected) > P_THRESHOLD
    # Forgetting the prompt's tokens for the penalty (a wrong rule) fails the same test.
    wrong = np.exp(np.asarray(process_logits(logits, cfg, jnp.zeros_like(seen)), np.float64))
    assert chi2_pvalue(drawn, wrong) < P_THRESHOLD


@pytest.mark.exec_bound  # 1e5 rows: running, not compiling (tests/conftest.py)
def test_decode_mirostat_first_token_follows_the_truncated_distribution(small):
    params, logits, _ = small
    processed = process_logits(logits, SamplerConfig())
    # mu starts at 2 * tau: put it between the 3rd and 4th smallest surprise, so 3 tokens are kept.
    surprise = np.sort(-np.asarray(processed) / np.log(2))
    tau = float(surprise[2] + surprise[3]) / 4
    expected = np.exp(np.asarray(mirostat_truncate(processed, jnp.float32(2 * tau)), np.float64))
    assert 2 <= np.count_nonzero(expected) < 8
    drawn = first_tokens(params, method="mirostat", mirostat_tau=tau, key=jax.random.key(5))
    assert chi2_pvalue(drawn, expected) > P_THRESHOLD
    assert chi2_pvalue(drawn, np.exp(np.asarray(processed, np.float64))) < P_THRESHOLD


def test_mirostat_decode_is_reproducible_and_keyed(small):
    params, _, _ = small
    tokens, lengths = pad_prompts([[1, 2, 3], [4]])
    kw = dict(max_new_tokens=12, method="mirostat", mirostat_tau=2.0, mirostat_eta=0.2, eos_ids=(7,))
    a = decode(SMALL, params, tokens, lengths, key=jax.random.key(0), **kw)
    b = decode(SMALL, params, tokens, lengths, key=jax.random.key(0), **kw)
    c = decode(SMALL, params, tokens, lengths, key=jax.random.key(1), **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    assert not np.array_equal(a.tokens, c.tokens)
    # With a target surprise far above anything seen, nothing is truncated: Mirostat is plain sampling.
    wide = decode(SMALL, params, tokens, lengths, key=jax.random.key(0),
                  **{**kw, "mirostat_tau": 1000.0})
    plain = decode(SMALL, params, tokens, lengths, key=jax.random.key(0), max_new_tokens=12,
                   method="sample", eos_ids=(7,))
    np.testing.assert_array_equal(wide.tokens, plain.tokens)


# ----------------------------------------------------------------------------- bad input
def test_pad_prompts_right_pads():
    tokens, lengths = pad_prompts([[5, 6, 7], [8]])
    np.testing.assert_array_equal(tokens, [[5, 6, 7], [8, 0, 0]])
    np.testing.assert_array_equal(lengths, [3, 1])
    assert tokens.dtype == np.int32 and lengths.dtype == np.int32
    with pytest.raises(PromptError, match="flat list of int"):
        pad_prompts([[1.5, 2.0]])


def test_default_cache_len_rounds_up():
    assert default_cache_len(5, 8) == 64
    assert default_cache_len(60, 8) == 128


@pytest.mark.parametrize("prompts_, kwargs, match", [
    ([[1, 2], []], {}, "empty prompt: row 1"),
    ([[1, 2], [3, 8]], {}, r"token id 8 at row 1, position 1 is outside the vocabulary \[0, 8\)"),
    ([[1, -1]], {}, "token id -1 at row 0"),
    ([[1] * 40], dict(cache_len=48), "does not fit the cache of 48 slots"),
    ([[1] * 40], dict(max_new_tokens=30), "exceeds the model's max_position_embeddings"),
    ([[1]], dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    ([], {}, "zero rows"),
])
def test_bad_prompts_raise_clear_errors(prompts_, kwargs, match):
    tokens, lengths = pad_prompts(prompts_)
    kwargs = {"max_new_tokens": 10, **kwargs}
    with pytest.raises(PromptError, match=match):
        decode(SMALL, None, tokens, lengths, method="greedy", **kwargs)


def test_more_validation_errors():
    tokens, lengths = pad_prompts([[1, 2]])
    with pytest.raises(PromptError, match="prompt_length 3 but prompt_tokens is only 2 wide"):
        validate_prompts(SMALL, tokens, np.array([3]), 4)
    with pytest.raises(PromptError, match="must be 2-D"):
        validate_prompts(SMALL, tokens[0], lengths, 4)
    with pytest.raises(PromptError, match="rectangular int array"):
        validate_prompts(SMALL, [[1, 2], [3]], [2, 1], 4)
    with pytest.raises(PromptError, match="must hold integer"):
        validate_prompts(SMALL, tokens.astype(np.float32), lengths, 4)
    with pytest.raises(PromptError, match="eos_ids"):
        decode(SMALL, None, tokens, lengths, max_new_tokens=4, method="greedy", eos_ids=(8,))
    with pytest.raises(ValueError, match="unknown decoding method"):
        decode(SMALL, None, tokens, lengths, max_new_tokens=4, method="nucleus")
    with pytest.raises(ValueError, match="pass key="):
        decode(SMALL, None, tokens, lengths, max_new_tokens=4, method="sample")
    # validation trims padding columns and checks only the valid part of each row
    with pytest.raises(PromptError, match="4 wide but the cache has only 3 slots"):
        validate_prompts(SMALL, np.zeros((1, 4), np.int32), np.array([1]), 2, cache_len=3)
    # Only the valid part of each row is checked; the padded width is kept.
    t, l = validate_prompts(SMALL, np.array([[1, 2, 99, 99], [3, 99, 99, 99]]), np.array([2, 1]), 4)
    np.testing.assert_array_equal(t, [[1, 2, 99, 99], [3, 99, 99, 99]])
