"""Tiny deterministic models with analytic answers, shared by the tests."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import socket
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def import_example(name: str):
    """``examples/<name>.py`` imported as a module of its own (each call afresh)."""
    spec = importlib.util.spec_from_file_location(f"jb_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # flax modules (dataclasses) look themselves up here
    spec.loader.exec_module(module)
    return module


# The demo models trained small: 2,000 images, 2 epochs (about 27x less than the demo's own
# budget), enough that the adversarial one keeps survivors at eps 0.3. Trained once per test run
# in $JAXBUNDLE_CACHE and shared by every test that needs a trained CNN rather than a toy; the
# command's --train-examples 2000 --train-epochs 2 train the same weights.
QUICK_TRAINING = {"n_train": 2000, "epochs": 2}


def quick_demo_model(name: str):
    """``(apply_fn, params)`` of demo model ``name`` trained with :data:`QUICK_TRAINING`."""
    from jaxbundle import models

    return models.load_or_train(models.MODELS[name]._replace(**QUICK_TRAINING))


class ColourCNN(nn.Module):
    """An ordinary flax network for colour 32x32 images (``nn.Conv``, not the demo's conv;
    random weights in the tests that use it)."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), strides=2)(x))
        x = nn.relu(nn.Conv(16, (3, 3), strides=2)(x))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def linear_apply(params, x):
    """A linear classifier: logits = flatten(x) @ w + b."""
    return x.reshape(x.shape[0], -1) @ params["w"] + params["b"][None, :]


def linear_problem(seed: int = 0, n: int = 64, d: int = 20, k: int = 4, spread: float = 0.05):
    """A random linear model and 8-bit images near the middle of the box (the box rarely binds).

    Labels are the model's own clean predictions, so every example is correctly classified.
    """
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(d, k)).astype(np.float32)
    b = rng.normal(size=(k,)).astype(np.float32) * 0.1
    x = 0.5 + spread * rng.uniform(-1, 1, size=(n, d))
    x = (np.round(x * 255) / 255).astype(np.float32)  # on the 8-bit grid, like real images
    params = {"w": jnp.asarray(w), "b": jnp.asarray(b)}
    y = np.asarray(jnp.argmax(linear_apply(params, jnp.asarray(x)), axis=1)).astype(np.int32)
    return params, x, y


def min_distance(params, x, y, norm: str) -> np.ndarray:
    """Exact minimal ``norm`` distance to misclassification of a linear model, ignoring the box.

    Class j beats y once ``(w_j - w_y) . delta > z_y - z_j``; the smallest such delta has
    ``||delta|| = (z_y - z_j) / ||w_y - w_j||_*`` with the dual norm (L1 for Linf, L2 for L2).
    """
    w = np.asarray(params["w"])
    z = np.asarray(linear_apply(params, jnp.asarray(x)))
    dual = {"linf": 1, "l2": 2, "l1": np.inf}[norm]
    best = np.full(len(y), np.inf)
    for j in range(w.shape[1]):
        gap = z[np.arange(len(y)), y] - z[:, j]
        diff = np.linalg.norm((w[:, y] - w[:, [j]]).T, ord=dual, axis=1)
        dist = np.where(y == j, np.inf, gap / np.maximum(diff, 1e-12))
        best = np.minimum(best, dist)
    return best


def images(x, shape=(4, 5, 1)):
    """Reshapes flat toy inputs to image batches [N, H, W, C]."""
    return jnp.asarray(x).reshape((x.shape[0],) + shape)


KEY = jax.random.key(0)


def trajectory(state, step, steps):
    """``[state]`` and the states after each of ``steps`` calls of ``step`` (``state ->
    (state, candidate)``), and the candidates."""
    states, cands = [state], []
    for _ in range(steps):
        state, cand = step(state)
        states.append(state)
        cands.append(cand)
    return states, cands


def run_steps(attack, model, keys, x, y, eps, steps, restart=0):
    """All states and candidates of ``steps`` jitted steps of ``attack`` after its ``init``."""
    step = jax.jit(lambda s: attack.step(attack.config, s, model))
    state = attack.init(attack.config, keys, x, y, eps, model, restart)
    return trajectory(state, step, steps)


def dot_flops(jaxpr) -> int:
    """Multiply-adds of every dot_general in a jaxpr, sub-jaxprs (jit, scan, ...) included: on a
    linear model, a count of forward and backward passes."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += int(np.prod(eqn.outvars[0].aval.shape)) * int(
                np.prod([lhs[i] for i in contract])
            )
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if hasattr(sub, "eqns"):
                    total += dot_flops(sub)
                elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                    total += dot_flops(sub.jaxpr)
    return total


def coordinator_port() -> int:
    """A free port on 127.0.0.1 for a ``jax.distributed`` coordinator.

    Skips the calling test when the loopback interface does not connect (inside ``unshare -n``
    it is down until ``ip link set lo up``), unless ``$JAXBUNDLE_REQUIRE_LOOPBACK`` is set, as CI
    sets it: then the test fails instead of silently not running.
    """
    import pytest

    try:
        with socket.create_server(("127.0.0.1", 0)) as server:
            socket.create_connection(server.getsockname(), timeout=5).close()
        with socket.create_server(("127.0.0.1", 0)) as free:  # never connected: no TIME_WAIT
            return free.getsockname()[1]
    except OSError as err:
        if os.environ.get("JAXBUNDLE_REQUIRE_LOOPBACK"):
            pytest.fail(f"JAXBUNDLE_REQUIRE_LOOPBACK is set but 127.0.0.1 does not connect: {err}")
        pytest.skip(f"no loopback network for the jax.distributed coordinator: {err}")


def python_command(code: str, *args: str, deadline: float) -> list[str]:
    """``python -c code args...`` that, still running after ``deadline`` seconds, dumps the
    stack of every thread to its output and exits (faulthandler): a hang explains itself."""
    prelude = f"import faulthandler; faulthandler.dump_traceback_later({deadline}, exit=True)\n"
    return [sys.executable, "-c", prelude + code, *args]


CLI = "import sys; from jaxbundle.cli import main; sys.argv[0] = 'jaxbundle'; sys.exit(main())"


def run_processes(commands, env, timeout):
    """Runs the processes of one job at once; returns ``(exit code, output)`` for each.

    Output goes to files, not pipes: a process blocked on a full pipe would stall the others in
    a collective. After ``timeout`` seconds every process still running is killed (code -9);
    give the commands a shorter :func:`python_command` deadline so that they dump their stacks
    first.
    """
    import tempfile
    import time

    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(os.path.join(tmp, f"{i}.log"), "w+") for i in range(len(commands))]
        workers = [
            subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            for cmd, log in zip(commands, logs)
        ]
        deadline = time.monotonic() + timeout
        for worker in workers:
            try:
                worker.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                pass
        for worker in workers:
            worker.kill()
            worker.wait()
        results = []
        for worker, log in zip(workers, logs):
            log.seek(0)
            results.append((worker.returncode, log.read()))
            log.close()
        return results


def assert_all_succeeded(results) -> None:
    """Fails with the end of every process's output (stack dumps included) unless all exited 0."""
    if any(code != 0 for code, _ in results):
        tails = "\n".join(f"--- process {i}: exit code {code}\n{log[-6000:]}"
                          for i, (code, log) in enumerate(results))
        raise AssertionError(f"a process failed:\n{tails}")
