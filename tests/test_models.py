"""Tests for jaxbundle.models: architectures, training, determinism and the weight cache.

Everything here uses tiny configs (a few hundred images, one or two epochs) so the whole file
runs in well under a minute on two CPU cores. Cache directories always live under ``tmp_path``.
"""

from __future__ import annotations

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import data, models

N_TRAIN = 512

TINY = models.TrainConfig(
    adversarial=False, epochs=2, batch_size=64, learning_rate=5e-3, seed=0, n_train=N_TRAIN
)
TINY_ADV = TINY._replace(adversarial=True, epochs=1, pgd_steps=2, pgd_step_size=0.15)
TINY_MLP = TINY._replace(arch="mlp", epochs=1)


@pytest.fixture(scope="module")
def train_set() -> data.Dataset:
    return data.load_mnist_sample("train", n=N_TRAIN)


@pytest.fixture(scope="module")
def tiny_params(train_set):
    return models.train(TINY, train_set)


def _assert_trees_equal(a, b) -> None:
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _count_train_calls(monkeypatch) -> list[models.TrainConfig]:
    calls: list[models.TrainConfig] = []
    real_train = models.train

    def counting_train(config, dataset=None, *, progress=None):
        calls.append(config)
        return real_train(config, dataset, progress=progress)

    monkeypatch.setattr(models.cache, "train", counting_train)  # what load_or_train calls
    return calls


# ----------------------------------------------------------------------------- architectures


@pytest.mark.parametrize("num_classes", [10, 3])
def test_small_cnn_shapes_and_dtypes(num_classes):
    module = models.SmallCNN(num_classes=num_classes)
    x = jnp.linspace(0.0, 1.0, 5 * 28 * 28).reshape(5, 28, 28, 1).astype(jnp.float32)
    params = module.init(jax.random.PRNGKey(0), x[:1])
    logits = module.apply(params, x)
    assert logits.shape == (5, num_classes)
    assert logits.dtype == jnp.float32
    assert set(params) == {"params"}
    for leaf in jax.tree_util.tree_leaves(params):
        assert leaf.dtype == jnp.float32


@pytest.mark.parametrize(
    "module, shape, num_classes",
    [
        (models.SmallCNN(num_classes=4, conv1=4, conv2=8, hidden=16, kernel=3), (2, 32, 32, 3), 4),
        (models.MLP(num_classes=7, hidden=(8, 8)), (3, 28, 28, 1), 7),
        (models.LinenCNN(num_classes=5, conv1=4, conv2=8, hidden=16), (2, 32, 32, 3), 5),
    ],
)
def test_other_modules_and_image_sizes(module, shape, num_classes):
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    params = jax.eval_shape(module.init, jax.random.PRNGKey(0), x)
    out = jax.eval_shape(module.apply, params, x)
    assert out.shape == (shape[0], num_classes) and out.dtype == jnp.float32


def test_model_for():
    assert isinstance(models.model_for(TINY), models.SmallCNN)
    assert isinstance(models.model_for(TINY_MLP), models.MLP)
    assert models.model_for(TINY._replace(num_classes=3)).num_classes == 3
    with pytest.raises(ValueError, match="unknown architecture"):
        models.model_for(TINY._replace(arch="resnet9000"))


def test_registry_and_defaults():
    assert models.MODELS == {"standard": models.STANDARD, "adversarial": models.ADVERSARIAL,
                             "adversarial-linen": models.ADVERSARIAL_LINEN,
                             "certified": models.CERTIFIED}
    assert models.CERTIFIED.certified == "ibp" and not models.CERTIFIED.adversarial
    assert models.model_name(models.CERTIFIED) == "small_cnn_bn-ibp"
    assert not models.STANDARD.adversarial
    assert models.ADVERSARIAL.adversarial
    assert models.ADVERSARIAL.eps == pytest.approx(0.3)
    assert models.ADVERSARIAL.pgd_steps >= 1
    assert models.model_name(models.STANDARD) != models.model_name(models.ADVERSARIAL)
    assert models.ADVERSARIAL_LINEN.adversarial and models.ADVERSARIAL_LINEN.seed != 0
    assert models.model_name(models.ADVERSARIAL_LINEN) == "linen_cnn-adv"


