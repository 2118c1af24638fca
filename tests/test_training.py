"""Training module: a seconds-long run end to end, exact resume after SIGKILL, checkpoint safety,
bad input, distillation and data-parallel / FSDP equivalence. Tiny model, one CPU device unless noted."""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.models import load_params
from jaxdecode.training.corpus import Corpus, CorpusError, WindowSampler, build_corpus, eval_batches
from jaxdecode.training.fixtures import build_tiny_corpus, tiny_setup, write_tiny_sources
from jaxdecode.training.lm import CausalLM, model_config, train_lm
from jaxdecode.training.tokenizer import TokenizerError, eos_id, load_tokenizer_dir, train_tokenizer
from jaxdecode.training.trainer import (CheckpointCorruptError, TrainConfig, TrainConfigError,
                                        read_metrics, restore_latest)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_corpus")
    src = write_tiny_sources(root / "src")
    tok_dir, corpus_dir = build_tiny_corpus(src, root)
    tok = load_tokenizer_dir(tok_dir)
    return {"root": root, "src": src, "tok_dir": tok_dir, "corpus": corpus_dir, "tok": tok,
            "config": model_config("tiny", len(tok), 128, eos_id(tok))}


def _params_equal(a, b):
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), a, b)))


# ----------------------------------------------------------------------------- CI run via the CLI
def test_cli_train_lm_end_to_end(tmp_path):
    from jaxdecode.training.cli import add_train_parser, run_train
    src = write_tiny_sources(tmp_path / "src")
    out = tmp_path / "model"
    ap = argparse.ArgumentParser()
    add_train_parser(ap.add_subparsers(dest="command"))
    args = ap.parse_args(["train", "lm", "--corpus", str(src), "--output", str(out), "--size", "tiny",
                          "--vocab-size", "320", "--steps", "30", "--batch-size", "8", "--seq-len", "32",
                          "--max-positions", "128", "--lr", "3e-3", "--warmup", "5",
                          "--eval-every", "10", "--checkpoint-every", "10", "--data-parallel", "1",
                          "--held-out-fraction", "0.25", "--no-progress"])
    assert run_train(args) == 0
    work = tmp_path / "model.train"
    log = read_metrics(work / "run" / "metrics.jsonl")
    train_losses = [r["loss"] for r in log if "loss" in r]
    evals = [r["eval_loss"] for r in log if "eval_loss" in r]
    assert train_losses[-1] < train_losses[0] - 1.0, train_losses
    assert evals[-1] < np.log(320), evals  # better than uniform on held-out files
    assert all("tokens_per_s" in r for r in log if "loss" in r)

    # checkpoint round-trip: the latest checkpoint holds exactly the exported (float32) weights
    config, exported = load_params(out, dtype="float32")
    module = CausalLM(config, exported)
    restored, step = restore_latest(module, TrainConfig(steps=30, warmup_steps=5), work / "run")
    assert step == 30
    assert _params_equal(restored.raw_params(), exported)

    # the export loads in transformers with matching logits and in AutoTokenizer
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from jaxdecode.models import causal_mask, forward
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    ids = tok("def add(a, b):\n    return a + b\n")["input_ids"]
    assert tok.decode(ids) == "def add(a, b):\n    return a + b\n"
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.numpy()
    t = len(ids)
    ours, _, _ = forward(config, exported, jnp.asarray([ids]), jnp.arange(t)[None], None, causal_mask(1, t))
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4)


# ----------------------------------------------------------------------------- kill and resume
_RUNNER = textwrap.dedent("""
    import sys, time
    import jaxdecode.training.lm as L
    from jaxdecode.training.fixtures import tiny_setup
    from jaxdecode.training.lm import model_config, train_lm
    from jaxdecode.training.tokenizer import eos_id, load_tokenizer_dir

    class Slow(L.WindowSampler):  # slow batches, so the kill lands mid-run
        def __call__(self, step):
            time.sleep(float(sys.argv[4]))
            return super().__call__(step)
    L.WindowSampler = Slow
    tok_dir, corpus_dir, work = sys.argv[1:4]
    tok = load_tokenizer_dir(tok_dir)
    tcfg, spec = tiny_setup(30, checkpoint_every=5, eval_every=10)
    train_lm(corpus_dir, tok_dir, model_config("tiny", len(tok), 128, eos_id(tok)), tcfg, work, spec=spec)
""")


def _complete_steps(ckpt_dir: Path) -> list[int]:
    if not ckpt_dir.exists():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())


