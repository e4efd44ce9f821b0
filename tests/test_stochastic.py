"""Stochastic models: EOT as a vmap axis, per-example keys, judging over many calls and the
bundle's best-on-average rule."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import binom
from scipy.stats import norm as gaussian

import jaxbundle
from jaxbundle import attacks as attacks_lib
from jaxbundle import goals as goals_lib
from jaxbundle import sampling
from jaxbundle import suites
from jaxbundle.attacks.base import Attack, Candidate, LabelOracle, ScoreOracle, WhiteBoxModel
from jaxbundle.bundler import bundle, goals_for
from jaxbundle.schedule import Batch, Model, cascade
from toys import dot_flops, images, linear_apply, linear_problem, min_distance

KEY = jax.random.key(3)
SIGMA = 0.05


def noisy_linear(params, x, key):
    """The toy linear model behind additive Gaussian input noise of std SIGMA."""
    return linear_apply(params, x + SIGMA * jax.random.normal(key, x.shape))


def _keys(n, seed=0):
    return jax.random.split(jax.random.key(seed), n)


# --- declaring a stochastic model ----------------------------------------------------------


def test_declaration_is_validated():
    model = jaxbundle.stochastic(noisy_linear, calls=8, threshold=0.25)
    assert sampling.is_stochastic(model) and not sampling.is_stochastic(linear_apply)
    assert (model.calls, model.threshold) == (8, 0.25)
    assert jaxbundle.stochastic(model, calls=3).apply_fn is noisy_linear  # re-declared, unwrapped
    for bad in (dict(calls=0), dict(calls=2.0), dict(threshold=1.0), dict(threshold=-0.1)):
        with pytest.raises(ValueError, match="calls|threshold"):
            jaxbundle.stochastic(noisy_linear, **bad)
    with pytest.raises(TypeError, match="callable"):
        jaxbundle.stochastic(3)
    assert [a.eot for a in jaxbundle.with_eot([attacks_lib.pgd(), attacks_lib.fgsm()], 4)] == [4, 4]
    with pytest.raises(ValueError, match="eot"):
        jaxbundle.with_eot([attacks_lib.pgd()], 0)


def test_eot_on_a_deterministic_model_is_an_error():
    params, x, y = linear_problem(n=4)
    with pytest.raises(ValueError, match="eot=4 but the model is deterministic"):
        bundle(jaxbundle.with_eot([attacks_lib.pgd(steps=2)], 4), linear_apply, params, x, y, KEY,
               eps=0.1)


def test_each_example_draws_from_its_own_key_whatever_the_batch():
    params, x, _ = linear_problem(n=6)
    model = jaxbundle.stochastic(noisy_linear)
    keys = _keys(6)
    whole = sampling.logits(model, params, jnp.asarray(x), keys)
    parts = [sampling.logits(model, params, jnp.asarray(x[i:i + 2]), keys[i:i + 2])
             for i in (0, 2, 4)]
    np.testing.assert_allclose(np.asarray(whole), np.concatenate(parts), rtol=1e-6)
    # ... and the calls differ from the clean model's and from each other.
    clean = np.asarray(linear_apply(params, jnp.asarray(x)))
    again = sampling.logits(model, params, jnp.asarray(x), _keys(6, seed=1))
    assert not np.allclose(np.asarray(whole), clean) and not np.allclose(whole, again)
    with pytest.raises(ValueError, match="needs a key per example"):
        sampling.logits(model, params, jnp.asarray(x))


# --- EOT: the averaged gradient, scores and labels -------------------------------------------


def test_eot_gradient_of_a_noisy_linear_model_converges_to_the_analytic_expectation():
    """Loss 0.5 ||z||^2 with z = W^T (x + sigma n) + b: the expected input gradient is
    W (W^T x + b), each sample's is off by sigma W W^T n, so the EOT mean over S samples is off
    by sigma W W^T n_bar with n_bar ~ N(0, I / S)."""
    params, x, _ = linear_problem(n=16, d=20, k=4)
    x = jnp.asarray(x)
    w = np.asarray(params["w"], np.float64)
    expected = (np.asarray(x, np.float64) @ w + np.asarray(params["b"])) @ w.T
    loss = lambda z: 0.5 * jnp.sum(z**2, axis=-1)  # noqa: E731
    model = jaxbundle.stochastic(noisy_linear)
    scale = SIGMA * np.linalg.norm(w @ w.T, 2)  # bound on |sigma W W^T n| per unit |n|
    errors = {}
    for samples in (1, 1024):
        m = WhiteBoxModel(model, params, None, _keys(16, seed=5), samples)
        value, grad, logits = jax.jit(lambda x_: m.loss_and_grad(loss, x_))(x)
        errors[samples] = np.linalg.norm(np.asarray(grad, np.float64) - expected, axis=1)
        assert logits.shape == (16, 4) and value.shape == (16,)
    # One sample: noisy (about sigma |W W^T n|, n ~ N(0, I_20)); 1024: 32 times closer.
    assert np.median(errors[1]) > 0.3 * scale
    assert np.all(errors[1024] < 6 * scale * np.sqrt(20 / 1024))
    assert np.median(errors[1024]) < np.median(errors[1]) / 10


def test_eot_mean_is_the_mean_of_its_samples_under_the_documented_keys():
    params, x, y = linear_problem(n=5)
    x = jnp.asarray(x)
    model = jaxbundle.stochastic(noisy_linear)
    keys = _keys(5, seed=2)
    m = WhiteBoxModel(model, params, None, keys, 3)
    ce = lambda z, y_: -jnp.take_along_axis(jax.nn.log_softmax(z), y_[:, None], 1)[:, 0]  # noqa

    def calls(x):  # in one program (eagerly, each operation would compile on its own)
        value, grad, logits = m.loss_and_grad(ce, x, jnp.asarray(y))
        second = m.logits(x)  # the second call site on the same object
        # the first call site draws split(fold_in(keys[b], 0), 3)
        per_sample = []
        for s in range(3):
            k = jax.vmap(lambda kb: jax.random.split(jax.random.fold_in(kb, 0), 3)[s])(keys)
            f = lambda x_: jnp.sum(ce(sampling.logits(model, params, x_, k), jnp.asarray(y)))  # noqa
            per_sample.append((f(x), jax.grad(f)(x), sampling.logits(model, params, x, k)))
        return value, grad, logits, second, per_sample

    value, grad, logits, second, per_sample = jax.jit(calls)(x)
    np.testing.assert_allclose(np.asarray(grad), np.mean([g for _, g, _ in per_sample], 0),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(logits), np.mean([z for _, _, z in per_sample], 0),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(jnp.sum(value)), np.mean([v for v, _, _ in per_sample]),
                               rtol=1e-5)
    # A second call on the same object draws fresh keys.
    assert not np.allclose(np.asarray(second), np.asarray(logits))


def test_eot_samples_are_one_vmap_axis_and_each_is_a_model_pass():
    """The program of an EOT-S gradient holds S forward and backward passes, not more, and the
    attack's budget counts each sample."""
    params, x, y = linear_problem(n=8)
    x = jnp.asarray(x)
    model = jaxbundle.stochastic(noisy_linear)
    loss = lambda z: jnp.sum(z, axis=-1)  # noqa: E731

    def flops(samples):
        m = WhiteBoxModel(model, params, None, _keys(8), samples)
        return dot_flops(jax.make_jaxpr(lambda x_: m.loss_and_grad(loss, x_))(x).jaxpr)

    assert flops(8) == 8 * flops(1)
    pgd = jaxbundle.with_eot([attacks_lib.pgd(steps=5, restarts=2)], 4)[0]
    assert pgd.gradients == 5 * 2 * 4
    square = jaxbundle.with_eot([attacks_lib.square(queries=11)], 3)[0]
    assert square.queries == 3 * (square.init_queries + 10 * square.queries_per_step)
    # That a bundle reports these counts for an attack with EOT, every kind of attack:
    # test_every_attack_kind_runs_on_a_stochastic_model_independently_of_the_batch.


