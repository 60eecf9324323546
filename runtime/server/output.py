"""From generated tokens to OpenAI chat deltas: detokenize, parse DSML tool calls, add logprobs.

`ChoiceBuilder` is the one output path for both modes: streaming sends each `Delta` as a chunk,
non-streaming folds the same deltas into one message. That makes "streamed reconstruction ==
non-streamed result" a property of the code, and lets unit tests drive the builder with controlled
text instead of a model.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from runtime.server.corrupt import ToolJsonCorruptor
from runtime.server.detokenizer import Detokenizer
from runtime.server.dsml import ContentDelta, DsmlParser, ToolCall
from runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def new_call_id() -> str:
    """A tool-call id unique across responses (clients key tool results by it)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class LogprobEntry:
    """One token's logprob and its top alternatives, rendered two ways from the same data: a dict
    (the non-streamed response, through `fold`) and JSON text (a streamed chunk, `as_json`). The
    JSON is built from per-token pieces cached once per token id: encoding the nested dicts of
    every streamed token anew was the biggest share of the server's json.dumps time."""

    tokenizer: Any
    token: int
    logprob: float
    top: list[tuple[int, float]]  # already cut to the request's top_logprobs

    def as_dict(self) -> dict[str, Any]:
        def item(tid: int, lp: float) -> dict[str, Any]:
            text, utf8 = token_text(self.tokenizer, tid)
            return {"token": text, "logprob": lp, "bytes": list(utf8)}

        entry = item(self.token, self.logprob)
        entry["top_logprobs"] = [item(t, lp) for t, lp in self.top]
        return entry

    def as_json(self) -> str:
        """Exactly `json.dumps(self.as_dict(), ensure_ascii=False)` (tests/unit/test_sse_chunks.py)."""
        tops = []
        for tid, lp in self.top:
            head, tail = token_json(self.tokenizer, tid)
            tops.append(f"{head}{json_float(lp)}{tail}}}")
        head, tail = token_json(self.tokenizer, self.token)
        return f"{head}{json_float(self.logprob)}{tail}, \"top_logprobs\": [{', '.join(tops)}]}}"


@dataclass
class Delta:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls or self.logprobs)


@dataclass(frozen=True)
class OutputOptions:
    stop: tuple[str, ...] = ()
    parse_tools: bool = False
    tool_names: frozenset[str] | None = None
    forced_prefix: str = ""  # DSML already placed in the prompt (named tool_choice): parsed, never sent
    logprobs: bool = False
    top_logprobs: int = 0
    max_calls: int | None = None  # parallel_tool_calls=false: 1, the reply ends at its first call (ChoiceBuilder)


# Counted with the parser's reasons (dsv4_dsml_rejected_total): model output after the reply's end.
PAST_LAST_CALL = "output after the last call allowed (parallel_tool_calls=false)"


