"""`jaxdecode train lm ...`: corpus -> (tokenizer) -> train -> HF export, resumable.

The lead's `jaxdecode/cli.py` calls `add_train_parser(subparsers)` and dispatches to `run_train`.
"""
from __future__ import annotations

import argparse
import math
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
    sub = train.add_subparsers(dest="train_command",
                               metavar="{lm," + ",".join(DRAFTER_COMMANDS + ("retrieval",) + DLLM_COMMANDS) + "}")
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
    lm.add_argument("--eval-every", type=int, default=200,
                    help="held-out evaluation every N steps (0: at the end)")
    _add_mesh_and_checkpoints(lm)
    for command in DRAFTER_COMMANDS:
        if command == "accept-head":
            add_accept_head_parser(sub)
        else:
            add_drafter_parser(sub, command)
    add_retrieval_parser(sub)
    add_dllm_parsers(sub)
    return train


# `jaxdecode train KIND`: the trained-drafter kinds (training.drafters) and the on-policy draft LM.
DRAFTER_COMMANDS = ("medusa", "hydra", "eagle3", "block", "accept-head", "kangaroo", "draft-lm")


def _add_target_and_sources(p, workdir: str) -> None:
    """The frozen target, the output and the corpus of a drafter command (train KIND, train retrieval)."""
    p.add_argument("--target", required=True,
                   help="the target model's HF directory (with its tokenizer), or an embedded model's name "
                        "(target)")
    p.add_argument("--out", required=True, help="output directory (written whole at the end)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", help="a corpus directory built with the target's tokenizer (manifest.json)")
    src.add_argument("--sources", nargs="+",
                     help="source files/directories, tokenized with the target's tokenizer into WORKDIR/corpus")
    p.add_argument("--workdir", default=None, help=f"{workdir} (default: OUT.train)")
    p.add_argument("--patterns", default=DEFAULT_PATTERNS, help="file globs taken from --sources directories")
    p.add_argument("--held-out-fraction", type=float, default=0.05, help="files held out (by path hash)")


def _target_and_corpus(args, why: str):
    """(target Model, out dir, work dir, corpus dir) of a drafter command: the target loaded in float32
    (it must have its tokenizer: `why` says what it tokenizes), the corpus prepared in the work dir."""
    import argparse as _ap

    import jaxdecode
    out = Path(args.out)
    work = Path(args.workdir) if args.workdir else out.with_name(out.name + ".train")
    target = jaxdecode.load(args.target, dtype="float32")
    if target.tokenizer is None:
        raise ValueError(f"the target {args.target} has no tokenizer files: {why} with the target's tokenizer")
    work.mkdir(parents=True, exist_ok=True)  # after the target loads: a mistyped --target leaves nothing
    # The tokenizer is the loaded target's own directory: --target may be an embedded model's name.
    ns = _ap.Namespace(corpus=[args.corpus] if args.corpus else args.sources, tokenizer=target.path,
                       patterns=args.patterns, held_out_fraction=args.held_out_fraction, vocab_size=None)
    _, corpus_dir = prepare_data(ns, work)
    return target, out, work, corpus_dir


def _add_optimizer_options(p, *, steps: int, batch: int, batch_help: str, lr: float, weight_decay: float) -> None:
    """The optimizer options of a drafter command (train KIND, train accept-head)."""
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps to train to")
    p.add_argument("--batch-size", type=int, default=batch, help=batch_help)
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=50, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=weight_decay, help="AdamW weight decay")
    p.add_argument("--seed", type=int, default=0, help="initialisation, data and batch-order seed")


def _add_eval_group(p, prompts_help: str):
    """The held-out evaluation group of a drafter command; returned for the options only one kind has."""
    e = p.add_argument_group("held-out evaluation")
    e.add_argument("--eval-every", type=int, default=200, help="evaluate every N steps (0: at the end)")
    e.add_argument("--eval-prompts", type=int, default=16, help=prompts_help)
    return e


