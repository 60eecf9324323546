"""Reading and decoding a JSON request body, with every limit that protects the server from it.

A body is refused (4xx, never 5xx) when it is: of a non-JSON content type (415; a browser page can
POST text/plain or form bodies cross-origin without a CORS preflight, so accepting them would let
any web page drive a loopback server), larger than the byte limit (413; counted while reading, so
a chunked body without Content-Length is cut off too), not strict JSON (NaN and Infinity are not
JSON), nested deeper than `MAX_JSON_DEPTH` (the validators, JSON Schema checks and template
rendering after this recurse), or carrying strings that are not valid Unicode (a `\\ud800` escape
decodes to a lone surrogate that no UTF-8 encoder accepts).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from runtime.server.errors import ApiError, bad_request

MAX_JSON_DEPTH = 64
JSON_MEDIA_TYPE = "application/json"


def check_content_type(header: str | None) -> None:
    """No header is accepted (curl-like clients omit it); any other media type than JSON is a 415."""
    if header is None:
        return
    media_type = header.split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        raise ApiError(415, f"unsupported content type {media_type[:100]!r}: send Content-Type: {JSON_MEDIA_TYPE}",
                       code="unsupported_media_type")


async def read_limited(chunks: AsyncIterator[bytes], declared_length: str | None, limit: int) -> bytes:
    if declared_length is not None and declared_length.isdigit() and int(declared_length) > limit:
        raise _too_large(f"request body of {declared_length} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > limit:
            raise _too_large(f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


def decode_json(body: bytes) -> Any:
    try:
        payload = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:  # includes UnicodeDecodeError (invalid UTF-8) and json.JSONDecodeError
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    check_structure(payload)
    return payload


def check_structure(payload: Any) -> None:
    """Depth and Unicode checks in one walk without recursion (the payload may be hostile)."""
    stack: list[tuple[Any, int]] = [(payload, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key)
                stack.append((item, depth + 1))


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("request body contains a string that is not valid Unicode (a lone surrogate escape)",
                          code="invalid_json") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _too_large(message: str) -> ApiError:
    return ApiError(413, message, code="request_too_large")


def _too_deep() -> ApiError:
    return bad_request(f"request body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")


async def until_disconnected(request) -> None:
    """Return when the client goes away. Only once the body has been read: the next ASGI message
    is then the client's disconnect (as Starlette's StreamingResponse listens for it)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
