"""Tuning-set variants of the ``default`` tried for a third design (2026-12-06: ``esc`` adopted)
and after it (the default's own escalation kept unless a part changes it).

Each variant is the default bundle with one change, run by ``run.py``'s machinery on the tuning
set of ``PROTOCOL.md`` (goal misclassify, n = 256, seed 0, no warm rounds), its rows appended to
``--out`` with per-example verdicts. A variant name is ``+``-joined parts:

* ``base``: the default as it is;
* the L2 FAB stage (``fab-t3``: 3 targets x 50 steps, one pass per step) replaced by
  ``fresh`` (3 x 50, the reference's order: a fresh gradient after a step back), ``t5`` /
  ``t9`` (5 / 9 targets x 50, one pass), ``t9l`` (9 x 100, one pass) or ``aafab``
  (AutoAttack's FAB-T: 9 x 100, the reference's order);
* ``cap``: a focused stage runs on the focus fraction of the *batch* when more survivors than
  that are left, else on all survivors (:func:`capped`, patched into ``jaxbundle.schedule``);
* ``nofocus``: the white-box stages (``apgd-ce-long``, ``apgd-t5``) on every survivor;
  ``ceall`` / ``tall``: only ``apgd-ce-long`` / only ``apgd-t5`` on every survivor (tried on
  the tuning ResNet, ``resnet-tune``, for a fourth design); ``apgdt9`` / ``apgdt100``: the
  APGD-T stage with 9 targets x 40 steps / 5 targets x 100 instead of 5 x 40;
* ``floorS``: the white-box stages' focus keeps every survivor while they are at most ``S`` of
  the batch, never fewer than ``S`` of it (the plan's ``floor``);
* ``malt``: the APGD-T stage's 5 targets in MALT's order (``apgd-t5-malt``: nearest
  linearised boundary of the 9 highest logits first; Melamed et al. 2024) instead of the
  logits';
* ``sqF``: Square's focus after its probe ``F`` instead of 0.06; ``sqpP``: its probe ``P`` of
  its queries instead of 0.05;
* ``wbcap``: ``cap`` for the white-box (APGD) stages only: while a stage's survivors are no
  more than its focus fraction of the batch, all of them run it (:func:`white_box_capped`);
* ``esc``: AutoAttack's FAB-T (9 x 100, the reference's order) after ``fab-t3``, run only
  when ``fab-t3`` fooled 5 % or more of the examples it ran on (``Plan.escalate``);
* ``probeF,P``: the FAB stage probed like Square (its first ``P`` of steps on every survivor,
  then ``F`` of them, more when the probe fooled some).

    python benchmarks/heldout/tuning_v3.py aafab --models adversarial --norms l2 --eps 1.5 \\
        --aa-cache benchmarks/results/heldout/aa --out benchmarks/results/heldout/tuning-v3.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import run  # noqa: E402

from jaxbundle import attacks as attacks_lib  # noqa: E402
from jaxbundle import bundles, schedule, suites  # noqa: E402
from jaxbundle.plan import AttackSpec  # noqa: E402

FABS = {"fresh": ("fab-t3f", 3, 50, True), "t5": ("fab-t5", 5, 50, False),
        "t9": ("fab-t9", 9, 50, False), "t9l": ("fab-t9l", 9, 100, False)}
_FOCUS_SIZE = schedule._focus_size


def _register_fab(name: str, targets: int, steps: int, fresh: bool) -> None:
    """A FAB-T of ``targets`` x ``steps`` under ``name`` (the plan's overrides ignored)."""
    suites.ATTACKS[name] = suites.NamedAttack(
        name, lambda norm: attacks_lib.fab(norm, steps=steps, targets=targets,
                                           fresh_gradient=fresh, name=name),
        (), ("linf", "l2"), "fab")


def capped(ladders, fraction: float, survivors: int) -> int:
    """Focus as a cap: ``fraction`` of the batch (rounded as the schedule rounds), all
    survivors when fewer, never fewer than the schedule's own rule keeps."""
    sizes, halves = ladders
    cap = schedule._bucket(halves, schedule._nearest_bucket(sizes, fraction * max(sizes)))
    return min(survivors, max(_FOCUS_SIZE(ladders, fraction, survivors), cap))


_STAGE_ROWS = schedule._stage_rows


def white_box_capped(b, attack, order, closeness, fraction, left, spent):
    """``schedule._stage_rows`` with an APGD stage's focus dropped while its survivors are at
    most ``fraction`` of the batch (so it never costs more than at a high robust accuracy)."""
    if fraction is not None and attack.name.startswith("apgd") and (
            order.size <= _FOCUS_SIZE((b.sizes, b.halves), fraction, max(b.sizes))):
        fraction = None
    return _STAGE_ROWS(b, attack, order, closeness, fraction, left, spent)


def variant(name: str) -> str:
    """Registers the variant ``name`` as a bundle; returns the bundle's name."""
    parts = name.split("+")
    b = bundles.BUNDLES["default"]
    fab = "fab-t" if "aafab" in parts else None
    for part in parts:
        if part in FABS:
            _register_fab(*FABS[part])
            fab = FABS[part][0]
    attacks = tuple((AttackSpec(fab, steps=100) if fab and s.name == "fab-t3" else s, only)
                    for s, only in b.attacks)
    focus, probe = dict(b.schedule.focus), dict(b.schedule.probe)
    floor = dict(b.schedule.floor)
    for part, spec in (("apgdt9", AttackSpec("apgd-t", steps=40)),
                       ("apgdt100", AttackSpec("apgd-t5", steps=100)),
                       ("malt", AttackSpec("apgd-t5-malt", steps=40))):
        if part in parts:  # the APGD-T stage: 9 targets x 40 steps, 5 targets x 100, or its
            # 5 targets in MALT's order
            attacks = tuple((spec if s.name == "apgd-t5" else s, only) for s, only in attacks)
            focus[spec.name] = focus.pop("apgd-t5")
            if "apgd-t5" in floor:
                floor[spec.name] = floor.pop("apgd-t5")
    for part in parts:  # sqF: Square's focus F after its probe (the default's 0.06); sqpP:
        if part.startswith("sqp"):  # its probe P of its queries (the default's 0.05)
            probe["square-aa"] = float(part[len("sqp"):])
        elif part.startswith("sq"):
            focus["square-aa"] = float(part[len("sq"):])
    for part in parts:
        if part.startswith("probe"):
            share, steps = part[len("probe"):].split(",")
            focus[fab], probe[fab] = float(share), float(steps)
    for part, stages in (("nofocus", ("apgd-ce-long", "apgd-t5")), ("ceall", ("apgd-ce-long",)),
                         ("tall", ("apgd-t5",))):
        if part in parts:
            for stage in stages:
                focus.pop(stage)
    for part in parts:  # floorS: the white-box stages' focus never under S of the batch
        if part.startswith("floor"):
            floor = {stage: float(part[len("floor"):]) for stage in ("apgd-ce-long", "apgd-t5")
                     if stage in focus}
    escalate = dict(b.schedule.escalate)
    names = [s.name for s, _ in attacks]
    if "esc" in parts and "fab-t" not in names:  # AutoAttack's FAB-T after fab-t3, run when
        at = names.index("fab-t3") + 1  # fab-t3 fooled 5 % or more (the third design has it)
        attacks = attacks[:at] + ((AttackSpec("fab-t", steps=100), ("l2",)),) + attacks[at:]
        escalate["fab-t"] = 0.05
    if "cap" in parts:
        schedule._focus_size = capped
    if "wbcap" in parts:
        schedule._stage_rows = white_box_capped
    bundles.BUNDLES[f"variant-{name}"] = b._replace(
        attacks=attacks, schedule=dataclasses.replace(
            b.schedule, focus=tuple(focus.items()), probe=tuple(probe.items()),
            floor=tuple((k, v) for k, v in floor.items() if k in focus),
            escalate=tuple(escalate.items())))
    return f"variant-{name}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant")
    parser.add_argument("--models", default="adversarial")
    parser.add_argument("--norms", default="l2")
    parser.add_argument("--eps", default=None)
    parser.add_argument("--aa-cache", required=True, metavar="DIR")
    parser.add_argument("--out", required=True, metavar="JSONL")
    parser.add_argument("--judging", choices=("auto", "float"), default="auto")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    args.set, args.n, args.rounds, args.seed = "tuning", 256, 0, 0
    run.run(args, [(variant(args.variant), {})], lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
