"""Multi-host: two processes on this machine (4 CPU devices each, gloo collectives) joined by
jax.distributed.initialize decode on one 2x4 (data x model) mesh, and both get exactly the output of a
single process. The worker is tests/multihost_worker.py."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import multihost_worker as worker

TIMEOUT_S = 300  # for both workers together; then they are killed (a hung peer never blocks)


def _gloo_missing() -> bool:
    """True only when this jaxlib positively lacks gloo CPU collectives."""
    import jax
    if "jax_cpu_collectives_implementation" not in jax.config.values:
        return True
    try:
        from jax._src.lib import _jax as ext
    except ImportError:
        return False  # another layout: let the workers say
    return not hasattr(ext, "make_gloo_tcp_collectives")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(checkpoint, draft, tmp_path, num_processes: int = 2) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}  # each worker sets its own
    env["JAX_PLATFORMS"] = "cpu"
    port = _free_port()
    procs, logs = [], []
    for i in range(num_processes):
        log = open(tmp_path / f"worker{i}.log", "w+")
        logs.append(log)
        cmd = [sys.executable, str(Path(worker.__file__)), str(i), str(num_processes), str(port),
               str(checkpoint), str(draft), str(tmp_path / f"out{i}.json")]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:  # a worker left waiting on a dead peer must not outlive the test
            if p.poll() is None:
                p.kill()
                p.wait()
    text = []
    for i, log in enumerate(logs):
        log.seek(0)
        text.append(f"--- worker {i}:\n" + log.read()[-6000:])
        log.close()
    assert codes is not None, f"workers still running after {TIMEOUT_S}s\n" + "\n".join(text)
    assert codes == [0] * num_processes, f"worker exit codes {codes}\n" + "\n".join(text)
    return [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(num_processes)]


def test_two_processes_decode_like_one(tiny_llama_dir, tmp_path):
    if _gloo_missing():
        pytest.skip("this jaxlib has no gloo CPU collectives: multi-process CPU runs are impossible")
    import jaxdecode
    from jd_testutil import make_checkpoint

    draft = make_checkpoint("llama", tmp_path / "draft", seed=1, num_hidden_layers=1)
    outs = _run_workers(tiny_llama_dir, draft, tmp_path)
    want = worker.run_cases(jaxdecode.load(tiny_llama_dir), None, jaxdecode.load(draft))  # one process
    assert all(want["greedy"]) and want["speculative"] == want["greedy"]
    for i, got in enumerate(outs):
        assert got["devices"] == 2 * worker.LOCAL_DEVICES
        for name in worker.CASES:
            assert got[name] == want[name], (i, name)
        assert got["greedy_from_local_params"] == want["greedy"], i
        assert "batch contents (shape (8, 3)) is not the same on every process" in got.get("mismatch_error", "")
        assert f"batch shape (shape (8, {3 + i})) is not the same" in got.get("length_mismatch_error", "")
        assert "the options (" in got.get("seed_mismatch_error", "") and "seed" in got["seed_mismatch_error"]
