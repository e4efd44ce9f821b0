"""A 'SAME' convolution whose backward pass stays fast on XLA:CPU inside loops.

:func:`conv_same` computes what ``flax.linen.Conv(padding="SAME")`` computes, with a custom VJP
whose input gradient is again an NHWC/HWIO convolution; :class:`Conv` is the flax module.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["Conv", "conv_same"]


def _same_padding(size: int, kernel: int, stride: int) -> tuple[int, int, int]:
    """Output size and (low, high) padding of a 'SAME' convolution (as flax and TF pad)."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return out, total // 2, total - total // 2


def _conv_forward(x: jax.Array, kernel: jax.Array, stride: int) -> jax.Array:
    pads = [_same_padding(x.shape[d], kernel.shape[d - 1], stride)[1:] for d in (1, 2)]
    return jax.lax.conv_general_dilated(
        x, kernel, (stride, stride), pads, dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def conv_same(x: jax.Array, kernel: jax.Array, stride: int) -> jax.Array:
    """A 'SAME' NHWC/HWIO convolution whose input gradient is also an NHWC/HWIO convolution.

    The numbers are those of ``flax.linen.Conv(padding="SAME")``. Only the backward pass
    differs in form: JAX's transpose rule gives the input-gradient convolution an ``01oi``
    kernel layout, which XLA:CPU canonicalises only outside loops; inside a ``lax.scan`` it
    falls back to a naive emitter, measured 4-6x slower (benchmarks/README.md). Here the
    kernel is flipped and transposed for real, so every convolution is canonical.
    """
    return _conv_forward(x, kernel, stride)


def _conv_same_fwd(x, kernel, stride):
    return _conv_forward(x, kernel, stride), (x, kernel)


def _conv_same_bwd(stride, residuals, g):
    x, kernel = residuals
    flipped = jnp.swapaxes(jnp.flip(kernel, (0, 1)), 2, 3)
    pads = []
    for d in (1, 2):
        size, k = x.shape[d], kernel.shape[d - 1]
        out, low, _ = _same_padding(size, k, stride)
        pads.append((k - 1 - low, size - (out - 1) * stride - 1 + low))
    dx = jax.lax.conv_general_dilated(
        g, flipped, (1, 1), pads, lhs_dilation=(stride, stride),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    dkernel = jax.vjp(lambda k: _conv_forward(x, k, stride), kernel)[1](g)[0]
    return dx, dkernel


conv_same.defvjp(_conv_same_fwd, _conv_same_bwd)


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
