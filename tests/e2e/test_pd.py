"""Issue 16: the PD pair (prefill + decode servers, Mooncake KV transfer over loopback, router in
front) answers exactly as the colocated server does - same tokens, same logprobs, bit for bit - and
every failure is an OpenAI-shaped error with every page back in both pools. Each PD fault
(runtime/faults.py PD_REGISTRY) is caught by the check written for it."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from contextlib import ExitStack

import httpx
import pytest

from runtime.disagg.transfer import unavailable_reason
from runtime.router import create_router_app
from tests.e2e.launch import serve_in_thread
from tests.e2e.pd_pair import pd_pair, serve_state, server_state

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

MODEL = "canary-moe-v2"
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "2+2=", "Tell me a story " * 20]


def body(prompt: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
            "temperature": 0, "logprobs": True, "top_logprobs": 3, **extra}


def answer(url: str, payload: dict) -> dict:
    """(text, tokens with logprobs and top logprobs, finish reason) of one request, unary or streamed."""
    if not payload.get("stream"):
        reply = httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=120)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        return {"text": choice["message"]["content"], "logprobs": choice["logprobs"]["content"],
                "finish": choice["finish_reason"]}
    text, logprobs, finish = "", [], None
    for chunk in stream_chunks(url, payload, timeout=120):
        assert "error" not in chunk, chunk
        choice = chunk["choices"][0]
        text += choice["delta"].get("content", "")
        logprobs += (choice.get("logprobs") or {}).get("content") or []
        finish = choice["finish_reason"] or finish
    return {"text": text, "logprobs": logprobs, "finish": finish}


def stream_chunks(url: str, payload: dict, timeout: float):
    """The parsed `data:` chunks of one streamed request (a 200 answer), [DONE] left out."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, timeout=timeout) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def wait_pages_free(*states, timeout_s: float = 20.0) -> list[int]:
    """Pages in use on each server once its in-flight work has drained (0 each when nothing leaked)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        used = [s.engine.pages_in_use for s in states]
        if not any(used):
            return used
        time.sleep(0.05)
    return [s.engine.pages_in_use for s in states]


def wait_staging_free(*states, timeout_s: float = 20.0) -> list[int]:
    """Staging arena slots held on each server once its in-flight work has drained (0 each when no path
    forgot one; the servers run the default, staged, transfer mode)."""
    deadline = time.monotonic() + timeout_s
    held = [s.pd.transfer.staging.slots_in_use for s in states]
    while any(held) and time.monotonic() < deadline:
        time.sleep(0.05)
        held = [s.pd.transfer.staging.slots_in_use for s in states]
    return held


@pytest.fixture(scope="module")
def servers():
    with pd_pair() as pair, serve_state(server_state()) as colocated:
        yield pair, colocated


PAYLOADS = [pytest.param(body(p, stream=s), id=f"{'stream' if s else 'unary'}-{i}")
            for i, p in enumerate(PROMPTS) for s in (False, True)]
PAYLOADS.append(pytest.param(body(PROMPTS[1], temperature=0.8, seed=11), id="seeded-sampling"))
PAYLOADS.append(pytest.param(body(PROMPTS[0], max_tokens=1), id="one-token"))


@pytest.mark.parametrize("payload", PAYLOADS)
def test_pd_pair_answers_exactly_as_the_colocated_server(servers, payload):
    pair, colocated = servers
    expected, got = answer(colocated, payload), answer(pair.router, payload)
    assert got == expected
    assert len(got["logprobs"]) >= 1
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
    assert wait_staging_free(pair.prefill_state, pair.decode_state) == [0, 0]


def raw_stream(url: str, payload: dict) -> str:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        return reply.read().decode()


def envelope_free(raw: str) -> tuple[str, set[str], set[str]]:
    """A stream's bytes with its chunk id and `created` written as ID and T, and the ids and createds it had."""
    ids, created = set(re.findall(r'"id": "([^"]+)"', raw)), set(re.findall(r'"created": (\d+)', raw))
    return re.sub(r'"created": \d+', '"created": T', re.sub(r'"id": "[^"]+"', '"id": ID', raw)), ids, created


@pytest.mark.parametrize("planted", [None, "relay_without_opening"])
def test_a_pd_stream_is_the_colocated_servers_bytes_with_its_first_token_relayed(servers, monkeypatch, planted):
    """The first token's chunk comes from the prefill server through the router (runtime/disagg/protocol.py),
    the rest from the decode server: one id and one `created` all through, and byte for byte the colocated
    server's stream but for those two. Control: a prefill server whose relay leaves out the opening chunk."""
    pair, colocated = servers
    side = pair.prefill_state.pd
    if planted:
        relay_text = side._relay_text
        monkeypatch.setattr(side, "_relay_text", lambda *args: relay_text(*args).split("\n\n", 1)[1])
    relayed = side.metrics.first_tokens.labels("relayed")
    before = relayed._value.get()
    for prompt in PROMPTS[:2]:
        payload = body(prompt, stream=True, stream_options={"include_usage": True})
        (got, ids, created), (expected, _, _) = envelope_free(raw_stream(pair.router, payload)), \
            envelope_free(raw_stream(colocated, payload))
        assert len(ids) == len(created) == 1
        assert (got == expected) is (planted is None), (got[:400], expected[:400])
    assert relayed._value.get() == before + 2


def test_concurrent_requests_batch_on_both_sides_and_still_match(servers):
    pair, colocated = servers
    payloads = [body(p, stream=i % 2 == 1) for i, p in enumerate(PROMPTS * 2)]
    expected = [answer(colocated, p) for p in payloads]

    async def all_at_once():
        return await asyncio.gather(*(asyncio.to_thread(answer, pair.router, p) for p in payloads))

    assert asyncio.run(all_at_once()) == expected
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]


def test_metrics_export_transfer_bytes_latency_and_pages_in_flight(servers):
    pair, _ = servers
    answer(pair.router, body(PROMPTS[0]))
    for url in (pair.prefill, pair.decode):
        text = httpx.get(f"{url}/metrics").text
        sent = [line for line in text.splitlines() if line.startswith("dsv4_pd_transfer_bytes_total ")]
        assert sent and float(sent[0].split()[1]) > 0, text
        assert "dsv4_pd_transfer_seconds_bucket" in text and "dsv4_pd_pages_in_flight 0.0" in text
        assert "dsv4_pd_staging_slots_in_use 0.0" in text and "dsv4_pd_staging_bytes_in_use 0.0" in text


def test_a_traced_request_has_every_phase_mark_in_path_order(servers):
    """`bench.pd_ttft --phases` reads these: every mark of the PD pair's critical path, of the decode
    side's room-opening branch and of the colocated server's path is kept, each at or after the one
    before it; an untraced request is kept by no server."""
    from bench.pd_phases import (
        COLOCATED_PATH,
        PD_AFTER_FIRST_TOKEN,
        PD_KV_CHECK,
        PD_PATH,
        PD_ROOM_BRANCH,
        PD_SENDER_DIGEST,
    )
    from bench.pd_ttft import traced_ttft

    pair, colocated = servers
    with httpx.Client() as client:
        for url, side, paths in ((pair.router, None, (PD_PATH, PD_ROOM_BRANCH, PD_SENDER_DIGEST, PD_KV_CHECK)),
                                 (colocated, "server", (COLOCATED_PATH,))):
            _, marks = traced_ttft(client, url, 8, 0, None, side, until=PD_AFTER_FIRST_TOKEN if side is None else ())
            for path in paths:
                times = [marks[mark] for mark, _ in path]  # a KeyError names a missing mark
                assert times == sorted(times), [(mark, marks[mark]) for mark, _ in path]
    states = (pair.prefill_state, pair.decode_state)
    kept = [len(s.traces) for s in states]
    answer(pair.router, body(PROMPTS[0], stream=True))
    assert [len(s.traces) for s in states] == kept


def test_a_room_answers_once_open_and_a_hang_up_before_its_first_line_fails_it(servers):
    """/pd/transfer's headers go out as soon as the room is open, not with the prompt's first line:
    then they are off the first token's path (the line alone reached the decode side in 0.25 ms on the
    2-core host, headers and line together in 1.2). A room whose prompt never comes here answers 200
    at once; the decode side hanging up before the first line fails the room and forgets it at once,
    not at the PD timeout (20 s here). The old answer, which sent no header before the first line,
    fails the first assertion (the read times out)."""
    pair, _ = servers
    registry = pair.prefill_state.pd.registry
    pool = pair.decode_state.pd.transfer.descriptor()
    probe = uuid.uuid4().hex
    registered = httpx.post(f"{pair.prefill}/pd/register", timeout=30,
                            json={"name": f"probe-{probe}", "instance": probe, "pool": pool.to_dict()})
    assert registered.status_code == 200, registered.text
    room = f"room-{probe}"
    request = {"room": room, "name": f"probe-{probe}", "session_id": registered.json()["session_id"],
               "dst_pages": [0], "staging_offset": 0 if pool.mode == "staged" else None}
    with httpx.stream("POST", f"{pair.prefill}/pd/transfer", json=request, timeout=5) as reply:
        assert reply.status_code == 200
        assert room in registry.rooms
    deadline = time.monotonic() + 5
    while room in registry.rooms and time.monotonic() < deadline:
        time.sleep(0.02)
    assert room not in registry.rooms, "the room outlived its decode side's hang-up"


