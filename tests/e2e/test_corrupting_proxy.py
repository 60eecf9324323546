"""Gate-level negative controls for issue 17 item 2: responses corrupted in flight between the
harness and the embedded canary server (tests/corrupting_proxy.py) must fail the gate, naming the
oracle that sees the defect, and the defect is planted from the second user turn on (a check
weakened to the first turn of each session would pass). The target behind the proxy is not
`embedded`, so golden transcripts are off: each corruption must be caught by the oracle built for it.
Two harmless rewrites (arguments re-serialized; nothing changed) must pass."""

from __future__ import annotations

import pytest

from canary.driver import DriverOptions
from canary.gate import run_gate
from canary.targets import embedded_server
from runtime.config import DEFAULT_MODEL
from tests import corrupting_proxy as cp

pytestmark = pytest.mark.e2e

# Sessions 1, 4 and 7 make two tool calls in a late turn (their second or third), which the call
# rewrites need; every session answers in late turns.
OPTIONS = dict(sessions=8, turns=3, max_tokens=160)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    with embedded_server(DEFAULT_MODEL, log_dir=tmp_path_factory.mktemp("server")) as server:
        with cp.CorruptingProxy(server.root_url) as proxy:
            proxy.model = server.model
            yield proxy


def gate_through(proxy, rewrite: cp.Rewrite, **options):
    proxy.rewrite = rewrite
    proxy.rewritten = 0
    outcome = run_gate(proxy.target(proxy.model), DriverOptions(**{**OPTIONS, **options}), progress=False)
    return outcome, proxy.rewritten


def fired(outcome) -> dict[str, list[str]]:
    by_oracle: dict[str, list[str]] = {}
    for line in outcome.failures:
        by_oracle.setdefault(line.split("]")[0] + "]", []).append(line)
    return by_oracle


@pytest.mark.parametrize("rewrite, stream_ratio, oracle", [
    (cp.DropLastCall, 0.5, "[required-calls]"),
    (cp.AnswerDigit, 0.5, "[ungrounded-answer]"),
    (cp.ReferenceNonceSwap, 1.0, "[cross-session-bleed]"),
    (cp.DropUsageChunk, 1.0, "[stream-usage]"),
    (cp.DropDone, 1.0, "[stream-done]"),
    (cp.DuplicateCallId, 0.5, "[tool-call-id]"),
    (cp.SparseIndexes, 1.0, "[tool-call-index]"),
    (cp.ControlText, 0.5, "[control-text]"),
    (cp.StreamOnlyWhitespace, 1.0, "[stream-equivalence]"),
    (cp.RepeatCalls, 0.0, "[session-incomplete]"),
    (cp.UnreadableChunk, 1.0, "[session-error]"),
    # The oracles that caught their defects before issue 17, now shown to do so in late turns too.
    (cp.ArgumentDigit, 0.0, "[ungrounded-argument]"),
    (cp.WrongFinishReason, 0.0, "[finish-reason]"),
    (cp.UsageOffByOne, 0.0, "[usage]"),
    (cp.ReplacementCharacter, 0.0, "[gibberish]"),
    (cp.AlteredNonce, 0.0, "[nonce-echo]"),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_corruption_in_flight_fails_the_gate_in_a_late_turn(proxy, rewrite, stream_ratio, oracle):
    outcome, rewritten = gate_through(proxy, rewrite(), stream_ratio=stream_ratio)
    assert rewritten, f"{rewrite.__name__} changed no response: the control proves nothing"
    by_oracle = fired(outcome)
    assert oracle in by_oracle, f"{rewrite.__name__} went unnoticed by {oracle}; fired: {sorted(by_oracle)}"
    # Nothing is rewritten in the first user turn (index 0), so the finding is in a later one
    # (session-error and session-incomplete name the session; they carry turn -1 or the turn).
    if oracle not in ("[session-error]",):
        assert all(" turn 0:" not in line for line in by_oracle[oracle]), by_oracle[oracle]
    ended_failed = outcome.summary["sessions_failed"]
    assert ended_failed >= 1 and outcome.summary["sessions_completed"] + ended_failed == OPTIONS["sessions"]


def test_kv_pages_of_an_external_server_are_checked_or_the_skip_is_said(proxy):
    outcome, _ = gate_through(proxy, cp.KvPagesLeft(), sessions=2, turns=1)
    assert "[kv-leak]" in fired(outcome), outcome.failures
    outcome, _ = gate_through(proxy, cp.NoMetrics(), sessions=2, turns=1)
    assert outcome.passed, outcome.failures
    assert any("leak oracle skipped" in note for note in outcome.notes), outcome.notes


@pytest.mark.parametrize("rewrite", [cp.Rewrite, cp.ReserializeArguments], ids=lambda v: v.__name__)
def test_harmless_rewrites_pass(proxy, rewrite):
    """Nothing changed, or the same arguments serialized differently (stream only, so stream ==
    non-stream compares two spellings of one object): no oracle may fire."""
    outcome, rewritten = gate_through(proxy, rewrite(), stream_ratio=1.0)
    assert rewrite is cp.Rewrite or rewritten
    assert outcome.passed, outcome.failures
    assert outcome.summary["kv_pages_in_use"] == 0.0
