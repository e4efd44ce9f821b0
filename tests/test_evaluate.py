"""The evaluation driver and the metric reducers."""

from __future__ import annotations

import json
import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxbundle import Plan, attacks, evaluate
from jaxbundle import metrics as metrics_lib
from jaxbundle.metrics import Counts, relative_robustness
from toys import (
    assert_all_succeeded,
    coordinator_port,
    images,
    linear_apply,
    linear_problem,
    min_distance,
    python_command,
    run_processes,
)

# Two white-box attacks and a black-box one (the white-box/black-box figures and the mesh runs).
ATTACKS = [attacks.fgsm(), attacks.pgd(steps=4, restarts=2), attacks.square("linf", queries=30)]


@pytest.fixture(scope="module")
def problem():
    params, x, y = linear_problem(n=37, k=4, seed=20)
    eps = float(np.quantile(min_distance(params, x, y, "linf"), 0.5))
    return params, np.asarray(images(x)), y, eps


def _run(problem, checkpoint_dir=None, progress=None, **fields):
    """ATTACKS on the problem, with the plan's ``fields`` (seed 3 and the problem's eps unless
    given)."""
    params, x, y, eps = problem
    plan = Plan.of(**{"eps": eps, "attacks": tuple(ATTACKS), "seed": 3, **fields})
    return evaluate(linear_apply, params, (x, y), plan, mesh=None,
                    checkpoint_dir=checkpoint_dir, progress=progress)


@pytest.mark.slow
def test_batch_size_does_not_change_any_per_example_result(problem):
    # The two batch sizes the other tests of this module run: their programs, compiled once.
    a = _run(problem, batch_size=16)  # 3 batches, the last with 5 real rows and 11 padding
    b = _run(problem, batch_size=8)  # 5 batches, the last with 5 real rows and 3 padding
    # The record's plan names the batch size it ran with; nothing else differs.
    assert (a.metrics["plan"]["run"]["batch_size"], b.metrics["plan"]["run"]["batch_size"]) == (
        16, 8)
    b.metrics["plan"]["run"]["batch_size"] = 16
    assert a.metrics == b.metrics
    assert set(a.per_example) == set(b.per_example)
    for k in a.per_example:
        np.testing.assert_allclose(a.per_example[k], b.per_example[k], rtol=0, atol=1e-6, err_msg=k)
    assert a.per_example["success"].shape == (37,)
    assert 0 < a.metrics["robust_accuracy"] < a.metrics["clean_accuracy"]


def test_metrics_match_the_per_example_arrays(problem):
    ev = _run(problem, batch_size=16)
    pe = ev.per_example
    clean_ok = pe["clean_prediction"] == pe["label"]
    assert ev.metrics["clean_accuracy"] == pytest.approx(100 * clean_ok.mean())
    assert ev.metrics["robust_accuracy"] == pytest.approx(100 * (clean_ok & ~pe["success"]).mean())
    for i, name in enumerate(ev.attack_names):
        alone = clean_ok & ~pe["attack_success"][:, i]
        assert ev.metrics["mat"][name] == pytest.approx(100 * alone.mean())
    assert ev.metrics["wat"] == min(ev.metrics["mat"].values())
    assert ev.metrics["robust_accuracy"] <= ev.metrics["wat"]
    rr = 100 * (clean_ok & ~pe["success"]).sum() / clean_ok.sum()
    assert ev.metrics["relative_robustness"] == pytest.approx(rr)
    fooled = pe["success"]
    np.testing.assert_array_equal(pe["adversarial_prediction"][fooled] != pe["label"][fooled], True)
    assert np.all(pe["distortion"][fooled] <= problem[3] + 1e-6)
    # The white-box and black-box bundles, and the examples only a black-box attack fooled.
    black = np.asarray([a.black_box for a in ATTACKS])
    by_white = pe["attack_success"][:, ~black].any(axis=1)
    by_black = pe["attack_success"][:, black].any(axis=1)
    m = ev.metrics
    assert m["white_box_robust_accuracy"] == pytest.approx(100 * (clean_ok & ~by_white).mean())
    assert m["black_box_robust_accuracy"] == pytest.approx(100 * (clean_ok & ~by_black).mean())
    assert m["black_box_robust_accuracy"] < m["clean_accuracy"], "square must fool some"
    np.testing.assert_array_equal(pe["black_box_only"], by_black & ~by_white)
    assert m["black_box_only"] == int(np.sum(clean_ok & by_black & ~by_white))


