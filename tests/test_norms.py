"""Property tests for jaxbundle.norms: norms, projections, steepest directions, quantisation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxbundle import norms
from norm_helpers import LEVELS, NAMES, grid, in_ball, on_grid, project, quantize
from norm_helpers import sphere_perturbation, steps

ORD = {"linf": np.inf, "l2": 2, "l1": 1}
DUAL = {"linf": "l1", "l2": "l2", "l1": "linf"}
OPTAX_BALL = {
    "linf": optax.projections.projection_linf_ball,
    "l2": optax.projections.projection_l2_ball,
    "l1": optax.projections.projection_l1_ball,
}

OPTAX_BATCHED = {k: jax.jit(jax.vmap(f)) for k, f in OPTAX_BALL.items()}

F32 = dict(allow_nan=False, allow_infinity=False, allow_subnormal=False, width=32)

# XLA compiles once per (function, shape, static args); a few fixed shapes keep this fast.
SHAPES = ((1, 20), (3, 3), (4, 4, 4, 1))

norm = jax.jit(norms.norm, static_argnames="name")
normalize = jax.jit(norms.normalize, static_argnames="name")
project_ball = jax.jit(norms.project_ball, static_argnames="name")


# --- Strategies -------------------------------------------------------------------------


def shapes():
    return st.sampled_from(SHAPES)


def arrays(shape, lo=-2.0, hi=2.0):
    return hnp.arrays(np.float32, shape, elements=st.floats(lo, hi, **F32))


@st.composite
def batch(draw, lo=-2.0, hi=2.0):
    return draw(arrays(draw(shapes()), lo, hi))


def radius(hi=4.0):
    return st.one_of(st.just(0.0), st.floats(0.0, hi, **F32))


@st.composite
def eps_for(draw, b, hi=4.0):
    """A per-example float32 eps ``[B]`` (all equal half of the time, like a scalar eps)."""
    if draw(st.booleans()):
        return np.full((b,), draw(radius(hi)), np.float32)
    return draw(hnp.arrays(np.float32, (b,), elements=radius(hi)))


@st.composite
def batch_and_eps(draw, lo=-2.0, hi=2.0, eps_hi=4.0):
    x = draw(batch(lo, hi))
    return x, draw(eps_for(x.shape[0], eps_hi))


def eps_rows(eps, b):
    return np.broadcast_to(np.asarray(eps, np.float32), (b,)).astype(np.float64)


def flat64(x):
    x = np.asarray(x)
    return x.reshape(x.shape[0], -1).astype(np.float64)


def np_norm(x, name):
    return np.linalg.norm(flat64(x), ord=ORD[name], axis=1)


def l1_slack(x):
    """Float32 rounding of the L1 projection: about one ulp of max|x| per active coordinate.

    Looser than in_ball's slack; see test_project_l1_exactly_feasible_with_ties.
    """
    f = flat64(x)
    return 2.0 * f.shape[1] * np.abs(f).max(axis=1) * 2.0**-23


def assert_in_ball(delta, eps, name, rel=1e-5, abs_=1e-6, slack=0.0):
    n = np_norm(delta, name)
    bound = eps_rows(eps, n.shape[0]) * (1 + rel) + abs_ + slack
    assert np.all(n <= bound), (name, n, bound)


# --- norm -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@given(x=batch())
def test_norm_matches_numpy(name, x):
    got = np.asarray(norm(jnp.asarray(x), name))
    assert got.shape == (x.shape[0],)
    np.testing.assert_allclose(got, np_norm(x, name), rtol=1e-5, atol=1e-6)


def test_norm_hand_values():
    d = jnp.array([[3.0, -4.0, 0.0], [0.0, 0.0, 0.0], [-1.0, 1.0, -1.0]])
    np.testing.assert_allclose(norm(d, "linf"), [4.0, 0.0, 1.0])
    np.testing.assert_allclose(norm(d, "l2"), [5.0, 0.0, np.sqrt(3.0)], rtol=1e-6)
    np.testing.assert_allclose(norm(d, "l1"), [7.0, 0.0, 3.0])


@pytest.mark.parametrize(
    "fn",
    [
        lambda: norms.check_norm("l0"),
        lambda: norms.norm(jnp.ones((2, 3)), "l0"),
        lambda: norms.project_ball(jnp.ones((2, 3)), 1.0, "L2"),
        lambda: norms.normalize(jnp.ones((2, 3)), "linf2"),
    ],
)
def test_unknown_norm_raises(fn):
    with pytest.raises(ValueError):
        fn()


def test_check_norm_accepts_known():
    for name in NAMES:
        assert norms.check_norm(name) == name


@pytest.mark.parametrize("name", NAMES)
@given(data=batch_and_eps())
def test_in_ball_is_norm_below_eps_with_slack(name, data):
    x, eps = data
    n = np.asarray(norm(jnp.asarray(x), name)).astype(np.float64)
    got = np.asarray(in_ball(jnp.asarray(x), jnp.asarray(eps), name))
    e = eps_rows(eps, x.shape[0])
    bound = e * (1 + norms.BALL_RTOL) + norms.BALL_ATOL
    clear = np.abs(n - bound) > 1e-6 * np.maximum(1.0, bound)  # away from float ties
    np.testing.assert_array_equal(got[clear], (n <= bound)[clear])


def test_in_ball_slack_is_tiny():
    # Far below one pixel level: 1% of a level outside an eps 0.3 ball is outside.
    assert 0 < norms.BALL_RTOL <= 1e-4 and 0 < norms.BALL_ATOL <= 1e-5
    delta = jnp.array([[0.3, -0.1, 0.0], [0.3 + 0.01 / 255, 0.0, 0.0]], jnp.float32)
    np.testing.assert_array_equal(norms.in_ball(delta, 0.3, "linf"), [True, False])


def test_per_example_broadcasts():
    x = jnp.zeros((3, 4, 4, 1))
    v = jnp.arange(3.0)
    out = norms.per_example(v, x)
    assert out.shape == (3, 1, 1, 1)
    np.testing.assert_array_equal((x + out)[:, 2, 1, 0], [0.0, 1.0, 2.0])


# --- project_ball -----------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@given(data=batch_and_eps())
def test_project_ball_feasible_and_idempotent(name, data):
    x, eps = data
    p = project_ball(jnp.asarray(x), eps, name)
    assert p.shape == x.shape and p.dtype == jnp.float32
    assert_in_ball(p, eps, name, slack=l1_slack(x) if name == "l1" else 0.0)
    p2 = project_ball(p, eps, name)
    np.testing.assert_allclose(np.asarray(p2), np.asarray(p), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
@given(x=batch(), factor=st.sampled_from([1.0, 1.5, 1e3]), per_example=st.booleans())
def test_project_ball_is_identity_inside(name, x, factor, per_example):
    n = np.asarray(norm(jnp.asarray(x), name))
    eps = n * np.float32(factor) if per_example else float(np.max(n)) * factor
    p = np.asarray(project_ball(jnp.asarray(x), eps, name))
    if factor > 1:
        np.testing.assert_array_equal(p, x)
    else:  # on the sphere: another summation order may see the norm one ulp above eps
        np.testing.assert_allclose(p, x, rtol=0, atol=4 * 2.0**-23 * np.abs(x).max())


@pytest.mark.parametrize("name", NAMES)
@given(data=batch_and_eps())
def test_project_ball_matches_optax(name, data):
    x, eps = data
    b = x.shape[0]
    e = eps_rows(eps, b).astype(np.float32)
    flat = jnp.asarray(x.reshape(b, -1))
    ref = np.asarray(OPTAX_BATCHED[name](flat, jnp.asarray(e)))
    # optax divides 0/0 on a zero radius (or a zero row with eps**2 underflowing); the
    # projection of 0, and onto {0}, is 0.
    zero = (e[:, None] == 0) | ~np.any(x.reshape(b, -1) != 0, axis=1, keepdims=True)
    ref = np.where(zero, 0.0, ref)
    got = np.asarray(project_ball(jnp.asarray(x), eps, name)).reshape(b, -1)
    # optax's L2 ball squares norms and radii: below ~1e-19 they underflow to inf / nan.
    fine = np.all(np.isfinite(ref), axis=1)
    assert fine.any() or np.abs(x).max() < 1e-18 or e.max() < 1e-18
    np.testing.assert_allclose(got[fine], ref[fine], rtol=1e-5, atol=2e-5)


def _l1_projection_reference(v, eps):
    """Euclidean projection onto the L1 ball in float64 by bisection on the threshold."""
    a = np.abs(v)
    if a.sum() <= eps:
        return v.copy()
    lo, hi = 0.0, a.max()
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if np.maximum(a - mid, 0).sum() > eps:
            lo = mid
        else:
            hi = mid
    return np.sign(v) * np.maximum(a - 0.5 * (lo + hi), 0)


@given(data=batch_and_eps())
def test_project_l1_is_the_euclidean_projection(data):
    x, eps = data
    b = x.shape[0]
    e = eps_rows(eps, b)
    v = flat64(x)
    p = flat64(project_ball(jnp.asarray(x), eps, "l1"))
    for i in range(b):
        ref = _l1_projection_reference(v[i], e[i])
        np.testing.assert_allclose(p[i], ref, atol=2e-5)
        if np.abs(v[i]).sum() <= e[i]:
            continue
        # KKT structure: p = sign(v) * max(|v| - theta, 0) with ||p||_1 = eps.
        np.testing.assert_allclose(np.abs(p[i]).sum(), e[i], rtol=1e-5, atol=1e-5)
        assert np.all(p[i] * v[i] >= 0)  # never flips a sign
        active = np.abs(p[i]) > 0
        theta = np.abs(v[i]) - np.abs(p[i])
        if active.any():
            t = theta[active].mean()
            np.testing.assert_allclose(theta[active], t, atol=3e-5)
            assert np.all(np.abs(v[i])[~active] <= t + 3e-5)


@given(data=batch_and_eps(), seed=st.integers(0, 2**16))
def test_project_l1_beats_random_feasible_points(data, seed):
    x, eps = data
    b = x.shape[0]
    e = eps_rows(eps, b)
    v = flat64(x)
    p = flat64(project_ball(jnp.asarray(x), eps, "l1"))
    rng = np.random.default_rng(seed)
    for i in range(b):
        q = rng.standard_normal((64, v.shape[1])) * rng.exponential(size=(64, v.shape[1]))
        q[:32] += v[i]  # some near v, some near the origin
        q *= np.minimum(1.0, e[i] / np.maximum(np.abs(q).sum(axis=1, keepdims=True), 1e-30))
        best = np.linalg.norm(v[i] - p[i])
        assert np.all(best <= np.linalg.norm(v[i] - q, axis=1) + 1e-5)


def test_project_l1_under_strict_rank_promotion():
    out = norms.project_ball(jnp.array([[3.0, -4.0, 0.5]]), 2.0, "l1")
    np.testing.assert_allclose(out, [[0.5, -1.5, 0.0]], atol=1e-6)


# Regression (fixed): norms._project_l1: with many tied |v_i| every coordinate is active and
# computing |v| - theta in float32 overshoots the radius by ~n ulp(max|v|): eps=0 gives a non-
# zero output, and [784] rows of 0.7 with eps=1 land outside in_ball's (goals.within's) slack


def test_project_l1_exactly_feasible_with_ties():
    v = jnp.full((2, 784), 0.7, jnp.float32)
    eps = jnp.array([0.0, 1.0], jnp.float32)
    p = project_ball(v, eps, "l1")
    ok = in_ball(p, eps, "l1")
    assert bool(jnp.all(p[0] == 0)) and bool(jnp.all(ok)), np.asarray(norm(p, "l1"))


@pytest.mark.parametrize("name", NAMES)
@given(
    x=arrays((4, 4, 4, 1)),
    e=radius(),
)
def test_scalar_eps_equals_broadcast_eps(name, x, e):
    """A Python-float eps means the same eps for every example."""
    x0 = np.clip(x, 0, 1)
    rows = np.full((x.shape[0],), e, np.float32)
    pairs = [
        (project_ball(x, e, name), project_ball(x, rows, name)),
        (project(x, x0, e, name), project(x, x0, rows, name)),
        (quantize(x, x0, e, name), quantize(x, x0, rows, name)),
        (in_ball(x, e, name), in_ball(x, rows, name)),
    ]
    for a, b in pairs:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_project_ball_hand_values():
    d = jnp.array([[3.0, -4.0, 0.5]])
    np.testing.assert_allclose(project_ball(d, 1.0, "linf"), [[1.0, -1.0, 0.5]])
    l2 = np.asarray(project_ball(jnp.array([[3.0, -4.0]]), 1.0, "l2"))
    np.testing.assert_allclose(l2, [[0.6, -0.8]], rtol=1e-6)
    # |v| = (3, 4, .5), eps 2: theta = (3 + 4 - 2) / 2 = 2.5 -> (0.5, -1.5, 0).
    np.testing.assert_allclose(project_ball(d, 2.0, "l1"), [[0.5, -1.5, 0.0]], atol=1e-6)
    np.testing.assert_array_equal(project_ball(d, 0.0, "l1"), np.zeros((1, 3)))
    np.testing.assert_array_equal(project_ball(d, 0.0, "l2"), np.zeros((1, 3)))


# --- project (box and ball) -------------------------------------------------------------


@st.composite
def image_pair(draw, eps_hi=4.0):
    shape = draw(shapes())
    x0 = draw(arrays(shape, 0.0, 1.0))
    noise = draw(arrays(shape, -2.0, 2.0))
    eps = draw(eps_for(shape[0], eps_hi))
    return x0, (x0 + noise).astype(np.float32), eps


@pytest.mark.parametrize("name", NAMES)
@given(data=image_pair())
def test_project_in_box_and_ball(name, data):
    x0, x, eps = data
    out = np.asarray(project(jnp.asarray(x), jnp.asarray(x0), eps, name))
    assert out.shape == x.shape
    assert np.all((out >= 0.0) & (out <= 1.0))
    slack = l1_slack(x - x0) if name == "l1" else 0.0
    assert_in_ball(out - x0.astype(np.float64), eps, name, slack=slack)


@given(data=image_pair())
def test_project_linf_is_exact_projection_onto_intersection(data):
    x0, x, eps = data
    e = eps_rows(eps, x.shape[0]).astype(np.float32).reshape((-1,) + (1,) * (x.ndim - 1))
    ref = np.clip(x, np.maximum(x0 - e, 0.0), np.minimum(x0 + e, 1.0))
    out = np.asarray(project(jnp.asarray(x), jnp.asarray(x0), eps, "linf"))
    np.testing.assert_allclose(out, ref, atol=1e-6)


def test_project_box():
    x = jnp.array([[-0.5, 0.25, 1.5]])
    np.testing.assert_array_equal(norms.project_box(x), [[0.0, 0.25, 1.0]])


# --- normalize --------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@given(g=batch())
def test_normalize_attains_the_dual_norm(name, g):
    n = np.asarray(normalize(jnp.asarray(g), name))
    assert n.shape == g.shape
    inner = (flat64(n) * flat64(g)).sum(axis=1)
    np.testing.assert_allclose(inner, np_norm(g, DUAL[name]), rtol=1e-5, atol=1e-5)
    # Unit length in the primal norm (zero rows give a zero direction; for tiny gradients
    # see test_normalize_l2_tiny_gradient_is_unit).
    size = np.abs(flat64(g)).max(axis=1)
    np.testing.assert_allclose(np_norm(n, name)[size > 1e-6], 1.0, rtol=1e-5)
    np.testing.assert_array_equal(np_norm(n, name)[size == 0], 0.0)


@given(g=batch())
def test_normalize_linf_is_sign(g):
    np.testing.assert_array_equal(np.asarray(normalize(jnp.asarray(g), "linf")), np.sign(g))


@given(g=batch())
def test_normalize_l2_is_direction_of_g(g):
    n = flat64(normalize(jnp.asarray(g), "l2"))
    f = flat64(g)
    length = np.linalg.norm(f, axis=1, keepdims=True)
    big = length[:, 0] > 1e-3
    np.testing.assert_allclose(n[big], (f / np.maximum(length, 1e-30))[big], rtol=1e-5, atol=1e-6)


@given(g=batch())
def test_normalize_l1_is_signed_one_hot_on_largest(g):
    n = flat64(normalize(jnp.asarray(g), "l1"))
    f = flat64(g)
    for i in range(f.shape[0]):
        nz = np.flatnonzero(n[i])
        if not np.any(f[i]):
            assert nz.size == 0
            continue
        assert nz.size == 1
        j = nz[0]
        assert abs(n[i, j]) == 1.0
        assert np.abs(f[i, j]) == np.abs(f[i]).max()
        assert np.sign(n[i, j]) == np.sign(f[i, j])


# Regression (fixed): norms.normalize('l2') divides by max(||g||_2, 1e-12), and ||g||_2
# underflows to 0 in float32 once |g_i| < ~1e-19: a non-zero gradient of size 1e-20 (cross-
# entropy on a confidently classified example) gets a direction of norm ~1e-8 instead of 1, so
# L2 PGD stalls where Linf (sign) does not


@pytest.mark.parametrize("size", [1e-14, 1e-20, 1e-30])
def test_normalize_l2_tiny_gradient_is_unit(size):
    g = jnp.array([[3.0, -4.0, 0.0]], jnp.float32) * jnp.float32(size)
    n = np.asarray(normalize(g, "l2"))
    np.testing.assert_allclose(n, [[0.6, -0.8, 0.0]], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", NAMES)
def test_normalize_zero_gradient_gives_zero(name):
    g = jnp.zeros((2, 4, 4, 1)).at[1, 2, 3, 0].set(-0.5)
    n = np.asarray(normalize(g, name))
    assert np.all(np.isfinite(n))
    np.testing.assert_array_equal(n[0], 0.0)
    assert n[1, 2, 3, 0] < 0


# --- quantize ---------------------------------------------------------------------------

@st.composite
def quantize_case(draw, off_grid=False):
    """Clean images ``x0`` (8-bit, or with ``off_grid`` anywhere in the box) and a point ``x`` in
    the box and the eps ball of x0; eps on a pixel level, between levels or random."""
    shape = draw(shapes())
    b = shape[0]
    if off_grid:
        x0 = draw(arrays(shape, 0.0, 1.0))
    else:
        x0 = grid(draw(hnp.arrays(np.int32, shape, elements=st.integers(0, LEVELS))))
    delta = draw(arrays(shape, -0.5, 0.5))
    name = draw(st.sampled_from(NAMES))
    # eps: a fraction of the raw perturbation's norm (so the ball binds often), whole or
    # fractional pixel levels, or random.
    raw = np.asarray(norm(jnp.asarray(delta), name))
    fracs = st.sampled_from([0.0, 0.3, 0.5, 0.99, 1.0, 2.0])
    frac = draw(hnp.arrays(np.float32, (b,), elements=fracs))
    eps = (raw * frac).astype(np.float32)
    kind = draw(st.sampled_from(["fraction", "level", "random"]))
    if kind == "level":
        steps_ = draw(st.sampled_from([1, 4, 7.905, 8, 51, 76.5, 127.5]))
        eps = np.full((b,), steps_ / LEVELS, np.float32)
    elif kind == "random":
        eps = draw(radius(1.0 if name == "linf" else 3.0))
    x = np.asarray(project(jnp.asarray(x0 + delta), jnp.asarray(x0), eps, name))
    return x0, x, eps, name


def test_grid_values_are_uint8_over_255_on_every_level():
    """The gather-free grid value equals numpy's correctly rounded ``uint8 / 255`` on all 256
    levels (126 of which XLA's ``k * float32(1 / 255)`` misses by an ulp), as float or int
    levels, eagerly and inside jit; non-integers are floored and outside levels clipped, as the
    table lookup did."""
    table = np.arange(256, dtype=np.uint8).astype(np.float32) / np.float32(255)
    k = np.arange(256)
    product = np.asarray(jax.jit(lambda v: v * np.float32(1 / 255))(k.astype(np.float32)))
    assert np.sum(product != table) == 126  # the trap the function exists for is real
    for levels in (k.astype(np.float32), k.astype(np.int32)):
        np.testing.assert_array_equal(np.asarray(norms._grid_value(jnp.asarray(levels))), table)
        np.testing.assert_array_equal(np.asarray(jax.jit(norms._grid_value)(levels)), table)
    odd = np.array([-3.0, -0.5, 0.4, 2.999, 254.5, 255.0, 255.7, 300.0], np.float32)
    expected = table[np.clip(np.floor(np.clip(odd, 0, 255)), 0, 255).astype(int)]
    np.testing.assert_array_equal(np.asarray(jax.jit(norms._grid_value)(odd)), expected)


@given(case=quantize_case())
def test_quantize_on_grid_in_box_and_in_ball(case):
    x0, x, eps, name = case
    q = np.asarray(quantize(jnp.asarray(x), jnp.asarray(x0), eps, name))
    assert q.shape == x.shape and q.dtype == np.float32
    assert on_grid(q)
    assert np.all((q >= 0.0) & (q <= 1.0))
    # The very check verification makes.
    assert np.all(np.asarray(in_ball(jnp.asarray(q - x0), jnp.asarray(eps), name)))
    # Never more than one grid step from x.
    assert np.all(np.abs(q.astype(np.float64) - x) <= 1.0 / LEVELS + 1e-6)


@given(case=quantize_case(off_grid=True))
def test_quantize_linf_off_grid_clean_images_stay_in_the_ball(case):
    """Linf accepts any clean image: each pixel takes a level inside the ball, or keeps x0 when
    the ball holds no level (eps under half a level)."""
    x0, x, eps, _ = case
    q = np.asarray(quantize(jnp.asarray(x), jnp.asarray(x0), eps, "linf"))
    assert np.all((q >= 0.0) & (q <= 1.0))
    assert np.all(np.asarray(in_ball(jnp.asarray(q - x0), jnp.asarray(eps), "linf")))
    off = ~np.isclose(q * LEVELS, np.round(q * LEVELS), rtol=0, atol=1e-4)
    assert np.all(q[off] == x0[off])  # only a kept clean pixel is off the grid
    to_level = np.abs(x0 * LEVELS - np.round(x0 * LEVELS)) / LEVELS
    lim = eps_rows(eps, x.shape[0]).reshape((-1,) + (1,) * (x.ndim - 1))
    assert not np.any(off & (to_level < lim - 1e-6)), "a level was inside the ball"


@pytest.mark.parametrize("off_grid", [False, True])
@given(data=st.data())
def test_quantize_linf_is_the_nearest_admissible_level(off_grid, data):
    """Per pixel, Linf quantisation picks a level within eps of x0 that is as close to x as
    any such level (the exact projection onto the grid points of the ball and the box)."""
    x0, x, eps, _ = data.draw(quantize_case(off_grid=off_grid))
    q = np.asarray(quantize(jnp.asarray(x), jnp.asarray(x0), eps, "linf")).astype(np.float64)
    limit = np.asarray(norms.ball_limit(jnp.asarray(eps)), np.float64)
    limit = np.broadcast_to(limit.reshape((-1,) + (1,) * (x.ndim - 1)), x.shape)
    levels = grid(np.arange(LEVELS + 1)).astype(np.float64)  # [256]
    x0_, x_ = x0.astype(np.float64)[..., None], x.astype(np.float64)[..., None]
    admissible = np.abs(levels - x0_) <= limit[..., None] + 1e-7
    dist = np.where(admissible, np.abs(levels - x_), np.inf).min(axis=-1)
    has = admissible.any(axis=-1)
    assert np.all(np.abs(q - x)[has] <= dist[has] + 1e-6)


@given(case=quantize_case())
def test_quantize_keeps_nearest_rounding_when_it_is_feasible(case):
    x0, x, eps, name = case
    q = np.asarray(quantize(jnp.asarray(x), jnp.asarray(x0), eps, name))
    nearest = np.asarray(quantize(jnp.asarray(x), jnp.asarray(x0), None, name))
    fits = np.asarray(in_ball(jnp.asarray(nearest - x0), jnp.asarray(eps), name))
    if name == "linf":
        np.testing.assert_array_equal(q[fits], nearest[fits])
    else:
        # L2 / L1 also keep nearest rounding where it fits, unless it loses norm (then the
        # cheapest pixels round away from x0, up to the candidate's own norm).
        keeps = fits & (norm(jnp.asarray(nearest - x0), name) >= norm(jnp.asarray(x - x0), name))
        np.testing.assert_array_equal(q[np.asarray(keeps)], nearest[np.asarray(keeps)])
        grown = np.asarray(norm(jnp.asarray(q - x0), name))
        limit = np.maximum(np.asarray(norm(jnp.asarray(nearest - x0), name)),
                           np.asarray(norm(jnp.asarray(x - x0), name)))
        assert np.all(grown <= limit * (1 + 1e-5) + 1e-6), "a stretch of the candidate"


@given(x=batch(-0.5, 1.5))
def test_quantize_without_eps_is_plain_rounding(x):
    x0 = np.zeros_like(x)
    q = np.asarray(quantize(jnp.asarray(x), jnp.asarray(x0)))
    ref = np.clip(np.round(x * np.float32(LEVELS)), 0, LEVELS).astype(np.float32)
    ref = ref / np.float32(LEVELS)
    np.testing.assert_allclose(q, ref, rtol=0, atol=1e-7)
    assert on_grid(q)


def test_quantize_linf_eps_03_half_step_edge():
    # eps = 0.3 = 76.5 / 255: x = x0 + 0.3 lies on the ball's boundary, half-way between two
    # grid values; rounding to nearest (half to even) pushes half of the pixels to 77/255.
    k = np.arange(0, 179, dtype=np.int32).reshape(1, -1)  # x0 + 0.3 <= 1
    k = np.concatenate([k, k[:, ::-1]], axis=0)
    x0 = grid(k)
    x = (x0 + np.float32(0.3)).astype(np.float32)
    assert np.all(x <= 1.0)
    nearest = np.asarray(quantize(jnp.asarray(x), jnp.asarray(x0)))
    assert np.all(np.abs(nearest.astype(np.float64) - x0).max(axis=1) > 0.3)  # the trap is real
    q = np.asarray(quantize(jnp.asarray(x), jnp.asarray(x0), 0.3, "linf"))
    assert on_grid(q)
    assert np.all(np.abs(q.astype(np.float64) - x0) <= 0.3 + 1e-6)
    np.testing.assert_array_equal(steps(q), k + 76)


@pytest.mark.parametrize("name", ["l2", "l1"])
def test_quantize_gives_back_only_what_the_rounding_added(name):
    """Four pixels 0.6 level up, eps their norm: nearest rounding (+1 each) leaves the ball;
    the repair rounds just enough of them towards x0, not all (all would keep nothing)."""
    k = np.array([[0, 10, 100, 200], [3, 3, 3, 3]], np.int32)
    x0 = grid(k)
    x = (x0 + np.float32(0.6 / LEVELS)).astype(np.float32)
    eps = np.asarray(norm(jnp.asarray(x - x0), name))  # L2: 1.2 levels, L1: 2.4 levels
    q = np.asarray(quantize(jnp.asarray(x), jnp.asarray(x0), eps, name))
    up = steps(q) - k
    assert set(np.unique(up)) <= {0, 1}
    np.testing.assert_array_equal(up.sum(axis=1), 1 if name == "l2" else 2)
    # Without the ball, plain rounding goes up one step.
    q_free = np.asarray(quantize(jnp.asarray(x), jnp.asarray(x0), None, name))
    np.testing.assert_array_equal(steps(q_free), k + 1)


@st.composite
def boundary_case(draw):
    """CIFAR-sized 8-bit images with an L2 perturbation on the ball's boundary: dense
    Gaussian, sparse (a few pixels) or PGD-like (a signed pattern), any eps in [1/16, 4]."""
    seed = draw(st.integers(0, 2**31 - 1))
    eps = draw(st.floats(0.0625, 4.0, width=32))
    kind = draw(st.sampled_from(["dense", "sparse", "signs"]))
    rng = np.random.default_rng(seed)
    x0 = grid(rng.integers(0, LEVELS + 1, (4, 32, 32, 3)))
    delta = sphere_perturbation(rng, x0.shape, kind, eps, sparse_fraction=0.01)
    return x0, (x0 + delta).astype(np.float32), np.float32(eps)


@given(case=boundary_case())
def test_quantize_l2_keeps_the_norm_of_boundary_perturbations(case):
    """Rounding a perturbation on the L2 sphere keeps >= 97 % of its norm (the box clips it
    first), inside the ball. Rounding every pixel towards x0 kept about 84 % at eps 0.5."""
    x0, x, eps = case
    x = np.asarray(project(jnp.asarray(x), jnp.asarray(x0), eps, "l2"))
    q = np.asarray(quantize(jnp.asarray(x), jnp.asarray(x0), eps, "l2"))
    before = np.linalg.norm((x - x0).reshape(4, -1).astype(np.float64), axis=1)
    after = np.linalg.norm((q - x0).reshape(4, -1).astype(np.float64), axis=1)
    assert np.all(np.asarray(in_ball(jnp.asarray(q - x0), eps, "l2")))
    assert np.all(after >= 0.97 * before), (after / before).min()
