"""The demo architectures: :class:`SmallCNN` and :class:`MLP`, and the module of a config."""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax

from jaxbundle.models.config import TrainConfig
from jaxbundle.models.layers import Conv

__all__ = ["ARCHITECTURES", "MLP", "LinenCNN", "SmallCNN", "model_for", "model_name"]

Params = Any  # a flax variables dict: {"params": {...}}, or any pytree a model's apply_fn takes
ApplyFn = Callable[[Params, jax.Array], jax.Array]  # apply_fn(params, x) -> logits


class SmallCNN(nn.Module):
    """A small convolutional network for 28x28 grey-scale images.

    Two strided ``kernel x kernel`` convolutions (28 -> 14 -> 7), one hidden dense layer and
    a linear read-out, all with ReLU; with ``batch_norm``, a BatchNorm before each ReLU (the
    certified demo model's architecture, ``"small_cnn_bn"``). No dropout, so ``apply`` is a pure
    function of ``(variables, x)``: BatchNorm normalises by its stored statistics unless called
    with ``train=True`` (see :func:`jaxbundle.models.training.train`).

    Attributes:
      num_classes: number of output logits.
      conv1: channels of the first convolution.
      conv2: channels of the second convolution.
      hidden: width of the hidden dense layer.
      kernel: side of the square convolution kernels.
      batch_norm: a BatchNorm before each ReLU.
    """

    num_classes: int = 10
    conv1: int = 16
    conv2: int = 32
    hidden: int = 100
    kernel: int = 5
    batch_norm: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Computes logits.

        Args:
          x: images ``[B, H, W, C]``, float32 in ``[0, 1]``.
          train: BatchNorm normalises by this batch's statistics and stores them in place of
            the old ones (momentum 0: the training loop computes the running statistics);
            nothing without ``batch_norm``.

        Returns:
          Logits ``[B, num_classes]``, float32.
        """
        def relu(h: jax.Array, name: str) -> jax.Array:
            if self.batch_norm:
                h = nn.BatchNorm(use_running_average=not train, momentum=0.0, name=name)(h)
            return nn.relu(h)

        x = relu(Conv(self.conv1, self.kernel, stride=2, name="conv1")(x), "norm1")
        x = relu(Conv(self.conv2, self.kernel, stride=2, name="conv2")(x), "norm2")
        x = x.reshape(x.shape[0], -1)
        x = relu(nn.Dense(self.hidden, name="hidden")(x), "norm3")
        return nn.Dense(self.num_classes, name="logits")(x)


class LinenCNN(nn.Module):
    """A small CNN built from flax's own ``nn.Conv`` (the layers users' models have), for
    28x28 grey-scale images: two 3x3 stride-2 convolutions (28 -> 14 -> 7), a hidden dense
    layer and a linear read-out, all with ReLU. Trained independently of :class:`SmallCNN`
    (other layers, widths and seed), it is the second model of the benchmarks.

    Attributes:
      num_classes: number of output logits.
      conv1: channels of the first convolution.
      conv2: channels of the second convolution.
      hidden: width of the hidden dense layer.
    """

    num_classes: int = 10
    conv1: int = 32
    conv2: int = 64
    hidden: int = 128

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Computes logits ``[B, num_classes]`` from images ``[B, 28, 28, C]`` in ``[0, 1]``."""
        x = nn.relu(nn.Conv(self.conv1, (3, 3), strides=(2, 2), name="conv1")(x))
        x = nn.relu(nn.Conv(self.conv2, (3, 3), strides=(2, 2), name="conv2")(x))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.hidden, name="hidden")(x))
        return nn.Dense(self.num_classes, name="logits")(x)


class MLP(nn.Module):
    """A fully connected ReLU network; mostly useful for fast tests.

    Attributes:
      num_classes: number of output logits.
      hidden: widths of the hidden layers.
    """

    num_classes: int = 10
    hidden: tuple[int, ...] = (64,)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Computes logits ``[B, num_classes]`` from inputs ``[B, ...]``."""
        x = x.reshape(x.shape[0], -1)
        for i, width in enumerate(self.hidden):
            x = nn.relu(nn.Dense(width, name=f"hidden{i}")(x))
        return nn.Dense(self.num_classes, name="logits")(x)


ARCHITECTURES: dict[str, Callable[..., nn.Module]] = {
    "small_cnn": SmallCNN,
    "small_cnn_bn": functools.partial(SmallCNN, batch_norm=True),
    "linen_cnn": LinenCNN,
    "mlp": MLP,
}


def model_for(config: TrainConfig) -> nn.Module:
    """The (untrained) flax module that ``config`` describes.

    Configs with the same architecture share one module instance, so their ``module.apply``
    is the same function and the jitted bundle compiles once for all of them.
    """
    return _module(config.arch, config.num_classes)


@functools.cache
def _module(arch: str, num_classes: int) -> nn.Module:
    try:
        cls = ARCHITECTURES[arch]
    except KeyError:
        raise ValueError(
            f"unknown architecture {arch!r}; expected one of {sorted(ARCHITECTURES)}"
        ) from None
    return cls(num_classes=num_classes)


def model_name(config: TrainConfig) -> str:
    """A short human-readable name, e.g. ``"small_cnn-adv"`` (``-ibp`` / ``-crown-ibp`` for
    verified training); the cache file prefix."""
    return f"{config.arch}-{config.certified or ('adv' if config.adversarial else 'std')}"
