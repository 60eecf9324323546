"""The default chat template renders conversations byte for byte as DeepSeek's V4 encoder does
(deepseek-recipe: the encoder SGLang renders DeepSeek-V4 prompts with), through the server's own
path (request validation, marking of request text, the template), over a corpus of conversations:
the 40 held-out canary sessions, hand-written edge cases (non-string, nested and non-ASCII
arguments, tool results, multi-turn, several calls) and generated argument values.

The canary model (golden/models/canary-moe-v2) is trained on this template, and the last tests
check that training renders exactly the prompts the server sends.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.server.chat_template import ChatTemplate
from runtime.server.prompt import render_prompt
from runtime.server.protocol import ChatCompletionRequest
from runtime.tokenizer import ByteTokenizer
from tests.reference_impls import deepseek_recipe, needs_recipe

pytestmark = pytest.mark.unit

DEFAULT = ChatTemplate.for_model(None)
BOS = "<｜begin▁of▁sentence｜>"
# tool_choice="required": the encoder writes the block's opening into the prompt; our server
# generates it by constrained decoding instead (app._required_opening), so it is not template text.
REQUIRED_PREFILL = "\n\n<｜DSML｜tool_calls>\n"
HELD_OUT = range(500_000, 500_040)  # the held-out sessions tests/unit/test_prompt_text.py uses

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & 'then' in a city — ünïcödé",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "a <city>"},
                                                    "days": {"type": "integer"},
                                                    "units": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
BARE = {"type": "function", "function": {"name": "ping"}}  # no description, no parameters


def call(name: str, arguments, cid: str) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": text}}


def calls_turn(*calls: dict, content: str = "") -> dict:
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


def result(cid: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": cid, "content": content}


USER = {"role": "user", "content": "Weather in Oslo?"}
EDGE_CASES = {
    "plain chat, no system": ([{"role": "user", "content": "hi"}], [], "auto"),
    "two systems, tools, no tool use": ([{"role": "system", "content": "A"}, {"role": "system", "content": "B"},
                                         USER], [WEATHER, BARE], "auto"),
    "tools without a system message": ([USER], [WEATHER], "auto"),
    "tool_choice none drops the tools": ([{"role": "system", "content": "S"}, USER], [WEATHER], "none"),
    "non-string, nested, non-ASCII and HTML-ish arguments": ([USER, calls_turn(call("get_weather", {
        "city": "Zürich <&> 'q'", "days": 3, "opts": {"z": 1, "a": "<b>", "ü": [True, None, 1.5, 1e20]},
        "tags": ["ä", "<x>"], "flag": False, "none": None, "pad": "  kept  "}, "c1")), result("c1", "sunny ☀ <ok> & 'fine'")],
        [WEATHER], "auto"),
    "content before calls, two calls, two results, answer, next turn": ([
        {"role": "system", "content": "You are helpful."}, USER,
        calls_turn(call("get_weather", {"city": "Oslo"}, "c1"), call("ping", {}, "c2"), content="Let me check."),
        result("c1", '{"temp": 3, "sky": "clear"}'), result("c2", "pong"),
        {"role": "assistant", "content": "3 °C and clear."}, {"role": "user", "content": "Thanks"}], [WEATHER, BARE],
        "auto"),
    "a user message right after tool results joins their turn": ([USER, calls_turn(call("ping", {}, "c1")),
                                                                  result("c1", "pong"), {"role": "user", "content": "and?"}],
                                                                 [BARE], "auto"),
    "two users in a row are one turn": ([USER, {"role": "user", "content": "Please."}], [], "auto"),
    "calls after calls": ([USER, calls_turn(call("ping", {}, "c1")), result("c1", "R1"),
                           calls_turn(call("ping", {}, "c2")), result("c2", "R2")], [BARE], "auto"),
    "a conversation ending with the assistant": ([USER, {"role": "assistant", "content": "Sunny."}], [], "auto"),
    "an assistant message first": ([{"role": "assistant", "content": "Hello."}, USER], [], "auto"),
    "arguments that are not a JSON object": ([USER, calls_turn(call("ping", "not json", "c1"), call("ping", "[1, 2]", "c2")),
                                              result("c1", "a"), result("c2", "b")], [BARE], "auto"),
    "text parts are paragraphs": ([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}], [], "auto"),
    "required": ([USER], [WEATHER], "required"),
}


def held_out_hops():
    """Every prompt the harness sends in a held-out canary session (the canary's tools and modes)."""
    from runtime.train.corpus import make_session, session_messages
    from runtime.train.tools import TOOLS

    for seed in HELD_OUT:
        session = make_session(seed)
        messages, reference_messages = [], session_messages(session)
        for at, message in enumerate(reference_messages):
            message = dict(message)
            if message.get("tool_calls"):
                message["tool_calls"] = [call(c["function"]["name"], c["function"]["arguments"], c["id"])
                                         for c in message["tool_calls"]]
            messages.append(message)
            following = reference_messages[at + 1]["role"] if at + 1 < len(reference_messages) else None
            # A prompt goes out after a user message and after the last result of a call turn.
            if message["role"] == "user" or (message["role"] == "tool" and following != "tool"):
                yield f"seed {seed}, {len(messages)} messages", list(messages), TOOLS, session.tool_choice


def body(messages, tools, choice) -> dict:
    out = {"model": "m", "messages": messages, "tool_choice": choice}
    if tools:
        out["tools"] = tools
    return out


def ours(messages, tools, choice, template: ChatTemplate = DEFAULT) -> str:
    """The prompt text the server builds (app._prepare), with the BOS it adds as an id."""
    req = ChatCompletionRequest.model_validate(body(messages, tools, choice))
    req.check()
    prompt = render_prompt(template, ByteTokenizer(512, 256, 257, 258),
                           [m.model_dump(exclude_none=True) for m in req.messages],
                           [t.model_dump(exclude_none=True) for t in req.tools or []], req.tool_choice_mode)
    return BOS + prompt.text


def reference(messages, tools, choice, prefill: bool = False) -> str:
    """The encoder's prompt; for "required" without the opening it prefills unless `prefill`."""
    request = {**body(messages, tools, choice), "model": "DeepSeek-V4-Pro", "thinking": {"type": "disabled"}}
    conversation = deepseek_recipe.ChatCompletionRequest(request).convert(deepseek_recipe.ConversionOptions()).conversation
    text = deepseek_recipe.DeepseekV4Encoding().render_conversation(conversation).prompt
    return text.removesuffix(REQUIRED_PREFILL) if choice == "required" and not prefill else text


def corpus():
    yield from ((name, *case) for name, case in EDGE_CASES.items())
    yield from held_out_hops()


def first_difference(a: str, b: str) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at {at}: ours {a[max(0, at - 40):at + 60]!r}\n      reference {b[max(0, at - 40):at + 60]!r}"


def disagreements(template: ChatTemplate = DEFAULT) -> list[str]:
    out = []
    for name, messages, tools, choice in corpus():
        mine, theirs = ours(messages, tools, choice, template), reference(messages, tools, choice)
        if mine != theirs:
            out.append(f"{name}: {first_difference(mine, theirs)}")
    return out


@needs_recipe
def test_default_template_renders_the_corpus_like_deepseeks_v4_encoder():
    found = disagreements()
    assert not found, "\n".join(found[:5])


def forced_opening(messages, tools, template: ChatTemplate = DEFAULT) -> str:
    """The text the server forces as the reply's first tokens for tool_choice="required"."""
    from runtime.server.app import _required_opening

    tok = ByteTokenizer(512, 256, 257, 258)
    req = ChatCompletionRequest.model_validate(body(messages, tools, "required"))
    return tok.decode(list(_required_opening(tok, template, req)))


@needs_recipe
def test_required_forces_the_opening_the_encoder_prefills():
    """The encoder writes "\n\n<｜DSML｜tool_calls>\n" into the prompt for "required"; the server
    generates it instead, by constrained decoding up to the tag (the model writes the newline):
    our prompt and the forced opening are the encoder's prompt up to the tag (the canary model is
    served with this template too)."""
    for messages in ([USER], [{"role": "system", "content": "S"}, USER, calls_turn(call("ping", {}, "c1")),
                              result("c1", "pong"), {"role": "assistant", "content": "Done."}, USER]):
        opened = ours(messages, [WEATHER, BARE], "required") + forced_opening(messages, [WEATHER, BARE])
        assert opened + "\n" == reference(messages, [WEATHER, BARE], "required", prefill=True)


# Integers within 64 bits: the encoder (Rust) reads a larger one as a float and writes
# -9223372036854775809 as -9.223372036854776e+18, losing the value; we keep it as sent.
# Known, not fixed: the encoder writes a small float's exponent unpadded (1.5e-7) where Python's
# JSON writes 1.5e-07 (same value, other bytes); such floats are left out here.
_json = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1)
                     | st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: "e-0" not in repr(x))
                     | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                     max_leaves=8)


