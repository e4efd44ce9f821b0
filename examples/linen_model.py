"""A flax linen CNN for 28x28 grey-scale images, as jaxbundle loads it: ``linen_model.py:model``.

``model()`` returns ``(apply_fn, params)``. The weights come from ``$MODEL_WEIGHTS`` (or
``WEIGHTS`` below): a file written by ``save_weights(params, "cnn.msgpack")``
(``flax.serialization``) or a directory written by ``save_orbax(params, "cnn_ckpt")`` (orbax).
Without either, the weights are freshly initialised: an untrained model, for trying things out.
"""

from __future__ import annotations

import os
import warnings

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp

WEIGHTS = None  # or a path, used when $MODEL_WEIGHTS is not set
MEAN, STD = 0.1307, 0.3081  # MNIST pixel statistics


class CNN(nn.Module):
    num_classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3), strides=2)(x))  # 28 -> 14
        x = nn.relu(nn.Conv(32, (3, 3), strides=2)(x))  # 14 -> 7
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(self.num_classes)(x)


NET = CNN()


def apply_fn(params, x):
    """Logits ``[B, 10]`` of images ``x``: float32 ``[B, 28, 28, 1]`` in ``[0, 1]``."""
    # Preprocessing belongs inside apply_fn: attacks perturb the raw [0, 1] pixels.
    return NET.apply(params, (x - MEAN) / STD)


def init_params(seed=0):
    return NET.init(jax.random.key(seed), jnp.zeros((1, 28, 28, 1), jnp.float32))


def abstract_params():
    """The structure, shapes and dtypes of the params, for the loaders (nothing is computed)."""
    return jax.eval_shape(init_params)


def save_weights(params, path):
    with open(path, "wb") as f:
        f.write(flax.serialization.to_bytes(params))


def load_weights(path):
    with open(path, "rb") as f:
        return flax.serialization.from_bytes(abstract_params(), f.read())


def save_orbax(params, directory):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:  # waits for the save on exit
        checkpointer.save(os.path.abspath(directory), params)


def load_orbax(directory):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(os.path.abspath(directory), abstract_params())


def model():
    path = os.environ.get("MODEL_WEIGHTS", WEIGHTS)
    if not path:
        warnings.warn("linen_model: no weights given, using an untrained model")
        return apply_fn, init_params()
    return apply_fn, load_orbax(path) if os.path.isdir(path) else load_weights(path)
