"""Checkpoints and run identity: what an interrupted evaluation resumes from, and whether it may.

A run's identity is its :func:`fingerprint`: the plan's description (with every attack's full
description, :func:`describe`), the data's and the parameters' digests. :func:`save` writes the
host state after every batch atomically; :func:`load` resumes from it in a new process, and
refuses a checkpoint whose fingerprint differs (any plan field, the model or the data changed).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxbundle.core import moved
from jaxbundle.run import files as files_lib
from jaxbundle.report.metrics import Counts

__all__ = ["FILE", "State", "describe", "fingerprint", "load", "load_images", "params_digest",
           "saved_batch_size", "save",
           "save_images"]

FILE = "checkpoint.npz"  # an evaluation's checkpoint, in its checkpoint directory


def describe(value: Any) -> Any:
    """A JSON-able description of an attack (or any value) that is the same in every process:
    no object addresses. Named tuples by field, functions by module and qualified name."""

    def plain(value: Any) -> Any:
        if isinstance(value, functools.partial):
            return {"partial": plain(value.func), "args": plain(value.args),
                    "keywords": plain(value.keywords)}
        if callable(value) and not hasattr(value, "_asdict"):
            owner = value if hasattr(value, "__qualname__") else type(value)
            return f"{moved.earlier(owner.__module__)}.{owner.__qualname__}"
        if hasattr(value, "_asdict"):
            return {type(value).__name__: {k: plain(v) for k, v in value._asdict().items()}}
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in sorted(value.items())}
        if isinstance(value, (str, int, float, bool, type(None))):
            return value
        return repr(value)

    return plain(value)


def params_digest(params: Any) -> str:
    """SHA-256 of a parameter tree's structure, shapes, dtypes and values."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    h = hashlib.sha256(str(treedef).encode())
    for leaf in leaves:
        a = np.asarray(leaf)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def identity(**config: Any) -> str:
    """A run's identity as canonical JSON (stable across processes and machines)."""
    return json.dumps(describe(config), sort_keys=True, default=repr)


def fingerprint(identity_: str) -> str:
    """A short hash of an :func:`identity`."""
    return hashlib.sha256(identity_.encode()).hexdigest()[:16]


def _changed(saved: Any, now: Any, path: str = "") -> list[str]:
    """The paths (``plan.schedule.segments``) at which two identities differ."""
    if isinstance(saved, dict) and isinstance(now, dict):
        return [p for k in sorted(set(saved) | set(now))
                for p in _changed(saved.get(k), now.get(k), f"{path}.{k}" if path else k)]
    return [] if saved == now else [path or "(all)"]


class State(NamedTuple):
    """What a checkpoint holds after ``batches_done`` batches: the summed counts, the
    per-example chunks and the gallery (ids and adversarial images of the first fooled
    examples, for the report's example figure)."""

    batches_done: int
    counts: Counts
    chunks: dict[str, list[np.ndarray]]
    stages: np.ndarray  # [A, 5] cascade only, per attack: examples attacked, rows computed,
    #   gradients and queries spent, survivors it could have run on
    gallery: tuple[np.ndarray, np.ndarray]


def load(path: str, identity_: str, empty: State) -> State:
    """The state saved at ``path`` (``empty`` if there is none); refuses, naming what changed,
    a checkpoint of another run."""
    if not os.path.exists(path):
        return empty
    with np.load(path) as saved:
        if str(saved["fingerprint"]) != fingerprint(identity_):
            was = json.loads(str(saved["identity"])) if "identity" in saved.files else {}
            changed = _changed(was, json.loads(identity_))
            raise ValueError(
                f"{path} belongs to a different evaluation ({', '.join(changed[:4])} changed); "
                "run the same plan, model and data to resume, or use another checkpoint "
                "directory"
            )
        return State(
            int(saved["batches_done"]),
            empty.counts.read({k[len("counts_"):]: saved[k] for k in saved.files
                               if k.startswith("counts_")}),
            {k[4:]: [saved[k]] for k in saved.files if k.startswith("out_")},
            saved["stages"],
            (saved["gallery_id"], saved["gallery_x_adv"]),
        )


def saved_batch_size(directory: str) -> int | None:
    """The batch size of the run checkpointed in ``directory`` (None: no checkpoint there), so
    that a run whose batch size was fitted to the memory resumes with the same one."""
    path = os.path.join(directory, FILE)
    if not os.path.exists(path):
        return None
    with np.load(path) as saved:
        return int(json.loads(str(saved["identity"]))["plan"]["run"]["batch_size"])


def save(path: str, identity_: str, state: State) -> None:
    """Writes ``state`` atomically, with the run's identity."""
    arrays = {f"counts_{k}": v for k, v in state.counts.arrays().items()}
    arrays.update({f"out_{k}": np.concatenate(v) for k, v in state.chunks.items()})
    files_lib.save_npz(
        path, batches_done=state.batches_done, fingerprint=fingerprint(identity_),
        identity=identity_, stages=state.stages, gallery_id=state.gallery[0],
        gallery_x_adv=state.gallery[1], **arrays
    )


def save_images(directory: str, index: int, x_adv: np.ndarray, ids: np.ndarray) -> None:
    files_lib.save_npz(
        os.path.join(directory, f"adversarial-{index:06d}.npz"), x_adv=x_adv, example_id=ids
    )


def load_images(directory: str) -> tuple[np.ndarray, np.ndarray]:
    """All adversarial images written to ``directory`` by :func:`jaxbundle.evaluate`, in example
    order: ``(x_adv, example_id)`` (for small runs; large ones read the batch files one by one).
    """
    names = sorted(f for f in os.listdir(directory) if f.startswith("adversarial-"))
    if not names:
        raise FileNotFoundError(f"no adversarial-*.npz files in {directory}")
    parts = [np.load(os.path.join(directory, f)) for f in names]
    return (np.concatenate([p["x_adv"] for p in parts]),
            np.concatenate([p["example_id"] for p in parts]))


