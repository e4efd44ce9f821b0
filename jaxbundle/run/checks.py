"""Trustworthiness checks: signs that an evaluation's robust accuracy may be too high.

Computed in the same run as the evaluation and reported with it (``metrics["checks"]``: one
entry per check with whether it passed, what it saw, what a failure means and what to try; the
per-example ones also as columns of ``per_example["check_flags"]``, named by
``metrics["check_flag_names"]``).

Model checks (AutoAttack's, Croce & Hein 2020), on the first images (up to 8) of the first batch
read:

``randomness``
    The same input twice gives different outputs: the model is random at test time. A model
    declared stochastic (:func:`jaxbundle.stochastic`) is judged over many calls; it passes
    when every attack that queries it averages samples (EOT), and fails when one does not
    (its gradients or scores are single noisy draws) or when the model ignores its key.
``probabilities``
    The outputs lie in [0, 1] and sum to 1: the model returns probabilities, not logits, and
    losses computed on them saturate.
``changes_between_calls``
    The outputs on an input change after the model has seen other inputs (while two calls in a
    row agree): the model keeps state across calls (a batch-norm in training mode, a cache).
``preprocessing`` (models that declare one, :func:`jaxbundle.defended`)
    Says how the attacks differentiated the preprocessing: with BPDA (passes, naming the
    backward pass), or straight through it, where it fails when the preprocessing's own
    gradient is exactly zero on an image (a quantising step: the white-box attacks are blind).

Per-example checks, over every example:

``zero_gradients``
    The cross-entropy gradient at a correctly classified clean image is exactly zero
    (a quantising input layer, a saturated softmax): gradient attacks are blind there.
``black_box_beats_white_box``
    A black-box attack fooled an example that no white-box attack fooled: the gradients mislead.

The indicators of attack failure of Pintor et al. (NeurIPS 2022), from each white-box attack's
best candidate (``per_example["attack_step"]``) on the examples it did not fool:

``silent``
    No candidate of the attack beat the clean image's margin: the attack never moved the loss.
``unbounded_incomplete``
    A minimum-norm attack, which is not bound by eps, found no adversarial example at any
    distortion: P(D) must reach 1 as D grows, so the attack failed, not the model.
``still_improving``
    A fixed-budget white-box attack of at least 10 steps failed while its best margin was
    still rising: its last 10 % of steps brought more than 5 % of its whole rise from the clean
    image (``per_example["attack_improving"]``, :func:`jaxbundle.core.bundler.still_improving`).

With ``certify`` (:mod:`jaxbundle.certify`, :func:`add_certified`):

``certified_and_fooled``
    An example certified robust was also fooled by an attack (or is misclassified clean); in
    the complete mode the bound's own verdict counts too, before the MIP. A sound bound and a
    sound judge never allow it: it is a bug, and the check must always pass.
``bound_above_model``
    The certified bound on the smallest margin over the ball is above the model's own margin
    at the clean image, a point of the ball: the bound is not the model's.
``missed_by_attacks`` (the complete mode)
    The exact MIP found an adversarial example of the judged threat model (on 8-bit data, a
    grid image) where no attack did: the bundled figure is higher than the truth by at least
    these examples.

Two more, where the job computes what they need (:func:`add`):

``transfer_beats_white_box`` (with ``--surrogate``)
    The transfer of a surrogate's adversarial images fooled an example that no white-box attack
    on the model itself fooled: the model's own gradients mislead.
``non_monotone`` (with ``--best-effort``)
    The bisection on eps fooled an example at a radius at most eps, but the evaluation at eps
    did not: a larger eps gave a lower success, so the attacks failed at eps.

"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle.run import checkpoint, defences
from jaxbundle.core import sampling
from jaxbundle.attacks.base import Attack
from jaxbundle.core.bundler import window_start

__all__ = [
    "Check", "FLAG_NAMES", "model_checks", "zero_gradients", "example_flags", "summarise", "add",
    "white_box_success", "non_monotone", "transfer_beats_white_box", "add_certified",
]

# Per-example flags, in the order of per_example["check_flags"]'s columns.
FLAG_NAMES = ("zero_gradients", "black_box_beats_white_box", "silent", "unbounded_incomplete",
              "still_improving")


class Check(NamedTuple):
    """One check's outcome (plain Python values: it goes into report.json as it is)."""

    passed: bool
    saw: str  # what it saw, with the numbers
    means: str  # what a failure means
    advice: str  # what to try
    examples: int | None = None  # examples flagged (per-example checks)


