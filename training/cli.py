"""`jaxdecode train lm ...`: corpus -> (tokenizer) -> train -> HF export, resumable.

The lead's `jaxdecode/cli.py` calls `add_train_parser(subparsers)` and dispatches to `run_train`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_PATTERNS = "*.py,*.md,*.txt,*.rst"


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    train = subparsers.add_parser("train", help="train models (causal LMs, draft models)")
    sub = train.add_subparsers(dest="train_command", metavar="{lm}")
    sub.required = True
    lm = sub.add_parser(
        "lm", help="train a causal LM from scratch or distil one from a teacher; export HF format",
        description="Train a Llama-style causal LM on text files and export config.json + "
                    "safetensors + tokenizer that jaxdecode and transformers load. Rerunning the "
                    "same command resumes from the last checkpoint.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    lm.add_argument("--corpus", nargs="+", required=True,
                    help="source files/directories, or a corpus directory built earlier (manifest.json)")
    lm.add_argument("--output", required=True, help="directory for the exported HF model")
    lm.add_argument("--workdir", default=None,
                    help="checkpoints, metrics.jsonl, tokenizer and corpus (default: OUTPUT.train)")
    lm.add_argument("--tokenizer", default=None,
                    help="tokenizer directory; default: train a byte-level BPE on the corpus")
    lm.add_argument("--vocab-size", type=int, default=4096, help="size of a newly trained tokenizer")
    lm.add_argument("--patterns", default=DEFAULT_PATTERNS, help="file globs taken from corpus directories")
    lm.add_argument("--held-out-fraction", type=float, default=0.05, help="files held out (by path hash)")
    lm.add_argument("--size", default="small", choices=("tiny", "draft", "small", "base"),
                    help="model size: tiny (tests), draft (~2.4 M), small (~12.6 M), base (~30 M)")
    lm.add_argument("--teacher", default=None, help="HF model directory to distil from (same tokenizer)")
    lm.add_argument("--distill-temperature", type=float, default=1.0)
    lm.add_argument("--distill-alpha", type=float, default=1.0, help="weight of the KL term (rest: CE)")
    lm.add_argument("--init-from", default=None,
                    help="HF model directory (same size and tokenizer) to continue training from")
    lm.add_argument("--steps", type=int, default=2000)
    lm.add_argument("--batch-size", type=int, default=8)
    lm.add_argument("--seq-len", type=int, default=256)
    lm.add_argument("--max-positions", type=int, default=512)
    lm.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    lm.add_argument("--warmup", type=int, default=100)
    lm.add_argument("--weight-decay", type=float, default=0.1)
    lm.add_argument("--seed", type=int, default=0)
    lm.add_argument("--bf16", action="store_true", help="bfloat16 compute (float32 master weights)")
    lm.add_argument("--export-dtype", default="float32", choices=("float32", "bfloat16"))
    lm.add_argument("--data-parallel", type=int, default=None, help="devices on the data axis (default all)")
    lm.add_argument("--fsdp", action="store_true", help="shard params and optimizer state over data")
    lm.add_argument("--eval-every", type=int, default=200)
    lm.add_argument("--checkpoint-every", type=int, default=200)
    lm.add_argument("--keep-checkpoints", type=int, default=3)
    lm.add_argument("--no-progress", action="store_true", help="no progress bar")
    return train


def _is_corpus_dir(paths) -> bool:
    return len(paths) == 1 and (Path(paths[0]) / "manifest.json").exists()


def run_train(args) -> int:
    """Run `jaxdecode train lm`; bad input raises a ValueError subclass with the fix in its message."""
    from .corpus import Corpus, CorpusError, build_corpus, iter_texts
    from .lm import LMTrainSpec, model_config, train_lm
    from .tokenizer import eos_id, load_tokenizer_dir, train_tokenizer
    from .trainer import TrainConfig

    if getattr(args, "train_command", "lm") != "lm":
        raise SystemExit(f"unknown train command {args.train_command!r}")
    output = Path(args.output)
    work = Path(args.workdir) if args.workdir else output.with_name(output.name + ".train")
    work.mkdir(parents=True, exist_ok=True)
    patterns = [p for p in args.patterns.split(",") if p]

    if _is_corpus_dir(args.corpus):
        corpus_dir = Path(args.corpus[0])
        if args.tokenizer is None:
            raise CorpusError(f"{corpus_dir} is a built corpus: pass the --tokenizer it was built with")
        tok_dir = Path(args.tokenizer)
    else:
        tok_dir = Path(args.tokenizer) if args.tokenizer else work / "tokenizer"
        if args.tokenizer is None and not (tok_dir / "tokenizer.json").exists():
            print(f"training a {args.vocab_size}-token BPE tokenizer -> {tok_dir}", file=sys.stderr)
            train_tokenizer(iter_texts(args.corpus, patterns, args.held_out_fraction), args.vocab_size,
                            tok_dir)
        corpus_dir = work / "corpus"
        tok = load_tokenizer_dir(tok_dir)
        try:
            existing = Corpus.open(corpus_dir)
            existing.check_tokenizer(tok)
            if existing.manifest["roots"] != [str(p) for p in args.corpus] or \
                    existing.manifest["patterns"] != patterns:
                raise CorpusError("different sources")
        except CorpusError:
            print(f"tokenizing {args.corpus} -> {corpus_dir}", file=sys.stderr)
            build_corpus(args.corpus, tok, corpus_dir, held_out_fraction=args.held_out_fraction,
                         patterns=patterns)
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
    result = train_lm(corpus_dir, tok_dir, config, tcfg, work / "run", spec=spec,
                      teacher_dir=args.teacher, export_dir=output, export_dtype=args.export_dtype,
                      init_from=args.init_from)
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
