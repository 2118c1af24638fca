"""Diffusion decoders: per rule, forwards (NFE), tokens per forward, exact match against one token per
forward (greedy1) and wall time; and block diffusion with the exact KV cache against recomputation.

    python benchmarks/bench_diffusion_decoders.py                      # random-weight dLLM, small sizes
    python benchmarks/bench_diffusion_decoders.py --model DIR --prompts-file p.txt --answer-length 64
    python benchmarks/bench_diffusion_decoders.py --block-only --answer-length 256 --block-size 32
    # Fast-dLLM's approximate caches vs none on a Dream-style (logits_shift 1) model, rules greedy1 + threshold
    python benchmarks/bench_diffusion_decoders.py --model DIR --heldout --rules greedy1,threshold \
        --cache-rules greedy1,threshold --answer-length 64 --block-length 16 --no-block

Prints one JSON line per configuration. Times exclude compilation (each decode runs once to compile,
then `--repeats` times measured). Rules in `--cache-rules` also run with cache='prefix' and 'dual';
their lines carry agree_no_cache (share of answer tokens equal to the same rule without a cache) and
match_no_cache (share of rows equal).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jaxdecode.models import ModelConfig, init_params

from jaxdecode import diffusion as D

RULES = ("greedy1", "llada", "random", "threshold", "factor", "credit", "localleap", "freedave", "adablock",
         "ccd", "ete", "window", "r2", "dystruct", "eb", "infogain")


def _random_model(attention: str, block_size: int, vocab: int, layers: int, hidden: int, max_pos: int,
                  logits_shift: int = 0):
    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_layers=layers, num_heads=max(hidden // 32, 1), num_kv_heads=max(hidden // 64, 1),
                      head_dim=32, max_position_embeddings=max_pos, attention=attention,
                      block_size=block_size if attention == "block" else 0, mask_token_id=vocab - 1,
                      logits_shift=logits_shift)
    return cfg, init_params(cfg, jax.random.PRNGKey(0), std=0.3)


def _timed(fn, repeats: int):
    out = fn()
    jax.block_until_ready(out.tokens)
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
        jax.block_until_ready(out.tokens)
    return out, (time.perf_counter() - start) / repeats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a diffusion checkpoint directory (default: random weights)")
    ap.add_argument("--prompts-file", help="one prompt per line (with --model)")
    ap.add_argument("--heldout", action="store_true",
                    help="with --model: --batch prompts of --prompt-length tokens from held-out stdlib files")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-length", type=int, default=16)
    ap.add_argument("--answer-length", type=int, default=32)
    ap.add_argument("--block-length", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=8, help="attention block of the random block model")
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--cache-rules", default="threshold", help="rules that also run with cache prefix and dual")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-only", action="store_true", help="only block diffusion: cache vs recomputation")
    ap.add_argument("--no-block", action="store_true", help="skip block diffusion")
    ap.add_argument("--logits-shift", type=int, default=0, choices=(0, 1), help="of the random bidirectional model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    max_pos = args.prompt_length + args.answer_length + 8

    if args.model:
        import jaxdecode
        model = jaxdecode.load(args.model)
        cfg, params = model.config, model.params
        from pathlib import Path

        from jaxdecode.autoregressive import pad_prompts
        if args.heldout:
            from _common import heldout_prompts
            encoded = heldout_prompts(model.tokenizer, args.batch, args.prompt_length)
        else:
            lines = Path(args.prompts_file).read_text().splitlines() if args.prompts_file else ["def f("] * args.batch
            encoded = [model.encode(x) for x in lines[:args.batch]]
        prompts, lengths = pad_prompts(encoded)
        eos = tuple(cfg.eos_token_ids)
    else:
        cfg, params = _random_model("bidirectional", 0, 512, args.layers, args.hidden, max_pos, args.logits_shift)
        lengths = rng.integers(args.prompt_length // 2, args.prompt_length + 1, args.batch).astype(np.int32)
        prompts = rng.integers(0, cfg.vocab_size - 1, (args.batch, args.prompt_length)).astype(np.int32)
        eos = ()
    prompts, lengths = jnp.asarray(prompts), jnp.asarray(lengths)
    common = {"answer_length": args.answer_length, "eos_ids": eos, "key": jax.random.PRNGKey(0)}

    if not args.block_only and cfg.attention != "block":
        ref = None
        for name in args.rules.split(","):
            kw = {"threshold": args.threshold} if "threshold" in {f.name for f in
                                                                  dataclasses.fields(D.RULES[name])} else {}
            rule = D.make_rule(name, **kw)
            for cache in (("none", "prefix", "dual") if name in args.cache_rules.split(",") else ("none",)):
                out, sec = _timed(partial(D.diffusion_decode, cfg, params, prompts, lengths, rule=rule,
                                          block_length=args.block_length, cache=cache, **common), args.repeats)
                toks = np.asarray(out.tokens)
                if name == "greedy1" and cache == "none":
                    ref = toks
                if cache == "none":
                    no_cache = toks
                nfe = np.asarray(out.stats["nfe"])
                print(json.dumps({"rule": name, "cache": cache, "logits_shift": cfg.logits_shift,
                                  "nfe_mean": float(nfe.mean()),
                                  "tokens_per_forward": float(np.asarray(out.stats["tokens_per_forward"]).mean()),
                                  "match_greedy1": None if ref is None else float((toks == ref).all(1).mean()),
                                  "agree_no_cache": float((toks == no_cache).mean()),
                                  "match_no_cache": float((toks == no_cache).all(1).mean()),
                                  "seconds": round(sec, 4)}), flush=True)

    if args.no_block:
        return
    # block diffusion: exact cache vs recomputation
    if cfg.attention == "block":
        bcfg, bparams = cfg, params
    else:
        bcfg, bparams = _random_model("block", args.block_size, 512, args.layers, args.hidden, max_pos)
    rule = D.Threshold(args.threshold)
    res = {}
    for use_cache in (True, False):
        out, sec = _timed(partial(D.block_diffusion_decode, bcfg, bparams, prompts, lengths, rule=rule,
                                  use_cache=use_cache, **common), args.repeats)
        res[use_cache] = (np.asarray(out.tokens), sec, float(np.asarray(out.stats["nfe"]).mean()))
    print(json.dumps({"block_diffusion": True, "answer_length": args.answer_length,
                      "block_size": bcfg.block_size, "cached_seconds": round(res[True][1], 4),
                      "recompute_seconds": round(res[False][1], 4),
                      "speedup": round(res[False][1] / res[True][1], 3),
                      "same_tokens": bool((res[True][0] == res[False][0]).all()),
                      "nfe_cached": res[True][2], "nfe_recompute": res[False][2]}), flush=True)


if __name__ == "__main__":
    main()
