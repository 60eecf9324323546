"""Static happens-before check over a recorded stream program (`StreamExecutor.program`).

Proves, without running anything, that every read of a buffer is ordered after the task that
wrote it, that no write races an earlier read or write on another stream, and that every side
stream is joined back into main before the program ends (a CUDA-graph capture must end joined).

Ordering is tracked with vector clocks: `clock[s][t]` = how many tasks of stream t are known to
have completed before the next op on stream s. A task's own stream orders it after that stream's
earlier tasks; `Wait(s, e)` merges the clock `e`'s stream had when `e` was recorded. Buffers with
no write in the program are inputs from before it and need no ordering.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.streams.tasks import MAIN, Event, Op, Task, Wait


@dataclass(frozen=True)
class Hazard:
    kind: str  # "read-after-write", "write-after-read", "write-after-write", "unjoined"
    buffer: str
    first: str  # the earlier task (or the side stream, for "unjoined")
    second: str  # the later task that is not ordered after it (or "end of program")

    def __str__(self) -> str:
        return f"{self.kind} on {self.buffer!r}: {self.second} is not ordered after {self.first}"


@dataclass(frozen=True)
class _Access:
    task: str
    stream: str
    index: int  # position of the task on its stream (0-based)


class HappensBeforeError(AssertionError):
    pass


def find_hazards(program: list[Op]) -> list[Hazard]:
    clocks: dict[str, dict[str, int]] = {}
    snapshots: dict[int, dict[str, int]] = {}  # id(Event) -> clock of its stream at record time
    last_write: dict[str, _Access] = {}
    reads_since_write: dict[str, list[_Access]] = {}
    hazards: list[Hazard] = []

    def ordered(clock: dict[str, int], earlier: _Access) -> bool:
        return clock.get(earlier.stream, 0) > earlier.index

    for op in program:
        if isinstance(op, Event):
            snapshots[id(op)] = dict(clocks.get(op.stream, {}))
        elif isinstance(op, Wait):
            clock = clocks.setdefault(op.stream, {})
            for stream, count in snapshots[id(op.event)].items():
                clock[stream] = max(clock.get(stream, 0), count)
        elif isinstance(op, Task):
            clock = clocks.setdefault(op.stream, {})
            me = _Access(op.name, op.stream, clock.get(op.stream, 0))
            for buf in op.reads:
                writer = last_write.get(buf)
                if writer is not None and not ordered(clock, writer):
                    hazards.append(Hazard("read-after-write", buf, writer.task, op.name))
            for buf in op.writes:
                writer = last_write.get(buf)
                if writer is not None and not ordered(clock, writer):
                    hazards.append(Hazard("write-after-write", buf, writer.task, op.name))
                for reader in reads_since_write.get(buf, []):
                    if reader.task != op.name and not ordered(clock, reader):
                        hazards.append(Hazard("write-after-read", buf, reader.task, op.name))
            for buf in op.reads:
                reads_since_write.setdefault(buf, []).append(me)
            for buf in op.writes:
                last_write[buf] = me
                reads_since_write[buf] = []
            clock[op.stream] = me.index + 1
        else:
            raise TypeError(f"not a stream program op: {op!r}")

    main_clock = clocks.get(MAIN, {})
    for stream, clock in sorted(clocks.items()):
        if stream != MAIN and main_clock.get(stream, 0) < clock.get(stream, 0):
            hazards.append(Hazard("unjoined", "*", f"stream {stream!r}", "end of program"))
    return hazards


def check_program(program: list[Op]) -> None:
    """Raise `HappensBeforeError` listing every hazard; silent for a correctly ordered program."""
    hazards = find_hazards(program)
    if hazards:
        raise HappensBeforeError("stream program is not race-free:\n  " + "\n  ".join(map(str, hazards)))
