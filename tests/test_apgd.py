"""APGD: the paper's schedule, targets as the restart axis, and linear-model oracles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import attacks, norms
from jaxbundle.attacks.base import WhiteBoxModel
from jaxbundle.attacks.white_box import apgd as apgd_lib
from jaxbundle.bundler import bundle
from attack_checks import assert_refused
from toys import KEY, images, linear_apply, linear_problem, min_distance



def test_checkpoints_follow_the_paper():
    # p = 0, .22, .41, .57, .70, .80, .87, .93, .99 (Croce & Hein 2020, section 3.2).
    assert apgd_lib.checkpoints(100) == (22, 41, 57, 70, 80, 87, 93, 99)
    assert apgd_lib.checkpoints(1000)[:4] == (220, 410, 570, 700)
    assert apgd_lib.checkpoints(1) == ()


def test_factory_names_restarts_and_validation():
    assert attacks.apgd().name == "apgd-ce"
    assert attacks.apgd(loss="dlr").name == "apgd-dlr"
    t = attacks.apgd(loss="dlr-targeted", targets=9)
    assert t.name == "apgd-t" and t.num_restarts == 9 and t.gradients == 900
    assert attacks.apgd(restarts=3).num_restarts == 3
    assert_refused(attacks.apgd, [
        (("l1",), "norm"), (dict(loss="hinge"), "loss"), (dict(steps=0), "steps"),
        (dict(loss="dlr-targeted", restarts=2), "targets, not restarts"),
    ])


def _binary_problem(n=32):
    params, x, y = linear_problem(n=n, k=2, seed=11)
    return params, images(x), jnp.asarray(y)


def _run(attack, model, x, y, eps, restart=0):
    """The state after init and all the attack's steps, in one program."""

    @jax.jit
    def run(keys):
        state = attack.init(attack.config, keys, x, y, eps, model, restart)
        step = lambda _, s: attack.step(attack.config, s, model)[0]  # noqa: E731
        return jax.lax.fori_loop(0, attack.num_steps, step, state)

    return run(attacks.per_example_keys(KEY, jnp.arange(x.shape[0])))


def test_step_size_halves_at_every_checkpoint_once_the_optimum_is_reached():
    """A binary linear model's CE is maximised at a corner of the Linf ball, which the first
    (eta = 2 eps) sign step reaches; the loss never rises again, so condition 1 halves eta at
    every checkpoint, and x_best is that corner."""
    params, x, y = _binary_problem()
    model = WhiteBoxModel(linear_apply, params)
    eps = jnp.full(y.shape, 0.02, jnp.float32)
    attack = attacks.apgd("linf", steps=30)
    state = _run(attack, model, x, y, eps)
    halvings = len(apgd_lib.checkpoints(30))
    np.testing.assert_allclose(state.eta, 2 * 0.02 / 2**halvings, rtol=1e-6)
    w = np.asarray(params["w"])
    yy = np.asarray(y)
    direction = np.sign(w[:, 1 - yy] - w[:, yy]).T.reshape(x.shape)
    corner = np.clip(np.asarray(x) + 0.02 * direction, 0, 1)
    np.testing.assert_allclose(state.x_best, corner, atol=1e-6)
    assert np.all(np.asarray(state.increases) == 0)


def test_targets_are_the_ranked_other_classes():
    params, x, y = linear_problem(n=16, k=6, seed=2)
    model = WhiteBoxModel(linear_apply, params)
    x, y = images(x), jnp.asarray(y)
    attack = attacks.apgd(loss="dlr-targeted", targets=5, steps=2)
    keys = attacks.per_example_keys(KEY, jnp.arange(16))
    logits = np.asarray(model.logits(x))
    order = np.argsort(-logits, axis=1)  # the label is the top class (clean predictions)
    # One compiled init, the restart traced (not op by op per restart).
    target = jax.jit(
        lambda r: attack.init(attack.config, keys, x, y, jnp.full((16,), 0.1), model, r).target)
    for r in range(5):
        np.testing.assert_array_equal(target(jnp.int32(r)), order[:, r + 1])


def test_too_many_targets_for_the_model_is_a_clear_error():
    params, x, y = linear_problem(n=4, k=4)
    with pytest.raises(ValueError, match="needs at least 10 classes"):
        bundle([attacks.apgd(loss="dlr-targeted", targets=9, steps=2)], linear_apply, params,
               images(x), jnp.asarray(y), KEY, eps=0.1)


