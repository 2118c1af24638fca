"""A diffusion LM as the speculative drafter (drafter 'dllm') against prompt lookup and plain decoding,
on the embedded target and held-out prompts.

    python benchmarks/bench_dllm_drafter.py --draft /work/runs/dllm-i12/export \
        [--trees chain:4,chain:8 --windows 64,128 --steps 1 --prompts 8 --new 128 --batch 1 --out R.json]

Per temperature (0: greedy verifier; 0.7: the chain verifier, lossless for the dLLM's sampled chain):
autoregressive decoding is the baseline; every configuration reports tau (tokens per verification),
target calls per token, tokens/s, the speedup over the baseline and (greedy) whether its output equals
the baseline's. Adaptive speculation is off (every step verifies the whole chain), so the rows compare
the drafters themselves. Compile time is excluded (each configuration runs once before it is timed).
`--draft self`: the target's own weights as an (untrained) Dream-style dLLM with a MASK id appended,
to check that the script runs where no dLLM is trained; its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecode
from jaxdecode.api import embedded_model_path
from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters import make_drafter
from jaxdecode.model import Model
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import speculative_decode
from jaxdecode.verifiers import get_verifier
from _common import heldout_prompts, timed


def self_dllm(target) -> Model:
    """The target as a Dream-style dLLM (bidirectional, logits shift 1) with a MASK id appended."""
    cfg = target.config
    p = dict(target.params)
    p["embed"] = jnp.concatenate([p["embed"], p["embed"].mean(0, keepdims=True)], axis=0)
    if "lm_head" in p and not cfg.tie_word_embeddings:
        p["lm_head"] = jnp.concatenate([p["lm_head"], p["lm_head"].mean(1, keepdims=True)], axis=1)
    return Model(cfg.replace(vocab_size=cfg.vocab_size + 1, attention="bidirectional", logits_shift=1,
                             mask_token_id=cfg.vocab_size), p)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None, help="target model dir (default: embedded target)")
    ap.add_argument("--draft", required=True, help="dLLM directory (same tokenizer as the target), or 'self'")
    ap.add_argument("--trees", default="chain:4,chain:8")
    ap.add_argument("--windows", default="64,128", help="committed tokens the dLLM sees per step")
    ap.add_argument("--steps", default="1", help="dLLM forwards per draft (comma list)")
    ap.add_argument("--lookup", default="chain:4,chain:8", help="prompt lookup trees to compare with")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    args = ap.parse_args(argv)

    target = jaxdecode.load(args.target or embedded_model_path("target"), dtype="float32")
    dllm = self_dllm(target) if args.draft == "self" else jaxdecode.load(args.draft, dtype="float32")
    prompts = heldout_prompts(target.tokenizer, args.prompts, args.prompt_tokens)
    cfg = target.config
    print(f"target {cfg.num_parameters() / 1e6:.1f} M, dLLM {dllm.config.num_parameters() / 1e6:.1f} M "
          f"({dllm.config.attention}, logits_shift {dllm.config.logits_shift}); {len(prompts)} held-out prompts "
          f"x {args.prompt_tokens} tokens, {args.new} new, batch {args.batch}; jax {jax.__version__} on "
          f"{jax.devices()[0].platform}, {os.cpu_count()} cores, {platform.machine()}", flush=True)
    batches = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    n_tok = args.new * len(prompts)
    rows = []

    def run_all(fn):
        toks, calls, steps, secs = [], 0, 0, 0.0
        for batch in batches:
            pt, pl = pad_prompts(batch)
            (out, st), s = timed(lambda: fn(pt, pl), args.repeats)
            secs += s
            toks += [list(np.asarray(out)[i]) for i in range(len(batch))]
            calls, steps = calls + int(st[0]), steps + int(st[1])
        return toks, calls, steps, secs

    configs = [("prompt_lookup", t, {}) for t in args.lookup.split(",") if t]
    configs += [("dllm", t, dict(window=int(w), steps=int(s))) for t in args.trees.split(",")
                for w in args.windows.split(",") for s in args.steps.split(",")]
    for temperature in (float(t) for t in args.temperatures.split(",")):
        sampler = SamplerConfig(temperature=temperature)
        key = jax.random.PRNGKey(0)

        def baseline(pt, pl):
            out = decode(cfg, target.params, pt, pl, max_new_tokens=args.new, sampler=sampler, key=key,
                         method="greedy" if temperature == 0 else "sample")
            jax.block_until_ready(out.tokens)
            return out.tokens, (out.stats["target_calls"], out.stats["target_calls"])

        base_toks, base_calls, _, base_s = run_all(baseline)
        rows.append(dict(temperature=temperature, method="autoregressive", tau=1.0, calls_per_token=base_calls / n_tok,
                         tok_s=n_tok / base_s, speedup=1.0, equal_to_baseline=True))
        print(f"\nT={temperature}: autoregressive {n_tok / base_s:.1f} tok/s", flush=True)
        for name, tree, kw in configs:
            drafter = make_drafter(name, target, draft=dllm if name == "dllm" else None, tree=tree,
                                   temperature=temperature, **kw)
            vname = "greedy" if temperature == 0 else ("point_mass" if drafter.child_rule == "point" else "chain")
            verifier = get_verifier(vname)

            def spec(pt, pl):
                out = speculative_decode(cfg, target.params, drafter, pt, pl, max_new_tokens=args.new,
                                         verifier=verifier, sampler=sampler, key=key)
                jax.block_until_ready(out.tokens)
                return out.tokens, (out.stats["target_calls"], np.sum(out.stats["verify_calls"]))

            toks, calls, steps, secs = run_all(spec)
            opts = ",".join(f"{k}={v}" for k, v in kw.items())
            row = dict(temperature=temperature, method=f"{name} {tree} {opts} / {vname}".replace("  ", " "),
                       tau=n_tok / steps, calls_per_token=calls / n_tok, tok_s=n_tok / secs,
                       speedup=base_s / secs, equal_to_baseline=toks == base_toks)
            rows.append(row)
            print(f"  {row['method']:52s} tau {row['tau']:.2f}  calls/token {row['calls_per_token']:.3f}  "
                  f"{row['tok_s']:.1f} tok/s  speedup {row['speedup']:.2f}x"
                  + ("" if temperature else f"  {'same tokens' if row['equal_to_baseline'] else 'DIFFERS'}"),
                  flush=True)
    print("\n| T | method | tau | target calls / token | tok/s | speedup vs AR | greedy output == AR |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        eq = ("yes" if r["equal_to_baseline"] else "NO") if r["temperature"] == 0 else "n/a (sampled)"
        print(f"| {r['temperature']} | {r['method']} | {r['tau']:.2f} | {r['calls_per_token']:.3f} | "
              f"{r['tok_s']:.1f} | {r['speedup']:.2f}x | {eq} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2, default=float)
    return rows


if __name__ == "__main__":
    main()
