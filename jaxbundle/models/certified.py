"""Verified training: the IBP (Gowal et al. 2018) and CROWN-IBP (Zhang et al. 2020) losses and
their schedules, for :func:`jaxbundle.models.training.train` when ``config.certified`` is set.

The loss is cross-entropy on the worst-case logits that sound bounds allow over the training
ball (Gowal et al. 2018, "On the Effectiveness of Interval Bound Propagation for Training
Verifiably Robust Models"), mixed with the natural cross-entropy::

    loss = kappa * CE(z(x), y) + (1 - kappa) * CE(-m(x), y)

where ``m_j <= z_y - z_j`` is a lower bound on margin ``j`` over the Linf ball of radius eps
around ``x`` (clipped to ``[0, 1]``), with ``m_y = 0``: the logits an adversary could reach at
worst, up to a shift, since CE depends only on logit differences. The bounds are the library's
own (:func:`jaxbundle.certify.bounds.margin_bounds`), so the model is trained against the
bounds that later certify it (in real arithmetic: the allowance for float32's rounding, which a
loss does not need, is left to the certificate). For ``"crown-ibp"`` the bound is
``beta * crown_ibp + (1 - beta) * ibp`` (Zhang et al. 2020, "Towards Stable and Efficient
Training of Verifiably Robust Neural Networks"); once ``beta`` reaches 0 the CROWN pass is
skipped.

Schedules, all driven by the eps ramp (``config.eps_warmup`` of the steps, eps linear from 0
to ``config.eps``): ``kappa`` goes linearly from ``config.kappa_start`` to
``config.kappa_end`` and ``beta`` from 1 to 0 over the ramp, then stay.

Verified training starts from the IBP initialisation of Shi et al. (2021, "Fast Certified
Robust Training with Short Warmup"): every kernel ``~ N(0, 2 pi / fan_in**2)``, which keeps
interval widths about constant from layer to layer at the start, so the bounds are not
useless before training has begun to tighten them. A model with BatchNorm (the demo model's)
is bounded, as in that paper, with each batch's own clean statistics as a fixed affine map
(:func:`jaxbundle.models.training.train`), and certified later with the training images'.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxbundle.core import losses
from jaxbundle.certify import bounds

__all__ = ["METHODS", "Schedule", "ibp_initialization", "schedule", "verified_loss",
           "worst_case_logits"]

# The bound propagation each verified training uses (values of ``TrainConfig.certified``).
METHODS = ("ibp", "crown-ibp")


class Schedule(NamedTuple):
    """The verified loss's scalars at one training step (float32 scalars when traced).

    Attributes:
      eps: Linf radius of the training ball.
      kappa: weight of the natural cross-entropy (``1 - kappa`` on the verified one).
      beta: weight of the CROWN-IBP bound against the IBP one (``"crown-ibp"`` only).
    """

    eps: Any
    kappa: Any
    beta: Any


def schedule(eps: float, progress: float, kappa_start: float, kappa_end: float) -> Schedule:
    """The schedule ``progress`` (0 to 1) of the way through the eps ramp: eps is the ramp's
    (``eps``, already scaled), kappa moves linearly from ``kappa_start`` to ``kappa_end`` and
    beta from 1 to 0."""
    kappa = kappa_start + (kappa_end - kappa_start) * progress
    return Schedule(eps=eps, kappa=kappa, beta=1.0 - progress)


def worst_case_logits(apply_fn: Callable[[Any, jax.Array], jax.Array], params: Any,
                      x: jax.Array, y: jax.Array, eps: jax.Array, beta: jax.Array, *,
                      method: str) -> jax.Array:
    """``-m`` for lower bounds ``m [B, K]`` on the margins ``z_y - z_j`` over the Linf ball of
    radius ``eps`` around ``x`` in ``[0, 1]``; 0 at the true class.

    ``method`` ``"ibp"`` ignores ``beta``; ``"crown-ibp"`` mixes ``beta * crown-ibp + (1 -
    beta) * ibp`` and computes the CROWN-IBP bound only while ``beta > 0``. Differentiable in
    ``params``; an example is certified when every entry but the true class's is negative.
    """
    if method not in METHODS:
        raise ValueError(f"verified training method must be one of {METHODS}; got {method!r}")

    def margins(bound_method: str) -> jax.Array:  # the papers' formulas: a loss, no proof
        return bounds.margin_bounds(apply_fn, params, x, y, eps=eps, method=bound_method,
                                    rounding=False)

    margin = margins("ibp")
    if method == "crown-ibp":
        tighter = jax.lax.cond(beta > 0, lambda: margins("crown-ibp"), lambda: margin)
        margin = beta * tighter + (1.0 - beta) * margin
    true_class = jax.nn.one_hot(y, margin.shape[-1], dtype=bool)
    return jnp.where(true_class, 0.0, -margin)


def verified_loss(apply_fn: Callable[[Any, jax.Array], jax.Array], params: Any, x: jax.Array,
                  y: jax.Array, mix: Schedule, *, method: str) -> jax.Array:
    """The mean of ``kappa * CE(z(x), y) + (1 - kappa) * CE(worst_case_logits, y)``.

    Args:
      apply_fn: ``apply_fn(params, x) -> logits [B, K]``.
      params: the model's parameters (differentiated).
      x: images ``[B, H, W, C]`` in ``[0, 1]``.
      y: labels ``[B]``.
      mix: this step's :class:`Schedule` (eps, kappa, beta).
      method: ``"ibp"`` or ``"crown-ibp"``.

    Returns:
      The scalar loss.
    """
    natural = jnp.mean(losses.cross_entropy(apply_fn(params, x), y))
    worst = worst_case_logits(apply_fn, params, x, y, mix.eps, mix.beta, method=method)
    verified = jnp.mean(losses.cross_entropy(worst, y))
    return mix.kappa * natural + (1.0 - mix.kappa) * verified


def ibp_initialization(params: Any, key: jax.Array) -> Any:
    """``params`` with every kernel (a leaf of two or more dimensions, fan-in all but the last)
    redrawn from ``N(0, (sqrt(2 pi) / fan_in)**2)`` (Shi et al. 2021); biases left as they are."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(key, len(leaves))
    redrawn = []
    for leaf, leaf_key in zip(leaves, keys):
        if jnp.ndim(leaf) >= 2:
            fan_in = math.prod(jnp.shape(leaf)[:-1])
            std = math.sqrt(2.0 * math.pi) / fan_in
            leaf = std * jax.random.normal(leaf_key, jnp.shape(leaf), jnp.result_type(leaf))
        redrawn.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, redrawn)
