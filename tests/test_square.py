"""Square Attack: factory, exact query count, schedule, masks, feasibility, linear oracles."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import losses, norms
from jaxbundle.attacks.base import Attack, Candidate, ScoreOracle, per_example_keys
from jaxbundle.attacks.score_based.square import (
    SquareState,
    fraction,
    pseudo_gaussian,
    side,
    square,
    window_mask,
)
from jaxbundle.bundler import bundle
from toys import KEY, images, linear_apply, linear_problem, min_distance

EPS = {"linf": 0.03, "l2": 0.1}


def _setup(norm, n=16, shape=(4, 5, 1), seed=0, spread=0.05, eps=None):
    d = int(np.prod(shape))
    params, x, y = linear_problem(seed=seed, n=n, d=d, spread=spread)
    eps = EPS[norm] if eps is None else eps
    return (
        ScoreOracle(linear_apply, params),
        params,
        images(x, shape),
        jnp.asarray(y),
        jnp.full((n,), eps, jnp.float32),
        per_example_keys(KEY, jnp.arange(n)),
    )


@functools.partial(jax.jit, static_argnames=("attack", "steps"))
def _run(attack: Attack, steps: int, params, keys, x, y, eps):
    """Initial state, the stacked states after each step and the stacked candidates."""
    model = ScoreOracle(linear_apply, params)
    state = attack.init(attack.config, keys, x, y, eps, model, jnp.int32(0))

    def body(s, _):
        s2, cand = attack.step(attack.config, s, model)
        return s2, (s2, cand)

    _, (states, cands) = jax.lax.scan(body, state, None, length=steps)
    return state, states, cands


def _trajectory(attack: Attack, params, keys, x, y, eps, steps: int):
    return _run(attack, steps, params, keys, x, y, eps)


# ---------------------------------------------------------------------------------------------
# Factory.


def test_factory_defaults():
    a = square()
    assert isinstance(a, Attack)
    assert (a.name, a.kind, a.norm, a.goal) == ("square", "score-based", "linf", "misclassify")
    assert a.black_box and a.num_restarts == 1 and a.gradients == 0
    assert a.init_queries == 1 and a.queries_per_step == 1
    assert a.num_steps == 4999 and a.queries == 5000
    assert a.config.p_init == 0.8
    assert square("l2").config.p_init == 0.1
    assert square("l2", queries=300, p_init=0.3).queries == 300
    assert square("linf", queries=2).num_steps == 1
    assert square(name="sq").name == "sq"
    assert square("l2", 77) == square("l2", 77), "equal attacks hit the jit cache"
    hash(square())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"norm": "l1"}, "norm"),
        ({"norm": "Linf"}, "norm"),
        ({"queries": 1}, "queries"),
        ({"queries": 0}, "queries"),
        ({"queries": 10.0}, "queries"),
        ({"p_init": 0.0}, "p_init"),
        ({"p_init": 1.5}, "p_init"),
        ({"p_init": -0.1}, "p_init"),
    ],
)
def test_factory_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        square(**kwargs)


# ---------------------------------------------------------------------------------------------
# Exact query counting: count oracle calls while tracing.


@pytest.mark.parametrize("norm", ["linf", "l2"])
@pytest.mark.parametrize("shape", [(4, 5, 1), (6, 6, 3)])
def test_declared_queries_match_oracle_calls(norm, shape):
    attack = square(norm, queries=50)
    _, params, x, y, eps, keys = _setup(norm, n=4, shape=shape)
    calls = []

    def counting_apply(p, xx):
        calls.append(xx.shape)
        return linear_apply(p, xx)

    model = ScoreOracle(counting_apply, params)
    jax.make_jaxpr(lambda k: attack.init(attack.config, k, x, y, eps, model, jnp.int32(0)))(keys)
    assert len(calls) == attack.init_queries
    # The state's shapes are all the step's trace needs (no eager run of init, op by op).
    state = jax.eval_shape(
        lambda k: attack.init(attack.config, k, x, y, eps, ScoreOracle(linear_apply, params), 0),
        keys)
    calls.clear()
    jax.make_jaxpr(lambda s: attack.step(attack.config, s, model))(state)
    assert len(calls) == attack.queries_per_step
    assert all(c == x.shape for c in calls), "one query = one batch of images"


# ---------------------------------------------------------------------------------------------
# Schedule and square geometry.


def _fraction_reference(t, num_steps, p_init):
    it = int(t / num_steps * 10000)
    for i, th in enumerate((10, 50, 200, 500, 1000, 2000, 4000, 6000, 8000)):
        if it <= th:
            return p_init / 2**i
    return p_init / 2**9


@pytest.mark.parametrize("num_steps", [10000, 4999, 999, 37])
def test_fraction_schedule(num_steps):
    t = np.arange(num_steps)
    got = np.asarray(fraction(jnp.asarray(t), num_steps, 0.8))
    want = np.array([_fraction_reference(i, num_steps, 0.8) for i in t], np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    if num_steps == 10000:
        assert got[10] == np.float32(0.8) and got[11] == np.float32(0.4)
        assert got[8000] == np.float32(0.8 / 256) and got[8001] == np.float32(0.8 / 512)


def test_fraction_schedule_of_a_long_run_does_not_overflow():
    """Past step 214,748 an int32 product t * 10000 wraps around (the schedule would restart
    at p_init); the schedule must follow floor(t * 10000 / N) exactly at any length."""
    num_steps = 3_000_017
    t = np.concatenate([np.arange(0, num_steps, 9973), [num_steps - 1, 214_748, 214_749]])
    got = np.asarray(fraction(jnp.asarray(t, jnp.int32), num_steps, 0.8))
    thresholds = (10, 50, 200, 500, 1000, 2000, 4000, 6000, 8000)
    halvings = [sum(int(i) * 10000 // num_steps > th for th in thresholds) for i in t]
    np.testing.assert_allclose(got, 0.8 / 2.0 ** np.asarray(halvings), rtol=1e-6)
    assert got[-3] == np.float32(0.8 / 512)


def test_side_lengths():
    p = jnp.asarray([0.8, 0.1, 0.8 / 512, 1.0])
    np.testing.assert_array_equal(side(p, 28, 28, "linf"), [25, 9, 1, 27])
    np.testing.assert_array_equal(side(p, 4, 5, "linf"), [3, 1, 1, 3])  # at most h - 1
    np.testing.assert_array_equal(side(p, 28, 28, "l2"), [25, 9, 3, 27])  # odd, at least 3
    np.testing.assert_array_equal(side(p, 4, 5, "l2"), [3, 3, 3, 3])
    np.testing.assert_array_equal(side(jnp.asarray([0.8]), 1, 20, "linf"), [1])


def test_window_mask_on_28x28():
    rng = np.random.default_rng(0)
    b, h, w = 64, 28, 28
    s = rng.integers(1, 28, size=b)
    oh = np.array([rng.integers(0, h - k + 1) for k in s])
    ow = np.array([rng.integers(0, w - k + 1) for k in s])
    got = np.asarray(window_mask(jnp.asarray(oh), jnp.asarray(ow), jnp.asarray(s), h, w))
    want = np.zeros((b, h, w), bool)
    for i in range(b):
        want[i, oh[i] : oh[i] + s[i], ow[i] : ow[i] + s[i]] = True
    np.testing.assert_array_equal(got, want)


def _rectangle_reference(a, b):
    """Concentric rectangles by explicit accumulation, as described in the paper."""
    out = np.zeros((a, b))
    ci, cj = a // 2, b // 2
    for k in range(max(ci, cj) + 1):
        out[max(ci - k, 0) : ci + k + 1, max(cj - k, 0) : cj + k + 1] += 1.0 / (k + 1) ** 2
    return out / np.linalg.norm(out) if a else out


def _pseudo_gaussian_reference(s):
    m = np.zeros((s, s))
    m[: s // 2] = _rectangle_reference(s // 2, s)
    m[s // 2 :] = -_rectangle_reference(s - s // 2, s)
    return m / np.linalg.norm(m)


@pytest.mark.parametrize("transpose", [False, True])
def test_pseudo_gaussian_pattern(transpose):
    h, w = 11, 13
    sides = np.arange(1, 11)
    oh = np.array([(3 * k) % (h - k + 1) for k in sides])
    ow = np.array([(5 * k) % (w - k + 1) for k in sides])
    got = np.asarray(
        jax.jit(pseudo_gaussian, static_argnums=(4, 5))(  # one program, not op by op
            jnp.asarray(oh), jnp.asarray(ow), jnp.asarray(sides),
            jnp.full(sides.shape, transpose), h, w,
        )
    )
    for i, k in enumerate(sides):
        ref = _pseudo_gaussian_reference(k)
        want = np.zeros((h, w))
        want[oh[i] : oh[i] + k, ow[i] : ow[i] + k] = ref.T if transpose else ref
        np.testing.assert_allclose(got[i], want, atol=1e-6, err_msg=f"side {k}")
    np.testing.assert_allclose(np.linalg.norm(got.reshape(len(sides), -1), axis=1), 1, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Direct init/step: feasibility, logits, accept rule, determinism.

SHAPES = [(4, 5, 1), (28, 28, 1), (6, 7, 3)]


@pytest.mark.parametrize("norm", ["linf", "l2"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_iterates_feasible_and_accept_rule(norm, shape):
    """Box and ball for every iterate and candidate; candidate logits are the oracle's; the
    loss only decreases; fooled examples stop changing; state.loss is x's margin loss."""
    # spread 0.5: pixels all over the box, many at the edges, so the box constraint binds.
    eps = {"linf": 0.2, "l2": 1.0}[norm]
    _, params, x, y, e, keys = _setup(norm, n=8, shape=shape, spread=0.5, eps=eps)
    attack = square(norm, queries=41, grid=False)
    state0, states, cands = _trajectory(attack, params, keys, x, y, e, attack.num_steps)
    assert isinstance(state0, SquareState) and isinstance(cands, Candidate)
    xs = np.concatenate([np.asarray(state0.x)[None], np.asarray(states.x), np.asarray(cands.x)])
    assert xs.min() >= 0.0 and xs.max() <= 1.0
    dist = np.asarray(jax.vmap(lambda p: norms.norm(p - x, norm))(jnp.asarray(xs)))
    assert np.all(dist <= eps * (1 + 1e-5) + 1e-6), dist.max()
    if norm == "linf":  # the perturbation is +-eps wherever the box allows it
        assert np.all(dist[0] > eps * 0.99)
    # Logits recomputed on another batch shape: XLA:CPU's matmul kernels round differently
    # (up to ~4e-5 over 784 pixels on some CPUs).
    flat_c = cands.x.reshape((-1,) + x.shape[1:])
    np.testing.assert_allclose(
        cands.logits.reshape(-1, 4), linear_apply(params, flat_c), rtol=1e-4, atol=1e-4
    )
    loss = np.concatenate([np.asarray(state0.loss)[None], np.asarray(states.loss)])
    assert np.all(np.diff(loss, axis=0) <= 0)
    steps = attack.num_steps
    flat_s = states.x.reshape((-1,) + x.shape[1:])
    want = -losses.margin(linear_apply(params, flat_s), jnp.tile(y, steps)).reshape(steps, -1)
    np.testing.assert_allclose(loss[1:], want, rtol=1e-4, atol=1e-4)
    prev = np.concatenate([np.asarray(state0.x)[None], np.asarray(states.x)[:-1]])
    fooled = loss[:-1] < 0
    assert fooled.any() and (~fooled).any(), "the test should see both kinds"
    moved = np.any((np.asarray(states.x) != prev).reshape(len(prev), 8, -1), axis=-1)
    assert not np.any(moved & fooled), "a fooled example must stay put"
    np.testing.assert_array_equal(np.asarray(states.t)[:, 0], np.arange(1, attack.num_steps + 1))


