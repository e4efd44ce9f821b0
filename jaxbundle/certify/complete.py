"""Complete verification of a ReLU network: the exact smallest margin over the input box, by a
mixed-integer program solved with SciPy's HiGHS.

For one example's :class:`jaxbundle.certify.program.ReluProgram` (its input box, its ReLU
layers as affine maps and every pre-activation's bounds ``l <= z <= u``), the margin
``z_y - z_j`` of each wrong class ``j`` is minimised over the box with the big-M encoding of
every ReLU ``a = max(z, 0)`` (Tjeng et al. 2019, "Evaluating robustness of neural networks with
mixed integer programming"):

* stable neurons need no binary: ``u <= 0`` gives ``a = 0``, ``l >= 0`` gives ``a = z``;
* an unstable neuron (``l < 0 < u``) gets a binary ``d`` and
  ``a >= 0, a >= z, a <= z - l (1 - d), a <= u d``, exact for ``d`` in ``{0, 1}``.

The model computes in float32: its pre-activation is the program's ``z`` up to a slack ``s``
(:attr:`ReluProgram.pre_slack`, its rounding), so the program relaxes each ``z`` to
``[z - s, z + s]`` (``a >= z - s``, ``a <= z + s - l (1 - d)``; ``z - s <= a <= z + s`` for an
active neuron) and each margin by its own slack: a margin proven positive is positive for the
float32 model too, not only for the network in real arithmetic.

Every variable is boxed (the input by the example's box, each ReLU output by ``[max(l, 0),
max(u, 0)]``), so every relaxation is bounded. The classes are refined best first: each class
starts with the interval bound its margin gets from the program's bounds; the class with the
smallest bound so far is refined (interval, then the LP relaxation, then the MIP) until the
smallest bound is a solved MIP's (the exact smallest margin, up to HiGHS's gap), a point is
found that the exact network misclassifies, or the time limit runs out. Classes whose
relaxation is already above the smallest margin are never solved as a MIP.

**What decides a status** (never a guess):

* ``"attacked"``: a point of the box (the example itself, an LP or MIP solution, clipped into
  the box) on which the network, evaluated exactly by the program's affine maps and true ReLUs
  in float64, has a margin below ``-ATTACK_ATOL``; :func:`complete` also re-checks it on the
  model itself in float32.
* ``"certified"``: the proven lower bound on every class's margin (an interval bound, an LP
  optimum or a MIP's dual bound) exceeds :func:`certify_tolerance` (the reported margin is the
  bound less the tolerance, so certified means a positive margin), which covers the solver's
  dual feasibility tolerance over the whole box of variables: a dual bound computed with
  reduced costs that are each wrong by up to ``DUAL_SLACK`` is too high by at most
  ``DUAL_SLACK * sum(widths of the variables' boxes)`` (weak duality over a box).
* ``"unknown"``: anything else: a time limit, a solver failure, a MIP "optimum" whose point the
  exact network does not misclassify (a tie, or the solver's feasibility tolerance), or a
  bound within the tolerance of zero. Its ``margin`` is still a sound lower bound.

Soundness rests on the program's pre-activation bounds being sound (the example's own
pre-activations are checked against them); an attack never does, as it is re-evaluated.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
import numpy as np
import scipy.sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from jaxbundle.core import arithmetic
from jaxbundle.certify.extract import relu_program
from jaxbundle.certify.program import INPUT, Affine, ReluProgram

__all__ = [
    "Decision",
    "decide",
    "complete",
    "confirm",
    "forward",
    "certify_tolerance",
    "ATTACK_ATOL",
    "CERTIFY_ATOL",
    "DUAL_SLACK",
    "BOUNDS_RTOL",
    "STATUSES",
]

STATUSES = ("certified", "attacked", "unknown")
# A witness counts when the exact float64 margin is below -ATTACK_ATOL: float64 rounding of
# these networks' sums is ~1e-13, so a margin this negative is no rounding artefact.
ATTACK_ATOL = 1e-9
# "certified" needs every class's proven bound above certify_tolerance(): CERTIFY_ATOL, plus
# DUAL_SLACK per unit of width of every variable's box. HiGHS's dual feasibility tolerance is
# 1e-7 (on its scaled problem); DUAL_SLACK is ten times that.
CERTIFY_ATOL = 1e-6
DUAL_SLACK = 1e-6
# The example's own pre-activations must lie in the program's bounds up to this relative slack
# (bounds computed in float32); beyond it the bounds are unsound and no status can be trusted.
BOUNDS_RTOL = 1e-4
# HiGHS's default gaps: an "optimal" MIP's value is within both of its dual bound.
MIP_REL_GAP = 1e-4
MIP_ABS_GAP = 1e-6

_INTERVAL, _LP, _MIP, _DONE = 0, 1, 2, 3  # how far each class's bound has been refined


class Decision(NamedTuple):
    """The complete mode's verdict on one example.

    Attributes:
      status: ``"certified"``, ``"attacked"`` or ``"unknown"``.
      margin: certified / unknown: a proven lower bound on the smallest wrong-class margin over
        the box, :func:`certify_tolerance` already subtracted (certified exactly when it is
        positive; the exact minimum less the tolerance, up to HiGHS's gap, when every class
        was solved); attacked: the exact network's margin at ``x`` (negative).
      x: when attacked the misclassified input, flat ``[d]``: float64 from :func:`decide`,
        the float32 image that fools the model from :func:`complete`; else None.
      seconds: wall-clock time spent.
    """

    status: str
    margin: float
    x: np.ndarray | None
    seconds: float


class _Encoding(NamedTuple):
    """The big-M MIP of a program: rows over columns ``[input, ReLU outputs..., binaries]``."""

    rows: scipy.sparse.csr_array  # [r, c]
    row_lower: np.ndarray  # [r]
    row_upper: np.ndarray  # [r]
    var_lower: np.ndarray  # [c]
    var_upper: np.ndarray  # [c]
    integrality: np.ndarray  # [c] 1 for the binaries
    objective: scipy.sparse.csr_array  # [m, c] each class's margin (without its bias)
    objective_bias: np.ndarray  # [m]


def forward(program: ReluProgram, x: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """The network exactly, in float64 with true ReLUs: the margins ``[m]`` at ``x`` ``[d]``
    and every layer's pre-activations."""
    values = {INPUT: np.asarray(x, np.float64)}
    pre = []
    for k, layer in enumerate(program.layers):
        pre.append(_apply(layer, values))
        values[k] = np.maximum(pre[-1], 0.0)
    return _apply(program.margins, values), tuple(pre)


