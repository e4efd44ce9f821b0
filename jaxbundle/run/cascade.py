"""Prioritisation: a bundle run as a cascade that spends nothing on examples already satisfied.

The bundling paper's rule for an attacker with finite compute: once an example's goal is met,
stop spending on it, and spend on the examples still unsatisfied. :func:`cascade` runs the
attacks of a bundle one stage at a time on one batch:

1. before stage ``k``, the examples whose ``goal`` is satisfied drop out: ``misclassify``, a
   verified success (a clean misclassification included); ``max_confidence``, a wrong class
   with confidence at least ``threshold`` inside the ball (the defender's threshold t);
   ``min_norm`` is never satisfied (a smaller distortion is always better), so every example
   stays. The other goals tracked are folded wherever an attack runs;
2. the survivors are compacted into the smallest of a few fixed bucket sizes (``batch``,
   ``3/4``, ``1/2``, ``3/8``, ``1/4`` of it, ...: :func:`bucket_sizes`, the plan's ``buckets``
   sizes per halving; padded by repeating the last survivor), so each attack compiles at most
   once per bucket size, never per batch;
3. stage ``k`` is :func:`jaxbundle.core.bundler.bundle` with attack ``k`` alone, under the same
   per-example keys as in the full bundle (``fold_in(fold_in(key, example_id), k)``), and its
   verified results are folded into the batch's best states at the survivors' rows.

Every example's randomness depends only on its id and the attack's index, and an attack's result
on an example does not depend on the other examples in the batch (up to float rounding, which
XLA may do differently in another batch shape), so for the misclassify goal a cascade fools
exactly the examples the full bundle fools (tested), at the cost of the attacks it ran. What it
does not give is the many-attack table: attack ``k`` saw only the survivors of attacks
``1..k-1``. Its ``attack_success[k]`` is False where attack ``k`` did not run.

With ``focus`` (attack name -> fraction), that attack runs only on the most promising part of
the survivors, ``fraction * survivors`` of them rounded to the nearest bucket size (in ratio)
and then up to a halving of the batch (all survivors if they are fewer), so that no padding
row is computed and a sweep over eps meets the same few shapes: those closest to the goal
under the best candidates so far (misclassify: the largest margin ``max_{j != y} z_j - z_y``;
max confidence: the highest wrong-class confidence). An expensive last stage, such as a black-box
attack with thousands of queries, is then spent where it can still succeed; the others are
discarded, so focus trades the exactness above for compute, and which survivors are kept
depends on the batch they are ranked in. With ``floor`` (attack name -> a share of the batch),
that attack's focus keeps every survivor while they are at most that share of the batch, and
never fewer than that share (rounded up to a halving of the batch): where few survive, a handful
of examples is all there is to attack, and halving it saves little.

With ``probe`` (attack name -> a fraction of its steps), a focused stage is not chosen by the
stages before it: every survivor runs the probe's steps, then the focus share goes on (plus
:data:`PROBE_GAIN` times the fraction the probe itself fooled, up to all), half of it the
most promising under the earlier stages and half the rows whose own best closed the largest
fraction of their clean margin. A black-box stage, the check against gradients that mislead
the white-box stages, is then not starved by the white-box margin it exists to doubt.

With ``escalate`` (attack name -> a share), that attack's stage runs only when the stage just
before it fooled at least that share of the examples it ran on, and is skipped otherwise: an
expensive stage held back for the models that need it, such as a full FAB-T after a light one
that fooled many of the survivors APGD left (gradients that mislead APGD on that model).
With ``widen`` (attack name -> a fraction), once an escalated stage has run on the batch (that
evidence), that attack's focus fraction is the widened one: the black-box check gets more of
the survivors on the models whose gradients were shown to mislead.

With ``budget`` (model passes per example, averaged over the batch), a stage that cannot be
paid for every survivor runs on the survivors that have had the least compute so far (the
paper's least-run-first rule), the others wait for the next stage.

With ``segments`` N > 1, a stage stops spending inside it too: the attack's steps run in N
segments (:func:`jaxbundle.core.bundler.start_stage`, ``step_stage``, ``judge_stage``: one program
per bucket size, the step index traced; a stage run whole is the same three programs in one
segment). After each, the bests so far are verified and merged; the examples now satisfied
stop there, and the others go on from their own attack state, gathered into a bucket at most
half the current size once they fit (:func:`jaxbundle.core.bundler.take_rows`; attack states have
the batch axis first). An example's
steps do not depend on the other rows, so the misclassify goal's fooled set is still the full
bundle's; an example that stopped keeps the image of the segment that fooled it, where the full
run might have gone on to a larger margin. Minimum-norm attacks always run whole (a smaller
distortion is always better). Each example is charged the steps it ran.

With ``restart_mode="cascade"``, a stage runs its attack's restarts one after another, each on
the examples the restarts before left (as AutoAttack runs APGD-T's and FAB-T's targets), under
the restart's own keys and number (the start program takes the first restart's number traced,
so one program serves them all). Focus and budget choose the stage's examples once, before its
first restart; the fooled set is the restarts-at-once stage's, for fewer passes where early
restarts fool.

One host sync per stage (the survivors' count), and one per segment; none per step.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle.core import goals as goals_lib
from jaxbundle.attacks.base import Attack, per_example_keys
from jaxbundle.core import bundler
from jaxbundle.core.bundler import BestState, BundleResult, fold, glue_jit
from jaxbundle.run.records import Batch, Model

__all__ = [
    "PROBE_GAIN", "Batch", "Model", "Stage", "bucket_sizes", "cascade", "escalates",
    "probe_steps", "promise", "satisfied",
]

# A probe's share grows by this many times the fraction of the survivors the probe itself
# fooled: a black-box probe that fools 1 in 20 survivors is evidence that the white-box stages
# were misled on this model, and the whole stage goes on (chosen on the tuning set of
# benchmarks/heldout/PROTOCOL.md).
PROBE_GAIN = 20.0


class Settings(Protocol):
    """What the cascade reads of its settings (:class:`jaxbundle.run.runners.Cascade`)."""

    goal: str
    threshold: float | None
    budget: float | None
    segments: int
    buckets: int
    focus_map: dict[str, float]
    floor_map: dict[str, float]
    probe_map: dict[str, float]
    escalate_map: dict[str, float]
    widen_map: dict[str, float]


class Stage(NamedTuple):
    """What one stage of a cascade did on one batch (host integers)."""

    attack: int  # index of the attack in the bundle
    examples: int  # real examples it ran on
    rows: int  # bucket rows computed (examples plus padding), in whole runs of the attack:
    #   a segmented stage's rows times steps, over its steps, rounded up
    gradients: int  # gradient evaluations it spent on the real examples
    queries: int  # model queries it spent on the real examples
    survivors: int  # real examples whose goal the stages before left unsatisfied: focus and
    #   budget chose ``examples`` of them; the others were skipped
    cut: int = 0  # of ``examples``, those a probe stopped after its steps (focus kept the rest)


def bucket_sizes(batch_size: int, multiple: int = 1, per_halving: int = 2) -> tuple[int, ...]:
    """The compacted batch sizes a cascade may use, largest first: ``batch_size`` halved again
    and again (rounded up), each with ``per_halving - 1`` sizes evenly between it and the next
    half (rounded down; ``per_halving=2``: 1, 3/4, 1/2, 3/8, 1/4, ...), then up to a multiple of
    ``multiple`` (the device count), down to ``multiple``. Padding wastes under
    ``1 / (per_halving + 1)`` of a bucket (a third with 2 per halving, a half with halves
    alone); the halves are among the sizes of every ladder."""
    sizes, half = set(), batch_size
    while True:
        for ratio in (1 - i / (2 * per_halving) for i in range(per_halving)):
            size = max(multiple, -(-int(half * ratio) // multiple) * multiple)
            sizes.add(min(size, batch_size))
        if half <= multiple:
            return tuple(sorted(sizes, reverse=True))
        half = -(-half // 2)


def _bucket(sizes: tuple[int, ...], rows: int) -> int:
    """The smallest bucket size that holds ``rows`` rows."""
    return min(s for s in sizes if s >= rows)


def _nearest_bucket(sizes: tuple[int, ...], rows: float) -> int:
    """The bucket size nearest to ``rows`` in ratio (ties: the smaller)."""
    return min(sorted(sizes), key=lambda s: abs(np.log(s / max(rows, 1.0))))


def satisfied(
    best: dict[str, BestState], eps: jax.Array, goal: str = "misclassify",
    threshold: float | None = None,
) -> jax.Array:
    """Per example: whether ``goal`` needs nothing more (see the module docstring)."""
    done = goals_lib.GOALS[goal].satisfied
    if done is None:  # e.g. min_norm: a smaller distortion is always better
        return jnp.zeros(eps.shape, bool)
    return done(best[goal].score, eps, threshold)


@glue_jit(static_argnames=("rules",))
def _start(params, x, y, key, example_id, eps, *, rules: bundler.Rules):
    """The clean image as every goal's starting best, the eps attacks aim at, the grid flag."""
    p = bundler.problem(rules, params, x, y, eps, per_example_keys(key, example_id))
    clean = bundler.clean_state(rules, p)
    return {g: clean for g in rules.goal_names}, clean.score, p.eps, p.grid


