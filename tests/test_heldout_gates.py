"""The pooled gates of the default against AutoAttack's own spread (benchmarks/heldout/gates.py),
on synthetic settings whose every count is worked out by hand."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "heldout"))

import gates  # noqa: E402


def _robust(bits: str) -> np.ndarray:
    return np.array([b == "1" for b in bits])


def _first(black_box_fires: bool = True) -> gates.Setting:
    """Six examples. AutoAttack: run 0 misses example 0, run 1 example 3, run 2 nothing more;
    all three leave example 5. The default's seed 0 misses example 1 (AutoAttack fooled it with
    Square in every run), seed 1 example 4 (FAB-T in every run)."""
    aa = (gates.Run(_robust("100001"), "-3002-", 100.0, 10.0),
          gates.Run(_robust("000101"), "030-2-", 100.0, 10.0),
          gates.Run(_robust("000001"), "13012-", 100.0, 10.0))
    default = (gates.Run(_robust("010001"), "0-002-", 20.0, 2.0),
               gates.Run(_robust("000011"), "0300--", 20.0, 2.0))
    return gates.Setting("first", "linf", aa, default, black_box_fires=black_box_fires)


def _second() -> gates.Setting:
    """Four examples every run fools; the default spends 0.12 of AutoAttack's passes."""
    aa = tuple(gates.Run(_robust("0000"), "0000", p, 1.0) for p in (100.0, 110.0, 90.0))
    default = tuple(gates.Run(_robust("0000"), "0000", p, 0.1) for p in (10.0, 14.0))
    return gates.Setting("second", "linf", aa, default)


def test_one_setting_counted_by_hand():
    f = gates.figures(_first())
    # C(-0) = {0, 1, 2, 4}: run 0 misses 0; C(-1) = {1, 2, 3, 4}: run 1 misses 3; C(-2) = {1, 2, 4}
    assert f["m_runs"] == [1, 1, 0]
    # each seed misses one example of every C(-r)
    assert f["m_default"] == 1.0
    assert f["autoattack_robust"] == [2, 2, 1] and f["default_robust"] == [2, 2]
    assert f["balance"] == 0.0 and f["above_worst"] == 0
    assert f["consensus_only"] == 1.0 and f["default_only"] == 0.0
    assert f["discordance"] == 2  # examples 0 and 3
    assert f["missed_by_component"] == {"apgd-ce": 0, "apgd-t": 0, "fab-t": 1, "square": 1}
    assert f["masked"] == {1: "square", 4: "fab-t"}
    assert f["passes_ratio"] == pytest.approx(0.2) and f["seconds_ratio"] == pytest.approx(0.2)
    assert f["limit"] == 0.12  # AutoAttack's median run leaves 2 of 6: 33 % robust


def test_the_pooled_verdict():
    v = gates.verdict([_first(), _second()])["linf"]
    assert v["m_runs"] == [1, 1, 0] and v["m_default"] == 1.0
    assert v["gates"] == {"consensus": True, "balance": True, "masking": False, "cost": False}
    assert v["over_cost"] == ["first"] and not v["passed"]
    # Without the black-box check firing, the Square-only and FAB-T-only misses are listed only.
    quiet = gates.verdict([_first(black_box_fires=False), _second()])["linf"]
    assert quiet["gates"]["masking"] and len(quiet["masked"]) == 2
    # One more consensus miss than AutoAttack's worst run fails the consensus gate.
    worse = _first()._replace(default=(gates.Run(_robust("011001")),) * 2)
    assert not gates.verdict([worse])["linf"]["gates"]["consensus"]
    with pytest.raises(ValueError, match="2 or more AutoAttack runs"):
        gates.figures(_second()._replace(autoattack=_second().autoattack[:1]))


def test_masking_applied_to_autoattack_itself():
    """Gate 3 like for like: run 0 misses example 0, which the other two runs fooled only with
    Square, so AutoAttack itself fails the literal rule; the default's seed 0 misses example 1
    (Square-only in every other pair of runs): 1 of 3 consensus sets, one seed of two."""
    aa = (gates.Run(_robust("100"), "-33"), gates.Run(_robust("000"), "333"),
          gates.Run(_robust("000"), "333"))
    default = (gates.Run(_robust("010"), "3-3"), gates.Run(_robust("000"), "333"))
    setting = gates.Setting("third", "l2", aa, default, black_box_fires=True)
    f = gates.figures(setting)
    assert f["masked_runs"] == [1, 0, 0] and f["masked_default"] == 0.5
    v = gates.verdict([setting])["l2"]
    assert not v["gates"]["masking"] and v["masked"] == [("third", 1, "square")]
    assert v["masking_relative"] and v["autoattack_runs_pass_masking"] == [False, True, True]
    # The first setting: no AutoAttack run misses a Square- or FAB-T-only example, the default
    # misses one per consensus set: outside AutoAttack's spread.
    first = gates.verdict([_first()])["linf"]
    assert first["masked_runs"] == [0, 0, 0] and first["masked_default"] == 1.0
    assert not first["masking_relative"]
    # Only the settings where the black-box check fires count.
    quiet = gates.verdict([setting._replace(black_box_fires=False)])["l2"]
    assert quiet["masked_runs"] == [0, 0, 0] and quiet["masked_default"] == 0.0


def test_cost_limits():
    assert gates.cost_limit("linf", 20.0, False) == 0.12
    assert gates.cost_limit("linf", 4.9, False) == 0.5
    assert gates.cost_limit("linf", 12.5, False) == pytest.approx(0.31)
    assert gates.cost_limit("l2", 50.0, False) == 0.20
    assert gates.cost_limit("l2", 50.0, True) == 0.6


def test_load_assembles_the_runs_of_a_setting(tmp_path):
    """Reference run 1 is torchattacks' (the cache), then the autoattack bundle's rows by seed;
    rows judged otherwise, or settings short of runs, are left out."""
    base = {"set": "heldout", "model": "m", "norm": "linf", "eps": 0.1, "n": 3,
            "reported": True, "judging": "float", "passes_per_example": 5.0,
            "seconds_warm": 1.0, "stages": []}
    rows = [dict(base, candidate="autoattack", seed=2, robust="001"),
            dict(base, candidate="autoattack", seed=1, robust="011"),
            dict(base, candidate="default", seed=0, robust="101"),
            dict(base, candidate="default", seed=0, robust="111", fooled_by="---"),
            dict(base, candidate="default", seed=1, robust="000", judging="auto"),
            dict(base, model="other", candidate="default", seed=0, robust="111")]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    key = gates.setting_key(base)
    (tmp_path / f"{key}_w0123456789abcdef.json").write_text(json.dumps(
        {"robust": [1, 0, 0], "fooled_by": [-1, 0, 3], "passes_per_example": 50.0,
         "seconds": 3.0}))
    settings, incomplete = gates.load([str(path)], str(tmp_path))
    (s,) = settings
    assert [r.robust.tolist() for r in s.autoattack] == [
        [True, False, False], [False, True, True], [False, False, True]]
    assert s.autoattack[0].fooled_by == "-03" and len(s.default) == 1  # the rerun of seed 0
    assert s.default[0].fooled_by == "---"
    assert incomplete == ["heldout_other_linf_0.100000_n3"]