def test_decode_side_reuses_one_http_client(servers, monkeypatch):
    """A client per request cost the decode server a TLS context each (69% of its event loop under a
    40-session PD gate, when it was httpx's): requests after the first must make none."""
    import runtime.disagg.decode as decode_side

    made = []

    class Counting(decode_side.Upstreams):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    pair, _ = servers
    answer(pair.router, body(PROMPTS[2]))  # the client exists from here on
    monkeypatch.setattr(decode_side, "Upstreams", Counting)
    for prompt in PROMPTS[:3]:
        answer(pair.router, body(prompt))
    assert made == [], f"the decode side made {len(made)} HTTP clients for 3 requests"


def test_router_metrics_sum_the_pairs_pages_and_preemptions(servers):
    """The gate reads KV pages, preemptions and prefix-cache tokens off the one URL it knows: through the
    router they must be the pair's sums (an 80-session PD gate once printed "preemptions: not counted",
    and had no "prefix cache" line)."""
    from runtime.router import PAIR_SUMS

    pair, _ = servers
    answer(pair.router, body(PROMPTS[1]))
    wait_pages_free(pair.prefill_state, pair.decode_state)

    def sample(url: str, name: str) -> float:
        lines = [line for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith(name + " ")]
        assert len(lines) == 1, f"{url}/metrics has {len(lines)} samples of {name}"
        return float(lines[0].split()[1])

    assert {"dsv4_prefix_cache_hit_tokens_total", "dsv4_prefix_cache_lookup_tokens_total"} <= PAIR_SUMS.keys()
    for name in PAIR_SUMS:
        assert sample(pair.router, name) == sample(pair.prefill, name) + sample(pair.decode, name)


def test_a_pair_with_an_api_key_serves_keyed_clients_and_refuses_the_rest():
    """Both servers started with `--api-key`: the router forwards the client's key to both, and the
    decode server shows its own key to the prefill server's /pd routes (it sent none: every request of
    a keyed pair failed with the prefill server's 401 from /pd/register)."""
    key = "pd-test-key"
    with pd_pair(prefill_args=("--api-key", key), decode_args=("--api-key", key)) as pair:
        payload = body(PROMPTS[2])
        keyed = httpx.post(f"{pair.router}/v1/chat/completions", json=payload, timeout=120,
                           headers={"authorization": f"Bearer {key}"})
        assert keyed.status_code == 200, keyed.text
        assert keyed.json()["choices"][0]["message"]["content"]
        unkeyed = httpx.post(f"{pair.router}/v1/chat/completions", json=payload, timeout=120)
        assert unkeyed.status_code == 401, unkeyed.text
        assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]


def test_servers_refuse_requests_that_bypass_the_router(servers):
    pair, _ = servers
    for url in (pair.prefill, pair.decode):
        reply = httpx.post(f"{url}/v1/chat/completions", json=body(PROMPTS[0]), timeout=30)
        assert reply.status_code == 400 and "runtime.router" in reply.json()["error"]["message"]


def test_router_passes_validation_errors_through(servers):
    pair, _ = servers
    reply = httpx.post(f"{pair.router}/v1/chat/completions", json={**body(PROMPTS[0]), "model": "nope"}, timeout=30)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]


def dead_prefill_error(decode_faults: tuple[str, ...]) -> tuple[dict, tuple[int, int]]:
    """A decode server whose prefill server is gone: the client's error and the decode pages and
    staging slots left. The request goes to the decode server as the router sends it (room and
    bootstrap headers): the router itself passes over a prefill server nothing listens on before any
    decode call (tests/unit/test_router.py), so this is the decode side's own path, as when a prefill
    server dies between the prompt's call and the room's."""
    from canary.targets import free_port
    from runtime.disagg.protocol import BOOTSTRAP_HEADER, ROOM_HEADER

    state = server_state("--disaggregation-mode", "decode", *decode_faults)
    with serve_state(state) as decode:
        reply = httpx.post(f"{decode}/v1/chat/completions", json=body(PROMPTS[0]), timeout=60,
                           headers={ROOM_HEADER: "room-dead", BOOTSTRAP_HEADER: f"http://127.0.0.1:{free_port()}"})
        return ({"status": reply.status_code, **reply.json()},
                (wait_pages_free(state, timeout_s=5)[0], wait_staging_free(state, timeout_s=5)[0]))


def test_a_dead_prefill_server_is_an_openai_error_and_frees_the_reserved_pages():
    error, leaked = dead_prefill_error(())
    assert error["status"] == 502 and error["error"]["code"] == "pd_prefill_unreachable"
    assert leaked == (0, 0)


def test_abort_leak_fault_is_caught():
    """Negative control: pd-abort-leak keeps the pages (and the staging slot) reserved for a transfer
    that never completed."""
    error, (pages, slots) = dead_prefill_error(("--inject-fault", "pd-abort-leak"))
    assert error["status"] == 502
    assert pages > 0 and slots > 0


def test_kv_corrupt_fault_is_caught_and_frees_pages():
    with pd_pair(prefill_args=("--inject-fault", "pd-kv-corrupt")) as pair:
        reply = httpx.post(f"{pair.router}/v1/chat/completions", json=body(PROMPTS[0]), timeout=60)
        assert reply.status_code == 502 and reply.json()["error"]["code"] == "pd_kv_corrupt", reply.text
        assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
        assert wait_staging_free(pair.prefill_state, pair.decode_state) == [0, 0]


def test_transfer_modes_that_differ_are_a_named_error_not_a_hang():
    """A staged prefill server and a direct decode server cannot move KV: the decode side's registration
    is refused, and the client gets a 409 naming the modes at once, with nothing left reserved."""
    with pd_pair(decode_args=("--disaggregation-transfer", "direct")) as pair:
        started = time.monotonic()
        reply = httpx.post(f"{pair.router}/v1/chat/completions", json=body(PROMPTS[0]), timeout=60)
        assert reply.status_code == 409 and reply.json()["error"]["code"] == "pd_mode_mismatch", reply.text
        assert "transfer modes differ" in reply.json()["error"]["message"]
        assert time.monotonic() - started < 10  # well inside the 20 s PD deadline: refused, not timed out
        assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
        assert pair.decode_state.pd.transfer.staging is None
        assert wait_staging_free(pair.prefill_state) == [0]


def test_client_disconnects_mid_stream_free_pages_on_both_sides(servers):
    pair, _ = servers
    payload = body(PROMPTS[3], stream=True, max_tokens=400)
    with httpx.stream("POST", f"{pair.router}/v1/chat/completions", json=payload, timeout=60) as reply:
        for n, _line in enumerate(reply.iter_lines()):
            if n > 4:
                break  # leave with the decode side mid-generation
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
    assert wait_staging_free(pair.prefill_state, pair.decode_state) == [0, 0]


def restart_then_answer(prefill_faults: tuple[str, ...]) -> int:
    """Serve one request, restart the decode server (same name, new process state), serve another:
    the second request's HTTP status."""
    with ExitStack() as stack:
        p_state = server_state("--disaggregation-mode", "prefill", "--disaggregation-timeout", "10",
                               *prefill_faults)
        prefill = stack.enter_context(serve_state(p_state))
        statuses = []
        for _life in range(2):
            with serve_state(server_state("--disaggregation-mode", "decode", "--disaggregation-name", "decode-0",
                                          "--disaggregation-timeout", "10")) as decode, \
                    serve_in_thread(create_router_app([prefill], [decode])) as router:
                reply = httpx.post(f"{router}/v1/chat/completions", json=body(PROMPTS[2]), timeout=60)
                statuses.append(reply.status_code)
                if reply.status_code != 200:
                    assert reply.json()["error"]["code"].startswith("pd_"), reply.text
        assert statuses[0] == 200
        assert p_state.pd.registry.open_rooms == 0
        return statuses[1]


def test_decode_only_restart_gets_a_fresh_session_and_serves():
    assert restart_then_answer(()) == 200


def test_stale_bootstrap_fault_is_caught_by_the_restart_check():
    """Negative control: with pd-stale-bootstrap the prefill side writes into the dead decode
    process's pool; the request after the restart fails (an error, never a hang)."""
    assert restart_then_answer(("--inject-fault", "pd-stale-bootstrap")) != 200


def test_equality_oracle_fires_when_the_decode_side_loses_sampler_state(servers, monkeypatch):
    """Negative control of the bit-for-bit comparison: a decode side that restarts the request's
    generator instead of continuing the prefill side's stream samples other tokens."""
    from runtime.disagg import decode

    pair, colocated = servers
    payload = body(PROMPTS[1], temperature=0.8, seed=11)
    planted = decode.prefilled_request

    def forgetful(*args, **kwargs):
        req = planted(*args, **kwargs)
        assert req.generator is not None
        req.generator.manual_seed(11)  # the bug: the stream starts over on the decode side
        return req

    monkeypatch.setattr(decode, "prefilled_request", forgetful)
    assert answer(pair.router, payload) != answer(colocated, payload)


