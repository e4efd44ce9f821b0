"""Candidate bundles against AutoAttack, setting by setting, under the held-out protocol.

``PROTOCOL.md`` beside this file fixes the two sets (tuning, held-out), the radii, which settings
are reported and the targets. For every (model, norm, eps) of a set this script

1. runs APGD-CE (20 steps, jaxbundle) and skips the setting where it leaves under 2 % robust;
2. runs AutoAttack standard (original parameters, torchattacks' parts: APGD-CE, APGD-T, FAB-T,
   Square, each on what the earlier ones left, as ``MultiAttack`` does) on a torch copy of the
   same weights, re-judging every returned image with the JAX model in float32 (box, ball,
   misclassified), and records which of its attacks fooled each example; cached per setting
   under ``--aa-cache``;
3. runs each candidate bundle through ``jaxbundle.evaluate`` exactly as the CLI runs it (goal
   misclassify, batch = n, seed ``--seed``, 0 by default), model passes counted at the model
   boundary, timed cold (first call in the process for that setting) and warm (median of
   ``--rounds``);
4. appends one JSON line per (setting, candidate) to ``--out``, with its per-example verdicts
   (``robust``: a string of 0/1), so that runs under other seeds can be compared.

Candidates are named bundles (``default``) or variants from ``--variants FILE.jsonl``, one JSON
object a line: ``{"name": "v1", "bundle": [["apgd-ce", {"steps": 20}], ...], "focus":
{"square-aa": 0.08}, "probe": {"square-aa": 250}, "segments": 6, "plan": {...other Plan
fields...}}``.

Needs torch and torchattacks (never jaxbundle's dependencies); see benchmarks/README.md::

    python benchmarks/heldout/run.py --set tuning --bundles default --aa-cache /tmp/aa \\
        --out /tmp/tuning.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from typing import Callable, NamedTuple

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from agreement import cached_path  # noqa: E402
from autoattack_compare import Counted, autoattack_parts, counting, torch_network  # noqa: E402

import jaxbundle  # noqa: E402
from jaxbundle import AttackSpec, bundles, data, models  # noqa: E402

GREY_LINF = (13 / 255, 26 / 255, 38 / 255, 51 / 255, 77 / 255)
GREY_L2 = (0.5, 1.0, 1.5, 2.0, 3.0)
COLOUR_LINF = (2 / 255, 4 / 255, 8 / 255, 12 / 255, 16 / 255)
COLOUR_L2 = (0.25, 0.5, 1.0, 1.5)


class Setting(NamedTuple):
    """One model of a set: where its images come from and the radii it is evaluated at."""

    model: str
    source: str  # "demo" (jaxbundle.models.MODELS) or "zoo" (benchmarks/heldout/zoo.py)
    data: str  # the zoo's data name ("grey28" for the demo models)
    start: int  # first test image
    eps: dict[str, tuple[float, ...]]  # norm -> radii


def _grey(model, source, data_name="grey28", start=1000):
    return Setting(model, source, data_name, start, {"linf": GREY_LINF, "l2": GREY_L2})


def _colour(model, data_name):
    return Setting(model, "zoo", data_name, 1000, {"linf": COLOUR_LINF, "l2": COLOUR_L2})


SETS: dict[str, tuple[Setting, ...]] = {
    "tuning": (
        Setting("adversarial", "demo", "grey28", 0,
                {"linf": (76 / 255, 80 / 255, 82 / 255), "l2": (1.5, 2.0)}),
        Setting("adversarial-linen", "demo", "grey28", 0,
                {"linf": (64 / 255, 70 / 255, 76 / 255)}),
        Setting("standard", "demo", "grey28", 0,
                {"linf": (13 / 255, 26 / 255), "l2": (0.5, 1.0)}),
        Setting("resnet-tune", "zoo", "colour32-off", 0,
                {"linf": (2 / 255, 4 / 255), "l2": (0.25, 0.5)}),
        Setting("resnet-tune-c", "zoo", "colour32", 0,
                {"linf": (2 / 255, 4 / 255), "l2": (0.25, 0.5)}),
    ),
    "heldout": (
        _grey("mlp-std", "zoo"), _grey("mlp-pgd", "zoo"),
        _grey("cnn-pgd-0.1", "zoo", "grey32-off"), _grey("cnn-pgd-0.3", "zoo"),
        _grey("cnn-trades", "zoo"), _grey("cnn-l2", "zoo"),
        _colour("resnet-std", "colour32"), _colour("resnet-pgd", "colour32"),
        _colour("cnn-colour-l2", "colour32-off"),
    ),
}
AA_ATTACKS = ("apgd-ce", "apgd-t", "fab-t", "square")


# ---------------------------------------------------------------------------- models and data


def load(setting: Setting, n: int):
    """``(apply_fn, params, x, y, torch_net)`` of a setting: the model, its ``n`` images and
    the torch copy of its weights (logits checked against the JAX model's)."""
    if setting.source == "demo":
        apply_fn, params = models.load_or_train(models.MODELS[setting.model])
        sample = data.load_mnist_sample("test", n=setting.start + n)
        x = np.asarray(sample.x, np.float32)[setting.start:]
        y = np.asarray(sample.y)[setting.start:]
        net = torch_network(params)
    else:
        import torch_copy
        import zoo

        apply_fn, params = zoo.load(setting.model)
        x, y = zoo.dataset(setting.data, "test", start=setting.start, n=n)
        net = torch_copy.torch_network(setting.model, params)
    import torch

    with torch.no_grad():
        gap = float(np.abs(net(torch.tensor(x.transpose(0, 3, 1, 2))).numpy()
                           - np.asarray(apply_fn(params, x))).max())
    if gap > 1e-3:
        raise SystemExit(f"the torch copy of {setting.model} differs: max logit gap {gap}")
    return apply_fn, params, x, y, net


# ---------------------------------------------------------------------------- AutoAttack


def _valid(x, x_adv, eps, norm) -> np.ndarray:
    """In the box and the ball (float32 tolerances)."""
    flat = (x_adv - x).reshape(len(x), -1)
    size = np.abs(flat).max(1) if norm == "linf" else np.sqrt((flat.astype(np.float64) ** 2)
                                                               .sum(1))
    tol = 1e-6 if norm == "linf" else 1e-5 * eps + 1e-6
    inside = (x_adv.reshape(len(x), -1).min(1) >= 0) & (x_adv.reshape(len(x), -1).max(1) <= 1)
    return (size <= eps + tol) & inside


def run_autoattack(net, apply_fn, params, x, y, eps, norm) -> dict:
    """AutoAttack as ``MultiAttack`` runs it (each attack on the examples the earlier ones
    left), every image re-judged here. Per example: robust, and the attack that fooled it."""
    import torch

    counted = Counted(net)
    predict = jax.jit(lambda p, a: jax.numpy.argmax(apply_fn(p, a), -1))
    clean_ok = np.asarray(predict(params, x)) == y
    by = np.full(len(y), -1)  # -1: robust or clean-wrong; k: fooled by attack k
    left = clean_ok.copy()
    start = time.perf_counter()
    parts = autoattack_parts(counted, eps, {"linf": "Linf", "l2": "L2"}[norm])
    for k, attack in enumerate(parts):
        rows = np.flatnonzero(left)
        if rows.size == 0:
            break
        xt = torch.tensor(np.ascontiguousarray(x[rows].transpose(0, 3, 1, 2)))
        adv = attack(xt, torch.tensor(y[rows].astype(np.int64))).detach().numpy()
        adv = np.ascontiguousarray(adv.transpose(0, 2, 3, 1))
        fooled = (np.asarray(predict(params, adv)) != y[rows]) & _valid(x[rows], adv, eps, norm)
        by[rows[fooled]] = k
        left[rows[fooled]] = False
    seconds = time.perf_counter() - start
    return {"robust": left.astype(int).tolist(), "fooled_by": by.tolist(),
            "robust_accuracy": 100 * float(left.mean()), "seconds": seconds,
            "passes_per_example": (counted.forward_rows + counted.backward_rows) / len(y)}


def weights_digest(params) -> str:
    """A fingerprint of a model's weights (sha256 of every leaf's bytes, 16 hex digits): the
    zoo's training repeats bit for bit on one machine, not across machines (resnet-pgd trained
    here on 2026-12-06 differs from the one AutoAttack's cached runs of 2026-12-05 attacked),
    so a cached AutoAttack run is tied to the weights it attacked."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return digest.hexdigest()[:16]


def cached_autoattack(cache: str | None, key: str, compute: Callable[[], dict],
                      weights: str, clean_wrong: np.ndarray) -> dict:
    """AutoAttack's run of setting ``key`` on the weights ``weights`` (:func:`weights_digest`):
    from ``cache/{key}_w{weights}.json``, or from the older ``cache/{key}.json`` (written
    without a fingerprint) when its clean mistakes are the model's ``clean_wrong`` (a run on
    other weights is refused in one line), or computed and written under the first name."""
    found = cached_path(cache, key, weights)
    if found:
        with open(found) as f:
            entry = json.load(f)
        wrong = ((~np.asarray(entry["robust"], bool)) & (np.asarray(entry["fooled_by"]) < 0))
        if entry.get("weights", weights) != weights or not np.array_equal(wrong, clean_wrong):
            raise SystemExit(f"{found}: AutoAttack ran on other weights than the model's "
                             f"now ({weights}); its clean mistakes differ. Delete it, or "
                             "use another --aa-cache")
        return {**entry, "from_cache": found}
    entry = {**compute(), "weights": weights}
    if cache:
        os.makedirs(cache, exist_ok=True)
        with open(os.path.join(cache, f"{key}_w{weights}.json"), "w") as f:
            json.dump(entry, f)
    return entry


# ---------------------------------------------------------------------------- candidates


def register(variant: dict) -> str:
    """Registers a variant as a named bundle; returns its name."""
    name = f"variant-{variant['name']}"
    schedule = (bundles.Cascade(focus=variant.get("focus", {}),
                                segments=variant.get("segments", 1),
                                probe=variant.get("probe", {}))
                if variant.get("mode", "cascade") == "cascade" else bundles.Full())
    bundles.BUNDLES[name] = bundles.Bundle(
        tuple((AttackSpec(a, **o), None) for a, o in variant["bundle"]), schedule)
    return name


def _plan(name, norm, eps, n, extra, seed=0, judging="auto"):
    return bundles.plan(name, norm, eps, goals=("misclassify",), batch_size=n, seed=seed,
                        judging=judging, **extra)


def _robust(result) -> np.ndarray:
    pe = result.per_example
    return (pe["clean_prediction"] == pe["label"]) & ~pe["success"].astype(bool)


def run_candidate(name, extra, apply_fn, params, x, y, eps, norm, rounds, aa, seed=0,
                  judging="auto", count=True) -> dict:
    """One candidate: its first call in the process (cold, timed), a run with the model passes
    counted at the model boundary (``count``; without it the row's passes are None: a
    reference run whose verdicts alone are wanted), then ``rounds`` warm timed runs; compared
    with AutoAttack's per-example verdicts ``aa`` (judged in float32). ``judging``: the plan's
    (``"auto"``, as the CLI runs it: on the 8-bit grid where the clean image is on it;
    ``"float"``, as AutoAttack's images are judged)."""
    plan = _plan(name, norm, eps, len(y), extra, seed, judging)

    def evaluate(fn):
        return jaxbundle.evaluate(fn, params, (x, y), plan, mesh=None, keep_images=False)

    start = time.perf_counter()
    result = evaluate(apply_fn)
    cold = time.perf_counter() - start
    robust = _robust(result)
    counts = {"forward": 0, "backward": 0}
    same = not count or np.array_equal(_robust(evaluate(counting(apply_fn, counts))), robust)
    jax.effects_barrier()
    warm = []
    for _ in range(rounds):
        start = time.perf_counter()
        again = _robust(evaluate(apply_fn))
        warm.append(time.perf_counter() - start)
        same &= np.array_equal(again, robust)
    if not same:
        raise SystemExit(f"{name}: the timed and the counted runs disagree")
    robust_aa = np.asarray(aa["robust"], bool)
    missed = robust & ~robust_aa
    passes = (counts["forward"] + counts["backward"]) / len(y) if count else None
    stages = (result.metrics.get("schedule") or {}).get("stages") or []
    return {
        "robust_accuracy": 100 * float(robust.mean()),
        "missed": int(missed.sum()), "extra": int((~robust & robust_aa).sum()),
        "missed_by_aa_attack": {AA_ATTACKS[k]: int(np.sum(missed & (np.asarray(
            aa["fooled_by"]) == k))) for k in range(4)},
        "passes_per_example": passes,
        "passes_ratio": None if passes is None else passes / aa["passes_per_example"],
        "seconds_cold": cold, "seconds_warm": statistics.median(warm) if warm else None,
        "warm_ratio": statistics.median(warm) / aa["seconds"] if warm else None,
        "stages": [{k: s.get(k) for k in ("attack", "survivors", "examples", "robust_accuracy")}
                   for s in stages],
        "seed": seed, "judging": judging,
        "robust": "".join("1" if r else "0" for r in robust),
        "fooled_by": _fooled_by(result),
        "black_box_beats_white_box": (result.metrics["checks"].get(
            "black_box_beats_white_box") or {}).get("examples"),
    }


def _fooled_by(result) -> str:
    """Per example, the first of the candidate's attacks that fooled it, as the AutoAttack
    component it stands for (``AA_ATTACKS``' index: ``0`` APGD-CE ... ``3`` Square; ``-``: not
    fooled or wrong when clean; ``?``: an attack that is none of them)."""
    pe = result.per_example
    success = np.asarray(pe["attack_success"], bool) & (
        pe["clean_prediction"] == pe["label"])[:, None]
    first = np.where(success.any(1), success.argmax(1), -1)
    names = result.attack_names
    return "".join("-" if k < 0 else _component(names[k]) for k in first)


def _component(attack: str) -> str:
    base = attack.split("-")[0] + ("-t" if attack.startswith(("apgd-t", "fab-t")) else "")
    base = {"apgd": "apgd-ce"}.get(base, base)
    return str(AA_ATTACKS.index(base)) if base in AA_ATTACKS else "?"


# ---------------------------------------------------------------------------- the run


def _screen(apply_fn, params, x, y, eps, norm) -> float:
    plan = jaxbundle.Plan.of(eps=eps, norm=norm, attacks=(AttackSpec("apgd-ce", steps=20),),
                          goals=("misclassify",), batch_size=len(y))
    return 100 * float(_robust(jaxbundle.evaluate(apply_fn, params, (x, y), plan, mesh=None,
                                                  keep_images=False)).mean())


def _done(paths: list[str]) -> set[tuple[str, str, str, str, str]]:
    """(model, norm, eps, candidate, judging) of the rows in ``paths`` (``--skip-done``)."""
    done = set()
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    done.add((r["model"], r["norm"], f"{r['eps']:.6f}", r["candidate"],
                              r.get("judging", "auto"), r.get("seed", 0)))
    return done


def run(args, candidates: list[tuple[str, dict]], log: Callable[[str], None]) -> None:
    settings = {s.model: s for s in SETS[args.set]}
    done = _done(getattr(args, "skip_done", None) or [])
    judging = getattr(args, "judging", "auto")
    for name in (args.models.split(",") if args.models else settings):
        setting = settings[name]
        jax.clear_caches()  # a long run compiles many programs: keep the process's maps few
        apply_fn, params, x, y, net = load(setting, args.n)
        weights = weights_digest(params)  # what a cached AutoAttack run must have attacked
        clean_wrong = np.asarray(jax.jit(apply_fn)(params, x)).argmax(-1) != y
        for norm in args.norms.split(","):
            for eps in setting.eps.get(norm, ()):
                if args.eps and not any(abs(eps - float(e)) < 1e-4 for e in args.eps.split(",")):
                    continue
                label = f"{setting.model} {norm} {eps:.4f}"
                todo = [(c, e) for c, e in candidates
                        if (setting.model, norm, f"{eps:.6f}", c, judging, args.seed) not in done]
                if not todo:
                    log(f"{label}: done already")
                    continue
                key = f"{args.set}_{setting.model}_{norm}_{eps:.6f}_n{args.n}"
                if getattr(args, "cached_only", False) and not cached_path(args.aa_cache, key,
                                                                       weights):
                    log(f"{label}: no AutoAttack run in --aa-cache: skipped (--cached-only)")
                    continue
                screen = _screen(apply_fn, params, x, y, eps, norm)
                if screen < 2:
                    log(f"{label}: APGD-CE-20 leaves {screen:.1f} % robust: skipped")
                    continue
                aa = cached_autoattack(args.aa_cache, key, lambda: run_autoattack(
                    net, apply_fn, params, x, y, eps, norm), weights, clean_wrong)
                reported = 2 <= aa["robust_accuracy"] <= 95
                note = "" if reported else " [not reported]"
                log(f"{label}: AutoAttack {aa['robust_accuracy']:.1f} % ({aa['seconds']:.0f} s,"
                    f" {aa['passes_per_example']:.0f} passes/ex){note}")
                if not reported and getattr(args, "reported_only", False):
                    continue
                for name, extra in todo:
                    row = run_candidate(name, extra, apply_fn, params, x, y, eps, norm,
                                        args.rounds, aa, args.seed, judging,
                                        count=not getattr(args, "no_count", False))
                    log(f"  {name}: {row['robust_accuracy']:.1f} %, missed {row['missed']} "
                        f"{row['missed_by_aa_attack']}, extra {row['extra']}, passes "
                        f"{_ratio(row['passes_ratio'])}, warm {row['warm_ratio']}, cold "
                        f"{row['seconds_cold']:.1f} s")
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps({
                                "set": args.set, "model": setting.model, "data": setting.data,
                                "norm": norm, "eps": eps, "n": args.n, "candidate": name,
                                "reported": reported, "apgd_ce_20": screen,
                                "autoattack": {k: v for k, v in aa.items()
                                               if k not in ("robust", "fooled_by")},
                                **row}) + "\n")


