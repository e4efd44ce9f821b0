"""The report: per-batch counts that merge like sums (``metrics``), the per-example arrays
(``outputs``), P(D) curves (``curves``), the record's schema (``schema``), and the writers of
``report.json``, ``report.md``, the terminal tables (``writers``), the figures (``plots``) and
``jaxbundle compare`` (``compare``).

The writers' API is re-exported here (``jaxbundle.report.write_report``, as before the report
became a folder), loaded when first used: the engine imports the counts, not rich or
matplotlib.
"""

import importlib
import pathlib

__all__ = ["SCHEMA_VERSION", "markdown", "print_tables", "table", "write_report"]
_MODULES = frozenset(p.stem for p in pathlib.Path(__file__).parent.glob("*.py"))


def __getattr__(name: str):
    """Whatever ``jaxbundle.report`` held as a module (``write_report``, ``check_lines``, ...):
    the writers', loaded when first asked for."""
    if name.startswith("__") or name in _MODULES:  # a submodule not imported yet: no writers
        raise AttributeError(f"module 'jaxbundle.report' has no attribute {name!r}")
    writers = importlib.import_module("jaxbundle.report.writers")
    if hasattr(writers, name):
        return getattr(writers, name)
    raise AttributeError(f"module 'jaxbundle.report' has no attribute {name!r}")