@pytest.mark.parametrize("phase", ["prefilling", "decoding"])
def test_a_client_gone_during_each_phase_frees_pages_on_both_sides(phase):
    """The client leaves while the prompt is still prefilling (slow prefill steps: the KV is not yet
    sent), or once decoding has started; both pools end with every page free, and the pair serves."""
    prefill_args = ("--inject-fault", "slow-step") if phase == "prefilling" else ()
    with pd_pair(prefill_args=prefill_args) as pair:
        payload = body(PROMPTS[3], stream=True, max_tokens=300)
        try:
            with httpx.stream("POST", f"{pair.router}/v1/chat/completions", json=payload,
                              timeout=httpx.Timeout(60, read=0.2 if phase == "prefilling" else 60)) as reply:
                for n, _line in enumerate(reply.iter_lines()):
                    if n > 3:
                        break
        except httpx.ReadTimeout:
            assert phase == "prefilling"
        assert wait_pages_free(pair.prefill_state, pair.decode_state, timeout_s=30) == [0, 0]
        assert answer(pair.router, body(PROMPTS[2]))["finish"] in ("stop", "length")


def test_concurrent_first_requests_of_a_fresh_pair_share_one_session():
    """A fresh decode server's first requests all register at once: one session, every request served
    (the 16-session PD gate found each registration bumping the version and refusing the others)."""
    with pd_pair() as pair:
        async def all_at_once():
            return await asyncio.gather(*(asyncio.to_thread(answer, pair.router, body(p)) for p in PROMPTS * 2))

        assert all(a["finish"] in ("stop", "length") for a in asyncio.run(all_at_once()))
        assert pair.prefill_state.pd.registry.sessions["decode-0"].version == 1


def test_a_prefill_server_killed_mid_request_is_an_error_and_leaks_nothing(tmp_path):
    """Processes this time: the prefill server (slow steps, so the request is still prefilling) is
    SIGKILLed; the client gets an OpenAI-shaped error, the decode pool ends empty (its /metrics says so,
    the gauge the gate reads), and a new prefill server serves the same decode server."""
    import os
    import signal
    import threading

    from canary.targets import embedded_server
    from runtime.config import DEFAULT_MODEL

    env = {"DSV4_SLOW_STEP_MS": "3000"}
    with embedded_server(DEFAULT_MODEL, ["--disaggregation-mode", "decode"], log_dir=tmp_path) as decode:
        with embedded_server(DEFAULT_MODEL, ["--disaggregation-mode", "prefill"], faults=("slow-step",), env=env,
                             log_dir=tmp_path) as prefill, \
                serve_in_thread(create_router_app([prefill.root_url], [decode.root_url])) as router:
            replies: list[httpx.Response] = []
            thread = threading.Thread(target=lambda: replies.append(httpx.post(
                f"{router}/v1/chat/completions", json=body(PROMPTS[0]), timeout=60)))
            thread.start()
            time.sleep(1.5)  # in the prefill server's 3 s step
            assert prefill.pid is not None
            os.kill(prefill.pid, signal.SIGKILL)
            thread.join(timeout=60)
        assert replies and replies[0].status_code >= 500, replies
        assert replies[0].json()["error"]["code"].startswith("pd_"), replies[0].text
        assert decode.wait_kv_pages_idle() == 0
        with embedded_server(DEFAULT_MODEL, ["--disaggregation-mode", "prefill"], log_dir=tmp_path) as prefill, \
                serve_in_thread(create_router_app([prefill.root_url], [decode.root_url])) as router:
            assert answer(router, body(PROMPTS[0]))["finish"] in ("stop", "length")


def queued_on_prefill(client: str, decode_faults: tuple[str, ...] = ()) -> tuple[int | None, list[int]]:
    """One routed request queued on a prefill server whose only running slot (`--max-running 1`) is
    held by a long request of its own, past the PD deadline (2 s), the client waiting or gone: its
    HTTP status (None for the client that left) and the decode side's pages and staging slots once
    that has drained."""
    from runtime.engine.request import SamplingParams

    with pd_pair(prefill_args=("--max-running", "1"), decode_args=decode_faults, timeout_s=2.0) as pair:
        engine = pair.prefill_state.engine
        hog_ids = engine.tokenizer.encode(PROMPTS[3])
        hog = SamplingParams(max_tokens=engine.cfg.max_model_len - len(hog_ids) - 1, ignore_eos=True)
        on_engine(pair.prefill_state, lambda e: e.add_request(hog_ids, hog, rid="hog"))
        status = None
        try:
            if client == "waits":
                reply = httpx.post(f"{pair.router}/v1/chat/completions", json=body(PROMPTS[0]), timeout=60)
                status = reply.status_code
                assert reply.json()["error"]["code"] == "pd_timeout", reply.text
            else:
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(f"{pair.router}/v1/chat/completions", json=body(PROMPTS[0]),
                               timeout=httpx.Timeout(60, read=0.5))
                time.sleep(3)  # past the deadline, with nobody listening
            decode_pages = wait_pages_free(pair.decode_state, timeout_s=10) + wait_staging_free(pair.decode_state,
                                                                                                timeout_s=2)
            assert "hog" in engine.scheduler.requests  # the slot really was held all along
        finally:
            on_engine(pair.prefill_state, lambda e: e.abort("hog"))
        assert wait_pages_free(pair.prefill_state) == [0]
        assert pair.prefill_state.pd.registry.open_rooms == 0
        assert answer(pair.router, body(PROMPTS[2]))["finish"] in ("stop", "length")
        return status, decode_pages


@pytest.mark.parametrize("client", ["waits", "leaves"])
def test_a_request_queued_on_prefill_past_its_deadline_is_a_timeout_error_and_leaks_nothing(client):
    """At the PD deadline the prefill side drops the queued request and fails its room, the decode side
    frees the pages it reserved, and the client (still waiting, or gone) gets a named 504, not a hang.
    Once the slot is free the pair serves."""
    status, decode_left = queued_on_prefill(client)
    assert status == (504 if client == "waits" else None)
    assert decode_left == [0, 0]  # pages, staging slots


def test_queued_on_prefill_check_catches_the_abort_leak_fault():
    """Negative control: with pd-abort-leak the decode side keeps the pages and the staging slot of the
    timed-out request."""
    status, decode_left = queued_on_prefill("waits", ("--inject-fault", "pd-abort-leak"))
    assert status == 504 and decode_left[0] > 0 and decode_left[1] > 0


def on_engine(state, fn):
    """Run `fn(engine)` on a server's engine thread (its pool and queues are not thread-safe)."""
    async def call():
        return await state.bridge.call(fn)

    return asyncio.run(call())


KILL_READ_GRACE_S = 2.0  # bytes a dead server sent before it died, still read by the client


def test_a_decode_server_killed_mid_run_fails_its_clients_by_name_and_the_prefill_side_keeps_no_page(tmp_path):
    """Processes: streams decoding and requests still in prefill/transfer when the decode server is
    SIGKILLed. Every client gets an OpenAI-shaped error within its bound (none hangs), the prefill
    server ends with no page in use and none in flight (its /metrics), and a restarted decode server
    (same name, same port) is served by the same prefill server."""
    import concurrent.futures

    from canary import pd_chaos
    from canary.pd_target import RestartablePDPair
    from runtime.config import DEFAULT_MODEL

    # Every engine step 40 ms slower (`slow-step`): the canary's answers are short, and at full speed a
    # request took ~0.3 s, so on a quiet host every late request could end before the kill (the count
    # below failed in CI that way). A late request now spends over a second in flight.
    with RestartablePDPair(DEFAULT_MODEL, log_dir=tmp_path, timeout_s=10.0, faults=("slow-step",),
                           env={"DSV4_SLOW_STEP_MS": "40"}) as pair, \
            concurrent.futures.ThreadPoolExecutor(6) as pool:
        def send(prompt: str) -> pd_chaos.Outcome:
            return pd_chaos.chat(pair.router, MODEL, prompt, stream=True, max_tokens=2000, timeout_s=60)

        decoding = [pool.submit(send, p) for p in PROMPTS[:3]]
        deadline = time.monotonic() + 60
        while pd_chaos.pages_left(pair.url("decode"), timeout_s=0)["kv_pages_in_use"] in (None, 0.0):
            assert time.monotonic() < deadline, "the decode server never started decoding"
            time.sleep(0.2)
        time.sleep(1.0)  # the first streams are decoding
        late = [pool.submit(send, p) for p in PROMPTS]  # these meet the kill in prefill or transfer
        time.sleep(0.3)
        killed_at = time.monotonic()
        pair.kill_side("decode")
        outcomes = [f.result(timeout=120) for f in decoding + late]
        # A short answer may have ended before the kill; every other request is a named PD error. The
        # client may read such an answer's last bytes just after the kill (a run failed once on a
        # complete answer read right at the kill), so a complete answer counts as served before the
        # kill if it ended within KILL_READ_GRACE_S of it; none can be served after it.
        ok = [o for o in outcomes if o.kind == pd_chaos.OK]
        assert all(o.ended < killed_at + KILL_READ_GRACE_S for o in ok), ok
        failed = [o for o in outcomes if o.kind != pd_chaos.OK]
        assert len(failed) >= len(outcomes) // 2, outcomes
        assert all(o.kind == pd_chaos.ERROR and o.code and o.code.startswith("pd_") for o in failed), failed
        assert pd_chaos.pages_left(pair.url("prefill")) == {"kv_pages_in_use": 0.0, "pd_pages_in_flight": 0.0,
                                                             "pd_staging_slots_in_use": 0.0}
        pair.start_side("decode")
        seconds, last = pd_chaos.seconds_until_serving(pair.router, MODEL, PROMPTS[0], within_s=30)
        assert seconds is not None, last


