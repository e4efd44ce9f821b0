"""The bundler: every candidate of every step, restart and attack, folded per example.

``bundle(attacks, apply_fn, params, x, y, key, eps=...)`` runs a static tuple of attacks in one
jitted program. For each attack (a Python loop at trace time over a static tuple):

1. restarts are a ``vmap`` axis (or a sequential ``lax.map``, to bound memory), each with its
   own key ``fold_in(fold_in(fold_in(key, example_id), attack_index), restart)``;
2. a ``lax.scan`` over steps calls ``step`` and folds its candidate into a best state per goal
   (:func:`fold`, a per-example ``where``: no extra forward pass); after the scan the final
   iterate is evaluated once and folded too;
3. the restarts' bests are folded into one;
4. :func:`jaxbundle.core.judge.verify` judges the best images as a user would submit them (on the
   8-bit grid inside the ball where the clean image is on the grid, else in float32), re-runs
   the model on them and re-checks box, ball and label: what fails does not count, and nothing
   the attack's own candidate did not achieve is credited to it;
5. the verified best is folded into the bundle's best state, which starts from the clean image;
6. against a stochastic model, once every attack is folded, each goal's winner and the clean
   image are re-judged on held-out calls (:func:`held_out`): the calls that chose a winner
   overstate its rate (it is the best of several), so the reported rates are the held-out ones.

The misclassify goal is always tracked, and each attack's own verified success is kept, so the
many-attack table, the worst-attack table and the bundled figure come from one run.

The records: :class:`Rules` (the static rules of a run: the model, the goals, the norm, how
candidates are judged, how restarts run), :class:`Problem` (one batch as the attacks and the
judge see it, built once per program by :func:`problem`) and :class:`Driver` (one attack of the
run: ``init``, ``steps`` and ``judge``, steps 1-5 above). :func:`run` is the jitted bundle;
the same three calls, jitted one attack at a time (:func:`start_stage`, :func:`step_stage`,
:func:`judge_stage`, :func:`take_rows`), let a cascade run a stage in segments and gather the
rows still running between them (:mod:`jaxbundle.run.cascade`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxbundle.core import goals as goals_lib, norms, sampling
from jaxbundle.attacks.base import Attack, WhiteBoxModel, per_example_keys, threat_model
from jaxbundle.core.canonical import fast_gradients
from jaxbundle.core.goals import (BestState, candidate_state, cross_fold, fold, fold_all, fold_each,
                             fold_stacked)
from jaxbundle.core.judge import (STRETCH, Problem, check_judging, judged_on_grid, judged_score,
                                  verify)
from jaxbundle.core.judge import held_out as judge_held_out
from jaxbundle.core.validation import check_attacks, check_eot, check_inputs, goals_for

__all__ = ["BestState", "BundleResult", "Driver", "Judged", "Problem", "Rules", "Running",
           "bundle", "candidate_state", "check_attacks", "check_eot", "check_inputs",
           "clean_state", "fold", "fold_all", "fold_each", "goals_for", "held_out",
           "judge_stage", "problem", "restart_keys", "run", "seen", "start_stage",
           "step_stage", "still_improving", "take_rows", "window_start"]


class BundleResult(NamedTuple):
    """What one bundle run returns (a pytree of arrays; attack names stay with the caller)."""

    best: dict[str, BestState]  # goal name -> verified best state
    clean: goals_lib.Score  # the clean image's score
    attack_success: jax.Array  # bool [A, B]: each attack alone (misclassify goal, verified)
    attack_distortion: jax.Array  # [A, B]: each attack's smallest verified adversarial
    #   distortion (min-norm goal if tracked, else its success within eps; inf: none)
    attack_step: jax.Array  # int32 [A, B]: the step of each attack's best verified misclassify
    #   candidate; -1: none beat the clean image (the attack never moved the margin up);
    #   -2: the attack did not run on the example (a cascade)
    attack_improving: jax.Array  # bool [A, B]: the attack failed while its margin was still
    #   rising over its last steps (see :func:`still_improving`)
    gradients: jax.Array  # int32 [B]: gradient evaluations spent per example
    queries: jax.Array  # int32 [B]: black-box model queries spent per example
    judged_on_grid: jax.Array  # bool [B]: judged on the 8-bit grid (else in float32)
    selection_rate: jax.Array | None = None  # float [B], stochastic models: the misclassify
    #   winner's success rate on the judge's calls that chose it (``best`` and ``clean`` then
    #   hold the held-out calls' scores, see :func:`held_out`); None: a deterministic model


class Rules(NamedTuple):
    """The static rules of a run (hashable: one program per distinct rules)."""

    apply_fn: Callable[[Any, jax.Array], jax.Array]
    goal_names: tuple[str, ...]
    norm: str
    judging: str = "auto"
    restart_mode: str = "vmap"
    unroll: int | bool = 1  # the steps' ``lax.scan`` unroll where their bounds are static


def problem(rules: Rules, params: Any, x: jax.Array, y: jax.Array, eps: jax.Array,
            keys: jax.Array) -> Problem:
    """The batch in float32, the radius the attacks aim at, the grid mask and the model as the
    judge calls it (a stochastic model: its ``calls`` under each example's judge keys, the same
    for every candidate)."""
    x = x.astype(jnp.float32)
    y = y.astype(jnp.int32)
    eps = jnp.broadcast_to(jnp.asarray(eps, jnp.float32), y.shape)
    grid = judged_on_grid(x, rules.judging)
    # On the grid the ball holds whole levels only: attacks aim at the radius the judge allows
    # (76/255 for Linf 0.3), so that rounding never has to cut a saturated perturbation back.
    eps = jnp.where(grid, norms.grid_radius(eps, rules.norm), eps)
    apply_fn = fast_gradients(rules.apply_fn)
    if not sampling.is_stochastic(apply_fn):
        model = WhiteBoxModel(apply_fn, params, grid)
    else:
        model = WhiteBoxModel(apply_fn, params, grid, sampling.judge_keys(keys),
                              apply_fn.calls, fresh=False)
    return Problem(model, x, y, eps, grid, keys)


def clean_state(rules: Rules, p: Problem) -> BestState:
    """The clean images' candidate as the judge scores it (attack -1)."""
    s, _ = judged_score(p.model, p.x, p.x, p.y, rules.norm)
    full = jnp.full(p.y.shape, 0, jnp.int32)
    return BestState(x=p.x, score=s, attack=full - 1, restart=full, step=full)