def _add_mesh_and_checkpoints(p) -> None:
    p.add_argument("--data-parallel", type=int, default=None, help="devices on the data axis (default: all)")
    p.add_argument("--fsdp", action="store_true", help="shard params and optimizer state over data")
    p.add_argument("--checkpoint-every", type=int, default=200, help="checkpoint every N steps (0: at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="checkpoints kept (the newest)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_drafter_parser(sub, command: str) -> argparse.ArgumentParser:
    """`train KIND` for a drafter trained on text (the trained kinds, and the on-policy draft LM)."""
    is_lm = command == "draft-lm"
    what = ("a small draft LM on the target's own continuations (on-policy), exported as an HF "
            "directory for --drafter draft_lm --draft DIR" if is_lm else
            f"a {command} drafter on a frozen target, exported for --drafter {command.replace('-', '_')} "
            f"--drafter-dir DIR")
    about = (f"The target stays frozen. Every --eval-every steps the held-out loss and the drafter's "
             f"acceptance (tau and the rate by tree depth, from real greedy speculative runs on held-out "
             f"prompts) go to WORKDIR/{'run/' if is_lm else ''}metrics.jsonl and the plot "
             f"WORKDIR/training.png (when matplotlib is installed). Rerunning the same command resumes "
             f"from the last checkpoint; self-distillation data is generated once and cached in "
             f"WORKDIR/data.")
    p = sub.add_parser(command, help=f"train {what.split(',')[0]}", formatter_class=_DefaultsFormatter,
                       description=f"Train {what}. {about}")
    _add_target_and_sources(p, workdir="checkpoints, logs, data")
    p.add_argument("--data", choices=("corpus", "self", "mix"), default="self" if is_lm else "corpus",
                   help="training text: corpus windows, the target's own continuations of corpus prompts "
                        "(self-distillation), or half of each")
    _add_optimizer_options(p, steps=2000 if is_lm else 1000, batch=8 if is_lm else 16,
                           batch_help="sequences per step", lr=3e-3 if is_lm else 1e-3,
                           weight_decay=0.1 if is_lm else 0.0)
    p.add_argument("--seq-len", type=int, default=96,
                   help="tokens per training sequence (self data: --prompt-len + the continuation)")
    g = p.add_argument_group("self-distillation data (--data self|mix)")
    g.add_argument("--prompts", type=int, default=1024, help="corpus prompts the target continues")
    g.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    g.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled continuations")
    g.add_argument("--greedy-fraction", type=float, default=0.5, help="continuations decoded greedily")
    g.add_argument("--gen-batch-size", type=int, default=32, help="rows per batched decode call")
    e = _add_eval_group(p, "held-out prompts decoded speculatively")
    e.add_argument("--eval-new-tokens", type=int, default=64, help="tokens decoded per held-out prompt")
    e.add_argument("--tree", default=None, help="tree of the held-out runs (default: the kind's own)")
    if is_lm:
        p.add_argument("--size", default="draft", choices=("tiny", "draft", "small"),
                       help="draft model size (draft: the shipped draft's recipe, ~2.4 M)")
        p.add_argument("--logit-distill", action="store_true",
                       help="add the KL to the target's logits (DistillLoss) to the loss")
        p.add_argument("--distill-temperature", type=float, default=1.0, help="KL temperature")
        p.add_argument("--distill-alpha", type=float, default=1.0, help="weight of the KL term (rest: CE)")
    else:
        p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                       help="a field of the kind's config (e.g. num_heads=4), value as JSON; repeatable")
        p.add_argument("--draft", default=None, help="draft model directory, for kinds that draft with one")
        p.add_argument("--export-dtype", default=None, choices=("float32", "bfloat16"),
                       help="store the exported weights in this dtype (loading casts them to the target's "
                            "compute dtype); default: as trained (float32)")
    _add_mesh_and_checkpoints(p)
    return p


def add_accept_head_parser(sub) -> argparse.ArgumentParser:
    """`train accept-head`: it learns from labels of verification runs, not from text, so it has no
    --data, --seq-len or --tree, and options of its own for the label runs."""
    what = "an accept-head drafter on a frozen target, exported for --drafter accept_head --drafter-dir DIR"
    about = ("The target stays frozen. The inner drafter (--draft DIR, or --set inner=KIND) drafts chains "
             "of --set draft_len=K on --prompts training windows, one label run per --temperatures entry; "
             "the target's verdicts label each position. Every --eval-every steps the BCE on label runs "
             "over --eval-prompts held-out windows goes to WORKDIR/metrics.jsonl; the export records the "
             "held-out BCE and calibration (ECE) and the threshold h its training runs price best "
             "(--draft-cost, --node-cost). Rerunning the same command resumes from the last checkpoint.")
    # No abbreviations: --data would be read as --data-parallel, --temperature as --temperatures.
    p = sub.add_parser("accept-head", help=f"train {what.split(',')[0]}", formatter_class=_DefaultsFormatter,
                       description=f"Train {what}. {about}", allow_abbrev=False)
    _add_target_and_sources(p, workdir="checkpoints, logs, data")
    p.add_argument("--data", type=_no_head_data, help=argparse.SUPPRESS)
    _add_optimizer_options(p, steps=1000, batch=256, batch_help="labelled row-steps per optimizer step", lr=1e-3,
                           weight_decay=0.0)
    g = p.add_argument_group("label runs (the inner drafter's chains, verified by the target)")
    g.add_argument("--prompts", type=int, default=256,
                   help="training windows labelled (on the embedded target the held-out BCE stops improving "
                        "past ~200: BENCHMARKS.md)")
    g.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt window")
    g.add_argument("--new-tokens", "--eval-new-tokens", dest="eval_new_tokens", type=int, default=64, metavar="N",
                   help="tokens decoded per window, training and held-out")
    g.add_argument("--temperatures", type=_label_temperatures, default="0,0.7",
                   help="comma-separated; one label run each: greedy verification at 0, the chain "
                        "verifier on sampled chains above")
    g.add_argument("--label-batch-size", type=int, default=8, help="rows per batched label-run decode call")
    c = p.add_argument_group("the saved threshold h (the best of training.accept_head.speed_estimate)")
    c.add_argument("--draft-cost", type=_unit_cost, default=None,
                   help="one draft level's cost in target steps (default 0.2; 0 over retrieval). On the 2-core "
                        "CPU of BENCHMARKS.md an EAGLE-3 level of the embedded target costs ~0.45")
    c.add_argument("--node-cost", type=_unit_cost, default=None,
                   help="one verified node's cost in target steps (default 0.05)")
    _add_eval_group(p, "held-out windows labelled (BCE, ECE)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a field of AcceptHeadConfig (inner: the drafter the head cuts, e.g. '\"eagle3\"'; "
                        "draft_len: its chain's K; hidden; target_proj; drafter_proj: read the inner "
                        "drafter's own states, eagle3), value as JSON; repeatable")
    p.add_argument("--draft", default=None, help="the draft LM whose chains the head cuts (the default inner drafter)")
    # The head is small (at most some 10^5 weights): it is exported as trained, float32 (no --export-dtype).
    p.add_argument("--inner-dir", default=None,
                   help="with --set inner=KIND (a trained drafter, e.g. eagle3 or retrieval): its "
                        "directory (default: the one shipped with the target)")
    _add_mesh_and_checkpoints(p)
    return p


