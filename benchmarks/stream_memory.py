"""Host memory of a streaming evaluation on an ImageNet-validation-sized stream.

``jaxbundle.evaluate`` reads a ``Source`` batch by batch; the claim is that host
memory stays at a few batches plus the small per-example arrays, whatever the dataset's size.
This runs it over a generated stream of N images 224x224x3 uint8 (1,000 classes; every row made
from its index, nothing per example held) with a tiny model (8x8 average pooling, then a linear
layer), and samples the resident set size (RSS) after every batch. Each variant runs in its own
process, so that its peak RSS (``ru_maxrss``) is its own:

- ``plain``: no ``images_dir`` (adversarial images are not kept);
- ``images``: ``images_dir`` in a temporary directory (one ``.npz`` per batch, deleted after).

    python benchmarks/stream_memory.py                        # both at N=50,000, batch 250, fgsm
    python benchmarks/stream_memory.py --runs images:10000 plain   # images at N=10,000 only
    python benchmarks/stream_memory.py --n 5000 --runs plain --attacks fgsm pgd-ce --steps 2

Besides RSS after every batch, a thread samples RSS every 10 ms, which catches the peak inside
a batch (the compiled batch program's buffers, whose sizes XLA's memory analysis also gives).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

H, W, C, CLASSES = 224, 224, 3, 1000
MB = 1e6  # decimal megabytes, as in "7.5 GB"


class GeneratedSource:
    """N deterministic images: row ``i`` is a window of a fixed random texture, shifted by ``i``
    (so rows differ and cost one copy each); label ``i % 1000``. Holds only the texture."""

    in_memory = False

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed = n, seed
        self.name = f"generated:{n}x{H}x{W}x{C}"
        self.num_classes, self.shape, self.dtype = CLASSES, (H, W, C), np.dtype(np.uint8)
        rng = np.random.default_rng(seed)
        self._texture = rng.integers(0, 256, (2 * H, 2 * W, C), dtype=np.uint8)  # 0.6 MB

    def __len__(self) -> int:
        return self.n

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        stop = min(stop, self.n)
        x = np.empty((stop - start, H, W, C), np.uint8)
        for k, i in enumerate(range(start, stop)):
            dy, dx = (i * 7) % H, (i * 13 + i // H) % W
            x[k] = self._texture[dy:dy + H, dx:dx + W]
        return x, np.arange(start, stop, dtype=np.int32) % CLASSES

    def describe(self) -> dict:
        return {"source": "generated", "n": self.n, "seed": self.seed, "shape": [H, W, C]}


def apply_fn(params, x):
    """[B, 224, 224, 3] -> [B, 1000] logits: 8x8 average pooling, then a linear layer."""
    b = x.shape[0]
    pooled = x.reshape(b, H // 8, 8, W // 8, 8, C).mean(axis=(2, 4)).reshape(b, -1)
    return pooled @ params["w"] + params["b"]


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def xla_memory(params, plan) -> dict | None:
    """The batch program's buffers as XLA plans them (arguments, outputs, temporaries), in MB.
    Lowers the library's private ``runners._evaluate_batch`` as the full runner calls it."""
    import jax
    import jax.numpy as jnp

    from jaxbundle import runners

    batch_size = plan.run.batch_size
    try:
        b = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
        compiled = runners._evaluate_batch.lower(
            params, jax.ShapeDtypeStruct((batch_size, H, W, C), jnp.float32), b,
            jax.random.key(0), b, jax.ShapeDtypeStruct((batch_size,), jnp.bool_),
            jnp.float32(0.0), apply_fn=apply_fn, attacks=plan.attack_values(),
            goal_names=plan.goal_names, norm=plan.threat.norm, judging=plan.threat.judging,
            unroll=plan.run.unroll, restart_mode=plan.run.restart_mode, mesh=None,
        ).compile()
        m = compiled.memory_analysis()
        return {k: getattr(m, f"{k}_size_in_bytes") / MB for k in ("argument", "output", "temp")}
    except Exception as e:  # a private API: report, do not fail the benchmark
        return {"error": repr(e)}


