"""Server-sent-event text of a streamed chat completion, pre-encoded per stream.

Every chunk of a stream repeats the same envelope (id, object, created, model, fingerprint); only
the delta, the logprobs and the finish reason change. `ChunkEncoder` encodes the envelope once and
each chunk as a concatenation of its JSON pieces, byte for byte what `json.dumps(body,
ensure_ascii=False)` writes for the whole body (tests/unit/test_sse_chunks.py checks it against the
reference encoding): per-token JSON of the full body was an eighth of the server's event loop in the
H200 gate.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.server.output import Delta, logprobs_json

_ENCODER = json.JSONEncoder(ensure_ascii=False)  # json.dumps(..., ensure_ascii=False) without a new encoder per call


def _dumps(value: Any) -> str:
    return _ENCODER.encode(value)


class ChunkEncoder:
    def __init__(self, rid: str, created: int, model: str, fingerprint: str) -> None:
        self.id, self.created = rid, created
        self._head = (f'data: {{"id": {_dumps(rid)}, "object": "chat.completion.chunk", "created": {_dumps(created)}, '
                      f'"model": {_dumps(model)}, "system_fingerprint": {_dumps(fingerprint)}, '
                      '"choices": [{"index": 0, "delta": ')

    def chunk(self, delta: dict[str, Any], logprobs_text: str | None, finish_reason: str | None) -> str:
        """One `data:` event; `logprobs_text` is the JSON list of the chunk's logprob entries (None: none)."""
        logprobs = f'{{"content": {logprobs_text}}}' if logprobs_text is not None else "null"
        finish = _dumps(finish_reason)
        return f'{self._head}{delta_json(delta)}, "logprobs": {logprobs}, "finish_reason": {finish}}}]}}\n\n'

    def delta_chunk(self, delta: Delta, body: dict[str, Any], finish_reason: str | None = None) -> str:
        return self.chunk(body, logprobs_json(delta.logprobs) if delta.logprobs else None, finish_reason)

    def opening(self) -> str:
        """The stream's first chunk: the assistant's role, before any token."""
        return self.chunk({"role": "assistant", "content": ""}, None, None)

    def token_chunk(self, delta: Delta) -> str:
        """A token's chunk: "" for a token that added nothing yet (held-back text, an undecided call)."""
        return self.delta_chunk(delta, delta_body(delta)) if delta else ""


def delta_body(delta: Delta) -> dict[str, Any]:
    """A delta's text and tool-call pieces, as a chunk's `delta` object carries them."""
    body: dict[str, Any] = {}
    if delta.content:
        body["content"] = delta.content
    if delta.tool_calls:
        body["tool_calls"] = delta.tool_calls
    return body


def delta_json(delta: dict[str, Any]) -> str:
    if len(delta) == 1 and "content" in delta:  # the common chunk: text only
        return f'{{"content": {_dumps(delta["content"])}}}'
    return _dumps(delta)
