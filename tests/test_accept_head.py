"""The acceptance head (jaxdecode.drafters.accept_head, training/accept_head.py; issue 10 item 2).

Wrapped around a draft LM chain it only cuts the tail of each draft (invalid nodes), so greedy output
equals plain greedy and sampling stays lossless (χ² through the model loop, 1e5 rows; a deliberately
wrong cut that also drops the node whose own confidence crossed the threshold must fail the same test).
h = 0 verifies one node per step, h = 1 all K. Training on labels from real verification runs lowers
the held-out BCE, and the head is calibrated on held-out runs (ECE, 10 bins). save -> load -> decode.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters import load_drafter, make_drafter
from jaxdecode.drafters.accept_head import (AcceptHeadConfig, AcceptHeadDrafter, chain_features, head_logits,
                                            keep_mask, log_accept)
from jaxdecode.drafters.builders import ChainBuilder
from jaxdecode.drafters.draft_lm import DraftLM
from jaxdecode.models import ModelConfig, init_params
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import SpeculativeError, speculative_decode
from jaxdecode.verifiers import get_verifier

from test_verifier_pairs import chi2_pvalue, exact_joint

V = 64
K = 4
GREEDY = SamplerConfig(temperature=0.0)
HEAD = AcceptHeadConfig(hidden=8, max_depth=8)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 9, 9, 9, 9, 9, 9], [3]]


def _perturbed(params, scale, seed):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(tree, [a + scale * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)])


def tiny_pair(vocab=V, layers=2, hidden=32, noise=0.03):
    """A random target and a draft LM = the target with noise (acceptance ~ 0.4-0.6 per position)."""
    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=256, sliding_windows=(0,) * layers)
    target = init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    return cfg, target, _perturbed(target, noise, 1)


def manual_head(cfg: AcceptHeadConfig, slope=3.0, bias=2.0):
    """Head params with logit ~ bias + slope * log q(token): confident drafts are kept, others cut. With
    drafter_proj, a random projection of the drafter's state moves the same hidden unit (so it matters)."""
    w = np.zeros((cfg.input_dim, cfg.hidden), np.float32)
    w[0, 0] = -1.0  # hidden unit 0 = silu(-log q(token)): grows as the draft is less sure
    out = np.zeros((cfg.hidden, 1), np.float32)
    out[0, 0] = -slope
    head = {"inp": {"kernel": jnp.asarray(w), "bias": jnp.zeros((cfg.hidden,))},
            "out": {"kernel": jnp.asarray(out), "bias": jnp.full((1,), bias)}}
    if cfg.drafter_proj:
        head["inp"]["kernel"] = head["inp"]["kernel"].at[-cfg.drafter_proj:, 0].set(1.0)
        head["drafter"] = {"kernel": jax.random.normal(jax.random.PRNGKey(5), (cfg.drafter_state_dim,
                                                                              cfg.drafter_proj)),
                           "bias": jnp.zeros((cfg.drafter_proj,))}
    return head


CFG, TARGET, DRAFT = tiny_pair()


def wrapped(threshold, stop_drafting=True, rule="argmax", k=K, head=None):
    inner = DraftLM(params=DRAFT, config=CFG, builder=ChainBuilder(k, rule))
    return AcceptHeadDrafter.wrap(inner, manual_head(HEAD) if head is None else head, HEAD, threshold,
                                  stop_drafting)


def greedy_reference(prompts, n):
    toks, lens = pad_prompts(prompts)
    return decode(CFG, TARGET, toks, lens, max_new_tokens=n, sampler=GREEDY, method="greedy").tokens


