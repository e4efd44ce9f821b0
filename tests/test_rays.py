"""RayS (decision-based, min-norm Linf): factory, exact query counts, the block schedule,
feasibility, determinism, and the linear oracle."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import norms
from jaxbundle.attacks.base import Candidate, LabelOracle, per_example_keys
from jaxbundle.attacks.decision_based.rays import (
    NONE_FOUND, _advance, block_order, flip_mask, max_stage, num_blocks, ray_image, rays,
)
from jaxbundle.bundler import bundle
from attack_checks import check_factory, check_states_keep_shape, oracle_problem, traced_queries
from toys import KEY, images, linear_apply, linear_problem, min_distance, run_steps as _run

B = 8


def _setup(seed=1):
    return oracle_problem(LabelOracle, B, 0.1, seed=seed)


def test_factory():
    check_factory(rays, name="rays", kind="decision-based", norm="linf", goal="min_norm",
                  num_steps=10000, num_restarts=1, gradients_per_step=0, init_queries=1,
                  queries_per_step=1, queries=10001)
    assert rays(steps=50, restarts=3, name="r").queries == 153


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(steps=0), "steps"), (dict(search_steps=0), "search_steps"),
     (dict(restarts=0), "restarts"),
     (dict(steps=2.5), "steps")],
)
def test_factory_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rays(**kwargs)


def test_declared_queries_are_exact():
    params, _, x, y, eps, keys = _setup()
    a = rays(steps=3)
    init_rows, step_rows = traced_queries(a, LabelOracle, params, keys, x, y, eps)
    assert init_rows == a.init_queries * B
    assert step_rows == a.queries_per_step * B


def _reference_blocks(dim, passes):
    """The reference's (start, end) flips (uclaml/RayS ``attack_hard_label``, its loop over
    ``block_level`` and ``block_ind`` rewritten): ``passes`` stages from stage 0."""
    out, level, ind = [], 0, 0
    while level < passes:
        size = -(-dim // 2**level)
        start, end = ind * size, min(dim, (ind + 1) * size)
        out.append((level, start, end))
        ind += 1
        if ind == 2**level or end == dim:
            level, ind = level + 1, 0
    return out


@functools.partial(jax.jit, static_argnums=(0, 1))
def _schedule(dim, length):
    """The stage and the flip mask of each of the first ``length`` blocks of the schedule from
    stage 0 (block by block with :func:`_advance`), in one program rather than op by op."""

    def body(carry, _):
        stage, block = carry
        return _advance(stage, block, dim), (stage[0], flip_mask((dim,), stage, block)[0])

    zero = jnp.zeros(1, jnp.int32)
    return jax.lax.scan(body, (zero, zero), None, length=length)[1]


@pytest.mark.parametrize("dim", [1, 5, 20, 48, 64, 784])
def test_schedule_is_the_references(dim):
    """Stage by stage the flipped blocks are the reference's: ceil(D / 2^s) pixels each (the
    last one shorter), a stage ends after 2^s blocks or at the end of the vector, and once
    blocks are single pixels every later stage flips single pixels (no return to stage 0)."""
    stages = max_stage(dim) + 3
    reference = _reference_blocks(dim, stages)
    stages_seen, masks = map(np.asarray, _schedule(dim, len(reference)))
    for (level, start, end), stage, mask in zip(reference, stages_seen, masks):
        expected = np.ones(dim)
        expected[start:end] = -1
        np.testing.assert_array_equal(mask, expected, err_msg=f"{level=} {start=}")
        assert int(stage) == min(level, max_stage(dim))
    singles = [r for r in reference if r[0] >= max_stage(dim)]
    assert len(singles) == 3 * dim and all(e - s == 1 for _, s, e in singles)
    for level in range(max_stage(dim) + 1):  # every stage is a partition of the pixels
        cover = np.zeros(dim, int)
        for _, s, e in (r for r in reference if r[0] == level):
            cover[s:e] += 1
        np.testing.assert_array_equal(cover, 1)


def test_block_sizes_differ_from_an_even_split_where_2s_does_not_divide_d():
    """MNIST (D = 784), stage 5: blocks of ceil(784 / 32) = 25 pixels, 32 of them, the last 9
    pixels long (an even split would give blocks of 24 or 25 pixels)."""
    masks = [np.asarray(flip_mask((784,), jnp.array([5]), jnp.array([j])))[0] == -1
             for j in range(32)]
    assert [int(m.sum()) for m in masks] == [25] * 31 + [9]
    assert int(num_blocks(jnp.array([6]), 784)[0]) == 61  # ceil(784 / 13) < 2^6


def _reference_mask(shape, stage, block):
    """The reference's block (uclaml/RayS flattens a channels-first tensor): block ``block``
    of ``ceil(D / 2^s)`` pixels over the ``(C, H, W)`` flattening, returned channels last."""
    h, w, c = shape
    dim = h * w * c
    size = -(-dim // 2**stage)
    flat = np.ones(dim)
    flat[block * size : min(dim, (block + 1) * size)] = -1
    return flat.reshape(c, h, w).transpose(1, 2, 0)


def test_colour_blocks_are_cut_channels_first():
    """On an RGB image stage 1's first block is the red plane and the top half of the green one
    (the first half of the (C, H, W) vector), not the top half of the image in all channels;
    every block of every stage is the reference's."""
    shape = (4, 4, 3)
    assert block_order(shape) == (3, 4, 4)
    mask = np.asarray(flip_mask(shape, jnp.array([1]), jnp.array([0])))[0]
    expected = np.ones(shape)
    expected[:, :, 0] = -1
    expected[:2, :, 1] = -1
    np.testing.assert_array_equal(mask, expected)
    for s in range(max_stage(48) + 1):
        for j in range(int(num_blocks(jnp.array([s]), 48)[0])):
            got = np.asarray(flip_mask(shape, jnp.array([s]), jnp.array([j])))[0]
            np.testing.assert_array_equal(got, _reference_mask(shape, s, j), err_msg=f"{s=} {j=}")


