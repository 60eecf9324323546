"""The PD router's relay of a stream's first token (runtime/disagg/protocol.py, runtime/router.py `relay`):
the prefill server's first bytes go to the client as soon as they are in, and the decode stream's
RELAYED_EVENT, which stands in their place, never reaches it; whichever of the two comes first, the
client gets the same bytes. A relay lost on the way, or a decode server that writes the relayed token
again, ends the stream with a named error, never a stream without its first token or with it twice."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from runtime.disagg.protocol import CREATED_HEADER, RELAY_HEADER, RELAY_MEDIA_TYPE, RELAYED_EVENT, relay_line
from runtime.router import create_router_app
from tests.fake_upstreams import SSE_TYPE, FakeReply, FakeRequest, FakeUpstreams

pytestmark = pytest.mark.unit
BODY = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
FIRST = 'data: {"delta": {"role": "assistant"}}\n\ndata: {"delta": {"content": "a"}}\n\n'
REST = b'data: {"delta": {"content": "b"}}\n\ndata: [DONE]\n\n'
EXPECTED = FIRST.encode() + REST


class Pair:
    """Upstreams whose prefill server relays `first` (None: null) and whose decode stream starts with
    `decode_head`; `order` says which of the two is let out first (the other waits for it)."""

    def __init__(self, first: str | None = FIRST, decode_head: bytes = RELAYED_EVENT.encode(),
                 order: str = "relay", prefill_breaks: bool = False) -> None:
        self.first, self.decode_head, self.order, self.prefill_breaks = first, decode_head, order, prefill_breaks
        self.relayed = asyncio.Event()  # set once the prefill server's first line is written
        self.headed = asyncio.Event()  # set once the decode stream's first event is written
        self.fake = FakeUpstreams(self.answer)
        self.app = create_router_app(["http://prefill:1"], ["http://decode:2"], health_every_s=None,
                                     connect=self.fake.connect)

    def answer(self, request: FakeRequest) -> FakeReply:
        if request.host == "prefill":
            return FakeReply(chunks=self.prefill_lines(), content_type=RELAY_MEDIA_TYPE)
        return FakeReply(chunks=self.decode_chunks(), content_type=SSE_TYPE)

    async def prefill_lines(self):
        if self.order == "decode":
            await self.headed.wait()
        if self.prefill_breaks:
            raise ConnectionError("planted: the prefill server died before its first line")
        yield relay_line(self.first)
        self.relayed.set()
        yield b'{"done": {"kv_bytes": 1}}\n'

    async def decode_chunks(self):
        if self.order == "relay":
            await self.relayed.wait()
        yield self.decode_head
        self.headed.set()
        yield REST


def stream(pair: Pair) -> bytes:
    with TestClient(pair.app) as router:
        reply = router.post("/v1/chat/completions", content=json.dumps(BODY))
        assert reply.status_code == 200
        return reply.content


@pytest.mark.parametrize("order", ["relay", "decode"])
def test_the_prefill_servers_first_bytes_reach_the_client_and_the_decode_streams_marker_does_not(order):
    """Either arrival order: the relay first (the usual one), or the decode side's RELAYED_EVENT first
    (the router then waits for the relay)."""
    assert stream(Pair(order=order)) == EXPECTED


def test_the_relay_ask_and_one_created_go_to_both_servers_of_a_stream_only():
    pair = Pair()
    stream(pair)
    prefill, decode = pair.fake.requests[:2]
    assert prefill.headers[RELAY_HEADER] == decode.headers[RELAY_HEADER] == "1"
    assert prefill.headers[CREATED_HEADER] == decode.headers[CREATED_HEADER]
    unary = FakeUpstreams(lambda r: FakeReply.json(200, {"choices": []}))
    app = create_router_app(["http://prefill:1"], ["http://decode:2"], health_every_s=None, connect=unary.connect)
    with TestClient(app) as router:
        assert router.post("/v1/chat/completions", content=json.dumps({**BODY, "stream": False})).status_code == 200
    assert all(RELAY_HEADER not in r.headers and CREATED_HEADER in r.headers for r in unary.requests)


def test_a_first_token_not_relayed_comes_through_the_decode_stream_unchanged():
    """The prefill server relays null (a stop token, whose text the decode side decides): the decode
    stream carries the opening and the token itself."""
    assert stream(Pair(first=None, decode_head=FIRST.encode(), order="relay")) == EXPECTED


def test_a_relay_lost_on_the_way_is_a_named_error_not_a_stream_without_its_first_token():
    """Control for the marker check: the decode side took the token as relayed, but the prefill
    server's answer broke off before its first line reached the router."""
    body = stream(Pair(prefill_breaks=True, order="decode"))
    assert b'"pd_stream_broken"' in body and b'"b"' not in body, body


def test_a_decode_server_that_writes_the_relayed_token_again_is_stopped_before_the_client_gets_it_twice():
    """Control for the other side: the decode stream starts with the token's own chunks (a server that
    did not take the relay); after the relay, the client gets the mismatch error, not a second "a"."""
    body = stream(Pair(decode_head=FIRST.encode(), order="relay"))
    assert body.startswith(FIRST.encode()) and b'"pd_relay_mismatch"' in body
    assert body.count(b'"content": "a"') == 1, body
