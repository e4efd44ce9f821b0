"""A flax linen CNN with BatchNorm, as jaxbundle loads it: ``linen_batchnorm_model.py:model``.

``model()`` returns ``(module, variables)``: jaxbundle calls ``module.apply(variables, x)``
with nothing mutable, so the module must be built for inference (``train=False``: BatchNorm on
its running averages in ``variables["batch_stats"]``). A module built for training (BatchNorm
updating its ``batch_stats``, Dropout asking for a ``dropout`` rng) is refused with one line.
The weights are freshly initialised and the running averages measured on 256 images of the
embedded MNIST sample: an untrained model, for trying things out.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

MEAN, STD = 0.1307, 0.3081  # MNIST pixel statistics


class CNN(nn.Module):
    num_classes: int = 10
    train: bool = False

    @nn.compact
    def __call__(self, x):
        x = (x - MEAN) / STD  # preprocessing inside: attacks perturb the raw [0, 1] pixels
        x = nn.Conv(16, (3, 3), strides=2)(x)  # 28 -> 14
        x = nn.relu(nn.BatchNorm(use_running_average=not self.train, momentum=0.0)(x))
        x = nn.relu(nn.Conv(32, (3, 3), strides=2)(x))  # 14 -> 7
        x = nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
        return nn.Dense(self.num_classes)(x)


def init_variables(seed=0):
    """``{"params": ..., "batch_stats": ...}``, the running averages those of 256 images."""
    from jaxbundle import data

    x = jnp.asarray(data.load_mnist_sample("train", n=256).x)
    variables = CNN().init(jax.random.key(seed), x[:1])
    # One pass in training mode (momentum 0: the running averages become this batch's).
    _, stats = CNN(train=True).apply(variables, x, mutable=["batch_stats"])
    return {**variables, **stats}


def model():
    return CNN(), init_variables()
