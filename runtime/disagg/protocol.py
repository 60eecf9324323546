"""What travels between router, prefill and decode besides the OpenAI request itself: the router's
headers (room id, the prefill server's bootstrap URL, and for a stream the relay ask and its `created`),
the lines of a /pd/transfer answer and of a relaying prompt answer, and the errors, OpenAI-shaped.

Light on purpose: the router imports it, and nothing here may pull in torch or the engine (the
router's start-up went from 3.8 s to a fraction of that when this module stopped importing the
bootstrap registry, which imports the transfer engine)."""

from __future__ import annotations

import asyncio
import json

from runtime.server.errors import ApiError

ROOM_HEADER = "x-pd-room"
BOOTSTRAP_HEADER = "x-pd-bootstrap"  # the prefill server's base URL, where /pd/register and /pd/transfer live
# /pd/transfer answers in JSON lines: {"first": outcome} as soon as the prompt finished, then
# {"done": result} once its KV is written, or {"error": {"status": ..., "error": {...}}} instead.
TRANSFER_MEDIA_TYPE = "application/x-ndjson"

# A streamed request's first token goes from the prefill server to the router, which relays it to the
# client, instead of from the prefill server to the decode server, then to the router: two process hops
# fewer on the time to first token (~0.6 ms of the PD pair's ~1.2 over the colocated server's at 8-word
# prompts on the H100; docs/results.md, "Forty-second session"). The router asks for it (RELAY_HEADER) and
# answers the stream with the prompt's answer's first line (`relay_line`): the stream's opening chunk and
# the first token's, as the decode server would have written them. The decode server takes that token
# into its output state and writes RELAYED_EVENT in their place; the router takes that event out, so the
# client's bytes are the colocated server's. Both servers write the stream's chunks under one id (the
# room's, `completion_id`) and one `created` (CREATED_HEADER, the router's clock).
RELAY_HEADER = "x-pd-relay-first"
CREATED_HEADER = "x-pd-created"
# The prompt's answer when relaying: {"relay": text or null} once the prompt finished (null: the first
# token is not relayed, `relays_first_token`), then {"done": result} or {"error": ...}.
RELAY_MEDIA_TYPE = "application/x-ndjson"
# An SSE comment (clients skip comments, but the router never lets this one through): the decode side's
# stream in place of the relayed opening and first-token chunks.
RELAYED_EVENT = ": pd-first-token-relayed\n\n"


class BootstrapError(RuntimeError):
    """A room or session problem, reported to the client (code names the kind)."""

    code = "pd_bootstrap_error"


class StaleSessionError(BootstrapError):
    code = "pd_stale_session"


class BootstrapTimeout(BootstrapError):
    code = "pd_timeout"


class RoomFailed(BootstrapError):
    code = "pd_transfer_failed"


class PrefillStopping(BootstrapError):
    """The prefill server is shutting down: it opens no new room, and fails each room still open when
    the drain's wait ends (`was_open`) (runtime/disagg/bootstrap.py `drain`)."""

    code = "pd_prefill_stopping"

    def __init__(self, room: str, *, was_open: bool = False) -> None:
        super().__init__(f"room {room}: the prefill server shut down before its KV was written" if was_open
                         else f"room {room}: the prefill server is shutting down and opens no new room")


def api_error(exc: BootstrapError) -> ApiError:
    """A bootstrap failure as the client sees it: 504 for a timeout, 409 for a stale session, 503 for a
    prefill server shutting down, else 502."""
    status = (504 if isinstance(exc, BootstrapTimeout) else 409 if exc.code == "pd_stale_session"
              else 503 if isinstance(exc, PrefillStopping) else 502)
    return ApiError(status, str(exc), type="server_error", code=exc.code)


def error_from_body(status: int, body: dict, fallback: str) -> ApiError:
    """The ApiError an upstream PD server answered with (its OpenAI-shaped body), passed on unchanged."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return ApiError(502, f"{fallback} (HTTP {status})", type="server_error", code="pd_upstream_error")
    return ApiError(status, str(error.get("message", fallback)), type=str(error.get("type") or "server_error"),
                    code=error.get("code"))


def completion_id(room: str) -> str:
    """The id of a PD request's chunks on both servers (its room's: the router's fresh uuid)."""
    return f"chatcmpl-{room}"


