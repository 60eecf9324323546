"""The declared-stream task API and its in-order executor.

Model code talks to a `StreamExecutor`:

    streams.fork("indexer")                      # side stream starts after main's work so far
    streams.submit(Task("indexer", "indexer", reads=("hidden",), writes=("selection",), fn=...))
    streams.join("indexer")                      # main waits for everything indexer did so far
    streams.submit(Task("attention", MAIN, reads=("selection",), writes=("attn_out",), fn=...))

With `record_program`, every call is also appended to `program`, a plain record that a static happens-before checker or
an adversarial executor can replay. The in-order executor runs each task when it is submitted,
which is what a single stream would do; events only matter for executors that reorder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

MAIN = "main"


@dataclass(frozen=True)
class Task:
    name: str
    stream: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    fn: Callable[[], None] = field(compare=False, repr=False)


@dataclass(frozen=True)
class Event:
    stream: str
    # How many tasks of `stream` this event covers (all tasks submitted to it before the record).
    covers: int


@dataclass(frozen=True)
class Wait:
    stream: str
    event: Event


Op = Task | Event | Wait


class StreamExecutor:
    """Base class: records the program; subclasses decide when tasks actually run."""

    def __init__(self, record_program: bool = False) -> None:
        self.record_program = record_program
        self.program: list[Op] = []
        self._submitted: dict[str, int] = {}

    def _log(self, op: Op) -> None:
        if self.record_program:
            self.program.append(op)

    def submit(self, task: Task) -> None:
        self._log(task)
        self._submitted[task.stream] = self._submitted.get(task.stream, 0) + 1
        self._on_submit(task)

    def record(self, stream: str) -> Event:
        event = Event(stream, self._submitted.get(stream, 0))
        self._log(event)
        return event

    def wait(self, stream: str, event: Event) -> None:
        wait = Wait(stream, event)
        self._log(wait)
        self._on_wait(wait)

    def fork(self, side: str) -> None:
        """`side` may start only after everything main has submitted so far."""
        self.wait(side, self.record(MAIN))

    def join(self, side: str) -> None:
        """Main continues only after everything `side` has submitted so far."""
        self.wait(MAIN, self.record(side))

    def synchronize(self) -> None:
        """End of a step: all streams drained (the host reads results after this)."""
        self._on_synchronize()

    def reset_program(self) -> None:
        self.program.clear()
        self._submitted.clear()

    def _on_submit(self, task: Task) -> None:
        raise NotImplementedError

    def _on_wait(self, wait: Wait) -> None:
        pass

    def _on_synchronize(self) -> None:
        pass


class InOrderExecutor(StreamExecutor):
    """Runs every task at submission: a valid schedule for any correct program."""

    def _on_submit(self, task: Task) -> None:
        task.fn()