# ---- the prompt computed before its room opens (its KV pages held until it does) -------------------

def wait_until(condition, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def held_requests(prefill_state) -> int:
    pd = prefill_state.pd
    with pd._lock:
        return sum(1 for entry in pd.pending.values() if entry.held is not None)


def pages_in_flight(url: str) -> float:
    lines = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
             if line.startswith("dsv4_pd_pages_in_flight ")]
    return float(lines[0].split()[1])


def test_the_prompt_is_computed_before_its_room_opens_and_the_answer_is_unchanged(servers, monkeypatch):
    """The prefill server runs the prompt at once and holds its KV until the decode side opens the room
    (here held back until the prompt is done): the pages are held meanwhile, then written, and the
    answer is still the colocated server's, bit for bit, with every page back on both sides. On the
    old protocol the prefill side did not start the prompt before the room was open."""
    import threading

    pair, colocated = servers
    gate = threading.Event()
    original = pair.decode_state.pd._open_room

    async def late(*args):
        await asyncio.to_thread(gate.wait, 60)
        return await original(*args)

    monkeypatch.setattr(pair.decode_state.pd, "_open_room", late)
    payload = body(PROMPTS[3], stream=True)
    expected = answer(colocated, payload)
    got: list[dict] = []
    client = threading.Thread(target=lambda: got.append(answer(pair.router, payload)))
    client.start()
    try:
        wait_until(lambda: held_requests(pair.prefill_state) == 1, what="the prompt's KV held on the prefill side")
        assert pair.prefill_state.pd.registry.open_rooms == 0  # computed, and the room still closed
        assert pair.prefill_state.engine.pages_in_use > 0
        assert pages_in_flight(pair.prefill) > 0
    finally:
        gate.set()
        client.join(timeout=120)
    assert got == [expected]
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
    assert pages_in_flight(pair.prefill) == 0 and pair.prefill_state.pd.pending == {}


def test_the_prefill_engine_thread_neither_hashes_nor_writes_the_kv(servers, monkeypatch):
    """A prompt whose room is already open when it finishes (the common case: the room opens while the
    prompt computes) has its KV hashed and written by a worker thread, not the engine thread, which
    is the busy prefill server's bottleneck (it used to do both right after the step). The answer is
    unchanged and every page comes back, pages-in-flight included."""
    import threading

    from runtime.disagg import prefill

    pair, colocated = servers
    side = pair.prefill_state.pd
    threads: list[tuple[str, str]] = []
    digest, write = prefill.kv_digest, side.transfer.write_pages

    def hashing(*args, **kwargs):
        threads.append(("digest", threading.current_thread().name))
        return digest(*args, **kwargs)

    def writing(*args, **kwargs):
        threads.append(("write", threading.current_thread().name))
        return write(*args, **kwargs)

    monkeypatch.setattr(prefill, "kv_digest", hashing)
    monkeypatch.setattr(side.transfer, "write_pages", writing)
    payloads = [body(p, stream=s) for p in PROMPTS for s in (False, True)]
    expected = [answer(colocated, payload) for payload in payloads]
    assert [answer(pair.router, payload) for payload in payloads] == expected
    assert sorted({what for what, _ in threads}) == ["digest", "write"] and len(threads) == 2 * len(payloads)
    assert [name for _, name in threads if name == "engine"] == []
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
    assert pages_in_flight(pair.prefill) == 0 and side.pending == {}


def test_the_decode_engine_thread_does_not_hash_the_received_kv(servers, monkeypatch):
    """The receiver's KV digest runs on a worker thread (the engine thread only lands the staged KV):
    the engine thread is the busy decode server's bottleneck. The old code hashed on the engine thread
    and fails this. The answer is unchanged and every page comes back."""
    import threading

    from runtime.disagg import decode

    pair, colocated = servers
    threads: list[str] = []
    digest = decode.kv_digest

    def hashing(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return digest(*args, **kwargs)

    monkeypatch.setattr(decode, "kv_digest", hashing)
    payloads = [body(p, stream=s) for p in PROMPTS[:2] for s in (False, True)]
    expected = [answer(colocated, payload) for payload in payloads]
    assert [answer(pair.router, payload) for payload in payloads] == expected
    assert len(threads) == len(payloads) and all(name.startswith("pd-digest") for name in threads), threads
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]


def test_the_sender_digest_runs_beside_the_write(servers, monkeypatch):
    """The prefill side's KV digest and its gather + write read the same held pages on two threads:
    the digest here waits for the write to start, which the old code (digest, then write, on one
    thread) never did, so the request failed. The answer is unchanged and every page comes back."""
    import threading

    from runtime.disagg import prefill

    pair, colocated = servers
    side = pair.prefill_state.pd
    writing = threading.Event()
    digest, write = prefill.kv_digest, side.transfer.write_pages

    def digest_during_the_write(*args, **kwargs):
        assert writing.wait(10), "the write never started while the digest ran"
        return digest(*args, **kwargs)

    def write_and_signal(*args, **kwargs):
        writing.set()
        return write(*args, **kwargs)

    monkeypatch.setattr(prefill, "kv_digest", digest_during_the_write)
    monkeypatch.setattr(side.transfer, "write_pages", write_and_signal)
    payload = body(PROMPTS[3])
    assert answer(pair.router, payload) == answer(colocated, payload)
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
    assert pages_in_flight(pair.prefill) == 0 and side.pending == {}


def prefill_only(timeout_s: float, *args: str):
    return serve_state(server_state("--disaggregation-mode", "prefill", "--disaggregation-timeout", str(timeout_s),
                                    *args))


def post_to_prefill(url: str, room: str, payload: dict) -> httpx.Response:
    """What the router sends the prefill server (a room no decode server will open here)."""
    return httpx.post(f"{url}/v1/chat/completions", json=payload, headers={"x-pd-room": room}, timeout=60)


@pytest.mark.parametrize("faults", [(), ("--inject-fault", "pd-abort-leak")], ids=["clean", "pd-abort-leak"])
def test_a_room_that_never_opens_frees_the_held_pages_at_the_deadline_and_refuses_a_late_open(faults):
    """No decode server opens the room: the prompt is computed and its pages held, then at the PD
    deadline the caller gets a named 504 and every page is free; the decode side's late open is refused
    at once. Negative control: with pd-abort-leak the held pages are never freed."""
    import threading

    state = server_state("--disaggregation-mode", "prefill", "--disaggregation-timeout", "2", *faults)
    with serve_state(state) as url:
        replies: list[httpx.Response] = []
        client = threading.Thread(target=lambda: replies.append(post_to_prefill(url, "room-x", body(PROMPTS[0]))))
        started = time.monotonic()
        client.start()
        wait_until(lambda: held_requests(state) == 1, what="the prompt's KV held")
        assert state.engine.pages_in_use > 0 and time.monotonic() - started < 2
        client.join(timeout=30)
        assert replies[0].status_code == 504 and replies[0].json()["error"]["code"] == "pd_timeout", replies[0].text
        late = httpx.post(f"{url}/pd/register", json={"name": "late", "instance": "i",
                                                      "pool": state.pd.transfer.descriptor().to_dict()})
        opened = time.monotonic()
        refused = httpx.post(f"{url}/pd/transfer", json={"room": "room-x", "name": "late",
                                                         "session_id": late.json()["session_id"], "dst_pages": [0]},
                             timeout=30)
        assert refused.status_code == 504 and "no decode server opened room room-x" in refused.text
        assert time.monotonic() - opened < 1.5  # at once, not after a deadline of its own
        if faults:
            assert wait_pages_free(state, timeout_s=2) != [0] and pages_in_flight(url) > 0
        else:
            assert wait_pages_free(state, timeout_s=5) == [0] and pages_in_flight(url) == 0
            assert state.pd.pending == {} and state.pd.registry.open_rooms == 0


def raw_post(url: str, room: str, payload: dict):
    """The router's call to the prefill server on a socket of our own, so the test decides when the
    caller goes away (closing it)."""
    import json
    import socket

    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(payload).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"x-pd-room: {room}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("phase", ["computing", "held"])
def test_a_caller_gone_before_the_room_opens_frees_every_page_at_once(phase, monkeypatch):
    """The caller (the router) hangs up while the prompt is still being computed, or once its KV is
    held, and no room is open: the prompt is aborted or its held pages freed right away, long before
    the PD deadline (20 s), and nothing is left in flight."""
    if phase == "computing":
        monkeypatch.setenv("DSV4_SLOW_STEP_MS", "1500")
    state = server_state("--disaggregation-mode", "prefill", "--disaggregation-timeout", "20",
                         *(("--inject-fault", "slow-step") if phase == "computing" else ()))
    with serve_state(state) as url:
        sock = raw_post(url, "room-y", body(PROMPTS[3]))
        try:
            if phase == "computing":  # its prefill step is planned (pages taken) and running
                wait_until(lambda: state.engine.pages_in_use > 0, what="the prompt's prefill step")
                assert held_requests(state) == 0
            else:
                wait_until(lambda: held_requests(state) == 1, what="the prompt's KV held")
        finally:
            sock.close()
        gone = time.monotonic()
        assert wait_pages_free(state, timeout_s=10) == [0]
        assert time.monotonic() - gone < 8  # freed by the hang-up, not by the 20 s deadline
        assert state.pd.pending == {} and state.pd.registry.open_rooms == 0 and pages_in_flight(url) == 0


