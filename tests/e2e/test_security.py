"""Security of the server: loopback by default, the API key on every route but /health, and no
prompt text or API key in the logs at the default level. Each oracle has a negative control that
shows it fails when the property is broken."""

from __future__ import annotations

import logging
import secrets
import socket
from ipaddress import ip_address

import httpx
import pytest
from starlette.routing import Route

from canary.targets import embedded_server
from runtime.server.auth import OPEN_PATHS, BearerAuth
from tests.e2e.launch import serve_in_thread, tiny_state

pytestmark = pytest.mark.e2e

KEY = "sk-" + secrets.token_hex(16)  # unique per run, so finding it in a log means this run leaked it
USER = [{"role": "user", "content": "hello"}]


# ---- loopback by default ------------------------------------------------------------------------
def non_loopback_address() -> str | None:
    """This machine's address on its default route (no packet is sent by a UDP connect)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("203.0.113.1", 9))  # TEST-NET-3: any routable address will do
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if ip_address(address).is_loopback else address


def reachable(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2.0)
        return s.connect_ex((address, port)) == 0


def test_default_host_is_loopback():
    from runtime.serve import parse_args

    assert ip_address(parse_args(["--model", "tiny-random"]).host).is_loopback


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    """The CLI with nothing but a model and a key: default host, default log level."""
    with embedded_server("tiny-random", ["--api-key", KEY], max_running=None, num_pages=None,
                         log_dir=tmp_path_factory.mktemp("default-server")) as server:
        yield server.root_url, server.port, server.log_path


def test_server_started_without_host_is_not_reachable_from_the_network(default_server):
    root, port, _ = default_server
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to probe from")
    assert reachable("127.0.0.1", port)
    assert not reachable(address, port), f"the default server accepts connections on {address}"


def test_reachability_probe_sees_a_socket_bound_to_all_interfaces():
    # Negative control: the probe above must report a wildcard-bound listener as reachable.
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to probe from")
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        assert reachable(address, listener.getsockname()[1])


# ---- the API key on every route but /health -----------------------------------------------------
def probes(app) -> list[tuple[str, str]]:
    """(method, path) for every route of the app; a route kind we do not know fails loudly, so a
    new kind of route (websocket, mount) forces this test to be extended rather than skipped."""
    out = []
    for route in app.routes:
        assert isinstance(route, Route), f"unhandled route kind {type(route).__name__} at {route.path}"
        path = route.path_format.replace("{", "").replace("}", "")  # any value for path parameters
        out += [(method, path) for method in sorted(route.methods or {"GET"})]
    return out


def auth_violations(root: str, routes: list[tuple[str, str]], key: str) -> list[str]:
    found = []
    for method, path in routes:
        if path in OPEN_PATHS:
            continue
        without = httpx.request(method, root + path, timeout=30).status_code
        wrong = httpx.request(method, root + path, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code
        right = httpx.request(method, root + path, headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code
        if without != 401 or wrong != 401:
            found.append(f"{method} {path}: {without} without the key, {wrong} with a wrong one (want 401)")
        if right == 401 or right >= 500:
            found.append(f"{method} {path}: {right} with the right key")
    return found


@pytest.fixture(scope="module")
def app_routes():
    from runtime.server.app import create_app

    routes = probes(create_app(tiny_state("--api-key", KEY)))
    paths = {path for _, path in routes}
    assert {"/v1/chat/completions", "/v1/models", "/metrics", "/server_info", "/health"} <= paths
    return routes


def test_every_route_but_health_needs_the_key(default_server, app_routes):
    root = default_server[0]
    assert auth_violations(root, app_routes, KEY) == []
    assert httpx.get(root + "/health").status_code == 200  # the liveness probe stays open
    # An unknown path answers 401 too: a keyless caller learns nothing about which paths exist.
    assert httpx.get(root + "/no/such/path").status_code == 401
    assert httpx.get(root + "/no/such/path", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


def test_key_scheme_and_duplicates(default_server):
    root = default_server[0]
    assert httpx.get(root + "/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(root + "/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401
    assert httpx.get(root + "/v1/models", headers={"Authorization": KEY}).status_code == 401
    two = httpx.Headers([("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer wrong")])
    assert httpx.get(root + "/v1/models", headers=two).status_code == 401


def test_route_oracle_flags_a_route_left_open(app_routes):
    # Negative control: a test-only app whose auth middleware leaves /metrics open.
    from runtime.server.app import create_app

    app = create_app(tiny_state("--api-key", KEY))
    auth = next(m for m in app.user_middleware if m.cls is BearerAuth)
    auth.kwargs["open_paths"] = OPEN_PATHS | {"/metrics"}
    with serve_in_thread(app) as root:
        violations = auth_violations(root, probes(app), KEY)
    assert violations and all("/metrics" in v for v in violations), violations


# ---- no prompt text or key in the logs -----------------------------------------------------------
def exercise(root: str, marker: str, key: str) -> None:
    """Requests that carry the marker in the prompt and the key in the header, every way a prompt
    can reach the server: unary, streamed, rejected by validation, rejected by auth."""
    auth = {"Authorization": f"Bearer {key}"}
    messages = [{"role": "user", "content": f"please repeat {marker}"}]
    ok = httpx.post(root + "/v1/chat/completions", headers=auth, timeout=60,
                    json={"model": "tiny-random", "messages": messages, "max_tokens": 4})
    assert ok.status_code == 200, ok.text
    streamed = httpx.post(root + "/v1/chat/completions", headers=auth, timeout=60,
                          json={"model": "tiny-random", "messages": messages, "max_tokens": 4, "stream": True})
    assert streamed.status_code == 200 and "[DONE]" in streamed.text
    bad = httpx.post(root + "/v1/chat/completions", headers=auth, timeout=60,
                     json={"model": "tiny-random", "messages": messages, "max_tokens": -1})
    assert bad.status_code == 400
    assert httpx.post(root + "/v1/chat/completions", headers={"Authorization": f"Bearer {marker}"},
                      json={"model": "tiny-random", "messages": messages}).status_code == 401


def test_no_prompt_or_key_in_logs_at_the_default_level(tmp_path):
    marker = "MARKER-" + secrets.token_hex(8)
    with embedded_server("tiny-random", ["--api-key", KEY], max_running=None, num_pages=None,
                         log_dir=tmp_path) as server:
        exercise(server.root_url, marker, KEY)
    text = server.log_path.read_text()
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in text  # the capture holds the access log
    assert marker not in text
    assert KEY not in text


def test_log_oracle_sees_a_prompt_or_key_that_is_logged(tmp_path):
    # Negative control: at debug level the server logs prompts, and uvicorn's access log records a
    # query string; the same capture and the same search must then find the marker and the key.
    marker = "MARKER-" + secrets.token_hex(8)
    with embedded_server("tiny-random", ["--api-key", KEY, "--log-level", "debug"], max_running=None, num_pages=None,
                         log_dir=tmp_path) as server:
        exercise(server.root_url, marker, KEY)
        httpx.get(server.url_for("health"), params={"api_key": KEY})
    text = server.log_path.read_text()
    assert marker in text
    assert KEY in text


def test_api_key_from_the_environment_and_never_in_a_repr(monkeypatch):
    # The environment keeps the key out of the process list; repr(Env) must not print it either.
    from runtime.env import Env

    monkeypatch.setenv("DSV4_SERVER_API_KEY", KEY)
    assert KEY not in repr(Env.load())
    assert tiny_state().api_key == KEY
    assert tiny_state("--api-key", "from-the-command-line").api_key == "from-the-command-line"


# ---- an internal error names no request data ------------------------------------------------------
def app_with_a_planted_bug(marker: str):
    """The real app plus one route whose exception text carries request data, as the fuzzer's
    UnicodeEncodeError did (it quoted the prompt)."""
    from runtime.server.app import create_app

    app = create_app(tiny_state("--api-key", KEY))

    @app.get("/v1/planted-bug")
    async def planted_bug() -> None:
        raise RuntimeError(f"could not encode the prompt {marker}")

    return app


def test_an_internal_error_answers_an_error_id_and_logs_where_not_what(caplog):
    marker = "MARKER-" + secrets.token_hex(8)
    with caplog.at_level(logging.INFO), serve_in_thread(app_with_a_planted_bug(marker)) as root:
        response = httpx.get(root + "/v1/planted-bug", headers={"Authorization": f"Bearer {KEY}"})
        assert httpx.get(root + "/health").json() == {"status": "ok"}  # the server lives on
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and marker not in response.text
    error_id = error["message"].split()[2]
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged, "the error id must lead from the client's 500 to the server log"
    assert "RuntimeError" in logged[0].getMessage() and "planted_bug" in logged[0].getMessage()
    assert marker not in caplog.text  # nothing logged at INFO and above quotes the exception


def test_the_internal_error_oracles_see_a_leak(caplog):
    # Negative control: at debug level the message is logged, and the same search must find it.
    marker = "MARKER-" + secrets.token_hex(8)
    with caplog.at_level(logging.DEBUG), serve_in_thread(app_with_a_planted_bug(marker)) as root:
        httpx.get(root + "/v1/planted-bug", headers={"Authorization": f"Bearer {KEY}"})
    assert marker in caplog.text


def test_health_of_a_dead_engine_says_only_that():
    from runtime.server.app import create_app

    state = tiny_state("--api-key", KEY)
    app = create_app(state)
    with serve_in_thread(app) as root:
        state.bridge.error = RuntimeError("engine thread died holding request data")
        health = httpx.get(root + "/health")
        info = httpx.get(root + "/server_info", headers={"Authorization": f"Bearer {KEY}"}).json()
        state.bridge.error = None
    assert health.status_code == 503 and health.json() == {"status": "engine down"}
    assert "engine thread died" in info["engine_error"]  # the cause, behind the key
