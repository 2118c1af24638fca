"""The retrieval drafter against plain decoding and prompt lookup, timed round robin in one run.

    python benchmarks/bench_retrieval.py [--prompts 8 --prompt-tokens 128 --new 96 --batch-sizes 1,4
                                          --temperatures 0,0.7 --sources heldout,outside --rounds 5
                                          --only chain,nocut,chain8,chain4,default,lookup --json FILE]

Per (temperature, batch size, source): plain decoding (`decode`), then each configuration through
`speculative_decode` as generate runs it: fixed chains (adaptive=False) of the shipped datastore
(`<target>/drafters/retrieval`: its own chain length with and without its confidence cut, chain:8 and
chain:4), prompt lookup's chain:4 (the best drafter before it), and the adaptive default (the policy
keyed by the drafter's confidence classes, costs measured once and cached). Every configuration is
compiled (and calibrated) first, then all are timed round robin, `--rounds` times, and each one's
median is compared with plain decoding's: load that drifts during the run falls on every configuration
alike. Prompts come from held-out stdlib files and from packages outside the corpus
(benchmarks/_common.py); greedy rows check the output against plain greedy token for token.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import jax
import numpy as np
from _common import interleaved_medians, prompts_by_source, source_names, write_result

import jaxdecode
from jaxdecode import costmodel
from jaxdecode.adaptive import default_widths
from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters import make_drafter
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import policy_for, speculative_decode
from jaxdecode.verifiers import default_verifier, get_verifier

# key (for --only): (label, drafter name, tree, drafter options, adaptive); tree None: the datastore's own
# chain length ({n} in a label: the drafter's node count)
CONFIGS = {
    "chain": ("retrieval, its chain ({n}), fixed", "retrieval", None, {}, False),
    "nocut": ("retrieval, its chain ({n}), fixed, no confidence cut", "retrieval", None, {"min_reach": 0.0}, False),
    "chain8": ("retrieval chain:8, fixed", "retrieval", "chain:8", {}, False),
    "chain4": ("retrieval chain:4, fixed", "retrieval", "chain:4", {}, False),
    "default": ("retrieval, adaptive (the default)", "retrieval", None, {}, True),
    "lookup": ("prompt_lookup chain:4, fixed", "prompt_lookup", "chain:4", {}, False),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per source")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--sources", type=source_names, default="heldout,outside")
    ap.add_argument("--rounds", type=int, default=5, help="round-robin timing rounds (medians)")
    ap.add_argument("--cost-cache", default=None, help="where the adaptive rows' cost tables are cached")
    ap.add_argument("--only", default=",".join(CONFIGS),
                    help=f"comma list of configurations to time beside plain decoding ({', '.join(CONFIGS)})")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    only = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = sorted(set(only) - set(CONFIGS))
    if unknown or not only:
        ap.error(f"--only takes a comma list of {', '.join(CONFIGS)}; got {args.only!r}")
    if args.cost_cache:
        os.environ["JAXDECODE_CACHE_DIR"] = args.cost_cache
    target = jaxdecode.load()
    cfg = target.config
    sources = prompts_by_source(args.sources, target.tokenizer, args.prompts, args.prompt_tokens)
    print(f"target {cfg.num_parameters() / 1e6:.1f} M; {args.prompts} prompts x {args.prompt_tokens} tokens per "
          f"source, {args.new} new; {args.rounds} rounds; jax {jax.__version__} on {jax.devices()[0].platform}, "
          f"{os.cpu_count()} cores, {platform.machine()}", flush=True)
    rows, all_equal = [], True
    for t in (float(x) for x in args.temperatures.split(",")):
        sampler = SamplerConfig(temperature=t)
        key = jax.random.PRNGKey(0)
        for bs in (int(x) for x in args.batch_sizes.split(",")):
            drafters = {}
            for label, name, tree, opts, adaptive in (CONFIGS[k] for k in only):
                d = make_drafter(name, target, tree=tree, temperature=t, **opts)
                label = label.format(n=d.num_nodes)
                verifier = get_verifier(default_verifier(d, sampler))
                policy = costs = None
                if adaptive:  # as generate sets it up (jaxdecode.decoders._adaptive_policy)
                    widths = default_widths(d.num_nodes, getattr(d, "verify_widths", None) or ())
                    policy = policy_for(d, sampler, widths=widths)
                    costs = costmodel.load_or_calibrate(target, d, bs, widths=widths, sampler=sampler,
                                                        verifier=verifier,
                                                        context_len=args.prompt_tokens + args.new // 2)
                drafters[label] = (d, verifier, policy, costs)
            for source, prompts in sources.items():
                batches = [pad_prompts(prompts[i:i + bs]) for i in range(0, len(prompts), bs)]
                n_tok = args.new * len(prompts)
                outs = {}

                def plain():
                    outs["plain"] = ([np.asarray(decode(cfg, target.params, pt, pl, max_new_tokens=args.new,
                                                        sampler=sampler, key=key,
                                                        method="greedy" if t == 0 else "sample").tokens)
                                      for pt, pl in batches], None)

                def spec(label):
                    d, verifier, policy, costs = drafters[label]

                    def run():
                        toks, steps = [], 0
                        for pt, pl in batches:
                            o = speculative_decode(cfg, target.params, d, pt, pl, max_new_tokens=args.new,
                                                   verifier=verifier, sampler=sampler, key=key, adaptive=policy,
                                                   costs=costs)
                            toks.append(np.asarray(o.tokens))
                            steps += int(np.sum(o.stats["verify_calls"]))
                        outs[label] = (toks, steps)
                    return run

                fns = {"plain": plain, **{label: spec(label) for label in drafters}}
                for fn in fns.values():
                    fn()  # compile
                med = interleaved_medians(fns, args.rounds)
                head = dict(temperature=t, batch=bs, source=source)
                rows.append(dict(head, method="plain decoding", tau=1.0, tok_s=n_tok / med["plain"], speedup=1.0,
                                 equal=True))
                print(f"\nT={t} batch {bs} {source}: plain {n_tok / med['plain']:.1f} tok/s", flush=True)
                for label in drafters:
                    toks, steps = outs[label]
                    same = all(np.array_equal(a, b) for a, b in zip(toks, outs["plain"][0]))
                    all_equal &= same or t > 0
                    rows.append(dict(head, method=label, tau=n_tok / max(steps, 1), tok_s=n_tok / med[label],
                                     speedup=med["plain"] / med[label], equal=same))
                    r = rows[-1]
                    print(f"  {label:40s} tau {r['tau']:.2f}  {r['tok_s']:7.1f} tok/s  {r['speedup']:.2f}x  "
                          f"{('same tokens' if same else 'DIFFERS') if t == 0 else 'sampled'}", flush=True)
    print("\n| T | batch | prompts | method | tau | tok/s | speedup | greedy == plain |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        eq = ("yes" if r["equal"] else "NO") if r["temperature"] == 0 else "n/a"
        print(f"| {r['temperature']} | {r['batch']} | {r['source']} | {r['method']} | {r['tau']:.2f} | "
              f"{r['tok_s']:.1f} | {r['speedup']:.2f}x | {eq} |")
    write_result(dict(jax=jax.__version__, platform=jax.devices()[0].platform, cpu_count=os.cpu_count(),
                      args=vars(args), rows=rows), args.json)
    return all_equal


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