def restart_keys(keys: jax.Array, index: int, restart: int | jax.Array) -> jax.Array:
    """``[B]`` keys of restart ``restart`` of attack ``index``: ``fold_in(fold_in(keys, index),
    restart)`` per example (``keys``: the examples' keys)."""
    return sampling.fold_each(sampling.fold_each(keys, index), restart)


def seen(attack: Attack, model: WhiteBoxModel, restart_keys_: jax.Array,
         call: int | jax.Array):
    """What the attack may see of the model (:func:`threat_model`), for a stochastic model with
    the keys of model call ``call`` of this restart (see :mod:`jaxbundle.core.sampling`) and the
    attack's EOT samples."""
    keys = None
    if model.stochastic:
        keys = sampling.fold_each(sampling.fold_each(restart_keys_, sampling.MODEL_STREAM), call)
    return threat_model(attack.kind, model.apply_fn, model.params, model.grid, keys, attack.eot)


def _over_restarts(attack: Attack, restart_mode: str, fn: Callable, *stacked: Any, first=0):
    """``fn(restart, *args)`` over the leading restart axis ``[R]`` of ``stacked`` (``vmap``, or
    one at a time with ``lax.map``), numbered from ``first``; the outputs stacked on ``[R]``.
    With one restart nothing is mapped: the arguments squeezed, the outputs expanded."""
    restarts = first + jnp.arange(attack.num_restarts, dtype=jnp.int32)
    if attack.num_restarts == 1:
        out = fn(restarts[0], *jax.tree.map(lambda a: a[0], stacked))
        return jax.tree.map(lambda a: a[None], out)
    if restart_mode == "vmap":
        return jax.vmap(fn)(restarts, *stacked)
    return jax.lax.map(lambda args: fn(*args), (restarts, *stacked))


