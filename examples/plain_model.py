"""A model without flax, as jaxbundle loads it: ``plain_model.py:model``.

Any function ``apply_fn(params, x) -> logits`` will do, with any pytree as ``params`` (here a
dict). This one is softmax regression on 28x28 grey-scale images; images of another size are
resized inside ``apply_fn``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

WEIGHTS = None  # or the path of an .npz written by np.savez(path, **params)
SIZE = 28  # the image side the model was trained on


def apply_fn(params, x):
    """Logits ``[B, 10]`` of images ``x``: float32 ``[B, H, W, 1]`` in ``[0, 1]``."""
    if x.shape[1:3] != (SIZE, SIZE):  # shapes are static, so this is fine under jit
        x = jax.image.resize(x, (x.shape[0], SIZE, SIZE, x.shape[3]), "bilinear")
    return x.reshape(x.shape[0], -1) @ params["w"] + params["b"][None, :]


def model():
    if WEIGHTS:
        with np.load(WEIGHTS) as f:
            params = {"w": jnp.asarray(f["w"]), "b": jnp.asarray(f["b"])}
    else:  # untrained: small random weights
        w = 0.01 * np.random.default_rng(0).standard_normal((SIZE * SIZE, 10), np.float32)
        params = {"w": jnp.asarray(w), "b": jnp.zeros(10)}
    return apply_fn, params
