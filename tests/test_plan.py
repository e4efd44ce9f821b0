"""One plan: the Python API and the CLI run the same plan with the same results, every bad value
is one error from Plan.check (through the API and as exit status 2 through the CLI), a
checkpoint refuses a changed plan naming what changed, and one attack vocabulary."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import pathlib
import re
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbundle
from jaxbundle import attacks as attacks_lib
from jaxbundle import bundles, suites
from jaxbundle.cli import main
from jaxbundle.plan import (AttackSpec, Cascade, Certify, Full, Plan, Run, Sampling, Suite,
                            Threat)
from jaxbundle.presets import DEMO_CERTIFY
from toys import images, linear_apply, linear_problem, min_distance

# A tiny user model (a 64-32-10 ReLU MLP on 8x8 digits) and its data, written once per module:
# the CLI loads it as `--model tinymlp:model`, the API calls the same function.
_MODEL = textwrap.dedent("""
    import jax, jax.numpy as jnp

    def apply_fn(params, x):
        h = jax.nn.relu(x.reshape(x.shape[0], -1) @ params["w1"] + params["b1"][None])
        return h @ params["w2"] + params["b2"][None]

    def model():
        k1, k2 = jax.random.split(jax.random.key(3))
        params = {"w1": jax.random.normal(k1, (64, 32)) * 0.3, "b1": jnp.zeros(32),
                  "w2": jax.random.normal(k2, (32, 10)) * 0.3, "b2": jnp.zeros(10)}
        return apply_fn, params
""")


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """The model module on sys.path and an npz of 24 on-grid 8x8 images the model mostly
    classifies correctly (labels: its own predictions, 4 of them flipped)."""
    root = tmp_path_factory.mktemp("plan")
    (root / "tinymlp.py").write_text(_MODEL)
    sys.path.insert(0, str(root))
    import tinymlp

    apply_fn, params = tinymlp.model()
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (24, 8, 8, 1)).astype(np.uint8)
    y = np.asarray(jnp.argmax(apply_fn(params, x / 255.0), -1)).astype(np.int64)
    y[:4] = (y[:4] + 1) % 10
    np.savez(root / "digits.npz", x=x, y=y)
    yield root, apply_fn, params, x, y
    sys.path.remove(str(root))
    sys.modules.pop("tinymlp", None)


def _cli_flags(root, out, *flags):
    return ["evaluate", "--model", "tiny=tinymlp:model", "--data", f"npz:{root / 'digits.npz'}",
            "--no-shifts", "--no-progress", "--no-compile-cache", "--cache-dir",
            str(root / "cache"), "--batch-size", "24", "--out", str(out), *flags]


def _queries(bundle, norm):
    """The runs below cut a bundle's black-box attacks to 60 queries (none: no override)."""
    black = any(a.kind != "white-box" for a in bundles.bundle_attacks(bundle, norm))
    return {"queries": 60} if black else {}


def _flags(bundle, norm, eps):
    queries = [f"--{k}={v}" for k, v in _queries(bundle, norm).items()]
    return ["--bundle", bundle, "--norm", norm, "--eps", str(eps), "--seed", "3", *queries]


def _api_plan(bundle, norm, eps):
    return bundles.plan(bundle, norm, eps, seed=3, batch_size=24, **_queries(bundle, norm))


# Every named bundle, in both norms.
SETTINGS = [(name, norm, eps) for name in bundles.BUNDLES for norm, eps in (("linf", 0.03),
                                                                          ("l2", 0.2))]


@pytest.mark.parametrize("bundle, norm, eps", SETTINGS)
def test_the_cli_runs_the_plan_the_api_builds(user, tmp_path, capsys, bundle, norm, eps):
    """``jaxbundle evaluate --bundle NAME`` and ``bundles.plan(NAME, ...)`` with the same
    settings: the same plan (the command's dry run prints it), cascade settings included."""
    root = user[0]
    assert main(_cli_flags(root, tmp_path, *_flags(bundle, norm, eps), "--dry-run")) == 0
    printed = json.loads(capsys.readouterr().out)["plan"]
    assert printed == json.loads(json.dumps(_api_plan(bundle, norm, eps).describe()))


