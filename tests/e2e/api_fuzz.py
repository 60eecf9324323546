"""Hostile HTTP requests for the server (hypothesis strategies), how to send one, and the oracle
that judges the answer.

Families of probes (`Probe.kind`):
  chat     - a valid chat request (messages, tools, tool_choice, sampling fields; max_tokens <= 3)
             with 0-3 mutations: a field set to a hostile JSON value (wrong type, huge or negative
             number, NaN/Infinity, lone surrogates), a field deleted, unknown keys, deep nesting,
             unknown roles, bad tool schemas, tool_choice naming an unknown function, no messages;
             encoded ASCII-escaped or as raw (possibly invalid) UTF-8
  raw      - bodies that are not a JSON request: random bytes, truncated JSON, invalid UTF-8,
             deeply nested arrays, empty, oversized (past the body limit)
  headers  - a valid body with hostile headers: content types, missing/wrong/malformed keys,
             random extra headers, oversized headers
  route    - any method on any of the app's paths or a random one, with a random query string
The oracle: never a 5xx, every 4xx an OpenAI-shaped error, every 200 from chat completions a
complete answer (a stream ends with [DONE] and carries no server_error chunk). A connection the
server cuts is accepted only for headers larger than the HTTP parser's buffer.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import strategies as st

CHAT_PATH = "/v1/chat/completions"
MODEL = "tiny-random"
TOOL_NAMES = ("get_weather", "search", "add_numbers")
SCHEMAS = (
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    {"type": "object"},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}, "tags": {"type": "array"}}},
)
BAD_SCHEMAS = ({"type": "banana"}, {"type": "string"}, {"type": "object", "properties": {"a": {"pattern": "(("}}},
               {"type": ["object", "null"]}, {"$ref": "http://example.invalid/schema"}, {"required": "city"},
               {"type": "object", "properties": []})
CONTENT_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/json; charset=latin-1", "APPLICATION/JSON", "", "application/jsonx", "*/*")
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")
# Fields whose valid values make the engine generate: a mutation never deletes them or sets them
# to a large valid count, so a fuzz run stays a few milliseconds per request.
GENERATION_FIELDS = ("max_tokens", "max_completion_tokens")
# uvicorn's HTTP parser refuses (or cuts the connection on) headers past its own buffer, before
# the app can answer; below this size a cut connection is a failure.
PARSER_HEADER_LIMIT = 64 * 1024


@dataclass(frozen=True)
class Probe:
    kind: str
    method: str
    path: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes | None

    @property
    def header_bytes(self) -> int:
        return sum(len(name) + len(value) for name, value in self.headers)

    def describe(self) -> str:
        body = self.body if self.body is None or len(self.body) <= 300 else self.body[:300] + b"..."
        return f"[{self.kind}] {self.method} {self.path} ({self.header_bytes} header bytes) body={body!r}"


# ---- values -------------------------------------------------------------------------------------
lone_surrogates = st.lists(st.integers(0xD800, 0xDFFF).map(chr), min_size=1, max_size=3).map("".join)
hostile_text = st.one_of(st.text(max_size=30), lone_surrogates, st.builds(lambda a, s: a + s, st.text(max_size=5),
                                                                          lone_surrogates))
hostile_numbers = st.one_of(st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
                            st.sampled_from([0, -1, 2**63, 2**64, -(2**63) - 1, 10**30]),
                            st.floats(allow_nan=True, allow_infinity=True))
json_scalars = st.one_of(st.none(), st.booleans(), hostile_numbers, hostile_text)
hostile_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(hostile_text, inner, max_size=4)), max_leaves=8)
# A generation field gets anything but a large valid count or null (null means "up to the context").
generation_values = st.one_of(st.integers(max_value=3), st.integers(min_value=10**6), json_scalars.filter(
    lambda v: v is not None and (not isinstance(v, int) or isinstance(v, bool))))


# ---- a valid chat request ----------------------------------------------------------------------
def tool_def(name: str) -> st.SearchStrategy[dict]:
    return st.builds(lambda schema, description: {"type": "function", "function": {
        "name": name, "description": description, "parameters": schema}},
        st.sampled_from(SCHEMAS), st.text(max_size=20))


# Well-typed message text, sometimes with lone surrogates (valid JSON escapes, invalid Unicode).
message_text = st.one_of(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40),
                         st.builds(lambda a, s, b: a + s + b, st.text(max_size=5), lone_surrogates,
                                   st.text(max_size=5)))


@st.composite
def messages(draw) -> list[dict]:
    text = message_text
    out = []
    if draw(st.booleans()):
        out.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(text)})
    out.append({"role": "user", "content": draw(st.one_of(text, st.lists(
        st.builds(lambda t: {"type": "text", "text": t}, text), min_size=1, max_size=2)))})
    if draw(st.booleans()):
        call_id = draw(st.text(min_size=1, max_size=8))
        out.append({"role": "assistant", "tool_calls": [{"id": call_id, "type": "function", "function": {
            "name": draw(st.sampled_from(TOOL_NAMES)), "arguments": draw(st.one_of(
                st.just('{"city": "Paris"}'), st.text(max_size=20)))}}]})
        out.append({"role": "tool", "tool_call_id": call_id, "content": draw(text)})
        out.append({"role": "user", "content": draw(text)})
    return out


@st.composite
def chat_request(draw) -> dict:
    body: dict[str, Any] = {"model": MODEL, "messages": draw(messages())}
    body[draw(st.sampled_from(GENERATION_FIELDS))] = draw(st.integers(1, 3))
    names = draw(st.lists(st.sampled_from(TOOL_NAMES), unique=True, max_size=3))
    if names:
        body["tools"] = [draw(tool_def(name)) for name in names]
        body["tool_choice"] = draw(st.one_of(st.sampled_from(["auto", "none", "required"]), st.sampled_from(names).map(
            lambda n: {"type": "function", "function": {"name": n}})))
        body["parallel_tool_calls"] = draw(st.booleans())
    if draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
    optional = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "seed": st.integers(0, 2**31),
                "stop": st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5),
                                                                            max_size=4)),
                "logprobs": st.booleans(), "user": st.text(max_size=10), "n": st.just(1)}
    for key in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=4)):
        body[key] = draw(optional[key])
    if body.get("logprobs") and draw(st.booleans()):
        body["top_logprobs"] = draw(st.integers(0, 20))
    return body


# ---- mutations ----------------------------------------------------------------------------------
def paths_of(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every location in a JSON tree, as a tuple of keys/indexes (the root is ())."""
    out = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            out += paths_of(item, prefix + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += paths_of(item, prefix + (i,))
    return out


def replace_at(root: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    parent = root
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    return root


def delete_at(root: Any, path: tuple) -> Any:
    if not path:
        return root
    parent = root
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    return root


# Deeper than Python's own json module can encode: a placeholder string in the tree, spliced into
# the encoded body as text (see `encode`).
SHALLOW_DEPTH = 80
DEEP_PLACEHOLDER = re.compile(rb'"@@deep:(\d+):(list|dict)@@"')


def nested(depth: int, leaf: Any, as_list: bool) -> Any:
    if depth > SHALLOW_DEPTH:
        return f"@@deep:{depth}:{'list' if as_list else 'dict'}@@"
    for _ in range(depth):
        leaf = [leaf] if as_list else {"a": leaf}
    return leaf


def splice_deep(text: bytes) -> bytes:
    def expand(match: re.Match) -> bytes:
        depth = int(match.group(1))
        return b"[" * depth + b"0" + b"]" * depth if match.group(2) == b"list" else \
            b'{"a":' * depth + b"0" + b"}" * depth
    return DEEP_PLACEHOLDER.sub(expand, text)


def applicable(body: Any) -> list[str]:
    """The mutations that make sense for `body` as earlier mutations left it."""
    kinds = ["set", "deep"]
    paths = paths_of(body)
    if any(p and p[-1] not in GENERATION_FIELDS for p in paths):
        kinds.append("delete")
    if any(isinstance(_at(body, p), dict) for p in paths):
        kinds.append("unknown_key")
    if isinstance(body, dict):
        kinds += ["unknown_tool_choice", "empty_messages", "number", "bad_schema"]
        chat = body.get("messages")
        if isinstance(chat, list) and chat and all(isinstance(m, dict) for m in chat):
            kinds.append("role")
    return kinds


@st.composite
def mutate(draw, body: Any) -> Any:
    body = json.loads(json.dumps(body))  # a private copy
    kind = draw(st.sampled_from(applicable(body)))
    paths = paths_of(body)
    if kind == "set":
        path = draw(st.sampled_from(paths))
        generation = bool(path) and path[-1] in GENERATION_FIELDS
        body = replace_at(body, path, draw(generation_values if generation else hostile_values))
    elif kind == "delete":
        body = delete_at(body, draw(st.sampled_from([p for p in paths if p and p[-1] not in GENERATION_FIELDS])))
    elif kind == "unknown_key":
        target = _at(body, draw(st.sampled_from([p for p in paths if isinstance(_at(body, p), dict)])))
        target["x_" + draw(st.text(max_size=8))] = draw(hostile_values)
    elif kind == "deep":
        path = draw(st.sampled_from([p for p in paths if not p or p[-1] not in GENERATION_FIELDS]))
        depth = draw(st.one_of(st.integers(1, SHALLOW_DEPTH), st.integers(SHALLOW_DEPTH + 1, 5000)))
        body = replace_at(body, path, nested(depth, draw(json_scalars), draw(st.booleans())))
    elif kind == "role":
        i = draw(st.integers(0, len(body["messages"]) - 1))
        body["messages"][i]["role"] = draw(st.one_of(hostile_text, st.sampled_from(["wizard", "USER", "function"])))
    elif kind == "unknown_tool_choice":
        body["tool_choice"] = {"type": "function", "function": {"name": draw(st.text(max_size=12))}}
    elif kind == "bad_schema":
        schema = draw(st.one_of(st.sampled_from(BAD_SCHEMAS), hostile_values))
        body["tools"] = [{"type": "function", "function": {"name": draw(st.sampled_from(TOOL_NAMES)),
                                                           "parameters": schema}}]
    elif kind == "empty_messages":
        body["messages"] = []
    elif kind == "number":
        field_name = draw(st.sampled_from(["temperature", "top_p", "seed", "top_logprobs", "n", *GENERATION_FIELDS]))
        body[field_name] = draw(generation_values if field_name in GENERATION_FIELDS else hostile_numbers)
    return body


def _at(root: Any, path: tuple) -> Any:
    for key in path:
        root = root[key]
    return root


@st.composite
def encode(draw, value: Any) -> bytes:
    """JSON text, ASCII-escaped (lone surrogates become \\ud800 escapes) or raw UTF-8 with
    surrogates passed through (bytes that are not valid UTF-8); NaN/Infinity kept as Python emits."""
    if draw(st.booleans()):
        text = json.dumps(value, ensure_ascii=True, allow_nan=True).encode()
    else:
        text = json.dumps(value, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")
    return splice_deep(text)


# ---- headers ------------------------------------------------------------------------------------
header_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-_0123456789", min_size=1, max_size=20).map(
    lambda n: ("x-" + n).encode())
# RFC 9110 field-value characters (visible ASCII and obs-text): what an HTTP client will send.
header_values = st.binary(max_size=40).map(lambda b: bytes(c for c in b if 0x21 <= c <= 0x7E or c >= 0x80) or b"v")


def base_headers(key: str, content_type: bytes | None = b"application/json") -> list[tuple[bytes, bytes]]:
    headers = [(b"authorization", f"Bearer {key}".encode())]
    if content_type is not None:
        headers.append((b"content-type", content_type))
    return headers


@st.composite
def hostile_headers(draw, key: str) -> list[tuple[bytes, bytes]]:
    auth = draw(st.sampled_from(["right", "right", "missing", "wrong", "scheme", "twice", "empty"]))
    headers = {"right": [(b"authorization", f"Bearer {key}".encode())], "missing": [],
               "wrong": [(b"authorization", b"Bearer not-the-key")], "scheme": [(b"authorization", key.encode())],
               "twice": [(b"authorization", f"Bearer {key}".encode())] * 2,
               "empty": [(b"authorization", b"Bearer")]}[auth]
    content_type = draw(st.one_of(st.none(), st.sampled_from(CONTENT_TYPES).map(str.encode), header_values))
    if content_type is not None:
        headers.append((b"content-type", content_type))
    headers += draw(st.lists(st.tuples(header_names, header_values), max_size=5))
    if draw(st.integers(0, 5)) == 0:  # oversized: under, between and past the two header limits
        size = draw(st.sampled_from([8 * 1024, 40 * 1024, 100 * 1024, 300 * 1024]))
        headers.append((b"x-oversized", b"a" * size))
    return headers


# ---- probes -------------------------------------------------------------------------------------
@st.composite
def chat_probe(draw, key: str) -> Probe:
    body = draw(chat_request())
    for _ in range(draw(st.integers(0, 3))):
        body = draw(mutate(body))
    return Probe("chat", "POST", CHAT_PATH, tuple(base_headers(key)), draw(encode(body)))


@st.composite
def raw_probe(draw, key: str, body_limit: int) -> Probe:
    valid = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    body = draw(st.one_of(
        st.binary(max_size=200),
        st.integers(0, len(valid) - 1).map(lambda n: valid[:n]),  # truncated JSON
        st.binary(min_size=1, max_size=4).map(lambda b: valid.replace(b'"hi"', b'"h' + b + b'\xff"')),
        st.integers(1, 200_000).map(lambda d: b"[" * d + b"]" * d),
        st.sampled_from([b"", b"null", b"[]", b"42", b'"text"', b"{}", b"NaN", b"{\"model\": Infinity}"]),
        st.integers(1, 64).map(lambda extra: b'{"model": "' + b"x" * (body_limit + extra) + b'"}'),
    ))
    return Probe("raw", "POST", CHAT_PATH, tuple(base_headers(key)), body)


@st.composite
def header_probe(draw, key: str) -> Probe:
    body = draw(chat_request())
    return Probe("headers", "POST", CHAT_PATH, tuple(draw(hostile_headers(key))), json.dumps(body).encode())


@st.composite
def route_probe(draw, key: str, paths: list[str]) -> Probe:
    path = draw(st.one_of(st.sampled_from(paths), st.text(
        alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._~/%", max_size=30).map(lambda p: "/" + p)))
    query = draw(st.one_of(st.just(""), st.text(alphabet="abc=&%20xyz", max_size=20).map(lambda q: "?" + q)))
    method = draw(st.sampled_from(METHODS))
    headers = base_headers(key, None) if draw(st.integers(0, 3)) else []
    body = draw(st.one_of(st.none(), st.binary(max_size=50)))
    return Probe("route", method, path + query, tuple(headers), body)


def probes(family: str, key: str, paths: list[str], body_limit: int) -> st.SearchStrategy[Probe]:
    """One family's strategy. Each family is fuzzed with its own example budget: hypothesis does not
    draw one_of branches evenly (it favours the cheaper ones), and the budget should be ours."""
    return {"chat": lambda: chat_probe(key), "raw": lambda: raw_probe(key, body_limit),
            "headers": lambda: header_probe(key), "route": lambda: route_probe(key, paths)}[family]()


# ---- sending and judging ------------------------------------------------------------------------
@dataclass
class Outcome:
    status: int | None  # None: the connection failed
    content_type: str = ""
    text: str = ""
    transport_error: str | None = None


def send(client: httpx.Client, root: str, probe: Probe) -> Outcome:
    try:
        resp = client.request(probe.method, root + probe.path, headers=list(probe.headers), content=probe.body)
    except httpx.TransportError as exc:
        return Outcome(None, transport_error=f"{type(exc).__name__}: {exc}")
    return Outcome(resp.status_code, resp.headers.get("content-type", ""), resp.text)


def problems(probe: Probe, outcome: Outcome) -> list[str]:
    if outcome.status is None:
        if probe.header_bytes > PARSER_HEADER_LIMIT:
            return []  # the HTTP parser's own limit: uvicorn hangs up before the app sees anything
        return [f"connection failed: {outcome.transport_error}"]
    if outcome.status >= 500:
        return [f"5xx: {outcome.status} {outcome.text[:300]}"]
    if probe.method == "HEAD":
        return []  # no body to judge
    if outcome.status >= 400:
        if outcome.text == "Invalid HTTP request received." and probe.header_bytes > PARSER_HEADER_LIMIT:
            return []  # uvicorn's answer to headers past its parser buffer
        return _error_shape(outcome)
    if probe.method == "POST" and probe.path == CHAT_PATH and outcome.status == 200:
        return _completion_shape(outcome)
    return []


def _error_shape(outcome: Outcome) -> list[str]:
    try:
        error = json.loads(outcome.text)["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
    except (ValueError, KeyError, TypeError, AssertionError):
        return [f"{outcome.status} without an OpenAI-shaped error body: {outcome.text[:300]!r}"]
    return []


def _completion_shape(outcome: Outcome) -> list[str]:
    if outcome.content_type.startswith("text/event-stream"):
        events = [line[len("data: "):] for line in outcome.text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return [f"stream does not end with [DONE]: {outcome.text[-300:]!r}"]
        for event in events[:-1]:
            try:
                chunk = json.loads(event)
            except ValueError:
                return [f"stream event is not JSON: {event[:200]!r}"]
            if "error" in chunk:
                return [f"error inside a 200 stream: {event[:300]}"]
        return []
    try:
        body = json.loads(outcome.text)
        assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"]
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    except (ValueError, KeyError, IndexError, TypeError, AssertionError):
        return [f"200 without a complete chat completion: {outcome.text[:300]!r}"]
    return []


@dataclass
class FuzzStats:
    statuses: Counter = field(default_factory=Counter)  # status (or "cut") -> count
    by_kind: Counter = field(default_factory=Counter)  # (kind, status) -> count

    def record(self, probe: Probe, outcome: Outcome) -> None:
        status = "cut" if outcome.status is None else outcome.status
        self.statuses[status] += 1
        self.by_kind[(probe.kind, status)] += 1

    @property
    def total(self) -> int:
        return sum(self.statuses.values())

    def summary(self) -> dict:
        kinds: dict[str, dict] = {}
        for (kind, status), n in sorted(self.by_kind.items(), key=str):
            kinds.setdefault(kind, {})[str(status)] = n
        return {"requests": self.total, "statuses": {str(k): v for k, v in sorted(self.statuses.items(), key=str)},
                "by_kind": kinds}