def _linear_success(attack, norm, seed=4):
    params, x, y = linear_problem(n=96, k=4, seed=seed)
    dist = min_distance(params, x, y, norm)
    eps = float(np.median(dist))
    r = bundle([attack], linear_apply, params, images(x), jnp.asarray(y), KEY, eps=eps,
               norm=norm, judging="float")
    assert np.all(np.asarray(norms.in_ball(r.best["misclassify"].x - images(x), eps, norm)))
    return np.asarray(r.attack_success[0]), dist, eps


# Every loss in Linf; in L2 one untargeted and one targeted loss: the losses are computed on
# the logits, whatever the norm, and the norm's step on their gradient, whatever the loss (the
# other two L2 cases compiled two more bundles for no other code).
@pytest.mark.parametrize("norm, loss", [
    ("linf", "ce"), ("linf", "dlr"), ("linf", "dlr-targeted"), ("linf", "ce-targeted"),
    ("l2", "ce"), ("l2", "dlr-targeted")])
def test_linear_oracle_succeeds_exactly_below_the_minimal_distance(norm, loss):
    """A fixed-budget attack on a linear model: fooled iff the analytic distance < eps (the
    examples within 3% of eps either way are left out: that is the budget's resolution).

    Untargeted margin-like losses have local maxima on the sphere (one per wrong class), so
    they get 5 random restarts; the targeted versions try every wrong class (3 targets)."""
    attack = attacks.apgd(norm, loss=loss, steps=50, targets=3,
                          restarts=1 if loss.endswith("targeted") else 5)
    fooled, dist, eps = _linear_success(attack, norm)
    assert not np.any(fooled[dist > 1.03 * eps])
    assert fooled[dist < 0.97 * eps].mean() >= 0.97


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_apgd_beats_pgd_with_the_same_budget(norm):
    """Measured on this toy (50 steps, one run): APGD-CE 1.00 vs PGD-CE 0.62 (L2) and
    0.86 (Linf) of the examples fooled below the analytic distance."""
    apgd_fooled, dist, eps = _linear_success(attacks.apgd(norm, loss="ce", steps=50), norm)
    pgd_fooled, _, _ = _linear_success(attacks.pgd(norm, loss="ce", steps=50), norm)
    inside = dist < 0.97 * eps
    assert apgd_fooled[inside].mean() >= 0.97
    assert apgd_fooled[inside].mean() >= pgd_fooled[inside].mean() + 0.1


# --- Issue 14: the reference implementation (fra31/auto-attack, autopgd_base.py) ---------------


def test_checkpoints_follow_the_reference_loop():
    """autopgd_base.py checks at ``counter3 == k``, starting from ``k = max(int(0.22 N), 1)`` and
    then ``k = max(k - max(int(0.03 N), 1), max(int(0.06 N), 1))``; derived by hand:

    N = 20:  k = 4, 3, 2, 1, 1, ...       (int(4.4) = 4, int(1.2) = 1, int(0.6) -> 1)
    N = 50:  k = 11, 10, 9, 8, 7, 6       (int(11.0) = 11, int(3.0) = 3, int(1.5) = 1)
    N = 100: k = 22, 19, 16, 13, 10, 7, 6, 6  (22, 6, 3)
    and the running sums below N (a check at N itself follows the last evaluation)."""
    assert apgd_lib.checkpoints(20) == (4, 7, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19)
    assert apgd_lib.checkpoints(50) == (11, 21, 30, 38, 45)
    assert apgd_lib.checkpoints(100) == (22, 41, 57, 70, 80, 87, 93, 99)
    assert attacks.apgd(steps=20).config.checkpoints == apgd_lib.checkpoints(20)
    assert attacks.apgd(steps=50).config.schedule == "reference"


def test_the_paper_schedule_stays_reachable():
    # ceil(p_j N), p = .22, .41, .57, .70, .80, .87, .93, .99: at N = 20 4.4 -> 5, 8.2 -> 9,
    # 11.4 -> 12, 14, 16, 17.4 -> 18, 18.6 -> 19 (19.8 -> 20 is not inside); at N = 50 11, 20.5
    # -> 21, 28.5 -> 29, 35, 40, 43.5 -> 44, 46.5 -> 47.
    assert apgd_lib.checkpoints(20, "paper") == (5, 9, 12, 14, 16, 18, 19)
    assert apgd_lib.checkpoints(50, "paper") == (11, 21, 29, 35, 40, 44, 47)
    paper = attacks.apgd(steps=20, schedule="paper")
    assert paper.config.checkpoints == (5, 9, 12, 14, 16, 18, 19)
    assert paper.config.schedule == "paper"
    with pytest.raises(ValueError, match="schedule"):
        attacks.apgd(schedule="fast")


