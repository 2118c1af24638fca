"""ASAp (grammar-aligned sampling, jaxdecode.constraints.asap) against plain masked sampling on the embedded
target: what a round costs, and how the samples and the estimate of P(L) move with the budget.

    python benchmarks/bench_asap.py                                   # embedded target, the default regex
    python benchmarks/bench_asap.py --regex '[0-9]{1,3}' --budget 256
    python benchmarks/bench_asap.py --budget 256 --samples-per-round 8           # 32 rounds of 8 rows per prompt
    python benchmarks/bench_asap.py --prompts 1 --budget 8 --max-new-tokens 8      # smoke

Both variants run in the same loop (asap_sample; masking = update=False: the trie stays empty), so the
difference is only the trie. One JSON line per variant: seconds_per_round (wall time of all rounds minus
JAX compilation, divided by the budget), plain_decode_seconds (one constrained `decode` sample per
prompt, compiled, for the cost of the loop itself), complete (fraction of samples in L), mean_log_p of
the complete samples of the budget's second half (ASAp's should rise: the model's likelier grammatical
texts stop being under-sampled), differ (fraction of ASAp's samples that differ from masking's: both
draw with the same keys, so where the correction is small they coincide), and log_mass at rounds 1, 10,
100, budget (ASAp only: the upper bound on log P(L), averaged over prompts).
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
from _common import heldout_prompts

PATTERN = r"(def|class) [a-z_][a-z0-9_]{0,15}\((self)?\):"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the embedded target)")
    ap.add_argument("--regex", default=PATTERN)
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts (one batch row each)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--budget", type=int, default=128, help="num_samples: rounds per prompt")
    ap.add_argument("--samples-per-round", type=int, default=1, help="ASAp rows per prompt per round (1: the paper)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import jaxdecode
    from jaxdecode.autoregressive import decode
    from jaxdecode.bench import CompileClock
    from jaxdecode.constraints.asap import COMPLETE, asap_sample
    from jaxdecode.constraints.automaton import compile_regex
    from jaxdecode.sampling import SamplerConfig
    model = jaxdecode.load(args.model)
    tok, eos = model.tokenizer, tuple(int(e) for e in model.config.eos_token_ids)
    auto = compile_regex(args.regex, tok, vocab_size=model.config.vocab_size, eos_ids=eos)
    sep = tok.encode("\n\n")
    prompts = np.asarray([w + sep for w in heldout_prompts(tok, args.prompts, args.prompt_tokens, args.seed)],
                         np.int32)
    lens = np.full(len(prompts), prompts.shape[1], np.int32)
    sampler = SamplerConfig(temperature=args.temperature)

    def plain():
        out = decode(model.config, model.params, prompts, lens, max_new_tokens=args.max_new_tokens, sampler=sampler,
                     eos_ids=eos, key=jax.random.PRNGKey(args.seed), constraint=auto.constraint())
        return jax.block_until_ready(out.tokens)
    plain()
    start = time.perf_counter()
    plain()
    plain_s = time.perf_counter() - start

    marks = [r for r in (1, 10, 100, args.budget) if r <= args.budget]
    first = None
    for name, update in (("masking", False), ("asap", True)):
        with CompileClock() as clock:
            start = time.perf_counter()
            out = asap_sample(model, auto.constraint(), args.budget, prompts, lens,
                              max_new_tokens=args.max_new_tokens, eos_ids=eos, sampler=sampler, seed=args.seed,
                              samples_per_round=args.samples_per_round, update=update)
            wall = time.perf_counter() - start
        compile_s = clock.seconds or 0.0
        half = out.status[:, args.budget // 2:] == COMPLETE
        log_p = out.log_p[:, args.budget // 2:][half]
        first = out if first is None else first
        differ = np.any(out.tokens != first.tokens, axis=-1) | (out.lengths != first.lengths)
        print(json.dumps({
            "variant": name, "prompts": len(prompts), "budget": args.budget, "max_new_tokens": args.max_new_tokens,
            "samples_per_round": args.samples_per_round,
            "seconds_per_round": (wall - compile_s) * args.samples_per_round / args.budget, "compile_seconds": compile_s,
            "compile_measured": clock.seconds is not None, "plain_decode_seconds": plain_s,
            "complete": float(np.mean(out.status == COMPLETE)),
            "mean_log_p": float(log_p.mean()) if log_p.size else None,
            "differ": float(np.mean(differ)) if update else None,
            "log_mass": {r: float(np.mean(out.log_mass[:, r - 1])) for r in marks} if update else None,
            "trie_nodes": len(out.trie), "regex": args.regex,
            "example": tok.decode([int(t) for t in out.last()[0][0] if int(t) not in eos])}))


if __name__ == "__main__":
    main()
