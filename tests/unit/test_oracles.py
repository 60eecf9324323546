"""Every oracle passes a clean turn and fires on a planted defect (its negative control)."""

from __future__ import annotations

import pytest

from canary.oracles.turn import (
    ToolCall,
    Turn,
    check_finish_and_usage,
    check_gibberish,
    check_nonce,
    check_stream_equivalence,
    check_tool_calls,
)

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


def test_usage_may_count_no_token_for_an_empty_reply_only():
    """A model whose first token ends its turn gives an empty reply; a server that does not count the
    EOS reports 0 completion tokens, which is no corruption. Text or calls with 0 tokens still are."""
    zero = {"prompt_tokens": 80, "completion_tokens": 0, "total_tokens": 80}
    assert check_finish_and_usage(answer_turn(content="", usage=zero)) == []
    assert oracles_fired(check_finish_and_usage(answer_turn(usage=zero))) == ["usage"]
    assert oracles_fired(check_finish_and_usage(answer_turn(content="", finish_reason="length", usage=zero))) \
        == ["usage"]


def test_grounding_oracle_passes_copied_values_and_fires_on_a_flipped_character():
    from canary.oracles.turn import check_grounded_arguments

    conversation = "Where is order N7Q4-ZX81? I need 3 of them."
    assert check_grounded_arguments(tool_turn(), conversation) == []
    flipped = tool_turn('{"order_id": "N7Q4-ZX80", "qty": 3}')
    assert oracles_fired(check_grounded_arguments(flipped, conversation)) == ["ungrounded-argument"]
    off_by_one = tool_turn('{"order_id": "N7Q4-ZX81", "qty": 2}')
    assert oracles_fired(check_grounded_arguments(off_by_one, conversation)) == ["ungrounded-argument"]


# ---- issue 17 item 2: whole-value grounding, answers, required calls, ids, stream protocol ------

def test_grounding_matches_whole_values_not_substrings():
    from canary.oracles.turn import check_grounded_arguments, is_grounded

    assert not is_grounded("85", "Where is ORD-4855?")  # inside a longer id
    assert not is_grounded("4855", "Where is ORD-4855?")  # a piece of the id, not the id
    assert is_grounded("ORD-4855", "Where is ORD-4855?")
    assert not is_grounded("12.5", "Convert 12.55 USD.") and not is_grounded("12", "Convert 12.55 USD.")
    assert is_grounded("12.55", "Convert 12.55 USD.") and is_grounded("-5", '{"temperature": -5}')
    assert not is_grounded("Pari", "Weather in Paris.")
    turn = tool_turn('{"order_id": "N7Q4-ZX81", "qty": 85}')
    assert oracles_fired(check_grounded_arguments(turn, "Order N7Q4-ZX81, see ORD-4855.")) == ["ungrounded-argument"]


def test_answer_grounding_passes_copied_values_and_fires_on_a_changed_digit_or_name():
    from canary.oracles.turn import answer_values, check_grounded_answer

    conversation = ('You are the canary assistant. Session nonce: J4U7FH.\nStatus of ORD-2055 with items please.\n'
                    '{"order_id": "ORD-2055", "status": "delivered", "items": 6}\nBook Yara Dubois on Monday.')
    good = "[J4U7FH] Order ORD-2055 is delivered with 6 items. Booked Yara Dubois on Monday."
    assert answer_values(good) == ["J4U7FH", "ORD-2055", "6", "Yara", "Dubois", "Monday"]  # "Order", "Booked": phrasing
    assert check_grounded_answer(answer_turn(good), conversation) == []
    for bad in (good.replace("6 items", "7 items"), good.replace("ORD-2055", "ORD-2056"),
                good.replace("6 items", "20 items"), good.replace("Dubois", "Duboit")):
        assert oracles_fired(check_grounded_answer(answer_turn(bad), conversation)) == ["ungrounded-answer"], bad
    # `55` is no value of the conversation although ORD-2055 ends in it.
    assert oracles_fired(check_grounded_answer(answer_turn("[J4U7FH] 55 items."), conversation)) == [
        "ungrounded-answer"]
    assert check_grounded_answer(tool_turn(), conversation) == []  # tool-call turns: the argument oracle's


def test_the_corpus_reference_answers_are_grounded():
    """The oracle's clean control on the canary corpus itself: the answer a perfect canary model
    gives is grounded in every held-out session (system prompt, user turns and tool results)."""
    from canary.oracles.turn import check_grounded_answer
    from runtime.train.corpus import make_session, session_messages

    for seed in range(500_000, 500_300):
        conversation = []
        for m in session_messages(make_session(seed)):
            if m["role"] == "assistant" and not m.get("tool_calls"):
                assert check_grounded_answer(answer_turn(m["content"]), "\n".join(conversation)) == [], m
            elif m["role"] != "assistant":
                conversation.append(m["content"])


