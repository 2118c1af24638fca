"""Infilling with diffusion_decode (suffix_tokens): answer slots between a prompt and a known suffix."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxdecode.models import ModelConfig, forward, init_params

from jaxdecode import diffusion as D
from jaxdecode import dllm_tasks as T

MASK = 31
BASE = {"model_type": "llama", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
        "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "max_position_embeddings": 32}
CFG = ModelConfig(**BASE, attention="bidirectional", mask_token_id=MASK)
# std 0.3 spreads the logits: greedy picks are not near-ties
PARAMS = init_params(CFG, jax.random.PRNGKey(1), std=0.3)
# right-padded rows of different prompt / answer / suffix lengths (row 2: no suffix)
PROMPTS = np.array([[1, 2, 3, 4], [7, 8, 0, 0], [9, 10, 11, 0]], np.int32)
PLENS = np.array([4, 2, 3], np.int32)
SUFFIX = np.array([[20, 21, 22], [23, 24, 0], [0, 0, 0]], np.int32)
SLENS = np.array([3, 2, 0], np.int32)
ANSWER, ALENS = 5, np.array([5, 3, 4], np.int32)


def _decode(rule=None, config=CFG, suffix=SUFFIX, slens=SLENS, **kw):
    kw = {"answer_length": ANSWER, "answer_lengths": ALENS, "eos_ids": (), **kw}
    return D.diffusion_decode(config, PARAMS, PROMPTS, PLENS, rule=rule or D.Greedy1(), suffix_tokens=suffix,
                              suffix_lengths=slens, **kw)


def _reference(prompt, n, suffix, shift):
    """Greedy1 by hand: full forwards over prompt + slots + suffix, one committed slot per forward."""
    seq = list(prompt) + [MASK] * n + list(suffix)
    p, t = len(prompt), len(seq)
    for _ in range(n):
        logits, _, _ = forward(CFG, PARAMS, jnp.array([seq], jnp.int32), jnp.arange(t)[None], None,
                               jnp.ones((1, t, t), bool))
        best = None
        for j in range(n):
            if seq[p + j] != MASK:
                continue
            lg = logits[0, p + j - shift].at[MASK].set(-jnp.inf)
            _, conf, tok = D.confidence(lg)
            if best is None or float(conf) > best[0]:  # ties: the lower slot
                best = (float(conf), j, int(tok))
        seq[p + best[1]] = best[2]
    return seq[p:p + n]


@pytest.mark.parametrize("shift", [0, 1])
def test_greedy1_with_suffix_equals_python_loop(shift):
    out = _decode(logits_shift=shift)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    assert lengths.tolist() == ALENS.tolist()
    for b in range(len(PROMPTS)):
        want = _reference(PROMPTS[b, :PLENS[b]].tolist(), int(ALENS[b]), SUFFIX[b, :SLENS[b]].tolist(), shift)
        assert tokens[b, :ALENS[b]].tolist() == want, b
    assert np.asarray(out.stats["nfe"]).tolist() == ALENS.tolist()


def test_suffix_is_seen():
    with_suffix = np.asarray(_decode().tokens)
    other = np.where(np.arange(3)[None] < SLENS[:, None], (SUFFIX + 3) % 30, 0).astype(np.int32)
    with_other = np.asarray(_decode(suffix=other).tokens)
    without = np.asarray(_decode(suffix=None, slens=None).tokens)
    for b in (0, 1):  # rows with a suffix: it changes what is decoded
        assert with_suffix[b].tolist() != with_other[b].tolist()
        assert with_suffix[b].tolist() != without[b].tolist()
    assert with_suffix[2].tolist() == without[2].tolist()  # row 2 has an empty suffix
    # an all-empty suffix is no suffix at all
    np.testing.assert_array_equal(np.asarray(_decode(slens=np.zeros(3, np.int32)).tokens), without)


def test_freedave_with_suffix_equals_greedy1():
    np.testing.assert_array_equal(np.asarray(_decode(D.FreeDave(draft=3)).tokens), np.asarray(_decode().tokens))


def test_bad_suffix_inputs():
    bad = SUFFIX.copy()
    bad[1, 1] = MASK
    with pytest.raises(D.DiffusionError, match="suffix 1 token 1 .*MASK"):
        _decode(suffix=bad)
    bad[1, 1] = 40
    with pytest.raises(D.DiffusionError, match="outside the vocabulary"):
        _decode(suffix=bad)
    _decode(suffix=np.where(np.arange(3)[None] < SLENS[:, None], SUFFIX, MASK))  # MASK as padding: ignored
    with pytest.raises(D.DiffusionError, match="without suffix_tokens"):
        _decode(suffix=None)
    with pytest.raises(D.DiffusionError, match=r"suffix_lengths must be in 0..3"):
        _decode(slens=np.array([3, 4, 0], np.int32))
    with pytest.raises(D.DiffusionError, match=r"\[batch, suffix_len\]"):
        _decode(suffix=SUFFIX[:2])
    with pytest.raises(D.DiffusionError, match="integer"):
        _decode(suffix=SUFFIX.astype(np.float32))
    with pytest.raises(D.DiffusionError, match="max_position_embeddings"):
        _decode(suffix=np.zeros((3, 24), np.int32), slens=None)
    with pytest.raises(D.DiffusionError, match="cache='none'"):
        _decode(cache="dual")
    block = CFG.replace(attention="block", block_size=2)
    with pytest.raises(D.DiffusionError, match="causal across blocks"):
        _decode(config=block)


# ----------------------------------------------------------------------------- the infilling task
def test_infill_task_split_and_validate():
    task = T.make_task("permutation", 5, 6)
    infill = T.InfillTask(task, span=2)
    batch = infill.sample(np.random.default_rng(0), 8)
    assert batch.span.shape == (8, 2) and batch.prefix.shape[1] == task.prompt_length + 3
    for i in range(8):  # the pieces put back together are the task's answer
        s, n = int(batch.prefix_lengths[i]) - task.prompt_length, int(batch.suffix_lengths[i])
        assert s + 2 + n == task.answer_length
        answer = np.concatenate([batch.prefix[i, task.prompt_length:task.prompt_length + s], batch.span[i],
                                 batch.suffix[i, :n]])
        np.testing.assert_array_equal(batch.prefix[i, :task.prompt_length], batch.prompts[i])
        assert task.validate(batch.prompts[i], answer)
    assert infill.validate(batch, batch.span).all()
    wrong = batch.span.copy()
    wrong[:, 0] = wrong[:, 1]  # a duplicate value: no longer a permutation
    assert not infill.validate(batch, wrong).any()
    report = T.evaluate_infill_answers(infill, batch, wrong, reference=batch.span)
    assert report["validity"] == 0.0 and report["exact_match"] == 0.0 and report["n"] == 8
    with pytest.raises(T.TaskError, match="span"):
        T.InfillTask(task, span=6)


# ----------------------------------------------------------------------------- the code-infilling benchmark
@pytest.mark.slow  # ~15 s on a quiet CPU (tokenizer load, held-out windows, four compiles)
def test_bench_dllm_infill_runs_on_a_saved_random_dllm(tmp_path, monkeypatch, capsys):
    import json
    import shutil
    from pathlib import Path

    from jaxdecode.models.hf import save_params
    root = Path(__file__).resolve().parents[1]
    tok_dir = root / "models" / "embedded" / "target"
    cfg = ModelConfig(**{**BASE, "vocab_size": 4097, "max_position_embeddings": 64}, attention="bidirectional",
                      mask_token_id=4096)
    save_params(cfg, init_params(cfg, jax.random.PRNGKey(0), std=0.3), tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, tmp_path / name)
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    import bench_dllm_infill
    bench_dllm_infill.main(["--model", str(tmp_path), "--windows", "3", "--batch", "2", "--prefix", "8", "--span", "4",
                            "--suffix", "4", "--rules", "greedy1,llada:2,freedave", "--without-suffix"])
    rows = {r["rule"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {"greedy1", "llada:2", "freedave", "greedy1 (no suffix)"}
    assert rows["greedy1"]["nfe"] == 4 and rows["llada:2"]["nfe"] == 2 and rows["greedy1"]["windows"] == 3
    assert rows["freedave"]["match_greedy1"] == 1.0  # lossless
    assert rows["greedy1 (no suffix)"]["match_greedy1"] < 1.0  # the suffix is seen
    assert 0 <= rows["greedy1"]["token_accuracy"] <= 1
