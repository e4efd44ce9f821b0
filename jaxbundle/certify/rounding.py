"""Float32 rounding, bounded: what makes a certificate hold for the model as it computes.

A bound in real arithmetic is not a bound on the model's float32 outputs, and a bound computed
in float32 is not a bound in real arithmetic. Every bound this package returns covers both:

* **the model's rounding**: each x-dependent equation's float32 output lies within a slack of
  the exact result of its float32 inputs, so the bounds contain the model's float32 values at
  every point of the input set, not only the real function's;
* **the bound's own rounding**: the centers, radii, CROWN's coefficients and constants, and
  the minimum over the input set are computed in float32 too; each is allowed for where it is
  computed.

The error model is Higham's (*Accuracy and Stability of Numerical Algorithms*, 2002, §3.1):
with unit roundoff ``u = 2^-24`` (float32, round to nearest), a sum of ``n`` products computed
in any order and blocking, with or without fused multiply-adds, satisfies

    |fl(sum_i a_i b_i) - sum_i a_i b_i| <= gamma_n sum_i |a_i b_i|,   gamma_n = n u / (1 - n u),

and with each product within a relative ``delta`` of the exact one (a matrix product at a
narrower precision, :data:`jaxbundle.core.arithmetic.PRODUCT_ERROR`) the bound is
``(delta + gamma_n (1 + delta)) sum_i |a_i b_i|`` (:func:`error`). ``sum_i |a_i b_i|`` is bounded
from the interval bounds the sweep carries: the equation with absolute weights applied to the
inputs' magnitudes (``|center| + radius``), each layer from its own values. A value flushed to
zero (a denormal) is off by at most ``2^-126`` of its weight: :data:`TINY` in every magnitude
and :data:`FLOOR` per term cover it.

Assumed, and not checked: XLA computes every matrix product, convolution and sum as a sum of
its products in some order (true of XLA:CPU and of cuBLAS; cuDNN's FFT and Winograd
convolution algorithms, which a GPU may pick, are outside it), elementwise operations are
IEEE float32 (no fast-math), and the values the model computes from its parameters alone
(BatchNorm's folded scale) are the same in the model's program as in the certificate's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxbundle.core import arithmetic
from jaxbundle.certify.graph import Arithmetic

__all__ = ["FLOOR", "HIGHEST", "TINY", "UNIT", "error", "gamma", "inflation", "magnitude",
           "outward", "relative", "slack", "summed"]

UNIT = arithmetic.UNIT
HIGHEST = arithmetic.PRODUCT_ERROR[jax.lax.Precision.HIGHEST]  # the bound's own products
TINY = 2.0**-100  # added to every magnitude: a flushed input's weight, 2^-26 of TINY's
FLOOR = 2.0**-120  # absolute allowance per term: a flushed output


def gamma(n: int | jax.Array) -> float | jax.Array:
    """``gamma_n = n u / (1 - n u)``: a sum of ``n`` terms' relative error bound. ``n`` may be
    traced (a count per example, at most an array's size: the check is the caller's)."""
    if not isinstance(n, jax.Array) and n * UNIT >= 0.5:
        raise ValueError(f"a float32 sum of {n} terms has no useful rounding bound")
    return n * UNIT / (1.0 - n * UNIT)


def error(terms: int, product: float = 0.0) -> float:
    """The relative error bound of a sum of ``terms`` products, each within ``product`` of the
    exact one: ``product + gamma_terms (1 + product)`` (0 for an exact equation)."""
    if terms == 0 and product == 0.0:
        return 0.0
    return product + gamma(max(terms, 1)) * (1.0 + product)


def relative(rounds: Arithmetic, *, crossing: bool) -> float:
    """An equation's slack per unit of its magnitude (``|op|`` of its inputs' magnitudes, fixed
    operands by their absolute values): the model's rounding at its own precision, and either
    (``crossing=False``, an interval through the equation) the bound's rounding of the center
    and of the radius (their errors are relative to ``|op| |center|`` and ``|op| radius``,
    which sum to at most the magnitude), or (``crossing=True``, CROWN's rows crossing it
    backwards) the rounding of the coefficients through its transpose; and 4 ulps for adding
    the slack itself. The bound's own products are at ``HIGHEST``."""
    own = HIGHEST if rounds.product else 0.0
    mine = error(rounds.back, own) if crossing else error(rounds.terms, own)
    return error(rounds.terms, rounds.product) + mine + 4.0 * UNIT


def inflation(terms: int) -> float:
    """The factor that makes an allowance computed as a float32 sum of ``terms`` terms at
    least the exact sum it stands for."""
    return (1.0 + 2.0 * gamma(terms + 1)) * (1.0 + 4.0 * UNIT)


def slack(rounds: Arithmetic, magnitude_: jax.Array, *, crossing: bool) -> jax.Array:
    """The elementwise bound on an equation's rounding (the model's and the bound's, see
    :func:`relative`) given ``magnitude_``, ``|op|`` of its inputs' :func:`magnitude`."""
    if rounds == Arithmetic():
        return jnp.zeros_like(magnitude_)
    floor = FLOOR * (rounds.terms + rounds.back + 1)
    scale = inflation(rounds.terms + rounds.back)
    return jax.lax.stop_gradient((relative(rounds, crossing=crossing) * magnitude_ + floor)
                                 * scale)


def summed(values: jax.Array) -> jax.Array:
    """Elementwise allowance for a row's inner product with non-negative ``values`` (a sum of
    at most ``values.size`` terms): ``gamma`` of that size times each value, inflated."""
    size = int(values.size)
    return jax.lax.stop_gradient(gamma(size) * inflation(size) * values + FLOOR)


def magnitude(center: jax.Array, radius: jax.Array) -> jax.Array:
    """An upper bound on ``|value|`` over ``center +- radius``, plus :data:`TINY`."""
    return jax.lax.stop_gradient((jnp.abs(center) + radius) * (1.0 + 2.0 * UNIT) + TINY)


def outward(lower: jax.Array, upper: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[lower, upper]`` widened by 4 ulps and :data:`FLOOR`: it then contains the exact
    interval that the float32 ``lower`` and ``upper`` were rounded from (a few operations)."""
    low = jax.lax.stop_gradient(jnp.abs(lower) * (4.0 * UNIT) + FLOOR)
    high = jax.lax.stop_gradient(jnp.abs(upper) * (4.0 * UNIT) + FLOOR)
    return lower - low, upper + high