def test_linen_cnn_is_built_from_flax_nn_conv():
    """The second demo model has the layers users' models have: flax's own nn.Conv, whose
    numbers are those of a 'SAME' stride-2 lax convolution."""
    module = models.model_for(models.ADVERSARIAL_LINEN)
    x = jax.random.uniform(jax.random.PRNGKey(1), (2, 28, 28, 1))
    params = module.init(jax.random.PRNGKey(0), x)
    p = params["params"]
    assert (p["conv1"]["kernel"].shape == (3, 3, 1, 32)
            and p["conv2"]["kernel"].shape == (3, 3, 32, 64))
    conv = jax.lax.conv_general_dilated(
        x, p["conv1"]["kernel"], (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    ) + p["conv1"]["bias"][None, None, None, :]
    _, state = module.apply(params, x, capture_intermediates=True)
    np.testing.assert_allclose(state["intermediates"]["conv1"]["__call__"][0], conv,
                               rtol=1e-5, atol=1e-6)
    assert module.apply(params, x).shape == (2, 10)


# ----------------------------------------------------------------------------- training


def test_training_beats_chance(train_set, tiny_params):
    module = models.model_for(TINY)
    init = module.init(jax.random.PRNGKey(0), train_set.x[:1])
    before = models.accuracy(module.apply, init, train_set.x, train_set.y)
    after = models.accuracy(module.apply, tiny_params, train_set.x, train_set.y)
    assert after > 0.6 > before + 0.2


@pytest.mark.parametrize("arch", ["small_cnn", "small_cnn_bn"])
def test_adversarial_training_runs_and_learns(train_set, arch):
    config = TINY_ADV._replace(arch=arch)  # with BatchNorm: PGD on the clean batch's statistics
    params = models.train(config, train_set)
    module = models.model_for(config)
    for leaf in jax.tree_util.tree_leaves(params):
        assert np.all(np.isfinite(np.asarray(leaf)))
    assert models.accuracy(module.apply, params, train_set.x, train_set.y) > 0.3


def test_same_seed_bit_identical(train_set, tiny_params):
    _assert_trees_equal(models.train(TINY, train_set), tiny_params)


def test_adversarial_same_seed_bit_identical(train_set):
    cfg = TINY_ADV._replace(n_train=128, batch_size=32)
    _assert_trees_equal(models.train(cfg, train_set), models.train(cfg, train_set))


def test_different_seed_differs(train_set, tiny_params):
    other = models.train(TINY._replace(seed=1), train_set)
    leaves = zip(jax.tree_util.tree_leaves(other), jax.tree_util.tree_leaves(tiny_params))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in leaves)


def test_progress_reports_every_step(train_set):
    seen: list[tuple[int, int]] = []
    cfg = TINY_MLP._replace(n_train=256, batch_size=64, epochs=2)
    models.train(cfg, train_set, progress=lambda i, n: seen.append((i, n)))
    assert seen == [(i, 8) for i in range(1, 9)]


def test_bad_training_data_raises(train_set):
    with pytest.raises(ValueError, match="n_train"):
        models.train(TINY._replace(n_train=N_TRAIN + 1), train_set)
    with pytest.raises(ValueError, match="labels"):
        models.train(TINY._replace(num_classes=5), train_set)


