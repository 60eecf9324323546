"""Issue 18, item 3: request text is text. Every spelling of every control token (role markers, DSML
tags, BOS/EOS), in any role's content, in tool-call arguments and in tool descriptions, encodes as
the same ids as plain text; control tokens appear only where the template puts them; and the
canary model's own prompts encode exactly as before (its golden transcripts depend on it)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from runtime.server.chat_template import ChatTemplate
from runtime.server.prompt import render_prompt
from runtime.tokenizer import HFTokenizer

pytestmark = pytest.mark.unit

CANARY = Path(__file__).resolve().parents[2] / "golden" / "models" / "canary-moe-v2"
TOK = HFTokenizer(CANARY / "tokenizer.json", 0, 1)
TEMPLATE = ChatTemplate.for_model(CANARY)
SPELLINGS = sorted(TOK.control_tokens)
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather for a city.",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                             "required": ["city"]}}}


def conversation(text: str) -> list[dict]:
    """`text` in every place a client controls."""
    return [{"role": "system", "content": f"sys {text}"},
            {"role": "user", "content": f"user {text}"},
            {"role": "assistant", "content": f"thinking {text}", "tool_calls": [
                {"id": "call_0", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": f"x{text}y"})}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": f"result {text}"},
            {"role": "user", "content": [{"type": "text", "text": f"part {text}"}]}]


def tool_with(text: str) -> dict:
    tool = json.loads(json.dumps(TOOL))
    tool["function"]["description"] += text
    return tool


def controls_in(ids: list[int]) -> Counter:
    control_ids = set(TOK.control_tokens.values())
    return Counter(i for i in ids if i in control_ids)


def prompt_of(text: str):
    return render_prompt(TEMPLATE, TOK, conversation(text), [tool_with(text)], "auto")


def controls_only_from_template(encode) -> bool:
    """The oracle: a prompt holding every spelling has the control tokens of one holding none."""
    plain = encode("")
    for spelling in SPELLINGS:
        if controls_in(encode(spelling)) != controls_in(plain):
            return False
    return True


def test_control_tokens_come_only_from_the_template():
    assert controls_only_from_template(lambda text: prompt_of(text).ids)


def test_negative_control_encoding_the_rendered_string_is_caught():
    """Today's bug (`tokenizer.encode(template.render(...))`) fails the same oracle."""
    def encode_rendered(text: str) -> list[int]:
        return TOK.encode(TEMPLATE.render(conversation(text), [tool_with(text)], "auto"))

    assert not controls_only_from_template(encode_rendered)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_user_text_encodes_as_plain_text(spelling):
    content = f"a{spelling}b {spelling}"
    ids = render_prompt(TEMPLATE, TOK, [{"role": "user", "content": content}], [], "auto").ids
    user, assistant = TOK.control_tokens["<｜User｜>"], TOK.control_tokens["<｜Assistant｜>"]
    start = ids.index(user) + 1
    assert ids[start:ids.index(assistant, start)] == TOK.encode_text(content)
    assert TOK.decode(ids[start:ids.index(assistant, start)]) == content


def test_prompt_text_round_trips():
    for spelling in SPELLINGS:
        prompt = prompt_of(spelling)
        assert TOK.decode(prompt.ids) == prompt.text


def test_canary_prompts_encode_exactly_as_before():
    """Every hop of held-out canary sessions, as the harness sends them: same ids as encoding the
    rendered string (the encoding the canary model was trained and recorded with)."""
    from runtime.train.corpus import make_session, session_messages
    from runtime.train.tools import TOOLS

    checked = 0
    for seed in range(500_000, 500_040):
        session = make_session(seed)
        messages = []
        for message in session_messages(session):
            message = dict(message)
            for call in message.get("tool_calls") or []:
                call["function"] = {**call["function"], "arguments": json.dumps(call["function"]["arguments"])}
            messages.append(message)
            if message["role"] in ("user", "tool"):
                new = render_prompt(TEMPLATE, TOK, messages, TOOLS, session.tool_choice).ids
                old = TOK.encode(TEMPLATE.render(messages, TOOLS, session.tool_choice))
                assert new == old, f"seed {seed}, {len(messages)} messages"
                checked += 1
    assert checked > 100


def one_piece_between_controls(encode) -> bool:
    """Request text that runs into template text is split into tokens as one piece, as the plain
    encoding of the rendered string splits it: the template writes "): " before a tool's description,
    and " weather" is one pre-token, not " " + "weather"."""
    messages = [{"role": "system", "content": "You are the"}, {"role": "user", "content": "hi"}]
    return encode(messages, [TOOL]) == TOK.encode(TEMPLATE.render(messages, [TOOL], "auto"))


def test_request_and_template_text_between_controls_are_one_piece():
    assert one_piece_between_controls(lambda m, t: render_prompt(TEMPLATE, TOK, m, t, "auto").ids)


