"""SurFree (Maho, Furon & Le Merrer 2021, "SurFree: a fast surrogate-free black-box attack",
CVPR): a decision-based, minimum-norm L2 attack that needs only the predicted label.

SurFree estimates no gradient. It walks along the decision boundary by trying, for one fresh
direction after another, a few angles on a circle through the current point ``x_b``.

Init (``init_queries = init_trials + init_search_steps``)
    ``init_trials`` uniform-noise images (rounded like every query point) are queried in one
    batched call;
    the first one the model does not label ``y`` is the starting point, and a bisection of
    ``init_search_steps`` queries over ``t`` on the blend ``x0 + t (noise - x0)`` brings it
    next to the boundary. An example that no noise fools stays at ``x0``; its queries in the
    steps then go to fresh noise images until one fools, followed by the same bisection.

The search, query by query (one query per inner iteration, ``queries_per_step`` of them per
:func:`step`, in a ``lax.scan``; the search state persists across steps, so a step is just
a slice of the paper's sequential algorithm and no query is wasted on a static schedule):

1. New direction. With ``r = x_b - x0``, ``u = r / ||r||``, a random ``t`` is drawn: by
   default (as in the paper) Gaussian coefficients on the low-frequency block of the
   orthonormal 2-D DCT (the first ``frequency_ratio`` of rows and columns, every channel),
   mapped back to pixels; ``basis="gaussian"`` draws white Gaussian noise instead. It is made
   orthogonal (Gram-Schmidt) to ``u`` and to the last ``history`` directions, kept in a
   circular buffer of static size; ``v`` is its normalisation.
2. Sign / angle search (SEARCH). The circle with diameter ``[x0, x_b]`` in the plane
   ``(u, v)``, ``z(θ) = x0 + ||r|| cos θ (u cos θ + v sin θ)``, lies closer to ``x0`` than
   ``x_b`` (``||z(θ) - x0|| = ||r|| cos θ``). Up to ``2 * trials`` queries try
   ``θ = +θ_max (1 - k / trials), -θ_max (1 - k / trials)``, ``k = 0, 1, ...``, stopping at
   the first adversarial one; if none is, ``θ_max <- rho θ_max`` and back to 1. On a success
   ``θ_max <- θ_max / rho`` (capped at π/2).
3. Upper end (EXTEND). Below the largest angle (``k > 0``) the next larger one, ``|θ| +
   θ_max / trials``, was tried and failed on both sides: it is the bisection's upper end. At
   the largest angle (``k = 0``) nothing larger was tried, so, as the reference's
   ``_alpha_binary_search`` does, the angle steps on by ``θ_max / trials`` (the updated
   ``θ_max``; capped at π/2, which is ``x0``), one query each, while it stays adversarial; the
   first that is not is the upper end. The angle can so grow past ``θ_max``. (The reference
   tests "at the largest angle" as ``|lower| == theta_max`` after ``theta_max`` got its
   ``1 / rho``, so for a lone image the loop never runs, and in a batch only when other
   images' extra search rounds have shrunk this one's ``theta_max`` back; this implements
   what the loop is for.)
4. Refinement (REFINE). Bisection queries on ``|θ|`` between the adversarial angle and the
   upper end, at most ``search_steps`` (the reference's ``BS_max_iteration``), stopping early,
   as the reference does, once ``|cos(hi) - cos(lo)| <= gamma`` (its ``BS_gamma``, 0.01; the
   check is made before each bisection, so an interval that already meets it is not
   bisected). Back to 1; the queries a stop saves go to the next direction.

The noise-blend bisections (init, and BLEND) stop by the reference's ``_binary_search`` rule,
``hi - lo <= gamma / (D sqrt D)``, or after ``init_search_steps`` queries. In init, whose
query count is static, the queries after a stop are still made but ignored; with the
defaults the rule needs more bisections than ``init_search_steps`` (22 on MNIST), so it never
fires there. Not implemented from the reference's angle bisection: its second query per
bisection on the opposite side (``-mid``) of a positive angle.

Each query is one move of a per-example state machine (``_query``): ``_new_circle`` where
a circle starts, ``_angle`` and ``_query_point`` for the query of the example's phase, then
one pure function per phase for its move (``_after_search``, ``_after_extend``,
``_after_refine``, ``_after_noise``, ``_after_blend``), selected by phase with ``where``.

Every query point is clipped to the box and, for an example judged on the 8-bit grid, rounded
to it (:func:`jaxbundle.core.norms.snap_to_grid`) before the oracle sees it, so the image the
oracle labels is the one the bundle judges; ``x_b`` (``state.x``, the step's candidate) is
always the closest such image the oracle has labelled wrong. The budget is exact and static:
``queries = restarts * (init_queries + num_steps * queries_per_step)``.

Defaults follow the paper: ``θ_max`` = 30°, ``rho = 0.98``, ``history = 100`` (its
``n_ortho``), ``search_steps = 7`` (its binary-search length), DCT directions with
``frequency_ratio = 0.5``, ``gamma = 0.01`` (its ``BS_gamma``); ``trials = 3`` (our reading of
its ``T``). The factory derives
``num_steps = (queries // restarts - init_queries) // queries_per_step``: with the default
5,000 queries, ``init_queries = 20`` and ``queries_per_step = 10``, that is 498 steps and
5,000 queries. The paper's optional boundary interpolation and distance line search are not
implemented.

Memory: the direction buffer holds ``history`` images per example (``B * history * D``
floats), and each query re-orthogonalises a candidate direction against it; lower
``history`` for large images.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxbundle.core import norms
from jaxbundle.attacks.base import Attack, Candidate, LabelOracle, check_count, query_attack
from jaxbundle.attacks.decision_based._surfree_geometry import (
    circle_point,
    orthogonalize,
    sample_directions,
)

__all__ = [
    "SurFreeConfig",
    "SurFreeState",
    "BASES",
    "SEARCH",
    "REFINE",
    "NOISE",
    "BLEND",
    "EXTEND",
    "init_queries",
    "sample_directions",
    "orthogonalize",
    "circle_point",
    "init",
    "step",
    "surfree",
]

BASES = ("dct", "gaussian")
# Phases of the per-example search (SurFreeState.phase).
SEARCH = 0  # angle search on the current circle (index = trial; index 0 draws a new direction)
REFINE = 1  # bisection on the angle (index = bisection queries done)
NOISE = 2  # no adversarial point yet: try a fresh noise image
BLEND = 3  # bisection on x0 + (1 - p) (noise - x0) from a fooling noise image
EXTEND = 4  # past a success at the largest angle: step the angle on until one is not adversarial


class SurFreeConfig(NamedTuple):
    num_steps: int
    queries_per_step: int  # oracle queries (inner iterations) per step
    init_trials: int  # uniform-noise images tried in init
    init_search_steps: int  # bisection queries on a noise blend (init, and BLEND phase)
    trials: int  # angles per sign in the angle search (the paper's T)
    search_steps: int  # most bisection queries on the angle (REFINE phase)
    gamma: float  # early stop of the bisections (the reference's BS_gamma); 0: none
    theta_max: float  # initial largest angle, radians
    rho: float  # theta_max adaptation factor, in (0, 1)
    history: int  # previous directions kept for Gram-Schmidt (the paper's n_ortho)
    basis: str  # "dct" (low-frequency DCT) or "gaussian"
    frequency_ratio: float  # share of DCT rows / columns kept, in (0, 1]


class SurFreeState(NamedTuple):
    x: jax.Array  # [B, ...] closest adversarial point so far (quantised), or x0 if none yet
    x0: jax.Array  # [B, ...] clean images
    y: jax.Array  # [B] labels
    phase: jax.Array  # int32 [B]: SEARCH, EXTEND, REFINE, NOISE or BLEND
    index: jax.Array  # int32 [B]: trial (SEARCH) or bisection queries done (REFINE, BLEND)
    u: jax.Array  # [B, D] unit r = x_b - x0 of the current circle (BLEND: noise - x0)
    v: jax.Array  # [B, D] unit direction of the current circle, orthogonal to u
    dist: jax.Array  # [B] ||r|| of the current circle (BLEND: ||noise - x0||)
    lo: jax.Array  # [B] bisection: adversarial end (|theta|, or p for BLEND)
    hi: jax.Array  # [B] bisection: non-adversarial end (EXTEND: not known yet)
    sign: jax.Array  # [B] +1 / -1: side of the circle being refined
    theta_max: jax.Array  # [B] current largest angle, radians
    directions: jax.Array  # [B, history, D] unit directions drawn lately (zeros: empty slots)
    drawn: jax.Array  # int32 [B] directions drawn so far (selects the slot to overwrite)
    key: jax.Array  # [B] PRNG keys


def init_queries(config: SurFreeConfig) -> int:
    """Oracle calls of :func:`init` per example."""
    return config.init_trials + config.init_search_steps


def _quantized(x: jax.Array, x0: jax.Array, grid: jax.Array | None) -> jax.Array:
    """A query point: clipped to the box and rounded to the 8-bit grid where the example is
    judged on it (``grid``, the judging mask)."""
    return norms.snap_to_grid(norms.project_box(x), x0, grid=grid)


def _fooled(model: LabelOracle, x: jax.Array, y: jax.Array) -> jax.Array:
    return model.label(x) != y


def _noise(keys: jax.Array, n: int, x0: jax.Array, grid: jax.Array | None) -> jax.Array:
    """``n`` uniform-noise images per example on the pixel grid, ``[n, B, ...]``."""
    split = jax.vmap(lambda k: jax.random.split(k, n))(keys)  # [B, n]
    noise = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k, x0.shape[1:])))(split)
    return jax.vmap(lambda z: _quantized(z, x0, grid))(jnp.swapaxes(noise, 0, 1))


def init(config: SurFreeConfig, keys, x0, y, eps, model: LabelOracle, restart) -> SurFreeState:
    del eps, restart
    split = jax.vmap(jax.random.split)(keys)
    key, noise_keys = split[:, 0], split[:, 1]
    shape = x0.shape[1:]
    noise = _noise(noise_keys, config.init_trials, x0, model.grid)  # [n, B, ...]
    # One oracle call per noise image (a batch of n * B images: n queries per example).
    batch = noise.reshape((-1,) + shape)
    fooled = _fooled(model, batch, jnp.tile(y, config.init_trials)).reshape(config.init_trials, -1)
    found = jnp.any(fooled, axis=0)
    first = jnp.argmax(fooled, axis=0)  # first adversarial noise (0 when none)
    start = jnp.take_along_axis(noise, first.reshape((1, -1) + (1,) * len(shape)), axis=0)[0]

    dim = math.prod(shape)

    def bisect(carry, _):
        # Here lo is the clean end (t = 0) and hi the adversarial one (t = 1). The query is
        # made every time (init's count is static); once the stopping rule holds it is ignored.
        lo, hi, x_adv = carry
        mid = (lo + hi) / 2
        x_mid = _quantized(x0 + norms.per_example(mid, x0) * (start - x0), x0, model.grid)
        active = ~_blend_converged(config, lo, hi, dim)
        adv = _fooled(model, x_mid, y)
        lo = jnp.where(active & ~adv, mid, lo)
        hi = jnp.where(active & adv, mid, hi)
        x_adv = jnp.where(norms.per_example(active & adv, x0), x_mid, x_adv)
        return (lo, hi, x_adv), None

    zeros, ones = jnp.zeros(y.shape, x0.dtype), jnp.ones(y.shape, x0.dtype)
    (_, _, x_adv), _ = jax.lax.scan(
        bisect, (zeros, ones, start), None, length=config.init_search_steps
    )
    x = jnp.where(norms.per_example(found, x0), x_adv, x0)
    b, d = y.shape[0], dim
    zeros_bd = jnp.zeros((b, d), jnp.float32)
    return SurFreeState(
        x=x,
        x0=x0,
        y=y,
        phase=jnp.where(found, SEARCH, NOISE).astype(jnp.int32),
        index=jnp.zeros(y.shape, jnp.int32),
        u=zeros_bd,
        v=zeros_bd,
        dist=zeros,
        lo=zeros,
        hi=ones,
        sign=ones,
        theta_max=jnp.full(y.shape, config.theta_max, jnp.float32),
        directions=jnp.zeros((b, config.history, d), jnp.float32),
        drawn=jnp.zeros(y.shape, jnp.int32),
        key=key,
    )


class _Next(NamedTuple):
    """The fields a phase's move may change (``[B]``, ``u`` ``[B, D]``)."""

    phase: jax.Array
    index: jax.Array
    lo: jax.Array
    hi: jax.Array
    sign: jax.Array
    theta_max: jax.Array
    u: jax.Array
    dist: jax.Array