@needs_recipe
@given(arguments=st.dictionaries(st.text(min_size=1, max_size=6), _json, max_size=4),
       output=st.text(max_size=20))
def test_any_arguments_and_tool_result_render_like_the_encoder(arguments, output):
    messages = [USER, calls_turn(call("get_weather", arguments, "c1")), result("c1", output or "x")]
    assert ours(messages, [WEATHER], "auto") == reference(messages, [WEATHER], "auto")


@needs_recipe
@pytest.mark.parametrize("planted", [
    ("<tool_result>", "<result>"),  # the form tool results had before
    ("| tojson)", "| tojson(sort_keys=True, ensure_ascii=True))"),  # Jinja's tojson: sorted, escaped
    ('"\\n\\n<｜DSML｜tool_calls>\\n"', '"<｜DSML｜tool_calls>\\n"'),  # no blank line before the block
])
def test_negative_control_each_former_difference_is_caught(planted):
    old, new = planted
    assert old in DEFAULT.source
    broken = ChatTemplate(DEFAULT.source.replace(old, new), "planted")
    assert disagreements(broken)


# ---- the canary model is trained on and served with the same template ----------------------------
CANARY = Path("golden/models/canary-moe-v2")


def test_canary_model_ships_the_default_template():
    """The canary is trained on DeepSeek's V4 form (runtime/train/template.py renders the default
    template), so its prompts are exactly what a V4 deployment renders."""
    assert ChatTemplate.for_model(CANARY).source == DEFAULT.source


