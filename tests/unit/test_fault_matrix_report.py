"""The fault matrix's own verdicts, with fake gates: a gate that passes with the fault on is a miss,
a crash or a failure for another reason is never a catch, a GPU gate without --gpu is "not run"
and counted apart, and any failure of a clean run is an alarm."""

from __future__ import annotations

import json

import pytest

from canary.faults.matrix import (
    CAUGHT,
    ERROR,
    MISSED,
    NOT_RUN,
    Detector,
    GateResult,
    render_table,
    run_clean,
    run_matrix,
    to_json,
)

pytestmark = pytest.mark.unit


def gate(failures_with_fault: list[str], failures_clean: list[str] = (), crash: Exception | None = None):
    calls = []

    def run(faults, seed, workdir):
        calls.append((faults, seed))
        if crash is not None:
            raise crash
        return GateResult(list(failures_with_fault if faults else failures_clean), 0.5, 0.1)

    run.calls = calls
    return run


def fires_on(tag):
    return lambda line: line.startswith(tag)


def matrix(registry, clean_runs=0, gpu=False, tmp_path=None):
    return run_matrix(registry, list(registry), clean_runs=clean_runs, gpu=gpu, workdir=tmp_path)


def test_a_gate_that_passes_with_the_fault_on_is_a_miss(tmp_path):
    always_passes = Detector("blind gate", gate([]), fires_on("[oracle]"))
    report = matrix({"some-fault": (always_passes,)}, tmp_path=tmp_path)
    assert [r.status for r in report.rows] == [MISSED]
    assert report.fault_status("some-fault") == MISSED
    assert report.score == {"caught": 0, "run": 1, "not_run": 0, "total": 1, "mutation_score": 0.0}
    assert not report.ok
    assert "| some-fault | blind gate | missed |" in render_table(report)


def test_a_gate_that_fires_for_its_reason_is_a_catch(tmp_path):
    detector = Detector("good gate", gate(["[oracle] wrong answer in session 3", "[other] too"]), fires_on("[oracle]"))
    report = matrix({"some-fault": (detector,)}, tmp_path=tmp_path)
    row = report.rows[0]
    assert (row.status, row.message) == (CAUGHT, "[oracle] wrong answer in session 3")
    assert row.fired == ("[oracle]",)  # only the lines that fired for the gate's reason
    assert (row.seconds, row.setup_s) == (0.5, 0.1)
    assert report.ok and report.score["mutation_score"] == 1.0


def test_a_crash_or_a_failure_for_another_reason_is_not_a_catch(tmp_path):
    crashes = Detector("crashing gate", gate([], crash=RuntimeError("server died\ntraceback...")), fires_on("[oracle]"))
    unrelated = Detector("wrong reason", gate(["[perf-regression] tok/s 50% worse"]), fires_on("[oracle]"))
    report = matrix({"a": (crashes,), "b": (unrelated,)}, tmp_path=tmp_path)
    assert [(r.status, r.message) for r in report.rows] == [
        (ERROR, "gate crashed: RuntimeError: server died"),
        (ERROR, "failed for another reason: [perf-regression] tok/s 50% worse")]
    assert report.score["caught"] == 0 and not report.ok


def test_a_fault_is_caught_only_when_every_gate_that_ran_caught_it(tmp_path):
    catches = Detector("g1", gate(["[x] fired"]), fires_on("[x]"))
    misses = Detector("g2", gate([]), fires_on("[y]"))
    report = matrix({"f": (catches, misses)}, tmp_path=tmp_path)
    assert [r.status for r in report.rows] == [CAUGHT, MISSED]
    assert report.fault_status("f") == MISSED and not report.ok


