"""CROWN: backward linear bound propagation over a :class:`~jaxbundle.certify.graph.Graph`.

Zhang et al. 2018, "Efficient Neural Network Robustness Certification with General Activation
Functions"; CROWN-IBP: Zhang et al. 2020, "Towards Stable and Efficient Training of Verifiably
Robust Neural Networks". A specification ``A`` (``[S, *shape]``: ``S`` linear functions of a
value) is carried backwards to the input: through an affine equation by its VJP (vmapped over
``S``; the equation at zero inputs gives the constant), through a ReLU with input bounds
``[l, u]`` by its linear relaxation (upper: the chord ``u (v - l) / (u - l)``; lower: ``v`` if
``u >= -l`` else 0; stable neurons exactly), through max pooling by ``max >= the element with
the largest lower bound`` and ``max <= max of the upper bounds``. The linear function of the
input that remains is minimised over the input set (:func:`jaxbundle.certify.sets.minimise`).

Lower and upper bounds travel together as a :class:`Pair`; while no relaxation has split them
(every hop before the first ReLU of an identity specification) they are one array, computed
once; for an identity specification it does not depend on the example either, so vmapping over
a group of examples computes it once per group.

Cost: one backward pass per row, each as wide as the whole feature maps it crosses. CROWN's
intermediate bounds (:func:`refinement`) take a row per ReLU that IBP leaves unstable behind
the first activation, chosen per example, and a row per element elsewhere, except that
elements whose input pixels are disjoint share a row (:mod:`jaxbundle.certify.packing`: a
convolution's neurons a receptive field apart); in blocks of :data:`CHUNK_ELEMENTS`. Strided
convolutions' transposes take the sub-pixel form (:func:`jaxbundle.canonical.strided_transpose`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle.canonical import canonical_convolutions
from jaxbundle.certify import graph as graphs
from jaxbundle.certify import ibp, packing
from jaxbundle.certify.sets import Box, BallInBox, minimise

__all__ = [
    "CHUNK_ELEMENTS", "SHARED_ELEMENTS", "Owners", "Pair", "backward", "chunk_elements",
    "linear_bounds", "refinement",
]

# Rows of an identity specification carried at once: at most this many coefficients per
# example for the program's largest value, by backend. On CPU small blocks keep a group's
# coefficients in a core's cache (CROWN on the demo CNN: 2**13 ran 2.1x faster than 2**18);
# accelerators want wide ones.
CHUNK_ELEMENTS = {"cpu": 2**13, "other": 2**18}
# Largest rows x values carried back to the activations once for a whole group of examples
# before the blocks go on from there (64 MiB of float32); above it each block goes the whole way.
SHARED_ELEMENTS = 2**24


def chunk_elements() -> int:
    """:data:`CHUNK_ELEMENTS` for the default backend."""
    return CHUNK_ELEMENTS.get(jax.default_backend(), CHUNK_ELEMENTS["other"])


class Pair(NamedTuple):
    """Coefficients (``[S, *shape]``) or constants (``[S]``) of the lower and the upper bound;
    ``None`` where that side is not wanted; ``upper is lower`` while the two are equal."""

    lower: jax.Array | None
    upper: jax.Array | None

    @property
    def shared(self) -> bool:
        return self.upper is self.lower


def _plus(a, b):
    return b if a is None else a if b is None else a + b


def _add(p: Pair | None, q: Pair | None) -> Pair | None:
    if p is None or q is None:
        return q if p is None else p
    lower = _plus(p.lower, q.lower)
    if p.shared and q.shared:
        return Pair(lower, lower)
    return Pair(lower, _plus(p.upper, q.upper))


class Owners(NamedTuple):
    """Which neuron of a packed row (:mod:`jaxbundle.certify.packing`) each element is for.

    Attributes:
      owner: ``[S, pixels]`` the slot of the row's neuron depending on each input pixel
        (``slots`` where none does).
      pixel: value id -> ``[elements]`` one input pixel each element depends on.
      slots: neurons per row.
    """

    owner: jax.Array
    pixel: dict
    slots: int

    def of(self, value_id) -> jax.Array:
        """``[S, elements]``: the slot of the neuron each element of the value is for."""
        return self.owner[:, self.pixel[value_id]]


def _dot(coefficients, value, owners: Owners | None = None, value_id=None):
    """``[S]`` inner products of ``coefficients`` ``[S, *shape]`` with ``value`` ``[*shape]``;
    with ``owners``, ``[S, slots]``: each packed neuron's share."""
    if coefficients is None or value is None:
        return None
    if owners is None:
        return jnp.tensordot(coefficients, value, axes=value.ndim)
    product = (coefficients * value[None]).reshape(coefficients.shape[0], -1)
    share = jax.nn.one_hot(owners.of(value_id), owners.slots, dtype=product.dtype)
    return jnp.einsum("su,sug->sg", product, share)