def test_black_box_oracles_average_scores_and_vote_labels():
    params, x, y = linear_problem(n=6)
    x = jnp.asarray(x)
    model = jaxbundle.stochastic(noisy_linear)
    keys = _keys(6, seed=4)
    draws = WhiteBoxModel(model, params, None, keys, 9).sample_logits(x)  # call site 0
    scores = ScoreOracle(model, params, None, keys, 9).logits(x)
    np.testing.assert_allclose(np.asarray(scores), np.asarray(jnp.mean(draws, 0)), rtol=1e-6)
    labels = np.asarray(LabelOracle(model, params, None, keys, 9).label(x))
    votes = np.stack([np.bincount(np.argmax(np.asarray(draws[:, b]), -1), minlength=4)
                      for b in range(6)])
    np.testing.assert_array_equal(labels, np.argmax(votes, axis=1))


# --- judging over many calls and best-on-average -----------------------------------------


def _two_pixel_model(params, x, key):
    """Two classes; the wrong class's margin is 8 (a - 0.5) + 10 b n, n ~ N(0, 1), for pixels
    a, b of x: a candidate's probability of fooling one call is Phi(mean / std)."""
    a, b = x[:, 0], x[:, 1]
    margin = 8.0 * (a - 0.5) + 10.0 * b * jax.random.normal(key, a.shape)
    return jnp.stack([jnp.zeros_like(margin), margin], axis=1)


