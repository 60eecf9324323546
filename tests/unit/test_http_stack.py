"""The servers' event loop and HTTP parser (runtime/server/http_stack.py): named by both entrypoints, and what
/server_info reports of the loop tells uvloop from asyncio's own."""

from __future__ import annotations

import asyncio

import uvicorn
import uvloop

from runtime import router
from runtime.server.http_stack import HTTP, LOOP, event_loop_name


async def _name() -> str:
    return event_loop_name()


def _name_on(loop_factory) -> str:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_name())


def test_the_loop_name_tells_uvloop_from_asyncio():
    assert _name_on(uvloop.new_event_loop) == "uvloop"
    assert _name_on(asyncio.SelectorEventLoop) == "asyncio"


def test_uvicorn_resolves_the_named_loop_and_parser():
    config = uvicorn.Config(lambda *_: None, loop=LOOP, http=HTTP)
    config.load()  # imports the parser's protocol class: raises if httptools is missing
    assert config.get_loop_factory() is uvloop.new_event_loop
    assert config.http_protocol_class.__module__.endswith("httptools_impl")


def test_the_router_runs_on_them(monkeypatch):
    seen: dict = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: seen.update(kwargs))
    assert router.main(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", "0"]) == 0
    assert (seen.get("loop"), seen.get("http")) == ("uvloop", "httptools")