_TEXT = {
    "randomness": (
        "the model is random at test time: one call's verdict does not hold for the next",
        "judge over many calls and average gradients over samples (EOT); report the success "
        "rate over fresh calls",
    ),
    "probabilities": (
        "the model returns probabilities: losses on them saturate and gradients vanish",
        "pass the logits (drop the final softmax) to the attacks",
    ),
    "changes_between_calls": (
        "the model keeps state across calls: results depend on what it saw before",
        "make apply_fn pure (batch-norm in inference mode, no caches)",
    ),
    "preprocessing": (
        "the attacks differentiate a preprocessing whose gradient is zero: they are blind to it",
        "rerun with --bpda (jaxbundle.with_bpda): its forward pass, the identity's (or your "
        "approx's) gradient",
    ),
    "zero_gradients": (
        "gradient attacks cannot move from these images: their failure says nothing",
        "declare the preprocessing (jaxbundle.defended) and rerun with --bpda "
        "(jaxbundle.with_bpda); or use black-box attacks (square, rays)",
    ),
    "black_box_beats_white_box": (
        "gradients mislead the white-box attacks (gradient masking)",
        "trust the black-box or bundled figure; try more restarts, other losses, --bpda "
        "(jaxbundle.with_bpda), --eot",
    ),
    "silent": (
        "the attack never raised the loss above the clean image's: it was broken, not the model",
        "check the gradients (scale, masking); try another loss or a random start",
    ),
    "unbounded_incomplete": (
        "an attack without an eps bound must fool every example at some distortion",
        "more steps or another minimum-norm attack; check for masked gradients",
    ),
    "still_improving": (
        "the attack stopped while its loss was still improving: its budget, not the model, "
        "ended it",
        "more steps (or a larger step size); compare the figure with twice the steps",
    ),
    "transfer_beats_white_box": (
        "another model's gradients fool it where its own do not (gradient masking)",
        "trust the transfer or bundled figure; try --bpda (jaxbundle.with_bpda), --eot, other "
        "losses",
    ),
    "certified_and_fooled": (
        "an example certified robust was fooled: a bound or a judgement is wrong (a bug, "
        "never the model)",
        "report it with the model and the example; trust neither figure until it is found",
    ),
    "bound_above_model": (
        "a certified bound on the smallest margin is above the model's own margin at the clean "
        "image: the bound is not the model's (a bug, or a model that is not the function "
        "certification traced, e.g. one drawing random numbers from a key it holds)",
        "report it with the model and the example; a model with randomness must be declared "
        "with jaxbundle.stochastic",
    ),
    "missed_by_attacks": (
        "the complete mode proved an adversarial example of the judged threat model exists "
        "that no attack found: the bundled figure is too high",
        "more restarts or steps, other attacks (the example ids are in exact_status)",
    ),
    "non_monotone": (
        "success fell as eps grew: the attacks at eps were stopped by the optimisation, not "
        "by the model",
        "more steps or restarts at eps; report the bisected (best-effort) figure",
    ),
}


def _check(name: str, passed: bool, saw: str, examples: int | None = None) -> Check:
    means, advice = _TEXT[name]
    return Check(bool(passed), saw, means, advice, examples)


def model_checks(apply_fn: Callable[[Any, jax.Array], jax.Array], params: Any,
                 x: np.ndarray, attacks: Sequence[Attack] = ()) -> dict[str, Check]:
    """The model-level checks on a batch of clean images ``x`` (a few forward passes; a
    stochastic model's under fixed keys, see :func:`_declared_randomness`)."""
    x = jnp.asarray(x, jnp.float32)
    fixed = sampling.fixed(apply_fn)
    call = lambda images: np.asarray(fixed(params, images), np.float64)  # noqa: E731
    call(x)  # a first call, in case the model sets itself up lazily
    first = call(x)
    again = call(x)
    call(jnp.flip(x, axis=0) * 0.5)  # other inputs in between
    after = call(x)
    random_gap = float(np.max(np.abs(first - again)))
    state_gap = float(np.max(np.abs(again - after)))
    in_unit = bool(np.all((first >= 0) & (first <= 1)))
    sums_to_one = bool(np.all(np.abs(first.sum(axis=-1) - 1.0) < 1e-4))
    if sampling.is_stochastic(apply_fn):
        other = np.asarray(sampling.fixed(apply_fn, seed=1)(params, x), np.float64)
        randomness = _declared_randomness(apply_fn, attacks, random_gap,
                                          float(np.max(np.abs(first - other))))
    else:
        randomness = _check("randomness", random_gap == 0.0,
                            f"two calls on the same images differ by up to {random_gap:.3g}")
    out = {
        "randomness": randomness,
        "probabilities": _check(
            "probabilities", not (in_unit and sums_to_one),
            f"outputs all in [0, 1]: {in_unit}; every row sums to 1: {sums_to_one}"),
        "changes_between_calls": _check(
            "changes_between_calls", random_gap > 0.0 or state_gap == 0.0,
            f"after other inputs the outputs moved by up to {state_gap:.3g} (two calls in a row:"
            f" {random_gap:.3g})"),
    }
    declared = defences.declared(apply_fn)
    if declared is not None:
        out["preprocessing"] = _preprocessing(declared, x, sampling.is_stochastic(apply_fn))
    return out


