"""The adaptive engine's lean plain runs hand a stateful drafter each plain step as an Observation over
no nodes (N = 0: the root's slot only); the engine's own plain step hands it the same step over the
drafter's N (invalid) nodes. Every drafter that keeps state must end up exactly where it would after
either (a drafter indexing slot 0 as `path[:, :1]` once read nothing at N = 0 and kept stale features)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode.autoregressive import pad_prompts
from jaxdecode.drafters import make_drafter
from jaxdecode.drafters import block as blk
from jaxdecode.drafters import selfspec as ss
from jaxdecode.speculative import Observation, _start, _verify_forward
from jaxdecode.tree import Tree


def _block(target):
    cfg = blk.BlockConfig(block_size=4, num_layers=1, anchors=8, gamma=2.0)
    return blk.make_block_drafter(blk.init_params(cfg, target.config, jax.random.PRNGKey(3)), cfg, target,
                                  "chain:3")


def _kangaroo(target):
    cfg = ss.KangarooConfig(exit_layer=1, threshold=0.0)
    return ss.make_kangaroo(ss.init_adapter(cfg, target.config, jax.random.PRNGKey(1)), cfg, target, "chain:3")


def _head_over_draft_lm(target):
    """The acceptance head over the embedded draft LM (the shipped head wraps EAGLE-3), random head weights."""
    from jaxdecode.drafters.accept_head import AcceptHeadConfig, make, param_shapes

    cfg = AcceptHeadConfig(inner="draft_lm")
    params = jax.tree.map(lambda shape: 0.1 * jax.random.normal(jax.random.PRNGKey(4), shape),
                          param_shapes(cfg, target.config), is_leaf=lambda x: isinstance(x, tuple))
    return make(params, cfg, target, "chain:4", 0.0)  # the embedded draft LM by default


# Stateful drafters (not history_only), shipped or built here with random weights.
MAKERS = {
    "eagle3": lambda t: make_drafter("eagle3", t),
    "medusa": lambda t: make_drafter("medusa", t),
    "hydra": lambda t: make_drafter("hydra", t),
    "accept_head": lambda t: make_drafter("accept_head", t),  # over the shipped EAGLE-3
    "accept_head over draft_lm": _head_over_draft_lm,
    "block": _block,
    "token_recycling": lambda t: make_drafter("token_recycling", t),
    "aded": lambda t: make_drafter("aded", t),
    "swift": lambda t: make_drafter("swift", t),
    "del": lambda t: make_drafter("del", t),
    "kangaroo": _kangaroo,
}


def _visible(state):
    """The state as the drafter reads it: the block drafter's context cache only below its lengths (it
    writes max_depth + 1 entries a step, those past the committed ones scratch, overwritten next)."""
    if isinstance(state, blk.BlockState):
        seen = (jnp.arange(state.k.shape[3])[None, :] < state.lengths[:, None])[None, :, None, :, None]
        return blk.BlockState(k=jnp.where(seen, state.k, 0), v=jnp.where(seen, state.v, 0), lengths=state.lengths)
    return state


@pytest.fixture(scope="module")
def target():
    return jaxdecode.load()


@pytest.mark.parametrize("name", list(MAKERS))
def test_a_plain_step_over_no_nodes_is_observed_like_one_over_the_drafters_tree(target, name):
    drafter = MAKERS[name](target)
    assert not getattr(drafter, "history_only", False)
    cfg, params = target.config, target.params
    prompts, lengths = pad_prompts([target.tokenizer.encode("def add(a, b):\n    return a"),
                                    target.tokenizer.encode("import os\nimport")])
    prompts, lengths = jnp.asarray(prompts), jnp.asarray(lengths)
    b, p = prompts.shape
    layers = tuple(getattr(drafter, "feature_layers", ()) or ())
    st = _start(cfg, params, drafter, prompts, lengths, jax.random.PRNGKey(0), cache_len=p + 32,
                hist_cap=p + 32, pad=0, feature_layers=layers, policy=None)
    n = drafter.num_nodes
    no_nodes = Tree(tokens=jnp.zeros((b, 0), jnp.int32), parents=jnp.zeros((b, 0), jnp.int32),
                    valid=jnp.zeros((b, 0), bool))
    pending = st.history[jnp.arange(b), st.hist_len - 1]
    active = jnp.asarray([True, False])  # one row still decoding, one finished
    logits, feats, _ = _verify_forward(cfg, params, no_nodes, pending, st.cache, active, (0,), "xla", None,
                                       layers)  # [B, 1, V], [F, B, 1, D]
    bonus = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    count = active.astype(jnp.int32)
    history = st.history.at[jnp.arange(b), st.hist_len].set(jnp.where(active, bonus, 0))
    common = dict(num_accepted=jnp.zeros((b,), jnp.int32), bonus=bonus, history=history,
                  hist_len=st.hist_len + count, active=active, committed=count)
    # The engine's plain step: the drafter's N nodes, all invalid; logits and features zero past slot 0.
    full = Observation(tree=Tree(tokens=jnp.zeros((b, n), jnp.int32), parents=jnp.full((b, n), -1, jnp.int32),
                                 valid=jnp.zeros((b, n), bool)),
                       path=jnp.full((b, n), -1, jnp.int32), target_logits=jnp.pad(logits, ((0, 0), (0, n), (0, 0))),
                       features=None if feats is None else jnp.pad(feats, ((0, 0), (0, 0), (0, n), (0, 0))),
                       **common)
    lean = Observation(tree=no_nodes, path=jnp.zeros((b, 0), jnp.int32), target_logits=logits, features=feats,
                       **common)
    after_full = _visible(jax.jit(drafter.observe)(st.drafter_state, full))
    after_lean = _visible(jax.jit(drafter.observe)(st.drafter_state, lean))
    leaves_full, tree_full = jax.tree.flatten(after_full)
    leaves_lean, tree_lean = jax.tree.flatten(after_lean)
    assert tree_full == tree_lean
    for x, y in zip(leaves_full, leaves_lean):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
    if layers:  # the step's features reached the state (a stale state would equal the one before)
        changed = [not np.array_equal(np.asarray(x), np.asarray(y))
                   for x, y in zip(jax.tree.leaves(st.drafter_state), leaves_lean)]
        assert any(changed), f"{name}: observe left the state as it was"


def test_a_forward_over_the_pending_token_alone_runs_decodes_attention(target, monkeypatch):
    """The engine's plain steps (no nodes) run the forward exactly as `decode` does, not the tree kernel
    (on an H200 the adaptive default sampled at 0.73x of plain decoding with the kernel there, 0.82x
    without); a tree of one node still runs the attention asked for."""
    import importlib

    from jaxdecode.models.transformer import forward

    ta = importlib.import_module("jaxdecode.kernels.tree_attention")  # the module (the package exports the op)

    kernel_calls = []
    real = ta.tree_attention_pallas

    def spy(*args, **kwargs):
        kernel_calls.append(kwargs.get("interpret"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ta, "tree_attention_pallas", spy)
    forward.clear_cache()  # trace afresh, so the spy sees every kernel call
    cfg, params = target.config, target.params
    prompts, lengths = pad_prompts([target.tokenizer.encode("def add(a, b):\n    return a")])
    prompts, lengths = jnp.asarray(prompts), jnp.asarray(lengths)
    st = _start(cfg, params, make_drafter("prompt_lookup", target), prompts, lengths, jax.random.PRNGKey(0),
                cache_len=prompts.shape[1] + 8, hist_cap=prompts.shape[1] + 8, pad=0, feature_layers=(), policy=None)
    pending = st.history[0, st.hist_len - 1]
    active = jnp.ones((1,), bool)

    def nodes(k):
        return Tree(tokens=jnp.full((1, k), 5, jnp.int32), parents=jnp.arange(k, dtype=jnp.int32)[None] - 1,
                    valid=jnp.ones((1, k), bool))

    logits, _, _ = _verify_forward(cfg, params, nodes(0), pending, st.cache, active, (0,), "interpret", None)
    assert kernel_calls == []
    decode_logits, _, _ = forward(cfg, params, pending[:, None], st.cache.lengths[:, None], st.cache,
                                  jnp.ones((1, 1, 1), bool))  # decode's step
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(decode_logits))
    _verify_forward(cfg, params, nodes(1), pending, st.cache, active, (1,), "interpret", None)
    assert kernel_calls and all(kernel_calls)  # the kernel, in interpret mode as asked