def test_linf_proposals_always_change_the_image():
    """The sign pattern is drawn among those that change the window: no wasted queries."""
    _, params, x, y, eps, keys = _setup("linf", n=8, shape=(4, 5, 1), eps=0.005)
    # same program as the feasibility test: no recompile
    attack = square("linf", queries=41, grid=False)
    state0, states, cands = _trajectory(attack, params, keys, x, y, eps, attack.num_steps)
    prev = np.concatenate([np.asarray(state0.x)[None], np.asarray(states.x)[:-1]])
    unfooled = np.concatenate([np.asarray(state0.loss)[None], np.asarray(states.loss)[:-1]]) >= 0
    assert unfooled.mean() > 0.5
    changed = np.any((np.asarray(cands.x) != prev).reshape(len(prev), 8, -1), axis=-1)
    assert np.all(changed[unfooled])
    # Late steps use 1x1 squares (p_init / 512 of 20 pixels): still always a change.
    last = fraction(jnp.asarray(attack.num_steps - 1), attack.num_steps, 0.8)
    assert int(side(last, 4, 5, "linf")) == 1


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_deterministic_and_per_example(norm):
    _, params, x, y, eps, keys = _setup(norm, n=8, shape=(6, 7, 3))
    # The attack, shapes and steps of the 6x7x3 feasibility test: its compiled program.
    attack = square(norm, queries=41, grid=False)
    steps = attack.num_steps
    a = _trajectory(attack, params, keys, x, y, eps, steps)[1].x
    b = _trajectory(attack, params, keys, x, y, eps, steps)[1].x
    np.testing.assert_array_equal(a, b)
    other = per_example_keys(jax.random.key(1), jnp.arange(8))
    c = _trajectory(attack, params, other, x, y, eps, steps)[1].x
    assert not np.allclose(a, c)
    # Each example's trajectory depends on its own key and data only, not on the batch.
    perm = np.array([5, 2, 7, 0, 1, 6, 3, 4])
    d = _trajectory(attack, params, keys[perm], x[perm], y[perm], eps[perm], steps)[1].x
    np.testing.assert_allclose(d, a[:, perm], rtol=0, atol=1e-6)