def test_checkpoint_resume_is_bit_identical(problem, tmp_path):
    reference = _run(problem, batch_size=8)

    class Stop(Exception):
        pass

    def interrupt(done, total):
        if done == 2:
            raise Stop

    with pytest.raises(Stop):
        _run(problem, batch_size=8, checkpoint_dir=str(tmp_path), progress=interrupt)
    seen = []
    resumed = _run(problem, batch_size=8, checkpoint_dir=str(tmp_path),
                   progress=lambda d, t: seen.append(d))
    assert seen == [3, 4, 5], "the resumed run must skip the finished batches"
    assert resumed.metrics == reference.metrics
    for k in reference.per_example:
        np.testing.assert_array_equal(resumed.per_example[k], reference.per_example[k], err_msg=k)
    with pytest.raises(ValueError, match=r"different evaluation \(plan\.run\.seed changed\)"):
        _run(problem, batch_size=8, checkpoint_dir=str(tmp_path), seed=4)


def _worker_script(problem, tmp_path, setup: str, checkpoint: bool = False) -> str:
    """A script that runs ``setup`` (devices, jax.distributed), then the same evaluation as
    ``_run(problem, batch_size=16)`` with ``mesh="auto"``, and saves what it got as
    ``out<argv[1]>.npz`` and ``metrics<argv[1]>.json`` in ``tmp_path``."""
    params, x, y, eps = problem
    np.savez(tmp_path / "p.npz", w=params["w"], b=params["b"], x=x, y=y, eps=eps)
    ckpt = repr(str(tmp_path / "ckpt")) if checkpoint else None
    return textwrap.dedent(setup) + textwrap.dedent(
        f"""
        import json, sys
        import jax, numpy as np
        from jaxbundle import Plan, attacks, data, evaluate
        from toys import linear_apply
        tag = sys.argv[1]
        d = np.load(r"{tmp_path / 'p.npz'}")
        params = {{"w": d["w"], "b": d["b"]}}
        reads = []

        class Recording(data.ArraySource):
            def read(self, start, stop):
                reads.append([start, stop])
                return super().read(start, stop)

        plan = Plan.of(eps=float(d["eps"]), seed=3, batch_size=16,
                    attacks=(attacks.fgsm(), attacks.pgd(steps=4, restarts=2),
                             attacks.square("linf", queries=30)))
        ev = evaluate(linear_apply, params, Recording(d["x"], d["y"]), plan, mesh="auto",
                      checkpoint_dir={ckpt}, keep_images=True)
        np.savez(r"{tmp_path}" + f"/out{{tag}}.npz", **ev.per_example)
        with open(r"{tmp_path}" + f"/metrics{{tag}}.json", "w") as f:
            json.dump(ev.metrics, f)
        with open(r"{tmp_path}" + f"/reads{{tag}}.json", "w") as f:
            json.dump(reads, f)
        """
    )


def _assert_same_as_single_device(problem, tmp_path, tags) -> None:
    single = _run(problem, batch_size=16)
    expected = json.loads(json.dumps(single.metrics))
    for tag in tags:
        with open(tmp_path / f"metrics{tag}.json") as f:
            assert json.load(f) == expected
        with np.load(tmp_path / f"out{tag}.npz") as sharded:
            assert set(sharded.files) == set(single.per_example)
            for k in single.per_example:
                np.testing.assert_allclose(sharded[k], single.per_example[k], atol=1e-6, err_msg=k)


# Sharding the batch over a mesh of 8 (fake CPU) devices changes nothing: the two processes
# of test_two_processes_give_the_same_answer hold 4 each (one run for both points).


def test_evaluate_rejects_bad_data(problem):
    params, x, y, eps = problem
    plan = Plan.of(eps=eps, attacks=tuple(ATTACKS))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        evaluate(linear_apply, params, (x * 2, y), plan)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        evaluate(linear_apply, params, (x, y), plan.replace(batch_size=0))
    with pytest.raises(ValueError, match="empty"):
        evaluate(linear_apply, params, (x[:0], y[:0]), plan)
    with pytest.raises(TypeError, match="plan must be a jaxbundle.Plan"):
        evaluate(linear_apply, params, (x, y), {"eps": eps})


# ---------------------------------------------------------------------------------------------
# Reducers: merge is associative and commutative with empty() as identity.

SETTING = metrics_lib.Setting(("a", "b"), (False, True), ("misclassify", "max_confidence"))


def _counts(v) -> Counts:
    """Counts of every metric of SETTING, filled leaf by leaf from 16 integers."""
    leaves, tree = jax.tree.flatten(Counts.empty(SETTING))
    parts = np.split(np.asarray(v, np.int32), np.cumsum([leaf.size for leaf in leaves])[:-1])
    return jax.tree.unflatten(
        tree, [jnp.asarray(part).reshape(leaf.shape) for part, leaf in zip(parts, leaves)])


counts_strategy = st.builds(_counts, st.lists(st.integers(0, 10_000), min_size=16, max_size=16))


