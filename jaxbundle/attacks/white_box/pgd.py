"""Projected Gradient Descent (Madry et al. 2018, "Towards Deep Learning Models Resistant to
Adversarial Attacks"; Kurakin et al. 2017 without the random start).

From a uniformly random point of the eps ball (or from x0), repeat ``num_steps`` times::

    x <- Proj_{B(x0, eps) ∩ [0,1]^d}( x + alpha * d(grad_x loss(x)) )

with ``d = sign`` for Linf and ``d = g / ||g||_2`` for L2. The default step size is Madry's
``alpha = 2.5 * eps / num_steps``; pass ``step_size`` for an absolute value (e.g. 0.01 for
MNIST Linf 0.3 with 40 steps). Restarts are independent random starts, run as a vmap axis by
the bundler, and every iterate is a candidate there: nothing is lost between restarts.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxbundle.core import losses, norms
from jaxbundle.attacks.base import Attack, Candidate, WhiteBoxModel, check_count, white_box_attack

__all__ = ["PGDConfig", "PGDState", "gradient_step", "init", "step", "pgd"]


class PGDConfig(NamedTuple):
    norm: str  # "linf" or "l2"
    loss: str  # name in jaxbundle.core.losses.LOSSES
    num_steps: int
    step_size: float | None  # absolute step; None: 2.5 * eps / num_steps
    random_start: bool


class PGDState(NamedTuple):
    x: jax.Array  # [B, ...] current iterate, in the box and the eps ball
    x0: jax.Array  # [B, ...] clean images
    y: jax.Array  # [B] labels
    eps: jax.Array  # [B] radius
    step_size: jax.Array  # [B] alpha


def init(config: PGDConfig, keys, x0, y, eps, model, restart) -> PGDState:
    del model, restart
    if config.random_start:
        x = norms.random_start(keys, x0, eps, config.norm)
    else:
        x = x0
    if config.step_size is None:
        alpha = 2.5 * eps / config.num_steps
    else:
        alpha = jnp.full_like(eps, config.step_size)
    return PGDState(x=x, x0=x0, y=y, eps=eps, step_size=alpha)


def gradient_step(loss: str, norm: str, state, model: WhiteBoxModel, start, size):
    """The step PGD and FGSM share: the gradient of ``loss`` at ``state.x``, normalised for
    ``norm``, times ``size`` ``[B]`` from ``start``, projected onto the box and the eps ball
    around ``state.x0``; the candidate is ``state.x`` with its logits."""
    _, grad, logits = model.loss_and_grad(losses.get(loss), state.x, state.y)
    direction = norms.normalize(grad, norm)
    x_new = norms.project(
        start + norms.per_example(size, direction) * direction, state.x0, state.eps, norm
    )
    return state._replace(x=x_new), Candidate(state.x, logits)


def step(config: PGDConfig, state: PGDState, model: WhiteBoxModel):
    return gradient_step(config.loss, config.norm, state, model, state.x, state.step_size)


def pgd(
    norm: str = "linf",
    loss: str = "ce",
    steps: int = 40,
    restarts: int = 1,
    step_size: float | None = None,
    random_start: bool = True,
    name: str | None = None,
) -> Attack:
    """PGD with a selectable loss, random start and restarts.

    The algorithm: :mod:`jaxbundle.attacks.white_box.pgd`. Paper: Madry et al. 2018, "Towards Deep
    Learning Models Resistant to Adversarial Attacks".

    Args:
      norm: ``"linf"`` or ``"l2"``.
      loss: ``"ce"`` (cross-entropy), ``"margin"`` (Carlini-Wagner) or ``"dlr"``.
      steps: gradient steps per restart.
      restarts: independent random starts (a vmap axis in the bundler).
      step_size: absolute step; ``None`` uses ``2.5 * eps / steps``.
      random_start: start from a uniform point of the ball instead of x0.
      name: report name; default ``"pgd-<loss>"``.

    Returns:
      An :class:`~jaxbundle.attacks.base.Attack`.
    """
    if norms.check_norm(norm) not in ("linf", "l2"):
        raise ValueError(f"pgd supports norms 'linf' and 'l2', not {norm!r}")
    losses.get(loss)
    check_count("pgd", "steps", steps)
    check_count("pgd", "restarts", restarts)
    if step_size is not None and not step_size > 0:
        raise ValueError(f"pgd step_size must be positive, got {step_size}")
    config = PGDConfig(norm, loss, steps, step_size, random_start)
    return white_box_attack(name or f"pgd-{loss}", norm, steps, init, step, config,
                            restarts=restarts)
