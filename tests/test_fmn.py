"""FMN: factory, protocol, exact gradient count, eps_k rules, and the linear-model oracles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import losses, norms
from jaxbundle.attacks.base import Attack, Candidate, WhiteBoxModel
from jaxbundle.attacks.white_box.fmn import cosine, fmn
from jaxbundle.bundler import bundle
from attack_checks import assert_refused, check_deterministic_and_vmappable, step_flops
from toys import KEY, images, linear_apply, linear_problem, min_distance, run_steps


def _run(attack: Attack, model, x, y, steps=None):
    # The attack ignores keys and eps (minimum-norm, deterministic).
    return run_steps(attack, model, None, x, y, None, attack.num_steps if steps is None else steps)


def _l1_min_distance_in_box(params, x, y) -> np.ndarray:
    """Exact minimal L1 distance to misclassification of a linear model inside the box [0, 1].

    Per class j a fractional knapsack: buy margin on the pixels with the largest |w_j - w_y|
    first, each up to the box (``1 - x`` upwards, ``x`` downwards).
    """
    w = np.asarray(params["w"], np.float64)
    z = np.asarray(linear_apply(params, jnp.asarray(x)), np.float64)
    best = np.full(len(y), np.inf)
    for i in range(len(y)):
        for j in range(w.shape[1]):
            if j == y[i]:
                continue
            diff = w[:, j] - w[:, y[i]]
            need, cost = z[i, y[i]] - z[i, j], 0.0
            room = np.where(diff > 0, 1.0 - x[i], x[i])
            for c in np.argsort(-np.abs(diff)):
                if abs(diff[c]) * room[c] >= need:
                    cost, need = cost + need / abs(diff[c]), 0.0
                    break
                cost, need = cost + room[c], need - abs(diff[c]) * room[c]
            if need <= 0:
                best[i] = min(best[i], cost)
    return best


def _oracle(params, x, y, norm):
    if norm == "l1":
        return _l1_min_distance_in_box(params, x, y)
    return min_distance(params, x, y, norm)


def _best(params, x, y, norm, attack):
    r = bundle(
        [attack], linear_apply, params, images(x), jnp.asarray(y), KEY, eps=0.1, norm=norm,
        judging="float",
    )
    return r.best["min_norm"].score


# ---------------------------------------------------------------------------------------------
# Factory, schedule and protocol.


def test_factory_defaults_and_equality():
    a = fmn()
    assert isinstance(a, Attack) and a.kind == "white-box" and a.goal == "min_norm"
    assert a.norm == "l2" and a.num_steps == 100 and a.num_restarts == 1 and a.name == "fmn"
    assert a.gradients_per_step == 1 and a.gradients == 100
    # alpha_init = 1.0 for every norm, as both reference implementations (pralab's and
    # adversarial-library's fmn); an earlier default of 10.0 for Linf had no source.
    for norm, alpha in (("l2", 1.0), ("linf", 1.0), ("l1", 1.0)):
        c = fmn(norm).config
        assert (c.alpha_init, c.alpha_final) == (alpha, alpha / 100)
        assert (c.gamma_init, c.gamma_final, c.boundary_slack) == (0.05, 0.001, True)
    assert fmn("l1", steps=7) == fmn("l1", steps=7)
    hash(a)
    assert fmn(alpha_init=2.0, alpha_final=0.5).config.alpha_final == 0.5


def test_factory_rejects_bad_arguments():
    assert_refused(fmn, [
        (("l0",), "norm"), (dict(steps=0), "steps"), (dict(alpha_init=0.0), "alpha_init"),
        (dict(alpha_final=-1.0), "alpha_final"), (dict(gamma_init=1.0), "gamma_init"),
        (dict(gamma_final=-0.1), "gamma_final"),
    ])


def test_cosine_schedule():
    k = jnp.arange(11)
    h = np.asarray(cosine(0.05, 0.001, k, 10))
    np.testing.assert_allclose(h[[0, 5, 10]], [0.05, 0.0255, 0.001], rtol=1e-5)
    assert np.all(np.diff(h) < 0)


@pytest.mark.parametrize("norm", ["linf", "l2", "l1"])
def test_iterates_in_box_and_eps_ball_and_logits_are_the_models(norm):
    # Images spread over the whole box: clipping binds.
    params, xf, yf = linear_problem(n=16, k=4, seed=2, spread=0.5)
    model, x, y = WhiteBoxModel(linear_apply, params), images(xf), jnp.asarray(yf)
    states, cands = _run(fmn(norm, steps=20), model, x, y)
    for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[-1])):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert any(np.any(np.asarray(s.x) == 0.0) or np.any(np.asarray(s.x) == 1.0) for s in states)
    for s in states:
        assert float(s.x.min()) >= 0.0 and float(s.x.max()) <= 1.0
        assert np.all(np.asarray(norms.in_ball(s.x - x, s.eps, norm)))
    for cand in cands:
        assert isinstance(cand, Candidate) and cand.logits.shape == (16, 4)
        np.testing.assert_allclose(cand.logits, model.logits(cand.x), rtol=1e-5, atol=1e-5)


def test_gradients_per_step_is_exact():
    """The step's multiply-adds on a linear model: one forward and one backward pass."""
    params, xf, yf = linear_problem(n=16, k=4)
    model, x, y = WhiteBoxModel(linear_apply, params), images(xf), jnp.asarray(yf)
    attack = fmn("l1")
    forward, total = step_flops(attack, model, params, x, y)
    assert forward > 0 and total == forward * (1 + attack.gradients_per_step)