def _stay(state: SurFreeState) -> _Next:
    return _Next(state.phase, state.index, state.lo, state.hi, state.sign, state.theta_max,
                 state.u, state.dist)


def _angle_converged(config: SurFreeConfig, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """The reference's early stop of the angle bisection (``_alpha_binary_search``): stop once
    ``|alpha(hi) - alpha(lo)| <= gamma`` with ``alpha(θ) = 1 - cos θ`` (never when
    ``gamma = 0``)."""
    gap = jnp.abs(jnp.cos(hi) - jnp.cos(lo))
    return (gap <= config.gamma) & (config.gamma > 0)


def _blend_converged(config: SurFreeConfig, lo: jax.Array, hi: jax.Array, dim: int) -> jax.Array:
    """The reference's early stop of the blend bisection (``_binary_search``): stop once
    ``hi - lo <= gamma / (D sqrt D)`` (never when ``gamma = 0``)."""
    return (hi - lo <= config.gamma / (dim * math.sqrt(dim))) & (config.gamma > 0)


def _refine_or_search(config: SurFreeConfig, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """REFINE on the angles ``[lo, hi]``, or straight back to SEARCH when no bisection is due
    (``search_steps = 0``, or the interval already meets the stopping rule)."""
    done = _angle_converged(config, lo, hi) | (config.search_steps == 0)
    return jnp.where(done, SEARCH, REFINE)


def _new_circle(config: SurFreeConfig, state: SurFreeState, keys: jax.Array) -> SurFreeState:
    """Phase SEARCH, trial 0: the circle through ``x_b`` with a fresh direction ``v``
    (orthogonal to ``u`` and the buffer, then stored in it); others unchanged."""
    fresh = (state.phase == SEARCH) & (state.index == 0)
    r = norms.flat(state.x) - norms.flat(state.x0)
    u = norms.unit(r)
    t = sample_directions(keys, state.x0.shape[1:], config.basis, config.frequency_ratio)
    v = orthogonalize(t, state.directions, u)
    slot = jax.nn.one_hot(state.drawn % config.history, config.history, dtype=jnp.bool_)
    slot = slot & fresh[:, None]
    return state._replace(
        u=jnp.where(fresh[:, None], u, state.u),
        v=jnp.where(fresh[:, None], v, state.v),
        dist=jnp.where(fresh, jnp.sqrt(norms.dot(r, r)), state.dist),
        directions=jnp.where(slot[:, :, None], v[:, None, :], state.directions),
        drawn=state.drawn + fresh.astype(jnp.int32),
    )


def _search_angle(config: SurFreeConfig, state: SurFreeState) -> jax.Array:
    """SEARCH: trial ``index`` is ``±θ_max (1 - (index // 2) / T)``, + first."""
    level = (state.index // 2).astype(jnp.float32)
    sign = jnp.where(state.index % 2 == 0, 1.0, -1.0)
    return sign * state.theta_max * (1.0 - level / config.trials)


def _extend_angle(config: SurFreeConfig, state: SurFreeState) -> jax.Array:
    """EXTEND: one step ``θ_max / T`` past the adversarial angle, capped at π/2 (``x0``)."""
    return state.sign * jnp.minimum(state.lo + state.theta_max / config.trials, jnp.pi / 2)


def _angle(config: SurFreeConfig, state: SurFreeState) -> jax.Array:
    """The signed angle each example queries on its circle (REFINE: the bisection's middle)."""
    theta = jnp.where(state.phase == SEARCH, _search_angle(config, state),
                      state.sign * (state.lo + state.hi) / 2)
    return jnp.where(state.phase == EXTEND, _extend_angle(config, state), theta)


def _query_point(state: SurFreeState, theta: jax.Array, noise: jax.Array, grid) -> jax.Array:
    """Each example's query image: on its circle at ``theta`` (SEARCH, EXTEND, REFINE), on the
    noise blend ``x0 + (1 - p)(noise - x0)`` at the bisection's middle ``p`` (BLEND), or the
    fresh noise image (NOISE); clipped and rounded like every query."""
    x0 = norms.flat(state.x0)
    on_circle = circle_point(x0, state.u, state.v, state.dist, theta)
    mid = (state.lo + state.hi) / 2
    on_blend = x0 + ((1.0 - mid) * state.dist)[:, None] * state.u
    point = jnp.where((state.phase == BLEND)[:, None], on_blend, on_circle)
    point = _quantized(point.reshape(state.x0.shape), state.x0, grid)
    return jnp.where(norms.per_example(state.phase == NOISE, point), noise, point)


def _after_search(config: SurFreeConfig, state: SurFreeState, theta, adv) -> _Next:
    """SEARCH. An adversarial trial sets the side and ``θ_max <- θ_max / rho``; at the
    largest angle (trials 0 and 1) the next larger one is unknown, so EXTEND; below it, the
    next larger angle ``|θ| + θ_max / T`` failed on both sides, so REFINE on ``[|θ|, that]``.
    All ``2T`` trials failed: ``θ_max <- rho θ_max`` and a new circle. Else the next trial."""
    index = state.index + 1
    lo = jnp.abs(theta)
    largest = state.index < 2
    hi = jnp.minimum(lo + state.theta_max / config.trials, jnp.pi / 2)
    found = _Next(
        phase=jnp.where(largest, jnp.where(lo < jnp.pi / 2, EXTEND, SEARCH),
                        _refine_or_search(config, lo, hi)),
        index=jnp.zeros_like(index),
        lo=lo,
        hi=jnp.where(largest, jnp.pi / 2, hi),
        sign=jnp.sign(theta),
        theta_max=jnp.minimum(state.theta_max / config.rho, jnp.pi / 2),
        u=state.u,
        dist=state.dist,
    )
    failed = index == 2 * config.trials
    missed = _stay(state)._replace(
        index=jnp.where(failed, 0, index),
        theta_max=jnp.where(failed, state.theta_max * config.rho, state.theta_max),
    )
    return norms.tree_where(adv, found, missed)


def _after_extend(config: SurFreeConfig, state: SurFreeState, theta, adv) -> _Next:
    """EXTEND (the reference's upper-range search in ``_alpha_binary_search``): an adversarial
    angle becomes ``lo`` and the search steps on (back to SEARCH once it reaches π/2); the
    first non-adversarial one is ``hi``, and REFINE bisects ``[lo, hi]``."""
    angle = jnp.abs(theta)
    lo = jnp.where(adv, angle, state.lo)
    hi = jnp.where(adv, state.hi, angle)
    phase = jnp.where(adv, jnp.where(angle < jnp.pi / 2, EXTEND, SEARCH),
                      _refine_or_search(config, lo, hi))
    return _stay(state)._replace(phase=phase, index=jnp.zeros_like(state.index), lo=lo, hi=hi)


def _after_refine(config: SurFreeConfig, state: SurFreeState, adv) -> _Next:
    """REFINE: bisection on ``|θ|`` (``lo`` adversarial, ``hi`` not) until ``search_steps``
    queries or the stopping rule (:func:`_angle_converged`); then a new circle."""
    mid = (state.lo + state.hi) / 2
    lo, hi = jnp.where(adv, mid, state.lo), jnp.where(adv, state.hi, mid)
    index = state.index + 1
    done = (index >= config.search_steps) | _angle_converged(config, lo, hi)
    return _stay(state)._replace(phase=jnp.where(done, SEARCH, REFINE),
                                 index=jnp.where(done, 0, index), lo=lo, hi=hi)


def _after_noise(config: SurFreeConfig, state: SurFreeState, noise, adv) -> _Next:
    """NOISE: a fooling noise image starts a BLEND bisection towards ``x0`` (``u``, ``dist``:
    the unit and length of ``noise - x0``); else another noise image next time."""
    r = norms.flat(noise) - norms.flat(state.x0)
    zeros, ones = jnp.zeros_like(state.lo), jnp.ones_like(state.hi)
    blend = jnp.where(_blend_converged(config, zeros, ones, r.shape[1])
                      | (config.init_search_steps == 0), SEARCH, BLEND)
    fooled = _stay(state)._replace(phase=blend, lo=zeros, hi=ones, u=norms.unit(r),
                                   dist=jnp.sqrt(norms.dot(r, r)))
    return norms.tree_where(adv, fooled, _stay(state))._replace(index=jnp.zeros_like(state.index))


def _after_blend(config: SurFreeConfig, state: SurFreeState, adv) -> _Next:
    """BLEND: bisection on ``p`` (``lo`` adversarial, ``hi`` not) until ``init_search_steps``
    queries or the stopping rule (:func:`_blend_converged`); then the angle search."""
    mid = (state.lo + state.hi) / 2
    lo, hi = jnp.where(adv, mid, state.lo), jnp.where(adv, state.hi, mid)
    index = state.index + 1
    done = (index >= config.init_search_steps) | _blend_converged(config, lo, hi, state.u.shape[1])
    return _stay(state)._replace(phase=jnp.where(done, SEARCH, BLEND),
                                 index=jnp.where(done, 0, index), lo=lo, hi=hi)


def _query(config: SurFreeConfig, state: SurFreeState, model: LabelOracle) -> SurFreeState:
    """One oracle query per example: a new circle where one starts, the query of each
    example's phase, the closest adversarial point kept, and the phase's move."""
    split = jax.vmap(lambda k: jax.random.split(k, 3))(state.key)
    key, dir_keys, noise_keys = split[:, 0], split[:, 1], split[:, 2]
    state = _new_circle(config, state, dir_keys)
    theta = _angle(config, state)
    noise = _noise(noise_keys, 1, state.x0, model.grid)[0]
    point = _query_point(state, theta, noise, model.grid)
    adv = _fooled(model, point, state.y)  # the query

    closer = norms.norm(point - state.x0, "l2") < norms.norm(state.x - state.x0, "l2")
    keep = adv & (closer | (state.phase == NOISE))
    moves = {
        SEARCH: _after_search(config, state, theta, adv),
        EXTEND: _after_extend(config, state, theta, adv),
        REFINE: _after_refine(config, state, adv),
        NOISE: _after_noise(config, state, noise, adv),
        BLEND: _after_blend(config, state, adv),
    }
    move = moves[SEARCH]
    for phase, other in moves.items():
        move = norms.tree_where(state.phase == phase, other, move)
    return state._replace(
        x=jnp.where(norms.per_example(keep, point), point, state.x),
        phase=move.phase.astype(jnp.int32),
        index=move.index.astype(jnp.int32),
        lo=move.lo,
        hi=move.hi,
        sign=move.sign,
        theta_max=move.theta_max,
        u=move.u,
        dist=move.dist,
        key=key,
    )


def step(config: SurFreeConfig, state: SurFreeState, model: LabelOracle):
    """``queries_per_step`` queries (a ``lax.scan``); the candidate is the closest adversarial."""
    state, _ = jax.lax.scan(
        lambda s, _: (_query(config, s, model), None), state, None,
        length=config.queries_per_step,
    )
    return state, Candidate(state.x, None)


def surfree(
    queries: int = 5000,
    restarts: int = 1,
    queries_per_step: int = 10,
    trials: int = 3,
    search_steps: int = 7,
    gamma: float = 0.01,
    theta_max: float = 30.0,
    rho: float = 0.98,
    history: int = 100,
    basis: str = "dct",
    frequency_ratio: float = 0.5,
    init_trials: int = 10,
    init_search_steps: int = 10,
    norm: str = "l2",
    name: str | None = None,
) -> Attack:
    """SurFree with a hard query budget.

    The algorithm: :mod:`jaxbundle.attacks.decision_based.surfree`. Paper: Maho, Furon & Le Merrer
    2021, "SurFree: a fast surrogate-free black-box attack".

    Args:
      queries: model queries per example, all restarts included; ``num_steps`` is the
        largest with ``restarts * (init_queries + num_steps * queries_per_step) <= queries``
        (default 5,000: 498 steps, 5,000 queries).
      restarts: independent runs from different keys (a vmap axis in the bundler), sharing
        the budget.
      queries_per_step: oracle queries per step (the search runs on across steps; this only
        sets how often the bundler scores ``x_b``).
      trials: largest angles per sign of the angle search (the paper's ``T``).
      search_steps: most bisection queries on the angle after a successful angle search
        (the reference's ``BS_max_iteration``).
      gamma: the reference's ``BS_gamma``: the angle bisection stops once
        ``|cos(hi) - cos(lo)| <= gamma``, the blend bisections once ``hi - lo <= gamma / (D
        sqrt D)``; the queries left go on to the next direction. Default 0.01 (the
        reference's); 0 runs every bisection to its length.
      theta_max: initial largest angle, in degrees (the paper's 30).
      rho: ``θ_max`` adaptation factor in (0, 1) (the paper's 0.98).
      history: previous directions the new one is made orthogonal to (the paper's 100).
      basis: ``"dct"`` (low-frequency DCT directions, the paper's) or ``"gaussian"``.
      frequency_ratio: share of DCT rows and columns kept, in (0, 1].
      init_trials: uniform-noise images tried to find a starting adversarial point.
      init_search_steps: bisection queries from a fooling noise image towards ``x0``.
      norm: only ``"l2"``.
      name: report name; default ``"surfree"``.

    Returns:
      A decision-based, min-norm :class:`~jaxbundle.attacks.base.Attack`.
    """
    config = _checked_config(
        queries=queries, restarts=restarts, queries_per_step=queries_per_step, trials=trials,
        search_steps=search_steps, gamma=gamma, theta_max=theta_max, rho=rho, history=history,
        basis=basis, frequency_ratio=frequency_ratio, init_trials=init_trials,
        init_search_steps=init_search_steps, norm=norm,
    )
    first, per_step = init_queries(config), config.queries_per_step
    steps = _steps_in_budget(config, queries, restarts)
    config = config._replace(num_steps=steps)
    return query_attack("decision-based", name or "surfree", "l2", steps, init, step, config,
                        restarts=restarts, goal="min_norm", init_queries=first,
                        queries_per_step=per_step)


def _checked_config(
    *,
    queries: int,
    restarts: int,
    queries_per_step: int,
    trials: int,
    search_steps: int,
    gamma: float,
    theta_max: float,
    rho: float,
    history: int,
    basis: str,
    frequency_ratio: float,
    init_trials: int,
    init_search_steps: int,
    norm: str,
) -> SurFreeConfig:
    """:func:`surfree`'s arguments checked, as a config with ``num_steps`` 0 (not yet known)."""
    if norms.check_norm(norm) != "l2":
        raise ValueError(f"surfree supports norm 'l2' only, not {norm!r}")
    if basis not in BASES:
        raise ValueError(f"surfree basis must be one of {BASES}, got {basis!r}")
    for label, value in (
        ("queries", queries),
        ("restarts", restarts),
        ("queries_per_step", queries_per_step),
        ("trials", trials),
        ("history", history),
        ("init_trials", init_trials),
    ):
        check_count("surfree", label, value)
    for label, value in (("search_steps", search_steps), ("init_search_steps", init_search_steps)):
        check_count("surfree", label, value, minimum=0)
    if not 0 <= gamma < 1:
        raise ValueError(f"surfree gamma must be in [0, 1), got {gamma}")
    if not 0 < theta_max <= 90:
        raise ValueError(f"surfree theta_max must be in (0, 90] degrees, got {theta_max}")
    if not 0 < rho < 1:
        raise ValueError(f"surfree rho must be in (0, 1), got {rho}")
    if not 0 < frequency_ratio <= 1:
        raise ValueError(f"surfree frequency_ratio must be in (0, 1], got {frequency_ratio}")
    return SurFreeConfig(
        num_steps=0,
        queries_per_step=int(queries_per_step),
        init_trials=int(init_trials),
        init_search_steps=int(init_search_steps),
        trials=int(trials),
        search_steps=int(search_steps),
        gamma=float(gamma),
        theta_max=float(math.radians(theta_max)),
        rho=float(rho),
        history=int(history),
        basis=basis,
        frequency_ratio=float(frequency_ratio),
    )


def _steps_in_budget(config: SurFreeConfig, queries: int, restarts: int) -> int:
    """The most steps with ``restarts * (init_queries + steps * queries_per_step) <= queries``
    (``ValueError`` when not even one fits)."""
    first, per_step = init_queries(config), config.queries_per_step
    steps = (queries // restarts - first) // per_step
    if steps < 1:
        raise ValueError(
            f"surfree queries={queries} leaves no step: each of the {restarts} restarts needs "
            f"{first} queries for init and {per_step} per step, so queries >= "
            f"{restarts * (first + per_step)}"
        )
    return steps
