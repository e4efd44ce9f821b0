"""CROWN's sparse refinement (jaxbundle.certify.crown.refinement): behind an activation only
the ReLUs IBP leaves unstable get CROWN's bounds, the others keep IBP's; the result does not
depend on how the rows are blocked, on whether they are first carried back for the whole
group, or on which examples share a group. Colour images and flax ``nn.Conv``, a net the
refinement was not built on."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle.certify import crown, ibp, packing, sets
from jaxbundle.certify import graph as graphs
from jaxbundle.certify.bounds import margin_bounds

SHAPE = (16, 16, 3)


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), strides=2)(x - 0.5))
        x = nn.relu(nn.Conv(6, (3, 3), strides=2, padding="VALID")(x))  # packs: 24 rows
        x = nn.relu(nn.Dense(12)(x.reshape(x.shape[0], -1)))
        return nn.Dense(4)(x)


@functools.cache
def _net():
    module = _Net()
    return module.apply, module.init(jax.random.key(0), jnp.zeros((1, *SHAPE)))


@functools.cache
def _sweeper(sparse):
    """The ReLUs' equation indices and a jitted sweep of :func:`_net` for the CROWN bounds of
    ``sparse``: compiled once, shared by every image, radius and test."""
    apply_fn, params = _net()
    graph = graphs.trace(apply_fn, params, (1, *SHAPE))
    relus = [i for i, e in enumerate(graph.equations) if e.kind == graphs.RELU]

    @jax.jit
    def bounds(leaves, image, eps):
        region = sets.input_set(image[None], eps, "linf", 0.0, 1.0)
        refine = crown.refinement(graph, region, sparse=sparse)
        state = ibp.sweep(graph, leaves, sets.hull(region), refine=refine)
        return ({i: state.pre[i] for i in relus},
                {i: state.interval(graph.operand(graph.equations[i])).bounds()
                 for i in relus})

    return relus, bounds


def _sweep(image, eps, sparse):
    """Per ReLU (by equation index) of :func:`_net`: CROWN's refined bounds on its input and
    IBP's, from one jitted sweep over the Linf ball of radius ``eps`` around ``image``."""
    relus, bounds = _sweeper(sparse)
    return relus, *bounds(jax.tree.leaves(_net()[1]), image, jnp.float32(eps))


def test_only_the_unstable_neurons_behind_an_activation_get_crown():
    image = jax.random.uniform(jax.random.key(1), SHAPE)
    relus, sparse, ibp_bounds = _sweep(image, 0.03, True)
    _, every, _ = _sweep(image, 0.03, False)
    first, second = relus[:2]
    # Before any activation every neuron gets CROWN either way.
    for a, b in zip(sparse[first], every[first]):
        np.testing.assert_array_equal(a, b)
    # The second ReLU's IBP bounds are the same in both (from the same first-layer bounds):
    # where they leave the neuron unstable the bounds are CROWN's, elsewhere IBP's own.
    ibp_low, ibp_high = ibp_bounds[second]
    unstable = (ibp_low < 0) & (ibp_high > 0)
    assert 0 < int(unstable.sum()) < unstable.size  # both kinds present: a real test
    low, high = sparse[second]
    np.testing.assert_allclose(np.where(unstable, low, ibp_low),
                               np.where(unstable, every[second][0], ibp_low), rtol=1e-5,
                               atol=1e-6)  # one neuron a row here, packed rows there
    np.testing.assert_array_equal(np.where(unstable, ibp_low, low), ibp_low)
    np.testing.assert_array_equal(np.where(unstable, ibp_high, high), ibp_high)
    assert np.any(every[second][0] > ibp_low)  # CROWN was tighter on some stable ones


def _unstable_counts(x, eps, index):
    counts = []
    for image, radius in zip(x, eps):
        _, _, ibp_bounds = _sweep(image, radius, True)
        low, high = ibp_bounds[index]
        counts.append(int(jnp.sum((low < 0) & (high > 0))))
    return counts


@pytest.mark.parametrize("chunk,shared", [
    # the smallest blocks and no head: three CROWN programs of many blocks, 11 s alone and
    # over the fast tier's 20 s under load once every block carries its rounding allowances
    pytest.param(2**8, 0, marks=pytest.mark.slow),
    (2**9, crown.SHARED_ELEMENTS), (2**20, crown.SHARED_ELEMENTS)])
def test_bounds_do_not_depend_on_blocks_head_or_group(chunk, shared, monkeypatch):
    apply_fn, params = _net()
    x = jax.random.uniform(jax.random.key(2), (5, *SHAPE))
    y = jnp.argmax(apply_fn(params, x), axis=-1)
    eps = jnp.asarray([0.0, 0.01, 0.02, 0.04, 0.08])  # from no unstable neuron to many
    reference = np.asarray(margin_bounds(apply_fn, params, x, y, eps=eps, method="crown"))
    monkeypatch.setattr(crown, "CHUNK_ELEMENTS", {"cpu": chunk, "other": chunk})
    monkeypatch.setattr(crown, "SHARED_ELEMENTS", shared)
    fresh = functools.partial(apply_fn)  # a fresh trace under the patched sizes
    blocked = np.asarray(margin_bounds(fresh, params, x, y, eps=eps, method="crown"))
    np.testing.assert_allclose(blocked, reference, rtol=1e-5, atol=1e-5)
    if shared:  # the group alone once, where the blocks are smallest and no head is carried
        return  # (each example alone under the default blocks: the test below)
    alone = [np.asarray(margin_bounds(fresh, params, x[b:b + 1], y[b:b + 1], eps=eps[b],
                                      method="crown"))[0] for b in (1, 4)]
    np.testing.assert_allclose(np.stack(alone), reference[[1, 4]], rtol=1e-5, atol=1e-5)


def test_a_group_too_unstable_for_one_neuron_per_row_takes_the_packed_rows():
    apply_fn, params = _net()
    graph = graphs.trace(apply_fn, params, (1, *SHAPE))
    second = [i for i, e in enumerate(graph.equations) if e.kind == graphs.RELU][1]
    packed = packing.pack(graph, graph.operand(graph.equations[second]),
                          packing.dependencies(graph))
    x = jax.random.uniform(jax.random.key(3), (2, *SHAPE))
    y = jnp.argmax(apply_fn(params, x), axis=-1)
    eps = jnp.asarray([0.01, 0.1])
    few, many = _unstable_counts(x, eps, second)
    assert few <= packed.members.shape[0] < many  # alone: one neuron a row; together: packed
    together = np.asarray(margin_bounds(apply_fn, params, x, y, eps=eps, method="crown"))
    # The first example without the second: twice in a group of its own (the program above).
    twice = jnp.asarray([0, 0])
    alone = np.asarray(margin_bounds(apply_fn, params, x[twice], y[twice], eps=eps[twice],
                                     method="crown"))
    np.testing.assert_allclose(alone[0], together[0], rtol=1e-5, atol=1e-5)
