"""Convolutions whose backward pass stays fast on XLA:CPU inside loops (no flax needed).

:func:`conv_same` computes what ``flax.linen.Conv(padding="SAME")`` computes, with a custom VJP
whose input gradient is again an NHWC/HWIO convolution (:class:`jaxbundle.models.layers.Conv`
is the flax module around it). :func:`canonical_convolutions` does the same for any model's
convolutions, without touching its code (the bundler applies it on CPU); with ``subpixel=True``
(certify's backward passes) a strided convolution's input gradient also skips the zeros of the
dilated form (:func:`strided_transpose`) and its kernel gradient is a canonical convolution.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.extend.core
import jax.numpy as jnp

from jaxbundle.core import sampling

__all__ = [
    "MIN_SUBPIXEL_FEATURES", "CanonicalConvolutions", "canonical_convolutions", "conv_same",
    "fast_gradients", "strided_transpose",
]

# Input features from which the sub-pixel transpose is used (XLA:CPU, SmallCNN's convolutions
# inside a loop: 16 features 2.3x faster than the dilated form; 1 feature no faster).
MIN_SUBPIXEL_FEATURES = 8


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


def conv_same(x: jax.Array, kernel: jax.Array, stride: int) -> jax.Array:
    """A 'SAME' NHWC/HWIO convolution whose input gradient is also an NHWC/HWIO convolution.

    The numbers are those of ``flax.linen.Conv(padding="SAME")``. Only the backward pass
    differs in form: JAX's transpose rule gives the input-gradient convolution an ``01oi``
    kernel layout, which XLA:CPU canonicalises only outside loops; inside a ``lax.scan`` it
    falls back to a naive emitter, measured 4-6x slower (benchmarks/README.md). Here the
    kernel is flipped and transposed for real, so every convolution is canonical.
    """
    pads = tuple(_same_padding(x.shape[d], kernel.shape[d - 1], stride)[1:] for d in (1, 2))
    conv = _freeze(
        window_strides=(stride, stride), padding=pads, lhs_dilation=(1, 1), rhs_dilation=(1, 1),
        dimension_numbers=_canonical_numbers(4), feature_group_count=1, precision=None,
        preferred_element_type=None,
    )
    return _conv(x, kernel, conv)


# ----------------------------------------------------------------------------------------
# Any model: every convolution of apply_fn rewritten into the canonical-gradient form
# ----------------------------------------------------------------------------------------

_PRIMITIVES = jax.extend.core.primitives
_CONV = _PRIMITIVES.conv_general_dilated_p
_JIT = getattr(_PRIMITIVES, "jit_p", None) or getattr(_PRIMITIVES, "pjit_p")  # renamed in 0.7


def _dilate(shape, dilation):
    return [0 if s == 0 else 1 + d * (s - 1) for s, d in zip(shape, dilation)]


def _canonical_numbers(ndim: int) -> jax.lax.ConvDimensionNumbers:
    """Batch first and features last for images and outputs, (spatial..., in, out) kernels."""
    spatial = tuple(range(1, ndim - 1))
    return jax.lax.ConvDimensionNumbers(
        (0, ndim - 1, *spatial), (ndim - 1, ndim - 2, *range(ndim - 2)), (0, ndim - 1, *spatial)
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _conv(lhs, rhs, conv):
    """``conv_general_dilated`` of canonical-layout operands (``conv``: its keyword arguments,
    frozen) whose input gradient is again a canonical convolution."""
    return jax.lax.conv_general_dilated(lhs, rhs, **dict(conv))


def _conv_fwd(lhs, rhs, conv):
    return _conv(lhs, rhs, conv), (lhs, rhs)


def _conv_bwd(conv, residuals, g):
    lhs, rhs = residuals
    c = dict(conv)
    groups = c["feature_group_count"]
    space = lhs.ndim - 2
    # The transposed kernel [spatial..., out/groups, in]: flipped, in and out swapped for real
    # (JAX's own transpose swaps them in the dimension numbers, which XLA:CPU runs on its
    # naive emitter inside loops), the groups moved from the out features into the in ones.
    k = jnp.flip(rhs, tuple(range(space)))
    k = k.reshape(*k.shape[:-1], groups, k.shape[-1] // groups)  # [..., I/G, G, O/G]
    k = jnp.moveaxis(k, (-3, -2, -1), (-1, -2, -3))  # [..., O/G, G, I/G]
    k = k.reshape(*k.shape[:-2], -1).astype(g.dtype)
    window = _dilate(rhs.shape[:space], c["rhs_dilation"])
    before = [w - 1 - lo for w, (lo, _) in zip(window, c["padding"])]
    after = [
        i + w - 1 - o - b
        for i, w, o, b in zip(
            _dilate(lhs.shape[1:-1], c["lhs_dilation"]),
            window,
            _dilate(g.shape[1:-1], c["window_strides"]),
            before,
        )
    ]
    dlhs = jax.lax.conv_general_dilated(
        g, k, window_strides=c["lhs_dilation"], padding=tuple(zip(before, after)),
        lhs_dilation=c["window_strides"], rhs_dilation=c["rhs_dilation"],
        dimension_numbers=c["dimension_numbers"], feature_group_count=groups,
        precision=c["precision"], preferred_element_type=c["preferred_element_type"],
    ).astype(lhs.dtype)
    drhs = jax.vjp(lambda r: jax.lax.conv_general_dilated(lhs, r, **c), rhs)[1](g)[0]
    return dlhs, drhs


_conv.defvjp(_conv_fwd, _conv_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _conv_subpixel(lhs, rhs, conv):
    """:func:`_conv` whose input gradient takes the sub-pixel form where it applies
    (:func:`strided_transpose`)."""
    return jax.lax.conv_general_dilated(lhs, rhs, **dict(conv))


def _conv_subpixel_bwd(conv, residuals, g):
    lhs, rhs = residuals
    dlhs, drhs = _conv_bwd(conv, residuals, g)  # the unused ones are compiled away
    subpixel = strided_transpose(g, rhs, dict(conv), lhs.shape)
    canonical = _kernel_gradient(lhs, g, dict(conv), rhs.shape)
    return (dlhs if subpixel is None else subpixel.astype(lhs.dtype),
            drhs if canonical is None else canonical.astype(rhs.dtype))


_conv_subpixel.defvjp(_conv_fwd, _conv_subpixel_bwd)


def _freeze(**conv) -> tuple:
    return tuple(sorted(conv.items()))


def _rewritten_conv(lhs, rhs, *, dimension_numbers, batch_group_count, out_sharding=None,
                    subpixel=False, **conv):
    """One ``conv_general_dilated`` equation, computed in the canonical layout (operands and
    result transposed when theirs differ) with the canonical-gradient VJP."""
    del out_sharding  # the result's sharding follows its operands'
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    if batch_group_count != 1:  # only weight gradients use it; not in a model's forward
        return jax.lax.conv_general_dilated(
            lhs, rhs, dimension_numbers=dimension_numbers, batch_group_count=batch_group_count,
            **conv,
        )
    lhs_c = _transpose(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
    rhs_c = _transpose(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
    convolve = _conv_subpixel if subpixel else _conv
    out_c = convolve(lhs_c, rhs_c, _freeze(dimension_numbers=_canonical_numbers(lhs.ndim), **conv))
    order = (out_spec[0], *out_spec[2:], out_spec[1])  # canonical axis j is result axis order[j]
    return _transpose(out_c, tuple(order.index(a) for a in range(out_c.ndim)))


def _transpose(x, perm):
    return x if tuple(perm) == tuple(range(x.ndim)) else jnp.transpose(x, perm)


def _has_conv(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive is _CONV:
            return True
        if eqn.primitive is _JIT and _has_conv(eqn.params["jaxpr"].jaxpr):
            return True
    return False


def _evaluate(jaxpr, consts, *args, subpixel=False):
    """``jaxpr`` evaluated on ``args`` with every convolution rewritten (``jit`` bodies are
    inlined; other higher-order primitives run unchanged)."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

    for var, val in zip(jaxpr.constvars, consts):
        env[var] = val
    for var, val in zip(jaxpr.invars, args):
        env[var] = val
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive is _CONV:
            outvals = [_rewritten_conv(*invals, **eqn.params, subpixel=subpixel)]
        elif eqn.primitive is _JIT:
            closed = eqn.params["jaxpr"]
            outvals = _evaluate(closed.jaxpr, closed.consts, *invals, subpixel=subpixel)
        else:
            bound = eqn.primitive.get_bind_params(eqn.params)  # (subfuns, params) before 0.8
            subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
            with eqn.ctx.manager:
                out = eqn.primitive.bind(*subfuns, *invals, **params)
            outvals = out if eqn.primitive.multiple_results else [out]
        for var, val in zip(eqn.outvars, outvals):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]


