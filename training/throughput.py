"""Training throughput of the LM train step (tokens/s), on whatever device JAX has.

    python -m jaxdecode.training.throughput --size small --batch-size 8 --seq-len 256 [--bf16]

Times the same jitted step the trainer runs (forward, backward, clipping, AdamW) on random tokens,
after one compile-and-warm-up step; prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np
from flax import nnx

from jaxdecode.models import init_params

from .lm import CausalLM, lm_loss, model_config
from .trainer import TrainConfig, _train_step_fn, make_mesh, make_optimizer


def measure(size: str, batch_size: int, seq_len: int, compute_dtype: str = "float32",
            vocab_size: int = 4096, steps: int = 3) -> dict:
    config = model_config(size, vocab_size, max(512, seq_len))
    module = CausalLM(config, init_params(config, jax.random.PRNGKey(0)), compute_dtype)
    tcfg = TrainConfig(steps=100, warmup_steps=10, data_parallel=1)
    optimizer = nnx.Optimizer(module, make_optimizer(tcfg), wrt=nnx.Param)
    graphdef, state = nnx.split((module, optimizer))
    mesh = make_mesh(1)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shardings = jax.tree.map(lambda _: rep, state)
    state = jax.device_put(state, shardings)
    step = _train_step_fn(graphdef, lm_loss, mesh, False, shardings, rep)
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, vocab_size, (batch_size, seq_len + 1)).astype(np.int32),
             "weights": np.ones((batch_size, seq_len), np.float32)}
    state, m = step(state, batch, None)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = step(state, batch, None)
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t0) / steps
    return {"size": size, "parameters": config.num_parameters(), "batch_size": batch_size,
            "seq_len": seq_len, "compute_dtype": compute_dtype, "device": jax.devices()[0].device_kind,
            "seconds_per_step": dt, "tokens_per_s": batch_size * seq_len / dt}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxdecode.training.throughput", description=__doc__)
    ap.add_argument("--size", default="small")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args(argv)
    print(json.dumps(measure(a.size, a.batch_size, a.seq_len, "bfloat16" if a.bf16 else "float32",
                             steps=a.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