def test_pgd_linf_stays_in_ball_and_box(train_set, tiny_params):
    module = models.model_for(TINY)
    x = jnp.asarray(train_set.x[:32])
    y = jnp.asarray(train_set.y[:32])
    eps = 0.1
    x_adv = jax.jit(
        lambda p, x, y, k: models.pgd_linf(module.apply, p, x, y, k, eps, 0.03, 5)
    )(tiny_params, x, y, jax.random.PRNGKey(3))
    assert x_adv.shape == x.shape and x_adv.dtype == x.dtype
    assert float(jnp.max(jnp.abs(x_adv - x))) <= eps + 1e-6
    assert float(jnp.min(x_adv)) >= 0.0 and float(jnp.max(x_adv)) <= 1.0
    clean = models.accuracy(module.apply, tiny_params, x, y)
    assert models.accuracy(module.apply, tiny_params, x_adv, y) < clean


def test_accuracy_helper_counts_exactly():
    def apply_fn(params, x):  # predicts class (first pixel * 10) in {0..9}
        cls = jnp.clip((x[:, 0] * 10).astype(jnp.int32), 0, 9)
        return jax.nn.one_hot(cls, 10) * params

    x = (np.arange(23, dtype=np.float32) % 10 / 10 + 0.01)[:, None]
    y = (np.arange(23) % 10).astype(np.int32)
    y[[0, 5, 22]] = 9 - y[[0, 5, 22]]  # three wrong labels (none equals 9 - itself)
    for batch_size in (1, 4, 23, 500):
        acc = models.accuracy(apply_fn, jnp.float32(1.0), x, y, batch_size=batch_size)
        assert acc == pytest.approx(20 / 23)


# ----------------------------------------------------------------------------- cache


def test_cache_round_trip_does_not_retrain(tmp_path, monkeypatch, train_set):
    calls = _count_train_calls(monkeypatch)
    apply1, params1 = models.load_or_train(TINY, cache_dir=tmp_path, dataset=train_set)
    assert len(calls) == 1
    path = models.cache_path(TINY, tmp_path, train_set)
    assert path.is_file() and path.parent == tmp_path / "models"
    assert path.name.startswith(models.model_name(TINY) + "-") and path.suffix == ".msgpack"
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["config"] == json.loads(json.dumps(TINY._asdict()))
    assert meta["code_version"] == models.CODE_VERSION
    assert 0.6 < meta["train_accuracy"] <= 1.0
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]

    apply2, params2 = models.load_or_train(TINY, cache_dir=tmp_path, dataset=train_set)
    assert len(calls) == 1  # served from disk
    _assert_trees_equal(params1, params2)
    x = train_set.x[:8]
    np.testing.assert_array_equal(np.asarray(apply1(params1, x)), np.asarray(apply2(params2, x)))


def test_cache_default_dataset_and_env_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXBUNDLE_CACHE", str(tmp_path / "env"))
    calls = _count_train_calls(monkeypatch)
    cfg = TINY_MLP._replace(n_train=256)
    apply_fn, params = models.load_or_train(cfg)
    assert len(calls) == 1
    assert models.cache_path(cfg).is_relative_to(tmp_path / "env")
    assert models.cache_path(cfg).is_file()
    _, again = models.load_or_train(cfg)
    assert len(calls) == 1
    _assert_trees_equal(params, again)
    x = data.load_mnist_sample("train", n=4).x
    assert apply_fn(params, x).shape == (4, 10)


