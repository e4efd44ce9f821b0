"""Square Attack (Andriushchenko, Croce, Flammarion & Hein 2020, "Square Attack: a
query-efficient black-box adversarial attack via random search", ECCV).

A score-based attack: it sees only the logits (one oracle query per example per call) and
minimises the paper's margin loss ``L(x) = z_y - max_{j != y} z_j`` by random search; an
example is fooled once ``L < 0``. Untargeted, fixed budget, Linf or L2 ball of radius eps,
always inside the box ``[0, 1]``.

Initialisation (1 query, the initial point):

* Linf: vertical stripes, ``x0 + eps * s`` with one random sign per column and channel.
* L2: the paper's grid of ``q x q`` blocks (``q = max(min(h, w) // 5, 1)``, the grid centred
  in the image) each carrying the pseudo-Gaussian pattern ``M(q)`` (below, randomly
  transposed) with a random sign per block and channel, rescaled to L2 norm eps.

Both are clipped to the box. Then, at every step ``t`` (1 query each):

1. The fraction of pixels ``p`` follows the paper's schedule: ``p_init`` halved once at each
   of the iterations {10, 50, 200, 500, 1000, 2000, 4000, 6000, 8000}, rescaled to the
   attack's number of steps as if it were 10,000 (iteration ``floor(t * 10000 / steps)``).
   The square side is ``s = round(sqrt(p * h * w))``, at least 1 and at most
   ``min(h, w) - 1`` (Linf), or odd, at least 3 and at most ``min(h, w)`` (L2), as in the
   authors' code (images smaller than 3 pixels get the largest odd side that fits). ``s``
   depends on the step counter only, so it is traced; the window of side ``s`` sits at a
   random position per example and step, built from iota comparisons against the
   per-example offsets (no dynamic shapes).
2. Linf: the window of the perturbation is set to ``+-eps`` with one random sign per channel.
   A proposal that would leave the image unchanged (the window already holds that value)
   is never drawn: the sign pattern is sampled uniformly among those that change something
   (the authors resample in a loop; this is the same distribution without the loop).
3. L2: a second random window ``W2`` of the same side gives up its perturbation to the first
   one ``W1``: per channel, ``W1`` gets ``M(s) * sign + delta_W1 / ||delta_W1||`` rescaled to
   norm ``sqrt(max(eps^2 - ||delta||^2, 0) / c + ||delta_{W1 u W2}||^2)``, ``W2 \\ W1`` is
   zeroed, and the whole perturbation is rescaled to norm eps and clipped to the box.
   ``M(s)`` is the paper's pseudo-Gaussian square: its top ``s // 2`` rows hold concentric
   rectangles with weight ``sum_{k >= d} 1 / (k + 1)^2`` at Chebyshev distance ``d`` from
   their centre, the bottom rows the same pattern negated, each half of unit norm, the whole
   of unit norm and transposed with probability 1/2.
4. Accept rule, per example: the proposal replaces ``x`` only if its margin loss is lower.
   An example already fooled (``L < 0``) stops changing: its proposal is ``x`` itself.

The step's candidate is the evaluated proposal with the logits the oracle returned; the
initial point is the final iterate whenever no proposal beat it, and the bundler evaluates
the final iterate, so every point that matters reaches the bundler without extra queries.

Defaults: 5,000 queries (init + 4,999 steps), ``p_init = 0.8`` (Linf) and ``0.1`` (L2), the
values of the paper's experiments. One restart (the key of a bundle restart only changes the
randomness). Square positions use offsets in ``[0, h - s]`` inclusive. Each step draws all
its random numbers from one PRNG call per example (cheaper to compile than one per use).

Pixel grid: like the paper, the attack stops as soon as ``L < 0``, so its successes sit just
past the decision boundary at ``|delta| = eps``, where the judge's rounding to the 8-bit grid
could undo them. With ``grid=True`` (default) every queried point of an example judged on the
grid is rounded first (:func:`jaxbundle.core.norms.snap_to_grid`), so the oracle labels exactly the
image the bundle judges.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle.core import losses, norms
from jaxbundle.attacks.base import Attack, Candidate, ScoreOracle, check_count, query_attack

__all__ = [
    "SquareConfig",
    "SquareState",
    "SCHEDULE",
    "DEFAULT_P_INIT",
    "margin_loss",
    "fraction",
    "side",
    "window_mask",
    "pseudo_gaussian",
    "linf_init",
    "l2_init",
    "init",
    "step",
    "square",
]

# Iterations (of a 10,000-iteration run) after which p is halved.
SCHEDULE = (10, 50, 200, 500, 1000, 2000, 4000, 6000, 8000)
SCHEDULE_LENGTH = 10_000
DEFAULT_P_INIT = {"linf": 0.8, "l2": 0.1}
_SAME = 1e-7  # two pixel values closer than this count as equal (no change)
_MAX_PATTERN_CHANNELS = 4  # up to 2**4 sign patterns enumerated; more channels: plain draws


class SquareConfig(NamedTuple):
    norm: str  # "linf" or "l2"
    num_steps: int  # iterations after init (queries - 1)
    p_init: float  # initial fraction of pixels in the square
    grid: bool  # round every queried point to the 8-bit grid inside the ball
    rescale_schedule: bool = True  # the p schedule stretched to the run as if 10,000 steps


class SquareState(NamedTuple):
    x: jax.Array  # [B, ...] current iterate, in the box and the eps ball
    x0: jax.Array  # [B, ...] clean images
    y: jax.Array  # [B] labels
    eps: jax.Array  # [B] radius
    loss: jax.Array  # [B] margin loss z_y - max_{j != y} z_j of x (< 0: fooled)
    key: jax.Array  # [B] PRNG keys, one per example
    t: jax.Array  # int32 [B] step counter (the same for every example)


# ---------------------------------------------------------------------------------------------
# Small pure helpers.


def margin_loss(logits: jax.Array, y: jax.Array) -> jax.Array:
    """The paper's loss ``z_y - max_{j != y} z_j`` ``[B]``, minimised; < 0 means fooled."""
    return -losses.margin(logits, y)


