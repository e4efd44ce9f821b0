"""The main job as a user runs it: their own flax ``nn.Conv`` model (written and trained here),
their data (``npz:``, ``tfds:`` over a real tensorflow-datasets builder, a CIFAR-shaped colour
set), presets, and a run killed with SIGKILL and started again.

The CLI runs in this process through ``jaxbundle.cli.main`` (and the experiment scripts through
their ``run``), where a new process adds nothing; real processes where the process is the point:
a run killed with SIGKILL and resumed by a new one, and a new process served by the persistent
compilation cache."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxbundle
from jaxbundle import cli, data, job, presets

USER_MODULE = textwrap.dedent('''
    """A user's model: an ordinary flax CNN, weights saved with flax.serialization."""
    import os

    import flax.linen as nn
    import flax.serialization
    import jax
    import jax.numpy as jnp

    SHAPE = {shape}


    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = (x - 0.13) / 0.31  # the user's normalisation, inside the model
            x = nn.relu(nn.Conv(8, (3, 3), strides=(2, 2))(x))
            x = nn.relu(nn.Conv(16, (3, 3), strides=(2, 2))(x))
            return nn.Dense(10)(x.reshape(x.shape[0], -1))


    def init():
        return CNN().init(jax.random.key(0), jnp.zeros((1, *SHAPE)))


    def model():
        template = jax.eval_shape(init)
        path = os.path.join(os.path.dirname(__file__), "{weights}")
        with open(path, "rb") as f:
            params = flax.serialization.from_bytes(template, f.read())
        return CNN().apply, params
