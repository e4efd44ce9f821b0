"""RoBIC's comparison table: several models (from one or more reports) side by side.

``load_reports(paths)`` reads ``report.json`` files (see :mod:`jaxbundle.report` for the
schema), ``compare_rows`` picks the figures to compare, and ``compare_table`` /
``compare_markdown`` lay them out for the terminal or for a Markdown document::

    rows = compare_rows(load_reports(["runs/a", "runs/b/report.json"]))
    Console(width=100).print(compare_table(rows))

Per model the row holds the clean accuracy, the half-distortions ``D1/2`` of the white-box and
black-box attacks (RoBIC, Pautrat et al. 2021: the distortion that fools half the correctly
classified examples; ``inf`` when under half are ever fooled, ``None`` when not measured), the
bundled robust accuracy at the report's ``eps``, and the relative robustness.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Sequence

from rich.table import Table

from jaxbundle.report.formatting import decode_infinities, number, to_float
from jaxbundle.report.schema import SCHEMA_VERSION as _SCHEMA_VERSION  # the newest this reads

__all__ = ["load_reports", "compare_rows", "compare_table", "compare_markdown", "ROW_KEYS"]

ROW_KEYS = (
    "model",
    "clean_accuracy",
    "d_half_white",
    "d_half_black",
    "robust_accuracy",
    "eps",
    "norm",
    "relative_robustness",
)

def _report_file(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    return os.path.join(path, "report.json") if os.path.isdir(path) else path


def _read(file: str) -> dict:
    try:
        with open(file, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read report {file}: {err}") from None
    if not isinstance(report, dict) or not isinstance(report.get("models"), dict):
        raise ValueError(f"{file} is not a jaxbundle report (no \"models\" mapping)")
    version = report.get("schema_version", _SCHEMA_VERSION)
    if not isinstance(version, int) or version > _SCHEMA_VERSION:
        raise ValueError(
            f"{file} has schema_version {version!r}; this jaxbundle reads up to {_SCHEMA_VERSION}"
        )
    for name, metrics in report["models"].items():
        if not isinstance(metrics, dict):
            raise ValueError(f"{file}: model {name!r} holds no metrics")
    return report


def load_reports(paths: Sequence[str | os.PathLike]) -> list[tuple[str, dict]]:
    """Reads reports (a report directory or its ``report.json``); returns one
    ``(label, metrics)`` per model of every report, in order. The label is ``"<model>"`` for a
    single report, ``"<report dir name>/<model>"`` for several (the directory's path as given
    when two directories share a name). Infinite values come back as ``float("inf")``.

    Raises ValueError, naming the file, when a report cannot be read or is not a report.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise ValueError("no report given")
    files = [_report_file(p) for p in paths]
    reports = [_read(f) for f in files]
    dirs = [os.path.dirname(os.path.abspath(f)) for f in files]
    names = [os.path.basename(d) for d in dirs]
    if len(set(names)) < len(names):
        names = [os.path.normpath(os.path.dirname(f)) or "." for f in files]
    entries = []
    for name, report in zip(names, reports):
        for model, metrics in report["models"].items():
            label = f"{name}/{model}" if len(files) > 1 else str(model)
            entries.append((label, decode_infinities(metrics)))
    return entries


def compare_rows(entries: Sequence[tuple[str, dict]]) -> list[dict]:
    """One row per ``(label, metrics)``: ``model``, ``clean_accuracy``, ``d_half_white``,
    ``d_half_black`` (float, ``inf``, or ``None`` when not measured), ``robust_accuracy``,
    ``eps``, ``norm`` and ``relative_robustness`` (percentages as in the report)."""
    rows = []
    for label, metrics in entries:
        half = metrics.get("half_distortion") or {}
        rows.append({
            "model": label,
            "clean_accuracy": to_float(metrics.get("clean_accuracy")),
            "d_half_white": to_float((half.get("white_box") or {}).get("d_half")),
            "d_half_black": to_float((half.get("black_box") or {}).get("d_half")),
            "robust_accuracy": to_float(metrics.get("robust_accuracy")),
            "eps": to_float(metrics.get("eps")),
            "norm": metrics.get("norm"),
            "relative_robustness": to_float(metrics.get("relative_robustness")),
        })
    return rows


_pct = number
_dist = functools.partial(number, spec=".4g")

_COLUMNS = (  # (header, key, formatter)
    ("model", "model", str),
    ("clean %", "clean_accuracy", _pct),
    ("D1/2 white", "d_half_white", _dist),
    ("D1/2 black", "d_half_black", _dist),
    ("robust %", "robust_accuracy", _pct),
    ("eps", "eps", lambda v: "n/a" if v is None else f"{v:g}"),
    ("norm", "norm", lambda v: "n/a" if v is None else str(v)),
    ("RR %", "relative_robustness", _pct),
)


def compare_table(rows: Sequence[dict], title: str = "Model comparison") -> Table:
    """A rich table of :func:`compare_rows`' rows (fits in 100 columns; long model names fold)."""
    t = Table(title=title, title_justify="left", caption=(
        "D1/2: distortion fooling half the correct examples (inf: never half); "
        "RR: robust / clean correct"
    ), caption_justify="left")
    for header, key, _ in _COLUMNS:
        if key == "model":
            t.add_column(header, overflow="fold", min_width=8, max_width=32)
        elif key == "norm":
            t.add_column(header, no_wrap=True)
        else:
            t.add_column(header, justify="right", no_wrap=True)
    for row in rows:
        t.add_row(*(fmt(row.get(key)) for _, key, fmt in _COLUMNS))
    return t


def compare_markdown(rows: Sequence[dict]) -> str:
    """The rows as a Markdown table (ends with a newline)."""
    def cell(text: str) -> str:
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")

    lines = [
        "| " + " | ".join(header for header, _, _ in _COLUMNS) + " |",
        "|" + "|".join(":---" if key in ("model", "norm") else "---:" for _, key, _ in _COLUMNS)
        + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(cell(fmt(row.get(key))) for _, key, fmt in _COLUMNS) + " |")
    return "\n".join(lines) + "\n"
