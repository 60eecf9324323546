"""What travels between router, prefill and decode besides the OpenAI request itself: two headers
(the router's room id and the prefill server's bootstrap URL), the lines of a /pd/transfer answer, and
the errors, OpenAI-shaped.

Light on purpose: the router imports it, and nothing here may pull in torch or the engine (the
router's start-up went from 3.8 s to a fraction of that when this module stopped importing the
bootstrap registry, which imports the transfer engine)."""

from __future__ import annotations

import json

from runtime.server.errors import ApiError

ROOM_HEADER = "x-pd-room"
BOOTSTRAP_HEADER = "x-pd-bootstrap"  # the prefill server's base URL, where /pd/register and /pd/transfer live
# /pd/transfer answers in JSON lines: {"first": outcome} as soon as the prompt finished, then
# {"done": result} once its KV is written, or {"error": {"status": ..., "error": {...}}} instead.
TRANSFER_MEDIA_TYPE = "application/x-ndjson"


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
