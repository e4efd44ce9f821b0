"""Property tests for jaxbundle.goals, through the bundler's per-example ``fold``.

A random stream of candidates (index 0 is the initial best, e.g. the clean image) is folded
one by one into a BestState and compared, per example, with a plain numpy reference of what
each goal promises. Candidate i carries ``step = i`` and ``x = i`` so the winner is visible.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxbundle import goals, norms
from jaxbundle.bundler import BestState, fold

GOAL_NAMES = ("misclassify", "max_confidence", "min_norm")
FOLD = jax.jit(fold, static_argnums=0)

# Distortions are eps * factor. goals.within has slack 1e-5 relative + 1e-7 absolute: 1.000001
# is inside it, 1.001 clearly outside. With eps = 0 the distortions are 0.1 * factor instead,
# so only factor 0 is within.
FACTORS = np.array([0.0, 0.3, 0.999, 1.0, 1.000001, 1.001, 1.5, 3.0], np.float32)
EPS = np.array([0.0, 0.1, 0.3, 1.0, 2.5], np.float32)
MARGINS = np.array([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], np.float32)
CONFIDENCES = np.array([0.05, 0.2, 0.5, 0.7, 0.9], np.float32)


class Stream:
    """``n + 1`` candidates for ``B`` examples, as numpy arrays ``[n + 1, B]``."""

    def __init__(self, mis, factor_i, margin_i, conf_i, eps_i):
        self.eps = EPS[eps_i]  # [B]
        self.mis = mis
        base = np.where(self.eps > 0, self.eps, np.float32(0.1))
        self.distortion = (base[None, :] * FACTORS[factor_i]).astype(np.float32)
        self.ok = np.where(self.eps[None, :] > 0, FACTORS[factor_i] <= 1.000001, factor_i == 0)
        self.margin = MARGINS[margin_i]
        self.confidence = CONFIDENCES[conf_i]
        self.n1, self.b = mis.shape

    def state(self, i, x_shape=(2,)):
        b = self.b
        full = jnp.full((b,), i, jnp.int32)
        return BestState(
            x=jnp.full((b,) + x_shape, float(i), jnp.float32),
            score=goals.Score(
                misclassified=jnp.asarray(self.mis[i]),
                distortion=jnp.asarray(self.distortion[i]),
                confidence=jnp.asarray(self.confidence[i]),
                margin=jnp.asarray(self.margin[i]),
                prediction=full + 100,
                rate=jnp.asarray(self.mis[i], jnp.float32),
            ),
            attack=full,
            restart=full + 1000,
            step=full,
        )

    def permuted(self, perm):
        """Same initial state, candidates 1..n reordered by ``perm``."""
        order = np.concatenate([[0], 1 + np.asarray(perm)])
        out = object.__new__(Stream)
        out.__dict__.update(self.__dict__)
        for field in ("mis", "distortion", "ok", "margin", "confidence"):
            setattr(out, field, getattr(self, field)[order])
        return out


@st.composite
def streams(draw, clean_start=False):
    b = draw(st.sampled_from([1, 3, 4]))
    n = draw(st.integers(1, 7))
    shape = (n + 1, b)

    def idx(size):
        return hnp.arrays(np.int32, shape, elements=st.integers(0, size - 1))

    mis = draw(hnp.arrays(np.bool_, shape))
    factor_i = draw(idx(len(FACTORS)))
    if clean_start:  # the initial best is the clean image: distortion 0
        factor_i[0] = 0
    margin_i = draw(idx(len(MARGINS)))
    conf_i = draw(idx(len(CONFIDENCES)))
    eps_i = draw(hnp.arrays(np.int32, (b,), elements=st.integers(0, len(EPS) - 1)))
    return Stream(mis, factor_i, margin_i, conf_i, eps_i)


def run(goal, s, x_shape=(2,)):
    """Folds candidates 1..n into candidate 0; returns the states after each fold."""
    eps = jnp.asarray(s.eps)
    best = s.state(0, x_shape)
    history = [best]
    for i in range(1, s.n1):
        best = FOLD(goal, eps, best, s.state(i, x_shape))
        history.append(best)
    return history


def winners(best):
    return np.asarray(best.step)


# --- numpy references: the index of the candidate each goal keeps, per example ----------


def _first_max_within(values, s, e):
    inside = [i for i in range(s.n1) if s.ok[i, e]]
    if not inside:
        return 0
    return max(inside, key=lambda i: (values[i, e], -i))


def ref_misclassify(s, e):
    """The largest margin within eps (first on ties); the initial one if none is within."""
    return _first_max_within(s.margin, s, e)


def ref_max_confidence(s, e):
    return _first_max_within(s.confidence, s, e)


def ref_min_norm(s, e):
    hits = [i for i in range(s.n1) if s.mis[i, e]]
    if hits:
        return min(hits, key=lambda i: (s.distortion[i, e], i))
    return max(range(s.n1), key=lambda i: (s.margin[i, e], -i))


def check_state_is_candidate(best, s, idx):
    """Every leaf of ``best`` is the chosen candidate's, per example (no mixed rows)."""
    cols = np.arange(s.b)
    np.testing.assert_array_equal(np.asarray(best.x), np.broadcast_to(idx[:, None], (s.b, 2)))
    np.testing.assert_array_equal(np.asarray(best.score.misclassified), s.mis[idx, cols])
    np.testing.assert_array_equal(np.asarray(best.score.distortion), s.distortion[idx, cols])
    np.testing.assert_array_equal(np.asarray(best.score.confidence), s.confidence[idx, cols])
    np.testing.assert_array_equal(np.asarray(best.score.margin), s.margin[idx, cols])
    np.testing.assert_array_equal(np.asarray(best.score.prediction), idx + 100)
    np.testing.assert_array_equal(np.asarray(best.attack), idx)
    np.testing.assert_array_equal(np.asarray(best.restart), idx + 1000)


