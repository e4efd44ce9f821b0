"""The evaluation driver: a plan run over a dataset in fixed-shape batches, on a device mesh.

``jaxbundle.evaluate(model, params, data, plan)`` adapts the model once to ``apply_fn(params, x)``
(:mod:`jaxbundle.run.adapters`: linen, NNX and Equinox modules too), reads ``data`` batch by batch
(padded, so one compiled program serves the whole dataset), runs the plan's runner on each
(:mod:`jaxbundle.run.runners`: ``full`` or ``cascade``), sums the batches'
:class:`jaxbundle.report.metrics.Counts` and collects the small per-example arrays on the host, then
computes the figures and the report's model record (:mod:`jaxbundle.report.schema`).

With several devices the batch axis is sharded over a ``jax.sharding.Mesh`` (params
replicated); the answer is the same as on one device because every example draws its own
randomness from ``fold_in(key, example_id)`` and metrics are sums. After
``jax.distributed.initialize()`` the mesh spans every device of every process: each process
makes the same call on the same data and the plan runs as one SPMD program over the global
batch, whose outputs are replicated inside the program, so every process reads the whole
result locally. No process ever runs an operation on a global array that the others do not
(that would deadlock them): host state is numpy, and process 0 only writes files. With
``checkpoint_dir``, the state after every batch is written atomically and a rerun resumes
after the last finished batch with a bit-identical result (:mod:`jaxbundle.run.checkpoint`).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxbundle import data as data_lib
from jaxbundle.core import judge, norms, sampling
from jaxbundle.core.validation import check_inputs, model_dtypes
from jaxbundle.plan import Plan
from jaxbundle.report import schema
from jaxbundle.report.metrics import Counts, Setting
from jaxbundle.report.outputs import curve_metrics, kind_distortions, stochastic_metrics
from jaxbundle.run import adapters, checkpoint, runners
from jaxbundle.run import compile_cache as compile_cache_lib
from jaxbundle.run import checks as checks_lib
from jaxbundle.run.checkpoint import load_images  # noqa: F401  (the images a run wrote)

__all__ = ["Evaluation", "default_mesh", "evaluate", "for_model", "load_images"]

# The model-level checks (jaxbundle.run.checks.model_checks) run on this many images of the first
# batch: five eager calls of the model, which on a ResNet-18 at 224x224 took 0.28 of PGD-10's
# gradients on 8 images (benchmarks/imagenet_overhead.py); two tell randomness, state and
# probabilities apart as well.
CHECKED = 2


class Evaluation(NamedTuple):
    """What :func:`evaluate` returns."""

    metrics: dict  # the report's model record (jaxbundle.report.schema.MODEL_FIELDS)
    per_example: dict[str, np.ndarray]  # arrays of length n_examples (schema.PER_EXAMPLE)
    attack_names: tuple[str, ...]
    # The first fooled examples: ``example_id``, ``x_clean`` and ``x_adv`` (the report's figure).
    gallery: dict[str, np.ndarray] | None = None


def default_mesh() -> Mesh | None:
    """A 1-D ``("batch",)`` mesh over all devices of all processes, or ``None`` for one device."""
    devices = jax.devices()
    if len(devices) == 1:
        return None
    return Mesh(np.asarray(devices), ("batch",))


def for_model(plan: Plan, apply_fn: Callable) -> tuple[Callable, tuple]:
    """The model and the attacks the plan runs on it: a stochastic model judged with the plan's
    ``judge_calls`` / ``success_threshold`` (its own where None) and attacked with ``eot``
    samples per call (an attack built with its own, :func:`jaxbundle.with_eot`, keeps it); a
    deterministic one as it is (the plan's stochastic fields must then be unset:
    :meth:`Plan.check`)."""
    plan.check(apply_fn)
    attacks = plan.attack_values()
    if not sampling.is_stochastic(apply_fn):
        return apply_fn, attacks
    options = plan.sampling
    model = sampling.stochastic(
        apply_fn.apply_fn,
        calls=apply_fn.calls if options.judge_calls is None else options.judge_calls,
        threshold=apply_fn.threshold if options.success_threshold is None
        else options.success_threshold,
    )
    # The plan's EOT for every attack that does not carry its own (jaxbundle.with_eot).
    return model, tuple(a._replace(eot=options.eot) if a.eot == 1 else a for a in attacks)


def _as_source(data: Any, plan: Plan, apply_fn: Callable, params: Any) -> data_lib.Source:
    """``data`` as a source: a :class:`jaxbundle.data.Source` as it is, ``(x, y)`` arrays
    checked whole first (images float in [0, 1], integer labels), a name for
    :func:`jaxbundle.data.open_source`."""
    if isinstance(data, str):
        return data_lib.open_source(data)
    if isinstance(data, tuple) and len(data) == 2:
        x, y = np.asarray(data[0]), np.asarray(data[1])
        if x.ndim == 0 or int(x.shape[0]) == 0:
            raise ValueError("the dataset is empty")
        check_inputs(apply_fn, params, x, y, plan.threat.eps, judging=plan.threat.judging)
        return data_lib.ArraySource(x, y)
    if isinstance(data, data_lib.Source):
        return data
    raise TypeError(f"data must be (x, y) arrays, a jaxbundle.data Source or a source name, "
                    f"got {type(data).__name__}")


def _stored_on_grid(source: data_lib.Source, judging: str) -> bool:
    """Whether every clean image is on the 8-bit grid and judged there (then x_adv is uint8)."""
    if judging == "float":
        return False
    if np.dtype(source.dtype) == np.uint8:
        return True
    if isinstance(source, data_lib.ArraySource):
        return bool(np.all(norms.on_grid(np.asarray(source.x, np.float32))))
    return False


class _Run(NamedTuple):
    """One evaluation: the plan (its batch size as run), the model as attacked, the data and
    how batches are placed."""

    plan: Plan
    model: runners.Model
    source: data_lib.Source
    sharding: NamedSharding | None
    process: tuple[int, int]  # (this process, process count) feeding the mesh

    @property
    def n(self) -> int:
        return len(self.source)

    @property
    def setting(self) -> Setting:
        """What the metrics know of the run."""
        return Setting.of(self.model.attacks, self.model.goal_names)


def _start(apply_fn, params, source, plan, mesh) -> _Run:
    """The run of ``plan`` on ``source``: the model adapted, the batch size as run
    (:func:`jaxbundle.data.balanced_batch`), params replicated over the mesh."""
    apply_fn, attacks = for_model(plan, apply_fn)
    if len(source) == 0:
        raise ValueError(f"the dataset {source.name} is empty")
    if mesh == "auto":
        mesh = default_mesh()
    sharding = None
    devices = 1 if mesh is None else mesh.devices.size
    if plan.run.batch_size % devices:
        raise ValueError(f"batch_size {plan.run.batch_size} must be a multiple of {devices} "
                         "devices")
    size = data_lib.balanced_batch(plan.run.batch_size, len(source), devices)
    plan = plan.replace(batch_size=size)
    if mesh is not None:
        sharding = NamedSharding(mesh, PartitionSpec("batch"))
        data_lib.check_local_rows(sharding, plan.run.batch_size, source.shape)
        params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    model = runners.Model(params, attacks, jax.random.key(plan.run.seed), mesh,
                          plan.rules(apply_fn, attacks))
    process = (jax.process_index(), jax.process_count()) if mesh is not None else (0, 1)
    return _Run(plan, model, source, sharding, process)


def evaluate(  # noqa: PLR0913 (the public call: keyword-only options after the four inputs)
    model: Any,
    params: Any,
    data: Any,
    plan: Plan,
    *,
    mesh: Mesh | None | str = "auto",
    checkpoint_dir: str | None = None,
    images_dir: str | None = None,
    keep_images: bool | None = None,
    gallery: int = 8,
    progress: Callable[[int, int], None] | None = None,
    compile_cache: str | os.PathLike | None = "auto",
) -> Evaluation:
    """Evaluates a model under a plan: what ``jaxbundle evaluate`` runs for each model.

    Host memory holds a batch at a time plus the small per-example arrays; the adversarial
    images go to ``images_dir`` as they are made.

    Args:
      model: ``apply_fn(params, x) -> logits`` (images ``[B, H, W, C]`` in [0, 1]), a stochastic
        model, or a linen, NNX or Equinox module in inference mode (:mod:`jaxbundle.run.adapters`).
      params: a jit argument; a linen module's variables; None for an NNX or Equinox module.
      data: ``(x, y)`` arrays (images float in [0, 1], labels ``[N]``), a
        :class:`jaxbundle.data.Source` (images uint8, or floats in [0, 1]), or a source name
        (``mnist-sample``, ``npz:PATH``, ``tfds:NAME``).
      plan: the :class:`jaxbundle.Plan` (e.g. ``jaxbundle.bundles.default("linf", 0.3)``).
      mesh: ``"auto"`` (every device, of every process under ``jax.distributed``), ``None`` (no
        sharding) or a 1-D ``Mesh`` whose axis is named ``"batch"``; the plan's batch size must
        divide evenly over it. Each process reads only the rows its own devices take.
      checkpoint_dir: save after every batch and resume from there on a rerun, in a new process
        too; a changed plan, model or data is refused.
      images_dir: the judged adversarial images of batch ``b`` go to
        ``images_dir/adversarial-{b:06d}.npz`` (``x_adv``, ``example_id``; by process 0).
      keep_images: also return them all in ``per_example["x_adv"]`` (default: when the data is
        in memory).
      gallery: how many fooled examples :attr:`Evaluation.gallery` shows (the first ones).
      progress: called as ``progress(batches_done, batches_total)``.
      compile_cache: JAX's persistent compilation cache for the run: ``"auto"`` (default:
        ``$JAXBUNDLE_CACHE/xla``, unless JAX has one configured or ``$JAXBUNDLE_COMPILE_CACHE``
        says otherwise, ``off`` for none: :mod:`jaxbundle.run.compile_cache`), a directory, or
        None (JAX's configuration as it is).

    Returns:
      An :class:`Evaluation`. Adversarial images are uint8 when every clean image is stored on
      the 8-bit grid and judged there, else float32 (the judged images exactly).
    """
    with compile_cache_lib.compilation_cache(compile_cache_lib.directory(compile_cache)):
        apply_fn, params, source = _model_and_data(model, params, data, plan)
        run = _start(apply_fn, params, source, plan, mesh)
        if keep_images is None:
            keep_images = bool(getattr(source, "in_memory", False))
        uint8_images = _stored_on_grid(source, plan.threat.judging)
        if images_dir is not None:
            os.makedirs(images_dir, exist_ok=True)
        state, ckpt = _resume(run, apply_fn, params, keep_images, uint8_images, checkpoint_dir)
        lead = jax.process_index() == 0
        total = data_lib.num_batches(run.n, run.plan.run.batch_size)
        model_checks, certify_seconds = None, 0.0  # this process's first rows; its own seconds
        for index in range(state.batches_done, total):
            bx, batch = _read_batch(run, index, check_classes=index == state.batches_done)
            if index == 0:
                model_checks = _model_checks(run, params, bx)
            counts, outputs, stage_counts, arrays = _attack_batch(run, index, bx, batch)
            certify_seconds += _certify_batch(run, arrays, outputs)
            x_adv = _images(outputs, uint8_images, keep_images)
            if images_dir is not None and lead:
                checkpoint.save_images(images_dir, index, x_adv, outputs["example_id"])
            state = _add_batch(state, counts, outputs, stage_counts, x_adv, gallery)
            if ckpt is not None and lead:
                checkpoint.save(*ckpt, state)
            if progress is not None:
                progress(index + 1, total)
        if model_checks is None:  # resumed: the first batch came from the checkpoint
            model_checks = _model_checks(run, params)
        metrics, per_example = _results(run, state, model_checks, certify_seconds)
        return Evaluation(metrics=metrics, per_example=per_example,
                          attack_names=tuple(a.name for a in run.model.attacks),
                          gallery=_gallery(source, state))


def _model_checks(run: _Run, params: Any, first: np.ndarray | None = None) -> dict:
    """The model-level checks on this process's first rows of batch 0 (``first``, or read
    again when the run resumed after it)."""
    if first is None:
        batch = data_lib.local_batch(run.source, 0, run.plan.run.batch_size, *run.process)
        first = data_lib.to_unit_float(batch.x)
    return checks_lib.model_checks(run.model.apply_fn, params, first[:CHECKED],
                                   run.model.attacks)


def _images(outputs: dict, uint8: bool, keep: bool) -> np.ndarray:
    """A batch's judged images, taken out of ``outputs`` (uint8 where every clean image is
    stored on the grid and judged there) and put back as ``x_adv`` if they are kept."""
    x_adv = outputs.pop("x_adv")
    if uint8:
        x_adv = np.round(x_adv * norms.PIXEL_LEVELS).astype(np.uint8)
    if keep:
        outputs["x_adv"] = x_adv
    return x_adv


def _model_and_data(model: Any, params: Any, data: Any, plan: Plan) -> tuple[Callable, Any,
                                                                          data_lib.Source]:
    """The model as ``(apply_fn, params)`` (adapted once:
    :func:`jaxbundle.run.adapters.as_apply_fn`) and the data as a source, once the plan is
    checked: a bad plan is refused first."""
    checked = _checked(plan)
    apply_fn, params = adapters.as_apply_fn(model, params)
    return apply_fn, params, _as_source(data, checked, apply_fn, params)


def _resume(run: _Run, apply_fn: Callable, params: Any, keep_images: bool, uint8_images: bool,
            checkpoint_dir: str | None) -> tuple[checkpoint.State, tuple[str, str] | None]:
    """The state to start from (a checkpoint's, if it is this run's) and where to save it:
    ``(path, identity)``, or None without a checkpoint directory."""
    state = _empty_state(run, uint8_images)
    if checkpoint_dir is None:
        return state, None
    os.makedirs(checkpoint_dir, exist_ok=True)
    identity = _identity(run, apply_fn, params, keep_images)
    path = os.path.join(checkpoint_dir, checkpoint.FILE)
    state = checkpoint.load(path, identity, state)
    if jax.process_count() > 1:
        multihost_utils.assert_equal(
            state.batches_done, f"processes resume from different batches: {path} must be on "
            "a file system that every process shares"
        )
    return state, (path, identity)


def _checked(plan: Any) -> Plan:
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a jaxbundle.Plan (e.g. jaxbundle.bundles.default(norm, "
                        f"eps)), got {type(plan).__name__}")
    return plan.check()


def _identity(run: _Run, apply_fn: Callable, params: Any, keep_images: bool) -> str:
    """What a checkpoint must match to be resumed: the plan as run, every attack in full, the
    data, the parameters and the counts' layout."""
    return checkpoint.identity(
        plan=run.plan.describe(), attacks=[checkpoint.describe(a) for a in run.model.attacks],
        apply_fn=checkpoint.describe(run.model.apply_fn), model=checkpoint.params_digest(params),
        data=run.source.describe(), n=run.n, images=keep_images,
        counts=sorted(Counts.empty(run.setting).arrays()),
    )


