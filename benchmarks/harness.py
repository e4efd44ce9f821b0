"""The timing harness every benchmark script shares.

* :func:`run_interleaved`: each variant's first call (compile + run, with the compile seconds
  JAX reports) then ``repeats`` rounds running every variant once, in an order rotated per
  round; medians, minima and quartiles per variant;
* :func:`medians`: the median seconds per variant of a :func:`run_interleaved` result;
* :func:`make_floors`: the floors (``steps`` bare gradients of the model, four ways);
* :func:`machine_facts` / :func:`model_description`: what the results were measured on;
* :func:`track_compile_time`: the compile-time listener, registered only when called;
* :func:`small_cnn`, :func:`mnist_batch`, :func:`bundle_alone`: the model, data and
  ``bundle`` calls the scripts time; :func:`parse_run_args` (``--quick``, ``--out``),
  :func:`results_path` and :func:`write_results`: where and how a script writes its JSON;
* ``EPS``, ``STEP_SIZE``, ``NORM``: the PGD setting the scripts share (Linf 0.3, step 0.01).

The scripts run as ``python benchmarks/<name>.py``: Python puts ``benchmarks/`` on
``sys.path``, so ``import harness`` needs no path manipulation.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import pathlib
import platform
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle import bundler, losses
from jaxbundle.data import load_mnist_sample
from jaxbundle.models import SmallCNN

EPS = 0.3
STEP_SIZE = 0.01
NORM = "linf"

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def loadavg() -> float | None:
    """The 1-minute load average (``None`` where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_compile_seconds = [0.0]
_listening = [False]


def _on_duration(event: str, duration: float, **_: Any) -> None:
    if event in _COMPILE_EVENTS:
        _compile_seconds[0] += duration


def track_compile_time() -> None:
    """Registers (once per process) the ``jax.monitoring`` listener that sums the trace,
    lowering and XLA compile seconds JAX reports; :func:`run_interleaved` reads it.

    Importing this module registers nothing: a script calls this (``run_interleaved`` calls it
    too), so that importing a benchmark never changes what JAX does in the importing process.
    """
    if not _listening[0]:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _listening[0] = True


def run_interleaved(
    variants: dict[str, Callable[[], Any]], repeats: int, label: str
) -> dict[str, dict[str, Any]]:
    """Times each variant: one first call (compile + run), then ``repeats`` interleaved rounds.

    Each round runs every variant once, in an order rotated by one per round, so that slow
    drifts of the machine's load hit all variants alike.
    """
    track_compile_time()
    names = list(variants)
    out: dict[str, dict[str, Any]] = {n: {"times_s": []} for n in names}
    for n in names:
        _compile_seconds[0] = 0.0
        t0 = time.perf_counter()
        jax.block_until_ready(variants[n]())
        out[n]["first_s"] = time.perf_counter() - t0
        out[n]["compile_s"] = _compile_seconds[0]
        print(
            f"  [{label}] {n}: first call {out[n]['first_s']:.2f} s "
            f"(trace+lower+compile {out[n]['compile_s']:.2f} s)",
            flush=True,
        )
    loads = []
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        gc.collect()
        loads.append(loadavg())
        for n in order:
            t0 = time.perf_counter()
            jax.block_until_ready(variants[n]())
            out[n]["times_s"].append(time.perf_counter() - t0)
        print(
            f"  [{label}] round {r + 1}/{repeats} done (load avg {loads[-1]})",
            flush=True,
        )
    for n in names:
        ts = out[n]["times_s"]
        med = statistics.median(ts)
        out[n]["median_s"] = med
        out[n]["min_s"] = min(ts)
        out[n]["q1_s"], _, out[n]["q3_s"] = (
            statistics.quantiles(ts, n=4) if len(ts) >= 2 else (ts[0], ts[0], ts[0])
        )
        out[n]["first_minus_median_s"] = out[n]["first_s"] - med
    out["_load_avg_per_round"] = loads  # type: ignore[assignment]
    return out


def medians(res: dict[str, Any]) -> dict[str, float]:
    """``{variant: median seconds}`` of a :func:`run_interleaved` result (its ``_``-prefixed
    bookkeeping entries left out)."""
    return {k: v["median_s"] for k, v in res.items() if not k.startswith("_")}


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """The median wall-clock seconds of ``repeats`` warm calls of ``fn`` (one call first, to
    compile), each waited for (``jax.block_until_ready``)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def make_floors(apply_fn, params, x, y, steps: int) -> dict[str, Callable[[], Any]]:
    """``steps`` forward+backward passes of the summed cross-entropy w.r.t. ``x``, four ways:
    40 independent jitted calls (``floor_a_async``), chained calls (``floor_a_chain``), one
    program unrolled at trace time (``floor_b_unrolled``) and a ``lax.fori_loop``
    (``floor_c_fori``). The lowest median is the floor an attack of ``steps`` gradients is
    compared with."""
    def total(xa, p, yy):
        return jnp.sum(losses.cross_entropy(apply_fn(p, xa), yy))

    grad = jax.grad(total)
    grad_jit = jax.jit(grad)

    @jax.jit
    def chain_step(xa, p, yy):
        return xa + 1e-6 * jnp.sign(grad(xa, p, yy))

    @jax.jit
    def unrolled(xa, p, yy):
        for _ in range(steps):
            xa = xa + 1e-6 * jnp.sign(grad(xa, p, yy))
        return xa

    @jax.jit
    def fori(xa, p, yy):
        return jax.lax.fori_loop(0, steps, lambda i, v: v + 1e-6 * jnp.sign(grad(v, p, yy)), xa)

    def a_async():
        return [grad_jit(x, params, y) for _ in range(steps)]

    def a_chain():
        xa = x
        for _ in range(steps):
            xa = chain_step(xa, params, y)
        return xa

    return {
        "floor_a_async": a_async,
        "floor_a_chain": a_chain,
        "floor_b_unrolled": lambda: unrolled(x, params, y),
        "floor_c_fori": lambda: fori(x, params, y),
    }


def machine_facts() -> dict[str, Any]:
    """Versions, backend, device, CPUs, platform, ``XLA_FLAGS`` and load when a run starts."""
    dev = jax.devices()[0]
    try:
        import jaxlib

        jaxlib_version = jaxlib.__version__
    except Exception:  # pragma: no cover
        jaxlib_version = None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        affinity = None
    cpu_model = None
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib_version,
        "backend": jax.default_backend(),
        "device": str(dev),
        "device_kind": getattr(dev, "device_kind", None),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "cpu_model": cpu_model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "load_avg_start": loadavg(),
    }


def model_description(module, params) -> dict[str, Any]:
    """The module's fields and parameter shapes (the model file may change under us)."""
    fields = {
        f.name: getattr(module, f.name)
        for f in dataclasses.fields(module)
        if f.name not in ("parent", "name")
    }
    shapes = {
        "/".join(str(getattr(k, "key", k)) for k in path): list(v.shape)
        for path, v in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    return {
        "class": type(module).__name__,
        "fields": {k: v if isinstance(v, (int, float, str, bool)) else repr(v)
                   for k, v in fields.items()},
        "param_shapes": shapes,
        "num_params": int(sum(np.prod(v) for v in shapes.values())),
    }


def small_cnn() -> tuple[Any, Any]:
    """``jaxbundle.models.SmallCNN()`` and its random-init params (``PRNGKey(0)``)."""
    module = SmallCNN()
    return module, module.init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 1), jnp.float32))