# --- misclassify -------------------------------------------------------------------------


@given(s=streams(clean_start=True))
def test_misclassify_matches_reference(s):
    s.mis = s.margin > 0  # consistent scores
    history = run("misclassify", s)
    idx = winners(history[-1])
    expected = np.array([ref_misclassify(s, e) for e in range(s.b)])
    np.testing.assert_array_equal(idx, expected)
    check_state_is_candidate(history[-1], s, idx)


@given(s=streams(clean_start=True))
def test_misclassify_success_is_never_lost(s):
    s.mis = s.margin > 0  # consistent scores: misclassified iff margin > 0
    cols = np.arange(s.b)
    for t, best in enumerate(run("misclassify", s)):
        idx = winners(best)
        assert np.all(s.ok[idx, cols]), "took a candidate outside eps"
        hits = s.mis[: t + 1] & s.ok[: t + 1]
        found = hits.any(axis=0)
        done = np.asarray(goals.success("misclassify", best.score, jnp.asarray(s.eps)))
        np.testing.assert_array_equal(done, found)
        # Among the successes so far, the one deepest inside a wrong class.
        deepest = np.where(hits, s.margin[: t + 1], -np.inf).max(axis=0)
        np.testing.assert_array_equal(s.margin[idx, cols][found], deepest[found])


# Regression (fixed): goals.misclassify ignores Score.misclassified and compares margins only,
# but verification (jaxbundle.judge.verify) marks a candidate with non-finite logits (or outside
# the box) as not misclassified while keeping its margin (+inf for logits (0, inf, 0)): folding
# such a verified failure into a verified success replaces the success, against the docstring 'a
# success is never replaced by a failure'


