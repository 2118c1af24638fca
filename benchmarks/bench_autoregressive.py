"""Greedy decoding throughput: jaxdecode vs transformers (PyTorch) on the same saved model, one run.

    python benchmarks/bench_autoregressive.py [--layers 8 --hidden 512 --vocab 8192 --new 64]

Both decode the same random Llama checkpoint (saved with save_pretrained, loaded by each library),
batch 1 and 8, prompts of 32 tokens, no EOS. jaxdecode's jit compile time is reported apart: the
timed figures are steady-state medians of several runs. Also checks that the tokens are equal.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import numpy as np
from _common import median_seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()

    import jax
    import torch
    import transformers as tf

    from jaxdecode.autoregressive import decode
    from jaxdecode.models import load_params
    from jaxdecode.sampling import SamplerConfig

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=int(args.hidden * 2.75), num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=1024, initializer_range=0.1)
    hf = tf.LlamaForCausalLM(cfg).eval()
    ckpt = tempfile.mkdtemp(prefix="bench_ar_")
    hf.save_pretrained(ckpt)
    hf = tf.LlamaForCausalLM.from_pretrained(ckpt).eval()
    config, params = load_params(ckpt)
    n_params = sum(p.numel() for p in hf.parameters())
    print(f"model: {args.layers} layers, d={args.hidden}, vocab {args.vocab}, {n_params / 1e6:.1f} M params; "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), {os.cpu_count()} cores, {platform.processor() or platform.machine()}")

    rows = []
    rng = np.random.RandomState(0)
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = rng.randint(1, args.vocab, size=(batch, args.prompt)).astype(np.int32)
        lengths = np.full((batch,), args.prompt, np.int32)

        def run_jax():
            out = decode(config, params, prompts, lengths, max_new_tokens=args.new,
                         sampler=SamplerConfig(temperature=0.0), method="greedy")
            return jax.block_until_ready(out.tokens)

        t0 = time.perf_counter()
        jax_tokens = np.asarray(run_jax())
        first = time.perf_counter() - t0
        jax_s = median_seconds(run_jax, args.repeats)
        compile_s = max(first - jax_s, 0.0)

        ids = torch.tensor(prompts, dtype=torch.long)

        def run_torch():
            with torch.no_grad():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=args.new, min_new_tokens=args.new,
                                   eos_token_id=None, pad_token_id=0)

        hf_tokens = run_torch()[:, args.prompt:].numpy()  # warm-up, and the tokens to compare
        hf_s = median_seconds(run_torch, args.repeats)
        n = batch * args.new
        row = dict(batch=batch, new_tokens=n, jaxdecode_tok_s=n / jax_s, transformers_tok_s=n / hf_s,
                   ratio=hf_s / jax_s, jax_compile_s=compile_s,
                   tokens_equal=bool(np.array_equal(jax_tokens, hf_tokens)))
        rows.append(row)
        print(json.dumps(row))

    print("\n| batch | jaxdecode tok/s | transformers tok/s | ratio | jit compile (s) | same tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['jaxdecode_tok_s']:.1f} | {r['transformers_tok_s']:.1f} | "
              f"{r['ratio']:.2f}x | {r['jax_compile_s']:.1f} | {r['tokens_equal']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
