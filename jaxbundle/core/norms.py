"""Per-example norms, projections and quantisation.

Every function here works on a batch: arrays of shape ``[B, ...]`` where each row is one
example, and per-example quantities have shape ``[B]``. Nothing here knows about models or
attacks.

Norm names are the strings ``"linf"``, ``"l2"`` and ``"l1"``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "NORMS",
    "check_norm",
    "norm",
    "project_ball",
    "project_box",
    "random_in_ball",
    "random_start",
    "project",
    "normalize",
    "quantize",
    "snap_to_grid",
    "on_grid",
    "grid_radius",
    "PIXEL_LEVELS",
    "GRID_ATOL",
    "per_example",
    "tree_where",
    "in_ball",
    "ball_limit",
    "BALL_RTOL",
    "BALL_ATOL",
]

NORMS = ("linf", "l2", "l1")
# Slack on "||delta|| <= eps": float32 rounding of a projection may land a hair outside the
# ball. Both are far below one pixel level (1/255 = 3.9e-3).
BALL_RTOL = 1e-5
BALL_ATOL = 1e-6
PIXEL_LEVELS = 255  # an 8-bit image has 256 values: k / 255 for k = 0..255
# A pixel within this many levels of k / 255 counts as on the grid (float32 rounding of
# x / 255 is ~1e-5 levels; resized or augmented pixels fall anywhere between levels).
GRID_ATOL = 1e-3


def check_norm(name: str) -> str:
    """Returns ``name`` if it is a known norm, else raises ``ValueError``."""
    if name not in NORMS:
        raise ValueError(f"unknown norm {name!r}; expected one of {NORMS}")
    return name


# The dual of each norm: ``|<g, d>| <= ||g||_* ||d||`` (Hoelder), the norm a linearised
# boundary's distance divides by (DeepFool, FAB, FMN).
DUAL = {"linf": "l1", "l2": "l2", "l1": "linf"}


def flat(x: jax.Array) -> jax.Array:
    """``x [B, ...]`` as rows ``[B, D]``."""
    return x.reshape(x.shape[0], -1)


def dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """Per-example inner product ``[B]`` of ``a`` and ``b`` ``[B, ...]`` (over all but axis 0)."""
    return jnp.sum(flat(a * b), axis=1)


def unit(a: jax.Array) -> jax.Array:
    """``a [B, ...]`` divided by its per-example L2 norm; zero rows stay zero."""
    n = jnp.sqrt(dot(a, a))
    return a / per_example(jnp.where(n > 0, n, 1.0), a)


def per_example(v: jax.Array, x: jax.Array) -> jax.Array:
    """Broadcasts a per-example vector ``[B]`` against ``x`` of shape ``[B, ...]``."""
    return v.reshape((-1,) + (1,) * (x.ndim - 1))


def tree_where(take: jax.Array, a, b):
    """Per example (``take`` ``[B]``), the leaves of pytree ``a`` where ``take`` holds, else of
    ``b`` (leaves with a leading batch axis)."""
    return jax.tree.map(lambda u, v: jnp.where(per_example(take, u), u, v), a, b)


def norm(delta: jax.Array, name: str) -> jax.Array:
    """Per-example Lp norm of ``delta`` (shape ``[B, ...]``), returned as ``[B]``."""
    rows = flat(delta)
    if name == "linf":
        # max(max, -min) rather than max(abs): XLA:CPU runs it ~10x faster (benchmarks/).
        return jnp.maximum(jnp.max(rows, axis=1), -jnp.min(rows, axis=1))
    if name == "l2":
        return jnp.sqrt(jnp.sum(rows * rows, axis=1))
    if name == "l1":
        return jnp.sum(jnp.abs(rows), axis=1)
    raise ValueError(f"unknown norm {name!r}; expected one of {NORMS}")


def in_ball(delta: jax.Array, eps: float | jax.Array, name: str) -> jax.Array:
    """Per-example ``||delta|| <= eps`` up to float32 slack (:data:`BALL_RTOL`,
    :data:`BALL_ATOL`)."""
    return norm(delta, name) <= ball_limit(eps)


def random_in_ball(
    keys: jax.Array, shape: tuple[int, ...], eps: jax.Array, norm: str
) -> jax.Array:
    """One uniform sample from the ``norm`` ball of radius ``eps[i]`` per key; ``[B, *shape]``."""

    def one(key, radius):
        if norm == "linf":
            return jax.random.uniform(key, shape, minval=-1.0, maxval=1.0) * radius
        k_dir, k_rad = jax.random.split(key)
        direction = jax.random.normal(k_dir, shape)
        direction = direction / jnp.maximum(jnp.linalg.norm(direction), 1e-12)
        dim = direction.size
        return direction * radius * jax.random.uniform(k_rad) ** (1.0 / dim)

    if norm not in ("linf", "l2"):
        raise ValueError(f"random_in_ball supports 'linf' and 'l2', not {norm!r}")
    return jax.vmap(one)(keys, eps)


def random_start(keys: jax.Array, x0: jax.Array, eps: jax.Array, norm: str) -> jax.Array:
    """The attacks' random start: ``x0`` plus one uniform sample of the eps ball per example
    (:func:`random_in_ball`), clipped to the box."""
    return project_box(x0 + random_in_ball(keys, x0.shape[1:], eps, norm))


def _project_l1(flat: jax.Array, eps: jax.Array) -> jax.Array:
    """Euclidean projection of each row onto the L1 ball of radius ``eps`` (Duchi et al. 2008)."""
    abs_v = jnp.abs(flat)
    inside = jnp.sum(abs_v, axis=1) <= eps
    mu = -jnp.sort(-abs_v, axis=1)  # descending
    cumsum = jnp.cumsum(mu, axis=1)
    ranks = jnp.arange(1, flat.shape[1] + 1, dtype=flat.dtype)
    cond = mu - (cumsum - eps[:, None]) / ranks[None, :] > 0
    rho = jnp.sum(cond, axis=1)  # number of active coordinates, >= 1 when outside
    theta = (jnp.take_along_axis(cumsum, jnp.maximum(rho - 1, 0)[:, None], axis=1)[:, 0] - eps) / (
        jnp.maximum(rho, 1).astype(flat.dtype)
    )
    shrunk = jnp.sign(flat) * jnp.maximum(abs_v - theta[:, None], 0.0)
    # With many tied |v_i| float32 rounding of theta can overshoot the radius; rescale.
    l1 = jnp.sum(jnp.abs(shrunk), axis=1)
    shrunk = shrunk * jnp.minimum(1.0, eps / jnp.maximum(l1, 1e-30))[:, None]
    return jnp.where(inside[:, None], flat, shrunk)


def project_ball(delta: jax.Array, eps: float | jax.Array, name: str) -> jax.Array:
    """Euclidean projection of each example's ``delta`` onto the Lp ball of radius ``eps``.

    ``eps`` is a scalar or a per-example ``[B]`` array. For L1 this is the exact Euclidean
    projection (sort-based), for L2 a rescaling, for Linf a clip.
    """
    eps = jnp.broadcast_to(jnp.asarray(eps, delta.dtype), delta.shape[:1])
    if name == "linf":
        e = per_example(eps, delta)
        return jnp.clip(delta, -e, e)
    if name == "l2":
        n = norm(delta, "l2")
        scale = jnp.where(n > eps, eps / jnp.maximum(n, 1e-12), 1.0)
        return delta * per_example(scale, delta)
    if name == "l1":
        return _project_l1(flat(delta), eps).reshape(delta.shape)
    raise ValueError(f"unknown norm {name!r}; expected one of {NORMS}")


def project_box(x: jax.Array, low: float = 0.0, high: float = 1.0) -> jax.Array:
    """Clips every pixel into the input box ``[low, high]``."""
    return jnp.clip(x, low, high)


def project(x: jax.Array, x0: jax.Array, eps: float | jax.Array, name: str) -> jax.Array:
    """Maps ``x`` into the intersection of the eps ball around ``x0`` and the box ``[0, 1]``.

    For Linf the result is the exact Euclidean projection onto the intersection (both are
    coordinate-wise intervals). For L2 and L1 it is the ball projection followed by a clip:
    always feasible (clipping towards ``x0``, which lies in the box, never increases any
    coordinate of ``|x - x0|``), which is what PGD and the reference implementations use.
    """
    return project_box(x0 + project_ball(x - x0, eps, name))


def normalize(g: jax.Array, name: str) -> jax.Array:
    """Steepest-ascent direction of unit ``name``-norm for each example's gradient ``g``.

    Linf: ``sign(g)``; L2: ``g / ||g||_2``; L1: a unit vector on the largest coordinate of
    ``|g|`` (the exact L1 steepest direction). Zero gradients give a zero direction.
    """
    if name == "linf":
        return jnp.sign(g)
    if name == "l2":
        # Divide by max|g| first: squaring a tiny gradient (1e-20) would underflow to zero.
        scale = jnp.max(jnp.abs(flat(g)), axis=1)
        g = g / per_example(jnp.where(scale > 0, scale, 1.0), g)
        n = norm(g, "l2")
        return g / per_example(jnp.where(n > 0, n, 1.0), g)
    if name == "l1":
        rows = flat(g)
        top = jnp.argmax(jnp.abs(rows), axis=1)
        one_hot = jax.nn.one_hot(top, rows.shape[1], dtype=g.dtype)
        return (one_hot * jnp.sign(rows)).reshape(g.shape)
    raise ValueError(f"unknown norm {name!r}; expected one of {NORMS}")


# ---------------------------------------------------------------------------------------------
# The 8-bit pixel grid.
#
# Grid values are the correctly rounded float32 of k / 255, what uint8 / 255 gives in numpy
# (_GRID). XLA compiles k / 255 as k * float32(1 / 255), one ulp above it for 126 of the 256
# levels, and a clean image must map to itself exactly. A table lookup inside the attacks'
# fused loops is a gather, the slowest part of rounding on XLA:CPU (benchmarks/grid_cost.py),
# so _grid_value computes the table's value instead: the product, one ulp down exactly where it
# is one too high. That is where k (below 255) has the second bit of its binary expansion set
# (k in [3, 3], [6, 7], [12, 15], ..., [192, 254]): bit 22 of k's float32 pattern, the first
# bit of its mantissa. The product is an IEEE float32 multiplication, rounded alike on every
# backend, and consumed only through a bitcast, so it is never fused into an FMA.
_GRID = np.arange(PIXEL_LEVELS + 1, dtype=np.float32) / np.float32(PIXEL_LEVELS)
_INVERSE_LEVELS = np.float32(1.0 / PIXEL_LEVELS)


def _grid_value(k: jax.Array) -> jax.Array:
    """float32 pixel values of integer levels ``k`` (float or int), clipped to ``[0, 255]``:
    exactly ``_GRID[k]`` (tested on every level), without a gather."""
    k = jnp.floor(jnp.clip(jnp.asarray(k, jnp.float32), 0.0, float(PIXEL_LEVELS)))
    product = jax.lax.bitcast_convert_type(k * _INVERSE_LEVELS, jnp.int32)
    mantissa_bit = jax.lax.bitcast_convert_type(k, jnp.int32) >> 22
    high = mantissa_bit & (k < PIXEL_LEVELS).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(product - high, jnp.float32)


def on_grid(x0: jax.Array) -> jax.Array:
    """Per example ``[B]``: whether every pixel of ``x0`` is an 8-bit level ``k / 255``.

    Works on jax arrays (inside jit) and on numpy arrays (on the host, the same arithmetic).

    A pixel within :data:`GRID_ATOL` of a level counts as on it, so that ``x / 255`` computed
    in float32 by any pipeline (XLA's division may be one ulp off numpy's) is recognised, while
    resized, blurred or augmented images (whose pixels fall between levels) are not.
    """
    xp = np if isinstance(x0, np.ndarray) else jnp  # also on the host, for whole datasets
    levels = x0 * np.float32(PIXEL_LEVELS)
    return xp.all((xp.abs(levels - xp.round(levels)) <= GRID_ATOL).reshape(len(x0), -1), axis=1)


def ball_limit(eps: float | jax.Array) -> jax.Array:
    """The largest norm that counts as inside the eps ball: ``eps`` plus float32 slack."""
    return jnp.asarray(eps, jnp.float32) * (1 + BALL_RTOL) + BALL_ATOL


def _linf_levels(nearest: jax.Array, x0: jax.Array, limit: jax.Array) -> jax.Array:
    """``nearest`` (levels) clipped, pixel by pixel, to the levels within ``limit`` of ``x0``.

    The admissible levels of a pixel are an interval: ``[ceil(255 (x0 - limit)),
    floor(255 (x0 + limit))]`` in exact arithmetic. The float32 bounds are then checked with the
    very subtraction :func:`in_ball` makes and moved by one level where they disagree, so the
    result passes :func:`in_ball` whenever an admissible level exists. Where none does (``x0``
    off the grid and ``eps`` under half a level) the pixel is marked ``nan``.
    """
    top = jnp.float32(PIXEL_LEVELS)
    hi = jnp.clip(jnp.floor((x0 + limit) * PIXEL_LEVELS), 0.0, top)
    lo = jnp.clip(jnp.ceil((x0 - limit) * PIXEL_LEVELS), 0.0, top)
    inside = lambda k: jnp.abs(_grid_value(k) - x0) <= limit  # noqa: E731
    hi = jnp.where(inside(hi), hi, hi - 1)
    hi = jnp.where((hi < top) & inside(hi + 1), hi + 1, hi)
    lo = jnp.where(inside(lo), lo, lo + 1)
    lo = jnp.where((lo > 0) & inside(lo - 1), lo - 1, lo)
    return jnp.where(lo <= hi, jnp.clip(nearest, lo, hi), jnp.nan)


def _toward_levels(x: jax.Array, x0: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(j, steps, toward)``: the level of ``x0``, ``x - x0`` in levels, and ``x`` rounded
    towards ``x0`` (never further from it than ``x``, up to 1e-4 of a level that keeps a float
    0.99997 of a level from truncating to 0)."""
    j = jnp.round(x0 * PIXEL_LEVELS)
    steps = (x - x0) * PIXEL_LEVELS
    toward = jnp.clip(j + jnp.trunc(steps + jnp.sign(steps) * 1e-4), 0.0, PIXEL_LEVELS)
    return j, steps, toward


