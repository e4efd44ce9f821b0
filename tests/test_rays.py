"""RayS (decision-based, min-norm Linf): factory, exact query counts, the block schedule,
feasibility, determinism, and the linear oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import norms
from jaxbundle.attacks.base import Attack, Candidate, LabelOracle, per_example_keys
from jaxbundle.attacks.rays import NONE_FOUND, _advance, flip_mask, max_stage, rays
from jaxbundle.bundler import bundle
from toys import KEY, images, linear_apply, linear_problem, min_distance, run_steps as _run

B = 8


def _setup(seed=1):
    params, x, y = linear_problem(n=B, k=4, seed=seed)
    x = images(x)
    keys = per_example_keys(KEY, jnp.arange(B))
    eps = jnp.full((B,), 0.1, jnp.float32)
    return params, LabelOracle(linear_apply, params), x, jnp.asarray(y), eps, keys


def test_factory():
    a = rays()
    assert isinstance(a, Attack) and a == rays()
    hash(a)
    assert (a.name, a.kind, a.norm, a.goal) == ("rays", "decision-based", "linf", "min_norm")
    assert (a.num_steps, a.num_restarts, a.gradients_per_step) == (10000, 1, 0)
    assert (a.init_queries, a.queries_per_step, a.queries) == (1, 1, 10001)
    assert rays(steps=50, restarts=3, name="r").queries == 153


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(steps=0), "steps"), (dict(search_steps=0), "search_steps"), (dict(restarts=0), "restarts"),
     (dict(steps=2.5), "steps")],
)
def test_factory_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rays(**kwargs)


def test_declared_queries_are_exact():
    params, _, x, y, eps, keys = _setup()
    rows = []

    def counting_apply(p, xx):
        rows.append(xx.shape[0])
        return linear_apply(p, xx)

    model = LabelOracle(counting_apply, params)
    a = rays(steps=3)
    jax.make_jaxpr(lambda: a.init(a.config, keys, x, y, eps, model, 0))()
    assert sum(rows) == a.init_queries * B
    state = a.init(a.config, keys, x, y, eps, LabelOracle(linear_apply, params), 0)
    rows.clear()
    jax.make_jaxpr(lambda s: a.step(a.config, s, model))(state)
    assert sum(rows) == a.queries_per_step * B


@pytest.mark.parametrize("dim", [1, 5, 20, 64])
def test_schedule_visits_every_block_then_every_pixel(dim):
    """One cycle: stages 0..ceil(log2 D) with min(2^s, D) non-empty blocks that tile the input;
    the last stage flips each pixel alone; then it starts again from the whole vector."""
    stage, block = jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32)
    cycle = sum(min(2**s, dim) for s in range(max_stage(dim) + 1))
    seen = {}
    for _ in range(cycle):
        mask = np.asarray(flip_mask((dim,), stage, block))[0]
        assert (mask == -1).any()
        seen.setdefault(int(stage[0]), []).append(mask == -1)
        stage, block = _advance(stage, block, dim)
    assert (int(stage[0]), int(block[0])) == (0, 0)
    for s, masks in seen.items():
        np.testing.assert_array_equal(np.sum(masks, axis=0), 1)  # a partition of the pixels
    np.testing.assert_array_equal(np.asarray(seen[max_stage(dim)]), np.eye(dim, dtype=bool))
    assert np.asarray(seen[0]).all()


def test_iterates_feasible_and_state_consistent():
    """In the box and on the pixel grid; state.x is adversarial at exactly radius k_best / 255
    (the toy images sit mid-box, so the box does not clip these radii)."""
    params, model, x, y, eps, keys = _setup()
    a = rays(steps=60)
    states, cands = _run(a, model, keys, x, y, eps, 60)
    assert jax.tree.structure(states[0]) == jax.tree.structure(states[-1])
    for s0, s1 in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[-1])):
        assert s0.shape == s1.shape and s0.dtype == s1.dtype and s0.shape[0] == B
    for point in [s.x for s in states] + [c.x for c in cands]:
        assert float(point.min()) >= 0.0 and float(point.max()) <= 1.0
        np.testing.assert_allclose(point * 255, np.round(point * 255), atol=1e-3)
    for c in cands:
        assert isinstance(c, Candidate) and c.logits is None
    k = [np.asarray(s.k_best) for s in states]
    assert all(np.all(b <= a_) for a_, b in zip(k, k[1:])), "the best radius never grows"
    last = states[-1]
    found = np.asarray(last.k_best) < NONE_FOUND
    assert found.all()
    pred = np.argmax(np.asarray(linear_apply(params, last.x)), axis=1)
    assert np.all(pred != np.asarray(y))
    np.testing.assert_allclose(norms.norm(last.x - x, "linf") * 255, last.k_best, atol=1e-3)
    assert np.all(np.abs(np.asarray(last.d)) == 1)


def test_deterministic_restarts_and_per_example():
    params, model, x, y, eps, keys = _setup()
    a = rays(steps=20, restarts=2)
    first = _run(a, model, keys, x, y, eps, 20)[0][-1]
    np.testing.assert_array_equal(first.x, _run(a, model, keys, x, y, eps, 20)[0][-1].x)
    s0 = a.init(a.config, keys, x, y, eps, model, 0)
    s1 = a.init(a.config, keys, x, y, eps, model, 1)
    assert np.all(np.asarray(s0.d) == 1) and not np.all(np.asarray(s1.d) == 1)
    alone = _run(a, model, keys[:1], x[:1], y[:1], eps[:1], 20)[0][-1]
    np.testing.assert_array_equal(alone.x, first.x[:1])
    np.testing.assert_array_equal(alone.k_best, first.k_best[:1])


def test_linear_oracle_min_norm():
    """With its default budget RayS reaches the grid optimum ceil(255 d*) / 255 of the exact
    minimal distance d* (the optimal Linf perturbation of a linear model is a sign vector)."""
    params, x, y = linear_problem(n=100, k=4, seed=1)
    dist = min_distance(params, x, y, "linf")
    a = rays()
    r = bundle([a], linear_apply, params, images(x), jnp.asarray(y), KEY, eps=0.1, norm="linf",
               judging="float", goals=("min_norm",))
    best = r.best["min_norm"].score
    assert np.asarray(best.misclassified).all()
    attained = np.asarray(best.distortion)
    ratio = attained / dist
    grid = np.ceil(dist * 255 - 1e-4) / 255  # no 8-bit image is closer than this
    assert ratio.min() >= 1 - 1e-4  # sound
    assert np.median(ratio) <= 1.05 and np.mean(ratio <= 1.1) >= 0.9
    np.testing.assert_allclose(np.median(attained / grid), 1.0, atol=1e-4)
    # misclassify: exactly those within eps
    success = np.asarray(r.attack_success[0])
    assert 10 <= success.sum() <= 90
    np.testing.assert_array_equal(success, attained <= 0.1 * (1 + 1e-5) + 1e-6)
    np.testing.assert_array_equal(r.queries, np.full(100, 10001))
