"""The default's strength and cost against AutoAttack's own spread, pooled per norm (issue 50).

AutoAttack is randomised, so two of its runs disagree on a few examples per setting; a candidate
is judged against that spread, per example, pooled over every reported setting of a norm:

* **consensus (gate 1).** For AutoAttack run ``r`` of ``K``, ``C(-r)`` is the set of examples the
  other ``K - 1`` runs all fool; ``M_r`` the examples of ``C(-r)`` run ``r`` itself misses, summed
  over the settings. ``M_default`` counts the examples of ``C(-r)`` the default misses, averaged
  over ``r`` and over the default's seeds, summed the same way. Passes when
  ``M_default <= max_r M_r``: the default misses no more of what AutoAttack agrees on than one of
  AutoAttack's own runs does.
* **balance (gate 2).** The sum over settings of (the default's robust examples, mean of its
  seeds, minus the median of AutoAttack's runs) is at most 0, and on no setting does a seed of
  the default leave more than 1 example robust beyond AutoAttack's worst run.
* **masking (gate 3).** The default's misses of any ``C(-r)`` that AutoAttack fooled only with
  Square (or only with FAB-T), in every run that says which component fooled it, are listed;
  on a setting where the default's ``black_box_beats_white_box`` check fires, any such miss
  fails the gate. The same rule is applied to AutoAttack's own runs, like for like: ``masked_r``
  counts the examples of ``C(-r)`` run ``r`` misses that the other runs fooled only with Square
  (or only with FAB-T), and ``masked_default`` the default's, averaged over ``r`` and its seeds,
  both summed over the settings where the check fires. Where every AutoAttack run fails the
  literal rule, it cannot tell a weaker attack from AutoAttack's own randomness; the verdict
  then also gives ``masking_relative``: ``masked_default <= max_r masked_r``, as gate 1.
* **cost.** Model passes per example (forward and backward rows), the default's mean over its
  seeds against the mean of AutoAttack's runs, and warm wall-clock alike (the means of the runs
  that were timed: torchattacks' run has no compilation, the bundle's are timed warm):
  Linf at most 0.12 where AutoAttack's robust accuracy (median run) is 20 % or more and 0.5
  under 5 % (between them, the limit moves linearly with the robust accuracy: not fixed by the
  issue, written down here); L2 at most 0.20, 0.6 where the default's FAB-T escalation fired.

Per setting the table gives AutoAttack's figures and the default's, the consensus-only and
default-only counts, AutoAttack's own discordance and the component that fooled each missed
example. Inputs: ``run.py --out`` files (rows carry per-example verdicts, ``robust``, and since
issue 50 ``fooled_by``) and AutoAttack's torchattacks caches::

    python benchmarks/heldout/gates.py benchmarks/results/heldout/gates-*.jsonl \\
        --aa-cache benchmarks/results/heldout/aa --judging float
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NamedTuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from agreement import cached_path, setting_key  # noqa: E402

COMPONENTS = ("apgd-ce", "apgd-t", "fab-t", "square")  # run.py's AA_ATTACKS


class Run(NamedTuple):
    """One run on one setting: per example robust (clean-correct and not fooled), the component
    that fooled it (a string, ``COMPONENTS``' index per example, ``-`` none, ``?`` unknown; None:
    not recorded), passes per example and warm seconds (None: not measured)."""

    robust: np.ndarray
    fooled_by: str | None = None
    passes: float | None = None
    seconds: float | None = None


class Setting(NamedTuple):
    """AutoAttack's ``K`` runs and the default's seeds on one (model, norm, eps)."""

    key: str
    norm: str
    autoattack: tuple[Run, ...]
    default: tuple[Run, ...]
    escalated: bool = False  # the default's FAB-T escalation ran (L2)
    black_box_fires: bool = False  # the default's black_box_beats_white_box check fired


def cost_limit(norm: str, autoattack_robust: float, escalated: bool) -> float:
    """The most of AutoAttack's passes (and time) the default may spend on a setting."""
    if norm == "l2":
        return 0.6 if escalated else 0.20
    if autoattack_robust >= 20.0:
        return 0.12
    if autoattack_robust < 5.0:
        return 0.5
    return 0.5 + (autoattack_robust - 5.0) / 15.0 * (0.12 - 0.5)


def _components(runs: tuple[Run, ...], example: int) -> set[str]:
    """The components that fooled ``example`` in the runs that recorded one."""
    return {r.fooled_by[example] for r in runs
            if r.fooled_by is not None and r.fooled_by[example] not in "-?"}


def _only_square_or_fab(runs: tuple[Run, ...], n: int) -> np.ndarray:
    """Per example, whether the runs that recorded a component fooled it only with Square, or
    only with FAB-T."""
    return np.array([_components(runs, e) in ({"3"}, {"2"}) for e in range(n)], bool)


