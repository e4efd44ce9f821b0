"""Auto-PGD (Croce & Hein 2020, "Reliable evaluation of adversarial robustness with an ensemble
of diverse parameter-free attacks"): PGD with momentum and a step size that adapts itself.

From a random point ``x^0`` of the eps ball, with ``eta = 2 eps`` and ``P`` the projection onto
the ball and the box, each iteration is::

    z       = P(x^k + eta * d(grad f(x^k)))                  (d = sign for Linf, g/||g|| for L2)
    x^{k+1} = P(x^k + a (z - x^k) + (1 - a)(x^k - x^{k-1}))  (a = 1 at k = 0, else 0.75)

At the checkpoints ``w_j = ceil(p_j N)`` with ``p_0 = 0``, ``p_1 = 0.22`` and
``p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06)``, the step size is halved and the iterate
restarts from the best point so far, per example, if

1. the loss went up in fewer than ``rho = 75%`` of the iterations since the last checkpoint, or
2. the step size was not halved at the last checkpoint and the best loss has not improved since.

On a restart the momentum is dropped (``x^{k-1} := x^k``), and the gradient at the best point,
kept in the state, is used: no gradient is spent twice. One gradient per iteration.

Losses: ``"ce"``, ``"dlr"`` (untargeted; restarts are independent random starts) and
``"dlr-targeted"`` / ``"ce-targeted"`` (APGD-T): restart ``r`` targets the class with the
``r``-th highest clean logit other than the label, so the target classes are the restart vmap
axis; AutoAttack's standard version runs 9 targets of 100 iterations each.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxbundle import losses, norms
from jaxbundle.attacks.base import Attack, Candidate, WhiteBoxModel
from jaxbundle.attacks.pgd import random_in_ball

__all__ = ["APGDConfig", "APGDState", "checkpoints", "init", "step", "apgd", "LOSSES"]

LOSSES = ("ce", "dlr", "ce-targeted", "dlr-targeted")


class APGDConfig(NamedTuple):
    norm: str  # "linf" or "l2"
    loss: str  # one of LOSSES
    num_steps: int  # N: gradient iterations
    checkpoints: tuple[int, ...]  # w_1 < w_2 < ... < N, iterations where eta may be halved
    momentum: float  # 1 - a: weight of the previous displacement (paper: a = 0.75)
    rho: float  # minimum fraction of loss increases between checkpoints (paper: 0.75)
    initial_step: float  # eta^0 / eps (paper: 2)
    targets: int  # target classes of a targeted loss (restart r targets rank r); 0 if untargeted


class APGDState(NamedTuple):
    x: jax.Array  # [B, ...] current iterate x^k
    x_prev: jax.Array  # [B, ...] previous iterate x^{k-1} (momentum)
    x0: jax.Array  # [B, ...] clean images
    y: jax.Array  # [B] labels
    target: jax.Array  # [B] target class (targeted losses; the label otherwise)
    eps: jax.Array  # [B] radius
    eta: jax.Array  # [B] step size
    loss_prev: jax.Array  # [B] f(x^{k-1})
    x_best: jax.Array  # [B, ...] the iterate of highest loss so far
    grad_best: jax.Array  # [B, ...] the gradient there
    loss_best: jax.Array  # [B] its loss
    increases: jax.Array  # int32 [B] loss increases since the last checkpoint
    loss_best_at_check: jax.Array  # [B] best loss at the last checkpoint
    halved_at_check: jax.Array  # bool [B] whether eta was halved at the last checkpoint
    k: jax.Array  # int32 [B] iteration counter (the same for every example)


def checkpoints(num_steps: int) -> tuple[int, ...]:
    """The paper's checkpoints ``w_j = ceil(p_j N)`` that fall strictly inside ``(0, N)``."""
    p = [0.0, 0.22]
    while p[-1] < 1.0:
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
    ws = sorted({math.ceil(round(pj * num_steps, 6)) for pj in p[1:]})  # 0.57 * 100 is 57
    return tuple(w for w in ws if 0 < w < num_steps)


def _loss_fn(name: str):
    if name == "ce":
        return lambda logits, y, t: losses.cross_entropy(logits, y)
    if name == "dlr":
        return lambda logits, y, t: losses.dlr(logits, y)
    if name == "ce-targeted":
        return lambda logits, y, t: losses.targeted_cross_entropy(logits, t)
    return losses.targeted_dlr


def _schedule(config: APGDConfig) -> tuple[jax.Array, jax.Array]:
    """Per iteration: whether it is a checkpoint, and the length of the window it closes."""
    is_check = [False] * config.num_steps
    window = [1] * config.num_steps
    last = 0
    for w in config.checkpoints:
        is_check[w], window[w], last = True, w - last, w
    return jnp.asarray(is_check), jnp.asarray(window, jnp.float32)


def _targets(config: APGDConfig, model, x0, y, restart) -> jax.Array:
    """Restart ``r`` targets the class of ``r``-th highest clean logit other than the label."""
    if not config.loss.endswith("targeted"):
        return y
    logits = model.logits(x0)
    num_classes = logits.shape[-1]
    needed = max(4 if config.loss == "dlr-targeted" else 2, config.targets + 1)
    if num_classes < needed:
        raise ValueError(
            f"APGD loss {config.loss!r} with {config.targets} targets needs at least {needed} "
            f"classes, the model has {num_classes}"
        )
    others = logits - jax.nn.one_hot(y, num_classes, dtype=logits.dtype) * 1e9
    ranked = jnp.argsort(-others, axis=-1)
    return ranked[:, restart].astype(jnp.int32)


