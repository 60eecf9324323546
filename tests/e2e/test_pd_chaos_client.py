"""The PD chaos checks' request classifier (canary/pd_chaos.py) against a fake router whose every
route plants one way of failing: it must call a named OpenAI error an error, and a bare 500, a
stream cut without [DONE] or error, an error body without a code and a slow answer failures of their
own (unnamed, hang). These are the negative controls of the chaos test's "every failure named, no
hang" oracles."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from canary import pd_chaos
from tests.e2e.launch import serve_in_thread


def chunk(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"delta": {"content": text}, "finish_reason": None}]}) + "\n\n"


NAMED = {"error": {"message": "decode server down", "type": "server_error", "code": "pd_upstream_unreachable"}}


def fake_router() -> FastAPI:
    app = FastAPI()

    @app.post("/{mode}/v1/chat/completions")
    async def chat(mode: str, request: Request):
        stream = (await request.json()).get("stream")
        if mode == "named":
            return JSONResponse(NAMED, status_code=502)
        if mode == "bare-500":
            return PlainTextResponse("Internal Server Error", status_code=500)
        if mode == "no-code":
            return JSONResponse({"error": {"message": "x", "type": "server_error", "code": None}}, status_code=502)
        if mode == "slow":
            await asyncio.sleep(3)
        if mode == "ok" and not stream:
            return JSONResponse({"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]})

        async def events():
            if mode == "held":  # headers out at once, the body only later (a PD stream while the prompt computes)
                await asyncio.sleep(3)
            for text in ("a", "b", "c"):
                yield chunk(text)
            if mode == "named-in-stream":
                yield "data: " + json.dumps(NAMED) + "\n\n"
            elif mode != "cut":
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def url():
    with serve_in_thread(fake_router()) as root:
        yield root


@pytest.mark.parametrize("mode, stream, kind, code", [
    ("ok", False, pd_chaos.OK, None),
    ("ok", True, pd_chaos.OK, None),
    ("named", True, pd_chaos.ERROR, "pd_upstream_unreachable"),
    ("named-in-stream", True, pd_chaos.ERROR, "pd_upstream_unreachable"),
    ("bare-500", False, pd_chaos.UNNAMED, None),
    ("no-code", False, pd_chaos.UNNAMED, None),
    ("cut", True, pd_chaos.UNNAMED, None),
    ("slow", False, pd_chaos.HANG, None),
])
def test_each_way_of_failing_is_classified(url, mode, stream, kind, code):
    out = pd_chaos.chat(f"{url}/{mode}", "m", "hello", stream=stream, timeout_s=1.0)
    assert (out.kind, out.code) == (kind, code), out


def test_an_abort_is_the_clients_own_and_keeps_what_arrived(url):
    out = pd_chaos.chat(f"{url}/ok", "m", "hello", stream=True, abort_after=2)
    assert (out.kind, out.text) == (pd_chaos.ABORTED, "ab")


def test_an_abort_at_the_headers_leaves_before_any_chunk(url):
    """abort_after=0 closes the stream once its 200 and headers are in, without waiting for a body byte (the
    fake holds its first chunk 3 s, past the 1 s bound); a refusal is still the named error it is."""
    out = pd_chaos.chat(f"{url}/held", "m", "hello", stream=True, abort_after=0, timeout_s=1.0)
    assert (out.kind, out.text) == (pd_chaos.ABORTED, "") and out.ended - out.started < 1.0, out
    out = pd_chaos.chat(f"{url}/named", "m", "hello", stream=True, abort_after=0, timeout_s=1.0)
    assert (out.kind, out.code) == (pd_chaos.ERROR, "pd_upstream_unreachable"), out


def test_recovery_probe_gives_up_at_its_bound_on_a_pair_that_never_serves(url):
    seconds, last = pd_chaos.seconds_until_serving(f"{url}/named", "m", "hello", within_s=1.0)
    assert seconds is None and last.code == "pd_upstream_unreachable"
    seconds, last = pd_chaos.seconds_until_serving(f"{url}/ok", "m", "hello", within_s=5.0)
    assert seconds is not None and last.kind == pd_chaos.OK
