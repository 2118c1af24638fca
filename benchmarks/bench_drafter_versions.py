"""Two implementations of a drafter under the adaptive default, timed side by side against plain
decoding in one process (round robin), on held-out prompts with the embedded target.

    git show 0c3343a:jaxdecode/drafters/draft_lm.py > /tmp/draft_lm_before.py
    python benchmarks/bench_drafter_versions.py --before /tmp/draft_lm_before.py \
        [--drafter draft_lm --batch-size 1 --temperature 0 --prompts 8 --max-new-tokens 64 --tree chain:4 --repeats 7]
    git show 1af8325:jaxdecode/drafters/selfspec.py > /tmp/selfspec_before.py
    python benchmarks/bench_drafter_versions.py --before /tmp/selfspec_before.py --drafter kangaroo

`--drafter`: `draft_lm` (the embedded draft model, `--tree`) or a self-speculation kind shipped with the
target (`kangaroo`, its own tree). `--before FILE` is a copy of the drafter's module from another commit:
its class of the same name is loaded from the file and given the same fields; the installed one is
"after". Each row: median seconds of all prompts (one generate call per batch), the ratio to plain
decoding, and how many steps drafted (the policy's `width_hist`). At T = 0 both must equal plain greedy
(exit status 1 otherwise). Cost tables are measured afresh in a temporary directory (the two classes
have different fingerprints).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import tempfile

import numpy as np
from _common import heldout_prompts, interleaved_medians


def load_class(path: str, name: str):
    spec = importlib.util.spec_from_file_location("drafter_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return getattr(module, name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the drafter's module file from another commit")
    ap.add_argument("--drafter", default="draft_lm", help="draft_lm, or a shipped self-speculation kind (kangaroo)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tree", default="chain:4", help="draft_lm's tree")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    os.environ["JAXDECODE_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxdecode-costs-")

    import jaxdecode
    from jaxdecode.api import embedded_model_path
    from jaxdecode.drafters import make_drafter
    from jaxdecode.drafters.builders import parse_tree_spec
    from jaxdecode.drafters.draft_lm import DraftLM

    target = jaxdecode.load(embedded_model_path("target"), dtype="float32")
    prompts = heldout_prompts(target.tokenizer, args.prompts, args.prompt_tokens)
    bs, n = args.batch_size, args.max_new_tokens
    batches = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
    greedy = args.temperature == 0
    samp = {} if greedy else dict(temperature=args.temperature, seed=0)
    if args.drafter == "draft_lm":
        draft = jaxdecode.load(embedded_model_path("draft"), dtype="float32")
        after = DraftLM(params=draft.params, config=draft.config,
                        builder=parse_tree_spec(args.tree + ("" if greedy else ":sample")))
    else:
        trained = jaxdecode.load_drafter(embedded_model_path("target") / "drafters" / args.drafter, target)
        after = make_drafter(trained, target, temperature=args.temperature)
    before_cls = load_class(args.before, type(after).__name__)
    before = before_cls(**{f.name: getattr(after, f.name) for f in dataclasses.fields(after)})
    drafters = {"before": before, "after": after}

    def run(method, **kw):
        return lambda: [jaxdecode.generate(target, b, method=method, max_new_tokens=n, eos_ids=[], **samp, **kw)
                        for b in batches]
    fns = {"plain": run("greedy" if greedy else "sample")}
    fns.update({name: run("speculative", drafter=d) for name, d in drafters.items()})
    outs = {name: fn() for name, fn in fns.items()}  # compile (and calibrate) untimed
    secs = interleaved_medians(fns, args.repeats)
    plain_tokens = [g.tokens for out in outs["plain"] for g in out]
    status = 0
    what = f"draft_lm, tree {args.tree}" if args.drafter == "draft_lm" else args.drafter
    print(f"batch {bs}, T={args.temperature}, {len(prompts)} held-out prompts x {n} new tokens, {what}, "
          f"median of {args.repeats} round-robin calls")
    print("| drafter | seconds | vs plain | steps drafted / steps | greedy == plain |")
    print("|---|---|---|---|---|")
    for name, out in outs.items():
        if name == "plain":
            continue
        hist = np.sum([np.asarray(o[0].batch_stats["width_hist"]) for o in out], axis=0)  # steps per width
        same = [g.tokens for o in out for g in o] == plain_tokens
        status |= int(greedy and not same)
        print(f"| {name} | {secs[name]:.3f} | {secs['plain'] / secs[name]:.3f}x | {int(hist[1:].sum())} / "
              f"{int(hist.sum())} | {('yes' if same else 'NO') if greedy else 'n/a'} |")
    print(f"plain: {secs['plain']:.3f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
