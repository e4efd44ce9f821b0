"""The architecture stays easy to see: no import cycles (hidden in functions or behind
TYPE_CHECKING or not), the bundler free of models/ and data/, a light ``import jaxbundle``, no
file over 600 lines and no function over 80."""

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


def test_the_bundler_depends_on_attacks_goals_judging_and_norms_only():
    graph = _graph()
    allowed = {"jaxbundle", "jaxbundle.attacks", "jaxbundle.goals", "jaxbundle.judge",
               "jaxbundle.norms", "jaxbundle.losses", "jaxbundle.sampling",
               "jaxbundle.canonical", "jaxbundle.validation"}
    for module in ("jaxbundle.bundler", "jaxbundle.judge", "jaxbundle.validation"):
        reached = _reach(graph, module)
        assert not {m for m in reached if m.startswith(("jaxbundle.models",
                                                        "jaxbundle.data"))}, module
    direct = {m for m in graph["jaxbundle.bundler"] if not m.startswith("jaxbundle.attacks.")}
    assert direct <= allowed, direct - allowed


def test_import_jaxbundle_is_light():
    """Neither the demo models and their trainer (flax), nor a dataset reader, nor the report
    writer (rich, matplotlib) loads until used."""
    code = ("import sys, jaxbundle; print(' '.join(m for m in ('flax', 'jaxbundle.models', "
            "'jaxbundle.data.tfds', 'tensorflow_datasets', 'rich', 'matplotlib', "
            "'jaxbundle.report', 'jaxbundle.job') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == []


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
