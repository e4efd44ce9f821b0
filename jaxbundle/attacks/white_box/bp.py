"""A VARIANT of BP, the Boundary Projection attack (Zhang, Avrithis, Furon & Amsaleg 2020,
"Walking on the Edge: Fast, Low-Distortion Adversarial Examples", IEEE TIFS), with the
stage-1 step size of RoBIC (Pautrat, Maho, Furon et al. 2021, "RoBIC: a benchmark suite
for assessing classifiers robustness"), whose white-box attack it is. Minimum-norm, untargeted, L2.

Notation, per example: ``x0`` the clean image, ``x`` the iterate, ``r = x - x0``;
the loss is the logit margin ``l(x) = z_y - max_{j != y} z_j`` (positive exactly while the
example is correctly classified; the margin rather than CE because its first-order zero is
the decision boundary itself). One gradient per step gives ``g = grad l(x)``, the adversarial
direction ``u = -g / ||g||_2`` and the first-order (signed) distance to the boundary along
``u``, ``s = l(x) / ||g||_2`` (``s < 0`` once adversarial). ``q = <r, u>`` and
``v = r - q u`` split the perturbation into its parts along and across the gradient.

Stage 1 (the example has never been adversarial): a step ``t`` along ``u``. RoBIC's trick: to
cancel the loss within ``kappa = floor(K / 3)`` of the ``K`` iterations, at iteration
``k < kappa`` the step is ``t = s / (kappa - k)`` (first order: the loss drops by
``t ||g||``, so it would reach 0 at ``k = kappa``). From ``k = kappa - 1`` on, a
not-yet-adversarial iterate takes the "in" step below.

Stage 2 (once adversarial, per example), a walk along the boundary with a schedule
``gamma_k = gamma_min + (gamma_max - gamma_min) k / K`` (the paper's linear schedule from
``gamma_min = 0.7`` to ``gamma_max = 1``: the relative step ``1 - gamma_k`` decays to 0):

* out (``x`` adversarial): lower the distortion towards ``gamma_k ||r||`` while staying at the
  boundary. The new perturbation is ``r' = a u + b v / ||v||`` with ``a = q + gamma_k s``: a
  step back along the gradient that gives up the fraction ``gamma_k`` of the first-order depth
  ``-s`` past the boundary (the iterate stays just adversarial when the model is linear), and
  ``b = min(||v||, sqrt(max(gamma_k^2 ||r||^2 - a^2, 0)))``: the component orthogonal to the
  gradient shrinks towards ``x0`` so that ``||r'|| = gamma_k ||r||`` where possible, and to 0
  (the projection of ``x0`` onto the linearised boundary) when the target norm is below
  ``a`` -- the paper's special case.
* in (``x`` not adversarial): cross back along the gradient, ``x' = x + t u`` with
  ``t = max(s / gamma_k, s + omega ||r||)``: the first-order distance with the relative
  overshoot ``1 / gamma_k - 1`` (decaying with the schedule), and at least ``omega ||r||``
  (``omega = 1e-3``) past the linearised boundary, so that the walk never stalls on it.

Every iterate is clipped to the box ``[0, 1]``. Each step's candidate is the iterate where the
gradient was taken, with its logits: the bundler's min-norm goal keeps the smallest adversarial
one across the walk. On a linear model the out step is the exact projection onto the boundary
(up to the kept depth), so the walk converges to the minimal perturbation in a few steps.

This is a variant, not the authors' algorithm (reported as ``"bp-variant"``): the loss (the
logit margin), the stage-1 step and the out and in steps above are this library's, not those of
the authors' reference implementation. Differences from the paper, by design: the out and in
steps use the first-order distance ``s`` (the paper steps in the tangent hyperplane through
``x`` and reaches a target norm ``||r|| / gamma_k`` in the in case); the paper's
quantisation-aware search is left to the judge, which rounds the reported image; with
``quantize=True`` (default) every iterate of an example judged on the grid is rounded to the
grid, so the walk moves on judged images; L2 only.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxbundle.core import losses, norms
from jaxbundle.attacks.base import Attack, Candidate, WhiteBoxModel, check_count, white_box_attack

__all__ = ["BPConfig", "BPState", "init", "step", "bp", "schedule", "in_step", "out_step"]

_TINY = 1e-12


class BPConfig(NamedTuple):
    num_steps: int  # K, the iterations of the walk
    kappa: int  # stage-1 horizon: RoBIC's floor(K / 3), at least 1
    gamma_min: float  # first value of the schedule gamma_k (largest relative step 1 - gamma)
    gamma_max: float  # value the schedule reaches at k = K (<= 1)
    overshoot: float  # omega: least crossing of the linearised boundary, relative to ||r||
    quantize: bool  # round iterates to the 8-bit grid where judged on it (quantised variant)


class BPState(NamedTuple):
    x: jax.Array  # [B, ...] current iterate, in the box
    x0: jax.Array  # [B, ...] clean images
    y: jax.Array  # [B] labels
    k: jax.Array  # int32 [B] iteration counter
    crossed: jax.Array  # bool [B] whether some iterate has been adversarial (stage 2)



def schedule(config: BPConfig, k: jax.Array) -> jax.Array:
    """``gamma_k``: linear from ``gamma_min`` at ``k = 0`` to ``gamma_max`` at ``k = K``."""
    frac = jnp.clip(k.astype(jnp.float32) / config.num_steps, 0.0, 1.0)
    return config.gamma_min + (config.gamma_max - config.gamma_min) * frac


def out_step(r: jax.Array, u: jax.Array, s: jax.Array, gamma: jax.Array) -> jax.Array:
    """New perturbation from an adversarial iterate: back along ``u``, shrunk across it."""
    q = norms.dot(r, u)
    v = r - norms.per_example(q, r) * u
    v_norm = norms.norm(v, "l2")
    a = jnp.maximum(q + gamma * s, 0.0)  # never past x0 (an adversarial x0 stays put)
    target = gamma * norms.norm(r, "l2")
    b = jnp.minimum(v_norm, jnp.sqrt(jnp.maximum(target**2 - a**2, 0.0)))
    v_unit = v / norms.per_example(jnp.maximum(v_norm, _TINY), v)
    return norms.per_example(a, u) * u + norms.per_example(b, v) * v_unit


def in_step(
    r: jax.Array, u: jax.Array, s: jax.Array, gamma: jax.Array, overshoot: float
) -> jax.Array:
    """New perturbation from a non-adversarial iterate: across the boundary along ``u``."""
    t = jnp.maximum(s / gamma, s + overshoot * norms.norm(r, "l2"))
    return r + norms.per_example(t, u) * u


def init(config: BPConfig, keys, x0, y, eps, model, restart) -> BPState:
    """Starts at the clean image; BP is deterministic and ignores ``eps``."""
    del config, keys, eps, model, restart
    batch = x0.shape[0]
    return BPState(
        x=x0,
        x0=x0,
        y=y,
        k=jnp.zeros((batch,), jnp.int32),
        crossed=jnp.zeros((batch,), bool),
    )


def step(config: BPConfig, state: BPState, model: WhiteBoxModel) -> tuple[BPState, Candidate]:
    """One BP iteration: one gradient of the margin at ``state.x``, then a stage-1, out or in
    step."""
    margin, grad, logits = model.loss_and_grad(losses.margin, state.x, state.y)
    # losses.margin = max_{j != y} z_j - z_y, the attacker's objective: grad points along u.
    u = norms.normalize(grad, "l2")
    g_norm = norms.norm(grad, "l2")
    s = -margin / jnp.maximum(g_norm, _TINY)  # first-order distance to the boundary along u
    adversarial = margin > 0
    crossed = state.crossed | adversarial
    gamma = schedule(config, state.k)
    r = state.x - state.x0

    remaining = (config.kappa - state.k).astype(jnp.float32)
    stage1 = r + norms.per_example(s / jnp.maximum(remaining, 1.0), u) * u
    inward = in_step(r, u, s, gamma, config.overshoot)
    outward = out_step(r, u, s, gamma)

    use_stage1 = ~crossed & (remaining > 1.0)
    r_new = jnp.where(
        norms.per_example(adversarial, r),
        outward,
        jnp.where(norms.per_example(use_stage1, r), stage1, inward),
    )
    x_new = norms.project_box(state.x0 + r_new)
    if config.quantize:
        x_new = norms.snap_to_grid(x_new, state.x0, grid=model.grid)
    new_state = state._replace(x=x_new, k=state.k + 1, crossed=crossed)
    return new_state, Candidate(state.x, logits)


def bp(
    norm: str = "l2",
    steps: int = 100,
    gamma_min: float = 0.7,
    gamma_max: float = 1.0,
    overshoot: float = 1e-3,
    quantize: bool = True,
    name: str | None = None,
) -> Attack:
    """The Boundary Projection attack (minimum-norm, untargeted, white-box).

    The algorithm: :mod:`jaxbundle.attacks.white_box.bp`. Paper: Zhang, Avrithis, Furon & Amsaleg
    2020, "Walking on the Edge: Fast, Low-Distortion Adversarial Examples" (stage-1 step from
    Pautrat et al. 2021, RoBIC).

    Args:
      norm: ``"l2"`` (the only norm BP's geometry is written for).
      steps: iterations ``K`` (one gradient each); stage 1 aims to cross the boundary within
        ``floor(K / 3)`` of them. The paper and RoBIC use 20 to 100; default 100.
      gamma_min, gamma_max: the schedule ``gamma_k`` runs linearly from ``gamma_min`` to
        ``gamma_max`` over the ``K`` steps (paper: 0.7 to 1); an out step aims at the
        distortion ``gamma_k ||r||``, an in step overshoots the boundary by ``1 / gamma_k - 1``.
        Needs ``0 < gamma_min <= gamma_max <= 1``.
      overshoot: the least crossing of the linearised boundary in an in step, relative to the
        distortion (default ``1e-3``), in ``[0, 1)``.
      quantize: round every iterate of an example judged on the 8-bit grid to the grid (the
        paper's quantised variant), following the bundle's judging (``model.grid``): the
        candidates then survive the judge's rounding unchanged. ``False``: a continuous walk,
        whose smallest adversarial candidate sits just past the boundary, where the judge's
        rounding may undo it (under ``judging="float"``, or for off-grid data, the two are
        the same).
      name: report name; default ``"bp-variant"`` (a variant of the authors' algorithm).

    Returns:
      An :class:`~jaxbundle.attacks.base.Attack` with ``goal="min_norm"``.
    """
    if norms.check_norm(norm) != "l2":
        raise ValueError(f"bp supports only the norm 'l2', not {norm!r}")
    check_count("bp", "steps", steps)
    if not 0.0 < gamma_min <= gamma_max <= 1.0:
        raise ValueError(
            f"bp needs 0 < gamma_min <= gamma_max <= 1, got gamma_min={gamma_min}, "
            f"gamma_max={gamma_max}"
        )
    if not 0.0 <= overshoot < 1.0:
        raise ValueError(f"bp overshoot must lie in [0, 1), got {overshoot}")
    config = BPConfig(steps, max(steps // 3, 1), float(gamma_min), float(gamma_max),
                      float(overshoot), bool(quantize))
    return white_box_attack(name or "bp-variant", norm, steps, init, step, config,
                            goal="min_norm")
