"""An evaluation plan: everything that decides what an evaluation computes, as one value.

A :class:`Plan` is frozen and hashable. It holds

* the threat model: ``eps``, ``norm``, ``judging`` and the ``goals`` tracked;
* the attacks: names of :data:`jaxbundle.suites.ATTACKS` (or :class:`AttackSpec` with their
  own budget, or :class:`~jaxbundle.attacks.base.Attack` values), the ``bundle`` they came from
  and the overrides ``steps``, ``restarts``, ``step_size``, ``queries`` of every named attack;
* the schedule: ``mode`` (``"full"``: every attack on every example; ``"cascade"``: each on
  the examples whose ``goal`` the ones before left unsatisfied, see :mod:`jaxbundle.run.cascade`),
  ``threshold`` (the max-confidence goal's t), ``budget``, ``focus``, ``probe``, ``escalate``
  (stages that run only when the stage before them fooled enough of what it ran on),
  ``segments`` and ``buckets`` (the compacted batch sizes per halving of the batch: more, less
  padding);
* the run options: ``batch_size``, ``seed``, ``unroll``, ``restart_mode`` (``"vmap"``;
  ``"map"``: one restart at a time, less memory; ``"cascade"``, in a cascade only: one restart
  at a time, each on the examples the ones before left, as AutoAttack runs APGD-T's and
  FAB-T's targets), and for stochastic models ``eot``, ``judge_calls`` and
  ``success_threshold``;
* the lower bound beside the attacks (optional): ``certify``, a method of
  :data:`CERTIFY_METHODS` (:mod:`jaxbundle.certify`), and ``certify_time_limit``, the complete
  mode's seconds per example.

Named bundles are plans (:mod:`jaxbundle.bundles`); a field is changed with
:meth:`Plan.replace`. :meth:`Plan.check` holds every rule once (the CLI, :func:`jaxbundle.evaluate`
and :func:`jaxbundle.job.run_job` all call it) and :meth:`Plan.describe` is what the report's
``config`` and a checkpoint's fingerprint are made of. A plan runs nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Callable, NamedTuple

import numpy as np

from jaxbundle.core import goals as goals_lib
from jaxbundle.core import judge
from jaxbundle.core import norms
from jaxbundle import suites
from jaxbundle.core import validation
from jaxbundle.attacks.base import Attack

__all__ = ["AttackSpec", "DEFAULT_GOALS", "MODES", "Plan"]

DEFAULT_GOALS = ("misclassify", "max_confidence", "min_norm")
MODES = ("full", "cascade")
RESTART_MODES = ("vmap", "map", "cascade")
# Certified lower bounds (jaxbundle.certify): bound propagation, the exact MIP, smoothing.
CERTIFY_METHODS = ("ibp", "crown-ibp", "crown", "complete", "smoothing")
MAX_BUCKETS = 64  # bucket sizes per halving of the batch, at most


class AttackSpec(NamedTuple):
    """A named attack of :data:`jaxbundle.suites.ATTACKS` with its own budget (``None``: the
    attack's default); the plan's ``steps`` / ``restarts`` / ``queries`` override these."""

    name: str
    steps: int | None = None
    restarts: int | None = None
    queries: int | None = None


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_number(value: Any) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
            and math.isfinite(value))


@dataclasses.dataclass(frozen=True)
class Plan:
    """An evaluation plan (see the module docstring). Build one with :mod:`jaxbundle.bundles`
    or directly, e.g. ``Plan(eps=0.3, attacks=("apgd-ce", "fmn"), steps=50)``."""

    eps: float
    norm: str = "linf"
    judging: str = "auto"
    goals: tuple[str, ...] = DEFAULT_GOALS
    attacks: tuple[AttackSpec | Attack, ...] = ()
    bundle: str | None = None
    steps: int | None = None
    restarts: int | None = None
    step_size: float | None = None
    queries: int | None = None
    mode: str = "full"
    goal: str = "misclassify"
    threshold: float | None = None
    budget: float | None = None
    focus: tuple[tuple[str, float], ...] = ()
    probe: tuple[tuple[str, float], ...] = ()
    escalate: tuple[tuple[str, float], ...] = ()
    segments: int = 1
    buckets: int = 2
    batch_size: int = 250
    seed: int = 0
    unroll: int | bool = 1
    restart_mode: str = "vmap"
    eot: int = 1
    judge_calls: int | None = None
    success_threshold: float | None = None
    certify: str | None = None
    certify_time_limit: float | None = None

    def __post_init__(self):
        # Containers into tuples (hashable): names into specs, a focus dict into pairs.
        attacks = (self.attacks,) if isinstance(self.attacks, (str, Attack)) else self.attacks
        set_ = functools.partial(object.__setattr__, self)
        for field in ("eps", "step_size", "threshold", "budget", "success_threshold",
                      "certify_time_limit"):
            if _is_number(getattr(self, field)):  # numpy and JAX scalars: plain, hashable
                set_(field, float(getattr(self, field)))
        for field in ("steps", "restarts", "queries", "segments", "buckets", "batch_size", "seed",
                      "eot", "judge_calls"):
            if _is_int(getattr(self, field)):
                set_(field, int(getattr(self, field)))
        set_("attacks", tuple(AttackSpec(a) if isinstance(a, str) else a for a in attacks))
        set_("goals", (self.goals,) if isinstance(self.goals, str) else tuple(self.goals))
        for field in ("focus", "probe", "escalate"):
            pairs = getattr(self, field)
            pairs = pairs.items() if isinstance(pairs, dict) else pairs
            set_(field, tuple((str(k), v) for k, v in pairs))

    def replace(self, **changes: Any) -> "Plan":
        """The same plan with ``changes`` (``dataclasses.replace``). A ``threshold`` given
        without a ``goal`` is the max_confidence goal's t: it selects that goal."""
        if changes.get("threshold") is not None and "goal" not in changes:
            changes["goal"] = "max_confidence"
        return dataclasses.replace(self, **changes)

    @property
    def focus_map(self) -> dict[str, float]:
        """``focus`` as a dict (attack name -> fraction)."""
        return dict(self.focus)

    @property
    def probe_map(self) -> dict[str, float]:
        """``probe`` as a dict (attack name -> the fraction of its steps every survivor runs
        before focus chooses: :func:`jaxbundle.run.cascade.probe_steps`)."""
        return dict(self.probe)

    @property
    def escalate_map(self) -> dict[str, float]:
        """``escalate`` as a dict (attack name -> the share of the examples the stage before it
        ran on that this stage must have fooled for it to run: :func:`jaxbundle.run.cascade`)."""
        return dict(self.escalate)

    def attack_values(self) -> tuple[Attack, ...]:
        """The attacks built for the plan's norm, named as in the plan (built once per distinct
        plan: the same values, so jitted programs are reused)."""
        return _build(self.attacks, self.norm, self.steps, self.restarts, self.step_size,
                      self.queries)

    def check(self, apply_fn: Callable | None = None) -> "Plan":
        """Every rule of a plan, in one place; returns the plan. Raises ``ValueError`` with one
        line naming the first bad field. With ``apply_fn``, also what depends on the model (EOT
        needs a stochastic one)."""
        _check_threat_model(self)
        attacks = _check_attacks(self)
        _check_schedule(self, attacks)
        _check_run(self)
        _check_certify(self)
        if apply_fn is not None:
            from jaxbundle.core import sampling

            if not sampling.is_stochastic(apply_fn):
                if self.eot != 1:
                    raise ValueError(
                        f"eot={self.eot} but the model is deterministic; EOT averages over a "
                        "stochastic model's randomness (declare it with jaxbundle.stochastic)")
                for field in ("judge_calls", "success_threshold"):
                    if getattr(self, field) is not None:
                        raise ValueError(f"{field} is for stochastic models; the model is "
                                         "deterministic")
            validation.check_eot(attacks, apply_fn)
            _check_certify_model(self, apply_fn)
        return self

    @property
    def goal_names(self) -> tuple[str, ...]:
        """The goals tracked: ``goals``, misclassify first, and each attack's own goal."""
        return validation.goals_for(self.goals, self.attack_values())

    def describe(self) -> dict:
        """A JSON-able description: the report's ``config`` of the plan, and (with the attacks'
        full descriptions, :func:`attack_description`) the checkpoint's fingerprint."""
        attacks = self.attack_values()
        return {
            "threat_model": {"eps": self.eps, "norm": self.norm, "judging": self.judging,
                             "goals": list(self.goal_names)},
            "bundle": self.bundle,
            "attacks": [{"name": a.name, "kind": a.kind, "goal": a.goal, "steps": a.num_steps,
                         "restarts": a.num_restarts, "gradients": a.gradients,
                         "queries": a.queries, "eot": a.eot} for a in attacks],
            "overrides": {"steps": self.steps, "restarts": self.restarts,
                          "step_size": self.step_size, "queries": self.queries},
            "schedule": {"mode": self.mode, "goal": self.goal, "threshold": self.threshold,
                         "budget": self.budget, "focus": self.focus_map,
                         "probe": self.probe_map, "escalate": self.escalate_map,
                         "segments": self.segments,
                         "buckets": self.buckets},
            "run": {"batch_size": self.batch_size, "seed": self.seed, "unroll": self.unroll,
                    "restart_mode": self.restart_mode},
            "stochastic": {"eot": self.eot, "judge_calls": self.judge_calls,
                           "success_threshold": self.success_threshold},
            "certify": {"method": self.certify, "time_limit": self.certify_time_limit},
        }


@functools.lru_cache(maxsize=128)
def _build(specs, norm, steps, restarts, step_size, queries) -> tuple[Attack, ...]:
    built = []
    for spec in specs:
        if isinstance(spec, Attack):
            built.append(spec)
            continue
        options = {k: v for k, v in (("steps", spec.steps), ("restarts", spec.restarts),
                                     ("queries", spec.queries)) if v is not None}
        options.update({k: v for k, v in (("steps", steps), ("restarts", restarts),
                                          ("queries", queries)) if v is not None})
        built.append(suites.attack(spec.name, norm, step_size=step_size, **options))
    return tuple(built)


def _check_threat_model(plan: Plan) -> None:
    norms.check_norm(plan.norm)
    if not _is_number(plan.eps) or plan.eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {plan.eps!r}")
    judge.check_judging(plan.judging)
    goals_lib.check_goals(plan.goals)


def _check_attacks(plan: Plan) -> tuple[Attack, ...]:
    if not plan.attacks:
        raise ValueError("a plan needs at least one attack (names from jaxbundle.suites.ATTACKS,"
                         " or a named bundle: jaxbundle.bundles)")
    for a in plan.attacks:
        if isinstance(a, AttackSpec) and a.name not in suites.ATTACKS:
            raise ValueError(f"unknown attack {a.name!r}; choose from {', '.join(suites.ATTACKS)}")
        if not isinstance(a, (AttackSpec, Attack)):
            raise ValueError(f"attacks are names, AttackSpec or Attack values, got {a!r}")
    for field in ("steps", "restarts"):
        value = getattr(plan, field)
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"{field} must be a positive integer, got {value!r}")
    if plan.step_size is not None and (not _is_number(plan.step_size) or plan.step_size <= 0):
        raise ValueError(f"step_size must be a number > 0, got {plan.step_size!r}")
    named = [a.name for a in plan.attacks if isinstance(a, AttackSpec)]
    overrides = [f for f in ("steps", "restarts", "step_size", "queries")
                 if getattr(plan, f) is not None]
    if overrides and not named:
        raise ValueError(f"{overrides[0]} overrides the named attacks of a plan; this plan's are "
                         "all Attack values (build them with the setting instead)")
    if plan.queries is not None and not suites.QUERY_ATTACKS & set(named):
        raise ValueError(f"queries sets the query budget of "
                         f"{', '.join(sorted(suites.QUERY_ATTACKS))}; no attack of this plan "
                         "has one")
    built = validation.check_attacks(plan.attack_values(), plan.norm)
    for a in built:  # an Attack value may carry its own EOT (jaxbundle.with_eot)
        if a.eot != 1 and plan.eot not in (1, a.eot):
            raise ValueError(f"attack {a.name!r} carries eot={a.eot} and the plan eot="
                             f"{plan.eot}: set one of them")
    return built


