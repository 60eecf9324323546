"""A local HTTP proxy between the harness and a server that rewrites responses in flight, as a
hostile network or a buggy proxy would: the gate-level negative controls of issue 17 item 2.

`CorruptingProxy(upstream_root)` runs a Starlette app under uvicorn on a free loopback port in a
thread; its `rewrite` (a `Rewrite`, swappable between runs) sees every chat completion: the parsed
request body and the upstream response, a JSON object or the list of SSE `data:` payloads (each a
parsed chunk, or the string "[DONE]"). Streams are buffered whole and then re-sent: the controls
are about content and framing, not timing. Every other route (/metrics, /health, /v1/models) is
passed through, or rewritten by `Rewrite.metrics`.

A rewrite applies only from the second user turn on (`late`): a check that looks at the first turn
of a session only would miss every one of them.

`token_delay_s` (a number instead of None) makes it a slow server instead: streams pass through as
they come (no rewrite), each token no earlier than its arrival plus `token_delay_s` for every token
of the response so far, the first included: a server whose every decode step takes that much longer
(0: the same path with no delay, the fair A/B baseline of a delayed proxy). A non-streamed response
is held back by `token_delay_s` per completion token of its usage.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import threading
import time
from typing import Any

import httpx

from canary.targets import Target, free_port


def user_turns(body: dict) -> int:
    return sum(1 for m in body.get("messages", []) if m.get("role") == "user")


class Rewrite:
    """No change; subclasses override what they corrupt. `late`: the user turn (1-based count of
    user messages in the request) from which on responses are rewritten."""

    late = 2

    def applies(self, body: dict) -> bool:
        return user_turns(body) >= self.late

    def unary(self, body: dict, response: dict) -> dict:
        return response

    def stream(self, body: dict, payloads: list[Any]) -> list[Any]:
        return payloads

    def metrics(self, text: str) -> str | None:
        """The /metrics text to return; None answers 404 (a server without the endpoint)."""
        return text


def stream_calls(payloads: list[Any]) -> list[dict]:
    """Every tool-call delta of a stream, in order (the dicts themselves, to edit in place)."""
    return [tc for p in payloads if isinstance(p, dict) for ch in p.get("choices", [])
            for tc in (ch.get("delta") or {}).get("tool_calls") or []]


def content_deltas(payloads: list[Any]) -> list[dict]:
    return [ch["delta"] for p in payloads if isinstance(p, dict) for ch in p.get("choices", [])
            if (ch.get("delta") or {}).get("content")]


class CorruptingProxy:
    def __init__(self, upstream_root: str, rewrite: Rewrite | None = None) -> None:
        self.upstream_root = upstream_root.rstrip("/")
        self.rewrite = rewrite or Rewrite()
        self.rewritten = 0  # responses the rewrite changed (a control that changed nothing proves nothing)
        self.in_flight = 0  # chat requests being handled now, this one included (`UnderLoad`)
        self.token_delay_s: float | None = None  # a number: a slowed pass-through (module docstring)
        self.delayed_tokens = 0  # tokens held back by token_delay_s (a slowdown that delayed nothing proves nothing)
        self.port = free_port()
        self._server = None
        self._thread: threading.Thread | None = None

    def target(self, model: str) -> Target:
        # Not `embedded`: golden transcripts are off, as they are for any server but the embedded one.
        return Target(f"proxy:{self.port}", f"http://127.0.0.1:{self.port}/v1", model, False)

    def _app(self):
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response, StreamingResponse
        from starlette.routing import Route

        client = httpx.AsyncClient(base_url=self.upstream_root, timeout=300.0)

        async def chat(request: Request):
            self.in_flight += 1
            try:
                return await rewritten_chat(request)
            finally:
                self.in_flight -= 1

        async def rewritten_chat(request: Request):
            raw = await request.body()
            body = json.loads(raw)
            headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
            rewrite = self.rewrite
            if self.token_delay_s is not None:
                return await delayed(raw, body, headers, self.token_delay_s)
            if not body.get("stream"):
                upstream = await client.post("/v1/chat/completions", content=raw, headers=headers)
                if upstream.status_code != 200 or not rewrite.applies(body):
                    return Response(upstream.content, upstream.status_code, media_type="application/json")
                original = upstream.json()
                changed = rewrite.unary(body, copy.deepcopy(original))
                self.rewritten += changed != original
                return Response(json.dumps(changed), 200, media_type="application/json")
            async with client.stream("POST", "/v1/chat/completions", content=raw, headers=headers) as upstream:
                data = await upstream.aread()
            if upstream.status_code != 200:
                return Response(data, upstream.status_code, media_type="application/json")
            payloads = [line[5:].strip() for line in data.decode().splitlines() if line.startswith("data:")]
            payloads = [p if p == "[DONE]" else json.loads(p) for p in payloads]
            if rewrite.applies(body):
                changed = rewrite.stream(body, copy.deepcopy(payloads))
                self.rewritten += changed != payloads
                payloads = changed

            async def events():
                for p in payloads:
                    yield f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n".encode()

            return StreamingResponse(events(), media_type="text/event-stream")

        async def delayed(raw: bytes, body: dict, headers: dict, delay: float):
            if not body.get("stream"):
                upstream = await client.post("/v1/chat/completions", content=raw, headers=headers)
                if upstream.status_code == 200:
                    tokens = (upstream.json().get("usage") or {}).get("completion_tokens") or 0
                    self.delayed_tokens += tokens
                    await asyncio.sleep(delay * tokens)
                return Response(upstream.content, upstream.status_code, media_type="application/json")
            upstream = await client.send(client.build_request("POST", "/v1/chat/completions", content=raw,
                                                              headers=headers), stream=True)
            if upstream.status_code != 200:
                data = await upstream.aread()
                await upstream.aclose()
                return Response(data, upstream.status_code, media_type="application/json")
            lines: asyncio.Queue = asyncio.Queue()

            async def read() -> None:  # the upstream's pace, whatever the delay holds back
                try:
                    async for line in upstream.aiter_lines():
                        await lines.put((time.perf_counter(), line))
                finally:
                    await lines.put(None)
                    await upstream.aclose()

            async def events():
                reader = asyncio.create_task(read())
                tokens = 0
                while (item := await lines.get()) is not None:
                    arrived, line = item
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload != "[DONE]" and any((ch.get("delta") or {}).get("content")
                                                   or (ch.get("delta") or {}).get("tool_calls")
                                                   for ch in json.loads(payload).get("choices") or []):
                        tokens += 1
                        self.delayed_tokens += 1
                        await asyncio.sleep(max(0.0, arrived + tokens * delay - time.perf_counter()))
                    yield f"data: {payload}\n\n".encode()
                await reader

            return StreamingResponse(events(), media_type="text/event-stream")

        async def passthrough(request: Request):
            upstream = await client.request(request.method, request.url.path, headers=dict(request.headers),
                                            content=await request.body())
            if request.url.path == "/metrics":
                text = self.rewrite.metrics(upstream.text)
                if text is None:
                    return Response("not found", 404)
                return Response(text, upstream.status_code, media_type="text/plain")
            return Response(upstream.content, upstream.status_code,
                            media_type=upstream.headers.get("content-type"))

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                 Route("/{path:path}", passthrough, methods=["GET", "POST"])])

    def __enter__(self) -> CorruptingProxy:
        import uvicorn

        config = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        for _ in range(200):
            if self._server.started:
                return self
            threading.Event().wait(0.05)
        raise RuntimeError("corrupting proxy did not start")

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


class UnderLoad(Rewrite):
    """`inner` only while another chat request is in flight at the proxy: a corruption that shows
    under load and never alone, as the seeds' batching bugs did (a calibration run, one session at a
    time, and the load-vs-solo replays see a clean server)."""

    def __init__(self, inner: Rewrite, proxy: CorruptingProxy) -> None:
        self.inner, self.proxy = inner, proxy

    def applies(self, body):
        return self.proxy.in_flight >= 2 and self.inner.applies(body)

    def unary(self, body, response):
        return self.inner.unary(body, response)

    def stream(self, body, payloads):
        return self.inner.stream(body, payloads)


# ---- the rewrites the controls plant ----------------------------------------------------------

class DropLastCall(Rewrite):
    """A response with several tool calls loses its last one, streamed and not (so stream and
    non-stream still agree: only the required-calls oracle can see it)."""

    def unary(self, body, response):
        message = response["choices"][0]["message"]
        if len(message.get("tool_calls") or []) >= 2:
            message["tool_calls"].pop()
        return response

    def stream(self, body, payloads):
        indexes = {tc["index"] for tc in stream_calls(payloads)}
        if len(indexes) < 2:
            return payloads
        last = max(indexes)
        for p in payloads:
            for ch in p.get("choices", []) if isinstance(p, dict) else []:
                delta = ch.get("delta") or {}
                if delta.get("tool_calls"):
                    delta["tool_calls"] = [tc for tc in delta["tool_calls"] if tc["index"] != last]
        return payloads


def _bump_last_digit(text: str) -> str:
    """The last digit of the text + 1 (mod 10), only past the `[NONCE]` prefix: a value in the
    answer body (a changed nonce is the nonce oracle's, which caught it before this issue)."""
    match = None
    for match in re.finditer(r"\d", text):  # noqa: B007 - the loop keeps the last digit's match
        pass
    if match is None or match.start() < text.find("]"):
        return text
    i = match.start()
    return text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:]


