"""models.canonical_convolutions: any model's convolutions, same numbers, canonical gradients."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbundle import bundler, canonical, models
from jaxbundle.attacks import fab, pgd
from jaxbundle.models import canonical_convolutions

LAYOUTS = [("NHWC", "HWIO", "NHWC"), ("NCHW", "OIHW", "NCHW"), ("NHWC", "OIHW", "NCHW"),
           ("CHWN", "IOHW", "HWNC")]


def value_and_input_grad(fn, *args):
    """Logits-like output and the gradient of a nonlinear scalar of it w.r.t. the last arg."""
    out = fn(*args)
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(fn(*args[:-1], x)) * jnp.arange(out.size).reshape(
        out.shape)))(args[-1])
    return out, grad


def assert_same(fn, *args):
    # Both forms in one compiled program (one trace, lowering and compile per case, not two).
    a, b = jax.jit(lambda *a: (value_and_input_grad(fn, *a),
                               value_and_input_grad(canonical_convolutions(fn), *a)))(*args)
    for u, v in zip(a, b):
        assert u.shape == v.shape and u.dtype == v.dtype
        np.testing.assert_allclose(v, u, rtol=2e-5, atol=2e-5)


def _normal(seed, shape):
    """Standard normal float32 data (NumPy's: jax.random would compile a program per shape)."""
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    size=st.tuples(st.integers(3, 9), st.integers(3, 9)),
    window=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    strides=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    rhs_dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    lhs_dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    padding=st.sampled_from(["SAME", "VALID", ((1, 0), (2, 1)), ((0, 2), (1, 1))]),
    groups=st.sampled_from([1, 2]),
)
def test_any_convolution_same_value_and_input_gradient(
    layout, size, window, strides, rhs_dilation, lhs_dilation, padding, groups
):
    """Strides, dilations (kernel and input), explicit padding, groups, every layout."""
    cin, cout, batch = 2 * groups, 3 * groups, 2
    shapes = {"N": batch, "C": cin, "H": size[0], "W": size[1]}
    x = _normal(0, [shapes[d] for d in layout[0]])
    kshape = {"O": cout, "I": cin // groups, "H": window[0], "W": window[1]}
    k = _normal(1, [kshape[d] for d in layout[1]])
    if padding in ("SAME", "VALID") and lhs_dilation != (1, 1):
        padding = ((1, 1), (0, 1))  # string padding is not defined with input dilation

    def conv(kernel, image):
        return jax.lax.conv_general_dilated(
            image, kernel, strides, padding, lhs_dilation, rhs_dilation,
            dimension_numbers=layout, feature_group_count=groups,
        )

    assert_same(conv, k, x)


class Mixed(nn.Module):
    """What users write: strided, depthwise, dilated, transposed and 1-D convolutions, inside
    a jitted helper too, batch norm statistics and a dense head."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), strides=2)(x))
        x = nn.Conv(8, (3, 3), feature_group_count=8, kernel_dilation=2)(x)  # depthwise
        x = jax.jit(lambda h: nn.gelu(h))(x)
        x = nn.ConvTranspose(4, (3, 3), strides=(2, 2))(x)
        x = nn.BatchNorm(use_running_average=True)(x)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        x = nn.Conv(6, (5,), strides=3, padding="CAUSAL")(x)  # 1-D over the flattened rows
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


@pytest.mark.parametrize("shape", [(3, 16, 16, 3), (2, 32, 32, 3)])
def test_flax_models_same_value_and_input_gradient(shape):
    x = jax.random.uniform(jax.random.key(2), shape)
    module = Mixed()
    params = module.init(jax.random.key(3), x)
    assert_same(module.apply, params, x)


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    size=st.tuples(st.integers(3, 9), st.integers(3, 9)),
    window=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    strides=st.tuples(st.integers(1, 3), st.integers(2, 3)),
    padding=st.sampled_from(["SAME", "VALID", ((1, 0), (2, 1)), ((0, 2), (3, 0))]),
    features=st.sampled_from([1, 3, 8, 9]),
)
def test_subpixel_input_gradient_equals_the_dilated_one(layout, size, window, strides, padding,
                                                        features):
    """certify's sub-pixel transposes (strides 2-3, any kernel, padding and layout; below 8
    input features the dilated form stays) give JAX's own input gradient, and the kernel's."""
    shapes = {"N": 2, "C": features, "H": size[0], "W": size[1]}
    x = _normal(0, [shapes[d] for d in layout[0]])
    kshape = {"O": 3, "I": features, "H": window[0], "W": window[1]}
    k = _normal(1, [kshape[d] for d in layout[1]])

    def conv(kernel, image):
        return jax.lax.conv_general_dilated(image, kernel, strides, padding,
                                            dimension_numbers=layout)

    cotangent = _normal(2, jax.eval_shape(conv, k, x).shape)

    @jax.jit  # both forms and their pullbacks in one program, not op by op
    def both(k, x, cotangent):
        out, pullback = jax.vjp(conv, k, x)
        mine, my_pullback = jax.vjp(canonical_convolutions(conv, subpixel=True), k, x)
        return out, mine, pullback(cotangent), my_pullback(cotangent)

    out, mine, grads, my_grads = both(k, x, cotangent)
    np.testing.assert_allclose(mine, out, rtol=1e-5, atol=1e-5)
    for a, b in zip(my_grads, grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_subpixel_form_applies_to_strided_undilated_convolutions_only():
    conv = dict(window_strides=(2, 2), padding=((1, 2), (1, 2)), lhs_dilation=(1, 1),
                rhs_dilation=(1, 1), feature_group_count=1, precision=None)
    g, kernel = jnp.ones((1, 7, 7, 4)), jnp.ones((5, 5, 8, 4))
    assert canonical.strided_transpose(g, kernel, conv, (1, 14, 14, 8)).shape == (1, 14, 14, 8)
    for change in ({"window_strides": (1, 1)}, {"rhs_dilation": (2, 1)}, {"lhs_dilation": (1, 2)},
                   {"feature_group_count": 2}):
        assert canonical.strided_transpose(g, kernel, conv | change, (1, 14, 14, 8)) is None
    assert canonical.strided_transpose(g, kernel[:, :, :1], conv, (1, 14, 14, 1)) is None


def test_wrapper_is_hashed_by_the_model_and_idempotent():
    f = models.LinenCNN().apply
    g = canonical_convolutions(f)
    assert g == canonical_convolutions(f) and hash(g) == hash(canonical_convolutions(f))
    assert canonical_convolutions(g) is g
    assert g != canonical_convolutions(models.SmallCNN().apply)
    assert canonical_convolutions(g, subpixel=True) != g
    assert canonical_convolutions(canonical_convolutions(g, subpixel=True)) == g


def test_model_without_convolutions_is_called_as_it_is():
    calls = []

    def mlp(params, x):
        calls.append(1)
        return x.reshape(x.shape[0], -1) @ params

    x = jnp.ones((2, 4, 4, 1))
    w = jnp.ones((16, 3))
    np.testing.assert_array_equal(canonical_convolutions(mlp)(w, x), mlp(w, x))
    assert len(calls) == 3  # traced once to look, then called as it is (plus the direct call)


def _conv_dim_labels(fn, params, x, y) -> list[str]:
    """dim_labels of every convolution XLA:CPU compiles for 3 PGD steps in a fori_loop."""

    def loss(xx):
        return jnp.sum(jax.nn.log_softmax(fn(params, xx))[jnp.arange(y.shape[0]), y])

    def loop(xx):
        return jax.lax.fori_loop(0, 3, lambda i, v: v + 1e-3 * jnp.sign(jax.grad(loss)(v)), xx)

    text = jax.jit(loop).lower(x).compile().as_text()
    return re.findall(r"convolution\(.*?dim_labels=([\w>_-]+)", text)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's layouts")
def test_every_convolution_in_the_loop_is_canonical():
    """Inside a loop, the rewritten model's input-gradient convolutions have HWIO kernels
    (XLA:CPU's fast path); plain flax nn.Conv gets JAX's swapped-kernel layout there."""
    x = jax.random.uniform(jax.random.key(4), (4, 28, 28, 1))
    y = jnp.arange(4)
    module = models.LinenCNN()
    params = module.init(jax.random.key(5), x)
    jitted = jax.jit(module.apply)  # as users often pass it: the convolutions inside a jit
    ours = _conv_dim_labels(canonical_convolutions(jitted), params, x, y)
    assert len(ours) >= 3  # two forwards and at least one input-gradient convolution
    assert set(ours) == {"b01f_01io->b01f"}, ours
    plain = _conv_dim_labels(module.apply, params, x, y)
    assert len(plain) >= 3  # the pattern finds JAX's own convolutions too


def _opaque(apply_fn):
    """apply_fn behind a custom_jvp (its own JVP): the rewrite leaves it as it is."""

    @jax.custom_jvp
    def f(params, x):
        return apply_fn(params, x)

    f.defjvp(lambda primals, tangents: jax.jvp(apply_fn, primals, tangents))
    return f


@pytest.mark.parametrize("attack", [pgd(steps=5, restarts=2),
                                    pytest.param(fab(steps=4, targets=3), marks=pytest.mark.slow)],
                         ids=["pgd-restarts", "fab-vmapped-vjp"])
def test_bundle_results_equal_without_the_rewrite(attack):
    """The bundler (which rewrites on CPU) finds the same images as on the unrewritten model,
    through vmapped restarts and FAB's per-class VJPs."""
    x = jax.random.uniform(jax.random.key(6), (6, 28, 28, 1))
    y = jnp.arange(6) % 10
    # flax's nn.Conv layers, narrow: the rewrite does not depend on the widths, the run time does
    module = models.LinenCNN(conv1=4, conv2=8, hidden=16)
    params = module.init(jax.random.key(7), x)
    kw = dict(eps=0.1, goals=("misclassify", "min_norm"))
    a = bundler.bundle([attack], module.apply, params, x, y, jax.random.key(8), **kw)
    b = bundler.bundle([attack], _opaque(module.apply), params, x, y, jax.random.key(8), **kw)
    for g in kw["goals"]:
        np.testing.assert_allclose(a.best[g].x, b.best[g].x, atol=1e-5)
        np.testing.assert_array_equal(a.best[g].score.misclassified, b.best[g].score.misclassified)