def promise(best: dict[str, BestState], goal: str = "misclassify") -> jax.Array:
    """Per example: how close its best candidate is to satisfying ``goal`` (larger is closer):
    the margin for misclassify, the wrong-class confidence for max confidence."""
    promise_of = goals_lib.GOALS[goal].promise
    if promise_of is not None:
        return promise_of(best[goal].score)
    raise ValueError(f"goal {goal!r} is never satisfied, so no survivor is more promising")


@glue_jit(static_argnames=("goal", "threshold", "ranked"))
def _status(best, eps, goal, threshold, ranked):
    """Whether each example is satisfied and, if the stage is focused, its promise."""
    done = satisfied(best, eps, goal, threshold)
    return done, (promise(best, goal) if ranked else jnp.zeros(eps.shape, jnp.float32))


def _host_reader(mesh) -> Callable[[jax.Array], np.ndarray]:
    """Reads a (possibly sharded) array on the host: replicated first under a mesh."""
    if mesh is None:
        return lambda a: jax.tree.map(np.asarray, a)
    from jax.sharding import NamedSharding, PartitionSpec

    replicate = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec()))
    return lambda a: jax.tree.map(np.asarray, replicate(a))


@glue_jit(static_argnames=("goal",))
def _progress(found, clean, goal):
    """Per row: how much of the way from the clean image to ``goal`` the stage's own best has
    come, ``(promise(own) - promise(clean)) / |promise(clean)|`` (misclassify: the fraction of
    the clean margin it closed). The stage's own view, not the stages' before it: a survivor
    whose gradients mislead the white-box stages is ranked by what the probe found."""
    start = goals_lib.GOALS[goal].promise(clean)
    return (promise(found, goal) - start) / jnp.maximum(jnp.abs(start), 1e-6)