def _hwc(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(height, width, channels) of one example of shape ``shape`` (without the batch axis).

    ``[H, W, C]`` images (channels last, as everywhere in jaxbundle), ``[H, W]`` greyscale
    images, or flat ``[D]`` vectors (seen as a 1 x D image).
    """
    if len(shape) == 3:
        return shape
    if len(shape) == 2:
        return (shape[0], shape[1], 1)
    if len(shape) == 1:
        return (1, shape[0], 1)
    raise ValueError(f"square expects images [B, H, W, C], [B, H, W] or [B, D]; got {shape}")


def fraction(
    t: jax.Array, num_steps: int, p_init: float, rescale: bool = True
) -> jax.Array:
    """The fraction of pixels ``p`` at step ``t`` (0-based) of a run of ``num_steps`` steps.

    ``p_init`` halved once for each threshold of :data:`SCHEDULE` below the step rescaled to
    a 10,000-step run, ``floor(t * 10000 / num_steps)``; with ``rescale=False`` below ``t``
    itself (AutoAttack's setting: a 5,000-query run stops halving after iteration 4,000).
    """
    t = t.astype(jnp.int32)
    # floor(t * L / N) > th  <=>  t >= ceil((th + 1) * N / L): exact in Python integers, so
    # that no int32 product t * L overflows (past t = 214,748 it would).
    starts = [-(-(th + 1) * num_steps // SCHEDULE_LENGTH) if rescale else th + 1
              for th in SCHEDULE]
    halvings = sum((t >= start).astype(jnp.int32) for start in starts)
    return jnp.float32(p_init) * jnp.exp2(-halvings.astype(jnp.float32))


def side(p: jax.Array, h: int, w: int, norm: str) -> jax.Array:
    """Square side ``round(sqrt(p * h * w))`` (int32), clamped as described in the module doc."""
    s = jnp.round(jnp.sqrt(p * (h * w))).astype(jnp.int32)
    if norm == "linf":
        return jnp.clip(s, 1, max(min(h, w) - 1, 1))
    s = jnp.maximum(s, 3)
    s = s + (s % 2 == 0).astype(jnp.int32)
    m = min(h, w)
    return jnp.minimum(s, m if m % 2 else m - 1)


def _uniforms(key: jax.Array, num: int) -> jax.Array:
    """``num`` uniform numbers in [0, 1) per example: ``[B, num]`` (one PRNG call)."""
    return jax.vmap(lambda k: jax.random.uniform(k, (num,)))(key)


def _pick(u: jax.Array, n: jax.Array | int) -> jax.Array:
    """A uniform integer in ``[0, n)`` from uniforms ``u`` in [0, 1) (int32, shape of ``u``)."""
    return jnp.minimum(jnp.floor(u * n).astype(jnp.int32), jnp.asarray(n, jnp.int32) - 1)


def _offsets(u: jax.Array, s: jax.Array, h: int, w: int) -> tuple[jax.Array, jax.Array]:
    """A uniform top-left corner in ``[0, h - s] x [0, w - s]`` per example from ``u [B, 2]``."""
    return _pick(u[:, 0], h - s + 1), _pick(u[:, 1], w - s + 1)


def _local(oh: jax.Array, ow: jax.Array, h: int, w: int) -> tuple[jax.Array, jax.Array]:
    """Row and column of every pixel relative to the corners ``(oh, ow)``: two ``[B, h, w]``."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (1, h, w), 1) - oh.reshape(-1, 1, 1)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, h, w), 2) - ow.reshape(-1, 1, 1)
    return rows, cols


def window_mask(oh: jax.Array, ow: jax.Array, s: jax.Array, h: int, w: int) -> jax.Array:
    """Boolean ``[B, h, w]``: the square of side ``s[b]`` with top-left corner ``(oh, ow)``."""
    rows, cols = _local(oh, ow, h, w)
    s3 = s.reshape(-1, 1, 1)
    return (rows >= 0) & (rows < s3) & (cols >= 0) & (cols < s3)


def _inv_square_cumsum(n: int) -> np.ndarray:
    """``H[k] = sum_{m=1}^{k} 1 / m^2`` for ``k = 0..n`` (float32 table)."""
    return np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, n + 1) ** 2)]).astype(np.float32)


