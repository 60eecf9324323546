"""Per-turn correctness oracles. Each takes a `Turn` (what one request returned) plus the session
context and returns `Failure`s; none of them retries or repairs anything.

The oracles are pure functions so each can be shown to fire on a planted defect in a unit test.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


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


def _parsed_arguments(arguments: str) -> Any:
    """Arguments as parsed JSON (key order and whitespace are presentation, not content); the raw
    string where they do not parse (check_tool_calls reports that)."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def check_stream_equivalence(streamed: Turn, reference: Turn) -> list[Failure]:
    """The streamed reconstruction must equal the non-streamed result for the same (greedy) request,
    tool arguments compared parsed: a server (or proxy) may serialize the same object differently."""
    a = (streamed.content, [(c.name, _parsed_arguments(c.arguments)) for c in streamed.tool_calls],
         streamed.finish_reason)
    b = (reference.content, [(c.name, _parsed_arguments(c.arguments)) for c in reference.tool_calls],
         reference.finish_reason)
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
        # An empty reply that ended by itself (the model's first token was its end of turn) may count
        # 0 tokens: servers differ on whether the EOS counts (ours counts it; llama.cpp's does not).
        # Any reply with text or calls took at least one token.
        empty = reason == "stop" and not turn.content and not turn.tool_calls
        least = 0 if empty else 1
        if not least <= completion <= turn.max_tokens:
            failures.append(_fail("usage", turn, f"completion_tokens {completion} outside [{least}, {turn.max_tokens}]",
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


def is_grounded(value: str, conversation: str) -> bool:
    """`value` occurs in the conversation as a whole value: not as a piece of a longer word, id or
    number (`85` is not grounded by `ORD-4855`, nor `12.5` by `12.55`). A `-` or `.` between two
    alphanumerics joins them into one value; before a space or at a sentence end it does not."""
    pattern = (r"(?<![A-Za-z0-9])(?<![A-Za-z0-9][-.])" + re.escape(value) + r"(?![A-Za-z0-9])(?![-.][A-Za-z0-9])")
    return re.search(pattern, conversation) is not None


def check_grounded_arguments(turn: Turn, conversation: str) -> list[Failure]:
    """Every string and number in the tool arguments must occur as a whole value in the conversation so far
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
            if not is_grounded(text, conversation):
                failures.append(_fail("ungrounded-argument", turn, f"{call.name}: value {text!r} appears nowhere "
                                      "in the conversation", call.arguments))
    return failures


# A value in answer text: a number (with its sign and decimals) or a word/id (`ORD-4855`, `MTG-7KQ2`).
_VALUE = re.compile(r"(?<![A-Za-z0-9-])-?[A-Za-z0-9]+(?:[-.][A-Za-z0-9]+)*")
_SENTENCE_END = re.compile(r"(^|[.!?\]]\s*)$")


def answer_values(text: str) -> list[str]:
    """The values an answer states: every token holding a digit (amounts, temperatures, ids, times)
    and every capitalised word that does not open a sentence (names, cities, days). A word opening
    a sentence ("Booked", "Order") is the answer's own phrasing, not a value."""
    values = []
    for match in _VALUE.finditer(text):
        token = match.group(0)
        if any(ch.isdigit() for ch in token):
            values.append(token)
        elif token[0].isupper() and len(token) > 1 and not _SENTENCE_END.search(text[:match.start()]):
            values.append(token)
    return values


def check_grounded_answer(turn: Turn, conversation: str) -> list[Failure]:
    """Every number and entity in a final answer occurs as a whole value in the conversation (the
    user's words, the system prompt and the tool results): the canary model copies them, so a digit
    changed in the answer text, where no tool-argument oracle looks, shows here. Only for a model
    that copies (the canary model); a real LLM may legitimately round or reformat."""
    if turn.tool_calls or turn.aborted:
        return []
    missing = [v for v in answer_values(turn.content) if not is_grounded(v, conversation)]
    if missing:
        return [_fail("ungrounded-answer", turn, f"answer values {missing[:5]} appear nowhere in the conversation",
                      turn.content)]
    return []


def check_required_calls(turn: Turn, made: list[ToolCall], required: list[tuple[str, dict]],
                         exact: bool) -> list[Failure]:
    """At the end of a user turn (its final answer, `turn`), the tool calls made across the turn's
    requests (`made`) include every call its scenario requires. `exact` (the canary model, which
    was trained on these very calls): the same calls with the same parsed arguments, none missing
    and none extra. Otherwise (a real LLM): each required function was called at least once."""
    names_made = [c.name for c in made]
    if not exact:
        absent = sorted({name for name, _ in required} - set(names_made))
        if absent:
            return [_fail("required-calls", turn, f"required tool calls {absent} never made (made {names_made})",
                          turn.content)]
        return []
    want = sorted(json.dumps([name, args], sort_keys=True) for name, args in required)
    got = sorted(json.dumps([c.name, _parsed_arguments(c.arguments)], sort_keys=True) for c in made)
    if want != got:
        missing = [w for w in want if w not in got]
        extra = [g for g in got if g not in want]
        return [_fail("required-calls", turn, f"tool calls of the turn differ from the required ones: missing "
                      f"{missing[:3]}, extra {extra[:3]}", "; ".join(got))]
    return []


def check_call_ids(turn: Turn) -> list[Failure]:
    """Each tool call of a response has its own non-empty id: the client answers each call by id,
    so two calls sharing one would have one result attributed to both."""
    ids = [c.id for c in turn.tool_calls]
    failures = []
    if any(not i for i in ids):
        failures.append(_fail("tool-call-id", turn, f"tool call without an id: {ids}", _output_text(turn)))
    duplicates = sorted({i for i in ids if i and ids.count(i) > 1})
    if duplicates:
        failures.append(_fail("tool-call-id", turn, f"tool call ids {duplicates} used by more than one call",
                              _output_text(turn)))
    return failures


@dataclass
class StreamProtocol:
    """What the raw SSE of one streamed response carried, beyond what the parsed chunks show."""
    done: bool = False  # a `data: [DONE]` line arrived
    events_after_done: int = 0
    usage_chunks: int = 0
    tool_call_indexes: list[int] = field(default_factory=list)  # in order of first appearance


def check_stream_protocol(turn: Turn, protocol: StreamProtocol, include_usage: bool) -> list[Failure]:
    """A complete stream ends with `[DONE]` (nothing after it), carries exactly one usage chunk
    when `stream_options.include_usage` was asked, and numbers its tool calls 0, 1, 2, ... (a gap
    or a repeat means a call was dropped or merged). An aborted stream is incomplete by design."""
    if turn.aborted:
        return []
    failures = []
    if not protocol.done:
        failures.append(_fail("stream-done", turn, "stream ended without its data: [DONE] terminator",
                              _output_text(turn)))
    if protocol.events_after_done:
        failures.append(_fail("stream-done", turn, f"{protocol.events_after_done} events after [DONE]",
                              _output_text(turn)))
    if include_usage and protocol.usage_chunks != 1:
        failures.append(_fail("stream-usage", turn, f"{protocol.usage_chunks} usage chunks although include_usage "
                              "was asked (want 1)", _output_text(turn)))
    indexes = protocol.tool_call_indexes
    if indexes != list(range(len(indexes))):
        failures.append(_fail("tool-call-index", turn, f"tool call indexes {indexes} are not 0..{len(indexes) - 1} "
                              "in order", _output_text(turn)))
    return failures


# Text of the canary chat template's control tokens, and the DSML spellings a parsed tool call
# consumes: none may reach a client as content (an EOS or role marker in an answer is a decode or
# template bug; a DSML tag in content is a tool call the parser missed).
CONTROL_TEXT = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>",
                "｜DSML｜", "<tool_result>", "</tool_result>")


def check_control_text(turn: Turn) -> list[Failure]:
    text = _output_text(turn)
    found = [t for t in CONTROL_TEXT if t in text]
    if found:
        return [_fail("control-text", turn, f"control-token text {found} in the reply", text)]
    return []