def backward(graph: graphs.Graph, state: ibp.Sweep, start: int, coefficients: dict, *,
             elide: bool = False, owners: Owners | None = None) -> tuple[dict, Pair | None]:
    """Carries ``coefficients`` (id -> :class:`Pair` of ``[S, *shape]``) on values computed
    before equation ``start`` back to the input.

    Args:
      graph, state: the program and its IBP sweep (fixed values, activation input bounds).
      start: the index of the first equation not to walk (``len(graph.equations)``: all).
      coefficients: where the linear functions start.
      elide: stop at activation outputs instead of relaxing them (IBP with the specification
        merged into the affine equations that follow the last activations, Gowal et al.).
      owners: for packed rows, the neuron each element is for (constants are then ``[S,
        slots]``).

    Returns:
      ``(frontier, constants)``: id -> :class:`Pair` of the coefficients on the input (and on
      the activation outputs if ``elide``), and the :class:`Pair` of ``[S]`` constants.
    """
    coefficients, frontier, constants = dict(coefficients), {}, None
    for index in range(start - 1, -1, -1):
        equation = graph.equations[index]
        if equation.kind == graphs.CONSTANT:
            continue
        pairs = [coefficients.pop(o, None) for o in equation.outputs]
        if all(p is None for p in pairs):
            continue
        if equation.kind == graphs.AFFINE:
            contributions, extra = _affine(graph, state, equation, pairs, owners)
        elif elide:
            frontier[equation.outputs[0]] = pairs[0]
            continue
        else:
            contributions, extra = _activation(graph, state, index, pairs[0], owners)
        constants = _add(constants, extra)
        for operand, pair in contributions:
            coefficients[operand] = _add(coefficients.get(operand), pair)
    frontier.update(coefficients)
    return frontier, constants


_WEIGHTED = frozenset({"mul", "div", "dot_general", "conv_general_dilated"})


def _affine(graph, state, equation, pairs, owners):
    """Contributions of an affine equation: the VJP of its x-dependent inputs (others fixed)
    applied to every row, and the rows' inner products with the equation at zero inputs."""
    positions = [k for k, i in enumerate(equation.inputs) if graph.dependent(i)]
    fixed = [None if k in positions else state.value(i) for k, i in enumerate(equation.inputs)]

    def linear(*dependent):
        args = list(fixed)
        for k, value in zip(positions, dependent):
            args[k] = value
        return equation.apply(*args)

    zeros = [jnp.zeros(graph.shapes[equation.inputs[k]].shape, jnp.float32) for k in positions]
    if equation.name == "conv_general_dilated":  # transposes XLA:CPU runs fast inside loops
        linear = canonical_convolutions(linear, subpixel=True)
    offsets, pullback = jax.vjp(linear, *zeros)
    # Products by fixed weights and structural operations without fixed floats are linear: no
    # constant (gather may fill out-of-range rows with a constant).
    has_constant = equation.name == "gather" or equation.name not in _WEIGHTED and any(
        jnp.issubdtype(jnp.result_type(f), jnp.floating) for f in fixed if f is not None)

    def pull(side):
        rows = next(a for a in side if a is not None).shape[0]
        cotangents = [a if a is not None else jnp.zeros((rows, *o.shape), o.dtype)
                      for a, o in zip(side, offsets)]
        coefficient = jax.vmap(pullback)(cotangents)
        constant = None
        if has_constant:
            constant = sum(_dot(a, o, owners, i)
                           for a, o, i in zip(side, offsets, equation.outputs) if a is not None)
        return coefficient, constant

    lower_side = [None if p is None else p.lower for p in pairs]
    upper_side = [None if p is None else p.upper for p in pairs]
    shared = all(p is None or p.shared for p in pairs)
    lower = pull(lower_side) if any(a is not None for a in lower_side) else None
    upper = lower if shared else (
        pull(upper_side) if any(a is not None for a in upper_side) else None)
    contributions = []
    for n, k in enumerate(positions):
        low = None if lower is None else lower[0][n]
        high = None if upper is None else upper[0][n]
        contributions.append((equation.inputs[k], Pair(low, low) if shared else Pair(low, high)))
    low_constant = None if lower is None else lower[1]
    high_constant = None if upper is None else upper[1]
    constant = Pair(low_constant, low_constant if shared else high_constant)
    return contributions, constant


