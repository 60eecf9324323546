"""The canary gate: `pytest -m stress --sessions 80` against the embedded runtime (or --base-url).

Fails on ANY oracle firing, a golden-transcript regression, leaked KV pages or a performance
regression beyond --perf-tolerance; every failure line names its oracle. What runs (A/B, gate,
sweep, reports) follows the command line: canary/gate.py `run_configured`.
"""

from __future__ import annotations

import pytest

from canary.gate import run_configured
from canary.reports import summary_lines

pytestmark = pytest.mark.stress


def test_canary_gate(canary_target, canary_options, canary_notes, canary_summary):
    outcome = run_configured(canary_options, canary_target)
    canary_notes.extend(outcome.notes)
    # Recorded before the verdict below, so the terminal summary says what ran on a failure too.
    canary_summary(summary_lines(outcome.summary, outcome.failures, outcome.report))
    assert outcome.passed, f"{len(outcome.failures)} canary failures:\n" + "\n".join(outcome.failures[:25])


def test_canary_gate_under_preemption(canary_options, canary_notes, canary_summary, request, tmp_path):
    """The same workload mix against a server whose KV pool is smaller than the working set
    (`--small-pool-pages`): requests are preempted and recomputed, and every oracle, the golden
    store and the replays must still hold; the summary says how often it preempted."""
    from canary.pytest_plugin import config_server_args
    from canary.small_pool import small_pool_gate
    from runtime.config import DEFAULT_MODEL

    if canary_options.base_url or canary_options.baseline_url:
        pytest.skip("small-pool run: only the embedded runtime's pool can be sized here")
    if not canary_options.small_pool_pages:
        pytest.skip("small-pool run off (--small-pool-pages 0)")
    if canary_options.golden_update or canary_options.baseline_update:
        pytest.skip("small-pool run: checked against the golden store, not while it is recorded")
    outcome = small_pool_gate(canary_options, canary_options.model or DEFAULT_MODEL, config_server_args(request),
                              tmp_path)
    canary_notes.extend(outcome.notes)
    lines = summary_lines(outcome.summary, outcome.failures, None)
    lines[0] += f" (small KV pool: {outcome.summary['kv_pool_pages']} pages)"
    canary_summary(lines)
    assert outcome.passed, f"{len(outcome.failures)} canary failures:\n" + "\n".join(outcome.failures[:25])
