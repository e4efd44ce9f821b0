"""The main job: models x data x bundle -> report, as one library call.

``jaxbundle evaluate`` and the scripts in ``experiments/`` parse their flags and call
:func:`run_job`; everything they do happens here or below. For each model it

1. loads the model (a demo model, trained once and cached, or the user's ``MODULE:FUNCTION``)
   and checks it on a few examples (:func:`jaxbundle.models.check_model`);
2. streams the data through :func:`jaxbundle.evaluate.evaluate_source` (resumable with
   ``checkpoint_dir``; adversarial images written to ``out/adversarial/<model>/`` with
   ``save_images``);
3. measures the natural shifts on the first examples, and, if asked, RoBIC's best-effort
   distortions and the transfer from surrogate models;

then prints the tables and writes the report (process 0 only). :func:`compilation_cache` keeps
compiled programs on disk so that the same command run again does not compile again.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import jax
import numpy as np

from jaxbundle import checks
from jaxbundle import curves
from jaxbundle import data as data_lib
from jaxbundle import models as models_lib
from jaxbundle import sampling
from jaxbundle.attacks.base import Attack
from jaxbundle.evaluate import Evaluation, evaluate_source
from jaxbundle.sampling import is_stochastic

__all__ = [
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
    a demo defence of :data:`jaxbundle.models.DEFENCES` (a stochastic model around one)."""
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
            apply_fn = models_lib.randomized(apply_fn, noise=defence.noise, shift=defence.shift)
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


@contextlib.contextmanager
def compilation_cache(directory: str | os.PathLike | None) -> Iterator[None]:
    """JAX's persistent compilation cache in ``directory`` while the block runs (``None``: no
    change): programs compiled once are read back by every later run with the same shapes,
    code and JAX version. The previous settings are restored afterwards, so a command run
    inside another program (a test, a notebook) leaves its JAX configuration as it was."""
    if directory is None:
        yield
        return
    from jax._src import compilation_cache as cache_lib

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    previous = {name: getattr(jax.config, name) for name in names}
    for name, value in zip(names, (directory, 0.0, 0)):
        jax.config.update(name, value)
    cache_lib.reset_cache()
    try:
        yield
    finally:
        for name, value in previous.items():
            jax.config.update(name, value)
        cache_lib.reset_cache()


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


def best_effort_metrics(
    attacks: Sequence[Attack], apply_fn: Callable, params: Any, source: data_lib.Source, *,
    eps_max: float, norm: str, seed: int, batch_size: int, judging: str, iterations: int = 8,
) -> tuple[dict, np.ndarray]:
    """RoBIC's best-effort mode over the whole source: the P(D) curve and D1/2 of the
    fixed-budget attacks' bisected distortions, and those distortions per example."""
    from jaxbundle.best_effort import best_effort

    fixed = tuple(a for a in attacks if a.goal == "misclassify" and not a.black_box)
    if not fixed:
        raise ValueError("best-effort mode needs a fixed-budget white-box attack in the bundle")
    key, parts = jax.random.key(seed), []
    for b in _batched(source, batch_size):
        r = best_effort(fixed, apply_fn, params, b.x, b.y, key, eps_max=eps_max, norm=norm,
                        iterations=iterations, example_id=b.example_id, judging=judging)
        ok = np.asarray(apply_fn(params, b.x)).argmax(-1) == b.y
        parts.append((np.asarray(r.distortion)[b.mask], ok[b.mask],
                      np.asarray(r.gradients)[b.mask]))
    d, ok, gradients = (np.concatenate(p) for p in zip(*parts))
    grid = curves.distortion_grid(norm)
    metrics = {
        "attacks": [a.name for a in fixed], "eps_max": eps_max, "iterations": iterations,
        "operating_characteristic": {
            "grid": grid.tolist(), "bundled": curves.operating_characteristic(d, ok, grid).tolist()
        },
        "half_distortion": curves.half_distortion(d, ok),
        "gradients_per_example": float(np.mean(gradients)),
    }
    return metrics, d


