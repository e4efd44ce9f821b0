"""The README's Python example runs as written."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_a_python_example():
    assert _python_blocks()


@pytest.mark.slow
def test_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXBUNDLE_CACHE", str(tmp_path))  # trains STANDARD once, in tmp
    for block in _python_blocks():
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert out.strip(), "the example prints its results"
