"""SurFree: factory, exact query counts, grid and box, determinism, and the linear oracle."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle.attacks.base import Attack, LabelOracle
from jaxbundle.attacks.decision_based.surfree import (
    NOISE,
    init_queries,
    orthogonalize,
    sample_directions,
    surfree,
)
from jaxbundle.bundler import bundle
from toys import KEY, images, linear_apply, linear_problem, min_distance, trajectory

PARAMS, X, Y = linear_problem()
X0 = images(X)
Y0 = jnp.asarray(Y)
KEYS = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(KEY, jnp.arange(len(Y)))


ATTACK = surfree(queries=1000)  # the attack of the direct tests (compiled once, below)
MODEL = LabelOracle(linear_apply, PARAMS)
INIT = jax.jit(lambda k, x, y_: ATTACK.init(ATTACK.config, k, x, y_, None, MODEL, 0))
STEP = jax.jit(lambda s: ATTACK.step(ATTACK.config, s, MODEL))


def _run(x0=X0, y=Y0, keys=KEYS, steps=5, state=None):
    state = INIT(keys, x0, y) if state is None else state
    return trajectory(state, STEP, steps)


def _on_grid(x) -> bool:
    x = np.asarray(x, np.float64) * 255
    return bool(np.all(np.abs(x - np.round(x)) < 1e-3))


# ---------------------------------------------------------------------------------------------
# Factory.


def test_factory_defaults_and_budget():
    a = surfree()
    assert isinstance(a, Attack) and a.kind == "decision-based" and a.goal == "min_norm"
    assert a.norm == "l2" and a.name == "surfree" and a.num_restarts == 1
    assert a.gradients_per_step == 0 and a.gradients == 0
    assert (a.init_queries, a.queries_per_step, a.num_steps) == (20, 10, 498)
    assert a.queries == 5000 and a.init_queries == init_queries(a.config)
    assert surfree(queries=1000, restarts=3).queries <= 1000
    for q in (31, 100, 999, 4321):
        a = surfree(queries=q, queries_per_step=7)
        assert a.queries <= q < a.queries + a.queries_per_step
    assert surfree(queries=300) == surfree(queries=300)
    hash(surfree())
    assert surfree(name="sf").name == "sf"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(norm="linf"), "norm"),
        (dict(norm="l0"), "norm"),
        (dict(queries=29), "queries"),
        (dict(restarts=0), "restarts"),
        (dict(queries_per_step=0), "queries_per_step"),
        (dict(trials=0), "trials"),
        (dict(search_steps=-1), "search_steps"),
        (dict(theta_max=0.0), "theta_max"),
        (dict(theta_max=91.0), "theta_max"),
        (dict(rho=1.0), "rho"),
        (dict(gamma=-0.1), "gamma"),
        (dict(gamma=1.0), "gamma"),
        (dict(history=0), "history"),
        (dict(basis="haar"), "basis"),
        (dict(frequency_ratio=0.0), "frequency_ratio"),
        (dict(init_trials=0), "init_trials"),
    ],
)
def test_factory_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        surfree(**kwargs)


# ---------------------------------------------------------------------------------------------
# Directions.


@jax.jit
def _directions(keys):
    """DCT and Gaussian directions, an orthonormal buffer, and the DCT ones orthogonalized
    against both (one compiled program rather than op by op)."""
    t = sample_directions(keys, (8, 6, 2), "dct", 0.5).reshape(4, 8, 6, 2)
    coeffs = jax.scipy.fft.dctn(t, axes=(1, 2), norm="ortho")
    g = sample_directions(keys, (8, 6, 2), "gaussian", 0.5)
    buf = jnp.linalg.qr(jax.random.normal(KEY, (96, 3)))[0].T  # 3 orthonormal rows
    buf = jnp.broadcast_to(buf, (4, 3, 96))
    u = g / jnp.linalg.norm(g, axis=1, keepdims=True)
    v = orthogonalize(t.reshape(4, -1), buf, u)
    return coeffs, g, buf, u, v


def test_dct_directions_are_low_frequency_and_orthogonalized():
    coeffs, g, buf, u, v = map(np.asarray, _directions(KEYS[:4]))
    assert np.abs(coeffs[:, 4:]).max() < 1e-5 and np.abs(coeffs[:, :, 3:]).max() < 1e-5
    assert np.abs(coeffs[:, :4, :3]).max() > 0.1
    assert g.shape == (4, 96)
    # Orthogonal to u and to the buffer, unit norm.
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, rtol=1e-5)
    assert np.abs(np.sum(v * u, axis=1)).max() < 1e-6
    assert np.abs(np.einsum("bd,bld->bl", v, buf)).max() < 1e-5


# ---------------------------------------------------------------------------------------------
# Exact query counts.


def _counting_oracle():
    rows = []

    def counted(params, x):
        n = x.shape[0]
        jax.debug.callback(lambda: rows.append(n))
        return linear_apply(params, x)

    return LabelOracle(counted, PARAMS), rows


def test_query_counts_are_exact():
    a = surfree(queries=200, queries_per_step=6, init_trials=4, init_search_steps=5)
    oracle, rows = _counting_oracle()
    b = len(Y)
    state = jax.jit(lambda k: a.init(a.config, k, X0, Y0, None, oracle, 0))(KEYS)
    jax.block_until_ready(state)
    jax.effects_barrier()
    assert sum(rows) == a.init_queries * b == 9 * b
    rows.clear()
    jax.block_until_ready(jax.jit(lambda s: a.step(a.config, s, oracle))(state))
    jax.effects_barrier()
    assert sum(rows) == a.queries_per_step * b == 6 * b
    # Traced calls: one batched noise call + one bisection body in init, one body per step.
    traced = []
    counting = LabelOracle(lambda p, x: (traced.append(x.shape[0]), linear_apply(p, x))[1], PARAMS)
    jax.make_jaxpr(lambda k: a.init(a.config, k, X0, Y0, None, counting, 0))(KEYS)
    assert traced == [4 * b, b]


# ---------------------------------------------------------------------------------------------
# Iterates: box, grid, adversarial, monotone, deterministic, per-example.


def test_iterates_in_box_on_grid_adversarial_and_shrinking():
    states, cands = _run(steps=8)
    dists = []
    for s, c in zip(states[1:], cands):
        assert c.logits is None and c.x.shape == X0.shape
        np.testing.assert_array_equal(np.asarray(c.x), np.asarray(s.x))
        x = np.asarray(c.x)
        assert x.min() >= 0.0 and x.max() <= 1.0 and _on_grid(x)
        found = np.asarray(s.phase) != NOISE
        pred = np.asarray(jnp.argmax(linear_apply(PARAMS, c.x), axis=1))
        assert np.all(pred[found] != Y[found])
        assert np.all(x[~found] == np.asarray(X0)[~found])
        dists.append(np.linalg.norm((x - np.asarray(X0)).reshape(len(Y), -1), axis=1))
    assert found.mean() > 0.9
    d = np.stack(dists)
    assert np.all(np.diff(d[:, found], axis=0) <= 1e-6)
    assert np.mean(d[-1, found] < d[0, found]) > 0.9  # it makes progress


def test_deterministic_and_independent_of_the_batch():
    _, c1 = _run(steps=3)
    _, c2 = _run(steps=3)
    np.testing.assert_array_equal(np.asarray(c1[-1].x), np.asarray(c2[-1].x))
    # Shuffling the batch (with each example's key) shuffles the results, nothing else.
    perm = np.random.default_rng(0).permutation(len(Y))
    _, c3 = _run(X0[perm], Y0[perm], KEYS[perm], steps=3)
    np.testing.assert_array_equal(np.asarray(c3[-1].x), np.asarray(c1[-1].x)[perm])


def test_examples_without_a_start_try_noise_until_one_fools():
    state = INIT(KEYS, X0, Y0)
    state = state._replace(x=X0, phase=jnp.full_like(state.phase, NOISE))
    states, cands = _run(steps=6, state=state)
    state, cand = states[-1], cands[-1]
    found = np.asarray(state.phase) != NOISE
    assert found.mean() > 0.9
    pred = np.asarray(jnp.argmax(linear_apply(PARAMS, cand.x), axis=1))
    assert np.all(pred[found] != Y[found])
    assert _on_grid(cand.x)


# ---------------------------------------------------------------------------------------------
# Linear oracle, bundled.


def test_linear_oracle_min_norm():
    """Default budget (5,000 queries, 498 steps), white Gaussian directions on the 20-pixel toy.

    Measured: all 64 examples fooled; attained / analytic minimum distance: median 1.03, 94%
    within 10%, max 1.15 (the worst are the examples whose minimum is a few grid levels, where
    rounding to the 8-bit grid dominates).
    """
    a = surfree(basis="gaussian")
    r = bundle([a], linear_apply, PARAMS, X0, Y0, KEY, eps=0.1, norm="l2")
    s = r.best["min_norm"]
    assert np.all(np.asarray(r.queries) == 5000)
    m = np.asarray(s.score.misclassified)
    assert m.all()
    # Reported best points are adversarial, in the box and on the grid.
    pred = np.asarray(jnp.argmax(linear_apply(PARAMS, s.x), axis=1))
    assert np.all(pred != Y)
    assert _on_grid(s.x) and float(jnp.min(s.x)) >= 0 and float(jnp.max(s.x)) <= 1
    ratio = np.asarray(s.score.distortion) / min_distance(PARAMS, X, Y, "l2")
    assert ratio.min() >= 1 - 1e-4
    assert np.median(ratio) < 1.1 and np.mean(ratio < 1.1) >= 0.8 and ratio.max() < 1.3


def test_queries_follow_the_judging():
    """Under judging="float" the oracle sees unrounded points (the bundle judges them so)."""
    a = surfree(basis="gaussian", queries=200)
    r = bundle([a], linear_apply, PARAMS, X0, Y0, KEY, eps=0.1, norm="l2", judging="float")
    s = r.best["min_norm"]
    assert np.asarray(s.score.misclassified).any()
    assert not _on_grid(s.x)


# ---------------------------------------------------------------------------------------------
# The angle search against the reference (t-maho/SurFree, _alpha_binary_search): on a ball
# oracle everything farther than `radius` from x0 is adversarial, so on a circle of diameter 1
# the adversarial angles are exactly those with cos θ > radius.

BALL_SHAPE = (8, 8, 1)
BALL_X0 = jnp.full((8,) + BALL_SHAPE, 0.5 + 1e-3, jnp.float32)  # off the grid: no rounding


BALL_QUERIES = 30  # more than the first circle takes in either test below


@functools.cache
def _ball_program(gamma):
    """``radius -> x, phase, index, lo, hi`` of the state before each of BALL_QUERIES queries
    and after the last, from x_b = x0 + (1/8, ..., 1/8) (distance 1), phase SEARCH: init and
    every step in one program per attack, the radius traced (the tests share it)."""
    kwargs = {} if gamma is None else {"gamma": gamma}
    a = surfree(queries=1000, queries_per_step=1, basis="gaussian", **kwargs)

    def apply(params, x):
        centre, radius = params
        r = jnp.linalg.norm((x - centre[None]).reshape(x.shape[0], -1), axis=1)
        return jnp.stack([radius - r, jnp.zeros_like(r)], axis=1)

    @jax.jit
    def run(radius):
        model = LabelOracle(apply, (BALL_X0[0], radius))
        y = jnp.zeros(8, jnp.int32)
        state = a.init(a.config, KEYS[:8], BALL_X0, y, None, model, 0)
        state = state._replace(x=BALL_X0 + 1 / 8, phase=jnp.zeros_like(state.phase),
                               index=jnp.zeros_like(state.index))

        def body(s, _):
            s = a.step(a.config, s, model)[0]
            return s, s

        _, states = jax.lax.scan(body, state, None, length=BALL_QUERIES)
        fields = ("x", "phase", "index", "lo", "hi")
        return {f: jnp.concatenate([getattr(state, f)[None], getattr(states, f)]) for f in fields}

    return run


def _ball_run(radius, **kwargs):
    """States (their x, phase, index, lo and hi) after each query; see :func:`_ball_program`."""
    stacked = {k: np.asarray(v) for k, v in
               _ball_program(kwargs.get("gamma"))(jnp.float32(radius)).items()}
    return [SimpleNamespace(**{k: v[t] for k, v in stacked.items()})
            for t in range(BALL_QUERIES + 1)]


def _first_circle(states):
    """The states of the first circle's queries, up to the one that starts the next circle."""
    for k in range(1, len(states)):
        if int(states[k].phase[0]) == 0 and int(states[k].index[0]) == 0:
            return states[: k + 1]
    raise AssertionError("the first circle did not end")


