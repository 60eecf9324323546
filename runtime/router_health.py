"""The PD router's view of its upstreams' health: each server's /health polled in the background.

Without it the router learned that a server was down only from a client's request (which then
failed, or was retried at the cost of a decode call), its own /health proxied one decode server in
turn (so with one of two decode servers down a readiness probe read 200 and 502 on alternate polls),
and a server that came back was tried again only when a request happened to land on it. Now a server
whose /health does not answer 200 is passed over by new requests until a later poll sees it
healthy, and the router's /health says whether it can serve: at least one healthy server of each
role. A failure seen on the request path (refused, unreachable) still rests a server at once
(runtime/router.py's `UPSTREAM_REST_S`); the poll only adds what no request has seen yet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

# How often each upstream's /health is polled, and how long a poll may take. A restarted server is
# back in the rotation within about one period of answering; the chaos gate wants the pair serving
# within 10 s of a restart, and a poll costs each server one small GET a second.
HEALTH_EVERY_S = 1.0
HEALTH_TIMEOUT_S = 2.0

Check = Callable[[str], Awaitable[int]]  # url -> the HTTP status its /health answered (raises when unreachable)


@dataclass
class UpstreamState:
    role: str
    healthy: bool = True  # until a poll says otherwise: the router starts serving at once
    checked_at: float | None = None  # time.time() of the last poll's answer
    reason: str = "not polled yet"

    def describe(self) -> dict:
        return {"role": self.role, "healthy": self.healthy, "reason": self.reason, "checked_at": self.checked_at}


class UpstreamHealth:
    """Every upstream's last polled health. `poll_once` checks all of them at once; `run` polls
    forever every `every_s`; `healthy(url)` is what request routing reads. `every_s` None: no polls
    (every server counts as healthy; the request path's own retries alone, as tests of it want)."""

    def __init__(self, roles: dict[str, list[str]], every_s: float | None = HEALTH_EVERY_S,
                 timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        if (every_s is not None and not every_s > 0) or not timeout_s > 0:
            raise ValueError(f"health polling needs positive periods, got every {every_s} s, timeout {timeout_s} s")
        self.every_s, self.timeout_s = every_s, timeout_s
        self.upstreams = {url: UpstreamState(role) for role, urls in roles.items() for url in urls}

    def healthy(self, url: str) -> bool:
        return self.upstreams[url].healthy

    async def poll_once(self, check: Check) -> None:
        if self.every_s is None:
            return
        await asyncio.gather(*(self._poll(url, check) for url in self.upstreams))

    async def _poll(self, url: str, check: Check) -> None:
        state = self.upstreams[url]
        try:
            status = await asyncio.wait_for(check(url), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure to answer is "not healthy", with its cause named
            state.healthy, state.reason = False, f"unreachable: {type(exc).__name__}: {exc}"[:200]
        else:
            state.healthy, state.reason = status == 200, "ok" if status == 200 else f"/health answered {status}"
        state.checked_at = time.time()

    async def run(self, check: Check) -> None:
        """Poll every `every_s` until cancelled (the router's lifespan owns the task)."""
        every_s = self.every_s
        while every_s is not None:
            started = asyncio.get_running_loop().time()
            await self.poll_once(check)
            await asyncio.sleep(max(0.0, every_s - (asyncio.get_running_loop().time() - started)))

    def unservable(self) -> list[str]:
        """The roles with no healthy server (the router cannot serve while any is listed)."""
        roles = {state.role for state in self.upstreams.values()}
        return sorted(role for role in roles
                      if not any(s.healthy for s in self.upstreams.values() if s.role == role))

    def report(self) -> tuple[int, dict]:
        """The router's /health: 200 while every role has a healthy server, else 503 naming the roles."""
        missing = self.unservable()
        body = {"status": "ok" if not missing else f"no healthy {' or '.join(missing)} server",
                "upstreams": {url: state.describe() for url, state in self.upstreams.items()}}
        return (200 if not missing else 503), body

    def metric_lines(self) -> list[str]:
        """`dsv4_pd_upstream_up{role,url}` 1 / 0 per upstream, for the router's /metrics."""
        return ["# TYPE dsv4_pd_upstream_up gauge",
                *(f'dsv4_pd_upstream_up{{role="{s.role}",url="{url}"}} {int(s.healthy)}'
                  for url, s in self.upstreams.items())]
