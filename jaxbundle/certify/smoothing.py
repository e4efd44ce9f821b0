"""Randomised smoothing: a certified L2 radius for a classifier under Gaussian input noise.

Cohen, Rosenfeld & Kolter 2019, "Certified adversarial robustness via randomized smoothing".
The smoothed classifier of a base classifier ``f`` is

    g(x) = argmax_c P(f(x + e) = c),   e ~ N(0, sigma^2 I),

and if the top class has probability ``pA >= pA_lower > 1/2``, ``g`` predicts it everywhere in
the L2 ball of radius ``sigma * Phi^-1(pA_lower)`` around ``x`` (``Phi`` the standard normal
CDF). CERTIFY estimates this from samples:

1. ``n0`` noisy samples select the top class ``cA`` (the most counted);
2. ``n`` fresh samples count ``cA``: ``nA`` of them;
3. ``pA_lower`` is the one-sided Clopper-Pearson lower bound at level ``alpha``:
   ``Beta(alpha; nA, n - nA + 1)``, the ``p`` at which ``P(Binom(n, p) >= nA) = alpha``;
4. abstain (prediction -1, radius 0) when ``pA_lower <= 1/2``, else certify ``cA`` with radius
   ``sigma * Phi^-1(pA_lower)``.

With probability at least ``1 - alpha`` over the samples, a certified prediction is ``g``'s and
the radius holds for ``g``. The noise must be exactly ``N(0, sigma^2 I)``: it is added to the
image and **not clipped** to the data's box (clipping changes the distribution and voids the
guarantee); the base classifier sees images outside ``[0, 1]``.

A smoothed model is a :class:`jaxbundle.core.sampling.Stochastic` model (:func:`gaussian`): the
library's attacks, EOT and judge run on its noisy calls unchanged, and :func:`certify` finds its
``sigma`` and base classifier in its ``apply_fn``, a :class:`GaussianNoise`.

**Sampling.** Sample ``s`` of example ``i`` in stream ``t`` (0: selection, 1: estimation) is
drawn under ``fold_in(fold_in(fold_in(key, example_id[i]), t), s)``, so that counts depend
neither on the batch of examples nor on the chunking. The samples of all examples are laid out
example-major and evaluated ``batch`` at a time as one batched call of the base classifier (one
compiled program per shape, the counts accumulated on the device); the last chunk is padded and
masked.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from scipy.stats import beta, norm

from jaxbundle.core import sampling

__all__ = [
    "GaussianNoise",
    "Certificate",
    "gaussian",
    "smoothing_sigma",
    "certify",
    "certified_accuracy",
    "lower_confidence_bound",
    "certified_radius",
    "sample_keys",
    "SELECTION_STREAM",
    "ESTIMATION_STREAM",
]

SELECTION_STREAM = 0  # folded into an example's key for the n0 samples that select cA
ESTIMATION_STREAM = 1  # ... and for the n fresh samples that count it


@dataclasses.dataclass(frozen=True)
class GaussianNoise:
    """``base(params, x + sigma * e)`` with ``e ~ N(0, I)`` drawn from ``key`` (not clipped):
    the ``apply_fn`` of a smoothed model, hashable so that it can be a static jit argument.

    Attributes:
      base: the base classifier ``base(params, x) -> logits``, deterministic.
      sigma: the noise's standard deviation, in the images' units.
    """

    base: Callable[[Any, jax.Array], jax.Array]
    sigma: float

    def noisy(self, x: jax.Array, key: jax.Array) -> jax.Array:
        """``x`` plus noise of std ``sigma`` drawn from ``key`` (the same values whatever
        leading axes of size one ``x`` has)."""
        dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
        return x.astype(dtype) + self.sigma * jax.random.normal(key, x.shape, dtype)

    def __call__(self, params: Any, x: jax.Array, key: jax.Array) -> jax.Array:
        return self.base(params, self.noisy(x, key))


class Certificate(NamedTuple):
    """CERTIFY's result, per example (host arrays ``[B]``).

    Attributes:
      prediction: int32 the smoothed classifier's class, -1 where it abstains.
      radius: float64 the certified L2 radius, 0 where it abstains.
      p_lower: float64 the lower confidence bound on the top class's probability.
      counts: int64 how many of the ``n`` estimation samples the base classifier gave ``cA``.
      selected: int32 ``cA``, the class the ``n0`` selection samples chose (abstaining too).
    """

    prediction: np.ndarray
    radius: np.ndarray
    p_lower: np.ndarray
    counts: np.ndarray
    selected: np.ndarray


def gaussian(apply_fn: Callable[[Any, jax.Array], jax.Array], sigma: float, *,
             calls: int = 16, threshold: float = 0.5) -> sampling.Stochastic:
    """The base classifier under isotropic Gaussian input noise, as a stochastic model.

    Args:
      apply_fn: the base classifier ``apply_fn(params, x) -> logits``, deterministic.
      sigma: the noise's standard deviation (> 0). The noise is not clipped to the data's box:
        the certificate needs exactly ``N(0, sigma^2 I)``.
      calls, threshold: the judge's calls and success rate (:func:`jaxbundle.stochastic`).

    Returns:
      A :class:`jaxbundle.core.sampling.Stochastic` whose ``apply_fn`` is a :class:`GaussianNoise`.
    """
    if sampling.is_stochastic(apply_fn) or isinstance(apply_fn, GaussianNoise):
        raise ValueError("gaussian smoothing needs a deterministic base classifier "
                         "apply_fn(params, x), got a stochastic model")
    if not callable(apply_fn):
        raise ValueError(f"the base classifier must be callable as apply_fn(params, x), "
                         f"got {apply_fn!r}")
    if isinstance(sigma, bool) or not np.isfinite(sigma) or not float(sigma) > 0:
        raise ValueError(f"sigma must be a positive finite number, got {sigma!r}")
    return sampling.stochastic(GaussianNoise(apply_fn, float(sigma)), calls=calls,
                               threshold=threshold)


def smoothing_sigma(model: Any) -> float | None:
    """The noise's ``sigma`` of a model built by :func:`gaussian`, else None."""
    noise = model.apply_fn if sampling.is_stochastic(model) else model
    return noise.sigma if isinstance(noise, GaussianNoise) else None


