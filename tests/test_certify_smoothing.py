"""Randomised smoothing (Cohen et al. 2019): the Clopper-Pearson bound, the radius, CERTIFY on
a linear base classifier whose smoothed probabilities are known exactly, sampling independent
of batches, and the smoothed model inside the library's stochastic machinery."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import binom, norm

from jaxbundle import sampling
from jaxbundle.certify import smoothing
from toys import images, linear_apply, linear_problem, min_distance

KEY = jax.random.key(7)


def halfplane(params, x):
    """A 2-D linear base classifier: logits ``(0, w . x + b)``, class 1 where positive."""
    score = x.reshape(x.shape[0], -1) @ params["w"] + params["b"]
    return jnp.stack([jnp.zeros_like(score), score], axis=-1)


def halfplane_problem(distances):
    """Points at signed distances from the line ``w . x + b = 0`` (positive: class 1)."""
    w = np.array([0.6, -0.8], np.float32)  # unit norm
    b = np.float32(0.1)
    base = -b * w  # on the line
    along = np.array([0.8, 0.6], np.float32)
    x = np.stack([base + d * w + 0.3 * i * along for i, d in enumerate(distances)])
    return {"w": jnp.asarray(w), "b": jnp.asarray(b)}, jnp.asarray(x, jnp.float32)


# --- the bound and the radius -----------------------------------------------------------------


@pytest.mark.parametrize("count,n,alpha", [(1, 10, 0.05), (7, 10, 0.001), (990, 1000, 0.001),
                                           (51234, 100_000, 0.001), (3, 3, 0.01)])
def test_lower_bound_is_the_clopper_pearson_bound(count, n, alpha):
    """``P(Binom(n, p_lower) >= count) = alpha``: at ``p_lower`` the count seen is as unlikely
    as alpha allows, and any smaller p makes it less likely."""
    p = float(smoothing.lower_confidence_bound(count, n, alpha))
    assert 0 < p < count / n or (count == n and p < 1)
    assert binom.sf(count - 1, n, p) == pytest.approx(alpha, rel=1e-6)
    assert binom.sf(count - 1, n, p * (1 - 1e-3)) < alpha
    if count == n:  # closed form: p^n = alpha
        assert p == pytest.approx(alpha ** (1 / n), rel=1e-9)


@given(n=st.integers(1, 10**6), share=st.floats(0, 1), alpha=st.floats(1e-6, 0.5))
def test_lower_bound_leaves_probability_alpha_to_the_count_seen(n, share, alpha):
    count = int(round(share * n))
    p = float(smoothing.lower_confidence_bound(count, n, alpha))
    if count == 0:
        assert p == 0.0
    else:
        assert 0 < p <= count / n
        assert binom.sf(count - 1, n, p) == pytest.approx(alpha, rel=1e-4)


def test_no_successes_bound_zero_and_arrays_work():
    got = smoothing.lower_confidence_bound(np.array([0, 5, 10]), 10, 0.01)
    assert got[0] == 0.0 and 0 < got[1] < got[2] < 1


def test_radius_is_sigma_times_the_normal_quantile_and_zero_when_abstaining():
    p = np.array([0.3, 0.5, 0.5000001, 0.8, 0.999])
    radius = smoothing.certified_radius(p, 0.25)
    np.testing.assert_allclose(radius[2:], 0.25 * norm.ppf(p[2:]))
    assert radius[0] == radius[1] == 0.0 and radius[2] > 0


# --- CERTIFY against the exact smoothed classifier ---------------------------------------------


def test_linear_base_certified_radius_is_below_and_close_to_the_distance():
    """For a half-plane the smoothed top class's probability is ``Phi(distance / sigma)`` and
    the exact certified radius is the distance itself: CERTIFY's radius is below it and, with
    n = 100,000, within what the confidence bound costs."""
    sigma, n, alpha = 0.5, 100_000, 0.001
    distances = np.array([0.05, 0.2, -0.3, 0.6, -0.9])
    params, x = halfplane_problem(distances)
    cert = smoothing.certify(smoothing.gaussian(halfplane, sigma), params, x, key=KEY, n=n,
                             alpha=alpha, batch=50_000)
    np.testing.assert_array_equal(cert.prediction, (distances > 0).astype(int))
    p_true = norm.cdf(np.abs(distances) / sigma)
    assert np.all(cert.radius <= np.abs(distances))
    # p_lower sits a few standard errors below the true p (z ~ 3.1 for alpha = 0.001)
    worst = p_true - 5 * np.sqrt(p_true * (1 - p_true) / n)
    assert np.all(cert.radius >= sigma * norm.ppf(worst))
    assert np.all(np.abs(cert.radius - np.abs(distances)) < 0.02)
    np.testing.assert_allclose(cert.p_lower,
                               smoothing.lower_confidence_bound(cert.counts, n, alpha))
    assert np.all(np.abs(cert.counts / n - p_true) < 5 * np.sqrt(p_true * (1 - p_true) / n))


def test_abstains_on_the_decision_boundary_and_without_a_majority():
    params, x = halfplane_problem(np.zeros(4))  # pA = 1/2 exactly
    cert = smoothing.certify(smoothing.gaussian(halfplane, 0.3), params, x, key=KEY, n=2_000)
    np.testing.assert_array_equal(cert.prediction, -1)
    np.testing.assert_array_equal(cert.radius, 0.0)
    assert np.all(cert.p_lower <= 0.5) and np.all(np.isin(cert.selected, [0, 1]))

    def three_way(params, x):  # class 0 below -a, 2 above a, 1 between: a third each
        t = x.reshape(x.shape[0], -1)[:, 0]
        return jnp.stack([-t - params, jnp.zeros_like(t), t - params], axis=-1)

    cert = smoothing.certify(smoothing.gaussian(three_way, 1.0), norm.ppf(2 / 3),
                             jnp.zeros((2, 2), jnp.float32), key=KEY, n=2_000)
    np.testing.assert_array_equal(cert.prediction, -1)


# --- sampling ---------------------------------------------------------------------------------


def test_counts_do_not_depend_on_the_batch_or_the_grouping_of_examples():
    params, x = halfplane_problem(np.array([0.02, -0.05, 0.1, 0.0, -0.01]))
    model = smoothing.gaussian(halfplane, 0.4)
    whole = smoothing.certify(model, params, x, key=KEY, n0=30, n=500, batch=1000)
    for batch in (7, 64):  # small chunks splitting examples' samples, against chunks of 1000
        again = smoothing.certify(model, params, x, key=KEY, n0=30, n=500, batch=batch)
        for a, b in zip(whole, again):
            np.testing.assert_array_equal(a, b)
    parts = [smoothing.certify(model, params, x[i:j], key=KEY, n0=30, n=500, batch=64,
                               example_id=np.arange(i, j)) for i, j in ((0, 2), (2, 5))]
    for field, got in zip(whole, zip(*parts)):
        np.testing.assert_array_equal(field, np.concatenate(got))
    other = smoothing.certify(model, params, x, key=jax.random.key(8), n0=30, n=500)
    assert not np.array_equal(other.counts, whole.counts)


def test_samples_are_the_smoothed_models_own_calls_under_the_documented_keys():
    """Sample ``s`` of example ``i`` in stream ``t`` is exactly the smoothed model's call on
    that example under ``fold_in(sample_keys(key, ids, t)[i], s)``."""
    params, x = halfplane_problem(np.array([0.01, -0.02, 0.03]))
    model = smoothing.gaussian(halfplane, 0.5)
    n0, n = 6, 9
    cert = smoothing.certify(model, params, x, key=KEY, n0=n0, n=n, batch=4,
                             example_id=np.array([5, 2, 9]))
    ids = jnp.array([5, 2, 9])
    for stream, samples in ((smoothing.SELECTION_STREAM, n0), (smoothing.ESTIMATION_STREAM, n)):
        keys = smoothing.sample_keys(KEY, ids, stream)
        votes = np.zeros((3, 2), int)
        for i in range(3):
            for s in range(samples):
                logits = model(params, x[i:i + 1], jax.random.fold_in(keys[i], s))
                votes[i, int(jnp.argmax(logits[0]))] += 1
        if stream == smoothing.SELECTION_STREAM:
            np.testing.assert_array_equal(cert.selected, np.argmax(votes, axis=1))
        else:
            np.testing.assert_array_equal(cert.counts, votes[np.arange(3), cert.selected])


# --- the smoothed model ------------------------------------------------------------------------


def test_gaussian_builds_a_hashable_stochastic_model_with_unclipped_noise():
    model = smoothing.gaussian(halfplane, 0.25, calls=8, threshold=0.25)
    assert sampling.is_stochastic(model) and (model.calls, model.threshold) == (8, 0.25)
    noise = model.apply_fn
    assert (noise.base, noise.sigma) == (halfplane, 0.25)
    assert hash(noise) == hash(smoothing.gaussian(halfplane, 0.25).apply_fn)
    assert noise == smoothing.gaussian(halfplane, 0.25).apply_fn
    with pytest.raises(dataclasses.FrozenInstanceError):
        noise.sigma = 1.0
    assert smoothing.smoothing_sigma(model) == 0.25 == smoothing.smoothing_sigma(noise)
    assert smoothing.smoothing_sigma(sampling.stochastic(lambda p, v, k: v)) is None
    assert smoothing.smoothing_sigma(linear_apply) is None
    drawn = np.asarray(noise.noisy(jnp.zeros((4000, 2)), KEY))
    assert drawn.min() < -0.5 and drawn.max() > 0.5  # not clipped to [0, 1]
    assert abs(drawn.std() - 0.25) < 0.01 and abs(drawn.mean()) < 0.01
    # one example with or without its batch axis gets the same noise from the same key
    one = jnp.full((3, 2), 0.5)
    np.testing.assert_array_equal(noise.noisy(one[None], KEY)[0], noise.noisy(one, KEY))


@pytest.mark.parametrize("sigma", [0.0, -0.1, float("nan"), float("inf"), True])
def test_gaussian_refuses_a_bad_sigma(sigma):
    with pytest.raises(ValueError, match="sigma must be a positive finite number"):
        smoothing.gaussian(halfplane, sigma)


def test_gaussian_refuses_a_stochastic_base():
    with pytest.raises(ValueError, match="deterministic base classifier"):
        smoothing.gaussian(smoothing.gaussian(halfplane, 0.1), 0.1)
    with pytest.raises(ValueError, match="callable"):
        smoothing.gaussian(3, 0.1)


def test_certify_validates_its_arguments():
    params, x = halfplane_problem(np.array([0.1, 0.2]))
    model = smoothing.gaussian(halfplane, 0.1)
    with pytest.raises(ValueError, match="needs a smoothed model"):
        smoothing.certify(sampling.stochastic(lambda p, v, k: halfplane(p, v)), params, x,
                          key=KEY)
    for bad, match in ((dict(n0=0), "n0"), (dict(n=2.5), "n must"), (dict(batch=-1), "batch"),
                       (dict(alpha=1.0), "alpha"), (dict(alpha=0), "alpha"),
                       (dict(example_id=np.arange(3)), "example_id"),
                       (dict(example_id=np.array([0.0, 1.0])), "example_id")):
        with pytest.raises(ValueError, match=match):
            smoothing.certify(model, params, x, key=KEY, **bad)
    with pytest.raises(ValueError, match="float images"):
        smoothing.certify(model, params, x.astype(jnp.int32), key=KEY)
    empty = smoothing.certify(model, params, x[:0], key=KEY)
    assert all(len(field) == 0 for field in empty)


def test_certified_accuracy_counts_right_predictions_with_radius_at_least_eps():
    cert = smoothing.Certificate(prediction=np.array([1, 0, -1, 2]),
                                 radius=np.array([0.5, 0.2, 0.0, 0.9]),
                                 p_lower=np.array([0.9, 0.7, 0.4, 0.99]),
                                 counts=np.array([90, 70, 40, 99]),
                                 selected=np.array([1, 0, 1, 2]))
    y = np.array([1, 0, 1, 1])
    assert smoothing.certified_accuracy(cert, y, 0.0) == 0.5
    assert smoothing.certified_accuracy(cert, y, 0.2) == 0.5
    assert smoothing.certified_accuracy(cert, y, 0.3) == 0.25
    assert smoothing.certified_accuracy(cert, y, 1.0) == 0.0
    with pytest.raises(ValueError, match="labels"):
        smoothing.certified_accuracy(cert, y[:2], 0.1)
    with pytest.raises(ValueError, match="eps"):
        smoothing.certified_accuracy(cert, y, -0.1)


def test_a_smoothed_model_is_evaluated_with_eot_end_to_end():
    """The library's attacks with EOT and its judge run on the smoothed model unchanged."""
    from jaxbundle import Plan, evaluate
    from jaxbundle.attacks import pgd

    params, x, y = linear_problem(n=8, k=3, seed=4)
    eps = float(np.quantile(min_distance(params, x, y, "linf"), 0.5))
    model = smoothing.gaussian(linear_apply, 0.02, calls=4)
    plan = Plan.of(eps=eps, attacks=(pgd(steps=3),), eot=2, goals=("misclassify",))
    ev = evaluate(model, params, (np.asarray(images(x)), y), plan)
    s = ev.metrics["stochastic"]
    assert (s["calls"], s["eot"]) == (4, {"pgd-ce": 2})
    assert ev.metrics["checks"]["randomness"]["passed"]
    assert np.all(ev.per_example["gradients"][ev.per_example["clean_success_rate"] <= 0.5]
                  == 3 * 2)
    assert 0 < np.mean(ev.per_example["success"]) <= 1
