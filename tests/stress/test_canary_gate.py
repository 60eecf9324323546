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
