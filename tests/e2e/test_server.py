"""The real server through the openai client and httpx: chat completions streaming and not, every
bad input a 4xx with an OpenAI-shaped body, auth, disconnect frees pages, 64 concurrent streams."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def test_non_streaming_completion(server):
    resp = server.client().chat.completions.create(model=server.model, messages=USER, max_tokens=8, temperature=0,
                                                  logprobs=True, top_logprobs=3, tools=TOOLS)
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert resp.usage.completion_tokens == len(choice.logprobs.content) <= 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert all(len(item.top_logprobs) == 3 for item in choice.logprobs.content)


def test_streaming_equals_non_streaming_greedy(server):
    kwargs = dict(model=server.model, messages=USER, max_tokens=12, temperature=0, seed=7, logprobs=True)
    unary = server.client().chat.completions.create(**kwargs)
    chunks = list(server.client().chat.completions.create(**kwargs, stream=True,
                                                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    tokens = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert text == (unary.choices[0].message.content or "")
    assert tokens == [t.token for t in unary.choices[0].logprobs.content]
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == unary.choices[0].finish_reason


def test_stop_sequences_and_seeded_sampling(server):
    c = server.client()
    a = c.chat.completions.create(model=server.model, messages=USER, max_tokens=10, temperature=0.8, seed=3)
    b = c.chat.completions.create(model=server.model, messages=USER, max_tokens=10, temperature=0.8, seed=3)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_models_health_info(server):
    assert [m.id for m in server.client().models.list().data] == ["tiny-random"]
    assert httpx.get(server.url_for("health")).status_code == 200
    info = server.server_info()
    assert info["model"] == "tiny-random" and info["config_fingerprint"] and "torch" in info["versions"]
    # Resolved by the engine, not the config (the gate's perf key reads them): the CPU default is on.
    assert info["prefix_cache"] is True and info["disaggregation"] is None
    # `python -m runtime.serve` names its loop and parser (runtime/server/http_stack.py); uvicorn's "auto" would
    # run asyncio's loop wherever uvloop fails to import, and this would say "asyncio".
    assert info["event_loop"] == "uvloop"


BAD = [
    ("not json", b"{not json", 400, "not valid JSON"),
    ("wrong type", {"model": "tiny-random", "messages": USER, "max_tokens": "5"}, 400, "max_tokens"),
    ("missing messages", {"model": "tiny-random"}, 400, "messages"),
    ("empty messages", {"model": "tiny-random", "messages": []}, 400, "messages"),
    ("unknown role", {"model": "tiny-random", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("empty content", {"model": "tiny-random", "messages": [{"role": "user", "content": ""}]}, 400, "content"),
    ("prompt too long", {"model": "tiny-random", "messages": [{"role": "user", "content": "x" * 5000}],
                         "max_tokens": 4}, 400, "context"),
    ("max_tokens zero", {"model": "tiny-random", "messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens huge", {"model": "tiny-random", "messages": USER, "max_tokens": 10**6}, 400, "max_tokens"),
    ("unknown model", {"model": "gpt-17", "messages": USER}, 404, "gpt-17"),
    ("invalid tool schema", {"model": "tiny-random", "messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}]}, 400, "Schema"),
    ("named tool not in tools", {"model": "tiny-random", "messages": USER, "tools": TOOLS,
                                 "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "nope"),
    ("temperature out of range", {"model": "tiny-random", "messages": USER, "temperature": 9}, 400, "temperature"),
    ("body not an object", [1, 2], 400, "object"),
]


@pytest.mark.parametrize("name, body, status, needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_with_an_openai_error_body(server, name, body, status, needle):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(server.base_url + "/chat/completions", content=content,
                      headers={**server.headers, "Content-Type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle.lower() in error["message"].lower(), error


def test_too_large_body_is_413(server):
    big = json.dumps({"model": "tiny-random", "messages": [{"role": "user", "content": "x" * (5 << 20)}]})
    resp = httpx.post(server.base_url + "/chat/completions", content=big, headers=server.headers)
    assert resp.status_code == 413 and "exceeds" in resp.json()["error"]["message"]


def test_api_key_required(server):
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=server.model, messages=USER, max_tokens=2)
    assert httpx.get(server.base_url + "/models").status_code == 401


def finish_counts(server) -> dict[str, float]:
    """`dsv4_request_finish_total` by finish reason, from the Prometheus text."""
    text = httpx.get(server.url_for("metrics"), headers=server.headers).text
    prefix = 'dsv4_request_finish_total{reason="'
    return {line[len(prefix):].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def test_disconnect_mid_stream_aborts_the_request_and_frees_pages(server):
    before = finish_counts(server)
    with httpx.stream("POST", server.base_url + "/chat/completions", headers=server.headers,
                      json={"model": "tiny-random", "messages": USER, "max_tokens": 3000, "stream": True,
                            "temperature": 0}) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i > 6:
                assert server.kv_pages_in_use() > 0  # the request really holds pages while it streams
                break
    assert server.wait_kv_pages_idle() == 0
    # Pages return to 0 as well when the request simply runs to max_tokens inside that wait (the tiny
    # model is that fast), so only the finish reason shows the disconnect aborted it.
    after = finish_counts(server)
    changed = {reason: after[reason] - before.get(reason, 0.0) for reason in after
               if after[reason] != before.get(reason, 0.0)}
    assert changed == {"abort": 1.0}, f"finishes counted since the request started: {changed}"


def test_disconnect_while_waiting_for_a_unary_reply_aborts_the_request(server):
    """The non-streaming path: the handler notices the closed connection while tokens keep coming
    and aborts. The request needs seconds to finish on its own (it waited for an idle half second
    before looking, which a generating request never has), so a missing abort shows as another
    finish reason, not `abort`."""
    before = finish_counts(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/chat/completions", headers=server.headers, timeout=httpx.Timeout(10, read=1.0),
                   json={"model": "tiny-random", "messages": USER, "max_tokens": 3000, "temperature": 0})
    assert server.wait_kv_pages_idle() == 0
    after = finish_counts(server)
    changed = {reason: after[reason] - before.get(reason, 0.0) for reason in after
               if after[reason] != before.get(reason, 0.0)}
    assert changed == {"abort": 1.0}, f"finishes counted since the request started: {changed}"


def test_64_concurrent_streaming_clients_complete_and_server_stays_healthy(server):
    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        stream = await c.chat.completions.create(model=server.model, max_tokens=8, temperature=0, stream=True,
                                                 messages=[{"role": "user", "content": f"request {i}"}])
        reasons = [ch.choices[0].finish_reason async for ch in stream if ch.choices]
        return reasons[-1]

    async def main() -> list[str]:
        c = server.async_client(timeout=120)
        try:
            return await asyncio.gather(*(one(c, i) for i in range(64)))
        finally:
            await c.close()

    reasons = asyncio.run(main())
    assert len(reasons) == 64 and set(reasons) <= {"stop", "length"}
    assert server.wait_kv_pages_idle() == 0
    assert httpx.get(server.url_for("health")).status_code == 200
    metrics = httpx.get(server.url_for("metrics"), headers=server.headers).text
    assert 'status="500"' not in metrics