def markdown(rows: list[dict]) -> str:
    """The rows of ``--out`` files as the table of benchmarks/README.md, one line per setting
    and candidate (settings outside AutoAttack's [2 %, 95 %] marked as not reported)."""
    lines = ["| model (data) | norm, eps | AutoAttack % (passes/ex, s) | candidate | robust % | "
             "missed (by AA attack) / extra | passes ratio | warm ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        aa, by = r["autoattack"], {k: v for k, v in r["missed_by_aa_attack"].items() if v}
        eps = f"{round(r['eps'] * 255)}/255" if r["norm"] == "linf" else f"{r['eps']:g}"
        warm = "" if r["seconds_warm"] is None else f"{r['warm_ratio']:.3f}"
        lines.append(
            f"| {r['model']} ({r['data']}) | {r['norm']} {eps}"
            f"{'' if r['reported'] else ' (not reported)'} | {aa['robust_accuracy']:.1f} "
            f"({aa['passes_per_example']:.0f}, {aa['seconds']:.0f}) | {r['candidate']} | "
            f"{r['robust_accuracy']:.1f} | {r['missed']} {by or ''} / {r['extra']} | "
            f"{_ratio(r['passes_ratio'])} | {warm} |")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=tuple(SETS), default="heldout")
    parser.add_argument("--models", default=None,
                        help="comma-separated, run in this order; default: the set's")
    parser.add_argument("--norms", default="linf,l2")
    parser.add_argument("--eps", default=None, help="comma-separated: only these of the grid")
    parser.add_argument("--bundles", default="default", help="named bundles, comma-separated")
    parser.add_argument("--variants", default=None, metavar="JSONL")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="the candidates' plan seed")
    parser.add_argument("--judging", choices=("auto", "float"), default="auto",
                        help="the candidates' judging: auto (the CLI's: on the 8-bit grid where "
                             "the clean image is on it) or float (as AutoAttack's images are)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--aa-cache", default=None, metavar="DIR")
    parser.add_argument("--out", default=None, metavar="JSONL")
    parser.add_argument("--no-count", action="store_true",
                        help="skip the counted run (passes None): reference runs' verdicts")
    parser.add_argument("--reported-only", action="store_true",
                        help="run the candidates only where AutoAttack's figure is reported")
    parser.add_argument("--cached-only", action="store_true",
                        help="skip the settings --aa-cache holds no AutoAttack run of")
    parser.add_argument("--skip-done", nargs="*", default=[], metavar="JSONL",
                        help="skip the (setting, candidate) pairs these result files hold")
    parser.add_argument("--table", default=None, metavar="JSONL",
                        help="print the markdown table of an --out file and exit")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(markdown([json.loads(line) for line in f if line.strip()]))
        return
    import torch

    torch.set_num_threads(args.threads)
    candidates = [(b, {}) for b in args.bundles.split(",") if b]
    if args.variants:
        with open(args.variants) as f:
            for line in f:
                if line.strip():
                    v = json.loads(line)
                    candidates.append((register(v), v.get("plan", {})))
    run(args, candidates, lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
