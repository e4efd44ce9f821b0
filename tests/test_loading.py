"""Tests for jaxbundle.models.loading: model specs, loading a user's model, checking its logits.

Each user error must be one clear line naming the model. The models here are tiny (a linear map,
a two-layer ``nn.Conv`` network), so the whole file runs in seconds.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import re
import sys
import textwrap

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbundle
from jaxbundle import models
from jaxbundle.models import LoadedModel, ModelSpec, check_model, load_model, parse_spec
from toys import EXAMPLES, import_example
X = np.random.default_rng(0).uniform(size=(4, 28, 28, 1)).astype(np.float32)

LINEAR = """
import jax.numpy as jnp

def model():
    def apply_fn(params, x):
        return x.reshape(x.shape[0], -1) @ params["w"]
    return apply_fn, {"w": jnp.linspace(-1.0, 1.0, 784 * 10).reshape(784, 10)}
"""

_names = itertools.count()


@pytest.fixture
def write_module(tmp_path, monkeypatch):
    """Writes a module with a fresh name into ``tmp_path`` (on sys.path); returns its name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(source: str) -> str:
        name = f"jb_user_model_{next(_names)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


def _error(exc_type, match, fn, *args, **kwargs) -> str:
    """The message of the error ``fn(*args, **kwargs)`` raises; it must match and be one line."""
    with pytest.raises(exc_type, match=match) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# ----------------------------------------------------------------------------- specs


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("pkg.mod:model", ModelSpec("model", "pkg.mod", "model")),
        ("cnn=pkg.mod:model", ModelSpec("cnn", "pkg.mod", "model")),
        (" my net = m : build ", ModelSpec("my net", "m", "build")),
        ("models/net.py:model", ModelSpec("model", "models/net.py", "model")),
        ("net.py:model", ModelSpec("model", "net.py", "model")),
        ("a=/abs/dir/net.py:model", ModelSpec("a", "/abs/dir/net.py", "model")),
        ("dir/a=b.py:model", ModelSpec("model", "dir/a=b.py", "model")),  # '=' inside a path
        (r"C:\models\net.py:model", ModelSpec("model", r"C:\models\net.py", "model")),
    ],
)
def test_parse_spec(spec, expected):
    assert parse_spec(spec) == expected


@pytest.mark.parametrize(
    "spec, match",
    [
        ("pkg.mod", r"expected MODULE:FUNCTION or NAME=MODULE:FUNCTION, got 'pkg.mod'$"),
        ("cnn=pkg.mod", r"expected MODULE:FUNCTION or NAME=MODULE:FUNCTION, got 'cnn=pkg.mod'"),
        ("=pkg.mod:model", r"empty NAME in model spec '=pkg.mod:model'"),
        (" =pkg.mod:model", r"empty NAME"),
        ("pkg.mod:", r"\(empty FUNCTION\)"),
        (":model", r"\(empty MODULE\)"),
        ("pkg.mod:build-it", r"FUNCTION 'build-it' is not a Python name"),
        ("my-net:model", r"MODULE 'my-net' is neither a dotted module name nor a path"),
    ],
)
def test_parse_spec_errors(spec, match):
    _error(ValueError, match, parse_spec, spec)


# ----------------------------------------------------------------------------- loading


def test_load_by_dotted_module(write_module):
    module = write_module(LINEAR)
    loaded = load_model(f"{module}:model")
    assert isinstance(loaded, LoadedModel) and loaded.name == "model"
    assert loaded.apply_fn(loaded.params, X).shape == (4, 10)
    assert load_model(ModelSpec("lin", module, "model")).name == "lin"


def test_load_by_dotted_module_from_current_directory(tmp_path, monkeypatch):
    (tmp_path / "jb_cwd_model.py").write_text(LINEAR)
    here = os.getcwd()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", here, str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "jb_cwd_model", raising=False)
    try:
        assert load_model("jb_cwd_model:model").apply_fn is not None
    finally:
        sys.modules.pop("jb_cwd_model", None)
    assert str(tmp_path) not in sys.path  # only put there while importing