class Running(NamedTuple):
    """One attack part-way through its steps on one batch (a pytree of arrays)."""

    state: Any  # the attack's state, restart-stacked: every leaf [R, B, ...]
    best: dict[str, BestState]  # goal name -> each restart's unverified best, [R, B, ...]
    clean: BestState  # [B]: the clean image's candidate (every goal's starting best)
    keys: jax.Array  # [B]: the examples' keys (per_example_keys)
    early: jax.Array  # [R, B]: each restart's best margin before its last steps (WINDOW)
    first: int | jax.Array = 0  # its first restart's number (restart_mode="cascade": schedule)


class Judged(NamedTuple):
    """An attack's verified result on one batch (:meth:`Driver.judge`)."""

    best: dict[str, BestState]  # goal name -> its verified best, offered to every goal
    success: jax.Array  # [B] bool: verified misclassification
    distortion: jax.Array  # [B] its smallest verified adversarial distortion (inf: none)
    step: jax.Array  # [B] int32: the step of its best misclassify candidate (-1: none)
    improving: jax.Array  # [B] bool: failed while still improving (still_improving)


class Driver(NamedTuple):
    """One attack of a run (static, hashable): the attack, its position in the bundle (its
    keys' fold and its candidates' ``attack`` field) and the run's rules. :meth:`init`,
    :meth:`steps` and :meth:`judge` are what the full bundle runs per attack, and a cascade's
    stage too, with segments of steps between them."""

    attack: Attack
    index: int
    rules: Rules

    def init(self, p: Problem, clean: BestState, first: int | jax.Array = 0) -> Running:
        """Every restart's initial state (numbered from ``first``), the clean image every
        goal's best (a stochastic model's as a 0-or-1 success rate, as the attack's candidates
        are)."""
        attack = self.attack
        shared = {}
        if attack.setup is not None:  # once for every restart, under the first one's keys
            model = seen(attack, p.model, restart_keys(p.keys, self.index, first),
                         sampling.INIT_CALL)
            shared["setup"] = attack.setup(attack.config, p.x, p.y, p.eps, model)

        def one_restart(restart):
            keys = restart_keys(p.keys, self.index, restart)
            model = seen(attack, p.model, keys, sampling.INIT_CALL)
            return attack.init(attack.config, keys, p.x, p.y, p.eps, model, restart, **shared)

        state = _over_restarts(attack, self.rules.restart_mode, one_restart, first=first)
        start = clean._replace(score=clean.score._replace(
            rate=clean.score.misclassified.astype(jnp.float32)))
        best = jax.tree.map(lambda a: jnp.broadcast_to(a, (attack.num_restarts, *a.shape)),
                            start)
        return Running(state, {g: best for g in self.rules.goal_names}, clean, p.keys,
                       best.score.margin, first)

    def steps(self, p: Problem, running: Running, t0: int | jax.Array,
              t1: int | jax.Array) -> Running:
        """Steps ``t0 .. t1 - 1`` of every restart, each candidate folded into its restart's
        best per goal. Static bounds run a ``lax.scan`` (unrolled by the rules' ``unroll``);
        traced ones a ``lax.fori_loop``, so that one program serves every segment of a
        cascade's stage."""
        attack, goal_names, norm = self.attack, self.rules.goal_names, self.rules.norm
        check_from = window_start(attack)

        def one_restart(restart, state, best, early):
            keys = restart_keys(running.keys, self.index, restart)

            def body(t, carry):
                state, best, early = carry
                state, cand = attack.step(attack.config, state, seen(attack, p.model, keys, t))
                # Label-only attacks return no logits: the evaluator computes them, uncounted.
                logits = cand.logits
                if logits is None:
                    logits = _evaluator(p.model, keys, t).logits(cand.x)
                c = candidate_state(cand.x, logits, p.x, p.y, norm, (self.index, restart, t),
                                    goal_names)
                best = fold_all(goal_names, p.eps, best, c)
                # the best margin of the steps before the window, frozen once it starts
                early = jnp.where(t < check_from, best["misclassify"].score.margin, early)
                return state, best, early

            if isinstance(t0, int) and isinstance(t1, int):
                carry, _ = jax.lax.scan(
                    lambda carry, t: (body(t, carry), None), (state, best, early),
                    jnp.arange(t0, t1, dtype=jnp.int32), unroll=self.rules.unroll,
                )
                return carry
            return jax.lax.fori_loop(t0, t1, body, (state, best, early))

        state, best, early = _over_restarts(attack, self.rules.restart_mode, one_restart,
                                            running.state, running.best, running.early,
                                            first=running.first)
        return running._replace(state=state, best=best, early=early)

    def judge(self, p: Problem, running: Running, t: int | jax.Array,
              last: bool | jax.Array = True) -> Judged:
        """The attack's bests after ``t`` steps, verified (:func:`jaxbundle.core.judge.verify`) and
        offered to every goal; after the ``last`` step (a traced bool: one program judges
        every segment) each restart's current iterate is evaluated and folded in first, and
        the still-improving indicator applies."""
        if isinstance(last, bool):
            found = self._best(p, running, t, iterate=last)
        else:
            found = jax.lax.cond(last, lambda: self._best(p, running, t, iterate=True),
                                 lambda: self._best(p, running, t, iterate=False))
        return self._verified(p, found, running.clean,
                              last & still_improving(self.attack, running))

    def _best(self, p: Problem, running: Running, t: int | jax.Array,
              iterate: bool) -> dict[str, BestState]:
        """The restarts' bests folded into one per goal, in order (unverified). With
        ``iterate``, each restart's current iterate is evaluated once more and folded in first,
        as step ``t`` (after the last step; mid-run the next step evaluates it anyway).
        Against a stochastic model the restarts stay stacked ``[R, B, ...]``: each is judged
        before they are folded (:meth:`_verified`), so that the best on average wins, not the
        luckiest draw."""
        goal_names, index = self.rules.goal_names, self.index

        def one_restart(restart, state, best):
            logits = _evaluator(p.model, restart_keys(running.keys, index, restart),
                                t).logits(state.x)
            final = candidate_state(state.x, logits, p.x, p.y, self.rules.norm,
                                    (index, restart, t), goal_names)
            return fold_all(goal_names, p.eps, best, final)

        stacked = running.best
        if iterate:
            stacked = _over_restarts(self.attack, self.rules.restart_mode, one_restart,
                                     running.state, stacked, first=running.first)
        if p.model.stochastic:
            return stacked
        if self.attack.num_restarts == 1:
            return jax.tree.map(lambda a: a[0], stacked)
        return fold_stacked(goal_names, p.eps, stacked)

    def _verified(self, p: Problem, found: dict[str, BestState], clean: BestState,
                  improving: jax.Array) -> Judged:
        """``found`` verified and offered to every goal, with the attack's verified success
        (misclassify), smallest verified distortion, the step of its best misclassify
        candidate (-1: the clean image's stayed best) and whether it failed while still
        ``improving`` per example."""
        goal_names, norm = self.rules.goal_names, self.rules.norm
        # A black-box attack's image is judged as it queried it: no uncounted stretching.
        stretch = (1.0,) if self.attack.black_box else STRETCH

        def judge(found):
            verified = {g: verify(found[g], g, p, norm, clean, stretch)
                        for g in goal_names}
            return cross_fold(goal_names, p.eps, verified)

        if p.model.stochastic:  # restart-stacked (see _best): judged, then folded
            found = fold_stacked(goal_names, p.eps, jax.vmap(judge)(found))
        else:
            found = judge(found)
        mis = found["misclassify"]
        success = goals_lib.success("misclassify", mis.score, p.eps)
        step = jnp.where(mis.attack >= 0, mis.step, -1)
        return Judged(found, success, _smallest_distortion(found, p.eps), step,
                      improving & ~success)


