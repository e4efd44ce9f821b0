"""A ReLU network as a mixed-integer program's data: the exchange format between the bound
propagation (which extracts it from a model's jaxpr, with every pre-activation's bounds) and
the complete mode (which solves it exactly, :mod:`jaxbundle.certify.complete`).

Everything is host-side NumPy (SciPy sparse for the weights) for one example: values are
flattened, "source" ``-1`` is the input and source ``k >= 0`` is the output of ReLU layer ``k``
(ReLU layers are numbered in the order the network computes them).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse

__all__ = ["Affine", "ReluProgram", "INPUT"]

INPUT = -1


@dataclasses.dataclass(frozen=True)
class Affine:
    """``sum(W @ value(source) for source, W in terms) + bias``, exactly as the network computes
    it (no relaxation): ``W`` is ``[out, size(source)]``, ``bias`` is ``[out]``."""

    terms: tuple[tuple[int, scipy.sparse.csr_array], ...]
    bias: np.ndarray


@dataclasses.dataclass(frozen=True)
class ReluProgram:
    """One example's verification problem for a ReLU network under an Linf input set.

    Attributes:
      lower, upper: ``[d]`` the input set, a box: the Linf ball around the example intersected
        with the data's box (and, on the 8-bit grid, the grid's radius).
      center: ``[d]`` the example itself.
      layers: the pre-activation of ReLU layer ``k`` as an :class:`Affine` of the input and of
        earlier ReLU layers' outputs.
      pre_lower, pre_upper: sound bounds on every layer's pre-activation over the input set (from
        CROWN or IBP); neurons with ``pre_lower >= 0`` or ``pre_upper <= 0`` are stable.
      margins: ``[m]`` the margins ``z_y - z_j`` for every wrong class ``j``, an :class:`Affine`.
      classes: ``[m]`` the wrong class ``j`` of each margin row.
      pre_slack: per layer, how far the model's float32 pre-activation may be from the
        :class:`Affine`'s exact value (its rounding, and the maps' own); empty: none.
      margin_slack: ``[m]`` the same for the margins; None: none.
    """

    lower: np.ndarray
    upper: np.ndarray
    center: np.ndarray
    layers: tuple[Affine, ...]
    pre_lower: tuple[np.ndarray, ...]
    pre_upper: tuple[np.ndarray, ...]
    margins: Affine
    classes: np.ndarray
    pre_slack: tuple[np.ndarray, ...] = ()
    margin_slack: np.ndarray | None = None
