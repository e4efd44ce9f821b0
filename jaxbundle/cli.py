"""The ``jaxbundle`` command.

``jaxbundle evaluate``  evaluates the demo models (shipped weights) or your own
                        (``--model MODULE:FUNCTION``) on the embedded MNIST sample or your data
                        (``--data npz:PATH`` / ``tfds:NAME``) and writes a report directory.
``jaxbundle attacks``   lists the available attacks and bundles.
``jaxbundle compare``   puts the models of one or more reports side by side (RoBIC's table).

The command holds no logic of its own beyond parsing flags: everything it does is a call into
the library.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from rich.console import Console
from rich.table import Table

from jaxbundle import bundles
from jaxbundle.bundles import BUNDLES, bundle_attacks
from jaxbundle.plan import CERTIFY_METHODS, MODES, PAIRS, Plan
from jaxbundle.presets import DEMO_MODELS, PRESETS, certify_for
from jaxbundle.suites import ATTACKS

__all__ = ["build_plan", "main"]

def build_plan(args: argparse.Namespace, norm: str, eps: float) -> Plan:
    """The plan the flags ask for: ``--bundle``'s (or ``--attacks``' in full mode) with every
    flag given applied to it, checked. ``--schedule full`` on a cascade bundle drops the
    bundle's own cascade settings (:func:`jaxbundle.bundles.plan`); ``--focus``, ``--floor``,
    ``--probe``, ``--escalate`` and ``--widen`` add to the bundle's."""
    fields = {k: v for k, v in (
        ("steps", args.steps), ("restarts", args.restarts), ("step_size", args.step_size),
        ("queries", args.queries), ("threshold", args.threshold), ("budget", args.budget),
        ("segments", args.segments), ("buckets", args.buckets),
        ("batch_size", None if args.batch_size == "auto" else args.batch_size),
        ("seed", args.seed),
        ("judging", args.judging), ("eot", args.eot), ("judge_calls", args.judge_calls),
        ("success_threshold", args.success_threshold),
        ("certify", certify_for(args.certify, args.models is None and not args.model)),
        ("certify_time_limit", args.certify_time_limit)) if v is not None}
    mode = {} if args.schedule is None else {"mode": args.schedule}
    base = (Plan.of(eps, tuple(args.attacks), norm=norm, **mode) if args.attacks
            else bundles.plan(args.bundle, norm, eps, **mode))
    own = base.schedule.describe()  # the bundle's focus, floor, probe, ..., if any
    for field in PAIRS:
        if getattr(args, field):
            fields[field] = tuple({**own[field], **dict(getattr(args, field))}.items())
    return base.replace(**fields).check()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _batch_size(text: str) -> int | str:
    """``--batch-size``: a positive integer, or ``auto`` (:mod:`jaxbundle.run.memory`)."""
    return "auto" if text.strip().lower() == "auto" else _positive_int(text)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected a number > 0, got 0")
    return value


def _rate(text: str) -> float:
    value = _non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"expected a success rate in [0, 1), got {text}")
    return value


def _named_fraction(text: str, whole: bool) -> tuple[str, float]:
    """``ATTACK=FRACTION`` with 0 < FRACTION <= 1 (``whole``) or < 1."""
    name, sep, fraction = text.partition("=")
    try:
        value = float(fraction)
    except ValueError:
        value = float("nan")
    if not sep or not name.strip() or not (0 < value <= 1 if whole else 0 < value < 1):
        raise argparse.ArgumentTypeError(
            f"expected ATTACK=FRACTION with 0 < FRACTION {'<=' if whole else '<'} 1, got {text!r}"
        )
    return name.strip(), value


def _focus(text: str) -> tuple[str, float]:
    return _named_fraction(text, whole=True)


def _probe(text: str) -> tuple[str, float]:
    return _named_fraction(text, whole=False)


