"""The bundler: per-example bests, verification, quantisation, and the point of bundling."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import attacks, norms
from jaxbundle.attacks.base import Attack, Candidate, WhiteBoxModel
from jaxbundle.bundler import bundle
from jaxbundle.validation import check_inputs
from jaxbundle.judge import quantize_min_norm
from jaxbundle.metrics import Counts, Setting
from toys import KEY, images, linear_apply, linear_problem, min_distance


class _RowState(NamedTuple):
    x: jax.Array
    x0: jax.Array
    y: jax.Array
    eps: jax.Array


class _RowConfig(NamedTuple):
    row: int
    shift: float  # added to every pixel of the victim row (may leave box and ball)


def _row_init(config, keys, x0, y, eps, model, restart):
    return _RowState(x0, x0, y, eps)


def _row_step(config, state, model):
    """FGSM (margin loss, Linf) on one batch row only; or a fixed shift when config.shift."""
    def margin(logits, y):
        from jaxbundle.losses import margin as m

        return m(logits, y)

    _, grad, logits = model.loss_and_grad(margin, state.x, state.y)
    fgsm = norms.project(state.x0 + norms.per_example(state.eps, grad) * jnp.sign(grad), state.x0,
                         state.eps, "linf")
    moved = fgsm if config.shift == 0 else state.x0 + config.shift
    victim = (jnp.arange(state.x.shape[0]) == config.row)
    x_new = jnp.where(norms.per_example(victim, state.x), moved, state.x0)
    return state._replace(x=x_new), Candidate(state.x, logits)


def only_row(row: int, shift: float = 0.0) -> Attack:
    """A white-box attack that touches a single example of the batch (for synthetic checks)."""
    return Attack(
        name=f"row{row}" if not shift else f"shift{row}",
        kind="white-box", norm="linf", num_steps=1, num_restarts=1, gradients_per_step=1,
        init=_row_init, step=_row_step, config=_RowConfig(row, shift),
    )


def test_bundling_finds_what_no_single_attack_does():
    """n attacks that each fool a different example: WAT error 1/n, bundled error 1."""
    n = 3
    params, x, y = linear_problem(n=n, k=2, seed=7)
    eps = float(min_distance(params, x, y, "linf").max()) * 1.2
    bundle_attacks = [only_row(i) for i in range(n)]
    r = bundle(bundle_attacks, linear_apply, params, images(x), jnp.asarray(y), KEY, eps=eps)
    np.testing.assert_array_equal(r.attack_success, np.eye(n, dtype=bool))
    setting = Setting.of(bundle_attacks)
    figures = Counts.from_result(r, jnp.ones(n, bool), eps, setting).compute(setting)
    assert figures["clean_accuracy"] == 100.0
    assert figures["wat"] == pytest.approx(100.0 * (n - 1) / n)  # WAT error 1/n
    assert figures["robust_accuracy"] == 0.0  # bundled error 1
    assert figures["relative_robustness"] == 0.0
    assert list(np.asarray(r.best["misclassify"].attack)) == list(range(n))


UNION_ATTACKS = [attacks.fgsm(), attacks.pgd(steps=5), attacks.pgd(loss="margin", steps=5)]


def test_bundled_success_is_the_union_of_verified_attack_successes():
    params, x, y = linear_problem(n=64, k=4, seed=8)
    y = y.copy()
    y[:4] = (y[:4] + 1) % 4  # a few clean errors
    eps = float(np.quantile(min_distance(params, x, y, "linf")[4:], 0.5))
    r = bundle(UNION_ATTACKS, linear_apply, params, images(x), jnp.asarray(y), KEY, eps=eps)
    clean_wrong = np.asarray(r.clean.misclassified)
    union = clean_wrong | np.asarray(r.attack_success).any(axis=0)
    best = r.best["misclassify"]
    np.testing.assert_array_equal(np.asarray(best.score.misclassified), union)
    assert np.all(np.asarray(r.attack_success)[:, clean_wrong]), (
        "clean errors count for every attack"
    )
    # The winner is an attack that succeeded on its own (or -1, the clean image).
    winner = np.asarray(best.attack)
    won = union & (winner >= 0)
    assert np.all(np.asarray(r.attack_success)[winner[won], np.flatnonzero(won)])
    assert 0 < union.sum() < 64


def test_more_attacks_never_lose_a_success():
    params, x, y = linear_problem(n=64, k=4, seed=9)
    eps = float(np.quantile(min_distance(params, x, y, "l2"), 0.5))
    small = [attacks.fgsm("l2")]
    large = small + [attacks.pgd("l2", steps=10, restarts=2)]
    run = lambda a: bundle(a, linear_apply, params, images(x), jnp.asarray(y), KEY, eps=eps,  # noqa: E731
                           norm="l2", goals=("misclassify", "min_norm", "max_confidence"))
    r_small, r_large = run(small), run(large)
    s_small = np.asarray(r_small.best["misclassify"].score.misclassified)
    s_large = np.asarray(r_large.best["misclassify"].score.misclassified)
    assert np.all(s_large[s_small]) and s_large.sum() > s_small.sum()
    d_small = np.where(np.asarray(r_small.best["min_norm"].score.misclassified),
                       np.asarray(r_small.best["min_norm"].score.distortion), np.inf)
    d_large = np.where(np.asarray(r_large.best["min_norm"].score.misclassified),
                       np.asarray(r_large.best["min_norm"].score.distortion), np.inf)
    assert np.all(d_large <= d_small)
    c_small = np.asarray(r_small.best["max_confidence"].score.confidence)
    c_large = np.asarray(r_large.best["max_confidence"].score.confidence)
    assert np.all(c_large >= c_small - 1e-6)


def test_reported_images_are_verified_in_box_ball_and_misclassified():
    params, x, y = linear_problem(n=64, k=4, seed=10)
    eps = float(np.quantile(min_distance(params, x, y, "linf"), 0.6))
    r = bundle([attacks.pgd(steps=20, restarts=2)], linear_apply, params, images(x),
               jnp.asarray(y), KEY, eps=eps, goals=("misclassify", "max_confidence"))
    for goal in ("misclassify", "max_confidence"):
        best = r.best[goal]
        xa = np.asarray(best.x)
        assert xa.min() >= 0 and xa.max() <= 1
        np.testing.assert_allclose(np.round(xa * 255), xa * 255, atol=1e-3)  # on the 8-bit grid
        assert np.all(np.asarray(norms.norm(best.x - images(x), "linf")) <= eps + 1e-6)
        pred = np.asarray(jnp.argmax(linear_apply(params, best.x), 1))
        np.testing.assert_array_equal(pred, np.asarray(best.score.prediction))
    ok = np.asarray(r.best["misclassify"].score.misclassified)
    assert ok.sum() > 10 and np.all(np.asarray(r.best["misclassify"].score.prediction)[ok] != y[ok])


def _threshold_model(threshold):
    """Two classes: class 1 iff pixel 0 exceeds ``threshold`` (steep, so rounding decides)."""
    def apply(params, x):
        z = 1000.0 * (x.reshape(x.shape[0], -1)[:, :1] - params)
        return jnp.concatenate([jnp.zeros_like(z), z], axis=1)
    return apply, jnp.float32(threshold)


def test_success_is_judged_on_the_quantised_image():
    """A float image past the boundary that rounds back to the clean class does not count."""
    apply, params = _threshold_model(128.2 / 255)
    x = jnp.full((1, 2, 2, 1), 128 / 255, jnp.float32)
    y = jnp.zeros((1,), jnp.int32)
    eps = 0.4 / 255  # enough to cross 128.2/255 in float, not enough to reach pixel 129
    attack = attacks.pgd(steps=5, random_start=False, step_size=0.2 / 255, loss="margin")
    raw = bundle([attack], apply, params, x, y, KEY, eps=eps, judging="float")
    assert bool(raw.attack_success[0, 0])
    quantised = bundle([attack], apply, params, x, y, KEY, eps=eps, judging="grid")
    assert not bool(quantised.attack_success[0, 0])
    assert not bool(quantised.best["misclassify"].score.misclassified[0])
    # With eps of one pixel level it does count, and the image is exactly one level up.
    one_level = bundle([attack], apply, params, x, y, KEY, eps=1 / 255, judging="grid")
    assert bool(one_level.attack_success[0, 0])
    np.testing.assert_allclose(one_level.best["misclassify"].x[0, 0, 0, 0], 129 / 255, atol=1e-7)


def test_candidates_outside_the_box_are_rejected():
    """An attack that leaves the box is caught by verification, whatever the model says."""
    apply, params = _threshold_model(0.99)
    x = jnp.full((2, 2, 2, 1), 0.98, jnp.float32)
    y = jnp.zeros((2,), jnp.int32)
    cheat = only_row(0, shift=0.05)  # 1.03 > 1: outside the box, inside the 0.1 ball
    r = bundle([cheat], apply, params, x, y, KEY, eps=0.1, judging="float")
    assert not bool(r.attack_success[0, 0])
    assert not np.asarray(r.best["misclassify"].score.misclassified).any()


def test_eps_zero_gives_clean_accuracy():
    params, x, y = linear_problem(n=64, k=4, seed=11)
    y = y.copy()
    y[:5] = (y[:5] + 1) % 4
    # The attacks and shapes of test_bundled_success_is_the_union_of_verified_attack_successes:
    # the same compiled bundle, run at eps 0.
    r = bundle(UNION_ATTACKS, linear_apply, params, images(x), jnp.asarray(y), KEY, eps=0.0)
    setting = Setting(("fgsm", "pgd-ce", "pgd-margin"), (False, False, False))
    figures = Counts.from_result(r, jnp.ones(64, bool), 0.0, setting).compute(setting)
    assert figures["robust_accuracy"] == figures["clean_accuracy"] == pytest.approx(100 * 59 / 64)
    assert figures["relative_robustness"] == 100.0


def test_per_example_eps_and_batch_invariance():
    """Example i's result depends on (key, example_id[i]) only, not on its batch mates."""
    params, x, y = linear_problem(n=24, k=4, seed=12)
    eps = float(np.quantile(min_distance(params, x, y, "linf"), 0.5))
    attack = [attacks.pgd(steps=5, restarts=2)]
    ids = jnp.arange(24, dtype=jnp.int32)
    # eps as one value per example here too: the same program as per_example's below.
    full = bundle(attack, linear_apply, params, images(x), jnp.asarray(y), KEY,
                  eps=jnp.full(24, eps), example_id=ids)
    part = bundle(attack, linear_apply, params, images(x[8:16]), jnp.asarray(y[8:16]), KEY,
                  eps=jnp.full(8, eps), example_id=ids[8:16])
    np.testing.assert_allclose(full.best["misclassify"].x[8:16], part.best["misclassify"].x,
                               atol=1e-6)
    per_example = bundle(attack, linear_apply, params, images(x), jnp.asarray(y), KEY,
                         eps=jnp.where(jnp.arange(24) < 12, 0.0, eps), example_id=ids)
    s = np.asarray(per_example.best["misclassify"].score.misclassified)
    assert not s[:12].any() and s[12:].sum() > 0


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda x, y, e: (x.astype(np.uint8), y, e), "floating"),
        (lambda x, y, e: (np.where(np.arange(x.size).reshape(x.shape) == 3, np.nan,
                                   x).astype(np.float32), y, e), "NaN"),
        (lambda x, y, e: (x + 0.6, y, e), r"\[0, 1\]"),
        (lambda x, y, e: (x, y.astype(np.float32), e), "integers"),
        (lambda x, y, e: (x, y + 7, e), r"labels must lie in \[0, 4\)"),
        (lambda x, y, e: (x, y[:-1], e), "length mismatch: 8 images but 7 labels"),
        (lambda x, y, e: (x, y, -0.1), "eps"),
        (lambda x, y, e: (x, y, float("nan")), "eps"),
    ],
)
def test_bad_inputs_get_clear_errors(mutate, match):
    params, x, y = linear_problem(n=8, k=4, seed=13)
    xx, yy, ee = mutate(np.asarray(images(x)), y, 0.1)
    with pytest.raises(ValueError, match=match):
        bundle([attacks.fgsm()], linear_apply, params, xx, yy, KEY, eps=ee)


