"""Issue 18, items 1-2: the server never reports a wrong tool call as a right one.

One rule: a call is reported only once its invoke closed with a valid JSON object that satisfies
what the markup declared; cut or malformed markup goes back to the content; finish_reason says
"tool_calls" only for a natural stop with every block closed. Checked on the issue's examples, on
every cut of generated replies (hypothesis), on malformed text under every chunking, and against
DeepSeek's reference parser (the wider differential: tests/unit/test_dsml_differential.py). Each
property has a negative control that plants the bug it is meant to catch.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from runtime.server.dsml import DSML, INVOKE_CLOSE, DsmlParser, ParsedCall, collect, parse
from runtime.server.output import ChoiceBuilder, OutputOptions, fold
from runtime.tokenizer import ByteTokenizer
from tests.reference_impls import encoding_dsv32 as reference
from tests.reference_impls import needs_sglang

pytestmark = pytest.mark.unit

TOK = ByteTokenizer(320, 256, 257, 258)
OPEN, CLOSE = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"


def invoke(name: str, body: str) -> str:
    return f'<{DSML}invoke name="{name}">\n{body}</{DSML}invoke>\n'


def param(name: str, value: str, string: str | None = "true") -> str:
    declared = "" if string is None else f' string="{string}"'
    return f'<{DSML}parameter name="{name}"{declared}>{value}</{DSML}parameter>\n'


def block(*invokes: str) -> str:
    return OPEN + "\n" + "".join(invokes) + CLOSE


WEATHER_OSLO = invoke("get_weather", param("city", "Oslo"))
WEATHER_PARIS = invoke("get_weather", param("city", "Paris") + param("days", "3", "false"))


def calls(text: str, tool_names=None) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parse(text, tool_names).calls]


def respond(text: str, reason: str, stop: tuple[str, ...] = (), tools=frozenset({"get_weather"})):
    """The server's output path on `text`, token by token, ending with `reason`."""
    builder = ChoiceBuilder(TOK, OutputOptions(stop=stop, parse_tools=True, tool_names=tools))
    deltas = [builder.push(t, -0.1, [], False) for t in TOK.encode(text)]
    if reason == "stop" and not stop:
        deltas.append(builder.push(TOK.eos_token_id, -0.1, [], True))
    last, finish = builder.finish(reason)
    return fold(deltas + [last])["message"], finish


# ---- item 1: incomplete output ------------------------------------------------------------------
def test_stop_string_inside_an_invoke_reports_no_call():
    message, finish = respond(block(WEATHER_OSLO), "stop", stop=("Oslo",))
    assert finish == "stop" and "tool_calls" not in message


def test_max_tokens_between_two_invokes_keeps_the_first_call_and_length():
    text = block(WEATHER_PARIS, WEATHER_OSLO)
    cut = text[: text.index(WEATHER_OSLO) + 10]
    message, finish = respond(cut, "length")
    assert finish == "length"
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris", "days": 3}]


def test_invoke_open_at_the_end_is_content_not_a_call():
    cut = OPEN + "\n" + WEATHER_OSLO[:-20]
    message, finish = respond(cut, "length")
    assert finish == "length" and "tool_calls" not in message
    assert message["content"] == WEATHER_OSLO[:-20]  # returned, not dropped


def test_complete_block_and_eos_is_tool_calls():
    message, finish = respond(block(WEATHER_PARIS), "stop")
    assert finish == "tool_calls" and message["content"] is None and len(message["tool_calls"]) == 1


