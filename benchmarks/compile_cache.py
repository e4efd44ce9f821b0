"""First and second run of the same ``jaxbundle evaluate`` command with the persistent
compilation cache: seconds spent compiling (XLA backend compiles, summed through
``jax.monitoring``) and wall time of each run, in fresh processes.

    python benchmarks/compile_cache.py            # main job's default bundle, n 250, no shifts
    python benchmarks/compile_cache.py --runs 3 -- --bundle fast --n 500
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax

# Runs in the child: sums backend compile time and counts cache hits, then runs the CLI.
CHILD = """
import json, sys, time, jax.monitoring
stats = {"compile_s": 0.0, "compiles": 0}
def on_duration(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        stats["compile_s"] += duration
        stats["compiles"] += 1
jax.monitoring.register_event_duration_secs_listener(on_duration)
from jaxbundle.cli import main
start = time.perf_counter()
code = main(sys.argv[1:])
stats["wall_s"] = time.perf_counter() - start
print("STATS " + json.dumps(stats))
sys.exit(code)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/compile_cache.json")
    parser.add_argument("flags", nargs="*", help="jaxbundle evaluate flags (after --)")
    args = parser.parse_args()
    flags = args.flags or ["--n", "250", "--no-shifts"]
    weights = os.environ.get("JAXBUNDLE_CACHE", os.path.expanduser("~/.cache/jaxbundle"))
    root = tempfile.mkdtemp()
    cache = os.path.join(root, "cache")
    if os.path.isdir(os.path.join(weights, "models")):  # reuse trained demo weights, not XLA
        shutil.copytree(os.path.join(weights, "models"), os.path.join(cache, "models"))
    runs = []
    for i in range(args.runs):
        cmd = [sys.executable, "-c", CHILD, "evaluate", *flags, "--no-progress",
               "--cache-dir", cache, "--out", os.path.join(root, f"report{i}")]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        stats = json.loads(done.stdout.rsplit("STATS ", 1)[1])
        stats["cache_entries"] = len(os.listdir(os.path.join(cache, "xla")))
        runs.append(stats)
        print(f"run {i + 1}: {stats}")
    result = {
        "command": ["jaxbundle", "evaluate", *flags], "runs": runs,
        "jax": jax.__version__, "backend": jax.default_backend(), "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
