"""A ReLU network's verification problems (:class:`~jaxbundle.certify.program.ReluProgram`),
extracted from its jaxpr, for the complete mode's mixed-integer program.

The model's program (:mod:`jaxbundle.certify.graph`) must consist of affine equations and ReLUs
only (``max``/``min``/``clamp``, leaky ReLU and ``abs`` are rewritten into ReLUs exactly and
are fine; max pooling is not). Each ReLU's pre-activation is an affine function of the input
and of earlier ReLUs' outputs: its matrices are the coefficients of an identity specification
carried back through the affine equations (the same pass as IBP's merged specification), the
same for every example. The pre-activation bounds are CROWN's, per example.

The program is the network in real arithmetic; the model computes in float32. Each
pre-activation and margin carries a slack (:attr:`ReluProgram.pre_slack`): the rounding of the
model's equations since the last activation, bounded as the sweep bounds it per example
(:attr:`jaxbundle.certify.ibp.Interval.error`), plus the maps' own rounding (the constants
carried back, :func:`jaxbundle.certify.crown.backward`'s errors). All of it runs at
``Precision.HIGHEST`` (:func:`jaxbundle.core.arithmetic.stated`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse

from jaxbundle.core import arithmetic
from jaxbundle.certify import bounds, crown, ibp, sets
from jaxbundle.certify import graph as graphs
from jaxbundle.certify.program import INPUT, Affine, ReluProgram

__all__ = ["relu_program"]


def relu_program(apply_fn: Callable[[Any, jax.Array], jax.Array], params: Any, x: jax.Array,
                 y: jax.Array, *, eps, lower=0.0, upper=1.0) -> list[ReluProgram]:
    """One :class:`ReluProgram` per example: the Linf ball of radius ``eps`` around ``x[b]``
    intersected with ``[lower, upper]``, the network as affine layers and ReLUs, CROWN's bounds
    on every pre-activation, and the margins ``z_y - z_j`` of every wrong class ``j``.

    Host-side (returns NumPy/SciPy values, float64 copies of the float32 weights).

    Args:
      apply_fn: ``apply_fn(params, x) -> logits [B, K]``, affine operations and ReLUs only.
      params: its parameters.
      x: images ``[B, H, W, C]``, float32.
      y: labels ``[B]``.
      eps: the Linf radius, a scalar or ``[B]``.
      lower, upper: the data's box (scalars).

    Raises:
      ValueError: the network computes something other than affine operations and ReLUs (e.g.
        max pooling), or malformed arguments.
    """
    bounds.check_arguments(apply_fn, x, y, eps)
    x, y = np.asarray(x), np.asarray(y)
    eps = np.broadcast_to(np.asarray(eps, np.float32), y.shape)
    graph = graphs.trace(apply_fn, params, (1, *x.shape[1:]))
    for equation in graph.equations:
        if equation.kind not in (graphs.CONSTANT, graphs.AFFINE, graphs.RELU):
            where = f" ({equation.source})" if equation.source else ""
            raise ValueError(
                f"relu_program supports networks of affine operations and ReLUs only (the "
                f"complete mode's mixed-integer program); `{equation.name}`{where} is neither")
    if graph.output not in graph.depends:
        raise ValueError("relu_program needs logits that depend on the input")
    layers, logits, own = _affine_maps(apply_fn, params, x.shape[1:])
    pre, logit_error = _pre_bounds(apply_fn, params, jnp.asarray(x), jnp.asarray(eps), lower,
                                   upper)
    pre = [tuple(np.asarray(v, np.float64) for v in bound) for bound in pre]
    logit_slack = np.asarray(logit_error, np.float64).reshape(len(x), -1) + own[-1]
    box_lower = np.maximum(x - eps[:, None, None, None], lower).reshape(len(x), -1)
    box_upper = np.minimum(x + eps[:, None, None, None], upper).reshape(len(x), -1)
    classes = logits.bias.shape[0]
    programs = []
    for b, label in enumerate(y):
        wrong = np.array([j for j in range(classes) if j != label])
        margins = Affine(
            tuple((source, scipy.sparse.csr_array(w[[label]] - w[wrong]))
                  for source, w in _dense_terms(logits)),
            logits.bias[label] - logits.bias[wrong],
        )
        programs.append(ReluProgram(
            lower=box_lower[b].astype(np.float64), upper=box_upper[b].astype(np.float64),
            center=x[b].reshape(-1).astype(np.float64), layers=layers,
            pre_lower=tuple(low[b].reshape(-1) for low, _, _ in pre),
            pre_upper=tuple(high[b].reshape(-1) for _, high, _ in pre),
            margins=margins, classes=wrong,
            pre_slack=tuple(error[b].reshape(-1) + o for (_, _, error), o in zip(pre, own)),
            margin_slack=logit_slack[b, label] + logit_slack[b, wrong],
        ))
    return programs


def _dense_terms(affine: Affine):
    return [(source, w.toarray()) for source, w in affine.terms]


def _affine_maps(apply_fn, params, shape) -> tuple[tuple[Affine, ...], Affine, list]:
    """Each ReLU's pre-activation and the logits as :class:`Affine` maps (host-side), and the
    bound on each map's own rounding (float64 ``[N]`` each)."""
    raw = _raw_maps(apply_fn, params, tuple(shape))
    maps = []
    for terms, bias, _ in raw:
        rows = bias.shape[0]
        pieces = tuple(
            (source, scipy.sparse.csr_array(np.asarray(w, np.float64).reshape(rows, -1)))
            for source, w in sorted(terms.items()))
        maps.append(Affine(pieces, np.asarray(bias, np.float64)))
    return tuple(maps[:-1]), maps[-1], [np.asarray(error, np.float64) for _, _, error in raw]


