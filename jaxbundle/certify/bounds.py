"""Sound bounds on a model's margins and logits over norm balls, by IBP, CROWN-IBP or CROWN.

Works on any ``apply_fn(params, x) -> logits`` (flax modules, plain JAX functions): the model's
program is traced on one example (:mod:`jaxbundle.certify.graph`) and every example of a batch
is bounded by the same per-example computation (vmapped, so results do not depend on the batch
size). The parameters are arguments of the compiled program, never constants.

Methods (:data:`METHODS`):

* ``"ibp"``: interval bounds (Gowal et al. 2018), the margin merged into the last affine layers.
* ``"crown-ibp"``: IBP bounds for every activation's input, CROWN from the output (Zhang et al.
  2020); about the cost of a few forward passes.
* ``"crown"``: CROWN bounds for every activation's input too (Zhang et al. 2018), intersected
  with IBP's (behind the first activation, on the ReLUs IBP leaves unstable); one backward
  pass per such neuron (in blocks), the tightest and the most expensive.

The returned bounds hold for the model's float32 outputs as the judge computes them (matrix
products at ``Precision.HIGHEST``, :mod:`jaxbundle.core.arithmetic`) at every point of the
input set, and they are computed at that precision whatever the backend's default: each equation's
rounding and the bound's own are allowed for by a worst-case bound
(:mod:`jaxbundle.certify.rounding`, which says what it assumes). A model computing anything
else of its input (``exp``, ``x * x``, softmax, ...) raises :class:`UnsupportedPrimitive` when
traced.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxbundle.core import arithmetic
from jaxbundle.certify import crown, ibp
from jaxbundle.certify import graph as graphs
from jaxbundle.certify import sets
from jaxbundle.certify.graph import UnsupportedPrimitive

__all__ = [
    "AXIS", "GROUP", "METHODS", "UnsupportedPrimitive", "check_arguments", "logit_bounds",
    "margin_bounds", "per_example",
]

METHODS = ("ibp", "crown-ibp", "crown")
GROUP = 32  # examples bounded at once by the CROWN methods (memory: GROUP x a chunk's rows)
AXIS = "examples"  # per_example's vmap axis: CROWN picks packed or one-neuron rows per group


def check_arguments(apply_fn, x, y=None, eps=None, *, method: str = "crown",
                    norm: str = "linf") -> None:
    """Raises a one-line ``TypeError``/``ValueError`` for arguments the entry points cannot take
    (shapes and types only: no values are read, so it runs under ``jit``)."""
    if not callable(apply_fn):
        raise TypeError(f"apply_fn must be callable as apply_fn(params, x); got {apply_fn!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    if norm not in sets.NORMS:
        raise ValueError(f"norm must be one of {sets.NORMS}; got {norm!r}")
    if jnp.ndim(x) != 4:
        raise ValueError(f"images must be [B, H, W, C]; got shape {jnp.shape(x)}")
    if jnp.result_type(x) != jnp.float32:
        raise TypeError(f"images must be float32; got {jnp.result_type(x)}")
    if y is not None and (jnp.shape(y) != jnp.shape(x)[:1]
                          or not jnp.issubdtype(jnp.result_type(y), jnp.integer)):
        raise ValueError(f"labels must be integers [B] = {list(jnp.shape(x)[:1])}; got "
                         f"{jnp.result_type(y)}{list(jnp.shape(y))}")
    if eps is not None and (jnp.ndim(eps) > 1 or jnp.ndim(eps) == 1
                            and jnp.shape(eps) != jnp.shape(x)[:1]):
        raise ValueError(f"eps must be a scalar or [B]; got shape {jnp.shape(eps)}")


def margin_bounds(  # noqa: PLR0913 (the public call: keyword-only settings of the bound)
        apply_fn: Callable[[Any, jax.Array], jax.Array], params: Any, x: jax.Array,
        y: jax.Array, *, eps, norm: str = "linf", method: str = "crown",
        lower=0.0, upper=1.0, rounding: bool = True) -> jax.Array:
    """Sound lower bounds on every margin ``z_y - z_j`` over each example's input set.

    The set of example ``b`` is the ``norm`` ball of radius ``eps[b]`` around ``x[b]``
    intersected with the box ``[lower, upper]``. The example is certified when every wrong
    class's bound is positive. Jittable: ``apply_fn``, ``norm`` and ``method`` are static
    (``apply_fn`` hashable), ``params``, ``x``, ``y``, ``eps``, ``lower``, ``upper`` traced.

    Args:
      apply_fn: ``apply_fn(params, x) -> logits [B, K]``.
      params: the model's parameters (any pytree).
      x: images ``[B, H, W, C]``, float32, inside ``[lower, upper]``.
      y: true labels ``[B]``, integers.
      eps: radius, a scalar or ``[B]``. Negative radii give NaN rows (an empty set).
      norm: ``"linf"`` or ``"l2"`` (IBP uses the L2 set's Linf hull and, up to the first
        activation, the ball itself; CROWN the set itself).
      method: one of :data:`METHODS`.
      lower, upper: the data's box (scalars, or arrays broadcastable to one image).
      rounding: allow for float32's rounding, the model's and the bound's own (default);
        False gives the papers' formulas in real arithmetic, for comparisons only.

    Returns:
      ``[B, K]`` float32 lower bounds, ``+inf`` in the true class's column.

    Raises:
      UnsupportedPrimitive: the model computes something of ``x`` that cannot be bounded.
      ValueError, TypeError: malformed arguments.
    """
    check_arguments(apply_fn, x, y, eps, method=method, norm=norm)
    return _margin_bounds(apply_fn, params, (x, y, eps), (lower, upper), norm=norm,
                          method=method, rounding=bool(rounding))


@functools.partial(jax.jit, static_argnames=("apply_fn", "norm", "method", "rounding"))
@arithmetic.stated()
def _margin_bounds(apply_fn, params, examples, box, *, norm, method, rounding):
    x, y, eps = examples
    lower, upper = box
    graph = graphs.trace(apply_fn, params, (1, *x.shape[1:]))
    arguments = jax.tree.leaves(params)
    classes = graph.shapes[graph.output].shape[-1]
    eps = jnp.broadcast_to(jnp.asarray(eps, jnp.float32), y.shape)

    def one(example):
        image, label, radius = example
        region = sets.input_set(image[None], radius, norm, lower, upper)
        spec = (jax.nn.one_hot(label, classes)[None, :] - jnp.eye(classes)).reshape(
            classes, 1, classes)
        bound = _spec_lower_bounds(graph, arguments, region, spec, method, rounding)
        bound = jnp.where(radius >= 0, bound, jnp.nan)
        return jnp.where(jnp.arange(classes) == label, jnp.inf, bound)

    return per_example(one, (x, y, eps), method)


def per_example(function, examples, method):
    """``function`` vmapped over the examples (axis name :data:`AXIS`); the CROWN methods
    ``GROUP`` at a time (the batch padded to a multiple of ``GROUP`` with copies of its last
    example, so that the program has one loop body, not a loop and a remainder)."""
    count = jax.tree.leaves(examples)[0].shape[0]
    each = jax.vmap(function, axis_name=AXIS)
    if method == "ibp" or count <= GROUP:
        return each(examples)
    extra = -count % GROUP
    grouped = jax.tree.map(lambda a: jnp.concatenate([a, jnp.repeat(a[-1:], extra, axis=0)])
                           .reshape(-1, GROUP, *a.shape[1:]), examples)
    results = jax.lax.map(each, grouped)
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:])[:count], results)


def _propagate(graph, arguments, region, method, rounding) -> ibp.Sweep:
    refine = None if method != "crown" else crown.refinement(graph, region, axis_name=AXIS)
    return ibp.sweep(graph, arguments, region, rounding=rounding, refine=refine)


def _spec_lower_bounds(graph, arguments, region, spec, method, rounding):
    """``[S]`` lower bounds on ``spec @ logits`` (``spec`` ``[S, 1, K]``) for one example: IBP's
    with the specification merged into the last affine equations, and for the CROWN methods the
    larger of that and CROWN's (both are sound)."""
    state = _propagate(graph, arguments, region, method, rounding)
    end, pair = len(graph.equations), crown.Pair(spec, None)
    bound, _ = crown.linear_bounds(graph, state, end, graph.output, pair, region, elide=True)
    if method != "ibp":
        tighter, _ = crown.linear_bounds(graph, state, end, graph.output, pair, region)
        bound = jnp.maximum(bound, tighter)
    return bound


