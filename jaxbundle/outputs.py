"""Per-example outputs and the figures computed from them on the host.

:func:`per_example_arrays` picks, inside the jitted batch program, the small per-example arrays
an evaluation keeps (the report's ``<model>.npz``); :func:`curve_metrics`,
:func:`kind_distortions` and :func:`stochastic_metrics` turn the whole dataset's arrays into
figures (P(D), D1/2, per-attack contributions, robustness vs compute, a stochastic model's
success-rate thresholds).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle import curves
from jaxbundle import goals as goals_lib
from jaxbundle.attacks.base import Attack
from jaxbundle.bundler import BundleResult
from jaxbundle.metrics import kind_success

__all__ = ["RATE_THRESHOLDS", "curve_metrics", "kind_distortions", "per_example_arrays",
           "stochastic_metrics"]


def per_example_arrays(
    result: BundleResult, x0: jax.Array, eps: jax.Array, black_box: Sequence[bool] | None = None
) -> dict[str, jax.Array]:
    """The per-example outputs kept for the report (``[B]`` arrays, and the judged ``x_adv``)."""
    mis = result.best["misclassify"]
    by_white, by_black = kind_success(result.attack_success, black_box)
    out = {
        "clean_prediction": result.clean.prediction,
        "winning_attack": mis.attack,
        "winning_restart": mis.restart,
        "winning_step": mis.step,
        "attack_success": result.attack_success.T,  # [B, A]
        "attack_distortion": result.attack_distortion.T,  # [B, A], inf: not fooled
        "attack_step": result.attack_step.T,  # [B, A]: step of each attack's best candidate
        "attack_improving": result.attack_improving.T,  # [B, A]: failed, margin still rising
        # A misclassified clean image's top probability is its highest wrong-class one.
        "clean_wrong_confidence": jnp.where(
            result.clean.misclassified, result.clean.confidence, 0.0
        ),
        "gradients": result.gradients,
        "queries": result.queries,
        "black_box_only": by_black & ~by_white,  # only a black-box attack fooled it
        "judged_on_grid": result.judged_on_grid,
        "x_adv": mis.x,  # the judged image (float32; stored as uint8 when all are on the grid)
    }
    for goal, best in result.best.items():  # misclassify: success, distortion, prediction
        out.update(goals_lib.GOALS[goal].per_example(best.score, eps))
    return out


RATE_THRESHOLDS = (0.0, 0.25, 0.5, 0.75, 0.9)


def stochastic_metrics(apply_fn: Any, attacks: Sequence[Attack],
                       per_example: dict[str, np.ndarray]) -> dict:
    """How a stochastic model was judged, and its robust accuracy at other success-rate
    thresholds (from the same per-example best candidates, chosen by their rate)."""
    rate, clean = per_example["success_rate"], per_example["clean_success_rate"]
    n = max(len(rate), 1)
    at = lambda t: float(np.sum((clean <= t) & (rate <= t)) / n)  # noqa: E731
    return {
        "calls": apply_fn.calls,
        "threshold": apply_fn.threshold,
        "eot": {a.name: a.eot for a in attacks},
        "statement": (
            f"stochastic model: each candidate judged over {apply_fn.calls} fresh calls the "
            f"attacks never saw; an example counts as fooled when more than "
            f"{apply_fn.threshold:g} of them misclassify its best candidate (the one with the "
            "highest success rate)"
        ),
        "mean_success_rate": float(np.mean(rate)) if len(rate) else 0.0,
        "mean_clean_success_rate": float(np.mean(clean)) if len(clean) else 0.0,
        "robust_accuracy_at_threshold": {f"{t:g}": at(t) for t in RATE_THRESHOLDS},
    }


def kind_distortions(per_example: dict[str, np.ndarray], attacks: Sequence[Attack]
                     ) -> dict[str, np.ndarray]:
    """Per example, the smallest verified adversarial distortion (inf: none) over the white-box
    attacks, the black-box ones and all of them: ``min_distortion_<kind>``, for each kind that
    has attacks."""
    dist = per_example["attack_distortion"]  # [n, A]
    black = np.asarray([a.black_box for a in attacks], bool)
    kinds = {"white_box": ~black, "black_box": black, "bundled": np.ones_like(black)}
    return {f"min_distortion_{kind}": np.min(dist[:, members], axis=1)
            for kind, members in kinds.items() if members.any()}


def curve_metrics(per_example: dict[str, np.ndarray], attacks: Sequence[Attack], norm: str) -> dict:
    """P(D) and D1/2 (white-box, black-box, bundled: from :func:`kind_distortions`' arrays),
    the failure-rate curve, per-attack contributions and robust accuracy vs compute, from the
    exact per-example values."""
    ok = per_example["clean_prediction"] == per_example["label"]
    grid = curves.distortion_grid(norm)
    oc, half = {"grid": grid.tolist()}, {}
    for key, d in kind_distortions(per_example, attacks).items():
        kind = key.removeprefix("min_distortion_")
        oc[kind] = curves.operating_characteristic(d, ok, grid).tolist()
        half[kind] = curves.half_distortion(d, ok)
    names = [a.name for a in attacks]
    out = {
        "operating_characteristic": oc,
        "half_distortion": half,
        "attack_contribution": curves.attack_contribution(
            per_example["attack_success"], per_example["winning_attack"], ok, names,
            per_example["winning_restart"],
        ),
        "gradients_per_example": int(sum(a.gradients for a in attacks)),
        "queries_per_example": int(sum(a.queries for a in attacks)),
        "robustness_vs_compute": curves.robustness_vs_compute(
            per_example["attack_success"], ok, [a.gradients + a.queries for a in attacks]
        ),
    }
    if "max_wrong_confidence" in per_example:
        out["failure_rate_curve"] = curves.failure_rate_curve(
            per_example["max_wrong_confidence"], per_example["clean_wrong_confidence"]
        )
    return out