def test_required_calls_fire_on_a_lost_or_changed_call_and_not_on_order():
    from canary.oracles.turn import check_required_calls

    required = [("lookup_order", {"order_id": "N7Q4-ZX81", "qty": 3}), ("get_weather", {"city": "Oslo"})]
    both = [ToolCall("a", "get_weather", '{"city":"Oslo"}'), ToolCall("b", "lookup_order",
                                                                      '{"qty": 3, "order_id": "N7Q4-ZX81"}')]
    final = answer_turn()
    assert check_required_calls(final, both, required, exact=True) == []
    assert oracles_fired(check_required_calls(final, both[:1], required, exact=True)) == ["required-calls"]
    assert oracles_fired(check_required_calls(final, both + both[:1], required, exact=True)) == ["required-calls"]
    changed = [both[0], ToolCall("b", "lookup_order", '{"qty": 4, "order_id": "N7Q4-ZX81"}')]
    assert oracles_fired(check_required_calls(final, changed, required, exact=True)) == ["required-calls"]
    # A real LLM: each required function called, arguments its own business.
    assert check_required_calls(final, changed, required, exact=False) == []
    assert oracles_fired(check_required_calls(final, both[1:], required, exact=False)) == ["required-calls"]
    assert check_required_calls(final, [], [], exact=True) == []


def test_call_ids_must_be_present_and_distinct():
    from canary.oracles.turn import check_call_ids

    two = tool_turn(tool_calls=[ToolCall("call_0", "lookup_order", "{}"), ToolCall("call_1", "lookup_order", "{}")])
    assert check_call_ids(two) == []
    shared = tool_turn(tool_calls=[ToolCall("call_0", "lookup_order", "{}"), ToolCall("call_0", "x", "{}")])
    assert oracles_fired(check_call_ids(shared)) == ["tool-call-id"]
    assert oracles_fired(check_call_ids(tool_turn(tool_calls=[ToolCall("", "x", "{}")]))) == ["tool-call-id"]


def test_stream_protocol_oracles():
    from canary.oracles.turn import StreamProtocol, check_stream_protocol

    turn = tool_turn(streamed=True)
    clean = StreamProtocol(done=True, usage_chunks=1, tool_call_indexes=[0, 1])
    assert check_stream_protocol(turn, clean, include_usage=True) == []
    cases = [(StreamProtocol(done=False, usage_chunks=1), "stream-done"),
             (StreamProtocol(done=True, events_after_done=1, usage_chunks=1), "stream-done"),
             (StreamProtocol(done=True, usage_chunks=0), "stream-usage"),
             (StreamProtocol(done=True, usage_chunks=2), "stream-usage"),
             (StreamProtocol(done=True, usage_chunks=1, tool_call_indexes=[0, 2]), "tool-call-index"),
             (StreamProtocol(done=True, usage_chunks=1, tool_call_indexes=[1, 0]), "tool-call-index")]
    for protocol, oracle in cases:
        assert oracles_fired(check_stream_protocol(turn, protocol, include_usage=True)) == [oracle], protocol
    assert check_stream_protocol(turn, StreamProtocol(done=True), include_usage=False) == []
    assert check_stream_protocol(tool_turn(streamed=True, aborted=True), StreamProtocol(), True) == []


@pytest.mark.parametrize("text", ["<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                                  '<｜DSML｜invoke name="x">'])
def test_control_token_text_in_a_reply_fires(text):
    from canary.oracles.turn import check_control_text

    assert check_control_text(answer_turn()) == []
    assert oracles_fired(check_control_text(answer_turn(f"Order {NONCE} ships.{text}"))) == ["control-text"]
    assert oracles_fired(check_control_text(tool_turn(f'{{"order_id": "{text}"}}'))) == ["control-text"]


def test_stream_equivalence_compares_parsed_arguments():
    reordered = tool_turn('{ "qty":3,\n "order_id":"N7Q4-ZX81" }', streamed=True)
    assert check_stream_equivalence(reordered, tool_turn()) == []
    two = [ToolCall("a", "lookup_order", '{"qty": 1}'), ToolCall("b", "lookup_order", '{"qty": 2}')]
    swapped = tool_turn(tool_calls=two[::-1], streamed=True)
    assert oracles_fired(check_stream_equivalence(swapped, tool_turn(tool_calls=two))) == ["stream-equivalence"]
    unparsable = tool_turn('{"qty": 3', streamed=True)
    assert oracles_fired(check_stream_equivalence(unparsable, tool_turn('{"qty":3'))) == ["stream-equivalence"]
