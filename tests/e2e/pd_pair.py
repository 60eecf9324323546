"""A PD pair (prefill + decode + router) and a colocated server, each a uvicorn server on a thread of
the test process, built exactly as `python -m runtime.serve` / `python -m runtime.router` build them.
Two Mooncake engines in one process talk TCP over loopback as two processes would."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from canary.targets import free_port
from runtime.config import DEFAULT_MODEL
from tests.e2e.launch import serve_in_thread


def server_state(*args: str):
    from runtime.serve import build_state, parse_args

    return build_state(parse_args(["--model", DEFAULT_MODEL, *args]))


@contextmanager
def serve_state(state) -> Iterator[str]:
    from runtime.server.app import create_app
    from runtime.server.serving import before_stop_listening

    try:
        with serve_in_thread(create_app(state), before_stop_listening(state)) as url:
            yield url
    finally:
        state.engine.shutdown()


@dataclass
class PDPair:
    router: str
    prefill: str
    decode: str
    prefill_state: object
    decode_state: object


@contextmanager
def pd_pair(prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = (), decode_name: str = "decode-0",
            timeout_s: float = 20.0) -> Iterator[PDPair]:
    from runtime.router import create_router_app

    common = ("--disaggregation-timeout", str(timeout_s))
    with ExitStack() as stack:
        p_state = server_state("--disaggregation-mode", "prefill", *common, *prefill_args)
        prefill = stack.enter_context(serve_state(p_state))
        d_state = server_state("--disaggregation-mode", "decode", "--disaggregation-name", decode_name, *common,
                               *decode_args)
        decode = stack.enter_context(serve_state(d_state))
        router = stack.enter_context(serve_in_thread(create_router_app([prefill], [decode], timeout_s=60)))
        yield PDPair(router, prefill, decode, p_state, d_state)


__all__ = ["PDPair", "free_port", "pd_pair", "serve_state", "server_state"]