def add_retrieval_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "retrieval", help="build a datastore of the target's own continuations (the retrieval drafter)",
        formatter_class=_DefaultsFormatter,
        description="Build the retrieval drafter's datastore: the target continues corpus prompts (cached "
                    "in WORKDIR/data, resumable), the continuations are kept as token rows, and the "
                    "drafter's n-gram table is built from them when it is loaded. Nothing is optimised. "
                    "The held-out acceptance of a real greedy speculative run is printed and stored "
                    "with the export (the adaptive policy starts from it).")
    _add_target_and_sources(p, workdir="generated data")
    p.add_argument("--prompts", type=int, default=4096, help="corpus prompts the target continues (rows)")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    p.add_argument("--seq-len", type=int, default=128, help="prompt + continuation tokens per row")
    p.add_argument("--greedy-fraction", type=float, default=1.0, help="continuations decoded greedily")
    p.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled continuations")
    p.add_argument("--gen-batch-size", type=int, default=32, help="rows per batched decode call")
    p.add_argument("--seed", type=int, default=0, help="prompt-choice and sampling seed")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a field of RetrievalConfig (max_order, history_ngram, num_nodes, ways, load, min_reach, "
                        "by_source: rates by match source and length), value as JSON; repeatable. A build "
                        "stores by_source=true, num_nodes=16, min_reach=0.15 unless set")
    e = p.add_argument_group("held-out evaluation")
    e.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts decoded speculatively")
    e.add_argument("--eval-new-tokens", type=int, default=64, help="tokens decoded per held-out prompt")
    e.add_argument("--tree", default=None, help="chain of the held-out runs (default: chain:num_nodes)")
    e.add_argument("--confidence-temperatures", default="0.7,1.0", type=_temperatures,
                   help="comma-separated sampling temperatures at which the acceptance by match length is "
                        "also measured (the adaptive policy's start when sampling there); '' for none")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _temperatures(text: str, greedy: bool = False) -> tuple:
    """'0.7,1.0' -> (0.7, 1.0); '' -> (); each finite and > 0 (>= 0 with greedy: 0 is a greedy run)."""
    try:
        temps = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of temperatures "
                                         f"(e.g. 0.7 or 0.7,1.0)") from None
    bad = [t for t in temps if not ((t >= 0 if greedy else t > 0) and math.isfinite(t))]
    if bad or len(set(temps)) != len(temps):
        raise argparse.ArgumentTypeError(
            f"temperatures must be finite, {'>= 0 (0: greedy)' if greedy else '> 0'} and given once each"
            f"{'' if greedy else ' (greedy is always measured)'}, got {text!r}")
    return temps


def _unit_cost(text: str) -> float:
    """--draft-cost / --node-cost: a finite cost >= 0 in target steps."""
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not (math.isfinite(x) and x >= 0):
        raise argparse.ArgumentTypeError(f"a cost in target steps is a finite number >= 0 (e.g. 0.2), "
                                         f"got {text!r}")
    return x


def _no_head_data(text: str):
    raise argparse.ArgumentTypeError(f"train accept-head learns from labels of verification runs on corpus "
                                     f"windows, not from training text: --data {text} does not apply, drop it")


def _label_temperatures(text: str) -> tuple:
    """--temperatures of train accept-head: one label run each, 0 greedy; at least one."""
    temps = _temperatures(text, greedy=True)
    if not temps:
        raise argparse.ArgumentTypeError("give at least one temperature, e.g. 0 or 0,0.7")
    return temps


