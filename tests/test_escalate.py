"""``escalate``: a cascade stage held back unless the stage before it fooled enough of what it
ran on (jaxbundle.schedule.escalates), and the plan's one-line errors for it."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import attacks as attacks_lib
from jaxbundle import Full, Plan
from jaxbundle.bundler import goals_for
from cascade_toys import problem as _problem
from cascade_toys import run_cascade as _cascade


def _fgsm_pgd_pgdm(*more, **schedule):
    """FGSM, PGD and PGD with the margin loss (then ``more``) as a cascade on the linear toy of
    48 examples, with the ``schedule`` settings: the attacks, the result and the stages."""
    params, x, y, eps = _problem(n=48, seed=3)
    atts = (attacks_lib.fgsm(), attacks_lib.pgd(steps=5, restarts=2).rename("pgd"),
            attacks_lib.pgd(steps=5, restarts=2, loss="margin").rename("pgd-m"), *more)
    ids = jnp.arange(len(y), dtype=jnp.int32)
    return atts, *_cascade(atts, params, x, y, ids, eps, norm="linf",
                           goal_names=goals_for(("misclassify",), atts), **schedule)


@pytest.mark.parametrize("share, runs", [(0.39, True), (0.4, False)])
def test_an_escalated_stage_runs_only_when_the_stage_before_fooled_enough(share, runs):
    """``escalate``: pgd fools 17 of the 43 survivors fgsm left (0.395 of those it ran on), so a
    third stage escalated at 0.39 runs on every survivor left and one at 0.40 is held back:
    it runs on none, every survivor counted skipped, no example charged for it."""
    atts, res, stages = _fgsm_pgd_pgdm(escalate={"pgd-m": share})
    assert (stages[1].survivors, stages[1].examples) == (43, 43)
    assert stages[2].survivors == 43 - 17
    assert stages[2].examples == (26 if runs else 0)
    left = (np.asarray(res.attack_step[1]) != -2) & ~np.asarray(res.attack_success[1])
    ran = np.asarray(res.attack_step[2]) != -2
    assert left.sum() == 26 and ran.sum() == stages[2].examples
    assert np.array_equal(ran, left) if runs else not ran.any()
    spent = atts[0].gradients + atts[1].gradients + (atts[2].gradients if runs else 0)
    np.testing.assert_array_equal(np.asarray(res.gradients)[left], spent)


@pytest.mark.parametrize(
    "escalate, message",
    [
        ({"pgd-x": 0.5}, "not in the plan"),
        ({"fgsm": 0.5}, "'fgsm' is the first stage"),
        ({"pgd": 0.0}, "share in (0, 1]"),
        ({"pgd": 1.5}, "share in (0, 1]"),
        ({"pgd": True}, "share in (0, 1]"),
    ],
)
def test_bad_escalate_is_one_clear_error(escalate, message):
    plan = Plan.of(eps=0.1, attacks=(attacks_lib.fgsm(), attacks_lib.pgd(steps=2).rename("pgd")),
                   goals=("misclassify",), mode="cascade", escalate=escalate)
    with pytest.raises(ValueError, match=re.escape(message)):
        plan.check()
    with pytest.raises(ValueError, match=re.escape("escalate is a cascade setting")):
        plan.replace(mode="full", escalate=escalate)
    assert plan.replace(mode="full").schedule == Full()  # a full plan has no escalate to keep


@pytest.mark.parametrize("share, widened", [(0.39, True), (0.4, False)])
def test_widen_takes_effect_once_an_escalated_stage_ran(share, widened):
    """``widen``: a fourth stage focused on 1/4 of the survivors runs on all of them once the
    escalated third stage has run on the batch, and on its focus share (6 of the 26 left: the
    bucket nearest 6.5, a halving of the batch) when the escalation held it back."""
    _, _, stages = _fgsm_pgd_pgdm(attacks_lib.pgd(steps=3, loss="dlr").rename("pgd-d"),
                                  escalate={"pgd-m": share}, focus={"pgd-d": 0.25},
                                  widen={"pgd-d": 1.0})
    assert stages[2].examples == (26 if widened else 0)
    assert stages[3].examples == (stages[3].survivors if widened else 6)
    assert stages[3].survivors < 26 if widened else stages[3].survivors == 26


@pytest.mark.parametrize(
    "widen, message",
    [
        ({"pgd-x": 0.5}, "give 'pgd-x' a focus fraction too"),
        ({"pgd": 0.5}, "the plan escalates no stage before 'pgd'"),
        ({"pgd-m": 0.2}, "fraction in [0.25, 1] (its focus or more)"),
        ({"pgd-m": 1.5}, "fraction in [0.25, 1]"),
    ],
)
def test_bad_widen_is_one_clear_error(widen, message):
    atts = (attacks_lib.fgsm(), attacks_lib.pgd(steps=2).rename("pgd"),
            attacks_lib.pgd(steps=2, loss="margin").rename("pgd-m"))
    plan = Plan.of(eps=0.1, attacks=atts, goals=("misclassify",), mode="cascade",
                   focus={"pgd": 0.5, "pgd-m": 0.25}, escalate={"pgd": 0.1}, widen=widen)
    with pytest.raises(ValueError, match=re.escape(message)):
        plan.check()
    with pytest.raises(ValueError, match=re.escape("widen is a cascade setting")):
        plan.replace(mode="full", widen=widen)