def _check_schedule(plan: Plan, attacks: tuple[Attack, ...]) -> None:
    if plan.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {plan.mode!r}")
    goal_names = validation.goals_for(plan.goals, attacks)
    if plan.goal not in goals_lib.GOALS:
        raise ValueError(f"unknown goal {plan.goal!r}; choose from {', '.join(goals_lib.GOALS)}")
    if plan.goal not in goal_names:
        raise ValueError(f"the schedule's goal {plan.goal!r} is not among the goals tracked "
                         f"{goal_names}")
    if plan.threshold is not None:
        if not _is_number(plan.threshold) or not 0 < plan.threshold <= 1:
            raise ValueError(f"threshold must be a confidence in (0, 1], got {plan.threshold!r}")
        if plan.goal != "max_confidence":
            raise ValueError("threshold is the max_confidence goal's t: set goal='max_confidence'")
    elif plan.goal == "max_confidence" and plan.mode == "cascade":
        raise ValueError("a cascade for the max_confidence goal needs its threshold t in (0, 1]")
    if plan.budget is not None and (not _is_number(plan.budget) or plan.budget <= 0):
        raise ValueError(f"budget must be a number of model passes > 0, got {plan.budget!r}")
    if not _is_int(plan.segments) or plan.segments < 1:
        raise ValueError(f"segments must be a positive integer, got {plan.segments!r}")
    if not _is_int(plan.buckets) or not 1 <= plan.buckets <= MAX_BUCKETS:
        raise ValueError(f"buckets (bucket sizes per halving of the batch) must be an integer "
                         f"in [1, {MAX_BUCKETS}], got {plan.buckets!r}")
    if plan.mode != "cascade":
        for field, given in (("focus", bool(plan.focus)), ("probe", bool(plan.probe)),
                             ("escalate", bool(plan.escalate)),
                             ("segments", plan.segments > 1),
                             ("buckets", plan.buckets != 2),
                             ("budget", plan.budget is not None),
                             ("threshold", plan.threshold is not None),
                             ("goal", plan.goal != "misclassify")):
            if given:
                raise ValueError(f"{field} is a cascade setting: it needs mode='cascade' "
                                 "(--schedule cascade)")
    names = [a.name for a in attacks]
    for name, fraction in plan.focus:
        if name not in names:
            raise ValueError(f"focus names attack {name!r}, which is not in the plan {names}")
        if not _is_number(fraction) or not 0 < fraction <= 1:
            raise ValueError(f"focus of {name!r} must be a fraction in (0, 1], got {fraction!r}")
    if len({n for n, _ in plan.focus}) != len(plan.focus):
        raise ValueError(f"focus names an attack twice: {[n for n, _ in plan.focus]}")
    _check_probe(plan, attacks)
    _check_escalate(plan, names)
    if plan.focus and goals_lib.GOALS[plan.goal].satisfied is None:
        can = [g.name for g in goals_lib.GOALS.values() if g.satisfied is not None]
        raise ValueError(f"focus needs a goal that can be satisfied ({' or '.join(can)}), "
                         f"not {plan.goal}")


