"""jaxbundle: per-example bundling of adversarial attacks for JAX image classifiers.

``jaxbundle.evaluate(apply_fn, params, data, plan)`` evaluates a model under a plan
(:class:`Plan`; named bundles are plans: ``jaxbundle.bundles.default(norm, eps)``), exactly as
``jaxbundle evaluate`` does; ``jaxbundle.bundle(attacks, apply_fn, params, x, y, key, eps=...)``
is the per-batch core. Importing the package loads neither the demo models and their trainer
nor any dataset reader: they load when used (``jaxbundle.models``, ``jaxbundle.data.tfds``).

The package's layers are its folders: ``core/`` (the jit side of one batch), ``attacks/``,
``run/`` (the host side of one evaluation), ``report/``, ``studies/``, ``certify/``, ``data/``,
``models/``; at the top only what a user meets (``plan``, ``bundles``, ``suites``,
``presets``, ``evaluation``, ``job``, ``cli``). The modules' earlier import paths
(``jaxbundle.bundler``, ``jaxbundle.schedule``, ...) still import the same modules
(:data:`MOVED`).
"""

import importlib
import importlib.abc
import importlib.util
import sys

from jaxbundle.core.moved import MOVED


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a module by its earlier path: the module at its new one, the same object."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        sys.modules[module.__name__] = importlib.import_module(MOVED[module.__name__])


if not any(isinstance(f, _Moved) for f in sys.meta_path):
    sys.meta_path.insert(0, _Moved())


def __getattr__(name: str):
    if f"jaxbundle.{name}" in MOVED:  # jaxbundle.bundler without importing it first
        return importlib.import_module(f"jaxbundle.{name}")
    raise AttributeError(f"module 'jaxbundle' has no attribute {name!r}")


from jaxbundle import attacks, bundles, certify  # noqa: E402
from jaxbundle.core import goals, losses, norms  # noqa: E402
from jaxbundle.core.bundler import BestState, BundleResult, bundle  # noqa: E402
from jaxbundle.core.sampling import Stochastic, stochastic, with_eot  # noqa: E402
from jaxbundle.evaluation import Evaluation, evaluate  # noqa: E402
from jaxbundle.plan import (AttackSpec, Cascade, Certify, Full, Plan, Run, Sampling,  # noqa: E402
                            Suite, Threat)
from jaxbundle.run.defences import Defended, bpda, defended, with_bpda  # noqa: E402

__all__ = ["AttackSpec", "BestState", "BundleResult", "Cascade", "Certify", "Defended",
           "Evaluation", "Full", "Plan", "Run", "Sampling", "Stochastic", "Suite", "Threat",
           "attacks", "bpda", "bundle", "bundles", "certify", "defended", "evaluate", "goals",
           "losses", "norms", "stochastic", "with_bpda", "with_eot"]
__version__ = "0.1.0"
