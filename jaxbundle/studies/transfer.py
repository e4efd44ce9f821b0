"""Transfer bundling: a black-box threat model without queries.

The attacker owns surrogate models but may not query the target. For each surrogate the
attacks of a bundle craft a candidate per example (the surrogate's verified misclassify best,
white-box on the surrogate). Every candidate is then shown to every surrogate, and per example
the candidate that fools the most surrogates is chosen (ties: the first surrogate's). Only that
one image is judged on the target: one target evaluation per example, made by the evaluator.

Each surrogate's own candidate judged on the target gives a per-surrogate transfer rate, so a
report can show the many-surrogate table beside the bundled transfer figure, as with attacks.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle.core import goals as goals_lib
from jaxbundle.attacks.base import Attack
from jaxbundle.core.bundler import bundle, check_inputs
from jaxbundle.core.sampling import float32_logits, is_stochastic

__all__ = ["TransferResult", "transfer_bundle", "choose_by_votes", "transfer_figures"]

Model = tuple[Callable[[Any, jax.Array], jax.Array], Any]  # (apply_fn, params)


class TransferResult(NamedTuple):
    x: jax.Array  # [B, ...] the chosen candidate per example (the clean image if none)
    chosen: jax.Array  # int32 [B]: index of the surrogate whose candidate was chosen
    votes: jax.Array  # int32 [B]: how many surrogates the chosen candidate fools
    success: jax.Array  # bool [B]: the chosen candidate fools the target within eps
    surrogate_success: jax.Array  # bool [S, B]: each surrogate's own candidate on the target
    target_clean_correct: jax.Array  # bool [B]


def choose_by_votes(fools: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``fools[c, s, b]``: candidate ``c`` fools surrogate ``s`` on example ``b``.

    Returns per example the candidate with the most fooled surrogates (the first on ties) and
    its vote count.
    """
    votes = jnp.sum(fools, axis=1, dtype=jnp.int32)  # [C, B]
    chosen = jnp.argmax(votes, axis=0).astype(jnp.int32)
    return chosen, jnp.take_along_axis(votes, chosen[None], axis=0)[0]


def _fooled(apply_fn, params, x, y) -> jax.Array:
    return jnp.argmax(apply_fn(params, x), axis=-1) != y


def transfer_bundle(  # noqa: PLR0913 (the public call: bundle()'s keyword options)
    attacks: Sequence[Attack],
    surrogates: Sequence[Model],
    apply_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    x: jax.Array,
    y: jax.Array,
    key: jax.Array,
    *,
    eps: float,
    norm: str = "linf",
    example_id: jax.Array | None = None,
    judging: str = "auto",
) -> TransferResult:
    """Crafts candidates on ``surrogates`` with ``attacks`` and judges the voted one on the target.

    Args:
      attacks: white-box attacks run on each surrogate (as in :func:`jaxbundle.bundle`).
      surrogates: ``(apply_fn, params)`` pairs the attacker owns.
      apply_fn, params: the target model, evaluated once per example on the chosen candidate.
      x, y, key, eps, norm, example_id, judging: as in :func:`jaxbundle.bundle` (the
        surrogates' bundles judge the candidates; the chosen one is re-checked on the target).

    Returns:
      A :class:`TransferResult`.
    """
    if not surrogates:
        raise ValueError("transfer_bundle needs at least one surrogate model")
    if is_stochastic(apply_fn) or any(is_stochastic(f) for f, _ in surrogates):
        raise ValueError("transfer_bundle does not support stochastic models yet (the target "
                         "is judged by one deterministic call)")
    check_inputs(apply_fn, params, x, y, eps)
    x = jnp.asarray(x, jnp.float32)
    y = jnp.asarray(y, jnp.int32)
    candidates = []
    for s_apply, s_params in surrogates:
        r = bundle(attacks, s_apply, s_params, x, y, key, eps=eps, norm=norm,
                   example_id=example_id, judging=judging)
        candidates.append(r.best["misclassify"].x)
    cands = jnp.stack(candidates)  # [C, B, ...]
    fools = jnp.stack(
        [jnp.stack([_fooled(a, p, c, y) for a, p in surrogates]) for c in candidates]
    )  # [C, S, B]
    chosen, votes = choose_by_votes(fools)
    pick = chosen.reshape((1, -1) + (1,) * (x.ndim - 1))
    x_adv = jnp.take_along_axis(cands, pick, axis=0)[0]
    eps_b = jnp.full(y.shape, eps, jnp.float32)

    def judge(xa):
        s = goals_lib.score(xa, float32_logits(apply_fn(params, xa)), x, y, norm)
        return goals_lib.success("misclassify", s, eps_b)

    # A candidate that fools no surrogate is not submitted: the clean image is.
    x_adv = jnp.where(jnp.reshape(votes > 0, (-1,) + (1,) * (x.ndim - 1)), x_adv, x)
    return TransferResult(
        x=x_adv,
        chosen=chosen,
        votes=votes,
        success=judge(x_adv),
        surrogate_success=jnp.stack([judge(c) for c in candidates]),
        target_clean_correct=~_fooled(apply_fn, params, x, y),
    )


def transfer_figures(result: TransferResult, surrogate_names: Sequence[str]) -> dict:
    """Robust accuracy (%) of the target under the voted transfer and under each surrogate."""
    ok = np.asarray(result.target_clean_correct)
    n = ok.size
    pct = lambda v: 100.0 * float(np.sum(ok & ~np.asarray(v))) / n  # noqa: E731
    return {
        "clean_accuracy": 100.0 * ok.mean(),
        "transfer_robust_accuracy": pct(result.success),
        "per_surrogate": {name: pct(s)
                          for name, s in zip(surrogate_names, result.surrogate_success)},
    }
