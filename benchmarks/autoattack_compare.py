"""jaxbundle against AutoAttack, side by side in one run, on the same weights and images.

AutoAttack (Croce & Hein 2020, standard version) is built from torchattacks' parts with its
original parameters, as ``fra31/auto-attack`` sets them: APGD-CE (100 steps), APGD-T (9 target
classes x 100 steps), FAB-T (9 x 100), Square (5,000 queries, p_init 0.8, schedule not
rescaled), each on the examples the earlier ones left (torchattacks' ``MultiAttack``). The
torch network is a layer-by-layer copy of the flax one (weights copied, logits checked equal).

Every adversarial image AutoAttack returns is re-judged by jaxbundle's model in float32: in
the box, in the eps ball, misclassified. jaxbundle's bundles run through ``jaxbundle.evaluate``
(each bundle's plan, ``jaxbundle.bundles.plan``) with the library's own judging. Model passes
are counted exactly at the model boundary on both sides (rows through the forward pass, and
rows whose input gradient was taken) in a separate, untimed run; wall-clock is the median of
``--rounds`` timed rounds, cold (JAX's compiled programs cleared first, so tracing and
compilation are included), cold with the persistent compilation cache filled (what a new CLI
process pays after an earlier run with the same shapes: tracing, no compilation) and warm.
``--aa-cache DIR`` stores AutoAttack's result per setting (with its per-example verdicts, for
``default_variants.py``) and reuses it.

Needs torch and torchattacks, which are never dependencies of jaxbundle; a benchmark-only
environment (see benchmarks/README.md)::

    python -m venv /tmp/bench && . /tmp/bench/bin/activate
    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    pip install --no-deps torchattacks==3.5.1 && pip install scipy tqdm requests -e .
    python benchmarks/autoattack_compare.py --out benchmarks/results/autoattack_compare.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxbundle
from jaxbundle import bundles, data, job, models
from jaxbundle.canonical import _same_padding

# Per model: the eps values (on the 8-bit grid, so both sides judge the same radius) where
# robust accuracy lies between 5 % and 90 % (83/255 is the adversarial model's edge: 3.9 % to
# 5.1 % under AutoAttack, depending on the weights the machine's training produced).
EPS = {
    "adversarial": (76 / 255, 80 / 255, 82 / 255, 83 / 255),
    "adversarial-linen": (64 / 255, 70 / 255, 76 / 255),
}


# ---------------------------------------------------------------------------- torch side


def torch_network(params: Any):
    """The flax demo CNN (``SmallCNN`` or ``LinenCNN``: conv1, conv2, hidden, logits; 'SAME'
    stride-2 convolutions, ReLU) as a torch module with the same weights."""
    import torch
    import torch.nn.functional as F

    p = jax.tree.map(np.asarray, params["params"])

    def tensor(a):
        return torch.tensor(np.ascontiguousarray(a), dtype=torch.float32)

    convs = [(tensor(p[n]["kernel"].transpose(3, 2, 0, 1)), tensor(p[n]["bias"]))
             for n in ("conv1", "conv2")]
    dense = [(tensor(p[n]["kernel"].T), tensor(p[n]["bias"])) for n in ("hidden", "logits")]

    class Net(torch.nn.Module):
        def forward(self, x):  # NCHW in [0, 1]
            for w, b in convs:
                pads = [_same_padding(x.shape[d], w.shape[d], 2)[1:] for d in (3, 2)]
                x = F.relu(F.conv2d(F.pad(x, (*pads[0], *pads[1])), w, b, stride=2))
            x = x.permute(0, 2, 3, 1).reshape(x.shape[0], -1)  # flatten as NHWC, like flax
            x = F.relu(F.linear(x, *dense[0]))
            return F.linear(x, *dense[1])

    return Net().eval()


class Counted:
    """Wraps a torch module; counts rows through forward and rows whose input gradient is
    taken (a hook on the input, so a graph backpropagated twice counts twice)."""

    def __new__(cls, net):
        import torch

        class _Counted(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net = net
                self.forward_rows = 0
                self.backward_rows = 0

            def _backward(self, grad):
                self.backward_rows += grad.shape[0]

            def forward(self, x):
                self.forward_rows += x.shape[0]
                if x.requires_grad:
                    x.register_hook(self._backward)
                return self.net(x)

        return _Counted().eval()


def autoattack_parts(model, eps: float, norm: str = "Linf", seed: int = 0) -> tuple:
    """AutoAttack standard's four attacks with their original parameters, from torchattacks'
    parts, in AutoAttack's order (``norm``: torchattacks' ``"Linf"`` or ``"L2"``)."""
    import torchattacks as ta

    return (
        ta.APGD(model, norm=norm, eps=eps, steps=100, n_restarts=1, loss="ce", seed=seed),
        ta.APGDT(model, norm=norm, eps=eps, steps=100, n_restarts=1, n_classes=10, seed=seed),
        ta.FAB(model, norm=norm, eps=eps, steps=100, n_restarts=1, multi_targeted=True,
               n_classes=10, seed=seed),
        ta.Square(model, norm=norm, eps=eps, n_queries=5000, n_restarts=1, p_init=0.8,
                  resc_schedule=False, seed=seed),
    )


def autoattack(model, eps: float, norm: str = "Linf", seed: int = 0):
    """AutoAttack standard: its four attacks, each on what the earlier ones left."""
    import torchattacks as ta

    return ta.MultiAttack(list(autoattack_parts(model, eps, norm, seed)))


def run_autoattack(net, x, y, eps):
    import torch

    xt = torch.tensor(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
    yt = torch.tensor(y.astype(np.int64))
    counted = Counted(net)
    attack = autoattack(counted, eps)
    start = time.perf_counter()
    adv = attack(xt, yt)
    seconds = time.perf_counter() - start
    x_adv = adv.detach().numpy().transpose(0, 2, 3, 1)
    return x_adv, seconds, counted.forward_rows, counted.backward_rows


def judge(apply_fn, params, x, y, x_adv, eps) -> np.ndarray:
    """Per example: is it still correctly classified (clean correct and no valid adversarial
    image)? Valid: in [0, 1] and within eps in Linf (float32 tolerance 1e-6)."""
    clean_ok = np.asarray(jnp.argmax(apply_fn(params, x), -1)) == y
    adv_wrong = np.asarray(jnp.argmax(apply_fn(params, x_adv), -1)) != y
    flat = (x_adv - x).reshape(len(x), -1)
    valid = (np.abs(flat).max(1) <= eps + 1e-6) & (x_adv.min((1, 2, 3)) >= 0) & (
        x_adv.max((1, 2, 3)) <= 1)
    return clean_ok & ~(valid & adv_wrong)


# ---------------------------------------------------------------------------- jaxbundle side


def counting(apply_fn: Callable, counts: dict[str, int]) -> Callable:
    """``apply_fn`` with a probe on its input: rows through the forward pass and rows whose
    input gradient is taken, counted on the host as the compiled program runs."""

    def add(kind):
        def callback(rows):
            counts[kind] += int(np.size(rows))
        return callback

    def rows(a):
        # Computed from the data, so that under vmap (restarts, targets) the callback sees
        # every batched copy; a constant of the same shape would be seen once.
        return (a.reshape(a.shape[0], -1)[:, 0] * 0).astype(jnp.int8)

    @jax.custom_vjp
    def probe(x):
        jax.debug.callback(add("forward"), rows(x))
        return x

    def probe_fwd(x):
        return probe(x), None

    def probe_bwd(_, g):
        jax.debug.callback(add("backward"), rows(g))
        return (g,)

    probe.defvjp(probe_fwd, probe_bwd)
    return lambda params, x: apply_fn(params, probe(x))


def run_jaxbundle(apply_fn, params, x, y, eps, name, seed=0):
    """A named bundle's plan, under its own schedule (focus, segments), as the CLI runs it."""
    plan = bundles.plan(name, "linf", eps, goals=("misclassify",), batch_size=len(x), seed=seed)
    result = jaxbundle.evaluate(apply_fn, params, (x, y), plan, mesh=None, keep_images=False)
    robust = result.per_example["clean_prediction"] == result.per_example["label"]
    return robust & ~result.per_example["success"].astype(bool), result


