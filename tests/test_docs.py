"""Every code block of README.md and docs/*.md runs, and what it prints is right.

* Each ```python block is executed in a fresh working directory (with the files it reads put
  there first) and checked by the one check below whose page and needle match it: what it
  prints is compared with figures computed independently (the model's own predictions, the
  bundles' declared budgets, the grid's levels, the tables of the docs themselves). A block with
  no check, or a check with no block, fails.
* Each command line starting with ``jaxbundle `` in a ```bash (or plain ```) block runs:
  ``jaxbundle evaluate ...`` through :func:`jaxbundle.cli.main` with ``--dry-run`` (the plan is
  built, checked and printed; what it says is compared with the flags and the docs' tables),
  ``jaxbundle attacks`` for real, ``jaxbundle compare ...`` on tiny reports written for it.
  Shell set-up lines (``python3 -m venv ...``, ``export XLA_FLAGS=...``) are not run.
* The reference pages stay true: every flag of the parser is in docs/cli.md and every flag
  there is the parser's; the README's bundles table is the library's (names, budgets, schedule);
  docs/architecture.md names every module; the README fits on a first screen.

Blocks that need a trained demo model (the run's cache trains it once) are marked ``slow``.
"""

from __future__ import annotations

import ast
import json
import math
import pathlib
import shutil
import sys
import types
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from docs_pages import DEFAULT_FOCUS, PYTHON_BLOCKS, Block, _write_my_model
from docs_pages import tiny_report  # noqa: F401  (a fixture)
from toys import QUICK_TRAINING

from jaxbundle import models


class Check(NamedTuple):
    page: str
    needle: str  # a piece of text only the checked block holds
    check: Callable[..., None]  # check(namespace, printed lines, working directory)
    slow: bool
    setup: Callable[..., None] | None  # setup(working directory, tiny_report) before exec


CHECKS: list[Check] = []


def check(page: str, needle: str, *, slow: bool = False, setup=None):
    def register(fn):
        CHECKS.append(Check(page, needle, fn, slow, setup))
        return fn

    return register


def _block_of(c: Check) -> Block:
    found = [b for b in PYTHON_BLOCKS if b.page == c.page and c.needle in b.text]
    assert len(found) == 1, f"{c.check.__name__}: {len(found)} blocks of {c.page} hold {c.needle!r}"
    return found[0]


def _accuracy(apply_fn, params, x, y) -> float:
    return 100 * float(np.mean(np.asarray(jnp.argmax(apply_fn(params, jnp.asarray(x)), -1))
                               == np.asarray(y)))


def _images(x_adv: np.ndarray) -> np.ndarray:
    """Judged images as float32 in [0, 1] (they are uint8 when judged on the 8-bit grid)."""
    return x_adv.astype(np.float32) / 255 if x_adv.dtype == np.uint8 else x_adv


def _check_successes(apply_fn, params, x, y, per_example, eps) -> None:
    """Every reported image is in the box and the Linf ball, and the model misclassifies exactly
    the examples reported as successes."""
    x_adv = _images(np.asarray(per_example["x_adv"]))
    assert x_adv.min() >= 0 and x_adv.max() <= 1
    assert np.abs(x_adv - np.asarray(x)).reshape(len(y), -1).max(1).max() <= eps + 1e-6
    wrong = np.asarray(jnp.argmax(apply_fn(params, jnp.asarray(x_adv)), -1)) != np.asarray(y)
    np.testing.assert_array_equal(np.asarray(per_example["success"]), wrong)


@check("README.md", "def model():")
def check_the_model_file(ns, printed, cwd):
    """``model()`` reads ``my_model.msgpack`` from the working directory and returns an
    ``apply_fn`` that gives the CNN's logits for a batch."""
    import flax.serialization

    cnn = ns["CNN"]()
    params = cnn.init(jax.random.key(1), jnp.zeros((1, 28, 28, 1)))
    (cwd / "my_model.msgpack").write_bytes(flax.serialization.to_bytes(params))
    apply_fn, loaded = ns["model"]()
    x = jnp.linspace(0, 1, 2 * 28 * 28).reshape(2, 28, 28, 1)
    np.testing.assert_array_equal(apply_fn(loaded, x), cnn.apply(params, x))
    assert apply_fn(loaded, x).shape == (2, 10)
    assert printed == []