def figures(s: Setting) -> dict:
    """One setting's counts (see the module docstring)."""
    aa = np.stack([r.robust for r in s.autoattack])
    default = np.stack([r.robust for r in s.default])
    k = len(aa)
    if k < 2:
        raise ValueError(f"{s.key}: a consensus needs 2 or more AutoAttack runs, got {k}")
    held_out = [~np.delete(aa, r, 0).any(0) for r in range(k)]  # C(-r): the others all fool
    m_runs = [int(np.sum(aa[r] & held_out[r])) for r in range(k)]
    m_default = float(np.mean([[np.sum(d & c) for d in default] for c in held_out]))
    missed = np.zeros(aa.shape[1], bool)
    for c in held_out:
        missed |= c & default.any(0)
    only = [_only_square_or_fab(s.autoattack[:r] + s.autoattack[r + 1:], aa.shape[1])
            for r in range(k)]  # fooled only by Square (or only FAB-T) in the other runs
    masked = {int(e): COMPONENTS[int(_components(s.autoattack, int(e)).pop())]
              for e in np.flatnonzero(missed & _only_square_or_fab(s.autoattack, aa.shape[1]))}
    aa_counts, default_counts = aa.sum(1), default.sum(1)
    aa_robust = 100.0 * float(np.median(aa_counts)) / aa.shape[1]
    out = {
        "key": s.key, "norm": s.norm, "n": int(aa.shape[1]),
        "autoattack_robust": [int(c) for c in aa_counts],
        "default_robust": [int(c) for c in default_counts],
        "m_runs": m_runs, "m_default": m_default,
        "balance": float(np.mean(default_counts) - np.median(aa_counts)),
        "above_worst": int(np.max(default_counts) - np.max(aa_counts)),
        # mean over the default's seeds: what every AutoAttack run fools and it misses; what it
        # fools and no AutoAttack run does
        "consensus_only": float(np.mean([np.sum(~aa.any(0) & d) for d in default])),
        "default_only": float(np.mean([np.sum(aa.all(0) & ~d) for d in default])),
        "discordance": int(np.sum(aa.any(0) & ~aa.all(0))),
        "missed_by_component": {
            name: int(sum(1 for e in np.flatnonzero(missed)
                          if str(i) in _components(s.autoattack, int(e))))
            for i, name in enumerate(COMPONENTS)},
        "masked": masked,
        "masked_runs": [int(np.sum(aa[r] & held_out[r] & only[r])) for r in range(k)],
        "masked_default": float(np.mean([[np.sum(d & c & o) for d in default]
                                         for c, o in zip(held_out, only)])),
        "black_box_fires": s.black_box_fires,
        "escalated": s.escalated,
    }
    out["limit"] = cost_limit(s.norm, aa_robust, s.escalated)
    for field in ("passes", "seconds"):  # the means of the runs that measured it
        mine = [getattr(r, field) for r in s.default if getattr(r, field) is not None]
        theirs = [getattr(r, field) for r in s.autoattack if getattr(r, field) is not None]
        out[f"{field}_ratio"] = (float(np.mean(mine)) / float(np.mean(theirs))
                                 if mine and theirs else None)
    return out


def verdict(settings: list[Setting]) -> dict:
    """The pooled gates of each norm over ``settings`` (every run aligned: AutoAttack run ``r``
    is the same reference in every setting)."""
    out = {}
    for norm in sorted({s.norm for s in settings}):
        rows = [figures(s) for s in settings if s.norm == norm]
        m_runs = np.sum([r["m_runs"] for r in rows], axis=0).tolist()
        m_default = float(sum(r["m_default"] for r in rows))
        balance = float(sum(r["balance"] for r in rows))
        worst = max(r["above_worst"] for r in rows)
        masked = [(r["key"], e, c) for r in rows for e, c in r["masked"].items()]
        masking_fails = [(r["key"], e) for r in rows if r["black_box_fires"]
                         for e in r["masked"]]
        fires = [r for r in rows if r["black_box_fires"]]
        masked_runs = np.sum([r["masked_runs"] for r in fires], axis=0).tolist() if fires \
            else [0] * len(m_runs)
        masked_default = float(sum(r["masked_default"] for r in fires))
        over = [r["key"] for r in rows
                if any(r[f] is not None and r[f] > r["limit"]
                       for f in ("passes_ratio", "seconds_ratio"))]
        gates = {
            "consensus": m_default <= max(m_runs),
            "balance": balance <= 0 and worst <= 1,
            "masking": not masking_fails,
            "cost": not over,
        }
        relative = {"masking_relative": masked_default <= max(masked_runs),
                    "autoattack_runs_pass_masking": [m == 0 for m in masked_runs]}
        out[norm] = {"settings": rows, "m_runs": m_runs, "m_default": m_default,
                     "balance": balance, "most_above_worst": worst, "masked": masked,
                     "masked_runs": masked_runs, "masked_default": masked_default,
                     "over_cost": over, "gates": gates, **relative,
                     "passed": all(gates.values())}
    return out


