"""P(D), D1/2, failure-rate curves, contributions: hand-computed answers and properties."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from jaxbundle import curves

INF = np.inf


def test_hand_computed_operating_characteristic_and_half_distortion():
    d = np.array([0.1, 0.3, INF, 0.2])
    ok = np.array([True, True, True, False])  # the 0.2 example is misclassified clean
    grid = np.array([0.05, 0.1, 0.2, 0.3, 1.0])
    np.testing.assert_allclose(curves.operating_characteristic(d, ok, grid),
                               [0, 1 / 3, 1 / 3, 2 / 3, 2 / 3])
    assert curves.half_distortion(d, ok) == {"d_half": 0.3, "fooled_fraction": 2 / 3,
                                             "n_correct": 3}


def test_half_distortion_is_infinite_not_nan_when_under_half_are_fooled():
    h = curves.half_distortion(np.array([INF, 0.1, INF]), np.ones(3, bool))
    assert h["d_half"] == INF and h["fooled_fraction"] == 1 / 3
    assert curves.half_distortion(np.array([0.1]), np.array([False]))["d_half"] is None


distortions = st.lists(
    st.one_of(st.floats(0, 5, allow_nan=False, width=32), st.just(INF)), min_size=1, max_size=40
)


@given(distortions, st.data())
def test_curve_is_monotone_bounded_and_consistent_with_d_half(values, data):
    d = np.asarray(values, np.float32)
    ok = np.asarray(data.draw(st.lists(st.booleans(), min_size=d.size, max_size=d.size)))
    grid = np.sort(np.unique(np.concatenate([d[np.isfinite(d)], np.linspace(0, 5, 11)])))
    p = curves.operating_characteristic(d, ok, grid)
    assert np.all((p >= 0) & (p <= 1)) and np.all(np.diff(p) >= 0)
    h = curves.half_distortion(d, ok)
    if not ok.any():
        assert h["d_half"] is None
        return
    m = int(ok.sum())
    fooled = np.sort(d[ok])
    assert h["d_half"] == fooled[math.ceil(m / 2) - 1]
    if np.isfinite(h["d_half"]):
        at = np.mean(d[ok] <= h["d_half"])
        below = np.mean(d[ok] < h["d_half"])
        assert at >= 0.5 > below  # the first D where P reaches one half
    else:
        assert np.isfinite(d[ok]).mean() < 0.5 + 1e-9


@given(distortions, st.data())
def test_operating_characteristic_counts_each_grid_point_by_brute_force(values, data):
    d = np.asarray(values, np.float32)
    ok = np.asarray(data.draw(st.lists(st.booleans(), min_size=d.size, max_size=d.size)))
    # The grid holds every finite value itself (ties count as fooled: <= D) and points between.
    grid = np.concatenate([d[np.isfinite(d)], curves.distortion_grid("l2", 20)]).astype(np.float32)
    got = curves.operating_characteristic(d, ok, grid)
    want = [np.sum(ok & (d <= g)) / ok.sum() if ok.any() else 0.0 for g in grid]
    np.testing.assert_array_equal(got, want)


def test_failure_rate_curve_hand_computed():
    attacked = np.array([0.95, 0.6, 0.0, 0.8])
    clean = np.array([0.0, 0.55, 0.0, 0.0])
    f = curves.failure_rate_curve(attacked, clean, thresholds=(0.5, 0.7, 0.9, 1.0))
    assert f["attacked"] == [0.75, 0.5, 0.25, 0.0]
    assert f["clean"] == [0.25, 0.0, 0.0, 0.0]


def test_attack_contribution_and_robustness_vs_compute():
    success = np.array([[1, 0], [1, 1], [0, 1], [0, 0], [1, 0]], bool)  # [n, A]
    winning = np.array([0, 0, 1, -1, 0])
    ok = np.array([True, True, True, True, False])
    c = curves.attack_contribution(success, winning, ok, ["a", "b"])
    assert c == {"a": {"won": 2, "only_this": 1}, "b": {"won": 1, "only_this": 1}}
    restart = np.array([2, 0, 1, 0, 2])
    c = curves.attack_contribution(success, winning, ok, ["a", "b"], restart)
    assert c["a"]["won_by_restart"] == {"0": 1, "2": 1} and c["b"]["won_by_restart"] == {"1": 1}
    r = curves.robustness_vs_compute(success, ok, [10, 100])
    assert r["cost"] == [0, 10, 110]
    np.testing.assert_allclose(r["robust_accuracy"], [80.0, 40.0, 20.0])
