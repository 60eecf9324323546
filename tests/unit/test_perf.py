"""Step-time fit, cliff detection and the baseline gate."""

from __future__ import annotations

import math

import pytest

from canary.gate import GateOutcome, gate_against_baseline
from canary.perf.machine_speed import probe
from canary.perf.verdict import (
    compare_to_baseline,
    find_cliffs,
    fit_step_time,
    percentile,
    save_baseline,
    scale_for_machine,
)

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
    ok = compare_to_baseline(base, {"output_tok_s": 950.0, "tpot_p50": 0.0105}, tolerance=0.10)
    assert all(r.passed for r in ok)
    slow = compare_to_baseline(base, {"output_tok_s": 700.0, "tpot_p50": 0.020}, tolerance=0.10)
    assert [r.metric for r in slow if not r.passed] == ["output_tok_s", "tpot_p50"]


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and math.isnan(percentile([], 50))


BASE = {"output_tok_s": 160.0, "ttft_p50": 0.7, "tpot_p50": 0.2}


def test_machine_scaling_forgives_a_slower_machine_but_not_a_slower_build(tmp_path):
    path = tmp_path / "baseline.json"
    save_baseline(path, {"hardware": "cpu:test"}, BASE, machine_speed=400.0)
    # The same runtime on a machine 0.75x as fast: every figure 1/0.75 worse, beyond the 25% tolerance.
    slower_machine = {"output_tok_s": 120.0, "ttft_p50": 0.7 / 0.75, "tpot_p50": 0.2 / 0.75}
    outcome = GateOutcome()
    gate_against_baseline(slower_machine, {}, path, 0.25, False, outcome, machine_speed=300.0)
    assert outcome.passed and "scaled by 0.75" in outcome.notes[0]
    # Negative controls: without the probe the same figures fail; a build 2x slower on the same slower
    # machine fails, naming the scaling.
    unscaled = GateOutcome()
    gate_against_baseline(slower_machine, {}, path, 0.25, False, unscaled, machine_speed=None)
    assert not unscaled.passed
    slower_build = {k: v * 2 if k != "output_tok_s" else v / 2 for k, v in slower_machine.items()}
    regressed = GateOutcome()
    gate_against_baseline(slower_build, {}, path, 0.25, False, regressed, machine_speed=300.0)
    assert len(regressed.failures) == 3
    assert all("scaled for a machine 0.75x as fast" in f and "100% worse" in f for f in regressed.failures)


def test_a_baseline_without_a_probe_is_compared_unscaled(tmp_path):
    path = tmp_path / "baseline.json"
    save_baseline(path, {}, BASE)
    outcome = GateOutcome()
    gate_against_baseline({**BASE, "output_tok_s": 100.0}, {}, path, 0.25, False, outcome, machine_speed=300.0)
    assert [f.split(":")[0] for f in outcome.failures] == ["[perf-regression] output_tok_s"]
    assert "scaled" not in outcome.failures[0]


def test_scaling_rejects_a_meaningless_ratio():
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            scale_for_machine(BASE, bad)


def test_probe_measures_blocks_per_second():
    assert 0 < probe(0.05) < 1e6
    with pytest.raises(ValueError):
        probe(0)


def test_a_baseline_belongs_to_its_kernels():
    from canary.driver import DriverOptions
    from canary.gate import baseline_fingerprint
    from canary.provenance import fingerprint
    from canary.targets import Target

    target, options = Target("t", "http://x/v1", "canary-moe-v1", True), DriverOptions(sessions=80)
    older = baseline_fingerprint(target, {"model": "m"}, options)  # a server without engine_config
    default = baseline_fingerprint(target, {"model": "m", "engine_config": {"moe_kernel": "torch",
                                                                         "attention_kernel": "torch"}}, options)
    triton = baseline_fingerprint(target, {"model": "m", "engine_config": {"attention_kernel": "triton"}}, options)
    assert fingerprint(older) == fingerprint(default) != fingerprint(triton)
    assert triton["triton_kernels"] == ["attention"]
