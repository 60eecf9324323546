"""Client-side pieces of the PD chaos checks (tests/stress/test_pd_chaos.py, the PD fault gate in
canary/faults/pd_gates.py): one chat request through the router, bounded and classified; the probe
that measures how soon a restarted pair serves again; the pages left on each side.

Every request has a deadline (a reply that takes longer is a `hang`, never waited out), and a
request that fails must say why in the OpenAI shape (`{"error": {"message", "type", "code"}}` as the
body, or as a `data:` chunk of a stream): anything else is `unnamed`, a defect of its own.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

OK, ABORTED, ERROR, UNNAMED, HANG = "ok", "aborted", "error", "unnamed", "hang"


@dataclass(frozen=True)
class Outcome:
    kind: str  # OK, ABORTED (the client left on purpose), ERROR (named), UNNAMED, HANG
    text: str = ""
    code: str | None = None  # the OpenAI error's code for ERROR
    detail: str = ""  # what went wrong, for failure lines
    started: float = 0.0  # time.monotonic() at send and at the last byte
    ended: float = 0.0


def error_code(body: object) -> str | None:
    """The code of an OpenAI-shaped error body, None when the body is not one."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not error.get("type"):
        return None
    code = error.get("code")
    return code if isinstance(code, str) and code else None


def chat(url: str, model: str, prompt: str, *, stream: bool, max_tokens: int = 24,
         abort_after: int | None = None, timeout_s: float = 90.0, headers: dict[str, str] | None = None) -> Outcome:
    """One greedy chat request to `url` (the router's, or a PD side's with the router's `headers`);
    `abort_after` N: a stream the client closes after N content chunks; 0: as soon as its headers are in (the
    router opens a stream when the decode side has opened the room, so this abort lands while the prompt
    computes or its KV is in flight)."""
    payload = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
               "temperature": 0, "stream": stream}
    started = time.monotonic()

    def done(kind: str, text: str = "", code: str | None = None, detail: str = "") -> Outcome:
        ended = time.monotonic()
        if kind in (OK, ERROR, UNNAMED) and ended - started > timeout_s:
            kind, detail = HANG, f"answered after {ended - started:.0f} s (bound {timeout_s:g} s)"
        return Outcome(kind, text, code, detail, started, ended)

    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, headers=headers,
                          timeout=httpx.Timeout(timeout_s, connect=5.0)) as reply:
            if reply.status_code != 200:
                raw = reply.read()
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                code = error_code(body)
                return done(ERROR if code else UNNAMED, code=code, detail=f"HTTP {reply.status_code}: {raw[:200]!r}")
            if not stream:
                choice = json.loads(reply.read())["choices"][0]
                return done(OK, choice["message"]["content"] or "")
            if abort_after == 0:
                return done(ABORTED)
            text, chunks = "", 0
            for line in reply.iter_lines():
                if line == "data: [DONE]":
                    return done(OK, text)
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    code = error_code(chunk)
                    return done(ERROR if code else UNNAMED, text, code, f"in-stream: {line[:200]}")
                text += chunk["choices"][0]["delta"].get("content") or ""
                chunks += 1
                if abort_after is not None and chunks >= abort_after:
                    return done(ABORTED, text)
            return done(UNNAMED, text, detail="the stream ended without [DONE] or an error")
    except httpx.TimeoutException as exc:
        return done(HANG, detail=f"no answer within {timeout_s:g} s: {exc!r}")
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        return done(UNNAMED, detail=f"{type(exc).__name__}: {exc}")


def seconds_until_serving(router: str, model: str, prompt: str, within_s: float = 10.0,
                          pause_s: float = 0.2) -> tuple[float | None, Outcome]:
    """Probe the pair with small requests until one succeeds: the seconds from this call to that
    success (None when none did within `within_s`) and the last probe's outcome."""
    started = time.monotonic()
    while True:
        left = within_s - (time.monotonic() - started)
        out = chat(router, model, prompt, stream=False, max_tokens=4, timeout_s=max(left, 2.0))
        if out.kind == OK and out.ended - started <= within_s:
            return out.ended - started, out
        if time.monotonic() - started >= within_s:
            return None, out
        time.sleep(pause_s)


def pages_left(root_url: str, timeout_s: float = 15.0) -> dict[str, float | None]:
    """KV pages in use, pages reserved for transfers and staging slots held (staged transfer mode) on
    one PD server once its work has drained (all 0 when nothing leaked); None where the server has no
    such gauge or is unreachable."""
    from canary.targets import Target

    target = Target(root_url, root_url + "/v1", "", True)
    return {"kv_pages_in_use": target.wait_kv_pages_idle(timeout_s),
            "pd_pages_in_flight": target.metric("dsv4_pd_pages_in_flight"),
            "pd_staging_slots_in_use": target.metric("dsv4_pd_staging_slots_in_use")}
