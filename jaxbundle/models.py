"""Small image classifiers, their training (standard and PGD adversarial), and a weight cache.

The models here are deliberately small so that they train in about a minute on a couple
of CPU cores using the embedded MNIST sample (see :mod:`jaxbundle.data`). They are the
targets that the attacks and evaluations in this package are tested against:

* ``STANDARD``: plain empirical-risk training; high clean accuracy, no robustness.
* ``ADVERSARIAL``: Madry et al. (2018) style PGD adversarial training at Linf eps 0.3
  (random start, a few PGD steps, eps ramped up from 0 at the start of training).

Evaluation code elsewhere only needs ``apply_fn(params, x) -> logits``; use
:func:`load_or_train` to get ``(module.apply, params)`` for a config, trained once and
then cached on disk.

Example::

    from jaxbundle import models

    apply_fn, params = models.load_or_train(models.ADVERSARIAL)
    logits = apply_fn(params, x)  # x: float32 [B, 28, 28, 1] in [0, 1]
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import pathlib
import tempfile
import time
import warnings
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxbundle import losses, norms

__all__ = [
    "CODE_VERSION",
    "Conv",
    "conv_same",
    "SmallCNN",
    "MLP",
    "ARCHITECTURES",
    "TrainConfig",
    "STANDARD",
    "ADVERSARIAL",
    "MODELS",
    "model_for",
    "model_name",
    "config_hash",
    "cache_path",
    "default_cache_dir",
    "train",
    "load_or_train",
    "accuracy",
    "pgd_linf",
]

# Bump whenever the architectures or the training procedure change in a way that makes
# previously cached weights stale. It is part of every cache key.
CODE_VERSION = 2

Params = Any  # a flax variables dict: {"params": {...}}
ApplyFn = Callable[[Params, jax.Array], jax.Array]
Progress = Callable[[int, int], None]


def _same_padding(size: int, kernel: int, stride: int) -> tuple[int, int, int]:
    """Output size and (low, high) padding of a 'SAME' convolution (as flax and TF pad)."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return out, total // 2, total - total // 2


def _conv_forward(x: jax.Array, kernel: jax.Array, stride: int) -> jax.Array:
    pads = [_same_padding(x.shape[d], kernel.shape[d - 1], stride)[1:] for d in (1, 2)]
    return jax.lax.conv_general_dilated(
        x, kernel, (stride, stride), pads, dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def conv_same(x: jax.Array, kernel: jax.Array, stride: int) -> jax.Array:
    """A 'SAME' NHWC/HWIO convolution whose input gradient is also an NHWC/HWIO convolution.

    The numbers are those of ``flax.linen.Conv(padding="SAME")``. Only the backward pass
    differs in form: JAX's transpose rule gives the input-gradient convolution an ``01oi``
    kernel layout, which XLA:CPU canonicalises only outside loops; inside a ``lax.scan`` it
    falls back to a naive emitter, measured 4-6x slower (benchmarks/README.md). Here the
    kernel is flipped and transposed for real, so every convolution is canonical.
    """
    return _conv_forward(x, kernel, stride)


def _conv_same_fwd(x, kernel, stride):
    return _conv_forward(x, kernel, stride), (x, kernel)


def _conv_same_bwd(stride, residuals, g):
    x, kernel = residuals
    flipped = jnp.swapaxes(jnp.flip(kernel, (0, 1)), 2, 3)
    pads = []
    for d in (1, 2):
        size, k = x.shape[d], kernel.shape[d - 1]
        out, low, _ = _same_padding(size, k, stride)
        pads.append((k - 1 - low, size - (out - 1) * stride - 1 + low))
    dx = jax.lax.conv_general_dilated(
        g, flipped, (1, 1), pads, lhs_dilation=(stride, stride),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    dkernel = jax.vjp(lambda k: _conv_forward(x, k, stride), kernel)[1](g)[0]
    return dx, dkernel


conv_same.defvjp(_conv_same_fwd, _conv_same_bwd)


class Conv(nn.Module):
    """``nn.Conv(features, (kernel, kernel), strides=stride, padding="SAME")`` with the same
    parameters and initialisers, computed by :func:`conv_same` (fast input gradients in loops).
    """

    features: int
    kernel: int
    stride: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = (self.kernel, self.kernel, x.shape[-1], self.features)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), shape)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        return conv_same(x, kernel, self.stride) + bias[None, None, None, :]