def _preprocessing(model: defences.Defended, x: jax.Array, random: bool) -> Check:
    """How the attacks differentiate a declared preprocessing: BPDA, or its own gradient (of
    the sum of its outputs, under a fixed key for a random one), zero on how many images."""
    if model.bpda:
        approx = ("the identity" if model.approx is None
                  else str(checkpoint.describe(model.approx)))
        return _check("preprocessing", True,
                      f"BPDA: the forward pass runs the preprocessing, the backward pass is "
                      f"{approx}'s; judging uses the true forward pass")
    key = (jax.random.key(0),) if random else ()
    grad = jax.vmap(jax.grad(lambda image: jnp.sum(model.preprocess(image[None], *key))))(x)
    zero = int(np.sum(np.all(np.asarray(grad).reshape(len(x), -1) == 0, axis=1)))
    return _check("preprocessing", zero == 0,
                  f"no BPDA: the attacks differentiate the preprocessing as it is; its gradient "
                  f"is exactly zero on {zero} of {len(x)} images")


def _declared_randomness(apply_fn: sampling.Stochastic, attacks: Sequence[Attack],
                         same_key_gap: float, key_gap: float) -> Check:
    """The randomness check of a model declared stochastic: it must draw its randomness from
    its key (same key, same logits; other keys, other logits), and every attack must average
    over samples (EOT > 1), or its view of the model is one noisy draw."""
    single = [a.name for a in attacks if a.eot == 1]
    saw = (f"declared stochastic, judged over {apply_fn.calls} calls per candidate (fooled in "
           f"more than {apply_fn.threshold:g} of them); other keys move the logits by up to "
           f"{key_gap:.3g}, the same key by {same_key_gap:.3g}; ")
    saw += (f"attacks without EOT: {', '.join(single)}" if single else
            "every attack averages " + ", ".join(f"{a.name} {a.eot}" for a in attacks)
            + " samples")
    passed = not single and same_key_gap == 0.0 and key_gap > 0.0
    return _check("randomness", passed, saw)


