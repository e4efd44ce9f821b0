"""The evaluation driver: fixed-shape batches, a device mesh, checkpoints, per-example output.

``evaluate(apply_fn, params, x, y, attacks, eps=...)`` runs :func:`jaxbundle.bundler.bundle`
over padded batches (one compiled program for the whole dataset). Each batch is one jitted
program that also computes its :class:`jaxbundle.metrics.Counts` and its per-example outputs;
the counts are summed and the small per-example arrays collected on the host.

With several devices the batch axis is sharded over a ``jax.sharding.Mesh`` (params
replicated); the answer is the same as on one device because every example draws its own
randomness from ``fold_in(key, example_id)`` and metrics are sums. After
``jax.distributed.initialize()`` the mesh spans every device of every process: each process
makes the same call on the same data and the bundle runs as one SPMD program over the global
batch, whose outputs are replicated inside the program, so every process reads the whole
result locally. No process ever runs an operation on a global array that the others do not
(that would deadlock them): host state is numpy, and process 0 only writes files. With
``checkpoint_dir``, the state after every batch is written atomically and a rerun resumes
after the last finished batch with a bit-identical result.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxbundle import curves
from jaxbundle import data as data_lib
from jaxbundle import goals as goals_lib
from jaxbundle import norms
from jaxbundle.attacks.base import Attack
from jaxbundle import judge
from jaxbundle.bundler import BundleResult, bundle, check_attacks, check_inputs, goals_for
from jaxbundle.metrics import Counts, kind_success

__all__ = ["Evaluation", "evaluate", "per_example_arrays", "curve_metrics", "default_mesh"]


class Evaluation(NamedTuple):
    """What :func:`evaluate` returns."""

    metrics: dict  # figures: see jaxbundle.metrics.Counts.compute, plus eps/norm/seed
    per_example: dict[str, np.ndarray]  # arrays of length n_examples (see per_example_arrays)
    attack_names: tuple[str, ...]


def per_example_arrays(
    result: BundleResult, x0: jax.Array, eps: jax.Array, black_box: Sequence[bool] | None = None
) -> dict[str, jax.Array]:
    """The per-example outputs kept for the report (``[B]`` arrays, and the judged ``x_adv``)."""
    mis = result.best["misclassify"]
    by_white, by_black = kind_success(result.attack_success, black_box)
    out = {
        "clean_prediction": result.clean.prediction,
        "adversarial_prediction": mis.score.prediction,
        "success": goals_lib.success("misclassify", mis.score, eps),
        "distortion": mis.score.distortion,
        "winning_attack": mis.attack,
        "winning_restart": mis.restart,
        "winning_step": mis.step,
        "attack_success": result.attack_success.T,  # [B, A]
        "attack_distortion": result.attack_distortion.T,  # [B, A], inf: not fooled
        # A misclassified clean image's top probability is its highest wrong-class one.
        "clean_wrong_confidence": jnp.where(
            result.clean.misclassified, result.clean.confidence, 0.0
        ),
        "gradients": result.gradients,
        "queries": result.queries,
        "black_box_only": by_black & ~by_white,  # only a black-box attack fooled it
        "judged_on_grid": result.judged_on_grid,
        "x_adv": mis.x,  # the judged image (float32; stored as uint8 when all are on the grid)
    }
    if "max_confidence" in result.best:
        mc = result.best["max_confidence"].score
        out["max_wrong_confidence"] = jnp.where(goals_lib.within(mc, eps), mc.confidence, 0.0)
    if "min_norm" in result.best:
        mn = result.best["min_norm"].score
        out["min_distortion"] = jnp.where(mn.misclassified, mn.distortion, jnp.inf)
    return out


def curve_metrics(per_example: dict[str, np.ndarray], attacks: Sequence[Attack], norm: str) -> dict:
    """P(D) and D1/2 (white-box, black-box, bundled), the failure-rate curve, per-attack
    contributions and robust accuracy vs compute, from the exact per-example values."""
    ok = per_example["clean_prediction"] == per_example["label"]
    dist = per_example["attack_distortion"]  # [n, A]
    black = np.asarray([a.black_box for a in attacks], bool)
    kinds = {"white_box": ~black, "black_box": black, "bundled": np.ones_like(black)}
    grid = curves.distortion_grid(norm)
    oc, half = {"grid": grid.tolist()}, {}
    for kind, members in kinds.items():
        if not members.any():
            continue
        d = np.min(dist[:, members], axis=1)
        per_example[f"min_distortion_{kind}"] = d
        oc[kind] = curves.operating_characteristic(d, ok, grid).tolist()
        half[kind] = curves.half_distortion(d, ok)
    names = [a.name for a in attacks]
    out = {
        "operating_characteristic": oc,
        "half_distortion": half,
        "attack_contribution": curves.attack_contribution(
            per_example["attack_success"], per_example["winning_attack"], ok, names,
            per_example["winning_restart"],
        ),
        "gradients_per_example": int(sum(a.gradients for a in attacks)),
        "queries_per_example": int(sum(a.queries for a in attacks)),
        "robustness_vs_compute": curves.robustness_vs_compute(
            per_example["attack_success"], ok, [a.gradients + a.queries for a in attacks]
        ),
    }
    if "max_wrong_confidence" in per_example:
        out["failure_rate_curve"] = curves.failure_rate_curve(
            per_example["max_wrong_confidence"], per_example["clean_wrong_confidence"]
        )
    return out


def default_mesh() -> Mesh | None:
    """A 1-D ``("batch",)`` mesh over all devices of all processes, or ``None`` for one device."""
    devices = jax.devices()
    if len(devices) == 1:
        return None
    return Mesh(np.asarray(devices), ("batch",))


@functools.partial(
    jax.jit,
    static_argnames=(
        "apply_fn", "attacks", "goal_names", "norm", "judging", "unroll", "restart_mode", "mesh"
    ),
)
def _evaluate_batch(
    params: Any,
    x: jax.Array,
    y: jax.Array,
    key: jax.Array,
    example_id: jax.Array,
    mask: jax.Array,
    eps: jax.Array,
    *,
    apply_fn: Callable[[Any, jax.Array], jax.Array],
    attacks: tuple[Attack, ...],
    goal_names: tuple[str, ...],
    norm: str,
    judging: str,
    unroll: int | bool,
    restart_mode: str,
    mesh: Mesh | None,
) -> tuple[Counts, dict[str, jax.Array]]:
    """One batch: the bundle, its counts and its per-example outputs, in one program.

    With a mesh, every output is replicated on every device (the gather happens inside the
    program), so each process reads the whole result locally: no eager operation on a global
    array, and nothing a single process would have to run alone.
    """
    result = bundle(
        attacks, apply_fn, params, x, y, key, eps=eps, norm=norm, goals=goal_names,
        example_id=example_id, judging=judging, unroll=unroll, restart_mode=restart_mode,
        validate=False,
    )
    black_box = tuple(a.black_box for a in attacks)
    eps_b = jnp.full(y.shape, eps, jnp.float32)
    out = (Counts.from_result(result, mask, eps_b, black_box),
           per_example_arrays(result, x, eps_b, black_box))
    if mesh is not None:
        out = jax.lax.with_sharding_constraint(out, NamedSharding(mesh, PartitionSpec()))
    return out


def _fingerprint(**config: Any) -> str:
    text = json.dumps({k: repr(v) for k, v in sorted(config.items())})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _save_checkpoint(path: str, state: dict[str, np.ndarray]) -> None:
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        np.savez(f, **state)
    os.replace(tmp, path)


def evaluate(
    apply_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    x: np.ndarray,
    y: np.ndarray,
    attacks: Sequence[Attack],
    *,
    eps: float,
    norm: str = "linf",
    goals: Sequence[str] = ("misclassify", "max_confidence", "min_norm"),
    seed: int = 0,
    batch_size: int = 256,
    judging: str = "auto",
    unroll: int | bool = 1,
    restart_mode: str = "vmap",
    mesh: Mesh | None | str = "auto",
    checkpoint_dir: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Evaluation:
    """Evaluates a model under a bundle of attacks on a whole dataset.

    Args:
      apply_fn: ``apply_fn(params, x) -> logits``.
      params: model parameters.
      x: images ``[N, ...]`` float in [0, 1] (numpy).
      y: integer labels ``[N]``.
      attacks: the bundle (see :mod:`jaxbundle.attacks`).
      eps: the threat model's radius.
      norm: the threat model's norm.
      goals: goals to track; ``misclassify`` always is.
      seed: example ``i`` draws from ``fold_in(PRNGKey(seed), i)``.
      batch_size: rows per batch; the last batch is padded (masked), so one program serves all.
      judging: ``"auto"``, ``"grid"`` or ``"float"`` (see :mod:`jaxbundle.judge`); the metrics'
        ``judging`` entry says how the examples were judged and the radius that allows.
      unroll, restart_mode: see :func:`jaxbundle.bundler.bundle`.
      mesh: ``"auto"`` (every device, of every process under ``jax.distributed``), ``None`` (no
        sharding) or a 1-D ``Mesh`` whose axis is named ``"batch"``; ``batch_size`` must divide
        evenly over it.
      checkpoint_dir: if set, save after every batch and resume from there on a rerun (written
        by process 0 only; every process reads it).
      progress: called as ``progress(batches_done, batches_total)``.

    Returns:
      An :class:`Evaluation`. ``per_example["x_adv"]`` is uint8 when every example was judged
      on the 8-bit grid, else float32 (the judged images exactly).
    """
    norms.check_norm(norm)
    attacks = check_attacks(attacks, norm)
    goal_names = goals_for(goals, attacks)
    judge.check_judging(judging)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    x = np.asarray(x)
    y = np.asarray(y)
    n = int(x.shape[0]) if x.ndim else 0
    if n == 0:
        raise ValueError("the dataset is empty")
    check_inputs(apply_fn, params, x, y, eps, judging=judging)
    if mesh == "auto":
        mesh = default_mesh()
    if mesh is None:
        batch_size = min(batch_size, n)
    sharding = None
    if mesh is not None:
        devices = mesh.devices.size
        if batch_size % devices:
            raise ValueError(f"batch_size {batch_size} must be a multiple of {devices} devices")
        sharding = NamedSharding(mesh, PartitionSpec("batch"))
        params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))

    total = data_lib.num_batches(n, batch_size)
    key = jax.random.key(seed)
    names = tuple(a.name for a in attacks)
    black_box = tuple(a.black_box for a in attacks)
    eps_value = float(eps)
    all_on_grid = judging != "float" and bool(np.all(norms.on_grid(np.asarray(x, np.float32))))
    # Host-side state only (numpy): counts are summed here, never by eager ops on global arrays.
    counts = jax.tree.map(np.asarray, Counts.empty(len(attacks)))
    chunks: dict[str, list[np.ndarray]] = {}
    start = 0
    ckpt_path = None
    if checkpoint_dir is not None:
        os.makedirs(checkpoint_dir, exist_ok=True)
        ckpt_path = os.path.join(checkpoint_dir, "checkpoint.npz")
        fingerprint = _fingerprint(
            attacks=attacks, eps=eps, norm=norm, goals=goal_names, seed=seed, n=n,
            batch_size=batch_size, judging=judging,
            data=hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest(),
        )
        if os.path.exists(ckpt_path):
            with np.load(ckpt_path) as saved:
                if str(saved["fingerprint"]) != fingerprint:
                    raise ValueError(
                        f"{ckpt_path} belongs to a different evaluation (other data, attacks or "
                        "settings); use another checkpoint_dir or delete it"
                    )
                start = int(saved["batches_done"])
                counts = Counts(*(saved[f"counts_{f}"] for f in Counts._fields))
                chunks = {k[4:]: [saved[k]] for k in saved.files if k.startswith("out_")}
        if jax.process_count() > 1:
            multihost_utils.assert_equal(
                start, f"processes resume from different batches: {ckpt_path} must be on a "
                "file system that every process shares"
            )

    for index, batch in enumerate(data_lib.batches(x, y, batch_size, start=start), start=start):
        arrays = (batch.x.astype(np.float32), batch.y.astype(np.int32), batch.example_id, batch.mask)
        if sharding is not None:
            arrays = tuple(jax.device_put(a, sharding) for a in arrays)
        bx, by, bid, bmask = arrays
        batch_counts, outputs = _evaluate_batch(
            params, bx, by, key, bid, bmask, jnp.float32(eps_value), apply_fn=apply_fn,
            attacks=attacks, goal_names=goal_names, norm=norm, judging=judging, unroll=unroll,
            restart_mode=restart_mode, mesh=mesh,
        )
        # Every output is replicated: each process reads its own full copy.
        counts = counts.merge(jax.tree.map(np.asarray, batch_counts))
        real = np.asarray(batch.mask)
        for k, v in outputs.items():
            v = np.asarray(v)[real]
            if k == "x_adv" and all_on_grid:
                v = np.round(v * norms.PIXEL_LEVELS).astype(np.uint8)
            chunks.setdefault(k, []).append(v)
        if ckpt_path is not None and jax.process_index() == 0:
            state = {f"counts_{f}": v for f, v in zip(Counts._fields, counts)}
            state.update({f"out_{k}": np.concatenate(v) for k, v in chunks.items()})
            _save_checkpoint(
                ckpt_path, dict(state, batches_done=index + 1, fingerprint=fingerprint)
            )
        if progress is not None:
            progress(index + 1, total)

    per_example = {k: np.concatenate(v) for k, v in chunks.items()}
    per_example["label"] = y
    metrics = counts.compute(names, black_box)
    metrics.update(eps=eps_value, norm=norm, seed=seed, goals=list(goal_names))
    on_grid = metrics.pop("grid_judged")
    metrics["judging"] = {
        "mode": judging,
        "grid_examples": on_grid,
        "float_examples": n - on_grid,
        "grid_radius": norms.grid_radius(eps_value, norm),
        "statement": judge.statement(judging, eps_value, norm, on_grid, n),
    }
    metrics.update(curve_metrics(per_example, attacks, norm))
    return Evaluation(metrics=metrics, per_example=per_example, attack_names=names)