def _apply(affine: Affine, values: dict[int, np.ndarray]) -> np.ndarray:
    out = np.asarray(affine.bias, np.float64).copy()
    for source, w in affine.terms:
        out += scipy.sparse.csr_array(w, dtype=np.float64) @ values[source]
    return out


def _check(program: ReluProgram) -> None:
    """Shapes, finite bounds and bounds that hold at the example (a ValueError otherwise)."""
    sizes = {INPUT: np.size(program.lower)}
    if not (np.shape(program.upper) == np.shape(program.center) == (sizes[INPUT],)):
        raise ValueError("a program's lower, upper and center must all be [d] vectors")
    if np.any(~(np.asarray(program.lower) <= program.upper)):
        raise ValueError("a program's input box is empty or not finite (lower > upper)")
    if len(program.pre_lower) != len(program.layers) or len(program.pre_upper) != len(
            program.layers):
        raise ValueError("a program needs pre_lower and pre_upper for every ReLU layer")
    for k, layer in enumerate((*program.layers, program.margins)):
        out = np.size(layer.bias)
        for source, w in layer.terms:
            if source not in sizes or np.shape(w) != (out, sizes[source]):
                raise ValueError(f"layer {k}: a term on source {source} has shape "
                                 f"{np.shape(w)}, expected ({out}, size of an earlier source)")
        if k < len(program.layers):
            low, high = program.pre_lower[k], program.pre_upper[k]
            if np.shape(low) != (out,) or np.shape(high) != (out,):
                raise ValueError(f"layer {k}: pre-activation bounds must be [{out}] vectors")
            if not (np.all(np.isfinite(low)) and np.all(np.isfinite(high))):
                raise ValueError(f"layer {k}: pre-activation bounds must be finite")
            sizes[k] = out
    if np.size(program.margins.bias) == 0:
        raise ValueError("a program needs at least one margin row (a wrong class)")
    if np.shape(program.classes) != np.shape(program.margins.bias):
        raise ValueError("a program needs one class per margin row")
    slacks = [*program.pre_slack, *([] if program.margin_slack is None else
                                    [program.margin_slack])]
    shapes = [np.shape(b) for b in program.pre_lower][:len(program.pre_slack)] + (
        [] if program.margin_slack is None else [np.shape(program.margins.bias)])
    if program.pre_slack and len(program.pre_slack) != len(program.layers) or any(
            np.shape(v) != shape or not np.all(np.isfinite(v) & (np.asarray(v) >= 0))
            for v, shape in zip(slacks, shapes)):
        raise ValueError("a program's slacks must be finite non-negative vectors, one per "
                         "layer's pre-activations and one for the margins")
    _, pre = forward(program, program.center)
    for k, z in enumerate(pre):
        slack = BOUNDS_RTOL * (1.0 + np.abs(z))
        if np.any(z < program.pre_lower[k] - slack) or np.any(z > program.pre_upper[k] + slack):
            raise ValueError(f"layer {k}: the pre-activation bounds exclude the example's own "
                             "pre-activations (unsound bounds)")


