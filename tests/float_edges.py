"""Float32 adversarial points at the edge of certified balls, searched as Jia & Rinard (2021,
"Exploiting verified neural networks via floating point numerical error") search them.

:func:`edge_problem` builds a network whose exact minimum margin over each example's ball is a
chosen tiny fraction of the margin's absolute scale: a flax ReLU network (two ``nn.Conv``, two
``nn.Dense``) whose hidden units are all active over the whole ``[0, 1]`` box, so that it is
affine there and the exact minimum of its margin over any box is known in float64; each example's
radius is bisected until that minimum is the chosen fraction. A bound in real arithmetic
certifies such an example; whether the model's float32 arithmetic still classifies every point
of the ball correctly is down to its rounding. :func:`fooled` searches each ball for a point the
model, computed as the judge computes it (:func:`jaxbundle.arithmetic.stated`), misclassifies:
the vertex where the exact margin is smallest and random neighbours a few ulps inward, each a
different draw of the rounding. Shared by ``tests/test_certify_float.py`` and
``benchmarks/float_soundness.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle import arithmetic

SHAPE = (28, 28, 1)


class EdgeNet(nn.Module):
    """Two ``nn.Conv`` (3x3 stride 2: 9 and 72 products a sum), ``nn.Dense`` 784 -> 64 and
    64 -> 2, ReLUs; ``precision`` None (the backend's default) or explicit."""

    precision: jax.lax.Precision | None = None

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), strides=2, precision=self.precision)(x))
        x = nn.relu(nn.Conv(16, (3, 3), strides=2, precision=self.precision)(x))
        x = nn.relu(nn.Dense(64, precision=self.precision)(x.reshape(x.shape[0], -1)))
        return nn.Dense(2, precision=self.precision)(x)


class EdgeProblem(NamedTuple):
    """Images ``x`` ``[B, 28, 28, 1]``, labels ``y``, radii ``eps`` ``[B]`` (float32), and the
    exact minimum margin over each ball, absolute and relative to the margin's scale (what the
    network computes with every weight, bias and pixel by its absolute value)."""

    apply_fn: object
    params: dict
    x: np.ndarray
    y: np.ndarray
    eps: np.ndarray
    margin: np.ndarray
    relative: np.ndarray
    slope: np.ndarray  # [2, 784]: each label's margin is slope[label] . x + a constant


def _all_active(params) -> dict:
    """``params`` with the hidden layers' weights made positive (scaled by ``1 / sqrt(fan
    in)``, so values stay about 1) and their biases 0.1: every ReLU's input is positive for
    every image in ``[0, 1]``, and the network is affine on the box."""
    params = jax.tree.map(np.array, params)  # in NumPy: eagerly, JAX compiles each step
    layers = params["params"]
    for name in ("Conv_0", "Conv_1", "Dense_0"):
        kernel = layers[name]["kernel"]
        fan_in = int(np.prod(kernel.shape[:-1]))
        layers[name]["kernel"] = (np.abs(kernel) / np.sqrt(fan_in)).astype(np.float32)
        layers[name]["bias"] = np.full_like(layers[name]["bias"], 0.1)
    return params


