"""A randomised demo defence: random input noise and a random shift in front of a classifier.

``randomized(apply_fn)`` returns a :class:`jaxbundle.core.sampling.Stochastic` model that, on every
call and for every image under its own key, adds Gaussian noise of std ``noise`` (clipped to
the box) and shifts the image by up to ``shift`` pixels in each direction (zero padding, then
a crop back to the original size) before ``apply_fn`` sees it. Test-time randomness of this
kind (Xie et al. 2018's random resizing and padding, Cohen et al.'s noise) is what makes a
single-call, non-EOT evaluation overstate robustness: the attack's gradient is one noisy draw,
and a single verdict on the candidate may be lucky either way.

The demo job's ``--models randomized`` puts it in front of the adversarially trained demo CNN
(:data:`DEFENCES`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxbundle.core.sampling import Stochastic, stochastic

__all__ = ["randomized", "Defence", "DEFENCES", "transform"]


def transform(x: jax.Array, key: jax.Array, noise: float, shift: int) -> jax.Array:
    """Images ``x`` ``[B, H, W, C]`` with noise of std ``noise`` (clipped to [0, 1]) and all
    shifted by one random offset in ``[-shift, shift]^2`` (zero padding), from ``key``."""
    noise_key, shift_key = jax.random.split(key)
    x = jnp.clip(x + noise * jax.random.normal(noise_key, x.shape, x.dtype), 0.0, 1.0)
    if shift == 0:
        return x
    padded = jnp.pad(x, ((0, 0), (shift, shift), (shift, shift), (0, 0)))
    offset = jax.random.randint(shift_key, (2,), 0, 2 * shift + 1)
    return jax.lax.dynamic_slice(padded, (0, offset[0], offset[1], 0), x.shape)


def randomized(
    apply_fn: Callable[[Any, jax.Array], jax.Array],
    *,
    noise: float = 0.1,
    shift: int = 2,
    calls: int = 16,
    threshold: float = 0.5,
) -> Stochastic:
    """``apply_fn`` behind :func:`transform`, declared stochastic (see the module docstring)."""
    if not noise >= 0 or not isinstance(shift, int) or shift < 0:
        raise ValueError(f"noise must be >= 0 and shift a non-negative integer, got {noise!r}, "
                         f"{shift!r}")

    def defended(params, x, key):
        return apply_fn(params, transform(x, key, noise, shift))

    return stochastic(defended, calls=calls, threshold=threshold)


class Defence(NamedTuple):
    """A demo defence: a demo model (of :data:`jaxbundle.models.MODELS`) behind a transform."""

    base: str
    noise: float
    shift: int

    def wrap(self, apply_fn: Callable[[Any, jax.Array], jax.Array]) -> Stochastic:
        """The base model's ``apply_fn`` behind the defence."""
        return randomized(apply_fn, noise=self.noise, shift=self.shift)


DEFENCES = {"randomized": Defence("adversarial", noise=0.1, shift=2)}