def test_gpu_gates_are_not_run_without_gpu_and_not_counted_as_caught(tmp_path):
    gpu_run = gate(["[gpu] fired"])
    cpu = Detector("cpu gate", gate(["[x] fired"]), fires_on("[x]"))
    gpu = Detector("gpu gate", gpu_run, fires_on("[gpu]"), needs_gpu=True)
    report = matrix({"both": (cpu, gpu), "gpu-only": (gpu,)}, clean_runs=2, tmp_path=tmp_path)
    assert [r.status for r in report.rows] == [CAUGHT, NOT_RUN, NOT_RUN]
    assert report.fault_status("both") == CAUGHT and report.fault_status("gpu-only") == NOT_RUN
    assert report.score == {"caught": 1, "run": 1, "not_run": 1, "total": 2, "mutation_score": 1.0}
    assert gpu_run.calls == [], "a GPU gate must not be called without --gpu"
    assert [c.status for c in report.clean] == ["ran", NOT_RUN]
    with_gpu = matrix({"gpu-only": (gpu,)}, gpu=True, tmp_path=tmp_path)
    assert with_gpu.rows[0].status == CAUGHT


def test_a_fault_with_no_gate_is_a_miss(tmp_path):
    report = matrix({"orphan": ()}, tmp_path=tmp_path)
    assert (report.rows[0].status, report.rows[0].message) == (MISSED, "no gate registered for this fault")
    assert not report.ok


def test_clean_runs_use_each_gate_once_per_seed_and_count_every_failure_as_an_alarm(tmp_path):
    shared_run = gate(["[x] fired"])
    shared = Detector("shared gate", shared_run, fires_on("[x]"))
    report = matrix({"f1": (shared,), "f2": (shared,)}, clean_runs=3, tmp_path=tmp_path)
    assert [c.gate for c in report.clean] == ["shared gate"], "one clean series per distinct gate"
    assert [call for call in shared_run.calls if call[0] == ()] == [((), 0), ((), 1), ((), 2)]
    assert report.clean_alarms == 0 and report.ok

    def flaky(faults, seed, workdir):
        return GateResult(["[golden] diverged"] if seed == 1 else [], 1.0)

    row = run_clean(Detector("flaky", flaky, fires_on("[x]")), 3, gpu=False, workdir=tmp_path)
    assert (row.runs, row.alarms, row.messages) == (3, 1, ["seed 1: [golden] diverged"])
    crash = run_clean(Detector("crash", gate([], crash=OSError("port in use")), fires_on("[x]")), 2, gpu=False,
                      workdir=tmp_path)
    assert crash.alarms == 2 and crash.messages[0] == "seed 0: gate crashed: OSError: port in use"


def test_a_clean_alarm_fails_the_matrix_even_with_every_fault_caught(tmp_path):
    detector = Detector("noisy gate", gate(["[x] fired"], failures_clean=["[x] fired on clean"]), fires_on("[x]"))
    report = matrix({"f": (detector,)}, clean_runs=1, tmp_path=tmp_path)
    assert report.score["mutation_score"] == 1.0
    assert report.clean_alarms == 1 and not report.ok
    payload = json.loads(json.dumps(to_json(report, {"commit": "abc"})))
    assert payload["ok"] is False and payload["commit"] == "abc" and payload["clean"][0]["alarms"] == 1


def test_a_gate_whose_package_is_missing_is_not_run_never_an_error(tmp_path):
    """The PD gate on a machine without Mooncake (the GPU image): "not run" with the reason, like a GPU
    gate without --gpu; a gate that would crash for it must not count as an error or an alarm."""
    from canary.faults.matrix import NOT_RUN, Detector, run_clean, run_detector

    def crash(faults, seed, workdir):
        raise AssertionError("must not run")

    gate = Detector("needs a package", crash, lambda line: True, unavailable=lambda: "no such engine here")
    row = run_detector("pd-kv-corrupt", gate, gpu=True, workdir=tmp_path)
    assert row.status == NOT_RUN and "no such engine here" in row.message
    clean = run_clean(gate, 3, gpu=True, workdir=tmp_path)
    assert clean.status == NOT_RUN and clean.alarms == 0
