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
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxbundle import checks as checks_lib
from jaxbundle import curves
from jaxbundle import data as data_lib
from jaxbundle import files as files_lib
from jaxbundle import goals as goals_lib
from jaxbundle import norms
from jaxbundle.attacks.base import Attack
from jaxbundle import judge
from jaxbundle import schedule as schedule_lib
from jaxbundle.bundler import (BundleResult, bundle, check_attacks, check_eot, check_inputs,
                               goals_for)
from jaxbundle.metrics import Counts, Setting, kind_success
from jaxbundle.sampling import is_stochastic

__all__ = [
    "Evaluation",
    "curve_metrics",
    "kind_distortions",
    "default_mesh",
    "describe",
    "evaluate",
    "evaluate_source",
    "load_images",
    "per_example_arrays",
]


class Evaluation(NamedTuple):
    """What :func:`evaluate` returns."""

    metrics: dict  # figures: see jaxbundle.metrics.Counts.compute, plus eps/norm/seed
    per_example: dict[str, np.ndarray]  # arrays of length n_examples (see per_example_arrays)
    attack_names: tuple[str, ...]
    # The first fooled examples: ``example_id``, ``x_clean`` and ``x_adv`` (the report's figure).
    gallery: dict[str, np.ndarray] | None = None


def per_example_arrays(
    result: BundleResult, x0: jax.Array, eps: jax.Array, black_box: Sequence[bool] | None = None
) -> dict[str, jax.Array]:
    """The per-example outputs kept for the report (``[B]`` arrays, and the judged ``x_adv``)."""
    mis = result.best["misclassify"]
    by_white, by_black = kind_success(result.attack_success, black_box)
    out = {
        "clean_prediction": result.clean.prediction,
        "winning_attack": mis.attack,
        "winning_restart": mis.restart,
        "winning_step": mis.step,
        "attack_success": result.attack_success.T,  # [B, A]
        "attack_distortion": result.attack_distortion.T,  # [B, A], inf: not fooled
        "attack_step": result.attack_step.T,  # [B, A]: step of each attack's best candidate
        "attack_improving": result.attack_improving.T,  # [B, A]: failed, margin still rising
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
    for goal, best in result.best.items():  # misclassify: success, distortion, prediction
        out.update(goals_lib.GOALS[goal].per_example(best.score, eps))
    return out


RATE_THRESHOLDS = (0.0, 0.25, 0.5, 0.75, 0.9)


def stochastic_metrics(apply_fn: Any, attacks: Sequence[Attack],
                       per_example: dict[str, np.ndarray]) -> dict:
    """How a stochastic model was judged, and its robust accuracy at other success-rate
    thresholds (from the same per-example best candidates, chosen by their rate)."""
    rate, clean = per_example["success_rate"], per_example["clean_success_rate"]
    n = max(len(rate), 1)
    at = lambda t: float(np.sum((clean <= t) & (rate <= t)) / n)  # noqa: E731
    return {
        "calls": apply_fn.calls,
        "threshold": apply_fn.threshold,
        "eot": {a.name: a.eot for a in attacks},
        "statement": (
            f"stochastic model: each candidate judged over {apply_fn.calls} fresh calls the "
            f"attacks never saw; an example counts as fooled when more than "
            f"{apply_fn.threshold:g} of them misclassify its best candidate (the one with the "
            "highest success rate)"
        ),
        "mean_success_rate": float(np.mean(rate)) if len(rate) else 0.0,
        "mean_clean_success_rate": float(np.mean(clean)) if len(clean) else 0.0,
        "robust_accuracy_at_threshold": {f"{t:g}": at(t) for t in RATE_THRESHOLDS},
    }


def kind_distortions(per_example: dict[str, np.ndarray], attacks: Sequence[Attack]
                     ) -> dict[str, np.ndarray]:
    """Per example, the smallest verified adversarial distortion (inf: none) over the white-box
    attacks, the black-box ones and all of them: ``min_distortion_<kind>``, for each kind that
    has attacks."""
    dist = per_example["attack_distortion"]  # [n, A]
    black = np.asarray([a.black_box for a in attacks], bool)
    kinds = {"white_box": ~black, "black_box": black, "bundled": np.ones_like(black)}
    return {f"min_distortion_{kind}": np.min(dist[:, members], axis=1)
            for kind, members in kinds.items() if members.any()}


def curve_metrics(per_example: dict[str, np.ndarray], attacks: Sequence[Attack], norm: str) -> dict:
    """P(D) and D1/2 (white-box, black-box, bundled: from :func:`kind_distortions`' arrays),
    the failure-rate curve, per-attack contributions and robust accuracy vs compute, from the
    exact per-example values."""
    ok = per_example["clean_prediction"] == per_example["label"]
    grid = curves.distortion_grid(norm)
    oc, half = {"grid": grid.tolist()}, {}
    for key, d in kind_distortions(per_example, attacks).items():
        kind = key.removeprefix("min_distortion_")
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
    return _summary(result, x, y, example_id, mask, eps, attacks, mesh, apply_fn, params)


def _summary(result, x, y, example_id, mask, eps, attacks, mesh, apply_fn, params):
    """A batch's counts and per-example outputs, replicated on every device under a mesh."""
    setting = Setting.of(attacks, tuple(result.best))
    eps_b = jnp.full(y.shape, eps, jnp.float32)
    outputs = dict(per_example_arrays(result, x, eps_b, setting.black_box), label=y,
                   example_id=example_id,
                   zero_gradient=checks_lib.zero_gradients(apply_fn, params, x, y))
    if is_stochastic(apply_fn):  # the fraction of the judge's calls each image fools
        outputs.update(success_rate=result.best["misclassify"].score.rate,
                       clean_success_rate=result.clean.rate)
    out = (Counts.from_result(result, mask, eps_b, setting), outputs)
    if mesh is not None:
        out = jax.lax.with_sharding_constraint(out, NamedSharding(mesh, PartitionSpec()))
    return out


@functools.partial(jax.jit, static_argnames=("attacks", "mesh", "apply_fn"))
def _summarise(result, params, x, y, example_id, mask, eps, *, attacks, mesh, apply_fn):
    return _summary(result, x, y, example_id, mask, eps, attacks, mesh, apply_fn, params)


def describe(value: Any) -> Any:
    """A JSON-able description of an attack (or any value) that is the same in every process:
    no object addresses. Named tuples by field, functions by module and qualified name."""

    def plain(value: Any) -> Any:
        if isinstance(value, functools.partial):
            return {"partial": plain(value.func), "args": plain(value.args),
                    "keywords": plain(value.keywords)}
        if callable(value) and not hasattr(value, "_asdict"):
            owner = value if hasattr(value, "__qualname__") else type(value)
            return f"{owner.__module__}.{owner.__qualname__}"
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


def fingerprint(**config: Any) -> str:
    """A short hash of a JSON-able description (stable across processes and machines)."""
    text = json.dumps(config, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cascade_metrics(metrics, per_example, attacks, stages, goal, threshold, budget,
                     focus, segments) -> dict:
    """What a cascade reports instead of the many-attack table: each stage's attack, the
    examples it ran on, what it spent, and the robust accuracy after it."""
    ok = per_example["clean_prediction"] == per_example["label"]
    fooled = np.cumsum(per_example["attack_success"], axis=1) > 0  # [n, A] after each stage
    n = len(ok)
    rows = []
    for k, a in enumerate(attacks):
        examples, computed, gradients, queries = (int(v) for v in stages[k])
        rows.append({
            "attack": a.name, "examples": examples, "rows": computed,
            "gradients": gradients, "queries": queries,
            "robust_accuracy": 100.0 * float(np.sum(ok & ~fooled[:, k])) / n,
        })
    black = [a.black_box for a in attacks]
    white_first = not any(b and not c for b, c in zip(black, black[1:]))  # no white after black
    out = {
        "schedule": {"mode": "cascade", "goal": goal, "threshold": threshold, "budget": budget,
                     "focus": dict(focus or {}), "segments": segments, "stages": rows},
        # Attack k saw only the survivors of attacks 1..k-1: no many-attack table.
        "mat": {}, "wat": None, "wat_attack": None, "black_box_robust_accuracy": None,
        "gradients_per_example": float(np.mean(per_example["gradients"])),
        "queries_per_example": float(np.mean(per_example["queries"])),
    }
    if not white_first:
        out.update(white_box_robust_accuracy=None, black_box_only=None)
    # A kind's P(D) would count only the examples its stages saw: keep the bundled curve.
    for key in ("half_distortion", "operating_characteristic"):
        out[key] = {k: v for k, v in metrics[key].items() if k in ("grid", "bundled")}
    return out


def _stored_on_grid(source: data_lib.Source, judging: str) -> bool:
    """Whether every clean image is on the 8-bit grid and judged there (then x_adv is uint8)."""
    if judging == "float":
        return False
    if np.dtype(source.dtype) == np.uint8:
        return True
    if isinstance(source, data_lib.ArraySource):
        return bool(np.all(norms.on_grid(np.asarray(source.x, np.float32))))
    return False


def _local_rows_match(sharding: NamedSharding, batch_size: int, shape: tuple[int, ...]) -> None:
    """The rows of a global batch this process's devices hold must be its ``p``-th slice."""
    p, count = jax.process_index(), jax.process_count()
    rows = sorted(
        r
        for index in sharding.addressable_devices_indices_map((batch_size, *shape)).values()
        for r in range(*index[0].indices(batch_size))
    )
    per = batch_size // count
    if sorted(set(rows)) != list(range(p * per, (p + 1) * per)):
        raise ValueError(
            "the mesh must list each process's devices together and in process order (as "
            "jax.devices() does), so that each process feeds a contiguous slice of the batch"
        )


def _save_images(directory: str, index: int, x_adv: np.ndarray, ids: np.ndarray) -> None:
    files_lib.save_npz(
        os.path.join(directory, f"adversarial-{index:06d}.npz"), x_adv=x_adv, example_id=ids
    )


def load_images(directory: str) -> tuple[np.ndarray, np.ndarray]:
    """All adversarial images written to ``directory`` by :func:`evaluate_source`, in example
    order: ``(x_adv, example_id)`` (for small runs; large ones read the batch files one by one).
    """
    names = sorted(f for f in os.listdir(directory) if f.startswith("adversarial-"))
    if not names:
        raise FileNotFoundError(f"no adversarial-*.npz files in {directory}")
    parts = [np.load(os.path.join(directory, f)) for f in names]
    return (np.concatenate([p["x_adv"] for p in parts]),
            np.concatenate([p["example_id"] for p in parts]))


class _State(NamedTuple):
    """What a checkpoint holds after ``batches_done`` batches: the summed counts, the
    per-example chunks and the gallery (ids and adversarial images of the first fooled
    examples, for the report's example figure)."""

    batches_done: int
    counts: Counts
    chunks: dict[str, list[np.ndarray]]
    stages: np.ndarray  # [A, 4] cascade only, per attack: examples attacked, rows computed,
    #   gradients and queries spent
    gallery: tuple[np.ndarray, np.ndarray]


def _fooled(outputs: dict[str, np.ndarray]) -> np.ndarray:
    """Indices of correctly classified examples that an attack fooled."""
    ok = outputs["clean_prediction"] == outputs["label"]
    return np.flatnonzero(ok & outputs["success"])


def _load_checkpoint(path: str, fingerprint_: str, empty: _State) -> _State:
    if not os.path.exists(path):
        return empty
    with np.load(path) as saved:
        if str(saved["fingerprint"]) != fingerprint_:
            raise ValueError(
                f"{path} belongs to a different evaluation (other model, data, attacks or "
                "settings); use another checkpoint directory or delete it"
            )
        return _State(
            int(saved["batches_done"]),
            empty.counts.read({k[len("counts_"):]: saved[k] for k in saved.files
                               if k.startswith("counts_")}),
            {k[4:]: [saved[k]] for k in saved.files if k.startswith("out_")},
            saved["stages"],
            (saved["gallery_id"], saved["gallery_x_adv"]),
        )


def _save_checkpoint(path: str, fingerprint_: str, state: _State) -> None:
    arrays = {f"counts_{k}": v for k, v in state.counts.arrays().items()}
    arrays.update({f"out_{k}": np.concatenate(v) for k, v in state.chunks.items()})
    files_lib.save_npz(
        path, batches_done=state.batches_done, fingerprint=fingerprint_,
        stages=state.stages, gallery_id=state.gallery[0], gallery_x_adv=state.gallery[1],
        **arrays
    )


def evaluate(
    apply_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    x: np.ndarray,
    y: np.ndarray,
    attacks: Sequence[Attack],
    **options: Any,
) -> Evaluation:
    """Evaluates a model under a bundle of attacks on images held in memory.

    ``x`` are images ``[N, ...]`` float in [0, 1] (numpy) and ``y`` integer labels ``[N]``;
    they are checked whole first. The options are those of :func:`evaluate_source`;
    ``per_example["x_adv"]`` holds the adversarial images unless ``keep_images=False``.
    """
    options.setdefault("keep_images", True)
    x = np.asarray(x)
    y = np.asarray(y)
    if x.ndim == 0 or int(x.shape[0]) == 0:
        raise ValueError("the dataset is empty")
    check_inputs(apply_fn, params, x, y, options.get("eps", 0.0),
                 judging=options.get("judging", "auto"))
    return evaluate_source(apply_fn, params, data_lib.ArraySource(x, y), attacks, **options)


def evaluate_source(
    apply_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    source: data_lib.Source,
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
    images_dir: str | None = None,
    keep_images: bool = False,
    gallery: int = 8,
    schedule: str = "full",
    schedule_goal: str = "misclassify",
    threshold: float | None = None,
    budget: float | None = None,
    focus: dict[str, float] | None = None,
    segments: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> Evaluation:
    """Evaluates a model under a bundle of attacks on a dataset read batch by batch.

    Host memory holds a batch at a time plus the small per-example arrays (a few numbers per
    example and attack); the adversarial images go to ``images_dir`` as they are made.

    Args:
      apply_fn: ``apply_fn(params, x) -> logits``.
      params: model parameters.
      source: a :class:`jaxbundle.data.Source` (images uint8, or floats in [0, 1]).
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
        evenly over it. Each process reads only the rows its own devices take.
      checkpoint_dir: if set, save after every batch and resume from there on a rerun, in a new
        process too (written by process 0 only; every process reads it).
      images_dir: if set, the judged adversarial images of batch ``b`` are written to
        ``images_dir/adversarial-{b:06d}.npz`` (``x_adv``, ``example_id``; by process 0).
      keep_images: also return them all in ``per_example["x_adv"]`` (in memory).
      gallery: how many fooled examples :attr:`Evaluation.gallery` shows (the first ones).
      schedule: ``"full"`` (every attack on every example: the many-attack table) or
        ``"cascade"`` (each attack only on the examples whose ``schedule_goal`` is not yet
        satisfied, see :mod:`jaxbundle.schedule`; the metrics' ``schedule`` entry gives the
        robust accuracy after each stage and what each stage spent, and there is no MAT).
      schedule_goal, threshold, budget, focus: the cascade's goal, the defender's confidence
        threshold t (for ``max_confidence``), its budget (model passes per example) and the
        attacks it runs only on the most promising survivors (name -> fraction).
      segments: in a cascade, each attack's steps run in up to this many segments, and the
        examples satisfied after a segment stop there (see :func:`jaxbundle.schedule.cascade`).
      progress: called as ``progress(batches_done, batches_total)``.

    Returns:
      An :class:`Evaluation`. Adversarial images are uint8 when every clean image is stored on
      the 8-bit grid and judged there, else float32 (the judged images exactly).
    """
    attacks, goal_names, focus, segments, eps_value = _check_options(
        apply_fn, source, attacks, eps=eps, norm=norm, goals=goals, judging=judging,
        batch_size=batch_size, schedule=schedule, schedule_goal=schedule_goal, focus=focus,
        segments=segments)
    n = len(source)
    setting = Setting.of(attacks, goal_names)
    if mesh == "auto":
        mesh = default_mesh()
    if mesh is None:
        batch_size = min(batch_size, n)
    fingerprint_ = None if checkpoint_dir is None else fingerprint(  # hashes params and data
        attacks=[describe(a) for a in attacks], eps=eps_value, norm=norm,
        goals=list(goal_names), seed=seed, batch_size=batch_size, judging=judging,
        schedule=([schedule, schedule_goal, threshold, budget, sorted(focus.items()), segments]
                  if schedule != "full" else "full"),
        data=source.describe(), n=n, model=params_digest(params), images=keep_images,
        apply_fn=describe(apply_fn),
        counts=sorted(Counts.empty(setting).arrays()),  # their layout
    )
    local_params, sharding = params, None
    if mesh is not None:
        devices = mesh.devices.size
        if batch_size % devices:
            raise ValueError(f"batch_size {batch_size} must be a multiple of {devices} devices")
        sharding = NamedSharding(mesh, PartitionSpec("batch"))
        _local_rows_match(sharding, batch_size, source.shape)
        params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    run = _Run(
        apply_fn=apply_fn, params=params, source=source, attacks=attacks, n=n,
        batch_size=batch_size, seed=seed, key=jax.random.key(seed), eps=eps_value, norm=norm,
        goal_names=goal_names, judging=judging, unroll=unroll, restart_mode=restart_mode,
        mesh=mesh, sharding=sharding,
        process=(jax.process_index(), jax.process_count()) if mesh is not None else (0, 1),
        schedule=schedule, schedule_goal=schedule_goal, threshold=threshold, budget=budget,
        focus=focus, segments=segments,
    )
    uint8_images = _stored_on_grid(source, judging)
    lead = jax.process_index() == 0
    # Host-side state only (numpy): counts are summed here, never by eager ops on global arrays.
    state = _State(
        0, jax.tree.map(np.asarray, Counts.empty(setting)), {},
        np.zeros((len(attacks), 4), np.int64),
        (np.zeros(0, np.int32),
         np.zeros((0, *source.shape), np.uint8 if uint8_images else np.float32)),
    )
    ckpt_path = None
    for directory in (checkpoint_dir, images_dir):
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
    if checkpoint_dir is not None:
        ckpt_path = os.path.join(checkpoint_dir, "checkpoint.npz")
        state = _load_checkpoint(ckpt_path, fingerprint_, state)
        if jax.process_count() > 1:
            multihost_utils.assert_equal(
                state.batches_done, f"processes resume from different batches: {ckpt_path} "
                "must be on a file system that every process shares"
            )

    total = data_lib.num_batches(n, batch_size)
    model_checks = None  # they run on this process's rows of the first batch, unsharded params
    for index in range(state.batches_done, total):
        bx, batch = _read_batch(run, index, check_classes=index == state.batches_done)
        if index == 0:
            model_checks = checks_lib.model_checks(apply_fn, local_params, bx[:8], attacks)
        counts, outputs, stage_counts = _attack_batch(run, index, bx, batch)
        x_adv = outputs.pop("x_adv")
        if uint8_images:
            x_adv = np.round(x_adv * norms.PIXEL_LEVELS).astype(np.uint8)
        if images_dir is not None and lead:
            _save_images(images_dir, index, x_adv, outputs["example_id"])
        if keep_images:
            outputs["x_adv"] = x_adv
        state = _add_batch(state, counts, outputs, stage_counts, x_adv, gallery)
        if ckpt_path is not None and lead:
            _save_checkpoint(ckpt_path, fingerprint_, state)
        if progress is not None:
            progress(index + 1, total)

    if model_checks is None:  # resumed: the first batch came from the checkpoint
        first = data_lib.local_batch(source, 0, batch_size, *run.process)
        model_checks = checks_lib.model_checks(apply_fn, local_params,
                                               data_lib.to_unit_float(first.x)[:8], attacks)
    metrics, per_example = _results(run, state, model_checks)
    ids, x_adv = state.gallery
    clean = [data_lib.to_unit_float(source.read(int(i), int(i) + 1)[0]) for i in ids]
    shown = {
        "example_id": ids, "x_adv": x_adv,
        "x_clean": np.concatenate(clean) if clean else np.zeros((0, *source.shape), np.float32),
    }
    return Evaluation(metrics=metrics, per_example=per_example,
                      attack_names=tuple(a.name for a in attacks), gallery=shown)


class _Run(NamedTuple):
    """What every batch of one evaluation shares: the model, data, bundle and how it runs."""

    apply_fn: Callable
    params: Any  # replicated over the mesh, if any
    source: data_lib.Source
    attacks: tuple[Attack, ...]
    n: int
    batch_size: int
    seed: int
    key: jax.Array  # jax.random.key(seed)
    eps: float
    norm: str
    goal_names: tuple[str, ...]
    judging: str
    unroll: int | bool
    restart_mode: str
    mesh: Mesh | None
    sharding: NamedSharding | None
    process: tuple[int, int]  # (this process, process count) feeding the mesh
    schedule: str
    schedule_goal: str
    threshold: float | None
    budget: float | None
    focus: dict[str, float]
    segments: int

    @property
    def setting(self) -> Setting:
        """What the metrics know of the run."""
        return Setting.of(self.attacks, self.goal_names)


def _check_options(apply_fn, source, attacks, *, eps, norm, goals, judging, batch_size,
                   schedule, schedule_goal, focus, segments):
    """The options of :func:`evaluate_source` checked: ``(attacks, goal names, focus,
    segments, eps)``."""
    norms.check_norm(norm)
    attacks = check_attacks(attacks, norm)
    check_eot(attacks, apply_fn)
    goal_names = goals_for(goals, attacks)
    judge.check_judging(judging)
    if schedule not in schedule_lib.SCHEDULES:
        raise ValueError(f"schedule must be one of {schedule_lib.SCHEDULES}, got {schedule!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if focus and schedule != "cascade":
        raise ValueError("focus drops survivors between stages: it needs schedule='cascade'")
    focus = schedule_lib.check_focus(focus, attacks, schedule_goal)
    segments = schedule_lib.check_segments(segments)
    if segments > 1 and schedule != "cascade":
        raise ValueError("segments drop satisfied examples within a stage: they need "
                         "schedule='cascade'")
    if len(source) == 0:
        raise ValueError(f"the dataset {source.name} is empty")
    eps_value = float(eps)
    if not np.isfinite(eps_value) or eps_value < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return attacks, goal_names, focus, segments, eps_value


def _read_batch(run: _Run, index: int, check_classes: bool) -> tuple[np.ndarray, data_lib.Batch]:
    """This process's rows of batch ``index`` as floats in [0, 1], checked (and, with
    ``check_classes``, the model's class count against the data's)."""
    batch = data_lib.local_batch(run.source, index, run.batch_size, *run.process)
    bx = data_lib.to_unit_float(batch.x)
    classes = check_inputs(run.apply_fn, run.params, bx, batch.y, run.eps, judging=run.judging)
    if check_classes and run.source.num_classes not in (None, classes):
        raise ValueError(
            f"the model has {classes} outputs but the data {run.source.name} has "
            f"{run.source.num_classes} classes"
        )
    return bx, batch


def _attack_batch(run: _Run, index: int, bx: np.ndarray, batch: data_lib.Batch):
    """Batch ``index`` attacked by the full bundle or the cascade: its counts (numpy), its
    per-example outputs on the real rows (numpy) and each stage's spending ``[A, 4]``."""
    arrays = (bx, batch.y.astype(np.int32), batch.example_id, batch.mask)
    if run.sharding is not None:
        arrays = tuple(
            jax.make_array_from_process_local_data(run.sharding, a, (run.batch_size, *a.shape[1:]))
            for a in arrays
        )
    real = np.arange(index * run.batch_size, (index + 1) * run.batch_size) < run.n
    eps = jnp.float32(run.eps)
    stage_counts = np.zeros((len(run.attacks), 4), np.int64)
    if run.schedule == "full":
        counts, outputs = _evaluate_batch(
            run.params, *arrays[:2], run.key, *arrays[2:], eps, apply_fn=run.apply_fn,
            attacks=run.attacks, goal_names=run.goal_names, norm=run.norm, judging=run.judging,
            unroll=run.unroll, restart_mode=run.restart_mode, mesh=run.mesh,
        )
    else:
        result, stages = schedule_lib.cascade(
            run.attacks, run.apply_fn, run.params, arrays[0], arrays[1], run.key, arrays[2],
            eps, norm=run.norm, goal_names=run.goal_names, judging=run.judging, mask=real,
            goal=run.schedule_goal, threshold=run.threshold, budget=run.budget,
            focus=run.focus, unroll=run.unroll, restart_mode=run.restart_mode, mesh=run.mesh,
            segments=run.segments,
        )
        stage_counts = np.asarray([s[1:] for s in stages], np.int64)
        counts, outputs = _summarise(result, run.params, *arrays, eps, attacks=run.attacks,
                                     mesh=run.mesh, apply_fn=run.apply_fn)
    # Every output is replicated: each process reads its own full copy.
    outputs = {k: np.asarray(v)[real] for k, v in outputs.items()}
    return jax.tree.map(np.asarray, counts), outputs, stage_counts


def _add_batch(state: _State, counts: Counts, outputs: dict[str, np.ndarray],
               stage_counts: np.ndarray, x_adv: np.ndarray, gallery: int) -> _State:
    """The state after one more batch: counts summed, outputs appended, the gallery filled
    up to ``gallery`` fooled examples."""
    shown = _fooled(outputs)[: gallery - len(state.gallery[0])]
    return _State(
        state.batches_done + 1,
        state.counts.merge(counts),
        {k: state.chunks.get(k, []) + [v] for k, v in outputs.items()},
        state.stages + stage_counts,
        (np.concatenate([state.gallery[0], outputs["example_id"][shown]]),
         np.concatenate([state.gallery[1], x_adv[shown]]) if shown.size else state.gallery[1]),
    )


def _results(run: _Run, state: _State, model_checks: Any) -> tuple[dict, dict]:
    """The figures and per-example arrays of a finished evaluation."""
    attacks, n = run.attacks, run.n
    per_example = {k: np.concatenate(v) for k, v in state.chunks.items()}
    per_example.pop("example_id")
    metrics = state.counts.compute(run.setting)
    metrics.update(eps=run.eps, norm=run.norm, seed=run.seed, goals=list(run.goal_names))
    on_grid = metrics.pop("grid_judged")
    metrics["judging"] = {
        "mode": run.judging,
        "grid_examples": on_grid,
        "float_examples": n - on_grid,
        "grid_radius": norms.grid_radius(run.eps, run.norm),
        "statement": judge.statement(run.judging, run.eps, run.norm, on_grid, n),
    }
    metrics["data"] = {"name": run.source.name, "n": n}
    per_example["check_flags"] = checks_lib.example_flags(per_example, attacks)
    metrics["checks"] = checks_lib.summarise(
        model_checks, per_example["check_flags"], attacks,
        int(np.sum(per_example["clean_prediction"] == per_example["label"])),
    )
    metrics["check_flag_names"] = list(checks_lib.FLAG_NAMES)
    if is_stochastic(run.apply_fn):
        metrics["stochastic"] = stochastic_metrics(run.apply_fn, attacks, per_example)
    per_example.update(kind_distortions(per_example, attacks))
    metrics.update(curve_metrics(per_example, attacks, run.norm))
    metrics["schedule"] = {"mode": run.schedule}
    if run.schedule == "cascade":
        metrics.update(_cascade_metrics(
            metrics, per_example, attacks, state.stages, run.schedule_goal, run.threshold,
            run.budget, run.focus, run.segments,
        ))
    return metrics, per_example