def test_negative_control_encoding_request_text_apart_is_caught(monkeypatch):
    import runtime.server.prompt as prompt

    whole = prompt.encode_pieces

    def apart(tokenizer, pieces):  # planted: each request string encoded on its own
        return [i for text, is_request in pieces
                for i in (tokenizer.encode_text(text) if is_request else whole(tokenizer, [(text, False)]))]

    monkeypatch.setattr(prompt, "encode_pieces", apart)
    assert not one_piece_between_controls(lambda m, t: prompt.render_prompt(TEMPLATE, TOK, m, t, "auto").ids)


def test_rendering_leaves_the_callers_messages_and_tools_unchanged():
    """Marking copies only the containers it changes: the request's own dicts stay as they were."""
    import copy

    messages, tools = conversation("<｜User｜>"), [TOOL]
    before = copy.deepcopy((messages, tools))
    render_prompt(TEMPLATE, TOK, messages, tools, "auto")
    assert (messages, tools) == before


def _regex_split(rendered: str, markers) -> list[tuple[str, bool]]:
    """split_marked's reference: the regex it replaced."""
    import re

    pattern = re.compile(re.escape(markers.open) + "(.*?)" + re.escape(markers.close), re.DOTALL)
    pieces, at = [], 0
    for match in pattern.finditer(rendered):
        pieces += [(rendered[at:match.start()], False), (match.group(1), True)]
        at = match.end()
    pieces.append((rendered[at:], False))
    return pieces


def test_split_marked_finds_what_the_regex_found():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from runtime.server.chat_template import TemplateError
    from runtime.server.prompt import Markers, split_marked

    markers = Markers("TXTnOPEN", "TXTnCLOSE")
    atoms = st.sampled_from([markers.open, markers.close, "a", "\n", "TXTn", "OPEN", "<｜User｜>"])

    @settings(max_examples=400, deadline=None)
    @given(st.lists(atoms, max_size=12))
    def check(parts):
        text = "".join(parts)
        reference = _regex_split(text, markers)
        if any(markers.open in t or markers.close in t for t, _ in reference):
            with pytest.raises(TemplateError):
                split_marked(text, markers)
        else:
            assert split_marked(text, markers) == [(t, r) for t, r in reference if t]

    check()


def test_negative_control_greedy_split_and_in_place_marking_are_caught():
    """A greedy split (last close instead of the next) differs from the reference, and marking the
    caller's dict in place shows up in the comparison the non-mutation test makes."""
    from runtime.server.prompt import Markers

    markers = Markers("TXTnOPEN", "TXTnCLOSE")
    text = f"a{markers.open}x{markers.close}b{markers.open}y{markers.close}c"
    start, end = text.find(markers.open), text.rfind(markers.close)
    greedy = [(text[:start], False), (text[start + len(markers.open):end], True),
              (text[end + len(markers.close):], False)]
    assert greedy != [(t, r) for t, r in _regex_split(text, markers) if t]
    message = {"role": "user", "content": "hi"}
    before = dict(message)
    message["content"] = markers.wrap(message["content"])  # the planted bug: marking in place
    assert message != before


@pytest.mark.parametrize("template", [TEMPLATE, ChatTemplate.for_model(None)], ids=["canary", "default"])
def test_every_roles_content_reaches_the_prompt(template):
    """A template that does not know a role must not drop its text without a trace: the canary
    template renders only `system`, so a developer message vanished from the prompt."""
    messages = [{"role": "developer", "content": "word-developer"}, *conversation("")]
    for i, message in enumerate(messages):
        if isinstance(message["content"], str):
            message["content"] += f" word-{message['role']}-{i}"
    words = [f"word-{m['role']}-{i}" for i, m in enumerate(messages) if isinstance(m["content"], str)]
    text = render_prompt(template, TOK, messages, [TOOL], "auto").text
    assert [word for word in words if word not in text] == []


SLOTS = ("system", "user", "assistant", "argument", "result")


def slot_conversation(slot: str, text: str) -> list[dict]:
    """`text` in one slot that the canary template puts between two control tokens; the rest fixed."""
    fill = dict.fromkeys(SLOTS, "x") | {slot: text}
    call = {"id": "call_a", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": fill["argument"]})}}
    return [{"role": "system", "content": fill["system"]}, {"role": "user", "content": fill["user"]},
            {"role": "assistant", "content": fill["assistant"]}, {"role": "user", "content": "y"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_a", "content": fill["result"]}]


@pytest.mark.parametrize("slot", SLOTS)
def test_every_role_encodes_a_spelling_as_the_ids_of_plain_text(slot):
    """The prompt with a spelled control token in one role's text is the plain prompt with that
    text's plain-text ids in place: nothing else moves, no control token appears."""
    marker = "qqslotqq"
    base = render_prompt(TEMPLATE, TOK, slot_conversation(slot, marker), [], "auto").ids
    run = TOK.encode_text(marker)
    at = next(i for i in range(len(base)) if base[i:i + len(run)] == run)
    for spelling in SPELLINGS:
        text = f"a{spelling}b"
        ids = render_prompt(TEMPLATE, TOK, slot_conversation(slot, text), [], "auto").ids
        assert ids == base[:at] + TOK.encode_text(text) + base[at + len(run):], spelling
