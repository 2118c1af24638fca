"""A trained drafter under the adaptive default with and without its training's acceptance as the
policy's starting estimates (`acceptance_prior`), beside the fixed configuration and plain greedy
decoding, timed round robin in one process on held-out prompts.

    python benchmarks/bench_acceptance_prior.py --drafter hydra --tree chain:4 [--batch-size 1 --prompts 4 --repeats 3]

Each row: speed relative to plain greedy (median of --repeats calls over all prompts), mean tau, and
whether the output equals plain greedy (it must: exit status 1 otherwise). Cost tables are measured
afresh in a temporary directory.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

import numpy as np
from _common import heldout_prompts, interleaved_medians


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="hydra", help="a trained kind shipped with the embedded target")
    ap.add_argument("--tree", default=None, help="the drafter's tree (default: its own)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ["JAXDECODE_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxdecode-costs-")

    import jaxdecode
    from jaxdecode.drafters import make_drafter

    model = jaxdecode.load()
    prompts = heldout_prompts(model.tokenizer, args.prompts, args.prompt_tokens)
    bs = args.batch_size
    batches = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
    told = make_drafter(args.drafter, model, tree=args.tree)
    flat = dataclasses.replace(told, acceptance_prior=())

    def run(**kw):
        return lambda: [jaxdecode.generate(model, b, max_new_tokens=args.max_new_tokens, eos_ids=[], **kw)
                        for b in batches]
    fns = {"plain greedy": run(method="greedy"),
           "adaptive, flat prior": run(method="speculative", drafter=flat),
           "adaptive, acceptance_prior": run(method="speculative", drafter=told),
           "fixed (adaptive=False)": run(method="speculative", drafter=told, adaptive=False)}
    outs = {name: fn() for name, fn in fns.items()}  # compile (and calibrate) untimed
    secs = interleaved_medians(fns, args.repeats)
    ref = [g.tokens for o in outs["plain greedy"] for g in o]
    print(f"{args.drafter} tree {args.tree or 'default'}, prior {told.acceptance_prior}, batch {bs}, "
          f"{len(prompts)} held-out prompts x {args.prompt_tokens} tokens, {args.max_new_tokens} new, "
          f"median of {args.repeats}")
    print("| configuration | vs plain | tau | greedy == plain |\n|---|---|---|---|")
    status = 0
    for name, out in outs.items():
        same = [g.tokens for o in out for g in o] == ref
        status |= int(not same)
        tau = np.mean([g.stats.get("tau", 1.0) for o in out for g in o])
        print(f"| {name} | {secs['plain greedy'] / secs[name]:.2f}x | {tau:.2f} | {'yes' if same else 'NO'} |")
    return status


if __name__ == "__main__":
    sys.exit(main())
