"""What travels between router, prefill and decode besides the OpenAI request itself: two headers
(the router's room id and the prefill server's bootstrap URL) and the errors, OpenAI-shaped.

Light on purpose: the router imports it, and nothing here may pull in torch or the engine (the
router's start-up went from 3.8 s to a fraction of that when this module stopped importing the
bootstrap registry, which imports the transfer engine)."""

from __future__ import annotations

from runtime.server.errors import ApiError

ROOM_HEADER = "x-pd-room"
BOOTSTRAP_HEADER = "x-pd-bootstrap"  # the prefill server's base URL, where /pd/register and /pd/transfer live


class BootstrapError(RuntimeError):
    """A room or session problem, reported to the client (code names the kind)."""

    code = "pd_bootstrap_error"


class StaleSessionError(BootstrapError):
    code = "pd_stale_session"


class BootstrapTimeout(BootstrapError):
    code = "pd_timeout"


class RoomFailed(BootstrapError):
    code = "pd_transfer_failed"


def api_error(exc: BootstrapError) -> ApiError:
    """A bootstrap failure as the client sees it: 504 for a timeout, 409 for a stale session, else 502."""
    status = 504 if isinstance(exc, BootstrapTimeout) else 409 if exc.code == "pd_stale_session" else 502
    return ApiError(status, str(exc), type="server_error", code=exc.code)


def error_from_body(status: int, body: dict, fallback: str) -> ApiError:
    """The ApiError an upstream PD server answered with (its OpenAI-shaped body), passed on unchanged."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return ApiError(502, f"{fallback} (HTTP {status})", type="server_error", code="pd_upstream_error")
    return ApiError(status, str(error.get("message", fallback)), type=str(error.get("type") or "server_error"),
                    code=error.get("code"))
