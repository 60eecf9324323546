"""Run one long blocking harness call (a soak) under an overall deadline and a stall limit, so a
hang ends as a clear `HangError` naming the progress reached, never as an endless wait.

The call runs on a daemon worker thread that cannot be killed: on a `HangError` the caller must
tear down what the call is blocked on (the soak stops the server, which fails its requests).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar, cast

T = TypeVar("T")


class HangError(RuntimeError):
    pass


def run_with_watchdog(fn: Callable[[], T], *, deadline_s: float, stall_s: float, progress: Callable[[], int],
                      on_tick: Callable[[float], None] | None = None, tick_s: float = 30.0,
                      poll_s: float = 0.5) -> T:
    """Return `fn()` (or re-raise its exception). Raise `HangError` if it runs past `deadline_s`,
    or if `progress()` stays unchanged for `stall_s`. `on_tick(elapsed_s)` runs every `tick_s`."""
    result: dict[str, object] = {}

    def call() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread below
            result["error"] = exc

    worker = threading.Thread(target=call, name="watched-call", daemon=True)
    start = time.monotonic()
    worker.start()
    last_progress, last_change, next_tick = progress(), start, start + tick_s
    while True:
        worker.join(poll_s)
        if not worker.is_alive():
            break
        now = time.monotonic()
        current = progress()
        if current != last_progress:
            last_progress, last_change = current, now
        if now - start > deadline_s:
            raise HangError(f"not finished after the {deadline_s:.0f} s deadline (progress {current})")
        if now - last_change > stall_s:
            raise HangError(f"no progress for {stall_s:.0f} s: stuck at {current} after {now - start:.0f} s")
        if on_tick is not None and now >= next_tick:
            on_tick(now - start)
            next_tick += tick_s
    if "error" in result:
        raise cast(BaseException, result["error"])
    return cast(T, result["value"])