@check("README.md", "jaxbundle.bundles.default(", slow=True)
def check_the_readme_library_example(ns, printed, cwd):
    """The default bundle on the standard demo CNN: its clean accuracy is the model's own, the
    standard CNN has no robustness at Linf 0.3, every reported image is a real adversarial
    example within the grid's radius, and the cascade ran the documented stages."""
    import jaxbundle

    apply_fn, params, x, y, ev = ns["apply_fn"], ns["params"], ns["x"], ns["y"], ns["ev"]
    clean = _accuracy(apply_fn, params, x, y)
    assert ev.metrics["clean_accuracy"] == pytest.approx(clean) and clean > 90
    assert ev.metrics["robust_accuracy"] == 0.0
    _check_successes(apply_fn, params, x, y, ev.per_example, 76 / 255)
    stages = [s["attack"] for s in ev.metrics["schedule"]["stages"]]
    assert stages == ["apgd-ce", "apgd-ce-long", "apgd-t5", "square-aa"]
    assert ns["plan"] == jaxbundle.bundles.plan("default", "linf", 0.3)
    first, second = printed
    assert [float(v) for v in first.split()] == [ev.metrics["clean_accuracy"], 0.0]
    assert second == f"{len(y)} of {len(y)} misclassified after the attacks"




@check("docs/python-api.md", "mine = jaxbundle.Plan.of(")
def check_plans(ns, printed, cwd):
    """A named bundle is a plan with its schedule; replace gives a new plan; check refuses a
    focus on an attack the plan lacks, in one line."""
    import jaxbundle

    mode, segments, focus = printed[0].split(" ", 2)
    assert (mode, int(segments), ast.literal_eval(focus)) == ("cascade", 6, DEFAULT_FOCUS)
    assert ast.literal_eval(printed[1]) == ["apgd-ce", "fmn"]
    assert printed[2].startswith("refused: ") and "fmn" in printed[2] and len(printed) == 3
    plan, same = ns["plan"], ns["same"]
    assert (plan.run.batch_size, plan.run.seed) == (128, 1)
    assert same == jaxbundle.bundles.default("linf", 0.3) != plan
    assert hash(same) == hash(jaxbundle.bundles.default("linf", 0.3))
    json.dumps(plan.describe())
    assert ns["mine"].suite.steps == 50 and ns["records"] == ns["mine"]


@check("docs/python-api.md", 'data.head(data.open_source("mnist-sample:test"), 64)', slow=True)
def check_evaluate_on_a_source(ns, printed, cwd):
    """The fast bundle in full: a MAT of its two attacks, the bundle at least as strong as
    either, 20 + 3 x 20 gradients per example (the bundles table), figures the model's own."""
    from jaxbundle import data

    ev, apply_fn, params = ns["ev"], ns["apply_fn"], ns["params"]
    ds = data.load_mnist_sample("test", n=64)
    m, pe = ev.metrics, ev.per_example
    assert m["clean_accuracy"] == pytest.approx(_accuracy(apply_fn, params, ds.x, ds.y))
    assert set(m["mat"]) == {"apgd-ce", "apgd-t3"} and ev.attack_names == ("apgd-ce", "apgd-t3")
    assert m["robust_accuracy"] <= min(m["mat"].values())
    assert m["robust_accuracy"] == pytest.approx(100 * np.mean(~np.asarray(pe["success"])))
    np.testing.assert_array_equal(pe["gradients"], 80)
    if "x_adv" in pe:
        _check_successes(apply_fn, params, ds.x, ds.y, pe, 25 / 255)
    clean, rest = printed[0].split(" ", 1)
    mat, robust = rest.rsplit(" ", 1)
    assert float(clean) == m["clean_accuracy"] and float(robust) == m["robust_accuracy"]
    assert ast.literal_eval(mat) == m["mat"]
    assert printed[1] == f"{ev.attack_names} 80"


@check("docs/python-api.md", "jaxbundle.bundle(bundle_attacks", slow=True)
def check_one_batch(ns, printed, cwd):
    """bundle(): the best misclassifying candidates are in the box and the ball, and the model
    misclassifies exactly the ones the score says it does."""
    apply_fn, params, ds, result = ns["apply_fn"], ns["params"], ns["ds"], ns["result"]
    x, y = np.asarray(ds.x), np.asarray(ds.y)
    best = result.best["misclassify"]
    x_adv = np.asarray(best.x)
    assert x_adv.min() >= 0 and x_adv.max() <= 1
    assert np.abs(x_adv - x).reshape(len(y), -1).max(1).max() <= 0.3 + 1e-6
    wrong = np.asarray(jnp.argmax(apply_fn(params, best.x), -1)) != y
    np.testing.assert_array_equal(np.asarray(best.score.misclassified), wrong)
    assert float(printed[0].split()[0]) == pytest.approx(wrong.mean(), abs=1e-6)
    assert np.asarray(result.attack_success).shape == (3, len(y))