def _exact(apply_fn, params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """In float64: the margins ``z_0 - z_1`` and ``z_1 - z_0`` on the box as ``a[label] . x +
    c[label]`` (the network is affine there: the same for every image), and each image's scale
    (the network with every weight, bias and pixel by its absolute value, both logits
    summed)."""
    with jax.enable_x64(True):
        wide = jax.tree.map(lambda v: np.asarray(v, np.float64), params)
        logits = jax.jit(apply_fn)  # one program each: eagerly, every operation compiles
        gradient = jax.jit(jax.jacobian(lambda p, v: apply_fn(p, v[None])[0], argnums=1))
        slope = np.asarray(gradient(wide, jnp.zeros(SHAPE))).reshape(2, -1)
        offset = np.asarray(logits(wide, jnp.zeros((1, *SHAPE))))[0]
        a = np.stack([slope[0] - slope[1], slope[1] - slope[0]])
        c = np.array([offset[0] - offset[1], offset[1] - offset[0]])
        absolute = jax.tree.map(np.abs, wide)
        scale = np.sum(np.asarray(logits(absolute, np.abs(x).astype(np.float64))), axis=1)
    return a, c, scale


def _box(x0: np.ndarray, eps) -> tuple[np.ndarray, np.ndarray]:
    """The float32 box ``[max(x0 - eps, 0), min(x0 + eps, 1)]`` as the bounds compute it."""
    eps = np.float32(eps)
    return (np.maximum(x0 - eps, np.float32(0.0)), np.minimum(x0 + eps, np.float32(1.0)))


def _minimum(a: np.ndarray, c: float, low: np.ndarray, high: np.ndarray) -> float:
    return float(np.sum(np.where(a > 0, a * low, a * high)) + c)


def edge_problem(seed: int, n: int, fractions: np.ndarray,
                 precision: jax.lax.Precision | None = None) -> EdgeProblem:
    """``n`` examples whose exact minimum margins over their balls are about ``fractions``
    (cycled) of their scales. Radii are bisected in float64 over the float32 boxes."""
    module = EdgeNet(precision)
    params = _all_active(jax.jit(module.init)(jax.random.key(seed), jnp.zeros((1, *SHAPE))))
    # The decision boundary through the middle of the box, so that small balls reach it.
    x = np.random.default_rng(seed).uniform(size=(n, *SHAPE)).astype(np.float32)
    a, c, _ = _exact(module.apply, params, x[:1])
    params["params"]["Dense_1"]["bias"][0] -= np.float32(c[0] + 0.5 * np.sum(a[0]))
    a, c, scales = _exact(module.apply, params, x)
    ys, radii, margins, relative = [], [], [], []
    for b in range(n):
        flat = x[b].reshape(-1)
        label = int(a[0] @ flat + c[0] < 0)
        clean = a[label] @ flat + c[label]
        target = min(fractions[b % len(fractions)] * scales[b], 0.5 * clean)
        low, high = 0.0, 1.0
        for _ in range(60):  # the largest float32 radius whose exact minimum is >= target
            middle = 0.5 * (low + high)
            if _minimum(a[label], c[label], *_box(flat, middle)) >= target:
                low = middle
            else:
                high = middle
        eps = np.float32(low)
        ys.append(label)
        radii.append(eps)
        margins.append(_minimum(a[label], c[label], *_box(flat, eps)))
        relative.append(margins[-1] / scales[b])
    return EdgeProblem(module.apply, params, x, np.asarray(ys, np.int32),
                       np.asarray(radii, np.float32), np.asarray(margins),
                       np.asarray(relative), a)


def points(problem: EdgeProblem, b: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``[count + 1, 28, 28, 1]`` float32 points of example ``b``'s ball: the vertex where the
    exact margin is smallest, and neighbours: half with each of the quarter of the pixels the
    margin depends on least 0 to 3 ulps inward (other roundings, nearly the same exact margin),
    half with the twentieth it depends on least anywhere in the ball (other roundings of a
    narrower arithmetic, whose steps are wider than ulps)."""
    a = problem.slope[int(problem.y[b])]
    low, high = _box(problem.x[b].reshape(-1), problem.eps[b])
    vertex = np.where(a > 0, low, high).astype(np.float32)
    inward = np.where(a > 0, np.float32(np.inf), np.float32(-np.inf))
    free = np.abs(a) <= np.quantile(np.abs(a), 0.25)
    loose = np.abs(a) <= np.quantile(np.abs(a), 0.05)
    out = [vertex]
    for k in range(count):
        moved = vertex.copy()
        if k % 2:
            anywhere = low + rng.uniform(size=vertex.shape).astype(np.float32) * (high - low)
            moved = np.where(loose, anywhere, moved)
        else:
            steps = np.where(free, rng.integers(0, 4, size=vertex.shape), 0)
            for step in range(1, 4):
                moved = np.where(steps >= step, np.nextafter(moved, inward), moved)
        out.append(np.clip(moved, low, high))
    return np.stack(out).reshape(count + 1, *SHAPE)


def fooled(problem: EdgeProblem, count: int = 32, seed: int = 0) -> np.ndarray:
    """``[B]``: whether a searched point of the example's ball (:func:`points`) is
    misclassified by the model as the judge computes it."""
    rng = np.random.default_rng(seed)
    found = np.stack([points(problem, b, count, rng) for b in range(len(problem.y))])
    with arithmetic.stated():
        logits = jax.jit(problem.apply_fn)(problem.params,
                                           jnp.asarray(found.reshape(-1, *SHAPE)))
    predicted = np.asarray(jnp.argmax(logits, axis=-1)).reshape(len(problem.y), count + 1)
    return np.any(predicted != problem.y[:, None], axis=1)
