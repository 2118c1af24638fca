"""Fast-dLLM's approximate KV caches (cache='prefix' / 'dual' of jaxdecode.diffusion), with logits_shift
0 and 1 (Dream: the logit at column i predicts token i + 1, so a block's first slot is predicted from
the column before the block, which the block forwards rerun).

The caches are approximations (a cached key or value is stale once the tokens it attended to have
changed), so the equality test uses a one-layer model, on which they are exact by construction.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxdecode.models import ModelConfig, init_params

from jaxdecode import diffusion as D

MASK, A = 31, 8
PROMPTS = jnp.array([[1, 2, 3, 4, 6], [7, 8, 0, 0, 0], [9, 10, 11, 12, 0]], jnp.int32)
LENGTHS = jnp.array([5, 2, 4], jnp.int32)
ANSWER_LENGTHS = jnp.array([8, 6, 7], jnp.int32)
RULES = (D.Greedy1(), D.Threshold(0.3))


def _config(shift, num_layers=2):
    return ModelConfig(model_type="llama", vocab_size=32, hidden_size=32, intermediate_size=64,
                       num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                       mask_token_id=MASK, logits_shift=shift, attention="bidirectional")


def _params(config, seed=0):
    # std 0.3 spreads the logits: no near-ties between the paths' float rounding
    return init_params(config, jax.random.PRNGKey(seed), std=0.3)


def _same(a, b):
    for k in ("tokens", "lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(a, k)), np.asarray(getattr(b, k)), err_msg=k)
    np.testing.assert_array_equal(np.asarray(a.stats["nfe"]), np.asarray(b.stats["nfe"]), err_msg="nfe")


@pytest.mark.parametrize("shift", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_caches_exact_on_a_one_layer_model(shift):
    """A one-layer model's keys and values are a function of each column's own token and position, so
    none is ever stale, and every logit a cached forward reads comes from a column it reruns (the
    block; "prefix": the slots after it; logits_shift 1: the column before the block too) against the
    same keys as without a cache. Both caches then commit exactly what no cache commits, here over
    three blocks (3, 3 and a short last one) with rows of different prompt and answer lengths."""
    config = _config(shift, num_layers=1)
    params = _params(config)
    kw = {"answer_length": A, "block_length": 3, "mask_id": MASK, "answer_lengths": ANSWER_LENGTHS}
    for rule in RULES:
        ref = D.diffusion_decode(config, params, PROMPTS, LENGTHS, rule=rule, **kw)
        assert not np.asarray(ref.stats["unfinished"]).any()
        for cache in ("prefix", "dual"):
            _same(D.diffusion_decode(config, params, PROMPTS, LENGTHS, rule=rule, cache=cache, **kw), ref)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cache_nfe_batch_and_jit(cache):
    """Rows of different prompt and answer lengths, a Dream-style model (logits_shift 1), inside a user
    jax.jit. Greedy1 commits exactly one slot per forward, refresh forwards included, so a row's nfe
    is its answer length."""
    config = _config(1)
    params = _params(config, seed=2)

    @jax.jit
    def decode(params, prompts, lengths, answer_lengths):
        return D.diffusion_decode(config, params, prompts, lengths, answer_length=A, block_length=3, mask_id=MASK,
                                  cache=cache, answer_lengths=answer_lengths)

    out = decode(params, PROMPTS, LENGTHS, ANSWER_LENGTHS)
    al = np.asarray(ANSWER_LENGTHS)
    np.testing.assert_array_equal(np.asarray(out.stats["nfe"]), al)
    assert int(out.stats["steps"]) == al.max()
    np.testing.assert_allclose(np.asarray(out.stats["tokens_per_forward"]), 1.0)
    np.testing.assert_array_equal(np.asarray(out.lengths), al)
    assert not (np.asarray(out.tokens) == MASK).any() and not np.asarray(out.stats["unfinished"]).any()


def test_generate_takes_the_caches_for_a_dream_model():
    """method='diffusion' with diffusion_cache on a logits_shift 1 model; with a threshold every block
    still costs its refresh forward. A block-diffusion model is told to use its exact cache."""
    import jaxdecode
    from jaxdecode.model import Model
    config = _config(1)
    model = Model(config=config, params=_params(config, seed=2))
    prompts = [[1, 2, 3, 4, 6], [7, 8]]
    res = jaxdecode.generate(model, prompts, method="diffusion", max_new_tokens=A, block_length=3,
                             diffusion_cache="dual", rule="threshold", threshold=0.3)
    for r in res:
        assert len(r.tokens) == A and MASK not in r.tokens
        assert -(-A // 3) <= r.stats["nfe"] <= A and r.stats["tokens_per_forward"] == pytest.approx(A / r.stats["nfe"])
    assert min(r.stats["nfe"] for r in res) < A  # the threshold commits several slots per forward somewhere
    block = config.replace(attention="block", block_size=4)
    with pytest.raises(D.DiffusionError, match="use cache='exact'"):
        D.diffusion_decode(block, model.params, PROMPTS, LENGTHS, answer_length=A, cache="prefix")


@pytest.mark.slow
@pytest.mark.parametrize("shift", [0, 1])
def test_dual_cache_agrees_with_no_cache_on_a_trained_model(shift):
    """Refreshed at every block (blocks of 2), the dual cache decodes a trained task dLLM (sort) almost
    as without a cache. Measured share of equal answer tokens (greedy1, 64 prompts): 0.995 with
    logits_shift 0 (0.97 of the rows whole), 0.987 with logits_shift 1 (0.92)."""
    from jaxdecode.training.dllm import tiny_task_dllm

    from jaxdecode.dllm_tasks import make_task
    config, params = tiny_task_dllm("sort", 6, 6, logits_shift=shift)
    prompts, _ = make_task("sort", 6, 6).sample(np.random.default_rng(7), 64)
    lengths = np.full(len(prompts), prompts.shape[1], np.int32)
    none, dual = (np.asarray(D.diffusion_decode(config, params, prompts, lengths, answer_length=6, block_length=2,
                                                cache=c).tokens) for c in ("none", "dual"))
    assert (none == dual).mean() >= 0.9