def test_load_by_file_path(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "net.py"
    path.parent.mkdir()
    path.write_text(LINEAR)
    absolute = load_model(f"{path}:model")
    monkeypatch.chdir(tmp_path)
    relative = load_model("lin=sub/net.py:model")
    assert (absolute.name, relative.name) == ("model", "lin")
    np.testing.assert_array_equal(
        absolute.apply_fn(absolute.params, X), relative.apply_fn(relative.params, X)
    )


def test_file_can_import_its_siblings(tmp_path):
    (tmp_path / "jb_sibling_helper.py").write_text(LINEAR)
    (tmp_path / "main.py").write_text("from jb_sibling_helper import model\n")
    try:
        assert load_model(f"{tmp_path / 'main.py'}:model").params["w"].shape == (784, 10)
    finally:
        sys.modules.pop("jb_sibling_helper", None)


def test_two_files_with_the_same_name_do_not_collide(tmp_path):
    for d, width in (("a", 3), ("b", 5)):
        (tmp_path / d).mkdir()
        (tmp_path / d / "model.py").write_text(f"def model():\n    return print, {width}\n")
    assert load_model(f"{tmp_path / 'a' / 'model.py'}:model").params == 3
    assert load_model(f"{tmp_path / 'b' / 'model.py'}:model").params == 5


def test_missing_file(tmp_path):
    path = tmp_path / "nope.py"
    message = _error(FileNotFoundError, r"no such file: .*nope\.py$", load_model, f"{path}:model")
    assert message.startswith("model 'model' (")
    _error(FileNotFoundError, "not a file", load_model, f"{tmp_path}/:model")


def test_missing_dotted_module():
    message = _error(
        ValueError,
        r"model 'm' \(jb_no_such_module_zz:model\): no module named 'jb_no_such_module_zz' "
        r"in the current directory or sys.path",
        load_model,
        "m=jb_no_such_module_zz:model",
    )
    assert "failed to import" not in message
    _error(
        ValueError,
        r"no module named 'jb_no_such_package_zz' \(needed for 'jb_no_such_package_zz.sub'\)",
        load_model,
        "jb_no_such_package_zz.sub:model",
    )


def test_module_whose_own_import_fails_is_not_called_missing(write_module, tmp_path):
    source = "import jb_dependency_that_is_not_installed\n\ndef model():\n    pass\n"
    module = write_module(source)
    message = _error(
        ValueError,
        rf"module '{module}' failed to import: ModuleNotFoundError: "
        r"No module named 'jb_dependency_that_is_not_installed'",
        load_model,
        f"{module}:model",
    )
    assert f"no module named '{module}'" not in message
    path = tmp_path / "broken.py"
    path.write_text(source)
    _error(ValueError, r"broken\.py failed to import: ModuleNotFoundError", load_model,
           f"{path}:model")
    path.write_text("def model(:\n")
    _error(ValueError, r"broken\.py failed to import: SyntaxError", load_model, f"{path}:model")
    path.write_text("raise RuntimeError('no GPU here\\nsecond line')\n")
    _error(ValueError, r"failed to import: RuntimeError: no GPU here \.\.\.$", load_model,
           f"{path}:model")


def test_missing_function_lists_what_the_module_has(write_module):
    module = write_module(
        """
        import os
        from math import sqrt

        LIMIT = 3

        def model():
            pass

        def build_model():
            pass

        def _private():
            pass
        """
    )
    message = _error(
        ValueError,
        rf"model 'modle' \({module}:modle\): module has no function 'modle'; "
        r"it defines model, build_model$",
        load_model,
        f"{module}:modle",
    )
    assert "sqrt" not in message and "_private" not in message
    _error(ValueError, r"'LIMIT' is an int, not a function returning the model$",
           load_model, f"{module}:LIMIT")
    empty = write_module("X = 1\n")
    _error(ValueError, "it defines no functions", load_model, f"{empty}:model")


def test_function_raising_is_wrapped(write_module):
    module = write_module(
        """
        def model():
            raise FileNotFoundError("weights.msgpack")
        """
    )
    message = _error(
        ValueError,
        rf"model 'net' \({module}:model\): model\(\) raised FileNotFoundError: weights.msgpack$",
        load_model,
        f"net={module}:model",
    )
    assert message.count("model 'net'") == 1


STYLES = re.escape("(apply_fn, params), (linen_module, variables), an NNX module or an Equinox "
                   "module")
LINEN_ALONE = (r"\(jb_user_model_\d+:model\): a flax linen module needs its variables: return or "
               r"pass \(module, variables\) or \(module.apply, variables\), variables as "
               r"module.init returns them$")


@pytest.mark.parametrize(
    "returned, match",
    [
        ("None", rf"model\(\) must return {STYLES}, got None$"),
        ("(f, 1, 2)", rf"must return {STYLES}, got a tuple of 3 items$"),
        ("{'w': 1}", rf"must return {STYLES}, got a dict$"),
        ("f", rf"must return {STYLES}, got a function$"),
        ("(1, {})", r"with apply_fn callable, got an int as apply_fn$"),
        ("({}, f)", r"got a dict as apply_fn \(the order is \(apply_fn, params\)\)$"),
        ("(jnp.ones(3), {})", r"got an array of shape \[3\] float32 as apply_fn$"),
        ("(nn.Dense(3), {})", LINEN_ALONE),
        ("(nn.Dense(3), None)", LINEN_ALONE),
        ("nn.Dense(3)", LINEN_ALONE),
    ],
)
def test_wrong_return_value(write_module, returned, match):
    module = write_module(
        f"""
        import flax.linen as nn
        import jax.numpy as jnp

        def f(params, x):
            return x

        def model():
            return {returned}
        """
    )
    _error(ValueError, match, load_model, f"{module}:model")


# ----------------------------------------------------------------------------- check_model


def _random_params(init, *args):
    """Params of ``init(*args)``'s structure filled from numpy: no (slow) random-init compile."""
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda s: (0.1 * rng.standard_normal(s.shape)).astype(s.dtype), jax.eval_shape(init, *args)
    )


