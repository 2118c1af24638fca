"""The speculative engine's plain step against an autoregressive step: what the adaptive policy's "do not
draft" costs. The engine runs with prompt lookup and a cost table under which drafting never pays, so
every step is the engine's plain step (the pending token alone through the target, no tree, no
verifier); the baseline is `decode` (greedy, or sampling at the same temperature) on the same prompts.
Greedy: both produce the same tokens (checked: same_tokens); sampling: the same distribution, different
draws (the engine splits its key differently). Timed round robin (median of --repeats). A ratio below 1 is the floor
under which the adaptive default cannot go at this batch size whenever it rightly decodes plainly.

    python benchmarks/bench_plain_step.py --batch-sizes 1,4,16 --temperatures 0,0.7
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import heldout_prompts, interleaved_medians, write_result  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import jaxdecode
    from jaxdecode.adaptive import default_widths
    from jaxdecode.autoregressive import decode
    from jaxdecode.costmodel import CostTable
    from jaxdecode.drafters import make_drafter
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.speculative import policy_for, speculative_decode
    from jaxdecode.verifiers import get_verifier

    model = jaxdecode.load()
    drafter = make_drafter("prompt_lookup", model)
    widths = default_widths(drafter.num_nodes)
    rows = []
    for temp in (float(t) for t in args.temperatures.split(",")):
        sampler = SamplerConfig(temperature=temp)
        verifier = get_verifier("greedy" if temp == 0 else "point_mass")
        policy = policy_for(drafter, sampler, widths=widths)
        for b in (int(x) for x in args.batch_sizes.split(",")):
            slow = (1e-3,) + (1.0,) * (len(widths) - 1)  # any drafting width costs a second: never pays
            never = CostTable(widths=widths, verify_seconds=slow, draft_seconds=0.0, idle_seconds=0.0,
                              batch_size=b, step_seconds=slow)
            toks = jnp.asarray(heldout_prompts(model.tokenizer, b, args.prompt_tokens), jnp.int32)
            lens = jnp.full((b,), toks.shape[1], jnp.int32)
            key = jax.random.PRNGKey(0)
            kw = dict(max_new_tokens=args.max_new_tokens, sampler=sampler, key=key)

            def plain():
                return decode(model.config, model.params, toks, lens, method="greedy" if temp == 0 else "sample", **kw)

            def engine():
                return speculative_decode(model.config, model.params, drafter, toks, lens, verifier=verifier,
                                          adaptive=policy, costs=never, **kw)
            a, s = plain(), engine()  # compile; same tokens
            same = bool(jnp.array_equal(a.tokens, s.tokens))
            secs = interleaved_medians({"plain": lambda: plain().tokens.block_until_ready(),
                                        "engine": lambda: engine().tokens.block_until_ready()}, args.repeats)
            row = dict(temperature=temp, batch=b, plain_ms=round(1e3 * secs["plain"], 2),
                       engine_plain_step_ms=round(1e3 * secs["engine"], 2),
                       ratio=round(secs["plain"] / secs["engine"], 3), same_tokens=same,
                       speculative_steps=int(jnp.sum(s.stats["speculative_steps"])))
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    write_result({"bench": "plain_step", "backend": jax.default_backend(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