@glue_jit
def _take(tree, rows):
    return jax.tree.map(lambda a: jnp.take(a, rows, axis=0), tree)


@glue_jit(static_argnames=("goal_names",))
def _merge(best, eps, rows, found, *, goal_names):
    """Folds a stage's verified bests into the batch's at ``rows`` (padding repeats a real
    row with the same result, so a repeated index writes the same value)."""
    mine = _take(best, rows)
    e = jnp.take(eps, rows)
    merged = {g: fold(g, e, mine[g], found[g]) for g in goal_names}
    return jax.tree.map(lambda a, b: a.at[rows].set(b), best, merged)


@glue_jit
def _put(a, rows, values):
    return a.at[rows].set(values)


class _Batch(NamedTuple):
    """What every stage of one cascade shares: its settings, the run's rules, the batch and how
    it is read."""

    schedule: Settings
    rules: bundler.Rules
    params: Any
    x: jax.Array
    y: jax.Array
    key: jax.Array
    example_id: jax.Array
    eps: jax.Array  # [B] the threat model's radius
    eps_aimed: jax.Array  # [B] the radius the attacks aim at (on the grid: whole levels)
    sizes: tuple[int, ...]  # bucket sizes
    halves: tuple[int, ...]  # the sizes focus keeps and a stage mid-run compacts to: one per
    #   halving, so that a sweep over eps, whose survivors differ, meets the same few shapes
    host: Callable[[Any], Any]  # reads device arrays on the host
    real: np.ndarray  # host bool [B]: False on padding rows


