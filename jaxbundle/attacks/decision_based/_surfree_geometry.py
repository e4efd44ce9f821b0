"""SurFree's geometry: the random directions (low-frequency DCT or white noise), their
Gram-Schmidt against the recent ones, and the points of a circle through ``x0`` (see
:mod:`jaxbundle.attacks.decision_based.surfree`, which re-exports them)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxbundle.core import norms

__all__ = ["circle_point", "orthogonalize", "sample_directions"]


def _low_frequency_mask(shape: tuple[int, ...], ratio: float) -> jax.Array:
    """1 on the first ``ceil(ratio * n)`` DCT rows and columns of ``[H, W, ...]``, else 0."""
    rows = jnp.arange(shape[0]) < math.ceil(ratio * shape[0])
    cols = jnp.arange(shape[1]) < math.ceil(ratio * shape[1])
    mask = (rows[:, None] & cols[None, :]).astype(jnp.float32)
    return mask.reshape(mask.shape + (1,) * (len(shape) - 2))


def sample_directions(
    keys: jax.Array, shape: tuple[int, ...], basis: str, frequency_ratio: float
) -> jax.Array:
    """One random direction per key, flattened ``[B, D]`` (not normalised).

    ``"dct"``: Gaussian coefficients on the low-frequency block of the orthonormal 2-D DCT over
    the first two axes of ``shape`` (``[H, W, C]`` images), inverse-transformed; inputs with
    fewer than two axes use white noise. ``"gaussian"``: white Gaussian noise.
    """
    noise = jax.vmap(lambda k: jax.random.normal(k, shape))(keys)
    if basis == "dct" and len(shape) >= 2:
        coeffs = noise * _low_frequency_mask(shape, frequency_ratio)[None]
        noise = jax.scipy.fft.idctn(coeffs, axes=(1, 2), norm="ortho")
    return norms.flat(noise)


def orthogonalize(t: jax.Array, directions: jax.Array, u: jax.Array) -> jax.Array:
    """Unit ``t`` ``[B, D]`` made orthogonal to ``u`` and to the buffer ``[B, L, D]``.

    The buffer rows are orthonormal (or zero), so Gram-Schmidt takes one projection for them
    and one for ``u``'s part outside their span; a last projection on ``u`` removes the
    float32 residue, which the circle's geometry needs exactly.
    """

    def off_buffer(a):
        return a - jnp.einsum("bl,bld->bd", jnp.einsum("bd,bld->bl", a, directions), directions)

    u_rest = norms.unit(off_buffer(u))
    v = off_buffer(t)
    v = v - norms.dot(v, u_rest)[:, None] * u_rest
    v = v - norms.dot(v, u)[:, None] * u
    return norms.unit(v)


def circle_point(
    x0: jax.Array, u: jax.Array, v: jax.Array, dist: jax.Array, theta: jax.Array
) -> jax.Array:
    """``x0 + dist cos θ (u cos θ + v sin θ)`` per example, flat ``[B, D]`` (not clipped)."""
    c, s = jnp.cos(theta)[:, None], jnp.sin(theta)[:, None]
    return x0 + dist[:, None] * c * (u * c + v * s)
