"""The attack protocol: a pair of pure functions over a per-example state.

An attack is an :class:`Attack`: a name, its static configuration, and two pure functions

``init(config, keys, x0, y, eps, model, restart) -> state``
    ``keys`` holds one PRNG key per example (``[B]``), ``x0`` the clean images ``[B, ...]``,
    ``y`` the labels ``[B]``, ``eps`` the radius per example ``[B]``; ``restart`` is the
    restart index (an int32 scalar, traced: the restart axis is a vmap axis), which an attack
    may use for more than its key, e.g. APGD-T's target class rank. ``state`` is a
    ``NamedTuple`` of arrays with a leading batch axis; it must have a field ``x``: the current
    iterate, inside the input box and (for fixed-budget attacks) inside the eps ball.

``step(config, state, model) -> (state, candidate)``
    One iteration. ``candidate`` is a :class:`Candidate`: an image and the logits the model gave
    it, which the step computed anyway (for a gradient attack, the point where the gradient was
    taken). The bundler scores candidates without another forward pass; after the last step it
    evaluates ``state.x`` once more.

Both are jit-able and vmap-able, loop over nothing in Python, and sync nothing with the host.
Restarts are a ``vmap`` axis and steps a ``lax.scan`` in the bundler, never inside the attack.
Configuration is a hashable ``NamedTuple`` so that an :class:`Attack` built twice with the same
arguments compares equal and reuses the compiled program.

``model`` is what the threat model lets the attack see, chosen by the bundler from
``Attack.kind`` (each also carries ``grid``: which examples are judged on the 8-bit grid):
white-box attacks get a :class:`WhiteBoxModel` (logits and gradients),
score-based attacks a :class:`ScoreOracle` (``logits(x)``, no gradients), decision-based
attacks a :class:`LabelOracle` (``label(x)`` only). Oracles hold the model in a closure and
expose nothing else. Every oracle call on a batch is one query per example; an attack declares
its exact query count (``init_queries`` + ``queries_per_step`` per step), which is a hard
budget because the program is static. A decision-based attack cannot see logits, so its
candidates carry ``logits=None`` and the bundler (the evaluator, not the attacker) computes
them for scoring.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle.core import arithmetic, sampling
from jaxbundle.core.sampling import is_stochastic

__all__ = [
    "KINDS",
    "Candidate",
    "WhiteBoxModel",
    "ScoreOracle",
    "LabelOracle",
    "check_kind",
    "threat_model",
    "Attack",
    "InitFn",
    "StepFn",
    "per_example_keys",
    "query_attack",
    "white_box_attack",
]

KINDS = ("white-box", "score-based", "decision-based")


class Candidate(NamedTuple):
    """An adversarial candidate and the model's logits on it."""

    x: jax.Array  # [B, ...] image in the input box
    logits: jax.Array | None  # [B, K]; None when the attack saw labels only


class _Oracle:
    """A black-box view of the model: ``_answer`` of the images and nothing else (the model
    stays in a closure), plus ``grid`` (see :class:`WhiteBoxModel`): how each example will be
    judged. A stochastic model answers with its samples combined (see :class:`WhiteBoxModel`)."""

    __slots__ = ("_fn", "grid")

    def __init__(
        self,
        apply_fn: Callable[[Any, jax.Array], jax.Array],
        params: Any,
        grid: jax.Array | None = None,
        keys: jax.Array | None = None,
        samples: int = 1,
    ):
        answer = type(self)._answer
        model = WhiteBoxModel(apply_fn, params, grid, keys, samples)
        self._fn = lambda x: answer(model.sample_logits(jax.lax.stop_gradient(x)))
        self.grid = grid

    @staticmethod
    def _answer(samples: jax.Array) -> jax.Array:
        raise NotImplementedError


