"""Attacks by name: what ``--attacks``, ``--focus``, a bundle, the report and the per-example
arrays call them (one vocabulary: :func:`attack` gives the attack the name it was asked by).

Each name is one record (:class:`NamedAttack`, as optax's aliases are partials of its
factories): a factory of :mod:`jaxbundle.attacks` with some of its arguments fixed, the plan's
overrides it takes (``steps`` and ``restarts`` of an iterative attack, ``step_size`` of PGD,
``queries``: the model-query budget of a black-box attack), the norms it works in and its
paper. :data:`QUERY_ATTACKS` and ``jaxbundle attacks``' table are views of the records. Named
bundles of these attacks, with their schedules, are plans: :mod:`jaxbundle.bundles`.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, NamedTuple

from jaxbundle import attacks as attacks_lib
from jaxbundle.core import norms as norms_lib
from jaxbundle.attacks.base import Attack, check_count

__all__ = ["ATTACKS", "OPTIONS", "PAPERS", "QUERY_ATTACKS", "NamedAttack", "attack"]

OPTIONS = ("steps", "restarts", "step_size", "queries")  # the plan's overrides of a budget

# The paper of each factory of jaxbundle.attacks (help(jaxbundle.attacks.<factory>) says how
# this library's version differs).
PAPERS = {
    "fgsm": "Goodfellow, Shlens & Szegedy 2015, Explaining and Harnessing Adversarial Examples",
    "pgd": "Madry et al. 2018, Towards Deep Learning Models Resistant to Adversarial Attacks",
    "apgd": "Croce & Hein 2020, Reliable Evaluation of Adversarial Robustness with an Ensemble "
            "of Diverse Parameter-free Attacks (APGD-CE, APGD-DLR, APGD-T)",
    "bp": "Zhang, Avrithis, Furon & Amsaleg 2020, Walking on the Edge: Fast, Low-Distortion "
          "Adversarial Examples (stage-1 step from Pautrat et al. 2021, RoBIC)",
    "cw": "Carlini & Wagner 2017, Towards Evaluating the Robustness of Neural Networks",
    "fmn": "Pintor, Roli, Brendel & Biggio 2021, Fast Minimum-norm Adversarial Attacks through "
           "Adaptive Norm Constraints",
    "ddn": "Rony, Hafemann, Oliveira, Ben Ayed, Sabourin & Granger 2019, Decoupling Direction "
           "and Norm for Efficient Gradient-Based L2 Adversarial Attacks and Defenses",
    "deepfool": "Moosavi-Dezfooli, Fawzi & Frossard 2016, DeepFool: a simple and accurate "
                "method to fool deep neural networks",
    "fab": "Croce & Hein 2020, Minimally distorted Adversarial Examples with a Fast Adaptive "
           "Boundary Attack (FAB; FAB-T, its targeted version in AutoAttack)",
    "spsa": "Uesato, O'Donoghue, van den Oord & Kohli 2018, Adversarial Risk and the Dangers of "
            "Evaluating Against Weak Attacks",
    "square": "Andriushchenko, Croce, Flammarion & Hein 2020, Square Attack: a "
              "query-efficient black-box adversarial attack via random search",
    "rays": "Chen & Gu 2020, RayS: A Ray Searching Method for Hard-label Adversarial Attack",
    "surfree": "Maho, Furon & Le Merrer 2021, SurFree: a fast surrogate-free black-box attack",
}


class NamedAttack(NamedTuple):
    """One named attack: ``build(norm, **options)`` makes it (``options``: those of
    :attr:`options` the plan sets), in any of :attr:`norms`; :attr:`family` is its factory in
    :mod:`jaxbundle.attacks` (its paper :data:`PAPERS`)."""

    name: str
    build: Callable[..., Attack]
    options: tuple[str, ...]
    norms: tuple[str, ...]
    family: str

    @property
    def paper(self) -> str:
        return PAPERS[self.family]

    @property
    def citation(self) -> str:
        """The paper's authors and year (``Croce & Hein 2020``)."""
        return self.paper[:re.search(r"\d{4}", self.paper).end()]

    @property
    def queries(self) -> bool:
        """Whether its budget is model queries (``queries=``), not steps."""
        return "queries" in self.options

    def made(self) -> Attack:
        """The attack with its own budget in its first norm (for its kind and goal)."""
        return attack(self.name, self.norms[0])


BOTH = ("linf", "l2")


def _normless(factory: Callable[..., Attack]) -> Callable[..., Attack]:
    """A factory with no ``norm`` argument (the record says which norms it works in)."""
    return lambda norm, **kwargs: factory(**kwargs)


def _rays(norm: str, queries: int = 5000) -> Attack:
    del norm
    return attacks_lib.rays(steps=queries - 1)  # 1 query at init, 1 per step


def _cw_reference(norm: str, steps: int = 10_000) -> Attack:
    del norm  # --steps sets the per-stage maximum of the reference's abort-early search
    return attacks_lib.cw_reference(max_iterations=steps)


def _record(name: str, family: str, build: Callable[..., Attack], options: tuple[str, ...],
            norms: tuple[str, ...] = BOTH, **fixed: Any) -> NamedAttack:
    return NamedAttack(name, functools.partial(build, **fixed) if fixed else build, options,
                       norms, family)