def test_bundle_configuration_errors():
    params, x, y = linear_problem(n=4, k=4)
    run = lambda a, **kw: bundle(a, linear_apply, params, images(x), jnp.asarray(y), KEY,  # noqa: E731
                                 eps=0.1, **kw)
    with pytest.raises(ValueError, match="at least one attack"):
        run([])
    with pytest.raises(ValueError, match="unique"):
        run([attacks.fgsm(), attacks.fgsm()])
    with pytest.raises(ValueError, match="norm 'l2' but the threat model is 'linf'"):
        run([attacks.fgsm("l2")])
    with pytest.raises(ValueError, match="unknown goal"):
        run([attacks.fgsm()], goals=("fastest",))
    # A step size or checkpoint schedule built for 10 steps must not silently run 20.
    with pytest.raises(ValueError, match="runs 20 steps but its config is built for 10"):
        run([attacks.pgd(steps=10)._replace(num_steps=20)])
    with pytest.raises(ValueError, match="logits"):
        bundle([attacks.fgsm()], lambda p, x: x.reshape(-1), params, images(x), jnp.asarray(y), KEY,
               eps=0.1)


def test_min_norm_candidates_survive_rounding_to_the_grid():
    """Points just past a linear boundary: nearest rounding loses many; the stretch keeps all."""
    params, x, y = linear_problem(n=64, k=2, seed=3)
    w = np.asarray(params["w"])
    z = np.asarray(linear_apply(params, jnp.asarray(x)))
    rows = np.arange(len(y))
    direction = (w[:, 1 - y] - w[:, y]).T  # [n, d]
    gap = z[rows, y] - z[rows, 1 - y]
    delta = (gap / np.sum(direction**2, axis=1) * (1 + 1e-3))[:, None] * direction
    x0, xa = images(x), images(x + delta)
    model = WhiteBoxModel(linear_apply, params)
    yy = jnp.asarray(y)
    fooled = lambda v: np.asarray(jnp.argmax(model.logits(v), -1) != yy)  # noqa: E731
    assert fooled(xa).all()
    assert fooled(norms.quantize(xa, x0)).mean() < 0.9, "the toy must make plain rounding fail"
    q = quantize_min_norm(model, xa, x0, yy, jnp.ones_like(yy, bool))
    assert fooled(q).all()
    np.testing.assert_array_equal(np.round(np.asarray(q) * 255), np.asarray(q) * 255)
    slack = np.sqrt(x.shape[1]) * 0.5 / 255  # half a level on every pixel
    assert np.all(np.asarray(norms.norm(q - x0, "l2"))
                  <= 1.3 * np.linalg.norm(delta, axis=1) + slack)