def _linear_model():
    w = jnp.linspace(-1.0, 1.0, 784 * 10).reshape(784, 10)
    return (lambda p, x: x.reshape(x.shape[0], -1) @ p), w


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), strides=2)(x))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def test_check_model_accepts_a_deterministic_flax_conv_model():
    net = ConvNet()
    params = _random_params(net.init, jax.random.key(0), X[:1])
    assert check_model(net.apply, params, X, num_classes=10) == 10
    assert check_model(jax.jit(net.apply), params, X) == 10
    assert check_model(*_linear_model(), X[:1], name="lin") == 10


@pytest.mark.parametrize(
    "apply_fn, match",
    [
        (lambda p, x: x.reshape(x.shape[0], -1)[:, 0], r"logits of shape \[4\] for 4 images, "
         r"expected \[4, 10\]$"),
        (lambda p, x: jnp.zeros((4, 10, 1)), r"shape \[4, 10, 1\] for 4 images, expected "
         r"\[4, 10\]"),
        (lambda p, x: jnp.zeros((1, 10)), r"shape \[1, 10\] for 4 images, expected \[4, 10\]"),
        (lambda p, x: jnp.zeros((4, 10), jnp.int32), r"logits of dtype int32, expected a floating"),
        (lambda p, x: (jnp.zeros((4, 10)), {}), r"returned a tuple of 2 items, expected logits "
         r"\[4, 10\]$"),
        (lambda p, x: jnp.zeros((4, 3)), r"has 3 outputs but the data has 10 classes$"),
        (lambda p, x: x.reshape(4, -1)[:, :10] / 0.0, r"non-finite logits \(NaN or inf\) for "
         r"4 of 4 sample images$"),
        (lambda p, x: jnp.where(jnp.arange(4)[:, None] == 2, jnp.nan, jnp.zeros((4, 10))),
         r"non-finite logits \(NaN or inf\) for 1 of 4"),
        (lambda p, x: p["missing"], r"fails under jax.jit on images of shape \[4, 28, 28, 1\] "
         r"float32: KeyError: 'missing'$"),
    ],
)
def test_check_model_errors(apply_fn, match):
    message = _error(ValueError, match, check_model, apply_fn, {}, X, num_classes=10, name="net")
    assert message.startswith("model 'net' ")


def test_check_model_without_num_classes():
    _error(ValueError, r"shape \[4\] for 4 images, expected \[4, K\]$", check_model,
           lambda p, x: jnp.zeros(4), None, X)
    _error(ValueError, r"shape \[4, 1\], expected \[4, K\] with K >= 2", check_model,
           lambda p, x: jnp.zeros((4, 1)), None, X)
    _error(ValueError, r"^model 'model': apply_fn is not callable \(got a dict\)$", check_model,
           {}, None, X)