def test_the_shipped_weights_are_the_demo_models_of_this_code(tmp_path, monkeypatch):
    """A first run trains nothing: each model of the main job has weights in the package under
    its current cache key (a change of config or CODE_VERSION that was not re-shipped fails
    here), loaded without training from an empty cache; nothing else is shipped; and
    ``shipped=False`` trains (the path :func:`models.ship` takes)."""
    keys = {models.cache_path(models.MODELS[n]).name for n in models.cache.SHIPPED_MODELS}
    on_disk = {p.name for p in models.SHIPPED.glob("*.msgpack")}
    assert on_disk == keys, "re-ship the demo weights: python -m jaxbundle.models.cache"
    for name in keys:
        meta = json.loads((models.SHIPPED / name).with_suffix(".json").read_text())
        assert meta["code_version"] == models.CODE_VERSION and name.endswith(
            f"-{meta['hash']}.msgpack")
    monkeypatch.setenv("JAXBUNDLE_CACHE", str(tmp_path))
    calls = _count_train_calls(monkeypatch)
    x = data.load_mnist_sample("test", n=500)
    for name in models.cache.SHIPPED_MODELS:
        apply_fn, params = models.load_or_train(models.MODELS[name])
        accuracy = np.mean(np.argmax(np.asarray(apply_fn(params, x.x)), 1) == x.y)
        assert accuracy > 0.9, (name, accuracy)
    assert calls == [] and not any(tmp_path.iterdir())  # nothing trained, nothing written
    shipped = models.load_or_train(models.MODELS["standard"])[1]
    monkeypatch.setattr(models.cache, "train", lambda config, dataset=None, *, progress=None: (
        calls.append(config) or shipped))
    models.load_or_train(models.MODELS["standard"], shipped=False)
    assert calls == [models.MODELS["standard"]]
    assert models.cache_path(models.MODELS["standard"]).is_file()