def test_misclassify_verified_failure_never_replaces_a_success():
    from jaxbundle.attacks.base import WhiteBoxModel
    from jaxbundle.bundler import candidate_state
    from jaxbundle.judge import Problem, verify

    def apply_fn(params, x):  # class 1 wins; far from x0 its logit overflows to +inf
        wrong = jnp.where(x[:, 0] > 0.5, jnp.inf, params)
        return jnp.stack([jnp.zeros_like(wrong), wrong, jnp.zeros_like(wrong)], axis=1)

    model = WhiteBoxModel(apply_fn, jnp.float32(2.0))
    x0 = jnp.zeros((1, 2), jnp.float32)
    y = jnp.zeros((1,), jnp.int32)
    eps = jnp.ones((1,), jnp.float32)

    def verified(x, attack):
        x = jnp.asarray([x], jnp.float32)
        state = candidate_state(x, model.logits(x), x0, y, "linf", (attack, 0, 0))
        clean = candidate_state(x0, model.logits(x0), x0, y, "linf", (-1, 0, 0))
        return verify(state, "misclassify", Problem(model, x0, y, eps, jnp.zeros((1,), bool)),
                      "linf", clean)

    @jax.jit
    def scenario():
        success, failure = verified([0.2, 0.0], 0), verified([0.9, 0.0], 1)
        return success, failure, fold("misclassify", eps, success, failure)

    success, failure, best = scenario()
    assert bool(success.score.misclassified[0]) and not bool(failure.score.misclassified[0])
    assert float(failure.score.margin[0]) == -np.inf  # the worst score: it never wins
    assert bool(goals.success("misclassify", best.score, eps)[0])
    assert int(best.attack[0]) == 0


@given(s=streams(clean_start=True))
def test_misclassify_ignores_candidates_outside_eps(s):
    # Make every candidate after the initial one a "perfect" attack outside the ball.
    s.mis[1:] = True
    s.margin[1:] = 1e3
    s.ok[1:] = False
    s.distortion[1:] = np.where(s.eps > 0, s.eps * 1.001, 0.1).astype(np.float32)
    np.testing.assert_array_equal(winners(run("misclassify", s)[-1]), 0)


# --- max_confidence -----------------------------------------------------------------------


@given(s=streams())
def test_max_confidence_matches_reference_and_is_monotone(s):
    cols = np.arange(s.b)
    history = run("max_confidence", s)
    prev_conf = prev_inside = None
    for t, best in enumerate(history):
        idx = winners(best)
        inside = s.ok[idx, cols]
        conf = s.confidence[idx, cols]
        # Best confidence within eps so far (and the initial, if it is within eps).
        seen = s.ok[: t + 1]
        top = np.where(seen, s.confidence[: t + 1], -np.inf).max(axis=0)
        np.testing.assert_array_equal(inside, seen.any(axis=0))
        np.testing.assert_array_equal(conf[inside], top[inside])
        if prev_conf is not None:
            assert np.all(conf[prev_inside] >= prev_conf[prev_inside])
            assert np.all(inside[prev_inside])
        prev_conf, prev_inside = conf, inside
    idx = winners(history[-1])
    np.testing.assert_array_equal(idx, [ref_max_confidence(s, e) for e in range(s.b)])
    check_state_is_candidate(history[-1], s, idx)


# --- min_norm ------------------------------------------------------------------------------


@given(s=streams())
def test_min_norm_matches_reference_and_is_monotone(s):
    cols = np.arange(s.b)
    history = run("min_norm", s)
    prev = None
    for t, best in enumerate(history):
        idx = winners(best)
        mis = s.mis[idx, cols]
        dist = s.distortion[idx, cols]
        seen = s.mis[: t + 1]
        np.testing.assert_array_equal(mis, seen.any(axis=0))  # misclassified once any was
        smallest = np.where(seen, s.distortion[: t + 1], np.inf).min(axis=0)
        np.testing.assert_array_equal(dist[mis], smallest[mis])
        if prev is not None:
            prev_mis, prev_dist = prev
            assert np.all(mis[prev_mis])  # stays misclassified
            assert np.all(dist[prev_mis] <= prev_dist[prev_mis])  # distortion never grows
        prev = (mis, dist)
    idx = winners(history[-1])
    np.testing.assert_array_equal(idx, [ref_min_norm(s, e) for e in range(s.b)])
    check_state_is_candidate(history[-1], s, idx)


def test_min_norm_ignores_eps():
    s = Stream(
        mis=np.array([[False], [True], [True]]),
        factor_i=np.array([[0], [7], [6]]),  # 3 eps, then 1.5 eps: both outside the ball
        margin_i=np.zeros((3, 1), np.int32),
        conf_i=np.zeros((3, 1), np.int32),
        eps_i=np.array([3]),
    )
    assert winners(run("min_norm", s)[-1]).tolist() == [2]
    assert winners(run("misclassify", s)[-1]).tolist() == [0]