def _csv(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def _data_flags(ev: argparse.ArgumentParser) -> None:
    what = ev.add_argument_group("models and data")
    what.add_argument(
        "--model", action="append", default=[], metavar="[NAME=]MODULE:FUNCTION",
        help="your model: FUNCTION() returns (apply_fn, params); MODULE is a dotted module or "
        "a path/to/file.py (repeatable)",
    )
    what.add_argument(
        "--models", type=_csv, default=None,
        help="demo models to evaluate (default: standard,adversarial when no --model is given); "
        "randomized: the adversarial CNN behind random noise and shifts (a stochastic model); "
        "quantized: the adversarial CNN behind bit-depth reduction and JPEG (zero gradients)",
    )
    what.add_argument(
        "--data", default="mnist-sample",
        help="mnist-sample[:SPLIT] (default), npz:PATH (x [N,H,W,C] uint8 or floats in [0,1], "
        "y [N]) or tfds:NAME[:SPLIT] (tensorflow-datasets, array_record, no TensorFlow)",
    )
    what.add_argument("--data-dir", default=None, help="tensorflow-datasets data_dir")
    what.add_argument(
        "--download", action="store_true", help="let tfds download and prepare the dataset"
    )
    what.add_argument(
        "--image-size", type=_positive_int, default=None,
        help="tfds only: resize the shorter side and centre-crop to this size (ImageNet: 224)",
    )
    what.add_argument(
        "--n", type=_positive_int, default=None,
        help="first N examples (default: 1000 of mnist-sample, else all)",
    )


def _threat_flags(ev: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    threat = ev.add_argument_group("threat model and attacks")
    threat.add_argument(
        "--preset", choices=tuple(PRESETS), default=None,
        help="standard (norm, eps) of a dataset (default: the data's own, e.g. mnist-linf)",
    )
    threat.add_argument(
        "--eps", type=_non_negative_float, default=None, help="radius (overrides the preset)"
    )
    threat.add_argument(
        "--norm", choices=("linf", "l2"), default=None, help="norm (overrides the preset)"
    )
    threat.add_argument(
        "--bundle",
        choices=tuple(BUNDLES),
        default="default",
        help="named bundle of attacks, a plan with its own schedule (see jaxbundle.bundles and "
        "`jaxbundle attacks`)",
    )
    threat.add_argument(
        "--attacks",
        type=_csv,
        default=None,
        help=f"comma-separated attacks instead of a bundle, from {','.join(ATTACKS)}",
    )
    threat.add_argument(
        "--steps", type=_positive_int, default=None, help="iterations of every iterative attack"
    )
    threat.add_argument(
        "--restarts", type=_positive_int, default=None,
        help="random restarts of PGD and untargeted APGD (APGD-T's restarts are its targets)"
    )
    threat.add_argument(
        "--queries", type=_positive_int, default=None, metavar="Q",
        help="model queries per example of every black-box attack (Square, RayS, SurFree; "
        "default: the bundle's own, else 5,000)",
    )
    threat.add_argument(
        "--step-size", type=_positive_float, default=None, help="PGD step (default 2.5*eps/steps)"
    )
    threat.add_argument(
        "--judging",
        choices=("auto", "grid", "float"),
        default=None,
        help="judge on the 8-bit grid where the clean image is on it, else in float32 (auto); "
        "require the grid (grid); or judge everything in float32 (float)",
    )
    _schedule_flags(threat)
    return threat


def _schedule_flags(threat: argparse._ArgumentGroup) -> None:
    threat.add_argument(
        "--schedule", choices=MODES, default=None,
        help="full: every attack on every example (the many-attack table); cascade: each "
        "attack only on the examples not yet fooled (prioritisation, far cheaper); default: "
        "the bundle's own (cascade for default and autoattack), else full",
    )
    threat.add_argument(
        "--threshold", type=_positive_float, default=None,
        help="cascade: the defender's confidence threshold t; an example drops out once a "
        "wrong class reaches confidence t (max-confidence goal)",
    )
    threat.add_argument(
        "--budget", type=_positive_float, default=None,
        help="cascade: model passes per example on average; least-run examples first",
    )
    threat.add_argument(
        "--focus", type=_focus, action="append", default=[], metavar="ATTACK=FRACTION",
        help="cascade: run ATTACK only on that fraction of the survivors, the most promising "
        "(closest to the goal) first; repeatable; default: the bundle's own",
    )
    threat.add_argument(
        "--floor", type=_focus, action="append", default=[], metavar="ATTACK=SHARE",
        help="cascade: ATTACK's focus keeps every survivor while they are at most SHARE of the "
        "batch, and never fewer than that share; repeatable; default: the bundle's own",
    )
    threat.add_argument(
        "--probe", type=_probe, action="append", default=[], metavar="ATTACK=FRACTION",
        help="cascade: run that fraction of ATTACK's steps on every survivor, then its focus "
        "share goes on, half by its own progress; repeatable; default: the bundle's own",
    )
    threat.add_argument(
        "--escalate", type=_focus, action="append", default=[], metavar="ATTACK=SHARE",
        help="cascade: run ATTACK only when the stage before it fooled at least SHARE of the "
        "examples it ran on; repeatable; default: the bundle's own",
    )
    threat.add_argument(
        "--widen", type=_focus, action="append", default=[], metavar="ATTACK=FRACTION",
        help="cascade: ATTACK's focus fraction once an escalated stage has run on the batch "
        "(the white-box stages were shown misled); repeatable; default: the bundle's own",
    )
    threat.add_argument(
        "--segments", type=_positive_int, default=None, metavar="N",
        help="cascade: run each attack's steps in N segments; an example fooled in one stops "
        "there (default: the bundle's own, 6 for default, else 1)",
    )
    threat.add_argument(
        "--buckets", type=_positive_int, default=None, metavar="N",
        help="cascade: compact the survivors into N batch sizes per halving of the batch "
        "(padding under 1/(N+1) of a bucket; default: the bundle's own, 8 for autoattack, "
        "else 2)",
    )


def _stochastic_flags(ev: argparse.ArgumentParser, threat: argparse._ArgumentGroup) -> None:
    random = ev.add_argument_group(
        "defences (randomised ones: jaxbundle.core.sampling; preprocessing: "
        "jaxbundle.run.defences)")
    random.add_argument(
        "--eot", type=_positive_int, default=None, metavar="N",
        help="every attack averages N model samples per call (expectation over "
        "transformation; each counts as a model pass); stochastic models only (default 1)",
    )
    random.add_argument(
        "--judge-calls", type=_positive_int, default=None, metavar="M",
        help="fresh model calls the judge makes on every candidate (default: the model's, 16)",
    )
    random.add_argument(
        "--success-threshold", type=_rate, default=None, metavar="T",
        help="an example counts as fooled when more than T of the judge's calls misclassify it "
        "(default: the model's, 0.5)",
    )
    random.add_argument(
        "--bpda", action="store_true",
        help="attack the models that declare a preprocessing (jaxbundle.defended; the demo "
        "quantized) with BPDA: its forward pass, the identity's (or their approx's) gradient; "
        "judging still uses the true forward pass (docs/defences.md)",
    )
    threat.add_argument(
        "--best-effort", action="store_true",
        help="add RoBIC's best-effort distortions (bisection on eps) to the report",
    )
    threat.add_argument(
        "--surrogate", action="append", default=[], metavar="[NAME=]MODULE:FUNCTION",
        help="a model the attacker owns (or a demo model's name): adds transfer bundling from "
        "it (repeatable)",
    )


def _certify_flags(ev: argparse.ArgumentParser) -> None:
    certify = ev.add_argument_group(
        "certified lower bound (jaxbundle.certify): robust accuracy in [certified, bundled]")
    certify.add_argument(
        "--certify", choices=(*CERTIFY_METHODS, "none"), default=None,
        help="certify every example beside the attacks (default: crown-ibp for the demo "
        "models when neither --model nor --models is given, else none): ibp, crown-ibp, crown "
        "(bound propagation through the model's jaxpr), complete (exact MIP on what crown leaves "
        "open; linf, ReLU networks), smoothing (Cohen et al.'s CERTIFY; a model declared with "
        "jaxbundle.certify.gaussian)",
    )
    certify.add_argument(
        "--certify-time-limit", type=_positive_float, default=None, metavar="SECONDS",
        help="the complete mode's time limit per example (default 10); over it: unknown",
    )


def _run_flags(ev: argparse.ArgumentParser) -> None:
    run = ev.add_argument_group("running")
    run.add_argument("--seed", type=int, default=None, help="example i draws from "
                     "fold_in(key(seed), i) (default 0)")
    run.add_argument("--batch-size", type=_batch_size, default=None, metavar="N|auto",
                     help="rows per batch at most (default 250; the examples are split into "
                          "equal batches); auto: the most that fit half the free memory of a "
                          "device, per model (jaxbundle.run.memory)")
    run.add_argument("--dry-run", action="store_true",
                     help="build and check the plan, print it as JSON and stop")
    run.add_argument("--out", default="jaxbundle-report", help="report directory")
    run.add_argument(
        "--checkpoint-dir", default=None,
        help="checkpoint after every batch; the same command resumes where a killed run stopped",
    )
    run.add_argument(
        "--save-images", action="store_true",
        help="write the adversarial images to OUT/adversarial/<model>/, batch by batch",
    )
    run.add_argument(
        "--cache-dir", default=None,
        help="cache of trained demo weights and compiled programs (default $JAXBUNDLE_CACHE or "
        "~/.cache/jaxbundle)",
    )
    run.add_argument(
        "--no-compile-cache", action="store_true",
        help="do not keep compiled programs on disk (CACHE_DIR/xla) between runs",
    )
    run.add_argument(
        "--train-examples", type=_positive_int, default=None, help="demo models: training set size"
    )
    run.add_argument("--train-epochs", type=_positive_int, default=None, help="demo models: epochs")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.add_argument("--no-shifts", action="store_true", help="skip the natural shifts")
    dist = ev.add_argument_group(
        "multi-process (jax.distributed)",
        "run the same command in every process; the batch is sharded over the devices of all "
        "processes, each process reads only its own rows, and process 0 prints and writes "
        "the report",
    )
    dist.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() (auto-detects TPU pods, SLURM, Open MPI, ...)",
    )
    dist.add_argument("--coordinator", help="coordinator HOST:PORT (implies --distributed)")
    dist.add_argument("--num-processes", type=_positive_int, help="number of processes")
    dist.add_argument("--process-id", type=int, help="this process's index, from 0")



def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxbundle", description="Per-example bundled robustness evaluation for JAX models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    ev = sub.add_parser("evaluate", help="evaluate models on a dataset and write a report")
    _data_flags(ev)
    _stochastic_flags(ev, _threat_flags(ev))
    _certify_flags(ev)
    _run_flags(ev)
    cmp = sub.add_parser("compare", help="compare models of one or more reports side by side")
    cmp.add_argument("reports", nargs="+", help="report directories or report.json files")
    cmp.add_argument("--markdown", action="store_true", help="print a Markdown table")

    sub.add_parser("attacks", help="list the available attacks")
    return parser


def _list_attacks(console: Console) -> None:
    t = Table(title="attacks (--attacks, --focus, the report: jaxbundle.suites.ATTACKS)")
    for column in ("name", "norms", "kind", "goal", "budget", "paper"):
        t.add_column(column, overflow="fold")
    for record in ATTACKS.values():
        made = record.made()
        t.add_row(record.name, ", ".join(record.norms), made.kind, made.goal, _budget(made),
                  record.citation)
    console.print(t)
    b = Table(title="bundles (--bundle)")
    for column in ("name", "linf", "l2"):
        b.add_column(column, overflow="fold")
    for name in BUNDLES:
        b.add_row(name, *(_describe(bundle_attacks(name, norm)) for norm in ("linf", "l2")))
    console.print(b)


def _describe(attacks) -> str:
    return ", ".join(f"{a.name} ({_budget(a)})" for a in attacks)


def _budget(a) -> str:
    if a.kind != "white-box" and a.queries:
        return f"{a.queries} queries"
    return (f"{a.num_steps} step{'s' if a.num_steps > 1 else ''}"
            + (f" x {a.num_restarts}" if a.num_restarts > 1 else ""))


def _evaluate(args: argparse.Namespace, console: Console) -> None:
    from jaxbundle import data, job, models, presets

    if not args.dry_run:  # a dry run checks the command without joining the other processes
        job.start_distributed(args.distributed, args.coordinator, args.num_processes,
                              args.process_id)
    source = data.open_source(
        args.data, data_dir=args.data_dir, download=args.download, image_size=args.image_size
    )
    source = data.head(source, presets.default_n(args.data, args.n))
    norm, eps, preset = presets.resolve(source.name, args.preset, args.norm, args.eps)
    demo = dict(cache_dir=args.cache_dir, train_examples=args.train_examples,
                train_epochs=args.train_epochs)
    demo_names = args.models if args.models is not None else ([] if args.model else
                                                               list(DEMO_MODELS))
    refs = [job.demo_model(m, **demo) for m in demo_names] + [job.user_model(s) for s in args.model]
    surrogates = [
        job.demo_model(s, **demo) if s in models.MODELS or s in models.DEFENCES
        else job.user_model(s)
        for s in args.surrogate
    ]
    plan = build_plan(args, norm, eps)
    if args.dry_run:
        print(json.dumps({"plan": plan.describe(), "threat_model": preset,
                          "data": {"name": source.name, "n": len(source)},
                          "models": demo_names + list(args.model), "bpda": args.bpda,
                          "batch_size_auto": args.batch_size == "auto"},
                         indent=2))
        return
    cache = args.cache_dir or str(models.default_cache_dir())
    compiled = None if args.no_compile_cache else os.path.join(cache, "xla")
    with job.compilation_cache(compiled):  # training the demo models and the shifts too
        options = job.JobOptions(
            out=args.out, shifts=not args.no_shifts, checkpoint_dir=args.checkpoint_dir,
            save_images=args.save_images, best_effort=args.best_effort, surrogates=surrogates,
            bpda=args.bpda, auto_batch=args.batch_size == "auto", compile_cache=compiled)
        path, _ = job.run_job(refs, source, plan, options, threat_model=preset,
                              console=console, show_progress=not args.no_progress)
    if path is not None:
        console.print(f"report written to {path} (and report.md, figures)")


def _compare(args: argparse.Namespace, console: Console) -> None:
    from jaxbundle.report.compare import compare_markdown, compare_rows, compare_table, load_reports

    rows = compare_rows(load_reports(args.reports))
    if args.markdown:
        print(compare_markdown(rows))
    else:
        console.print(compare_table(rows))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for bad flags or inputs)."""
    args = _parser().parse_args(argv)
    console = Console(width=100)
    try:
        if args.command == "attacks":
            _list_attacks(console)
        elif args.command == "compare":
            _compare(args, console)
        else:
            _evaluate(args, console)
    except (ValueError, FileNotFoundError, ImportError) as err:
        Console(stderr=True).print(f"[red]error:[/red] {err}", highlight=False, soft_wrap=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
