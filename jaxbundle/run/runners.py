"""The two schedules of an evaluation, :class:`Full` and :class:`Cascade`: each both the plan's
setting and the runner that carries it out (as optimistix's solvers are both their
configuration and their algorithm).

A schedule attacks one batch (``run``: its counts, per-example outputs and what each stage
spent) and then says what it adds to the figures (``figures``). :class:`Full` runs every attack
on every example in one jitted program (the many-attack table); :class:`Cascade` runs
:func:`jaxbundle.run.cascade.cascade` (each attack on the survivors of the ones before, with
its goal, focus, floor, probe, escalate, segments and budget) and summarises its result in a
second program. The evaluation driver (:mod:`jaxbundle.evaluation`) calls the plan's
``schedule``; nothing dispatches on a name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxbundle.attacks.base import Attack
from jaxbundle.core import goals as goals_lib
from jaxbundle.core.bundler import glue_jit, held_out, run
from jaxbundle.core.canonical import fast_gradients
from jaxbundle.core.sampling import is_stochastic
from jaxbundle.core.validation import as_plain, is_int, is_number
from jaxbundle.report.metrics import Counts, Setting
from jaxbundle.report.outputs import per_example_arrays
from jaxbundle.run import cascade as cascade_lib
from jaxbundle.run import checks as checks_lib
from jaxbundle.run.records import Batch, Model

__all__ = ["MAX_BUCKETS", "PAIRS", "Batch", "Cascade", "Full", "Model", "Schedule"]

MAX_BUCKETS = 64  # bucket sizes per halving of the batch, at most
PAIRS = ("focus", "floor", "probe", "escalate", "widen")  # a cascade's settings given per attack


class Schedule(Protocol):
    """Runs a plan's attacks on one batch, and says what it adds to the figures."""

    mode: ClassVar[str]  # "full" or "cascade": the report's and the CLI's name

    def check(self, attacks: tuple[Attack, ...], goal_names: tuple[str, ...]) -> None:
        """Raises ``ValueError`` with one line naming the first bad setting."""

    def describe(self) -> dict:
        """The plan's ``schedule`` section (every setting, the cascade's defaults in full)."""

    def run(self, model: Model, batch: Batch, eps: float) -> tuple[Counts, dict, np.ndarray]:
        """The batch's counts and per-example outputs (device arrays, replicated) and each
        stage's counts ``[A, STAGE_COLUMNS]`` (examples, rows, gradients, queries, survivors,
        cut; zeros in full)."""

    def figures(self, metrics: dict, per_example: dict, attacks, stages) -> dict:
        """The figures the schedule sets (``schedule``, and what it replaces)."""


STAGE_COLUMNS = len(cascade_lib.Stage._fields) - 1  # a stage's counts, its attack aside


def _pairs(pairs: Any) -> tuple[tuple[str, Any], ...]:
    """A dict or pairs (attack name -> value) as hashable pairs."""
    return tuple((str(k), v) for k, v in (pairs.items() if isinstance(pairs, dict) else pairs))


