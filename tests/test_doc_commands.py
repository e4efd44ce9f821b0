"""Every ``jaxbundle`` command of README.md and docs/*.md runs, and the reference pages stay true
(see tests/test_docs.py)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil

import jax
import numpy as np
import pytest

from jaxbundle import presets
from jaxbundle.cli import _parser, main
from docs_pages import (COMMANDS, DEFAULT_FOCUS, DOCS, README, ROOT, Command, _write_my_model,
                        _write_test_npz)
from docs_pages import tiny_report  # noqa: F401  (a fixture)


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


def _documented_default(flag: str) -> dict[str, float]:
    """The default bundle's ``--focus`` or ``--floor`` pairs as README's bundles table gives
    them."""
    row = _bundle_rows()["default"]
    return {a: float(f) for a, f in re.findall(rf"--{flag} ([\w-]+)=([\d.]+)", row[1])}


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
        assert schedule["focus"] == {**_documented_default("focus"), **dict(args.focus)}
        assert schedule["floor"] == _documented_default("floor") != {}
    if args.data.startswith("mnist-sample"):  # 2,000 test images; the first 1000 by default
        assert out["data"]["n"] == (1000 if args.n is None else args.n)
    demo = args.models if args.models is not None else ([] if args.model else
                                                         list(presets.DEMO_MODELS))
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
        for row in _table(DOCS / "attacks.md", "| name | attack |"):  # norms and kind too
            for name in re.findall(r"`([\w-]+)`", row[0]):
                record = ATTACKS[name]
                written = {"linf": "Linf", "l2": "L2", "l1": "L1"}
                assert row[2] == ", ".join(written[n] for n in record.norms), name
                assert row[3] == record.made().kind, name
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
            assert at_most == (plan.schedule.mode == "cascade"), name
    default = jaxbundle.bundles.default("linf", 0.3)
    assert dict(default.schedule.focus) == _documented_default("focus") == DEFAULT_FOCUS
    assert dict(default.schedule.floor) == _documented_default("floor")
    assert dict(default.schedule.probe) == _documented_default("probe")
    assert f"--segments {default.schedule.segments}" in rows["default"][1]


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
