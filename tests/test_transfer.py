"""Transfer bundling: candidates crafted on surrogates, chosen by votes, judged on the target."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import attacks, norms
from jaxbundle.bundler import bundle
from jaxbundle.transfer import choose_by_votes, transfer_bundle, transfer_figures
from toys import KEY, images, linear_apply, linear_problem, min_distance

ATTACKS = [attacks.pgd("linf", "margin", steps=20)]


def test_choose_by_votes_hand_computed():
    # fools[c, s, b]: 3 candidates, 2 surrogates, 3 examples.
    fools = jnp.asarray([
        [[1, 0, 0], [0, 0, 1]],   # candidate 0: votes 1, 0, 1
        [[1, 1, 0], [1, 0, 0]],   # candidate 1: votes 2, 1, 0
        [[1, 1, 1], [1, 0, 1]],   # candidate 2: votes 2, 1, 2
    ], bool)
    chosen, votes = choose_by_votes(fools)
    np.testing.assert_array_equal(chosen, [1, 1, 2])  # ties go to the first
    np.testing.assert_array_equal(votes, [2, 1, 2])


def _problem():
    params, x, y = linear_problem(n=48, seed=7)
    eps = float(np.median(min_distance(params, x, y, "linf")))
    return params, images(x), jnp.asarray(y), eps


def test_the_target_as_its_own_surrogate_is_the_white_box_attack():
    params, x, y, eps = _problem()
    white = bundle(ATTACKS, linear_apply, params, x, y, KEY, eps=eps)
    r = transfer_bundle(ATTACKS, [(linear_apply, params)], linear_apply, params, x, y, KEY, eps=eps)
    np.testing.assert_array_equal(r.success, white.attack_success[0])
    np.testing.assert_array_equal(r.surrogate_success[0], r.success)
    assert np.all(np.asarray(norms.in_ball(r.x - x, eps, "linf")))
    assert 0 < np.asarray(r.success).mean() < 1


def test_a_close_surrogate_transfers_better_than_an_unrelated_one():
    params, x, y, eps = _problem()
    rng = np.random.default_rng(0)
    close = {"w": params["w"] + 0.1 * rng.normal(size=params["w"].shape).astype(np.float32),
             "b": params["b"]}
    unrelated = {"w": jnp.asarray(rng.normal(size=params["w"].shape), jnp.float32),
                 "b": params["b"]}
    r = transfer_bundle(ATTACKS, [(linear_apply, unrelated), (linear_apply, close)],
                        linear_apply, params, x, y, KEY, eps=eps)
    f = transfer_figures(r, ["unrelated", "close"])
    assert f["per_surrogate"]["close"] < f["per_surrogate"]["unrelated"]
    # The vote picks the close surrogate's candidate wherever it fools more surrogates, so the
    # bundled transfer is at least as strong as the unrelated surrogate alone.
    assert f["transfer_robust_accuracy"] <= f["per_surrogate"]["unrelated"]
    assert np.all((np.asarray(r.votes) >= 0) & (np.asarray(r.votes) <= 2))
    # No fooled surrogate: the clean image is submitted.
    none = np.asarray(r.votes) == 0
    np.testing.assert_array_equal(np.asarray(r.x)[none], np.asarray(x)[none])


def test_transfer_rejects_no_surrogates_and_bad_inputs():
    params, x, y, eps = _problem()
    with pytest.raises(ValueError, match="surrogate"):
        transfer_bundle(ATTACKS, [], linear_apply, params, x, y, KEY, eps=eps)
    with pytest.raises(ValueError, match="eps"):
        transfer_bundle(ATTACKS, [(linear_apply, params)], linear_apply, params, x, y, KEY,
                        eps=-1.0)
