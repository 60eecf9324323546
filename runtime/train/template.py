"""The canary chat template (chat_template.jinja beside this file) and its special strings.

The server renders prompts with the copy shipped in the model directory; training renders the
same file, so what the model learnt is exactly what it is served.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
THINK_END = "</think>"
# Whole-token strings: role markers and DSML tags each become one id, so a tool call costs few
# tokens and a tag can never be split differently in a prompt than when it was generated.
# BOS/EOS/PAD are "special" (a server may skip them when decoding); the rest must never be skipped.
SPECIAL = [BOS, EOS, PAD]
MARKERS = ["<｜User｜>", "<｜Assistant｜>", THINK_END, "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>",
           "<｜DSML｜invoke name=\"", "</｜DSML｜invoke>", "<｜DSML｜parameter name=\"", "</｜DSML｜parameter>",
           "\" string=\"true\">", "\" string=\"false\">", "<function_results>", "</function_results>",
           "<result>", "</result>"]


@lru_cache(maxsize=4)
def _compiled(path: str, trim: bool):
    # The server's environment (its `tojson` included): training renders exactly what is served.
    from runtime.server.chat_template import environment

    return environment(trim_blocks=trim).from_string(Path(path).read_text())


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, tool_choice: str = "auto",
           path: Path = TEMPLATE_PATH, trim_blocks: bool = True) -> str:
    return _compiled(str(path), trim_blocks).render(messages=messages, tools=tools, tool_choice=tool_choice)
