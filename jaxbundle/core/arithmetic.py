"""One stated arithmetic for verdicts and certificates.

JAX computes a float32 matrix product or convolution whose ``precision`` is not given at the
backend's default: IEEE float32 on a CPU, TF32 on recent NVIDIA GPUs (operands rounded to 11
significant bits), one bfloat16 pass on a TPU (8 bits). A verdict (the judge's: clean
prediction, adversarial or not) and a certificate (no image of the ball changes the class) are
claims about a model's arithmetic, so jaxbundle computes both at :data:`PRECISION`,
``Precision.HIGHEST``, whatever the backend's default: IEEE float32 products on CPUs and GPUs,
six bfloat16 passes on TPUs (each product within :data:`PRODUCT_ERROR` of the exact one). A
model that fixes a precision itself (``precision=`` on a layer) keeps it: the judge runs it as
written and its certificate allows for that precision's error. The attacks only propose
candidates, every one judged at :data:`PRECISION`, so they search faster, at :data:`SEARCH`
(:func:`searching`): TF32 on GPUs, as their default; three bfloat16 passes on TPUs instead of
the default's one. Measured on the CPU with an accelerator's arithmetic emulated
(``benchmarks/attack_precision.py``, the ``default`` bundle, 256 images of a tuning and a
held-out model, judged in float32): TF32 search found exactly what float32 search found; one
bfloat16 pass missed 2 examples on each model.

:func:`stated` is the context every verdict and every certification program is traced in,
:func:`searching` the one the attacks' model passes are.
"""

from __future__ import annotations

import contextlib

import jax
from jax import lax

__all__ = ["PRECISION", "PRODUCT_ERROR", "SEARCH", "STATEMENT", "UNIT", "product_error",
           "searching", "stated"]

PRECISION = "highest"  # jax.default_matmul_precision of verdicts and certificates
SEARCH = "high"  # ... of the attacks' model passes, where nothing else sets one
STATEMENT = ("verdicts and certificates at float32 Precision.HIGHEST (IEEE float32 products on "
             "CPUs and GPUs, six bfloat16 passes on TPUs); the attacks search at Precision.HIGH "
             "(TF32 on GPUs, three bfloat16 passes on TPUs)")
UNIT = 2.0**-24  # float32's unit roundoff (round to nearest)
# Relative error of one product of float32 operands, by the precision a matrix product or
# convolution runs at, the largest over backends: HIGHEST (TPU: six bfloat16 passes drop
# the products of the operands' low parts, under 2^-22 of the product; CPUs and GPUs: exact
# before the float32 sum), HIGH (TPU: three passes, operands kept to 16 bits), DEFAULT (TPU:
# one bfloat16 pass, each operand rounded to 8 significant bits; GPUs: TF32, 11 bits).
PRODUCT_ERROR = {
    lax.Precision.HIGHEST: 2.0**-21,
    lax.Precision.HIGH: 2.0**-14,
    lax.Precision.DEFAULT: (1.0 + 2.0**-8) ** 2 - 1.0,
}


def stated() -> contextlib.AbstractContextManager:
    """The context verdicts and certificates are traced in: a matrix product or convolution
    with no ``precision`` of its own runs at :data:`PRECISION`."""
    return jax.default_matmul_precision(PRECISION)


def searching() -> contextlib.AbstractContextManager:
    """The context the attacks' model passes are traced in: :data:`SEARCH` where no precision
    is set already (by the user, ``jax_default_matmul_precision``, or by :func:`stated` around
    a verdict), else the one set."""
    if jax.config.jax_default_matmul_precision is not None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(SEARCH)


def product_error(precision) -> float:
    """The relative error of one product of a matrix product or convolution traced with
    ``precision`` (its jaxpr parameter: None, a ``Precision``, a pair, or an algorithm),
    as :data:`PRODUCT_ERROR` gives it; None (traced outside :func:`stated` with no precision of
    its own) is the backend's default."""
    if precision is None:
        return PRODUCT_ERROR[lax.Precision.DEFAULT]
    if isinstance(precision, (tuple, list)):
        return max(product_error(p) for p in precision)
    if isinstance(precision, lax.Precision):
        return PRODUCT_ERROR[precision]
    if precision in (lax.DotAlgorithmPreset.F32_F32_F32, lax.DotAlgorithmPreset.F64_F64_F64,
                     lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
                     lax.DotAlgorithmPreset.BF16_BF16_F32_X9):
        return PRODUCT_ERROR[lax.Precision.HIGHEST]
    if precision in (lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
                     lax.DotAlgorithmPreset.TF32_TF32_F32_X3):
        return PRODUCT_ERROR[lax.Precision.HIGH]
    if "F8" in str(precision):  # operands rounded to 4 significant bits at best
        return (1.0 + 2.0**-3) ** 2 - 1.0
    return PRODUCT_ERROR[lax.Precision.DEFAULT]  # one bfloat16, TF32 or float16 pass
