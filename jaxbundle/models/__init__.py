"""Models: the demo classifiers, their training and weight cache, and loading a user's model.

* :mod:`~jaxbundle.models.layers`: :class:`Conv`, a 'SAME' convolution fast to differentiate on CPU,
  and :func:`canonical_convolutions`, the same for any model's convolutions.
* :mod:`~jaxbundle.models.config`: :class:`TrainConfig`, what determines a trained model.
* :mod:`~jaxbundle.models.architectures`: :class:`SmallCNN`, :class:`MLP`, :func:`model_for`.
* :mod:`~jaxbundle.models.training`: :func:`train` (standard, PGD
  adversarial or verified), :func:`pgd_linf`, :func:`accuracy`.
* :mod:`~jaxbundle.models.certified`: the verified (IBP, CROWN-IBP) training loss and schedules.
* :mod:`~jaxbundle.models.cache`: :func:`load_or_train` and the demo models :data:`MODELS`.
* :mod:`~jaxbundle.models.randomized`: :func:`randomized`, a randomised defence (input noise
  and a random shift) around any model.
* :mod:`~jaxbundle.models.quantized`: :func:`quantized`, bit-depth reduction and JPEG-like
  compression (gradients broken by design, for BPDA) around any model.
* :data:`DEFENCES`: the demo defences by name (``--models randomized``, ``quantized``), each
  a demo model behind one of these.
* :mod:`~jaxbundle.models.loading`: a user's model from ``MODULE:FUNCTION`` (:func:`load_model`)
  and a sanity check of its logits (:func:`check_model`).

Evaluation code only needs ``apply_fn(params, x) -> logits``::

    from jaxbundle import models

    apply_fn, params = models.load_or_train(models.ADVERSARIAL)
    logits = apply_fn(params, x)  # x: float32 [B, 28, 28, 1] in [0, 1]
"""

from jaxbundle.models.architectures import (
    ARCHITECTURES,
    MLP,
    LinenCNN,
    SmallCNN,
    model_for,
    model_name,
)
from jaxbundle.models.config import TrainConfig
from jaxbundle.models.cache import (
    CODE_VERSION,
    MODELS,
    SHIPPED,
    cache_path,
    config_hash,
    default_cache_dir,
    load_or_train,
    ship,
)
from jaxbundle.models.layers import CanonicalConvolutions, Conv, canonical_convolutions, conv_same
from jaxbundle.models.loading import LoadedModel, ModelSpec, check_model, load_model, parse_spec
from jaxbundle.models.quantized import DEFENCES as _QUANTIZED
from jaxbundle.models.quantized import Quantized, quantized
from jaxbundle.models.randomized import DEFENCES as _RANDOMIZED
from jaxbundle.models.randomized import Defence, randomized
from jaxbundle.models.training import (
    ADVERSARIAL,
    ADVERSARIAL_LINEN,
    CERTIFIED,
    STANDARD,
    accuracy,
    pgd_linf,
    train,
)

# Not public, but used as models.<name> (types; tests and benchmarks).
from jaxbundle.models.architectures import ApplyFn, Params  # noqa: F401
from jaxbundle.models.cache import _atomic_write  # noqa: F401
from jaxbundle.models.layers import _conv_forward  # noqa: F401

# The demo defences by name: each has ``base`` (a name of MODELS) and ``wrap(apply_fn)``.
DEFENCES: dict[str, Defence | Quantized] = {**_RANDOMIZED, **_QUANTIZED}

__all__ = [
    "CODE_VERSION",
    "Conv",
    "CanonicalConvolutions",
    "canonical_convolutions",
    "conv_same",
    "SmallCNN",
    "LinenCNN",
    "MLP",
    "ARCHITECTURES",
    "TrainConfig",
    "STANDARD",
    "ADVERSARIAL",
    "ADVERSARIAL_LINEN",
    "CERTIFIED",
    "MODELS",
    "SHIPPED",
    "ship",
    "DEFENCES",
    "Defence",
    "Quantized",
    "randomized",
    "quantized",
    "model_for",
    "model_name",
    "config_hash",
    "cache_path",
    "default_cache_dir",
    "train",
    "load_or_train",
    "accuracy",
    "pgd_linf",
    "ModelSpec",
    "LoadedModel",
    "parse_spec",
    "load_model",
    "check_model",
]
