"""The canary gate: `pytest -m stress --sessions 80` against the embedded runtime (or --base-url).

Fails on ANY oracle firing, a golden-transcript regression, leaked KV pages or a performance
regression beyond --perf-tolerance; every failure line names its oracle.
"""

from __future__ import annotations

import pytest

from canary.gate import run_ab, run_gate
from canary.pytest_plugin import driver_options, record_notes, record_summary
from canary.reports import summary_lines, write_plots, write_summary

pytestmark = pytest.mark.stress


def test_canary_gate(canary_target, canary_options, pytestconfig, request):
    options = driver_options(canary_options, canary_target)
    if canary_options.baseline_url:
        from canary.targets import remote_target

        baseline = remote_target(canary_options.baseline_url, canary_options.model, canary_options.api_key)
        outcome = run_ab(canary_target, baseline, options, canary_options.perf_tolerance)
    else:
        outcome = run_gate(canary_target, options, golden_update=canary_options.golden_update,
                           baseline_update=canary_options.baseline_update,
                           baseline=canary_options.baseline, perf_tolerance=canary_options.perf_tolerance)
    if canary_options.sweep:
        from canary.gate import sweep

        outcome.summary.update(sweep(canary_target, options))
    record_notes(pytestconfig, outcome.notes)
    report = None
    if canary_options.report_dir:
        report = write_summary(canary_options.report_dir, outcome.summary)
        write_plots(canary_options.report_dir, outcome.summary)
    # Recorded before the verdict below, so the terminal summary says what ran on a failure too.
    record_summary(request.node, summary_lines(outcome.summary, outcome.failures, report))
    m = outcome.summary.get("metrics", {})
    if m:
        print(f"\ncanary: {m['requests']} requests, {m['completion_tokens']} tokens in {m['wall_s']:.1f}s "
              f"({m['output_tok_s']:.0f} tok/s), TTFT p50 {m['ttft_s']['p50']:.3f}s, TPOT p50 {m['tpot_s']['p50']:.4f}s")
    assert outcome.passed, f"{len(outcome.failures)} canary failures:\n" + "\n".join(outcome.failures[:25])
