"""The ``jaxbundle`` command.

``jaxbundle evaluate``  trains (once, cached) or loads the demo models, runs the attack bundle on
                        the embedded MNIST test sample and writes a report directory.
``jaxbundle attacks``   lists the available attacks and bundles.
``jaxbundle compare``   puts the models of one or more reports side by side (RoBIC's table).

The command holds no logic of its own beyond parsing flags: everything it does is a call into
the library.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from jaxbundle.suites import ATTACKS, BUNDLES, bundle_attacks

__all__ = ["main", "build_attacks"]


def build_attacks(args: argparse.Namespace):
    """The attacks of ``--attacks`` if given, else of ``--bundle``."""
    from jaxbundle import suites

    options = dict(steps=args.steps, restarts=args.restarts, step_size=args.step_size)
    if args.attacks:
        return tuple(suites.attack(name, args.norm, **options) for name in args.attacks)
    return suites.bundle_attacks(args.bundle, args.norm, **options)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


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


def _csv(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxbundle", description="Per-example bundled robustness evaluation for JAX models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    ev = sub.add_parser("evaluate", help="evaluate the demo models on the embedded MNIST sample")
    ev.add_argument("--n", type=_positive_int, default=1000, help="first N test examples (max 2000)")
    ev.add_argument("--eps", type=_non_negative_float, default=0.3, help="radius of the eps ball")
    ev.add_argument("--norm", choices=("linf", "l2"), default="linf")
    ev.add_argument(
        "--bundle",
        choices=tuple(BUNDLES),
        default="default",
        help="named bundle of attacks (see jaxbundle.suites and `jaxbundle attacks`)",
    )
    ev.add_argument(
        "--attacks",
        type=_csv,
        default=None,
        help=f"comma-separated attacks instead of a bundle, from {','.join(ATTACKS)}",
    )
    ev.add_argument(
        "--steps", type=_positive_int, default=None, help="iterations of every iterative attack"
    )
    ev.add_argument(
        "--restarts", type=_positive_int, default=None, help="random restarts of PGD / APGD"
    )
    ev.add_argument(
        "--step-size", type=_positive_float, default=None, help="PGD step (default 2.5*eps/steps)"
    )
    ev.add_argument(
        "--judging",
        choices=("auto", "grid", "float"),
        default="auto",
        help="judge on the 8-bit grid where the clean image is on it, else in float32 (auto); "
        "require the grid (grid); or judge everything in float32 (float)",
    )
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--batch-size", type=_positive_int, default=250)
    ev.add_argument("--out", default="jaxbundle-report", help="report directory")
    ev.add_argument(
        "--models", type=_csv, default=["standard", "adversarial"], help="demo models to evaluate"
    )
    ev.add_argument("--cache-dir", default=None, help="trained-weights cache (default ~/.cache)")
    ev.add_argument(
        "--train-examples", type=_positive_int, default=None, help="override training set size"
    )
    ev.add_argument("--train-epochs", type=_positive_int, default=None, help="override epochs")
    ev.add_argument("--no-progress", action="store_true", help="no progress bars")
    ev.add_argument("--no-shifts", action="store_true", help="skip the natural shifts")
    dist = ev.add_argument_group(
        "multi-process (jax.distributed)",
        "run the same command in every process; the batch is sharded over the devices of all "
        "processes and process 0 prints and writes the report",
    )
    dist.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() (auto-detects TPU pods, SLURM, Open MPI, ...)",
    )
    dist.add_argument("--coordinator", help="coordinator HOST:PORT (implies --distributed)")
    dist.add_argument("--num-processes", type=_positive_int, help="number of processes")
    dist.add_argument("--process-id", type=int, help="this process's index, from 0")

    cmp = sub.add_parser("compare", help="compare models of one or more reports side by side")
    cmp.add_argument("reports", nargs="+", help="report directories or report.json files")
    cmp.add_argument("--markdown", action="store_true", help="print a Markdown table")

    sub.add_parser("attacks", help="list the available attacks")
    return parser


def _list_attacks(console: Console) -> None:
    from jaxbundle.attacks import CATALOGUE

    t = Table(title="jaxbundle attacks")
    for column in ("name", "norms", "kind", "goal", "paper"):
        t.add_column(column, overflow="fold")
    for info in CATALOGUE:
        t.add_row(info.name, ", ".join(info.norms), info.kind, info.goal, info.paper)
    console.print(t)
    b = Table(title="bundles (--bundle)")
    for column in ("name", "linf", "l2"):
        b.add_column(column, overflow="fold")
    for name in BUNDLES:
        b.add_row(name, *(_describe(bundle_attacks(name, norm)) for norm in ("linf", "l2")))
    console.print(b)
    console.print(f"attack names for --attacks: {', '.join(ATTACKS)}")


def _describe(attacks) -> str:
    return ", ".join(
        f"{a.name} ({a.num_steps} step{'s' if a.num_steps > 1 else ''}"
        + (f" x {a.num_restarts}" if a.num_restarts > 1 else "")
        + ")"
        for a in attacks
    )


def _start_distributed(args: argparse.Namespace) -> None:
    """``jax.distributed.initialize`` when any multi-process flag is given."""
    import jax

    flags = (args.coordinator, args.num_processes, args.process_id)
    if not args.distributed and all(f is None for f in flags):
        return
    n, i = args.num_processes, args.process_id
    if i is not None and not 0 <= i < (n or i + 1):
        raise ValueError(f"--process-id must be in 0..{n - 1 if n else 'N-1'}, got {i}")
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )


def _evaluate(args: argparse.Namespace, console: Console) -> None:
    import jax

    from jaxbundle import data, models
    from jaxbundle.evaluate import evaluate
    from jaxbundle.report import print_tables, write_report
    from jaxbundle.shifts import evaluate_shifts

    unknown = [m for m in args.models if m not in models.MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; choose from {sorted(models.MODELS)}")
    attack_list = build_attacks(args)
    dataset = data.load_mnist_sample("test", n=args.n)
    _start_distributed(args)
    lead = jax.process_index() == 0  # prints and writes; every process computes

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=args.no_progress or not lead,
    )
    results = {}
    with progress:
        for name in args.models:
            config = models.MODELS[name]
            if args.train_examples is not None:
                config = config._replace(n_train=args.train_examples)
            if args.train_epochs is not None:
                config = config._replace(epochs=args.train_epochs)
            task = progress.add_task(f"{name}: train or load", total=None)
            apply_fn, params = models.load_or_train(
                config,
                cache_dir=args.cache_dir,
                progress=lambda done, total: progress.update(task, completed=done, total=total),
            )
            progress.update(task, description=f"{name}: attack")
            start = time.perf_counter()
            evaluation = evaluate(
                apply_fn,
                params,
                dataset.x,
                dataset.y,
                attack_list,
                eps=args.eps,
                norm=args.norm,
                seed=args.seed,
                batch_size=args.batch_size,
                judging=args.judging,
                progress=lambda done, total: progress.update(task, completed=done, total=total),
            )
            jax.block_until_ready(evaluation.per_example)
            if not args.no_shifts:
                progress.update(task, description=f"{name}: natural shifts")
                evaluation.metrics["shifts"] = evaluate_shifts(
                    apply_fn, params, dataset.x, dataset.y, seed=args.seed
                )
            results[name] = (evaluation, time.perf_counter() - start)

    if not lead:
        return
    print_tables(console, results)
    config = {
        "dataset": dataset.name,
        "n": args.n,
        "eps": args.eps,
        "norm": args.norm,
        "bundle": None if args.attacks else args.bundle,
        "attacks": [a.name for a in attack_list],
        "steps": args.steps,
        "restarts": args.restarts,
        "step_size": args.step_size,
        "seed": args.seed,
        "judging": args.judging,
        "batch_size": args.batch_size,
        "models": args.models,
    }
    path = write_report(args.out, config, results, x_clean=dataset.x)
    console.print(f"report written to {path} (and report.md, figures)")


def _compare(args: argparse.Namespace, console: Console) -> None:
    from jaxbundle.compare import compare_markdown, compare_rows, compare_table, load_reports

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
    except (ValueError, FileNotFoundError) as err:
        Console(stderr=True).print(f"[red]error:[/red] {err}", highlight=False)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
