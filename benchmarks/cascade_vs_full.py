"""A bundle as a cascade against the same bundle in full, as a user runs them: one
``jaxbundle evaluate`` command each, in fresh processes without the persistent compilation
cache (compile time included), rounds interleaved; medians of wall seconds, and the gradients
and rows each spent (from the report).

    python benchmarks/cascade_vs_full.py                      # standard bundle, adversarial CNN
    python benchmarks/cascade_vs_full.py --rounds 3 -- --bundle standard --n 256
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def run(flags: list[str], mode: str, root: str, cache: str) -> dict:
    out = tempfile.mkdtemp(dir=root)
    cmd = [sys.executable, "-m", "jaxbundle.cli", "evaluate", *flags, "--schedule", mode,
           "--no-progress", "--no-compile-cache", "--cache-dir", cache, "--out", out]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    report = json.load(open(os.path.join(out, "report.json")))
    (m,) = report["models"].values()
    return {"mode": mode, "wall_s": wall, "robust_accuracy": m["robust_accuracy"],
            "gradients_per_example": m["gradients_per_example"],
            "queries_per_example": m["queries_per_example"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="append the summary as one JSON line")
    parser.add_argument("flags", nargs="*", help="jaxbundle evaluate flags (after --)")
    args = parser.parse_args()
    flags = args.flags or ["--bundle", "standard", "--models", "adversarial", "--n", "256",
                           "--no-shifts"]
    weights = os.environ.get("JAXBUNDLE_CACHE", os.path.expanduser("~/.cache/jaxbundle"))
    root = tempfile.mkdtemp()
    cache = os.path.join(root, "cache")
    if os.path.isdir(os.path.join(weights, "models")):  # the trained demo weights, not XLA's
        shutil.copytree(os.path.join(weights, "models"), os.path.join(cache, "models"))
    rows = []
    for r in range(args.rounds):
        for mode in (("full", "cascade") if r % 2 == 0 else ("cascade", "full")):
            rows.append(run(flags, mode, root, cache))
            print(json.dumps(rows[-1]), flush=True)
    summary = {"flags": flags, "rounds": args.rounds}
    for mode in ("full", "cascade"):
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {"median_wall_s": round(statistics.median(r["wall_s"] for r in mine), 2),
                         **{k: mine[0][k] for k in ("robust_accuracy", "gradients_per_example",
                                                 "queries_per_example")}}
    summary["cascade_over_full"] = round(
        summary["cascade"]["median_wall_s"] / summary["full"]["median_wall_s"], 3)
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(summary) + "\n")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
