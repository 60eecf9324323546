"""The load-vs-solo differential oracle (canary/oracles/differential.py) against the embedded runtime: a
fault that corrupts only under load trips it with golden transcripts off, and a clean run is exact.

Golden transcripts are switched off the way the gate switches them off for any server it did not
start (`Target.embedded` False): the oracle must stand on its own, as it does for SGLang or vLLM.
`overlap-stale-token` (with --overlap) corrupts a request alone just as under load, and `stream-race`
changes nothing on the CPU's in-order stream executor, so neither belongs here (measured: 16/16
and 24/24 replays equal; their own gates are in canary/faults/detectors.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from canary.driver import DriverOptions
from canary.gate import run_gate
from canary.oracles.differential import DEFAULT_SAMPLE, TAG
from canary.targets import embedded_server
from runtime.config import DEFAULT_MODEL

pytestmark = pytest.mark.e2e

SMALL = DriverOptions(sessions=16, turns=2, stream_ratio=0.5, max_tokens=160)


def test_kv_slot_reuse_trips_the_differential_with_golden_off(tmp_path):
    with embedded_server(DEFAULT_MODEL, faults=["kv-slot-reuse"], log_dir=tmp_path) as target:
        outcome = run_gate(dataclasses.replace(target, embedded=False), SMALL, progress=False)
    assert any("golden-transcript oracle skipped" in note for note in outcome.notes)
    result = outcome.summary["differential"]
    assert not result["exact"], "a target the gate did not start gets the near-tie rule by default"
    lines = [line for line in outcome.failures if line.startswith(TAG)]
    assert result["failed"] == len(lines) >= 1, outcome.failures
    assert all(" session " in line and "first divergence at token" in line for line in lines), lines


def test_clean_runtime_is_exact_under_load(tmp_path):
    with embedded_server(DEFAULT_MODEL, log_dir=tmp_path) as target:
        outcome = run_gate(target, SMALL, progress=False)
    result = outcome.summary["differential"]
    assert result["exact"], "the embedded runtime is batch-invariant: exact mode by default"
    assert not [line for line in outcome.failures if line.startswith(TAG)]
    assert result["compared"] == result["equal"] == DEFAULT_SAMPLE and result["benign_near_ties"] == 0
