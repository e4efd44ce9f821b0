"""The ``jaxbundle`` command: flags, errors, and end-to-end runs on a small subset.

The command runs in this process through :func:`jaxbundle.cli.main`; real processes only where
the process is the point (the installed console script, two ``jax.distributed`` processes).
The tiny demo models train once per test run, in the run's cache (``$JAXBUNDLE_CACHE``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxbundle import suites
from jaxbundle.bundles import BUNDLES
from jaxbundle.cli import main
from toys import (CLI, QUICK_TRAINING, assert_all_succeeded, coordinator_port, python_command,
                  run_processes)

TRAIN_EXAMPLES, TRAIN_EPOCHS = QUICK_TRAINING["n_train"], QUICK_TRAINING["epochs"]
TINY = ["--n", "16", "--train-examples", str(TRAIN_EXAMPLES), "--train-epochs",
        str(TRAIN_EPOCHS), "--steps", "3", "--restarts", "2", "--batch-size", "16",
        "--no-progress"]


def test_attacks_lists_every_attack(capsys):
    assert main(["attacks"]) == 0
    out = capsys.readouterr().out
    for text in ("linf", "white-box", "score-based", "decision-based", "Madry", "Goodfellow",
                 "Croce", "min_norm", "bundles", "queries", *suites.ATTACKS,
                 *BUNDLES):
        assert text in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["evaluate", "--eps", "-1"], "finite number >= 0"),
        (["evaluate", "--n", "0"], "positive integer"),
        (["evaluate", "--norm", "l7"], "invalid choice"),
        (["evaluate", "--steps", "many"], "positive integer"),
        (["evaluate", "--attacks", ""], "comma-separated"),
        (["evaluate", "--bundle", "strong"], "invalid choice"),
        (["evaluate", "--focus", "square-aa"], "ATTACK=FRACTION"),
        (["evaluate", "--focus", "square-aa=1.5"], "ATTACK=FRACTION"),
        (["evaluate", "--escalate", "square-aa=0"], "ATTACK=FRACTION"),
        (["evaluate", "--floor", "apgd-t5"], "ATTACK=FRACTION"),
        (["evaluate", "--queries", "0"], "positive integer"),
    ],
)
def test_bad_flags_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["evaluate", "--attacks", "fgsm,cw"], "unknown attack 'cw'"),
        (["evaluate", "--attacks", "cw-l2"], "works in norm 'l2', not 'linf'"),
        (["evaluate", "--models", "resnet"], "unknown demo model 'resnet'"),
        (["evaluate", "--n", "5000"], "2000"),
        (["evaluate", "--num-processes", "2", "--process-id", "2"], "process id must be in 0..1"),
        (["evaluate", "--process-id", "-1"], "process id must be in 0..N-1"),
        (["evaluate", "--focus", "rays=0.5"], "not in the plan"),
        (["evaluate", "--focus", "apgd-t=0.5"], "not in the plan"),  # the default's is apgd-t5
        (["evaluate", "--focus", "square-aa=0.5", "--schedule", "full"], "needs mode='cascade'"),
        (["evaluate", "--bundle", "broad", "--focus", "fmn=0.5"], "needs mode='cascade'"),
        (["evaluate", "--bundle", "broad", "--segments", "3"], "needs mode='cascade'"),
        (["evaluate", "--escalate", "apgd-ce=0.5"], "'apgd-ce' is the first stage"),
        (["evaluate", "--bundle", "broad", "--escalate", "fmn=0.5"], "needs mode='cascade'"),
        (["evaluate", "--widen", "square-aa=0.5"], "the plan escalates no stage before"),
        (["evaluate", "--norm", "l2", "--eps", "1", "--widen", "square-aa=0.01"],
         "its focus or more"),
        (["evaluate", "--floor", "apgd-ce=0.5"], "give 'apgd-ce' a focus fraction too"),
        (["evaluate", "--bundle", "broad", "--budget", "100"], "needs mode='cascade'"),
        (["evaluate", "--attacks", "fgsm,fgsm"], "attack names must be unique"),
        (["evaluate", "--queries", "1"], "square-aa needs queries to be an integer >= 2"),
        (["evaluate", "--bundle", "fast", "--queries", "100"], "no attack of this plan has one"),
    ],
)
def test_bad_values_exit_2_with_a_message(argv, message, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path), "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err
    assert "Traceback" not in err


def test_compare_of_a_missing_report_exits_2_naming_it(capsys):
    assert main(["compare", "/nonexistent/report"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "/nonexistent/report" in err and "Traceback" not in err


def test_the_console_script_is_installed():
    """``jaxbundle`` on the PATH of the environment the package was installed in."""
    script = os.path.join(os.path.dirname(sys.executable), "jaxbundle")
    run = subprocess.run([script, "attacks"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "apgd" in run.stdout and "bundles" in run.stdout


def _report(out):
    return json.loads((out / "report.json").read_text())


@pytest.mark.slow
def test_evaluate_end_to_end(tmp_path, capsys):
    """The command trains tiny models (once per test run), attacks 16 images with the broad
    bundle and writes the report; compare reads it. (The same command repeating its report in
    a new process: tests/test_job.py.)"""
    out = tmp_path / "report"
    argv = ["evaluate", *TINY, "--bundle", "broad", "--queries", "100", "--out", str(out),
            "--seed", "5"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "bundled robust" in printed and "MAT" in printed
    judged = "eps 0.3 (linf): 16 of 16 examples judged on the 8-bit grid, which allows 76/255"
    assert judged in printed

    report = _report(out)
    plan = report["config"]["plan"]
    assert report["schema_version"] == 2 and plan["threat_model"]["judging"] == "auto"
    default = ["fgsm", "pgd-ce", "pgd-margin", "fmn", "square", "rays"]
    assert [a["name"] for a in plan["attacks"]] == default and plan["bundle"] == "broad"
    assert plan["schedule"]["mode"] == "full" and plan["overrides"]["queries"] == 100
    assert set(report["models"]) == {"standard", "adversarial", "certified"}
    for name, m in report["models"].items():
        for key in ("clean_accuracy", "robust_accuracy", "relative_robustness", "mat", "wat",
                    "n_examples", "eps", "norm", "plan"):
            assert key in m, key
        assert m["n_examples"] == 16 and m["eps"] == 0.3 and m["norm"] == "linf"
        assert m["plan"]["run"]["seed"] == 5 and m["plan"] == plan
        assert m["judging"]["mode"] == "auto" and m["judging"]["grid_examples"] == 16
        assert m["judging"]["statement"].startswith(judged)
        assert set(m["mat"]) == set(default)
        low, high = m["certified"]["interval"]  # the demo job certifies: [certified, bundled]
        assert high == m["robust_accuracy"] >= low
        assert m["robust_accuracy"] <= min(m["white_box_robust_accuracy"],
                                           m["black_box_robust_accuracy"])
        for kind in ("white_box", "black_box", "bundled"):
            h = m["half_distortion"][kind]
            assert h["d_half"] == "inf" or 0 < h["d_half"] <= 1
        assert set(m["shifts"]) >= {"clean_accuracy", "darkness", "sharpness"}
        for fig in m["figures"].values():
            assert (out / fig).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert m["robust_accuracy"] <= m["wat"] == min(m["mat"].values()) <= m["clean_accuracy"]
        with np.load(out / m["per_example"]) as pe:
            assert pe["success"].shape == (16,) and pe["x_adv"].dtype == np.uint8
            assert list(pe["attack_names"]) == default
            assert pe["attack_distortion"].shape == (16, 6)
            clean_ok = pe["clean_prediction"] == pe["label"]
            assert m["clean_accuracy"] == pytest.approx(100 * clean_ok.mean())
            assert m["robust_accuracy"] == pytest.approx(100 * (clean_ok & ~pe["success"]).mean())
            fooled = pe["success"]
            assert np.all(pe["adversarial_prediction"][fooled] != pe["label"][fooled])
            assert np.all(pe["distortion"][fooled] <= 0.3 + 1e-6)
            # --queries reached both black-box attacks: 100 each on every example they ran on
            black = pe["queries"][clean_ok]
            assert black.size and set(black) == {200}

    md = (out / "report.md").read_text()
    assert "## adversarial" in md and "D1/2" in md and ".png)" in md
    assert f"Judged: {judged}" in md

    assert main(["compare", str(out)]) == 0
    compared = capsys.readouterr().out
    assert "adversarial" in compared and "D1/2" in compared


@pytest.mark.slow
def test_two_processes_give_the_one_process_report(tmp_path):
    """Two processes (jax.distributed, 2 CPU devices each) give the report of one process; only
    process 0 prints and writes it. Skipped (before any work) without a loopback network."""
    port = coordinator_port()
    flags = [*TINY, "--attacks", "fgsm,pgd-ce,square", "--queries", "100", "--seed", "5",
             "--models", "adversarial", "--no-shifts"]
    assert main(["evaluate", *flags, "--out", str(tmp_path / "one")]) == 0
    report = json.loads((tmp_path / "one" / "report.json").read_text())
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=2")
    out2 = tmp_path / "two"
    flags += ["--out", str(out2), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    # Each process takes ~20 s; a hung one dumps its stacks after 240 s and exits.
    two = [python_command(CLI, "evaluate", *flags, "--process-id", str(i), deadline=240)
           for i in range(2)]
    results = run_processes(two, env, timeout=300)
    assert_all_succeeded(results)
    (_, log0), (_, log1) = results
    assert "bundled robust" in log0 and "bundled robust" not in log1
    report2 = json.loads((out2 / "report.json").read_text())
    assert set(report2["models"]) == {"adversarial"}
    for key in ("clean_accuracy", "robust_accuracy", "mat", "half_distortion"):
        assert report2["models"]["adversarial"][key] == report["models"]["adversarial"][key], key


@pytest.mark.slow
def test_default_bundle_runs_as_a_focused_cascade(tmp_path, capsys):
    """The main job's default bundle: APGD-CE, then APGD-CE 100 and APGD-T on the more
    promising half of the survivors, Square probed on every survivor and then on its share,
    reported stage by stage."""
    out = tmp_path / "report"
    argv = ["evaluate", *TINY, "--n", "24", "--models", "adversarial", "--no-shifts", "--queries",
            "300", "--out", str(out)]  # two batches: 16 + 8
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    focus = {"apgd-ce-long": 0.5, "apgd-t5": 0.5, "square-aa": 0.06}
    plan = report["config"]["plan"]
    assert plan["bundle"] == "default" and plan["schedule"]["mode"] == "cascade"
    assert plan["schedule"]["focus"] == focus
    assert plan["schedule"]["floor"] == {"apgd-ce-long": 0.125, "apgd-t5": 0.125}
    m = report["models"]["adversarial"]
    stages = m["schedule"]["stages"]
    assert [s["attack"] for s in stages] == ["apgd-ce", "apgd-ce-long", "apgd-t5", "square-aa"]
    assert m["schedule"]["focus"] == focus
    assert plan["schedule"]["segments"] == m["schedule"]["segments"] == 6
    # A focused stage ran, in each batch of 16 (24 examples: 16 + 8; balanced batches are
    # multiples of 16 here), on survivors of the stages before only, as many as a halving of
    # the batch (16, 8, 4, 2, 1; or all survivors, where the bucket would hold more) at least
    # the nearest bucket (16 x 1, 3/4, 1/2, 3/8, ...) to max(fraction * survivors, 1), so
    # within a factor 2 of it; the stage's count is what ran.
    with np.load(out / m["per_example"]) as pe:
        ok = pe["clean_prediction"] == pe["label"]
        ran = pe["attack_step"] != -2
        focused = 0  # batches where focus had survivors to leave out
        for k, fraction in ((1, 0.5), (2, 0.5)):
            before = ok & ~pe["attack_success"][:, :k].any(1)
            assert not (ran[:, k] & ~before).any(), k
            assert stages[k]["examples"] == ran[:, k].sum(), k
            for rows in (slice(0, 16), slice(16, 24)):
                n, r = int(before[rows].sum()), int(ran[rows, k].sum())
                if n == 0:
                    assert r == 0
                    continue
                focused += n > 1
                assert r == n or r in (1, 2, 4, 8, 16), (k, n, r)
                assert r >= min(n, 2), (k, n, r)  # the floor: 1/8 of the batch of 16
                assert 2 ** -0.5 <= r / max(fraction * n, 1) <= 2, (k, n, r)
        assert focused >= 2
        # Square: its probe (5 % of its 299 steps: 15, plus the first query) on every
        # survivor, then its share went on; those it neither fooled nor kept were cut.
        before = ok & ~pe["attack_success"][:, :3].any(1)
        np.testing.assert_array_equal(ran[:, 3], before)
        assert (pe["queries"] > 0).sum() == stages[3]["examples"] == before.sum()
        assert set(pe["queries"][ran[:, 3]]) <= set(range(1, 301))
        cut = before & (pe["queries"] == 16) & ~pe["attack_success"][:, 3]
        assert stages[3]["cut"] == cut.sum() > 0
        assert (pe["queries"][before & ~cut & ~pe["attack_success"][:, 3]] == 300).all()
    assert m["robust_accuracy"] == stages[-1]["robust_accuracy"]
    assert "square-aa" in capsys.readouterr().out


@pytest.mark.slow
def test_randomized_defence_with_eot_end_to_end(tmp_path, capsys):
    """The demo defence and a user's stochastic model: EOT, the judge's calls and the
    threshold from the flags, the stochastic section in report.json, .md and the console."""
    model_file = tmp_path / "noisy.py"
    model_file.write_text(
        "import jax, jaxbundle\n"
        "from jaxbundle import models\n"
        "def model():\n"
        "    apply_fn, params = models.load_or_train(\n"
        f"        models.ADVERSARIAL._replace(n_train={TRAIN_EXAMPLES}, epochs={TRAIN_EPOCHS}))\n"
        "    noisy = lambda p, x, key: apply_fn(p, x + 0.05 * jax.random.normal(key, x.shape))\n"
        "    return jaxbundle.stochastic(noisy), params\n")
    out = tmp_path / "report"
    argv = ["evaluate", *TINY, "--models", "randomized,adversarial", "--model",
            f"noisy={model_file}:model", "--attacks", "fgsm,pgd-ce", "--eot", "4",
            "--judge-calls", "8", "--success-threshold", "0.25", "--no-shifts",
            "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "judged over 8 fresh calls" in printed
    report = json.loads((out / "report.json").read_text())
    stochastic = report["config"]["plan"]["stochastic"]
    assert stochastic == {"eot": 4, "judge_calls": 8, "success_threshold": 0.25}
    deterministic = report["models"]["adversarial"]
    assert deterministic["stochastic"] is None  # deterministic: no EOT, as its plan says
    assert deterministic["plan"]["stochastic"] == {"eot": 1, "judge_calls": None,
                                                   "success_threshold": None}
    for name in ("randomized", "noisy"):
        m = report["models"][name]
        s = m["stochastic"]
        assert (s["calls"], s["threshold"], s["eot"]) == (8, 0.25, {"fgsm": 4, "pgd-ce": 4})
        assert m["checks"]["randomness"]["passed"], m["checks"]["randomness"]
        assert abs(100 * s["robust_accuracy_at_threshold"]["0.25"] - m["robust_accuracy"]) < 1e-6
        with np.load(out / m["per_example"]) as pe:
            np.testing.assert_array_equal(pe["success"], pe["success_rate"] > 0.25)
            ok = pe["clean_success_rate"] <= 0.25
            assert np.all(pe["gradients"][ok] == 4 * (1 + 3 * 2))  # fgsm + pgd 3 steps x 2
    assert "judged over 8 fresh calls" in (out / "report.md").read_text()
    # Best-effort mode does not support a stochastic model yet: a clear error.
    assert main(["evaluate", *TINY, "--models", "randomized", "--attacks", "fgsm",
                 "--best-effort", "--no-shifts", "--out", str(out)]) == 2
    assert "best-effort mode and surrogates do not support" in capsys.readouterr().err
