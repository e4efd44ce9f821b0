"""Attacks: one file each, all on the protocol of :mod:`jaxbundle.attacks.base`.

Factories return an :class:`Attack`; :data:`CATALOGUE` describes every attack for
``jaxbundle attacks`` and the docs.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxbundle.attacks.base import Attack, Candidate, WhiteBoxModel, per_example_keys
from jaxbundle.attacks.decision_based.rays import rays
from jaxbundle.attacks.decision_based.surfree import surfree
from jaxbundle.attacks.score_based.spsa import spsa
from jaxbundle.attacks.score_based.square import square
from jaxbundle.attacks.white_box.apgd import apgd
from jaxbundle.attacks.white_box.bp import bp
from jaxbundle.attacks.white_box.cw import cw, cw_reference
from jaxbundle.attacks.white_box.deepfool import deepfool
from jaxbundle.attacks.white_box.fab import fab
from jaxbundle.attacks.white_box.fgsm import fgsm
from jaxbundle.attacks.white_box.fmn import fmn
from jaxbundle.attacks.white_box.pgd import pgd

__all__ = [
    "Attack",
    "Candidate",
    "WhiteBoxModel",
    "per_example_keys",
    "fgsm",
    "pgd",
    "apgd",
    "bp",
    "cw",
    "cw_reference",
    "deepfool",
    "fab",
    "fmn",
    "spsa",
    "square",
    "rays",
    "surfree",
    "AttackInfo",
    "CATALOGUE",
]


class AttackInfo(NamedTuple):
    name: str
    norms: tuple[str, ...]
    kind: str
    goal: str  # the goal its candidates are made for
    paper: str


CATALOGUE: tuple[AttackInfo, ...] = (
    AttackInfo(
        "fgsm",
        ("linf", "l2"),
        "white-box",
        "misclassify",
        "Goodfellow, Shlens & Szegedy 2015, Explaining and Harnessing Adversarial Examples",
    ),
    AttackInfo(
        "pgd",
        ("linf", "l2"),
        "white-box",
        "misclassify",
        "Madry et al. 2018, Towards Deep Learning Models Resistant to Adversarial Attacks",
    ),
    AttackInfo(
        "apgd",
        ("linf", "l2"),
        "white-box",
        "misclassify",
        "Croce & Hein 2020, Reliable Evaluation of Adversarial Robustness with an Ensemble of "
        "Diverse Parameter-free Attacks (APGD-CE, APGD-DLR, APGD-T)",
    ),
    AttackInfo(
        "bp",
        ("l2",),
        "white-box",
        "min_norm",
        "Zhang, Avrithis, Furon & Amsaleg 2020, Walking on the Edge: Fast, Low-Distortion "
        "Adversarial Examples (stage-1 step from Pautrat et al. 2021, RoBIC)",
    ),
    AttackInfo(
        "cw-l2",
        ("l2",),
        "white-box",
        "min_norm",
        "Carlini & Wagner 2017, Towards Evaluating the Robustness of Neural Networks",
    ),
    AttackInfo(
        "fmn",
        ("linf", "l2", "l1"),
        "white-box",
        "min_norm",
        "Pintor, Roli, Brendel & Biggio 2021, Fast Minimum-norm Adversarial Attacks through "
        "Adaptive Norm Constraints",
    ),
    AttackInfo(
        "deepfool",
        ("linf", "l2"),
        "white-box",
        "min_norm",
        "Moosavi-Dezfooli, Fawzi & Frossard 2016, DeepFool: a simple and accurate method to "
        "fool deep neural networks",
    ),
    AttackInfo(
        "fab",
        ("linf", "l2"),
        "white-box",
        "min_norm",
        "Croce & Hein 2020, Minimally distorted Adversarial Examples with a Fast Adaptive "
        "Boundary Attack (FAB; FAB-T, its targeted version in AutoAttack)",
    ),
    AttackInfo(
        "spsa",
        ("linf",),
        "score-based",
        "misclassify",
        "Uesato, O'Donoghue, van den Oord & Kohli 2018, Adversarial Risk and the Dangers of "
        "Evaluating Against Weak Attacks",
    ),
    AttackInfo(
        "rays",
        ("linf",),
        "decision-based",
        "min_norm",
        "Chen & Gu 2020, RayS: A Ray Searching Method for Hard-label Adversarial Attack",
    ),
    AttackInfo(
        "surfree",
        ("l2",),
        "decision-based",
        "min_norm",
        "Maho, Furon & Le Merrer 2021, SurFree: a fast surrogate-free black-box attack",
    ),
    AttackInfo(
        "square",
        ("linf", "l2"),
        "score-based",
        "misclassify",
        "Andriushchenko, Croce, Flammarion & Hein 2020, Square Attack: a query-efficient "
        "black-box adversarial attack via random search",
    ),
)
