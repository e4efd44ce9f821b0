"""The two runners of an evaluation: ``full`` and ``cascade``, behind one small interface.

A runner attacks one batch (:meth:`Runner.run`: its counts, per-example outputs and what each
stage spent) and then says what its schedule adds to the figures (:meth:`Runner.figures`).
``full`` runs every attack on every example in one jitted program (the many-attack table);
``cascade`` runs :func:`jaxbundle.run.cascade.cascade` (each attack on the survivors of the ones
before, with the plan's focus, segments and budget) and summarises its result in a second
program. The evaluation driver (:mod:`jaxbundle.evaluation`) picks one by the plan's ``mode``.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxbundle.run import checks as checks_lib
from jaxbundle.run import cascade as schedule_lib
from jaxbundle.core.bundler import glue_jit, held_out, run
from jaxbundle.core.canonical import fast_gradients
from jaxbundle.report.metrics import Counts, Setting
from jaxbundle.report.outputs import per_example_arrays
from jaxbundle.plan import Plan
from jaxbundle.core.sampling import is_stochastic
from jaxbundle.run.cascade import Batch, Model

__all__ = ["RUNNERS", "Batch", "Model", "Runner", "runner"]


class Runner(Protocol):
    """Runs a plan's attacks on one batch, and says what its schedule adds to the figures."""

    def run(self, plan: Plan, model: Model, batch: Batch) -> tuple[Counts, dict, np.ndarray]:
        """The batch's counts and per-example outputs (device arrays, replicated) and each
        stage's counts ``[A, STAGE_COLUMNS]`` (examples, rows, gradients, queries, survivors,
        cut; zeros in full)."""

    def figures(self, plan: Plan, metrics: dict, per_example: dict, attacks, stages) -> dict:
        """The figures the schedule sets (``schedule``, and what it replaces)."""


class _Full:
    """Every attack on every example, the bundle and its summary in one program."""

    def run(self, plan: Plan, model: Model, batch: Batch):
        counts, outputs = _evaluate_batch(
            model.params, batch.x, batch.y, model.key, batch.example_id, batch.mask,
            jnp.float32(plan.eps), rules=schedule_lib.rules_of(plan, model),
            attacks=model.attacks, mesh=model.mesh)
        return counts, outputs, np.zeros((len(model.attacks), STAGE_COLUMNS), np.int64)

    def figures(self, plan: Plan, metrics: dict, per_example: dict, attacks, stages) -> dict:
        return {"schedule": dict(plan.describe()["schedule"], stages=None, skipped=0,
                                 statement=None)}


class _Cascade:
    """Each attack on the survivors of the ones before (:func:`jaxbundle.run.cascade.cascade`)."""

    def run(self, plan: Plan, model: Model, batch: Batch):
        eps = jnp.float32(plan.eps)
        result, stages = schedule_lib.cascade(plan, model, batch, eps)
        counts, outputs = _summarise(result, model.params, batch.x, batch.y, batch.example_id,
                                     batch.mask, eps, attacks=model.attacks, mesh=model.mesh,
                                     apply_fn=model.apply_fn)
        return counts, outputs, np.asarray([s[1:] for s in stages], np.int64)

    def figures(self, plan: Plan, metrics: dict, per_example: dict, attacks, stages) -> dict:
        return _cascade_figures(plan, metrics, per_example, attacks, stages)


STAGE_COLUMNS = len(schedule_lib.Stage._fields) - 1  # a stage's counts, its attack aside

RUNNERS: dict[str, Runner] = {"full": _Full(), "cascade": _Cascade()}


def runner(plan: Plan) -> Runner:
    """The runner of the plan's ``mode``."""
    return RUNNERS[plan.mode]


