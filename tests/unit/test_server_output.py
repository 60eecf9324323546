"""The server's output path fed controlled text (tiny-random only emits gibberish): tool calls,
streaming deltas, finish reasons, stop strings, UTF-8 and the tool-json-corrupt fault."""

from __future__ import annotations

import json

import pytest

from runtime.server.corrupt import ToolJsonCorruptor
from runtime.server.detokenizer import Detokenizer
from runtime.server.dsml import DSML
from runtime.server.output import PAST_LAST_CALL, ChoiceBuilder, OutputOptions, fold
from runtime.tokenizer import ByteTokenizer

pytestmark = pytest.mark.unit

TOK = ByteTokenizer(320, 256, 257, 258)
CALL_TEXT = (f'Sure.\n\n<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
             f'<{DSML}parameter name="city" string="true">Zürich</{DSML}parameter>\n'
             f'<{DSML}parameter name="days" string="false">3</{DSML}parameter>\n</{DSML}invoke>\n'
             f'<{DSML}invoke name="get_weather">\n<{DSML}parameter name="city" string="true">Oslo</{DSML}parameter>\n'
             f'</{DSML}invoke>\n</{DSML}tool_calls>')
TOOLS = OutputOptions(parse_tools=True, tool_names=frozenset({"get_weather"}))


def run(text: str, options: OutputOptions, reason: str = "stop", corruptor=None, eos: bool = True):
    builder = ChoiceBuilder(TOK, options, corruptor)
    deltas = [builder.push(t, -0.5, [(t, -0.5)], False) for t in TOK.encode(text)]
    if eos:
        deltas.append(builder.push(TOK.eos_token_id, -0.1, [], True))
    last, finish = builder.finish(reason)
    return deltas + [last], finish


def test_tool_calls_non_streaming_and_streaming_agree():
    deltas, finish = run(CALL_TEXT, TOOLS)
    message = fold(deltas)["message"]
    assert finish == "tool_calls"
    assert message["content"] == "Sure."
    calls = message["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Zürich", "days": 3}, {"city": "Oslo"}]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    # Streaming: each call once, whole, when its invoke closed (never a call that may turn out cut).
    entries = [tc for d in deltas for tc in d.tool_calls]
    for index, call in enumerate(calls):
        mine = [e for e in entries if e["index"] == index]
        assert sum("id" in e for e in mine) == 1 and sum(bool(e["function"].get("name")) for e in mine) == 1
        assert len(mine) == 1
        assert "".join(e["function"]["arguments"] for e in mine) == call["function"]["arguments"]


def push_until_ended(builder: ChoiceBuilder, text: str) -> tuple[list, int]:
    """Push `text`'s tokens as the server does under parallel_tool_calls=false: until the builder
    says the reply ended. Returns the deltas and the number of tokens pushed."""
    deltas = []
    for count, token in enumerate(TOK.encode(text), 1):
        deltas.append(builder.push(token, -0.5, [], False))
        if builder.ended:
            return deltas, count
    return deltas, count


def test_parallel_tool_calls_false_ends_the_reply_at_its_first_call():
    """max_calls=1: the reply ends on the very token that closes the first invoke (the server stops
    generating there), with that one call, finish "tool_calls", and nothing past it to count. The
    old builder read on and dropped the second call."""
    builder = ChoiceBuilder(TOK, OutputOptions(parse_tools=True, max_calls=1))
    deltas, pushed = push_until_ended(builder, CALL_TEXT)
    first_close = CALL_TEXT.index(f"</{DSML}invoke>") + len(f"</{DSML}invoke>")
    assert pushed == len(CALL_TEXT[:first_close].encode())
    last, finish = builder.finish("stop")
    message = fold([*deltas, last])["message"]
    assert finish == "tool_calls" and message["content"] == "Sure."
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Zürich", "days": 3}]
    assert builder.rejected == []


def test_parallel_tool_calls_false_counts_output_a_stop_string_held_past_the_call():
    """A stop string's hold-back releases the first call late, when the second invoke is already
    generated: it is past the reply's end, not returned, and counted (never dropped in silence)."""
    builder = ChoiceBuilder(TOK, OutputOptions(stop=("#" * 120,), parse_tools=True, max_calls=1))
    deltas, pushed = push_until_ended(builder, CALL_TEXT)
    assert pushed < len(CALL_TEXT.encode())
    last, finish = builder.finish("stop")
    message = fold([*deltas, last])["message"]
    assert finish == "tool_calls" and len(message["tool_calls"]) == 1 and message["content"] == "Sure."
    assert builder.rejected == [PAST_LAST_CALL]


