"""Writing an experiment's results (the scripts run as ``python experiments/<name>.py``, so
Python puts ``experiments/`` on ``sys.path`` and ``import _results`` needs no path set-up)."""

from __future__ import annotations

import json
import pathlib
from typing import Any


def write_results(path: pathlib.Path, results: Any, end: str = "") -> None:
    """Writes ``results`` as indented JSON (then ``end``) to ``path``, its folder made if need
    be, and says where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + end)
    print(f"wrote {path}")