def test_alpha_is_the_weight_of_the_new_step():
    """The paper's ``a = 0.75`` multiplies ``z - x^k``: the config field says so by name."""
    config = attacks.apgd().config
    assert config.alpha == 0.75
    assert "momentum" not in apgd_lib.APGDConfig._fields


def _state_at(attack, model, clean, y, eps, **fields):
    keys = attacks.per_example_keys(KEY, jnp.arange(clean.shape[0]))
    state = attack.init(attack.config, keys, clean, y, eps, model, 0)
    return state._replace(**fields)


def _offsets(seed, shape, scale):
    return jnp.asarray(np.random.default_rng(seed).uniform(-scale, scale, shape), jnp.float32)


def test_a_restart_from_the_best_point_keeps_the_momentum():
    """Where eta halves at a checkpoint, the next iterate is stepped from x_max with the
    momentum ``x_max - x^{k-1}`` (the reference resets x_adv, not x_adv_old), and with a = alpha:
    ``P(x_max + a (z - x_max) + (1 - a)(x_max - x^{k-1}))``, ``z = P(x_max + eta/2 sign(g_max))``.
    """
    params, x0, y = linear_problem(n=8, k=4, seed=5)
    x0, y = images(x0), jnp.asarray(y)
    model = WhiteBoxModel(linear_apply, params)
    eps = jnp.full(y.shape, 0.1, jnp.float32)
    attack = attacks.apgd("linf", steps=20)
    w = attack.config.checkpoints[0]
    x_best = x0 + _offsets(1, x0.shape, 0.03)
    x_prev = x0 + _offsets(2, x0.shape, 0.05)
    g_best = _offsets(3, x0.shape, 1.0)
    state = _state_at(
        attack, model, x0, y, eps, k=jnp.full(y.shape, w, jnp.int32),
        x=x0 + _offsets(4, x0.shape, 0.1), x_prev=x_prev, x_best=x_best, grad_best=g_best,
        loss_best=jnp.full(y.shape, 1e9), loss_prev=jnp.full(y.shape, jnp.inf),
        increases=jnp.zeros(y.shape, jnp.int32), eta=jnp.full(y.shape, 0.02),
    )
    new, _ = attack.step(attack.config, state, model)
    np.testing.assert_allclose(new.eta, 0.01, rtol=1e-6)  # it did halve
    proj = lambda v: np.clip(np.clip(v, x0 - 0.1, x0 + 0.1), 0, 1)  # noqa: E731
    z = proj(np.asarray(x_best) + 0.01 * np.sign(np.asarray(g_best)))
    expected = proj(x_best + 0.75 * (z - x_best) + 0.25 * (x_best - x_prev))
    np.testing.assert_allclose(new.x, expected, atol=1e-6)
    np.testing.assert_allclose(new.x_prev, x_best, atol=0)
    # Dropping it (keep_momentum=False) is the old behaviour: the step from x_max alone.
    old = attack._replace(config=attack.config._replace(keep_momentum=False))
    dropped, _ = old.step(old.config, state, model)
    np.testing.assert_allclose(dropped.x, proj(x_best + 0.75 * (z - x_best)), atol=1e-6)


@pytest.mark.parametrize("schedule, halves", [("reference", True), ("paper", False)])
def test_condition_one_at_exactly_rho_of_the_window(schedule, halves):
    """At 100 steps both schedules check at 57, closing a window of 16 iterations; with 12 = 0.75
    * 16 increases the reference halves (``t <= k * k3``) and the paper does not (``< rho``)."""
    params, x0, y = linear_problem(n=8, k=4, seed=5)
    x0, y = images(x0), jnp.asarray(y)
    model = WhiteBoxModel(linear_apply, params)
    kwargs = {"schedule": schedule} if schedule == "paper" else {}
    attack = attacks.apgd("linf", steps=100, **kwargs)
    eps = jnp.full(y.shape, 0.1, jnp.float32)
    state = _state_at(
        attack, model, x0, y, eps, k=jnp.full(y.shape, 57, jnp.int32),
        increases=jnp.full(y.shape, 11, jnp.int32), loss_prev=jnp.full(y.shape, -jnp.inf),
        loss_best=jnp.full(y.shape, 1e9), halved_at_check=jnp.ones(y.shape, bool),
        eta=jnp.full(y.shape, 0.02),
    )
    new, _ = attack.step(attack.config, state, model)
    np.testing.assert_allclose(new.eta, 0.01 if halves else 0.02, rtol=1e-6)


