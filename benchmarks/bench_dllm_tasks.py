"""Diffusion decoders on the synthetic tasks (ParallelBench-style): per task and rule, the forwards
per answer (NFE), tokens per forward, validity, exact match against one token per forward (greedy1)
and wall time, with task dLLMs trained here (cached in --workdir) and a Learn2PD filter per task.

    python benchmarks/bench_dllm_tasks.py                                    # small: answers of 6 tokens
    python benchmarks/bench_dllm_tasks.py --task-length 16 --num-values 8 --steps 1500   # 16-token answers
    python benchmarks/bench_dllm_tasks.py ... --check      # did each model learn? greedy1 + threshold only

Prints one JSON line per (task, rule). Times exclude compilation.

Training recipe (RECIPES; each task model is a 2-layer, width-128 dLLM): copy, sort and reverse learn
with the defaults. Addition trains on operands of mixed sizes (--addition-operands; the held-out
prompts are always full-size): with full-size operands only, each sum digit is (a + b + carry) mod
base, independent of either operand digit alone, so nothing pulls attention onto the two digits of
the same significance and the model stays at chance. At 16 digits over 8 values (2000 steps) the
mixed-size model learned most significant digit first (the default; loss 1.45 until ~700 steps, then
0.003) and least significant first (--addition-order lsd: sooner, but loss 0.02 at 2000 steps).
Permutation needs the lower learning rate and larger batch (at 3e-3 / 32 it plateaus above the data's
entropy and greedy1 writes duplicates).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from jaxdecode import diffusion as D
from jaxdecode.dllm_tasks import evaluate_decoder, make_task

RULES = ("greedy1", "llada:2", "llada:4", "threshold", "factor", "credit", "localleap", "freedave", "eb", "learn2pd")
CHECK_RULES = ("greedy1", "threshold")
# Per-task training options beyond the defaults (learning rate 3e-3, batch 32); a workdir tag names them.
DEFAULT_RECIPE = {"learning_rate": 3e-3, "batch_size": 32}
RECIPES = {"addition": {"learning_rate": 1e-3, "batch_size": 64},
           "permutation": {"learning_rate": 1e-3, "batch_size": 64}}


def _rule(spec: str, threshold: float, filter_params):
    name, _, n = spec.partition(":")
    if name == "llada":
        return D.LLaDA(tokens_per_step=int(n or 2))
    if name == "learn2pd":
        return D.Learn2PD(params=filter_params, threshold=threshold)
    if name == "threshold":
        return D.Threshold(threshold=threshold)
    return D.make_rule(name)


def _steps_for(text: str) -> dict:
    """'addition=3000,permutation=2000' -> {'addition': 3000, 'permutation': 2000}."""
    out = {}
    for item in filter(None, text.split(",")):
        name, eq, n = item.partition("=")
        if not eq or not n.isdigit():
            raise SystemExit(f"--steps-for takes task=steps pairs separated by commas, got {item!r}")
        out[name] = int(n)
    return out


def task_setup(name: str, args) -> tuple:
    """(training task, held-out task, recipe, steps, workdir tag) of one task under the options."""
    length = {"latin_square": min(args.many_length, 3), "permutation": args.many_length}.get(name, args.task_length)
    values = (args.many_values or args.num_values) if name in ("permutation", "latin_square") else args.num_values
    options = {"digit_order": args.addition_order} if name == "addition" else {}
    held_out = make_task(name, length, values, **options)
    train_options = {**options, "operand_sizes": args.addition_operands} if name == "addition" else options
    task = make_task(name, length, values, **train_options)
    recipe = {**DEFAULT_RECIPE, **RECIPES.get(name, {})}
    steps = _steps_for(args.steps_for).get(name, args.steps)
    tag = f"{name}-{length}-{values}-{steps}"
    if recipe != DEFAULT_RECIPE:  # the default recipe keeps the tags of earlier runs (their models are reused)
        tag += f"-lr{recipe['learning_rate']:g}-bs{recipe['batch_size']}"
    tag += "".join(f"-{v}" for v in task.options.values())
    return task, held_out, recipe, steps, tag


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="copy,sort,reverse,addition,permutation,latin_square")
    ap.add_argument("--task-length", type=int, default=6, help="items of the deterministic tasks")
    ap.add_argument("--many-length", type=int, default=6,
                    help="items of permutation (<= --num-values); latin_square's order is min(3, this)")
    ap.add_argument("--num-values", type=int, default=6)
    ap.add_argument("--many-values", type=int, default=0, help="values of the many-answer tasks (0: --num-values)")
    ap.add_argument("--steps", type=int, default=600, help="training steps of each task model")
    ap.add_argument("--steps-for", default="", help="per-task steps replacing --steps, e.g. addition=3000")
    ap.add_argument("--addition-order", choices=("msd", "lsd"), default="msd",
                    help="digit order of addition's numbers (msd: most significant digit first, as written; "
                         "lsd: least significant first)")
    ap.add_argument("--addition-operands", choices=("mixed", "full"), default="mixed",
                    help="addition's training operands: mixed sizes (the curriculum that learns) or full-size")
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--prompts", type=int, default=64, help="held-out prompts per task")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--check", action="store_true",
                    help=f"only {' and '.join(CHECK_RULES)} on 64 prompts: did each model learn its task?")
    ap.add_argument("--workdir", default="runs/bench_dllm_tasks")
    args = ap.parse_args(argv)
    if args.check:
        args.rules, args.prompts = ",".join(CHECK_RULES), 64
    from jaxdecode.training.dllm import train_task_dllm
    from jaxdecode.training.filter import filter_data, train_filter
    from jaxdecode.training.trainer import TrainConfig
    work = Path(args.workdir)
    rules = args.rules.split(",")
    for name in args.tasks.split(","):
        task, held_out, recipe, steps, tag = task_setup(name, args)
        config, params = train_task_dllm(task, work / tag, steps=steps, **recipe)
        filt = None
        if "learn2pd" in rules:
            train_prompts, _ = held_out.sample(np.random.default_rng(1), 256)
            data = filter_data(config, params, train_prompts, np.full(256, task.prompt_length, np.int32),
                               answer_length=task.answer_length)
            tcfg = TrainConfig(steps=300, learning_rate=3e-3, warmup_steps=10, weight_decay=0.0, log_every=50,
                               eval_every=0, checkpoint_every=0, keep_checkpoints=1, data_parallel=1, progress=False)
            filt = train_filter(data, tcfg, work / f"{tag}-filter").params
        prompts, _ = held_out.sample(np.random.default_rng(2), args.prompts)
        ref = None
        for spec in rules:
            r = evaluate_decoder(held_out, config, params, _rule(spec, args.threshold, filt), prompts, reference=ref)
            if spec == "greedy1":
                ref = r["tokens"]
                r["exact_match"] = 1.0
            r.pop("tokens")
            print(json.dumps({"task": name, "answer_length": task.answer_length, "rule": spec, "model": tag, **r}),
                  flush=True)


if __name__ == "__main__":
    main()
