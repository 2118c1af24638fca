"""The Pallas kernels on the machine's accelerator: each compiled for real (not interpret mode), checked
against its jnp reference on fresh random inputs, then timed beside the reference and the XLA form.

    python benchmarks/bench_kernels.py [--sections tree,constrained --json FILE]

tree         tree attention (jaxdecode.kernels.tree_attention): the Pallas kernel vs the blockwise jnp
             form (what CPU runs) vs the dense reference, at the embedded target's attention shape
             (6 query / 2 KV heads, hd 64) and a 7B-like one (32 / 8, hd 128), batch 1 and 4, committed
             prefix of 3/4 of the cache, N tree nodes (a random tree) from 1 to 256; float32 for the
             embedded shape (as the benchmarks decode it), bfloat16 for the 7B-like one. Correctness
             first: |kernel - reference| on every timed shape. The 7B-like shape at batch 1 only. A
             Gemma-2-like shape (head_dim 256, query_pre_attn_scalar's scale, soft-capped scores, a
             sliding window) in bfloat16, batch 1.
constrained  the constrained top-k step (jaxdecode.kernels.constrained): kernel vs reference, mask form
             and candidates form (64 slots), V = 32768 at 1 and 64 rows, and V = 4096 at 8 rows.

On CPU the kernels only run in interpret mode, which is slow and says nothing about speed: there the
script checks a few tiny shapes in interpret mode and times nothing (use it on a GPU / TPU).
Timings: per call, --repeats calls queued back to back after two warm-ups, blocked once at the end (best
of three such batches), so they show device time rather than the host's dispatch; compile time is
excluded. The tree kernel is also timed at each --block-m (query rows per program) where the shape has
more query rows than that (at the first batch size): the default's choice is checked on the machine.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import queued_us, write_result  # noqa: E402

from jaxdecode.kernels.constrained import constrained_topk_pallas, constrained_topk_reference  # noqa: E402
from jaxdecode.kernels.tree_attention import (tree_attention_blockwise, tree_attention_pallas,  # noqa: E402
                                              tree_attention_reference)
from jaxdecode.tree import ancestor_mask, depths  # noqa: E402

ACCEL = jax.default_backend() in ("gpu", "tpu")


def random_tree(rng, n):
    """Ancestor mask bool[n, n] and depth of a random tree (node i's parent is a random earlier node, or
    the root's slot -1)."""
    parents = jnp.asarray([-1] + [int(rng.integers(-1, i)) for i in range(1, n)], jnp.int32)
    return np.asarray(ancestor_mask(parents)), np.asarray(depths(parents))


def tree_inputs(seed, b, n, h, kv, s, hd, dtype):
    rng = np.random.default_rng(seed)
    anc, depth = random_tree(rng, n)
    lengths = np.full((b,), (3 * s) // 4 - n, np.int32) - rng.integers(0, 8, size=b).astype(np.int32)
    return dict(q=jnp.asarray(rng.normal(size=(b, n, h, hd)), dtype),
                k_cache=jnp.asarray(rng.normal(size=(b, kv, s, hd)), dtype),
                v_cache=jnp.asarray(rng.normal(size=(b, kv, s, hd)), dtype),
                lengths=jnp.asarray(lengths), tree_mask=jnp.asarray(np.broadcast_to(anc, (b, n, n))),
                q_positions=jnp.asarray(lengths[:, None] + depth[None, :] - 1, jnp.int32))


def _call(fn, inp, **kw):
    return fn(inp["q"], inp["k_cache"], inp["v_cache"], inp["lengths"], inp["tree_mask"],
              q_positions=inp["q_positions"], **kw)


# the embedded target decodes in float32 in the benchmarks; a 7B model would serve in bfloat16; Gemma 2's
# 9B shape: head_dim 256, scores scaled by query_pre_attn_scalar**-0.5 and soft-capped at 50, and a
# sliding-window layer (4096 keys in the real model; 1024 here, so the window cuts the 3/4 prefix)
TREE_SHAPES = {"embedded": (6, 2, 64, 512, jnp.float32, (1, 4)), "7b-like": (32, 8, 128, 4096, jnp.bfloat16, (1,)),
               "gemma2-like": (16, 8, 256, 2048, jnp.bfloat16, (1,))}
TREE_OPTIONS = {"gemma2-like": dict(sm_scale=256 ** -0.5, softcap=50.0, window=1024)}


def bench_tree(args):
    rows = []
    names = args.shapes.split(",")
    unknown = sorted(set(names) - set(TREE_SHAPES))
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; choose from {sorted(TREE_SHAPES)}")
    if ACCEL:
        shapes = [(name, *TREE_SHAPES[name]) for name in names]
        nodes = [int(x) for x in args.nodes.split(",")]
        block_ms = [None] + [int(x) for x in args.block_m.split(",")] if args.block_m else [None]
    else:  # a plain tiny shape, and the Gemma options (head_dim 256 is slow in interpret mode: 32 here)
        shapes, nodes, block_ms = [("tiny", 4, 2, 16, 64, jnp.float32, (2,)),
                                   ("tiny-softcap", 4, 2, 32, 64, jnp.float32, (1,))], (1, 7), (None,)
    for name, h, kv, hd, s, dtype, batches in shapes:
        opts = TREE_OPTIONS.get(name, dict(softcap=20.0, sm_scale=0.3, window=24) if name == "tiny-softcap" else {})
        # block_m is static: one jitted kernel per value (None: the default plan)
        pallas_at = {bm: jax.jit(functools.partial(tree_attention_pallas, interpret=not ACCEL, **opts,
                                                   **({} if bm is None else {"block_m": bm}))) for bm in block_ms}
        blockwise = jax.jit(functools.partial(tree_attention_blockwise, **opts))
        reference = jax.jit(functools.partial(tree_attention_reference, **opts))
        for b in batches:
            sweep = block_ms if b == batches[0] else [None]
            for n, block_m in [(n, bm) for n in nodes for bm in sweep if bm is None or n * h // kv > bm]:
                if n + 8 > (3 * s) // 4:  # prefix + tree end at 3/4 of the cache: the prefix would be negative
                    if block_m is None:  # (the H200 run of 2026-12-04 timed 512 nodes in a 512-slot cache so)
                        print(f"skip {name}, {n} nodes: prefix and tree end at 3/4 of a {s}-slot cache, so a tree "
                              f"of {n} leaves no prefix", flush=True)
                    continue
                inp = tree_inputs(len(rows), b, n, h, kv, s, hd, dtype)
                want = np.asarray(_call(reference, inp), np.float32)
                row = dict(shape=name, dtype=jnp.dtype(dtype).name, batch=b, nodes=n, heads=h, kv_heads=kv,
                           head_dim=hd, cache=s, block_m=block_m, **opts)
                pallas = pallas_at[block_m]
                try:
                    got = np.asarray(_call(pallas, inp), np.float32)
                    row["max_abs_err"] = float(np.max(np.abs(got - want)))
                    row["rel_err"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                    row["ok"] = bool(np.isfinite(got).all() and row["rel_err"] < (2e-3 if dtype == jnp.float32
                                                                                  else 2e-2))
                except Exception as e:  # noqa: BLE001 — report the failure and go on with the sweep
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    row["ok"] = False
                if ACCEL and "error" not in row:
                    row["pallas_us"] = queued_us(lambda: _call(pallas, inp), args.repeats)
                    if block_m is None:  # the jnp forms once per shape, beside the default kernel
                        for label, fn in (("blockwise", blockwise), ("reference", reference)):
                            row[f"{label}_us"] = queued_us(lambda fn=fn: _call(fn, inp), args.repeats)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def bench_constrained(args):
    rows = []
    if ACCEL:
        cases = [(4096, 8, "mask")] + [(32768, r, mode) for r in (1, 64) for mode in ("mask", "candidates")]
    else:
        cases = [(512, 4, "mask"), (512, 4, "candidates")]
    k, width = 8, 64
    pallas = jax.jit(lambda x, **kw: constrained_topk_pallas(x, k, interpret=not ACCEL, **kw))
    reference = jax.jit(lambda x, **kw: constrained_topk_reference(x, k, **kw))
    for i, (v, r, mode) in enumerate(cases):
        rng = np.random.default_rng(100 + i)
        logits = jnp.asarray(rng.normal(size=(r, v)) * 3, jnp.float32)
        if mode == "mask":
            kw = dict(mask=jnp.asarray(rng.random((r, v)) < 0.3))
        else:
            cand = rng.integers(0, v, size=(r, width)).astype(np.int32)
            cand[:, -3:] = -1  # empty slots
            kw = dict(candidates=jnp.asarray(cand))
        want_v, want_s = (np.asarray(x) for x in reference(logits, **kw))
        row = dict(vocab=v, rows=r, mode=mode, k=k, width=width if mode == "candidates" else None)
        try:
            got_v, got_s = (np.asarray(x) for x in pallas(logits, **kw))
            row["max_abs_err"] = float(np.max(np.abs(got_v - want_v)))
            row["slots_equal"] = bool((got_s == want_s).all())
            row["ok"] = row["slots_equal"] and row["max_abs_err"] < 1e-4
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            row["ok"] = False
        if ACCEL and "error" not in row:
            for label, fn in (("pallas", pallas), ("reference", reference)):
                row[f"{label}_us"] = queued_us(lambda fn=fn: fn(logits, **kw), args.repeats)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="tree,constrained")
    ap.add_argument("--nodes", default="1,16,64,256")
    ap.add_argument("--block-m", default="16,64",
                    help="also time the tree kernel at these query rows per program (where a shape has more rows)")
    ap.add_argument("--shapes", default="embedded,7b-like,gemma2-like", help="tree attention shapes to run, in this order")
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    result = dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
                  jax=jax.__version__, measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
    sections = args.sections.split(",")
    if "tree" in sections:
        result["tree"] = bench_tree(args)
    if "constrained" in sections:
        result["constrained"] = bench_constrained(args)
    bad = [r for sec in ("tree", "constrained") for r in result.get(sec, []) if not r["ok"]]
    print(f"{len(bad)} failing shapes" if bad else "all kernel outputs match their references")
    write_result(result, args.json)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
