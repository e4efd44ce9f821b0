"""Certification inside an evaluation: the plan's rules, the per-example arrays and the record,
the sandwich [certified, bundled] on models with known answers, and the CLI."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import Plan, arithmetic, evaluate, norms, stochastic
from jaxbundle.certify import crown
from jaxbundle.certify import run as certify_run
from jaxbundle.cli import main
from toys import images, linear_apply, linear_problem, min_distance

ATTACKS = ("apgd-ce", "apgd-t3")


@pytest.mark.parametrize("fields, message", [
    ({"certify": "exact"}, "certify must be one of"),
    ({"certify": "complete", "norm": "l2"}, "linf norm only"),
    ({"certify": "crown", "certify_time_limit": 5.0}, "needs certify='complete'"),
    ({"certify": "complete", "certify_time_limit": 0.0}, "seconds > 0"),
])
def test_bad_certify_fields_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        Plan.of(eps=0.1, attacks=("fgsm",), **fields).check()


def test_certify_needs_the_right_kind_of_model():
    def noisy(params, x, key):
        return linear_apply(params, x + 0.1 * jax.random.normal(key, x.shape))

    with pytest.raises(ValueError, match="bounds a deterministic model"):
        Plan.of(eps=0.1, attacks=("fgsm",), certify="crown").check(stochastic(noisy))
    with pytest.raises(ValueError, match="jaxbundle.certify.gaussian"):
        Plan.of(eps=0.1, attacks=("fgsm",), certify="smoothing").check(linear_apply)
    assert Plan.of(eps=0.1, attacks=("fgsm",), certify="crown").describe()["certify"] == {
        "method": "crown", "time_limit": None}


@pytest.fixture(scope="module")
def linear():
    params, x, y = linear_problem(n=40, k=4, seed=3)
    eps = float(np.quantile(min_distance(params, x, y, "linf"), 0.5))
    plan = Plan.of(eps=eps, attacks=ATTACKS, steps=20, judging="float", certify="crown",
                batch_size=16)
    return params, np.asarray(images(x)), y, evaluate(linear_apply, params, (images(x), y), plan,
                                                      mesh=None)


def test_a_linear_model_is_decided_on_both_sides(linear):
    """CROWN is exact on a linear model (the box aside, which only helps it), and the attacks
    find the minimum there: certified where the true distance exceeds eps, fooled where it is
    below; nothing both, and the interval is as narrow as the attacks are strong."""
    params, x, y, result = linear
    pe, m = result.per_example, result.metrics
    distance = min_distance(params, x.reshape(len(x), -1), y, "linf")
    eps = m["eps"]
    certified, fooled = pe["certified"], pe["success"]
    assert not np.any(certified & fooled)
    assert np.all(certified[distance > eps * 1.001])
    assert np.all(fooled[distance < eps * 0.999])
    record = m["certified"]
    assert record["method"] == "crown" and record["certified_and_fooled"] == 0
    assert record["certified_robust_accuracy"] == pytest.approx(100 * certified.mean())
    assert record["interval"] == [record["certified_robust_accuracy"], m["robust_accuracy"]]
    assert record["undecided"] == int(np.sum(~certified & ~fooled))
    assert m["checks"]["certified_and_fooled"]["passed"]
    assert "certified_and_fooled" in m["check_flag_names"]
    # The bound margin is a lower bound of the margin at the clean image.
    logits = np.asarray(linear_apply(params, jnp.asarray(x)))
    clean = logits[np.arange(len(y)), y] - np.max(
        np.where(np.eye(logits.shape[1], dtype=bool)[y], -np.inf, logits), axis=1)
    assert np.all(pe["bound_margin"] <= clean + 1e-4)


def test_the_certified_radius_is_sandwiched_by_the_truth_and_the_attacks(linear):
    """The certified side of P(D): each example's certified radius is at least the exact
    distance to the decision boundary (less the bisection's resolution: CROWN is exact here)
    and never above a distortion an attack fooled it at."""
    params, x, y, result = linear
    pe, m = result.per_example, result.metrics
    distance = min_distance(params, x.reshape(len(x), -1), y, "linf")
    radius = pe["certified_radius"]
    assert np.all(radius >= distance - 2.0 ** -certify_run.RADIUS_STEPS - 1e-6)
    found = pe["min_distortion_bundled"]
    assert np.all(radius[np.isfinite(found)] <= found[np.isfinite(found)] * (1 + 1e-5))
    upper, lower = (np.asarray(m["operating_characteristic"][k]) for k in ("certified",
                                                                             "bundled"))
    assert np.all(lower <= upper + 1e-12)  # the attacks' P(D) under the certified bound
    assert m["half_distortion"]["certified"]["d_half"] <= m["half_distortion"]["bundled"][
        "d_half"]


def _relu_net(seed: int):
    """A random ReLU network on 2x2x1 images (4 inputs, 8 hidden units, 4 classes)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"w1": jax.random.normal(k1, (4, 8)), "b1": jnp.full((8,), 0.1),
              "w2": jax.random.normal(k2, (8, 4))}

    def apply_fn(p, x):
        h = jax.nn.relu(x.reshape(x.shape[0], -1) @ p["w1"] + p["b1"][None, :])
        return h @ p["w2"]

    return apply_fn, params


