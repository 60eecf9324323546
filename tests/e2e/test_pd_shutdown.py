"""A decode server shut down while a PD request's KV check is pending gives back every page and
staging slot it reserved for that request: the check held computing, or queued behind busy digest
threads and not yet started. The client left after its first token, so nothing keeps the server
from stopping (uvicorn waits only for open connections) while the check is still pending."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import pytest

from runtime.disagg.transfer import unavailable_reason
from runtime.router import create_router_app
from tests.e2e.launch import serve_in_thread
from tests.e2e.pd_pair import serve_state, server_state
from tests.e2e.test_pd import PROMPTS, HeldDigest, body

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def first_token_then_leave(router: str) -> None:
    payload = body(PROMPTS[0], stream=True, max_tokens=300)
    with httpx.stream("POST", f"{router}/v1/chat/completions", json=payload, timeout=60) as reply:
        for line in reply.iter_lines():
            if '"logprobs"' in line:
                return  # the first token is here: leave


def occupy_digest_threads(pd) -> threading.Event:
    """The decode side's digest threads, one of them, kept busy until the returned event is set: a
    check submitted meanwhile stays queued, not started."""
    busy, release = threading.Event(), threading.Event()
    pd._digests.shutdown(wait=False)
    pd._digests = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-digest")

    def hold() -> None:
        busy.set()
        release.wait(30)

    pd._digests.submit(hold)
    assert busy.wait(10)
    return release


@pytest.mark.parametrize("phase", ["digest-computing", "digest-queued"])
def test_a_decode_server_shut_down_during_the_kv_check_frees_every_page_and_slot(phase, monkeypatch):
    """Everything is back once the server has stopped (before the held digest is let go). The old code
    left the request's pages held: its check's frees went to an engine thread that had stopped."""
    common = ("--disaggregation-timeout", "20")
    decode_state = server_state("--disaggregation-mode", "decode", *common)
    pool, arena = decode_state.engine.pool, decode_state.pd.transfer.staging
    initial = pool.free_pages
    digest = HeldDigest(monkeypatch)
    release_queue = occupy_digest_threads(decode_state.pd) if phase == "digest-queued" else None
    with ExitStack() as stack:
        prefill = stack.enter_context(serve_state(server_state("--disaggregation-mode", "prefill", *common)))
        decode_server = ExitStack()
        decode = decode_server.enter_context(serve_state(decode_state))
        router = stack.enter_context(serve_in_thread(create_router_app([prefill], [decode], timeout_s=60)))
        try:
            first_token_then_leave(router)
            if phase == "digest-computing":
                assert digest.started.wait(30), "the decode side never computed the KV digest"
            else:
                time.sleep(0.5)  # the check is queued behind the busy digest thread
                assert not digest.started.is_set()
            assert pool.free_pages < initial and arena.slots_in_use == 1  # the check holds both
            decode_server.close()  # the server stops (lifespan included) with the check pending
            freed = (pool.free_pages, arena.slots_in_use)  # its engine thread is gone: safe to read here
        finally:
            digest.release()
            if release_queue is not None:
                release_queue.set()
            decode_server.close()
    assert freed == (initial, 0)


@pytest.mark.parametrize("planted", [None, "no_drain"], ids=["as_built", "stops_listening_at_once"])
def test_a_prefill_server_shut_down_during_a_kv_write_stops_listening_only_once_it_ended(planted, monkeypatch):
    """A prefill server is shut down (gracefully) while its KV write into a room is in progress, and the
    decode side then gives that room up: its close must not find the server gone while the write still
    runs, or it frees the room's pages after the settle delay and the write lands in another request's
    KV. As built the server drains first (runtime/disagg/bootstrap.py `drain`): the pages stay held
    until the write ended, then all come back. Negative control: a server that stops listening at once
    (the old shutdown) lets the decode side free them while the write is held."""
    from runtime.disagg import decode as decode_module
    from runtime.server import serving as serving_module
    from runtime.server.errors import ApiError
    from tests.e2e.test_pd import HeldWrite, wait_pages_free, wait_until

    common = ("--disaggregation-timeout", "20")
    prefill_state = server_state("--disaggregation-mode", "prefill", *common)
    decode_state = server_state("--disaggregation-mode", "decode", *common)
    monkeypatch.setattr(serving_module, "GRACEFUL_SHUTDOWN_S", 0.2)  # the drain's wait (prefill `drain`)
    if planted == "no_drain":
        async def no_drain() -> None:
            return None

        monkeypatch.setattr(prefill_state.pd, "drain", no_drain)
    write = HeldWrite(prefill_state.pd.transfer, monkeypatch, first_only=True)
    shutting_down, gave_up = threading.Event(), threading.Event()
    build = decode_module.prefilled_request
    port = 0  # the prefill server's, once it serves

    def stopping_or_refusing() -> bool:
        """The prefill server has begun its shutdown: it drains (as built) or refuses connections (the
        old order). Under load uvicorn notices its exit flag a while after it was set."""
        if prefill_state.pd.registry.stopping:
            return True
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return False
        except OSError:
            return True

    def give_up_once_the_prefill_server_is_stopping(*args, **kwargs):
        monkeypatch.setattr(decode_module, "prefilled_request", build)
        assert write.started.wait(30) and shutting_down.wait(30)
        wait_until(stopping_or_refusing, what="the prefill server's shutdown")
        gave_up.set()
        raise ApiError(502, "planted: the decode side gives the room up", type="server_error", code="pd_planted")

    monkeypatch.setattr(decode_module, "prefilled_request", give_up_once_the_prefill_server_is_stopping)
    with ExitStack() as stack:
        prefill_server = ExitStack()
        prefill = prefill_server.enter_context(serve_state(prefill_state))
        port = httpx.URL(prefill).port
        decode = stack.enter_context(serve_state(decode_state))
        router = stack.enter_context(serve_in_thread(create_router_app([prefill], [decode], timeout_s=60)))
        client = threading.Thread(target=lambda: httpx.post(f"{router}/v1/chat/completions",
                                                            json=body(PROMPTS[0]), timeout=60), daemon=True)
        stopper = threading.Thread(target=prefill_server.close, daemon=True)
        try:
            client.start()
            assert write.started.wait(30), "the prefill side never started the KV write"
            stopper.start()
            shutting_down.set()
            assert gave_up.wait(30), "the decode side never gave the room up"
            time.sleep(1.0)  # its close: answered once the write ended (as built), or refused + 0.5 s settle
            during = decode_state.engine.pages_in_use  # the given-up room's pages, while the write is held
            # A request arriving meanwhile: refused by name while the server drains (the old one had
            # stopped listening: the router could not reach it).
            late = httpx.post(f"{router}/v1/chat/completions", json=body(PROMPTS[1]), timeout=30)
            try:  # and its /health says so, for the routers' polls (runtime/router_health.py)
                health = httpx.get(f"{prefill}/health", timeout=5)
                health_seen: tuple[int, str] | str = (health.status_code, health.json()["status"])
            except httpx.HTTPError as exc:
                health_seen = repr(exc)
        finally:
            write.release()
            shutting_down.set()
        client.join(30)
        stopper.join(30)
        after = wait_pages_free(decode_state)
    late_error = (late.status_code, late.json()["error"]["code"])
    if planted is None:
        assert during > 0 and after == [0], (during, after)
        assert late_error == (503, "pd_prefill_stopping"), late.text
        assert health_seen == (503, "draining"), health_seen
    else:
        assert during == 0, during
        assert late_error != (503, "pd_prefill_stopping"), late.text


def ask_in_turn(router: str, turns: range) -> list[tuple[int, str]]:
    """One request after another through `router`, turn i asking the canary prompt i % 3: (status, the
    answer's text or the error's code) each."""
    from tests.e2e.test_pd import PROMPTS

    replies = []
    for i in turns:
        reply = httpx.post(f"{router}/v1/chat/completions", json=body(PROMPTS[i % 3], max_tokens=8), timeout=60)
        replies.append((reply.status_code, reply.json()["choices"][0]["message"]["content"]
                        if reply.status_code == 200 else reply.json()["error"]["code"]))
    return replies


@pytest.mark.parametrize("tries", [None, 1], ids=["as_built", "router_without_retry"])
def test_one_of_two_prefill_servers_stopped_under_load_costs_no_request(tries, monkeypatch):
    """A rolling restart's first half: requests keep coming through the router while one of its two
    prefill servers is stopped (gracefully). The stopping server finishes what it took, refuses the rest
    by name while it drains, then nothing listens; the router offers each request it refused to the
    other server. Every request is answered, each the same text as the first answer to its prompt, and
    no page is left in use. Negative control: a router that offers a request to one prefill server only
    (`MAX_PREFILL_TRIES` = 1) answers some of them with the stopping server's error."""
    import runtime.router as router_module
    from tests.e2e.test_pd import wait_pages_free

    if tries is not None:
        monkeypatch.setattr(router_module, "MAX_PREFILL_TRIES", tries)
    common = ("--disaggregation-timeout", "20")
    prefill_states = [server_state("--disaggregation-mode", "prefill", *common) for _ in range(2)]
    decode_state = server_state("--disaggregation-mode", "decode", *common)
    replies: list[tuple[int, str]] = []
    with ExitStack() as stack:
        stopping = ExitStack()
        prefills = [stopping.enter_context(serve_state(prefill_states[0])),
                    stack.enter_context(serve_state(prefill_states[1]))]
        decode = stack.enter_context(serve_state(decode_state))
        # No health polls: the test is of the request path's retries (a poll would pass the stopped server
        # over within a second, and the control's failures would depend on when it ran).
        router = stack.enter_context(serve_in_thread(create_router_app(prefills, [decode], timeout_s=60,
                                                                       health_every_s=None)))

        replies += ask_in_turn(router, range(6))
        stopper = threading.Thread(target=stopping.close, daemon=True)
        stopper.start()  # the drain, then the sockets closed, then its engine stopped
        replies += ask_in_turn(router, range(6, 24))
        stopper.join(30)
        left = wait_pages_free(prefill_states[1], decode_state)
    failed = [(i, r) for i, r in enumerate(replies) if r[0] != 200]
    if tries is None:
        assert failed == [] and left == [0, 0], (failed, left)
        assert all(replies[i][1] == replies[i % 3][1] for i in range(len(replies))), replies
    else:
        assert failed, replies


