"""Certification inside an evaluation: the lower bound, batch by batch beside the attacks, and
its record in the report.

:func:`batch` certifies one batch under the plan's ``certify`` method and returns per-example
arrays; :func:`figures` turns the whole dataset's arrays into the model record's ``certified``
field: certified robust accuracy, the interval ``[certified, bundled]`` robust accuracy lies in,
the examples neither side decides, and the soundness checks (no example both certified and
fooled, no bound above the model's own clean margin). The radius certified is the radius the
judge accepts (:func:`radius`): on the 8-bit grid the grid's radius, in float32 the eps ball
with the judge's float slack. Certificates are statements about the model as the judge
computes it (float32 ``Precision.HIGHEST``, :mod:`jaxbundle.core.arithmetic`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxbundle.core import arithmetic, norms, sampling
from jaxbundle.report import curves
from jaxbundle.certify import bounds

__all__ = ["EXACT", "RADIUS_STEPS", "batch", "bound_above_model", "certified_and_fooled", "curve",
           "figures", "missed_by_attacks", "radius"]

# exact_status codes (the complete mode's per-example verdict): off_grid, a float point of the
# grid's radius that is adversarial but whose rounding to the 8-bit grid is not (grid-judged
# examples only: it decides nothing about the judged threat model)
EXACT = {"certified": 1, "unknown": 0, "attacked": -1, "off_grid": -2}
# Bisection steps of the certified radius (the P(D) curve's certified side): resolution
# 2^-10 of the curve's range (Linf 0.001, L2 0.01), each step one bound evaluation.
RADIUS_STEPS = 10
# Smoothing's estimation samples per example inside an evaluation (Cohen et al. use 100,000:
# fewer give a smaller certified radius, never an unsound one); n0 and alpha are theirs.
SMOOTHING_SAMPLES = 10_000
TIME_LIMIT = 10.0  # the complete mode's default seconds per example (the plan's
#   certify_time_limit sets another)
SMOOTHING_ALPHA = 0.001


def radius(plan: Any, on_grid: jax.Array) -> jax.Array:
    """``[B]`` the radius to certify: every image the judge would accept lies within it (the
    grid's radius on the 8-bit grid, eps elsewhere, both with the judge's float slack,
    :func:`jaxbundle.core.norms.ball_limit`)."""
    grid = norms.ball_limit(norms.grid_radius(plan.threat.eps, plan.threat.norm))
    return jnp.where(jnp.asarray(on_grid, bool), grid, norms.ball_limit(plan.threat.eps))


@functools.partial(jax.jit, static_argnames=("apply_fn", "method", "norm", "replicated"))
def _bound_margin(apply_fn: Callable, params: Any, x: jax.Array, y: jax.Array, eps: jax.Array,
                  *, method: str, norm: str, replicated: Any = None) -> jax.Array:
    """``[B]`` the lower bound on the smallest wrong-class margin over each example's set."""
    lower = bounds.margin_bounds(apply_fn, params, x, y, eps=eps, norm=norm, method=method)
    out = jnp.min(lower, axis=1)
    return out if replicated is None else jax.lax.with_sharding_constraint(out, replicated)


@functools.partial(jax.jit, static_argnames=("apply_fn", "method", "norm", "replicated"))
def _certified_radius(apply_fn: Callable, params: Any, x: jax.Array, y: jax.Array,
                      top: float, *, method: str, norm: str, replicated: Any = None
                      ) -> jax.Array:
    """``[B]`` a radius each example is certified at (0 where none is): bisection on
    ``[0, top]``, :data:`RADIUS_STEPS` bound evaluations, a lower bound on the largest."""
    def step(_, bracket):
        low, high = bracket
        middle = (low + high) / 2
        ok = _bound_margin(apply_fn, params, x, y, middle, method=method, norm=norm) > 0
        return jnp.where(ok, middle, low), jnp.where(ok, high, middle)

    start = (jnp.zeros(x.shape[:1], jnp.float32), jnp.full(x.shape[:1], top, jnp.float32))
    low, _ = jax.lax.fori_loop(0, RADIUS_STEPS, step, start)
    return low if replicated is None else jax.lax.with_sharding_constraint(low, replicated)


