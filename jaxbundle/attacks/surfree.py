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
2. Sign / angle search. The circle with diameter ``[x0, x_b]`` in the plane ``(u, v)``,
   ``z(θ) = x0 + ||r|| cos θ (u cos θ + v sin θ)``, lies closer to ``x0`` than ``x_b``
   (``||z(θ) - x0|| = ||r|| cos θ``). Up to ``2 * trials`` queries try
   ``θ = +θ_max (1 - k / trials), -θ_max (1 - k / trials)``, ``k = 0, 1, ...``, stopping at
   the first adversarial one; if none is, ``θ_max <- rho θ_max`` and back to 1.
3. Refinement. ``search_steps`` bisection queries on ``|θ|`` between the adversarial angle and
   the next larger one ``|θ| + θ_max / trials`` (capped at π/2, which is ``x0``);
   ``θ_max <- θ_max / rho`` (capped at π/2); back to 1.

Every query point is clipped to the box and, for an example judged on the 8-bit grid, rounded
to it (:func:`jaxbundle.norms.snap_to_grid`) before the oracle sees it, so the image the
oracle labels is the one the bundle judges; ``x_b`` (``state.x``, the step's candidate) is
always the closest such image the oracle has labelled wrong. The budget is exact and static:
``queries = restarts * (init_queries + num_steps * queries_per_step)``.

Defaults follow the paper: ``θ_max`` = 30°, ``rho = 0.98``, ``history = 100`` (its
``n_ortho``), ``search_steps = 7`` (its binary-search length), DCT directions with
``frequency_ratio = 0.5``; ``trials = 3`` (its ``T``, as we read it). The factory derives
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

from jaxbundle import norms
from jaxbundle.attacks.base import Attack, Candidate, LabelOracle

__all__ = [
    "SurFreeConfig",
    "SurFreeState",
    "BASES",
    "SEARCH",
    "REFINE",
    "NOISE",
    "BLEND",
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


class SurFreeConfig(NamedTuple):
    num_steps: int
    queries_per_step: int  # oracle queries (inner iterations) per step
    init_trials: int  # uniform-noise images tried in init
    init_search_steps: int  # bisection queries on a noise blend (init, and BLEND phase)
    trials: int  # angles per sign in the angle search (the paper's T)
    search_steps: int  # bisection queries on the angle (REFINE phase)
    theta_max: float  # initial largest angle, radians
    rho: float  # theta_max adaptation factor, in (0, 1)
    history: int  # previous directions kept for Gram-Schmidt (the paper's n_ortho)
    basis: str  # "dct" (low-frequency DCT) or "gaussian"
    frequency_ratio: float  # share of DCT rows / columns kept, in (0, 1]


class SurFreeState(NamedTuple):
    x: jax.Array  # [B, ...] closest adversarial point so far (quantised), or x0 if none yet
    x0: jax.Array  # [B, ...] clean images
    y: jax.Array  # [B] labels
    phase: jax.Array  # int32 [B]: SEARCH, REFINE, NOISE or BLEND
    index: jax.Array  # int32 [B]: trial (SEARCH) or bisection queries done (REFINE, BLEND)
    u: jax.Array  # [B, D] unit r = x_b - x0 of the current circle (BLEND: noise - x0)
    v: jax.Array  # [B, D] unit direction of the current circle, orthogonal to u
    dist: jax.Array  # [B] ||r|| of the current circle (BLEND: ||noise - x0||)
    lo: jax.Array  # [B] bisection: adversarial end (|theta|, or p for BLEND)
    hi: jax.Array  # [B] bisection: non-adversarial end
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


def _low_frequency_mask(shape: tuple[int, ...], ratio: float) -> jax.Array:
    """1 on the first ``ceil(ratio * n)`` DCT rows and columns of ``[H, W, ...]``, else 0."""
    rows = jnp.arange(shape[0]) < math.ceil(ratio * shape[0])
    cols = jnp.arange(shape[1]) < math.ceil(ratio * shape[1])
    mask = (rows[:, None] & cols[None, :]).astype(jnp.float32)
    return mask.reshape(mask.shape + (1,) * (len(shape) - 2))


def sample_directions(
    keys: jax.Array, shape: tuple[int, ...], basis: str, frequency_ratio: float
) -> jax.Array:
    """One random direction per key, flattened ``[B, D]`` (not normalised).

    ``"dct"``: Gaussian coefficients on the low-frequency block of the orthonormal 2-D DCT over
    the first two axes of ``shape`` (``[H, W, C]`` images), inverse-transformed; inputs with
    fewer than two axes use white noise. ``"gaussian"``: white Gaussian noise.
    """
    noise = jax.vmap(lambda k: jax.random.normal(k, shape))(keys)
    if basis == "dct" and len(shape) >= 2:
        coeffs = noise * _low_frequency_mask(shape, frequency_ratio)[None]
        noise = jax.scipy.fft.idctn(coeffs, axes=(1, 2), norm="ortho")
    return norms.flat(noise)


def orthogonalize(t: jax.Array, directions: jax.Array, u: jax.Array) -> jax.Array:
    """Unit ``t`` ``[B, D]`` made orthogonal to ``u`` and to the buffer ``[B, L, D]``.

    The buffer rows are orthonormal (or zero), so Gram-Schmidt takes one projection for them
    and one for ``u``'s part outside their span; a last projection on ``u`` removes the
    float32 residue, which the circle's geometry needs exactly.
    """

    def off_buffer(a):
        return a - jnp.einsum("bl,bld->bd", jnp.einsum("bd,bld->bl", a, directions), directions)

    u_rest = norms.unit(off_buffer(u))
    v = off_buffer(t)
    v = v - norms.dot(v, u_rest)[:, None] * u_rest
    v = v - norms.dot(v, u)[:, None] * u
    return norms.unit(v)


def circle_point(
    x0: jax.Array, u: jax.Array, v: jax.Array, dist: jax.Array, theta: jax.Array
) -> jax.Array:
    """``x0 + dist cos θ (u cos θ + v sin θ)`` per example, flat ``[B, D]`` (not clipped)."""
    c, s = jnp.cos(theta)[:, None], jnp.sin(theta)[:, None]
    return x0 + dist[:, None] * c * (u * c + v * s)


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

    def bisect(carry, _):
        lo, hi, x_adv = carry
        mid = (lo + hi) / 2
        x_mid = _quantized(x0 + norms.per_example(mid, x0) * (start - x0), x0, model.grid)
        adv = _fooled(model, x_mid, y)
        lo = jnp.where(adv, lo, mid)
        hi = jnp.where(adv, mid, hi)
        x_adv = jnp.where(norms.per_example(adv, x0), x_mid, x_adv)
        return (lo, hi, x_adv), None

    zeros, ones = jnp.zeros(y.shape, x0.dtype), jnp.ones(y.shape, x0.dtype)
    (_, _, x_adv), _ = jax.lax.scan(
        bisect, (zeros, ones, start), None, length=config.init_search_steps
    )
    x = jnp.where(norms.per_example(found, x0), x_adv, x0)
    b, d = y.shape[0], math.prod(shape)
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


def _query(config: SurFreeConfig, state: SurFreeState, model: LabelOracle) -> SurFreeState:
    """One oracle query per example: one move of each example's search."""
    shape = state.x0.shape
    x0 = norms.flat(state.x0)
    split = jax.vmap(lambda k: jax.random.split(k, 3))(state.key)
    key, dir_keys, noise_keys = split[:, 0], split[:, 1], split[:, 2]

    # 1. A new circle where the angle search starts over.
    fresh = (state.phase == SEARCH) & (state.index == 0)
    r = norms.flat(state.x) - x0
    u_new = norms.unit(r)
    t = sample_directions(dir_keys, shape[1:], config.basis, config.frequency_ratio)
    v_new = orthogonalize(t, state.directions, u_new)
    slot = jax.nn.one_hot(state.drawn % config.history, config.history, dtype=jnp.bool_)
    slot = slot & fresh[:, None]
    directions = jnp.where(slot[:, :, None], v_new[:, None, :], state.directions)
    u = jnp.where(fresh[:, None], u_new, state.u)
    v = jnp.where(fresh[:, None], v_new, state.v)
    dist = jnp.where(fresh, jnp.sqrt(norms.dot(r, r)), state.dist)

    # 2. The query point of each phase.
    level = (state.index // 2).astype(jnp.float32)
    trial_sign = jnp.where(state.index % 2 == 0, 1.0, -1.0)
    trial = trial_sign * state.theta_max * (1.0 - level / config.trials)
    mid = (state.lo + state.hi) / 2
    theta = jnp.where(state.phase == SEARCH, trial, state.sign * mid)
    on_circle = circle_point(x0, u, v, dist, theta)
    on_blend = x0 + ((1.0 - mid) * dist)[:, None] * u
    noise = _noise(noise_keys, 1, state.x0, model.grid)[0]
    point = jnp.where((state.phase == BLEND)[:, None], on_blend, on_circle).reshape(shape)
    at_noise = norms.per_example(state.phase == NOISE, point)
    point = jnp.where(at_noise, noise, _quantized(point, state.x0, model.grid))
    adv = _fooled(model, point, state.y)

    # 3. Keep the closest adversarial point; move each example's search on.
    closer = norms.norm(point - state.x0, "l2") < norms.norm(state.x - state.x0, "l2")
    keep = adv & (closer | (state.phase == NOISE))
    x = jnp.where(norms.per_example(keep, point), point, state.x)

    search, refine = state.phase == SEARCH, state.phase == REFINE
    noise_phase, blend = state.phase == NOISE, state.phase == BLEND
    index = state.index + 1
    # SEARCH: success -> REFINE on [|theta|, |theta| + theta_max / T]; all failed -> new circle.
    found_angle = search & adv
    failed = search & ~adv & (index == 2 * config.trials)
    lo = jnp.where(found_angle, jnp.abs(theta), state.lo)
    hi = jnp.where(
        found_angle, jnp.minimum(jnp.abs(theta) + state.theta_max / config.trials, jnp.pi / 2),
        state.hi,
    )
    sign = jnp.where(found_angle, jnp.sign(theta), state.sign)
    theta_max = jnp.where(
        found_angle, jnp.minimum(state.theta_max / config.rho, jnp.pi / 2), state.theta_max
    )
    theta_max = jnp.where(failed, state.theta_max * config.rho, theta_max)
    # REFINE / BLEND: bisection.
    bisecting = refine | blend
    lo = jnp.where(bisecting & adv, mid, lo)
    hi = jnp.where(bisecting & ~adv, mid, hi)
    refined = (refine & (index == config.search_steps)) | (
        blend & (index == config.init_search_steps)
    )
    # NOISE: a fooling noise image starts a BLEND bisection towards x0.
    fooled_noise = noise_phase & adv
    r_noise = norms.flat(noise) - x0
    u = jnp.where(fooled_noise[:, None], norms.unit(r_noise), u)
    dist = jnp.where(fooled_noise, jnp.sqrt(norms.dot(r_noise, r_noise)), dist)
    lo = jnp.where(fooled_noise, 0.0, lo)
    hi = jnp.where(fooled_noise, 1.0, hi)

    refine_next = jnp.where(config.search_steps > 0, REFINE, SEARCH)
    blend_next = jnp.where(config.init_search_steps > 0, BLEND, SEARCH)
    phase = state.phase
    phase = jnp.where(found_angle, refine_next, phase)
    phase = jnp.where(failed | refined, SEARCH, phase)
    phase = jnp.where(fooled_noise, blend_next, phase)
    restart = found_angle | failed | refined | fooled_noise
    index = jnp.where(restart | noise_phase, 0, index)
    return state._replace(
        x=x,
        phase=phase.astype(jnp.int32),
        index=index.astype(jnp.int32),
        u=u,
        v=v,
        dist=dist,
        lo=lo,
        hi=hi,
        sign=sign,
        theta_max=theta_max,
        directions=directions,
        drawn=state.drawn + fresh.astype(jnp.int32),
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

    Args:
      queries: model queries per example, all restarts included; ``num_steps`` is the
        largest with ``restarts * (init_queries + num_steps * queries_per_step) <= queries``
        (default 5,000: 498 steps, 5,000 queries).
      restarts: independent runs from different keys (a vmap axis in the bundler), sharing
        the budget.
      queries_per_step: oracle queries per step (the search runs on across steps; this only
        sets how often the bundler scores ``x_b``).
      trials: largest angles per sign of the angle search (the paper's ``T``).
      search_steps: bisection queries on the angle after a successful angle search.
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
    if norms.check_norm(norm) != "l2":
        raise ValueError(f"surfree supports norm 'l2' only, not {norm!r}")
    if basis not in BASES:
        raise ValueError(f"surfree basis must be one of {BASES}, got {basis!r}")
    for label, value in (
        ("restarts", restarts),
        ("queries_per_step", queries_per_step),
        ("trials", trials),
        ("history", history),
        ("init_trials", init_trials),
    ):
        if value < 1:
            raise ValueError(f"surfree needs {label} >= 1, got {value}")
    for label, value in (("search_steps", search_steps), ("init_search_steps", init_search_steps)):
        if value < 0:
            raise ValueError(f"surfree needs {label} >= 0, got {value}")
    if not 0 < theta_max <= 90:
        raise ValueError(f"surfree theta_max must be in (0, 90] degrees, got {theta_max}")
    if not 0 < rho < 1:
        raise ValueError(f"surfree rho must be in (0, 1), got {rho}")
    if not 0 < frequency_ratio <= 1:
        raise ValueError(f"surfree frequency_ratio must be in (0, 1], got {frequency_ratio}")
    config = SurFreeConfig(
        num_steps=0,
        queries_per_step=int(queries_per_step),
        init_trials=int(init_trials),
        init_search_steps=int(init_search_steps),
        trials=int(trials),
        search_steps=int(search_steps),
        theta_max=float(math.radians(theta_max)),
        rho=float(rho),
        history=int(history),
        basis=basis,
        frequency_ratio=float(frequency_ratio),
    )
    first, per_step = init_queries(config), config.queries_per_step
    steps = (queries // restarts - first) // per_step
    if steps < 1:
        raise ValueError(
            f"surfree queries={queries} leaves no step: each of the {restarts} restarts needs "
            f"{first} queries for init and {per_step} per step, so queries >= "
            f"{restarts * (first + per_step)}"
        )
    config = config._replace(num_steps=steps)
    return Attack(
        name=name or "surfree",
        kind="decision-based",
        norm="l2",
        num_steps=steps,
        num_restarts=restarts,
        gradients_per_step=0,
        init=init,
        step=step,
        config=config,
        goal="min_norm",
        init_queries=first,
        queries_per_step=per_step,
    )
