"""DeepSeek-V4 DSML tool-call parser: one incremental state machine for streaming AND one-shot use.

The model writes (full-width U+FF5C bars):

    prose<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

An invoke body is either parameter tags or one direct-JSON object; `<｜DSML｜invoke name="x"/>` is a
call without arguments. V3.2's block name `function_calls` and an invoke without a block around it
are read the same way, and a reply may hold several blocks.

The rule for what becomes a call: an invoke is reported only once it closed, its tool is known, and
its arguments are a JSON object that satisfies what the markup declared (`string="false"` values are
JSON, a direct-JSON body is an object). A call is emitted whole, never in pieces, so a stream never
shows a call that later turns out cut or malformed. Markup that fails the rule (an invoke cut by
max_tokens or a stop string, a malformed parameter, an unknown tool, stray text inside a block) is
returned as content and logged with its reason: model output is never silently dropped and never
silently turned into a complete call. A bad invoke is its own fault only: a malformed tag is content
up to its first "<" or ">", a bad body up to its close tag or the next invoke's tag (an invoke never
holds another: inside one, `<｜DSML｜invoke` starts the next), and the invokes after are read as
usual. Whitespace around tags is markup; the blank line the template puts before a block belongs to
the markup, not the prose.

Arguments keep what the model wrote: string values keep their whitespace, non-string values keep
their JSON text as written (`1.50` stays `1.50`, `1e400` is not turned into Infinity), a repeated
parameter keeps its last value (as SGLang and DeepSeek's reference parser do), a value may contain
other DSML close tags (only its own close tag ends it). How SGLang and DeepSeek's V4 reference read
the same text, and why ours differs where it does: tests/unit/test_dsml_differential.py.

One-shot parsing is `feed(text)` + `finish()`; every decision depends only on the buffered text,
and the parser waits while the buffer could still grow into a tag, so the streamed parse equals the
one-shot parse for any chunking.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import NoReturn

log = logging.getLogger(__name__)

BAR = "\uff5c"  # ｜ FULLWIDTH VERTICAL LINE
DSML = f"{BAR}DSML{BAR}"
BLOCK_NAMES = ("tool_calls", "function_calls")  # V4, V3.2
BLOCK_OPEN = f"<{DSML}tool_calls>"
BLOCK_OPENS = tuple(f"<{DSML}{name}>" for name in BLOCK_NAMES)
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"
# The chat template puts a blank line before a block; it belongs to the markup, not the prose.
BLOCK_LEAD = "\n\n"

# A tag ends at its first ">"; no "<" or ">" inside it, not even quoted. So a tag is decided as soon
# as the first "<" or ">" after its start arrives, whatever text follows: a name like "a>b" that a
# later chunk could have completed would make the streamed parse differ from the one-shot one.
_INVOKE_HEAD = re.compile(rf'<{DSML}invoke\s+name="(?P<name>[^"<>]+)"\s*(?P<end>/>|>)')
_PARAM_HEAD = re.compile(rf'<{DSML}parameter(?P<attrs>(?:\s+[A-Za-z_]+="[^"<>]*")*)\s*>')
_ATTR = re.compile(r'([A-Za-z_]+)="([^"<>]*)"')
_STARTS = (*BLOCK_OPENS, INVOKE_OPEN)  # what ends prose


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCall:
    """A complete call: its invoke closed and its arguments are a valid JSON object."""
    index: int
    name: str
    arguments: str


Event = ContentDelta | ToolCall


@dataclass
class ParsedCall:
    name: str
    arguments: str


@dataclass
class ParseResult:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class Invalid(ValueError):
    """An invoke that is not a call; its markup goes back to the content."""


def _reject_constant(value: str):
    raise ValueError(f"non-standard JSON constant {value}")


def json_text(raw: str) -> str:
    """`raw` stripped, when it is one strict JSON value (no NaN/Infinity); raises ValueError otherwise."""
    text = raw.strip()
    json.loads(text, parse_constant=_reject_constant)
    return text


def _held_suffix(buffer: str, *tokens: str) -> int:
    """Index where the longest tail of `buffer` that is a proper prefix of a token starts."""
    longest = max(len(t) for t in tokens)
    for start in range(max(0, len(buffer) - longest + 1), len(buffer)):
        tail = buffer[start:]
        if any(t.startswith(tail) for t in tokens):
            return start
    return len(buffer)


def _first_of(buffer: str, tags, start: int = 0) -> tuple[int, str] | None:
    found = [(i, tag) for tag in tags if (i := buffer.find(tag, start)) >= 0]
    return min(found) if found else None


class NeedMore(Exception):
    """The buffered invoke cannot be decided yet."""


def scan_invoke(text: str, final: bool) -> tuple[int, str, str]:
    """`text` starts with an invoke tag -> (end of the invoke markup, name, arguments JSON).

    Raises NeedMore while more text could change the answer (never when `final`), and Invalid with
    the end of the markup to give back as content when the invoke is not a call.
    """
    head = _INVOKE_HEAD.match(text)
    if head is None:
        end = _tag_end(text, 0)
        if end < 0:
            _need_more(text, final)
        raise Invalid("malformed invoke tag", end)  # only the tag: a following invoke is read on its own
    name = head.group("name").strip()
    if head.group("end") == "/>":
        return head.end(), name, "{}"
    body_start = head.end()
    rest = text[body_start:].lstrip()
    if rest.startswith("{"):  # direct JSON: the body up to the first close tag
        end = text.find(INVOKE_CLOSE, body_start)
        opened = text.find(INVOKE_OPEN, body_start)
        if end < 0 or 0 <= opened < end:
            if end < 0 and opened < 0:
                _need_more(text, final)
            _bad_body(text, body_start, final, "invoke cut by the next invoke")
        stop = end + len(INVOKE_CLOSE)
        try:
            arguments = json_text(text[body_start:end])
        except ValueError:
            raise Invalid("direct-JSON arguments are not valid JSON", stop) from None
        if not isinstance(json.loads(arguments), dict):
            raise Invalid("direct-JSON arguments are not an object", stop)
        return stop, name, arguments
    params: dict[str, str] = {}  # name -> JSON text; a repeated name keeps its last value
    at = body_start
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        tail = text[at:]
        if tail.startswith(INVOKE_CLOSE):
            body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in params.items())
            return at + len(INVOKE_CLOSE), name, "{" + body + "}"
        if not tail.startswith(PARAM_OPEN):
            if not final and any(tag.startswith(tail) for tag in (INVOKE_CLOSE, PARAM_OPEN)):
                raise NeedMore
            _bad_body(text, at, final, "text between parameters")
        param = _PARAM_HEAD.match(text, at)
        if param is None:
            if _tag_end(text, at) < 0:
                _need_more(text, final)
            _bad_body(text, at, final, "malformed parameter tag")
        end = text.find(PARAM_CLOSE, param.end())
        opened = text.find(INVOKE_OPEN, param.end())
        if end < 0 or 0 <= opened < end:
            if end < 0 and opened < 0 and not final:
                raise NeedMore
            # Never closed (the output was cut, or the model erred): the invoke is not a call, and
            # the invokes after it are still read.
            _bad_body(text, param.end(), final, "unclosed parameter")
        attrs = dict(_ATTR.findall(param.group("attrs")))
        value = text[param.end():end]
        at = end + len(PARAM_CLOSE)
        if "name" not in attrs:
            _bad_body(text, at, final, "parameter without a name")
        declared = attrs.get("string")
        if declared == "true":
            params[attrs["name"]] = json.dumps(value, ensure_ascii=False)
            continue
        try:
            params[attrs["name"]] = json_text(value)
        except ValueError:
            if declared is not None:  # string="false" (or anything else) promised JSON
                _bad_body(text, at, final, "a string=\"false\" value is not valid JSON")
            params[attrs["name"]] = json.dumps(value, ensure_ascii=False)  # undeclared: text is text


def _tag_end(text: str, start: int) -> int:
    """End of the tag at `start`: past its first ">", or at the next "<" (a tag cut short); -1: not yet."""
    close = text.find(">", start + 1)
    cut = text.find("<", start + 1)
    if cut >= 0 and (close < 0 or cut < close):
        return cut
    return close + 1 if close >= 0 else -1


def _need_more(text: str, final: bool) -> NoReturn:
    if final:
        raise Invalid("unclosed invoke", len(text))
    raise NeedMore


def _bad_body(text: str, at: int, final: bool, reason: str) -> NoReturn:
    """The invoke is not a call: its markup runs to its close tag, or up to the next invoke's tag
    (an invoke never holds another), or, cut, to the end."""
    end = text.find(INVOKE_CLOSE, at)
    opened = text.find(INVOKE_OPEN, at)
    if 0 <= opened and (end < 0 or opened < end):
        raise Invalid(reason, opened)
    if end < 0:
        _need_more(text, final)
    raise Invalid(reason, end + len(INVOKE_CLOSE))


class DsmlParser:
    """Feed text, get events; `finish()` flushes. `tool_names=None` accepts any function name."""

    skip_undecided = True  # False: scan every feed in full (the reference the shortcut is tested against)

    def __init__(self, tool_names: set[str] | None = None) -> None:
        self.tool_names = tool_names
        self._buf = ""
        self._state = "content"  # content -> block -> (invoke -> block)* -> content ...
        self._block_close = ""  # the close tag of the open block
        self._bare = False  # the current invoke stands without a block around it
        self._after_markup = False  # whitespace right after markup is markup
        self._index = 0  # index of the next call
        self.rejected: list[str] = []  # why markup went back to content, one entry per case

    # ---- public ---------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._step(events, final=False):
            pass
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        while self._step(events, final=True):
            pass
        if self._state == "block" and self._buf.strip():
            self._reject(events, self._buf.strip(), "text inside an unclosed tool-call block")
        elif self._state == "content" and self._buf and not self._after_markup:
            events.append(ContentDelta(self._buf))  # after markup, _content left only whitespace
        self._buf = ""
        return events

    @property
    def undecided(self) -> str:
        """Text fed but not decided yet: it could still grow into a tag, or its segment has not ended."""
        return self._buf

    @property
    def closed(self) -> bool:
        """Every block and invoke the model opened was closed (the output was not cut in markup)."""
        return self._state == "content"

    # ---- states ---------------------------------------------------------------------------------
    def _step(self, events: list[Event], final: bool) -> bool:
        """Consume what can be decided now; True when another step may make more progress."""
        if self._state == "content":
            return self._content(events, final)
        if self._state == "block":
            return self._block(events, final)
        return self._invoke(events, final)

    def _content(self, events: list[Event], final: bool) -> bool:
        if self._after_markup:
            stripped = self._buf.lstrip()
            if not stripped:
                return False
            self._buf, self._after_markup = stripped, False
        found = _first_of(self._buf, _STARTS)
        if found is not None:
            at, tag = found
            prose = self._buf[:at].removesuffix(BLOCK_LEAD)
            if prose:
                events.append(ContentDelta(prose))
            if tag == INVOKE_OPEN:
                self._buf, self._state, self._bare = self._buf[at:], "invoke", True
            else:
                self._buf, self._state = self._buf[at + len(tag):], "block"
                self._block_close = "</" + tag[1:]
            return True
        if not final:
            hold = _held_suffix(self._buf, *(BLOCK_LEAD + t for t in _STARTS), *_STARTS)
            if hold > 0:
                events.append(ContentDelta(self._buf[:hold]))
                self._buf = self._buf[hold:]
        return False

    def _block(self, events: list[Event], final: bool) -> bool:
        found = _first_of(self._buf, (INVOKE_OPEN, self._block_close))
        if found is None:
            return False  # stray text is decided when its segment ends (here or at finish)
        at, tag = found
        if self._buf[:at].strip():
            self._reject(events, self._buf[:at].strip(), "text inside a tool-call block")
        if tag == INVOKE_OPEN:
            self._buf, self._state, self._bare = self._buf[at:], "invoke", False
        else:
            self._buf, self._state = self._buf[at + len(tag):], "content"
            self._after_markup = True
        return True

    def _invoke(self, events: list[Event], final: bool) -> bool:
        if self.skip_undecided and not final and INVOKE_CLOSE not in self._buf:
            head = _INVOKE_HEAD.match(self._buf)
            if head is not None and head.group("end") == ">" and self._buf.find(INVOKE_OPEN, head.end()) < 0:
                # scan_invoke's answer here is always NeedMore: past a well-formed head, only the
                # close tag, the next invoke's tag or the end of the output decides a body. Rescanning
                # the whole invoke on every token made a long call quadratic (most of the server's
                # output path).
                return False
        try:
            end, name, arguments = scan_invoke(self._buf, final)
        except NeedMore:
            return False
        except Invalid as exc:
            reason, end = exc.args
            self._reject(events, self._buf[:end], reason)
        else:
            if self.tool_names is not None and name not in self.tool_names:
                self._reject(events, self._buf[:end], "unknown tool name")
            else:
                events.append(ToolCall(self._index, name, arguments))
                self._index += 1
        self._buf = self._buf[end:]
        self._state = "content" if self._bare else "block"
        self._after_markup = True
        return True

    def _reject(self, events: list[Event], markup: str, reason: str) -> None:
        # The reason only: the markup is model output, which may quote user data.
        log.warning("DSML returned as content, not as a tool call: %s", reason)
        self.rejected.append(reason)
        events.append(ContentDelta(markup))


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
        else:
            result.calls.append(ParsedCall(event.name, event.arguments))
    return result
