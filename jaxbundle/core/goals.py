"""Goals (criteria): which of two adversarial candidates is better, per example.

A candidate is summarised by a :class:`Score`. A goal is a :class:`Goal` record: its pure
``take(best, candidate, eps) -> bool[B]`` says, per example, whether the candidate replaces the
best one so far, and its other fields say whether it is bound by eps, what it needs scored,
when the attacker may stop and what per-example arrays the report keeps. The bundler, judge,
schedule and evaluator read only these fields, never a goal's name. Goals hold no state; one
bundle run can track several goals, each with its own best candidate, from the same stream of
candidates. A new goal is one more record in :data:`GOALS`. A candidate batch is wrapped as a
:class:`BestState` (:func:`candidate_state`) and folded into a goal's best (:func:`fold`, and
for several goals, restarts or verified images :func:`fold_all`, :func:`fold_each`,
:func:`fold_stacked`, :func:`cross_fold`).

Goals (``eps`` is the threat model's radius, per example):

``misclassify``
    Bundled error rate. A success is a misclassified candidate within eps. Keeps the candidate
    within eps with the highest success rate (the fraction of the judge's calls that
    misclassify it: 0 or 1 for a deterministic model, see :mod:`jaxbundle.core.sampling`), and
    among equal rates the largest margin ``max_{j != y} z_j - z_y``: a success (margin > 0) is
    never replaced by a failure, and among successes the one deepest inside a wrong class is
    kept, the one most likely to survive rounding to the pixel grid at verification.
``max_confidence``
    Failure rate of a confidence-thresholding defence (CleverHans' MaxConfidence). Keeps the
    candidate within eps with the highest probability on a wrong class.
``min_norm``
    Success-vs-distortion curve P(D) and RoBIC's half-distortion. Keeps the misclassified
    candidate of smallest distortion, whatever eps; before a success, the largest margin.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxbundle.core import losses, norms

__all__ = [
    "BestState",
    "Score",
    "Goal",
    "score",
    "within",
    "misclassify",
    "max_confidence",
    "min_norm",
    "GOALS",
    "success",
    "check_goals",
    "candidate_state",
    "cross_fold",
    "fold",
    "fold_all",
    "fold_each",
    "fold_stacked",
]

class Score(NamedTuple):
    """What a goal needs to know about one candidate per example (all ``[B]``)."""

    misclassified: jax.Array  # bool: argmax of the logits != label
    distortion: jax.Array  # float: ||x - x0|| in the threat model's norm
    confidence: jax.Array  # float: highest softmax probability on a wrong class
    margin: jax.Array  # float: max_{j != y} z_j - z_y (> 0 iff misclassified)
    prediction: jax.Array  # int32: argmax of the logits
    rate: jax.Array  # float: fraction of the model's calls that misclassify it (a
    #   deterministic model: misclassified as 0 or 1; a stochastic one: over the judge's calls,
    #   and ``misclassified`` is then ``rate > threshold``, the other fields call averages)


def score(
    x: jax.Array,
    logits: jax.Array,
    x0: jax.Array,
    y: jax.Array,
    norm: str,
    goals: tuple[str, ...] | None = None,
) -> Score:
    """Scores candidates ``x`` with their ``logits`` against clean ``x0`` and labels ``y``.

    With ``goals``, only what those goals compare is computed, for the bundler's per-step fold:
    ``misclassified`` is then ``margin > 0`` (the same but on exact ties, where it is the
    stricter reading), ``prediction`` is -1 and ``confidence`` is 0 unless ``max_confidence``
    is among them. Verification always rescores in full.
    """
    margin = losses.margin(logits, y)
    if goals is None:
        prediction = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        misclassified = prediction != y
    else:
        prediction = jnp.full(y.shape, -1, jnp.int32)
        misclassified = margin > 0
    if goals is None or any(GOALS[g].needs_confidence for g in goals):
        confidence = losses.wrong_class_confidence(logits, y)
    else:
        confidence = jnp.zeros(y.shape, jnp.float32)
    return Score(
        misclassified=misclassified,
        distortion=norms.norm(x - x0, norm),
        confidence=confidence,
        margin=margin,
        prediction=prediction,
        rate=misclassified.astype(jnp.float32),
    )


def within(s: Score, eps: jax.Array) -> jax.Array:
    """Whether the candidate lies inside the eps ball (:func:`jaxbundle.core.norms.ball_limit`)."""
    return s.distortion <= norms.ball_limit(eps)


def _take_misclassify(best: Score, cand: Score, eps: jax.Array) -> jax.Array:
    ok = within(cand, eps)
    better = (cand.rate > best.rate) | ((cand.rate == best.rate) & (cand.margin > best.margin))
    return ok & (~within(best, eps) | better)


def _take_max_confidence(best: Score, cand: Score, eps: jax.Array) -> jax.Array:
    best_ok = within(best, eps)
    ok = within(cand, eps)
    return ok & (~best_ok | (cand.confidence > best.confidence))


def _take_min_norm(best: Score, cand: Score, eps: jax.Array) -> jax.Array:
    del eps
    smaller = cand.distortion < best.distortion
    first = cand.misclassified & ~best.misclassified
    better = cand.misclassified & best.misclassified & smaller
    closer = ~cand.misclassified & ~best.misclassified & (cand.margin > best.margin)
    return first | better | closer


class Goal(NamedTuple):
    """Everything the library knows about one goal; every module reads it from :data:`GOALS`.

    * ``take(best, candidate, eps) -> bool [B]``: whether the candidate replaces the best;
    * ``bounded``: a success must lie inside the eps ball (judging then rounds into the ball
      and rejects what leaves it); unbounded (min-norm) goals keep any misclassified image;
    * ``needs_confidence``: the per-step fold must score the wrong-class confidence;
    * ``satisfied(score, eps, threshold) -> bool [B]``: the attacker may stop spending on the
      example (the cascade schedule); ``None`` where it never may (a smaller distortion is
      always better);
    * ``promise(score) -> [B]``: how close an unsatisfied example is (larger is closer);
    * ``per_example(score, eps) -> dict``: the per-example arrays the report keeps.
    """

    name: str
    take: Callable[[Score, Score, jax.Array], jax.Array]
    bounded: bool
    needs_confidence: bool
    satisfied: Callable[[Score, jax.Array, float | None], jax.Array] | None
    promise: Callable[[Score], jax.Array] | None
    per_example: Callable[[Score, jax.Array], dict[str, jax.Array]]


def _bounded_success(s: Score, eps: jax.Array) -> jax.Array:
    return s.misclassified & within(s, eps)


misclassify = Goal(
    name="misclassify",
    take=_take_misclassify,
    bounded=True,
    needs_confidence=False,
    satisfied=lambda s, eps, threshold: _bounded_success(s, eps),
    promise=lambda s: s.margin,
    per_example=lambda s, eps: {
        "adversarial_prediction": s.prediction,
        "success": _bounded_success(s, eps),
        "distortion": s.distortion,
    },
)
max_confidence = Goal(
    name="max_confidence",
    take=_take_max_confidence,
    bounded=True,
    needs_confidence=True,
    satisfied=lambda s, eps, threshold: _bounded_success(s, eps) & (s.confidence >= threshold),
    promise=lambda s: s.confidence,
    per_example=lambda s, eps: {
        "max_wrong_confidence": jnp.where(within(s, eps), s.confidence, 0.0)
    },
)
min_norm = Goal(
    name="min_norm",
    take=_take_min_norm,
    bounded=False,
    needs_confidence=False,
    satisfied=None,
    promise=None,
    per_example=lambda s, eps: {
        "min_distortion": jnp.where(s.misclassified, s.distortion, jnp.inf)
    },
)

GOALS: dict[str, Goal] = {g.name: g for g in (misclassify, max_confidence, min_norm)}


def success(goal: str, s: Score, eps: jax.Array) -> jax.Array:
    """Whether a best candidate counts as a successful attack for ``goal`` (``[B]`` bool):
    misclassified, and inside the eps ball when the goal is bounded."""
    return _bounded_success(s, eps) if GOALS[goal].bounded else s.misclassified


def check_goals(goals: tuple[str, ...] | list[str] | str) -> tuple[str, ...]:
    """Validates goal names; ``misclassify`` is always tracked and comes first."""
    if isinstance(goals, str):
        goals = (goals,)
    unknown = [g for g in goals if g not in GOALS]
    if unknown:
        raise ValueError(f"unknown goal(s) {unknown}; expected some of {sorted(GOALS)}")
    return ("misclassify",) + tuple(dict.fromkeys(g for g in goals if g != "misclassify"))


class BestState(NamedTuple):
    """The best candidate so far for one goal, per example (leading axis ``[B]``)."""

    x: jax.Array  # [B, ...] adversarial image
    score: Score  # its score (after verification: on the quantised image)
    attack: jax.Array  # int32 [B]: index of the attack that found it; -1 = the clean image
    restart: jax.Array  # int32 [B]: restart index within that attack
    step: jax.Array  # int32 [B]: iterate index within that restart (0 = start)


def fold(goal: str, eps: jax.Array, best: BestState, cand: BestState) -> BestState:
    """Keeps, per example, ``cand`` where ``goal`` prefers it to ``best``."""
    return norms.tree_where(GOALS[goal].take(best.score, cand.score, eps), cand, best)


def candidate_state(
    x: jax.Array,
    logits: jax.Array,
    x0: jax.Array,
    y: jax.Array,
    norm: str,
    origin: tuple[int | jax.Array, int | jax.Array, int | jax.Array],
    goals: tuple[str, ...] | None = None,
) -> BestState:
    """Wraps one candidate batch as a :class:`BestState` so that it can be folded.

    ``origin``: the ``(attack, restart, step)`` that made it (the clean image: ``(-1, 0, 0)``).
    ``goals``: score only what these goals compare (see :func:`jaxbundle.core.goals.score`).
    """
    batch = x.shape[0]
    attack, restart, step = (jnp.full((batch,), v, dtype=jnp.int32) for v in origin)
    return BestState(x=x, score=score(x, logits, x0, y, norm, goals), attack=attack,
                     restart=restart, step=step)


def fold_all(
    goal_names: tuple[str, ...], eps: jax.Array, best: dict[str, BestState], cand: BestState
) -> dict[str, BestState]:
    """Folds one candidate into every goal's best state."""
    return {g: fold(g, eps, best[g], cand) for g in goal_names}