def lower_confidence_bound(count: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """One-sided Clopper-Pearson lower bound at level ``alpha`` on a binomial proportion from
    ``count`` successes in ``n`` trials: ``Beta(alpha; count, n - count + 1)`` (0 when
    ``count = 0``), so that ``P(Binom(n, p_lower) >= count) = alpha``."""
    count = np.asarray(count, np.float64)
    safe = np.maximum(count, 1.0)
    return np.where(count > 0, beta.ppf(alpha, safe, n - safe + 1), 0.0)


def certified_radius(p_lower: np.ndarray, sigma: float) -> np.ndarray:
    """``sigma * Phi^-1(p_lower)`` where ``p_lower > 1/2``, else 0 (abstain)."""
    p_lower = np.asarray(p_lower, np.float64)
    return np.where(p_lower > 0.5, sigma * norm.ppf(np.maximum(p_lower, 0.5)), 0.0)


def sample_keys(key: jax.Array, example_id: jax.Array, stream: int) -> jax.Array:
    """``[B]`` the keys each example's samples of ``stream`` are folded from:
    ``fold_in(fold_in(key, example_id[b]), stream)`` (sample ``s`` under ``fold_in(., s)``)."""
    per_example = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, example_id)
    return sampling.fold_each(per_example, stream)