def created_of(headers, fallback: int) -> int:
    """The `created` the router stamped on a PD request (CREATED_HEADER), else `fallback`."""
    value = headers.get(CREATED_HEADER)
    return int(value) if value is not None and value.isdigit() else fallback


def relays_first_token(token: int, eos_token_id: int, stop_token_ids) -> bool:
    """Whether the prefill server relays a first token it was asked to relay: not a stop token (EOS or a
    stop_token_id), whose text depends on why the request ends there (`is_stop_token`), which the decode
    side decides. Any other token's chunk is the same on both servers whatever follows it: what ends the
    request at it (max_tokens, a stop string, the length limit) comes in the decode side's next chunk."""
    return token != eos_token_id and token not in stop_token_ids


def first_token_of(outcome: dict, logprobs: bool) -> tuple[int, float, list[tuple[int, float]]]:
    """(token, logprob, top) of the prompt's outcome as both servers push it into the request's output:
    the logprobs only where the request asked for them."""
    if not logprobs:
        return int(outcome["token"]), 0.0, []
    return int(outcome["token"]), float(outcome["logprob"]), [(int(t), float(v)) for t, v in outcome["top"]]


def relay_line(text: str | None) -> bytes:
    """The relaying prompt answer's first line: the client's first bytes, or null (not relayed)."""
    return (json.dumps({"relay": text}, ensure_ascii=True) + "\n").encode()


def relayed_bytes(line: bytes | None) -> bytes | None:
    """The client's first bytes in a relaying prompt answer's first line; None for null, no line or a
    malformed one (the router then has nothing to relay)."""
    if not line:
        return None
    try:
        parsed = json.loads(line)
    except ValueError:
        return None
    text = parsed.get("relay") if isinstance(parsed, dict) else None
    return text.encode() if isinstance(text, str) and text else None


def settle_relay(future: asyncio.Future, value: object) -> None:
    """Sets a relay's future once: the first of the prompt's outcome (prefill side) or the client's first
    bytes (router) and its "nothing to relay" (None), whichever comes first, wins; the later one is a no-op."""
    if not future.done():
        future.set_result(value)


def transfer_line(**field: object) -> bytes:
    """One line of a /pd/transfer answer: exactly one of first=, done=, error=."""
    assert len(field) == 1 and next(iter(field)) in ("first", "done", "error"), field
    return (json.dumps(field, ensure_ascii=True) + "\n").encode()


def transfer_error(error: ApiError) -> dict:
    """An error line's value: the status and the OpenAI-shaped body (`error_from_line` reads it back)."""
    return {"status": error.status, **error.body()}


def parse_transfer_line(line: str) -> dict | None:
    """A /pd/transfer line as its one-key object ({"first": ...}, {"done": ...} or {"error": ...}), or
    None when it is not one. Parsed once: `ends_the_write` and `transfer_value` both read the result."""
    try:
        parsed = json.loads(line)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) and len(parsed) == 1 else None


def transfer_value(parsed: dict | None, want: str, line: str) -> dict:
    """The value of a parsed /pd/transfer line that must be `want` ("first" or "done"); an error line,
    a malformed line (None) or the wrong kind raise the ApiError the decode side's client sees."""
    if parsed is None:
        raise ApiError(502, f"malformed /pd/transfer line: {line[:200]!r}", type="server_error",
                       code="pd_upstream_error")
    if "error" in parsed and isinstance(parsed["error"], dict):
        value = parsed["error"]
        raise error_from_body(int(value.get("status", 502)), value, "the KV transfer failed")
    if want not in parsed or not isinstance(parsed[want], dict):
        raise ApiError(502, f"/pd/transfer sent {sorted(parsed)} where {want!r} was due", type="server_error",
                       code="pd_upstream_error")
    return parsed[want]


def ends_the_write(parsed: dict | None) -> bool:
    """Whether a parsed /pd/transfer line says no KV write into the room is in progress or can start:
    the result line (written) or an error line (the room failed, which bars its writes first)."""
    return parsed is not None and isinstance(parsed.get("done", parsed.get("error")), dict)
