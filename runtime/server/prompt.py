"""A chat prompt as token ids where request text is always text: control tokens (role markers, DSML
tags, BOS/EOS) come only from the template, never from what a client wrote.

Rendering a template gives one string, and encoding that string would turn a user's `<｜User｜>`
into the real role marker: anyone could forge turns or tool markup. So every string a client sent
is wrapped in markers unique to this rendering before the template sees it; after rendering, the
markers split the prompt into template text (control-token spellings become their ids) and request
text (encoded as plain text). Between two control tokens, template and request text are encoded as
one piece, exactly as the plain encoding of the whole prompt would split them, so a prompt without
such spellings in its request text encodes to the same ids as before (the canary model's prompts
are unchanged; tests/unit/test_prompt_text.py checks both).
"""

from __future__ import annotations

import copy
import re
import secrets
from dataclasses import dataclass
from typing import Any

from runtime.server.chat_template import ChatTemplate, TemplateError
from runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class Markers:
    """ASCII words that survive Jinja's `tojson` unchanged (no `<>&'`, no escapes)."""
    open: str
    close: str

    @classmethod
    def fresh(cls) -> Markers:
        nonce = secrets.token_hex(12)  # a client cannot guess it, so cannot fake a boundary
        return cls(f"TXT{nonce}OPEN", f"TXT{nonce}CLOSE")

    def wrap(self, text: str) -> str:
        return f"{self.open}{text}{self.close}" if text else text


@dataclass(frozen=True)
class Prompt:
    text: str  # what the model sees, as text (for logs and tests)
    ids: list[int]


def render_prompt(template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]], tool_choice: str, suffix: str = "") -> Prompt:
    """`suffix` is server-written markup (a forced tool-call opening): its control tokens count."""
    markers = Markers.fresh()
    rendered = template.render([_mark_message(m, markers) for m in messages],
                               [_mark_tool(t, markers) for t in tools], tool_choice) + suffix
    pieces = split_marked(rendered, markers)
    return Prompt("".join(text for text, _ in pieces), encode_pieces(tokenizer, pieces))


def split_marked(rendered: str, markers: Markers) -> list[tuple[str, bool]]:
    """(text, is_request_text) pieces, markers removed. Found with str.find, as the regex
    `open(.*?)close` (DOTALL) finds them: compiling that per request (a fresh nonce each time, so
    never from re's cache) was most of this function's time."""
    pieces: list[tuple[str, bool]] = []
    at, width = 0, len(markers.open)
    while (start := rendered.find(markers.open, at)) >= 0:
        end = rendered.find(markers.close, start + width)
        if end < 0:  # no close after this open, so none after a later one either
            break
        pieces += [(rendered[at:start], False), (rendered[start + width:end], True)]
        at = end + len(markers.close)
    pieces.append((rendered[at:], False))
    if any(markers.open in text or markers.close in text for text, _ in pieces):
        # The template cut or reordered a client string: its boundary is lost, so refuse to guess.
        raise TemplateError("the chat template transforms message text; it cannot be encoded safely")
    return [(text, is_request) for text, is_request in pieces if text]


def encode_pieces(tokenizer: Tokenizer, pieces: list[tuple[str, bool]]) -> list[int]:
    ids: list[int] = []
    run = ""  # text since the last control token, encoded as one piece
    for text, is_request in pieces:
        if is_request:
            run += text
            continue
        for segment, control in _split_controls(text, tokenizer.control_tokens):
            run += segment
            if control is not None:
                ids += tokenizer.encode_text(run) + [control]
                run = ""
    return ids + tokenizer.encode_text(run)


_CONTROL_PATTERNS: dict[int, tuple[dict[str, int], re.Pattern]] = {}


def _controls_pattern(controls: dict[str, int]) -> re.Pattern:
    """The alternation of a tokenizer's control spellings, longest first, built once per tokenizer:
    escaping and compiling every added token on each request was a fifth of the server's event-loop
    time in the H200 gate (py-spy). Keyed by the dict's identity and checked against it."""
    cached = _CONTROL_PATTERNS.get(id(controls))
    if cached is None or cached[0] is not controls:
        pattern = re.compile("|".join(re.escape(c) for c in sorted(controls, key=len, reverse=True)))
        cached = _CONTROL_PATTERNS[id(controls)] = (controls, pattern)
    return cached[1]


