"""How many steps does the adaptive policy price a batch of level rows at, against a simulation of the
batch (it ends when its last row does)? The policy's pricing (`adaptive._width_terms`, the batch's
priced steps = the max over its rows) with `batch_spread` 1 and 0 (the default, the max of the
means), for chains of w nodes each accepted with probability a given its parent.

    python benchmarks/bench_batch_spread.py [--remaining 64 --trials 4000]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result  # noqa: E402

from jaxdecode import adaptive  # noqa: E402


def simulated_steps(a: float, w: int, rows: int, remaining: int, trials: int, seed: int = 0) -> float:
    """E[steps until every row has committed `remaining` tokens]: each step a row commits 1 + the
    leading run of accepted nodes among w, each accepted with probability a."""
    rng = np.random.default_rng(seed)
    tokens, steps = np.zeros((trials, rows)), np.zeros((trials, rows))
    while (tokens < remaining).any():
        going = tokens < remaining
        accepted = np.cumprod(rng.random((trials, rows, w)) < a, axis=2).sum(axis=2)
        tokens += going * (1 + accepted)
        steps += going
    return float(steps.max(axis=1).mean())


def priced_steps(a: float, w: int, rows: int, remaining: int, spread: float) -> float:
    policy = adaptive.AdaptivePolicy(widths=(0, w), prior=a, min_reach=0.0, batch_spread=spread)
    state = adaptive.init_state(policy, rows, w, w, np.arange(w, dtype=np.int32) - 1, is_chain=True)
    values = adaptive._node_values(policy, state, state.parents, state.shaped)
    costs = jnp.zeros((5,), jnp.float32)
    _, steps, _ = adaptive._width_terms(policy, *values, costs, jnp.full((rows,), remaining, jnp.int32),
                                        drafted=False)
    return float(jnp.max(steps[1]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--remaining", type=int, default=64)
    ap.add_argument("--trials", type=int, default=4000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print("| a | w | rows | simulated E[max] | priced (spread) | max of the means (batch_spread 0) |")
    print("|---|---|---|---|---|---|")
    rows = []
    for a in (0.3, 0.5, 0.7, 0.85):
        for w in (1, 2, 8):
            for b in (4, 16):
                sim = simulated_steps(a, w, b, args.remaining, args.trials)
                new, old = (priced_steps(a, w, b, args.remaining, s) for s in (1.0, 0.0))
                rows.append(dict(a=a, w=w, rows=b, simulated=sim, priced=new, means=old))
                print(f"| {a} | {w} | {b} | {sim:.1f} | {new:.1f} | {old:.1f} |", flush=True)
    write_result(dict(args=vars(args), rows=rows), args.json)


if __name__ == "__main__":
    main()