@dataclasses.dataclass(frozen=True)
class Cascade:
    """Each attack on the examples whose ``goal`` the ones before left unsatisfied
    (:func:`jaxbundle.run.cascade.cascade`, whose docstring says what each setting does):
    ``threshold`` (the max_confidence goal's t), ``budget`` (model passes per example),
    ``focus``, ``floor``, ``probe``, ``escalate``, ``widen`` (attack name -> fraction or share),
    ``segments`` and ``buckets`` (compacted batch sizes per halving of the batch: more, less
    padding)."""

    goal: str = "misclassify"
    threshold: float | None = None
    budget: float | None = None
    focus: tuple[tuple[str, float], ...] = ()
    floor: tuple[tuple[str, float], ...] = ()
    probe: tuple[tuple[str, float], ...] = ()
    escalate: tuple[tuple[str, float], ...] = ()
    widen: tuple[tuple[str, float], ...] = ()
    segments: int = 1
    buckets: int = 2
    mode: ClassVar[str] = "cascade"

    def __post_init__(self):
        as_plain(self, floats=("threshold", "budget"), ints=("segments", "buckets"))
        for field in PAIRS:
            object.__setattr__(self, field, _pairs(getattr(self, field)))

    @property
    def focus_map(self) -> dict[str, float]:
        """``focus`` as a dict (attack name -> fraction)."""
        return dict(self.focus)

    @property
    def floor_map(self) -> dict[str, float]:
        """``floor`` as a dict (attack name -> the share of the batch under which its focus
        keeps every survivor: ``jaxbundle.run.cascade._focus_size``)."""
        return dict(self.floor)

    @property
    def probe_map(self) -> dict[str, float]:
        """``probe`` as a dict (attack name -> the fraction of its steps every survivor runs
        before focus chooses: :func:`jaxbundle.run.cascade.probe_steps`)."""
        return dict(self.probe)

    @property
    def escalate_map(self) -> dict[str, float]:
        """``escalate`` as a dict (attack name -> the share of the examples the stage before it
        ran on that this stage must have fooled for it to run)."""
        return dict(self.escalate)

    @property
    def widen_map(self) -> dict[str, float]:
        """``widen`` as a dict (attack name -> its focus fraction once an escalated stage has
        run on the batch)."""
        return dict(self.widen)

    def describe(self) -> dict:
        return {"mode": self.mode, "goal": self.goal, "threshold": self.threshold,
                "budget": self.budget, "focus": self.focus_map, "floor": self.floor_map,
                "probe": self.probe_map,
                "escalate": self.escalate_map, "widen": self.widen_map,
                "segments": self.segments,
                "buckets": self.buckets}

    def check(self, attacks: tuple[Attack, ...], goal_names: tuple[str, ...]) -> None:
        if self.goal not in goals_lib.GOALS:
            raise ValueError(f"unknown goal {self.goal!r}; choose from "
                             f"{', '.join(goals_lib.GOALS)}")
        if self.goal not in goal_names:
            raise ValueError(f"the schedule's goal {self.goal!r} is not among the goals tracked "
                             f"{goal_names}")
        if self.threshold is not None:
            if not is_number(self.threshold) or not 0 < self.threshold <= 1:
                raise ValueError(f"threshold must be a confidence in (0, 1], got "
                                 f"{self.threshold!r}")
            if self.goal != "max_confidence":
                raise ValueError("threshold is the max_confidence goal's t: set "
                                 "goal='max_confidence'")
        elif self.goal == "max_confidence":
            raise ValueError("a cascade for the max_confidence goal needs its threshold t in "
                             "(0, 1]")
        if self.budget is not None and (not is_number(self.budget) or self.budget <= 0):
            raise ValueError(f"budget must be a number of model passes > 0, got {self.budget!r}")
        if not is_int(self.segments) or self.segments < 1:
            raise ValueError(f"segments must be a positive integer, got {self.segments!r}")
        if not is_int(self.buckets) or not 1 <= self.buckets <= MAX_BUCKETS:
            raise ValueError(f"buckets (bucket sizes per halving of the batch) must be an integer "
                             f"in [1, {MAX_BUCKETS}], got {self.buckets!r}")
        names = [a.name for a in attacks]
        self._check_focus(names)
        self._check_probe(attacks)
        self._check_escalate(names)
        self._check_widen(names)

    def _check_focus(self, names: list[str]) -> None:
        for name, fraction in self.focus:
            if name not in names:
                raise ValueError(f"focus names attack {name!r}, which is not in the plan {names}")
            if not is_number(fraction) or not 0 < fraction <= 1:
                raise ValueError(f"focus of {name!r} must be a fraction in (0, 1], got "
                                 f"{fraction!r}")
        _once("focus", self.focus)
        for name, share in self.floor:
            if name not in self.focus_map:
                raise ValueError(f"floor of {name!r} bounds its focus from below: give {name!r} "
                                 "a focus fraction too")
            if not is_number(share) or not 0 < share <= 1:
                raise ValueError(f"floor of {name!r} must be a share of the batch in (0, 1], got "
                                 f"{share!r}")
        _once("floor", self.floor)
        if self.focus and goals_lib.GOALS[self.goal].satisfied is None:
            can = [g.name for g in goals_lib.GOALS.values() if g.satisfied is not None]
            raise ValueError(f"focus needs a goal that can be satisfied ({' or '.join(can)}), "
                             f"not {self.goal}")

    def _check_escalate(self, names: list[str]) -> None:
        for name, share in self.escalate:
            if name not in names:
                raise ValueError(f"escalate names attack {name!r}, which is not in the plan "
                                 f"{names}")
            if names.index(name) == 0:
                raise ValueError(f"escalate: {name!r} is the first stage; it runs on what the "
                                 "stage before it fooled, and there is none")
            if not is_number(share) or not 0 < share <= 1:
                raise ValueError(f"escalate of {name!r} must be a share in (0, 1] of the examples "
                                 f"the stage before it ran on, got {share!r}")
        _once("escalate", self.escalate)

    def _check_widen(self, names: list[str]) -> None:
        for name, fraction in self.widen:
            if name not in self.focus_map:
                raise ValueError(f"widen of {name!r} replaces its focus fraction: give {name!r} "
                                 "a focus fraction too")
            if not is_number(fraction) or not self.focus_map[name] <= fraction <= 1:
                raise ValueError(f"widen of {name!r} must be a fraction in "
                                 f"[{self.focus_map[name]}, 1] (its focus or more), got "
                                 f"{fraction!r}")
            if not any(names.index(e) < names.index(name) for e in self.escalate_map):
                raise ValueError(f"widen of {name!r} applies once an escalated stage has run: "
                                 f"the plan escalates no stage before {name!r}")
        _once("widen", self.widen)

    def _check_probe(self, attacks: tuple[Attack, ...]) -> None:
        steps = {a.name: a.num_steps for a in attacks}
        for name, fraction in self.probe:
            if name not in self.focus_map:
                raise ValueError(f"probe of {name!r} decides which survivors its focus keeps: "
                                 f"give {name!r} a focus fraction too")
            if not is_number(fraction) or not 0 < fraction < 1:
                raise ValueError(f"probe of {name!r} must be a fraction of its steps in (0, 1), "
                                 f"got {fraction!r}")
            if steps[name] < 2:
                raise ValueError(f"probe of {name!r}: the attack has {steps[name]} step, and a "
                                 "probe needs 2 or more (the probe, then the rest)")
        _once("probe", self.probe)

    def run(self, model: Model, batch: Batch, eps: float):
        eps = jnp.float32(eps)
        result, stages = cascade_lib.cascade(self, model, batch, eps)
        counts, outputs = _summarise(result, model, batch._replace(real=None), eps)
        return counts, outputs, np.asarray([s[1:] for s in stages], np.int64)

    def figures(self, metrics: dict, per_example: dict, attacks, stages) -> dict:
        return _cascade_figures(self, metrics, per_example, attacks, stages)


