"""Speculative decoding under a regex / JSON-schema constraint (issue 13, ALGORITHMS.md §6).

Greedy: constrained speculative output equals constrained plain greedy token for token (embedded
target, JSON schema and regex rows in one batch, drafters that draft under the mask and ones the
engine prunes, a static, a chain and an adaptive dynamic tree). Sampling: the first two tokens follow
the constrained target's exact law (χ², 1e5 rows per block, V = 6 target of test_verifier_pairs and a
hand-built automaton with an EOS), and a deliberately wrong rule, not renormalising the draft
distribution after pruning, fails the same test.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
import jaxdecode.speculative as spec
import test_verifier_pairs as vp
from jaxdecode import verifiers as vf
from jaxdecode.adaptive import AdaptivePolicy, default_widths
from jaxdecode.autoregressive import decode
from jaxdecode.constraints import automaton as am
from jaxdecode.drafters import make_drafter
from jaxdecode.drafters.builders import StaticTreeBuilder, build_tree
from jaxdecode.drafters.medusa import MedusaConfig, init_params, make_heads_drafter
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import DraftContext, SpeculativeError, speculative_decode

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}
REGEX = r"(ab|cd)-[0-9]{2,3}( ok)?"
GREEDY = vf.get_verifier("greedy")


@pytest.fixture(scope="module")
def model():
    return jaxdecode.load()


@pytest.fixture(scope="module")
def batch(model):
    """Two prompts of different lengths, row 0 under the JSON schema, row 1 under the regex (one
    pattern for both rows where per-row stacking is not available)."""
    tok = model.tokenizer
    ids = [tok("A person as JSON: ")["input_ids"], tok("Code: ")["input_ids"]]
    width = max(map(len, ids))
    toks = np.zeros((2, width), np.int32)
    for i, row in enumerate(ids):
        toks[i, :len(row)] = row
    lens = np.asarray([len(r) for r in ids], np.int32)
    kw = dict(vocab_size=model.config.vocab_size, eos_ids=(0,))
    per_row = getattr(am, "per_row_constraint", None)
    if per_row is not None:
        constraint = per_row([SCHEMA, REGEX], tok, **kw)
    else:
        constraint = am.compile_json_schema(SCHEMA, tok, **kw).constraint()
    ref = decode(model.config, model.params, toks, lens, max_new_tokens=32, eos_ids=(0,), constraint=constraint,
                 method="greedy")
    return toks, lens, constraint, ref


def _drafter(model, name):
    if name == "draft_lm":  # the target as its own draft LM: drafts exactly what it would decode
        return make_drafter("draft_lm", model, draft=model, tree="chain:4")
    if name == "prompt_lookup":  # point masses the engine prunes
        return make_drafter("prompt_lookup", model)
    if name == "medusa":  # untrained heads (the LM head's guess), a feature drafter on a static tree
        cfg = MedusaConfig(num_heads=2)
        return make_heads_drafter(init_params(cfg, model.config.hidden_size, jax.random.PRNGKey(0)), cfg, model,
                                  tree="static:2,1")
    return make_drafter("draft_lm", model, draft=model, tree="eagle:depth=3,topk=2,total=4")


@pytest.mark.parametrize("name", ["draft_lm", "prompt_lookup", "medusa", "adaptive"])
def test_greedy_equals_constrained_greedy(model, batch, name):
    toks, lens, constraint, ref = batch
    drafter = _drafter(model, name)
    kw = {}
    if name == "adaptive":  # trees compacted to their kept nodes, and plain steps in between
        kw = dict(adaptive=AdaptivePolicy(widths=default_widths(drafter.num_nodes), shape="proposal", margin=0.0),
                  costs=vp.StepCosts(per_node=0.05, draft=0.1))
    out = speculative_decode(model.config, model.params, drafter, toks, lens, max_new_tokens=32, verifier=GREEDY,
                             eos_ids=(0,), constraint=constraint, **kw)
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert np.all(np.asarray(out.tokens)[np.arange(2), np.asarray(out.lengths) - 1] == 0)  # ended by EOS
    if name == "draft_lm":  # drafting under the mask: the self-draft is the constrained greedy path
        assert np.all(np.asarray(out.stats["tau"]) >= 3.0), out.stats["tau"]


@pytest.mark.slow  # ~20 s: the pushdown automaton's byte simulation compiles inside the tree step
def test_grammar_constraint(model):
    """A grammar (pushdown automaton on the device, per-row stacks) works the same way."""
    from jaxdecode.constraints.grammar import compile_grammar
    grammar = 'start: "(" item ")"\nitem: NUMBER | "[" item "," item "]"\nNUMBER: /[0-9]{1,3}/\n'
    c = compile_grammar(grammar, model.tokenizer, vocab_size=model.config.vocab_size, eos_ids=(0,)).constraint()
    ids = model.tokenizer("pair = ")["input_ids"]
    toks, lens = np.asarray([ids], np.int32), np.asarray([len(ids)], np.int32)
    ref = decode(model.config, model.params, toks, lens, max_new_tokens=16, eos_ids=(0,), constraint=c,
                 method="greedy")
    out = speculative_decode(model.config, model.params, _drafter(model, "adaptive"), toks, lens, max_new_tokens=16,
                             verifier=GREEDY, eos_ids=(0,), constraint=c)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert int(out.lengths[0]) > 2


def test_drafts_stay_inside_the_constraint(model, batch):
    """build_tree drafts among allowed tokens only: every node of a sampled tree is allowed after its
    parent's path, and each slot's distribution lives on its allowed set."""
    toks, lens, constraint, _ = batch
    c = constraint.prepare(model.config.vocab_size, (0,), 8, 2)
    b, v = 2, model.config.vocab_size
    logq = jax.nn.log_softmax(jax.random.normal(jax.random.PRNGKey(1), (16, v)))  # q(next | last token % 16)
    builder = StaticTreeBuilder.full((3, 2), "iid")
    ctx = DraftContext(history=jnp.asarray(toks), hist_len=jnp.asarray(lens), key=jax.random.PRNGKey(2),
                       constraint=c, cstate=c.init(b))
    @jax.jit
    def draft_and_prune(ctx):
        last = ctx.history[jnp.arange(b), ctx.hist_len - 1]
        tree, slots, _ = build_tree(builder, ctx, None, logq[last % 16], lambda s, start, t, p: (logq[t % 16], s),
                                    ctx.key)
        return tree, slots, spec.constrain_tree(c, ctx.cstate, tree, v, builder.max_depth, (0,))

    tree, slots, (pruned, _, allowed) = draft_and_prune(ctx)
    assert bool(jnp.all(pruned.valid == tree.valid)) and bool(jnp.all(tree.valid))
    has_children = np.isin(np.arange(builder.num_nodes + 1) - 1, np.asarray(tree.parents[0]))
    mass = jnp.sum(jnp.where(allowed, slots, 0.0), axis=-1)[:, has_children]
    np.testing.assert_allclose(np.asarray(mass), 1.0, atol=1e-5)


def test_refusals(model, batch):
    toks, lens, constraint, _ = batch
    from jaxdecode.constraints import TrieConstraint, build_index
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "items.txt")
        with open(path, "w") as f:
            f.write("5 6 7\n8 9\n")
        trie = build_index(path, model.config.vocab_size).constraint()
    assert isinstance(trie, TrieConstraint)
    drafter = _drafter(model, "prompt_lookup")
    with pytest.raises(SpeculativeError, match="per-row states"):
        speculative_decode(model.config, model.params, drafter, toks[:1], lens[:1], max_new_tokens=4,
                           verifier=GREEDY, eos_ids=(0,), constraint=trie)
    chain = make_drafter("draft_lm", model, draft=model, tree="chain:2:sample")
    with pytest.raises(SpeculativeError, match="'block' judges the whole draft"):
        speculative_decode(model.config, model.params, chain, toks, lens, max_new_tokens=4,
                           verifier=vf.get_verifier("block"), sampler=SamplerConfig(temperature=1.0), eos_ids=(0,),
                           constraint=constraint)


# ----------------------------------------------------------------------------------------------------
# Lossless sampling: χ² against the constrained target's exact law.

EOS = 0
# A: the start, not accepting; B: accepting (EOS allowed). Token 0 is the EOS id.
TRANSITIONS = {"A": {1: "A", 2: "B", 3: "B"}, "B": {4: "B", 5: "A", 1: "A"}}


def _automaton():
    return am.from_transitions(TRANSITIONS, "A", ["B"], vp.V, pattern="test", drop_ids=(EOS,))


def constrained_joint():
    """The constrained target's law of the first two tokens [V, V] (x2 = EOS also pads nothing: the
    row ends there, and the engine pads with the EOS id)."""
    joint = vp.exact_joint(vp.CFG, vp.PARAMS, vp.PROMPT, vp.V)
    p1 = joint.sum(1)
    p2 = joint / p1[:, None]
    auto = _automaton()
    s0 = auto.walk([])
    a1 = np.isin(np.arange(vp.V), auto.allowed_tokens(s0))
    q1 = p1 * a1 / (p1 * a1).sum()
    out = np.zeros((vp.V, vp.V))
    for x1 in np.flatnonzero(a1):
        s1 = auto.step(s0, x1)
        a2 = np.isin(np.arange(vp.V), auto.allowed_tokens(s1))
        a2[EOS] = bool(auto.final[s1])
        out[x1] = q1[x1] * p2[x1] * a2 / (p2[x1] * a2).sum()
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
    """q(next | last token) = exp(logq[last]) through a tree builder, per static row range: ranges
    ((builder, masked, start, stop), ...); masked: draft under the constraint (build_tree), else
    unconstrained drafts the engine prunes."""
    logq: jax.Array
    ranges: tuple = dataclasses.field(metadata=dict(static=True))

    num_nodes = property(lambda self: self.ranges[0][0].num_nodes)
    max_depth = property(lambda self: max(r[0].max_depth for r in self.ranges))
    child_rule = "iid"
    is_chain = False

    def init(self, prompt_tokens, prompt_lengths, cache_len, key):
        return jnp.zeros((), jnp.int32)

    def propose(self, state, ctx, sampler):
        parts = []
        for k, (builder, masked, a, z) in enumerate(self.ranges):
            sub = DraftContext(history=ctx.history[a:z], hist_len=ctx.hist_len[a:z], key=jax.random.fold_in(ctx.key, k),
                               constraint=ctx.constraint if masked else None,
                               cstate=jax.tree.map(lambda x, a=a, z=z: x[a:z], ctx.cstate) if masked else None)
            last = sub.history[jnp.arange(z - a), sub.hist_len - 1]
            tree, slots, _ = build_tree(builder, sub, None, self.logq[last],
                                        lambda s, start, t, p: (self.logq[t], s), sub.key)
            parts.append((tree, slots))
        tree, slots = jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)
        return tree, slots, state

    def observe(self, state, obs):
        return state


ROWS = 100_000
# (verifier, builder, drafts under the mask): every block 1e5 rows; the tree sizes match (one loop).
# PRUNED: drafts the engine prunes (q unmasked), the case the wrong rule below breaks.
PRUNED = ("specinfer", StaticTreeBuilder.full((2, 1), "iid"), False)
BLOCKS = (("specinfer", StaticTreeBuilder.full((2, 1), "iid"), True),
          ("spectr", StaticTreeBuilder.full((2, 1), "iid"), False),
          ("chain", StaticTreeBuilder.full((1, 1, 1, 1), "iid"), False))


def run_blocks(blocks, rows=ROWS, chunks=1):
    """Each block's first two tokens [rows, 2], from one compiled loop over all blocks."""
    ranges = tuple((b, masked, k * rows // chunks, (k + 1) * rows // chunks) for k, (_, b, masked) in enumerate(blocks))
    drafter = Rows(vp.LOGQ, ranges)
    verifier = vp.RowBlocks(tuple((vf.get_verifier(n), ((a, z),)) for (n, _, _), (_, _, a, z) in zip(blocks, ranges)))
    total = len(blocks) * rows // chunks
    prompts = np.tile(np.asarray(vp.PROMPT, np.int32), (total, 1))
    lengths = np.full((total,), len(vp.PROMPT), np.int32)
    constraint = _automaton().constraint()
    outs = []
    with pytest.MonkeyPatch.context() as mp:  # composite drafter / verifier: each block's pair is accepted
        mp.setattr(spec, "check_combination", lambda *a: None)
        for chunk in range(chunks):
            out = speculative_decode(vp.CFG, vp.PARAMS, drafter, prompts, lengths, max_new_tokens=2,
                                     verifier=verifier, sampler=vp.T1, eos_ids=(EOS,), constraint=constraint,
                                     key=jax.random.key(200 + chunk, impl="rbg"))
            outs.append(np.asarray(out.tokens))
    per = rows // chunks
    return [np.concatenate([o[k * per:(k + 1) * per] for o in outs]) for k in range(len(blocks))]


def _check_lossless(blocks):
    joint = constrained_joint()
    assert joint[:, 0].sum() > 0.05 and joint[1:4].sum() > 0.999  # EOS reachable; x1 only A's tokens
    for (name, _, masked), toks in zip(blocks, run_blocks(blocks)):
        p = vp.chi2_pvalue(toks, joint)
        assert p > vp.P_OK, (name, masked, p)


@pytest.mark.exec_bound  # 1e5 rows: running, not compiling (tests/conftest.py)
def test_constrained_sampling_is_lossless():
    _check_lossless((PRUNED,))


@pytest.mark.slow
def test_constrained_sampling_is_lossless_more_pairs():
    """Drafting under the mask (build_tree), SpecTr siblings and a chain, each 1e5 rows."""
    _check_lossless(BLOCKS)


@pytest.mark.exec_bound  # 1e5 rows: running, not compiling (tests/conftest.py)
def test_wrong_rule_fails_the_same_test():
    """Pruning forbidden children without renormalising q over the allowed ones: the survivors are
    draws from q restricted to the allowed set, verified as if drawn from q. Must fail."""
    broken = (PRUNED,)
    spec._speculative.clear_cache()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(spec, "mask_probs", lambda q, allowed: q)
        toks = run_blocks(broken)[0]
    spec._speculative.clear_cache()
    p = vp.chi2_pvalue(toks, constrained_joint())
    assert p < vp.P_BROKEN, p
