"""Defences with a preprocessing: BPDA, and a model that declares its preprocessing.

A preprocessing that quantises its input (bit-depth reduction, JPEG, any ``round``) has a zero
or useless gradient: a gradient attack run straight through it is blind, and the robust
accuracy it reports says nothing about the model. **BPDA** (Backward Pass Differentiable
Approximation, Athalye, Carlini & Wagner, ICML 2018, "Obfuscated Gradients Give a False Sense
of Security") keeps the forward pass and replaces the backward pass: :func:`bpda` runs
``preprocess(x)`` forward and back-propagates through a differentiable ``approx`` instead
(the identity by default, right when ``preprocess(x) ≈ x``)::

    g = jaxbundle.bpda(preprocess, approx)
    # g(x) == preprocess(x);  vjp(g, x)(v) == vjp(approx, x)(v)

Only gradients change: every forward value, the judge's verdicts included, is the true
model's.

A model declares its preprocessing apart from its classifier with :func:`defended`, so the
same model can be attacked both ways: straight through the preprocessing (what a naive
evaluation does) and with BPDA (:func:`with_bpda`; the CLI's ``--bpda``). The declaration is
a :class:`Defended` value, callable as ``apply_fn(params, x)``; a preprocessing that draws
randomness takes a key, ``preprocess(x, key)``, and the model is declared stochastic around it
(``jaxbundle.stochastic(jaxbundle.defended(...))``): then EOT averages the BPDA gradients over
its samples. The trustworthiness check ``preprocessing`` (:mod:`jaxbundle.run.checks`) reports
which of the two an evaluation ran.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from jaxbundle.core import sampling

__all__ = ["Defended", "bpda", "declared", "defended", "with_bpda"]


def _identity(x: jax.Array, *args: Any) -> jax.Array:
    return x


def bpda(preprocess: Callable[..., jax.Array],
         approx: Callable[..., jax.Array] | None = None) -> Callable[..., jax.Array]:
    """``preprocess`` forward, ``approx`` backward (BPDA, Athalye et al. 2018).

    Args:
      preprocess: ``preprocess(x, *args) -> x'``, any JAX function (``round`` and other
        non-differentiable steps included); ``args`` (a key, settings) get no gradient.
      approx: ``approx(x, *args) -> x'``, differentiable, the same shapes as ``preprocess``;
        ``None``: the identity.

    Returns:
      ``g(x, *args)``, with ``g(x, *args) == preprocess(x, *args)`` exactly and the
      vector-Jacobian product of ``approx`` at ``x`` as its own: ``grad(lambda x: f(g(x)))(x)
      == vjp(approx, x)(grad(f)(g(x)))``.
    """
    approx = _identity if approx is None else approx

    @jax.custom_vjp
    def forward(x, *args):
        return preprocess(x, *args)

    def forward_with_residuals(x, *args):
        return preprocess(x, *args), (x, args)

    def backward(residuals, cotangent):
        x, args = residuals
        _, vjp = jax.vjp(lambda v: approx(v, *args), x)
        return (*vjp(cotangent), *(None for _ in args))  # None: no gradient for args

    forward.defvjp(forward_with_residuals, backward)
    return forward


@dataclasses.dataclass(frozen=True)
class Defended:
    """A classifier behind a declared preprocessing, attacked through it or with BPDA.

    ``model(params, x) = classifier(params, preprocess(x))`` (with a key for a random
    preprocessing: ``model(params, x, key)``, ``preprocess(x, key)``). Frozen and hashable:
    equal declarations are equal values and share compiled programs; a checkpoint describes it
    field by field (:func:`jaxbundle.run.checkpoint.describe`), so one made with ``bpda`` off is not
    resumed with it on. (A dataclass, not a ``NamedTuple``: JAX keeps weak references to the
    functions it traces, and tuples cannot have them.)

    Attributes:
      classifier: ``classifier(params, x) -> logits``.
      preprocess: ``preprocess(x) -> x`` (or ``preprocess(x, key)``), the images the
        classifier sees.
      approx: BPDA's backward pass, ``approx(x[, key])``; ``None``: the identity.
      bpda: gradients through ``approx`` (:func:`bpda`) instead of ``preprocess``'s own.
    """

    classifier: Callable[[Any, jax.Array], jax.Array]
    preprocess: Callable[..., jax.Array]
    approx: Callable[..., jax.Array] | None = None
    bpda: bool = False

    def replace(self, **changes: Any) -> "Defended":
        """The same declaration with ``changes``."""
        return dataclasses.replace(self, **changes)

    def _asdict(self) -> dict[str, Any]:
        """The fields by name, as a named tuple's (what a checkpoint's description reads)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def inputs(self, x: jax.Array, *key: jax.Array) -> jax.Array:
        """What the classifier sees: ``preprocess(x[, key])``, differentiated as declared."""
        preprocess = bpda(self.preprocess, self.approx) if self.bpda else self.preprocess
        return preprocess(x, *key)

    def __call__(self, params: Any, x: jax.Array, *key: jax.Array) -> jax.Array:
        return self.classifier(params, self.inputs(x, *key))


def defended(classifier: Callable[[Any, jax.Array], jax.Array],
             preprocess: Callable[..., jax.Array],
             approx: Callable[..., jax.Array] | None = None, *, bpda: bool = False) -> Defended:
    """Declares ``classifier`` behind ``preprocess`` (see :class:`Defended`); ``bpda`` as
    :func:`with_bpda` sets it."""
    for name, fn in (("classifier", classifier), ("preprocess", preprocess)):
        if not callable(fn):
            raise TypeError(f"{name} must be callable, got {fn!r}")
    if approx is not None and not callable(approx):
        raise TypeError(f"approx must be callable or None, got {approx!r}")
    if not isinstance(bpda, bool):
        raise TypeError(f"bpda must be a bool, got {bpda!r}")
    return Defended(classifier, preprocess, approx, bpda)


def declared(model: Any) -> Defended | None:
    """The :class:`Defended` declaration of ``model`` (itself, or inside a stochastic model),
    or ``None``."""
    inner = model.apply_fn if sampling.is_stochastic(model) else model
    return inner if isinstance(inner, Defended) else None


def with_bpda(model: Any, bpda: bool = True) -> Any:
    """``model`` (a :class:`Defended`, or a stochastic model around one) attacked with BPDA
    (``bpda=False``: straight through its preprocessing); raises ``ValueError`` for a model
    that declares no preprocessing."""
    inner = declared(model)
    if inner is None:
        raise ValueError("BPDA needs the model's preprocessing declared apart from its classifier"
                         " (jaxbundle.defended(classifier, preprocess)); this model declares none")
    inner = inner.replace(bpda=bool(bpda))
    return model._replace(apply_fn=inner) if sampling.is_stochastic(model) else inner