@check("docs/python-api.md", "job.run_job(", slow=True, setup=lambda cwd, _: _write_my_model(cwd))
def check_the_job_from_python(ns, printed, cwd):
    """run_job writes the report where asked; its figures are the returned evaluation's."""
    path, results = ns["path"], ns["results"]
    report = json.loads(pathlib.Path(path).read_text())
    assert pathlib.Path(path).resolve() == (cwd / "my-report" / "report.json").resolve()
    m = report["models"]["mine"]
    assert m["robust_accuracy"] == results["mine"][0].metrics["robust_accuracy"]
    assert m["n_examples"] == 32 and m["robust_accuracy"] <= m["clean_accuracy"]
    assert (cwd / "my-report" / "mine.npz").exists()
    assert printed == [f"{path} {m['robust_accuracy']}"]


STYLES_PAGE = "docs/models-and-data.md"
SAMPLE = np.linspace(0, 1, 2 * 28 * 28, dtype=np.float32).reshape(2, 28, 28, 1)


def _load_style(needle: str, cwd: pathlib.Path):
    """The block holding ``needle`` as a model file, loaded as ``jaxbundle evaluate --model``
    loads it, and checked as the command checks it."""
    from jaxbundle import models

    [block] = [b for b in PYTHON_BLOCKS if b.page == STYLES_PAGE and needle in b.text]
    path = cwd / f"style_{abs(hash(needle))}.py"
    path.write_text(block.text)
    loaded = models.load_model(f"{path}:model")
    assert models.check_model(loaded.apply_fn, loaded.params, SAMPLE, num_classes=10) == 10
    return loaded


@check(STYLES_PAGE, 'params["w"] + params["b"][None, :]')
def check_the_plain_style(ns, printed, cwd):
    """(apply_fn, params) is taken as it is."""
    loaded = _load_style('params["w"] + params["b"][None, :]', cwd)
    assert loaded.apply_fn.__name__ == "apply_fn" and set(loaded.params) == {"w", "b"}
    w = np.arange(7840, dtype=np.float32).reshape(784, 10) / 7840
    np.testing.assert_allclose(loaded.apply_fn({"w": w, "b": np.ones(10, np.float32)}, SAMPLE),
                               SAMPLE.reshape(2, -1) @ w + 1, rtol=1e-6)
    assert printed == []


@check(STYLES_PAGE, "use_running_average=not self.train")
def check_the_linen_style(ns, printed, cwd):
    """(module, variables): module.apply(variables, x), running averages read; the module built
    for training is refused."""
    from jaxbundle.adapters import ModelStyleError, as_apply_fn

    loaded = _load_style("use_running_average=not self.train", cwd)
    module, variables = ns["model"]()
    assert set(loaded.params) == {"params", "batch_stats"}
    np.testing.assert_allclose(jax.jit(loaded.apply_fn)(loaded.params, SAMPLE),
                               module.apply(variables, SAMPLE), rtol=1e-6, atol=1e-6)
    with pytest.raises(ModelStyleError, match="is in training mode: it updates its variables"):
        jax.eval_shape(as_apply_fn(ns["CNN"](train=True), variables)[0], variables, SAMPLE)
    assert printed == []


@check(STYLES_PAGE, "net.eval()")
def check_the_nnx_style(ns, printed, cwd):
    """An NNX module: its state is the params; without eval() it is refused."""
    from flax import nnx

    from jaxbundle.adapters import ModelStyleError, as_apply_fn

    loaded = _load_style("net.eval()", cwd)
    net = ns["model"]()
    assert isinstance(loaded.params, nnx.State) and "kernel" in loaded.params["dense"]
    np.testing.assert_allclose(jax.jit(loaded.apply_fn)(loaded.params, SAMPLE), net(SAMPLE),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ModelStyleError, match=r"training mode .* call model.eval\(\)"):
        as_apply_fn(ns["CNN"](nnx.Rngs(0)))
    assert printed == []


@check(STYLES_PAGE, "eqx.nn.inference_mode(Batched(")
def check_the_equinox_style(ns, printed, cwd):
    """An Equinox module: its arrays are the params; the batch is the per-image model's."""
    loaded = _load_style("eqx.nn.inference_mode(Batched(", cwd)
    net = ns["model"]().net
    assert {a.shape for a in jax.tree.leaves(loaded.params)} == {
        a.shape for a in (net.conv.weight, net.conv.bias, net.dense.weight, net.dense.bias)}
    np.testing.assert_allclose(jax.jit(loaded.apply_fn)(loaded.params, SAMPLE),
                               np.stack([net(image) for image in SAMPLE]), rtol=1e-5,
                               atol=1e-6)
    assert printed == []


