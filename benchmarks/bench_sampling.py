"""One sampling step, old (stable sort of the whole vocabulary) vs new (lax.top_k, capped nucleus), one run.

    python benchmarks/bench_sampling.py [--vocabs 4096,32000 --batch 8 --nodes 25 --repeats 50 --json FILE]

The step is what every sampling decoder runs per position: temperature, top-k / top-p truncation,
log-softmax, one categorical draw. Shapes: a decode step [B, V] and a speculative verification
[B, N+1, V] (N = --nodes tree nodes). Configurations: top_k=50, top_k=50 + top_p=0.9, and top_p=0.9
alone on peaked logits (the nucleus fits in TOP_P_CAP tokens: the capped branch) and on flat ones (the
nucleus is wider: the new path falls back to the full sort and pays the capped attempt too). Both
paths are checked to keep the same tokens. Compile time is excluded; times are medians of old and
new calls interleaved.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

from _common import write_result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocabs", default="4096,32000")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=25, help="tree nodes N of the [B, N+1, V] shape")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxdecode.sampling import TOP_P_CAP, _truncation_mask, truncation_mask_sorted

    def step_fn(mask_fn, top_k, top_p, temperature=0.8):
        @jax.jit
        def step(key, logits):  # process_logits' truncation branch, then one draw per position
            x = logits / temperature
            x = jnp.where(mask_fn(x, top_k, top_p), x, -jnp.inf)
            return jax.random.categorical(key, jax.nn.log_softmax(x, axis=-1), axis=-1)
        return step

    def timed(old_step, new_step, key, logits):
        """Median seconds of each, the two interleaved so that a load change hits both alike."""
        jax.block_until_ready((old_step(key, logits), new_step(key, logits)))  # compile
        times = {old_step: [], new_step: []}
        for _ in range(args.repeats):
            for step in (old_step, new_step):
                t0 = time.perf_counter()
                jax.block_until_ready(step(key, logits))
                times[step].append(time.perf_counter() - t0)
        return statistics.median(times[old_step]), statistics.median(times[new_step])

    # (name, top_k, top_p, logits): "peaked" adds +11 to 16 random tokens per position, like a confident
    # model (the 0.9 nucleus lies among them); "flat" is N(0, 0.3^2) logits (the nucleus is most of V).
    configs = [("top_k=50", 50, 1.0, "peaked"), ("top_k=50 top_p=0.9", 50, 0.9, "peaked"),
               ("top_p=0.9 peaked", 0, 0.9, "peaked"), ("top_p=0.9 flat", 0, 0.9, "flat")]
    rng = np.random.default_rng(0)
    key = jax.random.PRNGKey(0)
    rows = []
    for v in [int(x) for x in args.vocabs.split(",")]:
        for shape_name, shape in (("[B, V]", (args.batch, v)), ("[B, N+1, V]", (args.batch, args.nodes + 1, v))):
            flat = rng.normal(size=shape).astype(np.float32)
            peaked = 2 * flat
            boost = rng.random(shape).argsort(axis=-1)[..., :16]
            np.put_along_axis(peaked, boost, np.take_along_axis(peaked, boost, axis=-1) + 11.0, axis=-1)
            for name, top_k, top_p, kind in configs:
                logits = jnp.asarray(peaked if kind == "peaked" else 0.3 * flat)
                same = bool(jnp.all(jax.jit(lambda x: _truncation_mask(x / 0.8, top_k, top_p))(logits)
                                    == jax.jit(lambda x: truncation_mask_sorted(x / 0.8, top_k, top_p))(logits)))
                old, new = timed(step_fn(truncation_mask_sorted, top_k, top_p),
                                 step_fn(_truncation_mask, top_k, top_p), key, logits)
                rows.append(dict(vocab=v, shape=shape_name, config=name, old_ms=round(old * 1e3, 4),
                                 new_ms=round(new * 1e3, 4), speedup=round(old / new, 2), same_tokens_kept=same))
                print(f"V={v:6d} {shape_name:12s} {name:20s} old {old * 1e3:9.3f} ms  new {new * 1e3:9.3f} ms  "
                      f"{old / new:6.2f}x  {'same mask' if same else 'MASKS DIFFER'}", flush=True)
    result = dict(bench="sampling_step", backend=jax.default_backend(), device=str(jax.devices()[0]),
                  jax=jax.__version__, machine=platform.machine(), batch=args.batch, nodes=args.nodes,
                  top_p_cap=TOP_P_CAP, repeats=args.repeats, rows=rows)
    write_result(result, args.json)

if __name__ == "__main__":
    main()
