"""Models as people write them (jaxbundle.adapters): a flax linen module with its variables, a
flax NNX module and an Equinox module, each evaluated end to end through ``jaxbundle evaluate``
and the Python API with the numbers of the same model written by hand as ``(apply_fn,
params)``; their arrays are jit arguments; a module in training mode is refused with one line;
Equinox never loads for a model that is not Equinox.

The models are the small untrained examples (``examples/*_model.py``) on 8 images of the
embedded sample, attacked by FGSM: a few seconds a test.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxbundle
from jaxbundle import data
from jaxbundle.adapters import AdaptedModel, ModelStyleError, as_apply_fn
from jaxbundle.cli import main
from jaxbundle.models import check_model, load_model
from toys import EXAMPLES, import_example

ROOT = EXAMPLES.parent
STYLES = ["nnx_model", "equinox_model", "linen_batchnorm_model"]
X = np.random.default_rng(0).uniform(size=(4, 28, 28, 1)).astype(np.float32)

# The same models written by hand as (apply_fn, params), as a user would without the adapter.
HAND_WRITTEN = f"""
import importlib.util
import pathlib
import sys

import equinox as eqx
from flax import nnx

EXAMPLES = pathlib.Path({str(EXAMPLES)!r})


def _example(name):
    spec = importlib.util.spec_from_file_location(f"jb_hand_{{name}}", EXAMPLES / f"{{name}}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def nnx_model():
    graph, params, rest = nnx.split(_example("nnx_model").model(), nnx.Param, ...)
    return (lambda p, x: nnx.merge(graph, p, rest)(x)), params


def equinox_model():
    params, static = eqx.partition(_example("equinox_model").model(), eqx.is_array)
    return (lambda p, x: eqx.combine(p, static)(x)), params


def linen_batchnorm_model():
    module, variables = _example("linen_batchnorm_model").model()
    return module.apply, variables
"""


@pytest.fixture
def hand_written(tmp_path) -> pathlib.Path:
    path = tmp_path / "hand_written.py"
    path.write_text(HAND_WRITTEN)
    return path


def _one_line_error(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(ModelStyleError, match=match) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# ----------------------------------------------------------------------------- same numbers


@pytest.mark.parametrize("style", STYLES)
def test_the_command_gives_the_hand_written_models_numbers(style, hand_written, tmp_path):
    """``jaxbundle evaluate --model`` on each example: logits, figures and every per-example
    array (the adversarial images bit for bit) as for the hand-written (apply_fn, params)."""
    styled = load_model(f"{EXAMPLES / style}.py:model")
    hand = load_model(f"{hand_written}:{style}")
    assert isinstance(styled.apply_fn, AdaptedModel) and not isinstance(hand.apply_fn,
                                                                       AdaptedModel)
    np.testing.assert_allclose(jax.jit(styled.apply_fn)(styled.params, X),
                               jax.jit(hand.apply_fn)(hand.params, X), rtol=1e-6, atol=1e-6)

    out = tmp_path / "report"
    argv = ["evaluate", "--model", f"styled={EXAMPLES / style}.py:model", "--model",
            f"hand={hand_written}:{style}", "--attacks", "fgsm", "--eps", "0.05", "--n", "8",
            "--no-shifts", "--no-progress", "--no-compile-cache", "--out", str(out)]
    assert main(argv) == 0
    models = json.loads((out / "report.json").read_text())["models"]
    for key in ("clean_accuracy", "robust_accuracy", "mat", "n_examples"):
        assert models["styled"][key] == models["hand"][key], key
    assert models["styled"]["checks"]["randomness"]["passed"]
    with np.load(out / models["styled"]["per_example"]) as a, \
            np.load(out / models["hand"]["per_example"]) as b:
        assert a["success"].shape == (8,)
        for key in ("clean_prediction", "adversarial_prediction", "success", "distortion",
                    "x_adv"):
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _module_and_params(style: str):
    """What ``jaxbundle.evaluate`` takes for the example: a module and None, or (for linen) the
    module and its variables."""
    made = import_example(style).model()
    return made if isinstance(made, tuple) else (made, None)


@pytest.mark.parametrize("style", STYLES)
def test_evaluate_takes_the_module(style, hand_written):
    """``jaxbundle.evaluate(module, None | variables, ...)``: the hand-written model's figures,
    and its certified bounds: bound propagation reads the module's own program (NNX merge,
    Equinox combine, linen with batch_stats; none certified, the examples are untrained)."""
    ds = data.load_mnist_sample("test", n=8)
    plan = jaxbundle.Plan.of(eps=0.05, attacks=("fgsm",), batch_size=8, certify="crown-ibp")
    hand = load_model(f"{hand_written}:{style}")
    want = jaxbundle.evaluate(hand.apply_fn, hand.params, (ds.x, ds.y), plan, mesh=None)
    got = jaxbundle.evaluate(*_module_and_params(style), (ds.x, ds.y), plan, mesh=None)
    assert got.metrics["robust_accuracy"] == want.metrics["robust_accuracy"]
    assert got.metrics["clean_accuracy"] == want.metrics["clean_accuracy"]
    for key in ("adversarial_prediction", "success", "x_adv"):
        np.testing.assert_array_equal(got.per_example[key], want.per_example[key], err_msg=key)
    np.testing.assert_allclose(got.per_example["bound_margin"],
                               want.per_example["bound_margin"], rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(got.per_example["bound_margin"]))
    assert got.metrics["certified"]["certified_robust_accuracy"] == (
        want.metrics["certified"]["certified_robust_accuracy"])


# ----------------------------------------------------------------------------- jit arguments


def _scaled(params, factor=1.5):
    return jax.tree.map(lambda a: a * factor if jnp.issubdtype(a.dtype, jnp.floating) else a,
                        params)


@pytest.mark.parametrize("style", STYLES)
def test_the_modules_arrays_are_jit_arguments(style):
    """The params are the module's own arrays; new weights change the logits under the same
    compiled program (one trace); no weight is a constant of the program."""
    module, variables = _module_and_params(style)
    apply_fn, params = as_apply_fn(module, variables)
    direct = module.apply(variables, X) if variables is not None else module(X)
    forward = jax.jit(apply_fn)
    np.testing.assert_allclose(forward(params, X), direct, rtol=1e-6, atol=1e-6)
    moved = forward(_scaled(params), X)
    assert forward._cache_size() == 1 and np.abs(moved - direct).max() > 1e-3
    consts = jax.make_jaxpr(apply_fn)(params, X).consts
    assert all(np.size(c) <= 2 for c in consts), [np.shape(c) for c in consts]
    kernels = {id(a) for a in jax.tree.leaves(params)}
    if style == "nnx_model":
        assert {id(module.dense2.kernel.get_value()), id(module.norm.mean.get_value())} <= kernels
    elif style == "equinox_model":
        assert id(module.net.dense2.weight) in kernels
    else:  # linen: the variables themselves, running averages included
        assert params is variables and "batch_stats" in params
        stats = {**params, "batch_stats": _scaled(params["batch_stats"], 3.0)}
        assert np.abs(forward(stats, X) - direct).max() > 1e-3


# ----------------------------------------------------------------------------- training mode


class NNXDropout(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(784, 10, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.dense(x.reshape(x.shape[0], -1)))


class NNXBatchNorm(nnx.Module):
    def __init__(self, rngs, use_running_average=None):
        self.norm = nnx.BatchNorm(1, use_running_average=use_running_average, rngs=rngs)
        self.dense = nnx.Linear(784, 10, rngs=rngs)

    def __call__(self, x):
        x = self.norm(x, use_running_average=False) if self.norm.use_running_average is None \
            else self.norm(x)
        return self.dense(x.reshape(x.shape[0], -1))


class NNXNoisy(nnx.Module):
    def __init__(self, rngs):
        self.rngs = rngs
        self.dense = nnx.Linear(784, 10, rngs=rngs)

    def __call__(self, x):
        return self.dense((x + 0.1 * jax.random.normal(self.rngs.noise(), x.shape))
                          .reshape(x.shape[0], -1))


def test_nnx_in_training_mode_is_refused():
    _one_line_error(r"^model 'NNXDropout' is in training mode \(Dropout at drop is not "
                    r"deterministic\): call model.eval\(\)", as_apply_fn, NNXDropout(nnx.Rngs(0)))
    _one_line_error(r"^model 'NNXBatchNorm' is in training mode \(BatchNorm at norm uses batch "
                    r"statistics, not its running averages\): call model.eval\(\)", as_apply_fn,
                    NNXBatchNorm(nnx.Rngs(0), use_running_average=False))
    net = NNXDropout(nnx.Rngs(0))
    net.eval()
    apply_fn, params = as_apply_fn(net)
    assert check_model(apply_fn, params, X, num_classes=10) == 10
    _one_line_error("holds its own arrays: give the module alone", as_apply_fn, net, params)
    # Found on the first trace: randomness drawn from nnx.Rngs, state updated by the call.
    noisy = NNXNoisy(nnx.Rngs(0, noise=1))
    noisy.eval()
    _one_line_error(r"^model 'NNXNoisy' draws random numbers from nnx.Rngs when called",
                    jax.jit(as_apply_fn(noisy)[0]), *as_apply_fn(noisy)[1:], X)
    updating = as_apply_fn(NNXBatchNorm(nnx.Rngs(0)), name="bn")
    _one_line_error(r"^model 'bn' changes its own state when called \(norm.mean", check_model,
                    *updating, X)


class EqxPerExample(eqx.Module):
    dense: eqx.nn.Linear
    layer: eqx.Module

    def __call__(self, x, *state):  # (x, state) with a BatchNorm, as Equinox has it
        h = x.reshape(-1)[:4]
        if isinstance(self.layer, eqx.nn.BatchNorm):
            h, _ = self.layer(h, *state)  # no state given: BatchNorm's own TypeError
        else:
            h = self.layer(h)
        return self.dense(jnp.concatenate([h, x.reshape(-1)[4:]]))


class EqxBatched(eqx.Module):
    net: EqxPerExample
    state: eqx.nn.State | None = None  # a stateful net's state, folded in

    def __call__(self, x):
        state = () if self.state is None else (self.state,)
        return jax.vmap(lambda xi: self.net(xi, *state))(x)


def _eqx(layer_kind: str, fold: bool = False):
    dense = eqx.nn.Linear(784, 10, key=jax.random.key(0))
    if layer_kind == "dropout":
        return EqxBatched(EqxPerExample(dense, eqx.nn.Dropout(0.5)))
    net, state = eqx.nn.make_with_state(EqxPerExample)(
        dense, eqx.nn.BatchNorm(4, axis_name="batch", mode="batch"))
    return EqxBatched(net, state if fold else None)


def test_equinox_in_training_mode_is_refused():
    for kind, layer in (("dropout", "Dropout"), ("batchnorm", "BatchNorm")):
        _one_line_error(rf"^model 'EqxBatched' is in training mode \({layer} with "
                        r"inference=False\): give eqx.nn.inference_mode\(model\)$", as_apply_fn,
                        _eqx(kind))
    apply_fn, params = as_apply_fn(eqx.nn.inference_mode(_eqx("dropout")))
    assert check_model(apply_fn, params, X, num_classes=10) == 10
    # A stateful layer without its state: refused on the first trace; folded in, it runs.
    unfolded = as_apply_fn(eqx.nn.inference_mode(_eqx("batchnorm")), name="eqx")
    _one_line_error(r"^model 'eqx' has stateful layers \(BatchNorm\) that need their state: "
                    r"fold it in", check_model, *unfolded, X)
    folded = eqx.nn.inference_mode(_eqx("batchnorm", fold=True))
    apply_fn, params = as_apply_fn(folded)
    np.testing.assert_allclose(jax.jit(apply_fn)(params, X), folded(X), rtol=1e-6, atol=1e-6)
    _one_line_error("holds its own arrays", as_apply_fn, folded, {"w": 1})


class LinenTrainable(nn.Module):
    layer: str
    train: bool = True

    @nn.compact
    def __call__(self, x):
        if self.layer == "batchnorm":
            x = nn.BatchNorm(use_running_average=not self.train)(x)
        else:
            x = nn.Dropout(0.5, deterministic=not self.train)(x)
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def test_linen_in_training_mode_is_refused():
    for layer, match in (("batchnorm", r"it updates its variables when called \(BatchNorm"),
                         ("dropout", r"it asks for a 'dropout' rng when called \(Dropout")):
        variables = LinenTrainable(layer, train=False).init(jax.random.key(0), X[:1])
        adapted = as_apply_fn(LinenTrainable(layer), variables)
        message = _one_line_error(rf"^model 'LinenTrainable' is in training mode: {match}",
                                  check_model, *adapted, X)
        assert "train=False / use_running_average=True / deterministic=True" in message
        assert "functools.partial(module.apply, train=False)" in message
        assert check_model(*as_apply_fn(LinenTrainable(layer, train=False), variables), X) == 10
    variables = LinenTrainable("batchnorm", train=False).init(jax.random.key(0), X[:1])
    module = LinenTrainable("batchnorm", train=False)
    _one_line_error(r"'params' collection alone", as_apply_fn, module, variables["params"])
    _one_line_error(r"its variables lack a collection it reads \(.*batch_stats", check_model,
                    *as_apply_fn(module, {"params": variables["params"]}), X)
    for missing in (None, {}):
        _one_line_error(r"^model 'LinenTrainable': a flax linen module needs its variables: "
                        r"return or pass \(module, variables\) or \(module.apply, variables\)",
                        as_apply_fn, module, missing)


@pytest.mark.parametrize("source, match", [
    ("from nnx_model import CNN\n\ndef model():\n    return CNN(rngs=nnx.Rngs(0))\n",
     "is in training mode (Dropout at dropout is not deterministic): call model.eval()"),
    ("import linen_batchnorm_model as m\n\ndef model():\n    return m.CNN(train=True), "
     "m.init_variables()\n", "is in training mode: it updates its variables when called"),
], ids=["nnx", "linen"])
def test_the_command_refuses_a_training_mode_model_in_one_line(source, match, tmp_path,
                                                                monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    (tmp_path / "train_mode.py").write_text("from flax import nnx\n" + source)
    argv = ["evaluate", "--model", f"net={tmp_path / 'train_mode.py'}:model", "--attacks",
            "fgsm", "--n", "8", "--no-shifts", "--no-progress", "--no-compile-cache", "--out",
            str(tmp_path / "out")]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"error: model 'net' ({tmp_path / 'train_mode.py'}:model) {match}" in err, err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- optional Equinox


def test_equinox_loads_only_for_equinox_models():
    """A linen model (and an NNX one) loads, adapts and runs without importing Equinox; the
    Equinox example does import it (so the check can see it)."""
    code = textwrap.dedent("""
        import sys
        import jaxbundle
        from jaxbundle import models
        x = __import__("numpy").zeros((2, 28, 28, 1), "float32")
        for name in sys.argv[1:]:
            m = models.load_model(f"{name}:model")
            models.check_model(m.apply_fn, m.params, x, num_classes=10)
        print(sorted(k for k in sys.modules if k.split(".")[0] == "equinox")[:1])
    """)

    def loaded(*names):
        run = subprocess.run([sys.executable, "-c", code, *(str(EXAMPLES / f"{n}.py")
                                                            for n in names)],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout.split()

    assert loaded("linen_batchnorm_model", "nnx_model", "plain_model") == ["[]"]
    assert loaded("equinox_model") == ["['equinox']"]