# A is the lucky candidate (mean margin -1, std 2: fools 31 % of calls), B the robust one
# (mean +0.8, std 1: fools 79 %).
LUCKY, ROBUST = (0.375, 0.2), (0.6, 0.1)
P_LUCKY, P_ROBUST = gaussian.cdf(-1 / 2), gaussian.cdf(0.8 / 1)


class _Proposal(NamedTuple):
    x: jax.Array


def _proposer():
    """An attack whose restart r (of two) proposes the candidate ``params["order"][r]`` (for
    one step) and claims, as a single lucky call would, that the lucky one is far deeper in the
    wrong class. The order is a traced argument: every order is one program."""

    def init(config, keys, x0, y, eps, model, restart):
        return _Proposal(jnp.broadcast_to(model.params["order"][restart], x0.shape))

    def step(config, state, model):
        lucky = jnp.all(state.x == jnp.asarray([LUCKY], jnp.float32), axis=1)
        claim = jnp.where(lucky, 10.0, 0.5)
        return state, Candidate(state.x, jnp.stack([jnp.zeros_like(claim), claim], axis=1))

    return Attack("proposer", "white-box", "linf", 1, 2, 1, init, step, "proposer")


def _propose(order, threshold=0.5, clean=(0.5, 0.0)):
    """The proposer's two candidates ``order`` on 4 copies of the image ``clean`` (label 0),
    judged over 400 calls: one program per threshold (the model's declaration)."""
    x = jnp.tile(jnp.asarray([clean], jnp.float32), (4, 1))
    model = jaxbundle.stochastic(_two_pixel_model, calls=400, threshold=threshold)
    return bundle([_proposer()], model, {"order": jnp.asarray(order, jnp.float32)}, x,
                  jnp.zeros(4, jnp.int32), KEY, eps=0.5, judging="float", validate=False)


def _close(rate, p, calls=400):
    return np.all(np.abs(np.asarray(rate) - p) < 4 * np.sqrt(p * (1 - p) / calls))


def test_the_bundle_keeps_the_candidate_best_on_average_not_the_luckiest():
    res = _propose((LUCKY, ROBUST))
    best = res.best["misclassify"]
    np.testing.assert_allclose(np.asarray(best.x), np.tile([ROBUST], (4, 1)))
    assert np.all(np.asarray(best.restart) == 1)
    assert _close(best.score.rate, P_ROBUST)
    assert np.all(np.asarray(res.attack_success[0]))
    # The order of the restarts does not matter; and the lucky candidate alone (proposed by
    # both restarts; a single-call view would have kept it) fools under a third of the calls:
    # not an adversarial example.
    swapped = _propose((ROBUST, LUCKY)).best["misclassify"]
    np.testing.assert_allclose(np.asarray(swapped.x), np.asarray(best.x))
    alone = _propose((LUCKY, LUCKY))
    assert _close(alone.best["misclassify"].score.rate, P_LUCKY)
    assert not np.asarray(alone.attack_success[0]).any()
    # Under a threshold of 0.25 it counts.
    assert np.all(np.asarray(_propose((LUCKY, LUCKY), threshold=0.25).attack_success[0]))


def test_judge_rate_and_threshold():
    """The same candidate under thresholds 0.25 and 0.5: fooled in 31 % of the calls. (The
    clean image is the lucky candidate; the programs are the proposer's above.)"""
    for threshold, fooled in ((0.25, True), (0.5, False)):
        res = _propose((ROBUST, ROBUST), threshold=threshold, clean=LUCKY)
        assert np.all(np.asarray(res.clean.misclassified) == fooled)
        np.testing.assert_allclose(np.asarray(res.clean.rate), P_LUCKY, atol=0.1)