def test_check_model_catches_stochastic_models():
    apply_fn, w = _linear_model()
    calls = itertools.count()

    def counter_noise(p, x):  # a fresh key per call, as a careless test-time augmentation does
        key = jax.random.key(next(calls))
        return apply_fn(p, x) + 0.01 * jax.random.normal(key, (x.shape[0], 10))

    def numpy_noise(p, x):
        return apply_fn(p, x) + np.random.normal(size=(x.shape[0], 10)).astype(np.float32)

    class Dropout(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dropout(0.5, deterministic=False)(x.reshape(x.shape[0], -1))
            return nn.Dense(10)(x)

    net = Dropout()
    params = _random_params(net.init, jax.random.key(0), X[:1])
    seeds = itertools.count()

    def dropout_on(p, x):
        return net.apply(p, x, rngs={"dropout": jax.random.key(next(seeds))})

    for fn, p in ((counter_noise, w), (numpy_noise, w), (dropout_on, params)):
        message = _error(ValueError, r"looks stochastic: two calls on the same images gave "
                         r"different logits", check_model, fn, p, X, name="noisy")
        assert "deterministic=True" in message and "jaxbundle.stochastic(fn)" in message
    # Declared stochastic: checked under fixed keys; randomness not drawn from the key fails.
    declared = jaxbundle.stochastic(lambda p, x, key: apply_fn(p, x)
                                    + 0.01 * jax.random.normal(key, (x.shape[0], 10)))
    assert check_model(declared, w, X, name="noisy") == 10
    careless = jaxbundle.stochastic(lambda p, x, key: counter_noise(p, x))
    _error(ValueError, r"declared stochastic but two calls with the same keys gave different",
           check_model, careless, w, X, name="noisy")


# ----------------------------------------------------------------------------- examples


def test_examples_load_and_give_logits(monkeypatch):
    monkeypatch.delenv("MODEL_WEIGHTS", raising=False)
    with pytest.warns(UserWarning, match="untrained"):
        linen = load_model(f"{EXAMPLES / 'linen_model.py'}:model")
    plain = load_model(f"plain={EXAMPLES / 'plain_model.py'}:model")
    for loaded in (linen, plain):
        assert loaded.apply_fn(loaded.params, X).shape == (4, 10)
        assert check_model(loaded.apply_fn, loaded.params, X, num_classes=10) == 10
    # The plain model resizes other image sizes to 28x28, also under jit.
    x32 = np.random.default_rng(1).uniform(size=(3, 32, 32, 1)).astype(np.float32)
    assert check_model(plain.apply_fn, plain.params, x32, num_classes=10) == 10
    assert jax.jit(plain.apply_fn)(plain.params, x32).shape == (3, 10)


def test_example_weights_round_trip(tmp_path, monkeypatch):
    """Weights saved with flax.serialization or orbax load back to identical logits."""
    example = import_example("linen_model")
    params = _random_params(example.abstract_params)
    want = np.asarray(example.apply_fn(params, X))

    example.save_weights(params, tmp_path / "w.msgpack")
    example.save_orbax(params, tmp_path / "orbax")
    for weights in (tmp_path / "w.msgpack", tmp_path / "orbax"):
        monkeypatch.setenv("MODEL_WEIGHTS", str(weights))
        loaded = load_model(f"{EXAMPLES / 'linen_model.py'}:model")
        np.testing.assert_array_equal(np.asarray(loaded.apply_fn(loaded.params, X)), want)
    np.testing.assert_array_equal(
        np.asarray(example.apply_fn(example.load_orbax(tmp_path / "orbax"), X)), want
    )


def test_plain_example_weights_round_trip(tmp_path):
    example = import_example("plain_model")
    _, params = example.model()
    params = {"w": params["w"] + 0.5, "b": params["b"] - 1.0}
    np.savez(tmp_path / "w.npz", **params)
    example.WEIGHTS = str(tmp_path / "w.npz")
    apply_fn, loaded = example.model()
    np.testing.assert_array_equal(apply_fn(loaded, X), apply_fn(params, X))


def test_loading_names_are_exported():
    for name in ("ModelSpec", "LoadedModel", "parse_spec", "load_model", "check_model"):
        assert name in models.__all__ and getattr(models, name) is getattr(models.loading, name)


def test_the_readme_example_model_loads_and_runs(tmp_path, monkeypatch):
    """The model a reader pastes from README.md's "Evaluate your own model" works as written."""
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Evaluate your own model", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_model.py").write_text(code)
    namespace: dict = {}
    exec(compile(code, "my_model.py", "exec"), namespace)
    params = namespace["CNN"]().init(jax.random.key(1), jnp.zeros((1, 28, 28, 1)))
    (tmp_path / "my_model.msgpack").write_bytes(flax.serialization.to_bytes(params))
    monkeypatch.chdir(tmp_path)
    name, apply_fn, loaded = models.load_model("mine=my_model.py:model")
    assert name == "mine"
    x = np.random.default_rng(0).uniform(0, 1, (4, 28, 28, 1)).astype(np.float32)
    assert models.check_model(apply_fn, loaded, x, num_classes=10, name=name) == 10
    np.testing.assert_array_equal(apply_fn(loaded, x), namespace["CNN"]().apply(params, x))