# ----------------------------------------------------------------------------------------------------
def test_keep_mask_rule():
    logits = jnp.asarray([[10.0, 10.0, -10.0, 10.0], [0.0, 0.0, 0.0, 0.0]])
    p = np.exp(np.cumsum(np.asarray(log_accept(logits)), axis=1))  # prod p so far
    assert np.allclose(p[1], 0.5 ** np.arange(1, 5), rtol=1e-5)
    # row 0: risk ~0, ~0, ~1: the node that crosses h (index 2) is still verified, index 3 is not
    np.testing.assert_array_equal(np.asarray(keep_mask(logits, 0.5)), [[1, 1, 1, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(np.asarray(keep_mask(logits, 0.0)), [[1, 0, 0, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(keep_mask(logits, 1.0)), np.ones((2, 4), bool))


def test_greedy_equals_plain_greedy_and_thresholds_bound_the_draft():
    """Batch 4, ragged prompts; h is an array leaf, so every threshold runs the same compiled loop."""
    toks, lens = pad_prompts(PROMPTS)
    ref = np.asarray(greedy_reference(PROMPTS, 24))
    hists = {}
    for h in (0.0, 0.3, 1.0):
        out = speculative_decode(CFG, TARGET, wrapped(h), toks, lens, max_new_tokens=24,
                                 verifier=get_verifier("greedy"))
        np.testing.assert_array_equal(np.asarray(out.tokens), ref, err_msg=f"h={h}")
        hists[h] = np.asarray(out.stats["accept_hist"]).sum(0)  # per row -> the batch's
    assert hists[0.0][2:].sum() == 0 and hists[0.0][1] > 0, "h = 0 verifies exactly one node per step"
    assert hists[1.0][K] > 0, "h = 1 verifies all K nodes"
    assert hists[0.3][1:].sum() > 0 and not np.array_equal(hists[0.3], hists[1.0])


@functools.partial(jax.jit, static_argnames="temperature")
def _propose(drafter, toks, lens, key, temperature):
    from jaxdecode.speculative import DraftContext
    state = drafter.init(toks, lens, 64, jax.random.PRNGKey(0))
    ctx = DraftContext(history=toks, hist_len=lens, key=key)
    tree, slots, _ = drafter.propose(state, ctx, SamplerConfig(temperature=temperature))
    return tree, slots


def test_early_stop_drafts_what_the_tail_cut_keeps(rule="sample", temperature=1.0):
    """Stopping the draft LM's level loop (a while_loop) proposes exactly the valid nodes (tokens and
    draft distributions) that drafting all K levels and cutting the tail does, for any h; h = 0 keeps
    one node, h = 1 all K. So the χ² test of the tail cut covers the early stop too."""
    toks, lens = map(jnp.asarray, pad_prompts(PROMPTS))
    for h in (0.0, 0.5, 1.0):
        (t1, s1), (t0, s0) = [_propose(wrapped(h, stop, rule), toks, lens, jax.random.PRNGKey(1), temperature)
                              for stop in (True, False)]
        v = np.asarray(t1.valid)
        np.testing.assert_array_equal(v, np.asarray(t0.valid))
        np.testing.assert_array_equal(np.where(v, t1.tokens, -1), np.where(v, t0.tokens, -1))
        # slot i holds the q node i was drafted from: the verifier reads it only for valid nodes
        np.testing.assert_allclose(np.asarray(s1)[:, :K][v], np.asarray(s0)[:, :K][v], atol=1e-6)
        if h == 0.0:
            assert v.sum(1).tolist() == [1] * len(PROMPTS)
        if h == 1.0:
            assert v.all()
    assert wrapped(0.5).verify_widths == (1, 2, 3, 4)


def test_bad_inner_drafters_and_thresholds_are_refused():
    from jaxdecode.drafters.ngram import PromptLookupDrafter
    from jaxdecode.drafters.builders import StaticTreeBuilder
    with pytest.raises(SpeculativeError, match="point masses"):
        AcceptHeadDrafter.wrap(PromptLookupDrafter(num_nodes=4), manual_head(HEAD), HEAD)
    with pytest.raises(SpeculativeError, match="chain"):
        AcceptHeadDrafter.wrap(DraftLM(params=DRAFT, config=CFG, builder=StaticTreeBuilder.full((2, 1))),
                               manual_head(HEAD), HEAD)
    with pytest.raises(SpeculativeError, match=r"positions 1..8"):
        wrapped(0.5, k=9)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        wrapped(1.5)


def test_catch_up_lag_is_the_inner_drafters():
    """Over a draft LM (which catches up lazily) the head reports the draft LM's lag on its part of the
    state; over a drafter that keeps up it has none, so calibration times no catch-up for it."""
    import types
    from jaxdecode.drafters.ngram import PromptLookupDrafter
    head = wrapped(0.5)
    state = (types.SimpleNamespace(lengths=jnp.asarray([3, 4])), None)  # (the draft LM's cache, features)
    np.testing.assert_array_equal(np.asarray(head.catch_up_lag(state, jnp.asarray([5, 9]))), [2, 5])
    assert dataclasses.replace(head, inner=PromptLookupDrafter(num_nodes=4)).catch_up_lag is None


# ----------------------------------------------------------------------------------------------------
# Lossless sampling through the model loop (the χ² harness of test_verifier_pairs).
SV = 6
ROWS = 100_000  # per case
CHUNKS = 5


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CutRows(AcceptHeadDrafter):
    """The tail cut (stop_drafting=False) on rows < wrong_from; on the rest a deliberately wrong cut
    that also drops the node whose OWN confidence pushed the risk over h, so whether token i is
    proposed depends on token i itself and the verifier's q is not the proposal law."""
    wrong_from: int = dataclasses.field(default=0, metadata=dict(static=True))

    def propose(self, state, ctx, sampler):
        inner_state, tfeat = state
        tree, slots, inner_state = self.inner.propose(inner_state, ctx, sampler)
        ds = inner_state.sources if self.head_config.drafter_proj else None
        lg = head_logits(self.params, self.head_config, chain_features(tree, slots),
                         jnp.arange(tree.tokens.shape[1]), drafter_state=ds)
        own = 1.0 - jnp.exp(jnp.cumsum(log_accept(lg), axis=1)) <= self.threshold
        wrong = (jnp.arange(tree.tokens.shape[0]) >= self.wrong_from)[:, None]
        keep = jnp.where(wrong, own, keep_mask(lg, self.threshold))
        return tree.replace(valid=tree.valid & keep), slots, (inner_state, tfeat)


def check_lossless_through_the_loop(cfg, target, inner, head_cfg, seed: int):
    """One compiled loop: rows verified by the chain verifier, rows by the block verifier, and rows with
    the wrong cut (chain verifier), 1e5 each, `inner` sampling a chain:2 under the head; χ² of the first
    two tokens against the exact law: the first two pass, the wrong cut fails."""
    from test_verifier_pairs import RowBlocks
    import jaxdecode.speculative as spec
    prompt = [2, 5]
    per = ROWS // CHUNKS
    cases = (("chain", "lossless"), ("block", "lossless"), ("chain", "broken"))
    if head_cfg.drafter_proj:  # the tail cut reads the states the chain recorded
        inner = dataclasses.replace(inner, record_sources=True)
    drafter = CutRows(inner=inner, params=manual_head(head_cfg, slope=4.0, bias=3.0), threshold=jnp.float32(0.4),
                      head_config=head_cfg, stop_drafting=False, wrong_from=2 * per)
    spans = {}
    for i, (name, _) in enumerate(cases):
        spans.setdefault(name, []).append((i * per, (i + 1) * per))
    verifier = RowBlocks(tuple((get_verifier(n), tuple(sp)) for n, sp in spans.items()))
    toks = np.tile(np.asarray(prompt, np.int32), (len(cases) * per, 1))
    lens = np.full((len(toks),), len(prompt), np.int32)
    outs = []
    with pytest.MonkeyPatch.context() as mp:  # the row-block verifier declares no child rules
        mp.setattr(spec, "check_combination", lambda *a: None)
        for chunk in range(CHUNKS):
            out = speculative_decode(cfg, target, drafter, toks, lens, max_new_tokens=2, verifier=verifier,
                                     sampler=SamplerConfig(temperature=1.0),
                                     key=jax.random.key(seed + chunk, impl="rbg"))
            outs.append(np.asarray(out.tokens))
    joint = exact_joint(cfg, target, prompt, SV)
    report = [(name, expect, chi2_pvalue(np.concatenate([o[i * per:(i + 1) * per] for o in outs]), joint))
              for i, (name, expect) in enumerate(cases)]
    print(report)
    for name, expect, p in report:
        assert (p > 1e-4) if expect == "lossless" else (p < 1e-6), report
    # the lossless rows are verified as the engine would verify them by name
    spec.check_combination(cfg, AcceptHeadDrafter.wrap(inner, drafter.params, head_cfg), get_verifier("block"),
                           SamplerConfig(temperature=1.0))


@pytest.mark.exec_bound  # 1e5 rows: running, not compiling (tests/conftest.py)
def test_sampling_is_lossless_through_the_model_loop():
    """The head over a draft LM chain (see check_lossless_through_the_loop)."""
    cfg, target, draft = tiny_pair(vocab=SV, layers=1, hidden=8, noise=0.5)
    inner = DraftLM(params=draft, config=cfg, builder=ChainBuilder(2, "sample"))
    check_lossless_through_the_loop(cfg, target, inner, HEAD, seed=200)


# ----------------------------------------------------------------------------------------------------
# Training on real verification runs, calibration, save / load.
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The whole recipe (training.accept_head.train_accept_head) on the tiny pair: label runs at T=0
    (greedy verifier) and T=0.7 (chain verifier) on training prompts and on held-out prompts, BCE
    training, the held-out report, the drafter directory."""
    from jaxdecode.training.accept_head import train_accept_head
    from jaxdecode.training.trainer import TrainConfig
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, V, rng.integers(2, 9))] for _ in range(48)]
    tc = TrainConfig(steps=200, learning_rate=1e-2, warmup_steps=10, log_every=50, eval_every=0,
                     checkpoint_every=0, progress=False, data_parallel=1)
    base = tmp_path_factory.mktemp("head")
    return train_accept_head(jaxdecode.Model(config=CFG, params=TARGET), jaxdecode.Model(config=CFG, params=DRAFT),
                             out_dir=base / "head", train_config=tc, k=K, temperatures=(0.0, 0.7),
                             train_prompts=prompts[:32], heldout_prompts=prompts[32:], new_tokens=24,
                             batch_rows=16, batch_size=128,
                             config_overrides={"hidden": HEAD.hidden, "max_depth": HEAD.max_depth})


def test_labels_follow_the_verifier(trained):
    data = trained.train_data
    lab, mask = data["label"], data["mask"]
    assert data["x"].shape[1:] == (K, 3) and data["tfeat"].shape[1] == CFG.hidden_size
    # masked positions: accepted ones then the first rejection (conditional convention)
    first_zero = np.argmax(np.concatenate([lab, np.zeros((len(lab), 1))], axis=1) == 0, axis=1)
    np.testing.assert_array_equal(mask.sum(1), np.minimum(first_zero + 1, K))
    assert 0.2 < lab[mask > 0].mean() < 0.8, "the tiny pair should accept some drafts and reject others"
    assert np.all(data["x"][..., 0] <= data["x"][..., 1] + 1e-6)  # log q(token) <= log max q


def test_training_lowers_bce_and_the_head_is_calibrated(trained):
    """Held-out label runs (prompts the head never saw, T=0 and T=0.7 pooled): BCE below the untrained
    head's and below the constant training acceptance rate's; ECE (10 bins) < 0.1."""
    from flax import nnx

    from jaxdecode.training.accept_head import AcceptHeadModule, bce, concat_labels, ece, params_of, predict
    held, data = concat_labels(*trained.heldout_data.values()), trained.train_data
    untrained = params_of(AcceptHeadModule(HEAD, CFG, nnx.Rngs(0)))
    before = bce(predict(untrained, HEAD, held), held["label"], held["mask"])
    p = predict(trained.head.params, HEAD, held)
    after = bce(p, held["label"], held["mask"])
    constant = bce(np.full(p.shape, data["label"][data["mask"] > 0].mean()), held["label"], held["mask"])
    err = ece(p, held["label"], held["mask"])
    print(f"held-out BCE untrained {before:.3f} -> trained {after:.3f} (constant {constant:.3f}), ECE {err:.3f}; "
          f"per temperature {trained.report}")
    assert len(held["x"]) > 300
    assert after < before and after < constant
    assert err < 0.1


def test_speed_estimate_brackets(trained):
    """The offline estimate: h = 0 is fixed length 1 and h = 1 fixed length K; the saved threshold is
    the best of the grid on the training runs."""
    from jaxdecode.training.accept_head import choose_threshold, speed_estimate
    est = speed_estimate(trained.head.params, HEAD, trained.train_data, [0.0, 1.0, trained.cfg.threshold])
    assert est["head"][0.0] == pytest.approx(est["fixed"][1]) and est["head"][1.0] == pytest.approx(est["fixed"][K])
    grid = [round(x, 2) for x in np.linspace(0.05, 0.95, 19)]
    assert trained.cfg.threshold == choose_threshold(speed_estimate(trained.head.params, HEAD,
                                                                    trained.train_data, grid))
    for r in trained.report.values():
        assert {"head", "best_fixed", "best_fixed_k", "threshold"} <= set(r["estimate"])


def test_stopping_ceilings_price_each_rule_by_hand():
    """Accepted lengths 0, 1, 2 of a chain:2 run; chain:1 steps cost 2 s, chain:2 steps 3 s, a plain step 1 s.
    6 tokens in all (min(a, 2) + 1 each). Fixed 1: 5 tokens / 6 s; fixed 2: 6 / 9. The head's rule with a
    perfect head drafts a + 1 (capped at 2): 2 + 3 + 3 s; foresight drafts max(a, 1): 2 + 2 + 3 s; with the
    skip a plain step where nothing is accepted: 1 + 2 + 3 s."""
    from jaxdecode.training.accept_head import stopping_ceilings
    c = stopping_ceilings(np.array([0, 1, 2]), {1: 2.0, 2: 3.0}, 1.0, 2, rules={"ones": np.ones(3, int),
                                                                              "skip": np.array([0, 1, 2])})
    assert c["fixed"] == pytest.approx({1: 5 / 6, 2: 6 / 9})
    assert c["head_rule"] == pytest.approx(6 / 8) and c["foresight"] == pytest.approx(6 / 7)
    assert c["foresight_and_skip"] == pytest.approx(1.0) and c["plain"] == pytest.approx(1.0)
    assert c["rules"] == pytest.approx({"ones": c["fixed"][1], "skip": c["foresight_and_skip"]})
    with pytest.raises(ValueError, match="one per step in 0..2"):
        stopping_ceilings(np.array([0, 1, 2]), {1: 2.0, 2: 3.0}, 1.0, 2, rules={"long": np.array([3, 3, 3])})
    with pytest.raises(ValueError, match="chain:1 and chain:4"):
        stopping_ceilings(np.array([0, 1]), {1: 2.0, 2: 3.0}, 1.0, 4)
    with pytest.raises(ValueError, match="no verification steps"):
        stopping_ceilings(np.array([], int), {1: 2.0, 2: 3.0}, 1.0, 2)


def test_save_load_decode_round_trip(trained):
    """train_accept_head's directory -> load_drafter -> make_drafter by name -> greedy == plain greedy."""
    target = jaxdecode.Model(config=CFG, params=TARGET)
    draft = jaxdecode.Model(config=CFG, params=DRAFT)
    loaded = load_drafter(trained.out_dir, target)
    assert loaded.name == "accept_head" and loaded.cfg == trained.cfg and "T=0" in loaded.extra["heldout"]
    assert dataclasses.replace(trained.cfg, threshold=HEAD.threshold, draft_len=HEAD.draft_len) == HEAD
    assert trained.cfg.draft_len == K
    jax.tree.map(np.testing.assert_array_equal, loaded.params, trained.head.params)
    drafter = make_drafter("accept_head", target, drafter_dir=trained.out_dir, draft=draft,
                           threshold=0.5)  # tree: chain:K, the length it was trained on
    assert isinstance(drafter, AcceptHeadDrafter) and drafter.num_nodes == K
    toks, lens = pad_prompts(PROMPTS)
    out = speculative_decode(CFG, TARGET, drafter, toks, lens, max_new_tokens=24, verifier=get_verifier("greedy"))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(greedy_reference(PROMPTS, 24)))
    wrong = ModelConfig(**{**dataclasses.asdict(CFG), "hidden_size": 48, "head_dim": 12})
    with pytest.raises(jaxdecode.drafters.DrafterLoadError, match="hidden_size"):
        load_drafter(trained.out_dir, jaxdecode.Model(config=wrong, params=None))
    with pytest.raises(ValueError, match="'accept_head' takes no option 'treshold'; its options: draft_model, "
                                         "threshold, stop_drafting, inner_dir"):  # not Python's TypeError
        make_drafter("accept_head", target, drafter_dir=trained.out_dir, draft=draft, treshold=0.5)


# ----------------------------------------------------------------------------------------------------
# The head over a drafter that reads the target's features (EAGLE-3; DSpark's confidence head).
def eagle3_inner(cfg, params, k=K, rule="argmax", seed=4, noise=0.5, oracle=False):
    """An EAGLE-3 chain drafter: random, or (oracle, for test_eagle3's bigram target) one that predicts
    the target up to head noise."""
    from jaxdecode.drafters import eagle3 as e3
    from test_eagle3 import oracle_params, random_drafter_params
    ec = e3.default_config(cfg)
    p = (oracle_params(ec, cfg, params, noise=noise) if oracle else
         random_drafter_params(ec, cfg, seed=seed, noise=noise))
    return e3.Eagle3Drafter.build(p, ec, cfg, params, ChainBuilder(k, rule)), ec, p


def bigram_target():
    from test_eagle3 import tiny
    return tiny(bigram=True)


def projected_head(cfg: AcceptHeadConfig, d: int):
    """manual_head plus a (small, random) projection of the target's bonus-slot state."""
    head = manual_head(cfg)
    head["inp"]["kernel"] = head["inp"]["kernel"].at[-cfg.target_proj:, 1].set(0.1)
    head["target"] = {"kernel": 0.3 * jax.random.normal(jax.random.PRNGKey(3), (d, cfg.target_proj)),
                      "bias": jnp.zeros((cfg.target_proj,))}
    return head


@pytest.mark.parametrize("target_proj", [0, 4])
def test_head_over_eagle3_greedy_equals_plain_greedy(target_proj):
    """Batch 4, ragged prompts: the head cuts (and stops) EAGLE-3's chain; the inner drafter gets its own
    features, the head the bonus-slot state after them; output == plain greedy for every h."""
    from jaxdecode.speculative import FINAL
    mcfg, params = bigram_target()
    inner, _, _ = eagle3_inner(mcfg, params, noise=0.1, oracle=True)
    cfg = dataclasses.replace(HEAD, target_proj=target_proj, inner="eagle3")
    head = projected_head(cfg, mcfg.hidden_size) if target_proj else manual_head(cfg)
    toks, lens = pad_prompts(PROMPTS)
    ref = np.asarray(decode(mcfg, params, toks, lens, max_new_tokens=24, sampler=GREEDY, method="greedy").tokens)
    for h in (0.0, 0.5, 1.0):
        drafter = AcceptHeadDrafter.wrap(inner, head, cfg, h)
        assert drafter._can_stop_early()
        assert drafter.feature_layers == inner.feature_layers + ((FINAL,) if target_proj else ())
        out = speculative_decode(mcfg, params, drafter, toks, lens, max_new_tokens=24,
                                 verifier=get_verifier("greedy"))
        np.testing.assert_array_equal(np.asarray(out.tokens), ref, err_msg=f"h={h}")
        hist = np.asarray(out.stats["accept_hist"]).sum(0)
        if h == 0.0:
            assert hist[2:].sum() == 0
        if h == 1.0:
            assert np.asarray(out.stats["tau"]).max() > 1.2, "the inner drafter should get drafts accepted"


def test_head_over_eagle3_states_cuts_alike_while_drafting_and_after():
    """drafter_proj: the head reads EAGLE-3's layer state per position, while the chain is drafted
    (StoppingChainBuilder.source) or recorded after it (stop_drafting=False): the same cuts, output ==
    plain greedy, and the states move the cuts (a head without them cuts elsewhere)."""
    from jaxdecode.drafters.eagle3 import Eagle3Error
    mcfg, params = bigram_target()
    inner, _, _ = eagle3_inner(mcfg, params, noise=0.1, oracle=True)
    cfg = dataclasses.replace(HEAD, inner="eagle3", drafter_proj=4, drafter_state_dim=inner.source_state_dim)
    head = manual_head(cfg)
    toks, lens = pad_prompts(PROMPTS)
    ref = np.asarray(decode(mcfg, params, toks, lens, max_new_tokens=24, sampler=GREEDY, method="greedy").tokens)
    for h in (0.3, 0.6):
        hists = []
        blind = {**head, "drafter": {**head["drafter"], "kernel": 0 * head["drafter"]["kernel"]}}  # states unread
        for stop, params_ in ((True, head), (False, head), (True, blind)):
            drafter = AcceptHeadDrafter.wrap(inner, params_, cfg, h, stop_drafting=stop)
            assert drafter._can_stop_early() == stop and drafter.inner.record_sources == (not stop)
            out = speculative_decode(mcfg, params, drafter, toks, lens, max_new_tokens=24,
                                     verifier=get_verifier("greedy"))
            np.testing.assert_array_equal(np.asarray(out.tokens), ref, err_msg=f"h={h} stop={stop}")
            hists.append(np.asarray(out.stats["accept_hist"]))
        np.testing.assert_array_equal(hists[0], hists[1], err_msg=f"h={h}")
        assert not np.array_equal(hists[0], hists[2]), "the drafter's states should move the cuts"
    # refused: a drafter without states, states of another width, recording a branching tree's
    draft = DraftLM(params=DRAFT, config=CFG, builder=ChainBuilder(K, "argmax"))
    with pytest.raises(SpeculativeError, match="does not give"):
        AcceptHeadDrafter.wrap(draft, manual_head(cfg), cfg, 0.5)
    with pytest.raises(SpeculativeError, match="states 5 wide"):
        AcceptHeadDrafter.wrap(inner, head, dataclasses.replace(cfg, drafter_state_dim=5), 0.5)
    from jaxdecode.drafters.builders import StaticTreeBuilder
    tree_inner = dataclasses.replace(inner, builder=StaticTreeBuilder(((0,), (1,), (0, 0))), record_sources=True)
    with pytest.raises(Eagle3Error, match="chain"):
        speculative_decode(mcfg, params, tree_inner, toks, lens, max_new_tokens=4, verifier=get_verifier("greedy"))
    with pytest.raises(ValueError, match="drafter_state_dim"):
        AcceptHeadConfig(drafter_proj=4)


@pytest.mark.exec_bound  # 1e5 rows: running, not compiling (tests/conftest.py)
@pytest.mark.parametrize("drafter_proj", [0, 4])
def test_head_over_eagle3_sampling_is_lossless(drafter_proj):
    """The head over EAGLE-3 sampling the chain (see check_lossless_through_the_loop); with drafter_proj the
    cut also reads the layer state each token was drafted from (known before the token is drawn)."""
    cfg, target, _ = tiny_pair(vocab=SV, layers=2, hidden=8, noise=0.5)
    inner, _, _ = eagle3_inner(cfg, target, k=2, rule="sample", noise=1.0)
    head_cfg = dataclasses.replace(HEAD, inner="eagle3", drafter_proj=drafter_proj,
                                   drafter_state_dim=inner.source_state_dim if drafter_proj else 0)
    check_lossless_through_the_loop(cfg, target, inner, head_cfg, seed=300 + drafter_proj)


def _saved_eagle3_and_prompts(tmp_path, seed: int, n: int, steps: int):
    """The bigram target, an oracle EAGLE-3 over it saved to tmp_path/eagle3, n random prompts and a
    TrainConfig of `steps`: what the heads trained over EAGLE-3 start from."""
    from jaxdecode.drafters.trained import save_drafter
    from jaxdecode.training.trainer import TrainConfig
    mcfg, params = bigram_target()
    inner, ec, p = eagle3_inner(mcfg, params, noise=0.1, oracle=True)
    e3_dir = save_drafter(tmp_path / "eagle3", "eagle3", ec, p, mcfg)
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(1, V, rng.integers(2, 9))] for _ in range(n)]
    tc = TrainConfig(steps=steps, learning_rate=1e-2, warmup_steps=max(steps // 12, 1), log_every=steps // 2,
                     eval_every=0, checkpoint_every=0, progress=False, data_parallel=1)
    return mcfg, params, inner, e3_dir, jaxdecode.Model(config=mcfg, params=params), prompts, tc


def test_train_over_eagle3_states_save_load_decode(tmp_path):
    """train_accept_head(inner='eagle3', drafter_proj=P) records EAGLE-3's state per position in its label
    runs (float16), sets drafter_state_dim from the drafter, and the saved head decodes == plain greedy."""
    from jaxdecode.training.accept_head import DSTATE, predict, train_accept_head
    mcfg, params, inner, e3_dir, target, prompts, tc = _saved_eagle3_and_prompts(tmp_path, seed=2, n=16, steps=20)
    run = train_accept_head(target, None, out_dir=tmp_path / "head", train_config=tc, k=K, temperatures=(0.0,),
                            train_prompts=prompts[:12], heldout_prompts=prompts[12:], new_tokens=12,
                            batch_rows=8, batch_size=32, inner="eagle3", inner_dir=e3_dir,
                            config_overrides={"hidden": HEAD.hidden, "max_depth": HEAD.max_depth, "drafter_proj": 3})
    width = inner.source_state_dim
    assert (run.cfg.drafter_proj, run.cfg.drafter_state_dim) == (3, width)
    ds = run.train_data[DSTATE]
    assert ds.shape == run.train_data["x"].shape[:2] + (width,) and ds.dtype == np.float16
    assert np.abs(ds).max() > 0  # real states, not the zeros init wrote
    assert np.isfinite(predict(run.head.params, run.cfg, run.heldout_data["T=0"])).all()
    loaded = load_drafter(run.out_dir, target)
    assert loaded.cfg == run.cfg and loaded.params["drafter"]["kernel"].shape == (width, 3)
    drafter = make_drafter("accept_head", target, drafter_dir=run.out_dir, inner_dir=e3_dir, threshold=0.5)
    toks, lens = pad_prompts(PROMPTS)
    out = speculative_decode(mcfg, params, drafter, toks, lens, max_new_tokens=16, verifier=get_verifier("greedy"))
    ref = decode(mcfg, params, toks, lens, max_new_tokens=16, sampler=GREEDY, method="greedy").tokens
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref))
    draft = jaxdecode.Model(config=CFG, params=DRAFT)
    with pytest.raises(ValueError, match="does not give"):
        train_accept_head(target, draft, out_dir=tmp_path / "x", train_config=tc, k=K, temperatures=(0.0,),
                          train_prompts=prompts, heldout_prompts=prompts, config_overrides={"drafter_proj": 3})


def test_train_over_eagle3_save_load_decode(tmp_path):
    """train_accept_head(inner='eagle3') labels real runs of a saved EAGLE-3 drafter, records the inner
    kind in the config, and make_drafter('accept_head') rebuilds head + EAGLE-3 from the directories:
    greedy == plain greedy. A draft LM given to an EAGLE-3 head is refused."""
    from jaxdecode.training.accept_head import train_accept_head
    mcfg, params, _, e3_dir, target, prompts, tc = _saved_eagle3_and_prompts(tmp_path, seed=1, n=24, steps=60)
    run = train_accept_head(target, None, out_dir=tmp_path / "head", train_config=tc, k=K, temperatures=(0.0,),
                            train_prompts=prompts[:16], heldout_prompts=prompts[16:], new_tokens=16,
                            batch_rows=8, batch_size=64, inner="eagle3", inner_dir=e3_dir,
                            config_overrides={"hidden": HEAD.hidden, "max_depth": HEAD.max_depth})
    assert run.cfg.inner == "eagle3" and run.train_data["x"].shape[1:] == (K, 3)
    lab = run.train_data["label"][run.train_data["mask"] > 0]
    assert 0.1 < lab.mean() < 0.95, "the noisy oracle should have some drafts accepted and some rejected"
    loaded = load_drafter(run.out_dir, target)
    assert loaded.cfg.inner == "eagle3" and loaded.extra["inner"] == "eagle3"
    drafter = make_drafter("accept_head", target, drafter_dir=run.out_dir, inner_dir=e3_dir, threshold=0.5)
    assert isinstance(drafter, AcceptHeadDrafter) and drafter.num_nodes == K
    toks, lens = pad_prompts(PROMPTS)
    out = speculative_decode(mcfg, params, drafter, toks, lens, max_new_tokens=24, verifier=get_verifier("greedy"))
    ref = decode(mcfg, params, toks, lens, max_new_tokens=24, sampler=GREEDY, method="greedy").tokens
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref))
    # the inner drafter's directory is recorded beside the head (relative to it), so the printed
    # `--drafter accept_head --drafter-dir HEAD` runs without naming it; it moves with the head
    assert loaded.extra["inner_dir_relative"] == "../eagle3"
    moved = tmp_path / "moved"
    moved.mkdir()
    for d in ("head", "eagle3"):
        (tmp_path / d).rename(moved / d)
    bare = make_drafter("accept_head", target, drafter_dir=moved / "head", threshold=0.5)
    out = speculative_decode(mcfg, params, bare, toks, lens, max_new_tokens=24, verifier=get_verifier("greedy"))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref))
    (moved / "eagle3").rename(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="trained over the 'eagle3' drafter, whose directory is not found.*inner_dir"):
        load_drafter(moved / "head", target).make(target, threshold=0.5)  # not the built one, kept by make_drafter
    e3_dir = tmp_path / "elsewhere"
    draft = jaxdecode.Model(config=mcfg, params=params)
    with pytest.raises(SpeculativeError, match="without a draft LM"):
        make_drafter("accept_head", target, drafter_dir=moved / "head", inner_dir=e3_dir, draft=draft)
    with pytest.raises(ValueError, match="drafts without a draft LM"):
        train_accept_head(target, draft, out_dir=tmp_path / "x",
                          train_config=tc, inner="eagle3", inner_dir=e3_dir, train_prompts=prompts,
                          heldout_prompts=prompts)
