"""What test_norms.py and test_grid.py share: the norms, the jitted functions they test, and
8-bit grid values as jaxbundle.data makes them."""

from __future__ import annotations

import jax
import numpy as np

from jaxbundle import norms

NAMES = ("linf", "l2", "l1")
LEVELS = 255

quantize = jax.jit(norms.quantize, static_argnames=("name",))
in_ball = jax.jit(norms.in_ball, static_argnames="name")
project = jax.jit(norms.project, static_argnames="name")


def on_grid(q):
    s = np.asarray(q, np.float64) * LEVELS
    return np.all(np.abs(s - np.round(s)) <= 1e-4)


def steps(q):
    return np.round(np.asarray(q, np.float64) * LEVELS).astype(np.int64)


def grid(k):
    """Grid values as jaxbundle.data makes them: uint8 / 255 in numpy (correctly rounded)."""
    return (np.asarray(k, np.float32) / np.float32(LEVELS)).astype(np.float32)


def sphere_perturbation(rng, shape, kind, eps, sparse_fraction):
    """Perturbations ``shape`` of L2 norm ``eps`` per example (float64): ``"dense"`` Gaussian,
    ``"sparse"`` (Gaussian on about ``sparse_fraction`` of the pixels) or ``"signs"`` (a signed
    pattern, as PGD makes)."""
    delta = rng.normal(size=shape)
    if kind == "sparse":
        delta *= rng.uniform(size=shape) < sparse_fraction
    elif kind == "signs":
        delta = np.sign(delta)
    b = shape[0]
    return delta / np.linalg.norm(delta.reshape(b, -1), axis=1).reshape(b, 1, 1, 1) * eps