def test_complete_mode_decides_every_example_of_a_small_relu_net():
    apply_fn, params = _relu_net(0)
    x = jax.random.uniform(jax.random.key(1), (24, 2, 2, 1))
    y = np.asarray(jnp.argmax(apply_fn(params, x), axis=1))
    plan = Plan.of(eps=0.15, attacks=ATTACKS[:1], steps=20, judging="float", certify="complete",
                certify_time_limit=20.0)
    result = evaluate(apply_fn, params, (x, y), plan, mesh=None)
    pe, record = result.per_example, result.metrics["certified"]
    status = pe["exact_status"]
    assert np.all(status != certify_run.EXACT["unknown"])  # small enough to decide exactly
    assert np.array_equal(pe["certified"], status == certify_run.EXACT["certified"])
    assert np.all(pe["certified"][pe["bound_certified"]])  # CROWN's verdict kept beside
    assert 0 < pe["bound_certified"].sum() < pe["certified"].sum()  # the MIP certified more
    assert not np.any(pe["certified"] & pe["success"])
    assert np.all(status[pe["success"]] == certify_run.EXACT["attacked"])
    assert record["exact"]["unknown"] == 0 and record["exact"]["off_grid"] == 0
    assert record["exact"]["certified"] + record["exact"]["attacked"] == len(y)
    assert record["exact"]["bound_certified"] == pe["bound_certified"].sum()
    assert record["certified_and_fooled"] == 0 and record["bound_above_model"] == 0
    assert np.all(pe["bound_margin"] <= pe["clean_margin"])
    missed = record["exact"]["missed_by_attacks"]
    assert result.metrics["checks"]["missed_by_attacks"]["examples"] == missed
    # Exact: the interval closes up to what the attacks missed.
    assert record["undecided"] == missed


def test_on_8_bit_data_every_grid_image_of_a_certified_ball_is_classified_right():
    """Examples on the 8-bit grid are certified at the grid's radius (8/255 here, whole
    levels): every 8-bit image within 8 levels of each pixel (17^4 per example) is classified
    right by the model, as the judge computes it, wherever an example is certified; and the
    attacks, judged on the grid, fool none of those whose every grid image is right."""
    k1, k2 = jax.random.split(jax.random.key(7))
    params = {"w1": jax.random.normal(k1, (4, 8)), "w2": jax.random.normal(k2, (8, 4))}

    def apply_fn(p, x):  # boundaries through the middle of the box
        return jax.nn.relu((x.reshape(x.shape[0], -1) - 0.5) @ p["w1"]) @ p["w2"]

    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.integers(0, 256, size=(16, 2, 2, 1)) / 255.0, jnp.float32)
    y = np.asarray(jnp.argmax(jax.jit(apply_fn)(params, x), axis=1))
    plan = Plan.of(eps=8 / 255, attacks=ATTACKS, steps=20, certify="crown")
    result = evaluate(apply_fn, params, (x, y), plan, mesh=None)
    pe = result.per_example
    assert np.all(pe["judged_on_grid"]) and 0 < pe["certified"].sum() < len(y)
    steps = np.stack(np.meshgrid(*[np.arange(-8, 9)] * 4, indexing="ij"), -1).reshape(-1, 4)
    grid = np.clip(np.round(np.asarray(x).reshape(16, 1, 4) * 255) + steps[None], 0, 255)
    with arithmetic.stated():
        logits = jax.jit(apply_fn)(params, jnp.asarray(grid.reshape(-1, 2, 2, 1) / 255.0,
                                                       jnp.float32))
    right = np.all(np.asarray(jnp.argmax(logits, axis=1)).reshape(16, -1) == y[:, None], axis=1)
    assert np.all(right[pe["certified"]]) and not np.all(right)
    assert not np.any(pe["success"] & right)


