"""RayS (Chen & Gu 2020, "RayS: A Ray Searching Method for Hard-label Adversarial Attack"): a
decision-based, untargeted, minimum-norm Linf attack.

The attacker sees predicted labels only (a :class:`~jaxbundle.attacks.base.LabelOracle`). It
searches over ray directions ``d in {-1, +1}^D``; the radius of a direction is the smallest
``r`` with ``label(x0 + r d) != y`` (images clipped to the box), and RayS minimises it:

* start from ``d = (1, ..., 1)``;
* hierarchical block flips: at stage ``s`` the flattened input is cut into blocks of
  ``ceil(D / 2^s)`` pixels (at most ``2^s`` blocks, the last one possibly shorter), visited in
  order; the trial direction flips the signs of one block of the best direction. After the
  last block the stage grows (blocks halve) until they hold one pixel each; from then on every
  stage flips single pixels, as in the reference;
* a trial is checked with ONE query just below the best radius; if it is not adversarial
  there it cannot improve and is rejected (the paper's fast check); if it is, it becomes the
  best direction and a binary search refines its radius.

Pixel grid. The image for radius level ``k`` is ``clip(x0 + k/255 d)``, rounded to the 8-bit
grid where ``x0`` is on it (:func:`jaxbundle.core.norms.snap_to_grid`, as the bundle judges it): its
Linf distortion is ``k/255`` (less where the box clips). Radii are therefore integer levels
``k in [0, 255]``, the check is at ``k_best - 1`` (the grid version of "strictly better than
``r_best``") and the binary search bisects levels until ``hi - lo = 1``: at most 8 queries
(``ceil(log2 256)``), capped by ``search_steps`` (default 8, so the search is exact). Before any
adversarial direction is known, ``k_best = 256`` and trials are checked at ``k = 255``
(radius 1: the corner of the box in direction ``d``).

Queries (exact, per example). The static program spends one query per step: a step is either
a check (of the next block flip) or one bisection of the running search, chosen per example
with ``where``; ``init`` spends one query on the start direction at radius 1. So
``init_queries = 1``, ``queries_per_step = 1`` and ``queries = restarts * (1 + steps)``; the
default ``steps=10000`` is the paper's query budget. A rejected trial costs 1 query and an
accepted one ``1 + (at most search_steps)``, as in the paper; nothing is wasted on padding.

Candidates: every queried image, ``Candidate(x_query, None)`` (the bundler computes logits
itself, uncounted); ``state.x`` is the best adversarial image so far (``x0`` before one is
found). The bundler's min-norm goal keeps the smallest adversarial candidate, so an example's
distortion is its best radius; the misclassify goal counts those within eps.

Details and deviations:

* Radii are pixel levels, not the paper's continuous binary search to a tolerance (see above).
* Blocks are the reference's (uclaml/RayS, ``attack_hard_label``): ``ceil(D / 2^s)`` pixels
  each over the flattened input (all channels), stage ``s`` ending after ``2^s`` blocks or at
  the end of the vector, and single pixels for good once ``2^s >= D``.
* Block order is the reference's: a channels-last image ``(H, W, C)`` is flattened channels
  first, ``(C, H, W)`` (:func:`block_order`), as PyTorch's tensors are, so for RGB stage 1's
  first block is the red plane and the top half of the green one (in channels-last order it
  would be the top half of the image in all three channels); for one channel (MNIST) the two
  orders are the same.
* Restart ``r > 0`` starts from a random sign vector instead of the all-ones direction.
* No early stop at ``r_best <= eps`` (the paper's robust-accuracy mode): the program is static
  and the min-norm goal wants the smallest radius anyway.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxbundle.core import norms
from jaxbundle.attacks.base import Attack, Candidate, LabelOracle, check_count, query_attack

__all__ = [
    "RaySConfig", "RaySState", "ray_image", "block_order", "block_size", "flip_mask", "init",
    "step", "rays",
]

LEVELS = norms.PIXEL_LEVELS  # radius levels: k / 255
NONE_FOUND = LEVELS + 1  # k_best before any adversarial direction is known


class RaySConfig(NamedTuple):
    num_steps: int  # queries after init (one per step)
    search_steps: int  # most bisections per accepted trial (8 makes the search exact)


class RaySState(NamedTuple):
    x: jax.Array  # [B, ...] best adversarial image so far (quantised), x0 before one is found
    x0: jax.Array  # [B, ...] clean images
    y: jax.Array  # [B] labels
    d: jax.Array  # [B, ...] best direction, +-1 per pixel
    k_best: jax.Array  # int32 [B] best radius in pixel levels; NONE_FOUND = none yet
    searching: jax.Array  # bool [B]: bisecting the radius of d (else: checking block flips)
    lo: jax.Array  # int32 [B] bisection: largest level known not adversarial along d
    iters: jax.Array  # int32 [B] bisections done in the running search
    stage: jax.Array  # int32 [B] block stage s: blocks of ceil(D / 2^s) pixels
    block: jax.Array  # int32 [B] index of the next block to flip, in [0, num_blocks(s, D))


def ray_image(
    x0: jax.Array, d: jax.Array, k: jax.Array, grid: jax.Array | None = None
) -> jax.Array:
    """``clip(x0 + k/255 d)`` per example, rounded to the grid where ``x0`` is on it
    (:func:`jaxbundle.core.norms.snap_to_grid`; ``grid``: the judging mask): the image at radius
    level ``k [B]``."""
    r = k.astype(x0.dtype) / LEVELS
    return norms.snap_to_grid(norms.project_box(x0 + norms.per_example(r, d) * d), x0, grid=grid)


def max_stage(dim: int) -> int:
    """The last stage: the smallest ``s`` with ``2^s >= dim`` (single pixels)."""
    return int(math.ceil(math.log2(dim))) if dim > 1 else 0


def block_size(stage: jax.Array, dim: int) -> jax.Array:
    """Pixels per block at ``stage``: ``ceil(D / 2^s)``, the reference's ``block_size``."""
    return (dim + jnp.left_shift(1, stage) - 1) // jnp.left_shift(1, stage)