def run_train_retrieval(args) -> int:
    """Run `jaxdecode train retrieval`."""
    from .distill_data import DistillOptions
    from .drafters import EvalOptions
    from .retrieval import build_retrieval

    if args.seq_len <= args.prompt_len:
        raise ValueError(f"--seq-len ({args.seq_len}) must exceed --prompt-len ({args.prompt_len}): the "
                         f"difference is the continuation the datastore keeps")
    _check_drafter_args(args, "retrieval")
    target, out, work, corpus_dir = _target_and_corpus(args, "prompts are tokenized")
    distill = DistillOptions(num_prompts=args.prompts, prompt_len=args.prompt_len,
                             new_tokens=args.seq_len - args.prompt_len, temperature=args.temperature,
                             greedy_fraction=args.greedy_fraction, batch_size=args.gen_batch_size, seed=args.seed)
    evals = EvalOptions(prompts=args.eval_prompts, prompt_len=args.prompt_len, new_tokens=args.eval_new_tokens,
                        tree=args.tree, seed=args.seed)
    res = build_retrieval(target, corpus_dir, out, distill=distill, workdir=work,
                          config_overrides=_parse_sets(args.set), eval_options=evals,
                          confidence_temperatures=args.confidence_temperatures, progress=not args.no_progress)
    s, h = res.stats, res.heldout
    print(f"built a retrieval datastore of {s['rows']} rows ({s['predicted_positions']} predicted tokens, "
          f"{s['entries']} table entries, {s['build_seconds']} s to build); held-out tau {h['tau']:.3f}, "
          f"acceptance by depth {', '.join(f'{a:.2f}' for a in h['accept_by_depth'])}; drafter -> {out} "
          f"(jaxdecode generate ... --drafter retrieval --drafter-dir {out})")
    return 0


# `jaxdecode train dllm | filter`: diffusion LMs (training.dllm) and their Learn2PD filter (training.filter).
DLLM_COMMANDS = ("dllm", "filter")
DLLM_FLAG_OF_KEY = {"run.dllm.attention": "--attention", "run.dllm.block_size": "--block-size",
                    "run.dllm.logits_shift": "--logits-shift", "run.dllm.eps": "--eps",
                    "run.dllm.batch_size": "--batch-size", "run.dllm.compute_dtype": "--bf16",
                    "run.seq_len": "--seq-len", "run.init": "--init-from", "run.tasks": "--task/--task-length",
                    "run.hidden": "--hidden", "run.pos_weight": "--pos-weight", "run.prompts": "--prompts",
                    "run.model": "--model"}


