"""Per-request phase timestamps: where one request's time goes, server by server (`bench/pd_ttft.py
--phases` reads them).

A client asks for a trace by sending `x-dsv4-trace: KEY`. Each server on the request's path (the
router, the prefill and decode servers, or the colocated server) then records `time.monotonic()` at
named marks and keeps the last TRACES_KEPT traces, read back at GET /debug/trace/KEY (the router's
answer holds its upstreams' too). A request without the header gets NO_TRACE, whose marks do
nothing: untraced requests pay a header lookup and a few no-op calls, none per token.

time.monotonic() reads CLOCK_MONOTONIC, one clock for every process of a host: the marks of servers
on one host can be subtracted from each other (and from the client's); across hosts they cannot.
"""

from __future__ import annotations

import ctypes
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

TRACE_HEADER = "x-dsv4-trace"
TRACES_KEPT = 256  # enough for a bench's run; an old trace is dropped, never a reason to grow
CPU_SUFFIX = "@cpu"  # a mark on its thread's CPU clock (`Trace.mark_cpu`), not on the monotonic one
PROCESS_CPU_SUFFIX = "@proc"  # the same, on the process's CPU clock (every thread of it)
ON_CPU_SUFFIX = "@on"  # the number of the CPU the marking thread ran on (Linux; absent elsewhere)


def _cpu_number_reader() -> Callable[[], int] | None:
    """glibc's sched_getcpu (a vDSO read, well under a microsecond), or None where there is none."""
    try:
        getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):
        return None
    getcpu.restype, getcpu.argtypes = ctypes.c_int, []
    return getcpu if getcpu() >= 0 else None


_current_cpu = _cpu_number_reader()


class Trace:
    """One request's marks on one server: name -> monotonic seconds, the first mark of a name kept
    (a phase starts once, though the code that marks it may run again)."""

    __slots__ = ("key", "marks")

    def __init__(self, key: str) -> None:
        self.key = key
        self.marks: dict[str, float] = {}

    def mark(self, name: str, at: float | None = None) -> None:
        # A plain dict write: the engine thread and worker threads mark too, the GIL keeps it whole.
        if name not in self.marks:
            self.marks[name] = time.monotonic() if at is None else at

    def mark_cpu(self, name: str) -> None:
        """Marks on CPU clocks: the calling thread's (`time.thread_time()`, kept as "NAME@cpu") and the
        whole process's (`time.process_time()`, "NAME@proc"); each compares only with its own kind,
        taken on the same thread. Beside the wall-clock marks of the same span they tell a phase that
        worked from one that waited, and what it waited for: a wait while the process's other threads
        ran is the GIL's; a wait while nothing here ran is a core's (or I/O). "NAME@on": the CPU the thread
        ran on, so a bench can tell two servers' spans that shared a physical core (SMT siblings) from
        spans that did not."""
        self.mark(f"{name}{CPU_SUFFIX}", time.thread_time())
        self.mark(f"{name}{PROCESS_CPU_SUFFIX}", time.process_time())
        if _current_cpu is not None:
            self.mark(f"{name}{ON_CPU_SUFFIX}", float(_current_cpu()))

    def headers(self) -> dict[str, str]:
        """What carries this trace to the next server on the request's path."""
        return {TRACE_HEADER: self.key}


class _NoTrace(Trace):
    def mark(self, name: str, at: float | None = None) -> None:
        pass

    def mark_cpu(self, name: str) -> None:
        pass

    def headers(self) -> dict[str, str]:
        return {}


NO_TRACE: Trace = _NoTrace("")


class TraceLog:
    """The traces one server keeps, by key; written on the server's event loop only."""

    def __init__(self, kept: int = TRACES_KEPT) -> None:
        self.kept = kept
        self._traces: OrderedDict[str, Trace] = OrderedDict()

    def start(self, headers: Mapping[str, str]) -> Trace:
        """The trace the request's headers ask for (the one already kept under its key, so a later
        call of the same request adds to it), or NO_TRACE."""
        key = headers.get(TRACE_HEADER)
        if not key:
            return NO_TRACE
        trace = self._traces.get(key)
        if trace is None:
            trace = self._traces[key] = Trace(key)
            while len(self._traces) > self.kept:
                self._traces.popitem(last=False)
        return trace

    def __len__(self) -> int:
        return len(self._traces)

    def marks(self, key: str) -> dict[str, float] | None:
        trace = self._traces.get(key)
        return None if trace is None else dict(trace.marks)
