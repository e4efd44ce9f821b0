"""Fast Gradient Sign Method (Goodfellow, Shlens & Szegedy 2015, "Explaining and Harnessing
Adversarial Examples") and its L2 analogue, the Fast Gradient Method.

One step of size eps along the steepest-ascent direction of the loss for the chosen norm::

    x_adv = clip_[0,1](x0 + eps * d),   d = sign(grad)            (Linf)
                                         d = grad / ||grad||_2     (L2)

For a linear model with the cross-entropy loss on two classes this step is the exact
worst case inside the ball, which the tests check.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from jaxbundle.core import losses, norms
from jaxbundle.attacks.base import Attack, WhiteBoxModel, white_box_attack
from jaxbundle.attacks.white_box.pgd import gradient_step

__all__ = ["FGSMConfig", "FGSMState", "init", "step", "fgsm"]


class FGSMConfig(NamedTuple):
    norm: str  # "linf" or "l2"
    loss: str  # name in jaxbundle.core.losses.LOSSES


class FGSMState(NamedTuple):
    x: jax.Array  # [B, ...] current iterate (x0 before the step, x_adv after)
    x0: jax.Array  # [B, ...] clean images
    y: jax.Array  # [B] labels
    eps: jax.Array  # [B] radius


def init(config: FGSMConfig, keys, x0, y, eps, model, restart) -> FGSMState:
    del config, keys, model, restart
    return FGSMState(x=x0, x0=x0, y=y, eps=eps)


def step(config: FGSMConfig, state: FGSMState, model: WhiteBoxModel):
    """One step of length eps from ``x0`` (PGD's :func:`~.pgd.gradient_step`)."""
    return gradient_step(config.loss, config.norm, state, model, state.x0, state.eps)


def fgsm(norm: str = "linf", loss: str = "ce", name: str | None = None) -> Attack:
    """FGSM (Linf) or FGM (L2): one gradient step of length eps.

    The algorithm: :mod:`jaxbundle.attacks.white_box.fgsm`. Paper: Goodfellow, Shlens & Szegedy
    2015, "Explaining and Harnessing Adversarial Examples".

    Args:
      norm: ``"linf"`` or ``"l2"``.
      loss: ``"ce"``, ``"margin"`` or ``"dlr"`` (see :mod:`jaxbundle.core.losses`).
      name: report name; default ``"fgsm"`` (plus the loss when it is not CE).

    Returns:
      An :class:`~jaxbundle.attacks.base.Attack` with one step and no restarts.
    """
    if norms.check_norm(norm) not in ("linf", "l2"):
        raise ValueError(f"fgsm supports norms 'linf' and 'l2', not {norm!r}")
    losses.get(loss)
    default = "fgsm" if loss == "ce" else f"fgsm-{loss}"
    return white_box_attack(name or default, norm, 1, init, step, FGSMConfig(norm=norm, loss=loss))
