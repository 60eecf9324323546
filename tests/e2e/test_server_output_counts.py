"""Issue 18 item 5, the output side, through the app in-process (tests/e2e/test_server_options.py's
harness): every tool call of a response has its own id, usage counts tokens (not chunks) streamed
and not, and EOS never reaches the text; logprob bytes rebuild the reply, DSML returned as content
is counted, and parallel_tool_calls=false ends the reply at its first call. The canary model writes
real DSML and ends its replies with EOS; tiny-random gives long replies whose text a stop string
holds back. Each oracle has a negative control that plants the bug it is meant to catch in the
running server."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from runtime.train.corpus import make_session
from runtime.train.tools import TOOLS
from tests.e2e.test_server_options import in_process, post, stream

pytestmark = pytest.mark.e2e

CANARY = Path(__file__).resolve().parents[2] / "golden" / "models" / "canary-moe-v2"
EOS_TEXT = "<\uff5cend\u2581of\u2581sentence\uff5c>"


@pytest.fixture(scope="module")
def canary():
    with in_process(str(CANARY)) as server:
        yield server


@pytest.fixture(scope="module")
def tiny():
    with in_process("tiny-random") as server:
        yield server


def first_turn(predicate) -> tuple[list[dict], object]:
    """The system and user messages of the first canary session turn that `predicate` accepts."""
    for seed in range(500):
        session = make_session(seed)
        turn = session.turns[0]
        if predicate(session, turn):
            return [{"role": "system", "content": session.system}, {"role": "user", "content": turn.user}], session
    raise AssertionError("no such session")


def streamed_message(chunks: list[dict]) -> tuple[str, list[dict], str, list[dict]]:
    """(content, tool calls, finish_reason, logprob entries) that a stream adds up to."""
    content, calls, finish, logprobs = "", {}, "", []
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                entry["id"] += call.get("id", "")
                entry["name"] += call["function"].get("name", "")
                entry["arguments"] += call["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
            logprobs += (choice.get("logprobs") or {}).get("content") or []
    return content, [calls[i] for i in sorted(calls)], finish, logprobs


# ---- ids ----------------------------------------------------------------------------------------
def own_ids(ids: list[str]) -> bool:
    return all(ids) and len(set(ids)) == len(ids)


def test_parallel_calls_each_have_their_own_id_streamed_and_not(canary):
    messages, _ = first_turn(lambda s, t: s.tool_choice == "auto" and len(t.calls) == 2)
    body = {"messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 200}
    unary = post(canary, body).json()["choices"][0]
    assert unary["finish_reason"] == "tool_calls" and len(unary["message"]["tool_calls"]) == 2
    _, calls, finish, _ = streamed_message(stream(canary, body))
    assert finish == "tool_calls" and len(calls) == 2
    unary_ids = [c["id"] for c in unary["message"]["tool_calls"]]
    assert own_ids(unary_ids) and own_ids([c["id"] for c in calls])
    assert not set(unary_ids) & {c["id"] for c in calls}  # ids are unique across responses too
    assert not own_ids([unary_ids[0], unary_ids[0]]) and not own_ids(["", "x"])  # the oracle can fail


# ---- EOS ----------------------------------------------------------------------------------------
def test_eos_is_counted_and_logprobbed_but_never_in_the_text(canary, monkeypatch):
    """A plain answer ends with the model's EOS: finish_reason "stop", the EOS is the last logprob
    entry and counts in usage, and its spelling is not in the content, streamed or not. Negative
    control: a bridge that stops flagging EOS as a stop token puts it into the text."""
    from runtime.server import bridge

    messages, session = first_turn(lambda s, t: s.tool_choice == "none")
    body = {"messages": messages, "tools": TOOLS, "tool_choice": "none", "temperature": 0, "max_tokens": 200,
            "logprobs": True}

    def replies() -> list[tuple[str, str, list[dict], int]]:
        unary = post(canary, body).json()
        chunks = stream(canary, {**body, "stream_options": {"include_usage": True}})
        content, _, finish, logprobs = streamed_message(chunks)
        choice = unary["choices"][0]
        return [(choice["message"]["content"], choice["finish_reason"], choice["logprobs"]["content"],
                 unary["usage"]["completion_tokens"]),
                (content, finish, logprobs, chunks[-1]["usage"]["completion_tokens"])]

    for content, finish, logprobs, completion_tokens in replies():
        assert finish == "stop" and logprobs[-1]["token"] == EOS_TEXT
        assert completion_tokens == len(logprobs)
        assert EOS_TEXT not in content and content == session.turns[0].answer

    real = bridge.TokenOut
    monkeypatch.setattr(bridge, "TokenOut", lambda *a: real(*a[:-1], False))  # planted: EOS unflagged
    assert all(content.endswith(EOS_TEXT) for content, *_ in replies())


# ---- usage --------------------------------------------------------------------------------------
def test_usage_counts_tokens_while_a_stop_string_holds_the_text_back(tiny):
    """A stop string holds back the text that could start it, so tokens and chunks differ; usage
    counts the tokens, streamed and not (a server counting chunks or deltas reports fewer)."""
    max_tokens = 24
    body = {"messages": [{"role": "user", "content": "hello"}], "temperature": 0, "max_tokens": max_tokens,
            "stop": ["\x00never\x00" * 3]}
    unary = post(tiny, body).json()
    chunks = stream(tiny, {**body, "stream_options": {"include_usage": True}})
    content, _, finish, _ = streamed_message(chunks)
    assert unary["choices"][0]["finish_reason"] == finish == "length"
    assert content == unary["choices"][0]["message"]["content"]
    assert unary["usage"]["completion_tokens"] == chunks[-1]["usage"]["completion_tokens"] == max_tokens
    # The oracle can fail: chunks that carried text (or any delta) are fewer than the tokens.
    with_text = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(with_text) < max_tokens and len(chunks) - 1 != max_tokens



# ---- logprob bytes ------------------------------------------------------------------------------
def test_logprob_bytes_rebuild_the_reply_streamed_and_not(tiny):
    """tiny-random's tokens are single bytes, so a seeded reply holds multi-byte characters split
    across tokens (and stray bytes). Joined, the entries' bytes decode to the reply exactly as the
    tokenizer decodes it, and every top_logprobs alternative is one byte or none; the old `bytes`
    (each token's decoded text, U+FFFD for a split character) rebuild U+FFFDs instead."""
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "seed": 2, "max_tokens": 100,
            "logprobs": True, "top_logprobs": 3}
    choice = post(tiny, body).json()["choices"][0]
    replies = [(choice["message"]["content"], choice["logprobs"]["content"]), streamed_message(stream(tiny, body))[::3]]
    for content, entries in replies:
        assert any(len(ch.encode()) > 1 and ch != "\ufffd" for ch in content)  # the premise: split characters
        rebuilt = b"".join(bytes(e["bytes"]) for e in entries)
        assert rebuilt.decode("utf-8", errors="replace") == content
        assert all(len(top["bytes"]) <= 1 for e in entries for top in e["top_logprobs"])
        old = b"".join(e["token"].encode() for e in entries)  # negative control: the text's bytes
        assert old.decode("utf-8", errors="replace") != content


