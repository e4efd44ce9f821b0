"""One report schema: every record has exactly the fields jaxbundle.schema lists (null where
they do not apply), in full and cascade mode alike; nothing undocumented gets in; the docs show
the schema's own tables; compare reads versions 1 and 2."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import jaxbundle
from jaxbundle import schema
from jaxbundle.compare import compare_rows, load_reports
from toys import images, linear_apply, linear_problem, min_distance

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "report.md"
FIELDS = [f[0] for f in schema.MODEL_FIELDS]


def test_the_docs_show_the_schema_tables():
    text = DOCS.read_text()
    shown = text.split("<!-- schema:begin -->\n", 1)[1].split("<!-- schema:end -->", 1)[0]
    assert shown == schema.markdown_tables()
    assert f"`schema_version` {schema.SCHEMA_VERSION}" in shown


@pytest.mark.parametrize("mode", ["full", "cascade"])
def test_an_evaluation_record_has_every_field_and_only_those(mode):
    params, x, y = linear_problem(n=16, k=4, seed=1)
    eps = float(np.quantile(min_distance(params, x, y, "linf"), 0.5))
    plan = jaxbundle.Plan.of(eps=eps, attacks=("fgsm", "pgd-ce", "square"), steps=3, queries=20,
                          mode=mode)
    ev = jaxbundle.evaluate(linear_apply, params, (images(x), y), plan)
    m = ev.metrics
    assert list(m) == FIELDS
    # The plan as run: one batch of the 16 examples (no mesh: at most the dataset).
    assert m["plan"] == plan.replace(batch_size=16).describe()
    assert m["eps"] == eps and m["norm"] == "linf"
    for field in ("model", "shifts", "shift_examples", "best_effort", "transfer", "per_example",
                  "figures", "seconds", "stochastic"):  # the job's and the writer's, or n/a
        assert m[field] is None, field
    assert m["confident_failure_rate"] is not None and m["failure_rate_curve"] is not None
    if mode == "cascade":
        assert m["mat"] is None and m["wat"] is None and m["black_box_robust_accuracy"] is None
        assert [s["attack"] for s in m["schedule"]["stages"]] == ["fgsm", "pgd-ce", "square"]
    else:
        assert set(m["mat"]) == {"fgsm", "pgd-ce", "square"} and m["schedule"]["stages"] is None
    assert m["schedule"]["mode"] == mode
    documented = {name for name, _ in schema.PER_EXAMPLE}
    assert set(ev.per_example) <= documented, set(ev.per_example) - documented
    json.dumps(m, default=float)


def test_a_stochastic_record_documents_every_array():
    import jax

    params, x, y = linear_problem(n=8, k=4, seed=2)
    eps = float(np.quantile(min_distance(params, x, y, "linf"), 0.5))
    noisy = jaxbundle.stochastic(
        lambda p, xb, key: linear_apply(p, xb + 0.02 * jax.random.normal(key, xb.shape)), calls=4)
    ev = jaxbundle.evaluate(noisy, params, (images(x), y),
                            jaxbundle.Plan.of(eps=eps, attacks=("fgsm",), goals=("misclassify",)))
    assert list(ev.metrics) == FIELDS and ev.metrics["stochastic"] is not None
    documented = {name for name, _ in schema.PER_EXAMPLE}
    assert {"success_rate", "selection_success_rate", "clean_success_rate"} <= set(ev.per_example)
    assert set(ev.per_example) <= documented, set(ev.per_example) - documented


def test_nothing_undocumented_gets_in():
    plan = jaxbundle.Plan.of(eps=0.1, attacks=("fgsm",))
    with pytest.raises(ValueError, match=r"\['new_figure'\] are not in the report schema"):
        schema.model_record(plan, {"robust_accuracy": 1.0, "new_figure": 2})
    with pytest.raises(ValueError, match="not in the report schema"):
        schema.with_extras({}, extra=1)
    with pytest.raises(ValueError, match="do not match the report schema"):
        schema.config_record(plan={})


def _write(path, report):
    path.mkdir()
    (path / "report.json").write_text(json.dumps(report))
    return path


def test_compare_reads_versions_1_and_2(tmp_path):
    v1 = {"schema_version": 1, "config": {}, "models": {"a": {
        "clean_accuracy": 99.0, "robust_accuracy": 10.0, "eps": 0.3, "norm": "linf",
        "relative_robustness": 10.1, "mat": {}, "seed": 0,
        "half_distortion": {"white_box": {"d_half": 0.2}}}}}
    v2 = {"schema_version": 2, "config": {}, "models": {"b": dict.fromkeys(FIELDS) | {
        "clean_accuracy": 98.0, "robust_accuracy": 20.0, "eps": 0.3, "norm": "linf",
        "relative_robustness": 20.4, "half_distortion": {"bundled": {"d_half": "inf"}}}}}
    rows = compare_rows(load_reports([_write(tmp_path / "one", v1), _write(tmp_path / "two", v2)]))
    assert [r["model"] for r in rows] == ["one/a", "two/b"]
    assert rows[0]["d_half_white"] == 0.2 and rows[1]["d_half_white"] is None
    assert rows[1]["robust_accuracy"] == 20.0
    with pytest.raises(ValueError, match="reads up to 2"):
        load_reports([_write(tmp_path / "three", {**v2, "schema_version": 3})])