def test_deterministic_and_vmappable_over_restarts():
    params, xf, yf = linear_problem(n=16, k=4)
    model, x, y = WhiteBoxModel(linear_apply, params), images(xf), jnp.asarray(yf)
    attack = fmn("linf", steps=5)
    check_deterministic_and_vmappable(attack, model, x, y)


@pytest.mark.parametrize("norm", ["linf", "l2", "l1"])
def test_first_step_eps_rules(norm):
    """Step 1 from x0: eps_1 = (1 + gamma_1) * |margin| / ||grad||_* where x0 is classified
    correctly (the first-order boundary estimate), 0 where x0 is already misclassified."""
    params, xf, yf = linear_problem(n=16, k=4, seed=5)
    yf = yf.copy()
    yf[:3] = (yf[:3] + 1) % 4  # misclassified from the start
    model, x, y = WhiteBoxModel(linear_apply, params), images(xf), jnp.asarray(yf)
    attack = fmn(norm, steps=10)
    states, _ = _run(attack, model, x, y, steps=1)
    margin, grad, _ = model.loss_and_grad(losses.margin, x, y)
    dual = {"linf": "l1", "l2": "l2", "l1": "linf"}[norm]
    gamma1 = float(cosine(0.05, 0.001, 1, 10))
    expected = (1 + gamma1) * np.abs(margin) / np.asarray(norms.norm(grad, dual))
    eps = np.asarray(states[1].eps)
    np.testing.assert_allclose(eps[3:], expected[3:], rtol=1e-5)
    np.testing.assert_array_equal(eps[:3], 0.0)
    np.testing.assert_array_equal(np.asarray(states[1].best_norm[:3]), 0.0)
    np.testing.assert_array_equal(np.asarray(states[1].x[:3]), np.asarray(x[:3]))
    assert np.all(np.isinf(np.asarray(states[1].best_norm[3:])))


@pytest.mark.parametrize("norm", ["linf", "l2", "l1"])
def test_success_never_lost(norm):
    """||delta*|| only shrinks, eps_k never exceeds it after an adversarial step, and the
    bundle's min-norm result is at least as good as every misclassified candidate."""
    params, xf, yf = linear_problem(n=32, k=4, seed=6)
    model, x, y = WhiteBoxModel(linear_apply, params), images(xf), jnp.asarray(yf)
    attack = fmn(norm, steps=30)
    states, cands = _run(attack, model, x, y)
    for prev, cur, cand in zip(states, states[1:], cands):
        before, after = np.asarray(prev.best_norm), np.asarray(cur.best_norm)
        assert np.all(after <= before)
        adv = np.asarray(losses.margin(cand.logits, y) > 0)
        assert np.all(np.isfinite(after[adv]))
        assert np.all(np.asarray(cur.eps)[adv] <= after[adv])
    wrong = np.stack([np.asarray(losses.margin(c.logits, y) > 0) for c in cands])
    dist = np.stack([np.asarray(norms.norm(c.x - x, norm)) for c in cands])
    smallest = np.where(wrong, dist, np.inf).min(axis=0)
    np.testing.assert_allclose(np.asarray(states[-1].best_norm), smallest, rtol=1e-6)
    assert wrong.any(axis=0).mean() > 0.9
    best = _best(params, xf, yf, norm, attack)
    found = wrong.any(axis=0)
    assert np.all(np.asarray(best.misclassified)[found])
    # Two float32 norms of the same delta (this test's and the bundle's program), each within
    # (20 pixels + 2) ulps of the exact one: they agree within 2 * 22 ulps.
    assert np.all(np.asarray(best.distortion)[found] <= smallest[found] * (1 + 44 * 2**-24))


