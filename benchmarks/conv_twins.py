"""The diagnostic twins of SmallCNN and the convolution-layout report of ``pgd_speed.py`` and
``pgd_overhead.py`` (re-exported by ``pgd_speed``).

XLA:CPU runs a non-canonical convolution (kernel ``01oi``, which JAX's transpose rule produces
for every ``nn.Conv``) on a slow naive emitter when it sits inside a loop body. A *twin* of
``jaxbundle.models.SmallCNN`` computes the same function from the same parameters with the
other kind of input-gradient convolution; :func:`conv_layout_report` counts the convolutions of
a compiled program and those that are not canonical.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from jaxbundle import losses
from jaxbundle.models import _conv_forward, conv_same


# ----------------------------------------------------------------------------------------
# Diagnostic twins of SmallCNN: the same function, the other kind of input-gradient conv
# ----------------------------------------------------------------------------------------


def _CONV_S2(x, k):
    """The library's canonical-gradient convolution (``jaxbundle.models.conv_same``)."""
    return conv_same(x, k, 2)


def _plain_conv_s2(x, k):
    """What ``flax.linen.Conv(padding="SAME", strides=2)`` computes, with JAX's own gradient."""
    return _conv_forward(x, k, 2)


def _small_cnn_apply(conv, variables, x):
    p = variables["params"]
    h = jax.nn.relu(conv(x, p["conv1"]["kernel"]) + p["conv1"]["bias"])
    h = jax.nn.relu(conv(h, p["conv2"]["kernel"]) + p["conv2"]["bias"])
    h = h.reshape(h.shape[0], -1)
    h = jax.nn.relu(h @ p["hidden"]["kernel"] + p["hidden"]["bias"])
    return h @ p["logits"]["kernel"] + p["logits"]["bias"]


def small_cnn_apply_canonical_grad(variables, x):
    """SmallCNN's function (same params, same numbers) whose input gradient is canonical."""
    return _small_cnn_apply(_CONV_S2, variables, x)


def small_cnn_apply_jax_conv(variables, x):
    """SmallCNN's function written as a flax ``nn.Conv`` model computes it (JAX's gradient)."""
    return _small_cnn_apply(_plain_conv_s2, variables, x)


def grad_is_canonical_in_loops(apply_fn, params, x, y) -> bool:
    """Whether every convolution of ``apply_fn``'s input gradient inside a loop is canonical."""
    def total(xa):
        return jnp.sum(losses.cross_entropy(apply_fn(params, xa), y))

    def loop(xa):
        return jax.lax.fori_loop(0, 2, lambda i, v: v + 1e-6 * jnp.sign(jax.grad(total)(v)), xa)

    report = conv_layout_report(jax.jit(loop).lower(x).compile().as_text())
    return report["non_canonical_kernel"] == 0


def alternative_model(apply_fn, params, x, y):
    """The diagnostic twin of the benchmarked model: the other kind of input gradient.

    If ``jaxbundle.models.SmallCNN``'s gradient is canonical inside loops (its own
    ``custom_vjp`` convolution), the twin is the plain ``nn.Conv`` formulation, which shows
    what a user's flax model gets; otherwise the twin is the canonical-gradient one, which
    shows what the loops cost without XLA:CPU's slow path. Returns ``(label, apply_fn)``.
    """
    if grad_is_canonical_in_loops(apply_fn, params, x, y):
        return "jaxconv", small_cnn_apply_jax_conv
    return "canonconv", small_cnn_apply_canonical_grad


def max_abs_diff_apply(apply_fn, other_fn, params, x, y) -> float:
    """Max abs difference of logits and input gradients between two apply functions."""
    def g(f):
        return jax.grad(lambda xa: jnp.sum(losses.cross_entropy(f(params, xa), y)))(x)

    d1 = jnp.max(jnp.abs(apply_fn(params, x) - other_fn(params, x)))
    d2 = jnp.max(jnp.abs(g(apply_fn) - g(other_fn)))
    return float(max(d1, d2))


# ----------------------------------------------------------------------------------------
# Diagnostics: convolutions inside while-loop bodies
# ----------------------------------------------------------------------------------------

_COMP_RE = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ", re.M)


def conv_layout_report(compiled_text: str) -> dict[str, int]:
    """Counts the convolutions of a compiled CPU module, and those whose kernel is not HWIO.

    XLA:CPU calls Eigen's fast convolution only for canonical dimension numbers (input NHWC,
    kernel HWIO = ``01io``, output NHWC); its ConvCanonicalization pass inserts transposes to
    get there but only walks the *entry* computation, so a non-canonical convolution inside a
    while body (``lax.scan`` / ``fori_loop`` / ``lax.map``) stays on the slow naive emitter.
    The input-gradient convolution that JAX emits for ``conv_general_dilated`` has a ``01oi``
    kernel.
    """
    convs = re.findall(r"convolution\(.*?dim_labels=([\w>-]+)", compiled_text)
    return {
        "convolutions": len(convs),
        "non_canonical_kernel": sum("_01io->" not in d for d in convs),
        "while_loops": compiled_text.count(" while("),
    }