def _check_escalate(plan: Plan, names: list[str]) -> None:
    for name, share in plan.escalate:
        if name not in names:
            raise ValueError(f"escalate names attack {name!r}, which is not in the plan {names}")
        if names.index(name) == 0:
            raise ValueError(f"escalate: {name!r} is the first stage; it runs on what the stage "
                             "before it fooled, and there is none")
        if not _is_number(share) or not 0 < share <= 1:
            raise ValueError(f"escalate of {name!r} must be a share in (0, 1] of the examples the "
                             f"stage before it ran on, got {share!r}")
    if len({n for n, _ in plan.escalate}) != len(plan.escalate):
        raise ValueError(f"escalate names an attack twice: {[n for n, _ in plan.escalate]}")


def _check_probe(plan: Plan, attacks: tuple[Attack, ...]) -> None:
    steps = {a.name: a.num_steps for a in attacks}
    focus = plan.focus_map
    for name, fraction in plan.probe:
        if name not in focus:
            raise ValueError(f"probe of {name!r} decides which survivors its focus keeps: give "
                             f"{name!r} a focus fraction too")
        if not _is_number(fraction) or not 0 < fraction < 1:
            raise ValueError(f"probe of {name!r} must be a fraction of its steps in (0, 1), got "
                             f"{fraction!r}")
        if steps[name] < 2:
            raise ValueError(f"probe of {name!r}: the attack has {steps[name]} step, and a "
                             "probe needs 2 or more (the probe, then the rest)")
    if len({n for n, _ in plan.probe}) != len(plan.probe):
        raise ValueError(f"probe names an attack twice: {[n for n, _ in plan.probe]}")


