"""Shared test configuration: strict JAX shapes, deterministic hypothesis, the ``slow`` marker."""

from __future__ import annotations

import gc
import os

import jax
import pytest
from hypothesis import HealthCheck, settings

# Implicit rank promotion hides shape bugs ([B] against [B, 1] silently becomes [B, B]).
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_enable_x64", False)  # the library is float32 throughout

# "ci" (default): deterministic and fast. "dev": more examples, random, for local digging.
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=60,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end tests (deselect with -m 'not slow')")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. Each XLA:CPU executable holds a few
    memory mappings of JIT code; the whole suite in one process compiles thousands of them,
    and at the kernel's ``vm.max_map_count`` (65,530 by default) LLVM's next mapping fails and
    the process segfaults inside ``backend_compile_and_load``. Cleared per module, the count
    stays flat."""
    yield
    jax.clear_caches()
    gc.collect()
