"""Tests for jaxbundle.losses: hand-computed values, sign conventions, invariances."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxbundle import losses

# Every loss function the module exports, jitted once per (function, shape): op-by-op
# dispatch compiles every primitive separately.
J = {name: jax.jit(getattr(losses, name))
     for name in losses.__all__ if name not in ("LOSSES", "get")}
assert len(J) == 8, sorted(J)


# --- Hand-computed values ---------------------------------------------------------------
# Four copies of the logits (2, 1, 0, -1), one per label, so a loss that mixes up rows or
# labels shows up. Sorted logits: pi1 = 2, pi2 = 1, pi3 = 0, pi4 = -1.
Z = np.array([2.0, 1.0, 0.0, -1.0])
LOGITS = jnp.asarray(np.tile(Z, (4, 1)), jnp.float32)
LABELS = jnp.array([0, 1, 2, 3], jnp.int32)
TARGETS = jnp.array([1, 2, 3, 0], jnp.int32)
LSE = np.log(np.exp(Z).sum())
P = np.exp(Z - LSE)  # softmax


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b, np.float64), rtol=tol, atol=tol)


def test_hand_cross_entropy():
    close(J["cross_entropy"](LOGITS, LABELS), LSE - Z)  # -log p_y
    close(J["targeted_cross_entropy"](LOGITS, TARGETS), Z[[1, 2, 3, 0]] - LSE)  # log p_t


def test_hand_margin_and_other_class_max():
    close(J["other_class_max"](LOGITS, LABELS), [1.0, 2.0, 2.0, 2.0])
    close(J["margin"](LOGITS, LABELS), [-1.0, 1.0, 2.0, 3.0])
    # z_t - max_{j != t} z_j for t = 1, 2, 3, 0.
    close(J["targeted_margin"](LOGITS, TARGETS), [-1.0, -2.0, -3.0, 1.0])


def test_hand_dlr():
    # margin / (pi1 - pi3) = margin / 2.
    close(J["dlr"](LOGITS, LABELS), [-0.5, 0.5, 1.0, 1.5])
    # -(z_y - z_t) / (pi1 - (pi3 + pi4) / 2) = -(z_y - z_t) / 2.5.
    close(J["targeted_dlr"](LOGITS, LABELS, TARGETS), [-0.4, -0.4, -0.4, 1.2])


def test_hand_dlr_unsorted_logits():
    # The sort must be over each row's logits, not over their positions.
    logits = jnp.array([[0.0, 3.0, -1.0, 1.0], [1.0, -2.0, 4.0, 2.0]], jnp.float32)
    # Row 0: sorted 3, 1, 0, -1; y = 0: margin = 3 - 0 = 3, pi1 - pi3 = 3 -> 1.
    # Row 1: sorted 4, 2, 1, -2; y = 2: margin = 2 - 4 = -2, pi1 - pi3 = 3 -> -2/3.
    close(J["dlr"](logits, jnp.array([0, 2])), [1.0, -2.0 / 3.0])
    # Targeted, y = (0, 2), t = (1, 0): -(0 - 3) / (3 - (0 - 1) / 2); -(4 - 1) / (4 - (1 - 2) / 2).
    close(
        J["targeted_dlr"](logits, jnp.array([0, 2]), jnp.array([1, 0])),
        [3.0 / 3.5, -3.0 / 4.5],
    )


def test_hand_wrong_class_confidence():
    # Label 0: the best other class is 1; otherwise class 0.
    close(J["wrong_class_confidence"](LOGITS, LABELS), [P[1], P[0], P[0], P[0]])


def test_large_logits_are_stable():
    logits = jnp.array([[1000.0, 0.0, -1000.0], [1000.0, 0.0, -1000.0]], jnp.float32)
    y = jnp.array([1, 0])
    close(J["cross_entropy"](logits, y), [1000.0, 0.0])
    close(J["wrong_class_confidence"](logits, y), [1.0, np.exp(-1000.0)])
    close(J["dlr"](logits, y), [0.5, -0.5])
    for fn in (J[n] for n in ("cross_entropy", "margin", "dlr", "wrong_class_confidence")):
        assert np.all(np.isfinite(np.asarray(fn(logits, y))))


def test_margin_gradient_points_from_label_to_runner_up():
    g = jax.grad(lambda z: losses.margin(z, LABELS).sum())(LOGITS)
    expected = np.zeros((4, 4))
    expected[np.arange(4), [1, 0, 0, 0]] += 1.0
    expected[np.arange(4), [0, 1, 2, 3]] -= 1.0
    np.testing.assert_array_equal(np.asarray(g), expected)


def test_get():
    assert losses.get("ce") is losses.cross_entropy
    assert losses.get("margin") is losses.margin
    assert losses.get("dlr") is losses.dlr
    assert set(losses.LOSSES) == {"ce", "margin", "dlr"}


@pytest.mark.parametrize("name", ["", "hinge", "targeted_margin", "cw"])
def test_get_unknown_raises(name):
    with pytest.raises(ValueError, match="unknown loss"):
        losses.get(name)


# --- Properties against a numpy reference -----------------------------------------------

SHAPES = ((3, 10), (2, 3))  # (B, K); XLA compiles once per shape
F32 = dict(allow_nan=False, allow_infinity=False, allow_subnormal=False, width=32)


@st.composite
def problem(draw, unique=False, shapes=SHAPES):
    b, k = draw(st.sampled_from(shapes))
    if unique:  # distinct logits, >= 0.25 apart: no ties, no vanishing DLR denominators
        ints = np.stack([draw(st.permutations(range(-2 * k, 2 * k)))[:k] for _ in range(b)])
        logits = (ints * np.float32(0.25)).astype(np.float32)
    else:
        logits = draw(hnp.arrays(np.float32, (b, k), elements=st.floats(-10, 10, **F32)))
    y = draw(hnp.arrays(np.int32, (b,), elements=st.integers(0, k - 1)))
    t = draw(hnp.arrays(np.int32, (b,), elements=st.integers(0, k - 1)))
    return logits, y, t


def ref_losses(logits, y, t):
    z = logits.astype(np.float64)
    b = np.arange(z.shape[0])
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    others = np.where(np.eye(z.shape[1], dtype=bool)[y], -np.inf, z)
    others_t = np.where(np.eye(z.shape[1], dtype=bool)[t], -np.inf, z)
    top = -np.sort(-z, axis=1)
    margin = others.max(1) - z[b, y]
    p = np.exp(z - lse[:, None])
    with np.errstate(divide="ignore", invalid="ignore"):  # tied top logits: masked later
        dlr = margin / (top[:, 0] - top[:, 2])
        tdlr = None
        if z.shape[1] >= 4:
            tdlr = -(z[b, y] - z[b, t]) / (top[:, 0] - 0.5 * (top[:, 2] + top[:, 3]))
    ref = {
        "cross_entropy": lse - z[b, y],
        "margin": margin,
        "other_class_max": others.max(1),
        "targeted_cross_entropy": z[b, t] - lse,
        "targeted_margin": z[b, t] - others_t.max(1),
        "wrong_class_confidence": np.where(np.eye(z.shape[1], dtype=bool)[y], -1, p).max(1),
        "dlr": dlr,
    }
    if tdlr is not None:
        ref["targeted_dlr"] = tdlr
    return ref, top


@given(case=problem())
def test_matches_numpy_reference(case):
    logits, y, t = case
    ref, top = ref_losses(logits, y, t)
    z, yj, tj = jnp.asarray(logits), jnp.asarray(y), jnp.asarray(t)
    for name, expected in ref.items():
        if name == "targeted_dlr":
            got = J[name](z, yj, tj)
            keep = top[:, 0] - 0.5 * (top[:, 2] + top[:, 3]) > 1e-2
        elif name.startswith("targeted"):
            got = J[name](z, tj)
            keep = np.ones(len(y), bool)
        else:
            got = J[name](z, yj)
            keep = top[:, 0] - top[:, 2] > 1e-2 if name == "dlr" else np.ones(len(y), bool)
        got = np.asarray(got)
        assert got.shape == (len(y),), name
        np.testing.assert_allclose(got[keep], expected[keep], rtol=1e-4, atol=1e-4, err_msg=name)


@given(case=problem(unique=True))
def test_sign_conventions(case):
    logits, y, t = case
    z = jnp.asarray(logits)
    pred = logits.argmax(1)
    m = np.asarray(J["margin"](z, jnp.asarray(y)))
    np.testing.assert_array_equal(m > 0, pred != y)  # margin > 0 iff misclassified
    np.testing.assert_array_equal(m < 0, pred == y)
    tm = np.asarray(J["targeted_margin"](z, jnp.asarray(t)))
    np.testing.assert_array_equal(tm > 0, pred == t)  # > 0 iff the target is predicted
    d = np.asarray(J["dlr"](z, jnp.asarray(y)))
    np.testing.assert_array_equal(np.sign(d), np.sign(m))
    # Correctly classified: DLR = -(pi1 - pi2) / (pi1 - pi3) lies in [-1, 0).
    assert np.all((d[pred == y] >= -1 - 1e-6) & (d[pred == y] < 0))
    ce = np.asarray(J["cross_entropy"](z, jnp.asarray(y)))
    assert np.all(ce > 0)
    assert np.all(np.asarray(J["targeted_cross_entropy"](z, jnp.asarray(t))) < 0)
    if logits.shape[1] >= 4:
        td = np.asarray(J["targeted_dlr"](z, jnp.asarray(y), jnp.asarray(t)))
        zy, zt = logits[np.arange(len(y)), y], logits[np.arange(len(y)), t]
        np.testing.assert_array_equal(td > 0, zt > zy)


@given(
    case=problem(unique=True, shapes=((3, 10),)),
    scale=st.floats(0.125, 8.0, **F32),
    shift=st.floats(-10.0, 10.0, **F32),
)
def test_dlr_invariant_to_shift_and_positive_scale(case, scale, shift):
    logits, y, t = case
    moved = (logits * np.float32(scale) + np.float32(shift)).astype(np.float32)
    for z in (logits, moved):
        assume(np.all(np.isfinite(z)))
    yj, tj = jnp.asarray(y), jnp.asarray(t)
    a = np.asarray(J["dlr"](jnp.asarray(logits), yj))
    b = np.asarray(J["dlr"](jnp.asarray(moved), yj))
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
    a = np.asarray(J["targeted_dlr"](jnp.asarray(logits), yj, tj))
    b = np.asarray(J["targeted_dlr"](jnp.asarray(moved), yj, tj))
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
    # ... while the margin scales with the logits (so the test can tell them apart).
    ma = np.asarray(J["margin"](jnp.asarray(logits), yj))
    mb = np.asarray(J["margin"](jnp.asarray(moved), yj))
    np.testing.assert_allclose(mb, ma * scale, rtol=1e-4, atol=1e-4)


@given(case=problem())
def test_wrong_class_confidence_is_max_other_softmax(case):
    logits, y, _ = case
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    rows = np.arange(len(y))
    others = p.copy()
    others[rows, y] = -1.0
    got = np.asarray(J["wrong_class_confidence"](jnp.asarray(logits), jnp.asarray(y)))
    np.testing.assert_allclose(got, others.max(1), rtol=1e-5, atol=1e-6)
    assert np.all((got >= 0) & (got <= 1 - p[rows, y] + 1e-6))
