"""The report's schema, in one place: every field of a model's record and of its per-example file.

``report.json`` is ``{"schema_version": SCHEMA_VERSION, "jaxbundle_version", "config",
"models": {name: record}}``. A model's record has exactly the fields of :data:`MODEL_FIELDS`,
in that order, ``null`` where a field does not apply to the run (the MAT of a cascade, the
failure-rate curve without the max-confidence goal, the shifts with ``--no-shifts``, ...).
:func:`model_record` builds it from the plan and the figures (:func:`jaxbundle.evaluate`), and
:func:`with_extras` adds what the job and the report writer know; both refuse a field the
schema does not list, so a new figure cannot appear undocumented. docs/report.md shows these
tables (a test keeps them equal). Infinite values are written as the string ``"inf"``.

Version 2 (from 1): ``mat`` is ``null`` rather than ``{}`` in a cascade; every field is present
in every record (``null`` when it does not apply); ``plan`` (the plan as run: its
description) replaces the record's ``seed``; attacks are named as in ``--attacks`` (the
default bundle's targeted stage is ``apgd-t5``, not ``apgd-t``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CONFIG_FIELDS", "MODEL_FIELDS", "PER_EXAMPLE", "SCHEMA_VERSION", "config_record",
           "markdown_tables", "model_record", "with_extras"]

SCHEMA_VERSION = 2

# The run's config: (field, what it holds)
CONFIG_FIELDS: tuple[tuple[str, str], ...] = (
    ("threat_model", "{preset, reference, overridden}: the preset the threat model came from "
     "(the CLI; null from Python)"),
    ("plan", "the plan (jaxbundle.Plan.describe()); each model's record holds the plan as run on "
     "it (a deterministic model: without the stochastic options)"),
    ("dataset", "the data source's name"),
    ("n", "examples"),
    ("models", "the models' names, in order"),
    ("model_origins", "{model: demo:NAME or MODULE:FUNCTION}"),
    ("surrogates", "{surrogate: origin} (--surrogate)"),
    ("best_effort", "whether RoBIC's best-effort mode ran"),
    ("shifts", "whether the natural shifts were measured"),
    ("processes", "jax.process_count()"),
    ("devices", "jax.device_count()"),
)

# (field, what it holds, when it is null)
MODEL_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("n_examples", "examples evaluated", ""),
    ("clean_accuracy", "percent of examples classified correctly", ""),
    ("robust_accuracy", "percent correct under every attack, per example (the bundled figure)",
     ""),
    ("relative_robustness", "robust / clean correct x 100", "no example is correct"),
    ("mat", "{attack: percent robust accuracy of that attack alone} (many-attack table)",
     "cascade (an attack saw only the survivors of the ones before)"),
    ("wat", "lowest single-attack robust accuracy (worst-attack table)", "cascade"),
    ("wat_attack", "the attack of the WAT", "cascade"),
    ("white_box_robust_accuracy", "percent robust under the white-box attacks together",
     "no white-box attack, or a cascade that runs one after a black-box one"),
    ("black_box_robust_accuracy", "percent robust under the black-box attacks together",
     "no black-box attack, or a cascade"),
    ("black_box_only", "examples only a black-box attack fooled (gradient masking?)",
     "a cascade that runs a white-box attack after a black-box one"),
    ("confident_failure_rate", "{threshold: percent fooled with a wrong class at least that "
     "confident}", "the max_confidence goal is not tracked"),
    ("eps", "the threat model's radius", ""),
    ("norm", "the threat model's norm: linf or l2", ""),
    ("goals", "the goals tracked", ""),
    ("plan", "the plan as run (jaxbundle.Plan.describe(): threat model, attacks, overrides, "
     "schedule, run options, stochastic options)", ""),
    ("schedule", "{mode, goal, threshold, budget, focus, floor, probe, escalate, widen, segments, "
     "buckets, stages, skipped, statement}: stages (cascade) list per attack the survivors it "
     "could run on, the examples it ran on, the survivors focus, budget and escalate skipped, "
     "those a probe cut short, rows computed, gradients, queries and the robust accuracy "
     "after it; skipped: the skipped and cut, summed; statement: when any were, that the "
     "robust accuracy is an upper bound a full run could lower", ""),
    ("judging", "{mode, grid_examples, float_examples, grid_radius, statement}: how successes "
     "were judged", ""),
    ("data", "{name, n}", ""),
    ("model_dtype", "{logits, params, compute, precision, statement}: the dtype of the "
     "model's logits, of its parameters and of its matrix products and convolutions (margins "
     "and judging use the logits widened to float32 exactly), the precisions the model sets "
     "on them itself, and the arithmetic of the verdicts (float32 Precision.HIGHEST, "
     "jaxbundle.core.arithmetic)", ""),
    ("checks", "{check: {passed, saw, means, advice, examples}} (jaxbundle.run.checks)", ""),
    ("check_flag_names", "the columns of the per-example check_flags", ""),
    ("operating_characteristic", "{grid: [D], white_box | black_box | bundled: [P(D)]} "
     "(a cascade keeps bundled only; with --certify, certified: the fraction not certified "
     "at D, an upper bound on P(D))", ""),
    ("half_distortion", "{white_box | black_box | bundled | certified: {d_half, "
     "fooled_fraction, n_correct}} (RoBIC's D1/2; certified: a lower bound)", ""),
    ("attack_contribution", "{attack: {won, only_this}}", ""),
    ("gradients_per_example", "gradient evaluations per example (a cascade: the mean spent)",
     ""),
    ("queries_per_example", "black-box model queries per example (a cascade: the mean spent)",
     ""),
    ("robustness_vs_compute", "{cost: [gradients + queries], robust_accuracy: [...]}", ""),
    ("failure_rate_curve", "{thresholds, attacked, clean}: a confidence-thresholding "
     "defence's failure rate", "the max_confidence goal is not tracked"),
    ("stochastic", "{calls, threshold, eot, statement, mean_success_rate (held-out calls), "
     "mean_selection_success_rate, mean_clean_success_rate, heldout_calls_per_example, "
     "robust_accuracy_at_threshold}",
     "a deterministic model"),
    ("certified", "{method, classifier (model; smoothing: smoothed), radius: {grid, float}, "
     "arithmetic (the precision the certificates hold at: highest), "
     "certified_robust_accuracy, interval: [certified, bundled] robust accuracy, undecided "
     "(robust under attack, not certified), certified_and_fooled and bound_above_model "
     "(always 0), exact: {certified, attacked, unknown, off_grid, bound_certified, "
     "missed_by_attacks} (complete mode), smoothed: {clean_accuracy, abstained} (smoothing, "
     "whose classifier is not the attacked one: no interval), seconds, statement}: the "
     "certified lower bound (jaxbundle.certify)", "without --certify"),
    ("model", "where the model came from (demo:NAME or MODULE:FUNCTION)", "the API"),
    ("shifts", "{clean_accuracy, shift: {severity: {accuracy, relative_robustness}}}",
     "--no-shifts, or the API"),
    ("shift_examples", "examples the shifts were measured on", "no shifts"),
    ("best_effort", "RoBIC's best-effort mode: {attacks, eps_max, iterations, "
     "operating_characteristic, half_distortion, gradients_per_example}",
     "without --best-effort"),
    ("transfer", "{surrogates, attacks, clean_accuracy, transfer_robust_accuracy, "
     "per_surrogate}", "without --surrogate"),
    ("per_example", "the model's per-example file, <model>.npz", "the API"),
    ("figures", "{figure: file.png}", "the API"),
    ("seconds", "wall-clock seconds of the model's evaluation", "the API"),
)

# Arrays of a model's <model>.npz (and Evaluation.per_example), all of length n_examples.
PER_EXAMPLE: tuple[tuple[str, str], ...] = (
    ("label", "the true class"),
    ("clean_prediction", "the model's class on the clean image"),
    ("success", "bool: a verified adversarial example was found"),
    ("distortion", "the reported adversarial image's distortion"),
    ("adversarial_prediction", "the model's class on the reported image"),
    ("winning_attack", "index into attack_names of the attack that found it; -1: the clean "
     "image"),
    ("winning_restart", "its restart"),
    ("winning_step", "its step"),
    ("attack_success", "[n, A] bool: each attack alone (a cascade: False where it did not run)"),
    ("attack_distortion", "[n, A]: each attack's smallest verified adversarial distortion; inf: "
     "none"),
    ("attack_step", "[n, A]: the step of each attack's best candidate; -1: it never beat the "
     "clean image, -2: it did not run"),
    ("attack_improving", "[n, A] bool: the attack failed while its margin was still rising"),
    ("clean_wrong_confidence", "a misclassified clean image's top probability, else 0"),
    ("gradients", "gradient evaluations spent (every EOT sample counts)"),
    ("queries", "black-box model queries spent (every EOT sample counts)"),
    ("black_box_only", "bool: fooled only by black-box attacks"),
    ("judged_on_grid", "bool: judged on the 8-bit grid (else in float32)"),
    ("zero_gradient", "bool: the clean cross-entropy gradient is exactly zero"),
    ("max_wrong_confidence", "highest wrong-class confidence in the ball (max_confidence goal)"),
    ("min_distortion", "smallest adversarial distortion found (min_norm goal); inf: none"),
    ("min_distortion_white_box", "the same over the white-box attacks"),
    ("min_distortion_black_box", "the same over the black-box attacks"),
    ("min_distortion_bundled", "the same over every attack"),
    ("check_flags", "[n, F] bool: the per-example checks named by check_flag_names"),
    ("x_adv", "the judged adversarial images (uint8 when all were judged on the 8-bit grid, "
     "else float32); with --save-images or data in memory"),
    ("success_rate", "stochastic models: the fraction of held-out judge calls (calls that "
     "neither the attacks nor the choice of the winner saw) that misclassify the reported "
     "image; success is success_rate > threshold"),
    ("selection_success_rate", "stochastic models: the same on the calls that chose the winner "
     "(biased upward by the choice; kept to show by how much)"),
    ("clean_success_rate", "stochastic models: success_rate for the clean image"),
    ("certified", "with --certify: bool, certified robust at the radius the judge accepts"),
    ("bound_margin", "with --certify (a bound method): a lower bound on the smallest "
     "wrong-class margin z_y - z_j over the input set; > 0: certified"),
    ("clean_margin", "with --certify (a bound method): the model's own smallest margin at the "
     "clean image, as the judge computes it (never below bound_margin)"),
    ("bound_certified", "with --certify complete: CROWN's own verdict, before the MIP"),
    ("certified_radius", "with --certify and the min_norm goal: a radius the example is "
     "certified at (bisection; 0: none), the certified side of P(D); smoothing: the L2 radius "
     "(Linf: divided by sqrt(d))"),
    ("exact_status", "with --certify complete: 1 certified, -1 attacked (an adversarial "
     "example of the judged threat model exists: an attack's or the MIP's), -2 off_grid (the "
     "MIP's float point is adversarial, its 8-bit rounding is not), 0 unknown (time limit)"),
    ("smoothed_prediction", "with --certify smoothing: the smoothed classifier's class; -1: "
     "abstain"),
    ("smoothed_radius", "with --certify smoothing: the certified L2 radius (0: abstain)"),
    ("best_effort_distortion", "with --best-effort: the bisected distortion"),
    ("transfer_success", "with --surrogate: fooled by the voted transfer"),
    ("attack_names", "the file only: the attacks, in order"),
)

_FIELDS = tuple(f[0] for f in MODEL_FIELDS)
_CONFIG = tuple(f[0] for f in CONFIG_FIELDS)
_FROM_EVALUATION = _FIELDS[: _FIELDS.index("model")]


def model_record(plan: Any, figures: dict) -> dict:
    """A model's record from its plan and its figures: every field of :data:`MODEL_FIELDS` up
    to ``stochastic`` (the rest: :func:`with_extras`), in order, ``None`` where absent."""
    figures = dict(figures, eps=plan.threat.eps, norm=plan.threat.norm,
                   goals=list(plan.goal_names), plan=plan.describe())
    unknown = sorted(set(figures) - set(_FROM_EVALUATION))
    if unknown:
        raise ValueError(f"figures {unknown} are not in the report schema "
                         "(jaxbundle.report.schema)")
    return {name: figures.get(name) for name in _FIELDS}


def with_extras(record: dict, **extras: Any) -> dict:
    """``record`` with the fields the job or the report writer add (``model``, ``shifts``,
    ``best_effort``, ``transfer``, ``per_example``, ``figures``, ``seconds``, ...)."""
    unknown = sorted(set(extras) - set(_FIELDS))
    if unknown:
        raise ValueError(f"fields {unknown} are not in the report schema (jaxbundle.report.schema)")
    return dict(record, **extras)


def config_record(**fields: Any) -> dict:
    """The report's ``config``: exactly the fields of :data:`CONFIG_FIELDS`, in order."""
    if set(fields) != set(_CONFIG):
        raise ValueError(f"config fields {sorted(set(fields) ^ set(_CONFIG))} do not match the "
                         "report schema (jaxbundle.report.schema)")
    return {name: fields[name] for name in _CONFIG}


def markdown_tables() -> str:
    """The schema as Markdown tables (docs/report.md shows exactly these)."""
    cell = lambda text: text.replace("|", "\\|")  # noqa: E731
    lines = [f"`report.json` (`schema_version` {SCHEMA_VERSION}): `schema_version`, "
             "`jaxbundle_version`, `config`, `models` (one record per model).", "",
             "| `config` field | holds |", "|---|---|"]
    lines += [f"| `{name}` | {cell(text)} |" for name, text in CONFIG_FIELDS]
    lines += ["", "| model field | holds | null when |", "|---|---|---|"]
    lines += [f"| `{name}` | {cell(text)} | {cell(null)} |" for name, text, null in MODEL_FIELDS]
    lines += ["", "| per-example array (`<model>.npz`) | holds |", "|---|---|"]
    lines += [f"| `{name}` | {cell(text)} |" for name, text in PER_EXAMPLE]
    return "\n".join(lines) + "\n"