@functools.partial(jax.jit, static_argnames=("rules", "attacks", "mesh"))
def _evaluate_batch(params, x, y, key, example_id, mask, eps, *, rules, attacks,
                    mesh) -> tuple[Counts, dict]:
    """One batch: the bundle, its counts and its per-example outputs, in one program.

    With a mesh, every output is replicated on every device (the gather happens inside the
    program), so each process reads the whole result locally: no eager operation on a global
    array, and nothing a single process would have to run alone.
    """
    result = held_out(run(params, x, y, key, example_id, eps, rules=rules, attacks=attacks),
                      params, x, y, key, example_id, eps, rules=rules)
    return _summary(result, x, y, example_id, mask, eps, attacks, mesh, rules.apply_fn, params)


def _summary(result, x, y, example_id, mask, eps, attacks, mesh, apply_fn, params):
    """A batch's counts and per-example outputs, replicated on every device under a mesh."""
    setting = Setting.of(attacks, tuple(result.best))
    eps_b = jnp.full(y.shape, eps, jnp.float32)
    outputs = dict(per_example_arrays(result, x, eps_b, setting.black_box), label=y,
                   example_id=example_id,
                   zero_gradient=checks_lib.zero_gradients(fast_gradients(apply_fn), params,
                                                           x, y))
    if is_stochastic(apply_fn):  # the fraction of the held-out calls each image fools, and
        # of the judge's calls that chose the winner (biased upward: the best of several)
        outputs.update(success_rate=result.best["misclassify"].score.rate,
                       clean_success_rate=result.clean.rate,
                       selection_success_rate=result.selection_rate)
    out = (Counts.from_result(result, mask, eps_b, setting), outputs)
    if mesh is not None:
        out = jax.lax.with_sharding_constraint(out, NamedSharding(mesh, PartitionSpec()))
    return out


@glue_jit(static_argnames=("attacks", "mesh", "apply_fn"))
def _summarise(result, params, x, y, example_id, mask, eps, *, attacks, mesh, apply_fn):
    return _summary(result, x, y, example_id, mask, eps, attacks, mesh, apply_fn, params)


def _cascade_figures(plan: Plan, metrics: dict, per_example: dict, attacks, stages) -> dict:
    """What a cascade reports instead of the many-attack table: each stage's attack, the
    examples it ran on, what it spent, and the robust accuracy after it."""
    ok = per_example["clean_prediction"] == per_example["label"]
    fooled = np.cumsum(per_example["attack_success"], axis=1) > 0  # [n, A] after each stage
    n = len(ok)
    rows = []
    for k, a in enumerate(attacks):
        examples, computed, gradients, queries, survivors, cut = (int(v) for v in stages[k])
        rows.append({
            "attack": a.name, "survivors": survivors, "examples": examples,
            "skipped": survivors - examples, "cut": cut, "rows": computed,
            "gradients": gradients, "queries": queries,
            "robust_accuracy": 100.0 * float(np.sum(ok & ~fooled[:, k])) / n,
        })
    black = [a.black_box for a in attacks]
    white_first = not any(b and not c for b, c in zip(black, black[1:]))  # no white after black
    skipped = sum(row["skipped"] + row["cut"] for row in rows)
    statement = None if not skipped else (
        "stages left survivors unattacked or stopped them after a probe ("
        + ", ".join(f"{r['attack']}: {r['skipped'] + r['cut']} of {r['survivors']}"
                    for r in rows if r["skipped"] + r["cut"])
        + "; focus, probe, escalate or budget): the robust accuracy is an upper bound that "
        "running those stages in full on every survivor could lower")
    out = {
        "schedule": dict(plan.describe()["schedule"], stages=rows, skipped=skipped,
                         statement=statement),
        # Attack k saw only the survivors of attacks 1..k-1: no many-attack table.
        "mat": None, "wat": None, "wat_attack": None, "black_box_robust_accuracy": None,
        "gradients_per_example": float(np.mean(per_example["gradients"])),
        "queries_per_example": float(np.mean(per_example["queries"])),
    }
    if not white_first:
        out.update(white_box_robust_accuracy=None, black_box_only=None)
    # A kind's P(D) would count only the examples its stages saw: keep the bundled curve.
    for key in ("half_distortion", "operating_characteristic"):
        out[key] = {k: v for k, v in metrics[key].items() if k in ("grid", "bundled")}
    return out


