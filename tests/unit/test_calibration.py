"""Calibration (canary/calibration.py): what a model fails alone is model quality, not corruption;
what fails only under load is corruption, and so is any load output that differs from the same
request's output alone. Synthetic results for the split, and a whole calibrated gate against an
httpx MockTransport "server" whose model cannot do the task and which corrupts answers only while
two or more requests are in flight (the negative controls)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

from canary import calibration
from canary.driver import DriverOptions, RequestRecord, RunResult, SessionDriver
from canary.gate import GateOutcome, run_gate
from canary.oracles.golden import Transcript
from canary.oracles.turn import Failure, Turn
from canary.targets import Target

pytestmark = pytest.mark.unit


# ---- the split, on synthetic results ---------------------------------------------------------------
def result(failures=(), requests=(), sessions=4) -> RunResult:
    return RunResult(DriverOptions(sessions=sessions), "t", 0.0, 1.0, requests=list(requests),
                     failures=[(0.0, f) for f in failures])


def fail(oracle: str, session: int, turn: int = 1) -> Failure:
    return Failure(oracle, session, turn, "planted", "")


def apply(solo, load, near_tie=0.05) -> GateOutcome:
    outcome = GateOutcome()
    calibration.apply(solo, load, outcome, near_tie=near_tie)
    return outcome


def test_a_task_oracle_that_fails_alone_is_model_quality_not_corruption():
    solo = result([fail("nonce-echo", 0), fail("nonce-echo", 1), fail("stream-usage", 1)])
    load = result([fail("nonce-echo", 0, turn=2), fail("nonce-echo", 1), fail("stream-usage", 1)])
    outcome = apply(solo, load)
    assert outcome.passed, outcome.failures
    alone = outcome.summary["calibration"]["failed_alone"]
    assert alone["nonce-echo"] == {"label": "model quality", "scenarios": 2, "load_failures_excused": 2}
    assert alone["stream-usage"]["label"] == "server protocol, also alone"
    assert any("nonce-echo failed alone in 2/4 scenarios (model quality)" in n for n in outcome.notes)


def test_negative_control_what_fails_only_under_load_is_corruption():
    """The same oracle in a scenario where it passed alone, and a protocol oracle that never failed alone."""
    solo = result([fail("nonce-echo", 0)])
    load = result([fail("nonce-echo", 0), fail("nonce-echo", 3), fail("stream-done", 0)])
    outcome = apply(solo, load)
    assert sorted(line.split("]")[0] + "]" for line in outcome.failures) == ["[nonce-echo]", "[stream-done]"]
    assert "session 3" in outcome.failures[0] and "session 0" in outcome.failures[1]


def test_integrity_oracles_are_never_calibrated_away():
    solo = result([fail("cross-session-bleed", 2), fail("http-status", 1)])
    load = result([fail("cross-session-bleed", 2)])
    outcome = apply(solo, load)
    assert len(outcome.failures) == 3, outcome.failures
    assert sum(line.startswith("alone (calibration run): [") for line in outcome.failures) == 2
    assert calibration.label("cross-session-bleed") is None and calibration.label("session-error") is None


def record(session: int, hop: int, tokens: list[str], content: str | None = None, top_gap: float = 2.0,
           body: dict | None = None, aborted: bool = False) -> RequestRecord:
    top = [[(t, -0.1), ("zz", -0.1 - top_gap)] for t in tokens]
    turn = Turn(session, hop, False, content if content is not None else "".join(tokens), [], "stop", None, 16,
                list(tokens))
    return RequestRecord(session, hop, False, aborted, 0.0, None, 0.0, len(tokens), [], turn,
                         Transcript(f"s{session}-req-{hop}", list(tokens), top),
                         request=body or {"messages": [{"role": "user", "content": f"{session}:{hop}"}]})


def test_solo_reference_equal_outputs_pass():
    solo = result(requests=[record(0, 0, ["a", "b"]), record(1, 0, ["c"])])
    load = result(requests=[record(0, 0, ["a", "b"]), record(1, 0, ["c"])])
    ref = calibration.compare_with_solo(solo, load, 0.05)
    assert (ref["compared"], ref["equal"], ref["failures"]) == (2, 2, [])


def test_negative_control_solo_reference_text_changed_tokens_kept():
    """A digit flipped in the text in flight, logprobs untouched: no token oracle can see it."""
    solo = result(requests=[record(0, 0, ["Total", " 42"])])
    load = result(requests=[record(0, 0, ["Total", " 42"], content="Total 43")])
    ref = calibration.compare_with_solo(solo, load, 0.05)
    assert ref["failed"] == 1 and "the same tokens as alone but another output" in ref["failures"][0]
    assert "'Total 43'" in ref["failures"][0] and ref["failures"][0].startswith(calibration.TAG)


def test_negative_control_solo_reference_swapped_tokens_fail_near_ties_do_not():
    solo = result(requests=[record(0, 0, ["a", "b", "c"]), record(1, 0, ["x", "y"], top_gap=0.01)])
    load = result(requests=[record(0, 0, ["a", "c", "b"]), record(1, 0, ["x", "zz"], top_gap=0.01)])
    # Session 1: solo's runner-up "zz" is 0.01 nats behind and under load "zz" won: a near-tie, benign
    # unless exact; load's top-k is built the same way, so "y" is missing from it (not benign either way).
    load.requests[1].transcript.top_logprobs[1] = [("zz", -0.1), ("y", -0.11)]
    ref = calibration.compare_with_solo(solo, load, 0.05)
    assert (ref["failed"], ref["benign_near_ties"]) == (1, 1), ref
    assert "session 0 turn 0 request 0" in ref["failures"][0] and "token 1" in ref["failures"][0]
    exact = calibration.compare_with_solo(solo, load, None)
    assert exact["failed"] == 2


def test_solo_reference_compares_only_requests_with_the_same_context():
    solo = result(requests=[record(0, 0, ["a"]), record(0, 1, ["b"], aborted=True)])
    load = result(requests=[record(0, 0, ["q"], body={"messages": [{"role": "user", "content": "other"}]}),
                            record(0, 1, ["b"], aborted=True)])
    ref = calibration.compare_with_solo(solo, load, 0.05)
    assert (ref["compared"], ref["no_counterpart"], ref["failures"]) == (0, 1, [])


# ---- keep_going and a calibrated gate against a mock server --------------------------------------
class MockServer:
    """An OpenAI-compatible chat endpoint (non-streamed) whose "model" cannot do the task: it never
    calls a tool, and echoes the session nonce only if `echo_nonce`. It answers with a number
    fixed by the conversation length, with one logprob entry per word. `under_load(answer, body)`,
    if set, rewrites the answer while another request is in flight: a load-dependent corruption."""

    def __init__(self, echo_nonce: bool = False, under_load=None) -> None:
        self.echo_nonce, self.under_load = echo_nonce, under_load
        self.in_flight = self.requests = self.corrupted = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.in_flight += 1
        self.requests += 1
        try:
            await asyncio.sleep(0.002)  # lets the other sessions' requests overlap this one
            nonce = re.search(r"Session nonce: (\w+)", body["messages"][0]["content"]).group(1)
            answer = f"I have no tool for that, sorry {len(body['messages'])}."
            answer = f"[{nonce}] {answer}" if self.echo_nonce else answer
            words = answer.split(" ")  # the logprobs are the true answer's, also when it is rewritten
            if self.under_load is not None and self.in_flight >= 2:
                changed = self.under_load(answer, body)
                self.corrupted += changed != answer
                answer = changed
        finally:
            self.in_flight -= 1
        tokens = [w if i == 0 else " " + w for i, w in enumerate(words)]
        content = [{"token": t, "logprob": -0.1, "bytes": None,
                    "top_logprobs": [{"token": t, "logprob": -0.1, "bytes": None},
                                     {"token": "x", "logprob": -3.0, "bytes": None}]} for t in tokens]
        return httpx.Response(200, json={
            "id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop",
                         "logprobs": {"content": content}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": len(tokens), "total_tokens": 7 + len(tokens)}})


@pytest.fixture
def mock_server(monkeypatch):
    """Install a MockServer behind every async openai client; returns a function that sets it."""
    holder = {}
    real = openai.AsyncOpenAI

    async def handler(request):
        return await holder["server"].handle(request)

    monkeypatch.setattr(openai, "AsyncOpenAI", lambda **kw: real(**{
        **kw, "http_client": httpx.AsyncClient(transport=httpx.MockTransport(handler))}))

    def use(server: MockServer) -> Target:
        holder["server"] = server
        return Target("mock", "http://mock.invalid/v1", "weak-model", False)

    return use


OPTIONS = dict(sessions=4, turns=3, stream_ratio=0.0, generic_prompts=True)


def test_keep_going_drives_a_failing_session_through_every_turn(mock_server):
    target = mock_server(MockServer())
    stopped = SessionDriver(target, DriverOptions(**OPTIONS)).run()
    assert len(stopped.requests) == 4, "without keep_going a session ends at its first failure"
    went_on = SessionDriver(target, DriverOptions(**OPTIONS, keep_going=True)).run()
    assert len(went_on.requests) == 12 and {r.turn.turn for r in went_on.requests} == {0, 1, 2}
    assert sorted(status for _, status, _ in went_on.session_ends) == ["failed"] * 4
    assert all("keep_going" in reason for _, _, reason in went_on.session_ends)


def gate(target, **kwargs) -> GateOutcome:
    return run_gate(target, DriverOptions(**OPTIONS, concurrency=4), progress=False, differential_sample=0,
                    perf_trials_min=0, calibrate=True, **kwargs)


def test_a_model_that_cannot_do_the_task_passes_the_calibrated_gate_as_model_quality(mock_server):
    server = MockServer()
    outcome = gate(mock_server(server))
    assert outcome.passed, outcome.failures
    alone = outcome.summary["calibration"]["failed_alone"]
    assert alone["nonce-echo"]["label"] == "model quality" and alone["nonce-echo"]["scenarios"] == 4
    assert alone["required-calls"]["label"] == "model quality"
    ref = outcome.summary["calibration"]["solo_reference"]
    assert ref["compared"] == ref["equal"] == 12
    # Without calibration the same run fails, naming the task oracles: that is what calibration is for.
    raw = run_gate(mock_server(MockServer()), DriverOptions(**OPTIONS), progress=False, differential_sample=0,
                   perf_trials_min=0)
    assert not raw.passed and any(line.startswith("[nonce-echo]") for line in raw.failures)


def test_negative_control_a_digit_flipped_under_load_is_caught(mock_server):
    server = MockServer(under_load=lambda answer, body: re.sub(r"\d+\.$", lambda m: f"{int(m[0][:-1]) + 1}.",
                                                               answer) if len(body["messages"]) > 3 else answer)
    outcome = gate(mock_server(server))
    assert server.corrupted, "the control must really corrupt something"
    assert not outcome.passed
    assert all(line.startswith(calibration.TAG) for line in outcome.failures), outcome.failures
    assert "the same tokens as alone but another output" in outcome.failures[0]


def test_negative_control_a_task_oracle_failing_only_under_load_is_corruption(mock_server):
    """The model echoes its nonce alone (scenario-level pass); under load the echo is lost."""
    echo_all = MockServer(echo_nonce=True, under_load=lambda answer, body: re.sub(r"^\[\w+\] ", "", answer))
    outcome = gate(mock_server(echo_all))
    assert echo_all.corrupted and not outcome.passed
    assert any(line.startswith("[nonce-echo]") for line in outcome.failures), outcome.failures
    assert "nonce-echo" not in outcome.summary["calibration"]["failed_alone"]


def test_summary_line_says_what_was_calibrated():
    from canary.reports import summary_lines

    outcome = apply(result([fail("nonce-echo", 0)]), result([fail("nonce-echo", 0)]))
    text = "\n".join(summary_lines({**outcome.summary, "notes": outcome.notes}, outcome.failures))
    assert "calibration: 4 scenarios alone first" in text and "nonce-echo in 1/4 scenarios (model quality)" in text


def test_solo_options_run_one_session_at_a_time_and_go_on():
    solo = calibration.solo_options(DriverOptions(sessions=8, concurrency=8, processes=2))
    assert (solo.concurrency, solo.processes, solo.keep_going, solo.sessions) == (1, 1, True, 8)


def test_solo_reference_without_tokens_compares_equal_outputs_and_skips_the_rest():
    """An empty answer (EOS first) has no logprob tokens: equal outputs are equal; differing outputs
    without tokens cannot be told from a near-tie, so they are counted, not failed (unless exact)."""
    solo = result(requests=[record(0, 0, [], content=""), record(1, 0, [], content="a")])
    load = result(requests=[record(0, 0, [], content=""), record(1, 0, [], content="b")])
    ref = calibration.compare_with_solo(solo, load, 0.05)
    assert (ref["equal"], ref["no_tokens"], ref["failed"]) == (1, 1, 0)
    assert calibration.compare_with_solo(solo, load, None)["failed"] == 1
