"""A demo defence whose gradients are broken by design: bit-depth reduction and JPEG-like
compression in front of a classifier.

:func:`squeeze` reduces the images to ``bits`` bits per pixel (Xu et al. 2018's feature
squeezing) and then compresses them as JPEG does (8x8 block DCT, quantisation by the standard
luminance table at ``quality``, inverse DCT; Guo et al. 2018's JPEG defence, one of those BPDA
broke). Both steps ``round``, so its gradient is exactly zero almost everywhere: a gradient
attack run through it never moves, though the classifier behind it is no more robust.
:func:`quantized` declares it as the model's preprocessing (:func:`jaxbundle.defended`), so the
same model is attacked through it or with BPDA (identity backward pass, right as
``squeeze(x) ≈ x``).

The demo job's ``--models quantized`` puts it (2 bits, quality 90) in front of the
adversarially trained demo CNN (:data:`DEFENCES`); on the embedded MNIST sample it keeps the
CNN's clean accuracy (``benchmarks/bpda_demo.py``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle.run.defences import Defended, defended

__all__ = ["BLOCK", "DEFENCES", "JPEG_LUMINANCE", "TIE_BREAK", "Quantized", "bit_depth",
           "dct_matrix", "jpeg", "quantized", "squeeze"]

BLOCK = 8  # JPEG's block side
# Added to every quantised coefficient before rounding. Images on the 8-bit grid, squeezed to a
# few bits, put some coefficients (the DC one above all: a sum of a block's levels over 8q)
# exactly on a tie m + 1/2, where float32 error in the DCT (about 1e-5) would decide the
# rounding, and a jitted and an eager call of the same model could disagree. The offset moves
# the ties off those exact values, so rounding is the same whatever the order of the sums.
TIE_BREAK = 0.01
# The JPEG standard's luminance quantisation table (ITU-T T.81, Annex K.1), quality 50.
JPEG_LUMINANCE = (
    (16, 11, 10, 16, 24, 40, 51, 61), (12, 12, 14, 19, 26, 58, 60, 55),
    (14, 13, 16, 24, 40, 57, 69, 56), (14, 17, 22, 29, 51, 87, 80, 62),
    (18, 22, 37, 56, 68, 109, 103, 77), (24, 35, 55, 64, 81, 104, 113, 92),
    (49, 64, 78, 87, 103, 121, 120, 101), (72, 92, 95, 98, 112, 100, 103, 99),
)


def bit_depth(x: jax.Array, bits: int) -> jax.Array:
    """``x`` in [0, 1] rounded to ``2**bits`` evenly spaced levels."""
    levels = 2**bits - 1
    return jnp.round(x * levels) / levels


def dct_matrix(n: int = BLOCK) -> np.ndarray:
    """The orthonormal DCT-II matrix ``C`` ``[n, n]``: ``C @ v`` transforms ``v``, ``C.T @ c``
    inverts it."""
    k, i = np.arange(n)[:, None], np.arange(n)[None, :]
    c = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * i + 1) * k / (2 * n))
    c[0] /= np.sqrt(2.0)
    return c.astype(np.float32)


@functools.cache
def _table(quality: int) -> np.ndarray:
    """The luminance table scaled to ``quality`` as libjpeg scales it."""
    scale = 5000 / quality if quality < 50 else 200 - 2 * quality
    table = np.floor((np.asarray(JPEG_LUMINANCE, np.float32) * scale + 50) / 100)
    return np.clip(table, 1, 255).astype(np.float32)


def jpeg(x: jax.Array, quality: int = 50) -> jax.Array:
    """Images ``x`` ``[B, H, W, C]`` in [0, 1] compressed as JPEG's luminance channel is: each
    channel in 8x8 blocks (edge-padded to whole blocks), on the 0-255 scale shifted by 128,
    DCT, divided by the quantisation table, rounded (ties moved off by :data:`TIE_BREAK`),
    multiplied back, inverse DCT; clipped to [0, 1]."""
    b, h, w, c = x.shape
    pad_h, pad_w = -h % BLOCK, -w % BLOCK
    v = jnp.pad(x, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge") * 255.0 - 128.0
    blocks = v.reshape(b, (h + pad_h) // BLOCK, BLOCK, (w + pad_w) // BLOCK, BLOCK, c)
    d = jnp.asarray(dct_matrix(), x.dtype)
    q = jnp.asarray(_table(quality), x.dtype)[None, None, :, None, :, None]
    coefficients = jnp.einsum("ki,bhiwjc,lj->bhkwlc", d, blocks, d)
    coefficients = jnp.round(coefficients / q + TIE_BREAK) * q
    back = jnp.einsum("ki,bhkwlc,lj->bhiwjc", d, coefficients, d)
    back = back.reshape(b, h + pad_h, w + pad_w, c)[:, :h, :w]
    return jnp.clip((back + 128.0) / 255.0, 0.0, 1.0)


def squeeze(x: jax.Array, bits: int = 2, quality: int = 90) -> jax.Array:
    """:func:`bit_depth` then :func:`jpeg`: the demo's preprocessing."""
    return jpeg(bit_depth(x, bits), quality)


def quantized(apply_fn: Callable[[Any, jax.Array], jax.Array], *, bits: int = 2,
              quality: int = 90, bpda: bool = False) -> Defended:
    """``apply_fn`` behind :func:`squeeze`, declared as its preprocessing (BPDA's backward
    pass: the identity)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in [1, 8], got {bits!r}")
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"quality must be an integer in [1, 100], got {quality!r}")
    return defended(apply_fn, functools.partial(squeeze, bits=bits, quality=quality), bpda=bpda)


class Quantized(NamedTuple):
    """A demo defence: a demo model (of :data:`jaxbundle.models.MODELS`) behind :func:`squeeze`."""

    base: str
    bits: int
    quality: int

    def wrap(self, apply_fn: Callable[[Any, jax.Array], jax.Array]) -> Defended:
        """The base model's ``apply_fn`` behind the defence."""
        return quantized(apply_fn, bits=self.bits, quality=self.quality)


DEFENCES = {"quantized": Quantized("adversarial", bits=2, quality=90)}