def training_hops():
    """(name, the messages training renders (arguments as dicts), the same as a client sends them)."""
    from runtime.train.corpus import make_session, session_messages

    for seed in HELD_OUT[:10]:
        session = make_session(seed)
        sent = list(held_out_hops_of(seed))
        for name, messages, tools, choice in sent:
            yield name, session_messages(session)[:len(messages)], messages, tools, choice


def held_out_hops_of(seed: int):
    return (hop for hop in held_out_hops() if hop[0].startswith(f"seed {seed},"))


def training_mismatches(template_path: Path | None = None) -> tuple[list[str], int]:
    """Sessions whose training rendering differs from the server's prompt; template_path None:
    training's own default template."""
    from runtime.train.template import render

    paths = {} if template_path is None else {"path": template_path}
    hops = list(training_hops())
    return [name for name, trained, sent, tools, choice in hops
            if render(trained, tools, choice, **paths) != ours(sent, tools, choice)], len(hops)


def test_training_renders_what_the_server_sends():
    """Token for token, what the model learnt is what it is served: training's rendering of a
    session prefix (BOS included) equals the server's prompt text for the same messages, with the
    template training uses by default (the server's DEFAULT_TEMPLATE, one constant)."""
    mismatches, checked = training_mismatches()
    assert not mismatches and checked > 20


def test_training_template_is_the_servers_constant():
    """One source of truth: training's default template is the server's DEFAULT_TEMPLATE object,
    not a second path that happens to point at the same file today."""
    import inspect

    from runtime.server.chat_template import DEFAULT_TEMPLATE
    from runtime.train import template

    assert inspect.signature(template.render).parameters["path"].default is DEFAULT_TEMPLATE
    assert not hasattr(template, "TEMPLATE_PATH")


def test_negative_control_training_on_another_template_is_caught(tmp_path):
    planted = tmp_path / "planted.jinja"
    planted.write_text(DEFAULT.source.replace("<tool_result>", "<result>"))
    assert training_mismatches(planted)[0]