def _bound_outputs(plan: Any, model: Any, x: jax.Array, y: jax.Array, eps: jax.Array
                   ) -> dict[str, np.ndarray]:
    method = "crown" if plan.certify.method == "complete" else plan.certify.method
    replicated = None if model.mesh is None else NamedSharding(model.mesh, PartitionSpec())
    margin = np.asarray(_bound_margin(model.apply_fn, model.params, x, y, eps, method=method,
                                      norm=plan.threat.norm, replicated=replicated))
    clean, gap, scale = (np.asarray(v) for v in _clean_margin(
        model.apply_fn, model.params, x, y, replicated=replicated))
    if gap > 1e-6 * max(float(scale), 1.0):
        raise ValueError(
            f"certify: the model gives an image other logits at another position in the batch "
            f"(by up to {float(gap):.3g}), so the function certified one image at a time is not "
            "the one the attacks and the judge run (noise from a PRNG key the model holds, "
            "BatchNorm in training mode?); declare randomness with jaxbundle.stochastic")
    out = {"certified": margin > 0, "bound_margin": margin.astype(np.float32),
           "clean_margin": clean.astype(np.float32)}
    if "min_norm" in plan.goal_names:  # the certified curve beside the attacks' P(D)
        top = float(curves.distortion_grid(plan.threat.norm)[-1])
        out["certified_radius"] = np.asarray(_certified_radius(
            model.apply_fn, model.params, x, y, top, method=method, norm=plan.threat.norm,
            replicated=replicated))
    return out