def test_grayscale_block_order_is_the_plain_flattening():
    """One channel: channels first and channels last flatten alike (MNIST is unchanged)."""
    shape = (4, 5, 1)
    assert block_order(shape) == (1, 4, 5)
    for s in range(max_stage(20) + 1):
        for j in range(int(num_blocks(jnp.array([s]), 20)[0])):
            got = np.asarray(flip_mask(shape, jnp.array([s]), jnp.array([j])))[0]
            flat = np.asarray(flip_mask((20,), jnp.array([s]), jnp.array([j])))[0]
            np.testing.assert_array_equal(got, flat.reshape(shape))
            np.testing.assert_array_equal(got, _reference_mask(shape, s, j))


def test_step_queries_the_channels_first_block():
    """A check step on a colour image queries the best direction with the reference's block
    flipped, just below the best radius."""
    shape = (4, 4, 3)
    rng = np.random.default_rng(0)
    x = jnp.asarray(np.round((0.5 + 0.05 * rng.uniform(-1, 1, (2,) + shape)) * 255) / 255,
                    jnp.float32)
    params = {"w": jnp.asarray(rng.normal(size=(48, 3)), jnp.float32), "b": jnp.zeros(3)}
    model = LabelOracle(linear_apply, params)
    y = jnp.argmax(linear_apply(params, x), axis=1)
    a = rays(steps=1)

    @jax.jit  # init and the step in one program, not op by op
    def check_step(keys):
        state = a.init(a.config, keys, x, y, None, model, 0)
        state = state._replace(searching=jnp.zeros(2, bool), k_best=jnp.full(2, 40, jnp.int32),
                               stage=jnp.array([1, 2]), block=jnp.array([0, 3]))
        return a.step(a.config, state, model)[1]

    cand = check_step(per_example_keys(KEY, jnp.arange(2)))
    for i, (s, j) in enumerate([(1, 0), (2, 3)]):
        d = jnp.asarray(_reference_mask(shape, s, j), jnp.float32)[None]
        want = ray_image(x[i : i + 1], d, jnp.array([39]))
        np.testing.assert_array_equal(np.asarray(cand.x[i : i + 1]), np.asarray(want))


