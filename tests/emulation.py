"""An accelerator's float32 matrix arithmetic on the CPU, for tests and benchmarks.

On a GPU a float32 matrix product or convolution at ``Precision.DEFAULT`` (what JAX uses when
none is given) rounds both operands to TF32 (10 explicit mantissa bits) and sums in float32; on
a TPU it takes one bfloat16 pass (7 bits). XLA:CPU computes it in full float32 whatever the
precision. :func:`default_precision` makes XLA:CPU do what an accelerator does: while it is
active, every float32 ``dot_general`` and ``conv_general_dilated`` lowered for the CPU at the
backend's default (None or ``DEFAULT``) or ``HIGH`` rounds both operands with
``reduce_precision`` to the bits that accelerator keeps at that precision (:data:`FORMATS`);
``HIGHEST`` stays float32, float64 stays float64.
Compiled programs are dropped on entry and exit, so what is traced inside is lowered with the
emulated arithmetic and nothing leaks out.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.interpreters import mlir  # the only way to change how XLA:CPU lowers a primitive
from jax._src.lax import convolution
from jax._src.lax import lax as lax_internal
from jax._src.lib.mlir.dialects import hlo

__all__ = ["FORMATS", "default_precision", "level"]

# Explicit mantissa bits each operand keeps, by accelerator and precision: a GPU computes
# DEFAULT and HIGH in TF32; a TPU DEFAULT in one bfloat16 pass and HIGH in three (an operand as
# a sum of two bfloat16 parts: 16 significant bits, the product of the low parts dropped).
FORMATS = {
    "float32": {},
    "tf32": {lax.Precision.DEFAULT: 10, lax.Precision.HIGH: 10},
    "bfloat16": {lax.Precision.DEFAULT: 7, lax.Precision.HIGH: 15},
}
_PRIMITIVES = (lax_internal.dot_general_p, convolution.conv_general_dilated_p)


def level(precision) -> lax.Precision:
    """The precision an accelerator computes a product traced with ``precision`` at (None:
    the backend's default), the higher of a pair."""
    if isinstance(precision, (tuple, list)):
        return max((level(p) for p in precision), key=lambda p: p.value)
    if precision is None:
        return lax.Precision.DEFAULT
    return precision if isinstance(precision, lax.Precision) else lax.Precision.HIGHEST


@contextlib.contextmanager
def default_precision(fmt: str):
    """Within the block, XLA:CPU computes default-precision float32 matrix products and
    convolutions as an accelerator of ``fmt`` (:data:`FORMATS`) does."""
    widths = FORMATS[fmt]
    table = mlir._platform_specific_lowerings["cpu"]
    saved = {p: table[p] for p in _PRIMITIVES}

    def emulated(entry):
        def rule(ctx, lhs, rhs, **params):
            bits = widths.get(level(params.get("precision")))
            if bits is not None and all(a.dtype == jnp.float32 for a in ctx.avals_in):
                lhs, rhs = (hlo.reduce_precision(v, mlir.i32_attr(8), mlir.i32_attr(bits))
                            for v in (lhs, rhs))
            return entry.rule(ctx, lhs, rhs, **params)
        return rule

    jax.clear_caches()
    try:
        for primitive in _PRIMITIVES:
            mlir.register_lowering(primitive, emulated(saved[primitive]), platform="cpu")
        yield
    finally:
        table.update(saved)
        jax.clear_caches()