@functools.partial(jax.jit, static_argnames=("apply_fn", "shape"))
@arithmetic.stated()
def _raw_maps(apply_fn, params, shape):
    """[(source -> W [N, *source shape], bias [N], error [N])] for every ReLU's input, then the
    logits: ``error`` bounds the rounding of ``bias`` (the rounding the coefficients add is
    each example's, in its sweep's errors)."""
    graph = graphs.trace(apply_fn, params, (1, *shape))
    zero = jnp.zeros((1, *shape), jnp.float32)
    state = ibp.sweep(graph, jax.tree.leaves(params), sets.Box(zero, zero))
    relus = [i for i, e in enumerate(graph.equations) if e.kind == graphs.RELU]
    source = {graph.equations[i].outputs[0]: k for k, i in enumerate(relus)}
    source[graph.input] = INPUT
    targets = [(i, graph.equations[i].inputs[0]) for i in relus]
    targets.append((len(graph.equations), graph.output))
    maps = []
    for start, target in targets:
        target_shape = graph.shapes[target].shape
        size = int(np.prod(target_shape))
        spec = jnp.eye(size, dtype=jnp.float32).reshape(size, *target_shape)
        carried = crown.backward(graph, state, start, {target: crown.Pair(spec, None)},
                                 elide=True)
        terms = {source[i]: pair.lower.reshape(size, -1) for i, pair in carried.frontier.items()}
        none = jnp.zeros(size)
        bias = none if carried.constants is None or carried.constants.lower is None else (
            carried.constants.lower)
        error = none if carried.errors is None or carried.errors.lower is None else (
            carried.errors.lower)
        maps.append((terms, bias, error))
    return maps


@functools.partial(jax.jit, static_argnames=("apply_fn",))
@arithmetic.stated()
def _pre_bounds(apply_fn, params, x, eps, lower, upper):
    """CROWN's ``(lower, upper, error)`` ``[B, *shape]`` of every ReLU's input, in the network's
    order, and the logits' ``error`` ``[B, K]`` (the rounding since the last activation)."""
    graph = graphs.trace(apply_fn, params, (1, *x.shape[1:]))
    relus = [i for i, e in enumerate(graph.equations) if e.kind == graphs.RELU]

    def one(example):
        image, radius = example
        region = sets.input_set(image[None], radius, "linf", lower, upper)
        refine = crown.refinement(graph, region, axis_name=bounds.AXIS)
        state = ibp.sweep(graph, jax.tree.leaves(params), region, refine=refine)
        errors = [ibp.error_of(state.interval(graph.operand(graph.equations[i]))) for i in relus]
        return ([(*state.pre[i], e) for i, e in zip(relus, errors)],
                ibp.error_of(state.interval(graph.output)))

    return bounds.per_example(one, (x, eps), "crown")
