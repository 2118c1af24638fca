"""Diffusion decoders on the synthetic tasks (ParallelBench-style): per task and rule, the forwards
per answer (NFE), tokens per forward, validity, exact match against one token per forward (greedy1)
and wall time, with task dLLMs trained here (cached in --workdir) and a Learn2PD filter per task.

    python benchmarks/bench_dllm_tasks.py                                    # small: answers of 6 tokens
    python benchmarks/bench_dllm_tasks.py --task-length 16 --num-values 8 --steps 1500   # 16-token answers

Prints one JSON line per (task, rule). Times exclude compilation.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from jaxdecode import diffusion as D
from jaxdecode.dllm_tasks import evaluate_decoder, make_task

RULES = ("greedy1", "llada:2", "llada:4", "threshold", "factor", "credit", "localleap", "freedave", "eb", "learn2pd")


def _rule(spec: str, threshold: float, filter_params):
    name, _, n = spec.partition(":")
    if name == "llada":
        return D.LLaDA(tokens_per_step=int(n or 2))
    if name == "learn2pd":
        return D.Learn2PD(params=filter_params, threshold=threshold)
    if name == "threshold":
        return D.Threshold(threshold=threshold)
    return D.make_rule(name)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="copy,sort,reverse,addition,permutation,latin_square")
    ap.add_argument("--task-length", type=int, default=6, help="items of the deterministic tasks")
    ap.add_argument("--many-length", type=int, default=6,
                    help="items of permutation (<= --num-values); latin_square's order is min(3, this)")
    ap.add_argument("--num-values", type=int, default=6)
    ap.add_argument("--steps", type=int, default=600, help="training steps of each task model")
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--prompts", type=int, default=64, help="held-out prompts per task")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--workdir", default="runs/bench_dllm_tasks")
    args = ap.parse_args(argv)
    from jaxdecode.training.dllm import train_task_dllm
    from jaxdecode.training.filter import filter_data, train_filter
    from jaxdecode.training.trainer import TrainConfig
    work = Path(args.workdir)
    for name in args.tasks.split(","):
        length = {"latin_square": min(args.many_length, 3), "permutation": args.many_length}.get(name, args.task_length)
        task = make_task(name, length, args.num_values)
        tag = f"{name}-{length}-{args.num_values}-{args.steps}"
        config, params = train_task_dllm(task, work / tag, steps=args.steps)
        rng = np.random.default_rng(1)
        train_prompts, _ = task.sample(rng, 256)
        data = filter_data(config, params, train_prompts, np.full(256, task.prompt_length, np.int32),
                           answer_length=task.answer_length)
        tcfg = TrainConfig(steps=300, learning_rate=3e-3, warmup_steps=10, weight_decay=0.0, log_every=50,
                           eval_every=0, checkpoint_every=0, keep_checkpoints=1, data_parallel=1, progress=False)
        filt = train_filter(data, tcfg, work / f"{tag}-filter").params
        prompts, _ = task.sample(np.random.default_rng(2), args.prompts)
        ref = None
        for spec in args.rules.split(","):
            r = evaluate_decoder(task, config, params, _rule(spec, args.threshold, filt), prompts, reference=ref)
            if spec == "greedy1":
                ref = r["tokens"]
                r["exact_match"] = 1.0
            r.pop("tokens")
            print(json.dumps({"task": name, "answer_length": task.answer_length, "rule": spec, **r}), flush=True)


if __name__ == "__main__":
    main()