class AnswerDigit(Rewrite):
    """A digit changed in the final answer text (no tool calls), streamed and not alike."""

    def unary(self, body, response):
        message = response["choices"][0]["message"]
        if message.get("content") and not message.get("tool_calls"):
            message["content"] = _bump_last_digit(message["content"])
        return response

    def stream(self, body, payloads):
        if stream_calls(payloads):
            return payloads
        deltas = content_deltas(payloads)
        if not deltas:
            return payloads
        # The whole answer decides which digit (the prefix may span deltas); the delta holding it changes.
        text = "".join(d["content"] for d in deltas)
        changed = _bump_last_digit(text)
        if changed != text:
            at = next(i for i, (a, b) in enumerate(zip(text, changed)) if a != b)
            for d in deltas:
                if at < len(d["content"]):
                    d["content"] = d["content"][:at] + changed[at] + d["content"][at + 1:]
                    break
                at -= len(d["content"])
        return payloads


class ReferenceNonceSwap(Rewrite):
    """The non-streamed request that repeats a streamed one (the harness's reference) answers with
    another live session's nonce; every other response is left alone."""

    def __init__(self) -> None:
        self.streamed: set[str] = set()
        self.nonces: set[str] = set()

    @staticmethod
    def _key(body: dict) -> str:
        return json.dumps(body.get("messages"), sort_keys=True)

    @staticmethod
    def _nonce(body: dict) -> str | None:
        match = re.search(r"nonce: ([A-Z0-9]+)", str(body["messages"][0].get("content")))
        return match.group(1) if match else None

    def applies(self, body):
        self.nonces.add(self._nonce(body))
        if body.get("stream"):
            self.streamed.add(self._key(body))
            return False
        return super().applies(body) and self._key(body) in self.streamed

    def unary(self, body, response):
        own = self._nonce(body)
        other = sorted(n for n in self.nonces if n and n != own)
        message = response["choices"][0]["message"]
        if other and own and message.get("content"):
            message["content"] = message["content"].replace(own, other[0])
        return response