_STEPS, _RESTARTS = ("steps",), ("steps", "restarts")
ATTACKS: dict[str, NamedAttack] = {r.name: r for r in (
    _record("fgsm", "fgsm", attacks_lib.fgsm, ()),
    *(_record(f"pgd-{loss}", "pgd", attacks_lib.pgd, (*_RESTARTS, "step_size"), loss=loss)
      for loss in ("ce", "margin", "dlr")),
    _record("apgd-ce", "apgd", attacks_lib.apgd, _RESTARTS, loss="ce"),
    # A second APGD-CE under its own name, so that a cascade can focus it (Plan.focus).
    _record("apgd-ce-long", "apgd", attacks_lib.apgd, _RESTARTS, loss="ce"),
    _record("apgd-dlr", "apgd", attacks_lib.apgd, _RESTARTS, loss="dlr"),
    *(_record(name, "apgd", attacks_lib.apgd, _STEPS, loss="dlr-targeted", targets=targets)
      for name, targets in (("apgd-t", 9), ("apgd-t3", 3), ("apgd-t5", 5))),
    # APGD-T's 5 targets in MALT's order (nearest linearised boundary of the 9 highest logits).
    _record("apgd-t5-malt", "apgd", attacks_lib.apgd, _STEPS, loss="dlr-targeted", targets=5,
            targeting="malt"),
    # BP as this library runs it (not the authors' loss and steps): a variant, named so.
    _record("bp-variant", "bp", attacks_lib.bp, _STEPS, ("l2",)),
    _record("fmn", "fmn", attacks_lib.fmn, _STEPS, ("linf", "l2", "l1")),
    # CW-L2 with 100 Adam steps per stage (a light budget) and with the reference code's
    # (up to 10,000 per stage, abort-early; --steps sets the per-stage maximum).
    _record("cw-l2-light", "cw", _normless(attacks_lib.cw), _STEPS, ("l2",)),
    _record("cw-l2", "cw", _cw_reference, _STEPS, ("l2",)),
    _record("deepfool", "deepfool", attacks_lib.deepfool, _STEPS),
    # DDN: L2 only; AttackBench ranks it first per gradient in L2 with APGD.
    _record("ddn", "ddn", _normless(attacks_lib.ddn), _STEPS, ("l2",)),
    # AutoAttack's FAB-T in the reference's order (a fresh gradient after a step back): on the
    # demo adversarial CNN at L2 1.5 it left 50.4 % against torchattacks' 49.2 %, the one-pass
    # order 51.6 % (experiments/fidelity_fab.py).
    _record("fab-t", "fab", attacks_lib.fab, _STEPS, fresh_gradient=True),
    # FAB-T with 3 target classes (AutoAttack's has 9), for a cheaper minimum-norm stage.
    _record("fab-t3", "fab", attacks_lib.fab, _STEPS, targets=3),
    _record("spsa", "spsa", attacks_lib.spsa, _STEPS, ("linf",)),
    # Black-box budgets are queries; --steps does not change them.
    _record("square", "square", attacks_lib.square, ("queries",)),
    # AutoAttack's Square: p_init 0.8 in both norms, the p schedule as written for 10,000.
    _record("square-aa", "square", attacks_lib.square, ("queries",), p_init=0.8,
            rescale_schedule=False),
    _record("rays", "rays", _rays, ("queries",), ("linf",)),
    _record("surfree", "surfree", _normless(attacks_lib.surfree), ("queries",), ("l2",)),
)}

# The attacks whose budget is model queries (``queries=``, 5,000 by default), not steps.
QUERY_ATTACKS = frozenset(name for name, r in ATTACKS.items() if r.queries)


def attack(
    name: str,
    norm: str = "linf",
    *,
    steps: int | None = None,
    restarts: int | None = None,
    step_size: float | None = None,
    queries: int | None = None,
) -> Attack:
    """Builds the attack called ``name`` (see :data:`ATTACKS`) for the threat norm ``norm``.

    Each override applies to the attacks whose record takes it (``steps``, ``restarts``:
    iterative attacks; ``step_size``: PGD; ``queries``: the black-box attacks of
    :data:`QUERY_ATTACKS`, default 5,000); the others ignore it."""
    norms_lib.check_norm(norm)
    if name not in ATTACKS:
        raise ValueError(f"unknown attack {name!r}; choose from {', '.join(ATTACKS)}")
    record = ATTACKS[name]
    if norm not in record.norms:
        raise ValueError(f"attack {name!r} works in norm {' or '.join(map(repr, record.norms))}"
                         f", not {norm!r}")
    given = dict(steps=steps, restarts=restarts, step_size=step_size, queries=queries)
    options = {k: v for k, v in given.items() if k in record.options and v is not None}
    if "queries" in options:
        check_count(name, "queries", options["queries"], minimum=2)
    built = record.build(norm, **options)
    if built.name != name:  # one vocabulary: the attack is called what it was asked for
        built = built.rename(name)
    if built.norm != norm:
        raise ValueError(f"attack {name!r} works in norm {built.norm!r}, not {norm!r}")
    return built