WINDOW = 0.1  # the last fraction of an attack's steps the still-improving indicator looks at
PROGRESS = 0.05  # ... and the fraction of its whole progress they must bring to count


def window_start(attack: Attack) -> int:
    """The first step of the window :func:`still_improving` looks at; ``num_steps`` (no
    window) where the indicator does not apply: black-box and minimum-norm attacks, and
    attacks of under 10 steps."""
    if attack.black_box or attack.goal != "misclassify" or attack.num_steps < 10:
        return attack.num_steps
    return attack.num_steps - max(1, int(round(WINDOW * attack.num_steps)))


def still_improving(attack: Attack, running: Running) -> jax.Array:
    """Per example ``[B]``: Pintor et al.'s incomplete-optimisation indicator. The best margin
    (over the restarts, in the attack's own view) rose in the last ``WINDOW`` of the steps by
    more than ``PROGRESS`` of its whole rise from the clean image: more steps would likely have
    gone further."""
    if window_start(attack) >= attack.num_steps:
        return jnp.zeros(running.clean.score.margin.shape, bool)
    final = jnp.max(running.best["misclassify"].score.margin, axis=0)
    early = jnp.max(running.early, axis=0)
    clean = running.clean.score.margin
    return (final > clean) & (final - early > PROGRESS * (final - clean))