class _Outcome(NamedTuple):
    """What one stage leaves: the batch's bests, attack ``k``'s success and distortion rows,
    the steps each example ran (host ``[B]``) and the bucket rows times steps computed."""

    best: dict[str, BestState]
    success: jax.Array
    distortion: jax.Array
    best_step: jax.Array
    improving: jax.Array
    steps: np.ndarray
    row_steps: int
    cut: int = 0  # examples a probe stopped after its steps


class _AttackRows(NamedTuple):
    """Each attack's rows of the result ``[A, B]``, filled in stage by stage."""

    success: jax.Array
    distortion: jax.Array
    best_step: jax.Array  # -2: did not run
    improving: jax.Array

    @classmethod
    def empty(cls, attacks: int, batch: int) -> "_AttackRows":
        return cls(jnp.zeros((attacks, batch), bool),
                   jnp.full((attacks, batch), jnp.inf, jnp.float32),
                   jnp.full((attacks, batch), -2, jnp.int32), jnp.zeros((attacks, batch), bool))

    def of(self, k: int) -> "_AttackRows":
        """Attack ``k``'s rows alone (``[B]`` each)."""
        return _AttackRows(*(field[k] for field in self))

    def set(self, k: int, out: "_Outcome", keep_success: bool = False) -> "_AttackRows":
        """Attack ``k``'s rows from ``out``; with ``keep_success`` (a later restart of a
        cascade of restarts), an example an earlier restart fooled keeps that restart's row."""
        new = [getattr(out, f) for f in self._fields]
        if keep_success:
            new = [jnp.where(self.success[k], old[k], v) for old, v in zip(self, new)]
        return _AttackRows(*(old.at[k].set(v) for old, v in zip(self, new)))


def _padded(order: np.ndarray, size: int) -> np.ndarray:
    """``order`` padded to ``size`` rows by repeating its last entry."""
    return np.concatenate([order, np.full(size - order.size, order[-1])]).astype(np.int32)