@pytest.mark.parametrize("method", ["ibp", "crown-ibp", "crown", "complete"])
def test_an_unsound_bound_fires_the_checks_in_every_mode(method, monkeypatch):
    """A bound that claims too much (every margin bound raised by 10) is caught wherever it
    certifies an example an attack fooled, and wherever it is above the model's own margin at
    the clean image; the complete mode keeps the bound's verdict beside the MIP's and does not
    relabel an example the attacks fooled (which hid the contradiction)."""
    apply_fn, params = _relu_net(0)
    x = jax.random.uniform(jax.random.key(1), (16, 2, 2, 1))
    y = np.asarray(jnp.argmax(jax.jit(apply_fn)(params, x), axis=1))
    honest = certify_run._bound_margin

    def unsound(*args, **kwargs):
        return honest(*args, **kwargs) + 10.0

    monkeypatch.setattr(certify_run, "_bound_margin", unsound)
    plan = Plan.of(eps=0.3, attacks=ATTACKS[:1], steps=10, judging="float", certify=method,
                certify_time_limit=5.0 if method == "complete" else None)
    result = evaluate(functools.partial(apply_fn), params, (x, y), plan, mesh=None)
    pe, record, checks = result.per_example, result.metrics["certified"], \
        result.metrics["checks"]
    fooled = int(pe["success"].sum())
    assert fooled > 0 and record["certified_and_fooled"] == fooled
    assert not checks["certified_and_fooled"]["passed"]
    assert checks["certified_and_fooled"]["examples"] == fooled
    assert record["bound_above_model"] == len(y) and not checks["bound_above_model"]["passed"]
    if method == "complete":
        assert np.all(pe["exact_status"] == certify_run.EXACT["certified"])
        assert np.all(pe["bound_certified"])


def test_a_relaxation_that_cuts_too_low_fires_the_check(monkeypatch):
    """An unsound ReLU relaxation (the chord's intercept dropped: below the ReLU where it
    straddles 0) makes CROWN certify examples the attacks fool; the check sees them."""
    apply_fn, params = _relu_net(0)
    x = jax.random.uniform(jax.random.key(1), (16, 2, 2, 1))
    y = np.asarray(jnp.argmax(jax.jit(apply_fn)(params, x), axis=1))
    honest = crown._relaxations

    def cut(graph, state, index):
        below, (slope, _) = honest(graph, state, index)
        return below, (slope, None)

    plan = Plan.of(eps=0.3, attacks=ATTACKS[:1], steps=10, judging="float", certify="crown")
    right = evaluate(apply_fn, params, (x, y), plan, mesh=None).metrics["certified"]
    monkeypatch.setattr(crown, "_relaxations", cut)
    wrong = evaluate(functools.partial(apply_fn), params, (x, y), plan, mesh=None)
    assert right["certified_and_fooled"] == 0
    assert wrong.metrics["certified"]["certified_and_fooled"] > 0
    assert not wrong.metrics["checks"]["certified_and_fooled"]["passed"]


def _slab(params, x):
    """Class 1 on a thin slab of pixel values between two 8-bit levels, class 0 elsewhere:
    ``z1 = c - k |x - m|`` with ``c / k`` = 0.3 of a level, ``m`` half-way between two."""
    distance = jnp.abs(x.reshape(x.shape[0], -1)[:, :1] - params["m"])
    return jnp.concatenate([jnp.zeros_like(distance), params["c"] - params["k"] * distance],
                           axis=1)


