"""Attacks and bundles by name: what ``jaxbundle evaluate --attacks/--bundle`` accept.

A *bundle* is a tuple of attacks that ``jaxbundle.bundle`` runs together, keeping the best
candidate per example:

``standard``
    At least AutoAttack's white-box part (Croce & Hein 2020): APGD-CE (100 steps) and APGD-T
    (targeted DLR, 9 target classes x 100 steps), plus FMN (100 steps), a minimum-norm attack
    whose candidates within eps count too and which gives every example a distortion.
``fast``
    A quick look: APGD-CE and APGD-T with 3 targets, 20 steps each.
``pgd``
    The walking skeleton's bundle: FGSM, and PGD-40 with the CE and the margin loss, 3
    random restarts each.
``default``
    The main job's, strongest for its cost, run as a cascade (:data:`BUNDLE_SCHEDULES`), each
    stage on the survivors of the ones before: APGD-CE (20 steps) on every example; APGD-CE
    again with 100 steps and APGD-T (5 targets x 40 steps), each on the more promising half
    of the survivors (rounded to the nearest bucket size); then AutoAttack's Square (5,000
    queries, p_init 0.8), the score-based check against gradient masking, on the 8 % most
    promising survivors (the schedule's ``focus``: promise is the smallest margin left by the
    stages before). Each stage runs in 6 segments, and an example fooled in one stops there.
    How it compares with AutoAttack: benchmarks/README.md.
``broad``
    A many-attack table (run in full): the ``pgd`` bundle, FMN (100 steps, white-box minimum
    norm), Square (1,000 queries) and a decision-based minimum-norm attack with 1,000 queries
    (RayS in Linf, SurFree in L2), so that the report has white-box and black-box robust
    accuracy per attack, P(D) curves per kind and D1/2.
``black-box``
    RayS (Linf) or SurFree (L2) with 5,000 queries.
``autoattack``
    AutoAttack's standard version (Croce & Hein 2020) with its original parameters: APGD-CE
    (100 steps), APGD-T (9 targets x 100), FAB-T (9 targets x 100) and Square (5,000 queries,
    p_init 0.8, the schedule not rescaled), run as AutoAttack runs it, each attack only on the
    examples the earlier ones did not fool (:data:`BUNDLE_SCHEDULES`: a cascade).
``min-norm``
    The white-box minimum-norm attacks for the success-vs-distortion curve (L2: FMN, BP, CW,
    DeepFool; Linf: FMN, DeepFool).

``steps`` and ``restarts`` override every iterative white-box attack's defaults, ``queries``
the query budget of every black-box attack (:data:`QUERY_ATTACKS`); ``step_size`` is PGD's.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from jaxbundle import attacks as attacks_lib
from jaxbundle import norms
from jaxbundle.attacks.base import Attack, check_count

__all__ = ["ATTACKS", "BUNDLES", "BUNDLE_SCHEDULES", "QUERY_ATTACKS", "Schedule", "attack",
           "bundle_attacks", "bundle_schedule"]


def _pgd(loss: str) -> Callable[..., Attack]:
    def make(norm, steps=None, restarts=None, step_size=None):
        return attacks_lib.pgd(
            norm, loss=loss, steps=steps or 40, restarts=restarts or 1, step_size=step_size
        )

    return make


def _apgd(loss: str, targets: int = 9, name: str | None = None) -> Callable[..., Attack]:
    def make(norm, steps=None, restarts=None, step_size=None):
        del step_size
        if loss.endswith("targeted"):
            return attacks_lib.apgd(norm, loss=loss, steps=steps or 100, targets=targets,
                                    name=name)
        return attacks_lib.apgd(norm, loss=loss, steps=steps or 100, restarts=restarts or 1,
                                name=name)

    return make


def _min_norm(factory: Callable[..., Attack], takes_norm: bool = True) -> Callable[..., Attack]:
    def make(norm, steps=None, restarts=None, step_size=None):
        del restarts, step_size
        kwargs: dict[str, Any] = {} if steps is None else {"steps": steps}
        return factory(norm, **kwargs) if takes_norm else factory(**kwargs)

    return make


# name -> make(norm, steps=None, restarts=None, step_size=None) -> Attack
ATTACKS: dict[str, Callable[..., Attack]] = {
    "fgsm": lambda norm, steps=None, restarts=None, step_size=None: attacks_lib.fgsm(norm),
    "pgd-ce": _pgd("ce"),
    "pgd-margin": _pgd("margin"),
    "pgd-dlr": _pgd("dlr"),
    "apgd-ce": _apgd("ce"),
    # A second APGD-CE under its own name, so that a cascade can focus it (Schedule.focus).
    "apgd-ce-long": _apgd("ce", name="apgd-ce-long"),
    "apgd-dlr": _apgd("dlr"),
    "apgd-t": _apgd("dlr-targeted"),
    "apgd-t3": _apgd("dlr-targeted", targets=3),
    "apgd-t5": _apgd("dlr-targeted", targets=5),
    # BP as this library runs it (not the authors' loss and steps): a variant, named so.
    "bp-variant": _min_norm(attacks_lib.bp),
    "fmn": _min_norm(attacks_lib.fmn),
    # CW-L2 with 100 Adam steps per stage (a light budget) and with the reference code's
    # (up to 10,000 per stage, abort-early; --steps sets the per-stage maximum).
    "cw-l2-light": _min_norm(attacks_lib.cw, takes_norm=False),
    "cw-l2": lambda norm, steps=None, restarts=None, step_size=None: _l2_only(
        "cw-l2", norm, attacks_lib.cw_reference(max_iterations=steps or 10_000)),
    "deepfool": _min_norm(attacks_lib.deepfool),
    "fab-t": lambda norm, steps=None, restarts=None, step_size=None: attacks_lib.fab(
        norm, steps=steps or 100
    ),
    "spsa": lambda norm, steps=None, restarts=None, step_size=None: attacks_lib.spsa(
        norm, steps=steps or 100
    ),
    # Black-box budgets are queries; --steps does not change them.
    "square": lambda norm, steps=None, restarts=None, step_size=None, queries=5000: (
        attacks_lib.square(norm, queries=queries)
    ),
    # AutoAttack's Square: p_init 0.8 in both norms, the p schedule as written for 10,000.
    "square-aa": lambda norm, steps=None, restarts=None, step_size=None, queries=5000: (
        attacks_lib.square(
            norm, queries=queries, p_init=0.8, rescale_schedule=False, name="square-aa"
        )
    ),
    "rays": lambda norm, steps=None, restarts=None, step_size=None, queries=5000: _rays(
        norm, queries
    ),
    "surfree": lambda norm, steps=None, restarts=None, step_size=None, queries=5000: _surfree(
        norm, queries
    ),
}


def _l2_only(name: str, norm: str, attack: Attack) -> Attack:
    if norm != "l2":
        raise ValueError(f"attack {name!r} works in norm 'l2', not {norm!r}")
    return attack


def _rays(norm: str, queries: int) -> Attack:
    if norm != "linf":
        raise ValueError(f"attack 'rays' works in norm 'linf', not {norm!r}")
    return attacks_lib.rays(steps=queries - 1)  # 1 query at init, 1 per step


def _surfree(norm: str, queries: int) -> Attack:
    if norm != "l2":
        raise ValueError(f"attack 'surfree' works in norm 'l2', not {norm!r}")
    return attacks_lib.surfree(queries=queries)

# The attacks whose budget is model queries (``queries=``, 5,000 by default), not steps.
QUERY_ATTACKS = frozenset({"square", "square-aa", "rays", "surfree"})

# name -> tuple of (attack name, norms it applies to or None for all, overrides)
BUNDLES: dict[str, tuple[tuple[str, tuple[str, ...] | None, dict[str, Any]], ...]] = {
    "standard": (("apgd-ce", None, {}), ("apgd-t", None, {}), ("fmn", None, {})),
    "fast": (("apgd-ce", None, {"steps": 20}), ("apgd-t3", None, {"steps": 20})),
    "pgd": (
        ("fgsm", None, {}),
        ("pgd-ce", None, {"restarts": 3}),
        ("pgd-margin", None, {"restarts": 3}),
    ),
    "default": (
        ("apgd-ce", None, {"steps": 20}),
        ("apgd-ce-long", None, {"steps": 100}),
        ("apgd-t5", None, {"steps": 40}),
        ("square-aa", None, {"queries": 5000}),
    ),
    "broad": (
        ("fgsm", None, {}),
        ("pgd-ce", None, {"restarts": 3}),
        ("pgd-margin", None, {"restarts": 3}),
        ("fmn", None, {}),
        ("square", None, {"queries": 1000}),
        ("rays", ("linf",), {"queries": 1000}),
        ("surfree", ("l2",), {"queries": 1000}),
    ),
    "autoattack": (
        ("apgd-ce", None, {}),
        ("apgd-t", None, {}),
        ("fab-t", None, {}),
        ("square-aa", None, {"queries": 5000}),
    ),
    "black-box": (
        ("square", None, {}),
        ("rays", ("linf",), {}),
        ("surfree", ("l2",), {}),
    ),
    "min-norm": (
        ("fmn", None, {}),
        ("bp-variant", ("l2",), {}),
        ("cw-l2-light", ("l2",), {}),
        ("deepfool", None, {}),
    ),
}


class Schedule(NamedTuple):
    """How a named bundle runs when the user does not choose (see :mod:`jaxbundle.schedule`)."""

    mode: str = "full"  # "full" or "cascade"
    # cascade: attack name -> the fraction of the survivors it runs on, the most promising
    focus: tuple[tuple[str, float], ...] = ()
    segments: int = 1  # cascade: each stage in this many segments, the fooled stopping early


BUNDLE_SCHEDULES: dict[str, Schedule] = {
    "autoattack": Schedule("cascade"),
    "default": Schedule(
        "cascade", (("apgd-ce-long", 0.5), ("apgd-t", 0.5), ("square-aa", 0.08)), segments=6
    ),
}


def bundle_schedule(name: str) -> Schedule:
    """The schedule the bundle ``name`` runs under by default (``full`` if it has none)."""
    return BUNDLE_SCHEDULES.get(name, Schedule())


def attack(
    name: str,
    norm: str = "linf",
    *,
    steps: int | None = None,
    restarts: int | None = None,
    step_size: float | None = None,
    queries: int | None = None,
) -> Attack:
    """Builds the attack called ``name`` (see :data:`ATTACKS`) for the threat norm ``norm``.

    ``queries`` is the model-query budget of a black-box attack of :data:`QUERY_ATTACKS`
    (default 5,000); the other attacks have none and ignore it."""
    norms.check_norm(norm)
    if name not in ATTACKS:
        raise ValueError(f"unknown attack {name!r}; choose from {', '.join(ATTACKS)}")
    options: dict[str, Any] = dict(steps=steps, restarts=restarts, step_size=step_size)
    if name in QUERY_ATTACKS and queries is not None:
        options["queries"] = check_count(name, "queries", queries, minimum=2)
    built = ATTACKS[name](norm, **options)
    if built.norm != norm:
        raise ValueError(f"attack {name!r} works in norm {built.norm!r}, not {norm!r}")
    return built


def bundle_attacks(
    name: str,
    norm: str = "linf",
    *,
    steps: int | None = None,
    restarts: int | None = None,
    step_size: float | None = None,
    queries: int | None = None,
) -> tuple[Attack, ...]:
    """The attacks of the bundle called ``name`` (see :data:`BUNDLES`) for ``norm``.

    ``steps`` and ``restarts`` override every iterative white-box attack's own, ``queries``
    every black-box attack's query budget (the bundle's own otherwise)."""
    norms.check_norm(norm)
    if name not in BUNDLES:
        raise ValueError(f"unknown bundle {name!r}; choose from {', '.join(BUNDLES)}")
    built = []
    for attack_name, only, overrides in BUNDLES[name]:
        if only is not None and norm not in only:
            continue
        kwargs = dict(overrides)
        kwargs.update({k: v for k, v in (("steps", steps), ("restarts", restarts),
                                         ("queries", queries)) if v is not None})
        built.append(attack(attack_name, norm, step_size=step_size, **kwargs))
    if not built:
        raise ValueError(f"bundle {name!r} has no attack for norm {norm!r}")
    return tuple(built)
