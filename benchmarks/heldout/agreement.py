"""How far AutoAttack agrees with itself, per example, and where a candidate falls short of it.

The held-out targets count, per setting, the examples AutoAttack fools that a candidate does not
(``missed``). AutoAttack is randomised (APGD's starts, Square's squares) and chaotic (FAB's
steps), so two runs of it disagree on some examples too; this script puts that floor beside the
candidates' counts. It reads ``run.py --out`` files (rows carry per-example verdicts,
``robust``) and AutoAttack's caches (``--aa-cache``, one directory per torchattacks run; the
first is the protocol's), treats each torchattacks run and every row of the ``autoattack``
bundle (any seed) as a reference run, and prints per setting:

* each pair of reference runs: the examples the first fools and the second does not, and back;
* the examples every reference run fools (the consensus) and those any of them fools;
* each candidate: robust %, missed against the first torchattacks run (the protocol's count),
  and missed among the consensus (examples no reference run left robust).

    python benchmarks/heldout/agreement.py benchmarks/results/heldout/agreement.jsonl \\
        --aa-cache benchmarks/results/heldout/aa benchmarks/results/heldout/aa-autoattack-v2
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os

import numpy as np

REFERENCE = "autoattack"


def setting_key(row: dict) -> str:
    """The AutoAttack cache key of a row's setting (``run.py``'s)."""
    return f"{row['set']}_{row['model']}_{row['norm']}_{row['eps']:.6f}_n{row['n']}"


def robust(row: dict) -> np.ndarray:
    return np.array([c == "1" for c in row["robust"]])


def compare(references: dict[str, np.ndarray], candidates: dict[str, np.ndarray]) -> dict:
    """Per-example agreement of ``references`` (name -> robust [n]) and each candidate."""
    pairs = [{"first": a, "second": b, "first_only": int(np.sum(~ra & rb)),
              "second_only": int(np.sum(ra & ~rb))}
             for (a, ra), (b, rb) in itertools.combinations(references.items(), 2)]
    stack = np.stack(list(references.values()))
    consensus, union = ~np.any(stack, 0), ~np.all(stack, 0)
    first = next(iter(references.values()))
    return {
        "pairs": pairs, "fooled_by_every_reference": int(consensus.sum()),
        "fooled_by_any_reference": int(union.sum()),
        "candidates": {name: {"robust_accuracy": 100 * float(r.mean()),
                              "missed": int(np.sum(r & ~first)),
                              "missed_of_consensus": int(np.sum(r & consensus))}
                       for name, r in candidates.items()},
    }


def load(paths: list[str], aa_caches: list[str]) -> dict[str, tuple[dict, dict]]:
    """``{setting: (references, candidates)}`` from ``run.py --out`` files: references are
    torchattacks' AutoAttack (each cache holding the setting) and every ``autoattack`` row,
    named by seed (and judging, where a row was not judged as the CLI judges)."""
    settings: dict[str, tuple[dict, dict]] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                row = json.loads(line)
                key = setting_key(row)
                if key not in settings:
                    settings[key] = (_torchattacks_runs(key, aa_caches), {})
                references, candidates = settings[key]
                name = f"{row['candidate']} seed {row.get('seed', 0)}"
                if row.get("judging", "auto") != "auto":
                    name += f", judged {row['judging']}"
                (references if row["candidate"] == REFERENCE else candidates)[name] = robust(row)
    return settings


def cached_path(cache: str | None, key: str, weights: str | None = None) -> str | None:
    """The file of setting ``key``'s torchattacks AutoAttack run in ``cache``: run.py names a
    run by the weights' fingerprint (``{key}_w{weights}.json``; without ``weights``, the last
    such name), older runs by the setting alone (``{key}.json``); None where it holds neither."""
    if not cache:
        return None
    pattern = f"{key}_w{weights}.json" if weights else f"{key}_w" + "[0-9a-f]" * 16 + ".json"
    found = sorted(glob.glob(os.path.join(glob.escape(cache), pattern)))
    for path in (found[-1:] + [os.path.join(cache, f"{key}.json")]):
        if os.path.exists(path):
            return path
    return None


def _torchattacks_runs(key: str, aa_caches: list[str]) -> dict[str, np.ndarray]:
    runs = {}
    for i, cache in enumerate(aa_caches):
        path = cached_path(cache, key)
        if path:
            with open(path) as f:
                runs["torchattacks" + (f" {i + 1}" if i else "")] = np.array(
                    json.load(f)["robust"], bool)
    if not runs:
        raise SystemExit(f"no AutoAttack run of {key} in {', '.join(aa_caches)}")
    return runs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", metavar="JSONL")
    parser.add_argument("--aa-cache", required=True, nargs="+", metavar="DIR")
    args = parser.parse_args(argv)
    for key, (references, candidates) in load(args.files, args.aa_cache).items():
        out = compare(references, candidates)
        print(f"{key}: {len(references)} reference runs; fooled by every one "
              f"{out['fooled_by_every_reference']}, by any {out['fooled_by_any_reference']}")
        for p in out["pairs"]:
            print(f"  {p['first']} vs {p['second']}: {p['first_only']} / {p['second_only']}")
        for name, c in out["candidates"].items():
            print(f"  {name}: {c['robust_accuracy']:.1f} %, missed {c['missed']}, of the "
                  f"consensus {c['missed_of_consensus']}")


if __name__ == "__main__":
    main()
