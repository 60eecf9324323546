"""The gate's terminal summary (issue 17 item 6): on success and on failure it says what ran and
what was checked, and the pytest plugin prints it in the terminal summary from the controlling
process (a summary recorded by a test travels in its report, so xdist workers' summaries show too)."""

from __future__ import annotations

import pytest

from canary.reports import summary_lines

pytestmark = pytest.mark.unit

pytest_plugins = ["pytester"]


def gate_summary(**overrides) -> dict:
    stat = {"count": 10, "p50": 0.25, "p90": 0.3, "p99": 0.4, "mean": 0.26}
    summary = {"target": "embedded:canary-dsv4", "sessions": 8, "sessions_completed": 7, "sessions_failed": 0,
               "sessions_aborted": 1,
               "metrics": {"requests": 40, "aborted_requests": 1, "completion_tokens": 1234, "prompt_tokens": 24680,
                           "wall_s": 12.5,
                           "output_tok_s": 98.7, "ttft_s": stat, "tpot_s": {**stat, "p50": 0.0123}},
               "oracle_checks": {"nonce": 40, "required-calls": 12, "stream-protocol": 20},
               "golden": {"path": "golden/transcripts/stress-canary-dsv4.jsonl", "checked": 39,
                          "benign_near_ties": 1, "golden_commit": "abc"},
               "perf_gate": {"baseline": "golden/baselines/x.json", "tolerance": 0.1, "status": "ok",
                             "verdicts": [{"metric": "decode_tok_s@8", "status": "ok", "ratio": 1.013, "low": 0.99,
                                           "high": 1.037, "trials": 6, "tolerance": 0.1, "reason": "r"}]},
               "kv_pages_in_use": 0.0, "notes": []}
    summary.update(overrides)
    return summary


def test_a_passing_gate_says_what_ran_and_what_was_checked():
    text = "\n".join(summary_lines(gate_summary(), [], report_path="reports/summary.json"))
    for fact in ("PASSED", "embedded:canary-dsv4", "sessions: 8 (7 completed, 0 failed, 1 aborted)",
                 "requests: 40 (1 aborted), 1234 completion tokens in 12.5s = 99 tok/s",
                 "24680 prompt tokens (20 per completion token)", "nonce 40", "required-calls 12", "stream-protocol 20",
                 "golden: 38/39 requests token-identical, 1 benign near-ties, 0 diverged",
                 "ok vs golden/baselines/x.json: tolerance 10%",
                 "decode_tok_s@8 +1.3% [-1.0%, +3.7%] over 6 trials (ok)",
                 "KV pages in use after the run: 0.0", "report: reports/summary.json"):
        assert fact in text, f"{fact!r} missing from\n{text}"
    assert "failures:" not in text


def test_a_failing_gate_says_the_same_facts_plus_the_failures():
    failures = ["[golden] session-500001-req-3 diverged at token 4", "[ungrounded-answer] session 2 turn 1: x"]
    passed = summary_lines(gate_summary(), [], None)
    failed = summary_lines(gate_summary(sessions_failed=1), failures, None)
    assert failed[0].startswith("canary gate FAILED (2 failures)")
    assert "golden: 37/39 requests token-identical, 1 benign near-ties, 1 diverged" in "\n".join(failed)
    assert len(failed) == len(passed) + 1 + len(failures)  # every fact line, then the failures
    assert failed[-2:] == [f"    {f}" for f in failures]


def test_skipped_checks_say_why():
    notes = ["golden-transcript oracle skipped: the target is not the embedded canary runtime",
             "NO PERFORMANCE BASELINE for this hardware at x.json: perf gate skipped"]
    text = "\n".join(summary_lines(gate_summary(golden=None, perf_gate=None, kv_pages_in_use=None, notes=notes,
                                                differential={"compared": 12, "equal": 12, "benign_near_ties": 0,
                                                              "failed": 0, "exact": True, "wall_s": 3.0}),
                                   [], None))
    assert "golden: not checked (golden-transcript oracle skipped" in text
    assert "perf: not gated (NO PERFORMANCE BASELINE" in text
    assert "KV pages in use after the run: skipped (no kv_pages_in_use gauge in /metrics)" in text
    assert "differential: 12/12 replays alone identical to under load (exact)" in text
    assert "report: none written" in text


