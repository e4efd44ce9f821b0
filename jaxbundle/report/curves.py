"""Robustness curves from per-example results: P(D), D1/2, failure rate vs confidence, and more.

All of these work on the per-example arrays a bundle run produces (``[n]`` numpy or jax arrays):

* **Operating characteristic** ``P(D)`` (RoBIC, Pautrat et al. 2021): among the examples the
  model classifies correctly, the fraction fooled within distortion ``D``, from the min-norm
  goal's smallest adversarial distortion per example (``inf`` where none was found). The clean
  error is reported apart. It is computed on the host from the exact per-example values,
  which every evaluation gathers anyway (and writes to disk), on the fixed grid of
  :func:`distortion_grid`.
* **Half-distortion** ``D1/2``: the smallest ``D`` with ``P(D) >= 1/2``, the ``ceil(m/2)``-th
  smallest distortion of the ``m`` correct examples. When fewer than half are ever fooled it is
  infinite, and reported as ``inf`` with ``fooled_fraction`` beside it, never as NaN.
* **Failure rate vs confidence threshold** (CleverHans' success-fail curve): for thresholds
  ``t`` in [0.5, 1], the fraction of examples with a wrong prediction of confidence >= t within
  eps (from the max-confidence goal), and the same on the clean images.
* **Per-attack contribution**: how many examples each attack won in the bundle, and how many
  only it fooled (lost if it were dropped).
* **Robust accuracy vs compute**: the bundled robust accuracy after the first k attacks of the
  bundle, against the gradients and queries spent so far.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = [
    "distortion_grid",
    "operating_characteristic",
    "half_distortion",
    "failure_rate_curve",
    "attack_contribution",
    "robustness_vs_compute",
    "CONFIDENCE_GRID",
]

CONFIDENCE_GRID = tuple(np.round(np.linspace(0.5, 1.0, 51), 3).tolist())


def distortion_grid(norm: str, size: int = 200) -> np.ndarray:
    """A fixed grid of distortions for ``P(D)`` counts: Linf [0, 1], L2 [0, 10], L1 [0, 100]."""
    top = {"linf": 1.0, "l2": 10.0, "l1": 100.0}[norm]
    return np.linspace(0.0, top, size + 1, dtype=np.float32)[1:]


def operating_characteristic(
    distortion: np.ndarray, clean_correct: np.ndarray, grid: np.ndarray
) -> np.ndarray:
    """``P(D)`` at each ``D`` of ``grid`` from exact per-example values: the fraction of the
    correctly classified examples fooled with distortion ``<= D`` (zeros with none correct)."""
    d = np.sort(np.asarray(distortion, np.float64)[np.asarray(clean_correct, bool)])
    if d.size == 0:
        return np.zeros(np.shape(grid))
    return np.searchsorted(d, np.asarray(grid, np.float64), side="right") / d.size


def half_distortion(distortion: np.ndarray, clean_correct: np.ndarray) -> dict:
    """RoBIC's ``D1/2``: the smallest ``D`` with ``P(D) >= 1/2`` over the correct examples.

    Returns ``{"d_half": float (inf when under half are ever fooled; None with no correct
    example), "fooled_fraction": float, "n_correct": int}``.
    """
    d = np.sort(np.asarray(distortion, np.float64)[np.asarray(clean_correct, bool)])
    m = d.size
    if m == 0:
        return {"d_half": None, "fooled_fraction": 0.0, "n_correct": 0}
    return {
        "d_half": float(d[math.ceil(m / 2) - 1]),
        "fooled_fraction": float(np.isfinite(d).mean()),
        "n_correct": int(m),
    }


def failure_rate_curve(
    max_wrong_confidence: np.ndarray,
    clean_wrong_confidence: np.ndarray,
    thresholds: Sequence[float] = CONFIDENCE_GRID,
) -> dict:
    """Fraction of examples wrong with confidence >= t: under attack (within eps) and clean.

    ``max_wrong_confidence``: per example, the highest wrong-class probability the
    max-confidence goal found within eps (0 if none); ``clean_wrong_confidence``: the clean
    image's top probability where it is misclassified, else 0.
    """
    t = np.asarray(thresholds, np.float64)[:, None]
    attacked = np.asarray(max_wrong_confidence, np.float64)[None, :]
    clean = np.asarray(clean_wrong_confidence, np.float64)[None, :]
    return {
        "thresholds": t[:, 0].tolist(),
        "attacked": (attacked >= t).mean(axis=1).tolist(),
        "clean": (clean >= t).mean(axis=1).tolist(),
    }


def attack_contribution(
    attack_success: np.ndarray, winning_attack: np.ndarray, clean_correct: np.ndarray,
    attack_names: Sequence[str], winning_restart: np.ndarray | None = None,
) -> dict:
    """Per attack: examples it won in the bundle (and by which restart), and examples only it
    fooled (lost if it were dropped).

    ``attack_success`` ``[n, A]`` (each attack alone, verified), ``winning_attack`` and
    ``winning_restart`` ``[n]`` (index, -1 for none), over the correctly classified examples.
    """
    ok = np.asarray(clean_correct, bool)
    succ = np.asarray(attack_success, bool)[ok]
    win = np.asarray(winning_attack)[ok]
    others = succ.sum(axis=1, keepdims=True) - succ  # how many other attacks fooled it
    out = {}
    for a, name in enumerate(attack_names):
        out[name] = {"won": int(np.sum(win == a)),
                     "only_this": int(np.sum(succ[:, a] & (others[:, a] == 0)))}
        if winning_restart is not None:
            restarts = np.asarray(winning_restart)[ok][win == a]
            out[name]["won_by_restart"] = {
                str(r): int(c) for r, c in zip(*np.unique(restarts, return_counts=True))
            }
    return out


def robustness_vs_compute(
    attack_success: np.ndarray, clean_correct: np.ndarray, costs: Sequence[int]
) -> dict:
    """Bundled robust accuracy (%) after the first k attacks, against the cumulative cost.

    ``costs[a]``: gradients (or queries) attack ``a`` spends per example.
    """
    ok = np.asarray(clean_correct, bool)
    succ = np.asarray(attack_success, bool)
    n = ok.size
    fooled = np.zeros(n, bool)
    cost, acc = [0], [100.0 * ok.mean() if n else 0.0]
    for a in range(succ.shape[1]):
        fooled |= succ[:, a]
        cost.append(cost[-1] + int(costs[a]))
        acc.append(100.0 * float(np.mean(ok & ~fooled)) if n else 0.0)
    return {"cost": cost, "robust_accuracy": acc}
