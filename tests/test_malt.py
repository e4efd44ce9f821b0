"""APGD-T's MALT targeting (Melamed et al. 2024): the order against the analytic linearised
distances, a target logit order misses, the setup computed once for every restart and counted
exactly (in the full bundle, a cascade and a cascade of restarts), the refusals, and a flax
``nn.Conv`` network on colour off-grid images (the order against each example's Jacobian, every
reported success re-checked)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import Plan, evaluate
from jaxbundle.attacks import apgd
from jaxbundle.attacks.base import WhiteBoxModel
from jaxbundle.attacks.white_box.apgd import malt_targets
from jaxbundle.bundler import bundle
from cascade_toys import problem, run_cascade
from toys import ColourCNN, KEY, images, linear_apply, linear_problem


def _analytic_order(params, x, y, norm, candidates):
    """Per example: the ``candidates`` classes of highest logit (label excluded), sorted by
    ``(z_y - z_j) / ||w_y - w_j||_*`` (exact on a linear model)."""
    w, z = np.asarray(params["w"]), np.asarray(linear_apply(params, jnp.asarray(x)))
    dual = {"linf": 1, "l2": 2}[norm]
    out = []
    for i, label in enumerate(y):
        others = [j for j in np.argsort(-z[i], kind="stable") if j != label][:candidates]
        dist = [(z[i, label] - z[i, j]) / np.linalg.norm(w[:, label] - w[:, j], ord=dual)
                for j in others]
        out.append([others[k] for k in np.argsort(dist, kind="stable")])
    return np.array(out)


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_the_order_is_the_analytic_linearised_distance(norm):
    params, x, y = linear_problem(seed=5, n=32, k=10, spread=0.2)
    config = apgd(norm, "dlr-targeted", steps=2, targets=5, targeting="malt").config
    got = malt_targets(config, images(x), jnp.asarray(y), None, WhiteBoxModel(linear_apply, params))
    expected = _analytic_order(params, x, y, norm, 9)
    np.testing.assert_array_equal(np.asarray(got), expected)
    # MALT's is not the logit order on this model.
    z = np.array(linear_apply(params, jnp.asarray(x)))
    z[np.arange(len(y)), y] = -np.inf
    by_logit = np.argsort(-z, axis=1, kind="stable")[:, :9]
    assert np.mean(np.any(expected[:, :5] != by_logit[:, :5], axis=1)) > 0.5


def _near_but_unlikely(n=8):
    """Class 0 wins; class 1 has the second logit but its boundary is 9.5 away in Linf (the
    logit gap 0.95 over ||w_0 - w_1||_1 = 0.1, upwards); class 2's is 0.2 away (gap 2 over 10,
    downwards: the way to class 1 leads away from it); class 3 is out of reach."""
    d = 20
    w = np.zeros((d, 4), np.float32)
    w[:, 1], w[:, 2] = 0.005, -0.5
    b = np.array([0.0, -1.0, 3.0, -100.0], np.float32)
    rng = np.random.default_rng(0)
    x = (0.5 + 0.01 * rng.uniform(-1, 1, size=(n, d))).astype(np.float32)
    params = {"w": jnp.asarray(w), "b": jnp.asarray(b)}
    assert np.all(np.argmax(np.asarray(linear_apply(params, jnp.asarray(x))), 1) == 0)
    return params, images(x), jnp.zeros(n, jnp.int32)


def test_malt_finds_the_target_the_logit_order_misses():
    params, x, y = _near_but_unlikely()
    fooled = {}
    for targeting in ("logits", "malt"):
        attack = apgd("linf", "dlr-targeted", steps=20, targets=1, candidates=3,
                      targeting=targeting)
        r = bundle([attack], linear_apply, params, x, y, KEY, eps=0.3, norm="linf",
                   judging="float")
        fooled[targeting] = np.asarray(r.best["misclassify"].score.misclassified)
    assert not fooled["logits"].any() and fooled["malt"].all()


def _backward_rows(apply_fn, counts):
    """``apply_fn`` with the rows of every input gradient counted as the program runs."""

    @jax.custom_vjp
    def probe(x):
        return x

    def bwd(_, g):
        jax.debug.callback(lambda r: counts.append(int(np.size(r))),
                           (g.reshape(g.shape[0], -1)[:, 0] * 0).astype(jnp.int8))
        return (g,)

    probe.defvjp(lambda x: (x, None), bwd)
    return lambda params, x: apply_fn(params, probe(x))


@pytest.mark.parametrize("restart_mode", ["vmap", "map"])
def test_the_setup_runs_once_for_every_restart_and_is_counted(restart_mode):
    params, x, y = linear_problem(seed=1, n=6, k=5)
    attack = apgd("l2", "dlr-targeted", steps=3, targets=3, candidates=4, targeting="malt")
    assert attack.setup_gradients == 4 and attack.gradients == 3 * 3 + 4
    counts = []
    r = bundle([attack], _backward_rows(linear_apply, counts), params, images(x),
               jnp.asarray(y), KEY, eps=0.5, norm="l2", judging="float",
               restart_mode=restart_mode)
    jax.effects_barrier()
    np.testing.assert_array_equal(np.asarray(r.gradients), attack.gradients)
    assert sum(counts) == 6 * attack.gradients  # 4 setup rows and 3 x 3 steps per example


def test_a_cascade_counts_the_setup_where_the_stage_ran():
    params, x, y, eps = problem(n=16)
    first = apgd("linf", "ce", steps=2)
    malt = apgd("linf", "dlr-targeted", steps=4, targets=2, candidates=3, targeting="malt",
                name="apgd-t2-malt")
    eps = np.full(16, eps, np.float32)
    for restart_mode in ("vmap", "cascade"):
        res, stages = run_cascade([first, malt], params, x, jnp.asarray(y),
                                  jnp.arange(16), eps, goal_names=("misclassify",),
                                  restart_mode=restart_mode)
        ran = ~np.asarray(res.attack_success)[0]  # the first stage's survivors
        paid = np.asarray(res.gradients) - first.gradients
        survivors = stages[1].examples
        assert 0 < survivors < 16 and survivors == ran.sum()
        assert np.all(paid[ran] > 0) and np.all(paid[~ran] == 0)
        if restart_mode == "vmap":  # both targets at once: one setup
            assert set(paid[paid > 0]) == {malt.gradients}
        else:  # one target after another, each with its own setup, the second on fewer
            assert set(paid[paid > 0]) <= {3 + 4, 2 * (3 + 4)}


def test_refusals():
    with pytest.raises(ValueError, match="targeting"):
        apgd("linf", "dlr-targeted", targeting="nearest")
    with pytest.raises(ValueError, match="has none"):
        apgd("linf", "ce", targeting="malt")
    with pytest.raises(ValueError, match="fewer than the 5 targets"):
        apgd("linf", "dlr-targeted", targets=5, candidates=4, targeting="malt")
    params, x, y = linear_problem(seed=1, n=4, k=5)
    attack = apgd("linf", "dlr-targeted", steps=2, targets=2, candidates=9, targeting="malt")
    with pytest.raises(ValueError, match="candidates=4"):
        bundle([attack], linear_apply, params, images(x), jnp.asarray(y), KEY, eps=0.1,
               norm="linf")


def test_on_a_flax_network_with_colour_off_grid_images():
    """The order on a network, against each example's Jacobian taken on its own
    (``jax.jacrev``, numpy's L1 norm), and ``apgd-t5-malt`` through ``evaluate``: every success
    in the box and the ball and misclassified in float32 at full matmul precision, every
    example charged 5 x 10 steps and the 9 gradients of the order once."""
    net = ColourCNN()
    x = jax.random.uniform(jax.random.key(3), (12, 32, 32, 3))  # off the 8-bit grid
    params = net.init(jax.random.key(4), x)
    y = np.asarray(jnp.argmax(net.apply(params, x), -1))
    attack = apgd("linf", "dlr-targeted", steps=10, targets=5, targeting="malt")
    got = np.asarray(malt_targets(attack.config, x, jnp.asarray(y), None,
                                  WhiteBoxModel(net.apply, params)))
    for i in range(len(y)):
        logits = np.asarray(net.apply(params, x[i:i + 1]))[0]
        jac = np.asarray(jax.jacrev(lambda im: net.apply(params, im[None])[0])(x[i]))
        others = [j for j in np.argsort(-logits, kind="stable") if j != y[i]]
        dist = [(logits[y[i]] - logits[j]) / np.abs(jac[y[i]] - jac[j]).sum() for j in others]
        np.testing.assert_array_equal(got[i], np.asarray(others)[np.argsort(dist)])
    plan = Plan.of(eps=4 / 255, attacks=(attack.rename("apgd-t5-malt"),), norm="linf",
                   goals=("misclassify",), judging="float")
    pe = evaluate(net.apply, params, (np.asarray(x), y), plan, mesh=None,
                  keep_images=True).per_example
    np.testing.assert_array_equal(pe["gradients"], 5 * 10 + 9)
    fooled = pe["success"].astype(bool)
    assert 0 < fooled.sum() < fooled.size
    adv = np.asarray(pe["x_adv"], np.float32)[fooled]
    assert adv.min() >= 0 and adv.max() <= 1
    assert np.abs(adv - np.asarray(x)[fooled]).max() <= 4 / 255 + 1e-7
    with jax.default_matmul_precision("highest"):
        assert np.all(np.asarray(jnp.argmax(net.apply(params, jnp.asarray(adv)), -1))
                      != y[fooled])
