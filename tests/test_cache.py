"""The KV cache contract: prefill + decode, token trees, commit of accepted paths, layer selection.

Each property is checked against the cache-free full-sequence forward on random tiny models (no
checkpoints needed): a Llama with GQA and llama3 rope, a Mistral-style model whose sliding window is
shorter than the sequences (so stale or out-of-window slots would show), and GPT-2 (learned positions).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.models import (ModelConfig, advance, causal_mask, commit, forward, init_cache, init_params,
                              padded_causal_mask)
from jaxdecode.models.transformer import param_shapes, rms_norm

VOCAB = 64
MAX_LEN = 16
ATOL = 1e-5

CONFIGS = {
    "llama_gqa_llama3": ModelConfig(
        model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
        rope_scaling=(("factor", 4.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                      ("original_max_position_embeddings", 4), ("rope_type", "llama3"))),
    "mistral_window3": ModelConfig(
        model_type="mistral", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, sliding_windows=(3, 3)),
    "qwen3_qk_norm_yarn": ModelConfig(
        model_type="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64, qk_norm=True, rope_theta=100.0,
        rope_scaling=(("factor", 4.0), ("original_max_position_embeddings", 4), ("rope_type", "yarn"))),
    # sliding layer 0 with its own RoPE base, a query scale not head_dim's, sandwich and plus-one norms
    "gemma3_window2": ModelConfig(
        model_type="gemma3_text", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, sliding_windows=(2, 0),
        rope_theta=1e6, local_rope_theta=100.0, query_pre_attn_scalar=24, activation="gelu_tanh",
        qk_norm=True, norm_plus_one=True, scale_embed=True, sandwich_norms=True, tie_word_embeddings=True),
    # soft-capped attention scores and logits (Gemma 2)
    "gemma2_softcaps": ModelConfig(
        model_type="gemma2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, sliding_windows=(3, 0),
        query_pre_attn_scalar=8, attn_logit_softcapping=1.0, final_logit_softcapping=2.0, activation="gelu_tanh",
        norm_plus_one=True, scale_embed=True, sandwich_norms=True, tie_word_embeddings=True),
    # a mixture of 4 experts, 2 per token: a tree's tokens routed together
    "mixtral_moe": ModelConfig(
        model_type="mixtral", vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=24),
    "gpt2": ModelConfig(
        model_type="gpt2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=4, head_dim=8, max_position_embeddings=64, norm_eps=1e-5,
        qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=True, activation="gelu_new"),
}

# The token tree of the tests: parents (-1 = child of the last committed token), and its depths.
PARENTS = np.array([-1, -1, 0, 0, 1, 2, 2])
PROMPT_LENS = np.array([4, 2, 3])  # different committed prefixes per row
# Accepted root-to-node paths per row (node indices, topological order); row 1 accepts nothing.
ACCEPTED = [[0, 2, 5], [], [1, 4]]


def random_params(config, seed: int, std: float = 0.3):
    """Random parameters built on the host (no per-op compiles): wide enough that logits spread,
    with non-zero biases and non-unit norm scales so a misplaced parameter changes the output."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        name = jax.tree_util.keystr(path)
        base = 1.0 if "scale" in name else 0.0
        return jnp.asarray(base + std * rng.standard_normal(shape), jnp.float32)
    return jax.tree_util.tree_map_with_path(leaf, param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))


commit_jit = jax.jit(commit)


