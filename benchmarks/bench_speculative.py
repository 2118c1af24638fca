"""Speculative decoding on the embedded models: tau, target calls per token, wall-time speedup.

    python benchmarks/bench_speculative.py [--prompts 8 --new 128 --out BENCH.json]

Everything is measured side by side in one run on held-out prompts (CPython stdlib files in the
held-out split of the embedded models' corpus): jaxdecode autoregressive greedy / sampling is the
baseline of each temperature; every speculative configuration reports tau (tokens per verification
call), target calls per token, tokens/s and the speedup over the baseline, and whether its greedy
output equals the baseline token for token. The same weights in transformers: plain greedy
`generate`, assisted generation (`assistant_model=`) and prompt lookup
(`prompt_lookup_num_tokens=`), tokens/s and token equality. Finally the verify-cost curve: one
verification forward's time against the number of tree nodes. Compile time is excluded (each
configuration runs once before it is timed).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import jax
import numpy as np

import jaxdecode
from jaxdecode.api import embedded_model_path
from jaxdecode.autoregressive import decode, pad_prompts
from jaxdecode.drafters import make_drafter
from jaxdecode.sampling import SamplerConfig
from jaxdecode.speculative import speculative_decode
from jaxdecode.verifiers import get_verifier
from _common import heldout_prompts, timed


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None, help="target model dir (default: embedded target)")
    ap.add_argument("--draft", default=None, help="draft model dir (default: embedded draft)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--torch-device", default="cpu", help="where transformers runs (cpu, cuda)")
    ap.add_argument("--verify-curve", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    args = ap.parse_args(argv)

    target = jaxdecode.load(args.target or embedded_model_path("target"), dtype="float32")
    draft = jaxdecode.load(args.draft or embedded_model_path("draft"), dtype="float32")
    prompts = heldout_prompts(target.tokenizer, args.prompts, args.prompt_tokens)
    cfg = target.config
    print(f"target {cfg.num_parameters() / 1e6:.1f} M, draft {draft.config.num_parameters() / 1e6:.1f} M; "
          f"{len(prompts)} held-out prompts x {args.prompt_tokens} tokens, {args.new} new tokens, batch "
          f"{args.batch}; jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores, "
          f"{platform.machine()}", flush=True)
    batches = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    results = {"args": vars(args), "rows": [], "hf": [], "verify_curve": []}

    def run_all(fn):
        toks, calls, steps, secs = [], 0, 0, 0.0
        for batch in batches:
            pt, pl = pad_prompts(batch)
            (out, stats), s = timed(lambda: fn(pt, pl), args.repeats)
            secs += s
            toks += [list(np.asarray(out)[i]) for i in range(len(batch))]
            calls += int(stats["calls"])
            steps += int(stats["steps"])
        return toks, calls, steps, secs

    for temperature in (0.0, 0.7):
        sampler = SamplerConfig(temperature=temperature)
        key = jax.random.PRNGKey(0)

        def baseline(pt, pl):
            out = decode(cfg, target.params, pt, pl, max_new_tokens=args.new, sampler=sampler, key=key,
                         method="greedy" if temperature == 0 else "sample")
            jax.block_until_ready(out.tokens)
            return out.tokens, {"calls": out.stats["target_calls"], "steps": out.stats["target_calls"]}

        base_toks, base_calls, _, base_s = run_all(baseline)
        n_tok = args.new * len(prompts)
        results["rows"].append(dict(temperature=temperature, method="autoregressive", tau=1.0,
                                    calls_per_token=base_calls / n_tok, tok_s=n_tok / base_s,
                                    speedup=1.0, equal_to_baseline=True))
        print(f"\nT={temperature}: autoregressive {n_tok / base_s:.1f} tok/s", flush=True)
        configs = [("draft_lm", "chain:4", {}), ("draft_lm", "chain:6", {}), ("draft_lm", "static:4,2,2,1", {}),
                   ("draft_lm", "eagle:depth=6,topk=4,total=24", {}),
                   ("draft_lm", "dyspec:num_nodes=24,topk=4", {}), ("prompt_lookup", "chain:3", {}),
                   ("prompt_lookup", "chain:6", {}), ("prompt_lookup", "chain:8", {"lengths": (1, 3, 8)}),
                   ("token_recycling", None, {}), ("aded", None, {})]
        for drafter_name, tree, kw in configs:
            try:
                drafter = make_drafter(drafter_name, target, draft=draft, tree=tree, temperature=temperature, **kw)
            except (ImportError, ValueError) as e:
                print(f"  skip {drafter_name} {tree}: {e}")
                continue
            vname = "greedy" if temperature == 0 else {"point": "point_mass", "sample": "chain",
                                                       "topk": "topk", "argmax": "topk"}[drafter.child_rule]
            verifiers = [vname] + (["block"] if vname == "chain" else [])
            for vn in verifiers:
                verifier = get_verifier(vn)

                def spec(pt, pl):
                    out = speculative_decode(cfg, target.params, drafter, pt, pl, max_new_tokens=args.new,
                                             verifier=verifier, sampler=sampler, key=key)
                    jax.block_until_ready(out.tokens)
                    return out.tokens, {"calls": out.stats["target_calls"],
                                        "steps": np.sum(out.stats["verify_calls"])}

                toks, calls, steps, secs = run_all(spec)
                opts = "".join(f" {k}={v}" for k, v in kw.items()).replace(" ", "")
                label = f"{drafter_name} {tree or ''}{' ' + opts if opts else ''} / {vn}".replace("  ", " ")
                row = dict(temperature=temperature, method=label,
                           tau=n_tok / steps, calls_per_token=calls / n_tok, tok_s=n_tok / secs,
                           speedup=base_s / secs, equal_to_baseline=toks == base_toks)
                results["rows"].append(row)
                print(f"  {row['method']:48s} tau {row['tau']:.2f}  calls/token {row['calls_per_token']:.3f}  "
                      f"{row['tok_s']:.1f} tok/s  speedup {row['speedup']:.2f}x  "
                      f"{'same tokens' if row['equal_to_baseline'] else ('differs' if temperature == 0 else 'sampled')}",
                      flush=True)

    if not args.skip_hf:
        results["hf"] = bench_transformers(args, prompts, results)
    results["verify_curve"] = verify_curve(target, [int(x) for x in args.verify_curve.split(",")])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, default=float)
    print_tables(results)
    return results


def bench_transformers(args, prompts, results):
    """transformers greedy / assisted / prompt-lookup generation on the same weights (batch 1)."""
    import torch
    import transformers as tf
    torch.set_num_threads(getattr(args, "torch_threads", None) or os.cpu_count())
    device = torch.device(getattr(args, "torch_device", None) or "cpu")
    tgt = tf.AutoModelForCausalLM.from_pretrained(args.target or embedded_model_path("target"),
                                                  dtype=torch.float32).eval().to(device)
    dft = tf.AutoModelForCausalLM.from_pretrained(args.draft or embedded_model_path("draft"),
                                                  dtype=torch.float32).eval().to(device)

    def synced(fn):  # CUDA runs asynchronously: the timed call ends when the device is done
        def call():
            out = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return out
        return call
    jd_greedy = None
    target = jaxdecode.load(args.target or embedded_model_path("target"), dtype="float32")
    pt, pl = pad_prompts(prompts)
    ref = np.asarray(decode(target.config, target.params, pt, pl, max_new_tokens=args.new,
                            sampler=SamplerConfig(temperature=0.0), method="greedy").tokens)
    rows = []
    for name, kw in [("transformers greedy", {}), ("transformers assisted (draft model)", {"assistant_model": dft}),
                     ("transformers prompt lookup", {"prompt_lookup_num_tokens": 10})]:
        total, same = 0.0, True
        for i, p in enumerate(prompts):
            ids = torch.tensor([p], device=device)
            gen = lambda: tgt.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=args.new, min_new_tokens=args.new, eos_token_id=None,
                                       pad_token_id=0, **kw)
            with torch.no_grad():
                out, s = timed(synced(gen), args.repeats)
            total += s
            same &= bool(np.array_equal(out[0, len(p):].cpu().numpy(), ref[i]))
        n_tok = args.new * len(prompts)
        rows.append(dict(method=name, tok_s=n_tok / total, equal_to_jaxdecode_greedy=same))
        print(f"  {name:40s} {n_tok / total:.1f} tok/s  {'same tokens' if same else 'differs'}", flush=True)
    del jd_greedy
    return rows


def verify_curve(target, sizes):
    """Time of one target verification forward over a chain-shaped tree of N nodes (prefix 128)."""
    import jax.numpy as jnp
    from jaxdecode.models import advance, forward, init_cache
    from jaxdecode.tree import ancestor_mask
    cfg, params = target.config, target.params
    out = []
    for n in sizes:
        cache = advance(init_cache(cfg, 1, 512), jnp.array([128]))
        parents = jnp.asarray(np.arange(n) // 2 - 1)[None]  # a binary-ish tree
        toks = jnp.zeros((1, n), jnp.int32)
        pos = 128 + jnp.arange(n)[None]
        mask = ancestor_mask(parents)
        f = lambda: jax.block_until_ready(forward(cfg, params, toks, pos, cache, mask)[0])
        _, s = timed(f, 20)
        out.append(dict(nodes=n, ms=1000 * s))
        print(f"  verify {n:4d} nodes: {1000 * s:.2f} ms", flush=True)
    return out


def print_tables(results):
    print("\n| T | method | tau | target calls / token | tok/s | speedup vs AR | greedy output == AR |")
    print("|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        eq = ("yes" if r["equal_to_baseline"] else "NO") if r["temperature"] == 0 else "n/a (sampled)"
        print(f"| {r['temperature']} | {r['method']} | {r['tau']:.2f} | {r['calls_per_token']:.3f} | "
              f"{r['tok_s']:.1f} | {r['speedup']:.2f}x | {eq} |")
    if results["hf"]:
        print("\n| transformers (same weights, batch 1, greedy) | tok/s | tokens == jaxdecode greedy |")
        print("|---|---|---|")
        for r in results["hf"]:
            print(f"| {r['method']} | {r['tok_s']:.1f} | {r['equal_to_jaxdecode_greedy']} |")
    print("\n| tree nodes | verify forward (ms) |")
    print("|---|---|")
    for r in results["verify_curve"]:
        print(f"| {r['nodes']} | {r['ms']:.2f} |")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