def _empty_state(run: _Run, uint8_images: bool) -> checkpoint.State:
    # Host-side state only (numpy): counts are summed here, never by eager ops on global arrays.
    return checkpoint.State(
        0, jax.tree.map(np.asarray, Counts.empty(run.setting)), {},
        np.zeros((len(run.model.attacks), runners.STAGE_COLUMNS), np.int64),
        (np.zeros(0, np.int32),
         np.zeros((0, *run.source.shape), np.uint8 if uint8_images else np.float32)),
    )


def _gallery(source: data_lib.Source, state: checkpoint.State) -> dict[str, np.ndarray]:
    ids, x_adv = state.gallery
    clean = [data_lib.to_unit_float(source.read(int(i), int(i) + 1)[0]) for i in ids]
    return {
        "example_id": ids, "x_adv": x_adv,
        "x_clean": np.concatenate(clean) if clean else np.zeros((0, *source.shape), np.float32),
    }


def _read_batch(run: _Run, index: int, check_classes: bool) -> tuple[np.ndarray, data_lib.Batch]:
    """This process's rows of batch ``index`` as floats in [0, 1], checked (and, with
    ``check_classes``, the model's class count against the data's)."""
    batch = data_lib.local_batch(run.source, index, run.plan.run.batch_size, *run.process)
    bx = data_lib.to_unit_float(batch.x)
    threat = run.plan.threat
    classes = check_inputs(run.model.apply_fn, run.model.params, bx, batch.y, threat.eps,
                           judging=threat.judging)
    if check_classes and run.source.num_classes not in (None, classes):
        raise ValueError(
            f"the model has {classes} outputs but the data {run.source.name} has "
            f"{run.source.num_classes} classes"
        )
    return bx, batch


