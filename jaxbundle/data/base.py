"""The one protocol every data source follows, the in-memory source, and reading a batch.

A :class:`Source` is read in pieces: ``read(start, stop)`` returns rows ``[start, stop)``, so
an evaluation never holds more than a few batches of a dataset, whatever its size. Images come
as stored (``uint8`` 0..255, or floats in [0, 1]) and are converted per batch.

Under ``jax.distributed``, :func:`local_batch` gives each process only the rows it feeds to its
own devices: global batch ``b`` is rows ``[b * B, (b + 1) * B)`` and process ``p`` of ``P``
reads the ``p``-th of its ``P`` equal slices, so the union over processes is the single-process
batch, row for row.

Opening a source by name (:func:`jaxbundle.data.source.open_source`) is one layer up, in
:mod:`jaxbundle.data.source`, which imports the sources themselves.
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jaxbundle.data.batching import Batch, num_batches
from jaxbundle.data.images import check_n

__all__ = ["ArraySource", "Source", "head", "local_batch"]


@runtime_checkable
class Source(Protocol):
    """A labelled image dataset read in contiguous pieces.

    Attributes:
      name: what the report calls it, e.g. ``"tfds:cifar10/test"``.
      num_classes: the label count if the source knows it, else None.
      shape: one image's shape ``(H, W, C)``.
      dtype: how pixels are stored: ``uint8`` (0..255, on the 8-bit grid) or a float dtype.
    """

    name: str
    num_classes: int | None
    shape: tuple[int, ...]
    dtype: np.dtype

    def __len__(self) -> int: ...

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Images ``[stop - start, H, W, C]`` as stored, and integer labels ``[stop - start]``."""
        ...

    def describe(self) -> dict[str, Any]:
        """A JSON-able description that is the same for the same data in every process."""
        ...


class ArraySource:
    """Arrays already in memory (images ``[N, H, W, C]``, uint8 or floats in [0, 1]; toy models
    may take vectors ``[N, D]``).

    ``description`` names fixed content (the embedded sample); by default the arrays' bytes are
    hashed on the first :meth:`describe`.
    """

    in_memory = True  # the whole dataset is in host memory already

    def __init__(
        self,
        x: Any,
        y: Any,
        num_classes: int | None = None,
        name: str = "arrays",
        description: dict[str, Any] | None = None,
    ):
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim < 2:
            raise ValueError(f"images must be an array [N, H, W, C], got shape {x.shape}")
        if y.shape != (x.shape[0],):
            raise ValueError(f"labels must have shape [{x.shape[0]}], got {y.shape}")
        self.x, self.y = x, y
        self.name, self.num_classes = name, num_classes
        self.shape, self.dtype = tuple(x.shape[1:]), x.dtype
        self._description = description

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[start:stop], self.y[start:stop]

    def describe(self) -> dict[str, Any]:
        if self._description is None:  # the content itself, hashed once
            h = hashlib.sha256()
            for a in (self.x, self.y):
                h.update(f"{a.dtype}{a.shape}".encode())
                h.update(np.ascontiguousarray(a).tobytes())
            self._description = {"source": "arrays", "sha256": h.hexdigest()}
        return self._description


class _Head:
    """The first ``n`` examples of another source."""

    def __init__(self, source: Source, n: int):
        self.source, self.n = source, n
        self.name = f"{source.name}[:{n}]"
        self.num_classes, self.shape, self.dtype = source.num_classes, source.shape, source.dtype
        self.in_memory = getattr(source, "in_memory", False)

    def __len__(self) -> int:
        return self.n

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        return self.source.read(start, min(stop, self.n))

    def describe(self) -> dict[str, Any]:
        return dict(self.source.describe(), n=self.n)


def head(source: Source, n: int | None) -> Source:
    """The first ``n`` examples of ``source`` (all of them for None); ``n`` must be available."""
    n = check_n(n, len(source), source.name)
    return source if n == len(source) else _Head(source, n)


def local_batch(
    source: Source,
    index: int,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
) -> Batch:
    """This process's rows of global batch ``index`` (all of them for one process).

    Rows past the end of the source are padding: they repeat its last example (``example_id``
    included) with ``mask`` False, as in :func:`jaxbundle.data.batches`.
    """
    n = len(source)
    if not 0 <= index < num_batches(n, batch_size):
        raise ValueError(f"batch {index} is out of range for {n} examples")
    if batch_size % process_count:
        raise ValueError(f"batch_size {batch_size} must divide over {process_count} processes")
    rows_per_process = batch_size // process_count
    lo = index * batch_size + process_index * rows_per_process
    rows = np.arange(lo, lo + rows_per_process)
    ids = np.minimum(rows, n - 1)
    first = int(ids[0])
    x, y = source.read(first, int(ids[-1]) + 1)
    if len(x) != int(ids[-1]) + 1 - first or len(y) != len(x):
        raise ValueError(
            f"{source.name} returned {len(x)} images and {len(y)} labels for rows "
            f"{first}..{int(ids[-1])}"
        )
    take = ids - first
    return Batch(
        x=np.asarray(x)[take], y=np.asarray(y)[take], mask=rows < n,
        example_id=ids.astype(np.int32),
    )
