"""The 8-bit grid: snapping and recognising it, radii in whole levels, and quantize's
regressions on it (clean images kept, whole Linf steps kept, L2 norm kept at ImageNet size).
The rest of quantize is tested in test_norms.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import norms
from norm_helpers import LEVELS, NAMES, grid, in_ball, on_grid, project, quantize
from norm_helpers import sphere_perturbation, steps


def test_snap_to_grid_rounds_only_the_examples_judged_on_the_grid():
    rng = np.random.default_rng(1)
    on = grid(rng.integers(0, LEVELS + 1, (1, 6, 6, 1)))
    off = rng.uniform(0, 1, (1, 6, 6, 1)).astype(np.float32)  # like a resized image
    x0 = np.concatenate([on, off])
    x = np.clip(x0 + rng.uniform(-0.02, 0.02, x0.shape), 0, 1).astype(np.float32)
    auto = np.asarray(norms.snap_to_grid(jnp.asarray(x), jnp.asarray(x0), 0.03, "linf"))
    assert on_grid(auto[0]) and not on_grid(auto[1])
    np.testing.assert_array_equal(auto[1], x[1])
    none = np.asarray(norms.snap_to_grid(jnp.asarray(x), jnp.asarray(x0), grid=jnp.zeros(2, bool)))
    np.testing.assert_array_equal(none, x)


def test_on_grid_recognises_8bit_images_however_divided():
    k = np.random.default_rng(2).integers(0, LEVELS + 1, (3, 28, 28, 1)).astype(np.uint8)
    numpy_way = k.astype(np.float32) / np.float32(255)
    xla_way = jnp.asarray(k, jnp.float32) * (1.0 / 255)  # may be an ulp off the numpy values
    for x in (numpy_way, xla_way, np.asarray(xla_way)):
        assert bool(np.all(norms.on_grid(x)))
    # A bilinear half-pixel shift leaves the grid (a constant image would not).
    shifted = 0.5 * (numpy_way + np.roll(numpy_way, 1, axis=2))
    assert not np.any(np.asarray(norms.on_grid(jnp.asarray(shifted))))
    assert np.all(norms.on_grid(np.full((2, 4, 4, 3), 7 / 255, np.float32)))


@pytest.mark.parametrize(
    "eps, name, levels",
    [(0.031, "linf", 7), (8 / 255, "linf", 8), (0.3, "linf", 76), (np.float32(4 / 255), "linf", 4),
     (0.031, "l1", 7), (0.5, "l2", np.sqrt(16256)), (2 / 255, "l2", 2)],
)
def test_grid_radius_is_in_whole_levels(eps, name, levels):
    assert norms.grid_radius(eps, name) == pytest.approx(levels / 255, abs=1e-9)


# Regression (fixed): norms.quantize computes grid values as k / levels in XLA, which on CPU is
# not correctly rounded: for ~half of the 256 levels it is one ulp off float32(k/255), the value
# jaxbundle.data gives x0 (numpy uint8 / 255). So quantize(x0, x0, eps, name) != x0 (767 of 1568
# pixels for two random [784] images), and at eps=0 the L1 distance is 1.6e-5, outside in_ball's
# slack: the quantised clean image fails verification
CLEAN = np.array([[0, 1, 7, 128, 254, 255], [7, 7, 7, 7, 7, 7], [3, 5, 9, 17, 33, 65]], np.int32)


@pytest.mark.parametrize("name", NAMES)
def test_quantize_zero_eps_keeps_x0_level(name):
    x0 = grid(CLEAN)
    q = np.asarray(quantize(jnp.asarray(x0), jnp.asarray(x0), 0.0, name))
    np.testing.assert_array_equal(steps(q), CLEAN)
    np.testing.assert_allclose(q, x0, rtol=0, atol=1e-7)


@pytest.mark.parametrize("name", NAMES)
def test_quantize_of_a_clean_image_is_the_identity(name):
    k = np.random.default_rng(0).integers(0, LEVELS + 1, (2, 784))
    x0 = grid(k)
    zero = jnp.zeros((2,), jnp.float32)
    q = quantize(jnp.asarray(x0), jnp.asarray(x0), zero, name)
    assert bool(jnp.all(in_ball(q - x0, zero, name)))
    for eps in (None, zero):
        q = quantize(jnp.asarray(x0), jnp.asarray(x0), eps, name)
        np.testing.assert_array_equal(np.asarray(q), x0)


@pytest.mark.parametrize("m", [1, 8])
def test_quantize_linf_on_grid_eps_keeps_full_steps(m):
    """On-grid Linf eps = m/255 and x = x0 +- eps (what PGD produces): every pixel keeps its
    m levels. Regression: a strict ``> eps`` test judged nearest rounding one ulp outside and
    truncating 7.9999995 levels gave 7 (eps 8/255 acted like 7/255, 1/255 like 0)."""
    k = np.arange(16, 240, dtype=np.int32).reshape(2, -1)
    sign = np.where(np.arange(k.size).reshape(k.shape) % 3 == 0, -1, 1)
    x0 = grid(k)
    eps = np.float32(m / LEVELS)
    x = np.asarray(project(jnp.asarray(x0 + sign * eps), jnp.asarray(x0), eps, "linf"))
    q = np.asarray(quantize(jnp.asarray(x), jnp.asarray(x0), eps, "linf"))
    np.testing.assert_array_equal(steps(q) - k, m * sign)


@pytest.mark.parametrize("kind", ["dense", "sparse", "signs"])
def test_quantize_l2_keeps_the_norm_at_imagenet_size(kind):
    """224 x 224 x 3 images at ImageNet's L2 eps 3 (the old truncation kept ~82 %)."""
    rng = np.random.default_rng(3)
    x0 = grid(rng.integers(0, LEVELS + 1, (2, 224, 224, 3)))
    delta = sphere_perturbation(rng, x0.shape, kind, 3.0, sparse_fraction=0.001)
    x = (x0 + delta).astype(np.float32)
    x = np.asarray(project(jnp.asarray(x), jnp.asarray(x0), 3.0, "l2"))
    q = np.asarray(quantize(jnp.asarray(x), jnp.asarray(x0), 3.0, "l2"))
    assert on_grid(q) and np.all(np.asarray(in_ball(jnp.asarray(q - x0), 3.0, "l2")))
    before = np.linalg.norm((x - x0).reshape(2, -1).astype(np.float64), axis=1)
    after = np.linalg.norm((q - x0).reshape(2, -1).astype(np.float64), axis=1)
    assert np.all(after >= 0.97 * before), after / before
