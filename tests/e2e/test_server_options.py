"""Issue 18, items 4-5 through the app in-process (httpx ASGI transport, lifespan on): every option
honoured or a 400, tool results must answer a call, tool_choice="required" enforced, unique call
ids, streamed usage counts tokens, EOS never in the text, request text never control tokens, and a
repeated tool schema checked once. Negative controls plant each bug an oracle is meant to catch."""

from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager

import httpx
import pytest

from runtime.server import dsml
from runtime.server.app import create_app
from runtime.server.chat_template import call_opening
from tests.unit.test_prompt_text import SLOTS, slot_conversation

pytestmark = pytest.mark.e2e

USER = [{"role": "user", "content": "hello"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


class InProcess:
    """The app with its lifespan (the engine bridge) entered once, on one event loop, served
    through httpx's ASGI transport: no port, no process."""

    def __init__(self, model: str) -> None:
        from runtime.serve import build_state, parse_args

        self.state = build_state(parse_args(["--model", model]))
        self.model_name = self.state.model_name
        self.engine, self.template = self.state.engine, self.state.template
        self.loop = asyncio.new_event_loop()
        self.app = create_app(self.state)
        self._lifespan = self.app.router.lifespan_context(self.app)
        self.loop.run_until_complete(self._lifespan.__aenter__())
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://app")

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.run_until_complete(self._lifespan.__aexit__(None, None, None))
        self.loop.close()


@contextmanager
def in_process(model: str):
    server = InProcess(model)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def state():
    with in_process("tiny-random") as server:
        yield server


def post(server: InProcess, body: dict) -> httpx.Response:
    return server.loop.run_until_complete(
        server.client.post("/v1/chat/completions", json={"model": server.model_name, **body}))


def stream(server: InProcess, body: dict) -> list[dict]:
    async def go():
        async with server.client.stream("POST", "/v1/chat/completions",
                                         json={"model": server.model_name, "stream": True, **body}) as resp:
            assert resp.status_code == 200
            return [json.loads(line[6:]) async for line in resp.aiter_lines()
                    if line.startswith("data: ") and line != "data: [DONE]"]
    return server.loop.run_until_complete(go())


# ---- options: honoured or refused ---------------------------------------------------------------
@pytest.mark.parametrize("option", [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    {"logit_bias": {"42": 5}},
    {"presence_penalty": 0.5},
    {"frequency_penalty": -1.0},
    {"functions": [{"name": "f"}]},
    {"top_k": 3},
    {"store": True},
    {"service_tier": "flex"},
    {"max_completion_tokens": 2},
    {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    {"stream": True, "stream_options": {"include_obfuscation": True}},
    {"tools": [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]},
    {"messages": [{**USER[0], "prefix": True}]},
    {"messages": [*USER, {"role": "assistant", "content": "x", "reasoning_content": "because"}, *USER]},
    {"messages": [*USER, {"role": "assistant", "content": "x", "refusal": "I cannot"}, *USER]},
    {"messages": [*USER, {"role": "assistant", "content": "x", "audio": {"id": "audio_1"}}, *USER]},
], ids=str)
def test_unimplemented_option_is_a_400(state, option):
    resp = post(state, {"messages": USER, "max_tokens": 1, **option})
    assert resp.status_code == 400, resp.text
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


# What the openai client sends back when a conversation appends the assistant message it received.
ECHOED = {"role": "assistant", "content": "x", "refusal": None, "annotations": [], "audio": None,
          "function_call": None, "tool_calls": None}


@pytest.mark.parametrize("option", [
    {"response_format": {"type": "text"}}, {"logit_bias": {}}, {"presence_penalty": 0}, {"frequency_penalty": 0.0},
    {"user": "u1"}, {"service_tier": "auto"}, {"max_completion_tokens": 1},
    {"stream": True, "stream_options": {"include_obfuscation": False}},
    {"tools": [{"type": "function", "function": {**TOOLS[0]["function"], "strict": False}}]},
    {"messages": [*USER, ECHOED, *USER]},
], ids=str)
def test_option_at_its_honoured_value_is_accepted(state, option):
    assert post(state, {"messages": USER, "max_tokens": 1, **option}).status_code == 200


def test_tool_result_for_an_unknown_call_is_a_400(state):
    call = {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    ok = [*USER, {"role": "assistant", "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "call_a", "content": "1"}]
    assert post(state, {"messages": ok, "max_tokens": 1, "tools": TOOLS}).status_code == 200
    bad = [*ok, {"role": "tool", "tool_call_id": "call_b", "content": "2"}]
    resp = post(state, {"messages": bad, "max_tokens": 1, "tools": TOOLS})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages.3.tool_call_id"


# ---- tool_choice="required" ---------------------------------------------------------------------
def opening(state) -> str:
    return call_opening(state.template, dsml.BLOCK_OPEN)


def opening_tokens(state) -> int:
    return len(state.engine.tokenizer.encode(opening(state)))


def test_required_forces_the_block_opening(state):
    """tiny-random never writes DSML on its own: with required, its reply opens a tool-call block,
    written as its (default, DeepSeek V4) template writes one: a blank line, then the tag."""
    assert opening(state) == "\n\n" + dsml.BLOCK_OPEN
    n = opening_tokens(state)
    free = post(state, {"messages": USER, "max_tokens": n, "temperature": 0, "tools": TOOLS}).json()
    forced = post(state, {"messages": USER, "max_tokens": n, "temperature": 0, "tools": TOOLS,
                          "tool_choice": "required", "logprobs": True}).json()
    tok = state.engine.tokenizer
    assert [item["token"] for item in forced["choices"][0]["logprobs"]["content"]] == \
        [tok.decode([i]) for i in tok.encode(opening(state))]
    # The block opening went to the tool-call parser (an open block is not content), the free reply is text.
    assert len(forced["choices"][0]["logprobs"]["content"]) == n == forced["usage"]["completion_tokens"]
    assert not forced["choices"][0]["message"]["content"] and free["choices"][0]["message"]["content"]
    # Cut inside the block: no call, and never "tool_calls".
    assert forced["choices"][0]["finish_reason"] == "length" and "tool_calls" not in forced["choices"][0]["message"]


CALL_A = {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}


def test_required_after_tool_results_lets_the_model_answer(state):
    messages = [*USER, {"role": "assistant", "tool_calls": [CALL_A]},
                {"role": "tool", "tool_call_id": "call_a", "content": "1"}]
    body = {"messages": messages, "max_tokens": opening_tokens(state), "temperature": 0, "tools": TOOLS}
    # Not forced: tiny-random's free reply is text (a forced one is an open block, no content).
    assert post(state, {**body, "tool_choice": "required"}).json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "Answer briefly."}],
    [*USER, {"role": "assistant", "content": "Let me see"}],
    [*USER, {"role": "assistant", "tool_calls": [CALL_A]}, {"role": "tool", "tool_call_id": "call_a", "content": "1"},
     {"role": "user", "content": "and tomorrow?"}, {"role": "tool", "tool_call_id": "call_a", "content": "1"}],
], ids=["system-only", "assistant-prefix", "result-of-an-earlier-turn"])
def test_required_is_forced_whenever_the_turn_has_no_call_yet(state, messages):
    """Not only after a user message: a turn without a tool call opens a block, whatever the last
    message is (it was accepted and ignored for a system-only or assistant-last conversation)."""
    n = opening_tokens(state)
    reply = post(state, {"messages": messages, "max_tokens": n, "temperature": 0, "tools": TOOLS,
                         "tool_choice": "required"}).json()["choices"][0]
    assert not reply["message"]["content"] and reply["finish_reason"] == "length"
    free = post(state, {"messages": messages, "max_tokens": n, "temperature": 0, "tools": TOOLS}).json()
    assert free["choices"][0]["message"]["content"]  # tiny-random's own reply is text


# ---- usage, EOS, ids ----------------------------------------------------------------------------
def streamed_usage_counts_tokens(chunks: list[dict]) -> bool:
    tokens = sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks
                 if c["choices"] and c["choices"][0]["logprobs"])
    return chunks[-1]["usage"]["completion_tokens"] == tokens


def test_streamed_usage_counts_tokens_not_chunks(state):
    chunks = stream(state, {"messages": USER, "max_tokens": 12, "temperature": 0, "logprobs": True,
                            "stream_options": {"include_usage": True}})
    assert streamed_usage_counts_tokens(chunks)
    # Negative control: usage that counted chunks (the role chunk, the final chunk) fails the oracle.
    wrong = [*chunks[:-1], {**chunks[-1], "usage": {**chunks[-1]["usage"], "completion_tokens": len(chunks) - 1}}]
    assert not streamed_usage_counts_tokens(wrong)


def test_eos_ends_the_reply_and_never_reaches_the_text():
    """The output path, fed an EOS the way the bridge flags it: counted, logprobbed, no text."""
    from runtime.server.output import ChoiceBuilder, OutputOptions, fold
    from runtime.tokenizer import ByteTokenizer

    # A tokenizer whose EOS decodes to text, as an HF tokenizer's "<｜end▁of▁sentence｜>" does.
    class SpelledEos(ByteTokenizer):
        def decode(self, ids):
            return "".join("<eos>" if i == self.eos_token_id else ByteTokenizer.decode(self, [i]) for i in ids)

    tok = SpelledEos(320, 256, 257, 258)

    def reply(flag_eos: bool) -> str:
        builder = ChoiceBuilder(tok, OutputOptions(logprobs=True))
        deltas = [builder.push(t, -0.1, [], False) for t in tok.encode("hi")]
        deltas.append(builder.push(tok.eos_token_id, -0.1, [], flag_eos))
        deltas.append(builder.finish("stop")[0])
        folded = fold(deltas)
        assert len(folded["logprobs"]) == 3  # the EOS is a generated token
        return folded["message"]["content"]

    assert reply(flag_eos=True) == "hi"
    assert reply(flag_eos=False) == "hi<eos>"  # negative control: an unflagged EOS leaks


def unique_ids(message: dict) -> bool:
    ids = [c["id"] for c in message.get("tool_calls") or []]
    return len(ids) == len(set(ids))


def test_every_tool_call_has_its_own_id(monkeypatch):
    from runtime.server import output
    from runtime.server.output import ChoiceBuilder, OutputOptions, fold
    from runtime.tokenizer import ByteTokenizer

    tok = ByteTokenizer(320, 256, 257, 258)
    call = f'<{dsml.DSML}invoke name="f">\n{{"a": 1}}\n</{dsml.DSML}invoke>\n'
    text = dsml.BLOCK_OPEN + "\n" + call * 3 + f"</{dsml.DSML}tool_calls>"

    def message() -> dict:
        builder = ChoiceBuilder(tok, OutputOptions(parse_tools=True))
        deltas = [builder.push(t, 0.0, [], False) for t in tok.encode(text)] + [builder.finish("stop")[0]]
        return fold(deltas)["message"]

    assert len(message()["tool_calls"]) == 3 and unique_ids(message())
    monkeypatch.setattr(output, "new_call_id", lambda: "call_same")  # planted: one id for every call
    assert not unique_ids(message())


# ---- request text stays text; tool schemas checked once ----------------------------------------
@pytest.fixture(scope="module")
def canary_state():
    from pathlib import Path

    with in_process(str(Path(__file__).resolve().parents[2] / "golden" / "models" / "canary-moe-v2")) as server:
        yield server


@pytest.mark.parametrize("slot", SLOTS)
def test_spelled_control_tokens_cost_their_text_in_prompt_tokens(canary_state, slot):
    """Whoever spells "<｜User｜>" (or any added token) in any role pays for its characters as plain
    text: prompt_tokens grows by the plain-text encoding, not by one control token. Each slot sits
    between two control tokens of the canary template, so the difference is exactly the slot's."""
    tok = canary_state.engine.tokenizer

    def prompt_tokens(text: str) -> int:
        body = {"messages": slot_conversation(slot, text), "max_tokens": 1, "temperature": 0}
        resp = post(canary_state, body)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens"]

    base = prompt_tokens("ab")
    for spelling in tok.control_tokens:
        text = f"a{spelling}b"
        assert prompt_tokens(text) - base == len(tok.encode_text(text)) - len(tok.encode_text("ab")), spelling


def test_a_repeated_tool_schema_is_checked_once(state):
    from runtime.server.tool_schemas import VERDICTS

    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "description": "unique-to-this-test"}}}}}]
    before = VERDICTS.checks
    for _ in range(3):
        assert post(state, {"messages": USER, "max_tokens": 1, "tools": tools}).status_code == 200
    assert VERDICTS.checks == before + 1
    # The cache keys on content, not on identity: a different schema is checked.
    tools[0]["function"]["parameters"]["properties"]["n"]["type"] = "string"
    assert post(state, {"messages": USER, "max_tokens": 1, "tools": tools}).status_code == 200
    assert VERDICTS.checks == before + 2
