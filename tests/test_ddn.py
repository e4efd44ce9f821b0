"""DDN: factory, protocol, exact gradient count, the norm rule, the grid, a zero gradient, and
the linear model's analytic minimum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import emulation
from jaxbundle import AttackSpec, Plan, evaluate, losses, norms, suites
from jaxbundle.attacks import ddn
from jaxbundle.attacks.base import Candidate, WhiteBoxModel
from jaxbundle.attacks.white_box.ddn import ALPHA_MIN, step_size
from jaxbundle.bundler import bundle
from attack_checks import (assert_refused, check_deterministic_and_vmappable, check_factory,
                           step_flops)
from toys import (ColourCNN, KEY, images, linear_apply, linear_problem, min_distance,
                  run_steps)


def _problem(n=32, k=4, seed=2, spread=0.05):
    params, xf, yf = linear_problem(n=n, k=k, seed=seed, spread=spread)
    return params, WhiteBoxModel(linear_apply, params), images(xf), jnp.asarray(yf)


def test_factory_and_refusals():
    a = check_factory(ddn, name="ddn", norm="l2", goal="min_norm", num_steps=100,
                      num_restarts=1, gradients_per_step=1)
    assert a.config.gamma == 0.05 and a.config.init_norm == 1.0 and a.config.quantize
    assert suites.attack("ddn", "l2", steps=30).num_steps == 30
    assert suites.ATTACKS["ddn"].norms == ("l2",) and "Rony" in suites.ATTACKS["ddn"].paper
    assert_refused(ddn, [({"steps": 0}, "steps"), ({"gamma": 1.0}, "gamma"),
                         ({"gamma": 0.0}, "gamma"), ({"init_norm": 0.0}, "init_norm"),
                         ({"init_norm": float("inf")}, "init_norm")])
    with pytest.raises(ValueError, match="norm"):
        suites.attack("ddn", "linf")


def test_step_schedule():
    assert float(step_size(0, 100)) == pytest.approx(1.0)
    assert float(step_size(50, 100)) == pytest.approx(0.505)
    assert float(step_size(100, 100)) == pytest.approx(ALPHA_MIN)


def test_the_norm_grows_until_adversarial_then_shrinks_and_iterates_stay_in_the_box():
    """eps_{k+1} = eps_k (1 + gamma) while the iterate is not adversarial, (1 - gamma) once it
    is; every iterate in the box with its norm eps_k (the box clipping only shortens it); the
    candidates are the iterates with the model's logits."""
    params, model, x, y = _problem(spread=0.5)
    attack = ddn(steps=25, quantize=False)
    states, cands = run_steps(attack, model, None, x, y, None, attack.num_steps)
    for prev, cur, cand in zip(states, states[1:], cands):
        adversarial = np.asarray(losses.margin(cand.logits, y) > 0)
        factor = np.where(adversarial, 0.95, 1.05)
        expected = np.minimum(np.asarray(prev.eps) * factor, np.asarray(prev.worst_norm))
        np.testing.assert_allclose(np.asarray(cur.eps), expected, rtol=1e-6)
        assert float(cur.x.min()) >= 0.0 and float(cur.x.max()) <= 1.0
        assert np.all(np.asarray(norms.norm(cur.x - x, "l2")) <= np.asarray(cur.eps) * 1.0001)
        assert isinstance(cand, Candidate)
        np.testing.assert_allclose(cand.logits, model.logits(cand.x), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(cand.x), np.asarray(prev.x))
    assert np.any(np.asarray(states[-1].x) == 0.0) or np.any(np.asarray(states[-1].x) == 1.0)


def test_iterates_on_the_grid_where_the_example_is_judged_on_it():
    params, model, x, y = _problem()
    grid = jnp.arange(32) % 2 == 0
    states, _ = run_steps(ddn(steps=5), model._replace(grid=grid), None, x, y, None, 5)
    levels = np.asarray(states[-1].x) * 255
    on = np.abs(levels - np.round(levels)) < 1e-3
    assert on[::2].all() and not on[1::2].all()


