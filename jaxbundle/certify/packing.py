"""Several neurons in one CROWN row: the rows of an identity specification packed by the
input pixels each neuron depends on.

CROWN bounds an activation's input neuron by neuron, one backward pass per row. A neuron of a
convolution depends on a window of input pixels only; neurons whose windows are disjoint can
share a row: their backward passes never meet (a value reached from both would depend on a
pixel of each window), so the row's coefficients are the sum of theirs, each where its own
window is, and every sum the pass takes (constants, the input set's minimum) splits by owner
(:func:`jaxbundle.certify.crown.backward`'s ``owners``). The rows are the colours of a greedy
colouring of the neurons (two conflict when their windows meet): for SmallCNN's second
convolution (7 x 7 x 32 outputs, 13 x 13 windows four pixels apart) 512 rows instead of
1,568; for dense layers no packing (every neuron sees every pixel).

Dependencies are found by propagating NaN: one input pixel at a time is NaN (the parameters
ones, ReLUs the identity) and a value depends on it where it becomes NaN. That is a superset
of the real dependencies (``0 * NaN`` is NaN), and a consistent one: a value reached from a
neuron's backward pass depends on a subset of that neuron's pixels. Packing is not used where
it cannot be established: inputs over :data:`MAX_PIXELS` pixels (or over :data:`MAX_SUPPORT`
dependencies to keep), values with elements that depend on no pixel (explicit padding by
constants), constants that are not known when the program is traced, indices or predicates
computed from the parameters (which the trace sets to one), L2 input sets (whose minimum does
not split by pixel).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle.certify import graph as graphs

__all__ = ["MAX_PIXELS", "MAX_SUPPORT", "Packing", "dependencies", "pack"]

MAX_PIXELS = 4096  # largest input (pixels x channels) whose dependencies are traced
MAX_SUPPORT = 2**27  # largest pixels x activation inputs' elements (booleans kept)
_CHUNK = 256  # input pixels made NaN at once while tracing dependencies


class Packing(NamedTuple):
    """Rows of one activation input's identity specification, several neurons each.

    Attributes:
      members: ``[R, G]`` flat indices of the neurons of each row; ``size`` (one past the
        last neuron) where a row has fewer than ``G``.
      owner: ``[R, pixels]`` the slot (``0..G-1``) of the row's neuron that depends on each
        input pixel; ``G`` where none does.
      pixel: value id -> ``[elements]`` one input pixel each element depends on.
    """

    members: np.ndarray
    owner: np.ndarray
    pixel: dict

    @property
    def slots(self) -> int:
        return self.members.shape[1]


def dependencies(graph: graphs.Graph) -> tuple[dict, dict] | None:
    """``(pixel, support)``: for every x-dependent value, one input pixel each element depends
    on (``[elements]``); for every activation's input, which pixels each element depends on
    (``[pixels, elements]`` booleans). None where they cannot be established (see the module
    docstring)."""
    pixels = int(np.prod(graph.shapes[graph.input].shape))
    constants = list(graph.constants.values()) + [
        i.value for e in graph.equations for i in e.inputs if isinstance(i, graphs.Constant)]
    if (pixels > MAX_PIXELS or any(isinstance(c, jax.core.Tracer) for c in constants)
            or _parameters_choose(graph)):
        return None
    targets = {graph.operand(e) for e in graph.equations
               if e.kind not in (graphs.CONSTANT, graphs.AFFINE)}
    if pixels * sum(int(np.prod(graph.shapes[t].shape)) for t in targets) > MAX_SUPPORT:
        return None
    count = min(pixels, _CHUNK)
    first, support = {}, {t: [] for t in targets}
    for start in range(0, pixels, count):
        with jax.ensure_compile_time_eval():
            reached = jax.vmap(lambda x: _nan_forward(graph, x))(_nan_images(graph, start, count))
        for id_, nan in reached.items():
            nan = np.asarray(nan)[:pixels - start]  # [pixels of this chunk, elements]
            hit = np.where(nan.any(axis=0), start + np.argmax(nan, axis=0), pixels)
            first[id_] = np.minimum(first.get(id_, pixels), hit)
            if id_ in support:
                support[id_].append(nan)
    if any(np.any(f == pixels) for f in first.values()):  # an element no pixel reaches
        return None
    pixel = {id_: f.astype(np.int32) for id_, f in first.items()}
    return pixel, {t: np.concatenate(chunks) for t, chunks in support.items()}


def _parameters_choose(graph: graphs.Graph) -> bool:
    """Whether an x-dependent equation takes an index or a predicate computed from the
    parameters (a gather's indices, a select's choice): with every parameter set to one the
    traced dependencies would be another program's. (A float operand never matters: NaN times
    anything is NaN.)"""
    derived = set(graph.arguments)
    for equation in graph.equations:
        if equation.kind == graphs.CONSTANT and derived.intersection(
                i for i in equation.inputs if isinstance(i, int)):
            derived.update(equation.outputs)
    return any(isinstance(i, int) and i in derived
               and not jnp.issubdtype(graph.shapes[i].dtype, jnp.floating)
               for e in graph.equations if e.kind != graphs.CONSTANT for i in e.inputs)


def _nan_images(graph, first, count):
    shape = graph.shapes[graph.input].shape
    hot = (first + np.arange(count))[:, None] == np.arange(int(np.prod(shape)))[None, :]
    return jnp.asarray(np.where(hot, np.nan, 0.0).astype(np.float32).reshape(count, *shape))


def _nan_forward(graph, x):
    """Where each x-dependent value is NaN when ``x`` is (flat booleans per value id)."""
    values = dict(graph.constants)
    for a in graph.arguments:
        values[a] = jnp.ones(graph.shapes[a].shape, graph.shapes[a].dtype)
    values[graph.input] = x

    def read(operand):
        return operand.value if isinstance(operand, graphs.Constant) else values[operand]

    for equation in graph.equations:
        if equation.kind in (graphs.CONSTANT, graphs.AFFINE):
            outputs = equation.apply(*(read(i) for i in equation.inputs))
        elif equation.kind == graphs.RELU:  # the identity: every input element can pass
            shape = graph.shapes[equation.outputs[0]].shape
            outputs = [jnp.broadcast_to(read(graph.operand(equation)), shape)]
        else:  # max / min: NaN anywhere in a window gives NaN
            outputs = equation.apply(read(graph.operand(equation)))
        values.update(zip(equation.outputs, outputs))
    return {i: jnp.isnan(values[i]).reshape(-1) for i in graph.depends if i in values}


def pack(graph: graphs.Graph, operand: int, found: tuple[dict, dict] | None) -> Packing | None:
    """The packed rows of ``operand``'s identity specification (a greedy colouring of its
    elements by their pixels), or None where packing is unknown or saves nothing."""
    if found is None:
        return None
    pixel, support = found
    depends = support[operand]  # [pixels, n]
    pixels, size = depends.shape
    used = np.zeros((pixels, 64), bool)  # colours taken at each pixel
    colour = np.empty(size, np.int64)
    for neuron in range(size):
        window = depends[:, neuron]
        taken = used[window].any(axis=0)
        free = np.flatnonzero(~taken)
        if free.size == 0:
            used = np.concatenate([used, np.zeros_like(used)], axis=1)
            free = np.array([taken.size])
        colour[neuron] = free[0]
        used[window, free[0]] = True
    rows = int(colour.max()) + 1
    if rows >= size:
        return None
    order = np.argsort(colour, kind="stable")  # the neurons row by row
    counts = np.bincount(colour, minlength=rows)
    slot = np.empty(size, np.int32)  # each neuron's place in its row
    slot[order] = np.arange(size) - np.repeat(np.cumsum(counts) - counts, counts)
    members = np.full((rows, int(counts.max())), size, np.int32)
    members[colour, slot] = np.arange(size)
    owner = np.full((rows, pixels), members.shape[1], np.int32)
    at, neuron = np.nonzero(depends)
    owner[colour[neuron], at] = slot[neuron]
    pixel = dict(pixel)
    pixel[graph.input] = np.arange(pixels, dtype=np.int32)
    return Packing(members, owner, pixel)