def _add_common(p, steps: int, batch: int, lr: float, warmup: int):
    p.add_argument("--workdir", default=None, help="checkpoints, metrics.jsonl, data (default: OUTPUT.train)")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps to train to")
    p.add_argument("--batch-size", type=int, default=batch, help="rows per step")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=warmup, help="linear warmup steps")
    p.add_argument("--seed", type=int, default=0, help="initialisation, data and batch-order seed")
    p.add_argument("--checkpoint-every", type=int, default=200, help="checkpoint every N steps (0: at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="checkpoints kept (the newest)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_task_args(p, group=None, required: bool = False):
    from jaxdecode.dllm_tasks import TASK_NAMES
    (group or p).add_argument("--task", choices=TASK_NAMES, required=required, default=None,
                              help="a synthetic task (jaxdecode.dllm_tasks), generated in code")
    p.add_argument("--task-length", type=int, default=6, help="task items (latin_square: the order k)")
    p.add_argument("--num-values", type=int, default=6, help="value tokens of the task vocabulary")


def add_dllm_parsers(sub) -> None:
    d = sub.add_parser(
        "dllm", formatter_class=_DefaultsFormatter,
        help="train a masked-diffusion LM (LLaDA objective) on a task or a corpus; export HF format",
        description="Train a masked-diffusion LM with the LLaDA objective (t ~ U(eps, 1), each maskable "
                    "token masked with probability t, CE on masked tokens / t): on a synthetic --task "
                    "(SFT: the prompt is never masked) or on a --corpus (every token maskable), from "
                    "scratch or continued from a causal LM (--init-from; Dream style: --attention "
                    "bidirectional --logits-shift 1; Fast-dLLM v2 style: --attention block --block-size N). "
                    "A tokenizer without a MASK token gets <|mask|> (one new embedding row). The export's "
                    "config.json carries mask_token_id, attention, block_size and logits_shift. Rerunning "
                    "the same command resumes.")
    src = d.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", nargs="+", help="source files/directories, or a corpus directory (manifest.json)")
    _add_task_args(d, group=src)
    d.add_argument("--output", required=True, help="directory for the exported HF model (written whole)")
    d.add_argument("--tokenizer", default=None, help="--corpus: tokenizer directory (default: --init-from's, "
                                                     "else a new BPE trained on the corpus)")
    d.add_argument("--vocab-size", type=int, default=4096, help="size of a newly trained tokenizer")
    d.add_argument("--patterns", default=DEFAULT_PATTERNS, help="file globs taken from corpus directories")
    d.add_argument("--held-out-fraction", type=float, default=0.05, help="files held out (by path hash)")
    d.add_argument("--init-from", default=None,
                   help="a causal LM to adapt: its HF directory or an embedded model's name (target) "
                        "(default: random init)")
    d.add_argument("--size", default="small", choices=("tiny", "draft", "small", "base"),
                   help="model size without --init-from (--task: the task model's own small shape)")
    d.add_argument("--max-positions", type=int, default=512, help="max_position_embeddings of a new model")
    d.add_argument("--attention", default="bidirectional", choices=("bidirectional", "block"),
                   help="bidirectional (LLaDA, Dream) or block (block diffusion: causal across blocks)")
    d.add_argument("--block-size", type=int, default=0, help="tokens per block (--attention block)")
    d.add_argument("--logits-shift", type=int, default=None, choices=(0, 1),
                   help="1: the logit at i predicts token i+1 (default: 1 with --init-from, else 0)")
    d.add_argument("--eps", type=float, default=1e-3, help="smallest masking rate t")
    d.add_argument("--seq-len", type=int, default=256, help="--corpus: tokens per training window")
    d.add_argument("--bf16", action="store_true", help="bfloat16 compute (float32 master weights)")
    d.add_argument("--export-dtype", default="float32", choices=("float32", "bfloat16"), help="exported weights")
    d.add_argument("--eval-every", type=int, default=200, help="--corpus: held-out loss every N steps (0: at the end)")
    d.add_argument("--data-parallel", type=int, default=None, help="devices on the data axis (default: all)")
    d.add_argument("--fsdp", action="store_true", help="shard params and optimizer state over data")
    _add_common(d, steps=2000, batch=32, lr=1e-3, warmup=100)

    f = sub.add_parser(
        "filter", formatter_class=_DefaultsFormatter,
        help="train a Learn2PD unmasking filter for a diffusion LM (rule learn2pd, option filter=DIR)",
        description="Decode task prompts with the dLLM one token per step (greedy1), label every masked "
                    "slot at every step final (its argmax already equals greedy1's final token) or not, "
                    "and train the small filter MLP the learn2pd rule runs on those labels. Reports "
                    "forwards and validity of greedy1 vs learn2pd on held-out prompts.")
    f.add_argument("--model", required=True, help="the dLLM's HF directory")
    f.add_argument("--out", required=True, help="filter directory (config.json + model.safetensors)")
    _add_task_args(f, required=True)
    f.add_argument("--prompts", type=int, default=256, help="prompts whose greedy1 trajectories label the data")
    f.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts of the final report")
    f.add_argument("--hidden", type=int, default=32, help="hidden units of the filter MLP")
    f.add_argument("--pos-weight", type=float, default=1.0, help="loss weight of the 'final' label")
    f.add_argument("--threshold", type=float, default=0.9, help="learn2pd threshold of the final report")
    _add_common(f, steps=300, batch=256, lr=3e-3, warmup=10)


def _dllm_train_config(args, eval_every: int = 0):
    from .trainer import TrainConfig
    return TrainConfig(steps=args.steps, learning_rate=args.lr, warmup_steps=args.warmup, weight_decay=0.0
                       if getattr(args, "task", None) or args.train_command == "filter" else 0.1, seed=args.seed,
                       eval_every=eval_every, checkpoint_every=args.checkpoint_every,
                       keep_checkpoints=args.keep_checkpoints, data_parallel=getattr(args, "data_parallel", None),
                       fsdp=getattr(args, "fsdp", False), progress=not args.no_progress)


def run_train_dllm(args) -> int:
    """Run `jaxdecode train dllm` / `jaxdecode train filter`."""
    from jaxdecode.dllm_tasks import make_task

    from .trainer import ResumeMismatchError
    out = Path(args.output if args.train_command == "dllm" else args.out)
    work = Path(args.workdir) if args.workdir else out.with_name(out.name + ".train")
    _dllm_train_config(args)  # bad options fail now, before a model loads or a corpus is tokenized
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.train_command == "filter":
            return _run_filter(args, make_task(args.task, args.task_length, args.num_values), out, work)
        from .dllm import DLLMSpec, train_corpus_dllm, train_task_dllm
        shift = args.logits_shift if args.logits_shift is not None else int(args.init_from is not None)
        spec = DLLMSpec(attention=args.attention, block_size=args.block_size, logits_shift=shift, eps=args.eps,
                        batch_size=args.batch_size, compute_dtype="bfloat16" if args.bf16 else "float32")
        if args.task:
            if args.init_from:
                raise ValueError("--init-from adapts a causal LM on a --corpus; a --task model trains from scratch "
                                 "on the task vocabulary: drop --init-from")
            task = make_task(args.task, args.task_length, args.num_values)
            tcfg = _dllm_train_config(args)
            train_task_dllm(task, work / "run", spec=spec, export_dir=out, train_config=tcfg)
            plot = _plot_dllm(work, f"{args.task} dLLM")
            print(f"trained a {args.task} dLLM for {args.steps} steps; model -> {out} (jaxdecode generate --model "
                  f"{out} --method diffusion ...); logs -> {work / 'run' / 'metrics.jsonl'}{_plot_note(plot)}")
            return 0
        import argparse as _ap
        init_from = _model_dir(args.init_from, "--init-from") if args.init_from is not None else None
        ns = _ap.Namespace(corpus=args.corpus, tokenizer=args.tokenizer or init_from, patterns=args.patterns,
                           held_out_fraction=args.held_out_fraction, vocab_size=args.vocab_size)
        tok_dir, corpus_dir = prepare_data(ns, work)
        result, config = train_corpus_dllm(corpus_dir, tok_dir, _dllm_train_config(args, args.eval_every),
                                           work / "run", spec=spec, seq_len=args.seq_len, size=args.size,
                                           max_positions=args.max_positions, init_from=init_from,
                                           export_dir=out, export_dtype=args.export_dtype)
    except ResumeMismatchError as e:
        raise e.renamed({**FLAG_OF_KEY, **DLLM_FLAG_OF_KEY}) from None
    loss = f"{result.eval_loss:.4f}" if result.eval_loss is not None else "n/a"
    plot = _plot_dllm(work, f"{config.attention} dLLM")
    print(f"trained a {config.attention} dLLM ({config.num_parameters() / 1e6:.2f} M params, MASK id "
          f"{config.mask_token_id}) for {result.step} steps; held-out masked-diffusion loss {loss}; model -> {out}; "
          f"logs -> {work / 'run' / 'metrics.jsonl'}{_plot_note(plot)}")
    return 0


def _model_dir(spec: str, flag: str) -> Path:
    """The HF directory a model flag names: an embedded model's name (as `jaxdecode.load` takes it:
    target, draft, dllm; a local directory of that name wins) or a directory, which must exist."""
    from jaxdecode.model import EMBEDDED_NAMES, embedded_model_path, model_path
    try:
        path = Path(model_path(spec))  # load's own rule for names
    except FileNotFoundError as e:
        raise ValueError(f"{flag} {spec}: {e}") from None
    if not path.is_dir():
        hint = (f" (the embedded {path.name} model: {flag} {path.name})"
                if path.name in EMBEDDED_NAMES and embedded_model_path(path.name) is not None else "")
        what = "is not a directory" if path.exists() else "does not exist"
        raise ValueError(f"{flag} {spec}: the directory {what}; pass a model's HF directory or an embedded "
                         f"model's name ({', '.join(EMBEDDED_NAMES)}){hint}")
    return path


def _plot_note(plot: Path | None) -> str:
    """", plot -> PATH" for a plot that was written; nothing when none was (no matplotlib: it said so)."""
    return f", plot -> {plot}" if plot is not None else ""


def _plot_dllm(work: Path, title: str) -> Path | None:
    from .dllm import plot_dllm_training
    from .drafters import read_metrics_file
    return plot_dllm_training(read_metrics_file(work / "run" / "metrics.jsonl"), work / "training.png", title)


def _run_filter(args, task, out: Path, work: Path) -> int:
    import numpy as np

    import jaxdecode

    from .filter import compare_nfe, export_filter, filter_data, train_filter
    model = jaxdecode.load(args.model, dtype="float32")
    if not getattr(model.config, "is_diffusion", False):
        raise ValueError(f"{args.model} is a causal LM; train filter needs a diffusion LM (jaxdecode train dllm)")
    if model.config.vocab_size < task.vocab.size:
        raise ValueError(f"{args.model} has {model.config.vocab_size} tokens, the {task.name} task needs "
                         f"{task.vocab.size}: train the model on that task (jaxdecode train dllm --task ...)")
    rng = np.random.default_rng(args.seed)
    prompts, _ = task.sample(rng, args.prompts + args.eval_prompts)
    lens = np.full(len(prompts), prompts.shape[1], np.int32)
    n = args.prompts
    data = filter_data(model.config, model.params, prompts[:n], lens[:n], answer_length=task.answer_length)
    res = train_filter(data, _dllm_train_config(args), work / "run", hidden=args.hidden, batch_size=args.batch_size,
                       pos_weight=args.pos_weight, run_info={"model": str(Path(model.path).resolve()),
                                                             "task": [task.name, task.length, task.num_values],
                                                             "prompts": n})
    report = compare_nfe(model.config, model.params, res.params, prompts[n:], lens[n:],
                         answer_length=task.answer_length, threshold=args.threshold, validate=task.validate)
    export_filter(out, res, {"model": str(Path(model.path).resolve()), "task": task.name,
                             "threshold": args.threshold, "heldout": report})
    print(f"trained a Learn2PD filter on {len(data)} labelled steps ({data.positive_fraction:.0%} final); held-out "
          f"{task.name}: forwards {report['nfe_greedy1']:.2f} (greedy1) -> {report['nfe_learn2pd']:.2f} (learn2pd, "
          f"threshold {args.threshold}), validity {report['valid_greedy1']:.3f} -> {report['valid_learn2pd']:.3f}; "
          f"filter -> {out} (e.g. jaxdecode generate --model {args.model} --method diffusion --option rule=learn2pd "
          f"--option filter={out} --max-new-tokens {task.answer_length} --prompt-ids "
          f"{','.join(str(int(t)) for t in prompts[n])}: a held-out {task.name} prompt)")
    return 0


def _run_accept_head(args, target, corpus_dir, out: Path, work: Path, tcfg) -> int:
    """`jaxdecode train accept-head`: label runs of the inner drafter's chains on the target (the --draft
    LM, or a trained kind: --set inner=eagle3 [--inner-dir DIR]), then the head
    (training.accept_head.train_accept_head). --set draft_len=K: the chain length."""
    import jaxdecode

    from .accept_head import train_accept_head
    sets = _parse_sets(args.set)
    inner = sets.pop("inner", "draft_lm")
    k = sets.pop("draft_len", 8)
    if inner == "draft_lm" and args.draft is None:
        raise ValueError("train accept-head learns when the target accepts a drafter's tokens: pass the draft "
                         "model with --draft DIR, or name a trained drafter with --set inner=eagle3 (hydra, "
                         "medusa, retrieval, ...)")
    if inner != "draft_lm" and args.draft is not None:
        raise ValueError(f"--set inner={inner} drafts without a draft LM: drop --draft")
    if inner == "draft_lm" and args.inner_dir is not None:
        raise ValueError("--inner-dir is the directory of a trained inner drafter (--set inner=KIND); a draft LM "
                         "is given with --draft DIR")
    draft = jaxdecode.load(args.draft, dtype="float32") if args.draft else None
    run = train_accept_head(target, draft, corpus_dir, out, k=int(k), temperatures=args.temperatures,
                            train_config=tcfg, prompts=args.prompts, heldout=args.eval_prompts,
                            prompt_len=args.prompt_len, new_tokens=args.eval_new_tokens, workdir=work,
                            batch_size=args.batch_size, batch_rows=args.label_batch_size,
                            config_overrides=sets, seed=args.seed, inner=inner, inner_dir=args.inner_dir,
                            draft_cost=args.draft_cost, node_cost=args.node_cost)
    report = "; ".join(f"{t}: ECE {r['ece']:.3f}, BCE {r['bce']:.3f}" for t, r in run.report.items()
                       if isinstance(r, dict) and "ece" in r)
    using = f"--draft {args.draft}" if draft is not None else f"(over {inner})"
    print(f"trained accept-head; held-out {report}; drafter -> {out} (jaxdecode generate ... --drafter "
          f"accept_head --drafter-dir {out} {using}); logs -> {work / 'metrics.jsonl'}")
    return 0


def _check_drafter_args(args, kind: str) -> None:
    """--out, --set and --draft checked before the target loads and anything trains."""
    from jaxdecode.drafters.trained import check_out_dir, get_kind

    from .drafters import check_config_overrides
    check_out_dir(args.out)
    check_config_overrides(kind, _parse_sets(args.set), "--set")
    if getattr(args, "draft", None) and not get_kind(kind).takes_draft_model:
        raise ValueError(f"--draft: the {kind} drafter drafts without a draft model: drop --draft")


def _drafter_flag(key: str) -> str:
    """The flag behind a drafter run's identity key (for ResumeMismatchError)."""
    if key in FLAG_OF_KEY:
        return FLAG_OF_KEY[key]
    table = [("run.cfg.", "--set"), ("run.self.options.num_prompts", "--prompts"),
             ("run.self.options.prompt_len", "--prompt-len"), ("run.self.options.temperature", "--temperature"),
             ("run.self.options.greedy_fraction", "--greedy-fraction"),
             ("run.self.options.batch_size", "--gen-batch-size"), ("run.self.options", "--seq-len"),
             ("run.self.corpus", "--corpus/--sources"), ("run.self.target", "--target"),
             ("run.self", "--data"), ("run.data", "--data"), ("run.batch_size", "--batch-size"),
             ("run.seq_len", "--seq-len"), ("run.target", "--target"), ("run.kind", "the kind")]
    return next((flag for prefix, flag in table if key.startswith(prefix)), key)


def _parse_sets(items) -> dict:
    import json
    out = {}
    for item in items:
        field, eq, value = item.partition("=")
        if not eq or not field:
            raise ValueError(f"--set takes FIELD=VALUE (e.g. num_heads=4), got {item!r}")
        try:
            out[field] = json.loads(value)
        except json.JSONDecodeError:
            out[field] = value  # a bare string
    return out


def run_train_drafter(args) -> int:
    """Run `jaxdecode train KIND` (a trained-drafter kind or draft-lm)."""
    import jaxdecode

    from .distill_data import DistillOptions
    from .drafters import EvalOptions, get_train_kind, train_draft_lm, train_drafter
    from .trainer import ResumeMismatchError, TrainConfig

    command = args.train_command
    kind = None if command == "draft-lm" else get_train_kind(command.replace("-", "_"))  # clear error first
    # The options are checked before the target loads and the corpus is tokenized (minutes on a big corpus).
    tcfg = TrainConfig(steps=args.steps, learning_rate=args.lr, warmup_steps=args.warmup,
                       weight_decay=args.weight_decay, seed=args.seed, eval_every=args.eval_every,
                       checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints,
                       data_parallel=args.data_parallel, fsdp=args.fsdp, progress=not args.no_progress)
    if kind is not None:
        _check_drafter_args(args, kind.name)
    if kind is not None and kind.name == "accept_head":  # trains on labels of verification runs, not on text
        target, out, work, corpus_dir = _target_and_corpus(args, "label-run prompts are tokenized")
        try:
            return _run_accept_head(args, target, corpus_dir, out, work, tcfg)
        except ResumeMismatchError as e:
            raise e.renamed({k: _drafter_flag(k) for k, _, _ in e.changes}) from None
    if args.data != "corpus" and args.seq_len <= args.prompt_len:
        raise ValueError(f"--data {args.data}: --seq-len ({args.seq_len}) must exceed --prompt-len "
                         f"({args.prompt_len}): the difference is the continuation the target writes")
    target, out, work, corpus_dir = _target_and_corpus(args, "training data is tokenized")
    distill = DistillOptions(num_prompts=args.prompts, prompt_len=args.prompt_len,
                             new_tokens=max(args.seq_len - args.prompt_len, 1), temperature=args.temperature,
                             greedy_fraction=args.greedy_fraction, batch_size=args.gen_batch_size, seed=args.seed)
    evals = EvalOptions(prompts=args.eval_prompts, prompt_len=args.prompt_len, new_tokens=args.eval_new_tokens,
                        tree=args.tree, seed=args.seed)
    try:
        if kind is None:
            res = train_draft_lm(target, corpus_dir, out, train_config=tcfg, data=args.data, size=args.size,
                                 batch_size=args.batch_size, seq_len=args.seq_len, workdir=work,
                                 distill=distill, logit_distill=args.logit_distill,
                                 distill_temperature=args.distill_temperature,
                                 distill_alpha=args.distill_alpha, eval_options=evals)
            logs = work / "run" / "metrics.jsonl"
        else:
            opts = {"draft_model": jaxdecode.load(args.draft, dtype="float32")} if args.draft else None
            res = train_drafter(kind.name, target, corpus_dir, out, train_config=tcfg, data=args.data,
                                batch_size=args.batch_size, seq_len=args.seq_len, workdir=work,
                                config_overrides=_parse_sets(args.set), distill=distill, eval_options=evals,
                                drafter_options=opts, export_dtype=args.export_dtype)
            logs = work / "metrics.jsonl"
    except ResumeMismatchError as e:
        raise e.renamed({k: _drafter_flag(k) for k, _, _ in e.changes}) from None
    last = res.heldout[-1] if res.heldout else {}
    held = (f"held-out tau {last['tau']:.3f}, acceptance by depth "
            f"{', '.join(f'{a:.2f}' for a in last['accept_by_depth'])}; " if last else "")
    use = (f"--drafter draft_lm --draft {out}" if kind is None else
           f"--drafter {kind.name} --drafter-dir {out}")
    print(f"trained {command} for {res.train.step} steps on {args.data} data; {held}drafter -> {out} "
          f"(jaxdecode generate ... {use}); logs -> {logs}{_plot_note(res.plot)}")
    return 0


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

    command = getattr(args, "train_command", "lm")
    if command in DRAFTER_COMMANDS:
        return run_train_drafter(args)
    if command == "retrieval":
        return run_train_retrieval(args)
    if command in DLLM_COMMANDS:
        return run_train_dllm(args)
    if command != "lm":
        raise SystemExit(f"unknown train command {command!r}")
    output = Path(args.output)
    work = Path(args.workdir) if args.workdir else output.with_name(output.name + ".train")
    tcfg = TrainConfig(steps=args.steps, learning_rate=args.lr, warmup_steps=args.warmup,
                       weight_decay=args.weight_decay, seed=args.seed, eval_every=args.eval_every,
                       checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints,
                       data_parallel=args.data_parallel, fsdp=args.fsdp, progress=not args.no_progress)
    work.mkdir(parents=True, exist_ok=True)
    tok_dir, corpus_dir = prepare_data(args, work)  # after the options' check: a tokenizer trains here
    tok = load_tokenizer_dir(tok_dir)
    config = model_config(args.size, len(tok), args.max_positions, eos_id(tok))
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