def test_a_zero_gradient_steps_in_a_random_direction():
    """A model constant in its input: DDN's reference draws a normal direction; the iterate
    moves to norm eps_1 (no NaN) and differs between examples."""
    model = WhiteBoxModel(lambda p, xb: jnp.zeros((xb.shape[0], 3)) + p, jnp.float32(0.0))
    x = jnp.full((4, 10, 10, 1), 0.5)  # 100 pixels: the box does not clip a norm of 1.05
    y = jnp.zeros((4,), jnp.int32)
    states, _ = run_steps(ddn(steps=2, quantize=False), model, None, x, y, None, 1)
    delta = np.asarray(states[1].x - x)
    assert np.all(np.isfinite(delta))
    np.testing.assert_allclose(np.asarray(norms.norm(states[1].x - x, "l2")), 1.05, rtol=1e-5)
    assert not np.allclose(delta[0], delta[1])


def test_gradients_per_step_is_exact():
    params, model, x, y = _problem()
    forward, total = step_flops(ddn(), model, params, x, y)
    assert forward > 0 and total == 2 * forward


def test_deterministic_and_vmappable_over_restarts():
    _, model, x, y = _problem()
    check_deterministic_and_vmappable(ddn(steps=5), model, x, y)


def test_near_the_analytic_minimum_of_a_two_class_linear_model():
    """On a 2-class linear model the cross-entropy's gradient is the boundary's normal, so DDN
    walks straight at the closest boundary point and ends within a step of gamma of it. The
    toy's minima are 0.002 .. 0.07 (20 pixels), so the first norm is the toy's scale, 0.05, as
    1.0 is MNIST's; the norm schedule then reaches 0.0003 .. 6.6 in 100 steps."""
    params, x, y = linear_problem(n=200, k=2, seed=1)
    dist = min_distance(params, x, y, "l2")
    r = bundle([ddn(init_norm=0.05)], linear_apply, params, images(x), jnp.asarray(y), KEY,
               eps=0.1, norm="l2", judging="float")
    score = r.best["min_norm"].score
    keep = dist > 2e-3
    assert keep.sum() >= 150
    assert np.all(np.asarray(score.misclassified)[keep])
    ratio = np.asarray(score.distortion)[keep] / dist[keep]
    assert ratio.min() >= 1.0 - 1e-4 and ratio.max() <= 1.01 and np.median(ratio) <= 1.002


@pytest.mark.parametrize("fmt", ["tf32", "bfloat16"])
def test_on_colour_off_grid_images_under_accelerator_arithmetic_every_report_is_float32_true(
        fmt):
    """Off-grid colour 32x32 images (continuous values, as after resizing), a flax ``nn.Conv``
    network and a GPU's TF32 or a TPU's bfloat16 default arithmetic (emulated): each distortion
    DDN reports through ``evaluate`` is its image's float32 L2 distance, in the box, and that
    image is misclassified by the model in float32 (the same arithmetic on CPU would hide a
    search that trusted reduced-precision logits)."""
    net = ColourCNN()
    x = jax.random.uniform(jax.random.key(3), (12, 32, 32, 3))
    params = net.init(jax.random.key(4), x)
    y = np.asarray(jnp.argmax(net.apply(params, x), -1))  # every example clean-correct
    plan = Plan.of(eps=0.5, attacks=(AttackSpec("ddn", steps=40),), norm="l2",
                   goals=("misclassify", "min_norm"), judging="float")
    with emulation.default_precision(fmt):
        pe = evaluate(net.apply, params, (np.asarray(x), y), plan, mesh=None,
                      keep_images=True).per_example
    fooled = pe["success"].astype(bool)
    assert 4 <= fooled.sum() < fooled.size
    adv = np.asarray(pe["x_adv"], np.float32)[fooled]
    assert adv.min() >= 0 and adv.max() <= 1
    true = np.linalg.norm((adv - np.asarray(x)[fooled]).reshape(fooled.sum(), -1), axis=1)
    np.testing.assert_allclose(pe["distortion"][fooled], true, rtol=1e-5)
    assert np.all(true <= 0.5) and np.all(pe["min_distortion"][fooled] <= true * (1 + 1e-6))
    with jax.default_matmul_precision("highest"):
        predicted = np.asarray(jnp.argmax(net.apply(params, jnp.asarray(adv)), -1))
    assert np.all(predicted != y[fooled])