# ---- item 2: what is parsed and how -------------------------------------------------------------
CASES = {
    "second block": (block(WEATHER_PARIS) + "\n\n" + block(WEATHER_OSLO),
                     "", [("get_weather", '{"city": "Paris", "days": 3}'), ("get_weather", '{"city": "Oslo"}')]),
    "function_calls (V3.2)": (WEATHER_OSLO.join([f"<{DSML}function_calls>\n", f"</{DSML}function_calls>"]),
                              "", [("get_weather", '{"city": "Oslo"}')]),
    "invoke without a block": ("Sure." + "\n\n" + WEATHER_OSLO, "Sure.", [("get_weather", '{"city": "Oslo"}')]),
    "attributes swapped": (block(invoke("f", f'<{DSML}parameter string="false" name="n">2</{DSML}parameter>\n')),
                           "", [("f", '{"n": 2}')]),
    "no string attribute: JSON": (block(invoke("f", param("n", "[1, 2]", None))), "", [("f", '{"n": [1, 2]}')]),
    "no string attribute: text": (block(invoke("f", param("s", "hi there", None))), "", [("f", '{"s": "hi there"}')]),
    "duplicate keeps the last": (block(invoke("f", param("a", "1", "false") + param("b", "x") + param("a", "2", "false"))),
                                 "", [("f", '{"a": 2, "b": "x"}')]),
    "string whitespace kept": (block(invoke("f", param("s", "  two\nlines  "))), "", [("f", '{"s": "  two\\nlines  "}')]),
    "numbers as written": (block(invoke("f", param("x", "1.50", "false") + param("y", "1e400", "false"))),
                           "", [("f", '{"x": 1.50, "y": 1e400}')]),
    "direct JSON as written": (block(invoke("f", '{"a": 1.0, "b": "c"}\n')), "", [("f", '{"a": 1.0, "b": "c"}')]),
    "value holding close tags": (block(invoke("f", param("s", f"a{CLOSE}</{DSML}invoke>b"))),
                                 "", [("f", json.dumps({"s": f"a{CLOSE}</{DSML}invoke>b"}, ensure_ascii=False))]),
    "self-closing": (block(f'<{DSML}invoke name="f"/>\n'), "", [("f", "{}")]),
}


@pytest.mark.parametrize("case", CASES)
def test_parses_what_the_reference_parses(case):
    text, content, expected = CASES[case]
    result = parse(text)
    assert (result.content, [(c.name, c.arguments) for c in result.calls]) == (content, expected)
    assert all(isinstance(json.loads(a), dict) for _, a in expected)


INVALID = {
    "array body": invoke("f", "[1, 2]\n"),
    "JSON missing a value": invoke("f", '{"city": }\n'),
    "JSON with trailing text": invoke("f", '{"a": 1} trailing\n'),
    "NaN": invoke("f", '{"a": NaN}\n'),
    "string=false not JSON": invoke("f", param("a", "Oslo", "false")),
    "Infinity value": invoke("f", param("a", "Infinity", "false")),
    "text between parameters": invoke("f", param("a", "x") + "stray\n" + param("b", "y")),
    "parameter without a name": invoke("f", f'<{DSML}parameter string="true">x</{DSML}parameter>\n'),
    "malformed parameter tag": invoke("f", f'<{DSML}parameter name="a" string="true"x</{DSML}parameter>\n'),
}


@pytest.mark.parametrize("case", INVALID)
def test_malformed_invoke_is_content_never_a_call_nor_dropped(case):
    markup = INVALID[case]
    result = parse(block(WEATHER_OSLO, markup, WEATHER_OSLO))
    assert [c.arguments for c in result.calls] == ['{"city": "Oslo"}'] * 2  # the neighbours survive
    assert result.content == markup.strip() or result.content == markup  # the model's text, as written
    message, finish = respond(block(markup), "stop", tools=None)
    assert finish == "stop" and "tool_calls" not in message and message["content"]


def test_unknown_tool_is_content():
    text = block(invoke("delete_everything", param("a", "1", "false")))
    assert calls(text, {"get_weather"}) == [] and "delete_everything" in parse(text, {"get_weather"}).content


def test_text_after_a_block_is_content():
    assert parse(block(WEATHER_OSLO) + "\nDone.").content == "Done."


# A malformed tag or an unclosed parameter is one invoke's fault: the invokes after it are still read
# (SGLang reads them too), and the bad markup is content. Inside an invoke, `<｜DSML｜invoke` starts the
# next one, so a parameter or body the model never closed cannot swallow the next call.
NEIGHBOUR_CASES = {
    "malformed invoke tag": f"<{DSML}invoke ",
    "malformed invoke tag, no space": f"<{DSML}invoke",
    "unclosed parameter": invoke("f", f'<{DSML}parameter name="a" string="true">cut\n'),
    "unclosed parameter, JSON": invoke("f", f'<{DSML}parameter name="a" string="false">[1,\n'),
    "unclosed parameter and invoke": f'<{DSML}invoke name="f">\n<{DSML}parameter name="a" string="true">cut\n',
    "unclosed direct JSON and invoke": f'<{DSML}invoke name="f">\n{{"a": 1,\n',
    "stray text, invoke unclosed": f'<{DSML}invoke name="f">\nstray\n',
}
WEATHER_JSON = invoke("get_weather", '{"city": "Oslo"}\n')


