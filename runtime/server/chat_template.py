"""Chat template loading and rendering: the model directory's `chat_template.jinja`, or our
default DSV4-style template (runtime/chat_templates/) when the model ships none.

Rendering runs in jinja2's immutable sandbox: a template comes with a model directory and must
not reach the server's objects. Messages are normalised first so every template sees one shape:
text content as a string, tool-call arguments as a dict when they are a JSON object (the DSML
parameter form a DSV4 model was trained on) and as the raw string otherwise.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

DEFAULT_TEMPLATE = Path(__file__).resolve().parent.parent / "chat_templates" / "dsv4_default.jinja"
TEMPLATE_NAME = "chat_template.jinja"


class TemplateError(ValueError):
    """The template could not render these messages (reported to the client as a 400)."""


@lru_cache(maxsize=8)
def _compile(source: str):
    return environment(trim_blocks=True).from_string(source)


def environment(trim_blocks: bool = True):
    """The Jinja environment templates render in, here and in training (runtime/train/template.py),
    so that what a model learnt is what it is served."""
    import jinja2.sandbox

    # Lenient undefined, as HF renders templates: `message.tool_calls` on a plain message is falsy.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=trim_blocks, lstrip_blocks=trim_blocks)
    env.filters["tojson"] = tojson
    return env


def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """HF's `tojson` (transformers' chat-template environment), not Jinja's: model templates are
    written for HF's renderer, and DeepSeek's encoder writes JSON the same way (`json.dumps` with
    non-ASCII kept, keys in the order sent). Jinja's own filter sorts keys and escapes `<>&'` for
    HTML, so a prompt would differ from the reference wherever a value holds those or a dict."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, origin: str) -> None:
        self.source = source
        self.origin = origin  # where it came from, for /server_info
        # OpenAI's developer messages are system instructions. A template that never names the
        # role (the canary model's) would drop them without a trace, so it sees them as system.
        self.developer_as_system = "developer" not in source
        _compile(source)  # a broken template fails at startup, not on the first request

    @classmethod
    def for_model(cls, model_dir: Path | None) -> ChatTemplate:
        if model_dir is not None and (model_dir / TEMPLATE_NAME).is_file():
            path = model_dir / TEMPLATE_NAME
        else:
            path = DEFAULT_TEMPLATE
        return cls(path.read_text(), str(path))

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               tool_choice: str = "auto") -> str:
        import jinja2

        try:
            return _compile(self.source).render(messages=[normalise(m, self.developer_as_system) for m in messages],
                                                tools=tools or None, tool_choice=tool_choice)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template cannot render these messages: {exc}") from exc


@lru_cache(maxsize=8)
def call_opening(template: ChatTemplate, block_open: str) -> str:
    """The text `template` writes at the start of an assistant reply that calls a tool, up to and
    including the tool-call block's opening tag `block_open`: what tool_choice="required" has the
    model write. DeepSeek's V4 encoder puts "\n\n" before the tag (and writes the same opening into
    the prompt for "required"); the canary template writes the tag alone. A template that renders
    calls some other way gets the bare tag. Found once per template, from a one-call conversation."""
    user = [{"role": "user", "content": "u"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    try:
        before = template.render(user, tools, "required")
        after = template.render([*user, call], tools, "required")
    except TemplateError:
        return block_open
    end = after.find(block_open, len(before))
    if not after.startswith(before) or end < 0:
        return block_open
    return after[len(before):end + len(block_open)]


def normalise(message: dict[str, Any], developer_as_system: bool = False) -> dict[str, Any]:
    role = "system" if developer_as_system and message["role"] == "developer" else message["role"]
    out = {"role": role, "content": text_of(message.get("content"))}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": call.get("id"), "type": "function",
                              "function": {"name": call["function"]["name"],
                                           "arguments": _arguments(call["function"]["arguments"])}}
                             for call in message["tool_calls"]]
    return out


def text_of(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # Text parts are separate paragraphs, as DeepSeek's encoder joins them.
    return "\n\n".join(part["text"] for part in content if isinstance(part.get("text"), str))


def _arguments(arguments: str) -> dict[str, Any] | str:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