def _evaluator(model: WhiteBoxModel, restart_keys_: jax.Array, t: int | jax.Array
               ) -> WhiteBoxModel:
    """The uncounted evaluator of a restart's candidates at step ``t`` (labels-only attacks'
    candidates, the final iterate): the model itself, or for a stochastic one a single call
    under keys no attack call uses."""
    if not model.stochastic:
        return model
    keys = sampling.fold_each(sampling.fold_each(restart_keys_, sampling.EVAL_STREAM), t)
    return WhiteBoxModel(model.apply_fn, model.params, model.grid, keys, 1)


@functools.partial(jax.jit, static_argnames=("rules", "attacks"))
def run(params: Any, x: jax.Array, y: jax.Array, key: jax.Array, example_id: jax.Array,
        eps: jax.Array, *, rules: Rules, attacks: tuple[Attack, ...]) -> BundleResult:
    """The jitted bundle (:func:`bundle` checks its inputs and calls it): attack ``k`` by its
    :class:`Driver` of index ``k`` (its key fold and its candidates' ``attack`` field), each
    from the clean image, every result folded per example and goal. A cascade runs the same
    drivers stage by stage (:mod:`jaxbundle.run.cascade`)."""
    keys = per_example_keys(key, example_id)
    p = problem(rules, params, x, y, eps, keys)
    clean = clean_state(rules, p)
    best = {g: clean for g in rules.goal_names}
    judged = []
    for index, attack in enumerate(attacks):
        driver = Driver(attack, index, rules)  # every attack starts alone from the clean image
        running = driver.steps(p, driver.init(p, clean), 0, attack.num_steps)
        judged.append(driver.judge(p, running, attack.num_steps))
        best = fold_each(rules.goal_names, p.eps, best, judged[-1].best)

    stack = lambda field: jnp.stack([getattr(j, field) for j in judged])  # noqa: E731
    return BundleResult(
        best=best,
        clean=clean.score,
        attack_success=stack("success"),
        attack_distortion=stack("distortion"),
        attack_step=stack("step").astype(jnp.int32),
        attack_improving=stack("improving"),
        gradients=jnp.full(p.y.shape, sum(a.gradients for a in attacks), dtype=jnp.int32),
        queries=jnp.full(p.y.shape, sum(a.queries for a in attacks), dtype=jnp.int32),
        judged_on_grid=p.grid,
    )


