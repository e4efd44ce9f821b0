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

from jaxbundle.report import curves
from jaxbundle.core import goals as goals_lib
from jaxbundle.attacks.base import Attack
from jaxbundle.core.bundler import BundleResult
from jaxbundle.report.metrics import kind_success

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


def _tracked_goals(per_example: dict[str, np.ndarray]) -> list[str]:
    """The goals whose per-example arrays ``per_example`` holds (misclassify always)."""
    empty = np.zeros(0, np.float32)
    dummy = goals_lib.Score(empty.astype(bool), empty, empty, empty, empty.astype(np.int32),
                            empty)
    return [g for g, goal in goals_lib.GOALS.items()
            if g == "misclassify" or set(goal.per_example(dummy, empty)) <= set(per_example)]


def stochastic_metrics(apply_fn: Any, attacks: Sequence[Attack],
                       per_example: dict[str, np.ndarray]) -> dict:
    """How a stochastic model was judged, and its robust accuracy at other success-rate
    thresholds (from the same per-example best candidates, chosen by their rate on the judge's
    calls, every rate on the held-out calls that re-judged them)."""
    rate, clean = per_example["success_rate"], per_example["clean_success_rate"]
    selection = per_example.get("selection_success_rate", rate)
    n = max(len(rate), 1)
    at = lambda t: float(np.sum((clean <= t) & (rate <= t)) / n)  # noqa: E731
    mean = lambda a: float(np.mean(a)) if len(a) else 0.0  # noqa: E731
    calls = apply_fn.calls
    return {
        "calls": calls,
        "threshold": apply_fn.threshold,
        "eot": {a.name: a.eot for a in attacks},
        "statement": (
            f"stochastic model: each candidate judged over {calls} fresh calls the attacks "
            "never saw, and each example's best candidate (the one with the highest success "
            f"rate) and clean image re-judged on {calls} held-out calls the choice never saw; "
            "the success rates and the robust accuracy reported are the held-out ones (mean "
            f"success rate {mean(rate):.3f} held out, {mean(selection):.3f} on the calls that "
            f"chose the winners), an example counting as fooled when more than "
            f"{apply_fn.threshold:g} of the held-out calls misclassify its best candidate"
        ),
        "mean_success_rate": mean(rate),
        "mean_selection_success_rate": mean(selection),
        "mean_clean_success_rate": mean(clean),
        "heldout_calls_per_example": calls * (len(_tracked_goals(per_example)) + 1),
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


