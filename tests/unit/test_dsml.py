"""DSML parser: examples, streaming == one-shot for any chunking (hypothesis), and agreement with
SGLang's `deepseekv4` detector when sglang is importable."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.server.dsml import DSML, DsmlParser, collect, parse
from tests.reference_impls import DeepSeekV4Detector, Function, Tool, needs_sglang

pytestmark = pytest.mark.unit

NAMES = ["get_weather", "lookup_order", "compute_stats"]
# Parameter text without the characters that would close a tag early; values are stripped by the
# format, so generated strings carry no outer whitespace.
_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<>\"\uff5c"), max_size=12)
_string_value = _text.map(str.strip)
_json_value = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6)
                           | st.floats(allow_nan=False, allow_infinity=False, width=32) | _string_value,
                           lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from("abc"), inner, max_size=2), max_leaves=6)
_arguments = st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), _json_value, max_size=4)
_call = st.tuples(st.sampled_from(NAMES), _arguments, st.booleans())  # (name, args, direct-JSON form)


def render_call(name: str, args: dict, direct_json: bool) -> str:
    head = f'<{DSML}invoke name="{name}">\n'
    if direct_json:
        return head + json.dumps(args, ensure_ascii=False) + f"\n</{DSML}invoke>\n"
    params = "".join(
        f'<{DSML}parameter name="{k}" string="true">{v}</{DSML}parameter>\n' if isinstance(v, str) else
        f'<{DSML}parameter name="{k}" string="false">{json.dumps(v, ensure_ascii=False)}</{DSML}parameter>\n'
        for k, v in args.items())
    return head + params + f"</{DSML}invoke>\n"


def render(prose: str, calls) -> str:
    if not calls:
        return prose
    return prose + "\n\n" + f"<{DSML}tool_calls>\n" + "".join(render_call(*c) for c in calls) + f"</{DSML}tool_calls>"


@st.composite
def chunkings(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


_reply = st.tuples(_text, st.lists(_call, max_size=3))


def test_example_parameters_json_and_self_closing():
    text = (f'Let me check.\n\n<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
            f'<{DSML}parameter name="city" string="true"> Paris </{DSML}parameter>\n'
            f'<{DSML}parameter name="days" string="false">[1, 2.5]</{DSML}parameter>\n</{DSML}invoke>\n'
            f'<{DSML}invoke name="compute_stats"/>\n<{DSML}invoke name="lookup_order">\n{{"id": "ORD-1"}}\n'
            f'</{DSML}invoke>\n</{DSML}tool_calls> More.')
    result = parse(text)
    assert result.content == "Let me check.More."  # text after a block is output too, never dropped
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == [
        ("get_weather", {"city": " Paris ", "days": [1, 2.5]}), ("compute_stats", {}), ("lookup_order", {"id": "ORD-1"})]


def test_plain_text_and_unknown_tools():
    assert parse("no calls <here>").content == "no calls <here>"
    text = render("", [("nope", {"a": 1}, False), ("get_weather", {"a": 1}, False)])
    assert [c.name for c in parse(text, {"get_weather"}).calls] == ["get_weather"]


def test_unclosed_invoke_is_not_a_call():
    """Cut output is never closed into a call (the full rule: tests/unit/test_dsml_incomplete.py)."""
    cut = f'<{DSML}tool_calls><{DSML}invoke name="f"><{DSML}parameter name="a" string="false">1</{DSML}parameter>'
    parser = DsmlParser()
    parser.feed(cut)
    assert not parser.closed
    assert parse(cut).calls == []


@given(data=st.data(), reply=_reply)
def test_streamed_parse_equals_one_shot_for_any_chunking(data, reply):
    prose, calls = reply
    text = render(prose, calls)
    one_shot = parse(text)
    streamed = collect(DsmlParser(), data.draw(chunkings(text)))
    assert streamed == one_shot
    assert [(c.name, json.loads(c.arguments)) for c in one_shot.calls] == [(n, a) for n, a, _ in calls]
    assert one_shot.content == prose


_noise = st.lists(st.sampled_from(["<", ">", "\n", " ", "x", '"', "{", "}", "/", f"<{DSML}tool_calls>",
                                   f"</{DSML}tool_calls>", f'<{DSML}invoke name="f">', f"</{DSML}invoke>",
                                   f'<{DSML}parameter name="p" string="true">', f"</{DSML}parameter>", "/>",
                                   f"<{DSML}invoke", f"<{DSML}parameter"]), max_size=30).map("".join)


@given(data=st.data(), text=_noise)
def test_chunking_never_changes_the_parse_even_of_malformed_text(data, text):
    assert collect(DsmlParser(), data.draw(chunkings(text))) == parse(text)


def test_property_check_can_fail_on_a_chunking_sensitive_parser():
    """Negative control: a parser that decides on each chunk alone disagrees with itself."""
    text = render("hi", [("get_weather", {"city": "Paris"}, False)])

    def naive(chunks):  # looks for the block tag per chunk, as a buggy streamer would
        return ["".join(c for c in chunks if f"<{DSML}tool_calls>" not in c)]

    split = [text[:5], text[5:20], text[20:]]
    assert naive(split) != naive([text])


@needs_sglang
@given(reply=_reply)
def test_agrees_with_sglang_deepseekv4_detector(reply):
    prose, calls = reply
    text = render(prose, calls)
    tools = [Tool(type="function", function=Function(name=n, parameters={"type": "object"})) for n in NAMES]
    theirs = DeepSeekV4Detector().detect_and_parse(text, tools)
    ours = parse(text, set(NAMES))
    assert [(c.name, json.loads(c.arguments)) for c in ours.calls] == \
        [(c.name, json.loads(c.parameters)) for c in theirs.calls]
    assert ours.content == theirs.normal_text
