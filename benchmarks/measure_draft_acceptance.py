"""The target's greedy acceptance by depth of a draft LM's chain, measured with the speculative engine
on held-out prompts, and (--write) recorded beside the draft as its acceptance.json: the adaptive
policy's starting estimates (jaxdecode.drafters.draft_lm.acceptance_prior_for).

    python benchmarks/measure_draft_acceptance.py [--draft DIR] [--prompts 32 --seed 7] [--write]

The windows are drawn with their own seed (default 7), not the benchmarks' (0), so the benchmarks'
prompts do not set the estimates they are then timed with. Defaults: the embedded target and draft.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from _common import heldout_prompts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target model dir (default: the embedded target)")
    ap.add_argument("--draft", default=None, help="draft model dir (default: the embedded draft)")
    ap.add_argument("--tree", default="chain:4")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=7, help="window draw (the benchmarks use 0)")
    ap.add_argument("--write", action="store_true", help="write the draft's acceptance.json")
    args = ap.parse_args(argv)

    import jaxdecode
    from jaxdecode.costmodel import params_digest
    from jaxdecode.drafters.draft_lm import ACCEPTANCE_FILE

    target = jaxdecode.load(args.target)
    draft = jaxdecode.load(args.draft if args.draft else "draft")
    prompts = heldout_prompts(target.tokenizer, args.prompts, args.prompt_tokens, seed=args.seed)
    # One batch: the engine's own per-depth counts over every row (greedy rows do not depend on each other).
    out = jaxdecode.generate(target, prompts, method="speculative", drafter="draft_lm", draft=draft, tree=args.tree,
                             adaptive=False, max_new_tokens=args.max_new_tokens, eos_ids=())
    rates = [round(float(x), 6) for x in out[0].batch_stats["accept_rate_by_depth"]]
    tau = sum(r.stats["new_tokens"] for r in out) / sum(int(r.stats["verify_calls"]) for r in out)
    print(f"{len(prompts)} held-out windows (seed {args.seed}) x {args.prompt_tokens} tokens, "
          f"{args.max_new_tokens} new, {args.tree}, greedy: tau {tau:.2f}, acceptance by depth {rates}")
    if args.write:
        path = Path(draft.path) / ACCEPTANCE_FILE
        record = {"about": f"The target's greedy acceptance by depth of this draft's {args.tree} on {len(prompts)} "
                           f"held-out stdlib windows of {args.prompt_tokens} tokens (seed {args.seed}), "
                           f"{args.max_new_tokens} new tokens each, measured with the speculative engine "
                           f"(benchmarks/measure_draft_acceptance.py; tau {tau:.2f}). jaxdecode uses it as the "
                           f"adaptive policy's starting estimate when the target's weights have this digest.",
                  "target_params_sha256": params_digest(target.params),
                  "accept_by_depth": rates}
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