@pytest.mark.parametrize("schedule, halves", [("reference", False), ("paper", True)])
def test_condition_two_at_the_first_checkpoint(schedule, halves):
    """No improvement over f(x^0) by w_1: the paper's condition 2 (w_0 = 0, eta unchanged) halves;
    the reference starts with ``reduced_last_check = 1`` and does not check it there."""
    params, x0, y = linear_problem(n=8, k=4, seed=5)
    x0, y = images(x0), jnp.asarray(y)
    model = WhiteBoxModel(linear_apply, params)
    attack = attacks.apgd("linf", steps=20, schedule=schedule)
    w = attack.config.checkpoints[0]
    eps = jnp.full(y.shape, 0.1, jnp.float32)
    state = _state_at(attack, model, x0, y, eps)
    state, _ = attack.step(attack.config, state, model)  # x^0: f_max at w_0 = 0
    state = state._replace(k=jnp.full(y.shape, w, jnp.int32),
                           increases=jnp.full(y.shape, w, jnp.int32),
                           loss_best=state.loss_best_at_check, loss_prev=jnp.full(y.shape, jnp.inf))
    state = state._replace(x=state.x_best)  # the loss there is f_max: no improvement
    new, _ = attack.step(attack.config, state, model)
    np.testing.assert_allclose(new.eta, state.eta * (0.5 if halves else 1.0), rtol=1e-6)


def test_eta_halves_exactly_at_the_reference_checkpoints():
    """The binary linear toy reaches its optimum at x^1 and stays: every window but the first
    has no increase (the first has one, f(x^1) > 0, the reference's ``loss_steps[-1]``), so
    eta halves at each of the reference's checkpoints at 20 steps, and nowhere else."""
    params, x, y = _binary_problem()
    model = WhiteBoxModel(linear_apply, params)
    eps = jnp.full(y.shape, 0.02, jnp.float32)
    attack = attacks.apgd("linf", steps=20)
    keys = attacks.per_example_keys(KEY, jnp.arange(x.shape[0]))
    state = attack.init(attack.config, keys, x, y, eps, model, 0)
    step = jax.jit(lambda s: attack.step(attack.config, s, model))
    halved_at = []
    for k in range(20):
        eta = np.asarray(state.eta)
        state, _ = step(state)
        if np.all(np.asarray(state.eta) == eta / 2):
            halved_at.append(k)
        else:
            np.testing.assert_array_equal(state.eta, eta)
    assert tuple(halved_at) == (4, 7, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19)


def _mlp_problem(seed=3, n=24, d=20, hidden=16, k=4):
    rng = np.random.default_rng(seed)
    params = {"w1": jnp.asarray(rng.normal(size=(d, hidden)) / np.sqrt(d) * 6, jnp.float32),
              "b1": jnp.asarray(rng.normal(size=(hidden,)), jnp.float32),
              "w2": jnp.asarray(rng.normal(size=(hidden, k)), jnp.float32)}
    x = jnp.asarray(rng.uniform(0.3, 0.7, size=(n, d)), jnp.float32).reshape(n, 4, 5, 1)
    apply = lambda p, v: jnp.tanh(v.reshape(v.shape[0], -1) @ p["w1"] + p["b1"][None, :]) @ p["w2"]  # noqa: E731
    y = jnp.argmax(apply(params, x), -1).astype(jnp.int32)
    return apply, params, x, y


