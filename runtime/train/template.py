"""The canary chat template and its special strings.

The canary model is trained on the server's default template (`DEFAULT_TEMPLATE`,
runtime/chat_templates/dsv4_default.jinja, DeepSeek's V4 encoder byte for byte) and ships a copy in
its model directory, so what the model learnt is exactly what it is served, and exactly what a
DeepSeek-V4 deployment renders.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

# The server's own constant and Jinja environment (`tojson` included): training renders exactly what
# is served. chat_template imports only the standard library at module level (jinja2 lazily).
from runtime.server.chat_template import DEFAULT_TEMPLATE, environment

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
THINK_END = "</think>"
ASSISTANT = "<｜Assistant｜>"
# Whole-token strings: role markers and DSML tags each become one id, so a tool call costs few
# tokens and a tag can never be split differently in a prompt than when it was generated.
# BOS/EOS/PAD are "special" (a server may skip them when decoding); the rest must never be skipped.
SPECIAL = [BOS, EOS, PAD]
MARKERS = ["<｜User｜>", ASSISTANT, THINK_END, "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>",
           "<｜DSML｜invoke name=\"", "</｜DSML｜invoke>", "<｜DSML｜parameter name=\"", "</｜DSML｜parameter>",
           "\" string=\"true\">", "\" string=\"false\">", "<tool_result>", "</tool_result>"]


@lru_cache(maxsize=4)
def _compiled(path: str, trim: bool):
    return environment(trim_blocks=trim).from_string(Path(path).read_text())


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, tool_choice: str = "auto",
           path: Path = DEFAULT_TEMPLATE, trim_blocks: bool = True) -> str:
    """The conversation as the server's prompt text: a template that does not write BOS (DeepSeek's
    does not) gets it in front, as the server adds it as an id (app._prepare)."""
    text = _compiled(str(path), trim_blocks).render(messages=messages, tools=tools, tool_choice=tool_choice)
    return text if text.startswith(BOS) else BOS + text
