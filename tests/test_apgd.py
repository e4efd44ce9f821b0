"""APGD: the paper's schedule, targets as the restart axis, and linear-model oracles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import attacks, norms
import importlib

apgd_lib = importlib.import_module("jaxbundle.attacks.apgd")
from jaxbundle.attacks.base import WhiteBoxModel
from jaxbundle.bundler import bundle
from toys import KEY, images, linear_apply, linear_problem, min_distance


def test_checkpoints_follow_the_paper():
    # p = 0, .22, .41, .57, .70, .80, .87, .93, .99 (Croce & Hein 2020, section 3.2).
    assert apgd_lib.checkpoints(100) == (22, 41, 57, 70, 80, 87, 93, 99)
    assert apgd_lib.checkpoints(1000)[:4] == (220, 410, 570, 700)
    assert apgd_lib.checkpoints(1) == ()


def test_factory_names_restarts_and_validation():
    assert attacks.apgd().name == "apgd-ce"
    assert attacks.apgd(loss="dlr").name == "apgd-dlr"
    t = attacks.apgd(loss="dlr-targeted", targets=9)
    assert t.name == "apgd-t" and t.num_restarts == 9 and t.gradients == 900
    assert attacks.apgd(restarts=3).num_restarts == 3
    with pytest.raises(ValueError, match="norm"):
        attacks.apgd("l1")
    with pytest.raises(ValueError, match="loss"):
        attacks.apgd(loss="hinge")
    with pytest.raises(ValueError, match="steps"):
        attacks.apgd(steps=0)
    with pytest.raises(ValueError, match="targets, not restarts"):
        attacks.apgd(loss="dlr-targeted", restarts=2)


def _binary_problem(n=32):
    params, x, y = linear_problem(n=n, k=2, seed=11)
    return params, images(x), jnp.asarray(y)


def _run(attack, model, x, y, eps, restart=0):
    keys = attacks.per_example_keys(KEY, jnp.arange(x.shape[0]))
    state = attack.init(attack.config, keys, x, y, eps, model, restart)
    step = jax.jit(lambda s: attack.step(attack.config, s, model))
    for _ in range(attack.num_steps):
        state, _ = step(state)
    return state


def test_step_size_halves_at_every_checkpoint_once_the_optimum_is_reached():
    """A binary linear model's CE is maximised at a corner of the Linf ball, which the first
    (eta = 2 eps) sign step reaches; the loss never rises again, so condition 1 halves eta at
    every checkpoint, and x_best is that corner."""
    params, x, y = _binary_problem()
    model = WhiteBoxModel(linear_apply, params)
    eps = jnp.full(y.shape, 0.02, jnp.float32)
    attack = attacks.apgd("linf", steps=30)
    state = _run(attack, model, x, y, eps)
    halvings = len(apgd_lib.checkpoints(30))
    np.testing.assert_allclose(state.eta, 2 * 0.02 / 2**halvings, rtol=1e-6)
    w = np.asarray(params["w"])
    yy = np.asarray(y)
    direction = np.sign(w[:, 1 - yy] - w[:, yy]).T.reshape(x.shape)
    corner = np.clip(np.asarray(x) + 0.02 * direction, 0, 1)
    np.testing.assert_allclose(state.x_best, corner, atol=1e-6)
    assert np.all(np.asarray(state.increases) == 0)


def test_targets_are_the_ranked_other_classes():
    params, x, y = linear_problem(n=16, k=6, seed=2)
    model = WhiteBoxModel(linear_apply, params)
    x, y = images(x), jnp.asarray(y)
    attack = attacks.apgd(loss="dlr-targeted", targets=5, steps=2)
    keys = attacks.per_example_keys(KEY, jnp.arange(16))
    logits = np.asarray(model.logits(x))
    order = np.argsort(-logits, axis=1)  # the label is the top class (clean predictions)
    for r in range(5):
        state = attack.init(attack.config, keys, x, y, jnp.full((16,), 0.1), model, r)
        np.testing.assert_array_equal(state.target, order[:, r + 1])


def test_too_many_targets_for_the_model_is_a_clear_error():
    params, x, y = linear_problem(n=4, k=4)
    with pytest.raises(ValueError, match="needs at least 10 classes"):
        bundle([attacks.apgd(loss="dlr-targeted", targets=9, steps=2)], linear_apply, params,
               images(x), jnp.asarray(y), KEY, eps=0.1)


def _linear_success(attack, norm, seed=4):
    params, x, y = linear_problem(n=96, k=4, seed=seed)
    dist = min_distance(params, x, y, norm)
    eps = float(np.median(dist))
    r = bundle([attack], linear_apply, params, images(x), jnp.asarray(y), KEY, eps=eps,
               norm=norm, judging="float")
    assert np.all(np.asarray(norms.in_ball(r.best["misclassify"].x - images(x), eps, norm)))
    return np.asarray(r.attack_success[0]), dist, eps


@pytest.mark.parametrize("loss", ["ce", "dlr", "dlr-targeted", "ce-targeted"])
@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_linear_oracle_succeeds_exactly_below_the_minimal_distance(norm, loss):
    """A fixed-budget attack on a linear model: fooled iff the analytic distance < eps (the
    examples within 3% of eps either way are left out: that is the budget's resolution).

    Untargeted margin-like losses have local maxima on the sphere (one per wrong class), so
    they get 5 random restarts; the targeted versions try every wrong class (3 targets)."""
    attack = attacks.apgd(norm, loss=loss, steps=50, targets=3,
                          restarts=1 if loss.endswith("targeted") else 5)
    fooled, dist, eps = _linear_success(attack, norm)
    assert not np.any(fooled[dist > 1.03 * eps])
    assert fooled[dist < 0.97 * eps].mean() >= 0.97


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_apgd_beats_pgd_with_the_same_budget(norm):
    """Measured on this toy (50 steps, one run): APGD-CE 1.00 vs PGD-CE 0.62 (L2) and
    0.86 (Linf) of the examples fooled below the analytic distance."""
    apgd_fooled, dist, eps = _linear_success(attacks.apgd(norm, loss="ce", steps=50), norm)
    pgd_fooled, _, _ = _linear_success(attacks.pgd(norm, loss="ce", steps=50), norm)
    inside = dist < 0.97 * eps
    assert apgd_fooled[inside].mean() >= 0.97
    assert apgd_fooled[inside].mean() >= pgd_fooled[inside].mean() + 0.1