def _rectangles(i: jax.Array, j: jax.Array, a: jax.Array, b: jax.Array, table: jax.Array):
    """Concentric-rectangle pattern of an ``a x b`` rectangle at local pixel ``(i, j)``.

    Weight ``sum_{k=d}^{K-1} 1 / (k + 1)^2`` with ``d`` the Chebyshev distance to the centre
    ``(a // 2, b // 2)`` and ``K = max(a // 2, b // 2) + 1``; zero outside the rectangle.
    Returns the unnormalised values (same shape as ``i``).
    """
    inside = (i >= 0) & (i < a) & (j >= 0) & (j < b)
    d = jnp.maximum(jnp.abs(i - a // 2), jnp.abs(j - b // 2))
    big_k = jnp.maximum(a // 2, b // 2) + 1
    top = table.shape[0] - 1
    value = table[jnp.clip(big_k, 0, top)] - table[jnp.clip(d, 0, top)]
    return jnp.where(inside, value, 0.0)



def pseudo_gaussian(
    oh: jax.Array, ow: jax.Array, s: jax.Array, transpose: jax.Array, h: int, w: int
) -> jax.Array:
    """The paper's pseudo-Gaussian square ``M(s)`` placed at ``(oh, ow)``: ``[B, h, w]``.

    Top ``s // 2`` rows: a rectangle pattern (positive); the other ``s - s // 2`` rows: the
    same pattern negated; each half of unit norm, the whole of unit norm; transposed where
    ``transpose`` (bool ``[B]``). Zero outside the square. ``s`` may be traced.
    """
    table = jnp.asarray(_inv_square_cumsum(max(h, w) + 2))
    rows, cols = _local(oh, ow, h, w)
    tr = transpose.reshape(-1, 1, 1)
    i, j = jnp.where(tr, cols, rows), jnp.where(tr, rows, cols)
    s3 = s.reshape(-1, 1, 1)
    half = s3 // 2
    upper = norms.unit(_rectangles(i, j, half, s3, table))
    lower = norms.unit(_rectangles(i - half, j, s3 - half, s3, table))
    return norms.unit(upper - lower)


def _with_channels(v: jax.Array, x: jax.Array) -> jax.Array:
    """``v [B, h, w, c]`` (or ``[B, h, w, 1]``) broadcast and reshaped like ``x``."""
    h, w, c = _hwc(x.shape[1:])
    return jnp.broadcast_to(v, (x.shape[0], h, w, c)).reshape(x.shape)


def _split(key: jax.Array, num: int) -> jax.Array:
    """``num`` fresh keys per example: ``[num, B]``."""
    return jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, num))(key), 1, 0)