def _reference_loop(model, x0, x_start, y, eps, n_iter, norm, rho=0.75):
    """The Linf/L2 loop of ``APGDAttack.attack_single_run`` (fra31/auto-attack), rewritten here
    with NumPy bookkeeping: a gradient at x^0, then ``n_iter`` iterations, each a momentum step
    from ``x_adv`` with ``grad2 = x_adv - x_adv_old``, a gradient at the new point, and at
    ``counter3 == k`` the oscillation test over ``loss_steps`` (index -1 wraps to a zero), the
    no-improvement test, halving with ``x_adv, grad <- x_best, grad_best`` (not
    ``x_adv_old``), and ``k <- max(k - size_decr, n_iter_min)``. Returns x^0, ..., x^n_iter and
    the step size of the last iteration (a check after it would change nothing)."""
    loss_grad = jax.jit(lambda v: model.loss_and_grad(
        lambda lg, yy, t: apgd_lib.losses.cross_entropy(lg, yy), v, y, y)[:2])
    proj = lambda v: np.asarray(norms.project(jnp.asarray(v), x0, eps, norm))  # noqa: E731
    direction = lambda g: np.asarray(norms.normalize(jnp.asarray(g), norm))  # noqa: E731
    col = lambda v: np.asarray(v).reshape((-1,) + (1,) * (x0.ndim - 1))  # noqa: E731
    x = np.asarray(x_start)
    loss, grad = map(np.asarray, loss_grad(x))
    x_best, grad_best, loss_best = x.copy(), grad.copy(), loss.copy()
    step_size = 2.0 * np.asarray(eps)
    x_old = x.copy()
    k = max(int(0.22 * n_iter), 1)
    n_iter_min, size_decr = max(int(0.06 * n_iter), 1), max(int(0.03 * n_iter), 1)
    counter3 = 0
    loss_steps = np.zeros((n_iter, len(y)), x.dtype)
    loss_best_last_check = loss_best.copy()
    reduced_last_check = np.ones(len(y), bool)
    xs = [x]
    for i in range(n_iter):
        last_step_size = step_size
        grad2, x_old = x - x_old, x
        a = 0.75 if i > 0 else 1.0
        z = proj(x + col(step_size) * direction(grad))
        x = proj(x + (z - x) * a + grad2 * (1 - a))
        xs.append(x)
        loss, grad = map(np.asarray, loss_grad(x))
        loss_steps[i] = loss
        better = loss > loss_best
        x_best = np.where(col(better), x, x_best)
        grad_best = np.where(col(better), grad, grad_best)
        loss_best = np.where(better, loss, loss_best)
        counter3 += 1
        if counter3 == k:
            ups = sum((loss_steps[i - c] > loss_steps[i - c - 1]).astype(np.float32)
                      for c in range(k))
            halve = (ups <= k * rho) | (~reduced_last_check & (loss_best_last_check >= loss_best))
            reduced_last_check, loss_best_last_check = halve, loss_best.copy()
            step_size = np.where(halve, step_size / 2, step_size)
            x = np.where(col(halve), x_best, x)
            grad = np.where(col(halve), grad_best, grad)
            k = max(k - size_decr, n_iter_min)
            counter3 = 0
    return xs, last_step_size


# Float32 for Linf (the iterates agree exactly); float64 for L2, whose float32 iterates drift
# apart by ~1e-4 after a dozen steps (one rounding-level difference amplified: in float64 both
# loops agree to ~1e-14 at every iterate).
@pytest.mark.parametrize("norm, eps, dtype, atol", [
    ("linf", 0.1, jnp.float32, 2e-5), ("l2", 0.5, jnp.float64, 1e-10),
    ("l2", 1.0, jnp.float64, 1e-10)])
@pytest.mark.parametrize("steps", [20, 50])
def test_iterates_match_the_reference_loop(norm, eps, dtype, atol, steps):
    """APGD-CE on a small tanh network follows the reference's loop iterate for iterate, from
    the same x^0: x^0 ... x^{N-1} (where it takes its N gradients) and x^N (its last state)."""
    with jax.enable_x64(dtype == jnp.float64):
        apply, params, x0, y = _mlp_problem()
        params, x0 = jax.tree.map(lambda a: a.astype(dtype), (params, x0))
        model = WhiteBoxModel(apply, params)
        eps = jnp.full(y.shape, eps, dtype)
        attack = attacks.apgd(norm, steps=steps)
        keys = attacks.per_example_keys(KEY, jnp.arange(x0.shape[0]))
        state = attack.init(attack.config, keys, x0, y, eps, model, 0)
        ref, ref_eta = _reference_loop(model, x0, state.x, y, eps, steps, norm)
        step = jax.jit(lambda s: attack.step(attack.config, s, model))
        ours = []
        for _ in range(steps):
            ours.append(np.asarray(state.x))
            state, _ = step(state)
        ours.append(np.asarray(state.x))
        assert ours[-1].dtype == dtype
    for k, (a, b) in enumerate(zip(ours, ref)):
        np.testing.assert_allclose(a, b, atol=atol, err_msg=f"x^{k}")
    np.testing.assert_allclose(state.eta, ref_eta, rtol=1e-6)
    assert len(set(np.round(ref_eta / np.asarray(eps), 6))) > 1  # the examples halve differently