class SmallCNN(nn.Module):
    """A small convolutional network for 28x28 grey-scale images.

    Two strided ``kernel x kernel`` convolutions (28 -> 14 -> 7), one hidden dense layer and
    a linear read-out, all with ReLU. No batch norm or dropout, so ``apply`` is a pure function of
    ``(params, x)``.

    Attributes:
      num_classes: number of output logits.
      conv1: channels of the first convolution.
      conv2: channels of the second convolution.
      hidden: width of the hidden dense layer.
      kernel: side of the square convolution kernels.
    """

    num_classes: int = 10
    conv1: int = 16
    conv2: int = 32
    hidden: int = 100
    kernel: int = 5

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Computes logits.

        Args:
          x: images ``[B, H, W, C]``, float32 in ``[0, 1]``.

        Returns:
          Logits ``[B, num_classes]``, float32.
        """
        x = nn.relu(Conv(self.conv1, self.kernel, stride=2, name="conv1")(x))
        x = nn.relu(Conv(self.conv2, self.kernel, stride=2, name="conv2")(x))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.hidden, name="hidden")(x))
        return nn.Dense(self.num_classes, name="logits")(x)


class MLP(nn.Module):
    """A fully connected ReLU network; mostly useful for fast tests.

    Attributes:
      num_classes: number of output logits.
      hidden: widths of the hidden layers.
    """

    num_classes: int = 10
    hidden: tuple[int, ...] = (64,)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Computes logits ``[B, num_classes]`` from inputs ``[B, ...]``."""
        x = x.reshape(x.shape[0], -1)
        for i, width in enumerate(self.hidden):
            x = nn.relu(nn.Dense(width, name=f"hidden{i}")(x))
        return nn.Dense(self.num_classes, name="logits")(x)


ARCHITECTURES: dict[str, Callable[..., nn.Module]] = {
    "small_cnn": SmallCNN,
    "mlp": MLP,
}


class TrainConfig(NamedTuple):
    """Everything that determines a trained model (and hence its cache key).

    Attributes:
      arch: architecture name, a key of :data:`ARCHITECTURES`.
      num_classes: number of classes (output logits).
      adversarial: train on PGD adversarial examples (Madry et al. 2018) instead of clean ones.
      epochs: passes over the training images.
      batch_size: examples per optimizer step (the last partial batch of an epoch is dropped;
        the data are reshuffled every epoch).
      learning_rate: Adam learning rate (peak value of the schedule).
      seed: seed for initialisation, shuffling and PGD random starts.
      n_train: how many of the training images to use (the first ``n_train``), ``None`` for all.
      eps: Linf radius of the training-time attack.
      pgd_steps: PGD iterations per training batch (each starts from a uniform random point
        in the eps ball).
      pgd_step_size: PGD step size at full eps; during the warm-up it is scaled with eps.
      eps_warmup: fraction of the training steps over which eps (and the step size) ramp
        linearly from 0 to their final values.
      clean_fraction: fraction of each adversarial batch left unperturbed.
      cosine_decay: decay the learning rate to 0 with a cosine schedule (else constant).
    """

    arch: str = "small_cnn"
    num_classes: int = 10
    adversarial: bool = False
    epochs: int = 8
    batch_size: int = 128
    learning_rate: float = 5e-3
    seed: int = 0
    n_train: int | None = None
    eps: float = 0.3
    pgd_steps: int = 2
    pgd_step_size: float = 0.2
    eps_warmup: float = 0.3
    clean_fraction: float = 0.0
    cosine_decay: bool = True