# --- order independence ---------------------------------------------------------------------


@given(s=streams(clean_start=True), data=st.data())
def test_winning_values_do_not_depend_on_candidate_order(s, data):
    s.mis = s.margin > 0
    perm = data.draw(st.permutations(range(s.n1 - 1)))
    t = s.permuted(perm)
    a = {g: winners(run(g, s)[-1]) for g in GOAL_NAMES}
    b = {g: winners(run(g, t)[-1]) for g in GOAL_NAMES}

    def both(field, goal):
        cols = np.arange(s.b)
        return getattr(s, field)[a[goal], cols], getattr(t, field)[b[goal], cols]

    # max_confidence: the same confidence (and within-eps status) whatever the order.
    for field in ("confidence", "ok"):
        np.testing.assert_array_equal(*both(field, "max_confidence"))
    # min_norm: misclassified, then the same distortion; otherwise the same margin.
    ma, mb = both("mis", "min_norm")
    np.testing.assert_array_equal(ma, mb)
    da, db = both("distortion", "min_norm")
    np.testing.assert_array_equal(da[ma], db[ma])
    ra, rb = both("margin", "min_norm")
    np.testing.assert_array_equal(ra[~ma], rb[~ma])
    # misclassify: the same margin (and within-eps status) whatever the order.
    for field in ("margin", "ok"):
        np.testing.assert_array_equal(*both(field, "misclassify"))


# --- fold on image-shaped states ---------------------------------------------------------


def test_fold_selects_whole_images_per_example():
    s = Stream(
        mis=np.array([[False, False, True], [True, False, True]]),
        factor_i=np.zeros((2, 3), np.int32),
        margin_i=np.array([[0, 0, 4], [5, 2, 3]]),  # (-2, -2, 1) then (2, -0.5, 0.5)
        conf_i=np.zeros((2, 3), np.int32),
        eps_i=np.array([2, 2, 2]),
    )
    eps = jnp.asarray(s.eps)
    best = fold("misclassify", eps, s.state(0, (4, 4, 1)), s.state(1, (4, 4, 1)))
    # Example 0: the candidate succeeds; 1: it is closer to the boundary; 2: the clean image
    # is misclassified more deeply than the candidate.
    np.testing.assert_array_equal(np.asarray(best.x)[:, 0, 0, 0], [1.0, 1.0, 0.0])
    assert np.all(np.asarray(best.x) == np.asarray(best.x)[:, :1, :1, :1])


# --- within, success, score, check_goals ---------------------------------------------------


def _score(distortion, misclassified):
    d = jnp.asarray(distortion, jnp.float32)
    z = jnp.zeros_like(d)
    return goals.Score(jnp.asarray(misclassified), d, z, z, z.astype(jnp.int32),
                       jnp.asarray(misclassified, jnp.float32))


def test_within_tolerance():
    rtol, atol = norms.BALL_RTOL, norms.BALL_ATOL
    assert 0 < rtol <= 1e-4 and 0 < atol <= 1e-5  # far below one pixel level
    eps = jnp.array([0.3, 0.3, 0.3, 0.0, 0.0, 0.0], jnp.float32)
    d = [0.3, 0.3 * (1 + rtol / 2), 0.3 * (1 + 10 * rtol), 0.0, atol / 2, 3 * atol]
    got = np.asarray(goals.within(_score(d, [True] * 6), eps))
    np.testing.assert_array_equal(got, [True, True, False, True, True, False])


def test_success_per_goal():
    eps = jnp.array([1.0, 1.0, 1.0], jnp.float32)
    s = _score([0.5, 2.0, 0.5], [True, True, False])
    for goal in ("misclassify", "max_confidence"):
        np.testing.assert_array_equal(goals.success(goal, s, eps), [True, False, False])
    np.testing.assert_array_equal(goals.success("min_norm", s, eps), [True, True, False])