def test_jit_and_vmap_over_restarts():
    model, _, x, y, eps, keys = _setup("l2", n=4)
    attack = square("l2", queries=10)

    def run(r):
        k = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, r)
        state = attack.init(attack.config, k, x, y, eps, model, r)
        new_state, cand = attack.step(attack.config, state, model)
        assert jax.tree.structure(state) == jax.tree.structure(new_state)
        for u, v in zip(jax.tree.leaves(state), jax.tree.leaves(new_state)):
            assert u.shape == v.shape and u.dtype == v.dtype
        return new_state.x

    both = jax.jit(lambda r: (jax.vmap(run)(r), run(r[1])))
    batched, single = both(jnp.arange(2, dtype=jnp.int32))
    np.testing.assert_allclose(batched[1], single, rtol=1e-6, atol=1e-6)
    assert not np.allclose(batched[0], batched[1])


# ---------------------------------------------------------------------------------------------
# Linear oracles through the bundler.


@pytest.mark.parametrize(
    "norm, shape, eps_scale, queries",
    [
        # 4x5x1 images, eps around the median analytic distance.
        ("linf", (4, 5, 1), 1.25, 300),
        ("l2", (4, 5, 1), 1.25, 300),
        # 28x28x1: a random linear model has no spatial structure, which Square relies on;
        # a larger eps (relative to the median distance) keeps it within a small budget.
        ("linf", (28, 28, 1), 2.0, 1000),
        ("l2", (28, 28, 1), 2.5, 1500),
    ],
    ids=["linf-4x5", "l2-4x5", "linf-28x28", "l2-28x28"],
)
def test_linear_oracle(norm, shape, eps_scale, queries):
    """Distance < eps/2: always fooled within the budget; distance > eps: never."""
    small = shape == (4, 5, 1)
    # 16 examples at 28x28 (the first 16 of the 32 this ran on: all fooled there too); the
    # run, not the compile, is most of the 28x28 cases' time, and it scales with the batch.
    n, d = (128, 20) if small else (16, 784)
    params, x, y = linear_problem(seed=0 if small else 1, n=n, d=d)
    dist = min_distance(params, x, y, norm)
    eps = float(np.median(dist)) * eps_scale
    r = bundle(
        [square(norm, queries=queries)], linear_apply, params, images(x, shape), jnp.asarray(y),
        KEY, eps=eps, norm=norm, judging="float",
    )
    fooled = np.asarray(r.best["misclassify"].score.misclassified)
    easy, hard = dist < 0.5 * eps, dist > eps
    assert easy.sum() >= 5 and (hard.sum() >= 5 or not small)  # 784-d distances concentrate
    print(
        f"\nsquare {norm} {shape} {queries} queries, eps {eps:.4f}: fooled {fooled.mean():.2f}; "
        f"d < eps/2 {fooled[easy].mean():.2f} ({easy.sum()}), "
        f"eps/2 <= d <= eps {fooled[~easy & ~hard].mean():.2f} ({(~easy & ~hard).sum()}), "
        f"d > eps {fooled[hard].sum()} of {hard.sum()}"
    )
    assert fooled[easy].all(), dist[easy & ~fooled] / eps
    assert not fooled[hard].any()
    assert np.all(np.asarray(r.best["misclassify"].score.distortion) <= eps * (1 + 1e-5) + 1e-6)
    np.testing.assert_array_equal(r.queries, queries)


def test_autoattack_schedule_is_not_rescaled():
    """AutoAttack runs Square with rescale_schedule=False: with 5,000 queries p halves after
    iterations 10, 50, 200, 500, 1000, 2000 and 4000 as written, never at 6000 or 8000."""
    t = jnp.asarray([0, 10, 11, 51, 201, 501, 1001, 2001, 4000, 4001, 4998])
    got = np.asarray(fraction(t, 4999, 0.8, rescale=False))
    halvings = [0, 0, 1, 2, 3, 4, 5, 6, 6, 7, 7]
    np.testing.assert_allclose(got, 0.8 * 0.5 ** np.asarray(halvings), rtol=1e-6)
    a = square("linf", queries=5000, rescale_schedule=False)
    assert a.config.rescale_schedule is False and a.queries == 5000