def test_tool_choice_none_returns_dsml_as_text_and_length_stays_length():
    deltas, finish = run(CALL_TEXT, OutputOptions(), reason="length", eos=False)
    assert fold(deltas)["message"]["content"] == CALL_TEXT and finish == "length"
    cut = CALL_TEXT[: CALL_TEXT.index("Oslo")]
    deltas, finish = run(cut, TOOLS, reason="length", eos=False)
    assert finish == "length"  # stopped inside an invoke: the call is incomplete


def test_named_tool_choice_prefix_is_parsed_not_sent():
    prefix = f'<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
    body = f'<{DSML}parameter name="city" string="true">Rome</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>'
    deltas, finish = run(body, OutputOptions(parse_tools=True, forced_prefix=prefix))
    message = fold(deltas)["message"]
    assert finish == "tool_calls" and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}


def test_stop_string_is_cut_and_never_streamed():
    deltas, _ = run("hello STOP world", OutputOptions(stop=("STOP",)))
    assert "".join(d.content for d in deltas) == "hello "


def test_utf8_split_across_tokens_is_held_until_complete():
    detok = Detokenizer(TOK)
    pieces = [detok.push(b) for b in "é€".encode()]
    assert "\ufffd" not in "".join(pieces) and "".join(pieces) + detok.flush() == "é€"


def test_logprobs_one_entry_per_token_including_eos():
    deltas, _ = run("ab", OutputOptions(logprobs=True, top_logprobs=1))
    entries = fold(deltas)["logprobs"]
    assert [e["token"] for e in entries] == ["a", "b", ""] and entries[0]["top_logprobs"][0]["token"] == "a"


def _corrupted_arguments(rate: float, key: str = "k") -> list[str]:
    deltas, _ = run(CALL_TEXT, TOOLS, corruptor=ToolJsonCorruptor(key, rate))
    return [c["function"]["arguments"] for c in fold(deltas)["message"]["tool_calls"]]


def test_tool_json_corrupt_fault_flips_one_character_deterministically():
    clean = _corrupted_arguments(0.0)
    hit = _corrupted_arguments(1.0)
    assert hit == _corrupted_arguments(1.0)  # same request, same corruption
    for good, bad in zip(clean, hit):
        assert len(good) == len(bad) and sum(a != b for a, b in zip(good, bad)) == 1


def test_arguments_check_catches_the_fault():
    """Negative control for the JSON/arguments oracle: with the fault on, some call fails it."""
    def arguments_ok(arguments: str) -> bool:
        try:
            value = json.loads(arguments)
        except ValueError:
            return False
        return value in ({"city": "Zürich", "days": 3}, {"city": "Oslo"})

    assert all(arguments_ok(a) for a in _corrupted_arguments(0.0))
    assert not all(arguments_ok(a) for a in _corrupted_arguments(1.0))


def test_corruption_rate_is_low_and_seeded():
    hits = 0
    for i in range(400):
        corruptor = ToolJsonCorruptor(f"req-{i}", 0.1)
        corruptor.start_call(0)
        hits += corruptor.arguments(0, '{"a": 1}') != '{"a": 1}'
    assert 20 <= hits <= 60


def test_parallel_tool_calls_false_a_call_released_only_at_the_end_ends_the_reply():
    """The output ended (max_tokens) while a stop string held both calls back: the flush releases
    them together, the reply ends at the first, complete ("tool_calls"), and the second is counted."""
    builder = ChoiceBuilder(TOK, OutputOptions(stop=("#" * 400,), parse_tools=True, max_calls=1))
    deltas = [builder.push(t, -0.5, [], False) for t in TOK.encode(CALL_TEXT)]
    assert not builder.ended
    last, finish = builder.finish("length")
    message = fold([*deltas, last])["message"]
    assert finish == "tool_calls" and len(message["tool_calls"]) == 1 and message["content"] == "Sure."
    assert builder.rejected == [PAST_LAST_CALL]