@pytest.mark.slow  # two subprocesses (imports + compiles): ~40 s of CPU
def test_sigkill_then_resume_is_bit_identical(tiny, tmp_path):
    script = tmp_path / "runner.py"
    script.write_text(_RUNNER)
    work = tmp_path / "killed"
    cmd = [sys.executable, str(script), str(tiny["tok_dir"]), str(tiny["corpus"]), str(work)]
    proc = subprocess.Popen(cmd + ["0.15"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and not _complete_steps(work / "checkpoints") and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    at_kill = _complete_steps(work / "checkpoints")
    assert at_kill and at_kill[-1] < 30, f"kill did not land mid-run: {at_kill}"
    log_at_kill = read_metrics(work / "metrics.jsonl")
    assert max(r["step"] for r in log_at_kill) < 30

    subprocess.run(cmd + ["0"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    # the uninterrupted reference, in this process (same device setup: the env is inherited)
    tok = tiny["tok"]
    tcfg, spec = tiny_setup(30, checkpoint_every=5, eval_every=10)
    ref = train_lm(tiny["corpus"], tiny["tok_dir"], tiny["config"], tcfg, tmp_path / "ref", spec=spec)
    resumed, step = restore_latest(CausalLM(tiny["config"], ref.module.raw_params()), tcfg, work)
    assert step == 30
    assert _params_equal(resumed.raw_params(), ref.module.raw_params())  # bit-identical on CPU
    curve = lambda log: [(r["step"], r.get("loss"), r.get("eval_loss")) for r in log]  # noqa: E731
    assert curve(read_metrics(work / "metrics.jsonl")) == curve(read_metrics(tmp_path / "ref" / "metrics.jsonl"))


# ----------------------------------------------------------------------------- checkpoint safety
def _run(tiny, work, steps, **kw):
    tcfg, spec = tiny_setup(steps, **{"checkpoint_every": 5, "eval_every": 0, **kw})
    return train_lm(tiny["corpus"], tiny["tok_dir"], tiny["config"], tcfg, work, spec=spec), tcfg


def test_crash_during_save_keeps_previous_checkpoint(tiny, tmp_path, monkeypatch):
    import orbax.checkpoint as ocp
    work = tmp_path / "run"
    first, tcfg = _run(tiny, work, 30, checkpoint_every=10)
    assert _complete_steps(work / "checkpoints") == [20, 30]  # keeps the last 2
    shutil.rmtree(work / "checkpoints" / "30")  # as if the run had stopped after step 20
    good, _ = restore_latest(CausalLM(tiny["config"], first.module.raw_params()), tcfg, work)

    calls = {"n": 0}

    def failing(self, *a, **k):  # the arrays are already on disk when the metadata write fails
        calls["n"] += 1
        raise OSError("disk full (simulated)")
    with monkeypatch.context() as m:
        m.setattr(ocp.JsonCheckpointHandler, "save", failing)
        m.setattr(ocp.JsonCheckpointHandler, "async_save", failing)
        with pytest.raises(OSError, match="disk full"):
            _run(tiny, work, 30, checkpoint_every=10)  # resumes at 20, fails saving step 30
    assert calls["n"] >= 1
    assert _complete_steps(work / "checkpoints") == [20]
    again, step = restore_latest(CausalLM(tiny["config"], first.module.raw_params()), tcfg, work)
    assert step == 20 and _params_equal(again.raw_params(), good.raw_params())
    # and training goes on from it to the same end point as the first run
    done, _ = _run(tiny, work, 30, checkpoint_every=10)
    assert _params_equal(done.module.raw_params(), first.module.raw_params())


def _corrupt(step_dir: Path):
    """Truncate the array data of a checkpoint step (as a crash of the disk, not of the writer, would)."""
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.stat().st_size > 1000]
    assert files
    for p in files:
        p.write_bytes(p.read_bytes()[:100])


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tiny, tmp_path):
    from jaxdecode.training.trainer import CheckpointFallbackWarning
    work = tmp_path / "run"
    first, tcfg = _run(tiny, work, 30, checkpoint_every=10)
    module = CausalLM(tiny["config"], first.module.raw_params())
    at20, _ = restore_latest(module, tcfg, work, step=20)
    # partial: a step directory with nothing inside, newer than the good ones
    (work / "checkpoints" / "35").mkdir()
    with pytest.warns(CheckpointFallbackWarning, match=r"step 35 .* cannot be restored .*; using step 30"):
        _, step = restore_latest(module, tcfg, work)
    assert step == 30
    shutil.rmtree(work / "checkpoints" / "35")
    # corrupt: the latest step's array data truncated; reading falls back to step 20 ...
    _corrupt(work / "checkpoints" / "30")
    with pytest.warns(CheckpointFallbackWarning, match=r"step 30 .* cannot be restored \(.*\); using step 20"):
        restored, step = restore_latest(module, tcfg, work)
    assert step == 20 and _params_equal(restored.raw_params(), at20.raw_params())
    # ... and training resumes from step 20, moves the bad step aside, and ends where the first run did
    with pytest.warns(CheckpointFallbackWarning, match=r"step 30 .*; using step 20.*moved to"):
        again, _ = _run(tiny, work, 30, checkpoint_every=10)
    assert again.resumed_from == 20
    assert _params_equal(again.module.raw_params(), first.module.raw_params())
    assert _complete_steps(work / "checkpoints") == [20, 30]
    assert [p.name for p in (work / "corrupt-checkpoints").iterdir()][0].startswith("30")
    # only when no kept step restores is it an error, naming every step and why
    for st in (20, 30):
        _corrupt(work / "checkpoints" / str(st))
    with pytest.raises(CheckpointCorruptError, match=r"no kept checkpoint .* can be restored: step 30 \(.*\), "
                                                     r"step 20 \(.*\); .*new work directory"):
        _run(tiny, work, 30, checkpoint_every=10)


def test_resume_with_different_options_is_refused_naming_the_key(tiny, tmp_path):
    work = tmp_path / "run"
    _run(tiny, work, 30, checkpoint_every=30)
    with pytest.raises(TrainConfigError, match=r"different run: train.learning_rate was 0.003, now 0.01; ") as e:
        _run(tiny, work, 30, learning_rate=1e-2)
    assert "\n" not in str(e.value) and "{" not in str(e.value)
    with pytest.raises(TrainConfigError, match=r"train.weight_decay was 0.1, now 0.0 \(and 1 more: train.seed\)"):
        _run(tiny, work, 30, seed=1, weight_decay=0.0)


def test_a_section_set_on_one_side_is_one_change():
    """--data self -> corpus drops the whole self-distillation section: one change beside run.data, not one
    per leaf of it (which named --target, --prompts, ... that the user did not change)."""
    from jaxdecode.training.trainer import ResumeMismatchError, identity_changes
    old = {"train": {"seed": 0}, "run": {"data": "self", "self": {"target": "t", "options": {"num_prompts": 8}}}}
    new = {"train": {"seed": 0}, "run": {"data": "corpus"}}
    changes = identity_changes(old, new)
    assert changes == [("run.data", "self", "corpus"), ("run.self", old["run"]["self"], None)]
    text = str(ResumeMismatchError("w", changes, {"run.data": "--data", "run.self": "--data"}))
    assert "was 'self', now 'corpus' (and 1 more: --data (run.self))" in text and "{" not in text
    assert identity_changes(new, old)[1] == ("run.self", None, old["run"]["self"])


def test_resume_with_other_parameter_shapes_is_refused_naming_the_key(tiny, tmp_path):
    """An option that changes the parameters' shapes is a changed option, named as any other, not a
    "damaged" checkpoint that cannot restore (the identity is read before the state)."""
    work = tmp_path / "run"
    _run(tiny, work, 10, checkpoint_every=10)
    wider = dict(tiny, config=tiny["config"].replace(intermediate_size=2 * tiny["config"].intermediate_size))
    with pytest.raises(TrainConfigError, match=r"different run: run.model.intermediate_size was \d+, now \d+; "):
        _run(wider, work, 10)


def test_extending_a_finished_run_continues_at_the_final_learning_rate(tiny, tmp_path, capsys):
    work = tmp_path / "run"
    done, tcfg = _run(tiny, work, 30, checkpoint_every=10)
    assert "resuming" not in capsys.readouterr().err
    longer, _ = _run(tiny, work, 40, checkpoint_every=10)
    assert "resuming from step 30 (of 40)" in capsys.readouterr().err
    assert longer.resumed_from == 30 and longer.step == 40
    final_lr = tcfg.learning_rate * tcfg.end_lr_ratio
    lrs = [r["lr"] for r in read_metrics(work / "metrics.jsonl") if "lr" in r]
    assert np.allclose(lrs[-2:], final_lr)  # the steps past the schedule's end run at its final value
    # the same as one run with that schedule: a cosine over 30 steps, stopped at 40
    ref, _ = _run(tiny, tmp_path / "ref", 40, checkpoint_every=10, schedule_steps=30)
    assert _params_equal(longer.module.raw_params(), ref.module.raw_params())
    # a run already past --steps trains nothing, and says so
    again, _ = _run(tiny, work, 35, checkpoint_every=10)
    assert again.step == 40 and "resuming from step 40 (of 35): nothing to train" in capsys.readouterr().err


# ----------------------------------------------------------------------------- run hygiene
def test_tokenizer_and_export_are_written_whole_or_not_at_all(tiny, tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast
    from jaxdecode.models import init_params
    from jaxdecode.training.lm import export_lm
    params = init_params(tiny["config"], jax.random.PRNGKey(0))
    export_lm(tiny["config"], params, tiny["tok"], tmp_path / "model")
    before = {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()}

    def half_then_fail(real):
        def save(self, d, *a, **k):  # some files written, then a failure (full disk, kill)
            real(self, d, *a, **k)
            raise OSError("disk full (simulated)")
        return save
    for cls in {PreTrainedTokenizerFast, type(tiny["tok"])}:
        monkeypatch.setattr(cls, "save_pretrained", half_then_fail(cls.save_pretrained))
    with pytest.raises(OSError, match="disk full"):
        train_tokenizer([(tiny["src"] / "mod_00.py").read_text()], 290, tmp_path / "tok")
    assert not (tmp_path / "tok").exists()
    with pytest.raises(OSError, match="disk full"):
        export_lm(tiny["config"], params, tiny["tok"], tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()
    with pytest.raises(OSError, match="disk full"):
        export_lm(tiny["config"], params, tiny["tok"], tmp_path / "model")
    assert {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary directories left


def _train_args(corpus, out, *extra):
    from jaxdecode.training.cli import add_train_parser
    ap = argparse.ArgumentParser()
    add_train_parser(ap.add_subparsers(dest="command"))
    return ap.parse_args(["train", "lm", "--corpus", str(corpus), "--output", str(out), "--size", "tiny",
                          "--vocab-size", "320", "--batch-size", "8", "--seq-len", "32",
                          "--max-positions", "128", "--lr", "3e-3", "--warmup", "5", "--eval-every", "10",
                          "--checkpoint-every", "10", "--data-parallel", "1", "--held-out-fraction", "0.25",
                          "--no-progress", *extra])


def test_cli_rerun_after_a_failure_and_with_more_steps(tiny, tmp_path, capsys):
    from jaxdecode.training.cli import run_train
    from jaxdecode.training.corpus import split_of
    one = tmp_path / "one"
    one.mkdir()
    name = next(f"f{i}.py" for i in range(100) if split_of(f"f{i}.py", 0.25) == "train")
    (one / name).write_text("x = 1\n")
    out = tmp_path / "model"
    # a run on a one-line corpus trains a 257-token tokenizer, then fails building the corpus ...
    with pytest.warns(UserWarning, match=r"257 tokens .* vocab_size=320"):
        with pytest.raises(CorpusError, match="heldout split has no documents"):
            run_train(_train_args(one, out, "--steps", "30"))
    capsys.readouterr()
    # ... and the next run, on other sources, does not reuse that tokenizer
    assert run_train(_train_args(tiny["src"], out, "--steps", "30")) == 0
    assert "made from other sources" in capsys.readouterr().err
    assert len(load_tokenizer_dir(tmp_path / "model.train" / "tokenizer")) == 320
    assert len(load_tokenizer_dir(out)) == 320
    # the same command with a larger --steps resumes the finished run and says so
    assert run_train(_train_args(tiny["src"], out, "--steps", "32")) == 0
    err = capsys.readouterr().err
    assert "resuming from step 30 (of 32)" in err and "training a" not in err and "tokenizing" not in err
    # another changed option: one line naming the flag, the old and the new value, and the fix
    with pytest.raises(TrainConfigError, match=r"--lr \(train.learning_rate\) was 0.003, now 0.01; rerun "
                                               r"with the same options .* or use a new --workdir"):
        run_train(_train_args(tiny["src"], out, "--steps", "32", "--lr", "1e-2"))


def test_train_help_shows_every_default(monkeypatch, capsys):
    from jaxdecode.cli import main
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as e:
        main(["train", "lm", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split("options:", 1)[1].split())
    opts = [w for w in text.split() if w.startswith("--") and not w.endswith(",")]
    segments = {}
    for i, opt in enumerate(opts):
        start = text.index(f" {opt}") if i else text.index(opt)
        end = text.index(f" {opts[i + 1]}", start + 1) if i + 1 < len(opts) else len(text)
        segments[opt] = text[start:end]
    assert {"--steps", "--lr", "--batch-size", "--seq-len", "--warmup", "--keep-checkpoints"} <= set(segments)
    flags = {"--help", "--bf16", "--fsdp", "--no-progress"}
    missing = [o for o, seg in segments.items() if o not in flags and "default" not in seg.lower()
               and o not in ("--corpus", "--output")]  # required
    assert not missing, missing
    assert "(default: 2000)" in segments["--steps"] and "(default: 8)" in segments["--batch-size"]
    assert "final learning rate" in segments["--steps"]  # how a longer --steps extends the schedule


# ----------------------------------------------------------------------------- bad input
def test_empty_corpus_errors(tmp_path, tiny):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="empty corpus"):
        build_corpus([tmp_path / "empty"], tiny["tok"], tmp_path / "c")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.py").write_text("")
    with pytest.raises(CorpusError, match="empty corpus: the .* split has no documents"):
        build_corpus([tmp_path / "blank"], tiny["tok"], tmp_path / "c")
    assert not (tmp_path / "c").exists()
    with pytest.raises(TokenizerError, match="empty corpus"):
        train_tokenizer(iter([]), 300)
    with pytest.raises(CorpusError, match="too small"):
        WindowSampler(np.zeros(10, np.int32), 2, 32)


def test_missing_tokenizer_directory_says_so(tmp_path, tiny):
    """A tokenizer path that does not exist (or is a file) is named as such, not as "holds no tokenizer"."""
    with pytest.raises(TokenizerError, match="tokenizer directory .*no_such_dir does not exist"):
        load_tokenizer_dir(tmp_path / "no_such_dir")
    (tmp_path / "file").write_text("x")
    with pytest.raises(TokenizerError, match="is not a directory"):
        load_tokenizer_dir(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="holds no tokenizer"):
        load_tokenizer_dir(tmp_path / "empty")


def test_vocab_mismatch_errors(tmp_path, tiny):
    tcfg, spec = tiny_setup(5)
    small = tiny["config"].replace(vocab_size=100)
    with pytest.raises(TokenizerError, match="vocabulary mismatch.*320 tokens.*vocab_size=100"):
        train_lm(tiny["corpus"], tiny["tok_dir"], small, tcfg, tmp_path / "r", spec=spec)
    other = train_tokenizer([(tiny["src"] / "mod_00.py").read_text()], 290, tmp_path / "other_tok")
    with pytest.raises(CorpusError, match="tokenizer mismatch"):
        Corpus.open(tiny["corpus"]).check_tokenizer(other)
    with pytest.raises(TokenizerError, match="too small"):
        train_tokenizer(["x"], 100)


def test_split_is_by_file_and_eval_covers_every_token(tiny):
    corpus = Corpus.open(tiny["corpus"])
    files = corpus.manifest["files"]
    assert {f["split"] for f in files} == {"train", "heldout"}
    held = corpus.tokens("heldout")
    assert sum(f["tokens"] for f in files if f["split"] == "heldout") == len(held)
    batches = eval_batches(held, 4, 16)
    assert sum(b["weights"].sum() for b in batches) == len(held) - 1
    s = WindowSampler(corpus.tokens("train"), 4, 16, seed=3)
    np.testing.assert_array_equal(s(7)["tokens"], s(7)["tokens"])
    assert not np.array_equal(s(7)["tokens"], s(8)["tokens"])


# ----------------------------------------------------------------------------- distillation, mesh
def test_distillation_from_a_teacher(tiny, tmp_path):
    from jaxdecode.models import init_params
    from jaxdecode.training.lm import export_lm
    teacher, _ = _run(tiny, tmp_path / "teacher", 30)
    export_lm(tiny["config"], teacher.module.raw_params(), tiny["tok"], tmp_path / "teacher_hf")
    tcfg, spec = tiny_setup(30, eval_every=0, checkpoint_every=0)
    spec = dataclasses.replace(spec, eval_max_batches=0)
    student = tiny["config"]
    r = train_lm(tiny["corpus"], tiny["tok_dir"], student, tcfg, tmp_path / "student", spec=spec,
                 teacher_dir=tmp_path / "teacher_hf")
    kls = [h["kl"] for h in r.history if "kl" in h]
    assert kls[-1] < kls[0]
    bad = tiny["config"].replace(vocab_size=400)
    export_lm(bad, init_params(bad, jax.random.PRNGKey(0)), tiny["tok"], tmp_path / "bad_teacher")
    with pytest.raises(TokenizerError, match="vocabulary mismatch"):
        train_lm(tiny["corpus"], tiny["tok_dir"], student, tcfg, tmp_path / "s2", spec=spec,
                 teacher_dir=tmp_path / "bad_teacher")


def test_continued_training_starts_from_given_weights(tiny, tmp_path):
    from jaxdecode.training.lm import export_lm
    first, _ = _run(tiny, tmp_path / "phase1", 30)
    export_lm(tiny["config"], first.module.raw_params(), tiny["tok"], tmp_path / "phase1_hf")
    tcfg, spec = tiny_setup(30, seed=1, checkpoint_every=30)
    cont = train_lm(tiny["corpus"], tiny["tok_dir"], tiny["config"], tcfg, tmp_path / "phase2", spec=spec,
                    init_from=tmp_path / "phase1_hf")
    fresh_first = next(h["loss"] for h in first.history if "loss" in h)
    cont_first = next(h["loss"] for h in cont.history if "loss" in h)
    assert cont_first < fresh_first - 1.0, (cont_first, fresh_first)
    other = tiny["config"].replace(num_layers=1, sliding_windows=())
    with pytest.raises(TrainConfigError, match="different architecture"):
        train_lm(tiny["corpus"], tiny["tok_dir"], other, tcfg, tmp_path / "x", spec=spec,
                 init_from=tmp_path / "phase1_hf")


def test_data_parallel_and_fsdp_match_single_device(tiny, tmp_path):
    assert jax.device_count() == 8
    out = {}
    # FSDP is data parallelism plus sharded params/optimizer state: one run covers both
    for name, kw in {"one": dict(data_parallel=1), "fsdp": dict(data_parallel=8, fsdp=True)}.items():
        tcfg, spec = tiny_setup(3, eval_every=0, checkpoint_every=0, **kw)
        spec = dataclasses.replace(spec, eval_max_batches=0)
        out[name] = train_lm(tiny["corpus"], tiny["tok_dir"], tiny["config"], tcfg, tmp_path / name,
                             spec=spec).module.raw_params()
    for name in ("fsdp",):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5),
                     out[name], out["one"])
    # FSDP really shards: the embedding is split over the 8 data devices
    emb = out["fsdp"]["embed"]
    assert emb.sharding.shard_shape(emb.shape)[0] == emb.shape[0] // 8
    with pytest.raises(TrainConfigError, match="multiple of the 8 data-parallel"):
        tcfg, spec = tiny_setup(3, data_parallel=None)
        train_lm(tiny["corpus"], tiny["tok_dir"], tiny["config"], tcfg, tmp_path / "x",
                 spec=spec.__class__(batch_size=12, seq_len=32, eval_batch_size=8))


def test_bf16_compute_keeps_float32_master_weights(tiny):
    from jaxdecode.models import init_params
    from jaxdecode.training.lm import lm_loss
    params = init_params(tiny["config"], jax.random.PRNGKey(0))
    batch = WindowSampler(Corpus.open(tiny["corpus"]).tokens("train"), 2, 16)(0)
    f32 = CausalLM(tiny["config"], params)
    bf16 = CausalLM(tiny["config"], params, compute_dtype="bfloat16")
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(bf16.raw_params()))
    l32, l16 = float(lm_loss(f32, batch)[0]), float(lm_loss(bf16, batch)[0])
    assert abs(l32 - l16) < 0.05, (l32, l16)
    with pytest.raises(TrainConfigError, match="compute_dtype"):
        CausalLM(tiny["config"], params, compute_dtype="float16")


def test_baselines_and_byte_counts(tiny):
    from jaxdecode.training.baselines import ngram_baselines, token_byte_lengths
    tok = tiny["tok"]
    text = (tiny["src"] / "mod_03.py").read_text()
    ids = np.asarray(tok(text)["input_ids"], np.int32)
    lengths = token_byte_lengths(tok)
    assert lengths[ids].sum() == len(text.encode("utf-8"))
    assert lengths[eos_id(tok)] == 0
    train = np.tile(np.arange(10, 20, dtype=np.int32), 50)  # a deterministic cycle
    held = np.tile(np.arange(10, 20, dtype=np.int32), 3)
    r = ngram_baselines(train, eval_batches(held, 2, 8), len(tok), lengths)
    assert r["bigram"]["nats_per_token"] < 0.1 < np.log(10) - 0.05 < r["unigram"]["nats_per_token"]
