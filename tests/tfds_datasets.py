"""Real tensorflow-datasets builders over the embedded MNIST sample, prepared into a temporary
``data_dir`` in the ``array_record`` format (no TensorFlow, no network): what the tfds source is
tested on.

``TinyDigits``: the first test images of the sample (28x28x1) as split ``test`` and the first
training images as ``train``. ``TinyColour``: the same digits on 32x32x3 colour canvases (a
CIFAR-shaped dataset with 10 classes).
"""

from __future__ import annotations

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

from jaxbundle import data

SIZES = {"test": 96, "train": 64}


def _examples(split: str, colour: bool):
    sample = data.load_mnist_sample(split, n=SIZES[split])
    digits = np.round(sample.x[..., 0] * 255).astype(np.uint8)
    rng = np.random.default_rng(0)
    for i, (digit, label) in enumerate(zip(digits, sample.y)):
        if colour:
            canvas = np.zeros((32, 32, 3), np.uint8) + rng.integers(0, 60, 3, dtype=np.uint8)
            tint = rng.uniform(0.5, 1.0, 3)
            canvas[2:30, 2:30] = np.maximum(canvas[2:30, 2:30], digit[..., None] * tint)
            image = Image.fromarray(canvas)
        else:
            image = Image.fromarray(digit)
        yield i, {"image": image, "label": int(label)}


class TinyDigits(tfds.core.GeneratorBasedBuilder):
    """First images of the embedded MNIST sample."""

    VERSION = tfds.core.Version("1.0.0")
    SHAPE = (28, 28, 1)
    COLOUR = False

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=self.SHAPE),
                "label": tfds.features.ClassLabel(num_classes=10),
            }),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(split) for split in SIZES}

    def _generate_examples(self, split):
        yield from _examples(split, self.COLOUR)


class TinyColour(TinyDigits):
    """The same digits on 32x32 colour canvases."""

    SHAPE = (32, 32, 3)
    COLOUR = True


def prepare(data_dir: str) -> None:
    """Builds both datasets into ``data_dir`` (about a second)."""
    for builder in (TinyDigits, TinyColour):
        builder(data_dir=data_dir, file_format="array_record").download_and_prepare()
