"""Input sets of one example and the minimum of a linear function over them.

A set is the ``linf`` or ``l2`` ball of radius ``eps`` around the example intersected with the
data's box ``[lower, upper]``: a :class:`Box` (per-pixel interval) for ``linf``, a
:class:`BallInBox` for ``l2``. :func:`minimise` is what turns CROWN's linear bounds into
numbers ("concretisation"); every value it returns is a lower bound of the true minimum.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle.certify import rounding as rounds

__all__ = ["NORMS", "BallInBox", "Box", "hull", "input_set", "minimise"]

NORMS = ("linf", "l2")
_DUAL_STEPS = 16  # bisection steps on log(lambda) in the L2-in-box dual


class Box(NamedTuple):
    """The per-pixel interval ``lower <= x <= upper`` (arrays of the example's shape)."""

    lower: jax.Array
    upper: jax.Array


class BallInBox(NamedTuple):
    """``{x : |x - center|_2 <= radius, lower <= x <= upper}``.

    Attributes:
      center: the example, e.g. ``[1, H, W, C]``.
      radius: scalar L2 radius.
      lower, upper: the box, already intersected with the ball's Linf hull
        (``max(center - radius, data lower)``, ``min(center + radius, data upper)``).
    """

    center: jax.Array
    radius: jax.Array
    lower: jax.Array
    upper: jax.Array


def input_set(x: jax.Array, eps: jax.Array, norm: str, lower, upper) -> Box | BallInBox:
    """The ``norm`` ball of radius ``eps`` (scalar) around ``x`` intersected with
    ``[lower, upper]`` (scalars or arrays broadcastable to ``x``)."""
    low = jnp.maximum(x - eps, lower).astype(x.dtype)
    high = jnp.minimum(x + eps, upper).astype(x.dtype)
    if norm == "linf":
        return Box(low, high)
    if norm == "l2":
        return BallInBox(x, jnp.asarray(eps, x.dtype), low, high)
    raise ValueError(f"norm must be one of {NORMS}; got {norm!r}")


def hull(input_set: Box | BallInBox) -> Box:
    """The smallest per-pixel interval containing the set (what IBP starts from)."""
    return Box(input_set.lower, input_set.upper)


def minimise(coefficients: jax.Array, input_set: Box | BallInBox, *,
             contract: Callable | None = None, rounding: bool = True) -> jax.Array:
    """Lower bounds ``[S]`` on ``min_x <A_s, x>`` over the set, ``A`` of shape ``[S, *shape]``.

    ``contract(A, value)`` sums a box's per-element terms (default: the inner product; CROWN's
    packed rows split it by neuron); only a box's minimum is such a sum.

    Box: exact, ``sum(min(A * lower, A * upper))``. L2 ball in a box: the largest of three
    lower bounds: the box's, the ball's alone (``<A, center> - radius |A|_2``) and Lagrangian
    dual values ``g(lambda) = min_{box} <A, x> + lambda/2 (|x - center|^2 - radius^2)`` (any
    ``lambda >= 0`` gives a lower bound by weak duality; the box minimiser is a clipped step, so
    ``g`` is cheap) at the points a bisection on ``g'`` visits. The problem is convex with a
    strictly feasible point, so the dual's maximum is the exact minimum.

    With ``rounding`` each bound is lowered by a bound on its own float32 rounding
    (:mod:`jaxbundle.certify.rounding`): ``gamma`` of its sums' lengths times their absolute
    terms, and for a dual value the excess of its computed box minimiser over the true one.
    """
    # A.c - |A|.r, not sum(min(A * lower, A * upper)): two contractions, which become matrix
    # products when A is the same for a batch of examples (specifications before any ReLU).
    if contract is not None and not isinstance(input_set, Box):
        raise ValueError("only a box's minimum is a sum over elements to contract otherwise")
    contract = contract or _contract
    size = int(np.prod(coefficients.shape[1:]))
    center = 0.5 * (input_set.lower + input_set.upper)
    if rounding:  # a box [center - radius, center + radius] that holds [lower, upper] exactly
        reach = jnp.maximum(input_set.upper - center, center - input_set.lower)
        radius = reach * (1.0 + 4.0 * rounds.UNIT) + rounds.FLOOR
    else:
        radius = 0.5 * (input_set.upper - input_set.lower)
    magnitude = jnp.abs(coefficients)
    spread = contract(magnitude, radius)
    box = contract(coefficients, center) - spread
    if rounding:
        terms = contract(magnitude, jnp.abs(center)) + spread
        box = box - _error(size + 2, terms)
    if isinstance(input_set, Box):
        return box
    axes = tuple(range(1, coefficients.ndim))
    input_set = jax.tree.map(lambda a: a[None] if jnp.ndim(a) else a, input_set)  # the S axis
    length = jnp.sqrt(jnp.sum(jnp.square(coefficients), axis=axes))
    ball = jnp.sum(coefficients * input_set.center, axis=axes) - input_set.radius * length
    if rounding:
        absolute = jnp.sum(magnitude * jnp.abs(input_set.center), axis=axes)
        ball = ball - _error(size + 4, absolute + input_set.radius * length)
    dual = _dual(coefficients, input_set, axes, rounding)
    return jnp.maximum(jnp.maximum(box, ball), jnp.where(jnp.isfinite(dual), dual, -jnp.inf))


def _error(terms: int, absolute: jax.Array) -> jax.Array:
    """The rounding bound of a float32 sum of ``terms`` terms whose absolute values sum to
    ``absolute`` (itself a float32 sum: inflated)."""
    return jax.lax.stop_gradient(rounds.gamma(terms) * rounds.inflation(terms) * absolute
                                 + rounds.FLOOR * terms)


def _contract(coefficients: jax.Array, value: jax.Array) -> jax.Array:
    """``[S]`` inner products of ``coefficients`` ``[S, *shape]`` with ``value`` ``[*shape]``."""
    return jnp.tensordot(coefficients, value, axes=value.ndim)


def _dual(coefficients, input_set: BallInBox, axes, rounding: bool) -> jax.Array:
    """The best dual value over a bisection of ``lambda`` in ``[top / 2**20, top]`` with
    ``top = |A|_2 / radius`` (the optimum is below it: there the unclipped step already ends on
    the sphere). With ``rounding``, each value is lowered by its evaluation's rounding and by
    what the computed minimiser ``clip(center - A / lambda)``, off by at most
    ``2.1 u (|center| + |A| / lambda)`` per element, can add to the true box minimum
    (``1.5 lambda`` times its squared offsets: the minimum is a clipped parabola's)."""
    radius = jnp.maximum(input_set.radius, jnp.finfo(coefficients.dtype).tiny)
    top = jnp.sqrt(jnp.sum(jnp.square(coefficients), axis=axes)) / radius
    shape = (-1,) + (1,) * (coefficients.ndim - 1)
    size = int(np.prod(coefficients.shape[1:]))
    if rounding:  # sums that do not depend on lambda
        farthest = jnp.maximum(jnp.abs(input_set.lower), jnp.abs(input_set.upper))
        reach = jnp.sum(jnp.abs(coefficients) * farthest, axis=axes)
        offsets = (jnp.sum(jnp.square(input_set.center), axis=axes),
                   jnp.sum(jnp.abs(coefficients * input_set.center), axis=axes),
                   jnp.sum(jnp.square(coefficients), axis=axes))

    def value(log_lambda):
        multiplier = jnp.exp2(log_lambda).reshape(shape)
        point = jnp.clip(input_set.center - coefficients / multiplier,
                         input_set.lower, input_set.upper)
        distance = jnp.sum(jnp.square(point - input_set.center), axis=axes)
        objective = jnp.sum(coefficients * point, axis=axes)
        flat = multiplier.reshape(-1)
        dual = objective + 0.5 * flat * (distance - radius**2)
        if rounding:
            excess = 7.0 * rounds.UNIT**2 * (flat * offsets[0] + 2.0 * offsets[1]
                                             + offsets[2] / flat)
            dual = dual - _error(size + 6, reach + 0.5 * flat * (distance + radius**2)) - (
                jax.lax.stop_gradient(excess * rounds.inflation(size)))
        return dual, distance > radius**2  # outside the ball: lambda must grow

    def step(_, state):
        low, high, best = state
        middle = 0.5 * (low + high)
        dual, grow = value(middle)
        best = jnp.maximum(best, jnp.where(jnp.isfinite(dual), dual, -jnp.inf))
        return jnp.where(grow, middle, low), jnp.where(grow, high, middle), best

    high = jnp.log2(jnp.maximum(top, jnp.finfo(coefficients.dtype).tiny))
    start = value(high)[0]
    start = jnp.where(jnp.isfinite(start), start, -jnp.inf)
    return jax.lax.fori_loop(0, _DUAL_STEPS, step, (high - 20.0, high, start))[2]