def model_params() -> dict:
    """The tiny model's parameters (fixed by the seed)."""
    import jax

    k1, k2 = jax.random.split(jax.random.key(0))
    d = (H // 8) * (W // 8) * C
    return {"w": jax.random.normal(k1, (d, CLASSES)) / np.sqrt(d),
            "b": 0.01 * jax.random.normal(k2, (CLASSES,))}


class Recorder:
    """The evaluation's ``progress`` callback: RSS after every batch, the highest RSS seen
    while each batch ran (a thread samples it every 10 ms; XLA releases the GIL while it runs,
    so this sees inside a batch), ``ru_maxrss`` and the time after every batch."""

    def __init__(self, variant: str):
        self.variant = variant
        self.before = rss()
        self.samples: list[int] = []
        self.peaks: list[int] = []
        self.maxrss: list[int] = []
        self.times: list[float] = []
        self._high, self._stop = self.before, threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()
        self._t0 = time.perf_counter()

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self._high = max(self._high, rss())

    def stop(self) -> None:
        self._stop.set()

    def __call__(self, done: int, total: int) -> None:
        self.samples.append(rss())
        self.peaks.append(max(self._high, self.samples[-1]))
        self._high = 0
        self.maxrss.append(max_rss())
        self.times.append(time.perf_counter() - self._t0)
        if done == 1 or done % max(1, total // 10) == 0 or done == total:
            print(f"  [{self.variant}] batch {done}/{total}  rss {self.samples[-1] / MB:.0f} MB  "
                  f"in-batch peak {self.peaks[-1] / MB:.0f} MB  ru_maxrss "
                  f"{self.maxrss[-1] / MB:.0f} MB  {self.times[-1]:.0f} s", file=sys.stderr,
                  flush=True)


def run_one(args: argparse.Namespace, variant: str) -> dict:
    """One variant in this process: the evaluation and its RSS after every batch."""
    from jaxbundle import Plan, evaluate

    params = model_params()
    plan = Plan.of(eps=args.eps, norm="linf", attacks=tuple(args.attacks), steps=args.steps,
                batch_size=args.batch_size)
    source = GeneratedSource(args.n)
    rec = Recorder(variant)
    tmp = None
    if variant == "images":
        tmp = tempfile.mkdtemp(prefix="stream_memory_", dir=args.tmp)
    try:
        result = evaluate(apply_fn, params, source, plan, mesh=None, images_dir=tmp,
                          keep_images=False, progress=rec)
        written = sum(f.stat().st_size for f in pathlib.Path(tmp).iterdir()) if tmp else 0
    finally:
        if tmp:
            shutil.rmtree(tmp)
    rec.stop()
    end = (rss(), max_rss())  # before XLA's memory analysis compiles the program again
    return summary(args, variant, rec, result, written, end, xla_memory(params, plan))


def summary(args, variant: str, rec: Recorder, result, written: int, end_rss, xla) -> dict:
    """What one variant's run reports (MB = 10^6 bytes); ``end_rss``: (RSS, ru_maxrss) when
    the evaluation finished."""
    samples, peaks, maxrss = rec.samples, rec.peaks, rec.maxrss
    end, peak = end_rss
    per_example = sum(v.nbytes for v in result.per_example.values())
    n_batches = len(samples)
    mid = samples[n_batches // 2] if n_batches > 2 else samples[-1]
    return {
        "variant": variant,
        "n": args.n, "batches": n_batches, "seconds": rec.times[-1],
        "rss_before_mb": rec.before / MB,
        "rss_after_batch1_mb": samples[0] / MB,
        "rss_mid_mb": mid / MB,
        "rss_max_after_batch_mb": max(samples) / MB,
        "rss_end_mb": end / MB,
        "in_batch_peak_batch1_mb": peaks[0] / MB,  # includes compiling
        "in_batch_peak_later_max_mb": max(peaks[1:], default=peaks[0]) / MB,
        "ru_maxrss_after_batch1_mb": maxrss[0] / MB,
        "ru_maxrss_end_mb": peak / MB,
        "growth_batch1_to_last_mb": (samples[-1] - samples[0]) / MB,
        # From batch 2 on, the previous batch's host arrays are alive while the next is read.
        "growth_batch2_to_last_mb": (samples[-1] - samples[min(1, n_batches - 1)]) / MB,
        "growth_mid_to_last_mb": (samples[-1] - mid) / MB,
        "ru_maxrss_growth_batch1_to_end_mb": (peak - maxrss[0]) / MB,
        "per_example_arrays_mb": per_example / MB,
        "images_written_mb": written / MB,
        "robust_accuracy": result.metrics.get("robust_accuracy"),
        "clean_accuracy": result.metrics.get("clean_accuracy"),
        "xla_batch_program_mb": xla,
        "rss_after_every_batch_mb": [round(s / MB, 1) for s in samples],
        "in_batch_peak_every_batch_mb": [round(s / MB, 1) for s in peaks],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=50_000)
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--attacks", nargs="+", default=["fgsm"], help="names in jaxbundle.suites")
    p.add_argument("--steps", type=int, default=None, help="steps of iterative attacks")
    p.add_argument("--eps", type=float, default=4 / 255)
    p.add_argument("--runs", nargs="+", default=["plain", "images"], metavar="VARIANT[:N]",
                   help="variants (plain, images) in separate processes; N defaults to --n")
    p.add_argument("--tmp", default=None, help="where the images variant writes")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one variant
    here = pathlib.Path(__file__).resolve().parent
    p.add_argument("--out", type=pathlib.Path, default=here / "results" / "stream_memory.json")
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args, args.one)))
        return 0

    runs = []
    for spec in args.runs:
        variant, _, n = spec.partition(":")
        if variant not in ("plain", "images"):
            p.error(f"unknown variant {variant!r}")
        cmd = [sys.executable, __file__, "--one", variant, "--n", n or str(args.n),
               "--batch-size", str(args.batch_size), "--eps", repr(args.eps),
               "--attacks", *args.attacks]
        cmd += ["--steps", str(args.steps)] if args.steps else []
        cmd += ["--tmp", args.tmp] if args.tmp else []
        print(" ".join(cmd[1:]), file=sys.stderr, flush=True)
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = write(args, runs)
    ref = report["reference_mb"]
    print(f"n={args.n}: dataset {ref['dataset_uint8']:.0f} MB uint8, "
          f"{ref['dataset_float32']:.0f} MB float32; one batch {ref['batch_float32']:.0f} MB "
          f"float32 (MB = 10^6 bytes)")
    for r in runs:
        print(f"{r['variant']:>6} n={r['n']}: {r['seconds']:.0f} s; RSS before "
              f"{r['rss_before_mb']:.0f} MB, after batch 1 {r['rss_after_batch1_mb']:.0f}, "
              f"after the last {r['rss_after_every_batch_mb'][-1]:.0f} "
              f"(growth {r['growth_batch1_to_last_mb']:+.1f}; per-example arrays "
              f"{r['per_example_arrays_mb']:.1f}); in-batch peak batch 1 "
              f"{r['in_batch_peak_batch1_mb']:.0f}, later <= "
              f"{r['in_batch_peak_later_max_mb']:.0f}; "
              f"ru_maxrss after batch 1 {r['ru_maxrss_after_batch1_mb']:.0f}, at the end "
              f"{r['ru_maxrss_end_mb']:.0f} MB")
    print(f"wrote {args.out}")
    return 0


def write(args: argparse.Namespace, runs: list[dict]) -> dict:
    """The JSON, rewritten after every run (so that a long session keeps what it finished)."""
    import jax

    b = args.batch_size
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "jax": jax.__version__,
                    "backend": jax.default_backend(), "load_average": os.getloadavg()},
        "config": {"shape": [H, W, C], "classes": CLASSES, "batch_size": b,
                   "attacks": args.attacks, "steps": args.steps, "eps": args.eps,
                   "model": "8x8 average pooling + linear 2352 -> 1000", "mesh": None},
        # What the dataset (of --n examples) and one batch would take in host memory.
        "reference_mb": {
            "dataset_uint8": args.n * H * W * C / MB,
            "dataset_float32": args.n * H * W * C * 4 / MB,
            "batch_uint8": b * H * W * C / MB,
            "batch_float32": b * H * W * C * 4 / MB,
        },
        "runs": runs,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    raise SystemExit(main())
