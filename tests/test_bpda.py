"""BPDA (jaxbundle.defences): the forward pass kept exactly, the approximation's gradient, EOT
over a random preprocessing, and the demo defence whose gradients are broken by design."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbundle
from jaxbundle import checks, models
from jaxbundle.attacks.base import WhiteBoxModel
from jaxbundle.models.quantized import dct_matrix, jpeg, squeeze
from toys import QUICK_TRAINING, images, linear_apply, linear_problem


def to_grid(x):
    """Round to multiples of 1/4: exactly zero gradient almost everywhere."""
    return jnp.round(x * 4) / 4


X = jnp.linspace(0.0, 1.0, 7)
W = jnp.arange(1.0, 8.0)


def test_forward_is_the_preprocessing_and_gradient_the_approximations():
    identity = jaxbundle.bpda(to_grid)
    doubled = jaxbundle.bpda(to_grid, lambda x: 2 * x)
    np.testing.assert_array_equal(identity(X), to_grid(X))  # exactly, not approximately
    np.testing.assert_array_equal(doubled(X), to_grid(X))
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(W * to_grid(x)))(X), 0 * W)
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(W * identity(x)))(X), W)
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(W * doubled(x)))(X), 2 * W)
    # The approximation is differentiated at x, not at preprocess(x): d(x^2)/dx = 2x.
    squared = jaxbundle.bpda(to_grid, lambda x: x**2)
    np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(W * squared(x)))(X), 2 * X * W)


def test_a_defended_model_is_the_same_forward_either_way_and_declares_its_choice():
    params, x, _ = linear_problem(n=4, d=7, k=3)
    x = jnp.asarray(x)
    naive = jaxbundle.defended(linear_apply, to_grid)
    with_bpda = jaxbundle.with_bpda(naive)
    assert (naive.bpda, with_bpda.bpda) == (False, True)
    assert jaxbundle.with_bpda(with_bpda, False) == naive  # equal values: one compilation
    np.testing.assert_array_equal(naive(params, x), with_bpda(params, x))
    np.testing.assert_array_equal(naive(params, x), linear_apply(params, to_grid(x)))
    loss = lambda m: lambda v: jnp.sum(m(params, v)[:, 0])  # noqa: E731
    np.testing.assert_array_equal(jax.grad(loss(naive))(x), 0 * x)
    np.testing.assert_allclose(jax.grad(loss(with_bpda))(x),
                               jnp.broadcast_to(params["w"][:, 0], x.shape), rtol=1e-6)
    with pytest.raises(ValueError, match="declares none"):
        jaxbundle.with_bpda(linear_apply)
    with pytest.raises(TypeError, match="preprocess"):
        jaxbundle.defended(linear_apply, 3)


def test_eot_averages_bpda_gradients_of_a_random_preprocessing():
    """preprocess(x, key) = to_grid(x + noise), approx(x, key) = s x with s ~ U(0, 2) from the
    key: each sample's gradient of the first logit is s w_0, so the EOT mean over S samples is
    mean(s) w_0, whose expectation is w_0 (std of mean(s): 1 / sqrt(3 S)). The forward pass is
    the preprocessing's: the logits are those of the rounded noisy images."""
    params, x, _ = linear_problem(n=8, d=6, k=3)
    x = jnp.asarray(x)

    def preprocess(v, key):
        return to_grid(v + 0.1 * jax.random.normal(jax.random.fold_in(key, 1), v.shape))

    def approx(v, key):
        return jax.random.uniform(key, (), minval=0.0, maxval=2.0) * v

    model = jaxbundle.stochastic(jaxbundle.defended(linear_apply, preprocess, approx, bpda=True))
    keys = jax.random.split(jax.random.key(4), 8)
    w0 = np.broadcast_to(np.asarray(params["w"][:, 0]), x.shape)
    first = lambda z: z[:, 0]  # noqa: E731
    def grad_of(m):  # one program per model (eagerly: every op of the EOT vmap compiled alone)
        return jax.jit(lambda v: m.loss_and_grad(first, v)[1])(x)

    for samples, tolerance in ((1, None), (2048, 5 / np.sqrt(3 * 2048))):
        grad = grad_of(WhiteBoxModel(model, params, None, keys, samples))
        scale = np.asarray(grad)[:, 0] / w0[:, 0]  # mean(s) per example
        np.testing.assert_allclose(np.asarray(grad), scale[:, None] * w0, rtol=1e-5)
        if tolerance is None:  # one draw of s per example: spread over (0, 2)
            assert np.all((scale > 0) & (scale < 2)) and np.std(scale) > 0.2
        else:
            np.testing.assert_allclose(scale, 1.0, atol=tolerance)
    naive = jaxbundle.stochastic(jaxbundle.defended(linear_apply, preprocess, approx))
    np.testing.assert_array_equal(np.asarray(grad_of(WhiteBoxModel(naive, params, None, keys, 4))),
                                  0)
    assert jaxbundle.with_bpda(naive) == model  # a stochastic model's declaration, switched


