"""Checks and conversions of image arrays: ``[N, H, W, C]`` pixels in [0, 1], integer labels."""

from __future__ import annotations

import numpy as np

from jaxbundle.core.validation import check_labels, check_pixels  # shared with the bundler

__all__ = ["check_labels", "check_n", "check_pixels", "to_unit_float", "translate",
           "validate_images"]


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