def test_a_decode_failure_before_the_room_opens_makes_the_router_hang_up_on_the_prefill_server(servers, monkeypatch):
    """The decode side fails before it opens the room (here: out of pages): the router answers its
    error without waiting for the prefill side's deadline (20 s), and the prefill server, hung up on,
    frees the prompt's held pages at once."""
    from runtime.server.errors import ApiError

    pair, _ = servers

    async def no_pages(*args):
        await asyncio.sleep(0.5)  # the prompt is computed and held by now
        raise ApiError(503, "decode server out of KV pages", type="server_error", code="pd_out_of_pages")

    monkeypatch.setattr(pair.decode_state.pd, "_open_room", no_pages)
    started = time.monotonic()
    reply = httpx.post(f"{pair.router}/v1/chat/completions", json=body(PROMPTS[0]), timeout=60)
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "pd_out_of_pages", reply.text
    assert time.monotonic() - started < 10
    assert wait_pages_free(pair.prefill_state, pair.decode_state, timeout_s=5) == [0, 0]
    assert wait_staging_free(pair.prefill_state, pair.decode_state, timeout_s=5) == [0, 0]
    assert pair.prefill_state.pd.pending == {} and pages_in_flight(pair.prefill) == 0


def test_server_shutdown_closes_the_decode_sides_http_client():
    with pd_pair() as pair:
        answer(pair.router, body(PROMPTS[2]))
        assert pair.decode_state.pd._client is not None
        client = pair.decode_state.pd._client[1]
        assert not client.is_closed
    assert client.is_closed and pair.decode_state.pd._client is None


# ---- the prefix cache on the prefill server -----------------------------------------------------------

# Two turns of one conversation: the second re-sends the first (prompt and answer) and asks more, as the
# 80-session gate's turns do. The first turn is long enough that their shared start spans several pages.
OPENING = "Tell me about the lighthouse keeper and the storm, slowly and in detail. " * 4


def conversation(url: str, opening: str = OPENING) -> list[dict]:
    """Both turns' answers (streamed second turn), the second sent with the first's answer in it."""
    first = answer(url, body(opening))
    messages = [{"role": "user", "content": opening}, {"role": "assistant", "content": first["text"]},
                {"role": "user", "content": "And what happened next?"}]
    return [first, answer(url, {**body(""), "messages": messages, "stream": True})]


def metric(url: str, name: str) -> float:
    lines = [line for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith(name + " ")]
    assert len(lines) == 1, f"{url}/metrics has {len(lines)} samples of {name}"
    return float(lines[0].split()[1])


def pages_accounted(state) -> bool:
    """Every page of the server's pool is free, held by a request or cached: none lost."""
    engine = state.engine
    return engine.pool.free_pages + engine.pages_in_use + engine.pages_cached == engine.pool.num_pages


def test_a_shared_prefix_hits_the_prefill_servers_cache_and_answers_as_the_colocated_server(servers):
    pair, colocated = servers
    assert pair.prefill_state.engine.prefix_cache is not None  # on by default on a prefill server
    assert pair.decode_state.engine.prefix_cache is None  # never on a decode server
    hits = "dsv4_prefix_cache_hit_tokens_total"
    before = metric(pair.prefill, hits), metric(pair.router, hits)
    got = conversation(pair.router, OPENING + "(pd)")
    assert metric(pair.prefill, hits) > before[0], "the second turn did not hit the prefill server's cache"
    assert metric(pair.router, hits) - before[1] == metric(pair.prefill, hits) - before[0]  # the pair's sum
    assert metric(pair.decode, hits) == 0
    assert got == conversation(colocated, OPENING + "(pd)")
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
    assert metric(pair.prefill, "dsv4_kv_pages_cached") == pair.prefill_state.engine.pages_cached > 0
    assert all(pages_accounted(s) for s in (pair.prefill_state, pair.decode_state))


def test_a_stale_page_on_the_prefill_servers_cache_is_caught_by_the_equality(servers):
    """Negative control: with prefix-cache-stale-page on the prefill server (a hit copies one page's KV
    from the wrong entry) the second turn hits the cache and no longer answers as the colocated server."""
    _, colocated = servers
    with pd_pair(prefill_args=("--inject-fault", "prefix-cache-stale-page")) as pair:
        got = conversation(pair.router, OPENING + "(stale)")
        assert pair.prefill_state.engine.prefix_cache.hit_tokens > 2 * pair.prefill_state.engine.pool.page_size
        assert got[0] == conversation(colocated, OPENING + "(stale)")[0]  # the first turn had no hit
        assert got[1] != conversation(colocated, OPENING + "(stale)")[1]


def test_the_decode_server_refuses_the_prefix_cache_by_name():
    with pytest.raises(ValueError, match=r"--prefix-cache.*refused.*PD decode server"):
        server_state("--disaggregation-mode", "decode", "--prefix-cache")
    state = server_state("--disaggregation-mode", "prefill", "--prefix-cache")  # control: allowed on prefill
    try:
        assert state.engine.prefix_cache is not None
    finally:
        state.engine.shutdown()
        state.pd.transfer.close()


def test_aborts_with_the_cache_on_leave_no_page_on_either_side(servers):
    """Conversations sharing prefixes, some streams abandoned while decoding, all at once: afterwards no
    request holds a page on either side (the gate's gauge through the router reads 0), every page is
    free or cached, and the cache was used."""
    pair, colocated = servers
    hits = metric(pair.prefill, "dsv4_prefix_cache_hit_tokens_total")

    def abandoned(prompt: str) -> None:
        with httpx.stream("POST", f"{pair.router}/v1/chat/completions",
                          json=body(prompt, stream=True, max_tokens=300), timeout=60) as reply:
            for n, _line in enumerate(reply.iter_lines()):
                if n > 3:
                    break

    async def all_at_once():
        jobs = [asyncio.to_thread(conversation, pair.router, OPENING + f"(abort {i})") for i in range(3)]
        jobs += [asyncio.to_thread(abandoned, OPENING + f"(abort {i}) and more") for i in range(3)]
        return await asyncio.gather(*jobs)

    done = asyncio.run(all_at_once())
    assert done[0] == conversation(colocated, OPENING + "(abort 0)")
    assert metric(pair.prefill, "dsv4_prefix_cache_hit_tokens_total") > hits
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
    assert metric(pair.router, "dsv4_kv_pages_in_use") == 0
    assert all(pages_accounted(s) for s in (pair.prefill_state, pair.decode_state))


@pytest.mark.parametrize("faults", [(), ("--inject-fault", "pd-abort-leak")], ids=["clean", "pd-abort-leak"])
def test_a_given_up_prompts_held_kv_goes_to_the_cache_and_leaks_nothing(faults):
    """The caller hangs up while a finished prompt's KV is held (no room opened): its KV is complete, so
    its pages go to the cache, and the same prompt sent again hits it; no page is left held. Negative
    control: with pd-abort-leak the given-up request's held pages are never given back (seen by the same
    gauge, beside the cached pages)."""
    state = server_state("--disaggregation-mode", "prefill", "--disaggregation-timeout", "20", *faults)
    with serve_state(state) as url:
        for attempt in range(2):
            sock = raw_post(url, f"room-held-{attempt}", body(PROMPTS[3]))
            try:
                wait_until(lambda: held_requests(state) == 1, what="the prompt's KV held")
            finally:
                sock.close()
            if faults:
                assert wait_pages_free(state, timeout_s=3) != [0]
                return
            assert wait_pages_free(state, timeout_s=10) == [0] and pages_accounted(state)
            assert state.engine.pages_cached > 0
        assert state.engine.prefix_cache.hit_tokens > 0  # the second time the prompt came from the cache


# ---- the first token streamed before the decode side's KV check ---------------------------------------

def sample(state, name: str, **labels: str) -> float:
    """One sample of a server's registry (0 where the labelled series does not exist yet)."""
    return state.metrics.registry.get_sample_value(name, labels) or 0.0


class StreamReader:
    """A streamed request read on a thread of its own: the test looks at what has arrived so far while
    the decode side is held mid-request. `tokens` counts the tokens received (one logprobs entry each),
    `errors` the error chunks' codes."""

    def __init__(self, url: str, payload: dict) -> None:
        import threading

        self.tokens, self.errors, self.done = 0, [], threading.Event()
        self.tokens_after_error = 0
        self._thread = threading.Thread(target=self._read, args=(url, payload), daemon=True)
        self._thread.start()

    def _read(self, url: str, payload: dict) -> None:
        try:
            for chunk in stream_chunks(url, payload, timeout=60):
                if "error" in chunk:
                    self.errors.append(chunk["error"]["code"])
                    continue
                got = len((chunk["choices"][0].get("logprobs") or {}).get("content") or [])
                self.tokens += got
                self.tokens_after_error += got if self.errors else 0
        finally:
            self.done.set()

    def join(self) -> None:
        assert self.done.wait(60), "the stream never ended"
        self._thread.join(timeout=5)


class HeldDigest:
    """The decode side's KV digest held until `release()`: `started` once a digest is computing."""

    def __init__(self, monkeypatch) -> None:
        import threading

        from runtime.disagg import decode

        self.started, self._gate = threading.Event(), threading.Event()
        digest = decode.kv_digest

        def held(*args, **kwargs):
            self.started.set()
            assert self._gate.wait(30), "the test never released the digest"
            return digest(*args, **kwargs)

        monkeypatch.setattr(decode, "kv_digest", held)

    def release(self) -> None:
        self._gate.set()


