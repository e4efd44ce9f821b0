"""Metric reducers that merge like sums (clu.metrics style).

A reducer has ``empty``, ``from_result`` (per batch, inside or outside jit), ``merge`` (adds
counts: associative and commutative, with ``empty`` as identity, so 1 device and 256 devices,
one batch or many, give the same answer) and ``compute`` (turns counts into figures on the host).

Figures (over the real examples, mask True):

* clean accuracy = correct clean / n;
* robust accuracy (bundled) = correct under every candidate of every attack / n;
* Relative Robustness (Amich et al.) RR = correct under attack / correct clean × 100;
* the many-attack table (MAT): the robust accuracy of each attack alone;
* the worst-attack table figure (WAT): the lowest robust accuracy of any single attack;
* the failure rate of a confidence-thresholding defence at a few thresholds: wrong with at
  least that confidence inside the eps ball (when the max-confidence goal is tracked);
* white-box and black-box robust accuracy: the bundle of the white-box attacks alone and of the
  black-box (score- and decision-based) attacks alone, and the examples that only a black-box
  attack fooled -- a sign of gradient masking.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle import goals as goals_lib
from jaxbundle.bundler import BundleResult

__all__ = ["CONFIDENCE_THRESHOLDS", "Counts", "kind_success", "relative_robustness"]

CONFIDENCE_THRESHOLDS = (0.5, 0.7, 0.9, 0.99)


class Counts(NamedTuple):
    """Sums over examples; every field merges by addition (int32, exact)."""

    n: jax.Array  # real examples
    clean_correct: jax.Array
    robust_correct: jax.Array  # bundled: no candidate within eps fools the model
    attack_correct: jax.Array  # [A] each attack alone
    confident_failures: jax.Array  # [T] wrong with confidence >= threshold (max_confidence)
    kind_correct: jax.Array  # [2] correct under every white-box / every black-box attack
    black_box_only: jax.Array  # fooled by a black-box attack and by no white-box attack
    grid_judged: jax.Array  # judged on the 8-bit grid (the others in float32)

    @classmethod
    def empty(cls, num_attacks: int) -> "Counts":
        zero = jnp.zeros((), jnp.int32)
        return cls(
            n=zero,
            clean_correct=zero,
            robust_correct=zero,
            attack_correct=jnp.zeros((num_attacks,), jnp.int32),
            confident_failures=jnp.zeros((len(CONFIDENCE_THRESHOLDS),), jnp.int32),
            kind_correct=jnp.zeros((2,), jnp.int32),
            black_box_only=zero,
            grid_judged=zero,
        )

    @classmethod
    def from_result(
        cls,
        result: BundleResult,
        mask: jax.Array,
        eps: jax.Array | float,
        black_box: Sequence[bool] | None = None,
    ) -> "Counts":
        """Counts one batch; ``mask`` ``[B]`` is False on padding rows; ``black_box[a]`` says
        whether attack ``a`` is black-box (default: none is)."""
        m = jnp.asarray(mask, bool)
        count = lambda v: jnp.sum(v & jnp.broadcast_to(m, v.shape), axis=-1, dtype=jnp.int32)  # noqa: E731
        eps = jnp.broadcast_to(jnp.asarray(eps, jnp.float32), m.shape)
        clean_correct = ~result.clean.misclassified
        fooled = goals_lib.success("misclassify", result.best["misclassify"].score, eps)
        if "max_confidence" in result.best:
            s = result.best["max_confidence"].score
            ok = goals_lib.success("max_confidence", s, eps)
            thresholds = jnp.asarray(CONFIDENCE_THRESHOLDS, jnp.float32)[:, None]
            confident = count(ok[None, :] & (s.confidence[None, :] >= thresholds))
        else:
            confident = jnp.zeros((len(CONFIDENCE_THRESHOLDS),), jnp.int32)
        by_white, by_black = kind_success(result.attack_success, black_box)
        return cls(
            n=count(jnp.ones_like(m)),
            clean_correct=count(clean_correct),
            robust_correct=count(clean_correct & ~fooled),
            attack_correct=count(clean_correct[None, :] & ~result.attack_success),
            confident_failures=confident,
            kind_correct=count(clean_correct[None, :] & ~jnp.stack([by_white, by_black])),
            black_box_only=count(clean_correct & by_black & ~by_white),
            grid_judged=count(result.judged_on_grid),
        )

    def merge(self, other: "Counts") -> "Counts":
        """Adds the counts (jax or numpy arrays: numpy stays on the host)."""
        return jax.tree.map(lambda a, b: a + b, self, other)

    def compute(self, attack_names: Sequence[str], black_box: Sequence[bool] | None = None) -> dict:
        """Figures in percent; ``attack_names`` label the MAT rows; ``black_box`` as in
        :meth:`from_result` (a kind without attacks gets ``None``)."""
        c = jax.tree.map(np.asarray, self)
        n = int(c.n)
        if len(attack_names) != c.attack_correct.shape[0]:
            raise ValueError(
                f"{len(attack_names)} attack names for {c.attack_correct.shape[0]} attacks"
            )
        pct = lambda k: 100.0 * float(k) / n if n else float("nan")  # noqa: E731
        black = [False] * len(attack_names) if black_box is None else list(black_box)
        any_white, any_black = not all(black), any(black)
        mat = {name: pct(k) for name, k in zip(attack_names, c.attack_correct)}
        return {
            "n_examples": n,
            "clean_accuracy": pct(c.clean_correct),
            "robust_accuracy": pct(c.robust_correct),
            "relative_robustness": relative_robustness(int(c.robust_correct), int(c.clean_correct)),
            "mat": mat,
            "wat": min(mat.values()) if mat else None,
            "wat_attack": min(mat, key=mat.get) if mat else None,
            "confident_failure_rate": {
                f"{t:g}": pct(k) for t, k in zip(CONFIDENCE_THRESHOLDS, c.confident_failures)
            },
            "white_box_robust_accuracy": pct(c.kind_correct[0]) if any_white else None,
            "black_box_robust_accuracy": pct(c.kind_correct[1]) if any_black else None,
            "black_box_only": int(c.black_box_only),
            "grid_judged": int(c.grid_judged),
        }


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
