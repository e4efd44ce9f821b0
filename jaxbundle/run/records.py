"""The records every batch of an evaluation passes to its schedule (:mod:`jaxbundle.run.runners`):
what the batches share (:class:`Model`) and one batch (:class:`Batch`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from jaxbundle.attacks.base import Attack
from jaxbundle.core import bundler

__all__ = ["Batch", "Model"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params", "key"],
                   meta_fields=["attacks", "mesh", "rules"])
@dataclasses.dataclass(frozen=True)
class Model:
    """What every batch of one evaluation shares: the model's parameters, the built attacks,
    the run's key, the mesh and the bundler's static rules (the model's apply function and the
    goals tracked among them). A pytree whose leaves are ``params`` and ``key``: a jitted
    program takes it whole, the rest static."""

    params: Any  # replicated over the mesh, if any
    attacks: tuple[Attack, ...]
    key: jax.Array  # jax.random.key(plan.run.seed)
    mesh: Mesh | None
    rules: bundler.Rules

    @property
    def apply_fn(self) -> Callable:
        return self.rules.apply_fn

    @property
    def goal_names(self) -> tuple[str, ...]:
        return self.rules.goal_names


class Batch(NamedTuple):
    """One batch (global arrays under a mesh) and its real rows (host bool ``[B]``; None inside
    a jitted program)."""

    x: jax.Array
    y: jax.Array
    example_id: jax.Array
    mask: jax.Array | None  # [B] device bool, False on padding rows (the summary's)
    real: np.ndarray
