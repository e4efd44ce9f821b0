"""What the dataset scripts share: run ``jaxbundle evaluate`` with a dataset's defaults in front
of the user's flags (a flag given again by the user wins)."""

from __future__ import annotations

import sys
from typing import Sequence

from jaxbundle.cli import main


def run(defaults: Sequence[str], argv: Sequence[str] | None = None) -> int:
    return main(["evaluate", *defaults, *(sys.argv[1:] if argv is None else argv)])
