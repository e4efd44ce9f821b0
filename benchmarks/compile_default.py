"""Compile cost of the ``default`` bundle through the Python API, in a fresh process: programs
compiled and seconds spent (trace + lowering + XLA backend compile, from ``jax.monitoring``) on
the first call, on a sweep over eps in the same process, and a warm call after each, without
the persistent compilation cache (what a notebook user pays), or with ``--persistent-cache``
in a second process after a first has filled JAX's persistent cache in a temporary directory
(a notebook run again with the three ``jax.config`` lines of docs/python-api.md).

    python benchmarks/compile_default.py                       # demo adversarial CNN, n 256
    python benchmarks/compile_default.py --eps 0.1 0.2 0.3 --norm linf --model adversarial
    python benchmarks/compile_default.py --norm l2 --eps 1.0 1.5 2.0 --persistent-cache
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import jax, jax.monitoring
import numpy as np
args = json.loads(sys.argv[1])
if args["cache"]:  # docs/python-api.md: compiled programs kept across processes
    jax.config.update("jax_compilation_cache_dir", args["cache"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
stats = {"backend_s": 0.0, "programs": 0, "trace_s": 0.0, "lower_s": 0.0}
def on_duration(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        stats["backend_s"] += duration; stats["programs"] += 1
    elif event == "/jax/core/compile/jaxpr_trace_duration":
        stats["trace_s"] += duration
    elif event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        stats["lower_s"] += duration
jax.monitoring.register_event_duration_secs_listener(on_duration)
import jaxbundle
from jaxbundle import data, models
spec = {"adversarial": models.ADVERSARIAL, "standard": models.STANDARD}[args["model"]]
apply_fn, params = models.load_or_train(spec)
ds = data.load_mnist_sample("test", n=args["n"])
x, y = np.asarray(ds.x), np.asarray(ds.y)
rows = []
for eps in args["eps"]:
    for call in ("first", "warm"):
        before = dict(stats)
        plan = jaxbundle.bundles.default(args["norm"], eps)
        start = time.perf_counter()
        ev = jaxbundle.evaluate(apply_fn, params, (x, y), plan)
        wall = time.perf_counter() - start
        row = {k: round(stats[k] - before[k], 2) for k in stats}
        row.update(eps=eps, call=call, wall_s=round(wall, 2),
                   robust_accuracy=ev.metrics["robust_accuracy"])
        row["compile_s"] = round(row["backend_s"] + row["trace_s"] + row["lower_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
print("ROWS " + json.dumps(rows))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="adversarial", choices=("adversarial", "standard"))
    parser.add_argument("--norm", default="linf")
    parser.add_argument("--eps", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--out", default=None, help="append the rows as one JSON line")
    parser.add_argument("--persistent-cache", action="store_true",
                        help="measure a second process, after a first filled the cache")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        runs = 2 if args.persistent_cache else 1
        for _ in range(runs):
            rows = _child(args, cache if args.persistent_cache else None)
    first = [r for r in rows if r["call"] == "first"]
    summary = {"model": args.model, "norm": args.norm, "n": args.n,
               "persistent_cache": args.persistent_cache,
               "first_call_compile_s": first[0]["compile_s"],
               "first_call_programs": first[0]["programs"],
               "sweep_compile_s": round(sum(r["compile_s"] for r in first), 2),
               "sweep_programs": sum(r["programs"] for r in first), "rows": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(summary) + "\n")


def _child(args: argparse.Namespace, cache: str | None) -> list[dict]:
    """The rows of one fresh process (``cache``: JAX's persistent cache directory, or none)."""
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false" if cache is None else "true")
    child = json.dumps({"model": args.model, "norm": args.norm, "eps": args.eps, "n": args.n,
                        "cache": cache})
    done = subprocess.run([sys.executable, "-c", CHILD, child], capture_output=True, text=True,
                          env=env)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    return json.loads(done.stdout.rsplit("ROWS ", 1)[1])


if __name__ == "__main__":
    main()