# Measured on 2 (shared) CPU cores, 10,000 embedded training images, seed 0:
#   STANDARD:    16-25 s; 97.8% clean on the 2,000 embedded test images, 0% under PGD-20.
#   ADVERSARIAL: 40-50 s; 96.9% clean; on the first 500 test images 85.2% under PGD-20
#                (Linf 0.3, random start, step 2.5 * eps / 20) and ~80% under PGD-100 x 5.
STANDARD = TrainConfig(adversarial=False, epochs=8, learning_rate=5e-3)
ADVERSARIAL = TrainConfig(
    adversarial=True,
    epochs=11,
    learning_rate=1e-2,
    eps=0.3,
    pgd_steps=2,
    pgd_step_size=0.2,
    eps_warmup=0.3,
)

MODELS: dict[str, TrainConfig] = {"standard": STANDARD, "adversarial": ADVERSARIAL}


def model_for(config: TrainConfig) -> nn.Module:
    """The (untrained) flax module that ``config`` describes.

    Configs with the same architecture share one module instance, so their ``module.apply``
    is the same function and the jitted bundle compiles once for all of them.
    """
    return _module(config.arch, config.num_classes)


@functools.cache
def _module(arch: str, num_classes: int) -> nn.Module:
    try:
        cls = ARCHITECTURES[arch]
    except KeyError:
        raise ValueError(
            f"unknown architecture {arch!r}; expected one of {sorted(ARCHITECTURES)}"
        ) from None
    return cls(num_classes=num_classes)


def model_name(config: TrainConfig) -> str:
    """A short human-readable name, e.g. ``"small_cnn-adv"``; the cache file prefix."""
    return f"{config.arch}-{'adv' if config.adversarial else 'std'}"


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------


def pgd_linf(
    apply_fn: ApplyFn,
    params: Params,
    x: jax.Array,
    y: jax.Array,
    key: jax.Array,
    eps: float | jax.Array,
    step_size: float | jax.Array,
    steps: int,
) -> jax.Array:
    """Untargeted Linf PGD on the cross-entropy with a uniform random start.

    Used for adversarial training (and handy in tests); the attacks proper live elsewhere.
    ``steps`` must be a Python int; ``eps`` and ``step_size`` may be traced scalars.

    Args:
      apply_fn: ``apply_fn(params, x) -> logits``.
      params: model parameters (treated as constants: no gradient flows into them).
      x: clean images ``[B, ...]`` in ``[0, 1]``.
      y: labels ``[B]``.
      key: PRNG key for the random start.
      eps: Linf radius.
      step_size: size of each signed-gradient step.
      steps: number of PGD iterations.

    Returns:
      Adversarial images ``[B, ...]`` inside the eps ball around ``x`` and the box.
    """
    params = jax.lax.stop_gradient(params)
    eps = jnp.asarray(eps, x.dtype)
    step_size = jnp.asarray(step_size, x.dtype)
    start = x + jax.random.uniform(key, x.shape, x.dtype, -1.0, 1.0) * eps
    start = norms.project(start, x, eps, "linf")

    def total_loss(xa: jax.Array) -> jax.Array:
        return jnp.sum(losses.cross_entropy(apply_fn(params, xa), y))

    grad_fn = jax.grad(total_loss)

    def body(_: int, xa: jax.Array) -> jax.Array:
        xa = xa + step_size * norms.normalize(grad_fn(xa), "linf")
        return norms.project(xa, x, eps, "linf")

    # Unrolled: on XLA:CPU a rolled while-loop runs the convolutions several times slower.
    x_adv = jax.lax.fori_loop(0, steps, body, start, unroll=True)
    return jax.lax.stop_gradient(x_adv)