def tree_depths(parents: np.ndarray) -> np.ndarray:
    depth = np.zeros(len(parents), np.int32)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    return depth


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """A[i, j] = node j is node i or one of its ancestors."""
    n = len(parents)
    mask = np.eye(n, dtype=bool)
    for i in range(n):
        j = parents[i]
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def path_to(parents: np.ndarray, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def full_logits(config, params, tokens, lengths) -> np.ndarray:
    """Cache-free forward over right-padded rows: the reference everything is compared with."""
    b, t = tokens.shape
    valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, _, _ = forward(config, params, jnp.asarray(tokens), positions, None,
                           padded_causal_mask(jnp.asarray(valid)))
    return np.asarray(logits)


def prefill(config, params, tokens, prompt_lens):
    """Right-padded prefill of each row's prompt into a fresh cache, committed with `advance`."""
    b = tokens.shape[0]
    p = int(prompt_lens.max())
    valid = jnp.asarray(np.arange(p)[None, :] < prompt_lens[:, None])
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    cache = init_cache(config, b, MAX_LEN)
    logits, _, cache = forward(config, params, jnp.asarray(tokens[:, :p]), positions, cache,
                               padded_causal_mask(valid))
    return np.asarray(logits), advance(cache, jnp.asarray(prompt_lens))


def decode_step(config, params, cache, next_tokens, n_commit):
    """One token per row at position cache.lengths; commits it in rows where n_commit is 1."""
    b = cache.batch_size
    logits, _, cache = forward(config, params, jnp.asarray(next_tokens, jnp.int32)[:, None],
                               cache.lengths[:, None], cache, jnp.ones((b, 1, 1), bool))
    return np.asarray(logits[:, 0]), advance(cache, jnp.asarray(n_commit))


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    config = CONFIGS[request.param]
    # A wide init spreads the logits, so a wrong position or a stale slot changes them visibly.
    params = random_params(config, seed=1)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, VOCAB, (len(PROMPT_LENS), 10)).astype(np.int32)
    return config, params, tokens


def test_prefill_then_decode_matches_full_forward(model):
    config, params, tokens = model
    b, total = tokens.shape
    ref = full_logits(config, params, tokens, np.full(b, total))
    logits, cache = prefill(config, params, tokens, PROMPT_LENS)
    for r, n in enumerate(PROMPT_LENS):
        np.testing.assert_allclose(logits[r, :n], ref[r, :n], atol=ATOL, rtol=0)
    np.testing.assert_array_equal(cache.lengths, PROMPT_LENS)
    # Every row decodes until the longest prompt reaches the end; rows sit at different positions.
    for _ in range(total - int(PROMPT_LENS.max())):
        pos = np.asarray(cache.lengths)
        step_logits, cache = decode_step(config, params, cache, tokens[np.arange(b), pos], np.ones(b))
        np.testing.assert_allclose(step_logits, ref[np.arange(b), pos], atol=ATOL, rtol=0)
    np.testing.assert_array_equal(cache.lengths, PROMPT_LENS + total - PROMPT_LENS.max())


def tree_forward(config, params, tokens, rng):
    """Prefill the prompts, then run the token tree over them; returns tree tokens, logits, cache."""
    b = tokens.shape[0]
    _, cache = prefill(config, params, tokens, PROMPT_LENS)
    tree_tokens = rng.integers(0, VOCAB, (b, len(PARENTS))).astype(np.int32)
    positions = jnp.asarray(PROMPT_LENS[:, None] + tree_depths(PARENTS)[None, :], jnp.int32)
    mask = jnp.broadcast_to(jnp.asarray(ancestor_mask(PARENTS)), (b, len(PARENTS), len(PARENTS)))
    logits, _, tree_cache = forward(config, params, jnp.asarray(tree_tokens), positions, cache, mask)
    return tree_tokens, np.asarray(logits), cache, tree_cache


def test_tree_forward_matches_each_path_run_causally(model):
    config, params, tokens = model
    tree_tokens, logits, _, tree_cache = tree_forward(config, params, tokens, np.random.default_rng(3))
    # The tree forward writes but does not commit.
    np.testing.assert_array_equal(tree_cache.lengths, PROMPT_LENS)
    # Reference: one causal sequence per (row, node): the row's prompt followed by the node's path.
    seqs, lens = [], []
    width = int(PROMPT_LENS.max() + tree_depths(PARENTS).max() + 1)
    for r, n in enumerate(PROMPT_LENS):
        for node in range(len(PARENTS)):
            seq = np.concatenate([tokens[r, :n], tree_tokens[r, path_to(PARENTS, node)]])
            lens.append(len(seq))
            seqs.append(np.pad(seq, (0, width - len(seq))))
    lens = np.array(lens)
    ref = full_logits(config, params, np.stack(seqs), lens)[np.arange(len(lens)), lens - 1]
    np.testing.assert_allclose(logits.reshape(-1, VOCAB), ref, atol=ATOL, rtol=0)


