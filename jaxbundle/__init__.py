"""jaxbundle: per-example bundling of adversarial attacks for JAX image classifiers.

``jaxbundle.evaluate(apply_fn, params, data, plan)`` evaluates a model under a plan
(:class:`Plan`; named bundles are plans: ``jaxbundle.bundles.default(norm, eps)``), exactly as
``jaxbundle evaluate`` does; ``jaxbundle.bundle(attacks, apply_fn, params, x, y, key, eps=...)``
is the per-batch core. Importing the package loads neither the demo models and their trainer
nor any dataset reader: they load when used (``jaxbundle.models``, ``jaxbundle.data.tfds``).
"""

from jaxbundle import attacks, bundles, certify, goals, losses, norms
from jaxbundle.bundler import BestState, BundleResult, bundle
from jaxbundle.defences import Defended, bpda, defended, with_bpda
from jaxbundle.evaluation import Evaluation, evaluate
from jaxbundle.plan import AttackSpec, Plan
from jaxbundle.sampling import Stochastic, stochastic, with_eot

__all__ = ["AttackSpec", "BestState", "BundleResult", "Defended", "Evaluation", "Plan",
           "Stochastic", "attacks", "bpda", "bundle", "bundles", "certify", "defended",
           "evaluate", "goals", "losses", "norms", "stochastic", "with_bpda", "with_eot"]
__version__ = "0.1.0"