# ---- DSML returned as content is counted --------------------------------------------------------
def rejected_counts(server) -> dict[str, float]:
    """`dsv4_dsml_rejected_total` by reason, from the Prometheus text."""
    text = server.loop.run_until_complete(server.client.get("/metrics")).text
    prefix = 'dsv4_dsml_rejected_total{reason="'
    return {line[len(prefix):].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def test_dsml_returned_as_content_is_counted_by_reason(canary):
    """Once per reply, streamed and not: a call cut by max_tokens inside its invoke is content, finish
    "length", counted as an unclosed invoke; an invoke of a tool the request did not offer (the
    canary calls it anyway) is content, counted as an unknown tool name. The same call left to
    finish among the offered tools counts nothing."""
    messages, session = first_turn(lambda s, t: s.tool_choice == "auto" and len(t.calls) == 1)
    body = {"messages": messages, "tools": TOOLS, "temperature": 0}
    name = session.turns[0].calls[0].name
    others = {**body, "max_tokens": 200, "tools": [t for t in TOOLS if t["function"]["name"] != name]}
    before = rejected_counts(canary)
    assert post(canary, {**body, "max_tokens": 200}).json()["choices"][0]["finish_reason"] == "tool_calls"
    assert streamed_message(stream(canary, {**body, "max_tokens": 200}))[2] == "tool_calls"
    assert rejected_counts(canary) == before  # a clean call is not counted
    cut = post(canary, {**body, "max_tokens": 12}).json()["choices"][0]
    assert cut["finish_reason"] == "length" and "invoke" in cut["message"]["content"]
    assert streamed_message(stream(canary, {**body, "max_tokens": 12}))[2] == "length"
    unknown = post(canary, others).json()["choices"][0]["message"]
    assert f'invoke name="{name}"' in unknown["content"] and "tool_calls" not in unknown
    assert f'invoke name="{name}"' in streamed_message(stream(canary, others))[0]
    after = rejected_counts(canary)
    assert {r: n - before.get(r, 0.0) for r, n in after.items() if n != before.get(r, 0.0)} == {
        "unclosed invoke": 2.0, "unknown tool name": 2.0}


# ---- parallel_tool_calls=false ------------------------------------------------------------------
def metric(server, prefix: str) -> float:
    text = server.loop.run_until_complete(server.client.get("/metrics")).text
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


def kv_pages_in_use(server) -> float:
    return metric(server, "dsv4_kv_pages_in_use ")


def finished(server, reason: str) -> float:
    return metric(server, f'dsv4_request_finish_total{{reason="{reason}"}} ')


def test_parallel_tool_calls_false_ends_the_reply_at_its_first_call(canary):
    """A turn the model answers with two calls, asked with parallel_tool_calls=false: the reply is
    the model's own reply up to the close of its first invoke, token for token (logprobs, usage),
    with that call and finish "tool_calls", streamed and not; the request stops there and its pages
    return. The old server generated both calls and dropped the second from a reply whose tokens
    still held it."""
    messages, _ = first_turn(lambda s, t: s.tool_choice == "auto" and len(t.calls) == 2)
    body = {"messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 200, "logprobs": True}
    both = post(canary, body).json()["choices"][0]
    tokens = [e["token"] for e in both["logprobs"]["content"]]
    assert len(both["message"]["tool_calls"]) == 2
    first = tokens[: tokens.index("</\uff5cDSML\uff5cinvoke>") + 1]
    single = {**body, "parallel_tool_calls": False}
    aborts, stops = finished(canary, "abort"), finished(canary, "stop")
    unary = post(canary, single).json()
    chunks = stream(canary, {**single, "stream_options": {"include_usage": True}})
    _, calls, finish, logprobs = streamed_message(chunks)
    replies = [(unary["choices"][0]["message"]["tool_calls"], unary["choices"][0]["finish_reason"],
                unary["choices"][0]["logprobs"]["content"], unary["usage"]["completion_tokens"]),
               ([{"function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls], finish, logprobs,
                chunks[-1]["usage"]["completion_tokens"])]
    for got_calls, got_finish, entries, completion_tokens in replies:
        assert got_finish == "tool_calls"
        assert [c["function"] for c in got_calls] == [both["message"]["tool_calls"][0]["function"]]
        assert [e["token"] for e in entries] == first and completion_tokens == len(first)
    deadline = time.monotonic() + 10
    while kv_pages_in_use(canary) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_pages_in_use(canary) == 0
    # Both replies were complete: counted as stops, not as aborts (no client gave up).
    assert (finished(canary, "abort"), finished(canary, "stop")) == (aborts, stops + 2)