def _once(field: str, pairs: tuple[tuple[str, Any], ...]) -> None:
    if len({n for n, _ in pairs}) != len(pairs):
        raise ValueError(f"{field} names an attack twice: {[n for n, _ in pairs]}")


@dataclasses.dataclass(frozen=True)
class Full:
    """Every attack on every example, the bundle and its summary in one program: the
    many-attack table. It has no settings of its own."""

    mode: ClassVar[str] = "full"

    def check(self, attacks: tuple[Attack, ...], goal_names: tuple[str, ...]) -> None:
        pass

    def describe(self) -> dict:
        return dict(Cascade().describe(), mode=self.mode)  # the cascade's settings as unset

    def run(self, model: Model, batch: Batch, eps: float):
        counts, outputs = _evaluate_batch(model, batch._replace(real=None), jnp.float32(eps))
        return counts, outputs, np.zeros((len(model.attacks), STAGE_COLUMNS), np.int64)

    def figures(self, metrics: dict, per_example: dict, attacks, stages) -> dict:
        return {"schedule": dict(self.describe(), stages=None, skipped=0, statement=None)}


@jax.jit
def _evaluate_batch(model: Model, batch: Batch, eps: jax.Array) -> tuple[Counts, dict]:
    """One batch: the bundle, its counts and its per-example outputs, in one program.

    With a mesh, every output is replicated on every device (the gather happens inside the
    program), so each process reads the whole result locally: no eager operation on a global
    array, and nothing a single process would have to run alone.
    """
    args = (model.params, batch.x, batch.y, model.key, batch.example_id, eps)
    result = held_out(run(*args, rules=model.rules, attacks=model.attacks), *args,
                      rules=model.rules)
    return _summary(result, model, batch, eps)


def _summary(result, model: Model, batch: Batch, eps: jax.Array) -> tuple[Counts, dict]:
    """A batch's counts and per-example outputs, replicated on every device under a mesh."""
    x, y, apply_fn = batch.x, batch.y, model.apply_fn
    setting = Setting.of(model.attacks, tuple(result.best))
    eps_b = jnp.full(y.shape, eps, jnp.float32)
    outputs = dict(per_example_arrays(result, x, eps_b, setting.black_box), label=y,
                   example_id=batch.example_id,
                   zero_gradient=checks_lib.zero_gradients(fast_gradients(apply_fn),
                                                           model.params, x, y))
    if is_stochastic(apply_fn):  # the fraction of the held-out calls each image fools, and
        # of the judge's calls that chose the winner (biased upward: the best of several)
        outputs.update(success_rate=result.best["misclassify"].score.rate,
                       clean_success_rate=result.clean.rate,
                       selection_success_rate=result.selection_rate)
    out = (Counts.from_result(result, batch.mask, eps_b, setting), outputs)
    if model.mesh is not None:
        out = jax.lax.with_sharding_constraint(out, NamedSharding(model.mesh, PartitionSpec()))
    return out


_summarise = glue_jit(_summary)  # a cascade's summary: its own program, after the stages


def _cascade_figures(schedule: Cascade, metrics: dict, per_example: dict, attacks, stages) -> dict:
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
        "schedule": dict(schedule.describe(), stages=rows, skipped=skipped,
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