@dataclasses.dataclass(frozen=True)
class CanonicalConvolutions:
    """``apply_fn`` with every convolution computed by the canonical-gradient form of
    :func:`conv_same` (see :func:`canonical_convolutions`). Equal (and hashed) by ``apply_fn``,
    so a jitted function taking it as a static argument compiles once per model."""

    apply_fn: Callable[..., Any]
    subpixel: bool = False

    def __call__(self, *args):
        closed, shape = jax.make_jaxpr(self.apply_fn, return_shape=True)(*args)
        if not _has_conv(closed.jaxpr):
            return self.apply_fn(*args)
        out = _evaluate(closed.jaxpr, closed.consts, *jax.tree_util.tree_leaves(args),
                        subpixel=self.subpixel)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), out)


def canonical_convolutions(apply_fn: Callable[..., Any], *,
                           subpixel: bool = False) -> Callable[..., Any]:
    """``apply_fn(params, x, ...)`` with the same numbers and an input gradient XLA:CPU runs fast in
    loops, for any model (flax ``nn.Conv``, ``lax.conv_general_dilated`` in any layout, grouped
    and dilated convolutions).

    Traces ``apply_fn`` and evaluates its program with each ``conv_general_dilated`` replaced by
    the same convolution in the canonical layout (batch first, features last, ``[spatial...,
    in, out]`` kernels) whose VJP is again such a convolution: JAX's transpose rule instead
    swaps the kernel's in and out features in the dimension numbers, a layout XLA:CPU
    canonicalises only outside loops (inside a ``lax.scan`` it measured 4-6x slower,
    benchmarks/README.md). Convolutions inside ``jit`` are rewritten too; inside other
    higher-order primitives (``scan``, ``remat``, custom derivatives) they are left as they are.
    The bundler applies it to every white-box model on CPU. Idempotent.

    ``subpixel=True`` (certify's backward passes): strided convolutions' input gradients take
    the sub-pixel form of :func:`strided_transpose`.
    """
    if isinstance(apply_fn, CanonicalConvolutions):
        if apply_fn.subpixel == subpixel:
            return apply_fn
        apply_fn = apply_fn.apply_fn
    return CanonicalConvolutions(apply_fn, subpixel)