# One cascade and one full bundle run both ways: every named bundle is a plan (above), and
# evaluate runs a plan the same way from both entry points.
@pytest.mark.parametrize("bundle, norm, eps", [
    pytest.param("default", "linf", 0.03, marks=pytest.mark.slow),
    ("fast", "l2", 0.2),
])
def test_api_and_cli_give_the_same_per_example_arrays(user, tmp_path, bundle, norm, eps):
    """``jaxbundle.evaluate(apply_fn, params, data, bundles.plan(NAME, ...))`` and
    ``jaxbundle evaluate --bundle NAME`` with the same settings: the same plan, the same
    per-example arrays, the same figures."""
    root, apply_fn, params, x, y = user
    out = tmp_path / "report"
    assert main(_cli_flags(root, out, *_flags(bundle, norm, eps))) == 0
    report = json.loads((out / "report.json").read_text())
    plan = _api_plan(bundle, norm, eps)
    assert report["config"]["plan"] == report["models"]["tiny"]["plan"] == plan.describe()
    ev = jaxbundle.evaluate(apply_fn, params, f"npz:{root / 'digits.npz'}", plan)
    with np.load(out / "tiny.npz") as cli:
        assert list(cli["attack_names"]) == list(ev.attack_names)
        assert set(cli.files) - {"attack_names"} == set(ev.per_example)
        for key, value in ev.per_example.items():
            np.testing.assert_array_equal(cli[key], value, err_msg=key)
    m = report["models"]["tiny"]
    for key in ("clean_accuracy", "robust_accuracy", "mat", "wat", "schedule"):
        assert m[key] == json.loads(json.dumps(ev.metrics[key])), key
    assert 0 < ev.metrics["robust_accuracy"] < ev.metrics["clean_accuracy"]
    if bundle == "default":
        assert m["schedule"]["mode"] == "cascade" and m["mat"] is None
        assert [s["attack"] for s in m["schedule"]["stages"]] == list(ev.attack_names)


def test_a_named_bundle_carries_its_schedule():
    """The default bundle is a focused, segmented cascade wherever it is used: the bug this
    replaces ran it in full from Python and as a cascade from the CLI."""
    plan = bundles.default("linf", 0.3)
    assert plan == bundles.plan("default", "linf", 0.3) and plan.suite.bundle == "default"
    assert (plan.schedule.mode, plan.schedule.segments) == ("cascade", 6)
    assert plan.schedule.focus_map == {"apgd-ce-long": 0.5, "apgd-t5": 0.5, "square-aa": 0.06}
    assert plan.schedule.probe_map == {"square-aa": 0.05}
    assert [a.name for a in plan.attack_values()] == ["apgd-ce", "apgd-ce-long", "apgd-t5",
                                                      "square-aa"]
    assert bundles.autoattack("l2", 0.5).schedule.mode == "cascade"
    assert bundles.broad("linf", 0.3).schedule.mode == "full"
    assert [a.name for a in bundles.black_box("l2", 1.0).attack_values()] == ["square",
                                                                              "surfree"]
    with pytest.raises(ValueError, match="needs the threat model's eps"):
        bundles.default("linf")


@pytest.mark.parametrize("name", list(bundles.BUNDLES))
@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_every_bundle_is_a_valid_plan_named_in_one_vocabulary(name, norm):
    plan = bundles.plan(name, norm, 0.1)
    built = plan.attack_values()
    assert [a.name for a in built] == [s.name for s in plan.suite.attacks]
    assert all(a.name in suites.ATTACKS and a.norm == norm for a in built)
    assert set(plan.schedule.describe()["focus"]) <= {a.name for a in built}
    assert plan.attack_values() is built  # built once per plan: jitted programs are reused
    hash(plan)
    json.dumps(plan.describe())


def test_one_name_everywhere():
    """An attack built by suite name is called by it; the CLI's --attacks, --focus, the report
    and the per-example arrays all use it."""
    for name in suites.ATTACKS:
        for norm in ("linf", "l2"):
            try:
                assert suites.attack(name, norm).name == name
            except ValueError as err:  # an attack of the other norm only
                assert f"{norm!r}" in str(err) and "norm" in str(err)


