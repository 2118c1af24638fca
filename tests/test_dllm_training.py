"""Training diffusion LMs (jaxdecode.training.dllm) and the Learn2PD filter (jaxdecode.training.filter).

The task-model tests share one tiny dLLM per task (training.dllm.tiny_task_dllm, cached per process):
a 2-layer, width-128 model over the 16-token task vocabulary, 300 SFT steps (seconds)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdecode.dllm_tasks import FIRST_VALUE, MASK, make_task
from jaxdecode.models import init_params
from jaxdecode.training.dllm import (DiffusionLM, DLLMLoss, TaskBatches, add_mask_token, block_ids,
                                     block_training_mask, dllm_config, mask_tokens, masked_diffusion_loss,
                                     shift_logits, task_model_config, tiny_task_dllm)
from jaxdecode.training.trainer import TrainConfigError

ANSWER = 6


def _prompts(task, n, seed):
    prompts, answers = task.sample(np.random.default_rng(seed), n)
    return prompts, np.full(n, prompts.shape[1], np.int32), answers


def test_llada_loss_known_case():
    """Per row: sum over masked tokens of CE / t, over the row's maskable count; mean over rows."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 4, 5)).astype(np.float32)
    tokens = np.array([[1, 2, 3, 4], [0, 1, 2, 3]])
    masked = np.array([[0, 1, 1, 0], [1, 0, 0, 0]], bool)
    maskable = np.array([[0, 1, 1, 1], [1, 1, 0, 0]], bool)
    t = np.array([[0.5] * 4, [0.25] * 4], np.float32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, tokens[..., None], -1)[..., 0]
    want = ((ce[0, 1] + ce[0, 2]) / 0.5 / 3 + ce[1, 0] / 0.25 / 2) / 2
    loss, aux = masked_diffusion_loss(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(masked), jnp.asarray(t),
                                      jnp.asarray(maskable))
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert float(aux["tokens"]) == 3


def test_masking_rate_and_block_noise():
    """mask_tokens: only maskable tokens, at rate t; one t per row, or per block counted from the offset."""
    tokens = jnp.full((512, 12), 7, jnp.int32)
    maskable = jnp.asarray(np.arange(12) >= 4)[None].repeat(512, 0)
    noise = jax.jit(mask_tokens, static_argnums=(3,), static_argnames=("eps", "block_size"))
    noisy, masked, t = noise(jax.random.PRNGKey(0), tokens, maskable, MASK, eps=0.1)
    assert not np.any(np.asarray(masked)[:, :4]) and np.all(np.asarray(noisy)[np.asarray(masked)] == MASK)
    assert np.all(np.asarray(t) == np.asarray(t)[:, :1]) and 0.1 <= float(t.min())
    rate = np.asarray(masked)[:, 4:].mean(1)
    assert abs(rate.mean() - 0.55) < 0.03 and np.corrcoef(rate, np.asarray(t)[:, 0])[0, 1] > 0.8
    _, _, tb = noise(jax.random.PRNGKey(1), tokens, maskable, MASK, block_size=4, offset=2)
    tb = np.asarray(tb)  # blocks [0,2) [2,6) [6,10) [10,12): one level each
    for lo, hi in ((0, 2), (2, 6), (6, 10), (10, 12)):
        assert np.all(tb[:, lo:hi] == tb[:, lo:lo + 1])
    assert np.mean(tb[:, 2] != tb[:, 6]) > 0.99


