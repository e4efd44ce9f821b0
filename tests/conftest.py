"""Shared test configuration: strict JAX shapes, deterministic hypothesis, the ``slow`` marker,
one cache for the whole run, and the suite's time budget.

Time budget (checked in every run, CI included): a test not marked ``slow`` that takes more than
``JAXBUNDLE_TEST_LIMIT_S`` seconds (default 20; its setup and call together) fails with a
message saying so; a whole run under ``CI`` that takes more than ``JAXBUNDLE_SUITE_BUDGET_S``
seconds (default 1,200) fails at the end. ``--durations=10`` (setup.cfg) prints the ten slowest
tests of every run.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time

# Python's cycle collector, tuned for a run that traces thousands of programs: JAX's tracing
# and lowering allocate millions of short-lived objects, and with the default thresholds
# (700, 10, 10) the collector ran 1,300 times over 50 s of three modules and took 7 % of the
# time (3.9 s); 10x fewer young collections, and the modules imported before the tests frozen
# out of every scan (:func:`pytest_collection_finish`), 1.2 s.
gc.set_threshold(10_000, 20, 20)

# Compile fast, run slower: the suite's programs are small and most of its time was XLA:CPU
# compiling them (a bundle of three attacks on a linear toy: 8.4 s with XLA's defaults, 2.2 s
# with LLVM at -O0 and XLA's classic loop emitters instead of the fusion emitters). Set before
# JAX starts its backend, so every test and every process a test starts compiles this way;
# JAXBUNDLE_TEST_XLA_DEFAULTS=1 runs the suite with XLA's own settings instead. LLVM's code
# generation in one piece, not split over threads: the suite's two workers keep both cores
# busy, and on a loaded machine the split only adds work (the default bundle's 84 programs for
# the API-vs-CLI test, alternating runs, one process: 8.8-10.3 s of compiles instead of
# 11.4-12.0 s; under heavy load 20.7 s instead of 28.0 s).
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                "--xla_cpu_parallel_codegen_split_count=1")
if not os.environ.get("JAXBUNDLE_TEST_XLA_DEFAULTS"):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
# Lower with one source line per operation instead of its whole Python traceback: JAX spends
# much of a test's time lowering programs, and the tracebacks are only read in compiler dumps
# (the API-vs-CLI tests: 6-10 % faster). An environment variable, so subprocesses inherit it.
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from jax._src import compilation_cache  # noqa: E402

# Implicit rank promotion hides shape bugs ([B] against [B, 1] silently becomes [B, B]).
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_enable_x64", False)  # the library is float32 throughout

# "ci" (default): deterministic and fast. "dev": more examples, random, for local digging.
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=30,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


TEST_LIMIT_S = float(os.environ.get("JAXBUNDLE_TEST_LIMIT_S", "20"))
SUITE_BUDGET_S = float(os.environ.get("JAXBUNDLE_SUITE_BUDGET_S", "1200"))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end tests (deselect with -m 'not slow')")
    # One cache of demo weights for the whole run, shared by every test module, every xdist
    # worker and every subprocess the tests start: each demo model trains at most once (the
    # cache's lock makes concurrent callers wait for the one that trains). CI sets
    # JAXBUNDLE_CACHE to a fresh directory; a local run without it gets one per run.
    if "JAXBUNDLE_CACHE" not in os.environ and not hasattr(config, "workerinput"):
        os.environ["JAXBUNDLE_CACHE"] = tempfile.mkdtemp(prefix="jaxbundle-tests-")
    # No persistent compilation cache by default: with the fast-compile flags above a program
    # compiles in about 0.15 s, and writing it to the cache (serialising and compressing it)
    # cost more than the rare hits saved (the stochastic and conformance modules, one process:
    # 575 compiles, 18 hits that saved nothing, 8.5 s spent writing and reading; the schedule
    # module: 74 hits, 9.5 s spent). JAXBUNDLE_TEST_COMPILE_CACHE=DIR turns one on for a run.
    # jaxbundle.evaluate uses one by default (jaxbundle.run.compile_cache): off here, for the
    # tests and the processes they start; tests/test_compile_cache.py runs the default alone.
    os.environ.setdefault("JAXBUNDLE_COMPILE_CACHE", "off")
    if directory := os.environ.get("JAXBUNDLE_TEST_COMPILE_CACHE"):
        for name, value in (("jax_compilation_cache_dir", directory),
                            ("jax_persistent_cache_min_compile_time_secs", 0.0),
                            ("jax_persistent_cache_min_entry_size_bytes", 0)):
            jax.config.update(name, value)
        compilation_cache.reset_cache()
    config._jaxbundle_started = time.monotonic()


def pytest_collection_finish(session):
    """Everything imported so far (JAX, flax, the library, the test modules) lives for the whole
    run: moved out of the collector's generations, it is never scanned again."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def compiles_counted():
    """For a test that counts XLA compilations (``backend_compile_duration`` events): the run's
    persistent compilation cache is off while it runs, so a program compiled again is counted
    rather than read back from the cache unseen."""
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX checks once whether to use it, until reset
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def _map_count_limit() -> int | None:
    """The kernel's limit on a process's memory mappings (``None`` off Linux)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


MAP_LIMIT = _map_count_limit()


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after a test module once the process holds more than half
    the memory mappings the kernel allows. Each XLA:CPU executable holds a few mappings of JIT
    code; the whole suite in one process compiles thousands of them, and at the kernel's
    ``vm.max_map_count`` (65,530 by default) LLVM's next mapping fails and the process
    segfaults inside ``backend_compile_and_load``. Below half the limit the programs stay, so
    later modules reuse what earlier ones compiled; off Linux they are dropped after every
    module."""
    yield
    if MAP_LIMIT is None or _mappings() > MAP_LIMIT // 2:
        jax.clear_caches()
        gc.collect()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Fails a test not marked ``slow`` whose setup and call took more than
    :data:`TEST_LIMIT_S` together (a module fixture's setup counts for the test that ran it)."""
    outcome = yield
    report = outcome.get_result()
    if call.when == "setup":
        item._jaxbundle_setup_s = call.duration
    elif (call.when == "call" and report.passed and item.get_closest_marker("slow") is None
          and (spent := getattr(item, "_jaxbundle_setup_s", 0.0) + call.duration)
          > TEST_LIMIT_S):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {spent:.1f} s (setup and call), over the {TEST_LIMIT_S:.0f} s "
            "a test not marked slow may take (JAXBUNDLE_TEST_LIMIT_S): give it a smaller "
            "model, data or budget, or mark it slow"
        )


def pytest_sessionfinish(session, exitstatus):
    """Under ``CI``, a whole run over :data:`SUITE_BUDGET_S` fails (the controller only)."""
    config = session.config
    if hasattr(config, "workerinput") or not os.environ.get("CI"):
        return
    spent = time.monotonic() - config._jaxbundle_started
    if spent > SUITE_BUDGET_S and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        message = (f"the suite took {spent:.0f} s, over its budget of {SUITE_BUDGET_S:.0f} s "
                   "(JAXBUNDLE_SUITE_BUDGET_S)")
        if reporter is not None:
            reporter.write_line(f"FAILED: {message}", red=True)


def pytest_collection_modifyitems(config, items):
    """Test modules holding ``slow`` tests first, the others after, each in its own order: with
    parallel workers (``-n``), the longest modules start first and the short ones fill in."""
    heavy = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in heavy)