def num_blocks(stage: jax.Array, dim: int) -> jax.Array:
    """Blocks at ``stage``: ``ceil(D / block_size)``, at most ``2^s`` (the last one may be
    shorter; the reference's stage ends at ``2^s`` blocks or at the end of the vector)."""
    size = block_size(stage, dim)
    return (dim + size - 1) // size


def block_order(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape whose C-order flattening numbers the pixels for the blocks: ``(C, H, W)`` for
    a channels-last image ``(H, W, C)`` (the reference flattens PyTorch's channels-first
    tensors, so a block is a run of one channel's rows, and the first half of the vector is the
    first channels), else ``shape`` itself (for one channel, or inputs of another rank, the
    order is the plain flattening)."""
    return (shape[2], shape[0], shape[1]) if len(shape) == 3 else shape


def from_block_order(mask: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``[B, *block_order(shape)]`` back to ``[B, *shape]`` (channels last again)."""
    return jnp.moveaxis(mask, 1, -1) if len(shape) == 3 else mask


def flip_mask(shape: tuple[int, ...], stage: jax.Array, block: jax.Array) -> jax.Array:
    """``[B, *shape]`` signs: -1 on block ``block`` of stage ``stage`` of the flat input,
    flattened channels first (:func:`block_order`, as the reference's ``sgn.view(B, D)`` of a
    ``(C, H, W)`` tensor): flat indices ``[j m, min(D, (j + 1) m))`` with
    ``m = ceil(D / 2^s)`` (:func:`block_size`), never empty for ``j < num_blocks``."""
    dim = math.prod(shape)
    size = block_size(stage, dim)  # [B], >= 1
    start = block * size
    end = jnp.minimum(start + size, dim)
    i = jnp.arange(dim, dtype=jnp.int32)[None, :]
    inside = (i >= start[:, None]) & (i < end[:, None])
    signs = jnp.where(inside, -1.0, 1.0).reshape((-1,) + block_order(shape))
    return from_block_order(signs, shape)


def _advance(stage: jax.Array, block: jax.Array, dim: int) -> tuple[jax.Array, jax.Array]:
    """The next (stage, block) of the hierarchical schedule; once blocks are single pixels the
    schedule stays there (the reference's later stages all have block size 1)."""
    block = block + 1
    next_stage = block >= num_blocks(stage, dim)
    stage = jnp.where(next_stage, jnp.minimum(stage + 1, max_stage(dim)), stage)
    return stage, jnp.where(next_stage, 0, block)


def init(config: RaySConfig, keys, x0, y, eps, model: LabelOracle, restart) -> RaySState:
    del config, eps
    batch = x0.shape[0]
    ones = jnp.ones_like(x0)
    random_signs = jax.vmap(lambda k: jax.random.rademacher(k, x0.shape[1:], dtype=x0.dtype))(keys)
    d = jnp.where(restart > 0, random_signs, ones)
    full = jnp.full((batch,), LEVELS, jnp.int32)
    x_far = ray_image(x0, d, full, model.grid)
    adv = model.label(x_far) != y  # 1 query: is the box corner along d adversarial?
    zeros = jnp.zeros((batch,), jnp.int32)
    return RaySState(
        x=jnp.where(norms.per_example(adv, x0), x_far, x0),
        x0=x0,
        y=y,
        d=d,
        k_best=jnp.where(adv, LEVELS, NONE_FOUND).astype(jnp.int32),
        searching=adv,
        lo=zeros,
        iters=zeros,
        stage=zeros,
        block=zeros,
    )


def step(config: RaySConfig, state: RaySState, model: LabelOracle):
    shape = state.x0.shape[1:]
    search = state.searching
    # Check mode: the best direction with one block flipped, just below the best radius.
    trial = state.d * flip_mask(shape, state.stage, state.block)
    check_level = jnp.clip(state.k_best - 1, 0, LEVELS)
    # Search mode: bisect (lo, k_best) along the best direction.
    mid = (state.lo + state.k_best) // 2
    direction = jnp.where(norms.per_example(search, trial), state.d, trial)
    level = jnp.where(search, mid, check_level)
    x_query = ray_image(state.x0, direction, level, model.grid)
    adv = model.label(x_query) != state.y  # the step's one query

    # Check: an adversarial trial becomes the best direction and starts a search.
    accepted = ~search & adv
    # Search: adversarial mid lowers k_best, else raises lo.
    improved = accepted | (search & adv)
    k_best = jnp.where(improved, level, state.k_best)
    lo = jnp.where(accepted, 0, jnp.where(search & ~adv, mid, state.lo))
    iters = jnp.where(accepted, 0, state.iters + search.astype(jnp.int32))
    still = (k_best - lo > 1) & (iters < config.search_steps)
    searching = jnp.where(search | accepted, still, False)
    # The schedule moves on after a rejected trial or a finished search.
    move = (~search & ~adv) | ((search | accepted) & ~searching)
    stage, block = _advance(state.stage, state.block, math.prod(shape))
    new_state = state._replace(
        x=jnp.where(norms.per_example(improved, x_query), x_query, state.x),
        d=jnp.where(norms.per_example(accepted, trial), trial, state.d),
        k_best=k_best,
        searching=searching,
        lo=lo,
        iters=iters,
        stage=jnp.where(move, stage, state.stage),
        block=jnp.where(move, block, state.block),
    )
    return new_state, Candidate(x_query, None)


def rays(
    steps: int = 10000,
    search_steps: int = 8,
    restarts: int = 1,
    name: str | None = None,
) -> Attack:
    """RayS: decision-based minimum-norm Linf attack by hierarchical sign-direction search.

    The algorithm: :mod:`jaxbundle.attacks.decision_based.rays`. Paper: Chen & Gu 2020, "RayS: A Ray
    Searching Method for Hard-label Adversarial Attack".

    Args:
      steps: queries after init, one per step (checks and bisections). Default 10000.
      search_steps: most bisections of the radius after an accepted trial. Default 8, which
        makes the search on the 256 pixel levels exact.
      restarts: independent runs; restart 0 starts from the all-ones direction, the others
        from random sign vectors.
      name: report name; default ``"rays"``.

    Returns:
      A decision-based :class:`~jaxbundle.attacks.base.Attack` with ``goal="min_norm"``,
      ``init_queries=1`` and ``queries_per_step=1``.
    """
    for label, value in (("steps", steps), ("search_steps", search_steps), ("restarts", restarts)):
        check_count("rays", label, value)
    return query_attack("decision-based", name or "rays", "linf", steps, init, step,
                        RaySConfig(steps, search_steps), restarts=restarts, goal="min_norm",
                        init_queries=1, queries_per_step=1)
