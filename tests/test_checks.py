"""The trustworthiness checks: a clean model trips none; models built to trip each check do."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import Plan, evaluate
from jaxbundle import attacks as attacks_lib
from jaxbundle import checks, suites
from jaxbundle.report import check_lines, markdown
from toys import images, linear_apply, linear_problem, min_distance


def _problem(n=32, seed=2):
    params, x, y = linear_problem(n=n, k=4, seed=seed)
    eps = float(np.quantile(min_distance(params, x, y, "linf"), 0.5))
    return params, np.asarray(images(x)), y, eps


def _run(apply_fn, params, x, y, eps, bundle):
    plan = Plan.of(eps=eps, attacks=tuple(bundle), batch_size=16, judging="float")
    return evaluate(apply_fn, params, (x, y), plan, mesh=None)


def _failed(result) -> set[str]:
    return {k for k, c in result.metrics["checks"].items() if not c["passed"]}


def test_a_clean_model_trips_no_check():
    params, x, y, eps = _problem()
    bundle = (attacks_lib.pgd("linf", steps=40, loss="margin"), suites.attack("square", "linf"),
              suites.attack("fmn", "linf", steps=30))
    r = _run(linear_apply, params, x, y, eps, bundle)
    assert set(r.metrics["checks"]) == {
        "randomness", "probabilities", "changes_between_calls", "zero_gradients",
        "black_box_beats_white_box", "silent", "unbounded_incomplete", "still_improving"}
    assert _failed(r) == set()
    assert r.per_example["check_flags"].shape == (32, len(checks.FLAG_NAMES))
    assert not r.per_example["check_flags"].any()
    assert r.metrics["check_flag_names"] == list(checks.FLAG_NAMES)
    assert check_lines(r.metrics["checks"])[0].startswith("checks: 8 of 8 passed")


def test_a_quantising_input_layer_zeroes_gradients_and_silences_white_box_attacks():
    """Rounding the input to 8 levels: every input gradient is exactly zero, so FGSM never
    moves and FMN finds nothing at any distortion, while Square, which needs no gradient,
    fools examples they cannot."""
    params, x, y, eps = _problem()
    quantised = lambda p, v: linear_apply(p, jnp.round(v * 8) / 8)  # noqa: E731
    bundle = (attacks_lib.fgsm("linf"), suites.attack("fmn", "linf", steps=20),
              suites.attack("square", "linf"))
    r = _run(quantised, params, x, y, 2 * eps, bundle)
    failed = _failed(r)
    assert {"zero_gradients", "silent", "unbounded_incomplete",
            "black_box_beats_white_box"} <= failed
    assert not {"randomness", "probabilities", "changes_between_calls"} & failed
    flags = dict(zip(checks.FLAG_NAMES, r.per_example["check_flags"].T))
    correct = r.per_example["clean_prediction"] == r.per_example["label"]
    np.testing.assert_array_equal(flags["zero_gradients"], correct)
    np.testing.assert_array_equal(flags["unbounded_incomplete"], correct)
    fooled_fgsm = r.per_example["attack_success"][:, 0].astype(bool)
    np.testing.assert_array_equal(flags["silent"], correct & ~fooled_fgsm)
    np.testing.assert_array_equal(flags["black_box_beats_white_box"],
                                  correct & r.per_example["black_box_only"].astype(bool))
    assert r.metrics["checks"]["zero_gradients"]["examples"] == correct.sum()
    text = "\n".join(check_lines(r.metrics["checks"]))
    assert "check zero_gradients FAILED" in text and "try:" in text


def test_an_attack_stopped_while_still_improving_is_flagged():
    """PGD with a step 1/200 of eps on a linear model: its margin rises by the same amount at
    every step, so its last 10 % of 20 steps bring 10 % of its rise, and on the examples it
    does not fool the indicator fires. With a step of eps it reaches the corner of the ball
    at once: the same failures, nothing left to gain."""
    params, x, y, eps = _problem()
    slow = attacks_lib.pgd("linf", steps=20, step_size=eps / 200, random_start=False)
    fast = attacks_lib.pgd("linf", steps=20, step_size=eps, random_start=False, name="fast")
    r = _run(linear_apply, params, x, y, eps, (slow, fast))
    flags = dict(zip(checks.FLAG_NAMES, r.per_example["check_flags"].T))
    improving = r.per_example["attack_improving"].astype(bool)
    correct = r.per_example["clean_prediction"] == r.per_example["label"]
    failed_slow = correct & ~r.per_example["attack_success"][:, 0].astype(bool)
    assert failed_slow.sum() > 0
    np.testing.assert_array_equal(improving[:, 0], failed_slow)
    assert not improving[:, 1].any()
    np.testing.assert_array_equal(flags["still_improving"], failed_slow)
    assert "still_improving" in _failed(r)
    assert r.metrics["checks"]["still_improving"]["examples"] == failed_slow.sum()
    # An attack of under 10 steps (FGSM: one; the program of the tests below), or a black-box
    # one, is not judged by it.
    short = _run(linear_apply, params, x, y, eps, (attacks_lib.fgsm("linf"),))
    assert "still_improving" not in short.metrics["checks"]


def test_a_model_returning_probabilities_is_flagged():
    params, x, y, eps = _problem()
    probs = lambda p, v: jax.nn.softmax(linear_apply(p, v))  # noqa: E731
    r = _run(probs, params, x, y, eps, (attacks_lib.fgsm("linf"),))
    assert "probabilities" in _failed(r)
    assert "logits" in r.metrics["checks"]["probabilities"]["advice"]


def test_a_model_with_test_time_noise_is_flagged_random():
    params, x, y, eps = _problem()
    rng = np.random.default_rng(0)
    noisy = lambda p, v: linear_apply(p, v) + rng.normal(0, 0.1, (v.shape[0], 4))  # noqa: E731
    got = checks.model_checks(noisy, params, x)
    assert not got["randomness"].passed and got["changes_between_calls"].passed
    assert "EOT" in got["randomness"].advice


def test_a_model_that_keeps_state_across_calls_is_flagged():
    """Its output depends on the previous batch it saw (like a batch-norm in training mode):
    two calls in a row agree, but not after other inputs."""
    params, x, y, eps = _problem()
    seen = {"mean": 0.0}

    def stateful(p, v):
        out = linear_apply(p, v) + 0.5 * jnp.abs(jnp.mean(v) - seen["mean"])
        seen["mean"] = jnp.mean(v)
        return out

    got = checks.model_checks(stateful, params, x)
    assert got["randomness"].passed and not got["changes_between_calls"].passed
    assert got["probabilities"].passed


@pytest.mark.parametrize("mode", ["full", "cascade"])
def test_checks_in_the_report(mode, tmp_path):
    params, x, y, eps = _problem()
    # The plan of _run (full: the program of the neighbouring tests), in either mode.
    r = evaluate(linear_apply, params, (x, y),
                 Plan.of(eps=eps, attacks=(attacks_lib.fgsm("linf"),), batch_size=16,
                      judging="float", mode=mode), mesh=None)
    report = {"config": {}, "models": {"m": dict(r.metrics, figures={})}}
    text = markdown(report)
    assert "| check | passed | saw | means / try |" in text
    assert "| zero_gradients | yes |" in text


def test_a_check_the_job_adds_fails_on_any_flag_and_becomes_a_column():
    params, x, y, eps = _problem()
    r = _run(linear_apply, params, x, y, eps, (attacks_lib.fgsm("linf"),))
    before = r.per_example["check_flags"].shape[1]
    flags = np.zeros(32, bool)
    flags[[3, 5]] = True
    checks.add(r.metrics, r.per_example, "transfer_beats_white_box", flags, "{count} examples")
    c = r.metrics["checks"]["transfer_beats_white_box"]
    assert not c["passed"] and c["examples"] == 2 and c["saw"] == "2 examples"
    assert r.metrics["check_flag_names"][-1] == "transfer_beats_white_box"
    np.testing.assert_array_equal(r.per_example["check_flags"][:, before], flags)
    assert "check transfer_beats_white_box FAILED: 2 examples" in "\n".join(
        check_lines(r.metrics["checks"]))


def test_the_job_checks_rules_on_a_truth_table():
    """``non_monotone`` and ``transfer_beats_white_box`` on every case, written out by hand:
    only a correctly classified example that the evaluation at eps left standing is flagged,
    when the bisection (or the transfer) fooled it, and for the transfer only when no
    white-box attack fooled it."""
    # rows: correct & bisected & not fooled; correct & bisected & fooled; wrong & bisected;
    #       correct & nothing within eps; correct, fooled by the black-box attack only.
    pe = {"clean_prediction": np.array([1, 1, 0, 1, 1]), "label": np.array([1, 1, 1, 1, 1]),
          "success": np.array([False, True, False, False, True]),
          "attack_success": np.array([[0, 0], [1, 0], [0, 0], [0, 0], [0, 1]], bool)}
    bisected = np.array([0.1, 0.2, 0.05, np.inf, 0.3])
    np.testing.assert_array_equal(checks.non_monotone(pe, bisected),
                                  [True, False, False, False, False])
    white, black = attacks_lib.fgsm(), suites.attack("square", "linf", queries=10)
    transferred = np.array([True, True, True, False, True])
    np.testing.assert_array_equal(
        checks.transfer_beats_white_box(pe, transferred, (white, black)),
        [True, False, False, False, True])
    np.testing.assert_array_equal(  # the same rows, the second attack white-box too
        checks.transfer_beats_white_box(pe, transferred, (white, attacks_lib.fgsm())),
        [True, False, False, False, False])
