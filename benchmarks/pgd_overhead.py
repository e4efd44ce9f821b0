"""Where does ``bundle()``'s time go beyond the 40 gradients? A decomposition probe.

Companion of ``pgd_speed.py`` (same model, data and attack; timing by ``harness.py``). Each variant
adds one piece of the bundler's program on top of the previous one, all interleaved in one
process, medians over ``--repeats`` rounds:

* ``floor_b_unrolled``: 40 chained grads, straight-line (the floor);
* ``U_pgd``: ``pgd.init`` + 40 x ``pgd.step`` unrolled at trace time (sign, projection,
  logits as aux output), nothing else;
* ``U_pgd_fold``: + per-step ``candidate_state`` + ``fold`` (the bundler's scan body),
  unrolled;
* ``bundle_unroll=True``: the library (adds clean forward, final forward, verification);
* ``S_pgd`` / ``S_pgd_fold`` / ``bundle_unroll=1``: the same in a rolled ``lax.scan``, with a
  model whose input-gradient convolution XLA:CPU runs on its fast path inside loops: SmallCNN
  itself if its gradient is canonical, else the canonical twin from ``pgd_speed.py``;
* ``fold_x40_only``: 40 folds with fixed logits and no gradients, in one program;
* ``fold_x40_dispatched``: one jitted fold called 40 times from Python;
* ``score_x40_only``: 40 x ``goals.score`` (margin, argmax, distortion, confidence) alone;
* ``image_where_x40_only``: 40 x the per-example ``where`` on the image alone.

Run with different ``XLA_FLAGS`` to test compiler options, e.g.::

    python benchmarks/pgd_overhead.py --n 64
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=-reduce \\
        python benchmarks/pgd_overhead.py --n 512 64 \\
        --out benchmarks/results/pgd_overhead_noynnreduce.json
    python benchmarks/pgd_overhead.py --patch-linf-norm \\
        --out benchmarks/results/pgd_overhead_patched.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp

from harness import (
    EPS, NORM, STEP_SIZE, machine_facts, make_floors, mnist_batch, model_description,
    run_interleaved, small_cnn, write_results,
)
from pgd_speed import grad_is_canonical_in_loops, make_bundle_call, small_cnn_apply_canonical_grad

from jaxbundle import bundler
from jaxbundle import goals as goals_lib
from jaxbundle import norms, sampling
from jaxbundle.attacks import pgd
from jaxbundle.attacks.base import WhiteBoxModel, per_example_keys


def make_pgd_program(apply_fn, attack, *, fold: bool, unroll: int | bool, loop: str):
    """init + steps (+ fold) of attack 0, restart 0, built from the bundler's own pieces;
    ``loop`` "python" (unrolled at trace time) or "scan".

    Mirrors ``bundler.Driver.init`` (keys by ``bundler.restart_keys``, the model as the
    attack sees it by ``bundler.seen``, ``attack.init``) and the body of
    ``bundler.Driver.steps`` (``attack.step``, then with ``fold`` ``candidate_state`` and
    ``fold_all``); it leaves out the clean forward (the starting best is scored on zero logits
    with the model's class count), the still-improving bookkeeping, the final forward and the
    verification, which ``bundle`` adds.
    """
    goal_names = ("misclassify",)

    @jax.jit
    def run(params, x0, y, key):
        model = WhiteBoxModel(apply_fn, params)
        eps = jnp.full(y.shape, EPS, jnp.float32)
        ids = jnp.arange(y.shape[0], dtype=jnp.int32)
        restart_keys = bundler.restart_keys(per_example_keys(key, ids), 0, 0)
        seen = bundler.seen(attack, model, restart_keys, sampling.INIT_CALL)
        state = attack.init(attack.config, restart_keys, x0, y, eps, seen, 0)
        classes = jax.eval_shape(apply_fn, params, x0).shape[-1]
        start = bundler.candidate_state(x0, jnp.zeros((y.shape[0], classes)), x0, y, NORM,
                                        (-1, 0, 0), goal_names)
        best = {g: start for g in goal_names}

        def body(carry, t):
            s, b = carry
            s, cand = attack.step(attack.config, s, bundler.seen(attack, model, restart_keys, t))
            if fold:
                c = bundler.candidate_state(cand.x, cand.logits, x0, y, NORM, (0, 0, t), goal_names)
                b = bundler.fold_all(goal_names, eps, b, c)
            return (s, b), None

        if loop == "python":
            carry = (state, best)
            for t in range(attack.num_steps):
                carry, _ = body(carry, jnp.int32(t))
        else:
            carry, _ = jax.lax.scan(body, (state, best), jnp.arange(attack.num_steps),
                                    unroll=unroll)
        return carry if fold else carry[0].x

    return run


def make_fold_only(x0, y, logits, steps):
    eps = jnp.full(y.shape, EPS, jnp.float32)

    @jax.jit
    def many(xa, lg):
        best = bundler.candidate_state(x0, lg, x0, y, NORM, (-1, 0, 0))
        for t in range(steps):
            c = bundler.candidate_state(xa + t * 1e-3, lg + t, x0, y, NORM, (0, 0, t))
            best = bundler.fold("misclassify", eps, best, c)
        return best

    @jax.jit
    def one(best, xa, lg, t):
        c = bundler.candidate_state(xa, lg, x0, y, NORM, (0, 0, t))
        return bundler.fold("misclassify", eps, best, c)

    ts = [jnp.int32(t) for t in range(steps)]

    def dispatched(xa, lg):
        best = bundler.candidate_state(x0, lg, x0, y, NORM, (-1, 0, 0))
        for t in ts:
            best = one(best, xa, lg, t)
        return best

    @jax.jit
    def scores_only(xa, lg):
        acc = jnp.zeros(y.shape, jnp.float32)
        for t in range(steps):
            sc = goals_lib.score(xa + t * 1e-3, lg + t, x0, y, NORM)
            acc = acc + sc.margin + sc.distortion + sc.confidence + sc.prediction + sc.misclassified
        return acc

    @jax.jit
    def where_only(xa, lg):
        best = x0
        for t in range(steps):
            take = lg[:, t % lg.shape[1]] > 0.5 * t
            best = jnp.where(take[:, None, None, None], xa + t * 1e-3, best)
        return best

    return many, dispatched, scores_only, where_only


@contextlib.contextmanager
def _linf_norm_patched():
    """Temporarily computes ``norms.norm(d, "linf")`` as ``max(max(d), -min(d))``."""
    original = norms.norm

    def norm(delta, name):
        if name == "linf":
            flat = delta.reshape(delta.shape[0], -1)
            return jnp.maximum(jnp.max(flat, axis=1), -jnp.min(flat, axis=1))
        return original(delta, name)

    norms.norm = norm
    try:
        yield
    finally:
        norms.norm = original


def _traced_patched(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` whose first call (where jit traces) runs with the patched Linf norm."""
    first = [True]

    def run():
        if first[0]:
            first[0] = False
            with _linf_norm_patched():
                return fn()
        return fn()

    return run


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[64])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--only", nargs="+", default=None,
                   help="time only the variants whose names contain one of these strings "
                   "(the two floors are always kept)")
    p.add_argument("--patch-linf-norm", action="store_true",
                   help="experiment: add '*_patchednorm' twins of the bundle / fold / score "
                   "variants, traced while jaxbundle.norms.norm computes the Linf norm as "
                   "max(max(d), -min(d)) (the same numbers) instead of max(abs(d)), whose fused "
                   "4-D reduction XLA:CPU runs slowly; shows what that library change would gain")
    p.add_argument("--out", type=pathlib.Path,
                   default=(pathlib.Path(__file__).resolve().parent / "results"
                            / "pgd_overhead.json"))
    return p.parse_args(argv)


