"""A ReLU network's verification problems (:class:`~jaxbundle.certify.program.ReluProgram`),
extracted from its jaxpr, for the complete mode's mixed-integer program.

The model's program (:mod:`jaxbundle.certify.graph`) must consist of affine equations and ReLUs
only (``max``/``min``/``clamp``, leaky ReLU and ``abs`` are rewritten into ReLUs exactly and
are fine; max pooling is not). Each ReLU's pre-activation is an affine function of the input
and of earlier ReLUs' outputs: its matrices are the coefficients of an identity specification
carried back through the affine equations (the same pass as IBP's merged specification), the
same for every example. The pre-activation bounds are CROWN's, per example.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse

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
    layers, logits = _affine_maps(apply_fn, params, x.shape[1:])
    pre = _pre_bounds(apply_fn, params, jnp.asarray(x), jnp.asarray(eps), lower, upper)
    pre = [(np.asarray(low, np.float64), np.asarray(high, np.float64)) for low, high in pre]
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
            pre_lower=tuple(low[b].reshape(-1) for low, _ in pre),
            pre_upper=tuple(high[b].reshape(-1) for _, high in pre),
            margins=margins, classes=wrong,
        ))
    return programs


def _dense_terms(affine: Affine):
    return [(source, w.toarray()) for source, w in affine.terms]


def _affine_maps(apply_fn, params, shape) -> tuple[tuple[Affine, ...], Affine]:
    """Each ReLU's pre-activation and the logits as :class:`Affine` maps (host-side)."""
    raw = _raw_maps(apply_fn, params, tuple(shape))
    maps = []
    for terms, bias in raw:
        rows = bias.shape[0]
        pieces = tuple(
            (source, scipy.sparse.csr_array(np.asarray(w, np.float64).reshape(rows, -1)))
            for source, w in sorted(terms.items()))
        maps.append(Affine(pieces, np.asarray(bias, np.float64)))
    return tuple(maps[:-1]), maps[-1]


@functools.partial(jax.jit, static_argnames=("apply_fn", "shape"))
def _raw_maps(apply_fn, params, shape):
    """[(source -> W [N, *source shape], bias [N])] for every ReLU's input, then the logits."""
    graph = graphs.trace(apply_fn, params, (1, *shape))
    zero = jnp.zeros((1, *shape), jnp.float32)
    state = ibp.sweep(graph, jax.tree.leaves(params), sets.Box(zero, zero), rounding=0.0)
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
        frontier, constants = crown.backward(graph, state, start,
                                             {target: crown.Pair(spec, None)}, elide=True)
        terms = {source[i]: pair.lower.reshape(size, -1) for i, pair in frontier.items()}
        bias = jnp.zeros(size) if constants is None or constants.lower is None else (
            constants.lower)
        maps.append((terms, bias))
    return maps


@functools.partial(jax.jit, static_argnames=("apply_fn",))
def _pre_bounds(apply_fn, params, x, eps, lower, upper):
    """CROWN's (lower, upper) ``[B, *shape]`` of every ReLU's input, in the network's order."""
    graph = graphs.trace(apply_fn, params, (1, *x.shape[1:]))
    rounding = ibp.rounding_for(graph)
    relus = [i for i, e in enumerate(graph.equations) if e.kind == graphs.RELU]

    def one(example):
        image, radius = example
        region = sets.input_set(image[None], radius, "linf", lower, upper)
        refine = crown.refinement(graph, region, rounding=rounding, axis_name=bounds.AXIS)
        state = ibp.sweep(graph, jax.tree.leaves(params), region, rounding=rounding,
                          refine=refine)
        return [state.pre[i] for i in relus]

    return bounds.per_example(one, (x, eps), "crown")
