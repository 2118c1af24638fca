"""Streaming overhead: tokens/s of one-shot generate vs jaxdecode.stream (all pieces consumed), batch 1.

    python benchmarks/bench_streaming.py [--model DIR --draft DIR --prompts 4 --max-new-tokens 128
                                          --repeats 3 --methods greedy,spec_draft,spec_lookup
                                          --interval 0.02 --every 8 --json FILE]

Per method, every prompt is decoded at batch 1 one-shot (`generate`) and streamed (`stream`, every piece
consumed as it arrives, as a console would), the two interleaved so that a change of load hits both
alike; each call is the wall time seen by the caller (for the stream: from the call to its last piece,
detokenisation included). Compilation is excluded (one untimed call of each first). EOS is off, so
every call makes --max-new-tokens tokens. Reported: tokens/s of each, the overhead (1 - stream /
one-shot), the stream's time to its first piece, loop steps per call (a token for greedy, an accepted
block for speculative; the host gets a delivery once a row crosses a multiple of --every tokens), and
that the two outputs are token for token equal.

Methods: greedy; spec_draft (speculative, the embedded draft LM, chain:4, adaptive off); spec_lookup
(speculative, prompt lookup, chain:4, adaptive off). Default models: the embedded target and draft.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

from _common import heldout_prompts, write_result

METHODS = {
    "greedy": ("greedy", {}),
    "spec_draft": ("speculative", dict(drafter="draft_lm", tree="chain:4", adaptive=False)),
    "spec_lookup": ("speculative", dict(drafter="prompt_lookup", tree="chain:4", adaptive=False)),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="target checkpoint (default: the embedded target)")
    ap.add_argument("--draft", default=None, help="draft checkpoint of spec_draft (default: the embedded draft)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--every", type=int, default=None, help="stream(every=): tokens between deliveries (default 8)")
    ap.add_argument("--interval", type=float, default=0.02,
                    help="stream(interval=): seconds between detokenisation rounds (0: every step)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()

    import jax

    import jaxdecode
    from jaxdecode.streaming import stream

    model = jaxdecode.load(args.model, dtype="float32")
    draft = None
    prompts = heldout_prompts(model.tokenizer, args.prompts, args.prompt_tokens)
    results = {}
    for name in args.methods.split(","):
        if name not in METHODS:
            raise SystemExit(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
        method, opts = METHODS[name]
        opts = dict(opts, max_new_tokens=args.max_new_tokens, eos_ids=())
        if opts.get("drafter") == "draft_lm":
            draft = draft or jaxdecode.load(args.draft or "draft", dtype="float32")
            opts["draft"] = draft

        def one_shot(p, method=method, opts=opts):
            t0 = time.perf_counter()
            out = jaxdecode.generate(model, [p], method, **opts)[0]
            return out, time.perf_counter() - t0, None

        def streamed(p, method=method, opts=opts):
            t0 = time.perf_counter()
            first = None
            s = stream(model, [p], method, interval=args.interval, every=args.every, **opts)
            for _ in s:
                first = first if first is not None else time.perf_counter() - t0
            return s.results[0], time.perf_counter() - t0, first

        one_shot(prompts[0]), streamed(prompts[0])  # compile both programs
        secs = {"one_shot": [], "stream": []}
        first_piece, calls, equal, tokens = [], [], True, 0
        for _ in range(args.repeats):
            for p in prompts:
                a, ta, _ = one_shot(p)
                b, tb, first = streamed(p)
                secs["one_shot"].append(ta)
                secs["stream"].append(tb)
                first_piece.append(first)
                equal &= a.tokens == b.tokens
                tokens += len(a.tokens)
                calls.append(b.stats.get("verify_calls", len(b.tokens)))
        tps = {k: tokens / sum(v) for k, v in secs.items()}
        results[name] = dict(
            one_shot_tokens_per_s=round(tps["one_shot"], 1), stream_tokens_per_s=round(tps["stream"], 1),
            overhead=round(1 - tps["stream"] / tps["one_shot"], 4),
            one_shot_median_s=round(statistics.median(secs["one_shot"]), 4),
            stream_median_s=round(statistics.median(secs["stream"]), 4),
            stream_first_piece_median_s=round(statistics.median(x for x in first_piece if x is not None), 4),
            loop_steps_per_call=round(statistics.mean(calls), 1), tokens_equal=bool(equal))
        print(name, results[name], flush=True)
    write_result(dict(benchmark="streaming", device=str(jax.devices()[0]), backend=jax.default_backend(),
                      host=platform.node(), batch=1, prompts=args.prompts, prompt_tokens=args.prompt_tokens,
                      max_new_tokens=args.max_new_tokens, repeats=args.repeats, interval=args.interval,
                      every=args.every,
                      results=results), args.json)


if __name__ == "__main__":
    main()