def test_commit_accepted_paths_equals_decoding_them(model):
    config, params, tokens = model
    b = tokens.shape[0]
    tree_tokens, _, prompt_cache, tree_cache = tree_forward(config, params, tokens,
                                                            np.random.default_rng(3))
    keep = np.zeros((b, len(PARENTS)), bool)
    for r, path in enumerate(ACCEPTED):
        assert path == ([] if not path else path_to(PARENTS, path[-1]))  # each is a root-to-node path
        keep[r, path] = True
    committed = commit_jit(tree_cache, jnp.asarray(keep))
    accepted_lens = np.array([len(p) for p in ACCEPTED])
    np.testing.assert_array_equal(committed.lengths, PROMPT_LENS + accepted_lens)
    bonus = np.array([7, 11, 13], np.int32)
    got, got_cache = decode_step(config, params, committed, bonus, np.ones(b))

    # Reference: decode each row's accepted path one token at a time from the prompt cache.
    cache = prompt_cache
    for s in range(accepted_lens.max()):
        step_tokens = [tree_tokens[r, p[s]] if s < len(p) else 0 for r, p in enumerate(ACCEPTED)]
        _, cache = decode_step(config, params, cache, step_tokens, (s < accepted_lens).astype(np.int32))
    want, want_cache = decode_step(config, params, cache, bonus, np.ones(b))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(got_cache.lengths, want_cache.lengths)
    # The committed slots themselves hold the same keys and values.
    for r, n in enumerate(np.asarray(want_cache.lengths)):
        np.testing.assert_allclose(got_cache.k[:, r, :, :n], want_cache.k[:, r, :, :n], atol=ATOL, rtol=0)
        np.testing.assert_allclose(got_cache.v[:, r, :, :n], want_cache.v[:, r, :, :n], atol=ATOL, rtol=0)


def test_commit_of_prefixes_equals_advance(model):
    """Keeping the valid prefix of a padded block is exactly `advance` (the no-move fast path)."""
    config, params, tokens = model
    b = tokens.shape[0]
    p = int(PROMPT_LENS.max())
    cache = init_cache(config, b, MAX_LEN)
    valid = np.arange(p)[None, :] < PROMPT_LENS[:, None]
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    _, _, written = forward(config, params, jnp.asarray(tokens[:, :p]), positions, cache,
                            padded_causal_mask(jnp.asarray(valid)))
    via_commit = commit_jit(written, jnp.asarray(valid))
    via_advance = advance(written, jnp.asarray(PROMPT_LENS))
    jax.tree.map(np.testing.assert_array_equal, via_commit, via_advance)


# ----------------------------------------------------------------------------- layer selection
LAYERED = ModelConfig(  # per-layer windows, so slicing layers must slice their windows too
    model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, qkv_bias=True,
    sliding_windows=(0, 3))


