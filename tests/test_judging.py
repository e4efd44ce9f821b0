"""Judging on any input: trained models, on- and off-grid images, eps on and between levels.

The 8-bit grid is a smaller threat model than the continuous ball, so robust accuracy judged
on the grid may sit a little above float32's (an example whose only adversarial points lie
between pixel levels is robust on the grid); what must never happen is a success the judging
itself voids (the rounding leaving the ball, or throwing away a success a grid image keeps),
or a success the judging invents. These tests measure both on real trained models and on data
the library was not built on: images moved by a sub-pixel offset (off the grid), an ordinary
flax ``nn.Conv`` network, and a linear toy whose grid optimum is known exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import Plan, attacks, bundle, bundles, data, evaluate, judge, norms
from jaxbundle.attacks.base import Attack, Candidate
from toys import ColourCNN, KEY, images, linear_apply, linear_problem, quick_demo_model

N = 96  # test images per setting
MATCH = 64  # of them, compared between grid and float32 judging at each setting
GAP = 16  # at most this many examples get the finer search


@pytest.fixture(scope="module")
def trained():
    """The two demo models these tests judge, trained small (once per run, in
    $JAXBUNDLE_CACHE)."""
    return {name: quick_demo_model(name) for name in ("standard", "adversarial")}


@pytest.fixture(scope="module")
def digits():
    test = data.load_mnist_sample("test", n=N)
    return {"on-grid": test.x, "off-grid": data.translate(test.x, 0.37, 0.41)}, test.y


def recheck(apply_fn, params, x0, ev, eps, norm):
    """Re-checks every reported success independently, on the image the report saves."""
    pe = ev.per_example
    saved = pe["x_adv"]
    x_adv = saved.astype(np.float32) / 255 if saved.dtype == np.uint8 else saved
    assert x_adv.dtype == np.float32 and x_adv.shape == x0.shape
    assert saved.dtype == (np.uint8 if pe["judged_on_grid"].all() else np.float32)
    assert x_adv.min() >= 0.0 and x_adv.max() <= 1.0
    ok = pe["success"]
    delta = (x_adv - x0).reshape(len(x0), -1).astype(np.float64)
    dist = {"linf": np.abs(delta).max(axis=1), "l2": np.linalg.norm(delta, axis=1)}[norm]
    assert np.all(dist[ok] <= eps * (1 + norms.BALL_RTOL) + norms.BALL_ATOL + 1e-7)
    if ok.any():
        logits = np.asarray(apply_fn(params, jnp.asarray(x_adv[ok])))
        assert np.all(logits.argmax(axis=1) != pe["label"][ok])
    grid = pe["judged_on_grid"]
    levels = x_adv[grid] * 255
    np.testing.assert_allclose(levels, np.round(levels), rtol=0, atol=1e-3)
    return ok


def fast(norm):
    """The `fast` bundle and Square on the grid (a black-box attack that searches on it)."""
    return bundles.bundle_attacks("fast", norm) + (attacks.square(norm, queries=100),)


# (model, norm, eps): Linf eps on a pixel level and between levels, and an L2 eps (always
# between the grid's radii), where the model is neither always fooled nor never.
SETTINGS = [
    ("adversarial", "linf", 0.3),
    ("standard", "linf", 8 / 255),
    ("standard", "l2", 1.5),
]


@pytest.mark.slow
@pytest.mark.parametrize("model, norm, eps", SETTINGS)
def test_judged_robust_accuracy_matches_float32(trained, digits, model, norm, eps):
    """On 8-bit images, judging on the grid changes the figure by the grid's smaller radius and
    nothing else; off the grid, images are judged in float32 and no success is lost."""
    apply_fn, params = trained[model]
    sets, y = digits
    sets, y = {name: x[:MATCH] for name, x in sets.items()}, y[:MATCH]
    run = lambda x, judging, e=eps: evaluate(  # noqa: E731
        apply_fn, params, (x, y),
        Plan.of(eps=e, norm=norm, attacks=fast(norm), goals=("misclassify",), judging=judging,
             batch_size=MATCH, seed=1),
    )
    on, flt = run(sets["on-grid"], "auto"), run(sets["on-grid"], "float")
    assert on.metrics["judging"]["grid_examples"] == MATCH
    assert flt.metrics["judging"]["grid_examples"] == 0
    recheck(apply_fn, params, sets["on-grid"], on, eps, norm)
    recheck(apply_fn, params, sets["on-grid"], flt, eps, norm)
    judged, floated = on.metrics["robust_accuracy"], flt.metrics["robust_accuracy"]
    # The grid's radius is whole levels (76/255 for 0.3); the statement says so.
    radius = norms.grid_radius(eps, norm)
    if norm == "linf":
        assert f"allows {round(radius * 255)}/255" in on.metrics["judging"]["statement"]
    # Judged on the grid at eps, the successes are those of float32 judging at that radius.
    at_radius = flt if radius == eps else run(sets["on-grid"], "float", radius)
    # (Measured at every setting on the 96 images, stop 46: no example differed, so the
    # figures were equal; one may sit on the boundary within float32 rounding.)
    differ = on.per_example["success"] != at_radius.per_example["success"]
    assert differ.sum() <= 1, differ.sum()
    spread = 100 * differ.sum() / MATCH  # the most the figures can differ by
    assert abs(judged - at_radius.metrics["robust_accuracy"]) <= spread
    if radius >= eps * (1 - 1e-6):  # eps on a level: the same figure
        assert abs(judged - floated) <= spread, (judged, floated)
    else:  # between levels the grid holds fewer (76 of 76.5 levels for 0.3)
        assert judged >= floated - spread, (judged, floated)
    # Tell a grid effect from a judging defect: a finer search (APGD-CE 100 x 4) on the
    # examples only float32 judging at eps fooled. Where it fools one in float32 at the grid's
    # radius, it must fool it on the grid too; what survives on the grid is a grid effect.
    gap = np.flatnonzero(flt.per_example["success"] & ~on.per_example["success"])[:GAP]
    if gap.size:
        finer = [attacks.apgd(norm, steps=100, restarts=4)]
        rows = np.resize(gap, GAP)  # a fixed shape: one compilation per norm
        xg, yg = jnp.asarray(sets["on-grid"][rows]), jnp.asarray(y[rows])
        on_grid = bundle(finer, apply_fn, params, xg, yg, KEY, eps=eps, norm=norm)
        in_float = bundle(finer, apply_fn, params, xg, yg, KEY, eps=radius, norm=norm,
                          judging="float")
        defect = np.asarray(in_float.attack_success[0]) & ~np.asarray(on_grid.attack_success[0])
        defect = defect[: gap.size]
        assert not defect.any(), (defect.sum(), gap.size)  # measured on 96: 0 of 2 at 0.3
    # Off the grid: judged in float32, said so, and no success lost to rounding.
    off = run(sets["off-grid"], "auto")
    assert off.metrics["judging"]["grid_examples"] == 0
    statement = off.metrics["judging"]["statement"]
    assert "judged in float32 (clean images off the 8-bit grid)" in statement
    off_float = run(sets["off-grid"], "float")
    np.testing.assert_array_equal(off.per_example["success"], off_float.per_example["success"])
    recheck(apply_fn, params, sets["off-grid"], off, eps, norm)


@pytest.mark.slow
@pytest.mark.parametrize("eps", [51 / 255, 8 / 255])
def test_linf_rounding_of_off_grid_images_keeps_their_successes(trained, digits, eps):
    """The issue's failure: off-grid images at an eps that is a whole number of levels. Rounding
    a float32 success to the grid levels inside the ball (what norms.quantize does for any x0)
    must keep it inside the ball and keep nearly all successes (it voided most before)."""
    apply_fn, params = trained["adversarial" if eps > 0.1 else "standard"]
    sets, y = digits
    x0 = sets["off-grid"]
    ev = evaluate(apply_fn, params, (x0, y),
                  bundles.fast("linf", eps, goals=("misclassify",), judging="float",
                               batch_size=N))
    ok = ev.per_example["success"]
    assert ok.sum() >= 20, "the setting must have successes to lose"
    rounded = norms.quantize(jnp.asarray(ev.per_example["x_adv"]), jnp.asarray(x0), eps, "linf")
    assert bool(jnp.all(norms.in_ball(rounded - x0, eps, "linf")))
    still = np.asarray(jnp.argmax(apply_fn(params, rounded), axis=1)) != y
    lost = int(np.sum(ok & ~still))
    # Nearly all kept (most were lost before): a success within a rounding step of the boundary
    # may go (0 of 71 on one machine, 1 of 71 on another: XLA:CPU's code differs by CPU).
    assert lost <= 0.02 * N, f"{lost} of {ok.sum()} successes lost to rounding"


class FlaxCNN(nn.Module):
    """``models.SmallCNN`` written with ordinary flax ``nn.Conv`` layers (the same params)."""

    @nn.compact
    def __call__(self, x):
        def conv(channels, name):
            return nn.Conv(channels, (5, 5), strides=(2, 2), padding="SAME", name=name)

        x = nn.relu(conv(16, "conv1")(x))
        x = nn.relu(conv(32, "conv2")(x))
        x = nn.relu(nn.Dense(100, name="hidden")(x.reshape(x.shape[0], -1)))
        return nn.Dense(10, name="logits")(x)


@pytest.mark.slow
@pytest.mark.parametrize("norm, eps", [("linf", 51 / 255), ("l2", 1.5)])
def test_a_flax_conv_model_on_resized_images(trained, norm, eps):
    """An ordinary nn.Conv model, on images resized 28 -> 32 -> 28 (bilinear): judged in
    float32, every success re-checked; the same images rounded to 8 bits judge on the grid."""
    _, params = trained["adversarial"]
    apply_fn = FlaxCNN().apply
    test = data.load_mnist_sample("test", n=64)
    up = jax.image.resize(test.x, (64, 32, 32, 1), "bilinear")
    x = np.clip(np.asarray(jax.image.resize(up, (64, 28, 28, 1), "bilinear")), 0, 1)
    rounded = (np.round(x * 255) / np.float32(255)).astype(np.float32)
    plan = bundles.fast(norm, eps, goals=("misclassify",), batch_size=64)
    fooled = {}
    for name, images_ in (("resized", x), ("rounded", rounded)):
        ev = evaluate(apply_fn, params, (images_, test.y), plan)
        expected_grid = 0 if name == "resized" else 64
        assert ev.metrics["judging"]["grid_examples"] == expected_grid
        fooled[name] = recheck(apply_fn, params, images_, ev, eps, norm)
        assert fooled[name].sum() > 0
    # Rounding the data moves every pixel by at most half a level (an L2 distance of at most
    # 0.5 / 255 * 28 = 0.055, 3.7 % of eps 1.5; 1 % of eps 0.2 in Linf): only examples that
    # close to the boundary change verdict (measured: none in either norm).
    changed = int(np.sum(fooled["resized"] != fooled["rounded"]))
    assert changed <= 3, changed


def grid_optimum(params, x, y, eps):
    """Per example: whether some 8-bit image inside the Linf ball fools the linear model.

    For each wrong class j the margin ``(w_j - w_y) . x' + b_j - b_y`` is maximised coordinate
    by coordinate over the grid levels inside the ball and the box: the exact grid optimum."""
    w, b = np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64)
    k0 = np.round(x * 255)
    m = np.floor(norms.grid_radius(eps, "linf") * 255 + 1e-6)
    hi, lo = np.minimum(k0 + m, 255) / 255, np.maximum(k0 - m, 0) / 255
    fooled = np.zeros(len(y), bool)
    for j in range(w.shape[1]):
        d = (w[:, j][None, :] - w[:, y].T)  # [n, D]
        best = np.where(d > 0, hi, lo)
        gain = np.sum(d * best, axis=1) + b[j] - b[y]
        fooled |= (j != y) & (gain > 0)
    return fooled


@pytest.mark.parametrize("levels", [55, 57.5, 59.3])
def test_grid_effects_on_tiny_inputs_are_genuine(levels):
    """On 20-pixel inputs whose margins cluster, eps between levels judges several points
    more robust on the grid than in float32. Each example judged robust on the grid must really be
    robust there (the exact grid optimum of a linear model agrees), and each one the grid
    optimum fools must be judged fooled: a genuine grid effect, not a judging defect."""
    params, x, y = linear_problem(n=400, d=20, k=3, seed=7, spread=0.1)
    eps = levels / 255
    attack = [attacks.apgd("linf", loss="ce-targeted", steps=30, targets=2)]
    on_grid = bundle(attack, linear_apply, params, images(x), jnp.asarray(y), KEY, eps=eps)
    in_float = bundle(attack, linear_apply, params, images(x), jnp.asarray(y), KEY, eps=eps,
                      judging="float")
    judged = np.asarray(on_grid.attack_success[0])
    floated = np.asarray(in_float.attack_success[0])
    optimum = grid_optimum(params, x, y, eps)
    np.testing.assert_array_equal(judged, optimum)
    assert np.all(floated >= judged)
    if levels % 1:  # between levels, the grid effect is real here
        assert floated.sum() >= judged.sum() + 0.02 * len(y), (floated.sum(), judged.sum())
    else:  # on a level, the grid vertices are the ball's: no effect at all
        np.testing.assert_array_equal(judged, floated)


def test_rounding_alone_is_never_credited():
    """A candidate that is not adversarial, but whose rounding to the grid would be, is not a
    success: the example falls back to the clean image (the judge does not search)."""
    def apply_fn(threshold, x):  # class 1 iff pixel 0 exceeds the threshold
        z = 1000.0 * (x.reshape(x.shape[0], -1)[:, :1] - threshold)
        return jnp.concatenate([jnp.zeros_like(z), z], axis=1)

    threshold = jnp.float32(128.7 / 255)
    x0 = jnp.full((1, 2, 2, 1), 128 / 255, jnp.float32)
    y = jnp.zeros((1,), jnp.int32)
    step = lambda levels: attacks.pgd(  # noqa: E731  (moves pixel 0 up by `levels`)
        steps=1, random_start=False, step_size=levels / 255, loss="margin")
    # 128.6: not adversarial in float, but it rounds to 129, which is.
    short = bundle([step(0.6)], apply_fn, threshold, x0, y, KEY, eps=1 / 255)
    assert not bool(short.attack_success[0, 0])
    best = short.best["misclassify"]
    assert int(best.attack[0]) == -1  # the clean image
    np.testing.assert_array_equal(np.asarray(best.x), np.asarray(x0))
    # Judged in float32 it is no success either; 128.8 is one both ways, judged at 129.
    assert not bool(bundle([step(0.6)], apply_fn, threshold, x0, y, KEY, eps=1 / 255,
                           judging="float").attack_success[0, 0])
    past = bundle([step(0.8)], apply_fn, threshold, x0, y, KEY, eps=1 / 255)
    assert bool(past.attack_success[0, 0])
    np.testing.assert_allclose(past.best["misclassify"].x[0, 0, 0, 0], 129 / 255, atol=1e-7)


def test_judging_modes_are_checked_and_reported():
    params, x, y = linear_problem(n=8, d=20, k=3, seed=1)
    xs = images(x)
    off = np.asarray(xs) + np.float32(0.3 / 255)
    with pytest.raises(ValueError, match="judging='grid' needs clean images on the 8-bit grid"):
        bundle([attacks.fgsm()], linear_apply, params, off, jnp.asarray(y), KEY, eps=0.1,
               judging="grid")
    with pytest.raises(ValueError, match="judging must be one of"):
        bundle([attacks.fgsm()], linear_apply, params, xs, jnp.asarray(y), KEY, eps=0.1,
               judging="8bit")
    r = bundle([attacks.fgsm()], linear_apply, params, off, jnp.asarray(y), KEY, eps=0.1)
    assert not np.asarray(r.judged_on_grid).any()
    r = bundle([attacks.fgsm()], linear_apply, params, xs, jnp.asarray(y), KEY, eps=0.1)
    assert np.asarray(r.judged_on_grid).all()
    assert judge.statement("auto", 0.031, "linf", 8, 8) == (
        "eps 0.031 (linf): 8 of 8 examples judged on the 8-bit grid, which allows "
        "7/255 = 0.02745")
    assert judge.statement("float", 0.5, "l2", 0, 8) == (
        "eps 0.5 (l2): 8 of 8 judged in float32 (judging='float'), radius 0.5")
    assert "sqrt(16256)/255" in judge.statement("auto", 0.5, "l2", 5, 8)


class _Fixed(NamedTuple):
    levels: float  # the candidate moves pixel 0 up by this many levels


class _FixedState(NamedTuple):
    x: jax.Array


def _fixed_init(config, keys, x0, y, eps, model, restart):
    bump = jnp.zeros(x0.shape[1:]).reshape(-1).at[0].set(config.levels / 255).reshape(x0.shape[1:])
    return _FixedState(x=x0 + bump[None])


def _fixed_step(config, state, model):
    logits = model.logits(state.x) if hasattr(model, "logits") else None
    return state, Candidate(state.x, logits)


def fixed_min_norm_attack(kind: str, levels: float) -> Attack:
    """A min-norm "attack" of ``kind`` whose one candidate moves pixel 0 up by ``levels``."""
    return Attack(name=f"fixed-{kind}", kind=kind, norm="linf", num_steps=1, num_restarts=1,
                  gradients_per_step=int(kind == "white-box"), init=_fixed_init,
                  step=_fixed_step, config=_Fixed(levels), goal="min_norm",
                  queries_per_step=int(kind != "white-box"))


def test_only_white_box_min_norm_candidates_are_stretched():
    """A min-norm candidate just past the boundary (128.45 levels, threshold 128.3) rounds back
    to the clean side; the judge stretches it (x 1.3 rounds to 129) only for a white-box
    attack, whose model passes are not budgeted. A black-box attack is judged on the image it
    queried: the stretched one would be an uncounted query."""
    def apply_fn(threshold, x):
        z = 1000.0 * (x.reshape(x.shape[0], -1)[:, :1] - threshold)
        return jnp.concatenate([jnp.zeros_like(z), z], axis=1)

    threshold = jnp.float32(128.3 / 255)
    x0 = jnp.full((1, 2, 2, 1), 128 / 255, jnp.float32)
    y = jnp.zeros((1,), jnp.int32)
    for kind, fooled in (("white-box", True), ("decision-based", False), ("score-based", False)):
        r = bundle([fixed_min_norm_attack(kind, 0.45)], apply_fn, threshold, x0, y, KEY, eps=0.1)
        best = r.best["min_norm"]
        assert bool(best.score.misclassified[0]) is fooled, kind
        if fooled:
            np.testing.assert_allclose(best.x[0, 0, 0, 0], 129 / 255, atol=1e-7)
        # Judged in float32 there is nothing to round: a success either way.
        f = bundle([fixed_min_norm_attack(kind, 0.45)], apply_fn, threshold, x0, y, KEY,
                   eps=0.1, judging="float")
        assert bool(f.best["min_norm"].score.misclassified[0]), kind


@pytest.mark.parametrize("norm, eps", [pytest.param("linf", 1 / 255, marks=pytest.mark.slow),
                                       ("linf", 0.006),
                                       pytest.param("l2", 0.1, marks=pytest.mark.slow)])
def test_colour_images_judged_like_float32_at_the_grid_radius(norm, eps):
    """CIFAR-sized colour images (8-bit, and the same moved off the grid) and an nn.Conv model:
    on the grid every verdict is float32's at the grid's radius; off it, float32's at eps."""
    module = ColourCNN()
    rng = np.random.default_rng(5)
    x = (rng.integers(0, 256, (32, 32, 32, 3)) / 255).astype(np.float32)
    params = module.init(jax.random.key(0), x[:1])
    y = np.asarray(jnp.argmax(module.apply(params, x), axis=1)).astype(np.int32)
    bundle_ = (attacks.apgd(norm, steps=10), attacks.square(norm, queries=50))
    run = lambda images_, e, judging: evaluate(  # noqa: E731
        module.apply, params, (images_, y),
        Plan.of(eps=e, norm=norm, attacks=bundle_, goals=("misclassify",), judging=judging,
             batch_size=32))
    radius = norms.grid_radius(eps, norm)
    judged, at_radius = run(x, eps, "auto"), run(x, radius, "float")
    assert judged.metrics["judging"]["grid_examples"] == 32
    ok = recheck(module.apply, params, x, judged, eps, norm)
    assert 0 < ok.sum() < 32, "the setting must fool some examples, not all"
    differ = judged.per_example["success"] != at_radius.per_example["success"]
    assert differ.sum() <= 1, differ.sum()
    moved = data.translate(x, 0.5, 0.25)
    off = run(moved, eps, "auto")
    assert off.metrics["judging"]["grid_examples"] == 0
    recheck(module.apply, params, moved, off, eps, norm)
