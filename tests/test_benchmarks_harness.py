"""The benchmarks' shared harness (benchmarks/harness.py) and the decomposition variants built
from the bundler's own pieces (benchmarks/pgd_speed.py, benchmarks/pgd_overhead.py)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402
import pgd_overhead  # noqa: E402
import pgd_speed  # noqa: E402

from jaxbundle import bundler  # noqa: E402
from jaxbundle.attacks import pgd  # noqa: E402

CLASSES = 3  # not 10: the variants must take the class count from the model


def _linear(params, x):
    return x.reshape(x.shape[0], -1) @ params["w"] + params["b"][None]


def _problem(batch=6):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(0, 256, (batch, 4, 4, 1)) / 255.0, jnp.float32)
    y = jnp.asarray(rng.integers(0, CLASSES, batch), jnp.int32)
    params = {"w": jnp.asarray(rng.normal(size=(16, CLASSES)), jnp.float32),
              "b": jnp.zeros((CLASSES,), jnp.float32)}
    return params, x, y


def test_importing_the_benchmarks_registers_no_listener():
    code = (
        "import sys, jax.monitoring as m\n"
        "calls = []\n"
        "m.register_event_duration_secs_listener = calls.append\n"
        f"sys.path.insert(0, {str(BENCH)!r})\n"
        "import harness, pgd_speed, pgd_overhead\n"
        "assert calls == [], calls\n"
        "harness.track_compile_time(); harness.track_compile_time()\n"
        "assert len(calls) == 1, calls\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]


def test_run_interleaved_times_and_reports_compile_seconds():
    """Each variant's times are what it takes (a 30 ms sleep takes at least 30 ms, a no-op far
    less), its median is the median of its rounds, and its first call's compilation is
    reported apart."""
    import statistics
    import time

    f = jax.jit(lambda v: jnp.sin(v) * 3.0 + 0.123456)
    res = harness.run_interleaved({"a": lambda: (time.sleep(0.03), f(jnp.ones(5)))[1],
                                   "b": lambda: jnp.ones(3)}, 3, "t")
    assert len(res["a"]["times_s"]) == 3 and len(res["_load_avg_per_round"]) == 3
    assert min(res["a"]["times_s"]) >= 0.03 > max(res["b"]["times_s"])
    assert res["a"]["compile_s"] > 0.0
    medians = harness.medians(res)
    assert set(medians) == {"a", "b"}
    assert medians["a"] == statistics.median(res["a"]["times_s"])


def test_pgd_program_starts_as_the_bundler_does():
    """The variant's PGD iterate after one step is the library's (same key folds: attack 0,
    restart 0), on a 3-class model."""
    params, x, y = _problem()
    key = jax.random.key(3)
    attack = pgd(norm="linf", loss="ce", steps=1, step_size=0.01, random_start=True)
    prog = pgd_overhead.make_pgd_program(_linear, attack, fold=False, unroll=1, loop="scan")
    got = prog(params, x, y, key)
    ids = jnp.arange(x.shape[0], dtype=jnp.int32)
    driver = bundler.Driver(attack, 0, bundler.Rules(_linear, ("misclassify",), "linf", "float"))
    running = bundler.start_stage(params, x, y, key, ids, harness.EPS, driver=driver)
    start = np.asarray(running.state.x[0])
    running = bundler.step_stage(params, running, x, y, harness.EPS, 0, 1, driver=driver)
    np.testing.assert_allclose(np.asarray(got), np.asarray(running.state.x[0]), atol=1e-6)
    # With the fold, the best is step 0's candidate (PGD's iterate whose gradient the step
    # took: the random start) wherever the model misclassifies it, since it beats the start
    # scored on zero logits.
    best = pgd_overhead.make_pgd_program(_linear, attack, fold=True, unroll=1, loop="python")(
        params, x, y, key)[1]["misclassify"]
    fooled = np.asarray(jnp.argmax(_linear(params, start), -1)) != np.asarray(y)
    assert fooled.any()
    np.testing.assert_allclose(np.asarray(best.x)[fooled], start[fooled], atol=1e-6)


@pytest.mark.parametrize("steps", [2])
def test_python_driven_and_stripped_match_bundle(steps):
    params, x, y = _problem()
    x = jnp.clip(x + 0.3 / 255, 0, 1)  # off the 8-bit grid: judged in float32, nothing rounded
    key = jax.random.key(5)
    attack = pgd(norm="linf", loss="ce", steps=steps, step_size=0.05, random_start=True)
    lib = bundler.bundle([attack], _linear, params, x, y, key, eps=harness.EPS).best["misclassify"]
    run, _ = pgd_speed.make_python_driven(attack, _linear, params, x, y, key)
    py = run()["misclassify"]
    np.testing.assert_allclose(np.asarray(py.x), np.asarray(lib.x), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(py.score.misclassified),
                                  np.asarray(lib.score.misclassified))
    # The stripped program folds only the last iterate into the clean start: its best is the
    # last iterate where the model's margin (largest wrong logit minus the label's) is higher
    # there than on the clean image, else the clean image.
    stripped = pgd_speed.make_stripped(attack, _linear, params, x, y, key, 1)()["misclassify"]
    last = pgd_overhead.make_pgd_program(_linear, attack, fold=False, unroll=1, loop="scan")(
        params, x, y, key)

    def margin(images):
        z = np.asarray(_linear(params, images), np.float64)
        true = z[np.arange(len(y)), y]
        z[np.arange(len(y)), y] = -np.inf
        return z.max(1) - true

    better = margin(last) > margin(x)
    assert better.any()
    expected = np.where(better[:, None, None, None], np.asarray(last), np.asarray(x))
    np.testing.assert_allclose(np.asarray(stripped.x), expected, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(stripped.score.misclassified),
                                  margin(expected) > 0)