def _relaxations(graph, state, index):
    """``(below, above)``: linear functions ``(slope(A), intercept)`` of the activation's input
    below and above its output on ``[l, u]``; ``slope`` maps row coefficients ``[S, *shape]``,
    ``intercept`` is an array of the output's shape; either may be None (zero)."""
    equation = graph.equations[index]
    lower, upper = state.pre[index]
    if equation.kind == graphs.RELU:
        active, unstable = lower >= 0, (lower < 0) & (upper > 0)
        chord = jnp.where(unstable, upper / jnp.where(unstable, upper - lower, 1.0),
                          active.astype(lower.dtype))
        intercept = jnp.where(unstable, -chord * lower, 0.0)
        # Adaptive lower slope: 1 where the chord is steeper than 1/2 (u >= -l), else 0.
        slope = jnp.where(unstable, (upper >= -lower).astype(lower.dtype), chord)
        return (lambda a: a * slope[None], None), (lambda a: a * chord[None], intercept)
    at, other = (lower, upper) if equation.kind == graphs.MAXIMUM else (upper, lower)
    _, route_back = jax.vjp(lambda v: equation.apply(v)[0], at)  # to the argmax of `at`
    route = (lambda a: jax.vmap(route_back)(a)[0], None)
    constant = (None, equation.apply(other)[0])
    return (route, constant) if equation.kind == graphs.MAXIMUM else (constant, route)


def _activation(graph, state, index, pair, owners):
    equation = graph.equations[index]
    operand = graph.operand(equation)
    below, above = _relaxations(graph, state, index)

    def side(a, positive_part, negative_part):
        if a is None:
            return None, None
        positive, negative = jnp.maximum(a, 0.0), jnp.minimum(a, 0.0)
        (slope_p, intercept_p), (slope_n, intercept_n) = positive_part, negative_part
        coefficient = _plus(None if slope_p is None else slope_p(positive),
                            None if slope_n is None else slope_n(negative))
        out = equation.outputs[0]
        return coefficient, _plus(_dot(positive, intercept_p, owners, out),
                                  _dot(negative, intercept_n, owners, out))

    low, low_constant = side(pair.lower, below, above)
    high, high_constant = side(pair.upper, above, below)
    return [(operand, Pair(low, high))], Pair(low_constant, high_constant)


