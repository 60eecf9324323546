"""The harness against a server started by hand (the --base-url path), and its reports."""

from __future__ import annotations

import json

import pytest

from canary.driver import DriverOptions
from canary.gate import run_gate
from canary.options import serves_canary_model
from canary.reports import write_plots, write_summary
from canary.targets import embedded_server, remote_target

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def hand_started_server(tmp_path_factory, canary_model):
    """The canary model served as an operator would start it; the harness gets only its URL."""
    with embedded_server(canary_model, max_running=None, num_pages=2048,
                         log_dir=tmp_path_factory.mktemp("srv")) as server:
        yield server.root_url


def test_gate_against_a_base_url_discovers_the_model_and_skips_golden_loudly(hand_started_server, tmp_path):
    target = remote_target(hand_started_server, None)  # --model omitted: asked from /v1/models
    assert target.model == "canary-moe-v2" and serves_canary_model(target.model)
    outcome = run_gate(target, DriverOptions(sessions=4, turns=2), progress=False,
                       baseline=tmp_path / "baseline.json")
    assert outcome.passed, outcome.failures
    assert any("golden-transcript oracle skipped" in n for n in outcome.notes)
    assert any("NO PERFORMANCE BASELINE" in n for n in outcome.notes)
    assert outcome.summary["metrics"]["requests"] >= 8


def test_reports_write_summary_and_plots(tmp_path):
    summary = {"metrics": {"output_tok_s": 10.0},
               "sweep": [{"concurrency": c, "output_tok_s": 10.0 * c, "tpot_s": {"p50": 0.01 + 0.001 * c}}
                         for c in (1, 2, 4)],
               "cliffs": [], "step_fit": {"a": 0.01, "b": 0.001, "points": [(1, 0.011), (2, 0.012), (4, 0.014)]},
               "failures": [{"t": 1.5, "oracle": "json-parse"}]}
    path = write_summary(tmp_path, summary)
    assert json.loads(path.read_text())["metrics"]["output_tok_s"] == 10.0
    plots = write_plots(tmp_path, summary)
    assert sorted(p.name for p in plots) == ["failures_over_time.png", "step_time_fit.png",
                                             "throughput_vs_concurrency.png"]
    assert all(p.stat().st_size > 1000 for p in plots)


def test_client_aborts_mid_stream_leave_no_pages_and_no_false_alarm(tmp_path, canary_model):
    options = DriverOptions(sessions=8, turns=2, stream_ratio=1.0, abort_ratio=0.5)
    with embedded_server(canary_model, log_dir=tmp_path) as target:
        outcome = run_gate(target, options, progress=False, baseline=tmp_path / "baseline.json")
    assert outcome.summary["metrics"]["aborted_requests"] >= 2, "the run must really abort streams"
    assert outcome.passed, outcome.failures  # includes the KV-leak oracle: pages back to idle
    assert "golden" in outcome.summary and outcome.summary["golden"]["checked"] > 0
