"""DeepFool (Moosavi-Dezfooli, Fawzi & Frossard 2016, "DeepFool: a simple and accurate method
to fool deep neural networks"), untargeted, Linf and L2, a minimum-norm attack.

Each step linearises the model around the current iterate ``x`` for the true class ``y`` and a
fixed set of candidate classes ``j`` (the ``candidates`` classes other than ``y`` with the
highest *clean* logits, chosen once in ``init``)::

    f_j = z_j(x) - z_y(x)            w_j = grad_x f_j(x)
    l   = argmin_j |f_j| / ||w_j||_*                    (dual norm: L1 for Linf, L2 for L2)
    p   = |f_l| / ||w_l||_*  +  extra                  (the step's length; extra = 1e-4)
    r   = p * sign(w_l)                                 (Linf)
    r   = p * w_l / ||w_l||_2                           (L2)
    r_tot <- r_tot + r
    x   <- clip_[0,1](x0 + (1 + overshoot) * r_tot)

``r`` is the smallest perturbation that reaches the linearised boundary of class ``l``; the
overshoot multiplies the *total* perturbation, as in the paper (Sect. 3: "the final perturbation
vector r is multiplied by a constant 1 + eta"; default eta = 0.02), and every iterate is the
overshot one, where the next linearisation is taken. The paper stops once the label changes; on
a fixed-length ``lax.scan`` an example whose iterate is misclassified (margin > 0) is frozen:
its ``x`` and ``r_tot`` stay put while the step still runs for the batch. Examples misclassified
on the clean image are frozen at ``x0``. On a linear model the first step lands on the nearest
decision boundary times ``1 + overshoot`` (exact for two classes; for more classes exact too
when every other class is a candidate), which the tests check.

Gradient count (``gradients_per_step == candidates``): one forward pass and, with
``jax.vmap`` over ``jax.vjp``, one backward pass (vector-Jacobian product) per candidate, with
cotangent ``e_j - e_y``: the gradient of the *difference* ``z_j - z_y`` directly, so ``z_y`` is
never differentiated on its own. A backward pass is what the library counts as one gradient
(PGD's forward + backward counts 1).

The candidate count is static and exact: a model with ``K`` classes has only ``K - 1`` other
classes, so ``init`` raises ``ValueError`` at trace time when ``candidates > K - 1`` rather than
silently computing fewer gradients than ``gradients_per_step`` reports. Pass
``candidates=K - 1`` for small models (the default 9 fits 10-class data such as MNIST).

``extra`` is the reference code's ``1e-4`` added to each step's length "for numerical
stability" (LTS4/DeepFool, ``r_i = (pert + 1e-4) * w / ||w||``), not in the paper's algorithm.
Without it an iterate that lands exactly on a tie of two logits (``f_l = 0``, which happens on
piecewise-linear networks) gets a zero step and stays on the tie for every later step: the
overshoot scales ``r_tot``, which no longer changes. ``extra=0.0`` runs the paper's step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxbundle.core import losses, norms
from jaxbundle.attacks.base import Attack, Candidate, WhiteBoxModel, check_count, white_box_attack

__all__ = ["DeepFoolConfig", "DeepFoolState", "init", "step", "deepfool"]

_TINY = 1e-12  # floor for dual norms of zero gradients


class DeepFoolConfig(NamedTuple):
    norm: str  # "linf" or "l2"
    candidates: int  # other classes linearised per step (highest clean logits, y excluded)
    overshoot: float  # eta: x = x0 + (1 + eta) * r_tot
    extra: float  # added to each step's length (the reference's 1e-4)


class DeepFoolState(NamedTuple):
    x: jax.Array  # [B, ...] current iterate clip(x0 + (1 + eta) * r_tot), in the box
    x0: jax.Array  # [B, ...] clean images
    y: jax.Array  # [B] labels
    classes: jax.Array  # [B, C] int32 candidate classes, fixed from the clean logits
    r_tot: jax.Array  # [B, ...] accumulated perturbation, before overshoot and clipping


def init(config: DeepFoolConfig, keys, x0, y, eps, model: WhiteBoxModel, restart) -> DeepFoolState:
    del keys, eps, restart
    classes = top_classes(model.logits(x0), y, config.candidates, "deepfool")
    return DeepFoolState(x=x0, x0=x0, y=y, classes=classes, r_tot=jnp.zeros_like(x0))


def top_classes(logits: jax.Array, y: jax.Array, candidates: int, attack: str) -> jax.Array:
    """The ``candidates`` classes of highest logit other than the label, ``[B, C]`` int32; a
    ``ValueError`` at trace time where the model has fewer other classes (a gradient count
    must be exact, never silently smaller)."""
    num_classes = logits.shape[-1]
    if candidates > num_classes - 1:
        raise ValueError(
            f"{attack}(candidates={candidates}) needs a model with at least {candidates + 1} "
            f"classes, got {num_classes}; pass candidates={num_classes - 1} (the gradient "
            "count must be exact)"
        )
    hidden = jnp.where(jax.nn.one_hot(y, num_classes, dtype=bool), -jnp.inf, logits)
    return jax.lax.top_k(hidden, candidates)[1].astype(jnp.int32)


def boundary_distances(
    model: WhiteBoxModel, x: jax.Array, y: jax.Array, classes: jax.Array, norm: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The linearised distance, in ``norm``, from ``x`` to the boundary between ``y`` and each
    of ``classes``: ``|f_j| / ||w_j||_*`` (the dual norm), ``[B, C]``, with ``f = z_j - z_y``
    and ``w = grad f``; and the logits ``[B, K]`` and ``w`` ``[C, B, ...]``. One forward pass
    and ``C`` backward passes (``vmap`` of the VJP over the cotangents ``e_j - e_y``)."""
    logits, vjp = jax.vjp(model.logits, x)
    num_classes = logits.shape[-1]
    cotangents = jax.nn.one_hot(classes, num_classes, dtype=logits.dtype) - jax.nn.one_hot(
        y, num_classes, dtype=logits.dtype
    )[:, None, :]  # [B, C, K]
    (grads,) = jax.vmap(vjp)(jnp.moveaxis(cotangents, 1, 0))  # [C, B, ...]
    f = jnp.take_along_axis(logits, classes, axis=1) - jnp.take_along_axis(
        logits, y[:, None], axis=1
    )
    dual = jax.vmap(lambda g: norms.norm(g, norms.DUAL[norm]))(grads).T  # [B, C]
    return jnp.abs(f) / jnp.maximum(dual, _TINY), logits, grads


