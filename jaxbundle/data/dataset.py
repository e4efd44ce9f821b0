"""The in-memory dataset record (:class:`Dataset`), shared by batching, the sample and tfds."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Dataset"]


class Dataset(NamedTuple):
    """An in-memory image classification dataset.

    Attributes:
        x: float32 images, shape [N, H, W, C], pixels in [0, 1].
        y: int32 labels, shape [N], values in [0, num_classes).
        num_classes: number of classes.
        name: human-readable name, e.g. ``"mnist_sample/test"``.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str