def _patched_variants(args, attack, canon, params, x, y, key, xr, logits):
    """The ``*_patchednorm`` variants (``--patch-linf-norm``): traced with the patched norm."""
    v: dict[str, Callable[[], Any]] = {}

    # New function objects, so that jit traces (and caches) these separately.
    def apply_patched(p_, x_):
        return canon(p_, x_)

    prog = make_pgd_program(apply_patched, attack, fold=True, unroll=1, loop="scan")
    v["S_pgd_fold_patchednorm"] = _traced_patched(lambda: prog(params, x, y, key))
    v["bundle_unroll=1_patchednorm"] = _traced_patched(
        make_bundle_call(attack, apply_patched, params, x, y, key, unroll=1)
    )
    many_p, _, scores_p, _ = make_fold_only(x, y, logits, args.steps)
    v[f"fold_x{args.steps}_only_patchednorm"] = _traced_patched(lambda: many_p(xr, logits))
    v[f"score_x{args.steps}_only_patchednorm"] = _traced_patched(
        lambda: scores_p(xr, logits))
    return v


def _variants(args, attack, apply_fn, canon, params, x, y, key) -> dict[str, Callable[[], Any]]:
    """The section's variants, each adding one piece of the bundler's program (see the module
    docstring), less those ``--only`` leaves out."""
    floors = make_floors(apply_fn, params, x, y, args.steps)
    v: dict[str, Callable[[], Any]] = {
        "floor_b_unrolled": floors["floor_b_unrolled"],
        "floor_a_chain": floors["floor_a_chain"],
    }
    for name, fn, fold, unroll, loop in [
        ("U_pgd", apply_fn, False, True, "python"),
        ("U_pgd_fold", apply_fn, True, True, "python"),
        ("S_pgd", canon, False, 1, "scan"),
        ("S_pgd_fold", canon, True, 1, "scan"),
    ]:
        prog = make_pgd_program(fn, attack, fold=fold, unroll=unroll, loop=loop)
        v[name] = lambda prog=prog: prog(params, x, y, key)
    v["bundle_unroll=True"] = make_bundle_call(attack, apply_fn, params, x, y, key, unroll=True)
    v["bundle_unroll=1"] = make_bundle_call(attack, canon, params, x, y, key, unroll=1)
    logits = apply_fn(params, x)
    xr = jnp.clip(x + 0.1, 0.0, 1.0)
    many, dispatched, scores_only, where_only = make_fold_only(x, y, logits, args.steps)
    v[f"fold_x{args.steps}_only"] = lambda: many(xr, logits)
    v[f"fold_x{args.steps}_dispatched"] = lambda: dispatched(xr, logits)
    v[f"score_x{args.steps}_only"] = lambda: scores_only(xr, logits)
    v[f"image_where_x{args.steps}_only"] = lambda: where_only(xr, logits)
    if args.patch_linf_norm:
        v.update(_patched_variants(args, attack, canon, params, x, y, key, xr, logits))
    if args.only:
        v = {k: f for k, f in v.items()
             if k.startswith("floor_") or any(s in k for s in args.only)}
    return v


