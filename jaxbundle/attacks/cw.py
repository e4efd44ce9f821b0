"""Carlini-Wagner L2 attack (Carlini & Wagner 2017, "Towards Evaluating the Robustness of
Neural Networks"), untargeted, as a minimum-norm attack.

Change of variables: the image is ``x = (tanh(w) + 1) / 2``, always inside the box [0, 1], and
``w`` starts at the clean image, ``w0 = arctanh((2 x0 - 1) * (1 - 1e-6))`` (the factor keeps
``arctanh`` finite on pixels at 0 or 1). Per example, Adam minimises over ``w``::

    ||x - x0||_2^2 + c * max(z_y - max_{j != y} z_j + kappa, 0)

with ``z`` the logits and ``kappa`` the ``confidence``. The constant ``c`` is tuned per example
by a binary search of ``search_steps`` stages of ``steps`` Adam iterations each. At the end of
a stage, per example (:func:`update_const`):

- the stage found an adversarial example (``max_{j != y} z_j - z_y > kappa`` at some
  iterate): ``upper = min(upper, c)``, ``c = (lower + upper) / 2``;
- it did not: ``lower = max(lower, c)``, then ``c = 10 c`` while ``upper`` is still infinite,
  else ``c = (lower + upper) / 2``;

then ``w`` goes back to ``w0`` and Adam's state is reset. All stages are one ``lax.scan`` in
the bundler (``num_steps = search_steps * steps``); a step counter in the state says where the
stages end. Every iterate is a candidate (the image where the gradient was taken, with its
logits), so the bundler's ``min_norm`` goal keeps the smallest adversarial image over all
stages, which is what the reference implementation returns. One gradient per step.

Defaults: ``learning_rate = 1e-2`` and ``search_steps = 9`` as in the paper's code;
``initial_const = 1e-2`` rather than its 1e-3 (one stage fewer spent growing ``c`` when only
nine are run; with several stages left the initial value matters little); ``steps = 100``
per stage rather than the reference's 10,000 with early abort, a budget that fits an
evaluation bundle (raise it for a stronger attack). No early abort: the scan has a fixed
length. Targeted mode is not offered.

The state keeps one Adam state per example (``optax.adam`` vmapped over the batch), so every
leaf has a leading batch axis and each example's trajectory depends on nothing else in the
batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxbundle import losses, norms
from jaxbundle.attacks.base import Attack, Candidate, WhiteBoxModel

__all__ = [
    "CWConfig",
    "CWState",
    "TANH_SHRINK",
    "to_tanh_space",
    "from_tanh_space",
    "hinge",
    "update_const",
    "objective_gradient",
    "init",
    "step",
    "cw",
]

# 2 x0 - 1 is scaled by 1 - TANH_SHRINK before arctanh, so pixels at 0 or 1 stay finite.
TANH_SHRINK = 1e-6


class CWConfig(NamedTuple):
    steps: int  # Adam iterations per binary-search stage
    search_steps: int  # binary-search stages
    initial_const: float  # c at the first stage
    learning_rate: float  # Adam's learning rate (in tanh space)
    confidence: float  # kappa: margin the hinge asks for beyond the decision boundary


class CWState(NamedTuple):
    x: jax.Array  # [B, ...] current image (tanh(w) + 1) / 2, in the box
    w: jax.Array  # [B, ...] current iterate in tanh space
    w0: jax.Array  # [B, ...] the clean image in tanh space (each stage starts here)
    x0: jax.Array  # [B, ...] clean images
    y: jax.Array  # int32 [B] labels
    opt_state: optax.OptState  # Adam's state, one per example (every leaf [B, ...])
    const: jax.Array  # float32 [B] c of the current stage
    lower: jax.Array  # float32 [B] largest c known to fail (0 at first)
    upper: jax.Array  # float32 [B] smallest c known to succeed (+inf at first)
    found: jax.Array  # bool [B] the current stage has found an adversarial example
    step: jax.Array  # int32 [B] Adam iterations done so far, all stages together


def to_tanh_space(x: jax.Array) -> jax.Array:
    """``w`` with ``(tanh(w) + 1) / 2`` (nearly) equal to ``x`` in [0, 1]; finite on 0 and 1."""
    return jnp.arctanh((2.0 * x - 1.0) * (1.0 - TANH_SHRINK))


def from_tanh_space(w: jax.Array) -> jax.Array:
    """The image ``(tanh(w) + 1) / 2``, inside [0, 1] for any ``w``."""
    return (jnp.tanh(w) + 1.0) / 2.0


def hinge(logits: jax.Array, y: jax.Array, confidence: float) -> jax.Array:
    """``max(z_y - max_{j != y} z_j + kappa, 0)`` per example; 0 once the margin exceeds kappa."""
    return jnp.maximum(confidence - losses.margin(logits, y), 0.0)


def update_const(
    found: jax.Array, const: jax.Array, lower: jax.Array, upper: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One binary-search update of ``c`` per example at the end of a stage.

    Args:
      found: bool ``[B]``, whether the stage found an adversarial example.
      const: ``[B]`` the stage's ``c``.
      lower: ``[B]`` the largest ``c`` known to fail.
      upper: ``[B]`` the smallest ``c`` known to succeed (``inf`` while none has).

    Returns:
      ``(const, lower, upper)`` for the next stage.
    """
    upper = jnp.where(found, jnp.minimum(upper, const), upper)
    lower = jnp.where(found, lower, jnp.maximum(lower, const))
    bisect = (lower + upper) / 2.0
    grow = jnp.where(jnp.isinf(upper), const * 10.0, bisect)
    return jnp.where(found, bisect, grow), lower, upper