HOLD_S = 1.0  # how long the digest is held: the engine makes many more tokens than 1 in that time


def tokens_while_held(pair, held, payload: dict) -> tuple[int, StreamReader]:
    """The tokens a streamed client has received HOLD_S into the `held` step (HeldDigest, HeldWrite:
    `started` once a request reached it, `release()`); the stream read to its end after the release."""
    reader = StreamReader(pair.router, payload)
    try:
        assert held.started.wait(30), f"no request reached the held step ({type(held).__name__})"
        time.sleep(HOLD_S)
        seen = reader.tokens
    finally:
        held.release()
    reader.join()
    return seen, reader


def tokens_while_the_digest_is_held(pair, monkeypatch, payload: dict) -> tuple[int, StreamReader]:
    """The tokens a streamed client has received HOLD_S into a held receiver's digest."""
    return tokens_while_held(pair, HeldDigest(monkeypatch), payload)


def answer_once(pd, monkeypatch, ready) -> None:
    """A planted late answer: the decode side hands its caller the request's sink only once
    `await ready(sink)` returns, so the client's stream waits for that too."""
    original = pd.start

    async def start(*args, **kwargs):
        sink = await original(*args, **kwargs)
        await ready(sink)
        return sink

    monkeypatch.setattr(pd, "start", start)


def digest_first(pd, monkeypatch) -> None:
    """The planted old order: the decode side's stream opens only once the KV check (and admission)
    is done, so the first token waits for the digest."""
    async def checked(_sink) -> None:
        await asyncio.gather(*pd._verifying)

    answer_once(pd, monkeypatch, checked)


def admit_before_the_check(pd, monkeypatch) -> None:
    """A planted bug: the request is admitted before its KV check, so the engine's tokens (2 on) reach
    the client while the digest is still computing."""
    async def verify_then_admit(state, room, req, answer, started, staging, sink, trace):
        result = await answer.line("done")
        await answer.aclose()
        landing = state.bridge.call(pd._lander(req.pages, staging, trace))
        state.bridge.withdraw(req.rid)
        state.bridge.submit_prefilled(req, sink, trace)
        await pd._check_kv(room, req.pages, len(req.prompt_ids), landing, result, trace)
        pd._release(state, req.rid, req.pages, staging, admitted=True)

    monkeypatch.setattr(pd, "_verify_then_admit", verify_then_admit)


def test_the_first_token_is_streamed_while_the_kv_digest_computes_and_the_second_after(servers, monkeypatch):
    """The first token (the prefill side's) reaches the client while the decode side's KV digest is
    still computing (held here), the second only after it matched; the answer is the colocated
    server's, bit for bit, and every page comes back."""
    pair, colocated = servers
    payload = body(PROMPTS[0], stream=True)
    seen, reader = tokens_while_the_digest_is_held(pair, monkeypatch, payload)
    assert seen == 1
    assert reader.errors == [] and reader.tokens == len(answer(colocated, payload)["logprobs"]) > 1
    assert answer(pair.router, payload) == answer(colocated, payload)
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
    assert wait_staging_free(pair.prefill_state, pair.decode_state) == [0, 0]


@pytest.mark.parametrize("planted", [digest_first, admit_before_the_check], ids=lambda f: f.__name__)
def test_the_first_token_oracle_catches_a_wrong_order(servers, monkeypatch, planted):
    """Negative controls: the old order (the stream opens after the digest) shows no token while the
    digest is held; admitting before the check shows tokens after the first."""
    pair, _ = servers
    planted(pair.decode_state.pd, monkeypatch)
    seen, _ = tokens_while_the_digest_is_held(pair, monkeypatch, body(PROMPTS[0], stream=True))
    if planted is digest_first:
        assert seen == 0
    else:
        assert seen > 1
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]


class HeldWrite:
    """The prefill side's KV write held until `release()` (or failing then, with `fail=True`; only the
    first one, with `first_only=True`): `started` once a write is in progress."""

    def __init__(self, transfer, monkeypatch, fail: bool = False, first_only: bool = False) -> None:
        import threading

        self.started, self._gate = threading.Event(), threading.Event()
        write = transfer.write_pages

        def held(*args, **kwargs):
            if first_only and self.started.is_set():  # a later write goes through at once
                return write(*args, **kwargs)
            self.started.set()
            assert self._gate.wait(30), "the test never released the write"
            if fail:
                raise OSError("planted: the KV write failed")
            return write(*args, **kwargs)

        monkeypatch.setattr(transfer, "write_pages", held)

    def release(self) -> None:
        self._gate.set()


def relay_after_the_write(pd, monkeypatch) -> None:
    """The planted old order: the prefill side relays the first token to the router only once the KV is
    written, so the client has no first token while the write is held (the decode side, which took the
    token as relayed, waits with it)."""
    relaying = pd._relaying

    async def after_the_write(state, request, prepared, relay, written, watcher, trace):
        await asyncio.wait([written])
        async for line in relaying(state, request, prepared, relay, written, watcher, trace):
            yield line

    monkeypatch.setattr(pd, "_relaying", after_the_write)


def admit_before_the_kv_landed(pd, monkeypatch) -> None:
    """A planted bug: the decode side admits the request as soon as it has the first line, before the
    KV's (the second line), so the engine decodes from pages the KV has not reached yet."""
    async def admit_early(state, room, req, answer, started, staging, sink, trace):
        state.bridge.withdraw(req.rid)
        state.bridge.submit_prefilled(req, sink, trace)
        try:
            await answer.line("done")
        finally:
            await answer.aclose()
        pd._release(state, req.rid, req.pages, staging, admitted=True)

    monkeypatch.setattr(pd, "_verify_then_admit", admit_early)


def first_token_twice(pd, monkeypatch) -> None:
    """A planted bug: the first token goes into the decode side's stream twice (as if both the early
    line and the KV's result carried it to the client)."""
    verify_then_admit = pd._verify_then_admit

    async def twice(state, room, req, answer, started, staging, sink, trace):
        items = [sink.get_nowait() for _ in range(sink.qsize())]  # the first token last, just put there
        for item in (*items, items[-1]):
            sink.put_nowait(item)
        await verify_then_admit(state, room, req, answer, started, staging, sink, trace)

    monkeypatch.setattr(pd, "_verify_then_admit", twice)


def tokens_while_the_write_is_held(pair, monkeypatch, payload: dict) -> tuple[int, StreamReader]:
    """The tokens a streamed client has received HOLD_S into a held KV write on the prefill side."""
    return tokens_while_held(pair, HeldWrite(pair.prefill_state.pd.transfer, monkeypatch), payload)


def first_token_violations(seen: int, reader: StreamReader, expected_tokens: int) -> list[str]:
    """What the first-token-before-the-write oracle finds wrong: exactly one token while the write is
    held (the first, and nothing decoded from a KV not yet there), then the colocated answer's count."""
    found = []
    if seen == 0:
        found.append("no first token while the KV write was held")
    if seen > 1:
        found.append(f"{seen} tokens while the KV write was held")
    if reader.errors or reader.tokens != expected_tokens:
        found.append(f"{reader.tokens} tokens (errors {reader.errors}), the colocated server sends {expected_tokens}")
    return found


PLANTED_FIRST_TOKEN = {  # planted bug -> what the oracle must say about it
    relay_after_the_write: "no first token while the KV write was held",
    admit_before_the_kv_landed: "tokens while the KV write was held",
    first_token_twice: "tokens while the KV write was held",
}


@pytest.mark.parametrize("planted", [None, *PLANTED_FIRST_TOKEN], ids=lambda f: "as_built" if f is None else f.__name__)
def test_the_first_token_reaches_the_client_before_the_kv_is_written(servers, monkeypatch, planted):
    """The prefill side's first token reaches the client before the KV write (relayed by the router, and
    in the first line of its /pd/transfer answer for the decode side): with the write held, the client
    already has its first token (and no second: the KV is not there yet); once released, the answer has
    the colocated server's tokens, and every page and slot comes back. Negative controls: the old order
    (the relay only after the write) shows nothing; a decode side admitting before the KV landed, or
    streaming the first token twice, shows more."""
    pair, colocated = servers
    payload = body(PROMPTS[1], stream=True)
    expected = len(answer(colocated, payload)["logprobs"])
    assert expected > 1
    if planted is not None:
        planted(pair.prefill_state.pd if planted is relay_after_the_write else pair.decode_state.pd,
                monkeypatch)
    seen, reader = tokens_while_the_write_is_held(pair, monkeypatch, payload)
    found = first_token_violations(seen, reader, expected)
    if planted is None:
        assert found == []
        assert answer(pair.router, payload) == answer(colocated, payload)
    else:
        assert any(PLANTED_FIRST_TOKEN[planted] in f for f in found), found
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
    assert wait_staging_free(pair.prefill_state, pair.decode_state) == [0, 0]