# --- held-out calls: the winner's rate re-judged on calls its choice never saw --------------

IDS = 64.0  # a candidate's id is its second pixel times IDS


def _bernoulli_model(params, x, key):
    """Two classes, label 0. A candidate (first pixel above 0.5) fools each call independently
    with probability ``params["p"]``: call key k fools candidate c iff ``uniform(fold_in(k, c))
    < p``, c its id (so candidates under common keys stay independent); the clean image never
    fools (and has the lowest margin, so that any candidate beats it on a tie)."""
    attacked = x[:, 0] > 0.5
    ident = jnp.round(x[:, 1] * IDS).astype(jnp.int32)
    u = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i)))(ident)
    fooled = attacked & (u < params["p"])
    margin = jnp.where(fooled, 1.0, jnp.where(attacked, -1.0, -2.0))
    return jnp.stack([jnp.zeros_like(margin), margin], axis=1)


def _candidates(name, first, restarts):
    """An attack whose restart r proposes candidate ``first + r`` (one step; its own view: an
    even chance)."""

    def init(config, keys, x0, y, eps, model, restart):
        ident = jnp.full(x0.shape[:1], (first + restart) / IDS)
        return _Proposal(jnp.stack([jnp.full_like(ident, 0.75), ident], axis=1))

    def step(config, state, model):
        claim = jnp.full(state.x.shape[:1], 0.5)
        return state, Candidate(state.x, jnp.stack([jnp.zeros_like(claim), claim], axis=1))

    return Attack(name, "white-box", "linf", 1, restarts, 1, init, step, (first, restarts))


# 5 candidates per example (2 attacks: 3 + 2 restarts), each fooling a fraction p of the calls.
CANDIDATES = (_candidates("three", 1, 3), _candidates("two", 4, 2))
R = sum(a.num_restarts for a in CANDIDATES)


def _toy(n):
    x = jnp.tile(jnp.asarray([[0.5, 0.0]], jnp.float32), (n, 1))
    return x, jnp.zeros(n, jnp.int32)


def _max_of_binomials(p, calls, k):
    """Mean and std of the largest of k Binomial(calls, p) / calls (the winner's selection
    rate), from its exact distribution P(max <= j) = F(j)^k."""
    j = np.arange(calls + 1)
    pmf = np.diff(np.concatenate([[0.0], binom.cdf(j, calls, p) ** k]))
    mean = float(np.sum(pmf * j / calls))
    return mean, float(np.sqrt(np.sum(pmf * (j / calls - mean) ** 2)))