def test_sft_never_masks_the_prompt_and_shift_skips_position_0():
    task = make_task("copy", 4, 6)
    config = task_model_config(task, hidden_size=32, intermediate_size=64, head_dim=8)
    module = DiffusionLM(config, init_params(config, jax.random.PRNGKey(0)))
    batch = jax.tree.map(jnp.asarray, TaskBatches(task, 128)(3))
    p = task.prompt_length

    jitted = {s: nnx.jit(lambda m, b, s=s: DLLMLoss(mask_id=MASK, logits_shift=s).outputs(m, b)) for s in (0, 1)}

    def outputs(shift, batch):  # one compiled program per shift (the prompt-free batch below reuses shift 1's)
        return jitted[shift](module, batch)
    for shift in (0, 1):
        logits, tokens, masked, t, maskable = outputs(shift, batch)
        masked = np.asarray(masked)
        assert not masked[:, :p].any() and masked[:, p:].mean() > 0.3
        assert np.all(np.asarray(maskable)[:, p:]) and not np.asarray(maskable)[:, :p].any()
    # logits_shift=1: token j is scored with the logits of position j-1
    x = jnp.arange(2 * 3 * 1, dtype=jnp.float32).reshape(2, 3, 1)
    np.testing.assert_array_equal(np.asarray(shift_logits(x, 1))[:, 1:], np.asarray(x)[:, :-1])
    pre = {"tokens": batch["tokens"], "maskable": jnp.ones_like(batch["maskable"]), "seed": batch["seed"]}
    _, _, masked, _, _ = outputs(1, pre)
    assert not np.asarray(masked)[:, 0].any() and np.asarray(masked)[:, 1:].any()


def test_block_training_mask():
    blk = block_ids(6, 2, jnp.array([0, 1]))  # row 1: the answer (blocks) starts at position 1
    np.testing.assert_array_equal(np.asarray(blk), [[0, 0, 1, 1, 2, 2], [-1, 0, 0, 1, 1, 2]])
    m = np.asarray(block_training_mask(blk))[0]
    noisy_noisy, noisy_clean, clean_noisy, clean_clean = m[:6, :6], m[:6, 6:], m[6:, :6], m[6:, 6:]
    b = np.asarray(blk)[0]
    np.testing.assert_array_equal(noisy_noisy, b[:, None] == b[None, :])
    np.testing.assert_array_equal(noisy_clean, b[None, :] < b[:, None])
    np.testing.assert_array_equal(clean_clean, b[None, :] <= b[:, None])
    assert not clean_noisy.any()


def test_block_form_matches_block_causal_decoding_context():
    """In the block form, a noisy block's logits equal those of a block-causal forward over
    [clean earlier blocks ; that noisy block] (what a block decoder with an exact cache computes)."""
    from jaxdecode.models import block_causal_mask, forward
    task = make_task("copy", 4, 6)
    config = task_model_config(task, hidden_size=32, intermediate_size=64, head_dim=8)
    params = init_params(config, jax.random.PRNGKey(1))
    module = DiffusionLM(config, params, attention="block", block_size=2)
    clean = jnp.asarray(np.random.default_rng(0).integers(FIRST_VALUE, 16, (1, 6)), jnp.int32)
    noisy = clean.at[0, 3].set(MASK)
    noisy_logits, _ = module(noisy, clean=clean)
    x = jnp.concatenate([clean[:, :2], noisy[:, 2:4]], 1)  # block 1 decoding, block 0 finished
    ref, _, _ = forward(config, params, x, jnp.arange(4)[None], None, block_causal_mask(jnp.ones((1, 4), bool), 2))
    np.testing.assert_allclose(np.asarray(noisy_logits[:, 2:4]), np.asarray(ref[:, 2:4]), rtol=2e-4, atol=2e-5)


def test_add_mask_token_and_config(tmp_path):
    from tests.jd_testutil import make_tokenizer
    tok = make_tokenizer(tmp_path / "tok", 300)
    config = task_model_config(make_task("copy", 2, 2)).replace(vocab_size=len(tok), tie_word_embeddings=False)
    params = init_params(config, jax.random.PRNGKey(0))
    tok, config2, params2, mid = add_mask_token(tok, config, params)
    assert mid == len(tok) - 1 == config.vocab_size and config2.vocab_size == mid + 1
    assert params2["embed"].shape[0] == mid + 1 and params2["lm_head"].shape[1] == mid + 1
    np.testing.assert_allclose(np.asarray(params2["embed"][mid]), np.asarray(params["embed"]).mean(0), atol=1e-7)
    assert tok.convert_tokens_to_ids("<|mask|>") == mid and tok.mask_token_id == mid
    assert add_mask_token(tok, config2, params2)[3] == mid  # already there: unchanged
    cfg = dllm_config(config2, mask_id=mid, attention="block", block_size=4, logits_shift=1)
    assert cfg.is_diffusion and cfg.to_hf_dict()["mask_token_id"] == mid
    with pytest.raises(TrainConfigError, match="needs block_size"):
        dllm_config(config2, mask_id=mid, attention="block")
    with pytest.raises(TrainConfigError, match="not a token"):
        dllm_config(config2, mask_id=config2.vocab_size)