def _attack_batch(run: _Run, index: int, bx: np.ndarray, batch: data_lib.Batch):
    """Batch ``index`` attacked by the plan's runner: its counts (numpy), its per-example
    outputs on the real rows (numpy), each stage's spending ``[A, 4]`` and the batch as run
    ``(x, y, example_id, mask, real)`` (global arrays under a mesh; ``real`` on the host)."""
    size = run.plan.run.batch_size
    arrays = (bx, batch.y.astype(np.int32), batch.example_id, batch.mask)
    if run.sharding is not None:
        arrays = tuple(
            jax.make_array_from_process_local_data(run.sharding, a, (size, *a.shape[1:]))
            for a in arrays
        )
    real = np.arange(index * size, (index + 1) * size) < run.n
    counts, outputs, stage_counts = run.plan.schedule.run(
        run.model, runners.Batch(*arrays, real), run.plan.threat.eps)
    # Every output is replicated: each process reads its own full copy.
    outputs = {k: np.asarray(v)[real] for k, v in outputs.items()}
    return jax.tree.map(np.asarray, counts), outputs, stage_counts, (*arrays, real)


def _certify_batch(run: _Run, arrays: tuple, outputs: dict[str, np.ndarray]) -> float:
    """With ``plan.certify``: adds the batch's certification to ``outputs``
    (:func:`jaxbundle.certify.run.batch`) and returns the seconds it took; else 0."""
    if run.plan.certify is None:
        return 0.0
    from jaxbundle.certify import run as certify_run  # loaded when a plan certifies

    start = time.perf_counter()
    outputs.update(certify_run.batch(run.plan, run.model, *arrays[:3], outputs, arrays[4]))
    return time.perf_counter() - start


