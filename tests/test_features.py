"""The verification forward hands feature drafters the target's hidden states (issue 10 item 1).

A probe drafter proposes prompt-lookup chains and records, through a host callback, the features the
engine gives it (from the prefill in `init`, from each verification in `observe`). They must equal the
hidden states of one plain forward over the final text at the same positions: the states a feature
drafter (Medusa, EAGLE, a block drafter) would otherwise need a second target forward for."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters.ngram import PromptLookupDrafter
from jaxdecode.models import ModelConfig, causal_mask, forward, init_params
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import (FINAL, SpeculativeError, accepted_features, speculative_decode)
from jaxdecode.verifiers import get_verifier

V = 64
GREEDY = SamplerConfig(temperature=0.0)
LAYERS = (0, FINAL, 2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProbeDrafter:
    """Prompt lookup, plus a log of every feature block it is handed."""
    inner: PromptLookupDrafter
    feature_layers: tuple = dataclasses.field(default=LAYERS, metadata=dict(static=True))

    num_nodes = property(lambda self: self.inner.num_nodes)
    max_depth = property(lambda self: self.inner.max_depth)
    child_rule = property(lambda self: self.inner.child_rule)
    is_chain = True

    def init(self, prompt_tokens, prompt_lengths, cache_len, key, features=None):
        jax.debug.callback(lambda f, n: LOG.append(("init", np.asarray(f), np.asarray(n))),
                           features, prompt_lengths, ordered=True)
        return self.inner.init(prompt_tokens, prompt_lengths, cache_len, key)

    def propose(self, state, ctx, sampler):
        return self.inner.propose(state, ctx, sampler)

    def observe(self, state, obs):
        feats, count = accepted_features(obs)
        start = obs.hist_len - count - 1  # the pending root's position
        jax.debug.callback(lambda f, c, s: LOG.append(("obs", np.asarray(f), np.asarray(c), np.asarray(s))),
                           feats, count, start, ordered=True)
        return self.inner.observe(state, obs)


LOG: list = []


def tiny(layers=3):
    cfg = ModelConfig(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=64,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=256, sliding_windows=(0,) * layers)
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    # No attention output: the model maps token -> next token, so lookups are really accepted.
    return cfg, {**params, "layers": {**params["layers"], "wo": params["layers"]["wo"] * 0}}


def reference_states(cfg, params, row_tokens):
    """[F, T, D] hidden states of one plain forward over a row's tokens, in LAYERS order."""
    t = jnp.asarray(row_tokens, jnp.int32)[None]
    _, hidden, _ = forward(cfg, params, t, jnp.arange(t.shape[1])[None], None, causal_mask(1, t.shape[1]),
                           return_layers=(0, 2))
    return np.stack([np.asarray(hidden["layers"][0, 0]), np.asarray(hidden["final"][0]),
                     np.asarray(hidden["layers"][1, 0])])


def test_features_reach_the_drafter_at_the_committed_positions():
    cfg, params = tiny()
    prompts = [[3, 9, 27, 4, 3, 9, 27, 4, 3], [8, 2], [5, 5, 5, 5, 5, 5]]
    toks, lens = pad_prompts(prompts)
    LOG.clear()
    out = speculative_decode(cfg, params, ProbeDrafter(PromptLookupDrafter(num_nodes=4)), toks, lens,
                             max_new_tokens=12, verifier=get_verifier("greedy"))
    ref = decode(cfg, params, toks, lens, max_new_tokens=12, sampler=GREEDY, method="greedy")
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert np.asarray(out.stats["tau"]).max() > 1.1, "the probe should see accepted drafts"

    full = [p + list(np.asarray(out.tokens[b])[:int(out.lengths[b])]) for b, p in enumerate(prompts)]
    refs = [reference_states(cfg, params, row) for row in full]
    seen = [np.zeros(len(row), bool) for row in full]
    (_, f0, n0), *steps = LOG
    for b, n in enumerate(n0):  # prefill: positions 0 .. len-2
        np.testing.assert_allclose(f0[:, b, :n - 1], refs[b][:, :n - 1], atol=2e-4)
        seen[b][:n - 1] = True
    for _, f, count, start in steps:
        for b in range(len(full)):
            for j in range(int(count[b])):
                pos = int(start[b]) + j
                np.testing.assert_allclose(f[:, b, j], refs[b][:, pos], atol=2e-4,
                                           err_msg=f"row {b} position {pos}")
                assert not seen[b][pos], f"row {b}: position {pos} handed over twice"
                seen[b][pos] = True
    for b, row in enumerate(full):  # every state up to the last committed token's predecessor
        assert seen[b][:len(row) - 1].all(), f"row {b}: positions {np.flatnonzero(~seen[b][:len(row) - 1])}"


def test_features_for_another_target_are_refused():
    cfg, params = tiny(layers=2)
    toks, lens = pad_prompts([[1, 2, 3]])
    with pytest.raises(SpeculativeError, match=r"target layers \[2\].*2 layers"):
        speculative_decode(cfg, params, ProbeDrafter(PromptLookupDrafter(num_nodes=2)), toks, lens,
                           max_new_tokens=4, verifier=get_verifier("greedy"))
