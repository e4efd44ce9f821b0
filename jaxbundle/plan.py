"""An evaluation plan: everything that decides what an evaluation computes, as one value of
nested records, each field only where it means something.

* :class:`Threat`: ``eps``, ``norm``, ``judging`` and the ``goals`` tracked;
* :class:`Suite`: the ``attacks`` (names of :data:`jaxbundle.suites.ATTACKS`, :class:`AttackSpec`
  with their own budget, or :class:`~jaxbundle.attacks.base.Attack` values), the ``bundle`` they
  came from and the overrides ``steps``, ``restarts``, ``step_size``, ``queries`` of every named
  attack;
* the ``schedule``, which is also the runner (:mod:`jaxbundle.run.runners`): :class:`Full`
  (every attack on every example) or :class:`Cascade` (each attack on the examples whose
  ``goal`` the ones before left unsatisfied, with its ``threshold``, ``budget``, ``focus``,
  ``floor``, ``probe``, ``escalate``, ``widen``, ``segments`` and ``buckets``:
  :mod:`jaxbundle.run.cascade`);
* :class:`Run`: ``batch_size``, ``seed``, ``unroll``, ``restart_mode`` (``"vmap"``; ``"map"``:
  one restart at a time, less memory; ``"cascade"``, under a :class:`Cascade` only: one restart
  at a time, each on the examples the ones before left, as AutoAttack runs APGD-T's and FAB-T's
  targets);
* ``stochastic``, for a stochastic model (optional): :class:`Sampling` ``eot``,
  ``judge_calls`` and ``success_threshold``;
* ``certify``, the lower bound beside the attacks (optional): :class:`Certify` ``method``, one
  of :data:`CERTIFY_METHODS` (:mod:`jaxbundle.certify`), and ``time_limit``, the complete mode's
  seconds per example.

Named bundles are plans (:mod:`jaxbundle.bundles`). :meth:`Plan.of` builds one and
:meth:`Plan.replace` changes one by the flat names above (``Plan.of(eps=0.3,
attacks=("apgd-ce", "fmn"), steps=50)``, ``plan.replace(mode="cascade", focus={...})``), each
routed to its record; a cascade setting on a :class:`Full` plan is refused there.
:meth:`Plan.check` holds every rule once (the CLI, :func:`jaxbundle.evaluate` and
:func:`jaxbundle.job.run_job` all call it) and :meth:`Plan.describe` is what the report's
``config`` and a checkpoint's fingerprint are made of. A plan runs nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

from jaxbundle import suites
from jaxbundle.attacks.base import Attack
from jaxbundle.core import goals as goals_lib
from jaxbundle.core import judge, norms, validation
from jaxbundle.core.bundler import Rules
from jaxbundle.core.validation import as_plain, is_int, is_number
from jaxbundle.run.runners import PAIRS, Cascade, Full

__all__ = ["AttackSpec", "CERTIFY_METHODS", "Cascade", "Certify", "DEFAULT_GOALS", "Full",
           "MODES", "PAIRS", "Plan", "Run", "Sampling", "Suite", "Threat"]

DEFAULT_GOALS = ("misclassify", "max_confidence", "min_norm")
SCHEDULES = {s.mode: s for s in (Full, Cascade)}
MODES = tuple(SCHEDULES)
RESTART_MODES = ("vmap", "map", "cascade")
# Certified lower bounds (jaxbundle.certify): bound propagation, the exact MIP, smoothing.
CERTIFY_METHODS = ("ibp", "crown-ibp", "crown", "complete", "smoothing")


class AttackSpec(NamedTuple):
    """A named attack of :data:`jaxbundle.suites.ATTACKS` with its own budget (``None``: the
    attack's default); the suite's ``steps`` / ``restarts`` / ``queries`` override these."""

    name: str
    steps: int | None = None
    restarts: int | None = None
    queries: int | None = None


@dataclasses.dataclass(frozen=True)
class Threat:
    """The threat model: the ball (``norm``, radius ``eps``), how candidates are judged
    (:mod:`jaxbundle.core.judge`) and the goals tracked."""

    eps: float
    norm: str = "linf"
    judging: str = "auto"
    goals: tuple[str, ...] = DEFAULT_GOALS

    def __post_init__(self):
        as_plain(self, floats=("eps",))
        goals = (self.goals,) if isinstance(self.goals, str) else tuple(self.goals)
        object.__setattr__(self, "goals", goals)

    def check(self) -> None:
        norms.check_norm(self.norm)
        if not is_number(self.eps) or self.eps < 0:
            raise ValueError(f"eps must be a finite number >= 0, got {self.eps!r}")
        judge.check_judging(self.judging)
        goals_lib.check_goals(self.goals)


@dataclasses.dataclass(frozen=True)
class Suite:
    """The attacks, the named bundle they came from, and the overrides of every named attack's
    budget (``None``: its own)."""

    attacks: tuple[AttackSpec | Attack, ...] = ()
    bundle: str | None = None
    steps: int | None = None
    restarts: int | None = None
    step_size: float | None = None
    queries: int | None = None

    def __post_init__(self):
        attacks = (self.attacks,) if isinstance(self.attacks, (str, Attack)) else self.attacks
        object.__setattr__(self, "attacks", tuple(AttackSpec(a) if isinstance(a, str) else a
                                                  for a in attacks))
        as_plain(self, floats=("step_size",), ints=("steps", "restarts", "queries"))

    def built(self, norm: str) -> tuple[Attack, ...]:
        """The attacks built for ``norm`` (once per distinct suite: the same values, so jitted
        programs are reused)."""
        return _build(self.attacks, norm, self.steps, self.restarts, self.step_size,
                      self.queries)

    def check(self, norm: str) -> tuple[Attack, ...]:
        if not self.attacks:
            raise ValueError("a plan needs at least one attack (names from "
                             "jaxbundle.suites.ATTACKS, or a named bundle: jaxbundle.bundles)")
        for a in self.attacks:
            if isinstance(a, AttackSpec) and a.name not in suites.ATTACKS:
                raise ValueError(f"unknown attack {a.name!r}; choose from "
                                 f"{', '.join(suites.ATTACKS)}")
            if not isinstance(a, (AttackSpec, Attack)):
                raise ValueError(f"attacks are names, AttackSpec or Attack values, got {a!r}")
        for field in ("steps", "restarts"):
            value = getattr(self, field)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if self.step_size is not None and (not is_number(self.step_size) or self.step_size <= 0):
            raise ValueError(f"step_size must be a number > 0, got {self.step_size!r}")
        named = [a.name for a in self.attacks if isinstance(a, AttackSpec)]
        overrides = [f for f in ("steps", "restarts", "step_size", "queries")
                     if getattr(self, f) is not None]
        if overrides and not named:
            raise ValueError(f"{overrides[0]} overrides the named attacks of a plan; this plan's "
                             "are all Attack values (build them with the setting instead)")
        if self.queries is not None and not suites.QUERY_ATTACKS & set(named):
            raise ValueError(f"queries sets the query budget of "
                             f"{', '.join(sorted(suites.QUERY_ATTACKS))}; no attack of this "
                             "plan has one")
        return validation.check_attacks(self.built(norm), norm)


@dataclasses.dataclass(frozen=True)
class Run:
    """How the run is carried out: the batch size, the seed of every key, the step loops'
    ``unroll`` and how an attack's restarts run."""

    batch_size: int = 250
    seed: int = 0
    unroll: int | bool = 1
    restart_mode: str = "vmap"

    def __post_init__(self):
        as_plain(self, ints=("batch_size", "seed"))

    def check(self) -> None:
        if not is_int(self.batch_size) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        if not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not (isinstance(self.unroll, bool) or (is_int(self.unroll) and self.unroll >= 1)):
            raise ValueError(f"unroll must be a positive integer or a bool, got {self.unroll!r}")
        if self.restart_mode not in RESTART_MODES:
            raise ValueError(f"restart_mode must be one of {RESTART_MODES}, got "
                             f"{self.restart_mode!r}")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """A stochastic model's options (:mod:`jaxbundle.core.sampling`): ``eot`` samples per
    gradient, the judge's ``judge_calls`` and ``success_threshold`` (``None``: the model's
    own, :func:`jaxbundle.stochastic`)."""

    eot: int = 1
    judge_calls: int | None = None
    success_threshold: float | None = None

    def __post_init__(self):
        as_plain(self, floats=("success_threshold",), ints=("eot", "judge_calls"))

    def check(self) -> None:
        for field in ("eot", "judge_calls"):
            value = getattr(self, field)
            if (value is not None or field == "eot") and (not is_int(value) or value < 1):
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        t = self.success_threshold
        if t is not None and (not is_number(t) or not 0 <= t < 1):
            raise ValueError(f"success_threshold must be a success rate in [0, 1), got {t!r}")


@dataclasses.dataclass(frozen=True)
class Certify:
    """The certified lower bound beside the attacks: ``method`` (:data:`CERTIFY_METHODS`) and,
    for ``"complete"``, ``time_limit``, the MIP's seconds per example (``None``: the default
    :data:`jaxbundle.certify.run.TIME_LIMIT`)."""

    method: str
    time_limit: float | None = None

    def __post_init__(self):
        as_plain(self, floats=("time_limit",))

    def check(self, norm: str) -> None:
        if self.method not in CERTIFY_METHODS:
            raise ValueError(f"certify must be one of {', '.join(CERTIFY_METHODS)}, got "
                             f"{self.method!r}")
        if self.method == "complete" and norm != "linf":
            raise ValueError("certify='complete' (an exact MIP) supports the linf norm only; for "
                             "l2 use 'crown' or 'crown-ibp'")
        if self.time_limit is not None:
            if self.method != "complete":
                raise ValueError(_TIME_LIMIT_NEEDS)
            if not is_number(self.time_limit) or self.time_limit <= 0:
                raise ValueError(f"certify_time_limit must be seconds > 0, got "
                                 f"{self.time_limit!r}")


_TIME_LIMIT_NEEDS = ("certify_time_limit is the complete mode's seconds per example: it needs "
                     "certify='complete'")

# The flat names of Plan.of / Plan.replace (the CLI's vocabulary), each to its record's field.
_SECTIONS = {
    "threat": {f: f for f in ("eps", "norm", "judging", "goals")},
    "suite": {f: f for f in ("attacks", "bundle", "steps", "restarts", "step_size", "queries")},
    "run": {f: f for f in ("batch_size", "seed", "unroll", "restart_mode")},
    "stochastic": {f: f for f in ("eot", "judge_calls", "success_threshold")},
    "certify": {"certify": "method", "certify_time_limit": "time_limit"},
}
# A Full plan refuses these when set (in this order: the error names the first).
_CASCADE_FIELDS = (*PAIRS, "segments", "buckets", "budget", "threshold", "goal")


@dataclasses.dataclass(frozen=True)
class Plan:
    """An evaluation plan (see the module docstring). Build one with :mod:`jaxbundle.bundles`,
    :meth:`Plan.of`, or from its records, e.g. ``Plan(Threat(0.3), Suite(("apgd-ce", "fmn"),
    steps=50), Cascade(focus={"fmn": 0.5}))``."""

    threat: Threat
    suite: Suite
    schedule: Full | Cascade = Full()
    run: Run = Run()
    stochastic: Sampling | None = None
    certify: Certify | None = None

    @classmethod
    def of(cls, eps: float, attacks: Any = (), **fields: Any) -> "Plan":
        """A plan from the flat names of the module docstring (every other one at its
        default), e.g. ``Plan.of(eps=0.3, attacks=("apgd-ce",), mode="cascade", segments=3)``."""
        return cls(Threat(eps), Suite(attacks)).replace(**fields)

    def replace(self, **changes: Any) -> "Plan":
        """The same plan with ``changes``: records by their name (``threat=Threat(...)``) or
        fields by their flat names (``eps=``, ``steps=``, ``mode=``, ``focus=``, ``seed=``,
        ``eot=``, ``certify=``, ...). ``mode`` swaps the schedule (a cascade's settings are
        kept while it stays one; ``mode="full"`` drops them). A ``threshold`` given without a
        ``goal`` is the max_confidence goal's t: it selects that goal."""
        records = {k: changes.pop(k) for k in [k for k, v in changes.items() if k in _RECORDS
                                                 and (k != "certify" or _is_record(v))]}
        plan = dataclasses.replace(self, **records)
        updates = {}
        for section, names in _SECTIONS.items():
            given = {names[k]: changes.pop(k) for k in [k for k in changes if k in names]}
            if given:
                updates[section] = _section(section, getattr(plan, section), given)
        schedule = {k: changes.pop(k) for k in [k for k in changes if k in _CASCADE_FIELDS]}
        mode = changes.pop("mode", None)
        if changes:
            raise TypeError(f"Plan has no field {next(iter(changes))!r}")
        if schedule or mode is not None:
            updates["schedule"] = _schedule(plan.schedule, mode, schedule)
        return dataclasses.replace(plan, **updates)

    def attack_values(self) -> tuple[Attack, ...]:
        """The attacks built for the plan's norm, named as in the plan."""
        return self.suite.built(self.threat.norm)

    @property
    def goal_names(self) -> tuple[str, ...]:
        """The goals tracked: the threat model's, misclassify first, and each attack's own."""
        return validation.goals_for(self.threat.goals, self.attack_values())

    def rules(self, apply_fn: Callable, attacks: tuple[Attack, ...]) -> Rules:
        """The bundler's static rules of this plan's run of ``attacks`` (as built for the
        model: :func:`jaxbundle.evaluation.for_model`) on ``apply_fn``."""
        threat, run = self.threat, self.run
        return Rules(apply_fn, validation.goals_for(threat.goals, attacks), threat.norm,
                     threat.judging, run.restart_mode, run.unroll)

    @property
    def sampling(self) -> Sampling:
        """The stochastic options (their defaults where the plan has none)."""
        return self.stochastic or Sampling()

    def check(self, apply_fn: Callable | None = None) -> "Plan":
        """Every rule of a plan, in one place; returns the plan. Raises ``ValueError`` with one
        line naming the first bad field. With ``apply_fn``, also what depends on the model (EOT
        needs a stochastic one)."""
        for record, kind in ((self.threat, Threat), (self.suite, Suite), (self.run, Run)):
            if not isinstance(record, kind):
                raise TypeError(f"a plan's {kind.__name__.lower()} is a {kind.__name__}, got "
                                f"{type(record).__name__}")
        if not isinstance(self.schedule, tuple(SCHEDULES.values())):
            raise TypeError(f"a plan's schedule is Full() or Cascade(...), got "
                            f"{type(self.schedule).__name__}")
        self.threat.check()
        attacks = self.suite.check(self.threat.norm)
        for a in attacks:  # an Attack value may carry its own EOT (jaxbundle.with_eot)
            if a.eot != 1 and self.sampling.eot not in (1, a.eot):
                raise ValueError(f"attack {a.name!r} carries eot={a.eot} and the plan eot="
                                 f"{self.sampling.eot}: set one of them")
        self.schedule.check(attacks, validation.goals_for(self.threat.goals, attacks))
        self.run.check()
        if self.run.restart_mode == "cascade" and not isinstance(self.schedule, Cascade):
            raise ValueError("restart_mode 'cascade' (each restart on the examples the ones "
                             "before left) needs mode 'cascade'; in mode 'full' use 'vmap' or "
                             "'map'")
        self.sampling.check()
        if self.certify is not None:
            self.certify.check(self.threat.norm)
        if apply_fn is not None:
            self._check_model(attacks, apply_fn)
        return self

    def _check_model(self, attacks: tuple[Attack, ...], apply_fn: Callable) -> None:
        from jaxbundle.core import sampling

        if not sampling.is_stochastic(apply_fn):
            if self.sampling.eot != 1:
                raise ValueError(
                    f"eot={self.sampling.eot} but the model is deterministic; EOT averages over "
                    "a stochastic model's randomness (declare it with jaxbundle.stochastic)")
            for field in ("judge_calls", "success_threshold"):
                if getattr(self.sampling, field) is not None:
                    raise ValueError(f"{field} is for stochastic models; the model is "
                                     "deterministic")
        validation.check_eot(attacks, apply_fn)
        _check_certify_model(self, apply_fn)

    def describe(self) -> dict:
        """A JSON-able description: the report's ``config`` of the plan, and (with the attacks'
        full descriptions, :func:`attack_description`) the checkpoint's fingerprint."""
        attacks, suite, run, certify = self.attack_values(), self.suite, self.run, self.certify
        return {
            "threat_model": {"eps": self.threat.eps, "norm": self.threat.norm,
                             "judging": self.threat.judging, "goals": list(self.goal_names)},
            "bundle": suite.bundle,
            "attacks": [{"name": a.name, "kind": a.kind, "goal": a.goal, "steps": a.num_steps,
                         "restarts": a.num_restarts, "gradients": a.gradients,
                         "queries": a.queries, "eot": a.eot} for a in attacks],
            "overrides": {"steps": suite.steps, "restarts": suite.restarts,
                          "step_size": suite.step_size, "queries": suite.queries},
            "schedule": self.schedule.describe(),
            "run": {"batch_size": run.batch_size, "seed": run.seed, "unroll": run.unroll,
                    "restart_mode": run.restart_mode},
            "stochastic": dataclasses.asdict(self.sampling),
            "certify": {"method": certify and certify.method,
                        "time_limit": certify and certify.time_limit},
        }


_RECORDS = tuple(f.name for f in dataclasses.fields(Plan))


def _is_record(value: Any) -> bool:
    """``certify=`` names the record when given one (or None), else the flat method name."""
    return value is None or isinstance(value, Certify)


def _section(section: str, record: Any, given: dict) -> Any:
    """``record`` (a plan's section, possibly None) with the fields ``given`` changed; an
    optional section all at its defaults is None."""
    if section == "certify":
        fields = dict(dataclasses.asdict(record) if record else {"method": None}, **given)
        if fields["method"] is None:
            if fields.get("time_limit") is not None:
                raise ValueError(_TIME_LIMIT_NEEDS)
            return None
        return Certify(**fields)
    if section == "stochastic":
        options = dataclasses.replace(record or Sampling(), **given)
        return None if options == Sampling() else options
    return dataclasses.replace(record, **given)


def _schedule(schedule: Full | Cascade, mode: str | None, changes: dict) -> Full | Cascade:
    """The schedule of ``mode`` (None: the current one's) with the cascade settings
    ``changes``; on a full plan, a cascade setting other than its default is refused."""
    mode = schedule.mode if mode is None else mode
    if mode not in SCHEDULES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if changes.get("threshold") is not None and "goal" not in changes:
        changes["goal"] = "max_confidence"
    if mode == "full":
        unset = Cascade()
        for field in _CASCADE_FIELDS:
            if field in changes and Cascade(**{field: changes[field]}) != unset:
                raise ValueError(f"{field} is a cascade setting: it needs mode='cascade' "
                                 "(--schedule cascade)")
        return Full()
    return dataclasses.replace(schedule if isinstance(schedule, Cascade) else Cascade(),
                               **changes)


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


def _check_certify_model(plan: Plan, apply_fn: Callable) -> None:
    """Smoothing certifies a model declared with :func:`jaxbundle.certify.gaussian`; bound
    propagation a deterministic one."""
    if plan.certify is None:
        return
    from jaxbundle.core import sampling
    from jaxbundle.certify import smoothing

    if plan.certify.method == "smoothing":
        if smoothing.smoothing_sigma(apply_fn) is None:
            raise ValueError("certify='smoothing' needs a model under Gaussian noise declared "
                             "with jaxbundle.certify.gaussian(apply_fn, sigma)")
    elif sampling.is_stochastic(apply_fn):
        raise ValueError(f"certify={plan.certify.method!r} bounds a deterministic model; a "
                         "stochastic one is certified by randomised smoothing "
                         "(certify='smoothing' with jaxbundle.certify.gaussian)")