_BISECTIONS = 24  # on a cost range of 8: ties closer than 5e-7 are taken in index order


def _fit_levels(x: jax.Array, x0: jax.Array, eps: jax.Array, name: str) -> jax.Array:
    """The L2 / L1 rounding of rows ``[B, D]`` (in levels) that keeps the perturbation's norm.

    Every pixel takes one of the two levels around it: ``t``, towards ``x0`` (``j`` its level),
    or ``a = t +- 1``, away from it (pixels already on a level have only ``t``). Starting from
    all ``t`` (inside the ball whenever ``x`` is, for ``x0`` on the grid), pixels are turned to
    ``a`` in increasing order of the cost ``|a - x| - |t - x|`` (negative where ``a`` is the
    nearer level) for as long as the norm stays within ``eps`` and within the larger of nearest
    rounding's norm and the candidate's own. So the result is nearest rounding wherever that
    fits, with only the cheapest pixels kept towards ``x0`` where it does not; and where
    nearest rounding would lose norm (every pixel a third of a level past a level, say), the
    cheapest pixels are rounded away until the candidate's norm is restored.
    """
    j, steps, toward = _toward_levels(x, x0)
    t = toward - j
    direction = jnp.sign(steps)
    away = jnp.clip(toward + direction, 0.0, PIXEL_LEVELS)
    can = (jnp.abs(steps) - jnp.abs(t) > 1e-4) & (away != toward)
    a = away - j
    # Nearest rounding picks a where a is the nearer level (ties: as jnp.round decides).
    picks_a = can & (jnp.round(x * PIXEL_LEVELS) == away)
    nearest = jnp.where(picks_a, a, t)
    # The cost |a - x| - |t - x| lies in [-1, 1]; those nearest rounding sends away come first.
    cost = jnp.abs(a - steps) - jnp.abs(t - steps) + jnp.where(picks_a, -2.0, 2.0)
    cost = jnp.where(can, cost, jnp.inf)
    # Per pixel: its share of the squared L2 norm, or of the L1 norm, in levels.
    mag = jnp.square if name == "l2" else jnp.abs
    size = lambda v: jnp.sum(mag(v), axis=1)  # noqa: E731
    ball = _grid_budget(eps, name)
    # Up to nearest rounding's norm, or the candidate's own where rounding would lose some:
    # never beyond the ball, never a stretch of what the attack made.
    budget = jnp.minimum(ball, jnp.maximum(size(nearest), size(steps)))
    base = size(t)
    grow = jnp.where(can, mag(a) - mag(t), 0.0)
    # The longest prefix in cost order that fits: bisect on a cost threshold (a sort of every
    # row is several times slower on XLA:CPU), then take the pixels tied at the threshold in
    # index order.
    fill = lambda below: base + jnp.sum(jnp.where(below, grow, 0.0), axis=1)  # noqa: E731

    def bisect(bounds, _):
        lo, hi = bounds
        mid = 0.5 * (lo + hi)
        fits = fill(cost < mid[:, None]) <= budget
        return (jnp.where(fits, mid, lo), jnp.where(fits, hi, mid)), None

    start = (jnp.full(base.shape, -4.0), jnp.full(base.shape, 4.0))  # cost lies in [-3, 3]
    (lo, hi), _ = jax.lax.scan(bisect, start, None, length=_BISECTIONS)
    below = cost < lo[:, None]
    tied = can & ~below & (cost < hi[:, None])
    room = budget - fill(below)
    turn = below | (tied & (jnp.cumsum(jnp.where(tied, grow, 0.0), axis=1) <= room[:, None]))
    return jnp.where(turn & can, away, toward)


