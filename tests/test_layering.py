"""The architecture stays easy to see: no import cycles (hidden in functions or behind
TYPE_CHECKING or not), each layer folder importing only the folders below it, the bundler free
of models/ and data/, a light ``import jaxbundle``, no file over 600 lines and no function
over 80."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxbundle"


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """jaxbundle module -> the jaxbundle modules it imports, anywhere in its code."""
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    edges.add(full if full in files else base)
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _reach(graph, start):
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_import_cycles():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# What each layer folder's modules may import (besides their own folder), anywhere in their
# code: the jit side of one batch at the bottom (core/ and the attacks on its protocol), then
# the report's records, certification, data and models, the host side of an evaluation (run/)
# and the studies beside it; the top (plan, suites, bundles, presets, evaluation, job, cli)
# may import any layer. plan and suites are the vocabulary run/ is configured in.
LAYERS = {
    "core": {"attacks"},
    "attacks": {"core"},
    "report": {"core", "attacks", ""},  # "": the package root, for its __version__
    "certify": {"core", "report"},
    "data": {"core"},
    "models": {"core", "data", "certify", "run"},
    "run": {"core", "attacks", "report", "certify"},
    "studies": {"core", "attacks", "report"},
}


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_each_layer_imports_only_the_layers_below_it():
    graph = _graph()
    for module, edges in graph.items():
        layer = _layer(module)
        if layer in LAYERS:
            reached = {_layer(m) for m in edges} - {layer}
            assert reached <= LAYERS[layer], (module, reached - LAYERS[layer])


def test_the_top_of_the_package_holds_only_what_a_user_meets():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == {"__init__", "__main__", "plan", "suites", "bundles", "presets", "evaluation",
                   "job", "cli"}, top
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(LAYERS), folders


def test_the_bundler_depends_on_attacks_goals_judging_and_norms_only():
    graph = _graph()
    allowed = {"jaxbundle.core", "jaxbundle.attacks", "jaxbundle.core.goals",
               "jaxbundle.core.judge", "jaxbundle.core.norms", "jaxbundle.core.losses",
               "jaxbundle.core.sampling", "jaxbundle.core.canonical",
               "jaxbundle.core.validation"}
    for module in ("jaxbundle.core.bundler", "jaxbundle.core.judge",
                   "jaxbundle.core.validation"):
        reached = _reach(graph, module)
        assert {_layer(m) for m in reached} <= {"core", "attacks", ""}, module
    direct = {m for m in graph["jaxbundle.core.bundler"]
              if not m.startswith("jaxbundle.attacks.")}
    assert direct <= allowed, direct - allowed


def test_the_earlier_import_paths_import_the_same_modules():
    """``jaxbundle.bundler``, ``jaxbundle.schedule``, ``from jaxbundle import metrics``: the
    module at its folder, the same object (a checkpoint's identity, a monkeypatch, a pickle
    see one module)."""
    code = ("import importlib, jaxbundle; "
            "print(all(importlib.import_module(old) is importlib.import_module(new) "
            "for old, new in jaxbundle.MOVED.items()), jaxbundle.schedule.__name__, "
            "jaxbundle.report.write_report.__module__)")
    assert _printed(code) == ["True", "jaxbundle.run.cascade", "jaxbundle.report.writers"]


def test_import_jaxbundle_is_light():
    """Neither the demo models and their trainer (flax), nor a dataset reader, nor the report
    writer (rich, matplotlib) loads until used."""
    code = ("import sys, jaxbundle; print(' '.join(m for m in ('flax', 'jaxbundle.models', "
            "'jaxbundle.data.tfds', 'tensorflow_datasets', 'rich', 'matplotlib', "
            "'jaxbundle.report.writers', 'jaxbundle.report.plots', 'jaxbundle.job') "
            "if m in sys.modules))")
    assert _printed(code) == []


def _printed(code: str) -> list[str]:
    """The words ``code`` prints in a fresh Python process."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split()


def _sources():
    for folder in ("jaxbundle", "tests", "benchmarks", "experiments", "examples"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_file_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_no_function_over_80_lines():
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 80:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = length
    assert not long, long


def test_a_run_s_identity_names_functions_by_their_earlier_paths():
    """A checkpoint written before the layer folders resumes: its identity named a model's
    wrapper by the module's earlier path, and still does."""
    from jaxbundle.core.canonical import fast_gradients
    from jaxbundle.core.sampling import with_eot
    from jaxbundle.run import cascade, checkpoint
    from jaxbundle.run.adapters import AdaptedModel

    assert checkpoint.describe(AdaptedModel) == "jaxbundle.adapters.AdaptedModel"
    assert checkpoint.describe(fast_gradients) == "jaxbundle.canonical.fast_gradients"
    assert checkpoint.describe(with_eot) == "jaxbundle.sampling.with_eot"
    assert checkpoint.describe(cascade.cascade) == "jaxbundle.schedule.cascade"
