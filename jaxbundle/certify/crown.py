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
convolutions' transposes take the sub-pixel form
(:func:`jaxbundle.core.canonical.strided_transpose`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle.core.canonical import canonical_convolutions
from jaxbundle.certify import graph as graphs
from jaxbundle.certify import ibp, packing
from jaxbundle.certify import rounding as rounds
from jaxbundle.certify.sets import Box, BallInBox, minimise

__all__ = [
    "CHUNK_ELEMENTS", "SHARED_ELEMENTS", "Carried", "Owners", "Pair", "backward",
    "chunk_elements", "linear_bounds", "refinement",
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
    rows = product.shape[0]
    bucket = owners.of(value_id) + (owners.slots + 1) * jnp.arange(rows)[:, None]
    shares = jax.ops.segment_sum(product.reshape(-1), bucket.reshape(-1),
                                 num_segments=rows * (owners.slots + 1))
    return shares.reshape(rows, owners.slots + 1)[:, :owners.slots]  # the last: no neuron's


class Carried(NamedTuple):
    """Rows carried back by :func:`backward`.

    Attributes:
      frontier: id -> :class:`Pair` of the coefficients on the input (and on the activation
        outputs when elided).
      constants: :class:`Pair` of ``[S]`` constants (``[S, slots]`` packed), or None.
      errors: :class:`Pair` of ``[S]`` non-negative allowances for float32's rounding (the
        model's and the pass's own, :mod:`jaxbundle.certify.rounding`), subtracted from the
        lower bound and added to the upper; None without rounding.
    """

    frontier: dict
    constants: Pair | None
    errors: Pair | None


def backward(graph: graphs.Graph, state: ibp.Sweep, start: int, coefficients: dict, *,
             elide: bool = False, owners: Owners | None = None, shared: bool = False
             ) -> Carried:
    """Carries ``coefficients`` (id -> :class:`Pair` of ``[S, *shape]``) on values computed
    before equation ``start`` back to the input.

    With rounding (``state.rounding``) the rows' errors grow where they enter a chain of affine
    equations (at the start, and at each activation's input): by the rounding the chain's
    equations meet, the model's and the rows' own (:attr:`jaxbundle.certify.ibp.Interval.error`,
    summed forward by the sweep); where they cross an activation, by the rounding of the
    relaxation's products and constants; by the rounding of each constant's running sum; and
    where a value of several uses sums its coefficients.

    Args:
      graph, state: the program and its IBP sweep (fixed values, activation input bounds).
      start: the index of the first equation not to walk (``len(graph.equations)``: all).
      coefficients: where the linear functions start.
      elide: stop at activation outputs instead of relaxing them (IBP with the specification
        merged into the affine equations that follow the last activations, Gowal et al.).
      owners: for packed rows, the neuron each element is for (constants are then ``[S,
        slots]``).
      shared: ``coefficients`` are the same for every example of a vmapped group (how the
        errors are summed fastest, :func:`_allowance`).

    Returns:
      The :class:`Carried` rows.
    """
    coefficients, frontier, constants, errors = dict(coefficients), {}, None, None
    steps = rounds.gamma(len(graph.equations) + 2)  # a constant's share of the running sum's
    if state.rounding:  # the chains the rows start in
        for value_id, pair in coefficients.items():
            chain = state.interval(value_id).error
            if chain is not None:
                errors = _add(errors, _allowance(pair, chain, owners, value_id, shared=shared))
    for index in range(start - 1, -1, -1):
        equation = graph.equations[index]
        if equation.kind == graphs.CONSTANT:
            continue
        pairs = [coefficients.pop(o, None) for o in equation.outputs]
        if all(p is None for p in pairs):
            continue
        if equation.kind == graphs.AFFINE:
            contributions, extra = _affine(graph, state, equation, pairs, owners)
            error = None
        elif elide:
            frontier[equation.outputs[0]] = pairs[0]
            continue
        else:
            contributions, extra, error = _activation(graph, state, index, pairs[0], owners,
                                                      shared)
        constants = _add(constants, extra)
        if state.rounding:
            errors = _add(_add(errors, error), _scaled(extra, steps))
        for operand, pair in contributions:
            before = coefficients.get(operand)
            if state.rounding and before is not None:  # a value of several uses: a sum rounds
                errors = _add(errors, _fan_in(state, operand, before, pair, owners, shared))
            coefficients[operand] = _add(before, pair)
    frontier.update(coefficients)
    return Carried(frontier, constants, errors)


def _map(pair: Pair | None, function) -> Pair | None:
    """``function`` of each side of ``pair`` (once while they are one array)."""
    if pair is None:
        return None
    lower = None if pair.lower is None else function(pair.lower)
    if pair.shared:
        return Pair(lower, lower)
    return Pair(lower, None if pair.upper is None else function(pair.upper))


def _scaled(pair: Pair | None, factor: float) -> Pair | None:
    """``factor * |pair|`` on each side."""
    return _map(pair, lambda a: factor * jnp.abs(a))


def _allowance(rows: Pair, value, owners, value_id, factor: float = 1.0, *,
               shared: bool = False) -> Pair:
    """``factor * |rows| . value`` on each side (``value`` non-negative), inflated for its own
    rounding: the error allowance of rows crossing a value whose elements may each be off by
    ``factor * value``. ``shared``: the rows are the same for every example of a vmapped
    group (a block's head), so the sum is a matrix product over the group's values; otherwise
    a product and a sum XLA fuses (a dot of one row per example is slow on CPU)."""
    size = int(np.prod(jnp.shape(value)))
    scale = factor * rounds.inflation(size)
    flat = jnp.reshape(value, -1)
    if owners is None and shared:
        return _map(rows, lambda a: scale * (jnp.abs(a).reshape(a.shape[0], -1) @ flat))
    if owners is None:
        axes = tuple(range(1, 1 + jnp.ndim(value)))
        return _map(rows, lambda a: scale * jnp.sum(jnp.abs(a) * value[None], axis=axes))
    if shared:  # each row's absolute values split by owner: then one product with the values
        share = jax.nn.one_hot(owners.of(value_id), owners.slots, dtype=flat.dtype)

        def split(a):
            return jnp.einsum("sug,u->sg", jnp.abs(a).reshape(a.shape[0], -1)[..., None] * share,
                              flat)
        return _map(rows, lambda a: scale * split(a))
    return _map(rows, lambda a: scale * _dot(jnp.abs(a), value, owners, value_id))


def _fan_in(state, operand, before: Pair, added: Pair, owners, shared: bool) -> Pair:
    """The rounding of ``before + added``, the coefficients of a value of several uses: one
    ulp of ``|before| + |added|`` times the value's magnitude."""
    summed = _add(_map(before, jnp.abs), _map(added, jnp.abs))
    return _allowance(summed, state.interval(operand).magnitude(), owners, operand,
                      rounds.UNIT, shared=shared)


def _affine(graph, state, equation, pairs, owners):
    """Contributions of an affine equation: the VJP of its x-dependent inputs (others fixed)
    applied to every row, and the rows' inner products with the equation at zero inputs (their
    rounding is in the chain's error the rows paid on entering it)."""
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
    has_constant = ibp.adds_constant(equation, fixed)

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
    return contributions, Pair(low_constant, low_constant if shared else high_constant)


def _relaxations(graph, state, index):
    """``(below, above)``: linear functions ``(slope(A), intercept)`` of the activation's input
    below and above its output on ``[l, u]``; ``slope`` maps row coefficients ``[S, *shape]``,
    ``intercept`` is an array of the output's shape; either may be None (zero). With rounding
    the chord's intercept is raised to hold at both ends in exact arithmetic whatever the
    rounding of its slope."""
    equation = graph.equations[index]
    lower, upper = state.pre[index]
    if equation.kind == graphs.RELU:
        active, unstable = lower >= 0, (lower < 0) & (upper > 0)
        chord = jnp.where(unstable, upper / jnp.where(unstable, upper - lower, 1.0),
                          active.astype(lower.dtype))
        intercept = -chord * lower
        if state.rounding:  # chord l + b >= 0 and chord u + b >= u, exactly
            intercept = (jnp.maximum(intercept, upper - chord * upper)
                         + 4.0 * rounds.UNIT * (jnp.abs(upper) + jnp.abs(lower)) + rounds.FLOOR)
        intercept = jnp.where(unstable, intercept, 0.0)
        # Adaptive lower slope: 1 where the chord is steeper than 1/2 (u >= -l), else 0.
        slope = jnp.where(unstable, (upper >= -lower).astype(lower.dtype), chord)
        return (lambda a: a * slope[None], None), (lambda a: a * chord[None], intercept)
    at, other = (lower, upper) if equation.kind == graphs.MAXIMUM else (upper, lower)
    _, route_back = jax.vjp(lambda v: equation.apply(v)[0], at)  # to the argmax of `at`
    route = (lambda a: jax.vmap(route_back)(a)[0], None)
    constant = (None, equation.apply(other)[0])
    return (route, constant) if equation.kind == graphs.MAXIMUM else (constant, route)


def _activation(graph, state, index, pair, owners, shared):
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
    error = None
    if state.rounding:
        # The slopes' products, the routes' sums and the intercepts' inner products round; and
        # the rows enter the chain that computed the activation's input (its error; the input
        # rows are at most the output rows in absolute value, routed or scaled by <= 1, and 0
        # at a ReLU that is off).
        lower, upper = state.pre[index]
        reach = jnp.maximum(jnp.abs(lower), jnp.abs(upper))
        chain = ibp.error_of(state.interval(operand))
        if equation.kind == graphs.RELU:
            # A stable neuron's slope is 0 or 1 and its intercept 0: only the unstable ones'
            # products round, and a sum rounds only where it adds a nonzero term: gamma of
            # their count (each example's own).
            unstable = (lower < 0) & (upper > 0)
            factor = rounds.UNIT + rounds.gamma(jnp.sum(unstable).astype(jnp.float32))
            value = jnp.where(unstable, reach, 0.0) * factor + jnp.where(upper > 0, chain, 0.0)
        else:  # |a routed value| <= its window's largest
            reach, chain = equation.apply(reach)[0], equation.apply(chain)[0]
            size = int(np.prod(reach.shape))
            factor = rounds.UNIT + rounds.gamma(equation.arithmetic.back) + rounds.gamma(size)
            value = reach * factor + chain
        error = _allowance(pair, jax.lax.stop_gradient(value), owners, equation.outputs[0],
                           shared=shared)
    return [(operand, Pair(low, high))], Pair(low_constant, high_constant), error


def linear_bounds(  # noqa: PLR0913 (where the rows start, and the forms of the two callers)
        graph: graphs.Graph, state: ibp.Sweep, start: int, target, spec: Pair,
        input_set: Box | BallInBox, *, elide: bool = False,
        owners: Owners | None = None, head: Carried | None = None):
    """Lower and upper bounds ``[S]`` of ``spec @ value(target)`` over the input set, for the
    model's float32 values with ``state.rounding`` (the rows' errors subtracted, the final sums'
    rounding allowed for).

    Args:
      graph, state: the program and its sweep.
      start: index of the first equation after ``target``'s (``len(equations)`` for outputs).
      target: the value's id.
      spec: :class:`Pair` of ``[S, *shape]`` rows (``None`` for an unwanted side).
      input_set: the example's set.
      elide: IBP with the specification merged into the last affine equations.
      owners: the rows are packed (:mod:`jaxbundle.certify.packing`; a :class:`Box` set).
      head: the rows already carried back as far as the activations (:func:`backward` with
        ``elide``): continue from there.

    Returns:
      ``(lower, upper)``, each ``[S]`` (``[S, slots]`` packed) or None.
    """
    if head is None:
        carried = backward(graph, state, start, {target: spec}, elide=elide, owners=owners)
    else:
        rest = backward(graph, state, start, head.frontier, owners=owners)
        carried = Carried(rest.frontier, _add(head.constants, rest.constants),
                          _add(head.errors, rest.errors))
    terms = {"lower": [], "upper": []}
    for operand, pair in carried.frontier.items():
        region = input_set if operand == graph.input else Box(
            *state.interval(operand).bounds(state.rounding))
        split = None if owners is None else functools.partial(_dot, owners=owners,
                                                              value_id=operand)
        minimum = functools.partial(minimise, input_set=region, contract=split,
                                    rounding=state.rounding)
        if pair.lower is not None:
            terms["lower"].append(minimum(pair.lower))
        if pair.upper is not None:
            terms["upper"].append(-minimum(-pair.upper))
    constants = carried.constants or Pair(None, None)
    errors = carried.errors or Pair(None, None)

    def finish(side, rows, sign):
        if rows is None:
            return None
        shape = rows.shape[:1] if owners is None else (rows.shape[0], owners.slots)
        parts = [t for t in (*terms[side], getattr(constants, side)) if t is not None]
        bound = sum(parts, jnp.zeros(shape, jnp.float32))
        if not state.rounding:
            return bound
        error = getattr(errors, side)
        error = jnp.zeros(shape, jnp.float32) if error is None else error
        total = sum((jnp.abs(t) for t in parts), error)  # the sums' rounding and the last one
        error = error + rounds.gamma(len(parts) + 3) * total
        return bound - sign * jax.lax.stop_gradient(error * (1.0 + 4.0 * rounds.UNIT))

    return finish("lower", spec.lower, 1.0), finish("upper", spec.upper, -1.0)


def refinement(graph: graphs.Graph, input_set: Box | BallInBox, *, sparse: bool = True,
               axis_name: str | None = None) -> ibp.Refine:
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
        args = (graph, state, index, operand, input_set, largest)
        if not (sparse and equation.kind == graphs.RELU and operand in behind):
            return _Blocks(*args, packed).bounds()
        lower, upper = state.interval(operand).bounds(state.rounding)
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

    def __init__(self, graph, state, index, operand, input_set, largest, packed):
        self.graph, self.state, self.index, self.operand = graph, state, index, operand
        self.input_set, self.packed = input_set, packed
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
                                 owners=self.owners(every), shared=True)

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
                             self.spec(chosen), self.input_set, owners=self.owners(chosen),
                             head=head)

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


def _rows(head: Carried, chosen) -> Carried:
    """The rows ``chosen`` of :func:`backward`'s :class:`Carried`."""
    def take(pair):
        if pair is None:
            return None
        lower = None if pair.lower is None else pair.lower[chosen]
        return Pair(lower, lower if pair.shared else (
            None if pair.upper is None else pair.upper[chosen]))

    return Carried({i: take(pair) for i, pair in head.frontier.items()},
                   take(head.constants), take(head.errors))


def _behind_activation(graph: graphs.Graph) -> frozenset:
    """Ids of the values computed from an activation's output."""
    behind = set()
    for equation in graph.equations:
        if equation.kind not in (graphs.AFFINE, graphs.CONSTANT) or any(
                i in behind for i in equation.inputs if isinstance(i, int)):
            behind.update(equation.outputs)
    return frozenset(behind)
