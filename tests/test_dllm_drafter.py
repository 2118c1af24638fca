"""The dLLM drafter (jaxdecode.drafters.diffusion): a masked-diffusion LM drafting a chain in one forward.

Greedy speculative decoding with it reproduces the target's greedy output (a random dLLM whose
vocabulary adds its MASK after the target's; the target's own weights as a block-size-1 dLLM with
logits shift 1, whose first slot is then the target's own next-token prediction, so drafts are
accepted), with adaptive speculation on and off, inside the user's own jax.jit, through generate and
the CLI. Bad inputs are refused clearly. Sampling losslessness: tests/test_verifier_pairs.py.
"""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters import make_drafter
from jaxdecode.drafters.diffusion import DiffusionDrafter, DiffusionDrafterError
from jaxdecode.model import Model
from jaxdecode.models import ModelConfig, init_params
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import DraftContext, policy_for, speculative_decode
from jaxdecode.verifiers import get_verifier

G = SamplerConfig(temperature=0.0)
PROMPTS = [[3, 9, 27, 4, 1, 7, 7], [8, 2], [5, 5, 5], [60, 1, 33, 7]]
N = 12


def _tiny(vocab=64, layers=2, seed=0, d=32, params=True, **kw):
    """A tiny random llama-form model; params=False: config only (for checks that never run it)."""
    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=d, intermediate_size=2 * d,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=d // 4,
                      max_position_embeddings=256, sliding_windows=(0,) * layers, **kw)
    return Model(cfg, init_params(cfg, jax.random.PRNGKey(seed), std=0.3) if params else None)


@pytest.fixture(scope="module")
def models():
    target = _tiny()
    # A different random model of the same shape (the target's weights with random signs: no compile of
    # another init), whose vocabulary appends its MASK (id 64) after the target's 64 ids.
    rng = np.random.default_rng(1)
    p = jax.tree.map(lambda a: np.asarray(a) * rng.choice([-1.0, 1.0], size=a.shape).astype(np.float32),
                     target.params)
    p["embed"] = np.concatenate([p["embed"], p["embed"][:1]], axis=0)
    p["lm_head"] = np.concatenate([p["lm_head"], p["lm_head"][:, :1]], axis=1)
    dllm = Model(target.config.replace(vocab_size=65, attention="bidirectional", mask_token_id=64),
                 jax.tree.map(jnp.asarray, p))
    # The target as a block diffusion LM with blocks of 1 (= causal) and logits shift 1: slot 0 is read
    # at the pending token's column, i.e. it is the target's own next-token distribution.
    self_dllm = Model(target.config.replace(attention="block", block_size=1, logits_shift=1, mask_token_id=0),
                      target.params)
    return target, dllm, self_dllm


@pytest.fixture(scope="module")
def reference(models):
    target = models[0]
    prompts, lengths = pad_prompts(PROMPTS)
    ref = decode(target.config, target.params, prompts, lengths, max_new_tokens=N, sampler=G, method="greedy")
    return prompts, lengths, np.asarray(ref.tokens)


class Costs:  # synthetic costs: verification nearly free, drafting cheap (the policy keeps drafting)
    draft_seconds, idle_seconds = 0.05, 0.0

    def verify_at(self, width):
        return 1.0 + 0.01 * width


def test_greedy_equals_target_greedy_inside_jit(models, reference):
    """A random dLLM (window shorter than some prompts, 2 refinement forwards) drafting in the user's
    own jax.jit: the drafter is a pytree argument."""
    target, dllm, _ = models
    prompts, lengths, ref = reference
    drafter = make_drafter("dllm", target, draft=dllm, tree="chain:3", window=4, steps=2)
    assert isinstance(drafter, DiffusionDrafter) and drafter.chunk_starts == (2,)
    run = jax.jit(lambda d, p, n: speculative_decode(target.config, target.params, d, p, n, max_new_tokens=N,
                                                     verifier=get_verifier("greedy"), sampler=G).tokens)
    np.testing.assert_array_equal(np.asarray(run(drafter, prompts, lengths)), ref)


def test_greedy_equals_target_greedy_adaptive(models, reference):
    """The self-dLLM's first slot is the target's prediction: >= 1 draft token accepted per step while
    the adaptive policy sizes the drafts."""
    target, _, self_dllm = models
    prompts, lengths, ref = reference
    drafter = make_drafter("dllm", target, draft=self_dllm, tree="chain:2")
    out = speculative_decode(target.config, target.params, drafter, prompts, lengths, max_new_tokens=N,
                             verifier=get_verifier("greedy"), sampler=G, adaptive=policy_for(drafter, G),
                             costs=Costs())
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    assert np.all(np.asarray(out.stats["tau"]) > 1.5), out.stats["tau"]


def test_generate_with_a_dllm_draft(models, reference):
    """generate(method='speculative', draft=<dLLM>): the drafter defaults to 'dllm' for a diffusion draft."""
    target, _, self_dllm = models
    prompts, lengths, ref = reference
    out = jaxdecode.generate(target, PROMPTS, method="speculative", draft=self_dllm, tree="chain:4",
                             max_new_tokens=N, eos_ids=(), adaptive=False)
    assert [r.tokens for r in out] == [list(ref[i, :N]) for i in range(len(PROMPTS))]
    assert all(r.stats["tau"] > 1.5 for r in out)


