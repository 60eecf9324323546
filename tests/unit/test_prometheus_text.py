"""The one Prometheus text parser (runtime/server/prometheus_text.py) and its two readers: the PD
router's /metrics sums and the harness's `Target.metric`. A sample is found by its exact name; the
controls show the substring match it replaced picking the wrong family off the same text."""

from __future__ import annotations

import math

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from canary.targets import Target
from runtime.router import create_router_app
from runtime.server.prometheus_text import Sample, parse_samples, sample_sum
from tests.fake_upstreams import FakeReply, FakeUpstreams

pytestmark = pytest.mark.unit

# What the router answers (runtime/router.py): the per-upstream series after the sums, and its name
# contains the sum's name.
ROUTER_TEXT = """\
# TYPE dsv4_kv_pages_in_use gauge
dsv4_kv_pages_in_use 0.0
# TYPE dsv4_preemptions counter
dsv4_preemptions_total 3.0
dsv4_pd_upstream_kv_pages_in_use{role="prefill",url="http://127.0.0.1:1"} 0.0
"""


def substring_metric(text: str, name: str) -> float | None:
    """The reading `Target.metric` did before: the first sample whose name (labels included) contains
    `name`, its value the line's last field."""
    for line in text.splitlines():
        if line.startswith("#") or name not in line.split(" ", 1)[0]:
            continue
        try:
            return float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
    return None


def test_label_values_keep_commas_braces_and_escapes():
    text = 'm{path="/a,b",q="say \\"hi\\", then }",bs="c:\\\\dir",nl="x\\ny"} 1\n'
    assert parse_samples(text) == [Sample("m", {"path": "/a,b", "q": 'say "hi", then }', "bs": "c:\\dir",
                                                "nl": "x\ny"}, 1.0)]


def test_label_syntax_variants():
    text = 'a{} 1\nb{x="1",} 2\nc { x = "1" , y="2" } 3\n'
    assert parse_samples(text) == [Sample("a", {}, 1.0), Sample("b", {"x": "1"}, 2.0),
                                   Sample("c", {"x": "1", "y": "2"}, 3.0)]


def test_comments_and_blank_lines_are_not_samples():
    text = ("# HELP dsv4_kv_pages_in_use pages 7\n# TYPE dsv4_kv_pages_in_use gauge\n"
            "#dsv4_kv_pages_in_use 9\n\n   \ndsv4_kv_pages_in_use 2\n")
    assert parse_samples(text) == [Sample("dsv4_kv_pages_in_use", {}, 2.0)]


def test_special_values():
    samples = parse_samples('h_bucket{le="+Inf"} 4\nup +Inf\ndown -Inf\nodd NaN\n')
    assert samples[0] == Sample("h_bucket", {"le": "+Inf"}, 4.0)
    assert [s.value for s in samples[1:3]] == [math.inf, -math.inf]
    assert math.isnan(samples[3].value)


def test_a_timestamp_is_not_the_value():
    text = 'dsv4_kv_pages_in_use 5 1712345678901\nx{a="b"} 2.5 1712345678901\n'
    assert parse_samples(text) == [Sample("dsv4_kv_pages_in_use", {}, 5.0), Sample("x", {"a": "b"}, 2.5)]
    # Control: the old reading took the last field, the timestamp.
    assert substring_metric(text, "dsv4_kv_pages_in_use") == 1712345678901.0


def test_an_exemplar_is_not_the_value():
    text = 'c_total{a="b"} 7 # {trace_id="abc"} 1.0 1712345678.9\n'
    assert parse_samples(text) == [Sample("c_total", {"a": "b"}, 7.0)]


def test_malformed_lines_are_skipped_and_the_rest_read():
    text = ('ok 1\nno_value\nbad{a="1" b="2"} 3\nunclosed{a="1" 3\nword abc\n9starts_with_digit 1\n'
            'too many fields here\nokay{a="1"} 2\n')
    assert parse_samples(text) == [Sample("ok", {}, 1.0), Sample("okay", {"a": "1"}, 2.0)]


