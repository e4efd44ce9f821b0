"""Checks and conversions of image arrays: ``[N, H, W, C]`` pixels in [0, 1], integer labels."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["check_labels", "check_n", "check_pixels", "to_unit_float", "translate",
           "validate_images"]


def check_pixels(x) -> None:
    """Checks that images (numpy or jax, any shape) are floating point, finite and in [0, 1].

    Raises ``ValueError`` naming the first problem; shared by the datasets and the bundler.
    """
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"images must have a floating dtype with pixels in [0, 1], got dtype "
                         f"{x.dtype} (divide uint8 images by 255)")
    xh = np.asarray(x)
    finite = np.isfinite(xh)
    if not finite.all():
        raise ValueError(f"images contain {int(xh.size - np.count_nonzero(finite))} non-finite "
                         "values (NaN or inf)")
    lo, hi = float(xh.min()), float(xh.max())
    if lo < 0.0 or hi > 1.0:
        raise ValueError(f"pixels must lie in [0, 1], found min {lo} and max {hi}")


def check_labels(y, n: int, num_classes: int) -> None:
    """Checks that labels are 1-D integers, ``n`` of them, in ``[0, num_classes)``."""
    y = np.asarray(y)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be 1-D integers, got shape {y.shape} dtype {y.dtype}")
    if len(y) != n:
        raise ValueError(f"length mismatch: {n} images but {len(y)} labels")
    values = np.unique(y[(y < 0) | (y >= num_classes)])
    if values.size:
        more = f" (and {len(values) - 10} more)" if len(values) > 10 else ""
        raise ValueError(f"labels must lie in [0, {num_classes}) for {num_classes} classes, "
                         f"found out-of-range values {values[:10].tolist()}{more}")


def validate_images(x: np.ndarray, y: np.ndarray, num_classes: int) -> None:
    """Checks that ``x`` and ``y`` form a valid image classification dataset.

    Args:
        x: images, expected floating [N, H, W, C] with values in [0, 1].
        y: labels, expected integer [N] with values in [0, num_classes).
        num_classes: number of classes.

    Raises:
        ValueError: naming the first problem found: ``x`` not 4-D, empty, or failing
            :func:`check_pixels`; ``num_classes`` not a positive int; ``y`` failing
            :func:`check_labels`.
    """
    x = np.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"images must be 4-D [N, H, W, C], got shape {x.shape}")
    if x.shape[0] == 0:
        raise ValueError("empty dataset: images have 0 examples")
    check_pixels(x)
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)):
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes}")
    check_labels(y, len(x), num_classes)


def check_n(n: int | None, available: int | None, what: str) -> int | None:
    """Validates a requested ``n``; returns it, or ``available`` when None.

    ``available`` None means "not known yet": only positivity is checked.
    """
    if n is None:
        return available
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise ValueError(f"n must be a positive int or None, got {n!r}")
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if available is not None and n > available:
        raise ValueError(f"n={n} is larger than the {available} examples available in {what}")
    return int(n)


def translate(x: np.ndarray, dy: float, dx: float) -> np.ndarray:
    """Images ``[N, H, W, C]`` in [0, 1] moved by a sub-pixel offset ``(dy, dx)`` with bilinear
    interpolation (edge pixels repeated): ordinary off-grid data, as after resizing or
    augmenting 8-bit images, whose pixels fall between the 8-bit levels. float32."""
    x = np.asarray(x, np.float32)
    if x.ndim != 4:
        raise ValueError(f"translate needs images [N, H, W, C], got shape {x.shape}")

    def shift(a: np.ndarray, offset: float, axis: int) -> np.ndarray:
        whole, frac = int(np.floor(offset)), offset - np.floor(offset)
        n = a.shape[axis]
        idx = np.clip(np.arange(n) - whole, 0, n - 1)
        prev = np.clip(idx - 1, 0, n - 1)
        return (1 - frac) * np.take(a, idx, axis=axis) + frac * np.take(a, prev, axis=axis)

    out = shift(shift(x, dy, 1), dx, 2)
    return np.clip(out, 0.0, 1.0).astype(np.float32)




def to_unit_float(x: np.ndarray) -> np.ndarray:
    """uint8 images as float32 in [0, 1] (``k / 255``); other dtypes cast to float32."""
    x = np.asarray(x)
    if x.dtype == np.uint8:
        return x.astype(np.float32) / np.float32(255.0)
    return x.astype(np.float32)
