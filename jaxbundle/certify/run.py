"""Certification inside an evaluation: the lower bound, batch by batch beside the attacks, and
its record in the report.

:func:`batch` certifies one batch under the plan's ``certify`` method and returns per-example
arrays; :func:`figures` turns the whole dataset's arrays into the model record's ``certified``
field: certified robust accuracy, the interval ``[certified, bundled]`` robust accuracy lies in,
the examples neither side decides, and the soundness check (no example both certified and
fooled). The radius certified is the radius the judge accepts (:func:`radius`): on the 8-bit
grid the grid's radius, in float32 the eps ball with the judge's float slack.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxbundle import curves, norms
from jaxbundle.certify import bounds
from jaxbundle.plan import CERTIFY_TIME_LIMIT

__all__ = ["EXACT", "RADIUS_STEPS", "batch", "curve", "figures", "missed_by_attacks", "radius"]

# exact_status codes (the complete mode's per-example verdict)
EXACT = {"certified": 1, "unknown": 0, "attacked": -1}
# Bisection steps of the certified radius (the P(D) curve's certified side): resolution
# 2^-10 of the curve's range (Linf 0.001, L2 0.01), each step one bound evaluation.
RADIUS_STEPS = 10
# Smoothing's estimation samples per example inside an evaluation (Cohen et al. use 100,000:
# fewer give a smaller certified radius, never an unsound one); n0 and alpha are theirs.
SMOOTHING_SAMPLES = 10_000


def radius(plan: Any, on_grid: jax.Array) -> jax.Array:
    """``[B]`` the radius to certify: every image the judge would accept lies within it (the
    grid's radius on the 8-bit grid, eps elsewhere, both with the judge's float slack,
    :func:`jaxbundle.norms.ball_limit`)."""
    grid = norms.ball_limit(norms.grid_radius(plan.eps, plan.norm))
    return jnp.where(jnp.asarray(on_grid, bool), grid, norms.ball_limit(plan.eps))


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
    method = "crown" if plan.certify == "complete" else plan.certify
    replicated = None if model.mesh is None else NamedSharding(model.mesh, PartitionSpec())
    margin = np.asarray(_bound_margin(model.apply_fn, model.params, x, y, eps, method=method,
                                      norm=plan.norm, replicated=replicated))
    out = {"certified": margin > 0, "bound_margin": margin.astype(np.float32)}
    if "min_norm" in plan.goal_names:  # the certified curve beside the attacks' P(D)
        top = float(curves.distortion_grid(plan.norm)[-1])
        out["certified_radius"] = np.asarray(_certified_radius(
            model.apply_fn, model.params, x, y, top, method=method, norm=plan.norm,
            replicated=replicated))
    return out


def _exact(plan: Any, model: Any, x: np.ndarray, y: np.ndarray, eps: np.ndarray,
           decided: np.ndarray) -> np.ndarray:
    """``[B]`` int8 :data:`EXACT` codes: the complete mode on the rows ``decided`` leaves open
    (the bound certified them or an attack fooled them: those are known already)."""
    from jaxbundle.certify import complete  # SciPy's MIP solver: loaded when used

    status = np.zeros(len(x), np.int8)
    limit = plan.certify_time_limit or CERTIFY_TIME_LIMIT
    for i in np.flatnonzero(~decided):
        (decision,) = complete.complete(model.apply_fn, model.params, x[i:i + 1], y[i:i + 1],
                                        eps=float(eps[i]), time_limit=limit)
        status[i] = EXACT[decision.status]
    return status


def batch(plan: Any, model: Any, x: jax.Array, y: jax.Array, example_id: jax.Array,
          outputs: dict[str, np.ndarray], real: np.ndarray) -> dict[str, np.ndarray]:
    """The certification of one batch (real rows only, like ``outputs``, the attacks' per-example
    arrays of the same batch): ``certified``, ``bound_margin``; with ``complete`` also
    ``exact_status`` (``certified`` then says what the complete mode proved); with
    ``smoothing`` ``smoothed_prediction`` and ``smoothed_radius``."""
    if plan.certify in ("complete", "smoothing") and jax.process_count() > 1:
        raise ValueError(f"certify={plan.certify!r} runs on the host of one process; across "
                         "processes use ibp, crown-ibp or crown (sharded like the attacks)")
    on_grid = np.zeros(len(real), bool)
    on_grid[real] = outputs["judged_on_grid"]
    eps = radius(plan, on_grid)
    if plan.certify == "smoothing":
        return _smoothed(plan, model, x, example_id, eps, real, outputs["label"])
    out = {k: v[real] for k, v in _bound_outputs(plan, model, x, y, eps).items()}
    if plan.certify == "complete":
        fooled = outputs["success"].astype(bool)
        correct = outputs["clean_prediction"] == outputs["label"]
        decided = out["certified"] | fooled | ~correct
        status = _exact(plan, model, np.asarray(x)[real], outputs["label"],
                        np.asarray(eps)[real], decided)
        status[out["certified"]] = EXACT["certified"]
        status[fooled | ~correct] = EXACT["attacked"]
        out["exact_status"] = status
        out["certified"] = status == EXACT["certified"]
    return out


def _smoothed(plan, model, x, example_id, eps, real, labels) -> dict[str, np.ndarray]:
    """Cohen et al.'s CERTIFY on the real rows; certified at eps when the smoothed classifier
    is right with a certified L2 radius of at least eps (Linf eps: ``eps * sqrt(d)``, the L2
    ball holding the Linf ball)."""
    from jaxbundle.certify import smoothing  # SciPy's beta quantiles: loaded when used

    key = jax.random.fold_in(model.key, 0x5300)
    cert = smoothing.certify(model.apply_fn, model.params, np.asarray(x)[real], key=key,
                             n=SMOOTHING_SAMPLES,
                             example_id=np.asarray(example_id)[real])
    scale = np.sqrt(np.prod(np.shape(x)[1:])) if plan.norm == "linf" else 1.0
    right, l2_radius = np.asarray(cert.prediction) == labels, np.asarray(cert.radius)
    return {"certified": right & (l2_radius >= np.asarray(eps)[real] * scale),
            "smoothed_prediction": np.asarray(cert.prediction, np.int32),
            "smoothed_radius": l2_radius.astype(np.float32),
            "certified_radius": np.where(right, l2_radius / scale, 0.0).astype(np.float32)}


def figures(plan: Any, per_example: dict[str, np.ndarray], robust_accuracy: float,
            seconds: float) -> dict:
    """The model record's ``certified`` field from the whole dataset's per-example arrays."""
    n = max(len(per_example["label"]), 1)
    certified = per_example["certified"].astype(bool)
    correct = per_example["clean_prediction"] == per_example["label"]
    fooled = per_example["success"].astype(bool)
    robust = correct & ~fooled
    lower = float(100.0 * certified.sum() / n)
    record = {
        "method": plan.certify,
        "radius": {"grid": norms.grid_radius(plan.eps, plan.norm), "float": plan.eps},
        "certified_robust_accuracy": lower,
        "interval": [lower, robust_accuracy],
        "undecided": int(np.sum(robust & ~certified)),
        "certified_and_fooled": int(np.sum(certified & fooled)),
        "exact": None,
        "seconds": seconds,
    }
    if "exact_status" in per_example:
        status = per_example["exact_status"]
        record["exact"] = {name: int(np.sum(status == code)) for name, code in EXACT.items()}
        record["exact"]["missed_by_attacks"] = int(np.sum(missed_by_attacks(per_example)))
    record["statement"] = _statement(record, plan)
    return record


def missed_by_attacks(per_example: dict[str, np.ndarray]) -> np.ndarray:
    """``[n]``: correctly classified, fooled by no attack, and the complete mode found an
    adversarial point (``exact_status`` attacked)."""
    correct = per_example["clean_prediction"] == per_example["label"]
    return ((per_example["exact_status"] == EXACT["attacked"]) & correct
            & ~per_example["success"].astype(bool))


def _statement(record: dict, plan: Any) -> str:
    low, high = record["interval"]
    text = (f"robust accuracy lies in [{low:.1f}, {high:.1f}] %: certified by {plan.certify}, "
            f"fooled by the attacks; {record['undecided']} examples undecided")
    if record["exact"] is not None:
        e = record["exact"]
        text += (f"; complete mode: {e['certified']} certified, {e['attacked']} attacked, "
                 f"{e['unknown']} unknown (time limit)")
    if high - low > 10.0:
        text += ("; the interval is wide: the bounds are loose on a model not trained for "
                 "verification (complete mode or a tighter method may narrow it)")
    if plan.certify == "smoothing":
        text += ("; smoothing certifies the smoothed classifier with probability 1 - alpha, "
                 "the attacks judge the noisy model by its calls")
    return text


def curve(per_example: dict[str, np.ndarray], norm: str) -> tuple[list[float], dict]:
    """The certified side of P(D) and D1/2: at each distortion of the curve's grid, the fraction
    of the correctly classified examples not certified at it (an upper bound on the true P(D),
    as the attacks' curve is a lower bound), and the distortion where it reaches 1/2 (a lower
    bound on the true D1/2)."""
    ok = per_example["clean_prediction"] == per_example["label"]
    radius_ = per_example["certified_radius"]
    grid = curves.distortion_grid(norm)
    return (curves.operating_characteristic(radius_, ok, grid).tolist(),
            curves.half_distortion(radius_, ok))
