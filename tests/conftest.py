"""Test setup: 8 simulated CPU devices (for the 2x4 mesh tests) before JAX initialises."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Cost tables measured by adaptive speculation go to a fresh directory per test process, not ~/.cache.
import tempfile  # noqa: E402

os.environ.setdefault("JAXDECODE_CACHE_DIR", tempfile.mkdtemp(prefix="jaxdecode-test-cache-"))

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
