"""Reports: terminal tables, ``report.json``, ``report.md``, per-example ``.npz`` files, figures.

The fields of ``report.json`` and of each ``<model>.npz`` are listed once, in
:mod:`jaxbundle.report.schema` (and in docs/report.md); this module only writes them.
Infinite values (a D1/2 when under half the examples are ever fooled) are written as the
string ``"inf"``: JSON has no infinity, and a NaN never stands for a number here.
``report.md`` holds the same figures as Markdown tables with the PNG plots.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from jaxbundle.report.formatting import encode_infinities, number
from jaxbundle.report.schema import SCHEMA_VERSION, with_extras

# What the writers read: jaxbundle.evaluation.Evaluation records (metrics, per-example arrays,
# gallery, attack names), by their fields; the report runs nothing, so it imports no engine.
Evaluation = Any

__all__ = ["SCHEMA_VERSION", "table", "print_tables", "write_report", "markdown"]


def attack_rows(metrics: dict) -> list[tuple[str, float | None]]:
    """The per-attack rows of a model's table: the MAT and the WAT (full schedule), or the
    robust accuracy after each stage of a cascade, with the examples each stage ran on."""
    if (metrics.get("schedule") or {}).get("stages") is not None:  # a cascade's stages
        return [
            (f"after {s['attack']} ({s['examples']} attacked"
             + (f", {s['cut']} stopped after the probe" if s.get("cut") else "")
             + (f", {s['skipped']} survivors skipped)" if s.get("skipped") else ")"),
             s["robust_accuracy"])
            for s in metrics["schedule"]["stages"]
        ]
    rows = [(f"MAT  {name}", acc) for name, acc in metrics["mat"].items()]
    return rows + [(f"WAT  ({metrics['wat_attack']})", metrics["wat"])]


def table(model_name: str, metrics: dict) -> Table:
    """A terminal table: clean accuracy, MAT rows, WAT, bundled robust accuracy and RR."""
    t = Table(
        title=f"{model_name}: {metrics['norm']} eps={metrics['eps']:g}, "
        f"n={metrics['n_examples']}, seed={metrics['plan']['run']['seed']}",
        title_justify="left",
    )
    t.add_column("row")
    t.add_column("accuracy %", justify="right")
    t.add_column("RR %", justify="right")
    clean = metrics["clean_accuracy"]
    rr = lambda acc: None if not clean else 100.0 * acc / clean  # noqa: E731
    t.add_row("clean", number(clean), "")
    for label, acc in attack_rows(metrics):
        t.add_row(label, number(acc), number(rr(acc)))
    white, black = (metrics.get("white_box_robust_accuracy"),
                    metrics.get("black_box_robust_accuracy"))
    if white is not None and black is not None:
        t.add_row("white-box bundled", number(white), number(rr(white)))
        t.add_row("black-box bundled", number(black), number(rr(black)))
        t.add_row("fooled by black-box only", str(metrics["black_box_only"]), "")
    t.add_row(
        "[bold]bundled robust[/bold]",
        f"[bold]{number(metrics['robust_accuracy'])}[/bold]",
        f"[bold]{number(metrics['relative_robustness'])}[/bold]",
    )
    for label, value, ratio in certified_rows(metrics):
        t.add_row(label, value, ratio)
    return t


def certified_rows(metrics: dict) -> list[tuple[str, str, str]]:
    """With ``--certify``: the certified robust accuracy and the interval robust accuracy lies
    in, ``[certified, bundled]``, with the examples neither side decides."""
    c = metrics.get("certified")
    if not c:
        return []
    if c["interval"] is None:  # smoothing: another classifier, no interval
        return [(f"certified ({c['method']}, smoothed classifier)",
                 number(c["certified_robust_accuracy"]), "")]
    clean = metrics["clean_accuracy"]
    low, high = c["interval"]
    return [
        (f"certified ({c['method']})", number(low),
         number(None if not clean else 100.0 * low / clean)),
        ("robust accuracy in", f"[{number(low)}, {number(high)}]",
         f"{c['undecided']} undecided"),
    ]


def write_report(
    out_dir: str,
    config: dict[str, Any],
    results: dict[str, tuple[Evaluation, float]],
    x_clean: np.ndarray | None = None,
) -> str:
    """Writes ``report.json``, ``report.md``, one ``<model>.npz`` and the PNG figures per model
    (the example grid only with the clean images ``x_clean``); returns the JSON path."""
    from jaxbundle import __version__
    from jaxbundle.report import plots

    os.makedirs(out_dir, exist_ok=True)
    models = {}
    for name, (evaluation, seconds) in results.items():
        npz = f"{name}.npz"
        np.savez_compressed(
            os.path.join(out_dir, npz),
            attack_names=np.asarray(evaluation.attack_names),
            **evaluation.per_example,
        )
        figures = plots.write_all(
            evaluation.metrics, *_grid_inputs(evaluation, x_clean), out_dir, prefix=name
        )
        models[name] = with_extras(
            evaluation.metrics, per_example=npz, figures=figures, seconds=round(seconds, 2)
        )
    report = {
        "schema_version": SCHEMA_VERSION,
        "jaxbundle_version": __version__,
        "config": config,
        "models": models,
    }
    path = os.path.join(out_dir, "report.json")
    with open(path, "w") as f:
        json.dump(encode_infinities(report), f, indent=2, allow_nan=False, default=_json_default)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(markdown(report))
    return path


def _grid_inputs(evaluation: Evaluation, x_clean: np.ndarray | None) -> tuple[dict, Any]:
    """The per-example arrays and clean images the example figure shows: the evaluation's
    gallery when it has one, else every example (with ``x_clean``)."""
    shown = evaluation.gallery
    if shown is None or not len(shown["example_id"]):
        return evaluation.per_example, x_clean
    ids = shown["example_id"]
    keys = ("label", "clean_prediction", "adversarial_prediction", "distortion", "success")
    per_example = {k: evaluation.per_example[k][ids] for k in keys}
    return dict(per_example, x_adv=shown["x_adv"]), shown["x_clean"]


def _half_text(h: dict | None) -> str:
    if not h:
        return "n/a"
    if h["d_half"] is not None and np.isinf(h["d_half"]):
        return f"inf (only {100 * h['fooled_fraction']:.1f}% ever fooled)"
    return number(h["d_half"], ".3f")


def check_lines(checks: dict[str, dict]) -> list[str]:
    """The trustworthiness checks in a few lines: how many passed, then each failure."""
    failed = {k: c for k, c in checks.items() if not c["passed"]}
    if not checks:
        return []
    lines = [f"checks: {len(checks) - len(failed)} of {len(checks)} passed"
             + ("" if failed else " (" + ", ".join(checks) + ")")]
    for name, c in failed.items():
        lines.append(f"check {name} FAILED: {c['saw']}; {c['means']}; try: {c['advice']}")
    return lines


def markdown(report: dict) -> str:
    """The report as Markdown: per model the attack table, D1/2, shifts and the figures."""
    c = report["config"]
    plan = c.get("plan") or {}
    threat, attacks = plan.get("threat_model") or {}, [a["name"] for a in plan.get("attacks", [])]
    lines = [
        "# jaxbundle report",
        "",
        f"{c.get('dataset', '?')}, n={c.get('n')}, {threat.get('norm')} eps={threat.get('eps')}, "
        f"attacks: {', '.join(attacks)} ({plan.get('schedule', {}).get('mode')}), "
        f"seed {plan.get('run', {}).get('seed')}.",
        "",
    ]
    for name, m in report["models"].items():
        clean = m["clean_accuracy"]
        rr = lambda acc: None if not clean else 100.0 * acc / clean  # noqa: E731
        lines += [f"## {name}", "", "| row | accuracy % | RR % |", "|---|---:|---:|",
                  f"| clean | {number(clean)} | |"]
        lines += [
            f"| {' '.join(label.split())} | {number(v)} | {number(rr(v))} |"
            for label, v in attack_rows(m)
        ]
        for kind in ("white_box", "black_box"):
            v = m.get(f"{kind}_robust_accuracy")
            if v is not None and m.get("black_box_robust_accuracy") is not None:
                lines.append(f"| {kind.replace('_', '-')} bundled | {number(v)} | "
                             f"{number(rr(v))} |")
        lines += [
            f"| **bundled robust** | **{number(m['robust_accuracy'])}** | "
            f"**{number(m['relative_robustness'])}** |",
            *[f"| {label} | {value} | {ratio} |" for label, value, ratio in certified_rows(m)],
            "",
            f"Judged: {m['judging']['statement']}.",
            *(["", f"Certified: {m['certified']['statement']}."] if m.get("certified") else []),
            "",
            *([f"Precision: {m['model_dtype']['statement']}.", ""] if m.get("model_dtype") else []),
            *([f"{m['stochastic']['statement']}; {_rates(m['stochastic'])}.", ""]
              if m.get("stochastic") else []),
            *([f"{m['schedule']['statement']}.", ""]
              if (m.get("schedule") or {}).get("statement") else []),
            *([f"Fooled only by black-box attacks: {m['black_box_only']} examples.", ""]
              if m.get("black_box_only") is not None else []),
        ]
        checks = (m.get("checks") or {})
        if checks:
            lines += ["| check | passed | saw | means / try |", "|---|---|---|---|"]
            lines += [f"| {k} | {'yes' if c['passed'] else '**no**'} | {c['saw']} | "
                      f"{c['means']}; try: {c['advice']} |" for k, c in checks.items()]
            lines.append("")
        half = (m.get("half_distortion") or {})
        if half:
            lines += ["| half-distortion D1/2 (" + m["norm"] + ") | value |", "|---|---|"]
            lines += [f"| {k.replace('_', '-')} | {_half_text(h)} |" for k, h in half.items()]
            lines.append("")
        shifts = m.get("shifts")
        if shifts:
            names = [k for k in shifts if k != "clean_accuracy"]
            sev = list(shifts[names[0]]) if names else []
            lines += ["| shift (accuracy % / RR %) | "
                      + " | ".join(f"severity {s}" for s in sev) + " |",
                      "|---|" + "---|" * len(sev)]
            for s_name in names:
                cells = [f"{number(v['accuracy'], '.1f')} / "
                         f"{number(v['relative_robustness'], '.1f')}"
                         for v in shifts[s_name].values()]
                lines.append(f"| {s_name} | " + " | ".join(cells) + " |")
            lines.append("")
        for fig, file in (m.get("figures") or {}).items():
            lines += [f"![{name} {fig}]({file})", ""]
    return "\n".join(lines)


def _rates(s: dict) -> str:
    """A stochastic model's robust accuracy at each success-rate threshold, in one line."""
    at = ", ".join(f"{100 * v:.1f} % at {t}" for t, v in s["robust_accuracy_at_threshold"].items())
    eot = ", ".join(f"{k} {v}" for k, v in s["eot"].items())
    return f"robust accuracy {at}; EOT samples: {eot}"


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def print_tables(console: Console, results: dict[str, tuple[Evaluation, float]]) -> None:
    for name, (evaluation, _) in results.items():
        m = evaluation.metrics
        console.print(table(name, m))
        console.print(f"  judged: {m['judging']['statement']}", highlight=False, soft_wrap=True)
        if m.get("certified"):
            console.print(f"  [bold]certified:[/bold] {m['certified']['statement']}",
                          highlight=False, soft_wrap=True)
        if m.get("model_dtype"):
            console.print(f"  precision: {m['model_dtype']['statement']}", highlight=False,
                          soft_wrap=True)
        if (m.get("schedule") or {}).get("statement"):
            console.print(f"  [bold]upper bound:[/bold] {m['schedule']['statement']}",
                          highlight=False, soft_wrap=True)
        if m.get("stochastic"):
            console.print(f"  {m['stochastic']['statement']}; {_rates(m['stochastic'])}",
                          highlight=False, soft_wrap=True)
        for line in check_lines((m.get("checks") or {})):
            console.print(f"  {line}", highlight=False, soft_wrap=True)
        half = m.get("half_distortion")
        if half:
            console.print(
                f"  D1/2 ({m['norm']}): "
                + ", ".join(f"{k.replace('_', '-')} {_half_text(h)}" for k, h in half.items())
            )
        shifts = m.get("shifts")
        if shifts:
            worst = {
                s: min(v["accuracy"] for v in sev.values())
                for s, sev in shifts.items() if s != "clean_accuracy"
            }
            console.print(
                "  shifts, accuracy at the worst severity: "
                + ", ".join(f"{s} {a:.1f}%" for s, a in worst.items())
            )
