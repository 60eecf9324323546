"""DeepSeek-V4 DSML tool-call parser: one incremental state machine for streaming AND one-shot use.

The model writes (full-width U+FF5C bars):

    prose<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

An invoke body is either parameter tags or one direct-JSON object; `<｜DSML｜invoke name="x"/>`
is a call without arguments. One-shot parsing is `feed(text)` + `finish()`, so "streamed parse ==
one-shot parse for any chunking" holds by construction: every decision below depends only on the
buffered text, and the parser waits while the buffer could still be the start of a tag.

Agreement with SGLang's `deepseekv4` detector on well-formed text: prose before the block loses the
blank line the template puts before it; string values are stripped; non-string values are JSON
(NaN/Infinity rejected) or else the stripped raw text; unknown tool names and unclosed invokes are
dropped; text after the block is dropped. Where a stream cannot take back what it already sent we
differ on malformed text: stray text between parameters is ignored (SGLang drops the call), a
repeated parameter keeps its first value, and a direct-JSON body that is not an object is passed
through verbatim so the client sees what the model wrote.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

BAR = "\uff5c"  # ｜ FULLWIDTH VERTICAL LINE
DSML = f"{BAR}DSML{BAR}"
BLOCK_OPEN = f"<{DSML}tool_calls>"
BLOCK_CLOSE = f"</{DSML}tool_calls>"
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"
# The chat template puts a blank line before a block; it belongs to the markup, not the prose.
BLOCK_LEAD = "\n\n"

_INVOKE_HEAD = re.compile(rf'<{DSML}invoke\s+name="(?P<name>[^"]+)"\s*(?P<end>/>|>)')
_PARAM_HEAD = re.compile(rf'<{DSML}parameter\s+name="(?P<name>[^"]+)"\s+string="(?P<string>[^"]+)"\s*>')


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


Event = ContentDelta | ToolCallStart | ArgumentsDelta


@dataclass
class ParsedCall:
    name: str
    arguments: str


@dataclass
class ParseResult:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


def _reject_constant(value: str):
    raise ValueError(f"non-standard JSON constant {value}")


def _json_value(raw: str, is_string: bool):
    text = raw.strip()
    if is_string:
        return text
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return text


def _held_suffix(buffer: str, *tokens: str) -> int:
    """Index where the longest tail of `buffer` that is a proper prefix of a token starts."""
    longest = max(len(t) for t in tokens)
    for start in range(max(0, len(buffer) - longest + 1), len(buffer)):
        tail = buffer[start:]
        if any(t.startswith(tail) for t in tokens):
            return start
    return len(buffer)


class DsmlParser:
    """Feed text, get events; `finish()` flushes. `tool_names=None` accepts any function name."""

    def __init__(self, tool_names: set[str] | None = None) -> None:
        self.tool_names = tool_names
        self._buf = ""
        self._state = "content"  # content -> block -> (invoke -> block)* -> done
        self._index = -1  # index of the last announced call
        self._body: str | None = None  # current invoke's form: None until its first character, "json" or "xml"
        self._params: list[str] = []  # parameter names already emitted in the current invoke
        self._skip = False  # current invoke names an unknown tool: parse it, emit nothing

    # ---- public ---------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._step(events, final=False):
            pass
        return events

    @property
    def in_call(self) -> bool:
        """Inside an unclosed invoke (the output stopped mid-call)."""
        return self._state == "invoke"

    def finish(self) -> list[Event]:
        events: list[Event] = []
        while self._step(events, final=True):
            pass
        if self._state == "content" and self._buf:
            events.append(ContentDelta(self._buf))
        elif self._state == "invoke":
            # Unclosed at the end of the output (max_tokens): the call was already announced, so
            # close the parameter object that was sent; a direct-JSON body goes out as written.
            self._close_invoke(events, self._buf)
        self._buf = ""
        self._state = "done"
        return events

    # ---- states ---------------------------------------------------------------------------------
    def _step(self, events: list[Event], final: bool) -> bool:
        """Consume what can be decided now; True when another step may make more progress."""
        if self._state == "content":
            return self._content(events, final)
        if self._state == "block":
            return self._block(events)
        if self._state == "invoke":
            return self._invoke(events)
        self._buf = ""  # done: text after the block is not part of the reply
        return False

    def _content(self, events: list[Event], final: bool) -> bool:
        at = self._buf.find(BLOCK_OPEN)
        if at >= 0:
            prose = self._buf[:at].removesuffix(BLOCK_LEAD)
            if prose:
                events.append(ContentDelta(prose))
            self._buf = self._buf[at + len(BLOCK_OPEN):]
            self._state = "block"
            return True
        if not final:
            hold = _held_suffix(self._buf, BLOCK_LEAD + BLOCK_OPEN, BLOCK_OPEN)
            if hold > 0:
                events.append(ContentDelta(self._buf[:hold]))
                self._buf = self._buf[hold:]
        return False

    def _block(self, events: list[Event]) -> bool:
        found = _first_of(self._buf, INVOKE_OPEN, BLOCK_CLOSE)
        if found is None:
            # Stray text between invokes is markup noise; keep only a possible tag start.
            self._buf = self._buf[_held_suffix(self._buf, INVOKE_OPEN, BLOCK_CLOSE):]
            return False
        at, tag = found
        if tag == BLOCK_CLOSE:
            self._buf = ""
            self._state = "done"
            return False
        head = _INVOKE_HEAD.match(self._buf, at)
        if head is None:
            if ">" in self._buf[at:]:  # a complete tag that is not a valid invoke head: skip it
                self._buf = self._buf[at + len(INVOKE_OPEN):]
                return True
            self._buf = self._buf[at:]
            return False
        name = head.group("name").strip()
        self._buf = self._buf[head.end():]
        self._skip = self.tool_names is not None and name not in self.tool_names
        self._body, self._params = None, []
        if not self._skip:
            self._index += 1
            events.append(ToolCallStart(self._index, name))
        if head.group("end") == "/>":
            self._close_invoke(events, "")
        else:
            self._state = "invoke"
        return True

    def _invoke(self, events: list[Event]) -> bool:
        if self._body is None:
            # The first non-blank character decides the form, whatever the chunking.
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._body = "json" if self._buf.startswith("{") else "xml"
        if self._body == "json":
            end = self._buf.find(INVOKE_CLOSE)
            if end < 0:
                return False
            self._close_invoke(events, self._buf[:end])
            self._buf = self._buf[end + len(INVOKE_CLOSE):]
            return True
        found = _first_of(self._buf, PARAM_OPEN, INVOKE_CLOSE)
        if found is None:
            self._buf = self._buf[_held_suffix(self._buf, PARAM_OPEN, INVOKE_CLOSE):]
            return False
        at, tag = found
        if tag == INVOKE_CLOSE:
            self._close_invoke(events, "")
            self._buf = self._buf[at + len(INVOKE_CLOSE):]
            return True
        head = _PARAM_HEAD.match(self._buf, at)
        if head is None:
            if ">" in self._buf[at:]:
                self._buf = self._buf[at + len(PARAM_OPEN):]
                return True
            self._buf = self._buf[at:]
            return False
        end = self._buf.find(PARAM_CLOSE, head.end())
        if end < 0:
            self._buf = self._buf[at:]
            return False
        name = head.group("name")
        value = _json_value(self._buf[head.end():end], is_string=head.group("string") == "true")
        self._buf = self._buf[end + len(PARAM_CLOSE):]
        if name not in self._params and not self._skip:
            opener = "{" if not self._params else ", "
            events.append(ArgumentsDelta(self._index, opener + json.dumps(name, ensure_ascii=False) + ": "
                                         + json.dumps(value, ensure_ascii=False)))
            self._params.append(name)
        return True

    def _close_invoke(self, events: list[Event], json_body: str) -> None:
        if not self._skip:
            if self._body == "json":
                events.append(ArgumentsDelta(self._index, json_body.strip()))
            else:
                events.append(ArgumentsDelta(self._index, "}" if self._params else "{}"))
        self._state = "block"
        self._body, self._params, self._skip = None, [], False


def _first_of(buffer: str, *tags: str) -> tuple[int, str] | None:
    found = [(i, tag) for tag in tags if (i := buffer.find(tag)) >= 0]
    return min(found) if found else None


def parse(text: str, tool_names: set[str] | None = None) -> ParseResult:
    """One-shot parse: the streaming parser fed the whole text at once."""
    return collect(DsmlParser(tool_names), [text])


def collect(parser: DsmlParser, chunks) -> ParseResult:
    """Feed chunks, finish, and fold the events into content + complete calls."""
    result = ParseResult()
    events: list[Event] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    for event in events:
        if isinstance(event, ContentDelta):
            result.content += event.text
        elif isinstance(event, ToolCallStart):
            result.calls.append(ParsedCall(event.name, ""))
        else:
            result.calls[event.index].arguments += event.text
    return result