def quantize(
    x: jax.Array,
    x0: jax.Array,
    eps: float | jax.Array | None = None,
    name: str = "linf",
) -> jax.Array:
    """Rounds ``x`` to the 8-bit grid ``k / 255``, inside the box and (with ``eps``) the eps ball.

    Without ``eps``: nearest rounding. With ``eps``, the nearest grid image inside the ball:

    * Linf: each pixel is rounded to the nearest level within ``eps`` of ``x0`` (the exact
      projection of the rounding onto the grid points of the ball and the box, so a pixel at
      the edge of the ball keeps every whole level of it; ``x0`` may be off the grid). A pixel
      with no such level (``x0`` off the grid and ``eps`` below half a level) keeps ``x0``.
    * L2 and L1: each pixel takes one of the two levels around it, nearest rounding where that
      fits the ball, the cheapest pixels towards ``x0`` where it does not, and the cheapest
      away from ``x0`` where rounding would otherwise lose norm (:func:`_fit_levels`): a
      perturbation on the boundary keeps nearly all of its norm. Guaranteed inside the ball
      for ``x0`` on the grid and ``x`` in the ball; a result still outside (``x0`` off the
      grid) falls back to the level of ``x0``.

    The clean image of an on-grid ``x0`` maps to itself exactly.

    Args:
      x: images ``[B, ...]`` in the box.
      x0: the clean images ``[B, ...]``.
      eps: radius (scalar or ``[B]``) of the ball to respect, or ``None`` for none.
      name: the norm of that ball.

    Returns:
      float32 images on the grid (but for the Linf fallback above), in the box and the ball.
    """
    check_norm(name)
    nearest = jnp.clip(jnp.round(x * PIXEL_LEVELS), 0.0, PIXEL_LEVELS)
    if eps is None:
        return _grid_value(nearest)
    eps = jnp.broadcast_to(jnp.asarray(eps, jnp.float32), x.shape[:1])
    limit = ball_limit(eps)
    if name == "linf":
        k = _linf_levels(nearest, x0, per_example(limit, x))
        return jnp.where(jnp.isnan(k), x0, _grid_value(jnp.nan_to_num(k)))
    k = _fit_levels(flat(x), flat(x0), eps, name).reshape(x.shape)
    # x0 off the grid, or x outside the ball: fall back to x0's own level (x0 itself on the grid).
    fits = in_ball(_grid_value(k) - x0, eps, name)
    return _grid_value(jnp.where(per_example(fits, x), k, jnp.round(x0 * PIXEL_LEVELS)))


