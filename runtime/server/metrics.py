"""Prometheus metrics of one server, in a private registry (several servers can live in one test
process). Names carry the `dsv4_` prefix; the canary gate reads `dsv4_kv_pages_in_use`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("dsv4_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"],
                                registry=r)
        self.finished = Counter("dsv4_request_finish", "Finished generations by finish reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("dsv4_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("dsv4_generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("dsv4_running_requests", "Requests in the running batch", registry=r)
        self.in_flight = Gauge("dsv4_http_requests_in_flight", "Generation requests holding a concurrency slot",
                               registry=r)
        self.waiting = Gauge("dsv4_waiting_requests", "Requests queued for admission", registry=r)
        # Held by requests: 0 when idle, what the gate's leak check reads. The prefix cache's pages are
        # kv_pages_cached (reclaimable: evicted before any allocation fails).
        self.kv_pages = Gauge("dsv4_kv_pages_in_use", "KV-cache pages held by requests", registry=r)
        self.kv_pages_cached = Gauge("dsv4_kv_pages_cached", "KV-cache pages held by the prefix cache", registry=r)
        self.prefix_hit_tokens = Counter("dsv4_prefix_cache_hit_tokens",
                                         "Prefill tokens whose KV was copied from the prefix cache", registry=r)
        self.prefix_lookup_tokens = Counter("dsv4_prefix_cache_lookup_tokens",
                                            "Prefill tokens of admitted requests looked up in the prefix cache",
                                            registry=r)
        self.kv_pages_total = Gauge("dsv4_kv_pages_total", "KV-cache pages in the pool", registry=r)
        # The canary gate reports how often its small-pool run really preempted (canary/workload.py).
        self.preemptions = Counter("dsv4_preemptions", "Running requests preempted to free KV pages", registry=r)
        # Model output the DSML parser did not take for a call, returned as content (runtime/server/dsml.py),
        # or output past a reply's last allowed call (output.py): by reason, a fixed phrase, never model text.
        self.dsml_rejected = Counter("dsv4_dsml_rejected", "Model output not returned as a tool call, by reason",
                                     ["reason"], registry=r)
        self.step_seconds = Histogram("dsv4_engine_step_seconds", "Wall time of one engine step",
                                      buckets=STEP_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
