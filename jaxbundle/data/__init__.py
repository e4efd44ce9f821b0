"""Datasets: sources read in pieces, fixed-shape batching and image checks.

Images are ``[N, H, W, C]`` arrays, stored as uint8 (0..255) or floats in [0, 1] and evaluated
as float32 in [0, 1]; labels are integers ``[N]``.

* :mod:`~jaxbundle.data.base`: the :class:`Source` protocol every source follows
  (``read(start, stop)``), the in-memory :class:`ArraySource` and :func:`local_batch` (a
  process's rows of a global batch);
* :mod:`~jaxbundle.data.source`: :func:`open_source` (``mnist-sample``, ``npz:PATH``,
  ``tfds:NAME[:SPLIT]``), on top of the sources (it re-exports :mod:`~jaxbundle.data.base`);
* :mod:`~jaxbundle.data.dataset`: :class:`Dataset`, an in-memory dataset;
* :mod:`~jaxbundle.data.sample`: the small real MNIST sample embedded in the package (first
  10,000 training and first 2,000 test images, CC BY-SA 3.0, see ``LICENSE-MNIST.txt``);
* :mod:`~jaxbundle.data.npz`, :mod:`~jaxbundle.data.tfds`: user data (tensorflow-datasets
  without TensorFlow, ``pip install 'jaxbundle[tfds]'``);
* :mod:`~jaxbundle.data.batching`: batches of a constant size, the last one padded and masked;
* :mod:`~jaxbundle.data.images`: validation, uint8 conversion and :func:`translate` (sub-pixel
  shifts: off-grid data for testing).

Nothing is downloaded at import time, nor later unless asked for.
"""

from __future__ import annotations

import numpy as np

from jaxbundle.data.base import ArraySource, Source, head, local_batch
from jaxbundle.data.batching import (Batch, balanced_batch, batches, check_local_rows,
                                     num_batches)
from jaxbundle.data.dataset import Dataset
from jaxbundle.data.images import (check_labels, check_n, check_pixels, to_unit_float, translate,
                                   validate_images)
from jaxbundle.data.sample import load_mnist_sample, sample_source
from jaxbundle.data.source import SOURCE_FORMS, open_source

__all__ = [
    "ArraySource",
    "Batch",
    "Dataset",
    "SOURCE_FORMS",
    "Source",
    "balanced_batch",
    "batches",
    "check_local_rows",
    "head",
    "load_mnist_sample",
    "load_tfds",
    "local_batch",
    "num_batches",
    "open_source",
    "sample_source",
    "to_unit_float",
    "translate",
    "validate_images",
    "check_pixels",
    "check_labels",
]


def load_tfds(
    name: str,
    split: str = "test",
    n: int | None = None,
    data_dir: str | None = None,
    download: bool = False,
) -> Dataset:
    """The first ``n`` examples (all for None) of a tfds split, in memory, as float32 in [0, 1]
    (see :class:`jaxbundle.data.tfds.TfdsSource`; for large splits stream the source instead)."""
    from jaxbundle.data.tfds import TfdsSource

    check_n(n, None, "the split")
    source = head(TfdsSource(name, split, data_dir=data_dir, download=download), n)
    x, y = source.read(0, len(source))
    x, y = to_unit_float(x), np.asarray(y, np.int32)
    num_classes = source.num_classes or int(y.max()) + 1
    validate_images(x, y, num_classes)
    return Dataset(x=x, y=y, num_classes=num_classes, name=f"{name}/{split}")
