"""How a streamed reply is cut into writes (runtime/server/app.py `_stream`): the opening chunk goes
out alone while the prompt computes (the client sees its stream open), but a first token already
waiting - a PD decode server's prefilled request brings it - goes out in the same write, so the first
token costs one socket write and not two. The bytes of the stream are the same either way."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from runtime.server.app import _stream
from runtime.server.bridge import TokenOut
from runtime.server.output import ChoiceBuilder, OutputOptions
from runtime.tokenizer import ByteTokenizer

pytestmark = pytest.mark.unit
TOK = ByteTokenizer(320, 256, 257, 258)


def fake_state() -> SimpleNamespace:
    return SimpleNamespace(model_name="m", loaded=SimpleNamespace(config=SimpleNamespace(fingerprint="fp")),
                           bridge=SimpleNamespace(abort=lambda rid, reason="abort": None),
                           metrics=SimpleNamespace(dsml_rejected=None))


async def writes(tokens_waiting: bool) -> list[str]:
    """The stream's writes for the reply "hi" (two tokens, the second one last)."""
    sink: asyncio.Queue = asyncio.Queue()
    events = [TokenOut(ord("h"), -0.1, [], None, False), TokenOut(ord("i"), -0.1, [], "length", False)]
    if tokens_waiting:
        sink.put_nowait(events[0])
    stream = _stream(fake_state(), "r1", sink, ChoiceBuilder(TOK, OutputOptions(), None), 3, False)
    out = [await anext(stream)]
    if not tokens_waiting:  # the first token comes while the stream is open
        sink.put_nowait(events[0])
        out.append(await anext(stream))
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
