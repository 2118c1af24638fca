"""Bits per byte of the embedded target (or any checkpoint) against bz2, gzip and xz, file by file.

    python benchmarks/bench_compression.py [--model DIR] [--checkpoint RUN_DIR [--step N]]
        [--context 256] [--splits heldout,outside] [--outside-bytes 300000] [--json FILE]

Splits: the held-out files of the CPython standard library (the embedded corpus's held-out split,
never trained on) and a fixed ~300 KB sample of installed packages' sources outside that corpus
(jaxdecode.training.compression.outside_files). The model scores each file on its own with a sliding
window (context up to --context tokens, stride half of it, every token scored once, the first token
conditioned on <|endoftext|>); bits/byte = the file's nats / ln 2 / its UTF-8 bytes, summed over the
split. Compressors: per file (sizes summed) and over the whole split as one stream.

--checkpoint scores a training run's orbax checkpoint (the newest kept one, or --step) with the
architecture and tokenizer of --model, e.g. a run started with `jaxdecode train lm --init-from DIR`.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time

from _common import write_result

from jaxdecode.training.compression import OUTSIDE_BYTES, compare, heldout_stdlib_files, outside_files
from jaxdecode.training.recipe import SEQ_LEN


def checkpoint_params(model_dir: str, run_dir: str, step: int | None):
    """(params, step) of an orbax checkpoint of `jaxdecode train lm` whose model is shaped like model_dir."""
    import jax

    from jaxdecode.models import init_params, load_params
    from jaxdecode.training.lm import CausalLM
    from jaxdecode.training.trainer import TrainConfig, restore_latest
    config, _ = load_params(model_dir, dtype="float32")
    module = CausalLM(config, init_params(config.replace(dtype="float32"), jax.random.PRNGKey(0)))
    module, step = restore_latest(module, TrainConfig(), run_dir, step=step)
    return module.raw_params(), step


def table(result: dict) -> str:
    splits = list(result["splits"])
    rows = ["model (per file, sliding window)"] + [k for k in result["splits"][splits[0]] if " per file" in k
                                                   or " whole" in k]
    head = "| bits/byte | " + " | ".join(f"{s} ({result['splits'][s]['files']} files, "
                                        f"{result['splits'][s]['bytes'] / 1e3:.0f} KB)" for s in splits) + " |"
    lines = [head, "|---" * (len(splits) + 1) + "|"]
    for r in rows:
        vals = [result["splits"][s]["model"]["bits_per_byte"] if r.startswith("model") else result["splits"][s][r]
                for s in splits]
        lines.append(f"| {r} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF model directory (default: the embedded target)")
    ap.add_argument("--checkpoint", default=None,
                    help="a `jaxdecode train lm` run directory (WORKDIR/run, with checkpoints/): score its "
                         "newest kept checkpoint instead of --model's weights")
    ap.add_argument("--step", type=int, default=None, help="with --checkpoint: this step instead of the newest")
    ap.add_argument("--context", type=int, default=SEQ_LEN,
                    help="tokens of context at most (the model's trained sequence length)")
    ap.add_argument("--stride", type=int, default=None, help="window stride (default: context // 2)")
    ap.add_argument("--splits", default="heldout,outside", help="heldout and/or outside")
    ap.add_argument("--outside-bytes", type=int, default=OUTSIDE_BYTES, help="size of the outside sample")
    ap.add_argument("--batch-size", type=int, default=8, help="windows per forward call")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    if args.step is not None and args.checkpoint is None:
        ap.error("--step selects a checkpoint: pass --checkpoint RUN_DIR too")
    if args.model is None:
        from jaxdecode.api import embedded_model_path
        args.model = str(embedded_model_path())
    want = [s.strip() for s in args.splits.split(",") if s.strip()]
    if not want or any(s not in ("heldout", "outside") for s in want):
        ap.error(f"--splits takes heldout and/or outside, got {args.splits!r}")
    splits, versions = {}, {}
    if "heldout" in want:
        splits["heldout"] = heldout_stdlib_files()
    if "outside" in want:
        splits["outside"], versions = outside_files(budget_bytes=args.outside_bytes)
    params, step = (checkpoint_params(args.model, args.checkpoint, args.step) if args.checkpoint
                    else (None, None))
    t0 = time.time()

    def progress(split, i, n):
        if i % (50 * args.batch_size) == 0 or i >= n:
            print(f"[{split}] {min(i, n)}/{n} windows, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    res = compare(args.model, splits, args.context, args.stride, args.batch_size, progress, params=params)
    result = {"bench": "compression", "model": args.model, "checkpoint": args.checkpoint, "step": step,
              "python": platform.python_version(), "outside_packages": versions, "splits": res,
              "seconds": time.time() - t0}
    print(table(result))
    write_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
