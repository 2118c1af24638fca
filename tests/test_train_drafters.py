"""Training drafters: the kind registry, self-distillation data, train_drafter (held-out loss and
acceptance from real engine runs, exact resume, export -> load -> decode), the on-policy draft LM, CLI."""
from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdecode
from jaxdecode.drafters import ChainBuilder, make_drafter
from jaxdecode.drafters.trained import DrafterKind, load_drafter, register_kind, save_drafter, unregister_kind
from jaxdecode.training import drafters as td
from jaxdecode.training.distill_data import (DistillOptions, load_shard, make_batches, prompt_windows,
                                             self_distill_data)
from jaxdecode.training.trainer import TrainConfig


# ----------------------------------------------------------------------------- a trivial kind
@dataclasses.dataclass(frozen=True)
class BigramConfig:
    depth: int = 3


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BigramDrafter:
    """Drafts a chain from a learned next-token table (no target features): the test kind."""
    table: jax.Array  # f32[V, V] logits of the next token given the current one
    builder: object = dataclasses.field(metadata=dict(static=True))

    num_nodes = property(lambda self: self.builder.num_nodes)
    max_depth = property(lambda self: self.builder.max_depth)
    child_rule = property(lambda self: self.builder.rule)
    is_chain = True

    def init(self, prompt_tokens, prompt_lengths, cache_len, key):
        return jnp.zeros((), jnp.int32)

    def propose(self, state, ctx, sampler):
        pending = jnp.take_along_axis(ctx.history, (ctx.hist_len - 1)[:, None], axis=1)[:, 0]

        def expand(s, start, tokens, parents_all):
            return jax.nn.log_softmax(self.table[tokens], axis=-1), s

        root = jax.nn.log_softmax(self.table[pending], axis=-1)
        tree, slots, state = self.builder.build(state, root, expand, ctx.key)
        return tree, slots, state

    def observe(self, state, obs):
        return state


def _make(params, cfg, target, tree=None, temperature=0.0, **kw):
    return BigramDrafter(table=params["table"], builder=ChainBuilder(cfg.depth))


class BigramModule(nnx.Module):
    def __init__(self, cfg, target_config, rngs):
        v = target_config.vocab_size
        self.table = nnx.Param(jnp.zeros((v, v), jnp.float32))


def _loss(module, batch, constants):
    toks, mask = batch["tokens"], batch["mask"]
    logits = module.table[...][toks[:, :-1]]
    w = mask[:, 1:] * mask[:, :-1]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), toks[:, 1:, None], -1)[..., 0]
    n = jnp.maximum(w.sum(), 1.0)
    return jnp.sum(nll * w) / n, {"tokens": w.sum()}


