"""Stochastic models: declared with a key, sampled per example, judged over many calls.

A model that is random at test time (input noise, random resizing, dropout left on) is declared
explicitly::

    apply_fn = jaxbundle.stochastic(lambda params, x, key: ..., calls=16, threshold=0.5)

``apply_fn(params, x, key) -> logits`` draws all its randomness from ``key``. jaxbundle calls
it on one example at a time under ``vmap`` (a batch of one image per key), so that each
example's randomness comes from its own key and results do not depend on the batch size, the
padding or the number of devices. Every call an attack or the judge makes gets a fresh key:

* attack ``a``, restart ``r``, step ``t``, call site ``c`` within the step, sample ``s``:
  ``split(fold_in(fold_in(fold_in(restart_key, MODEL_STREAM), t), c), eot)[s]``, where
  ``restart_key = fold_in(fold_in(fold_in(key, example_id), a), r)`` as for the attack's own
  randomness (``t = INIT_CALL`` in ``init``);
* the judge: ``split(fold_in(fold_in(fold_in(key, example_id), JUDGE_STREAM), 0), calls)``,
  the same keys for every candidate of an example (common random numbers), none of which an
  attack sees;
* the held-out judge, which re-judges each example's winner and its clean image once the
  winner is chosen: ``split(fold_in(fold_in(fold_in(key, example_id), HELDOUT_STREAM), 0),
  calls)``, keys neither the attacks nor the choice of the winner ever saw;
* the uncounted evaluator that scores a label-only attack's candidates and a restart's final
  iterate: one call under ``fold_in(fold_in(restart_key, EVAL_STREAM), t)``.

**EOT** (expectation over transformation) is a per-attack sample count (``Attack.eot``,
:func:`with_eot`): a white-box attack's loss, gradient and logits are means over ``eot``
samples, computed as one ``vmap`` axis, and a score-based attack's logits (a decision-based
attack's majority label) likewise; the budget counts every sample as a model pass.

**Judging** (:func:`jaxbundle.core.judge.verify`): each candidate is run through ``calls`` fresh
calls; its success rate is the fraction of them that misclassify it, the bundle keeps per
example the candidate with the best rate (margin averaged over the calls breaks ties), and the
example counts as fooled when the rate exceeds ``threshold`` (default: more than half of the
calls). Every restart's best is judged before the restarts are folded (the best on average
wins, not the luckiest draw); within a restart the attack's own, EOT-averaged view picks its
best step (judging every step would cost ``calls`` passes per step).

**Held-out calls** (:func:`jaxbundle.core.bundler.held_out`): the rate of the candidate chosen as
the best of several over the same calls is biased upward (the best of 5 candidates that each
fool 40 % of the calls fools more than half of 16 calls 54 % of the time, against 14 % for
one). So once each example's winner is chosen (every goal's, and the clean image), it is
re-judged on ``calls`` held-out calls, and the report's rates, ``success`` and robust accuracy
come from those: ``per_example["success_rate"]`` (held-out) beside
``per_example["selection_success_rate"]`` (the calls that chose it). The judge's calls, the
held-out ones included, are not counted in the budget (``gradients`` / ``queries``), as
verification never is; the report states the held-out ones per example
(``heldout_calls_per_example`` in its ``stochastic`` section).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

__all__ = [
    "Stochastic",
    "stochastic",
    "is_stochastic",
    "with_eot",
    "logits",
    "sample_logits",
    "call_keys",
    "fold_each",
    "judge_keys",
    "heldout_keys",
    "fixed",
    "MODEL_STREAM",
    "JUDGE_STREAM",
    "HELDOUT_STREAM",
    "EVAL_STREAM",
    "INIT_CALL",
]

MODEL_STREAM = 0x6D6F64  # folded into a restart's key for the model calls of its attack
JUDGE_STREAM = 0x6A7564  # folded into an example's key for the judge's calls
HELDOUT_STREAM = 0x686C64  # folded into an example's key for the held-out judge's calls
EVAL_STREAM = 0x657661  # folded into a restart's key for the uncounted evaluator's calls
INIT_CALL = 2**31 - 1  # the "step" of the model calls made in an attack's init


class Stochastic(NamedTuple):
    """A model declared random at test time (see the module docstring).

    Attributes:
      apply_fn: ``apply_fn(params, x, key) -> logits``, all randomness from ``key``.
      calls: fresh calls the judge makes on every candidate (m).
      threshold: an example counts as fooled when more than this fraction of the calls
        misclassify its candidate.
    """

    apply_fn: Callable[[Any, jax.Array, jax.Array], jax.Array]
    calls: int = 16
    threshold: float = 0.5

    def __call__(self, params: Any, x: jax.Array, key: jax.Array) -> jax.Array:
        return self.apply_fn(params, x, key)


def stochastic(
    apply_fn: Callable[[Any, jax.Array, jax.Array], jax.Array],
    *,
    calls: int = 16,
    threshold: float = 0.5,
) -> Stochastic:
    """Declares ``apply_fn(params, x, key) -> logits`` a stochastic model, judged with
    ``calls`` fresh calls per candidate and fooled above the success rate ``threshold``."""
    if isinstance(apply_fn, Stochastic):
        apply_fn = apply_fn.apply_fn
    if not callable(apply_fn):
        raise TypeError(f"a stochastic model must be callable as apply_fn(params, x, key), "
                        f"got {apply_fn!r}")
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise ValueError(f"calls must be a positive integer, got {calls!r}")
    if isinstance(threshold, bool) or not 0.0 <= float(threshold) < 1.0:
        raise ValueError(f"threshold must be a success rate in [0, 1), got {threshold!r}")
    return Stochastic(apply_fn, calls, float(threshold))


def is_stochastic(apply_fn: Any) -> bool:
    """Whether ``apply_fn`` was declared with :func:`stochastic`."""
    return isinstance(apply_fn, Stochastic)


def with_eot(attacks: Sequence[Any], eot: int) -> tuple[Any, ...]:
    """The attacks with ``eot`` model samples averaged per call (every sample a model pass)."""
    if isinstance(eot, bool) or not isinstance(eot, int) or eot < 1:
        raise ValueError(f"eot must be a positive integer, got {eot!r}")
    return tuple(a._replace(eot=eot) for a in attacks)


def float32_logits(logits: jax.Array) -> jax.Array:
    """A model's logits in float32, every margin and probability computed on them. Logits of a
    narrower float (bfloat16, float16) keep exactly the values the model returns: XLA may drop a
    round trip through the narrow type where the model's program is fused with other work (an
    attack's gradient), which left the logits up to half a unit in the last place wider than a
    plain call returns them, and a near tie then judged otherwise than the user's own call
    judges it; ``reduce_precision`` pins the rounding."""
    dtype = jnp.dtype(logits.dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize >= 4:
        return logits.astype(jnp.float32)
    info = jnp.finfo(dtype)
    wide = logits.astype(jnp.float32)
    pinned = jax.lax.reduce_precision(wide, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return jnp.where(jnp.abs(wide) < info.tiny, wide, pinned)  # subnormals: XLA flushes them


def sample_logits(apply_fn: Stochastic, params: Any, x: jax.Array, keys: jax.Array) -> jax.Array:
    """Logits ``[S, B, K]`` (float32) of images ``x`` ``[B, ...]`` under keys ``[S, B]``: each
    example alone under its own key, all as ``vmap`` axes."""
    one = lambda xi, ki: apply_fn.apply_fn(params, xi[None], ki)[0]  # noqa: E731
    samples, batch = keys.shape
    # One vmap axis over the B x S images, example-major: XLA:CPU runs this as fast as a plain
    # batch (an S-major or nested layout costs 3-5 % more per sample, benchmarks/eot_cost.py).
    out = jax.vmap(one)(jnp.repeat(x, samples, axis=0), keys.T.reshape(batch * samples))
    return float32_logits(jnp.swapaxes(out.reshape(batch, samples, *out.shape[1:]), 0, 1))


def fold_each(keys: jax.Array, data: int | jax.Array) -> jax.Array:
    """``[B]`` keys ``fold_in(keys[b], data)``: the same ``data`` folded into every example's
    key."""
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, data)


def call_keys(keys: jax.Array, call: int | jax.Array, samples: int) -> jax.Array:
    """``[S, B]`` keys for one call: ``split(fold_in(keys[b], call), samples)``."""
    folded = fold_each(keys, call)
    return jax.vmap(lambda k: jax.random.split(k, samples), out_axes=1)(folded)


def judge_keys(example_keys: jax.Array) -> jax.Array:
    """``[B]`` keys from which the judge's calls on each example are drawn."""
    return fold_each(example_keys, JUDGE_STREAM)


