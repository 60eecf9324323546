"""Adversarial CPU stream emulator: side-stream tasks run as late as their declared dependencies
allow, or at seeded random valid points, so a missing join becomes a stale read on a plain CPU.

A GPU stream runs a task whenever the hardware gets to it: possibly long after the host enqueued
it, possibly right away. Host code on the main stream (everything the model does outside tasks)
runs at once, so main-stream tasks run at submission too, after draining whatever they wait on.
Side-stream tasks are queued and only run when
  - main waits on an event that covers them (a join), or the step ends (`synchronize`), or
  - in "random" mode, at any submit/record/wait, where a seeded coin runs a random ready prefix.
"Late" mode is the worst case for a missing join (the reader always sees the stale buffer);
"random" mode explores the orders in between and also catches a missing fork (a side task that
runs before the main-stream work it should have waited for).
"""

from __future__ import annotations

import random
from collections import deque

from runtime.streams.tasks import MAIN, StreamExecutor, Task, Wait

MODES = ("late", "random")


class AdversarialExecutor(StreamExecutor):
    def __init__(self, seed: int = 0, mode: str = "late", record_program: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        super().__init__(record_program)
        self.mode = mode
        self.rng = random.Random(seed)
        # Per side stream: queued (task, requirements) pairs; requirements = {stream: tasks that
        # must have run}, collected from the waits the stream saw before the task was submitted.
        self._queues: dict[str, deque[tuple[Task, dict[str, int]]]] = {}
        self._pending_waits: dict[str, dict[str, int]] = {}
        self._done: dict[str, int] = {}

    # ---- hooks of StreamExecutor ---------------------------------------------------------------
    def _on_submit(self, task: Task) -> None:
        if task.stream == MAIN:
            self._maybe_run_some()
            self._run(task)
            return
        needs = self._pending_waits.pop(task.stream, {})
        self._queues.setdefault(task.stream, deque()).append((task, needs))
        self._maybe_run_some()

    def _on_wait(self, wait: Wait) -> None:
        covers = wait.event.covers
        if wait.stream == MAIN:
            # The host continues after this point, so the covered work must have happened.
            self._drain(wait.event.stream, covers)
        else:
            needs = self._pending_waits.setdefault(wait.stream, {})
            needs[wait.event.stream] = max(needs.get(wait.event.stream, 0), covers)
        self._maybe_run_some()

    def _on_synchronize(self) -> None:
        for stream in list(self._queues):
            self._drain(stream, self._submitted.get(stream, 0))

    def reset_program(self) -> None:
        if any(self._queues.values()):
            raise RuntimeError("reset_program with side-stream tasks still queued (missing synchronize)")
        super().reset_program()
        self._done.clear()
        self._pending_waits.clear()

    # ---- scheduling ----------------------------------------------------------------------------
    def _run(self, task: Task) -> None:
        task.fn()
        self._done[task.stream] = self._done.get(task.stream, 0) + 1

    def _drain(self, stream: str, covers: int) -> None:
        """Run `stream`'s tasks until its first `covers` have run (their own waits first)."""
        if stream == MAIN:
            return  # main tasks ran at submission
        queue = self._queues.get(stream, deque())
        while self._done.get(stream, 0) < covers:
            task, needs = queue[0]
            for other, count in needs.items():
                self._drain(other, count)
            queue.popleft()
            self._run(task)

    def _ready(self, stream: str) -> bool:
        queue = self._queues.get(stream)
        if not queue:
            return False
        _, needs = queue[0]
        return all(self._done.get(s, 0) >= n for s, n in needs.items())

    def _maybe_run_some(self) -> None:
        if self.mode != "random":
            return
        while self.rng.random() < 0.5:
            ready = [s for s in sorted(self._queues) if self._ready(s)]
            if not ready:
                return
            stream = self.rng.choice(ready)
            task, _ = self._queues[stream].popleft()
            self._run(task)