def test_slot_logits_follow_the_layout(models):
    """Slot distributions: the self-dLLM's slot 0 is the target's next-token logits (with the window
    covering the history), drafts never propose MASK nor the dLLM's extra ids."""
    target, dllm, self_dllm = models
    hist = jnp.asarray([[3, 9, 27, 4, 0, 0], [8, 2, 5, 0, 0, 0]], jnp.int32)
    hl = jnp.asarray([4, 3], jnp.int32)
    d = make_drafter("dllm", target, draft=self_dllm, tree="chain:2", window=8)
    lg = jax.jit(d.slot_logits, static_argnums=3)(hist, hl, jnp.zeros((2, 2), jnp.int32), 0)
    tl, _, _ = jax.jit(jaxdecode.models.forward, static_argnums=0)(
        target.config, target.params, hist, jnp.broadcast_to(jnp.arange(6), (2, 6)), None,
        jaxdecode.models.causal_mask(2, 6))
    want = np.asarray(tl)[[0, 1], [3, 2]]
    np.testing.assert_allclose(np.asarray(lg[:, 0, 1:]), want[:, 1:], rtol=1e-4, atol=1e-4)  # id 0 = MASK
    assert np.all(np.asarray(lg[:, :, 0]) < -1e29)
    # More MASK columns (blocks of 1: causal) change nothing before them.
    d5 = make_drafter("dllm", target, draft=self_dllm, tree="chain:2", window=8, slots=5)
    assert d5.mask_slots == 5 and d.mask_slots == 2
    lg5 = jax.jit(d5.slot_logits, static_argnums=3)(hist, hl, jnp.zeros((2, 2), jnp.int32), 0)
    np.testing.assert_allclose(np.asarray(lg5), np.asarray(lg), rtol=1e-5, atol=1e-5)
    blocks3 = Model(self_dllm.config.replace(block_size=3), None)
    assert make_drafter("dllm", target, draft=blocks3, tree="chain:4").mask_slots == 6  # whole blocks
    r = make_drafter("dllm", target, draft=dllm, tree="chain:3", temperature=1.0)
    assert r.child_rule == "sample"
    ctx = DraftContext(history=hist, hist_len=hl, key=jax.random.PRNGKey(0))
    tree, slots, _ = jax.jit(r.propose, static_argnums=2)(jnp.zeros((), jnp.int32), ctx, SamplerConfig(temperature=1.0))
    assert slots.shape == (2, 4, 64) and np.all(np.asarray(tree.tokens) < 64)
    np.testing.assert_allclose(np.asarray(slots[:, :3].sum(-1)), 1.0, rtol=1e-5)


def test_bad_inputs(models):
    target, dllm, _ = models
    with pytest.raises(DiffusionDrafterError, match="causal LM.*draft_lm"):
        make_drafter("dllm", target, draft=_tiny(layers=1, params=False))
    with pytest.raises(DiffusionDrafterError, match="needs a masked-diffusion LM"):
        make_drafter("dllm", target)
    with pytest.raises(DiffusionDrafterError, match="vocabulary.*share one tokenizer"):
        make_drafter("dllm", target, draft=_tiny(vocab=80, layers=1, params=False,
                                                          attention="bidirectional", mask_token_id=5))
    with pytest.raises(DiffusionDrafterError, match="vocabulary"):
        make_drafter("dllm", _tiny(vocab=70, params=False), draft=dllm)
    for tree in ("static:2,1", "eagle:depth=2,topk=2,total=3"):
        with pytest.raises(DiffusionDrafterError, match="chain:K"):
            make_drafter("dllm", target, draft=dllm, tree=tree)
    with pytest.raises(DiffusionDrafterError, match="steps must be an int in 1..3"):
        make_drafter("dllm", target, draft=dllm, tree="chain:3", steps=4)
    with pytest.raises(DiffusionDrafterError, match="slots must be an int >= 3"):
        make_drafter("dllm", target, draft=dllm, tree="chain:3", slots=2)
    with pytest.raises(DiffusionDrafterError, match="window must be"):
        make_drafter("dllm", target, draft=dllm, window=0)
    with pytest.raises(DiffusionDrafterError, match="max_position_embeddings"):
        make_drafter("dllm", target, draft=dllm, window=300)
    with pytest.raises(DiffusionDrafterError, match="mask_id"):
        make_drafter("dllm", target, draft=dllm, mask_id=65)
    with pytest.raises(DiffusionDrafterError, match="takes no option 'windows'; its options: window, steps"):
        make_drafter("dllm", target, draft=dllm, windows=8)
    with pytest.raises(ValueError, match="drafter='dllm'"):
        make_drafter("draft_lm", target, draft=dllm)


@pytest.mark.slow
def test_cli_drafter_dllm(tiny_llama_dir, tmp_path, capsys):
    """`jaxdecode generate --method speculative --drafter dllm --draft DIR` = greedy; the dLLM's
    tokenizer is the target's plus a MASK id appended to the model (id 320 of 321)."""
    from jaxdecode.cli import main
    from jaxdecode.models import save_params

    target = jaxdecode.load(tiny_llama_dir)
    cfg = target.config.replace(vocab_size=target.config.vocab_size + 1, attention="bidirectional",
                                mask_token_id=target.config.vocab_size, dtype="float32")
    p = dict(target.params)
    p["embed"] = jnp.concatenate([p["embed"], p["embed"][:1]], axis=0)
    p["lm_head"] = jnp.concatenate([p["lm_head"], p["lm_head"][:, :1]], axis=1)
    out_dir = tmp_path / "dllm"
    save_params(cfg, p, out_dir)
    for f in tiny_llama_dir.glob("*token*"):
        shutil.copy(f, out_dir / f.name)
    runs = {}
    for method in (["--method", "greedy"],
                   ["--method", "speculative", "--drafter", "dllm", "--draft", str(out_dir), "--no-adaptive"]):
        assert main(["generate", "--model", str(tiny_llama_dir), "--prompt", "def add(", "--max-new-tokens",
                     "6", "--json", *method]) == 0
        runs[method[1]] = json.loads(capsys.readouterr().out.strip().splitlines()[0])["tokens"]
    assert runs["greedy"] == runs["speculative"]