@pytest.mark.slow
def test_training_reproduces_the_shipped_standard_model(tmp_path):
    """The training code makes the shipped weights: the standard demo model trained afresh
    classifies the embedded test images as the shipped one does."""
    config = models.MODELS["standard"]
    apply_fn, fresh = models.load_or_train(config, cache_dir=tmp_path, shipped=False)
    _, shipped = models.load_or_train(config, cache_dir=tmp_path / "empty")
    test = data.load_mnist_sample("test", n=2000)
    a = np.argmax(np.asarray(apply_fn(fresh, test.x)), 1)
    b = np.argmax(np.asarray(apply_fn(shipped, test.x)), 1)
    # Here the two are the same bits; another CPU's float32 sums can send 8 epochs of SGD
    # elsewhere (the adversarial model moved 0.1 point of clean accuracy from one machine to
    # another), so the test asks for the same model's predictions and accuracy, not the same
    # bits (a broken or missing training agrees on far fewer images).
    assert np.mean(a == b) >= 0.97
    assert abs(np.mean(a == test.y) - np.mean(b == test.y)) <= 0.01


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXBUNDLE_CACHE", str(tmp_path))
    assert models.default_cache_dir() == tmp_path
    monkeypatch.delenv("JAXBUNDLE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.default_cache_dir() == tmp_path / "home" / ".cache" / "jaxbundle"


def test_cache_keys(tmp_path, train_set):
    base = models.cache_path(TINY, tmp_path)
    assert base == models.cache_path(TINY._replace(), tmp_path)  # equal configs, equal paths
    variants = [
        TINY._replace(seed=1),
        TINY._replace(epochs=3),
        TINY._replace(learning_rate=1e-3),
        TINY._replace(n_train=256),
        TINY._replace(adversarial=True),
        TINY._replace(arch="mlp"),
    ]
    paths = {models.cache_path(c, tmp_path) for c in variants}
    assert base not in paths and len(paths) == len(variants)
    # A user-supplied dataset is part of the key; its content, not just its name.
    custom = models.cache_path(TINY, tmp_path, train_set)
    assert custom != base
    flipped = train_set._replace(y=(train_set.y + 1) % 10)
    assert models.cache_path(TINY, tmp_path, flipped) != custom


def test_code_version_is_part_of_key(monkeypatch, tmp_path):
    before = models.cache_path(TINY, tmp_path)
    monkeypatch.setattr(models.cache, "CODE_VERSION", models.CODE_VERSION + 1)
    assert models.cache_path(TINY, tmp_path) != before


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "wrong_model"])
def test_corrupt_cache_retrains(tmp_path, monkeypatch, train_set, damage):
    cfg = TINY_MLP
    path = models.cache_path(cfg, tmp_path, train_set)
    path.parent.mkdir(parents=True)
    if damage == "garbage":
        path.write_bytes(b"this is not msgpack \x00\xff" * 10)
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        import flax.serialization

        other = TINY if damage == "wrong_model" else cfg
        module = models.model_for(other)
        params = module.init(jax.random.PRNGKey(0), train_set.x[:1])
        blob = flax.serialization.to_bytes(params)
        path.write_bytes(blob[: len(blob) // 2] if damage == "truncated" else blob)

    calls = _count_train_calls(monkeypatch)
    with pytest.warns(RuntimeWarning, match="corrupt model cache"):
        apply_fn, params = models.load_or_train(cfg, cache_dir=tmp_path, dataset=train_set)
    assert len(calls) == 1
    assert apply_fn(params, train_set.x[:2]).shape == (2, 10)
    # The bad file was replaced by a good one.
    _, again = models.load_or_train(cfg, cache_dir=tmp_path, dataset=train_set)
    assert len(calls) == 1
    _assert_trees_equal(params, again)


def test_cache_write_is_atomic_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "models" / "x.msgpack"

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        models._atomic_write(path, b"abc")
    assert list(path.parent.iterdir()) == []


@pytest.mark.parametrize("size, kernel, stride",
                         [(28, 5, 2), (14, 5, 2), (7, 3, 1), (9, 4, 2), (6, 1, 3)])
def test_conv_matches_flax_conv_values_and_gradients(size, kernel, stride):
    """models.Conv has flax's parameters and numbers; only its backward pass is rewritten."""
    x = jax.random.uniform(jax.random.key(1), (3, size, size, 2))
    ours = models.Conv(4, kernel, stride=stride)
    theirs = nn.Conv(4, (kernel, kernel), strides=(stride, stride), padding="SAME")
    params = theirs.init(jax.random.key(2), x)
    assert jax.tree.structure(ours.init(jax.random.key(2), x)) == jax.tree.structure(params)
    np.testing.assert_allclose(ours.apply(params, x), theirs.apply(params, x), rtol=1e-5, atol=1e-5)

    def grads(module):
        loss = lambda p, xx: jnp.sum(jnp.sin(module.apply(p, xx)))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1))(params, x)

    for a, b in zip(jax.tree.leaves(grads(ours)), jax.tree.leaves(grads(theirs))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_processes_sharing_a_cache_train_a_missing_model_once(tmp_path):
    """Two processes ask a shared cache for the same missing model at once (test workers, the
    hosts of one job): the first trains it under the cache's lock, the second waits and reads
    it. Each process's training is made to take 3 s, so without the lock both would train."""
    from toys import assert_all_succeeded, python_command, run_processes

    code = (
        "import sys, time\n"
        "import jax.numpy as jnp\n"
        "from jaxbundle import models\n"
        "from jaxbundle.models import cache\n"
        "real = cache.train\n"
        "def slow(*args, **kwargs):\n"
        "    print('TRAINED', flush=True)\n"
        "    time.sleep(3)\n"
        "    return real(*args, **kwargs)\n"
        "cache.train = slow\n"
        "config = models.TrainConfig(arch='mlp', epochs=1, batch_size=64, n_train=64)\n"
        "apply_fn, params = models.load_or_train(config, cache_dir=sys.argv[1])\n"
        "x = jnp.zeros((1, 28, 28, 1))\n"
        "print('LOGIT', float(apply_fn(params, x)[0, 0]))\n"
    )
    commands = [python_command(code, str(tmp_path), deadline=120) for _ in range(2)]
    results = run_processes(commands, dict(os.environ), timeout=150)
    assert_all_succeeded(results)
    logs = [log for _, log in results]
    assert sum(log.count("TRAINED") for log in logs) == 1, logs
    logits = {line for log in logs for line in log.splitlines() if line.startswith("LOGIT")}
    assert len(logits) == 1, logits  # both hold the same weights
    assert len(list((tmp_path / "models").glob("*.msgpack"))) == 1