@given(counts_strategy, counts_strategy, counts_strategy)
def test_merge_is_associative_commutative_with_identity(a, b, c):
    same = lambda p, q: all(  # noqa: E731
        np.array_equal(u, v) for u, v in zip(jax.tree.leaves(p), jax.tree.leaves(q)))
    assert len(jax.tree.leaves(a)) == 11  # every count field is covered
    assert same(a.merge(b).merge(c), a.merge(b.merge(c)))
    assert same(a.merge(b), b.merge(a))
    assert same(a.merge(Counts.empty(SETTING)), a)
    assert same(a.read(a.arrays()), a)  # the checkpoint round trip


@pytest.mark.slow
def test_merging_batches_equals_one_pass(problem):
    from jaxbundle.bundler import bundle

    params, x, y, eps = problem
    key = jax.random.key(0)
    ids = jnp.arange(37, dtype=jnp.int32)
    mask = jnp.ones(37, bool)
    goals = ("misclassify", "max_confidence")
    setting = metrics_lib.Setting.of(ATTACKS, goals)
    run = lambda rows: bundle(  # noqa: E731
        ATTACKS, linear_apply, params, x[rows], y[rows], key, eps=eps, example_id=ids[rows],
        goals=goals)
    whole = Counts.from_result(run(np.arange(37)), mask, eps, setting)
    parts = Counts.empty(setting)
    # Batches of 10, 1 and 26 examples, each padded to 37 rows (one program) with the other
    # examples, which its mask leaves out.
    for lo, hi in [(0, 10), (10, 11), (11, 37)]:
        rows = np.roll(np.arange(37), -lo)
        parts = parts.merge(Counts.from_result(run(rows), jnp.arange(37) < hi - lo, eps,
                                               setting))
    assert set(whole.metrics) == set(metrics_lib.METRICS)
    for u, v in zip(jax.tree.leaves(whole), jax.tree.leaves(parts)):
        np.testing.assert_array_equal(u, v)
    assert whole.compute(setting) == parts.compute(setting)


def test_hand_computed_figures():
    c = Counts({
        "accuracy": metrics_lib.Accuracy(*map(jnp.int32, (10, 8, 2))),
        "attack_table": metrics_lib.AttackTable(jnp.int32(10), jnp.asarray([6, 4], jnp.int32)),
        "threat_models": metrics_lib.ThreatModels(jnp.int32(10), jnp.asarray([6, 4], jnp.int32),
                                                  jnp.int32(0)),
        "confident_failures": metrics_lib.ConfidentFailures(
            jnp.int32(10), jnp.asarray([5, 3, 1, 0], jnp.int32)),
        "grid_judged": metrics_lib.GridJudged(jnp.int32(10)),
    })
    white = metrics_lib.Setting(("a", "b"), (False, False))
    f = c.compute(white)
    assert f["white_box_robust_accuracy"] == 60.0 and f["black_box_robust_accuracy"] is None
    g = c.metrics["threat_models"]._replace(kind_correct=jnp.asarray([6, 3], jnp.int32),
                                            black_box_only=jnp.int32(1))
    g = Counts({**c.metrics, "threat_models": g}).compute(white._replace(black_box=(False, True)))
    assert g["white_box_robust_accuracy"] == 60.0 and g["black_box_robust_accuracy"] == 30.0
    assert g["black_box_only"] == 1
    assert f["clean_accuracy"] == 80.0 and f["robust_accuracy"] == 20.0
    assert f["relative_robustness"] == 25.0
    assert f["mat"] == {"a": 60.0, "b": 40.0} and f["wat"] == 40.0 and f["wat_attack"] == "b"
    assert f["confident_failure_rate"] == {"0.5": 50.0, "0.7": 30.0, "0.9": 10.0, "0.99": 0.0}
    assert f["grid_judged"] == 10 and f["n_examples"] == 10
    assert relative_robustness(0, 0) is None
    with pytest.raises(ValueError, match="attack names"):
        c.compute(white._replace(attack_names=("a",)))


def test_confident_failures_only_with_the_max_confidence_goal(problem):
    """Without the max-confidence goal no candidate was kept for its confidence: the figure is
    null, not a 0 % that would read as a perfect defence."""
    params, x, y, eps = problem
    without = evaluate(linear_apply, params, (x, y),
                       Plan.of(eps=eps, attacks=tuple(ATTACKS[:1]), goals=("misclassify",)))
    assert without.metrics["confident_failure_rate"] is None
    assert without.metrics["failure_rate_curve"] is None
    # ATTACKS with the default goals (max_confidence among them), as test_metrics_match_the_
    # per_example_arrays runs them: the same program, at a larger eps.
    with_ = _run(problem, batch_size=16, eps=4 * eps)
    rates = with_.metrics["confident_failure_rate"]
    confidence = with_.per_example["max_wrong_confidence"]
    for t, rate in rates.items():
        assert rate == pytest.approx(100.0 * np.mean(confidence >= float(t)))
    assert rates["0.5"] > rates["0.7"] > 0  # the check is not vacuous


