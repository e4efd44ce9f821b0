"""Fixed-shape batches: every batch has ``batch_size`` rows, the last one padded and masked, so
jitted code never sees a new shape."""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple

import jax
import numpy as np

from jaxbundle.data.dataset import Dataset

__all__ = ["Batch", "balanced_batch", "batches", "check_local_rows", "num_batches"]


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


def balanced_batch(batch_size: int, n: int, devices: int = 1) -> int:
    """The batch size a run of ``n`` examples uses under a plan's ``batch_size``: as many
    batches as ``batch_size`` needs, of about equal size, rounded up to a multiple of the
    largest power of two dividing ``batch_size`` (so the same on one CPU and on any
    power-of-two mesh that divides the batch size; ``batch_size`` itself where ``devices``
    does not divide that). Every batch then has the same bucket sizes and about the same
    survivors, so the programs compiled for the first batch serve the others; a small last
    batch (250 + 6 for 256 examples) would compile a cascade's every stage again at its own
    sizes."""
    grain = batch_size & -batch_size  # the largest power of two dividing it
    size = min(batch_size, -(-(-(-n // -(-n // batch_size))) // grain) * grain)
    return size if size % devices == 0 else batch_size


def check_local_rows(sharding: Any, batch_size: int, shape: tuple[int, ...]) -> None:
    """The rows of a global batch that this process's devices hold under ``sharding`` (a
    ``NamedSharding`` over the batch axis) must be its ``p``-th slice, the rows
    :func:`jaxbundle.data.local_batch` reads."""
    p, count = jax.process_index(), jax.process_count()
    rows = sorted(
        r
        for index in sharding.addressable_devices_indices_map((batch_size, *shape)).values()
        for r in range(*index[0].indices(batch_size))
    )
    per = batch_size // count
    if sorted(set(rows)) != list(range(p * per, (p + 1) * per)):
        raise ValueError(
            "the mesh must list each process's devices together and in process order (as "
            "jax.devices() does), so that each process feeds a contiguous slice of the batch"
        )
