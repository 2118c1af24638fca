"""One verification forward of the embedded target over N tree nodes, per attention implementation: the
verify-cost curve the cost model and tree="auto" read, split by what the attention costs.

    python benchmarks/bench_verify_cost.py [--nodes 1,2,4,...,256 --batch-sizes 1,4 --impls xla,tree
                                            --trace DIR --json FILE]

The model forward alone (jaxdecode.models.forward, float32, a binary-ish tree, 256 committed tokens in
a 512-slot cache), jit-compiled, timed as calls queued back to back and blocked once (best of three
batches), so the figure is device time, not dispatch. attn_impl "xla" is the blockwise jnp form, "tree"
the Pallas kernel on GPU / TPU (the blockwise form on CPU); "step" is the engine's whole verification
(`speculative._verify_forward`: the tree's mask and positions built on the device, then the forward with
the backend's default attention), the curve `jaxdecode calibrate` times up to the drafter's tree size.
--trace DIR writes a jax.profiler trace of the largest N per impl (open it in Perfetto / TensorBoard).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import queued_us, write_result  # noqa: E402

import jaxdecode  # noqa: E402
from jaxdecode.model import embedded_model_path  # noqa: E402
from jaxdecode.models import advance, forward, init_cache  # noqa: E402
from jaxdecode.speculative import _verify_forward  # noqa: E402
from jaxdecode.tree import Tree, ancestor_mask  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--nodes", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--impls", default="step,tree,xla")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    target = jaxdecode.load(args.target or embedded_model_path("target"), dtype="float32")
    cfg, params = target.config, target.params
    nodes = [int(x) for x in args.nodes.split(",")]
    default_impl = "xla" if jax.default_backend() == "cpu" else "tree"  # what speculative_decode uses
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        for impl in args.impls.split(","):
            for n in nodes:
                cache = advance(init_cache(cfg, b, args.context + max(nodes)), jnp.full((b,), args.context))
                parents = jnp.broadcast_to(jnp.asarray(np.arange(n) // 2 - 1)[None], (b, n))
                toks = jnp.asarray(np.random.default_rng(n).integers(0, cfg.vocab_size, (b, n)), jnp.int32)
                pos = args.context + jnp.broadcast_to(jnp.arange(n)[None], (b, n))
                if impl == "step":  # the engine's verification: tree mask and positions built, then the forward
                    tree = Tree(tokens=toks, parents=parents, valid=jnp.ones((b, n), bool))
                    pending, active = toks[:, 0], jnp.ones((b,), bool)
                    step = jax.jit(lambda t, p, c: _verify_forward(cfg, params, t, p, c, active, (n,), default_impl)[0])
                    fn = lambda: step(tree, pending, cache)  # noqa: E731
                else:
                    mask = ancestor_mask(parents)
                    fn = lambda: forward(cfg, params, toks, pos, cache, mask, attn_impl=impl)[0]  # noqa: E731
                us = queued_us(fn, args.repeats)
                rows.append(dict(batch=b, impl=impl, nodes=n, us=us))
                print(f"batch {b} {impl:9s} {n:4d} nodes: {us / 1e3:8.3f} ms", flush=True)
                if args.trace and n == max(nodes) and b == 1:
                    with jax.profiler.trace(str(Path(args.trace) / impl)):
                        jax.block_until_ready([fn() for _ in range(5)])
    print("\n| batch | nodes | " + " | ".join(f"{i} (ms)" for i in args.impls.split(",")) + " |")
    print("|---" * (2 + len(args.impls.split(","))) + "|")
    for b in sorted({r["batch"] for r in rows}):
        for n in nodes:
            cells = [next(r["us"] for r in rows if r["batch"] == b and r["nodes"] == n and r["impl"] == i)
                     for i in args.impls.split(",")]
            print(f"| {b} | {n} | " + " | ".join(f"{c / 1e3:.3f}" for c in cells) + " |")
    write_result(dict(backend=jax.default_backend(), device=jax.devices()[0].device_kind, jax=jax.__version__,
                      args=vars(args), rows=rows), args.json)


if __name__ == "__main__":
    main()
