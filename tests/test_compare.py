"""The comparison table: hand-written report.json files (with "inf" strings) in, rows out."""

from __future__ import annotations

import io
import json
import math

import pytest
from rich.console import Console

from jaxbundle.compare import ROW_KEYS, compare_markdown, compare_rows, compare_table, load_reports


def model(clean, robust, rr, white, black, eps=0.3, norm="linf") -> dict:
    half = {}
    if white is not None:
        half["white_box"] = {"d_half": white, "fooled_fraction": 0.4, "n_correct": 10}
    if black is not None:
        half["black_box"] = {"d_half": black, "fooled_fraction": 0.4, "n_correct": 10}
    return {
        "n_examples": 10, "clean_accuracy": clean, "robust_accuracy": robust,
        "relative_robustness": rr, "mat": {"pgd": robust}, "wat": robust, "wat_attack": "pgd",
        "eps": eps, "norm": norm, "seed": 0, "half_distortion": half,
        "per_example": "m.npz", "seconds": 1.0,
    }


def write(directory, models) -> str:
    directory.mkdir(parents=True)
    path = directory / "report.json"
    path.write_text(json.dumps({"schema_version": 1, "config": {}, "models": models}))
    return str(path)


@pytest.fixture
def reports(tmp_path):
    a = write(tmp_path / "run_a", {
        "standard": model(99.0, 0.0, 0.0, 0.0625, "inf"),
        "adversarial": model(98.0, 88.5, 90.306, "inf", "inf"),
    })
    b = write(
        tmp_path / "run_b", {"adversarial": model(97.25, 80.0, 82.262, 0.41, None, 2.0, "l2")}
    )
    return a, b


def test_one_report_labels_by_model_and_decodes_inf(reports):
    entries = load_reports([reports[0]])
    assert [label for label, _ in entries] == ["standard", "adversarial"]
    assert entries[0][1]["half_distortion"]["black_box"]["d_half"] == math.inf
    assert entries[0][1]["wat_attack"] == "pgd"


def test_rows_from_two_reports(reports, tmp_path):
    rows = compare_rows(load_reports([tmp_path / "run_a", reports[1]]))  # a directory, a file
    labels = ["run_a/standard", "run_a/adversarial", "run_b/adversarial"]
    assert [r["model"] for r in rows] == labels
    assert all(tuple(r) == ROW_KEYS for r in rows)
    assert rows[0] == {
        "model": "run_a/standard", "clean_accuracy": 99.0, "d_half_white": 0.0625,
        "d_half_black": math.inf, "robust_accuracy": 0.0, "eps": 0.3, "norm": "linf",
        "relative_robustness": 0.0,
    }
    assert rows[1]["d_half_white"] == math.inf and rows[1]["d_half_black"] == math.inf
    assert rows[2]["d_half_black"] is None and rows[2]["norm"] == "l2" and rows[2]["eps"] == 2.0


def test_table_and_markdown_show_the_values(reports):
    rows = compare_rows(load_reports(list(reports)))
    buf = io.StringIO()
    Console(file=buf, width=100, color_system=None).print(compare_table(rows))
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 100
    for value in ("run_a/standard", "run_b/adversarial", "99.00", "88.50", "0.0625", "inf",
                  "n/a", "90.31", "0.41", "l2", "0.3"):
        assert value in text, value

    md = compare_markdown(rows)
    lines = md.strip().splitlines()
    assert len(lines) == 2 + 3
    assert lines[0].startswith("| model |") and set(lines[1]) <= set("|:-")
    assert lines[2] == "| run_a/standard | 99.00 | 0.0625 | inf | 0.00 | 0.3 | linf | 0.00 |"
    assert lines[4] == "| run_b/adversarial | 97.25 | 0.41 | n/a | 80.00 | 2 | l2 | 82.26 |"


def test_same_directory_names_stay_apart(tmp_path):
    a = write(tmp_path / "x" / "report", {"m": model(90.0, 50.0, 55.5, 0.1, None)})
    b = write(tmp_path / "y" / "report", {"m": model(91.0, 51.0, 56.0, 0.2, None)})
    labels = [label for label, _ in load_reports([a, b])]
    assert len(set(labels)) == 2 and all(label.endswith("report/m") for label in labels)


def test_bad_reports_raise_value_error_naming_the_file(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match="nowhere"):
        load_reports([missing])
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        load_reports([broken])
    no_models = tmp_path / "other.json"
    no_models.write_text(json.dumps({"schema_version": 1, "config": {}}))
    with pytest.raises(ValueError, match="other.json"):
        load_reports([no_models])
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="report.json"):
        load_reports([empty_dir])
    with pytest.raises(ValueError, match="no report"):
        load_reports([])