def transfer_metrics(
    attacks: Sequence[Attack], surrogates: Sequence[tuple[str, Callable, Any]], apply_fn: Callable,
    params: Any, source: data_lib.Source, *, eps: float, norm: str, seed: int, batch_size: int,
    judging: str,
) -> tuple[dict, np.ndarray]:
    """Transfer bundling from the surrogates over the whole source: the target's robust
    accuracy under the voted transfer and under each surrogate, and per-example success."""
    from jaxbundle.transfer import transfer_bundle

    white = tuple(a for a in attacks if not a.black_box)
    if not white:
        raise ValueError("transfer from surrogates needs a white-box attack in the bundle")
    names = [s[0] for s in surrogates]
    pairs = [(s[1], s[2]) for s in surrogates]
    key, parts = jax.random.key(seed), []
    for b in _batched(source, batch_size):
        r = transfer_bundle(white, pairs, apply_fn, params, b.x, b.y, key, eps=eps, norm=norm,
                            example_id=b.example_id, judging=judging)
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


def run_job(
    models: Sequence[ModelRef],
    source: data_lib.Source,
    attacks: Sequence[Attack],
    *,
    out: str,
    eps: float,
    norm: str = "linf",
    seed: int = 0,
    batch_size: int = 250,
    judging: str = "auto",
    shifts: bool = True,
    checkpoint_dir: str | None = None,
    save_images: bool = False,
    best_effort: bool = False,
    surrogates: Sequence[ModelRef] = (),
    schedule: str = "full",
    threshold: float | None = None,
    budget: float | None = None,
    focus: dict[str, float] | None = None,
    segments: int = 1,
    eot: int = 1,
    judge_calls: int | None = None,
    success_threshold: float | None = None,
    config: dict | None = None,
    console: Any = None,
    show_progress: bool = True,
) -> tuple[str | None, dict[str, tuple[Evaluation, float]]]:
    """Evaluates every model on ``source`` under ``attacks`` and writes the report to ``out``.

    Args:
      models: the models (see :func:`demo_model` and :func:`user_model`).
      source: the data (see :func:`jaxbundle.data.open_source`).
      attacks: the bundle.
      out: the report directory.
      eps, norm, seed, batch_size, judging: as in :func:`jaxbundle.evaluate.evaluate_source`.
      shifts: also measure the natural shifts (on the first examples, see ``SHIFT_EXAMPLES``).
      checkpoint_dir: resume from / checkpoint to ``checkpoint_dir/<model>/`` after every batch.
      save_images: write the adversarial images to ``out/adversarial/<model>/`` as they are
        made. Data held in memory (``source.in_memory``: the embedded sample, arrays) also keeps
        them in the report's per-example file.
      best_effort: add RoBIC's best-effort distortions (bisection on eps up to ``eps``).
      surrogates: models the attacker owns; adds the transfer of their candidates.
      schedule, threshold, budget: ``"full"`` or ``"cascade"`` (see
        :func:`jaxbundle.evaluate.evaluate_source`); with ``threshold`` t the cascade drops an
        example once a wrong class reaches confidence t (max-confidence goal), else once it is
        misclassified; ``budget``: model passes per example for the cascade.
      focus: attack name -> fraction: the cascade runs that attack only on the most promising
        survivors (see :mod:`jaxbundle.schedule`).
      segments: the cascade runs each attack's steps in this many segments; an example
        satisfied after one stops there.
      eot, judge_calls, success_threshold: for the stochastic models only (see
        :mod:`jaxbundle.sampling`): every attack averages ``eot`` samples per model call, and
        the judge's calls per candidate and success-rate threshold replace the model's own.
      config: what the report's ``config`` records besides what this function knows.
      console: a ``rich`` console to print progress and the tables on (process 0).
      show_progress: progress bars on ``console``.

    Returns:
      ``(path of report.json or None on processes other than 0, {model: (evaluation,
      seconds)})``.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.progress import TimeElapsedColumn

    from jaxbundle.report import print_tables, write_report
    from jaxbundle.shifts import evaluate_shifts

    names = [m.name for m in models]
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"model names must be unique and at least one, got {names}")
    if (best_effort or surrogates) and jax.process_count() > 1:
        raise ValueError("best-effort mode and surrogates run in a single process for now")
    lead = jax.process_index() == 0
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, disable=console is None or not show_progress or not lead,
    )
    loaded_surrogates = []
    results: dict[str, tuple[Evaluation, float]] = {}
    sample_x, _ = _in_memory(source, min(len(source), 8))
    with progress:
        for ref in surrogates:
            task = progress.add_task(f"surrogate {ref.name}: load", total=None)
            apply_fn, params = _load_checked(ref, progress, task, sample_x, source)
            loaded_surrogates.append((ref.name, apply_fn, params))
        for ref in models:
            task = progress.add_task(f"{ref.name}: train or load", total=None)
            apply_fn, params = _load_checked(ref, progress, task, sample_x, source)
            model_attacks = attacks
            if is_stochastic(apply_fn):
                if best_effort or loaded_surrogates:
                    raise ValueError(
                        f"model {ref.name!r} is stochastic: best-effort mode and surrogates do not "
                        "support stochastic models yet (drop --best-effort / --surrogate)")
                apply_fn = sampling.stochastic(
                    apply_fn.apply_fn,
                    calls=apply_fn.calls if judge_calls is None else judge_calls,
                    threshold=apply_fn.threshold if success_threshold is None
                    else success_threshold)
                model_attacks = sampling.with_eot(attacks, eot)
            progress.update(task, description=f"{ref.name}: attack")
            start = time.perf_counter()
            step = lambda done, total: progress.update(task, completed=done, total=total)  # noqa: E731
            evaluation = evaluate_source(
                apply_fn, params, source, model_attacks, eps=eps, norm=norm, seed=seed,
                batch_size=batch_size, judging=judging, progress=step,
                checkpoint_dir=(None if checkpoint_dir is None
                                else os.path.join(checkpoint_dir, ref.name)),
                images_dir=os.path.join(out, "adversarial", ref.name) if save_images else None,
                keep_images=getattr(source, "in_memory", False), schedule=schedule,
                schedule_goal="misclassify" if threshold is None else "max_confidence",
                threshold=threshold, budget=budget, focus=focus, segments=segments,
            )
            metrics = evaluation.metrics
            metrics["model"] = ref.origin
            if shifts:
                progress.update(task, description=f"{ref.name}: natural shifts")
                x, y = _in_memory(source, _shift_examples(source))
                metrics["shifts"] = evaluate_shifts(apply_fn, params, x, y, seed=seed)
                metrics["shift_examples"] = len(y)
            common = dict(norm=norm, seed=seed, batch_size=batch_size, judging=judging)
            if best_effort:
                progress.update(task, description=f"{ref.name}: best effort")
                metrics["best_effort"], d = best_effort_metrics(
                    attacks, apply_fn, params, source, eps_max=eps, **common
                )
                evaluation.per_example["best_effort_distortion"] = d
                pe = evaluation.per_example
                checks.add(metrics, pe, "non_monotone", checks.non_monotone(pe, d),
                           "{count} correctly classified examples were fooled by the bisection "
                           "at a radius at most eps but not by the evaluation at eps")
            if loaded_surrogates:
                progress.update(task, description=f"{ref.name}: transfer")
                metrics["transfer"], success = transfer_metrics(
                    attacks, loaded_surrogates, apply_fn, params, source, eps=eps, **common
                )
                evaluation.per_example["transfer_success"] = success
                pe = evaluation.per_example
                checks.add(metrics, pe, "transfer_beats_white_box",
                           checks.transfer_beats_white_box(pe, success, attacks),
                           "{count} correctly classified examples were fooled by a surrogate's "
                           "transfer and by no white-box attack on the model")
            results[ref.name] = (evaluation, time.perf_counter() - start)
    if not lead:
        return None, results
    if console is not None:
        print_tables(console, results)
    record = dict(config or {})
    record.update(
        dataset=source.name, n=len(source), eps=eps, norm=norm, seed=seed, judging=judging,
        batch_size=batch_size, attacks=[a.name for a in attacks], models=names,
        model_origins={m.name: m.origin for m in models},
        surrogates={m.name: m.origin for m in surrogates}, best_effort=best_effort,
        schedule=schedule, threshold=threshold, budget=budget, focus=dict(focus or {}),
        segments=segments, eot=eot, judge_calls=judge_calls, success_threshold=success_threshold,
        processes=jax.process_count(), devices=jax.device_count(),
    )
    return write_report(out, record, results), results


def _load_checked(ref: ModelRef, progress, task, sample_x: np.ndarray, source) -> tuple:
    apply_fn, params = ref.load(
        lambda done, total: progress.update(task, completed=done, total=total)
    )
    models_lib.check_model(apply_fn, params, sample_x, source.num_classes, name=ref.name)
    return apply_fn, params
