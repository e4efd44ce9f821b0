"""Natural shifts: exact transforms, box and grid, and accuracy/RR on a model with a known
answer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import shifts
from jaxbundle.attacks.base import per_example_keys


def _images(n=6, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, size=(n, 8, 8, 1)) / 255).astype(np.float32)


def _keys(n):
    return per_example_keys(jax.random.key(0), jnp.arange(n))


@pytest.mark.parametrize("name", sorted(shifts.SHIFTS))
@pytest.mark.parametrize("severity", [1, 5])
def test_shifted_images_stay_in_the_box_on_the_grid(name, severity):
    x = _images()
    out = np.asarray(shifts.apply_shift(jnp.asarray(x), _keys(6), name=name, severity=severity))
    assert out.shape == x.shape and out.min() >= 0 and out.max() <= 1
    np.testing.assert_allclose(out * 255, np.round(out * 255), atol=1e-3)
    assert not np.array_equal(out, x), "a shift at severity >= 1 must change the images"
    np.testing.assert_array_equal(
        shifts.apply_shift(jnp.asarray(x), _keys(6), name=name, severity=0), x
    )


def test_darkness_and_brightness_are_exact():
    x = _images()
    dark = shifts.apply_shift(jnp.asarray(x), _keys(6), name="darkness", severity=2)
    np.testing.assert_allclose(dark, np.round(x * 0.7 * 255) / 255, atol=1e-6)
    bright = shifts.apply_shift(jnp.asarray(x), _keys(6), name="brightness", severity=3)
    np.testing.assert_allclose(bright, np.round(np.clip(x + 0.3, 0, 1) * 255) / 255, atol=1e-6)


def test_smoothing_shifts_leave_flat_images_alone_and_noise_is_per_example():
    flat = jnp.full((3, 8, 8, 1), 100 / 255, jnp.float32)
    for name in ("sharpness", "blur", "contrast"):
        np.testing.assert_allclose(shifts.apply_shift(flat, _keys(3), name=name, severity=4), flat,
                                   atol=1e-6)
    noisy = np.asarray(shifts.apply_shift(flat, _keys(3), name="noise", severity=3))
    assert not np.allclose(noisy[0], noisy[1])
    again = np.asarray(shifts.apply_shift(flat, _keys(3), name="noise", severity=3))
    np.testing.assert_array_equal(noisy, again)
    assert 0.08 < np.std(noisy - np.asarray(flat)) < 0.16  # sigma 0.12


def test_sharpness_enhances_an_edge():
    x = np.zeros((1, 8, 8, 1), np.float32)
    x[:, :, 4:] = 0.5
    out = np.asarray(shifts.apply_shift(jnp.asarray(x), _keys(1), name="sharpness", severity=2))
    assert out[0, 4, 4, 0] > 0.5 and out[0, 4, 3, 0] == 0.0  # overshoot on the bright side


def _mean_model(threshold):
    """Class 1 iff the mean pixel exceeds ``threshold``."""
    def apply(params, x):
        m = jnp.mean(x.reshape(x.shape[0], -1), axis=1)
        return jnp.stack([threshold - m, m - threshold], axis=1)
    return apply


def test_evaluate_shifts_hand_computed_accuracy_and_rr():
    x = _images(n=40, seed=1)
    means = x.reshape(40, -1).mean(axis=1)
    threshold = float(np.median(means))
    y = (means > threshold).astype(np.int32)  # clean accuracy 100%
    r = shifts.evaluate_shifts(_mean_model(threshold), None, x, y, shifts=("darkness",),
                               severities=(1, 3), batch_size=16)
    assert r["clean_accuracy"] == 100.0
    for s in (1, 3):
        dark = np.round(x * (1 - 0.15 * s) * 255) / 255
        expected = 100.0 * np.mean((dark.reshape(40, -1).mean(axis=1) > threshold) == y)
        assert r["darkness"][str(s)]["accuracy"] == pytest.approx(expected)
        assert r["darkness"][str(s)]["relative_robustness"] == pytest.approx(expected)
    assert r["darkness"]["3"]["accuracy"] <= r["darkness"]["1"]["accuracy"] < 100.0


def test_evaluate_shifts_rejects_bad_arguments():
    x, y = _images(4), np.zeros(4, np.int32)
    with pytest.raises(ValueError, match="unknown shift"):
        shifts.evaluate_shifts(_mean_model(0.5), None, x, y, shifts=("fog",))
    with pytest.raises(ValueError, match="severities"):
        shifts.evaluate_shifts(_mean_model(0.5), None, x, y, severities=(0,))
    with pytest.raises(ValueError, match="images"):
        shifts.evaluate_shifts(_mean_model(0.5), None, x.reshape(4, -1), y)