def _split_controls(text: str, controls: dict[str, int]) -> list[tuple[str, int | None]]:
    """Template text -> (text before, control id) pairs, leftmost-longest like `tokenizers`."""
    if not controls:
        return [(text, None)]
    pattern = _controls_pattern(controls)
    out: list[tuple[str, int | None]] = []
    at = 0
    for match in pattern.finditer(text):
        out.append((text[at:match.start()], controls[match.group()]))
        at = match.end()
    out.append((text[at:], None))
    return out


# ---- marking request text -----------------------------------------------------------------------
def _mark_message(message: dict[str, Any], markers: Markers) -> dict[str, Any]:
    """A copy with every client string marked. Only the containers on the way to a changed string
    are copied (a deepcopy of the whole conversation per request was a sixth of preparing it)."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, str):
        out["content"] = markers.wrap(content)
    elif isinstance(content, list):
        out["content"] = parts = [dict(part) if isinstance(part, dict) else copy.deepcopy(part) for part in content]
        for part in parts:
            if isinstance(part.get("text"), str):
                part["text"] = markers.wrap(part["text"])
    if out.get("tool_calls"):
        out["tool_calls"] = calls = [dict(call) for call in out["tool_calls"]]
        for call in calls:
            call["function"] = function = dict(call["function"])
            function["name"] = markers.wrap(function["name"])
            function["arguments"] = _mark_arguments(function["arguments"], markers)
    return out


def _mark_arguments(arguments: str, markers: Markers) -> str:
    """Arguments arrive as a JSON string; the template renders a dict as DSML parameters, so its
    names and string values are request text, and a non-object string is rendered as written."""
    import json

    try:
        value = json.loads(arguments)
    except ValueError:
        return markers.wrap(arguments)
    if not isinstance(value, dict):
        return markers.wrap(arguments)
    return json.dumps({markers.wrap(k): _mark_value(v, markers) for k, v in value.items()}, ensure_ascii=False)


def _mark_value(value: Any, markers: Markers) -> Any:
    """Every string inside a value, keys too: nested values go through `tojson`, which (like
    DeepSeek's encoder) writes them unescaped, so a `<｜User｜>` there is request text as well. The
    markers are ASCII letters and digits, so JSON writes them as they are around the escaped text."""
    if isinstance(value, str):
        return markers.wrap(value)
    if isinstance(value, list):
        return [_mark_value(v, markers) for v in value]
    if isinstance(value, dict):
        return {markers.wrap(k): _mark_value(v, markers) for k, v in value.items()}
    return value


_KEYWORD = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")


def _mark_tool(tool: dict[str, Any], markers: Markers) -> dict[str, Any]:
    """A tool's description and every string in its parameter schema are client text a template
    may render raw (`tojson` writes the whole schema unescaped). Left as they are: the function
    name (a validated identifier), `type` values and keyword-like keys, which templates look up
    and compare (`spec["type"] == "array"`); none can spell a control token (all hold `<` or `｜`).
    Property names are always marked, as are the `required` entries that name them, so a
    template's `name in required` still holds."""
    out = dict(tool)  # copies on the way to what changes; _mark_schema builds new containers
    out["function"] = function = dict(out["function"])
    if isinstance(function.get("description"), str):
        function["description"] = markers.wrap(function["description"])
    if isinstance(function.get("parameters"), dict):
        function["parameters"] = _mark_schema(function["parameters"], markers)
    return out


def _mark_schema(node: Any, markers: Markers, properties: bool = False) -> Any:
    if isinstance(node, str):
        return markers.wrap(node)
    if isinstance(node, list):
        return [_mark_schema(v, markers) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        name = markers.wrap(key) if properties or not _KEYWORD.fullmatch(key) else key
        if properties:  # a property name -> its schema
            out[name] = _mark_schema(value, markers)
        elif key == "type":
            types = value if isinstance(value, list) else [value]
            kept = [t if isinstance(t, str) and _KEYWORD.fullmatch(t) else _mark_schema(t, markers) for t in types]
            out[name] = kept if isinstance(value, list) else kept[0]
        else:
            out[name] = _mark_schema(value, markers, properties=key == "properties")
    return out
