"""Certificates that hold for the model as the judge computes it, whatever the backend's default
matrix precision: Jia & Rinard's (2021) float32 adversarial points at the edge of certified
balls, on CPU float32 and under an accelerator's arithmetic emulated on the CPU (TF32 on GPUs,
one bfloat16 pass on TPUs; ``emulation.py``), and the certification programs' own precision."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import emulation
import float_edges
from jaxbundle import arithmetic
from jaxbundle.certify import UnsupportedPrimitive, extract, margin_bounds
from jaxbundle.certify import graph as graphs

FRACTIONS = 2.0 ** -np.arange(2, 34)  # the exact minimum margins, relative to their scales


def _certified(problem, rounding: bool) -> np.ndarray:
    lower = margin_bounds(problem.apply_fn, problem.params, jnp.asarray(problem.x),
                          jnp.asarray(problem.y), eps=jnp.asarray(problem.eps),
                          method="crown-ibp", rounding=rounding)
    return np.min(np.asarray(lower), axis=1), np.min(np.asarray(lower), axis=1) > 0


@pytest.mark.parametrize("fmt", sorted(emulation.FORMATS))
def test_no_certified_example_has_a_float_adversarial_point(fmt):
    """Networks built so that the exact minimum margin over each ball is 2^-2 to 2^-33 of the
    margin's scale; each ball searched for a point the model, computed as the judge computes
    it, misclassifies. A model with no precision of its own is judged and certified at
    HIGHEST whatever the backend's default; one that asks for DEFAULT is judged in the
    emulated arithmetic and certified with an allowance for it. Sound: no certified example
    has such a point, and no bound is above the exact (float64) minimum. The papers'
    formulas in float32 certify examples that have one: the search finds what a proof must
    exclude."""
    with emulation.default_precision(fmt):
        for precision in (None, jax.lax.Precision.DEFAULT):
            problem = float_edges.edge_problem(0, 32, FRACTIONS, precision)
            fooled = float_edges.fooled(problem, 24)
            bound, sound = _certified(problem, rounding=True)
            _, papers = _certified(problem, rounding=False)
            assert not np.any(sound & fooled), f"{precision}: certified and fooled"
            assert np.all(bound <= problem.margin), f"{precision}: above the exact minimum"
            assert np.any(papers & fooled), f"{precision}: the search found nothing to exclude"
            if precision is None:  # the allowance leaves the larger margins certified
                assert np.all(sound[problem.relative > 1e-3])
                assert 0 < sound.sum() < papers.sum()


def test_certification_computes_at_highest_whatever_the_backend_default():
    """The bounds, the complete mode's maps and the judge's logits of a model with no
    precision of its own are the same numbers under an emulated TF32 or bfloat16 default as on
    the CPU: every certification program and verdict runs at HIGHEST (on today's defaults a
    GPU would compute them in TF32)."""
    problem = float_edges.edge_problem(1, 8, FRACTIONS)
    x, y, eps = jnp.asarray(problem.x), jnp.asarray(problem.y), jnp.asarray(problem.eps)

    def everything():
        bounds = margin_bounds(problem.apply_fn, problem.params, x, y, eps=eps,
                               method="crown-ibp")
        layers, logits_map, _ = extract._affine_maps(problem.apply_fn, problem.params,
                                                     float_edges.SHAPE)
        with arithmetic.stated():
            logits = jax.jit(problem.apply_fn)(problem.params, x)
        return [np.asarray(bounds), layers[1].terms[0][1].toarray(), logits_map.bias,
                np.asarray(logits)]

    reference = everything()
    for fmt in ("tf32", "bfloat16"):
        with emulation.default_precision(fmt):
            for want, got in zip(reference, everything()):
                np.testing.assert_array_equal(got, want, err_msg=fmt)
            plain = jax.jit(problem.apply_fn)(problem.params, x)  # the emulation is real
            assert not np.array_equal(np.asarray(plain), reference[-1])


def test_each_equation_records_the_precision_the_model_computes_it_at():
    """No precision of its own: HIGHEST (traced as the judge runs it); an explicit DEFAULT
    keeps the narrowest arithmetic any backend gives it (one bfloat16 pass), and the sums'
    lengths are the contraction's (forward) and the transpose's (backward)."""
    for precision, product in ((None, arithmetic.PRODUCT_ERROR[jax.lax.Precision.HIGHEST]),
                               (jax.lax.Precision.DEFAULT,
                                arithmetic.PRODUCT_ERROR[jax.lax.Precision.DEFAULT])):
        module = float_edges.EdgeNet(precision)
        params = jax.jit(module.init)(jax.random.key(0), jnp.zeros((1, *float_edges.SHAPE)))
        graph = graphs.trace(module.apply, params, (1, *float_edges.SHAPE))
        found = {(e.name, e.arithmetic.terms, e.arithmetic.back, e.arithmetic.product)
                 for e in graph.equations if e.arithmetic.product}
        assert found == {("conv_general_dilated", 9, 72, product),
                         ("conv_general_dilated", 72, 144, product),
                         ("dot_general", 784, 64, product), ("dot_general", 64, 2, product)}


def test_a_model_computing_in_bfloat16_is_refused_not_certified():
    """A model whose layers compute in bfloat16 has no float32 allowance to be certified
    under: one line naming the operation and its dtype, never a bound."""
    class Narrow(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, dtype=jnp.bfloat16)(x.reshape(x.shape[0], -1))

    x = jnp.full((2, 4, 4, 1), 0.5)
    params = jax.jit(Narrow().init)(jax.random.key(0), x)
    with pytest.raises(UnsupportedPrimitive, match="to bfloat16"):
        margin_bounds(Narrow().apply, params, x, jnp.zeros(2, jnp.int32), eps=0.01)
