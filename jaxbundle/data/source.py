"""Data sources by name, and everything of :mod:`jaxbundle.data.base` under its old path.

:func:`open_source` turns ``mnist-sample[:SPLIT]``, ``npz:PATH`` or ``tfds:NAME[:SPLIT]`` into
a :class:`~jaxbundle.data.base.Source`; the sources are imported only when named (tfds needs
tensorflow-datasets). The protocol, :class:`ArraySource`, :func:`head` and :func:`local_batch`
live in :mod:`jaxbundle.data.base` and :class:`Dataset` in :mod:`jaxbundle.data.dataset`; they
are re-exported here.
"""

from __future__ import annotations

from jaxbundle.data.base import ArraySource, Source, head, local_batch
from jaxbundle.data.dataset import Dataset

__all__ = [
    "ArraySource",
    "Dataset",
    "Source",
    "head",
    "local_batch",
    "open_source",
    "SOURCE_FORMS",
]

SOURCE_FORMS = ("mnist-sample[:SPLIT]", "npz:PATH", "tfds:NAME[:SPLIT]")


def open_source(
    spec: str,
    *,
    data_dir: str | None = None,
    download: bool = False,
    image_size: int | None = None,
) -> Source:
    """The source that ``spec`` names: ``mnist-sample[:SPLIT]`` (the embedded sample, test split
    by default), ``npz:PATH`` or ``tfds:NAME[:SPLIT]`` (tensorflow-datasets' ``data_source``
    in ``data_dir``; nothing is downloaded unless ``download``)."""
    kind, _, rest = spec.partition(":")
    if image_size is not None and kind != "tfds":
        raise ValueError("image_size (resizing on read) is only for tfds sources")
    if kind == "mnist-sample":
        from jaxbundle.data.sample import sample_source

        return sample_source(rest or "test")
    if kind == "npz" and rest:
        from jaxbundle.data.npz import NpzSource

        return NpzSource(rest)
    if kind == "tfds" and rest:
        from jaxbundle.data.tfds import TfdsSource

        name, _, split = rest.partition(":")
        return TfdsSource(
            name, split or "test", data_dir=data_dir, download=download, image_size=image_size
        )
    raise ValueError(f"unknown data source {spec!r}; use one of {', '.join(SOURCE_FORMS)}")