# XLA:CPU compiles the programs a cascade runs once per stage or segment (starting a stage,
# judging it, moving rows) at -O0 with the classic emitters: measured on the default bundle
# (demo CNN, 256 images), the judging programs' compile time falls from 20 s to 6 s and the
# run's warm time does not change (8.4 s vs 8.6 s); the per-step programs keep XLA's defaults
# (at -O0 they ran 1.8x slower).
_CPU_GLUE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def glue_jit(fun=None, **jit_kwargs):
    """``jax.jit`` for a program that runs once per stage or segment, never per step: on CPU
    compiled for compile speed (:data:`_CPU_GLUE_OPTIONS`), elsewhere with the defaults."""
    if fun is None:
        return functools.partial(glue_jit, **jit_kwargs)
    cpu = jax.jit(fun, compiler_options=_CPU_GLUE_OPTIONS, **jit_kwargs)
    other = jax.jit(fun, **jit_kwargs)

    @functools.wraps(fun)
    def call(*args, **kwargs):
        nested = any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((args, kwargs)))
        top_cpu = not nested and jax.default_backend() == "cpu"  # options: top level only
        return (cpu if top_cpu else other)(*args, **kwargs)

    return call


@glue_jit(static_argnames=("driver",))
def start_stage(params, x, y, key, example_id, eps, first=0, *, driver: Driver) -> Running:
    """A cascade's stage run in segments: the driver's attack initialised on a bucket of rows,
    with the same keys as in the full bundle (see :mod:`jaxbundle.run.cascade`), its restarts
    numbered from ``first`` (traced: one program for every part of a cascade of restarts)."""
    p = problem(driver.rules, params, x, y, eps, per_example_keys(key, example_id))
    return driver.init(p, clean_state(driver.rules, p), jnp.asarray(first, jnp.int32))


@functools.partial(jax.jit, static_argnames=("driver",))
def step_stage(params, running, x, y, eps, t0, t1, *, driver: Driver) -> Running:
    """Steps ``t0 .. t1 - 1`` (traced: one program per bucket size) of a stage's rows."""
    p = problem(driver.rules, params, x, y, eps, running.keys)
    return driver.steps(p, running, t0, t1)


@glue_jit(static_argnames=("driver",))
def judge_stage(params, running, x, y, eps, t, last, *, driver: Driver) -> Judged:
    """A stage's verified bests after ``t`` steps, as :func:`run` judges an attack's
    (:meth:`Driver.judge`; ``last``: a traced bool, so one program judges every segment)."""
    p = problem(driver.rules, params, x, y, eps, running.keys)
    return driver.judge(p, running, t, last)


@glue_jit
def take_rows(running: Running, positions: jax.Array) -> Running:
    """The rows ``positions`` of a stage mid-run (axis 1 of the restart-stacked leaves)."""
    pick = lambda a: jnp.take(a, positions, axis=1)  # noqa: E731
    rows = lambda a: jnp.take(a, positions, axis=0)  # noqa: E731
    state, best, early = jax.tree.map(pick, (running.state, running.best, running.early))
    return running._replace(state=state, best=best, early=early,
                            clean=jax.tree.map(rows, running.clean), keys=rows(running.keys))


def held_out(result: BundleResult, params: Any, x: jax.Array, y: jax.Array, key: jax.Array,
             example_id: jax.Array, eps: jax.Array, *, rules: Rules) -> BundleResult:
    """A stochastic model's ``result`` with every goal's winner and the clean image re-judged
    on held-out calls (:func:`jaxbundle.core.judge.held_out`: the success, rate and robust accuracy
    reported) and ``selection_rate`` the misclassify winner's rate on the calls that chose it
    (the winners and ``attack_success`` unchanged); a deterministic model's as it is. ``x, y,
    key, example_id, eps``: as given to the bundle or cascade that produced ``result``."""
    if not sampling.is_stochastic(rules.apply_fn):
        return result
    return _held_out(result, params, x, y, key, example_id, eps, rules=rules)


