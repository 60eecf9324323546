"""`python -m canary faults`: the registry covers every runtime fault, and the CLI's exit status and
output follow the matrix's verdict (fake gates stand in for the real ones here)."""

from __future__ import annotations

import json

import pytest

from canary.__main__ import main
from canary.faults import detectors as fault_detectors
from canary.faults.matrix import Detector, GateResult
from runtime.faults import KNOWN_FAULTS

pytestmark = pytest.mark.unit


def test_every_runtime_fault_has_a_gate_and_every_gate_a_runtime_fault():
    assert set(fault_detectors.DETECTORS) == set(KNOWN_FAULTS)
    assert all(fault_detectors.DETECTORS[name] for name in KNOWN_FAULTS)


def test_every_gate_names_the_oracles_it_expects():
    # tests/e2e/test_fault_matrix.py asserts one of `oracles` fired: an empty tuple would fail it there.
    for fault, detectors in fault_detectors.DETECTORS.items():
        for detector in detectors:
            assert detector.oracles, f"{fault} via {detector.gate}: no expected oracle"
            assert all(tag.startswith("[") and tag.endswith("]") for tag in detector.oracles), detector.oracles


def test_canary_gate_counts_correctness_oracles_not_perf():
    fires = fault_detectors.CANARY_GATE.fires_for
    assert fires("[json-parse] session 0 turn 0: ...") and fires("[golden] session-5-req-2 ...")
    assert not fires("[perf-regression] output_tok_s: ...") and not fires("Traceback (most recent call last)")


def fake(failures_with_fault, failures_clean=()):
    def run(faults, seed, workdir):
        return GateResult(list(failures_with_fault if faults else failures_clean), 1.25, 0.5)

    return Detector("fake gate", run, lambda line: line.startswith("[fake]"))


@pytest.mark.parametrize("detector, status, code", [
    (fake(["[fake] fired"]), "caught", 0),
    (fake([]), "missed", 1),
    (fake(["[fake] fired"], failures_clean=["[fake] fired on clean"]), "caught", 1),
])
def test_cli_exit_status_and_json_follow_the_verdict(monkeypatch, capsys, detector, status, code):
    monkeypatch.setattr(fault_detectors, "DETECTORS", {"slow-step": (detector,)})
    assert main(["faults", "--only", "slow-step", "--clean-runs", "2", "--json"]) == code
    payload = json.loads(capsys.readouterr().out)
    assert payload["faults"] == {"slow-step": status}
    assert payload["ok"] is (code == 0)
    assert payload["command"] == "python -m canary faults --json --only slow-step --clean-runs 2"
    assert payload["rows"][0]["seconds"] == 1.25 and len(payload["clean"][0]["seconds"]) == 2


def test_cli_table_names_the_missed_fault(monkeypatch, capsys):
    monkeypatch.setattr(fault_detectors, "DETECTORS", {"slow-step": (fake([]),)})
    assert main(["faults", "--only", "slow-step", "--clean-runs", "0"]) == 1
    out = capsys.readouterr().out
    assert "| slow-step | fake gate | missed | 1.2 | gate passed with the fault on |" in out
    assert "mutation score: 0/1 faults run caught (0%)" in out and "verdict: FAIL" in out


def test_cli_rejects_an_unknown_fault(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["faults", "--only", "no-such-fault"])
    assert exit_.value.code == 2


@pytest.mark.parametrize("writes_log", [False, True])
def test_a_failed_matrix_keeps_its_logs_and_only_its_logs(monkeypatch, tmp_path, capsys, writes_log):
    """A failed run keeps the work directory a gate wrote its logs into (and names it); one whose gates
    wrote nothing leaves no empty directory behind (these failing runs used to pile up in /tmp)."""
    def run(faults, seed, workdir):
        if writes_log:
            (workdir / "server.log").write_text("stack frames")
        return GateResult([], 0.1, 0.1)  # the fault goes unnoticed: the matrix fails

    monkeypatch.setattr(fault_detectors, "DETECTORS", {"slow-step": (Detector("fake gate", run, lambda _: True),)})
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert main(["faults", "--only", "slow-step", "--clean-runs", "0"]) == 1
    left = list(tmp_path.glob("canary-faults-*"))
    assert len(left) == (1 if writes_log else 0), left
    assert ("logs kept in" in capsys.readouterr().err) is writes_log