def step(config: DeepFoolConfig, state: DeepFoolState, model: WhiteBoxModel):
    dist, logits, grads = boundary_distances(model, state.x, state.y, state.classes,
                                             config.norm)  # dist [B, C]
    best = jnp.argmin(dist, axis=1)  # [B]
    w = jnp.moveaxis(grads, 0, 1)  # [B, C, ...]
    w = jnp.take_along_axis(w, best.reshape((-1, 1) + (1,) * (w.ndim - 2)), axis=1)[:, 0]
    length = jnp.take_along_axis(dist, best[:, None], axis=1)[:, 0] + config.extra  # [B] ||r||
    direction = jnp.sign(w) if config.norm == "linf" else norms.normalize(w, "l2")
    r = norms.per_example(length, w) * direction
    done = norms.per_example(losses.margin(logits, state.y) > 0, w)
    r_tot = jnp.where(done, state.r_tot, state.r_tot + r)
    moved = norms.project_box(state.x0 + (1.0 + config.overshoot) * r_tot)
    x_new = jnp.where(done, state.x, moved)
    return state._replace(x=x_new, r_tot=r_tot), Candidate(state.x, logits)


def deepfool(
    norm: str = "l2",
    steps: int = 50,
    candidates: int = 9,
    overshoot: float = 0.02,
    name: str | None = None,
    extra: float = 1e-4,
) -> Attack:
    """DeepFool: repeated steps to the nearest linearised decision boundary.

    The algorithm: :mod:`jaxbundle.attacks.white_box.deepfool`. Paper: Moosavi-Dezfooli, Fawzi &
    Frossard 2016, "DeepFool: a simple and accurate method to fool deep neural networks".

    Args:
      norm: ``"linf"`` or ``"l2"``.
      steps: iterations (the paper stops at the first misclassification; here misclassified
        examples are frozen for the remaining steps). Default 50.
      candidates: other classes linearised per step, those with the highest clean logits;
        the model needs at least ``candidates + 1`` classes (checked at trace time).
        ``gradients_per_step == candidates``. Default 9 (all other classes of 10).
      overshoot: eta, applied to the total perturbation. Default 0.02, the paper's.
      name: report name; default ``"deepfool"``.
      extra: added to each step's length, in the norm's units; default ``1e-4``, the reference
        code's (it moves an iterate off an exact tie of two logits); ``0.0``: the paper's step.

    Returns:
      An :class:`~jaxbundle.attacks.base.Attack` with ``goal="min_norm"``.
    """
    if norms.check_norm(norm) not in ("linf", "l2"):
        raise ValueError(f"deepfool supports norms 'linf' and 'l2', not {norm!r}")
    check_count("deepfool", "steps", steps)
    check_count("deepfool", "candidates", candidates)
    if not 0.0 <= overshoot < float("inf"):
        raise ValueError(f"deepfool overshoot must be finite and >= 0, got {overshoot!r}")
    if not 0.0 <= extra < float("inf"):
        raise ValueError(f"deepfool extra must be finite and >= 0, got {extra!r}")
    config = DeepFoolConfig(norm=norm, candidates=candidates, overshoot=float(overshoot),
                            extra=float(extra))
    return white_box_attack(name or "deepfool", norm, steps, init, step, config,
                            gradients_per_step=candidates, goal="min_norm")