def init(config: APGDConfig, keys, x0, y, eps, model, restart) -> APGDState:
    x = norms.project_box(x0 + random_in_ball(keys, x0.shape[1:], eps, config.norm))
    neg_inf = jnp.full(y.shape, -jnp.inf, jnp.float32)
    return APGDState(
        x=x,
        x_prev=x,
        x0=x0,
        y=y,
        target=_targets(config, model, x0, y, restart),
        eps=eps,
        eta=config.initial_step * eps,
        loss_prev=neg_inf,
        x_best=x,
        grad_best=jnp.zeros_like(x),
        loss_best=neg_inf,
        increases=jnp.zeros(y.shape, jnp.int32),
        loss_best_at_check=neg_inf,
        halved_at_check=jnp.zeros(y.shape, bool),
        k=jnp.zeros(y.shape, jnp.int32),
    )


def step(config: APGDConfig, state: APGDState, model: WhiteBoxModel):
    s = state
    loss, grad, logits = model.loss_and_grad(_loss_fn(config.loss), s.x, s.y, s.target)
    where = lambda c, a, b: jnp.where(norms.per_example(c, a), a, b)  # noqa: E731

    increases = s.increases + (loss > s.loss_prev).astype(jnp.int32)
    improved = loss > s.loss_best
    x_best = where(improved, s.x, s.x_best)
    grad_best = where(improved, grad, s.grad_best)
    loss_best = jnp.where(improved, loss, s.loss_best)

    is_check, window = _schedule(config)
    check = is_check[s.k]
    oscillating = increases < config.rho * window[s.k]
    stalled = ~s.halved_at_check & (loss_best <= s.loss_best_at_check)
    halve = check & (oscillating | stalled)

    # Restart from the best point, with its gradient and without momentum, where eta halves.
    x = where(halve, x_best, s.x)
    x_prev = where(halve, x_best, s.x_prev)
    g = where(halve, grad_best, grad)
    loss_here = jnp.where(halve, loss_best, loss)
    eta = jnp.where(halve, 0.5 * s.eta, s.eta)

    direction = norms.normalize(g, config.norm)
    z = norms.project(x + norms.per_example(eta, direction) * direction, s.x0, s.eps, config.norm)
    a = norms.per_example(jnp.where(s.k == 0, 1.0, 1.0 - config.momentum), x)
    x_new = norms.project(x + a * (z - x) + (1.0 - a) * (x - x_prev), s.x0, s.eps, config.norm)

    new = s._replace(
        x=x_new,
        x_prev=x,
        eta=eta,
        loss_prev=loss_here,
        x_best=x_best,
        grad_best=grad_best,
        loss_best=loss_best,
        increases=jnp.where(check, 0, increases),
        loss_best_at_check=jnp.where(check, loss_best, s.loss_best_at_check),
        halved_at_check=jnp.where(check, halve, s.halved_at_check),
        k=s.k + 1,
    )
    return new, Candidate(s.x, logits)


def apgd(
    norm: str = "linf",
    loss: str = "ce",
    steps: int = 100,
    restarts: int = 1,
    targets: int = 9,
    name: str | None = None,
) -> Attack:
    """APGD (untargeted CE or DLR) or APGD-T (targeted DLR or CE).

    Args:
      norm: ``"linf"`` or ``"l2"``.
      loss: ``"ce"``, ``"dlr"``, ``"dlr-targeted"`` or ``"ce-targeted"``.
      steps: iterations (gradients) per run; AutoAttack uses 100.
      restarts: independent random starts of an untargeted run.
      targets: target classes of a targeted run (one run each, a vmap axis): the classes of
        highest clean logit other than the label. AutoAttack uses 9 (all others on 10 classes).
      name: report name; default ``"apgd-<loss>"`` or ``"apgd-t"`` for targeted DLR.

    Returns:
      An :class:`~jaxbundle.attacks.base.Attack` feeding the misclassify and max-confidence goals.
    """
    if norms.check_norm(norm) not in ("linf", "l2"):
        raise ValueError(f"apgd supports norms 'linf' and 'l2', not {norm!r}")
    if loss not in LOSSES:
        raise ValueError(f"unknown APGD loss {loss!r}; expected one of {LOSSES}")
    if steps < 1 or restarts < 1 or targets < 1:
        raise ValueError(
            f"apgd needs steps, restarts and targets >= 1, got {steps}, {restarts}, {targets}"
        )
    targeted = loss.endswith("targeted")
    if targeted and restarts != 1:
        raise ValueError("a targeted apgd runs one restart per target: set targets, not restarts")
    default_name = "apgd-t" if loss == "dlr-targeted" else f"apgd-{loss}"
    return Attack(
        name=name or default_name,
        kind="white-box",
        norm=norm,
        num_steps=steps,
        num_restarts=targets if targeted else restarts,
        gradients_per_step=1,
        init=init,
        step=step,
        config=APGDConfig(
            norm, loss, steps, checkpoints(steps), 0.25, 0.75, 2.0, targets if targeted else 0
        ),
    )