def timed(fn) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


# ---------------------------------------------------------------------------- the comparison


def _aa_path(aa_cache: str, model_name: str, eps: float, n: int) -> str:
    return os.path.join(aa_cache, f"autoattack_{model_name}_{round(eps * 255)}_n{n}.json")


def _cached_autoattack(aa_cache, model_name, eps, n):
    """AutoAttack's stored entry and per-example robust mask, if ``aa_cache`` holds them."""
    path = aa_cache and _aa_path(aa_cache, model_name, eps, n)
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        stored = json.load(f)
    robust = np.asarray(stored.pop("robust"), bool)
    return {**stored, "from_cache": path}, robust


def _store_autoattack(aa_cache, model_name, eps, n, entry, robust) -> None:
    os.makedirs(aa_cache, exist_ok=True)
    with open(_aa_path(aa_cache, model_name, eps, n), "w") as f:
        json.dump({**entry, "robust": robust.astype(int).tolist()}, f)


def _entry_key(name: str) -> str:
    """A jaxbundle bundle's key in a results row: ``autoattack`` is torchattacks' AutoAttack,
    so jaxbundle's own ``autoattack`` bundle is stored as ``jaxbundle-autoattack``."""
    return "jaxbundle-autoattack" if name == "autoattack" else name


def _torch_copy(model_name, apply_fn, params, x):
    """The torch copy of the model, its logits checked against the flax ones."""
    import torch

    net = torch_network(params)
    with torch.no_grad():
        torch_logits = net(torch.tensor(x.transpose(0, 3, 1, 2))).numpy()
    gap = float(np.abs(torch_logits - np.asarray(apply_fn(params, x))).max())
    if gap > 1e-3:
        raise SystemExit(f"the torch copy of {model_name} differs: max logit gap {gap}")
    return net, gap