def _block(affine: Affine, offsets: dict[int, int], columns: int) -> scipy.sparse.csr_array:
    """``[out, columns]`` the affine map's weights placed at its sources' columns."""
    parts = []
    for source, w in affine.terms:
        coo = scipy.sparse.coo_array(w, dtype=np.float64)
        parts.append(scipy.sparse.coo_array(
            (coo.data, (coo.row, coo.col + offsets[source])), shape=(coo.shape[0], columns)))
    if not parts:
        return scipy.sparse.csr_array((np.size(affine.bias), columns))
    return scipy.sparse.csr_array(sum(p.tocsr() for p in parts))


def _entries(columns: np.ndarray, values: np.ndarray, width: int) -> scipy.sparse.csr_array:
    """``[len(columns), width]`` with ``values[r]`` at ``(r, columns[r])``, zeros elsewhere."""
    rows = np.arange(columns.size)
    return scipy.sparse.csr_array((values, (rows, columns)), shape=(columns.size, width))


def _relu_rows(weights: scipy.sparse.csr_array, bias: np.ndarray, lo: np.ndarray,
               hi: np.ndarray, outputs: np.ndarray, binaries: np.ndarray, slack: np.ndarray
               ) -> tuple[list[scipy.sparse.csr_array], list[np.ndarray], list[np.ndarray]]:
    """One ReLU layer's rows ``low <= block @ v <= high``: ``z = weights @ v + bias`` is the
    pre-activation up to ``slack``, ``outputs`` the columns of ``a``, ``binaries`` those of the
    unstable neurons' ``d`` (in order). Inactive neurons need no row (their ``a`` is boxed to
    0)."""
    width = weights.shape[1]
    active, split = np.flatnonzero(lo >= 0), np.flatnonzero((lo < 0) & (hi > 0))
    own = _entries(outputs[split], np.ones(split.size), width)
    relu = own - weights[split]  # a - W v
    blocks = [_entries(outputs[active], np.ones(active.size), width) - weights[active],  # = b
              relu,  # >= b
              relu - _entries(binaries, lo[split], width),  # a - W v - l d <= b - l
              own - _entries(binaries, hi[split], width)]  # a - u d <= 0
    none = np.full(split.size, np.inf)
    lows = [bias[active] - slack[active], bias[split] - slack[split], -none, -none]
    highs = [bias[active] + slack[active], none, bias[split] + slack[split] - lo[split],
             np.zeros(split.size)]
    return blocks, lows, highs


def _encode(program: ReluProgram) -> _Encoding:
    """The big-M encoding (see the module docstring) of every ReLU layer."""
    widths = [np.size(program.lower)] + [np.size(b) for b in program.pre_lower]
    starts = np.concatenate([[0], np.cumsum(widths)]).astype(int)
    offsets = {source: int(starts[source + 1]) for source in range(INPUT, len(widths) - 1)}
    unstable = [int(np.sum((lo < 0) & (hi > 0)))
                for lo, hi in zip(program.pre_lower, program.pre_upper)]
    binary_start = np.cumsum([0] + unstable) + starts[-1]
    columns = int(binary_start[-1])
    var_lower, var_upper = np.zeros(columns), np.ones(columns)
    var_lower[:widths[0]], var_upper[:widths[0]] = program.lower, program.upper
    blocks, lows, highs = [], [], []
    for k, layer in enumerate(program.layers):
        lo = np.asarray(program.pre_lower[k], np.float64)
        hi = np.asarray(program.pre_upper[k], np.float64)
        outputs = offsets[k] + np.arange(widths[k + 1])
        var_lower[outputs], var_upper[outputs] = np.maximum(lo, 0.0), np.maximum(hi, 0.0)
        binaries = binary_start[k] + np.arange(unstable[k])
        slack = (np.asarray(program.pre_slack[k], np.float64) if program.pre_slack
                 else np.zeros(lo.shape))
        rows = _relu_rows(_block(layer, offsets, columns), np.asarray(layer.bias, np.float64),
                          lo, hi, outputs, binaries, slack)
        blocks, lows, highs = blocks + rows[0], lows + rows[1], highs + rows[2]
    integrality = (np.arange(columns) >= starts[-1]).astype(float)
    matrix = scipy.sparse.vstack(blocks, format="csr") if blocks else scipy.sparse.csr_array(
        (0, columns))
    margin_slack = 0.0 if program.margin_slack is None else np.asarray(program.margin_slack,
                                                                        np.float64)
    return _Encoding(matrix, np.concatenate([np.zeros(0), *lows]),
                     np.concatenate([np.zeros(0), *highs]), var_lower, var_upper, integrality,
                     _block(program.margins, offsets, columns),
                     np.asarray(program.margins.bias, np.float64) - margin_slack)


