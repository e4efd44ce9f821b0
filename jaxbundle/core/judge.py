"""Judging: how a candidate becomes a verified success, the same for every attack.

A success is judged on what a user would actually submit, re-run through the model in float32:

* **On the 8-bit grid** for an example whose clean image is on it (8-bit data): the image is
  rounded to the nearest grid image inside the eps ball and the box
  (:func:`jaxbundle.core.norms.quantize`; a min-norm candidate, which ignores eps, by
  :func:`quantize_min_norm`). The grid holds fewer images than the ball: the largest
  distortion it allows is :func:`jaxbundle.core.norms.grid_radius` (whole levels, e.g. 7/255 for
  Linf eps 0.031), which every report states, and the bundler runs the attacks of these
  examples at that radius, so that no saturated perturbation has to be cut back by the
  rounding (at Linf 0.3, attacking at 0.3 and rounding to 76/255 judged 2 points more robust
  than attacking at 76/255).
* **In float32** for an example whose clean image is off the grid (resized, blurred or
  augmented data, where no 8-bit image is the clean image) and for every example under
  ``judging="float"``: the candidate as the attack made it.

Either way the judged image must lie in the box and (for goals bound to eps) the ball, give
finite logits and be misclassified, **and** the attack's own candidate must have been
misclassified: a success that only the judge's rounding or stretching produced is never
credited to an attack, and a black-box attack's image is judged exactly as it queried it (no
stretching), so query counts stay exact.

Modes (``judging=``): ``"auto"`` (default) as above; ``"grid"`` the same but every clean image
must be on the grid (a clear error otherwise); ``"float"`` everything in float32.

Every verdict (the clean prediction, the judged candidates) is computed with the model's matrix
products at float32 ``Precision.HIGHEST`` (:mod:`jaxbundle.core.arithmetic`), whatever the backend's
default (TF32 on GPUs, one bfloat16 pass on TPUs): the arithmetic a certificate is a statement
about, and the same on every backend. The attacks search at the default.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxbundle.core import arithmetic
from jaxbundle.core import goals as goals_lib
from jaxbundle.core import norms
from jaxbundle.attacks.base import WhiteBoxModel
from jaxbundle.core.goals import BestState

__all__ = [
    "JUDGING",
    "Problem",
    "STRETCH",
    "check_judging",
    "judged_on_grid",
    "quantize_min_norm",
    "judged_score",
    "verify",
    "rejudge",
    "held_out",
    "statement",
]

# Min-norm verification: stretch factors tried on a white-box perturbation before rounding it.
STRETCH = (1.0, 1.01, 1.03, 1.1, 1.3)
JUDGING = ("auto", "grid", "float")


def check_judging(judging: str) -> str:
    """Returns ``judging`` if it is a known judging mode, else raises ``ValueError``."""
    if judging not in JUDGING:
        raise ValueError(f"judging must be one of {JUDGING}, got {judging!r}")
    return judging


def judged_on_grid(x0: jax.Array, judging: str) -> jax.Array:
    """Per example ``[B]``: whether its candidates are judged on the 8-bit grid.

    ``"auto"`` and ``"grid"``: where the clean image is on the grid (:func:`norms.on_grid`;
    ``"grid"`` additionally requires every image to be, at the boundary); ``"float"``: never.
    """
    if check_judging(judging) == "float":
        return jnp.zeros(x0.shape[:1], bool)
    return norms.on_grid(x0)


def quantize_min_norm(
    model: WhiteBoxModel,
    x: jax.Array,
    x0: jax.Array,
    y: jax.Array,
    adversarial: jax.Array,
    stretch: Sequence[float] = STRETCH,
) -> jax.Array:
    """Rounds min-norm candidates to the pixel grid without losing them to the rounding.

    A minimum-norm candidate sits just past the decision boundary, where rounding each pixel
    to the nearest level often lands back on the clean side. Where the candidate itself is
    ``adversarial``, its perturbation is stretched by the smallest factor of ``stretch`` (the
    first is 1) whose rounded image is still misclassified (by 1 when none is), then rounded;
    elsewhere it is rounded as it is. The factors are tried in turn, each only while some
    example of the batch still needs a larger one: one forward pass where rounding loses no
    candidate, at most ``len(stretch)`` (none for ``stretch=(1.0,)``).
    """
    if tuple(stretch) == (1.0,):
        return norms.quantize(x, x0)
    factors = jnp.asarray(stretch, jnp.float32)

    def rounded(s):
        return norms.quantize(norms.project_box(x0 + s * (x - x0)), x0)

    def fooled(images):
        with arithmetic.stated():
            return jnp.argmax(model.logits(images), axis=-1) != y

    def next_factor(carry):
        i, chosen, need = carry
        images = rounded(factors[i])
        now = need & fooled(images)
        return i + 1, norms.tree_where(now, images, chosen), need & ~now

    first = rounded(factors[0])
    _, chosen, _ = jax.lax.while_loop(
        lambda carry: (carry[0] < factors.size) & jnp.any(carry[2]), next_factor,
        (jnp.int32(1), first, adversarial & ~fooled(first)))
    return chosen


def judged_score(
    model: WhiteBoxModel, x: jax.Array, x0: jax.Array, y: jax.Array, norm: str
) -> tuple[goals_lib.Score, jax.Array]:
    """The judge's score of images ``x`` and whether all their logits are finite (``[B]``).

    A deterministic model: one call. A stochastic one: each of the judge's calls
    (``model.samples`` of them, the same keys for every image of an example) scored alone; the
    success rate is the fraction of calls that misclassify, ``misclassified`` is ``rate >
    threshold`` (the model's, :class:`jaxbundle.core.sampling.Stochastic`), margin and
    wrong-class confidence are the calls' means and the prediction is the class of highest
    mean probability. The model's matrix products run at
    :data:`jaxbundle.core.arithmetic.PRECISION`.
    """
    with arithmetic.stated():
        samples = model.sample_logits(x)  # [S, B, K]
    finite = jnp.all(jnp.isfinite(samples), axis=(0, 2))
    if not model.stochastic:
        return goals_lib.score(x, samples[0], x0, y, norm), finite
    per_call = jax.vmap(lambda z: goals_lib.score(x, z, x0, y, norm))(samples)
    rate = jnp.mean(per_call.misclassified.astype(jnp.float32), axis=0)
    mean_probability = jnp.mean(jax.nn.softmax(samples, axis=-1), axis=0)
    return goals_lib.Score(
        misclassified=rate > model.apply_fn.threshold,
        distortion=per_call.distortion[0],
        confidence=jnp.mean(per_call.confidence, axis=0),
        margin=jnp.mean(per_call.margin, axis=0),
        prediction=jnp.argmax(mean_probability, axis=-1).astype(jnp.int32),
        rate=rate,
    ), finite


class Problem(NamedTuple):
    """One batch as the attacks aim at it and the judge calls the model, built once per
    program (:func:`jaxbundle.core.bundler.problem`)."""

    model: WhiteBoxModel  # the model as the judge calls it
    x: jax.Array  # [B, ...] float32 clean images
    y: jax.Array  # [B] int32 labels
    eps: jax.Array  # [B] the radius the attacks aim at (on the grid: whole levels)
    grid: jax.Array  # [B] bool: judged on the 8-bit grid (:func:`judged_on_grid`)
    keys: jax.Array | None = None  # [B] the examples' keys (per_example_keys)


def verify(best: BestState, goal: str, p: Problem, norm: str, clean: BestState,
           stretch: Sequence[float] = STRETCH) -> BestState:
    """Judges a best state on what a user would submit, in the batch ``p``.

    Examples judged on the grid (``p.grid``) get their image rounded to the 8-bit grid: for
    goals bound to eps, the nearest grid image inside the ball and the box
    (:func:`jaxbundle.core.norms.quantize`); for min-norm, :func:`quantize_min_norm` with
    ``stretch``. The others are judged as they are, in float32. The judged image is re-run
    through the model in float32 and rescored. A candidate outside the box, with non-finite
    logits, or (for eps-bound goals) outside the ball gets the worst score (not misclassified,
    margin -inf, distortion inf), so that it never wins a fold.

    Nothing is credited that the attack did not find: where the judged image is misclassified
    but the attack's own candidate was not (the rounding alone flipped it), the example falls
    back to ``clean``, the clean image's state. A stochastic model is judged over the judge's
    calls (:func:`judged_score`), which are then the only authority: the attack's own view of
    its candidate is one noisy draw. (The winner these calls choose is then re-judged on
    held-out calls: :func:`rejudge`.)
    """
    model, x0, y, eps, grid = p.model, p.x, p.y, p.eps, p.grid
    bounded = goals_lib.GOALS[goal].bounded
    if bounded:
        rounded = norms.quantize(best.x, x0, eps, norm)
    else:
        rounded = quantize_min_norm(model, best.x, x0, y, best.score.misclassified & grid,
                                    stretch)
    x = jnp.where(norms.per_example(grid, x0), rounded, best.x)
    judged = best._replace(x=x, score=_checked_score(model, x, x0, y, eps, norm, bounded))
    credited = ~judged.score.misclassified | best.score.misclassified | model.stochastic
    return norms.tree_where(credited, judged, clean)


def _checked_score(model: WhiteBoxModel, x: jax.Array, x0: jax.Array, y: jax.Array,
                   eps: jax.Array, norm: str, bounded: bool) -> goals_lib.Score:
    """The judge's score of ``x`` (:func:`judged_score`), or the worst score where ``x`` is
    outside the box, gives non-finite logits or (``bounded``) lies outside the eps ball."""
    s, finite = judged_score(model, x, x0, y, norm)
    flat = x.reshape(x.shape[0], -1)
    valid = jnp.all((flat >= 0.0) & (flat <= 1.0), axis=1) & finite
    if bounded:
        valid &= goals_lib.within(s, eps)
    # An invalid image must never win a fold for any goal: worst possible score.
    invalid = goals_lib.Score(
        misclassified=jnp.zeros_like(s.misclassified),
        distortion=jnp.full_like(s.distortion, jnp.inf),
        confidence=jnp.zeros_like(s.confidence),
        margin=jnp.full_like(s.margin, -jnp.inf),
        prediction=s.prediction,
        rate=jnp.zeros_like(s.rate),
    )
    return norms.tree_where(valid, s, invalid)


def rejudge(best: BestState, goal: str, model: WhiteBoxModel, x0: jax.Array, y: jax.Array,
            eps: jax.Array, norm: str) -> BestState:
    """A chosen best state re-judged on other calls: a stochastic model's winner under the
    held-out calls ``model`` makes (:func:`jaxbundle.core.sampling.heldout_keys`), so that its rate
    is not the maximum of the rates it was chosen by.

    The image is the one :func:`verify` judged (already rounded where it is judged on the grid)
    and is not changed; it is re-checked (box, finite logits, and the ball for goals bound to
    eps) and rescored, an invalid one getting the worst score (not misclassified, rate 0).
    ``model.samples`` passes per example.
    """
    bounded = goals_lib.GOALS[goal].bounded
    return best._replace(score=_checked_score(model, best.x, x0, y, eps, norm, bounded))


def held_out(best: dict[str, BestState], model: WhiteBoxModel, x0: jax.Array, y: jax.Array,
             eps: jax.Array, norm: str) -> tuple[dict[str, BestState], goals_lib.Score]:
    """Every goal's winner (:func:`rejudge`) and the clean image re-judged under ``model``, a
    stochastic model under the held-out keys (:func:`jaxbundle.core.sampling.heldout_keys`), which
    neither the attacks nor the choice of the winners saw: on the calls that chose it, a
    winner's rate is the largest of its candidates' rates, biased upward; on fresh calls it is
    unbiased. ``model.samples * (goals + 1)`` model passes per example."""
    clean, _ = judged_score(model, x0, x0, y, norm)
    return {g: rejudge(b, g, model, x0, y, eps, norm) for g, b in best.items()}, clean


def statement(judging: str, eps: float, norm: str, n_grid: int, n: int) -> str:
    """One line for reports: how ``n`` examples were judged and the radius the judging allows,
    e.g. ``"eps 0.031 (linf): 1000 of 1000 examples judged on the 8-bit grid, which allows
    7/255 = 0.02745"``."""
    check_judging(judging)
    parts = []
    if n_grid:
        r = norms.grid_radius(eps, norm)
        if norm == "l2":
            allows = f"sqrt({round((r * norms.PIXEL_LEVELS) ** 2)})/255 = {r:.4g}"
        else:
            allows = f"{round(r * norms.PIXEL_LEVELS)}/255 = {r:.4g}"
        parts.append(f"{n_grid} of {n} examples judged on the 8-bit grid, which allows {allows}")
    if n - n_grid:
        why = "judging='float'" if judging == "float" else "clean images off the 8-bit grid"
        parts.append(f"{n - n_grid} of {n} judged in float32 ({why}), radius {eps:g}")
    return f"eps {eps:g} ({norm}): " + "; ".join(parts)
