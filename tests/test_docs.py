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
import os
import pathlib
import re
import shlex
import shutil
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle.cli import _parser, main

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
SHELLS = ("bash", "sh", "")  # fenced blocks whose lines are shell commands


def _page(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


class Block(NamedTuple):
    page: str  # "README.md", "docs/cli.md", ...
    line: int  # of the opening fence
    lang: str
    text: str


def _blocks(path: pathlib.Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.fullmatch(r"```([\w-]*)\s*", lines[i])
        if fence is None:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        assert end < len(lines), f"{_page(path)}:{i + 1}: a code block is never closed"
        blocks.append(Block(_page(path), i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return blocks


ALL_BLOCKS = [b for path in PAGES for b in _blocks(path)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "python"]


class Command(NamedTuple):
    page: str
    line: int
    argv: list[str]  # without the leading "jaxbundle"


def _commands() -> list[Command]:
    commands = []
    for block in ALL_BLOCKS:
        if block.lang not in SHELLS:
            continue
        logical, start = "", 0
        for number, line in enumerate(block.text.splitlines(), block.line + 1):
            if not logical:
                start = number
            if line.rstrip().endswith("\\"):
                logical += line.rstrip()[:-1] + " "
                continue
            logical += line
            if logical.strip().startswith("jaxbundle "):
                words = shlex.split(logical, comments=True)
                if words and words[-1] == "&":  # run in the background, as the docs say
                    words = words[:-1]
                words = [os.path.expanduser(w) if w.startswith("~") else w for w in words]
                commands.append(Command(block.page, start, words[1:]))
            logical = ""
    return commands


COMMANDS = _commands()


# --------------------------------------------------------------- the files the blocks read


def _model_file_block() -> str:
    """The model file of the README's "Evaluate your own model" (tests/test_loading.py reads the
    same block)."""
    section = README.read_text().split("## Evaluate your own model", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def _write_my_model(directory: pathlib.Path) -> None:
    """``my_model.py`` as the README gives it, and ``my_model.msgpack``: its CNN's initial
    weights (what a reader's training would have saved)."""
    import flax.serialization

    code = _model_file_block()
    (directory / "my_model.py").write_text(code)
    namespace: dict = {"__name__": "docs_my_model"}
    exec(compile(code, "my_model.py", "exec"), namespace)
    params = namespace["CNN"]().init(jax.random.key(1), jnp.zeros((1, 28, 28, 1)))
    (directory / "my_model.msgpack").write_bytes(flax.serialization.to_bytes(params))


def _write_test_npz(directory: pathlib.Path) -> None:
    """``test.npz``: the first 64 images of the embedded test sample, as uint8."""
    from jaxbundle import data

    ds = data.load_mnist_sample("test", n=64)
    x = np.round(np.asarray(ds.x) * 255).astype(np.uint8)
    np.savez(directory / "test.npz", x=x, y=np.asarray(ds.y))


LINEAR_MODEL = '''
import numpy as np

from jaxbundle import data


def model():
    """A nearest-class-mean classifier of the embedded training sample (about 80 % accurate)."""
    ds = data.load_mnist_sample("train", n=2000)
    x = np.asarray(ds.x).reshape(len(ds.y), -1)
    means = np.stack([x[np.asarray(ds.y) == k].mean(0) for k in range(10)])
    params = {"w": means.T.astype(np.float32), "b": (-0.5 * (means ** 2).sum(1)).astype(np.float32)}
    return (lambda p, x: x.reshape(x.shape[0], -1) @ p["w"] + p["b"][None, :]), params
'''


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory) -> pathlib.Path:
    """A report of a tiny run (a linear model, FGSM, 16 images, no shifts): a few seconds."""
    directory = tmp_path_factory.mktemp("tiny")
    (directory / "docs_linear_model.py").write_text(LINEAR_MODEL)
    out = directory / "report"
    argv = ["evaluate", "--model", f"lin={directory / 'docs_linear_model.py'}:model",
            "--attacks", "fgsm", "--n", "16", "--no-shifts", "--no-progress",
            "--no-compile-cache", "--out", str(out)]
    assert main(argv) == 0
    return out


# ----------------------------------------------------------------------------- python blocks


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


DEFAULT_FOCUS = {"apgd-ce-long": 0.5, "apgd-t5": 0.5, "square-aa": 0.08}  # the docs' own words


@check("docs/python-api.md", "mine = jaxbundle.Plan(")
def check_plans(ns, printed, cwd):
    """A named bundle is a plan with its schedule; replace gives a new plan; check refuses a
    focus on an attack the plan lacks, in one line."""
    import jaxbundle

    mode, segments, focus = printed[0].split(" ", 2)
    assert (mode, int(segments), ast.literal_eval(focus)) == ("cascade", 6, DEFAULT_FOCUS)
    assert ast.literal_eval(printed[1]) == ["apgd-ce", "fmn"]
    assert printed[2].startswith("refused: ") and "fmn" in printed[2] and len(printed) == 3
    plan, same = ns["plan"], ns["same"]
    assert (plan.batch_size, plan.seed) == (128, 1)
    assert same == jaxbundle.bundles.default("linf", 0.3) != plan
    assert hash(same) == hash(jaxbundle.bundles.default("linf", 0.3))
    json.dumps(plan.describe())
    assert ns["mine"].steps == 50


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
    assert ns["confident"].mode == "cascade"


@check("docs/schedules.md", "schedule.bucket_sizes(256)")
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
    namespace: dict = {"__name__": f"docs_block_{c.check.__name__}"}
    exec(compile(block.text, f"{block.page}:{block.line}", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    c.check(namespace, printed, tmp_path)


# ----------------------------------------------------------------------------- command lines


def _table(path: pathlib.Path, header: str) -> list[list[str]]:
    """The rows of the Markdown table whose header line starts with ``header``."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def _presets() -> dict[str, tuple[str, float]]:
    """docs/judging.md's presets table: name -> (norm, eps)."""
    out = {}
    for name, norm, eps, _ in _table(DOCS / "judging.md", "| preset |"):
        numerator, _, denominator = eps.partition("/")
        out[name.strip("`")] = (norm.lower(), float(numerator) / float(denominator or 1))
    return out


def _dataset_preset(data: str) -> str:
    """The data's own preset, as docs/judging.md puts it: the first of its dataset's."""
    base = data.removeprefix("tfds:").removeprefix("npz:").split(":")[0].split("/")[0]
    base = "mnist" if base in ("mnist-sample", "test.npz") else base
    base = "imagenet" if base.startswith("imagenet") else base
    return next(p for p in _presets() if p.startswith(base + "-"))


def _stand_in_source(open_source):
    """tfds data is not prepared here: a tiny stand-in source of the name tfds would give it
    (``tfds:NAME/SPLIT``, from which the preset follows); other specs open as usual."""
    from jaxbundle import data

    def open_(spec, **kwargs):
        if not spec.startswith("tfds:"):
            return open_source(spec, **kwargs)
        name, _, split = spec.removeprefix("tfds:").partition(":")
        size = kwargs.get("image_size") or 32
        x = np.zeros((4, size, size, 3), np.uint8)
        return data.ArraySource(x, np.arange(4) % 10, num_classes=10,
                                name=f"tfds:{name}/{split or 'test'}")

    return open_


@pytest.fixture
def command_directory(tmp_path, monkeypatch):
    """A working directory holding what the docs' commands name (my_model.py and its weights,
    test.npz), with jax.distributed recorded instead of joined and tfds stood in for."""
    from jaxbundle import data

    _write_my_model(tmp_path)
    _write_test_npz(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    joined: list[dict] = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joined.append(kw))
    monkeypatch.setattr(data, "open_source", _stand_in_source(data.open_source))
    return tmp_path, joined


def _bundle_rows() -> dict[str, list[str]]:
    return {row[0].split()[0].strip("`"): row
            for row in _table(README, "| bundle | attacks | budget / example |")}


def _documented_default_focus() -> dict[str, float]:
    row = _bundle_rows()["default"]
    return {a: float(f) for a, f in re.findall(r"--focus ([\w-]+)=([\d.]+)", row[1])}


def _check_dry_run(argv: list[str], out: dict, joined: list[dict]) -> None:
    """What the dry run printed is what the flags (and, where none is given, the docs' presets
    and bundles table) say."""
    args = _parser().parse_args(argv)
    plan = out["plan"]
    threat, schedule, run = plan["threat_model"], plan["schedule"], plan["run"]
    preset = args.preset or (None if args.eps is not None and not args.data.startswith(
        ("mnist", "tfds:")) else _dataset_preset(args.data))
    norm, eps = _presets()[preset] if preset else ("linf", None)
    assert threat["norm"] == (args.norm or norm)
    if args.eps is not None or args.norm is None or args.norm == norm:
        assert threat["eps"] == pytest.approx(args.eps if args.eps is not None else eps)
    if args.attacks:
        assert [a["name"] for a in plan["attacks"]] == args.attacks and plan["bundle"] is None
    else:
        assert plan["bundle"] == args.bundle
    for flag, value, got in (
            ("--steps", args.steps, plan["overrides"]["steps"]),
            ("--restarts", args.restarts, plan["overrides"]["restarts"]),
            ("--queries", args.queries, plan["overrides"]["queries"]),
            ("--schedule", args.schedule, schedule["mode"]),
            ("--threshold", args.threshold, schedule["threshold"]),
            ("--budget", args.budget, schedule["budget"]),
            ("--segments", args.segments, schedule["segments"]),
            ("--seed", args.seed, run["seed"]),
            ("--batch-size", args.batch_size, run["batch_size"]),
            ("--eot", args.eot, plan["stochastic"]["eot"]),
            ("--judge-calls", args.judge_calls, plan["stochastic"]["judge_calls"]),
            ("--success-threshold", args.success_threshold,
             plan["stochastic"]["success_threshold"])):
        if value is not None:
            assert got == value, flag
    for name, fraction in args.focus:
        assert schedule["focus"][name] == fraction
    if args.threshold is not None:
        assert schedule["goal"] == "max_confidence"
    if args.bundle == "default" and not args.attacks and args.schedule in (None, "cascade"):
        assert schedule["mode"] == "cascade"
        assert schedule["focus"] == {**_documented_default_focus(), **dict(args.focus)}
    if args.data.startswith("mnist-sample"):  # 2,000 test images; the first 1000 by default
        assert out["data"]["n"] == (1000 if args.n is None else args.n)
    demo = args.models if args.models is not None else ([] if args.model else
                                                         ["standard", "adversarial"])
    assert out["models"] == demo + args.model
    assert joined == []  # a dry run checks a multi-process command without joining


def _run_compare(argv: list[str], tiny: pathlib.Path, capsys) -> None:
    reports = [a for a in argv[1:] if not a.startswith("--")]
    for directory in reports:
        if not os.path.exists(directory):
            shutil.copytree(tiny, directory)
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    if "--markdown" in argv:
        labels = [f"{r}/lin" for r in reports] if len(reports) > 1 else ["lin"]
        rows = [line for line in out.splitlines() if line.startswith("| ")][1:]
        assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == labels
    else:
        assert "lin" in out and "robust" in out


def _documented_attack_names() -> set[str]:
    names = set()
    for row in _table(DOCS / "attacks.md", "| name | attack |"):
        names.update(re.findall(r"`([\w-]+)`", row[0]))
    return names


def test_the_docs_have_commands():
    subcommands = {c.argv[0] for c in COMMANDS}
    assert subcommands == {"evaluate", "attacks", "compare"}, subcommands


@pytest.mark.parametrize("command", [pytest.param(c, id=f"{c.page}:{c.line}") for c in COMMANDS])
def test_command(command: Command, command_directory, capsys, request):
    argv = command.argv
    cwd, joined = command_directory
    if argv[0] == "evaluate":
        capsys.readouterr()
        try:
            status = main(argv + ["--dry-run"])
        except SystemExit as exit_:  # argparse refused a flag
            status = exit_.code
        captured = capsys.readouterr()
        assert status == 0, captured.err[-2000:]
        _check_dry_run(argv, json.loads(captured.out), joined)
    elif argv[0] == "attacks":
        from jaxbundle.suites import ATTACKS

        assert main(argv) == 0
        out = capsys.readouterr().out
        assert _documented_attack_names() == set(ATTACKS)
        for name in ATTACKS:
            assert name in out
    elif argv[0] == "compare":
        _run_compare(argv, request.getfixturevalue("tiny_report"), capsys)
    else:
        pytest.fail(f"{command.page}:{command.line}: no test runs `jaxbundle {argv[0]}`")


# ----------------------------------------------------------------------------- reference pages


def _subcommands() -> dict:
    """``jaxbundle``'s subcommands: name -> argparse parser."""
    import argparse

    parser = _parser()
    return next(a for a in parser._actions
                if isinstance(a, argparse._SubParsersAction)).choices


def _parser_flags() -> dict[str, set[str]]:
    return {name: {s for a in p._actions for s in a.option_strings if s.startswith("--")}
            - {"--help"} for name, p in _subcommands().items()}


def test_the_cli_reference_has_every_flag_and_no_other():
    text = (DOCS / "cli.md").read_text()
    flags = _parser_flags()
    for command, options in flags.items():
        for flag in options:
            assert f"`{flag}" in text, f"docs/cli.md does not describe {command} {flag}"
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", text))
    assert mentioned <= set().union(*flags.values()), mentioned - set().union(*flags.values())


def _count(text: str) -> tuple[int, int]:
    """``"550 / 1,550"`` -> (550, 1550); ``"80"`` -> (80, 80)."""
    values = [int(v.replace(",", "")) for v in text.split(" / ")]
    return values[0], values[-1]


def _budget(cell: str) -> tuple[bool, tuple[int, int], tuple[int, int]]:
    """A budget cell: (at most, gradients (Linf, L2), queries (Linf, L2))."""
    at_most = cell.startswith("at most ")
    text = cell.removeprefix("at most ").split(" (", 1)[0]
    gradients, _, queries = text.partition(" + ")
    if gradients.endswith(" queries"):
        gradients, queries = "0", gradients
    return at_most, _count(gradients), _count(queries.removesuffix(" queries") or "0")


def test_the_readme_bundles_table_is_the_library():
    import jaxbundle

    rows = _bundle_rows()
    parser_choices = next(a.choices for a in _subcommands()["evaluate"]._actions
                          if "--bundle" in a.option_strings)
    assert set(rows) == set(jaxbundle.bundles.BUNDLES) == set(parser_choices)
    for name, row in rows.items():
        at_most, gradients, queries = _budget(row[2])
        for i, norm in enumerate(("linf", "l2")):
            plan = jaxbundle.bundles.plan(name, norm, 0.3)
            built = jaxbundle.bundles.bundle_attacks(name, norm)
            assert sum(a.gradients for a in built) == gradients[i], (name, norm)
            assert sum(a.queries for a in built) == queries[i], (name, norm)
            assert at_most == (plan.mode == "cascade"), name
    default = jaxbundle.bundles.default("linf", 0.3)
    assert dict(default.focus) == _documented_default_focus() == DEFAULT_FOCUS
    assert f"--segments {default.segments}" in rows["default"][1]


def test_the_architecture_page_names_every_module():
    text = (DOCS / "architecture.md").read_text()
    package = ROOT / "jaxbundle"
    modules = [p.stem for p in package.glob("*.py") if not p.stem.startswith("__")]
    packages = [p.name for p in package.iterdir() if (p / "__init__.py").exists()]
    for name in modules:
        assert f"`{name}`" in text or f"{name}.py" in text, f"docs/architecture.md: {name}"
    for name in packages:
        assert f"{name}/" in text, f"docs/architecture.md: {name}/"


def test_the_docs_index_links_every_page():
    index = (DOCS / "README.md").read_text()
    for page in DOCS.glob("*.md"):
        if page.name != "README.md":
            assert f"({page.name}" in index, f"docs/README.md does not link {page.name}"
    readme = README.read_text()
    for target in re.findall(r"\]\(((?:docs/|\.\./)?[\w./-]+\.md)(?:#[\w-]+)?\)", readme):
        assert (ROOT / target).exists(), target
    for page in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)", page.read_text()):
            assert (DOCS / target).resolve().exists(), f"{page.name}: {target}"


def test_the_readme_is_a_first_screen():
    """At most 15 KB, and "Evaluate your own model" within the first 60 lines."""
    assert len(README.read_bytes()) <= 15_000
    lines = README.read_text().splitlines()
    assert lines.index("## Evaluate your own model") < 60
