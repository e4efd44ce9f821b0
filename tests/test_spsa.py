"""SPSA (score-based, Linf): factory, exact query counts, feasibility, determinism, and the
linear oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import norms
from jaxbundle.attacks.base import Candidate, ScoreOracle, per_example_keys
from jaxbundle.attacks.score_based.spsa import spsa, spsa_gradient, rademacher
from jaxbundle.bundler import bundle
from attack_checks import check_factory, check_states_keep_shape, oracle_problem, traced_queries
from toys import KEY, images, linear_apply, linear_problem, min_distance, run_steps as _run

B = 8
EPS = 0.05


def _setup(seed=0):
    return oracle_problem(ScoreOracle, B, EPS, seed=seed)


def test_factory():
    a = check_factory(spsa, name="spsa", kind="score-based", norm="linf", goal="misclassify",
                      num_steps=100, num_restarts=1, gradients_per_step=0, init_queries=0,
                      queries_per_step=129, queries=12900)
    assert a.config.samples == 128 and a.config.delta == 0.01 and a.config.learning_rate == 0.01
    assert spsa(steps=3, samples=4, name="s").queries == 15


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(norm="l2"), "linf"),
        (dict(norm="l7"), "unknown norm"),
        (dict(steps=0), "steps"),
        (dict(samples=7), "samples"),
        (dict(samples=0), "samples"),
        (dict(delta=0.0), "delta"),
        (dict(learning_rate=-1.0), "learning_rate"),
    ],
)
def test_factory_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        spsa(**kwargs)


@pytest.mark.parametrize("samples", [2, 6])
def test_declared_queries_are_exact(samples):
    """Count oracle rows at trace time: a call on n * B images is n queries per example."""
    params, _, x, y, eps, keys = _setup()
    a = spsa(steps=2, samples=samples)
    init_rows, step_rows = traced_queries(a, ScoreOracle, params, keys, x, y, eps)
    assert init_rows == a.init_queries * B
    assert step_rows == a.queries_per_step * B == (samples + 1) * B


def test_gradient_estimate_on_a_linear_margin():
    """Away from ties the margin is linear, each antithetic difference is exactly g . v, and
    the average of (g . v) v over many Rademacher v approaches g."""
    params, model, x, y, _, keys = _setup()
    w = np.asarray(params["w"])
    z = np.asarray(linear_apply(params, x))
    other = np.argmax(np.where(np.eye(4)[np.asarray(y)] > 0, -np.inf, z), axis=1)
    g_true = (w[:, other] - w[:, np.asarray(y)]).T.reshape(x.shape)
    v = rademacher(keys, x.shape[1:], 4096)
    g = np.asarray(spsa_gradient(model, x, y, v, 1e-3))
    for i in range(B):
        cos = g[i].ravel() @ g_true[i].ravel() / np.linalg.norm(g[i]) / np.linalg.norm(g_true[i])
        assert cos > 0.97


def test_iterates_in_box_and_ball_and_candidates_honest():
    params, model, x, y, eps, keys = _setup()
    a = spsa(steps=6, samples=16)
    states, cands = _run(a, model, keys, x, y, eps, 6)
    check_states_keep_shape(states, B)
    for point in [s.x for s in states] + [c.x for c in cands]:
        assert float(point.min()) >= 0.0 and float(point.max()) <= 1.0
        assert np.all(np.asarray(norms.in_ball(point - x, eps, "linf")))
    for c in cands:
        assert isinstance(c, Candidate) and c.logits.shape == (B, 4)
        np.testing.assert_allclose(c.logits, linear_apply(params, c.x), rtol=1e-5, atol=1e-5)
    assert not np.allclose(states[-1].x, states[0].x), "the iterate must move"


def test_deterministic_and_per_example():
    params, model, x, y, eps, keys = _setup()
    a = spsa(steps=3, samples=8)
    first = _run(a, model, keys, x, y, eps, 3)[0][-1].x
    np.testing.assert_array_equal(first, _run(a, model, keys, x, y, eps, 3)[0][-1].x)
    other = per_example_keys(jax.random.key(1), jnp.arange(B))
    assert not np.allclose(first, _run(a, model, other, x, y, eps, 3)[0][-1].x)
    # Example 0's trajectory does not depend on the rest of the batch.
    alone = _run(a, model, keys[:1], x[:1], y[:1], eps[:1], 3)[0][-1].x
    np.testing.assert_allclose(alone, first[:1], rtol=1e-6, atol=1e-6)


def test_linear_oracle():
    """Fools every example whose analytic distance is below eps / 2, none beyond eps."""
    params, x, y = linear_problem(n=200, k=4, seed=0)
    dist = min_distance(params, x, y, "linf")
    eps = float(1.2 * np.median(dist))
    a = spsa(steps=30)
    r = bundle([a], linear_apply, params, images(x), jnp.asarray(y), KEY, eps=eps, norm="linf",
               judging="float")
    success = np.asarray(r.attack_success[0])
    near, far = dist < 0.5 * eps, dist > eps * (1 + 1e-4)
    assert near.sum() >= 20 and far.sum() >= 20
    assert success[near].all()
    assert not success[far].any()
    assert success[dist < 0.9 * eps].mean() >= 0.95
    np.testing.assert_array_equal(r.queries, np.full(200, 30 * 129))
