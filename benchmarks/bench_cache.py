"""Decode cost against the KV cache's capacity: per-token time should not depend on it.

    python benchmarks/bench_cache.py [--cache-lens 256,1024,4096 --repeats 5 --json OUT.json]

The embedded target model decodes the same 64-token prompt (the start of a CPython stdlib source file),
batch 1, 128 new tokens (no EOS), with its KV cache preallocated at each capacity ("cache_len"):
  * greedy: plain autoregressive greedy decoding, seconds per new token;
  * spec: speculative decoding with prompt lookup (chain:4) and greedy verification, seconds per new
    token and per verification step (one draft + one verification forward + commit).
Compile time is excluded (each configuration runs once before it is timed); figures are medians of
--repeats runs. The last column is the time at each capacity over the time at the smallest one.
A forward that copied the cache or attended over every preallocated slot would grow with cache_len.
"""
from __future__ import annotations

import argparse
import os
import platform

import jax
import numpy as np
from _common import median_seconds as _median_seconds, write_result


def median_seconds(fn, repeats: int) -> float:
    # compile, then warm up (the first timed configuration otherwise pays the process's warm-up)
    return _median_seconds(fn, repeats, warmup=2)


def stdlib_prompt(tokenizer, n_tokens: int) -> list[int]:
    """The first n_tokens of a stdlib source file (the same text wherever this Python runs)."""
    import json as json_module

    path = os.path.join(os.path.dirname(json_module.__file__), "decoder.py")
    with open(path, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read(), add_special_tokens=False)
    if len(ids) < n_tokens:
        raise SystemExit(f"{path} has only {len(ids)} tokens; use --prompt <= {len(ids)}")
    return ids[:n_tokens]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="target", help="model dir (default: the embedded target)")
    ap.add_argument("--cache-lens", default="256,1024,4096")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--new", type=int, default=128, help="new tokens per decode")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-spec", action="store_true", help="skip the speculative decoding rows")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()

    import jaxdecode
    from jaxdecode.autoregressive import decode
    from jaxdecode.drafters import make_drafter
    from jaxdecode.sampling import SamplerConfig
    from jaxdecode.speculative import speculative_decode
    from jaxdecode.verifiers import get_verifier

    model = jaxdecode.load(args.model, dtype="float32")
    cfg = model.config
    cache_lens = sorted(int(c) for c in args.cache_lens.split(","))
    need = args.prompt + args.new
    if min(cache_lens) < need + 16:
        raise SystemExit(f"every cache length must hold prompt + new tokens + a verification tree "
                         f"(>= {need + 16}); got {cache_lens}")
    if need + 8 > cfg.max_position_embeddings:
        raise SystemExit(f"--prompt + --new ({need}) exceeds the model's {cfg.max_position_embeddings} positions")
    prompt = np.asarray([stdlib_prompt(model.tokenizer, args.prompt)], np.int32)
    lengths = np.asarray([args.prompt], np.int32)
    greedy = SamplerConfig(temperature=0.0)
    drafter = make_drafter("prompt_lookup", model, tree="chain:4")
    print(f"model: {cfg.num_layers} layers, d={cfg.hidden_size}, {cfg.num_kv_heads} KV heads x {cfg.head_dim}; "
          f"batch 1, prompt {args.prompt}, {args.new} new tokens; jax {jax.__version__} on "
          f"{jax.devices()[0].platform}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}")

    rows = []
    for cache_len in cache_lens:
        def run_greedy():
            out = decode(cfg, model.params, prompt, lengths, max_new_tokens=args.new, sampler=greedy,
                         method="greedy", cache_len=cache_len)
            return jax.block_until_ready(out)

        n_new = int(run_greedy().lengths[0])
        sec = median_seconds(run_greedy, args.repeats)
        rows.append(dict(method="greedy", cache_len=cache_len, new_tokens=n_new, seconds=sec,
                         ms_per_token=1e3 * sec / n_new))
        if args.no_spec:
            continue

        def run_spec():
            out = speculative_decode(cfg, model.params, drafter, prompt, lengths, max_new_tokens=args.new,
                                     verifier=get_verifier("greedy"), sampler=greedy, cache_len=cache_len)
            return jax.block_until_ready(out)

        out = run_spec()
        n_new, steps = int(out.lengths[0]), int(np.asarray(out.stats["verify_calls"]).reshape(-1)[0])
        sec = median_seconds(run_spec, args.repeats)
        rows.append(dict(method="spec prompt_lookup chain:4", cache_len=cache_len, new_tokens=n_new, seconds=sec,
                         ms_per_token=1e3 * sec / n_new, verify_calls=steps, ms_per_verify=1e3 * sec / steps))

    base = {}
    print(f"\n{'method':<28} {'cache_len':>9} {'ms/token':>9} {'ms/verify':>10} {'x smallest':>10}")
    for r in rows:
        base.setdefault(r["method"], r["ms_per_token"])
        r["relative_to_smallest"] = r["ms_per_token"] / base[r["method"]]
        verify = f"{r['ms_per_verify']:10.3f}" if "ms_per_verify" in r else f"{'':>10}"
        print(f"{r['method']:<28} {r['cache_len']:>9} {r['ms_per_token']:9.3f} {verify} "
              f"{r['relative_to_smallest']:10.2f}")
    result = dict(jax=jax.__version__, platform=jax.devices()[0].platform, cpu_count=os.cpu_count(),
                  prompt_tokens=args.prompt, new_tokens=args.new, repeats=args.repeats, rows=rows)
    write_result(result, args.json)

if __name__ == "__main__":
    main()
