"""``tfds:NAME[:SPLIT]``: a tensorflow-datasets dataset, read through its ``data_source``.

``data_source`` reads the ``array_record`` files random-access and the images are decoded with
PIL, so it needs no TensorFlow (``pip install 'jaxbundle[tfds]'``). Nothing is downloaded
unless ``download=True``, which prepares the dataset in the ``array_record`` format. A dataset
prepared elsewhere is read from its files alone (its builder code need not be importable).

Images of varying size (``imagenet2012``) need ``image_size``: each image's shorter side is
resized to ``image_size / 0.875`` and the centre ``image_size`` square kept (the standard
ImageNet evaluation crop), on the uint8 pixels, so the result stays on the 8-bit grid.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

__all__ = ["TfdsSource", "center_crop"]

_HINT = "pip install 'jaxbundle[tfds]'"
_CROP_FRACTION = 0.875


def center_crop(image: np.ndarray, size: int) -> np.ndarray:
    """uint8 ``[H, W, C]``: shorter side resized (bilinear) to ``size / 0.875``, then the centre
    ``size x size``."""
    from PIL import Image

    h, w = image.shape[:2]
    scale = round(size / _CROP_FRACTION) / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    channels = image.shape[2] if image.ndim == 3 else 1
    pil = Image.fromarray(image[..., 0] if channels == 1 else image)
    out = np.asarray(pil.resize((nw, nh), Image.BILINEAR))
    top, left = (nh - size) // 2, (nw - size) // 2
    out = out[top : top + size, left : left + size]
    return out[..., None] if out.ndim == 2 else out


def _decode(encoded: bytes, channels: int) -> np.ndarray:
    """A PNG or JPEG image as uint8 ``[H, W, channels]`` (PIL; no TensorFlow, no OpenCV)."""
    from PIL import Image

    with Image.open(io.BytesIO(encoded)) as image:
        image = image.convert("L" if channels == 1 else "RGB")
        array = np.asarray(image)
    return array[..., None] if array.ndim == 2 else array


class TfdsSource:
    """Split ``split`` of tfds dataset ``name`` in ``data_dir`` (see the module docstring)."""

    def __init__(
        self,
        name: str,
        split: str = "test",
        *,
        data_dir: str | None = None,
        download: bool = False,
        image_size: int | None = None,
    ):
        try:
            import tensorflow_datasets as tfds
        except ImportError:
            raise ImportError(
                f"tfds sources need tensorflow-datasets, which is not installed: {_HINT}"
            ) from None
        where = data_dir or "the default tfds data_dir (~/tensorflow_datasets)"
        try:
            builder = tfds.builder(name, data_dir=data_dir)
        except Exception as err:  # DatasetNotFoundError and friends
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise FileNotFoundError(
                f"tfds dataset {name!r} is neither prepared in {where} nor known to "
                f"tensorflow-datasets ({first})"
            ) from None
        if not builder.is_prepared():
            if not download:
                raise FileNotFoundError(
                    f"tfds dataset {name!r} is not prepared in {where}; pass --download (or "
                    f"download=True) to download and prepare it, or point --data-dir at it"
                )
            builder.download_and_prepare(file_format="array_record")
        info = builder.info
        if split not in info.splits:
            raise ValueError(
                f"tfds dataset {name!r} has no split {split!r}; it has {sorted(info.splits)}"
            )
        keys = info.supervised_keys
        if not keys or len(keys) != 2:
            raise ValueError(f"tfds dataset {name!r} has no (image, label) supervised keys")
        self._image_key, self._label_key = keys
        try:
            feature = info.features[self._image_key]
            # Encoded images are decoded here with PIL (tfds would warn about OpenCV).
            self._encoded = isinstance(feature, tfds.features.Image)
            decoders = {self._image_key: tfds.decode.SkipDecoding()} if self._encoded else None
            self._data = builder.as_data_source(split=split, decoders=decoders)
        except Exception as err:
            raise ValueError(
                f"tfds dataset {name!r} cannot be read random-access ({err}); prepare it in "
                "the array_record format (tfds build --file_format=array_record)"
            ) from None
        label = info.features[self._label_key]
        image_shape = tuple(info.features[self._image_key].shape)
        if image_size is not None:
            image_shape = (image_size, image_size, image_shape[-1])
        elif None in image_shape:
            raise ValueError(
                f"tfds dataset {name!r} has images of varying size {image_shape}; pass an "
                "image size (--image-size 224) to resize and centre-crop them"
            )
        self.name = f"tfds:{name}/{split}"
        self.num_classes = getattr(label, "num_classes", None)
        self.shape = image_shape
        self.dtype = np.dtype(info.features[self._image_key].np_dtype)
        self._info = {
            "source": "tfds", "name": name, "split": split, "version": str(info.version),
            "num_examples": len(self._data), "image_size": image_size,
        }
        self._image_size = image_size

    def __len__(self) -> int:
        return len(self._data)

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        records = self._data.__getitems__(list(range(start, stop)))
        images = [r[self._image_key] for r in records]
        if self._encoded:
            images = [_decode(im, self.shape[-1]) for im in images]
        if self._image_size is not None:
            images = [center_crop(im, self._image_size) for im in images]
        labels = np.asarray([r[self._label_key] for r in records], np.int64)
        return np.stack(images), labels

    def describe(self) -> dict[str, Any]:
        return dict(self._info)
