"""What the docs tests share: the pages, their code blocks and commands, the files the blocks
read, and a tiny report."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle.cli import main

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


DEFAULT_FOCUS = {"apgd-ce-long": 0.5, "apgd-t5": 0.5, "square-aa": 0.06}  # the docs' own words
