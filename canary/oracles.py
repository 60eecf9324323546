"""Per-turn correctness oracles. Each takes a `Turn` (what one request returned) plus the session
context and returns `Failure`s; none of them retries or repairs anything.

The oracles are pure functions so each can be shown to fire on a planted defect in a unit test.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the raw JSON string, exactly as the server sent it


@dataclass
class Turn:
    session: int
    turn: int
    streamed: bool
    content: str
    tool_calls: list[ToolCall]
    finish_reason: str | None
    usage: dict[str, int] | None
    max_tokens: int
    tokens: list[Any] = field(default_factory=list)  # per generated token (from logprobs), if reported
    aborted: bool = False
    expects_tool_call: bool = False


@dataclass(frozen=True)
class Failure:
    oracle: str
    session: int
    turn: int
    message: str
    text: str  # the offending output, truncated

    def describe(self) -> str:
        return f"[{self.oracle}] session {self.session} turn {self.turn}: {self.message} | {self.text!r}"


def _fail(oracle: str, turn: Turn, message: str, text: str) -> Failure:
    return Failure(oracle, turn.session, turn.turn, message, text[:300])


def _output_text(turn: Turn) -> str:
    return turn.content + "".join(c.name + c.arguments for c in turn.tool_calls)


def check_tool_calls(turn: Turn, schemas: dict[str, dict]) -> list[Failure]:
    """Arguments parse as a JSON object, the function exists, and the arguments satisfy its schema."""
    import jsonschema

    failures = []
    for call in turn.tool_calls:
        if call.name not in schemas:
            failures.append(_fail("known-function", turn, f"unknown function {call.name!r}", call.name))
            continue
        try:
            args = json.loads(call.arguments)
        except json.JSONDecodeError as exc:
            failures.append(_fail("json-parse", turn, f"{call.name} arguments are not JSON: {exc.msg}",
                                  call.arguments))
            continue
        if not isinstance(args, dict):
            failures.append(_fail("json-parse", turn, f"{call.name} arguments are not an object", call.arguments))
            continue
        errors = sorted(jsonschema.Draft202012Validator(schemas[call.name]).iter_errors(args), key=str)
        if errors:
            failures.append(_fail("json-schema", turn, f"{call.name}: {errors[0].message}", call.arguments))
    return failures


def check_nonce(turn: Turn, own_nonce: str, other_nonces: Callable[[], list[str]], must_echo: bool) -> list[Failure]:
    """The session's own nonce is echoed exactly when the turn should carry it; no other session's
    nonce appears anywhere in this session's output (cross-session bleed)."""
    text = _output_text(turn)
    failures = []
    if must_echo and own_nonce not in text:
        failures.append(_fail("nonce-echo", turn, f"own nonce {own_nonce} missing or altered", text))
    foreign = [n for n in other_nonces() if n != own_nonce and n in text]
    if foreign:
        failures.append(_fail("cross-session-bleed", turn, f"contains other sessions' nonces {foreign[:3]}", text))
    return failures


def check_stream_equivalence(streamed: Turn, reference: Turn) -> list[Failure]:
    """The streamed reconstruction must equal the non-streamed result for the same (greedy) request."""
    a = (streamed.content, [(c.name, c.arguments) for c in streamed.tool_calls], streamed.finish_reason)
    b = (reference.content, [(c.name, c.arguments) for c in reference.tool_calls], reference.finish_reason)
    if a != b:
        return [_fail("stream-equivalence", streamed, f"streamed {a!r} != non-streamed {b!r}", _output_text(streamed))]
    return []


_REPEAT = re.compile(r"(.{3,40}?)\1{5,}", re.DOTALL)


def check_gibberish(turn: Turn) -> list[Failure]:
    """Replacement characters, control bytes or a short pattern repeated 6+ times: a model that was
    coherent yesterday emitting these today means corrupted numerics."""
    text = _output_text(turn)
    failures = []
    bad = sum(1 for ch in text if ch == "\ufffd" or (ord(ch) < 32 and ch not in "\n\t"))
    if bad:
        failures.append(_fail("gibberish", turn, f"{bad} replacement/control characters", text))
    match = _REPEAT.search(text)
    if match:
        failures.append(_fail("repetition", turn, f"{match.group(1)!r} repeated", text))
    return failures


def check_finish_and_usage(turn: Turn) -> list[Failure]:
    if turn.aborted:
        return []
    failures = []
    reason = turn.finish_reason
    if reason not in ("stop", "length", "tool_calls"):
        failures.append(_fail("finish-reason", turn, f"unexpected finish_reason {reason!r}", _output_text(turn)))
    if bool(turn.tool_calls) != (reason == "tool_calls"):
        failures.append(_fail("finish-reason", turn, f"finish_reason {reason!r} with {len(turn.tool_calls)} tool calls",
                              _output_text(turn)))
    if reason == "length" and turn.expects_tool_call and not turn.tool_calls:
        failures.append(_fail("max-tokens-no-tool-call", turn, f"hit max_tokens={turn.max_tokens} without a tool call",
                              _output_text(turn)))
    usage = turn.usage
    if usage is not None:
        total = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
        if usage.get("total_tokens") != total:
            failures.append(_fail("usage", turn, f"total_tokens {usage.get('total_tokens')} != prompt + completion "
                                  f"{total}", str(usage)))
        completion = usage.get("completion_tokens", -1)
        if not 0 < completion <= turn.max_tokens:
            failures.append(_fail("usage", turn, f"completion_tokens {completion} outside (0, {turn.max_tokens}]",
                                  str(usage)))
        if reason == "length" and completion != turn.max_tokens:
            failures.append(_fail("usage", turn, f"finish_reason length but {completion} of {turn.max_tokens} tokens",
                                  str(usage)))
        if turn.tokens and len(turn.tokens) != completion:
            failures.append(_fail("usage", turn, f"{len(turn.tokens)} logprob tokens but completion_tokens "
                                  f"{completion}", str(usage)))
    return failures


def _leaf_values(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaf_values(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _leaf_values(v)]
    return [value]


def check_grounded_arguments(turn: Turn, conversation: str) -> list[Failure]:
    """Every string and number in the tool arguments must occur verbatim in the conversation so far
    (the user asked for exactly these values). A single flipped character in a value that still
    parses and validates (`Paris` -> `Qaris`, 9 -> 8) is invisible to the JSON oracles but not here.
    Booleans and enum members are left to the schema."""
    failures = []
    for call in turn.tool_calls:
        try:
            args = json.loads(call.arguments)
        except json.JSONDecodeError:
            continue  # reported by check_tool_calls
        for leaf in _leaf_values(args):
            if isinstance(leaf, bool) or leaf is None:
                continue
            text = leaf if isinstance(leaf, str) else json.dumps(leaf)
            if text not in conversation:
                failures.append(_fail("ungrounded-argument", turn, f"{call.name}: value {text!r} appears nowhere "
                                      "in the conversation", call.arguments))
    return failures
