"""Auto-PGD (Croce & Hein 2020, "Reliable evaluation of adversarial robustness with an ensemble
of diverse parameter-free attacks"): PGD with momentum and a step size that adapts itself.

From a random point ``x^0`` of the eps ball, with ``eta = 2 eps`` and ``P`` the projection onto
the ball and the box, each iteration is::

    z       = P(x^k + eta * d(grad f(x^k)))                  (d = sign for Linf, g/||g|| for L2)
    x^{k+1} = P(x^k + a (z - x^k) + (1 - a)(x^k - x^{k-1}))  (a = 1 at k = 0, else alpha = 0.75)

At each checkpoint ``w_j`` (after ``f(x^{w_j})`` is known) the step size is halved and the
iterate restarts from the best point so far, per example, if

1. the loss went up in too few of the ``w_j - w_{j-1}`` iterations since the last checkpoint
   (fewer than ``rho = 75%`` of them), or
2. the step size was not halved at the last checkpoint and the best loss has not improved since.

On a restart ``x^{w_j} := x_max`` and ``x^{w_j - 1}`` is kept, so the next momentum term is
``x_max - x^{w_j - 1}``: Algorithm 1 of the paper sets only ``x^{(k+1)} <- x_max``, and the
reference (fra31/auto-attack, ``autopgd_base.py``) resets ``x_adv`` but not ``x_adv_old``. The
gradient at the best point, kept in the state, is used: no gradient is spent twice. One gradient
per iteration. (``APGDConfig.keep_momentum=False`` drops the momentum after a restart from the
best point instead; it is there for comparisons only.)

Two step-size schedules, ``APGDConfig.schedule``:

``"reference"`` (the default: what AutoAttack runs)
    ``autopgd_base.py``: ``k = max(int(0.22 N), 1)``, then after each checkpoint
    ``k <- max(k - max(int(0.03 N), 1), max(int(0.06 N), 1))``; a checkpoint falls every ``k``
    iterations (``w_1 = k_1``, ``w_{j+1} = w_j + k_{j+1}``). At ``N = 100`` this is the paper's
    ``22, 41, 57, 70, 80, 87, 93, 99``; at ``N = 20`` it is ``4, 7, 9, 10, 11, ..., 19`` and at
    ``N = 50`` ``11, 21, 30, 38, 45``. Condition 1 is ``increases <= rho k`` (the reference's
    ``t <= k * k3``), counting ``f(x^i) > f(x^{i-1})`` over the iterates the model evaluated
    (a restart does not change what ``x^{w_j}`` scored), with ``f(x^1)`` compared with ``0``
    in the first window (the reference reads the not-yet-written ``loss_steps[-1]``, a zero).
    Condition 2 is not checked at the first checkpoint (``reduced_last_check`` starts at 1).

``"paper"``
    Section 3.2: ``w_j = ceil(p_j N)`` with ``p_0 = 0``, ``p_1 = 0.22`` and
    ``p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06)``: at ``N = 20`` ``5, 9, 12, 14, 16, 18, 19``.
    Condition 1 is ``increases < rho (w_j - w_{j-1})`` over ``f(x^{i+1}) > f(x^i)`` for
    ``i = w_{j-1}, ..., w_j - 1`` where ``x^{w_j}`` is ``x_max`` after a restart; condition 2
    compares with ``f(x^0)`` at the first checkpoint.

Checkpoints ``w_j >= N`` are dropped: the last point, ``x^N``, is scored by the bundler, not
stepped from. The reference takes ``N + 1`` gradients for ``n_iter = N`` (one at ``x^0``, one
per iterate); this takes ``N`` (``x^0, ..., x^{N-1}``), ``x^N`` being scored without one.

Losses: ``"ce"``, ``"dlr"`` (untargeted; restarts are independent random starts) and
``"dlr-targeted"`` / ``"ce-targeted"`` (APGD-T): restart ``r`` targets the class with the
``r``-th highest clean logit other than the label, so the target classes are the restart vmap
axis; AutoAttack's standard version runs 9 targets of 100 iterations each. With
``targeting="malt"`` (Melamed et al. 2024, "MALT Powers Up Adversarial Attacks"), restart ``r``
targets instead the class whose linearised boundary is ``r``-th nearest in the threat model's
norm, ``|z_j - z_y| / ||grad (z_j - z_y)||_*`` at the clean image, of the ``candidates`` classes
of highest clean logit: one forward and ``candidates`` backward passes per example, once for
every restart (the attack's ``setup``, outside the restart axis), counted as ``candidates``
gradients.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxbundle.core import losses, norms
from jaxbundle.attacks.base import Attack, Candidate, WhiteBoxModel, check_count, white_box_attack
from jaxbundle.attacks.white_box.deepfool import boundary_distances, top_classes

__all__ = [
    "LOSSES",
    "SCHEDULES",
    "TARGETING",
    "APGDConfig",
    "APGDState",
    "apgd",
    "checkpoints",
    "init",
    "step"
]

LOSSES = ("ce", "dlr", "ce-targeted", "dlr-targeted")
SCHEDULES = ("reference", "paper")
TARGETING = ("logits", "malt")


class APGDConfig(NamedTuple):
    norm: str  # "linf" or "l2"
    loss: str  # one of LOSSES
    num_steps: int  # N: gradient iterations
    checkpoints: tuple[int, ...]  # w_1 < w_2 < ... < N, iterations where eta may be halved
    alpha: float  # a: weight of the new step z - x^k, 1 - a that of x^k - x^{k-1} (paper: 0.75)
    rho: float  # minimum fraction of loss increases between checkpoints (paper: 0.75)
    initial_step: float  # eta^0 / eps (paper: 2)
    targets: int  # target classes of a targeted loss (restart r targets rank r); 0 if untargeted
    schedule: str = "reference"  # one of SCHEDULES: the checkpoints and the halving rule
    keep_momentum: bool = True  # on a restart, keep x^{k-1} (paper, reference); False drops it
    candidates: int = 0  # targeting="malt": classes ranked (highest clean logits); 0 otherwise


class APGDState(NamedTuple):
    x: jax.Array  # [B, ...] current iterate x^k
    x_prev: jax.Array  # [B, ...] previous iterate x^{k-1} (momentum)
    x0: jax.Array  # [B, ...] clean images
    y: jax.Array  # [B] labels
    target: jax.Array  # [B] target class (targeted losses; the label otherwise)
    eps: jax.Array  # [B] radius
    eta: jax.Array  # [B] step size
    loss_prev: jax.Array  # [B] what f(x^k) is compared with: f(x^{k-1}) (see the module doc)
    x_best: jax.Array  # [B, ...] the iterate of highest loss so far
    grad_best: jax.Array  # [B, ...] the gradient there
    loss_best: jax.Array  # [B] its loss
    increases: jax.Array  # int32 [B] loss increases since the last checkpoint
    loss_best_at_check: jax.Array  # [B] best loss at the last checkpoint
    halved_at_check: jax.Array  # bool [B] whether eta was halved at the last checkpoint
    k: jax.Array  # int32 [B] iteration counter (the same for every example)


def checkpoints(num_steps: int, schedule: str = "reference") -> tuple[int, ...]:
    """The checkpoints of ``schedule`` that fall strictly inside ``(0, N)``.

    ``"reference"``: ``autopgd_base.py``'s ``counter3 == k`` loop, with ``int()`` flooring as
    there: the first after ``max(int(0.22 N), 1)`` iterations, each window then
    ``max(int(0.03 N), 1)`` shorter down to ``max(int(0.06 N), 1)``. ``"paper"``:
    ``w_j = ceil(p_j N)``.
    """
    if schedule == "reference":
        window = max(int(0.22 * num_steps), 1)
        shortest, shrink = max(int(0.06 * num_steps), 1), max(int(0.03 * num_steps), 1)
        ws, w = [], window
        while w < num_steps:
            ws.append(w)
            window = max(window - shrink, shortest)
            w += window
        return tuple(ws)
    if schedule != "paper":
        raise ValueError(f"unknown APGD schedule {schedule!r}; expected one of {SCHEDULES}")
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


def malt_targets(config: APGDConfig, x0, y, eps, model: WhiteBoxModel) -> jax.Array:
    """MALT's order (the attack's ``setup``, once for every restart): of the ``candidates``
    classes of highest clean logit, nearest linearised boundary first, ``[B, candidates]``."""
    del eps
    classes = top_classes(model.logits(x0), y, config.candidates, "apgd")
    distance, _, _ = boundary_distances(model, x0, y, classes, config.norm)
    order = jnp.argsort(distance, axis=1, stable=True)
    return jnp.take_along_axis(classes, order, axis=1)


def init(config: APGDConfig, keys, x0, y, eps, model, restart, setup=None) -> APGDState:
    """Restart ``restart``'s state; ``setup``: MALT's target order (:func:`malt_targets`)."""
    x = norms.random_start(keys, x0, eps, config.norm)
    target = (_targets(config, model, x0, y, restart) if setup is None
              else jnp.take(setup, restart, axis=1))
    neg_inf = jnp.full(y.shape, -jnp.inf, jnp.float32)
    return APGDState(
        x=x,
        x_prev=x,
        x0=x0,
        y=y,
        target=target,
        eps=eps,
        eta=config.initial_step * eps,
        loss_prev=jnp.full(y.shape, jnp.inf, jnp.float32),  # x^0 closes no comparison
        x_best=x,
        grad_best=jnp.zeros_like(x),
        loss_best=neg_inf,
        increases=jnp.zeros(y.shape, jnp.int32),
        loss_best_at_check=neg_inf,
        # The reference starts with reduced_last_check = 1: no condition 2 at the first check.
        halved_at_check=jnp.full(y.shape, config.schedule == "reference"),
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

    reference = config.schedule == "reference"
    first = s.k == 0
    is_check, window = _schedule(config)
    check = is_check[s.k]
    budget = config.rho * window[s.k]
    oscillating = increases <= budget if reference else increases < budget
    stalled = ~s.halved_at_check & (loss_best <= s.loss_best_at_check)
    halve = check & (oscillating | stalled)

    # Restart from the best point, with its gradient, where eta halves; x^{k-1} stays, so the
    # next momentum term is x_max - x^{k-1} (unless keep_momentum is off).
    x = where(halve, x_best, s.x)
    x_prev = s.x_prev if config.keep_momentum else where(halve, x_best, s.x_prev)
    g = where(halve, grad_best, grad)
    eta = jnp.where(halve, 0.5 * s.eta, s.eta)
    if reference:  # the evaluated loss; f(x^1) meets the reference's unwritten zero
        loss_next = jnp.where(first, 0.0, loss)
    else:  # the paper's x^k := x_max
        loss_next = jnp.where(halve, loss_best, loss)

    direction = norms.normalize(g, config.norm)
    z = norms.project(x + norms.per_example(eta, direction) * direction, s.x0, s.eps, config.norm)
    a = norms.per_example(jnp.where(first, 1.0, config.alpha), x)
    x_new = norms.project(x + a * (z - x) + (1.0 - a) * (x - x_prev), s.x0, s.eps, config.norm)

    new = s._replace(
        x=x_new,
        x_prev=x,
        eta=eta,
        loss_prev=loss_next,
        x_best=x_best,
        grad_best=grad_best,
        loss_best=loss_best,
        increases=jnp.where(check, 0, increases),
        # f_max at the last checkpoint; before the first one, f(x^0) (w_0 = 0).
        loss_best_at_check=jnp.where(check | first, loss_best, s.loss_best_at_check),
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
    schedule: str = "reference",
    targeting: str = "logits",
    candidates: int = 9,
) -> Attack:
    """APGD (untargeted CE or DLR) or APGD-T (targeted DLR or CE).

    The algorithm: :mod:`jaxbundle.attacks.white_box.apgd`. Paper: Croce & Hein 2020, "Reliable
    Evaluation of Adversarial Robustness with an Ensemble of Diverse Parameter-free Attacks"
    (APGD-CE, APGD-DLR, APGD-T).

    Args:
      norm: ``"linf"`` or ``"l2"``.
      loss: ``"ce"``, ``"dlr"``, ``"dlr-targeted"`` or ``"ce-targeted"``.
      steps: iterations (gradients) per run; AutoAttack uses 100.
      restarts: independent random starts of an untargeted run.
      targets: target classes of a targeted run (one run each, a vmap axis): the classes of
        highest clean logit other than the label. AutoAttack uses 9 (all others on 10 classes).
      name: report name; default ``"apgd-<loss>"`` or ``"apgd-t"`` for targeted DLR.
      schedule: ``"reference"`` (AutoAttack's ``autopgd_base.py``: its checkpoints and halving
        test) or ``"paper"`` (``w_j = ceil(p_j N)`` and the paper's test); they agree on the
        checkpoints at 100 steps, not at 20 or 50 (see the module docstring).
      targeting: a targeted run's order of targets: ``"logits"`` (AutoAttack's: highest clean
        logit first) or ``"malt"`` (nearest linearised boundary first, of the ``candidates``
        classes of highest logit; see the module docstring).
      candidates: the classes MALT ranks (``candidates`` backward passes once per example;
        at least ``targets``, at most the model's classes less one, checked when traced).

    Returns:
      An :class:`~jaxbundle.attacks.base.Attack` feeding the misclassify and max-confidence goals.
    """
    if norms.check_norm(norm) not in ("linf", "l2"):
        raise ValueError(f"apgd supports norms 'linf' and 'l2', not {norm!r}")
    if loss not in LOSSES:
        raise ValueError(f"unknown APGD loss {loss!r}; expected one of {LOSSES}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown APGD schedule {schedule!r}; expected one of {SCHEDULES}")
    for label, value in (("steps", steps), ("restarts", restarts), ("targets", targets)):
        check_count("apgd", label, value)
    targeted = loss.endswith("targeted")
    if targeted and restarts != 1:
        raise ValueError("a targeted apgd runs one restart per target: set targets, not restarts")
    if targeting not in TARGETING:
        raise ValueError(f"unknown APGD targeting {targeting!r}; expected one of {TARGETING}")
    malt = targeting == "malt"
    if malt and not targeted:
        raise ValueError(f"targeting='malt' orders a targeted loss's targets; loss {loss!r} "
                         "has none")
    check_count("apgd", "candidates", candidates)
    if malt and candidates < targets:
        raise ValueError(f"targeting='malt' ranks {candidates} candidates, fewer than the "
                         f"{targets} targets")
    default_name = "apgd-t" if loss == "dlr-targeted" else f"apgd-{loss}"
    config = APGDConfig(
        norm=norm,
        loss=loss,
        num_steps=steps,
        checkpoints=checkpoints(steps, schedule),
        alpha=0.75,
        rho=0.75,
        initial_step=2.0,
        targets=targets if targeted else 0,
        schedule=schedule,
        candidates=candidates if malt else 0,
    )
    attack = white_box_attack(name or default_name, norm, steps, init, step, config,
                              restarts=targets if targeted else restarts)
    if malt:
        attack = attack._replace(setup=malt_targets, setup_gradients=candidates)
    return attack