def test_iterates_feasible_and_state_consistent():
    """In the box and on the pixel grid; state.x is adversarial at exactly radius k_best / 255
    (the toy images sit mid-box, so the box does not clip these radii)."""
    params, model, x, y, eps, keys = _setup()
    a = rays(steps=60)
    states, cands = _run(a, model, keys, x, y, eps, 60)
    check_states_keep_shape(states, B)
    for point in [s.x for s in states] + [c.x for c in cands]:
        assert float(point.min()) >= 0.0 and float(point.max()) <= 1.0
        np.testing.assert_allclose(point * 255, np.round(point * 255), atol=1e-3)
    for c in cands:
        assert isinstance(c, Candidate) and c.logits is None
    k = [np.asarray(s.k_best) for s in states]
    assert all(np.all(b <= a_) for a_, b in zip(k, k[1:])), "the best radius never grows"
    last = states[-1]
    found = np.asarray(last.k_best) < NONE_FOUND
    assert found.all()
    pred = np.argmax(np.asarray(linear_apply(params, last.x)), axis=1)
    assert np.all(pred != np.asarray(y))
    np.testing.assert_allclose(norms.norm(last.x - x, "linf") * 255, last.k_best, atol=1e-3)
    assert np.all(np.abs(np.asarray(last.d)) == 1)


@functools.partial(jax.jit, static_argnames="attack")
def _after(attack, params, keys, x, y, eps, restart, steps):
    """The state after ``steps`` steps of ``attack`` (one program per attack and shape)."""
    model = LabelOracle(linear_apply, params)
    state = attack.init(attack.config, keys, x, y, eps, model, restart)
    return jax.lax.fori_loop(0, steps, lambda _, s: attack.step(attack.config, s, model)[0], state)


def test_deterministic_restarts_and_per_example():
    params, model, x, y, eps, keys = _setup()
    a = rays(steps=20, restarts=2)
    run = lambda *v, restart=0, steps=20: _after(a, params, *v, restart, steps)  # noqa: E731
    first = run(keys, x, y, eps)
    np.testing.assert_array_equal(first.x, run(keys, x, y, eps).x)
    s0 = run(keys, x, y, eps, restart=0, steps=0)  # init alone
    s1 = run(keys, x, y, eps, restart=1, steps=0)
    assert np.all(np.asarray(s0.d) == 1) and not np.all(np.asarray(s1.d) == 1)
    alone = run(keys[:1], x[:1], y[:1], eps[:1])
    np.testing.assert_array_equal(alone.x, first.x[:1])
    np.testing.assert_array_equal(alone.k_best, first.k_best[:1])


def test_linear_oracle_min_norm():
    """With its default budget RayS reaches the grid optimum ceil(255 d*) / 255 of the exact
    minimal distance d* (the optimal Linf perturbation of a linear model is a sign vector)."""
    params, x, y = linear_problem(n=100, k=4, seed=1)
    dist = min_distance(params, x, y, "linf")
    a = rays()
    r = bundle([a], linear_apply, params, images(x), jnp.asarray(y), KEY, eps=0.1, norm="linf",
               judging="float", goals=("min_norm",))
    best = r.best["min_norm"].score
    assert np.asarray(best.misclassified).all()
    attained = np.asarray(best.distortion)
    ratio = attained / dist
    grid = np.ceil(dist * 255 - 1e-4) / 255  # no 8-bit image is closer than this
    assert ratio.min() >= 1 - 1e-4  # sound
    assert np.median(ratio) <= 1.05 and np.mean(ratio <= 1.1) >= 0.9
    np.testing.assert_allclose(np.median(attained / grid), 1.0, atol=1e-4)
    # misclassify: exactly those within eps
    success = np.asarray(r.attack_success[0])
    assert 10 <= success.sum() <= 90
    np.testing.assert_array_equal(success, attained <= 0.1 * (1 + 1e-5) + 1e-6)
    np.testing.assert_array_equal(r.queries, np.full(100, 10001))
