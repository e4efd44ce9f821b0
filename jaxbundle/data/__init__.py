"""Datasets and fixed-shape batching for robustness evaluation.

Images are numpy ``float32`` arrays of shape ``[N, H, W, C]`` with pixels in
``[0, 1]``; labels are ``int32`` arrays of shape ``[N]``.

* :func:`load_mnist_sample` reads a small real MNIST sample embedded in the
  package (first 10,000 training and first 2,000 test images, CC BY-SA 3.0, see
  ``LICENSE-MNIST.txt``); it needs no network.
* :func:`load_tfds` loads image classification datasets through the optional
  ``tensorflow-datasets`` package (``pip install 'jaxbundle[tfds]'``).
* :func:`batches` yields batches of a constant size, padding the last one and
  marking real rows with a mask, so jitted code never sees a new shape.
* :func:`translate` moves images by a sub-pixel offset: off-grid data for testing.

Nothing is downloaded at import time.
"""

from __future__ import annotations

import functools
import importlib.resources
from typing import Iterator, NamedTuple

import numpy as np

__all__ = [
    "Batch",
    "Dataset",
    "batches",
    "load_mnist_sample",
    "load_tfds",
    "num_batches",
    "translate",
    "validate_images",
]

_SAMPLE_FILE = "mnist_sample.npz"
_SPLITS = ("train", "test")
_TFDS_HINT = "pip install 'jaxbundle[tfds]'"


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


class Batch(NamedTuple):
    """One fixed-size batch produced by :func:`batches`.

    Every batch has exactly ``batch_size`` rows. Rows past the end of the
    dataset (only in the last batch) are padding: they repeat the last real
    example, including its ``example_id``, and have ``mask`` False. Padding ids
    are therefore always valid, non-negative indices (safe for deriving
    per-example PRNG keys); use ``mask`` to tell real rows from padding.

    Attributes:
        x: images, shape [B, H, W, C].
        y: labels, shape [B].
        mask: bool [B], True for real examples.
        example_id: int32 [B], index of each row's example in the dataset.
    """

    x: np.ndarray
    y: np.ndarray
    mask: np.ndarray
    example_id: np.ndarray


def validate_images(x: np.ndarray, y: np.ndarray, num_classes: int) -> None:
    """Checks that ``x`` and ``y`` form a valid image classification dataset.

    Args:
        x: images, expected floating [N, H, W, C] with values in [0, 1].
        y: labels, expected integer [N] with values in [0, num_classes).
        num_classes: number of classes.

    Raises:
        ValueError: naming the first problem found: ``x`` not 4-D, not
            floating point, empty, containing NaN/inf, or outside [0, 1];
            ``y`` not a 1-D integer array, of a different length than ``x``, or
            holding labels outside [0, num_classes).
    """
    x = np.asarray(x)
    y = np.asarray(y)
    if x.ndim != 4:
        raise ValueError(f"images must be 4-D [N, H, W, C], got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(
            f"images must have a floating dtype with pixels in [0, 1], got dtype {x.dtype}"
        )
    if x.shape[0] == 0:
        raise ValueError("empty dataset: images have 0 examples")
    if not np.all(np.isfinite(x)):
        bad = int(np.size(x) - np.count_nonzero(np.isfinite(x)))
        raise ValueError(f"images contain {bad} non-finite values (NaN or inf)")
    lo, hi = float(x.min()), float(x.max())
    if lo < 0.0 or hi > 1.0:
        raise ValueError(f"pixels must lie in [0, 1], found min {lo} and max {hi}")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(
            f"labels must be a 1-D integer array, got shape {y.shape} dtype {y.dtype}"
        )
    if len(y) != len(x):
        raise ValueError(f"length mismatch: {len(x)} images but {len(y)} labels")
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)):
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes}")
    out_of_range = (y < 0) | (y >= num_classes)
    if np.any(out_of_range):
        values = np.unique(y[out_of_range])
        shown = values[:10].tolist()
        more = f" (and {len(values) - 10} more)" if len(values) > 10 else ""
        raise ValueError(
            f"labels must lie in [0, {num_classes}), found out-of-range values "
            f"{shown}{more}"
        )


def _check_n(n: int | None, available: int | None, what: str) -> int | None:
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


@functools.lru_cache(maxsize=1)
def _sample_arrays() -> dict[str, np.ndarray]:
    """Reads the embedded uint8 MNIST sample once (about 9 MB in memory)."""
    resource = importlib.resources.files(__name__).joinpath(_SAMPLE_FILE)
    with resource.open("rb") as f, np.load(f) as npz:
        arrays = {key: npz[key] for key in npz.files}
    for a in arrays.values():
        a.setflags(write=False)
    return arrays


def _to_unit_float(x: np.ndarray) -> np.ndarray:
    """Converts uint8 images to float32 in [0, 1]; casts floats to float32."""
    x = np.asarray(x)
    if x.dtype == np.uint8:
        return x.astype(np.float32) / np.float32(255.0)
    return x.astype(np.float32)