def fast_gradients(apply_fn: Callable[..., Any]) -> Callable[..., Any]:
    """On CPU, ``apply_fn`` (or a stochastic model's, :func:`jaxbundle.stochastic`) with
    canonical-gradient convolutions (:func:`canonical_convolutions`: the same numbers); on other
    backends ``apply_fn`` as it is. The bundler's white-box models, and the clean gradient of
    the ``zero_gradients`` check (0.83 -> 0.73 s for a ResNet-18 on 16 images at 224x224)."""
    if jax.default_backend() != "cpu":
        return apply_fn
    if sampling.is_stochastic(apply_fn):
        return apply_fn._replace(apply_fn=canonical_convolutions(apply_fn.apply_fn))
    return canonical_convolutions(apply_fn)


def strided_transpose(g: jax.Array, rhs: jax.Array, conv: dict, lhs_shape) -> jax.Array | None:
    """The input gradient of a strided canonical-layout convolution in sub-pixel form, or None
    where that form does not apply (no dilation, one feature group, padding >= 0, at least
    :data:`MIN_SUBPIXEL_FEATURES` input features).

    ``conv`` holds ``conv_general_dilated``'s keyword arguments in the canonical layout. With
    strides ``s``, :func:`_conv_bwd` convolves ``g`` dilated by ``s``: ``prod(s) - 1`` of every
    ``prod(s)`` products are with inserted zeros. Here tap ``k = t s + r`` of the kernel feeds
    input position ``(o + t) s + r - pad`` from output ``o``, so the kernel is split by phase
    ``r`` into ``prod(s)`` kernels of ``ceil(K / s)`` taps ``t``, stacked on the output features
    of one stride-1 convolution whose phases are then interleaved: every product is a real
    one."""
    strides = tuple(conv["window_strides"])
    space = len(strides)
    features = rhs.shape[-2]
    if (max(strides) == 1 or any(d != 1 for d in conv["lhs_dilation"])
            or any(d != 1 for d in conv["rhs_dilation"]) or conv["feature_group_count"] != 1
            or any(lo < 0 or hi < 0 for lo, hi in conv["padding"])
            or features < MIN_SUBPIXEL_FEATURES or 0 in g.shape):
        return None
    taps = [-(-k // s) for k, s in zip(rhs.shape[:space], strides)]
    k = jnp.pad(rhs, [(0, t * s - w) for t, s, w in zip(taps, strides, rhs.shape)] + [(0, 0)] * 2)
    k = k.reshape(*[d for t, s in zip(taps, strides) for d in (t, s)], features, -1)
    order = (*range(0, 2 * space, 2), 2 * space + 1, *range(1, 2 * space, 2), 2 * space)
    k = jnp.flip(k, tuple(range(0, 2 * space, 2))).transpose(order)  # [t..., O, s..., I]
    full = _conv_subpixel(g, k.reshape(*taps, k.shape[space], -1).astype(g.dtype), _freeze(
        window_strides=(1,) * space, padding=tuple((t - 1, t - 1) for t in taps),
        lhs_dilation=(1,) * space, rhs_dilation=(1,) * space,
        dimension_numbers=_canonical_numbers(g.ndim), feature_group_count=1,
        precision=conv["precision"], preferred_element_type=None))
    n, grid = full.shape[0], full.shape[1:1 + space]
    full = full.reshape(n, *grid, *strides, features)  # [n, q..., s..., I]
    order = (0, *[a for d in range(space) for a in (1 + d, 1 + space + d)], 1 + 2 * space)
    full = full.transpose(order).reshape(n, *[q * s for q, s in zip(grid, strides)], features)
    starts = [lo for lo, _ in conv["padding"]]
    ends = [lo + size for lo, size in zip(starts, lhs_shape[1:-1])]
    full = jnp.pad(full, [(0, 0)] + [(0, max(0, e - q)) for e, q in zip(ends, full.shape[1:-1])]
                   + [(0, 0)])
    return full[(slice(None), *[slice(a, b) for a, b in zip(starts, ends)], slice(None))]


def _kernel_gradient(lhs, g, conv: dict, kernel_shape):
    """The kernel gradient of a canonical-layout convolution as a canonical convolution (the
    images' features as its batch, the batch as its features, ``g`` as its kernel dilated by
    the strides), or None for input dilation, feature groups or an empty output. JAX's own
    swaps the dimension numbers instead, a layout XLA:CPU runs on its naive emitter inside
    loops (second-order certify: CROWN-IBP training's gradient through the backward pass)."""
    space = lhs.ndim - 2
    if (any(d != 1 for d in conv["lhs_dilation"]) or conv["feature_group_count"] != 1
            or 0 in g.shape):
        return None
    taps, strides, dilation = kernel_shape[:space], conv["window_strides"], conv["rhs_dilation"]
    grid = g.shape[1:-1]
    pads = [(lo, (k - 1) * d + (p - 1) * s + 1 - size - lo)
            for (lo, _), k, d, p, s, size in zip(conv["padding"], taps, dilation, grid, strides,
                                                   lhs.shape[1:-1])]
    image = jnp.moveaxis(lhs, (0, -1), (-1, 0))  # [I, *S, N]
    kernel = jnp.moveaxis(g, 0, -2)  # [*P, N, O]
    out = jax.lax.conv_general_dilated(
        image, kernel.astype(image.dtype), dilation, pads, rhs_dilation=strides,
        dimension_numbers=_canonical_numbers(lhs.ndim), precision=conv["precision"])
    return jnp.moveaxis(out, 0, -2)  # [*K, I, O]
