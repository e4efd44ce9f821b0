"""Reports: terminal tables, ``report.json`` and per-example ``.npz`` files.

Schema of ``report.json`` (version 1)::

    {
      "schema_version": 1,
      "jaxbundle_version": "...",
      "config": {...},                     # the run's settings (dataset, n, eps, norm, attacks...)
      "models": {
        "<model>": {
          "n_examples": int,
          "clean_accuracy": float,         # percent
          "robust_accuracy": float,        # percent, bundled (every attack, per example)
          "relative_robustness": float | null,   # robust / clean correct x 100
          "mat": {"<attack>": float},      # percent robust accuracy of each attack alone
          "wat": float,                    # lowest single-attack robust accuracy
          "wat_attack": "<attack>",
          "confident_failure_rate": {"<threshold>": float},  # percent
          "white_box_robust_accuracy": float | null,  # bundle of the white-box attacks alone
          "black_box_robust_accuracy": float | null,  # bundle of the black-box attacks alone
          "black_box_only": int,           # examples only a black-box attack fooled (masking?)
          "eps": float, "norm": str, "seed": int, "goals": [str],
          "per_example": "<model>.npz",
          "seconds": float
        }
      }
    }

Each ``<model>.npz`` holds arrays of length ``n_examples``: ``label``, ``clean_prediction``,
``adversarial_prediction``, ``success`` (bool, verified), ``distortion`` (of the reported
adversarial image), ``winning_attack`` (index into ``attack_names``; -1 = the clean image),
``winning_restart``, ``winning_step``, ``attack_success`` (``[n, A]``), ``gradients``,
``queries`` (black-box model queries), ``black_box_only`` (bool: fooled only by black-box attacks),
``x_adv`` (uint8 adversarial images), ``max_wrong_confidence`` and ``min_distortion``
(``inf`` where no misclassified candidate was found), and ``attack_names``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from jaxbundle.evaluate import Evaluation

__all__ = ["SCHEMA_VERSION", "table", "print_tables", "write_report"]

SCHEMA_VERSION = 1


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:6.2f}"


def table(model_name: str, metrics: dict) -> Table:
    """A terminal table: clean accuracy, MAT rows, WAT, bundled robust accuracy and RR."""
    t = Table(
        title=f"{model_name}: {metrics['norm']} eps={metrics['eps']:g}, "
        f"n={metrics['n_examples']}, seed={metrics['seed']}",
        title_justify="left",
    )
    t.add_column("row")
    t.add_column("accuracy %", justify="right")
    t.add_column("RR %", justify="right")
    clean = metrics["clean_accuracy"]
    rr = lambda acc: None if not clean else 100.0 * acc / clean  # noqa: E731
    t.add_row("clean", _pct(clean), "")
    for name, acc in metrics["mat"].items():
        t.add_row(f"MAT  {name}", _pct(acc), _pct(rr(acc)))
    t.add_row(f"WAT  ({metrics['wat_attack']})", _pct(metrics["wat"]), _pct(rr(metrics["wat"])))
    white, black = metrics.get("white_box_robust_accuracy"), metrics.get("black_box_robust_accuracy")
    if white is not None and black is not None:
        t.add_row("white-box bundled", _pct(white), _pct(rr(white)))
        t.add_row("black-box bundled", _pct(black), _pct(rr(black)))
        t.add_row("fooled by black-box only", str(metrics["black_box_only"]), "")
    t.add_row(
        "[bold]bundled robust[/bold]",
        f"[bold]{_pct(metrics['robust_accuracy'])}[/bold]",
        f"[bold]{_pct(metrics['relative_robustness'])}[/bold]",
    )
    return t


def write_report(
    out_dir: str, config: dict[str, Any], results: dict[str, tuple[Evaluation, float]]
) -> str:
    """Writes ``report.json`` and one ``<model>.npz`` per model; returns the JSON path."""
    from jaxbundle import __version__

    os.makedirs(out_dir, exist_ok=True)
    models = {}
    for name, (evaluation, seconds) in results.items():
        npz = f"{name}.npz"
        np.savez_compressed(
            os.path.join(out_dir, npz),
            attack_names=np.asarray(evaluation.attack_names),
            **evaluation.per_example,
        )
        models[name] = dict(evaluation.metrics, per_example=npz, seconds=round(seconds, 2))
    report = {
        "schema_version": SCHEMA_VERSION,
        "jaxbundle_version": __version__,
        "config": config,
        "models": models,
    }
    path = os.path.join(out_dir, "report.json")
    with open(path, "w") as f:
        json.dump(_explicit_inf(report), f, indent=2, allow_nan=False, default=_json_default)
    return path


def _explicit_inf(value: Any) -> Any:
    """JSON has no infinity: an infinite float (e.g. D1/2 when under half are fooled) is
    written as the string ``"inf"``; NaN is never produced."""
    if isinstance(value, dict):
        return {k: _explicit_inf(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_explicit_inf(v) for v in value]
    if isinstance(value, (float, np.floating)) and np.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def print_tables(console: Console, results: dict[str, tuple[Evaluation, float]]) -> None:
    for name, (evaluation, _) in results.items():
        console.print(table(name, evaluation.metrics))
