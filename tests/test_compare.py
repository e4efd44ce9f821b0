"""The comparison table: hand-written report.json files (schema version 2, with "inf"
strings) in, rows out."""

from __future__ import annotations

import io
import json
import math

import pytest
from rich.console import Console

from jaxbundle import schema
from jaxbundle.compare import ROW_KEYS, compare_markdown, compare_rows, compare_table, load_reports


def model(clean, robust, rr, white, black, eps=0.3, norm="linf", mode="full") -> dict:
    """A version-2 model record: every schema field, None where it does not apply (a cascade
    has no many-attack table)."""
    half = {}
    if white is not None:
        half["white_box"] = {"d_half": white, "fooled_fraction": 0.4, "n_correct": 10}
    if black is not None:
        half["black_box"] = {"d_half": black, "fooled_fraction": 0.4, "n_correct": 10}
    cascade = mode == "cascade"
    record = dict.fromkeys(name for name, _, _ in schema.MODEL_FIELDS)
    record.update({
        "n_examples": 10, "clean_accuracy": clean, "robust_accuracy": robust,
        "relative_robustness": rr, "mat": None if cascade else {"pgd": robust},
        "wat": None if cascade else robust, "wat_attack": None if cascade else "pgd",
        "eps": eps, "norm": norm, "plan": {"run": {"seed": 0}, "schedule": {"mode": mode}},
        "schedule": {"mode": mode}, "half_distortion": half, "per_example": "m.npz",
        "seconds": 1.0,
    })
    return record


def write(directory, models, version=schema.SCHEMA_VERSION) -> str:
    directory.mkdir(parents=True)
    path = directory / "report.json"
    path.write_text(json.dumps({"schema_version": version, "config": {}, "models": models}))
    return str(path)


@pytest.fixture
def reports(tmp_path):
    a = write(tmp_path / "run_a", {
        "standard": model(99.0, 0.0, 0.0, 0.0625, "inf"),
        "adversarial": model(98.0, 88.5, 90.306, "inf", "inf"),
    })
    b = write(  # a cascade: no many-attack table
        tmp_path / "run_b",
        {"adversarial": model(97.25, 80.0, 82.262, 0.41, None, 2.0, "l2", mode="cascade")},
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


def test_a_version_1_report_is_still_read_and_a_newer_one_refused(tmp_path):
    """Version 1 records had ``seed`` instead of ``plan`` and left out what did not apply."""
    old = {"n_examples": 10, "clean_accuracy": 90.0, "robust_accuracy": 50.0,
           "relative_robustness": 55.5, "mat": {}, "eps": 0.3, "norm": "linf", "seed": 0,
           "half_distortion": {"white_box": {"d_half": 0.1, "fooled_fraction": 0.4,
                                              "n_correct": 10}}}
    rows = compare_rows(load_reports([write(tmp_path / "v1", {"m": old}, version=1)]))
    assert rows[0]["robust_accuracy"] == 50.0 and rows[0]["d_half_white"] == 0.1
    assert rows[0]["d_half_black"] is None
    newer = write(tmp_path / "v3", {"m": model(90.0, 50.0, 55.5, 0.1, None)},
                  version=schema.SCHEMA_VERSION + 1)
    with pytest.raises(ValueError, match=f"reads up to {schema.SCHEMA_VERSION}"):
        load_reports([newer])


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
    no_models.write_text(json.dumps({"schema_version": schema.SCHEMA_VERSION, "config": {}}))
    with pytest.raises(ValueError, match="other.json"):
        load_reports([no_models])
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="report.json"):
        load_reports([empty_dir])
    with pytest.raises(ValueError, match="no report"):
        load_reports([])
