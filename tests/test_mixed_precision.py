"""Models that compute in bfloat16 or float16: judged on exactly the logits they return.

The risk is near ties. A narrow float has few values (bfloat16: 8 significant bits, one unit in
the last place is 1/32 at logits of 4-8), so two classes tie exactly, or nearly, far more often
than in float32, and XLA may compute a narrow model's logits otherwise where its program is fused
with other work: an attack's gradient let it drop the final round trip through bfloat16, leaving
logits up to half a unit wider than the user's own call returns (measured: 2 of 512 reported
adversarial examples of a bfloat16 CNN were not misclassified when re-run).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jaxbundle
from jaxbundle import arithmetic, losses, sampling, validation
from jaxbundle.attacks.base import WhiteBoxModel
from jaxbundle.data.sample import load_mnist_sample


class NarrowMLP(nn.Module):
    """A 2-layer MLP computing in ``dtype`` (parameters float32, as flax keeps them)."""

    dtype: object = jnp.bfloat16
    hidden: int = 32

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1).astype(self.dtype)
        x = nn.relu(nn.Dense(self.hidden, dtype=self.dtype)(x))
        return nn.Dense(10, dtype=self.dtype)(x)


def _random_params(net, shape, scale=3.0):
    """Weights and biases all non-zero (zero biases hide the effect: measured)."""
    leaves, tree = jax.tree.flatten(net.init(jax.random.key(0), jnp.zeros((1, *shape))))
    return tree.unflatten([scale * (a + 0.1 * jax.random.normal(jax.random.key(i), a.shape))
                           for i, a in enumerate(leaves)])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_logits_are_the_models_own_where_gradients_share_the_program(dtype):
    net = NarrowMLP(dtype=dtype)
    params = _random_params(net, (8, 8, 1))
    x = jax.random.uniform(jax.random.key(1), (64, 8, 8, 1))
    y = jnp.arange(64) % 10
    own = np.asarray(jax.jit(net.apply)(params, x)).astype(np.float32)

    @jax.jit
    def with_gradients(params, x):
        model = WhiteBoxModel(net.apply, params)
        _, grad, seen = model.loss_and_grad(losses.cross_entropy, x, y)
        return model.logits(x), seen, grad

    judged, seen, _ = with_gradients(params, x)
    np.testing.assert_array_equal(np.asarray(judged), own)
    np.testing.assert_array_equal(np.asarray(seen), own)
    if dtype != jnp.bfloat16:
        return
    # The effect is real (in bfloat16 on XLA:CPU): widened without pinning the rounding, the
    # same program's logits differ from the model's own.
    @jax.jit
    def unpinned(params, x):
        z = net.apply(params, x).astype(jnp.float32)
        g = jax.grad(lambda v: net.apply(params, v).astype(jnp.float32).sum())(x)
        return z, g

    assert np.any(np.asarray(unpinned(params, x)[0]) != own)


@given(st.lists(st.floats(-3e4, 3e4, width=32), min_size=1, max_size=12))
def test_widening_keeps_every_value(values):
    # Padded with zeros (values too) to one shape: run eagerly, as the narrowing must really
    # happen, each operation compiles once per dtype rather than once per length.
    values = values + [0.0] * (12 - len(values))
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        z = jnp.asarray(values, jnp.float32).astype(dtype)
        wide = sampling.float32_logits(z)
        assert wide.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(wide), np.asarray(z.astype(jnp.float32)))


def _tied(params, x):
    """Two classes whose bfloat16 logits tie exactly on every image: the mean pixel scaled,
    the second class the first plus a hair bfloat16 cannot hold."""
    s = (params * jnp.mean(x.reshape(x.shape[0], -1), axis=1)).astype(jnp.bfloat16)
    return jnp.stack([s, (s.astype(jnp.float32) + 1e-4).astype(jnp.bfloat16)], axis=1)


def test_exact_ties_are_decided_as_the_models_own_argmax_decides_them():
    # Class 0 wins every tie (the lowest index, as jnp.argmax and torch.argmax break them) and
    # no perturbation can break it: a label-0 example is robust, a label-1 one never correct.
    x = np.asarray(jax.random.uniform(jax.random.key(2), (32, 6, 6, 1)) * 0.8 + 0.1, np.float32)
    y = np.arange(32) % 2
    params = jnp.float32(5.0)
    z = np.asarray(_tied(params, jnp.asarray(x))).astype(np.float32)
    assert np.all(z[:, 0] == z[:, 1])
    plan = jaxbundle.Plan.of(attacks=("apgd-ce",), eps=0.1, norm="linf", steps=5, batch_size=32,
                          judging="float")
    out = jaxbundle.evaluate(_tied, params, (x, y), plan, mesh=None)
    assert out.metrics["clean_accuracy"] == 50.0
    assert out.metrics["robust_accuracy"] == 50.0
    np.testing.assert_array_equal(out.per_example["clean_prediction"], 0)
    np.testing.assert_array_equal(out.per_example["success"], y == 1)
    assert out.metrics["model_dtype"]["logits"] == "bfloat16"


def _trained_bfloat16_mlp(x, y, steps=150):
    net = NarrowMLP()
    params = net.init(jax.random.key(0), jnp.zeros((1, *x.shape[1:])))
    opt = optax.adam(3e-3)

    def step(carry, batch):
        params, state = carry
        xb, yb = batch
        grad = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
            net.apply(p, xb).astype(jnp.float32), yb).mean())(params)
        updates, state = opt.update(grad, state, params)
        return (optax.apply_updates(params, updates), state), None

    rows = np.random.default_rng(0).integers(0, len(y), (steps, 64))
    (params, _), _ = jax.jit(lambda c, b: jax.lax.scan(step, c, b))(
        (params, opt.init(params)), (x[rows], y[rows]))
    return net.apply, params


def test_a_bfloat16_model_reports_only_what_its_own_calls_confirm():
    train, test = load_mnist_sample("train", 2000), load_mnist_sample("test", 96)
    apply_fn, params = _trained_bfloat16_mlp(train.x, train.y)
    # APGD alone: the risk is the judge's logits in a program that also takes gradients (a
    # black-box attack adds no such program; every candidate is judged the same way).
    plan = jaxbundle.Plan.of(attacks=("apgd-ce",), eps=0.1, norm="linf", steps=20, batch_size=96)
    out = jaxbundle.evaluate(apply_fn, params, (test.x, test.y), plan, mesh=None)
    pe, m = out.per_example, out.metrics
    assert m["model_dtype"]["logits"] == "bfloat16"
    assert m["model_dtype"]["compute"] == ["bfloat16"]
    assert m["model_dtype"]["params"] == ["float32"]
    assert "bfloat16" in m["model_dtype"]["statement"]
    x_adv = pe["x_adv"].astype(np.float32) / (255.0 if pe["x_adv"].dtype == np.uint8 else 1.0)
    for calls in (jax.jit(apply_fn)(params, x_adv),  # the whole batch, and each image alone
                  np.concatenate([apply_fn(params, x_adv[i:i + 1]) for i in range(len(x_adv))])):
        wrong = np.asarray(calls).astype(np.float32).argmax(-1) != test.y
        np.testing.assert_array_equal(wrong, pe["success"])
    correct = pe["clean_prediction"] == test.y
    assert 50 < correct.sum() and 0 < (pe["success"] & correct).sum() < correct.sum()


def test_the_report_states_a_float32_models_precision():
    d = validation.model_dtypes(lambda p, x: x.reshape(x.shape[0], -1) @ p, jnp.ones((4, 3)),
                                (2, 2, 2, 1))
    assert d == {"logits": "float32", "params": ["float32"], "compute": ["float32"],
                 "precision": [],
                 "statement": "model computes in float32 (params float32), logits float32; "
                              + arithmetic.STATEMENT}
    fixed = validation.model_dtypes(
        lambda p, x: jnp.dot(x.reshape(x.shape[0], -1), p, precision=jax.lax.Precision.DEFAULT),
        jnp.ones((4, 3)), (2, 2, 2, 1))
    assert fixed["precision"] == ["DEFAULT"]
    assert fixed["statement"].endswith("(the model's own precision, DEFAULT, where it sets one)")


def test_verdicts_run_at_highest_and_the_search_at_high_unless_a_precision_is_set():
    """The judge's logits at HIGHEST (what certificates are about), the attacks' at HIGH
    (TF32 on GPUs, three bfloat16 passes on TPUs); a precision the user sets for JAX is kept
    for the search, never for a verdict."""
    from jaxbundle import judge

    model = WhiteBoxModel(lambda p, x: x.reshape(x.shape[0], -1) @ p, jnp.ones((4, 3)))
    x, y = jnp.ones((2, 2, 2, 1)), jnp.zeros(2, jnp.int32)

    def precisions(fn):
        return {e.params["precision"] for e in validation._matmuls(jax.make_jaxpr(fn)(x).jaxpr)}

    high, highest = ((p, p) for p in (jax.lax.Precision.HIGH, jax.lax.Precision.HIGHEST))
    verdict = lambda v: judge.judged_score(model, v, v, y, "linf")[0].margin  # noqa: E731
    search = lambda v: model.loss_and_grad(losses.cross_entropy, v, y)  # noqa: E731
    assert precisions(model.logits) == precisions(search) == {high}
    assert precisions(verdict) == {highest}
    with jax.default_matmul_precision("bfloat16"):
        assert precisions(model.logits) == {(jax.lax.Precision.DEFAULT,) * 2}
        assert precisions(verdict) == {highest}