@pytest.fixture(scope="module")
def permutation_model():
    return tiny_task_dllm("permutation", ANSWER, 6)


def test_topk_parallel_fails_permutation_while_greedy1_passes(permutation_model):
    """The many-answer task: one token per step (greedy1) stays valid; committing 2 or 3 tokens per
    forward from their marginals (llada, no dependence awareness) writes duplicates."""
    from jaxdecode.diffusion import Greedy1, LLaDA
    from jaxdecode.dllm_tasks import evaluate_decoder
    config, params = permutation_model
    task = make_task("permutation", ANSWER, 6)
    prompts, _, _ = _prompts(task, 32, 11)
    r = {name: evaluate_decoder(task, config, params, rule, prompts)
         for name, rule in (("greedy1", Greedy1()), ("top2", LLaDA(tokens_per_step=2)),
                            ("top3", LLaDA(tokens_per_step=3)))}
    assert {k: v["nfe"] for k, v in r.items()} == {"greedy1": 6, "top2": 3, "top3": 2}
    assert r["top3"]["tokens_per_forward"] == 3 and r["greedy1"]["tokens"].shape == (32, ANSWER)
    valid = {k: v["validity"] for k, v in r.items()}
    assert valid["greedy1"] >= 0.95, valid
    assert valid["top2"] <= 0.25 and valid["top3"] <= 0.25, valid


def test_learn2pd_filter_trains_and_reduces_nfe(tmp_path):
    """The filter, trained in seconds on greedy1 trajectories of a deterministic task (sort), decodes
    with far fewer forwards at no loss of accuracy; its export loads as the decoder's filter."""
    from jaxdecode.diffusion import load_filter
    from jaxdecode.training.filter import compare_nfe, export_filter, filter_data, train_filter
    from jaxdecode.training.fixtures import tiny_setup
    task = make_task("sort", ANSWER, 6)
    config, params = tiny_task_dllm("sort", ANSWER, 6)
    prompts, lens, _ = _prompts(task, 64, 5)
    data = filter_data(config, params, prompts, lens, answer_length=ANSWER)
    assert len(data) == 64 * ANSWER and data.features.shape[1] == ANSWER
    assert np.all(data.weight.sum(1) == np.repeat(np.arange(ANSWER, 0, -1)[None], 64, 0).T.reshape(-1))
    tcfg, _ = tiny_setup(steps=200, learning_rate=3e-3, warmup_steps=10, weight_decay=0.0, eval_every=0,
                         checkpoint_every=0)
    result = train_filter(data, tcfg, tmp_path / "run")
    out = export_filter(tmp_path / "filter", result, {"task": "sort"})
    params_f, meta = load_filter(out)
    assert meta["task"] == "sort" and meta["rows"] == len(data)
    test_prompts, test_lens, _ = _prompts(task, 32, 6)
    report = compare_nfe(config, params, params_f, test_prompts, test_lens, answer_length=ANSWER,
                         threshold=0.9, validate=task.validate)
    assert report["nfe_greedy1"] == ANSWER
    assert report["nfe_ratio"] >= 2.0, report
    assert report["valid_learn2pd"] >= report["valid_greedy1"] - 1 / 32, report