@glue_jit(static_argnames=("rules",))
def _held_out(result, params, x, y, key, example_id, eps, *, rules):
    keys = per_example_keys(key, example_id)
    p = problem(rules, params, x, y, eps, keys)
    best, clean = judge_held_out(result.best, p.model.replace(keys=sampling.heldout_keys(keys)),
                                 p.x, p.y, p.eps, rules.norm)
    return result._replace(best=best, clean=clean,
                           selection_rate=result.best["misclassify"].score.rate)


def _smallest_distortion(found: dict[str, BestState], eps: jax.Array) -> jax.Array:
    """An attack's smallest verified adversarial distortion per example (inf: none found).

    From an unbounded (min-norm) goal when one is tracked, else from the misclassify goal's
    success.
    """
    goal = next((g for g in found if not goals_lib.GOALS[g].bounded), "misclassify")
    s = found[goal].score
    return jnp.where(goals_lib.success(goal, s, eps), s.distortion, jnp.inf)


def bundle(  # noqa: PLR0913 (the public call: its keyword options are bundle()'s documented API)
    attacks: Sequence[Attack],
    apply_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    x: jax.Array,
    y: jax.Array,
    key: jax.Array,
    *,
    eps: float | jax.Array,
    norm: str = "linf",
    goals: Sequence[str] | str = ("misclassify",),
    example_id: jax.Array | None = None,
    judging: str = "auto",
    unroll: int | bool = 1,
    restart_mode: str = "vmap",
    validate: bool = True,
) -> BundleResult:
    """Runs a bundle of attacks and keeps, per example and goal, the best verified candidate.

    Args:
      attacks: attacks from :mod:`jaxbundle.attacks`, all in the threat model's norm.
      apply_fn: ``apply_fn(params, x) -> logits`` (e.g. a flax ``module.apply``), or a
        stochastic model declared with :func:`jaxbundle.stochastic` (``apply_fn(params, x,
        key)``, judged over its ``calls``, its winners re-judged on as many held-out calls:
        :func:`held_out`; see :mod:`jaxbundle.core.sampling`).
      params: the model's parameters (a jit argument, never baked into the program).
      x: clean images ``[B, ...]`` in [0, 1].
      y: integer labels ``[B]``.
      key: a PRNG key; example ``i`` draws from ``fold_in(key, example_id[i])``.
      eps: the threat model's radius, a scalar or one per example.
      norm: the threat model's norm, ``"linf"`` or ``"l2"``.
      goals: goals to track (``misclassify`` always is, and ``min_norm`` when a minimum-norm
        attack is in the bundle): see :mod:`jaxbundle.core.goals`.
      example_id: ``[B]`` ids that fix each example's randomness; default ``arange(B)``.
      judging: how candidates are judged. ``"auto"``: an example whose clean image is on the
        8-bit grid is judged on the grid (its image rounded, inside the ball, as a user would
        save it), any other (resized, augmented) in float32; ``"grid"``: the same, but every
        clean image must be on the grid (checked when ``validate``); ``"float"``: all in
        float32. See :func:`verify`.
      unroll: ``lax.scan`` unroll factor for the steps (``True``: fully unrolled).
      restart_mode: ``"vmap"`` (restarts in parallel) or ``"map"`` (one at a time, less memory).
      validate: check inputs at the boundary (one host sync); the evaluation driver, which has
        checked its data already, turns it off.

    Returns:
      A :class:`BundleResult`.
    """
    norms.check_norm(norm)
    attacks = check_attacks(attacks, norm)
    check_eot(attacks, apply_fn)
    goal_names = goals_for(goals, attacks)
    if restart_mode not in ("vmap", "map"):
        raise ValueError(f"restart_mode must be 'vmap' or 'map', got {restart_mode!r}")
    check_judging(judging)
    if validate:
        check_inputs(apply_fn, params, x, y, eps, judging=judging)
    if example_id is None:
        example_id = jnp.arange(x.shape[0], dtype=jnp.int32)
    rules = Rules(apply_fn, goal_names, norm, judging, restart_mode, unroll)
    result = run(params, x, y, key, example_id, eps, rules=rules, attacks=attacks)
    return held_out(result, params, x, y, key, example_id, eps, rules=rules)
