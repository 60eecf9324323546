"""The event loop and HTTP/1.1 parser under every server of the runtime (`runtime.serve`, `runtime.router`):
uvloop and httptools, the pair uvicorn[standard] installs (SGLang's servers set uvloop too), in place of asyncio's
own loop and the pure-Python h11 parser.

Each request crosses more of these servers in a PD pair (client -> router -> prefill server, and the first token
back through the decode server and the router) than on a colocated server, so their per-hop cost is a larger share
of the pair's time to first token: on the 2-core CPU host the PD / colocated ratio at 8 words fell from a median of
1.26 to 1.20 over five alternating pairs, lower or level in each (docs/results.md, "Forty-first session").

Named, not left to uvicorn's "auto" (which takes them only when they import): a server whose install lacks them
fails at start with the ImportError, never runs quietly on the slower pair.
"""

from __future__ import annotations

import asyncio
from typing import Literal

LOOP: Literal["uvloop"] = "uvloop"  # uvicorn's `loop`
HTTP: Literal["httptools"] = "httptools"  # uvicorn's `http`


def event_loop_name() -> str:
    """The running loop's package ("uvloop", or "asyncio" for the standard library's): /server_info reports it."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]
