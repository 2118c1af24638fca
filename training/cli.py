"""`jaxdecode train lm ...`: corpus -> (tokenizer) -> train -> HF export, resumable.

The lead's `jaxdecode/cli.py` calls `add_train_parser(subparsers)` and dispatches to `run_train`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_PATTERNS = "*.py,*.md,*.txt,*.rst"

# Run-identity keys (see training.trainer.ResumeMismatchError) -> the flags that set them.
FLAG_OF_KEY = {
    "train.learning_rate": "--lr", "train.warmup_steps": "--warmup", "train.weight_decay": "--weight-decay",
    "train.seed": "--seed", "train.schedule_steps": "--steps of the first run",
    "run.spec.batch_size": "--batch-size", "run.spec.eval_batch_size": "--batch-size",
    "run.spec.seq_len": "--seq-len", "run.spec.compute_dtype": "--bf16",
    "run.spec.distill_temperature": "--distill-temperature", "run.spec.distill_alpha": "--distill-alpha",
    "run.teacher": "--teacher", "run.init": "--init-from",
    "run.model.max_position_embeddings": "--max-positions", "run.corpus": "--corpus/--tokenizer",
    "run.model.vocab_size": "--vocab-size/--tokenizer",
}
for _k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "tie_word_embeddings"):
    FLAG_OF_KEY[f"run.model.{_k}"] = "--size"


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" for options with a default; options without one say it in their help."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    train = subparsers.add_parser("train", help="train models (causal LMs, draft models)")
    sub = train.add_subparsers(dest="train_command", metavar="{lm}")
    sub.required = True
    lm = sub.add_parser(
        "lm", help="train a causal LM from scratch or distil one from a teacher; export HF format",
        description="Train a Llama-style causal LM on text files and export config.json + "
                    "safetensors + tokenizer that jaxdecode and transformers load. Rerunning the "
                    "same command resumes from the last checkpoint (and says from which step); a "
                    "larger --steps extends a run. Options that would make resuming unsafe (learning "
                    "rate, batch, model, data, ...) must stay the same: a change is refused, naming it.",
        formatter_class=_DefaultsFormatter)
    lm.add_argument("--corpus", nargs="+", required=True,
                    help="source files/directories, or a corpus directory built earlier (manifest.json)")
    lm.add_argument("--output", required=True,
                    help="directory for the exported HF model (written whole at the end; other files "
                         "in it are kept)")
    lm.add_argument("--workdir", default=None,
                    help="checkpoints, metrics.jsonl, tokenizer and corpus (default: OUTPUT.train)")
    lm.add_argument("--tokenizer", default=None,
                    help="tokenizer directory (default: train a byte-level BPE on the corpus, kept in "
                         "WORKDIR/tokenizer and retrained when the sources or --vocab-size change)")
    lm.add_argument("--vocab-size", type=int, default=4096, help="size of a newly trained tokenizer")
    lm.add_argument("--patterns", default=DEFAULT_PATTERNS, help="file globs taken from corpus directories")
    lm.add_argument("--held-out-fraction", type=float, default=0.05, help="files held out (by path hash)")
    lm.add_argument("--size", default="small", choices=("tiny", "draft", "small", "base"),
                    help="model size: tiny (tests), draft (~2.4 M), small (~12.6 M), base (~30 M)")
    lm.add_argument("--teacher", default=None,
                    help="HF model directory to distil from, same tokenizer (default: none, plain LM loss)")
    lm.add_argument("--distill-temperature", type=float, default=1.0,
                    help="softmax temperature of the distillation KL term")
    lm.add_argument("--distill-alpha", type=float, default=1.0, help="weight of the KL term (rest: CE)")
    lm.add_argument("--init-from", default=None,
                    help="HF model directory (same size and tokenizer) to continue training from "
                         "(default: none, random init)")
    lm.add_argument("--steps", type=int, default=2000,
                    help="optimizer steps to train to. The learning-rate schedule (warmup, then cosine "
                         "to lr x 0.1) spans the --steps of a work directory's first run; rerunning with "
                         "a larger --steps extends a finished run, the extra steps at that final "
                         "learning rate (lr x 0.1)")
    lm.add_argument("--batch-size", type=int, default=8, help="sequences per step (and per eval batch)")
    lm.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    lm.add_argument("--max-positions", type=int, default=512, help="the model's max_position_embeddings")
    lm.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    lm.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    lm.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    lm.add_argument("--seed", type=int, default=0, help="initialisation and batch-order seed")
    lm.add_argument("--bf16", action="store_true", help="bfloat16 compute (float32 master weights)")
    lm.add_argument("--export-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="dtype of the exported weights")
    lm.add_argument("--data-parallel", type=int, default=None,
                    help="devices on the data axis (default: all)")
    lm.add_argument("--fsdp", action="store_true", help="shard params and optimizer state over data")
    lm.add_argument("--eval-every", type=int, default=200,
                    help="held-out evaluation every N steps (0: at the end)")
    lm.add_argument("--checkpoint-every", type=int, default=200,
                    help="checkpoint every N steps (0: at the end)")
    lm.add_argument("--keep-checkpoints", type=int, default=3, help="checkpoints kept (the newest)")
    lm.add_argument("--no-progress", action="store_true", help="no progress bar")
    return train


def _is_corpus_dir(paths) -> bool:
    return len(paths) == 1 and (Path(paths[0]) / "manifest.json").exists()


def _difference(have: dict | None, want: dict) -> str | None:
    """Why a recorded artefact does not fit (None: it fits)."""
    if have is None:
        return "no record of how it was made: an interrupted run or an older jaxdecode"
    diff = [k for k in want if have.get(k) != want[k]]
    if not diff:
        return None
    if "sources" in diff:
        return "it was made from other sources: the files, patterns or split changed"
    return "it was made with other " + ", ".join(f"{k}={have.get(k)!r}, now {want[k]!r}" for k in diff)


def prepare_data(args, work: Path) -> tuple[Path, Path]:
    """(tokenizer dir, corpus dir) for `jaxdecode train lm`: reused from the work directory when they
    were made from the same sources and options, (re)made otherwise (each written whole or not at all)."""
    from .corpus import Corpus, CorpusError, build_corpus, iter_texts, sources_record
    from .tokenizer import load_tokenizer_dir, train_tokenizer, trained_with

    patterns = [p for p in args.patterns.split(",") if p]
    if _is_corpus_dir(args.corpus):
        if args.tokenizer is None:
            raise CorpusError(f"{args.corpus[0]} is a built corpus: pass the --tokenizer it was built with")
        return Path(args.tokenizer), Path(args.corpus[0])
    sources = sources_record(args.corpus, patterns, args.held_out_fraction)
    if args.tokenizer is not None:
        tok_dir = Path(args.tokenizer)
    else:
        tok_dir = work / "tokenizer"
        want = {"vocab_size": args.vocab_size, "min_frequency": 2, "sources": sources}
        why = "none yet" if not tok_dir.exists() else _difference(trained_with(tok_dir), want)
        if why is not None:
            print(f"training a {args.vocab_size}-token BPE tokenizer -> {tok_dir} ({why})", file=sys.stderr)
            train_tokenizer(iter_texts(args.corpus, patterns, args.held_out_fraction), args.vocab_size,
                            tok_dir, record={"sources": sources})
    tok = load_tokenizer_dir(tok_dir)
    corpus_dir = work / "corpus"
    try:
        existing = Corpus.open(corpus_dir)
        existing.check_tokenizer(tok)
        why = _difference(existing.manifest, {"sources": sources})
    except CorpusError as e:
        why = "none yet" if not corpus_dir.exists() else str(e)
    if why is not None:
        print(f"tokenizing {args.corpus} -> {corpus_dir} ({why})", file=sys.stderr)
        build_corpus(args.corpus, tok, corpus_dir, held_out_fraction=args.held_out_fraction,
                     patterns=patterns)
    return tok_dir, corpus_dir


def run_train(args) -> int:
    """Run `jaxdecode train lm`; bad input raises a ValueError subclass with the fix in its message."""
    from .lm import LMTrainSpec, model_config, train_lm
    from .tokenizer import eos_id, load_tokenizer_dir
    from .trainer import ResumeMismatchError, TrainConfig

    if getattr(args, "train_command", "lm") != "lm":
        raise SystemExit(f"unknown train command {args.train_command!r}")
    output = Path(args.output)
    work = Path(args.workdir) if args.workdir else output.with_name(output.name + ".train")
    work.mkdir(parents=True, exist_ok=True)
    tok_dir, corpus_dir = prepare_data(args, work)
    tok = load_tokenizer_dir(tok_dir)
    config = model_config(args.size, len(tok), args.max_positions, eos_id(tok))
    tcfg = TrainConfig(steps=args.steps, learning_rate=args.lr, warmup_steps=args.warmup,
                       weight_decay=args.weight_decay, seed=args.seed, eval_every=args.eval_every,
                       checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints,
                       data_parallel=args.data_parallel, fsdp=args.fsdp, progress=not args.no_progress)
    spec = LMTrainSpec(batch_size=args.batch_size, seq_len=args.seq_len,
                       compute_dtype="bfloat16" if args.bf16 else "float32",
                       eval_batch_size=args.batch_size, distill_temperature=args.distill_temperature,
                       distill_alpha=args.distill_alpha)
    try:
        result = train_lm(corpus_dir, tok_dir, config, tcfg, work / "run", spec=spec,
                          teacher_dir=args.teacher, export_dir=output, export_dtype=args.export_dtype,
                          init_from=args.init_from)
    except ResumeMismatchError as e:
        raise e.renamed(FLAG_OF_KEY) from None
    loss = f"{result.eval_loss:.4f}" if result.eval_loss is not None else "n/a"
    print(f"trained {config.num_parameters() / 1e6:.2f} M params for {result.step} steps; held-out "
          f"loss {loss} nats/token; model -> {output}; logs -> {work / 'run' / 'metrics.jsonl'}")
    return 0


def main(argv=None) -> int:
    """Standalone entry (the package CLI normally wraps this): `python -m jaxdecode.training.cli lm ...`."""
    ap = argparse.ArgumentParser(prog="jaxdecode")
    sub = ap.add_subparsers(dest="command")
    add_train_parser(sub)
    args = ap.parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run_train(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
