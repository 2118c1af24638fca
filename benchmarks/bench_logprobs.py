"""What reporting log-probs costs: decoding with logprobs off / on / top_logprobs=5, and prompt scoring.

    python benchmarks/bench_logprobs.py [--quick] [--target DIR --draft DIR] [--batch-sizes 1,8]
                                        [--new-tokens 64] [--repeats 5] [--json FILE]

Per method (greedy, sample T=0.8 top-k 50, speculative greedy with prompt lookup chain:4 and with the
draft LM chain:4; adaptive speculation off, so every run does the same work) and batch size: median
seconds of one decode (compile excluded) with logprobs off, logprobs=True and top_logprobs=5, the three
interleaved so a load change hits them alike, and the overhead of each against off. The tokens are
checked to be the same in the three runs. Scoring: tokens/s of jaxdecode.score's forward over
--batch-sizes rows of prompt + new-tokens tokens. Default models: the embedded target and draft.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
from _common import finish_args, heldout_prompts, load_target_and_draft, write_result

FULL = dict(batch_sizes="1,8", new_tokens=64, prompt_tokens=64, repeats=5)
QUICK = dict(batch_sizes="1,2", new_tokens=8, prompt_tokens=16, repeats=2)
SETTINGS = (("off", dict(logprobs=False, top_logprobs=0)), ("logprobs", dict(logprobs=True, top_logprobs=0)),
            ("top5", dict(logprobs=True, top_logprobs=5)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks that the script runs")
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--batch-sizes", default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--prompt-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    finish_args(args, QUICK if args.quick else FULL)

    import jax

    from jaxdecode.autoregressive import decode
    from jaxdecode.drafters import make_drafter
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.scoring import prompt_logprobs
    from jaxdecode.speculative import speculative_decode
    from jaxdecode.verifiers import get_verifier

    _, target, draft = load_target_and_draft(args)
    cfg, params = target.config, target.params
    greedy, sample = SamplerConfig(temperature=0.0), SamplerConfig(temperature=0.8, top_k=50)
    drafters = {"prompt_lookup": make_drafter("prompt_lookup", target, tree="chain:4"),
                "draft_lm": make_drafter("draft_lm", target, draft=draft, tree="chain:4")}

    def runner(method, toks, lens, flags):
        n, key = args.new_tokens, jax.random.PRNGKey(0)
        if method in ("greedy", "sample"):
            return lambda: decode(cfg, params, toks, lens, max_new_tokens=n, eos_ids=(), key=key, method=method,
                                  sampler=greedy if method == "greedy" else sample, **flags)
        d = drafters[method.split(":")[1]]
        return lambda: speculative_decode(cfg, params, d, toks, lens, max_new_tokens=n, eos_ids=(), key=key,
                                          verifier=get_verifier("greedy"), sampler=greedy, **flags)

    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        ids = heldout_prompts(target.tokenizer, batch, args.prompt_tokens)
        toks, lens = np.asarray(ids, np.int32), np.full((batch,), args.prompt_tokens, np.int32)
        for method in ("greedy", "sample", "spec:prompt_lookup", "spec:draft_lm"):
            fns = {name: runner(method, toks, lens, flags) for name, flags in SETTINGS}
            outs = {name: jax.block_until_ready(fn()) for name, fn in fns.items()}  # compile
            same = all(np.array_equal(np.asarray(o.tokens), np.asarray(outs["off"].tokens)) for o in outs.values())
            times = {name: [] for name in fns}
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn())
                    times[name].append(time.perf_counter() - t0)
            med = {name: statistics.median(t) for name, t in times.items()}
            row = dict(method=method, batch=batch, same_tokens=same,
                       **{f"seconds_{k}": round(v, 5) for k, v in med.items()},
                       **{f"overhead_{k}": round(med[k] / med["off"] - 1, 4) for k in med if k != "off"})
            print(row, flush=True)
            rows.append(row)
        seqs = [list(r) + list(r[:args.new_tokens]) for r in ids]
        prompt_logprobs(target, seqs)  # compile
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            prompt_logprobs(target, seqs)
        sec = (time.perf_counter() - t0) / args.repeats
        rows.append(dict(method="score", batch=batch, seconds=round(sec, 5),
                         tokens_per_second=round(sum(map(len, seqs)) / sec, 1)))
        print(rows[-1], flush=True)
    write_result(dict(bench="logprobs", device=jax.devices()[0].device_kind, platform=platform.platform(),
                      new_tokens=args.new_tokens, prompt_tokens=args.prompt_tokens, rows=rows), args.json)


if __name__ == "__main__":
    main()