# ---------------------------------------------------------------------------------------------
# Analytic oracles on linear models.


@pytest.mark.parametrize("norm", ["linf", "l2", "l1"])
@pytest.mark.parametrize("classes", [2, 4])
def test_within_one_percent_of_the_analytic_minimum(norm, classes):
    """For L1 with 4 classes the minimal single-pixel change leaves the box, so the oracle is
    the exact box-constrained minimum; elsewhere the box does not bind."""
    params, x, y = linear_problem(n=200, k=classes, seed=1)
    dist = _oracle(params, x, y, norm)
    best = _best(params, x, y, norm, fmn(norm))
    keep = dist > 1e-3
    assert keep.sum() >= 150
    assert np.all(np.asarray(best.misclassified)[keep])
    ratio = np.asarray(best.distortion)[keep] / dist[keep]
    assert ratio.min() >= 1.0 - 1e-4 and ratio.max() <= 1.01


def test_box_oracle_agrees_with_the_unboxed_one_where_the_box_does_not_bind():
    params, x, y = linear_problem(n=50, k=2, seed=1)
    np.testing.assert_allclose(
        _l1_min_distance_in_box(params, x, y), min_distance(params, x, y, "l1"), rtol=1e-5
    )


def test_boundary_slack_aims_past_the_boundary_and_algorithm_1_onto_it():
    """Step 1 on a binary linear model, where the step reaches the eps_1 ball and the box does
    not bind: the iterate is ``x0 + eps_1 u`` with ``u`` the gradient direction, so its margin
    is ``m0 + eps_1 ||g||``. With the slack ``eps_1 = (1 + gamma_1) |m0| / ||g||`` the margin is
    ``gamma_1 |m0| > 0``; verbatim (``eps_1 = |m0| / ||g||``) it is 0 up to float32 rounding.
    The tolerance is derived: half the slack's margin, ``gamma_1 |m0| / 2``, against a rounding
    error of a few float32 ulps of the logits (``~1e-6`` relative), far below it. (Whether
    the verbatim iterate lands a hair past or short of the boundary is rounding luck, so it is
    not asserted.)"""
    params, xf, yf = linear_problem(n=200, k=2, seed=1)
    model, x, y = WhiteBoxModel(linear_apply, params), images(xf), jnp.asarray(yf)
    m0, grad, logits0 = model.loss_and_grad(losses.margin, x, y)
    m0, g = np.asarray(m0), np.asarray(norms.norm(grad, "l2"))
    gamma1 = float(cosine(0.05, 0.001, 1, 30))
    scale = np.abs(np.asarray(logits0)).max(axis=1)
    for slack, target in ((True, gamma1), (False, 0.0)):
        attack = fmn("l2", steps=30, boundary_slack=slack)
        state = _run(attack, model, x, y, steps=1)[0][1]
        eps, x1 = np.asarray(state.eps), state.x
        reached = np.isclose(np.asarray(norms.norm(x1 - x, "l2")), eps, rtol=1e-4) & (m0 < 0)
        assert reached.sum() >= 150 and np.allclose(
            eps[reached], (1 + target) * np.abs(m0[reached]) / g[reached], rtol=1e-4
        )
        margin = np.asarray(losses.margin(linear_apply(params, x1), y))[reached]
        tol = gamma1 * np.abs(m0[reached]) / 2
        # the tolerance is far above float32 rounding of the logits
        assert np.all(tol > 100 * np.finfo(np.float32).eps * scale[reached])
        np.testing.assert_array_less(np.abs(margin - target * np.abs(m0[reached])), tol)
    with_slack = np.asarray(_best(params, xf, yf, "l2", fmn("l2", steps=30)).misclassified)
    assert with_slack.all()
