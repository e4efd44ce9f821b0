"""Interval bound propagation (IBP) over a :class:`~jaxbundle.certify.graph.Graph`.

Intervals are kept in center/radius form (Gowal et al. 2018, "On the Effectiveness of Interval
Bound Propagation for Training Verifiably Robust Models"): an affine equation maps the center
by the equation itself and the radius by its absolute value ``|op|`` (the same equation with
absolute weights; sums for differences; additive constants dropped). ReLU and max pooling are
monotone, so they map the interval's ends.

On an L2 set the sweep also carries, up to the first activation, the ball's own reach
(:class:`Ball`): a value affine in the input is ``center + A (x - x0)``, and over
``|x - x0|_2 <= eps`` each element lies within ``eps |A_i|_2`` of its center. A linear layer on
the input itself (scaled, reshaped, sliced: rows along distinct pixels) gets that norm exactly,
the root of its squared weights applied to the squared radii; after it, sums follow the
triangle inequality like IBP's radii. The activation's input is bounded by the tighter of the
two (the first layer's bound of Gowal et al.'s L2 IBP and auto_LiRPA's; the Linf hull alone
leaves L2 certification by IBP and CROWN-IBP near nothing).

Float32 rounding. Next to each interval the sweep carries a magnitude ``m``: the same
propagation with every fixed operand replaced by its absolute value, restarted at every
activation from the bounds of its output, so that ``m`` bounds the sum of the absolute values of
the terms each layer's values are computed from. Every bound the package returns or relaxes
with is widened by ``rounding * m`` (see :func:`rounding_for`): rounding in float32 sums is a
few ulps of that sum per operation, in the model's own forward pass and in the bound's
computation. It is a margin for float32's rounding as it occurs, not a worst-case proof (the
worst case, a product of ``|W|`` over the layers, is orders of magnitude above any observed
error and left nothing certified on the demo CNNs); docs/certify.md says so.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxbundle.certify import graph as graphs
from jaxbundle.certify.sets import BallInBox, Box, hull

__all__ = [
    "ROUNDING_PER_EQUATION", "Ball", "Interval", "Sweep", "absolute", "interval_of",
    "rounding_for", "sweep",
]

# Widening per x-dependent equation, relative to the magnitude: 2**7 ulps of float32. Sums of n
# terms round by about sqrt(n) ulps of their absolute sum in practice (at most n - 1 in the
# worst case), so this covers contractions of up to 16k terms in practice, 128 in the worst case.
ROUNDING_PER_EQUATION = 2.0**-17


def rounding_for(graph: graphs.Graph) -> float:
    """The relative widening of a graph's bounds: :data:`ROUNDING_PER_EQUATION` for every
    x-dependent equation (rounding accumulates along the program)."""
    return ROUNDING_PER_EQUATION * sum(e.kind != graphs.CONSTANT for e in graph.equations)


class Interval(NamedTuple):
    """``center - radius <= value <= center + radius``; ``magnitude`` >= ``|center| + radius``
    bounds the absolute sum of the terms the value is computed from. Arrays of its shape."""

    center: jax.Array
    radius: jax.Array
    magnitude: jax.Array

    def bounds(self, rounding: float) -> tuple[jax.Array, jax.Array]:
        """``(lower, upper)`` widened by ``rounding * magnitude``."""
        slack = jax.lax.stop_gradient(rounding * self.magnitude)
        return self.center - self.radius - slack, self.center + self.radius + slack


class Ball(NamedTuple):
    """Over an L2 ball, ``|value - center| <= radius`` elementwise, for a value affine in the
    input with no activation between (``radius = eps |A_i|_2``, ``A`` the map's matrix).

    ``orthogonal``: the rows ``A_i`` are multiples of distinct unit vectors (the input scaled,
    reshaped, sliced or padded), so a weighted sum's row norm is the root of the sum of its
    squared terms, exactly; otherwise sums are bounded by the triangle inequality."""

    center: jax.Array
    radius: jax.Array
    orthogonal: bool


def interval_of(lower: jax.Array, upper: jax.Array, magnitude: jax.Array) -> Interval:
    """The interval ``[lower, upper]`` in center/radius form."""
    return Interval(0.5 * (lower + upper), 0.5 * (upper - lower), magnitude)


class Sweep(NamedTuple):
    """What one forward pass computed for one example.

    Attributes:
      values: id -> value of every x-independent value (parameters, constants, their results).
      intervals: id -> :class:`Interval` of every x-dependent value.
      pre: equation index -> ``(lower, upper)`` of the (x-dependent) input of each ReLU,
        max or min equation, widened: what its relaxation uses.
      balls: id -> :class:`Ball` of the values before any activation, on an L2 set (empty on
        a box).
    """

    values: dict
    intervals: dict
    pre: dict
    balls: dict

    def value(self, operand):
        """The value of an x-independent operand (an id or a ``Constant``)."""
        return operand.value if isinstance(operand, graphs.Constant) else self.values[operand]

    def interval(self, operand) -> Interval:
        """The interval of any value (a point for an x-independent one)."""
        if operand in self.intervals:
            return self.intervals[operand]
        value = jnp.asarray(self.value(operand), jnp.float32)
        return Interval(value, jnp.zeros_like(value), jnp.abs(value))


Refine = Callable[[int, "Sweep"], "tuple[jax.Array, jax.Array]"]


def sweep(graph: graphs.Graph, arguments: list, region: Box | BallInBox, *, rounding: float,
          refine: Refine | None = None) -> Sweep:
    """IBP through ``graph`` for one example.

    Args:
      graph: the model's program (:func:`jaxbundle.certify.graph.trace`).
      arguments: the parameters' leaves.
      region: the input set, ``[1, H, W, C]`` arrays: a :class:`~jaxbundle.certify.sets.Box`,
        or an L2 :class:`~jaxbundle.certify.sets.BallInBox` (its hull, and its :class:`Ball`
        up to the first activation).
      rounding: relative widening (:func:`rounding_for`; 0 gives the papers' exact formulas).
      refine: ``refine(index, sweep_so_far) -> (lower, upper)``, other sound bounds on the input
        of activation equation ``index`` (CROWN's), intersected with IBP's.

    Returns:
      The :class:`Sweep`.
    """
    values = dict(graph.constants)
    values.update(zip(graph.arguments, arguments))
    box = hull(region)
    magnitude = jnp.maximum(jnp.abs(box.lower), jnp.abs(box.upper))
    intervals = {graph.input: interval_of(box.lower, box.upper, magnitude)}
    balls = {}
    if isinstance(region, BallInBox):
        balls[graph.input] = Ball(region.center,
                                  jnp.broadcast_to(region.radius, region.center.shape), True)
    state = Sweep(values, intervals, {}, balls)
    for index, equation in enumerate(graph.equations):
        if equation.kind == graphs.CONSTANT:
            outputs = equation.apply(*(state.value(i) for i in equation.inputs))
            values.update(zip(equation.outputs, outputs))
        elif equation.kind == graphs.AFFINE:
            intervals.update(zip(equation.outputs, _affine(graph, state, equation)))
            balls.update(zip(equation.outputs, _ball(graph, state, equation)))
        else:
            operand = graph.operand(equation)
            lower, upper = intervals[operand].bounds(rounding)
            if operand in balls:
                lower, upper = _within(balls[operand], intervals[operand], lower, upper,
                                       rounding)
            if refine is not None:
                better_lower, better_upper = refine(index, state)
                lower, upper = jnp.maximum(lower, better_lower), jnp.minimum(upper, better_upper)
            state.pre[index] = (lower, upper)
            # Each layer's sums round in proportion to the values they sum: the magnitude
            # restarts at every activation from its output's own bounds, 0 for a ReLU that
            # is off (a product of |weights| through every layer would measure the worst case
            # of an error nobody meets, and certified nothing on the demo CNNs).
            intervals[equation.outputs[0]] = _activation(equation, lower, upper)
    return state


def _affine(graph, state: Sweep, equation) -> list[Interval]:
    dependent = [graph.dependent(i) for i in equation.inputs]

    def pick(field):
        return [getattr(state.intervals[i], field) if d else state.value(i)
                for i, d in zip(equation.inputs, dependent)]

    centers = equation.apply(*pick("center"))
    radii = absolute(equation, pick("radius"), dependent, constants=False)
    magnitudes = absolute(equation, pick("magnitude"), dependent, constants=True)
    magnitudes = [jax.lax.stop_gradient(m) for m in magnitudes]
    return [Interval(*parts) for parts in zip(centers, radii, magnitudes)]


# Affine equations that move each element of their x-dependent input to at most one place
# (:class:`Ball`'s rows stay along distinct unit vectors), and the elementwise ones, which do
# when the x-dependent operand has the output's shape (no broadcast scalar).
_REARRANGING = frozenset({
    "reshape", "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice", "pad", "rev",
    "convert_element_type", "copy", "copy_p", "stop_gradient", "sharding_constraint",
})
_ELEMENTWISE = frozenset({"mul", "div", "neg", "add", "sub", "select_n"})


def _ball(graph, state: Sweep, equation) -> list[Ball]:
    """The outputs' :class:`Ball` each, where every x-dependent input has one (else none)."""
    dependent = [graph.dependent(i) for i in equation.inputs]
    balls = [state.balls.get(i) for i, d in zip(equation.inputs, dependent) if d]
    if not all(balls):
        return []

    def arguments(values):  # the equation's arguments, ``values`` at its x-dependent inputs
        each = iter(values)
        return [next(each) if d else state.value(i) for i, d in zip(equation.inputs, dependent)]

    centers = equation.apply(*arguments(b.center for b in balls))
    if len(balls) == 1 and balls[0].orthogonal:  # sum_k w_k^2 r_k^2 is each row's norm^2
        squares = absolute(equation, arguments([jnp.square(balls[0].radius)]), dependent,
                           constants=False, power=2)
        radii = [jnp.sqrt(r) for r in squares]
        keep = equation.name in _REARRANGING or equation.name in _ELEMENTWISE and all(
            jnp.shape(c) == jnp.shape(balls[0].center) for c in centers)
    else:  # the triangle inequality, as IBP's radii
        radii = absolute(equation, arguments(b.radius for b in balls), dependent,
                         constants=False)
        keep = False
    return [Ball(c, r, keep) for c, r in zip(centers, radii)]


def _within(ball: Ball, interval: Interval, lower, upper, rounding):
    """``[lower, upper]`` intersected with the ball's bounds, widened for rounding like the
    interval's (by the larger magnitude)."""
    slack = jax.lax.stop_gradient(
        rounding * jnp.maximum(interval.magnitude, jnp.abs(ball.center) + ball.radius))
    return (jnp.maximum(lower, ball.center - ball.radius - slack),
            jnp.minimum(upper, ball.center + ball.radius + slack))


def absolute(equation, arguments: list, dependent: list[bool], *, constants: bool,
             power: int = 1) -> list:
    """``|op|`` of an affine equation applied to non-negative ``arguments`` at its x-dependent
    inputs: weights (fixed operands of products, quotients, dot products and convolutions) by
    their absolute values (to the ``power``), differences as sums, and additive fixed operands
    by their absolute values when ``constants`` (magnitudes) or zero otherwise (radii)."""
    def fixed(value, weight):
        if not jnp.issubdtype(jnp.result_type(value), jnp.floating):
            return value  # indices, predicates
        if weight and power != 1:
            return jnp.abs(value) ** power
        return jnp.abs(value) if weight or constants else jnp.zeros_like(value)

    weight = equation.name in ("mul", "div", "dot_general", "conv_general_dilated")
    args = [a if d else fixed(a, weight) for a, d in zip(arguments, dependent)]
    if equation.name == "neg":
        return args
    if equation.name == "sub":
        return [jnp.add(*args)]
    return equation.apply(*args)


def _activation(equation, lower, upper) -> Interval:
    """The interval of a monotone activation's output from its input's ``[lower, upper]``, its
    magnitude the output's own bound on its absolute value."""
    if equation.kind == graphs.RELU:
        low, high = jnp.maximum(lower, 0.0), jnp.maximum(upper, 0.0)
    else:
        (low,), (high,) = equation.apply(lower), equation.apply(upper)
    magnitude = jax.lax.stop_gradient(jnp.maximum(jnp.abs(low), jnp.abs(high)))
    return interval_of(low, high, magnitude)
