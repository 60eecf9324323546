"""Step-time fit, cliff detection and the baseline gate."""

from __future__ import annotations

import math

import pytest

from canary.perf import find_cliffs, fit_step_time, gate, percentile

pytestmark = pytest.mark.unit


def test_fit_recovers_a_known_line():
    bs = [1, 2, 4, 8, 16, 32]
    fit = fit_step_time(bs, [0.018 + 0.00105 * b for b in bs])
    assert math.isclose(fit.a, 0.018, rel_tol=1e-9) and math.isclose(fit.b, 0.00105, rel_tol=1e-9)
    assert fit.r2 == pytest.approx(1.0)
    with pytest.raises(ValueError):
        fit_step_time([4, 4], [1.0, 2.0])


def test_cliffs_are_flagged_only_where_throughput_drops():
    levels = [8, 9, 16, 17, 18]
    assert find_cliffs(levels, [100, 105, 180, 150, 158]) == [
        {"from": 16, "to": 17, "before": 180, "after": 150, "drop": pytest.approx(1 / 6)}]
    assert find_cliffs(levels, [100, 110, 120, 130, 140]) == []


def test_gate_fails_a_regression_beyond_tolerance_in_either_direction():
    base = {"output_tok_s": 1000.0, "tpot_p50": 0.010}
    ok = gate(base, {"output_tok_s": 950.0, "tpot_p50": 0.0105}, tolerance=0.10)
    assert all(r.passed for r in ok)
    slow = gate(base, {"output_tok_s": 700.0, "tpot_p50": 0.020}, tolerance=0.10)
    assert [r.metric for r in slow if not r.passed] == ["output_tok_s", "tpot_p50"]


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and math.isnan(percentile([], 50))