def _check_run(plan: Plan) -> None:
    if not _is_int(plan.batch_size) or plan.batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {plan.batch_size!r}")
    if not _is_int(plan.seed):
        raise ValueError(f"seed must be an integer, got {plan.seed!r}")
    if not (isinstance(plan.unroll, bool) or (_is_int(plan.unroll) and plan.unroll >= 1)):
        raise ValueError(f"unroll must be a positive integer or a bool, got {plan.unroll!r}")
    if plan.restart_mode not in RESTART_MODES:
        raise ValueError(f"restart_mode must be one of {RESTART_MODES}, got "
                         f"{plan.restart_mode!r}")
    if plan.restart_mode == "cascade" and plan.mode != "cascade":
        raise ValueError("restart_mode 'cascade' (each restart on the examples the ones before "
                         "left) needs mode 'cascade'; in mode 'full' use 'vmap' or 'map'")
    for field in ("eot", "judge_calls"):
        value = getattr(plan, field)
        if (value is not None or field == "eot") and (not _is_int(value) or value < 1):
            raise ValueError(f"{field} must be a positive integer, got {value!r}")
    t = plan.success_threshold
    if t is not None and (not _is_number(t) or not 0 <= t < 1):
        raise ValueError(f"success_threshold must be a success rate in [0, 1), got {t!r}")


