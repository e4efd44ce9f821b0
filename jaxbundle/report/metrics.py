"""Metric reducers that merge like sums (clu.metrics style).

Each metric is one class owning its whole computation: ``empty(setting)``, ``from_result``
(per batch, inside or outside jit), ``merge`` (adds counts: associative and commutative, with
``empty`` as identity, so 1 device and 256 devices, one batch or many, give the same answer) and
``compute(setting)`` (turns counts into figures on the host). :class:`Counts` is the collection
of the metrics a run tracks (:data:`METRICS`, less those whose goal is not tracked); it merges,
computes and checkpoints them generically, so a new metric is one class and one entry in
:data:`METRICS`.

Figures (over the real examples, mask True):

* clean accuracy = correct clean / n;
* robust accuracy (bundled) = correct under every candidate of every attack / n;
* Relative Robustness (Amich et al.) RR = correct under attack / correct clean × 100;
* the many-attack table (MAT): the robust accuracy of each attack alone;
* the worst-attack table figure (WAT): the lowest robust accuracy of any single attack;
* the failure rate of a confidence-thresholding defence at a few thresholds: wrong with at
  least that confidence inside the eps ball (only when the max-confidence goal is tracked:
  without it no candidate was chosen for its confidence, and no figure is reported);
* white-box and black-box robust accuracy: the bundle of the white-box attacks alone and of the
  black-box (score- and decision-based) attacks alone, and the examples that only a black-box
  attack fooled -- a sign of gradient masking;
* how many examples were judged on the 8-bit grid.

The curves (P(D), D1/2, the failure-rate curve) need every example's exact value and are
computed from the gathered per-example arrays (:mod:`jaxbundle.report.curves`), not reduced here.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle.core import goals as goals_lib
from jaxbundle.core.bundler import BundleResult

__all__ = [
    "CONFIDENCE_THRESHOLDS",
    "METRICS",
    "Accuracy",
    "AttackTable",
    "ConfidentFailures",
    "Counts",
    "GridJudged",
    "Setting",
    "ThreatModels",
    "kind_success",
    "relative_robustness",
]

CONFIDENCE_THRESHOLDS = (0.5, 0.7, 0.9, 0.99)


class Setting(NamedTuple):
    """What the metrics know of a run (static): the attacks' names and kinds, the goals."""

    attack_names: tuple[str, ...]
    black_box: tuple[bool, ...]  # per attack: score- or decision-based
    goals: tuple[str, ...] = ("misclassify",)

    @classmethod
    def of(cls, attacks: Sequence[Any], goals: Sequence[str] = ("misclassify",)) -> "Setting":
        """The setting of a bundle of :class:`~jaxbundle.attacks.base.Attack` objects."""
        return cls(tuple(a.name for a in attacks), tuple(bool(a.black_box) for a in attacks),
                   tuple(goals))


