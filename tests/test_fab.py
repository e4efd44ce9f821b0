"""FAB / FAB-T: factory, protocol (the conformance suite), exact gradient count, targets, the
box-constrained projection, the reference's iteration on linear models, and a CNN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import test_attacks
from jaxbundle import attacks, norms, suites
from jaxbundle.attacks.base import Attack, WhiteBoxModel
from jaxbundle.attacks.white_box.fab import fab, project_hyperplane
from jaxbundle.bundler import bundle
from attack_checks import step_flops
from toys import KEY, images, linear_apply, linear_problem, min_distance, quick_demo_model

DUAL = {"linf": 1, "l2": 2}


def _linear(n=32, k=4, seed=1, spread=0.05, centred=False):
    """The linear toy; ``centred``: biases shifted so that the logits are equal at the centre
    of the box, so that the boundaries are near and no box-free minimum leaves the box."""
    params, xf, yf = linear_problem(n=n, k=k, seed=seed, spread=spread)
    if centred:
        params = {"w": params["w"], "b": params["b"] - 0.5 * jnp.sum(params["w"], axis=0)}
        yf = np.asarray(jnp.argmax(linear_apply(params, jnp.asarray(xf)), axis=1)).astype(np.int32)
    return params, xf, yf, WhiteBoxModel(linear_apply, params), images(xf), jnp.asarray(yf)


def _trajectories(attack, model, x, y, steps, restarts, keys=None, eps=None):
    """Every run's iterates and best norms, ``[R, steps + 1, B, ...]`` and ``[R, steps + 1, B]``
    (index 0: after ``init``), in one compiled program (restarts vmapped, steps scanned)."""

    def run(r):
        state = attack.init(attack.config, keys, x, y, eps, model, r)

        def body(s, _):
            s, _ = attack.step(attack.config, s, model)
            return s, (s.x, s.best_norm)

        _, (xs, best) = jax.lax.scan(body, state, None, length=steps)
        return (
            jnp.concatenate([state.x[None], xs]),
            jnp.concatenate([state.best_norm[None], best]),
        )

    xs, best = jax.jit(jax.vmap(run))(jnp.arange(restarts, dtype=jnp.int32))
    return np.asarray(xs), np.asarray(best)


def _pair_distance(params, xf, yf, target, norm):
    """Exact distance to the boundary between y and ``target`` of a linear model (no box)."""
    w = np.asarray(params["w"], np.float64)
    z = np.asarray(linear_apply(params, jnp.asarray(xf)), np.float64)
    rows = np.arange(len(yf))
    diff = (w[:, target] - w[:, yf]).T  # [B, D]
    return (z[rows, yf] - z[rows, target]) / np.linalg.norm(diff, ord=DUAL[norm], axis=1)


def _targets_of(params, xf, yf, restart):
    """The class of (restart + 2)-th highest clean logit, label first (the reference's rank)."""
    z = np.asarray(linear_apply(params, jnp.asarray(xf)))
    assert np.all(np.argmax(z, axis=1) == yf)
    return np.argsort(-z, axis=1, kind="stable")[:, restart + 1]


# ---------------------------------------------------------------------------------------------
# Factory and protocol.


def test_factory_defaults_and_equality():
    a = fab()
    assert isinstance(a, Attack) and a.kind == "white-box" and a.goal == "min_norm"
    assert a.name == "fab-t" and a.norm == "linf" and a.num_steps == 100
    assert a.num_restarts == 9 and a.gradients_per_step == 1 and a.gradients == 900
    c = a.config
    assert (c.targeted, c.classes, c.restarts) == (True, 9, 1)
    assert (c.alpha_max, c.eta, c.beta) == (0.1, 1.05, 0.9)
    assert fab("l2", steps=7) == fab("l2", steps=7) != fab("l2", steps=8)
    assert {fab("l2", steps=7): "cached"}.get(fab("l2", steps=7)) == "cached"  # the jit key
    u = fab("l2", targeted=False, targets=5, restarts=3)
    assert u.name == "fab" and u.num_restarts == 3 and u.gradients_per_step == 5
    assert fab(targets=4, restarts=2).num_restarts == 8
    assert fab(name="x").name == "x"
    assert "fab" in attacks.__all__
    for name in ("fab-t", "fab-t3"):
        record = suites.ATTACKS[name]
        assert record.norms == ("linf", "l2") and record.family == "fab"
        assert (record.made().goal, record.made().kind) == ("min_norm", "white-box")


def test_factory_rejects_bad_arguments():
    with pytest.raises(ValueError, match="norm"):
        fab("l3")
    with pytest.raises(ValueError, match="fab supports"):
        fab("l1")
    for kwargs, match in (
        ({"steps": 0}, "steps"),
        ({"targets": 0}, "targets"),
        ({"restarts": 0}, "restarts"),
        ({"alpha_max": 1.5}, "alpha_max"),
        ({"eta": 0.0}, "eta"),
        ({"beta": 0.0}, "beta"),
        ({"beta": 1.1}, "beta"),
    ):
        with pytest.raises(ValueError, match=match):
            fab(**kwargs)


def test_too_many_targets_for_the_model_is_a_trace_time_error():
    _, _, _, model, x, y = _linear(n=4, k=4)
    attack = fab(targets=4)
    with pytest.raises(ValueError, match="at least 5 classes"):
        attack.init(attack.config, None, x, y, None, model, 0)


# The library's conformance suite (tests/test_attacks.py), run on FAB: FAB-T in L2 (several
# runs per target, so random starts too) and untargeted FAB in Linf cover both norms and both
# modes (a third, FAB-T in Linf, ran the same generic checks again: about 15 s).
FAB_ATTACKS = [
    pytest.param(lambda: fab("l2", steps=6, targets=2, restarts=2), "l2", id="fab-t-l2"),
    pytest.param(
        lambda: fab("linf", steps=6, targets=3, targeted=False, restarts=2), "linf", id="fab-linf"
    ),
]


@pytest.mark.parametrize("make, norm", FAB_ATTACKS)
class TestConformance:
    pass


for _name, _test in vars(test_attacks.TestConformance).items():
    if _name.startswith("test_"):
        setattr(TestConformance, _name, _test)


@pytest.mark.parametrize("targeted, classes", [(True, 1), (False, 3)])
def test_gradients_per_step_is_exact(targeted, classes):
    """The step's multiply-adds on a linear model: one forward pass and one backward pass per
    class linearised (1 for FAB-T), nothing else (the projection is elementwise)."""
    params, _, _, model, x, y = _linear(n=16, k=4)
    attack = fab(targets=3, targeted=targeted)
    assert attack.gradients_per_step == classes
    forward, total = step_flops(attack, model, params, x, y)
    assert forward > 0 and total == forward * (1 + attack.gradients_per_step)


def test_targets_are_the_2nd_to_10th_most_likely_classes():
    params, xf, yf, model, x, y = _linear(n=32, k=12, seed=3)
    attack = fab(targets=9)
    # One compiled init per attack (the restart index traced), not op by op per restart.
    run = jax.jit(lambda r: attack.init(attack.config, None, x, y, None, model, r).classes)
    for r in range(9):
        np.testing.assert_array_equal(run(jnp.int32(r))[:, 0], _targets_of(params, xf, yf, r))
    # With several runs per target, runs r*k .. r*k + k - 1 share target r.
    two = fab(targets=3, restarts=2)
    keys = attacks.per_example_keys(KEY, jnp.arange(32))
    eps = jnp.full((32,), 0.1)
    run_two = jax.jit(lambda r: two.init(two.config, keys, x, y, eps, model, r).classes)
    for r in range(6):
        np.testing.assert_array_equal(run_two(jnp.int32(r))[:, 0],
                                      _targets_of(params, xf, yf, r // 2))
    # Under the bundler's vmap over restarts too.
    vm = np.asarray(jax.jit(jax.vmap(run))(jnp.arange(9)))
    for r in range(9):
        np.testing.assert_array_equal(vm[r, :, 0], _targets_of(params, xf, yf, r))


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_random_start_only_after_the_first_run_of_a_target(norm):
    params, xf, yf, model, x, y = _linear(n=16, k=4)
    attack = fab(norm, targets=3, restarts=2)
    eps = jnp.full((16,), 0.04)
    keys = attacks.per_example_keys(KEY, jnp.arange(16))
    first = attack.init(attack.config, keys, x, y, eps, model, jnp.int32(2))
    np.testing.assert_array_equal(first.x, x)
    second = attack.init(attack.config, keys, x, y, eps, model, jnp.int32(3))
    # Distance eps / 2 (the box does not bind at the centre of the toy's box).
    np.testing.assert_allclose(norms.norm(second.x - x, norm), 0.02, rtol=1e-5)
    other = attack.init(
        attack.config, attacks.per_example_keys(jax.random.key(1), jnp.arange(16)), x, y, eps,
        model, jnp.int32(3),
    )
    assert not np.allclose(other.x, second.x)
    # AutoAttack's FAB-T (one run per target) never starts at random.
    plain = fab(norm, targets=3)
    for r in range(3):
        s = plain.init(plain.config, None, x, y, None, model, jnp.int32(r))
        np.testing.assert_array_equal(s.x, x)


# ---------------------------------------------------------------------------------------------
# The box-constrained minimal-norm projection.


def _brute_force_min(t, w, r, norm, rng, samples=20000):
    """The smallest norm of ``z - t`` over sampled points ``z`` of the box with
    ``w . (z - t) = r``: random box points moved along ``w`` onto the hyperplane, plus the
    hyperplane's crossings of the box's edges; ``inf`` if none is feasible."""
    dim = t.shape[0]
    pts = rng.uniform(0.0, 1.0, size=(samples, dim))
    pts = pts + np.outer(r - (pts - t) @ w, w) / (w @ w)
    corners = np.array(np.meshgrid(*[[0.0, 1.0]] * dim, indexing="ij")).reshape(dim, -1).T
    edges = []
    for free in range(dim):
        if abs(w[free]) > 1e-9:
            for c in corners:
                z = c.copy()
                rest = np.delete(w, free) @ (np.delete(c, free) - np.delete(t, free))
                z[free] = t[free] + (r - rest) / w[free]
                edges.append(z)
    pts = np.concatenate([pts] + ([np.array(edges)] if edges else []))
    inside = np.all((pts >= -1e-9) & (pts <= 1 + 1e-9), axis=1)
    if not inside.any():
        return np.inf
    return np.linalg.norm(pts[inside] - t, ord=np.inf if norm == "linf" else 2, axis=1).min()


_project = jax.jit(project_hyperplane, static_argnames="norm")


@given(
    dim=st.sampled_from([2, 3]),
    norm=st.sampled_from(["linf", "l2"]),
    seed=st.integers(0, 2**31 - 1),
    snap=st.booleans(),
    sparse=st.booleans(),
)
def test_projection_is_the_box_constrained_minimum(dim, norm, seed, snap, sparse):
    rng = np.random.default_rng(seed)
    t = rng.uniform(0.0, 1.0, size=dim)
    if snap:  # points on the box's faces
        t = np.where(rng.uniform(size=dim) < 0.5, np.round(t), t)
    w = rng.normal(size=dim)
    if sparse:  # zero coordinates of w (one at least stays)
        w[rng.integers(dim)] = 0.0
        w[rng.integers(dim)] = rng.normal()
    t32, w32 = t.astype(np.float32), w.astype(np.float32)
    t, w = t32.astype(np.float64), w32.astype(np.float64)
    s = rng.choice([-1.0, 1.0])
    reach = np.sum(np.abs(w) * np.where(s * w > 0, 1.0 - t, t))  # the most s w . d allowed
    r = s * rng.uniform(0.0, 1.2) * reach  # about one in six out of the box's reach
    d = np.asarray(_project(jnp.asarray(t32[None]), jnp.asarray(w32[None]),
                            jnp.asarray([r], jnp.float32), norm=norm), np.float64)[0]
    z = t + d
    assert np.all(z >= -1e-6) and np.all(z <= 1 + 1e-6), "outside the box"
    scale = 1e-5 * max(1.0, np.abs(w).sum())
    if reach < abs(r) - scale:  # the box misses the hyperplane: the corner towards it
        np.testing.assert_allclose(s * (w @ d), reach, atol=scale)
        return
    assert abs(w @ d - r) <= scale, "not on the hyperplane"
    ours = np.linalg.norm(d, ord=np.inf if norm == "linf" else 2)
    best = _brute_force_min(t, w, r, norm, rng)
    assert ours <= best + 1e-5, f"a feasible point of smaller norm exists: {best} < {ours}"


def test_projection_without_the_box_is_the_closed_form_and_rows_are_independent():
    rng = np.random.default_rng(0)
    t = rng.uniform(0.45, 0.55, size=(8, 30)).astype(np.float32)
    w = rng.normal(size=(8, 30)).astype(np.float32)
    r = (rng.uniform(-0.02, 0.02, size=8) * np.abs(w).sum(1)).astype(np.float32)
    d_inf = np.asarray(_project(jnp.asarray(t), jnp.asarray(w), jnp.asarray(r), norm="linf"))
    expected = (r / np.abs(w).sum(1))[:, None] * np.sign(w)
    np.testing.assert_allclose(d_inf, expected, rtol=1e-4, atol=1e-7)
    d_2 = np.asarray(_project(jnp.asarray(t), jnp.asarray(w), jnp.asarray(r), norm="l2"))
    np.testing.assert_allclose(d_2, (r / (w * w).sum(1))[:, None] * w, rtol=1e-4, atol=1e-7)
    one = np.asarray(_project(jnp.asarray(t[3:4]), jnp.asarray(w[3:4]), jnp.asarray(r[3:4]),
                              norm="l2"))
    np.testing.assert_allclose(one[0], d_2[3], rtol=1e-6, atol=1e-8)
    zero = _project(jnp.asarray(t), jnp.zeros_like(jnp.asarray(w)), jnp.asarray(r), norm="linf")
    assert np.all(np.asarray(zero) == 0.0)


# ---------------------------------------------------------------------------------------------
# Linear models: the analytic answers and the reference's iteration.


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_one_step_lands_on_the_pair_boundary(norm):
    """From x0 both projections coincide: with eta = 1 one step lands exactly on the boundary
    of y and the target, at their analytic distance; with eta = 1.05, 5% beyond it."""
    params, xf, yf, model, x, y = _linear(n=32, k=4, seed=2, spread=0.1, centred=True)
    rows = np.arange(32)
    for eta in (1.0, 1.05):
        xs, _ = _trajectories(fab(norm, targets=3, eta=eta), model, x, y, 1, restarts=3)
        for r in range(3):
            target = _targets_of(params, xf, yf, r)
            dist = _pair_distance(params, xf, yf, target, norm)
            keep = dist > 1e-3
            assert keep.sum() >= 24
            x1 = jnp.asarray(xs[r, 1])
            moved = np.asarray(norms.norm(x1 - x, norm))
            np.testing.assert_allclose(moved[keep], eta * dist[keep], rtol=1e-4)
            if eta == 1.0:
                z = np.asarray(model.logits(x1))
                np.testing.assert_allclose(z[rows, target], z[rows, yf], atol=1e-4)


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_untargeted_first_step_lands_on_the_nearest_boundary(norm):
    params, xf, yf, model, x, y = _linear(n=32, k=4, seed=2, spread=0.1, centred=True)
    xs, _ = _trajectories(fab(norm, targets=3, eta=1.0, targeted=False), model, x, y, 1, 1)
    dist = min_distance(params, xf, yf, norm)
    keep = dist > 1e-3
    moved = np.asarray(norms.norm(jnp.asarray(xs[0, 1]) - x, norm))
    np.testing.assert_allclose(moved[keep], dist[keep], rtol=1e-4)


def _reference_iterates(params, x0, y, target, norm, steps, alpha_max=0.1, eta=1.05, beta=0.9):
    """The reference's FAB-T loop (fab_base.py), rewritten in float64 for a linear model with
    the box-free projection (asserted not to leave the box): per iteration a gradient at ``x``,
    the biased step to ``x_new``, a forward pass on ``x_new`` and, if misclassified, the record
    and the step back. Returns every ``x_new`` and the best distance after each iteration."""
    w = np.asarray(params["w"], np.float64)
    b = np.asarray(params["b"], np.float64)
    rows = np.arange(len(y))
    g = (w[:, target] - w[:, y]).T  # grad of z_t - z_y, constant
    ord_ = np.inf if norm == "linf" else 2

    def proj(f):  # minimal step from a point of value f to {z : f + g . (z - point) = 0}
        if norm == "linf":
            return (-f / np.abs(g).sum(1))[:, None] * np.sign(g)
        return (-f / (g * g).sum(1))[:, None] * g

    x, best, news, bests = x0.copy(), np.full(len(y), np.inf), [], []
    for _ in range(steps):
        z = x @ w + b
        f = z[rows, target] - z[rows, y]
        d1, d2 = proj(f), proj(f + ((x0 - x) * g).sum(1))
        for d, t in ((d1, x), (d2, x0)):
            assert np.all(t + d > 0) and np.all(t + d < 1), "the box binds"
        a1 = np.maximum(np.linalg.norm(d1, ord=ord_, axis=1), 1e-8)
        a2 = np.maximum(np.linalg.norm(d2, ord=ord_, axis=1), 1e-8)
        alpha = np.clip(a1 / (a1 + a2), 0.0, alpha_max)[:, None]
        x = np.clip((1 - alpha) * (x + eta * d1) + alpha * (x0 + eta * d2), 0.0, 1.0)
        news.append(x.copy())
        adv = np.argmax(x @ w + b, axis=1) != y
        dist = np.linalg.norm(x - x0, ord=ord_, axis=1)
        best = np.where(adv & (dist < best), dist, best)
        bests.append(best.copy())
        x = np.where(adv[:, None], x0 + beta * (x - x0), x)
    return news, bests


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_iterates_are_the_references_on_a_linear_model(norm, fresh):
    """Checking x_new with the next step's forward pass (and linearising there) is the
    reference's iteration exactly where the gradient is constant; so is the reference's own
    order (``fresh_gradient``: a fresh gradient at the point moved back)."""
    params, xf, yf, model, x, y = _linear(n=32, k=4, seed=4, spread=0.1, centred=True)
    steps = 12
    attack = fab(norm, targets=3, fresh_gradient=fresh)
    xs, best = _trajectories(attack, model, x, y, steps + 1, restarts=3)
    for r in range(3):
        target = _targets_of(params, xf, yf, r)
        dist = _pair_distance(params, xf, yf, target, norm)
        news, bests = _reference_iterates(params, xf.astype(np.float64), yf, target, norm, steps)
        for k in range(steps):
            np.testing.assert_allclose(xs[r, k + 1].reshape(32, -1), news[k], atol=1e-6)
            # After step k + 2 the iterate of reference iteration k is checked (the start,
            # checked by step 1, is never adversarial here).
            np.testing.assert_allclose(best[r, k + 2], bests[k], rtol=1e-5, atol=1e-7)
        assert np.all(np.isfinite(bests[-1]))
        # The linear dynamics settle about 0.5% beyond the pair's boundary.
        keep = dist > 1e-3
        assert np.all(best[r, -1][keep] >= dist[keep] * (1 - 1e-4))
        assert np.all(best[r, -1][keep] <= dist[keep] * 1.01)


def test_the_orders_differ_where_the_gradient_does():
    """On a network the gradient at the point moved back is not the iterate's: the reference's
    order (``fresh_gradient``) takes its own path after the first step back."""
    rng = np.random.default_rng(0)
    v = jnp.asarray(rng.normal(size=(12, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)
    net = WhiteBoxModel(lambda p, x: jnp.tanh(x.reshape(x.shape[0], -1) @ p[0]) @ p[1], (v, w))
    x = jnp.asarray(rng.uniform(0.3, 0.7, size=(16, 3, 4, 1)), jnp.float32)
    y = jnp.argmax(net.logits(x), axis=1).astype(jnp.int32)
    paths = [_trajectories(fab("l2", targets=2, fresh_gradient=f), net, x, y, 8, restarts=2)
             for f in (False, True)]
    (xs, best), (xs_fresh, best_fresh) = paths
    stepped_back = np.isfinite(best[:, 1:-1]).any(axis=(0, 1))  # rows with a step back
    assert stepped_back.sum() >= 4
    np.testing.assert_allclose(xs[:, :2], xs_fresh[:, :2], atol=1e-6)  # before any step back
    moved = np.abs(xs - xs_fresh).reshape(*xs.shape[:3], -1).max(-1) > 1e-4  # [R, T, B]
    assert moved.any(axis=(0, 1))[stepped_back].all()
    assert not moved.any(axis=(0, 1))[~stepped_back].any()


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_fab_t_finds_the_analytic_minimum(norm):
    """Over its targets FAB-T's best distortion is the analytic minimal distance within 1%
    after 20 steps (eta = 1.05 keeps each recorded point a little beyond the boundary), and
    its success within eps is exactly where that distance fits."""
    params, xf, yf, _, x, y = _linear(n=100, k=4, seed=1, spread=0.1, centred=True)
    dist = min_distance(params, xf, yf, norm)
    eps = float(np.median(dist))
    r = bundle(
        [fab(norm, steps=20, targets=3)], linear_apply, params, x, y, KEY, eps=eps, norm=norm,
        judging="float",
    )
    best = r.best["min_norm"].score
    assert np.all(np.asarray(best.misclassified))
    keep = dist > 1e-3
    assert keep.sum() >= 80
    ratio = np.asarray(best.distortion)[keep] / dist[keep]
    assert ratio.min() >= 1 - 1e-4 and ratio.max() <= 1.01
    success = np.asarray(r.attack_success[0])
    assert np.all(success[dist * 1.01 < eps]) and not np.any(success[dist > eps * (1 + 1e-4)])


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_sound_and_in_the_box_where_the_box_binds(norm):
    """Images spread over the box: the box binds, every iterate stays in it, and no result
    beats the box-free analytic minimum."""
    params, xf, yf, model, x, y = _linear(n=32, k=4, seed=5, spread=0.5)
    attack = fab(norm, steps=15, targets=3)
    xs, best = _trajectories(attack, model, x, y, 15, restarts=3)
    assert xs.min() >= 0.0 and xs.max() <= 1.0
    assert np.any(xs[:, 1:] == 0.0) or np.any(xs[:, 1:] == 1.0)
    smallest = best[:, -1].min(axis=0)  # over the targets
    found = np.isfinite(smallest)
    dist = min_distance(params, xf, yf, norm)
    assert found.mean() > 0.9
    assert np.all(smallest[found] >= dist[found] * (1 - 1e-4))


# ---------------------------------------------------------------------------------------------
# A convolutional network.


def _against_fgsm(apply_fn, params, x, y, eps, steps):
    r = bundle(
        [attacks.fgsm("linf"), fab("linf", steps=steps)], apply_fn, params, x, y, KEY, eps=eps,
        norm="linf", goals=("min_norm",),
    )
    success = np.asarray(r.attack_success)
    distortion = np.asarray(r.attack_distortion)
    fooled = success[0]
    assert fooled.any()
    # Wherever FGSM succeeds, FAB-T does too, with no more distortion; and it succeeds as often.
    assert np.all(success[1][fooled])
    assert np.all(distortion[1][fooled] <= distortion[0][fooled] + 1e-6)
    assert success[1].sum() >= success[0].sum()
    return r


@pytest.mark.slow
def test_on_a_small_cnn():
    """The demo models' small CNN, untrained: the module (and so the compiled bundle, FAB-T's
    20 steps included) of the trained one below, other weights."""
    from jaxbundle import data, models

    test = data.load_mnist_sample("test", n=16)
    module = models.model_for(models.MODELS["adversarial"])
    params = module.init(jax.random.key(0), test.x[:1])
    z = module.apply(params, test.x)
    y = np.asarray(jnp.argmax(z, axis=1)).astype(np.int32)  # its own predictions: all correct
    r = _against_fgsm(module.apply, params, test.x, jnp.asarray(y), 0.03, steps=20)
    assert np.asarray(r.best["min_norm"].score.misclassified).all()


@pytest.mark.slow
def test_on_the_adversarially_trained_demo_cnn():
    from jaxbundle import data

    test = data.load_mnist_sample("test", n=16)
    apply_fn, params = quick_demo_model("adversarial")
    r = _against_fgsm(apply_fn, params, test.x, test.y, 0.3, steps=20)
    assert np.asarray(r.attack_distortion)[1].max() < np.inf  # a result for every image


def _water_level_reference(c, level, need):
    """The water level by sorting the breakpoints, in float64 (numpy)."""
    order = np.argsort(level, axis=1, kind="stable")
    b = np.take_along_axis(level, order, axis=1)
    w = np.take_along_axis(c, order, axis=1)
    below = np.cumsum(w * b, axis=1) - w * b
    tail = np.cumsum(w[:, ::-1], axis=1)[:, ::-1]
    reached = below + b * tail
    k = np.minimum(np.sum(reached < need[:, None], axis=1), b.shape[1] - 1)
    rows = np.arange(len(k))
    return np.maximum(need - below[rows, k], 0.0) / np.maximum(tail[rows, k], 1e-300)


@pytest.mark.parametrize("dim", [784, 3072])
def test_the_water_level_found_by_bisection_is_the_sorted_one(dim):
    """At image sizes, with ties, zero weights and levels at 0 and 1 (pixels on the box's
    faces), the bisection's level equals the sort's (float64) to float32 rounding."""
    from jaxbundle.attacks.white_box.fab import _water_level

    rng = np.random.default_rng(dim)
    c = np.abs(rng.normal(size=(64, dim))).astype(np.float32)
    c[:, ::7] = 0.0
    level = rng.uniform(size=(64, dim)).astype(np.float32)
    level[:, ::5] = np.round(level[:, ::5])
    level[:, 1::11] = level[:, 1:2]  # ties
    total = np.sum(c.astype(np.float64) * level, axis=1)
    need = (total * rng.uniform(0.0, 1.0, size=64)).astype(np.float32)
    need[:4] = [0.0, total[1] * 0.999999, 1e-7, total[3] * 1e-4]
    lam, feasible = jax.jit(_water_level)(jnp.asarray(c), jnp.asarray(level), jnp.asarray(need))
    assert np.asarray(feasible).all()
    expected = _water_level_reference(c.astype(np.float64), level.astype(np.float64),
                                      need.astype(np.float64))
    np.testing.assert_allclose(np.asarray(lam), expected, rtol=2e-5, atol=1e-7)
    over = jnp.asarray(total * 1.01, jnp.float32)  # beyond every level: saturated, infeasible
    lam, feasible = _water_level(jnp.asarray(c), jnp.asarray(level), over)
    assert not np.asarray(feasible).any()
    np.testing.assert_array_equal(np.asarray(lam), level.max(1))
