"""Fast Minimum-Norm attack, FMN (Pintor, Roli, Brendel & Biggio 2021, "Fast Minimum-norm
Adversarial Attacks through Adaptive Norm Constraints"), untargeted, Linf, L2 and L1.

A minimum-norm attack that runs projected gradient ascent inside an eps ball whose radius
``eps_k`` adapts per example. With the logit difference ``L = z_y - max_{j != y} z_j``
(adversarial iff ``L < 0``; here ``margin = -L`` from :func:`jaxbundle.core.losses.margin`), step
``k = 1..K`` (Algorithm 1) at ``x = x0 + delta``::

    g       = grad_delta margin(x0 + delta)                     (one gradient)
    gamma_k = h(gamma_0, gamma_K, k, K),  alpha_k = h(alpha_0, alpha_K, k, K)
    if x is adversarial:       best = min(best, ||delta||)       (delta*, the best so far)
                               eps_k = min(eps_{k-1} * (1 - gamma_k), best)
    elif none found yet:       eps_k = ||delta|| + |L| / ||g||_*  (first-order boundary estimate;
                                                  times 1 + gamma_k with boundary_slack)
    else:                      eps_k = eps_{k-1} * (1 + gamma_k)
    delta <- delta + alpha_k * g / ||g||_2                      (gradient-scaling step)
    delta <- Proj_{||.|| <= eps_k}(delta);  delta <- clip(x0 + delta) - x0

with cosine annealing ``h(v_0, v_K, k, K) = v_K + (v_0 - v_K) (1 + cos(k pi / K)) / 2`` and the
dual norm ``||.||_*`` (L1 for Linf, L2 for L2, Linf for L1). The L1 projection is the exact
Euclidean one (:func:`jaxbundle.core.norms.project_ball`). Every iterate is a candidate, so the
bundler's min-norm goal keeps ``delta*`` itself; the state only needs its norm.

Defaults: ``steps=100``, ``gamma_init=0.05``, ``gamma_final=0.001``,
``alpha_final=alpha_init / 100`` and ``alpha_init = 1.0`` for every norm, as in both
reference implementations (pralab/Fast-Minimum-Norm-Adversarial-Attack and
jeromerony/adversarial-library ``fmn``: ``alpha_init=1.0`` whatever the norm); a larger Linf
step, e.g. ``alpha_init=10.0``, can be passed (experiments/fidelity_cw_fmn_bp.py compares the
two on the demo model).

Details and deviations:

* ``boundary_slack`` (default on; a deviation): before the first adversarial, Algorithm 1 sets
  ``eps_k`` to the first-order boundary estimate itself. On a (locally) linear model that lands
  exactly on the boundary, and in float32 often a hair short of it (margin -1e-7), where the
  estimate then repeats forever and the example never becomes adversarial. With the slack
  ``eps_k = (1 + gamma_k) * estimate``; once an adversarial is found the shrink/grow phase
  (unchanged) refines it within ``gamma_K``.
  ``boundary_slack=False`` runs Algorithm 1 verbatim.
* The step is the paper's ``g / ||g||_2`` for every norm (not the norm's steepest-ascent
  direction: for L1 that is a single coordinate per step); the projection onto the eps_k ball
  makes it norm-specific.
* ``eps_k`` is capped by the largest perturbation the box allows, ``||max(x0, 1 - x0)||``, as in
  the authors' code, so a tiny gradient cannot make it infinite; ``eps_0 = 0`` (Algorithm 1).
* No adversarial initialisation (the paper's optional start from an adversarial point with a
  binary search): the attack starts from ``x0``. No restarts of the cosine schedule.
* "Adversarial" is ``margin > 0`` (strict), as in the bundler's per-step scoring.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxbundle.core import losses, norms
from jaxbundle.attacks.base import Attack, Candidate, WhiteBoxModel, check_count, white_box_attack

__all__ = ["FMNConfig", "FMNState", "DEFAULT_ALPHA_INIT", "cosine", "init", "step", "fmn"]

DEFAULT_ALPHA_INIT = {"l2": 1.0, "linf": 1.0, "l1": 1.0}  # both reference codes
_TINY = 1e-12


class FMNConfig(NamedTuple):
    norm: str  # "linf", "l2" or "l1"
    num_steps: int  # K, the length of the cosine schedules
    alpha_init: float  # alpha_0: first step size (of the L2-normalised gradient)
    alpha_final: float  # alpha_K: last step size
    gamma_init: float  # gamma_0: first relative change of eps_k
    gamma_final: float  # gamma_K: last relative change of eps_k
    boundary_slack: bool  # aim (1 + gamma_k) past the first-order boundary estimate


class FMNState(NamedTuple):
    x: jax.Array  # [B, ...] current iterate x0 + delta, in the box and the eps_k ball
    x0: jax.Array  # [B, ...] clean images
    y: jax.Array  # [B] labels
    eps: jax.Array  # [B] eps_k, the adaptive norm constraint (0 before the first step)
    best_norm: jax.Array  # [B] ||delta*||, smallest adversarial perturbation so far (inf: none)
    worst_norm: jax.Array  # [B] ||max(x0, 1 - x0)||, the largest perturbation the box allows
    k: jax.Array  # [B] int32 steps taken so far (the next step is k + 1)


def cosine(v0: float, vk: float, k: jax.Array, num_steps: int) -> jax.Array:
    """Cosine annealing ``h(v0, vK, k, K)``: ``v0`` at ``k = 0``, ``vK`` at ``k = K``."""
    k = jnp.asarray(k, jnp.float32)
    return vk + (v0 - vk) * 0.5 * (1.0 + jnp.cos(math.pi * k / num_steps))


def init(config: FMNConfig, keys, x0, y, eps, model, restart) -> FMNState:
    del keys, eps, model, restart
    batch = y.shape[0]
    return FMNState(
        x=x0,
        x0=x0,
        y=y,
        eps=jnp.zeros((batch,), jnp.float32),
        best_norm=jnp.full((batch,), jnp.inf, jnp.float32),
        worst_norm=norms.norm(jnp.maximum(x0, 1.0 - x0), config.norm),
        k=jnp.zeros((batch,), jnp.int32),
    )


def step(config: FMNConfig, state: FMNState, model: WhiteBoxModel):
    margin, grad, logits = model.loss_and_grad(losses.margin, state.x, state.y)
    k = state.k + 1
    gamma = cosine(config.gamma_init, config.gamma_final, k, config.num_steps)
    alpha = cosine(config.alpha_init, config.alpha_final, k, config.num_steps)

    delta = state.x - state.x0
    delta_norm = norms.norm(delta, config.norm)
    adversarial = margin > 0
    best_norm = jnp.where(adversarial, jnp.minimum(state.best_norm, delta_norm), state.best_norm)
    found = jnp.isfinite(best_norm)
    to_boundary = jnp.abs(margin) / jnp.maximum(norms.norm(grad, norms.DUAL[config.norm]), _TINY)
    estimate = delta_norm + to_boundary
    if config.boundary_slack:
        estimate = estimate * (1.0 + gamma)
    eps = jnp.where(
        adversarial,
        jnp.minimum(state.eps * (1.0 - gamma), best_norm),
        jnp.where(found, state.eps * (1.0 + gamma), estimate),
    )
    eps = jnp.minimum(eps, state.worst_norm)

    direction = norms.normalize(grad, "l2")
    delta = delta + norms.per_example(alpha, direction) * direction
    x_new = norms.project(state.x0 + delta, state.x0, eps, config.norm)
    new_state = state._replace(x=x_new, eps=eps, best_norm=best_norm, k=k)
    return new_state, Candidate(state.x, logits)


def fmn(
    norm: str = "l2",
    steps: int = 100,
    alpha_init: float | None = None,
    alpha_final: float | None = None,
    gamma_init: float = 0.05,
    gamma_final: float = 0.001,
    boundary_slack: bool = True,
    name: str | None = None,
) -> Attack:
    """FMN: minimum-norm attack by PGD in an adaptively shrinking or growing eps ball.

    The algorithm: :mod:`jaxbundle.attacks.white_box.fmn`. Paper: Pintor, Roli, Brendel & Biggio
    2021, "Fast Minimum-norm Adversarial Attacks through Adaptive Norm Constraints".

    Args:
      norm: ``"linf"``, ``"l2"`` or ``"l1"``.
      steps: gradient steps (one gradient each). Default 100.
      alpha_init: first step size; ``None``: 1.0 (the reference codes, every norm).
      alpha_final: last step size; ``None``: ``alpha_init / 100``.
      gamma_init, gamma_final: first and last relative eps update. Defaults 0.05 and 0.001.
      boundary_slack: before the first adversarial, set ``eps_k`` to ``(1 + gamma_k)`` times the
        first-order boundary estimate instead of the estimate itself (a deviation from
        Algorithm 1, see the module docstring); ``False`` runs Algorithm 1 verbatim.
      name: report name; default ``"fmn"``.

    Returns:
      An :class:`~jaxbundle.attacks.base.Attack` with ``goal="min_norm"``.
    """
    norms.check_norm(norm)
    check_count("fmn", "steps", steps)
    alpha_init = DEFAULT_ALPHA_INIT[norm] if alpha_init is None else alpha_init
    alpha_final = alpha_init / 100 if alpha_final is None else alpha_final
    for label, value in (("alpha_init", alpha_init), ("alpha_final", alpha_final)):
        if not 0.0 < value < float("inf"):
            raise ValueError(f"fmn {label} must be positive and finite, got {value!r}")
    for label, value in (("gamma_init", gamma_init), ("gamma_final", gamma_final)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"fmn {label} must be in [0, 1), got {value!r}")
    config = FMNConfig(norm, steps, float(alpha_init), float(alpha_final), float(gamma_init),
                       float(gamma_final), bool(boundary_slack))
    return white_box_attack(name or "fmn", norm, steps, init, step, config, goal="min_norm")
