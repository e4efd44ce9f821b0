"""How well does each ranking pick the survivors a black-box stage can still fool? (tuning only)

On a tuning model (PROTOCOL.md), for every example: the white-box stages of the ``default``
bundle run in full (APGD-CE 20, APGD-CE 100, APGD-T 5 x 40: the margin ``m_wb`` their best
candidate leaves), then AutoAttack's Square alone, with the keys it has as the default's fourth
stage, stopped after each probe length P (its own best margin ``m_P``; the schedule is not
rescaled, so these are the first P steps of the 5,000-query run) and run in full (``fooled``).
A ranking rule keeps the top K of the white-box survivors; the study counts how many of the
survivors Square fools it keeps, for K = 4 %, 8 %, 16 %, 32 % of the survivors. Rules:
``wb`` (the white-box margin, the old focus), ``probe-P`` (the fraction of the clean margin
Square's own best closed after P steps) and ``mix-P`` (half the slots each, no repeats).

    python benchmarks/heldout/probe_study.py --model adversarial --norm linf --eps 0.3137
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle import data, goals, models, suites
from jaxbundle.core.bundler import (Driver, Rules, goals_for, judge_stage, run, start_stage,
                                    step_stage)

PROBES = (50, 100, 250, 500, 1000)
SHARES = (0.04, 0.08, 0.16, 0.32)


def _run(attacks, index, apply_fn, params, x, y, eps, norm):
    """The attacks from the clean image: the bundle of them (``index`` None), or the one
    attack as the bundle's attack ``index`` (its keys), by the cascade's stage programs."""
    rules = Rules(apply_fn, goals_for(("misclassify",), attacks), norm)
    args = (params, x, y, jax.random.key(0), jnp.arange(len(y), dtype=jnp.int32),
            jnp.full(y.shape, eps, jnp.float32))
    if index is None:
        r = run(*args, rules=rules, attacks=tuple(attacks))
        best, clean = r.best, r.clean
    else:
        (attack,) = attacks
        driver = Driver(attack, index, rules)
        running = start_stage(*args, driver=driver)
        running = step_stage(params, running, x, y, args[-1], 0, attack.num_steps, driver=driver)
        best = judge_stage(params, running, x, y, args[-1], attack.num_steps, True,
                           driver=driver).best
        clean = running.clean.score
    s = best["misclassify"].score
    return (np.asarray(s.margin), np.asarray(goals.success("misclassify", s, eps)),
            np.asarray(clean.margin))


def _top(order_key, rows, k):
    return set(rows[np.argsort(-order_key[rows], kind="stable")[:k]].tolist())


def study(model, norm, eps, n, start=0, arrays: str | None = None) -> dict:
    apply_fn, params = models.load_or_train(models.MODELS[model])
    sample = data.load_mnist_sample("test", n=start + n)
    x, y = np.asarray(sample.x, np.float32)[start:], np.asarray(sample.y)[start:]
    white = (suites.attack("apgd-ce", norm, steps=20),
             suites.attack("apgd-ce-long", norm, steps=100),
             suites.attack("apgd-t5", norm, steps=40))
    m_wb, fooled_wb, clean = _run(white, None, apply_fn, params, x, y, eps, norm)
    survivors = np.flatnonzero(~fooled_wb & (clean < 0))
    square = lambda q: suites.attack("square-aa", norm, queries=q)  # noqa: E731
    _, fooled_sq, _ = _run((square(5000),), 3, apply_fn, params, x, y, eps, norm)
    target = set(survivors[fooled_sq[survivors]].tolist())
    out = {"model": model, "norm": norm, "eps": eps, "n": n, "survivors": int(survivors.size),
           "square_fools": len(target), "kept": {}}
    probes = {}
    for p in PROBES:  # what the probe fools is won whatever the focus keeps after it
        m_p, fooled_p, _ = _run((square(p + 1),), 3, apply_fn, params, x, y, eps, norm)
        won = set(survivors[fooled_p[survivors]].tolist())
        probes[p] = ((m_p - clean) / np.abs(clean), won,
                     survivors[[r not in won for r in survivors]])
        out[f"probe-{p} fools"] = len(won)
    for share in SHARES:
        k = max(1, round(share * survivors.size))
        row = {"wb": len(_top(m_wb, survivors, k) & target)}
        for p, (progress, won, rest) in probes.items():
            row[f"probe-{p}"] = len(won | (_top(progress, rest, k) & target))
            half = _top(m_wb, rest, k // 2)
            others = rest[[r not in half for r in rest]]
            row[f"mix-{p}"] = len(won | ((half | _top(progress, others, k - len(half)))
                                         & target))
        out["kept"][f"{share:.2f} (K={k})"] = row
    if arrays:  # per survivor, for rules studied offline
        np.savez(arrays, survivors=survivors, m_wb=m_wb[survivors], clean=clean[survivors],
                 fooled=fooled_sq[survivors],
                 **{f"progress_{p}": v[0][survivors] for p, v in probes.items()},
                 **{f"won_{p}": np.isin(survivors, list(v[1])) for p, v in probes.items()})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="adversarial")
    parser.add_argument("--norm", default="linf")
    parser.add_argument("--eps", type=float, required=True)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--arrays", default=None, metavar="NPZ",
                        help="save the per-survivor margins, progress and verdicts here")
    args = parser.parse_args(argv)
    print(json.dumps(study(args.model, args.norm, args.eps, args.n, arrays=args.arrays)),
          flush=True)


if __name__ == "__main__":
    main()
