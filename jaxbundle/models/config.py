"""The record of a demo model's training (:class:`TrainConfig`), shared by the architectures,
the training and the weight cache."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["TrainConfig"]


class TrainConfig(NamedTuple):
    """Everything that determines a trained model (and hence its cache key).

    Attributes:
      arch: architecture name, a key of :data:`~jaxbundle.models.architectures.ARCHITECTURES`.
      num_classes: number of classes (output logits).
      adversarial: train on PGD adversarial examples (Madry et al. 2018) instead of clean ones.
      epochs: passes over the training images.
      batch_size: examples per optimizer step (the last partial batch of an epoch is dropped;
        the data are reshuffled every epoch).
      learning_rate: Adam learning rate (peak value of the schedule).
      seed: seed for initialisation, shuffling and PGD random starts.
      n_train: how many of the training images to use (the first ``n_train``), ``None`` for all.
      eps: Linf radius of the training-time attack.
      pgd_steps: PGD iterations per training batch (each starts from a uniform random point
        in the eps ball).
      pgd_step_size: PGD step size at full eps; during the warm-up it is scaled with eps.
      eps_warmup: fraction of the training steps over which eps (and the step size) ramp
        linearly from 0 to their final values.
      clean_fraction: fraction of each adversarial batch left unperturbed.
      cosine_decay: decay the learning rate to 0 with a cosine schedule (else constant).
      certified: verified training against sound bounds over the eps ball instead of natural
        or PGD training: ``"ibp"`` (Gowal et al. 2018) or ``"crown-ibp"`` (Zhang et al. 2020),
        ``None`` for none (see :mod:`jaxbundle.models.certified`). The eps ramp is
        ``eps_warmup``'s; the weights start from the IBP initialisation (Shi et al. 2021).
      kappa_start: weight of the natural cross-entropy against the verified one at the start
        of verified training; it moves linearly to ``kappa_end`` over the eps ramp.
      kappa_end: that weight from the end of the eps ramp on.
    """

    arch: str = "small_cnn"
    num_classes: int = 10
    adversarial: bool = False
    epochs: int = 8
    batch_size: int = 128
    learning_rate: float = 5e-3
    seed: int = 0
    n_train: int | None = None
    eps: float = 0.3
    pgd_steps: int = 2
    pgd_step_size: float = 0.2
    eps_warmup: float = 0.3
    clean_fraction: float = 0.0
    cosine_decay: bool = True
    certified: str | None = None
    kappa_start: float = 1.0
    kappa_end: float = 0.5
