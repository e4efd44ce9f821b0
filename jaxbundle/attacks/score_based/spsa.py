"""SPSA (Uesato, O'Donoghue, van den Oord & Kohli 2018, "Adversarial Risk and the Dangers of
Evaluating Against Weak Attacks"): a score-based, untargeted Linf attack.

The attacker sees logits only (a :class:`~jaxbundle.attacks.base.ScoreOracle`, no gradients). It
maximises the margin loss ``f(x) = max_{j != y} z_j(x) - z_y(x)`` (positive iff misclassified)
with a Simultaneous Perturbation Stochastic Approximation of its gradient, fed to Adam on the
perturbation, and projects onto the eps ball and the box after every update. One step at the
iterate ``x`` (Algorithm 1 of the paper)::

    v_1..v_P ~ Rademacher({-1, +1}^D)                P = samples / 2 antithetic pairs
    g = 1/P sum_i (f(x + delta v_i) - f(x - delta v_i)) / (2 delta) * v_i
    x <- Proj_{B(x0, eps) ∩ [0,1]^D}(x + Adam_lr(g))                  (ascent on f)

Defaults: ``steps=100``, ``samples=128`` (64 pairs), ``delta=0.01``, ``learning_rate=0.01``
(the paper's and CleverHans' values). The start is a uniform point of the eps ball (as in
CleverHans' ``projected_optimization``).

Queries (exact, per example): ``init`` makes none; a step makes ``samples + 1``:

* the ``samples`` probes ``x ± delta v_i``, evaluated in ONE oracle call on a batch of
  ``samples * B`` images (reshaped ``[samples, B, ...] -> [samples * B, ...]``): every example
  sees only its own ``samples`` probes and is charged ``samples`` queries;
* one call on the iterate ``x`` itself, whose logits make the step's candidate
  ``Candidate(x, logits)`` (SPSA needs no value at ``x``; this is the price of scoring it).

So ``queries = steps * (samples + 1)`` (12 900 with the defaults).

Details and deviations:

* Probes are clipped to the box ``[0, 1]`` before they are sent (a real black box accepts only
  images); away from the box faces this changes nothing, on a face the difference becomes a
  one-sided one of the same sign.
* Adam state is per example (``optax.adam`` mapped over the batch axis), so no example's
  trajectory depends on another's. The update uses the projected perturbation as its parameter.
* No early stopping (the paper stops once the margin is positive): the program is static, and
  the bundler keeps the best candidate anyway.
* Memory: a step holds ``samples * B`` images at once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxbundle.core import losses, norms
from jaxbundle.attacks.base import Attack, Candidate, ScoreOracle, check_count, query_attack

__all__ = ["SPSAConfig", "SPSAState", "rademacher", "spsa_gradient", "init", "step", "spsa"]


class SPSAConfig(NamedTuple):
    norm: str  # "linf" (the only norm of the paper)
    samples: int  # probes per step, an even number: samples / 2 antithetic pairs
    delta: float  # finite-difference radius
    learning_rate: float  # Adam step size


class SPSAState(NamedTuple):
    x: jax.Array  # [B, ...] current iterate, in the box and the eps ball
    x0: jax.Array  # [B, ...] clean images
    y: jax.Array  # [B] labels
    eps: jax.Array  # [B] radius
    keys: jax.Array  # [B] PRNG key per example, split at every step
    opt_state: Any  # optax Adam state per example (every leaf has the leading axis [B])


def _adam(config: SPSAConfig) -> optax.GradientTransformation:
    return optax.adam(config.learning_rate)


def rademacher(keys: jax.Array, shape: tuple[int, ...], pairs: int) -> jax.Array:
    """``pairs`` Rademacher vectors per example: ``[pairs, B, *shape]`` of +-1 (float32)."""
    v = jax.vmap(lambda k: jax.random.rademacher(k, (pairs,) + shape, dtype=jnp.float32))(keys)
    return jnp.swapaxes(v, 0, 1)


def spsa_gradient(
    model: ScoreOracle, x: jax.Array, y: jax.Array, v: jax.Array, delta: float
) -> jax.Array:
    """SPSA estimate ``[B, ...]`` of the margin's gradient at ``x`` from antithetic probes.

    ``v``: ``[P, B, ...]`` Rademacher directions. One oracle call on ``2 P * B`` images, i.e.
    ``2 P`` queries per example.
    """
    pairs, batch = v.shape[0], v.shape[1]
    probes = norms.project_box(jnp.concatenate([x[None] + delta * v, x[None] - delta * v]))
    logits = model.logits(probes.reshape((2 * pairs * batch,) + x.shape[1:]))
    f = losses.margin(logits, jnp.tile(y, 2 * pairs)).reshape(2, pairs, batch)
    diff = (f[0] - f[1]) / (2.0 * delta)  # [P, B]
    return jnp.mean(diff.reshape(diff.shape + (1,) * (v.ndim - 2)) * v, axis=0)


def init(config: SPSAConfig, keys, x0, y, eps, model, restart) -> SPSAState:
    del model, restart  # no queries
    k_start, k_run = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
    x = norms.random_start(k_start, x0, eps, config.norm)
    opt_state = jax.vmap(_adam(config).init)(x - x0)
    return SPSAState(x=x, x0=x0, y=y, eps=eps, keys=k_run, opt_state=opt_state)


def step(config: SPSAConfig, state: SPSAState, model: ScoreOracle):
    logits = model.logits(state.x)  # 1 query: the candidate's logits
    k_next, k_v = jnp.moveaxis(jax.vmap(jax.random.split)(state.keys), 1, 0)
    v = rademacher(k_v, state.x.shape[1:], config.samples // 2)
    g = spsa_gradient(model, state.x, state.y, v, config.delta)  # `samples` queries
    delta_x = state.x - state.x0
    # Adam descends: feed it -g to ascend the margin.
    updates, opt_state = jax.vmap(_adam(config).update)(-g, state.opt_state, delta_x)
    x_new = norms.project(state.x0 + delta_x + updates, state.x0, state.eps, config.norm)
    new_state = state._replace(x=x_new, keys=k_next, opt_state=opt_state)
    return new_state, Candidate(state.x, logits)


def spsa(
    norm: str = "linf",
    steps: int = 100,
    samples: int = 128,
    delta: float = 0.01,
    learning_rate: float = 0.01,
    name: str | None = None,
) -> Attack:
    """SPSA: score-based Linf attack, Adam on SPSA gradient estimates of the margin.

    The algorithm: :mod:`jaxbundle.attacks.score_based.spsa`. Paper: Uesato, O'Donoghue, van den
    Oord & Kohli 2018, "Adversarial Risk and the Dangers of Evaluating Against Weak Attacks".

    Args:
      norm: ``"linf"`` (the only one supported).
      steps: Adam steps. Default 100.
      samples: probes per step (even: ``samples / 2`` antithetic pairs). Default 128.
      delta: finite-difference radius. Default 0.01.
      learning_rate: Adam step size, in pixel units. Default 0.01.
      name: report name; default ``"spsa"``.

    Returns:
      A score-based :class:`~jaxbundle.attacks.base.Attack` with ``init_queries=0`` and
      ``queries_per_step=samples + 1``.
    """
    if norms.check_norm(norm) != "linf":
        raise ValueError(f"spsa supports only norm 'linf', not {norm!r}")
    check_count("spsa", "steps", steps)
    if not isinstance(samples, int) or samples < 2 or samples % 2:
        raise ValueError(f"spsa samples must be an even integer >= 2, got {samples!r}")
    for label, value in (("delta", delta), ("learning_rate", learning_rate)):
        if not 0.0 < value < float("inf"):
            raise ValueError(f"spsa {label} must be positive and finite, got {value!r}")
    config = SPSAConfig(norm, samples, float(delta), float(learning_rate))
    return query_attack("score-based", name or "spsa", norm, steps, init, step, config,
                        init_queries=0, queries_per_step=samples + 1)