def fold_each(
    goal_names: tuple[str, ...],
    eps: jax.Array,
    best: dict[str, BestState],
    cand: dict[str, BestState],
) -> dict[str, BestState]:
    """Folds each goal's candidate into that goal's best state."""
    return {g: fold(g, eps, best[g], cand[g]) for g in goal_names}


def fold_stacked(
    goal_names: tuple[str, ...], eps: jax.Array, stacked: dict[str, BestState]
) -> dict[str, BestState]:
    """Folds best states stacked on a leading axis (restarts) into one, in order."""
    first = jax.tree.map(lambda a: a[0], stacked)
    rest = jax.tree.map(lambda a: a[1:], stacked)

    def body(best, cand_by_goal):
        return fold_each(goal_names, eps, best, cand_by_goal), None

    best, _ = jax.lax.scan(body, first, rest)
    return best


def cross_fold(
    goal_names: tuple[str, ...], eps: jax.Array, verified: dict[str, BestState]
) -> dict[str, BestState]:
    """Offers every goal's verified image to every other goal.

    A verified image is a legitimate candidate for any goal. This matters after quantisation:
    the min-norm candidate sits on the decision boundary and rounding may undo it, while the
    misclassify goal's image, deeper inside the wrong class, survives.
    """
    out = {}
    for g in goal_names:
        best = verified[g]
        for h in goal_names:
            if h != g:
                best = fold(g, eps, best, verified[h])
        out[g] = best
    return out
