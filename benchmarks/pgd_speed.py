"""PGD-40 through ``jaxbundle.bundler.bundle`` versus the cost of 40 bare gradients.

What is measured (all in one process, variants interleaved round-robin, medians reported):

* **floors**: 40 x (one forward + backward of the same model on the same batch), four ways:

  - ``floor_a_async``: a jitted ``grad`` of the summed CE w.r.t. ``x``, 40 independent calls
    dispatched from Python, one ``block_until_ready`` at the end;
  - ``floor_a_chain``: the same but chained (``x <- x + 1e-6 * sign(g)`` inside the jitted
    call), so that each call waits for the previous one, as PGD does;
  - ``floor_b_unrolled``: one jitted function doing the 40 chained grads in a Python loop at
    trace time (straight-line HLO);
  - ``floor_c_fori``: the same with ``lax.fori_loop`` (an XLA ``while`` loop).

  The *best floor* is the lowest median of these.

* **library**: ``bundle([pgd(steps=40, step_size=0.01)], apply_fn, params, x, y, key, eps=0.3)``
  with ``unroll`` in 1 / 4 / True (full; ``--unrolls`` for others), plus ``validate=False`` for
  the full unroll.

* **python-driven**: the same work as ``bundle`` (pgd init, step, candidate scoring and
  :func:`jaxbundle.bundler.fold` per step, final evaluation, verification) but with one jitted
  step called 40 times from Python instead of a ``lax.scan``.

* **stripped**: a copy of the bundler's program with the per-step fold removed (the scan
  only runs ``pgd.step``; the final iterate is verified), at unroll 1 and full: bundle minus
  stripped is the cost of the fold.

* **diagnostics** (``diag_*_<twin>``): the same runs with a numerically identical twin of
  SmallCNN whose input-gradient convolution has the *other* layout. XLA:CPU runs a
  non-canonical convolution (kernel ``01oi``, which JAX's transpose rule produces for every
  ``nn.Conv``) on a slow naive emitter when it sits inside a loop body (see
  ``conv_layout_report``). If ``jaxbundle.models.SmallCNN`` has a canonical gradient (its own
  ``custom_vjp`` convolution), the twin is the plain ``nn.Conv`` formulation (``jaxconv``:
  what a user's flax model gets); otherwise it is the canonical one (``canonconv``). Also the
  python-driven pieces (``piece_*``: init, 40 steps with / without fold, finish) timed alone.

* **restarts** (at one N, default 512): PGD-40 with 4 restarts, ``restart_mode`` "vmap" and
  "map" at unroll 1 and full, and 4 separate ``bundle`` calls; ratio to 4 x the best floor.

Compile time = the trace + lowering + XLA compile seconds that JAX reports (``jax.monitoring``
duration events) during each variant's first call; ``first_minus_median_s`` (first call minus
the steady-state median) is kept too, but on a loaded machine it is noise-dominated.

Usage::

    python benchmarks/pgd_speed.py                  # N = 512 and 64, 7 rounds, 5 for restarts
                                                    # (~37 min, 2 CPUs)
    python benchmarks/pgd_speed.py --n 512 64 --repeats 11
    python benchmarks/pgd_speed.py --quick          # smoke test, < 60 s (N=16, PGD-2)

Writes ``benchmarks/results/pgd_speed.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxbundle import bundler
from jaxbundle.attacks import pgd
from jaxbundle.attacks.base import per_example_keys

from conv_twins import (  # noqa: F401  (re-exported: pgd_speed.<name> as before)
    _CONV_S2,
    _COMP_RE,
    _plain_conv_s2,
    _small_cnn_apply,
    alternative_model,
    conv_layout_report,
    grad_is_canonical_in_loops,
    max_abs_diff_apply,
    small_cnn_apply_canonical_grad,
    small_cnn_apply_jax_conv,
)
from harness import (
    EPS, NORM, STEP_SIZE, loadavg, machine_facts, make_floors, mnist_batch, model_description,
    results_path, run_interleaved, small_cnn, write_results,
)

GOALS = ("misclassify",)
TARGET = {512: 1.05, 64: 1.10}  # from the issue: library path / best floor


# ----------------------------------------------------------------------------------------
# Library paths and comparison programs built from the library's pieces
# ----------------------------------------------------------------------------------------


def make_bundle_call(attack, apply_fn, params, x, y, key, **kw) -> Callable[[], Any]:
    return lambda: bundler.bundle([attack], apply_fn, params, x, y, key, eps=EPS, **kw)


JUDGING = "auto"  # bundle()'s default
RESTART_MODE = "vmap"  # bundle()'s default


def make_python_driven(attack, apply_fn, params, x, y, key) -> Callable[[], Any]:
    """bundle()'s work for one attack, with the step loop in Python: built from the bundler's
    own pieces so that it cannot drift from ``bundler.run``.

    ``init`` is ``bundler.start_stage`` (``problem``, ``clean_state``, ``Driver.init``: the same
    keys and init); each ``step`` is ``bundler.step_stage`` for steps ``t .. t + 1``
    (``Driver.steps``: ``attack.step``, ``candidate_state``, ``fold_all``); ``finish`` mirrors
    the end of ``run``'s attack loop (``Driver.judge``, ``fold_each`` into the clean best).
    What differs from ``bundle`` is the loop (one dispatch per step) and the per-call
    ``problem`` (a grid check of the batch) of each stage.
    """
    example_id = jnp.arange(x.shape[0], dtype=jnp.int32)
    rules = bundler.Rules(apply_fn, GOALS, NORM, JUDGING, RESTART_MODE)
    driver = bundler.Driver(attack, 0, rules)

    def init(p, x0, yy, k, ids):
        return bundler.start_stage(p, x0, yy, k, ids, EPS, driver=driver)

    def step(p, running, t):
        return bundler.step_stage(p, running, x, y, EPS, t, t + 1, driver=driver)

    @jax.jit
    def finish(p, running):
        # bundler.run's lines after Driver.steps, for attack 0
        problem = bundler.problem(rules, p, x, y, EPS, running.keys)
        found = driver.judge(problem, running, attack.num_steps).best
        return bundler.fold_each(GOALS, problem.eps, {g: running.clean for g in GOALS}, found)

    @jax.jit
    def step_nofold(p, running, t):
        # the body of Driver.steps without candidate_state / fold_all (restart 0)
        model = bundler.problem(rules, p, x, y, EPS, running.keys).model
        restart_keys = bundler.restart_keys(running.keys, 0, 0)
        state = jax.tree.map(lambda a: a[0], running.state)
        state, _ = attack.step(attack.config, state, bundler.seen(attack, model, restart_keys, t))
        return running._replace(state=jax.tree.map(lambda a: a[None], state))

    steps_t = [jnp.int32(t) for t in range(attack.num_steps)]

    def run():
        running = init(params, x, y, key, example_id)
        for t in steps_t:
            running = step(params, running, t)
        return finish(params, running)

    # The same pieces timed alone (from a fixed state), to split the overhead up.
    running0 = jax.block_until_ready(init(params, x, y, key, example_id))

    def steps_fold():
        running = running0
        for t in steps_t:
            running = step(params, running, t)
        return running

    def steps_nofold():
        running = running0
        for t in steps_t:
            running = step_nofold(params, running, t)
        return running

    pieces = {
        "piece_init (random start + clean fwd)": lambda: init(params, x, y, key, example_id),
        f"piece_{attack.num_steps}_steps_with_fold": steps_fold,
        f"piece_{attack.num_steps}_steps_no_fold": steps_nofold,
        "piece_finish (final fwd + verify fwd)": lambda: finish(params, running0),
    }
    return run, pieces


@functools.partial(jax.jit, static_argnames=("apply_fn", "attack", "unroll"))
def _stripped(params, x0, y, key, example_id, *, apply_fn, attack, unroll):
    """``bundler.run`` for one attack (one restart) without the per-step candidate fold.

    Built from the bundler's functions: ``problem``, ``clean_state`` and ``Driver.init`` as in
    ``run``; the scan runs the body of ``Driver.steps`` minus ``candidate_state`` /
    ``fold_all`` (``attack.step`` on the model ``seen`` under the restart's keys); then
    ``Driver.judge`` (the final iterate folded into the clean start, verified) and
    ``fold_each`` as in ``run``.
    """
    if attack.num_restarts != 1:
        raise ValueError("the stripped program runs one restart")
    rules = bundler.Rules(apply_fn, GOALS, NORM, JUDGING, RESTART_MODE)
    driver = bundler.Driver(attack, 0, rules)
    keys = per_example_keys(key, example_id)
    problem = bundler.problem(rules, params, x0, y, EPS, keys)
    clean = bundler.clean_state(rules, problem)
    running = driver.init(problem, clean)
    restart_keys = bundler.restart_keys(keys, 0, 0)

    def body(state, t):
        state, _ = attack.step(attack.config, state,
                               bundler.seen(attack, problem.model, restart_keys, t))
        return state, None

    state = jax.tree.map(lambda a: a[0], running.state)
    state, _ = jax.lax.scan(body, state, jnp.arange(attack.num_steps, dtype=jnp.int32),
                            unroll=unroll)
    running = running._replace(state=jax.tree.map(lambda a: a[None], state))
    found = driver.judge(problem, running, attack.num_steps).best
    return bundler.fold_each(GOALS, problem.eps, {g: clean for g in GOALS}, found)


def make_stripped(attack, apply_fn, params, x, y, key, unroll) -> Callable[[], Any]:
    ids = jnp.arange(x.shape[0], dtype=jnp.int32)
    return lambda: _stripped(params, x, y, key, ids, apply_fn=apply_fn, attack=attack,
                             unroll=unroll)


# ----------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------


def _summary(res: dict[str, Any], floor: float, floor_min: float) -> dict[str, Any]:
    return {
        "median_s": res["median_s"],
        "min_s": res["min_s"],
        "q1_s": res["q1_s"],
        "q3_s": res["q3_s"],
        "first_s": res["first_s"],
        "compile_s": res["compile_s"],
        "first_minus_median_s": res["first_minus_median_s"],
        "ratio_to_best_floor": res["median_s"] / floor,
        # min / (lowest min among the floors): less sensitive to other tenants' load
        "ratio_min_to_best_floor_min": res["min_s"] / floor_min,
        "times_s": res["times_s"],
    }


def _single_variants(args, attack, apply_fn, params, x, y, key, steps):
    """The variants of the single-restart section (floors, ``bundle`` at each unroll, the
    python-driven and stripped copies, the pieces, the twin's diagnostics) and the twin: the
    ``(label, apply_fn)`` of :func:`alternative_model`, or None without ``args.twin``."""
    variants: dict[str, Callable[[], Any]] = {}
    variants.update(make_floors(apply_fn, params, x, y, steps))
    for u in args.unrolls:
        variants[f"bundle_unroll={u}"] = make_bundle_call(attack, apply_fn, params, x, y, key,
                                                          unroll=u)
    variants["bundle_unroll=True_novalidate"] = make_bundle_call(
        attack, apply_fn, params, x, y, key, unroll=True, validate=False
    )
    variants["python_driven"], pieces = make_python_driven(attack, apply_fn, params, x, y, key)
    for u in (1, True):
        variants[f"stripped_nofold_unroll={u}"] = make_stripped(attack, apply_fn, params, x, y,
                                                                key, u)
    if args.pieces:
        variants.update(pieces)
    twin = alternative_model(apply_fn, params, x, y) if args.twin else None
    if twin is not None:
        twin_label, twin_fn = twin
        variants[f"diag_floor_c_fori_{twin_label}"] = make_floors(
            twin_fn, params, x, y, steps)["floor_c_fori"]
        for u in (1, True):
            variants[f"diag_bundle_unroll={u}_{twin_label}"] = make_bundle_call(
                attack, twin_fn, params, x, y, key, unroll=u
            )
    return variants, twin


def _single_section(n, steps, res) -> dict[str, Any]:
    """The section's floors, summaries and library ratios from :func:`run_interleaved`'s
    ``res``."""
    loads = res.pop("_load_avg_per_round")
    floors = {k: v for k, v in res.items() if k.startswith("floor_")}
    best_floor_name = min(floors, key=lambda k: floors[k]["median_s"])
    best_floor = floors[best_floor_name]["median_s"]
    best_floor_min = min(v["min_s"] for v in floors.values())
    out = {
        "n": n,
        "steps": steps,
        "best_floor": best_floor_name,
        "best_floor_s": best_floor,
        "per_grad_ms_at_best_floor": 1e3 * best_floor / steps,
        "load_avg_per_round": loads,
        "best_floor_min_s": best_floor_min,
        "variants": {k: _summary(v, best_floor, best_floor_min) for k, v in res.items()},
    }
    lib = {k: v for k, v in out["variants"].items()
           if k.startswith("bundle_unroll=") and "novalidate" not in k}
    best_lib = min(lib, key=lambda k: lib[k]["median_s"])
    out["best_library_variant"] = best_lib
    out["best_library_ratio"] = lib[best_lib]["ratio_to_best_floor"]
    out["default_library_ratio"] = lib.get("bundle_unroll=1", {}).get("ratio_to_best_floor")
    tgt = TARGET.get(n)
    out["target_ratio"] = tgt
    out["meets_target"] = None if tgt is None else bool(out["best_library_ratio"] <= tgt)
    return out


def _python_driven_check(variants, unroll) -> dict[str, Any]:
    """Sanity: the python-driven copy does the same computation as bundle()."""
    r_lib = variants[f"bundle_unroll={unroll}"]()
    r_py = variants["python_driven"]()
    return {
        "python_driven_max_abs_diff_vs_bundle": float(
            jnp.max(jnp.abs(r_lib.best["misclassify"].x - r_py["misclassify"].x))
        ),
        "python_driven_same_success": bool(
            jnp.all(r_lib.best["misclassify"].score.misclassified
                    == r_py["misclassify"].score.misclassified)
        ),
    }


def _hlo_report(args, attack, apply_fn, params, x, y, key, n, twin) -> dict[str, Any]:
    """:func:`conv_layout_report` of ``bundle``'s compiled program at each unroll (and of the
    twin's at unroll 1)."""
    diag = {}
    ids = jnp.arange(n, dtype=jnp.int32)
    for u in args.unrolls:
        c = bundler.run.lower(
            params, x, y, key, ids, EPS, attacks=(attack,),
            rules=bundler.Rules(apply_fn, GOALS, NORM, "auto", "vmap", u),
        ).compile()
        diag[f"bundle_unroll={u}"] = conv_layout_report(c.as_text())
    if twin is not None:
        twin_label, twin_fn = twin
        c = bundler.run.lower(
            params, x, y, key, ids, EPS, attacks=(attack,),
            rules=bundler.Rules(twin_fn, GOALS, NORM, "auto", "vmap", 1),
        ).compile()
        diag[f"diag_bundle_unroll=1_{twin_label}"] = conv_layout_report(c.as_text())
    return diag


def bench_single(n, args, apply_fn, params, steps) -> dict[str, Any]:
    x, y = mnist_batch(n)
    key = jax.random.PRNGKey(1)
    attack = pgd(norm=NORM, loss="ce", steps=steps, step_size=STEP_SIZE, random_start=True)
    variants, twin = _single_variants(args, attack, apply_fn, params, x, y, key, steps)
    out = _single_section(n, steps, run_interleaved(variants, args.repeats, f"N={n}"))
    out.update(_python_driven_check(variants, args.unrolls[0]))
    if twin is not None:
        out["twin_model"] = twin[0]
        out["twin_max_abs_diff"] = max_abs_diff_apply(apply_fn, twin[1], params, x, y)
    if args.hlo:
        out["hlo"] = _hlo_report(args, attack, apply_fn, params, x, y, key, n, twin)
    return out


def bench_restarts(
    n, args, apply_fn, params, steps, single_floor_s, single_floor_min_s
) -> dict[str, Any]:
    x, y = mnist_batch(n)
    key = jax.random.PRNGKey(2)
    r = args.restarts
    multi = pgd(norm=NORM, steps=steps, restarts=r, step_size=STEP_SIZE)
    single = pgd(norm=NORM, steps=steps, restarts=1, step_size=STEP_SIZE)

    variants: dict[str, Callable[[], Any]] = {}
    # Floors measured in this section too (the machine drifts): r*steps chained grads at N,
    # and steps chained grads at r*N (what the vmap over restarts amounts to).
    f_n = make_floors(apply_fn, params, x, y, steps * r)
    variants["floor_a_chain_x%d" % r] = f_n["floor_a_chain"]
    xr = jnp.concatenate([x] * r)
    yr = jnp.concatenate([y] * r)
    f_rn = make_floors(apply_fn, params, xr, yr, steps)
    variants[f"floor_a_chain_batch{r}N"] = f_rn["floor_a_chain"]
    for u in args.restart_unrolls:
        for mode in ("vmap", "map"):
            variants[f"bundle_{mode}_unroll={u}"] = make_bundle_call(
                multi, apply_fn, params, x, y, key, unroll=u, restart_mode=mode
            )
        calls = [
            make_bundle_call(single, apply_fn, params, x, y, jax.random.fold_in(key, i), unroll=u)
            for i in range(r)
        ]
        variants[f"bundle_{r}_separate_calls_unroll={u}"] = lambda calls=calls: [c() for c in calls]

    if args.twin:
        twin_label, twin = alternative_model(apply_fn, params, x, y)
        for mode in ("vmap", "map"):
            variants[f"diag_bundle_{mode}_unroll=1_{twin_label}"] = make_bundle_call(
                multi, twin, params, x, y, key, unroll=1, restart_mode=mode
            )
    res = run_interleaved(variants, args.restart_repeats, f"restarts N={n}")
    loads = res.pop("_load_avg_per_round")
    floor_candidates = {
        f"{r} x best single floor (N={n} section)": r * single_floor_s if single_floor_s else None,
        **{k: v["median_s"] for k, v in res.items() if k.startswith("floor_")},
    }
    floor_candidates = {k: v for k, v in floor_candidates.items() if v is not None}
    best_floor_name = min(floor_candidates, key=floor_candidates.get)
    best_floor = floor_candidates[best_floor_name]
    min_candidates = [r * single_floor_min_s] if single_floor_min_s else []
    min_candidates += [v["min_s"] for k, v in res.items() if k.startswith("floor_")]
    best_floor_min = min(min_candidates)
    out = {
        "n": n,
        "steps": steps,
        "restarts": r,
        "floor_candidates_s": floor_candidates,
        "best_floor": best_floor_name,
        "best_floor_s": best_floor,
        "best_floor_min_s": best_floor_min,
        "load_avg_per_round": loads,
        "variants": {k: _summary(v, best_floor, best_floor_min) for k, v in res.items()},
    }
    lib = {k: v for k, v in out["variants"].items() if k.startswith("bundle_")}
    best_lib = min(lib, key=lambda k: lib[k]["median_s"])
    out["best_library_variant"] = best_lib
    out["best_library_ratio"] = lib[best_lib]["ratio_to_best_floor"]
    return out


def print_table(title: str, sec: dict[str, Any]) -> None:
    print()
    print(f"== {title}: best floor = {sec['best_floor']} = {sec['best_floor_s'] * 1e3:.1f} ms ==")
    print(f"{'variant':42s} {'median ms':>10s} {'min ms':>9s} {'IQR ms':>13s} {'ratio':>6s} "
          f"{'ratio(min)':>10s} {'compile s':>9s}")
    for k, v in sec["variants"].items():
        iqr = f"{v['q1_s'] * 1e3:.0f}-{v['q3_s'] * 1e3:.0f}"
        print(
            f"{k:42s} {v['median_s'] * 1e3:10.1f} {v['min_s'] * 1e3:9.1f} {iqr:>13s} "
            f"{v['ratio_to_best_floor']:6.2f} {v['ratio_min_to_best_floor_min']:10.2f} "
            f"{v['compile_s']:9.2f}"
        )
    extra = {k: sec[k] for k in ("best_library_variant", "best_library_ratio",
                                 "default_library_ratio", "target_ratio", "meets_target",
                                 "python_driven_max_abs_diff_vs_bundle",
                                 "python_driven_same_success", "twin_model", "twin_max_abs_diff")
             if k in sec}
    print("  ", json.dumps(extra))
    if "hlo" in sec:
        print("   HLO:", json.dumps(sec["hlo"]))


def _unroll_arg(s: str) -> int | bool:
    if s.lower() in ("true", "full"):
        return True
    return int(s)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with ``--quick``'s settings and the defaults filled in."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=None, help="batch sizes (default 512 64)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per section (default 7)")
    p.add_argument("--restart-repeats", type=int, default=None,
                   help="rounds for the restarts section (default 5: it is the slow one)")
    p.add_argument("--steps", type=int, default=None, help="PGD steps (default 40)")
    p.add_argument("--restarts", type=int, default=4)
    p.add_argument("--restart-n", type=int, default=None,
                   help="N of the restarts section (default 512)")
    p.add_argument("--no-restarts", action="store_true", help="skip the restarts section")
    p.add_argument("--unrolls", type=_unroll_arg, nargs="+", default=[1, 4, True],
                   help="scan unroll factors for bundle() (int or True/full); default 1 4 True")
    p.add_argument("--restart-unrolls", type=_unroll_arg, nargs="+", default=[1, True])
    p.add_argument("--no-pieces", dest="pieces", action="store_false",
                   help="skip timing the python-driven pieces (init / steps / finish) alone")
    p.add_argument("--no-twin", dest="twin", action="store_false",
                   help="skip the diagnostic variants with SmallCNN's numerically identical twin "
                   "whose input gradient has the other convolution layout")
    p.add_argument("--no-hlo", dest="hlo", action="store_false", help="skip the HLO conv report")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: N=16, PGD-2, 2 restarts, 1 round, unroll 1 and full, "
                        "no diag/pieces (< 60 s)")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="JSON output (default benchmarks/results/pgd_speed.json; "
                   "pgd_speed_quick.json with --quick)")
    args = p.parse_args(argv)
    args.out = results_path(args.out, "pgd_speed", args.quick)
    if args.quick:
        args.n = args.n or [16]
        args.repeats = args.repeats or 1
        args.steps = args.steps or 2
        args.restarts = 2
        args.restart_n = args.restart_n or 16
        args.unrolls = [1, True]
        args.restart_unrolls = [True]
        args.twin = False
        args.pieces = False
    args.n = args.n or [512, 64]
    args.repeats = args.repeats or 7
    args.restart_repeats = args.restart_repeats or (args.repeats if args.quick else 5)
    args.steps = args.steps or 40
    args.restart_n = args.restart_n or 512
    return args


