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
    "project",
    "normalize",
    "quantize",
    "PIXEL_LEVELS",
    "per_example",
    "in_ball",
    "BALL_RTOL",
    "BALL_ATOL",
]

NORMS = ("linf", "l2", "l1")
# Slack on "||delta|| <= eps": float32 rounding of a projection may land a hair outside the
# ball. Both are far below one pixel level (1/255 = 3.9e-3).
BALL_RTOL = 1e-5
BALL_ATOL = 1e-6
PIXEL_LEVELS = 255  # an 8-bit image has 256 values: k / 255 for k = 0..255


def check_norm(name: str) -> str:
    """Returns ``name`` if it is a known norm, else raises ``ValueError``."""
    if name not in NORMS:
        raise ValueError(f"unknown norm {name!r}; expected one of {NORMS}")
    return name


def _flat(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[0], -1)


def per_example(v: jax.Array, x: jax.Array) -> jax.Array:
    """Broadcasts a per-example vector ``[B]`` against ``x`` of shape ``[B, ...]``."""
    return v.reshape((-1,) + (1,) * (x.ndim - 1))


def norm(delta: jax.Array, name: str) -> jax.Array:
    """Per-example Lp norm of ``delta`` (shape ``[B, ...]``), returned as ``[B]``."""
    flat = _flat(delta)
    if name == "linf":
        # max(max, -min) rather than max(abs): XLA:CPU runs it ~10x faster (benchmarks/).
        return jnp.maximum(jnp.max(flat, axis=1), -jnp.min(flat, axis=1))
    if name == "l2":
        return jnp.sqrt(jnp.sum(flat * flat, axis=1))
    if name == "l1":
        return jnp.sum(jnp.abs(flat), axis=1)
    raise ValueError(f"unknown norm {name!r}; expected one of {NORMS}")


def in_ball(delta: jax.Array, eps: float | jax.Array, name: str) -> jax.Array:
    """Per-example ``||delta|| <= eps`` up to float32 slack (:data:`BALL_RTOL`, :data:`BALL_ATOL`)."""
    return norm(delta, name) <= jnp.asarray(eps) * (1 + BALL_RTOL) + BALL_ATOL


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
        return _project_l1(_flat(delta), eps).reshape(delta.shape)
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
        scale = jnp.max(jnp.abs(_flat(g)), axis=1)
        g = g / per_example(jnp.where(scale > 0, scale, 1.0), g)
        n = norm(g, "l2")
        return g / per_example(jnp.where(n > 0, n, 1.0), g)
    if name == "l1":
        flat = _flat(g)
        top = jnp.argmax(jnp.abs(flat), axis=1)
        one_hot = jax.nn.one_hot(top, flat.shape[1], dtype=g.dtype)
        return (one_hot * jnp.sign(flat)).reshape(g.shape)
    raise ValueError(f"unknown norm {name!r}; expected one of {NORMS}")


def quantize(
    x: jax.Array,
    x0: jax.Array,
    eps: float | jax.Array | None = None,
    name: str = "linf",
    levels: int = PIXEL_LEVELS,
) -> jax.Array:
    """Rounds ``x`` to the pixel grid ``k / levels`` without leaving the box or the eps ball.

    Rounding to the nearest grid value can push a perturbation just outside the eps ball
    (e.g. Linf eps 0.3 = 76.5/255). For examples where that happens, each pixel is rounded
    towards ``x0`` instead; when ``x0`` lies on the grid (8-bit data) this never increases any
    ``|x - x0|_i``, so the result stays inside every Lp ball that held ``x``.

    Args:
      x: images ``[B, ...]`` in the box.
      x0: the clean images ``[B, ...]``.
      eps: radius (scalar or ``[B]``) of the ball to respect, or ``None`` for none.
      name: the norm of that ball.
      levels: number of grid steps between 0 and 1.

    Returns:
      Images on the grid, in the box, and in the ball wherever ``x`` and ``x0`` allow it.
    """
    # Grid values from a table computed in numpy: XLA's k / 255 is not always the correctly
    # rounded float32 that uint8 / 255 gives, and a clean image must map to itself exactly.
    grid = jnp.asarray(np.arange(levels + 1, dtype=np.float32) / np.float32(levels))
    on_grid = lambda k: grid[jnp.clip(k, 0, levels).astype(jnp.int32)]  # noqa: E731
    nearest = on_grid(jnp.round(x * levels))
    if eps is None:
        return nearest
    steps = (x - x0) * levels
    # Truncate towards x0; the 1e-4 keeps a float 0.99997 of a level from truncating to 0.
    towards = on_grid(jnp.round(x0 * levels) + jnp.trunc(steps + jnp.sign(steps) * 1e-4))
    eps = jnp.broadcast_to(jnp.asarray(eps, x.dtype), x.shape[:1])
    outside = ~in_ball(nearest - x0, eps, name)
    return jnp.where(per_example(outside, x), towards, nearest)
