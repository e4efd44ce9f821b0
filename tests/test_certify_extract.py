"""ReLU programs (jaxbundle.certify.extract): evaluated layer by layer they are the network, their
pre-activation bounds contain the pre-activations over the input set, and networks with other
operations are refused."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle.certify.extract import relu_program
from jaxbundle.certify.program import INPUT, ReluProgram
from jaxbundle.models.architectures import SmallCNN


def _evaluate(program: ReluProgram, point: np.ndarray):
    """(pre-activations of every layer, margins) of the program at the flat input ``point``."""
    outputs = {INPUT: point}
    pre = []
    for k, layer in enumerate(program.layers):
        value = sum(w @ outputs[source] for source, w in layer.terms) + layer.bias
        pre.append(value)
        outputs[k] = np.maximum(value, 0.0)
    margins = sum(w @ outputs[source] for source, w in program.margins.terms)
    return pre, margins + program.margins.bias


def _mlp(params, x):
    h = x.reshape(x.shape[0], -1) @ params["w1"]
    h = jax.nn.leaky_relu(h, 0.1)
    h = jnp.clip(h @ params["w2"], -0.5, 1.0)  # max and min: two ReLUs
    return jax.nn.relu(h) @ params["w3"]


def _check(apply_fn, params, x, eps):
    jitted = jax.jit(apply_fn)  # one program per batch shape, not one per operation
    y = jnp.argmax(jitted(params, x), axis=1)
    programs = relu_program(apply_fn, params, x, y, eps=eps)
    assert len(programs) == len(x)
    rng = np.random.default_rng(0)
    for b, program in enumerate(programs):
        image = np.asarray(x[b], np.float64).reshape(-1)
        np.testing.assert_allclose(program.center, image)
        np.testing.assert_allclose(program.lower, np.clip(image - eps, 0, 1), atol=1e-6)
        np.testing.assert_allclose(program.upper, np.clip(image + eps, 0, 1), atol=1e-6)
        assert list(program.classes) == [j for j in range(10) if j != int(y[b])][
            : len(program.classes)]
        corners = rng.choice([0, 1], size=(16, image.size))
        points = np.concatenate([
            image[None], np.where(corners, program.upper, program.lower),
            rng.uniform(program.lower, program.upper, size=(16, image.size))])
        logits = np.asarray(jitted(params, jnp.asarray(points, jnp.float32).reshape(
            len(points), *x.shape[1:])), np.float64)
        for point, logit in zip(points, logits):
            pre, margins = _evaluate(program, point)
            want = logit[int(y[b])] - logit[program.classes]
            np.testing.assert_allclose(margins, want, rtol=1e-4, atol=1e-4)
            for value, low, high in zip(pre, program.pre_lower, program.pre_upper):
                assert np.all(low <= value + 1e-5) and np.all(value <= high + 1e-5)
    return programs


def test_an_mlp_with_leaky_relu_and_clip_is_its_relu_program():
    keys = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(keys[0], (12, 8)) / 2,
              "w2": jax.random.normal(keys[1], (8, 6)) / 2,
              "w3": jax.random.normal(keys[2], (6, 10)) / 2}
    x = jax.random.uniform(jax.random.key(1), (2, 2, 2, 3))
    programs = _check(_mlp, params, x, 0.1)
    # leaky ReLU: one ReLU layer; clip: max and min, one each; the final relu: one more.
    assert len(programs[0].layers) == 4
    assert [s for s, _ in programs[0].layers[0].terms] == [INPUT]
    assert all(np.all(low <= high) for low, high in zip(programs[0].pre_lower,
                                                         programs[0].pre_upper))


def test_the_demo_cnn_is_its_relu_program():
    module = SmallCNN(conv1=2, conv2=3, hidden=6, kernel=3)
    x = jax.random.uniform(jax.random.key(2), (2, 28, 28, 1))
    params = jax.jit(module.init)(jax.random.key(3), x)
    programs = _check(module.apply, params, x, 0.02)
    sizes = [layer.bias.shape[0] for layer in programs[0].layers]
    assert sizes == [14 * 14 * 2, 7 * 7 * 3, 6]
    assert programs[0].layers[0].terms[0][1].nnz <= 14 * 14 * 2 * 9  # the convolution's taps


class _Pooled(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.max_pool(nn.relu(nn.Conv(2, (3, 3))(x)), (2, 2), strides=(2, 2))
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


def test_networks_with_max_pooling_are_refused():
    module = _Pooled()
    x = jnp.full((1, 4, 4, 1), 0.5)
    params = module.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"affine operations and ReLUs only .*"
                                         r"`reduce_window_max` \(test_certify_extract\.py:\d+\)"):
        relu_program(module.apply, params, x, jnp.array([0]), eps=0.1)
