"""Threat-model presets: the field's standard (norm, eps) per dataset.

=======================  =====  =======  ==============================================
preset                   norm   eps      where it is standard
=======================  =====  =======  ==============================================
``mnist-linf``           linf   0.3      Madry et al. 2018; RobustBench-style MNIST
``cifar10-linf``         linf   8/255    RobustBench CIFAR-10 Linf leaderboard
``cifar10-l2``           l2     0.5      RobustBench CIFAR-10 L2 leaderboard
``cifar10-linf-amich``   linf   0.2      Amich et al.
``imagenet-linf``        linf   4/255    RobustBench ImageNet Linf leaderboard
``imagenet-linf-amich``  linf   8/255    Amich et al.
=======================  =====  =======  ==============================================

The first preset of a dataset is its default (:func:`default_preset`); flags override either
field (another norm alone selects that norm's preset of the dataset), and the report records
the preset and what was overridden.

The demo job's defaults (``jaxbundle evaluate`` with no ``--model``): :data:`DEMO_MODELS`,
certified by :data:`DEMO_CERTIFY` unless ``--certify`` says otherwise (:func:`certify_for`), on
the embedded sample's first :data:`SAMPLE_N` images unless ``--n`` says otherwise
(:func:`default_n`).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["DEMO_CERTIFY", "DEMO_MODELS", "PRESETS", "Preset", "SAMPLE_N", "certify_for",
           "default_n", "default_preset", "resolve"]

DEMO_MODELS = ("standard", "adversarial", "certified")
# The demo job's certified lower bound (docs/certify.md): tight on the certified demo model,
# a few forward passes per bound.
DEMO_CERTIFY = "crown-ibp"
SAMPLE_N = 1000  # the embedded sample's images a run takes unless told


def certify_for(certify: str | None, demo: bool) -> str | None:
    """The certification method of a run: ``certify`` as asked (``"none"``: off), or without
    one :data:`DEMO_CERTIFY` for the demo job (``demo``: no model of the user's or named) and
    none for other runs."""
    if certify == "none":
        return None
    return DEMO_CERTIFY if certify is None and demo else certify


def default_n(data_spec: str, n: int | None) -> int | None:
    """How many images of the data a run takes: ``n`` as asked, else :data:`SAMPLE_N` of the
    embedded sample (``mnist-sample...``) and all of any other data."""
    if n is not None:
        return n
    return SAMPLE_N if data_spec.startswith("mnist-sample") else None


class Preset(NamedTuple):
    name: str
    dataset: str
    norm: str
    eps: float
    reference: str


PRESETS = {
    p.name: p
    for p in (
        Preset("mnist-linf", "mnist", "linf", 0.3, "Madry et al. 2018"),
        Preset("cifar10-linf", "cifar10", "linf", 8 / 255, "RobustBench"),
        Preset("cifar10-l2", "cifar10", "l2", 0.5, "RobustBench"),
        Preset("cifar10-linf-amich", "cifar10", "linf", 0.2, "Amich et al."),
        Preset("imagenet-linf", "imagenet", "linf", 4 / 255, "RobustBench"),
        Preset("imagenet-linf-amich", "imagenet", "linf", 8 / 255, "Amich et al."),
    )
}


def default_preset(data_name: str) -> Preset | None:
    """The default preset of the dataset a source name refers to (``mnist_sample/test``,
    ``tfds:cifar10/test``, ``tfds:imagenet2012/validation``, ...), or None if none is known."""
    name = data_name.lower()
    for prefix in ("tfds:", "npz:"):
        name = name.removeprefix(prefix)
    base = name.split("/", 1)[0].split("[", 1)[0]
    for dataset in ("mnist", "cifar10", "imagenet"):
        if base == dataset or base.startswith(dataset + "_") or (
            dataset == "imagenet" and base.startswith("imagenet")
        ):
            return next(p for p in PRESETS.values() if p.dataset == dataset)
    return None


def resolve(
    data_name: str, preset: str | None, norm: str | None, eps: float | None
) -> tuple[str, float, dict]:
    """``(norm, eps, record)``: the named preset (or the data's default), with ``norm`` and
    ``eps`` overriding it where given. ``record`` is what the report keeps."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    chosen = PRESETS[preset] if preset is not None else default_preset(data_name)
    if chosen is None:
        if eps is None:
            raise ValueError(
                f"no threat-model preset is known for {data_name}; pass --eps (and --norm) or "
                f"--preset ({', '.join(PRESETS)})"
            )
        return norm or "linf", float(eps), {"preset": None}
    if norm is not None and norm != chosen.norm and eps is None:
        same = [p for p in PRESETS.values() if p.dataset == chosen.dataset and p.norm == norm]
        if not same:
            raise ValueError(
                f"no {norm} preset for {chosen.dataset}; pass --eps with --norm {norm}"
            )
        chosen = same[0]
    record = {"preset": chosen.name, "reference": chosen.reference,
              "overridden": [k for k, v in (("norm", norm), ("eps", eps)) if v is not None]}
    return norm or chosen.norm, float(chosen.eps if eps is None else eps), record