def _distance(x):
    return np.linalg.norm((np.asarray(x) - np.asarray(BALL_X0)).reshape(8, -1), axis=1)


def test_success_at_the_largest_angle_extends_past_theta_max():
    """radius 0.3: every angle below arccos 0.3 = 72.5° is adversarial. The first trial (+30°)
    succeeds; the reference then steps the angle on by θ_max / T while it stays adversarial
    (its upper-range loop) and bisects from there, so the first circle ends near the ball
    (distance 0.3), not at cos(30° + 10°) = 0.77 or farther (a refinement capped at
    θ_max + θ_max / T)."""
    circle = _first_circle(_ball_run(0.3))
    d = _distance(circle[-1].x)
    assert np.all(d >= 0.3) and np.all(d < 0.4), d
    assert np.all(d < np.cos(np.radians(40.0)) - 0.3)


def test_angle_bisection_stops_at_gamma():
    """radius 0.9 (adversarial below 25.8°): ±30° fail, +20° succeeds, REFINE bisects [20°, 30°]
    and stops (reference rule) at the first |cos(hi) - cos(lo)| <= gamma = 0.01: after 3
    bisections, not search_steps = 7; the queries left go to the next circle. gamma = 0: all
    7."""
    for gamma, bisections in ((None, 3), (0.0, 7)):
        kwargs = {} if gamma is None else {"gamma": gamma}
        circle = _first_circle(_ball_run(0.9, **kwargs))
        assert len(circle) <= 15  # the first circle ends within 14 queries
        phases = [int(s.phase[0]) for s in circle]
        assert phases[:3] == [0, 0, 0] and phases[-1] == 0
        refine = [s for s in circle if int(s.phase[0]) == 1]
        assert len(refine) == bisections, phases
        gap = lambda s: np.abs(np.cos(np.asarray(s.hi)) - np.cos(np.asarray(s.lo)))  # noqa: E731
        if gamma is None:
            assert all(np.all(gap(s) > 0.01) for s in refine)
            assert np.all(gap(circle[-1]) <= 0.01)
        d = _distance(circle[-1].x)
        assert np.all(d >= 0.9) and np.all(d < np.cos(np.radians(25.0)) + 1e-3)