@check("docs/python-api.md", "memory.auto_batch_size(")
def check_auto_batch_size(ns, printed, cwd):
    """The batch fits half the free memory at the rule's bytes per example; the default plan
    runs APGD-T's 5 restarts at once, so an example needs 5 times what one restart does."""
    from jaxbundle import memory

    size, per_example, fixed = ns["size"], ns["per_example"], ns["fixed"]
    assert ns["plan"].run.batch_size == size >= 1
    assert size * per_example + fixed <= memory.FRACTION * memory.free_bytes() * 1.1
    one, _ = memory.per_example_bytes([a._replace(num_restarts=1) for a in ns["attacks"]],
                                      "vmap", ns["apply_fn"], ns["params"], (28, 28, 1))
    assert per_example == 5 * one
    assert printed == []


@check("docs/judging.md", "norms.grid_radius")
def check_grid_radius(ns, printed, cwd):
    """Whole levels: floor(255 eps) in Linf; in L2 the largest integer under (255 eps)^2."""
    assert printed[0] == f"{math.floor(0.3 * 255)} {math.floor(0.031 * 255)}" == "76 7"
    assert int(printed[1]) == math.ceil((0.5 * 255) ** 2) - 1 == 16256


@check("docs/schedules.md", "confident = ")
def check_schedule_fields(ns, printed, cwd):
    mode, rest = printed[0].split(" ", 1)
    focus, rest = rest.split("} ", 1)
    assert mode == "cascade" and ast.literal_eval(focus + "}") == {"apgd-t": 0.5}
    assert rest == "4 max_confidence 0.9"
    assert ns["confident"].schedule.mode == "cascade"


@check("docs/schedules.md", "cascade.bucket_sizes(256)")
def check_bucket_sizes(ns, printed, cwd):
    """The batch times 1, 3/4, 1/2, 3/8, 1/4, ... (rounded down), down to one row."""
    ratios = [scale * r for scale in (0.5 ** k for k in range(10)) for r in (1, 0.75)]
    expected = sorted({max(1, int(256 * r)) for r in ratios}, reverse=True)
    assert ast.literal_eval(printed[0]) == tuple(expected)
    assert expected[:6] == [256, 192, 128, 96, 64, 48] and expected[-1] == 1


@check("docs/stochastic.md", "jaxbundle.stochastic(noisy", slow=True)
def check_a_stochastic_model(ns, printed, cwd):
    """Judged over the model's 16 calls: fooled when more than half of them misclassify; every
    EOT sample counts as a model pass (4 x the fast bundle's 80 gradients)."""
    ev = ns["ev"]
    pe, m = ev.per_example, ev.metrics
    rate = np.asarray(pe["success_rate"])
    np.testing.assert_array_equal(np.asarray(pe["success"]), rate > 0.5)
    assert m["robust_accuracy"] == pytest.approx(100 * np.mean(rate <= 0.5))
    np.testing.assert_array_equal(pe["gradients"], 4 * 80)
    robust, mean_rate = printed[0].split()
    assert float(robust) == m["robust_accuracy"]
    assert float(mean_rate) == pytest.approx(rate.mean())
    assert printed[1] == "320"
    assert m["checks"]["randomness"]["passed"]


@check("docs/defences.md", "g = jaxbundle.bpda(squeeze)")
def check_bpda(ns, printed, cwd):
    """BPDA's forward pass is the preprocessing's exactly and its gradient the identity's; the
    declared model is the same forward either way, and only the BPDA one has a gradient; the
    random one is a stochastic model whose declaration has BPDA on."""
    import jaxbundle

    assert printed[0] == "True"
    assert printed[1].split() == ["[3.", "3.", "3.", "3.", "3.]"]
    assert printed[2].split() == ["[0.", "0.", "0.", "0.", "0.]"]
    assert printed[3] == "False True True"
    naive, bpda, noisy = ns["naive"], ns["bpda"], ns["noisy"]
    w = jnp.arange(12.0).reshape(4, 3) / 10
    x = jnp.linspace(0, 1, 8).reshape(2, 2, 2, 1)
    np.testing.assert_array_equal(naive(w, x), bpda(w, x))
    np.testing.assert_array_equal(naive(w, x), ns["classifier"](w, ns["squeeze"](x)))
    loss = lambda m: lambda v: jnp.sum(m(w, v))  # noqa: E731
    np.testing.assert_array_equal(jax.grad(loss(naive))(x), 0)
    np.testing.assert_allclose(jax.grad(loss(bpda))(x).reshape(2, 4), [w.sum(1)] * 2, rtol=1e-6)
    assert jaxbundle.sampling.is_stochastic(noisy) and ns["plan"].sampling.eot == 8


