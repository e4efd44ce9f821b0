"""The weight cache: :func:`load_or_train` trains a demo model once and keeps it on disk."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import time
import warnings
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle.run import files
from jaxbundle.run.compile_cache import cache_root
from jaxbundle.models.architectures import ApplyFn, Params, model_for, model_name
from jaxbundle.models.training import (
    ADVERSARIAL,
    ADVERSARIAL_LINEN,
    CERTIFIED,
    STANDARD,
    Progress,
    TrainConfig,
    _training_arrays,
    accuracy,
    train,
)

__all__ = [
    "CODE_VERSION",
    "MODELS",
    "SHIPPED",
    "cache_path",
    "config_hash",
    "default_cache_dir",
    "load_or_train",
    "ship",
]

# Bump whenever the architectures or the training procedure change in a way that makes
# previously cached weights stale. It is part of every cache key.
CODE_VERSION = 3

# The demo models' weights as this project trained them (the JSON beside each says when, how
# long, with which config), shipped in the package so that a first run trains nothing. They are
# looked up by the cache's own file name, so any change of config, data or CODE_VERSION misses
# them and trains afresh; :func:`ship` (``python -m jaxbundle.models.cache``) retrains them
# into this folder.
SHIPPED = pathlib.Path(__file__).parent / "weights"

# The demo models by name (the CLI's ``--models``).
MODELS: dict[str, TrainConfig] = {
    "standard": STANDARD,
    "adversarial": ADVERSARIAL,
    "adversarial-linen": ADVERSARIAL_LINEN,
    "certified": CERTIFIED,
}


default_cache_dir = cache_root  # ``$JAXBUNDLE_CACHE`` if set, else ``~/.cache/jaxbundle``


def _dataset_fingerprint(config: TrainConfig, dataset: Any | None) -> str:
    if dataset is None:
        return "embedded-mnist-train"
    x, y = _training_arrays(config, dataset)
    h = hashlib.sha256()
    for a in (x, y):
        h.update(str((a.shape, a.dtype.str)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return f"{getattr(dataset, 'name', 'dataset')}:{h.hexdigest()}"


def config_hash(config: TrainConfig, dataset: Any | None = None) -> str:
    """A 16-hex-digit key of the config, the training data and :data:`CODE_VERSION`."""
    payload = {
        "code_version": CODE_VERSION,
        "config": config._asdict(),
        "data": _dataset_fingerprint(config, dataset),
    }
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cache_path(
    config: TrainConfig,
    cache_dir: str | os.PathLike[str] | None = None,
    dataset: Any | None = None,
) -> pathlib.Path:
    """Where :func:`load_or_train` keeps the weights: ``<dir>/models/<name>-<hash>.msgpack``."""
    root = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "models" / f"{model_name(config)}-{config_hash(config, dataset)}.msgpack"


def _atomic_write(path: pathlib.Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    files.atomic_write(path, data)


def _template(config: TrainConfig, example_shape: tuple[int, ...]) -> Params:
    module = model_for(config)
    return module.init(jax.random.PRNGKey(0), jnp.zeros((1,) + example_shape, jnp.float32))


def _load(path: pathlib.Path, template: Params) -> Params:
    """Reads cached params; raises ``ValueError`` if the file does not match ``template``."""
    try:
        params = flax.serialization.from_bytes(template, path.read_bytes())
    except Exception as e:  # msgpack / flax raise a variety of errors on bad input
        raise ValueError(f"cannot decode {path}: {e}") from e
    want = jax.tree_util.tree_structure(template)
    if jax.tree_util.tree_structure(params) != want:
        raise ValueError(f"{path} has the wrong parameter structure")
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(template)):
        if np.shape(a) != np.shape(b) or np.asarray(a).dtype != np.asarray(b).dtype:
            raise ValueError(f"{path} has parameters of the wrong shape or dtype")
    return jax.tree_util.tree_map(jnp.asarray, params)


def load_or_train(
    config: TrainConfig,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    dataset: Any | None = None,
    progress: Progress | None = None,
    shipped: bool = True,
) -> tuple[ApplyFn, Params]:
    """Returns ``(module.apply, params)`` for ``config``, training only on a cache miss.

    A demo model on the embedded sample (:data:`MODELS`, ``dataset=None``) is first looked
    for in the cache, then among the weights shipped with the package (:data:`SHIPPED`).

    The weights live in ``cache_path(config, cache_dir, dataset)`` (flax msgpack) next to a
    JSON sidecar (same name, ``.json``) holding the config, the code version, the training
    time and the clean accuracy on the training images. Both are written atomically, under a
    lock beside them (``.lock``), so processes sharing the cache train a missing model once. A
    cache file that cannot be read is reported with a warning and replaced by retraining.

    Args:
      config: the model to get.
      cache_dir: cache root; defaults to ``$JAXBUNDLE_CACHE`` or ``~/.cache/jaxbundle``.
      dataset: training data (see :func:`train`); defaults to the embedded MNIST sample.
      progress: passed to :func:`train` when training happens.
      shipped: whether the weights shipped with the package count as cached.

    Returns:
      ``(apply_fn, params)`` with ``apply_fn(params, x) -> logits``.
    """
    module = model_for(config)
    path = cache_path(config, cache_dir, dataset)
    if dataset is None:
        example_shape: tuple[int, ...] = (28, 28, 1)
    else:
        example_shape = tuple(np.shape(dataset.x)[1:])
    cached = _cached(path, config, example_shape)
    if cached is None and dataset is None and shipped:
        cached = _cached(SHIPPED / path.name, config, example_shape)
    if cached is not None:
        return module.apply, cached
    # Several processes sharing a cache (test workers, the hosts of one job) train a missing
    # model once: the first takes the lock and trains, the others wait and then read it.
    path.parent.mkdir(parents=True, exist_ok=True)
    with files.exclusive(path.with_suffix(".lock")):
        cached = _cached(path, config, example_shape)
        if cached is not None:
            return module.apply, cached
        t0 = time.perf_counter()
        params = train(config, dataset, progress=progress)
        seconds = time.perf_counter() - t0
        x, y = _training_arrays(config, dataset)
        meta = {
            "name": model_name(config),
            "config": config._asdict(),
            "code_version": CODE_VERSION,
            "hash": config_hash(config, dataset),
            "data": _dataset_fingerprint(config, dataset),
            "train_seconds": round(seconds, 3),
            "train_accuracy": accuracy(module.apply, params, x, y),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        _atomic_write(path, flax.serialization.to_bytes(params))
        _atomic_write(path.with_suffix(".json"), (json.dumps(meta, indent=2) + "\n").encode())
    return module.apply, params


def _cached(path: pathlib.Path, config: TrainConfig, example_shape: tuple[int, ...]
            ) -> Params | None:
    """The cached params at ``path``, or ``None`` when there are none (a corrupt file is
    reported with a warning and treated as missing)."""
    if not path.exists():
        return None
    try:
        return _load(path, _template(config, example_shape))
    except (OSError, ValueError) as e:
        warnings.warn(f"ignoring corrupt model cache ({e}); retraining", RuntimeWarning)
        return None


SHIPPED_MODELS = ("standard", "adversarial", "certified")  # the main job's


def ship(names: tuple[str, ...] = SHIPPED_MODELS, folder: pathlib.Path = SHIPPED) -> None:
    """Trains the demo models ``names`` afresh (never from a cache) and writes their weights
    and JSON sidecars into ``folder``: how the shipped weights were made."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            config = MODELS[name]
            load_or_train(config, cache_dir=tmp, shipped=False)
            path = cache_path(config, tmp)
            for made in (path, path.with_suffix(".json")):
                shutil.copyfile(made, pathlib.Path(folder) / made.name)


if __name__ == "__main__":
    ship()
