"""The training-time attacks of the held-out zoo (benchmark-only): PGD in Linf and L2
(Madry et al. 2018) and TRADES' inner maximisation (Zhang et al. 2019)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxbundle import losses, norms


def _step_size(eps: jax.Array, steps: int) -> jax.Array:
    """PGD's step: 2.5 * eps / steps (Madry et al. 2018), enough to cross the ball and back."""
    return 2.5 * eps / steps


def _ascend(
    loss: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    start: jax.Array,
    eps: jax.Array,
    steps: int,
    norm: str,
) -> jax.Array:
    """``steps`` steepest-ascent steps on ``sum(loss(xa))`` from ``start``, each a
    ``norm``-normalised gradient step followed by the projection onto the eps ball around
    ``x`` and the box ``[0, 1]``."""
    grad = jax.grad(lambda xa: jnp.sum(loss(xa)))
    size = _step_size(eps, steps)

    def body(_: int, xa: jax.Array) -> jax.Array:
        xa = xa + size * norms.normalize(grad(xa), norm)
        return norms.project(xa, x, eps, norm)

    # Unrolled: on XLA:CPU a rolled loop runs the convolutions several times slower.
    xa = jax.lax.fori_loop(0, steps, body, norms.project(start, x, eps, norm), unroll=True)
    return jax.lax.stop_gradient(xa)


def pgd_examples(
    logits_fn: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    y: jax.Array,
    key: jax.Array,
    eps: float | jax.Array,
    steps: int,
    norm: str,
) -> jax.Array:
    """Untargeted PGD on the cross-entropy (Madry et al. 2018), for adversarial training.

    Starts at a uniform random point of the ``norm`` ball (``"linf"`` or ``"l2"``) and takes
    ``steps`` steps of 2.5 * eps / steps: signed-gradient steps for Linf, normalised-gradient
    steps for L2, each projected onto the ball and the box. ``logits_fn(x) -> [B, 10]`` is the
    model with its weights fixed. Returns images inside the eps ball around ``x`` and ``[0, 1]``.
    """
    eps = jnp.asarray(eps, x.dtype)
    keys = jax.random.split(key, x.shape[0])
    start = norms.random_start(keys, x, jnp.broadcast_to(eps, x.shape[:1]), norm)
    return _ascend(lambda xa: losses.cross_entropy(logits_fn(xa), y), x, start, eps, steps, norm)


def kl_divergence(p_logits: jax.Array, q_logits: jax.Array) -> jax.Array:
    """Per example ``KL(softmax(p_logits) || softmax(q_logits))`` ``[B]``."""
    log_p = jax.nn.log_softmax(p_logits, axis=-1)
    log_q = jax.nn.log_softmax(q_logits, axis=-1)
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def trades_examples(
    logits_fn: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    key: jax.Array,
    eps: float | jax.Array,
    steps: int,
) -> jax.Array:
    """TRADES' inner maximisation (Zhang et al. 2019): Linf PGD on
    ``KL(softmax f(x) || softmax f(x'))`` from ``x' = x + 0.001 * N(0, 1)``.

    The start is a hair away from ``x`` because the KL's gradient vanishes at ``x' = x``.
    Steps of 2.5 * eps / steps, projected onto the Linf ball and the box; labels are not used.
    """
    eps = jnp.asarray(eps, x.dtype)
    clean = jax.lax.stop_gradient(logits_fn(x))
    start = x + 0.001 * jax.random.normal(key, x.shape, x.dtype)
    return _ascend(lambda xa: kl_divergence(clean, logits_fn(xa)), x, start, eps, steps, "linf")
