"""API fuzzing of the real server (tiny-random): hostile requests from tests/e2e/api_fuzz.py, the
oracle there (no 5xx, OpenAI-shaped 4xx, complete 200s), and a healthy server afterwards.

`make test` runs the quick form (a few hundred requests); the full form (>= 2,000) is marked slow:
    .venv/bin/python -m pytest tests/e2e/test_fuzz_api.py --run-slow -s
Negative controls: the same fuzzing against test-only apps with a planted bug (a route that raises;
the fix for lone surrogates reverted) must fail, and the oracle flags synthetic bad answers.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from canary.targets import embedded_server
from runtime.server import request_body
from tests.e2e.api_fuzz import PARSER_HEADER_LIMIT, FuzzStats, Outcome, Probe, probes, problems, send
from tests.e2e.launch import serve_in_thread, tiny_state

pytestmark = pytest.mark.e2e

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 1024 * 1024
QUICK = {"chat": 150, "raw": 40, "headers": 40, "route": 40}
FULL = {"chat": 1200, "raw": 400, "headers": 400, "route": 400}
SLOW_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
               HealthCheck.filter_too_much]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    """A 1,024-token context bounds what any request can make the engine do, should a mutation
    ever let a long generation through."""
    with embedded_server("tiny-random", ["--api-key", KEY, "--max-model-len", "1024"], max_running=None, num_pages=None,
                         env={"DSV4_SERVER_MAX_BODY_BYTES": str(BODY_LIMIT)},
                         log_dir=tmp_path_factory.mktemp("fuzz")) as server:
        yield server.root_url, server.log_path


def app_paths(app) -> list[str]:
    return sorted({route.path for route in app.routes})


@pytest.fixture(scope="module")
def paths() -> list[str]:
    from runtime.server.app import create_app

    return app_paths(create_app(tiny_state("--api-key", KEY)))


def fuzz(root: str, family: str, paths: list[str], examples: int, stats: FuzzStats,
         phases: tuple = tuple(Phase)) -> None:
    """`examples` hypothesis examples of one family, each one request judged by the oracle."""
    # One connection per probe: a connection the server drops is then blamed on the probe that
    # caused it, not on whichever probe reuses it next.
    with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        @settings(max_examples=examples, deadline=None, suppress_health_check=SLOW_HEALTH, phases=phases,
                  report_multiple_bugs=False)
        @given(probe=probes(family, KEY, paths, BODY_LIMIT))
        def one(probe: Probe) -> None:
            outcome = send(client, root, probe)
            stats.record(probe, outcome)
            found = problems(probe, outcome)
            assert not found, f"{probe.describe()}: {found}"

        one()


def unknown_endpoint_labels(metrics: str, paths: list[str]) -> set[str]:
    """Endpoint labels of the request counter that are not routes: a scanner's random paths must
    not become label values (each would be a new series held for the life of the process)."""
    labels = set(re.findall(r'^dsv4_requests_total\{endpoint="([^"]*)"', metrics, flags=re.M))
    return labels - set(paths) - {"unmatched"}


def assert_healthy(root: str, log, paths: list[str]) -> None:
    assert httpx.get(root + "/health").json() == {"status": "ok"}
    answer = httpx.post(root + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": "tiny-random", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"], answer.text
    deadline = time.monotonic() + 15
    while (metrics := httpx.get(root + "/metrics", headers=AUTH).text) and "dsv4_kv_pages_in_use 0.0" not in metrics:
        assert time.monotonic() < deadline, "KV pages still in use after the fuzz run"
        time.sleep(0.1)
    assert 'status="500"' not in metrics
    assert 'endpoint="unmatched"' in metrics and unknown_endpoint_labels(metrics, paths) == set()
    text = log.read_text()
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-3000:]


def run_families(fuzz_server, paths, budget: dict[str, int]) -> FuzzStats:
    root, log = fuzz_server
    stats = FuzzStats()
    started = time.monotonic()
    for family, examples in budget.items():
        fuzz(root, family, paths, examples, stats)
    elapsed = time.monotonic() - started
    assert_healthy(root, log, paths)
    print("fuzz summary:", json.dumps({**stats.summary(), "seconds": round(elapsed, 1)}))
    return stats


def test_fuzz_quick(fuzz_server, paths):
    stats = run_families(fuzz_server, paths, QUICK)
    assert stats.total >= 0.9 * sum(QUICK.values())  # hypothesis really ran the examples


@pytest.mark.slow
def test_fuzz_full(fuzz_server, paths):
    stats = run_families(fuzz_server, paths, FULL)
    assert stats.total >= 2000


# ---- negative controls --------------------------------------------------------------------------
def test_fuzz_finds_a_route_that_raises():
    from runtime.server.app import create_app

    app = create_app(tiny_state("--api-key", KEY))

    @app.api_route("/v1/planted", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"],
                   include_in_schema=False)
    async def planted() -> None:
        raise RuntimeError("planted bug")

    # uvicorn closes the connection after an exception escapes the app, so when the probe also sent
    # a body it has not read, the client may see the reset instead of the 500: both are findings.
    with serve_in_thread(app) as root, pytest.raises(AssertionError, match="5xx|connection failed") as failure:
        fuzz(root, "route", app_paths(app), 300, FuzzStats(), phases=(Phase.generate,))
    assert "/v1/planted" in str(failure.value)


def test_fuzz_finds_a_reverted_fix(monkeypatch):
    # Without the Unicode/depth walk, a lone surrogate reaches the tokenizer: the bug the fuzzer found.
    from runtime.server.app import create_app

    monkeypatch.setattr(request_body, "check_structure", lambda payload: None)
    app = create_app(tiny_state("--api-key", KEY))
    with serve_in_thread(app) as root, pytest.raises(AssertionError, match="5xx"):
        fuzz(root, "chat", app_paths(app), 500, FuzzStats(), phases=(Phase.generate,))


def test_label_check_flags_a_raw_path_label():
    # Negative control for the cardinality check in assert_healthy.
    metrics = ('dsv4_requests_total{endpoint="/v1/models",status="200"} 1.0\n'
               'dsv4_requests_total{endpoint="unmatched",status="401"} 3.0\n'
               'dsv4_requests_total{endpoint="/wp-admin/x",status="404"} 1.0\n')
    assert unknown_endpoint_labels(metrics, ["/v1/models"]) == {"/wp-admin/x"}


def probe(header_bytes: int = 0) -> Probe:
    headers = ((b"x-big", b"a" * header_bytes),) if header_bytes else ()
    return Probe("chat", "POST", "/v1/chat/completions", headers, b"{}")


GOOD_ERROR = json.dumps({"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}})
GOOD_CHUNK = "data: " + json.dumps({"choices": [{"delta": {"content": "x"}}]})


@pytest.mark.parametrize("outcome, header_bytes, flagged", [
    (Outcome(500, "application/json", GOOD_ERROR), 0, True),
    (Outcome(503, "text/plain", "down"), 0, True),
    (Outcome(400, "text/plain", "bad"), 0, True),
    (Outcome(422, "application/json", '{"detail": []}'), 0, True),
    (Outcome(400, "application/json", GOOD_ERROR), 0, False),
    (Outcome(200, "text/event-stream", f"{GOOD_CHUNK}\n\ndata: [DONE]\n\n"), 0, False),
    (Outcome(200, "text/event-stream", f"{GOOD_CHUNK}\n\n"), 0, True),
    (Outcome(200, "text/event-stream", 'data: {"error": {"type": "server_error"}}\n\ndata: [DONE]\n\n'), 0, True),
    (Outcome(200, "application/json", '{"object": "chat.completion", "choices": []}'), 0, True),
    (Outcome(None, transport_error="ReadError: reset"), 0, True),
    (Outcome(None, transport_error="ReadError: reset"), PARSER_HEADER_LIMIT + 1, False),
    (Outcome(400, "text/plain", "Invalid HTTP request received."), 0, True),
    (Outcome(400, "text/plain", "Invalid HTTP request received."), PARSER_HEADER_LIMIT + 1, False),
])
def test_oracle_flags_bad_answers(outcome, header_bytes, flagged):
    assert bool(problems(probe(header_bytes), outcome)) is flagged