def _learning_rate(config: TrainConfig, step: int, total_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): cosine decay to 0, or constant."""
    if not config.cosine_decay:
        return config.learning_rate
    progress = min(step / max(total_steps, 1), 1.0)
    return config.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))


def _eps_at(config: TrainConfig, step: int, total_steps: int) -> float:
    """Training-time eps at optimizer step ``step`` (0-based): linear warm-up, then constant."""
    ramp = config.eps_warmup * total_steps
    if ramp <= 0:
        return config.eps
    return config.eps * min(1.0, (step + 1) / ramp)


class _StepSpec(NamedTuple):
    """The static (compile-time) part of a training step; hashable, seed-independent."""

    adversarial: bool
    pgd_steps: int
    pgd_step_ratio: float  # PGD step size / eps
    n_clean: int  # examples per batch left unperturbed


_OPTIMIZER = optax.scale_by_adam()  # Adam moments; the (scheduled) learning rate is applied below.


@functools.partial(jax.jit, static_argnames=("module", "spec"))
def _train_step(
    params: Params,
    opt_state: Any,
    x: jax.Array,
    y: jax.Array,
    key: jax.Array,
    eps: jax.Array,
    lr: jax.Array,
    *,
    module: nn.Module,
    spec: _StepSpec,
) -> tuple[Params, Any, jax.Array]:
    """One Adam step on clean or PGD-perturbed ``(x, y)``; returns ``(params, state, loss)``.

    Everything that changes during training (params, optimizer state, batch, PRNG key, eps,
    learning rate) is a traced argument, so one compilation serves a whole run and every
    run with the same ``module`` and ``spec``.
    """
    apply_fn = module.apply
    if spec.adversarial:
        step_size = eps * spec.pgd_step_ratio
        x_adv = pgd_linf(apply_fn, params, x, y, key, eps, step_size, spec.pgd_steps)
        if spec.n_clean > 0:
            keep = (jnp.arange(x.shape[0]) < spec.n_clean).reshape((-1,) + (1,) * (x.ndim - 1))
            x_adv = jnp.where(keep, x, x_adv)
        x = x_adv

    def loss_fn(p: Params) -> jax.Array:
        return jnp.mean(losses.cross_entropy(apply_fn(p, x), y))

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = _OPTIMIZER.update(grads, opt_state, params)
    updates = jax.tree_util.tree_map(lambda u: -lr * u, updates)
    return optax.apply_updates(params, updates), opt_state, loss


def _default_train_set() -> Any:
    from jaxbundle import data  # Imported lazily: only needed when training.

    return data.load_mnist_sample("train")


def _training_arrays(config: TrainConfig, dataset: Any | None) -> tuple[np.ndarray, np.ndarray]:
    if dataset is None:
        dataset = _default_train_set()
    x = np.asarray(dataset.x, np.float32)
    y = np.asarray(dataset.y, np.int32)
    if config.n_train is not None:
        if config.n_train > x.shape[0]:
            raise ValueError(f"n_train={config.n_train} but the dataset has {x.shape[0]} examples")
        x, y = x[: config.n_train], y[: config.n_train]
    if y.size and (y.min() < 0 or y.max() >= config.num_classes):
        raise ValueError(f"labels must lie in [0, {config.num_classes}) for this config")
    return x, y


def train(
    config: TrainConfig,
    dataset: Any | None = None,
    *,
    progress: Progress | None = None,
) -> Params:
    """Trains a model from scratch; deterministic for a fixed ``config.seed``.

    Args:
      config: what to train and how.
      dataset: an object with ``x`` (float32 ``[N, H, W, C]`` in ``[0, 1]``) and ``y`` (int
        ``[N]``); defaults to the embedded MNIST training sample. Its first
        ``config.n_train`` examples are used.
      progress: called as ``progress(step, total_steps)`` after every optimizer step.

    Returns:
      The trained flax variables ``{"params": ...}``, usable as ``module.apply(params, x)``.
    """
    x, y = _training_arrays(config, dataset)
    n = x.shape[0]
    if n == 0:
        raise ValueError("cannot train on an empty dataset")
    batch_size = min(config.batch_size, n)
    steps_per_epoch = n // batch_size
    total_steps = config.epochs * steps_per_epoch

    module = model_for(config)
    key = jax.random.PRNGKey(config.seed)
    init_key, pgd_key = jax.random.split(key)
    params = module.init(init_key, jnp.zeros((1,) + x.shape[1:], jnp.float32))
    opt_state = _OPTIMIZER.init(params)
    spec = _StepSpec(
        adversarial=bool(config.adversarial),
        pgd_steps=int(config.pgd_steps),
        pgd_step_ratio=float(config.pgd_step_size / config.eps) if config.eps > 0 else 0.0,
        n_clean=int(round(config.clean_fraction * batch_size)),
    )

    rng = np.random.default_rng(config.seed)
    step = 0
    for _ in range(config.epochs):
        order = rng.permutation(n)
        for b in range(steps_per_epoch):
            idx = order[b * batch_size : (b + 1) * batch_size]
            params, opt_state, _ = _train_step(
                params,
                opt_state,
                x[idx],
                y[idx],
                jax.random.fold_in(pgd_key, step),
                jnp.float32(_eps_at(config, step, total_steps)),
                jnp.float32(_learning_rate(config, step, total_steps)),
                module=module,
                spec=spec,
            )
            step += 1
            if progress is not None:
                progress(step, total_steps)
    return jax.block_until_ready(params)


def accuracy(
    apply_fn: ApplyFn, params: Params, x: Any, y: Any, batch_size: int = 500
) -> float:
    """Fraction of ``x`` that ``apply_fn(params, x)`` classifies as ``y``, in batches."""
    x = np.asarray(x, np.float32)
    y = np.asarray(y)
    if x.shape[0] == 0:
        return float("nan")
    predict = jax.jit(lambda p, xb: jnp.argmax(apply_fn(p, xb), axis=-1))
    correct = 0
    for start in range(0, x.shape[0], batch_size):
        pred = predict(params, x[start : start + batch_size])
        correct += int(np.sum(np.asarray(pred) == y[start : start + batch_size]))
    return correct / x.shape[0]


# --------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------


def default_cache_dir() -> pathlib.Path:
    """``$JAXBUNDLE_CACHE`` if set, else ``~/.cache/jaxbundle``."""
    env = os.environ.get("JAXBUNDLE_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "jaxbundle"


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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


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
) -> tuple[ApplyFn, Params]:
    """Returns ``(module.apply, params)`` for ``config``, training only on a cache miss.

    The weights live in ``cache_path(config, cache_dir, dataset)`` (flax msgpack) next to a
    JSON sidecar (same name, ``.json``) holding the config, the code version, the training
    time and the clean accuracy on the training images. Both are written atomically. A
    cache file that cannot be read is reported with a warning and replaced by retraining.

    Args:
      config: the model to get.
      cache_dir: cache root; defaults to ``$JAXBUNDLE_CACHE`` or ``~/.cache/jaxbundle``.
      dataset: training data (see :func:`train`); defaults to the embedded MNIST sample.
      progress: passed to :func:`train` when training happens.

    Returns:
      ``(apply_fn, params)`` with ``apply_fn(params, x) -> logits``.
    """
    module = model_for(config)
    path = cache_path(config, cache_dir, dataset)
    if path.exists():
        if dataset is None:
            example_shape: tuple[int, ...] = (28, 28, 1)
        else:
            example_shape = tuple(np.shape(dataset.x)[1:])
        try:
            return module.apply, _load(path, _template(config, example_shape))
        except (OSError, ValueError) as e:
            warnings.warn(f"ignoring corrupt model cache ({e}); retraining", RuntimeWarning)

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
