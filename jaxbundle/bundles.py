"""Named bundles, each an evaluation plan (:class:`jaxbundle.Plan`) with its own schedule.

``plan(name, norm, eps, **fields)`` (or the function of that name: ``default(norm, eps)``,
``autoattack(norm, eps)``, ``black_box(norm, eps)``, ...) returns the bundle's plan; any field
of it can be changed there or later with :meth:`Plan.replace`; ``mode="full"`` on a cascade
bundle drops its own cascade settings. ``jaxbundle evaluate --bundle NAME`` runs exactly the
plan ``plan(NAME, norm, eps)`` with the flags given applied to it (``--schedule S``:
``plan(NAME, norm, eps, mode=S)``).

``standard``
    At least AutoAttack's white-box part (Croce & Hein 2020): APGD-CE (100 steps) and APGD-T
    (targeted DLR, 9 target classes x 100 steps), plus FMN (100 steps), a minimum-norm attack
    whose candidates within eps count too and which gives every example a distortion.
``fast``
    A quick look: APGD-CE and APGD-T with 3 targets (``apgd-t3``), 20 steps each.
``pgd``
    The walking skeleton's bundle: FGSM, and PGD-40 with the CE and the margin loss, 3
    random restarts each.
``default``
    The main job's, strongest for its cost, run as a cascade, each stage on the survivors of the
    ones before: APGD-CE (20 steps) on every example; APGD-CE again with 100 steps
    (``apgd-ce-long``) and APGD-T (``apgd-t5``: 5 targets x 40 steps), each on the more promising
    half of the survivors (rounded as :mod:`jaxbundle.run.cascade` says), and on every survivor
    while they are at most 1/8 of the batch (the plan's ``floor``: where few survive, halving them
    saves little; tuning set: benchmarks/README.md); in L2, FAB-T with 3
    targets x 50 steps (``fab-t3``) on every survivor (on the tuning set, AutoAttack's FAB-T fooled
    most of what the APGD stages missed in L2), and when it fools 5 % or more of them (gradients
    that mislead APGD on this model) AutoAttack's FAB-T (``fab-t``: 9 targets x 100, the reference's
    order) on the survivors left (the plan's ``escalate``; on the tuning set's Linf-trained CNN only
    that full FAB-T found what AutoAttack's does); then AutoAttack's Square (``square-aa``: 5,000
    queries, p_init 0.8), the score-based check against gradient masking: its first 5 % (250
    queries) on every survivor (the plan's ``probe``), then on 6 % of them, half the most promising
    under the earlier stages and half those Square itself brought furthest, and on more when the
    probe fools survivors (up to all: :data:`jaxbundle.run.cascade.PROBE_GAIN`); 12.5 % where the
    FAB-T escalation ran (the plan's ``widen``: on the tuning set's Linf-trained CNN in L2 the
    examples only AutoAttack's Square fooled fell from 7 to 2). Each stage runs in
    6 segments, and an example fooled in one stops there. How it compares with AutoAttack:
    benchmarks/README.md.
``broad``
    A many-attack table (run in full): the ``pgd`` bundle, FMN (100 steps, white-box minimum
    norm), Square (1,000 queries) and a decision-based minimum-norm attack with 1,000 queries
    (RayS in Linf, SurFree in L2), so that the report has white-box and black-box robust
    accuracy per attack, P(D) curves per kind and D1/2.
``black-box``
    Square, and RayS (Linf) or SurFree (L2), with 5,000 queries each.
``autoattack``
    AutoAttack's standard version (Croce & Hein 2020) with its original parameters: APGD-CE
    (100 steps), APGD-T (9 targets x 100), FAB-T (9 targets x 100) and Square (5,000 queries,
    p_init 0.8, the schedule not rescaled), run as AutoAttack runs it, each attack only on the
    examples the earlier ones did not fool (a cascade), and APGD-T's and FAB-T's targets one
    after another, each on the examples the targets before did not fool (``restart_mode=
    "cascade"``; run in full, every target on every example); the survivors compacted into 8
    bucket sizes per halving of the batch (``buckets=8``: under 1/9 of a bucket padding, as
    AutoAttack pads none).
``min-norm``
    The white-box minimum-norm attacks for the success-vs-distortion curve (L2: FMN, BP, CW,
    DeepFool; Linf: FMN, DeepFool).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from jaxbundle.core import norms
from jaxbundle import suites
from jaxbundle.attacks.base import Attack
from jaxbundle.plan import PAIRS, AttackSpec, Cascade, Full, Plan, Run, Suite, Threat

__all__ = ["BUNDLES", "Bundle", "autoattack", "black_box", "broad", "bundle_attacks", "default",
           "fast", "min_norm", "pgd", "plan", "standard"]


class Bundle(NamedTuple):
    """A named bundle: its attacks (each with the norms the bundle runs it in, None: every
    norm the attack works in, :data:`jaxbundle.suites.ATTACKS`), the schedule it runs under
    and how a stage runs an attack's restarts (``"cascade"``: in a cascade, each restart on what
    the others left)."""

    attacks: tuple[tuple[AttackSpec, tuple[str, ...] | None], ...]
    schedule: Full | Cascade = Full()
    restart_mode: str = "vmap"


def _a(name: str, only: tuple[str, ...] | None = None, **budget: int):
    return AttackSpec(name, **budget), only


BUNDLES: dict[str, Bundle] = {
    "standard": Bundle((_a("apgd-ce"), _a("apgd-t"), _a("fmn"))),
    "fast": Bundle((_a("apgd-ce", steps=20), _a("apgd-t3", steps=20))),
    "pgd": Bundle((_a("fgsm"), _a("pgd-ce", restarts=3), _a("pgd-margin", restarts=3))),
    "default": Bundle(
        (_a("apgd-ce", steps=20), _a("apgd-ce-long", steps=100), _a("apgd-t5", steps=40),
         _a("fab-t3", ("l2",), steps=50), _a("fab-t", ("l2",), steps=100),
         _a("square-aa", queries=5000)),
        Cascade(focus=(("apgd-ce-long", 0.5), ("apgd-t5", 0.5), ("square-aa", 0.06)),
                floor=(("apgd-ce-long", 0.125), ("apgd-t5", 0.125)), segments=6,
                probe=(("square-aa", 0.05),), escalate=(("fab-t", 0.05),),
                widen=(("square-aa", 0.125),)),
    ),
    "broad": Bundle((
        _a("fgsm"), _a("pgd-ce", restarts=3), _a("pgd-margin", restarts=3), _a("fmn"),
        _a("square", queries=1000), _a("rays", queries=1000), _a("surfree", queries=1000),
    )),
    "autoattack": Bundle(
        (_a("apgd-ce"), _a("apgd-t"), _a("fab-t"), _a("square-aa", queries=5000)),
        Cascade(buckets=8), restart_mode="cascade",
    ),
    "black-box": Bundle((_a("square"), _a("rays"), _a("surfree"))),
    "min-norm": Bundle((_a("fmn"), _a("bp-variant"), _a("cw-l2-light"), _a("deepfool"))),
}


def plan(name: str, norm: str = "linf", eps: float | None = None, **fields: Any) -> Plan:
    """The plan of the bundle ``name`` for ``norm`` at radius ``eps``, with ``fields`` (any of
    :class:`jaxbundle.Plan`'s) changed; checked."""
    norms.check_norm(norm)
    if name not in BUNDLES:
        raise ValueError(f"unknown bundle {name!r}; choose from {', '.join(BUNDLES)}")
    if eps is None:
        raise ValueError(f"bundle {name!r} needs the threat model's eps")
    b = BUNDLES[name]
    attacks = tuple(spec for spec, only in b.attacks
                    if norm in (only or suites.ATTACKS[spec.name].norms))
    # Run in full, a cascade bundle keeps none of its own cascade settings (focus, floor, probe,
    # escalate, widen, segments, buckets, cascade of restarts): every attack, restarts at once, on
    # every example. Settings of an attack the norm leaves out go with it.
    mode = fields.pop("mode", b.schedule.mode)
    schedule, restart_mode = Full(), "vmap"
    if mode == "cascade":
        own = b.schedule if isinstance(b.schedule, Cascade) else Cascade()
        names = [spec.name for spec in attacks]
        kept = {f: tuple((n, v) for n, v in getattr(own, f) if n in names)
                for f in PAIRS}
        # A widened focus needs an escalated stage before it: in a norm without one (Linf has
        # no FAB-T stages) it goes too.
        kept["widen"] = tuple((n, v) for n, v in kept["widen"] if any(
            names.index(e) < names.index(n) for e, _ in kept["escalate"]))
        schedule, restart_mode = dataclasses.replace(own, **kept), b.restart_mode
    base = Plan(Threat(eps, norm), Suite(attacks, bundle=name), schedule,
                Run(restart_mode=restart_mode))
    return base.replace(mode=mode, **fields).check()


def bundle_attacks(name: str, norm: str = "linf", **overrides: Any) -> tuple[Attack, ...]:
    """The attacks of the bundle ``name`` for ``norm``, built (``overrides``: ``steps``,
    ``restarts``, ``step_size``, ``queries``, as in :class:`jaxbundle.Plan`)."""
    return plan(name, norm, 0.0, **overrides).attack_values()


def _named(name: str):
    def make(norm: str = "linf", eps: float | None = None, **fields: Any) -> Plan:
        return plan(name, norm, eps, **fields)

    make.__name__ = make.__qualname__ = name.replace("-", "_")
    make.__doc__ = f"The plan of the ``{name}`` bundle: ``plan({name!r}, norm, eps, **fields)``."
    return make


standard, fast, pgd, default = (_named(n) for n in ("standard", "fast", "pgd", "default"))
broad, autoattack = _named("broad"), _named("autoattack")
black_box, min_norm = _named("black-box"), _named("min-norm")
