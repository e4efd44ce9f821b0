"""Figures of a report: P(D), the attack table, failure rate vs confidence, robustness vs compute
and adversarial examples, one PNG per figure.

Every function takes the metrics of one model (as :func:`jaxbundle.evaluate` returns
them, or as read back from ``report.json``, where an infinite value is the string ``"inf"``),
writes a small PNG to ``path`` and returns ``path``. A figure whose data is missing (e.g. no
``failure_rate_curve`` because the max-confidence goal was not tracked) is still written, as a
panel that says so; :func:`write_all` skips such figures altogether.

Only :class:`matplotlib.figure.Figure` and the Agg renderer are used: no display, no pyplot
global state, safe in threads and on headless machines.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from jaxbundle.report.formatting import to_float

__all__ = [
    "operating_characteristic",
    "attack_table",
    "failure_rate",
    "robustness_vs_compute",
    "example_grid",
    "write_all",
    "FIGURES",
]

# The figures of write_all, in order, and their file-name suffixes.
FIGURES = (
    "operating_characteristic",
    "attack_table",
    "failure_rate",
    "robustness_vs_compute",
    "example_grid",
)

_KINDS = (  # (key, legend label, colour)
    ("white_box", "white-box", "tab:blue"),
    ("black_box", "black-box", "tab:orange"),
    ("bundled", "bundled", "tab:red"),
    ("certified", "certified (upper bound on P)", "tab:green"),
)
_DPI = 100


def _figure(width: float = 6.0, height: float = 4.0) -> Figure:
    fig = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


NO_DATA = "jaxbundle: no data"  # the PNG description of a panel drawn without data


def _save(fig: Figure, path: str | os.PathLike, description: str | None = None) -> str:
    path = os.fspath(path)
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    metadata = {"Description": description} if description else None
    fig.savefig(path, format="png", dpi=_DPI, metadata=metadata)
    return path


def _no_data(path: str | os.PathLike, title: str, reason: str) -> str:
    fig = _figure(6.0, 2.0)
    ax = fig.add_subplot()
    ax.set_axis_off()
    ax.set_title(title)
    ax.text(0.5, 0.5, reason, ha="center", va="center", transform=ax.transAxes, wrap=True)
    return _save(fig, path, f"{NO_DATA}: {reason}")


def _threat(metrics: Mapping[str, Any]) -> str:
    eps, norm = to_float(metrics.get("eps")), metrics.get("norm")
    if eps is None or norm is None:
        return ""
    return f"{norm} eps={eps:g}"


def _curves(metrics: Mapping[str, Any]) -> dict[str, np.ndarray]:
    oc = metrics.get("operating_characteristic") or {}
    return {
        kind: np.asarray([to_float(v) or 0.0 for v in oc[kind]], np.float64)
        for kind, _, _ in _KINDS
        if oc.get(kind)
    }


# --------------------------------------------------------------------------------- P(D) curves


def operating_characteristic(metrics: Mapping[str, Any], path: str | os.PathLike) -> str:
    """RoBIC's operating characteristic: ``P(D)`` (fraction of the correctly classified examples
    fooled within distortion ``D``) for the white-box, black-box and bundled attacks (those that
    ran), with the finite ``D1/2`` of each and ``eps`` marked, and the clean error in the title.
    The x axis stops a little after every curve has reached its last value."""
    title = "Operating characteristic P(D)"
    curves = _curves(metrics)
    oc = metrics.get("operating_characteristic") or {}
    grid = np.asarray([to_float(v) for v in oc.get("grid", [])], np.float64)
    if not curves or grid.size == 0:
        return _no_data(path, title, "no P(D) curve in these metrics")
    curves = {k: c for k, c in curves.items() if c.size == grid.size}
    if not curves:
        return _no_data(path, title, "P(D) curves and grid differ in length")

    eps = to_float(metrics.get("eps"))
    norm = metrics.get("norm") or "distortion"
    half = metrics.get("half_distortion") or {}
    fig = _figure()
    ax = fig.add_subplot()
    marks = [] if eps is None else [eps]
    # Prepend (0, 0): a correctly classified image is not fooled at distortion 0.
    x = np.concatenate([[0.0], grid])
    for kind, label, colour in _KINDS:
        if kind not in curves:
            continue
        d_half = to_float((half.get(kind) or {}).get("d_half"))
        fooled = to_float((half.get(kind) or {}).get("fooled_fraction"))
        if d_half is None:
            text = "n/a"
        elif math.isinf(d_half):
            text = "inf" + (f" (max P={fooled:.2f})" if fooled is not None else "")
        else:
            text = f"{d_half:.3g}"
        ax.plot(
            x, np.concatenate([[0.0], curves[kind]]), color=colour, drawstyle="steps-post",
            label=f"{label}: $D_{{1/2}}$={text}",
        )
        if d_half is not None and math.isfinite(d_half):
            ax.axvline(d_half, color=colour, linestyle="--", linewidth=1)
            marks.append(d_half)
    if eps is not None:
        ax.axvline(eps, color="black", linestyle=":", linewidth=1.2, label=f"eps = {eps:g}")
    ax.axhline(0.5, color="grey", linewidth=0.6, alpha=0.6)

    # Saturation: the first grid point where every curve has reached its final value.
    stack = np.stack(list(curves.values()))
    done = np.all(stack >= stack[:, -1:] - 1e-12, axis=0)
    saturated = grid[int(np.argmax(done))]
    right = max([saturated, *marks]) * 1.15 if max([saturated, *marks]) > 0 else grid[-1]
    ax.set_xlim(0.0, min(right, float(grid[-1])))
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel(f"D ({norm} distortion)")
    ax.set_ylabel("P(D): fraction of correct examples fooled")
    clean = to_float(metrics.get("clean_accuracy"))
    subtitle = "" if clean is None else f" (clean error {100.0 - clean:.2f}%)"
    ax.set_title(title + subtitle)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    return _save(fig, path)


# -------------------------------------------------------------------------------- attack table


def attack_table(metrics: Mapping[str, Any], path: str | os.PathLike) -> str:
    """Horizontal bars: the robust accuracy of each attack alone (MAT), the worst of them (WAT),
    the white-box and black-box bundles when both kinds ran, and the bundled robust accuracy;
    the clean accuracy as a vertical reference line."""
    title = "Robust accuracy per attack"
    rows: list[tuple[str, float, str]] = []  # (label, percent, colour)
    for name, acc in (metrics.get("mat") or {}).items():
        if to_float(acc) is not None:
            rows.append((f"MAT {name}", to_float(acc), "tab:gray"))
    wat = to_float(metrics.get("wat"))
    if wat is not None:
        rows.append((f"WAT ({metrics.get('wat_attack')})", wat, "tab:purple"))
    for key, label, colour in (
        ("white_box_robust_accuracy", "white-box bundled", "tab:blue"),
        ("black_box_robust_accuracy", "black-box bundled", "tab:orange"),
    ):
        if to_float(metrics.get(key)) is not None:
            rows.append((label, to_float(metrics.get(key)), colour))
    robust = to_float(metrics.get("robust_accuracy"))
    if robust is not None:
        rows.append(("bundled", robust, "tab:red"))
    if not rows:
        return _no_data(path, title, "no robust accuracy in these metrics")

    fig = _figure(6.5, 1.2 + 0.32 * len(rows))
    ax = fig.add_subplot()
    y = np.arange(len(rows))[::-1]  # first row on top
    values = [r[1] for r in rows]
    ax.barh(y, values, color=[r[2] for r in rows], height=0.7)
    for yi, v in zip(y, values):
        ax.text(v + 1.0, yi, f"{v:.1f}", va="center", fontsize="small")
    ax.set_yticks(y, [r[0] for r in rows], fontsize="small")
    clean = to_float(metrics.get("clean_accuracy"))
    if clean is not None:
        ax.axvline(clean, color="black", linestyle="--", linewidth=1, label=f"clean {clean:.1f}%")
        ax.legend(loc="lower right", fontsize="small")
    ax.set_xlim(0.0, 110.0)
    ax.set_xlabel("accuracy (%)")
    threat = _threat(metrics)
    ax.set_title(title + (f" ({threat})" if threat else ""))
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


# ------------------------------------------------------------------------------- failure rate


def failure_rate(metrics: Mapping[str, Any], path: str | os.PathLike) -> str:
    """CleverHans' success-fail curve: the percentage of examples wrong with confidence >= t
    under attack (within eps) and on the clean images, for thresholds t in [0.5, 1]."""
    title = "Failure rate vs confidence threshold"
    curve = metrics.get("failure_rate_curve")
    if not curve or not curve.get("thresholds"):
        return _no_data(
            path, title, "no failure-rate curve (the max_confidence goal was not tracked)"
        )
    t = np.asarray([to_float(v) for v in curve["thresholds"]], np.float64)
    fig = _figure()
    ax = fig.add_subplot()
    for key, colour in (("attacked", "tab:red"), ("clean", "tab:green")):
        if curve.get(key) is not None and len(curve[key]) == t.size:
            ax.plot(t, 100.0 * np.asarray(curve[key], np.float64), color=colour, label=key)
    ax.set_xlim(float(t.min()), float(t.max()))
    ax.set_ylim(0.0, 102.0)
    ax.set_xlabel("confidence threshold t")
    ax.set_ylabel("wrong with confidence >= t (%)")
    threat = _threat(metrics)
    ax.set_title(title + (f" ({threat})" if threat else ""))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")
    return _save(fig, path)


# ------------------------------------------------------------------------ robustness vs compute


def robustness_vs_compute(metrics: Mapping[str, Any], path: str | os.PathLike) -> str:
    """The bundled robust accuracy after the first k attacks of the bundle against the
    gradients + queries spent per example so far (a step plot; log-scaled x when the costs
    span more than two decades). Steps are labelled with the attack names when they match."""
    title = "Robust accuracy vs compute"
    rc = metrics.get("robustness_vs_compute") or {}
    cost = np.asarray([to_float(v) for v in rc.get("cost", [])], np.float64)
    acc = np.asarray([to_float(v) for v in rc.get("robust_accuracy", [])], np.float64)
    if cost.size < 2 or cost.size != acc.size:
        return _no_data(path, title, "no robustness-vs-compute curve in these metrics")
    fig = _figure()
    ax = fig.add_subplot()
    ax.step(cost, acc, where="post", color="tab:red", marker="o", markersize=4)
    names = list((metrics.get("mat") or {}).keys())
    if len(names) == cost.size - 1:
        for name, c, a in zip(names, cost[1:], acc[1:]):
            ax.annotate(
                name, (c, a), textcoords="offset points", xytext=(3, 4), fontsize="x-small"
            )
    positive = cost[cost > 0]
    if positive.size and positive.max() / positive.min() > 100:
        ax.set_xscale("symlog", linthresh=float(positive.min()))
    ax.margins(x=0.08)  # room for the last attack's name
    ax.set_ylim(0.0, max(102.0, float(np.nanmax(acc)) + 2.0))
    ax.set_xlabel("gradients + queries per example (cumulative)")
    ax.set_ylabel("bundled robust accuracy (%)")
    threat = _threat(metrics)
    ax.set_title(title + (f" ({threat})" if threat else ""))
    ax.grid(alpha=0.3)
    return _save(fig, path)


# ------------------------------------------------------------------------------- example grid


def _successful(per_example: Mapping[str, np.ndarray]) -> np.ndarray:
    """Indices of the correctly classified examples an attack fooled (verified)."""
    success = np.asarray(per_example["success"], bool)
    if "label" in per_example and "clean_prediction" in per_example:
        success &= np.asarray(per_example["clean_prediction"]) == np.asarray(per_example["label"])
    return np.flatnonzero(success)


def _image(x: np.ndarray) -> tuple[np.ndarray, dict]:
    """``[H, W, C]`` (C 1 or 3) or ``[H, W]`` in [0, 1] -> an array and imshow options."""
    if x.ndim == 3 and x.shape[-1] == 1:
        x = x[..., 0]
    if x.ndim == 2:
        return x, {"cmap": "gray", "vmin": 0.0, "vmax": 1.0}
    if x.ndim == 3 and x.shape[-1] == 3:
        return np.clip(x, 0.0, 1.0), {}
    raise ValueError(f"images must be [H, W, 1] or [H, W, 3], got shape {x.shape}")


def example_grid(
    x_clean: np.ndarray,
    per_example: Mapping[str, np.ndarray],
    path: str | os.PathLike,
    max_examples: int = 8,
) -> str:
    """Clean / adversarial pairs (one column each) for up to ``max_examples`` correctly
    classified examples that an attack fooled, with the label, the adversarial prediction and
    the distortion; a third row shows the perturbation, amplified. ``x_clean``: float
    ``[n, H, W, C]`` in [0, 1] (C = 1: grayscale, 3: RGB); ``per_example`` as in the report
    (``x_adv`` uint8 or float32)."""
    title = "Adversarial examples"
    x_clean = np.asarray(x_clean, np.float64)
    x_adv = np.asarray(per_example["x_adv"])
    if x_clean.shape[0] != x_adv.shape[0]:
        raise ValueError(f"{x_clean.shape[0]} clean images for {x_adv.shape[0]} adversarial ones")
    if x_clean.shape[1:] != x_adv.shape[1:]:
        raise ValueError(f"clean images {x_clean.shape[1:]} and x_adv {x_adv.shape[1:]} differ")
    index = _successful(per_example)[: max(int(max_examples), 0)]
    if index.size == 0:
        return _no_data(path, title, "no correctly classified example was fooled")
    adv = x_adv.astype(np.float64) / 255.0 if x_adv.dtype == np.uint8 else x_adv.astype(np.float64)
    delta = adv[index] - x_clean[index]
    scale = np.max(np.abs(delta))
    amp = 0.5 / scale if scale > 0 else 1.0

    k = index.size
    fig = _figure(1.3 * k + 0.4, 4.6)
    axes = fig.subplots(3, k, squeeze=False)
    label = per_example.get("label")
    pred = per_example.get("adversarial_prediction")
    dist = per_example.get("distortion")
    for col, i in enumerate(index):
        for row, (img, text) in enumerate((
            (x_clean[i], f"label {int(label[i])}" if label is not None else "clean"),
            (adv[i], (f"pred {int(pred[i])}" if pred is not None else "adv.")
             + (f"\nD={float(dist[i]):.3g}" if dist is not None else "")),
            (0.5 + amp * (adv[i] - x_clean[i]), "perturbation" if col == 0 else ""),
        )):
            ax = axes[row, col]
            image, options = _image(img)
            ax.imshow(image, interpolation="nearest", **options)
            ax.set_title(text, fontsize="small")
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(f"{title} (rows: clean, adversarial, perturbation x{amp:.3g})", fontsize="medium")
    return _save(fig, path)


# ------------------------------------------------------------------------------------ all of it


def _has_data(name: str, metrics: Mapping[str, Any], per_example, x_clean) -> bool:
    if name == "operating_characteristic":
        oc = metrics.get("operating_characteristic") or {}
        return bool(oc.get("grid")) and bool(_curves(metrics))
    if name == "attack_table":
        return bool(metrics.get("mat")) or to_float(metrics.get("robust_accuracy")) is not None
    if name == "failure_rate":
        return bool((metrics.get("failure_rate_curve") or {}).get("thresholds"))
    if name == "robustness_vs_compute":
        return len((metrics.get("robustness_vs_compute") or {}).get("cost", [])) > 1
    if name == "example_grid":
        return (
            per_example is not None
            and x_clean is not None
            and "x_adv" in per_example
            and "success" in per_example
            and _successful(per_example).size > 0
        )
    raise ValueError(f"unknown figure {name!r}")


_METRIC_FIGURES = {
    "operating_characteristic": operating_characteristic,
    "attack_table": attack_table,
    "failure_rate": failure_rate,
    "robustness_vs_compute": robustness_vs_compute,
}


def write_all(
    metrics: Mapping[str, Any],
    per_example: Mapping[str, np.ndarray] | None,
    x_clean: np.ndarray | None,
    out_dir: str | os.PathLike,
    prefix: str = "",
) -> dict[str, str]:
    """Writes every figure of :data:`FIGURES` that has data to ``out_dir`` as
    ``<prefix>_<figure>.png`` (``<figure>.png`` without a prefix); returns ``{figure: file name}``
    with names relative to ``out_dir``, in the order of :data:`FIGURES`. ``per_example`` and
    ``x_clean`` may be ``None`` (no example grid)."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    written = {}
    for name in FIGURES:
        if not _has_data(name, metrics, per_example, x_clean):
            continue
        filename = f"{prefix}_{name}.png" if prefix else f"{name}.png"
        path = os.path.join(out_dir, filename)
        if name == "example_grid":
            example_grid(x_clean, per_example, path)
        else:
            _METRIC_FIGURES[name](metrics, path)
        written[name] = filename
    return written
