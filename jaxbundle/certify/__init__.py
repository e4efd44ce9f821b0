"""Certified lower bounds beside the attacks' upper bound: robust accuracy lies in
``[certified, bundled]`` (docs/certify.md).

* :func:`margin_bounds`, :func:`logit_bounds` (:mod:`~jaxbundle.certify.bounds`): IBP,
  CROWN-IBP and CROWN through the jaxpr of any ``apply_fn(params, x)``
  (:mod:`~jaxbundle.certify.graph` reads it, :mod:`~jaxbundle.certify.ibp`,
  :mod:`~jaxbundle.certify.crown` and :mod:`~jaxbundle.certify.sets` bound it); a primitive
  it cannot bound is an :class:`UnsupportedPrimitive` error, never a silent bound.
* :mod:`~jaxbundle.certify.complete`: the exact answer for ReLU networks, a mixed-integer
  program (SciPy's HiGHS) over :mod:`~jaxbundle.certify.extract`'s
  :class:`~jaxbundle.certify.program.ReluProgram`, with a time limit per example:
  ``certified``, ``attacked`` (a verified adversarial example) or ``unknown``.
* :mod:`~jaxbundle.certify.smoothing`: randomised smoothing, Cohen et al.'s CERTIFY for a
  model declared with :func:`gaussian`.
* :mod:`~jaxbundle.certify.run`: certification inside :func:`jaxbundle.evaluate`
  (the plan's ``Certify`` record: ``plan.replace(certify=...)``, ``--certify``) and the
  report's ``certified`` record.

Every bound is a statement about the model's float32 outputs as the judge computes them
(matrix products at ``Precision.HIGHEST``, :mod:`jaxbundle.core.arithmetic`), computed at that
precision on any backend, with float32's rounding bounded in the worst case
(:mod:`~jaxbundle.certify.rounding`). SciPy's solvers and distributions load only when the
complete mode or smoothing is used.
"""

from jaxbundle.certify.bounds import METHODS, UnsupportedPrimitive, logit_bounds, margin_bounds

__all__ = ["METHODS", "UnsupportedPrimitive", "gaussian", "logit_bounds", "margin_bounds"]


def gaussian(apply_fn, sigma, *, calls=16, threshold=0.5):
    """The base classifier ``apply_fn`` under isotropic Gaussian input noise of std ``sigma``,
    a stochastic model certified by randomised smoothing
    (:func:`jaxbundle.certify.smoothing.gaussian`)."""
    from jaxbundle.certify import smoothing

    return smoothing.gaussian(apply_fn, sigma, calls=calls, threshold=threshold)
