"""Natural distribution shifts (Amich et al.): non-adaptive image transforms at severities 1-5.

Each shift is a pure function ``shift(x, severity, key) -> x'`` on a batch ``[B, H, W, C]`` in
[0, 1]; it never sees the model. The result is clipped to the box and, for an image on the
8-bit grid, rounded to the grid like a real image (off-grid images stay in float32, as the
bundle judges them). Severity 0 is the identity.

``darkness``     ``x * (1 - 0.15 s)``: a darker exposure (Amich et al.'s "darkness").
``sharpness``    PIL-style sharpness enhancement ``smooth + (1 + s)(x - smooth)`` with PIL's
                 3x3 SMOOTH kernel ``[[1,1,1],[1,5,1],[1,1,1]] / 13`` (Amich et al.'s
                 "sharpness").
``brightness``   ``x + 0.1 s``.
``contrast``     ``mean + (1 - 0.18 s)(x - mean)``, the mean per image and channel.
``noise``        additive Gaussian noise of standard deviation ``0.04 s`` (per-example keys).
``blur``         Gaussian blur of standard deviation ``0.5 s`` pixels.

:func:`evaluate_shifts` reports, per shift and severity, the accuracy and the Relative Robustness
``RR = correct on both clean and shifted / correct clean x 100``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle.core import norms, sampling
from jaxbundle.attacks.base import per_example_keys
from jaxbundle.report.metrics import relative_robustness

__all__ = ["SHIFTS", "SEVERITIES", "apply_shift", "evaluate_shifts"]

SEVERITIES = (1, 2, 3, 4, 5)


def _conv2d_same(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """Depthwise 2-D convolution with edge padding; ``x`` ``[B, H, W, C]``, ``kernel``
    ``[h, w]``."""
    kh, kw = kernel.shape
    padded = jnp.pad(x, ((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2), (0, 0)), mode="edge")
    channels = x.shape[-1]
    k = jnp.tile(kernel[:, :, None, None], (1, 1, 1, channels))  # HWIO, depthwise
    return jax.lax.conv_general_dilated(
        padded, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=channels,
    )


def _darkness(x, s, key):
    return x * (1.0 - 0.15 * s)


def _sharpness(x, s, key):
    smooth_kernel = jnp.asarray([[1, 1, 1], [1, 5, 1], [1, 1, 1]], jnp.float32) / 13.0
    smooth = _conv2d_same(x, smooth_kernel)
    return smooth + (1.0 + s) * (x - smooth)


def _brightness(x, s, key):
    return x + 0.1 * s


def _contrast(x, s, key):
    mean = jnp.mean(x, axis=(1, 2), keepdims=True)
    return mean + (1.0 - 0.18 * s) * (x - mean)


def _noise(x, s, key):
    noise = jax.vmap(lambda k: jax.random.normal(k, x.shape[1:]))(key)
    return x + 0.04 * s * noise


def _blur(x, s, key):
    sigma = 0.5 * s
    radius = int(np.ceil(3 * sigma))
    t = np.arange(-radius, radius + 1, dtype=np.float32)
    g = np.exp(-0.5 * (t / sigma) ** 2)
    g = jnp.asarray(g / g.sum())
    return _conv2d_same(_conv2d_same(x, g[:, None]), g[None, :])


SHIFTS: dict[str, Callable[[jax.Array, int, jax.Array], jax.Array]] = {
    "darkness": _darkness,
    "sharpness": _sharpness,
    "brightness": _brightness,
    "contrast": _contrast,
    "noise": _noise,
    "blur": _blur,
}


@functools.partial(jax.jit, static_argnames=("name", "severity"))
def apply_shift(x: jax.Array, keys: jax.Array, *, name: str, severity: int) -> jax.Array:
    """``x`` ``[B, H, W, C]`` shifted by ``name`` at ``severity`` (0: unchanged), on the grid
    where ``x`` is.

    ``keys`` holds one PRNG key per example (used by ``noise`` only).
    """
    if severity == 0:
        return x
    shifted = SHIFTS[name](x.astype(jnp.float32), severity, keys)
    return norms.snap_to_grid(norms.project_box(shifted), x)


def evaluate_shifts(
    apply_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    x: np.ndarray,
    y: np.ndarray,
    *,
    shifts: Sequence[str] = tuple(SHIFTS),
    severities: Sequence[int] = SEVERITIES,
    seed: int = 0,
    batch_size: int = 500,
) -> dict:
    """Accuracy and RR of the model under each shift and severity.

    Returns ``{"clean_accuracy": %, "<shift>": {"<severity>": {"accuracy": %,
    "relative_robustness": % | None}}}`` over the ``n`` examples of ``x`` ``[n, H, W, C]``.
    """
    unknown = [s for s in shifts if s not in SHIFTS]
    if unknown:
        raise ValueError(f"unknown shift(s) {unknown}; choose from {sorted(SHIFTS)}")
    bad = [s for s in severities if not (isinstance(s, int) and 1 <= s <= 5)]
    if bad:
        raise ValueError(f"severities must be integers in 1..5, got {bad}")
    x = np.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"shifts need images [n, H, W, C], got shape {x.shape}")
    y = np.asarray(y)
    key = jax.random.key(seed)
    # A stochastic model: one call per image, under a key of its own (an unbiased estimate of
    # the accuracy per call).
    predict = jax.jit(lambda p, v, k: jnp.argmax(sampling.logits(apply_fn, p, v, k), axis=-1))

    def correct_on(name: str | None, severity: int) -> np.ndarray:
        out = []
        for lo in range(0, len(y), batch_size):
            xb = jnp.asarray(x[lo : lo + batch_size], jnp.float32)
            keys = per_example_keys(key, jnp.arange(lo, lo + xb.shape[0]))
            if name is not None:
                xb = apply_shift(xb, keys, name=name, severity=severity)
            calls = sampling.judge_keys(keys)
            out.append(np.asarray(predict(params, xb, calls)) == y[lo : lo + batch_size])
        return np.concatenate(out)

    clean = correct_on(None, 0)
    result: dict = {"clean_accuracy": 100.0 * clean.mean()}
    for name in shifts:
        result[name] = {}
        for s in severities:
            ok = correct_on(name, s)
            result[name][str(s)] = {
                "accuracy": 100.0 * ok.mean(),
                "relative_robustness": relative_robustness(int(np.sum(ok & clean)),
                                                           int(clean.sum())),
            }
    return result
