"""A flax NNX CNN for 28x28 grey-scale images, as jaxbundle loads it: ``nnx_model.py:model``.

``model()`` returns the module itself, in inference mode (``model.eval()``: Dropout off,
BatchNorm on its running averages). jaxbundle splits it (``nnx.split``) into its graph and its
state, and passes the state to the compiled attacks as an argument, so the weights are never
compiled in. The weights here are freshly initialised (an untrained model, for trying things
out); restore trained ones into the module first, e.g. with orbax: ``nnx.update(net, state)``.
"""

from __future__ import annotations

import jax
from flax import nnx

MEAN, STD = 0.1307, 0.3081  # MNIST pixel statistics


class CNN(nnx.Module):
    def __init__(self, num_classes: int = 10, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, (3, 3), strides=2, rngs=rngs)  # 28 -> 14
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, (3, 3), strides=2, rngs=rngs)  # 14 -> 7
        self.dense1 = nnx.Linear(7 * 7 * 32, 64, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.dense2 = nnx.Linear(64, num_classes, rngs=rngs)

    def __call__(self, x):
        """Logits ``[B, 10]`` of images ``x``: float32 ``[B, 28, 28, 1]`` in ``[0, 1]``."""
        # Preprocessing belongs inside the model: attacks perturb the raw [0, 1] pixels.
        x = (x - MEAN) / STD
        x = jax.nn.relu(self.norm(self.conv1(x)))
        x = jax.nn.relu(self.conv2(x))
        x = jax.nn.relu(self.dense1(x.reshape(x.shape[0], -1)))
        return self.dense2(self.dropout(x))


def model(seed=0):
    net = CNN(rngs=nnx.Rngs(seed))
    net.eval()  # without it jaxbundle refuses the model: it is in training mode
    return net