@pytest.fixture(scope="module")
def layered():
    params = random_params(LAYERED, seed=4)
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, VOCAB, (2, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    return params, tokens, positions, causal_mask(2, 6)


def sliced_model(params, layers: list[int]):
    """A smaller model made of the chosen layers (their weights and windows), sharing embed/head."""
    config = LAYERED.replace(num_layers=len(layers),
                             sliding_windows=tuple(LAYERED.sliding_windows[i] for i in layers))
    sub = dict(params, layers=jax.tree.map(lambda a: a[np.asarray(layers)], params["layers"]))
    return config, sub


def test_skip_nothing_equals_full_forward(layered):
    params, tokens, positions, mask = layered
    full, full_hidden, _ = forward(LAYERED, params, tokens, positions, None, mask)
    same, same_hidden, _ = forward(LAYERED, params, tokens, positions, None, mask, skip_layers=(),
                                   stop_at_layer=LAYERED.num_layers)
    np.testing.assert_array_equal(same, full)
    np.testing.assert_array_equal(same_hidden["final"], full_hidden["final"])
    assert full_hidden["layers"] is None


def test_return_layers_gives_the_residual_stream_before_the_final_norm(layered):
    params, tokens, positions, mask = layered
    _, hidden, _ = forward(LAYERED, params, tokens, positions, None, mask, return_layers=(0, 1))
    assert hidden["layers"].shape == (2, 2, 6, LAYERED.hidden_size)
    last = hidden["layers"][1]
    np.testing.assert_allclose(rms_norm(last, params["final_norm"], LAYERED.norm_eps), hidden["final"],
                               atol=1e-6, rtol=0)
    assert not np.allclose(hidden["layers"][0], last)
    # Asking for one layer gives the same features as asking for several.
    _, only_first, _ = forward(LAYERED, params, tokens, positions, None, mask, return_layers=(0,))
    np.testing.assert_allclose(only_first["layers"][0], hidden["layers"][0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("select, layers", [(dict(stop_at_layer=1), [0]), (dict(skip_layers=(0,)), [1])],
                         ids=["stop_at_layer=1", "skip_layers=(0,)"])
def test_sub_network_equals_a_model_sliced_from_the_params(layered, select, layers):
    params, tokens, positions, mask = layered
    sub_config, sub_params = sliced_model(params, layers)
    want, want_hidden, _ = forward(sub_config, sub_params, tokens, positions, None, mask)
    got, got_hidden, _ = forward(LAYERED, params, tokens, positions, None, mask, **select)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    np.testing.assert_allclose(got_hidden["final"], want_hidden["final"], atol=1e-6, rtol=0)

    # With a cache: the run layers' slots get what the sliced model writes; the others stay as they were.
    cache = init_cache(LAYERED, 2, MAX_LEN)
    cache = cache.replace(k=cache.k + 1.0, v=cache.v - 1.0)  # recognisable untouched contents
    _, _, got_cache = forward(LAYERED, params, tokens, positions, cache, mask, **select)
    _, _, want_cache = forward(sub_config, sub_params, tokens, positions,
                               cache.replace(k=cache.k[np.asarray(layers)], v=cache.v[np.asarray(layers)]),
                               mask)
    skipped = [i for i in range(LAYERED.num_layers) if i not in layers]
    np.testing.assert_allclose(got_cache.k[np.asarray(layers)], want_cache.k, atol=1e-6, rtol=0)
    np.testing.assert_allclose(got_cache.v[np.asarray(layers)], want_cache.v, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(got_cache.k[np.asarray(skipped)], cache.k[np.asarray(skipped)])
    np.testing.assert_array_equal(got_cache.v[np.asarray(skipped)], cache.v[np.asarray(skipped)])


@pytest.mark.parametrize("select, message", [
    (dict(stop_at_layer=0), r"stop_at_layer must be in 1\.\.2, got 0"),
    (dict(stop_at_layer=3), r"stop_at_layer must be in 1\.\.2, got 3"),
    (dict(skip_layers=(0, 1)), r"removes every layer"),
    (dict(skip_layers=(5,)), r"skip_layers \[5\] are not layers of this 2-layer model"),
    (dict(stop_at_layer=1, return_layers=(1,)), r"return_layers \[1\] are not run by this forward"),
    (dict(skip_layers=(0,), return_layers=(0,)), r"return_layers \[0\] are not run by this forward"),
])
def test_bad_layer_selection_is_a_clear_error(layered, select, message):
    params, tokens, positions, mask = layered
    with pytest.raises(ValueError, match=message):
        forward(LAYERED, params, tokens, positions, None, mask, **select)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 33, 130])
def test_device_ancestor_mask_and_depths_equal_the_host_walk(n):
    """jaxdecode.tree builds them by pointer jumping (log2 N gathers, no loop over the nodes): on random
    trees (bushy and chain-like, batched) they equal walking each node's parents."""
    from jaxdecode.tree import ancestor_mask as device_mask
    from jaxdecode.tree import depths
    rng = np.random.default_rng(n)
    parents = np.full((3, n), -1, np.int32)
    for row, chainy in enumerate((0.0, 0.5, 1.0)):  # chainy: how often a node hangs off the previous one
        for i in range(1, n):
            parents[row, i] = i - 1 if rng.random() < chainy else rng.integers(-1, i)
    got_mask, got_depth = np.asarray(device_mask(jnp.asarray(parents))), np.asarray(depths(jnp.asarray(parents)))
    for row in range(3):
        np.testing.assert_array_equal(got_mask[row], ancestor_mask(parents[row]))
        np.testing.assert_array_equal(got_depth[row], tree_depths(parents[row]) + 1)


def test_tree_grown_level_by_level_with_write_offset_equals_one_tree_forward():
    """Writing a tree in two forwards (W > T window, write_offset) equals one forward over it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxdecode.models import ModelConfig, advance, causal_mask, forward, init_cache, init_params
    from jaxdecode.tree import ancestor_mask, depths

    cfg = ModelConfig(model_type="llama", vocab_size=48, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    params = init_params(cfg, jax.random.PRNGKey(1), std=0.3)
    prompt = jnp.asarray(np.random.RandomState(0).randint(0, 48, (2, 5)))
    cache = init_cache(cfg, 2, 32)
    _, _, cache = forward(cfg, params, prompt, jnp.broadcast_to(jnp.arange(5), (2, 5)), cache,
                          causal_mask(2, 5))
    cache = advance(cache, jnp.array([5, 3]))  # ragged committed prefixes
    parents = jnp.array([[-1, -1, 0, 0, 1]] * 2)
    toks = jnp.asarray(np.random.RandomState(1).randint(0, 48, (2, 5)))
    pos = cache.lengths[:, None] + depths(parents) - 1
    mask = ancestor_mask(parents)
    ref, _, _ = forward(cfg, params, toks, pos, cache, mask)
    # level 1 (nodes 0, 1) then level 2 (nodes 2, 3, 4) with a 5-wide window
    l1, _, c1 = forward(cfg, params, toks[:, :2], pos[:, :2], cache, mask[:, :2, :],
                        write_offset=jnp.zeros((2,), jnp.int32))
    l2, _, _ = forward(cfg, params, toks[:, 2:], pos[:, 2:], c1, mask[:, 2:, :],
                       write_offset=jnp.full((2,), 2, jnp.int32))
    np.testing.assert_allclose(np.concatenate([l1, l2], axis=1), ref, atol=1e-5)


# ----------------------------------------------------------------------------- cost follows occupancy
COST_CONFIG = ModelConfig(model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=3,
                          num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=8192, qkv_bias=True,
                          sliding_windows=(0, 0, 48))


def decode_loop_cost(select: dict, cache_len: int) -> tuple[float, int]:
    """Compiled cost of 4 decode steps (forward + advance in a loop, the cache donated, as inside the
    decoders): XLA's flop estimate and the temporary memory it allocates."""
    params = init_params(COST_CONFIG, jax.random.PRNGKey(0))

    def steps(params, cache, tok):
        def body(_, c):
            _, _, c = forward(COST_CONFIG, params, tok, c.lengths[:, None], c, jnp.ones((2, 1, 1), bool), **select)
            return advance(c, jnp.ones((2,), jnp.int32))
        return jax.lax.fori_loop(0, 4, body, cache)

    compiled = jax.jit(steps, donate_argnums=(1,)).lower(
        params, init_cache(COST_CONFIG, 2, cache_len), jnp.zeros((2, 1), jnp.int32)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"]), int(compiled.memory_analysis().temp_size_in_bytes)


@pytest.mark.parametrize("select", [{}, dict(skip_layers=(1,))], ids=["all_layers", "skip_layers=(1,)"])
def test_decode_step_cost_does_not_grow_with_cache_capacity(select):
    """A decode step works on what the rows occupy, not on the preallocated capacity: it allocates no
    copy of the cache (the cache is updated in place, layer slices and sub-networks included) and does
    not attend over empty slots. With 16x the capacity, the compiled step's temporary memory and
    arithmetic stay about the same (both grew 10-14x when every forward copied the cache through the
    layer scan and attended over all S slots)."""
    small_flops, small_temp = decode_loop_cost(select, 256)
    big_flops, big_temp = decode_loop_cost(select, 4096)
    full_cache = 2 * COST_CONFIG.num_layers * 2 * COST_CONFIG.num_kv_heads * 4096 * COST_CONFIG.head_dim * 4
    assert big_temp - small_temp < full_cache // 8, (small_temp, big_temp)
    assert big_flops < 1.5 * small_flops, (small_flops, big_flops)


def test_commit_cost_does_not_grow_with_cache_capacity():
    """Moving an accepted tree path touches the T window slots per row, not the whole cache: with 16x the
    capacity the compiled commit allocates about the same temporaries (it grew 16x with a per-row
    vmapped slice that transposed the cache)."""
    def temp(cache_len):
        cache = init_cache(COST_CONFIG, 2, cache_len)
        keep = jnp.zeros((2, 5), bool)
        return jax.jit(commit, donate_argnums=(0,)).lower(cache, keep).compile().memory_analysis().temp_size_in_bytes
    full_cache = 2 * COST_CONFIG.num_layers * 2 * COST_CONFIG.num_kv_heads * 4096 * COST_CONFIG.head_dim * 4
    assert temp(4096) - temp(256) < full_cache // 8, (temp(256), temp(4096))