def _signs(u: jax.Array) -> jax.Array:
    """Random +-1 (float32) from uniforms ``u`` (same shape)."""
    return jnp.where(u < 0.5, -1.0, 1.0).astype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# Initialisations.


def linf_init(key: jax.Array, x0: jax.Array, eps: jax.Array) -> jax.Array:
    """Vertical stripes: ``x0 + eps * sign`` with one sign per column and channel, clipped."""
    h, w, c = _hwc(x0.shape[1:])
    stripes = _with_channels(_signs(_uniforms(key, w * c)).reshape(-1, 1, w, c), x0)
    return norms.project_box(x0 + norms.per_example(eps, x0) * stripes)


def _grid_layout(h: int, w: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """The L2 init's static block grid: block side, block id per pixel (-1: none), local i, j."""
    q = max(min(h, w) // 5, 1)
    nh, nw = h // q, w // q
    top, left = (h - nh * q) // 2, (w - nw * q) // 2
    r = np.arange(h)[:, None] - top
    col = np.arange(w)[None, :] - left
    inside = (r >= 0) & (r < nh * q) & (col >= 0) & (col < nw * q)
    block = np.where(inside, (r // q) * nw + col // q, -1)
    return q, block.astype(np.int32), (r % q) * np.ones_like(col), (col % q) * np.ones_like(r)


def l2_init(key: jax.Array, x0: jax.Array, eps: jax.Array) -> jax.Array:
    """The paper's L2 start: a grid of pseudo-Gaussian blocks with random signs, norm eps."""
    h, w, c = _hwc(x0.shape[1:])
    q, block, li, lj = _grid_layout(h, w)
    nblocks = int(block.max()) + 1
    u = _uniforms(key, nblocks * (c + 1))
    sign = _signs(u[:, : nblocks * c]).reshape(-1, nblocks, c)  # [B, nblocks, c]
    transpose = u[:, nblocks * c :] < 0.5  # [B, nblocks]
    corner = jnp.zeros((1,), jnp.int32)
    size = jnp.full((1,), q, jnp.int32)
    pattern = pseudo_gaussian(corner, corner, size, jnp.zeros((1,), bool), q, q)[0]  # [q, q]
    m = pattern[li, lj]  # [h, w]: the block pattern tiled (meaningless outside the grid)
    mt = pattern.T[li, lj]
    idx = jnp.asarray(np.maximum(block, 0))
    tile = jnp.where(transpose[:, idx], mt[None], m[None])  # [B, h, w]
    delta = tile[..., None] * sign[:, idx, :]  # [B, h, w, c]
    delta = jnp.where(jnp.asarray(block >= 0)[None, :, :, None], delta, 0.0).reshape(x0.shape)
    n = norms.norm(delta, "l2")
    scale = eps / jnp.where(n > 0, n, 1.0)
    return norms.project_box(x0 + norms.per_example(scale, delta) * delta)


# ---------------------------------------------------------------------------------------------
# Proposals.


def _changing_signs(u: jax.Array, image: jax.Array, clean: jax.Array, radius: jax.Array,
                    mask: jax.Array) -> jax.Array:
    """One sign per channel ``[B, c]``, uniform (by ``u`` ``[B]``) among the ``2^c`` patterns
    that change the window; all patterns when none does. Setting the window of ``clean`` to
    ``clean + sign * radius`` (clipped to the box) must differ from ``image`` somewhere."""
    c = image.shape[-1]
    # same[b, ch, i]: sign (-1, +1)[i] on channel ch leaves the window of image b unchanged.
    same = jnp.stack([
        jnp.all((jnp.abs(jnp.clip(clean + sign * radius, 0.0, 1.0) - image) < _SAME) | ~mask,
                axis=(1, 2))
        for sign in (-1.0, 1.0)
    ], axis=-1)  # [B, c, 2]
    bits = (np.arange(2**c)[:, None] >> np.arange(c)[None, :]) & 1  # [P, c]: pattern p's signs
    unchanged = jnp.all(same[:, np.arange(c)[None, :], bits], axis=-1)  # [B, P]
    allowed = ~unchanged | jnp.all(unchanged, axis=-1, keepdims=True)
    rank = _pick(u, jnp.sum(allowed, axis=-1))  # the rank-th allowed pattern
    pattern = jnp.argmax(allowed & (jnp.cumsum(allowed, axis=-1) == rank[:, None] + 1), -1)
    return 2.0 * jnp.asarray(bits, jnp.float32)[pattern] - 1.0


def _linf_proposal(key: jax.Array, state: SquareState, s: jax.Array) -> jax.Array:
    """Sets a random square of the perturbation to +-eps (one sign per channel), clipped. With
    few channels the signs are drawn among those that change the image (no query wasted)."""
    b = state.x.shape[0]
    h, w, c = _hwc(state.x.shape[1:])
    few = c <= _MAX_PATTERN_CHANNELS
    u = _uniforms(key, 2 + (1 if few else c))
    oh, ow = _offsets(u[:, :2], s, h, w)
    mask = window_mask(oh, ow, s, h, w)[..., None]  # [B, h, w, 1]
    image, clean = state.x.reshape(b, h, w, c), state.x0.reshape(b, h, w, c)
    radius = state.eps.reshape(-1, 1, 1, 1)
    sign = _changing_signs(u[:, 2], image, clean, radius, mask) if few else _signs(u[:, 2:])
    delta = jnp.where(mask, radius * sign.reshape(b, 1, 1, c), image - clean)
    return norms.project_box(clean + delta).reshape(state.x.shape)


def _l2_proposal(key: jax.Array, state: SquareState, s: jax.Array) -> jax.Array:
    """Moves the perturbation of a second window into a first one (see the module doc)."""
    x, x0, eps = state.x, state.x0, state.eps
    b = x.shape[0]
    h, w, c = _hwc(x.shape[1:])
    u = _uniforms(key, 5 + c)
    oh1, ow1 = _offsets(u[:, 0:2], s, h, w)
    oh2, ow2 = _offsets(u[:, 2:4], s, h, w)
    m1 = window_mask(oh1, ow1, s, h, w)[..., None]  # [B, h, w, 1]
    m2 = window_mask(oh2, ow2, s, h, w)[..., None]
    delta = (x - x0).reshape(b, h, w, c)

    def channel_norm(v):  # [B, 1, 1, c]
        return jnp.sqrt(jnp.sum(v * v, axis=(1, 2), keepdims=True))

    total = norms.norm(delta, "l2").reshape(-1, 1, 1, 1)
    old = jnp.where(m1, delta, 0.0)
    union = channel_norm(jnp.where(m1 | m2, delta, 0.0))
    transpose = u[:, 4] < 0.5
    pattern = pseudo_gaussian(oh1, ow1, s, transpose, h, w)[..., None]  # [B, h, w, 1]
    sign = _signs(u[:, 5:]).reshape(b, 1, 1, c)
    new = pattern * sign + old / (channel_norm(old) + 1e-10)
    budget = jnp.maximum(eps.reshape(-1, 1, 1, 1) ** 2 - total**2, 0.0) / c + union**2
    new = new / jnp.maximum(channel_norm(new), 1e-12) * jnp.sqrt(budget)
    delta = jnp.where(m1, new, jnp.where(m2, 0.0, delta))
    n = norms.norm(delta, "l2")
    scale = eps / jnp.maximum(n, 1e-12)
    delta = delta * scale.reshape(-1, 1, 1, 1)
    return norms.project_box(x0 + delta.reshape(x.shape))


# ---------------------------------------------------------------------------------------------
# The protocol.


def _on_grid(
    config: SquareConfig, x: jax.Array, x0: jax.Array, eps: jax.Array, grid: jax.Array | None
) -> jax.Array:
    """With ``config.grid``: the point rounded to the 8-bit grid without leaving the ball,
    for the examples whose clean image is on the grid (the others are judged in float32)."""
    return norms.snap_to_grid(x, x0, eps, config.norm, grid) if config.grid else x


def init(config: SquareConfig, keys, x0, y, eps, model: ScoreOracle, restart) -> SquareState:
    """Linf stripes or the L2 block grid; one query (the initial point's logits)."""
    del restart
    _hwc(x0.shape[1:])
    k_init, k_run = _split(keys, 2)
    start = linf_init if config.norm == "linf" else l2_init
    x = _on_grid(config, start(k_init, x0, eps), x0, eps, model.grid)
    loss = margin_loss(model.logits(x), y)
    t = jnp.zeros(y.shape, jnp.int32)
    return SquareState(x=x, x0=x0, y=y, eps=eps, loss=loss, key=k_run, t=t)


def step(config: SquareConfig, state: SquareState, model: ScoreOracle):
    """One random-search step: one proposal per example, one query, greedy acceptance."""
    h, w, _ = _hwc(state.x.shape[1:])
    key, k_step = _split(state.key, 2)
    p = fraction(state.t, config.num_steps, config.p_init, config.rescale_schedule)
    s = side(p, h, w, config.norm)
    propose = _linf_proposal if config.norm == "linf" else _l2_proposal
    fooled = state.loss < 0
    proposal = _on_grid(config, propose(k_step, state, s), state.x0, state.eps, model.grid)
    x_new = jnp.where(norms.per_example(fooled, state.x), state.x, proposal)
    logits = model.logits(x_new)
    loss_new = margin_loss(logits, state.y)
    better = (loss_new < state.loss) & ~fooled
    new_state = state._replace(
        x=jnp.where(norms.per_example(better, state.x), x_new, state.x),
        loss=jnp.where(better, loss_new, state.loss),
        key=key,
        t=state.t + 1,
    )
    return new_state, Candidate(x_new, logits)


def square(
    norm: str = "linf",
    queries: int = 5000,
    p_init: float | None = None,
    grid: bool = True,
    name: str | None = None,
    rescale_schedule: bool = True,
) -> Attack:
    """The Square Attack, score-based, untargeted, in the Linf or L2 ball.

    The algorithm: :mod:`jaxbundle.attacks.score_based.square`. Paper: Andriushchenko, Croce,
    Flammarion & Hein 2020, "Square Attack: a query-efficient black-box adversarial attack via
    random search".

    Args:
      norm: ``"linf"`` or ``"l2"``.
      queries: model queries per example, the initial point included (``queries - 1``
        steps); the paper's budget is 10,000, AutoAttack's 5,000.
      p_init: initial fraction of pixels changed per step; ``None``: 0.8 (Linf) or 0.1 (L2).
      grid: round every queried point to the 8-bit pixel grid inside the ball, for the
        examples whose clean image is on the grid (as the bundle judges them).
      name: report name; default ``"square"``.
      rescale_schedule: stretch the paper's p schedule (written for 10,000 iterations) to
        ``queries`` (True), or apply it at the iterations as written (False: AutoAttack's).

    Returns:
      An :class:`~jaxbundle.attacks.base.Attack` of kind ``"score-based"`` whose
      ``queries`` is exactly ``queries``.
    """
    if not isinstance(norm, str) or norm not in ("linf", "l2"):
        raise ValueError(f"square supports norms 'linf' and 'l2', not {norm!r}")
    check_count("square", "queries (init + 1 step)", queries, minimum=2)
    if p_init is None:
        p_init = DEFAULT_P_INIT[norm]
    if not 0.0 < float(p_init) <= 1.0:
        raise ValueError(f"square p_init must lie in (0, 1], got {p_init}")
    init_queries = 1
    num_steps = int(queries) - init_queries
    config = SquareConfig(norm, num_steps, float(p_init), bool(grid), bool(rescale_schedule))
    return query_attack("score-based", name or "square", norm, num_steps, init, step, config,
                        init_queries=init_queries, queries_per_step=1)