@pytest.mark.parametrize("judging", ["auto", "float"])
def test_missed_by_attacks_counts_only_points_of_the_judged_threat_model(judging):
    """The MIP searches the float box of the grid's radius. On 8-bit data its adversarial point
    (inside the slab) rounds to a grid image that is not adversarial: no 8-bit adversarial
    image exists, so it is ``off_grid``, not missed by the attacks; judged in float32 the same
    point is an adversarial example of the judged threat model."""
    params = {"m": jnp.float32(128.5 / 255), "c": jnp.float32(3.0),
              "k": jnp.float32(10.0 * 255)}
    x = jnp.full((4, 1, 1, 1), 126.0 / 255)
    y = np.zeros(4, np.int32)
    plan = Plan.of(eps=3 / 255, attacks=("fgsm",), judging=judging, certify="complete",
                certify_time_limit=5.0)
    result = evaluate(_slab, params, (x, y), plan, mesh=None)
    pe, record = result.per_example, result.metrics["certified"]
    if judging == "auto":
        assert np.all(pe["judged_on_grid"]) and not np.any(pe["success"])
        assert np.all(pe["exact_status"] == certify_run.EXACT["off_grid"])
        assert record["exact"]["off_grid"] == 4 and record["exact"]["missed_by_attacks"] == 0
        assert result.metrics["checks"]["missed_by_attacks"]["passed"]
        assert "outside the 8-bit threat model" in record["statement"]
    else:
        assert np.all(pe["exact_status"] == certify_run.EXACT["attacked"])
        missed = int(np.sum(~pe["success"]))
        assert record["exact"]["missed_by_attacks"] == missed


