"""Best-effort mode (RoBIC): the smallest eps per example at which a fixed-budget bundle succeeds.

A fixed-eps attack says only "fooled within eps or not". Best effort turns it into a distortion
per example, so that PGD or APGD can join the ``P(D)`` curve and ``D1/2``: a bisection on eps,
run for all examples at once (eps is a per-example array of the jitted bundle, so every round
reuses one compiled program):

1. run the bundle at ``eps_max``: examples it cannot fool get distortion ``inf``;
2. ``iterations`` times: run at the midpoint of each example's bracket ``[lo, hi]``; where it
   succeeds, ``hi`` becomes the verified distortion of the adversarial image found (at most the
   midpoint), else ``lo`` becomes the midpoint.

The result is ``hi``: a verified adversarial distortion per example, within
``eps_max / 2**iterations`` of the smallest eps the bundle succeeds at (success is not
guaranteed to be monotone in eps for a heuristic attack; the bracket is that of this search).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxbundle.core import goals as goals_lib
from jaxbundle.attacks.base import Attack
from jaxbundle.core.bundler import bundle

__all__ = ["BestEffort", "best_effort"]


class BestEffort(NamedTuple):
    distortion: jax.Array  # [B] smallest verified adversarial distortion found (inf: none)
    lower: jax.Array  # [B] largest eps at which the bundle failed (0 if none)
    x: jax.Array  # [B, ...] the adversarial image at ``distortion`` (the clean one if none)
    gradients: jax.Array  # int32 [B] gradient evaluations spent over all rounds


def best_effort(  # noqa: PLR0913 (the public call: bundle()'s keyword options)
        attacks: Sequence[Attack], apply_fn: Callable, params: Any, x: jax.Array,
        y: jax.Array, key: jax.Array, *, eps_max: float, norm: str = "linf",
        iterations: int = 8, example_id: jax.Array | None = None,
        judging: str = "auto") -> BestEffort:
    """Per-example bisection on eps of a fixed-budget bundle (see the module docstring)."""
    if not eps_max > 0:
        raise ValueError(f"eps_max must be > 0, got {eps_max}")
    if not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"iterations must be an integer >= 0, got {iterations!r}")

    def run(eps, validate):
        r = bundle(attacks, apply_fn, params, x, y, key, eps=eps, norm=norm,
                   example_id=example_id, judging=judging, validate=validate)
        best = r.best["misclassify"]
        return goals_lib.success("misclassify", best.score, eps), best, r.gradients

    eps = jnp.full(jnp.shape(y), eps_max, jnp.float32)
    ok, best, gradients = run(eps, True)
    hi = jnp.where(ok, best.score.distortion, jnp.inf)
    lo = jnp.zeros_like(hi)
    x_adv = jnp.where(ok.reshape((-1,) + (1,) * (best.x.ndim - 1)), best.x, x)
    for _ in range(iterations):
        mid = jnp.where(jnp.isfinite(hi), 0.5 * (lo + jnp.minimum(hi, eps_max)), eps_max)
        ok, cand, spent = run(mid, False)
        gradients = gradients + spent
        better = ok & jnp.isfinite(hi)
        hi = jnp.where(better, jnp.minimum(hi, cand.score.distortion), hi)
        lo = jnp.where(~ok & jnp.isfinite(hi), jnp.maximum(lo, mid), lo)
        x_adv = jnp.where(better.reshape((-1,) + (1,) * (x_adv.ndim - 1)), cand.x, x_adv)
    return BestEffort(distortion=hi, lower=lo, x=x_adv, gradients=gradients)