def _adam(config: CWConfig) -> optax.GradientTransformation:
    return optax.adam(config.learning_rate)


def _fresh_opt_state(config: CWConfig, w: jax.Array) -> optax.OptState:
    return jax.vmap(_adam(config).init)(w)


def init(config: CWConfig, keys, x0, y, eps, model, restart) -> CWState:
    del keys, eps, model, restart  # deterministic, and blind to eps (a minimum-norm attack)
    w0 = to_tanh_space(x0)
    batch = y.shape[0]
    return CWState(
        x=from_tanh_space(w0),
        w=w0,
        w0=w0,
        x0=x0,
        y=y,
        opt_state=_fresh_opt_state(config, w0),
        const=jnp.full((batch,), config.initial_const, jnp.float32),
        lower=jnp.zeros((batch,), jnp.float32),
        upper=jnp.full((batch,), jnp.inf, jnp.float32),
        found=jnp.zeros((batch,), bool),
        step=jnp.zeros((batch,), jnp.int32),
    )


def objective_gradient(
    confidence: float, state: CWState, model: WhiteBoxModel
) -> tuple[jax.Array, jax.Array]:
    """Gradient w.r.t. ``w`` of each example's objective at ``state.x``, and the logits there.

    One forward and backward pass, for the gradient of ``c * hinge`` w.r.t. ``x``; the
    distance term's gradient ``2 (x - x0)`` is analytic, and ``dx/dw = (1 - tanh(w)^2) / 2``
    closes the chain rule.
    """
    _, grad_hinge, logits = model.loss_and_grad(
        lambda z, y, c: c * hinge(z, y, confidence), state.x, state.y, state.const
    )
    grad_x = 2.0 * (state.x - state.x0) + grad_hinge
    return grad_x * (1.0 - jnp.square(jnp.tanh(state.w))) / 2.0, logits


def step(config: CWConfig, state: CWState, model: WhiteBoxModel) -> tuple[CWState, Candidate]:
    grad_w, logits = objective_gradient(config.confidence, state, model)
    updates, opt_state = jax.vmap(_adam(config).update)(grad_w, state.opt_state)
    w = state.w + updates

    found = state.found | (losses.margin(logits, state.y) > config.confidence)
    t = state.step + 1
    stage_end = t % config.steps == 0
    const, lower, upper = jax.tree.map(
        lambda new, old: jnp.where(stage_end, new, old),
        update_const(found, state.const, state.lower, state.upper),
        (state.const, state.lower, state.upper),
    )
    # A new stage restarts from the clean image with a fresh Adam; after the last stage the
    # final iterate stays, so that the bundler's last evaluation sees it.
    new_stage = stage_end & (t < config.steps * config.search_steps)

    def reset(fresh: jax.Array, old: jax.Array) -> jax.Array:
        return jnp.where(norms.per_example(new_stage, old), fresh, old)

    w = reset(state.w0, w)
    opt_state = jax.tree.map(reset, _fresh_opt_state(config, state.w0), opt_state)
    new_state = state._replace(
        x=from_tanh_space(w),
        w=w,
        opt_state=opt_state,
        const=const,
        lower=lower,
        upper=upper,
        found=found & ~stage_end,
        step=t,
    )
    return new_state, Candidate(state.x, logits)


def cw(
    steps: int = 100,
    search_steps: int = 9,
    initial_const: float = 1e-2,
    learning_rate: float = 0.01,
    confidence: float = 0.0,
    name: str | None = None,
) -> Attack:
    """Carlini-Wagner L2 (untargeted): Adam in tanh space with a binary search over ``c``.

    Args:
      steps: Adam iterations per binary-search stage.
      search_steps: binary-search stages; the attack runs ``steps * search_steps`` iterations.
      initial_const: ``c`` at the first stage (the paper's code uses 1e-3).
      learning_rate: Adam's learning rate, in tanh space.
      confidence: ``kappa >= 0``, how far past the decision boundary the hinge pushes.
      name: report name; default ``"cw-l2"``.

    Returns:
      An :class:`~jaxbundle.attacks.base.Attack` with the ``min_norm`` goal, in norm ``"l2"``.
    """
    for label, value in (("steps", steps), ("search_steps", search_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"cw needs {label} to be an integer >= 1, got {value!r}")
    if not initial_const > 0 or initial_const == float("inf"):
        raise ValueError(f"cw initial_const must be positive and finite, got {initial_const}")
    if not learning_rate > 0 or learning_rate == float("inf"):
        raise ValueError(f"cw learning_rate must be positive and finite, got {learning_rate}")
    if not confidence >= 0 or confidence == float("inf"):
        raise ValueError(f"cw confidence must be >= 0 and finite, got {confidence}")
    return Attack(
        name=name or "cw-l2",
        kind="white-box",
        norm="l2",
        num_steps=steps * search_steps,
        num_restarts=1,
        gradients_per_step=1,
        init=init,
        step=step,
        config=CWConfig(
            steps, search_steps, float(initial_const), float(learning_rate), float(confidence)
        ),
        goal="min_norm",
    )