def zero_gradients(apply_fn: Callable[[Any, jax.Array], jax.Array], params: Any,
                   x: jax.Array, y: jax.Array) -> jax.Array:
    """Per example ``[B]``: whether the cross-entropy gradient at ``x`` is exactly zero
    (traceable: the evaluation computes it inside its per-batch summary)."""

    fixed = sampling.fixed(apply_fn)

    def loss(images):
        logits = fixed(params, images).astype(jnp.float32)
        return jnp.sum(-jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    grad = jax.grad(loss)(x.astype(jnp.float32))
    return jnp.all(grad.reshape(grad.shape[0], -1) == 0, axis=1)


def example_flags(per_example: dict[str, np.ndarray], attacks: Sequence[Attack]) -> np.ndarray:
    """``[n, len(FLAG_NAMES)]`` bool: each per-example check's flag (correctly classified
    examples only)."""
    correct = _correct(per_example)
    step = per_example["attack_step"]  # [n, A]
    success = per_example["attack_success"].astype(bool)
    distortion = per_example["attack_distortion"]
    n = len(correct)
    silent = np.zeros(n, bool)
    unbounded = np.zeros(n, bool)
    for k, a in enumerate(attacks):
        ran = correct & (step[:, k] >= -1)
        if a.goal == "min_norm":
            unbounded |= ran & ~np.isfinite(distortion[:, k])
        elif not a.black_box:
            silent |= ran & ~success[:, k] & (step[:, k] == -1)
    return np.stack([
        correct & per_example["zero_gradient"].astype(bool),
        correct & per_example["black_box_only"].astype(bool),
        silent, unbounded,
        # False wherever the indicator does not apply (bundler.still_improving)
        correct & per_example["attack_improving"].astype(bool).any(axis=1),
    ], axis=1)


def summarise(model: dict[str, Check], flags: np.ndarray, attacks: Sequence[Attack],
              correct: int) -> dict[str, dict]:
    """Every check as report.json holds it (``metrics["checks"]``)."""
    counts = dict(zip(FLAG_NAMES, (int(c) for c in flags.sum(axis=0))))
    white = any(not a.black_box for a in attacks)
    black = any(a.black_box for a in attacks)
    bounded_white = any(not a.black_box and a.goal != "min_norm" for a in attacks)
    unbounded = any(a.goal == "min_norm" for a in attacks)
    of = f"of {correct} correctly classified examples"
    out = dict(model)
    per_example = (  # (check, whether it applies to the bundle, what it saw)
        ("zero_gradients", True, "{n} {of} have an all-zero input gradient"),
        ("black_box_beats_white_box", white and black,
         "{n} {of} were fooled by a black-box attack and by no white-box attack"),
        ("silent", bounded_white, "on {n} {of} a white-box attack failed without ever beating "
         "the clean image's margin"),
        ("still_improving", any(window_start(a) < a.num_steps for a in attacks),
         "on {n} {of} a white-box attack failed while its margin was still rising over its "
         "last 10 % of steps"),
        ("unbounded_incomplete", unbounded,
         "a minimum-norm attack found no adversarial example for {n} {of}"),
    )
    for name, applies, saw in per_example:
        if applies:
            out[name] = _check(name, counts[name] == 0, saw.format(n=counts[name], of=of),
                               counts[name])
    return {name: check._asdict() for name, check in out.items()}


def white_box_success(per_example: dict[str, np.ndarray], attacks: Sequence[Attack]
                      ) -> np.ndarray:
    """``[n]``: fooled by at least one white-box attack of the bundle."""
    white = [k for k, a in enumerate(attacks) if not a.black_box]
    return per_example["attack_success"][:, white].astype(bool).any(axis=1)


def _correct(per_example: dict[str, np.ndarray]) -> np.ndarray:
    return per_example["clean_prediction"] == per_example["label"]


def non_monotone(per_example: dict[str, np.ndarray], bisected: np.ndarray) -> np.ndarray:
    """``[n]``: correctly classified, fooled by the bisection on eps (``bisected``: its
    distortion, ``inf`` where it found nothing within eps) and not by the evaluation at eps."""
    return _correct(per_example) & np.isfinite(bisected) & ~per_example["success"].astype(bool)


def transfer_beats_white_box(per_example: dict[str, np.ndarray], transferred: np.ndarray,
                             attacks: Sequence[Attack]) -> np.ndarray:
    """``[n]``: correctly classified, fooled by a surrogate's transfer (``transferred``) and by
    no white-box attack of the bundle."""
    return (_correct(per_example) & np.asarray(transferred, bool)
            & ~white_box_success(per_example, attacks))


def add(metrics: dict, per_example: dict[str, np.ndarray], name: str, flags: np.ndarray,
        saw: str) -> None:
    """Adds the per-example check ``name`` (flags ``[n]``) that the job computed after the
    evaluation: an entry in ``metrics["checks"]`` and a column of ``check_flags``."""
    count = int(np.sum(flags))
    metrics["checks"][name] = _check(name, count == 0, saw.format(count=count), count)._asdict()
    metrics["check_flag_names"].append(name)
    per_example["check_flags"] = np.concatenate(
        [per_example["check_flags"], np.asarray(flags, bool)[:, None]], axis=1)


def add_certified(metrics: dict, per_example: dict[str, np.ndarray]) -> None:
    """Adds the checks of a certified run (:mod:`jaxbundle.certify`): for a bound (not
    smoothing, which certifies another classifier) ``certified_and_fooled`` and
    ``bound_above_model`` (must never fire) and, with the complete mode,
    ``missed_by_attacks``."""
    from jaxbundle.certify import run as certify_run

    if "bound_margin" not in per_example:  # smoothing
        return
    add(metrics, per_example, "certified_and_fooled",
        certify_run.certified_and_fooled(per_example),
        "{count} examples were both certified robust and fooled by an attack (or misclassified "
        "clean)")
    add(metrics, per_example, "bound_above_model", certify_run.bound_above_model(per_example),
        "for {count} examples the certified bound on the margin is above the model's own margin "
        "at the clean image")
    if "exact_status" in per_example:
        add(metrics, per_example, "missed_by_attacks",
            certify_run.missed_by_attacks(per_example),
            "the complete mode found an adversarial example for {count} examples that no "
            "attack fooled")
