"""The main job: models x data x bundle -> report, as one library call.

``jaxbundle evaluate`` and the scripts in ``experiments/`` parse their flags and call
:func:`run_job`; everything they do happens here or below. For each model it

1. loads the model (a demo model: its shipped weights, or trained once and cached; or the
   user's ``MODULE:FUNCTION``) and checks it on a few examples
   (:func:`jaxbundle.models.check_model`);
2. streams the data through :func:`jaxbundle.evaluate` under the plan (resumable with
   ``checkpoint_dir``; adversarial images written to ``out/adversarial/<model>/`` with
   ``save_images``);
3. measures the natural shifts on the first examples, and, if asked, RoBIC's best-effort
   distortions and the transfer from surrogate models;

then prints the tables and writes the report (process 0 only). Compiled programs are kept on
disk (``JobOptions.compile_cache``, :mod:`jaxbundle.run.compile_cache`), so that the same
command run again does not compile again.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from jaxbundle.run import checks
from jaxbundle.run.compile_cache import compilation_cache  # noqa: F401 (re-exported)
from jaxbundle.run import progress as progress_lib
from jaxbundle.report import curves
from jaxbundle import data as data_lib
from jaxbundle import models as models_lib
from jaxbundle.report import schema
from jaxbundle.run.checkpoint import saved_batch_size
from jaxbundle.run.defences import declared, with_bpda
from jaxbundle.evaluation import Evaluation, evaluate, for_model
from jaxbundle.plan import Plan
from jaxbundle.core.sampling import is_stochastic

__all__ = [
    "JobOptions",
    "ModelRef",
    "demo_model",
    "compilation_cache",
    "run_job",
    "start_distributed",
    "user_model",
]

SHIFT_EXAMPLES = 1000  # natural shifts are measured on at most this many examples ...
_SHIFT_BYTES = 256 * 2**20  # ... and at most this much float32 image memory


class ModelRef(NamedTuple):
    """A model to evaluate, loaded when its turn comes.

    Attributes:
      name: its name in the report.
      load: ``load(progress) -> (apply_fn, params)``; ``progress(done, total)`` reports training.
      origin: what the report records about where it came from.
    """

    name: str
    load: Callable[[Callable[[int, int], None] | None], tuple[Callable, Any]]
    origin: str


def demo_model(
    name: str,
    *,
    cache_dir: str | None = None,
    train_examples: int | None = None,
    train_epochs: int | None = None,
) -> ModelRef:
    """A demo CNN of :data:`jaxbundle.models.MODELS`, trained on first use and then cached, or
    a demo defence of :data:`jaxbundle.models.DEFENCES` (one behind a preprocessing)."""
    defence = models_lib.DEFENCES.get(name)
    known = sorted(models_lib.MODELS) + sorted(models_lib.DEFENCES)
    if name not in models_lib.MODELS and defence is None:
        raise ValueError(f"unknown demo model {name!r}; choose from {known}")
    config = models_lib.MODELS[defence.base if defence else name]
    if train_examples is not None:
        config = config._replace(n_train=train_examples)
    if train_epochs is not None:
        config = config._replace(epochs=train_epochs)

    def load(progress):
        apply_fn, params = models_lib.load_or_train(config, cache_dir=cache_dir, progress=progress)
        if defence is not None:
            apply_fn = defence.wrap(apply_fn)
        return apply_fn, params

    return ModelRef(name, load, f"demo:{name}")


def user_model(spec: str) -> ModelRef:
    """The user's model ``[NAME=]MODULE:FUNCTION`` (see :mod:`jaxbundle.models.loading`)."""
    parsed = models_lib.parse_spec(spec)

    def load(progress):
        loaded = models_lib.load_model(parsed)
        return loaded.apply_fn, loaded.params

    return ModelRef(parsed.name, load, f"{parsed.module}:{parsed.function}")


def start_distributed(
    distributed: bool = False,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """``jax.distributed.initialize`` when asked for or when any of its settings is given
    (TPU pods, SLURM and Open MPI are detected with no settings at all)."""
    if not distributed and coordinator is None and num_processes is None and process_id is None:
        return
    n, i = num_processes, process_id
    if i is not None and not 0 <= i < (n or i + 1):
        raise ValueError(f"the process id must be in 0..{n - 1 if n else 'N-1'}, got {i}")
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )


