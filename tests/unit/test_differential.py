"""The load-vs-solo comparison on synthetic tokens and top-k logprobs, the replay sample, and the
gate-side check against a fake client (no server)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from canary.driver import DriverOptions, RequestRecord, RunResult
from canary.gate import GateOutcome
from canary.oracles.differential import TAG, check_load_vs_solo, choose, compare
from canary.oracles.golden import Transcript
from canary.oracles.turn import Turn

pytestmark = pytest.mark.unit


def tops(tokens, alt="z", gap=2.0):
    """Each position: the token at -0.1 and `alt` `gap` nats below it."""
    return [[(t, -0.1), (alt, -0.1 - gap)] for t in tokens]


def test_equal_tokens_pass():
    assert compare(["a", "b", "c"], tops("abc"), ["a", "b", "c"], tops("abc"), near_tie=0.05) is None
    assert compare(["a", "b"], tops("ab"), ["a", "b"], tops("ab"), near_tie=None) is None


def near_tie_pair():
    solo_top = [[("a", -0.1)], [("b", -0.700), ("x", -0.710)], [("c", -0.1)]]
    load_top = [[("a", -0.1)], [("x", -0.702), ("b", -0.709)], [("y", -0.1)]]
    return (["a", "b", "c"], solo_top), (["a", "x", "y"], load_top)


def test_near_tie_divergence_is_benign_by_default():
    (solo, solo_top), (load, load_top) = near_tie_pair()
    m = compare(solo, solo_top, load, load_top, near_tie=0.05)
    assert m.benign and m.position == 1 and (m.solo_token, m.load_token) == ("b", "x")
    assert m.solo_margin == pytest.approx(0.010) and m.load_margin == pytest.approx(0.007)


def test_near_tie_divergence_fails_in_exact_mode():
    (solo, solo_top), (load, load_top) = near_tie_pair()
    m = compare(solo, solo_top, load, load_top, near_tie=None)
    assert not m.benign and m.position == 1 and "exact" in m.reason
    # An exact tie is no excuse either: a deterministic server breaks it the same way every time.
    tie = [[("a", -0.1)], [("b", -0.7), ("x", -0.7)], [("c", -0.1)]]
    assert not compare(solo, tie, load, tie, near_tie=None).benign


def test_wide_margin_divergence_fails_naming_position_tokens_and_margins():
    solo_top = [[("a", -0.1)], [("b", -0.2), ("x", -1.9)]]
    load_top = [[("a", -0.1)], [("x", -0.3), ("b", -1.5)]]
    m = compare(["a", "b"], solo_top, ["a", "x"], load_top, near_tie=0.05)
    assert not m.benign and m.position == 1
    assert m.solo_margin == pytest.approx(1.7) and m.load_margin == pytest.approx(1.2)
    text = m.describe()
    assert "token 1" in text and "'b'" in text and "'x'" in text and "1.7000" in text and "1.2000" in text


def test_logprobs_that_moved_under_load_fail_only_in_exact_mode():
    # Same tokens, one logprob off by 3.5e-4 (an indexer window off by one did that and kept every token).
    solo_top = [[("a", -0.1), ("z", -2.0)], [("b", -0.2), ("z", -1.9)]]
    load_top = [[("a", -0.1), ("z", -2.0)], [("b", -0.20035), ("z", -1.9)]]
    assert compare(["a", "b"], solo_top, ["a", "b"], load_top, near_tie=0.05) is None
    m = compare(["a", "b"], solo_top, ["a", "b"], load_top, near_tie=None)
    assert not m.benign and m.position == 1 and "-0.20035" in m.describe() and "agrees" in m.describe()


def test_one_side_near_tie_only_is_not_benign():
    # The loaded run saw a near-tie, the solo run a clear winner: load moved the logits, not a tie flip.
    solo_top = [[("b", -0.1), ("x", -2.0)]]
    load_top = [[("x", -0.70), ("b", -0.71)]]
    assert not compare(["b"], solo_top, ["x"], load_top, near_tie=0.05).benign


def test_token_outside_the_other_top_k_and_length_differences_fail():
    m = compare(["a", "b"], tops("ab"), ["a", "q"], tops("aq"), near_tie=0.05)
    assert not m.benign and m.solo_margin is None and "top-" in m.reason
    m = compare(["a", "b", "c"], tops("abc"), ["a", "b"], tops("ab"), near_tie=0.05)
    assert not m.benign and m.position == 2 and m.load_token is None


# ---- the sample ----------------------------------------------------------------------------------
def record(session, hop, tokens=("a", "b"), temperature=0.0, aborted=False, streamed=False):
    turn = Turn(session, hop // 2, streamed, "", [], "stop", None, 160, list(tokens), aborted=aborted)
    body = {"model": "m", "messages": [{"role": "user", "content": f"{session}:{hop}"}], "temperature": temperature,
            "seed": 7, "max_tokens": 160, "logprobs": True, "top_logprobs": 5}
    return RequestRecord(session, hop, streamed, aborted, 0.0, None, 1.0, len(tokens), [], turn,
                         Transcript(f"session-{session}-req-{hop}", list(tokens), tops(tokens)), body)


def test_sample_is_deterministic_spread_and_includes_late_turns():
    records = [record(s, h) for s in range(10) for h in range(6)]
    picked = choose(records, 12, seed=3)
    assert picked == choose(records, 12, seed=3) and picked != choose(records, 12, seed=4)
    assert len(picked) == 12 and len({(r.session, r.hop) for r in picked}) == 12
    assert len({r.session for r in picked}) == 10  # round-robin: every session before any twice
    assert sum(r.hop == 5 for r in picked) >= 12 // 3  # every third pick is a session's last request
    assert {r.hop for r in picked} - {5}, "only last turns picked"


def test_sample_takes_every_seeded_sampled_request_and_skips_aborted_ones():
    records = [record(s, h) for s in range(4) for h in range(3)]
    sampled = [record(9, h, temperature=0.8) for h in range(5)]
    aborted = [record(8, 0, aborted=True)]
    picked = choose(records + sampled + aborted, 2, seed=0)
    assert sum(r.session == 9 for r in picked) == 5 and len(picked) == 7
    assert all(not r.aborted for r in picked)
    assert choose(records + sampled, 0, seed=0) == []  # 0 disables, seeded ones included
    assert len(choose(records, 100, seed=0)) == len(records)


def test_request_record_stays_picklable_for_the_driver_pool():
    r = record(1, 2)
    assert pickle.loads(pickle.dumps(r)).request == r.request


# ---- the check, against a fake client ------------------------------------------------------------
class FakeClient:
    """Answers each replay from `answers` (messages content -> tokens); top-2 margin `gap`."""

    def __init__(self, answers, gap=2.0):
        self.answers, self.gap, self.calls = answers, gap, []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, **body):
        self.calls.append(body)
        assert "stream" not in body  # these records were not streamed
        tokens = self.answers[body["messages"][0]["content"]]
        content = [SimpleNamespace(token=t, top_logprobs=[SimpleNamespace(token=t, logprob=-0.1),
                                                          SimpleNamespace(token="z", logprob=-0.1 - self.gap)])
                   for t in tokens]
        return SimpleNamespace(choices=[SimpleNamespace(logprobs=SimpleNamespace(content=content))])

    def close(self):
        pass


def run_check(records, client, **kwargs):
    target = SimpleNamespace(name="fake", client=lambda **_: client)
    result = RunResult(DriverOptions(sessions=4), "fake", 0.0, 1.0, requests=records)
    outcome = GateOutcome()
    check_load_vs_solo(target, result, outcome, **kwargs)
    return outcome


def test_check_counts_equal_replays_and_names_a_divergence():
    records = [record(s, h) for s in range(3) for h in range(2)]
    answers = {r.request["messages"][0]["content"]: ["a", "b"] for r in records}
    answers["2:1"] = ["a", "z"]  # the solo run of session 2's request 1 disagrees, 2 nats apart
    client = FakeClient(answers)
    outcome = run_check(records, client, sample=6)
    assert [c["messages"] for c in client.calls] == [r.request["messages"] for r in records]
    summary = outcome.summary["differential"]
    assert (summary["compared"], summary["equal"], summary["failed"]) == (6, 5, 1)
    assert len(outcome.failures) == 1 and outcome.failures[0].startswith(TAG)
    assert "session 2 turn 0 request 1" in outcome.failures[0] and "token 1" in outcome.failures[0]
    assert run_check(records, FakeClient({**answers, "2:1": ["a", "b"]}), sample=6).passed


def test_check_skips_with_a_note_when_the_target_returns_no_logprobs():
    records = [record(s, 0, tokens=()) for s in range(3)]
    outcome = run_check(records, FakeClient({}), sample=6)
    assert outcome.passed and "differential" not in outcome.summary
    assert any("no logprobs" in note for note in outcome.notes)


def test_requests_the_calibration_run_ran_alone_are_not_replayed_again():
    """With a calibration run, only the requests without a solo counterpart (their context moved under
    load) are replayed; negative control: a divergence in a replayed request still fails."""
    from canary import calibration

    records = [record(s, h) for s in range(3) for h in range(2)]
    solo = RunResult(DriverOptions(sessions=4), "fake", 0.0, 1.0,
                     requests=[r for r in records if r.session != 2])  # session 2 moved under load
    answers = {r.request["messages"][0]["content"]: ["a", "b"] for r in records}
    client = FakeClient(answers)
    outcome = run_check(records, client, sample=6, compared_alone=calibration.has_counterpart(solo))
    assert [c["messages"] for c in client.calls] == [r.request["messages"] for r in records if r.session == 2]
    summary = outcome.summary["differential"]
    assert (summary["compared"], summary["equal"], summary["compared_alone_in_calibration"]) == (2, 2, 4)
    assert outcome.passed
    answers["2:1"] = ["a", "z"]
    failed = run_check(records, FakeClient(answers), sample=6, compared_alone=calibration.has_counterpart(solo))
    assert len(failed.failures) == 1 and "session 2 turn 0 request 1" in failed.failures[0]