def test_held_out_rate_is_unbiased_where_the_selection_rate_is_not():
    """The analytic toy: every candidate fools a fraction p = 0.4 of the calls. The winner's
    rate on the 16 calls that chose it is the best of 5 (mean 0.543 by the order statistics);
    on 16 held-out calls it is Binomial(16, 0.4) / 16 (mean 0.4). At threshold 0.5 the
    selection calls fool 54 % of the examples, the held-out ones 14 %, the true figure."""
    n, calls, p = 2000, 16, 0.4
    model = jaxbundle.stochastic(_bernoulli_model, calls=calls, threshold=0.5)
    x, y = _toy(n)
    res = bundle(CANDIDATES, model, {"p": jnp.float32(p)}, x, y, KEY, eps=0.5, judging="float",
                 validate=False)
    selected, held = np.asarray(res.selection_rate), np.asarray(res.best["misclassify"].score.rate)
    assert np.all(np.asarray(res.best["misclassify"].attack) >= 0)  # a candidate always wins
    # Selection: biased upward by what the order statistics predict (4 standard errors).
    mean, std = _max_of_binomials(p, calls, R)
    assert mean - p > 0.14
    assert abs(selected.mean() - mean) < 4 * std / np.sqrt(n)
    # Held out: unbiased, within 4 standard errors of p (and far below the selection mean).
    se = np.sqrt(p * (1 - p) / (calls * n))
    assert abs(held.mean() - p) < 4 * se
    assert selected.mean() - held.mean() > 30 * se
    # Fooled: the held-out fraction is P(Binomial(16, p) > 8), not the best of 5 of it.
    q = binom.sf(calls // 2, calls, p)
    fooled = np.asarray(res.best["misclassify"].score.misclassified)
    np.testing.assert_array_equal(fooled, held > 0.5)
    assert abs(fooled.mean() - q) < 4 * np.sqrt(q * (1 - q) / n)
    inflated = 1 - (1 - q) ** R
    assert abs(np.mean(selected > 0.5) - inflated) < 4 * np.sqrt(inflated * (1 - inflated) / n)
    # Each attack's own verdict stays the choosing calls' (its best of its restarts).
    assert np.all(np.asarray(res.attack_success).any(0) == (selected > 0.5))


@pytest.mark.parametrize("mode", ["full", "cascade"])
def test_reported_robust_accuracy_counts_the_held_out_rate(mode):
    """p = 0.45 just below the threshold 0.5: the report's robust accuracy is 1 - P(Binomial(16,
    0.45) > 8) = 74.4 %, not the 22.8 % the winners' selection rates would give; the
    stochastic section gives both mean rates."""
    n, calls, p = 1000, 16, 0.45
    model = jaxbundle.stochastic(_bernoulli_model, calls=calls, threshold=0.5)
    x, y = _toy(n)
    plan = jaxbundle.Plan.of(eps=0.5, attacks=CANDIDATES, batch_size=n, goals=("misclassify",),
                          judging="float", mode=mode)
    ev = jaxbundle.evaluate(model, {"p": jnp.float32(p)}, (np.asarray(x), np.asarray(y)), plan)
    pe, s = ev.per_example, ev.metrics["stochastic"]
    np.testing.assert_array_equal(pe["success"], pe["success_rate"] > 0.5)
    q = binom.sf(calls // 2, calls, p)
    assert abs(ev.metrics["robust_accuracy"] - 100 * (1 - pe["success"].mean())) < 1e-9
    assert abs(pe["success"].mean() - q) < 4 * np.sqrt(q * (1 - q) / n)
    inflated = 1 - (1 - q) ** R  # the cascade too: fooled at selection iff any candidate is
    assert abs(np.mean(pe["selection_success_rate"] > 0.5) - inflated) < 0.05
    assert s["mean_success_rate"] == pytest.approx(pe["success_rate"].mean())
    assert s["mean_selection_success_rate"] == pytest.approx(pe["selection_success_rate"].mean())
    assert abs(s["mean_success_rate"] - p) < 4 * np.sqrt(p * (1 - p) / (calls * n))
    assert s["mean_selection_success_rate"] > p + 0.1
    assert "held-out" in s["statement"] and s["heldout_calls_per_example"] == 2 * calls
    assert s["robust_accuracy_at_threshold"]["0.5"] == pytest.approx(
        ev.metrics["robust_accuracy"] / 100)
    # The judge's calls, held-out ones included, are not attack passes.
    assert np.all(pe["gradients"] <= sum(a.gradients for a in CANDIDATES))


def test_held_out_keys_are_a_stream_of_their_own():
    """The winner's selection rate is its rate under the judge's call keys and its held-out
    rate under the held-out stream's, as documented; the two sets of keys share none."""
    n, calls, p = 2000, 16, 0.5  # the model and n of the test above: its program, run again
    model = jaxbundle.stochastic(_bernoulli_model, calls=calls)
    x, y = _toy(n)
    ids = jnp.arange(100, 100 + n, dtype=jnp.int32)
    res = bundle(CANDIDATES, model, {"p": jnp.float32(p)}, x, y, KEY, eps=0.5, judging="float",
                 example_id=ids, validate=False)
    examples = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(KEY, ids)
    judge = sampling.call_keys(sampling.judge_keys(examples), 0, calls)  # [calls, n]
    heldout = sampling.call_keys(sampling.heldout_keys(examples), 0, calls)
    def data(keys):
        return np.asarray(jax.random.key_data(keys)).reshape(-1, 2)

    np.testing.assert_array_equal(data(heldout), data(sampling.call_keys(
        sampling.fold_each(examples, sampling.HELDOUT_STREAM), 0, calls)))
    judged, held = ({tuple(r) for r in data(k)} for k in (judge, heldout))
    assert not judged & held and len(held) == calls * n

    def rate(keys, ident):  # [n]: the fraction of keys [calls, n] that fool candidate ident
        u = jax.vmap(jax.vmap(lambda k, i: jax.random.uniform(jax.random.fold_in(k, i))),
                     in_axes=(0, None))(keys, ident)
        return np.mean(np.asarray(u) < p, axis=0)

    best = res.best["misclassify"]
    winner = jnp.round(best.x[:, 1] * IDS).astype(jnp.int32)
    every = np.stack([rate(judge, jnp.full(n, c, jnp.int32)) for c in range(1, R + 1)])
    np.testing.assert_allclose(np.asarray(res.selection_rate), rate(judge, winner))
    np.testing.assert_allclose(np.asarray(res.selection_rate), every.max(0))
    np.testing.assert_allclose(np.asarray(best.score.rate), rate(heldout, winner))
    assert np.any(np.asarray(best.score.rate) != np.asarray(res.selection_rate))


def test_rejudging_rechecks_box_and_ball():
    """A winner outside the box or the ball is no success on the held-out calls either."""
    model = jaxbundle.stochastic(_bernoulli_model, calls=8)
    x0 = jnp.tile(jnp.asarray([[0.5, 0.0]], jnp.float32), (3, 1))
    y = jnp.zeros(3, jnp.int32)
    # in the ball; outside the ball (0.75 from x0 at eps 0.5); outside the box
    x = jnp.asarray([[0.75, 1 / IDS], [0.75, 48 / IDS], [1.25, 2 / IDS]], jnp.float32)
    keys = sampling.heldout_keys(jax.random.split(KEY, 3))
    judge = WhiteBoxModel(model, {"p": jnp.float32(1.0)}, None, keys, 8, fresh=False)
    full = jnp.zeros(3, jnp.int32)
    state = goals_lib.BestState(x, goals_lib.score(x, jnp.zeros((3, 2)), x0, y, "linf"),
                                full, full, full)
    eps = jnp.full(3, 0.5)
    s, min_norm = jax.jit(lambda: tuple(  # one program (eagerly: one per operation)
        jaxbundle.judge.rejudge(state, goal, judge, x0, y, eps, "linf").score
        for goal in ("misclassify", "min_norm")))()
    np.testing.assert_array_equal(np.asarray(s.misclassified), [True, False, False])
    np.testing.assert_array_equal(np.asarray(s.rate), [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(  # a min-norm winner is bound by the box, not the ball
        np.asarray(min_norm.misclassified), [True, True, False])


# --- every kind of attack, the cascade, the evaluation and its checks ------------------------


def _noisy_problem(n=24):
    params, x, y = linear_problem(n=n, k=5, seed=3)
    eps = float(np.quantile(min_distance(params, x, y, "linf"), 0.5))
    return params, np.asarray(images(x)), y, eps


# One kind in the fast tier (``-m "not slow"``), every kind in the whole suite.
_KINDS = [suites.attack("apgd-ce", "linf", steps=6)] + [
    pytest.param(a, marks=pytest.mark.slow) for a in (
        attacks_lib.pgd(steps=6, restarts=2), attacks_lib.square(queries=30),
        suites.attack("rays", "linf", steps=20), attacks_lib.fab(targets=4, steps=4),
        attacks_lib.deepfool("linf", steps=4, candidates=4))]


@pytest.mark.parametrize("attack", _KINDS, ids=lambda a: a.name)
def test_every_attack_kind_runs_on_a_stochastic_model_independently_of_the_batch(attack):
    """Whatever else is in the batch and wherever in it an example stands, it gets the same
    draws: each half of the batch run alone, padded as evaluate pads a last batch (its last
    row repeated; one program for the whole batch and the halves). Every reported image is in
    the box and the ball and fooled in more than half of the judge's calls."""
    params, x, y, eps = _noisy_problem()
    model = jaxbundle.stochastic(noisy_linear, calls=8)
    atts = jaxbundle.with_eot([attack], 2)
    whole = bundle(atts, model, params, x, y, KEY, eps=eps, judging="float")
    ids = jnp.arange(len(y), dtype=jnp.int32)
    halves = []
    for half in (np.arange(12), np.arange(12, 24)):
        rows = np.r_[half, np.full(12, half[-1])]
        res = bundle(atts, model, params, x[rows], y[rows], KEY, eps=eps, judging="float",
                     example_id=ids[rows])
        halves.append(jax.tree.map(lambda a: np.asarray(a)[:12], res.best["misclassify"]))
    best = whole.best["misclassify"]
    for field in ("x", "score"):
        got = jax.tree.map(lambda *a: np.concatenate(a), *[getattr(h, field) for h in halves])
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     jax.tree.map(np.asarray, getattr(best, field)), got)
    fooled = np.asarray(best.score.misclassified)
    xa = np.asarray(best.x).reshape(len(y), -1)
    assert np.all((xa >= 0) & (xa <= 1))
    assert np.all(np.abs(xa - x.reshape(len(y), -1)).max(1)[fooled] <= eps + 1e-6)
    assert np.all(np.asarray(best.score.rate)[fooled] > 0.5)
    assert np.asarray(whole.gradients)[0] == atts[0].gradients
    assert np.asarray(whole.queries)[0] == atts[0].queries


@pytest.mark.parametrize("segments", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_cascade_on_a_stochastic_model_fools_what_the_full_bundle_fools(segments):
    params, x, y, eps = _noisy_problem(n=32)
    model = jaxbundle.stochastic(noisy_linear, calls=8)
    atts = jaxbundle.with_eot([attacks_lib.fgsm(), attacks_lib.pgd(steps=6, restarts=2)], 3)
    goals = goals_for(("misclassify",), atts)
    ids = jnp.arange(len(y), dtype=jnp.int32)
    full = bundle(atts, model, params, x, y, KEY, eps=eps, goals=goals, example_id=ids)
    plan = jaxbundle.Plan.of(eps=eps, attacks=tuple(atts), goals=("misclassify",),
                             mode="cascade", segments=segments).check(model)
    res, _ = cascade(plan.schedule, Model(params, tuple(atts), KEY, None, plan.rules(model, atts)),
                     Batch(x, y, ids, None, None), eps)

    def fooled(r):
        return np.asarray(goals_lib.success("misclassify", r.best["misclassify"].score, eps))

    # On the judge's calls that chose the winners, the cascade fools what the full bundle does.
    chosen = np.asarray(full.selection_rate) > 0.5
    np.testing.assert_array_equal(np.asarray(res.selection_rate) > 0.5, chosen)
    assert 0 < chosen.sum() < len(y)
    # Both re-judge their winner on the same held-out calls: the same image, the same rate and
    # verdict. The winners are the same wherever no attack fooled the example (the cascade ran
    # every attack on it); where one did, the cascade may have stopped at an earlier winner.
    best, mine = full.best["misclassify"], res.best["misclassify"]
    same = np.all((np.asarray(best.x) == np.asarray(mine.x)).reshape(len(y), -1), axis=1)
    assert np.all(same[~chosen]) and same.sum() > (~chosen).sum()
    for r in (full, res):
        assert np.asarray(r.best["misclassify"].score.rate).tolist() != np.asarray(
            r.selection_rate).tolist()
    np.testing.assert_array_equal(np.asarray(mine.score.rate)[same],
                                  np.asarray(best.score.rate)[same])
    np.testing.assert_array_equal(fooled(res)[same], fooled(full)[same])
    np.testing.assert_array_equal(np.asarray(res.clean.rate), np.asarray(full.clean.rate))


def test_evaluation_reports_rates_and_the_randomness_check():
    from jaxbundle import Plan, checks, evaluate
    from jaxbundle.evaluation import CHECKED, for_model

    params, x, y, eps = _noisy_problem(n=20)
    model = jaxbundle.stochastic(noisy_linear, calls=8)
    pgd = attacks_lib.pgd(steps=5)
    plan = Plan.of(eps=eps, attacks=(pgd,), batch_size=8, goals=("misclassify",))
    # EOT as a plan field: every attack averages 4 samples per call (jaxbundle.with_eot).
    ev = evaluate(model, params, (x, y), plan.replace(eot=4))
    pe, s = ev.per_example, ev.metrics["stochastic"]
    assert (s["calls"], s["threshold"], s["eot"]) == (8, 0.5, {"pgd-ce": 4})
    np.testing.assert_array_equal(pe["success"], pe["success_rate"] > 0.5)
    assert np.all(np.isin(np.round(pe["success_rate"] * 8), np.arange(9)))
    at = s["robust_accuracy_at_threshold"]
    assert at["0"] <= at["0.5"] <= at["0.9"]
    correct = pe["clean_success_rate"] <= 0.5
    assert abs(at["0.5"] - np.mean(correct & ~pe["success"])) < 1e-9
    assert abs(100 * at["0.5"] - ev.metrics["robust_accuracy"]) < 1e-6
    assert np.all(pe["gradients"][correct] == 5 * 4)
    assert ev.metrics["checks"]["randomness"]["passed"]
    assert "every attack averages pgd-ce 4" in ev.metrics["checks"]["randomness"]["saw"]
    # The check reads the model and the attacks as the evaluation runs them (for_model), not
    # what they found: the two failing cases below are its model checks on the first batch's
    # images, as evaluate calls them (two more evaluations would compile two more programs).
    def randomness(model, plan):
        apply_fn, attacks = for_model(plan, model)
        return checks.model_checks(apply_fn, params, x[:CHECKED], attacks)["randomness"]

    assert randomness(model, plan.replace(eot=4)) == tuple(  # as the evaluation reported it
        ev.metrics["checks"]["randomness"][f] for f in checks.Check._fields)
    # Attacked without EOT: the check fails and says which attack.
    single = randomness(model, plan)
    assert not single.passed and "without EOT: pgd-ce" in single.saw
    # A model declared stochastic that ignores its key fails it too.
    ignores = jaxbundle.stochastic(lambda p, x_, key: linear_apply(p, x_), calls=4)
    checked = randomness(ignores, plan.replace(eot=2))
    assert "every attack averages pgd-ce 2" in checked.saw and not checked.passed
    for deterministic in (Plan.of(eps=eps, attacks=tuple(jaxbundle.with_eot([pgd], 2))),
                          Plan.of(eps=eps, attacks=(pgd,), eot=2)):
        with pytest.raises(ValueError, match="eot=2 but the model is deterministic"):
            evaluate(linear_apply, params, (x, y), deterministic)


def test_attacks_given_with_eot_keep_it_in_an_evaluation():
    """Attack values built with ``jaxbundle.with_eot`` run as the plan's ``eot`` does: the same
    per-example result, every gradient counting its samples; both set and different is an
    error."""
    from jaxbundle import Plan, evaluate

    params, x, y, eps = _noisy_problem(n=8)
    model = jaxbundle.stochastic(noisy_linear, calls=8)
    pgd = attacks_lib.pgd(steps=5)  # as in the test above: its program (a batch of 8), run again
    plan = Plan.of(eps=eps, attacks=(pgd,), goals=("misclassify",))
    given = evaluate(model, params, (x, y), plan.replace(attacks=jaxbundle.with_eot([pgd], 4)))
    by_plan = evaluate(model, params, (x, y), plan.replace(eot=4))
    assert given.metrics["stochastic"]["eot"] == {"pgd-ce": 4}
    for k in by_plan.per_example:
        np.testing.assert_array_equal(given.per_example[k], by_plan.per_example[k], err_msg=k)
    with pytest.raises(ValueError, match="carries eot=4 and the plan eot=2: set one of them"):
        evaluate(model, params, (x, y),
                 plan.replace(attacks=jaxbundle.with_eot([pgd], 4), eot=2))


def test_randomized_demo_defence_transform():
    from jaxbundle.models.randomized import randomized, transform

    x = jnp.asarray(np.random.default_rng(0).uniform(size=(3, 8, 8, 1)), jnp.float32)
    same = transform(x, jax.random.key(1), 0.0, 0)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(x))
    shifted = np.asarray(transform(x, jax.random.key(2), 0.0, 2))
    # A pure shift: each image is x moved by one offset in [-2, 2]^2, zeros coming in.
    found = [(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)
             if np.array_equal(shifted, np.asarray(
                 jnp.pad(x, ((0, 0), (2, 2), (2, 2), (0, 0)))[:, 2 - dy:10 - dy, 2 - dx:10 - dx]))]
    assert len(found) == 1
    noisy = np.asarray(transform(x, jax.random.key(3), 0.1, 0))
    assert 0.05 < np.std(noisy - np.asarray(x)) < 0.12 and noisy.min() >= 0 and noisy.max() <= 1
    model = randomized(lambda p, v: v.reshape(v.shape[0], -1)[:, :4], calls=5)
    assert sampling.is_stochastic(model) and model.calls == 5
    with pytest.raises(ValueError, match="noise"):
        randomized(linear_apply, noise=-1.0)


def test_transfer_from_surrogates_refuses_a_stochastic_model():
    from jaxbundle.transfer import transfer_bundle

    params, x, y, eps = _noisy_problem(n=4)
    with pytest.raises(ValueError, match="does not support stochastic models"):
        transfer_bundle([attacks_lib.fgsm()], [(linear_apply, params)],
                        jaxbundle.stochastic(noisy_linear), params, x, y, KEY, eps=eps)