@pytest.fixture(scope="module")
def bigram_kind():
    register_kind(DrafterKind(name="bigram_test", config_cls=BigramConfig, make=_make,
                              target_fields=("vocab_size",)), replace=True)
    td.register_train_kind(td.TrainKind(name="bigram_test", module=BigramModule, loss_fn=_loss,
                                        default_config=lambda tc, **kw: BigramConfig(**kw)))
    yield "bigram_test"
    td.unregister_train_kind("bigram_test")
    unregister_kind("bigram_test")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target Model, corpus dir) of a tiny trained LM with a real tokenizer."""
    from jaxdecode.training.fixtures import build_tiny_lm
    root = tmp_path_factory.mktemp("tiny")
    model_dir = build_tiny_lm(root / "lm", steps=40)
    return jaxdecode.load(model_dir), root / "lm" / "corpus"


def _cfg(steps, **kw):
    base = dict(steps=steps, learning_rate=0.3, warmup_steps=1, weight_decay=0.0, log_every=5, eval_every=10,
                checkpoint_every=10, keep_checkpoints=3, data_parallel=1, progress=False)
    base.update(kw)
    return TrainConfig(**base)


EVAL = td.EvalOptions(prompts=4, prompt_len=8, new_tokens=12, loss_batches=2)


# ----------------------------------------------------------------------------- registry
def test_unknown_and_missing_kinds(monkeypatch):
    with pytest.raises(td.TrainKindError, match="unknown training kind 'nope'.*known kinds: medusa"):
        td.get_train_kind("nope")
    monkeypatch.setitem(td.TRAIN_KIND_MODULES, "ghost", "jaxdecode.training.ghost_kind_module")
    with pytest.raises(td.TrainKindError, match="needs its module jaxdecode.training.ghost_kind_module"):
        td.get_train_kind("ghost")
    with pytest.raises(ValueError, match="must be callable"):
        td.TrainKind(name="x", module=1, loss_fn=_loss, default_config=BigramConfig)


# ----------------------------------------------------------------------------- data
def test_self_distillation_data(tiny, tmp_path, monkeypatch):
    target, corpus = tiny
    opts = DistillOptions(num_prompts=6, prompt_len=8, new_tokens=10, batch_size=4, greedy_fraction=0.5)
    shard = self_distill_data(target, corpus, tmp_path, opts, progress=False)
    tokens, mask = load_shard(shard)
    assert tokens.shape == mask.shape == (6, 18)
    assert (mask[:, :8] == 1).all() and ((tokens == 0) | (mask > 0)).all()
    # the first batch is greedy: the target's own greedy continuation of its prompt
    from jaxdecode.autoregressive import decode
    from jaxdecode.training.corpus import Corpus
    prompts = prompt_windows(Corpus.open(corpus).tokens("train"), 8, 8, opts.seed)
    assert (tokens[:, :8] == prompts[:6]).all()
    ref = decode(target.config, target.params, prompts[:4], np.full(4, 8, np.int32), max_new_tokens=10,
                 eos_ids=tuple(target.config.eos_token_ids), method="greedy")
    n = np.asarray(ref.lengths)
    for r in range(4):
        assert (tokens[r, 8:8 + n[r]] == np.asarray(ref.tokens)[r, :n[r]]).all() and mask[r, 8:].sum() == n[r]
    # cached: the same request does not regenerate; other options are another shard
    stamp = shard.stat().st_mtime_ns
    assert self_distill_data(target, corpus, tmp_path, opts, progress=False) == shard
    assert shard.stat().st_mtime_ns == stamp
    other = self_distill_data(target, corpus, tmp_path, dataclasses.replace(opts, seed=1), progress=False)
    assert other != shard
    # an interrupted generation goes on from its finished chunks and gives the same shard
    import jaxdecode.autoregressive as ar
    real, calls = ar.decode, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(ar, "decode", failing)
    with pytest.raises(KeyboardInterrupt):
        self_distill_data(target, corpus, tmp_path / "again", opts, progress=False)
    again = self_distill_data(target, corpus, tmp_path / "again", opts, progress=False)
    assert (load_shard(again)[0] == tokens).all() and len(calls) == 3  # only the missing chunk was made
    # batches are pure functions of the step; mix = half corpus windows, half continuations
    b = make_batches("mix", corpus, batch_size=4, seq_len=18, seed=3, shard=shard)
    x, y = b(5), b(5)
    assert x["tokens"].shape == (4, 18) and (x["tokens"] == y["tokens"]).all()
    assert (x["mask"][:2] == 1).all()
    with pytest.raises(ValueError, match="unknown data 'web'"):
        make_batches("web", corpus, batch_size=4, seq_len=18)


# ----------------------------------------------------------------------------- train_drafter
def test_train_drafter_improves_and_exports(tiny, bigram_kind, tmp_path):
    target, corpus = tiny
    # data_parallel=None: the trainer's state lives on all 8 devices, the evaluation runs beside the target
    res = td.train_drafter(bigram_kind, target, corpus, tmp_path / "out", train_config=_cfg(30, data_parallel=None),
                           batch_size=8, seq_len=24, eval_options=EVAL)
    evals = [r for r in td.read_metrics_file(tmp_path / "out.train" / "metrics.jsonl") if "tau" in r]
    assert [r["step"] for r in evals] == [10, 20, 30]
    assert all("eval_loss" in r and len(r["accept_by_depth"]) == 3 for r in evals)
    # against the untrained table (uniform: tau 1 + a little luck)
    drafter0 = _make({"table": jnp.zeros_like(res.params["table"])}, res.cfg, target)
    prompts = td.heldout_prompts(corpus, EVAL.prompts, EVAL.prompt_len)
    tau0 = td.measure_acceptance(target, drafter0, prompts, new_tokens=EVAL.new_tokens)["tau"]
    assert evals[-1]["tau"] > tau0 + 0.3, (tau0, evals)
    assert evals[-1]["eval_loss"] < np.log(target.config.vocab_size) - 1.0
    assert (tmp_path / "out.train" / "training.png").exists()
    # export -> load -> decode: greedy speculative equals plain greedy
    loaded = load_drafter(tmp_path / "out", target)
    assert loaded.extra["trained_steps"] == 30 and loaded.extra["heldout"]["tau"] == evals[-1]["tau"]
    drafter = make_drafter(bigram_kind, target, drafter_dir=tmp_path / "out")
    from jaxdecode.autoregressive import decode
    from jaxdecode.speculative import speculative_decode
    from jaxdecode.verifiers import get_verifier
    lens = np.full(len(prompts), prompts.shape[1], np.int32)
    spec = speculative_decode(target.config, target.params, drafter, prompts, lens, max_new_tokens=12,
                              verifier=get_verifier("greedy"))
    ref = decode(target.config, target.params, prompts, lens, max_new_tokens=12, method="greedy")
    assert (np.asarray(spec.tokens) == np.asarray(ref.tokens)).all()


def test_resume_is_exact(tiny, bigram_kind, tmp_path):
    target, corpus = tiny
    kw = dict(batch_size=4, seq_len=16, eval_options=EVAL, plot=False)
    whole = td.train_drafter(bigram_kind, target, corpus, None, workdir=tmp_path / "a",
                             train_config=_cfg(12, checkpoint_every=6, eval_every=6), **kw)
    td.train_drafter(bigram_kind, target, corpus, None, workdir=tmp_path / "b",
                     train_config=_cfg(6, checkpoint_every=6, eval_every=6, schedule_steps=12), **kw)
    second = td.train_drafter(bigram_kind, target, corpus, None, workdir=tmp_path / "b",
                              train_config=_cfg(12, checkpoint_every=6, eval_every=6, schedule_steps=12), **kw)
    assert second.train.resumed_from == 6
    np.testing.assert_array_equal(np.asarray(whole.params["table"]), np.asarray(second.params["table"]))


# ----------------------------------------------------------------------------- draft LM, on-policy + CLI
def _flags(**kw):
    out = []
    for k, v in kw.items():
        out += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return out


SMALL = dict(steps=20, eval_every=10, checkpoint_every=10, batch_size=8, seq_len=24, prompt_len=8, prompts=16,
             gen_batch_size=8, eval_prompts=4, eval_new_tokens=12, warmup=1, no_progress=True)


def test_draft_lm_on_policy_cli(tiny, tmp_path, capsys):
    from jaxdecode.cli import main
    target, corpus = tiny
    out = tmp_path / "draft"
    rc = main(["train", "draft-lm", "--target", target.path, "--corpus", str(corpus), "--out", str(out),
               *_flags(**SMALL, size="tiny", lr=3e-3, logit_distill=True)])
    assert rc == 0, capsys.readouterr().err
    assert "held-out tau" in capsys.readouterr().out
    evals = [r for r in td.read_metrics_file(tmp_path / "draft.train" / "run" / "metrics.jsonl") if "tau" in r]
    assert [r["step"] for r in evals] == [10, 20]
    assert all(r["tau"] >= 1.0 for r in evals) and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert (tmp_path / "draft.train" / "data").is_dir()  # --data self is the draft-lm default
    draft = jaxdecode.load(out)  # an HF directory with the target's tokenizer: usable as --draft
    assert draft.config.vocab_size == target.config.vocab_size and draft.tokenizer is not None


def test_accept_head_cli_takes_its_own_options(tiny, tmp_path, capsys):
    """`train accept-head` lists and honours the options of label runs (--new-tokens, --temperatures,
    --batch-size of labelled row-steps) and of the saved threshold's pricing (--draft-cost, --node-cost), and
    refuses the text-data options of the other kinds by name."""
    from jaxdecode.cli import main
    target, corpus = tiny
    out = tmp_path / "head"
    base = ["train", "accept-head", "--target", target.path, "--corpus", str(corpus), "--out", str(out)]
    flags = _flags(draft=target.path, prompts=4, prompt_len=8, new_tokens=8, temperatures="0", eval_prompts=2,
                   steps=6, eval_every=3, checkpoint_every=3, batch_size=32, warmup=1, no_progress=True)
    assert main([*base, *flags, "--set", "draft_len=3", "--draft-cost", "0.45", "--node-cost", "0.065"]) == 0, \
        capsys.readouterr().err
    head = load_drafter(out, target)
    assert head.cfg.draft_len == 3 and head.extra["temperatures"] == [0.0] and head.extra["steps"] == 6
    assert set(head.extra["heldout"]) == {"T=0"}  # one label run per --temperatures entry
    priced = head.extra["heldout"]["T=0"]["estimate"]  # the threshold was chosen at these unit costs
    assert (priced["draft_cost"], priced["node_cost"]) == (0.45, 0.065)
    capsys.readouterr()
    for bad, why in [(["--data", "self"], "--data self does not apply"),
                     (["--temperature", "0.7"], "unrecognized arguments: --temperature"),
                     (["--seq-len", "9"], "unrecognized arguments: --seq-len"),
                     (["--temperatures", "0,-1"], "temperatures must be finite, >= 0"),
                     (["--draft-cost", "-0.1"], "a cost in target steps is a finite number >= 0"),
                     (["--node-cost", "nan"], "a cost in target steps is a finite number >= 0")]:
        with pytest.raises(SystemExit):
            main([*base, *bad])
        assert why in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "accept-head", "--help"])
    usage = capsys.readouterr().out
    assert "--new-tokens" in usage and "--temperatures" in usage and "labelled row-steps" in usage
    assert "--draft-cost" in usage and "--node-cost" in usage
    assert not any(f in usage for f in ("--data ", "--seq-len", "--greedy-fraction", "--gen-batch-size", "--tree"))


def test_cli_kind_run_errors_and_help(tiny, bigram_kind, tmp_path, capsys, monkeypatch):
    from jaxdecode.cli import main
    from jaxdecode.training import cli
    target, corpus = tiny
    monkeypatch.setattr(cli, "DRAFTER_COMMANDS", cli.DRAFTER_COMMANDS + ("bigram-test",))
    args = ["train", "bigram-test", "--target", target.path, "--corpus", str(corpus), "--out",
            str(tmp_path / "bg"), *_flags(**dict(SMALL, steps=4, eval_every=4, checkpoint_every=4), lr=0.3)]
    assert main(args) == 0, capsys.readouterr().err
    assert load_drafter(tmp_path / "bg", target).extra["trained_steps"] == 4
    capsys.readouterr()
    assert main([*args[:-len(args) + 8], *_flags(**dict(SMALL, steps=4, seq_len=20), lr=0.3)]) == 2
    assert "--seq-len" in capsys.readouterr().err  # a changed option is refused by its flag
    # a kind whose training module is not installed: a clear error, not a traceback
    monkeypatch.setitem(td.TRAIN_KIND_MODULES, "kangaroo", "jaxdecode.training.ghost_kind_module")
    monkeypatch.setattr(td, "_TRAIN_KINDS", {k: v for k, v in td._TRAIN_KINDS.items() if k != "kangaroo"})
    assert main(["train", "kangaroo", "--target", target.path, "--corpus", str(corpus), "--out",
                 str(tmp_path / "k")]) == 2
    assert "needs its module jaxdecode.training.ghost_kind_module" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "nope", "--target", "x"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "medusa", "--help"])
    assert "(default: corpus)" in capsys.readouterr().out


def _without_matplotlib(monkeypatch):
    """Imports of matplotlib fail from here on, as in an install without it (it is only a [test] extra)."""
    import sys
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] or ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)


def test_cli_by_embedded_target_name_without_matplotlib(tiny, bigram_kind, tmp_path, capsys, monkeypatch):
    """`--target target` (an embedded model's name, as jaxdecode.load takes it) tokenizes --sources with that
    model's own tokenizer; without matplotlib the drafter is still exported and the run succeeds, the plot
    skipped with one warning (and the summary names no plot file)."""
    import importlib
    from jaxdecode.cli import main
    from jaxdecode.training import cli
    target, corpus = tiny
    embedded = tmp_path / "embedded"
    embedded.mkdir()
    (embedded / "target").symlink_to(target.path, target_is_directory=True)
    monkeypatch.setattr(importlib.import_module("jaxdecode.model"), "EMBEDDED_DIR", embedded)
    monkeypatch.setattr(cli, "DRAFTER_COMMANDS", cli.DRAFTER_COMMANDS + ("bigram-test",))
    _without_matplotlib(monkeypatch)
    with pytest.raises(ImportError):
        import matplotlib  # noqa: F401
    out = tmp_path / "bg"
    rc = main(["train", "bigram-test", "--target", "target", "--sources", str(corpus.parent / "src"), "--out",
               str(out), *_flags(**dict(SMALL, steps=4, eval_every=4, checkpoint_every=4), lr=0.3)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert load_drafter(out, target).extra["trained_steps"] == 4
    assert (tmp_path / "bg.train" / "corpus" / "manifest.json").exists()  # tokenized with the target's tokenizer
    assert not (tmp_path / "bg.train" / "training.png").exists()
    assert "plot ->" not in captured.out and "drafter -> " in captured.out
    (warning,) = [line for line in captured.err.splitlines() if "matplotlib" in line]
    assert "not installed" in warning and "pip install matplotlib" in warning and "training.png" in warning
    assert td.plot_training([{"step": 1, "loss": 1.0}], tmp_path / "p.png") is None


@pytest.mark.parametrize("command", [["medusa", "--target", "no/such/target", "--corpus", "no/such/corpus", "--out"],
                                     ["lm", "--corpus", "no/such/corpus", "--output"],
                                     ["dllm", "--corpus", "no/such/corpus", "--output"]])
def test_cli_checks_training_options_before_loading_anything(tmp_path, capsys, command):
    """`--steps 2` with the default warmup is refused at once, not after the target loads and the corpus is
    tokenized: here neither exists, so any later error would name them instead."""
    from jaxdecode.cli import main
    assert main(["train", *command, str(tmp_path / "out"), "--steps", "2", "--no-progress"]) == 2
    assert "warmup_steps must be in [0, steps)" in capsys.readouterr().err


@pytest.mark.parametrize("extra,match", [
    (["--set", "num_headz=4"], r"--set: the medusa drafter's config has no field\(s\) \['num_headz'\]; its fields: "
                               r"loss_decay, num_heads"),
    (["--draft", "some/draft"], "--draft: the medusa drafter drafts without a draft model: drop --draft"),
    (["--data", "self", "--seq-len", "16", "--prompt-len", "32"], r"--seq-len \(16\) must exceed --prompt-len"),
    (["--out-is", "file"], "is a file, not a directory"),
    (["--out-is", "dir"], "non-empty directory that holds no drafter"),
])
def test_cli_checks_drafter_arguments_before_loading_anything(tmp_path, capsys, extra, match):
    """--set fields, --draft and --out are checked before the target loads (it does not exist here) and
    long before training; an --out that is a file, or a directory of other things, is never replaced."""
    from jaxdecode.cli import main
    out = tmp_path / "out"
    if extra[0] == "--out-is":
        if extra[1] == "file":
            out.write_text("precious")
        else:
            out.mkdir()
            (out / "notes.txt").write_text("precious")
        extra = []
    rc = main(["train", "medusa", "--target", "no/such/target", "--corpus", "no/such/corpus", "--out", str(out),
               "--no-progress", *extra])
    assert rc == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "out.train").exists()
    if out.is_file():
        assert out.read_text() == "precious"
    elif out.is_dir():
        assert (out / "notes.txt").read_text() == "precious"


def test_save_drafter_keeps_other_files_and_refuses_what_is_not_a_drafter(tmp_path):
    """Retraining in place replaces the weights and keeps notes beside them; a file or a directory that
    holds no drafter is refused, untouched."""
    from jaxdecode.drafters.medusa import MedusaConfig
    from jaxdecode.models.config import ModelConfig
    tcfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=4, intermediate_size=16, max_position_embeddings=32)
    cfg = MedusaConfig(num_heads=1)
    params = td.params_of(td.get_train_kind("medusa").module(cfg, tcfg, nnx.Rngs(0)))
    out = save_drafter(tmp_path / "m", "medusa", cfg, params, tcfg)
    (out / "NOTES.md").write_text("kept")
    save_drafter(out, "medusa", cfg, params, tcfg)
    assert (out / "NOTES.md").read_text() == "kept" and load_drafter(out, tcfg).kind.name == "medusa"
    (tmp_path / "f").write_text("precious")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("precious")
    for bad, match in ((tmp_path / "f", "is a file"), (tmp_path / "d", "holds no drafter")):
        with pytest.raises(ValueError, match=match):
            save_drafter(bad, "medusa", cfg, params, tcfg)
    assert (tmp_path / "f").read_text() == "precious" and (tmp_path / "d" / "x.txt").read_text() == "precious"
