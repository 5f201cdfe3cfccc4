"""scripts/ab_kernels.py's report (CPU): bitwise agreement, per-kernel means and changes, and its case parsing."""

from __future__ import annotations

import pytest

from helpers import load_script

ab_kernels = load_script("ab_kernels")


def one_run(kernels: dict[str, float], checksums: list[int], wall: float = 10.0) -> dict:
    return {"64/4@65536:random": {"wall_ms": wall, "kernels_ms": kernels, "kernels_total_ms": sum(kernels.values()),
                                  "checksums": checksums}}


def test_report_means_changes_and_agreement():
    a = [one_run({"fwd": 4.0, "bwd": 8.0, "tiny": 0.1}, [1, 2]), one_run({"fwd": 6.0, "bwd": 8.0, "tiny": 0.1}, [1, 2])]
    b = [one_run({"fwd": 4.5, "bwd": 6.0, "tiny": 0.1}, [1, 2]), one_run({"fwd": 4.5, "bwd": 6.0, "tiny": 0.1}, [1, 2])]
    text = ab_kernels.report(a, b)
    assert "bit for bit equal" in text
    lines = text.splitlines()
    bwd = next(line for line in lines if line.endswith(" bwd"))
    fwd = next(line for line in lines if line.endswith(" fwd"))
    assert bwd.split()[:3] == ["8.000", "6.000", "-25.0%"]  # means over the runs, B against A
    assert fwd.split()[:3] == ["5.000", "4.500", "-10.0%"]
    assert lines.index(bwd) < lines.index(fwd)  # largest A time first
    assert not any(line.endswith(" tiny") for line in lines)  # below min_ms in both builds
    assert "kernels ms: A 12.10 14.10 | B 10.60 10.60" in text


def test_report_flags_different_bits_and_new_kernels():
    text = ab_kernels.report([one_run({"fwd": 4.0}, [1, 2])], [one_run({"fwd": 4.0, "split": 1.0}, [1, 3])])
    assert "DIFFER" in text
    assert any(line.endswith(" split") and "new" in line for line in text.splitlines())


def test_parse_case():
    assert ab_kernels.parse_case("32/8@8192:drifting") == (32, 8, 8192, "drifting")
    with pytest.raises(SystemExit, match="random or drifting"):
        ab_kernels.parse_case("32/8@8192:local")