@functools.partial(jax.jit, static_argnames=("apply_fn", "replicated"))
def _clean_margin(apply_fn: Callable, params: Any, x: jax.Array, y: jax.Array, *,
                  replicated: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``[B]`` the model's own smallest margin ``z_y - z_j`` at the clean image, computed as the
    judge computes it (no sound bound on the ball can be above it); and how far the logits of
    the batch in reverse order are from them, with the largest logit: a model whose logits
    depend on the rest of the batch is not the function certified one image at a time."""
    with arithmetic.stated():
        logits = sampling.float32_logits(apply_fn(params, x))
        reordered = sampling.float32_logits(apply_fn(params, x[::-1]))[::-1]
    true = jnp.take_along_axis(logits, y[:, None], axis=1)[:, 0]
    wrong = jnp.where(jax.nn.one_hot(y, logits.shape[-1], dtype=bool), -jnp.inf, logits)
    out = true - jnp.max(wrong, axis=1)
    out = out if replicated is None else jax.lax.with_sharding_constraint(out, replicated)
    return out, jnp.max(jnp.abs(logits - reordered)), jnp.max(jnp.abs(logits))


def _exact(plan: Any, model: Any, x: np.ndarray, y: np.ndarray, eps: np.ndarray,
           on_grid: np.ndarray, open_: np.ndarray) -> np.ndarray:
    """``[B]`` int8 :data:`EXACT` codes of the complete mode on the rows ``open_`` (0 for the
    others). On a grid-judged row the MIP searches the float box of the grid's radius: its
    adversarial point counts as ``attacked`` when its rounding to the 8-bit grid
    (:func:`jaxbundle.core.norms.quantize`, inside the ball and the box) still fools the model as
    the judge computes it, else it is ``off_grid``: a float image outside the judged threat
    model, which decides nothing about it."""
    from jaxbundle.certify import complete  # SciPy's MIP solver: loaded when used

    status = np.zeros(len(x), np.int8)
    limit = plan.certify.time_limit or TIME_LIMIT
    for i in np.flatnonzero(open_):
        (decision,) = complete.complete(model.apply_fn, model.params, x[i:i + 1], y[i:i + 1],
                                        eps=float(eps[i]), time_limit=limit)
        status[i] = EXACT[decision.status]
        if decision.status == "attacked" and on_grid[i]:
            point = jnp.asarray(decision.x.reshape(x[i:i + 1].shape))
            rounded = norms.quantize(point, jnp.asarray(x[i:i + 1]), plan.threat.eps,
                                     plan.threat.norm)
            if not _misclassified(model.apply_fn, model.params, rounded, y[i]):
                status[i] = EXACT["off_grid"]
    return status


def _misclassified(apply_fn: Callable, params: Any, image: jax.Array, label: int) -> bool:
    """Whether the model, computed as the judge computes it, misclassifies ``image``."""
    with arithmetic.stated():
        logits = np.asarray(sampling.float32_logits(apply_fn(params, image)))[0]
    return int(np.argmax(logits)) != int(label)


def batch(plan: Any, model: Any, x: jax.Array, y: jax.Array, example_id: jax.Array,
          outputs: dict[str, np.ndarray], real: np.ndarray) -> dict[str, np.ndarray]:
    """The certification of one batch (real rows only, like ``outputs``, the attacks' per-example
    arrays of the same batch): ``certified``, ``bound_margin`` and ``clean_margin``; with
    ``complete`` also ``exact_status`` and ``bound_certified`` (CROWN's own verdict, before the
    MIP; ``certified`` is then what either proved); with ``smoothing`` ``smoothed_prediction``
    and ``smoothed_radius``. A verdict is never changed to agree with the attacks: an example
    both certified and fooled stays both, and the ``certified_and_fooled`` check fires."""
    if plan.certify.method in ("complete", "smoothing") and jax.process_count() > 1:
        raise ValueError(f"certify={plan.certify.method!r} runs on the host of one process; across "
                         "processes use ibp, crown-ibp or crown (sharded like the attacks)")
    on_grid = np.zeros(len(real), bool)
    on_grid[real] = outputs["judged_on_grid"]
    eps = radius(plan, on_grid)
    if plan.certify.method == "smoothing":
        return _smoothed(plan, model, x, example_id, eps, real, outputs["label"])
    out = {k: v[real] for k, v in _bound_outputs(plan, model, x, y, eps).items()}
    if plan.certify.method == "complete":
        fooled = outputs["success"].astype(bool)
        correct = outputs["clean_prediction"] == outputs["label"]
        bound = out["certified"]
        status = _exact(plan, model, np.asarray(x)[real], outputs["label"],
                        np.asarray(eps)[real], on_grid[real], ~(bound | fooled | ~correct))
        status[(fooled | ~correct) & ~bound] = EXACT["attacked"]  # decided by the attacks
        status[bound] = EXACT["certified"]  # decided by the bound, whatever the attacks say
        out.update(exact_status=status, bound_certified=bound,
                   certified=status == EXACT["certified"])
    return out


def _smoothed(plan, model, x, example_id, eps, real, labels) -> dict[str, np.ndarray]:
    """Cohen et al.'s CERTIFY on the real rows; certified at eps when the smoothed classifier
    is right with a certified L2 radius of at least eps (Linf eps: ``eps * sqrt(d)``, the L2
    ball holding the Linf ball)."""
    from jaxbundle.certify import smoothing  # SciPy's beta quantiles: loaded when used

    key = jax.random.fold_in(model.key, 0x5300)
    cert = smoothing.certify(model.apply_fn, model.params, np.asarray(x)[real], key=key,
                             n=SMOOTHING_SAMPLES, alpha=SMOOTHING_ALPHA,
                             example_id=np.asarray(example_id)[real])
    scale = np.sqrt(np.prod(np.shape(x)[1:])) if plan.threat.norm == "linf" else 1.0
    right, l2_radius = np.asarray(cert.prediction) == labels, np.asarray(cert.radius)
    return {"certified": right & (l2_radius >= np.asarray(eps)[real] * scale),
            "smoothed_prediction": np.asarray(cert.prediction, np.int32),
            "smoothed_radius": l2_radius.astype(np.float32),
            "certified_radius": np.where(right, l2_radius / scale, 0.0).astype(np.float32)}


def figures(plan: Any, per_example: dict[str, np.ndarray], robust_accuracy: float,
            seconds: float) -> dict:
    """The model record's ``certified`` field from the whole dataset's per-example arrays.

    A bound (IBP, CROWN-IBP, CROWN, complete) certifies the model the attacks attack: robust
    accuracy lies in ``[certified, bundled]``, and ``certified_and_fooled`` (certified, yet an
    attack fooled it or the clean image is misclassified) and ``bound_above_model`` (the
    bound is above the model's own margin at the clean image) must be 0. Smoothing certifies
    another classifier, the smoothed one: its clean and certified accuracy are reported on
    their own (``smoothed``), with no interval and no check against the noisy model's
    attacks."""
    n = max(len(per_example["label"]), 1)
    certified = per_example["certified"].astype(bool)
    lower = float(100.0 * certified.sum() / n)
    method, threat = plan.certify.method, plan.threat
    record = {
        "method": method,
        "classifier": "smoothed" if method == "smoothing" else "model",
        "radius": {"grid": norms.grid_radius(threat.eps, threat.norm), "float": threat.eps},
        "arithmetic": arithmetic.PRECISION if method != "smoothing" else None,
        "certified_robust_accuracy": lower,
        "interval": None, "undecided": None, "certified_and_fooled": None,
        "bound_above_model": None, "exact": None, "smoothed": None,
        "seconds": seconds,
    }
    if plan.certify.method == "smoothing":
        right = per_example["smoothed_prediction"] == per_example["label"]
        record["smoothed"] = {
            "clean_accuracy": float(100.0 * right.sum() / n),
            "abstained": int(np.sum(per_example["smoothed_prediction"] < 0))}
    else:
        robust = _correct(per_example) & ~per_example["success"].astype(bool)
        record.update(interval=[lower, robust_accuracy],
                      undecided=int(np.sum(robust & ~certified)),
                      certified_and_fooled=int(np.sum(certified_and_fooled(per_example))),
                      bound_above_model=int(np.sum(bound_above_model(per_example))))
    if "exact_status" in per_example:
        status = per_example["exact_status"]
        record["exact"] = {name: int(np.sum(status == code)) for name, code in EXACT.items()}
        record["exact"]["bound_certified"] = int(np.sum(per_example["bound_certified"]))
        record["exact"]["missed_by_attacks"] = int(np.sum(missed_by_attacks(per_example)))
    record["statement"] = _statement(record, plan)
    return record


def _correct(per_example: dict[str, np.ndarray]) -> np.ndarray:
    return per_example["clean_prediction"] == per_example["label"]


def certified_and_fooled(per_example: dict[str, np.ndarray]) -> np.ndarray:
    """``[n]``: certified (by the bound, or in the complete mode by the bound or the MIP), yet
    fooled by an attack or misclassified clean: a bound or a verdict is wrong."""
    certified = per_example["certified"].astype(bool)
    if "bound_certified" in per_example:
        certified = certified | per_example["bound_certified"].astype(bool)
    return certified & (per_example["success"].astype(bool) | ~_correct(per_example))


def bound_above_model(per_example: dict[str, np.ndarray]) -> np.ndarray:
    """``[n]``: the bound on the smallest margin over the ball is above the model's own margin
    at the clean image, which lies in the ball: the bound is not the model's (a bug, or a model
    that is not the function certification traced, e.g. one drawing random numbers)."""
    return per_example["bound_margin"] > per_example["clean_margin"]


def missed_by_attacks(per_example: dict[str, np.ndarray]) -> np.ndarray:
    """``[n]``: correctly classified, fooled by no attack, and the complete mode found an
    adversarial example of the judged threat model (``exact_status`` attacked: on the 8-bit
    grid, a grid image; ``off_grid`` points are not counted)."""
    return ((per_example["exact_status"] == EXACT["attacked"]) & _correct(per_example)
            & ~per_example["success"].astype(bool))


def _statement(record: dict, plan: Any) -> str:
    if record["classifier"] == "smoothed":
        s = record["smoothed"]
        return (f"the smoothed classifier (a different classifier from the noisy model the "
                f"attacks judge): clean {s['clean_accuracy']:.1f} %, certified "
                f"{record['certified_robust_accuracy']:.1f} % (each certificate wrong with "
                f"probability at most {SMOOTHING_ALPHA:g}), {s['abstained']} abstained; the "
                "attacks' figure is the noisy model's, not an upper bound on this one")
    low, high = record["interval"]
    text = (f"robust accuracy lies in [{low:.1f}, {high:.1f}] %: certified by "
            f"{plan.certify.method} "
            f"for the model at float32 Precision.HIGHEST, fooled by the attacks; "
            f"{record['undecided']} examples undecided")
    if record["exact"] is not None:
        e = record["exact"]
        text += (f"; complete mode: {e['certified']} certified, {e['attacked']} attacked, "
                 f"{e['unknown']} unknown (time limit)")
        if e["off_grid"]:
            text += (f", {e['off_grid']} with a float adversarial point outside the 8-bit "
                     "threat model (its rounding to the grid is not adversarial)")
    if high - low > 10.0:
        text += ("; the interval is wide: the bounds are loose on a model not trained for "
                 "verification (complete mode or a tighter method may narrow it)")
    return text


def curve(per_example: dict[str, np.ndarray], norm: str) -> tuple[list[float], dict]:
    """The certified side of P(D) and D1/2: at each distortion of the curve's grid, the fraction
    of the correctly classified examples not certified at it (an upper bound on the true P(D),
    as the attacks' curve is a lower bound), and the distortion where it reaches 1/2 (a lower
    bound on the true D1/2). With smoothing, of the smoothed classifier's correct examples."""
    ok = (per_example["smoothed_prediction"] == per_example["label"]
          if "smoothed_prediction" in per_example else _correct(per_example))
    radius_ = per_example["certified_radius"]
    grid = curves.distortion_grid(norm)
    return (curves.operating_characteristic(radius_, ok, grid).tolist(),
            curves.half_distortion(radius_, ok))