def load(paths: list[str], aa_cache: str, judging: str = "float",
         runs: int = 3) -> tuple[list[Setting], list[str]]:
    """The settings with ``runs`` AutoAttack runs (torchattacks' from ``aa_cache``, then the
    ``autoattack`` bundle's rows by seed) and the default's rows, judged ``judging``; and the
    keys of the settings that lack some of them (left out of the verdict)."""
    rows: dict[str, dict[str, list[dict]]] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    if row.get("reported", True) and row.get("judging", "auto") == judging:
                        rows.setdefault(setting_key(row), {}).setdefault(
                            row["candidate"], []).append(row)
    settings, incomplete = [], []
    for key, by in sorted(rows.items()):
        cache = cached_path(aa_cache, key)
        references = []
        if cache:
            with open(cache) as f:
                aa = json.load(f)
            references.append(Run(np.asarray(aa["robust"], bool),
                                  "".join("-" if c < 0 else str(c) for c in aa["fooled_by"]),
                                  aa.get("passes_per_example"), aa.get("seconds")))
        references += [_run(row) for row in _by_seed(by.get("autoattack", []))]
        defaults = _by_seed(by.get("default", []))
        if len(references) < runs or not defaults:
            incomplete.append(key)
            continue
        first = defaults[0]
        settings.append(Setting(
            key, first["norm"], tuple(references[:runs]), tuple(_run(r) for r in defaults),
            escalated=any(s["attack"] == "fab-t" and s["examples"] for d in defaults
                          for s in d.get("stages", [])),
            black_box_fires=any(d.get("black_box_beats_white_box") for d in defaults)))
    return settings, incomplete


def _by_seed(rows: list[dict]) -> list[dict]:
    """One row per seed, in seed order: the last one read of each (a later file's rerun
    replaces an earlier row)."""
    return [row for _, row in sorted({r.get("seed", 0): r for r in rows}.items())]


def _run(row: dict) -> Run:
    return Run(np.array([c == "1" for c in row["robust"]]), row.get("fooled_by"),
               row.get("passes_per_example"), row.get("seconds_warm"))


def markdown(result: dict) -> str:
    """The per-setting table and the pooled verdict of each norm."""
    lines = []
    for norm, v in result.items():
        lines += [f"### {norm}", "",
                  "| setting | AutoAttack robust (runs) | default robust (seeds) | M_r | "
                  "M_default | consensus-only | default-only | AA discordance | missed by "
                  "component | passes / AA | time / AA | limit |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in v["settings"]:
            by = ", ".join(f"{k} {c}" for k, c in r["missed_by_component"].items() if c)
            ratio = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            lines.append(
                f"| {r['key']} | {r['autoattack_robust']} | {r['default_robust']} | "
                f"{r['m_runs']} | {r['m_default']:.2f} | {r['consensus_only']:.1f} | "
                f"{r['default_only']:.1f} | {r['discordance']} | {by or '-'} | "
                f"{ratio(r['passes_ratio'])} | {ratio(r['seconds_ratio'])} | {r['limit']:.2f} |")
        g = v["gates"]
        lines += ["", f"Pooled over {len(v['settings'])} settings: M_default "
                  f"{v['m_default']:.2f} against max_r M_r {max(v['m_runs'])} (M_r "
                  f"{v['m_runs']}): consensus {'passed' if g['consensus'] else 'FAILED'}; "
                  f"balance {v['balance']:+.1f} examples, at most {v['most_above_worst']} above "
                  f"AutoAttack's worst run: {'passed' if g['balance'] else 'FAILED'}; masking "
                  f"({len(v['masked'])} listed) {'passed' if g['masking'] else 'FAILED'} "
                  f"(like for like where the check fires: the default {v['masked_default']:.2f}"
                  f", AutoAttack's runs {v['masked_runs']}: "
                  f"{'within' if v['masking_relative'] else 'OUTSIDE'} their spread); cost "
                  f"{'passed' if g['cost'] else 'FAILED on ' + ', '.join(v['over_cost'])}. "
                  f"Verdict: {'PASSED' if v['passed'] else 'FAILED'}.", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", metavar="JSONL")
    parser.add_argument("--aa-cache", required=True, metavar="DIR",
                        help="torchattacks' AutoAttack runs (run.py's cache): reference run 1")
    parser.add_argument("--judging", choices=("auto", "float"), default="float")
    parser.add_argument("--runs", type=int, default=3, help="AutoAttack runs per setting (K)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures")
    args = parser.parse_args(argv)
    settings, incomplete = load(args.files, args.aa_cache, args.judging, args.runs)
    result = verdict(settings)
    print(markdown(result))
    if incomplete:
        print(f"left out ({len(incomplete)}, fewer than {args.runs} AutoAttack runs or no "
              f"default run): {', '.join(incomplete)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"verdict": result, "incomplete": incomplete}, f, indent=1)


if __name__ == "__main__":
    main()