class DropUsageChunk(Rewrite):
    def stream(self, body, payloads):
        return [p for p in payloads if not (isinstance(p, dict) and p.get("usage") and not p.get("choices"))]


class DropDone(Rewrite):
    def stream(self, body, payloads):
        return [p for p in payloads if p != "[DONE]"]


class DuplicateCallId(Rewrite):
    """The second tool call of a response carries the first one's id."""

    def unary(self, body, response):
        calls = response["choices"][0]["message"].get("tool_calls") or []
        if len(calls) >= 2:
            calls[1]["id"] = calls[0]["id"]
        return response

    def stream(self, body, payloads):
        first = next((tc.get("id") for tc in stream_calls(payloads) if tc["index"] == 0 and tc.get("id")), None)
        for tc in stream_calls(payloads):
            if tc["index"] == 1 and tc.get("id"):
                tc["id"] = first
        return payloads


class SparseIndexes(Rewrite):
    """Stream only: tool call index 1 becomes 2 (a gap: was a call dropped?)."""

    def stream(self, body, payloads):
        for tc in stream_calls(payloads):
            if tc["index"] == 1:
                tc["index"] = 2
        return payloads


class ControlText(Rewrite):
    """The EOS token's text leaks into the final answer, streamed and not."""

    def unary(self, body, response):
        message = response["choices"][0]["message"]
        if message.get("content") and not message.get("tool_calls"):
            message["content"] += "<｜end▁of▁sentence｜>"
        return response

    def stream(self, body, payloads):
        deltas = content_deltas(payloads)
        if deltas and not stream_calls(payloads):
            deltas[-1]["content"] += "<｜end▁of▁sentence｜>"
        return payloads


class StreamOnlyWhitespace(Rewrite):
    """Stream only: one more space after the nonce in the answer. Only stream == non-stream can
    see it, so this is the control for that oracle's failures reaching the verdict."""

    def stream(self, body, payloads):
        deltas = content_deltas(payloads)
        if deltas and not stream_calls(payloads):
            deltas[0]["content"] = deltas[0]["content"].replace("] ", "]  ", 1)
            if "]  " not in deltas[0]["content"]:
                deltas[-1]["content"] += " "
        return payloads


