"""Where each module that sat at the top of the package before its layer folders lives now.

The earlier paths still import the same modules (the package root's finder, ``jaxbundle.MOVED``),
and a run's identity names functions by them (:func:`earlier`, :mod:`jaxbundle.run.checkpoint`),
so that a checkpoint written before the move still resumes.
"""

__all__ = ["MOVED", "earlier"]

MOVED = {
    **{f"jaxbundle.{m}": f"jaxbundle.core.{m}" for m in (
        "arithmetic", "bundler", "canonical", "goals", "judge", "losses", "norms", "sampling",
        "validation")},
    **{f"jaxbundle.{m}": f"jaxbundle.run.{m}" for m in (
        "adapters", "checkpoint", "checks", "defences", "files", "memory", "runners")},
    "jaxbundle.schedule": "jaxbundle.run.cascade",
    **{f"jaxbundle.{m}": f"jaxbundle.report.{m}" for m in (
        "compare", "curves", "formatting", "metrics", "outputs", "plots", "schema")},
    **{f"jaxbundle.{m}": f"jaxbundle.studies.{m}" for m in (
        "best_effort", "shifts", "transfer")},
}

# The earlier path of each module that moved; report.py's functions live in report/writers.py.
_EARLIER = {**{new: old for old, new in MOVED.items()},
            "jaxbundle.report.writers": "jaxbundle.report"}


def earlier(module: str) -> str:
    """``module``'s path before the layer folders (itself if it did not move)."""
    return _EARLIER.get(module, module)