@pytest.mark.parametrize("neighbour", [WEATHER_JSON, WEATHER_OSLO], ids=["direct JSON", "parameters"])
@pytest.mark.parametrize("case", NEIGHBOUR_CASES)
@pytest.mark.parametrize("wrap", [block, lambda *invokes: "".join(invokes)], ids=["block", "bare"])
def test_a_bad_invoke_never_hides_the_next_call(case, wrap, neighbour):
    bad = NEIGHBOUR_CASES[case]
    text = wrap(bad, neighbour)
    result = parse(text)
    assert [(c.name, c.arguments) for c in result.calls] == [("get_weather", '{"city": "Oslo"}')]
    assert bad.strip() in result.content  # the model's text, returned
    for cut in range(len(text) + 1):  # every two-chunk split streams to the same parse
        assert collect(DsmlParser(), [text[:cut], text[cut:]]) == result


TAGS_WITH_BRACKETS = {
    "invoke name with >": block(f'<{DSML}invoke name="a>b">\n</{DSML}invoke>\n'),
    "invoke name with <": block(f'<{DSML}invoke name="a<b">\n</{DSML}invoke>\n'),
    "parameter name with >": block(invoke("f", f'<{DSML}parameter name="x>y" string="true">v</{DSML}parameter>\n')),
}


@pytest.mark.parametrize("text", TAGS_WITH_BRACKETS.values(), ids=TAGS_WITH_BRACKETS)
def test_a_tag_is_decided_at_its_first_angle_bracket_under_every_split(text):
    """A quoted ">" used to end a tag in a stream whose chunk stopped there, but not in the one-shot
    parse (the tag regex read on past it): `name="a>b"` was a call one-shot and content streamed."""
    one_shot = parse(text)
    assert one_shot.calls == [] and one_shot.content  # not a tool name: the markup is content
    for cut in range(len(text) + 1):
        assert collect(DsmlParser(), [text[:cut], text[cut:]]) == one_shot


# ---- properties over generated and malformed replies -------------------------------------------
_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<>\"\uff5c"), max_size=10)
_value = st.one_of(_text.map(lambda s: (s, "true")),
                   st.integers(-10**6, 10**6).map(lambda n: (str(n), "false")),
                   st.lists(st.integers(0, 9), max_size=3).map(lambda v: (json.dumps(v), "false")))
_params = st.lists(st.tuples(st.from_regex(r"[a-z]{1,4}", fullmatch=True), _value), max_size=3)
_invoke = st.tuples(st.sampled_from(["get_weather", "f"]), _params).map(
    lambda c: invoke(c[0], "".join(param(k, v, s) for k, (v, s) in c[1])))
_reply = st.tuples(_text, st.lists(_invoke, min_size=1, max_size=3)).map(
    lambda r: r[0] + "\n\n" + block(*r[1]))


def complete_calls_only(parse_fn, text: str, cut: int) -> bool:
    """Output cut anywhere reports only calls the whole reply has, with the same arguments."""
    whole, part = parse_fn(text).calls, parse_fn(text[:cut]).calls
    return part == whole[: len(part)]


@given(reply=_reply, data=st.data())
def test_a_cut_reply_never_reports_a_call_it_does_not_complete(reply, data):
    cut = data.draw(st.integers(0, len(reply)))
    assert complete_calls_only(parse, reply, cut)
    _, finish = respond(reply[:cut], "length", tools=None)
    assert finish == "length"


def test_negative_control_closing_a_cut_invoke_is_caught():
    """The bug the issue found (ChoiceBuilder/DsmlParser.finish closed an open invoke) fails the property."""
    def closes_open_invokes(text: str):
        result = parse(text)
        if text.count(f"<{DSML}invoke") > text.count(f"</{DSML}invoke>"):
            result.calls.append(ParsedCall("get_weather", "{}"))
        return result

    reply = block(WEATHER_PARIS, WEATHER_OSLO)
    cut = reply.index("Oslo")
    assert complete_calls_only(parse, reply, cut)
    assert not complete_calls_only(closes_open_invokes, reply, cut)


_noise = st.lists(st.sampled_from([
    "<", ">", "\n", " ", "x", '"', "{", "}", "/", "1", "NaN", "[", "]", ":", "1e400",
    OPEN, CLOSE, f"<{DSML}function_calls>", f'<{DSML}invoke name="f">', f"</{DSML}invoke>",
    f'<{DSML}parameter name="p" string="true">', f'<{DSML}parameter name="p" string="false">',
    f'<{DSML}parameter string="false" name="q">', f'<{DSML}parameter name="r">', f"</{DSML}parameter>",
    "/>", f"<{DSML}invoke", f"<{DSML}parameter", '{"a": 1}']), max_size=40).map("".join)