def linear_bounds(graph: graphs.Graph, state: ibp.Sweep, start: int, target, spec: Pair,
                  input_set: Box | BallInBox, *, rounding: float, elide: bool = False,
                  owners: Owners | None = None, head: tuple | None = None):
    """Lower and upper bounds ``[S]`` of ``spec @ value(target)`` over the input set.

    Args:
      graph, state: the program and its sweep.
      start: index of the first equation after ``target``'s (``len(equations)`` for outputs).
      target: the value's id.
      spec: :class:`Pair` of ``[S, *shape]`` rows (``None`` for an unwanted side).
      input_set: the example's set.
      rounding: relative widening (see :mod:`jaxbundle.certify.ibp`).
      elide: IBP with the specification merged into the last affine equations.
      owners: the rows are packed (:mod:`jaxbundle.certify.packing`; a :class:`Box` set).
      head: ``(frontier, constants)``, the rows already carried back as far as the
        activations (:func:`backward` with ``elide``): continue from there.

    Returns:
      ``(lower, upper)``, each ``[S]`` (``[S, slots]`` packed) or None.
    """
    if head is None:
        frontier, constants = backward(graph, state, start, {target: spec}, elide=elide,
                                       owners=owners)
    else:
        frontier, constants = backward(graph, state, start, head[0], owners=owners)
        constants = _add(head[1], constants)
    magnitude = state.interval(target).magnitude
    lower = upper = None
    for operand, pair in frontier.items():
        region = input_set if operand == graph.input else Box(
            *state.interval(operand).bounds(rounding))
        split = None if owners is None else functools.partial(_dot, owners=owners,
                                                              value_id=operand)
        if pair.lower is not None:
            lower = _plus(lower, minimise(pair.lower, region, contract=split))
        if pair.upper is not None:
            upper = _plus(upper, -minimise(-pair.upper, region, contract=split))
    constants = constants or Pair(None, None)

    def finish(bound, rows, constant):
        if rows is None:
            return None
        shape = rows.shape[:1] if owners is None else (rows.shape[0], owners.slots)
        bound = _plus(_plus(bound, constant), jnp.zeros(shape, jnp.float32))
        slack = _dot(jnp.abs(rows), magnitude, owners, target)
        return bound, jax.lax.stop_gradient(rounding * slack)

    low, high = finish(lower, spec.lower, constants.lower), finish(upper, spec.upper,
                                                                   constants.upper)
    return (None if low is None else low[0] - low[1],
            None if high is None else high[0] + high[1])


def refinement(graph: graphs.Graph, input_set: Box | BallInBox, *, rounding: float,
               sparse: bool = True, axis_name: str | None = None) -> ibp.Refine:
    """CROWN bounds on an activation's input (for :func:`jaxbundle.certify.ibp.sweep`): an
    identity specification of its elements, in blocks of rows (:func:`chunk_elements`),
    several elements to a row where their input pixels are disjoint
    (:mod:`jaxbundle.certify.packing`; box sets). The rows are carried back as far as the
    activations once for a group of examples (that part does not depend on the example),
    then block by block the rest of the way.

    With ``sparse``, a ReLU behind another activation gets CROWN's bounds only where its IBP
    bounds leave it unstable (a stable ReLU's relaxation is exact whatever its bounds; the
    others keep IBP's, which only the IBP part of the final bound,
    :func:`jaxbundle.certify.bounds.margin_bounds`, reads). Their rows are chosen per example,
    one neuron each, so the cost follows the example's instability rather than the layer's
    width; under ``vmap`` with ``axis_name``, a group whose most unstable example would need
    more rows than the packed layer has computes every packed row instead (the same bounds).
    """
    largest = max(int(np.prod(s.shape)) for i, s in graph.shapes.items() if i in graph.depends)
    found = packing.dependencies(graph) if isinstance(input_set, Box) else None
    behind = _behind_activation(graph)

    def refine(index, state):
        equation = graph.equations[index]
        operand = graph.operand(equation)
        packed = packing.pack(graph, operand, found)
        args = (graph, state, index, operand, input_set, rounding, largest)
        if not (sparse and equation.kind == graphs.RELU and operand in behind):
            return _Blocks(*args, packed).bounds()
        lower, upper = state.interval(operand).bounds(rounding)
        unstable = (lower < 0) & (upper > 0)

        def selected():  # each example's unstable neurons, one to a row
            return _Blocks(*args, None).bounds(unstable.reshape(-1))

        if packed is None or axis_name is None:
            low, high = selected()
        else:  # every packed row for a group too unstable for one neuron a row
            most = jax.lax.pmax(jnp.sum(unstable), axis_name)  # the same for the whole group
            low, high = jax.lax.cond(most <= packed.members.shape[0], selected,
                                     lambda: _Blocks(*args, packed).bounds())
        # CROWN's bounds only where IBP leaves the neuron unstable: the rest keep IBP's, whatever
        # rows a block or a branch happened to compute.
        return jnp.where(unstable, low, -jnp.inf), jnp.where(unstable, high, jnp.inf)

    return refine


