"""jaxbundle: per-example bundling of adversarial attacks for JAX image classifiers."""

from jaxbundle import attacks, goals, losses, norms
from jaxbundle.bundler import BestState, BundleResult, bundle
from jaxbundle.sampling import Stochastic, stochastic, with_eot

__all__ = ["attacks", "goals", "losses", "norms", "bundle", "BestState", "BundleResult",
           "Stochastic", "stochastic", "with_eot"]
__version__ = "0.1.0"
