"""Negative controls for the gate: each injected fault must make it fail, naming the right oracle.

These run a reduced workload (fewer sessions and turns than the 80-session gate) so `make test`
stays inside its budget; each starts its own embedded server with the fault switched on.
`slow-step` (a speed fault) and its clean-vs-clean A/B control are in tests/e2e/test_fault_matrix.py,
marked `timing` so they run alone.
"""

from __future__ import annotations

import pytest

from canary.driver import DriverOptions
from canary.gate import run_gate
from canary.targets import embedded_server
from runtime.config import DEFAULT_MODEL

pytestmark = pytest.mark.e2e

SMALL = DriverOptions(sessions=16, turns=2, stream_ratio=0.5, max_tokens=160)


def gate_with_fault(fault: str, tmp_path, options: DriverOptions = SMALL):
    with embedded_server(DEFAULT_MODEL, faults=[fault], log_dir=tmp_path) as target:
        return run_gate(target, options, progress=False)


@pytest.mark.parametrize("fault, oracles", [
    ("tool-json-corrupt", ("[json-parse]", "[json-schema]", "[stream-equivalence]", "[golden]", "[nonce-echo]")),
    ("kv-slot-reuse", ("[golden]", "[nonce-echo]", "[cross-session-bleed]", "[json-schema]", "[gibberish]",
                       "[repetition]", "[stream-equivalence]", "[json-parse]", "[known-function]")),
])
def test_fault_fails_the_gate_naming_an_oracle(fault, oracles, tmp_path):
    outcome = gate_with_fault(fault, tmp_path)
    assert not outcome.passed, f"{fault} went unnoticed"
    fired = {line.split("]")[0] + "]" for line in outcome.failures if line.startswith("[")}
    assert fired & set(oracles), f"{fault}: unexpected oracles {fired}"
