"""The `slow-step` fault's delay: a known slowdown of every engine step, the perf gate's control.

Its size is either fixed (`DSV4_SLOW_STEP_MS`, default 50 ms: far beyond any tolerance) or a
percentage of the step's own time (`DSV4_SLOW_STEP_PCT`, e.g. 10: the server ~10% slower at every
batch size, on a fast GPU and a slow CPU alike), which is what measuring a verdict's catch rate needs.

The percentage is spent as a busy-wait on the host, not a sleep: a sleeping engine thread on an
oversubscribed CPU waits for its core far longer than it asked (a 10% sleep measured +25% on the
loaded 2-core machine), while a real regression is more work, which keeps the core. On a GPU the
delay is spent twice at once: the host waits and the device busy-waits (`torch.cuda._sleep`) for
the same time. The overlap loop hides host time whenever the GPU is the bottleneck and device time
whenever the host is; with both, the step period grows by the delay in either regime, instead of by
nothing.
"""

from __future__ import annotations

import time

import torch


class SlowStep:
    def __init__(self, ms: float, pct: float, device: str) -> None:
        if ms < 0 or pct < 0:
            raise ValueError(f"slow-step size must be >= 0, got {ms} ms, {pct}%")
        self.ms, self.pct = ms, pct
        self.cuda = device.startswith("cuda")
        self._cycles_per_s: float | None = None

    def seconds(self, step_s: float) -> float:
        """The delay for a step that took `step_s` (a percentage of it when one is set)."""
        return self.pct / 100 * step_s if self.pct > 0 else self.ms / 1000

    def delay(self, step_s: float) -> None:
        seconds = self.seconds(step_s)
        if self.cuda and seconds > 0:
            torch.cuda._sleep(int(seconds * self.cycles_per_second()))
        if self.pct > 0:
            until = time.perf_counter() + seconds
            while time.perf_counter() < until:
                pass
        else:
            time.sleep(seconds)

    def cycles_per_second(self) -> float:
        """GPU busy-wait cycles per second, measured once (the clock is not in device properties)."""
        if self._cycles_per_s is None:
            cycles = 10_000_000
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self._cycles_per_s = cycles / (start.elapsed_time(end) / 1000)
        return self._cycles_per_s
