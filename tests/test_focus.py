"""A cascade's focus: the most promising survivors, rounded to the bucket ladder, bounded below by
the floor where few survive, chosen after a probe by the stage's own progress; clear errors."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbundle import attacks as attacks_lib
from jaxbundle import goals as goals_lib
from jaxbundle import Plan
from jaxbundle.bundler import (Driver, Rules, bundle, goals_for, judge_stage, start_stage,
                               step_stage)
from jaxbundle.schedule import (PROBE_GAIN, _after_probe, _focus_size,
                                _nearest_bucket, bucket_sizes)
from cascade_toys import KEY
from cascade_toys import evaluate_toy as _evaluate
from cascade_toys import problem as _problem
from cascade_toys import run_cascade as _cascade
from toys import linear_apply


def test_focus_rounds_to_the_nearest_bucket():
    sizes = bucket_sizes(256)
    assert [_nearest_bucket(sizes, r) for r in (104, 16.5, 6.8, 0.3, 256, 1000)] == [
        96, 16, 6, 1, 256, 256]
    # Focus keeps the nearest, rounded up to a halving of the batch (at most the survivors).
    ladders = (sizes, bucket_sizes(256, per_halving=1))
    assert [_focus_size(ladders, 0.5, s) for s in (208, 180, 120, 33, 13, 1)] == [
        128, 128, 64, 16, 8, 1]


def test_a_floor_keeps_every_survivor_while_few_survive():
    """``floor`` (a share of the batch): focus keeps every survivor while they are at most that
    share, and never fewer than the halving of the batch that holds it (1/8 of 256: 32)."""
    sizes = bucket_sizes(256)
    ladders = (sizes, bucket_sizes(256, per_halving=1))
    assert [_focus_size(ladders, 0.5, s, 0.125) for s in (208, 120, 40, 33, 32, 13, 1)] == [
        128, 64, 32, 32, 32, 13, 1]
    assert [_focus_size(ladders, 0.5, s, 0.13) for s in (120, 40, 33)] == [64, 40, 33]


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 512), per_halving=st.integers(1, 8), fraction=st.floats(0.01, 1),
       floor=st.floats(0.01, 1), data=st.data())
def test_a_floor_only_ever_adds_survivors(batch, per_halving, fraction, floor, data):
    """Property: with a floor, focus keeps at most every survivor, every survivor while they
    are at most ``floor * batch``, never fewer than ``floor * batch`` (or all) nor than focus
    alone, and more survivors never make it keep fewer."""
    ladders = (bucket_sizes(batch, 1, per_halving), bucket_sizes(batch, per_halving=1))
    survivors = data.draw(st.integers(1, batch))
    keep = _focus_size(ladders, fraction, survivors, floor)
    assert keep <= survivors
    assert keep >= min(survivors, floor * batch) and keep >= _focus_size(ladders, fraction,
                                                                        survivors)
    if survivors <= floor * batch:
        assert keep == survivors
    if survivors < batch:
        assert _focus_size(ladders, fraction, survivors + 1, floor) >= keep


def test_focus_spends_a_stage_on_the_most_promising_survivors_only():
    """With focus, attack k runs on the f * survivors survivors of largest margin under the
    earlier stages' bests (rounded to the nearest bucket size, then up to a halving of the
    batch), with the same per-example
    result as in the full bundle."""
    params, x, y, eps = _problem(n=48, seed=3)  # pgd fools 17 that fgsm does not
    atts = (attacks_lib.fgsm(), attacks_lib.pgd(steps=5, restarts=2).rename("pgd"))
    goals = goals_for(("misclassify",), atts)
    ids = jnp.arange(len(y), dtype=jnp.int32)
    kw = dict(norm="linf", goal_names=goals)
    full = bundle(atts, linear_apply, params, x, y, KEY, eps=eps, norm="linf", goals=goals,
                  example_id=ids)
    first, _ = _cascade(atts[:1], params, x, y, ids, eps, **kw)
    margin = np.asarray(first.best["misclassify"].score.margin)
    survivors = np.flatnonzero(~np.asarray(
        goals_lib.success("misclassify", first.best["misclassify"].score, eps)))
    # 0.2 * 43 = 8.6 survivors -> 9 of the buckets of 48 (48, 36, 24, 18, 12, 9, 6, ...): the
    # nearest in ratio (9 / 8.6 = 1.05 against 8.6 / 6 = 1.43), rounded up to a halving of the
    # batch (48, 24, 12, 6, ...): 12.
    assert survivors.size == 43
    keep = 12
    res, stages = _cascade(atts, params, x, y, ids, eps, focus={"pgd": 0.2},
                          **kw)
    assert stages[1].examples == keep
    # Which ran: the survivors only, and none that ran is further from the boundary (a smaller
    # margin under fgsm's best) than one that did not.
    ran = np.asarray(res.attack_step[1]) != -2
    assert ran.sum() == keep and set(np.flatnonzero(ran)) <= set(survivors)
    skipped = np.setdiff1d(survivors, np.flatnonzero(ran))
    assert margin[ran].min() >= margin[skipped].max()
    np.testing.assert_array_equal(np.asarray(res.attack_success[1])[ran],
                                  np.asarray(full.attack_success[1])[ran])
    assert not np.asarray(res.attack_success[1])[~ran].any()
    np.testing.assert_array_equal(np.asarray(res.gradients)[ran], atts[0].gradients
                                  + atts[1].gradients)
    # What the focused cascade fools, the full bundle fools (discarding only loses).
    fooled = np.asarray(goals_lib.success("misclassify", res.best["misclassify"].score, eps))
    fooled_full = np.asarray(goals_lib.success("misclassify", full.best["misclassify"].score, eps))
    assert not (fooled & ~fooled_full).any()
    gained = fooled.sum() - (len(y) - survivors.size)
    assert 0 < gained <= keep < fooled_full.sum() - (len(y) - survivors.size)
    # A floor of half the batch (24 rows): the 24 most promising survivors run; one of the
    # whole batch: every survivor, as without focus.
    for floor, rows in ((0.5, 24), (1.0, survivors.size)):
        res, stages = _cascade(atts, params, x, y, ids, eps, focus={"pgd": 0.2},
                               floor={"pgd": floor}, **kw)
        ran = np.asarray(res.attack_step[1]) != -2
        assert stages[1].examples == ran.sum() == rows
        assert margin[ran].min() >= margin[np.setdiff1d(survivors, np.flatnonzero(ran))].max(
            initial=-np.inf)


def test_a_probe_ranks_survivors_by_the_stage_s_own_progress():
    """With a probe, every survivor runs the stage's first ``probe`` steps; then a share of the
    survivors goes on (the focus fraction plus PROBE_GAIN times the fraction the probe fooled,
    to the nearest bucket): half of them the closest to the goal under the earlier stages, the
    rest those with the most progress of the stage's own (the fraction of the clean margin its
    best closed, computed here from a separate run of the probe's steps alone). The others are
    charged the probe's queries."""
    params, x, y, eps = _problem(n=48, seed=3)
    probe, queries = 5, 21  # Square: 1 query at init, 1 per step
    square = lambda q: attacks_lib.square("linf", queries=q, p_init=0.8,  # noqa: E731
                                          rescale_schedule=False, name="sq")
    atts = (attacks_lib.fgsm(), square(queries))
    goals = goals_for(("misclassify",), atts)
    ids = jnp.arange(len(y), dtype=jnp.int32)
    res, stages = _cascade(atts, params, x, y, ids, eps, goal_names=goals,
                           focus={"sq": 0.1}, probe={"sq": probe / (queries - 1)})
    first, _ = _cascade(atts[:1], params, x, y, ids, eps, goal_names=goals)
    survivors = np.flatnonzero(~np.asarray(first.best["misclassify"].score.misclassified))
    margin = np.asarray(first.best["misclassify"].score.margin)
    # The probe alone: the same Square, the same keys (index 1), stopped after `probe` steps
    # (no rescaled schedule, so its first steps are the long run's).
    driver = Driver(square(probe + 1), 1, Rules(linear_apply, goals, "linf"))
    eps_b = jnp.full(y.shape, eps, jnp.float32)
    running = start_stage(params, x, y, KEY, ids, eps_b, driver=driver)
    steps = driver.attack.num_steps
    running = step_stage(params, running, x, y, eps_b, 0, steps, driver=driver)
    short = judge_stage(params, running, x, y, eps_b, steps, True, driver=driver)
    own = np.asarray(short.best["misclassify"].score.margin)
    start = np.asarray(running.clean.score.margin)
    progress = (own - start) / np.abs(start)
    fooled_in_probe = np.asarray(short.best["misclassify"].score.misclassified)
    left = np.setdiff1d(survivors, np.flatnonzero(fooled_in_probe))
    share = 0.1 + PROBE_GAIN * (survivors.size - left.size) / survivors.size
    assert survivors.size == 43 and stages[1].examples == 43 and 0 < share < 1
    nearest = _nearest_bucket(bucket_sizes(48), share * survivors.size)
    keep = min(min(h for h in (48, 24, 12, 6, 3, 2, 1) if h >= nearest), left.size)
    closest = left[np.argsort(-margin[left], kind="stable")[:(keep + 1) // 2]]
    others = np.setdiff1d(left, closest)
    expected = np.sort(np.concatenate([
        closest, others[np.argsort(-progress[others], kind="stable")[:keep - closest.size]]]))
    charged = np.asarray(res.queries)
    went_on = np.flatnonzero(charged > 1 + probe)
    np.testing.assert_array_equal(went_on, expected)
    assert stages[1].cut == left.size - keep
    # Every survivor ran the probe and was charged for it; the others were not attacked.
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(res.attack_step[1]) != -2),
                                  survivors)
    assert (charged[survivors] >= 1 + probe).all()
    assert set(np.flatnonzero(charged == 1 + probe)) == set(left) - set(expected)
    # Neither ranking alone would have chosen these.
    for ranking in (margin, progress):
        alone = np.sort(left[np.argsort(-ranking[left], kind="stable")[:keep]])
        assert not np.array_equal(alone, expected)