def certify_tolerance(program: ReluProgram) -> float:
    """How far above zero a proven margin bound must be to certify: :data:`CERTIFY_ATOL` plus
    :data:`DUAL_SLACK` times the summed widths of every MIP variable's box (input, ReLU outputs
    and one per binary), the most a dual bound can be off through reduced costs that are each
    wrong by :data:`DUAL_SLACK` (weak duality over a box)."""
    widths = np.sum(np.asarray(program.upper, np.float64) - program.lower)
    for lo, hi in zip(program.pre_lower, program.pre_upper):
        widths += np.sum(np.maximum(hi, 0.0) - np.maximum(lo, 0.0)) + np.sum((lo < 0) & (hi > 0))
    return float(CERTIFY_ATOL + DUAL_SLACK * widths)


def _interval(encoding: _Encoding) -> np.ndarray:
    """``[m]`` each margin's lower bound over the variables' boxes (interval arithmetic)."""
    c = encoding.objective
    return (encoding.objective_bias + c.maximum(0) @ encoding.var_lower
            + c.minimum(0) @ encoding.var_upper)


def _solve(encoding: _Encoding, row: int, relax: bool, seconds: float
           ) -> tuple[bool, float, np.ndarray | None]:
    """Minimises margin ``row`` (as an LP relaxation when ``relax``) within ``seconds``:
    ``(solved to optimality, proven lower bound or -inf, the solution's input or None)``."""
    objective = encoding.objective[[row]].toarray()[0]
    constraints = ([LinearConstraint(encoding.rows, encoding.row_lower, encoding.row_upper)]
                   if encoding.rows.shape[0] else [])
    result = milp(objective, integrality=0 if relax else encoding.integrality,
                  bounds=Bounds(encoding.var_lower, encoding.var_upper), constraints=constraints,
                  options={"time_limit": max(seconds, 1e-3)})
    bias = encoding.objective_bias[row]
    if relax:
        bound = result.fun if result.status == 0 else None
    else:  # a MIP's dual bound is sound whether or not it stopped on time
        bound = getattr(result, "mip_dual_bound", None)
        if bound is None and result.status == 0:  # SciPy drops it when x is all zeros
            bound = result.fun - max(MIP_ABS_GAP, MIP_REL_GAP * abs(result.fun))
    if bound is None or not np.isfinite(bound):
        bound = -np.inf
    return result.status == 0, float(bound + bias), result.x


def _witness(program: ReluProgram, point: np.ndarray | None) -> tuple[np.ndarray, float] | None:
    """``(x, margin)`` when ``point`` (its first ``d`` values, clipped into the box) is
    misclassified by the exact network by more than :data:`ATTACK_ATOL`, else None."""
    if point is None:
        return None
    x = np.clip(np.asarray(point[:np.size(program.lower)], np.float64), program.lower,
                program.upper)
    margin = float(np.min(forward(program, x)[0]))
    return (x, margin) if margin < -ATTACK_ATOL else None


def decide(program: ReluProgram, *, time_limit: float, tighten: bool = True) -> Decision:
    """Decides one example exactly: is every wrong-class margin positive over its box?

    Args:
      program: the example's :class:`~jaxbundle.certify.program.ReluProgram` (sound
        pre-activation bounds; the example's own pre-activations are checked against them).
      time_limit: seconds for the whole example (every LP and MIP together).
      tighten: keep solving until the margin is the exact minimum (True), or stop once the
        status is proven (False: the margin of a certified example is then only a bound).

    Returns:
      A :class:`Decision` (the module docstring says what proves each status).
    """
    start = time.perf_counter()
    if isinstance(time_limit, bool) or not float(time_limit) > 0:
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    _check(program)
    found = _witness(program, np.asarray(program.center))
    if found is not None:
        return Decision("attacked", found[1], found[0], time.perf_counter() - start)
    encoding = _encode(program)
    tolerance = certify_tolerance(program)
    bound = _interval(encoding)
    level = np.full(bound.shape, _INTERVAL)
    while True:
        row = int(np.argmin(bound))
        left = time_limit - (time.perf_counter() - start)
        if level[row] >= _MIP or (not tighten and bound[row] > tolerance) or left <= 0:
            break
        relax = level[row] == _INTERVAL
        solved, value, point = _solve(encoding, row, relax, left)
        found = _witness(program, point)
        if found is not None:
            return Decision("attacked", found[1], found[0], time.perf_counter() - start)
        bound[row] = max(bound[row], value)
        level[row] = (_LP if relax else _MIP) if solved or relax else _DONE
    margin = float(np.min(bound)) - tolerance
    return Decision("certified" if margin > 0 else "unknown", margin, None,
                    time.perf_counter() - start)


