"""Best-effort mode: per-example bisection on eps recovers the analytic distance."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import attacks, norms
from jaxbundle.best_effort import best_effort
from toys import KEY, images, linear_apply, linear_problem, min_distance


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_fgsm_best_effort_on_a_binary_linear_model_is_the_exact_distance(norm):
    """FGSM is exact on a binary linear model, so its best effort is the minimal distance."""
    params, x, y = linear_problem(n=32, k=2, seed=2)
    # Move the boundary through the data: small distances, so the box never binds.
    z = np.asarray(linear_apply(params, jnp.asarray(x)))
    params = {"w": params["w"], "b": params["b"].at[1].add(-float(np.median(z[:, 1] - z[:, 0])))}
    y = np.asarray(jnp.argmax(linear_apply(params, jnp.asarray(x)), axis=1)).astype(np.int32)
    d = min_distance(params, x, y, norm)
    eps_max = float(np.quantile(d, 0.75))
    r = best_effort([attacks.fgsm(norm)], linear_apply, params, images(x), jnp.asarray(y), KEY,
                    eps_max=eps_max, norm=norm, iterations=12, judging="float")
    dist = np.asarray(r.distortion)
    reachable = d < eps_max * 0.999
    assert np.all(np.isinf(dist[d > eps_max * 1.001]))
    width = eps_max / 2**12
    np.testing.assert_array_less(d[reachable] * (1 - 1e-4), dist[reachable])
    np.testing.assert_array_less(dist[reachable], d[reachable] + 2 * width + 1e-6)
    assert np.all(np.asarray(r.lower)[reachable] <= dist[reachable])
    # Each adversarial image is verified and as distorted as reported.
    got = np.asarray(norms.norm(r.x - images(x), norm))
    np.testing.assert_allclose(got[reachable], dist[reachable], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(r.x)[~reachable & np.isinf(dist)],
                                  np.asarray(images(x))[~reachable & np.isinf(dist)])
    assert int(r.gradients[0]) == 13  # one FGSM gradient per round


def test_best_effort_rejects_bad_arguments():
    params, x, y = linear_problem(n=4)
    with pytest.raises(ValueError, match="eps_max"):
        best_effort([attacks.fgsm()], linear_apply, params, images(x), jnp.asarray(y), KEY,
                    eps_max=0.0)
    with pytest.raises(ValueError, match="iterations"):
        best_effort([attacks.fgsm()], linear_apply, params, images(x), jnp.asarray(y), KEY,
                    eps_max=0.1, iterations=-1)