def test_plan_is_frozen_hashable_and_replaceable():
    plan = Plan.of(eps=np.float32(0.25), attacks=["fgsm", "pgd-ce"], focus={"pgd-ce": 0.5},
                   mode="cascade", goals="misclassify")
    assert plan.threat.eps == 0.25 and type(plan.threat.eps) is float
    assert plan.suite.attacks == (AttackSpec("fgsm"), AttackSpec("pgd-ce"))
    assert plan.schedule.focus == (("pgd-ce", 0.5),) and plan.threat.goals == ("misclassify",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.threat = Threat(0.1)
    assert plan.replace(seed=2).run.seed == 2 and plan.run.seed == 0
    assert len({plan, plan.replace(), plan.replace(seed=2)}) == 2
    assert plan.check() is plan


def _described(name, norm, mode, extra):
    try:
        described = bundles.plan(name, norm, 0.3, mode=mode, **extra).describe()
    except ValueError as error:
        described = f"ERR {error}"
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


DESCRIPTIONS = pathlib.Path(__file__).parent / "plan_descriptions.json"


def _descriptions() -> dict[str, str]:
    """Every named bundle in each norm and mode, plain and with run, certify and schedule
    fields: the digest of its ``describe()``."""
    out = {}
    for name in bundles.BUNDLES:
        for norm, mode in itertools.product(("linf", "l2"), ("full", "cascade")):
            for extra in ({}, {"steps": 7, "seed": 3, "batch_size": 17}, {"certify": "crown"},
                          {"goal": "max_confidence", "threshold": 0.9} if mode == "cascade"
                          else {"restart_mode": "map"}):
                out[f"{name}/{norm}/{mode}/{sorted(extra)}"] = _described(name, norm, mode,
                                                                          extra)[:16]
    return out


def test_every_named_plan_describes_itself_as_stored():
    """``describe()`` (the report's config, the checkpoint's identity: a changed one starts a
    run afresh) of every named plan is byte-identical to the stored digests: first stored from
    the flat plan before the records (issue 49), rewritten only where a plan changed on purpose
    (``python tests/test_plan.py`` writes them; the diff says which plans changed)."""
    stored = json.loads(DESCRIPTIONS.read_text())
    assert _descriptions() == stored


def test_the_flat_names_are_routed_to_the_records():
    """``Plan.of`` / ``replace`` take the CLI's flat names, each into its record; the same plan
    built from its records is equal; a field exists only where it means something."""
    flat = Plan.of(eps=0.3, attacks=("fgsm", "pgd-ce"), norm="l2", steps=7, mode="cascade",
                   focus={"pgd-ce": 0.5}, segments=3, batch_size=16, seed=4, certify="crown")
    nested = Plan(Threat(0.3, "l2"), Suite(("fgsm", "pgd-ce"), steps=7),
                  Cascade(focus={"pgd-ce": 0.5}, segments=3), Run(batch_size=16, seed=4),
                  certify=Certify("crown"))
    assert flat == nested and flat.describe() == nested.describe()
    assert flat.stochastic is None and flat.replace(eot=2).stochastic == Sampling(eot=2)
    assert flat.replace(eot=2).replace(eot=1).stochastic is None  # all defaults: no section
    # A cascade keeps its settings while it stays one; mode="full" drops them.
    assert flat.replace(segments=4).schedule == Cascade(focus={"pgd-ce": 0.5}, segments=4)
    assert flat.replace(mode="full").schedule == Full()
    assert not hasattr(Full(), "focus")
    assert Plan.of(eps=0.3, attacks=("fgsm",)).replace(mode="cascade").schedule == Cascade()
    # certify= names the method (flat) or the record; a time limit goes with its method.
    limited = flat.replace(certify="complete", certify_time_limit=5)
    assert limited.certify == Certify("complete", 5.0)
    assert limited.replace(certify=None).certify is None
    assert flat.replace(certify=Certify("ibp")).certify == Certify("ibp")
    with pytest.raises(ValueError, match="certify_time_limit is the complete mode's seconds"):
        Plan.of(eps=0.3, attacks=("fgsm",), certify_time_limit=5)
    with pytest.raises(TypeError, match="Plan has no field 'stepz'"):
        flat.replace(stepz=3)
    with pytest.raises(TypeError, match="a plan's schedule is Full"):
        Plan(Threat(0.3), Suite(("fgsm",)), "cascade").check()


_GOOD = dict(eps=0.1, attacks=("fgsm", "pgd-ce"))

# (plan fields, the one error, the CLI flags that give the same plan, or None: no such flag)
_BAD = [
    (dict(eps=-0.1), "eps must be a finite number >= 0", None),
    (dict(eps=float("nan")), "eps must be a finite number >= 0", None),
    (dict(norm="l1"), "norm", None),
    (dict(judging="round"), "judging", None),
    (dict(goals=("misclassify", "fast")), "unknown goal", None),
    (dict(attacks=()), "at least one attack", None),
    (dict(attacks=("cw",)), "unknown attack 'cw'", ["--attacks", "cw"]),
    (dict(attacks=("fgsm", "fgsm")), "attack names must be unique", ["--attacks", "fgsm,fgsm"]),
    (dict(attacks=("cw-l2",)), "works in norm 'l2'", ["--attacks", "cw-l2"]),
    (dict(steps=0), "steps must be a positive integer", None),
    (dict(restarts=2.5), "restarts must be a positive integer", None),
    (dict(step_size=-1.0), "step_size must be a number > 0", None),
    (dict(queries=100), "no attack of this plan has one", ["--queries", "100"]),
    (dict(mode="greedy"), "mode must be one of", None),
    (dict(goals=("misclassify",), mode="cascade", goal="max_confidence", threshold=0.5),
     "not among the goals", None),
    (dict(goal="max_confidence"), "goal is a cascade setting", None),
    (dict(goal="max_confidence", threshold=0.5), "threshold is a cascade setting",
     ["--threshold", "0.5"]),
    (dict(mode="cascade", goals=("max_confidence",), goal="max_confidence"),
     "needs its threshold", None),
    (dict(mode="cascade", threshold=1.5, goal="max_confidence", goals=("max_confidence",)),
     "threshold must be a confidence in (0, 1]", None),
    (dict(mode="cascade", threshold=0.5, goal="misclassify"), "set goal='max_confidence'", None),
    (dict(budget=100.0), "budget is a cascade setting", ["--budget", "100"]),
    (dict(mode="cascade", budget=0.0), "budget must be a number of model passes > 0", None),
    (dict(segments=3), "segments is a cascade setting", ["--segments", "3"]),
    (dict(mode="cascade", segments=0), "segments must be a positive integer", None),
    (dict(buckets=4), "buckets is a cascade setting", ["--buckets", "4"]),
    (dict(mode="cascade", buckets=65), "buckets (bucket sizes per halving of the batch) must be "
     "an integer in [1, 64], got 65", None),
    (dict(mode="cascade", restart_mode="cascade", buckets=0), "must be an integer in [1, 64]",
     None),
    (dict(restart_mode="cascade"), "restart_mode 'cascade' (each restart on the examples the "
     "ones before left) needs mode 'cascade'", None),
    (dict(focus={"fgsm": 0.5}), "focus is a cascade setting", ["--focus", "fgsm=0.5"]),
    (dict(mode="cascade", focus={"fmn": 0.5}), "not in the plan",
     ["--schedule", "cascade", "--focus", "fmn=0.5"]),
    (dict(mode="cascade", focus={"fgsm": 2.0}), "fraction in (0, 1]", None),
    (dict(mode="cascade", goal="min_norm", goals=("min_norm",), focus={"fgsm": 0.5}),
     "focus needs a goal that can be satisfied", None),
    (dict(batch_size=0), "batch_size must be a positive integer", None),
    (dict(seed=1.5), "seed must be an integer", None),
    (dict(unroll=0), "unroll must be a positive integer or a bool", None),
    (dict(restart_mode="pmap"), "restart_mode must be one of", None),
    (dict(eot=0), "eot must be a positive integer", None),
    (dict(attacks=tuple(jaxbundle.with_eot([attacks_lib.fgsm()], 4)), eot=2),
     "attack 'fgsm' carries eot=4 and the plan eot=2: set one of them", None),
    (dict(judge_calls=0), "judge_calls must be a positive integer", None),
    (dict(success_threshold=1.0), "success_threshold must be a success rate in [0, 1)", None),
]


@pytest.mark.parametrize("fields, message, flags", _BAD)
def test_every_bad_value_is_one_error_from_check(fields, message, flags, tmp_path, capsys):
    # A setting with no field to hold it (a cascade setting on a full plan, an unknown mode) is
    # refused where the flat names are routed; every other bad value by check.
    unplaceable = "cascade setting" in message or message.startswith("mode must be one of")
    with pytest.raises(ValueError, match=re.escape(message)):
        Plan.of(**{**_GOOD, **fields}).check()
    if unplaceable:
        with pytest.raises(ValueError, match=re.escape(message)):
            Plan.of(**{**_GOOD, **fields})
    else:  # the API refuses it before touching the model or the data
        with pytest.raises(ValueError, match=re.escape(message)):
            jaxbundle.evaluate(None, None, None, Plan.of(**{**_GOOD, **fields}))
    if flags is not None:
        argv = ["evaluate", "--dry-run", "--out", str(tmp_path), "--cache-dir", str(tmp_path)]
        if "--attacks" not in flags:
            argv += ["--attacks", "fgsm,pgd-ce"]
        assert main(argv + ["--eps", "0.1", *flags]) == 2
        err = capsys.readouterr().err
        assert "error:" in err and message in " ".join(err.split()) and "Traceback" not in err


def test_the_model_dependent_rules(tmp_path):
    params, x, y = linear_problem(n=4, k=3)
    plan = Plan.of(eps=0.1, attacks=("fgsm",), eot=2)
    with pytest.raises(ValueError, match="eot=2 but the model is deterministic"):
        jaxbundle.evaluate(linear_apply, params, (images(x), y), plan)
    with pytest.raises(ValueError, match="judge_calls is for stochastic models"):
        jaxbundle.evaluate(linear_apply, params, (images(x), y),
                           Plan.of(eps=0.1, attacks=("fgsm",), judge_calls=4))
    with pytest.raises(TypeError, match="plan must be a jaxbundle.Plan"):
        jaxbundle.evaluate(linear_apply, params, (images(x), y), bundles.BUNDLES["fast"])


def test_dry_run_prints_the_plan_it_would_run(capsys, tmp_path):
    argv = ["evaluate", "--dry-run", "--bundle", "default", "--focus", "square-aa=0.2",
            "--segments", "3", "--queries", "500", "--out", str(tmp_path)]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = bundles.default("linf", 0.3, queries=500, segments=3, certify=DEMO_CERTIFY,
                               focus={"apgd-ce-long": 0.5, "apgd-t5": 0.5, "square-aa": 0.2})
    assert printed["plan"] == expected.describe()
    assert printed["threat_model"]["preset"] == "mnist-linf"
    assert not (tmp_path / "report.json").exists()
    # --schedule full on a cascade bundle drops the bundle's own focus and segments, and the
    # autoattack bundle's cascade of restarts (from Python too).
    assert main(["evaluate", "--dry-run", "--schedule", "full"]) == 0
    printed = json.loads(capsys.readouterr().out)["plan"]
    schedule = printed["schedule"]
    assert (schedule["mode"], schedule["focus"], schedule["segments"]) == ("full", {}, 1)
    assert printed == bundles.default("linf", 0.3, mode="full", certify=DEMO_CERTIFY).describe()
    for schedule, restarts in (("cascade", "cascade"), ("full", "vmap")):
        assert main(["evaluate", "--dry-run", "--bundle", "autoattack", "--schedule",
                     schedule]) == 0
        printed = json.loads(capsys.readouterr().out)["plan"]
        assert printed["run"]["restart_mode"] == restarts
        assert printed == bundles.autoattack("linf", 0.3, mode=schedule,
                                             certify=DEMO_CERTIFY).describe()


def _toy():
    params, x, y = linear_problem(n=12, k=4, seed=2)
    eps = float(np.quantile(min_distance(params, x, y, "linf"), 0.5))
    return params, np.asarray(images(x)), y, eps


_CHANGES = [
    ("eps", 0.05, "plan.threat_model.eps"),
    ("norm", "l2", "plan.threat_model.norm"),
    ("judging", "float", "plan.threat_model.judging"),
    ("goals", ("misclassify",), "plan.threat_model.goals"),
    ("attacks", ("fgsm", "pgd-margin"), "plan.attacks"),
    ("steps", 4, "plan.overrides.steps"),
    ("restarts", 2, "plan.overrides.restarts"),
    ("step_size", 0.01, "plan.overrides.step_size"),
    ("mode", "cascade", "plan.schedule.mode"),
    ("seed", 1, "plan.run.seed"),
    ("batch_size", 4, "plan.run.batch_size"),
    ("unroll", 2, "plan.run.unroll"),
    ("restart_mode", "map", "plan.run.restart_mode"),
]


def test_a_resumed_run_refuses_any_changed_plan_field(tmp_path):
    """The same plan resumes (nothing left to run: the same result); a plan that differs in
    any field is refused with the field named, before anything runs."""
    params, x, y, eps = _toy()
    base = Plan.of(eps=eps, attacks=("fgsm", "pgd-ce"), steps=3, batch_size=6)
    first = jaxbundle.evaluate(linear_apply, params, (x, y), base, checkpoint_dir=str(tmp_path))
    again = jaxbundle.evaluate(linear_apply, params, (x, y), base, checkpoint_dir=str(tmp_path))
    np.testing.assert_array_equal(again.per_example["success"], first.per_example["success"])
    cascades = {"mode": "cascade"}
    changes = _CHANGES + [
        ("focus", {"pgd-ce": 0.5}, "plan.schedule.focus"),
        ("segments", 3, "plan.schedule.segments"),
        ("budget", 100.0, "plan.schedule.budget"),
        ("buckets", 4, "plan.schedule.buckets"),
        ("restart_mode", "cascade", "plan.run.restart_mode"),
    ]
    for field, value, path in changes:
        plan = base.replace(**{field: value}, **(
            cascades if field in ("focus", "segments", "budget", "buckets", "restart_mode")
            else {}))
        if field == "norm":
            plan = plan.replace(eps=1.0)
        with pytest.raises(ValueError, match=re.escape(path)) as err:
            jaxbundle.evaluate(linear_apply, params, (x, y), plan, checkpoint_dir=str(tmp_path))
        assert "belongs to a different evaluation" in str(err.value), field
    other = jax.tree.map(lambda a: a + 1e-3, params)
    with pytest.raises(ValueError, match="model"):
        jaxbundle.evaluate(linear_apply, other, (x, y), base, checkpoint_dir=str(tmp_path))


def test_a_resumed_stochastic_run_refuses_changed_stochastic_options(tmp_path):
    params, x, y, eps = _toy()
    noisy = jaxbundle.stochastic(
        lambda p, xb, key: linear_apply(p, xb + 0.01 * jax.random.normal(key, xb.shape)),
        calls=4)
    base = Plan.of(eps=eps, attacks=(attacks_lib.fgsm(),), goals=("misclassify",), batch_size=6)
    jaxbundle.evaluate(noisy, params, (x, y), base, checkpoint_dir=str(tmp_path))
    for field, value in (("eot", 2), ("judge_calls", 8), ("success_threshold", 0.25)):
        with pytest.raises(ValueError, match=re.escape(f"plan.stochastic.{field}")):
            jaxbundle.evaluate(noisy, params, (x, y), base.replace(**{field: value}),
                               checkpoint_dir=str(tmp_path))


def test_a_threshold_selects_the_max_confidence_goal():
    """``replace(threshold=t)`` (and ``--threshold``) is the max_confidence goal's t; a goal
    given beside it is kept, and a threshold without that goal is still refused by check."""
    plan = bundles.default("linf", 0.3).replace(goals=("misclassify", "max_confidence"),
                                                  threshold=0.5)
    assert plan.schedule.goal == "max_confidence" and plan.check() is plan
    kept = plan.replace(threshold=0.5, goal="misclassify")
    with pytest.raises(ValueError, match="set goal='max_confidence'"):
        kept.check()


if __name__ == "__main__":  # rewrite the stored digests (a plan's description changed on purpose)
    DESCRIPTIONS.write_text(json.dumps(_descriptions(), indent=0, sort_keys=True))