def test_learn2pd_filter_abstains_on_a_many_answer_task(permutation_model, tmp_path):
    """On permutation no slot is final until its neighbours are chosen: the filter trained on greedy1's
    trajectories learns that and keeps validity (committing several slots at once scores ~0%, above)."""
    from jaxdecode.training.filter import compare_nfe, filter_data, train_filter
    from jaxdecode.training.fixtures import tiny_setup
    config, params = permutation_model
    task = make_task("permutation", ANSWER, 6)
    prompts, lens, _ = _prompts(task, 64, 7)
    data = filter_data(config, params, prompts, lens, answer_length=ANSWER)
    assert data.positive_fraction < 0.6  # early slots are rarely final
    tcfg, _ = tiny_setup(steps=200, learning_rate=3e-3, warmup_steps=10, weight_decay=0.0, eval_every=0,
                         checkpoint_every=0)
    filt = train_filter(data, tcfg, tmp_path / "run").params
    test_prompts, test_lens, _ = _prompts(task, 32, 8)
    report = compare_nfe(config, params, filt, test_prompts, test_lens, answer_length=ANSWER, threshold=0.9,
                         validate=task.validate)
    assert report["valid_greedy1"] >= 0.95 and report["valid_learn2pd"] >= 0.9, report


def test_export_loads_as_a_diffusion_model(tmp_path):
    """A task dLLM exports as an HF directory whose config.json carries the dLLM fields (contract 1) and
    whose word-level tokenizer holds the task vocabulary; jaxdecode.load reads it back."""
    import jaxdecode
    from jaxdecode.training.dllm import task_tokenizer
    from jaxdecode.training.lm import export_lm
    task = make_task("copy", 3, 4)
    config = task_model_config(task, hidden_size=32, intermediate_size=64, head_dim=8)
    out_config = dllm_config(config, mask_id=MASK, attention="block", block_size=2, logits_shift=1)
    export_lm(out_config, init_params(config, jax.random.PRNGKey(0)), task_tokenizer(task.vocab), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["mask_token_id"] == MASK and cfg["bd_size"] == 2
    model = jaxdecode.load(tmp_path / "m")
    assert model.config.is_diffusion and model.config.attention == "block" and model.config.logits_shift == 1
    assert model.config.mask_token_id == MASK and model.config.block_size == 2
    assert model.tokenizer.convert_tokens_to_ids("<mask>") == MASK
    assert model.tokenizer.decode([4, 10, 11]).split() == ["<copy>", "v0", "v1"]


@pytest.mark.slow
def test_cli_task_dllm_and_filter(tmp_path, capsys):
    """`jaxdecode train dllm --task` then `jaxdecode train filter` on it; the filter loads in generate."""
    import jaxdecode
    from jaxdecode.cli import main
    model, filt = tmp_path / "m", tmp_path / "f"
    assert main(["train", "dllm", "--task", "copy", "--task-length", "3", "--output", str(model), "--steps", "60",
                 "--warmup", "5", "--no-progress"]) == 0
    assert main(["train", "filter", "--model", str(model), "--task", "copy", "--task-length", "3", "--out", str(filt),
                 "--steps", "50", "--prompts", "32", "--eval-prompts", "16", "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "trained a Learn2PD filter" in said
    import shlex  # the command the summary suggests runs as printed
    hint = said.split("(e.g. ", 1)[1].rsplit(": a held-out", 1)[0]
    assert main(shlex.split(hint)[1:]) == 0, capsys.readouterr().err
    m = jaxdecode.load(model)
    res = jaxdecode.generate(m, ["<copy> v1 v0 v2 <sep>"], method="diffusion", answer_length=3, rule="learn2pd",
                             filter=str(filt))
    assert res[0].stats["nfe"] >= 1


@pytest.mark.slow
def test_cli_continued_training_of_a_causal_lm(tmp_path, capsys):
    """Dream-style adaptation: a causal tiny LM (no MASK token) -> a dLLM with <|mask|> added, shift 1."""
    import jaxdecode
    from jaxdecode.cli import main
    from jaxdecode.training.fixtures import build_tiny_lm
    lm = build_tiny_lm(tmp_path / "lm", steps=5)
    out = tmp_path / "dllm"
    assert main(["train", "dllm", "--corpus", str(tmp_path / "lm" / "src"), "--init-from", str(lm), "--output",
                 str(out), "--steps", "5", "--warmup", "1", "--batch-size", "8", "--seq-len", "32", "--eval-every",
                 "5", "--no-progress"]) == 0
    assert "dLLM" in capsys.readouterr().out
    assert (tmp_path / "dllm.train" / "training.png").stat().st_size > 0  # the trainer's loss plot
    model, causal = jaxdecode.load(out), jaxdecode.load(lm)
    assert model.config.is_diffusion and model.config.logits_shift == 1
    assert model.config.vocab_size == causal.config.vocab_size + 1 == model.config.mask_token_id + 1
    assert model.tokenizer.mask_token == "<|mask|>" and model.tokenizer.mask_token_id == model.config.mask_token_id


@pytest.mark.slow
def test_block_form_model_decodes_with_the_exact_cache(tmp_path):
    """A block-diffusion task model (Fast-dLLM v2 form: blocks of 3, logits_shift=1) trained here solves
    its task under block_diffusion's exact KV cache, as under recomputation: training and decoding see
    the same context."""
    from jaxdecode.diffusion import Greedy1
    from jaxdecode.dllm_tasks import evaluate_decoder
    from jaxdecode.training.dllm import DLLMSpec, train_task_dllm
    task = make_task("copy", ANSWER, 6)
    config, params = train_task_dllm(task, tmp_path, steps=300,
                                     spec=DLLMSpec(batch_size=32, attention="block", block_size=3, logits_shift=1))
    prompts, _, _ = _prompts(task, 32, 3)
    runs = {c: evaluate_decoder(task, config, params, Greedy1(), prompts, cache=c) for c in ("none", "exact")}
    assert runs["none"]["validity"] >= 0.95 and runs["exact"]["validity"] >= 0.95, runs
    np.testing.assert_array_equal(runs["none"]["tokens"], runs["exact"]["tokens"])


def test_cli_task_dllm_without_matplotlib(tmp_path, capsys, monkeypatch):
    """No matplotlib (it is only a [test] extra): the model is exported and the run succeeds, the loss plot
    skipped with one warning; the summary names no plot file."""
    import sys

    import jaxdecode
    from jaxdecode.cli import main
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] or ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    model = tmp_path / "m"
    rc = main(["train", "dllm", "--task", "copy", "--task-length", "3", "--output", str(model), "--steps", "2",
               "--warmup", "1", "--batch-size", "8", "--data-parallel", "1", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert jaxdecode.load(model).config.is_diffusion
    assert not (tmp_path / "m.train" / "training.png").exists()
    assert "trained a copy dLLM" in captured.out and "plot ->" not in captured.out
    (warning,) = [line for line in captured.err.splitlines() if "matplotlib" in line]
    assert "not installed" in warning and "pip install matplotlib" in warning


def test_cli_init_from_takes_an_embedded_name_and_names_a_missing_directory(tmp_path, capsys, monkeypatch):
    """`--init-from models/embedded/target` where that directory does not exist (a wheel install): the error
    says so (not "holds no tokenizer") and points at the embedded name; the name resolves to the model."""
    import importlib

    from jaxdecode.cli import main
    from jaxdecode.training.cli import _model_dir
    jm = importlib.import_module("jaxdecode.model")
    embedded = tmp_path / "embedded"
    (embedded / "target").mkdir(parents=True)
    (embedded / "target" / "config.json").write_text("{}")
    monkeypatch.setattr(jm, "EMBEDDED_DIR", embedded)
    assert _model_dir("target", "--init-from") == embedded / "target"
    missing = tmp_path / "models" / "embedded" / "target"
    assert main(["train", "dllm", "--corpus", str(tmp_path), "--init-from", str(missing), "--output",
                 str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--init-from {missing}: the directory does not exist" in err and "--init-from target" in err
    assert "holds no tokenizer" not in err and not (tmp_path / "out").exists()
    monkeypatch.setattr(jm, "EMBEDDED_DIR", tmp_path / "nothing_shipped")
    with pytest.raises(ValueError, match="embedded draft model is not shipped"):
        _model_dir("draft", "--init-from")