class ReserializeArguments(Rewrite):
    """Stream only, harmless: tool arguments re-serialized with other whitespace. The same object:
    no oracle may fire (the positive control for comparing parsed arguments). Key order stays: the
    harness sends the arguments back in the next request and the server renders the object's keys
    in the order given, so reordered keys change the next prompt (the canary model, trained on one
    order, then answered `8138.3 CHF` for `4138.3 CHF`: a real wrong answer, which the
    grounded-answer oracle rightly failed). Reordered keys are shown equal in tests/unit."""

    def stream(self, body, payloads):
        by_index: dict[int, list[dict]] = {}
        for tc in stream_calls(payloads):
            by_index.setdefault(tc["index"], []).append(tc)
        for deltas in by_index.values():
            pieces = [d for d in deltas if (d.get("function") or {}).get("arguments")]
            if not pieces:
                continue
            args = json.loads("".join(d["function"]["arguments"] for d in pieces))
            pieces[0]["function"]["arguments"] = json.dumps(args, indent=1, separators=(" ,", ":  "))
            for d in pieces[1:]:
                d["function"]["arguments"] = ""
        return payloads


class RepeatCalls(Rewrite):
    """Non-streamed: after the tool results of a late turn, the response repeats the turn's last
    calls instead of answering, so the turn never ends (the session runs out of MAX_HOPS)."""

    def applies(self, body):
        return super().applies(body) and not body.get("stream") and body["messages"][-1].get("role") == "tool"

    def unary(self, body, response):
        last = next(m for m in reversed(body["messages"]) if m.get("role") == "assistant" and m.get("tool_calls"))
        choice = response["choices"][0]
        choice["message"] = {"role": "assistant", "content": None, "tool_calls": [
            {**c, "id": f"{c['id']}-again{len(body['messages'])}"} for c in last["tool_calls"]]}
        choice["finish_reason"] = "tool_calls"
        return response


class UnreadableChunk(Rewrite):
    """Stream only: one chunk is not JSON: the client cannot read the stream at all."""

    def stream(self, body, payloads):
        return payloads[:1] + ["{not json"] + payloads[1:]


class KvPagesLeft(Rewrite):
    """/metrics says 5 KV pages are still in use after every session ended."""

    def applies(self, body):
        return False

    def metrics(self, text):
        return re.sub(r"^(\S*kv_pages_in_use\S*) \S+$", r"\1 5", text, flags=re.MULTILINE)


class NoMetrics(Rewrite):
    def applies(self, body):
        return False

    def metrics(self, text):
        return None


# ---- late-turn controls for the oracles that were already there ---------------------------------

class ArgumentDigit(Rewrite):
    """Non-streamed: the last digit in a tool call's arguments + 1 (still valid JSON and schema)."""

    def unary(self, body, response):
        for call in response["choices"][0]["message"].get("tool_calls") or []:
            args = call["function"]["arguments"]
            digits = [m.start() for m in re.finditer(r"\d", args)]
            if digits:
                i = digits[-1]
                call["function"]["arguments"] = args[:i] + str((int(args[i]) + 1) % 10) + args[i + 1:]
                break
        return response


class WrongFinishReason(Rewrite):
    """A plain answer claims `tool_calls` ("length" would be the usage oracle's: too few tokens)."""

    def unary(self, body, response):
        choice = response["choices"][0]
        if choice["finish_reason"] == "stop":
            choice["finish_reason"] = "tool_calls"
        return response


class UsageOffByOne(Rewrite):
    def unary(self, body, response):
        response["usage"]["total_tokens"] += 1
        return response


class ReplacementCharacter(Rewrite):
    def unary(self, body, response):
        message = response["choices"][0]["message"]
        if message.get("content"):
            message["content"] = message["content"].replace(" ", " \ufffd", 1)
        return response


class AlteredNonce(Rewrite):
    """The session's nonce in a late answer loses its last character (no other nonce appears)."""

    def unary(self, body, response):
        nonce = ReferenceNonceSwap._nonce(body)
        message = response["choices"][0]["message"]
        if nonce and message.get("content") and f"[{nonce}]" in message["content"]:
            message["content"] = message["content"].replace(nonce, nonce[:-1] + ("A" if nonce[-1] != "A" else "B"))
        return response