def _print_summary(results: dict[str, Any]) -> None:
    """The summary lines: each section's best floor and library ratios, and the wall time."""
    print()
    print("== summary ==")
    for n, sec in results["single"].items():
        print(
            f"N={n}: best floor {sec['best_floor']} {sec['best_floor_s'] * 1e3:.1f} ms; "
            f"best library {sec['best_library_variant']} ratio {sec['best_library_ratio']:.2f} "
            f"(target {sec['target_ratio']}, met: {sec['meets_target']}); "
            f"default unroll=1 ratio {sec['default_library_ratio']}"
        )
    if "restarts" in results:
        sec = results["restarts"]
        print(f"restarts N={sec['n']}: best {sec['best_library_variant']} "
              f"ratio {sec['best_library_ratio']:.2f}")
    print(f"wall {results['wall_s']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)

    t_start = time.perf_counter()
    facts = machine_facts()
    print("machine:", json.dumps(facts), flush=True)
    module, params = small_cnn()
    apply_fn = module.apply
    model_facts = model_description(module, params)
    print("model:", json.dumps(model_facts), flush=True)

    results: dict[str, Any] = {
        "machine": facts,
        "config": {
            "model": "jaxbundle.models.SmallCNN, random init (PRNGKey(0))",
            "model_facts": model_facts,
            "data": "jaxbundle.data.load_mnist_sample('test', n)",
            "attack": (f"pgd(norm='linf', loss='ce', steps={args.steps}, "
                       f"step_size={STEP_SIZE}, random_start=True)"),
            "eps": EPS,
            "repeats": args.repeats,
            "restart_repeats": args.restart_repeats,
            "quick": args.quick,
            "argv": sys.argv[1:] if argv is None else argv,
        },
        "single": {},
    }
    single_floor, single_floor_min = {}, {}
    for n in args.n:
        print(f"\n-- PGD-{args.steps}, N={n}", flush=True)
        sec = bench_single(n, args, apply_fn, params, args.steps)
        results["single"][str(n)] = sec
        single_floor[n] = sec["best_floor_s"]
        single_floor_min[n] = sec["best_floor_min_s"]
        print_table(f"PGD-{args.steps} N={n}", sec)
    if not args.no_restarts:
        n = args.restart_n
        print(f"\n-- PGD-{args.steps} x {args.restarts} restarts, N={n}", flush=True)
        sec = bench_restarts(
            n, args, apply_fn, params, args.steps, single_floor.get(n), single_floor_min.get(n)
        )
        results["restarts"] = sec
        print_table(f"PGD-{args.steps} x {args.restarts} restarts N={n}", sec)

    results["machine"]["load_avg_end"] = loadavg()
    results["wall_s"] = time.perf_counter() - t_start
    _print_summary(results)
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
