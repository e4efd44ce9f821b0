"""The README's Python examples run as written, and what they print is right."""

from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_the_python_examples():
    blocks = _python_blocks()
    assert len(blocks) == 2
    assert "def model():" in blocks[0] and "evaluate(" in blocks[1]


def test_readme_user_model_loads_its_weights(tmp_path, monkeypatch):
    """The model file of "Your own model": ``model()`` reads ``my_model.msgpack`` from the
    working directory and returns an ``apply_fn`` that gives logits for a batch."""
    import flax.serialization
    import jax

    namespace: dict = {"__name__": "my_model"}
    exec(compile(_python_blocks()[0], str(README), "exec"), namespace)
    cnn = namespace["CNN"]()
    params = cnn.init(jax.random.key(1), jnp.zeros((1, 28, 28, 1)))
    (tmp_path / "my_model.msgpack").write_bytes(flax.serialization.to_bytes(params))
    monkeypatch.chdir(tmp_path)
    apply_fn, loaded = namespace["model"]()
    x = jnp.linspace(0, 1, 2 * 28 * 28).reshape(2, 28, 28, 1)
    np.testing.assert_array_equal(apply_fn(loaded, x), cnn.apply(params, x))
    assert apply_fn(loaded, x).shape == (2, 10)


@pytest.mark.slow
def test_readme_python_example_runs(capsys):
    """The library example, on the demo standard CNN (the run's cache: trained once): every
    figure it prints is checked against the model itself."""
    namespace: dict = {"__name__": "readme"}
    exec(compile(_python_blocks()[1], str(README), "exec"), namespace)
    printed = capsys.readouterr().out.split("\n")
    apply_fn, params, ds = namespace["apply_fn"], namespace["params"], namespace["ds"]
    result, ev = namespace["result"], namespace["ev"]
    x, y = np.asarray(ds.x), np.asarray(ds.y)

    # bundle(): the best misclassifying candidates are in the box and the ball, and the model
    # misclassifies exactly the ones the score says it does.
    best = result.best["misclassify"]
    x_adv = np.asarray(best.x)
    assert x_adv.min() >= 0 and x_adv.max() <= 1
    assert np.abs(x_adv - x).reshape(len(y), -1).max(1).max() <= 0.3 + 1e-6
    wrong = np.asarray(jnp.argmax(apply_fn(params, best.x), -1)) != y
    np.testing.assert_array_equal(np.asarray(best.score.misclassified), wrong)
    assert float(printed[0].split()[0]) == pytest.approx(wrong.mean(), abs=1e-6)

    # evaluate(): clean accuracy is the model's own; the standard CNN has no robustness at
    # 0.3 (a PGD-40 attack fools every correctly classified digit).
    clean = 100 * np.mean(np.asarray(jnp.argmax(apply_fn(params, x), -1)) == y)
    m = ev.metrics
    assert m["clean_accuracy"] == pytest.approx(clean) and clean > 90
    assert m["robust_accuracy"] == 0.0 and m["relative_robustness"] == 0.0
    assert m["wat"] == min(m["mat"].values()) and set(m["mat"]) == {"fgsm", "pgd-ce", "pgd-margin"}
    assert printed[1].split()[0] == repr(m["clean_accuracy"])
