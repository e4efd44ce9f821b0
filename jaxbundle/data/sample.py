"""The embedded MNIST sample: the first 10,000 training and 2,000 test images of MNIST,
unmodified, in the original order (CC BY-SA 3.0, see ``LICENSE-MNIST.txt``); no network."""

from __future__ import annotations

import functools
import importlib.resources

import numpy as np

from jaxbundle.data.images import check_n, to_unit_float, validate_images
from jaxbundle.data.base import ArraySource
from jaxbundle.data.dataset import Dataset

__all__ = ["load_mnist_sample", "sample_source"]

_SAMPLE_FILE = "mnist_sample.npz"
_SPLITS = ("train", "test")


@functools.lru_cache(maxsize=1)
def _sample_arrays() -> dict[str, np.ndarray]:
    """Reads the embedded uint8 MNIST sample once (about 9 MB in memory)."""
    resource = importlib.resources.files("jaxbundle.data").joinpath(_SAMPLE_FILE)
    with resource.open("rb") as f, np.load(f) as npz:
        arrays = {key: npz[key] for key in npz.files}
    for a in arrays.values():
        a.setflags(write=False)
    return arrays


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
    n = check_n(n, len(y_all), f"the MNIST sample {split!r} split")
    x = to_unit_float(x_all[:n])[..., None]
    y = y_all[:n].astype(np.int32)
    validate_images(x, y, 10)
    return Dataset(x=x, y=y, num_classes=10, name=f"mnist_sample/{split}")



def sample_source(split: str = "test") -> ArraySource:
    """The sample's ``split`` as a :class:`~jaxbundle.data.base.Source` (uint8 images)."""
    if split not in _SPLITS:
        raise ValueError(f"mnist-sample split must be one of {_SPLITS}, got {split!r}")
    arrays = _sample_arrays()
    source = ArraySource(
        arrays[f"x_{split}"][..., None], arrays[f"y_{split}"].astype(np.int32), 10,
        name=f"mnist_sample/{split}", description={"source": "mnist-sample", "split": split},
    )
    return source