def mnist_batch(n: int) -> tuple[jax.Array, jax.Array]:
    """The first ``n`` embedded MNIST test images and their labels, as jax arrays."""
    ds = load_mnist_sample("test", n=n)
    return jnp.asarray(ds.x), jnp.asarray(ds.y)


def bundle_alone(built: dict[str, tuple[Any, str, float]], apply_fn, params, x, y,
                 key) -> dict[str, Callable[[], Any]]:
    """For each ``name -> (attack, norm, eps)``: a call of ``bundle`` with that attack alone."""
    return {
        name: (lambda a=attack, nm=norm, e=eps: bundler.bundle(
            [a], apply_fn, params, x, y, key, eps=e, norm=nm))
        for name, (attack, norm, eps) in built.items()
    }


def parse_run_args(p, argv, name: str, quick: dict[str, Any]):
    """Adds ``--quick`` and ``--out`` to the parser ``p`` and parses ``argv``; with ``--quick``
    the values of ``quick`` replace the arguments', and ``args.out`` is :func:`results_path`'s."""
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        for key, value in quick.items():
            setattr(args, key, value)
    args.out = results_path(args.out, name, args.quick)
    return args


def results_path(out: pathlib.Path | None, name: str, quick: bool) -> pathlib.Path:
    """``out`` if given, else ``benchmarks/results/<name>.json`` (``<name>_quick.json`` for a
    quick run)."""
    return out or RESULTS / (f"{name}_quick.json" if quick else f"{name}.json")


def write_results(path: pathlib.Path, results: Any) -> None:
    """Writes ``results`` as indented JSON to ``path`` (its folder made if need be)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