def _check_certify(plan: Plan) -> None:
    if plan.certify is not None and plan.certify not in CERTIFY_METHODS:
        raise ValueError(f"certify must be one of {', '.join(CERTIFY_METHODS)}, got "
                         f"{plan.certify!r}")
    if plan.certify == "complete" and plan.norm != "linf":
        raise ValueError("certify='complete' (an exact MIP) supports the linf norm only; for l2 "
                         "use 'crown' or 'crown-ibp'")
    limit = plan.certify_time_limit
    if limit is not None:
        if plan.certify != "complete":
            raise ValueError("certify_time_limit is the complete mode's seconds per example: it "
                             "needs certify='complete'")
        if not _is_number(limit) or limit <= 0:
            raise ValueError(f"certify_time_limit must be seconds > 0, got {limit!r}")


def _check_certify_model(plan: Plan, apply_fn: Callable) -> None:
    """Smoothing certifies a model declared with :func:`jaxbundle.certify.gaussian`; bound
    propagation a deterministic one."""
    if plan.certify is None:
        return
    from jaxbundle.core import sampling
    from jaxbundle.certify import smoothing

    if plan.certify == "smoothing":
        if smoothing.smoothing_sigma(apply_fn) is None:
            raise ValueError("certify='smoothing' needs a model under Gaussian noise declared "
                             "with jaxbundle.certify.gaussian(apply_fn, sigma)")
    elif sampling.is_stochastic(apply_fn):
        raise ValueError(f"certify={plan.certify!r} bounds a deterministic model; a stochastic "
                         "one is certified by randomised smoothing (certify='smoothing' with "
                         "jaxbundle.certify.gaussian)")