def confirm(apply_fn: Callable[[Any, Any], Any], params: Any, x: np.ndarray, y: int,
            point: np.ndarray, *, eps: float, lower: float = 0.0, upper: float = 1.0
            ) -> np.ndarray | None:
    """The float32 image ``point`` (flat, rounded into the ball and box) when the model
    itself, computed as the judge computes it, misclassifies it (a wrong logit strictly above
    the true one), else None.

    Args:
      apply_fn: ``apply_fn(params, x) -> logits`` ``[1, K]``.
      x: the clean image ``[...]`` (no batch axis); y: its label.
      point: ``[d]`` the candidate, flat.
      eps, lower, upper: the Linf ball and the data's box the candidate must lie in.
    """
    x0 = np.asarray(x, np.float64)
    low = np.maximum(x0 - eps, lower).ravel()
    high = np.minimum(x0 + eps, upper).ravel()
    rounded = np.asarray(point, np.float64).astype(np.float32)
    rounded = np.where(rounded > high, np.nextafter(rounded, np.float32(-np.inf)), rounded)
    rounded = np.where(rounded < low, np.nextafter(rounded, np.float32(np.inf)), rounded)
    if np.any(rounded < low) or np.any(rounded > high):
        return None
    image = jnp.asarray(rounded.reshape((1, *x0.shape)))
    with arithmetic.stated():  # as the judge computes it
        logits = np.asarray(apply_fn(params, image), np.float64).reshape(-1)
    wrong = np.delete(logits, int(y))
    return rounded if np.max(wrong) > logits[int(y)] else None


def complete(  # noqa: PLR0913 (the public call: keyword-only settings of the MIP)
        apply_fn: Callable[[Any, Any], Any], params: Any, x: Any, y: Any, *,
        eps: float, lower: float = 0.0, upper: float = 1.0, time_limit: float = 10.0,
        tighten: bool = True) -> list[Decision]:
    """The complete mode on a batch: each example's exact verdict under an Linf ball.

    Builds each example's program (:func:`jaxbundle.certify.extract.relu_program`, bounds
    from CROWN), decides it (:func:`decide`) and re-checks every attack on the model itself
    in float32 (:func:`confirm`): a point the float32 model does not misclassify inside the
    ball and the box (a tie on the decision boundary) makes the example "unknown", with the
    interval bound of the program as its margin.

    Args:
      apply_fn: ``apply_fn(params, x) -> logits`` of a ReLU network.
      x: images ``[B, ...]``; y: labels ``[B]``.
      eps: the Linf radius; lower, upper: the data's box.
      time_limit: seconds per example.
      tighten: see :func:`decide`.

    Returns:
      One :class:`Decision` per example; an attacked one's ``x`` is the float32 image (flat)
      that fools the model and its ``margin`` the exact network's margin there.
    """
    programs = relu_program(apply_fn, params, x, y, eps=eps, lower=lower, upper=upper)
    images, labels = np.asarray(x), np.asarray(y)
    radii = np.broadcast_to(np.asarray(eps, np.float64), (len(images),))
    decisions = []
    for i, program in enumerate(programs):
        decision = decide(program, time_limit=time_limit, tighten=tighten)
        if decision.status == "attacked":
            started = time.perf_counter()
            point = confirm(apply_fn, params, images[i], labels[i], decision.x, eps=radii[i],
                            lower=lower, upper=upper)
            margin = None if point is None else float(np.min(forward(program, point)[0]))
            spent = decision.seconds + time.perf_counter() - started
            if margin is None or margin >= -ATTACK_ATOL:
                floor = float(np.min(_interval(_encode(program)))) - certify_tolerance(program)
                decision = Decision("unknown", floor, None, spent)
            else:
                decision = Decision("attacked", margin, point, spent)
        decisions.append(decision)
    return decisions
