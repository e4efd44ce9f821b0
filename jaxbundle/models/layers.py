"""The demo CNNs' convolution layer: flax's ``nn.Conv(padding="SAME")`` computed by
:func:`jaxbundle.core.canonical.conv_same`, whose backward pass stays fast on XLA:CPU in loops.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from jaxbundle.core.canonical import (CanonicalConvolutions, _conv_forward,  # noqa: F401
                                 canonical_convolutions, conv_same)

__all__ = ["CanonicalConvolutions", "Conv", "canonical_convolutions", "conv_same"]


class Conv(nn.Module):
    """``nn.Conv(features, (kernel, kernel), strides=stride, padding="SAME")`` with the same
    parameters and initialisers, computed by :func:`conv_same` (fast input gradients in loops).
    """

    features: int
    kernel: int
    stride: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = (self.kernel, self.kernel, x.shape[-1], self.features)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), shape)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        return conv_same(x, kernel, self.stride) + bias[None, None, None, :]