def _in_memory(source: data_lib.Source, n: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = source.read(0, n)
    return data_lib.to_unit_float(x), np.asarray(y, np.int32)


def _shift_examples(source: data_lib.Source) -> int:
    per_image = 4 * int(np.prod(source.shape))
    return max(1, min(len(source), SHIFT_EXAMPLES, _SHIFT_BYTES // per_image))


def _batched(source: data_lib.Source, batch_size: int):
    """Every batch of ``source`` (one process), images as float32."""
    for index in range(data_lib.num_batches(len(source), batch_size)):
        b = data_lib.local_batch(source, index, batch_size)
        yield b._replace(x=data_lib.to_unit_float(b.x), y=b.y.astype(np.int32))


def best_effort_metrics(plan: Plan, apply_fn: Callable, params: Any, source: data_lib.Source,
                        iterations: int = 8) -> tuple[dict, np.ndarray]:
    """RoBIC's best-effort mode over the whole source: the P(D) curve and D1/2 of the plan's
    fixed-budget white-box attacks' bisected distortions (up to the plan's eps), and those
    distortions per example."""
    from jaxbundle.studies.best_effort import best_effort

    fixed = tuple(a for a in plan.attack_values() if a.goal == "misclassify" and not a.black_box)
    if not fixed:
        raise ValueError("best-effort mode needs a fixed-budget white-box attack in the bundle")
    key, parts, threat = jax.random.key(plan.run.seed), [], plan.threat
    for b in _batched(source, plan.run.batch_size):
        r = best_effort(fixed, apply_fn, params, b.x, b.y, key, eps_max=threat.eps,
                        norm=threat.norm, iterations=iterations, example_id=b.example_id,
                        judging=threat.judging)
        ok = np.asarray(apply_fn(params, b.x)).argmax(-1) == b.y
        parts.append((np.asarray(r.distortion)[b.mask], ok[b.mask],
                      np.asarray(r.gradients)[b.mask]))
    d, ok, gradients = (np.concatenate(p) for p in zip(*parts))
    grid = curves.distortion_grid(threat.norm)
    metrics = {
        "attacks": [a.name for a in fixed], "eps_max": threat.eps, "iterations": iterations,
        "operating_characteristic": {
            "grid": grid.tolist(), "bundled": curves.operating_characteristic(d, ok, grid).tolist()
        },
        "half_distortion": curves.half_distortion(d, ok),
        "gradients_per_example": float(np.mean(gradients)),
    }
    return metrics, d


def transfer_metrics(plan: Plan, surrogates: Sequence[tuple[str, Callable, Any]],
                     apply_fn: Callable, params: Any, source: data_lib.Source
                     ) -> tuple[dict, np.ndarray]:
    """Transfer bundling from the surrogates over the whole source, with the plan's white-box
    attacks: the target's robust accuracy under the voted transfer and under each surrogate, and
    per-example success."""
    from jaxbundle.studies.transfer import transfer_bundle

    white = tuple(a for a in plan.attack_values() if not a.black_box)
    if not white:
        raise ValueError("transfer from surrogates needs a white-box attack in the bundle")
    names = [s[0] for s in surrogates]
    pairs = [(s[1], s[2]) for s in surrogates]
    key, parts, threat = jax.random.key(plan.run.seed), [], plan.threat
    for b in _batched(source, plan.run.batch_size):
        r = transfer_bundle(white, pairs, apply_fn, params, b.x, b.y, key, eps=threat.eps,
                            norm=threat.norm, example_id=b.example_id, judging=threat.judging)
        m = b.mask
        parts.append((np.asarray(r.target_clean_correct)[m], np.asarray(r.success)[m],
                      np.asarray(r.surrogate_success)[:, m]))
    ok, success, each = (np.concatenate(p, axis=-1) for p in zip(*parts))
    pct = lambda fooled: 100.0 * float(np.sum(ok & ~fooled)) / ok.size  # noqa: E731
    metrics = {
        "surrogates": names, "attacks": [a.name for a in white],
        "clean_accuracy": 100.0 * float(ok.mean()),
        "transfer_robust_accuracy": pct(success),
        "per_surrogate": {name: pct(s) for name, s in zip(names, each)},
    }
    return metrics, success


class JobOptions(NamedTuple):
    """What the job does besides evaluating each model under the plan."""

    out: str  # the report directory
    shifts: bool = True  # natural shifts on the first examples (see SHIFT_EXAMPLES)
    checkpoint_dir: str | None = None  # resume from / checkpoint to checkpoint_dir/<model>/
    save_images: bool = False  # adversarial images to out/adversarial/<model>/
    best_effort: bool = False  # RoBIC's best-effort distortions (bisection on eps up to eps)
    surrogates: Sequence[ModelRef] = ()  # models the attacker owns: transfer of their candidates
    bpda: bool = False  # attack the models that declare a preprocessing with BPDA
    auto_batch: bool = False  # each model's batch size fitted to the memory (jaxbundle.run.memory)
    compile_cache: str | None = "auto"  # jaxbundle.evaluate's (jaxbundle.run.compile_cache)


def run_job(
    models: Sequence[ModelRef],
    source: data_lib.Source,
    plan: Plan,
    job: JobOptions,
    *,
    threat_model: dict | None = None,
    console: Any = None,
    show_progress: bool = True,
) -> tuple[str | None, dict[str, tuple[Evaluation, float]]]:
    """Evaluates every model on ``source`` under ``plan`` and writes the report to
    ``job.out``.

    Args:
      models: the models (see :func:`demo_model` and :func:`user_model`).
      source: the data (see :func:`jaxbundle.data.open_source`).
      plan: the :class:`jaxbundle.Plan`; each model runs :func:`jaxbundle.evaluate` with it (a
        deterministic model without the plan's stochastic options, which are for the
        stochastic ones).
      job: what the job does besides evaluating (:class:`JobOptions`: the report directory
        ``out``, ``shifts``, ``checkpoint_dir``, ``save_images``, ``best_effort``,
        ``surrogates``; ``bpda``: the models that declare a preprocessing,
        :func:`jaxbundle.defended`, attacked with BPDA, the others as they are;
        ``auto_batch``: each model's batch size fitted to the memory, :func:`fitted_batch_size`).
        Data held in memory (``source.in_memory``: the embedded sample, arrays) also keeps the
        adversarial images in the report's per-example file.

      threat_model: the preset the threat model came from (:func:`jaxbundle.presets.resolve`),
        for the report's ``config``.
      console: a ``rich`` console to print progress and the tables on (process 0).
      show_progress: progress bars on ``console``.
    Returns:
      ``(path of report.json or None on processes other than 0, {model: (evaluation,
      seconds)})``.
    """
    from jaxbundle.report.writers import print_tables, write_report

    plan.check()
    names = [m.name for m in models]
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"model names must be unique and at least one, got {names}")
    if (job.best_effort or job.surrogates) and jax.process_count() > 1:
        raise ValueError("best-effort mode and surrogates run in a single process for now")
    lead = jax.process_index() == 0
    progress = progress_lib.progress(console, show_progress and lead)
    results: dict[str, tuple[Evaluation, float]] = {}
    sample_x, _ = _in_memory(source, min(len(source), 8))
    with progress:
        surrogates = [(ref.name, *_load_checked(ref, progress, f"surrogate {ref.name}: load",
                                                sample_x, source)) for ref in job.surrogates]
        for ref in models:
            apply_fn, params = _load_checked(ref, progress, f"{ref.name}: train or load",
                                             sample_x, source)
            if job.bpda and declared(apply_fn) is not None:
                apply_fn = with_bpda(apply_fn)
            results[ref.name] = _evaluate_model(ref, apply_fn, params, source, plan, job,
                                                surrogates, progress)
    if not lead:
        return None, results
    if console is not None:
        print_tables(console, results)
    record = schema.config_record(
        threat_model=threat_model, plan=plan.describe(),
        dataset=source.name, n=len(source), models=names,
        model_origins={m.name: m.origin for m in models},
        surrogates={m.name: m.origin for m in job.surrogates}, best_effort=job.best_effort,
        shifts=job.shifts, processes=jax.process_count(), devices=jax.device_count(),
    )
    return write_report(job.out, record, results), results


def _evaluate_model(ref: ModelRef, apply_fn: Callable, params: Any, source: data_lib.Source,
                    plan: Plan, job: JobOptions, surrogates: list, progress
                    ) -> tuple[Evaluation, float]:
    """One model of the job: its evaluation under the plan, then the shifts, best-effort
    distortions and transfer asked for, and the seconds it all took."""
    from jaxbundle.studies.shifts import evaluate_shifts

    if is_stochastic(apply_fn):
        if job.best_effort or surrogates:
            raise ValueError(
                f"model {ref.name!r} is stochastic: best-effort mode and surrogates do not "
                "support stochastic models yet (drop --best-effort / --surrogate)")
    else:  # --eot and the judge's settings are for the stochastic models of the job
        plan = plan.replace(eot=1, judge_calls=None, success_threshold=None)
    ckpt = None if job.checkpoint_dir is None else os.path.join(job.checkpoint_dir, ref.name)
    if job.auto_batch:  # a resumed run keeps the size it was fitted to (its identity has it)
        saved = None if ckpt is None else saved_batch_size(ckpt)
        plan = plan.replace(batch_size=saved or fitted_batch_size(plan, apply_fn, params,
                                                                  source.shape))
    task = progress.add_task(f"{ref.name}: attack", total=None)
    start = time.perf_counter()
    evaluation = evaluate(
        apply_fn, params, source, plan,
        checkpoint_dir=ckpt,
        images_dir=os.path.join(job.out, "adversarial", ref.name) if job.save_images else None,
        progress=lambda done, total: progress.update(task, completed=done, total=total),
        compile_cache=job.compile_cache,
    )
    extras: dict[str, Any] = {"model": ref.origin}
    pe = evaluation.per_example
    if job.shifts:
        progress.update(task, description=f"{ref.name}: natural shifts")
        x, y = _in_memory(source, _shift_examples(source))
        judged = for_model(plan, apply_fn)[0]  # a stochastic model as the plan judges it
        extras.update(shifts=evaluate_shifts(judged, params, x, y, seed=plan.run.seed),
                      shift_examples=len(y))
    if job.best_effort:
        progress.update(task, description=f"{ref.name}: best effort")
        extras["best_effort"], d = best_effort_metrics(plan, apply_fn, params, source)
        pe["best_effort_distortion"] = d
    if surrogates:
        progress.update(task, description=f"{ref.name}: transfer")
        extras["transfer"], success = transfer_metrics(plan, surrogates, apply_fn, params,
                                                       source)
        pe["transfer_success"] = success
    metrics = schema.with_extras(evaluation.metrics, **extras)
    if job.best_effort:
        checks.add(metrics, pe, "non_monotone", checks.non_monotone(pe, d),
                   "{count} correctly classified examples were fooled by the bisection "
                   "at a radius at most eps but not by the evaluation at eps")
    if surrogates:
        checks.add(metrics, pe, "transfer_beats_white_box",
                   checks.transfer_beats_white_box(pe, success, plan.attack_values()),
                   "{count} correctly classified examples were fooled by a surrogate's "
                   "transfer and by no white-box attack on the model")
    return evaluation._replace(metrics=metrics), time.perf_counter() - start


def fitted_batch_size(plan: Plan, apply_fn: Callable, params: Any,
                      image_shape: Sequence[int]) -> int:
    """The batch size of :func:`jaxbundle.run.memory.auto_batch_size` for ``plan``'s attacks on this
    model, over every device of every process (the smallest of the processes' answers, so that
    all run the same batches)."""
    from jaxbundle.run import memory

    devices = jax.device_count()
    size = memory.auto_batch_size(for_model(plan, apply_fn)[1], plan.run.restart_mode, apply_fn,
                                  params, image_shape, devices=devices)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        size = int(np.min(multihost_utils.process_allgather(np.int64(size))))
    return size


def _load_checked(ref: ModelRef, progress, description: str, sample_x: np.ndarray,
                  source) -> tuple:
    task = progress.add_task(description, total=None)
    apply_fn, params = ref.load(
        lambda done, total: progress.update(task, completed=done, total=total)
    )
    models_lib.check_model(apply_fn, params, sample_x, source.num_classes, name=ref.name)
    return apply_fn, params