class ScoreOracle(_Oracle):
    """What a score-based attacker sees: the logits of a batch, without gradients (a
    stochastic model's: the mean over its samples)."""

    __slots__ = ()

    @staticmethod
    def _answer(samples: jax.Array) -> jax.Array:
        return jax.lax.stop_gradient(jnp.mean(samples, axis=0))

    def logits(self, x: jax.Array) -> jax.Array:
        """Logits ``[B, K]`` for images ``[B, ...]``; one query per example and sample."""
        return self._fn(x)


class LabelOracle(_Oracle):
    """What a decision-based attacker sees: the predicted label of each image (a stochastic
    model's: the most frequent over its samples, the smaller label on a tie)."""

    __slots__ = ()

    @staticmethod
    def _answer(samples: jax.Array) -> jax.Array:
        labels = jnp.argmax(jax.lax.stop_gradient(samples), axis=-1)
        if samples.shape[0] == 1:
            return labels[0].astype(jnp.int32)
        votes = jnp.sum(jax.nn.one_hot(labels, samples.shape[-1], dtype=jnp.int32), axis=0)
        return jnp.argmax(votes, axis=-1).astype(jnp.int32)

    def label(self, x: jax.Array) -> jax.Array:
        """Predicted labels ``[B]`` (int32) for images ``[B, ...]``; one query per example and
        sample."""
        return self._fn(x)


