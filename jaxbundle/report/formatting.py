"""How reports write numbers: report.json's infinities and the text form of a figure.

JSON has no infinity, so ``report.json`` writes an infinite float (e.g. D1/2 when fewer than
half the examples are ever fooled) as the string ``"inf"`` (or ``"-inf"``); readers turn it
back with :func:`decode_infinities`. NaN never stands for a number in a report. Every table
(``report.md``, the terminal summary, ``jaxbundle compare``) formats figures with
:func:`number`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["STRING_KEYS", "decode_infinities", "encode_infinities", "number", "to_float"]

# Values that are names, never numbers (a model or attack called "inf" stays a string).
STRING_KEYS = frozenset({"wat_attack", "norm", "per_example", "goals", "figures"})


def encode_infinities(value: Any) -> Any:
    """``value`` (nested dicts, lists, tuples) with each infinite float as ``"inf"``/``"-inf"``."""
    if isinstance(value, dict):
        return {k: encode_infinities(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_infinities(v) for v in value]
    if isinstance(value, (float, np.floating)) and np.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def decode_infinities(value: Any, key: str | None = None) -> Any:
    """The inverse of :func:`encode_infinities` on what ``json.load`` returns; the values of
    :data:`STRING_KEYS` are names and stay strings."""
    if key in STRING_KEYS:
        return value
    if isinstance(value, dict):
        return {k: decode_infinities(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_infinities(v) for v in value]
    if value == "inf":
        return math.inf
    if value == "-inf":
        return -math.inf
    return value


def to_float(value: Any) -> float | None:
    """A figure as a float, for tables and plots: ``None`` (not measured), NaN and strings
    that are not numbers become ``None``; ``"inf"``/``"-inf"`` become infinities."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(decode_infinities(value))
        except ValueError:
            return None
    value = float(value)
    return None if math.isnan(value) else value


def number(value: Any, spec: str = ".2f") -> str:
    """A figure as text: ``"n/a"`` for None, ``"inf"``/``"-inf"``, a float by ``spec``
    (percentages: the default two decimals), anything else as ``str``."""
    if value is None:
        return "n/a"
    if isinstance(value, (float, np.floating)):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return format(float(value), spec)
    return str(value)
