"""Packed CROWN rows (jaxbundle.certify.packing): the same bounds as one neuron per row on
convolutional nets the packing was not built on (colour images, flax ``nn.Conv``, batch norm,
max pooling, NCHW, a residual add), fewer rows where windows are disjoint, and no packing
where every neuron sees every pixel or the dependencies cannot be traced."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle.certify import graph as graphs
from jaxbundle.certify import packing, sets
from jaxbundle.certify.bounds import margin_bounds
from jaxbundle.models.architectures import SmallCNN


class _Colour(nn.Module):
    """16x16x3 inputs: strided SAME and VALID flax convolutions, batch norm, max pooling."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.BatchNorm(use_running_average=True)(nn.Conv(6, (3, 3), strides=2)(x)))
        x = nn.relu(nn.Conv(8, (3, 3), strides=2, padding="VALID")(x))
        x = nn.max_pool(x, (2, 2), strides=(1, 1))
        return nn.Dense(5)(x.reshape(x.shape[0], -1))


def _colour():
    module = _Colour()
    variables = jax.jit(module.init)(jax.random.key(0), jnp.zeros((1, 16, 16, 3)))
    stats = variables["batch_stats"]["BatchNorm_0"]
    variables["batch_stats"]["BatchNorm_0"] = {"mean": stats["mean"] + 0.1,
                                                "var": stats["var"] + 0.5}
    return module.apply, variables, (16, 16, 3)


def _residual():
    """Plain JAX, 12x12x2: normalisation, NCHW convolutions, leaky ReLU, a residual add."""
    keys = jax.random.split(jax.random.key(1), 3)
    params = {"k1": jax.random.normal(keys[0], (4, 2, 3, 3)) / 4,
              "k2": jax.random.normal(keys[1], (4, 4, 3, 3)) / 6,
              "w": jax.random.normal(keys[2], (4 * 6 * 6, 3)) / 12}

    def apply(params, x):
        x = jnp.transpose((x - 0.5) / 0.25, (0, 3, 1, 2))
        h = jax.nn.leaky_relu(jax.lax.conv_general_dilated(x, params["k1"], (2, 2), "SAME"))
        h = h + jax.nn.relu(jax.lax.conv_general_dilated(h, params["k2"], (1, 1), "SAME"))
        return jax.nn.relu(h).reshape(x.shape[0], -1) @ params["w"]

    return apply, params, (12, 12, 2)


def _crown(apply_fn, params, x, y, eps, pack, monkeypatch):
    monkeypatch.setattr(packing, "MAX_PIXELS", packing.MAX_PIXELS if pack else 0)
    fresh = functools.partial(apply_fn)  # hashed by identity: a fresh trace, not a cached one
    return np.asarray(margin_bounds(fresh, params, x, y, eps=eps, method="crown"))


def _packings(apply_fn, params, shape):
    graph = graphs.trace(apply_fn, params, (1, *shape))
    found = packing.dependencies(graph)
    return graph, found, [packing.pack(graph, graph.operand(e), found)
                          for e in _activations(graph)]


def _activations(graph):
    return [e for e in graph.equations if e.kind not in (graphs.CONSTANT, graphs.AFFINE)]


@pytest.mark.parametrize("net", [_colour, _residual])
def test_packed_rows_give_the_bounds_of_one_neuron_per_row(net, monkeypatch):
    apply_fn, params, shape = net()
    _, _, packs = _packings(apply_fn, params, shape)
    assert any(p is not None for p in packs)  # the comparison below is of two real paths
    x = jax.random.uniform(jax.random.key(2), (3, *shape))
    y = jnp.argmax(jax.jit(apply_fn)(params, x), axis=-1)  # one program, not one per op
    packed = _crown(apply_fn, params, x, y, 0.02, True, monkeypatch)
    single = _crown(apply_fn, params, x, y, 0.02, False, monkeypatch)
    finite = np.isfinite(single)
    assert np.array_equal(finite, np.isfinite(packed))
    scale = 1.0 + np.abs(single[finite])
    assert np.max(np.abs(packed[finite] - single[finite]) / scale) < 1e-5


