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

Float32 rounding (:mod:`jaxbundle.certify.rounding`). Each affine equation's interval is widened
by its rounding slack, a bound on the model's rounding of it and the bound's own, from the
equation with absolute weights applied to its inputs' magnitudes (``|center| + radius``): the
interval then holds the model's float32 value at every point of the input set, and every bound
read from it is rounded outward. ``error`` carries, from the last activation on, the rounding
that rows carried back through those equations meet (the model's, their own coefficients'
and constants'): CROWN adds it where its rows enter the chain, the complete mode relaxes each
pre-activation by it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxbundle.certify import graph as graphs
from jaxbundle.certify import rounding as rounds
from jaxbundle.certify.sets import BallInBox, Box, hull

__all__ = ["Ball", "Interval", "Sweep", "absolute", "error_of", "interval_of", "sweep"]


class Interval(NamedTuple):
    """``center - radius <= value <= center + radius`` (exactly, in real arithmetic) for the
    model's float32 value at every point of the input set. ``error`` (None: none, as after an
    activation): how far the model's float32 value may be from the exact result of the
    equations since the last activation, and linear rows carried back through them
    (CROWN's, the complete mode's maps) from their own rounding: what CROWN's rows pay where
    they enter such a chain, and what the complete mode's program is relaxed by. Arrays of
    its shape."""

    center: jax.Array
    radius: jax.Array
    error: jax.Array | None = None

    def bounds(self, rounding: bool = True) -> tuple[jax.Array, jax.Array]:
        """``(lower, upper)``, rounded outward with ``rounding``."""
        lower, upper = self.center - self.radius, self.center + self.radius
        return rounds.outward(lower, upper) if rounding else (lower, upper)

    def magnitude(self) -> jax.Array:
        """An upper bound on ``|value|`` (:func:`jaxbundle.certify.rounding.magnitude`)."""
        return rounds.magnitude(self.center, self.radius)


class Ball(NamedTuple):
    """Over an L2 ball, ``|value - center| <= radius + error`` elementwise, for a value affine
    in the input with no activation between (``radius = eps |A_i|_2``, ``A`` the map's
    matrix, ``error`` the rounding of the model's float32 value and of ``center`` and
    ``radius`` themselves).

    ``orthogonal``: the rows ``A_i`` are multiples of distinct unit vectors (the input scaled,
    reshaped, sliced or padded), so a weighted sum's row norm is the root of the sum of its
    squared terms, exactly; otherwise sums are bounded by the triangle inequality."""

    center: jax.Array
    radius: jax.Array
    orthogonal: bool
    error: jax.Array


def interval_of(lower: jax.Array, upper: jax.Array, rounding: bool = True) -> Interval:
    """The interval ``[lower, upper]`` in center/radius form (with ``rounding``, a radius that
    covers both ends exactly whatever the center's rounding)."""
    center = 0.5 * (lower + upper)
    if not rounding:
        return Interval(center, 0.5 * (upper - lower))
    reach = jnp.maximum(upper - center, center - lower)
    return Interval(center, reach * (1.0 + 4.0 * rounds.UNIT) + rounds.FLOOR)


class Sweep(NamedTuple):
    """What one forward pass computed for one example.

    Attributes:
      values: id -> value of every x-independent value (parameters, constants, their results).
      intervals: id -> :class:`Interval` of every x-dependent value.
      pre: equation index -> ``(lower, upper)`` of the (x-dependent) input of each ReLU,
        max or min equation, rounded outward: what its relaxation uses.
      balls: id -> :class:`Ball` of the values before any activation, on an L2 set (empty on
        a box).
      rounding: whether the bounds allow for float32's rounding.
    """

    values: dict
    intervals: dict
    pre: dict
    balls: dict
    rounding: bool

    def value(self, operand):
        """The value of an x-independent operand (an id or a ``Constant``)."""
        return operand.value if isinstance(operand, graphs.Constant) else self.values[operand]

    def interval(self, operand) -> Interval:
        """The interval of any value (a point for an x-independent one)."""
        if operand in self.intervals:
            return self.intervals[operand]
        value = jnp.asarray(self.value(operand), jnp.float32)
        return Interval(value, jnp.zeros_like(value))


Refine = Callable[[int, "Sweep"], "tuple[jax.Array, jax.Array]"]


def sweep(graph: graphs.Graph, arguments: list, region: Box | BallInBox, *,
          rounding: bool = True, refine: Refine | None = None) -> Sweep:
    """IBP through ``graph`` for one example.

    Args:
      graph: the model's program (:func:`jaxbundle.certify.graph.trace`).
      arguments: the parameters' leaves.
      region: the input set, ``[1, H, W, C]`` arrays: a :class:`~jaxbundle.certify.sets.Box`,
        or an L2 :class:`~jaxbundle.certify.sets.BallInBox` (its hull, and its :class:`Ball`
        up to the first activation).
      rounding: allow for float32's rounding (:mod:`jaxbundle.certify.rounding`); False gives
        the papers' formulas in real arithmetic, for comparisons.
      refine: ``refine(index, sweep_so_far) -> (lower, upper)``, other sound bounds on the input
        of activation equation ``index`` (CROWN's), intersected with IBP's.

    Returns:
      The :class:`Sweep`.
    """
    values = dict(graph.constants)
    values.update(zip(graph.arguments, arguments))
    box = hull(region)
    intervals = {graph.input: interval_of(box.lower, box.upper, rounding)}
    balls = {}
    if isinstance(region, BallInBox):
        balls[graph.input] = Ball(region.center,
                                  jnp.broadcast_to(region.radius, region.center.shape), True,
                                  jnp.zeros_like(region.center))
    state = Sweep(values, intervals, {}, balls, rounding)
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
                lower, upper = _within(balls[operand], lower, upper, rounding)
            if refine is not None:
                better_lower, better_upper = refine(index, state)
                lower, upper = jnp.maximum(lower, better_lower), jnp.minimum(upper, better_upper)
            state.pre[index] = (lower, upper)
            intervals[equation.outputs[0]] = _activation(equation, lower, upper, rounding)
    return state


def error_of(interval: Interval) -> jax.Array:
    """The interval's rounding error since the last activation (zeros for none)."""
    return jnp.zeros_like(interval.center) if interval.error is None else interval.error


# Affine equations whose transposes carry rows without a constant: products by fixed weights.
_WEIGHTED = frozenset({"mul", "div", "dot_general", "conv_general_dilated"})


def adds_constant(equation, fixed: list) -> bool:
    """Whether an affine equation adds a constant to its x-dependent inputs' linear image (a
    fixed float operand of a sum or difference, or the fill of a gather), given its fixed
    operands (None at x-dependent inputs)."""
    return equation.name == "gather" or equation.name not in _WEIGHTED and any(
        jnp.issubdtype(jnp.result_type(f), jnp.floating) for f in fixed if f is not None)


def _affine(graph, state: Sweep, equation) -> list[Interval]:
    """The outputs' intervals: the equation on the centers, ``|op|`` on the radii, and with
    rounding each output's slacks (:func:`jaxbundle.certify.rounding.slack`) added: an
    interval's to its radius; a crossing's, and the rounding of a crossing row's inner product
    with the constant the equation adds, to its error, which CROWN's rows pay once for the
    whole chain of equations since the last activation."""
    dependent = [graph.dependent(i) for i in equation.inputs]

    def pick(read):
        return [read(state.intervals[i]) if d else state.value(i)
                for i, d in zip(equation.inputs, dependent)]

    centers = equation.apply(*pick(lambda v: v.center))
    radii = absolute(equation, pick(lambda v: v.radius), dependent, constants=False)
    if not state.rounding:
        return [Interval(c, r) for c, r in zip(centers, radii)]
    magnitudes = absolute(equation, pick(Interval.magnitude), dependent, constants=True)
    widths = [rounds.slack(equation.arithmetic, m, crossing=False) for m in magnitudes]
    errors = [rounds.slack(equation.arithmetic, m, crossing=True) for m in magnitudes]
    if adds_constant(equation, [None if d else state.value(i)
                                for i, d in zip(equation.inputs, dependent)]):
        offsets = absolute(equation, pick(lambda v: jnp.zeros_like(v.center)), dependent,
                           constants=True)
        errors = [e + rounds.summed(o) for e, o in zip(errors, offsets)]
    if any(d and state.intervals[i].error is not None
           for i, d in zip(equation.inputs, dependent)):
        carried = absolute(equation, pick(error_of), dependent, constants=False)
        errors = [c + e for c, e in zip(carried, errors)]
    return [Interval(c, r + w, e) for c, r, w, e in zip(centers, radii, widths, errors)]


# Affine equations that move each element of their x-dependent input to at most one place
# (:class:`Ball`'s rows stay along distinct unit vectors), and the elementwise ones, which do
# when the x-dependent operand has the output's shape (no broadcast scalar).
_REARRANGING = frozenset({
    "reshape", "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice", "pad", "rev",
    "convert_element_type", "copy", "copy_p", "stop_gradient", "sharding_constraint",
})
_ELEMENTWISE = frozenset({"mul", "div", "neg", "add", "sub", "select_n"})


def _ball(graph, state: Sweep, equation) -> list[Ball]:
    """The outputs' :class:`Ball` each, where every x-dependent input has one (else none). With
    rounding, each output's error is the inputs' carried through ``|op|`` plus the equation's
    slack at the balls' own magnitudes (``|center| + radius + error``)."""
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
    if not state.rounding:
        return [Ball(c, r, keep, jnp.zeros_like(c)) for c, r in zip(centers, radii)]
    reach = [rounds.magnitude(b.center, b.radius + b.error) for b in balls]
    magnitudes = absolute(equation, arguments(reach), dependent, constants=True)
    carried = absolute(equation, arguments(b.error for b in balls), dependent, constants=False)
    errors = [e + rounds.slack(equation.arithmetic, m, crossing=False)
              for e, m in zip(carried, magnitudes)]
    return [Ball(c, r, keep, e) for c, r, e in zip(centers, radii, errors)]


def _within(ball: Ball, lower, upper, rounding: bool):
    """``[lower, upper]`` intersected with the ball's bounds (rounded outward with
    ``rounding``)."""
    reach = ball.radius + ball.error
    low, high = ball.center - reach, ball.center + reach
    if rounding:
        low, high = rounds.outward(low, high)
    return jnp.maximum(lower, low), jnp.minimum(upper, high)


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


def _activation(equation, lower, upper, rounding: bool) -> Interval:
    """The interval of a monotone activation's output from its input's ``[lower, upper]``
    (exact: ReLU and max pooling do not round), with no rounding error carried."""
    if equation.kind == graphs.RELU:
        low, high = jnp.maximum(lower, 0.0), jnp.maximum(upper, 0.0)
    else:
        (low,), (high,) = equation.apply(lower), equation.apply(upper)
    return interval_of(low, high, rounding)
