"""Verified (IBP) training of the demo models: it buys certified robustness that natural training
on the same budget does not, its schedules, and its configs in the weight cache."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import data, models
from jaxbundle.certify.bounds import margin_bounds
from jaxbundle.models import certified, training
from jaxbundle.models.layers import conv_same

TRAIN_EPS = 0.1
CERTIFY_EPS = 0.05
# A few seconds of training: 2,000 images, 4 epochs of 40 batches; so short a ramp needs the
# natural loss at first (kappa 1 -> 0.5).
BUDGET = dict(n_train=2000, epochs=4, batch_size=50, learning_rate=2e-3, eps=TRAIN_EPS,
              eps_warmup=0.5, kappa_start=1.0, kappa_end=0.5)
TINY_VERIFIED = models.CERTIFIED._replace(**BUDGET)
TINY_STANDARD = models.STANDARD._replace(**BUDGET)


def _certified_accuracy(config, eps):
    test = data.load_mnist_sample("test", n=200)
    bounds = margin_bounds(models.model_for(config).apply, models.train(config),
                           jnp.asarray(test.x), jnp.asarray(test.y), eps=eps, method="ibp")
    return float(np.mean(np.asarray(bounds).min(axis=-1) > 0))


@pytest.mark.slow  # end to end: two trainings and their certification, mostly compilation
def test_verified_training_certifies_what_natural_training_does_not():
    verified = _certified_accuracy(TINY_VERIFIED, CERTIFY_EPS)
    natural = _certified_accuracy(TINY_STANDARD, CERTIFY_EPS)
    assert verified >= 0.4 and verified >= natural + 0.3, (verified, natural)


def test_schedule_ramps_eps_kappa_and_beta_together():
    start = certified.schedule(0.0, 0.0, kappa_start=1.0, kappa_end=0.5)
    middle = certified.schedule(0.2, 0.5, kappa_start=1.0, kappa_end=0.5)
    end = certified.schedule(0.4, 1.0, kappa_start=1.0, kappa_end=0.5)
    assert start == (0.0, 1.0, 1.0)
    assert middle == pytest.approx((0.2, 0.75, 0.5))
    assert end == (0.4, 0.5, 0.0)


def test_worst_case_logits_bound_the_logits_over_the_ball():
    """For a linear model IBP is exact: the worst-case logits are the margins' minima."""
    def apply_fn(p, x):
        return x.reshape(x.shape[0], -1) @ p["w"]

    key_w, key_x = jax.random.split(jax.random.key(0))
    params = {"w": jax.random.normal(key_w, (4, 3))}
    x = jax.random.uniform(key_x, (5, 2, 2, 1), minval=0.2, maxval=0.8)
    y = jnp.array([0, 1, 2, 0, 1])
    worst = certified.worst_case_logits(apply_fn, params, x, y, 0.1, 0.0, method="ibp")
    w = params["w"]
    exact = x.reshape(5, -1) @ w
    diff = w[:, y].T[:, :, None] - w[None]  # [B, 4, K]: w_y - w_j
    lowest = exact[jnp.arange(5), y][:, None] - exact - 0.1 * jnp.abs(diff).sum(axis=1)
    np.testing.assert_allclose(worst, jnp.where(jax.nn.one_hot(y, 3) > 0, 0.0, -lowest),
                               atol=1e-3)


def test_crown_ibp_tightens_the_ibp_bound_as_beta_grows():
    module = models.MLP(num_classes=3, hidden=(8, 8))
    x = jax.random.uniform(jax.random.key(1), (4, 3, 3, 1))
    params = module.init(jax.random.key(2), x)
    y = jnp.array([0, 1, 2, 0])

    def worst(beta, method="crown-ibp"):
        return certified.worst_case_logits(module.apply, params, x, y, 0.2, jnp.float32(beta),
                                           method=method)

    ibp, full = worst(0.0, "ibp"), worst(1.0)
    np.testing.assert_allclose(worst(0.0), ibp, rtol=1e-6)
    assert np.all(full <= ibp + 1e-6) and np.any(full < ibp - 1e-3)
    np.testing.assert_allclose(worst(0.5), 0.5 * (full + ibp), rtol=1e-5, atol=1e-6)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="certified must be one of"):
        models.train(TINY_VERIFIED._replace(certified="lp", epochs=0))
    with pytest.raises(ValueError, match="not both"):
        models.train(TINY_VERIFIED._replace(adversarial=True, epochs=0))


def test_verified_configs_round_trip_through_the_cache(tmp_path, monkeypatch):
    config = TINY_VERIFIED._replace(n_train=100, epochs=1)
    keys = {models.config_hash(c) for c in (
        config, config._replace(certified=None), config._replace(certified="crown-ibp"),
        config._replace(kappa_end=0.25))}
    assert len(keys) == 4
    _, params = models.load_or_train(config, cache_dir=tmp_path)
    meta = json.loads(models.cache_path(config, tmp_path).with_suffix(".json").read_text())
    assert models.TrainConfig(**meta["config"]) == config
    monkeypatch.setattr("jaxbundle.models.cache.train", lambda *a, **k: pytest.fail("retrained"))
    _, again = models.load_or_train(config, cache_dir=tmp_path)
    jax.tree.map(np.testing.assert_array_equal, params, again)


BN_CONFIG = models.CERTIFIED._replace(n_train=200, epochs=1, batch_size=50, eps=TRAIN_EPS)


def test_batch_norm_keeps_the_training_images_statistics():
    """The stored statistics of the first BatchNorm are the mean and variance of the first
    convolution's outputs over every training image and position, under the final weights."""
    assert BN_CONFIG.arch == "small_cnn_bn"
    train = data.load_mnist_sample("train", n=BN_CONFIG.n_train)
    variables = models.train(BN_CONFIG, train)
    conv = variables["params"]["conv1"]
    out = conv_same(jnp.asarray(train.x), conv["kernel"], 2) + conv["bias"][None, None, None]
    stored = variables["batch_stats"]["norm1"]
    np.testing.assert_allclose(stored["mean"], out.mean(axis=(0, 1, 2)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stored["var"], out.var(axis=(0, 1, 2)), rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(variables["batch_stats"]["norm3"]["var"]) > 0)


def test_the_loss_sees_what_training_mode_computes():
    """Inference mode on a batch's own statistics (what the verified loss bounds) gives the
    logits of a training-mode pass on that batch, not those of the stored statistics."""
    module = models.model_for(BN_CONFIG)
    x = jnp.asarray(data.load_mnist_sample("train", n=16).x)
    variables = module.init(jax.random.key(0), x)
    variables = {**variables, "params": certified.ibp_initialization(variables["params"],
                                                                      jax.random.key(1))}
    state = {"batch_stats": variables["batch_stats"]}
    trained, _ = module.apply(variables, x, train=True, mutable=["batch_stats"])
    batch = training._batch_variables(module, variables["params"], state, x)
    np.testing.assert_allclose(module.apply(batch, x), trained, rtol=1e-5, atol=1e-5)
    assert not np.allclose(module.apply(variables, x), trained, atol=1e-3)