def test_the_demo_preprocessing_dct_and_jpeg():
    d = dct_matrix()
    np.testing.assert_allclose(d @ d.T, np.eye(8), atol=1e-6)  # orthonormal
    flat = jnp.full((1, 8, 8, 1), 0.5)
    # jitted: eagerly, every operation of the DCT and the rounding would compile on its own
    np.testing.assert_allclose(jax.jit(jpeg, static_argnums=1)(flat, 50), flat,
                               atol=1 / 255)  # a flat block survives
    x = jax.random.uniform(jax.random.key(0), (2, 28, 28, 1))
    out, grad = jax.jit(lambda v: (squeeze(v), jax.grad(lambda u: jnp.sum(squeeze(u)))(v)))(x)
    assert out.shape == x.shape and float(out.min()) >= 0 and float(out.max()) <= 1
    np.testing.assert_array_equal(grad, 0)


def _toy_defence():
    """The demo's preprocessing (2 bits, JPEG at quality 90) in front of a linear classifier on
    8x8 images, labels the defended model's own clean predictions (all correct)."""
    params, x, _ = linear_problem(n=32, d=64, k=4, spread=0.5, seed=1)
    x = np.asarray(images(x, (8, 8, 1)))
    naive = models.quantized(linear_apply)
    y = np.asarray(jnp.argmax(jax.jit(naive)(params, jnp.asarray(x)), -1)).astype(np.int32)
    return naive, params, x, y


def _evaluate(model, params, x, y):
    plan = jaxbundle.Plan.of(eps=0.1, attacks=(jaxbundle.AttackSpec("apgd-ce", steps=10),
                                            jaxbundle.AttackSpec("square", queries=100)),
                          batch_size=32, goals=("misclassify",))  # the one goal the test reads
    return jaxbundle.evaluate(model, params, (x, y), plan, mesh=None)


def _failed(ev) -> set[str]:
    return {k for k, c in ev.metrics["checks"].items() if not c["passed"]}


def test_bpda_breaks_the_demo_preprocessing_that_naive_gradients_cannot():
    """Straight through the preprocessing APGD sees zero gradients: only its random start
    fools a few examples; with BPDA it fools nearly all, in agreement with Square. Every
    success either way is misclassified by the true defended model; the checks that fire
    without BPDA (the preprocessing's zero gradient, zero_gradients, black_box_beats_white_box,
    silent) pass with it."""
    naive, params, x, y = _toy_defence()
    results = {}
    for name, model in (("naive", naive), ("bpda", jaxbundle.with_bpda(naive))):
        ev = results[name] = _evaluate(model, params, x, y)
        m, pe = ev.metrics, ev.per_example
        assert m["clean_accuracy"] == 100.0
        adv = jnp.asarray(np.asarray(pe["x_adv"], np.float32) / 255)
        # the true forward pass (jitted: eagerly, each operation of the JPEG would compile)
        wrong = np.asarray(jnp.argmax(jax.jit(naive)(params, adv), -1)) != y
        np.testing.assert_array_equal(np.asarray(pe["success"], bool), wrong)
    naive_m, bpda_m = results["naive"].metrics, results["bpda"].metrics
    assert naive_m["mat"]["apgd-ce"] >= 80.0  # blind (measured: 87.5)
    assert bpda_m["mat"]["apgd-ce"] <= 15.0  # the same attack with BPDA (measured: 3.1)
    assert abs(bpda_m["mat"]["apgd-ce"] - bpda_m["mat"]["square"]) <= 10.0  # Square: 6.2
    assert naive_m["mat"]["square"] == bpda_m["mat"]["square"]  # black box: BPDA is no matter
    fired = _failed(results["naive"])
    assert {"preprocessing", "zero_gradients", "black_box_beats_white_box", "silent"} <= fired
    assert _failed(results["bpda"]) == set()
    saw = bpda_m["checks"]["preprocessing"]["saw"]
    assert saw.startswith("BPDA") and "identity" in saw
    assert "--bpda" in naive_m["checks"]["preprocessing"]["advice"]
    assert "--bpda" in naive_m["checks"]["zero_gradients"]["advice"]
    assert "preprocessing" not in checks.model_checks(linear_apply, params, x[:2])


@pytest.mark.slow
def test_the_cli_demo_defence_with_and_without_bpda(tmp_path):
    """``--models quantized``: the adversarial demo CNN (trained small) behind the demo
    preprocessing, 32 images; ``--bpda`` brings the white-box figure from near the clean
    accuracy to 50 points below it or more. (APGD alone: that BPDA's figure agrees with
    Square's, which needs no gradient, is the API test's above.)"""
    from jaxbundle.cli import main

    figures = {}
    for flag in ([], ["--bpda"]):
        out = tmp_path / ("bpda" if flag else "naive")
        assert main(["evaluate", "--models", "quantized", "--n", "32", "--attacks",
                     "apgd-ce", "--steps", "20", "--no-shifts",
                     "--no-progress", "--train-examples", str(QUICK_TRAINING["n_train"]),
                     "--train-epochs", str(QUICK_TRAINING["epochs"]), "--out", str(out),
                     *flag]) == 0
        m = json.loads((out / "report.json").read_text())["models"]["quantized"]
        figures[bool(flag)] = m
    naive, bpda = figures[False], figures[True]
    assert naive["white_box_robust_accuracy"] >= naive["clean_accuracy"] - 10
    assert bpda["white_box_robust_accuracy"] <= naive["white_box_robust_accuracy"] - 50
    assert not naive["checks"]["preprocessing"]["passed"]
    assert bpda["checks"]["preprocessing"]["passed"]
    assert bpda["plan"] == naive["plan"]  # BPDA is the model's, not the plan's