def _autoattack_entry(net, apply_fn, params, x, y, eps, rounds, label, log):
    """AutoAttack over ``rounds`` timed rounds: its entry and per-example robust mask (passes
    counted during the first round; the wrapper costs nothing)."""
    times, robust_aa, passes = [], None, None
    for r in range(rounds):
        x_adv, seconds, fwd, bwd = run_autoattack(net, x, y, eps)
        times.append(seconds)
        if robust_aa is None:
            robust_aa = judge(apply_fn, params, x, y, x_adv, eps)
            passes = {"forward": fwd, "backward": bwd}
        log(f"{label} autoattack round {r}: {seconds:.1f} s, "
            f"robust {100 * robust_aa.mean():.1f} %")
    entry = {
        "robust_accuracy": 100 * float(robust_aa.mean()),
        "seconds": statistics.median(times), "seconds_all": times,
        "passes": passes,
        "passes_per_example": (passes["forward"] + passes["backward"]) / len(y),
    }
    return entry, robust_aa


def _timed_rounds(apply_fn, params, x, y, eps, name, rounds, robust):
    """Cold, warm and cold-with-the-compilation-cache seconds of ``rounds`` runs of the
    bundle ``name`` (each must find the counted run's ``robust``)."""
    cold, warm, cold_cached = [], [], []
    run = lambda: run_jaxbundle(apply_fn, params, x, y, eps, name)  # noqa: E731
    for _ in range(rounds):
        jax.clear_caches()
        (robust_r, _), seconds = timed(run)
        cold.append(seconds)
        (_, _), seconds = timed(run)
        warm.append(seconds)
        if not np.array_equal(robust_r, robust):
            raise SystemExit(f"{name}: the counted run and a timed run disagree")
        # A new process with the CLI's persistent compilation cache already filled (a second
        # model of the same architecture, a second eps): traced, not compiled.
        with tempfile.TemporaryDirectory() as tmp, job.compilation_cache(tmp):
            jax.clear_caches()
            run()
            jax.clear_caches()
            cold_cached.append(timed(run)[1])
    return cold, warm, cold_cached


