"""Attacks: one file each, all on the protocol of :mod:`jaxbundle.attacks.base`.

Factories return an :class:`Attack`. The attacks by name (what a plan, ``--attacks`` and the
report call them), each a factory here with some arguments fixed, its norms and its paper:
:data:`jaxbundle.suites.ATTACKS`.
"""

from __future__ import annotations

from jaxbundle.attacks.base import Attack, Candidate, WhiteBoxModel, per_example_keys
from jaxbundle.attacks.decision_based.rays import rays
from jaxbundle.attacks.decision_based.surfree import surfree
from jaxbundle.attacks.score_based.spsa import spsa
from jaxbundle.attacks.score_based.square import square
from jaxbundle.attacks.white_box.apgd import apgd
from jaxbundle.attacks.white_box.bp import bp
from jaxbundle.attacks.white_box.cw import cw, cw_reference
from jaxbundle.attacks.white_box.ddn import ddn
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
    "ddn",
    "deepfool",
    "fab",
    "fmn",
    "spsa",
    "square",
    "rays",
    "surfree",
]
