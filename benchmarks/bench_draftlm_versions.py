"""Two implementations of the draft-LM drafter under the adaptive default, timed side by side against
plain decoding in one process (round robin), on held-out prompts with the embedded target and draft.

    git show 0c3343a:jaxdecode/drafters/draft_lm.py > /tmp/draft_lm_before.py
    python benchmarks/bench_draftlm_versions.py --before /tmp/draft_lm_before.py \
        [--batch-size 1 --temperature 0 --prompts 8 --max-new-tokens 64 --tree chain:4 --repeats 7]

`--before FILE` is a copy of `jaxdecode/drafters/draft_lm.py` from another commit (its `DraftLM` class
is loaded from the file); the installed one is "after". Each row: median seconds of all prompts (one
generate call per batch), the ratio to plain decoding, and how many steps drafted (the policy's
`width_hist`). At T = 0 both must equal plain greedy (exit status 1 otherwise). Cost tables are
measured afresh in a temporary directory (the two classes have different fingerprints).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile

import numpy as np
from _common import heldout_prompts, interleaved_medians


def load_class(path: str):
    spec = importlib.util.spec_from_file_location("draft_lm_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module.DraftLM


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="a draft_lm.py from another commit")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tree", default="chain:4")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    os.environ["JAXDECODE_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxdecode-costs-")

    import jaxdecode
    from jaxdecode.api import embedded_model_path
    from jaxdecode.drafters.builders import parse_tree_spec
    from jaxdecode.drafters.draft_lm import DraftLM

    target = jaxdecode.load(embedded_model_path("target"), dtype="float32")
    draft = jaxdecode.load(embedded_model_path("draft"), dtype="float32")
    prompts = heldout_prompts(target.tokenizer, args.prompts, args.prompt_tokens)
    bs, n = args.batch_size, args.max_new_tokens
    batches = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
    greedy = args.temperature == 0
    samp = {} if greedy else dict(temperature=args.temperature, seed=0)
    tree = parse_tree_spec(args.tree + ("" if greedy else ":sample"))
    drafters = {cls_name: cls(params=draft.params, config=draft.config, builder=tree)
                for cls_name, cls in (("before", load_class(args.before)), ("after", DraftLM))}

    def run(method, **kw):
        return lambda: [jaxdecode.generate(target, b, method=method, max_new_tokens=n, eos_ids=[], **samp, **kw)
                        for b in batches]
    fns = {"plain": run("greedy" if greedy else "sample")}
    fns.update({name: run("speculative", drafter=d) for name, d in drafters.items()})
    outs = {name: fn() for name, fn in fns.items()}  # compile (and calibrate) untimed
    secs = interleaved_medians(fns, args.repeats)
    plain_tokens = [g.tokens for out in outs["plain"] for g in out]
    status = 0
    print(f"batch {bs}, T={args.temperature}, {len(prompts)} held-out prompts x {n} new tokens, tree {args.tree}, "
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
