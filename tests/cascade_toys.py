"""The cascade's toy problem, shared by the schedule's tests: a linear model on 5 classes whose
minimal distances are known, run through ``cascade`` or ``evaluate`` under a checked plan."""

from __future__ import annotations

import jax
import numpy as np

from jaxbundle import Plan, evaluate
from jaxbundle.schedule import Batch, Model, cascade
from toys import images, linear_apply, linear_problem, min_distance

KEY = jax.random.key(7)


def run_cascade(atts, params, x, y, ids, eps, *, goal_names, norm="linf", judging="auto",
                **schedule):
    """schedule.cascade under a checked cascade plan with these attacks and settings (the
    plan's eps is the largest radius; the batch's own, possibly per example, is passed)."""
    plan = Plan.of(eps=float(np.max(eps)), norm=norm, judging=judging, attacks=tuple(atts),
                   goals=goal_names, mode="cascade", **schedule).check()
    model = Model(params, tuple(atts), KEY, None, plan.rules(linear_apply, tuple(atts)))
    return cascade(plan.schedule, model, Batch(x, y, ids, None, None), eps)


def evaluate_toy(params, x, y, atts, eps, **plan):
    """jaxbundle.evaluate of the linear toy under a plan of these attacks (no mesh)."""
    plan.setdefault("goals", ("misclassify",))
    return evaluate(linear_apply, params, (x, y), Plan.of(eps=eps, attacks=tuple(atts), **plan),
                    mesh=None)


def problem(n=48, seed=3):
    params, x, y = linear_problem(n=n, k=5, seed=seed)
    eps = float(np.quantile(min_distance(params, x, y, "linf"), 0.6))
    return params, np.asarray(images(x)), y, eps