def test_the_cli_prints_and_writes_the_interval(tmp_path, capsys):
    model = tmp_path / "lin.py"
    model.write_text(
        "import jax, jax.numpy as jnp\n"
        "def model():\n"
        "    w = 0.05 * jax.random.normal(jax.random.key(0), (784, 10))\n"
        "    return (lambda p, x: x.reshape(x.shape[0], -1) @ p), w\n")
    out = tmp_path / "report"
    argv = ["evaluate", "--model", f"lin={model}:model", "--n", "8", "--attacks", "fgsm",
            "--eps", "0.01", "--certify", "crown-ibp", "--no-shifts", "--no-progress",
            "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "certified (crown-ibp)" in printed and "robust accuracy in" in printed
    record = json.loads((out / "report.json").read_text())["models"]["lin"]["certified"]
    assert record["method"] == "crown-ibp" and record["certified_and_fooled"] == 0
    assert "Certified: robust accuracy lies in" in (out / "report.md").read_text()
    with np.load(out / "lin.npz") as pe:
        assert pe["certified"].shape == (8,) and pe["bound_margin"].dtype == np.float32


def test_smoothing_certifies_the_smoothed_linear_classifier_beside_its_attack():
    """A linear base classifier under noise: CERTIFY's radius never exceeds the exact distance
    to the decision boundary (the smoothed classifier of a linear one is the same linear
    classifier), the certified examples are those whose radius reaches eps, and the run's
    record and per-example arrays say so."""
    from jaxbundle import certify

    params, x, y = linear_problem(n=12, k=3, d=4, seed=5, spread=0.3)
    distance = min_distance(params, x, y, "l2")
    eps = float(np.quantile(distance, 0.5))
    model = certify.gaussian(linear_apply, 0.5 * eps, calls=8)
    plan = Plan.of(eps=eps, norm="l2", attacks=("pgd-ce",), steps=5, judging="float",
                certify="smoothing", eot=2)
    result = evaluate(model, params, (images(x, (2, 2, 1)), y), plan, mesh=None)
    pe, record = result.per_example, result.metrics["certified"]
    right = pe["smoothed_prediction"] == y
    assert np.all(pe["smoothed_radius"][right] <= distance[right] + 1e-6)
    limit = float(norms.ball_limit(eps))
    np.testing.assert_array_equal(pe["certified"], right & (pe["smoothed_radius"] >= limit))
    assert 0 < pe["certified"].sum() < len(y) and record["method"] == "smoothing"
    assert "smoothed classifier" in record["statement"]


def test_smoothing_reports_the_smoothed_classifier_apart_from_the_attacked_one():
    """Examples one sigma from a linear boundary (the smoothed classifier's certified radius
    about 0.95 sigma at n = 10,000), attacked at 0.92 sigma: there the noisy base model errs
    47 % of the time, so the judge's 16 calls often call it fooled while the smoothed
    classifier is certified, correctly. Two classifiers:
    the record gives the smoothed one's clean and certified accuracy on its own, with no
    interval and no certified-and-fooled check, and counts it correct by its own prediction."""
    from jaxbundle import certify

    sigma, n = 0.1, 24
    params = {"w": jnp.asarray([[1.0, -1.0]] + [[0.0, 0.0]] * 3, jnp.float32),
              "b": jnp.asarray([-0.5, 0.5], jnp.float32)}  # class 0 iff pixel 0 > 0.5
    x = np.full((n, 4), 0.5, np.float32)
    x[:, 0] += sigma  # margin z0 - z1 = 2 (x0 - 0.5): distance x0 - 0.5
    y = np.zeros(n, np.int32)
    model = certify.gaussian(linear_apply, sigma, calls=16)
    eps = 0.92 * sigma
    plan = Plan.of(eps=eps, norm="l2", attacks=("pgd-ce",), steps=10, judging="float",
                certify="smoothing", eot=4)
    result = evaluate(model, params, (images(x, (2, 2, 1)), y), plan, mesh=None)
    pe, record, checks = result.per_example, result.metrics["certified"], \
        result.metrics["checks"]
    assert pe["certified"].sum() >= n - 3 and np.any(pe["certified"] & pe["success"])
    assert record["classifier"] == "smoothed" and record["interval"] is None
    assert record["certified_and_fooled"] is None and "certified_and_fooled" not in checks
    right = pe["smoothed_prediction"] == y
    assert record["smoothed"]["clean_accuracy"] == pytest.approx(100 * right.mean())
    assert record["certified_robust_accuracy"] == pytest.approx(100 * pe["certified"].mean())
    assert "not an upper bound on this one" in record["statement"]


def test_a_model_drawing_noise_from_a_key_it_holds_is_refused():
    """Noise drawn for the whole batch from a key in the parameters: an image gets other
    noise at another position, so the attacks, the judge and certification (one image at a
    time) would see three models. Refused by the model check and by certification."""
    from jaxbundle import models

    def noisy(p, x):
        noise = 0.05 * jax.random.normal(jax.random.wrap_key_data(p["key"]), x.shape)
        return linear_apply(p, x + noise)

    params, x, y = linear_problem(n=8, k=3, seed=1)
    params = {**params, "key": jax.random.key_data(jax.random.key(0))}
    with pytest.raises(ValueError, match="another position in the batch"):
        models.check_model(noisy, params, images(x), num_classes=3)
    plan = Plan.of(eps=0.01, attacks=("fgsm",), judging="float", certify="ibp")
    with pytest.raises(ValueError, match="another position in the batch"):
        evaluate(noisy, params, (images(x), y), plan, mesh=None)


def test_a_mesh_of_four_devices_certifies_as_one(tmp_path):
    """The bounds run on the attacks' sharded batch: four (fake CPU) devices give every
    per-example array of one, bit for bit."""
    script = tmp_path / "mesh.py"
    script.write_text(
        "import numpy as np\n"
        "from jaxbundle import Plan, evaluate\n"
        "from toys import images, linear_apply, linear_problem\n"
        "params, x, y = linear_problem(n=32, k=4, seed=3)\n"
        "plan = Plan.of(eps=0.02, attacks=('apgd-ce',), steps=5, judging='float',\n"
        "            certify='crown-ibp', batch_size=16)\n"
        "one = evaluate(linear_apply, params, (images(x), y), plan, mesh=None)\n"
        "four = evaluate(linear_apply, params, (images(x), y), plan, mesh='auto')\n"
        "for k in ('certified', 'bound_margin', 'certified_radius'):\n"
        "    assert np.array_equal(one.per_example[k], four.per_example[k]), k\n"
        "assert one.metrics['certified'] == {**four.metrics['certified'],\n"
        "                                    'seconds': one.metrics['certified']['seconds']}\n"
        "print('same', one.per_example['certified'].sum())\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__),
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=4")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("same")