def logit_bounds(apply_fn: Callable[[Any, jax.Array], jax.Array], params: Any, lo: jax.Array,
                 hi: jax.Array, *, method: str = "ibp", rounding: bool = True
                 ) -> tuple[jax.Array, jax.Array]:
    """Sound lower and upper bounds on the logits over the box ``[lo, hi]`` of each example.

    Differentiable in ``params`` (IBP and CROWN-IBP training losses are built on it; ``"crown"``
    in forward mode only: its refinement loops while unstable neurons remain) and jittable
    (``apply_fn`` and ``method`` static).

    Args:
      apply_fn: ``apply_fn(params, x) -> logits [B, K]``.
      params: the model's parameters.
      lo, hi: ``[B, H, W, C]`` float32 each, ``lo <= hi``.
      method: one of :data:`METHODS`.
      rounding: allow for float32's rounding (see :func:`margin_bounds`).

    Returns:
      ``(lower, upper)``, ``[B, K]`` float32 each.
    """
    check_arguments(apply_fn, lo, method=method)
    if jnp.shape(hi) != jnp.shape(lo):
        raise ValueError(f"lo and hi must have one shape; got {jnp.shape(lo)}, {jnp.shape(hi)}")
    return _logit_bounds(apply_fn, params, lo, hi, method=method, rounding=bool(rounding))


@functools.partial(jax.jit, static_argnames=("apply_fn", "method", "rounding"))
@arithmetic.stated()
def _logit_bounds(apply_fn, params, lo, hi, *, method, rounding):
    graph = graphs.trace(apply_fn, params, (1, *lo.shape[1:]))
    arguments = jax.tree.leaves(params)

    def one(example):
        region = sets.Box(example[0][None], example[1][None])
        state = _propagate(graph, arguments, region, method, rounding)
        lower, upper = state.interval(graph.output).bounds(rounding)
        if method != "ibp":
            classes = lower.shape[-1]
            spec = jnp.eye(classes).reshape(classes, 1, classes)
            tight_lower, tight_upper = crown.linear_bounds(
                graph, state, len(graph.equations), graph.output, crown.Pair(spec, spec),
                region)
            lower = jnp.maximum(lower[0], tight_lower)[None]
            upper = jnp.minimum(upper[0], tight_upper)[None]
        return lower[0], upper[0]

    return per_example(one, (lo, hi), method)