@st.composite
def chunkings(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def arguments_valid(result) -> bool:
    def strict(raw: str):
        def reject(name):
            raise ValueError(name)
        return json.loads(raw, parse_constant=reject)

    try:
        return all(isinstance(strict(c.arguments), dict) for c in result.calls)
    except ValueError:
        return False


@given(text=_noise, data=st.data())
@example(text=block(invoke("f", '{"a": NaN}\n')), data=None)
def test_malformed_text_never_yields_invalid_arguments_and_chunking_never_matters(text, data):
    one_shot = parse(text)
    assert arguments_valid(one_shot)
    if data is not None:
        assert collect(DsmlParser(), data.draw(chunkings(text))) == one_shot


def test_negative_control_invalid_arguments_are_caught():
    """A parser that passed a direct-JSON body through (the issue's `{"city": }`) fails the oracle."""
    result = parse(block(WEATHER_OSLO))
    assert arguments_valid(result)
    result.calls.append(ParsedCall("f", '{"city": }'))
    assert not arguments_valid(result)
    result.calls[-1] = ParsedCall("f", '{"a": NaN}')
    assert not arguments_valid(result)


# ---- differential: DeepSeek's reference parser and SGLang's detector (sglang wheel) ------------
_ref_invoke = st.tuples(st.sampled_from(["get_weather", "f"]), st.dictionaries(
    st.from_regex(r"[a-z]{1,4}", fullmatch=True), _value, max_size=3))
_ref_reply = st.tuples(_text.filter(lambda s: "\n\n" not in s), st.lists(_ref_invoke, max_size=3))


def reference_text(prose: str, invokes) -> str:
    """A V3.2 completion exactly as DeepSeek's encoder writes one (its parser is strict about layout)."""
    if not invokes:
        return prose + reference.eos_token
    body = "\n".join(f'<{DSML}invoke name="{name}">\n' + "\n".join(
        f'<{DSML}parameter name="{k}" string="{s}">{v}</{DSML}parameter>' for k, (v, s) in params.items())
        + f"\n</{DSML}invoke>" for name, params in invokes)
    return f"{prose}\n\n<{DSML}function_calls>\n{body}\n</{DSML}function_calls>{reference.eos_token}"


@needs_sglang
@given(reply=_ref_reply, data=st.data())
def test_agrees_with_deepseek_reference_parser_byte_for_byte(reply, data):
    text = reference_text(*reply)
    theirs = reference.parse_message_from_completion_text(text, thinking_mode="chat")
    ours = collect(DsmlParser(), data.draw(chunkings(text.removesuffix(reference.eos_token))))
    assert ours.content == theirs["content"]
    assert [(c.name, c.arguments) for c in ours.calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in theirs["tool_calls"]]


def _feed_events(text: str, pieces: list[int], skip: bool) -> list[list]:
    parser = DsmlParser()
    parser.skip_undecided = skip
    out, at = [], 0
    for size in pieces:
        out.append(parser.feed(text[at:at + size]))
        at += size
    out.append(parser.feed(text[at:]) + parser.finish())
    return out


_malformed = st.sampled_from(list(INVALID.values()) + [f'<{DSML}invoke name=f>\n', f'<{DSML}invoke name="f"/>\n'])


@given(reply=st.one_of(_reply, st.tuples(_reply, _malformed).map(lambda r: r[0] + block(r[1]))),
       pieces=st.lists(st.integers(1, 9), max_size=200))
def test_the_undecided_invoke_shortcut_changes_no_event(reply, pieces):
    """DsmlParser skips rescanning an invoke until its close tag arrives: every feed's events (not
    only the totals) are those of the full rescan."""
    assert _feed_events(reply, pieces, True) == _feed_events(reply, pieces, False)


def test_negative_control_a_shortcut_that_skips_too_much_is_caught(monkeypatch):
    """Skipping also at the end of the output (final) would lose the cut invoke's text: the
    comparison above sees it."""
    text = "hi\n\n" + block(invoke("f", param("a", "x")))[:-30]
    original = DsmlParser._invoke

    def skip_always(self, events, final):
        if INVOKE_CLOSE not in self._buf:
            return False
        return original(self, events, final)

    reference = _feed_events(text, [3] * 40, False)
    monkeypatch.setattr(DsmlParser, "_invoke", skip_always)
    assert _feed_events(text, [3] * 40, True) != reference
