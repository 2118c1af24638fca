"""One process of the two-process test in tests/test_multihost.py (not a test module itself).

    python multihost_worker.py PROCESS_ID NUM_PROCESSES PORT CHECKPOINT_DIR DRAFT_DIR OUT_JSON

Joins the cluster with jax.distributed.initialize (CPU devices, gloo collectives), builds the (data,
model) mesh over every process's devices, loads the checkpoint sharded over it and writes each method's
generated tokens to OUT_JSON (speculative: draft_lm with the draft checkpoint). The test runs the same
CASES in one process and compares.
"""
from __future__ import annotations

import json
import os
import sys

LOCAL_DEVICES = 4
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 16, 17, 18], [3, 4, 5], [9, 8, 7, 6, 5, 4],
           [20, 21], [30, 31, 32]]
MAX_NEW_TOKENS = 6
# name -> (method, options); every process decodes all of them, the test compares each to one process.
CASES = {
    "greedy": ("greedy", {}),
    "speculative": ("speculative", {"tree": "chain:3"}),  # draft_lm with the draft model below
}


def run_cases(model, mesh, draft) -> dict:
    import jaxdecode
    out = {}
    for name, (method, opts) in CASES.items():
        opts = dict(opts, draft=draft) if method == "speculative" else opts
        res = jaxdecode.generate(model, PROMPTS, method, max_new_tokens=MAX_NEW_TOKENS, mesh=mesh, **opts)
        out[name] = [r.tokens for r in res]
    return out


def main(process_id: int, num_processes: int, port: int, checkpoint: str, draft_dir: str,
         out_path: str) -> None:
    # The suite's compile flags (tests/conftest.py) with this process's own device count.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"])
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=120)
    import dataclasses

    import numpy as np

    import jaxdecode
    from jaxdecode.sharding import make_mesh, shard_batch
    assert jax.process_count() == num_processes and jax.local_device_count() == LOCAL_DEVICES
    mesh = make_mesh(model=LOCAL_DEVICES)  # rows of the batch across processes, model within each
    model = jaxdecode.load(checkpoint, mesh=mesh)
    assert not jax.tree.leaves(model.params)[0].is_fully_addressable  # the mesh spans the processes

    def local(path):  # parameters committed to one local device: generate places them on the mesh
        m = jaxdecode.load(path)
        return dataclasses.replace(m, params=jax.device_put(m.params, jax.local_devices()[0]))

    out = run_cases(model, mesh, local(draft_dir))
    out["devices"] = jax.device_count()
    out["greedy_from_local_params"] = [r.tokens for r in jaxdecode.generate(
        local(checkpoint), PROMPTS, "greedy", max_new_tokens=MAX_NEW_TOKENS, mesh=mesh)]
    # Different prompts, prompt lengths or seeds per process: a clear error, not a silently mixed batch
    # (nor a collective that aborts both processes on arrays of different sizes).
    for case, call in (
            ("mismatch_error", lambda: shard_batch(np.full((8, 3), process_id, np.int32), mesh)),
            ("length_mismatch_error", lambda: shard_batch(np.zeros((8, 3 + process_id), np.int32), mesh)),
            ("seed_mismatch_error", lambda: jaxdecode.generate(model, PROMPTS, "sample", max_new_tokens=2,
                                                               mesh=mesh, seed=process_id))):
        try:
            call()
        except ValueError as e:
            out[case] = str(e)
    with open(out_path, "w") as f:
        json.dump(out, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7])
