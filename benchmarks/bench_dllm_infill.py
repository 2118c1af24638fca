"""Code infilling with a diffusion LM on held-out standard-library files (the split the embedded models
never trained on): a window of prefix + span + suffix tokens is cut from each file, the decoder gets the
prefix as its prompt and the suffix as `suffix_tokens`, and fills the span's slots with each rule.

    python benchmarks/bench_dllm_infill.py --model /work/runs/dllm-i12/export
    python benchmarks/bench_dllm_infill.py --model DIR --span 32 --prefix 128 --suffix 64 --windows 64
    python benchmarks/bench_dllm_infill.py --model DIR --filter FILTER_DIR --rules greedy1,learn2pd

Per rule one JSON line: exact_match (the filled span equals the original), token_accuracy (span tokens
equal to the original's), match_greedy1 (the span equals greedy1's), nfe and tokens_per_forward (means
over windows), seconds (wall time of all windows, compilation excluded: each batch shape compiles
once before the timed pass). With --without-suffix, greedy1 also runs without the suffix (what seeing
it is worth). Rule specs: a name of jaxdecode.diffusion.RULES, llada:K (K tokens per forward),
threshold (--threshold), learn2pd (needs --filter, a filter written by `jaxdecode train filter`).
"""
from __future__ import annotations

import argparse
import json

import jax
import numpy as np
from _common import decode_in_batches, heldout_prompts, rows
from bench_dllm_tasks import _rule

from jaxdecode import diffusion as D

RULES = ("greedy1", "llada:2", "llada:4", "threshold", "factor", "credit", "localleap", "eb", "freedave")


def infill_windows(tokenizer, n: int, prefix: int, span: int, suffix: int, seed: int = 0):
    """(prefix int32[n, prefix], span int32[n, span], suffix int32[n, suffix]) from held-out files."""
    windows = [w for w in heldout_prompts(tokenizer, n, prefix + span + suffix, seed) if
               len(w) == prefix + span + suffix]
    if not windows:
        raise SystemExit(f"no held-out file has {prefix + span + suffix} tokens: shorten --prefix/--span/--suffix")
    w = np.asarray(windows, np.int32)
    return w[:, :prefix], w[:, prefix:prefix + span], w[:, prefix + span:]


def decode_all(config, params, rule, prefix, suffix, span: int, batch: int, key, **kw):
    """Fill every window's span in batches of `batch` (the last one padded with the first rows, so one
    shape compiles once): (tokens [n, span], nfe [n], tokens_per_forward [n], seconds of the timed pass)."""
    n = len(prefix)

    outs, seconds = decode_in_batches(lambda idx: D.diffusion_decode(
        config, params, prefix[idx], np.full(batch, prefix.shape[1], np.int32), answer_length=span, rule=rule,
        key=key, suffix_tokens=None if suffix is None else suffix[idx], **kw), n, batch)
    cat = lambda f: rows(outs, n, f)
    return cat(lambda o: o.tokens), cat(lambda o: o.stats["nfe"]), cat(lambda o: o.stats["tokens_per_forward"]), seconds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a diffusion checkpoint directory (bidirectional attention)")
    ap.add_argument("--windows", type=int, default=32, help="held-out file windows (one per file)")
    ap.add_argument("--prefix", type=int, default=96, help="tokens before the span")
    ap.add_argument("--span", type=int, default=16, help="tokens cut out and infilled")
    ap.add_argument("--suffix", type=int, default=32, help="tokens after the span")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--filter", help="a Learn2PD filter directory (for the rule learn2pd)")
    ap.add_argument("--block-length", type=int, help="semi-autoregressive block of slots (default: the span)")
    ap.add_argument("--without-suffix", action="store_true", help="also greedy1 without the suffix")
    ap.add_argument("--causal", help="also a causal LM's greedy continuation of the prefix (no suffix), e.g. "
                                     "'target' (the embedded target): what left-to-right decoding gets")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import jaxdecode
    model = jaxdecode.load(args.model, dtype=args.dtype)
    config, params = model.config, model.params
    prefix, span, suffix = infill_windows(model.tokenizer, args.windows, args.prefix, args.span, args.suffix,
                                          args.seed)
    filt = D.load_filter(args.filter)[0] if args.filter else None
    kw = {"eos_ids": (), "block_length": args.block_length}  # a span is exactly --span tokens: no EOS ends it
    runs = [(spec, spec, suffix) for spec in args.rules.split(",")]
    if args.without_suffix:
        runs.append(("greedy1 (no suffix)", "greedy1", None))
    reference = None
    for label, spec, suf in runs:
        if spec == "learn2pd" and filt is None:
            raise SystemExit("rule learn2pd needs --filter DIR (a filter written by `jaxdecode train filter`)")
        rule = _rule(spec, args.threshold, filt)
        tokens, nfe, tpf, seconds = decode_all(config, params, rule, prefix, suf, args.span,
                                               min(args.batch, len(prefix)), jax.random.PRNGKey(args.seed), **kw)
        if label == "greedy1":
            reference = tokens
        print(json.dumps({**_scores(label, args, tokens, span),
                          "match_greedy1": None if reference is None else float(np.mean(np.all(tokens == reference,
                                                                                                axis=1))),
                          "nfe": float(nfe.mean()), "tokens_per_forward": float(tpf.mean()), "seconds": seconds}))
    if args.causal:
        causal = jaxdecode.load(args.causal, dtype=args.dtype)
        res = jaxdecode.generate(causal, [list(map(int, p)) for p in prefix], method="greedy",
                                 max_new_tokens=args.span, eos_ids=())
        tokens = np.asarray([r.tokens for r in res])
        print(json.dumps({**_scores(f"causal greedy ({args.causal}, no suffix)", args, tokens, span),
                          "nfe": float(args.span), "tokens_per_forward": 1.0}))


def _scores(label, args, tokens, span) -> dict:
    return {"rule": label, "windows": len(span), "prefix": args.prefix, "span": args.span, "suffix": args.suffix,
            "exact_match": float(np.mean(np.all(tokens == span, axis=1))),
            "token_accuracy": float(np.mean(tokens == span)),
            "first_token_accuracy": float(np.mean(tokens[:, 0] == span[:, 0]))}


if __name__ == "__main__":
    main()