def test_a_new_metric_is_one_class(problem, monkeypatch):
    """A reducer added to METRICS (and its figure to the report schema) is counted, merged and
    reported; a figure the schema does not list is refused, not reported undocumented."""
    from typing import NamedTuple

    class Fooled(NamedTuple):
        fooled: jax.Array
        goal = None

        @classmethod
        def empty(cls, setting):
            return cls(jnp.zeros((), jnp.int32))

        @classmethod
        def from_result(cls, result, mask, eps, setting):
            return cls(jnp.sum(result.attack_success.any(axis=0) & mask, dtype=jnp.int32))

        merge = metrics_lib.Accuracy.merge

        def compute(self, setting):
            return {"fooled_by_any": int(self.fooled)}

    from jaxbundle import schema

    monkeypatch.setitem(metrics_lib.METRICS, "fooled", Fooled)
    params, x, y, eps = problem
    # FGSM alone: a program of its own (the jit cache does not see METRICS: no other test may
    # run this plan), kept small.
    plan = Plan.of(eps=eps, attacks=tuple(ATTACKS[:1]), batch_size=16)
    with pytest.raises(ValueError, match=r"\['fooled_by_any'\] are not in the report schema"):
        evaluate(linear_apply, params, (x, y), plan)
    # The schema's field list as model_record reads it (evaluation fields come before "model").
    fields = list(schema._FIELDS)
    fields.insert(fields.index("model"), "fooled_by_any")
    monkeypatch.setattr(schema, "_FIELDS", tuple(fields))
    monkeypatch.setattr(schema, "_FROM_EVALUATION", tuple(fields[: fields.index("model")]))
    ev = evaluate(linear_apply, params, (x, y), plan)
    assert ev.metrics["fooled_by_any"] == int(ev.per_example["attack_success"].any(axis=1).sum())


@pytest.mark.slow
def test_two_processes_give_the_same_answer(problem, tmp_path):
    """jax.distributed with 2 processes x 4 CPU devices: one global mesh of 8 that shards
    each batch of 16 two rows a device, same answer."""
    setup = f"""
        import os, sys
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=4")
        import jax
        jax.distributed.initialize("127.0.0.1:{coordinator_port()}", num_processes=2,
                                   process_id=int(sys.argv[1]))
        assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
        """
    script = _worker_script(problem, tmp_path, setup, checkpoint=True)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__))
    # A worker normally finishes in ~15 s; a hung one dumps its stacks after 120 s and exits.
    commands = [python_command(script, str(i), deadline=120) for i in range(2)]
    assert_all_succeeded(run_processes(commands, env, timeout=180))
    _assert_same_as_single_device(problem, tmp_path, ["0", "1"])
    with np.load(tmp_path / "ckpt" / "checkpoint.npz") as saved:  # written by process 0
        assert int(saved["batches_done"]) == 3
    # Each process read only the rows its own devices take: its half of every batch (the
    # padding of the last batch repeats the last example), plus single rows for the figure.
    n = len(problem[2])
    for p in range(2):
        reads = json.loads((tmp_path / f"reads{p}.json").read_text())
        own = {min(r, n - 1) for b in range(3) for r in range(16 * b + 8 * p, 16 * b + 8 * p + 8)}
        batch_reads = [r for r in reads if r[1] - r[0] > 1]
        # Process 1's slice of the last batch (rows 40..47 of 37) is all padding: one row.
        assert len(batch_reads) == [3, 2][p]
        assert {i for a, b in batch_reads for i in range(a, b)} <= own
        assert sum(b - a for a, b in reads) <= len(own) + 8


def test_attack_descriptions_hold_no_object_addresses():
    """The checkpoint fingerprint is built from these: they must not change between processes
    (a repr() with a function's address would refuse every resume in a new process)."""
    import functools
    import re

    from jaxbundle import suites
    from jaxbundle.checkpoint import describe, fingerprint, identity

    for norm in ("linf", "l2"):
        for name in suites.ATTACKS:
            try:
                a = suites.attack(name, norm)
            except ValueError:  # not defined in this norm
                continue
            text = json.dumps(describe(a))
            assert not re.search(r"0x[0-9a-f]{6,}", text), (name, text)
            assert a.init.__module__ in text and a.name in text
    closure = functools.partial(linear_apply, {"w": 1})
    assert "0x" not in json.dumps(describe(closure)) and "linear_apply" in json.dumps(
        describe(closure)
    )
    assert identity(a=1, b=[1, 2]) == identity(b=[1, 2], a=1)
    assert fingerprint(identity(a=1, b=[1, 2])) == fingerprint(identity(b=[1, 2], a=1))
