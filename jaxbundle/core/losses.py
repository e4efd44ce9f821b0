"""Attack objectives on logits, one value per example.

Convention: every function returns a ``[B]`` array that the *attacker maximises*; a higher
value is more adversarial. ``logits`` has shape ``[B, K]`` and labels/targets ``[B]`` (int).
Nothing here holds state or knows the number of classes in advance.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

__all__ = [
    "LOSSES",
    "get",
    "cross_entropy",
    "margin",
    "dlr",
    "targeted_cross_entropy",
    "targeted_margin",
    "targeted_dlr",
    "other_class_max",
    "wrong_class_confidence",
]

_BIG = 1e9


def _true_logit(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.take_along_axis(logits, labels[:, None].astype(jnp.int32), axis=1)[:, 0]


def other_class_max(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Largest logit among the classes other than ``labels``: ``max_{j != y} z_j``."""
    hide = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype) * _BIG
    return jnp.max(logits - hide, axis=-1)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Softmax cross-entropy ``-log p_y`` (untargeted: maximise)."""
    return jax.nn.logsumexp(logits, axis=-1) - _true_logit(logits, labels)


def margin(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Carlini-Wagner margin ``max_{j != y} z_j - z_y``; positive exactly when misclassified."""
    return other_class_max(logits, labels) - _true_logit(logits, labels)


def dlr(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Difference of Logits Ratio (Croce & Hein 2020), negated so that the attacker maximises.

    ``DLR = -(z_y - max_{j != y} z_j) / (z_pi1 - z_pi3)`` with ``z_pi`` the logits sorted in
    decreasing order. It is invariant to shifting and rescaling the logits. Needs >= 3 classes.
    """
    top = -jnp.sort(-logits, axis=-1)
    return margin(logits, labels) / (top[:, 0] - top[:, 2] + 1e-12)


def targeted_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``log p_t``: maximised when the model predicts the target class."""
    return -cross_entropy(logits, targets)


def targeted_margin(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``z_t - max_{j != t} z_j``; positive exactly when the prediction is the target."""
    return -margin(logits, targets)


def targeted_dlr(logits: jax.Array, labels: jax.Array, targets: jax.Array) -> jax.Array:
    """Targeted DLR (Croce & Hein 2020): ``-(z_y - z_t) / (z_pi1 - (z_pi3 + z_pi4) / 2)``.

    Needs >= 4 classes.
    """
    top = -jnp.sort(-logits, axis=-1)
    gap = _true_logit(logits, labels) - _true_logit(logits, targets)
    return -gap / (top[:, 0] - 0.5 * (top[:, 2] + top[:, 3]) + 1e-12)


def wrong_class_confidence(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Highest softmax probability given to a class other than ``labels``."""
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return jnp.exp(other_class_max(log_probs, labels))


LOSSES: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "ce": cross_entropy,
    "margin": margin,
    "dlr": dlr,
}


def get(name: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """Looks up an untargeted loss by name (``"ce"``, ``"margin"``, ``"dlr"``)."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; expected one of {sorted(LOSSES)}") from None