# ---- controls for a server and model this project did not write (tests/e2e/test_third_party.py) ----

class BySession(Rewrite):
    """Several controls in one run: session i's responses get `kinds[i % len(kinds)]` (the session
    found by the nonce in its system prompt); `changed[kind name]` holds the sessions each changed."""

    def __init__(self, kinds: list[Rewrite], nonces: list[str]) -> None:
        self.kinds, self.sessions = kinds, {nonce: i for i, nonce in enumerate(nonces)}
        self.changed: dict[str, set[int]] = {}

    def _session(self, body: dict) -> int | None:
        return self.sessions.get(ReferenceNonceSwap._nonce(body) or "")

    def _kind(self, body: dict) -> Rewrite:
        session = self._session(body)
        return Rewrite() if session is None else self.kinds[session % len(self.kinds)]

    def applies(self, body):
        return self._kind(body).applies(body)

    def _note(self, body: dict, before: Any, after: Any) -> None:
        if before != after:
            self.changed.setdefault(type(self._kind(body)).__name__, set()).add(self._session(body))

    def unary(self, body, response):
        before = copy.deepcopy(response)
        after = self._kind(body).unary(body, response)
        self._note(body, before, after)
        return after

    def stream(self, body, payloads):
        before = copy.deepcopy(payloads)
        after = self._kind(body).stream(body, payloads)
        self._note(body, before, after)
        return after


class ForeignNonce(Rewrite):
    """Another live session's nonce appended to the answer text, streamed and not: bleed that needs
    no model able to echo its own nonce."""

    def __init__(self, nonces: list[str]) -> None:
        self.nonces = nonces

    def _other(self, body: dict) -> str:
        own = ReferenceNonceSwap._nonce(body)
        return next(n for n in self.nonces if n != own)

    def unary(self, body, response):
        message = response["choices"][0]["message"]
        message["content"] = (message.get("content") or "") + f" [{self._other(body)}]"
        return response

    def stream(self, body, payloads):
        deltas = content_deltas(payloads)
        if deltas:
            deltas[-1]["content"] += f" [{self._other(body)}]"
        return payloads


class SwapTokens(Rewrite):
    """Two adjacent tokens of the answer change places, text and logprobs alike (the reply stays
    self-consistent, as an engine that mixed up two positions would send it)."""

    @staticmethod
    def _pair(tokens: list[str]) -> int | None:
        middle = len(tokens) // 2
        return next((i for i in range(middle, len(tokens) - 1) if tokens[i] != tokens[i + 1]), None)

    def unary(self, body, response):
        choice = response["choices"][0]
        entries = (choice.get("logprobs") or {}).get("content") or []
        tokens = [e["token"] for e in entries]
        i = self._pair(tokens)
        content = choice["message"].get("content") or ""
        if i is None or "".join(tokens) != content:
            return response
        entries[i], entries[i + 1] = entries[i + 1], entries[i]
        choice["message"]["content"] = "".join(e["token"] for e in entries)
        return response

    def stream(self, body, payloads):
        chunks = [ch for p in payloads if isinstance(p, dict) for ch in p.get("choices", [])
                  if (ch.get("delta") or {}).get("content") and (ch.get("logprobs") or {}).get("content")]
        i = self._pair([ch["delta"]["content"] for ch in chunks])
        if i is not None:
            a, b = chunks[i], chunks[i + 1]
            a["delta"]["content"], b["delta"]["content"] = b["delta"]["content"], a["delta"]["content"]
            a["logprobs"], b["logprobs"] = b["logprobs"], a["logprobs"]
        return payloads


class OneCharacter(Rewrite):
    """One character of the answer text changed, streamed and not, logprobs untouched: its first digit
    + 1 (mod 10), or in an answer without digits its first letter's case flipped (a model that does
    not echo its nonce gets no `[NONCE]` prefix to skip, AnswerDigit's rule)."""

    @staticmethod
    def _change(text: str) -> str:
        match = re.search(r"\d", text) or re.search(r"[A-Za-z]", text)
        if match is None:
            return text
        i, ch = match.start(), text[match.start()]
        return text[:i] + (str((int(ch) + 1) % 10) if ch.isdigit() else ch.swapcase()) + text[i + 1:]

    def unary(self, body, response):
        message = response["choices"][0]["message"]
        if message.get("content"):
            message["content"] = self._change(message["content"])
        return response

    def stream(self, body, payloads):
        for delta in content_deltas(payloads):
            changed = self._change(delta["content"])
            if changed != delta["content"]:
                delta["content"] = changed
                break
        return payloads