def snap_to_grid(
    x: jax.Array,
    x0: jax.Array,
    eps: float | jax.Array | None = None,
    name: str = "linf",
    grid: jax.Array | None = None,
) -> jax.Array:
    """:func:`quantize` for the examples judged on the 8-bit grid, ``x`` unchanged for the
    others (judged in float32).

    ``grid`` ``[B]`` says which examples are judged on the grid (an attack gets it from its
    model object, ``model.grid``); ``None``: those whose clean image ``x0`` is on the grid.
    This is how attacks that search on the pixel grid, and natural shifts, follow the
    bundle's judging of each example.
    """
    grid = on_grid(x0) if grid is None else grid
    return jnp.where(per_example(grid, x), quantize(x, x0, eps, name), x)


def _grid_budget(eps: float | jax.Array, name: str) -> float | jax.Array:
    """Whole levels within ``eps``: the largest integer ``m`` of levels (Linf, L1) or squared
    levels (L2) an 8-bit perturbation may have. ``2e-4`` of a level absorbs float32 rounding
    of an eps on a level (``float32(4/255) * 255 = 3.9999998``) without admitting the next
    level (for L2 up to eps ~ 9, where ``2 * 255 eps * 2e-4`` reaches a squared level)."""
    xp = jnp if isinstance(eps, (jax.Array, jax.core.Tracer)) else np
    levels = eps * PIXEL_LEVELS + 2e-4
    return xp.floor(levels * levels) if name == "l2" else xp.floor(levels)


def grid_radius(eps: float | jax.Array, name: str) -> float | jax.Array:
    """The largest ``name`` distortion of an 8-bit image from an 8-bit clean image within
    ``eps`` (away from the box): whole levels, e.g. ``7/255`` for Linf eps 0.031. For L2 it is
    ``sqrt(m)/255`` with ``m`` the largest integer under ``(255 eps)^2`` (every integer is a sum
    of four squares). On the grid, the ball of radius ``grid_radius(eps)`` holds exactly the
    images of the ball of radius ``eps``. A float gives a float, an array (traced) an array.
    """
    check_norm(name)
    traced = isinstance(eps, (jax.Array, jax.core.Tracer))
    budget = _grid_budget(eps if traced else float(eps), name)
    root = (jnp.sqrt(budget) if traced else np.sqrt(budget)) if name == "l2" else budget
    return root / PIXEL_LEVELS if traced else float(root / PIXEL_LEVELS)