def _bundle_entry(apply_fn, params, x, y, eps, name, rounds, aa, robust_aa) -> dict:
    """The bundle ``name``: counted once (model passes), then timed over ``rounds`` rounds
    (none: the counted run's seconds), compared with AutoAttack's entry ``aa``."""
    counts = {"forward": 0, "backward": 0}
    counted_apply = counting(apply_fn, counts)
    (robust, result), counted_seconds = timed(
        lambda: run_jaxbundle(counted_apply, params, x, y, eps, name))
    jax.effects_barrier()
    cold, warm, cold_cached = _timed_rounds(apply_fn, params, x, y, eps, name, rounds, robust)
    if not cold:  # run once, with the counting probes (a little slower)
        cold = warm = cold_cached = [counted_seconds]
    entry = {
        "robust_accuracy": 100 * float(robust.mean()),
        "seconds_cold": statistics.median(cold), "seconds_warm": statistics.median(warm),
        "seconds_cold_cached": statistics.median(cold_cached),
        "seconds_cold_all": cold, "seconds_warm_all": warm,
        "seconds_cold_cached_all": cold_cached,
        "timed_rounds": rounds,
        "passes": dict(counts),
        "passes_per_example": (counts["forward"] + counts["backward"]) / len(y),
        "robust_here_fooled_by_autoattack": int(np.sum(robust & ~robust_aa)),
        "fooled_here_robust_under_autoattack": int(np.sum(~robust & robust_aa)),
    }
    stages = (result.metrics.get("schedule") or {}).get("stages")
    if stages:
        entry["stages"] = [{k: s[k] for k in ("attack", "examples", "robust_accuracy")}
                           for s in stages]
    entry["cost_ratio"] = {
        "passes": entry["passes_per_example"] / aa["passes_per_example"],
        "seconds_cold": entry["seconds_cold"] / aa["seconds"],
        "seconds_cold_cached": entry["seconds_cold_cached"] / aa["seconds"],
        "seconds_warm": entry["seconds_warm"] / aa["seconds"],
    }
    return entry


def compare(model_name, eps_values, bundles_, once, n, rounds, log, aa_cache=None) -> dict:
    """AutoAttack (or its cached result) and each bundle of ``bundles_`` (timed over
    ``rounds``) and ``once`` (run once) at every eps, on the first ``n`` test digits."""
    apply_fn, params = models.load_or_train(models.MODELS[model_name])
    sample = data.load_mnist_sample("test", n=n)
    x, y = np.asarray(sample.x, np.float32), np.asarray(sample.y)
    net, gap = _torch_copy(model_name, apply_fn, params, x)
    out = {"logit_gap": gap, "eps": {}}
    for eps in eps_values:
        label = f"{model_name} eps {eps:.4f}"
        row: dict[str, Any] = {}
        cached = _cached_autoattack(aa_cache, model_name, eps, n)
        if cached is None:
            row["autoattack"], robust_aa = _autoattack_entry(net, apply_fn, params, x, y, eps,
                                                             rounds, label, log)
            if aa_cache:
                _store_autoattack(aa_cache, model_name, eps, n, row["autoattack"], robust_aa)
        else:
            row["autoattack"], robust_aa = cached
            log(f"{label} autoattack from {aa_cache}: "
                f"robust {row['autoattack']['robust_accuracy']:.1f} %")
        aa = row["autoattack"]
        for name in bundles_ + once:
            entry = _bundle_entry(apply_fn, params, x, y, eps, name,
                                  rounds if name in bundles_ else 0, aa, robust_aa)
            row[_entry_key(name)] = entry
            log(f"{label} {name}: robust {entry['robust_accuracy']:.1f} % "
                f"(AA {aa['robust_accuracy']:.1f} %), passes/ex {entry['passes_per_example']:.0f}"
                f" (AA {aa['passes_per_example']:.0f}), cold {entry['seconds_cold']:.1f} s, "
                f"cold with the compilation cache {entry['seconds_cold_cached']:.1f} s, warm "
                f"{entry['seconds_warm']:.1f} s (AA {aa['seconds']:.1f} s), disagree "
                f"{entry['robust_here_fooled_by_autoattack']}/"
                f"{entry['fooled_here_robust_under_autoattack']}")
        out["eps"][f"{eps:.6f}"] = row
    return out


