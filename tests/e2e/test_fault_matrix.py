"""The fault matrix (`python -m canary faults`) as tests.

CI form: every fault through its gates once (one test per fault, so xdist can spread them), each
gate naming one of the oracles its detector expects (`Detector.oracles`: kv-slot-reuse and
tool-json-corrupt must fail the canary gate through a correctness oracle listed for them), and every
gate once against the clean runtime; GPU-only gates skip without CUDA (the matrix reports them as
"not run", tests/unit/test_fault_matrix_report.py). About 2.5 CPU-minutes in all, in the `make test`
stage, plus the PD gate's four rows (about 1 minute on two workers; they skip without Mooncake); the
speed fault and its A/B control are marked `timing`, so they run alone.
Long form (slow): the whole CLI with --clean-runs 10 (about 10 minutes on the 2-core CPU).
"""

from __future__ import annotations

import json

import pytest
import torch

from canary.__main__ import main
from canary.faults.detectors import DETECTORS
from canary.faults.matrix import CAUGHT, NOT_RUN, MatrixReport, distinct_gates, render_table, run_clean, run_fault
from runtime.disagg.transfer import unavailable_reason
from runtime.faults import KNOWN_FAULTS, PD_REGISTRY

pytestmark = pytest.mark.e2e

GPU = torch.cuda.is_available()


def gpu_only(detectors) -> bool:
    return all(d.needs_gpu for d in detectors)


PD_GATES = {d.gate for name in PD_REGISTRY for d in DETECTORS[name]}
PD_MISSING = unavailable_reason() is not None  # no Mooncake: the matrix reports the PD rows "not run"
NO_PD = pytest.mark.skipif(PD_MISSING, reason=str(unavailable_reason()))


def marks_for(detectors) -> list:
    # A timed gate (an A/B speed ratio) runs in make test's serial stage: next to another test
    # worker on a 2-core runner, a clean-vs-clean A/B measured 73% apart in CI. A PD gate needs
    # Mooncake's transfer engine (`make install`) and takes 25-55 s a run on the 2-core CPU (four server
    # starts, two 10 s recovery bounds). It runs in the default stage all the same: while its rows were
    # `--run-slow` only, the gate stopped catching pd-abort-leak and nothing showed it (fortieth session).
    return ([pytest.mark.gpu] if gpu_only(detectors) else []) + \
        ([pytest.mark.timing] if any(d.timed for d in detectors) else []) + \
        ([NO_PD] if any(d.gate in PD_GATES for d in detectors) else [])


FAULTS = [pytest.param(name, marks=marks_for(DETECTORS[name]), id=name) for name in KNOWN_FAULTS]
GATES = [pytest.param(d, marks=marks_for((d,)), id=d.gate) for d in distinct_gates(DETECTORS, list(KNOWN_FAULTS))]


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_is_caught_by_its_gates(fault, tmp_path):
    rows = run_fault(fault, DETECTORS[fault], gpu=GPU, workdir=tmp_path)
    report = MatrixReport(rows)
    assert report.fault_status(fault) == CAUGHT, render_table(report)
    for detector, row in zip(DETECTORS[fault], rows, strict=True):
        if row.status != NOT_RUN:
            assert set(row.fired) & set(detector.oracles), \
                f"{fault} via {detector.gate}: fired {row.fired}, expected one of {detector.oracles}"


@pytest.mark.parametrize("detector", GATES)
def test_clean_runtime_raises_no_alarm(detector, tmp_path):
    row = run_clean(detector, 1, gpu=GPU, workdir=tmp_path)
    assert row.runs == 1 and row.alarms == 0, row.messages


@pytest.mark.slow
def test_long_form_matrix_catches_every_fault_with_no_clean_alarm(capsys):
    code = main(["faults", "--json", "--clean-runs", "10", *(["--gpu"] if GPU else [])])
    report = json.loads(capsys.readouterr().out)
    expected_not_run = sum((gpu_only(DETECTORS[name]) and not GPU) or (name in PD_REGISTRY and PD_MISSING)
                           for name in KNOWN_FAULTS)
    assert report["score"]["not_run"] == expected_not_run
    assert report["score"]["caught"] == report["score"]["run"] == len(KNOWN_FAULTS) - expected_not_run, report["rows"]
    assert report["clean_alarms"] == 0, report["clean"]
    assert all(c["runs"] == 10 for c in report["clean"] if c["status"] == "ran")
    assert code == 0