''')


def _write_model(directory, shape, x, y, name, steps=150):
    """Writes ``<name>.py`` and trains its CNN on ``(x, y)`` for a few seconds."""
    source = USER_MODULE.format(shape=tuple(shape), weights=f"{name}.msgpack")
    path = directory / f"{name}.py"
    path.write_text(source)
    namespace: dict = {"__file__": str(path)}
    exec(compile(source, str(path), "exec"), namespace)
    params = namespace["init"]()
    apply = namespace["CNN"]().apply
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state, xb, yb):
        loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(apply(p, xb), yb).mean()  # noqa: E731
        grads = jax.grad(loss)(params)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(0)
    for _ in range(steps):
        i = rng.integers(0, len(y), 64)
        params, state = step(params, state, x[i], y[i])
    (directory / f"{name}.msgpack").write_bytes(flax.serialization.to_bytes(params))
    return apply, params


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """A user's directory: a gray and a colour model, npz data, a prepared tfds data_dir."""
    import tfds_datasets

    root = tmp_path_factory.mktemp("user")
    train = data.load_mnist_sample("train", n=2000)
    gray = _write_model(root, (28, 28, 1), train.x, train.y, "gray_cnn")
    tfds_dir = root / "tfds"
    tfds_datasets.prepare(str(tfds_dir))
    colour = data.open_source("tfds:tiny_colour:train", data_dir=str(tfds_dir))
    cx, cy = colour.read(0, len(colour))
    colour_model = _write_model(root, (32, 32, 3), data.to_unit_float(cx), cy, "colour_cnn")
    test = data.load_mnist_sample("test", n=64)
    np.savez(root / "digits.npz", x=np.round(test.x * 255).astype(np.uint8), y=test.y)
    return {"root": root, "tfds": str(tfds_dir), "gray": gray, "colour": colour_model,
            "cache": str(root / "cache")}


EXPERIMENTS = os.path.join(os.path.dirname(__file__), os.pardir, "experiments")


def _script(name):
    """The experiment script ``experiments/<name>.py`` as a module (its ``run`` and
    ``DEFAULTS``), imported, not run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"experiment_{name}", os.path.join(EXPERIMENTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, EXPERIMENTS)  # the scripts import their shared _evaluate
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(EXPERIMENTS)
    return module


def _flags(user, *flags):
    return ["--no-progress", "--batch-size", "16", "--cache-dir", user["cache"], *flags]


def _main(user, capsys, monkeypatch, *flags, script=None):
    """``jaxbundle evaluate FLAGS`` (or ``experiments/SCRIPT.py FLAGS``) in this process, in
    the user's directory: ``(exit code, stdout, stderr)``."""
    monkeypatch.chdir(user["root"])
    capsys.readouterr()
    if script is None:
        code = cli.main(["evaluate", *_flags(user, *flags)])
    else:
        module = _script(script)
        code = module.run(module.DEFAULTS, _flags(user, *flags))
    out, err = capsys.readouterr()
    return code, out, err


def _command(user, *flags):
    """``python -m jaxbundle evaluate FLAGS``, for a new process."""
    return [sys.executable, "-m", "jaxbundle", "evaluate", *_flags(user, *flags)]


def _process(user, *flags, timeout=600):
    """:func:`_command` run to the end in a new process, in the user's directory."""
    return subprocess.run(_command(user, *flags), capture_output=True, text=True,
                          timeout=timeout, cwd=user["root"])


def _report(out):
    return json.loads((out / "report.json").read_text())


def _check_against_the_model(model, source, metrics, per_example, eps):
    """Clean predictions in the report are the model's own, every success is re-checked."""
    apply_fn, params = model
    x, y = source.read(0, len(source))
    x = data.to_unit_float(x)
    predictions = np.asarray(jnp.argmax(apply_fn(params, x), -1))
    np.testing.assert_array_equal(per_example["clean_prediction"], predictions)
    np.testing.assert_array_equal(per_example["label"], y)
    assert metrics["clean_accuracy"] == pytest.approx(100 * np.mean(predictions == y))
    fooled = per_example["success"]
    assert fooled.any()
    if "x_adv" in per_example:
        xa = per_example["x_adv"]
        xa = xa / 255.0 if xa.dtype == np.uint8 else xa
        assert np.all(np.abs(xa - x).reshape(len(y), -1).max(1)[fooled] <= eps + 1e-6)
        again = np.asarray(jnp.argmax(apply_fn(params, jnp.asarray(xa, jnp.float32)), -1))
        assert np.all(again[fooled] != y[fooled])


@pytest.mark.slow
def test_user_model_on_npz_data(user, tmp_path, capsys, monkeypatch):
    out = tmp_path / "npz"
    code, _, err = _main(user, capsys, monkeypatch, "--model", "cnn=gray_cnn.py:model",
                         "--data", "npz:digits.npz", "--preset", "mnist-linf", "--eps", "0.1",
                         "--attacks", "fgsm,pgd-ce", "--steps", "10", "--out", str(out))
    assert code == 0, err[-3000:]
    report = _report(out)
    m = report["models"]["cnn"]
    assert m["model"] == "gray_cnn.py:model" and report["config"]["dataset"] == "npz:digits.npz"
    assert report["config"]["threat_model"] == {
        "preset": "mnist-linf", "reference": "Madry et al. 2018", "overridden": ["eps"]
    }
    assert m["eps"] == 0.1 and m["n_examples"] == 64
    with np.load(out / m["per_example"]) as pe:
        per_example = dict(pe)
    assert "x_adv" not in per_example  # streamed data: images only with --save-images
    source = data.open_source(f"npz:{user['root'] / 'digits.npz'}")
    _check_against_the_model(user["gray"], source, m, per_example, 0.1)
    assert 0 < m["robust_accuracy"] < m["clean_accuracy"]


@pytest.mark.slow
def test_user_model_on_tfds_data_with_saved_images(user, tmp_path, capsys, monkeypatch):
    """Through the MNIST experiment script, its dataset replaced by the test's own."""
    out = tmp_path / "tfds"
    code, _, err = _main(user, capsys, monkeypatch, "--model",
                         str(user["root"] / "gray_cnn.py") + ":model",
                         "--data", "tfds:tiny_digits:test", "--data-dir", user["tfds"], "--eps",
                         "0.1", "--attacks", "fgsm,pgd-ce", "--steps", "10", "--save-images",
                         "--no-shifts", "--out", str(out), script="mnist")
    assert code == 0, err[-3000:]
    m = _report(out)["models"]["model"]
    assert m["n_examples"] == 96 and m["data"]["name"] == "tfds:tiny_digits/test"
    with np.load(out / m["per_example"]) as pe:
        per_example = dict(pe)
    from jaxbundle.evaluation import load_images

    x_adv, ids = load_images(str(out / "adversarial" / "model"))
    np.testing.assert_array_equal(ids, np.arange(96))
    assert x_adv.dtype == np.uint8 and len(os.listdir(out / "adversarial" / "model")) == 6
    per_example["x_adv"] = x_adv
    source = data.open_source("tfds:tiny_digits:test", data_dir=user["tfds"])
    _check_against_the_model(user["gray"], source, m, per_example, 0.1)


@pytest.mark.slow
def test_cifar_shaped_colour_run_with_the_cifar_preset(user, tmp_path, capsys, monkeypatch):
    """Through the CIFAR-10 experiment script (its preset), on 32x32 colour images."""
    out = tmp_path / "colour"
    code, _, err = _main(user, capsys, monkeypatch, "--model", "colour=colour_cnn.py:model",
                         "--data", "tfds:tiny_colour", "--data-dir", user["tfds"], "--bundle",
                         "fast", "--restarts", "1", "--steps", "10", "--no-shifts", "--out",
                         str(out), script="cifar10")
    assert code == 0, err[-3000:]
    report = _report(out)
    assert report["config"]["threat_model"]["preset"] == "cifar10-linf"
    m = report["models"]["colour"]
    assert m["eps"] == pytest.approx(8 / 255) and m["norm"] == "linf"
    assert m["judging"]["grid_examples"] == 96
    with np.load(out / m["per_example"]) as pe:
        per_example = dict(pe)
    source = data.open_source("tfds:tiny_colour", data_dir=user["tfds"])
    _check_against_the_model(user["colour"], source, m, per_example, 8 / 255)


@pytest.mark.slow
def test_user_errors_are_one_line(user, tmp_path, capsys, monkeypatch):
    cases = [
        (["--model", "gray_cnn.py:nope"], "has no function 'nope'"),
        (["--model", "missing.py:model"], "no such file"),
        (["--model", "cnn=gray_cnn.py:model", "--data", "tfds:tiny_colour", "--data-dir",
          user["tfds"], "--eps", "0.1"], "fails under jax.jit"),
        (["--data", "npz:nothing.npz", "--eps", "0.1"], "does not exist"),
        (["--data", "tfds:tiny_digits", "--data-dir", str(tmp_path)], "prepared in"),
        (["--model", "cnn=gray_cnn.py:model", "--data", "npz:digits.npz"], "no threat-model"),
        (["--data", "sql:db"], "unknown data source"),
        (["--model", "cnn=gray_cnn.py:model", "--data", "npz:digits.npz", "--eps", "0.1",
          "--attacks", "fgsm", "--queries", "100"], "no attack of this plan has one"),
    ]
    for flags, message in cases:
        code, _, err = _main(user, capsys, monkeypatch, *flags, "--out", str(tmp_path / "never"))
        assert code == 2, (flags, err[-2000:])
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and message in lines[0], (flags, err)
        assert not (tmp_path / "never").exists()


def _strip_timing(report):
    for m in report["models"].values():
        m.pop("seconds")
    return report


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_answer(user, tmp_path, capsys, monkeypatch):
    """SIGKILL mid-run, the same command again in a new process: the report and every
    per-example array equal those of a run that was never interrupted (the fingerprint is
    stable across processes); a checkpoint of another evaluation is refused in one line."""
    flags = ["--model", "cnn=gray_cnn.py:model", "--model", "again=gray_cnn.py:model",
             "--data", "npz:digits.npz", "--eps", "0.15", "--attacks", "pgd-ce,square",
             "--steps", "10", "--queries", "100", "--seed", "3", "--no-shifts", "--batch-size",
             "8"]
    whole = tmp_path / "whole"
    code, _, err = _main(user, capsys, monkeypatch, *flags, "--out", str(whole))
    assert code == 0, err[-3000:]
    with np.load(whole / "cnn.npz") as pe:  # --queries reached Square: 100 per example
        attacked = pe["clean_prediction"] == pe["label"]
        assert attacked.any() and set(pe["queries"][attacked]) <= {100}

    out, ckpt = tmp_path / "resumed", tmp_path / "ckpt"
    again = [*flags, "--out", str(out), "--checkpoint-dir", str(ckpt)]
    proc = subprocess.Popen(_command(user, *again), cwd=user["root"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    first = ckpt / "cnn" / "checkpoint.npz"
    deadline = time.monotonic() + 300
    done = 0
    while time.monotonic() < deadline and proc.poll() is None:
        if first.exists():
            with np.load(first) as saved:  # never a partial file: the write is atomic
                done = int(saved["batches_done"])
            if done >= 2:
                break
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert 2 <= done < 8 and not (out / "report.json").exists()

    resumed = _process(user, *again)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _strip_timing(_report(out)) == _strip_timing(_report(whole))
    for name in ("cnn", "again"):
        with np.load(whole / f"{name}.npz") as a, np.load(out / f"{name}.npz") as b:
            assert sorted(a.files) == sorted(b.files)
            for key in a.files:
                np.testing.assert_array_equal(a[key], b[key], err_msg=key)

    # A checkpoint of another evaluation is refused, in one line.
    code, _, err = _main(user, capsys, monkeypatch, *again, "--eps", "0.2")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "belongs to a different evaluation" in lines[0]


def test_presets():
    assert presets.resolve("mnist_sample/test[:20]", None, None, None)[:2] == ("linf", 0.3)
    assert presets.resolve("tfds:cifar10/test", None, None, None)[:2] == ("linf", 8 / 255)
    assert presets.resolve("tfds:cifar10/test", None, "l2", None)[:2] == ("l2", 0.5)
    norm, eps, record = presets.resolve("tfds:imagenet2012/validation", None, None, None)
    assert (norm, eps, record["preset"]) == ("linf", 4 / 255, "imagenet-linf")
    assert presets.resolve("tfds:imagenet_v2/matched", "imagenet-linf-amich", None, None)[1] == (
        8 / 255
    )
    assert presets.resolve("tfds:cifar10/test", "cifar10-linf-amich", None, None)[1] == 0.2
    assert presets.resolve("npz:x.npz", None, "l2", 1.0) == ("l2", 1.0, {"preset": None})
    with pytest.raises(ValueError, match="no threat-model preset"):
        presets.resolve("npz:x.npz", None, None, None)
    with pytest.raises(ValueError, match="no l2 preset for mnist"):
        presets.resolve("mnist_sample/test", None, "l2", None)
    with pytest.raises(ValueError, match="unknown preset"):
        presets.resolve("mnist_sample/test", "svhn", None, None)


@pytest.mark.slow
def test_compilation_cache_serves_a_second_run(user, tmp_path):
    """The same command run twice, each in a new process: the second compiles nothing new
    (the persistent cache gains no entries) and gives the same report. (How much time it
    saves: benchmarks/compile_cache.py.)"""
    cache = tmp_path / "cache"
    flags = ["--model", "cnn=gray_cnn.py:model", "--data", "npz:digits.npz", "--eps", "0.1",
             "--attacks", "pgd-ce", "--steps", "5", "--no-shifts", "--cache-dir", str(cache)]
    entries = []
    for i in range(2):
        run = _process(user, *flags, "--out", str(tmp_path / f"r{i}"))
        assert run.returncode == 0, run.stderr[-3000:]
        entries.append(sorted(os.listdir(cache / "xla")))
    assert entries[0] and entries[1] == entries[0]
    assert _strip_timing(_report(tmp_path / "r0")) == _strip_timing(_report(tmp_path / "r1"))


@pytest.mark.slow
def test_run_job_as_a_library_call(user, tmp_path):
    """What the CLI does, from Python, with best effort and a surrogate in the same report."""
    apply_fn, params = user["gray"]
    source = data.head(data.open_source(f"npz:{user['root'] / 'digits.npz'}"), 32)
    model = job.ModelRef("mine", lambda progress: (apply_fn, params), "test")
    surrogate = job.ModelRef("copy", lambda progress: (apply_fn, params), "test")
    plan = jaxbundle.Plan.of(eps=0.1, attacks=("pgd-ce",), steps=10, batch_size=16)
    path, results = job.run_job(
        [model], source, plan, job.JobOptions(out=str(tmp_path / "lib"), shifts=True,
                                              best_effort=True, surrogates=[surrogate]),
    )
    report = json.loads(open(path).read())
    m = report["models"]["mine"]
    assert m["shift_examples"] == 32 and "darkness" in m["shifts"]
    assert m["best_effort"]["attacks"] == ["pgd-ce"]
    assert m["best_effort"]["half_distortion"]["d_half"] != 0
    # The surrogate is the model itself: transfer is the white-box attack, example by example.
    evaluation, _ = results["mine"]
    np.testing.assert_array_equal(
        evaluation.per_example["transfer_success"], evaluation.per_example["success"]
    )
    assert m["transfer"]["transfer_robust_accuracy"] == pytest.approx(m["robust_accuracy"])
    be = evaluation.per_example["best_effort_distortion"]
    fooled = evaluation.per_example["success"]
    assert np.all(be[fooled] <= 0.1 + 1e-6)
    # The job's own checks (their rules: tests/test_checks.py's truth table): the transfer is
    # the white-box attack itself, so it beats it nowhere; non-monotone's column holds exactly
    # the correctly classified examples (by the model itself) that the bisection fooled within
    # eps and the evaluation at eps did not.
    assert m["checks"]["transfer_beats_white_box"] == {
        "passed": True, "examples": 0,
        "saw": "0 correctly classified examples were fooled by a surrogate's transfer and by "
               "no white-box attack on the model",
        "means": "another model's gradients fool it where its own do not (gradient masking)",
        "advice": "trust the transfer or bundled figure; try --bpda (jaxbundle.with_bpda), "
                  "--eot, other losses"}
    names = m["check_flag_names"]
    assert names[-2:] == ["non_monotone", "transfer_beats_white_box"]
    flags = evaluation.per_example["check_flags"]
    assert flags.shape == (32, len(names))
    x, y = source.read(0, 32)
    correct = np.asarray(jnp.argmax(apply_fn(params, data.to_unit_float(x)), -1)) == y
    flagged = flags[:, names.index("non_monotone")]
    np.testing.assert_array_equal(flagged, correct & (be <= 0.1 + 1e-6) & ~fooled.astype(bool))
    assert m["checks"]["non_monotone"]["examples"] == int(flagged.sum())
    assert not flags[:, names.index("transfer_beats_white_box")].any()


def test_progress_on_a_log_is_plain_lines_at_a_modest_rate():
    """On a console that is no terminal (a pod's log, ``> file``) progress is printed as lines:
    when a task starts, changes phase or completes, and in between at most once per interval;
    on a terminal it stays rich's bars."""
    import io

    from rich.console import Console

    from jaxbundle.run import progress

    now = [0.0]
    buf = io.StringIO()
    log = Console(file=buf, width=100)
    assert not log.is_terminal
    lines = progress.Lines(log, interval=30.0, clock=lambda: now[0])
    task = lines.add_task("m: train or load")
    for step in range(1, 101):  # 100 steps, one per second
        now[0] = float(step)
        lines.update(task, completed=step, total=100)
    lines.update(task, completed=100, total=100)  # repeated: not printed again
    now[0] = 101.0
    lines.update(task, description="m: natural shifts")
    printed = buf.getvalue().splitlines()
    assert printed == ["[      0 s] m: train or load", "[     30 s] m: train or load 30/100",
                       "[     60 s] m: train or load 60/100", "[     90 s] m: train or load 90/100",
                       "[    100 s] m: train or load 100/100",
                       "[    101 s] m: natural shifts"]
    assert isinstance(progress.progress(log, True), progress.Lines)
    assert not isinstance(
        progress.progress(Console(file=io.StringIO(), force_terminal=True), True), progress.Lines)
    assert not isinstance(progress.progress(log, False), progress.Lines)  # --no-progress
