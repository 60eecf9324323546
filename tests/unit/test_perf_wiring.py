"""How the gate's perf verdict is wired for a `--base-url` server this project did not write (issue
17 items 4-5): `--perf-workload` reaches the trials of both the A/B (`--baseline-url`) and the
stored-baseline verdict, and the A/B gate calibrates a plain-words target as the gate does, so a
model that cannot do the task (model quality) does not fail an A/B about speed. No server: the
driver and the trials are replaced by fakes."""

from __future__ import annotations

import pytest

from canary import gate
from canary.driver import DriverOptions, RunResult
from canary.options import CanaryOptions
from canary.oracles.turn import Failure
from canary.perf.ratio_stats import OK
from canary.perf.trial_load import TrialWorkload
from canary.perf.trials import TrialsOutcome
from canary.pytest_plugin import _perf_workload
from canary.targets import Target

pytestmark = pytest.mark.unit

THIRD_PARTY = Target("remote:http://llama/v1", "http://llama/v1", "gemma-3-270m-q4_k_m", False)


def options(**changes) -> CanaryOptions:
    values = dict(sessions=2, turns=1, concurrency=None, base_url="http://llama/v1", model=None, api_key=None,
                  stream_ratio=0.5, abort_ratio=0.0, faults=(), baseline=None, baseline_url=None,
                  perf_tolerance=0.2, report_dir=None, golden_update=False, baseline_update=False, sweep=False,
                  max_tokens=8, perf_trials=3)
    return CanaryOptions(**{**values, **changes})


@pytest.fixture
def calls(monkeypatch):
    """run_ab and run_gate replaced: each call's arguments, by name."""
    seen: dict[str, dict] = {}

    def fake(name):
        def run(*args, **kwargs):
            seen[name] = {"args": args, **kwargs}
            return gate.GateOutcome()
        return run

    monkeypatch.setattr(gate, "run_ab", fake("ab"))
    monkeypatch.setattr(gate, "run_gate", fake("gate"))
    monkeypatch.setattr("canary.targets.remote_target", lambda url, model, key=None: Target(
        f"remote:{url}", url, model or "gemma-3-270m-q4_k_m", False))
    return seen


def test_an_ab_gate_of_a_third_party_target_runs_the_asked_workload_calibrated(calls):
    changes = {"concurrency": [1], "max_tokens": 16, "logprobs": False}
    gate.run_configured(options(baseline_url="http://llama-b/v1", perf_workload=changes), THIRD_PARTY)
    ab = calls["ab"]
    assert ab["workload"] == TrialWorkload(concurrency=(1,), max_tokens=16, logprobs=False)
    assert ab["calibrate"] is True and ab["pairs"] == 3 and ab["args"][1].base_url == "http://llama-b/v1"


def test_the_stored_baseline_verdict_runs_the_asked_workload_too(calls):
    gate.run_configured(options(perf_workload={"logprobs": False}), THIRD_PARTY)
    assert calls["gate"]["perf_workload"] == TrialWorkload(logprobs=False) and calls["gate"]["calibrate"] is True
    gate.run_configured(options(), THIRD_PARTY)
    assert calls["gate"]["perf_workload"] == gate.PERF_WORKLOAD  # the default: stored baselines still apply


def test_perf_workload_option_is_checked_at_startup():
    assert _perf_workload(None) is None
    assert _perf_workload('{"concurrency": [1, 2], "logprobs": false}') == {"concurrency": [1, 2], "logprobs": False}
    for bad in ('{"logprob": false}', '[1]', '{"logprobs": "no"}', '{"concurrency": 1}', '{"max_tokens": 1}',
                'not json'):
        with pytest.raises(pytest.UsageError, match="--perf-workload"):
            _perf_workload(bad)


def model_quality_run(options: DriverOptions, target: str = "t") -> RunResult:
    """A run in which the model fails a task oracle (it cannot echo its nonce), alone and under load alike."""
    return RunResult(options, target, 0.0, 1.0, failures=[(0.0, Failure("nonce-echo", 0, 0, "no nonce", "Hi"))])


def test_an_ab_gate_calibrates_so_model_quality_does_not_fail_it(monkeypatch):
    runs: list[DriverOptions] = []

    def run_driver(target, driver_options, progress=True, on_request_done=None):
        runs.append(driver_options)
        return model_quality_run(driver_options)

    def ab_trials(candidate, baseline, workload, tolerance, min_pairs, max_pairs):
        return TrialsOutcome("ab", OK, [], [], tolerance)

    monkeypatch.setattr(gate, "run_driver", run_driver)
    monkeypatch.setattr(gate.perf_trials, "ab_trials", ab_trials)
    driver = DriverOptions(sessions=2, turns=1, generic_prompts=True)
    calibrated = gate.run_ab(THIRD_PARTY, THIRD_PARTY, driver, 0.2, pairs=3, progress=False, calibrate=True)
    assert calibrated.passed, calibrated.failures
    assert [r.concurrency for r in runs] == [1, None] and all(r.keep_going for r in runs)  # alone, then under load
    assert calibrated.summary["calibration"]["failed_alone"]["nonce-echo"]["label"] == "model quality"
    assert calibrated.summary["ab"]["status"] == OK and any("model quality" in n for n in calibrated.notes)
    plain = gate.run_ab(THIRD_PARTY, THIRD_PARTY, driver, 0.2, pairs=3, progress=False)
    assert plain.failures and plain.failures[0].startswith("candidate: [nonce-echo]")