def heldout_keys(example_keys: jax.Array) -> jax.Array:
    """``[B]`` keys from which the held-out calls that re-judge each example's winner are drawn
    (a stream of their own: no judge or attack call uses them)."""
    return fold_each(example_keys, HELDOUT_STREAM)


def logits(apply_fn: Callable, params: Any, x: jax.Array, keys: jax.Array | None = None
           ) -> jax.Array:
    """One call's logits ``[B, K]``: ``apply_fn(params, x)``, or for a stochastic model each
    example under its key ``keys[b]`` (required)."""
    if not is_stochastic(apply_fn):
        return apply_fn(params, x)
    if keys is None:
        raise ValueError("a stochastic model needs a key per example")
    return sample_logits(apply_fn, params, x, keys[None])[0]


def fixed(apply_fn: Callable, seed: int = 0) -> Callable[[Any, jax.Array], jax.Array]:
    """``apply_fn`` as a deterministic ``(params, x) -> logits``: a stochastic model with
    example ``b`` of every call under ``fold_in(key(seed), b)`` (checks and diagnostics)."""
    if not is_stochastic(apply_fn):
        return apply_fn

    def call(params, x):
        keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
            jax.random.key(seed), jnp.arange(x.shape[0]))
        return logits(apply_fn, params, x, keys)

    return call