def test_a_kv_write_that_fails_after_the_first_token_ends_the_stream_with_its_error(servers, monkeypatch):
    """The first token is out when the prefill side's KV write fails: the stream ends with an
    OpenAI-shaped error after that one token (no token from a KV that never arrived), and every page
    and receive slot comes back on both sides."""
    pair, _ = servers
    write = HeldWrite(pair.prefill_state.pd.transfer, monkeypatch, fail=True)
    reader = StreamReader(pair.router, body(PROMPTS[1], stream=True))
    try:
        assert write.started.wait(30), "the prefill side never started the KV write"
        time.sleep(0.3)
    finally:
        write.release()
    reader.join()
    assert reader.tokens == 1 and reader.errors == ["pd_transfer_failed"] and reader.tokens_after_error == 0
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
    assert wait_staging_free(pair.prefill_state, pair.decode_state) == [0, 0]
    assert pair.prefill_state.pd.pending == {} and pair.prefill_state.pd.registry.open_rooms == 0


def test_a_client_gone_while_the_kv_is_checked_is_aborted_once_admitted(servers, monkeypatch):
    """The client leaves after its first token, while the digest computes: the bridge keeps its abort
    until the admission (the engine does not know the request before), so the request ends as an abort
    at once instead of decoding for nobody, and every page comes back on both sides. Negative control:
    a bridge that does not keep it (abort sent to an engine that drops it) lets the request finish."""
    pair, _ = servers
    state = pair.decode_state
    payload = body(PROMPTS[0], stream=True, max_tokens=300)

    def leave_after_the_first_token() -> float:
        aborts = sample(state, "dsv4_request_finish_total", reason="abort")
        digest = HeldDigest(monkeypatch)
        try:
            with httpx.stream("POST", f"{pair.router}/v1/chat/completions", json=payload, timeout=60) as reply:
                for line in reply.iter_lines():
                    if '"logprobs"' in line:
                        break  # the first token is here: leave
            assert digest.started.wait(30)
            time.sleep(0.5)  # the decode side sees the hang-up while the digest is held
        finally:
            digest.release()
        assert wait_pages_free(pair.prefill_state, state) == [0, 0]
        assert wait_staging_free(pair.prefill_state, state) == [0, 0]
        return sample(state, "dsv4_request_finish_total", reason="abort") - aborts

    assert leave_after_the_first_token() == 1
    monkeypatch.setattr(state.bridge, "announce_prefilled", lambda rid: None)
    assert leave_after_the_first_token() == 0


def corrupt_stream(pair, monkeypatch=None) -> dict:
    """A streamed request whose KV arrives corrupted: what its client received, and what is left."""
    corrupt = sample(pair.decode_state, "dsv4_pd_transfers_total", outcome="corrupt")
    reader = StreamReader(pair.router, body(PROMPTS[0], stream=True))
    reader.join()
    return {"tokens": reader.tokens, "errors": reader.errors, "tokens_after_error": reader.tokens_after_error,
            "corrupt_counted": sample(pair.decode_state, "dsv4_pd_transfers_total", outcome="corrupt") - corrupt,
            "decode_pages": wait_pages_free(pair.decode_state, timeout_s=5)[0],
            "decode_staging": wait_staging_free(pair.decode_state, timeout_s=5)[0],
            "prefill_pages": wait_pages_free(pair.prefill_state, timeout_s=5)[0]}


CORRUPT_STREAM = {"tokens": 1, "errors": ["pd_kv_corrupt"], "tokens_after_error": 0, "corrupt_counted": 1,
                  "decode_pages": 0, "decode_staging": 0, "prefill_pages": 0}


def test_kv_corrupt_in_a_stream_is_the_first_token_then_the_error_and_frees_pages(monkeypatch):
    """With pd-kv-corrupt a streamed client gets its first token (sent before the check), then the
    pd_kv_corrupt error inside the stream and never a second token; the transfer is counted corrupt
    and the decode side frees its pages and receive slot. A unary client still gets the 502. Negative
    controls, on the same pair: a decode side that skips the check streams every token and no error;
    with pd-abort-leak on the decode side its pages and slot stay held."""
    from runtime.disagg.decode import DecodeSide

    with pd_pair(prefill_args=("--inject-fault", "pd-kv-corrupt")) as pair:
        assert corrupt_stream(pair) == CORRUPT_STREAM
        reply = httpx.post(f"{pair.router}/v1/chat/completions", json=body(PROMPTS[0]), timeout=60)
        assert reply.status_code == 502 and reply.json()["error"]["code"] == "pd_kv_corrupt", reply.text

        async def unchecked(self, *args):
            return None

        monkeypatch.setattr(DecodeSide, "_check_kv", unchecked)
        skipped = corrupt_stream(pair)
        assert skipped["errors"] == [] and skipped["tokens"] > 1
    with pd_pair(prefill_args=("--inject-fault", "pd-kv-corrupt"),
                 decode_args=("--inject-fault", "pd-abort-leak")) as pair:
        monkeypatch.undo()
        leaked = corrupt_stream(pair)
        assert leaked["errors"] == ["pd_kv_corrupt"] and leaked["decode_pages"] > 0 and leaked["decode_staging"] > 0


# ---- a room given up while its KV write is in progress ---------------------------------------------------

def opened_rooms(registry, monkeypatch) -> dict[str, tuple[list[int], int | None]]:
    """The rooms the prefill side opens from now on: room id -> (the decode side's pages, its receive slot)."""
    rooms: dict[str, tuple[list[int], int | None]] = {}
    open_room = registry.open

    def recording(room, name, session_id, dst_pages, staging_offset=None):
        rooms[room] = (list(dst_pages), staging_offset)
        return open_room(room, name, session_id, dst_pages, staging_offset)

    monkeypatch.setattr(registry, "open", recording)
    return rooms


def give_up_during_the_write(write: HeldWrite, monkeypatch) -> None:
    """The decode side's next request fails between the answer's two lines (its first line turned into
    a request), once the prefill side's KV write into its room is in progress: it gives the room up."""
    from runtime.disagg import decode
    from runtime.server.errors import ApiError

    build = decode.prefilled_request

    def failing(*args, **kwargs):
        monkeypatch.setattr(decode, "prefilled_request", build)  # the next request is served
        assert write.started.wait(30), "the prefill side never started the KV write"
        raise ApiError(502, "planted: the decode side gives the room up", type="server_error", code="pd_planted")

    monkeypatch.setattr(decode, "prefilled_request", failing)


def free_at_once(pd, monkeypatch) -> None:
    """The planted old order: a given-up room's pages and slot go back as the decode side hangs up."""
    monkeypatch.setattr(pd, "_give_up", lambda state, rid, pages, staging, link, reason:
                        pd._release(state, rid, pages, staging, admitted=False))


def given_up_during_the_write_violations(pair, colocated, monkeypatch) -> list[str]:
    """What is wrong when the decode side gives a room up (an error between the answer's two lines)
    while the prefill side's KV write into it is in progress (held), and a request is served
    meanwhile: the given-up room's pages or receive slot back before the write ended, the later
    request given any of them (the arena is first fit: a slot freed at once is the next one's), a wrong
    answer; or, once the write ended, anything left on either side."""
    write = HeldWrite(pair.prefill_state.pd.transfer, monkeypatch, first_only=True)
    rooms = opened_rooms(pair.prefill_state.pd.registry, monkeypatch)
    give_up_during_the_write(write, monkeypatch)
    decode_state, found = pair.decode_state, []
    payload = body(PROMPTS[0])
    expected = answer(colocated, payload)
    try:
        reply = httpx.post(f"{pair.router}/v1/chat/completions", json=body(PROMPTS[1]), timeout=60)
        assert reply.status_code == 502 and reply.json()["error"]["code"] == "pd_planted", reply.text
        time.sleep(0.3)  # what the decode side frees at once is free by now
        (given_up, (pages, slot)), = rooms.items()
        held = (decode_state.engine.pages_in_use, decode_state.pd.transfer.staging.slots_in_use)
        if held != (len(pages), 1):
            found.append(f"pages and slots in use during the write {held}, the given-up room has {len(pages)}, 1")
        if answer(pair.router, payload) != expected:
            found.append("the request served during the write answered wrong")
        (later_pages, later_slot), = [v for room, v in rooms.items() if room != given_up]
        if set(later_pages) & set(pages) or later_slot == slot:
            found.append(f"the request served during the write got the given-up room's pages or slot ({later_slot})")
    finally:
        write.release()
    left = wait_pages_free(pair.prefill_state, decode_state) + wait_staging_free(pair.prefill_state, decode_state)
    wait_until(lambda: pair.prefill_state.pd.registry.open_rooms == 0 and not pair.prefill_state.pd.pending,
               what="the prefill side's rooms and requests to end")
    if left != [0, 0, 0, 0] or sample(decode_state, "dsv4_pd_quarantined_pages"):
        found.append(f"left once the write ended: pages, slots {left}")
    return found


@pytest.mark.parametrize("planted", [None, free_at_once], ids=["as_built", "free_at_once"])
def test_a_room_given_up_during_its_kv_write_keeps_its_pages_and_slot_until_the_write_ended(servers, monkeypatch,
                                                                                            planted):
    """The room's pages and receive slot stay reserved until the prefill side's write into them ended,
    so a request served meanwhile gets other pages and another slot and the colocated server's answer;
    then every page and slot is back on both sides, no room left open. Negative control: the old order
    (freed as the decode side hangs up: `free_at_once`, and main's code) fails the first check, (0, 0),
    and the later request gets the given-up slot."""
    pair, colocated = servers
    if planted is not None:
        planted(pair.decode_state.pd, monkeypatch)
    found = given_up_during_the_write_violations(pair, colocated, monkeypatch)
    if planted is None:
        assert found == []
    else:
        assert any("during the write (0, 0)" in f for f in found) and any("got the given-up" in f for f in found), found


