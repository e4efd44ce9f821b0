"""Named attacks (``jaxbundle.suites``), named bundles (``jaxbundle.bundles``) and the
catalogue."""

from __future__ import annotations

import pytest

from jaxbundle import Plan, Threat, attacks, bundles, suites
from jaxbundle.schedule import probe_steps


@pytest.mark.parametrize("name", sorted(suites.ATTACKS))
def test_every_named_attack_builds_exactly_for_the_norms_its_record_lists(name):
    """A record's norms are those its factory builds: each listed norm builds (one kind and
    goal in all of them), each other is refused by the record, and the factory either refuses
    it too or has no norm argument and builds its own norm."""
    record = suites.ATTACKS[name]
    assert record.name == name and record.paper and record.family in suites.PAPERS
    assert record.paper.startswith(record.citation) and record.citation[-4:].isdigit()
    assert set(record.options) <= set(suites.OPTIONS)
    kinds = set()
    for norm in ("linf", "l2", "l1"):
        if norm in record.norms:
            a = suites.attack(name, norm)
            assert isinstance(a, attacks.Attack) and a.norm == norm
            kinds.add((a.kind, a.goal))
        else:
            with pytest.raises(ValueError, match=f"'{norm}'"):
                suites.attack(name, norm)
            try:
                assert record.build(norm).norm in record.norms
            except ValueError as e:
                assert f"'{norm}'" in str(e)
    assert kinds == {(record.made().kind, record.made().goal)}


@pytest.mark.parametrize("name", sorted(suites.ATTACKS))
def test_a_record_takes_exactly_the_overrides_it_lists(name):
    """Each override a record lists changes the attack; each other leaves it as it is."""
    record = suites.ATTACKS[name]
    norm = record.norms[0]
    own = suites.attack(name, norm)
    for option, value in (("steps", 7), ("restarts", 3), ("step_size", 0.01),
                          ("queries", 77)):
        changed = suites.attack(name, norm, **{option: value})
        assert (changed != own) == (option in record.options), option
    assert (name in suites.QUERY_ATTACKS) == ("queries" in record.options)


def test_min_norm_attacks_feed_the_min_norm_goal():
    for name in ("bp-variant", "cw-l2-light", "cw-l2", "fmn", "deepfool"):
        assert suites.attack(name, "l2").goal == "min_norm"
    # The light CW budget and the BP variant are reported as such, apart from the reference CW.
    for name in ("bp-variant", "cw-l2-light", "cw-l2"):
        assert suites.attack(name, "l2").name == name
    assert suites.attack("cw-l2", "l2").num_steps == 9 * 10_000
    for name in ("fgsm", "pgd-ce", "apgd-ce", "apgd-t"):
        assert suites.attack(name, "linf").goal == "misclassify"


@pytest.mark.parametrize("name", sorted(suites.ATTACKS))
def test_an_attack_built_by_name_carries_that_name(name):
    """One vocabulary: the name asked for is the name reported (``apgd-t5``, not ``apgd-t``)."""
    norms = suites.ATTACKS[name].norms
    assert norms
    for norm in norms:
        assert suites.attack(name, norm).name == name


def test_standard_bundle_contains_autoattacks_white_box_part():
    standard = {a.name: a for a in bundles.bundle_attacks("standard", "linf")}
    assert standard["apgd-ce"].config.loss == "ce" and standard["apgd-ce"].num_steps == 100
    t = standard["apgd-t"]
    assert t.config.loss == "dlr-targeted" and t.num_restarts == 9 and t.num_steps == 100
    assert "fmn" in standard
    fast = bundles.bundle_attacks("fast", "l2")
    assert sum(a.gradients for a in fast) < sum(a.gradients for a in standard.values()) / 5


def test_overrides_and_norm_specific_members():
    pgd = bundles.bundle_attacks("pgd", "linf", steps=7, restarts=2)
    assert [a.name for a in pgd] == ["fgsm", "pgd-ce", "pgd-margin"]
    assert all(a.num_steps == 7 and a.num_restarts == 2 for a in pgd[1:])
    assert bundles.bundle_attacks("pgd", "linf")[1].num_restarts == 3
    linf = [a.name for a in bundles.bundle_attacks("min-norm", "linf")]
    l2 = [a.name for a in bundles.bundle_attacks("min-norm", "l2")]
    assert "bp-variant" not in linf and "cw-l2-light" not in linf
    assert {"bp-variant", "cw-l2-light", "fmn"} <= set(l2)


def test_unknown_names_and_wrong_norms_are_clear_errors():
    with pytest.raises(ValueError, match="unknown attack 'cw'"):
        suites.attack("cw")
    with pytest.raises(ValueError, match="unknown bundle 'strong'"):
        bundles.bundle_attacks("strong")
    with pytest.raises(ValueError, match="unknown bundle 'strong'"):
        bundles.plan("strong", "linf", 0.3)
    with pytest.raises(ValueError, match="bundle 'fast' needs the threat model's eps"):
        bundles.plan("fast", "linf")
    with pytest.raises(ValueError, match="cw-l2.*'l2', not 'linf'"):
        suites.attack("cw-l2", "linf")
    with pytest.raises(ValueError, match="unknown norm"):
        suites.attack("fgsm", "l3")


def test_every_factory_has_a_paper_and_a_named_attack():
    assert set(suites.PAPERS) == {r.family for r in suites.ATTACKS.values()}
    assert all(callable(getattr(attacks, family)) for family in suites.PAPERS)
    assert all(r.made().kind in attacks.base.KINDS for r in suites.ATTACKS.values())


