"""How a streamed reply is cut into writes (runtime/server/app.py `_stream`): the opening chunk goes
out alone while the prompt computes (the client sees its stream open), but a first token already
waiting goes out in the same write, so the first token costs one socket write and not two. The bytes
of the stream are the same either way. A PD decode server (whose headers go out when the room opens)
always holds the opening for the first token, and drops it for an error that comes first: the router
reads that error as the stream's first event (runtime/router.py `relay`)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from runtime.disagg.protocol import RELAYED_EVENT
from runtime.server.app import _stream
from runtime.server.bridge import Failed, TokenOut
from runtime.server.errors import ApiError
from runtime.server.output import ChoiceBuilder, OutputOptions
from runtime.server.sse import ChunkEncoder
from runtime.tokenizer import ByteTokenizer

pytestmark = pytest.mark.unit
TOK = ByteTokenizer(320, 256, 257, 258)


def encoder() -> ChunkEncoder:
    return ChunkEncoder("r1", int(time.time()), "m", "fp")


def fake_state(pd: object = None) -> SimpleNamespace:
    return SimpleNamespace(model_name="m", loaded=SimpleNamespace(config=SimpleNamespace(fingerprint="fp")),
                           bridge=SimpleNamespace(abort=lambda rid, reason="abort": None),
                           metrics=SimpleNamespace(dsml_rejected=None), pd=pd)


async def writes(tokens_waiting: bool, pd: object = None, relayed: bool = False) -> list[str]:
    """The stream's writes for the reply "hi" (two tokens, the second one last); `relayed`: the first
    token's chunk went to the client from the prefill server (runtime/disagg/protocol.py)."""
    sink: asyncio.Queue = asyncio.Queue()
    events = [TokenOut(ord("h"), -0.1, [], None, False, relayed), TokenOut(ord("i"), -0.1, [], "length", False)]
    if tokens_waiting:
        sink.put_nowait(events[0])
    stream = _stream(fake_state(pd), "r1", sink, ChoiceBuilder(TOK, OutputOptions(), None), encoder(), 3, False)
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    if not tokens_waiting:  # the first token comes while the stream is open
        if not first.done():  # the opening was held (PD decode): the first token lets it out
            sink.put_nowait(events[0])
            out = [await first]
        else:
            out = [await first]
            sink.put_nowait(events[0])
            out.append(await anext(stream))
    else:
        out = [await first]
    sink.put_nowait(events[1])
    out.extend([chunk async for chunk in stream])
    return out


def test_a_waiting_first_token_shares_the_opening_write_and_the_bytes_are_unchanged():
    prefilled, computing = asyncio.run(writes(True)), asyncio.run(writes(False))
    assert '"role": "assistant"' in prefilled[0] and '"content": "h"' in prefilled[0]
    assert '"role": "assistant"' in computing[0] and '"content": "h"' not in computing[0]
    assert len(prefilled) == len(computing) - 1
    assert "".join(prefilled).replace(str(_created(prefilled)), "T") == \
        "".join(computing).replace(str(_created(computing)), "T")


def _created(chunks: list[str]) -> int:
    return int(chunks[0].split('"created": ', 1)[1].split(",", 1)[0])


def test_a_pd_decode_stream_holds_its_opening_for_the_first_token():
    """Its first write is the opening and the first token together, as when the token was waiting, with the
    same bytes. Control: the colocated server writes the opening alone (above)."""
    held, prefilled = asyncio.run(writes(False, pd=object())), asyncio.run(writes(True))
    assert '"role": "assistant"' in held[0] and '"content": "h"' in held[0]
    assert len(held) == len(prefilled)
    assert "".join(held).replace(str(_created(held)), "T") == "".join(prefilled).replace(str(_created(prefilled)), "T")


@pytest.mark.parametrize("pd", [object(), None], ids=["pd_decode", "colocated"])
def test_an_error_before_the_first_token_is_a_pd_streams_first_event(pd):
    """PD decode: the stream is the error and its end, no opening chunk (the router may then offer the
    request to another prefill server). The colocated server has written its opening already."""

    async def run() -> list[str]:
        sink: asyncio.Queue = asyncio.Queue()
        stream = _stream(fake_state(pd), "r1", sink, ChoiceBuilder(TOK, OutputOptions(), None), encoder(), 3, False)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        sink.put_nowait(Failed(ApiError(503, "planted", type="server_error", code="pd_prefill_stopping")))
        return [await first] + [chunk async for chunk in stream]

    out = asyncio.run(run())
    if pd is None:  # the colocated server's opening, written while the prompt computed
        assert '"role": "assistant"' in out[0]
        out = out[1:]
    assert len(out) == 1 and out[0].startswith('data: {"error": ') and out[0].endswith("data: [DONE]\n\n")
    assert '"pd_prefill_stopping"' in out[0]


def test_a_relayed_first_token_is_written_as_the_marker_and_the_rest_is_the_same_bytes():
    """A PD decode stream whose first token the prefill server relayed: RELAYED_EVENT in place of the
    opening and the token's chunk (which the prefill server wrote with the same encoder and output state,
    `PrefillSide._relay_text`), then exactly what the stream writes without the relay. Control: the same
    stream not relayed starts with the opening."""
    relayed, plain = asyncio.run(writes(False, pd=object(), relayed=True)), asyncio.run(writes(False, pd=object()))
    assert relayed[0] == RELAYED_EVENT and plain[0].startswith('data: {"id": "r1"') and '"role"' in plain[0]
    opening_and_h = plain[0]
    assert '"content": "h"' in opening_and_h and relayed[1:] == plain[1:]
    created = _created(plain)
    encoder = ChunkEncoder("r1", created, "m", "fp")
    builder = ChoiceBuilder(TOK, OutputOptions(), None)
    assert encoder.opening() + encoder.token_chunk(builder.push(ord("h"), -0.1, [], False)) == opening_and_h
