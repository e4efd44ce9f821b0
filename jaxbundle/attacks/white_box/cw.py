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

Two budgets. :func:`cw` defaults to a LIGHT variant, reported as ``"cw-l2-light"``:
``learning_rate = 1e-2`` and ``search_steps = 9`` as in the paper's code, but
``initial_const = 1e-2`` rather than its 1e-3 and ``steps = 100`` per stage rather than the
reference's 10,000, with no early abort -- a budget that fits an evaluation bundle, far below
the paper's. :func:`cw_reference` (reported as ``"cw-l2"``) is the budget of the reference
implementation (nicholas-carlini/nn_robust_attacks ``l2_attack.py``): ``MAX_ITERATIONS =
10000`` per stage, ``ABORT_EARLY``, ``INITIAL_CONST = 1e-3``, ``BINARY_SEARCH_STEPS = 9``,
``LEARNING_RATE = 1e-2``.

Early abort (``abort_early=True``), per example as in the reference's inner loop: every
``max(steps // 10, 1)`` iterations of a stage (at stage iterations 0, steps//10, ...) the
example's objective at the current iterate is compared with the one at the previous check;
if it is above ``0.9999`` times it (less than a 0.01% decrease) the stage ends for that example
at once (the reference compares the batch's summed loss; here each example has its own). The
binary-search update and the reset then happen for that example alone, so examples walk
through their stages at their own pace (a per-example stage counter); after its last stage an
example is frozen (its iterate no longer moves) until the scan ends. The scan keeps its fixed
length ``steps * search_steps``, an upper bound; frozen examples still cost their gradient.
Targeted mode is not offered.

The state keeps one Adam state per example (``optax.adam`` vmapped over the batch), so every
leaf has a leading batch axis and each example's trajectory depends on nothing else in the
batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxbundle.core import losses, norms
from jaxbundle.attacks.base import Attack, Candidate, WhiteBoxModel, check_count, white_box_attack

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
    "cw_reference",
    "objective",
    "abort_check",
]

# 2 x0 - 1 is scaled by 1 - TANH_SHRINK before arctanh, so pixels at 0 or 1 stay finite.
TANH_SHRINK = 1e-6


class CWConfig(NamedTuple):
    steps: int  # Adam iterations per binary-search stage
    search_steps: int  # binary-search stages
    initial_const: float  # c at the first stage
    learning_rate: float  # Adam's learning rate (in tanh space)
    confidence: float  # kappa: margin the hinge asks for beyond the decision boundary
    abort_early: bool = False  # end a stage once the objective stalls (the reference's rule)


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
    stage: jax.Array  # int32 [B] index of the current binary-search stage
    stage_step: jax.Array  # int32 [B] iterations done in the current stage
    prev_loss: jax.Array  # float32 [B] objective at the last early-abort check (+inf at first)


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
        stage=jnp.zeros((batch,), jnp.int32),
        stage_step=jnp.zeros((batch,), jnp.int32),
        prev_loss=jnp.full((batch,), jnp.inf, jnp.float32),
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


def objective(state: CWState, logits: jax.Array, confidence: float) -> jax.Array:
    """Each example's objective ``||x - x0||_2^2 + c * hinge`` at ``state.x`` (float32 ``[B]``)."""
    dist = jnp.sum(jnp.square(state.x - state.x0).reshape(state.x.shape[0], -1), axis=1)
    return dist + state.const * hinge(logits, state.y, confidence)


def abort_check(
    config: CWConfig, stage_step: jax.Array, loss: jax.Array, prev_loss: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The reference's early-abort rule, per example: ``(abort, prev_loss)``.

    At stage iterations ``0, P, 2P, ...`` (``P = max(steps // 10, 1)``) the stage is aborted
    when ``loss > 0.9999 * prev_loss``, and ``prev_loss`` becomes ``loss``; elsewhere nothing
    changes. Always ``False`` without ``abort_early``.
    """
    period = max(config.steps // 10, 1)
    check = (stage_step % period == 0) & config.abort_early
    abort = check & (loss > 0.9999 * prev_loss)
    return abort, jnp.where(check, loss, prev_loss)


def step(config: CWConfig, state: CWState, model: WhiteBoxModel) -> tuple[CWState, Candidate]:
    grad_w, logits = objective_gradient(config.confidence, state, model)
    updates, opt_state = jax.vmap(_adam(config).update)(grad_w, state.opt_state)
    done = state.stage >= config.search_steps  # every stage over: frozen
    w = jnp.where(norms.per_example(done, state.w), state.w, state.w + updates)

    found = state.found | (losses.margin(logits, state.y) > config.confidence)
    t = state.step + 1
    abort, prev_loss = abort_check(
        config, state.stage_step, objective(state, logits, config.confidence), state.prev_loss
    )
    stage_end = ~done & (abort | (state.stage_step + 1 >= config.steps))
    const, lower, upper = jax.tree.map(
        lambda new, old: jnp.where(stage_end, new, old),
        update_const(found, state.const, state.lower, state.upper),
        (state.const, state.lower, state.upper),
    )
    # A new stage restarts from the clean image with a fresh Adam; after the last stage the
    # final iterate stays, so that the bundler's last evaluation sees it.
    stage = state.stage + stage_end.astype(jnp.int32)
    new_stage = stage_end & (stage < config.search_steps)

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
        stage=stage,
        stage_step=jnp.where(stage_end, 0, state.stage_step + 1),
        prev_loss=jnp.where(stage_end, jnp.inf, prev_loss),
    )
    return new_state, Candidate(state.x, logits)


def cw(
    steps: int = 100,
    search_steps: int = 9,
    initial_const: float = 1e-2,
    learning_rate: float = 0.01,
    confidence: float = 0.0,
    name: str | None = None,
    abort_early: bool = False,
) -> Attack:
    """Carlini-Wagner L2 (untargeted): Adam in tanh space with a binary search over ``c``.

    The algorithm: :mod:`jaxbundle.attacks.white_box.cw`. Paper: Carlini & Wagner 2017, "Towards
    Evaluating the Robustness of Neural Networks".

    The defaults are the LIGHT budget (100 steps per stage, no early abort), reported as
    ``"cw-l2-light"``; :func:`cw_reference` gives the reference implementation's budget.

    Args:
      steps: Adam iterations per binary-search stage.
      search_steps: binary-search stages; the attack runs ``steps * search_steps`` iterations.
      initial_const: ``c`` at the first stage (the paper's code uses 1e-3).
      learning_rate: Adam's learning rate, in tanh space.
      confidence: ``kappa >= 0``, how far past the decision boundary the hinge pushes.
      name: report name; default ``"cw-l2-light"`` (``"cw-l2-abort"`` with ``abort_early``).
      abort_early: end a stage for an example once its objective has not decreased by 0.01%
        over ``steps // 10`` iterations (the reference's ``ABORT_EARLY``).

    Returns:
      An :class:`~jaxbundle.attacks.base.Attack` with the ``min_norm`` goal, in norm ``"l2"``.
    """
    for label, value in (("steps", steps), ("search_steps", search_steps)):
        check_count("cw", label, value)
    if not initial_const > 0 or initial_const == float("inf"):
        raise ValueError(f"cw initial_const must be positive and finite, got {initial_const}")
    if not learning_rate > 0 or learning_rate == float("inf"):
        raise ValueError(f"cw learning_rate must be positive and finite, got {learning_rate}")
    if not confidence >= 0 or confidence == float("inf"):
        raise ValueError(f"cw confidence must be >= 0 and finite, got {confidence}")
    config = CWConfig(steps, search_steps, float(initial_const), float(learning_rate),
                      float(confidence), bool(abort_early))
    return white_box_attack(name or ("cw-l2-abort" if abort_early else "cw-l2-light"), "l2",
                            steps * search_steps, init, step, config, goal="min_norm")


def cw_reference(
    max_iterations: int = 10_000,
    search_steps: int = 9,
    initial_const: float = 1e-3,
    learning_rate: float = 1e-2,
    confidence: float = 0.0,
    name: str | None = None,
) -> Attack:
    """Carlini-Wagner L2 with the reference implementation's budget, reported as ``"cw-l2"``.

    The algorithm: :mod:`jaxbundle.attacks.white_box.cw`. Paper: Carlini & Wagner 2017, "Towards
    Evaluating the Robustness of Neural Networks".

    nicholas-carlini/nn_robust_attacks ``l2_attack.py`` defaults: ``MAX_ITERATIONS = 10000``
    Adam steps per stage with ``ABORT_EARLY`` (a stage ends once the objective has not
    decreased by 0.01% over ``max_iterations // 10`` steps; per example here),
    ``INITIAL_CONST = 1e-3``, ``BINARY_SEARCH_STEPS = 9``, ``LEARNING_RATE = 1e-2``. The scan
    runs ``max_iterations * search_steps`` steps (an upper bound; aborted examples idle).

    Args:
      max_iterations: Adam steps per stage of the binary search over the constant ``c``.
      search_steps: stages of the binary search.
      initial_const: ``c`` of the first stage.
      learning_rate: Adam's step size.
      confidence: the margin ``kappa`` the logits must clear (0: just misclassified).
      name: report name; default ``"cw-l2"``.

    Returns:
      An :class:`~jaxbundle.attacks.base.Attack` with ``goal="min_norm"``, as :func:`cw` with
      ``abort_early=True``.
    """
    return cw(
        steps=max_iterations,
        search_steps=search_steps,
        initial_const=initial_const,
        learning_rate=learning_rate,
        confidence=confidence,
        name=name or "cw-l2",
        abort_early=True,
    )