@check("docs/certify.md", "jaxbundle.certify.margin_bounds(apply_fn")
def check_certify(ns, printed, cwd):
    """The bounds hold at random points of every certified example's ball (the model's margin
    stays positive there), the evaluation's interval is [certified, bundled] and nothing is both
    certified and fooled."""
    apply_fn, params, x, y = ns["apply_fn"], ns["params"], ns["x"], ns["y"]
    lower = np.asarray(ns["lower"])
    certified = lower.min(axis=1) > 0
    assert printed[0] == f"(64, 4) {int(certified.sum())}" and 0 < certified.sum() < 64
    noise = jax.random.uniform(jax.random.key(1), (32, *x.shape), minval=-0.02, maxval=0.02)
    z = jax.vmap(lambda d: apply_fn(params, jnp.clip(x + d, 0, 1)))(noise)  # [32, B, K]
    true = jnp.take_along_axis(z, jnp.asarray(y)[None, :, None], axis=2)[..., 0]
    other = jnp.max(jnp.where(jax.nn.one_hot(y, 4, dtype=bool)[None], -jnp.inf, z), axis=2)
    margins = np.asarray(true - other)
    assert np.all(margins[:, certified] >= lower.min(axis=1)[certified] - 1e-5)
    ev = ns["ev"]
    record, pe = ev.metrics["certified"], ev.per_example
    assert printed[1] == f"{record['interval']} {record['undecided']}"
    assert record["interval"] == [100 * pe["certified"].mean(), ev.metrics["robust_accuracy"]]
    assert not np.any(pe["certified"] & pe["success"])


def _copy_tiny_report(cwd: pathlib.Path, tiny: pathlib.Path) -> None:
    shutil.copytree(tiny, cwd / "jaxbundle-report")


@check("docs/report.md", 'json.load(open("jaxbundle-report/report.json"))', setup=_copy_tiny_report)
def check_reading_a_report(ns, printed, cwd):
    """One line per model: its figures as the report has them, and the robust accuracy is the
    fraction of examples the npz does not mark fooled."""
    report = json.loads((cwd / "jaxbundle-report" / "report.json").read_text())
    assert [line.split()[0] for line in printed] == list(report["models"]) == ["lin"]
    name, clean, robust, fooled = printed[0].split()
    m = report["models"][name]
    assert (float(clean), float(robust)) == (m["clean_accuracy"], m["robust_accuracy"])
    success = np.load(cwd / "jaxbundle-report" / f"{name}.npz")["success"]
    assert int(fooled) == success.sum()
    assert m["robust_accuracy"] == pytest.approx(100 * (m["n_examples"] - int(fooled))
                                                 / m["n_examples"])


def test_every_python_block_has_one_check():
    for block in PYTHON_BLOCKS:
        matching = [c.check.__name__ for c in CHECKS
                    if c.page == block.page and c.needle in block.text]
        assert len(matching) == 1, f"{block.page}:{block.line}: checks {matching}"
    for c in CHECKS:
        _block_of(c)


@pytest.mark.parametrize(
    "c", [pytest.param(c, marks=[pytest.mark.slow] if c.slow else [],
                       id=f"{c.page}:{c.check.__name__}") for c in CHECKS])
def test_python_block(c: Check, request, tmp_path, monkeypatch, capsys):
    block = _block_of(c)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    if c.setup is not None:
        c.setup(tmp_path, request.getfixturevalue("tiny_report")
                if c.setup is _copy_tiny_report else None)
    capsys.readouterr()
    # The demo models a page loads train small here (toys.QUICK_TRAINING, once per run): the
    # block runs as written, on weights trained within a test run's budget.
    for name in ("standard", "adversarial", "certified"):
        quick = models.MODELS[name]._replace(**QUICK_TRAINING)
        monkeypatch.setitem(models.MODELS, name, quick)
        monkeypatch.setattr(models, name.upper(), quick)
    module = types.ModuleType(f"docs_block_{c.check.__name__}")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # dataclasses look it up
    namespace = module.__dict__
    exec(compile(block.text, f"{block.page}:{block.line}", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    c.check(namespace, printed, tmp_path)


# ----------------------------------------------------------------------------- command lines


