"""Build the embedded default models: corpus -> tokenizer -> target + draft -> export -> card -> dLLM.

    python -m jaxdecode.training.build_embedded [--workdir runs/embedded] [--out models/embedded]
        [--stages tokenizer,corpus,target,draft,report,dllm,distill-draft,retrieval]

Every stage resumes: the tokenizer and corpus are reused when present, training continues from the
latest checkpoint in <workdir>/<model>/checkpoints, and `report` exports the latest checkpoint of
each model (bf16 safetensors), evaluates it on the whole held-out split, computes the unigram and
bigram baselines, plots the loss curves and writes MODEL_CARD.md. The target and draft stages can run
as separate processes at the same time (`--stages target` and `--stages draft`). `distill-draft` then
replaces the shipped draft by one distilled on-policy from the exported target (`recipe.DISTILLED_DRAFT`)
and records it in the card; a later `report` keeps it. `retrieval` builds the target's retrieval datastore
(`recipe.RETRIEVAL`: its own greedy continuations of training prompts) into target/drafters/retrieval.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import sysconfig
import time
from pathlib import Path

from .recipe import (DISTILLED_DRAFT, HELD_OUT_FRACTION, PACKAGE_FILE_MAX_BYTES, PACKAGE_SAMPLE_BYTES, PACKAGES,
                     RETRIEVAL, VOCAB_SIZE, phase_corpus, phases, recipe)
from .tokenizer import load_tokenizer_dir, train_tokenizer

STAGES = ("tokenizer", "corpus", "target", "draft", "report", "dllm", "distill-draft", "retrieval")

# The embedded diffusion LM (`load("dllm")`): the exported target adapted Dream-style (bidirectional
# attention, logits shifted by one, MASK token added) on the target's own corpus split.
DLLM_FLAGS = ("--attention", "bidirectional", "--logits-shift", "1", "--steps", "1500", "--batch-size", "8",
              "--seq-len", "256", "--lr", "5e-4", "--warmup", "50", "--eval-every", "100",
              "--checkpoint-every", "100", "--data-parallel", "1", "--export-dtype", "bfloat16")


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stage_tokenizer(work: Path):
    tok_dir = work / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        return load_tokenizer_dir(tok_dir)
    from .corpus import iter_texts
    return train_tokenizer(iter_texts([stdlib_root()], held_out_fraction=HELD_OUT_FRACTION),
                           VOCAB_SIZE, tok_dir)


def _corpus(work: Path, name: str, roots):
    """work/<name>, reused when it matches the tokenizer, else built from `roots()`."""
    from .corpus import Corpus, CorpusError, build_corpus
    tok = stage_tokenizer(work)
    try:
        corpus = Corpus.open(work / name)
        corpus.check_tokenizer(tok)
        return corpus
    except CorpusError:
        build_corpus(roots(), tok, work / name, held_out_fraction=HELD_OUT_FRACTION)
        return Corpus.open(work / name)


def stage_corpus(work: Path):
    return _corpus(work, "corpus", lambda: [stdlib_root()])


def stage_package_corpus(work: Path):
    """The stdlib plus a fixed slice of installed packages (`recipe.PACKAGES`), for the phases in
    `recipe.PACKAGE_PHASES`. The stdlib files keep their split; package files get one by the same rule."""
    import json

    from .corpus import sample_package_sources

    def roots():
        src = work / "packages-src"
        if not (src / "packages.json").exists():
            record = sample_package_sources(PACKAGES, src / "packages", budget_bytes=PACKAGE_SAMPLE_BYTES,
                                            max_file_bytes=PACKAGE_FILE_MAX_BYTES)
            (src / "packages.json").write_text(json.dumps(record, indent=1))
        return [stdlib_root(), src / "packages"]
    return _corpus(work, "corpus-packages", roots)


def stage_train(work: Path, name: str, progress: bool):
    """Every phase of one model in turn; each resumes from its own checkpoints."""
    from .lm import train_lm
    from .tokenizer import eos_id
    stage_corpus(work)
    tok = load_tokenizer_dir(work / "tokenizer")
    config, _, spec = recipe(name, len(tok), eos_id(tok))
    params, result, previous = None, None, None
    for dirname, tcfg in phases(name):
        tcfg = dataclasses.replace(tcfg, progress=progress)
        if phase_corpus(dirname) != "corpus":
            stage_package_corpus(work)
        result = train_lm(work / phase_corpus(dirname), work / "tokenizer", config, tcfg, work / dirname,
                          spec=spec, init_from=params, init_info=previous)
        params, previous = result.module.raw_params(), f"{dirname} step {result.step}"
    return result


def stage_dllm(work: Path, out: Path, progress: bool) -> int:
    """`jaxdecode train dllm` from the exported target (needs the report stage's export); resumes."""
    from .cli import main as train_main
    if not (out / "target" / "config.json").exists():
        raise SystemExit(f"stage dllm adapts the exported target {out / 'target'}: run the report stage first")
    stage_corpus(work)
    return train_main(["dllm", "--corpus", str(work / "corpus"), "--tokenizer", str(out / "target"),
                       "--init-from", str(out / "target"), "--output", str(out / "dllm"),
                       "--workdir", str(work / "dllm"), *DLLM_FLAGS] + ([] if progress else ["--no-progress"]))


def stage_distill_draft(work: Path, out: Path, progress: bool, command: str, eval_windows: int = 256) -> int:
    """Replace the shipped draft by one distilled on-policy from the shipped target (`recipe.DISTILLED_DRAFT`,
    `jaxdecode train draft-lm --data self`; resumes), then record it in the card (report.record_distilled_draft).
    A later `report` stage keeps it rather than re-export the from-scratch draft's checkpoints."""
    from .cli import main as train_main
    from .report import record_distilled_draft
    if not (out / "target" / "config.json").exists() or not (out / "metrics.json").exists():
        raise SystemExit(f"stage distill-draft distils from the exported target {out / 'target'} and records into "
                         f"{out / 'metrics.json'}: run the report stage first")
    stage_corpus(work)
    r, run_dir = DISTILLED_DRAFT, work / "draft-distilled"
    flags = ["--steps", r["steps"], "--batch-size", r["batch_size"], "--lr", r["learning_rate"],
             "--warmup", r["warmup_steps"], "--seed", r["seed"], "--prompts", r["prompts"],
             "--prompt-len", r["prompt_len"], "--seq-len", r["seq_len"], "--temperature", r["temperature"],
             "--greedy-fraction", r["greedy_fraction"], "--eval-every", r["eval_every"]]
    rc = train_main(["draft-lm", "--target", str(out / "target"), "--corpus", str(work / "corpus"), "--data", "self",
                     "--size", "draft", "--out", str(run_dir / "export"), "--workdir", str(run_dir),
                     *map(str, flags)] + ([] if progress else ["--no-progress"]))
    if rc:
        return rc
    record_distilled_draft(work, out, run_dir, run_dir / "export", command, r, eval_windows=eval_windows)
    return 0


def stage_retrieval(work: Path, out: Path, progress: bool) -> int:
    """The target's retrieval datastore (`recipe.RETRIEVAL`, `jaxdecode train retrieval`; the generated
    continuations are cached in the work directory) into out/target/drafters/retrieval."""
    from .cli import main as train_main
    if not (out / "target" / "config.json").exists():
        raise SystemExit(f"stage retrieval continues prompts with the exported target {out / 'target'}: run "
                         f"the report stage first")
    stage_corpus(work)
    r = RETRIEVAL
    flags = ["--prompts", r["prompts"], "--prompt-len", r["prompt_len"], "--seq-len", r["seq_len"],
             "--greedy-fraction", r["greedy_fraction"], "--seed", r["seed"]]
    return train_main(["retrieval", "--target", str(out / "target"), "--corpus", str(work / "corpus"),
                       "--out", str(out / "target" / "drafters" / "retrieval"), "--workdir", str(work / "retrieval"),
                       *map(str, flags)] + ([] if progress else ["--no-progress"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxdecode.training.build_embedded",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="runs/embedded", help="corpus, tokenizer, checkpoints, logs")
    ap.add_argument("--out", default="models/embedded", help="where the shipped models and card go")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {STAGES}")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar (for logs)")
    ap.add_argument("--refresh", action="store_true",
                    help="report: rewrite the card and metrics.json of the models already in --out (their "
                         "training run gone): keeps the recorded training facts, measures the compression "
                         "comparison anew; no export, the weights stay as they are")
    ap.add_argument("--eval-windows", type=int, default=256,
                    help="report: held-out windows of 256 tokens to score, spread evenly (0: all)")
    args = ap.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        ap.error(f"unknown stages {bad}; choose from {STAGES}")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    for s in stages:
        t0 = time.time()
        if s == "tokenizer":
            stage_tokenizer(work)
        elif s == "corpus":
            stage_corpus(work)
        elif s in ("target", "draft"):
            stage_train(work, s, not args.no_progress)
        elif s in ("dllm", "distill-draft"):  # a failed training run stops the build with its exit status
            rc = (stage_dllm(work, Path(args.out), not args.no_progress) if s == "dllm" else stage_distill_draft(
                work, Path(args.out), not args.no_progress, " ".join(
                    ["python -m jaxdecode.training.build_embedded"] + (argv if argv is not None else sys.argv[1:])),
                eval_windows=args.eval_windows))
            if rc:
                return rc
        elif s == "retrieval":
            rc = stage_retrieval(work, Path(args.out), not args.no_progress)
            if rc:
                return rc
        elif s == "report":
            from .report import build_report, refresh_report
            cmd = " ".join(["python -m jaxdecode.training.build_embedded"]
                           + (argv if argv is not None else sys.argv[1:]))
            if args.refresh:
                refresh_report(Path(args.out), command=cmd)
            else:
                build_report(work, Path(args.out), command=cmd, eval_windows=args.eval_windows)
        print(f"[build_embedded] stage {s} done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
