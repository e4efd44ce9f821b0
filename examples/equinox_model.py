"""An Equinox CNN for 28x28 grey-scale images, as jaxbundle loads it: ``equinox_model.py:model``.

Equinox layers work on one example at a time (channels first); jaxbundle calls a model on a
batch ``[B, 28, 28, 1]``, so ``Batched`` maps the per-example model over the batch with
``jax.vmap``. ``model()`` returns it in inference mode (``eqx.nn.inference_mode``: Dropout
off); jaxbundle passes its arrays (``eqx.partition(model, eqx.is_array)``) to the compiled
attacks as an argument. The weights here are freshly initialised (an untrained model); load
trained ones with ``eqx.tree_deserialise_leaves(path, model)``.
"""

from __future__ import annotations

import equinox as eqx
import jax

MEAN, STD = 0.1307, 0.3081  # MNIST pixel statistics


class CNN(eqx.Module):
    """One image ``[28, 28, 1]`` in ``[0, 1]`` to its 10 logits."""

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    dense1: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    dense2: eqx.nn.Linear

    def __init__(self, key, num_classes=10):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.conv1 = eqx.nn.Conv2d(1, 16, 3, stride=2, padding=1, key=k1)  # 28 -> 14
        self.conv2 = eqx.nn.Conv2d(16, 32, 3, stride=2, padding=1, key=k2)  # 14 -> 7
        self.dense1 = eqx.nn.Linear(7 * 7 * 32, 64, key=k3)
        self.dropout = eqx.nn.Dropout(0.5)
        self.dense2 = eqx.nn.Linear(64, num_classes, key=k4)

    def __call__(self, x, key=None):
        x = (x.transpose(2, 0, 1) - MEAN) / STD  # [1, 28, 28]: Equinox is channels-first
        x = jax.nn.relu(self.conv2(jax.nn.relu(self.conv1(x))))
        x = jax.nn.relu(self.dense1(x.reshape(-1)))
        return self.dense2(self.dropout(x, key=key))


class Batched(eqx.Module):
    """A per-example model on a batch: ``[B, 28, 28, 1]`` to logits ``[B, 10]``."""

    net: CNN

    def __call__(self, x):
        return jax.vmap(self.net)(x)


def model(seed=0):
    return eqx.nn.inference_mode(Batched(CNN(jax.random.key(seed))))
