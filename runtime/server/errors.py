"""OpenAI-shaped API errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx status.

Every way a request can be wrong ends here with a message that says what is wrong, so a bad input
never reaches the engine and never becomes a 5xx.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import Response


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def event(self) -> str:
        """The error inside a stream already answered 200: one server-sent event of its body."""
        return sse_event(self.body())

    def response(self) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        headers.update(self.headers)
        # ASCII-escaped: a message quoting client input (a lone surrogate, say) must still encode.
        return Response(json.dumps(self.body(), ensure_ascii=True), status_code=self.status, headers=headers,
                        media_type="application/json")


def sse_event(body: dict) -> str:
    """One server-sent event whose data is `body` as JSON (an error's, in a stream that is already open). Here, not
    in sse.py: that module imports the output builder (detokenizer, DSML parser), which the router never loads."""
    return f"data: {json.dumps(body)}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def rejected(message: str) -> ApiError:
    """The engine refused the request (over one of its limits): the client's 400."""
    return bad_request(f"request rejected: {message}", code="context_length_exceeded" if "exceeds" in message else None)


def from_validation_errors(errors: list[dict[str, Any]]) -> ApiError:
    """Turn pydantic/FastAPI validation errors into one 400 naming the first offending field."""
    first: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Union members add their type name to the location ("content.str"); keep only the field path.
    param = ".".join(p for p in loc if not p[:1].isupper() and p not in ("str", "list", "int", "float",
                                                                          "bool", "function-after"))
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return bad_request(f"request body is not valid JSON: {ctx.get('error', first['msg'])}",
                           code="invalid_json")
    if first.get("type") == "missing" and not param:
        return bad_request("request body is required")
    where = f"{param}: " if param else ""
    return bad_request(f"{where}{first.get('msg', 'invalid value')}", param=param or None)
