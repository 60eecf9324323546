"""The pre-encoded streaming path writes exactly the bytes the whole-body json.dumps wrote: the SSE
envelope (runtime/server/sse.py) and the logprob entries (runtime/server/output.py)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.server.output import ChoiceBuilder, LogprobEntry, OutputOptions, json_float, logprobs_json
from runtime.server.sse import ChunkEncoder
from runtime.tokenizer import ByteTokenizer

pytestmark = pytest.mark.unit

TOK = ByteTokenizer(320, 256, 257, 258)


def reference_chunk(rid: str, created: int, model: str, fingerprint: str, delta: dict, logprobs: list | None,
                    finish_reason: str | None) -> str:
    """The encoding the server used before the pre-encoded envelope (one json.dumps of the body)."""
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": fingerprint,
            "choices": [{"index": 0, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                         "finish_reason": finish_reason}]}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([-0.0, 0.0, -1e-300, -math.inf]))
tokens = st.integers(0, 319)
entries = st.builds(LogprobEntry, st.just(TOK), tokens, floats,
                    st.lists(st.tuples(tokens, floats), max_size=5))
texts = (st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
         | st.sampled_from(['"', "\\", "\n\t\x00", "Zürich ✓"]))
deltas = st.one_of(
    st.builds(lambda t: {"content": t}, texts),
    st.just({"role": "assistant", "content": ""}),
    st.just({}),
    st.builds(lambda t, n: {"content": t, "tool_calls": [{"index": 0, "id": "call_x", "type": "function",
                                                          "function": {"name": n, "arguments": '{"a": "ü"}'}}]},
              texts, texts))


@settings(max_examples=300, deadline=None)
@given(entry=entries)
def test_logprob_entry_json_is_json_dumps_of_its_dict(entry):
    assert entry.as_json() == json.dumps(entry.as_dict(), ensure_ascii=False)


@settings(max_examples=300, deadline=None)
@given(rid=texts, created=st.integers(0, 2**40), model=texts, fingerprint=texts, delta=deltas,
       logprobs=st.lists(entries, max_size=3), finish=st.sampled_from([None, "stop", "length", "tool_calls"]))
def test_chunk_is_byte_identical_to_the_whole_body_encoding(rid, created, model, fingerprint, delta, logprobs,
                                                           finish):
    encoder = ChunkEncoder(rid, created, model, fingerprint)
    got = encoder.chunk(delta, logprobs_json(logprobs) if logprobs else None, finish)
    assert got == reference_chunk(rid, created, model, fingerprint, delta,
                                  [e.as_dict() for e in logprobs] if logprobs else None, finish)


def test_builder_deltas_encode_as_before():
    builder = ChoiceBuilder(TOK, OutputOptions(logprobs=True, top_logprobs=2))
    encoder = ChunkEncoder("chatcmpl-1", 7, "canary", "fp")
    for token in TOK.encode('a"ü\n'):
        delta = builder.push(token, -0.25, [(token, -0.25), (token + 1, -3.5), (token + 2, -9.0)], False)
        body = {"content": delta.content} if delta.content else {}
        assert len(delta.logprobs[0].top) == 2
        assert encoder.delta_chunk(delta, body) == reference_chunk(
            "chatcmpl-1", 7, "canary", "fp", body, [e.as_dict() for e in delta.logprobs], None)


def test_float_spelling_matches_json():
    for value in (-0.0, 1e-320, -math.inf, math.inf, math.nan, -0.123456789012345678, 1e300):
        assert json_float(value) == json.dumps(value)


def test_negative_control_a_different_encoding_is_caught():
    """The comparison sees a one-byte difference: compact separators (what orjson or
    `separators=(",", ":")` would write) are not the reference bytes."""
    entry = LogprobEntry(TOK, 97, -0.5, [(98, -1.0)])
    compact = json.dumps(entry.as_dict(), ensure_ascii=False, separators=(",", ":"))
    assert compact != entry.as_json()
    encoder = ChunkEncoder("r", 1, "m", "f")
    planted = encoder.chunk({"content": "x"}, None, None).replace('"index": 0', '"index":0')
    assert planted != reference_chunk("r", 1, "m", "f", {"content": "x"}, None, None)