def test_rows_hold_neurons_with_disjoint_pixels_each_neuron_once():
    apply_fn, params, shape = _colour()
    graph, (pixel, support), packs = _packings(apply_fn, params, shape)
    operands = [graph.operand(e) for e in _activations(graph)]
    # 3x3 windows 2 apart, then 7x7 windows 4 apart: neighbours share pixels, every other not
    assert [p.members.shape for p in packs] == [(4 * 6, 16), (4 * 8, 4), (4 * 8, 4)]
    for operand, packed in zip(operands, packs):  # ReLU, ReLU, max pooling
        depends = support[operand]
        size = depends.shape[1]
        members = packed.members[packed.members < size]
        assert np.array_equal(np.sort(members), np.arange(size))
        for row, owner in zip(packed.members, packed.owner):
            row = row[row < size]
            counts = depends[:, row].sum(axis=1)
            assert counts.max() <= 1  # no pixel shared within a row
            expected = np.where(counts == 1, np.argmax(depends[:, row], axis=1), packed.slots)
            assert np.array_equal(owner, expected)


def test_small_cnn_second_convolution_packs_into_a_third_of_the_rows():
    module = SmallCNN()
    params = module.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
    _, _, packs = _packings(module.apply, params, (28, 28, 1))
    shapes = [None if p is None else p.members.shape for p in packs]
    # 5x5 stride-2 windows: conv1 neurons 3 apart, conv2 neurons (13x13 windows) 4 apart
    assert shapes == [(9 * 16, 25), (16 * 32, 4), None]


def test_no_packing_where_dependencies_cannot_be_traced():
    def padded(params, x):  # pixels of constant padding depend on no input
        h = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=0.5)
        h = jax.nn.relu(jax.lax.conv_general_dilated(h, params, (2, 2), "VALID",
                                                     dimension_numbers=("NHWC", "HWIO", "NHWC")))
        return h.reshape(h.shape[0], -1)[:, :3]

    kernel = jax.random.normal(jax.random.key(0), (3, 3, 1, 2))
    assert packing.dependencies(graphs.trace(padded, kernel, (1, 8, 8, 1))) is None
    big = graphs.trace(padded, kernel, (1, 80, 80, 1))  # over MAX_PIXELS
    assert packing.dependencies(big) is None


def _flipped():
    """A parameter chooses the image or its mirror (``where(flip, x[:, :, ::-1], x)``) before
    two strided convolutions: which pixels a neuron depends on is the parameter's to say."""
    kernels = jax.random.split(jax.random.key(3), 2)
    params = {"flip": jnp.ones((1, 1, 1, 1), bool),
              "k1": jax.random.normal(kernels[0], (3, 3, 1, 4)) / 3,
              "k2": jax.random.normal(kernels[1], (3, 3, 4, 4)) / 6}

    def apply(params, x):
        x = jnp.where(params["flip"], x[:, :, ::-1], x)
        for kernel in (params["k1"], params["k2"]):
            x = jax.nn.relu(jax.lax.conv_general_dilated(
                x, kernel, (2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")))
        return x.reshape(x.shape[0], -1)[:, :3]

    return apply, params, (15, 15, 1)


def test_no_packing_where_parameters_choose_the_pixels(monkeypatch):
    """Dependencies are traced with every parameter set to one: a parameter that selects or
    indexes (here, the mirror is off) would give the rows' pixels to the wrong neurons and
    bounds the model does not have. Such a program is not packed: CROWN's bounds are those of
    one neuron per row, and hold at points of the set."""
    apply_fn, params, shape = _flipped()
    params = {**params, "flip": jnp.zeros((1, 1, 1, 1), bool)}
    graph = graphs.trace(apply_fn, params, (1, *shape))
    assert packing.dependencies(graph) is None
    x = jax.random.uniform(jax.random.key(4), (2, *shape))
    y = jnp.argmax(jax.jit(apply_fn)(params, x), axis=-1)
    packed = _crown(apply_fn, params, x, y, 0.05, True, monkeypatch)
    single = _crown(apply_fn, params, x, y, 0.05, False, monkeypatch)
    np.testing.assert_array_equal(packed, single)
    corners = jnp.clip(x[:, None] + 0.05 * jax.random.rademacher(
        jax.random.key(5), (2, 64, *shape), jnp.float32), 0.0, 1.0)
    logits = jax.jit(jax.vmap(apply_fn, in_axes=(None, 0)))(params, corners)
    margins = np.asarray(jnp.take_along_axis(logits, y[:, None, None], axis=2) - logits)
    wrong = np.isfinite(packed)[:, None, :] & np.ones_like(margins, bool)  # [2, 64, 3]
    assert np.all(margins[wrong] >= np.broadcast_to(packed[:, None, :], margins.shape)[wrong])


def test_a_split_minimum_is_refused_for_an_l2_set():
    x = jnp.full((1, 2, 2, 1), 0.5)
    ball = sets.input_set(x, 0.1, "l2", 0.0, 1.0)
    with pytest.raises(ValueError, match="only a box"):
        sets.minimise(jnp.ones((3, 1, 2, 2, 1)), ball, contract=lambda a, v: a.sum())
