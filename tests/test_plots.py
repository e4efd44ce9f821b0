"""Figures: every function writes a PNG from hand-made metrics, missing data included."""

from __future__ import annotations

import copy
import math
import os

import numpy as np
import pytest

from jaxbundle import plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
METRIC_FIGURES = (
    "operating_characteristic", "attack_table", "failure_rate", "robustness_vs_compute"
)


def assert_png(path, data: bool = True) -> None:
    """A PNG file; with ``data``, a real figure, not the panel drawn when data is missing."""
    assert os.path.getsize(path) > 100
    with open(path, "rb") as f:
        content = f.read()
    assert content[:8] == PNG_SIGNATURE
    assert (plots.NO_DATA.encode() in content) is not data, "no-data panel" if data else "figure"


def make_metrics() -> dict:
    grid = np.linspace(0.0, 1.0, 21)[1:]
    return {
        "n_examples": 8,
        "clean_accuracy": 87.5,
        "robust_accuracy": 25.0,
        "relative_robustness": 28.57,
        "mat": {"pgd": 37.5, "fgsm": 62.5, "rays": 50.0},
        "wat": 37.5,
        "wat_attack": "pgd",
        "white_box_robust_accuracy": 37.5,
        "black_box_robust_accuracy": 50.0,
        "eps": 0.3,
        "norm": "linf",
        "operating_characteristic": {
            "grid": grid.tolist(),
            "white_box": np.clip(grid * 2, 0, 5 / 7).tolist(),
            "black_box": np.clip(grid, 0, 3 / 7).tolist(),
            "bundled": np.clip(grid * 2.5, 0, 6 / 7).tolist(),
        },
        "half_distortion": {
            "white_box": {"d_half": 0.25, "fooled_fraction": 5 / 7, "n_correct": 7},
            "black_box": {"d_half": math.inf, "fooled_fraction": 3 / 7, "n_correct": 7},
            "bundled": {"d_half": 0.2, "fooled_fraction": 6 / 7, "n_correct": 7},
        },
        "failure_rate_curve": {
            "thresholds": [0.5, 0.6, 0.7, 0.8, 0.9, 1.0],
            "attacked": [0.75, 0.7, 0.6, 0.5, 0.25, 0.0],
            "clean": [0.125, 0.125, 0.1, 0.0, 0.0, 0.0],
        },
        "robustness_vs_compute": {
            "cost": [0, 1, 100, 5100], "robust_accuracy": [87.5, 62.5, 37.5, 25.0]
        },
        "attack_contribution": {
            "pgd": {"won": 4, "only_this": 1},
            "fgsm": {"won": 1, "only_this": 0},
            "rays": {"won": 1, "only_this": 1},
        },
    }


def make_per_example(n: int = 8, channels: int = 1, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(n, 12, 10, channels)).astype(np.float32)
    x_adv = np.round(np.clip(x + rng.uniform(-0.3, 0.3, x.shape), 0, 1) * 255).astype(np.uint8)
    label = np.arange(n) % 10
    clean = label.copy()
    clean[0] = (label[0] + 1) % 10  # misclassified clean: never shown
    success = np.array([True, True, False, True, True, False, True, False])[:n]
    adv = np.where(success, (label + 3) % 10, clean)
    per_example = {
        "label": label,
        "clean_prediction": clean,
        "adversarial_prediction": adv,
        "success": success,
        "distortion": np.abs(x_adv / 255.0 - x).reshape(n, -1).max(axis=1),
        "x_adv": x_adv,
    }
    return x, per_example


@pytest.mark.parametrize("name", METRIC_FIGURES)
def test_each_metric_figure_writes_a_png(tmp_path, name):
    path = tmp_path / f"{name}.png"
    assert getattr(plots, name)(make_metrics(), path) == str(path)
    assert_png(path)


@pytest.mark.parametrize("channels", [1, 3])
def test_example_grid_grayscale_and_rgb(tmp_path, channels):
    x, per_example = make_per_example(channels=channels)
    path = str(tmp_path / "grid.png")
    assert plots.example_grid(x, per_example, path, max_examples=3) == path
    assert_png(path)
    assert list(plots._successful(per_example)) == [1, 3, 4, 6]  # clean-correct and fooled


def test_example_grid_rejects_mismatched_inputs(tmp_path):
    x, per_example = make_per_example()
    with pytest.raises(ValueError, match="clean images"):
        plots.example_grid(x[:4], per_example, tmp_path / "grid.png")


def test_missing_kinds_and_curves_do_not_fail(tmp_path):
    m = make_metrics()
    del m["operating_characteristic"]["black_box"], m["half_distortion"]["black_box"]
    m["black_box_robust_accuracy"] = None
    m["half_distortion"]["white_box"]["d_half"] = None
    m["half_distortion"]["bundled"]["d_half"] = math.inf
    m["failure_rate_curve"] = None  # a report field that does not apply is null
    for name in METRIC_FIGURES:  # the failure-rate curve alone is gone entirely
        assert_png(getattr(plots, name)(m, tmp_path / f"{name}.png"), data=name != "failure_rate")
    # Nothing at all: each function still writes a panel saying there is no data.
    for name in METRIC_FIGURES:
        assert_png(getattr(plots, name)({}, tmp_path / f"empty_{name}.png"), data=False)
    x, per_example = make_per_example()
    per_example["success"][:] = False
    assert_png(plots.example_grid(x, per_example, tmp_path / "none.png"), data=False)


def test_a_cascade_record_without_a_many_attack_table(tmp_path):
    """A cascade's record has ``mat``, ``wat`` and ``wat_attack`` null (schema version 2): the
    attack table still shows the bundled figures, and every figure is drawn."""
    m = make_metrics()
    m.update(mat=None, wat=None, wat_attack=None, black_box_robust_accuracy=None)
    for name in METRIC_FIGURES:
        assert_png(getattr(plots, name)(m, tmp_path / f"{name}.png"))
    written = plots.write_all(m, None, None, tmp_path / "cascade", "")
    assert list(written) == [n for n in plots.FIGURES if n != "example_grid"]


def test_metrics_read_back_from_report_json_with_inf_strings(tmp_path):
    m = make_metrics()
    m["half_distortion"]["black_box"]["d_half"] = "inf"
    m["eps"] = "0.3"
    assert_png(plots.operating_characteristic(m, tmp_path / "oc.png"))


def test_write_all_writes_what_has_data(tmp_path):
    x, per_example = make_per_example(channels=3)
    written = plots.write_all(make_metrics(), per_example, x, tmp_path / "out", "standard")
    assert list(written) == list(plots.FIGURES)
    for name, filename in written.items():
        assert filename == f"standard_{name}.png"
        assert_png(tmp_path / "out" / filename)
    assert sorted(os.listdir(tmp_path / "out")) == sorted(written.values())

    m = copy.deepcopy(make_metrics())
    m["failure_rate_curve"] = None
    del m["operating_characteristic"]["black_box"]
    written = plots.write_all(m, None, None, tmp_path / "less", "")
    assert list(written) == [
        "operating_characteristic", "attack_table", "robustness_vs_compute"
    ]
    assert sorted(os.listdir(tmp_path / "less")) == sorted(f"{n}.png" for n in written)