def test_score_hand_values():
    x0 = jnp.zeros((2, 2, 2, 1), jnp.float32)
    x = x0.at[0, 0, 0, 0].set(0.3).at[0, 1, 1, 0].set(-0.4).at[1, 0, 1, 0].set(0.1)
    logits = jnp.array([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]], jnp.float32)
    y = jnp.array([0, 0], jnp.int32)
    s = goals.score(x, logits, x0, y, "l2")
    np.testing.assert_array_equal(np.asarray(s.misclassified), [False, True])
    np.testing.assert_allclose(np.asarray(s.distortion), [0.5, 0.1], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s.margin), [-1.0, 3.0])
    np.testing.assert_array_equal(np.asarray(s.prediction), [0, 1])
    p = np.exp([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(s.confidence), [p[0, 1], p[1, 1]], rtol=1e-6)
    assert s.prediction.dtype == jnp.int32
    linf = goals.score(x, logits, x0, y, "linf").distortion
    np.testing.assert_allclose(np.asarray(linf), [0.4, 0.1], rtol=1e-6)


def test_check_goals():
    assert goals.check_goals("misclassify") == ("misclassify",)
    assert goals.check_goals("min_norm") == ("misclassify", "min_norm")
    assert goals.check_goals([]) == ("misclassify",)
    assert goals.check_goals(["max_confidence", "misclassify", "min_norm"]) == (
        "misclassify",
        "max_confidence",
        "min_norm",
    )
    assert goals.check_goals(("min_norm", "min_norm", "misclassify", "min_norm")) == (
        "misclassify",
        "min_norm",
    )
    assert set(goals.GOALS) == set(GOAL_NAMES)


@pytest.mark.parametrize("bad", ["max_conf", ["misclassify", "l2"], ("MIN_NORM",), ""])
def test_check_goals_rejects_unknown(bad):
    with pytest.raises(ValueError, match="unknown goal"):
        goals.check_goals(bad)


def test_a_new_goal_is_one_record(monkeypatch):
    """A goal registered in GOALS alone is tracked, judged in the ball, and reported: nothing
    else in the library names it. "min_margin_win" keeps the misclassified candidate within
    eps of smallest margin (an adversarial example closest to the boundary)."""
    from jaxbundle import Plan, attacks, evaluate
    from toys import images, linear_apply, linear_problem, min_distance

    def take(best, cand, eps):
        ok = cand.misclassified & goals.within(cand, eps)
        return ok & (~(best.misclassified & goals.within(best, eps)) | (cand.margin < best.margin))

    record = goals.Goal(
        name="min_margin_win", take=take, bounded=True, needs_confidence=False,
        satisfied=None, promise=None,
        per_example=lambda s, eps: {"smallest_winning_margin": jnp.where(
            s.misclassified & goals.within(s, eps), s.margin, jnp.inf)},
    )
    monkeypatch.setitem(goals.GOALS, record.name, record)
    params, x, y = linear_problem(n=12, k=3, seed=4)
    eps = float(np.quantile(min_distance(params, x, y, "linf"), 0.7))
    plan = Plan.of(eps=eps, attacks=(attacks.pgd(steps=6, restarts=2),),
                goals=("misclassify", "min_margin_win"), seed=0)
    ev = evaluate(linear_apply, params, (images(x), y), plan, mesh=None)
    assert ev.metrics["goals"] == ["misclassify", "min_margin_win"]
    pe = ev.per_example
    win = pe["smallest_winning_margin"]
    fooled = pe["success"].astype(bool)
    assert fooled.any() and not fooled.all()
    # Exactly the fooled examples have a finite, positive winning margin, never above the one
    # the misclassify goal kept (the largest margin within eps).
    np.testing.assert_array_equal(np.isfinite(win), fooled)
    assert np.all(win[fooled] > 0)
    logits = np.asarray(linear_apply(params, jnp.asarray(pe["x_adv"].reshape(12, -1))))
    top = np.sort(logits, axis=1)
    largest = np.where(logits.argmax(1) != y, top[:, -1] - logits[np.arange(12), y], -np.inf)
    assert np.all(win[fooled] <= largest[fooled] + 1e-5)