def test_autoattack_bundle_has_autoattacks_original_parameters():
    """AutoAttack's standard version: APGD-CE 100, APGD-T 9 x 100, FAB-T 9 x 100, Square 5,000
    queries with p_init 0.8 and the schedule not rescaled; run as a survivors-only cascade."""
    for norm in ("linf", "l2"):
        aa = {a.name: a for a in bundles.bundle_attacks("autoattack", norm)}
        assert list(aa) == ["apgd-ce", "apgd-t", "fab-t", "square-aa"]
        assert aa["apgd-ce"].num_steps == 100 and aa["apgd-ce"].num_restarts == 1
        assert aa["apgd-t"].num_restarts == 9 and aa["apgd-t"].num_steps == 100
        fab = aa["fab-t"]
        assert fab.num_restarts == 9 and fab.num_steps == 100 and fab.goal == "min_norm"
        assert fab.config.fresh  # the reference's order of checking and stepping back
        sq = aa["square-aa"]
        assert sq.queries == 5000 and sq.config.p_init == 0.8
        assert sq.config.rescale_schedule is False
    assert bundles.BUNDLES["autoattack"].schedule == bundles.Cascade(buckets=8)
    plan = bundles.autoattack("linf", 0.3)
    assert plan.schedule == bundles.Cascade(buckets=8) and plan.suite.bundle == "autoattack"


def test_default_bundle_is_a_focused_cascade_within_its_stated_share_of_autoattacks_budget():
    """The main job's default: APGD-CE 20; APGD-CE 100 and APGD-T 5 x 40 on the more promising
    half of the survivors; in L2, FAB-T 3 x 50 on every survivor, then AutoAttack's FAB-T only
    when that one fooled 5 % of them (escalate); AutoAttack's Square probed for 250 queries on
    every survivor, then on 6 % of them; stages in 6 segments. On an example no attack fools
    (nothing escalated, the probe fooling none) it spends under a tenth of what AutoAttack
    spends in Linf, and under 0.14 in L2, where FAB-T costs more (model passes: a gradient is a
    forward and a backward)."""
    for norm, share in (("linf", 0.1), ("l2", 0.14)):
        d = {a.name: a for a in bundles.bundle_attacks("default", norm)}
        fab = ["fab-t3", "fab-t"] if norm == "l2" else []
        assert list(d) == ["apgd-ce", "apgd-ce-long", "apgd-t5", *fab, "square-aa"]
        assert d["apgd-ce"].num_steps == 20 and d["apgd-ce-long"].num_steps == 100
        assert d["apgd-ce-long"].config.loss == "ce" and d["apgd-t5"].num_restarts == 5
        assert d["apgd-t5"].config.loss == "dlr-targeted"
        assert d["apgd-t5"].num_steps == 40 and d["square-aa"].kind == "score-based"
        if fab:
            assert d["fab-t3"].num_steps == 50 and d["fab-t3"].num_restarts == 3
            assert d["fab-t"].num_steps == 100 and d["fab-t"].num_restarts == 9
            assert d["fab-t"].config.fresh
        plan = bundles.default(norm, 0.3)
        focus, probe = plan.schedule.focus_map, plan.schedule.probe_map
        assert plan.schedule.escalate_map == ({"fab-t": 0.05} if fab else {})
        assert focus == {"apgd-ce-long": 0.5, "apgd-t5": 0.5, "square-aa": 0.06}
        assert probe == {"square-aa": 0.05}
        aa = bundles.bundle_attacks("autoattack", norm)
        assert set(focus) <= set(d)

        def passes(attack):
            return 2 * attack.gradients + attack.queries

        def spent(a):  # the probe on every survivor, then the focus share the rest
            if a.name in probe:
                ran = probe_steps(a, probe[a.name])
                return ran + focus[a.name] * (passes(a) - ran)
            if a.name in plan.schedule.escalate_map:
                return 0.0  # held back: the stage before it fooled nothing
            return passes(a) * focus.get(a.name, 1.0)

        mine = sum(spent(a) for a in d.values())
        assert mine < share * sum(passes(a) for a in aa)
    default = bundles.default("linf", 0.3)
    assert (default.schedule.mode, default.schedule.segments, default.suite.bundle) == (
        "cascade", 6, "default")
    assert bundles.BUNDLES["default"].schedule.segments == 6
    assert bundles.pgd("linf", 0.3).schedule == bundles.Full()
    assert "fmn" in {a.name for a in bundles.bundle_attacks("broad", "linf")}


def test_a_bundle_is_a_plan_whose_fields_can_be_changed():
    """``bundles.plan(name, norm, eps, **fields)`` is the bundle's checked plan with ``fields``
    changed; its attacks are the ones ``bundle_attacks`` builds, and a bad field is refused."""
    plan = bundles.plan("pgd", "linf", 0.3, steps=7, seed=2)
    assert isinstance(plan, Plan) and plan.threat == Threat(0.3, "linf") and plan.run.seed == 2
    assert plan.attack_values() == bundles.bundle_attacks("pgd", "linf", steps=7)
    assert bundles.fast("l2", 0.5) == bundles.plan("fast", "l2", 0.5)
    assert [a.name for a in bundles.broad("l2", 0.5).attack_values()] == [
        "fgsm", "pgd-ce", "pgd-margin", "fmn", "square", "surfree"]
    with pytest.raises(ValueError, match="focus is a cascade setting"):
        bundles.pgd("linf", 0.3, focus={"fgsm": 0.5})
    with pytest.raises(ValueError, match="segments must be a positive integer, got 0"):
        bundles.default("linf", 0.3, segments=0)