@pytest.mark.parametrize("verdict", ["passed", "failed"])
def test_the_plugin_prints_the_summary_in_the_terminal_summary(pytester, verdict):
    pytester.makeconftest('pytest_plugins = ["canary.pytest_plugin"]')
    pytester.makepyfile(f'''
        from canary.pytest_plugin import record_summary

        def test_gate(request):
            record_summary(request.node, ["canary gate LINE-ONE", "  sessions: 8 LINE-TWO"])
            assert {verdict == "passed"}
    ''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(**{verdict: 1})
    result.stdout.re_match_lines([r".*= canary =.*", r"canary gate LINE-ONE", r"  sessions: 8 LINE-TWO"])


def test_run_metrics_count_the_prompt_tokens_of_completed_requests_only():
    from types import SimpleNamespace

    from canary.perf.metrics import run_metrics

    def rec(prompt, completion, aborted=False):
        return SimpleNamespace(session=0, aborted=aborted, streamed=False, first_token=None,
                               completion_tokens=completion, prompt_tokens=prompt, chunk_times=[], started=0.0,
                               finished=1.0)

    result = SimpleNamespace(requests=[rec(100, 10), rec(250, 5), rec(999, 1, aborted=True)], wall_s=2.0, replays=[],
                             startup_s=0.0)
    assert run_metrics(result)["prompt_tokens"] == 350


def test_the_critical_path_is_the_longest_session_inside_and_between_its_requests():
    from types import SimpleNamespace

    from canary.perf.metrics import critical_path

    def rec(session, started, finished):
        return SimpleNamespace(session=session, started=started, finished=finished)

    # session 1: requests at [0, 2] and [2.5, 5] (span 5, 4.5 inside, a 0.5 gap); session 2: [0, 1], [1.1, 1.5]
    path = critical_path([rec(1, 2.5, 5.0), rec(2, 0.0, 1.0), rec(1, 0.0, 2.0), rec(2, 1.1, 1.5)])
    assert path["longest_session_s"] == 5.0 and path["longest_session_requests"] == 2
    assert path["longest_inside_requests_s"] == 4.5 and abs(path["longest_between_requests_s"] - 0.5) < 1e-12
    assert path["between_requests_s"]["count"] == 2
    metrics = {**gate_summary()["metrics"], "critical_path": path, "driver_startup_s": 3.25}
    text = "\n".join(summary_lines(gate_summary(metrics=metrics), []))
    assert "critical path: the longest session 5.0s (2 requests: 4.5s inside them, 0.5s between them)" in text
    assert "driver processes started in 3.2s before it (not counted)" in text


def test_the_critical_path_counts_reference_replays_as_server_time():
    """A streamed request [0, 2] replayed non-streamed at [2.1, 3.0], then the next turn [3.5, 5]:
    1 s of the session was the replay, the server's time; without it 1.5 s read as the harness's."""
    from types import SimpleNamespace

    from canary.perf.metrics import critical_path

    def rec(session, started, finished):
        return SimpleNamespace(session=session, started=started, finished=finished)

    records = [rec(1, 0.0, 2.0), rec(1, 3.5, 5.0)]
    without = critical_path(records)
    assert abs(without["longest_between_requests_s"] - 1.5) < 1e-12  # the replay counted as harness time
    path = critical_path(records, [(1, 2.1, 3.0)])
    assert path["longest_session_requests"] == 3 and abs(path["longest_inside_requests_s"] - 4.4) < 1e-12
    assert abs(path["longest_between_requests_s"] - 0.6) < 1e-12
    assert path["between_requests_s"]["count"] == 2


def test_engine_steps_of_the_load_phase_come_from_the_histograms_difference():
    from canary.gate import engine_steps_during

    steps = engine_steps_during((1.0, 10.0), (7.0, 510.0), wall_s=12.0)
    assert steps == {"steps": 500.0, "seconds": 6.0, "mean_ms": 12.0, "busy": 0.5}
    assert engine_steps_during(None, (7.0, 510.0), 12.0) is None
    text = "\n".join(summary_lines(gate_summary(engine_steps=steps), []))
    assert "engine: 500 steps, mean 12.0ms, in steps 50% of the run" in text


def test_a_sharded_runs_wall_time_is_its_sessions_not_its_process_start_up():
    """Two shards whose sessions ran 100.0-110.0 and 100.5-111.0 (wall clock): the run took 11 s,
    whenever their processes were spawned; requests, failures and counts add up."""
    from canary.driver import DriverOptions, RunResult
    from canary.driver_pool import merge_shards

    a = RunResult(DriverOptions(), "t", 100.0, 10.0, sessions_completed=3, oracle_checks={"nonce": 4})
    b = RunResult(DriverOptions(), "t", 100.5, 10.5, sessions_completed=2, oracle_checks={"nonce": 1, "gibberish": 2})
    merged = merge_shards(DriverOptions(), "t", [a, b])
    assert merged.started == 100.0 and merged.wall_s == 11.0
    assert merged.sessions_completed == 5 and merged.oracle_checks == {"nonce": 5, "gibberish": 2}
    a.replays.append((0, 100.1, 100.2))
    b.replays.append((1, 101.0, 101.5))
    assert merge_shards(DriverOptions(), "t", [a, b]).replays == [(0, 100.1, 100.2), (1, 101.0, 101.5)]