def _count(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Real examples (``mask``) where ``values`` (``[..., B]`` bool) holds, as int32."""
    return jnp.sum(values & jnp.broadcast_to(mask, values.shape), axis=-1, dtype=jnp.int32)


def _percent(count: Any, n: int) -> float:
    return 100.0 * float(count) / n if n else float("nan")


def _add(self, other):
    """Adds the counts field by field (jax or numpy arrays: numpy stays on the host)."""
    return jax.tree.map(lambda a, b: a + b, self, other)


def _zeros(*shapes: tuple[int, ...]) -> list[jax.Array]:
    return [jnp.zeros(shape, jnp.int32) for shape in shapes]


class Accuracy(NamedTuple):
    """Clean accuracy, bundled robust accuracy and Relative Robustness."""

    n: jax.Array  # real examples
    clean_correct: jax.Array
    robust_correct: jax.Array  # bundled: no candidate within eps fools the model
    goal = None  # tracked whatever the goals

    @classmethod
    def empty(cls, setting: Setting) -> "Accuracy":
        return cls(*_zeros((), (), ()))

    @classmethod
    def from_result(cls, result: BundleResult, mask, eps, setting: Setting) -> "Accuracy":
        clean = ~result.clean.misclassified
        fooled = goals_lib.success("misclassify", result.best["misclassify"].score, eps)
        return cls(_count(jnp.ones_like(mask), mask), _count(clean, mask),
                   _count(clean & ~fooled, mask))

    merge = _add

    def compute(self, setting: Setting) -> dict:
        n = int(self.n)
        return {
            "n_examples": n,
            "clean_accuracy": _percent(self.clean_correct, n),
            "robust_accuracy": _percent(self.robust_correct, n),
            "relative_robustness": relative_robustness(int(self.robust_correct),
                                                       int(self.clean_correct)),
        }


class AttackTable(NamedTuple):
    """The many-attack table (each attack alone) and its worst column (WAT)."""

    n: jax.Array
    attack_correct: jax.Array  # [A] correct under each attack alone
    goal = None

    @classmethod
    def empty(cls, setting: Setting) -> "AttackTable":
        return cls(*_zeros((), (len(setting.attack_names),)))

    @classmethod
    def from_result(cls, result: BundleResult, mask, eps, setting: Setting) -> "AttackTable":
        clean = ~result.clean.misclassified
        return cls(_count(jnp.ones_like(mask), mask),
                   _count(clean[None, :] & ~result.attack_success, mask))

    merge = _add

    def compute(self, setting: Setting) -> dict:
        n, correct = int(self.n), np.asarray(self.attack_correct)
        if len(setting.attack_names) != correct.shape[0]:
            raise ValueError(f"{len(setting.attack_names)} attack names for {correct.shape[0]} "
                             "attacks")
        mat = {name: _percent(k, n) for name, k in zip(setting.attack_names, correct)}
        return {
            "mat": mat,
            "wat": min(mat.values()) if mat else None,
            "wat_attack": min(mat, key=mat.get) if mat else None,
        }


class ThreatModels(NamedTuple):
    """The bundle of the white-box attacks alone, of the black-box ones alone, and the examples
    only a black-box attack fooled."""

    n: jax.Array
    kind_correct: jax.Array  # [2] correct under every white-box / every black-box attack
    black_box_only: jax.Array  # fooled by a black-box attack and by no white-box attack
    goal = None

    @classmethod
    def empty(cls, setting: Setting) -> "ThreatModels":
        return cls(*_zeros((), (2,), ()))

    @classmethod
    def from_result(cls, result: BundleResult, mask, eps, setting: Setting) -> "ThreatModels":
        clean = ~result.clean.misclassified
        by_white, by_black = kind_success(result.attack_success, setting.black_box)
        return cls(_count(jnp.ones_like(mask), mask),
                   _count(clean[None, :] & ~jnp.stack([by_white, by_black]), mask),
                   _count(clean & by_black & ~by_white, mask))

    merge = _add

    def compute(self, setting: Setting) -> dict:
        n = int(self.n)
        any_white, any_black = not all(setting.black_box), any(setting.black_box)
        return {
            "white_box_robust_accuracy": _percent(self.kind_correct[0], n) if any_white else None,
            "black_box_robust_accuracy": _percent(self.kind_correct[1], n) if any_black else None,
            "black_box_only": int(self.black_box_only),
        }


class ConfidentFailures(NamedTuple):
    """The failure rate of a confidence-thresholding defence: examples the max-confidence best
    misclassifies inside the ball with at least each of :data:`CONFIDENCE_THRESHOLDS`."""

    n: jax.Array
    failures: jax.Array  # [T]
    goal = "max_confidence"  # tracked only with this goal

    @classmethod
    def empty(cls, setting: Setting) -> "ConfidentFailures":
        return cls(*_zeros((), (len(CONFIDENCE_THRESHOLDS),)))

    @classmethod
    def from_result(cls, result: BundleResult, mask, eps, setting: Setting) -> "ConfidentFailures":
        score = result.best["max_confidence"].score
        ok = goals_lib.success("max_confidence", score, eps)
        thresholds = jnp.asarray(CONFIDENCE_THRESHOLDS, jnp.float32)[:, None]
        return cls(_count(jnp.ones_like(mask), mask),
                   _count(ok[None, :] & (score.confidence[None, :] >= thresholds), mask))

    merge = _add

    def compute(self, setting: Setting) -> dict:
        n = int(self.n)
        return {"confident_failure_rate": {
            f"{t:g}": _percent(k, n) for t, k in zip(CONFIDENCE_THRESHOLDS, self.failures)}}


class GridJudged(NamedTuple):
    """How many examples were judged on the 8-bit grid (the others in float32)."""

    grid_judged: jax.Array
    goal = None

    @classmethod
    def empty(cls, setting: Setting) -> "GridJudged":
        return cls(*_zeros(()))

    @classmethod
    def from_result(cls, result: BundleResult, mask, eps, setting: Setting) -> "GridJudged":
        return cls(_count(result.judged_on_grid, mask))

    merge = _add

    def compute(self, setting: Setting) -> dict:
        return {"grid_judged": int(self.grid_judged)}


#: Every metric, by the name its counts are checkpointed under. A metric whose ``goal`` is not
#: ``None`` is tracked only in runs that track that goal.
METRICS: dict[str, type] = {
    "accuracy": Accuracy,
    "attack_table": AttackTable,
    "threat_models": ThreatModels,
    "confident_failures": ConfidentFailures,
    "grid_judged": GridJudged,
}


def _tracked(setting: Setting) -> dict[str, type]:
    return {name: m for name, m in METRICS.items() if m.goal is None or m.goal in setting.goals}


class Counts(NamedTuple):
    """The reducers of one run, by name (a pytree: summed across batches and devices)."""

    metrics: dict[str, Any]

    @classmethod
    def empty(cls, setting: Setting) -> "Counts":
        return cls({name: m.empty(setting) for name, m in _tracked(setting).items()})

    @classmethod
    def from_result(cls, result: BundleResult, mask: jax.Array, eps: jax.Array | float,
                    setting: Setting) -> "Counts":
        """Counts one batch; ``mask`` ``[B]`` is False on padding rows."""
        if len(setting.black_box) != result.attack_success.shape[0]:
            raise ValueError(f"a setting of {len(setting.black_box)} attacks for a result of "
                             f"{result.attack_success.shape[0]}")
        missing = set(setting.goals) - set(result.best)
        if missing:
            raise ValueError(f"the setting tracks goals {sorted(missing)} the result lacks")
        mask = jnp.asarray(mask, bool)
        eps = jnp.broadcast_to(jnp.asarray(eps, jnp.float32), mask.shape)
        return cls({name: m.from_result(result, mask, eps, setting)
                    for name, m in _tracked(setting).items()})

    def merge(self, other: "Counts") -> "Counts":
        if self.metrics.keys() != other.metrics.keys():
            raise ValueError(f"cannot merge counts of metrics {sorted(self.metrics)} and "
                             f"{sorted(other.metrics)}")
        return Counts({name: m.merge(other.metrics[name]) for name, m in self.metrics.items()})

    def compute(self, setting: Setting) -> dict:
        """Every tracked metric's figures (percentages; see the module docstring)."""
        figures: dict = {}
        for metric in jax.tree.map(np.asarray, self).metrics.values():
            figures.update(metric.compute(setting))
        return figures

    def arrays(self) -> dict[str, np.ndarray]:
        """Flat ``{"<metric>.<field>": array}``, what a checkpoint stores."""
        return {f"{name}.{field}": np.asarray(value)
                for name, metric in self.metrics.items()
                for field, value in zip(metric._fields, metric)}

    def read(self, arrays: Mapping[str, np.ndarray]) -> "Counts":
        """Counts of the same metrics read back from :meth:`arrays`'s output (a dict or an
        open npz); a missing entry is a ``KeyError`` naming it."""
        return Counts({name: type(m)(*(np.asarray(arrays[f"{name}.{field}"])
                                       for field in m._fields))
                       for name, m in self.metrics.items()})


def kind_success(
    attack_success: jax.Array, black_box: Sequence[bool] | None
) -> tuple[jax.Array, jax.Array]:
    """Per example (``[B]`` bool): fooled by some white-box attack, by some black-box attack."""
    num = attack_success.shape[0]
    black = jnp.asarray([False] * num if black_box is None else list(black_box), bool)[:, None]
    by_white = jnp.any(attack_success & ~black, axis=0)
    by_black = jnp.any(attack_success & black, axis=0)
    return by_white, by_black


def relative_robustness(correct_under_attack: int, correct_clean: int) -> float | None:
    """RR = correct under attack / correct clean × 100; ``None`` when no example is correct."""
    if correct_clean == 0:
        return None
    return 100.0 * correct_under_attack / correct_clean
