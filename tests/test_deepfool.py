"""DeepFool: factory, protocol, exact gradient count, and the linear-model oracles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import losses
from jaxbundle.attacks.base import Attack, Candidate, WhiteBoxModel
from jaxbundle.attacks.white_box.deepfool import deepfool
from jaxbundle.bundler import bundle
from attack_checks import assert_refused, check_deterministic_and_vmappable, step_flops
from toys import KEY, images, linear_apply, linear_problem, min_distance, run_steps


def _setup(n=16, k=4, seed=0, spread=0.05):
    params, x, y = linear_problem(n=n, k=k, seed=seed, spread=spread)
    model = WhiteBoxModel(linear_apply, params)
    return model, params, images(x), jnp.asarray(y), x, y


def _run(attack: Attack, model, x, y, steps=None):
    # The attack ignores keys and eps (minimum-norm, deterministic).
    return run_steps(attack, model, None, x, y, None, attack.num_steps if steps is None else steps)


def _ratio(params, x, y, norm, attack):
    """Min-norm distortion of the bundle over the analytic minimum, for dist > 1e-3."""
    dist = min_distance(params, x, y, norm)
    r = bundle(
        [attack], linear_apply, params, images(x), jnp.asarray(y), KEY, eps=0.1, norm=norm,
        judging="float",
    )
    best = r.best["min_norm"].score
    keep = dist > 1e-3
    assert keep.sum() >= 100
    assert np.all(np.asarray(best.misclassified)), "DeepFool finds every linear-model example"
    return np.asarray(best.distortion)[keep] / dist[keep]


# ---------------------------------------------------------------------------------------------
# Factory and protocol.


def test_factory_defaults_and_equality():
    a = deepfool()
    assert isinstance(a, Attack) and a.kind == "white-box" and a.goal == "min_norm"
    assert a.norm == "l2" and a.num_steps == 50 and a.num_restarts == 1 and a.name == "deepfool"
    assert a.config.candidates == 9 and a.config.overshoot == 0.02 and a.config.extra == 1e-4
    assert a.gradients_per_step == 9 and a.gradients == 50 * 9
    assert deepfool("linf", candidates=3) == deepfool("linf", candidates=3)
    hash(a)
    assert deepfool(candidates=3).gradients_per_step == 3


def test_factory_rejects_bad_arguments():
    assert_refused(deepfool, [
        (("l1",), "norm"), (("l3",), "norm"), (dict(steps=0), "steps"),
        (dict(candidates=0), "candidates"), (dict(overshoot=-0.1), "overshoot"),
        (dict(overshoot=float("nan")), "overshoot"), (dict(extra=-1e-4), "extra"),
    ])


def test_too_many_candidates_fail_at_trace_time():
    """K = 4 classes have 3 other classes: candidates=9 would make gradients_per_step a lie."""
    model, params, x, y, _, _ = _setup()
    attack = deepfool("l2")
    with pytest.raises(ValueError, match="candidates=3"):
        attack.init(attack.config, None, x, y, None, model, 0)
    with pytest.raises(ValueError, match="at least 10 classes"):
        bundle([attack], linear_apply, params, x, y, KEY, eps=0.1, norm="l2")


def test_candidates_are_the_top_clean_logits_other_than_y():
    model, _, x, y, _, _ = _setup(n=32, k=6, seed=3)
    attack = deepfool("l2", candidates=2)
    state = attack.init(attack.config, None, x, y, None, model, 0)
    logits = np.asarray(model.logits(x))
    for i in range(32):
        order = [j for j in np.argsort(-logits[i]) if j != int(y[i])]
        assert list(np.asarray(state.classes[i])) == order[:2]


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_state_stable_candidates_in_box_and_logits_are_the_models(norm):
    # Images spread over the whole box with a large overshoot: clipping binds.
    model, _, x, y, _, _ = _setup(n=16, k=4, seed=2, spread=0.5)
    attack = deepfool(norm, steps=4, candidates=3, overshoot=2.0)
    states, cands = _run(attack, model, x, y)
    for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[-1])):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert any(np.any(np.asarray(s.x) == 0.0) or np.any(np.asarray(s.x) == 1.0) for s in states)
    for point in [s.x for s in states] + [c.x for c in cands]:
        assert float(point.min()) >= 0.0 and float(point.max()) <= 1.0
    for cand in cands:
        assert isinstance(cand, Candidate) and cand.logits.shape == (16, 4)
        np.testing.assert_allclose(cand.logits, model.logits(cand.x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("candidates", [1, 3])
def test_gradients_per_step_is_exact(candidates):
    """Count the linear model's multiply-adds in the step: one forward pass plus one backward
    pass per candidate (each as costly as the forward pass), nothing else."""
    model, params, x, y, _, _ = _setup()
    attack = deepfool("l2", candidates=candidates)
    forward, total = step_flops(attack, model, params, x, y)
    assert forward > 0 and total == forward * (1 + attack.gradients_per_step)


def test_deterministic_and_vmappable_over_restarts():
    model, _, x, y, _, _ = _setup()
    attack = deepfool("linf", steps=3, candidates=3)
    check_deterministic_and_vmappable(attack, model, x, y)


def _mlp_problem(n=32, d=20, h=16, k=5, seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": jnp.asarray(rng.normal(size=(d, h)).astype(np.float32)),
        "w2": jnp.asarray(rng.normal(size=(h, k)).astype(np.float32)),
    }
    x = images(jnp.asarray((0.5 + 0.3 * rng.uniform(-1, 1, size=(n, d))).astype(np.float32)))
    logits = _mlp_apply(params, x)
    y = np.asarray(jnp.argmax(logits, axis=1)).astype(np.int32)
    y[:4] = (y[:4] + 1) % k  # four examples misclassified from the start
    return params, x, jnp.asarray(y)


def _mlp_apply(params, x):
    return jnp.tanh(x.reshape(x.shape[0], -1) @ params["w1"]) @ params["w2"]


def test_frozen_once_misclassified_and_success_never_lost():
    params, x, y = _mlp_problem()
    model = WhiteBoxModel(_mlp_apply, params)
    attack = deepfool("l2", steps=8, candidates=4)
    states, cands = _run(attack, model, x, y)
    wrong = [np.asarray(losses.margin(model.logits(s.x), y) > 0) for s in states]
    assert wrong[0][:4].all(), "clean-misclassified examples"
    np.testing.assert_array_equal(np.asarray(states[-1].x[:4]), np.asarray(x[:4]))
    for t in range(len(states) - 1):
        assert np.all(wrong[t + 1][wrong[t]]), "a misclassified iterate must stay misclassified"
        np.testing.assert_array_equal(
            np.asarray(states[t + 1].x)[wrong[t]], np.asarray(states[t].x)[wrong[t]]
        )
    # A nonlinear model needs more than one step for some examples, and DeepFool gets there.
    assert wrong[-1].mean() == 1.0 and wrong[1].mean() < 1.0


# ---------------------------------------------------------------------------------------------
# Analytic oracles on linear models.


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_exact_in_one_step_on_binary_linear_model(norm):
    """Two classes: the first step is the analytic minimal perturbation (the paper's step,
    ``extra=0``; the reference's extra 1e-4 lengthens it by that much), then the overshoot."""
    params, xf, yf = linear_problem(n=200, k=2, seed=1)
    model = WhiteBoxModel(linear_apply, params)
    x, y = images(xf), jnp.asarray(yf)
    states, _ = _run(deepfool(norm, steps=1, candidates=1, extra=0.0), model, x, y)
    dist = min_distance(params, xf, yf, norm)
    w = np.asarray(params["w"])
    sign = np.where(yf == 0, 1.0, -1.0)[:, None]  # towards the other class
    diff = sign * (w[:, 1] - w[:, 0])[None, :]
    if norm == "linf":
        expected = dist[:, None] * np.sign(diff)
    else:
        expected = dist[:, None] * diff / np.linalg.norm(diff, axis=1, keepdims=True)
    r_tot = np.asarray(states[1].r_tot).reshape(200, -1)
    np.testing.assert_allclose(r_tot, expected, rtol=1e-4, atol=1e-6)
    delta = np.asarray(states[1].x - x).reshape(200, -1)
    np.testing.assert_allclose(delta, 1.02 * r_tot, rtol=1e-4, atol=1e-6)
    ratio = _ratio(params, xf, yf, norm, deepfool(norm, steps=3, candidates=1, extra=0.0))
    np.testing.assert_allclose(ratio, 1.02, rtol=1e-4)
    states, _ = _run(deepfool(norm, steps=1, candidates=1), model, x, y)
    longer = expected * ((dist + 1e-4) / dist)[:, None]
    np.testing.assert_allclose(np.asarray(states[1].r_tot).reshape(200, -1), longer, rtol=1e-4,
                               atol=1e-6)


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_within_overshoot_of_the_analytic_distance_multiclass(norm):
    params, x, y = linear_problem(n=200, k=4, seed=1)
    ratio = _ratio(params, x, y, norm, deepfool(norm, steps=5, candidates=3, extra=0.0))
    assert ratio.min() >= 1.0 - 1e-4 and ratio.max() <= 1.02 + 1e-4
    # A smaller overshoot gets within 1% of the minimum.
    ratio = _ratio(params, x, y, norm, deepfool(norm, steps=5, candidates=3, overshoot=0.005,
                                                   extra=0.0))
    assert ratio.min() >= 1.0 - 1e-4 and ratio.max() <= 1.01


def test_fewer_candidates_are_sound_but_may_miss_the_nearest_class():
    params, x, y = linear_problem(n=200, k=4, seed=1)
    ratio = _ratio(params, x, y, "l2", deepfool("l2", steps=5, candidates=1))
    assert ratio.min() >= 1.0 - 1e-4
    assert np.median(ratio) >= 1.0 - 1e-4


def _tie_apply(params, x):
    """Two classes: z_0 = 0.5, z_1 = the first pixel (a tie at exactly 0.5)."""
    first = x.reshape(x.shape[0], -1)[:, 0]
    return jnp.stack([jnp.full_like(first, 0.5), first * params], axis=-1)


def test_the_references_extra_step_leaves_an_exact_tie():
    """From pixel 0.25 the linearised step (length 0.25, no overshoot) lands exactly on the tie
    z_0 = z_1 = 0.5: margin 0, not misclassified, and with the paper's bare step (extra=0) the
    next steps are zero, so the iterate stays on the tie for good. The reference's extra 1e-4
    crosses it: the smallest adversarial distortion is 0.25 + 1e-4."""
    x = jnp.full((1, 2, 2, 1), 0.25, jnp.float32)
    y = jnp.zeros(1, jnp.int32)
    model = WhiteBoxModel(_tie_apply, jnp.float32(1.0))
    stuck, _ = _run(deepfool("l2", steps=6, candidates=1, overshoot=0.0, extra=0.0), model, x, y)
    assert float(stuck[-1].x[0, 0, 0, 0]) == 0.5
    assert float(losses.margin(_tie_apply(1.0, stuck[-1].x), y)[0]) == 0.0
    for norm in ("l2", "linf"):
        r = bundle([deepfool(norm, steps=6, candidates=1, overshoot=0.0)], _tie_apply,
                   jnp.float32(1.0), x, y, KEY, eps=0.0, norm=norm, judging="float")
        best = r.best["min_norm"]
        assert bool(best.score.misclassified[0])
        np.testing.assert_allclose(float(best.x[0, 0, 0, 0]), 0.25 + 0.25 + 1e-4, rtol=1e-6)
        assert r.best["min_norm"].score.distortion[0] == pytest.approx(0.25 + 1e-4, rel=1e-4)
    stuck_bundle = bundle([deepfool("l2", steps=6, candidates=1, overshoot=0.0, extra=0.0)],
                          _tie_apply, jnp.float32(1.0), x, y, KEY, eps=0.0, norm="l2",
                          judging="float")
    assert not bool(stuck_bundle.best["min_norm"].score.misclassified[0])
