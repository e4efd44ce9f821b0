"""A model's program as a flat list of equations that bound propagation can walk.

:func:`trace` traces ``apply_fn(params, x)`` on one example (``x`` of shape ``[1, H, W, C]``)
and flattens its jaxpr: ``jit``, ``closed_call``, ``remat`` and custom-derivative calls that
touch ``x`` are inlined (a ``custom_vjp`` function by its primal), and every equation gets a
kind:

* ``CONSTANT``: does not depend on ``x``; computed normally from the parameters (which stay
  arguments of the program, never compiled-in constants).
* ``AFFINE``: affine in its ``x``-dependent inputs, the others fixed (dense and convolution
  layers, biases, pooling by averaging, normalisation by parameters, reshapes, slices, ...).
* ``RELU``: ``max(v, 0)``. ``max``/``min``/``clamp`` against anything, leaky ReLU
  (``where(v >= 0, v, a * v)``) and ``abs`` are rewritten exactly into ReLUs and affine
  equations, e.g. ``max(a, b) = b + relu(a - b)``.
* ``MAXIMUM`` / ``MINIMUM``: ``reduce_max``/``reduce_window_max`` (max pooling) and the ``min``
  versions.

Anything else that depends on ``x`` raises :class:`UnsupportedPrimitive`.

Every equation also records how the model's float32 arithmetic rounds it (:class:`Arithmetic`:
how many terms an output element sums, in the equation and in its transpose, and the error of
each product at the precision the model asked for), from which
:mod:`jaxbundle.certify.rounding` bounds its rounding. ``apply`` computes x-dependent matrix
products and convolutions at ``Precision.HIGHEST`` whatever precision the model asked for (the
bound's own arithmetic); x-independent equations run as the model wrote them.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxbundle.core import arithmetic

__all__ = [
    "AFFINE", "CONSTANT", "EXACT", "MAXIMUM", "MINIMUM", "RELU", "Arithmetic", "Constant",
    "Equation", "Graph", "UnsupportedPrimitive", "trace",
]

CONSTANT, AFFINE, RELU, MAXIMUM, MINIMUM = "constant", "affine", "relu", "maximum", "minimum"
_COMPARE = "compare"  # an x-dependent comparison: allowed only as a leaky ReLU's predicate

SUPPORTED = (
    "affine operations (dense layers, convolutions, average pooling, reshapes, slices, padding, "
    "sums, products and quotients by values that do not depend on the input), ReLU-like "
    "max/min/clamp, leaky ReLU, abs and max pooling"
)

# Linear in their x-dependent inputs with non-negative coefficients; their other float inputs
# add a constant, their integer/boolean inputs (indices, predicates) must not depend on x.
_POSITIVE = frozenset({
    "add", "add_any", "reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims",
    "reduce_sum", "reduce_window_sum", "pad", "slice", "dynamic_slice", "dynamic_update_slice",
    "concatenate", "convert_element_type", "copy", "copy_p", "select_n", "rev", "gather",
    "cumsum", "scatter-add", "split", "sharding_constraint", "stop_gradient",
})
_SIGNED = frozenset({"mul", "dot_general", "conv_general_dilated"})  # one x-dependent operand
_INLINE = frozenset({
    "jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
})
_EXTREMA = {"reduce_max": MAXIMUM, "reduce_window_max": MAXIMUM,
            "reduce_min": MINIMUM, "reduce_window_min": MINIMUM}
_COMPARISONS = {"ge": 1, "gt": 1, "le": -1, "lt": -1}  # +1: true where lhs is the larger


class UnsupportedPrimitive(ValueError):
    """A model computes something of its input that certify cannot bound (e.g. ``exp``)."""


class Constant(NamedTuple):
    """A value known when the program is traced (a jaxpr literal or a folded constant)."""

    value: Any


class Arithmetic(NamedTuple):
    """How the model's float32 arithmetic rounds one x-dependent equation.

    Attributes:
      terms: the most terms one output element is a rounded sum of: a matrix product's or
        convolution's contraction length, a sum's count; 1 for one rounding (a sum of two, a
        product by a fixed value), 2 for a quotient (which XLA may compute as a product by the
        reciprocal); 0 where the equation is exact (reshapes, slices, selections, negation).
      back: the same for the equation's transpose, what CROWN's backward pass computes (a
        broadcast's transpose sums the broadcast copies, a convolution's sums output features
        times taps; max pooling's routes sum overlapping windows).
      product: the relative error of each product at the precision the model computes it
        (:data:`jaxbundle.core.arithmetic.PRODUCT_ERROR`; 0 where nothing is a matrix product).
    """

    terms: int = 0
    back: int = 0
    product: float = 0.0


EXACT = Arithmetic()


class Equation(NamedTuple):
    """One step of the flat program.

    Attributes:
      name: the primitive's name (``"relu"`` for the ReLUs the rewrites introduce).
      kind: ``CONSTANT``, ``AFFINE``, ``RELU``, ``MAXIMUM`` or ``MINIMUM``.
      apply: ``apply(*input_values) -> list`` of output values, as the model computes them
        (x-dependent matrix products and convolutions at ``Precision.HIGHEST``).
      inputs: value ids (``int``) or :class:`Constant` operands.
      outputs: value ids.
      source: ``"file.py:12"`` where the model computes it, or ``""``.
      arithmetic: how the model rounds it (:class:`Arithmetic`).
    """

    name: str
    kind: str
    apply: Callable[..., list]
    inputs: tuple
    outputs: tuple[int, ...]
    source: str
    arithmetic: Arithmetic = EXACT


class Graph(NamedTuple):
    """A model's flat program for one example.

    Attributes:
      equations: in an order that computes every value before its use.
      arguments: ids of the parameters' leaves (in ``jax.tree.leaves`` order).
      input: id of the input ``x``, shape ``[1, H, W, C]``.
      output: id of the logits, shape ``[1, K]``.
      constants: id -> value of the arrays the model closes over.
      depends: ids of the values that depend on ``x``.
      shapes: id -> ``jax.ShapeDtypeStruct`` of every value.
    """

    equations: tuple[Equation, ...]
    arguments: tuple[int, ...]
    input: int
    output: int
    constants: dict
    depends: frozenset
    shapes: dict

    def dependent(self, operand) -> bool:
        """Whether ``operand`` (an id or a :class:`Constant`) depends on ``x``."""
        return isinstance(operand, int) and operand in self.depends

    def operand(self, equation: Equation) -> int:
        """The one x-dependent input of an activation equation (ReLU, max, min)."""
        (operand,) = [i for i in equation.inputs if self.dependent(i)]
        return operand


def trace(apply_fn: Callable, params: Any, shape: tuple[int, ...]) -> Graph:
    """The flat program of ``apply_fn(params, x)`` for one example ``x`` of ``shape``
    (``[1, H, W, C]``, float32); ``params`` may be arrays, tracers or ShapeDtypeStructs. Traced
    as the judge runs the model (:func:`jaxbundle.core.arithmetic.stated`): a matrix product without
    a precision of its own at ``Precision.HIGHEST``.

    Raises:
      UnsupportedPrimitive: naming the first operation on ``x`` that cannot be bounded.
    """
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)),
                            params)
    with arithmetic.stated():  # the model as the judge computes it
        closed = jax.make_jaxpr(apply_fn)(abstract, jax.ShapeDtypeStruct(shape, jnp.float32))
    builder = _Builder()
    leaves = [builder.new(v.aval) for v in closed.jaxpr.invars]
    x = leaves[-1]
    builder.depends.add(x)
    outputs = builder.flatten(closed.jaxpr, closed.consts, leaves)
    if len(outputs) != 1 or len(builder.aval(outputs[0]).shape) != 2:
        raise ValueError(f"apply_fn must return one array of logits [B, K]; got {closed.out_avals}")
    return builder.finish(tuple(leaves[:-1]), x, outputs[0])


def _source(eqn) -> str:
    """``"file.py:12"``: the innermost frame outside JAX and installed libraries (flax...)."""
    try:
        from jax._src import source_info_util  # the only way to a jaxpr's frames
        frames = list(source_info_util.user_frames(eqn.source_info.traceback))
    except Exception:  # noqa: BLE001 (a private API: no line rather than no answer)
        return ""
    own = [f for f in frames if not re.search(r"[/\\](site|dist)-packages[/\\]", f.file_name)]
    frame = (own or frames or [None])[0]
    return "" if frame is None else f"{os.path.basename(frame.file_name)}:{frame.start_line}"


def _unsupported(name: str, source: str, why: str = "") -> UnsupportedPrimitive:
    where = f" ({source})" if source else ""
    return UnsupportedPrimitive(
        f"cannot bound `{name}`{where}{why}: certify supports {SUPPORTED} of the input"
    )


_HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


def _bind(eqn, highest: bool = False) -> Callable[..., list]:
    """``eqn`` as a function of its inputs; with ``highest``, a matrix product or convolution
    at ``Precision.HIGHEST`` whatever precision it was traced with."""
    bound = eqn.primitive.get_bind_params(eqn.params)  # (subfuns, params) before JAX 0.8
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    if highest and "precision" in params:
        params = {**params, "precision": _HIGHEST}

    def apply(*args):
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*subfuns, *args, **params)
        return list(out) if eqn.primitive.multiple_results else [out]

    return apply


def _inner(eqn):
    """(jaxpr, consts) of an inlinable call."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in eqn.params:
            inner = eqn.params[key]
            return (inner.jaxpr, inner.consts) if hasattr(inner, "consts") else (inner, ())
    raise _unsupported(eqn.primitive.name, _source(eqn))


def _is_zero(operand) -> bool:
    return isinstance(operand, Constant) and not np.any(np.asarray(operand.value))


def _is_one(operand) -> bool:
    return isinstance(operand, Constant) and bool(np.all(np.asarray(operand.value) == 1))


def _fn(function: Callable) -> Callable[..., list]:
    return lambda *args: [function(*args)]


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


# The x-dependent equations that move, select or negate values without rounding them.
_MOVES = frozenset({
    "reshape", "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice", "pad", "rev",
    "concatenate", "convert_element_type", "copy", "copy_p", "select_n", "split", "neg",
    "dynamic_update_slice", "sharding_constraint", "stop_gradient",
})


def _arithmetic(name: str, params: dict, shapes: list, dependent: list[bool],
                out_shape) -> Arithmetic:
    """How the model's float32 arithmetic rounds an x-dependent equation (:class:`Arithmetic`):
    ``shapes`` are its inputs' shapes, ``dependent`` which of them depend on ``x``."""
    if name in _MOVES:
        return EXACT
    if name in ("add", "add_any", "sub"):
        return Arithmetic(1, 0)
    if name == "mul":
        return Arithmetic(1, 1)
    if name == "div":
        return Arithmetic(2, 2)
    if name == "reduce_sum":
        return Arithmetic(_size([shapes[0][a] for a in params["axes"]]), 0)
    if name in ("reduce_window_sum", "reduce_window_max", "reduce_window_min"):
        window = _size(params["window_dimensions"])
        return Arithmetic(window if name == "reduce_window_sum" else 0, window)
    if name in ("reduce_max", "reduce_min"):
        return Arithmetic(0, 1)
    if name == "cumsum":
        length = shapes[0][params["axis"]]
        return Arithmetic(length, length)
    if name == "broadcast_in_dim":
        return Arithmetic(0, max(_size(out_shape) // max(_size(shapes[0]), 1), 1))
    if name == "gather":  # its transpose adds the rows gathered more than once
        return Arithmetic(0, _size(out_shape))
    if name == "scatter-add":
        return Arithmetic(_size(shapes[-1]), 0)
    product = arithmetic.product_error(params.get("precision"))
    if name == "dot_general":
        (contract_l, contract_r), (batch_l, batch_r) = params["dimension_numbers"]
        terms = _size([shapes[0][d] for d in contract_l])
        other, skip = (shapes[1], (*contract_r, *batch_r)) if dependent[0] else (
            shapes[0], (*contract_l, *batch_l))
        return Arithmetic(terms, _size([n for d, n in enumerate(other) if d not in skip]),
                          product)
    if name == "conv_general_dilated":
        kernel, spec = shapes[1], params["dimension_numbers"].rhs_spec
        taps = _size([kernel[d] for d in spec[2:]])
        back = kernel[spec[0]] * taps if dependent[0] else _size(out_shape)
        return Arithmetic(kernel[spec[1]] * taps, back, product)
    raise ValueError(f"no rounding model for `{name}`")  # every affine primitive has one


class _Builder:
    """Mutable only while :func:`trace` builds one :class:`Graph`."""

    def __init__(self):
        self.equations: list[Equation] = []
        self.depends: set[int] = set()
        self.shapes: dict[int, jax.ShapeDtypeStruct] = {}
        self.constants: dict[int, Any] = {}
        self.producer: dict[int, Equation] = {}
        self.seen: dict[tuple, list[int]] = {}

    def new(self, aval) -> int:
        index = len(self.shapes)
        self.shapes[index] = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
        return index

    def emit(self, name, kind, apply, inputs, avals, source, params=None) -> list[int]:
        rounds = EXACT
        if kind in (AFFINE, MAXIMUM, MINIMUM):
            rounds = _arithmetic(name, params or {}, [self.aval(i).shape for i in inputs],
                                 [self.dependent(i) for i in inputs], avals[0].shape)
        outputs = tuple(self.new(a) for a in avals)
        equation = Equation(name, kind, apply, tuple(inputs), outputs, source, rounds)
        self.equations.append(equation)
        for o in outputs:
            self.producer[o] = equation
            if kind != CONSTANT:
                self.depends.add(o)
        return list(outputs)

    def dependent(self, operand) -> bool:
        return isinstance(operand, int) and operand in self.depends

    def aval(self, operand):
        if isinstance(operand, Constant):
            return jax.ShapeDtypeStruct(np.shape(operand.value), jnp.result_type(operand.value))
        return self.shapes[operand]

    def flatten(self, jaxpr, consts, operands) -> list:
        env: dict = {}
        for var, value in zip(jaxpr.constvars, consts):
            env[var] = self.new(jax.ShapeDtypeStruct(np.shape(value), jnp.result_type(value)))
            self.constants[env[var]] = value
        env.update(zip(jaxpr.invars, operands))

        def read(var):
            if isinstance(var, jax.extend.core.Literal):
                return Constant(var.val)
            return env[var]

        for eqn in jaxpr.eqns:
            inputs = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            if not any(self.dependent(i) for i in inputs):
                outputs = self.constant(eqn, inputs)
            elif name in _INLINE:
                inner, inner_consts = _inner(eqn)
                outputs = self.flatten(inner, inner_consts, inputs)
            else:
                outputs = self.classify(eqn, inputs)
            env.update(zip(eqn.outvars, outputs))
        return [read(v) for v in jaxpr.outvars]

    def constant(self, eqn, inputs) -> list:
        apply = _bind(eqn)
        if all(isinstance(i, Constant) for i in inputs) and not eqn.effects:
            with jax.ensure_compile_time_eval():  # fold: literals stay literals (zeros seen)
                return [Constant(v) for v in apply(*(i.value for i in inputs))]
        avals = [v.aval for v in eqn.outvars]
        return self.emit(eqn.primitive.name, CONSTANT, apply, inputs, avals, _source(eqn))

    def classify(self, eqn, inputs) -> list:
        name, source = eqn.primitive.name, _source(eqn)
        avals = [v.aval for v in eqn.outvars]
        dependent = [self.dependent(i) for i in inputs]
        if name in _COMPARISONS and len(inputs) == 2:
            return self.emit(name, _COMPARE, _bind(eqn), inputs, avals, source)
        if name == "select_n" and dependent[0]:
            return [self.select(eqn, inputs, source)]
        for operand, dep in zip(inputs, dependent):
            if dep and self.aval(operand).dtype != jnp.float32:
                raise _unsupported(name, source, f" on {self.aval(operand).dtype} values")
        if name in ("max", "min") and len(inputs) == 2:
            return [self.extremum(name, inputs, avals[0], source)]
        if name == "clamp":  # clamp(low, v, high) = min(max(v, low), high)
            low, value, high = inputs
            if self.dependent(low) or self.dependent(high):
                raise _unsupported(name, source, " with input-dependent limits")
            raised = self.extremum("max", [value, low], avals[0], source)
            return [self.extremum("min", [raised, high], avals[0], source)]
        if name == "abs":  # |v| = relu(v) + relu(-v)
            (negated,) = self.emit("neg", AFFINE, _fn(jnp.negative), inputs, avals, source)
            parts = [self.relu(v, avals[0], source) for v in (inputs[0], negated)]
            return self.emit("add", AFFINE, _fn(jnp.add), parts, avals, source)
        if name in _EXTREMA:
            return self.emit(name, _EXTREMA[name], _bind(eqn), inputs, avals, source,
                             eqn.params)
        affine = (
            name in _POSITIVE and not any(
                d and not jnp.issubdtype(self.aval(i).dtype, jnp.floating)
                for i, d in zip(inputs, dependent))
            or name in ("sub", "neg")
            or name in _SIGNED and sum(dependent) == 1
            or name == "div" and dependent == [True, False]
        )
        if name == "convert_element_type" and eqn.params["new_dtype"] != jnp.float32:
            raise _unsupported(name, source, f" to {eqn.params['new_dtype']}")
        if not affine:
            raise _unsupported(name, source)
        # The same operation on the same operands once (jnp.where(h @ w > 0, h @ w, 0) computes
        # h @ w twice; the leaky ReLU pattern then sees one value).
        key = (name, tuple(i if isinstance(i, int) else id(i.value) for i in inputs),
               str(sorted(eqn.params.items())))
        if key not in self.seen:
            self.seen[key] = self.emit(name, AFFINE, _bind(eqn, highest=True), inputs, avals,
                                       source, eqn.params)
        return self.seen[key]

    def relu(self, operand, aval, source) -> int:
        return self.emit("relu", RELU, _fn(lambda v: jnp.maximum(v, 0.0)), [operand], [aval],
                         source)[0]

    def extremum(self, name, inputs, aval, source):
        """``max``/``min`` of two operands, at least one x-dependent, as ReLUs:
        ``max(v, w) = w + relu(v - w)`` and ``min(v, w) = w - relu(w - v)``."""
        value, other = inputs if self.dependent(inputs[0]) else inputs[::-1]
        if name == "max" and _is_zero(other):
            return self.relu(value, aval, source)
        if name == "max":
            (gap,) = self.emit("sub", AFFINE, _fn(jnp.subtract), [value, other], [aval], source)
            lifted = self.relu(gap, aval, source)
            return self.emit("add", AFFINE, _fn(jnp.add), [other, lifted], [aval], source)[0]
        (gap,) = self.emit("sub", AFFINE, _fn(jnp.subtract), [other, value], [aval], source)
        lifted = self.relu(gap, aval, source)
        return self.emit("sub", AFFINE, _fn(jnp.subtract), [other, lifted], [aval], source)[0]

    def select(self, eqn, inputs, source) -> int:
        """``select_n(v >= 0, a * v, b * v)`` (leaky ReLU and friends, ``a``, ``b`` fixed) as
        ``a * v + (b - a) * relu(v)``; any other x-dependent predicate is unsupported."""
        predicate, *cases = inputs
        compare = self.producer.get(predicate)
        aval = eqn.outvars[0].aval
        if compare is None or compare.kind != _COMPARE or len(cases) != 2:
            raise _unsupported("select_n", source, " with an input-dependent predicate")
        left, right = compare.inputs
        value, zero, sign = (left, right, 1) if self.dependent(left) else (right, left, -1)
        sign *= _COMPARISONS[compare.name]  # +1: the predicate is true where value >= 0
        slopes = [self.slope(case, value) for case in cases]
        if not _is_zero(zero) or None in slopes:
            raise _unsupported("select_n", source,
                               " with an input-dependent predicate other than a leaky ReLU's")
        negative, positive = slopes if sign > 0 else slopes[::-1]
        lifted = self.relu(value, aval, source)
        if _is_zero(negative) and _is_one(positive):
            return lifted
        if isinstance(negative, Constant) and isinstance(positive, Constant):
            gain = Constant(np.asarray(positive.value) - np.asarray(negative.value))
        else:
            gain = self.emit("sub", CONSTANT, _fn(jnp.subtract), [positive, negative],
                             [self.aval(positive)], source)[0]
        (kinked,) = self.emit("mul", AFFINE, _fn(jnp.multiply), [lifted, gain], [aval], source)
        if _is_zero(negative):
            return kinked
        (linear,) = self.emit("mul", AFFINE, _fn(jnp.multiply), [value, negative], [aval], source)
        return self.emit("add", AFFINE, _fn(jnp.add), [linear, kinked], [aval], source)[0]

    def slope(self, case, value):
        """``s`` if ``case`` is ``s * value`` (``s`` fixed, ``Constant(0)`` for zero), else None."""
        if case == value:
            return Constant(np.float32(1.0))
        if _is_zero(case):
            return Constant(np.float32(0.0))
        equation = self.producer.get(case)
        if equation is not None and equation.name == "mul" and value in equation.inputs:
            other = [i for i in equation.inputs if i != value]
            if len(other) == 1 and not self.dependent(other[0]):
                return other[0]
        return None

    def finish(self, arguments, x, output) -> Graph:
        if isinstance(output, Constant):  # logits the model returns as a literal: still an id
            value = output.value
            (output,) = self.emit("constant", CONSTANT, lambda: [value], (), [self.aval(output)],
                                  "")
        needed = {output}
        kept = []
        for equation in reversed(self.equations):  # dead code (a rewritten pattern's parts)
            if needed.intersection(equation.outputs):
                kept.append(equation)
                needed.update(i for i in equation.inputs if isinstance(i, int))
        kept.reverse()
        for equation in kept:
            if equation.kind == _COMPARE:
                raise _unsupported(equation.name, equation.source)
        return Graph(tuple(kept), arguments, x, output, dict(self.constants),
                     frozenset(self.depends), dict(self.shapes))