def test_a_room_quarantined_by_a_slow_prefill_server_goes_back_once_a_retried_close_is_confirmed(servers,
                                                                                               monkeypatch):
    """The prefill server's KV write into a given-up room outlasts its close's wait (0.2 s here, the PD
    timeout in production): the close answers 504 and the decode side quarantines the room's pages and
    slot. Retried closes get 504 while the write runs; once it ended, a retry is confirmed by the real
    close route and every page and slot is back, the gauges at 0. Negative control: the old decode side
    kept them until a restart (`assert [0, 2] == [0, 0]`: the decode pages left after the write)."""
    from runtime.disagg import decode

    pair = servers[0]
    registry, decode_state = pair.prefill_state.pd.registry, pair.decode_state
    close_room = registry.close_room
    monkeypatch.setattr(registry, "close_room", lambda room, error, timeout_s: close_room(room, error, 0.2))
    monkeypatch.setattr(decode, "QUARANTINE_RETRY_FIRST_S", 0.1, raising=False)
    monkeypatch.setattr(decode, "QUARANTINE_RETRY_MAX_S", 0.2, raising=False)
    lifted = sample(decode_state, "dsv4_pd_quarantines_lifted_total", outcome="closed")
    write = HeldWrite(pair.prefill_state.pd.transfer, monkeypatch, first_only=True)
    rooms = opened_rooms(registry, monkeypatch)
    give_up_during_the_write(write, monkeypatch)
    try:
        reply = httpx.post(f"{pair.router}/v1/chat/completions", json=body(PROMPTS[1]), timeout=60)
        assert reply.status_code == 502 and reply.json()["error"]["code"] == "pd_planted", reply.text
        (pages, _), = rooms.values()
        wait_until(lambda: sample(decode_state, "dsv4_pd_quarantined_pages") == len(pages), what="the quarantine")
        time.sleep(0.5)  # closes retried while the write runs: answered 504
        assert (decode_state.engine.pages_in_use, decode_state.pd.transfer.staging.slots_in_use) == (len(pages), 1)
    finally:
        write.release()
    assert wait_pages_free(pair.prefill_state, decode_state) == [0, 0]
    assert wait_staging_free(pair.prefill_state, decode_state) == [0, 0]
    assert sample(decode_state, "dsv4_pd_quarantined_pages") == 0
    assert sample(decode_state, "dsv4_pd_quarantined_staging_slots") == 0
    assert sample(decode_state, "dsv4_pd_quarantines_lifted_total", outcome="closed") == lifted + 1


def prompt_tokens(url: str, prompt: str) -> int:
    reply = httpx.post(f"{url}/v1/chat/completions", json=body(prompt, max_tokens=1), timeout=60)
    assert reply.status_code == 200, reply.text
    return int(reply.json()["usage"]["prompt_tokens"])


def streamed(url: str, payload: dict, started) -> dict:
    """A streamed request's status, error code and answer (`answer`'s shape); `started` is set once
    its second token is in, or once it ended."""
    out: dict = {"status": None, "code": None, "answer": None}
    text, logprobs, finish = "", [], None
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, timeout=60) as reply:
            out["status"] = reply.status_code
            if reply.status_code != 200:
                out["code"] = json.loads(reply.read())["error"]["code"]
                return out
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["code"] = chunk["error"]["code"]
                    return out
                choice = chunk["choices"][0]
                text += choice["delta"].get("content", "")
                logprobs += (choice.get("logprobs") or {}).get("content") or []
                finish = choice["finish_reason"] or finish
                if len(logprobs) >= 2:
                    started.set()
        out["answer"] = {"text": text, "logprobs": logprobs, "finish": finish}
        return out
    finally:
        started.set()


@pytest.mark.parametrize("planted", [None, free_at_once], ids=["as_built", "free_at_once"])
def test_direct_mode_a_late_write_never_reaches_a_request_admitted_after_the_give_up(servers, monkeypatch, planted):
    """Direct transfer (host pools, pages written by id), a decode pool one page larger than the first
    prompt: a room is given up while its KV write is held, then a second prompt arrives and the write
    is released once that one is decoding. By the pool's size, it must be refused by name
    (pd_out_of_pages: the given-up room's pages are still reserved, as they must be while the write
    may land). Negative control: the old order (pages freed at once) gives the second prompt those
    pages, and the late write overwrites its KV after its check: a wrong answer, silently (on main's
    code, whose `fail` also blocked the prefill server's event loop for the held write, the second
    prompt timed out instead: pd_prefill_unreachable)."""
    import threading

    _, colocated = servers
    given_up, later = PROMPTS[3], "Tell me a story about a dragon and a knight, " * 2
    pages = -(-prompt_tokens(colocated, given_up) // 16) + 1
    later_tokens = prompt_tokens(colocated, later)
    assert later_tokens > 16, later_tokens  # two pages at least: more than the spare one
    payload = body(later, stream=True, max_tokens=pages * 16 - later_tokens - 1)
    expected = answer(colocated, payload)
    direct = ("--disaggregation-transfer", "direct")
    with pd_pair(prefill_args=direct, decode_args=(*direct, "--num-pages", str(pages))) as pair:
        write = HeldWrite(pair.prefill_state.pd.transfer, monkeypatch, first_only=True)
        give_up_during_the_write(write, monkeypatch)
        if planted is not None:
            planted(pair.decode_state.pd, monkeypatch)
        reply = httpx.post(f"{pair.router}/v1/chat/completions", json=body(given_up), timeout=60)
        assert reply.status_code == 502 and reply.json()["error"]["code"] == "pd_planted", reply.text
        time.sleep(0.3)  # what the decode side frees at once is free by now
        decoding, result = threading.Event(), {}
        reader = threading.Thread(target=lambda: result.update(streamed(pair.router, payload, decoding)))
        reader.start()
        try:
            assert decoding.wait(60)
        finally:
            write.release()
        reader.join(60)
        if planted is None:  # one page free, the second prompt needs two at least
            assert (result["status"], result["code"]) == (503, "pd_out_of_pages"), result
        else:  # served, no error anywhere, and wrong
            assert result["status"] == 200 and result["code"] is None and result["answer"] != expected, result
        assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
        assert answer(pair.router, payload) == expected  # the pool is whole again


class HeldFirstLine:
    """The prefill side's first token held on both its ways until `release()`: its first /pd/transfer line
    (the prompt's outcome, computed) and its relaying answer's first line to the router
    (runtime/disagg/protocol.py). `started` once a room's outcome is ready and held."""

    def __init__(self, pd, monkeypatch) -> None:
        import threading

        self.started, self._gate = threading.Event(), threading.Event()
        wait_first, relaying = pd.registry.wait_first, pd._relaying

        async def gate() -> None:
            while not self._gate.is_set():
                await asyncio.sleep(0.01)

        async def held(room, timeout_s):
            first = await wait_first(room, timeout_s)
            self.started.set()
            await gate()
            return first

        async def held_relay(*args):
            lines = relaying(*args)
            first = await anext(lines)
            await gate()
            yield first
            async for line in lines:
                yield line

        monkeypatch.setattr(pd.registry, "wait_first", held)
        monkeypatch.setattr(pd, "_relaying", held_relay)

    def release(self) -> None:
        self._gate.set()


def answer_with_the_first_token(pd, monkeypatch) -> None:
    """The planted old order (before the fortieth session): the decode side answers its caller only once the
    first token is on the request's sink, so the client's stream (headers included) waits for that token."""
    async def first_token_in(sink) -> None:
        while sink.qsize() < 2:  # Accepted, then the first token (or the error)
            await asyncio.sleep(0.001)

    answer_once(pd, monkeypatch, first_token_in)


@pytest.mark.parametrize("planted", [False, True], ids=["as_built", "answer_with_the_first_token"])
def test_a_streamed_clients_answer_opens_while_the_prompt_computes(servers, monkeypatch, planted):
    """The decode side opens its answer when the room opens, and the router the client's then: with the
    prefill side holding the prompt's first token, a streamed client already has the 200 and the headers
    (and no byte of the body: the opening chunk waits for the first token), so neither server's response
    start is on the first token's path. Released, the stream is the colocated server's answer. Negative
    control: a decode side answering only with the first token shows the client nothing while it is held."""
    import threading

    pair, colocated = servers
    payload = body(PROMPTS[1], stream=True)
    held = HeldFirstLine(pair.prefill_state.pd, monkeypatch)
    if planted:
        answer_with_the_first_token(pair.decode_state.pd, monkeypatch)
    opened, lines, statuses = threading.Event(), [], []

    def read() -> None:
        with httpx.stream("POST", f"{pair.router}/v1/chat/completions", json=payload, timeout=60) as reply:
            statuses.append(reply.status_code)
            opened.set()
            lines.extend(line for line in reply.iter_lines() if line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert held.started.wait(30), "no request's first line was held"
        open_while_held = opened.wait(HOLD_S)
        body_while_held = list(lines)
    finally:
        held.release()
    reader.join(60)
    assert open_while_held is not planted and body_while_held == []
    assert statuses == [200] and lines[-1] == "data: [DONE]"
    streamed = [json.loads(line[6:]) for line in lines[:-1]]
    assert all("error" not in chunk for chunk in streamed), streamed
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in streamed)
    assert text == answer(colocated, payload)["text"]
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