def _fooled(outputs: dict[str, np.ndarray]) -> np.ndarray:
    """Indices of correctly classified examples that an attack fooled."""
    ok = outputs["clean_prediction"] == outputs["label"]
    return np.flatnonzero(ok & outputs["success"])


def _add_batch(state: checkpoint.State, counts: Counts, outputs: dict[str, np.ndarray],
               stage_counts: np.ndarray, x_adv: np.ndarray, gallery: int) -> checkpoint.State:
    """The state after one more batch: counts summed, outputs appended, the gallery filled
    up to ``gallery`` fooled examples."""
    shown = _fooled(outputs)[: gallery - len(state.gallery[0])]
    return checkpoint.State(
        state.batches_done + 1,
        state.counts.merge(counts),
        {k: state.chunks.get(k, []) + [v] for k, v in outputs.items()},
        state.stages + stage_counts,
        (np.concatenate([state.gallery[0], outputs["example_id"][shown]]),
         np.concatenate([state.gallery[1], x_adv[shown]]) if shown.size else state.gallery[1]),
    )


def _results(run: _Run, state: checkpoint.State, model_checks: Any,
             certify_seconds: float = 0.0) -> tuple[dict, dict]:
    """The model record (:func:`jaxbundle.report.schema.model_record`) and the per-example
    arrays of a finished evaluation."""
    plan, attacks, n = run.plan, run.model.attacks, run.n
    threat = plan.threat
    per_example = {k: np.concatenate(v) for k, v in state.chunks.items()}
    per_example.pop("example_id")
    figures = state.counts.compute(run.setting)
    on_grid = figures.pop("grid_judged")
    figures["judging"] = {
        "mode": threat.judging, "grid_examples": on_grid, "float_examples": n - on_grid,
        "grid_radius": norms.grid_radius(threat.eps, threat.norm),
        "statement": judge.statement(threat.judging, threat.eps, threat.norm, on_grid, n),
    }
    figures["data"] = {"name": run.source.name, "n": n}
    figures["model_dtype"] = model_dtypes(run.model.apply_fn, run.model.params,
                                          (1, *run.source.shape))
    per_example["check_flags"] = checks_lib.example_flags(per_example, attacks)
    figures["checks"] = checks_lib.summarise(
        model_checks, per_example["check_flags"], attacks,
        int(np.sum(per_example["clean_prediction"] == per_example["label"])),
    )
    figures["check_flag_names"] = list(checks_lib.FLAG_NAMES)
    if sampling.is_stochastic(run.model.apply_fn):
        figures["stochastic"] = stochastic_metrics(run.model.apply_fn, attacks, per_example)
    per_example.update(kind_distortions(per_example, attacks))
    figures.update(curve_metrics(per_example, attacks, threat.norm))
    figures.update(plan.schedule.figures(figures, per_example, attacks, state.stages))
    if plan.certify is not None:
        from jaxbundle.certify import run as certify_run

        figures["certified"] = certify_run.figures(plan, per_example, figures["robust_accuracy"],
                                                   certify_seconds)
        if "certified_radius" in per_example:
            (figures["operating_characteristic"]["certified"],
             figures["half_distortion"]["certified"]) = certify_run.curve(per_example, threat.norm)
        checks_lib.add_certified(figures, per_example)
    return schema.model_record(plan, figures), per_example