def load_mnist_sample(split: str = "test", n: int | None = None) -> Dataset:
    """Loads the MNIST sample embedded in the package.

    The sample holds the first 10,000 training and the first 2,000 test images
    of MNIST, unmodified, in the original order.

    Args:
        split: ``"train"`` (10,000 examples) or ``"test"`` (2,000 examples).
        n: take the first ``n`` examples; None for all of the split.

    Returns:
        A :class:`Dataset` with ``x`` float32 [n, 28, 28, 1] in [0, 1], ``y``
        int32 [n], ``num_classes`` 10 and name ``"mnist_sample/<split>"``.

    Raises:
        ValueError: for an unknown split, or ``n`` not in [1, available].
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    arrays = _sample_arrays()
    x_all, y_all = arrays[f"x_{split}"], arrays[f"y_{split}"]
    n = _check_n(n, len(y_all), f"the MNIST sample {split!r} split")
    x = _to_unit_float(x_all[:n])[..., None]
    y = y_all[:n].astype(np.int32)
    validate_images(x, y, 10)
    return Dataset(x=x, y=y, num_classes=10, name=f"mnist_sample/{split}")


def load_tfds(
    name: str,
    split: str = "test",
    n: int | None = None,
    data_dir: str | None = None,
    download: bool = False,
) -> Dataset:
    """Loads an image classification dataset through tensorflow-datasets.

    Works for datasets with ``(image, label)`` supervised keys and images of one
    fixed shape, e.g. ``"mnist"``, ``"cifar10"``, ``"cifar100"`` or
    ``"imagenet_resized/64x64"`` (``"imagenet2012"`` has images of varying
    size and must be resized beforehand). The whole split (or its first ``n``
    examples) is read into memory.

    Args:
        name: tfds dataset name, optionally with config, e.g. ``"cifar10"``.
        split: tfds split name, e.g. ``"test"`` or ``"validation"``.
        n: take the first ``n`` examples of the split; None for all.
        data_dir: tfds data directory; None for the tfds default
            (``~/tensorflow_datasets``).
        download: if True, download and prepare the data when missing. If
            False (default), nothing is downloaded.

    Returns:
        A :class:`Dataset` with float32 images in [0, 1] and int32 labels.

    Raises:
        ImportError: tensorflow-datasets is not installed.
        FileNotFoundError: the data is not prepared and ``download`` is False.
        ValueError: bad ``n``, or the loaded data fails :func:`validate_images`.
    """
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:
        raise ImportError(
            "load_tfds needs tensorflow-datasets, which is not installed; "
            f"install it with `{_TFDS_HINT}`"
        ) from err

    if n is not None:
        n = _check_n(n, None, "the split")
        tfds_split = f"{split}[:{n}]"
    else:
        tfds_split = split
    try:
        data, info = tfds.load(
            name,
            split=tfds_split,
            data_dir=data_dir,
            download=download,
            as_supervised=True,
            batch_size=-1,
            with_info=True,
        )
    except (AssertionError, FileNotFoundError) as err:
        if download:
            raise
        where = data_dir if data_dir is not None else "the default tfds data_dir"
        raise FileNotFoundError(
            f"tfds dataset {name!r} is not prepared in {where}. Pass download=True "
            f"to load_tfds, or run `tfds build {name}"
            + (f" --data_dir {data_dir}" if data_dir is not None else "")
            + "` first."
        ) from err

    x_raw, y_raw = tfds.as_numpy(data)
    x = _to_unit_float(x_raw)
    if x.ndim == 3:  # Grayscale stored without a channel axis.
        x = x[..., None]
    y = np.asarray(y_raw).astype(np.int32)
    if n is not None and len(y) < n:
        raise ValueError(
            f"n={n} is larger than the {len(y)} examples available in "
            f"{name!r} split {split!r}"
        )
    num_classes = int(info.features["label"].num_classes)
    validate_images(x, y, num_classes)
    return Dataset(x=x, y=y, num_classes=num_classes, name=f"{name}/{split}")


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


def num_batches(n: int, batch_size: int) -> int:
    """Returns the number of batches of ``batch_size`` needed for ``n`` rows.

    Args:
        n: number of examples, >= 0.
        batch_size: rows per batch, >= 1.

    Raises:
        ValueError: ``n`` negative or ``batch_size`` < 1.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return -(-n // batch_size)


def batches(
    dataset_or_x: Dataset | np.ndarray,
    y: np.ndarray | None = None,
    batch_size: int = 256,
    start: int = 0,
) -> Iterator[Batch]:
    """Yields fixed-size batches covering every example once, in order.

    Each batch has exactly ``batch_size`` rows. The last batch is padded by
    repeating the last real example (its ``example_id`` too) with ``mask``
    False, so shapes never change and all ids are valid indices. Concatenating
    ``x[mask]`` over all batches reproduces the dataset.

    Args:
        dataset_or_x: a :class:`Dataset`, or an image array [N, ...] (then pass
            ``y``).
        y: labels [N]; required with an array, must be None with a Dataset.
        batch_size: rows per batch, >= 1.
        start: index of the first batch to yield, to resume an interrupted
            run; in [0, num_batches(N, batch_size)].

    Yields:
        :class:`Batch` of numpy arrays (copies, not views).

    Raises:
        ValueError: bad ``y``, ``batch_size`` or ``start``.
    """
    if isinstance(dataset_or_x, Dataset):
        if y is not None:
            raise ValueError("pass y only with an image array, not with a Dataset")
        x, y = dataset_or_x.x, dataset_or_x.y
    else:
        if y is None:
            raise ValueError("y is required when passing an image array")
        x = dataset_or_x
    x, y = np.asarray(x), np.asarray(y)
    if len(x) != len(y):
        raise ValueError(f"length mismatch: {len(x)} images but {len(y)} labels")
    n = len(x)
    total = num_batches(n, batch_size)
    if not 0 <= start <= total:
        raise ValueError(f"start must be in [0, {total}] for {n} examples, got {start}")
    return _batch_iter(x, y, batch_size, start, total)


def _batch_iter(
    x: np.ndarray, y: np.ndarray, batch_size: int, start: int, total: int
) -> Iterator[Batch]:
    n = len(x)
    for b in range(start, total):
        rows = np.arange(b * batch_size, (b + 1) * batch_size)
        mask = rows < n
        ids = np.minimum(rows, n - 1).astype(np.int32)
        yield Batch(x=x[ids], y=y[ids], mask=mask, example_id=ids)