def _section(n: int, res: dict[str, Any]) -> dict[str, Any]:
    """One N's floor and each variant's times and ratios to it."""
    loads = res.pop("_load_avg_per_round")
    floor = min(res["floor_b_unrolled"]["median_s"], res["floor_a_chain"]["median_s"])
    floor_min = min(res["floor_b_unrolled"]["min_s"], res["floor_a_chain"]["min_s"])
    return {
        "n": n,
        "floor_s": floor,
        "floor_min_s": floor_min,
        "load_avg_per_round": loads,
        "variants": {
            k: {"median_s": r["median_s"], "min_s": r["min_s"], "compile_s": r["compile_s"],
                "ratio_to_floor": r["median_s"] / floor,
                "ratio_min_to_floor_min": r["min_s"] / floor_min, "times_s": r["times_s"]}
            for k, r in res.items()
        },
    }


def _print_section(sec: dict[str, Any], flags: Any) -> None:
    print(f"\n== N={sec['n']}, floor {sec['floor_s'] * 1e3:.1f} ms (XLA_FLAGS={flags}) ==")
    for k, r in sec["variants"].items():
        print(f"{k:26s} median {r['median_s'] * 1e3:9.1f} ms  "
              f"ratio {r['ratio_to_floor']:5.2f}  "
              f"min {r['min_s'] * 1e3:9.1f} ms  ratio(min) {r['ratio_min_to_floor_min']:5.2f}  "
              f"compile {r['compile_s']:6.1f} s")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    module, params = small_cnn()
    apply_fn = module.apply
    probe_x = jnp.zeros((2, 28, 28, 1), jnp.float32)
    shipped_ok = grad_is_canonical_in_loops(apply_fn, params, probe_x, jnp.zeros((2,), jnp.int32))
    canon = apply_fn if shipped_ok else small_cnn_apply_canonical_grad
    attack = pgd(norm=NORM, loss="ce", steps=args.steps, step_size=STEP_SIZE)
    results: dict[str, Any] = {
        "machine": machine_facts(),
        "model_facts": model_description(module, params),
        "steps": args.steps,
        "patch_linf_norm": args.patch_linf_norm,
        "scan_model": ("jaxbundle.models.SmallCNN" if shipped_ok
                       else "canonical twin (pgd_speed.py)"),
        "sections": {},
    }
    print(json.dumps(results["machine"]), flush=True)
    for n in args.n:
        x, y = mnist_batch(n)
        key = jax.random.PRNGKey(1)
        v = _variants(args, attack, apply_fn, canon, params, x, y, key)
        sec = _section(n, run_interleaved(v, args.repeats, f"overhead N={n}"))
        results["sections"][str(n)] = sec
        _print_section(sec, results['machine']['xla_flags'])
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