def test_after_a_probe_that_fools_survivors_more_of_the_stage_goes_on():
    """The share after a probe is the focus fraction plus PROBE_GAIN times the fraction the
    probe fooled: a black-box probe that fools survivors says the white-box stages were
    misled, so more of the stage goes on; half by the earlier margin, half by progress."""
    sizes, halves = bucket_sizes(64), bucket_sizes(64, per_halving=1)
    rows = np.arange(40)  # bucket rows -> batch rows (here the identity)
    closeness = -np.arange(40, dtype=float)  # row 0 the closest under the earlier stages
    progress = np.arange(40, dtype=float)  # row 39 the most progress of its own
    for fooled in (0, 1, 2):
        live = np.ones(40, bool)
        live[:fooled] = False  # the probe fooled these (the closest ones)
        after = _after_probe((sizes, halves), live, 40, (5, 0.1, 0.0, closeness), progress, rows)
        share = min(1.0, 0.1 + PROBE_GAIN * fooled / 40)
        nearest = _nearest_bucket(sizes, share * 40)
        keep = min(min(h for h in halves if h >= nearest), 40 - fooled)  # up to a halving
        assert after.sum() == keep and not (after & ~live).any()
        by_margin = np.arange(fooled, fooled + (keep + 1) // 2)
        by_progress = np.arange(40 - (keep - by_margin.size), 40)
        np.testing.assert_array_equal(np.flatnonzero(after),
                                      np.union1d(by_margin, by_progress))
    assert after.sum() == 38  # 2 of 40 fooled: the whole stage goes on
    # A floor of half the batch (32 rows): nothing fooled, yet 32 of the 40 go on (4 alone).
    live = np.ones(40, bool)
    floored = _after_probe((sizes, halves), live, 40, (5, 0.1, 0.5, closeness), progress, rows)
    assert floored.sum() == 32 and floored[:16].all() and floored[-16:].all()


@pytest.mark.parametrize(
    "probe, focus, message",
    [
        ({"sq": 0}, {"sq": 0.5}, "fraction of its steps in (0, 1)"),
        ({"sq": 1.0}, {"sq": 0.5}, "fraction of its steps in (0, 1)"),
        ({"sq": True}, {"sq": 0.5}, "fraction of its steps in (0, 1)"),
        ({"fgsm": 0.5}, {"sq": 0.5}, "give 'fgsm' a focus fraction too"),
        ({"fgsm": 0.5}, {"fgsm": 0.5}, "the attack has 1 step"),
    ],
)
def test_bad_probe_is_one_clear_error(probe, focus, message):
    plan = Plan.of(eps=0.1, attacks=(attacks_lib.fgsm(), attacks_lib.square("linf", queries=41,
                                                                         name="sq")),
                   goals=("misclassify",), mode="cascade", focus=focus, probe=probe)
    with pytest.raises(ValueError, match=re.escape(message)):
        plan.check()
    with pytest.raises(ValueError, match=re.escape("needs mode='cascade'")):
        plan.replace(mode="full", probe=probe)


@pytest.mark.parametrize(
    "focus, goal, message",
    [
        ({"pgd-x": 0.5}, "misclassify", "not in the plan"),
        ({"fgsm": 0.0}, "misclassify", "fraction in (0, 1]"),
        ({"fgsm": 1.5}, "misclassify", "fraction in (0, 1]"),
        ({"fgsm": True}, "misclassify", "fraction in (0, 1]"),
        ({"fgsm": 0.5}, "min_norm", "not min_norm"),
    ],
)
def test_bad_focus_is_one_clear_error(focus, goal, message):
    plan = Plan.of(eps=0.1, attacks=(attacks_lib.fgsm(),), goals=("misclassify", goal),
                mode="cascade", goal=goal, focus=focus)
    with pytest.raises(ValueError, match=re.escape(message)):
        plan.check()


@pytest.mark.parametrize(
    "floor, message",
    [
        ({"fgsm": 0.1}, "give 'fgsm' a focus fraction too"),
        ({"pgd": 0.0}, "share of the batch in (0, 1]"),
        ({"pgd": 1.5}, "share of the batch in (0, 1]"),
        ({"pgd": True}, "share of the batch in (0, 1]"),
    ],
)
def test_bad_floor_is_one_clear_error(floor, message):
    atts = (attacks_lib.fgsm(), attacks_lib.pgd(steps=5).rename("pgd"))
    plan = Plan.of(eps=0.1, attacks=atts, goals=("misclassify",), mode="cascade",
                   focus={"pgd": 0.2}, floor=floor)
    with pytest.raises(ValueError, match=re.escape(message)):
        plan.check()
    with pytest.raises(ValueError, match=re.escape("needs mode='cascade'")):
        plan.replace(mode="full", floor=floor)


def test_focus_needs_the_cascade():
    params, x, y, eps = _problem(n=8)
    with pytest.raises(ValueError, match=re.escape("needs mode='cascade'")):
        _evaluate(params, x, y, (attacks_lib.fgsm(),), eps, focus={"fgsm": 0.5})


def test_a_focused_cascade_says_what_it_skipped(tmp_path):
    """Every stage reports the survivors it could run on, those it ran on and those focus
    skipped (equal to the per-example arrays), and the report says, in JSON, Markdown and on
    the console, that the robust accuracy is then an upper bound; without skipping it does not."""
    from rich.console import Console

    from jaxbundle.report import markdown, print_tables

    params, x, y, eps = _problem(n=48, seed=3)
    atts = (attacks_lib.fgsm(), attacks_lib.pgd(steps=5, restarts=2).rename("pgd"))
    focused = _evaluate(params, x, y, atts, eps, mode="cascade", focus={"pgd": 0.2})
    whole = _evaluate(params, x, y, atts, eps, mode="cascade")
    pe = focused.per_example
    ok = pe["clean_prediction"] == pe["label"]
    survivors = ok & ~pe["attack_success"][:, 0]
    ran = pe["attack_step"][:, 1] != -2
    stages = focused.metrics["schedule"]["stages"]
    assert stages[1]["survivors"] == survivors.sum() == 43
    # 0.2 x 43 -> 9 (nearest bucket of 48) -> 12 (up to a halving of the batch)
    assert stages[1]["examples"] == ran.sum() == 12 and not (ran & ~survivors).any()
    assert stages[1]["skipped"] == 31 == focused.metrics["schedule"]["skipped"]
    assert stages[0]["skipped"] == 0 and stages[0]["survivors"] == ok.sum()
    statement = focused.metrics["schedule"]["statement"]
    assert statement.startswith("stages left survivors unattacked or stopped them after a "
                                "probe (pgd: 31 of 43; focus, probe, escalate or")
    assert "upper bound" in statement
    assert whole.metrics["schedule"]["skipped"] == 0
    assert whole.metrics["schedule"]["statement"] is None
    report = {"config": {}, "models": {"focused": focused.metrics, "whole": whole.metrics}}
    md = markdown(report)
    assert md.count("upper bound") == 1 and "after pgd (12 attacked, 31 survivors skipped)" in md
    console = Console(record=True, width=200)
    print_tables(console, {"focused": (focused, 0.0), "whole": (whole, 0.0)})
    assert console.export_text().count("upper bound:") == 1