class ChoiceBuilder:
    """One choice's output, token by token (`push`), then `finish`.

    `parallel_tool_calls=false` (`max_calls=1`): the reply ends at its first call. `ended` turns
    true on the token that completes the call; the server then stops the request and finishes with
    "tool_calls", so the model makes at most one call, as OpenAI's does, and a client that runs the
    call and answers gets the model's next call on the next turn. Never a second call generated and
    silently dropped: vLLM returns the first call and drops the rest from the reply (it does not stop
    generation); SGLang enforces one call only where a grammar constrains the output
    (tool_choice "required" or named), which for DeepSeek's format ends the block after one invoke,
    what stopping at the invoke's close does without a grammar. Text the same release carried past
    the call (only a stop string's hold-back releases several tokens at once) is not returned; when
    it is more than markup, it is logged and counted as PAST_LAST_CALL.
    """

    def __init__(self, tokenizer: Tokenizer, options: OutputOptions,
                 corruptor: ToolJsonCorruptor | None = None) -> None:
        self.tokenizer = tokenizer
        self.options = options
        self.detok = Detokenizer(tokenizer, options.stop)
        self.parser = DsmlParser(set(options.tool_names) if options.tool_names is not None else None) \
            if options.parse_tools else None
        self.corruptor = corruptor
        self.num_calls = 0
        self.ended = False  # the reply ended at its last allowed call
        self._past_end = False  # output after that call was not returned
        self._pending = self.parser.feed(options.forced_prefix) if self.parser and options.forced_prefix else []

    def push(self, token: int, logprob: float, top: list[tuple[int, float]], is_stop_token: bool) -> Delta:
        """One generated token. A stop token (EOS, stop_token_ids) counts but adds no text."""
        delta = Delta()
        if self.options.logprobs:
            delta.logprobs.append(LogprobEntry(self.tokenizer, token, logprob, top[: self.options.top_logprobs]))
        if not is_stop_token:
            self._apply(delta, self._events(self.detok.push(token)))
        return delta

    def finish(self, reason: str) -> tuple[Delta, str]:
        """Flush held-back text; return the last delta and the OpenAI finish_reason.

        "tool_calls" only when the model ended its turn itself (EOS or a stop token: reason "stop"
        with no stop string cut) with every block and invoke closed. Output cut by max_tokens or a
        stop string keeps "length"/"stop" even when some calls before the cut were complete, so a
        client never takes a truncated list of calls for the whole answer. A reply that ended at its
        last allowed call (`ended`, parallel_tool_calls=false) is complete: "tool_calls".
        """
        delta = Delta()
        self._apply(delta, self._events(self.detok.flush()))  # may end the reply (a held-back call)
        if self.parser is None:
            return delta, reason
        if self.ended:  # what the parser holds undecided is past the end too (the next invoke's opening)
            self._apply(delta, [ContentDelta(self.parser.undecided)])
            return delta, "tool_calls"
        closed = self.parser.closed
        self._apply(delta, self.parser.finish())
        if self.num_calls and reason == "stop" and closed and not self.detok.stopped:
            reason = "tool_calls"
        return delta, reason

    @property
    def rejected(self) -> list[str]:
        """Why model output is not a call, one reason per case: DSML returned as content (the parser's
        reasons, runtime/server/dsml.py), or PAST_LAST_CALL."""
        rejected = self.parser.rejected if self.parser is not None else []
        return [*rejected, PAST_LAST_CALL] if self._past_end else rejected

    # ---- internals ------------------------------------------------------------------------------
    def _events(self, text: str) -> list:
        if self.parser is None:
            return [ContentDelta(text)] if text else []
        pending, self._pending = self._pending, []
        return pending + (self.parser.feed(text) if text else [])

    def _apply(self, delta: Delta, events) -> None:
        for event in events:
            if self.ended:
                if isinstance(event, ToolCall) or event.text.strip():
                    if not self._past_end:
                        log.warning("output after the reply's last allowed call is not returned")
                    self._past_end = True
            elif isinstance(event, ContentDelta):
                delta.content += event.text
            elif isinstance(event, ToolCall):
                self.num_calls += 1
                self.ended = self.num_calls == self.options.max_calls
                arguments = event.arguments
                if self.corruptor is not None:
                    self.corruptor.start_call(event.index)
                    arguments = self.corruptor.arguments(event.index, arguments)
                # A call goes out whole, once complete (runtime/server/dsml.py says why).
                delta.tool_calls.append({"index": event.index, "id": new_call_id(), "type": "function",
                                         "function": {"name": event.name, "arguments": arguments}})


@functools.lru_cache(maxsize=1 << 16)
def token_text(tokenizer: Any, token: int) -> tuple[str, bytes]:  # Any: the cache hashes it
    """One token's text and bytes, as a logprob entry shows them. The bytes are the token's own
    (`Tokenizer.token_bytes`), not its text's: a token inside a multi-byte character decodes alone
    to U+FFFD, whose UTF-8 would not rebuild the reply. Cached: the server decoded every top-k
    alternative of every streamed token anew (a twentieth of its event loop in the H200 gate), and
    a token's text never changes. Tokenizers hash by identity."""
    return tokenizer.decode([token]), tokenizer.token_bytes(token)


@functools.lru_cache(maxsize=1 << 16)
def token_json(tokenizer: Any, token: int) -> tuple[str, str]:
    """A logprob item's JSON around its logprob: `{"token": TEXT, "logprob": ` and `, "bytes": [..]`
    (json.dumps's default separators, ensure_ascii=False, as the chunk encoder writes them)."""
    text, utf8 = token_text(tokenizer, token)
    return (f'{{"token": {json.dumps(text, ensure_ascii=False)}, "logprob": ',
            f', "bytes": {json.dumps(list(utf8))}')


_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def json_float(value: float) -> str:
    """A float as json.dumps writes it (repr; NaN and the infinities spelled as JavaScript does)."""
    text = repr(value)
    return text if text[-1].isdigit() else _NON_FINITE[text]  # a finite repr ends in a digit


def logprobs_json(entries: list[LogprobEntry]) -> str:
    return "[" + ", ".join(e.as_json() for e in entries) + "]"


def fold(deltas: list[Delta]) -> dict[str, Any]:
    """Non-streaming: the assistant message (and logprobs) the deltas add up to."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for tc in d.tool_calls:
            call = calls.setdefault(tc["index"], {"id": "", "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            call["id"] = call["id"] or tc.get("id", "")
            call["function"]["name"] += tc["function"].get("name", "")
            call["function"]["arguments"] += tc["function"].get("arguments", "")
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"message": message, "logprobs": [lp.as_dict() for d in deltas for lp in d.logprobs]}