class _Blocks:
    """The rows of an activation input's identity specification, in blocks of ``rows``: one
    element each, or packed (``packed``)."""

    def __init__(self, graph, state, index, operand, input_set, rounding, largest, packed):
        self.graph, self.state, self.index, self.operand = graph, state, index, operand
        self.input_set, self.rounding, self.packed = input_set, rounding, packed
        self.shape = graph.shapes[operand].shape
        self.size = int(np.prod(self.shape))
        members = np.arange(self.size)[:, None] if packed is None else packed.members
        count = members.shape[0]
        self.rows = max(1, min(count, chunk_elements() // largest))
        self.blocks = -(-count // self.rows)
        pad = [(0, self.blocks * self.rows - count), (0, 0)]
        self.members = jnp.asarray(np.pad(members, pad, constant_values=self.size))
        self.owner = None if packed is None else jnp.asarray(
            np.pad(packed.owner, pad, constant_values=packed.slots))
        self.head = None
        every = jnp.arange(self.blocks * self.rows)
        if self.blocks * self.rows * largest <= SHARED_ELEMENTS:
            self.head = backward(graph, state, index, {operand: self.spec(every)}, elide=True,
                                 owners=self.owners(every))

    def owners(self, chosen):
        packed = self.packed
        return None if packed is None else Owners(self.owner[chosen], packed.pixel, packed.slots)

    def spec(self, chosen):
        rows = jnp.any(self.members[chosen][:, :, None] == jnp.arange(self.size)[None, None],
                       axis=1)
        rows = rows.astype(jnp.float32).reshape(len(chosen), *self.shape)
        return Pair(rows, rows)

    def bound(self, chosen):
        """``(lower, upper)`` of the rows ``chosen``."""
        head = None if self.head is None else _rows(self.head, chosen)
        return linear_bounds(self.graph, self.state, self.index, self.operand,
                             self.spec(chosen), self.input_set, rounding=self.rounding,
                             owners=self.owners(chosen), head=head)

    def bounds(self, wanted=None):
        """``(lower, upper)`` of every element, or (one to a row) of at least the ``wanted``
        elements ``[size]``: the rows holding them first, block by block while any is left;
        infinite for the elements no block reached."""
        size, rows = self.size, self.rows
        low, high = jnp.full(size + 1, -jnp.inf), jnp.full(size + 1, jnp.inf)

        def scatter(out, chosen, values):
            return out.at[self.members[chosen].reshape(-1)].set(values.reshape(-1))

        if wanted is None:
            chosen = jnp.arange(self.blocks * rows).reshape(self.blocks, rows)
            lower, upper = jax.lax.map(self.bound, chosen)
            low, high = scatter(low, chosen, lower), scatter(high, chosen, upper)
        else:
            wanted = jnp.append(wanted, jnp.zeros(self.blocks * rows - size, bool))
            order = jnp.argsort(~wanted, stable=True)  # the wanted rows first

            def step(carry):
                block, low, high = carry
                chosen = jax.lax.dynamic_slice_in_dim(order, block * rows, rows)
                lower, upper = self.bound(chosen)
                return block + 1, scatter(low, chosen, lower), scatter(high, chosen, upper)

            _, low, high = jax.lax.while_loop(lambda c: c[0] * rows < jnp.sum(wanted), step,
                                              (0, low, high))
        return low[:size].reshape(self.shape), high[:size].reshape(self.shape)


def _rows(head, chosen):
    """The rows ``chosen`` of ``(frontier, constants)`` (:func:`backward`'s)."""
    def take(pair):
        if pair is None:
            return None
        lower = None if pair.lower is None else pair.lower[chosen]
        return Pair(lower, lower if pair.shared else (
            None if pair.upper is None else pair.upper[chosen]))

    frontier, constants = head
    return {i: take(pair) for i, pair in frontier.items()}, take(constants)


def _behind_activation(graph: graphs.Graph) -> frozenset:
    """Ids of the values computed from an activation's output."""
    behind = set()
    for equation in graph.equations:
        if equation.kind not in (graphs.AFFINE, graphs.CONSTANT) or any(
                i in behind for i in equation.inputs if isinstance(i, int)):
            behind.update(equation.outputs)
    return frozenset(behind)
