"""Shared test configuration: strict JAX shapes, deterministic hypothesis, the ``slow`` marker."""

from __future__ import annotations

import os

import jax
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