@functools.partial(jax.jit, static_argnames=("noise", "samples", "size"))
def _count_chunk(noise: GaussianNoise, params: Any, x: jax.Array, keys: jax.Array,
                 counts: jax.Array, start: jax.Array, *, samples: int, size: int) -> jax.Array:
    """``counts`` ``[B, K]`` plus the base classifier's votes on samples ``start`` to
    ``start + size`` of the example-major layout (``samples`` per example; those past the end
    are masked)."""
    flat = start + jnp.arange(size, dtype=jnp.int32)
    valid = flat < x.shape[0] * samples
    example = jnp.minimum(flat // samples, x.shape[0] - 1)
    draws = jax.vmap(jax.random.fold_in)(keys[example], flat % samples)
    images = jax.vmap(noise.noisy)(x[example], draws)
    top = jnp.argmax(noise.base(params, images), axis=-1)
    return counts.at[example, top].add(valid.astype(counts.dtype))


def _counts(noise: GaussianNoise, params: Any, x: jax.Array, keys: jax.Array, samples: int,
            batch: int) -> np.ndarray:
    """``[B, K]`` int the base classifier's votes over ``samples`` noisy copies per example,
    ``batch`` copies per jitted call."""
    shape = jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype)
    classes = jax.eval_shape(noise.base, params, shape).shape[-1]
    counts = jnp.zeros((x.shape[0], classes), jnp.int32)
    total = x.shape[0] * samples
    size = min(batch, total)
    for start in range(0, total, size):  # counts stay on the device: no sync per chunk
        counts = _count_chunk(noise, params, x, keys, counts, np.int32(start), samples=samples,
                              size=size)
    return np.asarray(counts)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def certify(  # noqa: PLR0913 (the public call: Cohen et al.'s n0, n, alpha as keywords)
        model: sampling.Stochastic, params: Any, x: Any, *, key: jax.Array, n0: int = 100,
        n: int = 100_000, alpha: float = 0.001, batch: int = 1024,
        example_id: Any = None) -> Certificate:
    """Cohen et al.'s CERTIFY (module docstring) on a batch of examples.

    Args:
      model: a smoothed model from :func:`gaussian`.
      params: the base classifier's parameters.
      x: images ``[B, ...]``.
      key: a JAX PRNG key; example ``b``'s samples come from ``fold_in(key, example_id[b])``.
      n0: selection samples per example (Cohen et al.: 100).
      n: estimation samples per example (Cohen et al.: 100,000).
      alpha: the probability that a certificate is wrong (Cohen et al.: 0.001).
      batch: noisy images per call of the base classifier (memory, not results).
      example_id: ``[B]`` int the examples' ids (default ``arange(B)``): certify them in any
        batches and each gets the same samples.

    Returns:
      A :class:`Certificate` of host arrays ``[B]``.
    """
    sigma = smoothing_sigma(model)
    if sigma is None:
        raise ValueError("certify needs a smoothed model built by "
                         "jaxbundle.certify.smoothing.gaussian(apply_fn, sigma)")
    n0, n, batch = _positive_int(n0, "n0"), _positive_int(n, "n"), _positive_int(batch, "batch")
    if isinstance(alpha, bool) or not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"alpha must be a probability in (0, 1), got {alpha!r}")
    x = jnp.asarray(x)
    count = x.shape[0] if x.ndim else 0
    ids = np.arange(count) if example_id is None else np.asarray(example_id)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be float images in the base classifier's units (the noise's "
                         f"sigma is in them), got {x.dtype}")
    if x.ndim < 2 or ids.shape != (count,) or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"x must be images [B, ...] and example_id [B] integers, got x "
                         f"{x.shape} and example_id {ids.shape} {ids.dtype}")
    if count * max(n0, n) >= 2**31:
        raise ValueError(f"{count} examples x {max(n0, n)} samples exceed 2^31 samples per "
                         "call of certify: certify fewer examples at a time")
    if count == 0:
        empty = np.zeros(0)
        return Certificate(empty.astype(np.int32), empty, empty, empty.astype(np.int64),
                           empty.astype(np.int32))
    noise = model.apply_fn if sampling.is_stochastic(model) else model
    ids = jnp.asarray(ids, jnp.int32)
    votes = _counts(noise, params, x, sample_keys(key, ids, SELECTION_STREAM), n0, batch)
    selected = np.argmax(votes, axis=1).astype(np.int32)
    votes = _counts(noise, params, x, sample_keys(key, ids, ESTIMATION_STREAM), n, batch)
    hits = votes[np.arange(count), selected].astype(np.int64)
    p_lower = lower_confidence_bound(hits, n, float(alpha))
    prediction = np.where(p_lower > 0.5, selected, -1).astype(np.int32)
    return Certificate(prediction, certified_radius(p_lower, sigma), p_lower, hits, selected)


def certified_accuracy(certificate: Certificate, y: Any, eps: float) -> float:
    """The fraction of examples the smoothed classifier gets right with a certified L2 radius
    of at least ``eps`` (an abstention is never certified)."""
    y = np.asarray(y)
    if y.shape != np.shape(certificate.prediction) or y.size == 0:
        raise ValueError(f"y must be labels [B] for the certificate's {len(certificate.radius)} "
                         f"examples (B > 0), got shape {y.shape}")
    if isinstance(eps, bool) or not float(eps) >= 0:
        raise ValueError(f"eps must be a radius >= 0, got {eps!r}")
    right = (certificate.prediction == y) & (certificate.prediction >= 0)
    return float(np.mean(right & (certificate.radius >= float(eps))))