def recount(results: dict, log) -> None:
    """Counts jaxbundle's model passes again for every (model, eps, bundle) of ``results``
    (deterministic: the same seed gives the same programs and survivors) and updates the
    pass counts and ratios in place; robust accuracy must come out the same."""
    for model_name, m in results["models"].items():
        apply_fn, params = models.load_or_train(models.MODELS[model_name])
        sample = data.load_mnist_sample("test", n=results["n"])
        x, y = np.asarray(sample.x, np.float32), np.asarray(sample.y)
        for eps_text, row in m["eps"].items():
            for name, entry in row.items():
                if name == "autoattack":
                    continue
                counts = {"forward": 0, "backward": 0}
                robust, _ = run_jaxbundle(counting(apply_fn, counts), params, x, y,
                                          float(eps_text), name.removeprefix("jaxbundle-"))
                jax.effects_barrier()
                if abs(100 * float(robust.mean()) - entry["robust_accuracy"]) > 1e-9:
                    raise SystemExit(f"{model_name} {eps_text} {name}: robust accuracy moved")
                entry["passes"] = dict(counts)
                entry["passes_per_example"] = (counts["forward"] + counts["backward"]) / len(y)
                entry["cost_ratio"]["passes"] = (entry["passes_per_example"]
                                                 / row["autoattack"]["passes_per_example"])
                log(f"{model_name} eps {eps_text} {name}: passes/ex "
                    f"{entry['passes_per_example']:.0f} ({entry['cost_ratio']['passes']:.3f})")


def markdown(results: dict) -> str:
    """The results as the table of benchmarks/README.md."""
    lines = ["| model | eps | AutoAttack: robust %, passes/ex, s | bundle | robust % | "
             "passes/ex (ratio) | cold s, cold with cache s, warm s (ratio cold, cached) | "
             "disagree (here robust / AA robust) |", "|---|---|---|---|---|---|---|---|"]
    for model, m in results["models"].items():
        for eps, row in m["eps"].items():
            aa = row["autoattack"]
            for name, e in row.items():
                if name == "autoattack":
                    continue
                lines.append(
                    f"| {model} | {round(float(eps) * 255)}/255 | {aa['robust_accuracy']:.1f}, "
                    f"{aa['passes_per_example']:.0f}, {aa['seconds']:.0f} | `{name}` | "
                    f"{e['robust_accuracy']:.1f} | {e['passes_per_example']:.0f} "
                    f"({e['cost_ratio']['passes']:.3f}) | {e['seconds_cold']:.1f}, "
                    f"{e.get('seconds_cold_cached', float('nan')):.1f}, "
                    f"{e['seconds_warm']:.1f} ({e['cost_ratio']['seconds_cold']:.3f}, "
                    f"{e['cost_ratio'].get('seconds_cold_cached', float('nan')):.3f}) | "
                    f"{e['robust_here_fooled_by_autoattack']} / "
                    f"{e['fooled_here_robust_under_autoattack']} |")
    return "\n".join(lines)


def _names(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="adversarial,adversarial-linen")
    parser.add_argument("--bundles", default="default",
                        help="bundles timed over --rounds (cold and warm)")
    parser.add_argument("--once", default="autoattack",
                        help="bundles run once, counted and timed with the probes on "
                        "(jaxbundle's own AutoAttack: the faithfulness check)")
    parser.add_argument("--eps", default=None,
                        help="comma-separated eps values for every model (default: EPS)")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--aa-cache", default=None, metavar="DIR",
                        help="store AutoAttack's result per (model, eps, n) here, and reuse a "
                        "stored one instead of running AutoAttack again (its entry then names "
                        "the file)")
    parser.add_argument("--table", default=None, metavar="JSON",
                        help="print the markdown table of a results file and exit")
    parser.add_argument("--recount", default=None, metavar="JSON",
                        help="count jaxbundle's passes again in a results file (in place)")
    args = parser.parse_args(argv)
    if args.recount:
        with open(args.recount) as f:
            results = json.load(f)
        recount(results, lambda line: print(line, flush=True))
        results["recounted"] = ("jaxbundle's passes counted again with the vmap-aware probe "
                                "(the first run's probe saw a vmapped copy once)")
        with open(args.recount, "w") as f:
            json.dump(results, f, indent=1)
        return
    if args.table:
        with open(args.table) as f:
            print(markdown(json.load(f)))
        return

    import torch

    torch.set_num_threads(args.threads)

    def log(line):
        print(line, flush=True)

    results = {"command": " ".join(sys.argv), "n": args.n, "rounds": args.rounds,
               "torch": torch.__version__, "jax": jax.__version__, "models": {}}
    for name in args.models.split(","):
        eps_values = (tuple(float(e) for e in args.eps.split(",")) if args.eps
                      else EPS[name])
        results["models"][name] = compare(
            name, eps_values, _names(args.bundles), _names(args.once), args.n, args.rounds, log,
            args.aa_cache)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