def _run_stage(b: _Batch, attack: Attack, k: int, order: np.ndarray, best, row: "_AttackRows",
               probe: tuple[int, float, float, np.ndarray] | None = None,
               first: int = 0) -> _Outcome:
    """Attack ``k`` (its restarts numbered from ``first``) on the rows ``order`` in up to
    :func:`_segments` runs of its steps, from the batch's bests and the attack's ``row`` so far.
    After each, the rows whose goal is satisfied stop; the others are compacted into a bucket
    at most half the size of the current one once they fit (fewer shapes to compile), else
    they go on in place. With ``probe = (steps, fraction, floor, closeness)``, the first run is
    ``steps`` long and only some rows go on after it (:func:`_after_probe`)."""
    driver = bundler.Driver(attack, k, b.rules)
    segments = _segments(b.schedule, attack, probe)
    success, distortion, best_step, improving = row
    rows = _padded(order, _bucket(b.sizes, order.size))
    sub = _take((b.x, b.y, b.example_id, b.eps), rows)
    running = bundler.start_stage(b.params, sub[0], sub[1], b.key, sub[2], sub[3],
                                  jnp.int32(first), driver=driver)
    steps, row_steps, cut = np.zeros(b.y.shape[0], np.int64), 0, 0
    length = -(-attack.num_steps // segments)
    live = np.ones(rows.size, bool)  # rows of the bucket still running (padding: False)
    live[order.size:] = False
    t = 0
    while True:
        probing = probe is not None and t == 0
        t1 = min(t + (probe[0] if probing else length), attack.num_steps)
        x, y, _, eps = sub
        running = bundler.step_stage(b.params, running, x, y, eps, jnp.int32(t), jnp.int32(t1),
                                     driver=driver)
        steps[rows[live]] = t1
        row_steps += rows.size * (t1 - t)
        t = t1
        last = t == attack.num_steps
        judged = bundler.judge_stage(b.params, running, x, y, eps, jnp.int32(t), jnp.bool_(last),
                                     driver=driver)
        ranks = _progress(judged.best, running.clean.score, b.schedule.goal) if probing else None
        # A row that stopped earlier keeps its result: its repeats here merge the same values.
        keep = _padded(np.flatnonzero(live), rows.size) if not live.all() else None
        merged_rows = rows if keep is None else rows[keep]
        if keep is not None:
            judged = _take(judged, jnp.asarray(keep))
        found, found_success, found_distortion, found_step, found_improving = judged
        best = _merge(best, b.eps_aimed, merged_rows, found, goal_names=b.rules.goal_names)
        success = _put(success, merged_rows, found_success)
        distortion = _put(distortion, merged_rows, found_distortion)
        best_step = _put(best_step, merged_rows, found_step)
        improving = _put(improving, merged_rows, found_improving)
        if last:
            break
        schedule = b.schedule
        done, _ = b.host(_status(best, b.eps, schedule.goal, schedule.threshold, False))  # a sync
        live &= ~done[rows]
        if probing:
            before = int(live.sum())
            live = _after_probe((b.sizes, b.halves), live, order.size, probe, b.host(ranks), rows)
            cut = before - int(live.sum())
        if not live.any():
            break
        size = _bucket(b.halves, int(live.sum()))
        if 2 * size <= rows.size:
            positions = _padded(np.flatnonzero(live), size)
            running = bundler.take_rows(running, jnp.asarray(positions))
            rows = rows[positions]
            sub = _take(sub, jnp.asarray(positions))
            live = np.arange(size) < int(live.sum())
    return _Outcome(best, success, distortion, best_step, improving, steps, row_steps, cut)


def _after_probe(ladders: tuple[tuple[int, ...], tuple[int, ...]], live: np.ndarray,
                 survivors: int, probe, progress: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The rows that go on after a probe: a share of the stage's ``survivors``, the focus
    fraction plus :data:`PROBE_GAIN` times the fraction the probe fooled (rounded as
    :func:`_focus_size` rounds, at most all); half of them the most promising under the
    earlier stages (``closeness``), the rest those with the most ``progress`` of the stage's
    own. ``live``: the bucket's rows not yet satisfied; ``ladders``: ``(sizes, halves)``."""
    _, fraction, floor, closeness = probe
    fooled = survivors - int(live.sum())
    share = min(1.0, fraction + PROBE_GAIN * fooled / survivors)
    keep = min(_focus_size(ladders, share, survivors, floor), int(live.sum()))
    candidates = np.flatnonzero(live)
    first = candidates[np.argsort(-closeness[rows[candidates]], kind="stable")[:(keep + 1) // 2]]
    others = np.setdiff1d(candidates, first)
    chosen = np.concatenate([first, others[np.argsort(-progress[others], kind="stable")]
                             [:keep - first.size]])
    out = np.zeros_like(live)
    out[chosen] = True
    return out


def _segments(schedule: Settings, attack: Attack, probe) -> int:
    """The runs a stage's steps are cut into: the plan's segments (after a probe, if it has
    one), or one: an attack whose goal is never satisfied (min-norm: a smaller distortion is
    always better) is never done early. A stage in one segment still runs as three programs
    (start, steps, judging), so its glue compiles fast (:func:`jaxbundle.core.bundler.glue_jit`):
    a whole-stage program compiled at XLA's defaults made a cascade of the standard bundle
    compile 14 s where the full bundle's one program took 9 s."""
    never_done = any(goals_lib.GOALS[g].satisfied is None for g in (schedule.goal, attack.goal))
    if probe is None and (attack.num_steps < schedule.segments or never_done):
        return 1
    return schedule.segments


def _restart_parts(attack: Attack, restart_mode: str) -> list[tuple[Attack, int]]:
    """What a stage runs in turn, each part with the index of its first restart: the attack
    whole, or with ``restart_mode="cascade"`` each of its restarts alone (keyed and numbered as
    in the whole attack: APGD-T's and FAB-T's restart ``r`` targets the ``r``-th class), each on
    the survivors of the ones before, as AutoAttack runs its targets."""
    if restart_mode != "cascade" or attack.num_restarts == 1:
        return [(attack, 0)]
    return [(attack._replace(num_restarts=1), r) for r in range(attack.num_restarts)]


def escalates(before: Stage, survivors: int, share: float) -> bool:
    """Whether a stage with ``escalate`` share ``share`` runs: the stage ``before`` it fooled at
    least that share of the examples it ran on (``before.survivors - survivors`` of
    ``before.examples``; a stage that ran on none is no evidence)."""
    return before.examples > 0 and before.survivors - survivors >= share * before.examples


def probe_steps(attack: Attack, fraction: float) -> int:
    """The steps of a probe of ``fraction`` of ``attack``'s steps: rounded, at least 1 and
    fewer than all (the plan's check requires 2 steps or more)."""
    return min(max(1, round(fraction * attack.num_steps)), attack.num_steps - 1)


def _focus_size(ladders: tuple[tuple[int, ...], tuple[int, ...]], fraction: float,
                survivors: int, floor: float = 0.0) -> int:
    """How many survivors a focus fraction keeps: of ``ladders = (sizes, halves)``, the bucket
    size nearest to ``fraction * survivors`` (in ratio), rounded up to a halving of the batch
    (at most all survivors). No padding rows, never fewer than the nearest bucket, and a focused
    stage meets the same few shapes at every eps of a sweep, whose survivors differ. With a
    ``floor`` (a share of the batch), never fewer than the halving of the batch that holds that
    share: every survivor while they are at most that share."""
    sizes, halves = ladders
    keep = _bucket(halves, _nearest_bucket(sizes, fraction * survivors))
    if floor:
        keep = max(keep, _bucket(halves, math.ceil(floor * sizes[0])))
    return min(keep, survivors)


def _stage_rows(b: _Batch, attack: Attack, order: np.ndarray, closeness: np.ndarray,
                fraction: float | None, left: float | None, spent: np.ndarray) -> np.ndarray:
    """The rows stage ``attack`` runs on, of the survivors ``order``: with a focus fraction, the
    most promising, as many as :func:`_focus_size`; with a budget left, those the budget pays
    for, the least run first."""
    if fraction is not None and order.size:
        keep = _focus_size((b.sizes, b.halves), fraction, order.size,
                           b.schedule.floor_map.get(attack.name, 0.0))
        order = np.sort(order[np.argsort(-closeness[order], kind="stable")][:keep])
    cost = attack.gradients + attack.queries
    if left is not None and cost:
        affordable = int(max(left, 0) // cost)
        order = np.sort(order[np.argsort(spent[order], kind="stable")][:affordable])
    return order


def _stage(b: _Batch, k: int, whole: Attack, chosen: np.ndarray, survivors: int,
           focus: tuple[np.ndarray, float | None], best, rows: _AttackRows):
    """Stage ``k``: attack ``whole`` on the rows ``chosen`` (of ``survivors``), whole or, with
    ``restart_mode="cascade"``, restart by restart on what the restarts before left; a probed
    stage (the plan's ``probe``) starts each part with its probe, then goes on with ``focus =
    (closeness, fraction)``: the survivors' ranking and the stage's focus fraction (its own,
    or widened: the plan's ``widen``). Returns the batch's bests and
    attack rows, the :class:`Stage` and the gradients and queries each example paid (host
    ``[B]``)."""
    schedule, batch = b.schedule, int(b.y.shape[0])
    (closeness, fraction), probes = focus, schedule.probe_map
    grads, asked = np.zeros(batch, np.int64), np.zeros(batch, np.int64)
    stage, row_steps = Stage(k, int(chosen.size), 0, 0, 0, survivors), 0
    for attack, first in _restart_parts(whole, b.rules.restart_mode):
        order = chosen
        if first:  # a later restart of a cascade of restarts: on what the others left
            done, closeness = b.host(_status(best, b.eps, schedule.goal, schedule.threshold,
                                             whole.name in schedule.focus_map))
            order = chosen[~done[chosen]]
        if order.size == 0:
            break
        probe = ((probe_steps(attack, probes[attack.name]), fraction,
                  schedule.floor_map.get(attack.name, 0.0), closeness)
                 if attack.name in probes else None)
        out = _run_stage(b, attack, k, order, best, rows.of(k), probe=probe, first=first)
        best, rows = out.best, rows.set(k, out, keep_success=first > 0)
        ran = np.zeros(batch, bool)
        ran[order] = True
        grads += np.where(ran, attack.steps_gradients(out.steps), 0)
        asked += np.where(ran, attack.steps_queries(out.steps), 0)
        row_steps += out.row_steps * attack.num_restarts
        stage = stage._replace(cut=stage.cut + out.cut)
    stage = stage._replace(rows=-(-row_steps // max(whole.num_steps * whole.num_restarts, 1)),
                           gradients=int(np.sum(grads[b.real])),
                           queries=int(np.sum(asked[b.real])))
    return best, rows, stage, grads, asked


def cascade(schedule: Settings, model: Model, batch: Batch,
            eps: jax.Array) -> tuple[BundleResult, list[Stage]]:
    """Runs the model's attacks on one batch as a cascade with the settings ``schedule`` (see
    the module docstring).

    Args:
      schedule: a checked :class:`jaxbundle.run.runners.Cascade` (``goal``, ``threshold``,
        ``budget``: model passes per example on average over the real rows, ``focus``,
        ``probe``, ``escalate``, ``segments``, ``buckets``; see the module docstring).
      model: the model's parameters, its attacks as built for it (EOT applied), the run's key,
        the bundler's rules (the goals tracked; ``restart_mode="cascade"``: a stage's restarts
        one after another; ``unroll``, the full bundle's) and the 1-D ``("batch",)`` mesh
        the batch is sharded over, if any: bucket sizes are multiples of its size, and the
        survivors' mask is replicated before it is read, so every process reads the same mask
        and runs the same programs.
      batch: the images, labels and example ids (as in :func:`jaxbundle.core.bundler.bundle`) and
        ``real``, host bool ``[B]``, False on padding rows (never attacked).
      eps: the radius, a scalar or one per example.

    Returns:
      ``(result, stages)``: a :class:`BundleResult` like the full bundle's (``attack_success``
      and ``attack_distortion`` only where the attack ran; ``gradients`` / ``queries`` what
      each example really cost) and one :class:`Stage` per attack.
    """
    attacks, params, mesh = tuple(model.attacks), model.params, model.mesh
    x, y, key, example_id = batch.x, batch.y, model.key, batch.example_id
    focus, probes, escalate = schedule.focus_map, schedule.probe_map, schedule.escalate_map
    widen, escalated = schedule.widen_map, False
    n = int(y.shape[0])
    real = np.ones(n, bool) if batch.real is None else np.asarray(batch.real, bool)
    eps = jnp.broadcast_to(jnp.asarray(eps, jnp.float32), y.shape)
    rules = model.rules
    best, clean, eps_aimed, grid = _start(params, x, y, key, example_id, eps, rules=rules)
    multiple = 1 if mesh is None else mesh.devices.size
    b = _Batch(schedule, rules, params, x, y, key, example_id, eps, eps_aimed,
               bucket_sizes(n, multiple, schedule.buckets),
               bucket_sizes(n, multiple, per_halving=1),
               _host_reader(mesh), real)
    rows = _AttackRows.empty(len(attacks), n)
    spent = np.zeros(n, np.int64)  # model passes per example so far (host)
    gradients = np.zeros(n, np.int64)
    queries = np.zeros(n, np.int64)
    left = None if schedule.budget is None else float(schedule.budget) * int(real.sum())
    stages = []
    for k, whole in enumerate(attacks):
        done, closeness = b.host(_status(best, eps, schedule.goal, schedule.threshold,
                                         whole.name in focus))
        survivors = np.flatnonzero(real & ~done)
        held_back = whole.name in escalate and not escalates(stages[-1], survivors.size,
                                                             escalate[whole.name])
        fraction = widen[whole.name] if escalated and whole.name in widen else focus.get(
            whole.name)
        chosen = _stage_rows(b, whole, survivors[:0] if held_back else survivors, closeness,
                             None if whole.name in probes else fraction, left, spent)
        best, rows, stage, grads, asked = _stage(b, k, whole, chosen, survivors.size,
                                                 (closeness, fraction), best, rows)
        escalated |= whole.name in escalate and stage.examples > 0
        spent += grads + asked
        gradients += grads
        queries += asked
        if left is not None:
            left -= float(np.sum(grads + asked))
        stages.append(stage)
    result = BundleResult(
        best=best, clean=clean, attack_success=rows.success, attack_distortion=rows.distortion,
        attack_step=rows.best_step, attack_improving=rows.improving,
        gradients=jnp.asarray(gradients, jnp.int32), queries=jnp.asarray(queries, jnp.int32),
        judged_on_grid=grid,
    )
    # A stochastic model's winners re-judged on held-out calls, as the full bundle's are.
    return bundler.held_out(result, params, x, y, key, example_id, eps, rules=rules), stages