@pytest.mark.parametrize("tries", [None, 1], ids=["as_built", "router_without_retry"])
def test_one_of_two_decode_servers_stopped_costs_no_request(tries, monkeypatch):
    """With one of its two decode servers stopped, the router hands each room it sends there to the other
    (nothing listened, so no room was opened; the prompt's call stands). Every request is answered with
    the text the pair gave before, and no page is left in use. Negative control: a router that offers a
    room to one decode server only (`MAX_DECODE_TRIES` = 1) answers some requests 502."""
    import runtime.router as router_module
    from tests.e2e.test_pd import wait_pages_free

    if tries is not None:
        monkeypatch.setattr(router_module, "MAX_DECODE_TRIES", tries)
    common = ("--disaggregation-timeout", "20")
    prefill_state = server_state("--disaggregation-mode", "prefill", *common)
    decode_states = [server_state("--disaggregation-mode", "decode", "--disaggregation-name", f"decode-{i}", *common)
                     for i in range(2)]
    replies: list[tuple[int, str]] = []
    with ExitStack() as stack:
        stopping = ExitStack()
        prefill = stack.enter_context(serve_state(prefill_state))
        decodes = [stopping.enter_context(serve_state(decode_states[0])),
                   stack.enter_context(serve_state(decode_states[1]))]
        router = stack.enter_context(serve_in_thread(create_router_app([prefill], decodes, timeout_s=60,
                                                                       health_every_s=None)))  # as above

        replies += ask_in_turn(router, range(6))
        stopping.close()
        replies += ask_in_turn(router, range(6, 18))
        left = wait_pages_free(prefill_state, decode_states[1])
    failed = [(i, r) for i, r in enumerate(replies) if r[0] != 200]
    if tries is None:
        assert failed == [] and left == [0, 0], (failed, left)
        assert all(replies[i][1] == replies[i % 3][1] for i in range(len(replies))), replies
    else:
        assert failed and all(r == (502, "pd_upstream_unreachable") for _, r in failed), failed
