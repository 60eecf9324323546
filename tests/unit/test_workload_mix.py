"""The gate's workload mix (canary/workload.py), the stop-string oracle, the golden store's logprob
check and its token-only fallback, and the seeded-replay rule of the load-vs-solo oracle: each check
shown passing on good data and failing on a planted defect."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from canary.driver import DriverOptions, RunResult
from canary.gate import GateOutcome, check_golden
from canary.oracles.golden import Transcript, logprob_drift, read_store, write_store
from canary.oracles.stop_strings import check_stop_string
from canary.oracles.turn import Turn
from canary.scenarios import make_scenario
from canary.workload import (
    MULTIBYTE_NOTES,
    choose_stop,
    multibyte_messages,
    plan_session,
    sampled_request,
)
from tests.unit.test_differential import FakeClient, record, run_check, tops

pytestmark = pytest.mark.unit

MIX = DriverOptions(sampled_ratio=0.5, stop_ratio=0.5, multibyte_ratio=0.5)


def reply(content: str, finish: str = "stop") -> Turn:
    return Turn(0, 1, True, content, [], finish, None, 160)


# ---- the mix ----------------------------------------------------------------------------------------
def test_plan_is_a_function_of_the_seed_and_does_not_depend_on_turns():
    plans = [plan_session(MIX, make_scenario(i, None, False)) for i in range(40)]
    assert plans == [plan_session(MIX, make_scenario(i, None, False)) for i in range(40)]
    assert any(p.sampled_turn is not None for p in plans) and any(p.sampled_turn is None for p in plans)
    # A run cut to 2 turns keeps every probe of those turns (its requests number as the full run's do).
    for i, full in enumerate(plans):
        short = plan_session(MIX, make_scenario(i, 2, False))
        for name in ("sampled_turn", "stop_turn", "multibyte_turn"):
            want = getattr(full, name)
            assert getattr(short, name) == (want if want is not None and want < 2 else None)
    assert all(p.stop_turn is None for p in (plan_session(DriverOptions(), make_scenario(i, None, False))
                                             for i in range(40)))


def test_stop_string_is_cut_from_the_answer_past_its_start():
    answer = "[ABC123] Paris: 12 degrees celsius, sunny."
    mix = plan_session(MIX, make_scenario(0, None, False))
    stop = choose_stop(answer, mix, 1)
    assert stop and stop in answer and answer.find(stop) > 0
    assert stop == choose_stop(answer, mix, 1)
    assert choose_stop("short", mix, 1) is None


def test_sampled_request_is_seeded_temperature_and_top_p():
    mix = plan_session(MIX, make_scenario(3, None, False))
    body = sampled_request({"temperature": 0.0, "seed": 1}, mix, 2)
    assert body["temperature"] > 0 and 0 < body["top_p"] < 1 and body["seed"] != 1
    assert body == sampled_request({"temperature": 0.0, "seed": 1}, mix, 2)


def test_multibyte_probe_carries_utf8_in_the_user_turn_and_tool_results():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "old"},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "tool", "tool_call_id": "c", "content": json.dumps({"temperature": 3})}]
    mix = plan_session(MIX, make_scenario(1, None, False))
    out = multibyte_messages(messages, mix, 0)
    assert messages[3]["content"] == "Weather in Oslo?", "the conversation itself is not changed"
    assert out[1] == messages[1] and out[3]["content"].startswith("Weather in Oslo? (")
    assert any(note in out[3]["content"] for note in MULTIBYTE_NOTES)
    tool = json.loads(out[5]["content"])
    assert tool["temperature"] == 3 and tool["note"] in MULTIBYTE_NOTES
    assert "\\u" not in out[5]["content"], "kept as UTF-8, not escaped"
    assert any(ord(ch) > 0xFFFF for note in MULTIBYTE_NOTES for ch in note), "4-byte characters included"
    assert any("\u0301" in note for note in MULTIBYTE_NOTES) and any("\u200d" in note for note in MULTIBYTE_NOTES)


# ---- the stop-string oracle ----------------------------------------------------------------------
def test_stop_string_oracle_passes_the_cut_answer_and_fails_a_kept_or_late_stop():
    answer = "[N] Oslo: 3 degrees celsius, windy."
    assert check_stop_string(reply("[N] Oslo: 3 "), answer, "degrees") == []
    kept = check_stop_string(reply("[N] Oslo: 3 degrees"), answer, "degrees")
    assert kept and kept[0].oracle == "stop-string" and "in the reply" in kept[0].message
    late = check_stop_string(reply("[N] Oslo: 3 degr", finish="stop"), answer, "rees")
    assert late and "!=" in late[0].message
    assert "finish_reason 'length'" in check_stop_string(reply("[N] Oslo: 3 ", "length"), answer, "degrees")[0].message


# ---- golden logprobs -----------------------------------------------------------------------------
def transcript(logprobs, tokens=(1, 2, 3)):
    return Transcript("session-1-req-0", list(tokens), [[(t, lp)] for t, lp in zip(tokens, logprobs)],
                      logprobs=list(logprobs))


def test_logprob_drift_finds_the_first_moved_token_within_the_matched_prefix():
    golden = transcript([-0.1, -0.2, -0.3])
    assert logprob_drift(golden, transcript([-0.1, -0.2, -0.3]), 5e-5) is None
    drift = logprob_drift(golden, transcript([-0.1, -0.20035, -0.3]), 5e-5)
    assert drift is not None and drift.position == 1 and drift.max_diff == pytest.approx(3.5e-4)
    assert "every token up to here matched" in drift.describe()
    assert logprob_drift(golden, transcript([-0.1, -0.20035, -0.3]), 5e-5, upto=1) is None
    assert logprob_drift(golden, transcript([-0.1, float("nan"), -0.3]), 5e-5) is not None
    assert logprob_drift(Transcript("s", [1], [[(1, -0.1)]]), transcript([-0.1]), 5e-5) is None, "none recorded"


def golden_run(tmp_path, store_meta, golden_logprobs, run_logprobs):
    path = tmp_path / "store.jsonl"
    write_store(path, store_meta, [transcript(golden_logprobs)])
    req = SimpleNamespace(transcript=transcript(run_logprobs), aborted=False)
    result = RunResult(DriverOptions(sessions=1), "t", 0.0, 1.0, requests=[req])  # type: ignore[list-item]
    outcome = GateOutcome()
    check_golden(result, path, False, {"commit": "x"}, outcome, 0.05)
    return outcome


def test_golden_check_fails_moved_logprobs_that_a_token_only_check_passes(tmp_path):
    moved = [-0.1, -0.20035, -0.3]
    outcome = golden_run(tmp_path, {"logprob_atol": 5e-5}, [-0.1, -0.2, -0.3], moved)
    assert [f.split("]")[0] + "]" for f in outcome.failures] == ["[golden-logprob]"]
    assert outcome.summary["golden"]["logprobs_checked"] == 1
    # The same run against a store written before logprobs were kept: tokens only, with a note.
    old = golden_run(tmp_path, {}, [-0.1, -0.2, -0.3], moved)
    assert old.passed and any("compares tokens only" in n for n in old.notes)
    assert old.summary["golden"]["logprob_atol"] is None


def test_store_without_logprobs_reads(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps({"metadata": {"commit": "c"}}) + "\n"
                    + json.dumps({"scenario": "s", "tokens": [1], "top_logprobs": [[[1, -0.1]]], "extra": {}}) + "\n")
    meta, loaded = read_store(path)
    assert "logprob_atol" not in meta and list(loaded["s"].logprobs) == []


def test_recording_writes_the_tolerance_and_the_logprobs(tmp_path):
    path = tmp_path / "new.jsonl"
    req = SimpleNamespace(transcript=transcript([-0.1, -0.2, -0.3]), aborted=False)
    result = RunResult(DriverOptions(sessions=1), "t", 0.0, 1.0, requests=[req])  # type: ignore[list-item]
    check_golden(result, path, True, {"commit": "x"}, GateOutcome(), 0.05, logprob_atol=5e-5)
    meta, loaded = read_store(path)
    assert meta["logprob_atol"] == 5e-5 and list(loaded["session-1-req-0"].logprobs) == [-0.1, -0.2, -0.3]


# ---- seeded replays ------------------------------------------------------------------------------
def test_a_seeded_sample_must_replay_exactly_even_where_a_greedy_one_may_near_tie():
    # Under load both requests produced a, z with b 0.01 nats behind z; alone, a, b with z 0.01 behind b:
    # a near-tie flipped. Benign for the greedy request, not for the seeded draw.
    greedy, sampled = record(0, 0, tokens=("a", "z")), record(1, 0, tokens=("a", "z"), temperature=0.8)
    for r in (greedy, sampled):
        r.transcript = Transcript(r.transcript.scenario, ["a", "z"], tops(["a", "z"], alt="b", gap=0.01))
    answers = {r.request["messages"][0]["content"]: ["a", "b"] for r in (greedy, sampled)}
    outcome = run_check([greedy, sampled], FakeClient(answers, gap=0.01), sample=2, near_tie=0.05)
    summary = outcome.summary["differential"]
    assert summary["benign_near_ties"] == 1 and summary["failed"] == 1
    assert "session 1" in outcome.failures[0] and "seeded sample" in outcome.failures[0]