def test_input_check_traces_the_model_once_per_model_and_shapes():
    """check_inputs remembers the model's output shape: no re-trace per bundle() call, but a
    new parameter shape or batch shape is traced again and judged on its own classes."""
    from jaxbundle import bundler

    assert bundler.check_inputs is check_inputs  # the bundler's checks live in validation
    traces = []

    def counting_apply(params, x):
        traces.append(x.shape)
        return linear_apply(params, x)

    params, x, y = linear_problem(n=6, k=4, seed=3)
    assert check_inputs(counting_apply, params, x, y, 0.1) == 4
    assert check_inputs(counting_apply, params, x, y, 0.1) == 4
    assert traces == [(6, 20)]
    three = {"w": params["w"][:, :3], "b": params["b"][:3]}
    assert check_inputs(counting_apply, three, x, np.minimum(y, 2), 0.1) == 3
    with pytest.raises(ValueError, match=r"\[0, 3\) for 3 classes"):
        check_inputs(counting_apply, three, x, np.full_like(y, 3), 0.1)
    assert check_inputs(counting_apply, params, x[:2], y[:2], 0.1) == 4
    assert traces == [(6, 20), (6, 20), (2, 20)]


@pytest.mark.slow
def test_restart_mode_map_and_unrolling_give_the_default_result():
    """Restarts one at a time (lax.map) and an unrolled scan are the same program as the
    default vmap and rolled scan, per example: the same images, scores and winners. (The
    unroll factor goes to ``lax.scan`` as it is; 2 over 5 steps also runs its remainder.)

    One attack with 3 restarts and 5 steps, on a stochastic model under EOT: map and unroll
    change the bundler's loops over restarts and steps, which do not depend on the attack or
    the model, and the model's per-call keys are what restarts one at a time could get wrong.
    (A second case on a deterministic model, and Square in both cases' bundles, ran the same
    loops again: about 65 s of compiling, where this takes about 19 s.)"""
    import jaxbundle

    params, x, y = linear_problem(n=12, k=4, seed=4)
    x = images(x)
    eps = float(np.quantile(min_distance(params, np.asarray(x).reshape(12, -1), y, "linf"), 0.5))
    apply_fn = jaxbundle.stochastic(
        lambda p, v, k: linear_apply(p, v + 0.02 * jax.random.normal(k, v.shape)), calls=6)
    atts = jaxbundle.with_eot([attacks.pgd(steps=5, restarts=3)], 2)
    run = lambda **kw: bundle(atts, apply_fn, params, x, y, KEY, eps=eps, **kw)  # noqa: E731
    default = run()
    assert 0 < int(np.sum(np.asarray(default.best["misclassify"].score.misclassified))) < 12
    for kw in (dict(restart_mode="map"), dict(unroll=2)):
        got = run(**kw)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     jax.tree.map(np.asarray, got.best), jax.tree.map(np.asarray, default.best))
        np.testing.assert_array_equal(np.asarray(got.attack_success),
                                      np.asarray(default.attack_success))


def test_raw_uint32_keys_work_like_typed_keys():
    """``jax.random.PRNGKey`` keys (uint32 [2]) give the typed key's result, also where the
    still-improving indicator does not apply (a black-box attack, a 2-step PGD)."""
    params, x, y = linear_problem(n=8, k=4, seed=2)
    bundle_ = [attacks.pgd(steps=2), attacks.square("linf", queries=5)]
    run = lambda k: bundle(bundle_, linear_apply, params, images(x), jnp.asarray(y), k,  # noqa: E731
                           eps=0.05)
    raw, typed = run(jax.random.PRNGKey(3)), run(jax.random.key(3))
    assert raw.attack_improving.shape == typed.attack_improving.shape == (2, 8)
    for a, b in zip(jax.tree.leaves(raw.best), jax.tree.leaves(typed.best)):
        np.testing.assert_array_equal(a, b)