def check_count(attack: str, label: str, value: Any, minimum: int = 1) -> int:
    """Returns ``value`` as an ``int`` if it is an integer (not a bool) ``>= minimum``, else
    raises ``ValueError`` naming the attack and the argument: every factory checks its counts
    (steps, restarts, queries, ...) here, so ``2.5`` and ``True`` are refused alike."""
    integral = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not integral or value < minimum:
        raise ValueError(f"{attack} needs {label} to be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_kind(kind: str) -> str:
    """Returns ``kind`` if it is one of :data:`KINDS`, else raises ``ValueError``."""
    if kind not in KINDS:
        raise ValueError(f"unknown attack kind {kind!r}; expected one of {KINDS}")
    return kind


def threat_model(
    kind: str,
    apply_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    grid: jax.Array | None = None,
    keys: jax.Array | None = None,
    samples: int = 1,
):
    """The model object an attack of ``kind`` receives, with the judging mask ``grid`` (and,
    for a stochastic model, the per-example ``keys`` of this step and the EOT ``samples``); an
    unknown kind is an error (a typo must never hand gradients to a black-box attack)."""
    check_kind(kind)
    if kind == "score-based":
        return ScoreOracle(apply_fn, params, grid, keys, samples)
    if kind == "decision-based":
        return LabelOracle(apply_fn, params, grid, keys, samples)
    return WhiteBoxModel(apply_fn, params, grid, keys, samples)


class WhiteBoxModel:
    """Full access to a differentiable classifier: ``apply_fn(params, x) -> logits``.

    Built inside the bundler's jitted function, so ``params`` are traced jit arguments.

    ``grid`` (``[B]`` bool, or ``None``: wherever the clean image is on the grid) tells the
    attacker which examples the bundle judges on the 8-bit grid, so that an attack searching
    on the grid does so exactly where it matters (:func:`jaxbundle.core.norms.snap_to_grid`).

    A stochastic model (:func:`jaxbundle.stochastic`) also needs ``keys`` (``[B]``: this
    step's key per example) and averages ``samples`` calls (EOT) in every answer, as one
    ``vmap`` axis: the logits are the mean logits, :meth:`loss_and_grad` the mean loss and its
    gradient. Each call site draws fresh keys, ``fold_in(keys, n)`` for the ``n``-th call made
    on this object while tracing (``fresh=False``: the same keys every call, as the judge
    wants: every candidate of an example under the same calls).
    """

    __slots__ = ("apply_fn", "params", "grid", "keys", "samples", "fresh", "_calls")

    def __init__(
        self,
        apply_fn: Callable[[Any, jax.Array], jax.Array],
        params: Any,
        grid: jax.Array | None = None,
        keys: jax.Array | None = None,
        samples: int = 1,
        fresh: bool = True,
    ):
        self.apply_fn = apply_fn
        self.params = params
        self.grid = grid
        self.keys = keys
        self.samples = samples
        self.fresh = fresh
        self._calls = 0

    def replace(self, **changes: Any) -> "WhiteBoxModel":
        """A copy with the given fields (``apply_fn``, ``params``, ...) changed."""
        fields = {k: getattr(self, k) for k in self.__slots__ if not k.startswith("_")}
        return WhiteBoxModel(**{**fields, **changes})

    _replace = replace  # as the named tuple it once was

    @property
    def stochastic(self) -> bool:
        return is_stochastic(self.apply_fn)

    def sample_logits(self, x: jax.Array) -> jax.Array:
        """Logits ``[S, B, K]`` (float32) of ``samples`` calls (``S = 1`` for a deterministic
        model)."""
        if not self.stochastic:
            return self.logits(x)[None]
        if self.keys is None:
            raise ValueError("a stochastic model needs per-example keys")
        call = self._calls if self.fresh else 0
        self._calls += 1
        keys = sampling.call_keys(self.keys, call, self.samples)
        with arithmetic.searching():  # a verdict's stated() wins: it is set already
            return sampling.sample_logits(self.apply_fn, self.params, x, keys)

    def logits(self, x: jax.Array) -> jax.Array:
        """Logits ``[B, K]`` for images ``[B, ...]`` (in float32; a stochastic model's: the mean
        over its samples)."""
        if not self.stochastic:
            with arithmetic.searching():  # a verdict's stated() wins: it is set already
                return sampling.float32_logits(self.apply_fn(self.params, x))
        return jnp.mean(self.sample_logits(x), axis=0)

    def loss_and_grad(
        self, loss_fn: Callable[..., jax.Array], x: jax.Array, *args: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Per-example loss ``[B]``, its gradient w.r.t. ``x`` ``[B, ...]``, and the logits.

        ``loss_fn(logits, *args) -> [B]``. Examples are independent, so the gradient of the
        summed loss is the per-example gradient; one forward and one backward pass in all (a
        stochastic model: per sample, the loss, gradient and logits averaged over them).
        """

        def total(x_):
            if self.stochastic:
                samples = self.sample_logits(x_)
                per_example = jnp.mean(jax.vmap(lambda z: loss_fn(z, *args))(samples), axis=0)
                logits = jnp.mean(samples, axis=0)
            else:
                logits = self.logits(x_)
                per_example = loss_fn(logits, *args)
            return jnp.sum(per_example), (per_example, logits)

        grad, (loss, logits) = jax.grad(total, has_aux=True)(x)
        return loss, grad, logits


class InitFn(Protocol):
    """``init``; an attack with a ``setup`` also takes its result as ``setup=``."""

    def __call__(
        self,
        config: Any,
        keys: jax.Array,
        x0: jax.Array,
        y: jax.Array,
        eps: jax.Array,
        model: Any,
        restart: jax.Array,
    ) -> Any: ...


class StepFn(Protocol):
    def __call__(self, config: Any, state: Any, model: Any) -> tuple[Any, Candidate]: ...


class Attack(NamedTuple):
    """One attack, ready to bundle. Built by a factory such as :func:`jaxbundle.attacks.pgd`.

    Attributes:
      name: unique name in a bundle, e.g. ``"pgd-ce"``; used in reports.
      kind: one of :data:`KINDS`.
      norm: the norm of the eps ball the attack stays in (``"linf"``, ``"l2"``, ``"l1"``).
      num_steps: scan length (iterations after ``init``).
      num_restarts: independent runs from different random keys (a vmap axis).
      gradients_per_step: gradient evaluations one step spends on one example.
      init, step: the pure functions described in the module docstring.
      config: the static, hashable hyper-parameters passed to ``init`` and ``step``.
      init_queries, queries_per_step: model queries (oracle calls per example) of ``init``
        and of one step, for black-box attacks; 0 for white-box ones.
      goal: the goal its candidates are made for: ``"misclassify"`` for fixed-budget attacks,
        whose iterates stay inside the eps ball, or ``"min_norm"`` for minimum-norm attacks,
        which ignore eps and look for the smallest adversarial perturbation (the bundler then
        tracks the min-norm goal too; their candidates within eps also count for misclassify).
      eot: model samples averaged per model call against a stochastic model (expectation over
        transformation, see :mod:`jaxbundle.core.sampling`); each counts as a gradient or query.
      setup: per-example work every restart shares, or None: ``setup(config, x0, y, eps,
        model) -> pytree``, computed once per run of the attack, outside the restart axis
        (the bundler's :class:`~jaxbundle.core.bundler.Driver`), and handed to every
        restart's ``init`` as ``setup=`` (APGD-T's MALT target order).
      setup_gradients: the gradient evaluations ``setup`` spends on one example (once, not
        per restart).
    """

    name: str
    kind: str
    norm: str
    num_steps: int
    num_restarts: int
    gradients_per_step: int
    init: InitFn
    step: StepFn
    config: Any
    goal: str = "misclassify"
    init_queries: int = 0
    queries_per_step: int = 0
    eot: int = 1
    setup: Callable[..., Any] | None = None
    setup_gradients: int = 0

    @property
    def gradients(self) -> int:
        """Gradient evaluations the attack spends on one example, all restarts and EOT samples
        included."""
        return self.steps_gradients(self.num_steps)

    @property
    def queries(self) -> int:
        """Model queries the attack spends on one example, all restarts and EOT samples
        included."""
        return self.steps_queries(self.num_steps)

    def steps_gradients(self, steps: Any) -> Any:
        """Gradient evaluations of ``setup`` and ``steps`` steps on one example (all restarts
        and samples)."""
        return self.eot * (self.setup_gradients
                           + self.num_restarts * self.gradients_per_step * steps)

    def steps_queries(self, steps: Any) -> Any:
        """Model queries of ``init`` and ``steps`` steps on one example (restarts, samples)."""
        return self.num_restarts * self.eot * (self.init_queries + self.queries_per_step * steps)

    @property
    def black_box(self) -> bool:
        return self.kind in ("score-based", "decision-based")

    def rename(self, name: str) -> "Attack":
        """The same attack under another name (names must be unique within a bundle)."""
        return self._replace(name=name)


def white_box_attack(name: str, norm: str, steps: int, init: InitFn, step: StepFn, config: Any,
                     *, restarts: int = 1, gradients_per_step: int = 1,
                     goal: str = "misclassify") -> Attack:
    """A white-box :class:`Attack`: ``gradients_per_step`` gradients per step, example and
    restart, and no queries counted (what every white-box factory returns)."""
    return Attack(
        name=name, kind="white-box", norm=norm, num_steps=steps, num_restarts=restarts,
        gradients_per_step=gradients_per_step, init=init, step=step, config=config, goal=goal,
    )


def query_attack(kind: str, name: str, norm: str, steps: int, init: InitFn, step: StepFn,
                 config: Any, *, init_queries: int, queries_per_step: int, restarts: int = 1,
                 goal: str = "misclassify") -> Attack:
    """A black-box :class:`Attack` of ``kind`` ``"score-based"`` or ``"decision-based"``: no
    gradients, ``init_queries`` model queries in init and ``queries_per_step`` in each step per
    example and restart (what every black-box factory returns)."""
    return Attack(
        name=name, kind=kind, norm=norm, num_steps=steps, num_restarts=restarts,
        gradients_per_step=0, init=init, step=step, config=config, goal=goal,
        init_queries=init_queries, queries_per_step=queries_per_step,
    )


def per_example_keys(key: jax.Array, example_id: jax.Array) -> jax.Array:
    """One key per example, ``fold_in(key, example_id)``: independent of batching and padding."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, example_id)