def test_a_name_that_prefixes_another_is_not_matched():
    samples = parse_samples(ROUTER_TEXT + "dsv4_kv_pages_in_use_max 9.0\n")
    assert sample_sum(samples, "dsv4_kv_pages_in_use") == 0.0
    assert sample_sum(samples, "kv_pages_in_use") is None
    assert sample_sum(samples, "dsv4_preemptions") is None  # a counter is read as `_total`
    assert sample_sum(samples, "dsv4_preemptions_total") == 3.0
    # Control: the substring match reads the wrong family off the same text.
    assert substring_metric("dsv4_kv_pages_in_use_max 9.0\n" + ROUTER_TEXT, "dsv4_kv_pages_in_use") == 9.0
    assert substring_metric('dsv4_pd_upstream_kv_pages_in_use{role="decode"} 4.0\n' + ROUTER_TEXT,
                            "kv_pages_in_use") == 4.0


def test_sum_over_labels_and_the_label_filter():
    samples = parse_samples('req_total{endpoint="chat",status="200"} 5\nreq_total{endpoint="chat",status="400"} 2\n'
                            'req_total{endpoint="models",status="200"} 1\nother 100\n')
    assert sample_sum(samples, "req_total") == 8.0
    assert sample_sum(samples, "req_total", {"endpoint": "chat"}) == 7.0
    assert sample_sum(samples, "req_total", {"endpoint": "chat", "status": "400"}) == 2.0
    assert sample_sum(samples, "req_total", {"endpoint": "none"}) is None
    assert sample_sum(parse_samples("zero 0\n"), "zero") == 0.0  # present and 0 is not absent


def test_agrees_with_prometheus_clients_parser_on_what_it_writes():
    registry = CollectorRegistry()
    Counter("dsv4_requests", "HTTP requests", ["endpoint", "status"], registry=registry).labels(
        'chat,"v1"\\x\ny', "200").inc(3)
    Gauge("dsv4_kv_pages_in_use", "pages", registry=registry).set(7)
    Histogram("dsv4_step_seconds", "step", buckets=(0.01, 1.0), registry=registry).observe(0.5)
    text = generate_latest(registry).decode()
    theirs = [(s.name, s.labels, float(s.value)) for family in text_string_to_metric_families(text)
              for s in family.samples]
    assert [tuple(s) for s in parse_samples(text)] == theirs
    assert len(theirs) > 8  # counters, gauge, buckets up to +Inf, sums, counts, created


def test_router_sums_the_pair_and_target_metric_reads_the_sum(monkeypatch):
    prefill = ("# HELP dsv4_kv_pages_in_use KV-cache pages held by requests\n# TYPE dsv4_kv_pages_in_use gauge\n"
               "dsv4_kv_pages_in_use 2.0\ndsv4_kv_pages_in_use_max 50.0\n"
               "# TYPE dsv4_preemptions counter\ndsv4_preemptions_total 1.0\ndsv4_preemptions_created 1.7e9\n")
    decode = "dsv4_kv_pages_in_use 3.0 1712345678901\ndsv4_preemptions_total 4.0\n"
    texts = {"prefill": prefill, "decode": decode}
    fake = FakeUpstreams(lambda request: FakeReply(200, texts[request.host].encode(), content_type="text/plain")
                         if request.path == "/metrics" else FakeReply.json(200, {"status": "ok"}))
    with TestClient(create_router_app(["http://prefill:1"], ["http://decode:2"], connect=fake.connect)) as router:
        text = router.get("/metrics").text
        monkeypatch.setattr(httpx, "get", lambda url, **kw: router.get(httpx.URL(url).path))
        target = Target("router", "http://router.invalid/v1", "m", False)
        assert target.kv_pages_in_use() == 5.0
        assert target.metric("dsv4_preemptions_total") == 5.0
        assert target.metric("dsv4_pd_upstream_kv_pages_in_use") == 5.0  # both roles' series
        assert target.metric("kv_pages_in_use") is None
        assert target.metrics("dsv4_preemptions_total", "kv_pages_in_use") == {  # one read, several names
            "dsv4_preemptions_total": 5.0, "kv_pages_in_use": None}
    samples = parse_samples(text)
    assert sample_sum(samples, "dsv4_pd_upstream_kv_pages_in_use", {"role": "decode"}) == 3.0
    assert sample_sum(samples, "dsv4_pd_upstream_preemptions_total", {"role": "prefill"}) == 1.0
