"""Test setup: 8 simulated CPU devices (for the 2x4 mesh tests) before JAX initialises."""
import inspect
import os


def _jaxlib_knows(flag: str) -> bool:
    """Whether the installed jaxlib's XLA defines `flag` (an unknown flag in XLA_FLAGS aborts the process)."""
    import glob
    import importlib.util
    import mmap
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or spec.origin is None:
        return False
    for path in glob.glob(os.path.join(os.path.dirname(spec.origin), "*.so")):
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(flag.encode()) >= 0:
                    return True
        except (OSError, ValueError):
            continue
    return False


# XLA's backend optimisation off: the suite's CPU time is almost all compilation of small programs
# (measured on test_speculative + test_diffusion_decoders: 186 -> 114 s of CPU); the programs are the
# same, only less optimised, and every test compares runs of the same setting.
# XLA's CPU fusion emitters off where this XLA has them: its older emitters compile the suite's small
# programs faster and run them faster at level 0 (test_adaptive + test_speculative + test_drafters on
# 2 workers: 374 -> 216 s).
_FAST_CPU = " --xla_cpu_use_fusion_emitters=false" if _jaxlib_knows("xla_cpu_use_fusion_emitters") else ""
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
                      + _FAST_CPU)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Cost tables measured by adaptive speculation go to a fresh directory per test process, not ~/.cache.
import tempfile  # noqa: E402

# One directory per test run, shared by its xdist workers (tables are written atomically), so a table
# is measured once per run, not once per worker.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
os.environ.setdefault("JAXDECODE_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"jaxdecode-test-cache-{_RUN}")
                      if _RUN else tempfile.mkdtemp(prefix="jaxdecode-test-cache-"))

import jax  # noqa: E402

try:
    jax.config.update("jax_num_cpu_devices", 8)
except Exception:  # older JAX: XLA_FLAGS above does it
    pass

import pytest  # noqa: E402

from jd_testutil import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A random Llama checkpoint (GQA, untied) with a byte-level BPE tokenizer."""
    return make_checkpoint("llama", tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory):
    return make_checkpoint("gpt2", tmp_path_factory.mktemp("tiny_gpt2"))


# Every executable XLA compiles on CPU holds ~6 memory mappings until JAX's caches drop it, and a
# process may hold at most vm.max_map_count (65530 by default) mappings: a test worker that compiles
# ~10k programs then gets a failed mmap inside XLA's compiler, which segfaults the worker (seen in CI,
# always in backend_compile, late in a worker's life, a different test each time). Drop the caches
# when a worker nears the limit.
def _map_count() -> int:
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to watch
        return 0


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


_MAP_BUDGET = _map_limit() // 2


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    yield
    if _map_count() > _MAP_BUDGET:
        jax.clear_caches()


# XLA's backend optimisation is off for the suite (compiling dominates it, see XLA_FLAGS above), but a
# test marked `exec_bound` spends its time running what it compiled (1e5-row chi-squared runs), which
# level 0 runs ~3x slower: its compiles get level 1 (the verifier-pairs adaptive run: 62 -> 41 s). The
# training tests measured compile-bound: they stay at level 0. JAX has no public switch for one test's
# compiles, so this wraps the function that builds the compile options; should a JAX release move it,
# the tests run unoptimised as before, only slower.
# JD_TEST_XLA_OPT=all / none forces one level for every test (to measure which tests gain).
_XLA_OPT = os.environ.get("JD_TEST_XLA_OPT", "")


@pytest.fixture(autouse=True)
def _optimise_exec_bound_compiles(request, monkeypatch):
    want = request.node.get_closest_marker("exec_bound") is not None
    want = {"all": True, "none": False}.get(_XLA_OPT, want)
    compiler = getattr(getattr(jax, "_src", None), "compiler", None)
    build = getattr(compiler, "get_compile_options", None)
    if want and build is not None:
        signature = inspect.signature(build)

        def optimised(*args, **kwargs):  # env_options_overrides passed by position or by keyword
            call = signature.bind(*args, **kwargs)
            env = dict(call.arguments.get("env_options_overrides") or {})
            env.setdefault("xla_backend_optimization_level", 1)
            call.arguments["env_options_overrides"] = env
            return build(*call.args, **call.kwargs)
        monkeypatch.setattr(compiler, "get_compile_options", optimised)
    yield


# Adaptive speculation (the default of method="speculative") measures a cost table on first use per
# model, drafter and batch size: ~5-10 s of compiling per tiny test model, ~40 times over the suite.
# Tests about other things get a synthetic table; measuring itself is tested in test_costmodel.py and,
# end to end through generate, by tests marked `real_costs`.
@pytest.fixture(autouse=True)
def _synthetic_cost_tables(request, monkeypatch):
    if request.node.get_closest_marker("real_costs") is None:
        from jaxdecode import costmodel

        def synthetic(model, drafter, batch_size, *, widths=None, **kw):
            ws = tuple(widths) if widths is not None else costmodel.default_widths(drafter.num_nodes)
            return costmodel.CostTable(widths=ws, verify_seconds=tuple(1e-3 * (1 + 0.05 * w) for w in ws),
                                       draft_seconds=2e-4, idle_seconds=0.0, batch_size=int(batch_size),
                                       meta={"synthetic": "tests/conftest.py"})
        monkeypatch.setattr(costmodel, "load_or_calibrate", synthetic)

        from jaxdecode import treeopt

        def synthetic_runs(model, drafters, *a, **kw):  # tree="auto"'s walk over sizes: the same curve
            return [treeopt.TreeRun(1.0, 1e-3, 1e3) if d is None else
                    treeopt.TreeRun(1 + 0.5 * d.max_depth, 1.2e-3 + 5e-5 * d.num_nodes,
                                    (1 + 0.5 * d.max_depth) / (1.2e-3 + 5e-5 * d.num_nodes)) for d in drafters]
        monkeypatch.setattr(treeopt, "time_runs", synthetic_runs)
    yield


# The longest modules first: pytest-xdist (--dist load) hands out tests in collection order, in chunks that
# shrink toward the end, so a run that ended on a minute-long test (the wheel build was last) kept one core
# idle while the other finished it; now it ends on short ones. (--dist worksteal would also keep modules
# on one worker, but a worker crash while it steals aborts the whole run: the crash rerun needs load.)
_LONG_MODULES = ("test_multihost.py", "test_notebook.py", "test_wheel.py", "test_embedded.py", "test_verifier_pairs.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
