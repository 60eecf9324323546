"""Every oracle passes a clean turn and fires on a planted defect (its negative control)."""

from __future__ import annotations

import pytest

from canary.oracles import (ToolCall, Turn, check_finish_and_usage, check_gibberish, check_nonce,
                            check_stream_equivalence, check_tool_calls)

pytestmark = pytest.mark.unit

SCHEMAS = {"lookup_order": {"type": "object", "properties": {"order_id": {"type": "string"},
                                                             "qty": {"type": "integer", "minimum": 1}},
                            "required": ["order_id", "qty"], "additionalProperties": False}}
NONCE = "N7Q4-ZX81"


def tool_turn(arguments='{"order_id": "N7Q4-ZX81", "qty": 3}', name="lookup_order", **kw):
    base = dict(session=1, turn=2, streamed=False, content="", tool_calls=[ToolCall("call_0", name, arguments)],
                finish_reason="tool_calls", usage={"prompt_tokens": 50, "completion_tokens": 12, "total_tokens": 62},
                max_tokens=64, expects_tool_call=True)
    base.update(kw)
    return Turn(**base)


def answer_turn(content=f"Order {NONCE} ships 3 units.", **kw):
    base = dict(session=1, turn=3, streamed=False, content=content, tool_calls=[], finish_reason="stop",
                usage={"prompt_tokens": 80, "completion_tokens": 9, "total_tokens": 89}, max_tokens=64)
    base.update(kw)
    return Turn(**base)


def oracles_fired(failures):
    return sorted({f.oracle for f in failures})


def test_clean_turns_raise_no_alarm():
    for turn in (tool_turn(), answer_turn()):
        assert check_tool_calls(turn, SCHEMAS) == []
        assert check_nonce(turn, NONCE, lambda: [NONCE, "AAAA-0000"], must_echo=True) == []
        assert check_gibberish(turn) == []
        assert check_finish_and_usage(turn) == []
    assert check_stream_equivalence(tool_turn(streamed=True), tool_turn()) == []


@pytest.mark.parametrize("arguments, oracle", [
    ('{"order_id": "N7Q4-ZX81", "qty": 3', "json-parse"),  # one character dropped
    ('["N7Q4-ZX81", 3]', "json-parse"),
    ('{"order_id": "N7Q4-ZX81", "qty": "3"}', "json-schema"),
    ('{"order_id": "N7Q4-ZX81"}', "json-schema"),
    ('{"order_id": "N7Q4-ZX81", "qty": 3, "extra": 1}', "json-schema"),
])
def test_tool_call_oracles_fire_on_corrupted_arguments(arguments, oracle):
    assert oracles_fired(check_tool_calls(tool_turn(arguments), SCHEMAS)) == [oracle]


def test_unknown_function_fires():
    assert oracles_fired(check_tool_calls(tool_turn(name="lookup_ordr"), SCHEMAS)) == ["known-function"]


def test_nonce_oracles_fire_on_altered_nonce_and_bleed():
    altered = tool_turn('{"order_id": "N7Q4-ZX8l", "qty": 3}')
    assert oracles_fired(check_nonce(altered, NONCE, lambda: [NONCE], must_echo=True)) == ["nonce-echo"]
    bled = answer_turn(f"Order {NONCE} and AAAA-0000 ship.")
    assert oracles_fired(check_nonce(bled, NONCE, lambda: [NONCE, "AAAA-0000"], must_echo=True)) == [
        "cross-session-bleed"]


def test_stream_equivalence_fires_on_any_difference():
    streamed = tool_turn('{"order_id": "N7Q4-ZX81", "qty": 4}', streamed=True)
    assert oracles_fired(check_stream_equivalence(streamed, tool_turn())) == ["stream-equivalence"]


@pytest.mark.parametrize("content, oracle", [
    ("Order \ufffd ships", "gibberish"),
    ("Order \x07 ships", "gibberish"),
    ("ships ships ships ships ships ships ships ships", "repetition"),
])
def test_gibberish_and_repetition_fire(content, oracle):
    assert oracle in oracles_fired(check_gibberish(answer_turn(content)))


def test_finish_and_usage_oracles_fire():
    no_calls = tool_turn(tool_calls=[])
    assert "finish-reason" in oracles_fired(check_finish_and_usage(no_calls))
    truncated = tool_turn(tool_calls=[], finish_reason="length",
                          usage={"prompt_tokens": 5, "completion_tokens": 64, "total_tokens": 69})
    assert "max-tokens-no-tool-call" in oracles_fired(check_finish_and_usage(truncated))
    bad_total = answer_turn(usage={"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 15})
    assert oracles_fired(check_finish_and_usage(bad_total)) == ["usage"]
    miscounted = answer_turn(tokens=["a"] * 8)
    assert oracles_fired(check_finish_and_usage(miscounted)) == ["usage"]


def test_grounding_oracle_passes_copied_values_and_fires_on_a_flipped_character():
    from canary.oracles import check_grounded_arguments

    conversation = "Where is order N7Q4-ZX81? I need 3 of them."
    assert check_grounded_arguments(tool_turn(), conversation) == []
    flipped = tool_turn('{"order_id": "N7Q4-ZX80", "qty": 3}')
    assert oracles_fired(check_grounded_arguments(flipped, conversation)) == ["ungrounded-argument"]
    off_by_one = tool_turn('{"order_id": "N7Q4-ZX81", "qty": 2}')
    assert oracles_fired(check_grounded_arguments(off_by_one, conversation)) == ["ungrounded-argument"]
